# cython: language_level=3, boundscheck=False, wraparound=False
"""A received frame's DLPack capsule in one C call.

The Python path builds an array or a ``StridedMemoryView`` per frame and asks it for a capsule: two
objects and a few Python calls, microseconds each with the caches cold right after a wake. A slot's
layout does not change between frames of one spec, so an :class:`Exporter` keeps it, made once per
(slot, spec), and each export is one allocation: the managed tensor with its shape and strides, whose
context is the frame's hold (the lease on the slot), released by the deleter whichever thread runs it.
"""

from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from cudalink._native.dlpack_abi cimport (
    CL_DLPACK_FLAG_READ_ONLY,
    cl_DLManagedTensor,
    cl_DLManagedTensorVersioned,
    cl_DLTensor,
)

cdef enum:
    MAX_DIMS = 8  # frames.spec.MAX_NDIM

cdef struct Legacy:  # one allocation per export: the managed tensor, then its shape and strides
    cl_DLManagedTensor m
    int64_t dims[2 * MAX_DIMS]

cdef struct Versioned:
    cl_DLManagedTensorVersioned m
    int64_t dims[2 * MAX_DIMS]


cdef void _drop_legacy(cl_DLManagedTensor *m) noexcept nogil:
    """The consumer is done (any thread, GIL or not): let go of the hold, free the tensor."""
    if m == NULL:
        return
    with gil:
        Py_DECREF(<object>m.manager_ctx)
    free(m)


cdef void _drop_versioned(cl_DLManagedTensorVersioned *m) noexcept nogil:
    if m == NULL:
        return
    with gil:
        Py_DECREF(<object>m.manager_ctx)
    free(m)


cdef void _unused_legacy(object capsule) noexcept:
    """A capsule nobody consumed (still named "dltensor") owns its tensor; a consumer renames it."""
    if PyCapsule_IsValid(capsule, b"dltensor"):
        m = <cl_DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")
        m.deleter(m)


cdef void _unused_versioned(object capsule) noexcept:
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        m = <cl_DLManagedTensorVersioned *>PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        m.deleter(m)


cdef class Exporter:
    """One slot viewed as one spec, in DLPack's terms: made once per (slot, spec), used by every frame."""

    cdef cl_DLTensor t  # the template: everything but where shape and strides live
    cdef int64_t dims[2 * MAX_DIMS]  # shape, then strides in elements

    def __init__(
        self, uintptr_t ptr, int device_type, int device_id, tuple shape, tuple strides, int code, int bits
    ):
        cdef Py_ssize_t n = len(shape), i
        if not 1 <= n <= MAX_DIMS or len(strides) != n:
            raise ValueError(f"cudalink: a DLPack export takes 1..{MAX_DIMS} dims with one stride each, got {n}")
        if not 0 <= code <= 255 or not 0 < bits <= 255:
            raise ValueError(f"cudalink: DLPack type code {code} with {bits} bits")
        for i in range(n):
            self.dims[i] = shape[i]
            self.dims[MAX_DIMS + i] = strides[i]
        self.t.data = <void *>ptr
        self.t.device.device_type = device_type
        self.t.device.device_id = device_id
        self.t.ndim = <int32_t>n
        self.t.dtype.code = <uint8_t>code
        self.t.dtype.bits = <uint8_t>bits
        self.t.dtype.lanes = 1
        self.t.byte_offset = 0

    def capsule(self, hold, bint readonly, bint versioned):
        """A new capsule of this slot that keeps ``hold`` alive until its consumer lets go.

        ``versioned``: the consumer passed ``max_version >= (1, 0)``; only that form can say ``readonly``.
        """
        cdef Legacy *old
        cdef Versioned *new
        if versioned:
            new = <Versioned *>malloc(sizeof(Versioned))
            if new == NULL:
                raise MemoryError()
            new.m.version.major = 1
            new.m.version.minor = 0
            new.m.flags = CL_DLPACK_FLAG_READ_ONLY if readonly else 0
            new.m.deleter = _drop_versioned
            new.m.manager_ctx = self._fill(&new.m.dl_tensor, new.dims, hold)
            try:
                return PyCapsule_New(new, b"dltensor_versioned", _unused_versioned)
            except BaseException:
                _drop_versioned(&new.m)
                raise
        old = <Legacy *>malloc(sizeof(Legacy))
        if old == NULL:
            raise MemoryError()
        old.m.deleter = _drop_legacy
        old.m.manager_ctx = self._fill(&old.m.dl_tensor, old.dims, hold)
        try:
            return PyCapsule_New(old, b"dltensor", _unused_legacy)
        except BaseException:
            _drop_legacy(&old.m)
            raise

    cdef void *_fill(self, cl_DLTensor *t, int64_t *dims, object hold) noexcept:
        """This slot's tensor, its shape and strides in ``dims``; the new reference to ``hold`` it returns
        is the managed tensor's context, dropped by its deleter."""
        t[0] = self.t
        memcpy(dims, self.dims, sizeof(self.dims))
        t.shape = dims
        t.strides = dims + MAX_DIMS
        Py_INCREF(hold)
        return <void *>hold
