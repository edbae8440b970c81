/*
 * core_measure.c: the machine ceilings benchmarks report against (streaming
 * read bandwidth, f32 FMA rate), measured with the widest vector unit this
 * CPU has. The vector loops are in core_measure_avx2.c and
 * core_measure_avx512.c (one source, core_measure.inc, built with each
 * instruction set); the portable loops here serve other CPUs.
 *
 * They live in core, not beside the kernels, because every layer that times
 * kernels (attention, the matrix kernels of the model) compares against the
 * same ceilings.
 */
#include <omp.h>

#include "core.h"

double cas_measure_read_bw_avx2(const float *buf, size_t n, int threads);
double cas_measure_read_bw_avx512(const float *buf, size_t n, int threads);
double cas_measure_fma_flops_avx2(int threads);
double cas_measure_fma_flops_avx512(int threads);

static double read_bw_generic(const float *buf, size_t n, int threads) {
    double best = 0.0;
    volatile float sink = 0.0f;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = cas_now_s();
        float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            float s[16] = {0};
#pragma omp for schedule(static)
            for (size_t i = 0; i < n / 16; i++)
                for (int k = 0; k < 16; k++) s[k] += buf[i * 16 + k];
            for (int k = 0; k < 16; k++) total += s[k];
        }
        double dt = cas_now_s() - t0;
        sink += total;
        double bw = (double)(n / 16 * 16) * sizeof(float) / dt;
        if (bw > best) best = bw;
    }
    (void)sink;
    return best;
}

double cas_measure_read_bandwidth(size_t bytes, int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
    size_t n = bytes / sizeof(float);
    float *buf = cas_alloc_array(n, sizeof(float));
    if (!buf) return 0.0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 1023) * 0.5f;
    double best;
    switch (cas_cpu_features_get()->simd) {
    case CAS_SIMD_AVX512: best = cas_measure_read_bw_avx512(buf, n, threads); break;
    case CAS_SIMD_AVX2: best = cas_measure_read_bw_avx2(buf, n, threads); break;
    default: best = read_bw_generic(buf, n, threads); break;
    }
    cas_free(buf);
    return best;
}

static double fma_flops_generic(int threads) {
    const long iters = 20000000;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = cas_now_s();
        float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            float a[8] = {1.0f, 1.01f, 1.02f, 1.03f, 1.04f, 1.05f, 1.06f, 1.07f}; /* distinct: no merged chains */
            volatile float mv = 0.9999999f, cv = 1e-7f; /* opaque: no folding at compile time */
            const float m = mv, c = cv;
            for (long i = 0; i < iters; i++)
                for (int k = 0; k < 8; k++) a[k] = a[k] * m + c;
            for (int k = 0; k < 8; k++) total += a[k];
        }
        double dt = cas_now_s() - t0;
        double f = 2.0 * 8 * iters * threads / dt;
        if (total == 12345.0f) f += 1; /* keep the loop alive */
        if (f > best) best = f;
    }
    return best;
}

double cas_measure_fma_flops(int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
    switch (cas_cpu_features_get()->simd) {
    case CAS_SIMD_AVX512: return cas_measure_fma_flops_avx512(threads);
    case CAS_SIMD_AVX2: return cas_measure_fma_flops_avx2(threads);
    default: return fma_flops_generic(threads);
    }
}
