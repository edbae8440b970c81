/*
 * cuda_stub.c: the kernel launchers that the CUDA backend's host code
 * (src/cuda/cuda_attn.c, cuda_attn_plan.c) calls, as stand-ins, so that its
 * planner runs on a machine without a GPU (test_cuda_plan.c, with the
 * runtime's stand-ins of cuda_rt_stub.c). Launchers launch nothing: a run is
 * not for this build.
 */
#include <cuda_runtime_api.h>

#include "cuda_stub.h"

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
