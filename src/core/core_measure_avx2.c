/*
 * core_measure_avx2.c: the measurement loops of core_measure.inc on 8-wide
 * AVX2 + FMA vectors. Compiled with -mavx2 -mfma -mf16c; core_measure.c calls
 * it only when cas_cpu_features_get() reports that level.
 */
#include <immintrin.h>

#include "core.h"

#define VL 8
typedef __m256 vf;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSET1(x) _mm256_set1_ps(x)
#define VZERO _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VADD(a, b) _mm256_add_ps((a), (b))

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define HSUM(v) hsum8(v)

#define FMA_FLOPS_NAME cas_measure_fma_flops_avx2
#define READ_BW_NAME cas_measure_read_bw_avx2
#include "core_measure.inc"
