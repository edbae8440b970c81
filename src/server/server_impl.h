/*
 * server_impl.h: the server's internals, shared by its files, its unit test
 * and its fuzz harness.
 *
 * The server reaches the engine only through cas_srv_engine_ops, a table of
 * the few engine functions it calls. server_engine.c fills it with the real
 * engine (cas_server_create); the unit test fills it with a test double, so
 * the HTTP layer is tested without a model and without linking the engine.
 *
 * Request handling is split in two: cas_srv_parse (routing, API key, JSON
 * parsing and validation of everything that needs no engine; a pure
 * function, fuzzed) and the HTTP file (model name, chat template, prompt
 * length, submit, streaming).
 */
#ifndef CASCADE_SERVER_IMPL_H
#define CASCADE_SERVER_IMPL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "server.h"

/* ---- the engine as the server sees it ---------------------------------- */

typedef struct {
    void *ctx; /* passed as the first argument of every function */
    cas_status (*submit)(void *ctx, const cas_engine_request *req, uint64_t *id);
    cas_status (*abort)(void *ctx, uint64_t id);
    void (*get_stats)(void *ctx, cas_engine_stats *st);
    const char *(*model_name)(void *ctx);
    int32_t (*context_length)(void *ctx);
    cas_status (*apply_chat)(void *ctx, const cas_engine_msg *msgs, int32_t n, char **out);
    /* optional (NULL: such requests get a 400): the chat template over a JSON
     * context (cas_engine_apply_chat_json), and how it asks for tool calls
     * (cas_engine_chat_tools: 0 never, 1 <tool_call> blocks, 2 another
     * format, -1 not run by the Jinja interpreter) */
    cas_status (*apply_chat_json)(void *ctx, const char *context_json, char **out);
    int (*chat_tools)(void *ctx);
    cas_status (*count_tokens)(void *ctx, const char *text, int32_t *n);
    /* optional (NULL): the text of one token, for logprobs' alternatives */
    const char *(*token_text)(void *ctx, int32_t id, size_t *len);
} cas_srv_engine_ops;

/* Creates a server over an engine given as an ops table (copied). */
cas_status cas_srv_create_with_ops(cas_server **out, const cas_srv_engine_ops *ops,
                                   const cas_server_opts *opts);

/* ---- parsing ------------------------------------------------------------ */

typedef enum {
    CAS_SRV_ROUTE_NONE = 0, /* an error: see cas_srv_error */
    CAS_SRV_ROUTE_COMPLETIONS,
    CAS_SRV_ROUTE_CHAT,
    CAS_SRV_ROUTE_MODELS,
    CAS_SRV_ROUTE_HEALTH,
    CAS_SRV_ROUTE_METRICS
} cas_srv_route;

/* An error as OpenAI reports it: {"error": {"message", "type", "param", "code"}}. */
typedef struct {
    int status;       /* HTTP status */
    const char *type; /* "invalid_request_error", "authentication_error", ... (static) */
    const char *code; /* "model_not_found", ... or NULL (static) */
    const char *allow; /* the Allow header of a 405, or NULL (static) */
    char param[64];   /* the offending field, "" when none */
    char message[512];
} cas_srv_error;

void cas_srv_error_set(cas_srv_error *err, int status, const char *type, const char *code,
                       const char *param, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* A JSON string of bytes that may not be UTF-8: invalid bytes become U+FFFD
 * (jansson refuses invalid UTF-8). Returns a new reference. */
typedef struct json_t json_t;
json_t *cas_srv_json_str(const char *s, size_t n);

/* JSON text of an error (malloc'd, caller frees; NULL on allocation failure). */
char *cas_srv_error_json(const cas_srv_error *err);

/* ---- the connection gate (server_gate.c) ------------------------------------ */

/* Checks the head of an HTTP/1.x request, the n bytes at buf so far: 0 if it
 * is not complete yet, 1 if it is complete and well-formed (request line
 * `METHOD SP target SP HTTP/1.x`, header lines `Name: value` without control
 * bytes or folding, a Content-Length of digits only and consistent if
 * repeated, Transfer-Encoding chunked only and not with a Content-Length),
 * -1 with an OpenAI error in *err otherwise: 400 malformed, 431 over
 * max_header_bytes (complete or not), 501 another transfer coding, 505 an
 * HTTP version other than 1.x. Reads only buf[0, n). */
int cas_srv_head_check(const char *buf, size_t n, size_t max_header_bytes, cas_srv_error *err);

typedef enum {
    CAS_SRV_GATE_BAD = 0,     /* a malformed head answered (status given) */
    CAS_SRV_GATE_REFUSED = 1, /* refused at the per-address or total limit (503 answered) */
    CAS_SRV_GATE_EVICTED = 2, /* the oldest waiting connection closed to make room */
    CAS_SRV_GATE_TIMEOUT = 3  /* closed: no complete head within header_timeout */
} cas_srv_gate_event;

struct sockaddr;
typedef struct {
    int listen_fd;           /* listening, non-blocking; the caller closes it after stop */
    int32_t max_conns;       /* connections in all (the gate's and open_conns') */
    int32_t headroom;        /* near max_conns by this many, the oldest waiting one is evicted */
    int32_t per_ip;          /* waiting connections per address; 0: no limit */
    double header_timeout;   /* seconds for a complete head; <= 0: none */
    size_t max_header_bytes; /* larger heads get a 431 */
    const char *replica;     /* X-Cascade-Replica of the gate's own answers (borrowed), or NULL */
    /* takes over a connection whose head passed (and must close it eventually) */
    void (*admit)(void *ctx, int fd, const struct sockaddr *addr, unsigned addr_len);
    int64_t (*open_conns)(void *ctx);                       /* connections past the gate */
    void (*event)(void *ctx, cas_srv_gate_event what, int status); /* for metrics */
    void *ctx;
} cas_srv_gate_opts;

typedef struct cas_srv_gate cas_srv_gate;
/* Starts the gate's thread on listen_fd. */
cas_status cas_srv_gate_start(cas_srv_gate **out, const cas_srv_gate_opts *opts);
/* Stops the thread and closes the connections still waiting in the gate. */
void cas_srv_gate_stop(cas_srv_gate *g);

typedef struct {
    char *text;      /* prompt text (NUL-terminated), or NULL */
    int32_t *tokens; /* [n_tokens] token ids when text is NULL */
    int32_t n_tokens;
} cas_srv_prompt;

typedef struct {
    cas_srv_route route;
    char *model;              /* the "model" field, or NULL when absent */
    int32_t n_prompts;        /* completions: prompts[n_prompts] */
    cas_srv_prompt *prompts;
    int32_t n_msgs;           /* chat: msgs[n_msgs], role and content owned */
    cas_engine_msg *msgs;
    cas_engine_sampling sampling; /* sampling.stop points into stops */
    int max_tokens_set;       /* 0: the route's default applies */
    int seed_set;             /* 0: the server picks a random seed */
    char **stops;             /* [n_stops] */
    int32_t n_stops;
    int32_t n;                /* choices per prompt, >= 1 */
    int stream, include_usage;
    int logprobs;             /* 1: report log-probabilities */
    int32_t top_logprobs;     /* alternatives per token when logprobs */
    /* chat: the template's context as JSON text ({"messages", "add_generation_prompt",
     * "tools", and chat_template_kwargs' keys}), made when the request needs more than
     * roles and texts: tools given to the template, tool calls or tool results in the
     * messages, or chat_template_kwargs. NULL: msgs render as plain chat. */
    char *chat_json;
    const char *chat_json_param; /* the field that needs it, for a template that cannot (static) */
    int tools_rendered;       /* tools are in chat_json (given, and tool_choice is not "none") */
    int parse_tool_calls;     /* the output is read for tool calls (tools_rendered) */
    int parallel_tool_calls;  /* 0: a response reports its first call only */
} cas_srv_parsed;

typedef struct {
    const char *api_key; /* NULL: no authentication */
    size_t max_body_bytes;
    int32_t max_n;
} cas_srv_limits;

/* Routes and validates one request. authorization is the Authorization
 * header or NULL; body need not be NUL-terminated. On success returns the
 * route and fills *out (free with cas_srv_parsed_free); on failure returns
 * CAS_SRV_ROUTE_NONE with *err filled and *out empty. Pure: touches nothing
 * else. */
cas_srv_route cas_srv_parse(const cas_srv_limits *lim, const char *method, const char *path,
                            const char *authorization, const char *body, size_t body_len,
                            cas_srv_parsed *out, cas_srv_error *err);
void cas_srv_parsed_free(cas_srv_parsed *p);

/* ---- tool calls in generated text (server_tools.c) ------------------------ */

/* A call the model wrote as <tool_call>{"name": ..., "arguments": {...}}</tool_call>. */
typedef struct {
    char *name;      /* NUL-terminated, malloc'd */
    char *arguments; /* the arguments object's JSON text as the model wrote it ("{}" when it gave
                        none), NUL-terminated, malloc'd: OpenAI's function.arguments */
} cas_srv_tool_call;

/* An incremental reader of Hermes-style tool calls (rules in server_tools.c).
 * A zeroed struct is an empty reader. Feed the text in pieces of any size,
 * then finish; at any moment content[0, content_len) and calls[0, n_calls)
 * are what is decided so far, and they only grow, so a stream sends what is
 * new after each feed. The result does not depend on where the text was cut.
 * Not thread-safe (one per choice). */
typedef struct {
    char *content;            /* [content_len] text outside the calls, NUL-terminated; NULL while empty */
    size_t content_len;
    cas_srv_tool_call *calls; /* [n_calls] */
    int32_t n_calls;
    int failed;               /* out of memory: content or calls are incomplete */
    int finished;             /* cas_srv_tools_finish was called */
    /* private */
    size_t content_cap;
    int32_t calls_cap;
    char *pend;               /* [pend_len] text not decided yet */
    size_t pend_len, pend_cap;
    int in_block, seg_text, phase, depth, in_str, esc; /* seg_text: text since the start or the last call */
    size_t ws, pos, json_start, json_end, close_at; /* offsets in pend */
} cas_srv_tools;

void cas_srv_tools_feed(cas_srv_tools *t, const char *text, size_t n);
/* The text has ended: everything still held back is decided. */
void cas_srv_tools_finish(cas_srv_tools *t);
/* Frees what the reader holds and zeroes it; NULL is a no-op. */
void cas_srv_tools_free(cas_srv_tools *t);

/* ---- metrics ------------------------------------------------------------ */

#define CAS_SRV_HIST_BUCKETS 20

typedef struct {
    const double *bounds; /* [CAS_SRV_HIST_BUCKETS] upper bounds, seconds */
    uint64_t counts[CAS_SRV_HIST_BUCKETS + 1]; /* last: +Inf */
    uint64_t n;
    double sum;
} cas_srv_hist;

typedef struct {
    pthread_mutex_t mu;
    cas_srv_hist ttft, tpot, e2e;
    uint64_t http_by_status[6]; /* 1xx..5xx at [1..5] */
    uint64_t requests_cancelled; /* clients that went away before their output was complete */
    /* connections, kept by the HTTP layer */
    int64_t conns_open;
    uint64_t conns_header_timeout; /* closed for headers not complete within header_timeout */
    uint64_t conns_evicted;        /* closed waiting for headers to make room at the limit */
    int draining;                  /* 1 once a drain began */
} cas_srv_metrics;

void cas_srv_metrics_init(cas_srv_metrics *m);
void cas_srv_metrics_destroy(cas_srv_metrics *m);
void cas_srv_metrics_observe(cas_srv_metrics *m, double ttft, double tpot, double e2e);
void cas_srv_metrics_http(cas_srv_metrics *m, int status);
/* Prometheus text exposition of engine stats and server metrics (malloc'd). */
char *cas_srv_metrics_text(cas_srv_metrics *m, const cas_engine_stats *st);

#endif
