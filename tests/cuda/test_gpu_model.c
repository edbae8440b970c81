/*
 * test_gpu_model.c: the GPU forward (src/gpu) against the CPU forward
 * (src/model) on the same GGUF file, and against itself under other ways of
 * batching the same tokens. Needs a GPU; `test_gpu_model [MODEL.gguf]`
 * (default models/SmolLM2-135M-Instruct.Q4_1.gguf; the device runs take a
 * copy cut to its first layers, tools/truncate_gguf.py, which is what fits a
 * call to the GPU machine).
 *
 * The two forwards compute the same function in other precisions: the CPU
 * quantizes activations to 8 bits for its Q4_1/Q8_0 products, the GPU holds
 * the weights in bf16 and multiplies bf16 activations with f32 accumulation,
 * and keeps K/V in bf16 where the CPU keeps f16. So they are compared as the
 * CPU is against llama.cpp (tests/test_llama.c): logits within CROSS_TOL
 * (absolute, logits are ~10-30) and CROSS_MEAN_TOL on average, over prefill
 * and 24 teacher-forced decode steps of several prompts batched together,
 * and greedy tokens identical where the CPU's top-two gap exceeds MARGIN.
 * Against itself (same arithmetic, other summation order) the GPU must agree
 * within SELF_TOL: cascade against flat, chunked against whole prefill,
 * shared prefix pages against private ones, mixed prefill and decode rows.
 * An attention output is rounded to bf16 before the output product, so a
 * new summation order flips some roundings and the flips grow through the
 * layers: cascade against flat measured 0.054 max, 0.0035 mean after 4
 * layers on the runtime stand-ins (tests/cuda/gpu_stub.c; the same bf16
 * roundings on the CPU). On an H100 through the 16 layers of the device's
 * copy: cascade against flat 0.50 max, 0.047 mean (the attention kernels of
 * the two plans each differ from float64 by ~2e-3 of a row's norm, below a
 * bf16 step), chunked against whole prefill 0.11 / 0.023 (other product
 * shapes, other cuBLASLt kernels), greedy tokens the same; SELF_TOL and
 * SELF_MEAN_TOL leave room above that for the 30 layers of the whole model.
 * Bad batches are refused with a message and leave the model usable.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "paged_batch.h"
#include "sample_ref.h"
#include "../../src/gpu/gpu.h"

#include <cuda_runtime_api.h>

#define PAGE PAGED_BATCH_PAGE
#define CROSS_TOL 2.5f
#define CROSS_MEAN_TOL 0.4
#define MARGIN 2.0f
#define SELF_TOL 0.75f
#define SELF_MEAN_TOL 0.07

static cas_model *g_cpu;
static cas_gpu_model *g_gpu;
static cas_model_kv *g_ckv;
static cas_gpu_kv *g_gkv;
static cas_tok *g_tok;
static int32_t g_vocab;

static const char *k_prompts[] = {
    "The capital of France is",
    "Water boils at",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog, then",
    "A list of prime numbers: 2, 3, 5, 7, 11, 13,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived",
};
#define NP 6

/* One forward (gpu: on the device) of nseq sequences adding counts[i] tokens
 * of toks[i] (paged_batch.h); logits of each sequence's last token
 * (all_logits: of every token). */
static cas_status step(int gpu, pager_t *pg, seq_t **seqs, const int32_t *const *toks, const int32_t *counts,
                       int nseq, int all_logits, float *logits) {
    const cas_model_batch b = paged_batch(pg, seqs, toks, counts, nseq, all_logits);
    return gpu ? cas_gpu_forward(g_gpu, g_gkv, &b, logits) : cas_model_forward(g_cpu, g_ckv, &b, logits);
}


static double g_mean;
static float max_abs_diff(const float *a, const float *b, size_t n) { return check_max_abs_diff(a, b, n, &g_mean); }

static int32_t enc(const char *s, int32_t *ids, size_t cap) {
    size_t n = 0;
    cas_tok_encode(g_tok, s, strlen(s), CAS_TOK_ADD_SPECIAL, ids, cap, &n);
    return (int32_t)n;
}

/* all prompts batched, then 24 decode steps fed the CPU's greedy token: GPU
 * logits against the CPU's at every step */
static void test_against_cpu(void) {
    static int32_t ids[NP][256];
    int32_t n[NP];
    for (int i = 0; i < NP; i++) n[i] = enc(k_prompts[i], ids[i], 256);
    float *lc = malloc(sizeof(float) * (size_t)g_vocab * NP), *lg = malloc(sizeof(float) * (size_t)g_vocab * NP);
    REQUIRE(lc && lg);
    pager_t pc = {0}, pgg = {0};
    seq_t sc[NP], sg[NP];
    seq_t *spc[NP], *spg[NP];
    const int32_t *tp[NP];
    memset(sc, 0, sizeof sc);
    memset(sg, 0, sizeof sg);
    for (int i = 0; i < NP; i++) spc[i] = &sc[i], spg[i] = &sg[i], tp[i] = ids[i];
    float worst = 0;
    double mean_sum = 0;
    int steps = 0, agree = 0, compared = 0, near = 0;
    for (int s = 0; s < 25; s++) {
        int32_t next[NP], ones[NP];
        const int32_t *t1[NP];
        cas_status st;
        if (s == 0) {
            CHECKF((st = step(0, &pc, spc, tp, n, NP, 0, lc)) == CAS_OK, "cpu prefill: %s", cas_last_error());
            CHECKF((st = step(1, &pgg, spg, tp, n, NP, 0, lg)) == CAS_OK, "gpu prefill: %s", cas_last_error());
        } else {
            for (int i = 0; i < NP; i++) next[i] = check_argmax(lc + (size_t)i * g_vocab, g_vocab), ones[i] = 1, t1[i] = &next[i];
            CHECKF((st = step(0, &pc, spc, t1, ones, NP, 0, lc)) == CAS_OK, "cpu decode: %s", cas_last_error());
            CHECKF((st = step(1, &pgg, spg, t1, ones, NP, 0, lg)) == CAS_OK, "gpu decode: %s", cas_last_error());
        }
        if (st) break;
        const float d = max_abs_diff(lc, lg, (size_t)g_vocab * NP);
        if (d > worst) worst = d;
        mean_sum += g_mean;
        steps++;
        for (int i = 0; i < NP; i++) {
            const float *a = lc + (size_t)i * g_vocab, *b = lg + (size_t)i * g_vocab;
            if (check_top2_gap(a, g_vocab) > MARGIN) {
                compared++;
                agree += check_argmax(a, g_vocab) == check_argmax(b, g_vocab);
            } else {
                near++;
            }
        }
    }
    const double mean = steps ? mean_sum / steps : 0;
    printf("  gpu vs cpu over %d steps of %d sequences: max |logit difference| %.4f, mean %.5f; greedy the same "
           "in %d of %d rows with a top-2 gap over %.1f (%d rows under it)\n",
           steps, NP, (double)worst, mean, agree, compared, (double)MARGIN, near);
    CHECKF(worst <= CROSS_TOL && mean <= CROSS_MEAN_TOL, "gpu vs cpu: max %.4f mean %.5f", (double)worst, mean);
    CHECKF(agree == compared && compared > 0, "gpu vs cpu: greedy differs in %d of %d rows", compared - agree, compared);
    free(lc);
    free(lg);
}

static void check_self(const float *a, const float *b, int rows, const char *what) {
    const float d = max_abs_diff(a, b, (size_t)rows * g_vocab);
    printf("  %-44s max %.4f mean %.6f\n", what, (double)d, g_mean);
    CHECKF(d <= SELF_TOL && g_mean <= SELF_MEAN_TOL, "%s: max %.4f mean %.6f", what, (double)d, g_mean);
    for (int r = 0; r < rows; r++)
        if (check_top2_gap(a + (size_t)r * g_vocab, g_vocab) > 2 * SELF_TOL)
            CHECKF(check_argmax(a + (size_t)r * g_vocab, g_vocab) == check_argmax(b + (size_t)r * g_vocab, g_vocab),
                   "%s: row %d argmax", what, r);
}

/* the GPU against itself: cascade of shared prefix pages against flat and
 * against private pages, chunked prefill against whole, a batch of mixed
 * prefill chunks and decode rows against each alone */
static void test_self(void) {
    static int32_t pre[256], ids[NP][512];
    const int32_t np0 = enc("You are a helpful assistant. Answer briefly and truthfully, and say when you do not "
                            "know. Here is the question:",
                            pre, 256);
    int32_t n[NP];
    for (int i = 0; i < NP; i++) {
        memcpy(ids[i], pre, sizeof(int32_t) * (size_t)np0);
        size_t m = 0;
        cas_tok_encode(g_tok, k_prompts[i], strlen(k_prompts[i]), 0, ids[i] + np0, 256, &m);
        n[i] = np0 + (int32_t)m;
    }
    float *ref = malloc(sizeof(float) * (size_t)g_vocab * NP), *got = malloc(sizeof(float) * (size_t)g_vocab * NP);
    REQUIRE(ref && got);
    const int32_t *tp[NP];
    for (int i = 0; i < NP; i++) tp[i] = ids[i];
    /* private pages, flat */
    cas_gpu_model_set_cascade(g_gpu, CAS_CASCADE_OFF);
    {
        pager_t pg = {0};
        seq_t s[NP], *sp[NP];
        memset(s, 0, sizeof s);
        for (int i = 0; i < NP; i++) sp[i] = &s[i];
        CHECKF(step(1, &pg, sp, tp, n, NP, 0, ref) == CAS_OK, "flat: %s", cas_last_error());
    }
    /* the prefix's full pages shared by all: written by sequence 0 in a first forward, then
     * the rest of every sequence in one forward with cascade on every shared run */
    for (int mode = 0; mode < 2; mode++) {
        cas_gpu_model_set_cascade(g_gpu, mode ? CAS_CASCADE_ALL : CAS_CASCADE_OFF);
        pager_t pg = {0};
        seq_t s[NP], *sp[NP];
        memset(s, 0, sizeof s);
        const int32_t full = np0 / PAGE * PAGE;
        seq_t *s0 = &s[0];
        const int32_t *t0 = ids[0];
        float *scratch = malloc(sizeof(float) * (size_t)g_vocab);
        CHECK(step(1, &pg, &s0, &t0, &full, 1, 0, scratch) == CAS_OK);
        free(scratch);
        int32_t rest[NP];
        const int32_t *tr[NP];
        for (int i = 0; i < NP; i++) {
            if (i > 0) {
                memcpy(s[i].pages, s[0].pages, sizeof(int32_t) * (size_t)(full / PAGE));
                s[i].n_pages = full / PAGE;
                s[i].len = full;
            }
            sp[i] = &s[i];
            rest[i] = n[i] - full;
            tr[i] = ids[i] + full;
        }
        CHECKF(step(1, &pg, sp, tr, rest, NP, 0, got) == CAS_OK, "shared: %s", cas_last_error());
        check_self(ref, got, NP, mode ? "shared prefix pages, cascade" : "shared prefix pages, flat");
        cas_attn_plan_info info;
        cas_gpu_plan_info(g_gpu, &info);
        if (mode) CHECKF(info.shared_passes > 0, "cascade ALL planned %d shared passes", info.shared_passes);
    }
    /* chunked prefill of sequence 2 (chunks of 7) against whole */
    cas_gpu_model_set_cascade(g_gpu, CAS_CASCADE_AUTO);
    {
        pager_t pg = {0};
        seq_t s;
        memset(&s, 0, sizeof s);
        seq_t *sp = &s;
        for (int32_t at = 0; at < n[2]; at += 7) {
            const int32_t c = n[2] - at < 7 ? n[2] - at : 7;
            const int32_t *t = ids[2] + at;
            CHECK(step(1, &pg, &sp, &t, &c, 1, 0, got) == CAS_OK);
        }
        check_self(ref + (size_t)2 * g_vocab, got, 1, "chunked prefill (7) vs whole");
    }
    /* mixed: sequences 0-2 prefilled, then one forward of 0-2 decoding and 3-5 prefilling */
    {
        pager_t pg = {0};
        seq_t s[NP], *sp[NP];
        memset(s, 0, sizeof s);
        for (int i = 0; i < NP; i++) sp[i] = &s[i];
        CHECK(step(1, &pg, sp, tp, n, 3, 0, got) == CAS_OK);
        int32_t next[3], cnt[NP];
        const int32_t *tm[NP];
        for (int i = 0; i < 3; i++) next[i] = check_argmax(got + (size_t)i * g_vocab, g_vocab);
        for (int i = 0; i < NP; i++) {
            cnt[i] = i < 3 ? 1 : n[i];
            tm[i] = i < 3 ? &next[i] : ids[i];
        }
        CHECK(step(1, &pg, sp, tm, cnt, NP, 0, got) == CAS_OK);
        check_self(ref + (size_t)3 * g_vocab, got + (size_t)3 * g_vocab, 3, "prefill rows beside decode rows");
    }
    free(ref);
    free(got);
}

/* ---- sampling on the device ---------------------------------------------- */

/* Every prompt token's row sampled on the device under a grid of settings
 * and draws: the token the host's reading of the same semantics picks, on
 * the same logits (copied back), and the same tokens on a second run. */
static void test_sampling(void) {
    static const cas_gpu_sample grid[] = {
        {0.0f, 0, 1.0f, 0.0f, 0, 1},    {0.7f, 40, 0.95f, 0.05f, 0, 1}, {1.0f, 0, 1.0f, 0.0f, 0, 1},
        {1.5f, 0, 0.9f, 0.0f, 0, 1},   {0.7f, 5, 1.0f, 0.0f, 0, 1},    {1.0f, 0, 1.0f, 0.1f, 0, 1},
        {2.0f, 100, 0.5f, 0.02f, 0, 1}, {1.0f, 1, 1.0f, 0.0f, 0, 1},    {0.5f, 0, 0.3f, 0.0f, 0, 1},
    };
    const int ng = (int)(sizeof grid / sizeof grid[0]);
    static int32_t ids[NP][256], tokens[2048], qo[NP + 1], kvp[NP + 1], idx[512], last[NP], rows[2048];
    int32_t T = 0, P = 0;
    qo[0] = kvp[0] = 0;
    for (int i = 0; i < NP; i++) {
        const int32_t n = enc(k_prompts[i], ids[i], 256);
        memcpy(tokens + T, ids[i], sizeof(int32_t) * (size_t)n);
        T += n;
        const int32_t np = (n + PAGE - 1) / PAGE;
        for (int32_t j = 0; j < np; j++, P++) idx[P] = 100 + P;
        qo[i + 1] = T;
        kvp[i + 1] = P;
        last[i] = n - (np - 1) * PAGE;
    }
    REQUIRE(T <= 256);
    for (int32_t t = 0; t < T; t++) rows[t] = t;
    cas_gpu_sample *sp = calloc((size_t)T, sizeof *sp);
    float *lg = malloc(sizeof(float) * (size_t)T * g_vocab);
    int32_t *got = malloc(sizeof(int32_t) * (size_t)T), *again = malloc(sizeof(int32_t) * (size_t)T);
    uint8_t *keep = malloc((size_t)g_vocab);
    sample_ref_wid *buf = malloc(sizeof(sample_ref_wid) * (size_t)g_vocab);
    REQUIRE(sp && lg && got && again && keep && buf);
    cas_rng rng;
    cas_rng_seed(&rng, 1234);
    int same = 0, inside = 0, checked = 0, sampled_rows = 0;
    for (int round = 0; round < 4; round++) {
        for (int32_t t = 0; t < T; t++) {
            sp[t] = grid[(t + round) % ng];
            sp[t].u = (float)cas_rng_uniform(&rng);
            if (sp[t].u >= 1.0f) sp[t].u = 0.999999f;
        }
        cas_model_batch b = {NP, tokens, qo, kvp, idx, last, T, rows};
        CHECKF(cas_gpu_forward_sample(g_gpu, g_gkv, &b, sp, got, lg) == CAS_OK, "sample: %s", cas_last_error());
        CHECKF(cas_gpu_forward_sample(g_gpu, g_gkv, &b, sp, again, lg) == CAS_OK, "sample: %s", cas_last_error());
        CHECK(memcmp(got, again, sizeof(int32_t) * (size_t)T) == 0);
        for (int32_t t = 0; t < T; t++) {
            const int32_t want = sample_ref(lg + (size_t)t * g_vocab, g_vocab, sp[t].temperature, sp[t].top_k,
                                            sp[t].top_p, sp[t].min_p, sp[t].u, keep, buf);
            checked++;
            sampled_rows += sp[t].temperature > 0;
            same += got[t] == want;
            inside += got[t] >= 0 && got[t] < g_vocab && keep[got[t]];
            if (sp[t].temperature == 0.f) CHECKF(got[t] == want, "greedy row %d: %d, argmax %d", t, got[t], want);
        }
    }
    printf("  device sampling: %d of %d rows (%d with temperature) pick the host's token, %d inside the host's kept "
           "set\n", same, checked, sampled_rows, inside);
    CHECK(inside == checked);
    CHECK(same >= checked - checked / 100); /* a draw on a boundary may round the other way */
    /* out-of-range settings are refused */
    cas_gpu_sample bad = grid[1];
    bad.u = 1.0f;
    cas_model_batch b1 = {1, tokens, qo, kvp, idx, last, 0, NULL};
    CHECK(cas_gpu_forward_sample(g_gpu, g_gkv, &b1, &bad, got, NULL) == CAS_ERR_INVALID);
    bad = grid[1];
    bad.want_logits = 1;
    CHECK(cas_gpu_forward_sample(g_gpu, g_gkv, &b1, &bad, got, NULL) == CAS_ERR_INVALID);
    free(sp);
    free(lg);
    free(got);
    free(again);
    free(keep);
    free(buf);
}

/* Decode steps replayed from CUDA graphs (g_gpu: graphs on, the default)
 * against the same steps launched eagerly by a model with graphs off: for a
 * batch that fills its bucket (8 rows) the same launches run, so tokens and
 * log-probability logits must be bitwise equal; a batch padded to its
 * bucket (5 rows into 8) runs its products over more rows, so it must agree
 * within SELF_TOL with the same greedy tokens where the gap exceeds MARGIN.
 * On the runtime stand-ins nothing can be captured and the padded launches
 * run eagerly: the same comparisons hold and the fallback is counted. */
static void test_graphs(void) {
    cas_gpu_opts go = cas_gpu_opts_default();
    go.max_batch_tokens = 512;
    go.max_logits = 512;
    go.graphs = 0;
    cas_gpu_model *eager = NULL;
    cas_gpu_kv *ekv = NULL;
    REQUIRE(cas_gpu_model_create(cas_model_gguf(g_cpu), &go, &eager) == CAS_OK);
    REQUIRE(cas_gpu_kv_create(eager, cas_gpu_kv_num_pages(g_gkv), PAGE, &ekv) == CAS_OK);
    const int stand_in = strcmp(cas_gpu_model_device_name(g_gpu), "host stand-in") == 0;
    cas_gpu_graph_info g0, g1;
    cas_gpu_graph_stats(g_gpu, &g0);
    enum { STEPS = 10, MAXB = 8 };
    static int32_t ids[MAXB][256];
    float *la = malloc(sizeof(float) * (size_t)MAXB * g_vocab), *lb = malloc(sizeof(float) * (size_t)MAXB * g_vocab);
    REQUIRE(la && lb);
    cas_rng rng;
    cas_rng_seed(&rng, 99);
    const int sizes[2] = {8, 5};
    for (int si = 0; si < 2; si++) {
        const int B = sizes[si];
        pager_t pa = {400}, pb = {400};
        seq_t sa[MAXB], sb[MAXB], *qa[MAXB], *qb[MAXB];
        const int32_t *toks[MAXB];
        int32_t counts[MAXB], next[MAXB];
        memset(sa, 0, sizeof sa);
        memset(sb, 0, sizeof sb);
        for (int i = 0; i < B; i++) {
            counts[i] = enc(k_prompts[i % NP], ids[i], 256);
            ids[i][counts[i]++] = 100 + i; /* rows of one prompt differ */
            toks[i] = ids[i];
            qa[i] = &sa[i];
            qb[i] = &sb[i];
        }
        cas_model_batch b = paged_batch(&pa, qa, toks, counts, B, 0);
        CHECKF(cas_gpu_forward(g_gpu, g_gkv, &b, la) == CAS_OK, "prefill: %s", cas_last_error());
        b = paged_batch(&pb, qb, toks, counts, B, 0);
        CHECKF(cas_gpu_forward(eager, ekv, &b, lb) == CAS_OK, "prefill: %s", cas_last_error());
        for (int i = 0; i < B; i++) next[i] = check_argmax(la + (size_t)i * g_vocab, g_vocab);
        int bitwise = 1, tokens_same = 1, gap_ok = 1;
        float worst = 0.f;
        for (int stp = 0; stp < STEPS; stp++) {
            cas_gpu_sample sp[MAXB];
            for (int i = 0; i < B; i++) {
                const float u = (float)cas_rng_uniform(&rng);
                /* the full-bucket batch samples (temperature, top-p), the padded one is greedy */
                sp[i] = (cas_gpu_sample){B == 8 ? 0.8f : 0.0f, 0, B == 8 ? 0.95f : 1.0f, 0.0f, u < 1.f ? u : 0.f, 1};
                toks[i] = &next[i];
                counts[i] = 1;
            }
            int32_t ta[MAXB], tb[MAXB];
            b = paged_batch(&pa, qa, toks, counts, B, 0);
            CHECKF(cas_gpu_forward_sample(g_gpu, g_gkv, &b, sp, ta, la) == CAS_OK, "graph step: %s",
                   cas_last_error());
            b = paged_batch(&pb, qb, toks, counts, B, 0);
            CHECKF(cas_gpu_forward_sample(eager, ekv, &b, sp, tb, lb) == CAS_OK, "eager step: %s",
                   cas_last_error());
            bitwise &= memcmp(la, lb, sizeof(float) * (size_t)B * g_vocab) == 0 && memcmp(ta, tb, sizeof(int32_t) * B) == 0;
            const float d = max_abs_diff(la, lb, (size_t)B * g_vocab);
            if (d > worst) worst = d;
            for (int i = 0; i < B; i++) {
                if (ta[i] != tb[i]) {
                    tokens_same = 0;
                    if (check_top2_gap(lb + (size_t)i * g_vocab, g_vocab) > MARGIN) gap_ok = 0;
                }
                next[i] = ta[i];
            }
        }
        printf("  graphs, %d rows (bucket %d): %s, max logit difference %.3g, tokens %s\n", B, 8,
               bitwise ? "bitwise equal to eager" : "not bitwise equal", (double)worst,
               tokens_same ? "the same" : "differ");
        if (B == 8) CHECKF(bitwise, "a full bucket's replay differs from eager (max %.3g)", (double)worst);
        else CHECK(worst <= SELF_TOL && gap_ok);
    }
    cas_gpu_graph_stats(g_gpu, &g1);
    const int64_t decode = 2 * STEPS;
    printf("  graph stats: %lld captured, %lld replayed, %lld padded eagerly, %lld eager\n",
           (long long)(g1.captures - g0.captures), (long long)(g1.replays - g0.replays),
           (long long)(g1.padded_eager - g0.padded_eager), (long long)(g1.eager - g0.eager));
    if (stand_in) CHECK(g1.padded_eager - g0.padded_eager == decode && g1.replays == g0.replays);
    else CHECK(g1.replays - g0.replays == decode && g1.captures >= 1 && g1.padded_eager == 0);
    cas_gpu_graph_info ge;
    cas_gpu_graph_stats(eager, &ge);
    CHECK(ge.captures == 0 && ge.replays == 0 && ge.padded_eager == 0 && ge.eager == decode + 2);
    free(la);
    free(lb);
    cas_gpu_kv_destroy(ekv);
    cas_gpu_model_destroy(eager);
}

/* Tensor parallelism (cas_gpu_opts.tensor_parallel) against the model on
 * one device: a one-rank split (the same path with NCCL's one-rank
 * all-reduce) gives the same bits, graphs included; a split over the 3 K/V
 * heads of the default model, on 3 devices where the machine has them and
 * on one device shared by the 3 ranks (the split's arithmetic without
 * NCCL), differs only by the summation order of the attention output and
 * down products over the ranks (SELF_TOL, greedy tokens the same past
 * near-ties), through a prefill of all prompts and 10 decode steps fed the
 * single model's tokens. Splits that do not divide the heads, or mix shared
 * and own devices, are refused. */
static void tp_compare(cas_gpu_model *tp, const char *what, int want_bitwise) {
    cas_gpu_kv *tkv = NULL;
    REQUIRE(cas_gpu_kv_create(tp, cas_gpu_kv_num_pages(g_gkv), PAGE, &tkv) == CAS_OK);
    enum { STEPS = 10 };
    static int32_t ids[NP][256];
    float *la = malloc(sizeof(float) * (size_t)NP * g_vocab), *lb = malloc(sizeof(float) * (size_t)NP * g_vocab);
    REQUIRE(la && lb);
    pager_t pa = {300}, pb = {300};
    seq_t sa[NP], sb[NP], *qa[NP], *qb[NP];
    const int32_t *toks[NP];
    int32_t counts[NP], next[NP];
    memset(sa, 0, sizeof sa);
    memset(sb, 0, sizeof sb);
    for (int i = 0; i < NP; i++) {
        counts[i] = enc(k_prompts[i], ids[i], 256);
        toks[i] = ids[i];
        qa[i] = &sa[i];
        qb[i] = &sb[i];
    }
    cas_model_batch b = paged_batch(&pa, qa, toks, counts, NP, 0);
    CHECKF(cas_gpu_forward(g_gpu, g_gkv, &b, la) == CAS_OK, "prefill: %s", cas_last_error());
    b = paged_batch(&pb, qb, toks, counts, NP, 0);
    CHECKF(cas_gpu_forward(tp, tkv, &b, lb) == CAS_OK, "%s prefill: %s", what, cas_last_error());
    int bitwise = memcmp(la, lb, sizeof(float) * (size_t)NP * g_vocab) == 0, gap_ok = 1, same = 0, near = 0;
    float worst = max_abs_diff(la, lb, (size_t)NP * g_vocab);
    double mean_worst = g_mean;
    for (int i = 0; i < NP; i++) next[i] = check_argmax(la + (size_t)i * g_vocab, g_vocab);
    for (int stp = 0; stp < STEPS; stp++) {
        cas_gpu_sample sp[NP];
        for (int i = 0; i < NP; i++) {
            sp[i] = (cas_gpu_sample){0.0f, 0, 1.0f, 0.0f, 0.0f, 1};
            toks[i] = &next[i];
            counts[i] = 1;
        }
        int32_t ta[NP], tb[NP];
        b = paged_batch(&pa, qa, toks, counts, NP, 0);
        CHECKF(cas_gpu_forward_sample(g_gpu, g_gkv, &b, sp, ta, la) == CAS_OK, "step: %s", cas_last_error());
        b = paged_batch(&pb, qb, toks, counts, NP, 0);
        CHECKF(cas_gpu_forward_sample(tp, tkv, &b, sp, tb, lb) == CAS_OK, "%s step: %s", what, cas_last_error());
        bitwise &= memcmp(la, lb, sizeof(float) * (size_t)NP * g_vocab) == 0 && memcmp(ta, tb, sizeof ta) == 0;
        const float d = max_abs_diff(la, lb, (size_t)NP * g_vocab);
        if (d > worst) worst = d;
        if (g_mean > mean_worst) mean_worst = g_mean;
        for (int i = 0; i < NP; i++) {
            if (check_top2_gap(la + (size_t)i * g_vocab, g_vocab) > MARGIN) {
                same += ta[i] == tb[i];
                gap_ok &= ta[i] == tb[i];
            } else {
                near++;
            }
            next[i] = ta[i]; /* both fed the single model's tokens */
        }
    }
    printf("  %-40s max %.4f, worst step mean %.5f, %s; greedy the same in %d rows (%d near-ties)\n", what,
           (double)worst, mean_worst, bitwise ? "bitwise equal" : "not bitwise equal", same, near);
    if (want_bitwise) CHECKF(bitwise, "%s: differs from the single model (max %.3g)", what, (double)worst);
    CHECKF(worst <= SELF_TOL && mean_worst <= SELF_MEAN_TOL && gap_ok && same > 0, "%s: max %.4f mean %.5f", what,
           (double)worst, mean_worst);
    free(la);
    free(lb);
    cas_gpu_kv_destroy(tkv);
}

static void test_tensor_parallel(void) {
    const cas_gguf *g = cas_model_gguf(g_cpu);
    const cas_model_config *c = cas_model_config_of(g_cpu);
    cas_gpu_opts go = cas_gpu_opts_default();
    go.max_batch_tokens = 512;
    go.max_logits = 512;
    cas_gpu_model *tp = NULL;
    go.tensor_parallel = 1;
    CHECKF(cas_gpu_model_create(g, &go, &tp) == CAS_OK, "tensor parallel 1: %s", cas_last_error());
    if (tp) {
        CHECK(cas_gpu_model_ranks(tp) == 1);
        tp_compare(tp, "tensor parallel 1 (NCCL, graphs)", 1);
        cas_gpu_model_destroy(tp);
        tp = NULL;
    }
    const int32_t n = c->n_head_kv; /* 3 for the default model */
    int ndev = 0;
    cudaGetDeviceCount(&ndev);
    int32_t same_dev[CAS_GPU_MAX_RANKS] = {0};
    go.tensor_parallel = n;
    if (ndev >= n) {
        go.devices = NULL;
        CHECKF(cas_gpu_model_create(g, &go, &tp) == CAS_OK, "tensor parallel %d: %s", n, cas_last_error());
        if (tp) {
            char what[64];
            snprintf(what, sizeof what, "tensor parallel %d on %d devices", n, n);
            CHECK(cas_gpu_model_ranks(tp) == n);
            /* each rank's pool holds a third of the heads: three times the pages */
            const int32_t p1 = cas_gpu_kv_pages_for_budget(g_gpu, PAGE, (size_t)1 << 30),
                          pn = cas_gpu_kv_pages_for_budget(tp, PAGE, (size_t)1 << 30);
            CHECKF(pn >= n * p1 && pn < n * (p1 + 1), "pages for 1 GiB: %d split, %d whole", pn, p1);
            tp_compare(tp, what, 0);
            cas_gpu_model_destroy(tp);
            tp = NULL;
        }
    } else {
        printf("  (%d device(s): the split over %d devices is not run here)\n", ndev, n);
    }
    go.devices = same_dev;
    CHECKF(cas_gpu_model_create(g, &go, &tp) == CAS_OK, "tensor parallel %d on one device: %s", n, cas_last_error());
    if (tp) {
        char what[64];
        snprintf(what, sizeof what, "tensor parallel %d on one device", n);
        /* three ranks' pools share the device: a third of the pages each, as many in all */
        CHECK(cas_gpu_kv_pages_for_budget(tp, PAGE, (size_t)1 << 30) ==
              cas_gpu_kv_pages_for_budget(g_gpu, PAGE, (size_t)1 << 30));
        tp_compare(tp, what, 0);
        cas_gpu_model_destroy(tp);
        tp = NULL;
    }
    /* refused: heads that do not divide, too many ranks, shared and own devices mixed */
    go.devices = NULL;
    go.tensor_parallel = 2;
    CHECK(cas_gpu_model_create(g, &go, &tp) == CAS_ERR_INVALID && !tp && strstr(cas_last_error(), "divide"));
    go.tensor_parallel = CAS_GPU_MAX_RANKS + 1;
    CHECK(cas_gpu_model_create(g, &go, &tp) == CAS_ERR_INVALID && !tp);
    if (ndev >= 2) {
        const int32_t mixed[3] = {0, 0, 1};
        go.tensor_parallel = 3;
        go.devices = mixed;
        CHECK(cas_gpu_model_create(g, &go, &tp) == CAS_ERR_INVALID && !tp &&
              strstr(cas_last_error(), "all different or all the same"));
    }
}

/* Llama-3-70B's shape with synthetic weights: refused with the sizes where
 * its 141 GB do not fit the device's free memory, made where they do */
static void test_too_large(void) {
    cas_model_config c;
    REQUIRE(cas_model_config_synthetic("llama-3-70b", &c) == CAS_OK);
    size_t free_b = 0, total_b = 0;
    REQUIRE(cas_gpu_mem_info(g_gpu, &free_b, &total_b) == CAS_OK);
    const double E = c.n_embd, F = c.n_ff, QD = (double)c.n_head * c.head_dim, KD = (double)c.n_head_kv * c.head_dim;
    const double need = 2.0 * (2.0 * c.n_vocab * E + c.n_layers * (E * (QD + 2 * KD) + QD * E + 3 * E * F));
    cas_gpu_model *big = NULL;
    const cas_status st = cas_gpu_model_create_synthetic(&c, 7, NULL, &big);
    printf("  llama-3-70b shape: %.1f GiB of weights, %.1f GiB free: %s\n", need / 1073741824.0,
           (double)free_b / 1073741824.0, st ? cas_last_error() : "created");
    if (need > (double)free_b) CHECK(st == CAS_ERR_NOMEM && big == NULL && strstr(cas_last_error(), "GiB"));
    else CHECK(st == CAS_OK && big != NULL);
    cas_gpu_model_destroy(big);
    /* the model in use still runs */
    float *lg = malloc(sizeof(float) * (size_t)g_vocab);
    int32_t tok = 1, qo[2] = {0, 1}, kvp[2] = {0, 1}, idx[1] = {0}, last[1] = {1};
    cas_model_batch b = {1, &tok, qo, kvp, idx, last, 0, NULL};
    CHECKF(lg && cas_gpu_forward(g_gpu, g_gkv, &b, lg) == CAS_OK, "after: %s", cas_last_error());
    free(lg);
}

/* The architectures the GPU forward does not run are refused at creation, naming them (the
 * CPU runs them); a SentencePiece vocabulary is no reason to refuse: the tokenizer is the
 * host's, the forward does not see it. */
static void test_other_archs(void) {
    static const char *const refused[] = {"qwen2", "qwen3", "phi3", "gemma2", "gemma3"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        char path[96];
        snprintf(path, sizeof path, "tests/fixtures/arch/tiny-%s.gguf", refused[i]);
        cas_gguf *g = NULL;
        REQUIRE(cas_gguf_open(path, &g) == CAS_OK);
        cas_gpu_model *m = NULL;
        CHECKF(cas_gpu_model_create(g, NULL, &m) == CAS_ERR_UNSUPPORTED && !m &&
                   strstr(cas_last_error(), refused[i]) && strstr(cas_last_error(), "--device cpu"),
               "%s: %s", refused[i], cas_last_error());
        cas_gpu_model_destroy(m);
        cas_gguf_close(g);
    }
    cas_gguf *g = NULL;
    REQUIRE(cas_gguf_open("tests/fixtures/arch/tiny-llama2.gguf", &g) == CAS_OK);
    cas_gpu_model *m = NULL;
    CHECKF(cas_gpu_model_create(g, NULL, &m) == CAS_OK, "llama2: %s", cas_last_error());
    cas_gpu_model_destroy(m);
    cas_gguf_close(g);
}

/* bad batches: refused with a message, the model still runs */
static void test_bad(void) {
    int32_t tok = g_vocab, qo[2] = {0, 1}, kvp[2] = {0, 1}, idx[1] = {0}, last[1] = {1};
    float *lg = malloc(sizeof(float) * (size_t)g_vocab);
    REQUIRE(lg);
    cas_model_batch b = {1, &tok, qo, kvp, idx, last, 0, NULL};
    CHECK(cas_gpu_forward(g_gpu, g_gkv, &b, lg) == CAS_ERR_INVALID && cas_last_error()[0]);
    tok = 1;
    idx[0] = cas_gpu_kv_num_pages(g_gkv); /* outside the pool */
    CHECK(cas_gpu_forward(g_gpu, g_gkv, &b, lg) == CAS_ERR_INVALID && cas_last_error()[0]);
    int32_t many[1024], qo2[2] = {0, 1000}, kvp2[2] = {0, 63}, idx2[63], last2[1] = {1000 - 62 * PAGE};
    for (int i = 0; i < 1000; i++) many[i] = 1;
    for (int i = 0; i < 63; i++) idx2[i] = i;
    cas_model_batch big = {1, many, qo2, kvp2, idx2, last2, 0, NULL};
    CHECK(cas_gpu_forward(g_gpu, g_gkv, &big, lg) == CAS_ERR_NOMEM && cas_last_error()[0]);
    idx[0] = 0;
    CHECKF(cas_gpu_forward(g_gpu, g_gkv, &b, lg) == CAS_OK, "after the bad batches: %s", cas_last_error());
    free(lg);
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (!cas_gpu_available()) {
        printf("FAIL: no CUDA device (this test is for a GPU machine; CI runs the stand-in build)\n");
        printf("0 passed, 1 failed\n");
        return 1;
    }
    cas_model_opts mo = cas_model_opts_default();
    mo.max_batch_tokens = 1024;
    cas_status st = cas_model_load(path, &mo, &g_cpu);
    if (st) {
        printf("FAIL: %s: %s (run `make model`)\n0 passed, 1 failed\n", path, cas_last_error());
        return 1;
    }
    cas_gpu_opts go = cas_gpu_opts_default();
    go.max_batch_tokens = 512;
    go.max_logits = 512;
    REQUIRE_MAIN(cas_gpu_model_create(cas_model_gguf(g_cpu), &go, &g_gpu) == CAS_OK);
    REQUIRE_MAIN(cas_tok_create(cas_model_gguf(g_cpu), &g_tok) == CAS_OK);
    g_vocab = cas_model_config_of(g_cpu)->n_vocab;
    REQUIRE_MAIN(cas_model_kv_create(g_cpu, 1024, PAGE, CAS_F16, &g_ckv) == CAS_OK);
    REQUIRE_MAIN(cas_gpu_kv_create(g_gpu, 1024, PAGE, &g_gkv) == CAS_OK);
    printf("model %s: %d layers; gpu %s, %.1f MiB on the device\n", path, cas_model_config_of(g_cpu)->n_layers,
           cas_gpu_model_device_name(g_gpu), (double)cas_gpu_model_bytes(g_gpu) / 1048576.0);
    RUN(test_against_cpu);
    RUN(test_self);
    RUN(test_sampling);
    RUN(test_graphs);
    RUN(test_tensor_parallel);
    RUN(test_bad);
    RUN(test_too_large);
    RUN(test_other_archs);
    cas_gpu_kv_destroy(g_gkv);
    cas_model_kv_destroy(g_ckv);
    cas_tok_destroy(g_tok);
    cas_gpu_model_destroy(g_gpu);
    cas_model_destroy(g_cpu);
    return check_summary();
}
