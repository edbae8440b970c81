/*
 * fuzz_server.c: libFuzzer harness for the server's request handling,
 * cas_srv_parse (routing, API key, JSON parsing and validation of both
 * generation routes), and the connection gate's check of a request head
 * (cas_srv_head_check) on the whole input. The input's first three bytes choose the method, the
 * path and the Authorization header (a fourth path choice takes the path
 * from the input itself); the rest is the body, copied into an exact-size
 * buffer so AddressSanitizer sees a read past its end.
 *
 * Oracles beyond "no crash": every error renders as valid JSON in OpenAI's
 * shape with a 4xx/5xx status, and every accepted request satisfies the
 * invariants the HTTP layer relies on (n >= 1, a prompt or messages, stop
 * strings non-empty, counts consistent, a tool-calling request's template
 * context valid JSON).
 *
 * The body is also read as a model's output by the tool-call reader
 * (cas_srv_tools): whole and cut in two where the input says, the content
 * and calls must be the same; with no call the content is the text itself;
 * every call has a name and arguments that parse as a JSON object.
 */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../src/server/server_impl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *methods[] = {"GET", "POST", "PUT", "DELETE"};
static const char *paths[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                              "/v1/completions?x=1", "/v1/", "/"};
static const char *auths[] = {NULL, "Bearer k", "Bearer wrong", "bearer  k "};

#define ASSERT(c)                                                                                            \
    do {                                                                                                     \
        if (!(c)) __builtin_trap();                                                                          \
    } while (0)

/* The head check on the raw input: reads only the bytes given, and every
 * verdict is 0 (wait), 1 (pass) or -1 with a 4xx/5xx error. A smaller limit
 * than the server's makes the 431 paths reachable. */
static void fuzz_head(const uint8_t *data, size_t size) {
    char *b = malloc(size ? size : 1);
    if (!b) return;
    if (size) memcpy(b, data, size);
    cas_srv_error err;
    memset(&err, 0, sizeof err);
    int r = cas_srv_head_check(b, size, 4096, &err);
    ASSERT(r >= -1 && r <= 1);
    if (r < 0) ASSERT(err.status >= 400 && err.status < 600 && err.message[0]);
    if (r == 0) ASSERT(size < 4096);
    free(b);
}

static void tools_read(cas_srv_tools *t, const char *text, size_t n, size_t cut) {
    memset(t, 0, sizeof *t);
    cas_srv_tools_feed(t, text, cut);
    cas_srv_tools_feed(t, text + cut, n - cut);
    cas_srv_tools_finish(t);
}

static void fuzz_tools(const char *text, size_t n, size_t cut) {
    cas_srv_tools a, b;
    tools_read(&a, text, n, n);
    tools_read(&b, text, n, n ? cut % (n + 1) : 0);
    ASSERT(!a.failed && !b.failed);
    ASSERT(a.content_len == b.content_len && (!a.content_len || !memcmp(a.content, b.content, a.content_len)));
    ASSERT(a.n_calls == b.n_calls);
    if (a.n_calls == 0) ASSERT(a.content_len == n && (!n || !memcmp(a.content, text, n)));
    for (int32_t i = 0; i < a.n_calls; i++) {
        ASSERT(a.calls[i].name[0] && !strcmp(a.calls[i].name, b.calls[i].name));
        ASSERT(!strcmp(a.calls[i].arguments, b.calls[i].arguments));
        json_t *args = json_loads(a.calls[i].arguments, JSON_DECODE_INT_AS_REAL, NULL);
        ASSERT(json_is_object(args));
        json_decref(args);
    }
    cas_srv_tools_free(&a);
    cas_srv_tools_free(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_head(data, size);
    if (size < 3) return 0;
    const char *method = methods[data[0] % 4];
    const char *auth = auths[data[2] % 4];
    char pathbuf[64];
    const char *path;
    const uint8_t *body = data + 3;
    size_t blen = size - 3;
    if (data[1] % 9 == 8) { /* path from the input, up to the first newline */
        size_t n = 0;
        while (n < blen && n < sizeof pathbuf - 1 && body[n] != '\n') n++;
        memcpy(pathbuf, body, n);
        pathbuf[n] = 0;
        path = pathbuf;
        body += n < blen ? n + 1 : n;
        blen -= n < blen ? n + 1 : n;
    } else {
        path = paths[data[1] % 9 % 8];
    }
    char *copy = malloc(blen ? blen : 1);
    if (!copy) return 0;
    if (blen) memcpy(copy, body, blen);

    cas_srv_limits lim = {data[2] & 4 ? "k" : NULL, 1 << 16, 8};
    cas_srv_parsed p;
    cas_srv_error err;
    cas_srv_route r = cas_srv_parse(&lim, method, path, auth, copy, blen, &p, &err);
    if (r == CAS_SRV_ROUTE_NONE) {
        ASSERT(err.status >= 400 && err.status < 600);
        char *js = cas_srv_error_json(&err);
        ASSERT(js);
        json_t *j = json_loads(js, 0, NULL);
        ASSERT(j);
        json_t *e = json_object_get(j, "error");
        ASSERT(json_is_string(json_object_get(e, "message")) && json_is_string(json_object_get(e, "type")));
        ASSERT(json_object_get(e, "param") && json_object_get(e, "code"));
        json_decref(j);
        free(js);
        ASSERT(p.prompts == NULL && p.msgs == NULL && p.stops == NULL && p.model == NULL);
    } else if (r == CAS_SRV_ROUTE_COMPLETIONS || r == CAS_SRV_ROUTE_CHAT) {
        ASSERT(p.n >= 1 && p.n <= lim.max_n);
        ASSERT(p.sampling.max_tokens >= 1 || (r == CAS_SRV_ROUTE_CHAT && !p.max_tokens_set));
        ASSERT(p.sampling.temperature >= 0.0f && p.sampling.temperature <= 2.0f);
        ASSERT(p.sampling.top_p > 0.0f && p.sampling.top_p <= 1.0f);
        ASSERT(p.sampling.n_stop == p.n_stops && p.n_stops <= 16);
        for (int32_t i = 0; i < p.n_stops; i++) ASSERT(p.stops[i][0] && p.sampling.stop[i] == p.stops[i]);
        if (r == CAS_SRV_ROUTE_COMPLETIONS) {
            ASSERT(p.n_prompts >= 1);
            for (int32_t i = 0; i < p.n_prompts; i++) {
                ASSERT(p.prompts[i].text || p.prompts[i].n_tokens >= 1);
                if (!p.prompts[i].text)
                    for (int32_t t = 0; t < p.prompts[i].n_tokens; t++) ASSERT(p.prompts[i].tokens[t] >= 0);
            }
        } else {
            ASSERT(p.n_msgs >= 1);
            for (int32_t i = 0; i < p.n_msgs; i++) ASSERT(p.msgs[i].role && p.msgs[i].content);
            if (p.chat_json) {
                json_t *ctx = json_loads(p.chat_json, 0, NULL);
                ASSERT(json_is_array(json_object_get(ctx, "messages")) && p.chat_json_param);
                ASSERT(!p.tools_rendered || json_is_array(json_object_get(ctx, "tools")));
                json_decref(ctx);
            }
            ASSERT(p.parse_tool_calls == p.tools_rendered && (!p.tools_rendered || p.chat_json));
        }
    }
    cas_srv_parsed_free(&p);
    fuzz_tools(copy, blen, (size_t)data[1] * 7 + data[2]);
    free(copy);
    return 0;
}
