"""The StreamDiffusion-style loop: an app sends frames, a model transforms them, the result comes back.

    python examples/model_roundtrip.py --device 0 --frames 300     # torch on the GPU
    python examples/model_roundtrip.py --device cpu --model numpy  # no torch needed

    app (spawned child; TouchDesigner in real life)         model (this process)
      Sender   NAME-cam  ---- camera frames ---------->   Receiver NAME-cam
      Receiver NAME-out  <--- processed frames --------   Sender   NAME-out

The model reads each input zero-copy (torch.from_dlpack / frame.numpy()) and writes its output
straight into the next output slot with Sender.reserve(), so no frame is copied on either link. The
"model" is a 1x1 convolution that inverts the image and swaps RGB to BGR; the app checks every result
against a numpy reference. ``--role producer`` runs only the app, ``--role consumer`` only the model.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np
from _demo_producer import (
    META,
    checksum,
    device_label,
    example_args,
    finish_args,
    other_side,
    pattern,
    publish,
    require_device,
    skip,
    wait_for_consumers,
)

import cudalink

WHO = "model_roundtrip"


def reference(x: np.ndarray) -> np.ndarray:
    """What the model must return: the negative, with the channels reversed."""
    return 255 - x[..., ::-1]


def numpy_model() -> Any:
    def run(src: cudalink.Frame, dst: cudalink.Frame) -> None:
        np.subtract(255, src.numpy()[..., ::-1], out=dst.numpy())  # dst.numpy() is the slot, writable

    return run


def torch_model(device: str | int) -> Any:
    import torch

    conv = torch.nn.Conv2d(3, 3, kernel_size=1)
    with torch.no_grad():  # out[c] = 255 - in[2 - c]: exact in float32, so the app can compare bytes
        conv.weight.copy_(-torch.eye(3).flip(1).view(3, 3, 1, 1))
        conv.bias.fill_(255.0)
    conv = conv.to("cpu" if device == "cpu" else f"cuda:{device}")

    @torch.inference_mode()
    def run(src: cudalink.Frame, dst: cudalink.Frame) -> None:
        x = torch.from_dlpack(src).permute(2, 0, 1)[None].float()  # HWC uint8 -> NCHW float, reads the slot
        y = conv(x)[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8)
        torch.from_dlpack(dst).copy_(y)  # written in place, on torch's stream; the link orders the rest

    return run


def app(
    name: str, device: str | int, frames: int, fps: float, shape: tuple[int, ...], results: Any, wait: float = 30.0
) -> None:
    """Send frame k at ``fps``, wait for the model's answer to it, compare with :func:`reference`."""
    good, rtt_ms = 0, []
    with (
        cudalink.Sender(f"{name}-cam", shape=shape, device=device, pixel_format="RGB") as cam,
        cudalink.Receiver(f"{name}-out", timeout=wait) as out,
    ):
        wait_for_consumers(cam, 1, wait)  # the model must be listening before frame 0
        tick = time.monotonic()
        for k in range(frames):
            host = pattern(k, shape)
            t0 = time.perf_counter()
            publish(cam, host, META.pack(k, checksum(host)))
            with out.recv(timeout=10) as res:
                result = res.to_numpy()  # a host copy, only to check it
                rtt_ms.append((time.perf_counter() - t0) * 1e3)
                good += META.unpack(res.meta)[0] == k and np.array_equal(result, reference(host))
            tick += 1.0 / fps if fps > 0 else 0.0
            time.sleep(max(0.0, tick - time.monotonic()))
    if results is not None:
        results.put((good, statistics.median(rtt_ms) if rtt_ms else float("nan")))
    else:
        print(f"app: {good}/{frames} results match the reference")


def serve(name: str, device: str | int, shape: tuple[int, ...], model: Any, wait: float = 30.0) -> int:
    """The model process: NAME-cam in, NAME-out back, until the app closes its Sender."""
    n = 0
    with (
        cudalink.Sender(f"{name}-out", shape=shape, device=device, pixel_format="RGB", policy="block") as out,
        cudalink.Receiver(f"{name}-cam", timeout=wait) as cam,
    ):
        for frame in cam:
            with frame, out.reserve(meta=frame.meta) as dst:  # dst is published when the block ends
                model(frame, dst)
            n += 1
    return n


def main() -> int:
    p = example_args(WHO, __doc__)
    p.add_argument("--model", choices=("auto", "torch", "numpy"), default="auto", help="auto: torch if there")
    args = finish_args(p.parse_args(), WHO)
    require_device(args.device, WHO)  # before anything touches the GPU: no GPU is a skip (exit 2), not a crash
    if args.role == "producer":
        with other_side(args):
            app(args.name, args.device, args.frames, args.fps, args.shape, None, args.wait)
        return 0
    kind = args.model
    if kind == "auto":
        try:
            import torch  # noqa: F401

            kind = "torch"
        except ImportError:
            kind = "numpy"
    if kind == "torch":
        try:
            model = torch_model(args.device)
        except ImportError:
            skip(WHO, "--model torch needs torch (pip install torch), or use --model numpy on cpu")
    elif args.device != "cpu":
        skip(WHO, "on the GPU the model needs torch (pip install torch); --model numpy runs on --device cpu")
    else:
        model = numpy_model()

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    child = None
    if args.role == "both":  # the app's Receiver waits for NAME-out, which serve() creates
        app_args = (args.name, args.device, args.frames, args.fps, args.shape, results, args.wait)
        child = ctx.Process(target=app, args=app_args)
        child.start()
    with other_side(args):
        n = serve(args.name, args.device, args.shape, model, args.wait)
    if child is None:
        print(f"{WHO}: served {n} frames")
        return 0
    child.join(30)
    good, rtt = results.get() if not results.empty() else (0, float("nan"))
    ok = child.exitcode == 0 and good == args.frames
    status = "OK" if ok else f"FAIL (app exit code {child.exitcode}),"
    where = device_label(args.device)
    print(
        f"{WHO}: {status} {good}/{args.frames} results matched the reference, model={kind} "
        f"on {where}, {n} frames served, median round trip {rtt:.2f} ms",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
