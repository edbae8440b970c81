/*
 * test_cuda_plan.c: the CUDA backend's planner (src/cuda/cuda_attn_plan.c)
 * on the CPU, against the runtime stand-ins of cuda_stub.c (an H200's shape,
 * no GPU): cascade batches (a shared prefix over many decode tails, random
 * ones and the grid's headline), multi-level trees from the CPU planner and
 * random flat batches (prefill chunks beside decode rows, causal, windows),
 * each planned for the wgmma kernel and for the mma.sync one; the uploaded
 * block checked: every (pass, KV head, row) gets its visible keys exactly
 * once across the task lists, the wgmma list's per-CTA ranges partition it,
 * split states sit on 8-byte offsets within the scratch, each pass reads the
 * page ids it was given, and broken batch descriptions are refused with a
 * message and leave the context planning (test_invalid).
 *
 * It prints a digest of every block it planned, over the block's contents
 * by field (not its byte layout): a change meant to keep the plans shows it
 * kept them by printing the same digest. Built with -DPLAN_TEST_OLD_API it
 * compiles against the planner as it was before the options replaced the
 * environment (bench/HISTORY.md, the clean-up of src/cuda, names the commit).
 *
 * Built and run by `make CUDA=1 cuda-build-check` (no GPU needed) and `make
 * test-cuda`; `test_cuda_plan --time [N [JSON]]` times the planners.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <math.h>
#include <time.h>

#include "check.h"
#include "cuda_stub.h"
#include "../../src/cuda/cuda_attn.h"

#define PS 16 /* page size */
#define HQ 32
#define HKV 8
#define GROUP (HQ / HKV)

/* ---- the API, or the one before the clean-up ------------------------------ */

#ifdef PLAN_TEST_OLD_API
typedef struct {
    cas_attn_shape shape;
    cas_attn_params params;
    int32_t num_pages, total_q, n_passes;
    const cas_attn_pass *passes;
    const int32_t *pages;
    int64_t n_page_ids;
    const int32_t *tok_ids, *tok_pos;
    int32_t n_tok_rows;
} cas_attn_pass_list;
static void cas_attn_plan_passes(const cas_attn_plan *p, cas_attn_pass_list *l) {
    l->shape = p->shape;
    l->params = p->params;
    l->num_pages = p->num_pages;
    l->total_q = p->total_q;
    l->n_passes = p->n_passes;
    l->passes = p->passes;
    l->pages = p->pages;
    l->n_page_ids = p->batch ? p->kv_indptr[p->batch] : 0;
    l->tok_ids = p->tok_ids;
    l->tok_pos = p->tok_pos;
    l->n_tok_rows = p->n_tok_rows;
}
static cas_status ctx_create(cas_cuda_attn **a, const cas_attn_shape *sh, const cas_cuda_attn_caps *caps, int wgmma,
                             int32_t tail_mix_len) {
    char mix[32];
    snprintf(mix, sizeof mix, "%d", tail_mix_len);
    setenv("CASCADE_CUDA_WIDE", wgmma ? "17" : "1", 1);
    setenv("CASCADE_CUDA_TAIL_MIX_LEN", mix, 1);
    return cas_cuda_attn_create(a, sh, caps);
}
static cas_status plan_list(cas_cuda_attn *a, const cas_attn_pass_list *l) {
    return cas_cuda_attn_plan_passes(a, &l->params, l->num_pages, l->n_passes, l->passes, l->pages, l->n_page_ids,
                                     l->tok_ids, l->tok_pos, l->n_tok_rows, l->total_q);
}
#define TASK_SEQ(t) ((t)->pad)
#else
static cas_status ctx_create(cas_cuda_attn **a, const cas_attn_shape *sh, const cas_cuda_attn_caps *caps, int wgmma,
                             int32_t tail_mix_len) {
    cas_cuda_attn_opts o = cas_cuda_attn_opts_default();
    o.kernel = wgmma ? CAS_CUDA_KERNEL_WGMMA : CAS_CUDA_KERNEL_MMA_SYNC;
    o.tail_mix_len = tail_mix_len;
    return cas_cuda_attn_create(a, sh, caps, &o);
}
static cas_status plan_list(cas_cuda_attn *a, const cas_attn_pass_list *l) { return cas_cuda_attn_plan_passes(a, l); }
#define TASK_SEQ(t) ((t)->seq)
#endif

typedef struct {
    int32_t npass, ntok, npages;
    cas_attn_pass *passes;
    int32_t *pages, *tok_ids, *tok_pos;
    int32_t npage_ids;
} batch;

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(uint32_t n) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

/* B requests, one decode token each, a shared prefix of P keys (0: none)
 * and tails of U[i] keys after it */
static void batch_make(batch *b, int32_t B, int32_t P, const int32_t *U) {
    b->npass = (P > 0) + B;
    b->ntok = B;
    b->passes = calloc((size_t)b->npass, sizeof *b->passes);
    int64_t np = (P + PS - 1) / PS;
    for (int32_t i = 0; i < B; i++) np += (U[i] + PS - 1) / PS;
    b->pages = malloc(sizeof(int32_t) * (size_t)np);
    b->tok_ids = calloc((size_t)(2 * B), sizeof(int32_t)); /* rows [B, 2B): spare capacity */
    b->tok_pos = calloc((size_t)(2 * B), sizeof(int32_t));
    int32_t pg = 0, rows = 0, k = 0;
    if (P > 0) {
        cas_attn_pass *s = &b->passes[k++];
        s->page_off = pg;
        s->pos0 = 0;
        s->len = P;
        s->tok_off = rows;
        s->n_tok = B;
        s->node = 0;
        for (int32_t j = 0; j < (P + PS - 1) / PS; j++) b->pages[pg + j] = pg + j;
        pg += (P + PS - 1) / PS;
        for (int32_t i = 0; i < B; i++) {
            b->tok_ids[rows + i] = i;
            b->tok_pos[rows + i] = P + U[i] - 1;
        }
        rows += B;
    }
    for (int32_t i = 0; i < B; i++) {
        cas_attn_pass *t = &b->passes[k++];
        t->page_off = pg;
        t->pos0 = P;
        t->len = U[i];
        t->tok_off = rows;
        t->n_tok = 1;
        t->node = -1;
        for (int32_t j = 0; j < (U[i] + PS - 1) / PS; j++) b->pages[pg + j] = pg + j;
        pg += (U[i] + PS - 1) / PS;
        b->tok_ids[rows] = i;
        b->tok_pos[rows] = P + U[i] - 1;
        rows++;
    }
    b->npages = pg;
    b->npage_ids = pg;
}
static void batch_free(batch *b) {
    free(b->passes);
    free(b->pages);
    free(b->tok_ids);
    free(b->tok_pos);
}
/* the batch as a pass list (2 ntok token rows: the last ntok spare) */
static cas_attn_pass_list batch_list(const batch *b, const cas_attn_params *pr) {
    cas_attn_pass_list l;
    memset(&l, 0, sizeof l);
    l.params = *pr;
    l.num_pages = b->npages;
    l.total_q = b->ntok;
    l.n_passes = b->npass;
    l.passes = b->passes;
    l.pages = b->pages;
    l.n_page_ids = b->npage_ids;
    l.tok_ids = b->tok_ids;
    l.tok_pos = b->tok_pos;
    l.n_tok_rows = 2 * b->ntok;
    return l;
}

typedef struct {
    int32_t pass, head, row, kv0, kv1;
} cover;
static int cmp_cover(const void *x, const void *y) {
    const cover *a = x, *b = y;
    if (a->pass != b->pass) return a->pass < b->pass ? -1 : 1;
    if (a->head != b->head) return a->head < b->head ? -1 : 1;
    if (a->row != b->row) return a->row < b->row ? -1 : 1;
    return a->kv0 < b->kv0 ? -1 : a->kv0 > b->kv0;
}

/* ---- the digest ----------------------------------------------------------------- */

/* FNV-1a over the contents of every block checked, field by field */
static uint64_t digest = 1469598103934665603ull;
static void dig(const void *p, size_t n) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) digest = (digest ^ c[i]) * 1099511628211ull;
}
static void dig_i(int64_t v) { dig(&v, sizeof v); }
static void dig_tasks(const cas_cuda_task *t, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        const int32_t f[8] = {t[i].pass, t[i].kv_head, t[i].row0, t[i].nrows, t[i].kv0, t[i].kv1, t[i].qpos_min,
                              t[i].qpos_max};
        dig(f, sizeof f);
        dig_i(t[i].o_off);
        dig_i(t[i].lse_off);
    }
}
static void digest_block(int wgmma) {
    const char *blk = cas_stub_last_h2d;
    const cas_cuda_plan_hdr *h = (const cas_cuda_plan_hdr *)blk;
    const int32_t f[8] = {h->n_passes, h->n_tasks_wide, h->n_tasks_narrow, h->total_q,
                          h->n_merge_tok, h->causal, h->window_left, h->group};
    dig(f, sizeof f);
    dig(&h->scale_log2, 4);
    dig(&h->soft_cap, 4);
    dig(&h->scale, 4);
    const cas_cuda_pass *gp = (const cas_cuda_pass *)(blk + h->off_passes);
    dig(gp, sizeof *gp * (size_t)h->n_passes);
    int64_t nids = 0, ntok = 0;
    for (int32_t i = 0; i < h->n_passes; i++) {
        const int64_t e = gp[i].page_off + ((int64_t)gp[i].len + PS - 1) / PS, t = (int64_t)gp[i].tok_off + gp[i].n_tok;
        if (e > nids) nids = e;
        if (t > ntok) ntok = t;
    }
    dig(blk + h->off_pages, 4 * (size_t)nids);
    dig(blk + h->off_tok_ids, 4 * (size_t)ntok);
    dig(blk + h->off_tok_pos, 4 * (size_t)ntok);
    dig_tasks((const cas_cuda_task *)(blk + h->off_tasks_wide), h->n_tasks_wide);
    dig_tasks((const cas_cuda_task *)(blk + h->off_tasks_narrow), h->n_tasks_narrow);
    if (wgmma) dig(blk + h->off_cta_ptr, 4 * (size_t)(CAS_STUB_SMS + 1));
    const int32_t *ind = (const int32_t *)(blk + h->off_contrib_indptr);
    dig(blk + h->off_merge_tok, 4 * (size_t)h->n_merge_tok);
    dig(ind, 4 * (size_t)(h->n_merge_tok + 1));
    dig(blk + h->off_contrib_o, 8 * (size_t)ind[h->n_merge_tok]);
    dig(blk + h->off_contrib_lse, 8 * (size_t)ind[h->n_merge_tok]);
}

/* ---- the checks of a block ---------------------------------------------------- */

/* checks the last uploaded block (wgmma: planned for the wgmma kernel) */
static void check_block(const char *what, int wgmma) {
    digest_block(wgmma);
    const char *blk = cas_stub_last_h2d;
    const cas_cuda_plan_hdr *h = (const cas_cuda_plan_hdr *)blk;
    CHECK((size_t)h->block_bytes == cas_stub_last_h2d_bytes);
    CHECK(h->group == GROUP);

    /* every (pass, head, row) gets its visible keys once over the two
     * lists: disjoint, contiguous intervals within [0, len), from at or
     * before the row's first visible key (0, or with a window its position
     * less the window) to at or past its last (len, or causal its position) */
    const cas_cuda_pass *gp = (const cas_cuda_pass *)(blk + h->off_passes);
    const int32_t *gpos = (const int32_t *)(blk + h->off_tok_pos);
    const struct {
        int64_t off;
        int32_t n;
    } lists[2] = {{h->off_tasks_wide, h->n_tasks_wide}, {h->off_tasks_narrow, h->n_tasks_narrow}};
    int64_t ncov = 0, cap = 0;
    for (int l = 0; l < 2; l++) {
        const cas_cuda_task *t = (const cas_cuda_task *)(blk + lists[l].off);
        for (int32_t i = 0; i < lists[l].n; i++) cap += t[i].nrows > 0 ? t[i].nrows : 0;
    }
    cover *cv = malloc(sizeof *cv * (size_t)(cap > 0 ? cap : 1));
    int bad = 0, marks = 0;
    for (int l = 0; l < 2; l++) {
        const cas_cuda_task *t = (const cas_cuda_task *)(blk + lists[l].off);
        for (int32_t i = 0; i < lists[l].n; i++) {
            const cas_cuda_task *x = &t[i];
            marks += x->flags != 0 || TASK_SEQ(x) != 0;
            if (x->pass < 0 || x->pass >= h->n_passes || x->kv_head < 0 || x->kv_head >= HKV || x->nrows < 1 ||
                x->row0 < 0 || x->row0 + x->nrows > gp[x->pass].n_tok * GROUP || x->kv0 < 0 ||
                x->kv1 > gp[x->pass].len) {
                bad++;
                continue;
            }
            for (int32_t r = 0; r < x->nrows; r++) cv[ncov++] = (cover){x->pass, x->kv_head, x->row0 + r, x->kv0, x->kv1};
        }
    }
    CHECKF(bad == 0, "%s: %d tasks out of range", what, bad);
    /* the host's marks and creation order do not reach the device */
    CHECKF(marks == 0, "%s: %d tasks with flags or seq set", what, marks);
    qsort(cv, (size_t)ncov, sizeof *cv, cmp_cover);
    int64_t rows_all = 0;
    for (int32_t p = 0; p < h->n_passes; p++) rows_all += (int64_t)gp[p].n_tok * GROUP * HKV;
    int64_t seen = 0, gaps = 0;
    for (int64_t i = 0; i < ncov;) {
        const cas_cuda_pass *ps = &gp[cv[i].pass];
        const int64_t qp = (int64_t)gpos[ps->tok_off + cv[i].row / GROUP] - ps->pos0;
        int64_t lo = h->window_left >= 0 ? qp - h->window_left : 0, hi = h->causal && qp + 1 < ps->len ? qp + 1 : ps->len;
        if (lo < 0) lo = 0;
        int64_t j = i, start = -1, end = -1;
        for (; j < ncov && cv[j].pass == cv[i].pass && cv[j].head == cv[i].head && cv[j].row == cv[i].row; j++) {
            if (cv[j].kv1 <= cv[j].kv0) continue;
            if (start < 0) start = cv[j].kv0;
            else if (cv[j].kv0 != end) gaps++;
            end = cv[j].kv1;
        }
        if (hi > lo && (start < 0 || start > lo || end < hi)) gaps++;
        if (end > ps->len) gaps++;
        seen++;
        i = j;
    }
    CHECKF(seen == rows_all && gaps == 0, "%s: %lld of %lld rows covered, %lld gaps or overlaps", what,
           (long long)seen, (long long)rows_all, (long long)gaps);
    free(cv);

    if (wgmma) {
        /* the per-CTA ranges partition the many-rows list */
        const int32_t *cp = (const int32_t *)(blk + h->off_cta_ptr);
        int mono = cp[0] == 0 && cp[CAS_STUB_SMS] == h->n_tasks_wide;
        for (int c = 0; c < CAS_STUB_SMS; c++) mono &= cp[c] <= cp[c + 1];
        CHECKF(mono, "%s: cta_ptr does not partition the %d tasks", what, h->n_tasks_wide);
    }
}

/* the last uploaded block gives each pass the page ids it was given
 * (passes[i] over pages), wherever it puts them, and stays within its size */
static void check_pass_pages(const char *what, const cas_attn_pass *passes, const int32_t *pages) {
    const char *blk = cas_stub_last_h2d;
    const cas_cuda_plan_hdr *h = (const cas_cuda_plan_hdr *)blk;
    const cas_cuda_pass *gp = (const cas_cuda_pass *)(blk + h->off_passes);
    const int32_t *gpages = (const int32_t *)(blk + h->off_pages);
    const int64_t room = (h->off_tok_ids - h->off_pages) / 4;
    int bad = 0;
    for (int32_t i = 0; i < h->n_passes; i++) {
        const int32_t np = (passes[i].len + PS - 1) / PS;
        if (gp[i].page_off < 0 || gp[i].page_off + (int64_t)np > room) {
            bad++;
            continue;
        }
        bad += np && memcmp(gpages + gp[i].page_off, pages + passes[i].page_off, (size_t)np * 4) != 0;
    }
    CHECKF(bad == 0, "%s: %d passes read other page ids than they were given", what, bad);
}

/* plans b for the wgmma (or the mma.sync) kernel and checks the uploaded
 * block; its task counts into n (where not NULL) */
static void plan_check(const batch *b, int wgmma, int32_t tail_mix_len, const char *what, int32_t n[2]) {
    const cas_attn_shape sh = {HQ, HKV, 128, PS, CAS_BF16};
    cas_cuda_attn_caps caps = {0};
    caps.max_total_q = b->ntok;
    caps.max_passes = b->npass;
    caps.max_tok_rows = 2 * b->ntok;
    caps.max_page_ids = b->npage_ids;
    caps.max_states = 64 * (int64_t)b->ntok;
    cas_cuda_attn *a = NULL;
    if (ctx_create(&a, &sh, &caps, wgmma, tail_mix_len) != CAS_OK) {
        CHECKF(0, "%s: create: %s", what, cas_last_error());
        return;
    }
    cas_attn_params pr = cas_attn_params_default();
    const cas_attn_pass_list l = batch_list(b, &pr);
    cas_status st = plan_list(a, &l);
    if (st == CAS_OK) st = cas_cuda_attn_upload(a, NULL);
    if (st != CAS_OK) {
        CHECKF(0, "%s: plan: %s", what, cas_last_error());
        cas_cuda_attn_destroy(a);
        return;
    }
    const cas_cuda_plan_hdr *h = (const cas_cuda_plan_hdr *)cas_stub_last_h2d;
    CHECKF(h->n_passes == b->npass, "%s: passes", what);
    if (n) n[0] = h->n_tasks_wide, n[1] = h->n_tasks_narrow;
    check_block(what, wgmma);
    check_pass_pages(what, b->passes, b->pages);
    cas_cuda_attn_destroy(a);
}

static void test_headline(void) {
    int32_t U[64];
    for (int i = 0; i < 64; i++) U[i] = 512;
    batch b;
    batch_make(&b, 64, 32768, U);
    int32_t n[2];
    plan_check(&b, 1, 512, "headline wgmma", n);
    /* the decode tails are in the wgmma list, spread over the CTAs */
    CHECKF(n[1] == 0 && n[0] > 64 * HKV, "headline: %d wgmma tasks, %d narrow", n[0], n[1]);
    plan_check(&b, 0, 512, "headline mma.sync", n);
    CHECKF(n[1] >= 64 * HKV, "headline mma.sync: %d narrow tasks", n[1]);
    batch_free(&b);
}

/* random cascades: prefix 0-8k keys, 1-96 requests, tails of 1-1500 keys,
 * every decode tail joining the wgmma list or the default rule */
static void test_random(void) {
    for (int it = 0; it < 60; it++) {
        const int32_t B = 1 + (int32_t)rnd(96), P = (int32_t)rnd(3) == 0 ? 0 : PS * (int32_t)rnd(513);
        int32_t U[96];
        const int same = rnd(2) == 0;
        const int32_t u0 = 1 + (int32_t)rnd(1500);
        for (int32_t i = 0; i < B; i++) U[i] = same ? u0 : 1 + (int32_t)rnd(1500);
        batch b;
        batch_make(&b, B, P, U);
        const int wgmma = rnd(4) != 3;
        const int32_t mix = rnd(2) ? 1000000000 : 512;
        char what[96];
        snprintf(what, sizeof what, "random %d (B %d P %d U0 %d%s) %s mix %d", it, B, P, U[0], same ? " all" : "",
                 wgmma ? "wgmma" : "mma.sync", mix);
        plan_check(&b, wgmma, mix, what, NULL);
        batch_free(&b);
    }
}

/* flat batches: 1-40 requests of 1-40 queries at the end of 1-3000 keys
 * (prefill chunks beside decode rows), causal */
static void test_flat(void) {
    for (int it = 0; it < 40; it++) {
        const int32_t B = 1 + (int32_t)rnd(40);
        int32_t qo[41], kvp[41], last[40], kvl[40];
        qo[0] = kvp[0] = 0;
        for (int32_t r = 0; r < B; r++) {
            const int32_t ql = rnd(3) ? 1 : 1 + (int32_t)rnd(40);
            kvl[r] = ql + (int32_t)rnd(3000);
            qo[r + 1] = qo[r] + ql;
            kvp[r + 1] = kvp[r] + (kvl[r] + PS - 1) / PS;
            last[r] = kvl[r] - (kvl[r] - 1) / PS * PS;
        }
        int32_t *idx = malloc(sizeof(int32_t) * (size_t)kvp[B]);
        for (int32_t j = 0; j < kvp[B]; j++) idx[j] = j;
        const cas_attn_batch bt = {B, qo, kvp, idx, last};
        const int wgmma = rnd(3) == 0 ? 0 : 1;
        char what[64];
        snprintf(what, sizeof what, "flat %d (B %d, %d queries) %s", it, B, qo[B], wgmma ? "wgmma" : "mma.sync");
        const cas_attn_shape sh = {HQ, HKV, 128, PS, CAS_BF16};
        cas_cuda_attn_caps caps = {0};
        caps.max_total_q = qo[B];
        caps.max_passes = B;
        caps.max_tok_rows = qo[B];
        caps.max_page_ids = kvp[B];
        cas_cuda_attn *a = NULL;
        if (ctx_create(&a, &sh, &caps, wgmma, 512) != CAS_OK) {
            CHECKF(0, "%s: create: %s", what, cas_last_error());
            free(idx);
            continue;
        }
        cas_attn_params pr = cas_attn_params_default();
        if (cas_cuda_attn_plan_flat(a, &bt, kvp[B], &pr) != CAS_OK || cas_cuda_attn_upload(a, NULL) != CAS_OK) {
            CHECKF(0, "%s: plan: %s", what, cas_last_error());
        } else {
            check_block(what, wgmma);
        }
        cas_cuda_attn_destroy(a);
        free(idx);
    }
}

/* a batch as the contract's arrays (cas_attn_batch), owned: B requests, room
 * for max_ids page ids */
typedef struct {
    int32_t B, *qo, *kvp, *last, *idx;
} lists;
static lists lists_make(int32_t B, int64_t max_ids) {
    lists l = {B, malloc(sizeof(int32_t) * (size_t)(B + 1)), malloc(sizeof(int32_t) * (size_t)(B + 1)),
               malloc(sizeof(int32_t) * (size_t)B), malloc(sizeof(int32_t) * (size_t)max_ids)};
    l.qo[0] = l.kvp[0] = 0;
    return l;
}
static cas_attn_batch lists_batch(const lists *l) { return (cas_attn_batch){l->B, l->qo, l->kvp, l->idx, l->last}; }
static void lists_free(lists *l) {
    free(l->qo);
    free(l->kvp);
    free(l->last);
    free(l->idx);
}

/* multi-level cascades: random trees of shared prefixes (a1 requests share
 * t1 pages, b1 of them t2 more, c1 of those t3 more; d others t4 pages of
 * their own tree), each request 1-4 queries or a prefill chunk and 1-150
 * private tokens, planned by the CPU planner (every shared run a pass) and
 * taken over by cas_cuda_attn_plan_from_cpu; causal, some with a window */
static void test_trees(void) {
    const int n = 40;
    const cas_attn_shape sh = {HQ, HKV, 128, PS, CAS_BF16};
    int multi = 0;
    for (int it = 0; it < n; it++) {
        const int32_t a1 = 2 + (int32_t)rnd(40), b1 = 1 + (int32_t)rnd((uint32_t)a1), c1 = 1 + (int32_t)rnd((uint32_t)b1);
        const int32_t t1 = 1 + (int32_t)rnd(200), t2 = 1 + (int32_t)rnd(40), t3 = (int32_t)rnd(20);
        const int32_t d = (int32_t)rnd(8), t4 = 1 + (int32_t)rnd(40), B = a1 + d;
        const int prefill = rnd(3) == 0;
        lists L = lists_make(B, (int64_t)B * (t1 + t2 + t3 + t4 + 10));
        int32_t *qo = L.qo, *kvp = L.kvp, *last = L.last, *idx = L.idx;
        int32_t np = 0, next = 0; /* page ids: the trees' first, then each request's own */
        const int32_t first2 = t1, first3 = t1 + t2, first4 = t1 + t2 + t3;
        next = first4 + t4;
        for (int32_t r = 0; r < B; r++) {
            if (r < a1) {
                for (int32_t k = 0; k < t1; k++) idx[np++] = k;
                for (int32_t k = 0; r < b1 && k < t2; k++) idx[np++] = first2 + k;
                for (int32_t k = 0; r < c1 && k < t3; k++) idx[np++] = first3 + k;
            } else {
                for (int32_t k = 0; k < t4; k++) idx[np++] = first4 + k;
            }
            const int32_t own = 1 + (int32_t)rnd(150), pages = (own + PS - 1) / PS;
            for (int32_t k = 0; k < pages; k++) idx[np++] = next++;
            kvp[r + 1] = np;
            last[r] = own - (pages - 1) * PS;
            const int32_t kvlen = (kvp[r + 1] - kvp[r] - 1) * PS + last[r];
            int32_t q = prefill ? 1 + (int32_t)rnd(200) : 1 + (int32_t)rnd(4);
            if (q > kvlen) q = kvlen;
            qo[r + 1] = qo[r] + q;
        }
        const cas_attn_batch bt = lists_batch(&L);
        cas_attn_params pr = cas_attn_params_default();
        if (rnd(4) == 0) pr.window_left = (int32_t)rnd(3000);
        cas_attn_plan_opts opts = cas_attn_plan_opts_default();
        opts.cascade = CAS_CASCADE_ALL;
        cas_attn_plan *plan = NULL;
        cas_status st = cas_attn_plan_create(&plan, &sh, &opts, B, qo[B], np);
        if (st == CAS_OK) st = cas_attn_plan_build(plan, &bt, next, &pr);
        CHECKF(st == CAS_OK, "tree %d: cpu plan: %s", it, cas_last_error());
        cas_attn_pass_list pl;
        memset(&pl, 0, sizeof pl);
        if (st == CAS_OK) cas_attn_plan_passes(plan, &pl);
        int levels = 0;
        for (int32_t i = 0; i < pl.n_passes; i++) levels += pl.passes[i].node >= 0;
        multi += levels >= 2;
        const int wgmma = rnd(4) != 3;
        char what[256];
        snprintf(what, sizeof what,
                 "tree %d (%d*%d(%d*%d(%d*%d))+%d*%d pages, %d queries, %d shared passes) %s window %d", it, a1, t1,
                 b1, t2, c1, t3, d, t4, qo[B], levels, wgmma ? "wgmma" : "mma.sync", pr.window_left);
        cas_cuda_attn *a = NULL;
        if (st == CAS_OK) {
            cas_cuda_attn_caps caps = {0};
            caps.max_total_q = qo[B];
            caps.max_passes = pl.n_passes;
            caps.max_tok_rows = pl.n_tok_rows;
            caps.max_page_ids = np;
            st = ctx_create(&a, &sh, &caps, wgmma, 512);
            CHECKF(st == CAS_OK, "%s: create: %s", what, cas_last_error());
        }
        if (st == CAS_OK) {
            st = cas_cuda_attn_plan_from_cpu(a, plan);
            if (st == CAS_OK) st = cas_cuda_attn_upload(a, NULL);
            CHECKF(st == CAS_OK, "%s: plan: %s", what, cas_last_error());
            if (st == CAS_OK) {
                check_block(what, wgmma);
                check_pass_pages(what, pl.passes, pl.pages);
                /* the block holds the passes' page ids only, not every request's */
                const cas_cuda_plan_hdr *h = (const cas_cuda_plan_hdr *)cas_stub_last_h2d;
                int64_t want = 0;
                for (int32_t i = 0; i < pl.n_passes; i++) want += (pl.passes[i].len + PS - 1) / PS;
                CHECKF(h->off_tok_ids - h->off_pages <= ((want < np ? want : np) * 4 + 15) / 16 * 16,
                       "%s: %lld bytes of page ids for %lld", what, (long long)(h->off_tok_ids - h->off_pages),
                       (long long)want);
            }
        }
        cas_cuda_attn_destroy(a);
        cas_attn_plan_destroy(plan);
        lists_free(&L);
    }
    printf("  %d of %d with two shared passes or more\n", multi, n);
    CHECK(multi >= n / 2);
}

/* bad batch descriptions: a random cascade with one field broken (a pass's
 * length, token count or offsets, a page id outside the pool or a token id
 * outside the batch, a misaligned start, a token in no pass, too many
 * passes, bad params) is refused with a message, and the same context then
 * plans the good batch; positions anywhere (before the pass, far past it),
 * a sliding window and no causal mask plan a block that gives every row its
 * keys (check_block) */
static void test_invalid(void) {
    int refused = 0, planned = 0;
    for (int it = 0; it < 300; it++) {
        const int32_t B = 1 + (int32_t)rnd(48), P = (int32_t)rnd(3) == 0 ? 0 : PS * (int32_t)rnd(257);
        int32_t U[48];
        for (int32_t i = 0; i < B; i++) U[i] = 1 + (int32_t)rnd(700);
        batch b;
        batch_make(&b, B, P, U);
        const int wgmma = rnd(4) != 3;
        const cas_attn_shape sh = {HQ, HKV, 128, PS, CAS_BF16};
        cas_cuda_attn_caps caps = {0};
        caps.max_total_q = b.ntok + 1;
        caps.max_passes = b.npass;
        caps.max_tok_rows = 2 * b.ntok;
        caps.max_page_ids = b.npage_ids;
        caps.max_states = 64 * (int64_t)b.ntok;
        cas_cuda_attn *a = NULL;
        if (ctx_create(&a, &sh, &caps, wgmma, 512) != CAS_OK) {
            CHECKF(0, "bad %d: create: %s", it, cas_last_error());
            batch_free(&b);
            continue;
        }
        /* the broken copy */
        cas_attn_pass *ps = malloc(sizeof *ps * (size_t)(b.npass + 1));
        int32_t *pg = malloc(sizeof(int32_t) * (size_t)b.npage_ids), *ids = malloc(sizeof(int32_t) * 2 * (size_t)B),
                *pos = malloc(sizeof(int32_t) * 2 * (size_t)B);
        memcpy(ps, b.passes, sizeof *ps * (size_t)b.npass);
        ps[b.npass] = ps[b.npass - 1];
        memcpy(pg, b.pages, sizeof(int32_t) * (size_t)b.npage_ids);
        memcpy(ids, b.tok_ids, sizeof(int32_t) * 2 * (size_t)B);
        memcpy(pos, b.tok_pos, sizeof(int32_t) * 2 * (size_t)B);
        cas_attn_params pr = cas_attn_params_default();
        int32_t npass = b.npass, total_q = b.ntok;
        cas_attn_pass *x = &ps[rnd((uint32_t)b.npass)];
        const int what = (int)rnd(16);
        const int bad = what < 13;
        switch (what) {
        case 0: x->len = -1 - (int32_t)rnd(100); break;
        case 1: x->len += PS * (b.npage_ids + 1); break; /* past the page ids */
        case 2: x->n_tok = -1; break;
        case 3: x->n_tok = 2 * B + 1 - x->tok_off; break; /* past the token rows */
        case 4: x->tok_off = rnd(2) ? -1 : 2 * B; break;
        case 5: x->page_off = rnd(2) ? -1 : b.npage_ids; break;
        case 6: x->pos0 = rnd(2) ? -PS : x->pos0 + 1 + (int32_t)rnd(PS - 1); break;
        case 7: pg[rnd((uint32_t)b.npages)] = rnd(2) ? -1 : b.npages + (int32_t)rnd(5); break;
        case 8: ids[x->tok_off + (x->n_tok > 0 ? (int32_t)rnd((uint32_t)x->n_tok) : 0)] = rnd(2) ? -1 : total_q; break;
        case 9: total_q++; break; /* token total_q - 1 in no pass */
        case 10: npass++; break;  /* over capacity */
        case 11: pr.window_left = -2 - (int32_t)rnd(5); break;
        case 12: pr.logits_soft_cap = rnd(2) ? -1.f : NAN; break;
        case 13: for (int32_t i = 0; i < B; i++) pos[i] = (int32_t)rnd(3 * (uint32_t)(P + 700)) - 700 + (int32_t)rnd(2) * 1000000000; break;
        case 14: pr.window_left = (int32_t)rnd((uint32_t)(P + 700)); pr.causal = (int)rnd(2); break;
        default: pr.causal = 0; break;
        }
        char msg[96];
        snprintf(msg, sizeof msg, "bad %d (B %d P %d %s) case %d", it, B, P, wgmma ? "wgmma" : "mma.sync", what);
        cas_attn_pass_list l = batch_list(&b, &pr);
        l.n_passes = npass;
        l.passes = ps;
        l.pages = pg;
        l.tok_ids = ids;
        l.tok_pos = pos;
        l.total_q = total_q;
        cas_status st = plan_list(a, &l);
        if (bad) {
            CHECKF(st == CAS_ERR_INVALID || st == CAS_ERR_NOMEM, "%s: status %d", msg, (int)st);
            CHECKF(st == CAS_OK || cas_last_error()[0] != 0, "%s: no message", msg);
            refused += st != CAS_OK;
        } else if (st == CAS_OK && cas_cuda_attn_upload(a, NULL) == CAS_OK) {
            check_block(msg, wgmma);
            planned++;
        } else {
            CHECKF(0, "%s: plan: %s", msg, cas_last_error());
        }
        /* the context still plans the good batch */
        pr = cas_attn_params_default();
        l = batch_list(&b, &pr);
        st = plan_list(a, &l);
        if (st == CAS_OK) st = cas_cuda_attn_upload(a, NULL);
        CHECKF(st == CAS_OK, "%s: the good batch after it: %s", msg, cas_last_error());
        if (st == CAS_OK) {
            check_block(msg, wgmma);
            check_pass_pages(msg, b.passes, b.pages);
        }
        free(ps);
        free(pg);
        free(ids);
        free(pos);
        cas_cuda_attn_destroy(a);
        batch_free(&b);
    }
    printf("  %d refused, %d planned\n", refused, planned);
}

/* odd head counts: with Hq and a pass's tokens odd, a (pass, chunk)'s states and LSEs
 * take an odd count of floats; every split state must still start on 8 bytes (the
 * kernels store pairs of floats) and stay within the scratch the context has */
static void test_odd_heads(void) {
    const int32_t shapes[4][3] = {{3, 1, 128}, {5, 5, 128}, {7, 1, 64}, {6, 2, 128}};
    for (int si = 0; si < 4; si++) {
        const int32_t Hq = shapes[si][0], Hkv = shapes[si][1], D = shapes[si][2];
        for (int wgmma = 0; wgmma < 2; wgmma++) {
            int32_t U[5] = {37, 500, 1, 129, 64};
            batch b;
            batch_make(&b, 5, 4096, U); /* 5 requests: passes of 5 and of 1 token */
            const cas_attn_shape sh = {Hq, Hkv, D, PS, CAS_BF16};
            cas_cuda_attn_caps caps = {0};
            caps.max_total_q = b.ntok;
            caps.max_passes = b.npass;
            caps.max_tok_rows = 2 * b.ntok;
            caps.max_page_ids = b.npage_ids;
            cas_cuda_attn *a = NULL;
            char what[64];
            snprintf(what, sizeof what, "heads %d:%d D %d %s", Hq, Hkv, D, wgmma ? "wgmma" : "mma.sync");
            /* the wgmma kernel takes head_dim 128 only: D 64 plans for mma.sync */
            if (ctx_create(&a, &sh, &caps, wgmma && D == 128, 512) != CAS_OK) {
                CHECKF(0, "%s: create: %s", what, cas_last_error());
                batch_free(&b);
                continue;
            }
            cas_attn_params pr = cas_attn_params_default();
            const cas_attn_pass_list l = batch_list(&b, &pr);
            cas_status st = plan_list(a, &l);
            if (st == CAS_OK) st = cas_cuda_attn_upload(a, NULL);
            CHECKF(st == CAS_OK, "%s: plan: %s", what, cas_last_error());
            if (st == CAS_OK) {
                const char *blk = cas_stub_last_h2d;
                const cas_cuda_plan_hdr *h = (const cas_cuda_plan_hdr *)blk;
                const int64_t tl[2][2] = {{h->off_tasks_wide, h->n_tasks_wide}, {h->off_tasks_narrow, h->n_tasks_narrow}};
                /* the scratch a context of these caps has: a state per token and head, and a
                 * float per (pass, chunk) (cuda_attn.c); max_states 0 means 8 per row */
                const int64_t room = 8 * (int64_t)caps.max_tok_rows * ((int64_t)Hq * (D + 1) + 1);
                int odd = 0, out = 0, split = 0;
                for (int li = 0; li < 2; li++) {
                    const cas_cuda_task *t = (const cas_cuda_task *)(blk + tl[li][0]);
                    for (int64_t i = 0; i < tl[li][1]; i++) {
                        if (t[i].o_off < 0) continue;
                        split++;
                        odd += (t[i].o_off & 1) != 0 || (t[i].lse_off & 1) != 0;
                        const int64_t ntok = ((const cas_cuda_pass *)(blk + h->off_passes))[t[i].pass].n_tok;
                        out += t[i].lse_off + ntok * Hq > room;
                    }
                }
                const int64_t *co = (const int64_t *)(blk + h->off_contrib_o);
                const int32_t *ind = (const int32_t *)(blk + h->off_contrib_indptr);
                for (int32_t m = 0; m < ind[h->n_merge_tok]; m++) odd += (co[m] & 1) != 0;
                CHECKF(split > 0, "%s: no split states (the case should split)", what);
                CHECKF(odd == 0 && out == 0, "%s: %d states on odd offsets, %d past the scratch", what, odd, out);
            }
            cas_cuda_attn_destroy(a);
            batch_free(&b);
        }
    }
}

#ifndef PLAN_TEST_OLD_API
/* the options are checked at create: a kernel the device cannot run, and
 * tuning numbers out of range, are refused with a message */
static void test_options(void) {
    cas_cuda_attn_caps caps = {0};
    caps.max_total_q = caps.max_passes = caps.max_tok_rows = 4;
    caps.max_page_ids = 4;
    cas_cuda_attn *a = NULL;
    cas_attn_shape sh = {HQ, HKV, 64, PS, CAS_BF16};
    cas_cuda_attn_opts o = cas_cuda_attn_opts_default();
    o.kernel = CAS_CUDA_KERNEL_WGMMA; /* head_dim 64: no wgmma kernel */
    CHECK(cas_cuda_attn_create(&a, &sh, &caps, &o) == CAS_ERR_UNSUPPORTED && !a);
    CHECK(strstr(cas_last_error(), "head_dim") != NULL);
    sh.head_dim = 128;
    REQUIRE(cas_cuda_attn_create(&a, &sh, &caps, &o) == CAS_OK);
    CHECK(cas_cuda_attn_kernel(a) == CAS_CUDA_KERNEL_WGMMA && !strcmp(cas_cuda_attn_kernel_name(a), "wgmma"));
    cas_cuda_attn_destroy(a);
    o = cas_cuda_attn_opts_default(); /* AUTO: wgmma on this (stand-in) Hopper at D 128, else mma.sync */
    REQUIRE(cas_cuda_attn_create(&a, &sh, &caps, NULL) == CAS_OK);
    CHECK(cas_cuda_attn_kernel(a) == CAS_CUDA_KERNEL_WGMMA);
    cas_cuda_attn_destroy(a);
    sh.head_dim = 96;
    REQUIRE(cas_cuda_attn_create(&a, &sh, &caps, &o) == CAS_OK);
    CHECK(cas_cuda_attn_kernel(a) == CAS_CUDA_KERNEL_MMA_SYNC);
    cas_cuda_attn_destroy(a);
    o.tail_cost = 0;
    CHECK(cas_cuda_attn_create(&a, &sh, &caps, &o) == CAS_ERR_INVALID && !a);
    o = cas_cuda_attn_opts_default();
    o.tail_mix_len = -1;
    CHECK(cas_cuda_attn_create(&a, &sh, &caps, &o) == CAS_ERR_INVALID && !a);
    o = cas_cuda_attn_opts_default();
    o.kernel = (cas_cuda_kernel)7;
    CHECK(cas_cuda_attn_create(&a, &sh, &caps, &o) == CAS_ERR_INVALID && !a);
}
#endif

/* `test_cuda_plan --time [N [JSON]]`: the host time of planning a decode
 * step on the GPU path for grid shapes, median of N plans (default 200): the
 * CPU planner's cas_attn_plan_build on the batch as the engine gives it
 * (every request's page list, the shared prefix's pages in each; the
 * prefix tree and the cost model, CUDA costs), then
 * cas_cuda_attn_plan_from_cpu + upload (stub runtime) for the wgmma kernel,
 * next to the floor (one memcpy of the batch's page ids, which every plan
 * reads); a table, and JSON to the file JSON where given. Checks nothing. */
static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}
static int cmp_dbl(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}
static double median(double *t, int n) {
    qsort(t, (size_t)n, sizeof *t, cmp_dbl);
    return t[n / 2];
}
static int time_plans(int n, const char *json) {
    const struct {
        int32_t B, P, U;
    } shapes[] = {{64, 32768, 512}, {256, 32768, 128}, {8, 1024, 128}, {128, 16384, 2048}, {64, 0, 4096}};
    const int ns = (int)(sizeof shapes / sizeof *shapes);
    const cas_attn_shape sh = {HQ, HKV, 128, PS, CAS_BF16};
    double *t = malloc(sizeof(double) * (size_t)n);
    FILE *jf = json ? fopen(json, "w") : NULL;
    if (json && !jf) return 1;
    if (jf) {
        /* the machine: /proc/cpuinfo's first model name */
        char cpu[160] = "unknown", line[256];
        FILE *ci = fopen("/proc/cpuinfo", "r");
        while (ci && fgets(line, sizeof line, ci))
            if (strncmp(line, "model name", 10) == 0 && strchr(line, ':')) {
                snprintf(cpu, sizeof cpu, "%s", strchr(line, ':') + 2);
                cpu[strcspn(cpu, "\n\"\\")] = 0;
                break;
            }
        if (ci) fclose(ci);
        fprintf(jf,
                "{\"what\": \"host time of planning one decode step on the GPU path (test_cuda_plan --time, one "
                "thread, stub CUDA runtime: the upload is a memcpy)\", \"cpu\": \"%s\", \"repeats\": %d, \"cases\": [",
                cpu, n);
    }
    printf("%-20s %9s %8s %8s %11s %11s %7s\n", "shape", "page ids", "copy us", "passes", "cpu plan us",
           "cuda plan us", "tasks");
    for (int si = 0; si < ns; si++) {
        const int32_t B = shapes[si].B, P = shapes[si].P, U = shapes[si].U;
        /* the engine's view: request r's pages = the prefix's, then its own */
        const int32_t pp = (P + PS - 1) / PS, up = (U + PS - 1) / PS;
        lists L = lists_make(B, (int64_t)B * (pp + up));
        int32_t *qo = L.qo, *kvp = L.kvp, *last = L.last, *idx = L.idx;
        for (int32_t r = 0; r < B; r++) {
            int32_t k = kvp[r];
            for (int32_t j = 0; j < pp; j++) idx[k++] = j;
            for (int32_t j = 0; j < up; j++) idx[k++] = pp + r * up + j;
            kvp[r + 1] = k;
            last[r] = U - (up - 1) * PS;
            qo[r + 1] = r + 1;
        }
        const cas_attn_batch bt = lists_batch(&L);
        cas_attn_plan_opts po = cas_attn_plan_opts_default();
        po.cost = cas_cuda_attn_cost();
        cas_attn_params pr = cas_attn_params_default();
        cas_attn_plan *plan = NULL;
        if (cas_attn_plan_create(&plan, &sh, &po, B, B, kvp[B]) != CAS_OK) return 1;
        for (int i = 0; i < n; i++) {
            const double t0 = now_us();
            if (cas_attn_plan_build(plan, &bt, pp + B * up, &pr) != CAS_OK) return 1;
            t[i] = now_us() - t0;
        }
        const double cpu_us = median(t, n);
        /* the floor: one copy of the batch's page ids (every plan reads them) */
        int32_t *cp = malloc(sizeof(int32_t) * (size_t)kvp[B]);
        for (int i = 0; i < n; i++) {
            const double t0 = now_us();
            memcpy(cp, idx, sizeof(int32_t) * (size_t)kvp[B]);
            t[i] = now_us() - t0;
            __asm__ volatile("" ::"r"(cp) : "memory");
        }
        const double copy_us = median(t, n);
        free(cp);
        cas_attn_pass_list pl;
        cas_attn_plan_passes(plan, &pl);
        cas_cuda_attn_caps caps = {0};
        caps.max_total_q = B;
        caps.max_passes = pl.n_passes;
        caps.max_tok_rows = pl.n_tok_rows;
        caps.max_page_ids = kvp[B];
        cas_cuda_attn *a = NULL;
        if (ctx_create(&a, &sh, &caps, 1, 512) != CAS_OK) return 1;
        for (int i = 0; i < n; i++) {
            const double t0 = now_us();
            if (cas_cuda_attn_plan_from_cpu(a, plan) != CAS_OK || cas_cuda_attn_upload(a, NULL) != CAS_OK) return 1;
            t[i] = now_us() - t0;
        }
        const double gpu_us = median(t, n);
        cas_cuda_attn_info inf;
        cas_cuda_attn_get_info(a, &inf);
        char nm[32];
        snprintf(nm, sizeof nm, "B%d P%d U%d", B, P, U);
        printf("%-20s %9d %8.1f %8d %11.1f %11.1f %7d\n", nm, kvp[B], copy_us, pl.n_passes, cpu_us, gpu_us,
               inf.tasks_wide + inf.tasks_narrow);
        if (jf)
            fprintf(jf, "%s\n  {\"B\": %d, \"P\": %d, \"U\": %d, \"page_ids\": %d, \"page_ids_copy_us\": %.2f, "
                    "\"passes\": %d, \"cpu_plan_us\": %.2f, \"cuda_plan_us\": %.2f, \"tasks\": %d}",
                    si ? "," : "", B, P, U, kvp[B], copy_us, pl.n_passes, cpu_us, gpu_us,
                    inf.tasks_wide + inf.tasks_narrow);
        cas_cuda_attn_destroy(a);
        cas_attn_plan_destroy(plan);
        lists_free(&L);
    }
    if (jf) {
        fprintf(jf, "\n]}\n");
        fclose(jf);
    }
    free(t);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--time") == 0) return time_plans(argc > 2 ? atoi(argv[2]) : 200, argc > 3 ? argv[3] : NULL);
#ifndef PLAN_TEST_OLD_API
    RUN(test_options);
#endif
    RUN(test_headline);
    RUN(test_random);
    RUN(test_flat);
    RUN(test_trees);
    RUN(test_invalid);
    RUN(test_odd_heads);
    printf("plan digest %016llx\n", (unsigned long long)digest);
    return check_summary();
}
