/*
 * cuda_stub.c: the CUDA runtime calls and kernel launchers that the CUDA
 * backend's host code (src/cuda/cuda_attn.c, cuda_attn_plan.c) makes, as host-memory stand-ins,
 * so that its planner runs on a machine without a GPU (test_cuda_plan.c).
 * "Device" memory is host memory; copies and sets are memcpy and memset; the
 * device is an H200's shape (132 SMs, compute capability 9.0). Launchers
 * launch nothing: a run is not for this build.
 */
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda_stub.h"

void *cas_stub_last_h2d;
size_t cas_stub_last_h2d_bytes;

cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
    *value = attr == cudaDevAttrMultiProcessorCount ? CAS_STUB_SMS
             : attr == cudaDevAttrComputeCapabilityMajor ? 9
                                                         : 0;
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaMalloc(void **p, size_t n) {
    *p = calloc(1, n ? n : 1);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaMalloc(p, n); }
cudaError_t cudaFree(void *p) {
    free(p);
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

/* the backend's launchers (cuda_attn_impl.h) */
const char *cas_cuda_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
int cas_cuda_wgmma_supported(int D) { return D == 128; }
/* one CTA per SM for the wgmma kernel (its shared memory), two for the
 * mma.sync kernels */
int cas_cuda_attn_occupancy(const cas_cuda_geom *g, int wide, int *ctas_per_sm) {
    *ctas_per_sm = wide == CAS_CUDA_WIDE_WGMMA ? 1 : 2;
    return 0;
}
int cas_cuda_wgmma_occupancy(const cas_cuda_geom *g, int *ctas_per_sm) {
    *ctas_per_sm = 1;
    return 0;
}
int cas_cuda_launch_attn(const cas_cuda_geom *g, const void *plan, const void *k, const void *v, const void *q,
                         float *o, float *lse, float *scratch, int wide, int grid, void *stream) {
    return (int)cudaErrorNotSupported;
}
int cas_cuda_launch_attn_wgmma(const cas_cuda_geom *g, const void *plan, const void *k, const void *v,
                               const void *q, float *o, float *lse, float *scratch, int grid, void *stream) {
    return (int)cudaErrorNotSupported;
}
int cas_cuda_launch_merge(const cas_cuda_geom *g, const void *plan, float *o, float *lse, const float *scratch,
                          int grid, int pdl, void *stream) {
    return (int)cudaErrorNotSupported;
}
int cas_cuda_launch_merge_states(float *o_out, float *lse_out, const float *o_in, const float *lse_in, int n,
                                 int64_t rows, int32_t D, void *stream) {
    return (int)cudaErrorNotSupported;
}
int cas_cuda_launch_merge2(float *o_out, float *lse_out, const float *o_a, const float *lse_a, const float *o_b,
                           const float *lse_b, int64_t rows, int32_t D, void *stream) {
    return (int)cudaErrorNotSupported;
}
