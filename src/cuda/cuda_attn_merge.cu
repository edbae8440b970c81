/*
 * cuda_attn_merge.cu: merges of attention states on the device: the plan's
 * merge of split states (every token whose attention came in several states:
 * split KV, or a cascade's levels) and the contract's merge2 / merge_n.
 *
 * A merge is m = max lse, o = sum exp(lse_i - m) o_i / sum exp(lse_i - m),
 * lse = m + log sum exp(lse_i - m); lse -inf is the empty state (weight 0,
 * and all empty gives o 0, lse -inf: no NaN).
 */
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "cuda_attn_impl.h"
#include "cuda_ptx.cuh"

/* One warp merges the states of token tkn (its contributions [c0, c1) of
 * the plan's lists co, cl) for q head hh into o and lse: the lanes look up
 * 32 contributions at once (their offsets and lse), and the weighted sum
 * loads eight states before it adds them, so that a warp waits for one round
 * of loads per eight states instead of a chain of dependent loads per state;
 * the sums run in contribution order. (Eight at a time needs the
 * 128-register bound of the kernel: ptxas capped D 128 at 64 registers and
 * spilled without it.) */
template <int D>
__device__ __forceinline__ void merge_token_head(int tkn, int c0, int c1, const int64_t *__restrict__ co,
                                                 const int64_t *__restrict__ cl, int hh, int lane,
                                                 float *__restrict__ o, float *__restrict__ lse,
                                                 const float *__restrict__ scratch, int Hq) {
    constexpr int J = D / 32, U = 8;
    auto ld = [&](const float *p) { return *p; };
    float m = -CUDART_INF_F;
    for (int c = c0 + lane; c < c1; c += 32) m = fmaxf(m, ld(scratch + cl[c] + hh));
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
    float acc[J];
#pragma unroll
    for (int j = 0; j < J; j++) acc[j] = 0.f;
    float s = 0.f;
    if (m != -CUDART_INF_F) {
        for (int base = c0; base < c1; base += 32) {
            /* lane k: contribution base + k (weight 0: an empty state, not read) */
            float f = 0.f;
            long long off = 0;
            if (base + lane < c1) {
                const float l = ld(scratch + cl[base + lane] + hh);
                if (l != -CUDART_INF_F) {
                    f = __expf(l - m);
                    off = co[base + lane] + (long long)hh * D;
                }
            }
            const int cnt = c1 - base < 32 ? c1 - base : 32;
            for (int k0 = 0; k0 < cnt; k0 += U) {
                float fu[U], v[U][J];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    fu[u] = __shfl_sync(0xffffffffu, f, (k0 + u) & 31);
                    const long long ou = __shfl_sync(0xffffffffu, off, (k0 + u) & 31);
                    const bool use = k0 + u < cnt && fu[u] != 0.f;
#pragma unroll
                    for (int j = 0; j < J; j++) v[u][j] = use ? ld(scratch + ou + lane + 32 * j) : 0.f;
                    if (!use) fu[u] = 0.f;
                }
#pragma unroll
                for (int u = 0; u < U; u++) {
                    if (fu[u] != 0.f) {
                        s += fu[u];
#pragma unroll
                        for (int j = 0; j < J; j++) acc[j] += fu[u] * v[u][j];
                    }
                }
            }
        }
    }
    float *dst = o + ((int64_t)tkn * Hq + hh) * D;
    const float inv = s > 0.f ? 1.f / s : 0.f;
#pragma unroll
    for (int j = 0; j < J; j++) dst[lane + 32 * j] = acc[j] * inv;
    if (lane == 0) lse[(int64_t)tkn * Hq + hh] = s > 0.f ? m + __logf(s) : -CUDART_INF_F;
}

/* ---- merge kernels ------------------------------------------------------ */

/* One warp per (merge token, q head): merges the token's scratch states
 * (merge_token_head; the 128-register bound keeps its eight loads in flight
 * without spills). */
template <int D>
__global__ void __launch_bounds__(256, 2)
    merge_plan_kernel(const char *__restrict__ plan, float *__restrict__ o,
                      float *__restrict__ lse, const float *__restrict__ scratch, int Hq) {
    const cas_cuda_plan_hdr *h = reinterpret_cast<const cas_cuda_plan_hdr *>(plan);
    const int32_t *mtok = reinterpret_cast<const int32_t *>(plan + h->off_merge_tok);
    const int32_t *indptr = reinterpret_cast<const int32_t *>(plan + h->off_contrib_indptr);
    const int64_t *co = reinterpret_cast<const int64_t *>(plan + h->off_contrib_o);
    const int64_t *cl = reinterpret_cast<const int64_t *>(plan + h->off_contrib_lse);
    const int64_t nw = (int64_t)gridDim.x * (blockDim.x / 32);
    const int64_t n = (int64_t)h->n_merge_tok * Hq;
    for (int64_t w = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w < n; w += nw) {
        const int i = (int)(w / Hq), hh = (int)(w - (int64_t)i * Hq);
        const int tkn = mtok[i], c0 = indptr[i], c1 = indptr[i + 1];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        /* launched as a programmatic dependent (Hopper): the plan's lists
         * above were uploaded before, the states below come from the grids
         * before this one (without a prerequisite grid this returns at once) */
        pdl_wait();
#endif
        merge_token_head<D>(tkn, c0, c1, co, cl, hh, threadIdx.x & 31, o, lse, scratch, Hq);
    }
}

/* merge of n states stored [n][rows][D] / [n][rows]: one warp per row */
__global__ void merge_states_kernel(float *o_out, float *lse_out, const float *o_in,
                                    const float *lse_in, int n, int64_t rows, int D) {
    const int lane = threadIdx.x & 31;
    const int64_t nw = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += nw) {
        float m = -CUDART_INF_F;
        for (int i = 0; i < n; i++) m = fmaxf(m, lse_in[(int64_t)i * rows + r]);
        float s = 0.f;
        if (m != -CUDART_INF_F)
            for (int i = 0; i < n; i++) {
                float l = lse_in[(int64_t)i * rows + r];
                if (l != -CUDART_INF_F) s += expf(l - m);
            }
        for (int d = lane; d < D; d += 32) {
            float acc = 0.f;
            if (m != -CUDART_INF_F)
                for (int i = 0; i < n; i++) {
                    float l = lse_in[(int64_t)i * rows + r];
                    if (l != -CUDART_INF_F) acc += expf(l - m) * o_in[((int64_t)i * rows + r) * D + d];
                }
            o_out[r * D + d] = s > 0.f ? acc / s : 0.f;
        }
        if (lane == 0) lse_out[r] = s > 0.f ? m + logf(s) : -CUDART_INF_F;
    }
}

/* out = merge(a, b), out may alias a or b: each element is read before written by one thread */
__global__ void merge2_kernel(float *o_out, float *lse_out, const float *o_a, const float *lse_a,
                              const float *o_b, const float *lse_b, int64_t rows, int D) {
    const int lane = threadIdx.x & 31;
    const int64_t nw = (int64_t)gridDim.x * (blockDim.x / 32);
    for (int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += nw) {
        const float la = lse_a[r], lb = lse_b[r];
        const float m = fmaxf(la, lb);
        float wa = 0.f, wb = 0.f, l = -CUDART_INF_F;
        if (m != -CUDART_INF_F) {
            float ea = expf(la - m), eb = expf(lb - m), s = ea + eb;
            wa = ea / s;
            wb = eb / s;
            l = m + logf(s);
        }
        __syncwarp();
        for (int d = lane; d < D; d += 32) {
            float va = wa != 0.f ? wa * o_a[r * D + d] : 0.f;
            float vb = wb != 0.f ? wb * o_b[r * D + d] : 0.f;
            o_out[r * D + d] = va + vb;
        }
        __syncwarp();
        if (lane == 0) lse_out[r] = l;
    }
}

/* ---- launchers ---------------------------------------------------------- */

template <int D>
static int launch_merge_d(const void *plan, float *o, float *lse, const float *scratch, int Hq, int grid,
                          int pdl, cudaStream_t st) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cas_launch_cfg(&attr, grid, 256, 0, st, pdl);
    return (int)cudaLaunchKernelEx(&cfg, merge_plan_kernel<D>, (const char *)plan, o, lse, scratch, Hq);
}

extern "C" int cas_cuda_launch_merge(const cas_cuda_geom *g, const void *plan, float *o,
                                     float *lse, const float *scratch, int grid, int pdl, void *stream) {
    cudaStream_t st = (cudaStream_t)stream;
    switch (g->D) {
    case 64: return launch_merge_d<64>(plan, o, lse, scratch, g->Hq, grid, pdl, st);
    case 96: return launch_merge_d<96>(plan, o, lse, scratch, g->Hq, grid, pdl, st);
    case 128: return launch_merge_d<128>(plan, o, lse, scratch, g->Hq, grid, pdl, st);
    case 256: return launch_merge_d<256>(plan, o, lse, scratch, g->Hq, grid, pdl, st);
    default: return (int)cudaErrorInvalidValue;
    }
}

static int merge_grid(int64_t rows) {
    int64_t b = (rows + 7) / 8;
    if (b > 4096) b = 4096;
    return b < 1 ? 1 : (int)b;
}

extern "C" int cas_cuda_launch_merge_states(float *o_out, float *lse_out, const float *o_in,
                                            const float *lse_in, int n, int64_t rows, int32_t D,
                                            void *stream) {
    if (rows <= 0) return 0;
    merge_states_kernel<<<merge_grid(rows), 256, 0, (cudaStream_t)stream>>>(o_out, lse_out, o_in,
                                                                            lse_in, n, rows, D);
    return (int)cudaGetLastError();
}

extern "C" int cas_cuda_launch_merge2(float *o_out, float *lse_out, const float *o_a,
                                      const float *lse_a, const float *o_b, const float *lse_b,
                                      int64_t rows, int32_t D, void *stream) {
    if (rows <= 0) return 0;
    merge2_kernel<<<merge_grid(rows), 256, 0, (cudaStream_t)stream>>>(o_out, lse_out, o_a, lse_a,
                                                                      o_b, lse_b, rows, D);
    return (int)cudaGetLastError();
}

