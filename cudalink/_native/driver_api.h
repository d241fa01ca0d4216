/* The few CUDA driver entry points a frame uses, declared by ABI (no cuda.h needed to build).
 *
 * The functions themselves come from cuGetProcAddress at import (driver.pyx), through the same
 * libcuda cuda.bindings loaded, asked for the ABI of CUDA 12.0: the signatures below are those. */
#ifndef CUDALINK_DRIVER_API_H
#define CUDALINK_DRIVER_API_H

#include <stddef.h>
#include <stdint.h>

typedef int cl_CUresult;
typedef void *cl_CUevent;
typedef void *cl_CUstream;
typedef void *cl_CUcontext;
typedef uint64_t cl_CUdeviceptr;
#define CL_CUDA_SUCCESS 0
#define CL_CUDA_ERROR_NOT_READY 600
#define CL_CU_MEMORYTYPE_DEVICE 2

typedef struct {  /* CUDA_MEMCPY2D_v2 */
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    cl_CUdeviceptr srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    cl_CUdeviceptr dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} cl_MEMCPY2D;

typedef cl_CUresult (*cl_EventRecord_t)(cl_CUevent, cl_CUstream);
typedef cl_CUresult (*cl_StreamWaitEvent_t)(cl_CUstream, cl_CUevent, unsigned int);
typedef cl_CUresult (*cl_EventQuery_t)(cl_CUevent);
typedef cl_CUresult (*cl_MemcpyDtoDAsync_t)(cl_CUdeviceptr, cl_CUdeviceptr, size_t, cl_CUstream);
typedef cl_CUresult (*cl_Memcpy2DAsync_t)(const cl_MEMCPY2D *, cl_CUstream);
typedef cl_CUresult (*cl_CtxGetCurrent_t)(cl_CUcontext *);
typedef cl_CUresult (*cl_CtxSetCurrent_t)(cl_CUcontext);

#endif
