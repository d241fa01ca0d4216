# cython: language_level=3, boundscheck=False, wraparound=False
"""The driver calls a frame makes, as direct C calls.

cuda.bindings' Python layer wraps each handle argument in an object and each result in a tuple: more
than the call itself costs. ``cudalink.cuda.driver`` routes its per-frame calls here where this module was
built; handles travel as plain integers (``cudalink.cuda.driver.raw``).

The entry points come from ``cuGetProcAddress`` through cuda.bindings, so this module needs no
``cuda.h`` to build and calls the very libcuda cuda.bindings loaded. (Compiling against
``cydriver.pxd`` needs a ``cuda.h`` at least as new as the installed cuda-bindings, which toolkits and
wheels often disagree on.) Errors are ``cudalink.cuda.driver.cuda_error``'s ``CudaError``, as for the Python calls. The GIL
stays held: these calls only queue work, and dropping it per call would invite a hand-off to another
thread in the middle of a frame.
"""

from libc.stdint cimport uintptr_t
from libc.string cimport memset

cdef extern from "driver_api.h":
    ctypedef int cl_CUresult
    ctypedef void *cl_CUevent
    ctypedef void *cl_CUstream
    ctypedef void *cl_CUcontext
    ctypedef unsigned long long cl_CUdeviceptr
    int CL_CUDA_SUCCESS, CL_CUDA_ERROR_NOT_READY, CL_CU_MEMORYTYPE_DEVICE
    ctypedef struct cl_MEMCPY2D:
        int srcMemoryType
        cl_CUdeviceptr srcDevice
        size_t srcPitch
        int dstMemoryType
        cl_CUdeviceptr dstDevice
        size_t dstPitch
        size_t WidthInBytes
        size_t Height
    ctypedef cl_CUresult (*cl_EventRecord_t)(cl_CUevent, cl_CUstream)
    ctypedef cl_CUresult (*cl_StreamWaitEvent_t)(cl_CUstream, cl_CUevent, unsigned int)
    ctypedef cl_CUresult (*cl_EventQuery_t)(cl_CUevent)
    ctypedef cl_CUresult (*cl_MemcpyDtoDAsync_t)(cl_CUdeviceptr, cl_CUdeviceptr, size_t, cl_CUstream)
    ctypedef cl_CUresult (*cl_Memcpy2DAsync_t)(const cl_MEMCPY2D *, cl_CUstream)
    ctypedef cl_CUresult (*cl_CtxGetCurrent_t)(cl_CUcontext *)
    ctypedef cl_CUresult (*cl_CtxSetCurrent_t)(cl_CUcontext)

#: this module's interface (``cudalink._native.ABI``): 2 adds ``current_context`` and ``set_context``
ABI = 2


cdef uintptr_t _entry(drv, str name) except 0:
    """The address of driver function ``name`` with the CUDA 12.0 ABI, or ImportError (no driver here)."""
    try:
        got = drv.cuGetProcAddress(name.encode(), 12000, drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
    except Exception as exc:
        raise ImportError(f"cudalink._native.driver: cuGetProcAddress({name}) raised {exc}") from exc
    if int(got[0]) != 0 or not int(got[1]):
        raise ImportError(f"cudalink._native.driver: no driver entry point {name} ({got[0]!r})")
    cdef uintptr_t address = int(got[1])
    return address


try:
    from cuda.bindings import driver as _drv
except ImportError as exc:
    raise ImportError("cudalink._native.driver: cuda.bindings is not installed") from exc
try:
    _err = _drv.cuInit(0)[0]
except Exception as exc:  # no libcuda on this machine
    raise ImportError(f"cudalink._native.driver: cuInit raised {exc}") from exc
if int(_err) != 0:
    raise ImportError(f"cudalink._native.driver: cuInit failed ({_err!r})")

cdef cl_EventRecord_t _record = <cl_EventRecord_t>_entry(_drv, "cuEventRecord")
cdef cl_StreamWaitEvent_t _wait = <cl_StreamWaitEvent_t>_entry(_drv, "cuStreamWaitEvent")
cdef cl_EventQuery_t _query = <cl_EventQuery_t>_entry(_drv, "cuEventQuery")
cdef cl_MemcpyDtoDAsync_t _dtod = <cl_MemcpyDtoDAsync_t>_entry(_drv, "cuMemcpyDtoDAsync")
cdef cl_Memcpy2DAsync_t _copy2d = <cl_Memcpy2DAsync_t>_entry(_drv, "cuMemcpy2DAsync")
cdef cl_CtxGetCurrent_t _ctx_get = <cl_CtxGetCurrent_t>_entry(_drv, "cuCtxGetCurrent")
cdef cl_CtxSetCurrent_t _ctx_set = <cl_CtxSetCurrent_t>_entry(_drv, "cuCtxSetCurrent")


cdef int _fail(cl_CUresult err, str what) except -1:
    from cudalink.cuda.driver import cuda_error  # the one translation, shared with the Python calls

    raise cuda_error(err, what)


def record(uintptr_t event, uintptr_t stream):
    """cuEventRecord of ``event`` on ``stream``."""
    cdef cl_CUresult err = _record(<cl_CUevent>event, <cl_CUstream>stream)
    if err != CL_CUDA_SUCCESS:
        _fail(err, "cuEventRecord")


def wait(uintptr_t stream, uintptr_t event):
    """cuStreamWaitEvent: ``stream`` waits on the GPU, the CPU never does."""
    cdef cl_CUresult err = _wait(<cl_CUstream>stream, <cl_CUevent>event, 0)
    if err != CL_CUDA_SUCCESS:
        _fail(err, "cuStreamWaitEvent")


def current_context():
    """cuCtxGetCurrent: the calling thread's current context as an int (0: none)."""
    cdef cl_CUcontext ctx = NULL
    cdef cl_CUresult err = _ctx_get(&ctx)
    if err != CL_CUDA_SUCCESS:
        _fail(err, "cuCtxGetCurrent")
    return <uintptr_t>ctx


def set_context(uintptr_t ctx):
    """cuCtxSetCurrent."""
    cdef cl_CUresult err = _ctx_set(<cl_CUcontext>ctx)
    if err != CL_CUDA_SUCCESS:
        _fail(err, "cuCtxSetCurrent")


def done(uintptr_t event):
    """cuEventQuery: False only while the work before ``event`` is pending (an error has nothing left to order)."""
    return _query(<cl_CUevent>event) != CL_CUDA_ERROR_NOT_READY


def memcpy_dtod(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream):
    cdef cl_CUresult err = _dtod(<cl_CUdeviceptr>dst, <cl_CUdeviceptr>src, nbytes, <cl_CUstream>stream)
    if err != CL_CUDA_SUCCESS:
        _fail(err, "cuMemcpyDtoDAsync")


def memcpy_2d_dtod(uintptr_t dst, size_t dst_pitch, uintptr_t src, size_t src_pitch, size_t width, size_t height,
                   uintptr_t stream):
    """One pitched device-to-device copy (a source with padded rows)."""
    cdef cl_MEMCPY2D p
    memset(&p, 0, sizeof(p))
    p.srcMemoryType = CL_CU_MEMORYTYPE_DEVICE
    p.srcDevice = <cl_CUdeviceptr>src
    p.srcPitch = src_pitch
    p.dstMemoryType = CL_CU_MEMORYTYPE_DEVICE
    p.dstDevice = <cl_CUdeviceptr>dst
    p.dstPitch = dst_pitch
    p.WidthInBytes = width
    p.Height = height
    cdef cl_CUresult err = _copy2d(&p, <cl_CUstream>stream)
    if err != CL_CUDA_SUCCESS:
        _fail(err, "cuMemcpy2DAsync")
