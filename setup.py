"""Build the optional compiled core (``cudalink/_native``); all metadata lives in pyproject.toml.

Both extensions are plain C from Cython and need nothing CUDA to build (the driver entry points are
looked up at import). Where no C compiler exists, or a module fails to build, the build says so and
installs without it: cudalink then uses the pure-Python twin. ``CUDALINK_NO_NATIVE=1`` skips the
compiled core on purpose.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = "cudalink/_native"
MODULES = ("ring", "driver", "exchange", "dlpack")


def _say(text: str) -> None:
    print(f"cudalink: {text}", file=sys.stderr)


def extensions() -> list[Extension]:
    if os.environ.get("CUDALINK_NO_NATIVE", "") not in ("", "0"):
        _say("CUDALINK_NO_NATIVE is set: installing the pure-Python core")
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        _say("Cython is missing: installing the pure-Python core")
        return []
    out: list[Extension] = []
    for name in MODULES:  # one that cannot be translated is skipped, never a failed install
        ext = Extension(f"cudalink._native.{name}", [f"{NATIVE}/{name}.pyx"], include_dirs=[NATIVE], optional=True)
        try:
            out += cythonize([ext], quiet=True, compiler_directives={"language_level": 3})
        except Exception as exc:
            _say(f"{ext.name} not translated ({exc}): its pure-Python twin is used")
    return out


class OptionalBuildExt(build_ext):
    """A compiled module that fails to build is reported and left out: its pure-Python twin takes over."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            _say(f"{ext.name} not built ({exc}): its pure-Python twin is used")

    def get_outputs(self) -> list[str]:
        return [o for o in super().get_outputs() if os.path.exists(o)]

    def get_output_mapping(self) -> dict[str, str]:
        return {k: v for k, v in super().get_output_mapping().items() if os.path.exists(v)}


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
