"""What a frame looks like: shape, dtype, strides and pixel layout, validated once, up front."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
from numpy.typing import DTypeLike

from ..errors import FormatError

__all__ = [
    "MAX_NDIM",
    "META_MAX",
    "SUPPORTED_DTYPES",
    "FrameSpec",
    "PixelFormat",
    "RowOrigin",
    "as_dtype",
    "check_meta_size",
]

MAX_NDIM = 8
#: Bytes of ``meta`` a frame carries: a tag or a small struct, kept beside the frame in every slot.
META_MAX = 64
#: Frames larger than this are refused: no real image is, and it keeps every size a safe u64.
MAX_NBYTES = 1 << 40


def check_meta_size(nbytes: int) -> None:
    """Refuse ``meta`` longer than a frame carries (``send``, ``reserve`` and ``Frame.from_array`` alike)."""
    if nbytes > META_MAX:
        raise FormatError(
            f"cudalink: meta is {nbytes} bytes; at most {META_MAX} travel with a frame (put more in the frame)"
        )


#: The element types every consumer framework (numpy, torch, cupy, jax) can take through DLPack.
SUPPORTED_DTYPES: tuple[str, ...] = (
    "bool",
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "uint64",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "bfloat16",  # numpy's through ml_dtypes (as jax and cuda.core read it); DLPack's kDLBfloat
)

#: Element types numpy has only through a package, and which package: imported when one is first named.
_PACKAGED = {"bfloat16": "ml_dtypes"}
_packaged: dict[str, np.dtype[np.generic]] = {}


def _packaged_dtype(name: str) -> np.dtype[np.generic]:
    """numpy's dtype for ``bfloat16``: ml_dtypes registers it with numpy on import, which costs ~5 ms, so only
    a process that meets one pays it."""
    dt = _packaged.get(name)
    if dt is None:
        try:
            mod = __import__(_PACKAGED[name])
        except ImportError as exc:
            raise FormatError(
                f"cudalink: {name} frames need the {_PACKAGED[name]} package, which gives numpy that type "
                f"(pip install {_PACKAGED[name]}); or send float16/float32"
            ) from exc
        dt = _packaged[name] = np.dtype(getattr(mod, name))
    return dt


class _Named(str, enum.Enum):
    """A str enum that equals its value (``frame.origin == "bottom"``) and reads as it in ``str()`` and f-strings
    on every Python: a str mixin's ``format()`` gave the value on 3.10 and the member's name on 3.11+."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class PixelFormat(_Named):
    """Channel order of the last axis; bit depth comes from the dtype (RGBA + uint8 = RGBA8)."""

    GRAY = "GRAY"
    RG = "RG"
    RGB = "RGB"
    BGR = "BGR"
    RGBA = "RGBA"
    BGRA = "BGRA"

    @property
    def channels(self) -> int:
        return 1 if self is PixelFormat.GRAY else len(self.value)


class RowOrigin(_Named):
    """Where row 0 is. TouchDesigner (OpenGL) hands out bottom-up images."""

    TOP = "top"
    BOTTOM = "bottom"


_DEPTH_SUFFIX = {
    "uint8": "8",
    "uint16": "16",
    "float16": "16F",
    "float32": "32F",
    "uint32": "32",
    "float64": "64F",
}


def as_dtype(dtype: DTypeLike) -> np.dtype[np.generic]:
    """Normalise anything numpy understands (``"float32"``, ``np.float32``, a dtype) and check it is supported."""
    if dtype is None:  # numpy reads None as float64: a link of another dtype than the caller meant
        raise FormatError(f"cudalink: dtype None is not a dtype; use one of {', '.join(SUPPORTED_DTYPES)} (e.g. uint8)")
    # a framework's dtype object (torch.float16, torch.bfloat16) by its name: numpy reads none of torch's
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.") if _is_torch(dtype) else None
    if name in _PACKAGED:
        return _packaged_dtype(name)
    try:
        dt = np.dtype(name if name is not None else dtype)
    except TypeError as exc:
        raise FormatError(f"cudalink: {dtype!r} is not a dtype; use one of {', '.join(SUPPORTED_DTYPES)}") from exc
    if dt.byteorder == ">" or dt.name not in SUPPORTED_DTYPES:
        raise FormatError(
            f"cudalink: dtype {_shown(dt)} is not supported; use a native-endian one of {', '.join(SUPPORTED_DTYPES)}"
        )
    out: np.dtype[np.generic] = dt.newbyteorder("=")
    return out


def _shown(dt: np.dtype[np.generic]) -> str:
    """``dt`` as messages name it: ``dt.str`` (``>u2``), but a dtype a package adds (ml_dtypes' bfloat16, float8_*)
    reads as raw bytes there (``<V2``), so by its name, and its byte order where that is not this machine's."""
    if dt.isbuiltin != 2:
        return str(dt.str)
    return dt.name if dt.isnative else f"{dt.name} ({'big' if dt.byteorder == '>' else 'little'}-endian)"


def _is_torch(obj: object) -> bool:
    return type(obj).__module__ == "torch"


def _check_int(value: object, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise FormatError(f"cudalink: {what} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class FrameSpec:
    """An immutable, validated frame description. Build it with keywords; it checks itself on creation.

    ``strides`` are numpy-style byte strides; ``None`` means C-contiguous. ``nbytes`` is the span the
    strides touch, which is what a slot must hold; ``nbytes=``, where given, must equal that span (a check of a size
    you hold against the spec).
    A pixel format may come third, as in ``FrameSpec((1080, 1920, 4), "uint8", "RGBA8")``: a name is never strides.
    """

    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]
    strides: tuple[int, ...] | None = None
    pixel_format: PixelFormat | None = None
    origin: RowOrigin = RowOrigin.TOP

    def __init__(
        self,
        shape: Sequence[int] | int,
        dtype: DTypeLike = "uint8",
        strides: Sequence[int] | None = None,
        pixel_format: PixelFormat | str | None = None,
        origin: RowOrigin | str = RowOrigin.TOP,
        *,
        nbytes: int | None = None,
    ) -> None:
        if isinstance(strides, PixelFormat) or (isinstance(strides, str) and _names_pixel_format(strides)):
            # (shape, dtype, pixel format[, origin]): the order a spec is said in
            if isinstance(pixel_format, RowOrigin) or str(pixel_format).lower() in ("top", "bottom"):
                if origin is not RowOrigin.TOP:
                    raise FormatError(f"cudalink: FrameSpec got two origins, {pixel_format!r} and {origin!r}; pass one")
                origin, pixel_format = cast("RowOrigin | str", pixel_format), None
            if pixel_format is not None:
                raise FormatError(
                    f"cudalink: FrameSpec got two pixel formats, {strides!r} and {pixel_format!r}; pass one"
                )
            strides, pixel_format = None, strides
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
            shape = (int(shape),)
        if not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)):
            raise FormatError(f"cudalink: shape must be a tuple of ints, got {shape!r}")
        dims = tuple(_check_int(d, "every shape entry") for d in shape)
        if not 1 <= len(dims) <= MAX_NDIM:
            raise FormatError(f"cudalink: a frame has 1 to {MAX_NDIM} dimensions, got shape {dims}")
        if any(d < 1 for d in dims):
            raise FormatError(f"cudalink: every dimension must be >= 1, got shape {dims}")
        dt = as_dtype(dtype)
        if math.prod(dims) * dt.itemsize > MAX_NBYTES:
            raise FormatError(f"cudalink: shape {dims} of {dt.name} exceeds the {MAX_NBYTES >> 30} GiB frame limit")
        st: tuple[int, ...] | None = None
        if strides is not None:
            if not isinstance(strides, Sequence) or isinstance(strides, (str, bytes)):
                raise FormatError(f"cudalink: strides must be a tuple of ints (bytes per axis), got {strides!r}")
            st = tuple(_check_int(s, "every stride") for s in strides)
            if len(st) != len(dims):
                raise FormatError(f"cudalink: strides {st} do not match the {len(dims)} dimensions of {dims}")
            if any(s < 0 or s % dt.itemsize for s in st):
                raise FormatError(
                    f"cudalink: strides {st} must be non-negative multiples of the itemsize {dt.itemsize}"
                )
            if any(s > MAX_NBYTES for s in st):  # even on a length-1 axis, where it spans nothing: numpy refuses it
                raise FormatError(f"cudalink: strides {st} exceed the {MAX_NBYTES >> 30} GiB frame limit")
            if st == _c_strides(dims, dt.itemsize):
                st = None
            else:
                _check_no_overlap(dims, st, dt.itemsize)
        pf = _pixel_format(pixel_format, dt)
        if pf is not None:
            channels = dims[-1] if len(dims) >= 3 else 1
            if channels != pf.channels:
                raise FormatError(
                    f"cudalink: pixel format {pf.value} has {pf.channels} channel(s) but shape {dims} has {channels}"
                    f" (the last axis of a 3-D shape counts channels)"
                )
        try:
            org = RowOrigin(origin.value if isinstance(origin, RowOrigin) else str(origin).lower())
        except ValueError as exc:
            raise FormatError(f"cudalink: origin must be 'top' or 'bottom', got {origin!r}") from exc
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "dtype", dt)
        object.__setattr__(self, "strides", st)
        object.__setattr__(self, "pixel_format", pf)
        object.__setattr__(self, "origin", org)
        # derived once: these sit on every send/recv path
        bst = st if st is not None else _c_strides(dims, dt.itemsize)
        given = nbytes  # the caller's, checked below against the span
        nbytes = sum((d - 1) * s for d, s in zip(dims, bst, strict=True)) + dt.itemsize
        if nbytes > MAX_NBYTES:  # the span the strides reach, not only the elements: what a slot must hold
            raise FormatError(
                f"cudalink: strides {st} of shape {dims} span {nbytes} bytes, over the {MAX_NBYTES >> 30} GiB frame "
                "limit; send a compact array (np.ascontiguousarray / .contiguous())"
            )
        if given is not None and _check_int(given, "nbytes") != nbytes:
            raise FormatError(
                f"cudalink: nbytes={given} does not match shape {dims} of {dt.name}"
                + (f" with strides {st}" if st is not None else "")
                + f", which spans {nbytes} bytes; fix the shape or dtype, or pass nbytes={nbytes}"
            )
        object.__setattr__(self, "_byte_strides", bst)
        object.__setattr__(self, "_nbytes", nbytes)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    @property
    def byte_strides(self) -> tuple[int, ...]:
        """Strides in bytes, filled in for contiguous specs."""
        return self._byte_strides  # type: ignore[attr-defined,no-any-return]

    @property
    def is_contiguous(self) -> bool:
        return self.strides is None

    @property
    def nbytes(self) -> int:
        """Bytes the frame spans: what a slot must hold."""
        return self._nbytes  # type: ignore[attr-defined,no-any-return]

    @property
    def label(self) -> str:
        """Short human name such as ``RGBA8`` or ``BGRA8 bottom-up``; shape and dtype when no pixel format."""
        if self.pixel_format is None:
            return f"{'x'.join(map(str, self.shape))} {self.dtype.name}"
        text = self.pixel_format.value + _DEPTH_SUFFIX.get(self.dtype.name, f" {self.dtype.name}")
        return text + (" bottom-up" if self.origin is RowOrigin.BOTTOM else "")

    def with_shape(self, shape: Sequence[int]) -> FrameSpec:
        return FrameSpec(shape, self.dtype, None, self.pixel_format, self.origin)

    def reconfigured(
        self,
        shape: Sequence[int] | None,
        dtype: DTypeLike | None,
        pixel_format: PixelFormat | str | None,
        origin: RowOrigin | str | None,
        capacity: int,
        strides: Sequence[int] | None = None,
    ) -> FrameSpec:
        """This spec with what a Sender's ``reconfigure`` changes, checked against its slots' ``capacity``.

        A new shape drops the pixel format unless one is given: the old one may not fit its channels. Strides
        are kept while shape and dtype stay (a pitched layout is a property of the slots, not of one frame)
        and reset to compact when either changes, unless new ones are given. ``pixel_format=""`` clears it.
        A shape equal to the current one is no new shape: it keeps both.
        """
        same = FrameSpec(self.shape if shape is None else shape, self.dtype if dtype is None else dtype)
        same_shape = same.shape == self.shape
        if strides is None:
            strides = self.strides if same_shape and same.dtype == self.dtype else None
        spec = FrameSpec(
            same.shape,
            same.dtype,
            strides,
            pixel_format if pixel_format is not None else (self.pixel_format if same_shape else None),
            self.origin if origin is None else origin,
        )
        if spec.nbytes > capacity:
            raise FormatError(
                f"cudalink: {spec.shape} {spec.dtype.name} needs {spec.nbytes} bytes but slots hold "
                f"{capacity}; create the Sender with capacity={spec.nbytes} (or more) to allow it"
            )
        return spec

    def check_array(self, shape: Sequence[int], dtype: DTypeLike, what: str = "array") -> None:
        """Raise a :class:`FormatError` that says exactly what differs, for ``send``."""
        got = tuple(int(d) for d in shape)
        dt = np.dtype(dtype)
        if got == self.shape and dt != self.dtype and dt.newbyteorder("=") == self.dtype:
            order = "" if dt.isbuiltin == 2 else f" ({'big' if dt.byteorder == '>' else 'little'}-endian)"
            raise FormatError(
                f"cudalink: {what} is {_shown(dt)}{order} but the link carries {_shown(self.dtype)} in this "
                "machine's byte order; send x.astype(x.dtype.newbyteorder('='))"
            )
        if got != self.shape or dt != self.dtype:
            # same shape, another dtype: most often a Python list or an int64/float64 array made by accident
            name = self.dtype.name
            convert = (
                f"convert it (np.asarray(x, dtype='{name}'); torch: x.to(torch.{name})), or "
                if got == self.shape
                else ""
            )
            raise FormatError(
                f"cudalink: {what} is {got} {dt.name} but the link carries {self.shape} {self.dtype.name}; "
                f"{convert}call reconfigure(shape=..., dtype=...) first to change the format"
            )


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out = []
    acc = itemsize
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _check_no_overlap(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> None:
    """Frames are written by copy; overlapping elements would make that ill-defined."""
    span = itemsize
    for d, s in sorted(zip(shape, strides, strict=False), key=lambda t: t[1]):
        if d > 1 and s < span:
            raise FormatError(f"cudalink: strides {strides} make elements of shape {shape} overlap")
        span = max(span, s * d) if d > 1 else span


def _names_pixel_format(text: str) -> bool:
    """Whether ``text`` is a pixel format's name (with or without a depth suffix)."""
    try:
        return _pixel_format(text) is not None
    except FormatError:
        return False


def _pixel_format(value: PixelFormat | str | None, dtype: np.dtype[np.generic] | None = None) -> PixelFormat | None:
    """A pixel format by name; a bit-depth suffix (``RGBA8``, ``RGBA32F``) must name ``dtype``'s depth, else the
    name would say one thing and the frames another."""
    if value is None or isinstance(value, PixelFormat):
        return value
    text = str(value).upper()
    if text in ("", "NONE"):  # said outright: no pixel format (how ``reconfigure`` clears one)
        return None
    for suffix in ("32F", "16F", "64F", "8", "16", "32"):
        if text.endswith(suffix) and text[: -len(suffix)] in PixelFormat.__members__:
            text = text[: -len(suffix)]
            want = _DEPTH_SUFFIX.get(dtype.name) if dtype is not None else suffix
            if want != suffix:
                fix = f"'{text}{want}'" if want else f"'{text}' (no depth suffix)"
                raise FormatError(
                    f"cudalink: pixel format {value!r} has the depth suffix {suffix!r} but the frames are {dtype}; "
                    f"use {fix}, or another dtype"
                )
            break
    try:
        return PixelFormat[text]
    except KeyError as exc:
        names = ", ".join(PixelFormat.__members__)
        raise FormatError(f"cudalink: unknown pixel format {value!r}; use one of {names} (e.g. 'RGBA8')") from exc
