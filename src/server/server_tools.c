/*
 * server_tools.c: finds the tool calls in a chat model's generated text, as
 * Hermes-style templates (Qwen2.5, Qwen3, Hermes 2/3) ask the model to write
 * them: one JSON object {"name": ..., "arguments": {...}} between
 * <tool_call> and </tool_call>, as many blocks as calls. vLLM's `hermes`
 * tool parser and llama.cpp's Hermes 2 Pro format read the same text.
 *
 * One incremental scanner serves both kinds of response: a stream feeds it
 * each piece of text as the engine delivers it and sends whatever it has
 * decided (content that cannot be part of a block, calls whose block has
 * closed), while a whole answer feeds it everything at once. The decisions
 * depend on the text only, never on where it was cut, so a stream's content
 * and calls are exactly the whole answer's (tests/test_server_tools.c cuts a
 * text at every byte).
 *
 * The rules:
 *   - a block is "<tool_call>", optional whitespace, one JSON object,
 *     optional whitespace, "</tool_call>". The object's end is found by its
 *     braces outside strings, so an argument string may hold "</tool_call>"
 *     or "}". It must parse (jansson) and have a non-empty string "name";
 *     "arguments" may be an object (its text is kept as the model wrote it),
 *     a string holding a JSON object's text (kept as is), or absent or
 *     null ("{}").
 *   - a block that breaks a rule (no object after the tag, a '<' outside
 *     the object's strings, text before the closing tag, JSON that does not
 *     parse or names nothing, no closing tag before the text ends) is not a
 *     call: its opening tag is content, and scanning resumes right after it,
 *     so a well-formed block later in the text is still found.
 *   - content is the text outside the well-formed blocks, byte for byte,
 *     less the stretches that hold only whitespace and lie between two
 *     blocks or between a block and the text's start or end (the newlines
 *     a model writes around its calls). Without a call, content is the
 *     whole text.
 *
 * So a stream holds back, and sends later, only text that may still turn
 * out to belong to a block or to such a stretch: a tail that could begin
 * "<tool_call>", whitespace since the start or the last call, and a block
 * until its closing tag.
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "server_impl.h"

static const char OPEN[] = "<tool_call>";
static const char CLOSE[] = "</tool_call>";
#define OPEN_N (sizeof OPEN - 1)
#define CLOSE_N (sizeof CLOSE - 1)

/* where a block's scan is */
enum { P_START, P_JSON, P_AFTER, P_CLOSE };

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static int grow(char **p, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    char *q = realloc(*p, c);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* Appends n bytes to the decided content (kept NUL-terminated). */
static void put(cas_srv_tools *t, const char *s, size_t n) {
    if (t->failed || !n) return;
    if (grow(&t->content, &t->content_cap, t->content_len + n + 1)) {
        t->failed = 1;
        return;
    }
    memcpy(t->content + t->content_len, s, n);
    t->content_len += n;
    t->content[t->content_len] = 0;
}

/* Drops the first n bytes of the undecided text. */
static void drop(cas_srv_tools *t, size_t n) {
    if (!n) return; /* pend may still be NULL */
    memmove(t->pend, t->pend + n, t->pend_len - n);
    t->pend_len -= n;
    t->pos = t->pos > n ? t->pos - n : 0;
}

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

/* ---- the spans of a JSON text that jansson has accepted -------------------- */

static size_t skip_ws(const char *s, size_t i, size_t n) {
    while (i < n && is_ws(s[i])) i++;
    return i;
}

/* s[i] is '"': the index after the closing quote */
static size_t skip_string(const char *s, size_t i, size_t n) {
    for (i++; i < n; i++) {
        if (s[i] == '\\') i++;
        else if (s[i] == '"') return i + 1;
    }
    return n;
}

static size_t skip_value(const char *s, size_t i, size_t n) {
    if (i >= n) return n;
    if (s[i] == '"') return skip_string(s, i, n);
    if (s[i] == '{' || s[i] == '[') {
        int depth = 0;
        while (i < n) {
            char c = s[i];
            if (c == '"') {
                i = skip_string(s, i, n);
                continue;
            }
            if (c == '{' || c == '[') depth++;
            else if ((c == '}' || c == ']') && --depth == 0) return i + 1;
            i++;
        }
        return n;
    }
    while (i < n && s[i] != ',' && s[i] != '}' && s[i] != ']' && !is_ws(s[i])) i++;
    return i;
}

/* The text of the top-level object's member `key` (the last one, as
 * jansson keeps the last of repeated keys): 0 and [*b, *e), or -1. */
static int member_span(const char *s, size_t n, const char *key, size_t *b, size_t *e) {
    int found = -1;
    size_t i = skip_ws(s, 0, n);
    if (i >= n || s[i] != '{') return -1;
    i++;
    for (;;) {
        i = skip_ws(s, i, n);
        if (i >= n || s[i] != '"') return found;
        size_t ks = i, ke = skip_string(s, i, n);
        int match;
        if (memchr(s + ks, '\\', ke - ks)) { /* an escaped key: jansson decodes it */
            json_t *k = json_loadb(s + ks, ke - ks, JSON_DECODE_ANY, NULL);
            match = json_is_string(k) && !strcmp(json_string_value(k), key);
            json_decref(k);
        } else {
            match = ke - ks == strlen(key) + 2 && !memcmp(s + ks + 1, key, ke - ks - 2);
        }
        i = skip_ws(s, ke, n);
        if (i >= n || s[i] != ':') return found;
        size_t vb = skip_ws(s, i + 1, n), ve = skip_value(s, vb, n);
        if (match) {
            *b = vb;
            *e = ve;
            found = 0;
        }
        i = skip_ws(s, ve, n);
        if (i >= n || s[i] != ',') return found;
        i++;
    }
}

/* ---- calls ----------------------------------------------------------------- */

/* The call a block's JSON text describes, added to t->calls: 1; 0 if the
 * text is not a call (it stays content); 0 with t->failed on no memory. */
static int add_call(cas_srv_tools *t, const char *js, size_t n) {
    /* integers as reals: a huge number in the arguments is still valid JSON */
    json_t *o = json_loadb(js, n, JSON_DECODE_INT_AS_REAL, NULL);
    json_t *name = json_object_get(o, "name"), *args = json_object_get(o, "arguments");
    const char *a = NULL;
    size_t alen = 0, b, e;
    int ok = json_is_object(o) && json_is_string(name) && json_string_length(name) > 0;
    if (ok && (!args || json_is_null(args))) {
        a = "{}";
        alen = 2;
    } else if (ok && json_is_object(args) && member_span(js, n, "arguments", &b, &e) == 0) {
        a = js + b;
        alen = e - b;
    } else if (ok && json_is_string(args)) {
        /* arguments already encoded as OpenAI sends them: a JSON object's text */
        json_t *inner = json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_INT_AS_REAL, NULL);
        ok = json_is_object(inner);
        json_decref(inner);
        a = json_string_value(args);
        alen = json_string_length(args);
    } else {
        ok = 0;
    }
    if (ok && t->n_calls == t->calls_cap) {
        int32_t cap = t->calls_cap ? t->calls_cap * 2 : 4;
        cas_srv_tool_call *c = realloc(t->calls, (size_t)cap * sizeof *c);
        if (c) {
            t->calls = c;
            t->calls_cap = cap;
        } else {
            t->failed = 1;
            ok = 0;
        }
    }
    if (ok) {
        cas_srv_tool_call *c = &t->calls[t->n_calls];
        c->name = dup_n(json_string_value(name), json_string_length(name));
        c->arguments = dup_n(a, alen);
        if (c->name && c->arguments) {
            t->n_calls++;
        } else {
            free(c->name);
            free(c->arguments);
            t->failed = 1;
            ok = 0;
        }
    }
    json_decref(o);
    return ok;
}

/* ---- the scanner ------------------------------------------------------------ */

static int all_ws(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!is_ws(s[i])) return 0;
    return 1;
}

/* Decides what the undecided text allows; with final, all of it. */
static void scan(cas_srv_tools *t, int final) {
    for (;;) {
        if (!t->in_block) {
            const char *o = t->pend_len ? memmem(t->pend, t->pend_len, OPEN, OPEN_N) : NULL;
            if (o) {
                size_t i = (size_t)(o - t->pend);
                if (t->seg_text || !all_ws(t->pend, i)) {
                    put(t, t->pend, i);
                    drop(t, i);
                    t->seg_text = 1;
                    i = 0;
                }
                /* else whitespace alone since the start or the last call: it goes with the block if it is one */
                t->in_block = 1;
                t->ws = i;
                t->pos = i + OPEN_N;
                t->phase = P_START;
                t->depth = t->in_str = t->esc = 0;
                continue;
            }
            if (final) {
                /* whitespace alone after the last call is not content; any other text is */
                if (t->seg_text || !all_ws(t->pend, t->pend_len) || t->n_calls == 0) put(t, t->pend, t->pend_len);
                drop(t, t->pend_len);
                return;
            }
            /* a tail that may begin the opening tag waits */
            size_t keep = 0;
            for (size_t k = t->pend_len < OPEN_N - 1 ? t->pend_len : OPEN_N - 1; k > 0; k--)
                if (!memcmp(t->pend + t->pend_len - k, OPEN, k)) {
                    keep = k;
                    break;
                }
            size_t n = t->pend_len - keep;
            if (!t->seg_text && all_ws(t->pend, n)) return; /* whitespace that may precede a block waits too */
            put(t, t->pend, n);
            drop(t, n);
            t->seg_text = 1;
            return;
        }
        /* in a block: pend[ws, ws + OPEN_N) is its tag, pend[pos] the next byte to judge */
        int verdict = 0; /* 1: closed well, -1: not a block */
        while (!verdict && t->pos < t->pend_len) {
            char c = t->pend[t->pos];
            switch (t->phase) {
            case P_START:
                if (c == '{') {
                    t->json_start = t->pos;
                    t->depth = 1;
                    t->phase = P_JSON;
                } else if (!is_ws(c)) {
                    verdict = -1;
                    continue;
                }
                break;
            case P_JSON:
                if (t->in_str) {
                    if (t->esc) t->esc = 0;
                    else if (c == '\\') t->esc = 1;
                    else if (c == '"') t->in_str = 0;
                } else if (c == '"') {
                    t->in_str = 1;
                } else if (c == '{' || c == '[') {
                    t->depth++;
                } else if (c == '}' || c == ']') {
                    if (--t->depth == 0) {
                        t->json_end = t->pos + 1;
                        t->phase = P_AFTER;
                    }
                } else if (c == '<') {
                    verdict = -1;
                    continue;
                }
                break;
            case P_AFTER:
                if (c == '<') {
                    t->close_at = t->pos;
                    t->phase = P_CLOSE;
                    continue; /* judged as the closing tag's first byte */
                }
                if (!is_ws(c)) {
                    verdict = -1;
                    continue;
                }
                break;
            default: /* P_CLOSE */
                if (c != CLOSE[t->pos - t->close_at]) {
                    verdict = -1;
                    continue;
                }
                if (t->pos + 1 - t->close_at == CLOSE_N) verdict = 1;
                break;
            }
            t->pos++;
        }
        if (!verdict && !final) return;
        if (verdict == 1 && add_call(t, t->pend + t->json_start, t->json_end - t->json_start)) {
            drop(t, t->pos);
            t->in_block = 0;
            t->seg_text = 0;
            continue;
        }
        /* not a call: the whitespace before it and the tag are content; the rest is scanned again */
        put(t, t->pend, t->ws + OPEN_N);
        drop(t, t->ws + OPEN_N);
        t->in_block = 0;
        t->seg_text = 1;
    }
}

void cas_srv_tools_feed(cas_srv_tools *t, const char *text, size_t n) {
    if (t->finished || !n) return;
    if (grow(&t->pend, &t->pend_cap, t->pend_len + n)) {
        /* no memory to hold text back: decide what there is and pass the rest through */
        t->failed = 1;
        scan(t, 1);
        put(t, text, n);
        return;
    }
    memcpy(t->pend + t->pend_len, text, n);
    t->pend_len += n;
    scan(t, 0);
}

void cas_srv_tools_finish(cas_srv_tools *t) {
    if (t->finished) return;
    scan(t, 1);
    t->finished = 1;
}

void cas_srv_tools_free(cas_srv_tools *t) {
    if (!t) return;
    for (int32_t i = 0; i < t->n_calls; i++) {
        free(t->calls[i].name);
        free(t->calls[i].arguments);
    }
    free(t->calls);
    free(t->content);
    free(t->pend);
    memset(t, 0, sizeof *t);
}
