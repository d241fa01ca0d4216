/* The DLPack structs cudalink reads and writes, declared by ABI (DLPack 1.x, dlpack.h).
 *
 * What ``exchange.pyx`` reads (a DLTensor filled by the producer, and the function table a framework
 * publishes on its array type as ``__dlpack_c_exchange_api__``) and the two managed tensors
 * ``dlpack.pyx`` hands out in capsules. */
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

/* "dltensor": DLPack 0.x, for consumers that pass no max_version (JAX) */
typedef struct cl_DLManagedTensor {
    cl_DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct cl_DLManagedTensor *self);
} cl_DLManagedTensor;

/* "dltensor_versioned": DLPack 1.x, which can say read-only */
typedef struct cl_DLManagedTensorVersioned {
    cl_DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct cl_DLManagedTensorVersioned *self);
    uint64_t flags;
    cl_DLTensor dl_tensor;
} cl_DLManagedTensorVersioned;

#define CL_DLPACK_FLAG_READ_ONLY 1ULL
#define CL_DLPACK_MAJOR 1
#define CL_KDLCPU 1
#define CL_KDLCUDA 2

#endif
