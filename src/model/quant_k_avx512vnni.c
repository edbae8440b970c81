/*
 * quant_k_avx512vnni.c: kernels of the K-quant, IQ4 and Q5 types on AVX-512
 * with VNNI (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq
 * -mavx512vnni -mfma -mf16c; quant_k.c and quant.c call them only after
 * checking the CPU): the batched ones, quant.c's Q8_0/Q4_0/Q4_1 batched calls
 * too, and Q5_0/Q5_1 one token at a time (at the end).
 *
 * The AVX2 token-lane kernel with sixteen tokens per 512-bit vector, and
 * vpdpbusd in place of maddubs: four codes of a row, broadcast, times the
 * sixteen tokens' four x bytes, summed into each token's int32 lane without
 * the 16-bit intermediate, so no code range needs early widening; one
 * vpmulld per sub-block applies its scale. The IQ4 tables' signed values are
 * stored plus 128 (unsigned, as vpdpbusd wants) and 128 times the sub-block's
 * x sum is taken off again; Q5_0's codes are its values plus 16, taken off
 * the same way. The integer sums are the exact ones and each lane's f32
 * chain is the canonical one (quant_k.h), so a token's results are the bits
 * of the other kernels. quant.c's 32-element types take the 32-element kernel
 * with their own chain (quant_impl.h): Q8_0's codes stored plus 128 and that
 * offset taken off as for IQ4_NL; Q4_0's and Q4_1's nibbles as they are, then
 * their minimum times the block's x sum. Q5's tile is decoded here
 * (decode_q5); every other tile of decoded rows comes from the AVX2 decoder
 * (every CPU with AVX-512 has AVX2).
 */
#include "quant_impl.h"
#include "quant_k.h"

#include <immintrin.h>
#include <string.h>

static inline __m512i bc32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline __m256i bc32_256(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* sc[j] holds the scale in both 16-bit halves: the low half, sign-extended */
static inline __m512i scale32(const int32_t *sc) { return _mm512_set1_epi32((int32_t)(int16_t)(uint16_t)(uint32_t)*sc); }

#define LD512(p) _mm512_load_si512((const void *)(p))

/* CAS_QK_TILE decoded rows' block b (k[r * nb]) against sixteen tokens' x
 * block: is[r] each token's int32 sum (offsets included), im[r] the minimum's. */
static inline __attribute__((always_inline)) void lane_sums16(const int t, const cas_qk_tblk *k, int64_t nb,
                                                              const cas_q8k16_block *x, __m512i is[CAS_QK_TILE],
                                                              __m512i im[CAS_QK_TILE]) {
    const __m512i zero = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int r = 0; r < CAS_QK_TILE; r++) is[r] = im[r] = zero;
    for (int j = 0; j < 8; j++) {
        __m512i xv[8];
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) xv[g] = LD512(x->q[8 * j + g]);
        /* 128 times each token's sum of these 32 elements, for the IQ4 offset */
        const __m512i xs128 = t == CAS_T_IQ4_XS ? _mm512_slli_epi32(LD512(x->xs[j]), 7) : zero;
#pragma GCC unroll 4
        for (int r = 0; r < CAS_QK_TILE; r++) {
            const cas_qk_tblk *kr = k + r * nb;
            const uint8_t *c = kr->c + 32 * j;
            if (t == CAS_T_Q4_K || t == CAS_T_Q5_K || t == CAS_T_IQ4_XS) {
                __m512i a = _mm512_dpbusd_epi32(zero, bc32(c), xv[0]);
#pragma GCC unroll 8
                for (int g = 1; g < 8; g++) a = _mm512_dpbusd_epi32(a, bc32(c + 4 * g), xv[g]);
                if (t == CAS_T_IQ4_XS) a = _mm512_sub_epi32(a, xs128);
                is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(a, scale32(&kr->sc[j])));
            } else { /* two 16-element sub-blocks */
                __m512i a0 = _mm512_dpbusd_epi32(zero, bc32(c), xv[0]), a1 = _mm512_dpbusd_epi32(zero, bc32(c + 16), xv[4]);
#pragma GCC unroll 3
                for (int g = 1; g < 4; g++) {
                    a0 = _mm512_dpbusd_epi32(a0, bc32(c + 4 * g), xv[g]);
                    a1 = _mm512_dpbusd_epi32(a1, bc32(c + 16 + 4 * g), xv[4 + g]);
                }
                is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(a0, scale32(&kr->sc[2 * j])));
                is[r] = _mm512_add_epi32(is[r], _mm512_mullo_epi32(a1, scale32(&kr->sc[2 * j + 1])));
            }
        }
    }
    if (t != CAS_T_IQ4_XS) {
        __m512i bv[8];
#pragma GCC unroll 8
        for (int p = 0; p < 8; p++) bv[p] = LD512(x->bs[p]);
#pragma GCC unroll 4
        for (int r = 0; r < CAS_QK_TILE; r++) {
            const cas_qk_tblk *kr = k + r * nb;
            __m512i o = zero;
#pragma GCC unroll 8
            for (int p = 0; p < 8; p++) o = _mm512_dpwssd_epi32(o, bv[p], bc32(&kr->sp[p]));
            if (t == CAS_T_Q6_K) is[r] = _mm512_sub_epi32(is[r], _mm512_slli_epi32(o, 5));
            else if (t == CAS_T_Q3_K) is[r] = _mm512_sub_epi32(is[r], _mm512_slli_epi32(o, 2));
            else im[r] = o;
        }
    }
}

/* Stores the first nt (<= 16) lanes of each of the nr rows' results. */
static inline void store16(const __m512 *acc, int64_t nr, int64_t nt, int64_t g, int64_t rows, int64_t r, float *y) {
    for (int64_t j = 0; j < nr; j++) {
        float out[16];
        _mm512_storeu_ps(out, acc[j]);
        for (int64_t i = 0; i < nt; i++) y[(16 * g + i) * rows + r + j] = out[i];
    }
}

static inline __attribute__((always_inline)) void lanes16_t(const int t, const uint8_t *w, size_t rb, int64_t n,
                                                            int64_t r, int64_t nr, int64_t rows,
                                                            const cas_q8k16_block *x16, int64_t m, float *y,
                                                            cas_qk_tblk *tile) {
    const int64_t nb = n / CAS_QK_SUPER;
    const size_t bb = (size_t)cas_ttype_block_bytes(t);
    for (int64_t j = 0; j < CAS_QK_TILE; j++)
        for (int64_t b = 0; b < nb; b++)
            cas_qk_avx2_decode(t, w + (size_t)(r + (j < nr ? j : 0)) * rb + (size_t)b * bb, tile + j * nb + b, 1);
    const int mins = t == CAS_T_Q4_K || t == CAS_T_Q5_K || t == CAS_T_Q2_K;
    for (int64_t g = 0; g < (m + 15) / 16; g++) {
        const cas_q8k16_block *xg = x16 + g * nb;
        __m512 acc[CAS_QK_TILE];
#pragma GCC unroll 4
        for (int j = 0; j < CAS_QK_TILE; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m512i is[CAS_QK_TILE], im[CAS_QK_TILE];
            lane_sums16(t, tile + b, nb, xg + b, is, im);
            const __m512 dx = _mm512_load_ps(xg[b].d);
#pragma GCC unroll 4
            for (int j = 0; j < CAS_QK_TILE; j++) {
                const cas_qk_tblk *k = tile + j * nb + b;
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[j]), _mm512_mul_ps(_mm512_set1_ps(k->d), dx), acc[j]);
                if (mins)
                    acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im[j]), _mm512_mul_ps(_mm512_set1_ps(k->dmin), dx), acc[j]);
            }
        }
        store16(acc, nr, m - 16 * g < 16 ? m - 16 * g : 16, g, rows, r, y);
    }
}

/* The fifth bits as a byte mask adding 16 to the nibbles: the 32 codes 0..31
 * of the Q5 block whose qh is at p and qs at p + 4 (quant_k_avx2.c's
 * q5_codes in two AVX-512VL instructions instead of six). */
static inline __m256i q5_codes_vl(const uint8_t *p) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(p + 4)));
    const __m256i nib = _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(15));
    return _mm256_mask_add_epi8(nib, (__mmask32)qh, nib, _mm256_set1_epi8(16));
}

/* A Q5 block decoded as cas_qk_avx2_decode_nl does, inlined here: the
 * 16-token kernel decodes each row's blocks once per call. */
static inline void decode_q5(const int t, const uint8_t *blk, cas_qk_tblk_nl *o) {
    uint16_t h[2];
    memcpy(h, blk, 4);
    _mm256_storeu_si256((__m256i *)(void *)o->v, q5_codes_vl(blk + (t == CAS_T_Q5_1 ? 4 : 2)));
    o->d = _cvtsh_ss(h[0]), o->m = t == CAS_T_Q5_1 ? _cvtsh_ss(h[1]) : 0;
}

static inline __attribute__((always_inline)) void lanes16_b32(const int t, const uint8_t *w, size_t rb, int64_t n,
                                                              int64_t r, int64_t nr, int64_t rows,
                                                              const cas_q8b16_block *x16, int64_t m, float *y,
                                                              cas_qk_tblk_nl *tile) {
    const int64_t nb = n / 32;
    const size_t bb = (size_t)cas_ttype_block_bytes(t);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t j = 0; j < CAS_QK_TILE; j++)
        for (int64_t b = 0; b < nb; b++)
            if (t == CAS_T_Q5_0 || t == CAS_T_Q5_1)
                decode_q5(t, w + (size_t)(r + (j < nr ? j : 0)) * rb + (size_t)b * bb, tile + j * nb + b);
            else
                cas_qk_avx2_decode_nl(t, w + (size_t)(r + (j < nr ? j : 0)) * rb + (size_t)b * bb, tile + j * nb + b, 1);
    for (int64_t g = 0; g < (m + 15) / 16; g++) {
        const cas_q8b16_block *xg = x16 + g * nb;
        __m512 acc[CAS_QK_TILE];
#pragma GCC unroll 4
        for (int j = 0; j < CAS_QK_TILE; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m512i xv[8];
#pragma GCC unroll 8
            for (int e = 0; e < 8; e++) xv[e] = LD512(xg[b].q[e]);
            const __m512i xs = LD512(xg[b].xs);
            /* the offset of the stored codes: 128 (IQ4_NL, Q8_0), 16 (Q5_0), none (Q5_1, Q4_0, Q4_1) */
            const __m512i off = t == CAS_T_IQ4_NL || t == CAS_T_Q8_0 ? _mm512_slli_epi32(xs, 7)
                                : t == CAS_T_Q5_0                   ? _mm512_slli_epi32(xs, 4)
                                                                    : zero;
            const __m512 dx = _mm512_load_ps(xg[b].d);
            /* Q4_0 and Q4_1: the block sum of x times d_x, as quant.c's quantizer makes it */
            const __m512 sx = t == CAS_T_Q4_0 || t == CAS_T_Q4_1 ? _mm512_mul_ps(dx, _mm512_cvtepi32_ps(xs)) : dx;
#pragma GCC unroll 4
            for (int j = 0; j < CAS_QK_TILE; j++) {
                const cas_qk_tblk_nl *k = tile + j * nb + b;
                __m512i a = _mm512_dpbusd_epi32(zero, bc32(k->v), xv[0]);
#pragma GCC unroll 8
                for (int e = 1; e < 8; e++) a = _mm512_dpbusd_epi32(a, bc32(k->v + 4 * e), xv[e]);
                if (t == CAS_T_IQ4_NL || t == CAS_T_Q8_0 || t == CAS_T_Q5_0) a = _mm512_sub_epi32(a, off);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(_mm512_set1_ps(k->d), dx), acc[j]);
                if (t == CAS_T_Q5_1)
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(xs), _mm512_mul_ps(_mm512_set1_ps(k->m), dx), acc[j]);
                if (t == CAS_T_Q4_0 || t == CAS_T_Q4_1) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(k->m), sx, acc[j]);
            }
        }
        store16(acc, nr, m - 16 * g < 16 ? m - 16 * g : 16, g, rows, r, y);
    }
}

void cas_qk_avx512_rows_lanes(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                              const void *x16, int64_t m, float *y, void *tile) {
    for (int64_t r = r0; r < r1; r += CAS_QK_TILE) {
        const int64_t nr = r1 - r < CAS_QK_TILE ? r1 - r : CAS_QK_TILE;
        switch (t) {
        case CAS_T_IQ4_NL: lanes16_b32(CAS_T_IQ4_NL, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_Q5_0: lanes16_b32(CAS_T_Q5_0, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_Q5_1: lanes16_b32(CAS_T_Q5_1, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_Q8_0: lanes16_b32(CAS_T_Q8_0, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_Q4_0: lanes16_b32(CAS_T_Q4_0, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_Q4_1: lanes16_b32(CAS_T_Q4_1, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_Q2_K: lanes16_t(CAS_T_Q2_K, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_Q3_K: lanes16_t(CAS_T_Q3_K, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_Q4_K: lanes16_t(CAS_T_Q4_K, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_Q5_K: lanes16_t(CAS_T_Q5_K, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_Q6_K: lanes16_t(CAS_T_Q6_K, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        case CAS_T_IQ4_XS: lanes16_t(CAS_T_IQ4_XS, w, rb, n, r, nr, rows, x16, m, y, tile); break;
        default: break;
        }
    }
}

/* ---- Q5_0 and Q5_1, one token at a time: eight rows in 256-bit lanes -------
 * The AVX2 row kernel's (quant_k_avx2.c group8) computation with two
 * AVX-512VL instructions in place of eight: the fifth bits become a byte mask
 * that adds 16 to the nibbles (one masked add instead of a shuffle, two ands
 * and a compare), and vpdpbusd takes the codes (0..31, unsigned) times x into
 * int32 without maddubs' 16-bit step. The integer sums are the same exact
 * ones and the f32 chain the same operations in the same order, so the bits
 * are group8's. 256-bit vectors only, as the other single-token kernels. */

static inline __m256i hsum8_rows(const __m256i a[8]) {
    __m256i c0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    __m256i c1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(c0, c1, 0x20), _mm256_permute2x128_si256(c0, c1, 0x31));
}

static inline __attribute__((always_inline)) void q5_group8(const int t, const uint8_t *const *p, int64_t n,
                                                            const cas_q8b_block *xb, const uint8_t *pf, float *out) {
    const size_t bb = (size_t)cas_ttype_block_bytes(t), qho = t == CAS_T_Q5_1 ? 4 : 2;
    const size_t pfl = (4 * 8 * bb + 63) / 64; /* cache lines of the next group per 4 blocks */
    const __m256i zero = _mm256_setzero_si256();
    /* the eight rows' block starts as offsets from the first: d (and Q5_1's m)
     * come by one gather (eight 16-bit stores read back as one vector would
     * stall on store forwarding every block) */
    const __m256i idx = _mm256_setr_epi32(0, (int)(p[1] - p[0]), (int)(p[2] - p[0]), (int)(p[3] - p[0]),
                                          (int)(p[4] - p[0]), (int)(p[5] - p[0]), (int)(p[6] - p[0]), (int)(p[7] - p[0]));
    __m256 acc = _mm256_setzero_ps();
    const uint8_t *q[8];
    for (int r = 0; r < 8; r++) q[r] = p[r];
    for (int64_t b = 0; b < n / 32; b++) {
        if (pf && (b & 3) == 0)
            for (size_t k = 0; k < pfl; k++) _mm_prefetch((const char *)pf + (size_t)b * 8 * bb + 64 * k, _MM_HINT_T0);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(const void *)xb[b].q);
        const __m256 dx = _mm256_set1_ps(xb[b].d);
        __m256i s[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) s[r] = _mm256_dpbusd_epi32(zero, q5_codes_vl(q[r] + qho), x);
        __m256i is = hsum8_rows(s);
        const __m256i dm = _mm256_i32gather_epi32((const int *)(const void *)q[0], idx, 1);
        if (t == CAS_T_Q5_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(16 * xb[b].s));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(_mm256_cvtph_ps(_mm256_cvtepi32_epi16(dm)), dx), acc);
        if (t == CAS_T_Q5_1)
            acc = _mm256_fmadd_ps(_mm256_set1_ps((float)xb[b].s),
                                  _mm256_mul_ps(_mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(dm, 16))), dx), acc);
        for (int r = 0; r < 8; r++) q[r] += bb;
    }
    _mm256_storeu_ps(out, acc);
}

static inline __attribute__((always_inline)) void q5_rows_t(const int t, const uint8_t *w, size_t rb, int64_t n,
                                                            int64_t r0, int64_t r1, int64_t rows, const uint8_t *xq,
                                                            size_t xstride, int64_t m, float *y) {
    for (int64_t r = r0; r < r1; r += 8) {
        const int64_t nr = r1 - r < 8 ? r1 - r : 8;
        const uint8_t *p[8];
        for (int64_t k = 0; k < 8; k++) p[k] = w + (size_t)(r + (k < nr ? k : 0)) * rb;
        const uint8_t *pf = nr == 8 && r + 16 <= r1 ? w + (size_t)(r + 8) * rb : NULL;
        for (int64_t i = 0; i < m; i++) {
            float out[8];
            q5_group8(t, p, n, (const cas_q8b_block *)(const void *)(xq + (size_t)i * xstride), i == 0 ? pf : NULL, out);
            for (int64_t k = 0; k < nr; k++) y[i * rows + r + k] = out[k];
        }
    }
}

void cas_qk_avx512_rows(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                        const uint8_t *xq, size_t xstride, int64_t m, float *y) {
    if (m >= (cas_qk_b32(t) ? 2 : CAS_QK_FEW_MIN_M))
        cas_qk_avx512_rows_few(t, w, rb, n, r0, r1, rows, xq, xstride, m, y);
    else if (t == CAS_T_Q5_0)
        q5_rows_t(CAS_T_Q5_0, w, rb, n, r0, r1, rows, xq, xstride, m, y);
    else if (t == CAS_T_Q5_1)
        q5_rows_t(CAS_T_Q5_1, w, rb, n, r0, r1, rows, xq, xstride, m, y);
    else
        cas_qk_avx2_rows(t, w, rb, n, r0, r1, rows, xq, xstride, m, y);
}

/* ---- the 32-element block types for a few tokens: eight rows in 256-bit lanes
 * Between one token and the token-lane kernels' threshold the lanes of those
 * kernels go mostly unused (two tokens in eight or sixteen lanes), and the
 * row kernels above read a row group once per token and reduce eight
 * vectors of partial sums per token and block. Here each block's codes of
 * eight rows are decoded once and transposed (vector g holds bytes 4g..4g+3
 * of every row), so that for each of up to eight tokens eight vpdpbusd of
 * those vectors against the token's four x bytes, broadcast, give the eight
 * rows' block sums in the lanes, with no reduction per token; the token's
 * f32 chain goes on in its own accumulator. Q8_0's codes are taken plus 128
 * (unsigned, as vpdpbusd wants) and 128 times the block's x sum comes off;
 * Q5_0's offset of 16 likewise. The integer sums are the exact ones and each
 * token's f32 chain the canonical one of its type (quant_impl.h for quant.c's
 * types, quant_k.h for Q5_0 and Q5_1), so a token's results are the bits of
 * its matvec. x: quant.c's cas_q8x_block per block for Q8_0, Q4_0 and Q4_1,
 * cas_qk_quantize_x's cas_q8b_block for Q5_0 and Q5_1. */

/* The 32 codes of the block at blk as unsigned bytes, in element order. */
static inline __m256i few_codes(const int t, const uint8_t *blk) {
    if (t == CAS_T_Q8_0)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(blk + 2)), _mm256_set1_epi8(-128));
    if (t == CAS_T_Q5_0 || t == CAS_T_Q5_1) return q5_codes_vl(blk + (t == CAS_T_Q5_1 ? 4 : 2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(const void *)(blk + (t == CAS_T_Q4_1 ? 4 : 2)));
    const __m256i nib = _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(q), _mm256_set_epi64x(4, 4, 0, 0)),
                                         _mm256_set1_epi8(15));
    if (t == CAS_T_IQ4_NL) { /* the table's values plus 128 */
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)cas_qk_iq4_values));
        return _mm256_xor_si256(_mm256_shuffle_epi8(table, nib), _mm256_set1_epi8(-128));
    }
    return nib;
}

/* 8 x 8 transpose of 32-bit elements: o[g] lane r = c[r] lane g. */
static inline void transpose8x8_i32(const __m256i c[8], __m256i o[8]) {
    const __m256i t0 = _mm256_unpacklo_epi32(c[0], c[1]), t1 = _mm256_unpackhi_epi32(c[0], c[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(c[2], c[3]), t3 = _mm256_unpackhi_epi32(c[2], c[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(c[4], c[5]), t5 = _mm256_unpackhi_epi32(c[4], c[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(c[6], c[7]), t7 = _mm256_unpackhi_epi32(c[6], c[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    o[0] = _mm256_permute2x128_si256(u0, u4, 0x20), o[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    o[2] = _mm256_permute2x128_si256(u2, u6, 0x20), o[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    o[4] = _mm256_permute2x128_si256(u0, u4, 0x31), o[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    o[6] = _mm256_permute2x128_si256(u2, u6, 0x31), o[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

/* The sum of the 32 signed bytes of v in every lane. */
static inline __m256i bytesum_all(__m256i v) {
    __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), v);
    s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0x4e));
    s = _mm256_add_epi32(s, _mm256_shuffle_epi32(s, 0xb1));
    return _mm256_add_epi32(s, _mm256_permute2x128_si256(s, s, 0x01));
}

/* MT tokens' f32 accumulators over the blocks of the eight rows at p[]
 * (token i's x at xq + i * xstride), prefetching the next row group at pf. */
static inline __attribute__((always_inline)) void few_group(const int t, const int MT, const uint8_t *const *p,
                                                            int64_t n, const uint8_t *xq, size_t xstride,
                                                            const uint8_t *pf, __m256 *acc) {
    const size_t bb = (size_t)cas_ttype_block_bytes(t);
    const size_t pfl = (4 * 8 * bb + 63) / 64; /* cache lines of the next group per 4 blocks */
    const int q5 = t == CAS_T_Q5_0 || t == CAS_T_Q5_1 || t == CAS_T_IQ4_NL; /* x as cas_qk_quantize_x makes it */
    const __m256i zero = _mm256_setzero_si256();
    /* d (and m) of the eight rows' blocks by one gather, as in q5_group8 */
    const __m256i idx = _mm256_setr_epi32(0, (int)(p[1] - p[0]), (int)(p[2] - p[0]), (int)(p[3] - p[0]),
                                          (int)(p[4] - p[0]), (int)(p[5] - p[0]), (int)(p[6] - p[0]), (int)(p[7] - p[0]));
#pragma GCC unroll 8
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / 32; b++) {
        if (pf && (b & 3) == 0)
            for (size_t k = 0; k < pfl; k++) _mm_prefetch((const char *)pf + (size_t)b * 8 * bb + 64 * k, _MM_HINT_T0);
        __m256i c[8], tw[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) c[r] = few_codes(t, p[r] + (size_t)b * bb);
        transpose8x8_i32(c, tw);
        const __m256i dm = _mm256_i32gather_epi32((const int *)(const void *)(p[0] + (size_t)b * bb), idx, 1);
        const __m256 d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(dm));
        const __m256 mh = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(dm, 16)));
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            const uint8_t *xi = xq + (size_t)i * xstride;
            const int8_t *xc;
            float dxs, sxf = 0;
            int32_t sxi = 0;
            if (q5) {
                const cas_q8b_block *xb = (const cas_q8b_block *)(const void *)xi + b;
                xc = xb->q, dxs = xb->d, sxi = xb->s;
            } else {
                const cas_q8x_block *xb = (const cas_q8x_block *)(const void *)xi + b;
                xc = xb->q, dxs = xb->d, sxf = xb->s;
            }
            /* two chains of four, for the latency of vpdpbusd */
            __m256i a0 = t == CAS_T_Q8_0 || t == CAS_T_IQ4_NL
                             ? _mm256_sub_epi32(zero, _mm256_slli_epi32(
                                                          bytesum_all(_mm256_loadu_si256((const __m256i *)(const void *)xc)), 7))
                             : zero;
            __m256i a1 = zero;
#pragma GCC unroll 4
            for (int g = 0; g < 8; g += 2) {
                a0 = _mm256_dpbusd_epi32(a0, tw[g], bc32_256(xc + 4 * g));
                a1 = _mm256_dpbusd_epi32(a1, tw[g + 1], bc32_256(xc + 4 * g + 4));
            }
            __m256i is = _mm256_add_epi32(a0, a1);
            if (t == CAS_T_Q5_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(16 * sxi));
            const __m256 dx = _mm256_set1_ps(dxs);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, dx), acc[i]);
            if (t == CAS_T_Q4_0) acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(-8.0f), d), _mm256_set1_ps(sxf), acc[i]);
            if (t == CAS_T_Q4_1) acc[i] = _mm256_fmadd_ps(mh, _mm256_set1_ps(sxf), acc[i]);
            if (t == CAS_T_Q5_1) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps((float)sxi), _mm256_mul_ps(mh, dx), acc[i]);
        }
    }
}


/* ---- the super-block types for a few tokens ----------------------------------
 * The same for Q2_K .. Q6_K and IQ4_XS: the eight rows' super-block decoded
 * once by the token-lane kernels' decoder (cas_qk_tblk) for up to eight
 * tokens; each 32 codes of the eight rows transposed into the lanes, the
 * sub-block scales and the bsum pairs' factors (sp) too. Per token and 32
 * codes, eight vpdpbusd against its x bytes broadcast give the rows' sums in
 * the lanes, one vpmulld per sub-block applies its scale (as lane_sums16), the
 * offsets or minimums come from vpdpwssd of sp against the token's bsum
 * pairs, and the f32 chain is lanes16_t's: the bits of each token's matvec. */
static inline __attribute__((always_inline)) void kfew_group(const int t, const int MT, const uint8_t *const *p,
                                                             int64_t nb, const uint8_t *xq, size_t xstride,
                                                             const uint8_t *pf, cas_qk_tblk *k, __m256 *acc) {
    const size_t bb = (size_t)cas_ttype_block_bytes(t);
    const size_t pfl = (8 * bb + 63) / 64; /* cache lines of the next group per super-block */
    const int sub16 = t == CAS_T_Q2_K || t == CAS_T_Q3_K || t == CAS_T_Q6_K;
    const int mins = t == CAS_T_Q4_K || t == CAS_T_Q5_K || t == CAS_T_Q2_K;
    const __m256i zero = _mm256_setzero_si256();
    const __m256i kidx = _mm256_setr_epi32(0, 1 * CAS_QK_TILE_BLOCK_BYTES, 2 * CAS_QK_TILE_BLOCK_BYTES,
                                           3 * CAS_QK_TILE_BLOCK_BYTES, 4 * CAS_QK_TILE_BLOCK_BYTES,
                                           5 * CAS_QK_TILE_BLOCK_BYTES, 6 * CAS_QK_TILE_BLOCK_BYTES,
                                           7 * CAS_QK_TILE_BLOCK_BYTES);
#pragma GCC unroll 8
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const size_t o = (size_t)b * bb;
        /* decoded once per super-block; the next group's lines spread over the rows */
        for (int r = 0; r < 8; r++) {
            if (pf)
                for (size_t l = (size_t)r * pfl / 8; l < (size_t)(r + 1) * pfl / 8; l++)
                    _mm_prefetch((const char *)pf + 8 * o + 64 * l, _MM_HINT_T0);
            cas_qk_avx2_decode(t, p[r] + o, k + r, 1);
        }
        /* sub-block scales, sign-extended from their low halves, and the sp pairs, in the lanes */
        __m256i scv[16], spv[8], v[8];
        for (int h = 0; h < (sub16 ? 2 : 1); h++) {
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_si256((const __m256i *)(const void *)(k[r].sc + 8 * h));
            transpose8x8_i32(v, scv + 8 * h);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) scv[8 * h + j] = _mm256_srai_epi32(_mm256_slli_epi32(scv[8 * h + j], 16), 16);
        }
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_si256((const __m256i *)(const void *)k[r].sp);
        transpose8x8_i32(v, spv);
        __m256i is[8];
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) is[i] = zero;
        for (int j = 0; j < 8; j++) {
            __m256i tw[8];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_si256((const __m256i *)(const void *)(k[r].c + 32 * j));
            transpose8x8_i32(v, tw);
#pragma GCC unroll 8
            for (int i = 0; i < MT; i++) {
                const cas_q8k_block *xb = (const cas_q8k_block *)(const void *)(xq + (size_t)i * xstride) + b;
                const int8_t *xc = xb->q + 32 * j;
                __m256i a0 = _mm256_dpbusd_epi32(zero, tw[0], bc32_256(xc));
                __m256i a1 = _mm256_dpbusd_epi32(zero, tw[sub16 ? 4 : 1], bc32_256(xc + (sub16 ? 16 : 4)));
                if (sub16) {
#pragma GCC unroll 3
                    for (int g = 1; g < 4; g++) {
                        a0 = _mm256_dpbusd_epi32(a0, tw[g], bc32_256(xc + 4 * g));
                        a1 = _mm256_dpbusd_epi32(a1, tw[4 + g], bc32_256(xc + 16 + 4 * g));
                    }
                    is[i] = _mm256_add_epi32(is[i], _mm256_mullo_epi32(a0, scv[2 * j]));
                    is[i] = _mm256_add_epi32(is[i], _mm256_mullo_epi32(a1, scv[2 * j + 1]));
                } else {
#pragma GCC unroll 3
                    for (int g = 2; g < 8; g += 2) {
                        a0 = _mm256_dpbusd_epi32(a0, tw[g], bc32_256(xc + 4 * g));
                        a1 = _mm256_dpbusd_epi32(a1, tw[g + 1], bc32_256(xc + 4 * g + 4));
                    }
                    __m256i a = _mm256_add_epi32(a0, a1);
                    if (t == CAS_T_IQ4_XS) /* the table values stored plus 128 */
                        a = _mm256_sub_epi32(a, _mm256_set1_epi32(128 * (xb->bsum[2 * j] + xb->bsum[2 * j + 1])));
                    is[i] = _mm256_add_epi32(is[i], _mm256_mullo_epi32(a, scv[j]));
                }
            }
        }
        const __m256 dv = _mm256_i32gather_ps(&k[0].d, kidx, 1);
        const __m256 dminv = _mm256_i32gather_ps(&k[0].dmin, kidx, 1);
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            const cas_q8k_block *xb = (const cas_q8k_block *)(const void *)(xq + (size_t)i * xstride) + b;
            __m256i im = zero;
            if (t != CAS_T_IQ4_XS) {
                __m256i om = zero;
#pragma GCC unroll 8
                for (int q = 0; q < 8; q++) om = _mm256_dpwssd_epi32(om, spv[q], bc32_256(&xb->bsum[2 * q]));
                if (t == CAS_T_Q6_K) is[i] = _mm256_sub_epi32(is[i], _mm256_slli_epi32(om, 5));
                else if (t == CAS_T_Q3_K) is[i] = _mm256_sub_epi32(is[i], _mm256_slli_epi32(om, 2));
                else im = om;
            }
            const __m256 dx = _mm256_set1_ps(xb->d);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[i]), _mm256_mul_ps(dv, dx), acc[i]);
            if (mins) acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(dminv, dx), acc[i]);
        }
    }
}

/* One 8-row group's MT tokens by the kernel of t's kind (k: the super-block types' decoded rows). */
static inline __attribute__((always_inline)) void few_any(const int t, const int MT, const uint8_t *const *p, int64_t n,
                                                          const uint8_t *xq, size_t xstride, const uint8_t *pf,
                                                          cas_qk_tblk *k, __m256 *acc) {
    if (t == CAS_T_Q2_K || t == CAS_T_Q3_K || t == CAS_T_Q4_K || t == CAS_T_Q5_K || t == CAS_T_Q6_K ||
        t == CAS_T_IQ4_XS)
        kfew_group(t, MT, p, n / CAS_QK_SUPER, xq, xstride, pf, k, acc);
    else
        few_group(t, MT, p, n, xq, xstride, pf, acc);
}

static inline __attribute__((always_inline)) void few_rows_t(const int t, const uint8_t *w, size_t rb, int64_t n,
                                                             int64_t r0, int64_t r1, int64_t rows, const uint8_t *xq,
                                                             size_t xstride, int64_t m, float *y) {
    /* tokens in chunks of at most eight, as even as they come (11: 6 and 5) */
    const int64_t chunks = (m + 7) / 8;
    cas_qk_tblk k[8];
    for (int64_t r = r0; r < r1; r += 8) {
        const int64_t nr = r1 - r < 8 ? r1 - r : 8;
        const uint8_t *p[8];
        for (int64_t j = 0; j < 8; j++) p[j] = w + (size_t)(r + (j < nr ? j : 0)) * rb;
        const uint8_t *pf = nr == 8 && r + 16 <= r1 ? w + (size_t)(r + 8) * rb : NULL;
        for (int64_t c = 0, i0 = 0; c < chunks; c++) {
            const int64_t kt = (m - i0) / (chunks - c);
            const uint8_t *xi = xq + (size_t)i0 * xstride, *pfi = c == 0 ? pf : NULL;
            __m256 acc[8];
            switch (kt) {
            case 1: few_any(t, 1, p, n, xi, xstride, pfi, k, acc); break;
            case 2: few_any(t, 2, p, n, xi, xstride, pfi, k, acc); break;
            case 3: few_any(t, 3, p, n, xi, xstride, pfi, k, acc); break;
            case 4: few_any(t, 4, p, n, xi, xstride, pfi, k, acc); break;
            case 5: few_any(t, 5, p, n, xi, xstride, pfi, k, acc); break;
            case 6: few_any(t, 6, p, n, xi, xstride, pfi, k, acc); break;
            case 7: few_any(t, 7, p, n, xi, xstride, pfi, k, acc); break;
            default: few_any(t, 8, p, n, xi, xstride, pfi, k, acc); break;
            }
            for (int64_t i = 0; i < kt; i++) {
                float out[8];
                _mm256_storeu_ps(out, acc[i]);
                for (int64_t j = 0; j < nr; j++) y[(i0 + i) * rows + r + j] = out[j];
            }
            i0 += kt;
        }
    }
}

void cas_qk_avx512_rows_few(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                            const void *xq, size_t xstride, int64_t m, float *y) {
    switch (t) {
    case CAS_T_Q8_0: few_rows_t(CAS_T_Q8_0, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q4_0: few_rows_t(CAS_T_Q4_0, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q4_1: few_rows_t(CAS_T_Q4_1, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q5_0: few_rows_t(CAS_T_Q5_0, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q5_1: few_rows_t(CAS_T_Q5_1, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_IQ4_NL: few_rows_t(CAS_T_IQ4_NL, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q2_K: few_rows_t(CAS_T_Q2_K, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q3_K: few_rows_t(CAS_T_Q3_K, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q4_K: few_rows_t(CAS_T_Q4_K, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q5_K: few_rows_t(CAS_T_Q5_K, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q6_K: few_rows_t(CAS_T_Q6_K, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_IQ4_XS: few_rows_t(CAS_T_IQ4_XS, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    default: break;
    }
}
