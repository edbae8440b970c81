/*
 * core_measure_avx512.c: the measurement loops of core_measure.inc on 16-wide
 * AVX-512 vectors. Compiled with AVX-512 flags; core_measure.c calls it only
 * when cas_cpu_features_get() reports that level.
 */
#include <immintrin.h>

#include "core.h"

#define VL 16
typedef __m512 vf;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSET1(x) _mm512_set1_ps(x)
#define VZERO _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VADD(a, b) _mm512_add_ps((a), (b))

static inline float hsum16(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}
#define HSUM(v) hsum16(v)

#define FMA_FLOPS_NAME cas_measure_fma_flops_avx512
#define READ_BW_NAME cas_measure_read_bw_avx512
#include "core_measure.inc"
