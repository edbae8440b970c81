/*
 * attn_vec512.h: the vector macros of attn_kern.inc for 16-wide AVX-512, shared
 * by the kernels built from it with AVX-512 (attn_cpu_avx512.c) and with
 * AVX-512 + BF16 dot products (attn_cpu_avx512bf16.c). Internal to src/attn.
 */
#ifndef CAS_ATTN_VEC512_H
#define CAS_ATTN_VEC512_H

#include <immintrin.h>

#define VL 16
typedef __m512 vf;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps((p), (v))
#define VSET1(x) _mm512_set1_ps(x)
#define VZERO _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VMAX(a, b) _mm512_max_ps((a), (b))

/* exp(x) for softmax arguments, as in the AVX2 file: x < -87 gives 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 pl = _mm512_set1_ps(1.0f / 720);
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f / 120));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f / 24));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f / 6));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(0.5f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f));
    /* p * 2^n in one instruction (n is in [-126, 0]: the same exact scaling
     * as building 2^n's exponent bits and multiplying) */
    return _mm512_maskz_scalef_ps(keep, pl, n);
}

/* Sum of the 16 lanes in a fixed order: lanes i and i+8, then i and i+4,
 * i and i+2, 0 and 1. The transposed-score path sums 16 vectors of lanes in
 * exactly this order, so both give a row the same bits. */
static inline float hsum16(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

#define VEXP(x) exp16(x)
#define VFIRST(v) _mm512_cvtss_f32(v)
#define HSUM(v) hsum16(v)
#define HMAX(v) _mm512_reduce_max_ps(v)
#endif
