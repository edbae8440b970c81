/*
 * test_core.c: what src/core says about the CPU (core.h). The features it
 * detects by hand (CPUID, XGETBV) against the compiler's own detection
 * (__builtin_cpu_supports: the same bits, so the same kernels are picked
 * as with it), the SIMD level names and their parsing, the
 * resolution of an option's level against this CPU (a level it lacks is
 * refused, never replaced), the same answers from many threads at once,
 * the machine ceilings being measured at all, and the elementwise tanh and
 * GELU: the same bits on every level and at every place in an array, within
 * a stated error of float64.
 */
#include <float.h>
#include <omp.h>
#include <string.h>

#include "../src/core/core.h"
#include "check.h"

static void test_features_match_compiler(void) {
    const cas_cpu_features *f = cas_cpu_features_get();
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
    /* GCC knows every name below (clang 14 lacks "f16c") */
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    CHECK(f->avx2 == avx2);
    CHECK(f->avx512 == avx512);
    CHECK(f->avx512_bf16 == !!__builtin_cpu_supports("avx512bf16"));
#endif
    const cas_simd_level want = f->avx2 && f->avx512 ? CAS_SIMD_AVX512 : f->avx2 ? CAS_SIMD_AVX2 : CAS_SIMD_GENERIC;
    CHECK(f->simd == want);
    CHECK(f->amx_int8 <= 1 && f->amx_bf16 <= 1 && f->amx_tile <= 1);
    if (cas_cpu_amx_ready()) CHECK(f->amx_tile);
    printf("  this CPU: %s%s%s%s%s (AMX tiles %s)\n", cas_simd_name(f->simd), f->avx512_bf16 ? " avx512_bf16" : "",
           f->amx_tile ? " amx_tile" : "", f->amx_int8 ? " amx_int8" : "", f->amx_bf16 ? " amx_bf16" : "",
           cas_cpu_amx_ready() ? "usable" : "not usable");
}

static void test_names_and_resolve(void) {
    for (int l = CAS_SIMD_AUTO; l <= CAS_SIMD_AVX512; l++) {
        cas_simd_level back = (cas_simd_level)-1;
        CHECK(cas_simd_parse(cas_simd_name((cas_simd_level)l), &back) == 0 && back == (cas_simd_level)l);
    }
    cas_simd_level out = CAS_SIMD_AVX2;
    CHECK(cas_simd_parse("avx9", &out) == -1 && out == CAS_SIMD_AVX2);
    CHECK(cas_simd_parse(NULL, &out) == -1);
    CHECK(strcmp(cas_simd_name((cas_simd_level)42), "?") == 0);

    const cas_simd_level have = cas_cpu_features_get()->simd;
    CHECK(cas_simd_resolve(CAS_SIMD_AUTO, "test", &out) == CAS_OK && out == have);
    for (int l = CAS_SIMD_GENERIC; l <= CAS_SIMD_AVX512; l++) {
        out = (cas_simd_level)-1;
        cas_status st = cas_simd_resolve((cas_simd_level)l, "test", &out);
        if (l <= (int)have) {
            CHECK(st == CAS_OK && out == (cas_simd_level)l);
        } else {
            CHECK(st == CAS_ERR_UNSUPPORTED && out == (cas_simd_level)-1);
            CHECK(strstr(cas_last_error(), "test") && strstr(cas_last_error(), cas_simd_name((cas_simd_level)l)));
        }
    }
    CHECK(cas_simd_resolve((cas_simd_level)4, "test", &out) == CAS_ERR_INVALID);
    CHECK(cas_simd_resolve((cas_simd_level)-1, "test", &out) == CAS_ERR_INVALID);
}

/* The first call races from many threads: every one sees the same, complete struct. */
static void test_threads(void) {
    const cas_cpu_features *seen[16];
    int ready[16];
#pragma omp parallel for num_threads(16)
    for (int i = 0; i < 16; i++) {
        seen[i] = cas_cpu_features_get();
        ready[i] = cas_cpu_amx_ready();
    }
    for (int i = 1; i < 16; i++) CHECK(seen[i] == seen[0] && ready[i] == ready[0]);
    CHECK(memcmp(seen[0], cas_cpu_features_get(), sizeof(cas_cpu_features)) == 0);
}

static void test_measurements(void) {
    double bw = cas_measure_read_bandwidth((size_t)64 << 20, 2);
    double fl = cas_measure_fma_flops(1);
    CHECKF(bw > 1e8 && fl > 1e8, "read %.3g B/s, fma %.3g FLOP/s", bw, fl);
    printf("  read bandwidth (64 MiB, 2 threads) %.1f GB/s, f32 FMA (1 thread) %.1f GFLOP/s\n", bw * 1e-9,
           fl * 1e-9);
}

/* ---- elementwise tanh and GELU ------------------------------------------- */

static uint32_t fbits(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

/* the same value: equal bits, or both NaN */
static int same(float a, float b) { return fbits(a) == fbits(b) || (isnan(a) && isnan(b)); }

static uint64_t rng_state = 88172645463325252ull;
static double urand(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1.0p-53;
}

/* Inputs: special values, a dense grid over [-12, 12], and random values of
 * every magnitude from 1e-30 to 1e4 with either sign. */
static int64_t math_inputs(float *x, int64_t cap) {
    static const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, FLT_MIN, -FLT_MIN, 1e-40f,
                                    -1e-40f, FLT_MAX, -FLT_MAX, 0.625f, -0.625f, 0.62499994f, 0.62500006f,
                                    9.0f, 10.0f, 43.4f, 43.6f, 87.0f, 88.0f, 1e30f, -1e30f, 1e-30f};
    int64_t n = 0;
    for (size_t i = 0; i < sizeof special / sizeof *special; i++) x[n++] = special[i];
    for (int i = -120000; i <= 120000; i++) x[n++] = (float)i * 1e-4f;
    while (n < cap) {
        double mag = pow(10.0, -30.0 + 34.0 * urand());
        x[n++] = (float)(urand() < 0.5 ? -mag : mag);
    }
    return n;
}

/* 0.5 x (1 + tanh z) as x / (1 + exp(-2z)): the same function, without the
 * cancellation that leaves the first form no correct digit for x < -5 */
static double gelu64(double x) { return x / (1.0 + exp(-2.0 * 0.79788456080286535588 * x * (1.0 + 0.044715 * x * x))); }

static void test_tanh_gelu_accuracy(void) {
    enum { N = 600000 };
    float *x = malloc(sizeof(float) * N);
    REQUIRE(x);
    int64_t n = math_inputs(x, N);
    double worst_t = 0, worst_g = 0;
    float at_t = 0, at_g = 0;
    int bad_t = 0, bad_g = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        if (!isfinite(v)) continue;
        double t = tanh((double)v), e = fabs((double)cas_tanhf(v) - t) / fabs(t);
        if (t == 0) e = cas_tanhf(v) == 0 ? 0 : 1;
        if (e > worst_t) worst_t = e, at_t = v;
        bad_t += !(e <= 3e-7);
        if (fabs(v) <= 10) {
            /* relative to 1e-6 + 2e-7 |2z|: for negative x, gelu ~ x exp(2z) and
             * the rounding of the argument 2z (a few ulp of it) is amplified by
             * |2z| (~87 at x = -10); near 0 and for x > 0 the bound is 1e-6 */
            double z2 = 2.0 * 0.79788456080286535588 * (double)v * (1.0 + 0.044715 * (double)v * v);
            double gr = gelu64(v), tol = 1e-6 + 2e-7 * fabs(z2);
            double eg = gr == 0 ? (cas_geluf(v) == 0 ? 0 : 1) : fabs((double)cas_geluf(v) - gr) / fabs(gr) / tol;
            if (eg > worst_g) worst_g = eg, at_g = v;
            bad_g += !(eg <= 1.0);
        }
    }
    CHECKF(bad_t == 0, "tanh: %d values off by more than 3e-7 relative, worst %.3g at %.9g", bad_t, worst_t, at_t);
    CHECKF(bad_g == 0, "gelu: %d values off by more than 1e-6 + 2e-7 |2z| relative, worst %.3g of it at %.9g", bad_g,
           worst_g, at_g);
    printf("  %lld inputs: tanh worst relative error %.3g (at %.9g), gelu (|x| <= 10) %.3g of its bound (at %.9g)\n",
           (long long)n, worst_t, at_t, worst_g, at_g);
    /* the edges */
    CHECK(fbits(cas_tanhf(0.0f)) == 0 && fbits(cas_tanhf(-0.0f)) == 0x80000000u);
    CHECK(cas_tanhf(INFINITY) == 1.0f && cas_tanhf(-INFINITY) == -1.0f && cas_tanhf(1e30f) == 1.0f);
    CHECK(isnan(cas_tanhf(NAN)) && isnan(cas_geluf(NAN)));
    CHECK(cas_tanhf(1e-30f) == 1e-30f && cas_tanhf(-1e-40f) == -1e-40f);
    CHECK(cas_geluf(0.0f) == 0.0f && cas_geluf(INFINITY) == INFINITY && cas_geluf(100.0f) == 100.0f);
    CHECK(cas_geluf(-100.0f) <= 0.0f && cas_geluf(-100.0f) > -1e-30f);
    free(x);
}

/* Every level gives the scalar twins' bits, at every offset and length (so in
 * the vector body and in the tails alike), scaled or not. */
static void test_tanh_gelu_bits(void) {
    enum { N = 600000 };
    float *x = malloc(sizeof(float) * N), *u = malloc(sizeof(float) * N), *y = malloc(sizeof(float) * N);
    float *h = malloc(sizeof(float) * N);
    REQUIRE(x && u && y && h);
    int64_t n = math_inputs(x, N);
    for (int64_t i = 0; i < n; i++) u[i] = (float)(urand() * 4 - 2);
    const cas_simd_level have = cas_cpu_features_get()->simd;
    const float caps[] = {1.0f, 30.0f, 50.0f};
    for (int l = CAS_SIMD_GENERIC; l <= (int)have; l++) {
        int diff_t = 0, diff_g = 0;
        for (size_t c = 0; c < sizeof caps / sizeof *caps; c++) {
            const float in = 1.0f / caps[c], out = caps[c];
            /* pieces of every length 1..40 at every offset, then the rest at once */
            int64_t i = 0;
            for (int len = 1; i < n && len <= 40; i += len, len++) {
                int64_t k = n - i < len ? n - i : len;
                memcpy(y + i, x + i, sizeof(float) * (size_t)k);
                cas_tanh_scaled_at((cas_simd_level)l, y + i, k, in, out);
                cas_gelu_mul_at((cas_simd_level)l, x + i, u + i, h + i, k);
            }
            memcpy(y + i, x + i, sizeof(float) * (size_t)(n - i));
            cas_tanh_scaled_at((cas_simd_level)l, y + i, n - i, in, out);
            cas_gelu_mul_at((cas_simd_level)l, x + i, u + i, h + i, n - i);
            for (int64_t j = 0; j < n; j++) {
                diff_t += !same(y[j], out * cas_tanhf(in * x[j]));
                diff_g += !same(h[j], cas_geluf(x[j]) * u[j]);
            }
        }
        CHECKF(diff_t == 0 && diff_g == 0, "%s: %d tanh and %d gelu values differ from the scalar twins",
               cas_simd_name((cas_simd_level)l), diff_t, diff_g);
    }
    /* in place (h = g) too */
    memcpy(y, x, sizeof(float) * (size_t)n);
    cas_gelu_mul(y, u, y, n);
    int diff = 0;
    for (int64_t j = 0; j < n; j++) diff += !same(y[j], cas_geluf(x[j]) * u[j]);
    CHECK(diff == 0);
    free(x), free(u), free(y), free(h);
}

int main(void) {
    RUN(test_threads); /* first: the detection must not have run yet */
    RUN(test_features_match_compiler);
    RUN(test_names_and_resolve);
    RUN(test_measurements);
    RUN(test_tanh_gelu_accuracy);
    RUN(test_tanh_gelu_bits);
    return check_summary();
}
