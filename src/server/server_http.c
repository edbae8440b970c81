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
 * hang-up (POLLRDHUP), so a client that goes away is noticed within 50 ms
 * even when no token is due (a request still queued). Then, and whenever
 * libmicrohttpd ends a request early, every unfinished engine request of it
 * is aborted, which frees its KV pages in the engine.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "server_impl.h"

#define WAIT_SLICE_NS 50000000L   /* 50 ms between hang-up checks */
#define IDLE_TIMEOUT_S 120        /* idle keep-alive connections close after this */
#define DUMP_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(8))

struct cas_server {
    cas_srv_engine_ops ops;
    cas_srv_limits lim;
    char *api_key, *model_name, *model_alias;
    struct MHD_Daemon *daemon;
    int32_t port;
    long created;
    cas_srv_metrics metrics;
    pthread_mutex_t mu; /* guards live */
    pthread_cond_t cv;
    int64_t live;       /* engine requests whose final event has not come yet */
    atomic_int closing;
    atomic_uint_fast64_t counter; /* ids and default seeds */
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

struct srv_req;

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

static int peer_gone(srv_req *r) {
    if (atomic_load(&r->s->closing)) return 1;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return 0;
    struct pollfd pf = {.fd = ci->connect_fd, .events = POLLRDHUP};
    return poll(&pf, 1, 0) > 0 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
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

static void abort_all(srv_req *r) {
    cas_server *s = r->s;
    for (int32_t i = 0; i < r->n_choices; i++) {
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

static json_t *bytes_of(json_t *str) {
    json_t *a = json_array();
    const char *p = json_string_value(str);
    size_t n = json_string_length(str);
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
                json_t *at = token_str(s, e->top_ids[(size_t)t * (size_t)e->k + (size_t)j], NULL);
                json_array_append_new(alts, json_pack("{s:o,s:f,s:o}", "token", at, "logprob",
                                                      lp_value(e->top_lp[(size_t)t * (size_t)e->k + (size_t)j]),
                                                      "bytes", bytes_of(at)));
            }
            json_array_append_new(json_object_get(*lp, "content"),
                                  json_pack("{s:O,s:f,s:o,s:o}", "token", tok, "logprob", v, "bytes",
                                            bytes_of(tok), "top_logprobs", alts));
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
                         cas_finish_reason finish) {
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
    const char *f = finish_str(finish);
    json_object_set_new(ch, "finish_reason", f ? json_string(f) : json_null());
    json_object_set_new(j, "choices", json_pack("[o]", ch));
    if (r->p.include_usage) json_object_set_new(j, "usage", json_null());
    sse(r, j);
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
            stream_chunk(r, c, "", 0, NULL, 1, CAS_FINISH_NONE);
            c->role_sent = 1;
        }
        if (e->text_len || lp) stream_chunk(r, c, e->text, e->text_len, lp, 0, CAS_FINISH_NONE);
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
            stream_chunk(r, c, chat ? NULL : "", 0, NULL, 0, e->finish);
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
        if (chat) json_object_set_new(ch, "message", json_pack("{s:s,s:o}", "role", "assistant", "content", text));
        else json_object_set_new(ch, "text", text);
        json_object_set_new(ch, "logprobs", c->lp ? json_incref(c->lp) : json_null());
        const char *f = finish_str(c->finish);
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
    if (allow) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    if (status == 401) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
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
            if (peer_gone(r)) {
                r->gone = 1;
                return MHD_CONTENT_READER_END_WITH_ERROR;
            }
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

/* ---- generation requests --------------------------------------------------- */

static uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static enum MHD_Result generate(srv_req *r) {
    cas_server *s = r->s;
    cas_srv_parsed *p = &r->p;
    cas_srv_error err;
    int chat = p->route == CAS_SRV_ROUTE_CHAT;
    char *chat_text = NULL;
    enum MHD_Result ret;

    if (p->model && strcmp(p->model, s->model_name) && !(s->model_alias && !strcmp(p->model, s->model_alias))) {
        cas_srv_error_set(&err, 404, "invalid_request_error", "model_not_found", "model",
                          "The model `%.200s` does not exist (this server serves `%.200s`)", p->model, s->model_name);
        return send_error(r, &err);
    }
    if (chat) {
        if (s->ops.apply_chat(s->ops.ctx, p->msgs, p->n_msgs, &chat_text) != CAS_OK) {
            cas_srv_error_set(&err, 400, "invalid_request_error", NULL, "messages", "chat template: %s",
                              cas_last_error());
            return send_error(r, &err);
        }
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
    }

    r->n_choices = p->n_prompts * p->n;
    r->choices = calloc((size_t)r->n_choices, sizeof *r->choices);
    if (!r->choices) {
        free(plen);
        r->n_choices = 0;
        cas_srv_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
        return send_error(r, &err);
    }
    uint64_t salt = atomic_fetch_add(&s->counter, 1);
    snprintf(r->id, sizeof r->id, "%s%016" PRIx64, chat ? "chatcmpl-" : "cmpl-", mix64(salt ^ (uint64_t)time(NULL)));
    r->created = (long)time(NULL);
    uint64_t seed = p->seed_set ? p->sampling.seed : mix64(salt * 0x2545F4914F6CDD1Dull + (uint64_t)(cas_now_s() * 1e9));

    /* no connection timeout while the engine works on it */
    MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT, 0u);

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
        if (peer_gone(r)) {
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

/* ---- dispatch ---------------------------------------------------------------- */

static enum MHD_Result handle(srv_req *r, const char *url, const char *method) {
    cas_server *s = r->s;
    cas_srv_error err;
    const char *auth = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    cas_srv_route route = cas_srv_parse(&s->lim, method, url, auth, r->body, r->body_len, &r->p, &err);
    switch (route) {
    case CAS_SRV_ROUTE_NONE: return send_error(r, &err);
    case CAS_SRV_ROUTE_HEALTH: return send_json(r, 200, json_pack("{s:s}", "status", "ok"));
    case CAS_SRV_ROUTE_MODELS: {
        json_t *m = json_pack("{s:s,s:s,s:I,s:s,s:i}", "id", s->model_name, "object", "model", "created",
                              (json_int_t)s->created, "owned_by", "cascade", "max_model_len",
                              (int)s->ops.context_length(s->ops.ctx));
        return send_json(r, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", m));
    }
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

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_size, void **con_cls) {
    cas_server *s = cls;
    srv_req *r = *con_cls;
    (void)version;
    if (!r) {
        if (!(r = req_new(s, conn))) return MHD_NO;
        *con_cls = r;
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
    MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)IDLE_TIMEOUT_S);
    req_release(r);
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
    s->ops = *ops;
    s->api_key = dup_or_null(o.api_key && o.api_key[0] ? o.api_key : NULL);
    s->model_name = dup_or_null(o.model_name ? o.model_name : ops->model_name(ops->ctx));
    s->model_alias = dup_or_null(o.model_alias);
    if (!s->model_name) s->model_name = dup_or_null("cascade");
    s->lim.api_key = s->api_key;
    s->lim.max_body_bytes = o.max_body_bytes ? o.max_body_bytes : (size_t)8 << 20;
    s->lim.max_n = o.max_n > 0 ? o.max_n : 16;
    s->created = (long)time(NULL);
    cas_srv_metrics_init(&s->metrics);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    atomic_init(&s->closing, 0);
    atomic_init(&s->counter, (uint64_t)time(NULL));

    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | ipv6 |
                     MHD_USE_ERROR_LOG;
    s->daemon = MHD_start_daemon(
        flags, (uint16_t)o.port, NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_CONNECTION_LIMIT,
        (unsigned)(o.max_connections > 0 ? o.max_connections : 1024), MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)IDLE_TIMEOUT_S, MHD_OPTION_LISTEN_BACKLOG_SIZE, 1024u, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
        MHD_OPTION_END);
    if (!s->daemon) {
        int e = errno;
        cas_server_destroy(s);
        return cas_error(CAS_ERR_IO, "server: cannot listen on %s:%d (%s)", host, (int)o.port, strerror(e));
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di ? (int32_t)di->port : o.port;
    *out = s;
    return CAS_OK;
}

int32_t cas_server_port(const cas_server *s) { return s ? s->port : 0; }

void cas_server_destroy(cas_server *s) {
    if (!s) return;
    atomic_store(&s->closing, 1);
    if (s->daemon) MHD_stop_daemon(s->daemon); /* joins connection threads; on_completed aborts their requests */
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
    free(s->api_key);
    free(s->model_name);
    free(s->model_alias);
    free(s);
}
