/*
 * attn_cpu_avx2.c: the blocked attention kernel (attn_kern.inc) with 8-wide
 * AVX2 + FMA vectors, and F16C for f16 KV. Compiled with -mavx2 -mfma -mf16c;
 * attn_cpu.c picks it only when the CPU reports those features.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attn_impl.h"

#define VL 8
typedef __m256 vf;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps((p), (v))
#define VSET1(x) _mm256_set1_ps(x)
#define VZERO _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VMAX(a, b) _mm256_max_ps((a), (b))

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0 (softmax arguments): 2^n * p(r) with r in [-ln2/2, ln2/2]
 * and a degree-6 polynomial (relative error ~2e-7); x < -87 gives exactly 0,
 * so masked scores (-inf) contribute nothing. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 pl = _mm256_set1_ps(1.0f / 720);
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f / 120));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f / 24));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f / 6));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(0.5f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f));
    pl = _mm256_fmadd_ps(pl, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 res = _mm256_mul_ps(pl, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(zero_mask, res);
}

#define VEXP(x) exp8(x)
#define VFIRST(v) _mm256_cvtss_f32(v)
#define HSUM(v) hsum8(v)
#define HMAX(v) hmax8(v)
#define KERNEL_NAME cas_attn_item_avx2

#include "attn_kern.inc"
