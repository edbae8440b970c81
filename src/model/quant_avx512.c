/*
 * quant_avx512.c: the forward pass's elementwise helpers on 16-wide AVX-512
 * vectors (SwiGLU and RoPE), taken where the CPU has AVX-512 and the kernels
 * are SIMD (cas_q_avx512_ok).
 *
 * Why: in the many-sequence decode step the elementwise work between the
 * matrix products runs on every token of the batch; SwiGLU's vector exp and
 * division and the scalar RoPE loop were about 6% of the 32-sequence step
 * (bench/NOTES.md). The SwiGLU here is cas_q_avx2_silu_mul's computation lane
 * for lane (the same exp polynomial, the same operations in the same order),
 * so it gives the same bits, 16 lanes at a time. The RoPE is the one RoPE of
 * the SIMD forward: the single-token and the batched paths both call it, so a
 * token's rotation does not depend on the batch it is in.
 */
#include "quant_impl.h"

#include <immintrin.h>
#include <math.h>

int cas_q_avx512_ok(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

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

/* Adjacent pairs (a, b) of the first n_rot elements of each of `heads` rows of
 * head_dim floats become (a cos - b sin, b cos + a sin), cs holding (cos, sin)
 * per pair: each output one FMA over a rounded product, a * cos + (-b sin)
 * and b * cos + a sin. */
void cas_q_avx512_rope(float *x, int32_t heads, int32_t head_dim, int32_t n_rot, const float *cs) {
    const int32_t nv = n_rot / 16; /* whole vectors of 8 pairs */
    /* swap the two floats of each pair; cos to both, (-sin, sin) */
    const __m512i swap = _mm512_set_epi32(14, 15, 12, 13, 10, 11, 8, 9, 6, 7, 4, 5, 2, 3, 0, 1);
    const __m512i dup_even = _mm512_set_epi32(14, 14, 12, 12, 10, 10, 8, 8, 6, 6, 4, 4, 2, 2, 0, 0);
    const __m512i dup_odd = _mm512_set_epi32(15, 15, 13, 13, 11, 11, 9, 9, 7, 7, 5, 5, 3, 3, 1, 1);
    const __mmask16 even = 0x5555;
    for (int32_t v = 0; v < nv; v++) {
        __m512 t = _mm512_loadu_ps(cs + 16 * v);
        __m512 co = _mm512_permutexvar_ps(dup_even, t);
        __m512 si = _mm512_permutexvar_ps(dup_odd, t);
        si = _mm512_mask_sub_ps(si, even, _mm512_setzero_ps(), si);
        for (int32_t h = 0; h < heads; h++) {
            float *p = x + (size_t)h * (size_t)head_dim + 16 * v;
            __m512 a = _mm512_loadu_ps(p);
            __m512 b = _mm512_permutexvar_ps(swap, a);
            _mm512_storeu_ps(p, _mm512_fmadd_ps(a, co, _mm512_mul_ps(b, si)));
        }
    }
    /* pairs past the last whole vector (n_rot not a multiple of 16) */
    for (int32_t h = 0; h < heads; h++) {
        float *p = x + (size_t)h * (size_t)head_dim;
        for (int32_t i = 8 * nv; i < n_rot / 2; i++) {
            float c = cs[2 * i], s = cs[2 * i + 1], a = p[2 * i], b = p[2 * i + 1];
            p[2 * i] = fmaf(a, c, b * -s);
            p[2 * i + 1] = fmaf(b, c, a * s);
        }
    }
}
