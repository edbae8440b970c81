/*
 * core_math_avx512.c: core_math.c's elementwise tanh and GELU, 16 lanes at a
 * time with AVX-512: the scalar twins' operations lane for lane (the
 * branch of tanh a blend), so every lane gives their bits.
 */
#include <immintrin.h>

#include "core_math_impl.h"

static inline __attribute__((always_inline)) void exp_parts16(__m512 x, __m512 *p, __m512 *s) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(CAS_M_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(CAS_M_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(CAS_M_LN2_LO), r);
    __m512 pl = _mm512_set1_ps(1.0f / 720);
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f / 120));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f / 24));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f / 6));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(0.5f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f));
    pl = _mm512_fmadd_ps(pl, r, _mm512_set1_ps(1.0f));
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
    *p = pl;
}

static inline __attribute__((always_inline)) __m512 tanh16(__m512 x) {
    const __m512 sign = _mm512_set1_ps(-0.0f), one = _mm512_set1_ps(1.0f);
    __m512 ax = _mm512_andnot_ps(sign, x);
    /* large: (1 - t) / (1 + t), t = exp(-2|x|) */
    __m512 a = _mm512_max_ps(_mm512_mul_ps(_mm512_set1_ps(-2.0f), ax), _mm512_set1_ps(CAS_M_EXP_LO)), p, s;
    exp_parts16(a, &p, &s);
    __m512 big = _mm512_div_ps(_mm512_fnmadd_ps(p, s, one), _mm512_fmadd_ps(p, s, one));
    /* small: x + x^3 P(x^2) */
    __m512 z = _mm512_mul_ps(ax, ax);
    __m512 pl = _mm512_fmadd_ps(_mm512_set1_ps(CAS_M_TP0), z, _mm512_set1_ps(CAS_M_TP1));
    pl = _mm512_fmadd_ps(pl, z, _mm512_set1_ps(CAS_M_TP2));
    pl = _mm512_fmadd_ps(pl, z, _mm512_set1_ps(CAS_M_TP3));
    pl = _mm512_fmadd_ps(pl, z, _mm512_set1_ps(CAS_M_TP4));
    __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(pl, z), ax, ax);
    __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(CAS_M_TANH_SMALL), _CMP_GE_OQ), small, big);
    return _mm512_or_ps(r, _mm512_and_ps(sign, x));
}

int64_t cas_m_avx512_tanh_scaled(float *x, int64_t n, float in, float out) {
    const __m512 vi = _mm512_set1_ps(in), vo = _mm512_set1_ps(out);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_mul_ps(vo, tanh16(_mm512_mul_ps(vi, _mm512_loadu_ps(x + i)))));
    return i;
}

int64_t cas_m_avx512_gelu_mul(const float *g, const float *u, float *h, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 a = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_set1_ps(CAS_M_G3), _mm512_mul_ps(x, x), _mm512_set1_ps(CAS_M_G1)));
        a = _mm512_max_ps(_mm512_min_ps(a, _mm512_set1_ps(CAS_M_EXP_HI)), _mm512_set1_ps(CAS_M_EXP_LO));
        __m512 p, s;
        exp_parts16(a, &p, &s);
        __m512 y = _mm512_div_ps(x, _mm512_fmadd_ps(p, s, _mm512_set1_ps(1.0f)));
        _mm512_storeu_ps(h + i, _mm512_mul_ps(y, _mm512_loadu_ps(u + i)));
    }
    return i;
}
