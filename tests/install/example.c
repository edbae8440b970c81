/*
 * example.c: a program that uses cascade as an installed library. It is
 * compiled by tests/install/check_install.sh against the headers, libraries
 * and pkg-config file that `make install` put under a temporary prefix (never
 * against src/), once linked with the shared library and once with the static
 * one, so what it checks is what a user of the installed library gets. It
 * includes the headers as a user would, <cascade/...>.
 *
 * It goes through the public contracts: the attention function on a random
 * paged batch with shared prefixes (cascade forced on, output poisoned first)
 * against the float64 reference; the error contract (status and message);
 * the KV block manager's prefix cache; and, when the default model's path is
 * given (argv[1]; absent: a skip line), the GGUF reader and the tokenizer
 * against llama.cpp's token ids, and the engine's greedy continuation against
 * llama.cpp's (tests/fixtures/smollm2-reference-logits.json, first prompt).
 * Those four tokens were each chosen by llama.cpp with a top-2 margin over
 * 1.1 nats, above the ~0.8 that rounding moves a margin between our own runs
 * (test_engine.c), so any correct build reproduces them.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cascade/attn.h>
#include <cascade/core.h>
#include <cascade/engine.h>
#include <cascade/kv.h>
#include <cascade/model.h>

#include "check.h"

static const char *model_path;

/* "The capital of France is": llama.cpp's prompt ids and greedy tokens
 * (" Paris", ".", "\n", "\n"). */
static const char *PROMPT = "The capital of France is";
static const int32_t PROMPT_IDS[] = {504, 3575, 282, 4649, 314};
static const int32_t GREEDY[] = {7042, 30, 198, 198};
static const char *GREEDY_TEXT = " Paris.\n\n";
#define N_PROMPT ((int32_t)(sizeof PROMPT_IDS / sizeof PROMPT_IDS[0]))
#define N_GREEDY ((int32_t)(sizeof GREEDY / sizeof GREEDY[0]))

/* Paged attention with GQA, f16 KV and a two-level shared prefix, every
 * request with a few queries (prefill chunks and decode rows in one batch),
 * against the float64 reference. */
static void test_attention_against_reference(void) {
    cas_attn_shape shape = {.num_qo_heads = 4, .num_kv_heads = 2, .head_dim = 64,
                            .page_size = 16, .kv_dtype = CAS_F16};
    cas_attn_synth s;
    REQUIRE(cas_attn_synth_create(&s, &shape, "4*48(2*32)", 0, 0, -20, -5, 29) == CAS_OK);
    cas_attn_batch b = cas_attn_synth_batch(&s);
    cas_kv_pool pool = cas_attn_synth_pool(&s);
    cas_attn_params prm = cas_attn_params_default();
    cas_attn_plan_opts opts = cas_attn_plan_opts_default();
    opts.cascade = CAS_CASCADE_ALL;
    size_t rows = (size_t)s.total_q * (size_t)shape.num_qo_heads, n = rows * (size_t)shape.head_dim;
    float *o = malloc(n * sizeof *o), *lse = malloc(rows * sizeof *lse);
    double *oref = malloc(n * sizeof *oref), *lref = malloc(rows * sizeof *lref);
    if (o && lse && oref && lref) {
        for (size_t i = 0; i < n; i++) o[i] = NAN;
        for (size_t i = 0; i < rows; i++) lse[i] = NAN;
        CHECK(cas_attn_reference(&shape, &pool, &b, &prm, s.q, oref, lref) == CAS_OK);
        CHECK(cas_attn_forward(&shape, &pool, &b, &prm, &opts, s.q, o, lse) == CAS_OK);
        /* counted, not maxed: a NaN left by an unwritten element fails too */
        double worst = 0;
        size_t bad = 0;
        for (size_t i = 0; i < n + rows; i++) {
            double d = i < n ? fabs(o[i] - oref[i]) : fabs(lse[i - n] - lref[i - n]);
            bad += !(d <= 1e-4);
            if (d > worst) worst = d;
        }
        CHECKF(bad == 0, "%zu of %zu outputs off the float64 reference (worst %g)", bad, n + rows, worst);
    } else {
        CHECK(!"out of memory");
    }
    free(o);
    free(lse);
    free(oref);
    free(lref);
    cas_attn_synth_destroy(&s);
}

/* Library calls return a status and leave a message; they do not exit. */
static void test_errors_are_statuses(void) {
    cas_engine_opts eo = cas_engine_opts_default();
    eo.model_path = "/nonexistent/model.gguf";
    cas_engine *e = NULL;
    CHECK(cas_engine_create(&e, &eo) != CAS_OK);
    CHECK(e == NULL);
    CHECK(strlen(cas_last_error()) > 0);
    cas_attn_shape bad = {.num_qo_heads = 3, .num_kv_heads = 2, .head_dim = 64, .page_size = 16,
                          .kv_dtype = CAS_F32}; /* Hq not a multiple of Hkv */
    cas_attn_plan *plan = NULL;
    CHECK(cas_attn_plan_create(&plan, &bad, NULL, 0, 0, 0) != CAS_OK);
    CHECK(plan == NULL && strlen(cas_last_error()) > 0);
    cas_attn_plan_destroy(plan);
}

/* A second sequence with the same first two blocks finds them cached. */
static void test_kv_prefix_cache(void) {
    cas_kv_opts ko = cas_kv_opts_default();
    ko.num_blocks = 16;
    ko.page_size = 4;
    ko.max_seqs = 4;
    ko.max_blocks_per_seq = 8;
    ko.enable_prefix_cache = 1;
    cas_kv *kv = NULL;
    REQUIRE(cas_kv_create(&ko, &kv) == CAS_OK);
    int32_t t[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, a, c, run, wait;
    cas_kv_match m;
    CHECK(cas_kv_seq_create(kv, t, 10, &a, &m) == CAS_OK && m.hit_tokens == 0);
    CHECK(cas_kv_seq_ready(kv, a, &run, &wait) == CAS_OK && run == 10);
    CHECK(cas_kv_seq_claim(kv, a, run) == CAS_OK && cas_kv_seq_commit(kv, a, run) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    t[9] = 99;
    CHECK(cas_kv_seq_create(kv, t, 10, &c, &m) == CAS_OK);
    CHECKF(m.hit_tokens == 8, "hit %d tokens, want 8", m.hit_tokens);
    CHECK(cas_kv_seq_free(kv, c) == CAS_OK);
    cas_kv_destroy(kv);
}

/* The model file through the model layer: metadata and the tokenizer. */
static void test_model_tokenizer(void) {
    cas_gguf *g = NULL;
    REQUIRE(cas_gguf_open(model_path, &g) == CAS_OK);
    const char *arch = NULL;
    size_t len = 0;
    CHECK(cas_gguf_get_str(g, "general.architecture", &arch, &len) == CAS_OK && len == 5 &&
          memcmp(arch, "llama", 5) == 0);
    CHECK(cas_gguf_n_tensors(g) > 0);
    cas_tok *tok = NULL;
    CHECK(cas_tok_create(g, &tok) == CAS_OK);
    cas_gguf_close(g);
    if (!tok) return;
    int32_t ids[64];
    size_t n = 0;
    CHECK(cas_tok_encode(tok, PROMPT, strlen(PROMPT), CAS_TOK_ADD_SPECIAL, ids, 64, &n) == CAS_OK);
    CHECKF(n == (size_t)N_PROMPT && memcmp(ids, PROMPT_IDS, sizeof PROMPT_IDS) == 0,
           "prompt encodes to %zu ids, want llama.cpp's %d", n, N_PROMPT);
    cas_tok_destroy(tok);
}

typedef struct {
    int32_t toks[64];
    int32_t n, prompt_tokens;
    char text[256];
    size_t text_len;
    cas_finish_reason finish;
} gen_out;

static void on_event(void *user, const cas_engine_event *ev) {
    gen_out *g = user;
    for (int32_t i = 0; i < ev->n_tokens && g->n < 64; i++) g->toks[g->n++] = ev->tokens[i];
    if (g->text_len + ev->text_len < sizeof g->text) {
        memcpy(g->text + g->text_len, ev->text, ev->text_len);
        g->text_len += ev->text_len;
        g->text[g->text_len] = '\0';
    }
    g->prompt_tokens = ev->prompt_tokens;
    g->finish = ev->finish;
}

/* The engine: load, submit a greedy request, step until idle. */
static void test_engine_greedy(void) {
    cas_engine_opts eo = cas_engine_opts_default();
    eo.model_path = model_path;
    eo.threads = 2;
    eo.max_context = 128;
    eo.kv_cache_bytes = 8 << 20;
    cas_engine *e = NULL;
    if (cas_engine_create(&e, &eo) != CAS_OK) printf("engine: %s\n", cas_last_error());
    REQUIRE(e);
    gen_out out = {0};
    cas_engine_request rq = {.prompt = PROMPT, .sampling = cas_engine_sampling_default(),
                             .cb = on_event, .user = &out};
    rq.sampling.temperature = 0;
    rq.sampling.max_tokens = N_GREEDY;
    uint64_t id = 0;
    CHECK(cas_engine_submit(e, &rq, &id) == CAS_OK);
    CHECK(cas_engine_run_until_idle(e) == CAS_OK);
    CHECK(out.finish == CAS_FINISH_LENGTH);
    CHECK(out.prompt_tokens == N_PROMPT);
    CHECKF(out.n == N_GREEDY && memcmp(out.toks, GREEDY, sizeof GREEDY) == 0,
           "greedy tokens %d %d %d %d (%d), want llama.cpp's %d %d %d %d", out.toks[0], out.toks[1],
           out.toks[2], out.toks[3], out.n, GREEDY[0], GREEDY[1], GREEDY[2], GREEDY[3]);
    CHECKF(strcmp(out.text, GREEDY_TEXT) == 0, "text \"%s\"", out.text);
    printf("generated: \"%s", PROMPT); /* newlines shown as \n: one line of output */
    for (const char *c = out.text; *c; c++) {
        if (*c == '\n') fputs("\\n", stdout);
        else putchar(*c);
    }
    printf("\"\n");
    cas_engine_destroy(e);
}

int main(int argc, char **argv) {
    RUN(test_attention_against_reference);
    RUN(test_errors_are_statuses);
    RUN(test_kv_prefix_cache);
    model_path = argc > 1 ? argv[1] : NULL;
    if (model_path) {
        RUN(test_model_tokenizer);
        RUN(test_engine_greedy);
    } else {
        printf("skip example: model tests (no model path given)\n");
    }
    return check_summary();
}
