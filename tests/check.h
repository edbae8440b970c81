/*
 * check.h: the tests' small harness. A test program defines test functions,
 * lists them in main with RUN(fn), and ends with `return check_summary();`,
 * which prints "N passed, N failed" (the line tests/run_all.sh adds up).
 * CHECK records a failure with file and line and lets the test go on;
 * REQUIRE also returns from the test function.
 */
#ifndef CASCADE_TEST_CHECK_H
#define CASCADE_TEST_CHECK_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int check_tests_passed, check_tests_failed, check_cur_failed;
static const char *check_cur_name = "";

#define CHECK(cond)                                                                    \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            if (check_cur_failed < 5)                                                  \
                printf("FAIL %s: %s:%d: %s\n", check_cur_name, __FILE__, __LINE__, #cond); \
            check_cur_failed++;                                                        \
        }                                                                              \
    } while (0)

#define CHECKF(cond, ...)                                                              \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            if (check_cur_failed < 5) {                                                \
                printf("FAIL %s: %s:%d: %s: ", check_cur_name, __FILE__, __LINE__, #cond); \
                printf(__VA_ARGS__);                                                   \
                printf("\n");                                                          \
            }                                                                          \
            check_cur_failed++;                                                        \
        }                                                                              \
    } while (0)

#define REQUIRE(cond)                                                                  \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            printf("FAIL %s: %s:%d: %s (stopping this test)\n", check_cur_name, __FILE__, \
                   __LINE__, #cond);                                                   \
            check_cur_failed++;                                                        \
            return;                                                                    \
        }                                                                              \
    } while (0)

/* The index of the largest of x[0..n) (the first of equals). */
static inline int32_t check_argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* The gap between the largest and the second largest of x[0..n). */
static inline float check_top2_gap(const float *x, int32_t n) {
    float a = -INFINITY, b = -INFINITY;
    for (int32_t i = 0; i < n; i++) {
        if (x[i] > a) b = a, a = x[i];
        else if (x[i] > b) b = x[i];
    }
    return a - b;
}

/* main's REQUIRE: a set-up step that failed ends the program with its message */
#define REQUIRE_MAIN(cond)                                                             \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            printf("FAIL set-up: %s: %s\n", #cond, cas_last_error());                  \
            return 1;                                                                  \
        }                                                                              \
    } while (0)

#define RUN(fn)                                                                        \
    do {                                                                               \
        check_cur_name = #fn;                                                          \
        check_cur_failed = 0;                                                          \
        fn();                                                                          \
        if (check_cur_failed) {                                                        \
            check_tests_failed++;                                                      \
            printf("FAIL %s (%d checks failed)\n", #fn, check_cur_failed);             \
        } else {                                                                       \
            check_tests_passed++;                                                      \
            printf("ok %s\n", #fn);                                                    \
        }                                                                              \
        fflush(stdout);                                                                \
    } while (0)

/* max |a[i] - b[i]| over n values (NaN counts as the largest), and their
 * mean in *mean */
static inline float check_max_abs_diff(const float *a, const float *b, size_t n, double *mean) {
    float m = 0;
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        sum += d;
        if (!(d <= m)) m = d;
    }
    *mean = n ? sum / (double)n : 0.0;
    return m;
}

static inline int check_summary(void) {
    printf("%d passed, %d failed\n", check_tests_passed, check_tests_failed);
    return check_tests_failed ? 1 : 0;
}

#endif
