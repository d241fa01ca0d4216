"""Frames from another process as cupy arrays, zero-copy on the GPU.

    python examples/cupy_consumer.py --device 0

A spawned child publishes a test pattern into GPU slots; this process wraps each frame with
cupy.from_dlpack(frame): no copy, and cupy's current stream waits for the producer's copy on the GPU.
Each array's sum is checked against the checksum sent in frame.meta.
"""

from __future__ import annotations

from _demo_producer import META, Tally, example_args, finish_args, other_side, require_device, skip, spawn_producer

import cudalink

WHO = "cupy_consumer"


def main() -> int:
    args = finish_args(example_args(WHO, __doc__, device="0").parse_args(), WHO)
    if args.device == "cpu":  # before the import: without cupy it said "cupy is not installed" to --device cpu
        skip(WHO, "cupy reads GPU frames; run with --device 0 (CPU frames: see torch_consumer.py or numpy)")
    try:
        import cupy
    except ImportError:
        skip(WHO, "cupy is not installed (pip install cupy-cuda13x)")
    require_device(args.device, WHO)

    producer = spawn_producer(args)
    tally = Tally(WHO, args.frames, args.device)
    with cupy.cuda.Device(args.device), other_side(args), cudalink.Receiver(args.name, timeout=args.wait) as rx:
        for frame in rx:  # newest frame each time; the loop ends when the producer closes
            with frame:
                a = cupy.from_dlpack(frame)  # a view of the producer's slot
                _, want = META.unpack(frame.meta)
                ok = int(a.sum(dtype=cupy.uint64)) & 0xFFFFFFFF == want  # int() syncs: fine for a check
                del a  # arrays hold the slot too; drop them so the producer can reuse it
            tally.add(frame, ok)
    return tally.finish(producer, f", cupy {cupy.__version__}")


if __name__ == "__main__":
    raise SystemExit(main())
