/*
 * attn_synth.c: random paged batches with a given sharing tree, for tests and
 * benchmarks (attn.h documents the tree spec). Shared runs are whole pages
 * that appear in every request below them, exactly as a prefix cache lays
 * them out, so the planner sees real page sharing.
 */
#include <ctype.h>
#include <stdint.h>
#include <sys/mman.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"

/* A parsed tree node: `count` requests share `tokens` more tokens. */
typedef struct tnode {
    int32_t count;
    int32_t tokens;
    int32_t n_child;
    struct tnode *child[64];
} tnode;

static void tfree(tnode *t) {
    if (!t) return;
    for (int i = 0; i < t->n_child; i++) tfree(t->child[i]);
    free(t);
}

static int parse_int(const char **s, int32_t *out) {
    if (!isdigit((unsigned char)**s)) return -1;
    long v = 0;
    while (isdigit((unsigned char)**s)) {
        v = v * 10 + (**s - '0');
        if (v > 100000000) return -1;
        (*s)++;
    }
    *out = (int32_t)v;
    return 0;
}

static int parse_list(const char **s, tnode *parent, int depth);

static int parse_group(const char **s, tnode *parent, int depth) {
    if (parent->n_child >= 64 || depth > 16) return -1;
    tnode *t = calloc(1, sizeof *t);
    if (!t) return -1;
    parent->child[parent->n_child++] = t;
    if (parse_int(s, &t->count) || t->count < 1) return -1;
    if (**s != '*') return -1;
    (*s)++;
    if (parse_int(s, &t->tokens)) return -1;
    if (**s == '(') {
        (*s)++;
        if (parse_list(s, t, depth + 1)) return -1;
        if (**s != ')') return -1;
        (*s)++;
        int32_t sum = 0;
        for (int i = 0; i < t->n_child; i++) sum += t->child[i]->count;
        if (sum > t->count) return -1;
    }
    return 0;
}

static int parse_list(const char **s, tnode *parent, int depth) {
    for (;;) {
        if (parse_group(s, parent, depth)) return -1;
        if (**s != '+') return 0;
        (*s)++;
    }
}

/* Walk state while laying out requests. */
typedef struct {
    const cas_attn_shape *shape;
    cas_rng *rng;
    int32_t suffix, qlen;
    int32_t *path_pages; /* shared pages along the current path */
    int32_t path_len;
    int32_t path_cap;
    int32_t path_extra;  /* private tokens inherited from partial pages above */
    /* outputs (two passes: counting, then filling) */
    int fill;
    int32_t n_req, n_pages, total_q, n_idx;
    int32_t *qo_indptr, *kv_indptr, *kv_indices, *last;
    int64_t unique, flat;
} walk;

static int32_t draw(walk *w, int32_t spec, int32_t lo) {
    if (spec >= 0) return spec;
    return (int32_t)cas_rng_range(w->rng, lo, -spec);
}

static void emit_request(walk *w) {
    const int32_t P = w->shape->page_size;
    int32_t priv = w->path_extra + draw(w, w->suffix, 0);
    int32_t shared_tok = w->path_len * P;
    if (shared_tok + priv == 0) priv = 1; /* a request needs KV */
    int32_t priv_pages = (priv + P - 1) / P;
    int32_t kv_len = shared_tok + priv;
    int32_t ql = draw(w, w->qlen, 1);
    if (ql > kv_len) ql = kv_len;
    if (!w->fill) w->n_idx += w->path_len + priv_pages;
    if (w->fill) {
        int32_t r = w->n_req;
        w->qo_indptr[r + 1] = w->qo_indptr[r] + ql;
        w->kv_indptr[r + 1] = w->kv_indptr[r] + w->path_len + priv_pages;
        for (int32_t i = 0; i < w->path_len; i++) w->kv_indices[w->n_idx++] = w->path_pages[i];
        for (int32_t i = 0; i < priv_pages; i++) w->kv_indices[w->n_idx++] = w->n_pages + i;
        w->last[r] = priv ? priv - (priv_pages - 1) * P : P;
    }
    w->n_req++;
    w->n_pages += priv_pages;
    w->total_q += ql;
    w->unique += priv;
    w->flat += kv_len;
}

static int walk_node(walk *w, const tnode *t) {
    const int32_t P = w->shape->page_size;
    int32_t full = t->tokens / P, rest = t->tokens % P;
    int32_t save_len = w->path_len, save_extra = w->path_extra;
    if (w->path_extra) {
        /* a partial page above: everything below is private to each request */
        w->path_extra += t->tokens;
    } else {
        if (w->path_len + full > w->path_cap) return -1;
        for (int32_t i = 0; i < full; i++) w->path_pages[w->path_len++] = w->n_pages + i;
        w->n_pages += full;
        w->unique += (int64_t)full * P;
        w->path_extra = rest;
    }
    int32_t placed = 0;
    for (int i = 0; i < t->n_child; i++) {
        if (walk_node(w, t->child[i])) return -1;
        placed += t->child[i]->count;
    }
    /* requests not placed in a sub-group end here */
    for (int32_t i = placed; i < t->count; i++) emit_request(w);
    w->path_len = save_len;
    w->path_extra = save_extra;
    return 0;
}

static int32_t tree_depth_pages(const tnode *t, int32_t P) {
    int32_t best = 0;
    for (int i = 0; i < t->n_child; i++) {
        int32_t d = tree_depth_pages(t->child[i], P);
        if (d > best) best = d;
    }
    return best + t->tokens / P + 1;
}

static int synth_huge;

void cas_attn_synth_huge_pages(int on) { synth_huge = on != 0; }

cas_status cas_attn_synth_create(cas_attn_synth *out, const cas_attn_shape *shape, const char *tree,
                                 int32_t batch, int32_t prefix, int32_t suffix, int32_t qlen,
                                 uint64_t seed) {
    memset(out, 0, sizeof *out);
    if (!shape || shape->page_size < 1 || shape->page_size > CAS_ATTN_MAX_PAGE_SIZE ||
        shape->head_dim < 1 || shape->num_qo_heads < 1 || shape->num_kv_heads < 1)
        return cas_error(CAS_ERR_INVALID, "synth: bad shape");
    if (qlen == 0) return cas_error(CAS_ERR_INVALID, "synth: qlen must not be 0");
    char buf[64];
    if (!tree || !*tree) {
        if (batch < 1 || prefix < 0) return cas_error(CAS_ERR_INVALID, "synth: batch must be >= 1, prefix >= 0");
        snprintf(buf, sizeof buf, "%d*%d", batch, prefix);
        tree = buf;
    }
    tnode root;
    memset(&root, 0, sizeof root);
    const char *s = tree;
    int bad = parse_list(&s, &root, 0) || *s != 0;
    if (bad) {
        for (int i = 0; i < root.n_child; i++) tfree(root.child[i]);
        return cas_error(CAS_ERR_INVALID,
                         "synth: bad tree spec '%s' near '%s' (want e.g. 40*1024(20*512)+10*768)", tree, s);
    }
    int32_t depth = 0;
    for (int i = 0; i < root.n_child; i++) {
        int32_t d = tree_depth_pages(root.child[i], shape->page_size);
        if (d > depth) depth = d;
    }
    cas_rng rng;
    walk w;
    memset(&w, 0, sizeof w);
    w.shape = shape;
    w.rng = &rng;
    w.suffix = suffix;
    w.qlen = qlen;
    w.path_cap = depth + 1;
    w.path_pages = malloc(sizeof(int32_t) * (size_t)w.path_cap);
    cas_status st = CAS_OK;
    if (!w.path_pages) st = cas_error(CAS_ERR_NOMEM, "synth: out of memory");
    /* pass 0 counts, pass 1 fills with the same random draws */
    for (int pass = 0; pass < 2 && !st; pass++) {
        cas_rng_seed(&rng, seed);
        if (pass == 1) {
            w.qo_indptr = calloc((size_t)w.n_req + 1, 4);
            w.kv_indptr = calloc((size_t)w.n_req + 1, 4);
            w.last = calloc((size_t)w.n_req + 1, 4);
            w.kv_indices = calloc((size_t)w.n_idx + 1, 4);
            if (!w.qo_indptr || !w.kv_indptr || !w.last || !w.kv_indices) {
                st = cas_error(CAS_ERR_NOMEM, "synth: out of memory");
                break;
            }
            w.fill = 1;
        }
        w.n_req = w.n_pages = w.total_q = w.n_idx = 0;
        w.unique = w.flat = 0;
        w.path_len = w.path_extra = 0;
        for (int i = 0; i < root.n_child && !st; i++)
            if (walk_node(&w, root.child[i])) st = cas_error(CAS_ERR_INVALID, "synth: tree too deep");
    }
    for (int i = 0; i < root.n_child; i++) tfree(root.child[i]);
    free(w.path_pages);
    if (!st && w.n_req < 1) st = cas_error(CAS_ERR_INVALID, "synth: the tree has no requests");
    size_t elems = (size_t)w.n_pages * (size_t)shape->page_size * (size_t)shape->num_kv_heads *
                   (size_t)shape->head_dim;
    size_t qelems = (size_t)w.total_q * (size_t)shape->num_qo_heads * (size_t)shape->head_dim;
    if (!st) {
        out->k = cas_alloc_array(elems, cas_dtype_size(shape->kv_dtype));
        out->v = cas_alloc_array(elems, cas_dtype_size(shape->kv_dtype));
        out->q = cas_alloc_array(qelems, sizeof(float));
        if (!out->k || !out->v || !out->q) st = cas_error(CAS_ERR_NOMEM, "synth: out of memory for the KV pool");
    }
    if (st) {
        free(w.qo_indptr), free(w.kv_indptr), free(w.last), free(w.kv_indices);
        cas_free(out->k), cas_free(out->v), cas_free(out->q);
        out->k = out->v = NULL;
        out->q = NULL;
        return st;
    }
    cas_rng_seed(&rng, seed ^ 0x5eedULL);
    void *pools[2] = {out->k, out->v};
    if (synth_huge) /* before the first touch, so the fill below faults huge pages in */
        for (int which = 0; which < 2; which++) {
            size_t bytes = elems * cas_dtype_size(shape->kv_dtype);
            uintptr_t a = ((uintptr_t)pools[which] + 4095) & ~(uintptr_t)4095;
            uintptr_t e = ((uintptr_t)pools[which] + bytes) & ~(uintptr_t)4095;
            if (e > a) (void)madvise((void *)a, e - a, MADV_HUGEPAGE);
        }
    for (int which = 0; which < 2; which++) {
        for (size_t i = 0; i < elems; i++) {
            float x = (float)cas_rng_normal(&rng);
            if (shape->kv_dtype == CAS_F32) ((float *)pools[which])[i] = x;
            else if (shape->kv_dtype == CAS_F16) ((uint16_t *)pools[which])[i] = cas_f32_to_f16(x);
            else ((uint16_t *)pools[which])[i] = cas_f32_to_bf16(x);
        }
    }
    for (size_t i = 0; i < qelems; i++) out->q[i] = (float)cas_rng_normal(&rng);
    out->batch = w.n_req;
    out->total_q = w.total_q;
    out->num_pages = w.n_pages;
    out->qo_indptr = w.qo_indptr;
    out->kv_indptr = w.kv_indptr;
    out->kv_indices = w.kv_indices;
    out->kv_last_page_len = w.last;
    out->unique_kv_tokens = w.unique;
    out->flat_kv_tokens = w.flat;
    return CAS_OK;
}

cas_attn_batch cas_attn_synth_batch(const cas_attn_synth *s) {
    cas_attn_batch b = {s->batch, s->qo_indptr, s->kv_indptr, s->kv_indices, s->kv_last_page_len};
    return b;
}

cas_kv_pool cas_attn_synth_pool(const cas_attn_synth *s) {
    cas_kv_pool p = {s->k, s->v, s->num_pages};
    return p;
}

void cas_attn_synth_destroy(cas_attn_synth *s) {
    if (!s) return;
    free(s->qo_indptr);
    free(s->kv_indptr);
    free(s->kv_indices);
    free(s->kv_last_page_len);
    cas_free(s->k);
    cas_free(s->v);
    cas_free(s->q);
    memset(s, 0, sizeof *s);
}
