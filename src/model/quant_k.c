/*
 * quant_k.c: the K-quant (Q2_K .. Q6_K), IQ4 (IQ4_NL, IQ4_XS) and Q5 (Q5_0,
 * Q5_1) weight types: their block formats, round-to-nearest quantizers for tests and
 * synthetic weights, the activation quantizer they pair with, the portable
 * kernels and the threading of a matrix call (quant.c forwards here).
 *
 * The portable code works on one decoded block at a time (kblk below: the
 * f16 scales, the integer scale and minimum of each sub-block, and each
 * element's stored code), so that the nine formats share one dequantizer and
 * one dot product and differ only in how their bits are packed. It is the
 * reference for the AVX2 and AVX-512 kernels, which must give the same bits
 * (see quant_k.h: exact integer sums per block, one f32 fma chain per row
 * and token).
 */
#include "quant_k.h"

#include <math.h>
#include <omp.h>
#include <string.h>

const int8_t cas_qk_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ---- type info ---------------------------------------------------------- */

int cas_qk_type(int t) {
    switch (t) {
    case CAS_T_Q2_K: case CAS_T_Q3_K: case CAS_T_Q4_K: case CAS_T_Q5_K: case CAS_T_Q6_K:
    case CAS_T_IQ4_NL: case CAS_T_IQ4_XS: case CAS_T_Q5_0: case CAS_T_Q5_1:
        return 1;
    default:
        return 0;
    }
}

int64_t cas_qk_block_size(int t) { return cas_qk_type(t) ? cas_ttype_block_size(t) : 0; }

size_t cas_qk_block_bytes(int t) { return cas_qk_type(t) ? (size_t)cas_ttype_block_bytes(t) : 0; }

const char *cas_qk_name(int t) { return cas_qk_type(t) ? cas_ttype_name(t) : NULL; }

/* Types whose elements are d * sc * q - dmin * mn (a per-sub-block minimum),
 * or for Q5_1 d * q + m (dmin holds m, mn = 1, and the minimum is added). */
static int has_min(int t) { return t == CAS_T_Q4_K || t == CAS_T_Q5_K || t == CAS_T_Q2_K || t == CAS_T_Q5_1; }

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline void wr16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline void wr32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* ---- block formats --------------------------------------------------------
 * One block decoded: element e of sub-block j = e / (bs / nsub) is
 *     d * sc[j] * value(code[e]) - dmin * mn[j]
 * with value() the code itself (Q2_K, Q4_K, Q5_K), code - 32 (Q6_K), code -
 * 4 (Q3_K) or the IQ4 table entry. Byte layouts (offsets in bytes):
 *   Q4_K (144): f16 d @0, f16 dmin @2, scales @4 (12 bytes: 8 six-bit scales
 *     and mins), qs @16 (128). Element 64c + l (l < 32) is the low nibble of
 *     qs[32c + l], element 64c + 32 + l its high nibble. Scales: for j < 4,
 *     sc[j] = s[j] & 63, mn[j] = s[j + 4] & 63, sc[j + 4] = (s[j + 8] & 15) |
 *     (s[j] >> 6) << 4, mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4.
 *   Q5_K (176): as Q4_K with qh @16 (32) before qs @48: bit j of qh[l] is
 *     bit 4 of element 32 j + l.
 *   Q6_K (210): ql @0 (128), qh @128 (64), int8 sc[16] @192, f16 d @208.
 *     Element 128 h + 32 g + l (g < 4, l < 32): low 4 bits from the nibble
 *     g / 2 of ql[64 h + 32 (g & 1) + l], high 2 bits from bits 2g, 2g+1 of
 *     qh[32 h + l]; value = code - 32; sub-blocks of 16.
 *   Q3_K (110): hmask @0 (32), qs @32 (64), scales @96 (12), f16 d @108.
 *     Element 32 g + l: low 2 bits from bits 2 (g % 4) of qs[32 (g / 4) + l],
 *     bit 2 from bit g of hmask[l]; value = code - 4; sub-blocks of 16 with
 *     six-bit scales minus 32: low 4 bits from s[j] (j < 8, low nibble) or
 *     s[j - 8] (high nibble), high 2 bits from bits 2 (j / 4) of s[8 + j % 4].
 *   Q2_K (84): scales @0 (16: low nibble sc, high nibble mn), qs @16 (64),
 *     f16 d @80, f16 dmin @82. Element 32 g + l: bits 2 (g % 4) of
 *     qs[32 (g / 4) + l]; sub-blocks of 16.
 *   IQ4_XS (136): f16 d @0, u16 scales_h @2, scales_l @4 (4), qs @8 (128).
 *     Sub-block j (32 elements): scale ((scales_l[j / 2] >> 4 (j % 2)) & 15 |
 *     ((scales_h >> 2 j) & 3) << 4) - 32; element 32 j + l is the low nibble
 *     of qs[16 j + l] for l < 16, else the high nibble of qs[16 j + l - 16];
 *     value = cas_qk_iq4_values[code].
 *   IQ4_NL (18, a block of 32): f16 d @0, qs @2 (16) in the same nibble
 *     order; sc = 1.
 *   Q5_0 (22, a block of 32): f16 d @0, u32 qh @2, qs @6 (16): element l is
 *     the low nibble of qs[l] (l < 16) or the high nibble of qs[l - 16],
 *     with bit l of qh as its bit 4; value = code - 16; sc = 1.
 *   Q5_1 (24): f16 d @0, f16 m @2, qh @4, qs @8 as Q5_0; value = code, and
 *     the element is d * code + m (dmin = m, mn = 1, added). */

typedef struct {
    uint16_t d, dmin; /* f16 */
    int nsub;         /* sub-blocks: 8 of 32, 16 of 16, or 1 (the 32-element block types) */
    int sc[16], mn[16];
    uint8_t code[CAS_QK_SUPER];
} kblk;

static inline int k_value(int t, int code) {
    switch (t) {
    case CAS_T_Q6_K: return code - 32;
    case CAS_T_Q3_K: return code - 4;
    case CAS_T_Q5_0: return code - 16;
    case CAS_T_IQ4_NL: case CAS_T_IQ4_XS: return cas_qk_iq4_values[code];
    default: return code;
    }
}

static void k_unpack(int t, const uint8_t *p, kblk *k) {
    memset(k, 0, sizeof *k);
    switch (t) {
    case CAS_T_Q4_K: case CAS_T_Q5_K: {
        const uint8_t *s = p + 4, *qs = p + (t == CAS_T_Q5_K ? 48 : 16), *qh = p + 16;
        k->d = rd16(p), k->dmin = rd16(p + 2), k->nsub = 8;
        for (int j = 0; j < 4; j++) {
            k->sc[j] = s[j] & 63, k->mn[j] = s[j + 4] & 63;
            k->sc[j + 4] = (s[j + 8] & 15) | (s[j] >> 6) << 4;
            k->mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
        }
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                k->code[64 * c + l] = qs[32 * c + l] & 15;
                k->code[64 * c + 32 + l] = qs[32 * c + l] >> 4;
            }
        if (t == CAS_T_Q5_K)
            for (int e = 0; e < CAS_QK_SUPER; e++) k->code[e] |= (uint8_t)(((qh[e % 32] >> (e / 32)) & 1) << 4);
        break;
    }
    case CAS_T_Q6_K: {
        const uint8_t *ql = p, *qh = p + 128;
        k->d = rd16(p + 208), k->nsub = 16;
        for (int j = 0; j < 16; j++) k->sc[j] = (int8_t)p[192 + j];
        for (int e = 0; e < CAS_QK_SUPER; e++) {
            int h = e / 128, g = e % 128 / 32, l = e % 32;
            int lo = (ql[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 15, hi = (qh[32 * h + l] >> (2 * g)) & 3;
            k->code[e] = (uint8_t)(lo | hi << 4);
        }
        break;
    }
    case CAS_T_Q3_K: {
        const uint8_t *hm = p, *qs = p + 32, *s = p + 96;
        k->d = rd16(p + 108), k->nsub = 16;
        for (int j = 0; j < 16; j++) {
            int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4, hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
            k->sc[j] = (lo | hi << 4) - 32;
        }
        for (int e = 0; e < CAS_QK_SUPER; e++) {
            int g = e / 32, l = e % 32;
            k->code[e] = (uint8_t)(((qs[32 * (g / 4) + l] >> (2 * (g % 4))) & 3) | ((hm[l] >> g) & 1) << 2);
        }
        break;
    }
    case CAS_T_Q2_K: {
        const uint8_t *qs = p + 16;
        k->d = rd16(p + 80), k->dmin = rd16(p + 82), k->nsub = 16;
        for (int j = 0; j < 16; j++) k->sc[j] = p[j] & 15, k->mn[j] = p[j] >> 4;
        for (int e = 0; e < CAS_QK_SUPER; e++) {
            int g = e / 32, l = e % 32;
            k->code[e] = (uint8_t)((qs[32 * (g / 4) + l] >> (2 * (g % 4))) & 3);
        }
        break;
    }
    case CAS_T_IQ4_XS: {
        const uint16_t sh = rd16(p + 2);
        const uint8_t *sl = p + 4, *qs = p + 8;
        k->d = rd16(p), k->nsub = 8;
        for (int j = 0; j < 8; j++) {
            k->sc[j] = (((sl[j / 2] >> (4 * (j % 2))) & 15) | ((sh >> (2 * j)) & 3) << 4) - 32;
            for (int l = 0; l < 16; l++) {
                k->code[32 * j + l] = qs[16 * j + l] & 15;
                k->code[32 * j + 16 + l] = qs[16 * j + l] >> 4;
            }
        }
        break;
    }
    case CAS_T_IQ4_NL:
        k->d = rd16(p), k->nsub = 1, k->sc[0] = 1;
        for (int l = 0; l < 16; l++) k->code[l] = p[2 + l] & 15, k->code[16 + l] = p[2 + l] >> 4;
        break;
    case CAS_T_Q5_0: case CAS_T_Q5_1: {
        const int o = t == CAS_T_Q5_1 ? 2 : 0;
        const uint32_t qh = rd32(p + 2 + o);
        const uint8_t *qs = p + 6 + o;
        k->d = rd16(p), k->nsub = 1, k->sc[0] = 1;
        if (t == CAS_T_Q5_1) k->dmin = rd16(p + 2), k->mn[0] = 1;
        for (int l = 0; l < 16; l++) {
            k->code[l] = (uint8_t)((qs[l] & 15) | ((qh >> l) & 1) << 4);
            k->code[16 + l] = (uint8_t)((qs[l] >> 4) | ((qh >> (16 + l)) & 1) << 4);
        }
        break;
    }
    default: break;
    }
}

/* The inverse of k_unpack (codes, scales and minimums in range). */
static void k_pack(int t, const kblk *k, uint8_t *p) {
    memset(p, 0, cas_qk_block_bytes(t));
    switch (t) {
    case CAS_T_Q4_K: case CAS_T_Q5_K: {
        uint8_t *s = p + 4, *qs = p + (t == CAS_T_Q5_K ? 48 : 16), *qh = p + 16;
        wr16(p, k->d), wr16(p + 2, k->dmin);
        for (int j = 0; j < 4; j++) {
            s[j] = (uint8_t)((k->sc[j] & 63) | (k->sc[j + 4] >> 4) << 6);
            s[j + 4] = (uint8_t)((k->mn[j] & 63) | (k->mn[j + 4] >> 4) << 6);
            s[j + 8] = (uint8_t)((k->sc[j + 4] & 15) | (k->mn[j + 4] & 15) << 4);
        }
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                qs[32 * c + l] = (uint8_t)((k->code[64 * c + l] & 15) | (k->code[64 * c + 32 + l] & 15) << 4);
        if (t == CAS_T_Q5_K)
            for (int e = 0; e < CAS_QK_SUPER; e++) qh[e % 32] |= (uint8_t)(((k->code[e] >> 4) & 1) << (e / 32));
        break;
    }
    case CAS_T_Q6_K: {
        uint8_t *ql = p, *qh = p + 128;
        wr16(p + 208, k->d);
        for (int j = 0; j < 16; j++) p[192 + j] = (uint8_t)(int8_t)k->sc[j];
        for (int e = 0; e < CAS_QK_SUPER; e++) {
            int h = e / 128, g = e % 128 / 32, l = e % 32;
            ql[64 * h + 32 * (g & 1) + l] |= (uint8_t)((k->code[e] & 15) << (4 * (g >> 1)));
            qh[32 * h + l] |= (uint8_t)((k->code[e] >> 4) << (2 * g));
        }
        break;
    }
    case CAS_T_Q3_K: {
        uint8_t *hm = p, *qs = p + 32, *s = p + 96;
        wr16(p + 108, k->d);
        for (int j = 0; j < 16; j++) {
            int v = k->sc[j] + 32;
            s[j < 8 ? j : j - 8] |= (uint8_t)((v & 15) << (j < 8 ? 0 : 4));
            s[8 + j % 4] |= (uint8_t)((v >> 4) << (2 * (j / 4)));
        }
        for (int e = 0; e < CAS_QK_SUPER; e++) {
            int g = e / 32, l = e % 32;
            qs[32 * (g / 4) + l] |= (uint8_t)((k->code[e] & 3) << (2 * (g % 4)));
            hm[l] |= (uint8_t)((k->code[e] >> 2) << g);
        }
        break;
    }
    case CAS_T_Q2_K: {
        uint8_t *qs = p + 16;
        wr16(p + 80, k->d), wr16(p + 82, k->dmin);
        for (int j = 0; j < 16; j++) p[j] = (uint8_t)(k->sc[j] | k->mn[j] << 4);
        for (int e = 0; e < CAS_QK_SUPER; e++) {
            int g = e / 32, l = e % 32;
            qs[32 * (g / 4) + l] |= (uint8_t)(k->code[e] << (2 * (g % 4)));
        }
        break;
    }
    case CAS_T_IQ4_XS: {
        uint16_t sh = 0;
        uint8_t *sl = p + 4, *qs = p + 8;
        wr16(p, k->d);
        for (int j = 0; j < 8; j++) {
            int v = k->sc[j] + 32;
            sl[j / 2] |= (uint8_t)((v & 15) << (4 * (j % 2)));
            sh |= (uint16_t)((v >> 4) << (2 * j));
            for (int l = 0; l < 16; l++) qs[16 * j + l] = (uint8_t)(k->code[32 * j + l] | k->code[32 * j + 16 + l] << 4);
        }
        wr16(p + 2, sh);
        break;
    }
    case CAS_T_IQ4_NL:
        wr16(p, k->d);
        for (int l = 0; l < 16; l++) p[2 + l] = (uint8_t)(k->code[l] | k->code[16 + l] << 4);
        break;
    case CAS_T_Q5_0: case CAS_T_Q5_1: {
        const int o = t == CAS_T_Q5_1 ? 2 : 0;
        uint32_t qh = 0;
        wr16(p, k->d);
        if (t == CAS_T_Q5_1) wr16(p + 2, k->dmin);
        for (int l = 0; l < 32; l++) qh |= (uint32_t)(k->code[l] >> 4) << l;
        wr32(p + 2 + o, qh);
        for (int l = 0; l < 16; l++) p[6 + o + l] = (uint8_t)((k->code[l] & 15) | (k->code[16 + l] & 15) << 4);
        break;
    }
    default: break;
    }
}

void cas_qk_dequantize_row(int t, const uint8_t *src, float *dst, int64_t n) {
    const int64_t bs = cas_qk_block_size(t);
    const size_t bb = cas_qk_block_bytes(t);
    kblk k;
    for (int64_t b = 0; b < n / bs; b++, src += bb, dst += bs) {
        k_unpack(t, src, &k);
        const float d = cas_f16_to_f32(k.d), dmin = cas_f16_to_f32(k.dmin);
        const int64_t sub = bs / k.nsub;
        for (int64_t e = 0; e < bs; e++) {
            /* d * sc has at most 11 + 7 significant bits and the value 7: the
             * product is exact in f32, so only the minimum's subtraction (or
             * Q5_1's addition) rounds */
            const float a = d * (float)k.sc[e / sub], m = dmin * (float)k.mn[e / sub];
            dst[e] = t == CAS_T_Q5_1 ? a * (float)k_value(t, k.code[e]) + m : a * (float)k_value(t, k.code[e]) - m;
        }
    }
}

/* ---- quantizers (tests, synthetic weights) --------------------------------
 * Round to nearest against the stored (f16-rounded) scales. The sub-block
 * scale multipliers are rounded up in magnitude (ceil), so that a sub-block's
 * extreme value stays in range; the codes then err by at most half a step of
 * their sub-block, plus, for the minimum of the affine types, half a step of
 * dmin, and for the symmetric types one step for the value of the opposite
 * sign to the extreme (their levels are lopsided, e.g. -32..31). */

/* Index of the IQ4 table value nearest to v (ties to the lower). */
static int iq4_nearest(float v) {
    int best = 0;
    float be = fabsf(v - (float)cas_qk_iq4_values[0]);
    for (int i = 1; i < 16; i++) {
        float e = fabsf(v - (float)cas_qk_iq4_values[i]);
        if (e < be) be = e, best = i;
    }
    return best;
}

/* The value of largest magnitude among x[0..len) (the first such). */
static float vmax_of(const float *x, int len) {
    float v = 0;
    for (int i = 0; i < len; i++)
        if (fabsf(x[i]) > fabsf(v)) v = x[i];
    return v;
}

static void quant_block(int t, const float *x, uint8_t *out) {
    kblk k;
    memset(&k, 0, sizeof k);
    const int bs = (int)cas_qk_block_size(t);
    if (t == CAS_T_IQ4_NL) {
        k.nsub = 1, k.sc[0] = 1;
        k.d = cas_f32_to_f16(vmax_of(x, 32) / -127.0f);
        const float d = cas_f16_to_f32(k.d);
        for (int e = 0; e < 32; e++) k.code[e] = (uint8_t)(d != 0 ? iq4_nearest(x[e] / d) : 8);
        k_pack(t, &k, out);
        return;
    }
    if (t == CAS_T_Q5_0) { /* levels -16..15: the extreme value maps to -16 */
        k.nsub = 1, k.sc[0] = 1;
        k.d = cas_f32_to_f16(vmax_of(x, 32) / -16.0f);
        const float d = cas_f16_to_f32(k.d), id = d != 0 ? 1.0f / d : 0.0f;
        for (int e = 0; e < 32; e++) k.code[e] = (uint8_t)clampi((int)lrintf(x[e] * id) + 16, 0, 31);
        k_pack(t, &k, out);
        return;
    }
    if (t == CAS_T_Q5_1) { /* levels 0..31 over [min, max], the minimum stored first */
        float lo = x[0], hi = x[0];
        for (int e = 1; e < 32; e++) lo = fminf(lo, x[e]), hi = fmaxf(hi, x[e]);
        k.nsub = 1, k.sc[0] = 1, k.mn[0] = 1;
        k.dmin = cas_f32_to_f16(lo);
        const float m = cas_f16_to_f32(k.dmin);
        k.d = cas_f32_to_f16((hi - m) / 31.0f);
        const float d = cas_f16_to_f32(k.d), id = d != 0 ? 1.0f / d : 0.0f;
        for (int e = 0; e < 32; e++) k.code[e] = (uint8_t)clampi((int)lrintf((x[e] - m) * id), 0, 31);
        k_pack(t, &k, out);
        return;
    }
    k.nsub = t == CAS_T_Q4_K || t == CAS_T_Q5_K || t == CAS_T_IQ4_XS ? 8 : 16;
    const int sub = bs / k.nsub;
    float scl[16], mnv[16], smax = 0, mmax = 0;
    if (has_min(t)) {
        /* affine: x = step * code - off over [min(0, lo), hi] */
        const int levels = t == CAS_T_Q4_K ? 15 : t == CAS_T_Q5_K ? 31 : 3, sm = t == CAS_T_Q2_K ? 15 : 63;
        for (int j = 0; j < k.nsub; j++) {
            float lo = 0, hi = x[j * sub];
            for (int i = 0; i < sub; i++) lo = fminf(lo, x[j * sub + i]), hi = fmaxf(hi, x[j * sub + i]);
            scl[j] = (hi - lo) / (float)levels, mnv[j] = -lo;
            smax = fmaxf(smax, scl[j]), mmax = fmaxf(mmax, mnv[j]);
        }
        k.d = cas_f32_to_f16(smax / (float)sm), k.dmin = cas_f32_to_f16(mmax / (float)sm);
        const float d = cas_f16_to_f32(k.d), dmin = cas_f16_to_f32(k.dmin);
        for (int j = 0; j < k.nsub; j++) {
            k.sc[j] = d > 0 ? clampi((int)ceilf(scl[j] / d), 0, sm) : 0;
            k.mn[j] = dmin > 0 ? clampi((int)lrintf(mnv[j] / dmin), 0, sm) : 0;
            const float step = d * (float)k.sc[j], off = dmin * (float)k.mn[j];
            for (int i = 0; i < sub; i++)
                k.code[j * sub + i] = (uint8_t)(step > 0 ? clampi((int)lrintf((x[j * sub + i] + off) / step), 0, levels) : 0);
        }
    } else {
        /* symmetric: the extreme value maps to the most negative level */
        const int qlo = t == CAS_T_Q6_K ? -32 : t == CAS_T_Q3_K ? -4 : -127;
        const int qhi = t == CAS_T_Q6_K ? 31 : 3, sm = t == CAS_T_Q6_K ? 127 : 31;
        for (int j = 0; j < k.nsub; j++) {
            scl[j] = vmax_of(x + j * sub, sub) / (float)qlo;
            smax = fmaxf(smax, fabsf(scl[j]));
        }
        k.d = cas_f32_to_f16(smax / (float)sm);
        const float d = cas_f16_to_f32(k.d);
        for (int j = 0; j < k.nsub; j++) {
            int mag = d > 0 ? clampi((int)ceilf(fabsf(scl[j]) / d), 0, sm) : 0;
            k.sc[j] = scl[j] < 0 ? -mag : mag;
            const float step = d * (float)k.sc[j];
            for (int i = 0; i < sub; i++) {
                const float v = step != 0 ? x[j * sub + i] / step : 0;
                k.code[j * sub + i] = (uint8_t)(t == CAS_T_IQ4_XS ? iq4_nearest(v) : clampi((int)lrintf(v), qlo, qhi) - qlo);
            }
        }
    }
    k_pack(t, &k, out);
}

void cas_qk_quantize_row(int t, const float *x, uint8_t *dst, int64_t n) {
    const int64_t bs = cas_qk_block_size(t);
    const size_t bb = cas_qk_block_bytes(t);
    for (int64_t b = 0; b < n / bs; b++) quant_block(t, x + b * bs, dst + (size_t)b * bb);
}

/* ---- activations -------------------------------------------------------- */

size_t cas_qk_x_bytes(int t, int64_t n) {
    return cas_qk_b32(t) ? (size_t)(n / 32) * sizeof(cas_q8b_block)
                             : (size_t)(n / CAS_QK_SUPER) * sizeof(cas_q8k_block);
}

/* len floats to 8 bits against d = amax / 127. x * (127 / amax) is rounded to
 * nearest even, as the AVX2 code does (the same f32 operations); below
 * amax = 2^-120 the reciprocal could overflow, so those blocks divide by d. */
static float quant_x_block(const float *x, int len, int8_t *q) {
    float amax = 0;
    for (int i = 0; i < len; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f;
    if (amax >= 0x1p-120f) {
        const float id = 127.0f / amax;
        for (int i = 0; i < len; i++) q[i] = (int8_t)clampi((int)lrintf(x[i] * id), -127, 127);
    } else {
        for (int i = 0; i < len; i++) q[i] = (int8_t)(d != 0 ? clampi((int)lrintf(x[i] / d), -127, 127) : 0);
    }
    return d;
}

static void quantize_x_generic(int t, const float *x, int64_t n, void *buf) {
    if (cas_qk_b32(t)) {
        cas_q8b_block *o = buf;
        for (int64_t b = 0; b < n / 32; b++) {
            memset(o[b].pad, 0, sizeof o[b].pad);
            o[b].d = quant_x_block(x + 32 * b, 32, o[b].q);
            int32_t s = 0;
            for (int i = 0; i < 32; i++) s += o[b].q[i];
            o[b].s = s;
        }
        return;
    }
    cas_q8k_block *o = buf;
    for (int64_t b = 0; b < n / CAS_QK_SUPER; b++) {
        memset(o[b].pad, 0, sizeof o[b].pad);
        o[b].d = quant_x_block(x + CAS_QK_SUPER * b, CAS_QK_SUPER, o[b].q);
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += o[b].q[16 * k + i];
            o[b].bsum[k] = (int16_t)s;
        }
    }
}

void cas_qk_quantize_x(int t, const float *x, int64_t n, void *buf, int level) {
    if (level >= 1)
        cas_qk_avx2_quantize_x(t, x, n, buf);
    else
        quantize_x_generic(t, x, n, buf);
}

/* ---- portable kernels ----------------------------------------------------
 * Integer sums: |value| <= 127 and |q| <= 127, so a sub-block's dot is below
 * 32 * 127^2 and a super-block's scaled sum below 2^28 for every format (the
 * largest, Q6_K: 16 sub-blocks * |sc| 128 * 16 elements * |v| 32 * 127). */

/* Block b of one weight row (decoded) against the same block of one token's x:
 * the exact integer sums. */
static inline void block_sums(int t, const kblk *k, const void *xq, int64_t b, int32_t *isum, int32_t *imin) {
    if (cas_qk_b32(t)) {
        const cas_q8b_block *xb = (const cas_q8b_block *)xq + b;
        int32_t s = 0, xs = 0;
        for (int e = 0; e < 32; e++) s += k_value(t, k->code[e]) * xb->q[e], xs += xb->q[e];
        *isum = s, *imin = k->mn[0] * xs;
        return;
    }
    const cas_q8k_block *xb = (const cas_q8k_block *)xq + b;
    const int sub = CAS_QK_SUPER / k->nsub;
    int32_t is = 0, im = 0;
    for (int j = 0; j < k->nsub; j++) {
        int32_t dot = 0, xs = 0;
        for (int i = j * sub; i < (j + 1) * sub; i++) dot += k_value(t, k->code[i]) * xb->q[i];
        for (int h = j * sub / 16; h < (j + 1) * sub / 16; h++) xs += xb->bsum[h];
        is += k->sc[j] * dot;
        im += k->mn[j] * xs;
    }
    *isum = is, *imin = im;
}

/* One step of the canonical chain (quant_k.h) for block b of x. */
static inline float chain_step(int t, const kblk *k, const void *xq, int64_t b, int32_t isum, int32_t imin, float s) {
    const float dx = cas_qk_b32(t) ? ((const cas_q8b_block *)xq)[b].d : ((const cas_q8k_block *)xq)[b].d;
    s = fmaf((float)isum, cas_f16_to_f32(k->d) * dx, s);
    if (t == CAS_T_Q5_1) s = fmaf((float)imin, cas_f16_to_f32(k->dmin) * dx, s);
    else if (has_min(t)) s = fmaf((float)imin, -(cas_f16_to_f32(k->dmin) * dx), s);
    return s;
}

/* Rows [r0, r1) against m tokens (token i's x at xq + i * xs bytes) into
 * Y[m][rows]: each block is decoded once and advances every token's chain,
 * so each token sees the same operations as alone. acc: m floats. */
static void rows_generic(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                         const uint8_t *xq, size_t xs, int64_t m, float *y, float *acc) {
    const int64_t bs = cas_qk_block_size(t), nb = n / bs;
    const size_t bb = cas_qk_block_bytes(t);
    kblk k;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t i = 0; i < m; i++) acc[i] = 0;
        for (int64_t b = 0; b < nb; b++) {
            k_unpack(t, w + (size_t)r * rb + (size_t)b * bb, &k);
            for (int64_t i = 0; i < m; i++) {
                int32_t isum, imin;
                block_sums(t, &k, xq + (size_t)i * xs, b, &isum, &imin);
                acc[i] = chain_step(t, &k, xq + (size_t)i * xs, b, isum, imin, acc[i]);
            }
        }
        for (int64_t i = 0; i < m; i++) y[i * rows + r] = acc[i];
    }
}

void cas_qk_matvec_range(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1,
                         const void *buf, float *y, int level) {
    if (r1 <= r0) return;
    if (level >= 2) {
        cas_qk_avx512_rows(t, w, rb, n, r0, r1, r1, buf, 0, 1, y);
        return;
    }
    if (level >= 1) {
        cas_qk_avx2_rows(t, w, rb, n, r0, r1, r1, buf, 0, 1, y);
        return;
    }
    float acc;
    rows_generic(t, w, rb, n, r0, r1, r1, buf, 0, 1, y, &acc);
}

/* ---- matrix call ----------------------------------------------------------- */

static size_t align64(size_t v) { return (v + 63) & ~(size_t)63; }

_Static_assert(sizeof(cas_qk_tblk) == CAS_QK_TILE_BLOCK_BYTES, "decoded block size");
_Static_assert(sizeof(cas_qk_tblk_nl) == CAS_QK_TILE_BLOCK_BYTES_NL, "decoded 32-element block size");
_Static_assert(sizeof(cas_q8b_block) == 64 && sizeof(cas_q8b8_block) == 320 && sizeof(cas_q8b16_block) == 640,
               "32-element activation block sizes");

int cas_qk_avx512_available(void) {
    return cas_cpu_features_get()->avx512 && cas_cpu_features_get()->avx2 && __builtin_cpu_supports("avx512vnni");
}

/* Workspace: xq[m] (each token's x) | acc[nt][m] (portable) | for the
 * token-lane kernels x8[ceil(m / 8)][nb] or x16[ceil(m / 16)][nb] |
 * tile[nt]. */

/* Token lanes: 16 (AVX-512), 8 (AVX2) or none (row kernels). */
static int lanes_for(int t, int64_t m, int level) {
    if (level >= 2 && m <= (cas_qk_b32(t) ? CAS_Q_FEW_MAX_M : CAS_QK_FEW_MAX_M)) return 0; /* row kernels */
    return level >= 2 && m >= CAS_QK_LANE16_MIN_M ? 16 : level >= 1 && m >= CAS_QK_LANE_MIN_M ? 8 : 0;
}

static size_t tile_bytes(int t, int64_t n) {
    return cas_qk_b32(t) ? align64((size_t)CAS_QK_TILE * (size_t)(n / 32) * CAS_QK_TILE_BLOCK_BYTES_NL)
                             : align64((size_t)CAS_QK_TILE * (size_t)(n / CAS_QK_SUPER) * CAS_QK_TILE_BLOCK_BYTES);
}

/* Bytes of one token group's block of x in the lane layout (8 or 16 lanes). */
static size_t lane_block_bytes(int t, int lanes) {
    if (lanes == 16) return cas_qk_b32(t) ? sizeof(cas_q8b16_block) : sizeof(cas_q8k16_block);
    return cas_qk_b32(t) ? sizeof(cas_q8b8_block) : sizeof(cas_q8k8_block);
}

static size_t lanes_x_bytes(int t, int64_t n, int64_t m, int lanes) {
    return align64((size_t)((m + lanes - 1) / lanes) * (size_t)(n / cas_qk_block_size(t)) * lane_block_bytes(t, lanes));
}

size_t cas_qk_work_bytes(int t, int64_t n, int64_t m, int nt) {
    size_t b = align64((size_t)m * cas_qk_x_bytes(t, n)) + (size_t)nt * align64((size_t)m * sizeof(float)) + 64;
    if (m >= CAS_QK_LANE_MIN_M) {
        size_t x8 = lanes_x_bytes(t, n, m, 8), x16 = lanes_x_bytes(t, n, m, 16);
        b += (x8 > x16 ? x8 : x16) + (size_t)nt * tile_bytes(t, n);
    }
    return b;
}

/* Block b of tokens [16 g, 16 g + k) (k <= 16) into the 16-lane layout. */
static void pack_x16(int t, const uint8_t *xq, size_t xs, int64_t g, int64_t k, int64_t b, void *out) {
    if (cas_qk_b32(t)) {
        cas_q8b16_block *o = out;
        memset(o, 0, sizeof *o);
        for (int64_t i = 0; i < k; i++) {
            const cas_q8b_block *x = (const cas_q8b_block *)(const void *)(xq + (size_t)(16 * g + i) * xs) + b;
            for (int e = 0; e < 8; e++) memcpy(o->q[e] + 4 * i, x->q + 4 * e, 4);
            o->xs[i] = x->s;
            o->d[i] = x->d;
        }
        return;
    }
    cas_q8k16_block *o = out;
    memset(o, 0, sizeof *o);
    for (int64_t i = 0; i < k; i++) {
        const cas_q8k_block *x = (const cas_q8k_block *)(const void *)(xq + (size_t)(16 * g + i) * xs) + b;
        for (int e = 0; e < 64; e++) memcpy(o->q[e] + 4 * i, x->q + 4 * e, 4);
        for (int p = 0; p < 8; p++) {
            o->bs[p][2 * i] = x->bsum[2 * p], o->bs[p][2 * i + 1] = x->bsum[2 * p + 1];
            o->xs[p][i] = x->bsum[2 * p] + x->bsum[2 * p + 1];
        }
        o->d[i] = x->d;
    }
}

/* Block b of tokens [8 g, 8 g + k) (k <= 8) into the token-lane layout. */
static void pack_x8(int t, const uint8_t *xq, size_t xs, int64_t g, int64_t k, int64_t b, void *out) {
    if (cas_qk_b32(t)) {
        cas_q8b8_block *o = out;
        memset(o, 0, sizeof *o);
        for (int64_t i = 0; i < k; i++) {
            const cas_q8b_block *x = (const cas_q8b_block *)(const void *)(xq + (size_t)(8 * g + i) * xs) + b;
            for (int e = 0; e < 8; e++) memcpy(o->q[e] + 4 * i, x->q + 4 * e, 4);
            o->xs[i] = x->s;
            o->d[i] = x->d;
        }
        return;
    }
    cas_q8k8_block *o = out;
    memset(o, 0, sizeof *o);
    for (int64_t i = 0; i < k; i++) {
        const cas_q8k_block *x = (const cas_q8k_block *)(const void *)(xq + (size_t)(8 * g + i) * xs) + b;
        for (int e = 0; e < 64; e++) memcpy(o->q[e] + 4 * i, x->q + 4 * e, 4);
        for (int p = 0; p < 8; p++) o->bs[p][2 * i] = x->bsum[2 * p], o->bs[p][2 * i + 1] = x->bsum[2 * p + 1];
        o->d[i] = x->d;
    }
}

/* Rows go to threads in contiguous ranges of whole 8-row groups (the AVX2
 * row kernel's unit; any split gives the same bits). Each thread's weight
 * rows are read once for all m tokens: a row group or tile (a few KiB) stays
 * in cache while every token uses it. x is quantized per token first, then,
 * for the token-lane kernels, transposed into groups of 8 or 16 tokens. */
void cas_qk_matmul(int t, const uint8_t *w, size_t rb, int64_t rows, int64_t n, const float *x, int64_t m,
                   float *y, int level, int nt, void *work) {
    const size_t xs = cas_qk_x_bytes(t, n);
    uint8_t *xq = work;
    const int64_t groups = (rows + 7) / 8;
    if (nt > groups) nt = (int)groups;
    if (nt < 1) nt = 1;
    const int lanes = lanes_for(t, m, level);
    const int64_t nb = n / cas_qk_block_size(t);
    const size_t xlb = lanes ? lane_block_bytes(t, lanes) : 0;
    uint8_t *xl = xq + align64((size_t)m * xs) + (size_t)nt * align64((size_t)m * sizeof(float));
    uint8_t *tiles = xl + (lanes ? lanes_x_bytes(t, n, m, lanes) : 0);
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) cas_qk_quantize_x(t, x + i * n, n, xq + (size_t)i * xs, level);
        if (lanes) {
#pragma omp for schedule(static)
            for (int64_t gb = 0; gb < (m + lanes - 1) / lanes * nb; gb++) {
                const int64_t g = gb / nb, k = m - lanes * g < lanes ? m - lanes * g : lanes;
                if (lanes == 16)
                    pack_x16(t, xq, xs, g, k, gb % nb, xl + (size_t)gb * xlb);
                else
                    pack_x8(t, xq, xs, g, k, gb % nb, xl + (size_t)gb * xlb);
            }
        }
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        const int64_t r0 = groups * tid / nth * 8, r1e = groups * (tid + 1) / nth * 8;
        const int64_t r1 = r1e < rows ? r1e : rows;
        if (r1 > r0) {
            void *tile = tiles + (size_t)tid * tile_bytes(t, n);
            if (lanes == 16) {
                cas_qk_avx512_rows_lanes(t, w, rb, n, r0, r1, rows, xl, m, y, tile);
            } else if (lanes) {
                cas_qk_avx2_rows_lanes(t, w, rb, n, r0, r1, rows, xl, m, y, tile);
            } else if (level >= 2) {
                cas_qk_avx512_rows(t, w, rb, n, r0, r1, rows, xq, xs, m, y);
            } else if (level >= 1) {
                cas_qk_avx2_rows(t, w, rb, n, r0, r1, rows, xq, xs, m, y);
            } else {
                float *acc = (float *)(void *)(xq + align64((size_t)m * xs) + (size_t)tid * align64((size_t)m * sizeof(float)));
                rows_generic(t, w, rb, n, r0, r1, rows, xq, xs, m, y, acc);
            }
        }
    }
}
