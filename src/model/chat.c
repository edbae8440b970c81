/*
 * chat.c: renders a conversation into the prompt text a chat model was
 * trained on. Model files carry their template as Jinja source
 * (tokenizer.chat_template), and the file's own template is the
 * authority: it is compiled by the interpreter in jinja.c and rendered
 * with the variables Hugging Face's apply_chat_template passes (messages,
 * add_generation_prompt, bos_token, eos_token, tools = none).
 *
 * Two families also have a fixed routine here, recognised by their marker
 * tokens: ChatML (<|im_start|>role\ncontent<|im_end|>\n) and Llama 3
 * (<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent
 * <|eot_id|>, content trimmed as its template does). They are a fallback,
 * not a fast path: a family's members differ in details the routine cannot
 * see (Llama 3.1's template adds a dated system header, Qwen2.5's a default
 * system message, Qwen3's reasoning blocks), while rendering through the
 * interpreter costs microseconds per request. So a routine renders only a
 * template of its family that the interpreter cannot compile, or whose
 * rendering fails on an unsupported construct (each logged as a warning
 * naming the cause); a template's own raise_exception() is an error, never
 * a reason to fall back. The one part of a family that varies and matters
 * for the routine, a default system message inserted when the conversation
 * has none (SmolLM2, Qwen), is read out of the template's string literal.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"

/* ---- a growable string -------------------------------------------------- */

typedef struct {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = (b->n + n + 1) * 2;
        char *p = realloc(b->p, nc);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = nc;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

/* ---- recognising templates ---------------------------------------------- */

const char *cas_chat_kind_name(cas_chat_kind kind) {
    switch (kind) {
    case CAS_CHAT_CHATML: return "chatml";
    case CAS_CHAT_LLAMA3: return "llama3";
    case CAS_CHAT_JINJA: return "jinja";
    default: return "unknown";
    }
}

/* The default system message of a ChatML template: the literal text between
 * "<|im_start|>system" + newline and "<|im_end|>" inside a Jinja string, in a
 * template that tests whether the first message is a system message (SmolLM2:
 * `!= 'system'` before the literal; Qwen2.5: `== 'system'` with the literal
 * in the else branch). The newline may be a real one or the escape \n.
 * Returns a malloc'd string or NULL when the template has none. */
static char *chatml_default_system(const char *jinja) {
    if (!strstr(jinja, "!= 'system'") && !strstr(jinja, "!= \"system\"") && !strstr(jinja, "== 'system'") &&
        !strstr(jinja, "== \"system\""))
        return NULL;
    static const char open[] = "<|im_start|>system";
    for (const char *p = strstr(jinja, open); p; p = strstr(p + 1, open)) {
        const char *s = p + sizeof open - 1;
        if (*s == '\n') s += 1;
        else if (s[0] == '\\' && s[1] == 'n') s += 2;
        else continue;
        const char *e = strstr(s, "<|im_end|>");
        if (!e) return NULL;
        /* literal text only: no Jinja expression or string end inside */
        int literal = 1;
        for (const char *q = s; q < e; q++)
            if (*q == '{' || *q == '}' || *q == '\'' || *q == '"' || *q == '+') {
                if (q > s && q[-1] == '\\') continue;
                literal = 0;
                break;
            }
        if (!literal || e == s) continue;
        char *out = malloc((size_t)(e - s) + 1), *w = out;
        if (!out) return NULL;
        for (const char *q = s; q < e; q++) {
            if (*q == '\\' && q + 1 < e) {
                q++;
                *w++ = *q == 'n' ? '\n' : *q == 't' ? '\t' : *q;
            } else {
                *w++ = *q;
            }
        }
        *w = 0;
        return out;
    }
    return NULL;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

static cas_chat_kind family_of(const char *jinja) {
    if (strstr(jinja, "<|start_header_id|>") && strstr(jinja, "<|eot_id|>")) return CAS_CHAT_LLAMA3;
    if (strstr(jinja, "<|im_start|>") && strstr(jinja, "<|im_end|>")) return CAS_CHAT_CHATML;
    return CAS_CHAT_UNKNOWN;
}

cas_status cas_chat_template_create(const char *jinja, const char *bos_token, const char *eos_token,
                                    cas_chat_template *out) {
    if (!out) return cas_error(CAS_ERR_INVALID, "chat: out is NULL");
    memset(out, 0, sizeof *out);
    if (!jinja) return cas_error(CAS_ERR_INVALID, "chat: template is NULL");
    cas_chat_kind fam = family_of(jinja);
    if (!bos_token) bos_token = fam == CAS_CHAT_LLAMA3 ? "<|begin_of_text|>" : "";
    if (!eos_token) eos_token = fam == CAS_CHAT_LLAMA3 ? "<|eot_id|>" : fam == CAS_CHAT_CHATML ? "<|im_end|>" : "";
    out->bos_token = dup_str(bos_token);
    out->eos_token = dup_str(eos_token);
    if (!out->bos_token || !out->eos_token) {
        cas_chat_template_free(out);
        return cas_error(CAS_ERR_NOMEM, "chat: out of memory");
    }
    cas_status st = cas_jinja_compile(jinja, strlen(jinja), &out->jinja);
    if (st) {
        char why[512];
        snprintf(why, sizeof why, "%s", cas_last_error());
        if (st == CAS_ERR_NOMEM || fam == CAS_CHAT_UNKNOWN) {
            cas_chat_template_free(out);
            if (st == CAS_ERR_NOMEM) return st;
            return cas_error(CAS_ERR_UNSUPPORTED,
                             "chat: the chat template matches no known family (ChatML, Llama 3) and cannot be "
                             "interpreted: %s", why);
        }
        cas_log(CAS_LOG_WARN, "chat: %s; rendering with the built-in %s routine instead", why, cas_chat_kind_name(fam));
    }
    out->kind = fam == CAS_CHAT_UNKNOWN ? CAS_CHAT_JINJA : fam;
    out->tool_call_tag = strstr(jinja, "<tool_call>") != NULL;
    if (fam == CAS_CHAT_CHATML) out->default_system = chatml_default_system(jinja);
    out->includes_bos = fam == CAS_CHAT_LLAMA3 ? (strstr(jinja, "bos_token") || strstr(jinja, "<|begin_of_text|>"))
                                               : (bos_token[0] && strstr(jinja, "bos_token") != NULL);
    return CAS_OK;
}

cas_status cas_chat_template_parse(const char *jinja, cas_chat_template *out) {
    return cas_chat_template_create(jinja, NULL, NULL, out);
}

/* The text of the special token the file names under key, or "" for none. */
static char *token_text(const cas_gguf *g, const char *key) {
    uint32_t id;
    cas_gguf_arr toks;
    cas_gguf_str t = {"", 0};
    if (cas_gguf_find_kv(g, key) >= 0 && cas_gguf_get_u32(g, key, &id) == CAS_OK &&
        cas_gguf_get_arr(g, "tokenizer.ggml.tokens", CAS_GGUF_STRING, &toks) == CAS_OK && id < toks.n &&
        cas_gguf_arr_str(&toks, id, &t) != CAS_OK)
        t.ptr = "", t.len = 0;
    char *s = malloc(t.len + 1);
    if (!s) return NULL;
    if (t.len) memcpy(s, t.ptr, t.len);
    s[t.len] = 0;
    return s;
}

cas_status cas_chat_template_from_gguf_with(const cas_gguf *g, const char *jinja, cas_chat_template *out) {
    if (!g || !out) return cas_error(CAS_ERR_INVALID, "chat: NULL argument");
    memset(out, 0, sizeof *out);
    const char *s = jinja;
    cas_status st;
    if (!s) {
        if (cas_gguf_find_kv(g, "tokenizer.chat_template") < 0)
            return cas_error(CAS_ERR_FORMAT, "chat: the model file has no tokenizer.chat_template");
        if ((st = cas_gguf_get_str(g, "tokenizer.chat_template", &s, NULL))) return st;
    }
    char *bos = token_text(g, "tokenizer.ggml.bos_token_id"), *eos = token_text(g, "tokenizer.ggml.eos_token_id");
    if (!bos || !eos) st = cas_error(CAS_ERR_NOMEM, "chat: out of memory");
    else st = cas_chat_template_create(s, bos, eos, out);
    free(bos);
    free(eos);
    return st;
}

cas_status cas_chat_template_from_gguf(const cas_gguf *g, cas_chat_template *out) {
    return cas_chat_template_from_gguf_with(g, NULL, out);
}

int cas_chat_template_reads(const cas_chat_template *tpl, const char *name) {
    if (!tpl || !tpl->jinja) return -1;
    return cas_jinja_reads(tpl->jinja, name);
}

int cas_chat_template_tools(const cas_chat_template *tpl) {
    int r = cas_chat_template_reads(tpl, "tools");
    if (r <= 0) return r;
    return tpl->tool_call_tag ? CAS_CHAT_TOOLS_HERMES : CAS_CHAT_TOOLS_OTHER;
}

void cas_chat_template_free(cas_chat_template *tpl) {
    if (!tpl) return;
    free(tpl->default_system);
    free(tpl->bos_token);
    free(tpl->eos_token);
    cas_jinja_destroy(tpl->jinja);
    memset(tpl, 0, sizeof *tpl);
}

/* ---- rendering ----------------------------------------------------------- */

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

/* The fixed routine of the template's family. */
static cas_status builtin_apply(const cas_chat_template *tpl, const cas_chat_msg *msgs, size_t n,
                                int add_generation_prompt, char **out) {
    sbuf b = {0};
    sb_put(&b, "", 0);
    switch (tpl->kind) {
    case CAS_CHAT_CHATML:
        if (n && tpl->default_system && strcmp(msgs[0].role, "system")) {
            sb_str(&b, "<|im_start|>system\n");
            sb_str(&b, tpl->default_system);
            sb_str(&b, "<|im_end|>\n");
        }
        for (size_t i = 0; i < n; i++) {
            sb_str(&b, "<|im_start|>");
            sb_str(&b, msgs[i].role);
            sb_str(&b, "\n");
            sb_str(&b, msgs[i].content);
            sb_str(&b, "<|im_end|>\n");
        }
        if (add_generation_prompt) sb_str(&b, "<|im_start|>assistant\n");
        break;
    case CAS_CHAT_LLAMA3:
        if (n) sb_str(&b, "<|begin_of_text|>");
        for (size_t i = 0; i < n; i++) {
            const char *c = msgs[i].content, *e = c + strlen(c);
            while (c < e && is_space(*c)) c++;
            while (e > c && is_space(e[-1])) e--;
            sb_str(&b, "<|start_header_id|>");
            sb_str(&b, msgs[i].role);
            sb_str(&b, "<|end_header_id|>\n\n");
            sb_put(&b, c, (size_t)(e - c));
            sb_str(&b, "<|eot_id|>");
        }
        if (add_generation_prompt) sb_str(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    default:
        free(b.p);
        return cas_error(CAS_ERR_UNSUPPORTED, "chat: template kind %d cannot be rendered", (int)tpl->kind);
    }
    if (b.oom) {
        free(b.p);
        return cas_error(CAS_ERR_NOMEM, "chat: no memory for the prompt");
    }
    *out = b.p;
    return CAS_OK;
}

/* s as a JSON string literal */
static void sb_json(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc[8];
        if (*p == '"' || *p == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*p;
            sb_put(b, esc, 2);
        } else if (*p < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", *p);
            sb_put(b, esc, 6);
        } else {
            sb_put(b, (const char *)p, 1);
        }
    }
    sb_put(b, "\"", 1);
}

static cas_status render_json(const cas_chat_template *tpl, const char *ctx, const cas_jinja_limits *lim, char **out) {
    /* bos_token and eos_token go first: a key the context repeats replaces them */
    const char *p = ctx;
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    if (*p != '{') return cas_error(CAS_ERR_INVALID, "chat: the context must be a JSON object");
    p++;
    const char *q = p;
    while (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r') q++;
    sbuf b = {0};
    sb_str(&b, "{\"bos_token\": ");
    sb_json(&b, tpl->bos_token ? tpl->bos_token : "");
    sb_str(&b, ", \"eos_token\": ");
    sb_json(&b, tpl->eos_token ? tpl->eos_token : "");
    sb_str(&b, *q == '}' ? "" : ", ");
    sb_str(&b, p);
    if (b.oom) {
        free(b.p);
        return cas_error(CAS_ERR_NOMEM, "chat: no memory for the context");
    }
    cas_status st = cas_jinja_render(tpl->jinja, b.p, b.n, lim, out, NULL);
    free(b.p);
    return st;
}

cas_status cas_chat_apply_json(const cas_chat_template *tpl, const char *context_json, const cas_jinja_limits *lim,
                               char **out) {
    if (!tpl || !context_json || !out) return cas_error(CAS_ERR_INVALID, "chat: NULL argument");
    *out = NULL;
    if (!tpl->jinja) return cas_error(CAS_ERR_UNSUPPORTED, "chat: the template could not be compiled");
    return render_json(tpl, context_json, lim, out);
}

cas_status cas_chat_apply(const cas_chat_template *tpl, const cas_chat_msg *msgs, size_t n,
                          int add_generation_prompt, char **out) {
    if (!tpl || !out || (!msgs && n)) return cas_error(CAS_ERR_INVALID, "chat: NULL argument");
    *out = NULL;
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return cas_error(CAS_ERR_INVALID, "chat: message %zu has no role or content", i);
    if (!tpl->jinja) return builtin_apply(tpl, msgs, n, add_generation_prompt, out);
    sbuf b = {0};
    sb_str(&b, "{\"messages\": [");
    for (size_t i = 0; i < n; i++) {
        sb_str(&b, i ? ", {\"role\": " : "{\"role\": ");
        sb_json(&b, msgs[i].role);
        sb_str(&b, ", \"content\": ");
        sb_json(&b, msgs[i].content);
        sb_str(&b, "}");
    }
    sb_str(&b, add_generation_prompt ? "], \"add_generation_prompt\": true, \"tools\": null}"
                                     : "], \"add_generation_prompt\": false, \"tools\": null}");
    if (b.oom) {
        free(b.p);
        return cas_error(CAS_ERR_NOMEM, "chat: no memory for the prompt");
    }
    cas_status st = render_json(tpl, b.p, NULL, out);
    free(b.p);
    if (st == CAS_ERR_UNSUPPORTED && tpl->kind != CAS_CHAT_JINJA) {
        cas_log(CAS_LOG_WARN, "chat: %s; rendering with the built-in %s routine instead", cas_last_error(),
                cas_chat_kind_name(tpl->kind));
        return builtin_apply(tpl, msgs, n, add_generation_prompt, out);
    }
    return st;
}
