/*
 * quant_amx.c: the batched kernels for quantized weights on AMX-INT8
 * (compiled with -mamx-tile -mamx-int8 and AVX-512; quant.c calls them only
 * after cas_q_amx_available(), which also asks the kernel for the tile
 * state).
 *
 * Why: many sequences decoding together (and prefill) are bound by compute,
 * and one tile multiply (TDPBSUD / TDPBSSD) does 16 x 16 x 32 int8
 * multiply-adds, 256 times what one AVX2 maddubs does. The weights'
 * per-block scales cannot go into the tile unit, so every 32-element block
 * gets its own int32 result tile (16 tokens x 16 weight rows), which AVX-512
 * converts, scales by d_w * d_x and adds to f32 accumulators, with the
 * zero-point term (Q4_1 m_w * s_x, Q4_0 -8 d_w * s_x) as one more FMA:
 * 4 vector instructions per token row of a tile, i.e. per 512 multiply-adds,
 * against 12 or more for the same work with maddubs or VNNI. That scaling,
 * not the tile unit, is the cost here, so tokens go in tile rows (A, signed
 * x) and weight rows in the lanes (B, 16 rows x 4 bytes per 64-byte row of
 * the tile, the packed layout of quant_impl.h), and an accumulator register
 * holds one token's outputs for 16 weight rows, ready to store into Y.
 *
 * Per panel (16 weight rows) the Q4 nibbles are unpacked to bytes once into
 * per-thread scratch and then serve every 16-token group; Q8_0 tiles load
 * straight from the packed weights. The panel after next is prefetched while one
 * computes. Two blocks go through the tile unit per step (two sets of
 * tiles); measured, the tile work and the vector work do not overlap on the
 * machine this was built on (Sapphire Rapids class, bench/HISTORY.md), so a
 * block costs their sum, about 65 TSC cycles.
 *
 * Numerics: x is quantized exactly as in the other paths (quant.c,
 * quant_avx2.c), the per-block integer sums are exact, and the f32 terms
 * are added in the same order as in the AVX2 token-lane kernel, so the
 * results are bit-identical to it.
 */
#include "quant_impl.h"

#include <immintrin.h>
#include <string.h>

/* Tile registers: two sets of (C result, A x, B weights). */
#define TC0 0
#define TA0 1
#define TB0 2
#define TC1 3
#define TA1 4
#define TB1 5

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* A constant in memory: GCC 12 treats _tile_loadconfig as reading less than
 * the 64 bytes, so a configuration built on the stack can lose its stores. */
static const tile_config k_tiles __attribute__((aligned(64))) = {
    .palette = 1,
    /* C: 16 tokens x 16 rows of int32; A: 16 tokens x 32 x bytes; B: 8 x (16 rows x 4 weight bytes) */
    .colsb = {[TC0] = 64, [TA0] = 32, [TB0] = 64, [TC1] = 64, [TA1] = 32, [TB1] = 64},
    .rows = {[TC0] = 16, [TA0] = 16, [TB0] = 8, [TC1] = 16, [TA1] = 16, [TB1] = 8},
};

static void config_tiles(void) { _tile_loadconfig(&k_tiles); }

static inline __m512 ld_h16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
}

/* acc[k] += (C[k] * d_w * d_x[k]) + m_w * s_x[k] for the mt tokens of the tile. */
static inline __attribute__((always_inline)) void scale_tile(const int t, const int32_t *c, __m512 dw,
                                                             __m512 mw, const cas_q8x16_block *xb, int mt,
                                                             __m512 acc[CAS_Q_PANEL]) {
#pragma GCC unroll 16
    for (int k = 0; k < CAS_Q_PANEL; k++) {
        if (k < mt) {
            __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 16 * k)));
            acc[k] = _mm512_fmadd_ps(v, _mm512_mul_ps(dw, _mm512_set1_ps(xb->d[k])), acc[k]);
            if (t != CAS_T_Q8_0) acc[k] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xb->s[k]), acc[k]);
        }
    }
}

/* The f32 scales of block b of a panel: d_w, and the zero-point factor. */
static inline __attribute__((always_inline)) void block_scales(const int t, const uint8_t *blk, __m512 *dw,
                                                               __m512 *mw) {
    if (t == CAS_T_Q8_0) {
        *dw = ld_h16(blk + 512);
        *mw = _mm512_setzero_ps();
    } else {
        *dw = ld_h16(blk + 256);
        *mw = t == CAS_T_Q4_1 ? ld_h16(blk + 288) : _mm512_mul_ps(_mm512_set1_ps(-8.0f), *dw);
    }
}

/* acc[k] = the outputs of token k of group g for the panel's 16 rows. */
static inline __attribute__((always_inline)) void panel_group(const int t, const uint8_t *pp, size_t pb,
                                                              const uint8_t *wu, const cas_q8x16_block *xg,
                                                              int64_t nb, const int mt, int32_t *cb,
                                                              __m512 acc[CAS_Q_PANEL], const uint8_t *pf,
                                                              const uint8_t *pf2, int64_t rows, int64_t p,
                                                              int64_t g, int64_t ng) {
    (void)rows, (void)p;
#pragma GCC unroll 16
    for (int k = 0; k < CAS_Q_PANEL; k++) acc[k] = _mm512_setzero_ps();
    __m512 dw, mw;
    /* the prefetched panels' bytes (pf, and pf2 for a run's first panel),
     * spread evenly over the tile steps of all ng groups (step gs of ng * spg
     * takes `per` bytes): a burst of a whole block pair's lines per step of
     * the first group only kept more misses in flight than the core has fill
     * buffers */
    const int64_t spg = (nb + 1) / 2, tot = nb * (int64_t)pb;
    const int64_t per = ((tot + ng * spg - 1) / (ng * spg) + 63) & ~(int64_t)63;
    int64_t pfo = g * spg * per; /* this step's first byte */
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *b0 = pp + (size_t)b * pb, *b1 = b0 + pb;
        if (pf)
            for (int64_t o = pfo; o < pfo + per && o < tot; o += 64) _mm_prefetch((const char *)pf + o, _MM_HINT_T0);
        if (pf2)
            for (int64_t o = pfo; o < pfo + per && o < tot; o += 64) _mm_prefetch((const char *)pf2 + o, _MM_HINT_T0);
        pfo += per;
        const uint8_t *w0 = t == CAS_T_Q8_0 ? b0 : wu + b * 512;
        const uint8_t *w1 = t == CAS_T_Q8_0 ? b1 : wu + (b + 1) * 512;
        _tile_zero(TC0);
        _tile_zero(TC1);
        _tile_loadd(TA0, xg[b].q, 32);
        _tile_loadd(TB0, w0, 64);
        _tile_loadd(TA1, xg[b + 1].q, 32);
        _tile_loadd(TB1, w1, 64);
        if (t == CAS_T_Q8_0) {
            _tile_dpbssd(TC0, TA0, TB0);
            _tile_dpbssd(TC1, TA1, TB1);
        } else {
            _tile_dpbsud(TC0, TA0, TB0);
            _tile_dpbsud(TC1, TA1, TB1);
        }
        _tile_stored(TC0, cb, 64);
        _tile_stored(TC1, cb + 256, 64);
        block_scales(t, b0, &dw, &mw);
        scale_tile(t, cb, dw, mw, xg + b, mt, acc);
        block_scales(t, b1, &dw, &mw);
        scale_tile(t, cb + 256, dw, mw, xg + b + 1, mt, acc);
    }
    if (b < nb) {
        const uint8_t *b0 = pp + (size_t)b * pb;
        for (int64_t o = pfo; o < tot; o += 64) {
            if (pf) _mm_prefetch((const char *)pf + o, _MM_HINT_T0);
            if (pf2) _mm_prefetch((const char *)pf2 + o, _MM_HINT_T0);
        }
        _tile_zero(TC0);
        _tile_loadd(TA0, xg[b].q, 32);
        _tile_loadd(TB0, t == CAS_T_Q8_0 ? b0 : wu + b * 512, 64);
        if (t == CAS_T_Q8_0)
            _tile_dpbssd(TC0, TA0, TB0);
        else
            _tile_dpbsud(TC0, TA0, TB0);
        _tile_stored(TC0, cb, 64);
        block_scales(t, b0, &dw, &mw);
        scale_tile(t, cb, dw, mw, xg + b, mt, acc);
    }
}

static inline __attribute__((always_inline)) void amx_panels(const int t, const uint8_t *packed, int64_t p0,
                                                             int64_t p1, int64_t rows, int64_t n,
                                                             const cas_q8x16_block *x16, int64_t m, float *y,
                                                             uint8_t *scratch) {
    const int64_t nb = n / 32;
    const size_t pb = t == CAS_T_Q8_0 ? 544 : t == CAS_T_Q4_1 ? 320 : 288;
    uint8_t *wu = scratch;                                  /* [nb][512] Q4 weights as bytes */
    int32_t *cb = (int32_t *)(void *)(scratch + nb * 512); /* [2][16][16] result tiles */
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *pp = packed + (size_t)p * (size_t)nb * pb;
        if (t != CAS_T_Q8_0) {
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *s = pp + (size_t)b * pb;
                uint8_t *d = wu + b * 512;
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    __m512i v = _mm512_loadu_si512((const void *)(s + 64 * k));
                    _mm512_store_si512((void *)(d + 64 * k), _mm512_and_si512(v, m4));
                    _mm512_store_si512((void *)(d + 256 + 64 * k), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                }
            }
        }
        /* The panel after next is fetched from memory while this one computes
         * (the first panel of a run also fetches the next): it is contiguous,
         * but the computation reads it too slowly (and, for Q8_0, through tile
         * loads) for the hardware prefetchers to run ahead. Two panels ahead
         * measured 2-4% faster per decode step than one, now that the lines
         * are spread over the steps; nothing past the run (another thread's
         * panels, read already). */
        const size_t pbytes = (size_t)nb * pb;
        const uint8_t *pf = p + 2 < p1 ? pp + 2 * pbytes : NULL;
        const uint8_t *pf2 = p == p0 && p + 1 < p1 ? pp + pbytes : NULL;
        const int64_t nr = rows - CAS_Q_PANEL * p < CAS_Q_PANEL ? rows - CAS_Q_PANEL * p : CAS_Q_PANEL;
        const __mmask16 rmask = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
        const int64_t ng = (m + CAS_Q_PANEL - 1) / CAS_Q_PANEL;
        for (int64_t g = 0; g < ng; g++) {
            const cas_q8x16_block *xg = x16 + g * nb;
            const int mt = m - CAS_Q_PANEL * g < CAS_Q_PANEL ? (int)(m - CAS_Q_PANEL * g) : CAS_Q_PANEL;
            __m512 acc[CAS_Q_PANEL];
            /* full groups (the common case) without per-token checks */
            if (mt == CAS_Q_PANEL)
                panel_group(t, pp, pb, wu, xg, nb, CAS_Q_PANEL, cb, acc, pf, pf2, rows, p, g, ng);
            else
                panel_group(t, pp, pb, wu, xg, nb, mt, cb, acc, pf, pf2, rows, p, g, ng);
            float *yo = y + CAS_Q_PANEL * g * rows + CAS_Q_PANEL * p;
#pragma GCC unroll 16
            for (int k = 0; k < CAS_Q_PANEL; k++)
                if (k < mt) _mm512_mask_storeu_ps(yo + k * rows, rmask, acc[k]);
        }
    }
}

/* The tile configuration is per thread; it is released after, so that a
 * thread that no longer runs AMX code does not carry the tile state. */
void cas_q_amx_begin(void) { config_tiles(); }

void cas_q_amx_end(void) { _tile_release(); }

/* 64-byte aligned: where the linker happened to put the kernel moved the
 * 32-sequence decode step by 3-4% (the same code 0x50 bytes further: 3-4%
 * slower), so its loops' alignment no longer depends on what precedes it. */
__attribute__((aligned(64))) void cas_q_amx_matmul_panels(int t, const uint8_t *packed, int64_t p0, int64_t p1,
                                                          int64_t rows, int64_t n, const cas_q8x16_block *x16,
                                                          int64_t m, float *y, void *scratch) {
    switch (t) {
    case CAS_T_Q8_0: amx_panels(CAS_T_Q8_0, packed, p0, p1, rows, n, x16, m, y, scratch); break;
    case CAS_T_Q4_0: amx_panels(CAS_T_Q4_0, packed, p0, p1, rows, n, x16, m, y, scratch); break;
    case CAS_T_Q4_1: amx_panels(CAS_T_Q4_1, packed, p0, p1, rows, n, x16, m, y, scratch); break;
    default: break;
    }
}
