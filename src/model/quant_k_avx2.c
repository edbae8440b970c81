/*
 * quant_k_avx2.c: AVX2+FMA+F16C kernels of the K-quant, IQ4 and Q5 types
 * (compiled with -mavx2 -mfma -mf16c; quant_k.c calls them only after the
 * CPU check).
 *
 * Matrix-vector (and batches of fewer than CAS_QK_LANE_MIN_M tokens): eight
 * weight rows go together, one row per f32 lane. Per super-block each row's
 * integer dot product with x is computed in eight int32 partial sums
 * (unsigned weight codes times signed x bytes by _mm256_maddubs_epi16, the
 * sub-block scale applied by _mm256_madd_epi16 against the scale broadcast
 * to 16-bit lanes), the eight rows' partial sums are reduced and transposed
 * into one vector by three rounds of _mm256_hadd_epi32 (integer adds: exact,
 * so the order is free), and one FMA per super-block (two with a minimum)
 * advances eight rows' f32 chains at once. Each lane's chain is the portable
 * code's, so the results are the same bits (quant_k.h).
 *
 * Batched: eight tokens in the lanes instead (see "tokens in lanes" below),
 * with a tile of rows decoded once; again the canonical chain per lane.
 *
 * Q5_0's values (code - 16) are computed as codes 0..31 and 16 times the
 * block's x sum taken off the integer sum afterwards (the same integer).
 *
 * Overflow: maddubs adds two products into int16: codes below 64 times
 * |x| <= 127 give at most 16002, and for the IQ4 tables' signed values
 * (magnitude moved onto the unsigned operand, sign onto x) 2 * 127 * 127 =
 * 32258 < 32767. madd by a scale of at most 128 stays far below 2^31.
 */
#include "quant_k.h"

#include <immintrin.h>
#include <string.h>

/* ---- activations ---------------------------------------------------------- */

/* len (a multiple of 32) floats to 8 bits, exactly as quant_x_block in
 * quant_k.c: the same f32 operations per element (max is exact in any order,
 * then one multiply or divide and round to nearest even). Returns d; bsum,
 * when given, gets the sums of each 16 elements. */
static float quant_x_block(const float *x, int len, int8_t *q, int16_t *bsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 am = _mm256_setzero_ps();
    for (int i = 0; i < len; i += 8) am = _mm256_max_ps(am, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h), d = amax / 127.0f;
    const int mul = amax >= 0x1p-120f;
    const __m256 f = _mm256_set1_ps(mul ? 127.0f / amax : d);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (int i = 0; i < len; i += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) {
            __m256 a = _mm256_loadu_ps(x + i + 8 * k);
            a = mul ? _mm256_mul_ps(a, f) : d != 0 ? _mm256_div_ps(a, f) : _mm256_setzero_ps();
            v[k] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(a), lo), hi);
        }
        if (bsum) {
            __m256i s0 = _mm256_add_epi32(v[0], v[1]), s1 = _mm256_add_epi32(v[2], v[3]);
            __m256i s = _mm256_hadd_epi32(s0, s1); /* [s0 01 23, s1 01 23 | s0 45 67, s1 45 67] */
            s = _mm256_hadd_epi32(s, s);
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            bsum[i / 16] = (int16_t)_mm_cvtsi128_si32(t);
            bsum[i / 16 + 1] = (int16_t)_mm_extract_epi32(t, 1);
        }
        /* packs interleave 128-bit lanes; the permutation restores element order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(void *)(q + i), p);
    }
    return d;
}

void cas_qk_avx2_quantize_x(int t, const float *x, int64_t n, void *buf) {
    if (cas_qk_b32(t)) {
        cas_q8b_block *o = buf;
        for (int64_t b = 0; b < n / 32; b++) {
            int16_t bs[2];
            memset(o[b].pad, 0, sizeof o[b].pad);
            o[b].d = quant_x_block(x + 32 * b, 32, o[b].q, bs);
            o[b].s = (int32_t)bs[0] + bs[1];
        }
        return;
    }
    cas_q8k_block *o = buf;
    for (int64_t b = 0; b < n / CAS_QK_SUPER; b++) {
        memset(o[b].pad, 0, sizeof o[b].pad);
        o[b].d = quant_x_block(x + CAS_QK_SUPER * b, CAS_QK_SUPER, o[b].q, o[b].bsum);
    }
}

/* ---- helpers ------------------------------------------------------------- */

#define LDU(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The f16 at byte offset off of each of the eight rows' blocks, as f32. */
static inline __m256 ld_f16x8(const uint8_t *const *p, size_t off) {
    uint16_t h[8];
    for (int r = 0; r < 8; r++) memcpy(&h[r], p[r] + off, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)h));
}

/* Eight vectors of eight int32 to one: lane r = the sum of a[r]'s lanes. */
static inline __m256i hsum_rows(__m256i a0, __m256i a1, __m256i a2, __m256i a3, __m256i a4, __m256i a5,
                                __m256i a6, __m256i a7) {
    __m256i c0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
    __m256i c1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a4, a5), _mm256_hadd_epi32(a6, a7));
    return _mm256_add_epi32(_mm256_permute2x128_si256(c0, c1, 0x20), _mm256_permute2x128_si256(c0, c1, 0x31));
}

/* Eight vectors of four int32 (one per row) to one: lane r = a[r]'s sum. */
static inline __m256i hsum_rows4(const __m128i *a) {
    __m256i h0 = _mm256_hadd_epi32(_mm256_set_m128i(a[1], a[0]), _mm256_set_m128i(a[3], a[2]));
    __m256i h1 = _mm256_hadd_epi32(_mm256_set_m128i(a[5], a[4]), _mm256_set_m128i(a[7], a[6]));
    /* [r0 r2 r4 r6 | r1 r3 r5 r7] */
    return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h0, h1), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Shuffle masks that broadcast 16-bit element k of each 128-bit lane to the
 * whole lane (bcast16[k]), or element 2k to the low lane and 2k + 1 to the
 * high lane (pair16[k]: the two 16-element sub-blocks of a 32-byte chunk). */
static inline __m256i bcast16(int k) { return _mm256_set1_epi16((short)(((2 * k + 1) << 8) | (2 * k))); }
static inline __m256i pair16(int k) {
    __m128i a = _mm_set1_epi16((short)(((4 * k + 1) << 8) | (4 * k)));
    __m128i b = _mm_set1_epi16((short)(((4 * k + 3) << 8) | (4 * k + 2)));
    return _mm256_set_m128i(b, a);
}

/* maddubs of signed weights w with x: |w| unsigned, the sign moved onto x. */
static inline __m256i maddubs_signed(__m256i w, __m256i x) {
    return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}

/* 16 nibbles of a 16-byte group: low nibbles (elements 0..15) in the low
 * lane, high nibbles (16..31) in the high lane. */
static inline __m256i nibbles16(const uint8_t *p) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)p));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(15));
}

/* Byte l = 16 where bit l of qh is set, else 0: the fifth bits of a Q5
 * block's 32 codes, in element order (byte l tests bit l % 8 of byte l / 8). */
static inline __m256i q5_high(uint32_t qh) {
    const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), sel), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

/* The 32 codes 0..31 of the Q5 block whose qh is at p and qs at p + 4. */
static inline __m256i q5_codes(const uint8_t *p) {
    uint32_t qh;
    memcpy(&qh, p, 4);
    return _mm256_or_si256(nibbles16(p + 4), q5_high(qh));
}

/* ---- one row, one super-block: eight int32 partial sums -------------------
 * Each returns the partial sums of sum_j sc_j * (codes . x)_j (the offsets of
 * Q6_K and Q3_K included); the types with a minimum also give
 * sum_j mn_j * (sum of x)_j through *imin (Q4_K, Q5_K: four partial sums;
 * Q2_K: eight). */

static inline __m256i dot_q4k_q5k(const int t, const uint8_t *blk, const cas_q8k_block *xb, __m128i bs32,
                                  __m128i *imin) {
    const uint32_t w0 = rd32(blk + 4), w1 = rd32(blk + 8), w2 = rd32(blk + 12);
    const uint32_t sc_lo = w0 & 0x3f3f3f3fu, mn_lo = w1 & 0x3f3f3f3fu;
    const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
    const uint32_t mn_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
    const __m256i sm = _mm256_cvtepu8_epi16(_mm_set_epi32((int)mn_hi, (int)mn_lo, (int)sc_hi, (int)sc_lo));
    *imin = _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), bs32);
    const __m256i sc = _mm256_permute2x128_si256(sm, sm, 0x00);
    const __m256i m4 = _mm256_set1_epi8(15);
    const uint8_t *qs = blk + (t == CAS_T_Q5_K ? 48 : 16);
    __m256i hb = t == CAS_T_Q5_K ? LDU(blk + 16) : _mm256_setzero_si256();
    __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        const __m256i v = LDU(qs + 32 * c);
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (t == CAS_T_Q5_K) { /* bit 2c of qh[l] for the low half, bit 2c + 1 for the high */
            const __m256i b4 = _mm256_set1_epi8(16);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), b4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 3), b4));
            hb = _mm256_srli_epi16(hb, 2);
        }
        const __m256i p0 = _mm256_maddubs_epi16(lo, LDU(xb->q + 64 * c));
        const __m256i p1 = _mm256_maddubs_epi16(hi, LDU(xb->q + 64 * c + 32));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p0, _mm256_shuffle_epi8(sc, bcast16(2 * c))));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p1, _mm256_shuffle_epi8(sc, bcast16(2 * c + 1))));
    }
    return acc;
}

static inline __m256i dot_q6k(const uint8_t *blk, const cas_q8k_block *xb) {
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(blk + 192)));
    /* codes are value + 32: subtract 32 * sum_j sc_j * bsum_j */
    const __m256i off = _mm256_madd_epi16(sc, LDU(xb->bsum));
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    __m256i acc = _mm256_setzero_si256();
    const __m256i s_lo = _mm256_permute2x128_si256(sc, sc, 0x00), s_hi = _mm256_permute2x128_si256(sc, sc, 0x11);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i s = h ? s_hi : s_lo;
        const __m256i qh = LDU(blk + 128 + 32 * h), l0 = LDU(blk + 64 * h), l1 = LDU(blk + 64 * h + 32);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            const __m256i p = _mm256_maddubs_epi16(q[g], LDU(xb->q + 128 * h + 32 * g));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_shuffle_epi8(s, pair16(g))));
        }
    }
    return _mm256_sub_epi32(acc, _mm256_slli_epi32(off, 5));
}

static inline __m256i dot_q3k(const uint8_t *blk, const cas_q8k_block *xb) {
    const uint32_t w0 = rd32(blk + 96), w1 = rd32(blk + 100), w2 = rd32(blk + 104);
    const uint32_t k4 = 0x0f0f0f0fu, k2 = 0x03030303u;
    const __m128i raw = _mm_set_epi32((int)(((w1 >> 4) & k4) | ((w2 >> 6) & k2) << 4),
                                      (int)(((w0 >> 4) & k4) | ((w2 >> 4) & k2) << 4),
                                      (int)((w1 & k4) | ((w2 >> 2) & k2) << 4), (int)((w0 & k4) | (w2 & k2) << 4));
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_sub_epi8(raw, _mm_set1_epi8(32)));
    /* codes are value + 4: subtract 4 * sum_j sc_j * bsum_j */
    const __m256i off = _mm256_madd_epi16(sc, LDU(xb->bsum));
    const __m256i m3 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
    __m256i hm = LDU(blk), acc = _mm256_setzero_si256();
    const __m256i s_lo = _mm256_permute2x128_si256(sc, sc, 0x00), s_hi = _mm256_permute2x128_si256(sc, sc, 0x11);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i s = h ? s_hi : s_lo;
        __m256i qs = LDU(blk + 32 + 32 * h);
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            const __m256i q = _mm256_or_si256(_mm256_and_si256(qs, m3), _mm256_and_si256(_mm256_slli_epi16(hm, 2), b2));
            qs = _mm256_srli_epi16(qs, 2);
            hm = _mm256_srli_epi16(hm, 1);
            const __m256i p = _mm256_maddubs_epi16(q, LDU(xb->q + 128 * h + 32 * g));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_shuffle_epi8(s, pair16(g))));
        }
    }
    return _mm256_sub_epi32(acc, _mm256_slli_epi32(off, 2));
}

static inline __m256i dot_q2k(const uint8_t *blk, const cas_q8k_block *xb, __m256i *imin) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)blk), m4 = _mm_set1_epi8(15);
    const __m256i sc = _mm256_cvtepu8_epi16(_mm_and_si128(v, m4));
    *imin = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), m4)), LDU(xb->bsum));
    const __m256i m3 = _mm256_set1_epi8(3);
    __m256i acc = _mm256_setzero_si256();
    const __m256i s_lo = _mm256_permute2x128_si256(sc, sc, 0x00), s_hi = _mm256_permute2x128_si256(sc, sc, 0x11);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i s = h ? s_hi : s_lo;
        __m256i qs = LDU(blk + 16 + 32 * h);
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            const __m256i p = _mm256_maddubs_epi16(_mm256_and_si256(qs, m3), LDU(xb->q + 128 * h + 32 * g));
            qs = _mm256_srli_epi16(qs, 2);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_shuffle_epi8(s, pair16(g))));
        }
    }
    return acc;
}

static inline __m256i dot_iq4xs(const uint8_t *blk, const cas_q8k_block *xb, __m256i table) {
    const uint32_t sh = (uint32_t)blk[2] | (uint32_t)blk[3] << 8, sl = rd32(blk + 4);
    int16_t s16[8];
    for (int j = 0; j < 8; j++) s16[j] = (int16_t)((((sl >> (4 * j)) & 15) | ((sh >> (2 * j)) & 3) << 4) - 32);
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)s16));
    __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256i wv = _mm256_shuffle_epi8(table, nibbles16(blk + 8 + 16 * j));
        const __m256i p = maddubs_signed(wv, LDU(xb->q + 32 * j));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_shuffle_epi8(sc, bcast16(j))));
    }
    return acc;
}

/* ---- eight rows, one token ------------------------------------------------
 * out[r] = W[p[r]] . x for the eight rows p[0..7] (repeated pointers for a
 * partial group: their lanes are dropped by the caller). pf, when not NULL,
 * is the start of the next group: its bytes are prefetched at the pace this
 * group is read, as each row is too short for the hardware prefetchers. */
static inline __attribute__((always_inline)) void group8(const int t, const uint8_t *const *p, int64_t n,
                                                         const uint8_t *xq, const uint8_t *pf, float *out) {
    const size_t bb = (size_t)cas_ttype_block_bytes(t);
    __m256 acc = _mm256_setzero_ps();
    if (cas_qk_b32(t)) {
        const cas_q8b_block *xb = (const cas_q8b_block *)(const void *)xq;
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)cas_qk_iq4_values));
        const __m256i ones = _mm256_set1_epi16(1);
        const size_t qho = t == CAS_T_Q5_1 ? 4 : 2;  /* Q5: qh, then qs */
        const size_t pfl = (4 * 8 * bb + 63) / 64; /* cache lines of the next group per 4 blocks */
        const uint8_t *q[8];
        for (int r = 0; r < 8; r++) q[r] = p[r];
        for (int64_t b = 0; b < n / 32; b++) {
            if (pf && (b & 3) == 0)
                for (size_t k = 0; k < pfl; k++) _mm_prefetch((const char *)pf + (size_t)b * 8 * bb + 64 * k, _MM_HINT_T0);
            const __m256i x = LDU(xb[b].q);
            const __m256 dx = _mm256_set1_ps(xb[b].d);
            __m256i s[8];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++)
                s[r] = t == CAS_T_IQ4_NL
                           ? _mm256_madd_epi16(maddubs_signed(_mm256_shuffle_epi8(table, nibbles16(q[r] + 2)), x), ones)
                           : _mm256_madd_epi16(_mm256_maddubs_epi16(q5_codes(q[r] + qho), x), ones);
            __m256i is = hsum_rows(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]);
            if (t == CAS_T_Q5_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(16 * xb[b].s));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(ld_f16x8(q, 0), dx), acc);
            if (t == CAS_T_Q5_1)
                acc = _mm256_fmadd_ps(_mm256_set1_ps((float)xb[b].s), _mm256_mul_ps(ld_f16x8(q, 2), dx), acc);
            for (int r = 0; r < 8; r++) q[r] += bb;
        }
        _mm256_storeu_ps(out, acc);
        return;
    }
    const cas_q8k_block *xb = (const cas_q8k_block *)(const void *)xq;
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)cas_qk_iq4_values));
    const size_t doff = t == CAS_T_Q6_K ? 208 : t == CAS_T_Q3_K ? 108 : t == CAS_T_Q2_K ? 80 : 0;
    /* Cache lines of the next group per super-block, issued an eighth before
     * each row's dot product: at once, Q6_K's 27 lines (more than the L1's
     * outstanding misses) stalled the loads behind them and the matrix-vector
     * product ran at half speed from DRAM (576 x 1536, 2 threads: 45 -> 23-27
     * us; warm unchanged). */
    const size_t pfl = (8 * bb + 63) / 64;
#define PF_ROW(r)                                                                                \
    if (pf)                                                                                      \
        for (size_t k = (size_t)(r) * pfl / 8; k < (size_t)((r) + 1) * pfl / 8; k++)            \
            _mm_prefetch((const char *)pf + 8 * o + 64 * k, _MM_HINT_T0);
    for (int64_t b = 0; b < n / CAS_QK_SUPER; b++) {
        const cas_q8k_block *x = xb + b;
        const size_t o = (size_t)b * bb;
        __m256i s[8];
        const __m256 dx = _mm256_set1_ps(x->d);
        if (t == CAS_T_Q4_K || t == CAS_T_Q5_K) {
            const __m128i b16l = _mm_loadu_si128((const __m128i *)(const void *)x->bsum);
            const __m128i b16h = _mm_loadu_si128((const __m128i *)(const void *)(x->bsum + 8));
            const __m128i bs32 = _mm_hadd_epi16(b16l, b16h); /* sums of 32 (|.| <= 4064) */
            __m128i mn[8];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                PF_ROW(r)
                s[r] = dot_q4k_q5k(t, p[r] + o, x, bs32, &mn[r]);
            }
            const __m256i is = hsum_rows(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]), im = hsum_rows4(mn);
            const __m256 d = ld_f16x8(p, o), dmin = ld_f16x8(p, o + 2);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, dx), acc);
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(dmin, dx), acc);
        } else if (t == CAS_T_Q2_K) {
            __m256i mn[8];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                PF_ROW(r)
                s[r] = dot_q2k(p[r] + o, x, &mn[r]);
            }
            const __m256i is = hsum_rows(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]);
            const __m256i im = hsum_rows(mn[0], mn[1], mn[2], mn[3], mn[4], mn[5], mn[6], mn[7]);
            const __m256 d = ld_f16x8(p, o + 80), dmin = ld_f16x8(p, o + 82);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, dx), acc);
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(dmin, dx), acc);
        } else {
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                PF_ROW(r)
                s[r] = t == CAS_T_Q6_K ? dot_q6k(p[r] + o, x)
                       : t == CAS_T_Q3_K ? dot_q3k(p[r] + o, x)
                                         : dot_iq4xs(p[r] + o, x, table);
            }
            const __m256i is = hsum_rows(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(ld_f16x8(p, o + doff), dx), acc);
        }
    }
    _mm256_storeu_ps(out, acc);
#undef PF_ROW
}

static inline __attribute__((always_inline)) void rows_t(const int t, const uint8_t *w, size_t rb, int64_t n,
                                                         int64_t r0, int64_t r1, int64_t rows, const uint8_t *xq,
                                                         size_t xstride, int64_t m, float *y) {
    for (int64_t r = r0; r < r1; r += 8) {
        const int64_t nr = r1 - r < 8 ? r1 - r : 8;
        const uint8_t *p[8];
        for (int64_t k = 0; k < 8; k++) p[k] = w + (size_t)(r + (k < nr ? k : 0)) * rb;
        /* the next group's rows, prefetched while the first token reads this one */
        const uint8_t *pf = nr == 8 && r + 16 <= r1 ? w + (size_t)(r + 8) * rb : NULL;
        for (int64_t i = 0; i < m; i++) {
            float out[8];
            group8(t, p, n, xq + (size_t)i * xstride, i == 0 ? pf : NULL, out);
            for (int64_t k = 0; k < nr; k++) y[i * rows + r + k] = out[k];
        }
    }
}

void cas_qk_avx2_rows(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                      const uint8_t *xq, size_t xstride, int64_t m, float *y) {
    switch (t) {
    case CAS_T_Q2_K: rows_t(CAS_T_Q2_K, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q3_K: rows_t(CAS_T_Q3_K, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q4_K: rows_t(CAS_T_Q4_K, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q5_K: rows_t(CAS_T_Q5_K, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q6_K: rows_t(CAS_T_Q6_K, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_IQ4_NL: rows_t(CAS_T_IQ4_NL, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_IQ4_XS: rows_t(CAS_T_IQ4_XS, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q5_0: rows_t(CAS_T_Q5_0, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    case CAS_T_Q5_1: rows_t(CAS_T_Q5_1, w, rb, n, r0, r1, rows, xq, xstride, m, y); break;
    default: break;
    }
}

/* ---- batched: tokens in lanes ---------------------------------------------
 * For m >= CAS_QK_LANE_MIN_M tokens the eight f32 lanes hold eight tokens of
 * one weight row instead of eight rows of one token. A tile of CAS_QK_TILE
 * rows is decoded once (codes to bytes in element order, scales to 16-bit
 * pairs, d and dmin to f32) and stays in L1 while every group of eight
 * tokens uses it: four codes of a row, broadcast to all lanes, times the
 * eight tokens' four x bytes (cas_q8k8_block) give each token two 16-bit
 * partial sums per _mm256_maddubs_epi16; a sub-block's partial sums add up
 * in 16 bits as far as they cannot overflow (codes below 16: 8 * 2 * 15 *
 * 127 < 2^15; Q5_K four, Q6_K two, IQ4_XS one maddubs at a time), then one
 * _mm256_madd_epi16 by the broadcast scale widens them into the block's
 * int32 sum. The integer sums are the exact ones again, and each lane's f32
 * chain is the canonical one (d_w * d_x is the same product in either
 * order), so a token's results are the bits of its matvec. */

typedef cas_qk_tblk lt_blk;
typedef cas_qk_tblk_nl lt_nl;

static inline int32_t pack16(int a, int b) { return (int32_t)((uint32_t)(uint16_t)a | (uint32_t)(uint16_t)b << 16); }

static inline void st32(uint8_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)(void *)p, v); }

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

void cas_qk_avx2_decode(int t, const uint8_t *blk, cas_qk_tblk *o, int iq4_offset) {
    const __m256i m4 = _mm256_set1_epi8(15);
    int sc[16], mn[16];
    switch (t) {
    case CAS_T_Q4_K: case CAS_T_Q5_K: {
        const uint32_t w0 = rd32(blk + 4), w1 = rd32(blk + 8), w2 = rd32(blk + 12);
        const uint32_t s4[2] = {w0 & 0x3f3f3f3fu, (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u)};
        const uint32_t m4s[2] = {w1 & 0x3f3f3f3fu, ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u)};
        for (int j = 0; j < 8; j++) sc[j] = (s4[j / 4] >> (8 * (j % 4))) & 63, mn[j] = (m4s[j / 4] >> (8 * (j % 4))) & 63;
        const uint8_t *qs = blk + (t == CAS_T_Q5_K ? 48 : 16);
        __m256i hb = t == CAS_T_Q5_K ? LDU(blk + 16) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = LDU(qs + 32 * c);
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (t == CAS_T_Q5_K) {
                const __m256i b4 = _mm256_set1_epi8(16);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), b4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 3), b4));
                hb = _mm256_srli_epi16(hb, 2);
            }
            st32(o->c + 64 * c, lo);
            st32(o->c + 64 * c + 32, hi);
        }
        for (int j = 0; j < 8; j++) o->sc[j] = pack16(sc[j], sc[j]), o->sp[j] = pack16(mn[j], mn[j]);
        o->d = f16_at(blk), o->dmin = f16_at(blk + 2);
        break;
    }
    case CAS_T_Q6_K: {
        const __m256i m30 = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m256i qh = LDU(blk + 128 + 32 * h), l0 = LDU(blk + 64 * h), l1 = LDU(blk + 64 * h + 32);
            st32(o->c + 128 * h, _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)));
            st32(o->c + 128 * h + 32,
                 _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)));
            st32(o->c + 128 * h + 64,
                 _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30)));
            st32(o->c + 128 * h + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                      _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30)));
        }
        for (int j = 0; j < 16; j++) sc[j] = (int8_t)blk[192 + j];
        o->d = f16_at(blk + 208), o->dmin = 0;
        break;
    }
    case CAS_T_Q3_K: {
        const uint8_t *s = blk + 96;
        for (int j = 0; j < 16; j++) {
            const int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4, hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
            sc[j] = (lo | hi << 4) - 32;
        }
        const __m256i m3 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
        __m256i hm = LDU(blk);
        for (int h = 0; h < 2; h++) {
            __m256i qs = LDU(blk + 32 + 32 * h);
            for (int g = 0; g < 4; g++) {
                st32(o->c + 128 * h + 32 * g,
                     _mm256_or_si256(_mm256_and_si256(qs, m3), _mm256_and_si256(_mm256_slli_epi16(hm, 2), b2)));
                qs = _mm256_srli_epi16(qs, 2);
                hm = _mm256_srli_epi16(hm, 1);
            }
        }
        o->d = f16_at(blk + 108), o->dmin = 0;
        break;
    }
    case CAS_T_Q2_K: {
        for (int j = 0; j < 16; j++) sc[j] = blk[j] & 15, mn[j] = blk[j] >> 4;
        const __m256i m3 = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; h++) {
            __m256i qs = LDU(blk + 16 + 32 * h);
            for (int g = 0; g < 4; g++) {
                st32(o->c + 128 * h + 32 * g, _mm256_and_si256(qs, m3));
                qs = _mm256_srli_epi16(qs, 2);
            }
        }
        for (int p = 0; p < 8; p++) o->sp[p] = pack16(mn[2 * p], mn[2 * p + 1]);
        o->d = f16_at(blk + 80), o->dmin = f16_at(blk + 82);
        break;
    }
    default: { /* IQ4_XS */
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)cas_qk_iq4_values));
        const uint32_t sh = (uint32_t)blk[2] | (uint32_t)blk[3] << 8, sl = rd32(blk + 4);
        for (int j = 0; j < 8; j++) {
            sc[j] = (int)(((sl >> (4 * j)) & 15) | ((sh >> (2 * j)) & 3) << 4) - 32;
            const __m256i v = _mm256_shuffle_epi8(table, nibbles16(blk + 8 + 16 * j));
            st32(o->c + 32 * j, iq4_offset ? _mm256_xor_si256(v, _mm256_set1_epi8(-128)) : v);
        }
        o->d = f16_at(blk), o->dmin = 0;
        break;
    }
    }
    const int nsub = t == CAS_T_Q4_K || t == CAS_T_Q5_K || t == CAS_T_IQ4_XS ? 8 : 16;
    for (int j = 0; j < nsub; j++) o->sc[j] = pack16(sc[j], sc[j]);
    if (t == CAS_T_Q6_K || t == CAS_T_Q3_K)
        for (int p = 0; p < 8; p++) o->sp[p] = pack16(sc[2 * p], sc[2 * p + 1]);
}

static inline __m256i bcast32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The 16-bit sums of n (1, 2 or 4) maddubs of codes c[4i .. 4i+3], broadcast,
 * with the token vectors x[i]. */
static inline __attribute__((always_inline)) __m256i msum(const int n, const uint8_t *c, const __m256i *x) {
    __m256i p = _mm256_maddubs_epi16(bcast32(c), x[0]);
    if (n >= 2) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(bcast32(c + 4), x[1]));
    if (n >= 4) {
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(bcast32(c + 8), x[2]));
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(bcast32(c + 12), x[3]));
    }
    return p;
}

/* CAS_QK_TILE decoded rows' block b (k[j * nb]) against eight tokens' x
 * block: is[j] the int32 sum of each token (offsets included) and, for the
 * types with a minimum, im[j]. A sub-block's x vectors are loaded once into
 * registers and used by every row of the tile. */
static inline __attribute__((always_inline)) void lane_sums(const int t, const lt_blk *k, int64_t nb,
                                                            const cas_q8k8_block *x, __m256i is[CAS_QK_TILE],
                                                            __m256i im[CAS_QK_TILE]) {
    const __m256i *xq = (const __m256i *)(const void *)x->q;
#pragma GCC unroll 4
    for (int r = 0; r < CAS_QK_TILE; r++) is[r] = im[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        /* 32 elements: sub-block j of Q4_K, Q5_K, IQ4_XS; sub-blocks 2j, 2j+1 of the others */
        __m256i xv[8];
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) xv[g] = _mm256_load_si256(xq + 8 * j + g);
#pragma GCC unroll 4
        for (int r = 0; r < CAS_QK_TILE; r++) {
            const lt_blk *kr = k + r * nb;
            const uint8_t *c = kr->c + 32 * j;
            __m256i a;
            if (t == CAS_T_Q4_K) { /* codes below 16: eight maddubs fit in 16 bits */
                a = _mm256_madd_epi16(_mm256_add_epi16(msum(4, c, xv), msum(4, c + 16, xv + 4)), bcast32(&kr->sc[j]));
            } else if (t == CAS_T_Q5_K) { /* below 32: four */
                const __m256i sc = bcast32(&kr->sc[j]);
                a = _mm256_add_epi32(_mm256_madd_epi16(msum(4, c, xv), sc), _mm256_madd_epi16(msum(4, c + 16, xv + 4), sc));
            } else if (t == CAS_T_IQ4_XS) { /* signed values up to 127: one */
                const __m256i sc = bcast32(&kr->sc[j]);
                a = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int g = 0; g < 8; g++) a = _mm256_add_epi32(a, _mm256_madd_epi16(maddubs_signed(bcast32(c + 4 * g), xv[g]), sc));
            } else if (t == CAS_T_Q6_K) { /* below 64: two */
                const __m256i s0 = bcast32(&kr->sc[2 * j]), s1 = bcast32(&kr->sc[2 * j + 1]);
                a = _mm256_add_epi32(_mm256_madd_epi16(msum(2, c, xv), s0), _mm256_madd_epi16(msum(2, c + 8, xv + 2), s0));
                a = _mm256_add_epi32(a, _mm256_madd_epi16(msum(2, c + 16, xv + 4), s1));
                a = _mm256_add_epi32(a, _mm256_madd_epi16(msum(2, c + 24, xv + 6), s1));
            } else { /* Q3_K, Q2_K: below 8, a 16-element sub-block in one run */
                a = _mm256_add_epi32(_mm256_madd_epi16(msum(4, c, xv), bcast32(&kr->sc[2 * j])),
                                     _mm256_madd_epi16(msum(4, c + 16, xv + 4), bcast32(&kr->sc[2 * j + 1])));
            }
            is[r] = _mm256_add_epi32(is[r], a);
        }
    }
    if (t != CAS_T_IQ4_XS) {
        const __m256i *bs = (const __m256i *)(const void *)x->bs;
        __m256i bv[8];
#pragma GCC unroll 8
        for (int p = 0; p < 8; p++) bv[p] = _mm256_load_si256(bs + p);
#pragma GCC unroll 4
        for (int r = 0; r < CAS_QK_TILE; r++) {
            const lt_blk *kr = k + r * nb;
            __m256i o = _mm256_madd_epi16(bv[0], bcast32(&kr->sp[0]));
#pragma GCC unroll 8
            for (int p = 1; p < 8; p++) o = _mm256_add_epi32(o, _mm256_madd_epi16(bv[p], bcast32(&kr->sp[p])));
            if (t == CAS_T_Q6_K) is[r] = _mm256_sub_epi32(is[r], _mm256_slli_epi32(o, 5));
            else if (t == CAS_T_Q3_K) is[r] = _mm256_sub_epi32(is[r], _mm256_slli_epi32(o, 2));
            else im[r] = o;
        }
    }
}

/* Rows [r, r + nr) (nr <= CAS_QK_TILE) decoded in tile, against every group
 * of eight tokens in x8[ceil(m / 8)][nb]. Rows past nr are decoded as copies
 * of the first (their lanes are dropped). */
static inline __attribute__((always_inline)) void lanes_t(const int t, const uint8_t *w, size_t rb, int64_t n, int64_t r,
                                                          int64_t nr, int64_t rows, const cas_q8k8_block *x8, int64_t m,
                                                          float *y, lt_blk *tile) {
    const int64_t nb = n / CAS_QK_SUPER;
    const size_t bb = (size_t)cas_ttype_block_bytes(t);
    for (int64_t j = 0; j < CAS_QK_TILE; j++)
        for (int64_t b = 0; b < nb; b++)
            cas_qk_avx2_decode(t, w + (size_t)(r + (j < nr ? j : 0)) * rb + (size_t)b * bb, tile + j * nb + b, 0);
    const int mins = t == CAS_T_Q4_K || t == CAS_T_Q5_K || t == CAS_T_Q2_K;
    for (int64_t g = 0; g < (m + 7) / 8; g++) {
        const cas_q8k8_block *xg = x8 + g * nb;
        __m256 acc[CAS_QK_TILE];
#pragma GCC unroll 4
        for (int j = 0; j < CAS_QK_TILE; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m256i is[CAS_QK_TILE], im[CAS_QK_TILE];
            lane_sums(t, tile + b, nb, xg + b, is, im);
            const __m256 dx = _mm256_load_ps(xg[b].d);
#pragma GCC unroll 4
            for (int j = 0; j < CAS_QK_TILE; j++) {
                const lt_blk *k = tile + j * nb + b;
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[j]), _mm256_mul_ps(_mm256_set1_ps(k->d), dx), acc[j]);
                if (mins)
                    acc[j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im[j]), _mm256_mul_ps(_mm256_set1_ps(k->dmin), dx), acc[j]);
            }
        }
        const int64_t nt = m - 8 * g < 8 ? m - 8 * g : 8;
        for (int64_t j = 0; j < nr; j++) {
            float out[8];
            _mm256_storeu_ps(out, acc[j]);
            for (int64_t i = 0; i < nt; i++) y[(8 * g + i) * rows + r + j] = out[i];
        }
    }
}

void cas_qk_avx2_decode_nl(int t, const uint8_t *blk, cas_qk_tblk_nl *o, int iq4_offset) {
    if (t == CAS_T_Q8_0) { /* codes plus 128, unsigned */
        st32((uint8_t *)o->v, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(blk + 2)),
                                               _mm256_set1_epi8(-128)));
        o->d = f16_at(blk), o->m = 0;
        return;
    }
    if (t == CAS_T_Q4_0 || t == CAS_T_Q4_1) { /* the nibbles 0..15; m as quant.c's kernels take it */
        const size_t qo = t == CAS_T_Q4_1 ? 4 : 2;
        st32((uint8_t *)o->v, nibbles16(blk + qo));
        o->d = f16_at(blk), o->m = t == CAS_T_Q4_1 ? f16_at(blk + 2) : -8.0f * o->d;
        return;
    }
    if (t == CAS_T_IQ4_NL) {
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)cas_qk_iq4_values));
        const __m256i v = _mm256_shuffle_epi8(table, nibbles16(blk + 2));
        st32((uint8_t *)o->v, iq4_offset ? _mm256_xor_si256(v, _mm256_set1_epi8(-128)) : v);
        o->d = f16_at(blk), o->m = 0;
        return;
    }
    st32((uint8_t *)o->v, q5_codes(blk + (t == CAS_T_Q5_1 ? 4 : 2)));
    o->d = f16_at(blk), o->m = t == CAS_T_Q5_1 ? f16_at(blk + 2) : 0;
}

/* The lane kernel of the 32-element block types. IQ4_NL's signed values
 * against signed x take the sign trick, and each maddubs is widened at once
 * (two products of up to 127 * 127 fill 16 bits); Q5's codes below 32 add
 * four maddubs in 16 bits (4 * 2 * 31 * 127 < 2^15), and Q5_0's offset of 16
 * comes off the int32 sum. */

static inline __attribute__((always_inline)) void lanes_b32(const int t, const uint8_t *w, size_t rb, int64_t n,
                                                            int64_t r, int64_t nr, int64_t rows,
                                                            const cas_q8b8_block *x8, int64_t m, float *y, lt_nl *tile) {
    const int64_t nb = n / 32;
    const size_t bb = (size_t)cas_ttype_block_bytes(t);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t j = 0; j < CAS_QK_TILE; j++)
        for (int64_t b = 0; b < nb; b++)
            cas_qk_avx2_decode_nl(t, w + (size_t)(r + (j < nr ? j : 0)) * rb + (size_t)b * bb, tile + j * nb + b, 0);
    for (int64_t g = 0; g < (m + 7) / 8; g++) {
        const cas_q8b8_block *xg = x8 + g * nb;
        __m256 acc[CAS_QK_TILE];
#pragma GCC unroll 4
        for (int j = 0; j < CAS_QK_TILE; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m256i xv[8];
#pragma GCC unroll 8
            for (int e = 0; e < 8; e++) xv[e] = _mm256_load_si256((const __m256i *)(const void *)xg[b].q[e]);
            const __m256 dx = _mm256_load_ps(xg[b].d);
            const __m256i xs = _mm256_load_si256((const __m256i *)(const void *)xg[b].xs);
#pragma GCC unroll 4
            for (int j = 0; j < CAS_QK_TILE; j++) {
                const lt_nl *k = tile + j * nb + b;
                __m256i is;
                if (t == CAS_T_IQ4_NL) {
                    is = _mm256_madd_epi16(maddubs_signed(bcast32(k->v), xv[0]), ones);
#pragma GCC unroll 8
                    for (int e = 1; e < 8; e++)
                        is = _mm256_add_epi32(is, _mm256_madd_epi16(maddubs_signed(bcast32(k->v + 4 * e), xv[e]), ones));
                } else {
                    const uint8_t *c = (const uint8_t *)k->v;
                    is = _mm256_add_epi32(_mm256_madd_epi16(msum(4, c, xv), ones), _mm256_madd_epi16(msum(4, c + 16, xv + 4), ones));
                    if (t == CAS_T_Q5_0) is = _mm256_sub_epi32(is, _mm256_slli_epi32(xs, 4));
                }
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(_mm256_set1_ps(k->d), dx), acc[j]);
                if (t == CAS_T_Q5_1)
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(xs), _mm256_mul_ps(_mm256_set1_ps(k->m), dx), acc[j]);
            }
        }
        const int64_t nt = m - 8 * g < 8 ? m - 8 * g : 8;
        for (int64_t j = 0; j < nr; j++) {
            float out[8];
            _mm256_storeu_ps(out, acc[j]);
            for (int64_t i = 0; i < nt; i++) y[(8 * g + i) * rows + r + j] = out[i];
        }
    }
}

void cas_qk_avx2_rows_lanes(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                            const void *x8v, int64_t m, float *y, void *tile) {
    const cas_q8k8_block *x8 = x8v;
    for (int64_t r = r0; r < r1; r += CAS_QK_TILE) {
        const int64_t nr = r1 - r < CAS_QK_TILE ? r1 - r : CAS_QK_TILE;
        switch (t) {
        case CAS_T_IQ4_NL: lanes_b32(CAS_T_IQ4_NL, w, rb, n, r, nr, rows, x8v, m, y, tile); break;
        case CAS_T_Q5_0: lanes_b32(CAS_T_Q5_0, w, rb, n, r, nr, rows, x8v, m, y, tile); break;
        case CAS_T_Q5_1: lanes_b32(CAS_T_Q5_1, w, rb, n, r, nr, rows, x8v, m, y, tile); break;
        case CAS_T_Q2_K: lanes_t(CAS_T_Q2_K, w, rb, n, r, nr, rows, x8, m, y, tile); break;
        case CAS_T_Q3_K: lanes_t(CAS_T_Q3_K, w, rb, n, r, nr, rows, x8, m, y, tile); break;
        case CAS_T_Q4_K: lanes_t(CAS_T_Q4_K, w, rb, n, r, nr, rows, x8, m, y, tile); break;
        case CAS_T_Q5_K: lanes_t(CAS_T_Q5_K, w, rb, n, r, nr, rows, x8, m, y, tile); break;
        case CAS_T_Q6_K: lanes_t(CAS_T_Q6_K, w, rb, n, r, nr, rows, x8, m, y, tile); break;
        case CAS_T_IQ4_XS: lanes_t(CAS_T_IQ4_XS, w, rb, n, r, nr, rows, x8, m, y, tile); break;
        default: break;
        }
    }
}
