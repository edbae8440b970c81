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
 * Pages of any size are gathered per 16-byte chunk, so no tensor map (TMA)
 * is used: a page of the pool may hold a single token. cp.async writes
 * through the generic proxy and wgmma reads through the async proxy, hence
 * fence.proxy.async before the barrier that hands a stage over.
 *
 * Compiled for sm_90a only; other targets get a stub that traps, and the
 * host selects this kernel only on compute capability 9.0 with head_dim 128
 * (the 64 instance is built but disabled: it failed the reference test on
 * the H200; CASCADE_CUDA_WIDE=1 or 2 selects mma.sync).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include "cuda_attn_impl.h"
#include "cuda_attn_ptx.cuh"

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

/* ---- launchers ---------------------------------------------------------- */

template <typename T, int D, bool OVL>
static int wg_launch(const cas_cuda_geom *g, const void *plan, const void *k, const void *v,
                     const void *q, float *o, float *lse, float *scratch, int grid, cudaStream_t st) {
    typedef wg_cfg<D, OVL> C;
    attn_wgmma_kernel<T, D, OVL><<<grid, C::NT, C::SMEM, st>>>(
        (const char *)plan, (const T *)k, (const T *)v, (const T *)q, o, lse, scratch, g->Hq, g->Hkv,
        g->page_size);
    return (int)cudaGetLastError();
}

template <typename T, int D, bool OVL> static int wg_occ(int *ctas) {
    typedef wg_cfg<D, OVL> C;
    cudaError_t e = cudaFuncSetAttribute(attn_wgmma_kernel<T, D, OVL>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM);
    if (e != cudaSuccess) return (int)e;
    return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, attn_wgmma_kernel<T, D, OVL>, C::NT,
                                                              C::SMEM);
}

/* head_dim 64 compiles but failed the float64 reference on the H200 (bench/NOTES.md):
 * only 128 is enabled until that is understood */
extern "C" int cas_cuda_wgmma_supported(int D) { return D == 128; }

/* Calls F<T, D, OVL> for the geometry's dtype and head_dim; kind 4 overlaps */
#define CAS_WG_DISPATCH(g, kind, F, ...)                                                          \
    do {                                                                                          \
        const bool ovl_ = (kind) == 4;                                                            \
        if ((g)->dtype == 2 && (g)->D == 64)                                                      \
            return ovl_ ? F<__nv_bfloat16, 64, true>(__VA_ARGS__) : F<__nv_bfloat16, 64, false>(__VA_ARGS__); \
        if ((g)->dtype == 2 && (g)->D == 128)                                                     \
            return ovl_ ? F<__nv_bfloat16, 128, true>(__VA_ARGS__) : F<__nv_bfloat16, 128, false>(__VA_ARGS__); \
        if ((g)->dtype == 1 && (g)->D == 64)                                                      \
            return ovl_ ? F<__half, 64, true>(__VA_ARGS__) : F<__half, 64, false>(__VA_ARGS__);   \
        if ((g)->dtype == 1 && (g)->D == 128)                                                     \
            return ovl_ ? F<__half, 128, true>(__VA_ARGS__) : F<__half, 128, false>(__VA_ARGS__); \
        return (int)cudaErrorInvalidValue;                                                        \
    } while (0)

extern "C" int cas_cuda_launch_attn_wgmma(const cas_cuda_geom *g, const void *plan, const void *k,
                                          const void *v, const void *q, float *o, float *lse,
                                          float *scratch, int kind, int grid, void *stream) {
    CAS_WG_DISPATCH(g, kind, wg_launch, g, plan, k, v, q, o, lse, scratch, grid, (cudaStream_t)stream);
}

extern "C" int cas_cuda_wgmma_occupancy(const cas_cuda_geom *g, int kind, int *ctas_per_sm) {
    *ctas_per_sm = 0;
    CAS_WG_DISPATCH(g, kind, wg_occ, ctas_per_sm);
}
