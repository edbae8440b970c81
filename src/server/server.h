/*
 * server.h: `cascade serve`, an OpenAI-compatible HTTP server over one engine.
 * Every HTTP request becomes one or more engine requests, so requests from
 * different clients meet in the engine's batches (continuous batching,
 * prefix caching and cascade attention across clients).
 *
 * Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
 * GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text), GET
 * /version, POST /tokenize, POST /detokenize (as vLLM has them). Streaming is
 * Server-Sent Events as OpenAI sends them. Every error is an OpenAI error
 * object. HTTP is libmicrohttpd (one thread per connection), JSON is jansson.
 *
 * Connections. A client cannot hold the server with idle or half-sent
 * requests: connections per address are capped, a request's headers must
 * arrive within header_timeout of the connection opening (or of the previous
 * response on a kept-alive connection), and as connections run short the
 * oldest one still waiting for its headers is closed to make room.
 * Inactivity (a body that stops coming, a client that stops reading) closes a
 * connection after idle_timeout; waiting on the engine never counts.
 *
 * Threads. The engine must be running (cas_engine_start) while the server
 * serves. The server never blocks the engine thread: its engine callback only
 * copies an event into the request's queue under that request's mutex and
 * signals the connection's thread, which renders JSON and writes to the
 * socket. A client that disconnects has its engine requests aborted.
 *
 * Order at shutdown: optionally cas_server_drain and a wait for
 * cas_server_active to reach 0 (graceful), or cas_server_abort_all and a short
 * wait (prompt); then cas_server_destroy (closes connections, aborts their
 * requests and waits for the engine's final events), then cas_engine_stop and
 * cas_engine_destroy.
 */
#ifndef CASCADE_SERVER_H
#define CASCADE_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "../core/core.h"
#include "../engine/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cas_server cas_server;

typedef struct {
    const char *host;        /* address to bind, IPv4 or IPv6 literal; NULL = "127.0.0.1" */
    int32_t port;            /* TCP port; 0 = any free port (see cas_server_port) */
    const char *api_key;     /* when set, /v1/ routes need "Authorization: Bearer KEY" */
    const char *model_name;  /* the model id clients name; NULL = the engine's model name */
    const char *model_alias; /* a second accepted id (e.g. the GGUF file's base name); may be NULL */
    size_t max_body_bytes;   /* larger request bodies get 413; 0 = 8 MiB */
    int32_t max_connections; /* simultaneous connections (one thread each); 0 = 1024, or fewer
                                where the open-file limit (RLIMIT_NOFILE) is lower */
    int32_t max_connections_per_ip; /* from one client address; 0 = 256, -1 = no limit */
    double header_timeout_s; /* a request's headers must be complete this long after the
                                connection opened or the previous response ended; 0 = 10, -1 = none */
    double idle_timeout_s;   /* inactivity while reading a body or writing a response (never
                                while the engine works); 0 = 30, -1 = none */
    int32_t max_n;           /* largest `n` (choices per request); 0 = 16 */
    const char *replica_name; /* sent in every response as "X-Cascade-Replica: NAME", so that
                                behind a load balancer clients and logs see which replica
                                answered; NULL = "HOST:PORT" as bound (the machine's host name
                                for a wildcard host such as 0.0.0.0) */
    /* Optional: token ids of a text as the engine tokenizes prompts (for POST
     * /tokenize); *ids is malloc'd, the caller frees it. NULL: /tokenize
     * answers 501. Called from connection threads: must be thread-safe. */
    cas_status (*tokenize)(void *ctx, const char *text, int add_special, int32_t **ids, int32_t *n);
    void *tokenize_ctx;
} cas_server_opts;

cas_server_opts cas_server_opts_default(void);

/* Creates a server over a running (or soon started) engine and starts
 * listening. The engine must outlive the server. The strings in opts are
 * copied. */
cas_status cas_server_create(cas_server **out, cas_engine *e, const cas_server_opts *opts);

/* The TCP port the server listens on (useful with port 0). */
int32_t cas_server_port(const cas_server *s);

/* The name the server sends in its X-Cascade-Replica header (owned by the
 * server, valid until cas_server_destroy). */
const char *cas_server_replica_name(cas_server *s);

/* Graceful drain, for SIGTERM. From now on new requests get 503 (an OpenAI
 * error, "Connection: close") and /health answers 503, so a load balancer
 * stops sending work; requests already admitted go on to their end (streams
 * with their final chunk and [DONE]). /metrics still answers. Thread-safe,
 * idempotent; the socket stays open so that probes see the 503. */
void cas_server_drain(cas_server *s);

/* Requests admitted and not yet answered in full (0 once a drain is done).
 * Thread-safe. */
int64_t cas_server_active(cas_server *s);

/* Prompt stop: aborts the engine requests of every admitted request and
 * refuses new ones (503). Streams then end cleanly with finish_reason
 * "abort" and [DONE], non-streaming requests get their partial text with
 * finish_reason "abort"; returns at once (poll cas_server_active). Implies a
 * drain. Thread-safe. */
void cas_server_abort_all(cas_server *s);

/* Stops listening, closes every connection, aborts their engine requests and
 * waits (a few seconds at most) for the engine's final events. NULL is a
 * no-op. */
void cas_server_destroy(cas_server *s);

/* A response id: prefix followed by 32 lowercase hex digits of 128 bits from
 * the kernel's random source (getrandom, /dev/urandom where that fails), so
 * ids never repeat in practice. buf needs strlen(prefix) + 33 bytes.
 * Returns 0, or -1 when no random source answered (buf still gets an id,
 * from the clock and a counter). Thread-safe. */
int cas_server_make_id(char *buf, size_t cap, const char *prefix);

#ifdef __cplusplus
}
#endif

#endif
