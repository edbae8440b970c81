/*
 * cuda_wgmma_kernel.cuh: the many-rows attention kernel on Hopper tensor
 * cores (sm_90a), head_dim 128: the shared-prefix passes of a cascade (every
 * query and group head of the requests below a node over the node's KV),
 * prefill chunks, and the decode tails of a cascade next to them.
 *
 * The task contract is the one of the mma.sync kernel (cuda_attn_mma.cu): a
 * task is rows of one pass for one KV head over a key range of the pass's
 * segment. CTA b runs tasks [cta_ptr[b], cta_ptr[b + 1]) of the plan's
 * many-rows list, which the planner arranged per CTA (its shared-pass tasks
 * first, then the decode tails it was given). Counts and lists are read from
 * the plan in device memory, never from launch arguments, so a captured CUDA
 * graph stays valid after any re-plan.
 *
 * Warp specialization. A CTA is three warpgroups. The producer (warpgroup
 * 0; its warp 0 alone, the other three leave at once) fills STAGES stages
 * of K and V, 128-key tiles in the 128-byte swizzled layout that wgmma reads
 * ([D/64 column blocks][keys][64 elements], 16-byte chunks XOR-ed with key %
 * 8). Each stage has full and empty mbarriers for K and for V, so that a K
 * slot is refilled as soon as both consumers have used it for S = Q K^T.
 * Full tiles come by the bulk tensor copy engine (TMA): one box per page,
 * or one per 64 keys where 64 keys sit in consecutive rows of the pool (page
 * ids allocated in a row: the row map), each box counted in bytes on the
 * full barrier; partial tiles and tiles of tasks that start off the box grid
 * are gathered by cp.async per 16-byte chunk. K and V of a pass that only
 * this CTA reads (one row block: a decode tail) are loaded with an L2
 * evict-first policy, so that a shared prefix read by several row blocks
 * stays in L2 for them.
 *
 * Two consumer warpgroups of 64 rows each take turns on the tensor cores
 * (a pair of named barriers, ping-pong): one issues O += P V of this tile and
 * S of the next while the other runs its softmax. Each keeps its query rows
 * in registers (wgmma's A operand) and computes S = Q K^T with m64n128k16 (K
 * the K-major B operand), the online softmax on the accumulator fragments,
 * and O += P V with P taken straight from the S registers (the accumulator
 * layout is the A-fragment layout) and V the N-major B operand. setmaxnreg
 * gives the producer 56 registers a thread and the consumers 224 (with
 * fewer, ptxas serializes the wgmma pipeline: tests/cuda/check_wgmma_serial.sh
 * guards that). On a task of at most 64 rows consumer 1 only keeps its side
 * of the protocol (turns, waits, releases).
 *
 * Two refinements of the online softmax: a warp skips the rescale of O when
 * no row of it got a new maximum, and a row's running maximum moves only
 * when a score passes it by more than 2^LAZY_LOG2 in the exponential's domain
 * (probabilities up to 256 before the final division, exact after it), so
 * that a warp whose scores stay under it skips the max exchange and the
 * rescale.
 *
 * Launch chain: this grid is a programmatic dependent of the narrow kernel
 * (launched before it on the stream) and the merge kernel one of this grid;
 * each lets its dependent start as its CTAs leave, and this grid does not
 * complete before the narrow one (pdl_wait at the end), so the merge sees
 * both grids' states.
 *
 * Compiled for sm_90a only (cuda_attn_wgmma.cu); other targets get a stub
 * that traps, and the host selects this kernel only on compute capability
 * 9.0 with head_dim 128.
 */
#ifndef CASCADE_CUDA_WGMMA_KERNEL_CUH
#define CASCADE_CUDA_WGMMA_KERNEL_CUH

#include <math_constants.h>

#include "cuda_attn_impl.h"
#include "cuda_ptx.cuh"

template <int D_> struct wgmma_cfg {
    static constexpr int D = D_, KEYS = 128, STAGES = 3;
    static constexpr int NT = 384, ROWS = 128;
    static constexpr int CPR = D / 8; /* 16-byte chunks per K or V row */
    static constexpr size_t TILE = (size_t)KEYS * D * 2;
    static constexpr size_t SMEM = 1024 + 2 * STAGES * TILE; /* stages 1024-byte aligned */
    static_assert(D == 128, "wgmma kernel: head_dim 128");
};
/* registers per thread after setmaxnreg: 128 x producer + 256 x consumer
 * may not exceed the 384 x 168 the CTA was launched with */
#define WGMMA_PRODUCER_REGS 56
#define WGMMA_CONSUMER_REGS 224
/* named barriers: 1, 2 the consumers' turns; 3, 4 each consumer's own */
#define WGMMA_BAR_TURN0 1
#define WGMMA_BAR_WG0 3
/* how far (log2 of the factor) a score may pass the running max before the
 * max moves */
#define LAZY_LOG2 8.f

/* Q rows r0 and r1 = r0 + 8 into the A fragments (of m16n8k16, and of a
 * warp's 16 rows of wgmma: columns 2 (lane % 4) + {0, 1} and + 8 of each
 * 16-column step); rows not ok are zero. From global memory (q0, q1: the
 * rows' first element + 2 (lane % 4)) */
template <typename T, int D>
__device__ __forceinline__ void q_frags_global(uint32_t (&qf)[D / 16][4], const T *q0, const T *q1, bool ok0, bool ok1) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        qf[ks][0] = ok0 ? __ldg(reinterpret_cast<const unsigned int *>(q0 + ks * 16)) : 0u;
        qf[ks][1] = ok1 ? __ldg(reinterpret_cast<const unsigned int *>(q1 + ks * 16)) : 0u;
        qf[ks][2] = ok0 ? __ldg(reinterpret_cast<const unsigned int *>(q0 + ks * 16 + 8)) : 0u;
        qf[ks][3] = ok1 ? __ldg(reinterpret_cast<const unsigned int *>(q1 + ks * 16 + 8)) : 0u;
    }
}

/* the online softmax's running max m of a row after a tile whose max is mx
 * (raw logits; x sl is the log2 domain): returns the factor the row's state
 * is rescaled by, mu the offset the tile's exponents subtract */
__device__ __forceinline__ float online_max(float &m, float mx, float sl, float &mu) {
    const float mn = fmaxf(m, mx);
    mu = mn == -CUDART_INF_F ? 0.f : mn * sl;
    /* an unchanged max leaves mu as it was: the state needs no rescale (exactly 1) */
    const float al = mn == m ? 1.f : ex2_fast(fmaf(m, sl, -mu));
    m = mn;
    return al;
}

/* kmap, vmap: the pools as [pages][P][Hkv][D] boxes of tma_rows keys (0: no
 * TMA for these pools); krun, vrun: as rows, boxes of 64 keys (tma_runs 0:
 * not encoded). See cuda_attn_wgmma.cu. */
template <typename T, int D>
__global__ void __launch_bounds__(384, 1)
    attn_wgmma_kernel(const char *__restrict__ plan, const T *__restrict__ kpool,
                      const T *__restrict__ vpool, const T *__restrict__ q, float *__restrict__ o,
                      float *__restrict__ lse, float *__restrict__ scratch, int Hq, int Hkv, int P,
                      const __grid_constant__ CUtensorMap kmap, const __grid_constant__ CUtensorMap vmap,
                      int tma_rows, const __grid_constant__ CUtensorMap krun,
                      const __grid_constant__ CUtensorMap vrun, int tma_runs) {
#if CAS_WGMMA_OK
    typedef wgmma_cfg<D> C;
    constexpr int KEYS = C::KEYS, STAGES = C::STAGES, CPR = C::CPR;
    /* the merge kernel may start its CTAs on SMs this grid leaves */
    pdl_launch_dependents();
    extern __shared__ __align__(16) unsigned char smem[];
    /* K/V stages, 1024-byte aligned (the swizzle pattern repeats every 1024 bytes) */
    const uint32_t kv_s = (smem_u32(smem) + 1023u) & ~1023u;
    __shared__ int s_qpos[128];
    __shared__ long long s_qrow[128], s_oo[128], s_lo[128];
    __shared__ __align__(8) unsigned long long s_bar[4 * STAGES]; /* full K, full V, empty K, empty V */

    const cas_cuda_plan_hdr *h = reinterpret_cast<const cas_cuda_plan_hdr *>(plan);
    const cas_cuda_task *tasks = reinterpret_cast<const cas_cuda_task *>(plan + h->off_tasks_wide);
    const cas_cuda_pass *passes = reinterpret_cast<const cas_cuda_pass *>(plan + h->off_passes);
    const int32_t *pages = reinterpret_cast<const int32_t *>(plan + h->off_pages);
    const int32_t *cta_ptr = reinterpret_cast<const int32_t *>(plan + h->off_cta_ptr);
    const int ti_first = cta_ptr[blockIdx.x], ti_end = cta_ptr[blockIdx.x + 1];

    const int tid = threadIdx.x, lane = tid & 31;
    const uint32_t bar0 = smem_u32(s_bar);
    auto full_k = [&](int s) { return bar0 + 8u * (uint32_t)s; };
    auto full_v = [&](int s) { return bar0 + 8u * (uint32_t)(STAGES + s); };
    auto empty_k = [&](int s) { return bar0 + 8u * (uint32_t)(2 * STAGES + s); };
    auto empty_v = [&](int s) { return bar0 + 8u * (uint32_t)(3 * STAGES + s); };
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            /* full: the producer's 32 threads; empty: the 8 consumer warps */
            mbar_init(full_k(s), 32);
            mbar_init(full_v(s), 32);
            mbar_init(empty_k(s), 8);
            mbar_init(empty_v(s), 8);
        }
    }
    __syncthreads();
    const int64_t page_stride = (int64_t)P * Hkv * D;

    /* the warpgroup index, warp-uniform for the compiler (wgmma on a path it
     * thinks divergent gets serialized) */
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (wg == 0) {
        /* ---- producer: warp 0 ---- */
        reg_dealloc<WGMMA_PRODUCER_REGS>();
        if (tid >= 32) return;
        if (tma_rows > 0 && tid == 0) {
            tma_prefetch_map(&kmap);
            tma_prefetch_map(&vmap);
            if (tma_runs) {
                tma_prefetch_map(&krun);
                tma_prefetch_map(&vrun);
            }
        }
        /* TMA: lane b copies box b of a tile: key rows [b / CB x tma_rows,
         * + tma_rows), columns [(b % CB) x 64, + 64) (recomputed per tile:
         * the producer has few registers) */
        constexpr int CB = D / 64;
        const int64_t row_stride = (int64_t)Hkv * D;
        const uint64_t pol_once = l2_policy(0), pol_more = l2_policy(1);
        /* tile j of task t into position it of the stage ring */
        auto load_tile = [&](const cas_cuda_task &t, int j, int it, const int32_t *pg_list, uint64_t pol,
                             bool look_runs, bool task_tma) {
            const int s = it % STAGES;
            const uint32_t ph = (uint32_t)(it / STAGES) & 1u;
            if (task_tma && t.kv0 + (j + 1) * KEYS <= t.kv1) {
                /* a full tile: one box per lane, the bytes counted by
                 * thread 0's expect-tx arrival; the other lanes only arrive */
                const int nsmall = KEYS / tma_rows * CB;
                bool boxer = tid < nsmall;
                int pg = 0, pr = 0;
                if (tid < nsmall) {
                    const int kidx = t.kv0 + j * KEYS + (tid / CB) * tma_rows;
                    const int pi = kidx / P;
                    pg = pg_list[pi];
                    pr = kidx - pi * P;
                }
                bool run = false;
#pragma unroll
                for (int kv = 0; kv < 2; kv++) {
                    const uint32_t full = kv ? full_v(s) : full_k(s);
                    mbar_wait(kv ? empty_v(s) : empty_k(s), ph ^ 1u);
                    if (tid == 0) mbar_arrive_expect_tx(full, (uint32_t)C::TILE);
                    else mbar_arrive(full);
                    if (tid < 32) {
                        /* runs: where the 64 keys of a group of boxes sit
                         * in consecutive rows of the pool (pages
                         * allocated in a row), the group's first box per
                         * column block loads all 64 through the row map,
                         * the others nothing. Decided after the first
                         * wait, so that the page-id loads stay under it. */
                        if (kv == 0 && look_runs) {
                            const int G = 64 / tma_rows, rb = tid / CB, lead = (rb - rb % G) * CB + tid % CB;
                            const long long grow = (long long)pg * P + pr;
                            const long long grow0 = __shfl_sync(0xffffffffu, grow, lead);
                            const bool ok = tid >= nsmall || (grow == grow0 + (long long)(rb % G) * tma_rows &&
                                                              grow0 + 64 <= 0x7fffffffLL);
                            const uint32_t all = __ballot_sync(0xffffffffu, ok);
                            const int g0 = (rb - rb % G) * CB;
                            const uint32_t gm = (G * CB >= 32 ? 0xffffffffu : ((1u << (G * CB)) - 1u)) << g0;
                            if (tid < nsmall && (all & gm) == gm) {
                                run = rb % G == 0;
                                boxer = run;
                                pr = (int)grow; /* the row coordinate of the run box */
                            }
                        }
                        __syncwarp();
                        const uint32_t dst = kv_s + (uint32_t)(s * 2 * C::TILE + kv * C::TILE +
                                                               (tid % CB) * (KEYS * 128) + (tid / CB) * tma_rows * 128);
                        if (run)
                            tma_load_3d(dst, kv ? &vrun : &krun, (tid % CB) * 64, t.kv_head, pr, full, pol);
                        else if (boxer)
                            tma_load_4d(dst, kv ? &vmap : &kmap, (tid % CB) * 64, t.kv_head, pr, pg, full, pol);
                    }
                }
                return;
            }
            /* a partial tile, or pages that no box fits: lane copies chunk
             * lane % CPR of keys lane / CPR + n (32 / CPR), 32 keys per
             * round, their page ids looked up one per lane */
            constexpr int KPR = 32 / CPR;
            const int ch32 = lane % CPR;
#pragma unroll
            for (int kv = 0; kv < 2; kv++) {
                const T *base = (kv ? vpool : kpool) + (int64_t)t.kv_head * D + ch32 * 8;
                const uint32_t d0 = kv_s + (uint32_t)(s * 2 * C::TILE + kv * C::TILE);
                mbar_wait(kv ? empty_v(s) : empty_k(s), ph ^ 1u);
                for (int g0 = 0; g0 < KEYS; g0 += 32) {
                    const int kidx = t.kv0 + j * KEYS + g0 + lane;
                    int pgo = pg_list[0], pro = -1;
                    if (kidx < t.kv1) {
                        const int pi = kidx / P;
                        pgo = pg_list[pi];
                        pro = kidx - pi * P;
                    }
#pragma unroll
                    for (int n = 0; n < 32 / KPR; n++) {
                        const int kl = lane / CPR + n * KPR, key = g0 + kl;
                        const int pg = __shfl_sync(0xffffffffu, pgo, kl), pr = __shfl_sync(0xffffffffu, pro, kl);
                        const int64_t off = (int64_t)pg * page_stride + (pr > 0 ? (int64_t)pr * row_stride : 0);
                        const uint32_t so = (uint32_t)((ch32 >> 3) * (KEYS * 128) + key * 128 + (((ch32 & 7) ^ (key & 7)) << 4));
                        cp_async16(d0 + so, base + off, pr >= 0 ? 16 : 0);
                    }
                }
                mbar_arrive_cpasync(kv ? full_v(s) : full_k(s));
            }
        };
        int it = 0;
        for (int ti = ti_first; ti < ti_end; ti++) {
            const cas_cuda_task t = tasks[ti];
            const int32_t *pg_list = pages + passes[t.pass].page_off;
            /* K and V of a pass of one row block (read by this CTA only)
             * evict first; of the others evict normal */
            const bool once = (int64_t)passes[t.pass].n_tok * h->group <= C::ROWS;
            const uint64_t pol = once ? pol_once : pol_more;
            const bool look_runs = tma_runs && passes[t.pass].page_runs;
            const int nkeys = t.kv1 - t.kv0;
            const int ntiles = nkeys > 0 ? (nkeys + KEYS - 1) / KEYS : 0;
            /* whole boxes of tma_rows keys lie in one page when the task
             * starts on a multiple of tma_rows (a divisor of the page size) */
            const bool task_tma = tma_rows > 0 && t.kv0 % tma_rows == 0;
            for (int j = 0; j < ntiles; j++, it++) load_tile(t, j, it, pg_list, pol, look_runs, task_tma);
        }
        cp_async_wait_all();
    } else {
        /* ---- consumers ---- */
        reg_alloc<WGMMA_CONSUMER_REGS>();
        const int32_t *tok_ids = reinterpret_cast<const int32_t *>(plan + h->off_tok_ids);
        const int32_t *tok_pos = reinterpret_cast<const int32_t *>(plan + h->off_tok_pos);
        const int group = h->group, causal = h->causal, window = h->window_left;
        const float scale_log2 = h->scale_log2, cap = h->soft_cap, scale = h->scale;
        const float sl = cap > 0.f ? 1.f : scale_log2; /* s x sl: the log2-domain logit */
        const int cw = wg - 1, ctid = tid & 127;
        const int wrow = cw * 64 + (ctid >> 5) * 16; /* this warp's first row in the CTA */
        const int my_turn = WGMMA_BAR_TURN0 + cw, other_turn = WGMMA_BAR_TURN0 + 1 - cw, bar_wg = WGMMA_BAR_WG0 + cw;
        if (cw == 1) nbar_arrive(WGMMA_BAR_TURN0, 256); /* consumer 0 goes first */
        /* a warp is done with a stage: lane 0 tells the producer */
        auto release = [&](uint32_t bar) {
            if (lane == 0) mbar_arrive(bar);
        };
        /* the parity of the phase of stage ring position k */
        auto ph_of = [&](int k) { return (uint32_t)(k / STAGES) & 1u; };
        int it = 0;
        for (int ti = ti_first; ti < ti_end; ti++) {
            const cas_cuda_task t = tasks[ti];
            const cas_cuda_pass ps = passes[t.pass];
            /* a task of at most 64 rows: consumer 1 has none of them and
             * keeps only its side of the protocol (its turns, the full
             * waits and the releases), leaving the tensor cores to
             * consumer 0 */
            if (cw == 1 && t.nrows <= 64) {
                const int nk = t.kv1 - t.kv0, nt = nk > 0 ? (nk + KEYS - 1) / KEYS : 0;
                if (nt > 0) {
                    const int s0 = it % STAGES;
                    mbar_wait(full_k(s0), ph_of(it));
                    nbar_sync(my_turn, 256);
                    nbar_arrive(other_turn, 256);
                    release(empty_k(s0));
                    for (int i = 0; i < nt; i++, it++) {
                        const int sc = it % STAGES, sn = (it + 1) % STAGES;
                        const bool more = i + 1 < nt;
                        mbar_wait(full_v(sc), ph_of(it));
                        if (more) mbar_wait(full_k(sn), ph_of(it + 1));
                        nbar_sync(my_turn, 256);
                        nbar_arrive(other_turn, 256);
                        release(empty_v(sc));
                        if (more) release(empty_k(sn));
                    }
                }
                continue;
            }
            nbar_sync(bar_wg, 128); /* the last task's epilogue and Q reads are done */
            if (ctid < 64) {
                const int r0 = cw * 64 + ctid;
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
            nbar_sync(bar_wg, 128);
            /* Q straight into the A fragments (rows lane / 4 and + 8, columns
             * 2 (lane % 4) + {0, 1} and + 8 of each 16-column step): once per
             * task, no shared memory; padding rows are zero */
            uint32_t qf[D / 16][4];
            const int r0 = wrow + (lane >> 2), r1 = r0 + 8;
            q_frags_global<T, D>(qf, q + s_qrow[r0] + (lane & 3) * 2, q + s_qrow[r1] + (lane & 3) * 2, r0 < t.nrows,
                                 r1 < t.nrows);

            const int nkeys = t.kv1 - t.kv0;
            const int ntiles = nkeys > 0 ? (nkeys + KEYS - 1) / KEYS : 0;
            float oacc[D / 2];
#pragma unroll
            for (int i = 0; i < D / 2; i++) oacc[i] = 0.f;
            float mrow[2] = {-CUDART_INF_F, -CUDART_INF_F}, lrow[2] = {0.f, 0.f};
            /* each row's exponent offset (mrow x sl) and the raw score above
             * which the max must move */
            float mul[2] = {0.f, 0.f}, mthr[2] = {-CUDART_INF_F, -CUDART_INF_F};
            const int qp[2] = {s_qpos[wrow + (lane >> 2)], s_qpos[wrow + (lane >> 2) + 8]};
            float s[KEYS / 2];
            /* S = Q K^T of the tile in stage st (64 rows x KEYS keys per warpgroup), no commit */
            auto mma_qk = [&](int st) {
                const uint32_t ka = kv_s + (uint32_t)(st * 2 * C::TILE);
#pragma unroll
                for (int ks = 0; ks < D / 16; ks++)
                    wg_mma<T>::template run<0>(s, qf[ks], wg_desc(ka + (ks >> 2) * (KEYS * 128) + (ks & 3) * 32, 16, 1024),
                                               ks > 0);
            };
            /* softmax of S (tile i) into probabilities in s: scale or soft
             * cap, masks, running max and sum; al: the factor O must be
             * rescaled by (done by rescale_pack) */
            float al[2];
            auto softmax = [&](int i) {
                /* s[4 * nt + e]: row (lane / 4) + 8 * (e / 2), key 8 nt + 2 (lane % 4) + e % 2 */
                const int kb = t.kv0 + i * KEYS;
                const bool full = kb + KEYS <= t.kv1 && (!causal || ps.pos0 + kb + KEYS - 1 <= t.qpos_min) &&
                                  (window < 0 || ps.pos0 + kb >= t.qpos_max - window);
                /* with a soft cap, s becomes the log2-domain logit (sl 1);
                 * without, s stays raw and the scale folds into the exp2's
                 * FFMA (sl = scale log2 e > 0, so the max commutes) */
                if (cap > 0.f) {
#pragma unroll
                    for (int j = 0; j < KEYS / 2; j++) s[j] = cap * tanhf(s[j] * scale / cap) * LOG2E_F;
                }
                if (!full) {
#pragma unroll
                    for (int j = 0; j < KEYS / 2; j++) {
                        const int nt = j >> 2, e = j & 3;
                        const int key = kb + nt * 8 + (lane & 3) * 2 + (e & 1);
                        const int kabs = ps.pos0 + key;
                        const int qq = qp[e >> 1];
                        const bool vis = key < t.kv1 && (!causal || kabs <= qq) && (window < 0 || kabs >= qq - window);
                        if (!vis) s[j] = -CUDART_INF_F;
                    }
                }
                /* the lazy max: a warp whose scores all stay under their
                 * rows' thresholds skips the quad shuffles, the rescale and
                 * its exponential */
                float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
#pragma unroll
                    for (int nt = 0; nt < KEYS / 8; nt++)
                        mx[hf] = fmaxf(mx[hf], fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
                }
                const bool need = !(mx[0] <= mthr[0]) || !(mx[1] <= mthr[1]);
                al[0] = al[1] = 1.f;
                if (__any_sync(0xffffffffu, need)) {
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
                        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
                        al[hf] = online_max(mrow[hf], mx[hf], sl, mul[hf]);
                        mthr[hf] = mrow[hf] + LAZY_LOG2 / sl;
                    }
                }
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float rs = 0.f;
#pragma unroll
                    for (int nt = 0; nt < KEYS / 8; nt++) {
                        s[4 * nt + 2 * hf] = ex2_fast(fmaf(s[4 * nt + 2 * hf], sl, -mul[hf]));
                        s[4 * nt + 2 * hf + 1] = ex2_fast(fmaf(s[4 * nt + 2 * hf + 1], sl, -mul[hf]));
                        rs += s[4 * nt + 2 * hf] + s[4 * nt + 2 * hf + 1];
                    }
                    lrow[hf] = lrow[hf] * al[hf] + rs;
                }
            };
            /* the rescale of O (skipped where no row of the warp got a new
             * max) and P packed into the A fragments of P V */
            uint32_t pa[KEYS / 16][4];
            auto rescale_pack = [&]() {
                if (!__all_sync(0xffffffffu, al[0] == 1.f && al[1] == 1.f)) {
#pragma unroll
                    for (int hf = 0; hf < 2; hf++)
#pragma unroll
                        for (int dt = 0; dt < D / 8; dt++) {
                            oacc[4 * dt + 2 * hf] *= al[hf];
                            oacc[4 * dt + 2 * hf + 1] *= al[hf];
                        }
                }
#pragma unroll
                for (int kk = 0; kk < KEYS / 16; kk++) {
                    pa[kk][0] = ptx_type<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
                    pa[kk][1] = ptx_type<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
                    pa[kk][2] = ptx_type<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
                    pa[kk][3] = ptx_type<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
                }
            };
            auto mma_pv = [&](int st) {
                const uint32_t vs_addr = kv_s + (uint32_t)(st * 2 * C::TILE) + (uint32_t)C::TILE;
#pragma unroll
                for (int kk = 0; kk < KEYS / 16; kk++)
                    wg_mma<T>::template run<1>(oacc, pa[kk], wg_desc(vs_addr + kk * 2048, KEYS * 128, 1024), 1);
            };
            if (ntiles > 0) {
                const int s0 = it % STAGES;
                mbar_wait(full_k(s0), ph_of(it));
                fence_proxy_async();
                nbar_sync(my_turn, 256);
                wg_fence();
                mma_qk(s0);
                wg_commit();
                nbar_arrive(other_turn, 256);
                wg_wait<0>();
                wg_fence_regs<KEYS / 2>(s);
                release(empty_k(s0));
            }
            /* one tile i, on this consumer's turn: the softmax of tile i,
             * then O += P V (tile i) and, if MORE, S of tile i + 1 in one
             * commit group (two instances: wgmma under a run-time branch
             * gets serialized by ptxas) */
            auto step = [&](int i, auto more_c) {
                constexpr bool more = decltype(more_c)::value;
                softmax(i);
                rescale_pack();
                const int sc = it % STAGES, sn = (it + 1) % STAGES;
                mbar_wait(full_v(sc), ph_of(it));
                if (more) mbar_wait(full_k(sn), ph_of(it + 1));
                fence_proxy_async();
                nbar_sync(my_turn, 256);
                wg_fence_regs<D / 2>(oacc);
                wg_fence();
                mma_pv(sc);
                if constexpr (more) mma_qk(sn);
                wg_commit();
                nbar_arrive(other_turn, 256);
                wg_wait<0>();
                wg_fence_regs<D / 2>(oacc);
                wg_fence_regs<KEYS / 2>(s);
                release(empty_v(sc));
                if (more) release(empty_k(sn));
            };
            for (int i = 0; i + 1 < ntiles; i++, it++) step(i, std::true_type{});
            if (ntiles > 0) {
                step(ntiles - 1, std::false_type{});
                it++;
            }
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                lrow[hf] += __shfl_xor_sync(0xffffffffu, lrow[hf], 1);
                lrow[hf] += __shfl_xor_sync(0xffffffffu, lrow[hf], 2);
            }
            float *obase = t.o_off < 0 ? o : scratch;
            float *lbase = t.o_off < 0 ? lse : scratch;
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int r = wrow + (lane >> 2) + hf * 8;
                const float l = lrow[hf], m = mrow[hf];
                if (r < t.nrows) {
                    const float inv = l > 0.f ? 1.f / l : 0.f;
                    const long long ooff = s_oo[r], loff = s_lo[r]; /* both read before the stores */
                    float *dst = obase + ooff;
#pragma unroll
                    for (int dt = 0; dt < D / 8; dt++) {
                        float2 v = make_float2(oacc[4 * dt + 2 * hf] * inv, oacc[4 * dt + 2 * hf + 1] * inv);
                        *reinterpret_cast<float2 *>(dst + dt * 8 + (lane & 3) * 2) = v;
                    }
                    if ((lane & 3) == 0) lbase[loff] = l > 0.f ? (m * sl + log2f(l)) * LN2_F : -CUDART_INF_F;
                }
            }
        }
        /* consumer 1 arrived once more on consumer 0's turn than consumer 0 waited */
        if (cw == 0) nbar_sync(WGMMA_BAR_TURN0, 256);
    }
    /* not complete before the narrow kernel (the grid this one depends on),
     * so that the merge after this grid sees both */
    pdl_wait();
#else
    __trap();
#endif
}

#endif
