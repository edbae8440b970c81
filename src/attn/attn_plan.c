/*
 * attn_plan.c: cascade planning.
 *
 * Planning turns a batch into passes (attn_impl.h). With cascade on, the
 * requests are sorted by their page lists; the longest common prefixes of
 * neighbours in that order give the tree of shared page runs (every
 * lcp-interval with two or more requests is a node). The cost model keeps a
 * node when reading it once for every query below it is cheaper than every
 * request reading it on its own. What a request does not get from chosen
 * nodes is its own pass (usually one contiguous tail). Passes are then cut
 * into jobs along KV (split-KV, so one long request still keeps every thread
 * busy) and jobs into work items (KV head x block of rows); each item is a
 * blocked multi-query attention over its KV: one tile of keys is loaded and
 * used by all its rows before the next tile is read.
 *
 * Running the plan (attn_cpu.c) is two phases in one OpenMP region: all
 * items in parallel (each writes attention states), then a per-token merge of
 * the states by their log-sum-exp. A build grows its buffers when a batch
 * needs more than any before it; a run allocates nothing. This file calls the
 * run's (kernel choice at create, workspace size, cas_attn_forward); the run
 * does not call back.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "attn_impl.h"

/* ---- options and cost model ---------------------------------------------- */

cas_attn_cost cas_attn_cost_default(void) {
    /* measured on the 2-core development machine: bench/HISTORY.md */
    cas_attn_cost c;
    c.bytes_per_s = 18e9;
    c.pack_bytes_per_s = 20e9;
    c.flops_per_s = 150e9;
    c.cache_bytes = 8.0 * 1024 * 1024;
    c.pass_overhead_s = 4e-6;
    c.row_merge_s = 0.4e-9;
    return c;
}

cas_attn_plan_opts cas_attn_plan_opts_default(void) {
    cas_attn_plan_opts o;
    o.cascade = CAS_CASCADE_AUTO;
    o.threads = 0;
    o.min_shared_tokens = 0;
    o.cost = cas_attn_cost_default();
    o.bf16_dot = 0;
    o.simd = CAS_SIMD_AUTO;
    o.amx_off = 0;
    o.batch_invariant = 0;
    return o;
}

/* ---- capacity management ------------------------------------------------ */

static int grow(void **p, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return 0;
    int64_t n = *cap > 0 ? *cap : 16;
    while (n < need) n *= 2;
    void *q = cas_alloc_array((size_t)n, elem);
    if (!q) return -1;
    cas_free(*p);
    *p = q;
    *cap = n;
    return 0;
}

static int grow32(void **p, int32_t *cap, int64_t need, size_t elem) {
    int64_t c = *cap;
    if (need > INT32_MAX) return -1;
    if (grow(p, &c, need, elem)) return -1;
    *cap = (int32_t)c;
    return 0;
}

/* Keeps the old contents when growing (used for arrays filled incrementally). */
static int grow_keep(void **ptr, int32_t *cap, int64_t need, size_t elem, int64_t used) {
    if (need <= *cap) return 0;
    int32_t c = *cap;
    void *old = *ptr;
    void *fresh = NULL;
    if (grow32(&fresh, &c, need, elem)) return -1;
    if (old && used) memcpy(fresh, old, (size_t)used * elem);
    cas_free(old);
    *ptr = fresh;
    *cap = c;
    return 0;
}

static cas_status ensure_batch_caps(cas_attn_plan *p, int32_t B, int64_t npages, int32_t total_q);

cas_status cas_attn_plan_create(cas_attn_plan **out, const cas_attn_shape *shape,
                                const cas_attn_plan_opts *opts, int32_t max_batch,
                                int32_t max_total_q, int64_t max_pages) {
    *out = NULL;
    /* validate the shape with an empty batch */
    int32_t zero = 0;
    cas_attn_batch empty = {0, &zero, &zero, NULL, NULL};
    cas_attn_params dp = cas_attn_params_default();
    cas_status st = cas_attn_validate(shape, &empty, 0, &dp);
    if (st) return st;
    cas_attn_plan *p = calloc(1, sizeof *p);
    if (!p) return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory");
    p->shape = *shape;
    p->opts = opts ? *opts : cas_attn_plan_opts_default();
    if ((st = cas_attn_cpu_select(p))) {
        free(p);
        return st;
    }
    int32_t nt = p->opts.threads > 0 ? p->opts.threads : omp_get_max_threads();
    if (nt < 1) nt = 1;
    p->threads = nt;
    p->work_floats = cas_attn_work_floats(shape->head_dim);
    p->work = cas_alloc_array((size_t)nt * (size_t)p->work_floats, sizeof(float));
    if (!p->work) {
        free(p);
        return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory for workspaces");
    }
    if (max_batch < 0 || max_total_q < 0 || max_pages < 0) {
        cas_attn_plan_destroy(p);
        return cas_error(CAS_ERR_INVALID, "attn plan: negative capacity");
    }
    st = ensure_batch_caps(p, max_batch, max_pages, max_total_q);
    if (st) {
        cas_attn_plan_destroy(p);
        return st;
    }
    *out = p;
    return CAS_OK;
}

void cas_attn_plan_destroy(cas_attn_plan *p) {
    if (!p) return;
    cas_free(p->qo_indptr);
    cas_free(p->kv_indptr);
    cas_free(p->pages);
    cas_free(p->last_len);
    cas_free(p->kv_len);
    cas_free(p->sorted);
    cas_free(p->lcp);
    cas_free(p->nodes);
    cas_free(p->passes);
    cas_free(p->tok_ids);
    cas_free(p->tok_pos);
    cas_free(p->jobs);
    cas_free(p->items);
    cas_free(p->contrib_indptr);
    cas_free(p->contrib_o);
    cas_free(p->contrib_lse);
    cas_free(p->direct_tok);
    cas_free(p->tok_init);
    cas_free(p->tok_carry);
    cas_free(p->row_pass);
    cas_free(p->chain);
    cas_free(p->pass_level);
    cas_free(p->level_start);
    cas_free(p->scratch);
    cas_free(p->work);
    cas_free(p->sort_work);
    free(p);
}

/* ---- prefix tree ---------------------------------------------------------- */

/* The token count of page i of request r (full but for the last). */
static inline int32_t page_tokens(const cas_attn_plan *p, int32_t r, int32_t i) {
    int32_t n = p->kv_indptr[r + 1] - p->kv_indptr[r];
    return i == n - 1 ? p->last_len[r] : p->shape.page_size;
}

/* Shared pages of requests a and b from page d on, where the first d are
 * shared: how many more pages have the same id and the same number of
 * tokens in both. The pages before either's last compare as ids only (both
 * full), a block of 64 at a time. */
static int32_t common_from(const cas_attn_plan *p, int32_t a, int32_t b, int32_t d) {
    const int32_t na = p->kv_indptr[a + 1] - p->kv_indptr[a], nb = p->kv_indptr[b + 1] - p->kv_indptr[b];
    const int32_t *pa = p->pages + p->kv_indptr[a], *pb = p->pages + p->kv_indptr[b];
    const int32_t n = na < nb ? na : nb;
    int32_t i = d;
    while (i + 64 <= n - 1 && memcmp(pa + i, pb + i, 64 * sizeof(int32_t)) == 0) i += 64;
    while (i < n - 1 && pa[i] == pb[i]) i++;
    if (i == n - 1 && pa[i] == pb[i] && page_tokens(p, a, i) == page_tokens(p, b, i)) i++;
    return i - d;
}

/* a request's element at depth d for the sort: (page id, tokens in it), -1 past its end */
struct sort_key {
    int64_t key;
    int32_t r;
};
static int cmp_sort_key(const void *x, const void *y) {
    const struct sort_key *a = x, *b = y;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return a->r < b->r ? -1 : (a->r > b->r); /* equal lists keep batch order */
}

/* Sorts sorted[0, n) by page list (lexicographically by (page id, tokens in
 * the page), a list before its extensions, equal lists in batch order) and
 * sets lcp[i] to the pages sorted[i - 1] and sorted[i] share at their start
 * (same id, same tokens in it; lcp[0] = 0). Most
 * significant page first: a group of requests that share their first d
 * pages finds how far they all go on together (common_from against its first
 * member), then splits by the element there, each part a group one deeper.
 * Each (request, page) is looked at about once, where sorting by comparison
 * compared every shared page again in each of its n log n comparisons (the
 * tree of 256 requests over 2048 shared pages: 2.1 ms a plan). Returns -1 on
 * allocation failure. */
static int sort_requests(cas_attn_plan *p, int32_t n) {
    const int64_t need = (int64_t)n * (int64_t)(sizeof(struct sort_key) + 3 * sizeof(int32_t)) + 64;
    if (need > p->cap_sort_work) {
        void *w = cas_alloc_array((size_t)need, 1);
        if (!w) return -1;
        cas_free(p->sort_work);
        p->sort_work = w;
        p->cap_sort_work = need;
    }
    struct sort_key *ks = p->sort_work;
    int32_t *stk = (int32_t *)(ks + n); /* groups (lo, hi, d), at most n pending */
    int32_t *sorted = p->sorted, *lcp = p->lcp, top = 0;
    if (n == 0) return 0;
    lcp[0] = 0;
    stk[0] = 0, stk[1] = n, stk[2] = 0;
    top = 1;
    while (top > 0) {
        top--;
        const int32_t lo = stk[3 * top], hi = stk[3 * top + 1], d = stk[3 * top + 2];
        if (hi - lo < 2) continue;
        /* the group goes on together to depth e */
        int32_t e = INT32_MAX;
        const int32_t ref = sorted[lo];
        for (int32_t i = lo + 1; i < hi; i++) {
            const int32_t c = d + common_from(p, ref, sorted[i], d);
            if (c < e) e = c;
        }
        /* split by the element at e (ended lists first) */
        for (int32_t i = lo; i < hi; i++) {
            const int32_t r = sorted[i], nr = p->kv_indptr[r + 1] - p->kv_indptr[r];
            ks[i - lo].key = e < nr ? (int64_t)p->pages[p->kv_indptr[r] + e] * 512 + page_tokens(p, r, e) : -1;
            ks[i - lo].r = r;
        }
        qsort(ks, (size_t)(hi - lo), sizeof *ks, cmp_sort_key);
        for (int32_t i = lo; i < hi; i++) sorted[i] = ks[i - lo].r;
        for (int32_t i = lo + 1; i < hi; i++) lcp[i] = e; /* deeper groups overwrite theirs */
        /* ended lists are equal to each other: sorted already (batch order) */
        for (int32_t i = lo; i < hi;) {
            int32_t j = i + 1;
            while (j < hi && ks[j - lo].key == ks[i - lo].key) j++;
            if (j - i > 1 && ks[i - lo].key >= 0) {
                stk[3 * top] = i, stk[3 * top + 1] = j, stk[3 * top + 2] = e + 1;
                top++;
            }
            i = j;
        }
    }
    return 0;
}

/* Builds nodes from the lcp-intervals of the sorted requests (those with
 * queries). Returns -1 on allocation failure. */
static int build_tree(cas_attn_plan *p) {
    int32_t n = 0;
    for (int32_t r = 0; r < p->batch; r++)
        if (p->qo_indptr[r + 1] > p->qo_indptr[r]) p->sorted[n++] = r;
    if (sort_requests(p, n)) return -1;

    /* bottom-up enumeration of lcp-intervals with a stack of (lcp, lo) */
    p->n_nodes = 0;
    if (n < 2) return 0;
    int32_t *st_lcp = p->kv_len + p->batch; /* scratch: see ensure_batch_caps */
    int32_t *st_lo = st_lcp + p->batch + 1;
    int32_t top = 0;
    st_lcp[0] = 0;
    st_lo[0] = 0;
    for (int32_t i = 1; i <= n; i++) {
        int32_t cur = i < n ? p->lcp[i] : 0;
        int32_t lb = i - 1;
        while (st_lcp[top] > cur) {
            int32_t l = st_lcp[top], lo = st_lo[top];
            top--;
            lb = lo;
            int32_t parent_lcp = st_lcp[top] > cur ? st_lcp[top] : cur;
            if (grow_keep((void **)&p->nodes, &p->cap_nodes, p->n_nodes + 1, sizeof(cas_attn_node), p->n_nodes))
                return -1;
            cas_attn_node *nd = &p->nodes[p->n_nodes++];
            nd->lo = lo;
            nd->hi = i;
            nd->depth0 = parent_lcp;
            nd->depth1 = l;
            nd->parent = -1;
            nd->chosen = 0;
            nd->rows = 0;
            for (int32_t k = lo; k < i; k++)
                nd->rows += p->qo_indptr[p->sorted[k] + 1] - p->qo_indptr[p->sorted[k]];
        }
        if (st_lcp[top] < cur) {
            top++;
            st_lcp[top] = cur;
            st_lo[top] = lb;
        }
    }
    /* parents: the smallest enclosing interval; nodes come out children first */
    for (int32_t a = 0; a < p->n_nodes; a++)
        for (int32_t b = a + 1; b < p->n_nodes; b++) {
            cas_attn_node *x = &p->nodes[a], *y = &p->nodes[b];
            if (y->lo <= x->lo && x->hi <= y->hi && y->depth1 <= x->depth0) {
                x->parent = b;
                break;
            }
        }
    return 0;
}

/* Tokens of a node's KV run (its last page may be a partial last page). */
static int64_t node_tokens(const cas_attn_plan *p, const cas_attn_node *nd) {
    int32_t r = p->sorted[nd->lo];
    int64_t t = 0;
    for (int32_t i = nd->depth0; i < nd->depth1; i++) t += page_tokens(p, r, i);
    return t;
}

static double kv_bytes_per_token(const cas_attn_plan *p) {
    return 2.0 * p->shape.head_dim * (double)cas_dtype_size(p->shape.kv_dtype) * p->shape.num_kv_heads;
}

/* Cost-model time of `reads` passes, each over the same `tokens` keys, for
 * `rows` query tokens in all: memory time (the keys once if they stay in
 * cache, else every time) against compute time (every read packs the keys;
 * the FLOPs are those of the rows). */
static double reads_time(const cas_attn_plan *p, double tokens, double rows, double reads) {
    const cas_attn_cost *c = &p->opts.cost;
    double bytes = tokens * kv_bytes_per_token(p);
    double mem = (bytes <= c->cache_bytes ? bytes : reads * bytes) / c->bytes_per_s;
    double flops = 4.0 * rows * p->shape.num_qo_heads * tokens * p->shape.head_dim;
    double comp = reads * bytes / c->pack_bytes_per_s + flops / c->flops_per_s;
    return mem > comp ? mem : comp;
}

static double pass_time(const cas_attn_plan *p, double tokens, double rows) {
    return reads_time(p, tokens, rows, 1.0);
}

/* The decision for one node: its run read once by a multi-query pass, or by
 * each of the k requests below it. */
static void choose_node(cas_attn_plan *p, cas_attn_node *nd) {
    const cas_attn_cost *c = &p->opts.cost;
    double L = (double)node_tokens(p, nd);
    double k = nd->hi - nd->lo;
    double rows = (double)nd->rows;
    if (L < p->opts.min_shared_tokens) return;
    if (p->opts.cascade == CAS_CASCADE_ALL) {
        nd->chosen = 1;
        return;
    }
    double flat = reads_time(p, L, rows, k);
    double shared = reads_time(p, L, rows, 1.0) + c->pass_overhead_s +
                    rows * p->shape.num_qo_heads * p->shape.head_dim * c->row_merge_s;
    if (shared < flat) nd->chosen = 1;
}

/* ---- layout of passes, jobs, items, merge lists --------------------------- */

static int add_pass(cas_attn_plan *p, int32_t page_off, int32_t pos0, int32_t len, int32_t node,
                    const int32_t *reqs, int32_t n_reqs) {
    if (grow_keep((void **)&p->passes, &p->cap_passes, p->n_passes + 1, sizeof(cas_attn_pass),
                  p->n_passes))
        return -1;
    int64_t ntok = 0;
    for (int32_t i = 0; i < n_reqs; i++) ntok += p->qo_indptr[reqs[i] + 1] - p->qo_indptr[reqs[i]];
    if (grow_keep((void **)&p->tok_ids, &p->cap_tok_rows, p->n_tok_rows + ntok, 4, p->n_tok_rows) ||
        grow_keep((void **)&p->tok_pos, &p->cap_tok_pos, p->n_tok_rows + ntok, 4, p->n_tok_rows))
        return -1;
    cas_attn_pass *ps = &p->passes[p->n_passes++];
    ps->page_off = page_off;
    ps->pos0 = pos0;
    ps->len = len;
    ps->tok_off = p->n_tok_rows;
    ps->n_tok = (int32_t)ntok;
    ps->node = node;
    for (int32_t i = 0; i < n_reqs; i++) {
        int32_t r = reqs[i];
        int32_t q0 = p->qo_indptr[r], ql = p->qo_indptr[r + 1] - q0;
        for (int32_t j = 0; j < ql; j++) {
            p->tok_ids[p->n_tok_rows] = q0 + j;
            p->tok_pos[p->n_tok_rows] = p->kv_len[r] - ql + j;
            p->n_tok_rows++;
        }
    }
    return 0;
}

static cas_status ensure_batch_caps(cas_attn_plan *p, int32_t B, int64_t npages, int32_t total_q) {
    int32_t c;
    int fail = 0;
    if (B + 1 > p->cap_batch) {
        /* all per-request arrays share cap_batch; kv_len doubles as tree stack
         * scratch so it gets room for 3 * (B + 1) entries */
        c = 0;
        void *a = NULL, *b = NULL, *d = NULL, *e = NULL, *f = NULL, *g = NULL;
        fail |= grow32(&a, &c, B + 1, 4);
        int32_t c2 = 0, c3 = 0, c4 = 0, c5 = 0, c6 = 0;
        fail |= grow32(&b, &c2, c, 4);
        fail |= grow32(&d, &c3, c, 4);
        fail |= grow32(&e, &c4, 3 * (int64_t)c + 3, 4);
        fail |= grow32(&f, &c5, c, 4);
        fail |= grow32(&g, &c6, c, 4);
        if (fail) {
            cas_free(a), cas_free(b), cas_free(d), cas_free(e), cas_free(f), cas_free(g);
            return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (batch %d)", B);
        }
        cas_free(p->qo_indptr), cas_free(p->kv_indptr), cas_free(p->last_len);
        cas_free(p->kv_len), cas_free(p->sorted), cas_free(p->lcp);
        p->qo_indptr = a, p->kv_indptr = b, p->last_len = d, p->kv_len = e, p->sorted = f, p->lcp = g;
        p->cap_batch = c;
    }
    if (grow(( void **)&p->pages, &p->cap_pages, npages > 0 ? npages : 1, 4))
        return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (pages)");
    if (total_q + 1 > p->cap_q) {
        c = 0;
        void *a = NULL, *b = NULL;
        fail |= grow32(&a, &c, total_q + 1, 4);
        int32_t c2 = 0;
        fail |= grow32(&b, &c2, c, 4);
        if (fail) {
            cas_free(a), cas_free(b);
            return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (queries)");
        }
        cas_free(p->contrib_indptr), cas_free(p->direct_tok);
        p->contrib_indptr = a, p->direct_tok = b;
        p->cap_q = c;
    }
    return CAS_OK;
}

static int add_job(cas_attn_plan *p, int32_t pass, int32_t kv0, int32_t kv1, int direct) {
    if (grow_keep((void **)&p->jobs, &p->cap_jobs, p->n_jobs + 1, sizeof(cas_attn_job), p->n_jobs))
        return -1;
    cas_attn_job *j = &p->jobs[p->n_jobs++];
    j->pass = pass;
    j->kv0 = kv0;
    j->kv1 = kv1;
    j->direct = direct;
    j->level = 0;
    j->o_off = j->lse_off = -1;
    return 0;
}

static int add_items_for_job(cas_attn_plan *p, int32_t jid) {
    const cas_attn_job *j = &p->jobs[jid];
    const cas_attn_pass *ps = &p->passes[j->pass];
    const int32_t G = p->shape.num_qo_heads / p->shape.num_kv_heads;
    const int32_t rows = ps->n_tok * G;
    const int32_t Hkv = p->shape.num_kv_heads;
    /* Few rows per head (decode): one item spans every KV head, so a token's
     * K and V (all heads, contiguous) stream in once, in short tiles. */
    const int32_t padded = rows <= 4 ? 4 : (rows + 5) / 6 * 6;
    const int all_heads = Hkv > 1 && padded * Hkv <= CAS_ATTN_ROW_BLOCK && !p->split_heads;
    const int32_t hstep = all_heads ? Hkv : 1;
    const int32_t tile = all_heads ? CAS_ATTN_SHORT_TILE : CAS_ATTN_TILE;
    int32_t rb = CAS_ATTN_ROW_BLOCK;
    int32_t nblk = (rows + rb - 1) / rb;
    /* balance the blocks: equal sizes, a multiple of 6 rows (the micro-kernel) */
    if (nblk > 0) rb = ((rows + nblk - 1) / nblk + 5) / 6 * 6;
    if (rb > CAS_ATTN_ROW_BLOCK) rb = CAS_ATTN_ROW_BLOCK;
    for (int32_t h = 0; h < Hkv; h += hstep) {
        for (int32_t r0 = 0; r0 < rows; r0 += rb) {
            int32_t r1 = r0 + rb < rows ? r0 + rb : rows;
            /* trim the key range to what the block's rows can see */
            int32_t minp = INT32_MAX, maxp = INT32_MIN;
            for (int32_t t = r0 / G; t <= (r1 - 1) / G; t++) {
                int32_t pos = p->tok_pos[ps->tok_off + t];
                if (pos < minp) minp = pos;
                if (pos > maxp) maxp = pos;
            }
            int64_t lo = (int64_t)ps->pos0 + j->kv0, hi = (int64_t)ps->pos0 + j->kv1; /* absolute */
            if (p->params.causal && hi > (int64_t)maxp + 1) hi = (int64_t)maxp + 1;
            if (p->params.window_left >= 0 && lo < (int64_t)minp - p->params.window_left) {
                lo = (int64_t)minp - p->params.window_left;
                /* tiles stay at their absolute positions; masking drops the keys before lo */
                if (p->opts.batch_invariant) lo = ps->pos0 + (lo - ps->pos0) / tile * tile;
            }
            if (hi < lo) hi = lo;
            if (grow_keep((void **)&p->items, &p->cap_items, p->n_items + 1, sizeof(cas_attn_item),
                          p->n_items))
                return -1;
            cas_attn_item *it = &p->items[p->n_items++];
            it->job = jid;
            it->kv_head0 = h;
            it->kv_head1 = h + hstep;
            it->row0 = r0;
            it->row1 = r1;
            it->kv0 = (int32_t)(lo - ps->pos0);
            it->kv1 = (int32_t)(hi - ps->pos0);
            it->tile = tile;
            it->level = j->level;
        }
    }
    return 0;
}

/* Items sort by level (batch-invariant plans; otherwise all 0), then largest first. */
static int cmp_items_cost(const void *x, const void *y) {
    const cas_attn_item *a = x, *b = y;
    if (a->level != b->level) return a->level < b->level ? -1 : 1;
    int64_t ca = (int64_t)(a->kv1 - a->kv0) * ((a->row1 - a->row0) + 16) * (a->kv_head1 - a->kv_head0);
    int64_t cb = (int64_t)(b->kv1 - b->kv0) * ((b->row1 - b->row0) + 16) * (b->kv_head1 - b->kv_head0);
    if (ca != cb) return ca > cb ? -1 : 1;
    if (a->job != b->job) return a->job < b->job ? -1 : 1;
    if (a->kv_head0 != b->kv_head0) return a->kv_head0 < b->kv_head0 ? -1 : 1;
    return a->row0 < b->row0 ? -1 : (a->row0 > b->row0);
}

/* ---- batch-invariant plans (opts.batch_invariant) -------------------------- */

/* Chosen shared runs trimmed inward to whole tiles at absolute positions: to
 * pages that are multiples of both the page size and CAS_ATTN_TILE, so that a
 * shared pass ends where a flat pass's tile would. A run with no whole tile
 * left is not shared. */
static void align_nodes(cas_attn_plan *p) {
    int32_t a = p->shape.page_size, b = CAS_ATTN_TILE;
    while (b) {
        int32_t t = a % b;
        a = b;
        b = t;
    }
    const int32_t step = CAS_ATTN_TILE / a; /* pages of lcm(page_size, tile) tokens */
    for (int32_t i = 0; i < p->n_nodes; i++) {
        cas_attn_node *nd = &p->nodes[i];
        if (!nd->chosen) continue;
        int32_t d0 = (nd->depth0 + step - 1) / step * step, d1 = nd->depth1 / step * step;
        if (d1 <= d0) {
            nd->chosen = 0;
        } else {
            nd->depth0 = d0;
            nd->depth1 = d1;
        }
    }
}

/* Each token's passes in key order (chain), the level of every pass (after
 * the passes before it for each of its tokens), and the scratch states that
 * carry a token's running softmax from one of its passes to the next;
 * *scratch grows by their floats. contrib_indptr and direct_tok serve as
 * scratch here (the merge lists are not used). */
static cas_status build_chains(cas_attn_plan *p, int32_t total_q, int64_t *scratch) {
    const int32_t n = p->n_tok_rows, Hq = p->shape.num_qo_heads, D = p->shape.head_dim;
    if (n > p->cap_chain) {
        int32_t c1 = 0, c2 = 0, c3 = 0, c4 = 0;
        void *a = NULL, *b = NULL, *c = NULL, *d = NULL;
        if (grow32(&a, &c1, n, 4) || grow32(&b, &c2, n, 4) || grow32(&c, &c3, n, 8) || grow32(&d, &c4, n, 8)) {
            cas_free(a), cas_free(b), cas_free(c), cas_free(d);
            return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (pass chains)");
        }
        cas_free(p->row_pass), cas_free(p->chain), cas_free(p->tok_init), cas_free(p->tok_carry);
        p->row_pass = a, p->chain = b, p->tok_init = c, p->tok_carry = d;
        p->cap_chain = c1 < c2 ? c1 : c2;
    }
    if (grow32((void **)&p->pass_level, &p->cap_pass_level, p->n_passes > 0 ? p->n_passes : 1, 4))
        return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (pass levels)");
    for (int32_t i = 0; i < p->n_passes; i++) {
        const cas_attn_pass *ps = &p->passes[i];
        for (int32_t t = 0; t < ps->n_tok; t++) p->row_pass[ps->tok_off + t] = i;
        p->pass_level[i] = 0;
    }
    int32_t *ind = p->contrib_indptr, *cur = p->direct_tok;
    for (int32_t t = 0; t <= total_q; t++) ind[t] = 0;
    for (int32_t g = 0; g < n; g++) ind[p->tok_ids[g] + 1]++;
    for (int32_t t = 0; t < total_q; t++) ind[t + 1] += ind[t], cur[t] = 0;
    for (int32_t g = 0; g < n; g++) {
        int32_t tok = p->tok_ids[g];
        int32_t *c = p->chain + ind[tok];
        /* insertion in key order (a token has a few passes; their segments are disjoint) */
        int32_t k = cur[tok]++;
        int32_t pos = p->passes[p->row_pass[g]].pos0;
        while (k > 0 && p->passes[p->row_pass[c[k - 1]]].pos0 > pos) {
            c[k] = c[k - 1];
            k--;
        }
        c[k] = g;
    }
    /* levels: a pass runs after its tokens' previous passes (relaxed to a
     * fixed point; chains are a few passes long) */
    for (int changed = 1; changed;) {
        changed = 0;
        for (int32_t t = 0; t < total_q; t++)
            for (int32_t k = ind[t] + 1; k < ind[t + 1]; k++) {
                int32_t a = p->row_pass[p->chain[k - 1]], b = p->row_pass[p->chain[k]];
                if (p->pass_level[b] <= p->pass_level[a]) {
                    p->pass_level[b] = p->pass_level[a] + 1;
                    changed = 1;
                }
            }
    }
    const int64_t state = (int64_t)Hq * D + 2 * (int64_t)Hq;
    for (int32_t t = 0; t < total_q; t++)
        for (int32_t k = ind[t]; k < ind[t + 1]; k++) {
            int32_t g = p->chain[k];
            p->tok_init[g] = k > ind[t] ? p->tok_carry[p->chain[k - 1]] : -1;
            p->tok_carry[g] = -1;
            if (k + 1 < ind[t + 1]) {
                p->tok_carry[g] = *scratch;
                *scratch += state;
            }
        }
    return CAS_OK;
}

/* Jobs of the fastest plan: passes longer than `chunk` split along their keys
 * (so one long request still keeps every thread busy), the merge lists of the
 * tokens served by several jobs, and the scratch of their states. */
static cas_status layout_split_jobs(cas_attn_plan *p, int64_t chunk, int32_t total_q) {
    const int32_t Hq = p->shape.num_qo_heads, D = p->shape.head_dim;
    int64_t scratch = 0;
    /* how many passes serve each token: decides direct writes */
    for (int32_t t = 0; t <= total_q; t++) p->contrib_indptr[t] = 0;
    for (int32_t i = 0; i < p->n_passes; i++) {
        const cas_attn_pass *ps = &p->passes[i];
        int32_t nj = ps->len > chunk ? (int32_t)((ps->len + chunk - 1) / chunk) : 1;
        for (int32_t t = 0; t < ps->n_tok; t++) p->contrib_indptr[p->tok_ids[ps->tok_off + t] + 1] += nj;
    }
    for (int32_t i = 0; i < p->n_passes; i++) {
        const cas_attn_pass *ps = &p->passes[i];
        int32_t nj = ps->len > chunk ? (int32_t)((ps->len + chunk - 1) / chunk) : 1;
        int direct = nj == 1 && ps->node < 0 && ps->n_tok > 0 &&
                     p->contrib_indptr[p->tok_ids[ps->tok_off] + 1] == 1;
        for (int32_t c = 0; c < nj; c++) {
            int32_t kv0 = (int32_t)(c * (ps->len / nj / CAS_ATTN_TILE * CAS_ATTN_TILE));
            int32_t kv1 = c == nj - 1 ? ps->len : (int32_t)((c + 1) * (ps->len / nj / CAS_ATTN_TILE * CAS_ATTN_TILE));
            if (nj > 1 && ps->len / nj < CAS_ATTN_TILE) { /* tiny: even split */
                kv0 = (int32_t)((int64_t)ps->len * c / nj);
                kv1 = (int32_t)((int64_t)ps->len * (c + 1) / nj);
            }
            if (add_job(p, i, kv0, kv1, direct))
                return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (jobs)");
            cas_attn_job *j = &p->jobs[p->n_jobs - 1];
            if (!direct) {
                j->o_off = scratch;
                scratch += (int64_t)ps->n_tok * Hq * D;
                j->lse_off = scratch;
                scratch += (int64_t)ps->n_tok * Hq;
            }
        }
    }
    if (grow((void **)&p->scratch, &p->cap_scratch, scratch > 0 ? scratch : 1, sizeof(float)))
        return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (scratch states, %lld floats)",
                         (long long)scratch);
    p->scratch_floats = scratch;

    /* 4. merge lists (CSR over tokens) */
    for (int32_t t = 0; t < total_q; t++) p->contrib_indptr[t + 1] += p->contrib_indptr[t];
    int64_t nc = p->contrib_indptr[total_q];
    int32_t cap_c = p->cap_contrib;
    if (nc > cap_c) {
        int32_t c1 = 0, c2 = 0;
        void *a = NULL, *bb = NULL;
        if (grow32(&a, &c1, nc, 8) || grow32(&bb, &c2, nc, 8)) {
            cas_free(a), cas_free(bb);
            return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (merge lists)");
        }
        cas_free(p->contrib_o), cas_free(p->contrib_lse);
        p->contrib_o = a, p->contrib_lse = bb, p->cap_contrib = c1;
    }
    p->n_contrib = (int32_t)nc;
    /* fill: a cursor per token, reusing direct_tok as the cursor first */
    for (int32_t t = 0; t < total_q; t++) p->direct_tok[t] = 0;
    for (int32_t jid = 0; jid < p->n_jobs; jid++) {
        const cas_attn_job *j = &p->jobs[jid];
        const cas_attn_pass *ps = &p->passes[j->pass];
        for (int32_t t = 0; t < ps->n_tok; t++) {
            int32_t tok = p->tok_ids[ps->tok_off + t];
            int32_t slot = p->contrib_indptr[tok] + p->direct_tok[tok]++;
            p->contrib_o[slot] = j->direct ? -1 : j->o_off + (int64_t)t * Hq * D;
            p->contrib_lse[slot] = j->direct ? -1 : j->lse_off + (int64_t)t * Hq;
        }
    }
    for (int32_t t = 0; t < total_q; t++)
        p->direct_tok[t] = (p->direct_tok[t] == 1 && p->contrib_o[p->contrib_indptr[t]] < 0);

    p->n_levels = p->n_passes ? 1 : 0;
    return CAS_OK;
}

cas_status cas_attn_plan_build(cas_attn_plan *p, const cas_attn_batch *b, int32_t num_pages,
                               const cas_attn_params *params) {
    if (!p) return cas_error(CAS_ERR_INVALID, "attn plan: NULL plan");
    cas_status st = cas_attn_validate_head(&p->shape, b, num_pages, params);
    if (st) return st;
    const int32_t B = b->batch, P = p->shape.page_size, Hq = p->shape.num_qo_heads,
                  D = p->shape.head_dim;
    const int32_t G = Hq / p->shape.num_kv_heads;
    int32_t total_q = B ? b->qo_indptr[B] : 0;
    int64_t npages = B ? b->kv_indptr[B] : 0;
    st = ensure_batch_caps(p, B, npages, total_q);
    if (st) return st;
    /* the page ids checked as they are copied (one pass over them) */
    if ((st = cas_attn_check_pages(b, num_pages, p->pages))) return st;

    p->params = *params;
    p->scale = cas_attn_scale(&p->shape, params);
    p->num_pages = num_pages;
    p->batch = B;
    p->total_q = total_q;
    memcpy(p->qo_indptr, b->qo_indptr, (size_t)(B + 1) * 4);
    memcpy(p->kv_indptr, b->kv_indptr, (size_t)(B + 1) * 4);
    if (B) memcpy(p->last_len, b->kv_last_page_len, (size_t)B * 4);
    for (int32_t r = 0; r < B; r++)
        p->kv_len[r] = (p->kv_indptr[r + 1] - p->kv_indptr[r] - 1) * P + p->last_len[r];
    p->n_nodes = p->n_passes = p->n_tok_rows = p->n_jobs = p->n_items = p->n_contrib = 0;
    memset(&p->info, 0, sizeof p->info);

    /* 1. tree and cost model */
    if (p->opts.cascade != CAS_CASCADE_OFF && B > 1) {
        if (build_tree(p)) return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (tree)");
        for (int32_t i = 0; i < p->n_nodes; i++) choose_node(p, &p->nodes[i]);
        if (p->opts.batch_invariant) align_nodes(p);
    }

    /* 2. passes: chosen nodes, then each request's remaining runs. The tree
     * stack scratch (kv_len + B ..) is reused here for request lists. */
    int32_t *reqs = p->kv_len + B;
    int32_t *rank = reqs + B + 1; /* rank[r]: position of r in sorted, or -1 */
    for (int32_t r = 0; r < B; r++) rank[r] = -1;
    int32_t n_sorted = 0;
    if (p->n_nodes) {
        for (int32_t r = 0; r < B; r++)
            if (p->qo_indptr[r + 1] > p->qo_indptr[r]) n_sorted++;
        for (int32_t i = 0; i < n_sorted; i++) rank[p->sorted[i]] = i;
    }
    for (int32_t i = 0; i < p->n_nodes; i++) {
        cas_attn_node *nd = &p->nodes[i];
        if (!nd->chosen) continue;
        int32_t n = 0;
        for (int32_t k = nd->lo; k < nd->hi; k++) reqs[n++] = p->sorted[k];
        /* members in batch order, so a pass's rows follow q's order */
        for (int32_t a = 1; a < n; a++)
            for (int32_t c = a; c > 0 && reqs[c - 1] > reqs[c]; c--) {
                int32_t t = reqs[c];
                reqs[c] = reqs[c - 1];
                reqs[c - 1] = t;
            }
        int32_t r0 = p->sorted[nd->lo];
        if (add_pass(p, p->kv_indptr[r0] + nd->depth0, nd->depth0 * P, (int32_t)node_tokens(p, nd), i,
                     reqs, n))
            return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (passes)");
    }
    int32_t n_shared_passes = p->n_passes;
    for (int32_t r = 0; r < B; r++) {
        if (p->qo_indptr[r + 1] == p->qo_indptr[r]) continue;
        int32_t npg = p->kv_indptr[r + 1] - p->kv_indptr[r];
        /* covered[d] for pages of r: mark chosen node ranges (nested, disjoint) */
        int32_t cur = 0; /* next uncovered page */
        while (cur < npg) {
            int32_t next_cov = npg, cov_end = npg;
            if (rank[r] >= 0)
                for (int32_t i = 0; i < p->n_nodes; i++) {
                    const cas_attn_node *nd = &p->nodes[i];
                    if (!nd->chosen || rank[r] < nd->lo || rank[r] >= nd->hi) continue;
                    if (nd->depth1 <= cur) continue;
                    int32_t s0 = nd->depth0 > cur ? nd->depth0 : cur;
                    if (s0 < next_cov) {
                        next_cov = s0;
                        cov_end = nd->depth1;
                    }
                }
            if (next_cov > cur) {
                int32_t len = 0;
                for (int32_t d = cur; d < next_cov; d++) len += page_tokens(p, r, d);
                if (add_pass(p, p->kv_indptr[r] + cur, cur * P, len, -1, &r, 1))
                    return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (passes)");
            }
            cur = next_cov < npg ? cov_end : npg;
        }
    }

    /* 3. jobs: split long KV so that the work fills every thread */
    int64_t work = 0, base_items = 0;
    for (int32_t i = 0; i < p->n_passes; i++) {
        int64_t rows = p->passes[i].n_tok * (int64_t)G;
        int64_t blocks = (rows + CAS_ATTN_ROW_BLOCK - 1) / CAS_ATTN_ROW_BLOCK;
        int64_t padded = rows <= 4 ? 4 : (rows + 5) / 6 * 6;
        int64_t head_items = padded * p->shape.num_kv_heads <= CAS_ATTN_ROW_BLOCK ? 1 : p->shape.num_kv_heads;
        /* work in (item x key) units: an item spanning every head is one unit per key */
        work += blocks * p->passes[i].len * head_items;
        base_items += blocks * head_items;
    }
    int64_t chunk = INT32_MAX;
    p->split_heads = 0;
    if (base_items < 4 * (int64_t)p->threads && p->threads > 1) {
        if (p->opts.batch_invariant) { /* never split along keys: split heads if too few items */
            p->split_heads = base_items < 2 * (int64_t)p->threads;
        } else {
            chunk = work / (4 * (int64_t)p->threads);
            if (chunk < 512) chunk = 512;
            chunk = (chunk + CAS_ATTN_TILE - 1) / CAS_ATTN_TILE * CAS_ATTN_TILE;
        }
    }
    if (p->opts.batch_invariant) {
        int64_t scratch = 0;
        /* one job per pass; a row writes its token's output or its carried state */
        if ((st = build_chains(p, total_q, &scratch))) return st;
        int32_t top = 0;
        for (int32_t i = 0; i < p->n_passes; i++) {
            if (add_job(p, i, 0, p->passes[i].len, 1))
                return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (jobs)");
            p->jobs[p->n_jobs - 1].level = p->pass_level[i];
            if (p->pass_level[i] > top) top = p->pass_level[i];
        }
        p->n_levels = p->n_passes ? top + 1 : 0;
        if (grow((void **)&p->scratch, &p->cap_scratch, scratch > 0 ? scratch : 1, sizeof(float)))
            return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (scratch states, %lld floats)",
                             (long long)scratch);
        p->scratch_floats = scratch;
        p->n_contrib = 0;
    } else if ((st = layout_split_jobs(p, chunk, total_q))) {
        return st;
    }
    /* 5. work items, largest first */
    for (int32_t jid = 0; jid < p->n_jobs; jid++)
        if (add_items_for_job(p, jid)) return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (items)");
    qsort(p->items, (size_t)p->n_items, sizeof(cas_attn_item), cmp_items_cost);
    if (grow32((void **)&p->level_start, &p->cap_levels, (int64_t)p->n_levels + 1, 4))
        return cas_error(CAS_ERR_NOMEM, "attn plan: out of memory (levels)");
    for (int32_t k = 0, i = 0; k <= p->n_levels; k++) {
        while (i < p->n_items && p->items[i].level < k) i++;
        p->level_start[k] = i;
    }
    if (p->n_levels > 0) p->level_start[p->n_levels] = p->n_items;

    /* 6. info */
    cas_attn_plan_info *in = &p->info;
    in->tree_nodes = p->n_nodes;
    in->shared_passes = n_shared_passes;
    in->passes = p->n_passes;
    in->work_items = p->n_items;
    for (int32_t i = 0; i < p->n_passes; i++) {
        in->kv_tokens_read += p->passes[i].len;
        if (p->passes[i].node >= 0) in->shared_rows += (int64_t)p->passes[i].n_tok * Hq;
        in->est_cost_s += pass_time(p, p->passes[i].len, p->passes[i].n_tok);
    }
    in->est_cost_s += n_shared_passes * p->opts.cost.pass_overhead_s +
                      (double)in->shared_rows * D * p->opts.cost.row_merge_s;
    for (int32_t r = 0; r < B; r++) {
        in->kv_tokens_flat += p->kv_len[r];
        in->est_flat_cost_s += pass_time(p, p->kv_len[r], p->qo_indptr[r + 1] - p->qo_indptr[r]);
    }
    if (cas_log_enabled(CAS_LOG_DEBUG))
        cas_log(CAS_LOG_DEBUG, "attn plan: B=%d tokens=%d nodes=%d shared_passes=%d passes=%d items=%d kv_read=%lld flat=%lld",
                B, total_q, p->n_nodes, n_shared_passes, p->n_passes, p->n_items,
                (long long)in->kv_tokens_read, (long long)in->kv_tokens_flat);
    return CAS_OK;
}

void cas_attn_plan_get_info(const cas_attn_plan *p, cas_attn_plan_info *info) { *info = p->info; }

void cas_attn_plan_passes(const cas_attn_plan *p, cas_attn_pass_list *out) {
    out->shape = p->shape;
    out->params = p->params;
    out->num_pages = p->num_pages;
    out->total_q = p->total_q;
    out->n_passes = p->n_passes;
    out->passes = p->passes;
    out->pages = p->pages;
    out->n_page_ids = p->batch ? p->kv_indptr[p->batch] : 0;
    out->tok_ids = p->tok_ids;
    out->tok_pos = p->tok_pos;
    out->n_tok_rows = p->n_tok_rows;
}

void cas_attn_plan_print(const cas_attn_plan *p, FILE *f) {
    fprintf(f, "plan: batch %d, %d query tokens, %d tree nodes, %d passes, %d jobs, %d items\n", p->batch,
            p->total_q, p->n_nodes, p->n_passes, p->n_jobs, p->n_items);
    for (int32_t i = 0; i < p->n_nodes; i++) {
        const cas_attn_node *nd = &p->nodes[i];
        fprintf(f, "  node %d: %d requests, pages [%d, %d), %lld query tokens, parent %d, %s\n", i,
                nd->hi - nd->lo, nd->depth0, nd->depth1, (long long)nd->rows, nd->parent,
                nd->chosen ? "shared pass" : "read per request");
    }
    for (int32_t i = 0; i < p->n_passes; i++) {
        const cas_attn_pass *ps = &p->passes[i];
        fprintf(f, "  pass %d: %d query tokens x keys [%d, %d)%s\n", i, ps->n_tok, ps->pos0,
                ps->pos0 + ps->len, ps->node >= 0 ? " (shared)" : "");
    }
}

cas_status cas_attn_forward(const cas_attn_shape *shape, const cas_kv_pool *pool,
                            const cas_attn_batch *batch, const cas_attn_params *params,
                            const cas_attn_plan_opts *opts, const float *q, float *o, float *lse) {
    cas_attn_plan *p;
    cas_status st = cas_attn_plan_create(&p, shape, opts, batch ? batch->batch : 0, 0, 0);
    if (st) return st;
    st = cas_attn_plan_build(p, batch, pool ? pool->num_pages : 0, params);
    if (!st) st = cas_attn_plan_run(p, pool, q, o, lse);
    cas_attn_plan_destroy(p);
    return st;
}
