"""Script TOP callbacks: show the frames of a cudalink link in TouchDesigner.

Make this DAT a Script TOP's "Callbacks DAT", press "Setup Parameters" on the Script TOP, and type
the link name (what the Python producer passed to ``cudalink.Sender``). See td/README.md.

Each cook takes the newest frame without waiting (``Receiver.poll``); when none is new it copies
the last one again, so the image stays while the producer pauses, restarts or has not started.
Status shows on the Script TOP as a warning/error, and in ``op('script1').fetch('cudalink')``.
GPU frames go in by pointer (``copyCUDAMemory``); flips, red/blue swaps and float16->float32 run on
the GPU with cupy or torch when the frame needs them.
"""

import cudalink.td
import td  # TouchDesigner's module (the tests inject a fake)

DEFAULT_LINK = "td_in"
RETRY_S = 0.5  # how often to look for a producer that is not there, or that refused this TOP
CHOICES = ["auto", "on", "off"]
CHOICE_LABELS = ["Auto (from frame metadata)", "On", "Off"]

# One receiver per Script TOP using this DAT (keyed by operator id). Editing this DAT reloads the
# module; the old receivers are then garbage, and closing them lets their producers' slots go.
_receivers = {}
_owners = {}  # operator id -> its Script TOP: a deleted one's receiver is closed at the next cook


def _close_deleted(current):
    """TD has no callback for a deleted Script TOP: its receiver would hold a producer's slot (and make the
    producer's close() wait) for as long as this DAT lives. ``OP.valid`` turns False once it is deleted."""
    for oid, owner in list(_owners.items()):
        if oid != current and getattr(owner, "valid", True) is False:
            del _owners[oid]
            rx = _receivers.pop(oid, None)
            if rx is not None:
                rx.close()


def _par(group, default, old):
    par = group[0]  # appendX returns a ParGroup (a list of Par in older builds)
    par.default = default
    par.val = old.get(par.name, default)
    return par


def onSetupParameters(scriptOp):
    old = {p.name: p.eval() for p in scriptOp.customPars}
    page = next((p for p in scriptOp.customPages if p.name == "Cudalink"), None)
    if page is None:
        page = scriptOp.appendCustomPage("Cudalink")
    _par(page.appendStr("Linkname", label="Link Name"), DEFAULT_LINK, old)
    _par(page.appendToggle("Active", label="Active"), True, old)
    for name, label in (("Flip", "Flip Rows"), ("Swaprb", "Swap Red/Blue")):
        par = page.appendMenu(name, label=label)[0]
        par.menuNames = CHOICES
        par.menuLabels = CHOICE_LABELS
        par.default = "auto"
        par.val = old.get(name, "auto")
    _par(page.appendToggle("Matchformat", label="Match Resolution/Format"), True, old)
    page.appendPulse("Reconnect", label="Reconnect")


def onPulse(par):
    if par.name == "Reconnect":
        rx = _receivers.get(par.owner.id)
        if rx is not None:
            rx.reconnect()


def _value(scriptOp, name, default):
    par = getattr(scriptOp.par, name, None)
    return default if par is None else par.eval()


def onCook(scriptOp):
    _ = td.absTime.frame  # depending on the frame number makes TD cook this TOP every frame, so it polls
    if len(_owners) > 1:
        _close_deleted(scriptOp.id)
    rx = _receivers.get(scriptOp.id)
    if rx is None:
        rx = cudalink.td.ScriptTopReceiver(DEFAULT_LINK, retry_s=RETRY_S, shape_factory=td.CUDAMemoryShape)
        _receivers[scriptOp.id] = rx
        _owners[scriptOp.id] = scriptOp
    rx.set_link(str(_value(scriptOp, "Linkname", DEFAULT_LINK)).strip())
    rx.flip = _value(scriptOp, "Flip", "auto")
    rx.swap_rb = _value(scriptOp, "Swaprb", "auto")
    rx.match_format = bool(_value(scriptOp, "Matchformat", True))
    status = rx.cook(scriptOp, active=bool(_value(scriptOp, "Active", True)))
    scriptOp.store("cudalink", {"link": rx.link, "status": status, "frames": rx.frames})
