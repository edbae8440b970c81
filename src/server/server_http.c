/*
 * server_http.c: the HTTP side of `cascade serve`. libmicrohttpd runs one
 * thread per connection; that thread reads the body, parses it
 * (server_parse.c), submits one engine request per choice and then waits for
 * the choice's events, either to write them as Server-Sent Events as they
 * come (stream) or to answer once everything is done.
 *
 * Engine thread vs HTTP threads. The engine callback (on_event) copies the
 * event into the request's queue under the request's own mutex and signals
 * its condition variable: no JSON, no socket, no waiting on a client. The
 * connection thread takes the whole queue at once, renders the chunks and
 * writes them at its client's pace. Blocking a connection thread is fine
 * (it is that client's thread).
 *
 * Lifetime. A request (srv_req) is reference-counted: one reference for the
 * connection, one for a streaming response object, one for each engine
 * request until its final event (finish != NONE), which the engine
 * guarantees even after an abort. Whoever drops the last reference frees it,
 * so a client that disconnects never leaves the engine a dangling pointer.
 *
 * Cancellation. While waiting, the connection thread polls its socket for a
 * hang-up, so a client that goes away is noticed within 50 ms even when no
 * token is due (a request still queued). Then, and whenever libmicrohttpd
 * ends a request early, every unfinished engine request of it is aborted,
 * which frees its KV pages in the engine. A client may half-close its socket
 * after sending the request (shutdown(SHUT_WR)): that alone (POLLRDHUP) does
 * not end a stream; instead the stream sends an SSE comment line (": ping",
 * which SSE clients ignore) at most once a second while no token is due, and
 * a client that really closed answers it with a reset, which ends the stream.
 * A non-streaming request cannot write before its answer, so for it a
 * half-close still counts as gone.
 *
 * Connections (design). The listening socket is ours: the gate thread
 * (server_gate.c) accepts, holds a connection until its request head is
 * complete, answers a malformed one with a JSON error (libmicrohttpd would
 * send an HTML page) and hands the rest to libmicrohttpd; while a connection
 * waits there, the gate applies the limits below itself. Each connection
 * libmicrohttpd holds has a srv_conn (its socket context, set when it
 * opens), in a list oldest first. A watchdog
 * thread shuts down any connection still waiting for its request headers
 * header_timeout after it opened or after its previous response ended: a
 * hard deadline that dribbling bytes does not extend, unlike libmicrohttpd's
 * inactivity timeout. When the connections near the limit (all but 1/16 of
 * them taken), each new one shuts down the oldest connection waiting for
 * headers, so a flood of idle connections cannot keep a real client out;
 * the per-address limit (libmicrohttpd's, which refuses at accept) keeps one
 * address from taking them all. libmicrohttpd's own inactivity timeout (idle_timeout) covers a
 * body that stops coming and a client that stops reading; while a
 * connection waits on the engine it is off (0), and it is set again (which
 * restarts its clock) when there is something to write.
 *
 * Tool calls. A chat request whose tools reach the template (tool_choice
 * "auto") has its output read for Hermes-style <tool_call> blocks
 * (server_tools.c): a whole answer gets message.tool_calls, content null
 * when nothing is left outside the calls, and finish_reason "tool_calls"; a
 * stream runs the same reader per choice as the text comes, sends content
 * deltas as soon as they cannot belong to a call, and each call, once its
 * block has closed, as one delta.tool_calls chunk. render_chat refuses
 * (400) tools for a template that never names them, or that asks for calls
 * in another format, rather than drop them or return the calls as text.
 *
 * Drain. cas_server_drain makes new requests 503 and /health 503 while the
 * admitted requests (a list, under s->mu) run to their end; cas_server_abort_all
 * aborts their engine requests so that streams end at once, cleanly.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server_impl.h"

#define WAIT_SLICE_NS 50000000L   /* 50 ms between hang-up checks */
#define PROBE_EVERY_S 1.0         /* SSE ": ping" to a half-closed stream client */
#define WATCH_SLICE_NS 100000000L /* the watchdog looks at connections every 100 ms */
#define MAX_HEADER_BYTES 32768    /* larger request headers get our own 431 */
#define CONN_MEMORY (128u << 10)  /* libmicrohttpd's per-connection buffer (its 431 beyond) */
#define DUMP_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(8))
#define REPLICA_HEADER "X-Cascade-Replica" /* names the replica that answered (load balancers, logs) */

/* the release /version reports: the Makefile passes its CAS_VERSION */
#ifndef CAS_VERSION_STRING
#error "CAS_VERSION_STRING is not defined: build with the Makefile, which passes CAS_VERSION"
#endif

/* One TCP connection (libmicrohttpd's socket context). */
typedef struct srv_conn {
    struct srv_conn *prev, *next; /* s->conns, oldest first; guarded by s->conn_mu */
    int fd;
    double since; /* cas_now_s() when it began waiting for request headers */
    int busy;     /* a request's headers came and its response has not ended */
    int shut;     /* shut down by the server; gone soon */
} srv_conn;

struct srv_req;

struct cas_server {
    cas_srv_engine_ops ops;
    cas_srv_limits lim;
    char *api_key, *model_name, *model_alias;
    /* X-Cascade-Replica of every response, named once the socket is bound
     * (before any connection is accepted) */
    _Atomic(char *) replica_name;
    struct MHD_Daemon *daemon;
    int listen_fd;             /* ours: the gate (server_gate.c) accepts, libmicrohttpd gets checked heads */
    cas_srv_gate *gate;
    int32_t port;
    long created;
    cas_srv_metrics metrics;
    pthread_mutex_t mu; /* guards live, active, admitted */
    pthread_cond_t cv;
    int64_t live;       /* engine requests whose final event has not come yet */
    int64_t active;     /* admitted requests not yet completed */
    struct srv_req *admitted; /* those requests, a list */
    atomic_int closing;
    atomic_int draining, aborting;
    atomic_uint_fast64_t counter; /* fallback ids and default seeds */
    /* connections */
    int32_t max_conns;
    int32_t headroom;          /* connections kept free by evicting (1/16 of them, 1 to 64) */
    double header_timeout;     /* seconds; <= 0: none */
    unsigned idle_timeout;     /* seconds; 0: none */
    pthread_mutex_t conn_mu;   /* guards the list, n_conns, watch_stop */
    pthread_cond_t conn_cv;
    srv_conn *conns, *conns_tail;
    int64_t n_conns;
    pthread_t watchdog;
    int watch_started, watch_stop;
    cas_status (*tokenize)(void *ctx, const char *text, int add_special, int32_t **ids, int32_t *n);
    void *tokenize_ctx;
};

/* One engine event, copied (with its arrays) into one allocation. */
typedef struct srv_ev {
    struct srv_ev *next;
    int32_t choice;
    cas_finish_reason finish;
    int32_t prompt_tokens, completion_tokens, cached_tokens;
    int32_t n_tokens, k;    /* tokens, alternatives per token */
    double t;               /* cas_now_s() when the engine delivered it */
    int32_t *tokens;        /* [n_tokens] */
    float *logprobs;        /* [n_tokens] or NULL */
    int32_t *top_ids;       /* [n_tokens][k] or NULL */
    float *top_lp;          /* [n_tokens][k] */
    size_t text_len;
    char *text;             /* NUL-terminated */
} srv_ev;

typedef struct {
    struct srv_req *req;
    int32_t index;
    int32_t k;            /* alternatives asked of the engine */
    uint64_t id;          /* engine id, valid when submitted */
    int submitted;        /* guarded by req->mu */
    int engine_done;      /* final event delivered; guarded by req->mu */
    /* HTTP-thread state */
    int role_sent;
    cas_finish_reason finish;
    int32_t prompt_tokens, completion_tokens, cached_tokens;
    double t_first, t_last;
    char *text;           /* non-stream: accumulated text */
    size_t len, cap;
    json_t *lp;           /* non-stream: accumulated logprobs (shape per route) */
    size_t text_offset;
    /* stream with tools: the reader of the text so far, and what of it was sent */
    cas_srv_tools tools;
    size_t content_sent;
    int32_t calls_sent;
} srv_choice;

typedef struct srv_req {
    cas_server *s;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;             /* guarded by mu */
    srv_ev *head, *tail;  /* guarded by mu */
    int n_live;           /* choices without a final event; guarded by mu */
    struct MHD_Connection *conn;
    char *body;
    size_t body_len, body_cap;
    int too_large;
    cas_srv_parsed p;
    char id[48];
    long created;
    double t_arrive;
    int32_t n_choices;
    srv_choice *choices;
    /* streaming output not yet written */
    char *out;
    size_t out_len, out_pos, out_cap;
    int finished_stream;  /* [DONE] rendered */
    int gone;             /* the client went away */
    /* connection-thread state */
    srv_conn *sc;         /* its connection, or NULL (untracked) */
    int admitted;         /* counted in s->active, on s->admitted */
    struct srv_req *adm_prev, *adm_next; /* guarded by s->mu */
    int timeout_off;      /* libmicrohttpd's inactivity timeout is off while waiting on the engine */
    double last_probe;    /* when the last ": ping" went to a half-closed client */
} srv_req;

/* ---- requests and their lifetime ------------------------------------------- */

static srv_req *req_new(cas_server *s, struct MHD_Connection *conn) {
    srv_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    r->s = s;
    r->conn = conn;
    r->refs = 1;
    r->t_arrive = cas_now_s();
    return r;
}

static void req_free(srv_req *r) {
    for (srv_ev *e = r->head, *n; e; e = n) {
        n = e->next;
        free(e);
    }
    for (int32_t i = 0; i < r->n_choices; i++) {
        free(r->choices[i].text);
        json_decref(r->choices[i].lp);
        cas_srv_tools_free(&r->choices[i].tools);
    }
    free(r->choices);
    cas_srv_parsed_free(&r->p);
    free(r->body);
    free(r->out);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

static void req_release(srv_req *r) {
    pthread_mutex_lock(&r->mu);
    int last = --r->refs == 0;
    pthread_mutex_unlock(&r->mu);
    if (last) req_free(r);
}

static void live_add(cas_server *s, int64_t d) {
    pthread_mutex_lock(&s->mu);
    s->live += d;
    if (s->live == 0) pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* The engine callback: copy, append, signal. Runs on the engine thread. */
static void on_event(void *user, const cas_engine_event *ev) {
    srv_choice *c = user;
    srv_req *r = c->req;
    cas_server *s = r->s;
    int32_t n = ev->n_tokens > 0 ? ev->n_tokens : 0;
    int32_t k = ev->top_ids && ev->top_logprobs ? c->k : 0;
    size_t arrays = (size_t)n * sizeof(int32_t) * (1 + (ev->logprobs ? 1 : 0)) +
                    (size_t)n * (size_t)k * (sizeof(int32_t) + sizeof(float));
    srv_ev *e = malloc(sizeof *e + arrays + ev->text_len + 1);
    if (e) {
        memset(e, 0, sizeof *e);
        e->choice = c->index;
        e->finish = ev->finish;
        e->prompt_tokens = ev->prompt_tokens;
        e->completion_tokens = ev->completion_tokens;
        e->cached_tokens = ev->cached_tokens;
        e->n_tokens = n;
        e->t = cas_now_s();
        char *w = (char *)(e + 1);
        e->tokens = (int32_t *)w;
        if (n) memcpy(w, ev->tokens, (size_t)n * sizeof(int32_t));
        w += (size_t)n * sizeof(int32_t);
        if (ev->logprobs) {
            e->logprobs = (float *)w;
            memcpy(w, ev->logprobs, (size_t)n * sizeof(float));
            w += (size_t)n * sizeof(float);
        }
        if (k) {
            e->k = k;
            e->top_ids = (int32_t *)w;
            memcpy(w, ev->top_ids, (size_t)n * (size_t)k * sizeof(int32_t));
            w += (size_t)n * (size_t)k * sizeof(int32_t);
            e->top_lp = (float *)w;
            memcpy(w, ev->top_logprobs, (size_t)n * (size_t)k * sizeof(float));
            w += (size_t)n * (size_t)k * sizeof(float);
        }
        e->text = w;
        e->text_len = ev->text_len;
        if (ev->text_len) memcpy(w, ev->text, ev->text_len);
        w[ev->text_len] = 0;
    }
    int final = ev->finish != CAS_FINISH_NONE;
    pthread_mutex_lock(&r->mu);
    if (e) {
        if (r->tail) r->tail->next = e;
        else r->head = e;
        r->tail = e;
    } else if (final) {
        /* out of memory: the text is lost, but the end is recorded */
        c->finish = CAS_FINISH_ERROR;
    }
    if (final && !c->engine_done) {
        c->engine_done = 1;
        r->n_live--;
        r->refs--;
    }
    int last = r->refs == 0;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (last) req_free(r);
    if (final) live_add(s, -1);
}

/* ---- waiting on the engine, watching the client --------------------------- */

/* 0: connected; 1: gone (reset, error, or the server closing); 2: the
 * client shut its sending side (POLLRDHUP alone), which a half-close and a
 * full close both look like until something is written. */
static int peer_state(srv_req *r) {
    if (atomic_load(&r->s->closing)) return 1;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return 0;
    struct pollfd pf = {.fd = ci->connect_fd, .events = POLLRDHUP};
    if (poll(&pf, 1, 0) <= 0) return 0;
    if (pf.revents & (POLLHUP | POLLERR | POLLNVAL)) return 1;
    return pf.revents & POLLRDHUP ? 2 : 0;
}

/* libmicrohttpd's inactivity timeout: off while the engine works (waiting on
 * it is not the client's inactivity), back on when there is something to
 * write; setting it after 0 restarts its clock. */
static void timeout_off(srv_req *r) {
    if (r->timeout_off || !r->s->idle_timeout) return;
    MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    r->timeout_off = 1;
}

static void timeout_on(srv_req *r) {
    if (!r->timeout_off) return;
    MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT, r->s->idle_timeout);
    r->timeout_off = 0;
}

/* Takes the queued events (oldest first); *live is the number of choices
 * still running at that moment. Waits up to one slice when there are none. */
static srv_ev *take_events(srv_req *r, int *live, int wait) {
    pthread_mutex_lock(&r->mu);
    if (wait && !r->head && r->n_live > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += WAIT_SLICE_NS;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    srv_ev *e = r->head;
    r->head = r->tail = NULL;
    *live = r->n_live;
    pthread_mutex_unlock(&r->mu);
    return e;
}

/* Aborts the request's unfinished engine requests. Any thread (the
 * connection's, or cas_server_abort_all's): choices and n_choices are read
 * under r->mu, where generate sets them. */
static void abort_all(srv_req *r) {
    cas_server *s = r->s;
    pthread_mutex_lock(&r->mu);
    int32_t n = r->n_choices;
    pthread_mutex_unlock(&r->mu);
    for (int32_t i = 0; i < n; i++) {
        pthread_mutex_lock(&r->mu);
        int todo = r->choices[i].submitted && !r->choices[i].engine_done;
        uint64_t id = r->choices[i].id;
        pthread_mutex_unlock(&r->mu);
        if (todo) s->ops.abort(s->ops.ctx, id); /* never under r->mu: the engine may be calling on_event */
    }
}

/* ---- rendering ------------------------------------------------------------- */

static json_t *jstr(const char *s, size_t n) { return cas_srv_json_str(s, n); }

static json_t *token_str(cas_server *s, int32_t id, const srv_ev *e) {
    if (s->ops.token_text) {
        size_t len = 0;
        const char *t = s->ops.token_text(s->ops.ctx, id, &len);
        if (t) return jstr(t, len);
    }
    if (e && e->n_tokens == 1 && e->tokens[0] == id) return jstr(e->text, e->text_len);
    char buf[32];
    snprintf(buf, sizeof buf, "token_id:%d", (int)id);
    return json_string(buf);
}

/* OpenAI's "bytes" of a token: its raw bytes, which differ from its string
 * when it holds part of a UTF-8 character (the string has U+FFFD there). */
static json_t *bytes_of(cas_server *s, int32_t id, const srv_ev *e, json_t *str) {
    const char *p = NULL;
    size_t n = 0;
    if (s->ops.token_text) p = s->ops.token_text(s->ops.ctx, id, &n);
    if (!p && e && e->n_tokens == 1 && e->tokens[0] == id) p = e->text, n = e->text_len;
    if (!p) p = json_string_value(str), n = json_string_length(str);
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer((unsigned char)p[i]));
    return a;
}

static double lp_value(float v) { return v < -9999.0f ? -9999.0 : (double)v; } /* -inf is not JSON */

/* Appends an event's log-probabilities to *lp in the route's shape:
 * chat {"content": [...]}, completions {"tokens", "token_logprobs",
 * "top_logprobs", "text_offset"}. */
static void add_logprobs(srv_req *r, srv_choice *c, const srv_ev *e, json_t **lp) {
    cas_server *s = r->s;
    int chat = r->p.route == CAS_SRV_ROUTE_CHAT;
    int32_t top = r->p.top_logprobs < e->k ? r->p.top_logprobs : e->k;
    if (!*lp) {
        *lp = chat ? json_pack("{s:[]}", "content")
                   : json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
        if (!*lp) return;
    }
    for (int32_t t = 0; t < e->n_tokens; t++) {
        json_t *tok = token_str(s, e->tokens[t], e);
        double v = e->logprobs ? lp_value(e->logprobs[t]) : 0.0;
        if (chat) {
            json_t *alts = json_array();
            for (int32_t j = 0; j < top; j++) {
                int32_t aid = e->top_ids[(size_t)t * (size_t)e->k + (size_t)j];
                json_t *at = token_str(s, aid, NULL);
                json_array_append_new(alts, json_pack("{s:o,s:f,s:o}", "token", at, "logprob",
                                                      lp_value(e->top_lp[(size_t)t * (size_t)e->k + (size_t)j]),
                                                      "bytes", bytes_of(s, aid, NULL, at)));
            }
            json_array_append_new(json_object_get(*lp, "content"),
                                  json_pack("{s:O,s:f,s:o,s:o}", "token", tok, "logprob", v, "bytes",
                                            bytes_of(s, e->tokens[t], e, tok), "top_logprobs", alts));
        } else {
            json_t *alts = json_object();
            for (int32_t j = 0; j < top; j++) {
                json_t *at = token_str(s, e->top_ids[(size_t)t * (size_t)e->k + (size_t)j], NULL);
                json_object_set_new(alts, json_string_value(at),
                                    json_real(lp_value(e->top_lp[(size_t)t * (size_t)e->k + (size_t)j])));
                json_decref(at);
            }
            json_array_append(json_object_get(*lp, "tokens"), tok);
            json_array_append_new(json_object_get(*lp, "token_logprobs"), json_real(v));
            json_array_append_new(json_object_get(*lp, "top_logprobs"), alts);
            json_array_append_new(json_object_get(*lp, "text_offset"), json_integer((json_int_t)c->text_offset));
            c->text_offset += json_string_length(tok);
        }
        json_decref(tok);
    }
}

static const char *finish_str(cas_finish_reason f) {
    switch (f) {
    case CAS_FINISH_STOP: return "stop";
    case CAS_FINISH_LENGTH: return "length";
    case CAS_FINISH_ABORT: return "abort";
    case CAS_FINISH_ERROR: return "error";
    default: return NULL;
    }
}

static const char *served_name(const srv_req *r) { return r->s->model_name; }

static json_t *usage_json(srv_req *r) {
    int64_t prompt = 0, completion = 0, cached = 0;
    for (int32_t i = 0; i < r->n_choices; i++) {
        srv_choice *c = &r->choices[i];
        if (i % r->p.n == 0) { /* each prompt once, however many choices it has */
            prompt += c->prompt_tokens;
            cached += c->cached_tokens;
        }
        completion += c->completion_tokens;
    }
    return json_pack("{s:I,s:I,s:I,s:{s:I}}", "prompt_tokens", (json_int_t)prompt, "completion_tokens",
                     (json_int_t)completion, "total_tokens", (json_int_t)(prompt + completion),
                     "prompt_tokens_details", "cached_tokens", (json_int_t)cached);
}

static json_t *envelope(srv_req *r, const char *object) {
    return json_pack("{s:s,s:s,s:I,s:s,s:n}", "id", r->id, "object", object, "created", (json_int_t)r->created,
                     "model", served_name(r), "system_fingerprint");
}

static int out_put(srv_req *r, const char *s, size_t n) {
    if (r->out_len + n > r->out_cap) {
        size_t cap = r->out_cap ? r->out_cap : 4096;
        while (cap < r->out_len + n) cap *= 2;
        char *p = realloc(r->out, cap);
        if (!p) return -1;
        r->out = p;
        r->out_cap = cap;
    }
    memcpy(r->out + r->out_len, s, n);
    r->out_len += n;
    return 0;
}

/* Writes one SSE event "data: {json}\n\n" and takes the reference of j. */
static void sse(srv_req *r, json_t *j) {
    char *s = j ? json_dumps(j, DUMP_FLAGS) : NULL;
    json_decref(j);
    if (!s) return;
    out_put(r, "data: ", 6);
    out_put(r, s, strlen(s));
    out_put(r, "\n\n", 2);
    free(s);
}

static void stream_chunk(srv_req *r, srv_choice *c, const char *text, size_t len, json_t *lp, int with_role,
                         const char *finish) {
    int chat = r->p.route == CAS_SRV_ROUTE_CHAT;
    json_t *j = envelope(r, chat ? "chat.completion.chunk" : "text_completion");
    json_t *ch = json_pack("{s:i}", "index", (int)c->index);
    if (chat) {
        json_t *delta = json_object();
        if (with_role) json_object_set_new(delta, "role", json_string("assistant"));
        if (text) json_object_set_new(delta, "content", jstr(text, len));
        json_object_set_new(ch, "delta", delta);
    } else {
        json_object_set_new(ch, "text", jstr(text ? text : "", text ? len : 0));
    }
    json_object_set_new(ch, "logprobs", lp ? lp : json_null());
    json_object_set_new(ch, "finish_reason", finish ? json_string(finish) : json_null());
    json_object_set_new(j, "choices", json_pack("[o]", ch));
    if (r->p.include_usage) json_object_set_new(j, "usage", json_null());
    sse(r, j);
}

/* One call as OpenAI gives it, with a fresh id; index >= 0 adds "index"
 * (a stream's delta.tool_calls entries). */
static json_t *tool_call_json(const cas_srv_tool_call *tc, int32_t index) {
    char id[48];
    cas_server_make_id(id, sizeof id, "call_");
    json_t *o = index >= 0 ? json_pack("{s:i}", "index", (int)index) : json_object();
    json_object_set_new(o, "id", json_string(id));
    json_object_set_new(o, "type", json_string("function"));
    json_object_set_new(o, "function", json_pack("{s:o,s:o}", "name", jstr(tc->name, strlen(tc->name)), "arguments",
                                                 jstr(tc->arguments, strlen(tc->arguments))));
    return o;
}

/* The calls a response reports: all, or the first with parallel_tool_calls false. */
static int32_t calls_reported(const srv_req *r, const cas_srv_tools *t) {
    return !r->p.parallel_tool_calls && t->n_calls > 1 ? 1 : t->n_calls;
}

/* A choice's finish_reason: "tool_calls" when it called a tool and ended by
 * itself or at its length (as vLLM), else the engine's. */
static const char *choice_finish(const srv_req *r, cas_finish_reason f, const cas_srv_tools *t) {
    if (r->p.parse_tool_calls && calls_reported(r, t) > 0 && (f == CAS_FINISH_STOP || f == CAS_FINISH_LENGTH))
        return "tool_calls";
    return finish_str(f);
}

/* A stream with tools: what the reader decided since the last event goes
 * out, content as content deltas (with the event's logprobs), each call as
 * one delta.tool_calls chunk (the arguments whole). */
static void stream_tools(srv_req *r, srv_choice *c, const srv_ev *e, json_t *lp) {
    cas_srv_tools *t = &c->tools;
    cas_srv_tools_feed(t, e->text, e->text_len);
    if (e->finish != CAS_FINISH_NONE) cas_srv_tools_finish(t);
    size_t n = t->content_len - c->content_sent;
    if (n || lp) stream_chunk(r, c, n ? t->content + c->content_sent : NULL, n, lp, 0, NULL);
    c->content_sent = t->content_len;
    for (int32_t k = c->calls_sent; k < calls_reported(r, t); k++) {
        json_t *j = envelope(r, "chat.completion.chunk");
        json_t *ch = json_pack("{s:i,s:{s:[o]},s:n,s:n}", "index", (int)c->index, "delta", "tool_calls",
                               tool_call_json(&t->calls[k], k), "logprobs", "finish_reason");
        json_object_set_new(j, "choices", json_pack("[o]", ch));
        if (r->p.include_usage) json_object_set_new(j, "usage", json_null());
        sse(r, j);
    }
    c->calls_sent = calls_reported(r, t);
}

static void observe_finish(srv_req *r, srv_choice *c) {
    if (c->finish == CAS_FINISH_ABORT || c->finish == CAS_FINISH_ERROR) return;
    double ttft = c->t_first > 0 ? c->t_first - r->t_arrive : -1;
    double tpot = c->completion_tokens > 1 && c->t_first > 0
                      ? (c->t_last - c->t_first) / (double)(c->completion_tokens - 1)
                      : -1;
    double e2e = c->t_last > 0 ? c->t_last - r->t_arrive : -1;
    cas_srv_metrics_observe(&r->s->metrics, ttft, tpot, e2e);
}

/* Folds one event into its choice; in streaming mode also renders chunks. */
static void consume(srv_req *r, srv_ev *e, int stream) {
    srv_choice *c = &r->choices[e->choice];
    int chat = r->p.route == CAS_SRV_ROUTE_CHAT;
    c->prompt_tokens = e->prompt_tokens;
    c->completion_tokens = e->completion_tokens;
    c->cached_tokens = e->cached_tokens;
    if (e->n_tokens > 0) {
        if (c->t_first == 0) c->t_first = e->t;
        c->t_last = e->t;
    }
    if (e->finish != CAS_FINISH_NONE) {
        c->finish = e->finish;
        if (c->t_last == 0) c->t_last = e->t;
    }
    json_t *lp = NULL;
    if (r->p.logprobs && e->n_tokens > 0) add_logprobs(r, c, e, stream ? &lp : &c->lp);
    if (!stream) {
        if (e->text_len && c->len + e->text_len + 1 > c->cap) {
            size_t cap = c->cap ? c->cap : 256;
            while (cap < c->len + e->text_len + 1) cap *= 2;
            char *p = realloc(c->text, cap);
            if (p) {
                c->text = p;
                c->cap = cap;
            }
        }
        if (c->len + e->text_len < c->cap) {
            memcpy(c->text + c->len, e->text, e->text_len);
            c->len += e->text_len;
        }
    } else {
        if (chat && !c->role_sent) {
            stream_chunk(r, c, "", 0, NULL, 1, NULL);
            c->role_sent = 1;
        }
        if (chat && r->p.parse_tool_calls) stream_tools(r, c, e, lp);
        else if (e->text_len || lp) stream_chunk(r, c, e->text, e->text_len, lp, 0, NULL);
        if (e->finish == CAS_FINISH_ERROR) {
            cas_srv_error err;
            cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "the engine failed on this request");
            char *js = cas_srv_error_json(&err);
            if (js) {
                out_put(r, "data: ", 6);
                out_put(r, js, strlen(js));
                out_put(r, "\n\n", 2);
                free(js);
            }
        } else if (e->finish != CAS_FINISH_NONE) {
            stream_chunk(r, c, chat ? NULL : "", 0, NULL, 0, choice_finish(r, e->finish, &c->tools));
        }
    }
    if (e->finish != CAS_FINISH_NONE) observe_finish(r, c);
}

/* The whole answer of a non-streaming request. */
static char *final_json(srv_req *r) {
    int chat = r->p.route == CAS_SRV_ROUTE_CHAT;
    json_t *j = envelope(r, chat ? "chat.completion" : "text_completion");
    json_t *choices = json_array();
    for (int32_t i = 0; i < r->n_choices; i++) {
        srv_choice *c = &r->choices[i];
        json_t *ch = json_pack("{s:i}", "index", (int)i);
        json_t *text = jstr(c->text ? c->text : "", c->len);
        if (chat && r->p.parse_tool_calls) {
            /* the same reader as a stream's, over the whole text */
            cas_srv_tools_feed(&c->tools, c->text ? c->text : "", c->len);
            cas_srv_tools_finish(&c->tools);
        }
        int32_t ncalls = chat && r->p.parse_tool_calls ? calls_reported(r, &c->tools) : 0;
        if (ncalls) {
            /* content: the text outside the calls, null when there is none (OpenAI's shape) */
            json_decref(text);
            json_t *calls = json_array();
            for (int32_t k = 0; k < ncalls; k++) json_array_append_new(calls, tool_call_json(&c->tools.calls[k], -1));
            json_t *content = c->tools.content_len ? jstr(c->tools.content, c->tools.content_len) : json_null();
            json_object_set_new(ch, "message", json_pack("{s:s,s:o,s:o}", "role", "assistant", "content", content,
                                                         "tool_calls", calls));
        } else if (chat) {
            json_object_set_new(ch, "message", json_pack("{s:s,s:o}", "role", "assistant", "content", text));
        } else {
            json_object_set_new(ch, "text", text);
        }
        json_object_set_new(ch, "logprobs", c->lp ? json_incref(c->lp) : json_null());
        const char *f = choice_finish(r, c->finish, &c->tools);
        json_object_set_new(ch, "finish_reason", json_string(f ? f : "stop"));
        json_array_append_new(choices, ch);
    }
    json_object_set_new(j, "choices", choices);
    json_object_set_new(j, "usage", usage_json(r));
    char *s = json_dumps(j, DUMP_FLAGS);
    json_decref(j);
    return s;
}

/* ---- responses ------------------------------------------------------------- */

static void add_replica_header(cas_server *s, struct MHD_Response *resp) {
    const char *name = atomic_load(&s->replica_name);
    if (name) MHD_add_response_header(resp, REPLICA_HEADER, name);
}

static enum MHD_Result send_text(srv_req *r, int status, const char *ctype, char *body_owned,
                                 const char *allow) {
    size_t n = body_owned ? strlen(body_owned) : 0;
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(n, body_owned ? body_owned : (char *)"", body_owned ? MHD_RESPMEM_MUST_FREE
                                                                                            : MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        free(body_owned);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    add_replica_header(r->s, resp);
    if (allow) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    if (status == 401) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (atomic_load(&r->s->draining)) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    timeout_on(r);
    enum MHD_Result ret = MHD_queue_response(r->conn, (unsigned)status, resp);
    MHD_destroy_response(resp);
    cas_srv_metrics_http(&r->s->metrics, status);
    return ret;
}

static enum MHD_Result send_error(srv_req *r, const cas_srv_error *err) {
    char *js = cas_srv_error_json(err);
    return send_text(r, err->status, "application/json", js, err->allow);
}

static enum MHD_Result send_json(srv_req *r, int status, json_t *j) {
    char *s = j ? json_dumps(j, DUMP_FLAGS) : NULL;
    json_decref(j);
    if (!s) {
        cas_srv_error err;
        cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
        return send_error(r, &err);
    }
    return send_text(r, status, "application/json", s, NULL);
}

/* libmicrohttpd pulls the stream through this, on the connection's thread. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    srv_req *r = cls;
    (void)pos;
    for (;;) {
        if (r->out_pos < r->out_len) {
            timeout_on(r);
            size_t n = r->out_len - r->out_pos < max ? r->out_len - r->out_pos : max;
            memcpy(buf, r->out + r->out_pos, n);
            r->out_pos += n;
            return (ssize_t)n;
        }
        r->out_len = r->out_pos = 0;
        if (r->finished_stream) return MHD_CONTENT_READER_END_OF_STREAM;
        int live;
        srv_ev *e = take_events(r, &live, 0);
        if (!e && live > 0) {
            int ps = peer_state(r);
            if (ps == 1) {
                r->gone = 1;
                return MHD_CONTENT_READER_END_WITH_ERROR;
            }
            if (ps == 2 && cas_now_s() - r->last_probe >= PROBE_EVERY_S) {
                /* half-closed or gone: a comment line tells (a closed socket answers with a reset) */
                r->last_probe = cas_now_s();
                out_put(r, ": ping\n\n", 8);
                continue;
            }
            timeout_off(r);
            e = take_events(r, &live, 1);
        }
        for (srv_ev *n; e; e = n) {
            n = e->next;
            consume(r, e, 1);
            free(e);
        }
        if (live == 0 && r->out_len == 0) {
            /* every choice ended and every event is rendered */
            pthread_mutex_lock(&r->mu);
            int drained = r->head == NULL;
            pthread_mutex_unlock(&r->mu);
            if (!drained) continue;
            if (r->p.include_usage) {
                json_t *j = envelope(r, r->p.route == CAS_SRV_ROUTE_CHAT ? "chat.completion.chunk" : "text_completion");
                json_object_set_new(j, "choices", json_array());
                json_object_set_new(j, "usage", usage_json(r));
                sse(r, j);
            }
            out_put(r, "data: [DONE]\n\n", 14);
            r->finished_stream = 1;
        }
    }
}

static void stream_free(void *cls) { req_release(cls); }

/* ---- errors and facts shared by routes -------------------------------------- */

static int model_known(const cas_server *s, const char *name) {
    return !strcmp(name, s->model_name) || (s->model_alias && !strcmp(name, s->model_alias));
}

static void model_not_found(const cas_server *s, cas_srv_error *err, const char *name) {
    cas_srv_error_set(err, 404, "invalid_request_error", "model_not_found", "model",
                      "The model `%.200s` does not exist (this server serves `%.200s`)", name, s->model_name);
}

static void shutting_down(cas_srv_error *err) {
    cas_srv_error_set(err, 503, "server_error", "server_shutting_down", NULL,
                      "The server is shutting down and takes no new requests");
}

static json_t *model_json(cas_server *s) {
    return json_pack("{s:s,s:s,s:I,s:s,s:s,s:n,s:i}", "id", s->model_name, "object", "model", "created",
                     (json_int_t)s->created, "owned_by", "cascade", "root", s->model_name, "parent",
                     "max_model_len", (int)s->ops.context_length(s->ops.ctx));
}

/* ---- generation requests --------------------------------------------------- */

static uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* n bytes from the kernel's random source: getrandom(2), else /dev/urandom.
 * Returns 0, or -1 when neither answered. */
static int random_bytes(void *p, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t k = getrandom((char *)p + got, n - got, 0);
        if (k < 0) {
            if (errno == EINTR) continue;
            break;
        }
        got += (size_t)k;
    }
    if (got == n) return 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    while (got < n) {
        ssize_t k = read(fd, (char *)p + got, n - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        got += (size_t)k;
    }
    close(fd);
    return got == n ? 0 : -1;
}

static atomic_uint_fast64_t id_fallback;

int cas_server_make_id(char *buf, size_t cap, const char *prefix) {
    unsigned char b[16];
    int rc = random_bytes(b, sizeof b);
    if (rc) { /* no random source: still distinct within this process */
        uint64_t c = atomic_fetch_add(&id_fallback, 1);
        uint64_t x = mix64(c ^ (uint64_t)(cas_now_s() * 1e9)), y = mix64(x ^ (uint64_t)getpid() ^ (c << 32));
        memcpy(b, &x, 8);
        memcpy(b + 8, &y, 8);
    }
    static const char hex[] = "0123456789abcdef";
    size_t pl = prefix ? strlen(prefix) : 0;
    if (!cap) return rc;
    size_t w = 0;
    for (size_t i = 0; i < pl && w + 1 < cap; i++) buf[w++] = prefix[i];
    for (size_t i = 0; i < sizeof b && w + 2 < cap; i++) {
        buf[w++] = hex[b[i] >> 4];
        buf[w++] = hex[b[i] & 15];
    }
    buf[w] = 0;
    return rc;
}

/* The prompt of a chat request: the model's template over roles and texts
 * (apply_chat), or, when the request has tools, tool calls or results, or
 * chat_template_kwargs, over its JSON context (apply_chat_json), refused
 * with a 400 naming the field when the template cannot take it: one not run
 * by the Jinja interpreter; tools for a template that never names `tools`
 * (the model would not see them) or that asks for calls in a format other
 * than <tool_call> blocks (they would come back as text). 0 with *text
 * (malloc'd), or -1 with err. */
static int render_chat(cas_server *s, const cas_srv_parsed *p, char **text, cas_srv_error *err) {
    *text = NULL;
    if (!p->chat_json) {
        if (s->ops.apply_chat(s->ops.ctx, p->msgs, p->n_msgs, text) == CAS_OK) return 0;
        cas_srv_error_set(err, 400, "invalid_request_error", NULL, "messages", "chat template: %s", cas_last_error());
        return -1;
    }
    const char *param = p->chat_json_param ? p->chat_json_param : "messages";
    if (!s->ops.apply_chat_json) {
        cas_srv_error_set(err, 400, "invalid_request_error", NULL, param,
                          "'%s' is not supported by this server: it renders chats from roles and texts only", param);
        return -1;
    }
    int format = p->tools_rendered && s->ops.chat_tools ? s->ops.chat_tools(s->ops.ctx) : -1;
    if (format == 0) {
        cas_srv_error_set(err, 400, "invalid_request_error", NULL, "tools",
                          "This model's chat template never uses 'tools', so the model would not see them: send "
                          "no tools (or tool_choice \"none\"), or serve the model with a template that renders "
                          "them (cascade serve --chat-template FILE)");
        return -1;
    }
    if (format == 2) {
        cas_srv_error_set(err, 400, "invalid_request_error", NULL, "tools",
                          "This model's chat template asks for tool calls in another format than <tool_call> "
                          "blocks (Hermes style: Qwen2.5, Qwen3, Hermes), the only one this server reads, so its "
                          "calls would come back as plain text: send no tools (or tool_choice \"none\"), or serve "
                          "the model with a template that asks for <tool_call> blocks (--chat-template FILE)");
        return -1;
    }
    cas_status st = s->ops.apply_chat_json(s->ops.ctx, p->chat_json, text);
    if (st == CAS_OK) return 0;
    if (st == CAS_ERR_UNSUPPORTED)
        cas_srv_error_set(err, 400, "invalid_request_error", NULL, param, "'%s' cannot be rendered: %s", param,
                          cas_last_error());
    else
        cas_srv_error_set(err, st == CAS_ERR_NOMEM ? 500 : 400, st == CAS_ERR_NOMEM ? "server_error" : "invalid_request_error",
                          NULL, "messages", "chat template: %s", cas_last_error());
    return -1;
}

static enum MHD_Result generate(srv_req *r) {
    cas_server *s = r->s;
    cas_srv_parsed *p = &r->p;
    cas_srv_error err;
    int chat = p->route == CAS_SRV_ROUTE_CHAT;
    char *chat_text = NULL;
    enum MHD_Result ret;

    if (p->model && !model_known(s, p->model)) {
        model_not_found(s, &err, p->model);
        return send_error(r, &err);
    }
    if (atomic_load(&s->aborting)) {
        shutting_down(&err);
        return send_error(r, &err);
    }
    if (chat) {
        if (render_chat(s, p, &chat_text, &err)) return send_error(r, &err);
        /* the rendered conversation becomes the one prompt */
        cas_srv_prompt *pr = calloc(1, sizeof *pr);
        if (!pr) {
            free(chat_text);
            cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
            return send_error(r, &err);
        }
        pr->text = chat_text;
        p->prompts = pr;
        p->n_prompts = 1;
    }
    int32_t ctx = s->ops.context_length(s->ops.ctx);
    int32_t *plen = calloc((size_t)p->n_prompts, sizeof *plen);
    if (!plen) {
        cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
        return send_error(r, &err);
    }
    for (int32_t i = 0; i < p->n_prompts; i++) {
        cas_srv_prompt *pr = &p->prompts[i];
        if (pr->text) {
            if (!pr->text[0]) {
                free(plen);
                cas_srv_error_set(&err, 400, "invalid_request_error", NULL, chat ? "messages" : "prompt",
                                  "The prompt is empty");
                return send_error(r, &err);
            }
            if (s->ops.count_tokens(s->ops.ctx, pr->text, &plen[i]) != CAS_OK) {
                free(plen);
                cas_srv_error_set(&err, 400, "invalid_request_error", NULL, chat ? "messages" : "prompt", "%s",
                                  cas_last_error());
                return send_error(r, &err);
            }
        } else {
            plen[i] = pr->n_tokens;
        }
        if (plen[i] >= ctx) {
            cas_srv_error_set(&err, 400, "invalid_request_error", "context_length_exceeded",
                              chat ? "messages" : "prompt",
                              "This model's maximum context length is %d tokens. However, your %s resulted in %d "
                              "tokens, which leaves no room for the completion. Please reduce the length of the %s.",
                              (int)ctx, chat ? "messages" : "prompt", (int)plen[i], chat ? "messages" : "prompt");
            free(plen);
            return send_error(r, &err);
        }
        if (p->max_tokens_set && (int64_t)plen[i] + p->sampling.max_tokens > ctx) {
            /* as vLLM and OpenAI: refused, not silently shortened */
            cas_srv_error_set(&err, 400, "invalid_request_error", "context_length_exceeded", "max_tokens",
                              "This model's maximum context length is %d tokens; the request asks for %lld (%d in "
                              "the %s and max_tokens %d). Reduce the %s or max_tokens.",
                              (int)ctx, (long long)plen[i] + p->sampling.max_tokens, (int)plen[i],
                              chat ? "messages" : "prompt", (int)p->sampling.max_tokens, chat ? "messages" : "prompt");
            free(plen);
            return send_error(r, &err);
        }
    }

    srv_choice *choices = calloc((size_t)(p->n_prompts * p->n), sizeof *choices);
    if (!choices) {
        free(plen);
        cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
        return send_error(r, &err);
    }
    pthread_mutex_lock(&r->mu); /* cas_server_abort_all may look at them from another thread */
    r->choices = choices;
    r->n_choices = p->n_prompts * p->n;
    pthread_mutex_unlock(&r->mu);
    cas_server_make_id(r->id, sizeof r->id, chat ? "chatcmpl-" : "cmpl-");
    r->created = (long)time(NULL);
    uint64_t seed = p->sampling.seed;
    if (!p->seed_set && random_bytes(&seed, sizeof seed))
        seed = mix64(atomic_fetch_add(&s->counter, 1) * 0x2545F4914F6CDD1Dull + (uint64_t)(cas_now_s() * 1e9));

    timeout_off(r); /* waiting on the engine is not the client's inactivity */

    cas_status st = CAS_OK;
    for (int32_t i = 0; i < r->n_choices; i++) {
        srv_choice *c = &r->choices[i];
        cas_srv_prompt *pr = &p->prompts[i / p->n];
        c->req = r;
        c->index = i;
        cas_engine_request er;
        memset(&er, 0, sizeof er);
        er.prompt = pr->text;
        er.tokens = pr->tokens;
        er.n_tokens = pr->n_tokens;
        er.sampling = p->sampling;
        er.sampling.seed = seed + (uint64_t)(i % p->n);
        if (!p->max_tokens_set) er.sampling.max_tokens = ctx - plen[i / p->n];
        er.sampling.logprobs = p->logprobs ? (p->top_logprobs > 0 ? p->top_logprobs : 1) : 0;
        c->k = er.sampling.logprobs;
        er.cb = on_event;
        er.user = c;
        pthread_mutex_lock(&r->mu);
        r->refs++;
        r->n_live++;
        pthread_mutex_unlock(&r->mu);
        live_add(s, 1);
        uint64_t id = 0;
        st = s->ops.submit(s->ops.ctx, &er, &id);
        if (st != CAS_OK) {
            pthread_mutex_lock(&r->mu);
            r->refs--;
            r->n_live--;
            pthread_mutex_unlock(&r->mu);
            live_add(s, -1);
            break;
        }
        pthread_mutex_lock(&r->mu);
        c->id = id;
        c->submitted = 1;
        pthread_mutex_unlock(&r->mu);
    }
    free(plen);
    if (st != CAS_OK) {
        cas_srv_error_set(&err, st == CAS_ERR_INVALID ? 400 : 503, st == CAS_ERR_INVALID ? "invalid_request_error" : "server_error",
                          NULL, NULL, "%s", cas_last_error());
        abort_all(r);
        return send_error(r, &err);
    }
    /* cas_server_abort_all sets the flag before it walks the admitted
     * requests: it saw these choices, or this sees the flag */
    if (atomic_load(&s->aborting)) abort_all(r);

    if (p->stream) {
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, r, stream_free);
        if (!resp) {
            abort_all(r);
            return MHD_NO;
        }
        pthread_mutex_lock(&r->mu);
        r->refs++;
        pthread_mutex_unlock(&r->mu);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream; charset=utf-8");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
        add_replica_header(s, resp);
        if (atomic_load(&s->draining)) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
        ret = MHD_queue_response(r->conn, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp);
        cas_srv_metrics_http(&s->metrics, 200);
        return ret;
    }

    /* non-streaming: wait here (this connection's own thread) */
    for (;;) {
        int live;
        srv_ev *e = take_events(r, &live, 1);
        for (srv_ev *n; e; e = n) {
            n = e->next;
            consume(r, e, 0);
            free(e);
        }
        if (live == 0) {
            pthread_mutex_lock(&r->mu);
            int drained = r->head == NULL;
            pthread_mutex_unlock(&r->mu);
            if (drained) break;
            continue;
        }
        if (peer_state(r)) { /* no write can tell a half-close from a close here */
            r->gone = 1;
            abort_all(r);
            return MHD_NO;
        }
    }
    for (int32_t i = 0; i < r->n_choices; i++)
        if (r->choices[i].finish == CAS_FINISH_ERROR) {
            cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "the engine failed on this request");
            return send_error(r, &err);
        }
    char *body = final_json(r);
    if (!body) {
        cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
        return send_error(r, &err);
    }
    return send_text(r, 200, "application/json", body, NULL);
}

/* ---- tokenizer routes (vLLM's /tokenize and /detokenize) ----------------------- */

/* The body as a JSON object, or NULL with *err filled. */
static json_t *body_object(srv_req *r, cas_srv_error *err) {
    json_error_t jerr;
    json_t *o = r->body_len ? json_loadb(r->body, r->body_len, 0, &jerr) : NULL;
    if (!o) {
        if (r->body_len)
            cas_srv_error_set(err, 400, "invalid_request_error", "invalid_json", NULL,
                              "Invalid JSON body: %s (line %d, column %d)", jerr.text, jerr.line, jerr.column);
        else
            cas_srv_error_set(err, 400, "invalid_request_error", "invalid_json", NULL, "The request needs a JSON body");
        return NULL;
    }
    if (!json_is_object(o)) {
        json_decref(o);
        cas_srv_error_set(err, 400, "invalid_request_error", "invalid_json", NULL,
                          "The request body must be a JSON object");
        return NULL;
    }
    return o;
}

/* The optional boolean o[key] into *v; -1 with *err filled when it is not one. */
static int opt_bool(json_t *o, const char *key, int *v, cas_srv_error *err) {
    json_t *j = json_object_get(o, key);
    if (!j || json_is_null(j)) return 0;
    if (!json_is_boolean(j)) {
        cas_srv_error_set(err, 400, "invalid_request_error", NULL, key, "'%s' must be a boolean", key);
        return -1;
    }
    *v = json_is_true(j);
    return 0;
}

/* The optional "model" field: absent, or a string naming this model. */
static int check_model_field(cas_server *s, json_t *o, cas_srv_error *err) {
    json_t *m = json_object_get(o, "model");
    if (!m || json_is_null(m)) return 0;
    if (!json_is_string(m)) {
        cas_srv_error_set(err, 400, "invalid_request_error", NULL, "model", "'model' must be a string");
        return -1;
    }
    if (!model_known(s, json_string_value(m))) {
        model_not_found(s, err, json_string_value(m));
        return -1;
    }
    return 0;
}

/* POST /tokenize {"model", "prompt" | "messages", "add_special_tokens",
 * "add_generation_prompt", "return_token_strs", and with messages "tools",
 * "tool_choice", "parallel_tool_calls", "chat_template_kwargs"} ->
 * {"count", "max_model_len", "tokens", "token_strs"}. Messages and the tool
 * fields are validated by the chat parser and rendered by the chat template
 * (render_chat), as a chat request's would be. */
static enum MHD_Result tokenize(srv_req *r) {
    cas_server *s = r->s;
    cas_srv_error err;
    char *text = NULL;
    int32_t *ids = NULL, n = 0;
    json_t *o = body_object(r, &err), *out = NULL;
    if (!o) return send_error(r, &err);
    if (!s->tokenize) {
        cas_srv_error_set(&err, 501, "server_error", "not_implemented", NULL, "This server cannot tokenize");
        goto fail;
    }
    if (check_model_field(s, o, &err)) goto fail;
    json_t *prompt = json_object_get(o, "prompt"), *msgs = json_object_get(o, "messages");
    if (!prompt == !msgs) {
        cas_srv_error_set(&err, 400, "invalid_request_error", NULL, prompt ? "messages" : "prompt",
                          "Give either 'prompt' (a string) or 'messages'");
        goto fail;
    }
    int add_special = prompt != NULL, gen_prompt = 1, cont = 0, strs = 0;
    if (opt_bool(o, "add_special_tokens", &add_special, &err) || opt_bool(o, "add_generation_prompt", &gen_prompt, &err) ||
        opt_bool(o, "continue_final_message", &cont, &err) || opt_bool(o, "return_token_strs", &strs, &err))
        goto fail;
    /* the chat template always ends with the assistant's turn opened */
    if (msgs && (!gen_prompt || cont)) {
        cas_srv_error_set(&err, 400, "invalid_request_error", "unsupported_parameter",
                          !gen_prompt ? "add_generation_prompt" : "continue_final_message",
                          "Only add_generation_prompt=true and continue_final_message=false are supported");
        goto fail;
    }
    static const char *const refused[] = {"chat_template", "mm_processor_kwargs"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        json_t *j = json_object_get(o, refused[i]);
        if (j && !json_is_null(j)) {
            cas_srv_error_set(&err, 400, "invalid_request_error", "unsupported_parameter", refused[i],
                              "'%s' is not supported", refused[i]);
            goto fail;
        }
    }
    if (prompt) {
        if (!json_is_string(prompt)) {
            cas_srv_error_set(&err, 400, "invalid_request_error", NULL, "prompt", "'prompt' must be a string");
            goto fail;
        }
        text = strdup(json_string_value(prompt));
    } else {
        /* the chat parser validates the messages and the tool fields exactly as for /v1/chat/completions */
        json_t *only = json_pack("{s:O}", "messages", msgs);
        static const char *const chat_fields[] = {"tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs"};
        for (size_t i = 0; only && i < sizeof chat_fields / sizeof chat_fields[0]; i++) {
            json_t *f = json_object_get(o, chat_fields[i]);
            if (f) json_object_set(only, chat_fields[i], f);
        }
        char *body = only ? json_dumps(only, JSON_COMPACT) : NULL;
        json_decref(only);
        cas_srv_parsed p;
        if (!body) {
            cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
            goto fail;
        }
        cas_srv_limits lim = s->lim;
        lim.api_key = NULL;
        cas_srv_route rt = cas_srv_parse(&lim, "POST", "/v1/chat/completions", NULL, body, strlen(body), &p, &err);
        free(body);
        if (rt == CAS_SRV_ROUTE_NONE) goto fail;
        int rc = render_chat(s, &p, &text, &err);
        cas_srv_parsed_free(&p);
        if (rc) goto fail;
    }
    if (!text || s->tokenize(s->tokenize_ctx, text, add_special, &ids, &n) != CAS_OK) {
        cas_srv_error_set(&err, text ? 400 : 500, text ? "invalid_request_error" : "server_error", NULL,
                          text ? (prompt ? "prompt" : "messages") : NULL, "%s", text ? cas_last_error() : "out of memory");
        goto fail;
    }
    json_t *toks = json_array(), *tstrs = strs ? json_array() : json_null();
    for (int32_t i = 0; i < n; i++) {
        json_array_append_new(toks, json_integer(ids[i]));
        if (strs) json_array_append_new(tstrs, token_str(s, ids[i], NULL));
    }
    out = json_pack("{s:i,s:i,s:o,s:o}", "count", (int)n, "max_model_len", (int)s->ops.context_length(s->ops.ctx),
                    "tokens", toks, "token_strs", tstrs);
    free(ids);
    free(text);
    json_decref(o);
    return send_json(r, 200, out);
fail:
    free(ids);
    free(text);
    json_decref(o);
    return send_error(r, &err);
}

/* POST /detokenize {"model", "tokens": [ids]} -> {"prompt": text}; special
 * tokens are rendered as their text, as vLLM does. */
static enum MHD_Result detokenize(srv_req *r) {
    cas_server *s = r->s;
    cas_srv_error err;
    json_t *o = body_object(r, &err);
    if (!o) return send_error(r, &err);
    char *text = NULL;
    size_t len = 0;
    if (check_model_field(s, o, &err)) goto fail;
    if (!s->ops.token_text) {
        cas_srv_error_set(&err, 501, "server_error", "not_implemented", NULL, "This server cannot detokenize");
        goto fail;
    }
    json_t *toks = json_object_get(o, "tokens");
    if (!json_is_array(toks)) {
        cas_srv_error_set(&err, 400, "invalid_request_error", NULL, "tokens", "'tokens' must be an array of token ids");
        goto fail;
    }
    size_t cap = 64;
    text = malloc(cap);
    for (size_t i = 0; text && i < json_array_size(toks); i++) {
        json_t *t = json_array_get(toks, i);
        json_int_t id = json_is_integer(t) ? json_integer_value(t) : -1;
        size_t k = 0;
        const char *piece = id >= 0 && id <= INT32_MAX ? s->ops.token_text(s->ops.ctx, (int32_t)id, &k) : NULL;
        if (!piece) {
            cas_srv_error_set(&err, 400, "invalid_request_error", NULL, "tokens",
                              "tokens[%zu] is not a token id of this model", i);
            goto fail;
        }
        if (len + k + 1 > cap) {
            while (len + k + 1 > cap) cap *= 2;
            char *p = realloc(text, cap);
            if (!p) {
                free(text);
                text = NULL;
                break;
            }
            text = p;
        }
        memcpy(text + len, piece, k);
        len += k;
    }
    if (!text) {
        cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    json_decref(o);
    json_t *out = json_pack("{s:o}", "prompt", jstr(text, len));
    free(text);
    return send_json(r, 200, out);
fail:
    free(text);
    json_decref(o);
    return send_error(r, &err);
}

/* ---- dispatch ---------------------------------------------------------------- */

/* Routes served here, before the parser (which knows the OpenAI routes):
 * vLLM's extras. Returns 1 and answers when the path is one of them. */
static int extra_route(srv_req *r, const char *url, const char *method, enum MHD_Result *ret) {
    cas_server *s = r->s;
    cas_srv_error err;
    size_t plen = strcspn(url, "?");
    static const char models[] = "/v1/models/";
    const size_t mlen = sizeof models - 1;
    const char *want = NULL; /* the one method the route takes */
    int which = 0;
    if (plen == 9 && !strncmp(url, "/tokenize", 9)) want = "POST", which = 1;
    else if (plen == 11 && !strncmp(url, "/detokenize", 11)) want = "POST", which = 2;
    else if (plen == 8 && !strncmp(url, "/version", 8)) want = "GET", which = 3;
    else if (plen > mlen && !strncmp(url, models, mlen)) want = "GET", which = 4;
    if (!which) return 0;
    if (strcmp(method, want)) {
        cas_srv_error_set(&err, 405, "invalid_request_error", "method_not_allowed", NULL,
                          "Method %.16s not allowed on %.200s (use %s)", method, url, want);
        err.allow = want;
        *ret = send_error(r, &err);
        return 1;
    }
    switch (which) {
    case 1: *ret = tokenize(r); break;
    case 2: *ret = detokenize(r); break;
    case 3: *ret = send_json(r, 200, json_pack("{s:s}", "version", CAS_VERSION_STRING)); break;
    default: {
        /* the parser's own API-key check, through the route it knows */
        cas_srv_parsed p;
        const char *auth = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
        if (cas_srv_parse(&s->lim, "GET", "/v1/models", auth, NULL, 0, &p, &err) == CAS_SRV_ROUTE_NONE) {
            *ret = send_error(r, &err);
            break;
        }
        cas_srv_parsed_free(&p);
        char id[256];
        snprintf(id, sizeof id, "%.*s", (int)(plen - mlen), url + mlen);
        if (!model_known(s, id)) {
            model_not_found(s, &err, id);
            *ret = send_error(r, &err);
        } else {
            *ret = send_json(r, 200, model_json(s));
        }
    }
    }
    return 1;
}

static enum MHD_Result handle(srv_req *r, const char *url, const char *method) {
    cas_server *s = r->s;
    cas_srv_error err;
    if (!r->admitted && !(strcspn(url, "?") == 8 && !strncmp(url, "/metrics", 8))) {
        /* draining: everything but /metrics gets 503, /health included */
        shutting_down(&err);
        return send_error(r, &err);
    }
    enum MHD_Result ret;
    if (extra_route(r, url, method, &ret)) return ret;
    const char *auth = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    cas_srv_route route = cas_srv_parse(&s->lim, method, url, auth, r->body, r->body_len, &r->p, &err);
    switch (route) {
    case CAS_SRV_ROUTE_NONE: return send_error(r, &err);
    case CAS_SRV_ROUTE_HEALTH: return send_json(r, 200, json_pack("{s:s}", "status", "ok"));
    case CAS_SRV_ROUTE_MODELS: return send_json(r, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", model_json(s)));
    case CAS_SRV_ROUTE_METRICS: {
        cas_engine_stats st;
        memset(&st, 0, sizeof st);
        s->ops.get_stats(s->ops.ctx, &st);
        char *text = cas_srv_metrics_text(&s->metrics, &st);
        if (!text) {
            cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
            return send_error(r, &err);
        }
        return send_text(r, 200, "text/plain; version=0.0.4; charset=utf-8", text, NULL);
    }
    case CAS_SRV_ROUTE_COMPLETIONS:
    case CAS_SRV_ROUTE_CHAT: return generate(r);
    }
    return MHD_NO;
}

static enum MHD_Result add_header_bytes(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind;
    *(size_t *)cls += strlen(key) + (value ? strlen(value) : 0) + 4; /* ": " and CRLF */
    return MHD_YES;
}

/* A request's headers are in: its connection is busy (no header deadline)
 * and, unless the server drains, the request is admitted. */
static void request_begins(cas_server *s, srv_req *r) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    r->sc = ci ? ci->socket_context : NULL;
    if (r->sc) {
        pthread_mutex_lock(&s->conn_mu);
        r->sc->busy = 1;
        pthread_mutex_unlock(&s->conn_mu);
    }
    pthread_mutex_lock(&s->mu);
    if (!atomic_load(&s->draining)) {
        r->admitted = 1;
        s->active++;
        r->adm_next = s->admitted;
        if (s->admitted) s->admitted->adm_prev = r;
        s->admitted = r;
    }
    pthread_mutex_unlock(&s->mu);
}

static void request_ends(cas_server *s, srv_req *r) {
    if (r->sc) {
        pthread_mutex_lock(&s->conn_mu);
        r->sc->busy = 0;
        r->sc->since = cas_now_s();
        pthread_mutex_unlock(&s->conn_mu);
    }
    if (!r->admitted) return;
    pthread_mutex_lock(&s->mu);
    if (r->adm_prev) r->adm_prev->adm_next = r->adm_next;
    else s->admitted = r->adm_next;
    if (r->adm_next) r->adm_next->adm_prev = r->adm_prev;
    r->admitted = 0;
    s->active--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_size, void **con_cls) {
    cas_server *s = cls;
    srv_req *r = *con_cls;
    (void)version;
    if (!r) {
        if (!(r = req_new(s, conn))) return MHD_NO;
        *con_cls = r;
        request_begins(s, r);
        size_t hbytes = strlen(url);
        MHD_get_connection_values(conn, MHD_HEADER_KIND, add_header_bytes, &hbytes);
        MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, add_header_bytes, &hbytes);
        if (hbytes > MAX_HEADER_BYTES) {
            /* libmicrohttpd's buffer holds more than this, so that this
             * answer, not its HTML page, is what most clients see */
            cas_srv_error err;
            cas_srv_error_set(&err, 431, "invalid_request_error", "request_header_too_large", NULL,
                              "Request headers of %zu bytes exceed the limit of %d bytes", hbytes, MAX_HEADER_BYTES);
            return send_error(r, &err);
        }
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        unsigned long long len = cl ? strtoull(cl, NULL, 10) : 0;
        if (s->lim.max_body_bytes && len > s->lim.max_body_bytes)
            r->too_large = 1; /* read and drop the body, then answer 413: most clients only read after sending */
        if (r->too_large && len > s->lim.max_body_bytes + ((unsigned long long)64 << 20)) {
            /* too much to drain: answer before reading the body; libmicrohttpd then closes the connection */
            cas_srv_error err;
            cas_srv_error_set(&err, 413, "invalid_request_error", "request_too_large", NULL,
                              "Request body of %s bytes exceeds the limit of %zu bytes", cl, s->lim.max_body_bytes);
            return send_error(r, &err);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (r->too_large) return MHD_YES;
        if (s->lim.max_body_bytes && r->body_len + n > s->lim.max_body_bytes) {
            r->too_large = 1; /* chunked body over the limit: read and drop the rest, then 413 */
            free(r->body);
            r->body = NULL;
            r->body_len = r->body_cap = 0;
            return MHD_YES;
        }
        if (r->body_len + n + 1 > r->body_cap) {
            size_t cap = r->body_cap ? r->body_cap : 1024;
            while (cap < r->body_len + n + 1) cap *= 2;
            char *b = realloc(r->body, cap);
            if (!b) return MHD_NO;
            r->body = b;
            r->body_cap = cap;
        }
        memcpy(r->body + r->body_len, upload_data, n);
        r->body_len += n;
        r->body[r->body_len] = 0;
        return MHD_YES;
    }
    if (r->too_large) {
        cas_srv_error err;
        cas_srv_error_set(&err, 413, "invalid_request_error", "request_too_large", NULL,
                          "Request body exceeds the limit of %zu bytes", s->lim.max_body_bytes);
        return send_error(r, &err);
    }
    return handle(r, url, method);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    cas_server *s = cls;
    srv_req *r = *con_cls;
    if (!r) return;
    *con_cls = NULL;
    abort_all(r); /* a no-op for choices that finished */
    int early = 0;
    for (int32_t i = 0; i < r->n_choices; i++) {
        pthread_mutex_lock(&r->mu);
        early |= r->choices[i].submitted && !r->choices[i].engine_done;
        pthread_mutex_unlock(&r->mu);
    }
    if (early || (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK && r->gone)) {
        pthread_mutex_lock(&s->metrics.mu);
        s->metrics.requests_cancelled++;
        pthread_mutex_unlock(&s->metrics.mu);
    }
    MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, s->idle_timeout);
    request_ends(s, r);
    req_release(r);
}

/* ---- connections: the header deadline and room at the limit ------------------ */

/* Shuts a connection down (libmicrohttpd's thread then reads the end and
 * closes it). Under conn_mu: the fd stays open until the CLOSED
 * notification, which takes conn_mu, so it cannot be another socket's. */
static void conn_shut(srv_conn *c) {
    if (c->shut || c->fd < 0) return;
    c->shut = 1;
    shutdown(c->fd, SHUT_RDWR);
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    cas_server *s = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        srv_conn *c = calloc(1, sizeof *c);
        if (!c) return; /* untracked: only libmicrohttpd's timeout applies to it */
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        c->fd = ci ? ci->connect_fd : -1;
        c->since = cas_now_s();
        int evicted = 0;
        pthread_mutex_lock(&s->conn_mu);
        c->prev = s->conns_tail;
        if (s->conns_tail) s->conns_tail->next = c;
        else s->conns = c;
        s->conns_tail = c;
        s->n_conns++;
        if (s->n_conns > s->max_conns - s->headroom) {
            /* into the last free connections: free one, the oldest still
             * waiting for its headers (a real client sends them at once).
             * libmicrohttpd refuses a connection at the limit (accepts and
             * closes it), so a few stay free for the moments an evicted
             * connection takes to close. */
            for (srv_conn *o = s->conns; o && o != c; o = o->next)
                if (!o->busy && !o->shut) {
                    conn_shut(o);
                    evicted = 1;
                    break;
                }
        }
        pthread_mutex_unlock(&s->conn_mu);
        *socket_context = c;
        pthread_mutex_lock(&s->metrics.mu);
        s->metrics.conns_open++;
        s->metrics.conns_evicted += (uint64_t)evicted;
        pthread_mutex_unlock(&s->metrics.mu);
    } else if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
        srv_conn *c = *socket_context;
        if (!c) return;
        *socket_context = NULL;
        pthread_mutex_lock(&s->conn_mu);
        if (c->prev) c->prev->next = c->next;
        else s->conns = c->next;
        if (c->next) c->next->prev = c->prev;
        else s->conns_tail = c->prev;
        s->n_conns--;
        pthread_mutex_unlock(&s->conn_mu);
        free(c);
        pthread_mutex_lock(&s->metrics.mu);
        s->metrics.conns_open--;
        pthread_mutex_unlock(&s->metrics.mu);
    }
}

/* ---- the gate's side of the HTTP layer --------------------------------------- */

static void gate_admit(void *ctx, int fd, const struct sockaddr *addr, unsigned addr_len) {
    cas_server *s = ctx;
    /* libmicrohttpd closes the socket itself if it cannot take it */
    if (MHD_add_connection(s->daemon, fd, addr, (socklen_t)addr_len) != MHD_YES)
        cas_log(CAS_LOG_INFO, "http: a connection was refused after its head (%s)", strerror(errno));
}

static int64_t gate_open_conns(void *ctx) {
    cas_server *s = ctx;
    pthread_mutex_lock(&s->conn_mu);
    int64_t n = s->n_conns;
    pthread_mutex_unlock(&s->conn_mu);
    return n;
}

static void gate_event(void *ctx, cas_srv_gate_event what, int status) {
    cas_server *s = ctx;
    if (what == CAS_SRV_GATE_BAD || what == CAS_SRV_GATE_REFUSED) {
        cas_srv_metrics_http(&s->metrics, status);
        return;
    }
    pthread_mutex_lock(&s->metrics.mu);
    if (what == CAS_SRV_GATE_EVICTED) s->metrics.conns_evicted++;
    else s->metrics.conns_header_timeout++;
    pthread_mutex_unlock(&s->metrics.mu);
}

/* Every WATCH_SLICE: shuts down connections whose request headers did not
 * come within header_timeout. */
static void *watchdog_main(void *arg) {
    cas_server *s = arg;
    pthread_mutex_lock(&s->conn_mu);
    while (!s->watch_stop) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += WATCH_SLICE_NS;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->conn_cv, &s->conn_mu, &ts);
        if (s->watch_stop || s->header_timeout <= 0) continue;
        double now = cas_now_s();
        uint64_t n = 0;
        for (srv_conn *c = s->conns; c; c = c->next)
            if (!c->busy && !c->shut && now - c->since > s->header_timeout) {
                conn_shut(c);
                n++;
            }
        if (n) {
            pthread_mutex_lock(&s->metrics.mu);
            s->metrics.conns_header_timeout += n;
            pthread_mutex_unlock(&s->metrics.mu);
        }
    }
    pthread_mutex_unlock(&s->conn_mu);
    return NULL;
}

/* ---- drain -------------------------------------------------------------------- */

void cas_server_drain(cas_server *s) {
    if (!s) return;
    atomic_store(&s->draining, 1);
    pthread_mutex_lock(&s->metrics.mu);
    s->metrics.draining = 1;
    pthread_mutex_unlock(&s->metrics.mu);
}

int64_t cas_server_active(cas_server *s) {
    if (!s) return 0;
    pthread_mutex_lock(&s->mu);
    int64_t n = s->active;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void cas_server_abort_all(cas_server *s) {
    if (!s) return;
    cas_server_drain(s);
    atomic_store(&s->aborting, 1);
    /* take a reference to each admitted request, then abort outside s->mu */
    pthread_mutex_lock(&s->mu);
    int64_t n = 0;
    for (srv_req *r = s->admitted; r; r = r->adm_next) n++;
    srv_req **all = n ? malloc((size_t)n * sizeof *all) : NULL;
    int64_t k = 0;
    for (srv_req *r = s->admitted; r && all; r = r->adm_next) {
        pthread_mutex_lock(&r->mu);
        r->refs++;
        pthread_mutex_unlock(&r->mu);
        all[k++] = r;
    }
    pthread_mutex_unlock(&s->mu);
    for (int64_t i = 0; i < k; i++) {
        abort_all(all[i]);
        req_release(all[i]);
    }
    free(all);
}

/* ---- create and destroy ------------------------------------------------------ */

static char *dup_or_null(const char *s) {
    if (!s) return NULL;
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

cas_server_opts cas_server_opts_default(void) {
    cas_server_opts o;
    memset(&o, 0, sizeof o);
    o.host = "127.0.0.1";
    o.port = 8000;
    return o;
}

/* "HOST:PORT" as bound ("[ADDR]:PORT" for IPv6); a wildcard address names
 * no machine, so the host name stands in for it. malloc'd, NULL on failure. */
static char *default_replica_name(const char *host, unsigned ipv6, int32_t port) {
    char hn[256];
    const char *h = host;
    if (!strcmp(host, "0.0.0.0") || !strcmp(host, "::")) {
        if (gethostname(hn, sizeof hn) == 0) {
            hn[sizeof hn - 1] = 0;
            h = hn;
            ipv6 = 0;
        }
    }
    size_t cap = strlen(h) + 16;
    char *name = malloc(cap);
    if (name) snprintf(name, cap, ipv6 ? "[%s]:%d" : "%s:%d", h, (int)port);
    return name;
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    if (!cas_log_enabled(CAS_LOG_INFO)) return;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    cas_log(CAS_LOG_INFO, "http: %s", msg);
}

cas_status cas_srv_create_with_ops(cas_server **out, const cas_srv_engine_ops *ops, const cas_server_opts *opts) {
    *out = NULL;
    cas_server_opts o = opts ? *opts : cas_server_opts_default();
    if (!ops || !ops->submit || !ops->abort || !ops->get_stats || !ops->model_name || !ops->context_length ||
        !ops->apply_chat || !ops->count_tokens)
        return cas_error(CAS_ERR_INVALID, "server: incomplete engine table");
    if (o.port < 0 || o.port > 65535) return cas_error(CAS_ERR_INVALID, "server: port %d out of range", (int)o.port);
    const char *host = o.host ? o.host : "127.0.0.1";

    struct sockaddr_storage addr;
    memset(&addr, 0, sizeof addr);
    unsigned ipv6 = 0;
    struct sockaddr_in *a4 = (struct sockaddr_in *)&addr;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&addr;
    if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)o.port);
    } else if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)o.port);
        ipv6 = MHD_USE_IPv6;
    } else {
        return cas_error(CAS_ERR_INVALID, "server: host '%s' is not an IPv4 or IPv6 address", host);
    }

    cas_server *s = calloc(1, sizeof *s);
    if (!s) return cas_error(CAS_ERR_NOMEM, "server: out of memory");
    s->listen_fd = -1;
    s->ops = *ops;
    s->api_key = dup_or_null(o.api_key && o.api_key[0] ? o.api_key : NULL);
    s->model_name = dup_or_null(o.model_name ? o.model_name : ops->model_name(ops->ctx));
    s->model_alias = dup_or_null(o.model_alias);
    if (!s->model_name) s->model_name = dup_or_null("cascade");
    s->lim.api_key = s->api_key;
    s->lim.max_body_bytes = o.max_body_bytes ? o.max_body_bytes : (size_t)8 << 20;
    s->lim.max_n = o.max_n > 0 ? o.max_n : 16;
    s->created = (long)time(NULL);
    s->tokenize = o.tokenize;
    s->tokenize_ctx = o.tokenize_ctx;
    cas_srv_metrics_init(&s->metrics);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    atomic_init(&s->closing, 0);
    atomic_init(&s->draining, 0);
    atomic_init(&s->aborting, 0);
    atomic_init(&s->replica_name, NULL);
    atomic_init(&s->counter, (uint64_t)time(NULL));

    /* Connections: one thread and one descriptor each; the open-file limit
     * keeps room for the model, the listening socket and the engine. */
    long room = 1L << 30;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) room = (long)rl.rlim_cur - 64;
    if (room < 4) room = 4;
    long maxc = o.max_connections > 0 ? o.max_connections : 1024;
    if (maxc > room) {
        if (o.max_connections > 0)
            cas_log(CAS_LOG_WARN, "server: %ld connections do not fit the open-file limit; %ld instead", maxc, room);
        maxc = room;
    }
    s->max_conns = (int32_t)maxc;
    s->headroom = s->max_conns / 16 < 1 ? 1 : s->max_conns / 16 > 64 ? 64 : s->max_conns / 16;
    unsigned per_ip = o.max_connections_per_ip < 0 ? 0u : o.max_connections_per_ip > 0 ? (unsigned)o.max_connections_per_ip : 256u;
    s->header_timeout = o.header_timeout_s < 0 ? 0.0 : o.header_timeout_s > 0 ? o.header_timeout_s : 10.0;
    double idle = o.idle_timeout_s < 0 ? 0.0 : o.idle_timeout_s > 0 ? o.idle_timeout_s : 30.0;
    s->idle_timeout = idle > 0 ? (unsigned)(idle + 0.999) : 0u; /* whole seconds, at least 1 */
    pthread_mutex_init(&s->conn_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->conn_cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&s->watchdog, NULL, watchdog_main, s) != 0) {
        cas_server_destroy(s);
        return cas_error(CAS_ERR_IO, "server: cannot start a thread");
    }
    s->watch_started = 1;

    /* the replica's name goes into a header line: no control characters */
    for (const char *c = o.replica_name ? o.replica_name : ""; *c; c++) {
        if ((unsigned char)*c < 0x20 || *c == 0x7f) {
            cas_server_destroy(s);
            return cas_error(CAS_ERR_INVALID, "server: the replica name has a control character");
        }
    }
    /* the listening socket is ours (the gate's); libmicrohttpd gets connections whose head passed */
    s->listen_fd = socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    socklen_t alen = addr.ss_family == AF_INET6 ? (socklen_t)sizeof(struct sockaddr_in6) : (socklen_t)sizeof(struct sockaddr_in);
    if (s->listen_fd < 0 || setsockopt(s->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
        bind(s->listen_fd, (struct sockaddr *)&addr, alen) || listen(s->listen_fd, 1024)) {
        int e = errno;
        cas_server_destroy(s);
        return cas_error(CAS_ERR_IO, "server: cannot listen on %s:%d (%s)", host, (int)o.port, strerror(e));
    }
    struct sockaddr_storage bound;
    socklen_t blen = sizeof bound;
    s->port = o.port;
    if (getsockname(s->listen_fd, (struct sockaddr *)&bound, &blen) == 0)
        s->port = (int32_t)ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                             : ((struct sockaddr_in *)&bound)->sin_port);
    /* the replica's name (the port is known now, port 0 included), before any request */
    char *name = o.replica_name && o.replica_name[0] ? dup_or_null(o.replica_name)
                                                     : default_replica_name(host, ipv6, s->port);
    if (!name) {
        cas_server_destroy(s);
        return cas_error(CAS_ERR_NOMEM, "server: out of memory");
    }
    atomic_store(&s->replica_name, name);
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | ipv6 |
                     MHD_USE_ERROR_LOG | MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC;
    s->daemon = MHD_start_daemon(
        flags, 0, NULL, NULL, on_request, s, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, s, MHD_OPTION_CONNECTION_LIMIT, (unsigned)s->max_conns,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, per_ip, MHD_OPTION_CONNECTION_TIMEOUT, s->idle_timeout,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)CONN_MEMORY, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
        MHD_OPTION_END);
    if (!s->daemon) {
        int e = errno;
        cas_server_destroy(s);
        return cas_error(CAS_ERR_IO, "server: cannot start the HTTP daemon (%s)", strerror(e));
    }
    cas_srv_gate_opts go = {s->listen_fd, s->max_conns, s->headroom, (int32_t)per_ip, s->header_timeout,
                            MAX_HEADER_BYTES, name, gate_admit, gate_open_conns, gate_event, s};
    cas_status gst = cas_srv_gate_start(&s->gate, &go);
    if (gst) {
        cas_server_destroy(s);
        return gst;
    }
    *out = s;
    return CAS_OK;
}

int32_t cas_server_port(const cas_server *s) { return s ? s->port : 0; }

const char *cas_server_replica_name(cas_server *s) { return s ? atomic_load(&s->replica_name) : NULL; }

void cas_server_destroy(cas_server *s) {
    if (!s) return;
    atomic_store(&s->closing, 1);
    if (s->watch_started) {
        pthread_mutex_lock(&s->conn_mu);
        s->watch_stop = 1;
        pthread_cond_signal(&s->conn_cv);
        pthread_mutex_unlock(&s->conn_mu);
        pthread_join(s->watchdog, NULL);
        s->watch_started = 0;
    }
    cas_srv_gate_stop(s->gate); /* no new connections */
    s->gate = NULL;
    if (s->daemon) MHD_stop_daemon(s->daemon); /* joins connection threads; on_completed aborts their requests */
    if (s->listen_fd >= 0) close(s->listen_fd);
    s->listen_fd = -1;
    /* wait for the engine's final events, which still point into our requests */
    pthread_mutex_lock(&s->mu);
    double deadline = cas_now_s() + 10.0;
    while (s->live > 0 && cas_now_s() < deadline) {
        pthread_mutex_unlock(&s->mu);
        struct timespec ts = {0, 10000000L};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&s->mu);
    }
    int64_t left = s->live;
    pthread_mutex_unlock(&s->mu);
    if (left > 0) {
        /* the engine is not delivering (stopped?): leak rather than free what it may still touch */
        cas_log(CAS_LOG_WARN, "server: %lld engine requests still live at shutdown", (long long)left);
        return;
    }
    cas_srv_metrics_destroy(&s->metrics);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->conn_cv);
    pthread_mutex_destroy(&s->conn_mu);
    free(s->api_key);
    free(s->model_name);
    free(s->model_alias);
    free(atomic_load(&s->replica_name));
    free(s);
}
