/*
 * quant_avx512.c: SwiGLU on 16-wide AVX-512 vectors for the batched forward,
 * taken where the model's kernels may use AVX-512 (cas_model_opts.simd) and
 * the CPU has it.
 *
 * Why: in the many-sequence decode step SwiGLU runs on every token of the
 * batch, and its vector exp and division were about 2-3% of the 32-sequence
 * step (bench/HISTORY.md). It is cas_q_avx2_silu_mul's computation lane for lane
 * (the same exp polynomial, the same operations in the same order), so it
 * gives the same bits, 16 lanes at a time; the single-token path keeps the
 * AVX2 one (no 512-bit instructions between its AVX2 matrix-vector kernels:
 * measured 1% slower with them).
 */
#include "quant_impl.h"

#include <immintrin.h>

/* exp8 of quant_avx2.c on 16 lanes: the same clamp, range reduction and
 * polynomial, each step the same IEEE operation. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

void cas_q_avx512_silu_mul(const float *g, const float *u, float *h, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(g + i);
        __m512 s = _mm512_div_ps(v, _mm512_add_ps(one, exp16(_mm512_xor_ps(v, sign))));
        _mm512_storeu_ps(h + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
    if (i < n) cas_q_avx2_silu_mul(g + i, u + i, h + i, n - i);
}
