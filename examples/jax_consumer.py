"""Frames from another process as jax arrays through DLPack.

    python examples/jax_consumer.py --device 0      # GPU link: arrays on the GPU, zero-copy
    python examples/jax_consumer.py --device cpu    # host link: jax CPU arrays

A spawned child publishes a test pattern; this process wraps each frame with jax.dlpack.from_dlpack(frame)
and checks its sum against the checksum sent in frame.meta.
"""

from __future__ import annotations

import os

from _demo_producer import META, Tally, example_args, finish_args, other_side, require_device, skip, spawn_producer

import cudalink

WHO = "jax_consumer"


def main() -> int:
    args = finish_args(example_args(WHO, __doc__, device="0").parse_args(), WHO)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # else jax takes 75% of the GPU at start
    try:
        import jax
        import jax.dlpack
        import jax.numpy as jnp
    except ImportError:
        skip(WHO, "jax is not installed (pip install 'jax[cuda13]', or plain jax for --device cpu)")
    if args.device != "cpu":
        try:
            jax.devices("cuda")
        except RuntimeError:
            skip(WHO, "this jax has no CUDA backend; install jax[cuda13] or use --device cpu")
    require_device(args.device, WHO)

    checksum = jax.jit(lambda x: jnp.sum(x, dtype=jnp.uint32))  # uint32 wraps mod 2**32, like the meta
    producer = spawn_producer(args)
    tally = Tally(WHO, args.frames, args.device)
    with other_side(args), cudalink.Receiver(args.name, timeout=args.wait) as rx:
        for frame in rx:  # newest frame each time; the loop ends when the producer closes
            with frame:
                try:
                    x = jax.dlpack.from_dlpack(frame)  # zero-copy
                except BufferError:  # jax asks for legacy DLPack, which cannot mark a read-only host frame
                    x = jnp.asarray(frame)  # so CPU frames take one copy
                _, want = META.unpack(frame.meta)
                ok = int(checksum(x)) == want  # int() waits for the device: fine for a check
                del x  # arrays hold the slot too; drop them so the producer can reuse it
            tally.add(frame, ok)
    return tally.finish(producer, f", jax {jax.__version__} on {jax.default_backend()}")


if __name__ == "__main__":
    raise SystemExit(main())
