/*
 * cmd_bench.c: `cascade bench`, offline serving benchmark through the engine.
 * Synthetic requests share a prefix (or a tree of prefixes) and have unique
 * suffixes of random tokens; they arrive all at once or as a Poisson process
 * at --rate requests per second. Reports throughput, time to first token and
 * time per output token percentiles, prompt tokens the model actually computed
 * and the prefix-cache hit rate; --no-cascade and --no-prefix-cache switch
 * each feature off so its effect can be measured, and --simd / --no-amx pick
 * the kernels' instruction set to compare them.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../engine/engine.h"
#include "tools.h"

typedef struct {
    double submit_t, first_t, last_t;
    int32_t n_out;
    int done;
} req_stat;

typedef struct {
    req_stat *st;
    int32_t n_done;
} bench_ctx;

static bench_ctx *g_ctx;

static void on_event(void *user, const cas_engine_event *ev) {
    req_stat *r = user;
    double now = cas_now_s();
    if (ev->n_tokens > 0) {
        if (r->n_out == 0) r->first_t = now;
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

static double pct(double *v, int n, double p) {
    if (n == 0) return NAN;
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    double idx = p / 100.0 * (n - 1);
    int lo = (int)idx;
    int hi = lo + 1 < n ? lo + 1 : lo;
    return v[lo] + (v[hi] - v[lo]) * (idx - lo);
}

/* Token lists per request from a tree spec "N*T(...)+..." like attn-bench's:
 * requests below a group share its T tokens. */
typedef struct {
    int32_t **toks;
    int32_t *len;
    int32_t n, cap;
} prompts;

static int parse_groups(const char **s, prompts *ps, int32_t *prefix, int32_t plen, int32_t suffix,
                        cas_rng *rng, int32_t vocab, int depth);

static int add_request(prompts *ps, const int32_t *prefix, int32_t plen, int32_t suffix, cas_rng *rng,
                       int32_t vocab) {
    if (ps->n == ps->cap) {
        ps->cap = ps->cap ? ps->cap * 2 : 64;
        ps->toks = realloc(ps->toks, sizeof(int32_t *) * (size_t)ps->cap);
        ps->len = realloc(ps->len, sizeof(int32_t) * (size_t)ps->cap);
    }
    int32_t *t = malloc(sizeof(int32_t) * (size_t)(plen + suffix + 1));
    memcpy(t, prefix, sizeof(int32_t) * (size_t)plen);
    for (int32_t i = 0; i < suffix; i++) t[plen + i] = (int32_t)cas_rng_range(rng, 100, vocab - 1);
    ps->toks[ps->n] = t;
    ps->len[ps->n] = plen + suffix;
    ps->n++;
    return 0;
}

static int parse_group(const char **s, prompts *ps, int32_t *prefix, int32_t plen, int32_t suffix,
                       cas_rng *rng, int32_t vocab, int depth) {
    char *end;
    long n = strtol(*s, &end, 10);
    if (end == *s || *end != '*' || n < 1 || n > 100000) return -1;
    *s = end + 1;
    long t = strtol(*s, &end, 10);
    if (end == *s || t < 0 || t > 1000000) return -1;
    *s = end;
    int32_t *p2 = malloc(sizeof(int32_t) * (size_t)(plen + t + 1));
    memcpy(p2, prefix, sizeof(int32_t) * (size_t)plen);
    for (long i = 0; i < t; i++) p2[plen + i] = (int32_t)cas_rng_range(rng, 100, vocab - 1);
    int placed0 = ps->n;
    if (**s == '(') {
        (*s)++;
        if (parse_groups(s, ps, p2, plen + (int32_t)t, suffix, rng, vocab, depth + 1) || **s != ')') {
            free(p2);
            return -1;
        }
        (*s)++;
    }
    while (ps->n - placed0 < n) add_request(ps, p2, plen + (int32_t)t, suffix, rng, vocab);
    free(p2);
    return ps->n - placed0 > n ? -1 : 0;
}

static int parse_groups(const char **s, prompts *ps, int32_t *prefix, int32_t plen, int32_t suffix,
                        cas_rng *rng, int32_t vocab, int depth) {
    if (depth > 16) return -1;
    for (;;) {
        if (parse_group(s, ps, prefix, plen, suffix, rng, vocab, depth)) return -1;
        if (**s != '+') return 0;
        (*s)++;
    }
}

int cmd_bench(int argc, char **argv) {
    cas_engine_opts eo = cas_engine_opts_default();
    int32_t requests = 64, prefix = 1024, suffix = 32, output = 64;
    double rate = 0; /* 0: all at once */
    const char *tree = NULL;
    int json = 0;
    uint64_t seed = 1;
    eo.model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: cascade bench [-m MODEL] [--requests N] [--prefix T] [--suffix T] [--output T]\n"
                   "                     [--tree SPEC] [--rate R] [--no-cascade] [--no-prefix-cache]\n"
                   "                     [--threads N] [--kv-cache-mb N] [--max-batch-tokens N] [--seed N] [--json]\n"
                   "                     [--simd LEVEL] [--no-amx] [--debug-checks]\n"
                   "                     [--device auto|cpu|cuda] [--gpu-memory-fraction X] [--enforce-eager]\n"
                   "  --device D      auto (default: the GPU where this build has CUDA and the machine a GPU,\n"
                   "                  else the CPU), cpu or cuda\n"
                   "  --gpu-memory-fraction X  cuda: share of the GPU's memory for weights, buffers and KV (0.9)\n"
                   "  --enforce-eager cuda: launch every step eagerly, no CUDA graphs\n"
                   "  --tree SPEC     multi-level sharing as in attn-bench: '40*1024(20*512)+10*768'\n"
                   "  --rate R        Poisson arrivals at R requests/s (default: all at once)\n"
                   "  --simd LEVEL    kernels' instruction set: auto (default), generic, avx2, avx512\n"
                   "  --no-amx        never the AMX tile unit\n"
                   "  --debug-checks  check the KV pool's and scheduler's invariants after every change\n");
            return 0;
        }
        int takes = !strcmp(a, "-m") || !strcmp(a, "--requests") || !strcmp(a, "--prefix") ||
                    !strcmp(a, "--suffix") || !strcmp(a, "--output") || !strcmp(a, "--tree") ||
                    !strcmp(a, "--rate") || !strcmp(a, "--seed") || !strcmp(a, "--threads") ||
                    !strcmp(a, "--kv-cache-mb") || !strcmp(a, "--max-batch-tokens") || !strcmp(a, "--simd") ||
                    !strcmp(a, "--device") || !strcmp(a, "--gpu-memory-fraction");
        if (takes) {
            if (!v) {
                fprintf(stderr, "bench: %s needs a value\n", a);
                return 2;
            }
            i++;
        }
        if (!strcmp(a, "-m")) eo.model_path = v;
        else if (!strcmp(a, "--requests")) requests = atoi(v);
        else if (!strcmp(a, "--prefix")) prefix = atoi(v);
        else if (!strcmp(a, "--suffix")) suffix = atoi(v);
        else if (!strcmp(a, "--output")) output = atoi(v);
        else if (!strcmp(a, "--tree")) tree = v;
        else if (!strcmp(a, "--rate")) rate = atof(v);
        else if (!strcmp(a, "--seed")) seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--threads")) eo.threads = atoi(v);
        else if (!strcmp(a, "--kv-cache-mb")) eo.kv_cache_bytes = (int64_t)atoll(v) << 20;
        else if (!strcmp(a, "--max-batch-tokens")) eo.max_batch_tokens = atoi(v);
        else if (!strcmp(a, "--no-cascade")) eo.cascade = 0;
        else if (!strcmp(a, "--enforce-eager")) eo.enforce_eager = 1;
        else if (!strcmp(a, "--no-prefix-cache")) eo.prefix_cache = 0;
        else if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--no-amx")) eo.amx_off = 1;
        else if (!strcmp(a, "--debug-checks")) eo.debug_checks = 1;
        else if (!strcmp(a, "--device")) {
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
    if (requests < 1 || prefix < 0 || suffix < 0 || output < 1 || rate < 0) {
        fprintf(stderr, "bench: --requests and --output must be >= 1, --prefix/--suffix/--rate >= 0\n");
        return 2;
    }
    cas_engine *e;
    if (cas_engine_create(&e, &eo)) {
        fprintf(stderr, "bench: %s\n", cas_last_error());
        return 1;
    }
    fprintf(stderr, "bench: %s on %s\n", cas_engine_model_name(e), cas_engine_device_name(e));
    cas_rng rng;
    cas_rng_seed(&rng, seed);
    prompts ps = {0};
    char spec[64];
    if (!tree) {
        snprintf(spec, sizeof spec, "%d*%d", requests, prefix);
        tree = spec;
    }
    const char *s = tree;
    int32_t *empty = NULL;
    if (parse_groups(&s, &ps, empty, 0, suffix, &rng, 49152, 0) || *s) {
        fprintf(stderr, "bench: bad --tree '%s'\n", tree);
        cas_engine_destroy(e);
        return 2;
    }
    bench_ctx ctx = {calloc((size_t)ps.n, sizeof(req_stat)), 0};
    g_ctx = &ctx;
    double t0 = cas_now_s(), next = t0;
    int32_t submitted = 0;
    int64_t prompt_total = 0;
    int rc = 0;
    while (ctx.n_done < ps.n) {
        double now = cas_now_s();
        while (submitted < ps.n && (rate <= 0 || now >= next)) {
            cas_engine_request rq;
            memset(&rq, 0, sizeof rq);
            rq.tokens = ps.toks[submitted];
            rq.n_tokens = ps.len[submitted];
            rq.sampling = cas_engine_sampling_default();
            rq.sampling.max_tokens = output;
            rq.sampling.ignore_eos = 1;
            rq.cb = on_event;
            rq.user = &ctx.st[submitted];
            ctx.st[submitted].submit_t = now;
            uint64_t id;
            if (cas_engine_submit(e, &rq, &id)) {
                fprintf(stderr, "bench: %s\n", cas_last_error());
                rc = 1;
                goto out;
            }
            prompt_total += ps.len[submitted];
            submitted++;
            if (rate > 0) next += -log(1.0 - cas_rng_uniform(&rng)) / rate;
        }
        int busy = 0;
        if (cas_engine_step(e, &busy)) {
            fprintf(stderr, "bench: %s\n", cas_last_error());
            rc = 1;
            goto out;
        }
        (void)busy;
    }
    double elapsed = cas_now_s() - t0;
    double *ttft = malloc(sizeof(double) * (size_t)ps.n), *tpot = malloc(sizeof(double) * (size_t)ps.n);
    int n_tpot = 0;
    int64_t out_tokens = 0;
    for (int32_t i = 0; i < ps.n; i++) {
        req_stat *r = &ctx.st[i];
        ttft[i] = (r->first_t - r->submit_t) * 1e3;
        out_tokens += r->n_out;
        if (r->n_out > 1) tpot[n_tpot++] = (r->last_t - r->first_t) * 1e3 / (r->n_out - 1);
    }
    cas_engine_stats st;
    cas_engine_get_stats(e, &st);
    double hit = st.prefix_queries_tokens ? (double)st.prefix_hit_tokens / (double)st.prefix_queries_tokens : 0;
    double t50 = pct(ttft, ps.n, 50), t99 = pct(ttft, ps.n, 99);
    double p50 = pct(tpot, n_tpot, 50), p99 = pct(tpot, n_tpot, 99);
    if (json)
        printf("{\"requests\": %d, \"prefix\": %d, \"suffix\": %d, \"output\": %d, \"tree\": \"%s\", \"rate\": %g, "
               "\"cascade\": %d, \"prefix_cache\": %d, \"elapsed_s\": %.4f, \"output_tok_per_s\": %.3f, "
               "\"total_tok_per_s\": %.3f, \"prompt_tokens\": %lld, \"prompt_tokens_computed\": %lld, "
               "\"prefix_cache_hit_rate\": %.4f, \"ttft_ms_p50\": %.3f, \"ttft_ms_p99\": %.3f, "
               "\"tpot_ms_p50\": %.3f, \"tpot_ms_p99\": %.3f, \"steps\": %lld, \"cascade_steps\": %lld, "
               "\"preemptions\": %lld, \"graph_steps\": %lld, \"eager_steps\": %lld}\n",
               ps.n, prefix, suffix, output, tree, rate, eo.cascade, eo.prefix_cache, elapsed,
               out_tokens / elapsed, (out_tokens + prompt_total) / elapsed, (long long)prompt_total,
               (long long)st.prompt_tokens_computed, hit, t50, t99, p50, p99, (long long)st.steps,
               (long long)st.cascade_steps, (long long)st.preemptions, (long long)st.graph_steps,
               (long long)st.eager_steps);
    else
        printf("%d requests in %.2f s: %.1f output tok/s; prompt tokens computed %lld of %lld (prefix-cache hit "
               "rate %.1f%%); TTFT p50 %.1f ms p99 %.1f ms; TPOT p50 %.2f ms p99 %.2f ms; %lld steps, %lld with "
               "cascade, %lld preemptions\n",
               ps.n, elapsed, out_tokens / elapsed, (long long)st.prompt_tokens_computed, (long long)prompt_total,
               100 * hit, t50, t99, p50, p99, (long long)st.steps, (long long)st.cascade_steps,
               (long long)st.preemptions);
    free(ttft);
    free(tpot);
out:
    for (int32_t i = 0; i < ps.n; i++) free(ps.toks[i]);
    free(ps.toks);
    free(ps.len);
    free(ctx.st);
    cas_engine_destroy(e);
    return rc;
}
