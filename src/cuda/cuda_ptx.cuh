/*
 * cuda_ptx.cuh: the PTX the attention kernels use, each instruction wrapped
 * once: cp.async and ldmatrix, mma.sync m16n8k16 (any sm_80+ GPU), and the
 * Hopper instructions of the many-rows kernel (sm_90a): wgmma, mbarriers,
 * named barriers, the bulk tensor copy (TMA) with an L2 cache policy,
 * setmaxnreg, and programmatic dependent launch.
 *
 * Every wrapper is a forced-inline function around one asm statement, so
 * that the kernels read as the algorithm and the instruction spellings live
 * here; nothing here allocates or synchronizes beyond what its instruction
 * does.
 */
#ifndef CASCADE_CUDA_PTX_CUH
#define CASCADE_CUDA_PTX_CUH

#include <cuda.h> /* CUtensorMap only: no libcuda link */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

/* The launch configuration of a plain grid on st; pdl: as a programmatic
 * dependent of the kernel before it on st (attr holds the attribute). */
static inline cudaLaunchConfig_t cas_launch_cfg(cudaLaunchAttribute *attr, int grid, int block, size_t smem,
                                                cudaStream_t st, int pdl) {
    cudaLaunchConfig_t cfg = {};
    attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr->val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cfg;
}

/* ---- any sm_80+ GPU ------------------------------------------------------ */

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared, the first src_bytes of them read (the rest zero) */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

/* ldmatrix x4 (.trans: each 8 x 8 matrix transposed) from a shared-memory
 * address, or a pointer into shared memory */
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void *p) { ldsm_x4(r, smem_u32(p)); }
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const void *p) { ldsm_x4_t(r, smem_u32(p)); }

/* The operand type's spelling in PTX and its f32 -> 16-bit pair packing. */
template <typename T> struct ptx_type;
template <> struct ptx_type<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};
template <> struct ptx_type<__half> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};

/* c (16 x 8 f32, 4 per thread) += a (16 x 16) b (16 x 8), operands of type
 * T: mma.sync m16n8k16, row-major A, column-major B. */
#define CAS_MMA_SYNC(TY)                                                                                   \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, "                 \
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                                \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                          \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T> struct mma_op : ptx_type<T> {
    static __device__ __forceinline__ void run(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
        if constexpr (std::is_same<T, __nv_bfloat16>::value) CAS_MMA_SYNC("bf16");
        else CAS_MMA_SYNC("f16");
    }
};
#undef CAS_MMA_SYNC

/* ---- Hopper (sm_90a) ------------------------------------------------------ */

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CAS_WGMMA_OK 1
#else
#define CAS_WGMMA_OK 0
#endif

/* d (64 x 128 f32 accumulators of a warpgroup, 64 per thread) = A B +
 * (scale_d ? d : 0): wgmma m64n128k16 with A 64 x 16 from registers (the
 * mma.sync A fragment of each warp's 16 rows) and B 16 x 128 from shared
 * memory through a descriptor; TB = 1: B is N-major (transposed). */
#define CAS_WGMMA_N128(TY)                                                                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                              \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "                              \
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23," \
                 "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,"    \
                 "%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "          \
                 "{%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"                                              \
                 : CAS_WG_D8(0), CAS_WG_D8(8), CAS_WG_D8(16), CAS_WG_D8(24), CAS_WG_D8(32), CAS_WG_D8(40), \
                   CAS_WG_D8(48), CAS_WG_D8(56)                                                            \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TB))
#define CAS_WG_D8(i)                                                                                       \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),            \
        "+f"(d[i + 6]), "+f"(d[i + 7])
template <typename T> struct wg_mma {
    template <int TB>
    static __device__ __forceinline__ void run(float *d, const uint32_t a[4], uint64_t desc, int scale_d) {
        if constexpr (std::is_same<T, __nv_bfloat16>::value) CAS_WGMMA_N128("bf16");
        else CAS_WGMMA_N128("f16");
    }
};
#undef CAS_WGMMA_N128
#undef CAS_WG_D8

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
/* orders this thread's generic-proxy shared-memory accesses before the async
 * proxy's (wgmma's operand reads, TMA's writes) */
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

/* mbarriers in shared memory (addresses from smem_u32) */
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
/* one arrival on bar that also raises the bytes the phase waits for by tx */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t tx) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
                 "r"(tx)
                 : "memory");
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

/* named barriers: n threads (whole warps) of the CTA */
__device__ __forceinline__ void nbar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void nbar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

/* 2^x, one MUFU.EX2 (exp2f adds range fix-ups); 2^-inf = 0 */
__device__ __forceinline__ float ex2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* registers per thread of this warpgroup after setmaxnreg (the CTA needs a
 * register cap at entry: __launch_bounds__(threads, 1)) */
template <int R> __device__ __forceinline__ void reg_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R> __device__ __forceinline__ void reg_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

/* An L2 policy for every access it is given (fraction 1): evict first (0)
 * or evict normal (1). */
__device__ __forceinline__ uint64_t l2_policy(int which) {
    uint64_t p;
    if (which == 0) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
    else asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}

/* Bulk tensor copy (TMA) of one box of a 3-D or 4-D tensor map at element
 * coordinates (c0, c1, c2[, c3]) into shared memory at dst, completing its
 * bytes on mbarrier bar, under L2 policy pol. */
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                            uint32_t bar, uint64_t pol) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(pol)
                 : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                            int c3, uint32_t bar, uint64_t pol) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(pol)
                 : "memory");
}
/* the descriptor of a tensor map (a __grid_constant__ parameter) into the cache */
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

/* Programmatic dependent launch (sm_90): a kernel launched after this one on
 * the stream with the programmatic-serialization attribute may start its
 * CTAs once every CTA of this grid has called launch_dependents (or exited);
 * pdl_wait blocks until the grids this one depends on have completed and
 * their writes are visible (at once where there is none). */
__device__ __forceinline__ void pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

#endif
