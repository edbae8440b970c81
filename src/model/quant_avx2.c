/*
 * quant_avx2.c: the AVX2+FMA+F16C matrix kernels (compiled with -mavx2 -mfma
 * -mf16c; quant.c calls them only after checking the CPU at run time).
 *
 * Matrix-vector (decode) is bound by the bytes of weights read, so the kernel
 * reads each weight byte once, in its file format, and does little work per
 * 32-element block: nibbles are spread to bytes with one shift and one mask,
 * multiplied with the 8-bit x by _mm256_maddubs_epi16 (unsigned weight bytes
 * times signed x bytes; no overflow: 2 * 15 * 127 < 2^15) and summed to int32
 * by _mm256_madd_epi16. Q8_0 weights are signed, so the sign of each weight
 * moves onto x (_mm256_sign_epi8) and its magnitude is the unsigned operand.
 * Eight rows go together, one per f32 lane, so that each row's result is the
 * one chain per block that the batched kernel computes for it (the batch-
 * invariance contract in quant_impl.h).
 *
 * Batched (prefill, many sequences) is bound by compute once m is large: a
 * tile of four weight rows is decoded once into bytes and f32 scales (for Q4,
 * the unpacking then costs nothing per token) and stays in L1 while every
 * token uses it. The tokens go into the SIMD lanes, eight at a time (x
 * transposed by quant.c), so that one maddubs does 32 useful multiply-adds
 * and the per-block scaling is paid once per eight tokens. Float weights use
 * a 4 x 2 register tile (rows x tokens) with FMAs on f32 (F16 and BF16 rows
 * are converted to f32 once per tile).
 */
#include "quant_impl.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define R CAS_Q_TILE_ROWS

/* Software prefetch distance beyond the next 4-row group, bytes. */
#define PF_AHEAD 1024

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 16 bytes of nibbles to 32 bytes 0..15: low nibbles are elements 0..15, high
 * nibbles 16..31. */
static inline __m256i unpack_nibbles(const uint8_t *qs) {
    __m128i lo = _mm_loadu_si128((const __m128i *)(const void *)qs);
    __m128i hi = _mm_srli_epi16(lo, 4);
    return _mm256_and_si256(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(15));
}

/* 8 f32 weights from a float-type row at element i. */
static inline __m256 ld_w8(int t, const uint8_t *row, int64_t i) {
    if (t == CAS_T_F32) return _mm256_loadu_ps((const float *)(const void *)row + i);
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(row + 2 * i));
    if (t == CAS_T_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float ld_w1(int t, const uint8_t *row, int64_t i) {
    if (t == CAS_T_F32) {
        float v;
        memcpy(&v, row + 4 * i, 4);
        return v;
    }
    uint16_t h;
    memcpy(&h, row + 2 * i, 2);
    if (t == CAS_T_F16) return _cvtsh_ss(h);
    uint32_t u = (uint32_t)h << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

/* ---- activation quantization -------------------------------------------- */

/* One block of 32 floats to 8 bits, exactly as quantize_x_row in quant.c
 * (d = amax / 127, q = round-to-nearest-even(x * 127 / amax) clamped to
 * +-127, s = d * sum(q)): the same f32 operations in the same order, so the
 * portable and AVX2 paths see bit-identical quantized x. Returns q in a
 * register (element order) and d, s through pointers. */
static inline __m256i quant_block_x(const float *x, float *d_out, float *s_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
           v3 = _mm256_loadu_ps(x + 24);
    __m256 am = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float amax = _mm_cvtss_f32(h);
    float d = amax / 127.0f, id = d != 0 ? 127.0f / amax : 0.0f;
    __m256 iv = _mm256_set1_ps(id);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i q0 = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v0, iv)), lo), hi);
    __m256i q1 = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v1, iv)), lo), hi);
    __m256i q2 = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v2, iv)), lo), hi);
    __m256i q3 = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v3, iv)), lo), hi);
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *d_out = d;
    *s_out = d * (float)_mm_cvtsi128_si32(s4);
    /* packs work within 128-bit lanes: [q0 0-3, q1 0-3, q2 0-3, q3 0-3 | q0 4-7, ...] */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

void cas_q_avx2_quantize_x(const float *x, int64_t nb, cas_q8x_block *xq, float *sx) {
    for (int64_t b = 0; b < nb; b++) {
        __m256i q = quant_block_x(x + 32 * b, &xq[b].d, &xq[b].s);
        _mm256_storeu_si256((__m256i *)(void *)xq[b].q, q);
        sx[b] = xq[b].s;
    }
}

void cas_q_avx2_quantize_x16(const float *x, int64_t nb, int t, cas_q8x16_block *g) {
    for (int64_t b = 0; b < nb; b++) {
        __m256i q = quant_block_x(x + 32 * b, &g[b].d[t], &g[b].s[t]);
        _mm256_store_si256((__m256i *)(void *)g[b].q[t], q);
    }
}

void cas_q_avx2_quantize_x8(const float *x, int64_t n, int64_t ntok, int64_t b, cas_q8x8_block *o) {
    __m256i r[8];
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) {
        if (t < ntok) {
            r[t] = quant_block_x(x + t * n + 32 * b, &o->d[t], &o->s[t]);
        } else {
            r[t] = _mm256_setzero_si256();
            o->d[t] = o->s[t] = 0;
        }
    }
    /* 8 x 8 transpose of 32-bit elements: vector k gets element group k
     * (x[4k .. 4k+3]) of every token */
    __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    __m256i *q = (__m256i *)(void *)o->q;
    _mm256_store_si256(q + 0, _mm256_permute2x128_si256(u0, u4, 0x20));
    _mm256_store_si256(q + 1, _mm256_permute2x128_si256(u1, u5, 0x20));
    _mm256_store_si256(q + 2, _mm256_permute2x128_si256(u2, u6, 0x20));
    _mm256_store_si256(q + 3, _mm256_permute2x128_si256(u3, u7, 0x20));
    _mm256_store_si256(q + 4, _mm256_permute2x128_si256(u0, u4, 0x31));
    _mm256_store_si256(q + 5, _mm256_permute2x128_si256(u1, u5, 0x31));
    _mm256_store_si256(q + 6, _mm256_permute2x128_si256(u2, u6, 0x31));
    _mm256_store_si256(q + 7, _mm256_permute2x128_si256(u3, u7, 0x31));
}

/* ---- matrix-vector ------------------------------------------------------
 * Every path computes y[r] for a token by the same chain (the batch-
 * invariance contract of quant_impl.h): per block b in order, the block's
 * integer dot product s_b (exact int32), then acc = fma((float)s_b, d_b * dx_b,
 * acc) and, for Q4_0 and Q4_1, acc = fma(m_b, sx_b, acc) (m_b = -8 d_b for
 * Q4_0, the block minimum for Q4_1). The batched kernel keeps tokens in the
 * lanes; this one keeps eight rows in the lanes: each row's 32-element dot
 * product is summed to eight int32 partial sums, and the eight rows' partial
 * sums are reduced to one vector of eight totals by a horizontal-add
 * transpose (integer adds: exact in any order). Rows past the last group of
 * eight take the same chain one at a time. */

#define MV8 8

/* The block dot product of one row as eight int32 partial sums (lane k sums
 * elements 4k..4k+3). */
static inline __attribute__((always_inline)) __m256i mv_block_i32(const int t, const uint8_t *blk,
                                                                   __m256i xv) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (t == CAS_T_Q8_0) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 2));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)), ones);
    }
    /* the 16 nibble bytes in both halves, the upper half shifted right by 4 */
    const __m256i shift = _mm256_set_epi64x(4, 4, 0, 0), m4 = _mm256_set1_epi8(15);
    __m128i q = _mm_loadu_si128((const __m128i *)(const void *)(blk + (t == CAS_T_Q4_1 ? 4 : 2)));
    __m256i nib = _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(q), shift), m4);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(nib, xv), ones);
}

/* Sum of the eight lanes of each of v[0..8), row j's total in lane j. */
static inline __m256i hsum8x8_i32(const __m256i v[MV8]) {
    __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
    /* b0 = [r0 r1 r2 r3 (low halves) | r0 r1 r2 r3 (high halves)], b1 the same for r4..r7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* Scale d (lanes) and zero-point factor m of block b of eight rows r..r+7. */
static inline __attribute__((always_inline)) void mv_scales8(const int t, const uint8_t *p0, size_t rb,
                                                             __m256 *d, __m256 *m) {
    int32_t v[MV8];
#pragma GCC unroll 8
    for (int j = 0; j < MV8; j++) memcpy(&v[j], p0 + (size_t)j * rb, 4);
    __m256i g = _mm256_loadu_si256((const __m256i *)(const void *)v);
    const __m256i lo16 = _mm256_set1_epi32(0xffff);
    /* the low 16 bits of each lane (d) in lanes 0..7 of an xmm, as f16 */
    __m256i dl = _mm256_and_si256(g, lo16);
    __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(dl, dl), 0x08);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(pk));
    if (t == CAS_T_Q4_1) {
        __m256i ml = _mm256_srli_epi32(g, 16);
        __m256i pm = _mm256_permute4x64_epi64(_mm256_packus_epi32(ml, ml), 0x08);
        *m = _mm256_cvtph_ps(_mm256_castsi256_si128(pm));
    } else if (t == CAS_T_Q4_0) {
        *m = _mm256_mul_ps(_mm256_set1_ps(-8.0f), *d);
    } else {
        *m = _mm256_setzero_ps();
    }
}

static inline __attribute__((always_inline)) void mv_quant8(const int t, const uint8_t *w, size_t rb,
                                                            int64_t r, int64_t nb, const cas_q8x_block *xq,
                                                            float *y) {
    const size_t bb = t == CAS_T_Q8_0 ? 34 : t == CAS_T_Q4_0 ? 18 : 20;
    const uint8_t *p = w + (size_t)r * rb;
    __m256 acc = _mm256_setzero_ps();
    /* each row is only a few cache lines, too short for the hardware stream
     * prefetchers to train on: prefetch the next group of eight rows at the
     * pace this group is consumed, PF_AHEAD bytes further */
    const uint8_t *pf = p + (size_t)MV8 * rb + PF_AHEAD;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *a = pf + (size_t)b * MV8 * bb;
        _mm_prefetch((const char *)a, _MM_HINT_T0);
        _mm_prefetch((const char *)a + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)a + 128, _MM_HINT_T0);
        if (MV8 * bb > 192) _mm_prefetch((const char *)a + 192, _MM_HINT_T0);
        __m256i xv = _mm256_loadu_si256((const __m256i *)(const void *)xq[b].q);
        __m256i s[MV8];
#pragma GCC unroll 8
        for (int j = 0; j < MV8; j++) s[j] = mv_block_i32(t, p + (size_t)j * rb + (size_t)b * bb, xv);
        __m256 d, m;
        mv_scales8(t, p + (size_t)b * bb, rb, &d, &m);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hsum8x8_i32(s)), _mm256_mul_ps(d, _mm256_set1_ps(xq[b].d)), acc);
        if (t != CAS_T_Q8_0) acc = _mm256_fmadd_ps(m, _mm256_set1_ps(xq[b].s), acc);
    }
    _mm256_storeu_ps(y + r, acc);
}

static inline __attribute__((always_inline)) void mv_quant1(const int t, const uint8_t *w, size_t rb,
                                                            int64_t r, int64_t nb, const cas_q8x_block *xq,
                                                            float *y) {
    const size_t bb = t == CAS_T_Q8_0 ? 34 : t == CAS_T_Q4_0 ? 18 : 20;
    const uint8_t *p = w + (size_t)r * rb;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = p + (size_t)b * bb;
        __m256i v = mv_block_i32(t, blk, _mm256_loadu_si256((const __m256i *)(const void *)xq[b].q));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        float d = ld_f16(blk);
        acc = fmaf((float)_mm_cvtsi128_si32(s4), d * xq[b].d, acc);
        if (t == CAS_T_Q4_1) acc = fmaf(ld_f16(blk + 2), xq[b].s, acc);
        if (t == CAS_T_Q4_0) acc = fmaf(-8.0f * d, xq[b].s, acc);
    }
    y[r] = acc;
}

static inline __attribute__((always_inline)) void mv_float(const int t, const int nr,
                                                           const uint8_t *w, size_t rb, int64_t r,
                                                           int64_t n, const float *x, float *y) {
    __m256 acc[R];
    const uint8_t *p[R];
#pragma GCC unroll 4
    for (int j = 0; j < nr; j++) {
        acc[j] = _mm256_setzero_ps();
        p[j] = w + (size_t)(r + j) * rb;
    }
    const size_t es = t == CAS_T_F32 ? 4 : 2;
    const uint8_t *pf = p[0] + (size_t)R * rb + PF_AHEAD;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        if (nr == R) { /* as in mv_quant: 4 rows x 8 elements consumed per step */
            const uint8_t *a = pf + (size_t)i * R * es;
            _mm_prefetch((const char *)a, _MM_HINT_T0);
            if (R * 8 * es > 64) _mm_prefetch((const char *)a + 64, _MM_HINT_T0);
        }
        __m256 xv = _mm256_loadu_ps(x + i);
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) acc[j] = _mm256_fmadd_ps(ld_w8(t, p[j], i), xv, acc[j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < nr; j++) {
        float s = hsum8(acc[j]);
        for (int64_t k = i; k < n; k++) s = fmaf(ld_w1(t, p[j], k), x[k], s);
        y[r + j] = s;
    }
}

#define MV_TYPE(name, step, body_many, body1)                                              \
    static void name(const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n,          \
                     const float *xf, const cas_q8x_block *xq, const float *sx, float *y) {   \
        int64_t r = r0;                                                                       \
        (void)xf, (void)xq, (void)sx;                                                         \
        for (; r + (step) <= r1; r += (step)) body_many;                                      \
        for (; r < r1; r++) body1;                                                            \
    }

MV_TYPE(mv_q8_0, MV8, mv_quant8(CAS_T_Q8_0, w, rb, r, n / 32, xq, y), mv_quant1(CAS_T_Q8_0, w, rb, r, n / 32, xq, y))
MV_TYPE(mv_q4_0, MV8, mv_quant8(CAS_T_Q4_0, w, rb, r, n / 32, xq, y), mv_quant1(CAS_T_Q4_0, w, rb, r, n / 32, xq, y))
MV_TYPE(mv_q4_1, MV8, mv_quant8(CAS_T_Q4_1, w, rb, r, n / 32, xq, y), mv_quant1(CAS_T_Q4_1, w, rb, r, n / 32, xq, y))
MV_TYPE(mv_f32, R, mv_float(CAS_T_F32, 4, w, rb, r, n, xf, y),
        mv_float(CAS_T_F32, 1, w, rb, r, n, xf, y))
MV_TYPE(mv_f16, R, mv_float(CAS_T_F16, 4, w, rb, r, n, xf, y),
        mv_float(CAS_T_F16, 1, w, rb, r, n, xf, y))
MV_TYPE(mv_bf16, R, mv_float(CAS_T_BF16, 4, w, rb, r, n, xf, y),
        mv_float(CAS_T_BF16, 1, w, rb, r, n, xf, y))

void cas_q_avx2_matvec_rows(int t, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n,
                            const float *xf, const cas_q8x_block *xq, const float *sx, float *y) {
    switch (t) {
    case CAS_T_Q8_0: mv_q8_0(w, rb, r0, r1, n, xf, xq, sx, y); break;
    case CAS_T_Q4_0: mv_q4_0(w, rb, r0, r1, n, xf, xq, sx, y); break;
    case CAS_T_Q4_1: mv_q4_1(w, rb, r0, r1, n, xf, xq, sx, y); break;
    case CAS_T_F32: mv_f32(w, rb, r0, r1, n, xf, xq, sx, y); break;
    case CAS_T_F16: mv_f16(w, rb, r0, r1, n, xf, xq, sx, y); break;
    case CAS_T_BF16: mv_bf16(w, rb, r0, r1, n, xf, xq, sx, y); break;
    default: break;
    }
}

/* ---- batched: quantized weights ---------------------------------------- */

/* Decoded tile of R rows: wq[R][n] unsigned bytes (Q4: 0..15; Q8_0: |w|),
 * ws[R][n] signed bytes (Q8_0 only: the weights, whose signs move onto x),
 * dw[R][nb] f32 scales, mw[R][nb] zero-point factors (Q4_0: -8 d; Q4_1: m).
 * Rows past nr are zero, so the register tile always has R rows. */
typedef struct {
    uint8_t *wq;
    int8_t *ws;
    float *dw;
    float *mw;
} qtile;

static inline __attribute__((always_inline)) qtile decode_qtile(const int t, const uint8_t *w, size_t rb,
                                                                 int64_t r0, int64_t nr, int64_t n,
                                                                 void *scratch) {
    const size_t bb = t == CAS_T_Q8_0 ? 34 : t == CAS_T_Q4_0 ? 18 : 20;
    int64_t nb = n / 32;
    qtile q;
    q.wq = scratch;
    q.ws = (int8_t *)(q.wq + R * n);
    q.dw = (float *)(void *)(q.ws + R * n);
    q.mw = q.dw + R * nb;
    for (int64_t j = nr; j < R; j++) {
        memset(q.wq + j * n, 0, (size_t)n);
        memset(q.ws + j * n, 0, (size_t)n);
        memset(q.dw + j * nb, 0, (size_t)nb * 4);
        memset(q.mw + j * nb, 0, (size_t)nb * 4);
    }
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t j = 0; j < nr; j++) {
        const uint8_t *row = w + (size_t)(r0 + j) * rb;
        float *dw = q.dw + j * nb, *mw = q.mw + j * nb;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + bb * (size_t)b;
            uint8_t *dst = q.wq + j * n + 32 * b;
            if (t == CAS_T_Q8_0) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 2));
                _mm256_storeu_si256((__m256i *)(void *)dst, _mm256_abs_epi8(wv));
                _mm256_storeu_si256((__m256i *)(void *)(q.ws + j * n + 32 * b), wv);
            } else {
                _mm256_storeu_si256((__m256i *)(void *)dst, unpack_nibbles(blk + (t == CAS_T_Q4_1 ? 4 : 2)));
            }
        }
        /* scales eight blocks at a time: one f16 conversion instead of eight */
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8) {
            const uint8_t *blk = row + bb * (size_t)b;
            if (t == CAS_T_Q4_1) {
                int32_t v[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) memcpy(&v[i], blk + bb * (size_t)i, 4);
                __m256 a0 = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_setr_epi32(v[0], v[1], v[2], v[3])), perm);
                __m256 a1 = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_setr_epi32(v[4], v[5], v[6], v[7])), perm);
                _mm256_storeu_ps(dw + b, _mm256_permute2f128_ps(a0, a1, 0x20));
                _mm256_storeu_ps(mw + b, _mm256_permute2f128_ps(a0, a1, 0x31));
            } else {
                uint16_t h[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) memcpy(&h[i], blk + bb * (size_t)i, 2);
                __m256 d = _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3],
                                                          (short)h[4], (short)h[5], (short)h[6], (short)h[7]));
                _mm256_storeu_ps(dw + b, d);
                _mm256_storeu_ps(mw + b, t == CAS_T_Q4_0 ? _mm256_mul_ps(_mm256_set1_ps(-8.0f), d) : _mm256_setzero_ps());
            }
        }
        for (; b < nb; b++) {
            const uint8_t *blk = row + bb * (size_t)b;
            dw[b] = ld_f16(blk);
            mw[b] = t == CAS_T_Q4_1 ? ld_f16(blk + 2) : t == CAS_T_Q4_0 ? -8.0f * dw[b] : 0.0f;
        }
    }
    return q;
}

/* ---- batched: quantized weights, tokens in lanes ------------------------
 * Eight tokens sit in the eight f32 lanes; the x of one block comes as eight
 * vectors (cas_q8x8_block), vector k holding elements 4k..4k+3 of every
 * token. Four weight bytes of row j, broadcast to all lanes, times vector k
 * with _mm256_maddubs_epi16 give each token two 16-bit partial sums, so one
 * instruction serves eight tokens and the per-block scaling (madd, convert,
 * scale, FMA) is paid once per eight tokens instead of once per token. For
 * Q4 the eight 16-bit partial sums of a block add up without overflow
 * (8 * 2 * 15 * 127 < 2^15); Q8_0's do not, so it widens every chunk. */

static inline __m256i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) void mm_lanes(const int t, const qtile *q, int64_t nb,
                                                           int64_t n, const cas_q8x8_block *xg,
                                                           __m256 acc[R]) {
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const cas_q8x8_block *xb = xg + b;
        /* The block's x for all eight tokens stays in eight registers while
         * the R rows use it: per row and block, 8 broadcasts (loads) and 8
         * maddubs, 7 adds, then one widening, convert and scale. */
        __m256i xk[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) xk[k] = _mm256_load_si256((const __m256i *)(const void *)xb->q[k]);
        const __m256 dx = _mm256_load_ps(xb->d);
#pragma GCC unroll 4
        for (int j = 0; j < R; j++) {
            const uint8_t *wq = q->wq + (size_t)j * n + 32 * b;
            __m256i s32;
            if (t == CAS_T_Q8_0) {
                const int8_t *ws = q->ws + (size_t)j * n + 32 * b;
                s32 = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    __m256i p = _mm256_maddubs_epi16(bcast4(wq + 4 * k), _mm256_sign_epi8(xk[k], bcast4(ws + 4 * k)));
                    s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(p, ones));
                }
            } else {
                __m256i a = _mm256_maddubs_epi16(bcast4(wq), xk[0]);
#pragma GCC unroll 8
                for (int k = 1; k < 8; k++) a = _mm256_add_epi16(a, _mm256_maddubs_epi16(bcast4(wq + 4 * k), xk[k]));
                s32 = _mm256_madd_epi16(a, ones);
            }
            __m256 sc = _mm256_mul_ps(_mm256_broadcast_ss(q->dw + j * nb + b), dx);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), sc, acc[j]);
            if (t != CAS_T_Q8_0)
                acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(q->mw + j * nb + b), _mm256_load_ps(xb->s), acc[j]);
        }
    }
}

static inline __attribute__((always_inline)) void mm_quant_lanes(const int t, const uint8_t *w,
                                                                 size_t rb, int64_t r0, int64_t nr,
                                                                 int64_t rows, int64_t n,
                                                                 const cas_q8x8_block *x8, int64_t m,
                                                                 float *y, void *scratch) {
    int64_t nb = n / 32;
    qtile q = decode_qtile(t, w, rb, r0, nr, n, scratch);
    for (int64_t g = 0; g < (m + 7) / 8; g++) {
        __m256 acc[R];
        float out[R][8];
        mm_lanes(t, &q, nb, n, x8 + g * nb, acc);
        for (int j = 0; j < R; j++) _mm256_storeu_ps(out[j], acc[j]);
        int64_t nt = m - 8 * g < 8 ? m - 8 * g : 8;
        for (int64_t i = 0; i < nt; i++)
            for (int64_t j = 0; j < nr; j++) y[(8 * g + i) * rows + r0 + j] = out[j][i];
    }
}

void cas_q_avx2_matmul_tile_lanes(int t, const uint8_t *w, size_t rb, int64_t r0, int64_t nr,
                                  int64_t rows, int64_t n, const cas_q8x8_block *x8, int64_t m,
                                  float *y, void *tile) {
    switch (t) {
    case CAS_T_Q8_0: mm_quant_lanes(CAS_T_Q8_0, w, rb, r0, nr, rows, n, x8, m, y, tile); break;
    case CAS_T_Q4_0: mm_quant_lanes(CAS_T_Q4_0, w, rb, r0, nr, rows, n, x8, m, y, tile); break;
    case CAS_T_Q4_1: mm_quant_lanes(CAS_T_Q4_1, w, rb, r0, nr, rows, n, x8, m, y, tile); break;
    default: break;
    }
}

/* ---- batched: float weights -------------------------------------------- */

static inline __attribute__((always_inline)) void mm_ftile(const int nt, const float *const *wr,
                                                           int64_t n, const float *x0,
                                                           const float *x1, float out[R][2]) {
    __m256 acc[R][2];
#pragma GCC unroll 4
    for (int j = 0; j < R; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 xa = _mm256_loadu_ps(x0 + i);
        __m256 xb = nt > 1 ? _mm256_loadu_ps(x1 + i) : xa;
#pragma GCC unroll 4
        for (int j = 0; j < R; j++) {
            __m256 wv = _mm256_loadu_ps(wr[j] + i);
            acc[j][0] = _mm256_fmadd_ps(wv, xa, acc[j][0]);
            if (nt > 1) acc[j][1] = _mm256_fmadd_ps(wv, xb, acc[j][1]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < R; j++) {
        float s0 = hsum8(acc[j][0]), s1 = nt > 1 ? hsum8(acc[j][1]) : 0;
        for (int64_t k = i; k < n; k++) {
            s0 = fmaf(wr[j][k], x0[k], s0);
            if (nt > 1) s1 = fmaf(wr[j][k], x1[k], s1);
        }
        out[j][0] = s0;
        out[j][1] = s1;
    }
}

static void mm_float(int t, const uint8_t *w, size_t rb, int64_t r0, int64_t nr, int64_t rows,
                     int64_t n, const float *x, int64_t m, float *y, float *scratch) {
    const float *wr[R];
    for (int64_t j = 0; j < R; j++) {
        if (j >= nr) {
            wr[j] = wr[0]; /* a real row; its results are dropped */
        } else if (t == CAS_T_F32) {
            wr[j] = (const float *)(const void *)(w + (size_t)(r0 + j) * rb);
        } else {
            float *d = scratch + j * n;
            const uint8_t *row = w + (size_t)(r0 + j) * rb;
            int64_t i = 0;
            for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, ld_w8(t, row, i));
            for (; i < n; i++) d[i] = ld_w1(t, row, i);
            wr[j] = d;
        }
    }
    float out[R][2];
    for (int64_t i = 0; i < m; i += 2) {
        int two = i + 1 < m;
        if (two)
            mm_ftile(2, wr, n, x + i * n, x + (i + 1) * n, out);
        else
            mm_ftile(1, wr, n, x + i * n, x + i * n, out);
        for (int k = 0; k <= two; k++)
            for (int64_t j = 0; j < nr; j++) y[(i + k) * rows + r0 + j] = out[j][k];
    }
}

void cas_q_avx2_matmul_tile(int t, const uint8_t *w, size_t rb, int64_t r0, int64_t nr, int64_t rows,
                            int64_t n, const float *xf, const cas_q8x_block *xq, const float *sx,
                            int64_t m, float *y, void *tile) {
    (void)xq, (void)sx;
    mm_float(t, w, rb, r0, nr, rows, n, xf, m, y, tile);
}

/* ---- ceilings ------------------------------------------------------------ */

/* Twelve independent chains of _mm256_maddubs_epi16 (32 int8 multiply-adds
 * each, the core of the quantized kernels), so the loop runs at the
 * instruction's throughput. Returns instructions per second of the calling
 * thread. (The f32 FMA peak is the attention core's cas_measure_fma_flops.) */
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
double cas_q_avx2_peak_maddubs(long iters) {
    const __m256i b = _mm256_set1_epi8(1);
#define DECL(i) __m256i c##i = _mm256_set1_epi8((char)(i + 1));
#define STEP(i) c##i = _mm256_maddubs_epi16(c##i, b);
#define SUM(i) acc = _mm256_add_epi16(acc, c##i);
    CHAINS(DECL)
    double t0 = cas_now_s();
    for (long it = 0; it < iters; it++) {
        CHAINS(STEP)
        __asm__("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4), "+x"(c5), "+x"(c6), "+x"(c7),
                "+x"(c8), "+x"(c9), "+x"(c10), "+x"(c11));
    }
    double dt = cas_now_s() - t0;
    __m256i acc = _mm256_setzero_si256();
    CHAINS(SUM)
    volatile int sink = _mm256_extract_epi16(acc, 0);
    (void)sink;
#undef DECL
#undef STEP
#undef SUM
    return 12.0 * (double)iters / dt;
}

#undef CHAINS

/* ---- elementwise helpers of the forward pass ------------------------------ */

/* e^x for x in lanes: Cephes' expf (range reduction by ln 2 in two parts,
 * degree-6 polynomial; within 2 ulp of the true value on [-87.3, 88.3], to
 * which x is clamped: below it the result is 2^-126 instead of a subnormal
 * or zero). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float silu1(float g) { return g / (1.0f + expf(-g)); }

void cas_q_avx2_silu_mul(const float *g, const float *u, float *h, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(g + i);
        __m256 s = _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_xor_ps(v, sign))));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) h[i] = silu1(g[i]) * u[i];
}

void cas_q_avx2_f32_to_f16(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

void cas_q_avx2_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        a0 = _mm256_fmadd_pd(lo, lo, a0);
        a1 = _mm256_fmadd_pd(hi, hi, a1);
    }
    a0 = _mm256_add_pd(a0, a1);
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a0), _mm256_extractf128_pd(a0, 1));
    double ss = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    for (int64_t k = i; k < n; k++) ss += (double)x[k] * x[k];
    float s = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    __m256 sv = _mm256_set1_ps(s);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sv), _mm256_loadu_ps(w + i)));
    for (; i < n; i++) out[i] = x[i] * s * w[i];
}

/* Adjacent pairs (a, b) of the first n_rot elements of each of `heads` rows of
 * head_dim floats become (a cos - b sin, b cos + a sin), cs holding (cos, sin)
 * per pair: each output one FMA over a rounded product, a * cos + (-b sin)
 * and b * cos + a sin. 256-bit vectors, so the single-token path (AVX2
 * otherwise) runs no 512-bit instruction for it. */
void cas_q_avx2_rope(float *x, int32_t heads, int32_t head_dim, int32_t n_rot, const float *cs) {
    const int32_t nv = n_rot / 8; /* whole vectors of 4 pairs */
    const __m256 neg_even = _mm256_setr_ps(-0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f, -0.0f, 0.0f);
    for (int32_t v = 0; v < nv; v++) {
        __m256 t = _mm256_loadu_ps(cs + 8 * v);
        __m256 co = _mm256_moveldup_ps(t);                        /* cos of each pair, twice */
        __m256 si = _mm256_xor_ps(_mm256_movehdup_ps(t), neg_even); /* (-sin, sin) */
        for (int32_t h = 0; h < heads; h++) {
            float *p = x + (size_t)h * (size_t)head_dim + 8 * v;
            __m256 a = _mm256_loadu_ps(p);
            __m256 b = _mm256_permute_ps(a, 0xB1); /* (b, a) of each pair */
            _mm256_storeu_ps(p, _mm256_fmadd_ps(a, co, _mm256_mul_ps(b, si)));
        }
    }
    for (int32_t h = 0; h < heads; h++) { /* pairs past the last whole vector */
        float *p = x + (size_t)h * (size_t)head_dim;
        for (int32_t i = 4 * nv; i < n_rot / 2; i++) {
            float c = cs[2 * i], sn = cs[2 * i + 1], a = p[2 * i], b = p[2 * i + 1];
            p[2 * i] = fmaf(a, c, b * -sn);
            p[2 * i + 1] = fmaf(b, c, a * sn);
        }
    }
}
