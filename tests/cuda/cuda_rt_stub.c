/*
 * cuda_rt_stub.c: the CUDA runtime calls of the backends' host code as
 * host-memory stand-ins, for the tests that run that code on a machine
 * without a GPU (test_cuda_plan with cuda_stub.c; the GPU forward and engine
 * with gpu_stub.c). "Device" memory is host memory; copies and sets are
 * memcpy and memset, complete on return; the device is an H200's shape (132
 * SMs, compute capability 9.0).
 */
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda_stub.h"

void *cas_stub_last_h2d;
size_t cas_stub_last_h2d_bytes;

cudaError_t cudaSetDevice(int device) {
    return device >= 0 && device < CAS_STUB_DEVICES ? cudaSuccess : cudaErrorInvalidDevice;
}
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
    *value = attr == cudaDevAttrMultiProcessorCount ? CAS_STUB_SMS
             : attr == cudaDevAttrComputeCapabilityMajor ? 9
                                                         : 0;
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
/* The device has CAS_STUB_DEVICE_BYTES: an allocation past them fails, as on
 * a GPU (and is never asked of the host); each block keeps its size in front. */
static _Atomic size_t stub_used;
cudaError_t cudaMalloc(void **p, size_t n) {
    *p = NULL;
    if (n > CAS_STUB_DEVICE_BYTES - stub_used) return cudaErrorMemoryAllocation;
    char *b = calloc(1, n + 64);
    if (!b) return cudaErrorMemoryAllocation;
    memcpy(b, &n, sizeof n);
    stub_used += n;
    *p = b + 64;
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaMalloc(p, n); }
cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    char *b = (char *)p - 64;
    size_t n;
    memcpy(&n, b, sizeof n);
    stub_used -= n;
    free(b);
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
    *free_b = CAS_STUB_DEVICE_BYTES - stub_used;
    *total_b = CAS_STUB_DEVICE_BYTES;
    return cudaSuccess;
}
cudaError_t cudaFreeHost(void *p) { return cudaFree(p); }
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind) {
    memcpy(dst, src, n);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s) {
    memcpy(dst, src, n);
    if (kind == cudaMemcpyHostToDevice) {
        cas_stub_last_h2d = dst;
        cas_stub_last_h2d_bytes = n;
    }
    return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t s) {
    for (size_t i = 0; i < height; i++) memcpy((char *)dst + i * dpitch, (const char *)src + i * spitch, width);
    return cudaSuccess;
}
cudaError_t cudaMemset(void *p, int v, size_t n) {
    memset(p, v, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) { return cudaMemset(p, v, n); }
/* events and streams: distinct non-null handles that are never dereferenced */
static char handles[1];
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
    *e = (cudaEvent_t)(void *)handles;
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
    *s = (cudaStream_t)(void *)handles;
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) { return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "error (stub)"; }
