/* The stamp/lease handshake's memory operations, for cudalink._native.ring.
 *
 * Cells are naturally aligned little-endian integers in shared memory (transport/wire.py). Loads
 * acquire, stores release, and cl_fence() is the full barrier each side of the Dekker handshake puts
 * between its store and its load. One header, so the platform split stays in one place.
 */
#ifndef CUDALINK_ATOMICS_H
#define CUDALINK_ATOMICS_H

#include <stdint.h>

#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
#include <windows.h>
#if defined(_M_ARM64) || defined(_M_ARM)
/* ARM: volatile orders nothing in hardware (/volatile:iso is the default there): a barrier by each access */
#define CL_ORDER() MemoryBarrier()
#else
/* x86/x64: the hardware keeps loads and stores in order (TSO); the compiler is kept from moving them */
#define CL_ORDER() _ReadWriteBarrier()
#endif
static inline uint64_t cl_load64(const void *p) { uint64_t v = *(const volatile uint64_t *)p; CL_ORDER(); return v; }
static inline uint32_t cl_load32(const void *p) { uint32_t v = *(const volatile uint32_t *)p; CL_ORDER(); return v; }
static inline void cl_store64(void *p, uint64_t v) { CL_ORDER(); *(volatile uint64_t *)p = v; }
static inline void cl_store32(void *p, uint32_t v) { CL_ORDER(); *(volatile uint32_t *)p = v; }
static inline void cl_fence(void) { MemoryBarrier(); }
#define CL_LITTLE_ENDIAN 1
#else
static inline uint64_t cl_load64(const void *p) { return __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE); }
static inline uint32_t cl_load32(const void *p) { return __atomic_load_n((const uint32_t *)p, __ATOMIC_ACQUIRE); }
static inline void cl_store64(void *p, uint64_t v) { __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE); }
static inline void cl_store32(void *p, uint32_t v) { __atomic_store_n((uint32_t *)p, v, __ATOMIC_RELEASE); }
static inline void cl_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#define CL_LITTLE_ENDIAN (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)
#endif

#endif
