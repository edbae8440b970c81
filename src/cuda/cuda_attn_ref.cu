/*
 * cuda_attn_ref.cu: the float64 reference on the device: the definition of
 * src/attn/attn.h computed directly, one warp per (query token, q head), in
 * double precision, from the pools and the batch (no plan, no tiles, no
 * split). It is the oracle of the benchmarks' checks where the CPU reference
 * (cas_attn_reference) would take minutes, such as a 32k-token prefix under
 * 256 requests or a 16k-token prefill; the tests check it against the CPU
 * reference.
 *
 * Lane i holds elements i, i + 32, ... of the row's query and output; each
 * visible key's score is the warp's sum of the lanes' products (a shuffle
 * tree), then an online softmax in double: slow and simple on purpose.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "cuda_attn_impl.h"

template <typename T> __device__ __forceinline__ double to_double(T x);
template <> __device__ __forceinline__ double to_double(__nv_bfloat16 x) { return (double)__bfloat162float(x); }
template <> __device__ __forceinline__ double to_double(__half x) { return (double)__half2float(x); }

/* tok_req[t], tok_pos[t]: the request of query token t and its absolute
 * position; kv_len[r]: request r's keys */
template <typename T, int D>
__global__ void __launch_bounds__(256)
    attn_reference_kernel(const T *__restrict__ k, const T *__restrict__ v, const T *__restrict__ q,
                          const int32_t *__restrict__ tok_req, const int32_t *__restrict__ tok_pos,
                          const int32_t *__restrict__ kv_indptr, const int32_t *__restrict__ kv_indices,
                          const int32_t *__restrict__ kv_len, int32_t total_q, int Hq, int Hkv, int P,
                          int causal, int window, float soft_cap, float scale, double *__restrict__ o_ref,
                          double *__restrict__ lse_ref) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    const int64_t w = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (w >= (int64_t)total_q * Hq) return;
    const int t = (int)(w / Hq), h = (int)(w - (int64_t)t * Hq), kvh = h / (Hq / Hkv);
    const int r = tok_req[t], p = tok_pos[t], n = kv_len[r];
    double qd[E], acc[E];
#pragma unroll
    for (int e = 0; e < E; e++) {
        qd[e] = to_double(q[((int64_t)t * Hq + h) * D + lane + 32 * e]);
        acc[e] = 0.0;
    }
    int lo = 0, hi = n;
    if (window >= 0 && p - window > lo) lo = p - window;
    if (causal && p + 1 < hi) hi = p + 1;
    double m = -CUDART_INF, l = 0.0;
    const double sc = (double)scale, cap = (double)soft_cap;
    for (int j = lo; j < hi; j++) {
        const int64_t page = kv_indices[kv_indptr[r] + j / P];
        const int64_t base = ((page * P + j % P) * Hkv + kvh) * D;
        double dot = 0.0;
#pragma unroll
        for (int e = 0; e < E; e++) dot += qd[e] * to_double(k[base + lane + 32 * e]);
#pragma unroll
        for (int x = 16; x > 0; x >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, x);
        double s = dot * sc;
        if (cap > 0.0) s = cap * tanh(s / cap);
        if (s > m) {
            const double f = exp(m - s); /* 0 on the first key */
            l *= f;
#pragma unroll
            for (int e = 0; e < E; e++) acc[e] *= f;
            m = s;
        }
        const double pj = exp(s - m);
        l += pj;
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] += pj * to_double(v[base + lane + 32 * e]);
    }
#pragma unroll
    for (int e = 0; e < E; e++) o_ref[w * D + lane + 32 * e] = l > 0.0 ? acc[e] / l : 0.0;
    if (lane == 0) lse_ref[w] = l > 0.0 ? m + log(l) : -CUDART_INF;
}

template <typename T, int D>
static int launch_ref(const cas_cuda_geom *g, const void *k, const void *v, const void *q, const int32_t *tok_req,
                      const int32_t *tok_pos, const int32_t *kv_indptr, const int32_t *kv_indices,
                      const int32_t *kv_len, int32_t total_q, int causal, int window, float soft_cap, float scale,
                      double *o_ref, double *lse_ref, cudaStream_t st) {
    const int64_t warps = (int64_t)total_q * g->Hq;
    if (warps == 0) return 0;
    attn_reference_kernel<T, D><<<(unsigned)((warps + 7) / 8), 256, 0, st>>>(
        (const T *)k, (const T *)v, (const T *)q, tok_req, tok_pos, kv_indptr, kv_indices, kv_len, total_q, g->Hq,
        g->Hkv, g->page_size, causal, window, soft_cap, scale, o_ref, lse_ref);
    return (int)cudaGetLastError();
}

#define CAS_REF_D(T)                                                                                            \
    switch (g->D) {                                                                                             \
    case 64: return launch_ref<T, 64>(g, k, v, q, tok_req, tok_pos, kv_indptr, kv_indices, kv_len, total_q,      \
                                      causal, window_left, soft_cap, scale, o_ref, lse_ref, st);                \
    case 96: return launch_ref<T, 96>(g, k, v, q, tok_req, tok_pos, kv_indptr, kv_indices, kv_len, total_q,      \
                                      causal, window_left, soft_cap, scale, o_ref, lse_ref, st);                \
    case 128: return launch_ref<T, 128>(g, k, v, q, tok_req, tok_pos, kv_indptr, kv_indices, kv_len, total_q,    \
                                        causal, window_left, soft_cap, scale, o_ref, lse_ref, st);              \
    case 256: return launch_ref<T, 256>(g, k, v, q, tok_req, tok_pos, kv_indptr, kv_indices, kv_len, total_q,    \
                                        causal, window_left, soft_cap, scale, o_ref, lse_ref, st);              \
    default: return (int)cudaErrorInvalidValue;                                                                 \
    }

extern "C" int cas_cuda_launch_reference(const cas_cuda_geom *g, const void *k, const void *v, const void *q,
                                         const int32_t *tok_req, const int32_t *tok_pos, const int32_t *kv_indptr,
                                         const int32_t *kv_indices, const int32_t *kv_len, int32_t total_q,
                                         int causal, int window_left, float soft_cap, float scale, double *o_ref,
                                         double *lse_ref, void *stream) {
    cudaStream_t st = (cudaStream_t)stream;
    if (g->dtype == 2) CAS_REF_D(__nv_bfloat16)
    if (g->dtype == 1) CAS_REF_D(__half)
    return (int)cudaErrorInvalidValue;
}
