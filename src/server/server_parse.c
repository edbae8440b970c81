/*
 * server_parse.c: routing, API-key check and validation of the OpenAI
 * request bodies, as one pure function (cas_srv_parse) from (method, path,
 * Authorization, body) to either a parsed request or an OpenAI-shaped error.
 * It needs no engine and no socket, so the unit test drives it directly and
 * libFuzzer hammers it (fuzz/fuzz_server.c).
 *
 * Validation follows OpenAI's API: a mistyped or out-of-range field is a 400
 * naming the field in "param", found here rather than later, so that every
 * refusal names its field. OpenAI's and vLLM's sampling fields are either
 * carried to the engine (cas_engine_sampling: penalties, logit_bias,
 * stop_token_ids, min_tokens, include_stop_str_in_output, echo) or refused
 * (400) when they would change the output and we do not implement them
 * (the `unsupported` table: guided decoding, prompt_logprobs, beam search,
 * a per-request chat_template, suffix), and ignored when they would not
 * (user, metadata). JSON is parsed by jansson, never by hand.
 *
 * Tool calling. `tools`, `tool_choice` ("auto" or "none"; "required" and a
 * named function are refused: they need constrained decoding),
 * `parallel_tool_calls`, `chat_template_kwargs`, assistant messages with
 * `tool_calls` and `role: "tool"` results are validated here and put into
 * the JSON context the model's Jinja template is rendered with
 * (cas_srv_parsed.chat_json), in the shape transformers' apply_chat_template
 * and vLLM give it: messages, add_generation_prompt, tools (null with
 * tool_choice "none": the model is not shown them, and its output is not
 * read for calls), and the kwargs' keys. A request without any of them
 * keeps chat_json NULL and renders exactly as a plain chat. Whether the
 * template can take them is the HTTP file's question (it has the engine).
 */
#include <ctype.h>
#include <float.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server_impl.h"

#define MAX_PROMPTS 256  /* prompts times n per request: a bound on one request's work */
#define MAX_STOPS 16
#define MAX_TOP_LOGPROBS 20
#define MAX_STOP_TOKEN_IDS 1024
#define MAX_LOGIT_BIAS 65536

void cas_srv_error_set(cas_srv_error *err, int status, const char *type, const char *code,
                       const char *param, const char *fmt, ...) {
    err->status = status;
    err->type = type;
    err->code = code;
    err->allow = NULL;
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

json_t *cas_srv_json_str(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    if (j) return j;
    char *d = malloc(n * 3 + 1);
    if (!d) return json_string("");
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        unsigned char b = (unsigned char)s[i];
        size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
        json_t *t = len && b && i + len <= n ? json_stringn(s + i, len) : NULL;
        if (t) { /* jansson judges the sequence (overlong forms, surrogates) */
            json_decref(t);
            memcpy(d + w, s + i, len);
            w += len;
            i += len;
        } else {
            memcpy(d + w, "\xEF\xBF\xBD", 3); /* U+FFFD */
            w += 3;
            i++;
        }
    }
    j = json_stringn(d, w);
    free(d);
    return j ? j : json_string("");
}

char *cas_srv_error_json(const cas_srv_error *err) {
    json_t *e = json_object();
    json_t *root = json_object();
    if (!e || !root) {
        json_decref(e);
        json_decref(root);
        return NULL;
    }
    /* the message may quote the request (a path, a JSON error): any bytes */
    json_object_set_new(e, "message", cas_srv_json_str(err->message, strlen(err->message)));
    json_object_set_new(e, "type", json_string(err->type ? err->type : "invalid_request_error"));
    json_object_set_new(e, "param", err->param[0] ? cas_srv_json_str(err->param, strlen(err->param)) : json_null());
    json_object_set_new(e, "code", err->code ? json_string(err->code) : json_null());
    json_object_set_new(root, "error", e);
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

static void bad(cas_srv_error *err, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void bad(cas_srv_error *err, const char *param, const char *fmt, ...) {
    cas_srv_error_set(err, 400, "invalid_request_error", NULL, param, "%s", "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

void cas_srv_parsed_free(cas_srv_parsed *p) {
    if (!p) return;
    free(p->model);
    for (int32_t i = 0; i < p->n_prompts; i++) {
        free(p->prompts[i].text);
        free(p->prompts[i].tokens);
    }
    free(p->prompts);
    for (int32_t i = 0; i < p->n_msgs; i++) {
        free((char *)p->msgs[i].role);
        free((char *)p->msgs[i].content);
    }
    free(p->msgs);
    free(p->chat_json);
    for (int32_t i = 0; i < p->n_stops; i++) free(p->stops[i]);
    free(p->stops);
    /* the sampling's token lists are the parse's own (parse_common) */
    free((void *)p->sampling.stop_token_ids);
    free((void *)p->sampling.logit_bias_ids);
    free((void *)p->sampling.logit_bias);
    memset(p, 0, sizeof *p);
}

/* ---- routing and authentication ------------------------------------------ */

static const struct {
    const char *path, *method;
    cas_srv_route route;
} routes[] = {
    {"/v1/completions", "POST", CAS_SRV_ROUTE_COMPLETIONS},
    {"/v1/chat/completions", "POST", CAS_SRV_ROUTE_CHAT},
    {"/v1/models", "GET", CAS_SRV_ROUTE_MODELS},
    {"/health", "GET", CAS_SRV_ROUTE_HEALTH},
    {"/metrics", "GET", CAS_SRV_ROUTE_METRICS},
};

/* Compares in time independent of where the strings differ. */
static int secret_equal(const char *a, size_t alen, const char *b) {
    size_t blen = strlen(b);
    unsigned char d = (unsigned char)(alen != blen);
    for (size_t i = 0; i < blen; i++) d |= (unsigned char)((i < alen ? a[i] : 0) ^ b[i]);
    return d == 0;
}

static int authorized(const char *key, const char *authorization) {
    if (!key || !key[0]) return 1;
    if (!authorization) return 0;
    const char *p = authorization;
    while (*p == ' ') p++;
    if (strncasecmp(p, "Bearer ", 7) != 0) return 0;
    p += 7;
    while (*p == ' ') p++;
    size_t n = strlen(p);
    while (n && p[n - 1] == ' ') n--;
    return secret_equal(p, n, key);
}

/* ---- typed field access ---------------------------------------------------- */

/* Each getter: 1 = present and valid (value written), 0 = absent or null,
 * -1 = invalid (err filled). */

static int get_int(json_t *o, const char *k, long long lo, long long hi, long long *v, cas_srv_error *err) {
    json_t *x = json_object_get(o, k);
    if (!x || json_is_null(x)) return 0;
    if (!json_is_integer(x)) {
        bad(err, k, "'%s' must be an integer", k);
        return -1;
    }
    long long i = (long long)json_integer_value(x);
    if (i < lo || i > hi) {
        char msg[160];
        snprintf(msg, sizeof msg, "'%s' must be between %lld and %lld, got %lld", k, lo, hi, i);
        bad(err, k, "%s", msg);
        return -1;
    }
    *v = i;
    return 1;
}

static int get_num(json_t *o, const char *k, double lo, double hi, int lo_open, double *v,
                   cas_srv_error *err) {
    json_t *x = json_object_get(o, k);
    if (!x || json_is_null(x)) return 0;
    if (!json_is_number(x)) {
        bad(err, k, "'%s' must be a number", k);
        return -1;
    }
    double d = json_number_value(x);
    /* the engine holds floats: a value that rounds to the open bound is out too (top_p 1e-300) */
    if (!(d >= lo && d <= hi) || (lo_open && (d <= lo || (float)d <= (float)lo))) {
        char msg[160];
        snprintf(msg, sizeof msg, "'%s' must be %s %g and <= %g, got %g", k, lo_open ? ">" : ">=", lo, hi, d);
        bad(err, k, "%s", msg);
        return -1;
    }
    *v = d;
    return 1;
}

static int get_bool(json_t *o, const char *k, int *v, cas_srv_error *err) {
    json_t *x = json_object_get(o, k);
    if (!x || json_is_null(x)) return 0;
    if (!json_is_boolean(x)) {
        bad(err, k, "'%s' must be a boolean", k);
        return -1;
    }
    *v = json_is_true(x);
    return 1;
}

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static void oom(cas_srv_error *err) {
    cas_srv_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
}

/* ---- fields shared by both routes ----------------------------------------- */

static int parse_stop(json_t *o, cas_srv_parsed *p, cas_srv_error *err) {
    json_t *x = json_object_get(o, "stop");
    if (!x || json_is_null(x)) return 0;
    size_t n = json_is_string(x) ? 1 : json_is_array(x) ? json_array_size(x) : (size_t)-1;
    if (n == (size_t)-1) {
        bad(err, "stop", "'%s' must be a string or a list of strings", "stop");
        return -1;
    }
    if (n > MAX_STOPS) {
        bad(err, "stop", "'stop' has more than %s strings", "16");
        return -1;
    }
    p->stops = calloc(n ? n : 1, sizeof *p->stops);
    if (!p->stops) {
        oom(err);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_is_string(x) ? x : json_array_get(x, i);
        if (!json_is_string(s)) {
            bad(err, "stop", "'%s' must be a string or a list of strings", "stop");
            return -1;
        }
        if (json_string_length(s) == 0) continue; /* an empty stop string would end every output at once */
        char *d = dup_n(json_string_value(s), json_string_length(s));
        if (!d) {
            oom(err);
            return -1;
        }
        p->stops[p->n_stops++] = d;
    }
    return 0;
}

/* Fields that would change the output and that this server does not
 * implement, refused when set: any value but null (PRESENT), true, false, or
 * anything but null, an empty list, object or string (NONEMPTY). */
typedef enum { REFUSE_PRESENT, REFUSE_TRUE, REFUSE_FALSE, REFUSE_NONEMPTY } refuse_when;

static const struct {
    const char *name;
    refuse_when when;
} unsupported[] = {
    /* vLLM's guided decoding and structured outputs */
    {"guided_json", REFUSE_PRESENT},
    {"guided_regex", REFUSE_PRESENT},
    {"guided_choice", REFUSE_PRESENT},
    {"guided_grammar", REFUSE_PRESENT},
    {"structured_outputs", REFUSE_PRESENT},
    /* vLLM's sampling extras */
    {"prompt_logprobs", REFUSE_PRESENT}, /* needs every prompt row's logits; the engine computes the last */
    {"allowed_token_ids", REFUSE_PRESENT},
    {"bad_words", REFUSE_NONEMPTY},
    {"logits_processors", REFUSE_NONEMPTY},
    {"use_beam_search", REFUSE_TRUE},
    {"truncate_prompt_tokens", REFUSE_PRESENT},
    {"skip_special_tokens", REFUSE_FALSE}, /* control tokens always render as nothing */
    {"return_tokens_as_token_ids", REFUSE_TRUE},
    /* vLLM's chat template controls */
    {"chat_template", REFUSE_PRESENT},
    {"add_generation_prompt", REFUSE_FALSE},
    {"continue_final_message", REFUSE_TRUE},
    {"documents", REFUSE_NONEMPTY},
    /* OpenAI's fields for other modalities and tools */
    {"audio", REFUSE_PRESENT},
    {"functions", REFUSE_NONEMPTY},
    {"web_search_options", REFUSE_PRESENT},
};

static int refuse_unsupported(json_t *o, cas_srv_error *err) {
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++) {
        const char *k = unsupported[i].name;
        json_t *x = json_object_get(o, k);
        if (!x || json_is_null(x)) continue;
        int set = 1;
        switch (unsupported[i].when) {
        case REFUSE_PRESENT: break;
        case REFUSE_TRUE:
        case REFUSE_FALSE:
            if (!json_is_boolean(x)) {
                bad(err, k, "'%s' must be a boolean", k);
                return -1;
            }
            set = json_is_true(x) == (unsupported[i].when == REFUSE_TRUE);
            break;
        case REFUSE_NONEMPTY:
            set = !((json_is_array(x) && json_array_size(x) == 0) || (json_is_object(x) && json_object_size(x) == 0) ||
                    (json_is_string(x) && json_string_length(x) == 0));
            break;
        }
        if (set) {
            bad(err, k, "'%s' is not supported by this server", k);
            return -1;
        }
    }
    return 0;
}

/* stop_token_ids: a list of token ids >= 0 (the engine checks the vocabulary). */
static int parse_stop_token_ids(json_t *o, cas_engine_sampling *s, cas_srv_error *err) {
    json_t *x = json_object_get(o, "stop_token_ids");
    if (!x || json_is_null(x)) return 0;
    if (!json_is_array(x)) {
        bad(err, "stop_token_ids", "'%s' must be a list of token ids", "stop_token_ids");
        return -1;
    }
    size_t n = json_array_size(x);
    if (n > MAX_STOP_TOKEN_IDS) {
        bad(err, "stop_token_ids", "'stop_token_ids' has more than %d entries", MAX_STOP_TOKEN_IDS);
        return -1;
    }
    if (n == 0) return 0;
    int32_t *ids = malloc(n * sizeof *ids);
    if (!ids) {
        oom(err);
        return -1;
    }
    s->stop_token_ids = ids; /* owned by the parse from here (cas_srv_parsed_free) */
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(x, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) > INT32_MAX) {
            bad(err, "stop_token_ids", "'%s' must be a list of token ids (integers >= 0)", "stop_token_ids");
            return -1;
        }
        ids[i] = (int32_t)json_integer_value(t);
    }
    s->n_stop_token_ids = (int32_t)n;
    return 0;
}

/* logit_bias: {"token id": bias in [-100, 100], ...}, as OpenAI's. */
static int parse_logit_bias(json_t *o, cas_engine_sampling *s, cas_srv_error *err) {
    const char *k = "logit_bias";
    json_t *x = json_object_get(o, k);
    if (!x || json_is_null(x)) return 0;
    if (!json_is_object(x)) {
        bad(err, k, "'%s' must be an object mapping token ids to biases", k);
        return -1;
    }
    size_t n = json_object_size(x);
    if (n > MAX_LOGIT_BIAS) {
        bad(err, k, "'logit_bias' has more than %d entries", MAX_LOGIT_BIAS);
        return -1;
    }
    if (n == 0) return 0;
    int32_t *ids = malloc(n * sizeof *ids);
    float *bias = malloc(n * sizeof *bias);
    s->logit_bias_ids = ids; /* owned by the parse from here (cas_srv_parsed_free) */
    s->logit_bias = bias;
    if (!ids || !bias) {
        oom(err);
        return -1;
    }
    const char *key;
    json_t *v;
    size_t i = 0;
    json_object_foreach(x, key, v) {
        char *end = NULL;
        long long id = isdigit((unsigned char)key[0]) ? strtoll(key, &end, 10) : -1;
        if (id < 0 || id > INT32_MAX || !end || *end) {
            bad(err, k, "'logit_bias' keys must be token ids (decimal integers >= 0), got '%.40s'", key);
            return -1;
        }
        if (!json_is_number(v) || !(json_number_value(v) >= -100.0 && json_number_value(v) <= 100.0)) {
            bad(err, k, "'logit_bias' values must be numbers between -100 and 100 (token %lld)", id);
            return -1;
        }
        ids[i] = (int32_t)id;
        bias[i] = (float)json_number_value(v);
        i++;
    }
    s->n_logit_bias = (int32_t)i;
    return 0;
}

/* min_tokens against the max_tokens the request ends up with (vLLM's rule). */
static int check_min_tokens(const cas_srv_parsed *p, cas_srv_error *err) {
    if (p->max_tokens_set && p->sampling.min_tokens > p->sampling.max_tokens) {
        bad(err, "min_tokens", "'min_tokens' (%d) must be at most max_tokens (%d)", (int)p->sampling.min_tokens,
            (int)p->sampling.max_tokens);
        return -1;
    }
    return 0;
}

static int parse_common(json_t *o, cas_srv_parsed *p, const cas_srv_limits *lim, cas_srv_error *err) {
    json_t *m = json_object_get(o, "model");
    if (m && !json_is_null(m)) {
        if (!json_is_string(m)) {
            bad(err, "model", "'%s' must be a string", "model");
            return -1;
        }
        if (!(p->model = dup_n(json_string_value(m), json_string_length(m)))) {
            oom(err);
            return -1;
        }
    }
    cas_engine_sampling *s = &p->sampling;
    double d;
    long long i;
    int r, b;
    if ((r = get_num(o, "temperature", 0.0, 2.0, 0, &d, err)) < 0) return -1;
    if (r) s->temperature = (float)d;
    if ((r = get_num(o, "top_p", 0.0, 1.0, 1, &d, err)) < 0) return -1;
    if (r) s->top_p = (float)d;
    if ((r = get_int(o, "top_k", -1, 1 << 30, &i, err)) < 0) return -1;
    if (r) s->top_k = i < 0 ? 0 : (int32_t)i;
    if ((r = get_num(o, "min_p", 0.0, 1.0, 0, &d, err)) < 0) return -1;
    if (r) s->min_p = (float)d;
    json_t *seed = json_object_get(o, "seed");
    if (seed && !json_is_null(seed)) {
        if (!json_is_integer(seed)) {
            bad(err, "seed", "'%s' must be an integer", "seed");
            return -1;
        }
        s->seed = (uint64_t)json_integer_value(seed);
        p->seed_set = 1;
    }
    long long n = 1;
    if (get_int(o, "n", 1, lim->max_n > 0 ? lim->max_n : 16, &n, err) < 0) return -1;
    p->n = (int32_t)n;
    if (get_bool(o, "stream", &p->stream, err) < 0) return -1;
    json_t *so = json_object_get(o, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) {
            bad(err, "stream_options", "'%s' must be an object", "stream_options");
            return -1;
        }
        if (get_bool(so, "include_usage", &p->include_usage, err) < 0) return -1;
    }
    if ((r = get_bool(o, "ignore_eos", &b, err)) < 0) return -1;
    if (r) s->ignore_eos = b;
    if (parse_stop(o, p, err) < 0) return -1;
    s->stop = (const char *const *)p->stops;
    s->n_stop = p->n_stops;
    if ((r = get_num(o, "presence_penalty", -2.0, 2.0, 0, &d, err)) < 0) return -1;
    if (r) s->presence_penalty = (float)d;
    if ((r = get_num(o, "frequency_penalty", -2.0, 2.0, 0, &d, err)) < 0) return -1;
    if (r) s->frequency_penalty = (float)d;
    if ((r = get_num(o, "repetition_penalty", 0.0, FLT_MAX, 1, &d, err)) < 0) return -1;
    if (r) s->repetition_penalty = (float)d;
    if (parse_logit_bias(o, s, err) < 0) return -1;
    if (parse_stop_token_ids(o, s, err) < 0) return -1;
    if ((r = get_int(o, "min_tokens", 0, INT32_MAX, &i, err)) < 0) return -1;
    if (r) s->min_tokens = (int32_t)i;
    if ((r = get_bool(o, "include_stop_str_in_output", &b, err)) < 0) return -1;
    if (r) s->include_stop_str = b;
    if ((r = get_int(o, "best_of", 1, 1 << 20, &i, err)) < 0) return -1;
    if (r && i != p->n) {
        bad(err, "best_of", "'%s' other than n is not supported by this server", "best_of");
        return -1;
    }
    json_t *rf = json_object_get(o, "response_format");
    if (rf && !json_is_null(rf)) {
        json_t *t = json_object_get(rf, "type");
        if (!json_is_object(rf) || !json_is_string(t) || strcmp(json_string_value(t), "text")) {
            bad(err, "response_format", "'%s' other than {\"type\": \"text\"} is not supported", "response_format");
            return -1;
        }
    }
    return refuse_unsupported(o, err);
}

/* ---- /v1/completions ------------------------------------------------------- */

static int token_array(json_t *a, cas_srv_prompt *pr, cas_srv_error *err) {
    size_t n = json_array_size(a);
    if (n == 0) {
        bad(err, "prompt", "'%s' must not be empty", "prompt");
        return -1;
    }
    if (n > (1u << 24)) {
        bad(err, "prompt", "'%s' is too long", "prompt");
        return -1;
    }
    pr->tokens = malloc(n * sizeof *pr->tokens);
    if (!pr->tokens) {
        oom(err);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(a, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) > INT32_MAX) {
            bad(err, "prompt", "'%s' token ids must be integers >= 0", "prompt");
            return -1;
        }
        pr->tokens[i] = (int32_t)json_integer_value(t);
    }
    pr->n_tokens = (int32_t)n;
    return 0;
}

static int parse_prompt(json_t *o, cas_srv_parsed *p, cas_srv_error *err) {
    json_t *x = json_object_get(o, "prompt");
    if (!x || json_is_null(x)) {
        bad(err, "prompt", "'%s' is a required property", "prompt");
        return -1;
    }
    const char *shape = "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids";
    if (json_is_string(x)) {
        if (!(p->prompts = calloc(1, sizeof *p->prompts))) goto nomem;
        p->n_prompts = 1;
        if (!(p->prompts[0].text = dup_n(json_string_value(x), json_string_length(x)))) goto nomem;
        return 0;
    }
    if (!json_is_array(x)) {
        bad(err, "prompt", "%s", shape);
        return -1;
    }
    size_t n = json_array_size(x);
    if (n == 0) {
        bad(err, "prompt", "'%s' must not be empty", "prompt");
        return -1;
    }
    json_t *first = json_array_get(x, 0);
    if (json_is_integer(first)) { /* one prompt of token ids */
        if (!(p->prompts = calloc(1, sizeof *p->prompts))) goto nomem;
        p->n_prompts = 1;
        return token_array(x, &p->prompts[0], err);
    }
    if (n > MAX_PROMPTS) {
        bad(err, "prompt", "'prompt' has more than %s entries", "256");
        return -1;
    }
    if (!(p->prompts = calloc(n, sizeof *p->prompts))) goto nomem;
    int strings = json_is_string(first);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(x, i);
        p->n_prompts = (int32_t)i + 1;
        if (strings && json_is_string(e)) {
            if (!(p->prompts[i].text = dup_n(json_string_value(e), json_string_length(e)))) goto nomem;
        } else if (!strings && json_is_array(e)) {
            if (token_array(e, &p->prompts[i], err) < 0) return -1;
        } else {
            bad(err, "prompt", "%s", shape);
            return -1;
        }
    }
    return 0;
nomem:
    oom(err);
    return -1;
}

static int parse_completions(json_t *o, cas_srv_parsed *p, const cas_srv_limits *lim, cas_srv_error *err) {
    if (parse_prompt(o, p, err) < 0) return -1;
    if (parse_common(o, p, lim, err) < 0) return -1;
    if ((long long)p->n_prompts * p->n > MAX_PROMPTS) {
        bad(err, "n", "'prompt' entries times 'n' exceed %s", "256");
        return -1;
    }
    long long v;
    int r = get_int(o, "max_tokens", 1, INT32_MAX, &v, err);
    if (r < 0) return -1;
    p->sampling.max_tokens = r ? (int32_t)v : 16; /* OpenAI's default for completions */
    p->max_tokens_set = 1;
    if ((r = get_int(o, "logprobs", 0, MAX_TOP_LOGPROBS, &v, err)) < 0) return -1;
    if (r) {
        p->logprobs = 1;
        p->top_logprobs = (int32_t)v;
    }
    int echo = 0;
    if (get_bool(o, "echo", &echo, err) < 0) return -1;
    if (echo && p->logprobs) {
        /* OpenAI's echo with logprobs scores the prompt too: prompt_logprobs */
        bad(err, "echo", "'%s' with 'logprobs' is not supported by this server (it needs the prompt's log-probabilities)",
            "echo");
        return -1;
    }
    p->sampling.echo = echo;
    static const char *const chat_only[] = {"chat_template_kwargs", "tools"};
    for (size_t i = 0; i < sizeof chat_only / sizeof chat_only[0]; i++) {
        json_t *x = json_object_get(o, chat_only[i]);
        if (x && !json_is_null(x) && !((json_is_array(x) || json_is_object(x)) && json_object_size(x) + json_array_size(x) == 0)) {
            bad(err, chat_only[i], "'%s' applies to chat completions (/v1/chat/completions) only", chat_only[i]);
            return -1;
        }
    }
    json_t *suffix = json_object_get(o, "suffix");
    if (suffix && !json_is_null(suffix)) {
        if (!json_is_string(suffix)) {
            bad(err, "suffix", "'%s' must be a string", "suffix");
            return -1;
        }
        if (json_string_length(suffix)) {
            bad(err, "suffix", "'%s' is not supported by this server", "suffix");
            return -1;
        }
    }
    return check_min_tokens(p, err);
}

/* ---- /v1/chat/completions -------------------------------------------------- */

/* Content: a string, a non-empty list of text parts (their texts
 * concatenated), or null (assistant only). Errors name messages[i].content. */
static char *message_content(json_t *c, size_t idx, int allow_null, cas_srv_error *err) {
    char param[48];
    snprintf(param, sizeof param, "messages[%zu].content", idx);
    if (!c || json_is_null(c)) {
        if (allow_null) return dup_n("", 0);
        bad(err, param, "'%s' entries need a 'content'", "messages");
        return NULL;
    }
    if (json_is_string(c)) return dup_n(json_string_value(c), json_string_length(c));
    if (!json_is_array(c)) {
        bad(err, param, "'%s' must be a string or a list of text parts", param);
        return NULL;
    }
    size_t total = 0, n = json_array_size(c);
    if (n == 0) {
        bad(err, param, "'%s' must not be an empty list", param);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *part = json_array_get(c, i);
        json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type)) {
            bad(err, param, "'%s' parts must be objects with a 'type'", param);
            return NULL;
        }
        if (strcmp(json_string_value(type), "text")) {
            bad(err, param, "'%s' part type '%.40s' is not supported by this server (only 'text')", param,
                json_string_value(type));
            return NULL;
        }
        if (!json_is_string(text)) {
            bad(err, param, "'%s' text parts need a string 'text'", param);
            return NULL;
        }
        total += json_string_length(text);
    }
    char *s = malloc(total + 1), *w = s;
    if (!s) return NULL;
    for (size_t i = 0; i < n; i++) {
        json_t *text = json_object_get(json_array_get(c, i), "text");
        memcpy(w, json_string_value(text), json_string_length(text));
        w += json_string_length(text);
    }
    *w = 0;
    return s;
}

/* ---- tool calling and the template's variables ------------------------------ */

#define MAX_TOOLS 1024

/* An assistant message's tool_calls, OpenAI's shape ({"id", "type":
 * "function", "function": {"name", "arguments"}}), as the template gets
 * them: copied as given, with each arguments string (a JSON object's text)
 * decoded into the object, as vLLM and transformers pass them (Qwen2.5's
 * template prints `arguments | tojson`; a string would come out quoted).
 * 1 with *out a new list; 0 for none (absent, null or empty); -1 with err. */
static int message_tool_calls(json_t *tc, size_t idx, json_t **out, cas_srv_error *err) {
    char param[64];
    *out = NULL;
    snprintf(param, sizeof param, "messages[%zu].tool_calls", idx);
    if (!tc || json_is_null(tc)) return 0;
    if (!json_is_array(tc)) {
        bad(err, param, "'%s' must be a list", param);
        return -1;
    }
    if (json_array_size(tc) == 0) return 0;
    json_t *list = json_deep_copy(tc);
    if (!list) {
        oom(err);
        return -1;
    }
    for (size_t i = 0; i < json_array_size(list); i++) {
        json_t *c = json_array_get(list, i), *fn = json_object_get(c, "function");
        json_t *type = json_object_get(c, "type"), *id = json_object_get(c, "id");
        snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu]", idx, i);
        if (!json_is_object(c) || !json_is_object(fn)) {
            bad(err, param, "'%s' must be an object with a 'function' object", param);
            goto fail;
        }
        if (type && !json_is_null(type) && !(json_is_string(type) && !strcmp(json_string_value(type), "function"))) {
            bad(err, param, "'%s.type' must be \"function\"", param);
            goto fail;
        }
        if (id && !json_is_null(id) && !json_is_string(id)) {
            bad(err, param, "'%s.id' must be a string", param);
            goto fail;
        }
        json_t *name = json_object_get(fn, "name"), *args = json_object_get(fn, "arguments");
        if (!json_is_string(name) || json_string_length(name) == 0) {
            bad(err, param, "'%s.function.name' must be a non-empty string", param);
            goto fail;
        }
        json_t *obj = NULL;
        if (!args || json_is_null(args)) {
            obj = json_object();
        } else if (json_is_object(args)) {
            continue; /* already an object (some clients send one) */
        } else if (json_is_string(args)) {
            const char *a = json_string_value(args);
            size_t n = json_string_length(args), k = 0;
            while (k < n && (a[k] == ' ' || a[k] == '\t' || a[k] == '\n' || a[k] == '\r')) k++;
            obj = k == n ? json_object() : json_loadb(a, n, 0, NULL); /* "" is a call without arguments */
        }
        if (!json_is_object(obj)) {
            json_decref(obj);
            bad(err, param, "'%s.function.arguments' must be a JSON object encoded as a string", param);
            goto fail;
        }
        json_object_set_new(fn, "arguments", obj);
    }
    *out = list;
    return 1;
fail:
    json_decref(list);
    return -1;
}

/* tools: [{"type": "function", "function": {"name", "description"?,
 * "parameters"?, "strict"?}}], given to the template as sent. 1 with *out a
 * new reference; 0 for none (absent, null or empty); -1 with err. */
static int parse_tools(json_t *o, json_t **out, cas_srv_error *err) {
    char param[64];
    json_t *x = json_object_get(o, "tools");
    *out = NULL;
    if (!x || json_is_null(x)) return 0;
    if (!json_is_array(x)) {
        bad(err, "tools", "'%s' must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools");
        return -1;
    }
    if (json_array_size(x) == 0) return 0;
    if (json_array_size(x) > MAX_TOOLS) {
        bad(err, "tools", "'tools' has more than %d entries", MAX_TOOLS);
        return -1;
    }
    for (size_t i = 0; i < json_array_size(x); i++) {
        json_t *t = json_array_get(x, i), *type = json_object_get(t, "type"), *fn = json_object_get(t, "function");
        snprintf(param, sizeof param, "tools[%zu]", i);
        if (!json_is_object(t)) {
            bad(err, param, "'%s' must be an object", param);
            return -1;
        }
        if (!json_is_string(type) || strcmp(json_string_value(type), "function")) {
            bad(err, param, "'%s.type' must be \"function\" (the only kind of tool this server calls)", param);
            return -1;
        }
        if (!json_is_object(fn)) {
            bad(err, param, "'%s.function' must be an object", param);
            return -1;
        }
        json_t *name = json_object_get(fn, "name"), *desc = json_object_get(fn, "description");
        json_t *params = json_object_get(fn, "parameters"), *strict = json_object_get(fn, "strict");
        if (!json_is_string(name) || json_string_length(name) == 0) {
            bad(err, param, "'%s.function.name' must be a non-empty string", param);
            return -1;
        }
        if (desc && !json_is_null(desc) && !json_is_string(desc)) {
            bad(err, param, "'%s.function.description' must be a string", param);
            return -1;
        }
        if (params && !json_is_null(params) && !json_is_object(params)) {
            bad(err, param, "'%s.function.parameters' must be an object (a JSON Schema)", param);
            return -1;
        }
        if (strict && !json_is_null(strict) && !json_is_boolean(strict)) {
            bad(err, param, "'%s.function.strict' must be a boolean", param);
            return -1;
        }
    }
    *out = json_incref(x);
    return 1;
}

/* tool_choice: 1 when tools are offered ("auto", or absent), 0 for "none",
 * -1 with err for what this server does not do: "required" and a named
 * function need decoding constrained to a call's grammar. */
static int parse_tool_choice(json_t *o, cas_srv_error *err) {
    json_t *x = json_object_get(o, "tool_choice");
    if (!x || json_is_null(x)) return 1;
    const char *v = json_is_string(x) ? json_string_value(x) : NULL;
    if (v && !strcmp(v, "auto")) return 1;
    if (v && !strcmp(v, "none")) return 0;
    if ((v && !strcmp(v, "required")) || json_is_object(x)) {
        bad(err, "tool_choice",
            "'tool_choice' %s is not supported by this server: forcing a call needs decoding constrained to the "
            "call's grammar, which it does not do; use \"auto\" (the model may call a tool) or \"none\"",
            v ? "\"required\"" : "naming a function");
        return -1;
    }
    bad(err, "tool_choice",
        "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    return -1;
}

/* chat_template_kwargs: an object whose keys become the template's variables
 * (enable_thinking, ...), except those the server sets. 1 with *out a
 * borrowed reference, 0 for none (absent, null or {}), -1 with err. */
static int parse_template_kwargs(json_t *o, json_t **out, cas_srv_error *err) {
    static const char *const reserved[] = {"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                           "eos_token"};
    json_t *x = json_object_get(o, "chat_template_kwargs");
    *out = NULL;
    if (!x || json_is_null(x)) return 0;
    if (!json_is_object(x)) {
        bad(err, "chat_template_kwargs", "'%s' must be an object of the template's variables", "chat_template_kwargs");
        return -1;
    }
    for (size_t i = 0; i < sizeof reserved / sizeof reserved[0]; i++)
        if (json_object_get(x, reserved[i])) {
            bad(err, "chat_template_kwargs", "'chat_template_kwargs' may not set '%s' (the server sets it from the request)",
                reserved[i]);
            return -1;
        }
    if (json_object_size(x) == 0) return 0;
    *out = x;
    return 1;
}

/* ---- /v1/chat/completions (continued) ----------------------------------------- */

/* The messages into p->msgs and, for the template's JSON context, into
 * *jmsgs (a new list: role, content as text, name, tool_calls,
 * tool_call_id); *tool_msgs is set when one has tool calls or is a tool's
 * result (which roles and texts alone cannot carry). */
static int parse_messages(json_t *o, cas_srv_parsed *p, json_t **jmsgs, int *tool_msgs, cas_srv_error *err) {
    json_t *ms = json_object_get(o, "messages");
    if (!ms || json_is_null(ms)) {
        bad(err, "messages", "'%s' is a required property", "messages");
        return -1;
    }
    if (!json_is_array(ms) || json_array_size(ms) == 0) {
        bad(err, "messages", "'%s' must be a non-empty list", "messages");
        return -1;
    }
    size_t n = json_array_size(ms);
    if (n > 100000) {
        bad(err, "messages", "'%s' has too many entries", "messages");
        return -1;
    }
    if (!(p->msgs = calloc(n, sizeof *p->msgs)) || !(*jmsgs = json_array())) goto nomem;
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(ms, i);
        json_t *role = json_object_get(m, "role");
        if (!json_is_object(m) || !json_is_string(role)) {
            bad(err, "messages", "'%s' entries must be objects with a string 'role'", "messages");
            return -1;
        }
        const char *r = json_string_value(role);
        const char *canon = !strcmp(r, "system") || !strcmp(r, "developer") ? "system"
                            : !strcmp(r, "user")                            ? "user"
                            : !strcmp(r, "assistant")                       ? "assistant"
                            : !strcmp(r, "tool")                            ? "tool"
                                                                            : NULL;
        if (!canon) {
            bad(err, "messages", "'%s' role must be system, developer, user, assistant or tool", "messages");
            return -1;
        }
        int assistant = !strcmp(canon, "assistant");
        char *content = message_content(json_object_get(m, "content"), i, assistant, err);
        if (!content) {
            if (!err->message[0]) goto nomem;
            return -1;
        }
        p->msgs[i].content = content;
        p->n_msgs = (int32_t)i + 1;
        if (!(p->msgs[i].role = dup_n(canon, strlen(canon)))) goto nomem;

        char param[64];
        json_t *jm = json_pack("{s:s,s:o}", "role", canon, "content", json_stringn(content, strlen(content)));
        if (!jm || json_array_append_new(*jmsgs, jm)) goto nomem;
        json_t *name = json_object_get(m, "name");
        if (name && !json_is_null(name)) {
            if (!json_is_string(name)) {
                snprintf(param, sizeof param, "messages[%zu].name", i);
                bad(err, param, "'%s' must be a string", param);
                return -1;
            }
            json_object_set(jm, "name", name);
        }
        json_t *calls = NULL, *tc = json_object_get(m, "tool_calls");
        if (!assistant && tc && !json_is_null(tc)) {
            snprintf(param, sizeof param, "messages[%zu].tool_calls", i);
            bad(err, param, "'%s': only assistant messages have tool calls", param);
            return -1;
        }
        int rc = message_tool_calls(tc, i, &calls, err);
        if (rc < 0) return -1;
        if (rc) {
            json_object_set_new(jm, "tool_calls", calls);
            *tool_msgs = 1;
        }
        if (!strcmp(canon, "tool")) {
            json_t *id = json_object_get(m, "tool_call_id");
            if (!json_is_string(id)) {
                snprintf(param, sizeof param, "messages[%zu].tool_call_id", i);
                bad(err, param, "'%s' is required: the id of the call this message answers", param);
                return -1;
            }
            json_object_set(jm, "tool_call_id", id);
            *tool_msgs = 1;
        }
    }
    return 0;
nomem:
    oom(err);
    return -1;
}

static int parse_chat_fields(json_t *o, cas_srv_parsed *p, const cas_srv_limits *lim, json_t **jmsgs, json_t **tools,
                             cas_srv_error *err) {
    int tool_msgs = 0;
    if (parse_messages(o, p, jmsgs, &tool_msgs, err) < 0) return -1;
    if (parse_common(o, p, lim, err) < 0) return -1;
    long long v;
    int r = get_int(o, "max_completion_tokens", 1, INT32_MAX, &v, err);
    if (r < 0) return -1;
    if (!r && (r = get_int(o, "max_tokens", 1, INT32_MAX, &v, err)) < 0) return -1;
    if (r) {
        p->sampling.max_tokens = (int32_t)v;
        p->max_tokens_set = 1;
    }
    if (get_bool(o, "logprobs", &p->logprobs, err) < 0) return -1;
    if ((r = get_int(o, "top_logprobs", 0, MAX_TOP_LOGPROBS, &v, err)) < 0) return -1;
    if (r) {
        if (!p->logprobs) {
            bad(err, "top_logprobs", "'%s' needs 'logprobs' set to true", "top_logprobs");
            return -1;
        }
        p->top_logprobs = (int32_t)v;
    }

    /* tool calling: the tools go to the template unless tool_choice is "none" */
    int have_tools = parse_tools(o, tools, err);
    if (have_tools < 0) return -1;
    int offer = parse_tool_choice(o, err);
    if (offer < 0) return -1;
    p->parallel_tool_calls = 1;
    if (get_bool(o, "parallel_tool_calls", &p->parallel_tool_calls, err) < 0) return -1;
    p->tools_rendered = p->parse_tool_calls = have_tools && offer;
    json_t *kwargs = NULL;
    int have_kwargs = parse_template_kwargs(o, &kwargs, err);
    if (have_kwargs < 0) return -1;
    if (p->tools_rendered || tool_msgs || have_kwargs) {
        /* the context Hugging Face's apply_chat_template gives a template, as cas_chat_apply makes it */
        json_t *ctx = json_pack("{s:O,s:b,s:O}", "messages", *jmsgs, "add_generation_prompt", 1, "tools",
                                p->tools_rendered ? *tools : json_null());
        if (!ctx || (kwargs && json_object_update(ctx, kwargs))) {
            json_decref(ctx);
            oom(err);
            return -1;
        }
        p->chat_json = json_dumps(ctx, JSON_COMPACT);
        json_decref(ctx);
        if (!p->chat_json) {
            oom(err);
            return -1;
        }
        p->chat_json_param = p->tools_rendered ? "tools" : tool_msgs ? "messages" : "chat_template_kwargs";
    }

    json_t *fc = json_object_get(o, "function_call");
    if (fc && !json_is_null(fc) &&
        !(json_is_string(fc) && (!strcmp(json_string_value(fc), "none") || !strcmp(json_string_value(fc), "auto")))) {
        bad(err, "function_call", "'%s' is not supported by this server", "function_call");
        return -1;
    }
    /* vLLM's chat echo repeats the last message when it is the assistant's: not implemented */
    int echo = 0;
    if (get_bool(o, "echo", &echo, err) < 0) return -1;
    if (echo) {
        bad(err, "echo", "'%s' is not supported on chat completions by this server", "echo");
        return -1;
    }
    json_t *mod = json_object_get(o, "modalities");
    if (mod && !json_is_null(mod)) {
        int text_only = json_is_array(mod);
        for (size_t i = 0; text_only && i < json_array_size(mod); i++) {
            json_t *m = json_array_get(mod, i);
            text_only = json_is_string(m) && !strcmp(json_string_value(m), "text");
        }
        if (!text_only) {
            bad(err, "modalities", "'%s' other than [\"text\"] are not supported by this server", "modalities");
            return -1;
        }
    }
    return check_min_tokens(p, err);
}

static int parse_chat(json_t *o, cas_srv_parsed *p, const cas_srv_limits *lim, cas_srv_error *err) {
    json_t *jmsgs = NULL, *tools = NULL;
    int rc = parse_chat_fields(o, p, lim, &jmsgs, &tools, err);
    json_decref(jmsgs);
    json_decref(tools);
    return rc;
}

/* ---- entry ------------------------------------------------------------------ */

cas_srv_route cas_srv_parse(const cas_srv_limits *lim, const char *method, const char *path,
                            const char *authorization, const char *body, size_t body_len,
                            cas_srv_parsed *out, cas_srv_error *err) {
    memset(out, 0, sizeof *out);
    memset(err, 0, sizeof *err);
    /* OpenAI's defaults (not the engine's: this file links without it) */
    out->sampling.temperature = 1.0f;
    out->sampling.top_p = 1.0f;
    out->sampling.max_tokens = 16;
    out->n = 1;
    if (!method || !path) {
        cas_srv_error_set(err, 400, "invalid_request_error", NULL, NULL, "malformed request");
        return CAS_SRV_ROUTE_NONE;
    }
    size_t plen = strcspn(path, "?");
    if (!strncmp(path, "/v1/", 4) && !authorized(lim->api_key, authorization)) {
        cas_srv_error_set(err, 401, "authentication_error", "invalid_api_key", NULL,
                          authorization ? "Incorrect API key provided."
                                        : "You didn't provide an API key. Provide it as 'Authorization: Bearer KEY'.");
        return CAS_SRV_ROUTE_NONE;
    }
    cas_srv_route route = CAS_SRV_ROUTE_NONE;
    const char *allow = NULL;
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (strlen(routes[i].path) != plen || strncmp(routes[i].path, path, plen)) continue;
        allow = routes[i].method;
        if (!strcmp(routes[i].method, method)) route = routes[i].route;
    }
    if (route == CAS_SRV_ROUTE_NONE) {
        if (allow) {
            cas_srv_error_set(err, 405, "invalid_request_error", "method_not_allowed", NULL,
                              "Method %.16s not allowed on %.200s (use %s)", method, path, allow);
            err->allow = allow;
        } else {
            cas_srv_error_set(err, 404, "invalid_request_error", "not_found", NULL,
                              "Unknown route %.16s %.200s", method, path);
        }
        return CAS_SRV_ROUTE_NONE;
    }
    out->route = route;
    if (route != CAS_SRV_ROUTE_COMPLETIONS && route != CAS_SRV_ROUTE_CHAT) return route;

    if (lim->max_body_bytes && body_len > lim->max_body_bytes) {
        cas_srv_error_set(err, 413, "invalid_request_error", "request_too_large", NULL,
                          "Request body of %zu bytes exceeds the limit of %zu bytes", body_len,
                          lim->max_body_bytes);
        goto fail;
    }
    json_error_t jerr;
    json_t *o = body_len ? json_loadb(body, body_len, 0, &jerr) : NULL;
    if (!o) {
        if (body_len)
            cas_srv_error_set(err, 400, "invalid_request_error", "invalid_json", NULL,
                              "Invalid JSON body: %s (line %d, column %d)", jerr.text, jerr.line, jerr.column);
        else
            cas_srv_error_set(err, 400, "invalid_request_error", "invalid_json", NULL,
                              "The request needs a JSON body");
        goto fail;
    }
    if (!json_is_object(o)) {
        json_decref(o);
        cas_srv_error_set(err, 400, "invalid_request_error", "invalid_json", NULL,
                          "The request body must be a JSON object");
        goto fail;
    }
    int rc = route == CAS_SRV_ROUTE_CHAT ? parse_chat(o, out, lim, err) : parse_completions(o, out, lim, err);
    json_decref(o);
    if (rc < 0) goto fail;
    return route;
fail:
    cas_srv_parsed_free(out);
    out->route = CAS_SRV_ROUTE_NONE;
    if (!err->status) cas_srv_error_set(err, 400, "invalid_request_error", NULL, NULL, "invalid request");
    return CAS_SRV_ROUTE_NONE;
}
