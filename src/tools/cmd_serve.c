/*
 * cmd_serve.c: `cascade serve`, the OpenAI-compatible HTTP server. Loads the
 * model into an engine, starts the engine's step thread, serves HTTP until
 * SIGINT or SIGTERM, then shuts down in order: the server (closing
 * connections and aborting their requests), the engine thread, the engine.
 *
 * Signals are blocked in every thread and taken synchronously by the main
 * thread with sigwait, so no handler runs inside libmicrohttpd or the
 * engine. The line "listening on http://HOST:PORT" goes to stderr once the
 * socket is bound (scripts started with --port 0 read the port from it).
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../engine/engine.h"
#include "../server/server.h"
#include "tools.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static void usage(FILE *f) {
    fprintf(f,
            "usage: cascade serve [options]\n"
            "  -m, --model PATH        GGUF model (default " DEFAULT_MODEL ")\n"
            "  --host ADDR             address to listen on (default 127.0.0.1)\n"
            "  --port N                TCP port (default 8000; 0 = any free port)\n"
            "  --api-key KEY           require \"Authorization: Bearer KEY\" on /v1/ routes\n"
            "                          (default: $CASCADE_API_KEY when set)\n"
            "  --served-model-name ID  the model id clients use (default: the file name without .gguf)\n"
            "  --max-body-mb N         largest request body (default 8)\n"
            "engine options:\n"
            "  --device D              auto (default: the GPU where this build has CUDA and the machine\n"
            "                          a GPU, else the CPU), cpu or cuda\n"
            "  --gpu-memory-fraction X cuda: share of the GPU's memory for weights, buffers and the KV\n"
            "                          pool (default 0.9; --kv-cache-mb sizes the pool instead)\n"
            "  --enforce-eager         cuda: launch every step eagerly, no CUDA graphs\n"
            "  --threads N             CPU threads (default all cores)\n"
            "  --kv-cache-mb N         KV cache memory (default 256)\n"
            "  --page-size N           tokens per KV page (default 16)\n"
            "  --max-batch-tokens N    tokens per step (default 512)\n"
            "  --max-seqs N            sequences per step (default 256)\n"
            "  --max-context N         tokens per sequence (default the model's context length)\n"
            "  --no-cascade            flat attention only\n"
            "  --no-prefix-cache       no automatic prefix caching\n"
            "  --simd LEVEL            kernels' instruction set: auto (default), generic, avx2, avx512\n"
            "  --no-amx                never the AMX tile unit\n"
            "  --debug-checks          check the KV pool's and scheduler's invariants after every\n"
            "                          change (slow: for debugging)\n");
}

/* A one-line bar on stderr while the weights load (only on a terminal). */
static void load_bar(void *user, int64_t done, int64_t total) {
    (void)user;
    const int width = 40;
    double f = total > 0 ? (double)done / (double)total : 1.0;
    int fill = (int)(f * width + 0.5);
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    fprintf(stderr, "\rserve: loading weights [%s] %3d%% %6.1f / %.1f MiB", bar, (int)(f * 100 + 0.5),
            (double)done / 1048576.0, (double)total / 1048576.0);
    if (done >= total) fputc('\n', stderr);
    fflush(stderr);
}

static int parse_int(const char *flag, const char *v, long lo, long hi, long *out) {
    char *end = NULL;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || !*v || *end || x < lo || x > hi) {
        fprintf(stderr, "serve: %s needs an integer in [%ld, %ld]\n", flag, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

/* "models/SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct.Q4_1" */
static char *file_stem(const char *path) {
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t n = strlen(b);
    if (n > 5 && !strcmp(b + n - 5, ".gguf")) n -= 5;
    char *s = malloc(n + 1);
    if (s) {
        memcpy(s, b, n);
        s[n] = 0;
    }
    return s;
}

int cmd_serve(int argc, char **argv) {
    cas_engine_opts eo = cas_engine_opts_default();
    cas_server_opts so = cas_server_opts_default();
    eo.model_path = DEFAULT_MODEL;
    so.api_key = getenv("CASCADE_API_KEY");
    long v;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
#define INT_OPT(flag, lo, hi, dst)                                                                           \
    if (!strcmp(a, flag)) {                                                                                  \
        if (parse_int(flag, val, lo, hi, &v) < 0) return 2;                                                  \
        dst = v;                                                                                             \
        i++;                                                                                                 \
        continue;                                                                                            \
    }
#define STR_OPT(flag, dst)                                                                                   \
    if (!strcmp(a, flag)) {                                                                                  \
        if (!val) {                                                                                          \
            fprintf(stderr, "serve: %s needs a value\n", flag);                                              \
            return 2;                                                                                        \
        }                                                                                                    \
        dst = val;                                                                                           \
        i++;                                                                                                 \
        continue;                                                                                            \
    }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        STR_OPT("-m", eo.model_path)
        STR_OPT("--model", eo.model_path)
        STR_OPT("--host", so.host)
        STR_OPT("--api-key", so.api_key)
        STR_OPT("--served-model-name", so.model_name)
        INT_OPT("--port", 0, 65535, so.port)
        INT_OPT("--max-body-mb", 1, 4096, so.max_body_bytes)
        INT_OPT("--threads", 0, 4096, eo.threads)
        INT_OPT("--kv-cache-mb", 1, 1L << 24, eo.kv_cache_bytes)
        INT_OPT("--page-size", 1, 256, eo.page_size)
        INT_OPT("--max-batch-tokens", 1, 1L << 24, eo.max_batch_tokens)
        INT_OPT("--max-seqs", 1, 1L << 20, eo.max_seqs)
        INT_OPT("--max-context", 1, 1L << 24, eo.max_context)
        if (!strcmp(a, "--no-cascade")) {
            eo.cascade = 0;
            continue;
        }
        if (!strcmp(a, "--no-prefix-cache")) {
            eo.prefix_cache = 0;
            continue;
        }
        if (!strcmp(a, "--no-amx")) {
            eo.amx_off = 1;
            continue;
        }
        if (!strcmp(a, "--debug-checks")) {
            eo.debug_checks = 1;
            continue;
        }
        if (!strcmp(a, "--enforce-eager")) {
            eo.enforce_eager = 1;
            continue;
        }
        if (!strcmp(a, "--device")) {
            if (!val || cas_device_parse(val, &eo.device)) {
                fprintf(stderr, "serve: --device takes auto, cpu or cuda\n");
                return 2;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--gpu-memory-fraction")) {
            char *end = NULL;
            eo.gpu_memory_fraction = val ? strtof(val, &end) : 0.0f;
            if (!val || !end || *end || !(eo.gpu_memory_fraction > 0 && eo.gpu_memory_fraction <= 1)) {
                fprintf(stderr, "serve: --gpu-memory-fraction takes a number in (0, 1]\n");
                return 2;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--simd")) {
            if (!val || cas_simd_parse(val, &eo.simd)) {
                fprintf(stderr, "serve: --simd takes auto, generic, avx2 or avx512\n");
                return 2;
            }
            i++;
            continue;
        }
#undef INT_OPT
#undef STR_OPT
        fprintf(stderr, "serve: unknown option '%s'\n", a);
        usage(stderr);
        return 2;
    }
    /* the macros stored megabytes */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--kv-cache-mb")) eo.kv_cache_bytes <<= 20;
        if (!strcmp(argv[i], "--max-body-mb")) so.max_body_bytes <<= 20;
    }

    /* every thread created from here on inherits the blocked signals */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    int rc = 1;
    cas_engine *e = NULL;
    cas_server *s = NULL;
    char *alias = file_stem(eo.model_path);
    fprintf(stderr, "serve: loading %s\n", eo.model_path);
    if (isatty(STDERR_FILENO)) eo.load_progress = load_bar;
    if (cas_engine_create(&e, &eo) != CAS_OK) {
        fprintf(stderr, "serve: %s\n", cas_last_error());
        if (!strcmp(eo.model_path, DEFAULT_MODEL)) fprintf(stderr, "serve: run `make model` to fetch the default model\n");
        goto done;
    }
    if (cas_engine_start(e) != CAS_OK) {
        fprintf(stderr, "serve: %s\n", cas_last_error());
        goto done;
    }
    /* clients name the model by its file's stem; the GGUF's own name is accepted too */
    if (!so.model_name) so.model_name = alias;
    so.model_alias = cas_engine_model_name(e);
    if (cas_server_create(&s, e, &so) != CAS_OK) {
        fprintf(stderr, "serve: %s\n", cas_last_error());
        goto stop;
    }
    const char *host = so.host ? so.host : "127.0.0.1";
    int v6 = strchr(host, ':') != NULL;
    fprintf(stderr, "serve: model %s (context %d tokens) on %s, listening on http://%s%s%s:%d%s\n",
            so.model_name ? so.model_name : cas_engine_model_name(e), (int)cas_engine_context_length(e),
            cas_engine_device_name(e),
            v6 ? "[" : "", host, v6 ? "]" : "", (int)cas_server_port(s), so.api_key && so.api_key[0] ? " (API key required)" : "");
    fflush(stderr);
    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, "serve: %s, shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    rc = 0;
    cas_server_destroy(s);
stop:
    cas_engine_stop(e);
done:
    if (e) cas_engine_destroy(e);
    free(alias);
    return rc;
}
