/*
 * test_core.c: what src/core says about the CPU (core.h). The features it
 * detects by hand (CPUID, XGETBV) against the compiler's own detection
 * (__builtin_cpu_supports: the same bits, so the same kernels are picked
 * as with it), the SIMD level names and their parsing, the
 * resolution of an option's level against this CPU (a level it lacks is
 * refused, never replaced), the same answers from many threads at once, and
 * the machine ceilings being measured at all.
 */
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

int main(void) {
    RUN(test_threads); /* first: the detection must not have run yet */
    RUN(test_features_match_compiler);
    RUN(test_names_and_resolve);
    RUN(test_measurements);
    return check_summary();
}
