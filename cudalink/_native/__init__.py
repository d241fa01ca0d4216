"""The compiled core, where it was built: ``ring`` (the per-frame ring operations), ``driver``
(direct CUDA driver calls, entry points from cuda.bindings' ``cuGetProcAddress``), ``exchange``
(reading a source array through DLPack's C exchange API) and ``dlpack`` (a received frame's capsule).

Each is an optional extension: ``pip install .`` builds them where a C compiler (and, for ``driver``,
``cuda.h``) exists, and the pure-Python implementations stand in everywhere else, a TouchDesigner
Python without a matching wheel included. ``CUDALINK_PURE_PYTHON=1`` forces the Python ones, so the
same tests run against both.
"""

from __future__ import annotations

import os
from types import ModuleType

PURE = os.environ.get("CUDALINK_PURE_PYTHON", "") not in ("", "0")

#: why a compiled module is not in use (absent when it is)
missing: dict[str, str] = {}


#: each compiled module's interface version (its ``ABI``; 1 where it has none). A build older than its source
#: (an editable install after a ``git pull``, not rebuilt) is left unused, not called with arguments it lacks:
#: ring 2 is ``claim(seq, skip)``, and ring 1's ``claim(seq)`` raised TypeError on every send; ring 3 adds
#: ``woken_ahead``; driver 2 adds ``current_context`` and ``set_context``
ABI = {"ring": 3, "exchange": 1, "dlpack": 1, "driver": 2}


def _load(name: str) -> ModuleType | None:
    if PURE:
        missing[name] = "CUDALINK_PURE_PYTHON is set"
        return None
    try:
        import importlib

        mod = importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:  # not built here, or built against another cuda-bindings
        missing[name] = str(exc)
        return None
    built = getattr(mod, "ABI", 1)
    if built != ABI[name]:
        missing[name] = (
            f"stale build: its interface is {built}, this source's {ABI[name]}; rebuild it "
            "(`pip install -e .` or `python setup.py build_ext --inplace`)"
        )
        return None
    return mod


ring = _load("ring")
exchange = _load("exchange")  # no CUDA needed: it only reads what a framework's C table reports
dlpack = _load("dlpack")  # no CUDA needed: it only describes memory
driver: ModuleType | None = None  # loaded by cudalink.cuda.driver with the CUDA packages, never on a CPU-only import


def load_driver() -> ModuleType | None:
    global driver
    if driver is None and "driver" not in missing:
        driver = _load("driver")
    return driver


#: how the compiled driver module says it was built but found no driver to call (see driver.pyx)
_NO_DRIVER = "cudalink._native.driver: cuInit "


def status() -> dict[str, str]:
    """``{"ring": "compiled" | "python (why)", "driver": ..., ...}`` for ``info`` and the bench; the driver
    module can also be ``"built (unused: ...)"`` on a machine with no CUDA driver."""
    out = {}
    for name, mod in (("ring", ring), ("driver", driver), ("exchange", exchange), ("dlpack", dlpack)):
        if mod is not None:
            out[name] = "compiled"
        elif name in missing and _NO_DRIVER in missing[name]:
            # built, but this machine has no CUDA driver: nothing for it to call, and no CUDA link can exist
            out[name] = "built (unused: no CUDA driver on this machine)"
        elif name in missing and missing[name].startswith("No module named"):
            out[name] = "python (not built: no C compiler or Cython at install; `pip install -v .` shows why)"
        elif name in missing:
            out[name] = f"python ({missing[name]})"
        else:
            out[name] = "python (not loaded yet)"
    return out
