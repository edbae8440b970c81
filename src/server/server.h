/*
 * server.h: `cascade serve`, an OpenAI-compatible HTTP server over one engine.
 * Every HTTP request becomes one or more engine requests, so requests from
 * different clients meet in the engine's batches (continuous batching,
 * prefix caching and cascade attention across clients).
 *
 * Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
 * GET /health, GET /metrics (Prometheus text). Streaming is Server-Sent
 * Events as OpenAI sends them. HTTP is libmicrohttpd (one thread per
 * connection), JSON is jansson.
 *
 * Threads. The engine must be running (cas_engine_start) while the server
 * serves. The server never blocks the engine thread: its engine callback only
 * copies an event into the request's queue under that request's mutex and
 * signals the connection's thread, which renders JSON and writes to the
 * socket. A client that disconnects has its engine requests aborted.
 *
 * Order at shutdown: cas_server_destroy (closes connections, aborts their
 * requests and waits for the engine's final events), then cas_engine_stop
 * and cas_engine_destroy.
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
    int32_t max_connections; /* simultaneous connections (one thread each); 0 = 1024 */
    int32_t max_n;           /* largest `n` (choices per request); 0 = 16 */
} cas_server_opts;

cas_server_opts cas_server_opts_default(void);

/* Creates a server over a running (or soon started) engine and starts
 * listening. The engine must outlive the server. The strings in opts are
 * copied. */
cas_status cas_server_create(cas_server **out, cas_engine *e, const cas_server_opts *opts);

/* The TCP port the server listens on (useful with port 0). */
int32_t cas_server_port(const cas_server *s);

/* Stops listening, closes every connection, aborts their engine requests and
 * waits (a few seconds at most) for the engine's final events. NULL is a
 * no-op. */
void cas_server_destroy(cas_server *s);

#ifdef __cplusplus
}
#endif

#endif
