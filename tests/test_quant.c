/*
 * test_quant.c: tensor types and the CPU matrix kernels (src/model/quant*.c)
 * against a float64 reference computed from the dequantized weights.
 *
 * Tolerances. Float weights (F32, F16, BF16) see x unchanged, so the only
 * error is f32 summation: at most about n * 2^-24 * sum|w||x| for a
 * sequential sum (the SIMD path's lane-wise sums are better). Quantized
 * weights see x rounded to 8 bits per block against the scale d_b =
 * amax_b|x| / 127, an error of at most d_b / 2 per element, hence
 *     |y - y_ref| <= sum_b (d_b / 2) * sum_{i in b} |w_i|    (the x term)
 * plus f32 rounding of the per-block scaled integer sums, bounded by a few
 * units of 2^-24 per block times sum_b max_b|w| * sum_{i in b}(|x_i| + d_b)
 * (Q4_1's m and d q terms can each be up to twice the largest |w| of the
 * block, hence the max rather than |w_i|). The x term is computed exactly
 * from the test's own x, so the check is tight enough to catch a wrong
 * nibble or a wrong scale, which would err by O(sum |w||x|).
 *
 * `test_quant --bench` runs the benchmarks instead of the tests.
 */
#include "check.h"

#include <float.h>
#include <string.h>

#include "../src/core/core.h"
#include "../src/model/model.h"
#include "../src/model/quant_impl.h"
#include "../src/model/quant_k.h"

static const int k_types[] = {CAS_T_F32, CAS_T_F16, CAS_T_BF16, CAS_T_Q8_0, CAS_T_Q4_0, CAS_T_Q4_1};
#define N_TYPES ((int)(sizeof k_types / sizeof k_types[0]))

static int is_q(int t) { return t == CAS_T_Q8_0 || t == CAS_T_Q4_0 || t == CAS_T_Q4_1; }

static int have_avx2(void) {
    cas_q_opts o = {1, CAS_Q_SIMD_AVX2, NULL, 0, NULL, NULL, NULL};
    float w = 1, x = 1, y = 0;
    return cas_q_matvec(CAS_T_F32, &w, 1, 1, &x, &y, &o) == CAS_OK;
}

/* Normal values with a per-row and a per-block magnitude spread, so blocks
 * of very different scales sit side by side. */
static void fill_weights(cas_rng *rng, float *w, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        double rs = pow(10.0, cas_rng_uniform(rng) * 2 - 1);
        for (int64_t b = 0; b < n; b += 32) {
            double bs = rs * pow(2.0, cas_rng_uniform(rng) * 6 - 3);
            for (int64_t i = b; i < b + 32 && i < n; i++) w[r * n + i] = (float)(bs * cas_rng_normal(rng));
        }
    }
}

/* Quantizes w into type t and returns the dequantized matrix in wd. */
static void make_matrix(int t, const float *w, int64_t rows, int64_t n, uint8_t **wq, float *wd) {
    size_t rb = 0;
    CHECK(cas_tensor_row_bytes(t, n, &rb) == CAS_OK);
    *wq = cas_alloc(rb * (size_t)rows);
    CHECK(cas_q_quantize_rows(t, w, *wq, rows, n) == CAS_OK);
    for (int64_t r = 0; r < rows; r++) CHECK(cas_q_dequantize_row(t, *wq + r * rb, wd + r * n, n) == CAS_OK);
}

/* Reference and per-output tolerance for Y[m][rows]. */
static void reference(int t, const float *wd, int64_t rows, int64_t n, const float *x, int64_t m,
                      double *yref, double *tol, double *ftol) {
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * n;
        for (int64_t r = 0; r < rows; r++) {
            const float *wr = wd + r * n;
            double s = 0, xterm = 0, fterm = 0;
            for (int64_t b = 0; b < n; b += 32) {
                int64_t e = b + 32 < n ? b + 32 : n;
                double amx = 0, amw = 0, sw = 0, sx = 0, swx = 0;
                for (int64_t k = b; k < e; k++) {
                    s += (double)wr[k] * xi[k];
                    amx = fmax(amx, fabs(xi[k]));
                    amw = fmax(amw, fabs(wr[k]));
                    sw += fabs(wr[k]);
                    sx += fabs(xi[k]);
                    swx += fabs((double)wr[k] * xi[k]);
                }
                if (is_q(t)) {
                    double d = amx / 127;
                    xterm += d / 2 * sw;
                    fterm += 3 * amw * (sx + 32 * d);
                } else {
                    fterm += swx;
                }
            }
            double nb = (double)(n + 31) / 32;
            /* f32 rounding: quantized types round a handful of times per
             * block and once per block in the sum; float types once per
             * element in the worst (sequential) order. */
            double frel = is_q(t) ? (nb + 8) * 0x1p-22 : (double)(n + 8) * 0x1p-23;
            yref[i * rows + r] = s;
            tol[i * rows + r] = 1.001 * xterm + frel * fterm + 1e-30;
            ftol[i * rows + r] = 2 * frel * fterm + 1e-30;
        }
    }
}

static void check_result(const char *what, int t, int64_t rows, int64_t n, int64_t m, const float *y,
                         const double *yref, const double *tol) {
    int bad = 0;
    for (int64_t i = 0; i < m * rows && bad < 3; i++) {
        double err = fabs((double)y[i] - yref[i]);
        if (!(err <= tol[i])) { /* also catches NaN: every output must be written */
            CHECKF(0, "%s %s rows=%lld n=%lld m=%lld: y[%lld]=%g ref=%g err=%g tol=%g", what,
                   cas_tensor_type_name(t), (long long)rows, (long long)n, (long long)m, (long long)i,
                   (double)y[i], yref[i], err, tol[i]);
            bad++;
        }
    }
}

static void poison(float *y, int64_t k) {
    for (int64_t i = 0; i < k; i++) y[i] = NAN;
}

/* ---- tests ---------------------------------------------------------------- */

static void test_type_info(void) {
    size_t rb = 7;
    CHECK(cas_tensor_row_bytes(CAS_T_Q4_1, 576, &rb) == CAS_OK && rb == 18 * 20);
    CHECK(cas_tensor_row_bytes(CAS_T_Q4_0, 64, &rb) == CAS_OK && rb == 36);
    CHECK(cas_tensor_row_bytes(CAS_T_Q8_0, 1536, &rb) == CAS_OK && rb == 48 * 34);
    CHECK(cas_tensor_row_bytes(CAS_T_F32, 37, &rb) == CAS_OK && rb == 148);
    CHECK(cas_tensor_row_bytes(CAS_T_F16, 37, &rb) == CAS_OK && rb == 74);
    CHECK(cas_tensor_row_bytes(CAS_T_BF16, 3, &rb) == CAS_OK && rb == 6);
    CHECK(cas_tensor_row_bytes(CAS_T_Q4_1, 33, &rb) == CAS_ERR_INVALID && rb == 0);
    CHECK(cas_tensor_row_bytes(CAS_T_Q8_0, 16, &rb) == CAS_ERR_INVALID);
    CHECK(cas_tensor_row_bytes(CAS_T_Q4_0, 0, &rb) == CAS_ERR_INVALID);
    CHECK(cas_tensor_row_bytes(CAS_T_F32, -1, &rb) == CAS_ERR_INVALID);
    CHECK(cas_tensor_row_bytes(16 /* iq2_xxs */, 256, &rb) == CAS_ERR_UNSUPPORTED);
    CHECK(cas_tensor_row_bytes(CAS_T_F32, 32, NULL) == CAS_ERR_INVALID);
    CHECK(cas_tensor_block_size(CAS_T_Q4_1) == 32 && cas_tensor_block_size(CAS_T_BF16) == 1);
    CHECK(cas_tensor_block_size(99) == 0 && cas_tensor_block_bytes(99) == 0);
    CHECK(cas_tensor_block_bytes(CAS_T_Q4_0) == 18 && cas_tensor_block_bytes(CAS_T_Q8_0) == 34);
    CHECK(strcmp(cas_tensor_type_name(CAS_T_Q4_1), "q4_1") == 0);
    CHECK(strcmp(cas_tensor_type_name(CAS_T_BF16), "bf16") == 0);
    CHECK(strcmp(cas_tensor_type_name(99), "?") == 0);
    for (int i = 0; i < N_TYPES; i++) CHECK(cas_tensor_type_supported(k_types[i]));
    /* ids the GGUF reader can size but the kernels cannot compute with, named in the error */
    CHECK(!cas_tensor_type_supported(CAS_T_Q8_1) && !cas_tensor_type_supported(CAS_T_Q8_K) && !cas_tensor_type_supported(16));
    CHECK(cas_tensor_row_bytes(CAS_T_Q8_1, 64, &rb) == CAS_ERR_UNSUPPORTED && strstr(cas_last_error(), "q8_1"));
    CHECK(cas_tensor_row_bytes(41, 64, &rb) == CAS_ERR_UNSUPPORTED && strstr(cas_last_error(), "q1_0"));
}

/* Hand-built blocks pin the layout: ggml's nibble order puts element i in the
 * low nibble of byte i and element 16 + i in the high nibble. */
static void test_layout(void) {
    uint8_t q40[18], q41[20], q80[34];
    uint16_t two = cas_f32_to_f16(2.0f), half = cas_f32_to_f16(0.5f), m = cas_f32_to_f16(-3.0f);
    memcpy(q40, &two, 2);
    memcpy(q41, &half, 2);
    memcpy(q41 + 2, &m, 2);
    memcpy(q80, &half, 2);
    for (int i = 0; i < 16; i++) {
        q40[2 + i] = (uint8_t)(i | (15 - i) << 4);
        q41[4 + i] = (uint8_t)(i | (15 - i) << 4);
    }
    for (int i = 0; i < 32; i++) q80[2 + i] = (uint8_t)(int8_t)(i * 8 - 128);
    float d[32];
    REQUIRE(cas_q_dequantize_row(CAS_T_Q4_0, q40, d, 32) == CAS_OK);
    for (int i = 0; i < 16; i++) {
        CHECK(d[i] == 2.0f * (float)(i - 8));
        CHECK(d[16 + i] == 2.0f * (float)(15 - i - 8));
    }
    REQUIRE(cas_q_dequantize_row(CAS_T_Q4_1, q41, d, 32) == CAS_OK);
    for (int i = 0; i < 16; i++) {
        CHECK(d[i] == 0.5f * (float)i - 3.0f);
        CHECK(d[16 + i] == 0.5f * (float)(15 - i) - 3.0f);
    }
    REQUIRE(cas_q_dequantize_row(CAS_T_Q8_0, q80, d, 32) == CAS_OK);
    for (int i = 0; i < 32; i++) CHECK(d[i] == 0.5f * (float)(i * 8 - 128));

    /* The kernels read the same layout: y = W x with x = e_k picks column k
     * (exact: one-hot x quantizes without error). */
    const uint8_t *blocks[3] = {q40, q41, q80};
    const int types[3] = {CAS_T_Q4_0, CAS_T_Q4_1, CAS_T_Q8_0};
    for (int v = 0; v < 3; v++) {
        REQUIRE(cas_q_dequantize_row(types[v], blocks[v], d, 32) == CAS_OK);
        for (int path = CAS_Q_SIMD_GENERIC; path <= CAS_Q_SIMD_AVX2; path++) {
            if (path == CAS_Q_SIMD_AVX2 && !have_avx2()) continue;
            cas_q_opts o = {1, (cas_q_simd)path, NULL, 0, NULL, NULL, NULL};
            for (int k = 0; k < 32; k++) {
                float x[32] = {0}, y = NAN;
                x[k] = 1;
                CHECK(cas_q_matvec(types[v], blocks[v], 1, 32, x, &y, &o) == CAS_OK);
                CHECKF(fabsf(y - d[k]) <= 1e-6f * fabsf(d[k]), "type %s path %d k %d: %g vs %g",
                       cas_tensor_type_name(types[v]), path, k, (double)y, (double)d[k]);
            }
        }
    }
}

/* Round trip: per block, Q8_0 and Q4_1 err by at most half a step (plus the
 * f16 rounding of the scale and of Q4_1's minimum against the block's
 * magnitude); Q4_0 by one step (its extreme value on the short side of zero
 * is clamped from +8 to +7 steps). F16 and BF16 round to nearest: relative
 * 2^-11 and 2^-8 (F16 values here stay in its normal range). */
static void test_roundtrip(void) {
    cas_rng rng;
    cas_rng_seed(&rng, 7);
    const int64_t rows = 9, n = 576;
    float *w = cas_alloc_array((size_t)(rows * n), 4), *wd = cas_alloc_array((size_t)(rows * n), 4);
    REQUIRE(w && wd);
    fill_weights(&rng, w, rows, n);
    for (int64_t i = 0; i < 32; i++) w[i] = 0;           /* an all-zero block */
    for (int64_t i = 32; i < 64; i++) w[i] = 1.25f;       /* a constant block */
    for (int64_t i = 64; i < 96; i++) w[i] = -3.0f + 0.5f * (float)(i % 16); /* on the Q4_1 grid */
    for (int ti = 0; ti < N_TYPES; ti++) {
        int t = k_types[ti];
        uint8_t *q = NULL;
        make_matrix(t, w, rows, n, &q, wd);
        double worst = 0;
        for (int64_t b = 0; b < rows * n; b += 32) {
            float lo = w[b], hi = w[b], amax = 0;
            for (int k = 0; k < 32; k++) {
                lo = fminf(lo, w[b + k]), hi = fmaxf(hi, w[b + k]);
                amax = fmaxf(amax, fabsf(w[b + k]));
            }
            for (int k = 0; k < 32; k++) {
                double err = fabs((double)wd[b + k] - w[b + k]), tol;
                switch (t) {
                case CAS_T_F32: tol = 0; break;
                case CAS_T_F16: tol = fabs(w[b + k]) * 0x1p-11; break;
                case CAS_T_BF16: tol = fabs(w[b + k]) * 0x1p-8; break;
                case CAS_T_Q8_0: tol = amax / 127.0 * (0.5 + 127 * 0x1p-10); break;
                case CAS_T_Q4_0: tol = amax / 8.0 * (1 + 16 * 0x1p-10); break;
                default: tol = (hi - lo) / 15.0 * (0.5 + 16 * 0x1p-10) + fabs(lo) * 0x1p-10; break;
                }
                if (!(err <= tol) && worst < 1) {
                    CHECKF(0, "%s element %lld: %g -> %g (tol %g)", cas_tensor_type_name(t),
                           (long long)(b + k), (double)w[b + k], (double)wd[b + k], tol);
                    worst = 1;
                }
            }
        }
        for (int k = 0; k < 32; k++) CHECK(wd[k] == 0); /* zero block stays zero */
        if (t == CAS_T_Q4_1 || t == CAS_T_F32 || t == CAS_T_F16 || t == CAS_T_BF16)
            for (int k = 64; k < 96; k++) CHECK(wd[k] == w[k]);
        if (t == CAS_T_F16 || t == CAS_T_BF16)
            for (int k = 32; k < 64; k++) CHECKF(wd[k] == 1.25f, "%s %g", cas_tensor_type_name(t), (double)wd[k]);
        cas_free(q);
    }
    cas_free(w);
    cas_free(wd);
}

/* One (type, shape) over tokens counts, paths and thread counts. */
static void run_case(int t, int64_t rows, int64_t n, const int64_t *ms, int nm, int avx2, cas_rng *rng) {
    int64_t mmax = 0;
    for (int i = 0; i < nm; i++) mmax = ms[i] > mmax ? ms[i] : mmax;
    float *w = cas_alloc_array((size_t)(rows * n), 4), *wd = cas_alloc_array((size_t)(rows * n), 4);
    float *x = cas_alloc_array((size_t)(mmax * n), 4);
    float *y = cas_alloc_array((size_t)(mmax * rows), 4), *y1 = cas_alloc_array((size_t)rows, 4);
    float *yg = cas_alloc_array((size_t)(mmax * rows), 4);
    double *yref = cas_alloc_array((size_t)(mmax * rows), 8), *tol = cas_alloc_array((size_t)(mmax * rows), 8);
    double *ftol = cas_alloc_array((size_t)(mmax * rows), 8);
    uint8_t *wq = NULL;
    REQUIRE(w && wd && x && y && y1 && yg && yref && tol && ftol);
    fill_weights(rng, w, rows, n);
    make_matrix(t, w, rows, n, &wq, wd);
    for (int mi = 0; mi < nm; mi++) {
        int64_t m = ms[mi];
        for (int64_t i = 0; i < m * n; i++) x[i] = (float)cas_rng_normal(rng);
        if (n >= 64) /* an all-zero x block (scale 0) and a tiny one */
            for (int64_t k = 0; k < 32; k++) x[k] = 0, x[32 + k] *= 1e-6f;
        reference(t, wd, rows, n, x, m, yref, tol, ftol);
        int first = 1;
        for (int path = CAS_Q_SIMD_GENERIC; path <= CAS_Q_SIMD_AVX2; path++) {
            if (path == CAS_Q_SIMD_AVX2 && !avx2) continue;
            for (int nt = 1; nt <= 2; nt++) {
                cas_q_opts o = {nt, (cas_q_simd)path, NULL, 0, NULL, NULL, NULL};
                poison(y, m * rows);
                cas_status st = m == 1 ? cas_q_matvec(t, wq, rows, n, x, y, &o)
                                       : cas_q_matmul(t, wq, rows, n, x, m, y, &o);
                CHECKF(st == CAS_OK, "%s", cas_last_error());
                check_result(path == CAS_Q_SIMD_AVX2 ? "avx2" : "generic", t, rows, n, m, y, yref, tol);
                /* Differential: every path and thread count computes from
                 * the same quantized x, so they differ only by f32 rounding:
                 * twice the f32 part of the tolerance, without the x term. */
                if (first) {
                    memcpy(yg, y, (size_t)(m * rows) * 4);
                    first = 0;
                } else {
                    for (int64_t i = 0; i < m * rows; i++) {
                        if (!(fabs((double)y[i] - yg[i]) <= ftol[i])) {
                            CHECKF(0, "%s path %d nt %d m %lld: y[%lld] %g vs first %g", cas_tensor_type_name(t),
                                   path, nt, (long long)m, (long long)i, (double)y[i], (double)yg[i]);
                            break;
                        }
                    }
                }
                /* batched = alone: each token's row of Y matches its own matvec */
                if (m > 1 && nt == 2) {
                    for (int64_t i = 0; i < m; i += (m > 4 ? m / 4 : 1)) {
                        poison(y1, rows);
                        CHECK(cas_q_matvec(t, wq, rows, n, x + i * n, y1, &o) == CAS_OK);
                        for (int64_t r = 0; r < rows; r++)
                            if (!(fabs((double)y1[r] - y[i * rows + r]) <= ftol[i * rows + r])) {
                                CHECKF(0, "%s batched vs alone token %lld row %lld: %g vs %g",
                                       cas_tensor_type_name(t), (long long)i, (long long)r,
                                       (double)y[i * rows + r], (double)y1[r]);
                                break;
                            }
                    }
                }
            }
        }
    }
    cas_free(wq);
    cas_free(w);
    cas_free(wd);
    cas_free(x);
    cas_free(y);
    cas_free(y1);
    cas_free(yg);
    cas_free(yref);
    cas_free(tol);
    cas_free(ftol);
}

static void test_kernels(void) {
    cas_rng rng;
    cas_rng_seed(&rng, 42);
    int avx2 = have_avx2();
    if (!avx2) printf("note: no AVX2 on this CPU; testing the portable path only\n");
    static const int64_t ns[] = {32, 64, 576, 1536};
    static const int64_t rowss[] = {1, 7, 33, 577};
    for (int ti = 0; ti < N_TYPES; ti++) {
        int t = k_types[ti];
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 4; b++) {
                int64_t n = ns[a], rows = rowss[b];
                if (n == 32 && rows > 33) continue;
                /* token counts: 1 (matvec), odd and even small batches, and a
                 * full 32-token batch where it stays cheap */
                int64_t ms[4] = {1, 2, 5, 32};
                int nm = rows * n <= 33 * 1536 || (rows == 577 && n == 64) ? 4 : 3;
                run_case(t, rows, n, ms, nm, avx2, &rng);
            }
        if (!is_q(t)) { /* float types take any n: SIMD tails */
            int64_t ms[3] = {1, 3, 4};
            run_case(t, 33, 37, ms, 3, avx2, &rng);
            run_case(t, 5, 7, ms, 3, avx2, &rng);
        }
    }
}

static void test_workspace_and_env(void) {
    cas_rng rng;
    cas_rng_seed(&rng, 3);
    const int64_t rows = 65, n = 576, m = 7;
    float *w = cas_alloc_array((size_t)(rows * n), 4), *wd = cas_alloc_array((size_t)(rows * n), 4);
    float *x = cas_alloc_array((size_t)(m * n), 4), *y = cas_alloc_array((size_t)(m * rows), 4);
    float *y2 = cas_alloc_array((size_t)(m * rows), 4);
    REQUIRE(w && wd && x && y && y2);
    fill_weights(&rng, w, rows, n);
    for (int64_t i = 0; i < m * n; i++) x[i] = (float)cas_rng_normal(&rng);
    for (int ti = 0; ti < N_TYPES; ti++) {
        int t = k_types[ti];
        uint8_t *wq = NULL;
        make_matrix(t, w, rows, n, &wq, wd);
        /* A caller-owned workspace gives bit-identical results. */
        size_t need = cas_q_work_bytes(t, rows, n, m, 2);
        CHECK(need > 0);
        void *work = cas_alloc(need);
        cas_q_opts own = {2, CAS_Q_SIMD_AUTO, work, need, NULL, NULL, NULL}, dflt = {2, CAS_Q_SIMD_AUTO, NULL, 0, NULL, NULL, NULL};
        poison(y, m * rows);
        poison(y2, m * rows);
        CHECK(cas_q_matmul(t, wq, rows, n, x, m, y, &own) == CAS_OK);
        CHECK(cas_q_matmul(t, wq, rows, n, x, m, y2, &dflt) == CAS_OK);
        CHECK(memcmp(y, y2, (size_t)(m * rows) * 4) == 0);
        own.work_bytes = need - 1;
        CHECK(cas_q_matmul(t, wq, rows, n, x, m, y, &own) == CAS_ERR_INVALID);
        /* NULL options mean defaults */
        CHECK(cas_q_matmul(t, wq, rows, n, x, m, y, NULL) == CAS_OK);
        /* AUTO is the path cas_q_simd_name names (the CPU's, from src/core):
         * bit-identical to asking for that path. */
        const int auto_avx2 = strcmp(cas_q_simd_name(), "avx2") == 0;
        CHECK(auto_avx2 == have_avx2() && auto_avx2 == cas_cpu_features_get()->avx2);
        cas_q_opts same = {1, auto_avx2 ? CAS_Q_SIMD_AVX2 : CAS_Q_SIMD_GENERIC, NULL, 0, NULL, NULL, NULL},
                   aut = {1, CAS_Q_SIMD_AUTO, NULL, 0, NULL, NULL, NULL};
        poison(y, m * rows);
        poison(y2, m * rows);
        CHECK(cas_q_matmul(t, wq, rows, n, x, m, y, &aut) == CAS_OK);
        CHECK(cas_q_matmul(t, wq, rows, n, x, m, y2, &same) == CAS_OK);
        CHECK(memcmp(y, y2, (size_t)(m * rows) * 4) == 0);
        cas_free(work);
        cas_free(wq);
    }
    cas_free(w);
    cas_free(wd);
    cas_free(x);
    cas_free(y);
    cas_free(y2);
}

/* Batch invariance (quant_impl.h): on one shape whose rows are not a
 * multiple of the 8-row matrix-vector group or the 4-row tile, for every
 * token count 1..33 and 1, 2 or 3 threads, each token's outputs are bitwise
 * the same as in a 33-token call (so the same as alone, m = 1), and for the
 * quantized types the portable, AVX2 and AVX-512 VNNI kernels give the same
 * bits. Each result is also checked against the float64 reference. */
static void test_all_token_counts(void) {
    cas_rng rng;
    cas_rng_seed(&rng, 11);
    const int64_t rows = 37, n = 576, M = 33;
    int avx2 = have_avx2();
    float *w = cas_alloc_array((size_t)(rows * n), 4), *wd = cas_alloc_array((size_t)(rows * n), 4);
    float *x = cas_alloc_array((size_t)(M * n), 4), *y = cas_alloc_array((size_t)(M * rows), 4);
    float *yall = cas_alloc_array((size_t)(M * rows), 4);
    double *yref = cas_alloc_array((size_t)(M * rows), 8), *tol = cas_alloc_array((size_t)(M * rows), 8);
    double *ftol = cas_alloc_array((size_t)(M * rows), 8);
    REQUIRE(w && wd && x && y && yall && yref && tol && ftol);
    fill_weights(&rng, w, rows, n);
    for (int64_t i = 0; i < M * n; i++) x[i] = (float)cas_rng_normal(&rng);
    for (int ti = 0; ti < N_TYPES; ti++) {
        int t = k_types[ti];
        uint8_t *wq = NULL;
        make_matrix(t, w, rows, n, &wq, wd);
        reference(t, wd, rows, n, x, M, yref, tol, ftol);
        /* AVX-512 (VNNI): the quantized types' 16-token kernel takes calls of 12 tokens or more */
        const int paths[] = {CAS_Q_SIMD_GENERIC, CAS_Q_SIMD_AVX2, CAS_Q_SIMD_AVX512};
        for (int pi = 0; pi < 3; pi++) {
            const int path = paths[pi];
            if (path != CAS_Q_SIMD_GENERIC && !avx2) continue;
            if (path == CAS_Q_SIMD_AVX512 && !(is_q(t) && cas_qk_avx512_available())) continue;
            cas_q_opts o = {2, (cas_q_simd)path, NULL, 0, NULL, NULL, NULL};
            if (path != CAS_Q_SIMD_GENERIC && is_q(t)) { /* the generic call's bits, kept in yall */
                poison(y, M * rows);
                CHECK(cas_q_matmul(t, wq, rows, n, x, M, y, &o) == CAS_OK);
                CHECKF(!memcmp(y, yall, (size_t)(M * rows) * 4), "%s: %s and generic differ",
                       cas_tensor_type_name(t), path == CAS_Q_SIMD_AVX2 ? "avx2" : "avx512");
            }
            CHECK(cas_q_matmul(t, wq, rows, n, x, M, yall, &o) == CAS_OK);
            for (int64_t m = 1; m <= M; m++) {
                o.nthreads = 1 + (int)(m % 3);
                poison(y, m * rows);
                CHECK(cas_q_matmul(t, wq, rows, n, x, m, y, &o) == CAS_OK);
                check_result(path == CAS_Q_SIMD_AVX512 ? "avx512 m-sweep" : path == CAS_Q_SIMD_AVX2 ? "avx2 m-sweep" : "generic m-sweep", t, rows, n, m, y,
                             yref, tol);
                CHECKF(!memcmp(y, yall, (size_t)(m * rows) * 4), "%s path %d: first %lld tokens of 33 differ",
                       cas_tensor_type_name(t), path, (long long)m);
            }
            /* each token alone (matvec) */
            for (int64_t i = 0; i < M; i += 4) {
                poison(y, rows);
                CHECK(cas_q_matvec(t, wq, rows, n, x + i * n, y, &o) == CAS_OK);
                CHECKF(!memcmp(y, yall + i * rows, (size_t)rows * 4), "%s path %d: token %lld alone differs",
                       cas_tensor_type_name(t), path, (long long)i);
            }
        }
        cas_free(wq);
    }
    cas_free(w);
    cas_free(wd);
    cas_free(x);
    cas_free(y);
    cas_free(yall);
    cas_free(yref);
    cas_free(tol);
    cas_free(ftol);
}

/* The AMX-INT8 kernels (batched calls on packed quantized weights) against
 * the reference and against the AVX2 kernels on random inputs: shapes with
 * rows that are not a multiple of the 16-row panel and odd block counts,
 * token counts around the 16-token groups; 1 and 2 threads give the same
 * bits, and a token's outputs do not depend on the other tokens of the
 * call. On a machine without AMX (or where the OS refuses the tile state)
 * the test says so and checks only that asking for AMX fails cleanly. */
static void test_amx(void) {
    static const int qt[3] = {CAS_T_Q8_0, CAS_T_Q4_0, CAS_T_Q4_1};
    float x1[64] = {0}, y1[4];
    uint8_t w1[2 * 34] = {0};
    CHECK(cas_q_packed_bytes(CAS_T_F32, 4, 32) == 0 && cas_q_packed_bytes(CAS_T_Q4_1, 4, 33) == 0);
    CHECK(cas_q_packed_bytes(CAS_T_Q4_1, 17, 64) == 2 * 2 * 320);
    CHECK(cas_q_packed_bytes(CAS_T_Q8_0, 16, 32) == 544 && cas_q_packed_bytes(CAS_T_Q4_0, 1, 32) == 288);
    CHECK(cas_q_pack(CAS_T_F16, w1, 1, 32, w1) == CAS_ERR_UNSUPPORTED);
    CHECK(cas_q_pack(CAS_T_Q8_0, NULL, 1, 32, w1) == CAS_ERR_INVALID);
    if (!cas_q_amx_available()) {
        printf("note: AMX-INT8 is not available here (CPU or OS): AMX kernels NOT tested, "
               "only that asking for them fails\n");
        cas_q_opts o = {1, CAS_Q_SIMD_AMX, NULL, 0, w1, NULL, NULL};
        if (have_avx2()) CHECK(cas_q_matmul(CAS_T_Q8_0, w1, 1, 32, x1, 2, y1, &o) == CAS_ERR_UNSUPPORTED);
        return;
    }
    printf("note: AMX-INT8 available: testing the AMX kernels against the reference and AVX2\n");
    cas_rng rng;
    cas_rng_seed(&rng, 99);
    static const int64_t shapes[][2] = {{37, 576}, {16, 32}, {64, 96}, {5, 1536}, {200, 1536}};
    static const int64_t ms[] = {2, 3, 15, 16, 17, 32, 33, 40};
    const int64_t M = 40;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t rows = shapes[si][0], n = shapes[si][1];
        float *w = cas_alloc_array((size_t)(rows * n), 4), *wd = cas_alloc_array((size_t)(rows * n), 4);
        float *x = cas_alloc_array((size_t)(M * n), 4), *y = cas_alloc_array((size_t)(M * rows), 4);
        float *y2 = cas_alloc_array((size_t)(M * rows), 4), *yall = cas_alloc_array((size_t)(M * rows), 4);
        double *yref = cas_alloc_array((size_t)(M * rows), 8), *tol = cas_alloc_array((size_t)(M * rows), 8);
        double *ftol = cas_alloc_array((size_t)(M * rows), 8);
        REQUIRE(w && wd && x && y && y2 && yall && yref && tol && ftol);
        fill_weights(&rng, w, rows, n);
        for (int64_t i = 0; i < M * n; i++) x[i] = (float)cas_rng_normal(&rng);
        if (n >= 64) /* an all-zero x block (scale 0) and a tiny one */
            for (int64_t k = 0; k < 32; k++) x[k] = 0, x[32 + k] *= 1e-6f;
        for (int ti = 0; ti < 3; ti++) {
            const int t = qt[ti];
            uint8_t *wq = NULL;
            make_matrix(t, w, rows, n, &wq, wd);
            size_t pbytes = cas_q_packed_bytes(t, rows, n);
            uint8_t *pk = cas_alloc(pbytes);
            REQUIRE(pk && pbytes > 0);
            memset(pk, 0xA5, pbytes); /* padding rows must be written too */
            CHECK(cas_q_pack(t, wq, rows, n, pk) == CAS_OK);
            reference(t, wd, rows, n, x, M, yref, tol, ftol);
            cas_q_opts amx = {2, CAS_Q_SIMD_AMX, NULL, 0, pk, NULL, NULL}, av2 = {2, CAS_Q_SIMD_AVX2, NULL, 0, NULL, NULL, NULL};
            cas_q_opts amx1 = {1, CAS_Q_SIMD_AMX, NULL, 0, pk, NULL, NULL}, aut = {2, CAS_Q_SIMD_AUTO, NULL, 0, pk, NULL, NULL};
            poison(yall, M * rows);
            CHECK(cas_q_matmul(t, wq, rows, n, x, M, yall, &amx) == CAS_OK);
            for (size_t mi = 0; mi < sizeof ms / sizeof ms[0]; mi++) {
                const int64_t m = ms[mi];
                poison(y, m * rows);
                CHECKF(cas_q_matmul(t, wq, rows, n, x, m, y, &amx) == CAS_OK, "%s", cas_last_error());
                check_result("amx", t, rows, n, m, y, yref, tol);
                poison(y2, m * rows);
                CHECK(cas_q_matmul(t, wq, rows, n, x, m, y2, &av2) == CAS_OK);
                int bad = 0;
                for (int64_t i = 0; i < m * rows && bad < 3; i++)
                    if (!(fabs((double)y[i] - y2[i]) <= ftol[i])) {
                        CHECKF(0, "%s amx vs avx2 rows %lld n %lld m %lld: y[%lld] %g vs %g", cas_tensor_type_name(t),
                               (long long)rows, (long long)n, (long long)m, (long long)i, (double)y[i], (double)y2[i]);
                        bad++;
                    }
                CHECKF(!memcmp(y, yall, (size_t)(m * rows) * 4), "%s amx: first %lld tokens of %lld differ",
                       cas_tensor_type_name(t), (long long)m, (long long)M);
                CHECKF(!memcmp(y, y2, (size_t)(m * rows) * 4), "%s amx: not the AVX2 kernels' bits",
                       cas_tensor_type_name(t));
                poison(y2, m * rows);
                CHECK(cas_q_matmul(t, wq, rows, n, x, m, y2, &amx1) == CAS_OK);
                CHECKF(!memcmp(y, y2, (size_t)(m * rows) * 4), "%s amx: 1 and 2 threads differ", cas_tensor_type_name(t));
                if (strcmp(cas_q_batch_simd_name(), "amx") == 0) { /* AUTO takes AMX given the packed copy */
                    poison(y2, m * rows);
                    CHECK(cas_q_matmul(t, wq, rows, n, x, m, y2, &aut) == CAS_OK);
                    CHECK(!memcmp(y, y2, (size_t)(m * rows) * 4));
                }
            }
            /* no packed copy: AMX refuses, AUTO falls back to AVX2 */
            amx.packed = NULL;
            CHECK(cas_q_matmul(t, wq, rows, n, x, 2, y, &amx) == CAS_ERR_INVALID);
            cas_free(pk);
            cas_free(wq);
        }
        cas_free(w);
        cas_free(wd);
        cas_free(x);
        cas_free(y);
        cas_free(y2);
        cas_free(yall);
        cas_free(yref);
        cas_free(tol);
        cas_free(ftol);
    }
}

/* The forward pass's AVX2 elementwise helpers against scalar references on
 * random inputs (NaN-poisoned outputs): SiLU-times-up within a few ulp (the
 * vector exp is within 2 ulp), F16 stores bit-exact with cas_f32_to_f16,
 * RMSNorm within f32 rounding. Without AVX2 the test says so. */
static void test_elementwise(void) {
    if (!have_avx2()) {
        printf("note: no AVX2: elementwise helpers NOT tested\n");
        return;
    }
    cas_rng rng;
    cas_rng_seed(&rng, 77);
    enum { N = 1536 + 5 };
    static float g[N], u[N], h[N], w[N], o[N];
    static uint16_t f16[N];
    for (int i = 0; i < N; i++) {
        g[i] = (float)(cas_rng_normal(&rng) * 6);
        u[i] = (float)cas_rng_normal(&rng);
        w[i] = (float)(1 + cas_rng_normal(&rng) * 0.1);
        h[i] = o[i] = NAN;
    }
    g[0] = -100, g[1] = 100, g[2] = 0, g[3] = -87.5f, g[4] = 88.5f; /* the exp clamps */
    cas_q_avx2_silu_mul(g, u, h, N);
    int bad = 0;
    for (int i = 0; i < N && bad < 3; i++) {
        double ref = (double)g[i] / (1 + exp(-(double)g[i])) * u[i];
        /* below -88.3 the exp argument is clamped: silu is g e^-88.3 (< 1e-36 |g|) instead of ~0 */
        if (!(fabs(h[i] - ref) <= 8 * 0x1p-24 * fabs(ref) + 1e-36 * fabs(g[i] * u[i]))) {
            CHECKF(0, "silu_mul[%d]: g %g u %g: %g vs %g", i, (double)g[i], (double)u[i], (double)h[i], ref);
            bad++;
        }
    }
    cas_q_avx2_f32_to_f16(g, f16, N);
    for (int i = 0; i < N; i++) CHECK(f16[i] == cas_f32_to_f16(g[i]));
    cas_q_avx2_rmsnorm(o, g, w, N, 1e-5f);
    double ss = 0;
    for (int i = 0; i < N; i++) ss += (double)g[i] * g[i];
    double sc = 1 / sqrt(ss / N + 1e-5);
    bad = 0;
    for (int i = 0; i < N && bad < 3; i++) {
        double ref = g[i] * sc * w[i];
        if (!(fabs(o[i] - ref) <= 4 * 0x1p-24 * fabs(ref) + 1e-37)) {
            CHECKF(0, "rmsnorm[%d]: %g vs %g", i, (double)o[i], ref);
            bad++;
        }
    }
}

/* The pieces a forward pass uses inside its own parallel region: x
 * quantized by the AVX2 code is bit-identical to the portable quantizer
 * (ties, zero and tiny blocks included), and row ranges computed separately
 * are bit-identical to one cas_q_matvec call. */
static void test_in_region_api(void) {
    cas_rng rng;
    cas_rng_seed(&rng, 12);
    const int64_t n = 1536, rows = 45;
    float *x = cas_alloc_array((size_t)n, 4), *w = cas_alloc_array((size_t)(rows * n), 4);
    float *wd = cas_alloc_array((size_t)(rows * n), 4), *y = cas_alloc_array((size_t)rows, 4);
    float *y2 = cas_alloc_array((size_t)rows, 4);
    size_t xb = cas_q_xvec_bytes(n);
    uint8_t *b0 = cas_alloc(xb), *b1 = cas_alloc(xb);
    REQUIRE(x && w && wd && y && y2 && b0 && b1 && xb > 0);
    for (int64_t i = 0; i < n; i++) x[i] = (float)cas_rng_normal(&rng);
    for (int64_t k = 0; k < 32; k++) x[k] = 0, x[32 + k] *= 1e-30f;
    /* exact ties of x * 127 / amax: amax 127 makes x the scaled value itself */
    x[64] = 127;
    for (int64_t k = 65; k < 96; k++) x[k] = (float)(k - 80) + 0.5f;
    int avx2 = have_avx2();
    CHECK(cas_q_resolve_avx2(CAS_Q_SIMD_GENERIC) == 0);
    CHECK(cas_q_resolve_avx2(CAS_Q_SIMD_AUTO) == avx2);
    if (avx2) {
        memset(b0, 0, xb);
        memset(b1, 0, xb);
        cas_q_xvec_quantize(CAS_T_Q4_1, x, n, b0, 0);
        cas_q_xvec_quantize(CAS_T_Q4_1, x, n, b1, 1);
        CHECK(!memcmp(b0, b1, xb));
    }
    fill_weights(&rng, w, rows, n);
    for (int ti = 0; ti < N_TYPES; ti++) {
        int t = k_types[ti];
        uint8_t *wq = NULL;
        size_t rb = 0;
        make_matrix(t, w, rows, n, &wq, wd);
        CHECK(cas_tensor_row_bytes(t, n, &rb) == CAS_OK);
        for (int a = 0; a <= avx2; a++) {
            cas_q_opts o = {1, a ? CAS_Q_SIMD_AVX2 : CAS_Q_SIMD_GENERIC, NULL, 0, NULL, NULL, NULL};
            CHECK(cas_q_matvec(t, wq, rows, n, x, y, &o) == CAS_OK);
            cas_q_xvec_quantize(t, x, n, b0, a);
            poison(y2, rows);
            int64_t covered = 0;
            for (int tid = 0; tid < 3; tid++) {
                int64_t r0, r1;
                cas_q_thread_rows(rows, tid, 3, &r0, &r1);
                CHECK(r0 == covered && r1 >= r0);
                covered = r1;
                cas_q_matvec_range(t, wq, rb, n, r0, r1, x, b0, y2, a);
            }
            CHECK(covered == rows);
            CHECKF(!memcmp(y, y2, (size_t)rows * 4), "%s path %d: ranges differ from one call",
                   cas_tensor_type_name(t), a);
        }
        cas_free(wq);
    }
    cas_free(x);
    cas_free(w);
    cas_free(wd);
    cas_free(y);
    cas_free(y2);
    cas_free(b0);
    cas_free(b1);
}

static void test_bad_input(void) {
    float x[64] = {0}, y[4] = {0}, f[64] = {0};
    uint8_t w[4 * 40] = {0};
    cas_q_opts o = {1, CAS_Q_SIMD_AUTO, NULL, 0, NULL, NULL, NULL};
    CHECK(cas_q_matvec(CAS_T_Q4_1, w, 1, 33, x, y, &o) == CAS_ERR_INVALID);
    CHECK(strlen(cas_last_error()) > 0);
    CHECK(cas_q_matvec(CAS_T_Q8_0, w, 1, 48, x, y, &o) == CAS_ERR_INVALID);
    CHECK(cas_q_matmul(CAS_T_Q4_0, w, 2, 16, x, 2, y, &o) == CAS_ERR_INVALID);
    CHECK(cas_q_matvec(CAS_T_Q4_1, NULL, 1, 32, x, y, &o) == CAS_ERR_INVALID);
    CHECK(cas_q_matvec(CAS_T_Q4_1, w, 1, 32, NULL, y, &o) == CAS_ERR_INVALID);
    CHECK(cas_q_matvec(CAS_T_Q4_1, w, 1, 32, x, NULL, &o) == CAS_ERR_INVALID);
    CHECK(cas_q_matvec(CAS_T_Q4_1, w, 0, 32, x, y, &o) == CAS_ERR_INVALID);
    CHECK(cas_q_matmul(CAS_T_Q4_1, w, 1, 32, x, 0, y, &o) == CAS_ERR_INVALID);
    CHECK(cas_q_matvec(16 /* iq2_xxs */, w, 1, 256, x, y, &o) == CAS_ERR_UNSUPPORTED);
    cas_q_opts neg = {-1, CAS_Q_SIMD_AUTO, NULL, 0, NULL, NULL, NULL};
    CHECK(cas_q_matvec(CAS_T_Q4_1, w, 1, 32, x, y, &neg) == CAS_ERR_INVALID);
    CHECK(cas_q_dequantize_row(CAS_T_Q4_0, w, f, 40) == CAS_ERR_INVALID);
    CHECK(cas_q_dequantize_row(CAS_T_Q4_0, NULL, f, 32) == CAS_ERR_INVALID);
    CHECK(cas_q_dequantize_row(CAS_T_Q4_0, w, NULL, 32) == CAS_ERR_INVALID);
    CHECK(cas_q_quantize_rows(CAS_T_Q8_0, f, w, 1, 40) == CAS_ERR_INVALID);
    CHECK(cas_q_quantize_rows(CAS_T_Q8_0, NULL, w, 1, 32) == CAS_ERR_INVALID);
    CHECK(cas_q_quantize_rows(CAS_T_Q8_0, f, w, -1, 32) == CAS_ERR_INVALID);
    CHECK(cas_q_work_bytes(CAS_T_Q4_1, 1, 33, 1, 1) == 0);
    CHECK(cas_q_work_bytes(CAS_T_Q4_1, 0, 32, 1, 1) == 0);
    double i8 = -1, f32 = -1;
    CHECK(cas_q_bench_peak(1, 0, NULL, &f32) == CAS_ERR_INVALID);
    if (have_avx2()) {
        CHECK(cas_q_bench_peak(1, 0, &i8, &f32) == CAS_OK);
        CHECK(i8 > 0 && f32 > 0);
    }
}

/* ---- K-quants, IQ4 and Q5 -------------------------------------------------
 * Q2_K..Q6_K and IQ4_XS quantize x per 256-element super-block (IQ4_NL, Q5_0
 * and Q5_1 per 32-element block) to d_b = amax_b / 127, so the x term of the tolerance is
 * sum_b (d_b / 2) sum_{i in b} |w_i| as above, with 256-element b.
 *
 * The f32 part is derived from the kernels' chain (quant_k.h): per block k
 * one fma s = fl(I_k P_k + s), with I_k = (float)isum_k and P_k = fl(d_w d_x)
 * each within a relative 2^-24, so the term I_k P_k errs by at most
 * 2 * 2^-24 |T_k| (T_k the exact term) and each of the K fmas rounds s by at
 * most 2^-24 |s| <= 2^-24 G, G = sum_k |T_k|. The types with a minimum add a
 * second chain step per block whose term can cancel the first, so G is
 * bounded by the magnitudes of the parts, not of the weights:
 *     G <= F = sum_i (|d sc_j v_i| + |dmin mn_j|) (|x_i| + d_b / 2)
 * (the parts come from dequantizing copies of the matrix with dmin, or d,
 * set to zero). The reference's own weights (the dequantized f32 values) are
 * the exact ones rounded once (the scale part is exact in f32, only the
 * minimum's subtraction rounds), another 2^-24 F. In all:
 *     |y - y_ref| <= 1.001 * xterm + (K + 4) * 2^-24 * F,
 * K = blocks per row, twice that with a minimum. Paths, thread counts and
 * batch sizes must agree bit for bit (the contract in quant_impl.h). */

static const int kq_types[] = {CAS_T_Q4_K, CAS_T_Q6_K, CAS_T_Q5_K, CAS_T_Q3_K, CAS_T_Q2_K,
                               CAS_T_IQ4_NL, CAS_T_IQ4_XS, CAS_T_Q5_0, CAS_T_Q5_1};
#define N_KQ ((int)(sizeof kq_types / sizeof kq_types[0]))

/* Q5_1's minimum m is added (x = d v + m), the others' subtracted: either way
 * a second chain step per block. */
static int kq_has_min(int t) { return t == CAS_T_Q4_K || t == CAS_T_Q5_K || t == CAS_T_Q2_K || t == CAS_T_Q5_1; }
/* the types of 32-element blocks (rows a multiple of 32, x quantized per 32) */
static int kq_b32(int t) { return t == CAS_T_IQ4_NL || t == CAS_T_Q5_0 || t == CAS_T_Q5_1; }
static int64_t kq_xblock(int t) { return kq_b32(t) ? 32 : 256; }

/* Byte offsets of a block's f16 d and dmin (-1: none), from the formats in
 * quant_impl.h. */
static void kq_scale_offsets(int t, int *d, int *dmin) {
    *dmin = -1;
    switch (t) {
    case CAS_T_Q2_K: *d = 80, *dmin = 82; break;
    case CAS_T_Q3_K: *d = 108; break;
    case CAS_T_Q4_K: case CAS_T_Q5_K: case CAS_T_Q5_1: *d = 0, *dmin = 2; break;
    case CAS_T_Q6_K: *d = 208; break;
    default: *d = 0; break;
    }
}

/* mag[i] = |scale part| + |minimum part| of each weight (|w| without a minimum). */
static void kq_magnitudes(int t, const uint8_t *wq, const float *wd, int64_t rows, int64_t n, float *mag) {
    if (!kq_has_min(t)) {
        for (int64_t i = 0; i < rows * n; i++) mag[i] = fabsf(wd[i]);
        return;
    }
    size_t rb = 0, bb = cas_tensor_block_bytes(t);
    CHECK(cas_tensor_row_bytes(t, n, &rb) == CAS_OK);
    uint8_t *c = cas_alloc(rb * (size_t)rows);
    float *part = cas_alloc_array((size_t)n, 4);
    int od, om;
    kq_scale_offsets(t, &od, &om);
    for (int pass = 0; pass < 2; pass++) {
        memcpy(c, wq, rb * (size_t)rows);
        for (size_t b = 0; b < rb * (size_t)rows / bb; b++) memset(c + b * bb + (pass ? od : om), 0, 2);
        for (int64_t r = 0; r < rows; r++) {
            CHECK(cas_q_dequantize_row(t, c + (size_t)r * rb, part, n) == CAS_OK);
            for (int64_t i = 0; i < n; i++) mag[r * n + i] = (pass ? mag[r * n + i] : 0) + fabsf(part[i]);
        }
    }
    cas_free(c);
    cas_free(part);
}

static void kq_reference(int t, const float *wd, const float *mag, int64_t rows, int64_t n, const float *x, int64_t m,
                         double *yref, double *tol) {
    const int64_t xb = kq_xblock(t), nblk = n / xb;
    const double k = (double)(kq_has_min(t) ? 2 * nblk : nblk);
    for (int64_t i = 0; i < m; i++)
        for (int64_t r = 0; r < rows; r++) {
            const float *wr = wd + r * n, *mr = mag + r * n, *xi = x + i * n;
            double s = 0, xterm = 0, f = 0;
            for (int64_t b = 0; b < n; b += xb) {
                double amx = 0, sw = 0;
                for (int64_t e = b; e < b + xb; e++) amx = fmax(amx, fabs(xi[e]));
                const double d = amx / 127;
                for (int64_t e = b; e < b + xb; e++) {
                    s += (double)wr[e] * xi[e];
                    sw += fabs(wr[e]);
                    f += mr[e] * (fabs(xi[e]) + d / 2);
                }
                xterm += d / 2 * sw;
            }
            yref[i * rows + r] = s;
            tol[i * rows + r] = 1.001 * xterm + (k + 4) * 0x1p-24 * f + 1e-30;
        }
}

/* Random x for m tokens with, where n allows, an all-zero block, a tiny one
 * and one so tiny (below 2^-120) that the quantizer divides instead. */
static void kq_fill_x(cas_rng *rng, int t, float *x, int64_t m, int64_t n) {
    const int64_t xb = kq_xblock(t);
    for (int64_t i = 0; i < m * n; i++) x[i] = (float)cas_rng_normal(rng);
    if (n >= 4 * xb)
        for (int64_t e = 0; e < xb; e++) x[e] = 0, x[xb + e] *= 1e-6f, x[2 * xb + e] *= 1e-38f;
}

static const char *kq_path_name(int path) {
    return path == CAS_Q_SIMD_AVX512 ? "avx512" : path == CAS_Q_SIMD_AVX2 ? "avx2" : "generic";
}

/* The paths this CPU runs: generic, AVX2, and AVX-512 (whose K-quant batched
 * kernels need VNNI as well); *np of them into paths[3]. */
static void kq_paths(int paths[3], int *np) {
    *np = 0;
    paths[(*np)++] = CAS_Q_SIMD_GENERIC;
    if (have_avx2()) paths[(*np)++] = CAS_Q_SIMD_AVX2;
    if (have_avx2() && cas_qk_avx512_available()) paths[(*np)++] = CAS_Q_SIMD_AVX512;
}

/* One (type, shape): every path and 1-3 threads against the reference, bit
 * for bit against each other, and each token of a batch bit for bit against
 * its own matvec. */
static void kq_case(int t, int64_t rows, int64_t n, const int64_t *ms, int nm, cas_rng *rng) {
    int64_t mmax = 0;
    for (int i = 0; i < nm; i++) mmax = ms[i] > mmax ? ms[i] : mmax;
    float *w = cas_alloc_array((size_t)(rows * n), 4), *wd = cas_alloc_array((size_t)(rows * n), 4);
    float *mag = cas_alloc_array((size_t)(rows * n), 4), *x = cas_alloc_array((size_t)(mmax * n), 4);
    float *y = cas_alloc_array((size_t)(mmax * rows), 4), *yg = cas_alloc_array((size_t)(mmax * rows), 4);
    float *y1 = cas_alloc_array((size_t)rows, 4);
    double *yref = cas_alloc_array((size_t)(mmax * rows), 8), *tol = cas_alloc_array((size_t)(mmax * rows), 8);
    uint8_t *wq = NULL;
    REQUIRE(w && wd && mag && x && y && yg && y1 && yref && tol);
    fill_weights(rng, w, rows, n);
    make_matrix(t, w, rows, n, &wq, wd);
    kq_magnitudes(t, wq, wd, rows, n, mag);
    for (int mi = 0; mi < nm; mi++) {
        const int64_t m = ms[mi];
        kq_fill_x(rng, t, x, m, n);
        kq_reference(t, wd, mag, rows, n, x, m, yref, tol);
        int first = 1;
        int paths[3], np;
        kq_paths(paths, &np);
        for (int pi = 0; pi < np; pi++) {
            const int path = paths[pi];
            for (int nt = 1; nt <= 3; nt++) {
                cas_q_opts o = {nt, (cas_q_simd)path, NULL, 0, NULL, NULL, NULL};
                poison(y, m * rows);
                cas_status st = m == 1 ? cas_q_matvec(t, wq, rows, n, x, y, &o) : cas_q_matmul(t, wq, rows, n, x, m, y, &o);
                CHECKF(st == CAS_OK, "%s", cas_last_error());
                check_result(kq_path_name(path), t, rows, n, m, y, yref, tol);
                if (first) {
                    memcpy(yg, y, (size_t)(m * rows) * 4);
                    first = 0;
                } else {
                    CHECKF(!memcmp(y, yg, (size_t)(m * rows) * 4), "%s rows %lld n %lld m %lld: %s with %d threads "
                           "differs from the first path", cas_tensor_type_name(t), (long long)rows, (long long)n,
                           (long long)m, kq_path_name(path), nt);
                }
                if (m > 1 && nt == 2)
                    for (int64_t i = 0; i < m; i++) {
                        poison(y1, rows);
                        CHECK(cas_q_matvec(t, wq, rows, n, x + i * n, y1, &o) == CAS_OK);
                        CHECKF(!memcmp(y1, y + i * rows, (size_t)rows * 4), "%s %s: token %lld of %lld differs from "
                               "its matvec", cas_tensor_type_name(t), kq_path_name(path), (long long)i, (long long)m);
                    }
            }
        }
    }
    cas_free(wq);
    cas_free(w);
    cas_free(wd);
    cas_free(mag);
    cas_free(x);
    cas_free(y);
    cas_free(yg);
    cas_free(y1);
    cas_free(yref);
    cas_free(tol);
}

static void test_kq_kernels(void) {
    cas_rng rng;
    cas_rng_seed(&rng, 4242);
    if (!have_avx2()) printf("note: no AVX2 on this CPU; K-quant kernels tested on the portable path only\n");
    /* n: one super-block, and 3, 7, 11 of them (no power of two); rows not
     * a multiple of the 8-row group, one whole group, one row */
    static const int64_t ns[] = {256, 768, 1792, 2816};
    static const int64_t rowss[] = {1, 8, 13, 67};
    for (int ti = 0; ti < N_KQ; ti++) {
        const int t = kq_types[ti];
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 4; b++) {
                const int64_t n = ns[a], rows = rowss[b];
                int64_t ms[3] = {1, 3, 17};
                kq_case(t, rows, n, ms, rows * n <= 13 * 2816 ? 3 : 2, &rng);
            }
        if (kq_b32(t)) { /* rows of 32-element blocks: the model's 576 and 1536 */
            int64_t ms[3] = {1, 2, 17};
            kq_case(t, 11, 32, ms, 3, &rng);
            kq_case(t, 37, 576, ms, 3, &rng);
            kq_case(t, 9, 1504, ms, 2, &rng);
        }
    }
}

/* Batch invariance: for every token count 1..40 and thread counts 1-3, row i
 * of the batched result is bitwise the matvec of token i alone, on both
 * paths (which also agree with each other). */
static void test_kq_batch_invariance(void) {
    cas_rng rng;
    cas_rng_seed(&rng, 77);
    const int64_t rows = 37, M = 40;
    for (int ti = 0; ti < N_KQ; ti++) {
        const int t = kq_types[ti];
        const int64_t n = kq_b32(t) ? 576 : 768;
        float *w = cas_alloc_array((size_t)(rows * n), 4), *wd = cas_alloc_array((size_t)(rows * n), 4);
        float *x = cas_alloc_array((size_t)(M * n), 4), *y = cas_alloc_array((size_t)(M * rows), 4);
        float *alone = cas_alloc_array((size_t)(M * rows), 4), *alone_g = cas_alloc_array((size_t)(M * rows), 4);
        uint8_t *wq = NULL;
        REQUIRE(w && wd && x && y && alone && alone_g);
        fill_weights(&rng, w, rows, n);
        make_matrix(t, w, rows, n, &wq, wd);
        kq_fill_x(&rng, t, x, M, n);
        int paths[3], np;
        kq_paths(paths, &np);
        for (int pi = 0; pi < np; pi++) {
            const int path = paths[pi];
            for (int64_t i = 0; i < M; i++) {
                cas_q_opts o = {1, (cas_q_simd)path, NULL, 0, NULL, NULL, NULL};
                CHECK(cas_q_matvec(t, wq, rows, n, x + i * n, alone + i * rows, &o) == CAS_OK);
            }
            if (path == CAS_Q_SIMD_GENERIC)
                memcpy(alone_g, alone, (size_t)(M * rows) * 4);
            else
                CHECKF(!memcmp(alone, alone_g, (size_t)(M * rows) * 4), "%s: %s matvec differs from generic",
                       cas_tensor_type_name(t), kq_path_name(path));
            int bad = 0;
            for (int64_t m = 1; m <= M && bad < 3; m++) {
                cas_q_opts o = {1 + (int)(m % 3), (cas_q_simd)path, NULL, 0, NULL, NULL, NULL};
                poison(y, m * rows);
                CHECK(cas_q_matmul(t, wq, rows, n, x, m, y, &o) == CAS_OK);
                if (memcmp(y, alone, (size_t)(m * rows) * 4)) {
                    CHECKF(0, "%s %s m=%lld: batched rows differ from matvec alone", cas_tensor_type_name(t),
                           kq_path_name(path), (long long)m);
                    bad++;
                }
            }
        }
        cas_free(wq);
        cas_free(w);
        cas_free(wd);
        cas_free(x);
        cas_free(y);
        cas_free(alone);
        cas_free(alone_g);
    }
}

/* The forward pass's in-region pieces on K-quant weights: x quantized by
 * either path is the same bytes, and row ranges are bitwise one matvec. */
static void test_kq_in_region(void) {
    cas_rng rng;
    cas_rng_seed(&rng, 31);
    const int64_t rows = 45;
    const int avx2 = have_avx2();
    for (int ti = 0; ti < N_KQ; ti++) {
        const int t = kq_types[ti];
        const int64_t n = kq_b32(t) ? 1536 : 1792;
        float *x = cas_alloc_array((size_t)n, 4), *w = cas_alloc_array((size_t)(rows * n), 4);
        float *wd = cas_alloc_array((size_t)(rows * n), 4), *y = cas_alloc_array((size_t)rows, 4);
        float *y2 = cas_alloc_array((size_t)rows, 4);
        const size_t xb = cas_q_xvec_bytes(n);
        uint8_t *b0 = cas_alloc(xb), *b1 = cas_alloc(xb), *wq = NULL;
        REQUIRE(x && w && wd && y && y2 && b0 && b1);
        kq_fill_x(&rng, t, x, 1, n);
        /* exact ties of x * 127 / amax (amax 127: the scaled value is x itself) */
        x[kq_xblock(t) * 3] = 127;
        for (int64_t k = 1; k < 31; k++) x[kq_xblock(t) * 3 + k] = (float)(k - 15) + 0.5f;
        fill_weights(&rng, w, rows, n);
        make_matrix(t, w, rows, n, &wq, wd);
        size_t rb = 0;
        CHECK(cas_tensor_row_bytes(t, n, &rb) == CAS_OK);
        if (avx2) {
            memset(b0, 0xA5, xb);
            memset(b1, 0xA5, xb);
            cas_q_xvec_quantize(t, x, n, b0, 0);
            cas_q_xvec_quantize(t, x, n, b1, 1);
            CHECKF(!memcmp(b0, b1, xb), "%s: quantized x differs between paths", cas_tensor_type_name(t));
        }
        for (int a = 0; a <= avx2; a++) {
            cas_q_opts o = {1, a ? CAS_Q_SIMD_AVX2 : CAS_Q_SIMD_GENERIC, NULL, 0, NULL, NULL, NULL};
            poison(y, rows);
            CHECK(cas_q_matvec(t, wq, rows, n, x, y, &o) == CAS_OK);
            cas_q_xvec_quantize(t, x, n, b0, a);
            poison(y2, rows);
            for (int tid = 0; tid < 3; tid++) {
                int64_t r0, r1;
                cas_q_thread_rows(rows, tid, 3, &r0, &r1);
                cas_q_matvec_range(t, wq, rb, n, r0, r1, x, b0, y2, a);
            }
            CHECKF(!memcmp(y, y2, (size_t)rows * 4), "%s path %d: ranges differ from one call", cas_tensor_type_name(t), a);
        }
        cas_free(wq);
        cas_free(x);
        cas_free(w);
        cas_free(wd);
        cas_free(y);
        cas_free(y2);
        cas_free(b0);
        cas_free(b1);
    }
}

/* The layouts against ggml's, through an implementation that is not ours:
 * tests/fixtures/kquant_blocks.gguf holds random blocks of every type and
 * their values as the `gguf` Python package decodes them
 * (tests/fixtures/make_kquant_blocks.py). The dequantizer must give the same
 * bits (both compute d * sc * v exactly and round the minimum's subtraction
 * once), and each kernel's matvec with one-hot x picks those values out. */
static void test_kq_fixture(void) {
    cas_gguf *g = NULL;
    REQUIRE(cas_gguf_open("tests/fixtures/kquant_blocks.gguf", &g) == CAS_OK);
    for (int ti = 0; ti < N_KQ; ti++) {
        const int t = kq_types[ti];
        char name[32];
        snprintf(name, sizeof name, "%s.f32", cas_tensor_type_name(t));
        const cas_gguf_tensor *q = cas_gguf_find_tensor(g, cas_tensor_type_name(t)), *f = cas_gguf_find_tensor(g, name);
        CHECKF(q && f, "%s missing from the fixture", cas_tensor_type_name(t));
        if (!q || !f) continue;
        CHECK(q->type == (cas_ttype)t && f->type == CAS_T_F32 && q->ne[0] == f->ne[0] && q->ne[1] == f->ne[1]);
        const int64_t rows = q->ne[1], n = q->ne[0];
        size_t rb = 0;
        CHECK(cas_tensor_row_bytes(t, n, &rb) == CAS_OK && rb * (size_t)rows == q->nbytes);
        float *d = cas_alloc_array((size_t)(rows * n), 4), *x = cas_alloc_array((size_t)n, 4);
        float *y = cas_alloc_array((size_t)rows, 4);
        REQUIRE(d && x && y);
        for (int64_t r = 0; r < rows; r++)
            CHECK(cas_q_dequantize_row(t, (const uint8_t *)q->data + (size_t)r * rb, d + r * n, n) == CAS_OK);
        CHECKF(!memcmp(d, f->data, (size_t)(rows * n) * 4), "%s: dequantized values differ from the gguf package's",
               cas_tensor_type_name(t));
        /* one-hot x quantizes to q = 127, d = fl(1/127): the chain computes each part
         * (d sc v and dmin mn, whose difference w is) within 3 * 2^-24 of its magnitude
         * (d_x, d_w d_x and the fma each round once), and the two parts' sum once more */
        float *mag = cas_alloc_array((size_t)(rows * n), 4);
        REQUIRE(mag);
        kq_magnitudes(t, q->data, d, rows, n, mag);
        int paths[3], np;
        kq_paths(paths, &np);
        for (int pi = 0; pi < np; pi++) {
            const int path = paths[pi];
            cas_q_opts o = {1, (cas_q_simd)path, NULL, 0, NULL, NULL, NULL};
            int bad = 0;
            for (int64_t k = 0; k < n && bad < 3; k += 7) {
                memset(x, 0, (size_t)n * 4);
                x[k] = 1;
                poison(y, rows);
                CHECK(cas_q_matvec(t, q->data, rows, n, x, y, &o) == CAS_OK);
                for (int64_t r = 0; r < rows; r++) {
                    const float want = ((const float *)f->data)[r * n + k];
                    if (!(fabsf(y[r] - want) <= 5 * 0x1p-24f * mag[r * n + k])) {
                        CHECKF(0, "%s %s column %lld row %lld: %g vs %g", cas_tensor_type_name(t), kq_path_name(path),
                               (long long)k, (long long)r, (double)y[r], (double)want);
                        bad++;
                    }
                }
            }
        }
        cas_free(mag);
        cas_free(d);
        cas_free(x);
        cas_free(y);
    }
    cas_gguf_close(g);
}

/* The test quantizer's round trip, per element (see quant_k.c): affine types
 * (levels L, scale multipliers up to S) err by at most half their sub-block's
 * step, at most R_j / L + d, plus half of dmin, with d = R_max / (L S) and
 * dmin = M_max / S (R_j the range of sub-block j including zero, M_j its
 * magnitude below zero); symmetric types (levels qlo..qhi) by one step,
 * amax_j / |qlo| + d, for the value of the opposite sign; the IQ4 types by
 * 14 steps (the table's widest half-gap is 12, and 127 lies 14 from 113).
 * Q5_0 (levels -16..15 against the extreme value) errs by one step for the
 * opposite sign, Q5_1 (0..31 from the block's minimum) by half a step.
 * Each bound gets 2^-9 of the largest magnitude for the f16 scales. */
static void test_kq_roundtrip(void) {
    cas_rng rng;
    cas_rng_seed(&rng, 5);
    const int64_t rows = 6, n = 1024;
    float *w = cas_alloc_array((size_t)(rows * n), 4), *wd = cas_alloc_array((size_t)(rows * n), 4);
    REQUIRE(w && wd);
    fill_weights(&rng, w, rows, n);
    for (int64_t i = 0; i < 256; i++) w[i] = 0;                     /* an all-zero super-block */
    for (int64_t i = 256; i < 512; i++) w[i] = fabsf(w[i]) + 0.5f; /* all positive */
    for (int64_t i = 512; i < 768; i++) w[i] = -fabsf(w[i]) - 0.5f; /* all negative */
    for (int ti = 0; ti < N_KQ; ti++) {
        const int t = kq_types[ti];
        uint8_t *q = NULL;
        make_matrix(t, w, rows, n, &q, wd);
        const int sub = t == CAS_T_Q4_K || t == CAS_T_Q5_K || t == CAS_T_IQ4_XS || kq_b32(t) ? 32 : 16;
        const int64_t bs = kq_xblock(t);
        int bad = 0;
        for (int64_t b = 0; b < rows * n && bad < 3; b += bs) {
            double rmax = 0, mmax = 0, amax = 0, big = 0;
            for (int64_t j = b; j < b + bs; j += sub) {
                double lo = 0, hi = w[j], am = 0;
                for (int64_t e = j; e < j + sub; e++) lo = fmin(lo, w[e]), hi = fmax(hi, w[e]), am = fmax(am, fabs(w[e]));
                rmax = fmax(rmax, hi - lo), mmax = fmax(mmax, -lo), amax = fmax(amax, am);
                big = fmax(big, fmax(hi - lo, am));
            }
            for (int64_t j = b; j < b + bs; j += sub) {
                double lo = 0, hi = w[j], am = 0, bound;
                for (int64_t e = j; e < j + sub; e++) lo = fmin(lo, w[e]), hi = fmax(hi, w[e]), am = fmax(am, fabs(w[e]));
                switch (t) {
                case CAS_T_Q4_K: bound = (hi - lo) / 15 / 2 + rmax / (15 * 63) / 2 + mmax / 63 / 2; break;
                case CAS_T_Q5_K: bound = (hi - lo) / 31 / 2 + rmax / (31 * 63) / 2 + mmax / 63 / 2; break;
                case CAS_T_Q2_K: bound = (hi - lo) / 3 / 2 + rmax / (3 * 15) / 2 + mmax / 15 / 2; break;
                case CAS_T_Q6_K: bound = am / 32 + amax / (32 * 127); break;
                case CAS_T_Q3_K: bound = am / 4 + amax / (4 * 31); break;
                case CAS_T_IQ4_XS: bound = 14 * (am / 127 + amax / (127 * 31)); break;
                case CAS_T_Q5_0: bound = am / 16; break;           /* levels -16..15 */
                case CAS_T_Q5_1: bound = (hi - lo) / 31 / 2; break; /* levels 0..31 over the block's range */
                default: bound = 14 * am / 127; break;
                }
                bound += big * 0x1p-9;
                for (int64_t e = j; e < j + sub; e++)
                    if (!(fabs((double)wd[e] - w[e]) <= bound) && bad < 3) {
                        CHECKF(0, "%s element %lld: %g -> %g (bound %g)", cas_tensor_type_name(t), (long long)e,
                               (double)w[e], (double)wd[e], bound);
                        bad++;
                    }
            }
        }
        for (int64_t i = 0; i < 256; i++) CHECK(wd[i] == 0);
        cas_free(q);
    }
    cas_free(w);
    cas_free(wd);
}

static void test_kq_type_info(void) {
    size_t rb = 0;
    static const struct { int t; size_t bytes; int64_t bs; const char *name; } want[] = {
        {CAS_T_Q2_K, 84, 256, "q2_k"},   {CAS_T_Q3_K, 110, 256, "q3_k"},  {CAS_T_Q4_K, 144, 256, "q4_k"},
        {CAS_T_Q5_K, 176, 256, "q5_k"},  {CAS_T_Q6_K, 210, 256, "q6_k"},  {CAS_T_IQ4_NL, 18, 32, "iq4_nl"},
        {CAS_T_IQ4_XS, 136, 256, "iq4_xs"}, {CAS_T_Q5_0, 22, 32, "q5_0"},  {CAS_T_Q5_1, 24, 32, "q5_1"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        CHECK(cas_tensor_type_supported(want[i].t));
        CHECK(cas_tensor_block_bytes(want[i].t) == want[i].bytes && cas_tensor_block_size(want[i].t) == want[i].bs);
        CHECK(cas_ttype_block_bytes(want[i].t) == (int64_t)want[i].bytes && cas_ttype_block_size(want[i].t) == want[i].bs);
        CHECK(strcmp(cas_tensor_type_name(want[i].t), want[i].name) == 0);
        CHECK(cas_tensor_row_bytes(want[i].t, 3 * want[i].bs, &rb) == CAS_OK && rb == 3 * want[i].bytes);
        CHECK(cas_tensor_row_bytes(want[i].t, want[i].bs + 32 * (want[i].bs > 32), &rb) == (want[i].bs > 32 ? CAS_ERR_INVALID : CAS_OK));
    }
    /* the model's 576-wide rows take IQ4_NL, Q5_0 and Q5_1 but no super-block type */
    CHECK(cas_tensor_row_bytes(CAS_T_Q4_K, 576, &rb) == CAS_ERR_INVALID && strstr(cas_last_error(), "256"));
    CHECK(cas_tensor_row_bytes(CAS_T_IQ4_NL, 576, &rb) == CAS_OK && rb == 18 * 18);
    CHECK(cas_tensor_row_bytes(CAS_T_Q5_0, 576, &rb) == CAS_OK && rb == 18 * 22);
    CHECK(cas_tensor_row_bytes(CAS_T_Q5_1, 576, &rb) == CAS_OK && rb == 18 * 24);
    /* K-quant weights have no packed (AMX) layout: batched calls take the vector kernels */
    CHECK(cas_q_packed_bytes(CAS_T_Q4_K, 16, 256) == 0 && cas_q_packed_block_bytes(CAS_T_Q6_K) == 0);
    uint8_t w[144] = {0};
    float x[512] = {0}, y[2];
    cas_q_opts o = {1, CAS_Q_SIMD_AUTO, NULL, 0, w, NULL, NULL};
    CHECK(cas_q_matmul(CAS_T_Q4_K, NULL, 1, 256, x, 2, y, &o) == CAS_ERR_INVALID);
    o.simd = CAS_Q_SIMD_AMX; /* no AMX kernels for these types: AMX takes the vector path */
    if (have_avx2()) CHECK(cas_q_matmul(CAS_T_Q4_K, w, 1, 256, x, 2, y, &o) == CAS_OK && y[0] == 0 && y[1] == 0);
    /* an id the kernels cannot compute with is named in the error */
    CHECK(cas_tensor_row_bytes(16, 256, &rb) == CAS_ERR_UNSUPPORTED && strstr(cas_last_error(), "iq2_xxs"));
    CHECK(cas_q_matvec(CAS_T_Q8_K, w, 1, 256, x, y, NULL) == CAS_ERR_UNSUPPORTED && strstr(cas_last_error(), "q8_k"));
}

/* ---- benchmark mode --------------------------------------------------------- */

static void bench_line(const char *label, int t, int64_t rows, int64_t n, int64_t m, int cold, double bw,
                       double *secs) {
    cas_q_bench_result r;
    cas_status st = cas_q_bench(t, rows, n, m, 2, cold, 0.5, &r);
    if (st) {
        printf("%s: error %s\n", label, cas_last_error());
        return;
    }
    printf("%-34s %-5s %6lldx%-5lld m=%-3lld %s  %8.1f us  %6.1f GB/s weights (%3.0f%% of read bw)  %6.1f GFLOP/s\n",
           label, cas_tensor_type_name(t), (long long)rows, (long long)n, (long long)m,
           cold ? "cold" : "hot ", r.seconds * 1e6, r.weight_gbs, 100 * r.weight_gbs / bw, r.gflops);
    if (secs) *secs = r.seconds;
}

static int bench_main(void) {
    double bw = 0;
    if (cas_q_bench_read_bw(2, (size_t)1 << 30, 1.0, &bw)) {
        printf("read bandwidth: %s\n", cas_last_error());
        return 1;
    }
    printf("simd path: %s; read bandwidth (2 threads, sum of 1 GiB): %.1f GB/s\n", cas_q_simd_name(), bw);
    double s1 = 0, s32 = 0;
    bench_line("decode: ffn down/up", CAS_T_Q4_1, 576, 1536, 1, 1, bw, &s1);
    bench_line("decode: ffn down/up", CAS_T_Q4_1, 576, 1536, 1, 0, bw, NULL);
    bench_line("decode: ffn up (1536 rows)", CAS_T_Q4_1, 1536, 576, 1, 1, bw, NULL);
    bench_line("batched 32 tokens", CAS_T_Q4_1, 576, 1536, 32, 1, bw, &s32);
    if (s1 > 0 && s32 > 0)
        printf("  -> 32 tokens cost %.1fx one matvec (%.1fx the tokens/s)\n", s32 / s1, 32 * s1 / s32);
    bench_line("decode: output embedding", CAS_T_Q8_0, 49152, 576, 1, 1, bw, &s1);
    bench_line("batched 32 tokens", CAS_T_Q8_0, 49152, 576, 32, 1, bw, &s32);
    if (s1 > 0 && s32 > 0)
        printf("  -> 32 tokens cost %.1fx one matvec (%.1fx the tokens/s)\n", s32 / s1, 32 * s1 / s32);
    for (int i = 0; i < N_TYPES; i++) bench_line("decode 1536x576 all types", k_types[i], 1536, 576, 1, 1, bw, NULL);
    /* K-quants: of the 135M model's matrices only ffn_down (576 x 1536) has rows that are a
     * multiple of 256; IQ4_NL (32-element blocks) takes the 576-wide ones too */
    static const int cmp[] = {CAS_T_Q4_1, CAS_T_Q8_0};
    for (int i = 0; i < 2; i++) bench_line("decode ffn down 576x1536", cmp[i], 576, 1536, 1, 1, bw, NULL);
    for (int i = 0; i < N_KQ; i++) bench_line("decode ffn down 576x1536", kq_types[i], 576, 1536, 1, 1, bw, NULL);
    for (int i = 0; i < N_KQ; i++)
        if (kq_b32(kq_types[i])) bench_line("decode ffn up 1536x576", kq_types[i], 1536, 576, 1, 1, bw, NULL);
    for (int i = 0; i < 2; i++) bench_line("batched 32 tokens", cmp[i], 576, 1536, 32, 1, bw, NULL);
    for (int i = 0; i < N_KQ; i++) bench_line("batched 32 tokens", kq_types[i], 576, 1536, 32, 1, bw, NULL);
    bench_line("batched 128 tokens", CAS_T_Q4_1, 1536, 576, 128, 1, bw, NULL);
    bench_line("batched 32 tokens", CAS_T_F32, 1536, 576, 32, 1, bw, NULL);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--bench") == 0) return bench_main();
    RUN(test_type_info);
    RUN(test_layout);
    RUN(test_roundtrip);
    RUN(test_bad_input);
    RUN(test_workspace_and_env);
    RUN(test_kernels);
    RUN(test_all_token_counts);
    RUN(test_in_region_api);
    RUN(test_amx);
    RUN(test_elementwise);
    RUN(test_kq_type_info);
    RUN(test_kq_fixture);
    RUN(test_kq_roundtrip);
    RUN(test_kq_kernels);
    RUN(test_kq_batch_invariance);
    RUN(test_kq_in_region);
    return check_summary();
}
