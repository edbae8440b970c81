/*
 * test_attn.c: the attention core against its float64 reference.
 *
 * Differential over a random grid: flat (cascade off), cascade on every
 * shared run, and cascade by the cost model, each with every SIMD kernel the
 * CPU has, must equal the reference on fresh random inputs; outputs are
 * poisoned with NaN first, so an unwritten element fails. The SIMD kernels'
 * decode path and transposed-score path must give the blocked kernel's bits
 * (memcmp, every case). Merge laws, plan
 * reuse across layers and batches, cost-model decisions and every kind of
 * malformed batch description are checked too.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../src/attn/attn.h"
#include "../src/attn/attn_impl.h"
#include "check.h"

static cas_rng rng;

static void poison(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = NAN;
}

/* max |a - ref| / (1 + |ref|) over n; NaN anywhere gives +inf */
static double rel_err(const float *a, const double *ref, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double r = ref[i], e;
        if (isinf(r) && r < 0) e = (isinf(a[i]) && a[i] < 0) ? 0 : INFINITY;
        else e = fabs((double)a[i] - r) / (1.0 + fabs(r));
        if (isnan(e) || isnan(a[i])) e = INFINITY;
        if (e > worst) worst = e;
    }
    return worst;
}

/* the same for two float arrays (b the reference); NaN gives +inf */
static double rel_err_ff(const float *a, const float *b, size_t n) {
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]) / (1.0 + fabs((double)b[i]));
        if (isnan(e)) e = INFINITY;
        if (e > worst) worst = e;
    }
    return worst;
}

typedef struct {
    cas_attn_shape shape;
    cas_attn_params params;
    const char *tree;
    int32_t suffix, qlen;
    char desc[1024];
} case_t;

static const cas_simd_level simd_levels[] = {CAS_SIMD_GENERIC, CAS_SIMD_AVX2, CAS_SIMD_AVX512};

/* Runs one case in every mode and kernel; returns the number of failures. */
static int run_case(const case_t *c, uint64_t seed) {
    cas_attn_synth s;
    cas_status st = cas_attn_synth_create(&s, &c->shape, c->tree, 0, 0, c->suffix, c->qlen, seed);
    if (st) {
        printf("  synth failed for %s: %s\n", c->desc, cas_last_error());
        return 1;
    }
    cas_attn_batch b = cas_attn_synth_batch(&s);
    cas_kv_pool pool = cas_attn_synth_pool(&s);
    const int32_t Hq = c->shape.num_qo_heads, D = c->shape.head_dim;
    size_t no = (size_t)s.total_q * Hq * D, nl = (size_t)s.total_q * Hq;
    double *oref = malloc(sizeof(double) * (no + 1)), *lref = malloc(sizeof(double) * (nl + 1));
    float *o = malloc(sizeof(float) * (no + 1)), *lse = malloc(sizeof(float) * (nl + 1));
    float *o2 = malloc(sizeof(float) * (no + 1)), *lse2 = malloc(sizeof(float) * (nl + 1));
    int fails = 0;
    st = cas_attn_reference(&c->shape, &pool, &b, &c->params, s.q, oref, lref);
    if (st) {
        printf("  reference failed for %s: %s\n", c->desc, cas_last_error());
        fails++;
        goto done;
    }
    /* f16/bf16 keys change nothing here: the reference reads the same stored values */
    const double tol = 2e-5 * sqrt((double)D) + 1e-5;
    cas_cascade_mode modes[3] = {CAS_CASCADE_OFF, CAS_CASCADE_ALL, CAS_CASCADE_AUTO};
    for (int k = 0; k < 3; k++) {
        if (simd_levels[k] > cas_cpu_features_get()->simd) continue; /* plan_create would refuse it */
        const char *simd = cas_simd_name(simd_levels[k]);
        for (int m = 0; m < 3; m++) {
            for (int threads = 1; threads <= 3; threads += 2) {
                cas_attn_plan_opts opts = cas_attn_plan_opts_default();
                opts.cascade = modes[m];
                opts.threads = threads;
                opts.simd = simd_levels[k];
                opts.batch_invariant = threads == 3; /* the chained passes, against the same reference */
                cas_attn_plan *plan = NULL;
                st = cas_attn_plan_create(&plan, &c->shape, &opts, 0, 0, 0);
                if (!st) st = cas_attn_plan_build(plan, &b, s.num_pages, &c->params);
                poison(o, no);
                poison(lse, nl);
                if (!st) st = cas_attn_plan_run(plan, &pool, s.q, o, lse);
                if (st) {
                    printf("  %s [%s mode %d]: %s\n", c->desc, simd, m, cas_last_error());
                    fails++;
                } else {
                    double eo = rel_err(o, oref, no), el = rel_err(lse, lref, nl);
                    if (!(eo <= tol && el <= tol)) {
                        printf("  %s [%s, mode %d, %d threads]: o err %.3g lse err %.3g (tol %.3g)\n", c->desc,
                               simd, m, threads, eo, el, tol);
                        if (fails == 0) cas_attn_plan_print(plan, stdout);
                        fails++;
                    }
                    if (k > 0) {
                        /* the decode path computes the blocked kernel's bits */
                        int keep = plan->decode_rows;
                        plan->decode_rows = 0;
                        poison(o2, no);
                        poison(lse2, nl);
                        cas_status st2 = cas_attn_plan_run(plan, &pool, s.q, o2, lse2);
                        plan->decode_rows = keep;
                        if (st2 || memcmp(o, o2, sizeof(float) * no) || memcmp(lse, lse2, sizeof(float) * nl)) {
                            printf("  %s [%s, mode %d, %d threads]: decode path and blocked kernel differ\n",
                                   c->desc, simd, m, threads);
                            fails++;
                        }
                        /* so does the transposed-score path (AVX-512, many rows per KV head) */
                        keep = plan->stile_rows;
                        plan->stile_rows = INT_MAX;
                        poison(o2, no);
                        poison(lse2, nl);
                        st2 = cas_attn_plan_run(plan, &pool, s.q, o2, lse2);
                        plan->stile_rows = keep;
                        if (st2 || memcmp(o, o2, sizeof(float) * no) || memcmp(lse, lse2, sizeof(float) * nl)) {
                            printf("  %s [%s, mode %d, %d threads]: transposed-score and row-layout kernels differ\n",
                                   c->desc, simd, m, threads);
                            fails++;
                        }
                    }
                    if (m == 1) {
                        cas_attn_plan_info info;
                        cas_attn_plan_get_info(plan, &info);
                        if (info.kv_tokens_read > info.kv_tokens_flat) {
                            printf("  %s: cascade reads more KV than flat\n", c->desc);
                            fails++;
                        }
                    }
                }
                cas_attn_plan_destroy(plan);
            }
        }
    }
done:
    free(oref), free(lref), free(o), free(lse), free(o2), free(lse2);
    cas_attn_synth_destroy(&s);
    return fails;
}

/* A random tree spec of the given depth over about `n` requests. */
static void random_tree(char *buf, size_t cap, int depth, int n, int page) {
    size_t off = 0;
    int groups = (int)cas_rng_range(&rng, 1, 3);
    for (int g = 0; g < groups && n > 0; g++) {
        int cnt = g == groups - 1 ? n : (int)cas_rng_range(&rng, 1, n);
        n -= cnt;
        int tokens = (int)cas_rng_range(&rng, 0, 3) * page + (int)cas_rng_range(&rng, 0, page);
        off += (size_t)snprintf(buf + off, cap - off, "%s%d*%d", g ? "+" : "", cnt, tokens);
        if (depth > 1 && cnt > 1) {
            char sub[512];
            random_tree(sub, sizeof sub, depth - 1, (int)cas_rng_range(&rng, 1, cnt), page);
            off += (size_t)snprintf(buf + off, cap - off, "(%s)", sub);
        }
        if (off >= cap) break;
    }
}

static void test_differential_grid(void) {
    const int pages[] = {1, 16, 64};
    const int batches[] = {1, 7, 33};
    const int groups[] = {1, 3, 4, 8};
    const int dims[] = {64, 128};
    int n = 0, fails = 0;
    for (int pi = 0; pi < 3; pi++)
        for (int bi = 0; bi < 3; bi++)
            for (int gi = 0; gi < 4; gi++) {
                case_t c;
                memset(&c, 0, sizeof c);
                c.shape.num_kv_heads = (int)cas_rng_range(&rng, 1, 2);
                c.shape.num_qo_heads = c.shape.num_kv_heads * groups[gi];
                c.shape.head_dim = dims[(pi + bi + gi) % 2];
                c.shape.page_size = pages[pi];
                c.shape.kv_dtype = (cas_dtype)((pi + gi) % 3);
                c.params = cas_attn_params_default();
                int depth = 1 + (bi + gi) % 3;
                char tree[600];
                random_tree(tree, sizeof tree, depth, batches[bi], pages[pi]);
                c.tree = tree;
                c.suffix = -(int)cas_rng_range(&rng, 0, 2 * pages[pi] + 3);
                /* mixed: decode rows beside prefill chunks */
                c.qlen = (bi + gi) % 2 ? 1 : -(int)cas_rng_range(&rng, 1, 40);
                snprintf(c.desc, sizeof c.desc, "page %d tree '%s' Hq:Hkv %d:%d D %d %s suffix %d qlen %d",
                         c.shape.page_size, tree, c.shape.num_qo_heads, c.shape.num_kv_heads,
                         c.shape.head_dim, cas_dtype_name(c.shape.kv_dtype), c.suffix, c.qlen);
                fails += run_case(&c, cas_rng_u64(&rng));
                n++;
            }
    CHECKF(fails == 0, "%d of %d grid cases failed", fails, n);
}

/* bf16 KV with cas_attn_plan_opts.bf16_dot: Q and P rounded to bf16, the
 * products summed by vdpbf16ps or AMX tiles. Checked against the float64
 * reference at bf16 precision, in every cascade mode, with AMX and without,
 * and the two instruction paths against each other at f32 precision. */
static void test_bf16_dot(void) {
    if (!cas_attn_bf16_dot_available()) {
        printf("  bf16 dot: this CPU has no AVX512_BF16; the bf16 dot-product kernel was not run\n");
        return;
    }
    struct {
        int32_t hq, hkv, D, page, qlen;
        float cap;
        int32_t window, causal;
        const char *tree;
    } v[] = {
        {8, 2, 128, 16, 1, 0.0f, -1, 1, "12*200(5*64)+3*40"},
        {8, 2, 64, 1, -20, 0.0f, -1, 1, "6*37(2*9)"},
        {12, 4, 96, 16, -5, 20.0f, 33, 1, "5*130"},
        {16, 2, 256, 32, 3, 0.0f, -1, 0, "4*70(2*33)"},
        {4, 4, 128, 64, -40, 0.0f, -1, 1, "3*300+2*5"},
        {8, 1, 128, 16, 300, 0.0f, -1, 1, "2*400"},
    };
    int fails = 0, amx_runs = 0;
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        cas_attn_shape sh = {v[i].hq, v[i].hkv, v[i].D, v[i].page, CAS_BF16};
        cas_attn_params prm = cas_attn_params_default();
        prm.logits_soft_cap = v[i].cap;
        prm.window_left = v[i].window;
        prm.causal = v[i].causal;
        cas_attn_synth s;
        if (cas_attn_synth_create(&s, &sh, v[i].tree, 0, 0, -9, v[i].qlen, cas_rng_u64(&rng))) {
            printf("  bf16 dot #%zu: synth: %s\n", i, cas_last_error());
            fails++;
            continue;
        }
        cas_attn_batch b = cas_attn_synth_batch(&s);
        cas_kv_pool pool = cas_attn_synth_pool(&s);
        size_t no = (size_t)s.total_q * sh.num_qo_heads * sh.head_dim, nl = (size_t)s.total_q * sh.num_qo_heads;
        double *oref = malloc(sizeof(double) * no), *lref = malloc(sizeof(double) * nl);
        float *o[2], *l[2];
        for (int a = 0; a < 2; a++) o[a] = malloc(sizeof(float) * no), l[a] = malloc(sizeof(float) * nl);
        CHECK(cas_attn_reference(&sh, &pool, &b, &prm, s.q, oref, lref) == CAS_OK);
        cas_cascade_mode modes[3] = {CAS_CASCADE_OFF, CAS_CASCADE_ALL, CAS_CASCADE_AUTO};
        for (int m = 0; m < 3; m++)
            for (int threads = 1; threads <= 3; threads += 2) {
                for (int a = 0; a < 2; a++) { /* a = 0: AMX where present; 1: AVX512_BF16 only */
                    amx_runs += a == 0 && cas_attn_amx_bf16_available();
                    cas_attn_plan_opts opts = cas_attn_plan_opts_default();
                    opts.cascade = modes[m];
                    opts.threads = threads;
                    opts.bf16_dot = 1;
                    opts.amx_off = a;
                    cas_attn_plan *plan = NULL;
                    cas_status st = cas_attn_plan_create(&plan, &sh, &opts, 0, 0, 0);
                    if (!st) st = cas_attn_plan_build(plan, &b, s.num_pages, &prm);
                    poison(o[a], no);
                    poison(l[a], nl);
                    if (!st) st = cas_attn_plan_run(plan, &pool, s.q, o[a], l[a]);
                    cas_attn_plan_destroy(plan);
                    double eo = st ? INFINITY : rel_err(o[a], oref, no), el = st ? INFINITY : rel_err(l[a], lref, nl);
                    /* bf16 keeps 8 significant bits: Q and P rounding moves outputs by ~1e-3 */
                    if (!(eo <= 2e-2 && el <= 2e-2)) {
                        printf("  bf16 dot #%zu [mode %d, %d threads, %s]: o err %.3g lse err %.3g\n", i, m, threads,
                               a ? "avx512bf16" : "amx", eo, el);
                        fails++;
                    }
                }
                /* the two instruction paths compute the same function: their scores differ
                 * in the last f32 bits (sums in another order), which can move a
                 * probability to the neighbouring bf16 value (2^-8 relative) */
                double worst = 0;
                for (size_t k = 0; k < no; k++) {
                    double d = fabs((double)o[0][k] - o[1][k]) / (1.0 + fabs((double)o[1][k]));
                    if (!(d <= worst)) worst = d;
                }
                if (!(worst <= 2e-3)) {
                    printf("  bf16 dot #%zu [mode %d]: AMX and AVX512_BF16 differ by %.3g\n", i, m, worst);
                    fails++;
                }
            }
        free(oref), free(lref);
        for (int a = 0; a < 2; a++) free(o[a]), free(l[a]);
        cas_attn_synth_destroy(&s);
    }
    printf("  bf16 dot: %d runs on AMX tiles%s\n", amx_runs, amx_runs ? "" : " (this CPU or OS has no AMX-BF16)");
    CHECKF(fails == 0, "%d bf16 dot-product runs failed", fails);
}

static void test_features(void) {
    /* soft cap, sliding window, non-causal, head dims 96 and 256, a long prefill */
    struct {
        float cap;
        int32_t window, causal, D, qlen, page;
        const char *tree;
    } v[] = {
        {30.0f, -1, 1, 128, -20, 16, "5*100(2*40)"},
        {0.0f, 7, 1, 64, -30, 4, "6*50"},
        {5.0f, 33, 1, 128, 1, 16, "9*300(4*64)+3*10"},
        {0.0f, -1, 0, 64, -9, 8, "4*24(2*16)"},
        {0.0f, 20, 0, 96, 3, 16, "3*64"},
        {0.0f, -1, 1, 256, -5, 32, "4*130"},
        {0.0f, -1, 1, 128, 300, 16, "2*400"},
        /* Gemma 2's: cap 50 with head_dim 256 and a window; a cap small enough to bend most
         * scores, on decode rows */
        {50.0f, 15, 1, 256, -12, 16, "4*90(2*32)"},
        {2.0f, 9, 1, 64, 1, 8, "5*40(2*16)"},
    };
    int fails = 0;
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        case_t c;
        memset(&c, 0, sizeof c);
        c.shape = (cas_attn_shape){8, 2, v[i].D, v[i].page, CAS_F32};
        c.params = cas_attn_params_default();
        c.params.logits_soft_cap = v[i].cap;
        c.params.window_left = v[i].window;
        c.params.causal = v[i].causal;
        c.params.sm_scale = i % 2 ? 0.0f : 0.11f;
        c.tree = v[i].tree;
        c.suffix = -20;
        c.qlen = v[i].qlen;
        snprintf(c.desc, sizeof c.desc, "features #%zu", i);
        fails += run_case(&c, cas_rng_u64(&rng));
    }
    CHECKF(fails == 0, "%d feature cases failed", fails);
}

static void test_all_shared_and_single_page(void) {
    int fails = 0;
    case_t c;
    memset(&c, 0, sizeof c);
    c.shape = (cas_attn_shape){4, 4, 64, 16, CAS_BF16};
    c.params = cas_attn_params_default();
    /* every request's KV is exactly the shared prefix (parallel sampling) */
    c.tree = "5*64";
    c.suffix = 0;
    c.qlen = 1;
    snprintf(c.desc, sizeof c.desc, "all shared");
    fails += run_case(&c, 1);
    /* single-page requests, some sharing their only page */
    c.tree = "3*16+4*0";
    c.suffix = -15;
    snprintf(c.desc, sizeof c.desc, "single page");
    fails += run_case(&c, 2);
    /* a prefill chunk whose queries lie inside the shared run */
    c.tree = "3*64";
    c.suffix = 0;
    c.qlen = -40;
    snprintf(c.desc, sizeof c.desc, "queries inside shared run");
    fails += run_case(&c, 3);
    CHECK(fails == 0);
}

static void test_decode_beside_long_prefill(void) {
    /* one unified call: a 2000-token prefill chunk next to decode rows */
    cas_attn_shape shape = {8, 2, 64, 16, CAS_F16};
    int32_t P = 16;
    int32_t qo[4] = {0, 1, 2001, 2002};
    int32_t lens[3] = {700, 2000, 35};
    int32_t kvp[4], idx[200], last[3], n = 0;
    kvp[0] = 0;
    for (int r = 0; r < 3; r++) {
        int32_t np = (lens[r] + P - 1) / P;
        for (int32_t i = 0; i < np; i++) idx[n + i] = n + i;
        n += np;
        kvp[r + 1] = n;
        last[r] = lens[r] - (np - 1) * P;
    }
    size_t elems = (size_t)n * P * 2 * 64;
    uint16_t *k = malloc(elems * 2), *v = malloc(elems * 2);
    float *q = malloc(sizeof(float) * 2002 * 8 * 64), *o = malloc(sizeof(float) * 2002 * 8 * 64);
    float *lse = malloc(sizeof(float) * 2002 * 8);
    double *oref = malloc(sizeof(double) * 2002 * 8 * 64), *lref = malloc(sizeof(double) * 2002 * 8);
    for (size_t i = 0; i < elems; i++) {
        k[i] = cas_f32_to_f16((float)cas_rng_normal(&rng));
        v[i] = cas_f32_to_f16((float)cas_rng_normal(&rng));
    }
    for (size_t i = 0; i < 2002 * 8 * 64; i++) q[i] = (float)cas_rng_normal(&rng);
    cas_kv_pool pool = {k, v, n};
    cas_attn_batch b = {3, qo, kvp, idx, last};
    cas_attn_params prm = cas_attn_params_default();
    REQUIRE(cas_attn_reference(&shape, &pool, &b, &prm, q, oref, lref) == CAS_OK);
    poison(o, 2002 * 8 * 64);
    poison(lse, 2002 * 8);
    REQUIRE(cas_attn_forward(&shape, &pool, &b, &prm, NULL, q, o, lse) == CAS_OK);
    CHECK(rel_err(o, oref, 2002 * 8 * 64) < 3e-4);
    CHECK(rel_err(lse, lref, 2002 * 8) < 3e-4);
    free(k), free(v), free(q), free(o), free(lse), free(oref), free(lref);
}

/* The kernel is batch-invariant for flat passes: a query row's output does not
 * depend on which other rows share its work item or batch (tiles of keys
 * always start at the request's first key). The engine relies on it. */
static void test_rows_batch_invariant(void) {
    cas_attn_shape sh = {9, 3, 64, 16, CAS_F16};
    cas_attn_synth s;
    REQUIRE(cas_attn_synth_create(&s, &sh, "1*0", 0, 0, 230, 230, 3) == CAS_OK);
    cas_kv_pool pool = cas_attn_synth_pool(&s);
    cas_attn_params prm = cas_attn_params_default();
    cas_attn_plan_opts po = cas_attn_plan_opts_default();
    po.cascade = CAS_CASCADE_OFF;
    int32_t qoA[2] = {0, 230};
    cas_attn_batch a = {1, qoA, s.kv_indptr, s.kv_indices, s.kv_last_page_len};
    float *oA = malloc(sizeof(float) * 230 * 9 * 64), *oB = malloc(sizeof(float) * 230 * 9 * 64);
    REQUIRE(cas_attn_forward(&sh, &pool, &a, &prm, &po, s.q, oA, NULL) == CAS_OK);
    const int ms[5] = {1, 2, 6, 22, 100};
    for (int k = 0; k < 5; k++) {
        int m = ms[k];
        int32_t qoB[2] = {0, m};
        cas_attn_batch b = {1, qoB, s.kv_indptr, s.kv_indices, s.kv_last_page_len};
        REQUIRE(cas_attn_forward(&sh, &pool, &b, &prm, &po, s.q + (size_t)(230 - m) * 9 * 64, oB, NULL) == CAS_OK);
        CHECKF(!memcmp(oA + (size_t)(230 - m) * 9 * 64, oB, sizeof(float) * (size_t)m * 9 * 64),
               "last %d rows alone differ from the same rows in a 230-row chunk", m);
    }
    free(oA);
    free(oB);
    cas_attn_synth_destroy(&s);
}


/* Batch-invariant plans (opts.batch_invariant): every query row's output and
 * lse are bitwise the same as when its request runs alone (one request,
 * cascade off, one thread), whatever else is in the batch, with cascade off,
 * on every shared run or by the cost model, on 1-3 threads, and when the
 * request's queries come in two chunks (the first chunk with the keys up to
 * its last query only, as a chunked prefill has them). Random trees of
 * shared prefixes (runs that do and do not fill whole tiles), random private
 * lengths and query counts, with and without a sliding window; every SIMD
 * level this CPU has (each against itself). */
static void test_batch_invariant_plans(void) {
    static const char *trees[] = {"6*300(3*200(2*100))+2*150", "5*1024(2*77)+3*128", "4*40+2*0"};
    for (int tc = 0; tc < 3; tc++)
        for (int win = 0; win < 2; win++) {
            cas_attn_shape sh = {8, 2, 64, 16, tc == 1 ? CAS_BF16 : CAS_F16};
            cas_attn_synth s;
            REQUIRE(cas_attn_synth_create(&s, &sh, trees[tc], 0, 0, -140, -24, 50 + (uint64_t)tc) == CAS_OK);
            cas_attn_batch b = cas_attn_synth_batch(&s);
            cas_kv_pool pool = cas_attn_synth_pool(&s);
            cas_attn_params prm = cas_attn_params_default();
            if (win) prm.window_left = 150;
            const size_t row = (size_t)sh.num_qo_heads * sh.head_dim, H = (size_t)sh.num_qo_heads;
            const size_t nq = (size_t)s.total_q;
            float *alone = malloc(sizeof(float) * nq * row), *lalone = malloc(sizeof(float) * nq * H);
            float *o = malloc(sizeof(float) * nq * row), *lse = malloc(sizeof(float) * nq * H);
            REQUIRE(alone && lalone && o && lse);
            for (size_t li = 0; li < sizeof simd_levels / sizeof simd_levels[0]; li++) {
                if (simd_levels[li] > cas_cpu_features_get()->simd) continue;
                cas_attn_plan_opts po = cas_attn_plan_opts_default();
                po.batch_invariant = 1;
                po.simd = simd_levels[li];
                /* each request alone */
                po.cascade = CAS_CASCADE_OFF;
                po.threads = 1;
                for (int32_t r = 0; r < s.batch; r++) {
                    int32_t q0 = s.qo_indptr[r], ql = s.qo_indptr[r + 1] - q0;
                    int32_t qo[2] = {0, ql}, kvp[2] = {0, s.kv_indptr[r + 1] - s.kv_indptr[r]};
                    cas_attn_batch one = {1, qo, kvp, s.kv_indices + s.kv_indptr[r], s.kv_last_page_len + r};
                    REQUIRE(cas_attn_forward(&sh, &pool, &one, &prm, &po, s.q + (size_t)q0 * row,
                                             alone + (size_t)q0 * row, lalone + (size_t)q0 * H) == CAS_OK);
                }
                /* the whole batch, every mode and thread count */
                static const cas_cascade_mode modes[3] = {CAS_CASCADE_OFF, CAS_CASCADE_ALL, CAS_CASCADE_AUTO};
                for (int mi = 0; mi < 3; mi++)
                    for (int th = 1; th <= 3; th++) {
                        po.cascade = modes[mi];
                        po.threads = th;
                        poison(o, nq * row);
                        poison(lse, nq * H);
                        REQUIRE(cas_attn_forward(&sh, &pool, &b, &prm, &po, s.q, o, lse) == CAS_OK);
                        CHECKF(!memcmp(o, alone, sizeof(float) * nq * row) && !memcmp(lse, lalone, sizeof(float) * nq * H),
                               "tree %s window %d %s: batch (cascade %d, %d threads) differs from alone", trees[tc],
                               win, cas_simd_name(simd_levels[li]), mi, th);
                    }
                /* each request's queries in two chunks, the first with its keys only */
                po.cascade = CAS_CASCADE_ALL;
                po.threads = 2;
                for (int32_t r = 0; r < s.batch; r++) {
                    int32_t q0 = s.qo_indptr[r], ql = s.qo_indptr[r + 1] - q0, split = ql / 2;
                    if (split == 0) continue;
                    int32_t np = s.kv_indptr[r + 1] - s.kv_indptr[r];
                    int32_t len = (np - 1) * sh.page_size + s.kv_last_page_len[r] - (ql - split);
                    int32_t qo[2] = {0, split}, kvp[2] = {0, (len + sh.page_size - 1) / sh.page_size};
                    int32_t last = len - (kvp[1] - 1) * sh.page_size;
                    cas_attn_batch first = {1, qo, kvp, s.kv_indices + s.kv_indptr[r], &last};
                    poison(o, (size_t)split * row);
                    REQUIRE(cas_attn_forward(&sh, &pool, &first, &prm, &po, s.q + (size_t)q0 * row, o, lse) == CAS_OK);
                    CHECKF(!memcmp(o, alone + (size_t)q0 * row, sizeof(float) * (size_t)split * row),
                           "tree %s window %d %s: request %d's first chunk differs from its rows alone", trees[tc], win,
                           cas_simd_name(simd_levels[li]), r);
                }
            }
            /* the same batch in the fastest (default) plan agrees to rounding, and
             * the invariant plan with cascade takes shared passes */
            cas_attn_plan_opts po = cas_attn_plan_opts_default();
            po.cascade = CAS_CASCADE_ALL;
            po.batch_invariant = 1;
            cas_attn_plan *plan = NULL;
            REQUIRE(cas_attn_plan_create(&plan, &sh, &po, 0, 0, 0) == CAS_OK);
            REQUIRE(cas_attn_plan_build(plan, &b, s.num_pages, &prm) == CAS_OK);
            cas_attn_plan_info info;
            cas_attn_plan_get_info(plan, &info);
            CHECKF(tc == 2 || info.shared_passes > 0, "tree %s: no shared pass", trees[tc]);
            CHECK(cas_attn_plan_run(plan, &pool, s.q, alone, lalone) == CAS_OK);
            cas_attn_plan_destroy(plan);
            po.batch_invariant = 0;
            REQUIRE(cas_attn_forward(&sh, &pool, &b, &prm, &po, s.q, o, lse) == CAS_OK);
            CHECK(rel_err_ff(o, alone, nq * row) < 1e-5);
            free(alone), free(lalone), free(o), free(lse);
            cas_attn_synth_destroy(&s);
        }
}

/* ---- merge ---------------------------------------------------------------- */

static void random_state(float *o, float *l, int rows, int D, double p_empty) {
    for (int r = 0; r < rows; r++) {
        l[r] = cas_rng_uniform(&rng) < p_empty ? -INFINITY : (float)(cas_rng_normal(&rng) * 5);
        for (int d = 0; d < D; d++) o[r * D + d] = (float)cas_rng_normal(&rng);
    }
}

static void test_merge_laws(void) {
    enum { R = 64, D = 64 };
    static float oa[R * D], ob[R * D], oc[R * D], o1[R * D], o2[R * D], t[R * D];
    static float la[R], lb[R], lc[R], l1[R], l2[R], lt[R];
    random_state(oa, la, R, D, 0.2);
    random_state(ob, lb, R, D, 0.2);
    random_state(oc, lc, R, D, 0.2);
    la[0] = lb[0] = lc[0] = -INFINITY; /* all empty */
    /* commutative */
    cas_attn_merge2(o1, l1, oa, la, ob, lb, R, D);
    cas_attn_merge2(o2, l2, ob, lb, oa, la, R, D);
    double worst = 0;
    for (int i = 0; i < R * D; i++) worst = fmax(worst, fabs(o1[i] - o2[i]));
    for (int i = 0; i < R; i++)
        if (!(l1[i] == l2[i] || fabs(l1[i] - l2[i]) < 1e-5)) worst = 1;
    CHECKF(worst < 1e-6, "commutativity error %g", worst);
    /* associative: (a b) c = a (b c) */
    cas_attn_merge2(t, lt, oa, la, ob, lb, R, D);
    cas_attn_merge2(o1, l1, t, lt, oc, lc, R, D);
    cas_attn_merge2(t, lt, ob, lb, oc, lc, R, D);
    cas_attn_merge2(o2, l2, oa, la, t, lt, R, D);
    worst = 0;
    for (int i = 0; i < R * D; i++) worst = fmax(worst, fabs(o1[i] - o2[i]));
    CHECKF(worst < 1e-5, "associativity error %g", worst);
    /* merge_n equals the pairwise merges */
    const float *os[3] = {oa, ob, oc}, *ls[3] = {la, lb, lc};
    cas_attn_merge_n(o2, l2, os, ls, 3, R, D);
    worst = 0;
    for (int i = 0; i < R * D; i++) worst = fmax(worst, fabs(o1[i] - o2[i]));
    for (int i = 1; i < R; i++)
        if (isfinite(l1[i])) worst = fmax(worst, fabs(l1[i] - l2[i]));
    CHECKF(worst < 1e-5, "merge_n error %g", worst);
    /* empty is the identity, and nothing is NaN */
    static float oe[R * D], le[R];
    for (int i = 0; i < R * D; i++) oe[i] = 1e30f; /* an empty state's o is ignored */
    for (int i = 0; i < R; i++) le[i] = -INFINITY;
    cas_attn_merge2(o1, l1, oa, la, oe, le, R, D);
    int nan = 0, diff = 0;
    for (int r = 0; r < R; r++) {
        if (isnan(l1[r])) nan++;
        if (la[r] != l1[r]) diff++;
        for (int d = 0; d < D; d++) {
            if (isnan(o1[r * D + d])) nan++;
            if (la[r] != -INFINITY && fabsf(o1[r * D + d] - oa[r * D + d]) > 1e-6f) diff++;
        }
    }
    CHECK(nan == 0);
    CHECK(diff == 0);
    /* in place */
    memcpy(t, oa, sizeof t);
    memcpy(lt, la, sizeof lt);
    cas_attn_merge_inplace(t, lt, ob, lb, R, D);
    cas_attn_merge2(o1, l1, oa, la, ob, lb, R, D);
    CHECK(memcmp(t, o1, sizeof t) == 0);
    /* two empties stay empty, no NaN */
    cas_attn_merge2(o1, l1, oe, le, oe, le, R, D);
    CHECK(l1[3] == -INFINITY && o1[3 * D] == 0.0f);
    /* n = 0 writes the empty state */
    cas_attn_merge_n(o1, l1, NULL, NULL, 0, 1, D);
    CHECK(l1[0] == -INFINITY && o1[0] == 0.0f);
}

/* A split into disjoint key sets merges to attention over the union. */
static void test_merge_matches_union(void) {
    cas_attn_shape shape = {4, 1, 64, 8, CAS_F32};
    cas_attn_synth s;
    REQUIRE(cas_attn_synth_create(&s, &shape, "1*80", 0, 0, 0, 1, 77) == CAS_OK);
    cas_attn_params prm = cas_attn_params_default();
    prm.causal = 0;
    cas_kv_pool pool = cas_attn_synth_pool(&s);
    /* first 5 pages, then the other 5, then all 10 */
    int32_t qo[2] = {0, 1}, kvA[2] = {0, 5}, kvB[2] = {0, 5}, kvAll[2] = {0, 10}, last[1] = {8};
    int32_t *pages = s.kv_indices;
    cas_attn_batch a = {1, qo, kvA, pages, last}, bb = {1, qo, kvB, pages + 5, last},
                   all = {1, qo, kvAll, pages, last};
    float oa[4 * 64], ob[4 * 64], oall[4 * 64], la[4], lb[4], lall[4];
    REQUIRE(cas_attn_forward(&shape, &pool, &a, &prm, NULL, s.q, oa, la) == CAS_OK);
    REQUIRE(cas_attn_forward(&shape, &pool, &bb, &prm, NULL, s.q, ob, lb) == CAS_OK);
    REQUIRE(cas_attn_forward(&shape, &pool, &all, &prm, NULL, s.q, oall, lall) == CAS_OK);
    cas_attn_merge_inplace(oa, la, ob, lb, 4, 64);
    double worst = 0;
    for (int i = 0; i < 4 * 64; i++) worst = fmax(worst, fabs(oa[i] - oall[i]));
    for (int i = 0; i < 4; i++) worst = fmax(worst, fabs(la[i] - lall[i]));
    CHECKF(worst < 1e-5, "merged halves differ from the whole by %g", worst);
    cas_attn_synth_destroy(&s);
}

/* ---- plans ---------------------------------------------------------------- */

static void test_plan_reuse_layers_and_batches(void) {
    cas_attn_shape shape = {8, 2, 64, 16, CAS_F32};
    cas_attn_plan_opts opts = cas_attn_plan_opts_default();
    opts.cascade = CAS_CASCADE_ALL;
    opts.threads = 2;
    cas_attn_plan *plan;
    REQUIRE(cas_attn_plan_create(&plan, &shape, &opts, 2, 2, 2) == CAS_OK);
    const char *trees[3] = {"2*32", "12*200(5*64)+6*48", "3*16"};
    for (int bi = 0; bi < 3; bi++) {
        cas_attn_synth L1, L2; /* two "layers": same batch, different K, V, q */
        REQUIRE(cas_attn_synth_create(&L1, &shape, trees[bi], 0, 0, -30, -6, 100 + bi) == CAS_OK);
        REQUIRE(cas_attn_synth_create(&L2, &shape, trees[bi], 0, 0, -30, -6, 100 + bi) == CAS_OK);
        /* same structure, fresh values */
        cas_rng r2;
        cas_rng_seed(&r2, 999 + bi);
        size_t elems = (size_t)L2.num_pages * 16 * 2 * 64;
        for (size_t i = 0; i < elems; i++) ((float *)L2.k)[i] = (float)cas_rng_normal(&r2);
        for (size_t i = 0; i < (size_t)L2.total_q * 8 * 64; i++) L2.q[i] = (float)cas_rng_normal(&r2);
        cas_attn_batch b = cas_attn_synth_batch(&L1);
        cas_attn_params prm = cas_attn_params_default();
        REQUIRE(cas_attn_plan_build(plan, &b, L1.num_pages, &prm) == CAS_OK);
        size_t no = (size_t)L1.total_q * 8 * 64, nl = (size_t)L1.total_q * 8;
        float *o = malloc(no * 4), *l = malloc(nl * 4);
        double *oref = malloc(no * 8), *lref = malloc(nl * 8);
        cas_attn_synth *layers[2] = {&L1, &L2};
        for (int li = 0; li < 2; li++) {
            cas_kv_pool pool = cas_attn_synth_pool(layers[li]);
            poison(o, no);
            poison(l, nl);
            REQUIRE(cas_attn_plan_run(plan, &pool, layers[li]->q, o, l) == CAS_OK);
            REQUIRE(cas_attn_reference(&shape, &pool, &b, &prm, layers[li]->q, oref, lref) == CAS_OK);
            CHECKF(rel_err(o, oref, no) < 1e-4, "batch %d layer %d", bi, li);
            CHECKF(rel_err(l, lref, nl) < 1e-4, "batch %d layer %d lse", bi, li);
        }
        free(o), free(l), free(oref), free(lref);
        cas_attn_synth_destroy(&L1);
        cas_attn_synth_destroy(&L2);
    }
    cas_attn_plan_destroy(plan);
}

static cas_attn_plan_info plan_info_for(const char *tree, int32_t suffix, cas_cascade_mode mode,
                                        cas_attn_shape shape) {
    cas_attn_synth s;
    cas_attn_plan_info info;
    memset(&info, 0, sizeof info);
    if (cas_attn_synth_create(&s, &shape, tree, 0, 0, suffix, 1, 5)) return info;
    cas_attn_plan_opts opts = cas_attn_plan_opts_default();
    opts.cascade = mode;
    cas_attn_plan *plan;
    cas_attn_batch b = cas_attn_synth_batch(&s);
    cas_attn_params prm = cas_attn_params_default();
    if (cas_attn_plan_create(&plan, &shape, &opts, 0, 0, 0) == CAS_OK) {
        if (cas_attn_plan_build(plan, &b, s.num_pages, &prm) == CAS_OK) cas_attn_plan_get_info(plan, &info);
        cas_attn_plan_destroy(plan);
    }
    cas_attn_synth_destroy(&s);
    return info;
}

static void test_cost_model_decisions(void) {
    cas_attn_shape shape = {32, 8, 128, 16, CAS_F32};
    /* 3 requests sharing one page (a small model's heads): an extra pass and
     * merge cost more than reading 16 tokens twice more from cache */
    cas_attn_shape small = {9, 3, 64, 16, CAS_BF16};
    cas_attn_plan_info i1 = plan_info_for("3*16", 100, CAS_CASCADE_AUTO, small);
    CHECK(i1.tree_nodes == 1);
    CHECK(i1.shared_passes == 0);
    /* the example: 40 share A, 20 of those share A+B, 10 others share C */
    cas_attn_plan_info i2 = plan_info_for("40*1024(20*512)+10*768", 64, CAS_CASCADE_AUTO, shape);
    CHECK(i2.tree_nodes == 3);
    CHECKF(i2.shared_passes == 3, "shared passes %d", i2.shared_passes);
    CHECK(i2.kv_tokens_read == 1024 + 512 + 768 + 50 * 64);
    CHECK(i2.kv_tokens_flat == 40 * 1024 + 20 * 512 + 10 * 768 + 50 * 64);
    /* off means flat: one pass per request, nothing shared */
    cas_attn_plan_info i3 = plan_info_for("40*1024(20*512)+10*768", 64, CAS_CASCADE_OFF, shape);
    CHECK(i3.shared_passes == 0 && i3.passes == 50);
    CHECK(i3.kv_tokens_read == i3.kv_tokens_flat);
    /* nothing shared: no tree at all */
    cas_attn_plan_info i4 = plan_info_for("16*0", 300, CAS_CASCADE_AUTO, shape);
    CHECK(i4.tree_nodes == 0 && i4.passes == 16);
    /* a long prefix shared by many pays even for 2 */
    cas_attn_plan_info i5 = plan_info_for("2*32768", 16, CAS_CASCADE_AUTO, shape);
    CHECK(i5.shared_passes == 1);
}

/* ---- bad input ---------------------------------------------------------- */

static void test_bad_input(void) {
    cas_attn_shape shape = {4, 2, 64, 16, CAS_F32};
    float k[4 * 16 * 2 * 64] = {0}, v[4 * 16 * 2 * 64] = {0};
    float q[8 * 4 * 64] = {0}, o[8 * 4 * 64], lse[8 * 4];
    cas_kv_pool pool = {k, v, 4};
    cas_attn_params prm = cas_attn_params_default();
    int32_t qo_ok[3] = {0, 1, 2}, kv_ok[3] = {0, 2, 4}, idx_ok[4] = {0, 1, 2, 3}, last_ok[2] = {5, 16};
    cas_attn_batch ok = {2, qo_ok, kv_ok, idx_ok, last_ok};
    CHECK(cas_attn_forward(&shape, &pool, &ok, &prm, NULL, q, o, lse) == CAS_OK);

    int32_t qo_bad[3] = {0, 2, 1};
    cas_attn_batch b1 = ok;
    b1.qo_indptr = qo_bad;
    CHECK(cas_attn_forward(&shape, &pool, &b1, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);
    CHECK(strstr(cas_last_error(), "qo_indptr not monotone") != NULL);

    int32_t kv_bad[3] = {0, 3, 2};
    cas_attn_batch b2 = ok;
    b2.kv_indptr = kv_bad;
    CHECK(cas_attn_forward(&shape, &pool, &b2, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);
    CHECK(strstr(cas_last_error(), "kv_indptr not monotone") != NULL);

    int32_t idx_bad[4] = {0, 1, 4, 3};
    cas_attn_batch b3 = ok;
    b3.kv_indices = idx_bad;
    CHECK(cas_attn_forward(&shape, &pool, &b3, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);
    CHECK(strstr(cas_last_error(), "outside the pool") != NULL);
    idx_bad[2] = -1;
    CHECK(cas_attn_forward(&shape, &pool, &b3, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);

    int32_t last0[2] = {0, 16}, last17[2] = {5, 17};
    cas_attn_batch b4 = ok;
    b4.kv_last_page_len = last0;
    CHECK(cas_attn_forward(&shape, &pool, &b4, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);
    CHECK(strstr(cas_last_error(), "kv_last_page_len") != NULL);
    b4.kv_last_page_len = last17;
    CHECK(cas_attn_forward(&shape, &pool, &b4, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);

    /* 6 queries but 5 KV tokens under causal masking */
    int32_t qo_many[3] = {0, 6, 7}, kv1[3] = {0, 1, 2}, last_small[2] = {5, 3};
    cas_attn_batch b5 = {2, qo_many, kv1, idx_ok, last_small};
    CHECK(cas_attn_forward(&shape, &pool, &b5, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);
    CHECK(strstr(cas_last_error(), "queries but only") != NULL);
    prm.causal = 0; /* allowed without causal masking */
    CHECK(cas_attn_forward(&shape, &pool, &b5, &prm, NULL, q, o, lse) == CAS_OK);
    prm.causal = 1;

    cas_attn_shape s2 = shape;
    s2.num_qo_heads = 5;
    CHECK(cas_attn_forward(&s2, &pool, &ok, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);
    CHECK(strstr(cas_last_error(), "not a multiple") != NULL);
    s2 = shape;
    s2.head_dim = 72;
    CHECK(cas_attn_forward(&s2, &pool, &ok, &prm, NULL, q, o, lse) == CAS_ERR_UNSUPPORTED);
    CHECK(strstr(cas_last_error(), "head_dim") != NULL);
    s2 = shape;
    s2.page_size = 0;
    CHECK(cas_attn_forward(&s2, &pool, &ok, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);
    s2.page_size = 257;
    CHECK(cas_attn_forward(&s2, &pool, &ok, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);

    /* a request without pages; a NULL array; a bad first indptr */
    int32_t kv_empty[3] = {0, 0, 2};
    cas_attn_batch b6 = ok;
    b6.kv_indptr = kv_empty;
    CHECK(cas_attn_forward(&shape, &pool, &b6, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);
    cas_attn_batch b7 = ok;
    b7.kv_last_page_len = NULL;
    CHECK(cas_attn_forward(&shape, &pool, &b7, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);
    int32_t qo_start[3] = {1, 2, 3};
    cas_attn_batch b8 = ok;
    b8.qo_indptr = qo_start;
    CHECK(cas_attn_forward(&shape, &pool, &b8, &prm, NULL, q, o, lse) == CAS_ERR_INVALID);

    /* bad params */
    cas_attn_params p2 = cas_attn_params_default();
    p2.window_left = -5;
    CHECK(cas_attn_forward(&shape, &pool, &ok, &p2, NULL, q, o, lse) == CAS_ERR_INVALID);
    p2 = cas_attn_params_default();
    p2.logits_soft_cap = NAN;
    CHECK(cas_attn_forward(&shape, &pool, &ok, &p2, NULL, q, o, lse) == CAS_ERR_INVALID);

    /* a run on a pool of another size than planned */
    cas_attn_plan *plan;
    REQUIRE(cas_attn_plan_create(&plan, &shape, NULL, 0, 0, 0) == CAS_OK);
    REQUIRE(cas_attn_plan_build(plan, &ok, 4, &prm) == CAS_OK);
    cas_kv_pool small = {k, v, 3};
    CHECK(cas_attn_plan_run(plan, &small, q, o, lse) == CAS_ERR_INVALID);
    /* a failed build leaves the plan usable for the next good one */
    CHECK(cas_attn_plan_build(plan, &b3, 4, &prm) == CAS_ERR_INVALID);
    CHECK(cas_attn_plan_build(plan, &ok, 4, &prm) == CAS_OK);
    CHECK(cas_attn_plan_run(plan, &pool, q, o, lse) == CAS_OK);
    cas_attn_plan_destroy(plan);

    /* a SIMD level outside the enum, or one this CPU lacks, is refused (never
     * replaced by another kernel); each level the CPU has runs its own kernel */
    cas_attn_plan_opts po = cas_attn_plan_opts_default();
    po.simd = (cas_simd_level)9;
    plan = NULL;
    CHECK(cas_attn_plan_create(&plan, &shape, &po, 0, 0, 0) == CAS_ERR_INVALID && plan == NULL);
    const cas_simd_level have = cas_cpu_features_get()->simd;
    CHECK(strcmp(cas_attn_simd_name(), cas_simd_name(have)) == 0);
    if (have < CAS_SIMD_AVX512) {
        po.simd = CAS_SIMD_AVX512;
        CHECK(cas_attn_plan_create(&plan, &shape, &po, 0, 0, 0) == CAS_ERR_UNSUPPORTED && plan == NULL);
        CHECK(strstr(cas_last_error(), "avx512") != NULL);
    }
    const cas_attn_item_fn kernels[] = {cas_attn_item_generic, cas_attn_item_avx2, cas_attn_item_avx512};
    for (int lvl = CAS_SIMD_AUTO; lvl <= (int)have; lvl++) {
        po.simd = (cas_simd_level)lvl;
        REQUIRE(cas_attn_plan_create(&plan, &shape, &po, 0, 0, 0) == CAS_OK);
        CHECK(plan->simd == (lvl == CAS_SIMD_AUTO ? have : (cas_simd_level)lvl));
        CHECK(plan->kernel == kernels[plan->simd - CAS_SIMD_GENERIC]);
        cas_attn_plan_destroy(plan);
    }

    /* the synthetic generator rejects bad tree specs */
    cas_attn_synth s;
    CHECK(cas_attn_synth_create(&s, &shape, "3*(", 0, 0, 0, 1, 1) == CAS_ERR_INVALID);
    CHECK(cas_attn_synth_create(&s, &shape, "2*16(3*16)", 0, 0, 0, 1, 1) == CAS_ERR_INVALID);
}

int main(void) {
    cas_rng_seed(&rng, 20261202);
    printf("simd: %s\n", cas_attn_simd_name());
    RUN(test_merge_laws);
    RUN(test_merge_matches_union);
    RUN(test_bad_input);
    RUN(test_cost_model_decisions);
    RUN(test_all_shared_and_single_page);
    RUN(test_features);
    RUN(test_bf16_dot);
    RUN(test_plan_reuse_layers_and_batches);
    RUN(test_decode_beside_long_prefill);
    RUN(test_rows_batch_invariant);
    RUN(test_batch_invariant_plans);
    RUN(test_differential_grid);
    return check_summary();
}
