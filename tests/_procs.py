"""Child-process entry points for the multi-process tests (spawn needs importable functions)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import cudalink

from ._content import pattern, stamp


def host_producer(
    name: str,
    n: int,
    shape: tuple[int, ...],
    dtype: str,
    slots: int,
    ready: Any,
    go: Any = None,
    every: float = 0.0,
    policy: str = "drop",
) -> None:
    """Publish n frames, each with its checksum in meta."""
    with cudalink.Sender(
        name,
        shape=shape,
        dtype=dtype,
        slots=slots,
        device="cpu",
        policy=policy,  # type: ignore[arg-type]
        max_consumers=16,
    ) as tx:
        ready.set()
        if go is not None:
            go.wait(30)
        for _ in range(n):
            seq = tx.seq + 1  # the seq this frame gets if published; a dropped frame leaves it unused
            arr = pattern(seq, shape, dtype)
            got = tx.send(arr, meta=stamp(arr, seq))
            assert got in (None, seq), (got, seq)
            if every:
                time.sleep(every)
        ready.clear()
        time.sleep(0.3)


def host_producer_forever(name: str, shape: tuple[int, ...], dtype: str, ready: Any) -> None:
    with cudalink.Sender(name, shape=shape, dtype=dtype, slots=4, device="cpu") as tx:
        ready.set()
        seq = 0
        while True:
            seq += 1
            arr = pattern(seq, shape, dtype)
            tx.send(arr, meta=stamp(arr, seq))
            time.sleep(0.0005)


@contextlib.contextmanager
def taker(rx: cudalink.Receiver, use_async: bool, timeout: float) -> Iterator[Callable[[], cudalink.Frame]]:
    """A call that takes ``rx``'s next frame: ``recv(timeout)``, or with ``use_async`` ``recv_async(timeout)``
    awaited on an event loop of this thread, closed at the end of the block."""
    if not use_async:
        yield lambda: rx.recv(timeout=timeout)
        return
    loop = asyncio.new_event_loop()
    try:
        yield lambda: loop.run_until_complete(rx.recv_async(timeout=timeout))
    finally:
        loop.close()


def host_consumer(
    name: str,
    n_expected: int,
    result: Any,
    hold_s: float = 0.0,
    latest: bool = True,
    deadline_s: float = 60.0,
    wait: str = "hybrid",
) -> None:
    """Receive until the producer goes away; verify every frame's checksum against its content. ``wait``: the
    Receiver's mode, or ``"async"``: ``recv_async`` on an event loop of this process."""
    got = mismatches = 0
    seqs: list[int] = []
    held: list[Any] = []
    end = time.monotonic() + deadline_s
    mode = "block" if wait == "async" else wait
    try:
        with (
            cudalink.Receiver(name, timeout=20.0, latest=latest, wait=mode) as rx,  # type: ignore[arg-type]
            taker(rx, wait == "async", 5.0) as take,
        ):
            while time.monotonic() < end:
                try:
                    frame = take()
                except cudalink.ProducerGone:
                    break
                arr = np.from_dlpack(frame)
                if hold_s:
                    held.append(frame)
                    time.sleep(hold_s)
                    if len(held) > 2:
                        old = held.pop(0)
                        # a held frame must still be intact after the producer moved on
                        if stamp(np.from_dlpack(old), old.seq) != old.meta:
                            mismatches += 1
                        old.release()
                if stamp(arr, frame.seq) != frame.meta:
                    mismatches += 1
                seqs.append(frame.seq)
                got += 1
                if not hold_s:
                    frame.release()
                del arr
            for f in held:
                if stamp(np.from_dlpack(f), f.seq) != f.meta:
                    mismatches += 1
            result.put((os.getpid(), got, mismatches, seqs[-50:], rx.skipped, sorted(seqs) == seqs))
    except Exception as exc:  # report, so the parent's assertion says what happened
        result.put((os.getpid(), -1, -1, repr(exc), 0, False))


def hold_lease_forever(name: str, ready: Any) -> None:
    """Receive one frame, keep it, and wait to be killed."""
    with cudalink.Receiver(name, timeout=10.0) as rx:
        frame = rx.recv(timeout=10.0)
        ready.set()
        time.sleep(600)
        frame.release()


#: Senders a child keeps to its end (a module global, as an application's long-lived objects are)
KEPT: list[Any] = []


def host_producer_kept_open(name: str, ready: Any) -> None:
    """Publish one frame and return with the Sender still open and referenced: only the exit-time close can close
    it (a forked or forkserver child ends in ``os._exit``, after multiprocessing's own exit hooks)."""
    tx = cudalink.Sender(name, shape=(4, 4), dtype="uint8", device="cpu")
    tx.send(np.full((4, 4), 1, np.uint8))
    KEPT.append(tx)
    ready.set()


def host_producer_later(name: str, delay_s: float, ready: Any) -> None:
    """Start publishing only after ``delay_s``: a Receiver started first must wait for it, not give up."""
    ready.set()
    time.sleep(delay_s)
    with cudalink.Sender(name, shape=(4, 4), dtype="uint8", device="cpu") as tx:
        for i in range(200):
            tx.send(np.full((4, 4), i % 256, np.uint8))
            time.sleep(0.01)


def forking_consumer(name: str, ready: Any, dropped: Any, worker: Any, closed_in_worker: Any) -> None:
    """Hold two frames, fork a worker whose copies of them end at once (it lives on), then wait to be killed."""
    import gc

    rx = cudalink.Receiver(name, timeout=10.0, latest=False)
    held = [rx.recv(timeout=10.0) for _ in range(2)]
    pid = os.fork()
    if pid == 0:  # the worker: its copies of the link are closed, its copies of the frames end here
        try:
            rx.poll()
            said = ""
        except cudalink.LinkClosed as exc:
            said = str(exc)
        closed_in_worker.value = int(rx.closed) + int("forked from" in said)  # 2: closed, and says why
        held.clear()
        gc.collect()
        dropped.set()
        time.sleep(60)
        os._exit(0)
    worker.value = pid
    ready.set()
    time.sleep(60)


def forking_producer(name: str, worker: Any, closed_in_worker: Any, ready: Any) -> None:
    """Publish a frame, fork a worker that lives on, then wait to be killed."""
    with cudalink.Sender(name, shape=(8,), dtype="uint8", device="cpu") as tx:
        tx.send(np.full(8, 5, np.uint8))
        pid = os.fork()
        if pid == 0:
            try:
                tx.send(np.zeros(8, np.uint8))
                said = ""
            except cudalink.LinkClosed as exc:
                said = str(exc)
            closed_in_worker.value = int(tx.closed) + int("forked from" in said)
            time.sleep(60)
            os._exit(0)
        worker.value = pid
        end = time.monotonic() + 30
        while closed_in_worker.value == -1 and time.monotonic() < end:  # the worker has tried its copy
            time.sleep(0.01)
        ready.set()
        while True:
            time.sleep(1)


def forking_while_busy(name: str, result: Any) -> None:
    """Fork a worker while threads of this process are inside the link: one in a ``send`` that waits for a slot
    (it holds the Sender's lock), one in a ``recv`` that waits for a frame. The worker's copies of both links
    must refuse at once (LinkClosed, saying why), never wait on a lock or a waiter its parent's threads hold.
    Puts {call: "forked" | what else happened | "hung"} on ``result``."""
    import threading

    tx = cudalink.Sender(name, shape=(8,), dtype="uint8", device="cpu", slots=1, policy="block", timeout=30.0)
    hog = cudalink.Receiver(name, timeout=10.0)
    rx = cudalink.Receiver(name, timeout=10.0)
    tx.send(np.zeros(8, np.uint8))
    held = hog.recv(timeout=10.0)  # the only slot stays held: the next send waits, holding the Sender's lock
    rx.recv(timeout=10.0).release()
    threading.Thread(target=lambda: tx.send(np.ones(8, np.uint8)), daemon=True).start()
    threading.Thread(target=lambda: rx.recv(timeout=30.0), daemon=True).start()
    time.sleep(0.5)  # both threads are waiting now
    calls = {
        "send": lambda: tx.send(np.ones(8, np.uint8), timeout=1.0),
        "reconfigure": lambda: tx.reconfigure(shape=(4,)),
        "recv": lambda: rx.recv(timeout=1.0),
    }
    said: dict[str, str] = {}
    for what, call in calls.items():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                call()
                out = "no error"
            except cudalink.LinkClosed as exc:
                out = "forked" if "forked from" in str(exc) else f"LinkClosed: {exc}"
            except BaseException as exc:
                out = f"{type(exc).__name__}: {exc}"
            os.write(w, out.encode())
            os._exit(0)
        os.close(w)
        end = time.monotonic() + 5.0
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > end:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        said[what] = os.read(r, 4096).decode() or "hung"
        os.close(r)
    result.put(said)
    result.close()
    result.join_thread()
    del held
    with contextlib.suppress(Exception):  # ends the waiting threads' calls too; os._exit would leave the link
        rx.close()
        hog.close()
        tx.close(timeout=0)
    os._exit(0)  # the threads may still be on their way out: leave without joining them


def waiting_consumer_that_stops_while_it_looks(name: str, looking: Any) -> None:
    """A Receiver waiting for a producer that has not started asks, at each try, whether the name is a dead
    producer's (``SharedMemoryTransport.abandoned``). The look is made to stop midway (set ``looking``, then
    sleep: the test SIGSTOPs this process there), as a consumer paused by its user or the OS would."""
    from cudalink.transport import shm

    real = shm.leftovers

    def look(link: str, unrecorded: bool = False) -> tuple[list[str], list[str]]:
        looking.set()
        time.sleep(600)
        return real(link, unrecorded)

    shm.leftovers = look
    with contextlib.suppress(cudalink.LinkError):
        cudalink.Receiver(name, timeout=600.0)


def write_into_a_received_frame(name: str, ready: Any) -> None:
    """Receive a frame and write into it in place, as torch's in-place ops do (torch ignores DLPack's read-only
    flag): the write must fault in this process, never reach the slot the producer and others read."""
    import ctypes

    with cudalink.Receiver(name, timeout=10.0) as rx:
        frame = rx.recv(timeout=10.0)
        ready.set()
        ctypes.memset(frame.ptr, 0xEE, frame.nbytes)
        time.sleep(600)


def blocked_producer_forever(name: str, ready: Any) -> None:
    """Send forever on a 2-slot link with policy='block': once a consumer holds both slots, this waits in send()
    (the header's producer-waiting flag set) until one is released; the test SIGKILLs it there."""
    with cudalink.Sender(name, shape=(16,), dtype="uint8", slots=2, policy="block", timeout=600.0) as tx:
        ready.set()
        while True:
            tx.send(np.zeros(16, np.uint8))
            time.sleep(0.005)


def sigpipe_default_consumer(name: str, ready: Any, go: Any) -> None:
    """A consumer whose SIGPIPE is at its default action (a CLI that sets SIG_DFL; a host that embeds Python):
    it holds both slots of ``blocked_producer_forever``'s link, then (``go``: that producer was killed meanwhile)
    releases them, which tells a producer waiting for a slot over its socket, and receives once more. A dead
    producer's socket must raise nothing worse than its ProducerGone here: exit code 0."""
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    with cudalink.Receiver(name, timeout=10.0, latest=False) as rx:
        held = [rx.recv(), rx.recv()]
        ready.set()
        go.wait(30)
        held.clear()
        with contextlib.suppress(cudalink.ProducerGone):
            rx.recv(timeout=5.0)


def sigpipe_default_producer(name: str, ready: Any, joined: Any, held: Any, left: Any) -> None:
    """A producer whose SIGPIPE is at its default action, publishing while a consumer that sleeps on its
    ``fileno()`` (woken for every frame) has closed its end and the control thread has not yet taken it out
    (its leave is held here, as a busy control thread or a consumer killed mid-stream leaves it for a moment).
    Its wake-up then meets a closed peer: exit code 0, never SIGPIPE's. The test sets ``joined`` once its consumer
    is in, and ``left`` once it closed; ``held`` says the leave is held."""
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    with cudalink.Sender(name, shape=(16,), dtype="uint8") as tx:
        ready.set()
        joined.wait(30)
        with tx._server._loop._lock:  # type: ignore[attr-defined]  # the control thread's leave waits for this
            held.set()
            left.wait(30)
            time.sleep(0.2)  # the consumer's end is closed by now
            for _ in range(3):
                tx.send(np.zeros(16, np.uint8))
