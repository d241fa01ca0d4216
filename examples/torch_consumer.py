"""Frames from another process as torch tensors, zero-copy.

    python examples/torch_consumer.py --device 0       # GPU link: tensors on cuda:0
    python examples/torch_consumer.py --device cpu     # host link: CPU tensors

A spawned child publishes a test pattern; this process receives each frame and wraps it with
torch.from_dlpack(frame): no copy, and on the GPU torch's current stream waits for the producer's
copy without blocking the CPU. Each tensor's sum is checked against the checksum sent in frame.meta.
"""

from __future__ import annotations

from _demo_producer import (
    META,
    Tally,
    example_args,
    finish_args,
    other_side,
    require_device,
    skip,
    spawn_producer,
    torch_cuda_problem,
)

import cudalink

WHO = "torch_consumer"


def main() -> int:
    args = finish_args(example_args(WHO, __doc__).parse_args(), WHO)
    try:
        import torch
    except ImportError:
        skip(WHO, "torch is not installed (pip install torch); numpy works too, see walkthrough.ipynb")
    problem = torch_cuda_problem(torch) if args.device != "cpu" else None
    if problem:
        skip(WHO, problem)
    require_device(args.device, WHO)

    producer = spawn_producer(args)
    tally = Tally(WHO, args.frames, args.device)
    with other_side(args), cudalink.Receiver(args.name, timeout=args.wait) as rx:
        for frame in rx:  # newest frame each time; ends when the producer closes (its death raises ProducerGone)
            with frame:
                t = torch.from_dlpack(frame)  # shares the producer's slot: no copy
                _, want = META.unpack(frame.meta)
                ok = int(t.sum()) & 0xFFFFFFFF == want  # int() waits for the GPU: fine for a check
                del t  # tensors hold the slot too; drop them so the producer can reuse it
            tally.add(frame, ok)
    return tally.finish(producer, f", torch {torch.__version__}")


if __name__ == "__main__":
    raise SystemExit(main())
