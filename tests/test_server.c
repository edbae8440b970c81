/*
 * test_server.c: the HTTP server against a TEST DOUBLE of the engine. The
 * double (fake_*, below) implements the server's engine table
 * (cas_srv_engine_ops) with a thread that "generates" one word per request
 * every millisecond, honours max_tokens, stop strings, seeds, logprobs and
 * aborts, and counts KV "pages" per live request, so the tests can see that
 * a client that disconnects frees its pages. It says nothing about the real
 * engine: tests/check_server.py runs the real model behind the real server.
 *
 * Covered here: cas_srv_parse on good and bad bodies (every error's status
 * and shape), routes, 401/404/405/413, completions and chat (plain and
 * streamed, SSE framing, [DONE] last, usage chunk), n and prompt lists,
 * logprobs, the metrics text, disconnects mid-stream and while queued, 32
 * concurrent streams, shutdown with requests in flight, and the replica's
 * name in every response's headers; tool calling: the tool fields'
 * validation (every refusal names its field), the template context they
 * become, and, with the double "generating" a script of text and
 * <tool_call> blocks a few bytes per event, the tool_calls of whole and
 * streamed answers, parallel_tool_calls, tool_choice "none", and the 400s
 * for a template that cannot take tools. The client is a
 * minimal HTTP/1.0 socket client (requests only go to 127.0.0.1); response
 * bodies are parsed with jansson.
 */
#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../src/server/server_impl.h"
#include "check.h"

/* ---- the engine test double -------------------------------------------------- */

#define FAKE_MAX 512
#define FAKE_CTX 64

typedef struct {
    int used;
    uint64_t id;
    cas_engine_cb cb;
    void *user;
    int32_t prompt_len, generated, max_tokens, k;
    uint64_t seed;
    float temperature;
    char stops[4][32];
    int n_stops;
    char text[4096];
    size_t text_len;
    int abort_req;
    int delay_start; /* steps to wait before the first token (a queued request) */
    const char *script; /* text to "generate" 7 bytes per step, then stop; NULL: words */
    size_t script_pos;
} fake_req;

typedef struct {
    pthread_mutex_t mu;
    pthread_t th;
    int stop;
    uint64_t next_id;
    fake_req reqs[FAKE_MAX];
    int64_t submitted, aborted, finished;
    int queue_delay;
    int template_tools;     /* what chat_tools answers: 1 <tool_call>, 0 no tools, 2 another format,
                               -1 no interpreter */
    char last_context[4096]; /* the last JSON context rendered */
} fake_engine;

/* The scripts a prompt naming them gets (the prompt is the rendered chat). */
#define SCRIPT_CALLS                                                                                         \
    "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n" \
    "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>"
#define SCRIPT_PLAIN "Hello <b>world</b>, no <tool_call here.\n"

static fake_engine fake;

static int32_t words(const char *t) {
    int32_t n = 1; /* a BOS */
    for (const char *p = t; *p;) {
        while (*p == ' ' || *p == '\n') p++;
        if (!*p) break;
        n++;
        while (*p && *p != ' ' && *p != '\n') p++;
    }
    return n;
}

static cas_status fake_submit(void *ctx, const cas_engine_request *req, uint64_t *id) {
    (void)ctx;
    int32_t plen = req->prompt ? words(req->prompt) : req->n_tokens;
    if (plen >= FAKE_CTX) return cas_error(CAS_ERR_INVALID, "fake: prompt too long");
    if (req->sampling.max_tokens < 1) return cas_error(CAS_ERR_INVALID, "fake: max_tokens < 1");
    if (req->tokens && !req->prompt)
        for (int32_t i = 0; i < req->n_tokens; i++)
            if (req->tokens[i] >= 1000) return cas_error(CAS_ERR_INVALID, "fake: token id %d out of range", (int)req->tokens[i]);
    pthread_mutex_lock(&fake.mu);
    fake_req *f = NULL;
    for (int i = 0; i < FAKE_MAX && !f; i++)
        if (!fake.reqs[i].used) f = &fake.reqs[i];
    if (!f) {
        pthread_mutex_unlock(&fake.mu);
        return cas_error(CAS_ERR_NOMEM, "fake: full");
    }
    memset(f, 0, sizeof *f);
    f->used = 1;
    f->id = *id = ++fake.next_id;
    f->cb = req->cb;
    f->user = req->user;
    f->prompt_len = plen;
    f->max_tokens = req->sampling.max_tokens;
    f->seed = req->sampling.seed;
    f->temperature = req->sampling.temperature;
    f->k = req->sampling.logprobs;
    f->delay_start = fake.queue_delay;
    if (req->prompt && strstr(req->prompt, "SCRIPT_CALLS")) f->script = SCRIPT_CALLS;
    if (req->prompt && strstr(req->prompt, "SCRIPT_PLAIN")) f->script = SCRIPT_PLAIN;
    for (int i = 0; i < req->sampling.n_stop && i < 4; i++)
        snprintf(f->stops[f->n_stops++], sizeof f->stops[0], "%s", req->sampling.stop[i]);
    fake.submitted++;
    pthread_mutex_unlock(&fake.mu);
    return CAS_OK;
}

static cas_status fake_abort(void *ctx, uint64_t id) {
    (void)ctx;
    pthread_mutex_lock(&fake.mu);
    for (int i = 0; i < FAKE_MAX; i++)
        if (fake.reqs[i].used && fake.reqs[i].id == id) fake.reqs[i].abort_req = 1;
    pthread_mutex_unlock(&fake.mu);
    return CAS_OK;
}

static void fake_stats(void *ctx, cas_engine_stats *st) {
    (void)ctx;
    memset(st, 0, sizeof *st);
    pthread_mutex_lock(&fake.mu);
    st->kv_blocks_total = 4096;
    for (int i = 0; i < FAKE_MAX; i++)
        if (fake.reqs[i].used) {
            if (fake.reqs[i].delay_start > 0) st->waiting++;
            else st->running++;
            st->kv_blocks_used += (fake.reqs[i].prompt_len + fake.reqs[i].generated) / 16 + 1;
        }
    st->kv_blocks_free = st->kv_blocks_total - st->kv_blocks_used;
    st->requests_aborted = fake.aborted;
    st->requests_finished = fake.finished;
    pthread_mutex_unlock(&fake.mu);
}

static const char *fake_name(void *ctx) { return "fake-model"; }
static int32_t fake_ctx(void *ctx) { return FAKE_CTX; }

static cas_status fake_chat(void *ctx, const cas_engine_msg *m, int32_t n, char **out) {
    size_t len = 32;
    for (int32_t i = 0; i < n; i++) len += strlen(m[i].role) + strlen(m[i].content) + 8;
    char *s = malloc(len), *w = s;
    if (!s) return CAS_ERR_NOMEM;
    for (int32_t i = 0; i < n; i++) w += sprintf(w, "<%s> %s\n", m[i].role, m[i].content);
    strcpy(w, "<assistant>");
    *out = s;
    return CAS_OK;
}

static cas_status fake_chat_json(void *ctx, const char *context, char **out) {
    pthread_mutex_lock(&fake.mu);
    int reads = fake.template_tools;
    snprintf(fake.last_context, sizeof fake.last_context, "%s", context);
    pthread_mutex_unlock(&fake.mu);
    if (reads < 0) return cas_error(CAS_ERR_UNSUPPORTED, "fake: a built-in routine renders this template");
    *out = strdup(context);
    return *out ? CAS_OK : CAS_ERR_NOMEM;
}

static int fake_chat_tools(void *ctx) {
    pthread_mutex_lock(&fake.mu);
    int r = fake.template_tools;
    pthread_mutex_unlock(&fake.mu);
    return r;
}

static cas_status fake_count(void *ctx, const char *text, int32_t *n) {
    *n = words(text);
    return CAS_OK;
}

/* One step: every live request makes one word (" w<i>", or " s<seed>" when
 * sampling), or ends. Callbacks run outside the lock, as an engine would. */
static void *fake_loop(void *arg) {
    (void)arg;
    for (;;) {
        cas_engine_event evs[FAKE_MAX];
        char texts[FAKE_MAX][32];
        int32_t toks[FAKE_MAX];
        float lps[FAKE_MAX], tops[FAKE_MAX][4];
        int32_t top_ids[FAKE_MAX][4];
        cas_engine_cb cbs[FAKE_MAX];
        void *users[FAKE_MAX];
        int n = 0;
        pthread_mutex_lock(&fake.mu);
        if (fake.stop) {
            pthread_mutex_unlock(&fake.mu);
            return NULL;
        }
        for (int i = 0; i < FAKE_MAX; i++) {
            fake_req *f = &fake.reqs[i];
            if (!f->used) continue;
            cas_engine_event *e = &evs[n];
            memset(e, 0, sizeof *e);
            e->id = f->id;
            e->prompt_tokens = f->prompt_len;
            if (f->abort_req) {
                e->finish = CAS_FINISH_ABORT;
                fake.aborted++;
            } else if (f->delay_start > 0) {
                f->delay_start--;
                continue;
            } else {
                if (f->script) {
                    size_t left = strlen(f->script + f->script_pos), k = left < 7 ? left : 7;
                    memcpy(texts[n], f->script + f->script_pos, k);
                    texts[n][k] = 0;
                    f->script_pos += k;
                } else if (f->temperature > 0) {
                    snprintf(texts[n], sizeof texts[n], " s%d", (int)(f->seed % 1000));
                } else {
                    snprintf(texts[n], sizeof texts[n], " w%d", (int)f->generated);
                }
                size_t tl = strlen(texts[n]);
                toks[n] = 100 + f->generated;
                lps[n] = -0.25f;
                for (int j = 0; j < 4; j++) {
                    top_ids[n][j] = 100 + f->generated + j;
                    tops[n][j] = -0.25f * (float)(j + 1);
                }
                memcpy(f->text + f->text_len, texts[n], tl + 1);
                f->text_len += tl;
                f->generated++;
                e->text = texts[n];
                e->text_len = tl;
                e->tokens = &toks[n];
                e->n_tokens = 1;
                if (f->k) {
                    e->logprobs = &lps[n];
                    e->top_ids = top_ids[n];
                    e->top_logprobs = tops[n];
                    if (f->k > 4) f->k = 4;
                }
                for (int s = 0; s < f->n_stops; s++) {
                    char *hit = strstr(f->text, f->stops[s]);
                    if (hit) {
                        /* drop the stop string and what follows from this event's text */
                        size_t keep = (size_t)(hit - f->text);
                        size_t before = f->text_len - tl;
                        e->text_len = keep > before ? keep - before : 0;
                        e->finish = CAS_FINISH_STOP;
                    }
                }
                if (!e->finish && f->script && !f->script[f->script_pos]) e->finish = CAS_FINISH_STOP;
                if (!e->finish && f->generated >= f->max_tokens) e->finish = CAS_FINISH_LENGTH;
                if (!e->finish && f->prompt_len + f->generated >= FAKE_CTX) e->finish = CAS_FINISH_LENGTH;
                if (e->finish) fake.finished++;
            }
            e->completion_tokens = f->generated;
            cbs[n] = f->cb;
            users[n] = f->user;
            if (e->finish) f->used = 0;
            n++;
        }
        pthread_mutex_unlock(&fake.mu);
        for (int i = 0; i < n; i++) cbs[i](users[i], &evs[i]);
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
    }
}

static cas_srv_engine_ops fake_ops(void) {
    cas_srv_engine_ops o = {.ctx = &fake,
                            .submit = fake_submit,
                            .abort = fake_abort,
                            .get_stats = fake_stats,
                            .model_name = fake_name,
                            .context_length = fake_ctx,
                            .apply_chat = fake_chat,
                            .apply_chat_json = fake_chat_json,
                            .chat_tools = fake_chat_tools,
                            .count_tokens = fake_count,
                            .token_text = NULL};
    return o;
}

static int64_t fake_live(void) {
    pthread_mutex_lock(&fake.mu);
    int64_t n = 0;
    for (int i = 0; i < FAKE_MAX; i++) n += fake.reqs[i].used;
    pthread_mutex_unlock(&fake.mu);
    return n;
}

/* waits up to 3 s for the double to have no live request */
static int fake_drained(void) {
    for (int i = 0; i < 300; i++) {
        if (fake_live() == 0) return 1;
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* ---- a minimal HTTP/1.0 client ---------------------------------------------- */

static int port;

typedef struct {
    int status;
    char *head; /* status line and headers */
    char *body;
    size_t body_len;
} resp;

static void resp_free(resp *r) {
    free(r->head);
    free(r->body);
    memset(r, 0, sizeof *r);
}

static int connect_local(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void send_req(int fd, const char *method, const char *path, const char *extra_headers, const char *body,
                     size_t body_len) {
    char head[1024];
    int n = snprintf(head, sizeof head, "%s %s HTTP/1.0\r\nHost: 127.0.0.1\r\n%sContent-Length: %zu\r\n\r\n", method,
                     path, extra_headers ? extra_headers : "", body_len);
    if (write(fd, head, (size_t)n) < 0) return;
    size_t off = 0;
    while (off < body_len) {
        ssize_t w = write(fd, body + off, body_len - off);
        if (w <= 0) return;
        off += (size_t)w;
    }
}

static resp http(const char *method, const char *path, const char *extra_headers, const char *body) {
    resp r = {0};
    int fd = connect_local();
    if (fd < 0) return r;
    send_req(fd, method, path, extra_headers, body ? body : "", body ? strlen(body) : 0);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t k = read(fd, buf + len, cap - len - 1);
        if (k <= 0) break;
        len += (size_t)k;
    }
    close(fd);
    buf[len] = 0;
    char *sep = strstr(buf, "\r\n\r\n");
    if (sep && sscanf(buf, "HTTP/1.%*d %d", &r.status) == 1) {
        r.head = strndup(buf, (size_t)(sep - buf));
        r.body_len = len - (size_t)(sep + 4 - buf);
        r.body = malloc(r.body_len + 1);
        memcpy(r.body, sep + 4, r.body_len + 1);
    }
    free(buf);
    return r;
}

static resp post(const char *path, const char *body) { return http("POST", path, NULL, body); }

static json_t *body_json(const resp *r) { return r->body ? json_loads(r->body, 0, NULL) : NULL; }

/* Checks OpenAI's error shape and returns 1 when the status matches. */
static int is_error(const resp *r, int status) {
    if (r->status != status) {
        printf("  status %d, expected %d: %s\n", r->status, status, r->body ? r->body : "(none)");
        return 0;
    }
    json_t *j = body_json(r);
    json_t *e = json_object_get(j, "error");
    int ok = json_is_object(e) && json_is_string(json_object_get(e, "message")) &&
             json_is_string(json_object_get(e, "type")) && json_object_get(e, "param") &&
             json_object_get(e, "code");
    if (!ok) printf("  not an OpenAI error: %s\n", r->body ? r->body : "(none)");
    json_decref(j);
    return ok;
}

/* Splits an SSE body into its data payloads; checks the framing. Returns the
 * number of events; *done is set when the last one is [DONE]. */
static int sse_events(const char *body, json_t **events, int max, int *done, int *framing_ok) {
    int n = 0;
    *done = 0;
    *framing_ok = 1;
    const char *p = body;
    while (*p) {
        const char *end = strstr(p, "\n\n");
        if (!end || strncmp(p, "data: ", 6)) {
            *framing_ok = 0;
            break;
        }
        if (*done) *framing_ok = 0; /* something after [DONE] */
        if (!strncmp(p + 6, "[DONE]", 6) && end == p + 12) {
            *done = 1;
        } else if (n < max) {
            events[n++] = json_loadb(p + 6, (size_t)(end - p - 6), 0, NULL);
        }
        p = end + 2;
    }
    return n;
}

/* ---- parse tests --------------------------------------------------------------- */

static cas_srv_limits lim_default = {NULL, 1 << 20, 16};

static int parse_status(const char *method, const char *path, const char *auth, const char *body,
                        const cas_srv_limits *lim) {
    cas_srv_parsed p;
    cas_srv_error err;
    cas_srv_route r = cas_srv_parse(lim ? lim : &lim_default, method, path, auth, body, body ? strlen(body) : 0, &p, &err);
    cas_srv_parsed_free(&p);
    return r == CAS_SRV_ROUTE_NONE ? err.status : 200;
}

/* The connection gate's head check: complete and well-formed heads pass,
 * incomplete ones wait, and every malformed kind gets its status and an
 * OpenAI error; only the n bytes given are read (an exact-size copy, so
 * ASan sees a read past them). */
static int head(const char *h, size_t max, cas_srv_error *e) {
    size_t n = strlen(h);
    char *b = malloc(n ? n : 1);
    memcpy(b, h, n);
    int r = cas_srv_head_check(b, n, max, e);
    free(b);
    return r;
}

static void test_head_check(void) {
    cas_srv_error e;
    const size_t M = 32768;
    CHECK(head("GET /health HTTP/1.1\r\nHost: x\r\n\r\n", M, &e) == 1);
    CHECK(head("POST /v1/completions HTTP/1.0\r\nContent-Length: 12\r\ncontent-length: 12\r\n\r\n{", M, &e) == 1);
    CHECK(head("GET / HTTP/1.1\n\n", M, &e) == 1); /* bare LF */
    CHECK(head("POST / HTTP/1.1\r\nTransfer-Encoding: Chunked\r\nX-A:\t v \r\n\r\n", M, &e) == 1);
    CHECK(head("GET /health HTTP/1.1\r\nHost: x\r\n", M, &e) == 0); /* not complete yet */
    CHECK(head("GE", M, &e) == 0);
    CHECK(head("", M, &e) == 0);
    static const struct {
        const char *h;
        int status;
    } bad[] = {
        {"HELLO\r\n\r\n", 400},
        {"GET  / HTTP/1.1\r\n\r\n", 400},
        {"GET / HTTP/1.1 x\r\n\r\n", 400},
        {"GET / HTTPS/1.1\r\n\r\n", 400},
        {"G@T / HTTP/1.1\r\n\r\n", 400},
        {"GET / HTTP/2.0\r\n\r\n", 505},
        {"GET / HTTP/0.9\r\n\r\n", 505},
        {"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\n: v\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\nA b: v\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400},
        {"GET / HTTP/1.1\r\nX: a\x01b\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nContent-Length: 1 2\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nContent-Length:\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400},
        {"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501},
        {"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&e, 0, sizeof e);
        int r = head(bad[i].h, M, &e);
        CHECKF(r == -1 && e.status == bad[i].status, "case %zu: %d, status %d (want %d)", i, r, e.status, bad[i].status);
        char *js = cas_srv_error_json(&e);
        CHECKF(js && strstr(js, "\"error\"") && strstr(js, "\"message\""), "case %zu: %s", i, js ? js : "NULL");
        free(js);
    }
    /* 431: a complete head over the limit, and an incomplete one that reached it */
    char big[301];
    memset(big, 'a', sizeof big);
    memcpy(big, "GET / HTTP/1.1\r\nX: ", 19);
    memcpy(big + 296, "\r\n\r\n", 4);
    big[300] = 0;
    CHECK(head(big, 1000, &e) == 1);
    CHECK(head(big, 100, &e) == -1 && e.status == 431);
    big[200] = 0;
    CHECK(head(big, 100, &e) == -1 && e.status == 431);
    CHECK(head(big, 1000, &e) == 0);
}

static void test_parse_routes(void) {
    CHECK(parse_status("GET", "/health", NULL, NULL, NULL) == 200);
    CHECK(parse_status("GET", "/metrics", NULL, NULL, NULL) == 200);
    CHECK(parse_status("GET", "/v1/models", NULL, NULL, NULL) == 200);
    CHECK(parse_status("GET", "/v1/models?x=1", NULL, NULL, NULL) == 200);
    CHECK(parse_status("GET", "/nope", NULL, NULL, NULL) == 404);
    CHECK(parse_status("GET", "/v1/completions", NULL, NULL, NULL) == 405);
    CHECK(parse_status("POST", "/health", NULL, NULL, NULL) == 405);
    CHECK(parse_status("DELETE", "/v1/chat/completions", NULL, NULL, NULL) == 405);
    cas_srv_limits keyed = {"sekrit", 1 << 20, 16};
    CHECK(parse_status("GET", "/v1/models", NULL, NULL, &keyed) == 401);
    CHECK(parse_status("GET", "/v1/models", "Bearer wrong", NULL, &keyed) == 401);
    CHECK(parse_status("GET", "/v1/models", "Bearer sekri", NULL, &keyed) == 401);
    CHECK(parse_status("GET", "/v1/models", "Bearer sekrit", NULL, &keyed) == 200);
    CHECK(parse_status("GET", "/v1/models", "bearer  sekrit ", NULL, &keyed) == 200);
    CHECK(parse_status("GET", "/health", NULL, NULL, &keyed) == 200);
    cas_srv_limits small = {NULL, 10, 16};
    CHECK(parse_status("POST", "/v1/completions", NULL, "{\"prompt\": \"hello world\"}", &small) == 413);
}

static void test_parse_completions(void) {
    cas_srv_parsed p;
    cas_srv_error err;
    const char *b = "{\"model\":\"m\",\"prompt\":[\"a b\",\"c\"],\"max_tokens\":5,\"temperature\":0.5,\"top_p\":0.9,"
                    "\"top_k\":-1,\"min_p\":0.1,\"seed\":-3,\"stop\":[\"x\",\"\"],\"n\":2,\"stream\":true,"
                    "\"stream_options\":{\"include_usage\":true},\"logprobs\":3,\"user\":\"u\"}";
    REQUIRE(cas_srv_parse(&lim_default, "POST", "/v1/completions", NULL, b, strlen(b), &p, &err) ==
            CAS_SRV_ROUTE_COMPLETIONS);
    CHECK(p.n_prompts == 2 && !strcmp(p.prompts[1].text, "c"));
    CHECK(p.sampling.max_tokens == 5 && p.sampling.top_k == 0 && p.n == 2 && p.stream && p.include_usage);
    CHECK(fabsf(p.sampling.temperature - 0.5f) < 1e-6f && fabsf(p.sampling.min_p - 0.1f) < 1e-6f);
    CHECK(p.seed_set && p.sampling.seed == (uint64_t)-3);
    CHECK(p.n_stops == 1 && p.sampling.n_stop == 1 && !strcmp(p.sampling.stop[0], "x"));
    CHECK(p.logprobs && p.top_logprobs == 3);
    cas_srv_parsed_free(&p);

    const char *t = "{\"prompt\":[[1,2,3],[4]]}";
    REQUIRE(cas_srv_parse(&lim_default, "POST", "/v1/completions", NULL, t, strlen(t), &p, &err) ==
            CAS_SRV_ROUTE_COMPLETIONS);
    CHECK(p.n_prompts == 2 && p.prompts[0].n_tokens == 3 && p.prompts[1].tokens[0] == 4 && !p.prompts[0].text);
    CHECK(p.sampling.max_tokens == 16 && p.n == 1 && !p.seed_set);
    cas_srv_parsed_free(&p);

    const char *f = "{\"prompt\":\"a\",\"presence_penalty\":0.5,\"frequency_penalty\":-1,\"repetition_penalty\":1.2,"
                    "\"logit_bias\":{\"7\":-100,\"12\":2.5},\"stop_token_ids\":[3,4],\"min_tokens\":2,"
                    "\"include_stop_str_in_output\":true,\"echo\":true,\"use_beam_search\":false,\"bad_words\":[]}";
    REQUIRE(cas_srv_parse(&lim_default, "POST", "/v1/completions", NULL, f, strlen(f), &p, &err) ==
            CAS_SRV_ROUTE_COMPLETIONS);
    CHECK(p.sampling.presence_penalty == 0.5f && p.sampling.frequency_penalty == -1.0f &&
          p.sampling.repetition_penalty == 1.2f);
    CHECK(p.sampling.n_logit_bias == 2 && p.sampling.n_stop_token_ids == 2 && p.sampling.stop_token_ids[1] == 4);
    for (int32_t i = 0; i < p.sampling.n_logit_bias; i++)
        CHECK(p.sampling.logit_bias_ids[i] == 7 ? p.sampling.logit_bias[i] == -100.0f
                                                : p.sampling.logit_bias_ids[i] == 12 && p.sampling.logit_bias[i] == 2.5f);
    CHECK(p.sampling.min_tokens == 2 && p.sampling.include_stop_str && p.sampling.echo);
    cas_srv_parsed_free(&p);

    static const struct {
        const char *body, *param;
    } bads[] = {
        {"{", ""},
        {"[1,2]", ""},
        {"", ""},
        {"{\"model\":\"m\"}", "prompt"},
        {"{\"prompt\":5}", "prompt"},
        {"{\"prompt\":[]}", "prompt"},
        {"{\"prompt\":[\"a\",1]}", "prompt"},
        {"{\"prompt\":[[1],[]]}", "prompt"},
        {"{\"prompt\":[1,-2]}", "prompt"},
        {"{\"prompt\":[1,2.5]}", "prompt"},
        {"{\"prompt\":\"a\",\"model\":3}", "model"},
        {"{\"prompt\":\"a\",\"max_tokens\":0}", "max_tokens"},
        {"{\"prompt\":\"a\",\"max_tokens\":\"5\"}", "max_tokens"},
        {"{\"prompt\":\"a\",\"max_tokens\":1e99}", "max_tokens"},
        {"{\"prompt\":\"a\",\"temperature\":-1}", "temperature"},
        {"{\"prompt\":\"a\",\"temperature\":2.5}", "temperature"},
        {"{\"prompt\":\"a\",\"temperature\":\"hot\"}", "temperature"},
        {"{\"prompt\":\"a\",\"top_p\":0}", "top_p"},
        {"{\"prompt\":\"a\",\"top_p\":1.5}", "top_p"},
        {"{\"prompt\":\"a\",\"top_k\":-5}", "top_k"},
        {"{\"prompt\":\"a\",\"min_p\":2}", "min_p"},
        {"{\"prompt\":\"a\",\"seed\":1.5}", "seed"},
        {"{\"prompt\":\"a\",\"stop\":5}", "stop"},
        {"{\"prompt\":\"a\",\"stop\":[\"a\",5]}", "stop"},
        {"{\"prompt\":\"a\",\"n\":0}", "n"},
        {"{\"prompt\":\"a\",\"n\":17}", "n"},
        {"{\"prompt\":\"a\",\"stream\":\"yes\"}", "stream"},
        {"{\"prompt\":\"a\",\"stream_options\":1}", "stream_options"},
        {"{\"prompt\":\"a\",\"logprobs\":21}", "logprobs"},
        {"{\"prompt\":\"a\",\"logprobs\":true}", "logprobs"},
        {"{\"prompt\":\"a\",\"echo\":true,\"logprobs\":1}", "echo"},
        {"{\"prompt\":\"a\",\"presence_penalty\":2.5}", "presence_penalty"},
        {"{\"prompt\":\"a\",\"frequency_penalty\":3}", "frequency_penalty"},
        {"{\"prompt\":\"a\",\"repetition_penalty\":0}", "repetition_penalty"},
        {"{\"prompt\":\"a\",\"logit_bias\":{\"1\":500}}", "logit_bias"},
        {"{\"prompt\":\"a\",\"logit_bias\":{\"x\":5}}", "logit_bias"},
        {"{\"prompt\":\"a\",\"logit_bias\":[1]}", "logit_bias"},
        {"{\"prompt\":\"a\",\"stop_token_ids\":[1,-2]}", "stop_token_ids"},
        {"{\"prompt\":\"a\",\"min_tokens\":17}", "min_tokens"},
        {"{\"prompt\":\"a\",\"include_stop_str_in_output\":1}", "include_stop_str_in_output"},
        {"{\"prompt\":\"a\",\"top_p\":1e-300}", "top_p"},
        {"{\"prompt\":\"a\",\"guided_json\":{}}", "guided_json"},
        {"{\"prompt\":\"a\",\"prompt_logprobs\":1}", "prompt_logprobs"},
        {"{\"prompt\":\"a\",\"use_beam_search\":true}", "use_beam_search"},
        {"{\"prompt\":\"a\",\"best_of\":3}", "best_of"},
    };
    for (size_t i = 0; i < sizeof bads / sizeof bads[0]; i++) {
        cas_srv_route r = cas_srv_parse(&lim_default, "POST", "/v1/completions", NULL, bads[i].body,
                                        strlen(bads[i].body), &p, &err);
        CHECKF(r == CAS_SRV_ROUTE_NONE && err.status == 400 && !strcmp(err.param, bads[i].param),
               "%s -> status %d param '%s' (%s)", bads[i].body, err.status, err.param, err.message);
        CHECK(p.prompts == NULL && p.model == NULL);
        cas_srv_parsed_free(&p);
    }
}

static void test_parse_chat(void) {
    cas_srv_parsed p;
    cas_srv_error err;
    const char *b = "{\"messages\":[{\"role\":\"developer\",\"content\":\"sys\"},{\"role\":\"user\",\"content\":"
                    "[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]},{\"role\":\"assistant\","
                    "\"content\":null}],\"max_tokens\":7,\"max_completion_tokens\":9,\"logprobs\":true,"
                    "\"top_logprobs\":2,\"response_format\":{\"type\":\"text\"}}";
    REQUIRE(cas_srv_parse(&lim_default, "POST", "/v1/chat/completions", NULL, b, strlen(b), &p, &err) ==
            CAS_SRV_ROUTE_CHAT);
    CHECK(p.n_msgs == 3 && !strcmp(p.msgs[0].role, "system") && !strcmp(p.msgs[1].content, "ab"));
    CHECK(!strcmp(p.msgs[2].content, "") && p.sampling.max_tokens == 9 && p.max_tokens_set);
    CHECK(p.logprobs && p.top_logprobs == 2);
    cas_srv_parsed_free(&p);
    const char *d = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}";
    REQUIRE(cas_srv_parse(&lim_default, "POST", "/v1/chat/completions", NULL, d, strlen(d), &p, &err) ==
            CAS_SRV_ROUTE_CHAT);
    CHECK(!p.max_tokens_set);
    cas_srv_parsed_free(&p);
    static const char *bads[] = {
        "{}",
        "{\"messages\":[]}",
        "{\"messages\":{}}",
        "{\"messages\":[1]}",
        "{\"messages\":[{\"content\":\"x\"}]}",
        "{\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}",
        "{\"messages\":[{\"role\":\"user\"}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":5}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":-1}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\"}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":\"json_object\"}}",
        "{\"messages\":[{\"role\":\"user\",\"content\":[]}]}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"echo\":true}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"guided_regex\":\"a+\"}",
    };
    for (size_t i = 0; i < sizeof bads / sizeof bads[0]; i++) {
        cas_srv_route r =
            cas_srv_parse(&lim_default, "POST", "/v1/chat/completions", NULL, bads[i], strlen(bads[i]), &p, &err);
        CHECKF(r == CAS_SRV_ROUTE_NONE && err.status == 400, "%s -> %d (%s)", bads[i], err.status, err.message);
        char *js = cas_srv_error_json(&err);
        json_t *j = js ? json_loads(js, 0, NULL) : NULL;
        CHECK(json_is_string(json_object_get(json_object_get(j, "error"), "message")));
        json_decref(j);
        free(js);
        cas_srv_parsed_free(&p);
    }
}


/* Tool calling's fields: what becomes the template's context, and every
 * refusal with the field it names. */
#define TOOL_F "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather.\"," \
               "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}}}}}"
#define MSGS_TOOLS                                                                                             \
    "\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"},{\"role\":\"assistant\","              \
    "\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":"        \
    "\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}}]},{\"role\":\"tool\",\"tool_call_id\":" \
    "\"call_1\",\"content\":\"22 C\"}]"

static void test_parse_tools(void) {
    cas_srv_parsed p;
    cas_srv_error err;
    const char *chat = "/v1/chat/completions";
    /* tools, tool calls and results: all in the context, the arguments decoded */
    const char *b = "{" MSGS_TOOLS ",\"tools\":[" TOOL_F "],\"chat_template_kwargs\":{\"enable_thinking\":false}}";
    REQUIRE(cas_srv_parse(&lim_default, "POST", chat, NULL, b, strlen(b), &p, &err) == CAS_SRV_ROUTE_CHAT);
    CHECK(p.chat_json && p.tools_rendered && p.parse_tool_calls && p.parallel_tool_calls);
    CHECK(p.chat_json_param && !strcmp(p.chat_json_param, "tools"));
    json_t *ctx = p.chat_json ? json_loads(p.chat_json, 0, NULL) : NULL;
    json_t *ms = json_object_get(ctx, "messages");
    CHECK(json_array_size(ms) == 3 && json_is_true(json_object_get(ctx, "add_generation_prompt")));
    CHECK(json_is_false(json_object_get(ctx, "enable_thinking")));
    CHECK(!strcmp(json_string_value(json_object_get(json_object_get(json_array_get(json_object_get(ctx, "tools"), 0),
                                                                    "function"), "name")), "get_weather"));
    json_t *call = json_array_get(json_object_get(json_array_get(ms, 1), "tool_calls"), 0);
    json_t *args = json_object_get(json_object_get(call, "function"), "arguments");
    CHECK(json_is_object(args) && !strcmp(json_string_value(json_object_get(args, "city")), "Paris"));
    CHECK(!strcmp(json_string_value(json_object_get(call, "id")), "call_1"));
    CHECK(!strcmp(json_string_value(json_object_get(json_array_get(ms, 1), "content")), "")); /* null: "" */
    CHECK(!strcmp(json_string_value(json_object_get(json_array_get(ms, 2), "role")), "tool"));
    CHECK(!strcmp(json_string_value(json_object_get(json_array_get(ms, 2), "tool_call_id")), "call_1"));
    CHECK(p.n_msgs == 3 && !strcmp(p.msgs[2].role, "tool") && !strcmp(p.msgs[2].content, "22 C"));
    json_decref(ctx);
    cas_srv_parsed_free(&p);

    /* tool_choice "none": the tools stay out of the prompt and the output is not read for calls */
    b = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[" TOOL_F "],\"tool_choice\":\"none\","
        "\"parallel_tool_calls\":false}";
    REQUIRE(cas_srv_parse(&lim_default, "POST", chat, NULL, b, strlen(b), &p, &err) == CAS_SRV_ROUTE_CHAT);
    CHECK(!p.chat_json && !p.tools_rendered && !p.parse_tool_calls && !p.parallel_tool_calls);
    cas_srv_parsed_free(&p);
    /* empty tools and kwargs are none; a plain chat has no context */
    b = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[],\"chat_template_kwargs\":{},"
        "\"tool_choice\":\"auto\"}";
    REQUIRE(cas_srv_parse(&lim_default, "POST", chat, NULL, b, strlen(b), &p, &err) == CAS_SRV_ROUTE_CHAT);
    CHECK(!p.chat_json && !p.parse_tool_calls);
    cas_srv_parsed_free(&p);
    /* kwargs alone, and tool results alone, need the context too */
    b = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":{\"enable_thinking\":true}}";
    REQUIRE(cas_srv_parse(&lim_default, "POST", chat, NULL, b, strlen(b), &p, &err) == CAS_SRV_ROUTE_CHAT);
    CHECK(p.chat_json && strstr(p.chat_json, "\"enable_thinking\":true") && strstr(p.chat_json, "\"tools\":null"));
    CHECK(p.chat_json_param && !strcmp(p.chat_json_param, "chat_template_kwargs") && !p.parse_tool_calls);
    cas_srv_parsed_free(&p);
    b = "{" MSGS_TOOLS "}";
    REQUIRE(cas_srv_parse(&lim_default, "POST", chat, NULL, b, strlen(b), &p, &err) == CAS_SRV_ROUTE_CHAT);
    CHECK(p.chat_json && p.chat_json_param && !strcmp(p.chat_json_param, "messages") && !p.parse_tool_calls);
    cas_srv_parsed_free(&p);

    static const struct {
        const char *body, *param;
    } bads[] = {
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":{}}", "tools"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[5]}", "tools[0]"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"code\",\"function\":{\"name\":\"f\"}}]}",
         "tools[0]"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\"}]}", "tools[0]"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[" TOOL_F ",{\"type\":\"function\","
         "\"function\":{\"name\":\"\"}}]}", "tools[1]"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":"
         "{\"name\":\"f\",\"parameters\":[]}}]}", "tools[0]"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":"
         "{\"name\":\"f\",\"description\":1}}]}", "tools[0]"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":"
         "{\"name\":\"f\",\"strict\":\"yes\"}}]}", "tools[0]"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[" TOOL_F "],\"tool_choice\":\"required\"}",
         "tool_choice"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[" TOOL_F "],\"tool_choice\":{\"type\":"
         "\"function\",\"function\":{\"name\":\"get_weather\"}}}", "tool_choice"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"sometimes\"}", "tool_choice"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":5}", "tool_choice"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"parallel_tool_calls\":\"yes\"}", "parallel_tool_calls"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":[1]}", "chat_template_kwargs"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":{\"messages\":[]}}",
         "chat_template_kwargs"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":{\"add_generation_prompt\":false}}",
         "chat_template_kwargs"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"tool\",\"content\":\"1\"}]}",
         "messages[1].tool_call_id"},
        {"{\"messages\":[{\"role\":\"tool\",\"tool_call_id\":\"c\",\"content\":null}]}", "messages[0].content"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"tool_calls\":[]}]}", "messages[0].tool_calls"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":{}}]}", "messages[0].tool_calls"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"type\":\"function\",\"function\":"
         "{\"name\":\"f\",\"arguments\":\"{not json\"}}]}]}", "messages[0].tool_calls[0]"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"type\":\"function\",\"function\":"
         "{\"name\":\"f\",\"arguments\":\"[1]\"}}]}]}", "messages[0].tool_calls[0]"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"type\":\"function\",\"function\":"
         "{\"arguments\":\"{}\"}}]}]}", "messages[0].tool_calls[0]"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"type\":\"code\",\"function\":"
         "{\"name\":\"f\"}}]}]}", "messages[0].tool_calls[0]"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":5,\"function\":"
         "{\"name\":\"f\"}}]}]}", "messages[0].tool_calls[0]"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[\"f\"]}]}", "messages[0].tool_calls[0]"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"name\":5}]}", "messages[0].name"},
        {"{\"messages\":[{\"role\":\"function\",\"content\":\"x\"}]}", "messages"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"functions\":[{\"name\":\"f\"}]}", "functions"},
    };
    for (size_t i = 0; i < sizeof bads / sizeof bads[0]; i++) {
        cas_srv_route r = cas_srv_parse(&lim_default, "POST", chat, NULL, bads[i].body, strlen(bads[i].body), &p, &err);
        CHECKF(r == CAS_SRV_ROUTE_NONE && err.status == 400 && !strcmp(err.param, bads[i].param),
               "%s -> %d param '%s' (want '%s'): %s", bads[i].body, err.status, err.param, bads[i].param, err.message);
        cas_srv_parsed_free(&p);
    }
    /* the chat-only fields on completions */
    b = "{\"prompt\":\"x\",\"tools\":[" TOOL_F "]}";
    CHECK(cas_srv_parse(&lim_default, "POST", "/v1/completions", NULL, b, strlen(b), &p, &err) == CAS_SRV_ROUTE_NONE &&
          !strcmp(err.param, "tools"));
    cas_srv_parsed_free(&p);
    b = "{\"prompt\":\"x\",\"chat_template_kwargs\":{\"a\":1}}";
    CHECK(cas_srv_parse(&lim_default, "POST", "/v1/completions", NULL, b, strlen(b), &p, &err) == CAS_SRV_ROUTE_NONE &&
          !strcmp(err.param, "chat_template_kwargs"));
    cas_srv_parsed_free(&p);
}

/* ---- HTTP tests -------------------------------------------------------------------- */

static cas_server *srv;

static void test_http_simple_routes(void) {
    resp r = http("GET", "/health", NULL, NULL);
    CHECK(r.status == 200);
    resp_free(&r);
    r = http("GET", "/v1/models", NULL, NULL);
    CHECK(r.status == 200);
    json_t *j = body_json(&r);
    json_t *m = json_array_get(json_object_get(j, "data"), 0);
    CHECK(!strcmp(json_string_value(json_object_get(m, "id")), "fake-model"));
    CHECK(!strcmp(json_string_value(json_object_get(j, "object")), "list"));
    json_decref(j);
    resp_free(&r);
    r = http("GET", "/nowhere", NULL, NULL);
    CHECK(is_error(&r, 404));
    resp_free(&r);
    r = http("PUT", "/v1/completions", NULL, "{}");
    CHECK(is_error(&r, 405));
    CHECK(r.head && strstr(r.head, "Allow: POST"));
    resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"a\", \"model\": \"gpt-4\"}");
    CHECK(is_error(&r, 404));
    CHECK(r.body && strstr(r.body, "model_not_found"));
    resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": ");
    CHECK(is_error(&r, 400));
    resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"a\", \"temperature\": 9}");
    CHECK(is_error(&r, 400));
    resp_free(&r);
    /* 64 words: over the double's 64-token context */
    char big[1024] = "{\"prompt\": \"";
    for (int i = 0; i < 70; i++) strcat(big, "w ");
    strcat(big, "\"}");
    r = post("/v1/completions", big);
    CHECK(is_error(&r, 400));
    CHECK(r.body && strstr(r.body, "context_length_exceeded"));
    resp_free(&r);
    /* a token id the engine rejects: its message comes back as a 400 */
    r = post("/v1/completions", "{\"prompt\": [1, 5000]}");
    CHECK(is_error(&r, 400));
    resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"\"}");
    CHECK(is_error(&r, 400));
    resp_free(&r);
}

static void test_http_body_limit(void) {
    size_t n = 70000; /* server limit is 64 KiB in this test */
    char *body = malloc(n + 1);
    memset(body, ' ', n);
    body[n] = 0;
    memcpy(body, "{\"prompt\": \"a\"}", 15);
    resp r = post("/v1/completions", body);
    CHECK(is_error(&r, 413));
    resp_free(&r);
    free(body);
    r = http("GET", "/health", NULL, NULL);
    CHECK(r.status == 200);
    resp_free(&r);
}

static void test_http_completion(void) {
    resp r = post("/v1/completions", "{\"model\": \"fake-model\", \"prompt\": \"hello there\", \"max_tokens\": 4, "
                                     "\"temperature\": 0}");
    CHECK(r.status == 200);
    json_t *j = body_json(&r);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    CHECK(!strcmp(json_string_value(json_object_get(c, "text")), " w0 w1 w2 w3"));
    CHECK(!strcmp(json_string_value(json_object_get(c, "finish_reason")), "length"));
    CHECK(!strcmp(json_string_value(json_object_get(j, "object")), "text_completion"));
    CHECK(!strncmp(json_string_value(json_object_get(j, "id")), "cmpl-", 5));
    json_t *u = json_object_get(j, "usage");
    CHECK(json_integer_value(json_object_get(u, "prompt_tokens")) == 3);
    CHECK(json_integer_value(json_object_get(u, "completion_tokens")) == 4);
    CHECK(json_integer_value(json_object_get(u, "total_tokens")) == 7);
    json_decref(j);
    resp_free(&r);

    /* stop strings: the text ends before the stop string */
    r = post("/v1/completions", "{\"prompt\": \"hello\", \"max_tokens\": 10, \"temperature\": 0, \"stop\": \" w3\"}");
    j = body_json(&r);
    c = json_array_get(json_object_get(j, "choices"), 0);
    CHECK(!strcmp(json_string_value(json_object_get(c, "text")), " w0 w1 w2"));
    CHECK(!strcmp(json_string_value(json_object_get(c, "finish_reason")), "stop"));
    json_decref(j);
    resp_free(&r);

    /* two prompts times n=2: four choices, indexed prompt-major; seeds differ per choice */
    r = post("/v1/completions", "{\"prompt\": [[1,2],[3]], \"n\": 2, \"max_tokens\": 2, \"temperature\": 1, \"seed\": 7}");
    CHECK(r.status == 200);
    j = body_json(&r);
    json_t *ch = json_object_get(j, "choices");
    CHECK(json_array_size(ch) == 4);
    const char *t0 = json_string_value(json_object_get(json_array_get(ch, 0), "text"));
    const char *t1 = json_string_value(json_object_get(json_array_get(ch, 1), "text"));
    const char *t2 = json_string_value(json_object_get(json_array_get(ch, 2), "text"));
    CHECK(t0 && t1 && t2 && !strcmp(t0, " s7 s7") && !strcmp(t1, " s8 s8") && !strcmp(t2, " s7 s7"));
    for (int i = 0; i < 4; i++) CHECK(json_integer_value(json_object_get(json_array_get(ch, (size_t)i), "index")) == i);
    u = json_object_get(j, "usage");
    CHECK(json_integer_value(json_object_get(u, "prompt_tokens")) == 3); /* 2 + 1, each prompt once */
    CHECK(json_integer_value(json_object_get(u, "completion_tokens")) == 8);
    json_decref(j);
    resp_free(&r);

    /* logprobs */
    r = post("/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 2, \"temperature\": 0, \"logprobs\": 2}");
    j = body_json(&r);
    json_t *lp = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
    CHECK(json_array_size(json_object_get(lp, "tokens")) == 2);
    CHECK(!strcmp(json_string_value(json_array_get(json_object_get(lp, "tokens"), 1)), " w1"));
    CHECK(fabs(json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), 0)) + 0.25) < 1e-6);
    CHECK(json_object_size(json_array_get(json_object_get(lp, "top_logprobs"), 0)) == 2);
    CHECK(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 1)) == 3);
    json_decref(j);
    resp_free(&r);
    CHECK(fake_drained());
}

static void test_http_chat(void) {
    resp r = post("/v1/chat/completions", "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, "
                                          "{\"role\": \"user\", \"content\": \"hi\"}], \"max_completion_tokens\": 3, "
                                          "\"temperature\": 0, \"logprobs\": true, \"top_logprobs\": 1}");
    CHECK(r.status == 200);
    json_t *j = body_json(&r);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *msg = json_object_get(c, "message");
    CHECK(!strcmp(json_string_value(json_object_get(msg, "role")), "assistant"));
    CHECK(!strcmp(json_string_value(json_object_get(msg, "content")), " w0 w1 w2"));
    CHECK(!strcmp(json_string_value(json_object_get(j, "object")), "chat.completion"));
    json_t *content = json_object_get(json_object_get(c, "logprobs"), "content");
    CHECK(json_array_size(content) == 3);
    CHECK(json_array_size(json_object_get(json_array_get(content, 0), "top_logprobs")) == 1);
    CHECK(json_array_size(json_object_get(json_array_get(content, 0), "bytes")) == 3);
    json_decref(j);
    resp_free(&r);
    /* no max tokens: runs to the context's end */
    r = post("/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": 0}");
    j = body_json(&r);
    c = json_array_get(json_object_get(j, "choices"), 0);
    CHECK(!strcmp(json_string_value(json_object_get(c, "finish_reason")), "length"));
    CHECK(json_integer_value(json_object_get(json_object_get(j, "usage"), "total_tokens")) == FAKE_CTX);
    json_decref(j);
    resp_free(&r);
}

static void test_http_stream(void) {
    json_t *ev[64];
    int done, framing;
    resp r = post("/v1/completions", "{\"prompt\": \"hello\", \"max_tokens\": 3, \"temperature\": 0, \"stream\": true, "
                                     "\"stream_options\": {\"include_usage\": true}}");
    CHECK(r.status == 200);
    CHECK(r.head && strstr(r.head, "text/event-stream"));
    int n = r.body ? sse_events(r.body, ev, 64, &done, &framing) : 0;
    CHECK(done && framing);
    char text[256] = "";
    int usage_chunks = 0, finish_seen = 0;
    for (int i = 0; i < n; i++) {
        json_t *ch = json_object_get(ev[i], "choices");
        CHECK(json_object_get(ev[i], "usage") != NULL); /* null or the usage object, in every chunk */
        if (json_array_size(ch) == 0) {
            usage_chunks++;
            CHECK(i == n - 1);
            CHECK(json_integer_value(json_object_get(json_object_get(ev[i], "usage"), "completion_tokens")) == 3);
            continue;
        }
        json_t *c = json_array_get(ch, 0);
        strcat(text, json_string_value(json_object_get(c, "text")));
        if (json_is_string(json_object_get(c, "finish_reason"))) finish_seen++;
        json_decref(ev[i]);
        ev[i] = NULL;
    }
    for (int i = 0; i < n; i++) json_decref(ev[i]);
    CHECK(!strcmp(text, " w0 w1 w2"));
    CHECK(usage_chunks == 1 && finish_seen == 1);
    resp_free(&r);

    /* chat stream: role first, then content deltas, then an empty delta with the finish reason */
    r = post("/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 2, "
                                     "\"temperature\": 0, \"stream\": true, \"n\": 2}");
    CHECK(r.status == 200);
    n = r.body ? sse_events(r.body, ev, 64, &done, &framing) : 0;
    CHECK(done && framing);
    char texts[2][64] = {"", ""};
    int roles[2] = {0, 0}, finishes[2] = {0, 0};
    for (int i = 0; i < n; i++) {
        CHECK(!strcmp(json_string_value(json_object_get(ev[i], "object")), "chat.completion.chunk"));
        CHECK(json_object_get(ev[i], "usage") == NULL);
        json_t *c = json_array_get(json_object_get(ev[i], "choices"), 0);
        int idx = (int)json_integer_value(json_object_get(c, "index"));
        REQUIRE(idx == 0 || idx == 1);
        json_t *delta = json_object_get(c, "delta");
        if (json_object_get(delta, "role")) {
            CHECK(roles[idx] == 0 && texts[idx][0] == 0);
            roles[idx]++;
        }
        if (json_is_string(json_object_get(delta, "content")))
            strcat(texts[idx], json_string_value(json_object_get(delta, "content")));
        if (json_is_string(json_object_get(c, "finish_reason"))) {
            finishes[idx]++;
            CHECK(json_object_size(delta) == 0);
        }
        json_decref(ev[i]);
    }
    CHECK(roles[0] == 1 && roles[1] == 1 && finishes[0] == 1 && finishes[1] == 1);
    CHECK(!strcmp(texts[0], " w0 w1") && !strcmp(texts[1], " w0 w1"));
    resp_free(&r);
    CHECK(fake_drained());
}


/* Tool calls end to end through the HTTP layer, the double "generating" a
 * script 7 bytes per event. */
static json_t *tool_calls_of(json_t *msg) { return json_object_get(msg, "tool_calls"); }

static int call_is(json_t *call, const char *name, const char *args) {
    json_t *fn = json_object_get(call, "function");
    const char *id = json_string_value(json_object_get(call, "id"));
    return id && !strncmp(id, "call_", 5) && strlen(id) > 20 &&
           !strcmp(json_string_value(json_object_get(call, "type")), "function") &&
           !strcmp(json_string_value(json_object_get(fn, "name")), name) &&
           !strcmp(json_string_value(json_object_get(fn, "arguments")), args);
}

#define TOOLS_BODY(extra)                                                                                      \
    "{\"messages\": [{\"role\": \"user\", \"content\": \"SCRIPT_CALLS\"}], \"tools\": [" TOOL_F "], "           \
    "\"max_tokens\": 40, \"temperature\": 0" extra "}"

static void test_http_tools(void) {
    pthread_mutex_lock(&fake.mu);
    fake.template_tools = 1;
    pthread_mutex_unlock(&fake.mu);
    /* whole: content outside the calls, the calls, finish_reason tool_calls */
    resp r = post("/v1/chat/completions", TOOLS_BODY(""));
    CHECKF(r.status == 200, "%d %s", r.status, r.body ? r.body : "");
    json_t *j = body_json(&r);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *msg = json_object_get(c, "message");
    CHECK(!strcmp(json_string_value(json_object_get(c, "finish_reason")), "tool_calls"));
    CHECK(json_is_string(json_object_get(msg, "content")) &&
          !strcmp(json_string_value(json_object_get(msg, "content")), "Let me check.\n"));
    json_t *calls = tool_calls_of(msg);
    CHECK(json_array_size(calls) == 2);
    CHECK(call_is(json_array_get(calls, 0), "get_weather", "{\"city\": \"Paris\"}"));
    CHECK(call_is(json_array_get(calls, 1), "get_time", "{\"tz\": \"CET\"}"));
    CHECK(strcmp(json_string_value(json_object_get(json_array_get(calls, 0), "id")),
                 json_string_value(json_object_get(json_array_get(calls, 1), "id"))) != 0);
    json_decref(j);
    resp_free(&r);
    /* the template got the tools */
    pthread_mutex_lock(&fake.mu);
    CHECK(strstr(fake.last_context, "\"tools\":[{\"type\":\"function\"") != NULL);
    pthread_mutex_unlock(&fake.mu);

    /* parallel_tool_calls false: the first call only */
    r = post("/v1/chat/completions", TOOLS_BODY(", \"parallel_tool_calls\": false"));
    j = body_json(&r);
    msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    CHECK(json_array_size(tool_calls_of(msg)) == 1 && call_is(json_array_get(tool_calls_of(msg), 0), "get_weather",
                                                              "{\"city\": \"Paris\"}"));
    json_decref(j);
    resp_free(&r);

    /* tool_choice "none": the text as it came, no calls read */
    r = post("/v1/chat/completions", TOOLS_BODY(", \"tool_choice\": \"none\""));
    j = body_json(&r);
    c = json_array_get(json_object_get(j, "choices"), 0);
    msg = json_object_get(c, "message");
    CHECK(!tool_calls_of(msg) && !strcmp(json_string_value(json_object_get(msg, "content")), SCRIPT_CALLS));
    CHECK(!strcmp(json_string_value(json_object_get(c, "finish_reason")), "stop"));
    json_decref(j);
    resp_free(&r);

    /* tools, and a text without calls: content exactly the text, finish_reason the engine's */
    r = post("/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": \"SCRIPT_PLAIN\"}], "
                                     "\"tools\": [" TOOL_F "], \"max_tokens\": 40}");
    j = body_json(&r);
    c = json_array_get(json_object_get(j, "choices"), 0);
    msg = json_object_get(c, "message");
    CHECK(!tool_calls_of(msg) && !strcmp(json_string_value(json_object_get(msg, "content")), SCRIPT_PLAIN));
    CHECK(!strcmp(json_string_value(json_object_get(c, "finish_reason")), "stop"));
    json_decref(j);
    resp_free(&r);

    /* streamed, two choices: content deltas never show a tag; each call one delta.tool_calls chunk */
    json_t *ev[128];
    int done, framing;
    r = post("/v1/chat/completions", TOOLS_BODY(", \"stream\": true, \"n\": 2, \"stream_options\": {\"include_usage\": true}"));
    CHECK(r.status == 200);
    int n = r.body ? sse_events(r.body, ev, 128, &done, &framing) : 0;
    CHECK(done && framing);
    char texts[2][256] = {"", ""};
    int ncalls[2] = {0, 0}, finishes[2] = {0, 0}, bad_calls = 0, after_finish = 0;
    for (int i = 0; i < n; i++) {
        json_t *ch = json_array_get(json_object_get(ev[i], "choices"), 0);
        if (!ch) continue; /* the usage chunk */
        int idx = (int)json_integer_value(json_object_get(ch, "index"));
        REQUIRE(idx == 0 || idx == 1);
        json_t *delta = json_object_get(ch, "delta");
        if (finishes[idx]) after_finish++;
        if (json_is_string(json_object_get(delta, "content")))
            strncat(texts[idx], json_string_value(json_object_get(delta, "content")), 255 - strlen(texts[idx]));
        json_t *tc = json_object_get(delta, "tool_calls");
        for (size_t k = 0; k < json_array_size(tc); k++) {
            json_t *call = json_array_get(tc, k);
            int want = ncalls[idx]++;
            if (json_integer_value(json_object_get(call, "index")) != want ||
                !call_is(call, want ? "get_time" : "get_weather", want ? "{\"tz\": \"CET\"}" : "{\"city\": \"Paris\"}"))
                bad_calls++;
        }
        if (json_is_string(json_object_get(ch, "finish_reason"))) {
            finishes[idx]++;
            CHECK(!strcmp(json_string_value(json_object_get(ch, "finish_reason")), "tool_calls"));
        }
    }
    for (int i = 0; i < n; i++) json_decref(ev[i]);
    for (int k = 0; k < 2; k++) {
        CHECKF(!strcmp(texts[k], "Let me check.\n"), "choice %d content '%s'", k, texts[k]);
        CHECK(ncalls[k] == 2 && finishes[k] == 1);
    }
    CHECK(bad_calls == 0 && after_finish == 0);
    resp_free(&r);

    /* a template that never names tools, one the interpreter does not run: 400s naming the field */
    pthread_mutex_lock(&fake.mu);
    fake.template_tools = 0;
    pthread_mutex_unlock(&fake.mu);
    r = post("/v1/chat/completions", TOOLS_BODY(""));
    j = body_json(&r);
    CHECK(is_error(&r, 400) && !strcmp(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "tools"));
    json_decref(j);
    resp_free(&r);
    r = post("/v1/chat/completions", TOOLS_BODY(", \"tool_choice\": \"none\"")); /* not shown: fine */
    CHECK(r.status == 200);
    resp_free(&r);
    pthread_mutex_lock(&fake.mu);
    fake.template_tools = 2; /* calls in a format this server does not read */
    pthread_mutex_unlock(&fake.mu);
    r = post("/v1/chat/completions", TOOLS_BODY(""));
    j = body_json(&r);
    CHECK(is_error(&r, 400) && !strcmp(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "tools"));
    CHECK(strstr(json_string_value(json_object_get(json_object_get(j, "error"), "message")), "another format"));
    json_decref(j);
    resp_free(&r);
    pthread_mutex_lock(&fake.mu);
    fake.template_tools = -1;
    pthread_mutex_unlock(&fake.mu);
    r = post("/v1/chat/completions", TOOLS_BODY(""));
    j = body_json(&r);
    CHECK(is_error(&r, 400) && !strcmp(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "tools"));
    json_decref(j);
    resp_free(&r);
    r = post("/v1/chat/completions", "{" MSGS_TOOLS ", \"max_tokens\": 2}");
    j = body_json(&r);
    CHECK(is_error(&r, 400) && !strcmp(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "messages"));
    json_decref(j);
    resp_free(&r);
    pthread_mutex_lock(&fake.mu);
    fake.template_tools = 1;
    pthread_mutex_unlock(&fake.mu);
    CHECK(fake_drained());
}

/* A client that reads a little of its stream and hangs up: its request is aborted. */
static void test_http_disconnect(void) {
    pthread_mutex_lock(&fake.mu);
    int64_t aborted0 = fake.aborted;
    pthread_mutex_unlock(&fake.mu);
    for (int queued = 0; queued <= 1; queued++) {
        pthread_mutex_lock(&fake.mu);
        fake.queue_delay = queued ? 1000000 : 0; /* queued: never gets a token */
        pthread_mutex_unlock(&fake.mu);
        int fd = connect_local();
        REQUIRE(fd >= 0);
        const char *b = "{\"prompt\": \"a\", \"max_tokens\": 50, \"temperature\": 0, \"stream\": true}";
        send_req(fd, "POST", "/v1/completions", NULL, b, strlen(b));
        if (!queued) {
            char buf[512];
            ssize_t k = read(fd, buf, sizeof buf);
            CHECK(k > 0);
        } else {
            struct timespec ts = {0, 100000000L};
            nanosleep(&ts, NULL);
            CHECK(fake_live() == 1);
        }
        close(fd);
        CHECK(fake_drained());
        pthread_mutex_lock(&fake.mu);
        fake.queue_delay = 0;
        pthread_mutex_unlock(&fake.mu);
    }
    /* a non-streaming client that hangs up while queued */
    pthread_mutex_lock(&fake.mu);
    fake.queue_delay = 1000000;
    pthread_mutex_unlock(&fake.mu);
    int fd = connect_local();
    REQUIRE(fd >= 0);
    const char *b = "{\"prompt\": \"a\", \"max_tokens\": 50}";
    send_req(fd, "POST", "/v1/completions", NULL, b, strlen(b));
    struct timespec ts = {0, 100000000L};
    nanosleep(&ts, NULL);
    CHECK(fake_live() == 1);
    close(fd);
    CHECK(fake_drained());
    pthread_mutex_lock(&fake.mu);
    fake.queue_delay = 0;
    CHECK(fake.aborted - aborted0 == 3);
    pthread_mutex_unlock(&fake.mu);
    cas_engine_stats st;
    fake_stats(NULL, &st);
    CHECK(st.kv_blocks_used == 0);
    resp r = http("GET", "/metrics", NULL, NULL);
    CHECKF(r.body && strstr(r.body, "cascade_requests_cancelled_total 3"), "%s", r.body ? strstr(r.body, "cascade_requests_cancelled") : "");
    resp_free(&r);
}

static char lone_text[256];

static void *stream_client(void *arg) {
    int *ok = arg;
    resp r = post("/v1/completions", "{\"prompt\": \"shared system prompt, then a question\", \"max_tokens\": 20, "
                                     "\"temperature\": 0, \"stream\": true}");
    json_t *ev[64];
    int done = 0, framing = 0;
    int n = r.status == 200 && r.body ? sse_events(r.body, ev, 64, &done, &framing) : 0;
    char text[256] = "";
    for (int i = 0; i < n; i++) {
        const char *t = json_string_value(json_object_get(json_array_get(json_object_get(ev[i], "choices"), 0), "text"));
        if (t && strlen(text) + strlen(t) < sizeof text) strcat(text, t);
        json_decref(ev[i]);
    }
    *ok = done && framing && !strcmp(text, lone_text);
    resp_free(&r);
    return NULL;
}

static void test_http_concurrent(void) {
    resp r = post("/v1/completions", "{\"prompt\": \"shared system prompt, then a question\", \"max_tokens\": 20, "
                                     "\"temperature\": 0}");
    json_t *j = body_json(&r);
    snprintf(lone_text, sizeof lone_text, "%s",
             json_string_value(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text")));
    json_decref(j);
    resp_free(&r);
    CHECK(strlen(lone_text) > 20);
    enum { N = 32 };
    pthread_t th[N];
    int ok[N];
    for (int i = 0; i < N; i++) pthread_create(&th[i], NULL, stream_client, &ok[i]);
    int good = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        good += ok[i];
    }
    CHECKF(good == N, "%d of %d streams complete and equal", good, N);
    CHECK(fake_drained());
    r = http("GET", "/metrics", NULL, NULL);
    CHECK(r.status == 200 && r.head && strstr(r.head, "text/plain"));
    CHECK(r.body && strstr(r.body, "cascade_kv_pages_used 0\n"));
    CHECK(r.body && strstr(r.body, "# TYPE cascade_time_to_first_token_seconds histogram"));
    CHECK(r.body && strstr(r.body, "cascade_time_per_output_token_seconds_bucket{le=\"+Inf\"}"));
    CHECK(r.body && strstr(r.body, "cascade_num_requests_running 0\n"));
    resp_free(&r);
}

static void test_http_api_key(void) {
    cas_srv_engine_ops ops = fake_ops();
    cas_server_opts o = cas_server_opts_default();
    o.port = 0;
    o.api_key = "k123";
    cas_server *s2 = NULL;
    REQUIRE(cas_srv_create_with_ops(&s2, &ops, &o) == CAS_OK);
    int saved = port;
    port = cas_server_port(s2);
    resp r = http("GET", "/v1/models", NULL, NULL);
    CHECK(is_error(&r, 401));
    resp_free(&r);
    r = http("GET", "/v1/models", "Authorization: Bearer nope\r\n", NULL);
    CHECK(is_error(&r, 401));
    resp_free(&r);
    r = http("GET", "/v1/models", "Authorization: Bearer k123\r\n", NULL);
    CHECK(r.status == 200);
    resp_free(&r);
    r = http("GET", "/health", NULL, NULL);
    CHECK(r.status == 200);
    resp_free(&r);
    /* shutdown with a stream in flight: the request is aborted, nothing leaks or hangs */
    int fd = connect_local();
    const char *b = "{\"prompt\": \"a\", \"max_tokens\": 50, \"stream\": true}";
    send_req(fd, "POST", "/v1/completions", "Authorization: Bearer k123\r\n", b, strlen(b));
    char buf[256];
    CHECK(read(fd, buf, sizeof buf) > 0);
    double t0 = cas_now_s();
    cas_server_destroy(s2);
    CHECK(cas_now_s() - t0 < 5.0);
    close(fd);
    CHECK(fake_drained());
    port = saved;
}

/* Every response names the replica that answered (X-Cascade-Replica): by
 * default the address and port as bound, else the configured name; health,
 * errors, answers and streams alike, for a load balancer's logs and clients. */
static int has_replica(const resp *r, const char *name) {
    char want[128];
    snprintf(want, sizeof want, "\r\nX-Cascade-Replica: %s\r", name);
    char *head = r->head ? malloc(strlen(r->head) + 3) : NULL;
    if (!head) return 0;
    sprintf(head, "%s\r\n", r->head); /* the last header ends with CRLF too */
    int ok = strstr(head, want) != NULL;
    free(head);
    return ok;
}

static void test_http_replica_name(void) {
    char def[64];
    snprintf(def, sizeof def, "127.0.0.1:%d", port);
    CHECK(!strcmp(cas_server_replica_name(srv), def));
    const char *routes[][2] = {{"GET", "/health"}, {"GET", "/metrics"}, {"GET", "/nowhere"}, {"PUT", "/v1/completions"}};
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        resp r = http(routes[i][0], routes[i][1], NULL, "{}");
        CHECK(r.status != 0 && has_replica(&r, def));
        resp_free(&r);
    }
    resp r = post("/v1/completions", "{\"prompt\": \"hello\", \"max_tokens\": 2}");
    CHECK(r.status == 200 && has_replica(&r, def));
    resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"hello\", \"max_tokens\": 2, \"stream\": true}");
    CHECK(r.status == 200 && has_replica(&r, def));
    resp_free(&r);
    CHECK(fake_drained());

    /* a second server with a name of its own; a name that would break the header line is refused */
    cas_srv_engine_ops ops = fake_ops();
    cas_server_opts o = cas_server_opts_default();
    o.port = 0;
    o.replica_name = "r1\r\nX-Injected: 1";
    cas_server *named = NULL;
    CHECK(cas_srv_create_with_ops(&named, &ops, &o) == CAS_ERR_INVALID && !named);
    o.replica_name = "gpu-node-3/r1";
    CHECK(cas_srv_create_with_ops(&named, &ops, &o) == CAS_OK);
    if (!named) return;
    CHECK(!strcmp(cas_server_replica_name(named), "gpu-node-3/r1"));
    int saved = port;
    port = cas_server_port(named);
    r = http("GET", "/health", NULL, NULL);
    CHECK(r.status == 200 && has_replica(&r, "gpu-node-3/r1") && !has_replica(&r, def));
    resp_free(&r);
    r = post("/v1/completions", "{\"prompt\": \"hello\", \"max_tokens\": 2, \"stream\": true}");
    CHECK(r.status == 200 && has_replica(&r, "gpu-node-3/r1"));
    resp_free(&r);
    /* draining: the 503s still say who answered */
    cas_server_drain(named);
    r = http("GET", "/health", NULL, NULL);
    CHECK(r.status == 503 && has_replica(&r, "gpu-node-3/r1"));
    resp_free(&r);
    port = saved;
    CHECK(fake_drained());
    cas_server_destroy(named);
}

int main(void) {
    RUN(test_head_check);
    RUN(test_parse_routes);
    RUN(test_parse_completions);
    RUN(test_parse_chat);
    RUN(test_parse_tools);

    pthread_mutex_init(&fake.mu, NULL);
    pthread_create(&fake.th, NULL, fake_loop, NULL);
    cas_srv_engine_ops ops = fake_ops();
    cas_server_opts o = cas_server_opts_default();
    o.port = 0;
    o.max_body_bytes = 65536;
    if (cas_srv_create_with_ops(&srv, &ops, &o) != CAS_OK) {
        printf("FAIL server: %s\n", cas_last_error());
        return 1;
    }
    port = cas_server_port(srv);
    RUN(test_http_simple_routes);
    RUN(test_http_body_limit);
    RUN(test_http_completion);
    RUN(test_http_chat);
    RUN(test_http_stream);
    RUN(test_http_tools);
    RUN(test_http_disconnect);
    RUN(test_http_concurrent);
    RUN(test_http_api_key);
    RUN(test_http_replica_name);
    cas_server_destroy(srv);
    pthread_mutex_lock(&fake.mu);
    fake.stop = 1;
    pthread_mutex_unlock(&fake.mu);
    pthread_join(fake.th, NULL);
    return check_summary();
}
