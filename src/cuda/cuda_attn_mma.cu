/*
 * cuda_attn_mma.cu: the attention kernel for any sm_80+ GPU (mma.sync), and
 * its launchers.
 *
 * One kernel template serves every pass of a plan (decode rows, prefill
 * chunks, shared prefix nodes, request tails): a CTA takes a task (rows of
 * one pass for one KV head, a key range of the pass's segment), keeps the
 * rows' queries in registers, streams the segment's K and V pages through
 * shared memory with cp.async (STAGES deep) and computes S = Q K^T and O += P V
 * with mma.sync m16n8k16 (bf16 or f16 operands, f32 accumulation), with an
 * online softmax in the log2 domain. Masks are applied per (query position,
 * key position), only on tiles that need them.
 *
 * The CTA's warps form a WM x WN grid: WM warps split the rows (16 each) and
 * share every K/V tile (the shared-node pass: many queries over one KV run,
 * where the tensor cores do the work), WN warps split each tile's keys and
 * merge their states at the end (decode rows: few rows, the bytes are the
 * work). The "wide" instance is 4 x 1 (64 rows): the many-rows kernel where
 * the GPU has no wgmma or head_dim is not 128; the "narrow" one 1 x 4 runs
 * the decode rows everywhere.
 *
 * Grids are persistent and their size never depends on the plan; task counts
 * are read from the plan block in device memory, so a captured graph replays
 * correctly after a re-plan.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "cuda_attn_impl.h"
#include "cuda_ptx.cuh"

/* ---- configuration ------------------------------------------------------ */

/* WM x WN warps; each warp holds MT m-tiles of 16 rows; BN keys per warp per
 * stage. */
template <int D_, int WM_, int WN_, int MT_, int BN_, int STAGES_> struct cfg {
    static constexpr int D = D_, WM = WM_, WN = WN_, MT = MT_, BN = BN_, STAGES = STAGES_;
    static constexpr int NT = 32 * WM * WN;
    static constexpr int ROWS = 16 * MT * WM;
    static constexpr int KEYS = WN * BN; /* keys per pipeline stage */
    static constexpr int LD = D + 8;     /* smem row pitch (elements): 16 B pad, no ldmatrix conflicts */
    static constexpr int CPR = D / 8;    /* 16-byte chunks per row */
    static constexpr bool Q_REGS = D <= 128 && MT == 1;
    static constexpr size_t Q_BYTES = (size_t)ROWS * LD * 2;
    static constexpr size_t KV_STAGE = (size_t)KEYS * LD * 2;
    static constexpr size_t MERGE_BYTES = WN > 1 ? (size_t)WN * ROWS * (D + 2) * 4 : 0;
    static constexpr size_t KV_BYTES = 2 * STAGES * KV_STAGE;
    static constexpr size_t SMEM = Q_BYTES + (KV_BYTES > MERGE_BYTES ? KV_BYTES : MERGE_BYTES);
    static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
    static_assert(BN % 16 == 0, "BN must be a multiple of 16");
    static_assert(WN == 1 || MT == 1, "split keys only with one m-tile per warp");
};

/* wide: 4 warps x 1 m-tile (64 rows), 64 keys per stage (32 for D 256);
 * narrow: 1 x 4 warps, 16 rows, each warp 16 keys of a stage */
template <int D> struct wide_cfg : cfg<D, 4, 1, 1, (D <= 128 ? 64 : 32), 2> {};
template <int D> struct narrow_cfg : cfg<D, 1, 4, 1, 16, (D <= 128 ? 3 : 2)> {};

/* ---- the attention kernel ----------------------------------------------- */

template <typename T, typename C>
__global__ void __launch_bounds__(C::NT)
    attn_kernel(const char *__restrict__ plan, const T *__restrict__ kpool,
                const T *__restrict__ vpool, const T *__restrict__ q, float *__restrict__ o,
                float *__restrict__ lse, float *__restrict__ scratch, int Hq, int Hkv, int P,
                int list) {
    constexpr int D = C::D, WN = C::WN, MT = C::MT, BN = C::BN, STAGES = C::STAGES, NT = C::NT;
    constexpr int ROWS = C::ROWS, KEYS = C::KEYS, LD = C::LD, CPR = C::CPR;
    extern __shared__ __align__(16) unsigned char smem[];
    T *sQ = reinterpret_cast<T *>(smem);
    T *sK = reinterpret_cast<T *>(smem + C::Q_BYTES);
    T *sV = sK + (size_t)STAGES * KEYS * LD;
    __shared__ int s_qpos[ROWS];
    __shared__ long long s_qrow[ROWS], s_oo[ROWS], s_lo[ROWS];

    const cas_cuda_plan_hdr *h = reinterpret_cast<const cas_cuda_plan_hdr *>(plan);
    /* list: 0 narrow tasks, 1 many-rows tasks */
    const int ntask = list ? h->n_tasks_wide : h->n_tasks_narrow;
    const cas_cuda_task *tasks = reinterpret_cast<const cas_cuda_task *>(
        plan + (list ? h->off_tasks_wide : h->off_tasks_narrow));
    const cas_cuda_pass *passes = reinterpret_cast<const cas_cuda_pass *>(plan + h->off_passes);
    const int32_t *pages = reinterpret_cast<const int32_t *>(plan + h->off_pages);
    const int32_t *tok_ids = reinterpret_cast<const int32_t *>(plan + h->off_tok_ids);
    const int32_t *tok_pos = reinterpret_cast<const int32_t *>(plan + h->off_tok_pos);
    const int group = h->group, causal = h->causal, window = h->window_left;
    const float scale_log2 = h->scale_log2, cap = h->soft_cap, scale = h->scale;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % C::WM, wn = warp / C::WM;
    const int64_t page_stride = (int64_t)P * Hkv * D; /* elements per page */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    /* on Hopper the many-rows kernel is launched as a programmatic dependent
     * of this one (cas_cuda_attn_run): its CTAs may take SMs as these leave
     * (without a dependent this does nothing) */
    if (list == 0) pdl_launch_dependents();
#endif

    auto run_task = [&](const cas_cuda_task &t) {
        const cas_cuda_pass ps = passes[t.pass];
        for (int r0 = tid; r0 < ROWS; r0 += NT) {
            int r = r0 < t.nrows ? r0 : t.nrows - 1; /* padding rows repeat the last row */
            int row = t.row0 + r;
            int tk = row / group, g = row - tk * group;
            int tokid = tok_ids[ps.tok_off + tk];
            int hq = t.kv_head * group + g;
            s_qpos[r0] = tok_pos[ps.tok_off + tk];
            s_qrow[r0] = ((long long)tokid * Hq + hq) * D;
            if (t.o_off < 0) {
                s_oo[r0] = ((long long)tokid * Hq + hq) * D;
                s_lo[r0] = (long long)tokid * Hq + hq;
            } else {
                s_oo[r0] = t.o_off + ((long long)tk * Hq + hq) * D;
                s_lo[r0] = t.lse_off + (long long)tk * Hq + hq;
            }
        }
        __syncthreads();
        for (int c = tid; c < ROWS * CPR; c += NT) {
            int r = c / CPR, ch = c - r * CPR;
            cp_async16(sQ + r * LD + ch * 8, q + s_qrow[r] + ch * 8, r < t.nrows ? 16 : 0);
        }
        const int nkeys = t.kv1 - t.kv0;
        const int ntiles = nkeys > 0 ? (nkeys + KEYS - 1) / KEYS : 0;
        const T *kbase = kpool + (int64_t)t.kv_head * D;
        const T *vbase = vpool + (int64_t)t.kv_head * D;

        /* K/V tile loads: chunk ch = c % CPR of key c / CPR for c = tid +
         * it NT. Where a warp's keys fit (KW keys per iteration, NI
         * iterations: at most 32), lane j looks up the page and row of one
         * of them (iteration j % NI, key j / NI of the iteration) and the
         * CPR lanes of a key take them by shuffle: one page-id load and one
         * division per lane and tile instead of one per 16-byte chunk */
        constexpr int NI = (KEYS * CPR + NT - 1) / NT;
        constexpr int KW = 32 / CPR;
        constexpr bool SHARED_IDS = 32 % CPR == 0 && NT % 32 == 0 && KEYS * CPR % NT == 0 && NI * KW <= 32;
        auto load_tile = [&](int tile) {
            const int slot = tile % STAGES;
            T *dk = sK + (size_t)slot * KEYS * LD;
            T *dv = sV + (size_t)slot * KEYS * LD;
            const int k0 = t.kv0 + tile * KEYS;
            if constexpr (SHARED_IDS) {
                int pg_own = 0, pr_own = -1;
                if (lane < NI * KW) {
                    const int kidx = k0 + warp * KW + lane / NI + (lane % NI) * (NT / CPR);
                    if (kidx < t.kv1) {
                        const int pi = kidx / P;
                        pg_own = pages[ps.page_off + pi];
                        pr_own = kidx - pi * P;
                    }
                }
                const int h = lane / CPR, ch = lane % CPR;
#pragma unroll
                for (int it = 0; it < NI; it++) {
                    const int pg = __shfl_sync(0xffffffffu, pg_own, h * NI + it);
                    const int pr = __shfl_sync(0xffffffffu, pr_own, h * NI + it);
                    const int key = warp * KW + h + it * (NT / CPR);
                    const int64_t off = (int64_t)pg * page_stride + (int64_t)(pr > 0 ? pr : 0) * (Hkv * D) + ch * 8;
                    cp_async16(dk + key * LD + ch * 8, kbase + off, pr >= 0 ? 16 : 0);
                    cp_async16(dv + key * LD + ch * 8, vbase + off, pr >= 0 ? 16 : 0);
                }
            } else {
#pragma unroll
                for (int it = 0; it < NI; it++) {
                    int c = tid + it * NT;
                    if (KEYS * CPR % NT == 0 || c < KEYS * CPR) {
                        int key = c / CPR, ch = c - key * CPR;
                        int kidx = k0 + key;
                        int ok = kidx < t.kv1;
                        int kk = ok ? kidx : t.kv0;
                        int pg = pages[ps.page_off + kk / P];
                        int64_t off = (int64_t)pg * page_stride + (int64_t)(kk % P) * Hkv * D + ch * 8;
                        cp_async16(dk + key * LD + ch * 8, kbase + off, ok ? 16 : 0);
                        cp_async16(dv + key * LD + ch * 8, vbase + off, ok ? 16 : 0);
                    }
                }
            }
        };

#pragma unroll
        for (int s = 0; s < STAGES - 1; s++) {
            if (s < ntiles) load_tile(s);
            cp_async_commit();
        }

        float oacc[MT][D / 8][4];
        float mrow[MT][2], lrow[MT][2];
        int qp[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int i = 0; i < D / 8; i++) oacc[mt][i][0] = oacc[mt][i][1] = oacc[mt][i][2] = oacc[mt][i][3] = 0.f;
            mrow[mt][0] = mrow[mt][1] = -CUDART_INF_F;
            lrow[mt][0] = lrow[mt][1] = 0.f;
            qp[mt][0] = s_qpos[(wm * MT + mt) * 16 + (lane >> 2)];
            qp[mt][1] = s_qpos[(wm * MT + mt) * 16 + (lane >> 2) + 8];
        }
        uint32_t qf[C::Q_REGS ? D / 16 : 1][4];
        const T *Qw = sQ + (size_t)(wm * MT * 16) * LD;
        const int lrow8 = ((lane >> 3) & 1) * 8 + (lane & 7), lcol8 = (lane >> 4) * 8;

        for (int i = 0; i < ntiles; i++) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            if (i + STAGES - 1 < ntiles) load_tile(i + STAGES - 1);
            cp_async_commit();
            if (C::Q_REGS && i == 0) {
#pragma unroll
                for (int ks = 0; ks < (C::Q_REGS ? D / 16 : 1); ks++)
                    ldsm_x4(qf[ks], Qw + lrow8 * LD + ks * 16 + lcol8);
            }
            const int slot = i % STAGES;
            const T *Kt = sK + (size_t)slot * KEYS * LD + (size_t)wn * BN * LD;
            const T *Vt = sV + (size_t)slot * KEYS * LD + (size_t)wn * BN * LD;

            float s[MT][BN / 8][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < BN / 8; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
            for (int kp = 0; kp < D / 32; kp++) {
                uint32_t qa[MT][4], qb[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    if constexpr (C::Q_REGS) {
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            qa[mt][j] = qf[C::Q_REGS ? 2 * kp : 0][j];
                            qb[mt][j] = qf[C::Q_REGS ? 2 * kp + 1 : 0][j];
                        }
                    } else {
                        ldsm_x4(qa[mt], Qw + (mt * 16 + lrow8) * LD + (2 * kp) * 16 + lcol8);
                        ldsm_x4(qb[mt], Qw + (mt * 16 + lrow8) * LD + (2 * kp + 1) * 16 + lcol8);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < BN / 8; nt++) {
                    uint32_t b[4];
                    ldsm_x4(b, Kt + (nt * 8 + (lane & 7)) * LD + kp * 32 + (lane >> 3) * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_op<T>::run(s[mt][nt], qa[mt], b[0], b[1]);
                        mma_op<T>::run(s[mt][nt], qb[mt], b[2], b[3]);
                    }
                }
            }
            /* scale, soft cap, masks */
            const int kb = t.kv0 + i * KEYS + wn * BN; /* segment index of this warp's first key */
            const bool full = kb + BN <= t.kv1 && (!causal || ps.pos0 + kb + BN - 1 <= t.qpos_min) &&
                              (window < 0 || ps.pos0 + kb >= t.qpos_max - window);
            /* uniform branches hoisted out of the element loops, so that the
             * compiler cannot if-convert tanhf or the mask into every tile */
            if (cap > 0.f) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            s[mt][nt][e] = cap * tanhf(s[mt][nt][e] * scale / cap) * LOG2E_F;
            } else {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) s[mt][nt][e] *= scale_log2;
            }
            if (!full) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            int key = kb + nt * 8 + (lane & 3) * 2 + (e & 1);
                            int kabs = ps.pos0 + key;
                            int qq = qp[mt][e >> 1];
                            bool vis = key < t.kv1 && (!causal || kabs <= qq) &&
                                       (window < 0 || kabs >= qq - window);
                            if (!vis) s[mt][nt][e] = -CUDART_INF_F;
                        }
            }
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                /* online softmax */
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float mx = -CUDART_INF_F;
#pragma unroll
                    for (int nt = 0; nt < BN / 8; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float mn = fmaxf(mrow[mt][hf], mx);
                    const float mu = mn == -CUDART_INF_F ? 0.f : mn;
                    const float al = exp2f(mrow[mt][hf] - mu);
                    mrow[mt][hf] = mn;
                    float rs = 0.f;
#pragma unroll
                    for (int nt = 0; nt < BN / 8; nt++) {
                        s[mt][nt][2 * hf] = exp2f(s[mt][nt][2 * hf] - mu);
                        s[mt][nt][2 * hf + 1] = exp2f(s[mt][nt][2 * hf + 1] - mu);
                        rs += s[mt][nt][2 * hf] + s[mt][nt][2 * hf + 1];
                    }
                    lrow[mt][hf] = lrow[mt][hf] * al + rs;
#pragma unroll
                    for (int dt = 0; dt < D / 8; dt++) {
                        oacc[mt][dt][2 * hf] *= al;
                        oacc[mt][dt][2 * hf + 1] *= al;
                    }
                }
            }
            /* O += P V */
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    a[mt][0] = mma_op<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                    a[mt][1] = mma_op<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                    a[mt][2] = mma_op<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                    a[mt][3] = mma_op<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                }
#pragma unroll
                for (int dt = 0; dt < D / 16; dt++) {
                    uint32_t b[4];
                    ldsm_x4_t(b, Vt + (kk * 16 + lrow8) * LD + dt * 16 + lcol8);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_op<T>::run(oacc[mt][2 * dt], a[mt], b[0], b[1]);
                        mma_op<T>::run(oacc[mt][2 * dt + 1], a[mt], b[2], b[3]);
                    }
                }
            }
        }
        cp_async_wait<0>();
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                lrow[mt][hf] += __shfl_xor_sync(0xffffffffu, lrow[mt][hf], 1);
                lrow[mt][hf] += __shfl_xor_sync(0xffffffffu, lrow[mt][hf], 2);
            }
        float *obase = t.o_off < 0 ? o : scratch;
        float *lbase = t.o_off < 0 ? lse : scratch;

        if constexpr (WN == 1) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int r = (wm * MT + mt) * 16 + (lane >> 2) + hf * 8;
                    const float l = lrow[mt][hf], m = mrow[mt][hf];
                    if (r < t.nrows) {
                        const float inv = l > 0.f ? 1.f / l : 0.f;
                        float *dst = obase + s_oo[r];
#pragma unroll
                        for (int dt = 0; dt < D / 8; dt++) {
                            float2 v = make_float2(oacc[mt][dt][2 * hf] * inv, oacc[mt][dt][2 * hf + 1] * inv);
                            *reinterpret_cast<float2 *>(dst + dt * 8 + (lane & 3) * 2) = v;
                        }
                        if ((lane & 3) == 0)
                            lbase[s_lo[r]] = l > 0.f ? (m + log2f(l)) * LN2_F : -CUDART_INF_F;
                    }
                }
        } else {
            /* merge the WN warps' states of the same rows through shared memory */
            __syncthreads();
            float *mo = reinterpret_cast<float *>(smem + C::Q_BYTES); /* [WN][ROWS][D] */
            float *mm = mo + (size_t)WN * ROWS * D;                    /* [WN][ROWS] */
            float *ml = mm + WN * ROWS;                                 /* [WN][ROWS] */
            const int rA = wm * 16 + (lane >> 2), rB = rA + 8;
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
                int d = dt * 8 + (lane & 3) * 2;
                *reinterpret_cast<float2 *>(mo + ((size_t)wn * ROWS + rA) * D + d) =
                    make_float2(oacc[0][dt][0], oacc[0][dt][1]);
                *reinterpret_cast<float2 *>(mo + ((size_t)wn * ROWS + rB) * D + d) =
                    make_float2(oacc[0][dt][2], oacc[0][dt][3]);
            }
            if ((lane & 3) == 0) {
                mm[wn * ROWS + rA] = mrow[0][0];
                mm[wn * ROWS + rB] = mrow[0][1];
                ml[wn * ROWS + rA] = lrow[0][0];
                ml[wn * ROWS + rB] = lrow[0][1];
            }
            __syncthreads();
            for (int idx = tid; idx < ROWS * D; idx += NT) {
                const int r = idx / D, d = idx - r * D;
                if (r >= t.nrows) continue;
                float ms = -CUDART_INF_F;
#pragma unroll
                for (int w = 0; w < WN; w++) ms = fmaxf(ms, mm[w * ROWS + r]);
                float acc = 0.f, ls = 0.f;
                if (ms != -CUDART_INF_F) {
#pragma unroll
                    for (int w = 0; w < WN; w++) {
                        float f = exp2f(mm[w * ROWS + r] - ms);
                        acc += f * mo[((size_t)w * ROWS + r) * D + d];
                        ls += f * ml[w * ROWS + r];
                    }
                }
                const bool any = ls > 0.f;
                obase[s_oo[r] + d] = any ? acc / ls : 0.f;
                if (d == 0) lbase[s_lo[r]] = any ? (ms + log2f(ls)) * LN2_F : -CUDART_INF_F;
            }
        }
        __syncthreads();
    };
    for (int ti = blockIdx.x; ti < ntask; ti += gridDim.x) run_task(tasks[ti]);
}

/* ---- launchers ---------------------------------------------------------- */

template <typename T, typename C>
static int launch_one(const cas_cuda_geom *g, const void *plan, const void *k, const void *v,
                      const void *q, float *o, float *lse, float *scratch, int list, int grid,
                      cudaStream_t st) {
    attn_kernel<T, C><<<grid, C::NT, C::SMEM, st>>>(
        (const char *)plan, (const T *)k, (const T *)v, (const T *)q, o, lse, scratch, g->Hq,
        g->Hkv, g->page_size, list);
    return (int)cudaGetLastError();
}

template <typename T, typename C> static int occ_one(int *ctas) {
    cudaError_t e = cudaFuncSetAttribute(attn_kernel<T, C>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM);
    if (e != cudaSuccess) return (int)e;
    return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, attn_kernel<T, C>, C::NT,
                                                              C::SMEM);
}

/* Runs CALL with T_ the geometry's storage type and C_ the configuration of
 * its head_dim (wide: the 64-row instance, else the narrow one). */
#define CAS_DISPATCH(g, wide, CALL)                                                       \
    do {                                                                                  \
        if ((g)->dtype == 2) {                                                            \
            typedef __nv_bfloat16 T_;                                                     \
            CAS_DISPATCH_D(g, wide, CALL);                                                \
        } else if ((g)->dtype == 1) {                                                     \
            typedef __half T_;                                                            \
            CAS_DISPATCH_D(g, wide, CALL);                                                \
        }                                                                                 \
    } while (0)
#define CAS_DISPATCH_D(g, wide, CALL)                                                     \
    switch ((g)->D) {                                                                     \
    case 64: CAS_DISPATCH_K(64, wide, CALL); break;                                       \
    case 96: CAS_DISPATCH_K(96, wide, CALL); break;                                       \
    case 128: CAS_DISPATCH_K(128, wide, CALL); break;                                     \
    case 256: CAS_DISPATCH_K(256, wide, CALL); break;                                     \
    default: break;                                                                       \
    }
#define CAS_DISPATCH_K(DD, wide, CALL)                                                    \
    if (wide) { typedef wide_cfg<DD> C_; CALL; }                                          \
    else { typedef narrow_cfg<DD> C_; CALL; }

extern "C" int cas_cuda_launch_attn(const cas_cuda_geom *g, const void *plan, const void *k,
                                    const void *v, const void *q, float *o, float *lse,
                                    float *scratch, int wide, int grid, void *stream) {
    int rc = (int)cudaErrorInvalidValue;
    CAS_DISPATCH(g, wide,
                 rc = (launch_one<T_, C_>(g, plan, k, v, q, o, lse, scratch, wide != 0, grid,
                                          (cudaStream_t)stream)));
    return rc;
}

extern "C" int cas_cuda_attn_occupancy(const cas_cuda_geom *g, int wide, int *ctas_per_sm) {
    if (wide == CAS_CUDA_WIDE_WGMMA) return cas_cuda_wgmma_occupancy(g, ctas_per_sm);
    int rc = (int)cudaErrorInvalidValue;
    *ctas_per_sm = 0;
    CAS_DISPATCH(g, wide, rc = (occ_one<T_, C_>(ctas_per_sm)));
    return rc;
}

extern "C" const char *cas_cuda_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }
