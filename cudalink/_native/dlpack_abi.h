/* The DLPack structs the C exchange API passes, declared by ABI (DLPack 1.x, dlpack.h).
 *
 * Only what ``exchange.pyx`` reads: a DLTensor filled by the producer, and the function table a
 * framework publishes on its array type as ``__dlpack_c_exchange_api__``. */
#ifndef CUDALINK_DLPACK_ABI_H
#define CUDALINK_DLPACK_ABI_H

#include <stdint.h>

typedef struct { int32_t device_type; int32_t device_id; } cl_DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } cl_DLDataType;

typedef struct {
    void *data;
    cl_DLDevice device;
    int32_t ndim;
    cl_DLDataType dtype;
    int64_t *shape;
    int64_t *strides;  /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} cl_DLTensor;

typedef struct { uint32_t major; uint32_t minor; } cl_DLPackVersion;

typedef int (*cl_DLTensorFromPyObject_t)(void *py_object, cl_DLTensor *out);
typedef int (*cl_CurrentWorkStream_t)(int32_t device_type, int32_t device_id, void **out_stream);

typedef struct {
    cl_DLPackVersion version;
    void *prev_api;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    cl_DLTensorFromPyObject_t dltensor_from_py_object_no_sync;  /* may be NULL */
    cl_CurrentWorkStream_t current_work_stream;
} cl_DLPackExchangeAPI;

#define CL_DLPACK_MAJOR 1
#define CL_KDLCPU 1
#define CL_KDLCUDA 2

#endif
