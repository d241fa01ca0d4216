# The DLPack structs of dlpack_abi.h, declared once for every module of the compiled core that uses them.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t


cdef extern from "dlpack_abi.h":
    ctypedef struct cl_DLDevice:
        int32_t device_type
        int32_t device_id
    ctypedef struct cl_DLDataType:
        uint8_t code
        uint8_t bits
        unsigned short lanes
    ctypedef struct cl_DLTensor:
        void *data
        cl_DLDevice device
        int32_t ndim
        cl_DLDataType dtype
        int64_t *shape
        int64_t *strides
        unsigned long long byte_offset
    ctypedef struct cl_DLPackVersion:
        unsigned int major
        unsigned int minor
    ctypedef int (*cl_DLTensorFromPyObject_t)(void *py_object, cl_DLTensor *out)
    ctypedef int (*cl_CurrentWorkStream_t)(int32_t device_type, int32_t device_id, void **out_stream)
    ctypedef struct cl_DLPackExchangeAPI:
        cl_DLPackVersion version
        cl_DLTensorFromPyObject_t dltensor_from_py_object_no_sync
        cl_CurrentWorkStream_t current_work_stream
    ctypedef struct cl_DLManagedTensor:
        cl_DLTensor dl_tensor
        void *manager_ctx
        void (*deleter)(cl_DLManagedTensor *) noexcept nogil
    ctypedef struct cl_DLManagedTensorVersioned:
        cl_DLPackVersion version
        void *manager_ctx
        void (*deleter)(cl_DLManagedTensorVersioned *) noexcept nogil
        uint64_t flags
        cl_DLTensor dl_tensor
    int CL_DLPACK_MAJOR, CL_KDLCPU, CL_KDLCUDA
    uint64_t CL_DLPACK_FLAG_READ_ONLY
