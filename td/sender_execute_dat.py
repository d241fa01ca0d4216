"""Execute DAT callbacks: export a TOP to a cudalink link at the end of every frame.

Put this text in an Execute DAT, turn its "Frame End" toggle on, and edit the settings below.
Python then reads the frames with ``cudalink.Receiver(LINK_NAME)``; see td/README.md.

Why onFrameEnd: ``TOP.cudaMemory()`` inside a cook stalls TD (peers measured 8.8 ms). The export
asks TD for the TOP's CUDA memory on a non-default stream of ours, then queues one GPU copy into
the link's IPC ring on that same stream: the CPU never waits, and the ``CUDAMemory`` object is
held until that copy has run (TD frees its memory when the object dies).
Frames carry TD's layout as metadata: rows bottom-up, BGRA for 8-bit RGBA, RGBA otherwise.
"""

import cudalink.td

SOURCE_TOP = "null_out"  # the TOP to export, relative to this DAT
LINK_NAME = "td_out"  # Python side: cudalink.Receiver("td_out")
DEVICE = 0  # the CUDA device TouchDesigner renders on
SLOTS = 3  # frames in flight; more slots let slow consumers hold frames longer

_state = {"sender": None, "error": None}


def _sender():
    tx = _state["sender"]
    if tx is None or tx.name != LINK_NAME:
        if tx is not None:
            tx.close()
        tx = cudalink.td.TDSender(LINK_NAME, device=DEVICE, slots=SLOTS)
        _state["sender"] = tx
    return tx


def _report(message):
    """Show a failure on this DAT once (not every frame), and print it to the textport."""
    if message != _state["error"]:
        _state["error"] = message
        me.clearScriptErrors()  # noqa: F821 -- `me` is this DAT, a TouchDesigner global
        if message:
            me.addScriptError(message)  # noqa: F821
            print(f"cudalink export of {SOURCE_TOP!r}: {message}")


def onFrameEnd(frame):
    top = op(SOURCE_TOP)  # noqa: F821 -- TouchDesigner's op(), relative to this DAT
    if top is None:
        _report(f"cudalink: no TOP named {SOURCE_TOP!r}; set SOURCE_TOP in {me.path}")  # noqa: F821
        return
    try:
        _sender().send_top(top)
    except Exception as exc:
        _report(str(exc))
        return
    _report(None)


def onExit():
    tx, _state["sender"] = _state["sender"], None
    if tx is not None:
        tx.close()


def onStart():
    return
