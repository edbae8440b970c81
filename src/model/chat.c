/*
 * chat.c: renders a conversation into the prompt text a chat model was
 * trained on. Model files carry their template as Jinja source
 * (tokenizer.chat_template); rather than embed a Jinja interpreter we
 * recognise the template family by its marker tokens and render it with a
 * fixed routine per family. The one part of a template that varies inside a
 * family and matters for the output, a default system message inserted when
 * the conversation has none (SmolLM2, Qwen), is read out of the template's
 * string literal so that it matches the file exactly.
 *
 * Families: ChatML (<|im_start|>role\ncontent<|im_end|>\n) and Llama 3
 * (<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent
 * <|eot_id|>, content trimmed as its template does).
 */
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

cas_status cas_chat_template_parse(const char *jinja, cas_chat_template *out) {
    if (!out) return cas_error(CAS_ERR_INVALID, "chat: out is NULL");
    memset(out, 0, sizeof *out);
    if (!jinja) return cas_error(CAS_ERR_INVALID, "chat: template is NULL");
    if (strstr(jinja, "<|start_header_id|>") && strstr(jinja, "<|eot_id|>")) {
        out->kind = CAS_CHAT_LLAMA3;
        out->includes_bos = strstr(jinja, "bos_token") || strstr(jinja, "<|begin_of_text|>");
        return CAS_OK;
    }
    if (strstr(jinja, "<|im_start|>") && strstr(jinja, "<|im_end|>")) {
        out->kind = CAS_CHAT_CHATML;
        out->default_system = chatml_default_system(jinja);
        return CAS_OK;
    }
    return cas_error(CAS_ERR_UNSUPPORTED, "chat: the chat template matches no known family (ChatML, Llama 3)");
}

cas_status cas_chat_template_from_gguf(const cas_gguf *g, cas_chat_template *out) {
    if (!g || !out) return cas_error(CAS_ERR_INVALID, "chat: NULL argument");
    memset(out, 0, sizeof *out);
    const char *s;
    if (cas_gguf_find_kv(g, "tokenizer.chat_template") < 0)
        return cas_error(CAS_ERR_FORMAT, "chat: the model file has no tokenizer.chat_template");
    cas_status st = cas_gguf_get_str(g, "tokenizer.chat_template", &s, NULL);
    if (st) return st;
    return cas_chat_template_parse(s, out);
}

void cas_chat_template_free(cas_chat_template *tpl) {
    if (!tpl) return;
    free(tpl->default_system);
    tpl->default_system = NULL;
}

/* ---- rendering ----------------------------------------------------------- */

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

cas_status cas_chat_apply(const cas_chat_template *tpl, const cas_chat_msg *msgs, size_t n,
                          int add_generation_prompt, char **out) {
    if (!tpl || !out || (!msgs && n)) return cas_error(CAS_ERR_INVALID, "chat: NULL argument");
    *out = NULL;
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return cas_error(CAS_ERR_INVALID, "chat: message %zu has no role or content", i);
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
