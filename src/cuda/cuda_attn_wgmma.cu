/*
 * cuda_attn_wgmma.cu: the launch of the Hopper many-rows kernel
 * (cuda_wgmma_kernel.cuh): the tensor maps of the K and V pools that its
 * bulk tensor copies read, its occupancy, and its launch as a programmatic
 * dependent of the narrow kernel.
 *
 * Tensor maps are encoded on the host (cuTensorMapEncodeTiled, reached
 * through the runtime's driver entry point: no libcuda link) and passed by
 * value as __grid_constant__ parameters. They are cached per host thread for
 * the last pools launched on, so that the launch of every layer of a step
 * does not encode them again; a map's page extent is the int32 range of page
 * ids rather than the pool's size, so a map baked into a captured graph
 * stays valid for every later plan (the plan validates page ids against the
 * pool).
 */
#include <stdio.h>
#include <string.h>

#include "cuda_attn_impl.h"
#include "cuda_wgmma_kernel.cuh"

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

/* A map of the pool in the 128-byte swizzle that wgmma's K-major operand
 * reads, boxes of 64 columns of one KV head: rank 4, the pool as (D, Hkv, P,
 * pages) with boxes of `rows` keys of one page; or rank 3, the pool as rows
 * (D, Hkv, pages x P) with boxes of 64 keys of consecutive rows, which cross
 * pages when the page ids run in a row (row coordinates are int32). 0 on
 * success. */
static int tma_encode(CUtensorMap *map, const void *pool, int dtype, int D, int Hkv, int P, int rows, int rank) {
    encode_tiled_fn encode = tma_encoder();
    if (!encode || ((uintptr_t)pool & 15)) return -1;
    const cuuint64_t dims4[4] = {(cuuint64_t)D, (cuuint64_t)Hkv, (cuuint64_t)P, (cuuint64_t)0x7fffffff};
    const cuuint64_t dims3[3] = {(cuuint64_t)D, (cuuint64_t)Hkv, (cuuint64_t)0x7fffffff};
    const cuuint64_t strides[3] = {(cuuint64_t)D * 2, (cuuint64_t)Hkv * D * 2, (cuuint64_t)P * Hkv * D * 2};
    const cuuint32_t box4[4] = {64, 1, (cuuint32_t)rows, 1}, box3[3] = {64, 1, 64};
    const cuuint32_t estr[4] = {1, 1, 1, 1};
    CUresult r = encode(map, dtype == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                        (cuuint32_t)rank, const_cast<void *>(pool), rank == 4 ? dims4 : dims3, strides,
                        rank == 4 ? box4 : box3, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? 0 : -1;
}

/* The maps of the last pools launched on, per host thread. */
struct tma_maps {
    const void *k, *v;
    cas_cuda_geom g;
    int rows; /* 0: TMA off for these pools (the kernel gathers with cp.async) */
    int runs; /* 1: the row maps kr, vr are valid (boxes of rows < 64) */
    CUtensorMap km, vm, kr, vr;
};
static int tma_maps_for(tma_maps *m, const cas_cuda_geom *g, const void *k, const void *v) {
    if (m->k == k && m->v == v && !memcmp(&m->g, g, sizeof *g)) return m->rows;
    m->k = k;
    m->v = v;
    m->g = *g;
    m->rows = tma_box_rows(g->page_size);
    if (m->rows && (tma_encode(&m->km, k, g->dtype, g->D, g->Hkv, g->page_size, m->rows, 4) ||
                    tma_encode(&m->vm, v, g->dtype, g->D, g->Hkv, g->page_size, m->rows, 4))) {
        fprintf(stderr, "cascade cuda: no tensor map for pages of %d (D %d): the wgmma kernel copies with cp.async\n",
                g->page_size, g->D);
        m->rows = 0;
    }
    m->runs = m->rows > 0 && m->rows < 64 && !tma_encode(&m->kr, k, g->dtype, g->D, g->Hkv, g->page_size, 64, 3) &&
              !tma_encode(&m->vr, v, g->dtype, g->D, g->Hkv, g->page_size, 64, 3);
    return m->rows;
}

template <typename T> static void *wgmma_fn() { return (void *)attn_wgmma_kernel<T, 128>; }

template <typename T>
static int wgmma_launch(const cas_cuda_geom *g, const void *plan, const void *k, const void *v, const void *q,
                        float *o, float *lse, float *scratch, int grid, cudaStream_t st) {
    typedef wgmma_cfg<128> C;
    const char *plan_c = (const char *)plan;
    const T *kp = (const T *)k, *vp = (const T *)v, *qp = (const T *)q;
    int Hq = g->Hq, Hkv = g->Hkv, P = g->page_size;
    static thread_local tma_maps maps;
    static const CUtensorMap none = {};
    int rows = tma_maps_for(&maps, g, k, v);
    const CUtensorMap *km = rows ? &maps.km : &none, *vm = rows ? &maps.vm : &none;
    int runs = rows ? maps.runs : 0;
    const CUtensorMap *kr = runs ? &maps.kr : &none, *vr = runs ? &maps.vr : &none;
    void *args[] = {(void *)&plan_c, (void *)&kp, (void *)&vp, (void *)&qp, (void *)&o, (void *)&lse,
                    (void *)&scratch, (void *)&Hq, (void *)&Hkv, (void *)&P, (void *)km, (void *)vm,
                    (void *)&rows, (void *)kr, (void *)vr, (void *)&runs};
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cas_launch_cfg(&attr, grid, C::NT, C::SMEM, st, 1);
    return (int)cudaLaunchKernelExC(&cfg, wgmma_fn<T>(), args);
}

template <typename T> static int wgmma_occ(int *ctas) {
    typedef wgmma_cfg<128> C;
    cudaError_t e = cudaFuncSetAttribute(wgmma_fn<T>(), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM);
    if (e != cudaSuccess) return (int)e;
    return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, wgmma_fn<T>(), C::NT, C::SMEM);
}

extern "C" int cas_cuda_wgmma_supported(int D) { return D == 128; }

extern "C" int cas_cuda_launch_attn_wgmma(const cas_cuda_geom *g, const void *plan, const void *k,
                                          const void *v, const void *q, float *o, float *lse,
                                          float *scratch, int grid, void *stream) {
    if (g->D != 128) return (int)cudaErrorInvalidValue;
    if (g->dtype == 2) return wgmma_launch<__nv_bfloat16>(g, plan, k, v, q, o, lse, scratch, grid, (cudaStream_t)stream);
    if (g->dtype == 1) return wgmma_launch<__half>(g, plan, k, v, q, o, lse, scratch, grid, (cudaStream_t)stream);
    return (int)cudaErrorInvalidValue;
}

extern "C" int cas_cuda_wgmma_occupancy(const cas_cuda_geom *g, int *ctas_per_sm) {
    *ctas_per_sm = 0;
    if (g->D != 128) return (int)cudaErrorInvalidValue;
    if (g->dtype == 2) return wgmma_occ<__nv_bfloat16>(ctas_per_sm);
    if (g->dtype == 1) return wgmma_occ<__half>(ctas_per_sm);
    return (int)cudaErrorInvalidValue;
}
