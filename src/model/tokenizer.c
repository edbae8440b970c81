/*
 * tokenizer.c: text to token ids and back, as the GGUF file describes.
 *
 * Two families, chosen by tokenizer.ggml.model. Both first cut the text at
 * special tokens (control and unknown tokens when the caller asks for them,
 * user-defined tokens always), which become their own ids; each remaining
 * fragment is then encoded by the family's own rule:
 *
 * Byte-level BPE ("gpt2": GPT-2, Llama 3, SmolLM, Qwen...):
 *   1. the fragment is split into words by the pre-tokenizer regexes that
 *      tokenizer.ggml.pre names, applied in sequence (each regex splits
 *      every piece left by the previous one; text between matches is kept
 *      as a piece of its own). PCRE2 does the Unicode matching (\p{L},
 *      \p{N}, \s), with PCRE2_MATCH_INVALID_UTF so that any bytes are
 *      accepted;
 *   2. each word's bytes are mapped to the 256 printable code points of the
 *      byte-level alphabet and merged pairwise, always the pair of lowest
 *      merge rank first (leftmost on ties), with a heap over candidate pairs
 *      so a long word costs O(n log n).
 *
 * SentencePiece ("llama": Llama 1/2, Mistral, Gemma), as llama.cpp runs it:
 *   1. a space is put in front of the fragment when the file asks for it
 *      (tokenizer.ggml.add_space_prefix, on unless it says otherwise): every
 *      fragment, as each one opens the text or follows a special token; then
 *      every space becomes U+2581 (the "lower one eighth block" that stands
 *      for a space in the vocabulary);
 *   2. the fragment is cut into characters (the length a UTF-8 lead byte
 *      announces, without validating the rest) and adjacent symbols are
 *      merged while their concatenation is a token, always the pair whose
 *      token has the highest score first (leftmost on ties), with the same
 *      kind of heap: there is no merge list, the scores are the ranks;
 *   3. a symbol left that is not a token (a character the vocabulary lacks)
 *      becomes one byte token <0xNN> per byte (byte fallback).
 *
 * Decoding concatenates each token's bytes, precomputed at creation:
 * the byte-level mapping reversed (BPE), or U+2581 back to a space and byte
 * tokens to their byte (SentencePiece; the space the encoder put in front is
 * dropped from the first token of a decoded text).
 *
 * The family sits behind a small table of functions (tok_vtable), so the
 * callers never ask which one a file uses.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "model.h"

#define MAX_REGEX 4

/* ---- growable int32 vector (encode's scratch) -------------------------- */

typedef struct {
    int32_t *v;
    size_t n, cap;
} ivec;

static int ivec_push(ivec *a, int32_t x) {
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 64;
        int32_t *p = realloc(a->v, nc * sizeof *p);
        if (!p) return -1;
        a->v = p;
        a->cap = nc;
    }
    a->v[a->n++] = x;
    return 0;
}

/* ---- the tokenizer object ---------------------------------------------- */

typedef struct {
    uint64_t key;   /* (left id << 32) | right id; UINT64_MAX = empty */
    int32_t rank;   /* position in tokenizer.ggml.merges */
    int32_t result; /* id of left+right */
} merge_slot;

struct cas_tok;
typedef struct {
    /* Appends the ids of a fragment that holds no special tokens. */
    cas_status (*encode_fragment)(const struct cas_tok *t, const char *s, size_t n, ivec *out);
} tok_vtable;

struct cas_tok {
    cas_tok_kind kind;
    const tok_vtable *vt;
    int32_t n_vocab;
    char pre[64];             /* pre-tokenizer name */
    cas_tok_special sp;
    char *text;               /* vocabulary texts, back to back */
    uint64_t *text_off;       /* [n_vocab + 1] */
    char *piece;              /* decoded bytes of each token, back to back */
    uint64_t *piece_off;      /* [n_vocab + 1] */
    uint8_t *type;            /* [n_vocab] CAS_TOKTYPE_* */
    uint8_t *eog;             /* [n_vocab] 1 = ends generation */
    int32_t *vhash;           /* text -> id, open addressing, [vcap], -1 empty */
    size_t vcap;
    merge_slot *merges;       /* BPE: (left, right) -> rank and result, [mcap] */
    size_t mcap;
    float *score;             /* SentencePiece: [n_vocab] tokenizer.ggml.scores (0 where absent) */
    int add_space_prefix;     /* SentencePiece: a space in front of each fragment between special
                                 tokens (tokenizer.ggml.add_space_prefix) */
    int32_t byte_tok[256];    /* BPE: the id of each byte's single-character token; SentencePiece:
                                 its byte token <0xNN> (else the byte as a one-byte token); -1 if none */
    int32_t *special;         /* special token ids by first byte, longest first */
    uint32_t special_start[257];
    pcre2_code *re[MAX_REGEX];
    int n_re;
};

/* ---- byte-level alphabet ------------------------------------------------
 * GPT-2 maps every byte to a printable code point: the printable Latin-1
 * bytes stand for themselves, the other 68 (controls, space, 0x7f-0xa0,
 * 0xad) take the code points 256, 257, ... in byte order. */

static uint32_t byte_cp(int b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174) return (uint32_t)b;
    int n = 0;
    for (int i = 0; i < b; i++)
        if (!((i >= 33 && i <= 126) || (i >= 161 && i <= 172) || i >= 174)) n++;
    return 256u + (uint32_t)n;
}

static size_t utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xc0 | (cp >> 6)); out[1] = (char)(0x80 | (cp & 0x3f)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Decodes one UTF-8 character at s (n > 0 bytes left). Returns its length
 * (1 for an invalid byte, with *cp = UINT32_MAX). */
static size_t utf8_get(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned c = s[0];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 1) { *cp = c; return 1; }
    if (!len || len > n) { *cp = UINT32_MAX; return 1; }
    uint32_t v = c & (0x7f >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) { *cp = UINT32_MAX; return 1; }
        v = (v << 6) | (s[i] & 0x3f);
    }
    *cp = v;
    return len;
}

/* ---- hashing ----------------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 0x100000001b3ull;
    }
    return h ^ (h >> 31);
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static const char *tok_text(const cas_tok *t, int32_t id, size_t *len) {
    *len = (size_t)(t->text_off[id + 1] - t->text_off[id]);
    return t->text + t->text_off[id];
}

int32_t cas_tok_lookup(const cas_tok *t, const char *s, size_t n) {
    size_t mask = t->vcap - 1, h = (size_t)hash_bytes(s, n) & mask;
    while (t->vhash[h] >= 0) {
        size_t l;
        const char *x = tok_text(t, t->vhash[h], &l);
        if (l == n && !memcmp(x, s, n)) return t->vhash[h];
        h = (h + 1) & mask;
    }
    return -1;
}

static const merge_slot *merge_find(const cas_tok *t, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t mask = t->mcap - 1, h = (size_t)hash_u64(key) & mask;
    while (t->merges[h].key != UINT64_MAX) {
        if (t->merges[h].key == key) return &t->merges[h];
        h = (h + 1) & mask;
    }
    return NULL;
}

/* ---- BPE --------------------------------------------------------------- */

typedef struct {
    int32_t rank;
    int32_t left;      /* symbol index */
    int32_t right;
    int32_t left_id;   /* ids when pushed: a stale entry no longer matches */
    int32_t right_id;
} cand;

static int cand_less(const cand *x, const cand *y) {
    return x->rank < y->rank || (x->rank == y->rank && x->left < y->left);
}

static void heap_push(cand *h, size_t *n, cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static cand heap_pop(cand *h, size_t *n) {
    cand top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const cand *mv = &last;
        if (l < *n && cand_less(&h[l], mv)) m = l, mv = &h[l];
        if (r < *n && cand_less(&h[r], mv)) m = r;
        if (m == i) break;
        h[i] = h[m];
        i = m;
    }
    if (*n) h[i] = last;
    return top;
}

/* Merges the bytes of one word (symbol index order = byte order; a symbol
 * index survives merges as the left part, so it also orders ties). */
static cas_status bpe_word(const cas_tok *t, const unsigned char *s, size_t n, ivec *out) {
    if (n == 0) return CAS_OK;
    if (n > INT32_MAX / 2) return cas_error(CAS_ERR_INVALID, "tok: word of %zu bytes is too long", n);
    int32_t *id = malloc(n * sizeof *id), *next = malloc(n * sizeof *next), *prev = malloc(n * sizeof *prev);
    /* each merge adds at most 2 candidates; n - 1 initial ones */
    cand *heap = malloc((3 * n + 1) * sizeof *heap);
    cas_status st = CAS_OK;
    if (!id || !next || !prev || !heap) {
        st = cas_error(CAS_ERR_NOMEM, "tok: no memory for a %zu-byte word", n);
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        id[i] = t->byte_tok[s[i]];
        prev[i] = (int32_t)i - 1;
        next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    size_t hn = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        const merge_slot *m = id[i] >= 0 && id[i + 1] >= 0 ? merge_find(t, id[i], id[i + 1]) : NULL;
        if (m) heap_push(heap, &hn, (cand){m->rank, (int32_t)i, (int32_t)i + 1, id[i], id[i + 1]});
    }
    while (hn) {
        cand c = heap_pop(heap, &hn);
        if (next[c.left] != c.right || id[c.left] != c.left_id || id[c.right] != c.right_id) continue;
        const merge_slot *m = merge_find(t, c.left_id, c.right_id);
        id[c.left] = m->result;
        id[c.right] = -2; /* dead */
        next[c.left] = next[c.right];
        if (next[c.right] >= 0) prev[next[c.right]] = c.left;
        int32_t p = prev[c.left], q = next[c.left];
        if (p >= 0 && (m = merge_find(t, id[p], id[c.left])))
            heap_push(heap, &hn, (cand){m->rank, p, c.left, id[p], id[c.left]});
        if (q >= 0 && (m = merge_find(t, id[c.left], id[q])))
            heap_push(heap, &hn, (cand){m->rank, c.left, q, id[c.left], id[q]});
    }
    for (int32_t i = 0; i >= 0; i = next[i]) {
        int32_t x = id[i] >= 0 ? id[i] : t->sp.unk; /* a byte the vocabulary lacks */
        if (x >= 0 && ivec_push(out, x)) {
            st = cas_error(CAS_ERR_NOMEM, "tok: no memory for ids");
            goto done;
        }
    }
done:
    free(id);
    free(next);
    free(prev);
    free(heap);
    return st;
}

typedef struct {
    size_t off, len;
} span;

typedef struct {
    span *v;
    size_t n, cap;
} spans;

static int spans_push(spans *a, size_t off, size_t len) {
    if (!len) return 0;
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 32;
        span *p = realloc(a->v, nc * sizeof *p);
        if (!p) return -1;
        a->v = p;
        a->cap = nc;
    }
    a->v[a->n++] = (span){off, len};
    return 0;
}

/* Splits each piece of in by one regex into out: matches and the gaps
 * between them, in order, covering every byte. */
static cas_status regex_split(const pcre2_code *re, pcre2_match_data *md, const char *s, const spans *in,
                              spans *out) {
    out->n = 0;
    for (size_t k = 0; k < in->n; k++) {
        const char *p = s + in->v[k].off;
        size_t n = in->v[k].len, pos = 0, start = 0;
        while (start < n) {
            int rc = pcre2_match(re, (PCRE2_SPTR)p, n, start, 0, md, NULL);
            if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) /* JIT stack exhausted: the interpreter */
                rc = pcre2_match(re, (PCRE2_SPTR)p, n, start, PCRE2_NO_JIT, md, NULL);
            if (rc == PCRE2_ERROR_NOMATCH) break; /* the rest is one gap */
            if (rc < 0) {
                PCRE2_UCHAR msg[120];
                pcre2_get_error_message(rc, msg, sizeof msg);
                return cas_error(CAS_ERR_INTERNAL, "tok: pre-tokenizer regex failed: %s", (const char *)msg);
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            size_t ms = ov[0], me = ov[1];
            if (me <= ms || ms < pos || me > n) {
                /* empty match: try from the next character */
                start = ms + 1;
                while (start < n && ((unsigned char)p[start] & 0xc0) == 0x80) start++;
                continue;
            }
            if (spans_push(out, in->v[k].off + pos, ms - pos) ||
                spans_push(out, in->v[k].off + ms, me - ms))
                return cas_error(CAS_ERR_NOMEM, "tok: no memory for pre-tokens");
            pos = start = me;
        }
        if (spans_push(out, in->v[k].off + pos, n - pos))
            return cas_error(CAS_ERR_NOMEM, "tok: no memory for pre-tokens");
    }
    return CAS_OK;
}

static cas_status bpe_encode_fragment(const cas_tok *t, const char *s, size_t n, ivec *out) {
    spans a = {0}, b = {0};
    pcre2_match_data *md = NULL;
    cas_status st = CAS_OK;
    if (spans_push(&a, 0, n)) {
        st = cas_error(CAS_ERR_NOMEM, "tok: no memory");
        goto done;
    }
    if (t->n_re) {
        md = pcre2_match_data_create(4, NULL);
        if (!md) {
            st = cas_error(CAS_ERR_NOMEM, "tok: no memory for regex match data");
            goto done;
        }
    }
    for (int r = 0; r < t->n_re; r++) {
        if ((st = regex_split(t->re[r], md, s, &a, &b))) goto done;
        spans tmp = a;
        a = b;
        b = tmp;
    }
    for (size_t k = 0; k < a.n; k++)
        if ((st = bpe_word(t, (const unsigned char *)s + a.v[k].off, a.v[k].len, out))) goto done;
done:
    pcre2_match_data_free(md);
    free(a.v);
    free(b.v);
    return st;
}

static const tok_vtable bpe_vtable = {bpe_encode_fragment};

/* ---- SentencePiece ----------------------------------------------------- */

/* A candidate merge of adjacent symbols left and right into the token of
 * that text, whose score orders the merges. */
typedef struct {
    float score;
    int32_t left, right;
    uint32_t size; /* bytes of left + right when pushed: a stale entry no longer adds up */
} spm_cand;

/* Higher score first, then the leftmost pair. */
static int spm_before(const spm_cand *x, const spm_cand *y) {
    return x->score > y->score || (x->score == y->score && x->left < y->left);
}

static void spm_push(spm_cand *h, size_t *n, spm_cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!spm_before(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static spm_cand spm_pop(spm_cand *h, size_t *n) {
    spm_cand top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const spm_cand *mv = &last;
        if (l < *n && spm_before(&h[l], mv)) m = l, mv = &h[l];
        if (r < *n && spm_before(&h[r], mv)) m = r;
        if (m == i) break;
        h[i] = h[m];
        i = m;
    }
    if (*n) h[i] = last;
    return top;
}

/* The symbols of one fragment: byte ranges of the escaped text, in a list
 * (a merged-away symbol has len 0). */
typedef struct {
    const char *s;
    uint32_t *off, *len;
    int32_t *prev, *next;
    spm_cand *heap;
    size_t hn;
} spm_work;

static void spm_try(const cas_tok *t, spm_work *w, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    int32_t id = cas_tok_lookup(t, w->s + w->off[l], (size_t)w->len[l] + w->len[r]);
    if (id >= 0) spm_push(w->heap, &w->hn, (spm_cand){t->score[id], l, r, w->len[l] + w->len[r]});
}

static cas_status spm_encode_fragment(const cas_tok *t, const char *s, size_t n, ivec *out) {
    if (n > UINT32_MAX / 4) return cas_error(CAS_ERR_INVALID, "tok: text of %zu bytes is too long", n);
    /* the escaped text: a leading space if asked, each space as U+2581 (3 bytes) */
    size_t cap = 3 * (n + 1), m = 0;
    char *buf = malloc(cap);
    spm_work w = {0};
    cas_status st = CAS_OK;
    if (!buf) return cas_error(CAS_ERR_NOMEM, "tok: no memory for a %zu-byte fragment", n);
    if (!n && !t->add_space_prefix) goto done;
    for (size_t i = t->add_space_prefix ? 0 : 1; i <= n; i++) {
        char c = i ? s[i - 1] : ' ';
        if (c == ' ') {
            memcpy(buf + m, "\xe2\x96\x81", 3);
            m += 3;
        } else {
            buf[m++] = c;
        }
    }
    w.s = buf;
    w.off = malloc(m * sizeof *w.off);
    w.len = malloc(m * sizeof *w.len);
    w.prev = malloc(m * sizeof *w.prev);
    w.next = malloc(m * sizeof *w.next);
    /* each merge adds at most 2 candidates; fewer than m initial ones */
    w.heap = malloc((3 * m + 1) * sizeof *w.heap);
    if (!w.off || !w.len || !w.prev || !w.next || !w.heap) {
        st = cas_error(CAS_ERR_NOMEM, "tok: no memory for a %zu-byte fragment", n);
        goto done;
    }
    /* characters by their lead byte's length (continuation bytes alone: 1), cut at the end */
    int32_t ns = 0;
    for (size_t i = 0; i < m; ns++) {
        static const uint8_t lead_len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
        size_t l = lead_len[(unsigned char)buf[i] >> 4];
        if (l > m - i) l = m - i;
        w.off[ns] = (uint32_t)i;
        w.len[ns] = (uint32_t)l;
        w.prev[ns] = ns - 1;
        i += l;
        w.next[ns] = i < m ? ns + 1 : -1;
    }
    for (int32_t i = 1; i < ns; i++) spm_try(t, &w, i - 1, i);
    while (w.hn) {
        spm_cand c = spm_pop(w.heap, &w.hn);
        if (!w.len[c.left] || !w.len[c.right] || w.len[c.left] + w.len[c.right] != c.size) continue;
        w.len[c.left] += w.len[c.right];
        w.len[c.right] = 0;
        w.next[c.left] = w.next[c.right];
        if (w.next[c.right] >= 0) w.prev[w.next[c.right]] = c.left;
        spm_try(t, &w, w.prev[c.left], c.left);
        spm_try(t, &w, c.left, w.next[c.left]);
    }
    for (int32_t i = 0; ns && i >= 0; i = w.next[i]) {
        int32_t id = cas_tok_lookup(t, buf + w.off[i], w.len[i]);
        if (id >= 0) {
            if (ivec_push(out, id)) goto nomem;
            continue;
        }
        /* not a token: its bytes as byte tokens (the unknown token for a byte without one) */
        for (uint32_t k = 0; k < w.len[i]; k++) {
            int32_t b = t->byte_tok[(unsigned char)buf[w.off[i] + k]];
            if (b < 0) b = t->sp.unk;
            if (b >= 0 && ivec_push(out, b)) goto nomem;
        }
    }
    goto done;
nomem:
    st = cas_error(CAS_ERR_NOMEM, "tok: no memory for ids");
done:
    free(buf);
    free(w.off);
    free(w.len);
    free(w.prev);
    free(w.next);
    free(w.heap);
    return st;
}

static const tok_vtable spm_vtable = {spm_encode_fragment};

/* ---- pre-tokenizer regexes --------------------------------------------- */

/* GPT-2's word split: contractions, letters, numbers, other symbols, each
 * with one optional leading space; runs of spaces not followed by a word. */
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
/* Llama 3 (tiktoken cl100k-like): case-insensitive contractions, numbers in
 * groups of up to three digits, newlines kept together. */
#define RE_LLAMA3                                                                                  \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"      \
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
/* Qwen 2: as Llama 3, but every digit alone. */
#define RE_QWEN2                                                                                   \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"      \
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

/* The names are llama.cpp's (the values its converter writes); a file without
 * tokenizer.ggml.pre gets "default", as in llama.cpp. */
static const struct {
    const char *names; /* space-separated tokenizer.ggml.pre values */
    const char *re[MAX_REGEX];
} pre_table[] = {
    /* digits split one by one first, then GPT-2's rule */
    {" smollm starcoder refact command-r codeshell exaone minerva ", {"\\p{N}", RE_GPT2}},
    {" gpt-2 gpt2 phi-2 mpt olmo jais roberta-bpe ", {RE_GPT2}},
    {" llama3 llama-bpe llama-v3 dbrx smaug-bpe ", {RE_LLAMA3}},
    {" qwen2 stablelm2 deepseek-r1-qwen ", {RE_QWEN2}},
    /* punctuation runs, GPT-2's rule, digit runs, then digits in threes */
    {" default ", {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"}},
};

static cas_status compile_pre(cas_tok *t) {
    char needle[72];
    snprintf(needle, sizeof needle, " %s ", t->pre);
    size_t which = 0;
    int found = 0;
    for (size_t i = 0; i < sizeof pre_table / sizeof pre_table[0]; i++)
        if (strstr(pre_table[i].names, needle)) which = i, found = 1;
    /* another split would give other token ids than the model was trained on */
    if (!found || strchr(t->pre, ' '))
        return cas_error(CAS_ERR_UNSUPPORTED,
                         "tok: pre-tokenizer '%s' (tokenizer.ggml.pre) is not supported (smollm, gpt-2, llama-bpe, "
                         "qwen2, default and their aliases)", t->pre);
    for (int r = 0; r < MAX_REGEX && pre_table[which].re[r]; r++) {
        int err;
        PCRE2_SIZE eoff;
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)pre_table[which].re[r], PCRE2_ZERO_TERMINATED,
                                       PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &eoff, NULL);
        if (!re) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(err, msg, sizeof msg);
            return cas_error(CAS_ERR_INTERNAL, "tok: regex %d of '%s' does not compile at %zu: %s", r,
                             t->pre, (size_t)eoff, (const char *)msg);
        }
        pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* optional: falls back to the interpreter */
        t->re[t->n_re++] = re;
    }
    return CAS_OK;
}

/* ---- creation ---------------------------------------------------------- */

/* A special token id from the file, or dflt (-1: none; a default outside the
 * vocabulary is none too). */
static int32_t opt_id(const cas_gguf *g, const char *key, int32_t n_vocab, int32_t dflt) {
    uint32_t v;
    if (dflt >= n_vocab) dflt = -1;
    if (cas_gguf_find_kv(g, key) < 0) return dflt;
    if (cas_gguf_get_u32(g, key, &v) != CAS_OK || v >= (uint32_t)n_vocab) {
        cas_log(CAS_LOG_WARN, "tokenizer: ignoring %s (not a token id below %d)", key, (int)n_vocab);
        return dflt;
    }
    return (int32_t)v;
}

static int opt_bool(const cas_gguf *g, const char *key, int dflt) {
    int v;
    if (cas_gguf_find_kv(g, key) < 0 || cas_gguf_get_bool(g, key, &v) != CAS_OK) return dflt;
    return v;
}

/* Precomputes the bytes each token decodes to. */
static cas_status build_pieces(cas_tok *t) {
    uint64_t total = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) total += t->text_off[i + 1] - t->text_off[i];
    t->piece = malloc(total ? (size_t)total : 1); /* decoding never lengthens a token */
    t->piece_off = malloc(((size_t)t->n_vocab + 1) * sizeof *t->piece_off);
    if (!t->piece || !t->piece_off) return cas_error(CAS_ERR_NOMEM, "tok: no memory for pieces");
    int16_t cp_byte[324]; /* the byte-level alphabet reversed */
    for (int i = 0; i < 324; i++) cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) cp_byte[byte_cp(b)] = (int16_t)b;
    uint64_t w = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        size_t n;
        const unsigned char *s = (const unsigned char *)tok_text(t, i, &n);
        t->piece_off[i] = w;
        if (t->type[i] == CAS_TOKTYPE_CONTROL || t->type[i] == CAS_TOKTYPE_USER_DEFINED ||
            t->type[i] == CAS_TOKTYPE_UNKNOWN) {
            memcpy(t->piece + w, s, n); /* stored as plain text */
            w += n;
            continue;
        }
        if (t->kind == CAS_TOK_SPM) {
            if (t->type[i] == CAS_TOKTYPE_BYTE && n == 6) { /* <0xNN> */
                char hex[3] = {(char)s[3], (char)s[4], 0};
                t->piece[w++] = (char)strtol(hex, NULL, 16);
            } else if (t->type[i] == CAS_TOKTYPE_NORMAL) {
                for (size_t k = 0; k < n; k++) {
                    if (k + 3 <= n && !memcmp(s + k, "\xe2\x96\x81", 3)) {
                        t->piece[w++] = ' ';
                        k += 2;
                    } else {
                        t->piece[w++] = (char)s[k];
                    }
                }
            } /* unused and undefined tokens decode to nothing, as in llama.cpp */
            continue;
        }
        for (size_t k = 0; k < n;) {
            uint32_t cp;
            size_t l = utf8_get(s + k, n - k, &cp);
            int b = cp < 324 ? cp_byte[cp] : -1;
            if (b >= 0) {
                t->piece[w++] = (char)b;
            } else {
                memcpy(t->piece + w, s + k, l); /* outside the alphabet: keep as is */
                w += l;
            }
            k += l;
        }
    }
    t->piece_off[t->n_vocab] = w;
    return CAS_OK;
}

static int eog_text(const char *s, size_t n) {
    static const char *const names[] = {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
                                        "<|endoftext|>", "<end_of_turn>", "<|end_of_text|>"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i]) == n && !memcmp(names[i], s, n)) return 1;
    return 0;
}

/* The tokens, their types and the text -> id table: what both families read. */
static cas_status load_vocab(cas_tok *t, const cas_gguf *g) {
    cas_status st;
    cas_gguf_arr toks, types;
    if ((st = cas_gguf_get_arr(g, "tokenizer.ggml.tokens", CAS_GGUF_STRING, &toks))) return st;
    if (toks.n == 0 || toks.n > INT32_MAX / 4)
        return cas_error(CAS_ERR_FORMAT, "tok: vocabulary of %" PRIu64 " tokens", toks.n);
    t->n_vocab = (int32_t)toks.n;
    int has_types = cas_gguf_find_kv(g, "tokenizer.ggml.token_type") >= 0;
    if (has_types) {
        if ((st = cas_gguf_get_arr(g, "tokenizer.ggml.token_type", -1, &types))) return st;
        if (types.n != toks.n)
            return cas_error(CAS_ERR_FORMAT, "tok: %" PRIu64 " token types for %" PRIu64 " tokens", types.n,
                             toks.n);
    }
    size_t nv = (size_t)t->n_vocab;
    t->text_off = malloc((nv + 1) * sizeof *t->text_off);
    t->type = malloc(nv);
    t->eog = calloc(nv, 1);
    if (!t->text_off || !t->type || !t->eog) return cas_error(CAS_ERR_NOMEM, "tok: no memory");
    uint64_t total = 0;
    for (size_t i = 0; i < nv; i++) {
        cas_gguf_str s;
        if ((st = cas_gguf_arr_str(&toks, i, &s))) return st;
        total += s.len;
    }
    t->text = malloc(total ? (size_t)total : 1);
    if (!t->text) return cas_error(CAS_ERR_NOMEM, "tok: no memory for %" PRIu64 " bytes of tokens", total);
    uint64_t w = 0;
    for (size_t i = 0; i < nv; i++) {
        cas_gguf_str s;
        cas_gguf_arr_str(&toks, i, &s);
        memcpy(t->text + w, s.ptr, (size_t)s.len);
        t->text_off[i] = w;
        w += s.len;
        int64_t ty = CAS_TOKTYPE_NORMAL;
        if (has_types && ((st = cas_gguf_arr_int(&types, i, &ty)))) return st;
        t->type[i] = ty >= 0 && ty <= CAS_TOKTYPE_BYTE ? (uint8_t)ty : CAS_TOKTYPE_NORMAL;
    }
    t->text_off[nv] = w;

    /* text -> id; the first of duplicate texts wins */
    t->vcap = 16;
    while (t->vcap < 2 * nv) t->vcap *= 2;
    t->vhash = malloc(t->vcap * sizeof *t->vhash);
    if (!t->vhash) return cas_error(CAS_ERR_NOMEM, "tok: no memory");
    memset(t->vhash, 0xff, t->vcap * sizeof *t->vhash);
    for (size_t i = 0; i < nv; i++) {
        size_t n;
        const char *s = tok_text(t, (int32_t)i, &n);
        if (cas_tok_lookup(t, s, n) >= 0) continue;
        size_t mask = t->vcap - 1, h = (size_t)hash_bytes(s, n) & mask;
        while (t->vhash[h] >= 0) h = (h + 1) & mask;
        t->vhash[h] = (int32_t)i;
    }
    return CAS_OK;
}

static cas_status build_bpe(cas_tok *t, const cas_gguf *g) {
    cas_status st;
    cas_gguf_arr merges;
    if ((st = load_vocab(t, g))) return st;
    for (int b = 0; b < 256; b++) {
        char u[4];
        size_t n = utf8_put(byte_cp(b), u);
        t->byte_tok[b] = cas_tok_lookup(t, u, n);
    }

    /* merges: "left right" -> rank */
    if ((st = cas_gguf_get_arr(g, "tokenizer.ggml.merges", CAS_GGUF_STRING, &merges))) return st;
    if (merges.n > INT32_MAX / 4) return cas_error(CAS_ERR_FORMAT, "tok: %" PRIu64 " merges", merges.n);
    t->mcap = 16;
    while (t->mcap < 2 * merges.n) t->mcap *= 2;
    t->merges = malloc(t->mcap * sizeof *t->merges);
    if (!t->merges) return cas_error(CAS_ERR_NOMEM, "tok: no memory for merges");
    for (size_t i = 0; i < t->mcap; i++) t->merges[i].key = UINT64_MAX;
    uint64_t skipped = 0;
    char *buf = NULL;
    size_t buf_cap = 0;
    for (uint64_t r = 0; r < merges.n; r++) {
        cas_gguf_str s;
        cas_gguf_arr_str(&merges, r, &s);
        int32_t a = -1, b = -1, c = -1;
        /* the separator is a space that leaves a token on each side */
        for (size_t k = 1; k + 1 < s.len && c < 0; k++) {
            if (s.ptr[k] != ' ') continue;
            a = cas_tok_lookup(t, s.ptr, k);
            b = cas_tok_lookup(t, s.ptr + k + 1, (size_t)s.len - k - 1);
            if (a < 0 || b < 0) continue;
            if (s.len > buf_cap) {
                free(buf);
                buf_cap = (size_t)s.len * 2;
                buf = malloc(buf_cap);
                if (!buf) return cas_error(CAS_ERR_NOMEM, "tok: no memory");
            }
            memcpy(buf, s.ptr, k);
            memcpy(buf + k, s.ptr + k + 1, (size_t)s.len - k - 1);
            c = cas_tok_lookup(t, buf, (size_t)s.len - 1);
        }
        if (c < 0) {
            skipped++;
            continue;
        }
        uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
        size_t mask = t->mcap - 1, h = (size_t)hash_u64(key) & mask;
        while (t->merges[h].key != UINT64_MAX && t->merges[h].key != key) h = (h + 1) & mask;
        if (t->merges[h].key == key) continue; /* a repeated merge keeps its first rank */
        t->merges[h] = (merge_slot){key, (int32_t)r, c};
    }
    free(buf);
    if (skipped)
        cas_log(CAS_LOG_WARN, "tokenizer: skipped %" PRIu64 " merges whose parts are not tokens", skipped);
    return compile_pre(t);
}

static cas_status build_spm(cas_tok *t, const cas_gguf *g) {
    cas_status st;
    if ((st = load_vocab(t, g))) return st;
    t->score = calloc((size_t)t->n_vocab, sizeof *t->score);
    if (!t->score) return cas_error(CAS_ERR_NOMEM, "tok: no memory for scores");
    if (cas_gguf_find_kv(g, "tokenizer.ggml.scores") >= 0) {
        cas_gguf_arr sc;
        if ((st = cas_gguf_get_arr(g, "tokenizer.ggml.scores", -1, &sc))) return st;
        if (sc.n != (uint64_t)t->n_vocab)
            return cas_error(CAS_ERR_FORMAT, "tok: %" PRIu64 " scores for %d tokens", sc.n, (int)t->n_vocab);
        for (int32_t i = 0; i < t->n_vocab; i++) {
            double v; /* f32 in the converter's files; integers are read too, as llama.cpp does */
            int64_t iv;
            if (cas_gguf_arr_float(&sc, (uint64_t)i, &v) != CAS_OK) {
                if ((st = cas_gguf_arr_int(&sc, (uint64_t)i, &iv))) return st;
                v = (double)iv;
            }
            t->score[i] = (float)v;
        }
    }
    for (int b = 0; b < 256; b++) {
        char hex[7], one = (char)b;
        snprintf(hex, sizeof hex, "<0x%02X>", b);
        t->byte_tok[b] = cas_tok_lookup(t, hex, 6);
        if (t->byte_tok[b] < 0) t->byte_tok[b] = cas_tok_lookup(t, &one, 1);
    }
    t->add_space_prefix = opt_bool(g, "tokenizer.ggml.add_space_prefix", 1);
    return CAS_OK;
}

static int is_special_type(int type) {
    return type == CAS_TOKTYPE_CONTROL || type == CAS_TOKTYPE_USER_DEFINED || type == CAS_TOKTYPE_UNKNOWN;
}

/* Control, unknown and user-defined tokens, bucketed by first byte, longest
 * first, so the splitter tries only the few that can start at each position. */
static cas_status build_specials(cas_tok *t) {
    uint32_t count[257] = {0};
    for (int32_t i = 0; i < t->n_vocab; i++) {
        size_t n;
        const char *s = tok_text(t, i, &n);
        if (n && is_special_type(t->type[i])) count[(unsigned char)s[0] + 1]++;
    }
    for (int b = 0; b < 256; b++) count[b + 1] += count[b];
    memcpy(t->special_start, count, sizeof count);
    t->special = malloc((count[256] ? count[256] : 1) * sizeof *t->special);
    if (!t->special) return cas_error(CAS_ERR_NOMEM, "tok: no memory");
    uint32_t fill[256];
    memcpy(fill, count, sizeof fill);
    for (int32_t i = 0; i < t->n_vocab; i++) {
        size_t n;
        const char *s = tok_text(t, i, &n);
        if (n && is_special_type(t->type[i])) t->special[fill[(unsigned char)s[0]]++] = i;
    }
    /* insertion sort by length, descending, within each bucket (they are small) */
    for (int b = 0; b < 256; b++)
        for (uint32_t i = t->special_start[b] + 1; i < t->special_start[b + 1]; i++) {
            int32_t x = t->special[i];
            size_t lx, ly;
            tok_text(t, x, &lx);
            uint32_t j = i;
            while (j > t->special_start[b] && (tok_text(t, t->special[j - 1], &ly), ly < lx)) {
                t->special[j] = t->special[j - 1];
                j--;
            }
            t->special[j] = x;
        }
    return CAS_OK;
}

cas_status cas_tok_create(const cas_gguf *g, cas_tok **out) {
    if (!g || !out) return cas_error(CAS_ERR_INVALID, "tok: NULL argument");
    *out = NULL;
    const char *model;
    cas_status st = cas_gguf_get_str(g, "tokenizer.ggml.model", &model, NULL);
    if (st) return st;
    cas_tok *t = calloc(1, sizeof *t);
    if (!t) return cas_error(CAS_ERR_NOMEM, "tok: no memory");
    const char *pre = "default";
    if (cas_gguf_find_kv(g, "tokenizer.ggml.pre") >= 0 &&
        (st = cas_gguf_get_str(g, "tokenizer.ggml.pre", &pre, NULL)))
        goto fail;
    snprintf(t->pre, sizeof t->pre, "%s", pre);
    if (!strcmp(model, "gpt2")) {
        t->kind = CAS_TOK_BPE;
        t->vt = &bpe_vtable;
        if ((st = build_bpe(t, g))) goto fail;
    } else if (!strcmp(model, "llama")) {
        t->kind = CAS_TOK_SPM;
        t->vt = &spm_vtable;
        if ((st = build_spm(t, g))) goto fail;
    } else {
        st = cas_error(CAS_ERR_UNSUPPORTED, "tok: tokenizer model '%s' is not supported", model);
        goto fail;
    }
    int32_t nv = t->n_vocab;
    /* SentencePiece files name <unk> <s> </s> = 0 1 2 and BOS added unless they say otherwise */
    const int spm = t->kind == CAS_TOK_SPM;
    t->sp.bos = opt_id(g, "tokenizer.ggml.bos_token_id", nv, spm ? 1 : -1);
    t->sp.eos = opt_id(g, "tokenizer.ggml.eos_token_id", nv, spm ? 2 : -1);
    t->sp.eot = opt_id(g, "tokenizer.ggml.eot_token_id", nv, -1);
    t->sp.eom = opt_id(g, "tokenizer.ggml.eom_token_id", nv, -1);
    t->sp.unk = opt_id(g, "tokenizer.ggml.unknown_token_id", nv, spm ? 0 : -1);
    t->sp.pad = opt_id(g, "tokenizer.ggml.padding_token_id", nv, -1);
    t->sp.sep = opt_id(g, "tokenizer.ggml.seperator_token_id", nv, -1); /* sic: GGUF's spelling */
    t->sp.add_bos = opt_bool(g, "tokenizer.ggml.add_bos_token", spm);
    t->sp.add_eos = opt_bool(g, "tokenizer.ggml.add_eos_token", 0);
    if (t->sp.eos >= 0) t->eog[t->sp.eos] = 1;
    if (t->sp.eot >= 0) t->eog[t->sp.eot] = 1;
    if (t->sp.eom >= 0) t->eog[t->sp.eom] = 1;
    for (int32_t i = 0; i < nv; i++) {
        size_t n;
        const char *s = tok_text(t, i, &n);
        if (t->type[i] == CAS_TOKTYPE_CONTROL && eog_text(s, n)) t->eog[i] = 1;
    }
    if ((st = build_pieces(t))) goto fail;
    if ((st = build_specials(t))) goto fail;
    *out = t;
    return CAS_OK;
fail:
    cas_tok_destroy(t);
    return st;
}

void cas_tok_destroy(cas_tok *t) {
    if (!t) return;
    for (int r = 0; r < t->n_re; r++) pcre2_code_free(t->re[r]);
    free(t->text);
    free(t->text_off);
    free(t->piece);
    free(t->piece_off);
    free(t->type);
    free(t->eog);
    free(t->vhash);
    free(t->merges);
    free(t->score);
    free(t->special);
    free(t);
}

/* ---- queries ----------------------------------------------------------- */

cas_tok_kind cas_tok_kind_of(const cas_tok *t) { return t->kind; }
int32_t cas_tok_n_vocab(const cas_tok *t) { return t->n_vocab; }
const cas_tok_special *cas_tok_specials(const cas_tok *t) { return &t->sp; }
const char *cas_tok_pre_name(const cas_tok *t) { return t->pre; }

int cas_tok_type(const cas_tok *t, int32_t id) {
    return id >= 0 && id < t->n_vocab ? t->type[id] : -1;
}

int cas_tok_is_eog(const cas_tok *t, int32_t id) { return id >= 0 && id < t->n_vocab && t->eog[id]; }

const char *cas_tok_text(const cas_tok *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab) {
        if (len) *len = 0;
        return NULL;
    }
    size_t n;
    const char *s = tok_text(t, id, &n);
    if (len) *len = n;
    return s;
}

const char *cas_tok_piece(const cas_tok *t, int32_t id, unsigned flags, size_t *len) {
    if (id < 0 || id >= t->n_vocab) {
        *len = 0;
        return NULL;
    }
    int hidden = (t->type[id] == CAS_TOKTYPE_CONTROL || t->type[id] == CAS_TOKTYPE_UNKNOWN) &&
                 !(flags & CAS_TOK_DECODE_SPECIAL);
    *len = hidden ? 0 : (size_t)(t->piece_off[id + 1] - t->piece_off[id]);
    return t->piece + t->piece_off[id];
}

/* ---- encode and decode ------------------------------------------------- */

size_t cas_tok_max_ids(const cas_tok *t, size_t len) { return (t->kind == CAS_TOK_SPM ? 6 * len : len) + 2; }

cas_status cas_tok_encode(const cas_tok *t, const char *text, size_t len, unsigned flags, int32_t *ids,
                          size_t cap, size_t *n_out) {
    if (!t || (!text && len) || !n_out || (!ids && cap)) return cas_error(CAS_ERR_INVALID, "tok: NULL argument");
    *n_out = 0;
    ivec out = {0};
    cas_status st = CAS_OK;
    if ((flags & CAS_TOK_ADD_SPECIAL) && t->sp.add_bos && t->sp.bos >= 0 && ivec_push(&out, t->sp.bos)) {
        st = cas_error(CAS_ERR_NOMEM, "tok: no memory");
        goto done;
    }
    size_t frag = 0;
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)text[i];
        int32_t hit = -1;
        size_t hit_len = 0;
        for (uint32_t k = t->special_start[c]; k < t->special_start[c + 1]; k++) {
            int32_t id = t->special[k];
            if (t->type[id] != CAS_TOKTYPE_USER_DEFINED && !(flags & CAS_TOK_PARSE_SPECIAL)) continue;
            size_t n;
            const char *s = tok_text(t, id, &n);
            if (n <= len - i && !memcmp(s, text + i, n)) {
                hit = id;
                hit_len = n;
                break; /* longest first */
            }
        }
        if (hit < 0) {
            i++;
            continue;
        }
        if (i > frag && (st = t->vt->encode_fragment(t, text + frag, i - frag, &out))) goto done;
        if (ivec_push(&out, hit)) {
            st = cas_error(CAS_ERR_NOMEM, "tok: no memory");
            goto done;
        }
        i += hit_len;
        frag = i;
    }
    if (len > frag && (st = t->vt->encode_fragment(t, text + frag, len - frag, &out))) goto done;
    if ((flags & CAS_TOK_ADD_SPECIAL) && t->sp.add_eos && t->sp.eos >= 0 && ivec_push(&out, t->sp.eos)) {
        st = cas_error(CAS_ERR_NOMEM, "tok: no memory");
        goto done;
    }
    *n_out = out.n;
    if (out.n > cap) {
        if (cap) memcpy(ids, out.v, cap * sizeof *ids);
        st = cas_error(CAS_ERR_NOMEM, "tok: the text needs %zu ids, the buffer holds %zu", out.n, cap);
        goto done;
    }
    if (out.n) memcpy(ids, out.v, out.n * sizeof *ids);
done:
    free(out.v);
    return st;
}

cas_status cas_tok_decode(const cas_tok *t, const int32_t *ids, size_t n, unsigned flags, char *buf, size_t cap,
                          size_t *len_out) {
    if (!t || (!ids && n) || (!buf && cap) || !len_out) return cas_error(CAS_ERR_INVALID, "tok: NULL argument");
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab) {
            *len_out = w;
            return cas_error(CAS_ERR_INVALID, "tok: token id %" PRId32 " out of range [0, %" PRId32 ")", ids[i],
                             t->n_vocab);
        }
        size_t l;
        const char *p = cas_tok_piece(t, ids[i], flags, &l);
        if (i == 0 && t->add_space_prefix && l && p[0] == ' ') /* the space the encoder put in front */
            p++, l--;
        if (w < cap) memcpy(buf + w, p, l < cap - w ? l : cap - w);
        w += l;
    }
    *len_out = w;
    if (w >= cap) {
        if (cap) buf[cap - 1] = 0;
        return cas_error(CAS_ERR_NOMEM, "tok: the text needs %zu bytes and a NUL, the buffer holds %zu", w, cap);
    }
    buf[w] = 0;
    return CAS_OK;
}
