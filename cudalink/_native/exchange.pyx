# cython: language_level=3, boundscheck=False, wraparound=False
"""Read an array through DLPack's C exchange API: one C call for its layout, one for its work stream.

A framework that publishes ``__dlpack_c_exchange_api__`` on its array type (torch, cuda.core's
``StridedMemoryView``) hands out a C function that fills a ``DLTensor`` with no Python objects, and one
that names the stream it queues work on. That replaces half a dozen Python-level calls on the send
path (each parses its arguments in C++, several µs when the caches are cold). Types without it, or an
array this reader cannot vouch for, get None and take the general path, which also words the errors.
"""

from cpython.long cimport PyLong_AsVoidPtr
from cpython.pycapsule cimport PyCapsule_CheckExact, PyCapsule_GetPointer
from cpython.exc cimport PyErr_Clear
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t

from cudalink._native.dlpack_abi cimport (
    CL_DLPACK_MAJOR,
    CL_KDLCPU,
    CL_KDLCUDA,
    cl_DLPackExchangeAPI,
    cl_DLTensor,
)

#: type -> its exchange table's address, or 0 where it has none we can use (looked up once per type)
cdef dict _apis = {}


cdef uintptr_t _api_of(type cls):
    got = _apis.get(cls)
    if got is not None:
        return <uintptr_t>got
    cdef uintptr_t address = 0
    cdef const cl_DLPackExchangeAPI *api
    obj = getattr(cls, "__dlpack_c_exchange_api__", None)
    if obj is None:
        obj = getattr(cls, "__c_dlpack_exchange_api__", None)  # the name before DLPack settled on one
    try:
        if PyCapsule_CheckExact(obj):
            address = <uintptr_t>PyCapsule_GetPointer(obj, b"dlpack_exchange_api")
        elif isinstance(obj, int):
            address = <uintptr_t>PyLong_AsVoidPtr(obj)
    except Exception:
        address = 0
    if address:
        api = <const cl_DLPackExchangeAPI *>address
        if api.version.major != CL_DLPACK_MAJOR or api.dltensor_from_py_object_no_sync == NULL:
            address = 0  # another major version, or no non-owning export: not ours to read
    _apis[cls] = address
    return address


def has_api(obj) -> bool:
    """Whether ``obj``'s type publishes an exchange table this reader uses."""
    return _api_of(type(obj)) != 0


def source(obj, want):
    """``(pointer, stream)`` of ``obj`` if it is a compact array of exactly what ``want`` says.

    ``want`` is ``(shape, dl_code, dl_bits, dl_device_type, device_id, ...)``, built once per frame spec
    (``cudalink.cuda.arrays.source_want``). The stream is the one its framework queues work on now (0 on the CPU); a copy queued there runs
    after the array's producer with nothing to order. Anything else (no exchange table, strided, another
    shape, dtype or device, the framework refusing) returns None: the general path then decides.
    """
    if not PyTuple_Check(want):  # a NamedTuple too (``tuple`` in the signature would refuse a subclass)
        raise TypeError(f"cudalink: want must be a tuple, got {type(want).__name__}")
    cdef uintptr_t address = _api_of(type(obj))
    if not address:
        return None
    cdef tuple shape = <tuple>PyTuple_GET_ITEM(want, 0)
    cdef int dl_code = <object>PyTuple_GET_ITEM(want, 1)
    cdef int dl_bits = <object>PyTuple_GET_ITEM(want, 2)
    cdef int device_type = <object>PyTuple_GET_ITEM(want, 3)
    cdef int device_id = <object>PyTuple_GET_ITEM(want, 4)
    cdef const cl_DLPackExchangeAPI *api = <const cl_DLPackExchangeAPI *>address
    cdef cl_DLTensor t
    if api.dltensor_from_py_object_no_sync(<void *>obj, &t) != 0:
        PyErr_Clear()  # e.g. torch refuses a tensor that requires grad: the general path words it
        return None
    if t.device.device_type != device_type or t.device.device_id != device_id:
        return None
    if t.dtype.code != dl_code or t.dtype.bits != dl_bits or t.dtype.lanes != 1:
        return None
    cdef Py_ssize_t n = PyTuple_GET_SIZE(shape), i
    if t.ndim != n:
        return None
    cdef int64_t expect = 1, d
    for i in range(n):
        if t.shape[i] != <int64_t><object>PyTuple_GET_ITEM(shape, i):
            return None
    if t.strides != NULL:
        for i in range(n - 1, -1, -1):
            d = t.shape[i]
            if d != 1 and t.strides[i] != expect:
                return None
            expect *= d
    cdef void *stream = NULL
    if device_type != CL_KDLCPU and api.current_work_stream != NULL:
        if api.current_work_stream(device_type, device_id, &stream) != 0:
            PyErr_Clear()
            return None
    return (<uintptr_t>t.data + <uintptr_t>t.byte_offset, <uintptr_t>stream)
