"""ucx:// with GPUs (run on a GPU machine with ucxx installed: ``python -m pytest -m gpu tests/test_ucx_gpu.py -s``).

A GPU producer process, ``cudalink serve`` in another, and a consumer process per case, over loopback:
``UCX_TLS=tcp,cuda_copy`` (no ``cuda_ipc``) makes cudalink stage GPU frames through host memory, as across
hosts without RDMA; adding ``cuda_ipc`` lets UCX move the GPU memory itself. Every frame is checked through
torch or cupy (or, for a consumer without a GPU, numpy). The server runs with ``UCX_PROTO_INFO=y`` and the
test prints the protocol lines UCX chose, so the run shows which transports carried the frames.
"""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from .test_ucx import Proc, free_port, unique

pytestmark = pytest.mark.gpu

pytest.importorskip("ucxx", reason='ucxx is not installed: pip install "cudalink[ucx]"')


CASES = [
    (tls, device, lib, "auto", 0.0, "0", 100)
    for tls in ("tcp,cuda_copy", "tcp,cuda_copy,cuda_ipc")
    for device, lib in (("0", "torch"), ("0", "cupy"), ("cpu", "numpy"))
] + [
    ("tcp,cuda_copy,cuda_ipc", "0", "torch", "host", 0.0, "0", 100),
    ("tcp,cuda_copy,cuda_ipc", "0", "cupy", "host", 0.0, "0", 100),
    # a host producer's frames land on the consumer's GPU through its page-locked buffer
    ("tcp,cuda_copy,cuda_ipc", "0", "torch", "auto", 0.0, "cpu", 100),
    # the consumer holds the GIL 2 s after its first frame: dropped, it connects again and checks on
    ("tcp,cuda_copy,cuda_ipc", "0", "torch", "auto", 2.0, "0", 100),
    ("tcp,cuda_copy", "0", "cupy", "auto", 2.0, "0", 100),
    # the producer flat out: several GPU frames on their way at once (the server's copies, or its stages)
    ("tcp,cuda_copy,cuda_ipc", "0", "cupy", "auto", 0.0, "0", 0),
    ("tcp,cuda_copy,cuda_ipc", "0", "torch", "host", 0.0, "0", 0),
]


@pytest.mark.parametrize(("tls", "device", "lib", "stage", "stall", "producer", "fps"), CASES)
def test_gpu_producer_to_remote_consumer(
    tls: str, device: str, lib: str, stage: str, stall: float, producer: str, fps: int
) -> None:
    """GPU frames go as GPU memory where UCX moves it itself (``cuda_ipc`` on one host), else as host bytes
    staged by cudalink: ``UCX_TLS=tcp,cuda_copy`` as across hosts without RDMA, a consumer landing on the
    host, or ``stage="host"`` (``CUDALINK_UCX_STAGE``, given to server and consumer) forcing it.
    ``producer="cpu"``: host frames, which a GPU consumer lands through its page-locked buffer.
    ``stall``: the consumer holds the GIL that long after its first frame; the server drops it for silence
    (its GPU frame in flight included) and it connects again to the same GPU landing buffers, with no error.
    ``fps=0``: the producer flat out, so that the server has several GPU frames on their way at once."""
    if lib != "numpy":
        pytest.importorskip(lib)
    if producer != "cpu":
        pytest.importorskip("torch")  # the producer makes its frames with torch
    name = unique("g")
    env = {"UCX_TLS": tls, "CUDALINK_UCX_STAGE": stage}
    prod = Proc(
        [
            "-m",
            "tests._ucx_procs",
            "producer",
            name,
            "--frames",
            "1000000",
            "--fps",
            str(fps or 100_000),
            "--device",
            producer,
            "--shape",
            "1080,1920,4",
            "--slots",
            "4",
        ],
        **env,
    )
    prod.expect("ready", 60.0)
    port = free_port()
    srv = Proc(
        ["-m", "cudalink", "serve", name, "--listen", f"ucx://127.0.0.1:{port}", "-v"],
        UCX_PROTO_INFO="y",
        CUDALINK_DEBUG="1",
        **env,
    )
    try:
        srv.expect("cudalink: serving", 60.0)
        cons = Proc(
            [
                "-m",
                "tests._ucx_procs",
                "gpu-consumer",
                f"ucx://127.0.0.1:{port}/{name}",
                "--device",
                device,
                "--lib",
                lib,
                "--frames",
                "60",
                "--stall",
                str(stall),
                *(["--close"] if lib == "cupy" else []),  # the others exit with their Receiver open
            ],
            **env,
        )
        try:
            line = cons.expect("checked", 120.0)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- the server's log ---\n{''.join(srv.log[-60:])}") from None
        print(f"\n[{tls} -> {device}/{lib}] {line}")
        used = sorted({ln.strip() for ln in srv.log if "cuda" in ln.lower() or "tcp" in ln.lower()})
        print("UCX protocols on the server:\n  " + "\n  ".join(used[:30]))
        assert " bad 0 " in line, line
        gpu_path = "cuda_ipc" in tls.split(",")
        staged = producer != "cpu" and (stage == "host" or device == "cpu" or not gpu_path)
        joined = [ln for ln in srv.log if "a consumer joined" in ln]
        assert joined and ("GPU frames as host bytes" in joined[-1]) == staged, joined
        assert f"device {'cpu' if device == 'cpu' else 'cuda:0'}" in line, line
        if lib == "cupy":  # closed: every landing buffer and the page-locked one are freed at once
            closed = cons.expect("closed landing", 30.0)
            assert "buffers left 0 pinned False" in closed, closed
        try:  # exit must be clean: with the Receiver closed, or open with frames still landing
            rc = cons.p.wait(30)
        except Exception:
            rc = None
        assert rc == 0, f"the consumer exited with {rc}:\n{''.join(cons.log[-20:])}"
        cons.reader.join(10)  # its last lines, written as it exited
        warned = [ln for ln in cons.log if "UCX" in ln and ("WARN" in ln or "ERROR" in ln)]
        if warned:
            print(f"UCX warnings of the consumer ({len(warned)}):\n  " + "  ".join(warned[:5]))
        # UCX's CUDA events freed with no context current (at interpreter exit): a line per event
        assert not [ln for ln in warned if "context is destroyed" in ln], "".join(warned[:5])
        if stall:  # (a loaded machine may drop and resume any consumer: only the stalled one must)
            assert " resumes 0 " not in line, line
            assert any("a consumer went silent" in ln for ln in srv.log), "".join(srv.log[-40:])
            assert len(joined) >= 2, joined
        cons.stop()
        if not fps and producer != "cpu":  # the consumer's leave is logged with the most on their way at once
            end = time.monotonic() + 10.0
            while not (left := [ln for ln in srv.log if "frames sent" in ln]) and time.monotonic() < end:
                time.sleep(0.05)
            assert left and "GPU frames on their way at once" in left[-1], "".join(srv.log[-20:])
            assert "up to 1 " not in left[-1], left
    finally:
        srv.stop()
        prod.stop()
    srv.reader.join(10)
    print("server: UCX lines saying 'context is destroyed':", sum("context is destroyed" in ln for ln in srv.log))


@pytest.mark.parametrize("tls", ["tcp,cuda_copy", "tcp,cuda_copy,cuda_ipc"])
def test_a_gpu_relay_lands_remote_frames_in_its_local_links_slots(tls: str) -> None:
    """``cudalink relay --device 0``: each remote GPU frame lands in a slot of the relay's local GPU link,
    taken with ``reserve()`` (staged through host memory with ``tcp,cuda_copy``: one copy from its page-locked
    buffer into the slot; with ``cuda_ipc`` UCX writes the slot itself), and an unmodified local consumer
    checks every frame through torch."""
    pytest.importorskip("torch")
    name, local = unique("gr"), unique("grl")
    env = {"UCX_TLS": tls}
    prod = Proc(
        ["-m", "tests._ucx_procs", "producer", name, "--frames", "1000000", "--fps", "100", "--device", "0",
         "--shape", "1080,1920,4", "--slots", "4"],
        **env,
    )  # fmt: skip
    prod.expect("ready", 60.0)
    port = free_port()
    srv = Proc(["-m", "cudalink", "serve", name, "--listen", f"ucx://127.0.0.1:{port}"], **env)
    relay = None
    try:
        srv.expect("cudalink: serving", 60.0)
        relay = Proc(
            ["-m", "cudalink", "relay", f"ucx://127.0.0.1:{port}/{name}", "--as", local, "--device", "0", "--in-order"],
            **env,
        )
        assert "(1080x1920x4 uint8)" in relay.expect("cudalink: relaying", 60.0)
        cons = Proc(["-m", "tests._ucx_procs", "gpu-consumer", local, "--device", "0", "--lib", "torch",
                     "--frames", "60"])  # fmt: skip
        line = cons.expect("checked", 120.0)
        print(f"\n[relay {tls}] {line}")
        assert " bad 0 " in line and "device cuda:0" in line, line
        assert cons.p.wait(30) == 0, "".join(cons.log[-20:])
        assert relay.p.poll() is None, "".join(relay.log)
    finally:
        if relay is not None:
            relay.stop()
        srv.stop()
        prod.stop()
    assert relay.p.returncode == 0, "".join(relay.log)


def test_a_cuda_error_landing_a_remote_frame_on_the_gpu_is_raised_as_itself() -> None:
    """A real CUDA error in a landing's page-locked -> GPU copy (a lent slot at an address no allocation holds)
    read as a lost connection: ProducerGone, and a relay reconnected for ever. recv() now raises the CudaError,
    naming the link; nothing is committed; once landing works again the next recv() connects anew."""
    import cudalink
    from cudalink.link import default_transport
    from cudalink.transport import ucx_source
    from cudalink.transport.sources import open_source

    from ._ucx_procs import pattern
    from .test_ucx import served

    class Target:
        host = None
        ptr = 16  # no allocation holds it: the driver refuses the copy
        stream = 0
        aborted = 0

        def commit(self) -> None:
            raise AssertionError("a landing that failed was committed")

        def abort(self) -> None:
            Target.aborted += 1

    class Lander:
        def take(self, head: object, att: object) -> Target:
            return Target()

    with served("gl", "--frames", "1000000", "--fps", "200") as (prod, srv, url):  # host frames: the pinned path
        source = open_source(url, transport=default_transport(), device=0, copy="auto", latest=True)
        assert isinstance(source, ucx_source.UcxSource)
        source.lander = Lander()  # type: ignore[assignment]
        with cudalink.Receiver(url, source=source, timeout=10.0) as rx:
            with pytest.raises(cudalink.CudaError) as got:
                rx.recv(timeout=10.0)
            print("raised:", got.value)
            assert "could not be landed here" in str(got.value) and Target.aborted >= 1
            assert not isinstance(got.value, cudalink.ProducerGone)
            source.lander = None
            with rx.recv(timeout=10.0) as f:
                assert f.device == "cuda:0"
                seq = struct.unpack("<Q", f.meta)[0]
                assert seq == f.seq and np.array_equal(f.to_numpy(), pattern(f.shape, seq))  # whole, on the GPU
        assert prod.p.poll() is None and srv.p.poll() is None


def test_a_gpu_relay_makes_its_local_link_again_on_its_own_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``test_ucx_edges``' remake test with GPU links at both ends (GPU frames served, landed on the relay's
    GPU, the new link made on the relay's thread, which sends the frames that came meanwhile): no reconnect,
    and every frame of either shape whole on the GPU."""
    pytest.importorskip("torch")
    from .test_ucx_edges import relay_remakes_its_link

    relay_remakes_its_link(0, monkeypatch, caplog)


def test_bfloat16_gpu_frames_reach_a_remote_gpu_consumer_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 CUDA frame has no CUDA array interface: the server reads its pointer and ready stream as the
    interface would, and stages its bytes through host memory (``CUDALINK_UCX_STAGE=host``, as across hosts
    without RDMA); the consumer lands them on its GPU."""
    import threading

    import cudalink
    from cudalink.tools import remote_bench

    torch = pytest.importorskip("torch")
    monkeypatch.setenv("CUDALINK_UCX_STAGE", "host")
    shape = (64, 48, 4)
    n = int(np.prod(shape))

    def bits(seq: int) -> object:
        return ((torch.arange(n, device="cuda", dtype=torch.int64) * 7 + seq * 13) % 30011).to(torch.int16)

    name, port = unique("bf"), free_port()
    with cudalink.Sender(name, shape=shape, dtype="bfloat16", device=0, serve=f"ucx://127.0.0.1:{port}") as tx:

        def feed() -> None:
            while not tx.closed:
                try:
                    tx.send(bits(tx.seq + 1).view(torch.bfloat16).reshape(shape))
                except cudalink.LinkError:
                    return
                time.sleep(0.01)

        t = threading.Thread(target=feed, daemon=True)
        t.start()
        with remote_bench.connect(port, name, within=30, device=0) as rx:
            for _ in range(10):
                with rx.recv(timeout=10.0) as f:
                    assert f.device == "cuda:0" and f.dtype.name == "bfloat16" and f.shape == shape
                    got = torch.from_dlpack(f)
                    assert torch.equal(got.view(torch.int16).reshape(-1), bits(f.seq)), f.seq
    t.join(5)
