/*
 * core_math_avx2.c: core_math.c's elementwise tanh and GELU, 8 lanes at a
 * time with AVX2 + FMA: the scalar twins' operations lane for lane (the
 * branch of tanh a blend), so every lane gives their bits.
 */
#include <immintrin.h>

#include "core_math_impl.h"

static inline __attribute__((always_inline)) void exp_parts8(__m256 x, __m256 *p, __m256 *s) {
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(CAS_M_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(CAS_M_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(CAS_M_LN2_LO), r);
    __m256 pl = _mm256_set1_ps(1.0f / 720);
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f / 120));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f / 24));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f / 6));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(0.5f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f));
    *s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    *p = pl;
}

static inline __attribute__((always_inline)) __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    __m256 ax = _mm256_andnot_ps(sign, x);
    /* large: (1 - t) / (1 + t), t = exp(-2|x|) */
    __m256 a = _mm256_max_ps(_mm256_mul_ps(_mm256_set1_ps(-2.0f), ax), _mm256_set1_ps(CAS_M_EXP_LO)), p, s;
    exp_parts8(a, &p, &s);
    __m256 big = _mm256_div_ps(_mm256_fnmadd_ps(p, s, one), _mm256_fmadd_ps(p, s, one));
    /* small: x + x^3 P(x^2) */
    __m256 z = _mm256_mul_ps(ax, ax);
    __m256 pl = _mm256_fmadd_ps(_mm256_set1_ps(CAS_M_TP0), z, _mm256_set1_ps(CAS_M_TP1));
    pl = _mm256_fmadd_ps(pl, z, _mm256_set1_ps(CAS_M_TP2));
    pl = _mm256_fmadd_ps(pl, z, _mm256_set1_ps(CAS_M_TP3));
    pl = _mm256_fmadd_ps(pl, z, _mm256_set1_ps(CAS_M_TP4));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(pl, z), ax, ax);
    __m256 r = _mm256_blendv_ps(small, big, _mm256_cmp_ps(ax, _mm256_set1_ps(CAS_M_TANH_SMALL), _CMP_GE_OQ));
    return _mm256_or_ps(r, _mm256_and_ps(sign, x));
}

int64_t cas_m_avx2_tanh_scaled(float *x, int64_t n, float in, float out) {
    const __m256 vi = _mm256_set1_ps(in), vo = _mm256_set1_ps(out);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(vo, tanh8(_mm256_mul_ps(vi, _mm256_loadu_ps(x + i)))));
    return i;
}

int64_t cas_m_avx2_gelu_mul(const float *g, const float *u, float *h, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 a = _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_set1_ps(CAS_M_G3), _mm256_mul_ps(x, x), _mm256_set1_ps(CAS_M_G1)));
        a = _mm256_max_ps(_mm256_min_ps(a, _mm256_set1_ps(CAS_M_EXP_HI)), _mm256_set1_ps(CAS_M_EXP_LO));
        __m256 p, s;
        exp_parts8(a, &p, &s);
        __m256 y = _mm256_div_ps(x, _mm256_fmadd_ps(p, s, _mm256_set1_ps(1.0f)));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
    }
    return i;
}
