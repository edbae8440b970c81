/*
 * cmd_serve.c: `cascade serve`, the OpenAI-compatible HTTP server. Loads the
 * model into an engine, starts the engine's step thread, serves HTTP until
 * SIGINT or SIGTERM, then shuts down in order: the server (closing
 * connections and aborting their requests), the engine thread, the engine.
 *
 * Shutdown is a drain, as a load balancer expects of a deploy: on the first
 * SIGTERM or SIGINT the server answers new requests and /health with 503 and
 * lets the admitted ones finish, for at most --shutdown-timeout seconds;
 * then, or at a second signal, it aborts what still runs (streams end with
 * finish_reason "abort" and [DONE]) and exits, 0 in every case.
 *
 * Signals are blocked in every thread and taken synchronously by the main
 * thread with sigwait, so no handler runs inside libmicrohttpd or the
 * engine. The line "listening on http://HOST:PORT" goes to stderr once the
 * socket is bound (scripts started with --port 0 read the port from it).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "../engine/engine.h"
#include "../model/model.h"
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
            "  --replica-name NAME     sent in every response's X-Cascade-Replica header, naming this\n"
            "                          replica behind a load balancer (default HOST:PORT as bound; the\n"
            "                          host name for a wildcard host)\n"
            "  --max-body-mb N         largest request body (default 8)\n"
            "  --max-connections N     simultaneous connections, one thread each (default 1024, fewer\n"
            "                          where the open-file limit is lower); as they run short, the\n"
            "                          oldest one still waiting for its request headers is closed\n"
            "  --max-connections-per-ip N  from one client address (default 256; 0 = no limit;\n"
            "                          behind a proxy every client has the proxy's address)\n"
            "  --header-timeout S      request headers must arrive within S seconds of the connection\n"
            "                          opening or of the previous response (default 10; 0 = none)\n"
            "  --idle-timeout S        close a connection whose client sends or reads nothing for S\n"
            "                          seconds; waiting on the model never counts (default 30; 0 = none)\n"
            "  --shutdown-timeout S    on SIGTERM/SIGINT, let running requests finish for up to S\n"
            "                          seconds, then abort them (default 30); a second signal aborts\n"
            "                          at once\n"
            "  --chat-template FILE    a Jinja chat template used instead of the model file's own\n"
            "                          (e.g. one that renders tools and tool calls); it must compile\n"
            "engine options:\n"
            "  --device D              auto (default: the GPU where this build has CUDA and the machine\n"
            "                          a GPU, else the CPU), cpu or cuda\n"
            "  --gpu-memory-fraction X cuda: share of the GPU's memory for weights, buffers and the KV\n"
            "                          pool (default 0.9; --kv-cache-mb sizes the pool instead)\n"
            "  --enforce-eager         cuda: launch every step eagerly, no CUDA graphs\n"
            "  --tensor-parallel N     cuda: split the model over N GPUs (NCCL; its heads must divide)\n"
            "  --no-batch-invariance   cpu: the fastest attention plans; a request's text may then\n"
            "                          change with the requests batched beside it (default: the same\n"
            "                          seed gives the same tokens and logprobs, alone or in any batch)\n"
            "  --threads N             CPU threads (default all cores)\n"
            "  --kv-cache-mb N         KV cache memory (default 256)\n"
            "  --page-size N           tokens per KV page (default 16)\n"
            "  --max-batch-tokens N    tokens per step (default 512)\n"
            "  --max-itl-ms X          keep the time between a stream's tokens near X ms while prompts\n"
            "                          are prefilled: prefill chunks are cut to fit (from measured step\n"
            "                          times) and short prompts go before long ones (default 100;\n"
            "                          0 = off, prefill takes every step's whole token budget)\n"
            "  --max-seqs N            sequences per step (default 256)\n"
            "  --max-context N         tokens per sequence (default the model's context length)\n"
            "  --no-cascade            flat attention only\n"
            "  --no-prefix-cache       no automatic prefix caching\n"
            "  --simd LEVEL            kernels' instruction set: auto (default), generic, avx2, avx512\n"
            "  --no-amx                never the AMX tile unit\n"
            "  --mmap                  cpu: keep the weights in the file's shared mapping, e.g. for\n"
            "                          replicas on one machine (default: read into huge pages)\n"
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

static int parse_seconds(const char *flag, const char *v, double *out) {
    char *end = NULL;
    double x = v ? strtod(v, &end) : -1.0;
    if (!v || !*v || *end || !(x >= 0 && x <= 1e6)) {
        fprintf(stderr, "serve: %s needs a number of seconds in [0, 1e6]\n", flag);
        return -1;
    }
    *out = x;
    return 0;
}

/* One descriptor per connection: take the whole allowance (the hard limit). */
static void raise_fd_limit(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max) return;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) fprintf(stderr, "serve: cannot raise the open-file limit (%s)\n", strerror(errno));
}

/* POST /tokenize: the server reaches the engine's tokenizer through this
 * hook; a second copy built from the same file tokenizes exactly as the
 * engine does (engine.h offers a count, not the ids). */
static cas_status tokenize_hook(void *ctx, const char *text, int add_special, int32_t **ids, int32_t *n) {
    const cas_tok *t = ctx;
    size_t len = strlen(text), cap = cas_tok_max_ids(t, len), got = 0;
    *ids = NULL;
    *n = 0;
    int32_t *buf = malloc(sizeof(int32_t) * cap);
    if (!buf) return cas_error(CAS_ERR_NOMEM, "tokenize: out of memory");
    unsigned flags = CAS_TOK_PARSE_SPECIAL | (add_special ? CAS_TOK_ADD_SPECIAL : 0u);
    cas_status st = cas_tok_encode(t, text, len, flags, buf, cap, &got);
    if (st != CAS_OK) {
        free(buf);
        return st;
    }
    *ids = buf;
    *n = (int32_t)got;
    return CAS_OK;
}

/* The tokenizer of the model file (a synthetic model takes the default
 * model's, as the engine does); NULL when it cannot be built. */
static cas_tok *load_tokenizer(const char *model_path) {
    const char *path = strncmp(model_path, "synthetic:", 10) ? model_path : DEFAULT_MODEL;
    cas_gguf *g = NULL;
    cas_tok *t = NULL;
    if (cas_gguf_open(path, &g) == CAS_OK && cas_tok_create(g, &t) != CAS_OK) t = NULL;
    cas_gguf_close(g);
    if (!t) fprintf(stderr, "serve: no tokenizer for /tokenize (%s)\n", cas_last_error());
    return t;
}

/* Waits up to `seconds` for one of sigs; returns it, or 0 at the deadline. */
static int wait_signal(const sigset_t *sigs, double seconds) {
    if (seconds <= 0) return 0;
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    for (;;) {
        int sig = sigtimedwait(sigs, NULL, &ts);
        if (sig > 0) return sig;
        if (errno != EINTR) return 0;
    }
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
    const char *chat_template_file = NULL;
    double shutdown_timeout = 30.0;
    long v;
    double sec;
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
#define SEC_OPT(flag, dst)                                                                                   \
    if (!strcmp(a, flag)) {                                                                                  \
        if (parse_seconds(flag, val, &sec) < 0) return 2;                                                    \
        dst = sec;                                                                                           \
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
        STR_OPT("--replica-name", so.replica_name)
        STR_OPT("--chat-template", chat_template_file)
        INT_OPT("--port", 0, 65535, so.port)
        INT_OPT("--max-body-mb", 1, 4096, so.max_body_bytes)
        INT_OPT("--max-connections", 1, 1L << 20, so.max_connections)
        INT_OPT("--max-connections-per-ip", 0, 1L << 20, so.max_connections_per_ip)
        SEC_OPT("--header-timeout", so.header_timeout_s)
        SEC_OPT("--idle-timeout", so.idle_timeout_s)
        SEC_OPT("--shutdown-timeout", shutdown_timeout)
        INT_OPT("--threads", 0, 4096, eo.threads)
        INT_OPT("--kv-cache-mb", 1, 1L << 24, eo.kv_cache_bytes)
        INT_OPT("--page-size", 1, 256, eo.page_size)
        INT_OPT("--max-batch-tokens", 1, 1L << 24, eo.max_batch_tokens)
        INT_OPT("--max-seqs", 1, 1L << 20, eo.max_seqs)
        INT_OPT("--max-context", 1, 1L << 24, eo.max_context)
        INT_OPT("--tensor-parallel", 1, CAS_ENGINE_MAX_TENSOR_PARALLEL, eo.tensor_parallel)
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
        if (!strcmp(a, "--mmap")) {
            eo.mmap_weights = 1;
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
        if (!strcmp(a, "--no-batch-invariance")) {
            eo.no_batch_invariance = 1;
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
        if (!strcmp(a, "--max-itl-ms")) {
            char *end = NULL;
            double x = val ? strtod(val, &end) : -1.0;
            if (!val || !*val || *end || !(x >= 0 && x <= 1e7)) {
                fprintf(stderr, "serve: --max-itl-ms needs a number of milliseconds in [0, 1e7] (0 = off)\n");
                return 2;
            }
            eo.max_itl_ms = (float)x;
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
#undef SEC_OPT
        fprintf(stderr, "serve: unknown option '%s'\n", a);
        usage(stderr);
        return 2;
    }
    /* the macros stored megabytes */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--kv-cache-mb")) eo.kv_cache_bytes <<= 20;
        if (!strcmp(argv[i], "--max-body-mb")) so.max_body_bytes <<= 20;
    }
    /* 0 on the command line means none; in cas_server_opts 0 is the default */
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--max-connections-per-ip") && so.max_connections_per_ip == 0) so.max_connections_per_ip = -1;
        if (!strcmp(argv[i], "--header-timeout") && so.header_timeout_s == 0) so.header_timeout_s = -1;
        if (!strcmp(argv[i], "--idle-timeout") && so.idle_timeout_s == 0) so.idle_timeout_s = -1;
    }

    /* every thread created from here on inherits the blocked signals */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    raise_fd_limit();

    int rc = 1;
    cas_engine *e = NULL;
    cas_server *s = NULL;
    cas_tok *tok = NULL;
    char *alias = file_stem(eo.model_path);
    char *chat_template = NULL;
    if (chat_template_file) {
        if (!(chat_template = cas_tool_read_file(chat_template_file))) {
            fprintf(stderr, "serve: cannot read the chat template %s\n", chat_template_file);
            goto done;
        }
        eo.chat_template = chat_template;
    }
    fprintf(stderr, "serve: loading %s\n", eo.model_path);
    if (isatty(STDERR_FILENO)) eo.load_progress = load_bar;
    if (cas_engine_create(&e, &eo) != CAS_OK) {
        fprintf(stderr, "serve: %s\n", cas_last_error());
        if (!strcmp(eo.model_path, DEFAULT_MODEL) && access(DEFAULT_MODEL, R_OK) != 0)
            fprintf(stderr, "serve: run `make model` to fetch the default model\n");
        goto done;
    }
    if (cas_engine_start(e) != CAS_OK) {
        fprintf(stderr, "serve: %s\n", cas_last_error());
        goto done;
    }
    /* clients name the model by its file's stem; the GGUF's own name is accepted too */
    if (!so.model_name) so.model_name = alias;
    so.model_alias = cas_engine_model_name(e);
    if ((tok = load_tokenizer(eo.model_path))) {
        so.tokenize = tokenize_hook;
        so.tokenize_ctx = tok;
    }
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
    rc = 0;
    double t0 = cas_now_s();
    cas_server_drain(s);
    int64_t left = cas_server_active(s);
    fprintf(stderr, "serve: %s, draining %lld running requests (up to %gs; a second signal stops at once)\n",
            sig == SIGINT ? "SIGINT" : "SIGTERM", (long long)left, shutdown_timeout);
    fflush(stderr);
    int forced = 0;
    while ((left = cas_server_active(s)) > 0) {
        double rest = t0 + shutdown_timeout - cas_now_s();
        if (rest <= 0) {
            fprintf(stderr, "serve: shutdown timeout, aborting %lld requests\n", (long long)left);
            forced = 1;
            break;
        }
        if (wait_signal(&sigs, rest < 0.05 ? rest : 0.05)) {
            fprintf(stderr, "serve: second signal, aborting %lld requests\n", (long long)left);
            forced = 1;
            break;
        }
    }
    if (forced) {
        /* the engine ends each aborted request at its next step; streams
         * then write their last chunk; a short wait lets them, not more */
        cas_server_abort_all(s);
        double until = cas_now_s() + 2.0;
        while (cas_server_active(s) > 0 && cas_now_s() < until && !wait_signal(&sigs, 0.02)) {
        }
    }
    fprintf(stderr, "serve: stopped after %.2fs\n", cas_now_s() - t0);
    cas_server_destroy(s);
stop:
    cas_engine_stop(e);
done:
    if (e) cas_engine_destroy(e);
    if (tok) cas_tok_destroy(tok);
    free(chat_template);
    free(alias);
    return rc;
}
