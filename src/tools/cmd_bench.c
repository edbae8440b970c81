/*
 * cmd_bench.c: `cascade bench`, offline serving benchmark through the engine.
 * Synthetic requests share a prefix (or a tree of prefixes) and have unique
 * suffixes of random tokens; they arrive all at once or as a Poisson process
 * at --rate requests per second. --workload picks one of the end-to-end
 * presets (system prompt, few-shot tree, document QA, parallel sampling,
 * unshared chat traffic, long context) and --scale shrinks every length so
 * the same shapes run on a small machine.
 *
 * Reports throughput, time to first token, time per output token and
 * inter-token latency percentiles, prompt tokens the model actually computed
 * and the prefix-cache hit rate, and per decode step (a step that computed no
 * prompt token) its time, batch size and a byte roofline: the weights plus
 * the distinct KV tokens the step's attention reads, over the copy bandwidth.
 * --no-cascade and --no-prefix-cache switch each feature off so its effect
 * can be measured, and --simd / --no-amx pick the kernels' instruction set to
 * compare them.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "../engine/engine.h"
#include "../model/model.h"
#include "tools.h"
#if CAS_WITH_CUDA
#include "../cuda/cuda_attn.h"
#endif

/* Random prompt tokens are drawn from [TOKEN_LO, TOKEN_HI]: ids of the
 * default model's tokenizer (49152 entries), which synthetic models take too. */
#define TOKEN_LO 100
#define TOKEN_HI 49151
/* inter-token latency samples written to --latency-json at the most */
#define ITL_SAMPLES_MAX 20000

/* ---- growing arrays ------------------------------------------------------ */

typedef struct {
    double *v;
    int64_t n, cap;
} dvec;

static void dvec_push(dvec *a, double x) {
    if (a->n == a->cap) {
        int64_t cap = a->cap ? a->cap * 2 : 1024;
        double *v = realloc(a->v, sizeof(double) * (size_t)cap);
        if (!v) return; /* a lost sample, not a failed benchmark */
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = x;
}

/* ---- per-request timing, from the engine's events ------------------------- */

typedef struct {
    double submit_t, first_t, last_t;
    int32_t n_out;
    int done;
} req_stat;

typedef struct {
    req_stat *st;
    int32_t n_done;
    dvec itl; /* ms: every gap between consecutive token events of a request */
} bench_ctx;

static bench_ctx *g_ctx;

/* The engine emits one event per token per step, so an event's gap to the
 * request's previous one is one inter-token latency. */
static void on_event(void *user, const cas_engine_event *ev) {
    req_stat *r = user;
    double now = cas_now_s();
    if (ev->n_tokens > 0) {
        if (r->n_out == 0) r->first_t = now;
        else dvec_push(&g_ctx->itl, (now - r->last_t) * 1e3);
        r->n_out += ev->n_tokens;
        r->last_t = now;
    }
    if (ev->finish != CAS_FINISH_NONE) {
        r->done = 1;
        g_ctx->n_done++;
    }
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The p-th percentile (linear interpolation) of n values; v is left as it
 * was. NAN when n is 0. */
static double pct(const double *v, int64_t n, double p) {
    if (n <= 0) return NAN;
    double *s = malloc(sizeof(double) * (size_t)n);
    if (!s) return NAN;
    memcpy(s, v, sizeof(double) * (size_t)n);
    qsort(s, (size_t)n, sizeof(double), cmp_d);
    double idx = p / 100.0 * (double)(n - 1);
    int64_t lo = (int64_t)idx;
    int64_t hi = lo + 1 < n ? lo + 1 : lo;
    double r = s[lo] + (s[hi] - s[lo]) * (idx - (double)lo);
    free(s);
    return r;
}

/* ---- synthetic prompts ---------------------------------------------------- */

/* Token lists per request from a tree spec "N*T(...)+..." like attn-bench's:
 * requests below a group share its T tokens; each then gets `suffix` tokens
 * of its own and asks for `out[i]` tokens. */
typedef struct {
    int32_t **toks;
    int32_t *len;
    int32_t *out; /* max_tokens per request */
    int32_t n, cap;
} prompts;

typedef struct {
    int32_t suffix, output; /* own tokens and output tokens per request (scaled) */
    double scale;           /* multiplies every T of the tree */
    cas_rng *rng;
} tree_gen;

/* A token length times --scale: at least 1 token, 0 stays 0. */
static int32_t scaled(double x, double scale) {
    if (x <= 0) return 0;
    double y = floor(x * scale + 0.5);
    return y < 1 ? 1 : y > 1e9 ? 1000000000 : (int32_t)y;
}

static int add_request(prompts *ps, const int32_t *prefix, int32_t plen, int32_t own, int32_t out,
                       cas_rng *rng) {
    if (ps->n == ps->cap) {
        int32_t cap = ps->cap ? ps->cap * 2 : 64;
        int32_t **t = realloc(ps->toks, sizeof(int32_t *) * (size_t)cap);
        if (!t) return -1;
        ps->toks = t;
        int32_t *l = realloc(ps->len, sizeof(int32_t) * (size_t)cap);
        if (!l) return -1;
        ps->len = l;
        int32_t *o = realloc(ps->out, sizeof(int32_t) * (size_t)cap);
        if (!o) return -1;
        ps->out = o;
        ps->cap = cap;
    }
    int32_t *t = malloc(sizeof(int32_t) * (size_t)(plen + own + 1));
    if (!t) return -1;
    if (plen) memcpy(t, prefix, sizeof(int32_t) * (size_t)plen);
    for (int32_t i = 0; i < own; i++) t[plen + i] = (int32_t)cas_rng_range(rng, TOKEN_LO, TOKEN_HI);
    ps->toks[ps->n] = t;
    ps->len[ps->n] = plen + own;
    ps->out[ps->n] = out;
    ps->n++;
    return 0;
}

static int parse_groups(const char **s, prompts *ps, const int32_t *prefix, int32_t plen, const tree_gen *g,
                        int depth);

static int parse_group(const char **s, prompts *ps, const int32_t *prefix, int32_t plen, const tree_gen *g,
                       int depth) {
    char *end;
    long n = strtol(*s, &end, 10);
    if (end == *s || *end != '*' || n < 1 || n > 100000) return -1;
    *s = end + 1;
    long t0 = strtol(*s, &end, 10);
    if (end == *s || t0 < 0 || t0 > 1000000) return -1;
    *s = end;
    const int32_t t = scaled((double)t0, g->scale);
    int32_t *p2 = malloc(sizeof(int32_t) * (size_t)(plen + t + 1));
    if (!p2) return -1;
    if (plen) memcpy(p2, prefix, sizeof(int32_t) * (size_t)plen);
    for (int32_t i = 0; i < t; i++) p2[plen + i] = (int32_t)cas_rng_range(g->rng, TOKEN_LO, TOKEN_HI);
    int32_t placed0 = ps->n;
    if (**s == '(') {
        (*s)++;
        if (parse_groups(s, ps, p2, plen + t, g, depth + 1) || **s != ')') {
            free(p2);
            return -1;
        }
        (*s)++;
    }
    while (ps->n - placed0 < n)
        if (add_request(ps, p2, plen + t, g->suffix, g->output, g->rng)) {
            free(p2);
            return -1;
        }
    free(p2);
    return ps->n - placed0 > n ? -1 : 0;
}

static int parse_groups(const char **s, prompts *ps, const int32_t *prefix, int32_t plen, const tree_gen *g,
                        int depth) {
    if (depth > 16) return -1;
    for (;;) {
        if (parse_group(s, ps, prefix, plen, g, depth)) return -1;
        if (**s != '+') return 0;
        (*s)++;
    }
}

/* Lengths of the unshared workload: log-normal fits of chat traffic. A
 * log-normal's mean is exp(mu + sigma^2 / 2), so for a mean m, mu = ln(m) -
 * sigma^2 / 2. Prompts: mean 1000 tokens, sigma 1.0 (mu = ln 1000 - 0.5 =
 * 6.408), clamped to [16, 8192]; outputs: mean 250, sigma 0.8 (mu = ln 250 -
 * 0.32 = 5.201), clamped to [8, 2048]. The clamps trim the means by under
 * 1%. Drawn from the --seed generator, so a seed fixes them. */
#define LN_PROMPT_MEAN 1000.0
#define LN_PROMPT_SIGMA 1.0
#define LN_PROMPT_MIN 16
#define LN_PROMPT_MAX 8192
#define LN_OUTPUT_MEAN 250.0
#define LN_OUTPUT_SIGMA 0.8
#define LN_OUTPUT_MIN 8
#define LN_OUTPUT_MAX 2048

static double lognormal_len(cas_rng *rng, double mean, double sigma, double lo, double hi) {
    double mu = log(mean) - sigma * sigma / 2;
    double x = floor(exp(mu + sigma * cas_rng_normal(rng)) + 0.5);
    return x < lo ? lo : x > hi ? hi : x;
}

/* ---- workload presets ------------------------------------------------------ */

typedef struct {
    int32_t requests, prefix, suffix, output;
    const char *tree;
    float temperature; /* < 0: the engine's default */
    int lognormal_prompt, lognormal_output; /* unshared: lengths drawn per request */
    const char *workload;
    char tree_buf[256];
} bench_cfg;

static const char *const WORKLOADS =
    "system-prompt, few-shot-tree, document-qa, parallel-sampling, unshared, long-context";

/* Sets every field a preset decides; options after --workload override them. */
static int apply_workload(bench_cfg *c, const char *name) {
    c->tree = NULL;
    c->prefix = 0;
    c->temperature = -1;
    c->lognormal_prompt = c->lognormal_output = 0;
    if (!strcmp(name, "system-prompt")) {
        /* one 8192-token system prompt shared by 64 requests, 512 tokens each of their own */
        c->requests = 64, c->prefix = 8192, c->suffix = 512, c->output = 256;
    } else if (!strcmp(name, "few-shot-tree")) {
        /* 4096 tokens shared by all 128, 2048 more by each group of 32 */
        c->tree = "128*4096(32*2048+32*2048+32*2048+32*2048)";
        c->requests = 128, c->suffix = 256, c->output = 128;
    } else if (!strcmp(name, "document-qa")) {
        /* 16 documents of 4096 tokens, 16 questions of 64 tokens on each */
        c->tree_buf[0] = 0;
        for (int i = 0; i < 16; i++) strcat(c->tree_buf, i ? "+16*4096" : "16*4096");
        c->tree = c->tree_buf;
        c->requests = 256, c->suffix = 64, c->output = 128;
    } else if (!strcmp(name, "parallel-sampling")) {
        /* 8 prompts of 2048 tokens, 16 samples of each at temperature 1 (seeds differ) */
        c->tree_buf[0] = 0;
        for (int i = 0; i < 8; i++) strcat(c->tree_buf, i ? "+16*2048" : "16*2048");
        c->tree = c->tree_buf;
        c->requests = 128, c->suffix = 0, c->output = 256, c->temperature = 1.0f;
    } else if (!strcmp(name, "unshared")) {
        /* 256 requests with nothing shared, lengths as chat traffic (lognormal_len) */
        c->requests = 256, c->suffix = 0, c->output = 0;
        c->lognormal_prompt = c->lognormal_output = 1;
    } else if (!strcmp(name, "long-context")) {
        /* 8 questions of 256 tokens on one 65536-token document */
        c->requests = 8, c->prefix = 65536, c->suffix = 256, c->output = 256;
    } else {
        return -1;
    }
    c->workload = name;
    return 0;
}

/* ---- model shape, for the byte roofline ----------------------------------- */

typedef struct {
    cas_model_config cfg;
    int64_t file_weight_bytes; /* a GGUF file: bytes of the tensors a decode step reads; 0 synthetic */
} model_shape;

/* The config of -m's model without building it: the shape by name for
 * "synthetic:NAME", else the file's header (and its tensors' bytes). */
static cas_status read_shape(const char *path, model_shape *m) {
    memset(m, 0, sizeof *m);
    if (!strncmp(path, "synthetic:", 10)) return cas_model_config_synthetic(path + 10, &m->cfg);
    cas_gguf *g;
    cas_status st = cas_gguf_open(path, &g);
    if (st) return st;
    if ((st = cas_model_config_read(g, &m->cfg))) goto out;
    /* every tensor but the embedding table (a step reads a row of it per token);
     * a model without output.weight reads the table as its output matrix */
    const cas_gguf_tensor *emb = cas_gguf_find_tensor(g, "token_embd.weight");
    for (int64_t i = 0; i < cas_gguf_n_tensors(g); i++) {
        const cas_gguf_tensor *t = cas_gguf_tensor_at(g, i);
        if (t != emb) m->file_weight_bytes += (int64_t)t->nbytes;
    }
    if (emb && !cas_gguf_find_tensor(g, "output.weight")) m->file_weight_bytes += (int64_t)emb->nbytes;
out:
    cas_gguf_close(g);
    return st;
}

/* Bytes of weights one decode step reads. The GPU holds every matrix in
 * bf16 (2 bytes per parameter) and the norms in f32: per layer wq, wk, wv,
 * wo, gate, up, down and two norms, then the output norm and the output
 * matrix (the tied embedding table where there is no output matrix). The
 * CPU reads the file's tensors as they are (quantized). */
static int64_t weight_bytes(const model_shape *m, cas_device dev) {
    if (dev != CAS_DEVICE_CUDA) return m->file_weight_bytes;
    const cas_model_config *c = &m->cfg;
    const int64_t E = c->n_embd, F = c->n_ff, QD = (int64_t)c->n_head * c->head_dim,
                  KD = (int64_t)c->n_head_kv * c->head_dim;
    const int64_t per_layer = E * QD + 2 * E * KD + QD * E + 3 * E * F;
    const int64_t matrices = c->n_layers * per_layer + (int64_t)c->n_vocab * E;
    const int64_t norms = (2 * (int64_t)c->n_layers + 1) * E;
    return 2 * matrices + 4 * norms;
}

/* K and V of one token in every layer: f16 on the CPU, bf16 on the GPU. */
static int64_t kv_bytes_per_token(const model_shape *m) {
    return 2 * (int64_t)m->cfg.n_layers * m->cfg.n_head_kv * m->cfg.head_dim * 2;
}

/* ---- steps ------------------------------------------------------------------ */

typedef struct {
    double t;     /* start, seconds after the first submission */
    double s;     /* the engine's last_step_s */
    double pred;  /* the scheduler's prediction of it */
    int32_t seqs, tokens, prompt_tokens;
    int64_t kv_tokens;
} step_rec;

/* ---- JSON output (jansson) ------------------------------------------------------- */

/* a number, or null for NaN and infinities (which JSON lacks) */
static json_t *jnum(double v) { return isfinite(v) ? json_real(v) : json_null(); }
static json_t *jstr(const char *v) { return v ? json_string(v) : json_null(); }
static json_t *jarr(const double *v, int64_t n) {
    json_t *a = json_array();
    for (int64_t i = 0; a && i < n; i++) json_array_append_new(a, jnum(v[i]));
    return a;
}

/* what names a run, at the head of each of its files */
static json_t *run_json(const char *workload, const char *label, const char *model, const char *device,
                        const cas_engine_opts *eo) {
    json_t *o = json_object();
    json_object_set_new(o, "workload", jstr(workload));
    json_object_set_new(o, "label", jstr(label));
    json_object_set_new(o, "model", jstr(model));
    json_object_set_new(o, "device", jstr(device));
    json_object_set_new(o, "cascade", json_integer(eo->cascade));
    json_object_set_new(o, "batch_invariant", json_boolean(!eo->no_batch_invariance));
    json_object_set_new(o, "prefix_cache", json_integer(eo->prefix_cache));
    json_object_set_new(o, "max_itl_ms", json_real(eo->max_itl_ms));
    return o;
}

/* o as one line on f (o is released); -1 when it could not be written */
static int json_line(json_t *o, FILE *f) {
    const int bad = !o || json_dumpf(o, f, JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10)) != 0 || fputc('\n', f) == EOF;
    json_decref(o);
    return bad ? -1 : 0;
}

/* o into a new file at path (o is released); -1 when it could not be written */
static int json_file(json_t *o, const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) {
        json_decref(o);
        return -1;
    }
    const int bad = json_line(o, f);
    return fclose(f) != 0 || bad ? -1 : 0;
}

static void usage(void) {
    printf("usage: cascade bench [-m MODEL] [--workload NAME] [--scale X] [--requests N] [--prefix T]\n"
           "                     [--suffix T] [--output T] [--tree SPEC] [--rate R] [--temperature X]\n"
           "                     [--no-cascade] [--no-prefix-cache] [--threads N] [--kv-cache-mb N]\n"
           "                     [--max-batch-tokens N] [--max-itl-ms X] [--max-context N] [--seed N]\n"
           "                     [--json] [--label S]\n"
           "                     [--copy-gbps X] [--measure-copy] [--steps-json FILE] [--latency-json FILE]\n"
           "                     [--simd LEVEL] [--no-amx] [--mmap] [--debug-checks]\n"
           "                     [--device auto|cpu|cuda] [--gpu-memory-fraction X] [--enforce-eager]\n"
           "                     [--tensor-parallel N]\n"
           "                     [--no-batch-invariance]\n"
           "  -m MODEL        a GGUF file, or synthetic:NAME (llama-3.2-1b, llama-3-8b, llama-3-70b;\n"
           "                  random weights, --device cuda only)\n"
           "  --workload NAME a preset; options after it override its settings:\n"
           "                  system-prompt      64 requests: 8192 shared tokens + 512 own, 256 out\n"
           "                  few-shot-tree      128 requests: 4096 shared by all, 2048 more by each\n"
           "                                     group of 32, 256 own, 128 out\n"
           "                  document-qa        16 documents of 4096 tokens x 16 questions of 64, 128 out\n"
           "                  parallel-sampling  8 prompts of 2048 tokens x 16 samples at temperature 1,\n"
           "                                     256 out\n"
           "                  unshared           256 requests, nothing shared, log-normal lengths: prompt\n"
           "                                     mean 1000 (sigma 1, [16, 8192]), output mean 250\n"
           "                                     (sigma 0.8, [8, 2048])\n"
           "                  long-context       8 requests on one 65536-token document, 256 own, 256 out\n"
           "  --scale X       multiply every token length (tree, prefix, suffix, output, log-normal\n"
           "                  draws) by X, at least 1 token (default 1)\n"
           "  --tree SPEC     multi-level sharing as in attn-bench: '40*1024(20*512)+10*768'\n"
           "                  (sets the request count; --requests and --prefix are then unused)\n"
           "  --rate R        Poisson arrivals at R requests/s (default: all at once)\n"
           "  --temperature X sampling temperature (default: greedy); request i gets seed --seed + i\n"
           "  --max-context N tokens per sequence (default: the model's, raised to the longest request)\n"
           "  --max-itl-ms X  target time between a stream's tokens while prompts are prefilled: prefill\n"
           "                  chunks are cut to fit it, short prompts go first (default 100; 0 = off)\n"
           "  --label S       a name for this run, copied into the JSON\n"
           "  --copy-gbps X   device copy bandwidth, GB/s of bytes read + written: gives the decode\n"
           "                  steps' byte roofline (else its fields are null)\n"
           "  --measure-copy  cuda: measure that bandwidth on the GPU before the run\n"
           "  --steps-json F  every step's start, time, sequences, tokens, KV tokens read, to F\n"
           "  --latency-json F  TTFT, TPOT per request and inter-token latencies, to F (for CDFs)\n"
           "  --device D      auto (default: the GPU where this build has CUDA and the machine a GPU,\n"
           "                  else the CPU), cpu or cuda\n"
           "  --gpu-memory-fraction X  cuda: share of the GPU's memory for weights, buffers and KV (0.9)\n"
           "  --enforce-eager cuda: launch every step eagerly, no CUDA graphs\n"
           "  --tensor-parallel N  cuda: split the model over N GPUs (NCCL; its heads must divide)\n"
           "  --no-batch-invariance cpu: the fastest attention plans, not batch-invariant\n"
           "  --simd LEVEL    kernels' instruction set: auto (default), generic, avx2, avx512\n"
           "  --no-amx        never the AMX tile unit\n"
           "  --mmap          cpu: keep the weights in the file's shared mapping (default: read into\n"
           "                  huge pages, faster decode)\n"
           "  --debug-checks  check the KV pool's and scheduler's invariants after every change\n"
           "A decode step is a step that computed no prompt token. Its byte roofline reads every\n"
           "weight matrix once and the step's distinct KV tokens once, at the copy bandwidth.\n");
}

int cmd_bench(int argc, char **argv) {
    cas_engine_opts eo = cas_engine_opts_default();
    bench_cfg c;
    memset(&c, 0, sizeof c);
    c.requests = 64, c.prefix = 1024, c.suffix = 32, c.output = 64, c.temperature = -1;
    double rate = 0; /* 0: all at once */
    double scale = 1, copy_gbps = 0;
    int json = 0, measure_copy = 0;
    uint64_t seed = 1;
    const char *label = NULL, *steps_path = NULL, *lat_path = NULL;
    eo.model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        }
        int takes = !strcmp(a, "-m") || !strcmp(a, "--requests") || !strcmp(a, "--prefix") ||
                    !strcmp(a, "--suffix") || !strcmp(a, "--output") || !strcmp(a, "--tree") ||
                    !strcmp(a, "--rate") || !strcmp(a, "--seed") || !strcmp(a, "--threads") ||
                    !strcmp(a, "--kv-cache-mb") || !strcmp(a, "--max-batch-tokens") || !strcmp(a, "--simd") ||
                    !strcmp(a, "--device") || !strcmp(a, "--gpu-memory-fraction") || !strcmp(a, "--workload") ||
                    !strcmp(a, "--scale") || !strcmp(a, "--temperature") || !strcmp(a, "--max-context") ||
                    !strcmp(a, "--label") || !strcmp(a, "--copy-gbps") || !strcmp(a, "--steps-json") ||
                    !strcmp(a, "--latency-json") || !strcmp(a, "--max-itl-ms") || !strcmp(a, "--tensor-parallel");
        if (takes) {
            if (!v) {
                fprintf(stderr, "bench: %s needs a value\n", a);
                return 2;
            }
            i++;
        }
        if (!strcmp(a, "-m")) eo.model_path = v;
        else if (!strcmp(a, "--requests")) c.requests = atoi(v);
        else if (!strcmp(a, "--prefix")) c.prefix = atoi(v), c.lognormal_prompt = 0;
        else if (!strcmp(a, "--suffix")) c.suffix = atoi(v), c.lognormal_prompt = 0;
        else if (!strcmp(a, "--output")) c.output = atoi(v), c.lognormal_output = 0;
        else if (!strcmp(a, "--tree")) c.tree = v, c.lognormal_prompt = 0;
        else if (!strcmp(a, "--rate")) rate = atof(v);
        else if (!strcmp(a, "--seed")) seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--threads")) eo.threads = atoi(v);
        else if (!strcmp(a, "--kv-cache-mb")) eo.kv_cache_bytes = (int64_t)atoll(v) << 20;
        else if (!strcmp(a, "--max-batch-tokens")) eo.max_batch_tokens = atoi(v);
        else if (!strcmp(a, "--max-context")) eo.max_context = atoi(v);
        else if (!strcmp(a, "--max-itl-ms")) {
            char *end = NULL;
            double x = strtod(v, &end);
            if (!*v || *end || !(x >= 0 && x <= 1e7)) {
                fprintf(stderr, "bench: --max-itl-ms needs a number of milliseconds in [0, 1e7] (0 = off)\n");
                return 2;
            }
            eo.max_itl_ms = (float)x;
        }
        else if (!strcmp(a, "--no-cascade")) eo.cascade = 0;
        else if (!strcmp(a, "--enforce-eager")) eo.enforce_eager = 1;
        else if (!strcmp(a, "--tensor-parallel")) {
            char *end = NULL;
            const long n = strtol(v, &end, 10);
            if (!*v || *end || n < 1 || n > CAS_ENGINE_MAX_TENSOR_PARALLEL) {
                fprintf(stderr, "bench: --tensor-parallel takes 1 to %d GPUs\n", CAS_ENGINE_MAX_TENSOR_PARALLEL);
                return 2;
            }
            eo.tensor_parallel = (int32_t)n;
        }
        else if (!strcmp(a, "--no-batch-invariance")) eo.no_batch_invariance = 1;
        else if (!strcmp(a, "--no-prefix-cache")) eo.prefix_cache = 0;
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--no-amx")) eo.amx_off = 1;
        else if (!strcmp(a, "--mmap")) eo.mmap_weights = 1;
        else if (!strcmp(a, "--debug-checks")) eo.debug_checks = 1;
        else if (!strcmp(a, "--measure-copy")) measure_copy = 1;
        else if (!strcmp(a, "--label")) label = v;
        else if (!strcmp(a, "--steps-json")) steps_path = v;
        else if (!strcmp(a, "--latency-json")) lat_path = v;
        else if (!strcmp(a, "--workload")) {
            if (apply_workload(&c, v)) {
                fprintf(stderr, "bench: no workload '%s' (%s)\n", v, WORKLOADS);
                return 2;
            }
        } else if (!strcmp(a, "--scale")) {
            scale = atof(v);
            if (!(scale > 0 && scale <= 1000)) {
                fprintf(stderr, "bench: --scale must be in (0, 1000]\n");
                return 2;
            }
        } else if (!strcmp(a, "--temperature")) {
            c.temperature = (float)atof(v);
            if (!(c.temperature >= 0)) {
                fprintf(stderr, "bench: --temperature must be >= 0\n");
                return 2;
            }
        } else if (!strcmp(a, "--copy-gbps")) {
            copy_gbps = atof(v);
            if (!(copy_gbps > 0)) {
                fprintf(stderr, "bench: --copy-gbps must be > 0\n");
                return 2;
            }
        } else if (!strcmp(a, "--device")) {
            if (cas_device_parse(v, &eo.device)) {
                fprintf(stderr, "bench: --device takes auto, cpu or cuda, not '%s'\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--gpu-memory-fraction")) {
            eo.gpu_memory_fraction = (float)atof(v);
            if (!(eo.gpu_memory_fraction > 0 && eo.gpu_memory_fraction <= 1)) {
                fprintf(stderr, "bench: --gpu-memory-fraction must be in (0, 1]\n");
                return 2;
            }
        } else if (!strcmp(a, "--simd")) {
            if (cas_simd_parse(v, &eo.simd)) {
                fprintf(stderr, "bench: --simd takes auto, generic, avx2 or avx512, not '%s'\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "bench: unknown option '%s'\n", a);
            return 2;
        }
    }
    if (c.requests < 1 || c.prefix < 0 || c.suffix < 0 || (c.output < 1 && !c.lognormal_output) || rate < 0 ||
        eo.max_context < 0) {
        fprintf(stderr, "bench: --requests and --output must be >= 1, --prefix/--suffix/--rate/--max-context >= 0\n");
        return 2;
    }

    /* the requests, before the engine: a bad spec fails at once, and the
     * longest request sets the context */
    cas_rng rng;
    cas_rng_seed(&rng, seed);
    prompts ps = {0};
    const int32_t prefix = scaled(c.prefix, scale), suffix = scaled(c.suffix, scale), output = scaled(c.output, scale);
    char spec[64];
    const char *tree = c.tree;
    int rc = 0;
    cas_engine *e = NULL;
    bench_ctx ctx = {0};
    step_rec *steps = NULL;
    double *ttft = NULL, *tpot = NULL, *dec_ms = NULL, *dec_seqs = NULL, *dec_kv = NULL, *dec_bytes = NULL,
           *dec_roof = NULL, *dec_ratio = NULL;
    if (c.lognormal_prompt) {
        tree = "lognormal";
        for (int32_t i = 0; i < c.requests; i++) {
            int32_t len = scaled(lognormal_len(&rng, LN_PROMPT_MEAN, LN_PROMPT_SIGMA, LN_PROMPT_MIN, LN_PROMPT_MAX),
                                 scale);
            int32_t out = c.lognormal_output
                              ? scaled(lognormal_len(&rng, LN_OUTPUT_MEAN, LN_OUTPUT_SIGMA, LN_OUTPUT_MIN, LN_OUTPUT_MAX),
                                       scale)
                              : output;
            if (add_request(&ps, NULL, 0, len, out, &rng)) {
                fprintf(stderr, "bench: out of memory for the prompts\n");
                rc = 1;
                goto out;
            }
        }
    } else {
        if (!tree) {
            /* the prefix is scaled here, so the spec carries it as it is */
            snprintf(spec, sizeof spec, "%d*%d", c.requests, prefix);
            tree = spec;
        }
        tree_gen g = {suffix, output, tree == spec ? 1.0 : scale, &rng};
        const char *s = tree;
        if (parse_groups(&s, &ps, NULL, 0, &g, 0) || *s) {
            fprintf(stderr, "bench: bad --tree '%s'\n", tree);
            rc = 2;
            goto out;
        }
        if (c.lognormal_output) /* the prompts from the options, the outputs drawn */
            for (int32_t i = 0; i < ps.n; i++)
                ps.out[i] = scaled(lognormal_len(&rng, LN_OUTPUT_MEAN, LN_OUTPUT_SIGMA, LN_OUTPUT_MIN, LN_OUTPUT_MAX),
                                   scale);
    }
    for (int32_t i = 0; i < ps.n; i++)
        if (ps.len[i] < 1) {
            fprintf(stderr, "bench: request %d has an empty prompt (give --prefix or --suffix > 0)\n", i);
            rc = 2;
            goto out;
        }
    int64_t max_len = 0, prompt_total = 0, out_asked = 0;
    for (int32_t i = 0; i < ps.n; i++) {
        if (ps.len[i] + ps.out[i] > max_len) max_len = ps.len[i] + ps.out[i];
        prompt_total += ps.len[i];
        out_asked += ps.out[i];
    }

    model_shape shape;
    int have_shape = read_shape(eo.model_path, &shape) == CAS_OK;
    if (!have_shape) fprintf(stderr, "bench: no model shape, no byte roofline: %s\n", cas_last_error());
    if (have_shape && eo.max_context == 0 && max_len > shape.cfg.n_ctx_train) {
        eo.max_context = (int32_t)max_len;
        fprintf(stderr, "bench: context raised from the model's %d to %d tokens for the longest request\n",
                shape.cfg.n_ctx_train, eo.max_context);
    }

    /* before the engine takes its share of the GPU's memory */
    if (measure_copy) {
#if CAS_WITH_CUDA
        if (cas_device_resolve(eo.device) == CAS_DEVICE_CUDA) {
            if (cas_cuda_measure_copy(eo.gpu_device, &copy_gbps)) {
                fprintf(stderr, "bench: measuring the copy bandwidth: %s\n", cas_last_error());
                rc = 1;
                goto out;
            }
            fprintf(stderr, "bench: device copy %.0f GB/s (read + write)\n", copy_gbps);
        } else
            fprintf(stderr, "bench: --measure-copy measures a CUDA device only; not measured\n");
#else
        fprintf(stderr, "bench: --measure-copy needs a CUDA build (make CUDA=1); not measured\n");
#endif
    }

    if (cas_engine_create(&e, &eo)) {
        fprintf(stderr, "bench: %s\n", cas_last_error());
        rc = 1;
        goto out;
    }
    const char *model_name = cas_engine_model_name(e), *device_name = cas_engine_device_name(e);
    fprintf(stderr, "bench: %s on %s\n", model_name, device_name);
    const int64_t wbytes = have_shape ? weight_bytes(&shape, cas_engine_device(e)) : 0;
    const int64_t kvb = have_shape ? kv_bytes_per_token(&shape) : 0;

    ctx.st = calloc((size_t)ps.n, sizeof(req_stat));
    if (!ctx.st) {
        fprintf(stderr, "bench: out of memory\n");
        rc = 1;
        goto out;
    }
    g_ctx = &ctx;
    int64_t n_steps = 0, steps_cap = 0, steps_seen = 0;
    double t0 = cas_now_s(), next = t0;
    int32_t submitted = 0;
    while (ctx.n_done < ps.n) {
        double now = cas_now_s();
        while (submitted < ps.n && (rate <= 0 || now >= next)) {
            cas_engine_request rq;
            memset(&rq, 0, sizeof rq);
            rq.tokens = ps.toks[submitted];
            rq.n_tokens = ps.len[submitted];
            rq.sampling = cas_engine_sampling_default();
            rq.sampling.max_tokens = ps.out[submitted];
            rq.sampling.ignore_eos = 1;
            rq.sampling.seed = seed + (uint64_t)submitted;
            if (c.temperature >= 0) rq.sampling.temperature = c.temperature;
            rq.cb = on_event;
            rq.user = &ctx.st[submitted];
            ctx.st[submitted].submit_t = now;
            uint64_t id;
            if (cas_engine_submit(e, &rq, &id)) {
                fprintf(stderr, "bench: %s\n", cas_last_error());
                rc = 1;
                goto out;
            }
            submitted++;
            if (rate > 0) next += -log(1.0 - cas_rng_uniform(&rng)) / rate;
        }
        int busy = 0;
        double ts = cas_now_s();
        if (cas_engine_step(e, &busy)) {
            fprintf(stderr, "bench: %s\n", cas_last_error());
            rc = 1;
            goto out;
        }
        cas_engine_stats st;
        cas_engine_get_stats(e, &st);
        if (st.steps == steps_seen) continue; /* nothing ran */
        steps_seen = st.steps;
        if (n_steps == steps_cap) {
            int64_t cap = steps_cap ? steps_cap * 2 : 1024;
            step_rec *p = realloc(steps, sizeof(step_rec) * (size_t)cap);
            if (!p) {
                fprintf(stderr, "bench: out of memory for the steps\n");
                rc = 1;
                goto out;
            }
            steps = p;
            steps_cap = cap;
        }
        steps[n_steps++] = (step_rec){ts - t0, st.last_step_s, st.last_step_predicted_s, st.last_step_seqs,
                                      st.last_step_tokens,
                                      st.last_step_prompt_tokens, st.last_step_kv_tokens};
    }
    double elapsed = cas_now_s() - t0;

    /* per request */
    ttft = malloc(sizeof(double) * (size_t)ps.n);
    tpot = malloc(sizeof(double) * (size_t)ps.n);
    /* per decode step */
    size_t nd_bytes = sizeof(double) * (size_t)(n_steps + 1);
    dec_ms = malloc(nd_bytes), dec_seqs = malloc(nd_bytes), dec_kv = malloc(nd_bytes);
    dec_bytes = malloc(nd_bytes), dec_roof = malloc(nd_bytes), dec_ratio = malloc(nd_bytes);
    if (!ttft || !tpot || !dec_ms || !dec_seqs || !dec_kv || !dec_bytes || !dec_roof || !dec_ratio) {
        fprintf(stderr, "bench: out of memory\n");
        rc = 1;
        goto out;
    }
    int n_tpot = 0;
    int64_t out_tokens = 0;
    for (int32_t i = 0; i < ps.n; i++) {
        req_stat *r = &ctx.st[i];
        ttft[i] = (r->first_t - r->submit_t) * 1e3;
        out_tokens += r->n_out;
        if (r->n_out > 1) tpot[n_tpot++] = (r->last_t - r->first_t) * 1e3 / (r->n_out - 1);
    }
    /* the roofline per decode step: every weight and the step's distinct KV
     * tokens read once. The copy bandwidth counts bytes read + written, a
     * step only reads, so roofline_ms = bytes / (copy_gbps * 1e9) * 1e3;
     * step_over_roofline is the median over decode steps of each step's
     * time over its own roofline */
    int64_t nd = 0;
    for (int64_t i = 0; i < n_steps; i++) {
        const step_rec *s = &steps[i];
        if (s->prompt_tokens != 0) continue;
        const double bytes = (double)wbytes + (double)s->kv_tokens * (double)kvb;
        dec_ms[nd] = s->s * 1e3;
        dec_seqs[nd] = s->seqs;
        dec_kv[nd] = (double)s->kv_tokens;
        dec_bytes[nd] = bytes;
        dec_roof[nd] = copy_gbps > 0 && have_shape ? bytes / (copy_gbps * 1e9) * 1e3 : NAN;
        dec_ratio[nd] = dec_ms[nd] / dec_roof[nd];
        nd++;
    }
    cas_engine_stats st;
    cas_engine_get_stats(e, &st);
    const double hit =
        st.prefix_queries_tokens ? (double)st.prefix_hit_tokens / (double)st.prefix_queries_tokens : 0;
    const double t50 = pct(ttft, ps.n, 50), t99 = pct(ttft, ps.n, 99);
    const double p50 = pct(tpot, n_tpot, 50), p99 = pct(tpot, n_tpot, 99);
    const double i50 = pct(ctx.itl.v, ctx.itl.n, 50), i99 = pct(ctx.itl.v, ctx.itl.n, 99);
    const double d50 = pct(dec_ms, nd, 50), d99 = pct(dec_ms, nd, 99);
    const double batch50 = pct(dec_seqs, nd, 50), kv50 = pct(dec_kv, nd, 50);
    const double bytes50 = have_shape ? pct(dec_bytes, nd, 50) : NAN;
    const double roof50 = pct(dec_roof, nd, 50), ratio50 = pct(dec_ratio, nd, 50);
    const double out_per_s = (double)out_tokens / elapsed, total_per_s = (double)(out_tokens + prompt_total) / elapsed;
    if (json) {
        json_t *o = run_json(c.workload, label, model_name, device_name, &eo);
        json_object_set_new(o, "requests", json_integer(ps.n));
        json_object_set_new(o, "prefix", json_integer(prefix));
        json_object_set_new(o, "suffix", json_integer(suffix));
        json_object_set_new(o, "output", json_integer(output));
        json_object_set_new(o, "tree", jstr(tree));
        json_object_set_new(o, "prompt_len_mean", jnum((double)prompt_total / ps.n));
        json_object_set_new(o, "output_len_mean", jnum((double)out_asked / ps.n));
        json_object_set_new(o, "scale", jnum(scale));
        json_object_set_new(o, "rate", jnum(rate));
        json_object_set_new(o, "temperature", jnum(c.temperature >= 0 ? c.temperature : 0.0));
        json_object_set_new(o, "max_context", json_integer(cas_engine_context_length(e)));
        json_object_set_new(o, "elapsed_s", jnum(elapsed));
        json_object_set_new(o, "output_tokens", json_integer((long long)out_tokens));
        json_object_set_new(o, "output_tok_per_s", jnum(out_per_s));
        json_object_set_new(o, "total_tok_per_s", jnum(total_per_s));
        json_object_set_new(o, "prompt_tokens", json_integer((long long)prompt_total));
        json_object_set_new(o, "prompt_tokens_computed", json_integer((long long)st.prompt_tokens_computed));
        json_object_set_new(o, "prefix_cache_hit_rate", jnum(hit));
        json_object_set_new(o, "ttft_ms_p50", jnum(t50));
        json_object_set_new(o, "ttft_ms_p99", jnum(t99));
        json_object_set_new(o, "tpot_ms_p50", jnum(p50));
        json_object_set_new(o, "tpot_ms_p99", jnum(p99));
        json_object_set_new(o, "itl_ms_p50", jnum(i50));
        json_object_set_new(o, "itl_ms_p99", jnum(i99));
        json_object_set_new(o, "steps", json_integer((long long)st.steps));
        json_object_set_new(o, "cascade_steps", json_integer((long long)st.cascade_steps));
        json_object_set_new(o, "preemptions", json_integer((long long)st.preemptions));
        json_object_set_new(o, "itl_limited_steps", json_integer((long long)st.itl_limited_steps));
        json_object_set_new(o, "graph_steps", json_integer((long long)st.graph_steps));
        json_object_set_new(o, "eager_steps", json_integer((long long)st.eager_steps));
        json_object_set_new(o, "decode_steps", json_integer((long long)nd));
        json_object_set_new(o, "decode_step_ms_p50", jnum(d50));
        json_object_set_new(o, "decode_step_ms_p99", jnum(d99));
        json_object_set_new(o, "decode_batch_median", jnum(batch50));
        json_object_set_new(o, "decode_kv_tokens_median", jnum(kv50));
        json_object_set_new(o, "weight_bytes", jnum(have_shape ? (double)wbytes : NAN));
        json_object_set_new(o, "kv_bytes_per_token", jnum(have_shape ? (double)kvb : NAN));
        json_object_set_new(o, "decode_step_bytes_median", jnum(bytes50));
        json_object_set_new(o, "copy_gbps", jnum(copy_gbps > 0 ? copy_gbps : NAN));
        json_object_set_new(o, "roofline_ms_median", jnum(roof50));
        json_object_set_new(o, "step_over_roofline", jnum(ratio50));
        if (json_line(o, stdout)) rc = 1;
    } else {
        printf("%d requests in %.2f s: %.1f output tok/s, %.1f total tok/s; prompt tokens computed %lld of %lld "
               "(prefix-cache hit rate %.1f%%); TTFT p50 %.1f ms p99 %.1f ms; TPOT p50 %.2f ms p99 %.2f ms; "
               "ITL p50 %.2f ms p99 %.2f ms; %lld steps, %lld with cascade, %lld preemptions\n",
               ps.n, elapsed, out_per_s, total_per_s, (long long)st.prompt_tokens_computed, (long long)prompt_total,
               100 * hit, t50, t99, p50, p99, i50, i99, (long long)st.steps, (long long)st.cascade_steps,
               (long long)st.preemptions);
        printf("decode steps %lld: p50 %.3f ms p99 %.3f ms, batch p50 %.0f, KV tokens p50 %.0f", (long long)nd, d50,
               d99, batch50, kv50);
        if (have_shape) printf(", %.1f MB read p50", bytes50 / 1e6);
        if (isfinite(roof50)) printf(", roofline p50 %.3f ms at %.0f GB/s copy, %.2fx it", roof50, copy_gbps, ratio50);
        printf("; graph steps %lld, eager steps %lld\n", (long long)st.graph_steps, (long long)st.eager_steps);
    }
    fflush(stdout);

    if (steps_path) {
        json_t *o = run_json(c.workload, label, model_name, device_name, &eo);
        json_object_set_new(o, "weight_bytes", json_integer((json_int_t)wbytes));
        json_object_set_new(o, "kv_bytes_per_token", json_integer((json_int_t)kvb));
        json_object_set_new(o, "copy_gbps", jnum(copy_gbps > 0 ? copy_gbps : NAN));
        /* t: start in s after the first submission; s: the step's time in s;
         * predicted_s: the scheduler's cost model's guess of s (before the step);
         * kv_tokens: distinct KV tokens its attention reads; decode: no prompt
         * token computed; bytes: weights + kv_tokens * kv_bytes_per_token */
        json_t *arr = json_array();
        for (int64_t i = 0; i < n_steps; i++) {
            const step_rec *r = &steps[i];
            json_array_append_new(arr, json_pack("{s:f, s:f, s:f, s:i, s:i, s:i, s:I, s:b, s:f}", "t", r->t, "s", r->s,
                                                 "predicted_s", r->pred, "seqs", r->seqs, "tokens", r->tokens, "prompt_tokens",
                                                 r->prompt_tokens, "kv_tokens", (json_int_t)r->kv_tokens, "decode",
                                                 r->prompt_tokens == 0, "bytes",
                                                 (double)wbytes + (double)r->kv_tokens * (double)kvb));
        }
        json_object_set_new(o, "steps", arr);
        if (json_file(o, steps_path)) {
            fprintf(stderr, "bench: cannot write %s\n", steps_path);
            rc = 1;
        }
    }
    if (lat_path) {
        json_t *o = run_json(c.workload, label, model_name, device_name, &eo);
        /* per request, in submission order */
        json_object_set_new(o, "ttft_ms", jarr(ttft, ps.n));
        json_object_set_new(o, "tpot_ms", jarr(tpot, n_tpot));
        /* all inter-token gaps sorted; past ITL_SAMPLES_MAX, evenly spaced
         * order statistics of them (the same CDF, coarser) */
        qsort(ctx.itl.v, (size_t)ctx.itl.n, sizeof(double), cmp_d);
        json_object_set_new(o, "itl_count", json_integer((json_int_t)ctx.itl.n));
        json_t *itl = json_array();
        const int64_t k = ctx.itl.n < ITL_SAMPLES_MAX ? ctx.itl.n : ITL_SAMPLES_MAX;
        for (int64_t i = 0; i < k; i++)
            json_array_append_new(itl, json_real(ctx.itl.v[k > 1 ? i * (ctx.itl.n - 1) / (k - 1) : 0]));
        json_object_set_new(o, "itl_ms", itl);
        if (json_file(o, lat_path)) {
            fprintf(stderr, "bench: cannot write %s\n", lat_path);
            rc = 1;
        }
    }
out:
    free(ttft);
    free(tpot);
    free(dec_ms);
    free(dec_seqs);
    free(dec_kv);
    free(dec_bytes);
    free(dec_roof);
    free(dec_ratio);
    free(steps);
    free(ctx.itl.v);
    for (int32_t i = 0; i < ps.n; i++) free(ps.toks[i]);
    free(ps.toks);
    free(ps.len);
    free(ps.out);
    free(ctx.st);
    if (e) cas_engine_destroy(e);
    return rc;
}
