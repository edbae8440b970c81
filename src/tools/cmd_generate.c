/*
 * cmd_generate.c: `cascade generate`, text generation for one or several
 * prompts through the engine: the prompts are submitted together, so they
 * run in one batch with continuous batching, the prefix cache (a system
 * prompt they share is computed once) and cascade attention (its KV is read
 * once per step for all of them).
 *
 * Output: one prompt streams as it is generated; several prompts print each
 * answer, labelled, as it finishes. Timing goes to stderr at the end.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../engine/engine.h"
#include "tools.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define MAX_STOPS 16

static void usage(FILE *f) {
    fprintf(f,
            "usage: cascade generate [-m MODEL] (-p PROMPT ... | --file PATH) [options]\n"
            "  -m, --model PATH     GGUF model (default %s)\n"
            "  -p, --prompt TEXT    a prompt; repeat for several, generated together in one batch\n"
            "  --file PATH          one prompt per line\n"
            "  --chat               apply the model's chat template (the prompt is the user message)\n"
            "  --system TEXT        system message for --chat (shared by every prompt)\n"
            "  -n, --max-tokens N   tokens to generate per prompt (default 128)\n"
            "  --temperature X      0 = greedy (default 0.7)\n"
            "  --top-k N            (default 40; 0 = off)\n"
            "  --top-p X            (default 0.95; 1 = off)\n"
            "  --min-p X            (default 0.05; 0 = off)\n"
            "  --seed N             per-prompt seeds are N, N+1, ... (default 42)\n"
            "  --stop TEXT          stop string (repeatable, up to %d)\n"
            "  --device D           auto (default: the GPU where this build has CUDA and the machine\n"
            "                       a GPU, else the CPU), cpu or cuda\n"
            "  --gpu-memory-fraction X  cuda: share of the GPU's memory for weights, buffers and the\n"
            "                       KV pool (default 0.9)\n"
            "  --enforce-eager      cuda: launch every step eagerly, no CUDA graphs\n"
            "  --tensor-parallel N  cuda: split the model over N GPUs (NCCL; its heads must divide)\n"
            "  --no-batch-invariance cpu: the fastest attention plans (a sequence's tokens may then\n"
            "                       change with the sequences batched beside it)\n"
            "  --threads N          CPU threads (default: all cores)\n"
            "  --ctx N              context length (default: the model's, at most 8192)\n"
            "  --max-itl-ms X       while some prompts decode, cut other prompts' prefill chunks so\n"
            "                       that a step takes about X ms (default 100; 0 = off)\n"
            "  --no-cascade         flat attention\n"
            "  --no-prefix-cache    compute every prompt in full\n"
            "  --simd LEVEL         kernels' instruction set: auto (default), generic, avx2, avx512\n"
            "  --no-amx             never the AMX tile unit\n"
            "  --mmap               cpu: keep the weights in the file's shared mapping (default: read\n"
            "                       into huge pages, faster decode)\n"
            "  --debug-checks       check the KV pool's and scheduler's invariants after every change\n"
            "  -q, --quiet          print only the generated text\n",
            DEFAULT_MODEL, MAX_STOPS);
}

typedef struct {
    int32_t index;
    char *text; /* accumulated output (several prompts) */
    size_t len, cap;
    int32_t n_gen, n_prompt, cached;
    int finished;
    cas_finish_reason why;
} gen_out;

typedef struct {
    int stream; /* one prompt: print as it comes */
    int quiet;
    const char *const *prompts;
    int32_t n_done;
    double t_first;
} gen_ctx;

static gen_ctx *g;

static const char *why_name(cas_finish_reason r) {
    switch (r) {
    case CAS_FINISH_STOP: return "stop";
    case CAS_FINISH_LENGTH: return "length";
    case CAS_FINISH_ABORT: return "abort";
    case CAS_FINISH_ERROR: return "error";
    default: return "running";
    }
}

static void on_event(void *user, const cas_engine_event *ev) {
    gen_out *o = user;
    if (ev->n_tokens && g->t_first == 0) g->t_first = cas_now_s();
    o->n_gen = ev->completion_tokens;
    o->n_prompt = ev->prompt_tokens;
    o->cached = ev->cached_tokens;
    if (g->stream) {
        fwrite(ev->text, 1, ev->text_len, stdout);
        fflush(stdout);
    } else if (ev->text_len) {
        if (o->len + ev->text_len + 1 > o->cap) {
            size_t c = o->cap ? o->cap * 2 : 256;
            while (c < o->len + ev->text_len + 1) c *= 2;
            char *t = realloc(o->text, c);
            if (!t) return;
            o->text = t;
            o->cap = c;
        }
        memcpy(o->text + o->len, ev->text, ev->text_len);
        o->len += ev->text_len;
        o->text[o->len] = 0;
    }
    if (ev->finish != CAS_FINISH_NONE) {
        o->finished = 1;
        o->why = ev->finish;
        g->n_done++;
        if (g->stream) {
            printf("\n");
        } else {
            if (!g->quiet) printf("=== [%d] %s\n", o->index + 1, g->prompts[o->index]);
            printf("%s\n", o->text ? o->text : "");
            if (!g->quiet) printf("--- (%d tokens, %s)\n\n", o->n_gen, why_name(o->why));
        }
        fflush(stdout);
    }
}

static int parse_int(const char *s, long lo, long hi, int32_t *out) {
    char *e;
    long v = strtol(s, &e, 10);
    if (!*s || *e || v < lo || v > hi) return 0;
    *out = (int32_t)v;
    return 1;
}

static int parse_float(const char *s, float *out) {
    char *e;
    float v = strtof(s, &e);
    if (!*s || *e) return 0;
    *out = v;
    return 1;
}

int cmd_generate(int argc, char **argv) {
    cas_engine_opts eo = cas_engine_opts_default();
    eo.model_path = DEFAULT_MODEL;
    const char *system_msg = NULL, *file = NULL;
    const char *stops[MAX_STOPS];
    int32_t n_stops = 0, max_tokens = 128, ctx = 0;
    int chat = 0, quiet = 0;
    cas_engine_sampling sp = cas_engine_sampling_default();
    sp.temperature = 0.7f, sp.top_k = 40, sp.top_p = 0.95f, sp.min_p = 0.05f, sp.seed = 42;
    const char **texts = NULL;
    char *file_buf = NULL;
    int32_t n_texts = 0;
    int rc = 1;
    cas_engine *e = NULL;
    gen_out *outs = NULL;
    char **rendered = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int takes = strcmp(a, "--chat") && strcmp(a, "--no-cascade") && strcmp(a, "--no-prefix-cache") &&
                    strcmp(a, "--no-share") && strcmp(a, "-q") && strcmp(a, "--quiet") && strcmp(a, "-h") &&
                    strcmp(a, "--help") && strcmp(a, "--no-amx") && strcmp(a, "--debug-checks") &&
                    strcmp(a, "--no-batch-invariance") && strcmp(a, "--enforce-eager") && strcmp(a, "--mmap");
        if (takes && i + 1 >= argc) {
            fprintf(stderr, "generate: %s needs a value\n", a);
            goto usage_fail;
        }
        const char *v = takes ? argv[++i] : NULL;
        int ok = 1;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            free(texts);
            return 0;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) eo.model_path = v;
        else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            const char **t = realloc(texts, sizeof(char *) * (size_t)(n_texts + 1));
            if (!t) goto oom;
            texts = t;
            texts[n_texts++] = v;
        } else if (!strcmp(a, "--file")) file = v;
        else if (!strcmp(a, "--chat")) chat = 1;
        else if (!strcmp(a, "--system")) system_msg = v;
        else if (!strcmp(a, "-n") || !strcmp(a, "--max-tokens")) ok = parse_int(v, 1, 1 << 20, &max_tokens);
        else if (!strcmp(a, "--temperature")) ok = parse_float(v, &sp.temperature);
        else if (!strcmp(a, "--top-k")) ok = parse_int(v, -(1L << 30), 1L << 30, &sp.top_k);
        else if (!strcmp(a, "--top-p")) ok = parse_float(v, &sp.top_p);
        else if (!strcmp(a, "--min-p")) ok = parse_float(v, &sp.min_p);
        else if (!strcmp(a, "--seed")) {
            char *end;
            sp.seed = strtoull(v, &end, 10);
            ok = *v && !*end;
        } else if (!strcmp(a, "--stop")) {
            if (n_stops == MAX_STOPS) {
                fprintf(stderr, "generate: at most %d stop strings\n", MAX_STOPS);
                goto usage_fail;
            }
            stops[n_stops++] = v;
        } else if (!strcmp(a, "--threads")) ok = parse_int(v, 1, 1024, &eo.threads);
        else if (!strcmp(a, "--device")) ok = cas_device_parse(v, &eo.device) == 0;
        else if (!strcmp(a, "--gpu-memory-fraction"))
            ok = parse_float(v, &eo.gpu_memory_fraction) && eo.gpu_memory_fraction > 0 && eo.gpu_memory_fraction <= 1;
        else if (!strcmp(a, "--ctx")) ok = parse_int(v, 16, 1 << 20, &ctx);
        else if (!strcmp(a, "--max-itl-ms"))
            ok = parse_float(v, &eo.max_itl_ms) && eo.max_itl_ms >= 0 && eo.max_itl_ms <= 1e7f;
        else if (!strcmp(a, "--no-cascade")) eo.cascade = 0;
        else if (!strcmp(a, "--enforce-eager")) eo.enforce_eager = 1;
        else if (!strcmp(a, "--tensor-parallel")) ok = parse_int(v, 1, CAS_ENGINE_MAX_TENSOR_PARALLEL, &eo.tensor_parallel);
        else if (!strcmp(a, "--no-batch-invariance")) eo.no_batch_invariance = 1;
        else if (!strcmp(a, "--no-prefix-cache") || !strcmp(a, "--no-share")) eo.prefix_cache = 0;
        else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) quiet = 1;
        else if (!strcmp(a, "--simd")) ok = cas_simd_parse(v, &eo.simd) == 0;
        else if (!strcmp(a, "--no-amx")) eo.amx_off = 1;
        else if (!strcmp(a, "--mmap")) eo.mmap_weights = 1;
        else if (!strcmp(a, "--debug-checks")) eo.debug_checks = 1;
        else {
            fprintf(stderr, "generate: unknown option '%s'\n", a);
            goto usage_fail;
        }
        if (!ok) {
            fprintf(stderr, "generate: invalid value '%s' for %s\n", v, a);
            goto usage_fail;
        }
    }
    if (file) {
        FILE *f = fopen(file, "rb");
        if (!f) {
            fprintf(stderr, "generate: cannot open %s\n", file);
            goto done;
        }
        fseek(f, 0, SEEK_END);
        long len = ftell(f);
        fseek(f, 0, SEEK_SET);
        file_buf = malloc((size_t)(len > 0 ? len : 0) + 1);
        if (!file_buf || len < 0 || fread(file_buf, 1, (size_t)len, f) != (size_t)len) {
            fclose(f);
            fprintf(stderr, "generate: cannot read %s\n", file);
            goto done;
        }
        fclose(f);
        file_buf[len] = 0;
        for (char *line = strtok(file_buf, "\n"); line; line = strtok(NULL, "\n")) {
            if (!*line || !strcmp(line, "\r")) continue;
            const char **t = realloc(texts, sizeof(char *) * (size_t)(n_texts + 1));
            if (!t) goto oom;
            texts = t;
            texts[n_texts++] = line;
        }
    }
    if (n_texts == 0) {
        fprintf(stderr, "generate: no prompt (use -p TEXT or --file PATH)\n");
        goto usage_fail;
    }
    if (sp.top_k < 0) {
        fprintf(stderr, "generate: --top-k must be >= 0\n");
        goto done;
    }

    /* the engine: room for every prompt in one step */
    eo.max_context = ctx > 0 ? ctx : 8192;
    eo.max_seqs = n_texts < 256 ? n_texts : 256;
    eo.max_batch_tokens = 512 > eo.max_seqs ? 512 : eo.max_seqs;
    int64_t need = (int64_t)n_texts * (eo.max_context < 2048 ? eo.max_context : 2048) * 24 * 1024;
    eo.device = cas_device_resolve(eo.device);
    /* the CPU's pool from the prompts; a GPU's from --gpu-memory-fraction */
    if (eo.device == CAS_DEVICE_CPU) eo.kv_cache_bytes = need > ((int64_t)256 << 20) ? need : ((int64_t)256 << 20);
    double t0 = cas_now_s();
    cas_status st = cas_engine_create(&e, &eo);
    if (st == CAS_ERR_INVALID && ctx == 0 && strstr(cas_last_error(), "context")) {
        /* a smaller model context than 8192 */
        eo.max_context = 0;
        st = cas_engine_create(&e, &eo);
    }
    if (st) {
        fprintf(stderr, "generate: %s: %s\n", eo.model_path, cas_last_error());
        goto done;
    }
    double t_load = cas_now_s() - t0;
    if (!quiet) fprintf(stderr, "generate: %s on %s\n", cas_engine_model_name(e), cas_engine_device_name(e));
    gen_ctx gc = {n_texts == 1, quiet, texts, 0, 0};
    g = &gc;
    outs = calloc((size_t)n_texts, sizeof(gen_out));
    rendered = calloc((size_t)n_texts, sizeof(char *));
    if (!outs || !rendered) goto oom;
    sp.n_stop = n_stops;
    sp.stop = stops;
    sp.max_tokens = max_tokens;
    double t_start = cas_now_s();
    for (int32_t i = 0; i < n_texts; i++) {
        const char *prompt = texts[i];
        if (chat) {
            cas_engine_msg m[2];
            int32_t nm = 0;
            if (system_msg) m[nm++] = (cas_engine_msg){"system", system_msg};
            m[nm++] = (cas_engine_msg){"user", texts[i]};
            if ((st = cas_engine_apply_chat(e, m, nm, &rendered[i]))) {
                fprintf(stderr, "generate: --chat: %s\n", cas_last_error());
                goto done;
            }
            prompt = rendered[i];
        }
        cas_engine_request rq;
        memset(&rq, 0, sizeof rq);
        rq.prompt = prompt;
        rq.sampling = sp;
        rq.sampling.seed = sp.seed + (uint64_t)i;
        rq.cb = on_event;
        rq.user = &outs[i];
        outs[i].index = i;
        uint64_t id;
        if ((st = cas_engine_submit(e, &rq, &id))) {
            fprintf(stderr, "generate: prompt %d: %s\n", i + 1, cas_last_error());
            goto done;
        }
    }
    if ((st = cas_engine_run_until_idle(e))) {
        fprintf(stderr, "generate: %s\n", cas_last_error());
        goto done;
    }
    double t_end = cas_now_s();
    cas_engine_stats es;
    cas_engine_get_stats(e, &es);
    int64_t gen = 0, prompt_tok = 0;
    for (int32_t i = 0; i < n_texts; i++) gen += outs[i].n_gen, prompt_tok += outs[i].n_prompt;
    double t_prefill = gc.t_first > 0 ? gc.t_first - t_start : t_end - t_start;
    double t_decode = t_end - (gc.t_first > 0 ? gc.t_first : t_end);
    if (!quiet)
        fprintf(stderr,
                "\n%d prompt(s): %lld prompt tokens (%lld computed, %lld from shared pages or the prefix cache), "
                "%lld generated\nprompt: %.1f tokens/s (time to first token %.2f s); generation: %.1f tokens/s; "
                "%lld of %lld steps used cascade; model loaded in %.2f s\n",
                n_texts, (long long)prompt_tok, (long long)es.prompt_tokens_computed,
                (long long)(prompt_tok - es.prompt_tokens_computed), (long long)gen,
                t_prefill > 0 ? (double)es.prompt_tokens_computed / t_prefill : 0.0, t_prefill,
                t_decode > 0 ? (double)(gen - n_texts) / t_decode : 0.0, (long long)es.cascade_steps,
                (long long)es.steps, t_load);
    rc = 0;
    goto done;
oom:
    fprintf(stderr, "generate: out of memory\n");
    goto done;
usage_fail:
    usage(stderr);
    rc = 2;
done:
    if (outs)
        for (int32_t i = 0; i < n_texts; i++) free(outs[i].text);
    free(outs);
    if (rendered)
        for (int32_t i = 0; i < n_texts; i++) free(rendered[i]);
    free(rendered);
    cas_engine_destroy(e);
    free(texts);
    free(file_buf);
    return rc;
}
