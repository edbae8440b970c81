/*
 * jinja.c: a small interpreter for the Jinja templates model files carry as
 * their chat template (tokenizer.chat_template). No maintained C
 * implementation of Jinja exists to link against, so this file implements
 * the subset that real chat templates use, with the semantics of Python's
 * jinja2 in the environment that Hugging Face's apply_chat_template builds
 * (the renderer every template is written and tested against):
 *
 *   - trim_blocks and lstrip_blocks on, a trailing newline of the source
 *     dropped, {%- -%} {{- -}} {#- -#} whitespace control, {%+ to keep;
 *   - statements if/elif/else, for (tuple targets, `if` filter, else,
 *     loop.index/index0/first/last/length/revindex/previtem/nextitem/cycle,
 *     break/continue), set (names, tuples, namespace attributes, blocks),
 *     macro (positional, keyword and default arguments), filter blocks and
 *     generation blocks (transparent);
 *   - Python values: none, booleans, 64-bit integers, floats, strings
 *     (lengths, indexes and slices count code points), lists, tuples, dicts
 *     in insertion order, namespaces; Python's str() and repr() when
 *     printed, json.dumps(ensure_ascii=False) for tojson;
 *   - undefined values as jinja2's default Undefined: printed empty, false,
 *     iterable and empty, an error on attribute access, arithmetic or call;
 *   - the immutable sandbox: list.append, dict.update and the like are
 *     errors, as they are there.
 *
 * Filters, tests, string and dict methods and the globals (range,
 * namespace, dict, raise_exception, strftime_now) are listed in their
 * tables below. An unknown tag is a compile error that names it; an
 * unknown filter or test, as in jinja2, an error when it is reached.
 * Case mapping (upper, lower, title) covers ASCII, Latin-1, Latin
 * Extended-A, Greek and Cyrillic; whitespace is Python's.
 *
 * Compiling turns the source into a token array and then a tree of nodes
 * in one arena owned by the cas_jinja; the tree is never modified, so one
 * compiled template renders on many threads at once. A render allocates
 * every value from its own arena, freed in one piece at the end: values
 * need no ownership rules, and a bound on that arena bounds the render's
 * memory. Loop iterations, macro calls and range() sizes count against a
 * step budget, the output against a byte limit, macro recursion and
 * nesting in the source against fixed depths; every error names its line
 * and column.
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model.h"

#define MAX_SOURCE (4u << 20)    /* bytes of template source */
#define MAX_NEST 64              /* nesting of expressions and of blocks in the source */
#define MAX_CALL_DEPTH 24        /* macro calls inside macro calls */
#define MAX_DATA_DEPTH 128       /* nesting of values printed, compared or serialized */
#define DEF_MAX_OUTPUT (16u << 20)
#define DEF_MAX_MEMORY (256u << 20)
#define DEF_MAX_STEPS 1000000

/* ---- arena ---------------------------------------------------------------- */

typedef struct chunk {
    struct chunk *prev;
    size_t used, cap, pad_; /* header of 32 bytes keeps data 16-aligned */
} chunk;

typedef struct {
    chunk *top;
    size_t total, limit; /* bytes held; 0 limit: none */
} arena;

typedef struct {
    chunk *top;
    size_t used;
} arena_mark;

static void *ar_alloc(arena *a, size_t n) {
    if (n > ((size_t)1 << 40)) return NULL;
    n = (n + 15) & ~(size_t)15;
    if (!n) n = 16;
    if (!a->top || a->top->cap - a->top->used < n) {
        size_t cap = n > 32768 ? n : 32768;
        if (a->limit && a->total + cap + sizeof(chunk) > a->limit) return NULL;
        chunk *c = malloc(sizeof(chunk) + cap);
        if (!c) return NULL;
        c->prev = a->top;
        c->used = 0;
        c->cap = cap;
        a->top = c;
        a->total += cap + sizeof(chunk);
    }
    void *p = (char *)(a->top + 1) + a->top->used;
    a->top->used += n;
    return p;
}

static arena_mark ar_mark(const arena *a) {
    arena_mark m = {a->top, a->top ? a->top->used : 0};
    return m;
}

static void ar_release(arena *a, arena_mark m) {
    while (a->top && a->top != m.top) {
        chunk *c = a->top;
        a->top = c->prev;
        a->total -= c->cap + sizeof(chunk);
        free(c);
    }
    if (a->top) a->top->used = m.used;
}

static void ar_free(arena *a) {
    arena_mark none = {NULL, 0};
    ar_release(a, none);
}

/* ---- strings, UTF-8 and Python's whitespace ------------------------------- */

typedef struct {
    const char *p;
    size_t n;
} str;

static int str_is(str a, const char *lit) {
    size_t n = strlen(lit);
    return a.n == n && !memcmp(a.p, lit, n);
}

/* The code point at s[i] and its byte length; a malformed byte is one code
 * point of its own value, so any byte string has a well-defined length. */
static size_t u8_dec(const char *s, size_t n, size_t i, uint32_t *cp) {
    const unsigned char *u = (const unsigned char *)s + i;
    size_t left = n - i;
    if (u[0] < 0x80) {
        *cp = u[0];
        return 1;
    }
    size_t len = u[0] >= 0xF0 && u[0] < 0xF5 ? 4 : u[0] >= 0xE0 ? 3 : u[0] >= 0xC2 && u[0] < 0xE0 ? 2 : 0;
    if (!len || len > left) {
        *cp = u[0];
        return 1;
    }
    uint32_t c = u[0] & (0x7F >> len);
    for (size_t k = 1; k < len; k++) {
        if ((u[k] & 0xC0) != 0x80) {
            *cp = u[0];
            return 1;
        }
        c = (c << 6) | (u[k] & 0x3F);
    }
    *cp = c;
    return len;
}

static size_t u8_enc(uint32_t cp, char *o) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

static size_t u8_len(str s) {
    size_t k = 0;
    uint32_t cp;
    for (size_t i = 0; i < s.n; i += u8_dec(s.p, s.n, i, &cp)) k++;
    return k;
}

/* Byte offset of code point k (s.n if k is past the end). */
static size_t u8_off(str s, size_t k) {
    size_t i = 0;
    uint32_t cp;
    while (k-- && i < s.n) i += u8_dec(s.p, s.n, i, &cp);
    return i;
}

/* str.isspace() of Python for one code point */
static int py_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
           c == 0x3000;
}

/* Byte length of the code point ending at s[e) (e > 0). */
static size_t u8_back(const char *s, size_t start, size_t e) {
    size_t b = e - 1;
    while (b > start && e - b < 4 && ((unsigned char)s[b] & 0xC0) == 0x80) b--;
    uint32_t cp;
    if (u8_dec(s, e, b, &cp) == e - b) return e - b;
    return 1;
}

/* ---- a growable byte buffer with a limit ---------------------------------- */

typedef struct {
    char *p;
    size_t n, cap, limit;
    int full; /* 1: the limit was hit; 2: malloc failed */
} buf;

static int b_put(buf *b, const void *s, size_t n) {
    if (b->full) return -1;
    if (b->limit && b->n + n > b->limit) {
        b->full = 1;
        return -1;
    }
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + n + 1) nc *= 2;
        char *p = realloc(b->p, nc);
        if (!p) {
            b->full = 2;
            return -1;
        }
        b->p = p;
        b->cap = nc;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

static int b_str(buf *b, const char *s) { return b_put(b, s, strlen(s)); }
static int b_ch(buf *b, char c) { return b_put(b, &c, 1); }

static int b_fmt(buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int b_fmt(buf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0) return -1;
    return b_put(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

/* ---- values --------------------------------------------------------------- */

enum { V_UNDEF, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_LIST, V_DICT, V_MACRO, V_FUNC, V_METHOD, V_LOOP };

struct list;
struct dict;
struct macro;
struct method;
struct loopst;

typedef struct value {
    int k;
    int markup; /* V_STR: a jinja2 Markup (from |safe): `+` HTML-escapes a plain string joined to it */
    union {
        int b;
        int64_t i;
        double f;
        str s; /* V_STR; V_UNDEF: the name that was looked up, for messages */
        struct list *l;
        struct dict *d;
        struct macro *m;
        struct method *mt;
        struct loopst *lp;
        int fn;
    } u;
} value;

/* What Python type a list value stands for: jinja2's map, select and the
 * like return generators, dict.items() a view; neither has an index or
 * serializes, and a generator has no length and is always true. */
enum { IT_LIST, IT_GEN, IT_ITEMS, IT_KEYS, IT_VALUES };

typedef struct list {
    value *v;
    size_t n, cap;
    int tuple;
    int iter; /* IT_*; IT_LIST for lists and tuples */
} list;

typedef struct dict {
    value *k, *v;
    size_t n, cap;
    int ns; /* a namespace(): attributes may be assigned */
} dict;

typedef struct method {
    value self;
    str name;
} method;

typedef struct loopst {
    list *items;
    size_t i;
} loopst;

static value v_undef(str name) {
    value v = {.k = V_UNDEF};
    v.u.s = name;
    return v;
}
static value v_none(void) {
    value v = {.k = V_NONE};
    return v;
}
static value v_bool(int b) {
    value v = {.k = V_BOOL};
    v.u.b = !!b;
    return v;
}
static value v_int(int64_t i) {
    value v = {.k = V_INT};
    v.u.i = i;
    return v;
}
static value v_float(double f) {
    value v = {.k = V_FLOAT};
    v.u.f = f;
    return v;
}
static value v_str(const char *p, size_t n) {
    value v = {.k = V_STR};
    v.u.s.p = p;
    v.u.s.n = n;
    return v;
}
static const str NOSTR = {"", 0};

static int is_num(const value *v) { return v->k == V_BOOL || v->k == V_INT || v->k == V_FLOAT; }
static double num_f(const value *v) {
    return v->k == V_FLOAT ? v->u.f : v->k == V_INT ? (double)v->u.i : (double)v->u.b;
}
static int64_t num_i(const value *v) { return v->k == V_INT ? v->u.i : v->k == V_BOOL ? v->u.b : 0; }

static int truthy(const value *v) {
    switch (v->k) {
    case V_UNDEF:
    case V_NONE: return 0;
    case V_BOOL: return v->u.b;
    case V_INT: return v->u.i != 0;
    case V_FLOAT: return v->u.f != 0.0;
    case V_STR: return v->u.s.n != 0;
    case V_LIST: return v->u.l->iter == IT_GEN || v->u.l->n != 0;
    case V_DICT: return v->u.d->ns || v->u.d->n != 0;
    default: return 1;
    }
}

static const char *type_name(const value *v) {
    switch (v->k) {
    case V_UNDEF: return "undefined";
    case V_NONE: return "NoneType";
    case V_BOOL: return "bool";
    case V_INT: return "int";
    case V_FLOAT: return "float";
    case V_STR: return "str";
    case V_LIST: {
        static const char *const it[] = {"list", "generator", "dict_items", "dict_keys", "dict_values"};
        return v->u.l->tuple ? "tuple" : it[v->u.l->iter];
    }
    case V_DICT: return v->u.d->ns ? "Namespace" : "dict";
    case V_MACRO: return "Macro";
    case V_LOOP: return "LoopContext";
    default: return "function";
    }
}

/* ---- the syntax tree ------------------------------------------------------ */

enum {
    /* expressions */
    N_LIT,
    N_NAME,
    N_LIST,
    N_TUPLE,
    N_DICT,
    N_ATTR,
    N_ITEM,
    N_SLICE,
    N_CALL,
    N_FILTER,
    N_TEST,
    N_NOT,
    N_NEG,
    N_POS,
    N_BIN,
    N_CMP,
    N_AND,
    N_OR,
    N_COND,
    N_BODY, /* the rendered body of a filter block */
    /* statements */
    S_TEXT,
    S_OUT,
    S_IF,
    S_FOR,
    S_SET,
    S_SETBLOCK,
    S_MACRO,
    S_BREAK,
    S_CONTINUE,
    S_FILTER,
    S_BLOCK
};

/* binary and comparison operators (tokens share the codes) */
enum {
    O_ADD = 1, O_SUB, O_MUL, O_DIV, O_FDIV, O_MOD, O_POW, O_TILDE, O_EQ, O_NE, O_LT, O_LE, O_GT, O_GE,
    O_ASSIGN, O_LP, O_RP, O_LB, O_RB, O_LC, O_RC, O_COMMA, O_DOT, O_COLON, O_PIPE, O_IN, O_NOTIN
};

typedef struct node node;
struct node {
    int t, op, flag;
    int32_t pos;   /* byte offset in the (normalised) source */
    value lit;     /* N_LIT */
    str s;         /* a name: variable, attribute, filter, test, macro, set target attribute */
    node *a, *b, *c, *d;
    node **kid;    /* [nk] arguments, items, keys, targets, parameters */
    node **kid2;   /* [nk] dict values, parameter defaults (NULL: none) */
    str *kw;       /* [nk] keyword names of arguments (p NULL: positional) */
    int nk;
    node *body, *alt; /* statement lists */
    node *next;
};

struct cas_jinja {
    arena ar;      /* nodes, names, decoded literals, the source copy */
    const char *src; /* normalised source: newlines \n, one trailing newline dropped */
    size_t n;
    node *root;
};

/* ---- positions and errors ------------------------------------------------- */

static void line_col(const char *src, size_t n, int32_t pos, int *line, int *col) {
    int l = 1, c = 1;
    for (size_t i = 0; i < n && i < (size_t)pos; i++) {
        if (src[i] == '\n') l++, c = 1;
        else if (((unsigned char)src[i] & 0xC0) != 0x80) c++;
    }
    *line = l;
    *col = c;
}

/* ---- lexer ---------------------------------------------------------------- */

enum { T_EOF, T_TEXT, T_VBEGIN, T_VEND, T_BBEGIN, T_BEND, T_NAME, T_STR, T_INT, T_FLOAT, T_OP };

typedef struct {
    int t, op;
    int32_t pos;
    str s;
    int64_t i;
    double f;
} tok;

typedef struct {
    const char *src;
    size_t n;
    tok *v;
    size_t nt, cap;
    arena *ar;
    char err[240];
    int32_t err_pos;
    int failed;
} lexer;

static int lx_fail(lexer *L, size_t pos, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int lx_fail(lexer *L, size_t pos, const char *fmt, ...) {
    if (L->failed) return -1;
    L->failed = 1;
    L->err_pos = (int32_t)pos;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(L->err, sizeof L->err, fmt, ap);
    va_end(ap);
    return -1;
}

static int lx_push(lexer *L, tok t) {
    if (L->nt == L->cap) {
        size_t nc = L->cap ? L->cap * 2 : 256;
        tok *p = realloc(L->v, nc * sizeof *p);
        if (!p) return lx_fail(L, (size_t)t.pos, "out of memory");
        L->v = p;
        L->cap = nc;
    }
    L->v[L->nt++] = t;
    return 0;
}

static int ascii_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* Skips Python whitespace forward from i. */
static size_t skip_pyspace(const char *s, size_t n, size_t i) {
    while (i < n) {
        uint32_t cp;
        size_t l = u8_dec(s, n, i, &cp);
        if (!py_space(cp)) break;
        i += l;
    }
    return i;
}

/* Strips Python whitespace backward from e down to start. */
static size_t rstrip_pyspace(const char *s, size_t start, size_t e) {
    while (e > start) {
        size_t l = u8_back(s, start, e);
        uint32_t cp;
        u8_dec(s, e, e - l, &cp);
        if (!py_space(cp)) break;
        e -= l;
    }
    return e;
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* A string literal at src[i] (a quote): decoded as Python's unicode-escape
 * decoding does, the way jinja2 reads literals. */
static int lx_string(lexer *L, size_t *ip, tok *t) {
    size_t i = *ip;
    char q = L->src[i];
    size_t j = i + 1;
    while (j < L->n && L->src[j] != q) j += L->src[j] == '\\' ? 2 : 1;
    if (j >= L->n) return lx_fail(L, i, "string literal is not closed");
    char *o = ar_alloc(L->ar, j - i);
    if (!o) return lx_fail(L, i, "out of memory");
    size_t w = 0;
    for (size_t k = i + 1; k < j; k++) {
        char c = L->src[k];
        if (c != '\\') {
            o[w++] = c;
            continue;
        }
        char e = L->src[++k];
        switch (e) {
        case '\n': break;
        case '\\': o[w++] = '\\'; break;
        case '\'': o[w++] = '\''; break;
        case '"': o[w++] = '"'; break;
        case 'a': o[w++] = '\a'; break;
        case 'b': o[w++] = '\b'; break;
        case 'f': o[w++] = '\f'; break;
        case 'n': o[w++] = '\n'; break;
        case 'r': o[w++] = '\r'; break;
        case 't': o[w++] = '\t'; break;
        case 'v': o[w++] = '\v'; break;
        case 'x':
        case 'u':
        case 'U': {
            int nd = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            for (int d = 0; d < nd; d++) {
                int h = k + 1 + (size_t)d < j ? hexval(L->src[k + 1 + (size_t)d]) : -1;
                if (h < 0) return lx_fail(L, k - 1, "truncated \\%c escape in a string literal", e);
                cp = cp * 16 + (uint32_t)h;
            }
            if (cp > 0x10FFFF) return lx_fail(L, k - 1, "escape \\%c names no code point", e);
            k += (size_t)nd;
            w += u8_enc(cp, o + w);
            break;
        }
        default:
            if (e >= '0' && e <= '7') {
                uint32_t cp = 0;
                int d = 0;
                while (d < 3 && k < j && L->src[k] >= '0' && L->src[k] <= '7') cp = cp * 8 + (uint32_t)(L->src[k++] - '0'), d++;
                k--;
                w += u8_enc(cp, o + w);
            } else if (e == 'N') {
                return lx_fail(L, k - 1, "\\N{...} escapes are not supported");
            } else {
                o[w++] = '\\';
                o[w++] = e;
            }
        }
    }
    t->t = T_STR;
    t->s.p = o;
    t->s.n = w;
    *ip = j + 1;
    return 0;
}

static int is_name0(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_digit(char c) { return c >= '0' && c <= '9'; }

static int lx_number(lexer *L, size_t *ip, tok *t) {
    size_t i = *ip, j = i;
    int is_float = 0;
    while (j < L->n && (is_digit(L->src[j]) || L->src[j] == '_')) j++;
    if (j + 1 < L->n && L->src[j] == '.' && is_digit(L->src[j + 1])) {
        is_float = 1;
        j++;
        while (j < L->n && (is_digit(L->src[j]) || L->src[j] == '_')) j++;
    }
    if (j < L->n && (L->src[j] == 'e' || L->src[j] == 'E')) {
        size_t k = j + 1;
        if (k < L->n && (L->src[k] == '+' || L->src[k] == '-')) k++;
        if (k < L->n && is_digit(L->src[k])) {
            is_float = 1;
            j = k;
            while (j < L->n && is_digit(L->src[j])) j++;
        }
    }
    char tmp[64];
    size_t w = 0;
    for (size_t k = i; k < j; k++)
        if (L->src[k] != '_') {
            if (w + 1 >= sizeof tmp) return lx_fail(L, i, "number literal too long");
            tmp[w++] = L->src[k];
        }
    tmp[w] = 0;
    if (is_float) {
        t->t = T_FLOAT;
        t->f = strtod(tmp, NULL);
    } else {
        uint64_t v = 0;
        for (size_t k = 0; k < w; k++) {
            if (v > (uint64_t)INT64_MAX / 10 || v * 10 + (uint64_t)(tmp[k] - '0') > (uint64_t)INT64_MAX)
                return lx_fail(L, i, "integer literal above 2**63 - 1");
            v = v * 10 + (uint64_t)(tmp[k] - '0');
        }
        t->t = T_INT;
        t->i = (int64_t)v;
    }
    *ip = j;
    return 0;
}

static const struct {
    const char *s;
    int op;
} OPS[] = {{"**", O_POW}, {"//", O_FDIV}, {"==", O_EQ}, {"!=", O_NE}, {"<=", O_LE}, {">=", O_GE},
           {"+", O_ADD},  {"-", O_SUB},   {"*", O_MUL},  {"/", O_DIV},  {"%", O_MOD},  {"~", O_TILDE},
           {"<", O_LT},   {">", O_GT},    {"=", O_ASSIGN}, {"(", O_LP}, {")", O_RP},   {"[", O_LB},
           {"]", O_RB},   {"{", O_LC},    {"}", O_RC},   {",", O_COMMA}, {".", O_DOT}, {":", O_COLON},
           {"|", O_PIPE}};

/* The inside of a {{ }} or {% %} tag from *ip up to and including its end. */
static int lx_tag(lexer *L, size_t *ip, char kind, size_t start) {
    size_t i = *ip;
    int depth = 0;
    char open[MAX_NEST * 4]; /* the closing bracket each open one expects */
    for (;;) {
        while (i < L->n && ascii_ws(L->src[i])) i++;
        if (i >= L->n) return lx_fail(L, start, "tag opened here is not closed");
        const char *s = L->src + i;
        size_t left = L->n - i;
        if (depth == 0) {
            char close = kind == '%' ? '%' : '}';
            int strip = 0, keep = 0;
            size_t len = 0;
            if (left >= 3 && s[0] == '-' && s[1] == close && s[2] == '}') strip = 1, len = 3;
            else if (kind == '%' && left >= 3 && s[0] == '+' && s[1] == '%' && s[2] == '}') keep = 1, len = 3;
            else if (left >= 2 && s[0] == close && s[1] == '}') len = 2;
            if (len) {
                tok t = {kind == '%' ? T_BEND : T_VEND, 0, (int32_t)i, NOSTR, 0, 0};
                if (lx_push(L, t)) return -1;
                i += len;
                if (strip) i = skip_pyspace(L->src, L->n, i);
                else if (kind == '%' && !keep && i < L->n && L->src[i] == '\n') i++;
                *ip = i;
                return 0;
            }
        }
        tok t = {T_OP, 0, (int32_t)i, NOSTR, 0, 0};
        if (is_name0(s[0]) || (unsigned char)s[0] >= 0x80) {
            size_t j = i;
            while (j < L->n && (is_name0(L->src[j]) || is_digit(L->src[j]) || (unsigned char)L->src[j] >= 0x80)) j++;
            t.t = T_NAME;
            t.s.p = s;
            t.s.n = j - i;
            i = j;
        } else if (is_digit(s[0])) {
            if (lx_number(L, &i, &t)) return -1;
        } else if (s[0] == '\'' || s[0] == '"') {
            if (lx_string(L, &i, &t)) return -1;
        } else {
            size_t k = 0;
            for (; k < sizeof OPS / sizeof OPS[0]; k++) {
                size_t ol = strlen(OPS[k].s);
                if (left >= ol && !memcmp(s, OPS[k].s, ol)) break;
            }
            if (k == sizeof OPS / sizeof OPS[0]) return lx_fail(L, i, "unexpected character '%c'", s[0]);
            t.op = OPS[k].op;
            i += strlen(OPS[k].s);
            if (t.op == O_LP || t.op == O_LB || t.op == O_LC) {
                if (depth == (int)sizeof open) return lx_fail(L, (size_t)t.pos, "brackets nested too deep");
                open[depth++] = t.op == O_LP ? ')' : t.op == O_LB ? ']' : '}';
            } else if ((t.op == O_RP || t.op == O_RB || t.op == O_RC) && depth > 0) {
                char c = t.op == O_RP ? ')' : t.op == O_RB ? ']' : '}';
                if (c != open[depth - 1]) return lx_fail(L, (size_t)t.pos, "unexpected '%c', expected '%c'", c, open[depth - 1]);
                depth--;
            }
        }
        if (lx_push(L, t)) return -1;
    }
}

static int lex(lexer *L) {
    size_t pos = 0;
    const char *s = L->src;
    size_t n = L->n;
    for (;;) {
        size_t t = pos;
        while (t + 1 < n && !(s[t] == '{' && (s[t + 1] == '{' || s[t + 1] == '%' || s[t + 1] == '#'))) t++;
        if (t + 1 >= n) t = n;
        size_t te = t;
        char kind = 0, sign = 0;
        if (t < n) {
            kind = s[t + 1];
            sign = t + 2 < n && (s[t + 2] == '-' || s[t + 2] == '+') ? s[t + 2] : 0;
            if (sign == '-') {
                te = rstrip_pyspace(s, pos, te);
            } else if (sign != '+' && kind != '{') {
                /* lstrip_blocks: only whitespace between the line's start and the tag */
                size_t l = te;
                while (l > pos && s[l - 1] != '\n') l--;
                if (l > pos || pos == 0 || s[pos - 1] == '\n') {
                    size_t e = l;
                    while (e < te) {
                        uint32_t cp;
                        size_t k = u8_dec(s, te, e, &cp);
                        if (!py_space(cp) || cp == '\n') break;
                        e += k;
                    }
                    if (e == te) te = l;
                }
            }
        }
        if (te > pos) {
            tok x = {T_TEXT, 0, (int32_t)pos, {s + pos, te - pos}, 0, 0};
            if (lx_push(L, x)) return -1;
        }
        if (t >= n) break;
        size_t i = t + 2 + (sign ? 1 : 0);
        if (kind == '#') {
            size_t e = i;
            while (e + 1 < n && !(s[e] == '#' && s[e + 1] == '}')) e++;
            if (e + 1 >= n) return lx_fail(L, t, "comment opened here is not closed");
            pos = e + 2;
            if (e > i && s[e - 1] == '-') pos = skip_pyspace(s, n, pos);
            else if (!(e > i && s[e - 1] == '+') && pos < n && s[pos] == '\n') pos++;
            continue;
        }
        tok b = {kind == '%' ? T_BBEGIN : T_VBEGIN, 0, (int32_t)t, NOSTR, 0, 0};
        if (lx_push(L, b)) return -1;
        if (lx_tag(L, &i, kind, t)) return -1;
        pos = i;
    }
    tok e = {T_EOF, 0, (int32_t)n, NOSTR, 0, 0};
    return lx_push(L, e);
}

/* ---- filters and tests: names resolved when compiling --------------------- */

enum {
    F_ABS, F_CAPITALIZE, F_DEFAULT, F_DICTSORT, F_FIRST, F_FLOAT, F_INDENT, F_INT, F_ITEMS, F_JOIN, F_LAST,
    F_LENGTH, F_LIST, F_LOWER, F_MAP, F_MAX, F_MIN, F_REJECT, F_REJECTATTR, F_REPLACE, F_REVERSE, F_ROUND,
    F_SAFE, F_SELECT, F_SELECTATTR, F_SORT, F_STRING, F_SUM, F_TITLE, F_TOJSON, F_TRIM, F_UNIQUE, F_UPPER,
    F_WORDCOUNT
};

static const struct {
    const char *name;
    int id;
} FILTERS[] = {{"abs", F_ABS},       {"capitalize", F_CAPITALIZE}, {"count", F_LENGTH}, {"d", F_DEFAULT},
               {"default", F_DEFAULT}, {"dictsort", F_DICTSORT}, {"first", F_FIRST},  {"float", F_FLOAT},
               {"indent", F_INDENT},  {"int", F_INT},   {"items", F_ITEMS},   {"join", F_JOIN},
               {"last", F_LAST},      {"length", F_LENGTH}, {"list", F_LIST}, {"lower", F_LOWER},
               {"map", F_MAP},        {"max", F_MAX},   {"min", F_MIN},       {"reject", F_REJECT},
               {"rejectattr", F_REJECTATTR}, {"replace", F_REPLACE}, {"reverse", F_REVERSE},
               {"round", F_ROUND},    {"safe", F_SAFE}, {"select", F_SELECT}, {"selectattr", F_SELECTATTR},
               {"sort", F_SORT},      {"string", F_STRING}, {"sum", F_SUM},   {"title", F_TITLE},
               {"tojson", F_TOJSON},  {"trim", F_TRIM}, {"unique", F_UNIQUE}, {"upper", F_UPPER},
               {"wordcount", F_WORDCOUNT}};

enum {
    TS_BOOLEAN, TS_CALLABLE, TS_DEFINED, TS_DIVISIBLEBY, TS_EQ, TS_EVEN, TS_FALSE, TS_FLOAT, TS_GE, TS_GT,
    TS_IN, TS_INTEGER, TS_ITERABLE, TS_LE, TS_LOWER, TS_LT, TS_MAPPING, TS_NE, TS_NONE, TS_NUMBER, TS_ODD,
    TS_SAMEAS, TS_SEQUENCE, TS_STRING, TS_TRUE, TS_UNDEFINED, TS_UPPER
};

static const struct {
    const char *name;
    int id;
} TESTS[] = {{"!=", TS_NE},         {"<", TS_LT},           {"<=", TS_LE},          {"==", TS_EQ},
             {">", TS_GT},          {">=", TS_GE},          {"boolean", TS_BOOLEAN}, {"callable", TS_CALLABLE},
             {"defined", TS_DEFINED}, {"divisibleby", TS_DIVISIBLEBY}, {"eq", TS_EQ}, {"equalto", TS_EQ},
             {"even", TS_EVEN},     {"false", TS_FALSE},    {"float", TS_FLOAT},    {"ge", TS_GE},
             {"greaterthan", TS_GT}, {"gt", TS_GT},         {"in", TS_IN},          {"integer", TS_INTEGER},
             {"iterable", TS_ITERABLE}, {"le", TS_LE},      {"lessthan", TS_LT},    {"lower", TS_LOWER},
             {"lt", TS_LT},         {"mapping", TS_MAPPING}, {"ne", TS_NE},         {"none", TS_NONE},
             {"number", TS_NUMBER}, {"odd", TS_ODD},        {"sameas", TS_SAMEAS},  {"sequence", TS_SEQUENCE},
             {"string", TS_STRING}, {"true", TS_TRUE},      {"undefined", TS_UNDEFINED}, {"upper", TS_UPPER}};

static int find_filter(str name) {
    for (size_t i = 0; i < sizeof FILTERS / sizeof FILTERS[0]; i++)
        if (str_is(name, FILTERS[i].name)) return FILTERS[i].id;
    return -1;
}

static int find_test(str name) {
    for (size_t i = 0; i < sizeof TESTS / sizeof TESTS[0]; i++)
        if (str_is(name, TESTS[i].name)) return TESTS[i].id;
    return -1;
}

/* ---- parser --------------------------------------------------------------- */

typedef struct {
    tok *v;
    size_t i, nt;
    arena *ar;
    int depth, loops, in_macro;
    char err[240];
    int32_t err_pos;
    int failed;
} parser;

static int ps_fail(parser *P, int32_t pos, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int ps_fail(parser *P, int32_t pos, const char *fmt, ...) {
    if (P->failed) return -1;
    P->failed = 1;
    P->err_pos = pos;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(P->err, sizeof P->err, fmt, ap);
    va_end(ap);
    return -1;
}

static tok *cur(parser *P) { return &P->v[P->i]; }
static tok *peek(parser *P, size_t k) { return &P->v[P->i + k < P->nt ? P->i + k : P->nt - 1]; }
static void adv(parser *P) {
    if (P->i + 1 < P->nt) P->i++;
}
static int is_op(parser *P, int op) { return cur(P)->t == T_OP && cur(P)->op == op; }
static int is_name(parser *P, const char *s) { return cur(P)->t == T_NAME && str_is(cur(P)->s, s); }
static int skip_op(parser *P, int op) {
    if (!is_op(P, op)) return 0;
    adv(P);
    return 1;
}
static int skip_name(parser *P, const char *s) {
    if (!is_name(P, s)) return 0;
    adv(P);
    return 1;
}

static const char *tok_desc(const tok *t, char *b, size_t cap) {
    switch (t->t) {
    case T_EOF: return "end of template";
    case T_TEXT: return "template text";
    case T_VBEGIN: return "'{{'";
    case T_VEND: return "'}}'";
    case T_BBEGIN: return "'{%'";
    case T_BEND: return "'%}'";
    case T_STR: return "a string";
    case T_INT:
    case T_FLOAT: return "a number";
    case T_NAME: snprintf(b, cap, "'%.*s'", (int)(t->s.n < 40 ? t->s.n : 40), t->s.p); return b;
    default:
        for (size_t k = 0; k < sizeof OPS / sizeof OPS[0]; k++)
            if (OPS[k].op == t->op) {
                snprintf(b, cap, "'%s'", OPS[k].s);
                return b;
            }
        return "an operator";
    }
}

static int expect_op(parser *P, int op, const char *what) {
    if (skip_op(P, op)) return 0;
    char b[64];
    return ps_fail(P, cur(P)->pos, "expected %s, found %s", what, tok_desc(cur(P), b, sizeof b));
}

static int expect_bend(parser *P) {
    if (cur(P)->t == T_BEND) {
        adv(P);
        return 0;
    }
    char b[64];
    return ps_fail(P, cur(P)->pos, "expected '%%}', found %s", tok_desc(cur(P), b, sizeof b));
}

static node *mk(parser *P, int t, int32_t pos) {
    node *n = ar_alloc(P->ar, sizeof *n);
    if (!n) {
        ps_fail(P, pos, "out of memory");
        return NULL;
    }
    memset(n, 0, sizeof *n);
    n->t = t;
    n->pos = pos;
    return n;
}

/* A growable array of nodes while parsing; copied into the arena at the end. */
typedef struct {
    node *v[256];
    node *v2[256];
    str kw[256];
    int n;
} nodelist;

static int nl_push(parser *P, nodelist *l, node *a, node *b, str kw) {
    if (l->n >= 256) return ps_fail(P, a ? a->pos : cur(P)->pos, "more than 256 items in one list or call");
    l->v[l->n] = a;
    l->v2[l->n] = b;
    l->kw[l->n] = kw;
    l->n++;
    return 0;
}

static int nl_store(parser *P, node *n, const nodelist *l, int with2, int withkw) {
    n->nk = l->n;
    if (!l->n) return 0;
    n->kid = ar_alloc(P->ar, sizeof(node *) * (size_t)l->n);
    if (with2) n->kid2 = ar_alloc(P->ar, sizeof(node *) * (size_t)l->n);
    if (withkw) n->kw = ar_alloc(P->ar, sizeof(str) * (size_t)l->n);
    if (!n->kid || (with2 && !n->kid2) || (withkw && !n->kw)) return ps_fail(P, n->pos, "out of memory");
    memcpy(n->kid, l->v, sizeof(node *) * (size_t)l->n);
    if (with2) memcpy(n->kid2, l->v2, sizeof(node *) * (size_t)l->n);
    if (withkw) memcpy(n->kw, l->kw, sizeof(str) * (size_t)l->n);
    return 0;
}

static node *p_expr(parser *P, int with_cond);
static node *p_unary(parser *P, int with_filter);

/* (args) after a callee, filter or test; the '(' is current */
static int p_args(parser *P, node *n) {
    nodelist *l = malloc(sizeof *l);
    if (!l) return ps_fail(P, cur(P)->pos, "out of memory");
    l->n = 0;
    int rc = -1;
    adv(P);
    while (!is_op(P, O_RP)) {
        str kw = {NULL, 0};
        if (is_op(P, O_MUL) || is_op(P, O_POW)) {
            ps_fail(P, cur(P)->pos, "*args and **kwargs in calls are not supported");
            goto done;
        }
        if (cur(P)->t == T_NAME && peek(P, 1)->t == T_OP && peek(P, 1)->op == O_ASSIGN) {
            kw = cur(P)->s;
            adv(P);
            adv(P);
        }
        node *a = p_expr(P, 1);
        if (!a || nl_push(P, l, a, NULL, kw)) goto done;
        if (!skip_op(P, O_COMMA)) break;
    }
    if (expect_op(P, O_RP, "')'") || nl_store(P, n, l, 0, 1)) goto done;
    rc = 0;
done:
    free(l);
    return rc;
}

static node *p_primary(parser *P) {
    tok *t = cur(P);
    node *n;
    char b[64];
    switch (t->t) {
    case T_NAME:
        if (!(n = mk(P, N_LIT, t->pos))) return NULL;
        if (str_is(t->s, "true") || str_is(t->s, "True")) n->lit = v_bool(1);
        else if (str_is(t->s, "false") || str_is(t->s, "False")) n->lit = v_bool(0);
        else if (str_is(t->s, "none") || str_is(t->s, "None")) n->lit = v_none();
        else {
            n->t = N_NAME;
            n->s = t->s;
        }
        adv(P);
        return n;
    case T_STR: {
        if (!(n = mk(P, N_LIT, t->pos))) return NULL;
        if (peek(P, 1)->t != T_STR) {
            n->lit = v_str(t->s.p, t->s.n);
            adv(P);
            return n;
        }
        /* adjacent literals join */
        size_t total = 0;
        for (size_t k = P->i; k < P->nt && P->v[k].t == T_STR; k++) total += P->v[k].s.n;
        char *o = ar_alloc(P->ar, total + 1);
        if (!o) {
            ps_fail(P, t->pos, "out of memory");
            return NULL;
        }
        size_t w = 0;
        while (cur(P)->t == T_STR) {
            memcpy(o + w, cur(P)->s.p, cur(P)->s.n);
            w += cur(P)->s.n;
            adv(P);
        }
        n->lit = v_str(o, w);
        return n;
    }
    case T_INT:
        if (!(n = mk(P, N_LIT, t->pos))) return NULL;
        n->lit = v_int(t->i);
        adv(P);
        return n;
    case T_FLOAT:
        if (!(n = mk(P, N_LIT, t->pos))) return NULL;
        n->lit = v_float(t->f);
        adv(P);
        return n;
    case T_OP:
        if (t->op == O_LP) {
            adv(P);
            if (skip_op(P, O_RP)) return mk(P, N_TUPLE, t->pos);
            node *e = p_expr(P, 1);
            if (!e) return NULL;
            if (!is_op(P, O_COMMA)) {
                if (expect_op(P, O_RP, "')'")) return NULL;
                return e;
            }
            nodelist *l = malloc(sizeof *l);
            if (!l) {
                ps_fail(P, t->pos, "out of memory");
                return NULL;
            }
            l->n = 0;
            n = mk(P, N_TUPLE, t->pos);
            int ok = n && !nl_push(P, l, e, NULL, NOSTR);
            while (ok && skip_op(P, O_COMMA) && !is_op(P, O_RP)) {
                node *x = p_expr(P, 1);
                ok = x && !nl_push(P, l, x, NULL, NOSTR);
            }
            ok = ok && !expect_op(P, O_RP, "')'") && !nl_store(P, n, l, 0, 0);
            free(l);
            return ok ? n : NULL;
        }
        if (t->op == O_LB || t->op == O_LC) {
            int is_dict = t->op == O_LC;
            adv(P);
            nodelist *l = malloc(sizeof *l);
            if (!l) {
                ps_fail(P, t->pos, "out of memory");
                return NULL;
            }
            l->n = 0;
            n = mk(P, is_dict ? N_DICT : N_LIST, t->pos);
            int ok = n != NULL;
            while (ok && !is_op(P, is_dict ? O_RC : O_RB)) {
                node *k = p_expr(P, 1), *v = NULL;
                ok = k != NULL;
                if (ok && is_dict) ok = !expect_op(P, O_COLON, "':'") && (v = p_expr(P, 1)) != NULL;
                ok = ok && !nl_push(P, l, k, v, NOSTR);
                if (!ok || !skip_op(P, O_COMMA)) break;
            }
            ok = ok && !expect_op(P, is_dict ? O_RC : O_RB, is_dict ? "'}'" : "']'") && !nl_store(P, n, l, is_dict, 0);
            free(l);
            return ok ? n : NULL;
        }
        /* fall through */
    default: ps_fail(P, t->pos, "unexpected %s in an expression", tok_desc(t, b, sizeof b)); return NULL;
    }
}

static node *p_postfix(parser *P, node *n) {
    while (n) {
        tok *t = cur(P);
        if (skip_op(P, O_DOT)) {
            node *a;
            if (cur(P)->t == T_NAME) {
                if (!(a = mk(P, N_ATTR, t->pos))) return NULL;
                a->s = cur(P)->s;
            } else if (cur(P)->t == T_INT) {
                if (!(a = mk(P, N_ITEM, t->pos)) || !(a->b = mk(P, N_LIT, t->pos))) return NULL;
                a->b->lit = v_int(cur(P)->i);
            } else {
                ps_fail(P, cur(P)->pos, "expected an attribute name after '.'");
                return NULL;
            }
            adv(P);
            a->a = n;
            n = a;
        } else if (skip_op(P, O_LB)) {
            node *lo = NULL, *hi = NULL, *st = NULL;
            if (!is_op(P, O_COLON) && !(lo = p_expr(P, 1))) return NULL;
            if (skip_op(P, O_COLON)) {
                if (!is_op(P, O_RB) && !is_op(P, O_COLON) && !(hi = p_expr(P, 1))) return NULL;
                if (skip_op(P, O_COLON) && !is_op(P, O_RB) && !(st = p_expr(P, 1))) return NULL;
                node *s = mk(P, N_SLICE, t->pos);
                if (!s) return NULL;
                s->a = n, s->b = lo, s->c = hi, s->d = st;
                n = s;
            } else {
                node *s = mk(P, N_ITEM, t->pos);
                if (!s) return NULL;
                s->a = n, s->b = lo;
                n = s;
            }
            if (expect_op(P, O_RB, "']'")) return NULL;
        } else if (is_op(P, O_LP)) {
            node *c = mk(P, N_CALL, n->pos);
            if (!c) return NULL;
            c->a = n;
            if (p_args(P, c)) return NULL;
            n = c;
        } else {
            break;
        }
    }
    return n;
}

static node *p_filters(parser *P, node *n) {
    while (n) {
        tok *t = cur(P);
        if (skip_op(P, O_PIPE)) {
            if (cur(P)->t != T_NAME) {
                ps_fail(P, cur(P)->pos, "expected a filter name after '|'");
                return NULL;
            }
            node *f = mk(P, N_FILTER, cur(P)->pos);
            if (!f) return NULL;
            f->s = cur(P)->s;
            f->op = find_filter(f->s); /* -1: unknown, an error if reached (as jinja2 defers it) */
            adv(P);
            f->a = n;
            if (is_op(P, O_LP) && p_args(P, f)) return NULL;
            n = f;
        } else if (is_name(P, "is")) {
            adv(P);
            node *x = mk(P, N_TEST, t->pos);
            if (!x) return NULL;
            x->flag = skip_name(P, "not");
            if (cur(P)->t != T_NAME) {
                ps_fail(P, cur(P)->pos, "expected a test name after 'is'");
                return NULL;
            }
            x->s = cur(P)->s;
            x->op = find_test(x->s); /* -1: unknown, an error if reached */
            adv(P);
            x->a = n;
            tok *c = cur(P);
            if (is_op(P, O_LP)) {
                if (p_args(P, x)) return NULL;
            } else if ((c->t == T_NAME && !str_is(c->s, "else") && !str_is(c->s, "or") && !str_is(c->s, "and")) ||
                       c->t == T_STR || c->t == T_INT || c->t == T_FLOAT ||
                       (c->t == T_OP && (c->op == O_LB || c->op == O_LC))) {
                node *arg = p_postfix(P, p_primary(P));
                if (!arg) return NULL;
                x->kid = ar_alloc(P->ar, sizeof(node *));
                x->kw = ar_alloc(P->ar, sizeof(str));
                if (!x->kid || !x->kw) {
                    ps_fail(P, x->pos, "out of memory");
                    return NULL;
                }
                x->kid[0] = arg;
                x->kw[0].p = NULL;
                x->kw[0].n = 0;
                x->nk = 1;
            }
            n = x;
        } else if (is_op(P, O_LP)) {
            node *c = mk(P, N_CALL, t->pos);
            if (!c) return NULL;
            c->a = n;
            if (p_args(P, c)) return NULL;
            n = c;
        } else {
            break;
        }
    }
    return n;
}

static node *p_unary(parser *P, int with_filter) {
    tok *t = cur(P);
    if (++P->depth > MAX_NEST) {
        ps_fail(P, t->pos, "expression nested more than %d deep", MAX_NEST);
        return NULL;
    }
    node *n;
    if (is_op(P, O_SUB) || is_op(P, O_ADD)) {
        adv(P);
        n = mk(P, t->op == O_SUB ? N_NEG : N_POS, t->pos);
        if (n && !(n->a = p_unary(P, 0))) n = NULL;
    } else {
        n = p_primary(P);
    }
    n = p_postfix(P, n);
    if (with_filter) n = p_filters(P, n);
    P->depth--;
    return n;
}

static node *bin(parser *P, int t, int op, int32_t pos, node *a, node *b) {
    if (!a || !b) return NULL;
    node *n = mk(P, t, pos);
    if (!n) return NULL;
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static node *p_pow(parser *P) {
    node *n = p_unary(P, 1);
    while (n && is_op(P, O_POW)) {
        int32_t pos = cur(P)->pos;
        adv(P);
        n = bin(P, N_BIN, O_POW, pos, n, p_unary(P, 1));
    }
    return n;
}

static node *p_math2(parser *P) {
    node *n = p_pow(P);
    while (n && (is_op(P, O_MUL) || is_op(P, O_DIV) || is_op(P, O_FDIV) || is_op(P, O_MOD))) {
        tok *t = cur(P);
        adv(P);
        n = bin(P, N_BIN, t->op, t->pos, n, p_pow(P));
    }
    return n;
}

static node *p_concat(parser *P) {
    node *n = p_math2(P);
    while (n && is_op(P, O_TILDE)) {
        int32_t pos = cur(P)->pos;
        adv(P);
        n = bin(P, N_BIN, O_TILDE, pos, n, p_math2(P));
    }
    return n;
}

static node *p_math1(parser *P) {
    node *n = p_concat(P);
    while (n && (is_op(P, O_ADD) || is_op(P, O_SUB))) {
        tok *t = cur(P);
        adv(P);
        n = bin(P, N_BIN, t->op, t->pos, n, p_concat(P));
    }
    return n;
}

/* Comparisons chain as in Python: a < b < c is (a < b) and (b < c). */
static node *p_compare(parser *P) {
    node *n = p_math1(P), *left = n, *chain = NULL;
    for (;;) {
        if (!n) return NULL;
        tok *t = cur(P);
        int op = 0;
        if (t->t == T_OP && t->op >= O_EQ && t->op <= O_GE) op = t->op, adv(P);
        else if (is_name(P, "in")) op = O_IN, adv(P);
        else if (is_name(P, "not") && peek(P, 1)->t == T_NAME && str_is(peek(P, 1)->s, "in")) op = O_NOTIN, adv(P), adv(P);
        else break;
        node *right = p_math1(P);
        node *c = bin(P, N_CMP, op, t->pos, left, right);
        chain = chain ? bin(P, N_AND, 0, t->pos, chain, c) : c;
        n = chain;
        left = right;
    }
    return n;
}

static node *p_not(parser *P) {
    if (is_name(P, "not")) {
        int32_t pos = cur(P)->pos;
        adv(P);
        if (++P->depth > MAX_NEST) {
            ps_fail(P, pos, "expression nested more than %d deep", MAX_NEST);
            return NULL;
        }
        node *n = mk(P, N_NOT, pos);
        if (n && !(n->a = p_not(P))) n = NULL;
        P->depth--;
        return n;
    }
    return p_compare(P);
}

static node *p_and(parser *P) {
    node *n = p_not(P);
    while (n && is_name(P, "and")) {
        int32_t pos = cur(P)->pos;
        adv(P);
        n = bin(P, N_AND, 0, pos, n, p_not(P));
    }
    return n;
}

static node *p_or(parser *P) {
    node *n = p_and(P);
    while (n && is_name(P, "or")) {
        int32_t pos = cur(P)->pos;
        adv(P);
        n = bin(P, N_OR, 0, pos, n, p_and(P));
    }
    return n;
}

static node *p_expr(parser *P, int with_cond) {
    if (++P->depth > MAX_NEST) {
        ps_fail(P, cur(P)->pos, "expression nested more than %d deep", MAX_NEST);
        return NULL;
    }
    node *n = p_or(P);
    while (with_cond && n && is_name(P, "if")) {
        int32_t pos = cur(P)->pos;
        adv(P);
        node *c = mk(P, N_COND, pos);
        if (!c) return NULL;
        c->a = n;
        if (!(c->b = p_or(P))) return NULL;
        if (skip_name(P, "else") && !(c->c = p_expr(P, 1))) return NULL;
        n = c;
    }
    P->depth--;
    return n;
}

/* An expression that may be an unparenthesised tuple (`{{ a, b }}`, `set x = 1, 2`). */
static node *p_tuple(parser *P) {
    int32_t pos = cur(P)->pos;
    node *n = p_expr(P, 1);
    if (!n || !is_op(P, O_COMMA)) return n;
    nodelist *l = malloc(sizeof *l);
    if (!l) {
        ps_fail(P, pos, "out of memory");
        return NULL;
    }
    l->n = 0;
    node *t = mk(P, N_TUPLE, pos);
    int ok = t && !nl_push(P, l, n, NULL, NOSTR);
    while (ok && skip_op(P, O_COMMA)) {
        if (cur(P)->t == T_VEND || cur(P)->t == T_BEND) break;
        node *x = p_expr(P, 1);
        ok = x && !nl_push(P, l, x, NULL, NOSTR);
    }
    ok = ok && !nl_store(P, t, l, 0, 0);
    free(l);
    return ok ? t : NULL;
}

/* Names separated by commas: the targets of for and set. */
static int p_targets(parser *P, node *n) {
    nodelist *l = malloc(sizeof *l);
    if (!l) return ps_fail(P, cur(P)->pos, "out of memory");
    l->n = 0;
    int rc = -1;
    do {
        if (cur(P)->t != T_NAME) {
            char b[64];
            ps_fail(P, cur(P)->pos, "expected a variable name, found %s", tok_desc(cur(P), b, sizeof b));
            goto done;
        }
        node *x = mk(P, N_NAME, cur(P)->pos);
        if (!x) goto done;
        x->s = cur(P)->s;
        adv(P);
        if (nl_push(P, l, x, NULL, NOSTR)) goto done;
    } while (skip_op(P, O_COMMA));
    rc = nl_store(P, n, l, 0, 0);
done:
    free(l);
    return rc;
}

static node *p_body(parser *P, const char *const *stops, str *stopped);

/* the keywords ending the body of each block */
static const char *const STOP_IF[] = {"elif", "else", "endif", NULL};
static const char *const STOP_ENDIF[] = {"endif", NULL};
static const char *const STOP_FOR[] = {"else", "endfor", NULL};
static const char *const STOP_ENDFOR[] = {"endfor", NULL};
static const char *const STOP_SET[] = {"endset", NULL};
static const char *const STOP_MACRO[] = {"endmacro", NULL};
static const char *const STOP_FILTER[] = {"endfilter", NULL};
static const char *const STOP_GEN[] = {"endgeneration", NULL};

/* After p_body stopped at a keyword: consume it and the tag's end. */
static int end_tag(parser *P) {
    adv(P);
    return expect_bend(P);
}

static node *p_if(parser *P, int32_t pos) {
    node *n = mk(P, S_IF, pos);
    if (!n || !(n->a = p_expr(P, 1)) || expect_bend(P)) return NULL;
    str stop;
    n->body = p_body(P, STOP_IF, &stop);
    if (P->failed) return NULL;
    if (str_is(stop, "elif")) {
        int32_t p2 = cur(P)->pos;
        adv(P);
        if (!(n->alt = p_if(P, p2))) return NULL;
        return n;
    }
    if (str_is(stop, "else")) {
        if (end_tag(P)) return NULL;
        n->alt = p_body(P, STOP_ENDIF, &stop);
        if (P->failed) return NULL;
    }
    return end_tag(P) ? NULL : n;
}

static node *p_statement(parser *P) {
    tok *b = cur(P); /* T_BBEGIN */
    adv(P);
    tok *k = cur(P);
    char d[64];
    if (k->t != T_NAME) {
        ps_fail(P, k->pos, "expected a tag name, found %s", tok_desc(k, d, sizeof d));
        return NULL;
    }
    if (++P->depth > MAX_NEST) {
        ps_fail(P, k->pos, "blocks nested more than %d deep", MAX_NEST);
        return NULL;
    }
    str kw = k->s, stop;
    adv(P);
    node *n = NULL;
    if (str_is(kw, "if")) {
        n = p_if(P, b->pos);
    } else if (str_is(kw, "for")) {
        if (!(n = mk(P, S_FOR, b->pos)) || p_targets(P, n)) return NULL;
        if (!skip_name(P, "in")) {
            ps_fail(P, cur(P)->pos, "expected 'in' in a for tag, found %s", tok_desc(cur(P), d, sizeof d));
            return NULL;
        }
        if (!(n->a = p_expr(P, 0))) return NULL;
        if (skip_name(P, "if") && !(n->c = p_expr(P, 1))) return NULL;
        if (is_name(P, "recursive")) {
            ps_fail(P, cur(P)->pos, "recursive loops are not supported");
            return NULL;
        }
        if (expect_bend(P)) return NULL;
        P->loops++;
        n->body = p_body(P, STOP_FOR, &stop);
        P->loops--;
        if (P->failed) return NULL;
        if (str_is(stop, "else")) {
            if (end_tag(P)) return NULL;
            n->alt = p_body(P, STOP_ENDFOR, &stop);
            if (P->failed) return NULL;
        }
        if (end_tag(P)) return NULL;
    } else if (str_is(kw, "set")) {
        if (!(n = mk(P, S_SET, b->pos))) return NULL;
        if (cur(P)->t == T_NAME && peek(P, 1)->t == T_OP && peek(P, 1)->op == O_DOT) {
            node *x = mk(P, N_NAME, cur(P)->pos);
            if (!x) return NULL;
            x->s = cur(P)->s;
            adv(P);
            adv(P);
            if (cur(P)->t != T_NAME) {
                ps_fail(P, cur(P)->pos, "expected an attribute name after '.'");
                return NULL;
            }
            n->s = cur(P)->s;
            n->flag = 1;
            adv(P);
            if (!(n->kid = ar_alloc(P->ar, sizeof(node *)))) {
                ps_fail(P, x->pos, "out of memory");
                return NULL;
            }
            n->kid[0] = x;
            n->nk = 1;
        } else if (p_targets(P, n)) {
            return NULL;
        }
        if (skip_op(P, O_ASSIGN)) {
            if (!(n->a = p_tuple(P)) || expect_bend(P)) return NULL;
        } else {
            if (n->flag || n->nk != 1) {
                ps_fail(P, cur(P)->pos, "expected '=' in a set tag");
                return NULL;
            }
            if (expect_bend(P)) return NULL;
            n->t = S_SETBLOCK;
            n->body = p_body(P, STOP_SET, &stop);
            if (P->failed || end_tag(P)) return NULL;
        }
    } else if (str_is(kw, "macro")) {
        if (!(n = mk(P, S_MACRO, b->pos))) return NULL;
        if (cur(P)->t != T_NAME) {
            ps_fail(P, cur(P)->pos, "expected a macro name");
            return NULL;
        }
        n->s = cur(P)->s;
        adv(P);
        if (expect_op(P, O_LP, "'('")) return NULL;
        nodelist *l = malloc(sizeof *l);
        if (!l) {
            ps_fail(P, n->pos, "out of memory");
            return NULL;
        }
        l->n = 0;
        int ok = 1;
        while (ok && !is_op(P, O_RP)) {
            if (cur(P)->t != T_NAME) {
                ps_fail(P, cur(P)->pos, "expected a parameter name, found %s", tok_desc(cur(P), d, sizeof d));
                ok = 0;
                break;
            }
            node *x = mk(P, N_NAME, cur(P)->pos), *def = NULL;
            ok = x != NULL;
            if (!ok) break;
            x->s = cur(P)->s;
            adv(P);
            if (skip_op(P, O_ASSIGN)) ok = (def = p_expr(P, 1)) != NULL;
            ok = ok && !nl_push(P, l, x, def, NOSTR);
            if (!skip_op(P, O_COMMA)) break;
        }
        ok = ok && !expect_op(P, O_RP, "')'") && !nl_store(P, n, l, 1, 0) && !expect_bend(P);
        free(l);
        if (!ok) return NULL;
        int loops = P->loops, in_macro = P->in_macro;
        P->loops = 0;
        P->in_macro = 1;
        n->body = p_body(P, STOP_MACRO, &stop);
        P->loops = loops;
        P->in_macro = in_macro;
        if (P->failed || end_tag(P)) return NULL;
    } else if (str_is(kw, "break") || str_is(kw, "continue")) {
        if (!P->loops) {
            ps_fail(P, k->pos, "'%.*s' outside a loop", (int)kw.n, kw.p);
            return NULL;
        }
        if (!(n = mk(P, str_is(kw, "break") ? S_BREAK : S_CONTINUE, b->pos)) || expect_bend(P)) return NULL;
    } else if (str_is(kw, "filter")) {
        /* {% filter f(args) | g %}: the body's text through the filters */
        if (!(n = mk(P, S_FILTER, b->pos))) return NULL;
        node *body = mk(P, N_BODY, b->pos);
        if (!body || cur(P)->t != T_NAME) {
            ps_fail(P, cur(P)->pos, "expected a filter name");
            return NULL;
        }
        /* parse "name(args) | ..." as if it followed a '|' */
        node *f = mk(P, N_FILTER, cur(P)->pos);
        if (!f) return NULL;
        f->s = cur(P)->s;
        f->op = find_filter(f->s);
        adv(P);
        f->a = body;
        if (is_op(P, O_LP) && p_args(P, f)) return NULL;
        if (!(n->a = p_filters(P, f)) || expect_bend(P)) return NULL;
        n->body = p_body(P, STOP_FILTER, &stop);
        if (P->failed || end_tag(P)) return NULL;
    } else if (str_is(kw, "generation")) {
        /* a marker for training masks: renders its body unchanged */
        if (!(n = mk(P, S_BLOCK, b->pos)) || expect_bend(P)) return NULL;
        n->body = p_body(P, STOP_GEN, &stop);
        if (P->failed || end_tag(P)) return NULL;
    } else if (str_is(kw, "elif") || str_is(kw, "else") || str_is(kw, "endif") || str_is(kw, "endfor") ||
               str_is(kw, "endset") || str_is(kw, "endmacro") || str_is(kw, "endfilter") ||
               str_is(kw, "endgeneration")) {
        ps_fail(P, k->pos, "'%.*s' without a block to end", (int)kw.n, kw.p);
    } else {
        ps_fail(P, k->pos, "unsupported tag '%.*s'", (int)(kw.n < 40 ? kw.n : 40), kw.p);
    }
    P->depth--;
    return P->failed ? NULL : n;
}

/* Statements until a {% tag %} whose keyword is in stops (NULL-terminated;
 * NULL stops: the end of the template). *stopped is that keyword and the
 * parser is left on it. */
static node *p_body(parser *P, const char *const *stops, str *stopped) {
    node *head = NULL, **tail = &head;
    stopped->p = NULL;
    stopped->n = 0;
    for (;;) {
        tok *t = cur(P);
        node *n = NULL;
        if (t->t == T_EOF) {
            if (stops) ps_fail(P, t->pos, "unexpected end of template: expected '%s'", stops[stops[1] ? 1 : 0]);
            for (int k = 0; stops && stops[k]; k++)
                if (!stops[k + 1]) {
                    P->failed = 0;
                    ps_fail(P, t->pos, "unexpected end of template: expected '%s'", stops[k]);
                }
            return head;
        }
        if (t->t == T_TEXT) {
            if (!(n = mk(P, S_TEXT, t->pos))) return NULL;
            n->s = t->s;
            adv(P);
        } else if (t->t == T_VBEGIN) {
            adv(P);
            if (!(n = mk(P, S_OUT, t->pos)) || !(n->a = p_tuple(P))) return NULL;
            if (cur(P)->t != T_VEND) {
                char d[64];
                ps_fail(P, cur(P)->pos, "expected '}}', found %s", tok_desc(cur(P), d, sizeof d));
                return NULL;
            }
            adv(P);
        } else if (t->t == T_BBEGIN) {
            tok *k = peek(P, 1);
            for (int s = 0; stops && stops[s] && k->t == T_NAME; s++)
                if (str_is(k->s, stops[s])) {
                    adv(P);
                    *stopped = k->s;
                    return head;
                }
            if (!(n = p_statement(P))) return NULL;
        } else {
            char d[64];
            ps_fail(P, t->pos, "unexpected %s", tok_desc(t, d, sizeof d));
            return NULL;
        }
        *tail = n;
        tail = &n->next;
    }
}

/* ---- the public compile --------------------------------------------------- */

static cas_status compile_error(const char *src, size_t n, int32_t pos, const char *msg) {
    int line, col;
    line_col(src, n, pos, &line, &col);
    return cas_error(CAS_ERR_UNSUPPORTED, "jinja: line %d column %d: %s", line, col, msg);
}

cas_status cas_jinja_compile(const char *src, size_t len, cas_jinja **out) {
    if (!out) return cas_error(CAS_ERR_INVALID, "jinja: out is NULL");
    *out = NULL;
    if (!src) return cas_error(CAS_ERR_INVALID, "jinja: template is NULL");
    if (len > MAX_SOURCE) return cas_error(CAS_ERR_UNSUPPORTED, "jinja: template of %zu bytes (at most %u)", len, MAX_SOURCE);
    cas_jinja *t = calloc(1, sizeof *t);
    if (!t) return cas_error(CAS_ERR_NOMEM, "jinja: out of memory");
    /* newlines normalised to \n and one trailing newline dropped, as jinja2 reads source */
    char *s = ar_alloc(&t->ar, len + 1);
    if (!s) {
        free(t);
        return cas_error(CAS_ERR_NOMEM, "jinja: out of memory");
    }
    size_t w = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[w++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[w++] = src[i];
        }
    }
    if (w && s[w - 1] == '\n') w--;
    s[w] = 0;
    t->src = s;
    t->n = w;

    lexer L = {0};
    L.src = s;
    L.n = w;
    L.ar = &t->ar;
    cas_status st = CAS_OK;
    if (lex(&L)) {
        st = L.err[0] && !strcmp(L.err, "out of memory") ? cas_error(CAS_ERR_NOMEM, "jinja: out of memory")
                                                           : compile_error(s, w, L.err_pos, L.err);
        goto done;
    }
    parser P = {0};
    P.v = L.v;
    P.nt = L.nt;
    P.ar = &t->ar;
    str stop;
    t->root = p_body(&P, NULL, &stop);
    if (P.failed) {
        st = compile_error(s, w, P.err_pos, P.err);
        goto done;
    }
done:
    free(L.v);
    if (st) {
        cas_jinja_destroy(t);
        return st;
    }
    *out = t;
    return CAS_OK;
}

void cas_jinja_destroy(cas_jinja *t) {
    if (!t) return;
    ar_free(&t->ar);
    free(t);
}

/* Any N_NAME of the tree: a variable read, or a name a set, for or macro
 * binds (which only makes the answer err on the side of "reads"). Statement
 * lists are walked by their next links in a loop; the recursion follows the
 * source's nesting, bounded by MAX_NEST. */
static int names(const node *n, const char *name, size_t len) {
    for (; n; n = n->next) {
        if (n->t == N_NAME && n->s.n == len && !memcmp(n->s.p, name, len)) return 1;
        if (names(n->a, name, len) || names(n->b, name, len) || names(n->c, name, len) ||
            names(n->d, name, len) || names(n->body, name, len) || names(n->alt, name, len))
            return 1;
        for (int i = 0; i < n->nk; i++)
            if ((n->kid && names(n->kid[i], name, len)) || (n->kid2 && names(n->kid2[i], name, len))) return 1;
    }
    return 0;
}

int cas_jinja_reads(const cas_jinja *t, const char *name) {
    return t && name && names(t->root, name, strlen(name));
}

/* ---- rendering: state, errors, allocation --------------------------------- */

typedef struct scope {
    struct scope *parent;
    str *names;
    value *vals;
    size_t n, cap;
} scope;

typedef struct macro {
    const node *def;
    scope *closure;
} macro;

typedef struct {
    const cas_jinja *t;
    arena ar;
    buf *out;
    size_t max_output;
    int64_t steps, max_steps;
    int64_t now; /* < 0: the clock */
    int call_depth;
    uint64_t stores; /* assignments so far: a statement that made none may free its temporaries */
    dict *globals;
    int failed;
    cas_status code;
    int32_t err_pos;
    char err[400];
} rx;

static int fail(rx *r, int32_t pos, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(rx *r, int32_t pos, const char *fmt, ...) {
    if (r->failed) return -1;
    r->failed = 1;
    r->code = CAS_ERR_UNSUPPORTED;
    r->err_pos = pos;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->err, sizeof r->err, fmt, ap);
    va_end(ap);
    return -1;
}

static int fail_mem(rx *r, int32_t pos) {
    if (r->failed) return -1;
    fail(r, pos, "the template needs more than %zu bytes of memory", r->ar.limit);
    r->code = CAS_ERR_NOMEM;
    return -1;
}

static void *ralloc(rx *r, int32_t pos, size_t n) {
    void *p = ar_alloc(&r->ar, n);
    if (!p) fail_mem(r, pos);
    return p;
}

static int step(rx *r, int32_t pos, int64_t k) {
    r->steps += k;
    if (r->steps > r->max_steps) return fail(r, pos, "the template took more than %lld steps (loop iterations, calls)", (long long)r->max_steps);
    return 0;
}

/* a temporary text buffer whose size counts against the memory limit */
static buf tmpbuf(rx *r) {
    buf b = {0};
    b.limit = r->ar.limit > r->ar.total ? r->ar.limit - r->ar.total : 1;
    return b;
}

/* Moves a temporary buffer's bytes into the arena as a string value. */
static int buf_to_str(rx *r, int32_t pos, buf *b, value *out) {
    if (b->full) {
        size_t lim = b->limit;
        free(b->p);
        if (b->full == 2 || r->failed) return fail_mem(r, pos);
        fail(r, pos, "the text exceeds %zu bytes (the output or memory limit)", lim);
        r->code = CAS_ERR_NOMEM;
        return -1;
    }
    char *p = ralloc(r, pos, b->n + 1);
    if (!p) {
        free(b->p);
        return -1;
    }
    if (b->n) memcpy(p, b->p, b->n);
    p[b->n] = 0;
    *out = v_str(p, b->n);
    free(b->p);
    return 0;
}

static list *new_list(rx *r, int32_t pos, size_t cap) {
    list *l = ralloc(r, pos, sizeof *l);
    if (!l) return NULL;
    memset(l, 0, sizeof *l);
    if (cap && !(l->v = ralloc(r, pos, sizeof(value) * cap))) return NULL;
    l->cap = cap;
    return l;
}

static int list_push(rx *r, int32_t pos, list *l, value v) {
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 8;
        value *p = ralloc(r, pos, sizeof(value) * nc);
        if (!p) return -1;
        if (l->n) memcpy(p, l->v, sizeof(value) * l->n);
        l->v = p;
        l->cap = nc;
    }
    l->v[l->n++] = v;
    return 0;
}

static value v_list(list *l) {
    value v = {.k = V_LIST};
    v.u.l = l;
    return v;
}

static value v_dict(dict *d) {
    value v = {.k = V_DICT};
    v.u.d = d;
    return v;
}

static dict *new_dict(rx *r, int32_t pos) {
    dict *d = ralloc(r, pos, sizeof *d);
    if (d) memset(d, 0, sizeof *d);
    return d;
}

static int veq(const value *a, const value *b, int depth);

static value *dict_get(const dict *d, const value *k) {
    for (size_t i = 0; i < d->n; i++)
        if (veq(&d->k[i], k, 0) == 1) return &d->v[i];
    return NULL;
}

static value *dict_get_s(const dict *d, str k) {
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].k == V_STR && d->k[i].u.s.n == k.n && !memcmp(d->k[i].u.s.p, k.p, k.n)) return &d->v[i];
    return NULL;
}

static int dict_set(rx *r, int32_t pos, dict *d, value k, value v) {
    value *old = dict_get(d, &k);
    if (old) {
        *old = v;
        return 0;
    }
    if (d->n == d->cap) {
        size_t nc = d->cap ? d->cap * 2 : 8;
        value *nk = ralloc(r, pos, sizeof(value) * nc), *nv = ralloc(r, pos, sizeof(value) * nc);
        if (!nk || !nv) return -1;
        if (d->n) {
            memcpy(nk, d->k, sizeof(value) * d->n);
            memcpy(nv, d->v, sizeof(value) * d->n);
        }
        d->k = nk;
        d->v = nv;
        d->cap = nc;
    }
    d->k[d->n] = k;
    d->v[d->n] = v;
    d->n++;
    return 0;
}

/* ---- scopes ---------------------------------------------------------------- */

static scope *new_scope(rx *r, int32_t pos, scope *parent) {
    scope *s = ralloc(r, pos, sizeof *s);
    if (s) {
        memset(s, 0, sizeof *s);
        s->parent = parent;
    }
    return s;
}

static value *scope_find(scope *s, str name) {
    for (; s; s = s->parent)
        for (size_t i = s->n; i-- > 0;)
            if (s->names[i].n == name.n && !memcmp(s->names[i].p, name.p, name.n)) return &s->vals[i];
    return NULL;
}

static int scope_set(rx *r, int32_t pos, scope *s, str name, value v) {
    r->stores++;
    for (size_t i = 0; i < s->n; i++)
        if (s->names[i].n == name.n && !memcmp(s->names[i].p, name.p, name.n)) {
            s->vals[i] = v;
            return 0;
        }
    if (s->n == s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 8;
        str *nn = ralloc(r, pos, sizeof(str) * nc);
        value *nv = ralloc(r, pos, sizeof(value) * nc);
        if (!nn || !nv) return -1;
        if (s->n) {
            memcpy(nn, s->names, sizeof(str) * s->n);
            memcpy(nv, s->vals, sizeof(value) * s->n);
        }
        s->names = nn;
        s->vals = nv;
        s->cap = nc;
    }
    s->names[s->n] = name;
    s->vals[s->n] = v;
    s->n++;
    return 0;
}

/* ---- Python's str(), repr() and json.dumps() ------------------------------ */

/* repr() of a float: the shortest digits that read back to the same value,
 * fixed notation for exponents -4..15, else d.ddde+XX. */
static void float_repr(double x, char *o, size_t cap) {
    if (isnan(x)) {
        snprintf(o, cap, "nan");
        return;
    }
    if (isinf(x)) {
        snprintf(o, cap, x < 0 ? "-inf" : "inf");
        return;
    }
    char e[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, x);
        if (strtod(e, NULL) == x) break;
    }
    const char *p = e;
    int neg = *p == '-';
    if (neg) p++;
    char dig[24];
    int nd = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.' && nd < 23) dig[nd++] = *p;
    int ex = atoi(p + 1);
    while (nd > 1 && dig[nd - 1] == '0') nd--;
    char *w = o, *end = o + cap - 1;
#define PUT(c)                                                                                                         \
    do {                                                                                                               \
        if (w < end) *w++ = (c);                                                                                       \
    } while (0)
    if (neg) PUT('-');
    if (ex >= -4 && ex < 16) {
        if (ex < 0) {
            PUT('0');
            PUT('.');
            for (int k = 0; k < -ex - 1; k++) PUT('0');
            for (int k = 0; k < nd; k++) PUT(dig[k]);
        } else {
            for (int k = 0; k <= ex; k++) PUT(k < nd ? dig[k] : '0');
            PUT('.');
            if (nd > ex + 1)
                for (int k = ex + 1; k < nd; k++) PUT(dig[k]);
            else
                PUT('0');
        }
    } else {
        PUT(dig[0]);
        if (nd > 1) {
            PUT('.');
            for (int k = 1; k < nd; k++) PUT(dig[k]);
        }
        PUT('e');
        PUT(ex < 0 ? '-' : '+');
        int a = ex < 0 ? -ex : ex;
        char t[16];
        snprintf(t, sizeof t, "%02d", a);
        for (char *q = t; *q; q++) PUT(*q);
    }
#undef PUT
    *w = 0;
}

static int repr_str(buf *b, str s) {
    char q = '\'';
    if (memchr(s.p, '\'', s.n) && !memchr(s.p, '"', s.n)) q = '"';
    b_ch(b, q);
    for (size_t i = 0; i < s.n;) {
        uint32_t cp;
        size_t l = u8_dec(s.p, s.n, i, &cp);
        if (cp == (uint32_t)q || cp == '\\') b_ch(b, '\\'), b_ch(b, (char)cp);
        else if (cp == '\n') b_str(b, "\\n");
        else if (cp == '\r') b_str(b, "\\r");
        else if (cp == '\t') b_str(b, "\\t");
        else if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) b_fmt(b, "\\x%02x", (unsigned)cp);
        else b_put(b, s.p + i, l);
        i += l;
    }
    return b_ch(b, q);
}

static int to_text(rx *r, int32_t pos, buf *b, const value *v, int quote, int depth);

static int repr_items(rx *r, int32_t pos, buf *b, const value *v, int depth) {
    if (v->k == V_LIST) {
        const list *l = v->u.l;
        if (l->iter == IT_GEN) return b_str(b, "<generator object>");
        if (l->iter != IT_LIST) b_str(b, type_name(v)), b_ch(b, '(');
        b_ch(b, l->tuple ? '(' : '[');
        for (size_t i = 0; i < l->n; i++) {
            if (i) b_str(b, ", ");
            if (to_text(r, pos, b, &l->v[i], 1, depth + 1)) return -1;
        }
        if (l->tuple && l->n == 1) b_ch(b, ',');
        b_ch(b, l->tuple ? ')' : ']');
        return l->iter != IT_LIST ? b_ch(b, ')') : 0;
    }
    const dict *d = v->u.d;
    if (d->ns) b_str(b, "<Namespace ");
    b_ch(b, '{');
    for (size_t i = 0; i < d->n; i++) {
        if (i) b_str(b, ", ");
        if (to_text(r, pos, b, &d->k[i], 1, depth + 1)) return -1;
        b_str(b, ": ");
        if (to_text(r, pos, b, &d->v[i], 1, depth + 1)) return -1;
    }
    b_ch(b, '}');
    return d->ns ? b_ch(b, '>') : 0;
}

/* str(v) (quote 0) or repr(v) (quote 1) appended to b; a full b is the
 * caller's to check (b->full), -1 means an error recorded in r */
static int to_text_(rx *r, int32_t pos, buf *b, const value *v, int quote, int depth);
static int to_text(rx *r, int32_t pos, buf *b, const value *v, int quote, int depth) {
    to_text_(r, pos, b, v, quote, depth);
    return r->failed ? -1 : 0;
}

static int to_text_(rx *r, int32_t pos, buf *b, const value *v, int quote, int depth) {
    if (depth > MAX_DATA_DEPTH) return fail(r, pos, "a value nested more than %d deep", MAX_DATA_DEPTH);
    char t[64];
    switch (v->k) {
    case V_UNDEF: return 0;
    case V_NONE: return b_str(b, "None");
    case V_BOOL: return b_str(b, v->u.b ? "True" : "False");
    case V_INT: return b_fmt(b, "%lld", (long long)v->u.i);
    case V_FLOAT: float_repr(v->u.f, t, sizeof t); return b_str(b, t);
    case V_STR: return quote ? repr_str(b, v->u.s) : b_put(b, v->u.s.p, v->u.s.n);
    case V_LIST:
    case V_DICT: return repr_items(r, pos, b, v, depth);
    case V_MACRO: return b_fmt(b, "<Macro '%.*s'>", (int)v->u.m->def->s.n, v->u.m->def->s.p);
    case V_LOOP: return b_str(b, "<LoopContext>");
    default: return b_str(b, "<built-in function>");
    }
}

/* str(v) as a string value (no copy for strings) */
static int to_str(rx *r, int32_t pos, const value *v, value *out) {
    if (v->k == V_STR) {
        *out = *v;
        return 0;
    }
    if (v->k == V_UNDEF) {
        *out = v_str("", 0);
        return 0;
    }
    buf b = tmpbuf(r);
    if (to_text(r, pos, &b, v, 0, 0)) {
        free(b.p);
        return -1;
    }
    return buf_to_str(r, pos, &b, out);
}

typedef struct {
    int indent; /* < 0: none */
    str item_sep, key_sep;
    int sort_keys, ascii;
} json_style;

static int json_string(buf *b, str s, int ascii) {
    b_ch(b, '"');
    for (size_t i = 0; i < s.n;) {
        uint32_t cp;
        size_t l = u8_dec(s.p, s.n, i, &cp);
        switch (cp) {
        case '"': b_str(b, "\\\""); break;
        case '\\': b_str(b, "\\\\"); break;
        case '\n': b_str(b, "\\n"); break;
        case '\r': b_str(b, "\\r"); break;
        case '\t': b_str(b, "\\t"); break;
        case '\b': b_str(b, "\\b"); break;
        case '\f': b_str(b, "\\f"); break;
        default:
            if (cp < 0x20 || (ascii && cp >= 0x7F)) {
                if (cp >= 0x10000) {
                    uint32_t c = cp - 0x10000;
                    b_fmt(b, "\\u%04x\\u%04x", 0xD800 + (c >> 10), 0xDC00 + (c & 0x3FF));
                } else {
                    b_fmt(b, "\\u%04x", (unsigned)cp);
                }
            } else {
                b_put(b, s.p + i, l);
            }
        }
        i += l;
    }
    return b_ch(b, '"');
}

static void json_newline(buf *b, const json_style *js, int level) {
    b_ch(b, '\n');
    for (int k = 0; k < js->indent * level; k++) b_ch(b, ' ');
}

static int vcmp(rx *r, int32_t pos, const value *a, const value *b, int ci, int *res);

static int to_json_(rx *r, int32_t pos, buf *b, const value *v, const json_style *js, int level);
static int to_json(rx *r, int32_t pos, buf *b, const value *v, const json_style *js, int level) {
    to_json_(r, pos, b, v, js, level);
    return r->failed ? -1 : 0;
}

static int to_json_(rx *r, int32_t pos, buf *b, const value *v, const json_style *js, int level) {
    if (level > MAX_DATA_DEPTH) return fail(r, pos, "a value nested more than %d deep", MAX_DATA_DEPTH);
    char t[64];
    switch (v->k) {
    case V_NONE: return b_str(b, "null");
    case V_BOOL: return b_str(b, v->u.b ? "true" : "false");
    case V_INT: return b_fmt(b, "%lld", (long long)v->u.i);
    case V_FLOAT:
        if (isnan(v->u.f)) return b_str(b, "NaN");
        if (isinf(v->u.f)) return b_str(b, v->u.f < 0 ? "-Infinity" : "Infinity");
        float_repr(v->u.f, t, sizeof t);
        return b_str(b, t);
    case V_STR: return json_string(b, v->u.s, js->ascii);
    case V_LIST: {
        const list *l = v->u.l;
        if (l->iter != IT_LIST) return fail(r, pos, "Object of type %s is not JSON serializable", type_name(v));
        if (!l->n) return b_str(b, "[]");
        b_ch(b, '[');
        for (size_t i = 0; i < l->n; i++) {
            if (i) b_put(b, js->item_sep.p, js->item_sep.n);
            if (js->indent >= 0) json_newline(b, js, level + 1);
            if (to_json(r, pos, b, &l->v[i], js, level + 1)) return -1;
        }
        if (js->indent >= 0) json_newline(b, js, level);
        return b_ch(b, ']');
    }
    case V_DICT: {
        const dict *d = v->u.d;
        if (d->ns) return fail(r, pos, "Object of type Namespace is not JSON serializable");
        if (!d->n) return b_str(b, "{}");
        size_t *ord = ralloc(r, pos, sizeof(size_t) * d->n);
        if (!ord) return -1;
        for (size_t i = 0; i < d->n; i++) ord[i] = i;
        if (js->sort_keys) /* insertion sort: dicts in templates are small */
            for (size_t i = 1; i < d->n; i++)
                for (size_t j = i; j > 0; j--) {
                    int c;
                    if (vcmp(r, pos, &d->k[ord[j - 1]], &d->k[ord[j]], 0, &c)) return -1;
                    if (c <= 0) break;
                    size_t x = ord[j];
                    ord[j] = ord[j - 1];
                    ord[j - 1] = x;
                }
        b_ch(b, '{');
        for (size_t i = 0; i < d->n; i++) {
            const value *k = &d->k[ord[i]];
            if (i) b_put(b, js->item_sep.p, js->item_sep.n);
            if (js->indent >= 0) json_newline(b, js, level + 1);
            if (k->k == V_STR) json_string(b, k->u.s, js->ascii);
            else if (k->k == V_INT || k->k == V_FLOAT || k->k == V_BOOL || k->k == V_NONE) {
                b_ch(b, '"');
                if (to_json(r, pos, b, k, js, level + 1)) return -1;
                b_ch(b, '"');
            } else {
                return fail(r, pos, "keys must be str, int, float, bool or None, not %s", type_name(k));
            }
            b_put(b, js->key_sep.p, js->key_sep.n);
            if (to_json(r, pos, b, &d->v[ord[i]], js, level + 1)) return -1;
        }
        if (js->indent >= 0) json_newline(b, js, level);
        return b_ch(b, '}');
    }
    default: return fail(r, pos, "Object of type %s is not JSON serializable", type_name(v));
    }
}

/* ---- the context: JSON in --------------------------------------------------- */

typedef struct {
    rx *r;
    const char *s;
    size_t n, i;
    int depth;
} jreader;

static int jr_fail(jreader *j, const char *what) {
    fail(j->r, 0, "context JSON: %s at byte %zu", what, j->i);
    j->r->code = CAS_ERR_INVALID;
    return -1;
}

static void jr_ws(jreader *j) {
    while (j->i < j->n && (j->s[j->i] == ' ' || j->s[j->i] == '\t' || j->s[j->i] == '\n' || j->s[j->i] == '\r')) j->i++;
}

static int jr_value(jreader *j, value *out);

static int jr_hex4(jreader *j, uint32_t *cp) {
    if (j->n - j->i < 4) return jr_fail(j, "truncated \\u escape");
    uint32_t c = 0;
    for (int k = 0; k < 4; k++) {
        int h = hexval(j->s[j->i + (size_t)k]);
        if (h < 0) return jr_fail(j, "bad \\u escape");
        c = c * 16 + (uint32_t)h;
    }
    j->i += 4;
    *cp = c;
    return 0;
}

static int jr_string(jreader *j, value *out) {
    j->i++; /* the quote */
    size_t start = j->i, e = start;
    while (e < j->n && j->s[e] != '"') e += j->s[e] == '\\' ? 2 : 1;
    if (e >= j->n) return jr_fail(j, "unterminated string");
    char *o = ralloc(j->r, 0, e - start + 1);
    if (!o) return -1;
    size_t w = 0;
    while (j->i < e) {
        char c = j->s[j->i++];
        if ((unsigned char)c < 0x20) return jr_fail(j, "control character in a string");
        if (c != '\\') {
            o[w++] = c;
            continue;
        }
        char x = j->s[j->i++];
        switch (x) {
        case '"': o[w++] = '"'; break;
        case '\\': o[w++] = '\\'; break;
        case '/': o[w++] = '/'; break;
        case 'b': o[w++] = '\b'; break;
        case 'f': o[w++] = '\f'; break;
        case 'n': o[w++] = '\n'; break;
        case 'r': o[w++] = '\r'; break;
        case 't': o[w++] = '\t'; break;
        case 'u': {
            uint32_t cp;
            if (jr_hex4(j, &cp)) return -1;
            if (cp >= 0xD800 && cp < 0xDC00 && j->i + 6 <= e && j->s[j->i] == '\\' && j->s[j->i + 1] == 'u') {
                size_t save = j->i;
                uint32_t lo;
                j->i += 2;
                if (jr_hex4(j, &lo)) return -1;
                if (lo >= 0xDC00 && lo < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                else j->i = save;
            }
            w += u8_enc(cp, o + w); /* at most 4 bytes from at least 6 */
            break;
        }
        default: return jr_fail(j, "bad escape");
        }
    }
    j->i = e + 1;
    o[w] = 0;
    *out = v_str(o, w);
    return 0;
}

static int jr_value(jreader *j, value *out) {
    jr_ws(j);
    if (j->i >= j->n) return jr_fail(j, "unexpected end");
    if (++j->depth > MAX_DATA_DEPTH) return jr_fail(j, "nested too deep");
    char c = j->s[j->i];
    int rc = 0;
    if (c == '"') {
        rc = jr_string(j, out);
    } else if (c == '[' || c == '{') {
        j->i++;
        list *l = c == '[' ? new_list(j->r, 0, 0) : NULL;
        dict *d = c == '{' ? new_dict(j->r, 0) : NULL;
        if (!l && !d) return -1;
        jr_ws(j);
        char close = c == '[' ? ']' : '}';
        if (j->i < j->n && j->s[j->i] == close) {
            j->i++;
        } else {
            for (;;) {
                value k, v;
                if (d) {
                    jr_ws(j);
                    if (j->i >= j->n || j->s[j->i] != '"') return jr_fail(j, "expected a key");
                    if (jr_string(j, &k)) return -1;
                    jr_ws(j);
                    if (j->i >= j->n || j->s[j->i] != ':') return jr_fail(j, "expected ':'");
                    j->i++;
                }
                if (jr_value(j, &v)) return -1;
                if (d ? dict_set(j->r, 0, d, k, v) : list_push(j->r, 0, l, v)) return -1;
                jr_ws(j);
                if (j->i < j->n && j->s[j->i] == ',') {
                    j->i++;
                    continue;
                }
                if (j->i < j->n && j->s[j->i] == close) {
                    j->i++;
                    break;
                }
                return jr_fail(j, "expected ',' or a closing bracket");
            }
        }
        *out = d ? v_dict(d) : v_list(l);
    } else if (!strncmp(j->s + j->i, "true", j->n - j->i < 4 ? j->n - j->i : 4) && j->n - j->i >= 4) {
        j->i += 4;
        *out = v_bool(1);
    } else if (j->n - j->i >= 5 && !strncmp(j->s + j->i, "false", 5)) {
        j->i += 5;
        *out = v_bool(0);
    } else if (j->n - j->i >= 4 && !strncmp(j->s + j->i, "null", 4)) {
        j->i += 4;
        *out = v_none();
    } else if (c == '-' || is_digit(c)) {
        size_t e = j->i + (c == '-');
        int fl = 0;
        while (e < j->n && (is_digit(j->s[e]) || j->s[e] == '.' || j->s[e] == 'e' || j->s[e] == 'E' ||
                            ((j->s[e] == '+' || j->s[e] == '-') && (j->s[e - 1] == 'e' || j->s[e - 1] == 'E')))) {
            if (!is_digit(j->s[e])) fl = 1;
            e++;
        }
        char tmp[64];
        if (e - j->i >= sizeof tmp) return jr_fail(j, "number too long");
        memcpy(tmp, j->s + j->i, e - j->i);
        tmp[e - j->i] = 0;
        char *end;
        if (!fl && e - j->i <= 18) *out = v_int(strtoll(tmp, &end, 10));
        else *out = v_float(strtod(tmp, &end));
        if (*end) return jr_fail(j, "bad number");
        j->i = e;
    } else {
        return jr_fail(j, "unexpected character");
    }
    j->depth--;
    return rc;
}

/* ---- comparisons --------------------------------------------------------- */

/* Python ==: 1 equal, 0 not. Numbers compare across int, float and bool;
 * a list never equals a tuple. */
static int veq(const value *a, const value *b, int depth) {
    if (depth > MAX_DATA_DEPTH) return 0;
    if (is_num(a) && is_num(b)) {
        if (a->k == V_FLOAT || b->k == V_FLOAT) return num_f(a) == num_f(b);
        return num_i(a) == num_i(b);
    }
    if (a->k != b->k) return 0;
    switch (a->k) {
    case V_UNDEF:
    case V_NONE: return 1;
    case V_STR: return a->u.s.n == b->u.s.n && !memcmp(a->u.s.p, b->u.s.p, a->u.s.n);
    case V_LIST:
        if (a->u.l->iter != IT_LIST || b->u.l->iter != IT_LIST) return a->u.l == b->u.l;
        if (a->u.l->tuple != b->u.l->tuple || a->u.l->n != b->u.l->n) return 0;
        for (size_t i = 0; i < a->u.l->n; i++)
            if (!veq(&a->u.l->v[i], &b->u.l->v[i], depth + 1)) return 0;
        return 1;
    case V_DICT:
        if (a->u.d->ns || b->u.d->ns) return a->u.d == b->u.d;
        if (a->u.d->n != b->u.d->n) return 0;
        for (size_t i = 0; i < a->u.d->n; i++) {
            value *o = NULL;
            for (size_t k = 0; k < b->u.d->n && !o; k++)
                if (veq(&a->u.d->k[i], &b->u.d->k[k], depth + 1)) o = &b->u.d->v[k];
            if (!o || !veq(&a->u.d->v[i], o, depth + 1)) return 0;
        }
        return 1;
    case V_MACRO: return a->u.m == b->u.m;
    case V_FUNC: return a->u.fn == b->u.fn;
    default: return 0;
    }
}

static int lower_cmp(str a, str b) {
    size_t n = a.n < b.n ? a.n : b.n;
    for (size_t i = 0; i < n; i++) {
        unsigned char x = (unsigned char)a.p[i], y = (unsigned char)b.p[i];
        if (x >= 'A' && x <= 'Z') x = (unsigned char)(x + 32);
        if (y >= 'A' && y <= 'Z') y = (unsigned char)(y + 32);
        if (x != y) return x < y ? -1 : 1;
    }
    return a.n < b.n ? -1 : a.n > b.n;
}

/* Python ordering for <, sorted(), min(); ci: strings compare lowercased */
static int vcmp(rx *r, int32_t pos, const value *a, const value *b, int ci, int *res) {
    if (is_num(a) && is_num(b)) {
        if (a->k == V_FLOAT || b->k == V_FLOAT) {
            double x = num_f(a), y = num_f(b);
            *res = x < y ? -1 : x > y;
        } else {
            int64_t x = num_i(a), y = num_i(b);
            *res = x < y ? -1 : x > y;
        }
        return 0;
    }
    if (a->k == V_STR && b->k == V_STR) {
        if (ci) {
            *res = lower_cmp(a->u.s, b->u.s);
            return 0;
        }
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        int c = n ? memcmp(a->u.s.p, b->u.s.p, n) : 0;
        *res = c ? (c < 0 ? -1 : 1) : a->u.s.n < b->u.s.n ? -1 : a->u.s.n > b->u.s.n;
        return 0;
    }
    if (a->k == V_LIST && b->k == V_LIST && a->u.l->tuple == b->u.l->tuple) {
        size_t n = a->u.l->n < b->u.l->n ? a->u.l->n : b->u.l->n;
        for (size_t i = 0; i < n; i++) {
            if (veq(&a->u.l->v[i], &b->u.l->v[i], 0)) continue;
            return vcmp(r, pos, &a->u.l->v[i], &b->u.l->v[i], ci, res);
        }
        *res = a->u.l->n < b->u.l->n ? -1 : a->u.l->n > b->u.l->n;
        return 0;
    }
    if (a->k == V_UNDEF || b->k == V_UNDEF) {
        const value *u = a->k == V_UNDEF ? a : b;
        return fail(r, pos, "'%.*s' is undefined", (int)u->u.s.n, u->u.s.p);
    }
    return fail(r, pos, "'<' not supported between instances of '%s' and '%s'", type_name(a), type_name(b));
}

/* A stable merge sort of n values by key (keys[i] sorts vals[i]). */
static int sort_values(rx *r, int32_t pos, value *vals, value *keys, size_t n, int ci, int reverse) {
    if (n < 2) return 0;
    value *tv = ralloc(r, pos, sizeof(value) * n), *tk = ralloc(r, pos, sizeof(value) * n);
    if (!tv || !tk) return -1;
    for (size_t w = 1; w < n; w *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * w) {
            size_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            size_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) {
                int c;
                if (vcmp(r, pos, &keys[j], &keys[i], ci, &c)) return -1;
                if (reverse) c = -c;
                int take_right = c < 0;
                tv[o] = take_right ? vals[j] : vals[i];
                tk[o++] = take_right ? keys[j++] : keys[i++];
            }
            while (i < mid) tv[o] = vals[i], tk[o++] = keys[i++];
            while (j < hi) tv[o] = vals[j], tk[o++] = keys[j++];
        }
        memcpy(vals, tv, sizeof(value) * n);
        memcpy(keys, tk, sizeof(value) * n);
    }
    return 0;
}

/* ---- attribute and item access -------------------------------------------- */

static const char *const STR_METHODS[] = {"startswith", "endswith", "strip", "lstrip", "rstrip", "split",
                                          "rsplit", "upper", "lower", "title", "capitalize", "replace",
                                          "join", "find", "count", "format", "splitlines", "isdigit",
                                          "isalpha", "isalnum", "isspace", "islower", "isupper", NULL};
static const char *const DICT_METHODS[] = {"get", "items", "keys", "values", "copy", "pop", "update",
                                           "setdefault", "clear", "popitem", NULL};
static const char *const LIST_METHODS[] = {"append", "extend", "insert", "pop", "remove", "clear",
                                           "sort", "reverse", "index", "count", "copy", NULL};

static int in_names(str s, const char *const *names) {
    for (int i = 0; names[i]; i++)
        if (str_is(s, names[i])) return 1;
    return 0;
}

static int make_method(rx *r, int32_t pos, const value *self, str name, value *out) {
    method *m = ralloc(r, pos, sizeof *m);
    if (!m) return -1;
    m->self = *self;
    m->name = name;
    out->k = V_METHOD;
    out->u.mt = m;
    return 0;
}

static int undefined_error(rx *r, int32_t pos, const value *u) {
    if (u->u.s.n) return fail(r, pos, "'%.*s' is undefined", (int)(u->u.s.n < 60 ? u->u.s.n : 60), u->u.s.p);
    return fail(r, pos, "a value is undefined");
}

/* obj.name as jinja2 resolves it: the Python attribute first (methods), then the item */
static int get_attr(rx *r, int32_t pos, const value *obj, str name, value *out) {
    *out = v_undef(name);
    switch (obj->k) {
    case V_UNDEF: return undefined_error(r, pos, obj);
    case V_DICT: {
        if (!obj->u.d->ns && in_names(name, DICT_METHODS)) return make_method(r, pos, obj, name, out);
        value *v = dict_get_s(obj->u.d, name);
        if (v) *out = *v;
        return 0;
    }
    case V_STR: return in_names(name, STR_METHODS) ? make_method(r, pos, obj, name, out) : 0;
    case V_LIST: return in_names(name, LIST_METHODS) ? make_method(r, pos, obj, name, out) : 0;
    case V_LOOP: {
        const loopst *lp = obj->u.lp;
        int64_t i = (int64_t)lp->i, n = (int64_t)lp->items->n;
        if (str_is(name, "index")) *out = v_int(i + 1);
        else if (str_is(name, "index0")) *out = v_int(i);
        else if (str_is(name, "revindex")) *out = v_int(n - i);
        else if (str_is(name, "revindex0")) *out = v_int(n - i - 1);
        else if (str_is(name, "first")) *out = v_bool(i == 0);
        else if (str_is(name, "last")) *out = v_bool(i == n - 1);
        else if (str_is(name, "length")) *out = v_int(n);
        else if (str_is(name, "depth")) *out = v_int(1);
        else if (str_is(name, "depth0")) *out = v_int(0);
        else if (str_is(name, "previtem")) {
            if (i > 0) *out = lp->items->v[i - 1];
        } else if (str_is(name, "nextitem")) {
            if (i + 1 < n) *out = lp->items->v[i + 1];
        } else if (str_is(name, "cycle"))
            return make_method(r, pos, obj, name, out);
        return 0;
    }
    default: return 0;
    }
}

static int idx_norm(int64_t i, size_t n, size_t *out) {
    if (i < 0) i += (int64_t)n;
    if (i < 0 || (uint64_t)i >= n) return 0;
    *out = (size_t)i;
    return 1;
}

/* obj[key]: the item first, then (for a string key) the attribute */
static int get_item(rx *r, int32_t pos, const value *obj, const value *key, value *out) {
    *out = v_undef(key->k == V_STR ? key->u.s : NOSTR);
    if (obj->k == V_UNDEF) return undefined_error(r, pos, obj);
    if (obj->k == V_DICT) {
        value *v = dict_get(obj->u.d, key);
        if (v) {
            *out = *v;
            return 0;
        }
    } else if ((obj->k == V_LIST || obj->k == V_STR) && (key->k == V_INT || key->k == V_BOOL)) {
        size_t i;
        if (obj->k == V_LIST) {
            if (obj->u.l->iter == IT_LIST && idx_norm(num_i(key), obj->u.l->n, &i)) *out = obj->u.l->v[i];
        } else {
            size_t n = u8_len(obj->u.s);
            if (idx_norm(num_i(key), n, &i)) {
                size_t a = u8_off(obj->u.s, i), b = u8_off(obj->u.s, i + 1);
                *out = v_str(obj->u.s.p + a, b - a);
            }
        }
        return 0;
    }
    if (key->k == V_STR) return get_attr(r, pos, obj, key->u.s, out);
    return 0;
}

/* Python slice indices for a sequence of n items */
static int slice_bounds(rx *r, int32_t pos, const value *lo, const value *hi, const value *st, size_t n,
                        int64_t *start, int64_t *stop, int64_t *stepv) {
    int64_t s = 1;
    if (st && st->k != V_NONE) {
        if (st->k != V_INT) return fail(r, pos, "slice indices must be integers or None");
        s = st->u.i;
        if (s == 0) return fail(r, pos, "slice step cannot be zero");
    }
    int64_t N = (int64_t)n, a, b;
    if (lo && lo->k != V_NONE) {
        if (lo->k != V_INT && lo->k != V_BOOL) return fail(r, pos, "slice indices must be integers or None");
        a = num_i(lo);
        if (a < 0) a += N;
        if (a < 0) a = s < 0 ? -1 : 0;
        if (a >= N) a = s < 0 ? N - 1 : N;
    } else {
        a = s < 0 ? N - 1 : 0;
    }
    if (hi && hi->k != V_NONE) {
        if (hi->k != V_INT && hi->k != V_BOOL) return fail(r, pos, "slice indices must be integers or None");
        b = num_i(hi);
        if (b < 0) b += N;
        if (b < 0) b = s < 0 ? -1 : 0;
        if (b >= N) b = s < 0 ? N - 1 : N;
    } else {
        b = s < 0 ? -1 : N;
    }
    *start = a;
    *stop = b;
    *stepv = s;
    return 0;
}

static int do_slice(rx *r, int32_t pos, const value *obj, const value *lo, const value *hi, const value *st, value *out) {
    if (obj->k == V_UNDEF) return undefined_error(r, pos, obj);
    if ((obj->k != V_LIST || obj->u.l->iter != IT_LIST) && obj->k != V_STR) {
        *out = v_undef(NOSTR);
        return 0;
    }
    size_t n = obj->k == V_LIST ? obj->u.l->n : u8_len(obj->u.s);
    int64_t a = 0, b = 0, s = 1;
    if (slice_bounds(r, pos, lo, hi, st, n, &a, &b, &s)) return -1;
    if (obj->k == V_LIST) {
        list *l = new_list(r, pos, 0);
        if (!l) return -1;
        l->tuple = obj->u.l->tuple;
        for (int64_t i = a; s > 0 ? i < b : i > b; i += s)
            if (list_push(r, pos, l, obj->u.l->v[i])) return -1;
        *out = v_list(l);
        return 0;
    }
    if (s == 1) {
        size_t x = u8_off(obj->u.s, (size_t)a), y = b > a ? u8_off(obj->u.s, (size_t)b) : x;
        *out = v_str(obj->u.s.p + x, y - x);
        return 0;
    }
    /* other steps: collect the code points' offsets */
    size_t *off = ralloc(r, pos, sizeof(size_t) * (n + 1));
    if (!off) return -1;
    size_t k = 0, i = 0;
    uint32_t cp;
    while (i < obj->u.s.n) off[k++] = i, i += u8_dec(obj->u.s.p, obj->u.s.n, i, &cp);
    off[k] = obj->u.s.n;
    buf o = tmpbuf(r);
    for (int64_t j = a; s > 0 ? j < b : j > b; j += s) b_put(&o, obj->u.s.p + off[j], off[j + 1] - off[j]);
    return buf_to_str(r, pos, &o, out);
}

/* ---- evaluation ------------------------------------------------------------ */

typedef struct {
    int n;
    value *v;
    const str *kw; /* kw[i].p NULL: positional */
} args;

/* the positional argument idx or the keyword name; 1 if given */
static int arg(const args *a, int idx, const char *name, value *out) {
    int p = 0;
    for (int i = 0; i < a->n; i++) {
        if (a->kw && a->kw[i].p) {
            if (name && str_is(a->kw[i], name)) {
                *out = a->v[i];
                return 1;
            }
        } else if (p++ == idx) {
            *out = a->v[i];
            return 1;
        }
    }
    return 0;
}

static int n_positional(const args *a) {
    int p = 0;
    for (int i = 0; i < a->n; i++) p += !(a->kw && a->kw[i].p);
    return p;
}

static int eval(rx *r, scope *sc, const node *e, value *out);
static int exec_body(rx *r, scope *sc, const node *n);
static int apply_filter(rx *r, int32_t pos, int fid, const value *in, const args *a, value *out);
static int apply_test(rx *r, int32_t pos, int tid, const value *v, const args *a, int *res);
static int call_value(rx *r, int32_t pos, const value *f, const args *a, value *out);

static int eval_args(rx *r, scope *sc, const node *e, args *a) {
    a->n = e->nk;
    a->kw = e->kw;
    a->v = NULL;
    if (!e->nk) return 0;
    if (!(a->v = ralloc(r, e->pos, sizeof(value) * (size_t)e->nk))) return -1;
    for (int i = 0; i < e->nk; i++)
        if (eval(r, sc, e->kid[i], &a->v[i])) return -1;
    return 0;
}

static int str_concat(rx *r, int32_t pos, str a, str b, value *out) {
    char *p = ralloc(r, pos, a.n + b.n + 1);
    if (!p) return -1;
    if (a.n) memcpy(p, a.p, a.n);
    if (b.n) memcpy(p + a.n, b.p, b.n);
    p[a.n + b.n] = 0;
    *out = v_str(p, a.n + b.n);
    return 0;
}

/* Markup's escaping of a plain string joined to it */
static int html_escape(rx *r, int32_t pos, str s, value *out) {
    buf b = tmpbuf(r);
    for (size_t i = 0; i < s.n; i++) {
        switch (s.p[i]) {
        case '&': b_str(&b, "&amp;"); break;
        case '<': b_str(&b, "&lt;"); break;
        case '>': b_str(&b, "&gt;"); break;
        case '"': b_str(&b, "&#34;"); break;
        case '\'': b_str(&b, "&#39;"); break;
        default: b_ch(&b, s.p[i]);
        }
    }
    return buf_to_str(r, pos, &b, out);
}

static int arith(rx *r, int32_t pos, int op, const value *a, const value *b, value *out) {
    if (op == O_TILDE) {
        value x, y;
        if (to_str(r, pos, a, &x) || to_str(r, pos, b, &y)) return -1;
        return str_concat(r, pos, x.u.s, y.u.s, out);
    }
    if (a->k == V_UNDEF) return undefined_error(r, pos, a);
    if (b->k == V_UNDEF) return undefined_error(r, pos, b);
    if (op == O_ADD && a->k == V_STR && b->k == V_STR) {
        if (a->markup == b->markup) {
            if (str_concat(r, pos, a->u.s, b->u.s, out)) return -1;
            out->markup = a->markup;
            return 0;
        }
        value ea = *a, eb = *b;
        if ((!a->markup && html_escape(r, pos, a->u.s, &ea)) || (!b->markup && html_escape(r, pos, b->u.s, &eb)))
            return -1;
        if (str_concat(r, pos, ea.u.s, eb.u.s, out)) return -1;
        out->markup = 1;
        return 0;
    }
    if (op == O_ADD && a->k == V_LIST && b->k == V_LIST && a->u.l->tuple == b->u.l->tuple &&
        a->u.l->iter == IT_LIST && b->u.l->iter == IT_LIST) {
        list *l = new_list(r, pos, a->u.l->n + b->u.l->n);
        if (!l) return -1;
        l->tuple = a->u.l->tuple;
        for (size_t i = 0; i < a->u.l->n; i++) l->v[l->n++] = a->u.l->v[i];
        for (size_t i = 0; i < b->u.l->n; i++) l->v[l->n++] = b->u.l->v[i];
        *out = v_list(l);
        return 0;
    }
    if (op == O_MUL && ((a->k == V_STR || (a->k == V_LIST && a->u.l->iter == IT_LIST)) && (b->k == V_INT || b->k == V_BOOL))) {
        int64_t k = num_i(b);
        if (k < 0 || (a->k == V_STR ? a->u.s.n : a->u.l->n) == 0) k = 0; /* nothing to repeat: no loop to run */
        if (a->k == V_STR) {
            if (a->u.s.n && (uint64_t)k > (r->ar.limit ? r->ar.limit : SIZE_MAX) / a->u.s.n) return fail_mem(r, pos);
            char *p = ralloc(r, pos, a->u.s.n * (size_t)k + 1);
            if (!p) return -1;
            for (int64_t i = 0; i < k; i++) memcpy(p + (size_t)i * a->u.s.n, a->u.s.p, a->u.s.n);
            p[a->u.s.n * (size_t)k] = 0;
            *out = v_str(p, a->u.s.n * (size_t)k);
            return 0;
        }
        if (a->u.l->n && (uint64_t)k > (uint64_t)(r->max_steps) / a->u.l->n) return fail_mem(r, pos);
        list *l = new_list(r, pos, a->u.l->n * (size_t)k);
        if (!l) return -1;
        l->tuple = a->u.l->tuple;
        for (int64_t i = 0; i < k; i++)
            for (size_t j = 0; j < a->u.l->n; j++) l->v[l->n++] = a->u.l->v[j];
        *out = v_list(l);
        return 0;
    }
    if (op == O_MUL && (b->k == V_STR || b->k == V_LIST) && (a->k == V_INT || a->k == V_BOOL))
        return arith(r, pos, op, b, a, out);
    if (!is_num(a) || !is_num(b)) {
        static const char *const names[] = {"", "+", "-", "*", "/", "//", "%", "**"};
        return fail(r, pos, "unsupported operand types for %s: '%s' and '%s'", op <= O_POW ? names[op] : "?",
                    type_name(a), type_name(b));
    }
    int fl = a->k == V_FLOAT || b->k == V_FLOAT;
    if (op == O_DIV) {
        double y = num_f(b);
        if (y == 0) return fail(r, pos, "division by zero");
        *out = v_float(num_f(a) / y);
        return 0;
    }
    if (fl) {
        double x = num_f(a), y = num_f(b), z;
        switch (op) {
        case O_ADD: z = x + y; break;
        case O_SUB: z = x - y; break;
        case O_MUL: z = x * y; break;
        case O_POW: z = pow(x, y); break;
        default:
            if (y == 0) return fail(r, pos, "division by zero");
            if (op == O_FDIV) z = floor(x / y);
            else {
                z = fmod(x, y);
                if (z != 0 && ((z < 0) != (y < 0))) z += y;
            }
        }
        *out = v_float(z);
        return 0;
    }
    int64_t x = num_i(a), y = num_i(b), z = 0;
    int ovf = 0;
    switch (op) {
    case O_ADD: ovf = __builtin_add_overflow(x, y, &z); break;
    case O_SUB: ovf = __builtin_sub_overflow(x, y, &z); break;
    case O_MUL: ovf = __builtin_mul_overflow(x, y, &z); break;
    case O_POW:
        if (y < 0) {
            *out = v_float(pow((double)x, (double)y));
            return 0;
        }
        z = 1;
        for (int64_t k = 0; k < y && !ovf; k++) {
            ovf = __builtin_mul_overflow(z, x, &z);
            if (z == 0 || z == 1) break;
        }
        if (x == -1) z = (y % 2) ? -1 : 1;
        break;
    default:
        if (y == 0) return fail(r, pos, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) {
            ovf = 1;
            break;
        }
        z = op == O_FDIV ? x / y : x % y;
        if (op == O_FDIV && (x % y != 0) && ((x < 0) != (y < 0))) z--;
        if (op == O_MOD && z != 0 && ((z < 0) != (y < 0))) z += y;
    }
    if (ovf) return fail(r, pos, "integer overflow");
    *out = v_int(z);
    return 0;
}

static int contains(rx *r, int32_t pos, const value *item, const value *seq, int *res) {
    *res = 0;
    switch (seq->k) {
    case V_UNDEF: return 0;
    case V_STR:
        if (item->k != V_STR) return fail(r, pos, "'in <string>' requires string as left operand, not %s", type_name(item));
        if (!item->u.s.n) *res = 1;
        else
            for (size_t i = 0; i + item->u.s.n <= seq->u.s.n && !*res; i++)
                *res = !memcmp(seq->u.s.p + i, item->u.s.p, item->u.s.n);
        return 0;
    case V_LIST:
        for (size_t i = 0; i < seq->u.l->n && !*res; i++) *res = veq(item, &seq->u.l->v[i], 0);
        return 0;
    case V_DICT: *res = dict_get(seq->u.d, item) != NULL; return 0;
    default: return fail(r, pos, "argument of type '%s' is not iterable", type_name(seq));
    }
}

static int compare(rx *r, int32_t pos, int op, const value *a, const value *b, int *res) {
    if (op == O_EQ || op == O_NE) {
        *res = veq(a, b, 0) == (op == O_EQ);
        return 0;
    }
    if (op == O_IN || op == O_NOTIN) {
        if (contains(r, pos, a, b, res)) return -1;
        if (op == O_NOTIN) *res = !*res;
        return 0;
    }
    int c;
    if (vcmp(r, pos, a, b, 0, &c)) return -1;
    *res = op == O_LT ? c < 0 : op == O_LE ? c <= 0 : op == O_GT ? c > 0 : c >= 0;
    return 0;
}

/* the items a for loop (or list()) walks: list items, dict keys, string code points */
static int iterate(rx *r, int32_t pos, const value *v, list **out) {
    list *l;
    switch (v->k) {
    case V_UNDEF: *out = new_list(r, pos, 0); return *out ? 0 : -1;
    case V_LIST: *out = v->u.l; return 0;
    case V_DICT:
        if (v->u.d->ns) break;
        if (!(l = new_list(r, pos, v->u.d->n))) return -1;
        for (size_t i = 0; i < v->u.d->n; i++) l->v[l->n++] = v->u.d->k[i];
        *out = l;
        return 0;
    case V_STR: {
        if (!(l = new_list(r, pos, 0))) return -1;
        uint32_t cp;
        for (size_t i = 0; i < v->u.s.n;) {
            size_t k = u8_dec(v->u.s.p, v->u.s.n, i, &cp);
            if (list_push(r, pos, l, v_str(v->u.s.p + i, k))) return -1;
            i += k;
        }
        *out = l;
        return 0;
    }
    default: break;
    }
    return fail(r, pos, "'%s' object is not iterable", type_name(v));
}

static int eval(rx *r, scope *sc, const node *e, value *out) {
    value a, b, c, d;
    args av;
    switch (e->t) {
    case N_LIT: *out = e->lit; return 0;
    case N_NAME: {
        value *v = scope_find(sc, e->s);
        if (v) {
            *out = *v;
            return 0;
        }
        if ((v = dict_get_s(r->globals, e->s))) {
            *out = *v;
            return 0;
        }
        static const char *const fns[] = {"range", "namespace", "dict", "raise_exception", "strftime_now", NULL};
        for (int i = 0; fns[i]; i++)
            if (str_is(e->s, fns[i])) {
                out->k = V_FUNC;
                out->u.fn = i;
                return 0;
            }
        *out = v_undef(e->s);
        return 0;
    }
    case N_LIST:
    case N_TUPLE: {
        list *l = new_list(r, e->pos, (size_t)e->nk);
        if (!l) return -1;
        l->tuple = e->t == N_TUPLE;
        for (int i = 0; i < e->nk; i++)
            if (eval(r, sc, e->kid[i], &l->v[l->n++])) return -1;
        *out = v_list(l);
        return 0;
    }
    case N_DICT: {
        dict *dd = new_dict(r, e->pos);
        if (!dd) return -1;
        for (int i = 0; i < e->nk; i++)
            if (eval(r, sc, e->kid[i], &a) || eval(r, sc, e->kid2[i], &b) || dict_set(r, e->pos, dd, a, b)) return -1;
        *out = v_dict(dd);
        return 0;
    }
    case N_ATTR:
        if (eval(r, sc, e->a, &a)) return -1;
        return get_attr(r, e->pos, &a, e->s, out);
    case N_ITEM:
        if (eval(r, sc, e->a, &a) || eval(r, sc, e->b, &b)) return -1;
        return get_item(r, e->pos, &a, &b, out);
    case N_SLICE:
        b = c = d = v_none();
        if (eval(r, sc, e->a, &a) || (e->b && eval(r, sc, e->b, &b)) || (e->c && eval(r, sc, e->c, &c)) ||
            (e->d && eval(r, sc, e->d, &d)))
            return -1;
        return do_slice(r, e->pos, &a, &b, &c, &d, out);
    case N_CALL:
        if (eval(r, sc, e->a, &a) || eval_args(r, sc, e, &av)) return -1;
        return call_value(r, e->pos, &a, &av, out);
    case N_FILTER:
        if (e->op < 0) return fail(r, e->pos, "unsupported filter '%.*s'", (int)(e->s.n < 40 ? e->s.n : 40), e->s.p);
        if (eval(r, sc, e->a, &a) || eval_args(r, sc, e, &av)) return -1;
        return apply_filter(r, e->pos, e->op, &a, &av, out);
    case N_TEST: {
        int res;
        if (e->op < 0) return fail(r, e->pos, "unsupported test '%.*s'", (int)(e->s.n < 40 ? e->s.n : 40), e->s.p);
        if (eval(r, sc, e->a, &a) || eval_args(r, sc, e, &av) || apply_test(r, e->pos, e->op, &a, &av, &res))
            return -1;
        *out = v_bool(e->flag ? !res : res);
        return 0;
    }
    case N_NOT:
        if (eval(r, sc, e->a, &a)) return -1;
        *out = v_bool(!truthy(&a));
        return 0;
    case N_NEG:
    case N_POS:
        if (eval(r, sc, e->a, &a)) return -1;
        if (a.k == V_UNDEF) return undefined_error(r, e->pos, &a);
        if (!is_num(&a)) return fail(r, e->pos, "bad operand type for unary %c: '%s'", e->t == N_NEG ? '-' : '+', type_name(&a));
        if (e->t == N_POS) *out = a.k == V_BOOL ? v_int(a.u.b) : a;
        else if (a.k == V_FLOAT) *out = v_float(-a.u.f);
        else if (num_i(&a) == INT64_MIN) return fail(r, e->pos, "integer overflow");
        else *out = v_int(-num_i(&a));
        return 0;
    case N_BIN:
        if (eval(r, sc, e->a, &a) || eval(r, sc, e->b, &b)) return -1;
        return arith(r, e->pos, e->op, &a, &b, out);
    case N_CMP: {
        int res;
        if (eval(r, sc, e->a, &a) || eval(r, sc, e->b, &b) || compare(r, e->pos, e->op, &a, &b, &res)) return -1;
        *out = v_bool(res);
        return 0;
    }
    case N_AND:
    case N_OR:
        if (eval(r, sc, e->a, &a)) return -1;
        if (truthy(&a) == (e->t == N_OR)) {
            *out = a;
            return 0;
        }
        return eval(r, sc, e->b, out);
    case N_COND:
        if (eval(r, sc, e->b, &a)) return -1;
        if (truthy(&a)) return eval(r, sc, e->a, out);
        if (e->c) return eval(r, sc, e->c, out);
        *out = v_undef(NOSTR);
        return 0;
    case N_BODY: {
        value *v = scope_find(sc, (str){"\x01body", 5});
        *out = v ? *v : v_str("", 0);
        return 0;
    }
    default: return fail(r, e->pos, "internal: node %d is not an expression", e->t);
    }
}

/* ---- calls: macros, globals, methods --------------------------------------- */

static int render_to_str(rx *r, scope *sc, const node *body, int32_t pos, value *out) {
    buf *saved = r->out;
    buf b = tmpbuf(r);
    if (b.limit > r->max_output) b.limit = r->max_output;
    r->out = &b;
    int rc = exec_body(r, sc, body);
    r->out = saved;
    if (rc < 0) {
        free(b.p);
        return -1;
    }
    return buf_to_str(r, pos, &b, out);
}

static int call_macro(rx *r, int32_t pos, const macro *m, const args *a, value *out) {
    const node *def = m->def;
    if (r->call_depth >= MAX_CALL_DEPTH) return fail(r, pos, "macros call each other more than %d deep", MAX_CALL_DEPTH);
    if (step(r, pos, 1)) return -1;
    if (n_positional(a) > def->nk)
        return fail(r, pos, "macro '%.*s' takes %d arguments, %d given", (int)def->s.n, def->s.p, def->nk, n_positional(a));
    for (int i = 0; i < a->n; i++) {
        if (!(a->kw && a->kw[i].p)) continue;
        int found = 0;
        for (int k = 0; k < def->nk && !found; k++) found = a->kw[i].n == def->kid[k]->s.n && !memcmp(a->kw[i].p, def->kid[k]->s.p, a->kw[i].n);
        if (!found)
            return fail(r, pos, "macro '%.*s' has no parameter '%.*s'", (int)def->s.n, def->s.p, (int)a->kw[i].n, a->kw[i].p);
    }
    scope *sc = new_scope(r, pos, m->closure);
    if (!sc) return -1;
    for (int k = 0; k < def->nk; k++) {
        value v;
        char name[64];
        str pn = def->kid[k]->s;
        snprintf(name, sizeof name, "%.*s", (int)(pn.n < 63 ? pn.n : 63), pn.p);
        if (!arg(a, k, name, &v)) {
            if (def->kid2[k]) {
                if (eval(r, sc, def->kid2[k], &v)) return -1;
            } else {
                v = v_undef(pn);
            }
        }
        if (scope_set(r, pos, sc, pn, v)) return -1;
    }
    r->call_depth++;
    int rc = render_to_str(r, sc, def->body, pos, out);
    r->call_depth--;
    return rc;
}

static int format_time(rx *r, int32_t pos, str fmt, value *out) {
    time_t t = r->now >= 0 ? (time_t)r->now : time(NULL);
    struct tm tm;
    if (r->now >= 0) gmtime_r(&t, &tm);
    else localtime_r(&t, &tm);
    char f[128], o[256];
    if (fmt.n >= sizeof f) return fail(r, pos, "strftime_now: format too long");
    memcpy(f, fmt.p, fmt.n);
    f[fmt.n] = 0;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
    size_t n = strftime(o, sizeof o, f, &tm); /* the template's own format, as Python's strftime takes it */
#pragma GCC diagnostic pop
    char *p = ralloc(r, pos, n + 1);
    if (!p) return -1;
    memcpy(p, o, n + 1);
    *out = v_str(p, n);
    return 0;
}

static int call_global(rx *r, int32_t pos, int fn, const args *a, value *out) {
    value x, y, z;
    switch (fn) {
    case 0: { /* range */
        int np = n_positional(a);
        int64_t lo = 0, hi, st = 1;
        if (np < 1 || np > 3) return fail(r, pos, "range expects 1 to 3 arguments");
        for (int i = 0; i < np; i++) {
            arg(a, i, NULL, &x);
            if (x.k != V_INT && x.k != V_BOOL) return fail(r, pos, "range arguments must be integers");
        }
        arg(a, 0, NULL, &x);
        if (np == 1) hi = num_i(&x);
        else {
            lo = num_i(&x);
            arg(a, 1, NULL, &y);
            hi = num_i(&y);
        }
        if (np == 3) {
            arg(a, 2, NULL, &z);
            st = num_i(&z);
            if (!st) return fail(r, pos, "range step must not be zero");
        }
        /* counted in unsigned arithmetic: hi - lo may exceed INT64_MAX */
        uint64_t span = st > 0 ? (hi > lo ? (uint64_t)hi - (uint64_t)lo : 0) : (lo > hi ? (uint64_t)lo - (uint64_t)hi : 0);
        uint64_t ust = st > 0 ? (uint64_t)st : (uint64_t)0 - (uint64_t)st;
        uint64_t cnt = span / ust + (span % ust != 0);
        if (cnt > (uint64_t)r->max_steps || step(r, pos, (int64_t)cnt)) return r->failed ? -1 : step(r, pos, r->max_steps + 1);
        list *l = new_list(r, pos, (size_t)cnt);
        if (!l) return -1;
        for (uint64_t i = 0; i < cnt; i++) l->v[l->n++] = v_int((int64_t)((uint64_t)lo + i * (uint64_t)st));
        *out = v_list(l);
        return 0;
    }
    case 1:   /* namespace */
    case 2: { /* dict */
        dict *d = new_dict(r, pos);
        if (!d) return -1;
        d->ns = fn == 1;
        for (int i = 0; i < a->n; i++) {
            if (a->kw && a->kw[i].p) {
                if (dict_set(r, pos, d, v_str(a->kw[i].p, a->kw[i].n), a->v[i])) return -1;
            } else if (a->v[i].k == V_DICT) {
                for (size_t k = 0; k < a->v[i].u.d->n; k++)
                    if (dict_set(r, pos, d, a->v[i].u.d->k[k], a->v[i].u.d->v[k])) return -1;
            } else {
                return fail(r, pos, "%s() takes keyword arguments or a mapping", fn == 1 ? "namespace" : "dict");
            }
        }
        *out = v_dict(d);
        return 0;
    }
    case 3: /* raise_exception */
        if (!arg(a, 0, NULL, &x) || to_str(r, pos, &x, &y)) y = v_str("", 0);
        fail(r, pos, "the template raised an error: %.*s", (int)(y.u.s.n < 300 ? y.u.s.n : 300), y.u.s.p);
        r->code = CAS_ERR_INVALID;
        return -1;
    default: /* strftime_now */
        if (!arg(a, 0, "format", &x) || x.k != V_STR) return fail(r, pos, "strftime_now expects a format string");
        return format_time(r, pos, x.u.s, out);
    }
}

/* ---- string helpers for methods and filters ------------------------------- */

/* is code point c in the set of chars (NULL: Python whitespace)? */
static int in_chars(uint32_t c, const str *chars) {
    if (!chars) return py_space(c);
    uint32_t x;
    for (size_t i = 0; i < chars->n;) {
        i += u8_dec(chars->p, chars->n, i, &x);
        if (x == c) return 1;
    }
    return 0;
}

static str strip(str s, const str *chars, int left, int right) {
    size_t a = 0, b = s.n;
    uint32_t c;
    while (left && a < b) {
        size_t l = u8_dec(s.p, b, a, &c);
        if (!in_chars(c, chars)) break;
        a += l;
    }
    while (right && b > a) {
        size_t l = u8_back(s.p, a, b);
        u8_dec(s.p, b, b - l, &c);
        if (!in_chars(c, chars)) break;
        b -= l;
    }
    str o = {s.p + a, b - a};
    return o;
}

/* Simple case mapping of one code point: ASCII, Latin-1, Latin Extended-A,
 * Greek and Cyrillic (the alphabets whose letters have one-to-one simple
 * mappings); other code points map to themselves. */
static uint32_t cp_upper(uint32_t c) {
    if (c >= 'a' && c <= 'z') return c - 32;
    if (c < 0x80) return c;
    if ((c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 32;
    if (c == 0xFF) return 0x178;
    if (c == 0xB5) return 0x39C;
    if (c >= 0x100 && c <= 0x137 && (c & 1)) return c - 1;
    if (c >= 0x139 && c <= 0x148 && !(c & 1)) return c - 1;
    if (c >= 0x14A && c <= 0x177 && (c & 1)) return c - 1;
    if ((c == 0x17A || c == 0x17C || c == 0x17E)) return c - 1;
    if (c == 0x17F) return 'S';
    if (c >= 0x3B1 && c <= 0x3C9 && c != 0x3C2) return c - 32;
    if (c == 0x3C2) return 0x3A3;
    if (c >= 0x3AC && c <= 0x3AF) return c == 0x3AC ? 0x386 : c - 37;
    if (c >= 0x430 && c <= 0x44F) return c - 32;
    if (c >= 0x450 && c <= 0x45F) return c - 80;
    return c;
}

static uint32_t cp_lower(uint32_t c) {
    if (c >= 'A' && c <= 'Z') return c + 32;
    if (c < 0x80) return c;
    if ((c >= 0xC0 && c <= 0xDE && c != 0xD7)) return c + 32;
    if (c == 0x178) return 0xFF;
    if (c >= 0x100 && c <= 0x137 && !(c & 1)) return c + 1;
    if (c >= 0x139 && c <= 0x148 && (c & 1)) return c + 1;
    if (c >= 0x14A && c <= 0x177 && !(c & 1)) return c + 1;
    if ((c == 0x179 || c == 0x17B || c == 0x17D)) return c + 1;
    if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 32;
    if (c == 0x386) return 0x3AC;
    if (c >= 0x388 && c <= 0x38A) return c + 37;
    if (c >= 0x410 && c <= 0x42F) return c + 32;
    if (c >= 0x400 && c <= 0x40F) return c + 80;
    return c;
}

static int cp_cased(uint32_t c) { return cp_upper(c) != c || cp_lower(c) != c || c == 0xDF; }

/* mode 0 lower, 1 upper, 2 str.title() (a cased letter after an uncased
 * character starts a word), 3 capitalize, 4 the title filter (words start
 * after whitespace or one of -({[<). ß upper-cases to SS as in Python. */
static int case_map(rx *r, int32_t pos, str s, int mode, value *out) {
    buf b = tmpbuf(r);
    uint32_t prev = 0;
    for (size_t i = 0; i < s.n;) {
        uint32_t c;
        size_t l = u8_dec(s.p, s.n, i, &c);
        int want_up = mode == 1 || (mode == 2 && !cp_cased(prev)) || (mode == 3 && i == 0) ||
                      (mode == 4 && (i == 0 || py_space(prev) || (prev < 0x80 && prev && strchr("-({[<", (int)prev))));
        uint32_t m = want_up ? cp_upper(c) : cp_lower(c);
        char enc[4];
        if (l == 1 && c >= 0x80) b_put(&b, s.p + i, 1); /* a malformed byte stays */
        else if (want_up && c == 0xDF) b_str(&b, "SS");
        else b_put(&b, enc, u8_enc(m, enc));
        prev = c;
        i += l;
    }
    return buf_to_str(r, pos, &b, out);
}

static const char *memfind(const char *h, size_t hn, const char *n, size_t nn) {
    if (!nn) return h;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == n[0] && !memcmp(h + i, n, nn)) return h + i;
    return NULL;
}

static int str_replace(rx *r, int32_t pos, str s, str old, str nw, int64_t count, value *out) {
    buf b = tmpbuf(r);
    int64_t done = 0;
    if (!old.n) {
        size_t i = 0;
        uint32_t cp;
        for (;;) {
            if (count < 0 || done < count) b_put(&b, nw.p, nw.n), done++;
            if (i >= s.n) break;
            size_t l = u8_dec(s.p, s.n, i, &cp);
            b_put(&b, s.p + i, l);
            i += l;
        }
    } else {
        size_t i = 0;
        while (i < s.n) {
            const char *f = (count < 0 || done < count) ? memfind(s.p + i, s.n - i, old.p, old.n) : NULL;
            if (!f) {
                b_put(&b, s.p + i, s.n - i);
                break;
            }
            b_put(&b, s.p + i, (size_t)(f - (s.p + i)));
            b_put(&b, nw.p, nw.n);
            i = (size_t)(f - s.p) + old.n;
            done++;
        }
    }
    return buf_to_str(r, pos, &b, out);
}

/* str.split / str.rsplit (sep NULL: runs of whitespace) */
static int str_split(rx *r, int32_t pos, str s, const str *sep, int64_t maxsplit, int from_right, value *out) {
    list *l = new_list(r, pos, 0);
    if (!l) return -1;
    if (sep && !sep->n) return fail(r, pos, "empty separator");
    if (!from_right) {
        size_t i = 0;
        int64_t splits = 0;
        if (!sep) {
            uint32_t c;
            for (;;) {
                while (i < s.n) {
                    size_t k = u8_dec(s.p, s.n, i, &c);
                    if (!py_space(c)) break;
                    i += k;
                }
                if (i >= s.n) break;
                if (maxsplit >= 0 && splits >= maxsplit) { /* the rest as it is, trailing space included */
                    if (list_push(r, pos, l, v_str(s.p + i, s.n - i))) return -1;
                    break;
                }
                size_t st = i;
                while (i < s.n) {
                    size_t k = u8_dec(s.p, s.n, i, &c);
                    if (py_space(c)) break;
                    i += k;
                }
                if (list_push(r, pos, l, v_str(s.p + st, i - st))) return -1;
                splits++;
            }
        } else {
            for (;;) {
                const char *f = (maxsplit < 0 || splits < maxsplit) ? memfind(s.p + i, s.n - i, sep->p, sep->n) : NULL;
                if (!f) {
                    if (list_push(r, pos, l, v_str(s.p + i, s.n - i))) return -1;
                    break;
                }
                if (list_push(r, pos, l, v_str(s.p + i, (size_t)(f - (s.p + i))))) return -1;
                i = (size_t)(f - s.p) + sep->n;
                splits++;
            }
        }
        *out = v_list(l);
        return 0;
    }
    /* rsplit: split from the right, then reverse */
    if (!sep) {
        value tmp;
        if (str_split(r, pos, s, NULL, -1, 0, &tmp)) return -1;
        list *all = tmp.u.l;
        if (maxsplit < 0 || (size_t)maxsplit >= all->n) {
            *out = tmp;
            return 0;
        }
        size_t keep = (size_t)maxsplit; /* last `keep` words separate, the rest joined as in the source */
        size_t first_sep = all->n - keep;
        const char *end = all->v[first_sep - 1].u.s.p + all->v[first_sep - 1].u.s.n;
        if (list_push(r, pos, l, v_str(s.p, (size_t)(end - s.p)))) return -1; /* leading space included */
        for (size_t i = first_sep; i < all->n; i++)
            if (list_push(r, pos, l, all->v[i])) return -1;
        *out = v_list(l);
        return 0;
    }
    size_t e = s.n;
    int64_t splits = 0;
    list *rev = new_list(r, pos, 0);
    if (!rev) return -1;
    for (;;) {
        const char *f = NULL;
        if (maxsplit < 0 || splits < maxsplit)
            for (size_t i = e >= sep->n ? e - sep->n + 1 : 0; i-- > 0;)
                if (!memcmp(s.p + i, sep->p, sep->n)) {
                    f = s.p + i;
                    break;
                }
        if (!f) {
            if (list_push(r, pos, rev, v_str(s.p, e))) return -1;
            break;
        }
        size_t fi = (size_t)(f - s.p);
        if (list_push(r, pos, rev, v_str(f + sep->n, e - fi - sep->n))) return -1;
        e = fi;
        splits++;
    }
    for (size_t i = rev->n; i-- > 0;)
        if (list_push(r, pos, l, rev->v[i])) return -1;
    *out = v_list(l);
    return 0;
}

/* str.format with {} {0} {name} fields and {{ }} escapes, no format specs */
static int str_format(rx *r, int32_t pos, str f, const args *a, value *out) {
    buf b = tmpbuf(r);
    int auto_i = 0;
    for (size_t i = 0; i < f.n; i++) {
        char c = f.p[i];
        if ((c == '{' || c == '}') && i + 1 < f.n && f.p[i + 1] == c) {
            b_ch(&b, c);
            i++;
            continue;
        }
        if (c == '}') {
            free(b.p);
            return fail(r, pos, "str.format: single '}'");
        }
        if (c != '{') {
            b_ch(&b, c);
            continue;
        }
        size_t e = i + 1;
        while (e < f.n && f.p[e] != '}') e++;
        if (e >= f.n) {
            free(b.p);
            return fail(r, pos, "str.format: '{' without '}'");
        }
        str field = {f.p + i + 1, e - i - 1};
        value v;
        int found;
        if (!field.n) found = arg(a, auto_i++, NULL, &v);
        else if (is_digit(field.p[0])) {
            int k = 0;
            for (size_t q = 0; q < field.n; q++) {
                if (!is_digit(field.p[q]) || k > 1000) {
                    free(b.p);
                    return fail(r, pos, "str.format: field '%.*s' is not supported", (int)field.n, field.p);
                }
                k = k * 10 + (field.p[q] - '0');
            }
            found = arg(a, k, NULL, &v);
        } else {
            char nm[64];
            if (field.n >= sizeof nm || memchr(field.p, ':', field.n) || memchr(field.p, '!', field.n) ||
                memchr(field.p, '.', field.n) || memchr(field.p, '[', field.n)) {
                free(b.p);
                return fail(r, pos, "str.format: field '%.*s' is not supported", (int)(field.n < 40 ? field.n : 40), field.p);
            }
            memcpy(nm, field.p, field.n);
            nm[field.n] = 0;
            found = arg(a, -1, nm, &v);
        }
        if (!found) {
            free(b.p);
            return fail(r, pos, "str.format: no argument for '{%.*s}'", (int)(field.n < 40 ? field.n : 40), field.p);
        }
        if (to_text(r, pos, &b, &v, 0, 0)) {
            free(b.p);
            return -1;
        }
        i = e;
    }
    return buf_to_str(r, pos, &b, out);
}

static int join_values(rx *r, int32_t pos, const list *l, str sep, const str *attr, value *out);

static int call_method(rx *r, int32_t pos, const method *m, const args *a, value *out) {
    const value *self = &m->self;
    str name = m->name;
    value x, y, z;
    if (self->k == V_LOOP) { /* loop.cycle(a, b, ...) */
        int np = n_positional(a);
        if (!np) return fail(r, pos, "loop.cycle needs at least one argument");
        arg(a, (int)(self->u.lp->i % (size_t)np), NULL, out);
        return 0;
    }
    if (self->k == V_DICT) {
        const dict *d = self->u.d;
        if (str_is(name, "get")) {
            if (!arg(a, 0, NULL, &x)) return fail(r, pos, "dict.get needs a key");
            value *v = dict_get(d, &x);
            if (v) *out = *v;
            else if (!arg(a, 1, NULL, out)) *out = v_none();
            return 0;
        }
        if (str_is(name, "items") || str_is(name, "keys") || str_is(name, "values")) {
            list *l = new_list(r, pos, d->n);
            if (!l) return -1;
            l->iter = str_is(name, "items") ? IT_ITEMS : str_is(name, "keys") ? IT_KEYS : IT_VALUES;
            for (size_t i = 0; i < d->n; i++) {
                if (str_is(name, "items")) {
                    list *t = new_list(r, pos, 2);
                    if (!t) return -1;
                    t->tuple = 1;
                    t->v[0] = d->k[i];
                    t->v[1] = d->v[i];
                    t->n = 2;
                    l->v[l->n++] = v_list(t);
                } else {
                    l->v[l->n++] = str_is(name, "keys") ? d->k[i] : d->v[i];
                }
            }
            *out = v_list(l);
            return 0;
        }
        if (str_is(name, "copy")) {
            dict *c = new_dict(r, pos);
            if (!c) return -1;
            for (size_t i = 0; i < d->n; i++)
                if (dict_set(r, pos, c, d->k[i], d->v[i])) return -1;
            *out = v_dict(c);
            return 0;
        }
        return fail(r, pos, "dict.%.*s would modify a value, which templates may not do", (int)name.n, name.p);
    }
    if (self->k == V_LIST) {
        if (str_is(name, "index") || str_is(name, "count")) {
            if (!arg(a, 0, NULL, &x)) return fail(r, pos, "list.%.*s needs an argument", (int)name.n, name.p);
            int64_t cnt = 0;
            for (size_t i = 0; i < self->u.l->n; i++)
                if (veq(&self->u.l->v[i], &x, 0)) {
                    if (str_is(name, "index")) {
                        *out = v_int((int64_t)i);
                        return 0;
                    }
                    cnt++;
                }
            if (str_is(name, "index")) return fail(r, pos, "list.index: value is not in the list");
            *out = v_int(cnt);
            return 0;
        }
        if (str_is(name, "copy")) {
            list *c = new_list(r, pos, self->u.l->n);
            if (!c) return -1;
            for (size_t i = 0; i < self->u.l->n; i++) c->v[c->n++] = self->u.l->v[i];
            *out = v_list(c);
            return 0;
        }
        return fail(r, pos, "list.%.*s would modify a value, which templates may not do", (int)name.n, name.p);
    }
    /* string methods */
    str s = self->u.s;
    if (str_is(name, "startswith") || str_is(name, "endswith")) {
        if (!arg(a, 0, NULL, &x)) return fail(r, pos, "str.%.*s needs an argument", (int)name.n, name.p);
        int ends = name.p[0] == 'e', res = 0;
        const value *cands = &x;
        size_t nc = 1;
        if (x.k == V_LIST) cands = x.u.l->v, nc = x.u.l->n;
        for (size_t i = 0; i < nc && !res; i++) {
            if (cands[i].k != V_STR) return fail(r, pos, "str.%.*s expects strings", (int)name.n, name.p);
            str p = cands[i].u.s;
            res = p.n <= s.n && !memcmp(ends ? s.p + s.n - p.n : s.p, p.p, p.n);
        }
        *out = v_bool(res);
        return 0;
    }
    if (str_is(name, "strip") || str_is(name, "lstrip") || str_is(name, "rstrip")) {
        int have = arg(a, 0, "chars", &x) && x.k != V_NONE;
        if (have && x.k != V_STR) return fail(r, pos, "str.%.*s expects a string", (int)name.n, name.p);
        str o = strip(s, have ? &x.u.s : NULL, name.p[0] != 'r', name.p[0] != 'l');
        *out = v_str(o.p, o.n);
        return 0;
    }
    if (str_is(name, "split") || str_is(name, "rsplit")) {
        int have = arg(a, 0, "sep", &x) && x.k != V_NONE;
        if (have && x.k != V_STR) return fail(r, pos, "str.split expects a string separator");
        int64_t maxsplit = -1;
        if (arg(a, 1, "maxsplit", &y)) maxsplit = num_i(&y);
        return str_split(r, pos, s, have ? &x.u.s : NULL, maxsplit, name.p[0] == 'r', out);
    }
    if (str_is(name, "upper")) return case_map(r, pos, s, 1, out);
    if (str_is(name, "lower")) return case_map(r, pos, s, 0, out);
    if (str_is(name, "title")) return case_map(r, pos, s, 2, out);
    if (str_is(name, "capitalize")) return case_map(r, pos, s, 3, out);
    if (str_is(name, "replace")) {
        if (!arg(a, 0, NULL, &x) || !arg(a, 1, NULL, &y) || x.k != V_STR || y.k != V_STR)
            return fail(r, pos, "str.replace expects two strings");
        int64_t count = arg(a, 2, "count", &z) ? num_i(&z) : -1;
        return str_replace(r, pos, s, x.u.s, y.u.s, count, out);
    }
    if (str_is(name, "join")) {
        list *l;
        if (!arg(a, 0, NULL, &x) || iterate(r, pos, &x, &l)) return r->failed ? -1 : fail(r, pos, "str.join needs an iterable");
        for (size_t i = 0; i < l->n; i++)
            if (l->v[i].k != V_STR) return fail(r, pos, "str.join: item %zu is %s, not str", i, type_name(&l->v[i]));
        return join_values(r, pos, l, s, NULL, out);
    }
    if (str_is(name, "find") || str_is(name, "count")) {
        if (!arg(a, 0, NULL, &x) || x.k != V_STR) return fail(r, pos, "str.%.*s expects a string", (int)name.n, name.p);
        if (name.p[0] == 'f') {
            const char *f = memfind(s.p, s.n, x.u.s.p, x.u.s.n);
            *out = v_int(f ? (int64_t)u8_len((str){s.p, (size_t)(f - s.p)}) : -1);
            return 0;
        }
        int64_t cnt = 0;
        if (!x.u.s.n) cnt = (int64_t)u8_len(s) + 1;
        else
            for (const char *f = s.p; (f = memfind(f, s.n - (size_t)(f - s.p), x.u.s.p, x.u.s.n)); f += x.u.s.n) cnt++;
        *out = v_int(cnt);
        return 0;
    }
    if (str_is(name, "format")) return str_format(r, pos, s, a, out);
    if (str_is(name, "splitlines")) {
        list *l = new_list(r, pos, 0);
        if (!l) return -1;
        size_t st = 0;
        for (size_t i = 0; i < s.n; i++) {
            char c = s.p[i];
            if (c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1e)) {
                if (list_push(r, pos, l, v_str(s.p + st, i - st))) return -1;
                if (c == '\r' && i + 1 < s.n && s.p[i + 1] == '\n') i++;
                st = i + 1;
            }
        }
        if (st < s.n && list_push(r, pos, l, v_str(s.p + st, s.n - st))) return -1;
        *out = v_list(l);
        return 0;
    }
    /* is* predicates, ASCII */
    int res = s.n > 0, cased = 0;
    for (size_t i = 0; i < s.n; i++) {
        unsigned char c = (unsigned char)s.p[i];
        int dg = c >= '0' && c <= '9', lo = c >= 'a' && c <= 'z', up = c >= 'A' && c <= 'Z';
        cased |= lo || up;
        if (str_is(name, "isdigit")) res &= dg;
        else if (str_is(name, "isalpha")) res &= lo || up;
        else if (str_is(name, "isalnum")) res &= lo || up || dg;
        else if (str_is(name, "isspace")) res &= ascii_ws((char)c) || (c >= 0x1c && c <= 0x1f);
        else if (str_is(name, "islower")) res &= !up;
        else if (str_is(name, "isupper")) res &= !lo;
    }
    if (str_is(name, "islower") || str_is(name, "isupper")) res = res && cased;
    *out = v_bool(res);
    return 0;
}

static int call_value(rx *r, int32_t pos, const value *f, const args *a, value *out) {
    switch (f->k) {
    case V_MACRO: return call_macro(r, pos, f->u.m, a, out);
    case V_FUNC: return call_global(r, pos, f->u.fn, a, out);
    case V_METHOD: return call_method(r, pos, f->u.mt, a, out);
    case V_UNDEF: return undefined_error(r, pos, f);
    default: return fail(r, pos, "'%s' object is not callable", type_name(f));
    }
}

/* ---- filters ---------------------------------------------------------------- */

/* item.a.b.0 as jinja2's attribute getters walk it: each part an item, then an attribute */
static int get_path(rx *r, int32_t pos, const value *item, str path, value *out) {
    *out = *item;
    size_t i = 0;
    while (i <= path.n) {
        size_t e = i;
        while (e < path.n && path.p[e] != '.') e++;
        str part = {path.p + i, e - i};
        value key = v_str(part.p, part.n), cur = *out;
        int digits = part.n > 0 && part.n < 19;
        for (size_t k = 0; k < part.n && digits; k++) digits = is_digit(part.p[k]);
        if (digits) key = v_int(strtoll(part.p, NULL, 10));
        if (get_item(r, pos, &cur, &key, out)) return -1;
        i = e + 1;
    }
    return 0;
}

static int join_values(rx *r, int32_t pos, const list *l, str sep, const str *attr, value *out) {
    buf b = tmpbuf(r);
    for (size_t i = 0; i < l->n; i++) {
        value v = l->v[i];
        if (attr && get_path(r, pos, &l->v[i], *attr, &v)) {
            free(b.p);
            return -1;
        }
        if (i) b_put(&b, sep.p, sep.n);
        if (to_text(r, pos, &b, &v, 0, 0)) {
            free(b.p);
            return -1;
        }
    }
    return buf_to_str(r, pos, &b, out);
}

static int str_arg(rx *r, int32_t pos, const args *a, int idx, const char *name, str dflt, str *out) {
    value v, s;
    if (!arg(a, idx, name, &v)) {
        *out = dflt;
        return 0;
    }
    if (to_str(r, pos, &v, &s)) return -1;
    *out = s.u.s;
    return 0;
}

static int bool_arg(const args *a, int idx, const char *name, int dflt) {
    value v;
    return arg(a, idx, name, &v) ? truthy(&v) : dflt;
}

/* int() of Python on a string: optional sign, digits with single underscores, spaces around */
static int parse_int(str s, int64_t *out) {
    s = strip(s, NULL, 1, 1);
    size_t i = 0;
    int neg = 0;
    if (i < s.n && (s.p[i] == '+' || s.p[i] == '-')) neg = s.p[i++] == '-';
    if (i >= s.n) return 0;
    int64_t v = 0;
    int prev_digit = 0;
    for (; i < s.n; i++) {
        if (s.p[i] == '_' && prev_digit && i + 1 < s.n && is_digit(s.p[i + 1])) {
            prev_digit = 0;
            continue;
        }
        if (!is_digit(s.p[i])) return 0;
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, s.p[i] - '0', &v)) return 0;
        prev_digit = 1;
    }
    *out = neg ? -v : v;
    return 1;
}

static int parse_float(str s, double *out) {
    s = strip(s, NULL, 1, 1);
    char tmp[64];
    if (!s.n || s.n >= sizeof tmp) return 0;
    memcpy(tmp, s.p, s.n);
    tmp[s.n] = 0;
    for (size_t i = 0; i < s.n; i++)
        if (tmp[i] == 'x' || tmp[i] == 'X' || tmp[i] == 'p' || tmp[i] == 'P') return 0; /* no hex floats */
    char *end;
    *out = strtod(tmp, &end);
    return *end == 0;
}

static int filter_select(rx *r, int32_t pos, int fid, const value *in, const args *a, value *out) {
    int byattr = fid == F_SELECTATTR || fid == F_REJECTATTR, want = fid == F_SELECT || fid == F_SELECTATTR;
    list *l, *o;
    if (!(o = new_list(r, pos, 0))) return -1;
    o->iter = IT_GEN;
    *out = v_list(o);
    if (!truthy(in)) return 0; /* as jinja2: nothing selected from a false value, None included */
    if (iterate(r, pos, in, &l)) return -1;
    value attr, tname;
    int first = 0;
    if (byattr) {
        if (!arg(a, 0, NULL, &attr) || attr.k != V_STR) return fail(r, pos, "selectattr/rejectattr need an attribute name");
        first = 1;
    }
    int tid = -1;
    if (arg(a, first, NULL, &tname)) {
        if (tname.k != V_STR || (tid = find_test(tname.u.s)) < 0)
            return fail(r, pos, "no test named '%.*s'", tname.k == V_STR ? (int)tname.u.s.n : 1,
                        tname.k == V_STR ? tname.u.s.p : "?");
    }
    /* the test's own arguments follow its name */
    args ta = {0, NULL, NULL};
    int skip = first + (tid >= 0), seen = 0;
    if (a->n > skip) {
        ta.v = ralloc(r, pos, sizeof(value) * (size_t)a->n);
        str *kw = ralloc(r, pos, sizeof(str) * (size_t)a->n);
        if (!ta.v || !kw) return -1;
        for (int i = 0; i < a->n; i++) {
            int positional = !(a->kw && a->kw[i].p);
            if (positional && seen++ < skip) continue;
            ta.v[ta.n] = a->v[i];
            kw[ta.n] = positional ? (str){NULL, 0} : a->kw[i];
            ta.n++;
        }
        ta.kw = kw;
    }
    for (size_t i = 0; i < l->n; i++) {
        value v = l->v[i];
        if (byattr && get_path(r, pos, &l->v[i], attr.u.s, &v)) return -1;
        int res;
        if (tid >= 0) {
            if (apply_test(r, pos, tid, &v, &ta, &res)) return -1;
        } else {
            res = truthy(&v);
        }
        if (res == want && list_push(r, pos, o, l->v[i])) return -1;
    }
    *out = v_list(o);
    return 0;
}

static int apply_filter(rx *r, int32_t pos, int fid, const value *in, const args *a, value *out) {
    value x, y;
    list *l, *o;
    str s;
    switch (fid) {
    case F_SAFE:
        if (to_str(r, pos, in, out)) return -1;
        out->markup = 1;
        return 0;
    case F_STRING: return to_str(r, pos, in, out);
    case F_TRIM: {
        if (to_str(r, pos, in, &x)) return -1;
        int have = arg(a, 0, "chars", &y) && y.k != V_NONE;
        if (have && to_str(r, pos, &y, &y)) return -1;
        s = strip(x.u.s, have ? &y.u.s : NULL, 1, 1);
        *out = v_str(s.p, s.n);
        out->markup = x.markup;
        return 0;
    }
    case F_UPPER:
    case F_LOWER:
    case F_TITLE:
    case F_CAPITALIZE:
        if (to_str(r, pos, in, &x)) return -1;
        return case_map(r, pos, x.u.s, fid == F_UPPER ? 1 : fid == F_LOWER ? 0 : fid == F_TITLE ? 4 : 3, out);
    case F_LENGTH:
        switch (in->k) {
        case V_UNDEF: *out = v_int(0); return 0;
        case V_STR: *out = v_int((int64_t)u8_len(in->u.s)); return 0;
        case V_LIST:
            if (in->u.l->iter == IT_GEN) return fail(r, pos, "object of type 'generator' has no len()");
            *out = v_int((int64_t)in->u.l->n);
            return 0;
        case V_DICT:
            if (!in->u.d->ns) {
                *out = v_int((int64_t)in->u.d->n);
                return 0;
            }
            /* fall through */
        default: return fail(r, pos, "object of type '%s' has no len()", type_name(in));
        }
    case F_DEFAULT:
        if (!arg(a, 0, "default_value", &x)) x = v_str("", 0);
        *out = in->k == V_UNDEF || (bool_arg(a, 1, "boolean", 0) && !truthy(in)) ? x : *in;
        return 0;
    case F_FIRST:
    case F_LAST:
        if (iterate(r, pos, in, &l)) return -1;
        if (fid == F_LAST && l->iter == IT_GEN) return fail(r, pos, "last: a generator cannot be reversed");
        *out = l->n ? l->v[fid == F_FIRST ? 0 : l->n - 1] : v_undef(NOSTR);
        return 0;
    case F_LIST:
        if (iterate(r, pos, in, &l) || !(o = new_list(r, pos, l->n))) return -1;
        for (size_t i = 0; i < l->n; i++) o->v[o->n++] = l->v[i];
        *out = v_list(o);
        return 0;
    case F_ITEMS:
        if (in->k == V_UNDEF) {
            if (!(o = new_list(r, pos, 0))) return -1;
            o->iter = IT_GEN;
            *out = v_list(o);
            return 0;
        }
        if (in->k != V_DICT || in->u.d->ns) return fail(r, pos, "the items filter needs a mapping, not %s", type_name(in));
        {
            method m = {*in, {"items", 5}};
            args none = {0, NULL, NULL};
            if (call_method(r, pos, &m, &none, out)) return -1;
            out->u.l->iter = IT_GEN;
            return 0;
        }
    case F_JOIN: {
        str sep, attr;
        int by = arg(a, 1, "attribute", &y) && y.k == V_STR;
        if (by) attr = y.u.s;
        if (str_arg(r, pos, a, 0, "d", (str){"", 0}, &sep) || iterate(r, pos, in, &l)) return -1;
        return join_values(r, pos, l, sep, by ? &attr : NULL, out);
    }
    case F_REPLACE: {
        str old, nw;
        if (to_str(r, pos, in, &x)) return -1;
        if (!arg(a, 0, "old", &y) || str_arg(r, pos, a, 0, "old", NOSTR, &old) || str_arg(r, pos, a, 1, "new", NOSTR, &nw))
            return r->failed ? -1 : fail(r, pos, "replace needs two arguments");
        int64_t count = arg(a, 2, "count", &y) && y.k != V_NONE ? num_i(&y) : -1;
        return str_replace(r, pos, x.u.s, old, nw, count, out);
    }
    case F_REVERSE:
        if (in->k == V_STR) {
            size_t n = in->u.s.n;
            char *p = ralloc(r, pos, n + 1);
            if (!p) return -1;
            uint32_t cp;
            for (size_t i = 0; i < n;) {
                size_t k = u8_dec(in->u.s.p, n, i, &cp);
                memcpy(p + n - i - k, in->u.s.p + i, k);
                i += k;
            }
            p[n] = 0;
            *out = v_str(p, n);
            return 0;
        }
        if (iterate(r, pos, in, &l) || !(o = new_list(r, pos, l->n))) return -1;
        for (size_t i = l->n; i-- > 0;) o->v[o->n++] = l->v[i];
        /* reversed() of a sequence is an iterator; of a generator, a list */
        o->iter = in->k == V_STR || l->iter == IT_GEN ? IT_LIST : IT_GEN;
        *out = v_list(o);
        return 0;
    case F_TOJSON: {
        json_style js = {-1, {", ", 2}, {": ", 2}, 0, 0};
        js.ascii = bool_arg(a, 0, "ensure_ascii", 0);
        if (arg(a, 1, "indent", &x) && x.k != V_NONE) {
            if (x.k != V_INT || x.u.i < 0 || x.u.i > 64) return fail(r, pos, "tojson: indent must be an integer 0..64");
            js.indent = (int)x.u.i;
            js.item_sep.n = 1;
        }
        if (arg(a, 2, "separators", &x) && x.k != V_NONE) {
            if (x.k != V_LIST || x.u.l->n != 2 || x.u.l->v[0].k != V_STR || x.u.l->v[1].k != V_STR)
                return fail(r, pos, "tojson: separators must be two strings");
            js.item_sep = x.u.l->v[0].u.s;
            js.key_sep = x.u.l->v[1].u.s;
        }
        js.sort_keys = bool_arg(a, 3, "sort_keys", 0);
        buf b = tmpbuf(r);
        if (to_json(r, pos, &b, in, &js, 0)) {
            free(b.p);
            return -1;
        }
        return buf_to_str(r, pos, &b, out);
    }
    case F_INDENT: {
        str ind;
        char sp[65];
        if (arg(a, 0, "width", &x) && x.k == V_STR) {
            ind = x.u.s;
        } else {
            int64_t w = arg(a, 0, "width", &x) ? num_i(&x) : 4;
            if (w < 0) w = 0;
            if (w > 64) return fail(r, pos, "indent: width above 64");
            memset(sp, ' ', (size_t)w);
            ind.p = sp;
            ind.n = (size_t)w;
        }
        int first = bool_arg(a, 1, "first", 0), blank = bool_arg(a, 2, "blank", 0);
        if (to_str(r, pos, in, &x) || str_concat(r, pos, x.u.s, (str){"\n", 1}, &x)) return -1;
        method m = {x, {"splitlines", 10}};
        args none = {0, NULL, NULL};
        if (call_method(r, pos, &m, &none, &y)) return -1;
        l = y.u.l;
        buf b = tmpbuf(r);
        if (first) b_put(&b, ind.p, ind.n);
        for (size_t i = 0; i < l->n; i++) {
            str line = l->v[i].u.s;
            if (i) {
                b_ch(&b, '\n');
                if (blank || line.n) b_put(&b, ind.p, ind.n);
            }
            b_put(&b, line.p, line.n);
        }
        return buf_to_str(r, pos, &b, out);
    }
    case F_INT: {
        int64_t iv;
        double fv;
        if (!arg(a, 0, "default", out)) *out = v_int(0);
        if (in->k == V_INT || in->k == V_BOOL) *out = v_int(num_i(in));
        else if (in->k == V_FLOAT && isfinite(in->u.f) && fabs(in->u.f) < 9.2e18) *out = v_int((int64_t)in->u.f);
        else if (in->k == V_STR && parse_int(in->u.s, &iv)) *out = v_int(iv);
        else if (in->k == V_STR && parse_float(in->u.s, &fv) && isfinite(fv) && fabs(fv) < 9.2e18) *out = v_int((int64_t)fv);
        return 0;
    }
    case F_FLOAT: {
        double fv;
        if (!arg(a, 0, "default", out)) *out = v_float(0.0);
        if (is_num(in)) *out = v_float(num_f(in));
        else if (in->k == V_STR && parse_float(in->u.s, &fv)) *out = v_float(fv);
        return 0;
    }
    case F_ABS:
        if (!is_num(in)) return fail(r, pos, "bad operand type for abs(): '%s'", type_name(in));
        if (in->k == V_FLOAT) *out = v_float(fabs(in->u.f));
        else if (num_i(in) == INT64_MIN) return fail(r, pos, "integer overflow");
        else *out = v_int(num_i(in) < 0 ? -num_i(in) : num_i(in));
        return 0;
    case F_ROUND: {
        if (!is_num(in)) return fail(r, pos, "round needs a number, not %s", type_name(in));
        int64_t prec = arg(a, 0, "precision", &x) ? num_i(&x) : 0;
        str method_name;
        if (str_arg(r, pos, a, 1, "method", (str){"common", 6}, &method_name)) return -1;
        if (in->k != V_FLOAT && str_is(method_name, "common") && prec >= 0) {
            *out = v_int(num_i(in));
            return 0;
        }
        if (prec < -20 || prec > 20) return fail(r, pos, "round: precision out of range");
        double m = pow(10.0, (double)prec), v = num_f(in) * m;
        v = str_is(method_name, "ceil") ? ceil(v) : str_is(method_name, "floor") ? floor(v) : nearbyint(v);
        *out = v_float(v / m);
        return 0;
    }
    case F_SUM: {
        value acc = v_int(0);
        int by = arg(a, 0, "attribute", &y) && y.k == V_STR;
        str attr = by ? y.u.s : NOSTR;
        arg(a, 1, "start", &acc);
        if (iterate(r, pos, in, &l)) return -1;
        for (size_t i = 0; i < l->n; i++) {
            value v = l->v[i];
            if (by && get_path(r, pos, &l->v[i], attr, &v)) return -1;
            if (arith(r, pos, O_ADD, &acc, &v, &acc)) return -1;
        }
        *out = acc;
        return 0;
    }
    case F_MIN:
    case F_MAX:
    case F_SORT:
    case F_UNIQUE: {
        int cs_idx = fid == F_SORT ? 1 : 0, attr_idx = fid == F_SORT ? 2 : 1;
        int ci = !bool_arg(a, cs_idx, "case_sensitive", 0);
        int by = arg(a, attr_idx, "attribute", &y) && y.k == V_STR;
        str attr = by ? y.u.s : NOSTR;
        if (iterate(r, pos, in, &l)) return -1;
        value *keys = l->n ? ralloc(r, pos, sizeof(value) * l->n) : NULL;
        if (l->n && !keys) return -1;
        for (size_t i = 0; i < l->n; i++) {
            keys[i] = l->v[i];
            if (by && get_path(r, pos, &l->v[i], attr, &keys[i])) return -1;
        }
        if (fid == F_MIN || fid == F_MAX) {
            if (!l->n) {
                *out = v_undef(NOSTR);
                return 0;
            }
            size_t best = 0;
            for (size_t i = 1; i < l->n; i++) {
                int c;
                if (vcmp(r, pos, &keys[i], &keys[best], ci, &c)) return -1;
                if (fid == F_MIN ? c < 0 : c > 0) best = i;
            }
            *out = l->v[best];
            return 0;
        }
        if (!(o = new_list(r, pos, l->n))) return -1;
        if (fid == F_UNIQUE) {
            for (size_t i = 0; i < l->n; i++) {
                int seen = 0;
                for (size_t k = 0; k < i && !seen; k++) {
                    if (ci && keys[i].k == V_STR && keys[k].k == V_STR) seen = !lower_cmp(keys[i].u.s, keys[k].u.s);
                    else seen = veq(&keys[i], &keys[k], 0);
                }
                if (!seen) o->v[o->n++] = l->v[i];
            }
            o->iter = IT_GEN;
            *out = v_list(o);
            return 0;
        }
        for (size_t i = 0; i < l->n; i++) o->v[o->n++] = l->v[i];
        if (sort_values(r, pos, o->v, keys, o->n, ci, bool_arg(a, 0, "reverse", 0))) return -1;
        *out = v_list(o);
        return 0;
    }
    case F_DICTSORT: {
        if (in->k != V_DICT || in->u.d->ns) return fail(r, pos, "dictsort needs a mapping, not %s", type_name(in));
        int ci = !bool_arg(a, 0, "case_sensitive", 0);
        str by;
        if (str_arg(r, pos, a, 1, "by", (str){"key", 3}, &by)) return -1;
        if (!str_is(by, "key") && !str_is(by, "value")) return fail(r, pos, "dictsort: by must be 'key' or 'value'");
        method m = {*in, {"items", 5}};
        args none = {0, NULL, NULL};
        if (call_method(r, pos, &m, &none, &x)) return -1;
        l = x.u.l;
        value *keys = l->n ? ralloc(r, pos, sizeof(value) * l->n) : NULL;
        if (l->n && !keys) return -1;
        l->iter = IT_LIST; /* sorted() makes a list */
        for (size_t i = 0; i < l->n; i++) keys[i] = l->v[i].u.l->v[str_is(by, "key") ? 0 : 1];
        if (sort_values(r, pos, l->v, keys, l->n, ci, bool_arg(a, 2, "reverse", 0))) return -1;
        *out = x;
        return 0;
    }
    case F_MAP: {
        if (!(o = new_list(r, pos, 0))) return -1;
        o->iter = IT_GEN;
        *out = v_list(o);
        if (!truthy(in)) return 0; /* jinja2 maps nothing over a false value, None included */
        if (iterate(r, pos, in, &l) || !(o = new_list(r, pos, l->n))) return -1;
        o->iter = IT_GEN;
        if (arg(a, -1, "attribute", &y)) {
            if (y.k != V_STR) return fail(r, pos, "map: attribute must be a string");
            int has_default = arg(a, -1, "default", &x);
            for (size_t i = 0; i < l->n; i++) {
                value v;
                if (get_path(r, pos, &l->v[i], y.u.s, &v)) return -1;
                o->v[o->n++] = v.k == V_UNDEF && has_default ? x : v;
            }
            *out = v_list(o);
            return 0;
        }
        if (!arg(a, 0, NULL, &y) || y.k != V_STR) return fail(r, pos, "map needs a filter name or attribute=");
        int f = find_filter(y.u.s);
        if (f < 0) return fail(r, pos, "map: no filter named '%.*s'", (int)(y.u.s.n < 40 ? y.u.s.n : 40), y.u.s.p);
        args fa = *a;
        /* the filter's arguments: all but the first positional */
        fa.v = a->n > 1 ? ralloc(r, pos, sizeof(value) * (size_t)a->n) : NULL;
        str *kw = a->n > 1 ? ralloc(r, pos, sizeof(str) * (size_t)a->n) : NULL;
        if (a->n > 1 && (!fa.v || !kw)) return -1;
        fa.n = 0;
        int skipped = 0;
        for (int i = 0; i < a->n; i++) {
            int positional = !(a->kw && a->kw[i].p);
            if (positional && !skipped) {
                skipped = 1;
                continue;
            }
            fa.v[fa.n] = a->v[i];
            kw[fa.n] = positional ? (str){NULL, 0} : a->kw[i];
            fa.n++;
        }
        fa.kw = kw;
        for (size_t i = 0; i < l->n; i++)
            if (apply_filter(r, pos, f, &l->v[i], &fa, &o->v[o->n++])) return -1;
        *out = v_list(o);
        return 0;
    }
    case F_SELECT:
    case F_REJECT:
    case F_SELECTATTR:
    case F_REJECTATTR: return filter_select(r, pos, fid, in, a, out);
    case F_WORDCOUNT: {
        if (to_str(r, pos, in, &x)) return -1;
        int64_t n = 0;
        int inword = 0;
        for (size_t i = 0; i < x.u.s.n; i++) {
            unsigned char c = (unsigned char)x.u.s.p[i];
            int w = is_digit((char)c) || is_name0((char)c) || c >= 0x80;
            n += w && !inword;
            inword = w;
        }
        *out = v_int(n);
        return 0;
    }
    default: return fail(r, pos, "internal: filter %d", fid);
    }
}

/* ---- tests ------------------------------------------------------------------ */

static int apply_test(rx *r, int32_t pos, int tid, const value *v, const args *a, int *res) {
    value x;
    int has = arg(a, 0, NULL, &x);
    switch (tid) {
    case TS_DEFINED: *res = v->k != V_UNDEF; return 0;
    case TS_UNDEFINED: *res = v->k == V_UNDEF; return 0;
    case TS_NONE: *res = v->k == V_NONE; return 0;
    case TS_BOOLEAN: *res = v->k == V_BOOL; return 0;
    case TS_FALSE: *res = v->k == V_BOOL && !v->u.b; return 0;
    case TS_TRUE: *res = v->k == V_BOOL && v->u.b; return 0;
    case TS_INTEGER: *res = v->k == V_INT; return 0;
    case TS_FLOAT: *res = v->k == V_FLOAT; return 0;
    case TS_NUMBER: *res = is_num(v); return 0;
    case TS_STRING: *res = v->k == V_STR; return 0;
    case TS_MAPPING: *res = v->k == V_DICT && !v->u.d->ns; return 0;
    case TS_ITERABLE:
        *res = v->k == V_UNDEF || v->k == V_STR || v->k == V_LIST || (v->k == V_DICT && !v->u.d->ns);
        return 0;
    case TS_SEQUENCE:
        *res = v->k == V_UNDEF || v->k == V_STR || (v->k == V_LIST && v->u.l->iter == IT_LIST) ||
               (v->k == V_DICT && !v->u.d->ns);
        return 0;
    case TS_CALLABLE: *res = v->k == V_MACRO || v->k == V_FUNC || v->k == V_METHOD; return 0;
    case TS_LOWER:
    case TS_UPPER: {
        value s;
        if (to_str(r, pos, v, &s)) return -1;
        int cased = 0, ok = 1;
        for (size_t i = 0; i < s.u.s.n; i++) {
            char c = s.u.s.p[i];
            if (c >= 'a' && c <= 'z') cased = 1, ok &= tid == TS_LOWER;
            if (c >= 'A' && c <= 'Z') cased = 1, ok &= tid == TS_UPPER;
        }
        *res = cased && ok;
        return 0;
    }
    case TS_ODD:
    case TS_EVEN:
    case TS_DIVISIBLEBY: {
        if (v->k != V_INT && v->k != V_BOOL) {
            if (v->k == V_UNDEF) return undefined_error(r, pos, v);
            return fail(r, pos, "test needs an integer, not %s", type_name(v));
        }
        int64_t i = num_i(v);
        if (tid == TS_DIVISIBLEBY) {
            if (!has || (x.k != V_INT && x.k != V_BOOL)) return fail(r, pos, "divisibleby needs an integer");
            if (num_i(&x) == 0) return fail(r, pos, "integer division or modulo by zero");
            *res = num_i(&x) == -1 || i % num_i(&x) == 0;
        } else {
            *res = (i % 2 != 0) == (tid == TS_ODD);
        }
        return 0;
    }
    case TS_SAMEAS:
        if (!has) return fail(r, pos, "sameas needs an argument");
        if (v->k != x.k) *res = 0;
        else if (v->k == V_LIST) *res = v->u.l == x.u.l;
        else if (v->k == V_DICT) *res = v->u.d == x.u.d;
        else *res = veq(v, &x, 0);
        return 0;
    case TS_IN:
        if (!has) return fail(r, pos, "the in test needs an argument");
        return contains(r, pos, v, &x, res);
    default: {
        static const int ops[] = {[TS_EQ] = O_EQ, [TS_NE] = O_NE, [TS_LT] = O_LT,
                                  [TS_LE] = O_LE, [TS_GT] = O_GT, [TS_GE] = O_GE};
        if (tid > TS_UPPER || !ops[tid]) return fail(r, pos, "internal: test %d", tid);
        if (!has) return fail(r, pos, "comparison test needs an argument");
        return compare(r, pos, ops[tid], v, &x, res);
    }
    }
}

/* ---- statements --------------------------------------------------------------- */

static int out_check(rx *r, int32_t pos, buf *b) {
    if (!b->full) return 0;
    if (b->full == 2) return fail_mem(r, pos);
    fail(r, pos, "the rendered text exceeds %zu bytes (the output or memory limit)", b->limit);
    r->code = CAS_ERR_NOMEM;
    return -1;
}

static int bind_targets(rx *r, int32_t pos, scope *sc, const node *n, const value *v) {
    if (n->nk == 1) return scope_set(r, pos, sc, n->kid[0]->s, *v);
    if (v->k != V_LIST || v->u.l->n != (size_t)n->nk)
        return fail(r, pos, "cannot unpack %s into %d names", type_name(v), n->nk);
    for (int i = 0; i < n->nk; i++)
        if (scope_set(r, pos, sc, n->kid[i]->s, v->u.l->v[i])) return -1;
    return 0;
}

static int exec_for(rx *r, scope *sc, const node *n) {
    value it;
    list *items;
    if (eval(r, sc, n->a, &it) || iterate(r, n->pos, &it, &items)) return -1;
    scope *ls = new_scope(r, n->pos, sc);
    if (!ls) return -1;
    if (n->c) { /* the loop's if: applied before the loop, so loop.length counts what passes */
        list *kept = new_list(r, n->pos, 0);
        if (!kept) return -1;
        for (size_t i = 0; i < items->n; i++) {
            value c;
            if (step(r, n->pos, 1) || bind_targets(r, n->pos, ls, n, &items->v[i]) || eval(r, ls, n->c, &c)) return -1;
            if (truthy(&c) && list_push(r, n->pos, kept, items->v[i])) return -1;
        }
        items = kept;
    }
    if (!items->n) return n->alt ? exec_body(r, sc, n->alt) : 0;
    loopst *lp = ralloc(r, n->pos, sizeof *lp);
    if (!lp) return -1;
    lp->items = items;
    value lv = {.k = V_LOOP};
    lv.u.lp = lp;
    if (scope_set(r, n->pos, ls, (str){"loop", 4}, lv)) return -1;
    for (size_t i = 0; i < items->n; i++) {
        lp->i = i;
        if (step(r, n->pos, 1) || bind_targets(r, n->pos, ls, n, &items->v[i])) return -1;
        int rc = exec_body(r, ls, n->body);
        if (rc < 0) return -1;
        if (rc == 1) break;
    }
    return 0;
}

static int exec_stmt(rx *r, scope *sc, const node *n) {
    value v;
    switch (n->t) {
    case S_TEXT: b_put(r->out, n->s.p, n->s.n); return out_check(r, n->pos, r->out);
    case S_OUT: {
        /* the value's temporaries go back to the arena unless something stored a reference */
        arena_mark m = ar_mark(&r->ar);
        uint64_t stores = r->stores;
        if (eval(r, sc, n->a, &v)) return -1;
        to_text(r, n->pos, r->out, &v, 0, 0);
        if (r->failed || out_check(r, n->pos, r->out)) return -1;
        if (stores == r->stores) ar_release(&r->ar, m);
        return 0;
    }
    case S_IF: {
        arena_mark m = ar_mark(&r->ar);
        uint64_t stores = r->stores;
        if (eval(r, sc, n->a, &v)) return -1;
        int t = truthy(&v);
        if (stores == r->stores) ar_release(&r->ar, m);
        return t ? exec_body(r, sc, n->body) : n->alt ? (n->alt->t == S_IF && !n->alt->next ? exec_stmt(r, sc, n->alt) : exec_body(r, sc, n->alt)) : 0;
    }
    case S_FOR: return exec_for(r, sc, n);
    case S_SET:
        if (eval(r, sc, n->a, &v)) return -1;
        if (n->flag) {
            value *obj = scope_find(sc, n->kid[0]->s);
            if (!obj) obj = dict_get_s(r->globals, n->kid[0]->s);
            if (!obj || obj->k != V_DICT || !obj->u.d->ns)
                return fail(r, n->pos, "cannot assign attribute '%.*s' on a non-namespace object", (int)n->s.n, n->s.p);
            r->stores++;
            return dict_set(r, n->pos, obj->u.d, v_str(n->s.p, n->s.n), v);
        }
        return bind_targets(r, n->pos, sc, n, &v);
    case S_SETBLOCK:
        if (render_to_str(r, sc, n->body, n->pos, &v)) return -1;
        return scope_set(r, n->pos, sc, n->kid[0]->s, v);
    case S_MACRO: {
        macro *m = ralloc(r, n->pos, sizeof *m);
        if (!m) return -1;
        m->def = n;
        m->closure = sc;
        v.k = V_MACRO;
        v.u.m = m;
        return scope_set(r, n->pos, sc, n->s, v);
    }
    case S_BREAK: return 1;
    case S_CONTINUE: return 2;
    case S_FILTER: {
        scope *fs;
        if (render_to_str(r, sc, n->body, n->pos, &v) || !(fs = new_scope(r, n->pos, sc)) ||
            scope_set(r, n->pos, fs, (str){"\x01body", 5}, v) || eval(r, fs, n->a, &v))
            return -1;
        to_text(r, n->pos, r->out, &v, 0, 0);
        return r->failed ? -1 : out_check(r, n->pos, r->out);
    }
    case S_BLOCK: return exec_body(r, sc, n->body);
    default: return fail(r, n->pos, "internal: node %d is not a statement", n->t);
    }
}

/* 0 done, 1 break, 2 continue, -1 error */
static int exec_body(rx *r, scope *sc, const node *n) {
    for (; n; n = n->next) {
        int rc = exec_stmt(r, sc, n);
        if (rc) return rc;
    }
    return 0;
}

/* ---- the public render ----------------------------------------------------- */

cas_status cas_jinja_render(const cas_jinja *t, const char *context_json, size_t len, const cas_jinja_limits *lim,
                            char **out, size_t *out_len) {
    if (!t || !out || (!context_json && len)) return cas_error(CAS_ERR_INVALID, "jinja: NULL argument");
    *out = NULL;
    if (out_len) *out_len = 0;
    rx r;
    memset(&r, 0, sizeof r);
    r.t = t;
    r.max_output = lim && lim->max_output ? lim->max_output : DEF_MAX_OUTPUT;
    r.ar.limit = lim && lim->max_memory ? lim->max_memory : DEF_MAX_MEMORY;
    r.max_steps = lim && lim->max_steps > 0 ? lim->max_steps : DEF_MAX_STEPS;
    r.now = lim ? lim->now : -1;
    buf o = {0};
    o.limit = r.max_output;
    r.out = &o;
    int rc = 0;
    value ctx = v_none();
    if (len) {
        jreader j = {&r, context_json, len, 0, 0};
        rc = jr_value(&j, &ctx);
        jr_ws(&j);
        if (!rc && j.i != len) rc = jr_fail(&j, "trailing characters");
    } else {
        dict *d = new_dict(&r, 0);
        if (d) ctx = v_dict(d);
        else rc = -1;
    }
    if (!rc && (ctx.k != V_DICT)) rc = fail(&r, 0, "context JSON: not an object");
    if (!rc) {
        r.globals = ctx.u.d;
        scope *root = new_scope(&r, 0, NULL);
        rc = root ? exec_body(&r, root, t->root) : -1;
    }
    cas_status st = CAS_OK;
    if (rc < 0) {
        if (!strncmp(r.err, "context JSON", 12)) {
            st = cas_error(r.code == CAS_ERR_NOMEM ? CAS_ERR_NOMEM : CAS_ERR_INVALID, "jinja: %s", r.err);
        } else {
            int line, col;
            line_col(t->src, t->n, r.err_pos, &line, &col);
            st = cas_error(r.code ? r.code : CAS_ERR_INVALID, "jinja: line %d column %d: %s", line, col, r.err);
        }
        free(o.p);
    } else {
        if (!o.p && b_put(&o, "", 0)) st = cas_error(CAS_ERR_NOMEM, "jinja: out of memory");
        if (!st) {
            *out = o.p;
            if (out_len) *out_len = o.n;
        }
    }
    ar_free(&r.ar);
    return st;
}
