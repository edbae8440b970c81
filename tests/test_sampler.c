/*
 * test_sampler.c: the sampler and the stop checker (model.h). Sampling is
 * checked by its distribution: greedy is the argmax; each filter (top-k,
 * top-p, min-p) leaves exactly the tokens it should, seen over many draws; a
 * seed reproduces its sequence; temperature sharpens; bad values are refused
 * with a message. Stop strings are checked for text split at every byte, so
 * that a stop string spread over several tokens is caught and never shown.
 */
#include <string.h>

#include "../src/model/model.h"
#include "check.h"

#define V 16

/* logits with softmax probabilities proportional to w */
static void make_logits(float *l, const double *w) {
    for (int i = 0; i < V; i++) l[i] = w[i] > 0 ? (float)log(w[i]) : -1e30f;
}

static void draw_counts(const cas_sampler_params *p, const float *l, int n, int *count) {
    cas_sampler *s = NULL;
    memset(count, 0, sizeof(int) * V);
    if (cas_sampler_create(p, V, &s) != CAS_OK) return;
    for (int i = 0; i < n; i++) {
        int32_t t = cas_sampler_sample(s, l);
        if (t >= 0 && t < V) count[t]++;
    }
    cas_sampler_destroy(s);
}

static const double k_w[V] = {0.30, 0.20, 0.15, 0.10, 0.08, 0.06, 0.04, 0.03,
                              0.02, 0.01, 0.005, 0.003, 0.001, 0.0005, 0.0003, 0.0002};

static cas_sampler_params plain(void) {
    cas_sampler_params p = {1.0f, 0, 1.0f, 0.0f, 123};
    return p;
}

static void test_greedy(void) {
    float l[V];
    make_logits(l, k_w);
    l[5] = 10; /* the argmax */
    cas_sampler_params p = plain();
    p.temperature = 0;
    int c[V];
    draw_counts(&p, l, 50, c);
    CHECK(c[5] == 50);
}

static void test_plain_distribution(void) {
    float l[V];
    make_logits(l, k_w);
    cas_sampler_params p = plain();
    int n = 40000, c[V];
    draw_counts(&p, l, n, c);
    double wsum = 0;
    for (int i = 0; i < V; i++) wsum += k_w[i];
    for (int i = 0; i < 6; i++) {
        double want = k_w[i] / wsum * n, sd = sqrt(want);
        CHECKF(fabs(c[i] - want) < 5 * sd + 5, "token %d: %d draws, expected %.0f", i, c[i], want);
    }
}

static void test_top_k(void) {
    float l[V];
    make_logits(l, k_w);
    cas_sampler_params p = plain();
    p.top_k = 3;
    int c[V];
    draw_counts(&p, l, 20000, c);
    for (int i = 3; i < V; i++) CHECK(c[i] == 0);
    CHECK(c[0] > c[1] && c[1] > c[2] && c[2] > 0);
    /* renormalised among the three: 0.30 / 0.65 */
    CHECK(fabs(c[0] / 20000.0 - 0.30 / 0.65) < 0.02);
}

static void test_top_p(void) {
    float l[V];
    make_logits(l, k_w);
    cas_sampler_params p = plain();
    p.top_p = 0.6f; /* 0.30 + 0.20 + 0.15 = 0.65 is the smallest set reaching 0.6 */
    int c[V];
    draw_counts(&p, l, 20000, c);
    for (int i = 3; i < V; i++) CHECK(c[i] == 0);
    CHECK(c[2] > 0);
}

static void test_min_p(void) {
    float l[V];
    make_logits(l, k_w);
    cas_sampler_params p = plain();
    p.min_p = 0.3f; /* keeps p >= 0.09: tokens 0..3 */
    int c[V];
    draw_counts(&p, l, 20000, c);
    for (int i = 4; i < V; i++) CHECK(c[i] == 0);
    CHECK(c[3] > 0);
}

static void test_temperature_sharpens(void) {
    float l[V];
    make_logits(l, k_w);
    cas_sampler_params p = plain();
    int hot[V], cold[V];
    p.temperature = 2.0f;
    draw_counts(&p, l, 20000, hot);
    p.temperature = 0.3f;
    draw_counts(&p, l, 20000, cold);
    CHECK(cold[0] > hot[0]);
    CHECK(cold[8] < hot[8]);
}

static void test_seed_reproducible(void) {
    float l[V];
    make_logits(l, k_w);
    cas_sampler_params p = plain();
    cas_sampler *a = NULL, *b = NULL, *c = NULL;
    REQUIRE(cas_sampler_create(&p, V, &a) == CAS_OK);
    REQUIRE(cas_sampler_create(&p, V, &b) == CAS_OK);
    p.seed = 124;
    REQUIRE(cas_sampler_create(&p, V, &c) == CAS_OK);
    int same = 1, differ = 0;
    for (int i = 0; i < 200; i++) {
        int32_t x = cas_sampler_sample(a, l), y = cas_sampler_sample(b, l), z = cas_sampler_sample(c, l);
        same &= x == y;
        differ |= x != z;
    }
    CHECK(same);
    CHECK(differ);
    cas_sampler_destroy(a);
    cas_sampler_destroy(b);
    cas_sampler_destroy(c);
}

/* Samplers that borrow one scratch, used in turn, pick what samplers with
 * their own scratch pick (top-k, top-p and min-p all use it); a scratch
 * smaller than the vocabulary is refused. */
static void test_shared_scratch(void) {
    float l[V], l2[V];
    make_logits(l, k_w);
    for (int i = 0; i < V; i++) l2[i] = l[V - 1 - i];
    cas_sampler_params p = plain();
    p.top_k = 5;
    p.top_p = 0.8f;
    p.min_p = 0.02f;
    cas_sampler_scratch *sc = NULL;
    REQUIRE(cas_sampler_scratch_create(V, &sc) == CAS_OK);
    cas_sampler *own[2] = {NULL, NULL}, *shared[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        p.seed = 7 + (uint64_t)k;
        REQUIRE(cas_sampler_create(&p, V, &own[k]) == CAS_OK);
        REQUIRE(cas_sampler_create_with(&p, V, sc, &shared[k]) == CAS_OK);
    }
    int same = 1;
    for (int i = 0; i < 500; i++) {
        const float *row = i % 3 ? l : l2;
        for (int k = 0; k < 2; k++) same &= cas_sampler_sample(own[k], row) == cas_sampler_sample(shared[k], row);
    }
    CHECK(same);
    cas_sampler *bad = NULL;
    CHECK(cas_sampler_create_with(&p, V + 1, sc, &bad) == CAS_ERR_INVALID && bad == NULL);
    for (int k = 0; k < 2; k++) {
        cas_sampler_destroy(own[k]);
        cas_sampler_destroy(shared[k]);
    }
    cas_sampler_scratch_destroy(sc);
}

static void test_bad_params(void) {
    cas_sampler_params p = plain();
    cas_sampler *s = NULL;
    p.temperature = -1;
    CHECK(cas_sampler_params_check(&p) == CAS_ERR_INVALID);
    CHECK(strstr(cas_last_error(), "temperature") != NULL);
    CHECK(cas_sampler_create(&p, V, &s) == CAS_ERR_INVALID && s == NULL);
    p = plain();
    p.temperature = NAN;
    CHECK(cas_sampler_params_check(&p) == CAS_ERR_INVALID);
    p = plain();
    p.top_k = -2;
    CHECK(cas_sampler_params_check(&p) == CAS_ERR_INVALID);
    p = plain();
    p.top_p = 0;
    CHECK(cas_sampler_params_check(&p) == CAS_ERR_INVALID);
    p.top_p = 1.5f;
    CHECK(cas_sampler_params_check(&p) == CAS_ERR_INVALID);
    p = plain();
    p.min_p = -0.1f;
    CHECK(cas_sampler_params_check(&p) == CAS_ERR_INVALID);
    p = cas_sampler_params_default();
    CHECK(cas_sampler_params_check(&p) == CAS_OK);
}

/* Feeds text in pieces of `step` bytes; returns what was shown and whether it stopped. */
static int feed(const char *const *stops, int n, const char *text, size_t step, char *shown) {
    cas_stopper *st = NULL;
    if (cas_stopper_create(stops, n, &st) != CAS_OK) return -1;
    size_t len = strlen(text), out = 0;
    int stopped = 0;
    for (size_t i = 0; i < len && !stopped; i += step) {
        size_t k = len - i < step ? len - i : step;
        const char *e;
        size_t el;
        stopped = cas_stopper_push(st, text + i, k, &e, &el);
        memcpy(shown + out, e, el);
        out += el;
    }
    if (!stopped) {
        const char *e;
        size_t el;
        cas_stopper_flush(st, &e, &el);
        memcpy(shown + out, e, el);
        out += el;
    }
    shown[out] = 0;
    cas_stopper_destroy(st);
    return stopped;
}

static void test_stop_strings(void) {
    const char *stops[] = {"\nUser:", "###"};
    char shown[256];
    for (size_t step = 1; step <= 8; step++) {
        CHECK(feed(stops, 2, "The answer is 4.\nUser: and", step, shown) == 1);
        CHECKF(!strcmp(shown, "The answer is 4."), "step %zu: '%s'", step, shown);
        CHECK(feed(stops, 2, "a ## b # c ###d", step, shown) == 1);
        CHECKF(!strcmp(shown, "a ## b # c "), "step %zu: '%s'", step, shown);
        /* a partial stop string at the end is released by flush */
        CHECK(feed(stops, 2, "ends with \nUse", step, shown) == 0);
        CHECKF(!strcmp(shown, "ends with \nUse"), "step %zu: '%s'", step, shown);
    }
    CHECK(feed(NULL, 0, "no stops at all", 3, shown) == 0);
    CHECK(!strcmp(shown, "no stops at all"));
}

int main(void) {
    RUN(test_greedy);
    RUN(test_plain_distribution);
    RUN(test_top_k);
    RUN(test_top_p);
    RUN(test_min_p);
    RUN(test_temperature_sharpens);
    RUN(test_seed_reproducible);
    RUN(test_shared_scratch);
    RUN(test_bad_params);
    RUN(test_stop_strings);
    return check_summary();
}
