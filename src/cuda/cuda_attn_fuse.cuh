/*
 * cuda_attn_fuse.cuh: the merge of split states inside the attention kernels
 * (kind 18, the plan header's merge_fused), shared by the narrow kernel
 * (cuda_attn_kernels.cu) and the many-rows wgmma kernel (cuda_attn_wgmma.cu).
 *
 * A token whose attention comes in several states (split KV, or a cascade's
 * levels) has, per KV head, a counter in device memory and a number of
 * writer units that write its states: a unit is a narrow task or one
 * consumer warpgroup's 64 rows of a many-rows task (the planner counts them,
 * merge_need). When a unit has written its states, one thread per token of
 * its rows orders those writes before an increment of the token's counter
 * (a gpu-scope fence, the release of CUTLASS's split-K semaphore); the unit
 * that brings the counter to merge_need writes the merged output and
 * log-sum-exp of the token's group heads and sets the counter back to zero,
 * so that the next run, or a graph replay, starts from zero without a reset.
 * This replaces the merge kernel and the wait for the attention grids that
 * came before it.
 */
#ifndef CASCADE_CUDA_ATTN_FUSE_CUH
#define CASCADE_CUDA_ATTN_FUSE_CUH

#include <math_constants.h>

#include "cuda_attn_impl.h"

/* One warp merges the states of token tkn (its contributions [c0, c1) of
 * the plan's lists co, cl) for q head hh into o and lse: the lanes look up
 * 32 contributions at once (their offsets and lse), and the weighted sum
 * loads eight states before it adds them, so that a warp waits for one round
 * of loads per eight states instead of a chain of dependent loads per state;
 * the sums run in contribution order. FUSED: the states come from other SMs
 * of the same grid, read from L2 (.cg); else (the merge kernel) plain loads
 * of the kernel's read-only scratch, as v11 compiled them. (Eight at a time needs the 128-register bound: ptxas
 * capped D 128 at 64 registers and spilled without it.) */
template <int D, bool FUSED>
__device__ __forceinline__ void merge_token_head(int tkn, int c0, int c1, const int64_t *__restrict__ co,
                                                 const int64_t *__restrict__ cl, int hh, int lane,
                                                 float *__restrict__ o, float *__restrict__ lse,
                                                 const float *__restrict__ scratch, int Hq) {
    constexpr int J = D / 32, U = 8;
    auto ld = [&](const float *p) { return FUSED ? __ldcg(p) : *p; };
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

/* Called by the nthr threads of a unit (tid 0 .. nthr - 1, whole warps)
 * after they wrote the states of rows [r_lo, r_hi) of task t (relative to
 * t.row0) into scratch; sync() synchronizes exactly those threads. s_list
 * (at least r_hi - r_lo ints) and *s_n (0 on entry, and 0 again on return)
 * are the unit's shared memory. Each warp merges (token, group head) pairs
 * with merge_token_head. */
template <int D, typename Sync>
__device__ __forceinline__ void fused_merge(const char *__restrict__ plan, const cas_cuda_task &t,
                                            int r_lo, int r_hi, int tid, int nthr, int *s_list,
                                            int *s_n, float *__restrict__ o, float *__restrict__ lse,
                                            const float *scratch, int Hq, int Hkv, Sync sync) {
    const cas_cuda_plan_hdr *h = reinterpret_cast<const cas_cuda_plan_hdr *>(plan);
    const int group = h->group;
    const cas_cuda_pass *passes = reinterpret_cast<const cas_cuda_pass *>(plan + h->off_passes);
    const int32_t *tok_ids = reinterpret_cast<const int32_t *>(plan + h->off_tok_ids);
    const int32_t *tok_merge = reinterpret_cast<const int32_t *>(plan + h->off_tok_merge);
    const int32_t *need = reinterpret_cast<const int32_t *>(plan + h->off_merge_need);
    int *cnt = reinterpret_cast<int *>(h->merge_cnt);
    const int tok_off = passes[t.pass].tok_off;
    const int tk0 = (t.row0 + r_lo) / group, ntk = (t.row0 + r_hi - 1) / group - tk0 + 1;
    sync(); /* the unit's states are written */
    for (int k = tid; k < ntk; k += nthr) {
        const int m = tok_merge[tok_ids[tok_off + tk0 + k]];
        int *c = cnt + (int64_t)m * Hkv + t.kv_head;
        __threadfence();
        if (atomicAdd(c, 1) == need[m] - 1) {
            /* the last unit: no other one touches the counter in this run */
            *c = 0;
            __threadfence();
            s_list[atomicAdd(s_n, 1)] = m;
        }
    }
    sync();
    const int n = *s_n, lane = tid & 31;
    const int32_t *mtok = reinterpret_cast<const int32_t *>(plan + h->off_merge_tok);
    const int32_t *indptr = reinterpret_cast<const int32_t *>(plan + h->off_contrib_indptr);
    const int64_t *co = reinterpret_cast<const int64_t *>(plan + h->off_contrib_o);
    const int64_t *cl = reinterpret_cast<const int64_t *>(plan + h->off_contrib_lse);
    for (int p = tid >> 5; p < n * group; p += nthr >> 5) {
        const int m = s_list[p / group];
        merge_token_head<D, true>(mtok[m], indptr[m], indptr[m + 1], co, cl, t.kv_head * group + p % group,
                                  lane, o, lse, scratch, Hq);
    }
    sync(); /* every thread has read *s_n and s_list */
    if (tid == 0) *s_n = 0;
}

#endif
