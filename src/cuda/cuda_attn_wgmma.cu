/*
 * cuda_attn_wgmma.cu: the many-rows attention kernel on Hopper tensor cores
 * (wgmma, sm_90a): the shared-prefix pass (all queries and group heads of the
 * requests below a node over the node's KV) and prefill chunks.
 *
 * Same task contract as the mma.sync kernel of cuda_attn_kernels.cu (a task:
 * rows of one pass for one KV head over a key range; persistent grid, counts
 * read from the plan in device memory, so graph replay after a re-plan is
 * safe). A CTA is two warpgroups of 64 rows each (128 rows). Every thread
 * streams K and V pages with cp.async into shared memory in the 128-byte
 * swizzled layout that wgmma reads without bank conflicts ([D/64 column
 * blocks][keys][64 elements], 16-byte chunks XOR-ed with key % 8), STAGES
 * tiles of 64 keys deep. Each warpgroup keeps its 64 query rows in registers
 * (wgmma's A operand from registers) and computes S = Q K^T with
 * m64n64k16 (K is the K-major B operand), the online softmax on the
 * accumulator fragments, and O += P V with m64n{D}k16, P taken straight
 * from the S registers (the accumulator layout is the A-fragment layout) and
 * V the transposed (N-major) B operand of the same layout.
 *
 * Pages of any size are gathered per 16-byte chunk (a page of the pool may
 * hold a single token); kind 9 below adds TMA where pages allow it. cp.async writes
 * through the generic proxy and wgmma reads through the async proxy, hence
 * fence.proxy.async before the barrier that hands a stage over.
 *
 * That is v4's kernel (kinds 3, 4). Since v5 the many-rows kernel is the
 * warp-specialized one further down (kinds 6-10): a producer warpgroup fills
 * mbarrier-guarded stages and two consumer warpgroups take turns on the
 * tensor cores. Kind 9 (the default since v6) has the producer load full
 * tiles with the bulk tensor copy engine (TMA) through tensor maps of the
 * pool, one box per page or one per 64 keys of consecutive pages, and keeps
 * the cp.async gathers for the rest; kind 10 runs kind 9 in clusters of two
 * with multicast (measured slower in v6, but with its wgmma serialized by
 * ptxas for want of registers: unmeasured since the fix, bench/NOTES.md v21).
 * Since v10 kind 9's producer is warp 0
 * alone (the other three warps leave) and its consumers skip the rescale of
 * O where no row of a warp got a new max; kind 16 is v9's.
 *
 * Compiled for sm_90a only; other targets get a stub that traps, and the
 * host selects these kernels only on compute capability 9.0 with head_dim 128
 * (the 64 instances are built but disabled: v4's failed the reference test on
 * the H200; CASCADE_CUDA_WIDE=1 or 2 selects mma.sync).
 */
#include <cuda.h> /* CUtensorMap and its encoder's types only: no libcuda link (the
                     * encoder comes through cudaGetDriverEntryPointByVersion) */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "cuda_attn_impl.h"
#include "cuda_attn_ptx.cuh"
#include "cuda_attn_fuse.cuh"

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

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CAS_WGMMA_OK 1
#else
#define CAS_WGMMA_OK 0
#endif

/* ---- wgmma wrappers ----------------------------------------------------- */

/* d (64 x N f32 accumulators of the warpgroup, N/2 per thread) = A B + (scale_d ? d : 0):
 * A 64 x 16 from registers (the mma.sync A fragment of each warp's 16 rows),
 * B 16 x N from shared memory through a descriptor, TB = 1: B is N-major. */
template <typename T, int N> struct wg_mma;
template <> struct wg_mma<__nv_bfloat16, 64> {
    template <int TB>
    static __device__ __forceinline__ void run(float *d, const uint32_t a[4], uint64_t desc, int scale_d) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TB));
    }
};

template <> struct wg_mma<__half, 64> {
    template <int TB>
    static __device__ __forceinline__ void run(float *d, const uint32_t a[4], uint64_t desc, int scale_d) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TB));
    }
};

template <> struct wg_mma<__nv_bfloat16, 128> {
    template <int TB>
    static __device__ __forceinline__ void run(float *d, const uint32_t a[4], uint64_t desc, int scale_d) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TB));
    }
};

template <> struct wg_mma<__half, 128> {
    template <int TB>
    static __device__ __forceinline__ void run(float *d, const uint32_t a[4], uint64_t desc, int scale_d) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TB));
    }
};

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* keeps the compiler from moving reads of accumulators above the wait */
template <int N> __device__ __forceinline__ void wg_fence_regs(float *r) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* Shared-memory matrix descriptor, 128-byte swizzle: start address, leading
 * byte offset (K-major: unused; N-major: the distance between 64-element
 * column blocks), stride byte offset (8 rows of 128 bytes: 1024). */
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

/* ---- configuration ------------------------------------------------------ */

/* OVL: S of the next tile is issued before the softmax of this one (one
 * more S in registers, one more stage in flight). */
template <int D_, bool OVL> struct wg_cfg {
    static constexpr int D = D_;
    static constexpr int NWG = 2, NT = 128 * NWG, ROWS = 64 * NWG, KEYS = 64;
    static constexpr int STAGES = D <= 64 ? 4 : (OVL ? 4 : 3);
    static constexpr int LD = D + 8;  /* Q staging pitch (ldmatrix, no conflicts) */
    static constexpr int CPR = D / 8; /* 16-byte chunks per K or V row */
    static constexpr size_t Q_BYTES = (size_t)ROWS * LD * 2;
    static constexpr size_t TILE = (size_t)KEYS * D * 2; /* K or V of one stage */
    static constexpr size_t SMEM = Q_BYTES + 1024 + 2 * STAGES * TILE;
    static_assert(D == 64 || D == 128, "wgmma kernel: head_dim 64 or 128");
};

/* ---- the kernel --------------------------------------------------------- */

template <typename T, int D, bool OVL>
__global__ void __launch_bounds__(256, 1)
    attn_wgmma_kernel(const char *__restrict__ plan, const T *__restrict__ kpool,
                      const T *__restrict__ vpool, const T *__restrict__ q, float *__restrict__ o,
                      float *__restrict__ lse, float *__restrict__ scratch, int Hq, int Hkv, int P) {
#if CAS_WGMMA_OK
    typedef wg_cfg<D, OVL> C;
    constexpr int NT = C::NT, ROWS = C::ROWS, KEYS = C::KEYS, STAGES = C::STAGES, LD = C::LD,
                  CPR = C::CPR;
    extern __shared__ __align__(16) unsigned char smem[];
    T *sQ = reinterpret_cast<T *>(smem);
    /* K/V stages 1024-byte aligned: the swizzle pattern repeats every 1024 bytes */
    const uint32_t kv_s = (smem_u32(smem + C::Q_BYTES) + 1023u) & ~1023u;
    unsigned char *kv_g = smem + (kv_s - smem_u32(smem));
    __shared__ int s_qpos[ROWS];
    __shared__ long long s_qrow[ROWS], s_oo[ROWS], s_lo[ROWS];

    const cas_cuda_plan_hdr *h = reinterpret_cast<const cas_cuda_plan_hdr *>(plan);
    const int ntask = h->n_tasks_wide;
    const cas_cuda_task *tasks = reinterpret_cast<const cas_cuda_task *>(plan + h->off_tasks_wide);
    const cas_cuda_pass *passes = reinterpret_cast<const cas_cuda_pass *>(plan + h->off_passes);
    const int32_t *pages = reinterpret_cast<const int32_t *>(plan + h->off_pages);
    const int32_t *tok_ids = reinterpret_cast<const int32_t *>(plan + h->off_tok_ids);
    const int32_t *tok_pos = reinterpret_cast<const int32_t *>(plan + h->off_tok_pos);
    const int group = h->group, causal = h->causal, window = h->window_left;
    const float scale_log2 = h->scale_log2, cap = h->soft_cap, scale = h->scale;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wrow = (warp >> 2) * 64 + (warp & 3) * 16; /* this warp's first row in the CTA */
    const int64_t page_stride = (int64_t)P * Hkv * D;

    for (int ti = blockIdx.x; ti < ntask; ti += gridDim.x) {
        const cas_cuda_task t = tasks[ti];
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

        auto load_tile = [&](int tile) {
            unsigned char *dk = kv_g + (size_t)(tile % STAGES) * 2 * C::TILE;
            unsigned char *dv = dk + C::TILE;
            const int k0 = t.kv0 + tile * KEYS;
#pragma unroll
            for (int it = 0; it < KEYS * CPR / NT; it++) {
                const int c = tid + it * NT;
                const int key = c / CPR, ch = c - key * CPR;
                const int kidx = k0 + key;
                const int ok = kidx < t.kv1;
                const int kk = ok ? kidx : t.kv0;
                const int pg = pages[ps.page_off + kk / P];
                const int64_t off = (int64_t)pg * page_stride + (int64_t)(kk % P) * Hkv * D + ch * 8;
                const int soff = (ch >> 3) * (KEYS * 128) + key * 128 + (((ch & 7) ^ (key & 7)) << 4);
                cp_async16(dk + soff, kbase + off, ok ? 16 : 0);
                cp_async16(dv + soff, vbase + off, ok ? 16 : 0);
            }
        };

#pragma unroll
        for (int s = 0; s < STAGES - 1; s++) {
            if (s < ntiles) load_tile(s);
            cp_async_commit();
        }

        float oacc[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; i++) oacc[i] = 0.f;
        float mrow[2] = {-CUDART_INF_F, -CUDART_INF_F}, lrow[2] = {0.f, 0.f};
        const int qp[2] = {s_qpos[wrow + (lane >> 2)], s_qpos[wrow + (lane >> 2) + 8]};
        uint32_t qf[D / 16][4];
        const int lrow8 = ((lane >> 3) & 1) * 8 + (lane & 7), lcol8 = (lane >> 4) * 8;

        float s[KEYS / 2], sn[OVL ? KEYS / 2 : 1];
        /* issues S = Q K^T of one tile (64 rows x 64 keys per warpgroup) into dst */
        auto issue_qk = [&](float *dst, int tile) {
            const uint32_t ka = kv_s + (uint32_t)((tile % STAGES) * 2 * C::TILE);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++)
                wg_mma<T, KEYS>::template run<0>(
                    dst, qf[ks], wg_desc(ka + (ks >> 2) * (KEYS * 128) + (ks & 3) * 32, 16, 1024), ks > 0);
            wg_commit();
        };
        if (OVL && ntiles > 0) {
            cp_async_wait<STAGES - 2>();
            fence_proxy_async();
            __syncthreads();
#pragma unroll
            for (int ks = 0; ks < D / 16; ks++) ldsm_x4(qf[ks], sQ + (wrow + lrow8) * LD + ks * 16 + lcol8);
            issue_qk(s, 0);
            wg_wait<0>();
            wg_fence_regs<KEYS / 2>(s);
        }

        for (int i = 0; i < ntiles; i++) {
            if (OVL) {
                /* tile i + 1 must be in; S of tile i + 1 runs on the tensor
                 * cores while this warpgroup does the softmax of tile i */
                cp_async_wait<STAGES - 3>();
                fence_proxy_async();
                __syncthreads();
                if (i + STAGES - 1 < ntiles) load_tile(i + STAGES - 1);
                cp_async_commit();
                if (i + 1 < ntiles) issue_qk(sn, i + 1);
            } else {
                cp_async_wait<STAGES - 2>();
                fence_proxy_async();
                __syncthreads();
                if (i + STAGES - 1 < ntiles) load_tile(i + STAGES - 1);
                cp_async_commit();
                if (i == 0) {
#pragma unroll
                    for (int ks = 0; ks < D / 16; ks++) ldsm_x4(qf[ks], sQ + (wrow + lrow8) * LD + ks * 16 + lcol8);
                }
                issue_qk(s, i);
                wg_wait<0>();
                wg_fence_regs<KEYS / 2>(s);
            }
            const uint32_t vs_addr = kv_s + (uint32_t)((i % STAGES) * 2 * C::TILE) + (uint32_t)C::TILE;

            /* scale, soft cap, masks; s[4 * nt + e]: row (lane / 4) + 8 * (e / 2), key 8 nt + 2 (lane % 4) + e % 2 */
            const int kb = t.kv0 + i * KEYS;
            const bool full = kb + KEYS <= t.kv1 && (!causal || ps.pos0 + kb + KEYS - 1 <= t.qpos_min) &&
                              (window < 0 || ps.pos0 + kb >= t.qpos_max - window);
            if (cap > 0.f) {
#pragma unroll
                for (int j = 0; j < KEYS / 2; j++) s[j] = cap * tanhf(s[j] * scale / cap) * LOG2E_F;
            } else {
#pragma unroll
                for (int j = 0; j < KEYS / 2; j++) s[j] *= scale_log2;
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
            /* online softmax (log2 domain) */
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                float mx = -CUDART_INF_F;
#pragma unroll
                for (int nt = 0; nt < KEYS / 8; nt++) mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mn = fmaxf(mrow[hf], mx);
                const float mu = mn == -CUDART_INF_F ? 0.f : mn;
                const float al = exp2f(mrow[hf] - mu);
                mrow[hf] = mn;
                float rs = 0.f;
#pragma unroll
                for (int nt = 0; nt < KEYS / 8; nt++) {
                    s[4 * nt + 2 * hf] = exp2f(s[4 * nt + 2 * hf] - mu);
                    s[4 * nt + 2 * hf + 1] = exp2f(s[4 * nt + 2 * hf + 1] - mu);
                    rs += s[4 * nt + 2 * hf] + s[4 * nt + 2 * hf + 1];
                }
                lrow[hf] = lrow[hf] * al + rs;
#pragma unroll
                for (int dt = 0; dt < D / 8; dt++) {
                    oacc[4 * dt + 2 * hf] *= al;
                    oacc[4 * dt + 2 * hf + 1] *= al;
                }
            }
            /* O += P V: P from the S registers, 16 keys per step */
            uint32_t pa[KEYS / 16][4];
#pragma unroll
            for (int kk = 0; kk < KEYS / 16; kk++) {
                pa[kk][0] = mma_op<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
                pa[kk][1] = mma_op<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
                pa[kk][2] = mma_op<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
                pa[kk][3] = mma_op<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
            }
            wg_fence_regs<D / 2>(oacc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < KEYS / 16; kk++)
                wg_mma<T, D>::template run<1>(oacc, pa[kk], wg_desc(vs_addr + kk * 2048, KEYS * 128, 1024), 1);
            wg_commit();
            wg_wait<0>();
            wg_fence_regs<D / 2>(oacc);
            if (OVL) {
                wg_fence_regs<KEYS / 2>(sn);
#pragma unroll
                for (int j = 0; j < KEYS / 2; j++) s[j] = sn[j];
            }
        }
        cp_async_wait<0>();
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
                float *dst = obase + s_oo[r];
#pragma unroll
                for (int dt = 0; dt < D / 8; dt++) {
                    float2 v = make_float2(oacc[4 * dt + 2 * hf] * inv, oacc[4 * dt + 2 * hf + 1] * inv);
                    *reinterpret_cast<float2 *>(dst + dt * 8 + (lane & 3) * 2) = v;
                }
                if ((lane & 3) == 0) lbase[s_lo[r]] = l > 0.f ? (m + log2f(l)) * LN2_F : -CUDART_INF_F;
            }
        }
        __syncthreads();
    }
#else
    __trap();
#endif
}

/* ---- warp-specialized kernel (kinds 6 and 7) ------------------------------
 *
 * Three warpgroups: a producer (warpgroup 0) streams K and V tiles with
 * cp.async into STAGES stages, each completing on its own mbarrier
 * (cp.async.mbarrier.arrive.noinc: one arrival per producer thread when its
 * copies land), K and V with separate full/empty barriers so that a K slot
 * is refilled as soon as S = Q K^T of both consumers has read it. Two
 * consumer warpgroups of 64 rows each run the same tiles; a pair of named
 * barriers makes them take turns on the tensor cores (ping-pong): one issues
 * O += P V of this tile and S of the next while the other does its softmax.
 * No CTA-wide barrier after the start. setmaxnreg gives each producer
 * thread 40 registers and each consumer thread 232. Kind 6: 128-key tiles, 2 stages;
 * kind 7: 64-key tiles, 4 stages (same shared memory). */

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
/* n arrivals on bar at once */
__device__ __forceinline__ void mbar_arrive_cnt(uint32_t bar, uint32_t n) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(n) : "memory");
}
/* arrives on bar when all prior cp.async of this thread have completed; the
 * arrival is one of the count given at init (noinc) */
__device__ __forceinline__ void mbar_arrive_cpasync(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\nLAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@p bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void nbar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void nbar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async16_s(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/* 2^x, one MUFU.EX2 (exp2f adds range fix-ups); 2^-inf = 0 */
__device__ __forceinline__ float ex2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ long long sm_clock64() {
    long long c;
    asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(c)::"memory");
    return c;
}
/* XF bit 131072 (probe CASCADE_CUDA_XV=18, measurement only): a
 * timeline of the run, read back at exit (cas_cuda_tl_dump). Per CTA (the
 * first TL_CTAS) cas_tl_cta: its SM, the global timer (ns) and SM clock at
 * its start (0-2), consumer 0's end (3, 4), its task count (5), the
 * producer's end (6, 7). Per task of its list (the first TL_TASKS) cas_tl,
 * SM clocks of thread 0 of each warpgroup: consumer 0's start (0), its first
 * S done (1), its end (2), the cycles it waited for full stages (3) and for
 * its turn (4); consumer 1's start and end (5, 6); the producer's first tile
 * past its empty wait (7) and its last tile issued (8); the task's rows |
 * tiles << 16 | KV head << 32 | a KV-read-once flag << 48 (9); consumer 1's
 * full waits (10). (A sum of the producer's empty waits made it spill.) */
#define TL_CTAS 160
#define TL_TASKS 48
#define TL_F 11
__device__ long long cas_tl_cta[TL_CTAS][8];
__device__ long long cas_tl[TL_CTAS][TL_TASKS][TL_F];
__device__ __forceinline__ long long global_timer() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t)::"memory");
    return t;
}
__device__ __forceinline__ int sm_id() {
    int r;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(r));
    return r;
}
/* XF bit 16384: how far (log2 of the factor) a score may pass the running
 * max before the max moves */
#define LAZY_LOG2 8.f
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
template <int R> __device__ __forceinline__ void reg_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R> __device__ __forceinline__ void reg_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
/* one arrival on bar that also raises the bytes the phase waits for by tx */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t tx) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
                 "r"(tx)
                 : "memory");
}
/* bulk tensor copy (TMA) of one box of the 4-D map at element coordinates
 * (c0, c1, c2, c3) into shared memory at dst, completing its bytes on bar */
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                            int c3, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}
/* one box of the 3-D map at (c0, c1, c2) */
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                            uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}
/* XF bit 65536 (kind 17 since v17): the boxes above with an L2 cache
 * policy (createpolicy below), so that K and V read by one CTA only (a
 * decode tail) leave the L2 before K and V that other CTAs read again (a
 * shared pass of several row blocks) */
__device__ __forceinline__ void tma_load_4d_pol(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                                int c3, uint32_t bar, uint64_t pol) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(pol)
                 : "memory");
}
__device__ __forceinline__ void tma_load_3d_pol(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                                uint32_t bar, uint64_t pol) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(pol)
                 : "memory");
}
/* L2 policies for every access they are given (fraction 1): evict first,
 * evict normal, evict last */
__device__ __forceinline__ uint64_t l2_policy(int which) {
    uint64_t p;
    if (which == 0) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
    else if (which == 1) asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(p));
    else asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}
/* the same box into the shared memory of every CTA of the cluster in mask
 * (same offsets), completing on each one's barrier at bar's offset */
__device__ __forceinline__ void tma_load_4d_mc(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                               int c3, uint32_t bar, uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(mask)
                 : "memory");
}
/* one arrival on the barrier at the same offset in CTA `rank` of the cluster */
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, int rank) {
    asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
                 "r"(rank)
                 : "memory");
}
/* waits for a phase that CTAs of the cluster arrived on (acquire at cluster scope) */
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\nLAB_WAITC:\n"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
                 "@p bra DONEC;\nbra LAB_WAITC;\nDONEC:\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

/* ---- decode tails on the producer's spare warps (kind 11) -----------------
 *
 * With TMA only warp 0 of the producer warpgroup issues copies; in kind 11
 * its warps 1-3 run the plan's fused list together: decode tails (a task of
 * at most 8 rows: a request's group heads over a chunk of its own KV) while
 * the consumers keep the tensor cores on the shared pass, in the producer's
 * 56 registers (the consumers keep their 224). The three warps take a task
 * from a counter shared with the narrow kernel (launched after this one, it
 * takes what is left), and only while the consumers of their CTA have more
 * tiles left than one tail task took the last time (in consumer tiles), so
 * that a late task does not hold the SM after the shared pass.
 *
 * The tail is computed transposed, keys as the M dimension of mma.sync
 * m16n8k16, so that 8 rows fill N: S^T = K Q^T (16 keys x 8 rows), the
 * online softmax per column, then O^T += V^T P^T with d as M. Every warp
 * computes the same S^T and softmax (a few mma each) and its own third of
 * the D/16 m-tiles of O^T, so that its accumulators stay small. P^T comes
 * out of the S^T accumulators as 8 x 8 blocks with keys on rows; movmatrix
 * transposes each into the B fragment. Q (8 rows) and three buffers of K
 * and V (16 keys each) are staged by cp.async, rows padded by 16 bytes
 * (ldmatrix without bank conflicts, addresses as immediate offsets from one
 * base per lane); the next 32 keys load while these are used, and the L2 is
 * asked for the keys TL_PF blocks ahead. */
template <int D> struct tail_cfg {
    static constexpr int CPR = D / 8, NMT = D / 16, WARPS = 3, MTW = (NMT + WARPS - 1) / WARPS;
    static constexpr uint32_t LDB = D * 2 + 16; /* row pitch, bytes */
    static constexpr uint32_t Q_BYTES = 8 * LDB, KV_BYTES = 16 * LDB;
    static constexpr int NBUF = 3; /* buffers of K and V: two blocks in flight */
    static constexpr uint32_t BYTES = Q_BYTES + 2 * NBUF * KV_BYTES;
    static_assert(CPR >= 8, "tail warps: head_dim 64 or 128");
};
#define TL_PF 8    /* blocks of 16 keys the L2 prefetch runs ahead */
#define TL_BAR 5   /* named barrier of the three tail warps (1-4: the consumers') */
#define TL_EST0 4  /* consumer tiles a first tail task is assumed to take */
__device__ __forceinline__ uint32_t movm_t(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}
__device__ __forceinline__ void prefetch_l2(const void *p) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

/* The three tail warps (threads 32-127). cdone: consumer warps done; ctile:
 * tiles consumer warpgroup 0 has finished; ctiles: the CTA's tiles in all;
 * s_ti: the task index broadcast. */
template <typename T, int D>
__device__ __forceinline__ void tail_warps(const char *__restrict__ plan, const T *__restrict__ kpool,
                                           const T *__restrict__ vpool, const T *__restrict__ q,
                                           float *__restrict__ o, float *__restrict__ lse,
                                           float *__restrict__ scratch, int Hq, int Hkv, int P,
                                           int *counter, uint32_t area, const volatile int *cdone,
                                           int ndone, const volatile int *ctile, int ctiles,
                                           volatile int *s_ti) {
    typedef tail_cfg<D> C;
    constexpr int CPR = C::CPR, NKS = D / 16, MTW = C::MTW;
    constexpr uint32_t LDB = C::LDB;
    const int tt = threadIdx.x - 32, w = tt >> 5, lane = tt & 31, g = lane >> 2, c = lane & 3;
    const cas_cuda_plan_hdr *h = reinterpret_cast<const cas_cuda_plan_hdr *>(plan);
    const int nf = h->n_tasks_fused;
    const uint32_t sQ = area, sB = area + C::Q_BYTES;
    /* per-lane ldmatrix bases: Q (B fragments of S^T, k-steps 2kp, 2kp + 1 at
     * + 64 kp), K (A fragment of S^T, k-step ks at + 32 ks), V (A fragment of
     * O^T, m-tile i at + 32 i); buffer x at + 2 x KV_BYTES */
    constexpr int NBUF = C::NBUF;
    const uint32_t qA = sQ + (uint32_t)(lane & 7) * LDB + (uint32_t)(lane >> 3) * 16;
    const uint32_t kA = sB + (uint32_t)((lane & 7) + ((lane >> 3) & 1) * 8) * LDB + (uint32_t)(lane >> 4) * 16;
    const uint32_t vA = sB + C::KV_BYTES + (uint32_t)((lane & 7) + (lane >> 4) * 8) * LDB +
                        (uint32_t)((lane >> 3) & 1) * 16 + (uint32_t)(w * MTW) * 32;
    int est = TL_EST0;
    for (;;) {
        if (tt == 0) {
            const int left = *cdone >= ndone ? 0 : ctiles - *ctile;
            *s_ti = left >= est ? atomicAdd(counter, 1) : nf;
        }
        nbar_sync(TL_BAR, 96);
        const int ti = *s_ti, tile0 = *ctile;
        if (ti >= nf) break;
        const cas_cuda_task *tp = reinterpret_cast<const cas_cuda_task *>(plan + h->off_tasks_fused) + ti;
        const int kv0 = tp->kv0, kv1 = tp->kv1, nrows = tp->nrows, row0 = tp->row0, kvh = tp->kv_head;
        const cas_cuda_pass *pp = reinterpret_cast<const cas_cuda_pass *>(plan + h->off_passes) + tp->pass;
        const int32_t *pg_list = reinterpret_cast<const int32_t *>(plan + h->off_pages) + pp->page_off;
        const int tok_off = pp->tok_off, group = h->group;
        const T *kb = kpool + (int64_t)kvh * D, *vb = vpool + (int64_t)kvh * D;
        const int64_t page_stride = (int64_t)P * Hkv * D;
        const int row_stride = Hkv * D;
        /* Q rows into shared memory, zero past nrows */
        for (int cc = tt; cc < 8 * CPR; cc += 96) {
            const int r = cc / CPR, ch = cc - r * CPR, rr = r < nrows ? r : nrows - 1;
            const int row = row0 + rr, tk = row / group;
            const int64_t qoff = ((int64_t)__ldg(&reinterpret_cast<const int32_t *>(plan + h->off_tok_ids)[tok_off + tk]) * Hq +
                                  kvh * group + (row - tk * group)) * D;
            cp_async16_s(sQ + (uint32_t)r * LDB + (uint32_t)ch * 16, q + qoff + ch * 8, r < nrows ? 16 : 0);
        }
        const int nb = kv1 > kv0 ? (kv1 - kv0 + 15) / 16 : 0;
        /* K and V of block b into buffer b % NBUF: chunk cc % CPR of key cc / CPR */
        auto issue = [&](int b) {
            const uint32_t dst = sB + (uint32_t)(b % NBUF) * 2 * C::KV_BYTES;
            for (int cc = tt; cc < 16 * CPR; cc += 96) {
                const int key = cc / CPR, ch = cc - key * CPR, kidx = kv0 + b * 16 + key;
                int64_t off = 0;
                if (kidx < kv1) {
                    const int pi = kidx / P;
                    off = (int64_t)pg_list[pi] * page_stride + (int64_t)(kidx - pi * P) * row_stride;
                }
                const uint32_t d = dst + (uint32_t)key * LDB + (uint32_t)ch * 16;
                cp_async16_s(d, kb + off + ch * 8, kidx < kv1 ? 16 : 0);
                cp_async16_s(d + C::KV_BYTES, vb + off + ch * 8, kidx < kv1 ? 16 : 0);
            }
        };
        /* L2 prefetch of block b: thread tt < 64 takes key tt / 4, a 128-byte
         * line (tt / 2) % 2 of its row, of K (tt even) or V */
        auto prefetch = [&](int b) {
            const int kidx = kv0 + b * 16 + (tt >> 2);
            if (tt < 64 && b < nb && kidx < kv1) {
                const int pi = kidx / P;
                const int64_t off = (int64_t)pg_list[pi] * page_stride + (int64_t)(kidx - pi * P) * row_stride +
                                    ((tt >> 1) & 1) * (D / 2);
                prefetch_l2((tt & 1 ? vb : kb) + off);
            }
        };
        for (int b = 1; b < TL_PF; b++) prefetch(b);
#pragma unroll
        for (int b = 0; b < NBUF - 1; b++) {
            if (b < nb) issue(b);
            cp_async_commit();
        }
        int qp[2]; /* this thread's columns are rows 2c and 2c + 1 (padding rows repeat the last) */
        {
            const int32_t *tok_pos = reinterpret_cast<const int32_t *>(plan + h->off_tok_pos) + tok_off;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int r = 2 * c + e < nrows ? 2 * c + e : nrows - 1;
                qp[e] = tok_pos[(row0 + r) / group];
            }
        }
        float oacc[MTW][4];
#pragma unroll
        for (int i = 0; i < MTW; i++) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.f;
        float mrow[2] = {-CUDART_INF_F, -CUDART_INF_F}, lrow[2] = {0.f, 0.f};
        const float sl = h->soft_cap > 0.f ? 1.f : h->scale_log2;
        /* a block of keys from kb0 is all visible when kb0 + 16 <= kv1, kb0 <= klast
         * (causal) and kb0 >= kfirst (window) */
        const int pos0 = pp->pos0, causal = h->causal, window = h->window_left;
        const int klast = causal ? tp->qpos_min - pos0 - 15 : INT_MAX;
        const int kfirst = window >= 0 ? tp->qpos_max - window - pos0 : INT_MIN;
        for (int b = 0; b < nb; b++) {
            /* buffer (b + NBUF - 1) % NBUF held block b - 1, done (barrier below) */
            if (b + NBUF - 1 < nb) issue(b + NBUF - 1);
            cp_async_commit();
            prefetch(b + TL_PF);
            cp_async_wait<NBUF - 1>();
            nbar_sync(TL_BAR, 96);
            const uint32_t xo = (uint32_t)(b % NBUF) * 2 * C::KV_BYTES;
            /* S^T = K Q^T: 16 keys x 8 rows */
            float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kp = 0; kp < NKS / 2; kp++) {
                uint32_t qb[4];
                ldsm_x4(qb, qA + 64 * kp);
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    uint32_t ka[4];
                    ldsm_x4(ka, kA + xo + 32 * (2 * kp + hh));
                    mma_op<T>::run(s, ka, qb[2 * hh], qb[2 * hh + 1]);
                }
            }
            /* s[e]: key g, row 2c + e; s[2 + e]: key g + 8 */
            const int kb0 = kv0 + b * 16;
            const bool full = kb0 + 16 <= kv1 && kb0 <= klast && kb0 >= kfirst;
            const float cap = h->soft_cap;
            if (cap > 0.f) {
                const float scale = h->scale;
#pragma unroll
                for (int j = 0; j < 4; j++) s[j] = cap * tanhf(s[j] * scale / cap) * LOG2E_F;
            }
            if (!full) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int key = kb0 + g + 8 * (j >> 1), kabs = pos0 + key, qq = qp[j & 1];
                    const bool vis = key < kv1 && (!causal || kabs <= qq) && (window < 0 || kabs >= qq - window);
                    if (!vis) s[j] = -CUDART_INF_F;
                }
            }
            float al[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float mx = fmaxf(s[e], s[2 + e]);
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                float mu;
                al[e] = online_max(mrow[e], mx, sl, mu);
                s[e] = ex2_fast(fmaf(s[e], sl, -mu));
                s[2 + e] = ex2_fast(fmaf(s[2 + e], sl, -mu));
                lrow[e] = lrow[e] * al[e] + s[e] + s[2 + e];
            }
#pragma unroll
            for (int i = 0; i < MTW; i++) {
                oacc[i][0] *= al[0];
                oacc[i][1] *= al[1];
                oacc[i][2] *= al[0];
                oacc[i][3] *= al[1];
            }
            /* P^T blocks (keys 0-7, 8-15 x rows) transposed into the B fragment */
            const uint32_t pb0 = movm_t(mma_op<T>::pack(s[0], s[1]));
            const uint32_t pb1 = movm_t(mma_op<T>::pack(s[2], s[3]));
            /* O^T += V^T P^T: this warp's m-tiles w MTW + i (d 16 (w MTW + i) ..) */
#pragma unroll
            for (int i = 0; i < MTW; i++) {
                if (w * MTW + i < C::NMT) {
                    uint32_t va[4];
                    ldsm_x4_t(va, vA + xo + 32 * i);
                    mma_op<T>::run(oacc[i], va, pb0, pb1);
                }
            }
            nbar_sync(TL_BAR, 96); /* buffer b % NBUF is free for block b + NBUF */
        }
        cp_async_wait<0>();
#pragma unroll
        for (int e = 0; e < 2; e++) {
            lrow[e] += __shfl_xor_sync(0xffffffffu, lrow[e], 4);
            lrow[e] += __shfl_xor_sync(0xffffffffu, lrow[e], 8);
            lrow[e] += __shfl_xor_sync(0xffffffffu, lrow[e], 16);
        }
        /* oacc[i][e]: d 16 (w MTW + i) + g, row 2c + e; oacc[i][2 + e]: d + 8 */
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int r = 2 * c + e;
            if (r >= nrows) continue;
            const int row = row0 + r, tk = row / group, hq = kvh * group + (row - tk * group);
            const int64_t o_off = tp->o_off;
            int64_t oo, lo;
            float *ob, *lb;
            if (o_off < 0) {
                const int64_t tokid = reinterpret_cast<const int32_t *>(plan + h->off_tok_ids)[tok_off + tk];
                oo = (tokid * Hq + hq) * D;
                lo = tokid * Hq + hq;
                ob = o;
                lb = lse;
            } else {
                oo = o_off + ((int64_t)tk * Hq + hq) * D;
                lo = tp->lse_off + (int64_t)tk * Hq + hq;
                ob = scratch;
                lb = scratch;
            }
            const float l = lrow[e], inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
            for (int i = 0; i < MTW; i++) {
                if (w * MTW + i < C::NMT) {
                    ob[oo + 16 * (w * MTW + i) + g] = oacc[i][e] * inv;
                    ob[oo + 16 * (w * MTW + i) + g + 8] = oacc[i][2 + e] * inv;
                }
            }
            if (w == 0 && g == 0) lb[lo] = l > 0.f ? (mrow[e] * sl + log2f(l)) * LN2_F : -CUDART_INF_F;
        }
        /* the consumer tiles this task took, plus one: the least the consumers
         * must have left for the next */
        if (tt == 0) {
            est = *ctile - tile0 + 1;
            atomicAdd(counter + 1, 1); /* tasks the tail warps ran (cas_cuda_attn_fused_split) */
        }
        nbar_sync(TL_BAR, 96); /* Q and the buffers are free, s_ti read */
    }
}

/* The merge of NW warps' states of row r: ml holds each warp's (max, sum) of the row at
 * ml[(ww * rows + r) * 2]; M and L: the common max and sum; returns the factor a warp
 * whose max is m scales its O by, 2^((m - M) sl) / L (0 where it or the row has nothing) */
template <int NW>
__device__ __forceinline__ float merge_rows(const float *ml, int rows, int r, float m, float sl, float &M, float &L) {
    M = -CUDART_INF_F;
    L = 0.f;
#pragma unroll
    for (int ww = 0; ww < NW; ww++) M = fmaxf(M, ml[(ww * rows + r) * 2]);
#pragma unroll
    for (int ww = 0; ww < NW; ww++) {
        const float mw = ml[(ww * rows + r) * 2];
        if (mw != -CUDART_INF_F) L += ml[(ww * rows + r) * 2 + 1] * ex2_fast((mw - M) * sl);
    }
    return m == -CUDART_INF_F || !(L > 0.f) ? 0.f : ex2_fast((m - M) * sl) / L;
}
/* XF bit 67108864 (probe CASCADE_CUDA_XV=35): decode tails of at most 8 rows
 * (tasks flagged 32 by the planner) run on the producer warpgroup's three
 * spare warps (tw_warps), from the same stages as the consumers' tiles, so
 * that their bytes stream while the consumers keep the tensor cores on the
 * shared passes. The positions of a CTA's stage ring (0, 1, ...) interleave
 * the consumers' tiles (na) and the tail warps' (nb) evenly: position k is
 * the tail warps' when (k + 1) nb / N passes an integer (N = na + nb), which
 * cas_cuda_tw_next (cuda_attn_impl.h) tells one position after the other. The producer loads every
 * position in order (waiting on each stage's empty barriers, which the owner
 * of a position releases) and completes the full barriers of the position's
 * owner: the tail warps have their own, so that each party's full barriers
 * move one phase per use of its own (a party that waited on the others'
 * could fall two phases behind them, which a parity wait cannot tell). */
template <int D> struct tw_cfg {
    static constexpr uint32_t LDQ = D * 2 + 16;   /* row pitch of a Q buffer, bytes */
    static constexpr uint32_t QBUF = 8 * LDQ;     /* 8 rows: the N of m16n8k16 */
    static constexpr int LDO = D + 4;             /* row pitch of a warp's O in the merge, floats */
    /* the merge: each warp's O [8][LDO] floats, then its max and sum per row [8][2] */
    static constexpr uint32_t OBUF = 8 * LDO * 4, MBUF = 8 * 2 * 4;
    static constexpr uint32_t BYTES = 3 * (QBUF + OBUF + MBUF);
};
#define TW_BAR 5 /* named barrier of the three tail warps (1-4: the consumers') */
/* the tiles of CTA's tasks [i0, i1) that are the consumers' (na) and the tail warps' (nb); a warp's lanes together */
/* 128-key (KEYS) tiles of a task */
template <int KEYS> __device__ __forceinline__ int task_tiles(const cas_cuda_task &t) {
    const int nk = t.kv1 - t.kv0;
    return nk > 0 ? (nk + KEYS - 1) / KEYS : 0;
}
template <int KEYS>
__device__ __forceinline__ void tw_count(const cas_cuda_task *__restrict__ tasks, int i0, int i1, int lane, int &na,
                                         int &nb) {
    int a = 0, b = 0;
    for (int i = i0 + lane; i < i1; i += 32) {
        const int nt = task_tiles<KEYS>(tasks[i]);
        if (tasks[i].flags & 32) b += nt;
        else a += nt;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    na = a;
    nb = b;
}
/* The tail warps (threads 32-127 of the producer warpgroup): each warp walks
 * the CTA's positions, and on each of its own computes its share of the
 * tile, blocks of 16 keys w, w + 3, ... (w its index), transposed as kind
 * 11's tail warps did (S^T = K Q^T with 16 keys as the M of mma.sync
 * m16n8k16 and the task's rows as N; O^T += V^T P^T with D as M, P^T into
 * the B fragment by movmatrix), with its own running max, sum and O^T of
 * the task; at the task's end the three states merge in shared memory. K
 * and V come as ldmatrix from the 128-byte swizzled stage the producer
 * filled, Q from the warp's own buffer. Each warp releases a stage with its
 * share of the 8 arrivals the empty barriers count. */
template <typename T, int D, int KEYS, int STAGES>
__device__ __forceinline__ void tw_warps(const char *__restrict__ plan, const cas_cuda_task *__restrict__ tasks, int ti0,
                                         int ti1, const T *__restrict__ q, float *__restrict__ o, float *__restrict__ lse,
                                         float *__restrict__ scratch, int Hq, uint32_t kv_s, uint32_t bar0,
                                         unsigned char *area_p, int diag) {
    typedef tw_cfg<D> C;
    constexpr int NMT = D / 16, CPR = D / 8, NKS = D / 16, NBK = KEYS / 16;
    constexpr uint32_t TILE = (uint32_t)KEYS * D * 2, CB = (uint32_t)KEYS * 128; /* a column block of 64 elements */
    const int w = (int)(threadIdx.x >> 5) - 1, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const cas_cuda_plan_hdr *h = reinterpret_cast<const cas_cuda_plan_hdr *>(plan);
    const cas_cuda_pass *passes = reinterpret_cast<const cas_cuda_pass *>(plan + h->off_passes);
    const int32_t *tok_ids = reinterpret_cast<const int32_t *>(plan + h->off_tok_ids);
    const int32_t *tok_pos = reinterpret_cast<const int32_t *>(plan + h->off_tok_pos);
    const float sl = h->soft_cap > 0.f ? 1.f : h->scale_log2;
    int na, nb;
    tw_count<KEYS>(tasks, ti0, ti1, lane, na, nb);
    const int n = na + nb;
    int pos = 0;
    cas_cuda_tw_walk wk = {0, 0, 0, na};
    uint32_t pb = 0; /* bit s: the parity of the tail warps' next use of stage s */
    const uint32_t sq = smem_u32(area_p) + (uint32_t)w * C::QBUF;
    float *ob = reinterpret_cast<float *>(area_p + 3 * C::QBUF); /* [3][8][LDO] */
    float *mb = reinterpret_cast<float *>(area_p + 3 * (C::QBUF + C::OBUF)); /* [3][8][2] */
    /* ldmatrix rows of this lane: Q (B of S^T, k-steps 2 kp, 2 kp + 1 at + 64 kp); K (A of S^T:
     * matrix lane / 8 is keys + 8 ((lane / 8) % 2), chunk + lane / 16); V (A of O^T, transposed:
     * keys + 8 (lane / 16), chunk + (lane / 8) % 2); the swizzle XORs chunks with key % 8 = lane % 8 */
    const uint32_t qA = sq + (uint32_t)(lane & 7) * C::LDQ + (uint32_t)(lane >> 3) * 16u;
    for (int ti = ti0; ti < ti1; ti++) {
        if (!(tasks[ti].flags & 32)) continue;
        int kv0, kv1, flo, fhi; /* this task's keys; blocks of 16 from kb0 in [flo, fhi] are all visible */
        {
            const cas_cuda_task t = tasks[ti];
            const cas_cuda_pass ps = passes[t.pass];
            const int group = h->group, nrows = t.nrows;
            kv0 = t.kv0;
            kv1 = t.kv1;
            flo = h->window_left >= 0 ? t.qpos_max - h->window_left - ps.pos0 : INT_MIN;
            fhi = kv1 - 16;
            if (h->causal && t.qpos_min - ps.pos0 - 15 < fhi) fhi = t.qpos_min - ps.pos0 - 15;
            /* Q rows into this warp's buffer, zero past nrows (this warp's reads of the last task's are done) */
            for (int cc = lane; cc < 8 * CPR; cc += 32) {
                const int r = cc / CPR, ch = cc - r * CPR, rr = r < nrows ? r : nrows - 1;
                const int row = t.row0 + rr, tk = row / group;
                const int64_t qoff =
                    ((int64_t)tok_ids[ps.tok_off + tk] * Hq + t.kv_head * group + (row - tk * group)) * D;
                cp_async16_s(sq + (uint32_t)r * C::LDQ + (uint32_t)ch * 16u, q + qoff + ch * 8, r < nrows ? 16 : 0);
            }
            cp_async_commit();
        }
        float oacc[NMT][4];
#pragma unroll
        for (int i = 0; i < NMT; i++) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.f;
        float mrow[2] = {-CUDART_INF_F, -CUDART_INF_F}, lrow[2] = {0.f, 0.f};
        float mul[2] = {0.f, 0.f}, mthr[2] = {-CUDART_INF_F, -CUDART_INF_F}; /* the lazy max, as the consumers' */
        cp_async_wait<0>();
        __syncwarp();
        for (int kt0 = kv0; kt0 < kv1; kt0 += KEYS) {
            /* the next position of the tail warps (the consumers' passed) and the parity of their
             * use of its stage (their full barriers complete on their positions only) */
            int k = pos++;
            while (!cas_cuda_tw_next(&wk, nb, n)) k = pos++;
            const uint32_t st = (uint32_t)(k % STAGES), ph = (pb >> st) & 1u;
            pb ^= 1u << st;
            mbar_wait(bar0 + 8u * (4 * STAGES + st), ph);
            mbar_wait(bar0 + 8u * (5 * STAGES + st), ph);
            const uint32_t ka = kv_s + st * 2u * TILE;
            /* CASCADE_CUDA_WS_DIAG bit 2 (timing only, wrong results): the tail warps compute nothing */
            for (int bk = (diag & 4) ? NBK : w; bk < NBK; bk += 3) {
                const int kb0 = kt0 + bk * 16;
                if (kb0 >= kv1) break;
                /* S^T = K Q^T: 16 keys x 8 rows, the k-steps in two chains */
                float s[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};
                {
                    const uint32_t kbase = ka + (uint32_t)(bk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * 128u;
#pragma unroll
                    for (int kp = 0; kp < NKS / 2; kp++) {
                        uint32_t qb[4];
                        ldsm_x4(qb, qA + 64u * (uint32_t)kp);
#pragma unroll
                        for (int hh = 0; hh < 2; hh++) {
                            const int ks = 2 * kp + hh;
                            uint32_t kf[4];
                            ldsm_x4(kf, kbase + (uint32_t)(ks >> 2) * CB +
                                            (((((uint32_t)(2 * ks)) & 7u) + ((uint32_t)lane >> 4)) ^ ((uint32_t)lane & 7u)) * 16u);
                            mma_op<T>::run(hh ? s2 : s, kf, qb[2 * hh], qb[2 * hh + 1]);
                        }
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; e++) s[e] += s2[e];
                /* s[e]: key kb0 + g, row 2c + e; s[2 + e]: key kb0 + g + 8 */
                if (h->soft_cap > 0.f) {
                    const float cap = h->soft_cap, scale = h->scale;
#pragma unroll
                    for (int e = 0; e < 4; e++) s[e] = cap * tanhf(s[e] * scale / cap) * LOG2E_F;
                }
                if (!(kb0 >= flo && kb0 <= fhi)) {
                    /* masks (rare: a task's last block, windows, causal chunks), from the task again */
                    const cas_cuda_task &t = tasks[ti];
                    const cas_cuda_pass &ps = passes[t.pass];
                    const int causal = h->causal, window = h->window_left;
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = 2 * c + (e & 1) < t.nrows ? 2 * c + (e & 1) : t.nrows - 1;
                        const int qq = tok_pos[ps.tok_off + (t.row0 + r) / h->group];
                        const int key = kb0 + g + 8 * (e >> 1), kabs = ps.pos0 + key;
                        const bool vis = key < kv1 && (!causal || kabs <= qq) && (window < 0 || kabs >= qq - window);
                        if (!vis) s[e] = -CUDART_INF_F;
                    }
                }
                float mx[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
                if (__any_sync(0xffffffffu, !(mx[0] <= mthr[0]) || !(mx[1] <= mthr[1]))) {
                    float al[2];
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 4));
                        mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 8));
                        mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 16));
                        al[e] = online_max(mrow[e], mx[e], sl, mul[e]);
                        mthr[e] = mrow[e] + LAZY_LOG2 / sl;
                        lrow[e] *= al[e];
                    }
#pragma unroll
                    for (int i = 0; i < NMT; i++) {
                        oacc[i][0] *= al[0];
                        oacc[i][1] *= al[1];
                        oacc[i][2] *= al[0];
                        oacc[i][3] *= al[1];
                    }
                }
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    s[e] = ex2_fast(fmaf(s[e], sl, -mul[e]));
                    s[2 + e] = ex2_fast(fmaf(s[2 + e], sl, -mul[e]));
                    lrow[e] += s[e] + s[2 + e];
                }
                /* P^T (keys 0-7, 8-15 x rows) transposed into the B fragment; O^T += V^T P^T */
                const uint32_t pb0 = movm_t(mma_op<T>::pack(s[0], s[1]));
                const uint32_t pb1 = movm_t(mma_op<T>::pack(s[2], s[3]));
                const uint32_t vbase = ka + TILE + (uint32_t)(bk * 16 + (lane & 7) + 8 * (lane >> 4)) * 128u;
#pragma unroll
                for (int mt = 0; mt < NMT; mt++) {
                    const uint32_t cv = (uint32_t)(2 * mt) + (((uint32_t)lane >> 3) & 1u);
                    uint32_t vf[4];
                    ldsm_x4_t(vf, vbase + (cv >> 3) * CB + ((cv & 7u) ^ ((uint32_t)lane & 7u)) * 16u);
                    mma_op<T>::run(oacc[mt], vf, pb0, pb1);
                }
            }
            __syncwarp();
            if (lane == 0) { /* this warp's arrivals of the 8 */
                mbar_arrive_cnt(bar0 + 8u * (2 * STAGES + st), w < 2 ? 3u : 2u);
                mbar_arrive_cnt(bar0 + 8u * (3 * STAGES + st), w < 2 ? 3u : 2u);
            }
        }
        /* the merge: each warp's max and sum per row (over its g lanes), then its O scaled to the
         * common max and divided by the common sum into its buffer, then their sum out */
#pragma unroll
        for (int e = 0; e < 2; e++) {
            lrow[e] += __shfl_xor_sync(0xffffffffu, lrow[e], 4);
            lrow[e] += __shfl_xor_sync(0xffffffffu, lrow[e], 8);
            lrow[e] += __shfl_xor_sync(0xffffffffu, lrow[e], 16);
        }
        if (g == 0) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                mb[(w * 8 + 2 * c + e) * 2] = mrow[e];
                mb[(w * 8 + 2 * c + e) * 2 + 1] = lrow[e];
            }
        }
        nbar_sync(TW_BAR, 96);
        float rm[2], rl[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int r = 2 * c + e;
            const float f = merge_rows<3>(mb, 8, r, mrow[e], sl, rm[e], rl[e]);
            float *orow = ob + (w * 8 + r) * C::LDO;
#pragma unroll
            for (int mt = 0; mt < NMT; mt++) {
                orow[16 * mt + g] = oacc[mt][e] * f;
                orow[16 * mt + g + 8] = oacc[mt][2 + e] * f;
            }
        }
        nbar_sync(TW_BAR, 96);
        {
            const cas_cuda_task &t = tasks[ti];
            const int group = h->group;
            /* float2 stores, as the consumers' (a state's offset in scratch is even) */
            for (int x = (int)threadIdx.x - 32; x < t.nrows * (D / 2); x += 96) {
                const int r = x / (D / 2), d2 = x - r * (D / 2);
                float2 v = reinterpret_cast<const float2 *>(ob + r * C::LDO)[d2];
#pragma unroll
                for (int ww = 1; ww < 3; ww++) {
                    const float2 u = reinterpret_cast<const float2 *>(ob + (ww * 8 + r) * C::LDO)[d2];
                    v.x += u.x;
                    v.y += u.y;
                }
                const int row = t.row0 + r, tk = row / group, hq = t.kv_head * group + (row - tk * group);
                const int64_t oo = t.o_off < 0 ? ((int64_t)tok_ids[passes[t.pass].tok_off + tk] * Hq + hq) * D
                                               : t.o_off + ((int64_t)tk * Hq + hq) * D;
                reinterpret_cast<float2 *>((t.o_off < 0 ? o : scratch) + oo)[d2] = v;
            }
            if (w == 0 && g == 0) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int r = 2 * c + e;
                    if (r >= t.nrows) continue;
                    const int row = t.row0 + r, tk = row / group, hq = t.kv_head * group + (row - tk * group);
                    const int64_t lo = t.o_off < 0 ? (int64_t)tok_ids[passes[t.pass].tok_off + tk] * Hq + hq
                                                   : t.lse_off + (int64_t)tk * Hq + hq;
                    (t.o_off < 0 ? lse : scratch)[lo] = rl[e] > 0.f ? (rm[e] * sl + log2f(rl[e])) * LN2_F : -CUDART_INF_F;
                }
            }
        }
        nbar_sync(TW_BAR, 96); /* the merge buffers are read before the next task writes them */
    }
}

template <int D_, int KEYS_, int STAGES_, bool TAILS_ = false, bool TW_ = false>
struct ws_cfg {
    static constexpr int D = D_, KEYS = KEYS_, STAGES = STAGES_;
    static constexpr int NT = 384, ROWS = 128;
    static constexpr int CPR = D / 8;
    static constexpr int KSTEP = 128 / CPR;   /* keys one pass of the producer's 128 threads covers */
    static constexpr int NIT = KEYS / KSTEP;  /* 16-byte copies per producer thread per K or V tile */
    static constexpr size_t TILE = (size_t)KEYS * D * 2;
    /* kind 11: the tail warps' staging after the K/V stages */
    /* XF bit 67108864: the tail warps' Q rows (tw_warps), one buffer per warp after the stages */
    static constexpr size_t SMEM = 1024 + 2 * STAGES * TILE + (TAILS_ ? tail_cfg<D>::BYTES : 0) +
                                   (TW_ ? (size_t)tw_cfg<D>::BYTES : 0);
    static_assert(D == 64 || D == 128, "wgmma kernel: head_dim 64 or 128");
    static_assert(KSTEP % 8 == 0 && KEYS % KSTEP == 0 && NIT <= CPR && CPR <= 32, "producer mapping");
};
/* registers per thread after setmaxnreg: 128 x producer + 256 x consumer may
 * not exceed the 384 x 168 the CTA was launched with (setmaxnreg.inc would wait
 * forever) */
#ifndef WS_PRODUCER_REGS
#define WS_PRODUCER_REGS 40
#endif
#ifndef WS_CONSUMER_REGS
#define WS_CONSUMER_REGS 232
#endif
/* with TMA (kind 9) the producer needs more than 40 (ptxas spilled), and
 * the consumers fit in 224 without spilling */
#ifndef WS_PRODUCER_REGS_TMA
#define WS_PRODUCER_REGS_TMA 56
#endif
#ifndef WS_CONSUMER_REGS_TMA
#define WS_CONSUMER_REGS_TMA 224
#endif
/* kind 10 (clusters): 56 / 224 as kind 9, the producer spilling 16 bytes. v6's 64 / 216 spilled
 * nowhere but made ptxas serialize every wgmma of the kernel (C7512; v6 measured it so, and found
 * kind 10 slower: bench/NOTES.md v21) */
#ifndef WS_PRODUCER_REGS_MC
#define WS_PRODUCER_REGS_MC 56
#endif
#ifndef WS_CONSUMER_REGS_MC
#define WS_CONSUMER_REGS_MC 224
#endif
/* kind 11: the tail warps run in the producer's registers (each holds a third
 * of a transposed O); the consumers keep kind 9's 224 (with 200 the same
 * consumer code ran the 16k prefill at 466 TFLOP/s instead of 568) */
#ifndef WS_PRODUCER_REGS_TAIL
#define WS_PRODUCER_REGS_TAIL 56
#endif
#ifndef WS_CONSUMER_REGS_TAIL
#define WS_CONSUMER_REGS_TAIL 224
#endif
/* XF bit 67108864: the consumers keep kind 17's 224, so the tail warps run in the producer's 56
 * and spill (~580 bytes of spill stores, most outside the per-block loop: the walk, the masks,
 * the soft cap, the rescale, the merge). v20's 88 / 208 and 72 / 216 made ptxas serialize every
 * wgmma of the kernel (C7512, the shared pass's too), which the A/B of v20 measured
 * (bench/NOTES.md v21) */
#ifndef WS_PRODUCER_REGS_TW
#define WS_PRODUCER_REGS_TW 56
#endif
#ifndef WS_CONSUMER_REGS_TW
#define WS_CONSUMER_REGS_TW 224
#endif
/* named barriers: 1, 2 the consumers' turns; 3, 4 each consumer's own */
#define WS_BAR_TURN0 1
#define WS_BAR_WG0 3

/* XF, kind 9's v10 changes (kind 9 is XF 12, kind 16 XF 0, v9's kind 9): bit
 * 2 no rescale of O where no row of a warp got a new max, bit 3 the
 * producer's warp 0 alone (warps 1-3 leave at once; its full barriers count
 * 32). A lazy running max and 240 consumer registers were measured and
 * removed (bench/NOTES.md v10) */
template <typename T, int D, int KEYS, int STAGES, bool OVL, bool TMA, bool MC, bool TAILS, int XF = 0>
__global__ void __launch_bounds__(384, 1)
    attn_wgmma_ws_kernel(const char *__restrict__ plan, const T *__restrict__ kpool,
                         const T *__restrict__ vpool, const T *__restrict__ q, float *__restrict__ o,
                         float *__restrict__ lse, float *__restrict__ scratch, int Hq, int Hkv, int P,
                         int diag, const __grid_constant__ CUtensorMap kmap,
                         const __grid_constant__ CUtensorMap vmap, int tma_rows,
                         const __grid_constant__ CUtensorMap krun, const __grid_constant__ CUtensorMap vrun,
                         int tma_runs, int *counter) {
#if CAS_WGMMA_OK
    typedef ws_cfg<D, KEYS, STAGES, TAILS, (XF & 67108864) != 0> C;
    /* kind 11: the narrow kernel (a programmatic dependent) may start its CTAs
     * on SMs this grid leaves free; it waits for this grid before it ends */
    if (TAILS) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    /* XF bit 32 (kind 17): the merge kernel is a programmatic dependent of
     * this grid (its CTAs take SMs as these leave), and this grid one of the
     * narrow kernel's, whose end it waits for before it completes (below) */
    if (XF & 32) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    constexpr int CPR = C::CPR, KSTEP = C::KSTEP, NIT = C::NIT;
    extern __shared__ __align__(16) unsigned char smem[];
    /* K/V stages, 1024-byte aligned (the swizzle pattern repeats every 1024 bytes) */
    const uint32_t kv_s = (smem_u32(smem) + 1023u) & ~1023u;
    __shared__ int s_qpos[128];
    __shared__ long long s_qrow[128], s_oo[128], s_lo[128];
    /* full K, full V, empty K, empty V; XF bit 67108864: then full K and V of the tail warps' positions */
    __shared__ __align__(8) unsigned long long s_bar[((XF & 67108864) != 0 ? 6 : 4) * STAGES];
    __shared__ int s_fml[2][64], s_fmn[2]; /* XF bit 64: the tokens each consumer merges */
    __shared__ long long s_tlw[2][2]; /* XF bit 131072: consumer thread 0's full and turn waits */
    __shared__ int s_cdone, s_ctile, s_tti; /* kind 11: consumer warps done with their tasks,
                                              tiles consumer warpgroup 0 finished, the tail
                                              warps' task index */

    const cas_cuda_plan_hdr *h = reinterpret_cast<const cas_cuda_plan_hdr *>(plan);
    /* MC (kind 10): clusters of two CTAs walk a list of task pairs (tasks 2i
     * and 2i + 1, equal tile counts); CTA `crank` of a cluster runs task
     * 2i + crank. A pair flagged multicast (flags bit 0) shares its key range:
     * each CTA's producer loads half of every TMA tile into both CTAs. Every
     * stage is released by the consumers of both CTAs (empty barriers count
     * 16), so the two pipelines stay in step for unflagged pairs too. */
    const int crank = MC ? (int)cluster_rank() : 0;
    const int slot0 = MC ? (int)(blockIdx.x >> 1) : (int)blockIdx.x;
    const int nslot_grid = MC ? (int)(gridDim.x >> 1) : (int)gridDim.x;
    const int ntask = MC ? h->n_tasks_wide / 2 : h->n_tasks_wide;
    const cas_cuda_task *tasks = reinterpret_cast<const cas_cuda_task *>(plan + h->off_tasks_wide) + crank;
    const int tstride = MC ? 2 : 1;
    const cas_cuda_pass *passes = reinterpret_cast<const cas_cuda_pass *>(plan + h->off_passes);
    const int32_t *pages = reinterpret_cast<const int32_t *>(plan + h->off_pages);
    /* XF bit 16 (kind 17): CTA b runs tasks [cta_ptr[b], cta_ptr[b + 1]) of
     * the list, which the planner arranged per CTA (the decode tails
     * interleaved with the shared passes); otherwise tasks b, b + g, ... */
    int ti_first = slot0, ti_end = ntask, ti_step = nslot_grid;
    if constexpr ((XF & 16) != 0) {
        const int32_t *cta_ptr = reinterpret_cast<const int32_t *>(plan + h->off_cta_ptr);
        ti_first = cta_ptr[blockIdx.x];
        ti_end = cta_ptr[blockIdx.x + 1];
        ti_step = 1;
    }

    const int tid = threadIdx.x, lane = tid & 31;
    /* kind 11 with fused tasks: warp 0 alone produces (the full barriers
     * count its 32 threads), warps 1-3 run tails */
    const bool fuse = TAILS && h->n_tasks_fused > 0;
    constexpr bool p1 = !TAILS && !MC && (XF & 8); /* warp 0 alone produces */
    const int nprod = (fuse || p1) ? 32 : 128;
    const uint32_t bar0 = smem_u32(s_bar);
#define FULL_K(s) (bar0 + 8u * (uint32_t)(s))
#define FULL_V(s) (bar0 + 8u * (uint32_t)(STAGES + (s)))
#define FULL_KB(s) (bar0 + 8u * (uint32_t)(4 * STAGES + (s)))
#define FULL_VB(s) (bar0 + 8u * (uint32_t)(5 * STAGES + (s)))
#define EMPTY_K(s) (bar0 + 8u * (uint32_t)(2 * STAGES + (s)))
#define EMPTY_V(s) (bar0 + 8u * (uint32_t)(3 * STAGES + (s)))
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            mbar_init(FULL_K(s), nprod);
            mbar_init(FULL_V(s), nprod);
            if ((XF & 67108864) != 0) {
                mbar_init(FULL_KB(s), nprod);
                mbar_init(FULL_VB(s), nprod);
            }
            mbar_init(EMPTY_K(s), MC ? 16 : 8);
            mbar_init(EMPTY_V(s), MC ? 16 : 8);
        }
        if (MC) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        s_cdone = 0;
        s_ctile = 0;
        s_fmn[0] = s_fmn[1] = 0;
    }
    if (MC) cluster_sync_all();
    else __syncthreads();
    const int64_t page_stride = (int64_t)P * Hkv * D;
    constexpr bool TL = (XF & 131072) != 0, HINT = (XF & 65536) != 0;
    /* XF bit 67108864 (probe CASCADE_CUDA_XV=35): decode tails (flags 32) on the producer's spare warps
     * (tw_warps), interleaved with the consumers' tiles in the stage ring; needs warp 0 alone producing
     * (bit 8) and the per-CTA lists (bit 16) */
    constexpr bool TWK = (XF & 67108864) != 0 && (XF & 8) != 0 && (XF & 16) != 0 && !MC && !TAILS && !TL;
    const bool tl_cta = TL && blockIdx.x < TL_CTAS;
    if (tl_cta && tid == 0) {
        cas_tl_cta[blockIdx.x][0] = sm_id();
        cas_tl_cta[blockIdx.x][1] = global_timer();
        cas_tl_cta[blockIdx.x][2] = sm_clock64();
        cas_tl_cta[blockIdx.x][5] = ti_first < ti_end ? (ti_end - ti_first + ti_step - 1) / ti_step : 0;
    }

    /* the warpgroup index, warp-uniform for the compiler (wgmma on a path it
     * thinks divergent gets serialized) */
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    if (wg == 0) {
        /* ---- producer ---- */
        reg_dealloc<TWK ? WS_PRODUCER_REGS_TW : TAILS ? WS_PRODUCER_REGS_TAIL : MC ? WS_PRODUCER_REGS_MC : TMA ? WS_PRODUCER_REGS_TMA : WS_PRODUCER_REGS>();
        if (TAILS && fuse && tid >= 32) {
            /* the consumer tiles of this CTA's tasks, the budget the tail warps work within */
            int ctiles = 0;
            for (int ti = slot0; ti < ntask; ti += nslot_grid) {
                const int nk = tasks[ti * tstride].kv1 - tasks[ti * tstride].kv0;
                ctiles += nk > 0 ? (nk + KEYS - 1) / KEYS : 0;
            }
            tail_warps<T, D>(plan, kpool, vpool, q, o, lse, scratch, Hq, Hkv, P, counter,
                             kv_s + (uint32_t)(2 * STAGES * C::TILE), &s_cdone, 8, &s_ctile, ctiles, &s_tti);
            return;
        }
        if constexpr (TWK) {
            if (tid >= 32) {
                tw_warps<T, D, KEYS, STAGES>(plan, tasks, ti_first, ti_end, q, o, lse, scratch, Hq, kv_s, bar0,
                                             smem + (kv_s - smem_u32(smem)) + 2 * STAGES * C::TILE, diag);
                return;
            }
        }
        if (p1 && tid >= 32) return;
        if (TMA && tma_rows > 0 && tid == 0) {
            tma_prefetch_map(&kmap);
            tma_prefetch_map(&vmap);
            if (tma_runs) {
                tma_prefetch_map(&krun);
                tma_prefetch_map(&vrun);
            }
        }
        /* TMA: lane b of warp 0 copies box b of a tile: key rows
         * [b / CB x tma_rows, + tma_rows), columns [(b % CB) x 64, + 64)
         * (recomputed per tile: the producer has few registers) */
        constexpr int CB = D / 64;
        const int ch = tid % CPR, key0 = tid / CPR;
        const uint32_t soff0 = (uint32_t)((ch >> 3) * (KEYS * 128) + key0 * 128 + (((ch & 7) ^ (key0 & 7)) << 4));
        const int64_t row_stride = (int64_t)Hkv * D;
        /* XF bit 65536: K and V of a pass of one row block (read by this CTA
         * only) evict first; of the others evict normal */
        uint64_t pol_once = 0, pol_more = 0;
        if constexpr (HINT) {
            pol_once = l2_policy(0);
            pol_more = l2_policy(1);
        }
        /* XF bit 131072: thread 0's clocks (cas_tl) */
        const bool tlp = tl_cta && tid == 0;
        /* the first tile of task ti past its empty wait */
        auto tl_first = [&](int ti) {
            const int jt = (ti - ti_first) / ti_step;
            if (TL && tlp && jt < TL_TASKS) cas_tl[blockIdx.x][jt][7] = sm_clock64();
        };
        /* one tile: tile j of task t (ti in the list) into position it of the stage ring */
        /* XF bit 67108864: a tail warps' position (tw) completes their own full barriers */
#define FULL_OF(kv, s) ((kv) ? (tw ? FULL_VB(s) : FULL_V(s)) : (tw ? FULL_KB(s) : FULL_K(s)))
        auto load_tile = [&](const cas_cuda_task &t, int j, int it, int ti, const int32_t *pg_list, uint64_t pol,
                             bool look_runs, bool task_tma, bool mcast, const T *kb, const T *vb, bool tw) {
            const int s = it % STAGES;
            const uint32_t ph = (uint32_t)(it / STAGES) & 1u;
            if (task_tma && t.kv0 + (j + 1) * KEYS <= t.kv1) {
                /* a full tile: one box per lane of warp 0, the bytes
                 * counted by thread 0's expect-tx arrival; the other
                 * producer threads only arrive (the barriers count 128) */
                /* multicast: this CTA loads every other box, for both */
                const int nsmall = KEYS / tma_rows * CB;
                bool boxer = tid < nsmall && (!mcast || (tid & 1) == crank);
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
                    const uint32_t full = FULL_OF(kv, s);
                    if (MC) mbar_wait_cluster(kv ? EMPTY_V(s) : EMPTY_K(s), ph ^ 1u);
                    else mbar_wait(kv ? EMPTY_V(s) : EMPTY_K(s), ph ^ 1u);
                    if (TL && j == 0 && kv == 0) tl_first(ti);
                    if (tid == 0 && !(diag & 1)) mbar_arrive_expect_tx(full, (uint32_t)C::TILE);
                    else mbar_arrive(full);
                    if (tid < 32 && !(diag & 1)) {
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
                        if (boxer && mcast)
                            tma_load_4d_mc(dst, kv ? &vmap : &kmap, (tid % CB) * 64, t.kv_head, pr, pg, full,
                                           (uint16_t)3);
                        else if (run && HINT)
                            tma_load_3d_pol(dst, kv ? &vrun : &krun, (tid % CB) * 64, t.kv_head, pr, full, pol);
                        else if (run)
                            tma_load_3d(dst, kv ? &vrun : &krun, (tid % CB) * 64, t.kv_head, pr, full);
                        else if (boxer && HINT)
                            tma_load_4d_pol(dst, kv ? &vmap : &kmap, (tid % CB) * 64, t.kv_head, pr, pg, full,
                                            pol);
                        else if (boxer)
                            tma_load_4d(dst, kv ? &vmap : &kmap, (tid % CB) * 64, t.kv_head, pr, pg, full);
                    }
                }
                return;
            }
            if ((TAILS && fuse) || p1) {
                /* warp 0 alone: lane copies chunk lane % CPR of keys lane / CPR + n (32 / CPR),
                 * 32 keys per round, their page ids looked up one per lane */
                constexpr int KPR = 32 / CPR;
                const int ch32 = lane % CPR;
#pragma unroll
                for (int kv = 0; kv < 2; kv++) {
                    const T *base = (kv ? vpool : kpool) + (int64_t)t.kv_head * D + ch32 * 8;
                    const uint32_t d0 = kv_s + (uint32_t)(s * 2 * C::TILE + kv * C::TILE);
                    mbar_wait(kv ? EMPTY_V(s) : EMPTY_K(s), ph ^ 1u);
                    if (diag & 1) {
                        mbar_arrive(FULL_OF(kv, s));
                        continue;
                    }
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
                            cp_async16_s(d0 + so, base + off, pr >= 0 ? 16 : 0);
                        }
                    }
                    mbar_arrive_cpasync(FULL_OF(kv, s));
                }
                return;
            }
            const uint32_t dk = kv_s + (uint32_t)(s * 2 * C::TILE) + soff0;
            const int k0 = t.kv0 + j * KEYS + key0;
            /* this thread copies chunk ch of keys k0 + n KSTEP; the CPR
             * lanes of a key share its page ids: lane ch of the group looks
             * up step n = ch (one load each, before the wait for the
             * slot), and step n takes it from lane n by a shuffle */
            int pg_own = 0, pr_own = -1;
            if (ch < NIT) {
                const int kidx = k0 + ch * KSTEP;
                if (kidx < t.kv1) {
                    const int pi = kidx / P;
                    pg_own = pg_list[pi];
                    pr_own = kidx - pi * P;
                } else {
                    pg_own = pg_list[0];
                }
            }
#pragma unroll
            for (int kv = 0; kv < 2; kv++) {
                const T *base = kv ? vb : kb;
                const uint32_t d0 = dk + (uint32_t)(kv * C::TILE);
                if (MC) mbar_wait_cluster(kv ? EMPTY_V(s) : EMPTY_K(s), ph ^ 1u);
                else mbar_wait(kv ? EMPTY_V(s) : EMPTY_K(s), ph ^ 1u);
                if (TL && j == 0 && kv == 0) tl_first(ti);
                if (diag & 1) { /* measurement only: no copies (wrong results) */
                    mbar_arrive(FULL_OF(kv, s));
                    continue;
                }
#pragma unroll
                for (int n = 0; n < NIT; n++) {
                    const int pg = __shfl_sync(0xffffffffu, pg_own, n, CPR);
                    const int pr = __shfl_sync(0xffffffffu, pr_own, n, CPR);
                    const int64_t off = (int64_t)pg * page_stride + (pr > 0 ? (int64_t)pr * row_stride : 0);
                    cp_async16_s(d0 + (uint32_t)(n * KSTEP * 128), base + off, pr >= 0 ? 16 : 0);
                }
                mbar_arrive_cpasync(FULL_OF(kv, s));
            }
        };
        int it = 0;
        if constexpr (TWK) {
            /* XF bit 67108864: every position in order, from the next tile of its class's tasks */
            int na, nb;
            tw_count<KEYS>(tasks, ti_first, ti_end, lane, na, nb);
            const int n = na + nb;
            int ta = ti_first - 1, tb = ti_first - 1, ja = 0, jb = 0, nta = 0, ntb = 0;
            cas_cuda_tw_walk wk = {0, 0, 0, na};
            for (int k = 0; k < n; k++) {
                int ti, j;
                const bool cb = cas_cuda_tw_next(&wk, nb, n) != 0;
                if (cb) {
                    while (jb >= ntb) {
                        do tb++;
                        while (!(tasks[tb].flags & 32));
                        ntb = task_tiles<KEYS>(tasks[tb]);
                        jb = 0;
                    }
                    ti = tb;
                    j = jb++;
                } else {
                    while (ja >= nta) {
                        do ta++;
                        while (tasks[ta].flags & 32);
                        nta = task_tiles<KEYS>(tasks[ta]);
                        ja = 0;
                    }
                    ti = ta;
                    j = ja++;
                }
                const cas_cuda_task t = tasks[ti];
                const cas_cuda_pass pp = passes[t.pass];
                load_tile(t, j, k, ti, pages + pp.page_off, HINT && (int64_t)pp.n_tok * h->group <= C::ROWS ? pol_once : pol_more,
                          tma_runs && pp.page_runs, TMA && tma_rows > 0 && t.kv0 % tma_rows == 0, false,
                          kpool + (int64_t)t.kv_head * D + ch * 8, vpool + (int64_t)t.kv_head * D + ch * 8, cb);
            }
        }
        for (int ti = ti_first; ti < (TWK ? ti_first : ti_end); ti += ti_step) {
            const cas_cuda_task t = tasks[ti * tstride];
            const bool mcast = MC && (t.flags & 1);
            const int32_t *pg_list = pages + passes[t.pass].page_off;
            const bool once = HINT && (int64_t)passes[t.pass].n_tok * h->group <= C::ROWS;
            const uint64_t pol = once ? pol_once : pol_more;
            const bool look_runs = tma_runs && passes[t.pass].page_runs && !mcast;
            const int nkeys = t.kv1 - t.kv0;
            const int ntiles = nkeys > 0 ? (nkeys + KEYS - 1) / KEYS : 0;
            const T *kb = kpool + (int64_t)t.kv_head * D + ch * 8;
            const T *vb = vpool + (int64_t)t.kv_head * D + ch * 8;
            /* whole boxes of tma_rows keys lie in one page when the task
             * starts on a multiple of tma_rows (a divisor of the page size) */
            const bool task_tma = TMA && tma_rows > 0 && t.kv0 % tma_rows == 0;
            for (int j = 0; j < ntiles; j++, it++)
                load_tile(t, j, it, ti, pg_list, pol, look_runs, task_tma, mcast, kb, vb, false);
            if (TL && tlp) {
                const int jt = (ti - ti_first) / ti_step;
                if (jt < TL_TASKS) {
                    long long *e = cas_tl[blockIdx.x][jt];
                    e[8] = sm_clock64();
                    e[9] = (long long)t.nrows | (long long)ntiles << 16 | (long long)t.kv_head << 32 |
                            (long long)((int64_t)passes[t.pass].n_tok * h->group <= C::ROWS) << 48;
                }
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        if (TL && tlp) {
            cas_tl_cta[blockIdx.x][6] = global_timer();
            cas_tl_cta[blockIdx.x][7] = sm_clock64();
        }
    } else {
        /* ---- consumers ---- */
        reg_alloc<TWK ? WS_CONSUMER_REGS_TW : TAILS ? WS_CONSUMER_REGS_TAIL : MC ? WS_CONSUMER_REGS_MC : TMA ? WS_CONSUMER_REGS_TMA : WS_CONSUMER_REGS>();
        const int32_t *tok_ids = reinterpret_cast<const int32_t *>(plan + h->off_tok_ids);
        const int32_t *tok_pos = reinterpret_cast<const int32_t *>(plan + h->off_tok_pos);
        const int group = h->group, causal = h->causal, window = h->window_left;
        const float scale_log2 = h->scale_log2, cap = h->soft_cap, scale = h->scale;
        const float sl = cap > 0.f ? 1.f : scale_log2; /* s x sl: the log2-domain logit */
        const int cw = wg - 1, ctid = tid & 127;
        const int wrow = cw * 64 + (ctid >> 5) * 16; /* this warp's first row in the CTA */
        const int my_turn = WS_BAR_TURN0 + cw, other_turn = WS_BAR_TURN0 + 1 - cw, bar_wg = WS_BAR_WG0 + cw;
        if (cw == 1) nbar_arrive(WS_BAR_TURN0, 256); /* consumer 0 goes first */
        /* a warp is done with a stage: lane 0 tells this CTA's producer, and
         * with MC lane 1 the other CTA's (which may multicast into it) */
        auto release = [&](uint32_t bar) {
            if (lane == 0) mbar_arrive(bar);
            if (MC && lane == 1) mbar_arrive_cluster(bar, crank ^ 1);
        };
        int it = 0;
        /* XF bit 67108864: the positions of the stage ring walked in order (cas_cuda_tw_next), the tail warps'
         * passed; next_a gives the next position of the consumers and (par) the parity of their use
         * of its stage: their full barriers complete on their positions only, one phase a use
         * (tw_pa: bit s, the parity of the next use of stage s) */
        int tw_n = 0, tw_nb = 0, tw_pos = 0, tw_pa = 0, itph = 0;
        cas_cuda_tw_walk tw_wk = {0, 0, 0, 0};
        if constexpr (TWK) {
            tw_count<KEYS>(tasks, ti_first, ti_end, lane, tw_wk.a_left, tw_nb);
            tw_n = tw_wk.a_left + tw_nb;
        }
        auto next_a = [&](int &par) {
            int k = tw_pos++;
            while (cas_cuda_tw_next(&tw_wk, tw_nb, tw_n)) k = tw_pos++;
            const int sk = k % STAGES;
            par = (tw_pa >> sk) & 1;
            tw_pa ^= 1 << sk;
            return k;
        };
        /* the parity of position k's phase (the consumers' own with XF bit 67108864, in itph) */
        auto ph_of = [&](int k, int par) { return TWK ? (uint32_t)par : (uint32_t)(k / STAGES) & 1u; };
        /* XF bit 131072: thread 0 of each consumer stamps its tasks (cas_tl) */
        const bool tlc = tl_cta && ctid == 0;
        auto clk = [&]() -> long long { return TL && tlc ? sm_clock64() : 0LL; };
        /* the sums of waits live in shared memory (the consumers' registers are full) */
        auto tl_add = [&](int k, long long c) {
            if (TL && tlc) {
                volatile long long *w = &s_tlw[cw][k];
                *w = *w + c;
            }
        };
        for (int ti = ti_first; ti < ti_end; ti += ti_step) {
            if constexpr (TWK) {
                if (tasks[ti].flags & 32) continue; /* the tail warps' */
            }
            const cas_cuda_task t = tasks[ti * tstride];
            const cas_cuda_pass ps = passes[t.pass];
            const int jt = (ti - ti_first) / ti_step;
            const bool tlt = TL && tlc && jt < TL_TASKS;
            if (TL && tlt) {
                cas_tl[blockIdx.x][jt][cw ? 5 : 0] = sm_clock64();
                s_tlw[cw][0] = s_tlw[cw][1] = 0;
            }
            if constexpr ((XF & 16) != 0) {
                /* a task of at most 64 rows: consumer 1 has none of them and
                 * keeps only its side of the protocol (its turns, the full
                 * waits and the releases), leaving the tensor cores to
                 * consumer 0 */
                if (cw == 1 && t.nrows <= 64) {
                    const int nk = t.kv1 - t.kv0, nt = nk > 0 ? (nk + KEYS - 1) / KEYS : 0;
                    if (nt > 0) {
                        if constexpr (TWK) it = next_a(itph);
                        const int s0 = it % STAGES;
                        long long w0 = clk();
                        mbar_wait(FULL_K(s0), ph_of(it, itph));
                        tl_add(0, clk() - w0);
                        nbar_sync(my_turn, 256);
                        nbar_arrive(other_turn, 256);
                        release(EMPTY_K(s0));
                        for (int i = 0; i < nt; i++, it++) {
                            const int sc = it % STAGES;
                            int sn = (it + 1) % STAGES;
                            const bool more = i + 1 < nt;
                            w0 = clk();
                            mbar_wait(FULL_V(sc), ph_of(it, itph));
                            if constexpr (TWK) {
                                /* the next position of the consumers (it + 1 after this iteration) */
                                int phn = 0;
                                const int itn = more ? next_a(phn) : it + 1;
                                sn = itn % STAGES;
                                if (more) mbar_wait(FULL_K(sn), (uint32_t)phn);
                                it = itn - 1;
                                itph = phn;
                            } else if (more) {
                                mbar_wait(FULL_K(sn), (uint32_t)((it + 1) / STAGES) & 1u);
                            }
                            tl_add(0, clk() - w0);
                            nbar_sync(my_turn, 256);
                            nbar_arrive(other_turn, 256);
                            release(EMPTY_V(sc));
                            if (more) release(EMPTY_K(sn));
                        }
                    }
                    if (TL && tlt) {
                        cas_tl[blockIdx.x][jt][6] = sm_clock64();
                        cas_tl[blockIdx.x][jt][10] = s_tlw[cw][0];
                    }
                    continue;
                }
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
            /* XF bit 16384: each row's exponent offset (mrow x sl) and the
             * raw score above which the max must move */
            float mul[2] = {0.f, 0.f}, mthr[2] = {-CUDART_INF_F, -CUDART_INF_F};
            const int qp[2] = {s_qpos[wrow + (lane >> 2)], s_qpos[wrow + (lane >> 2) + 8]};
            float s[KEYS / 2];
            /* S = Q K^T of the tile in stage st (64 rows x KEYS keys per warpgroup), no commit */
            auto mma_qk = [&](int st) {
                const uint32_t ka = kv_s + (uint32_t)(st * 2 * C::TILE);
#pragma unroll
                for (int ks = 0; ks < D / 16; ks++)
                    wg_mma<T, KEYS>::template run<0>(
                        s, qf[ks], wg_desc(ka + (ks >> 2) * (KEYS * 128) + (ks & 3) * 32, 16, 1024), ks > 0);
            };
            /* softmax of S (tile i) into probabilities in s: scale or soft
             * cap, masks, running max and sum; al: the factor O must be
             * rescaled by (done by rescale_pack, so that with OVL it can wait
             * until the previous O += P V has completed) */
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
                if constexpr ((XF & 16384) != 0) {
                    /* XF bit 16384 (kind 17 from v15): the running
                     * max moves only when a score passes it by more than
                     * 2^LAZY_LOG2 in the exponential's domain (P up to 256,
                     * exact after the final division); a warp whose scores
                     * all stay under that skips the quad shuffles, the
                     * rescale and its exponential */
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
                } else {
                    al[0] = al[1] = 1.f;
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        float mx = -CUDART_INF_F;
#pragma unroll
                        for (int nt = 0; nt < KEYS / 8; nt++) mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
                        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                        float mu;
                        al[hf] = online_max(mrow[hf], mx, sl, mu);
                        float rs = 0.f;
#pragma unroll
                        for (int nt = 0; nt < KEYS / 8; nt++) {
                            s[4 * nt + 2 * hf] = ex2_fast(fmaf(s[4 * nt + 2 * hf], sl, -mu));
                            s[4 * nt + 2 * hf + 1] = ex2_fast(fmaf(s[4 * nt + 2 * hf + 1], sl, -mu));
                            rs += s[4 * nt + 2 * hf] + s[4 * nt + 2 * hf + 1];
                        }
                        lrow[hf] = lrow[hf] * al[hf] + rs;
                    }
                }
            };
            uint32_t pa[KEYS / 16][4];
            auto rescale_pack = [&]() {
                if (!(XF & 4) || !__all_sync(0xffffffffu, al[0] == 1.f && al[1] == 1.f)) {
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
                    pa[kk][0] = mma_op<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
                    pa[kk][1] = mma_op<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
                    pa[kk][2] = mma_op<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
                    pa[kk][3] = mma_op<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
                }
            };
            auto mma_pv = [&](int st) {
                const uint32_t vs_addr = kv_s + (uint32_t)(st * 2 * C::TILE) + (uint32_t)C::TILE;
#pragma unroll
                for (int kk = 0; kk < KEYS / 16; kk++)
                    wg_mma<T, D>::template run<1>(oacc, pa[kk], wg_desc(vs_addr + kk * 2048, KEYS * 128, 1024), 1);
            };
            if (ntiles > 0) {
                if constexpr (TWK) it = next_a(itph);
                const int s0 = it % STAGES;
                const long long w0 = clk();
                mbar_wait(FULL_K(s0), ph_of(it, itph));
                fence_proxy_async();
                const long long w1 = clk();
                nbar_sync(my_turn, 256);
                const long long w2 = clk();
                tl_add(0, w1 - w0);
                tl_add(1, w2 - w1);
                wg_fence();
                mma_qk(s0);
                wg_commit();
                nbar_arrive(other_turn, 256);
                wg_wait<0>();
                wg_fence_regs<KEYS / 2>(s);
                if (TL && tlt) cas_tl[blockIdx.x][jt][1] = sm_clock64();
                release(EMPTY_K(s0));
                if (OVL) {
                    softmax(0);
                    rescale_pack();
                }
            }
            /* one tile i, on this consumer's turn: O += P V (tile i) and, if
             * MORE, S of tile i + 1 (two instances: wgmma under a run-time
             * branch gets serialized by ptxas). Without OVL: softmax of tile
             * i first, then both products in one commit group. With OVL (P of
             * tile i is ready): S of tile i + 1, then P V of tile i; the
             * softmax of tile i + 1 runs while P V is on the tensor cores.
             * par: the parity of position it's phase with XF bit 67108864
             * (itph, see ph_of) */
            int it_next = it, itph_next = 0; /* the position after this tile's and its parity (step) */
            auto step = [&](int i, int par, auto more_c) {
                constexpr bool more = decltype(more_c)::value;
                if (!OVL) {
                    softmax(i);
                    rescale_pack();
                }
                const int sc = it % STAGES;
                int sn = (it + 1) % STAGES;
                const long long w0 = clk();
                mbar_wait(FULL_V(sc), ph_of(it, par));
                /* XF bit 67108864: the next position of the consumers (the tail warps' passed) */
                if constexpr (TWK) {
                    it_next = more ? next_a(itph_next) : it;
                    sn = it_next % STAGES;
                    if (more) mbar_wait(FULL_K(sn), (uint32_t)itph_next);
                } else if (more) {
                    mbar_wait(FULL_K(sn), (uint32_t)((it + 1) / STAGES) & 1u);
                }
                fence_proxy_async();
                const long long w1 = clk();
                nbar_sync(my_turn, 256);
                const long long w2 = clk();
                tl_add(0, w1 - w0);
                tl_add(1, w2 - w1);
                wg_fence_regs<D / 2>(oacc);
                wg_fence();
                if constexpr (OVL) {
                    if constexpr (more) {
                        mma_qk(sn);
                        wg_commit();
                    }
                    mma_pv(sc);
                    wg_commit();
                    nbar_arrive(other_turn, 256);
                    if constexpr (more) {
                        wg_wait<1>();
                        wg_fence_regs<KEYS / 2>(s);
                        release(EMPTY_K(sn));
                        softmax(i + 1);
                    }
                    wg_wait<0>();
                    wg_fence_regs<D / 2>(oacc);
                    release(EMPTY_V(sc));
                    if constexpr (more) rescale_pack();
                } else {
                    mma_pv(sc);
                    if constexpr (more) mma_qk(sn);
                    wg_commit();
                    nbar_arrive(other_turn, 256);
                    wg_wait<0>();
                    wg_fence_regs<D / 2>(oacc);
                    wg_fence_regs<KEYS / 2>(s);
                    release(EMPTY_V(sc));
                    if (more) release(EMPTY_K(sn));
                }
                /* kind 11: the tail warps' clock */
                if (TAILS && cw == 0 && ctid == 0) {
                    volatile int *ct = &s_ctile;
                    *ct = *ct + 1;
                }
            };
            for (int i = 0; i + 1 < ntiles; i++, it = TWK ? it_next : it + 1, itph = itph_next)
                step(i, itph, std::true_type{});
            if (ntiles > 0) {
                step(ntiles - 1, itph, std::false_type{});
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
                if (r < t.nrows && !(MC && (t.flags & 2))) { /* a stand-in writes nothing */
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
            if (TL && tlt) {
                long long *e = cas_tl[blockIdx.x][jt];
                if (cw == 0) {
                    e[2] = sm_clock64();
                    e[3] = s_tlw[0][0];
                    e[4] = s_tlw[0][1];
                } else {
                    e[6] = sm_clock64();
                    e[10] = s_tlw[1][0];
                }
            }
            /* XF bit 64 (kind 18): each consumer is a writer unit of its 64
             * rows; the last unit of a token merges its states */
            if constexpr ((XF & 64) != 0) {
                if (t.o_off >= 0 && h->merge_fused)
                    fused_merge<D>(plan, t, cw * 64, t.nrows < cw * 64 + 64 ? t.nrows : cw * 64 + 64, ctid, 128,
                                   s_fml[cw], &s_fmn[cw], o, lse, scratch, Hq, Hkv,
                                   [&] { nbar_sync(bar_wg, 128); });
            }
        }
        /* consumer 1 arrived once more on consumer 0's turn than consumer 0 waited */
        if (cw == 0) nbar_sync(WS_BAR_TURN0, 256);
        if (TL && tlc && cw == 0) {
            cas_tl_cta[blockIdx.x][3] = global_timer();
            cas_tl_cta[blockIdx.x][4] = sm_clock64();
        }
        /* kind 11: the tail warps stop taking tasks once all 8 consumer warps are here */
        if (TAILS && lane == 0) atomicAdd(&s_cdone, 1);
    }
    /* the other CTA may still arrive on this one's barriers until it is done */
    if (MC) cluster_sync_all();
    /* XF bit 32: not complete before the narrow kernel (see above), so that
     * the merge after this grid sees both (at once without a prerequisite) */
    if (XF & 32) asm volatile("griddepcontrol.wait;\n" ::: "memory");
#undef FULL_K
#undef FULL_V
#undef FULL_KB
#undef FULL_VB
#undef FULL_OF
#undef EMPTY_K
#undef EMPTY_V
#else
    __trap();
#endif
}

/* ---- launchers ---------------------------------------------------------- */

/* kinds: 3 plain, 4 next S during this softmax, 6 warp-specialized 128-key
 * tiles x 3 stages, 7 warp-specialized 64-key tiles x 6 stages, 8 kind 6
 * with the softmax of the next tile during this tile's P V, 9 kind 6 with
 * the full tiles of K and V brought in by the bulk tensor copy engine (TMA)
 * where the page size allows (tma_box_rows), 10 kind 9 in clusters of two
 * CTAs that run pairs of tasks, K and V of a pair sharing its keys
 * multicast to both (the planner pairs the row blocks of one KV chunk) */
template <typename C_, typename T, void *(*F)()> struct wg_entry {
    typedef C_ C;
    static constexpr int NT = C::NT;
    static constexpr size_t SMEM = C::SMEM;
    static void *fn() { return F(); }
};
template <typename T, int D, bool OVL> void *wg_plain_fn() { return (void *)attn_wgmma_kernel<T, D, OVL>; }
template <typename T, int D, int KEYS, int ST, bool OVL, bool TMA, bool MC, bool TAILS, int XF> void *wg_ws_fn() {
    return (void *)attn_wgmma_ws_kernel<T, D, KEYS, ST, OVL, TMA, MC, TAILS, XF>;
}
template <typename T, int D, int KEYS, int ST, bool OVL, bool TMA, bool MC, bool TAILS = false, int XF = 0>
struct wg_ws : wg_entry<ws_cfg<D, KEYS, ST, TAILS, (XF & 67108864) != 0>, T,
                        wg_ws_fn<T, D, KEYS, ST, OVL, TMA, MC, TAILS, XF>> {};

template <typename T, int D, int KIND> struct wg_kernel;
template <typename T, int D> struct wg_kernel<T, D, 3> : wg_entry<wg_cfg<D, false>, T, wg_plain_fn<T, D, false>> {};
template <typename T, int D> struct wg_kernel<T, D, 4> : wg_entry<wg_cfg<D, true>, T, wg_plain_fn<T, D, true>> {};
template <typename T, int D> struct wg_kernel<T, D, 6> : wg_ws<T, D, 128, 3, false, false, false> {};
template <typename T, int D> struct wg_kernel<T, D, 7> : wg_ws<T, D, 64, 6, false, false, false> {};
template <typename T, int D> struct wg_kernel<T, D, 8> : wg_ws<T, D, 128, 3, true, false, false> {};
template <typename T, int D> struct wg_kernel<T, D, 9> : wg_ws<T, D, 128, 3, false, true, false, false, 12> {};
template <typename T, int D> struct wg_kernel<T, D, 10> : wg_ws<T, D, 128, 3, false, true, true> {};
template <typename T, int D> struct wg_kernel<T, D, 11> : wg_ws<T, D, 128, 3, false, true, false, true> {};
/* kind 9 as in v9 (for A/B runs in one call) */
template <typename T, int D> struct wg_kernel<T, D, 16> : wg_ws<T, D, 128, 3, false, true, false, false, 0> {};
/* kind 9 with the decode tails in its own list, arranged per CTA by the
 * planner, and consumer 1 idle on tasks of at most 64 rows; since v17 its
 * TMA loads of passes of one row block (the tails) evict first from the L2
 * (XF bit 65536: the shared passes' K and V stay for their other row blocks) */
template <typename T, int D> struct wg_kernel<T, D, 17> : wg_ws<T, D, 128, 3, false, true, false, false, 60 | 16384 | 65536> {};
/* 18: 17 with the merge of split states in the kernels (XF bit 64) */
template <typename T, int D> struct wg_kernel<T, D, 18> : wg_ws<T, D, 128, 3, false, true, false, false, 124> {};
/* Kind 17's probes (never planned: kind 17 launches kind 200 + n under CASCADE_CUDA_XV=n, bf16 and head_dim 128
 * only). 218 (=18): kind 17 with a timeline of every CTA's tasks (XF bit 131072, cas_tl). 235 (=35): kind 17
 * with the decode tails of at most 8 rows on the producer's spare warps (XF bit 67108864, tw_warps). The other
 * probes were removed after their measurements: 201-213 (exponentials on the FMA pipe, FA3's intra-warpgroup
 * overlap, no softmax, the turn handed on after the products, descriptor offsets, clock stamps, kind 17 without
 * the lazy max or the proxy fence; bench/NOTES.md v13-v15; 201-203 were timed with their wgmma serialized, v21), 217, 219, 220 (L2 policies, v17), 225-234 (Q staged
 * by the producer, pairs of tails, the padding rows' softmax skipped, tails by mma.sync; v17-v19); code in git
 * history before this commit. (v16's 214-216 and v17's 221-224 went earlier: commits 950af49, 5b0fce7) */
template <typename T, int D> struct wg_kernel<T, D, 218> : wg_ws<T, D, 128, 3, false, true, false, false, 60 | 16384 | 65536 | 131072> {};
template <typename T, int D> struct wg_kernel<T, D, 235> : wg_ws<T, D, 128, 3, false, true, false, false, 60 | 16384 | 65536 | 67108864> {};
template <typename T, int D, int KIND> struct wg_cluster { static constexpr int N = 1; };
template <typename T, int D> struct wg_cluster<T, D, 10> { static constexpr int N = 2; };

/* Rows of K or V one TMA box holds: the largest power of two up to 64 that
 * divides the page size, so that a box never crosses a page; 0 (no TMA) when
 * that is under 8 (the 128-byte swizzle repeats every 8 rows of 128 bytes,
 * so each box must start on a 1024-byte boundary of the stage). */
static int tma_box_rows(int P) {
    int r = P & -P;
    if (r > 64) r = 64;
    return r >= 8 ? r : 0;
}

typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                    const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                    const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                    CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* The 4-D map of a pool [pages][P][Hkv][D] as (D, Hkv, P, pages), boxes of
 * (64, 1, rows, 1) in the 128-byte swizzle that wgmma's K-major operand
 * reads. The page extent is the int32 range of page ids rather than the
 * pool's size: the plan validates page ids against the pool, and a map baked
 * into a captured graph stays valid for every later plan. 0 on success. */
static encode_tiled_fn tma_encoder(void) {
    static encode_tiled_fn encode = NULL;
    static int looked_up = 0;
    if (!looked_up) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) ==
                cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            encode = (encode_tiled_fn)fn;
        looked_up = 1;
    }
    return encode;
}
static int tma_encode(CUtensorMap *map, const void *pool, int dtype, int D, int Hkv, int P, int rows) {
    encode_tiled_fn encode = tma_encoder();
    if (!encode || ((uintptr_t)pool & 15)) return -1;
    const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)Hkv, (cuuint64_t)P, (cuuint64_t)0x7fffffff};
    const cuuint64_t strides[3] = {(cuuint64_t)D * 2, (cuuint64_t)Hkv * D * 2, (cuuint64_t)P * Hkv * D * 2};
    const cuuint32_t box[4] = {64, 1, (cuuint32_t)rows, 1};
    const cuuint32_t estr[4] = {1, 1, 1, 1};
    CUresult r = encode(map, dtype == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                        const_cast<void *>(pool), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : -1;
}
/* The pool as rows: (D, Hkv, pages x P rows), boxes of (64, 1, 64): 64
 * keys of consecutive rows, which cross pages when the page ids are
 * consecutive (a run). Row coordinates are int32: rows up to 2^31 - 1. */
static int tma_encode_rows(CUtensorMap *map, const void *pool, int dtype, int D, int Hkv) {
    encode_tiled_fn encode = tma_encoder();
    if (!encode || ((uintptr_t)pool & 15)) return -1;
    const cuuint64_t dims[3] = {(cuuint64_t)D, (cuuint64_t)Hkv, (cuuint64_t)0x7fffffff};
    const cuuint64_t strides[2] = {(cuuint64_t)D * 2, (cuuint64_t)Hkv * D * 2};
    const cuuint32_t box[3] = {64, 1, 64};
    const cuuint32_t estr[3] = {1, 1, 1};
    CUresult r = encode(map, dtype == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                        const_cast<void *>(pool), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : -1;
}

/* The maps of the last pools launched on, per host thread (encoding is a
 * host-only call, but the launch path should not repeat it per layer). */
struct tma_maps {
    const void *k, *v;
    cas_cuda_geom g;
    int rows; /* 0: TMA off for these pools */
    int runs; /* 1: the row maps below are valid (boxes of rows < 64) */
    CUtensorMap km, vm, kr, vr;
};
static int tma_maps_for(tma_maps *m, const cas_cuda_geom *g, const void *k, const void *v) {
    if (m->k == k && m->v == v && !memcmp(&m->g, g, sizeof *g)) return m->rows;
    m->k = k;
    m->v = v;
    m->g = *g;
    m->rows = tma_box_rows(g->page_size);
    if (m->rows && (g->D % 64 || tma_encode(&m->km, k, g->dtype, g->D, g->Hkv, g->page_size, m->rows) ||
                    tma_encode(&m->vm, v, g->dtype, g->D, g->Hkv, g->page_size, m->rows))) {
        fprintf(stderr, "cascade cuda: no tensor map for pages of %d (D %d): kind 9 copies with cp.async\n",
                g->page_size, g->D);
        m->rows = 0;
    }
    /* CASCADE_CUDA_TMA_RUNS=0: no run boxes (measurement) */
    static const int runs_env = getenv("CASCADE_CUDA_TMA_RUNS") ? atoi(getenv("CASCADE_CUDA_TMA_RUNS")) : 1;
    m->runs = runs_env && m->rows > 0 && m->rows < 64 && !tma_encode_rows(&m->kr, k, g->dtype, g->D, g->Hkv) &&
              !tma_encode_rows(&m->vr, v, g->dtype, g->D, g->Hkv);
    return m->rows;
}

/* launch configuration of a cluster kind: clusters of wg_cluster::N CTAs,
 * as many whole clusters as fit in `grid` CTAs (attr must outlive it) */
template <typename T, int D, int KIND>
static cudaLaunchConfig_t wg_cluster_cfg(cudaLaunchAttribute *attr, int grid, cudaStream_t st) {
    typedef wg_kernel<T, D, KIND> K;
    cudaLaunchConfig_t cfg = {};
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = wg_cluster<T, D, KIND>::N;
    attr->val.clusterDim.y = 1;
    attr->val.clusterDim.z = 1;
    cfg.gridDim = dim3(grid / wg_cluster<T, D, KIND>::N * wg_cluster<T, D, KIND>::N);
    cfg.blockDim = dim3(K::NT);
    cfg.dynamicSmemBytes = K::SMEM;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
}

/* CASCADE_CUDA_XV=18: at exit, the timeline of the last run (cas_tl,
 * kernel above) as one JSON object to the file CASCADE_CUDA_TRACE names (else
 * stderr): "ctas": per CTA [sm, gt0, clk0, gt_c0end, clk_c0end, ntasks,
 * gt_pend, clk_pend] and its tasks' fields as the kernel wrote them */
static void cas_cuda_tl_dump(void) {
    static long long hc[TL_CTAS][8], ht[TL_CTAS][TL_TASKS][TL_F];
    if (cudaDeviceSynchronize() != cudaSuccess || cudaMemcpyFromSymbol(hc, cas_tl_cta, sizeof hc) != cudaSuccess ||
        cudaMemcpyFromSymbol(ht, cas_tl, sizeof ht) != cudaSuccess)
        return;
    const char *path = getenv("CASCADE_CUDA_TRACE");
    FILE *f = path && *path ? fopen(path, "w") : stderr;
    if (!f) return;
    fprintf(f, "{\"fields\": \"c0_start c0_first_s c0_end c0_full_wait c0_turn_wait c1_start c1_end p_first p_last "
               "meta c1_full_wait\",\n\"ctas\": [");
    int first = 1;
    for (int b = 0; b < TL_CTAS; b++) {
        if (!hc[b][1]) continue;
        fprintf(f, "%s\n{\"cta\": %d, \"hdr\": [", first ? "" : ",", b);
        for (int k = 0; k < 8; k++) fprintf(f, "%s%lld", k ? ", " : "", hc[b][k]);
        fprintf(f, "], \"tasks\": [");
        const int n = hc[b][5] < TL_TASKS ? (int)hc[b][5] : TL_TASKS;
        for (int j = 0; j < n; j++) {
            fprintf(f, "%s[", j ? ", " : "");
            for (int k = 0; k < TL_F; k++) fprintf(f, "%s%lld", k ? ", " : "", ht[b][j][k]);
            fprintf(f, "]");
        }
        fprintf(f, "]}");
        first = 0;
    }
    fprintf(f, "\n]}\n");
    if (f != stderr) fclose(f);
}

/* the shared-memory limit of each kind listed (kind 17's probes) */
template <typename T, int D, int... KS> static void wg_set_smem() {
    (cudaFuncSetAttribute(wg_kernel<T, D, KS>::fn(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)wg_kernel<T, D, KS>::SMEM),
     ...);
}
template <typename T, int D, int KIND>
static int wg_launch(const cas_cuda_geom *g, const void *plan, const void *k, const void *v,
                     const void *q, float *o, float *lse, float *scratch, int *counter, int grid,
                     int pdl, cudaStream_t st) {
    typedef wg_kernel<T, D, KIND> K;
    if constexpr (KIND == 17 && std::is_same<T, __nv_bfloat16>::value && D == 128) {
        /* the probes: bf16 and head_dim 128 only (other geometries run kind 17) */
        const int xv = g->xv; /* per context, so that an A/B run in one process can set it */
        if (xv == 18 || xv == 35) {
            static int ready = 0; /* the variants' shared-memory limit, set once per process */
            if (!ready) {
                wg_set_smem<T, D, 218, 235>();
                ready = 1;
            }
            static int dump_tl = 0; /* the timeline's dump at exit, once */
            if (xv == 18 && !dump_tl) dump_tl = !atexit(cas_cuda_tl_dump);
            switch (xv) {
#define CAS_XV(n) \
    case n: return wg_launch<T, D, 200 + n>(g, plan, k, v, q, o, lse, scratch, counter, grid, pdl, st);
                CAS_XV(18) CAS_XV(35)
#undef CAS_XV
            default: break;
            }
        }
    }
    const char *plan_c = (const char *)plan;
    const T *kp = (const T *)k, *vp = (const T *)v, *qp = (const T *)q;
    int Hq = g->Hq, Hkv = g->Hkv, P = g->page_size;
    /* CASCADE_CUDA_WS_DIAG=1 (warp-specialized kinds, measurement only): the
     * producer copies nothing, so the time is that of the consumers alone;
     * 4 (XV 35): the tail warps compute nothing */
    static const int diag = getenv("CASCADE_CUDA_WS_DIAG") ? atoi(getenv("CASCADE_CUDA_WS_DIAG")) : 0;
    int dg = diag;
    /* kind 9: tensor maps of the pools (other kinds: zeroed, unused) */
    static thread_local tma_maps maps;
    static const CUtensorMap none = {};
    int rows = KIND >= 9 ? tma_maps_for(&maps, g, k, v) : 0;
    const CUtensorMap *km = rows ? &maps.km : &none, *vm = rows ? &maps.vm : &none;
    int runs = rows ? maps.runs : 0;
    const CUtensorMap *kr = runs ? &maps.kr : &none, *vr = runs ? &maps.vr : &none;
    /* the kernels of kinds 3 and 4 take the first ten arguments only */
    void *args[] = {(void *)&plan_c, (void *)&kp, (void *)&vp, (void *)&qp, (void *)&o,
                    (void *)&lse, (void *)&scratch, (void *)&Hq, (void *)&Hkv, (void *)&P, (void *)&dg,
                    (void *)km, (void *)vm, (void *)&rows, (void *)kr, (void *)vr, (void *)&runs,
                    (void *)&counter};
    if (wg_cluster<T, D, KIND>::N == 1 && pdl) {
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t cfg = cas_launch_cfg(&attr, grid, K::NT, K::SMEM, st, 1);
        return (int)cudaLaunchKernelExC(&cfg, K::fn(), args);
    }
    if (wg_cluster<T, D, KIND>::N == 1) return (int)cudaLaunchKernel(K::fn(), dim3(grid), dim3(K::NT), args, K::SMEM, st);
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg = wg_cluster_cfg<T, D, KIND>(&attr, grid, st);
    return (int)cudaLaunchKernelExC(&cfg, K::fn(), args);
}

template <typename T, int D, int KIND> static int wg_occ(int *ctas) {
    typedef wg_kernel<T, D, KIND> K;
    cudaError_t e = cudaFuncSetAttribute(K::fn(), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)K::SMEM);
    if (e != cudaSuccess) return (int)e;
    return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, K::fn(), K::NT, K::SMEM);
}

/* CTAs of the persistent grid of a cluster kind: clusters that fit at once
 * (an SM of a GPC may be left over) times the cluster size; 0 otherwise */
template <typename T, int D, int KIND> static int wg_cluster_grid(int *ctas) {
    typedef wg_kernel<T, D, KIND> K;
    *ctas = 0;
    if (wg_cluster<T, D, KIND>::N == 1) return 0;
    cudaError_t e = cudaFuncSetAttribute(K::fn(), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)K::SMEM);
    if (e != cudaSuccess) return (int)e;
    int dev = 0, sms = 0, n = 0;
    if ((e = cudaGetDevice(&dev)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess)
        return (int)e;
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg = wg_cluster_cfg<T, D, KIND>(&attr, sms, 0);
    if ((e = cudaOccupancyMaxActiveClusters(&n, (const void *)K::fn(), &cfg)) != cudaSuccess) return (int)e;
    *ctas = n * wg_cluster<T, D, KIND>::N;
    return 0;
}

/* head_dim 64 compiles but failed the float64 reference on the H200 (bench/NOTES.md):
 * only 128 is enabled until that is understood */
extern "C" int cas_cuda_wgmma_supported(int D) { return D == 128; }

#define CAS_WG_DISPATCH_K(T, DD, kind, F, ...)                                                    \
    do {                                                                                          \
        switch (kind) {                                                                           \
        case 3: return F<T, DD, 3>(__VA_ARGS__);                                                  \
        case 4: return F<T, DD, 4>(__VA_ARGS__);                                                  \
        case 6: return F<T, DD, 6>(__VA_ARGS__);                                                  \
        case 7: return F<T, DD, 7>(__VA_ARGS__);                                                  \
        case 8: return F<T, DD, 8>(__VA_ARGS__);                                                  \
        case 9: return F<T, DD, 9>(__VA_ARGS__);                                                  \
        case 10: return F<T, DD, 10>(__VA_ARGS__);                                                \
        case 11: return F<T, DD, 11>(__VA_ARGS__);                                                \
        case 16: return F<T, DD, 16>(__VA_ARGS__);                                                \
        case 17: return F<T, DD, 17>(__VA_ARGS__);                                                \
        case 18: return F<T, DD, 18>(__VA_ARGS__);                                                \
        default: return (int)cudaErrorInvalidValue;                                               \
        }                                                                                         \
    } while (0)
/* Calls F<T, D, kind> for the geometry's dtype and head_dim */
#define CAS_WG_DISPATCH(g, kind, F, ...)                                                          \
    do {                                                                                          \
        if ((g)->dtype == 2 && (g)->D == 64) CAS_WG_DISPATCH_K(__nv_bfloat16, 64, kind, F, __VA_ARGS__); \
        if ((g)->dtype == 2 && (g)->D == 128) CAS_WG_DISPATCH_K(__nv_bfloat16, 128, kind, F, __VA_ARGS__); \
        if ((g)->dtype == 1 && (g)->D == 64) CAS_WG_DISPATCH_K(__half, 64, kind, F, __VA_ARGS__); \
        if ((g)->dtype == 1 && (g)->D == 128) CAS_WG_DISPATCH_K(__half, 128, kind, F, __VA_ARGS__); \
        return (int)cudaErrorInvalidValue;                                                        \
    } while (0)

extern "C" int cas_cuda_launch_attn_wgmma(const cas_cuda_geom *g, const void *plan, const void *k,
                                          const void *v, const void *q, float *o, float *lse,
                                          float *scratch, int *counter, int kind, int grid, int pdl,
                                          void *stream) {
    CAS_WG_DISPATCH(g, kind, wg_launch, g, plan, k, v, q, o, lse, scratch, counter, grid, pdl,
                    (cudaStream_t)stream);
}

extern "C" int cas_cuda_wgmma_occupancy(const cas_cuda_geom *g, int kind, int *ctas_per_sm) {
    *ctas_per_sm = 0;
    CAS_WG_DISPATCH(g, kind, wg_occ, ctas_per_sm);
}

extern "C" int cas_cuda_wgmma_cluster_grid(const cas_cuda_geom *g, int kind, int *ctas) {
    *ctas = 0;
    if (kind != 10) return 0;
    CAS_WG_DISPATCH(g, kind, wg_cluster_grid, ctas);
}
