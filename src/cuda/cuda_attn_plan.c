/*
 * cuda_attn_plan.c: the planner of the CUDA attention backend (C11, host
 * only): a list of passes in, a GPU plan block out, in the context's pinned
 * staging (uploaded by cas_cuda_attn_upload).
 *
 * The steps (cas_cuda_attn_plan_passes):
 *   1. check the passes against the capacities and the pool;
 *   2. split each pass along its KV into chunks (split_passes), so that the
 *      GPU has a couple of waves of CTAs; the many-rows passes get the chunk
 *      length that fills the last wave of their grid best (pick_chunk);
 *   3. decide which tokens are written directly (their only state comes from
 *      one unsplit pass) and give the others scratch states (assign_states);
 *   4. lay out the passes, their page ids and query tokens (write_passes);
 *   5. cut every (pass, chunk) into tasks per KV head and row block, each
 *      task's key range trimmed by the causal and window masks of its rows
 *      (make_tasks); order the lists (order_lists): longest first, stably,
 *      so that row blocks over the same KV run side by side and share L2,
 *      with every other round of a persistent grid reversed; on the wgmma
 *      kernel the decode tails of a cascade join the many-rows list and go to
 *      the CTAs with the least work (arrange_wgmma);
 *   6. write the lists and each merge token's contributions (write_lists,
 *      write_merges) and the header.
 * Nothing here allocates or calls the device but the wait for the previous
 * upload to have read the staging.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_attn_ctx.h"

#define ALIGN16(x) (((x) + 15) & ~(int64_t)15)

int cas_cuda_wide_rows(int wide) {
    return wide == CAS_CUDA_WIDE_WGMMA ? 128 : wide ? 64 : CAS_CUDA_NARROW_ROWS;
}

int64_t cas_cuda_plan_bytes_cap(const cas_cuda_attn_caps *c, int64_t cap_tasks, int64_t cap_states, int64_t grid) {
    int64_t b = ALIGN16((int64_t)sizeof(cas_cuda_plan_hdr));
    b += ALIGN16((grid + 1) * 4); /* wgmma: CTA ranges of the many-rows list */
    b += ALIGN16((int64_t)c->max_passes * (int64_t)sizeof(cas_cuda_pass));
    b += ALIGN16(c->max_page_ids * 4);
    b += 2 * ALIGN16((int64_t)c->max_tok_rows * 4);
    b += 2 * ALIGN16(cap_tasks * (int64_t)sizeof(cas_cuda_task)); /* the two lists */
    b += ALIGN16((int64_t)c->max_total_q * 4) + ALIGN16(((int64_t)c->max_total_q + 1) * 4);
    b += 2 * ALIGN16(cap_states * 8);
    return b + 64;
}

/* Floats of scratch one (pass, chunk) takes: its tokens' states [n_tok][Hq][D], then their
 * LSEs [n_tok][Hq], rounded up to an even count, so that every state starts on 8 bytes (the
 * kernels store pairs of floats; with Hq and n_tok odd the count is odd) */
static int64_t job_stride(int32_t n_tok, int32_t Hq, int32_t D) {
    const int64_t f = (int64_t)n_tok * Hq * (D + 1);
    return f + (f & 1);
}

/* ---- classes of passes ------------------------------------------------------ */

/* Which kernel a pass of `rows` rows per KV head goes to: the narrow one
 * (decode rows) or the many-rows one. */
enum { CLS_NARROW = 0, CLS_WIDE = 1 };
static int pass_class(int64_t rows) { return rows <= CAS_CUDA_NARROW_ROWS ? CLS_NARROW : CLS_WIDE; }
static int class_rows(const cas_cuda_attn *a, int cls) { return cls == CLS_WIDE ? a->wide_rows : CAS_CUDA_NARROW_ROWS; }

/* The passes of class cls into idx (the planner's cls_idx); returns their count. */
static int32_t class_list(const cas_attn_pass_list *l, int32_t group, int cls, int32_t *idx) {
    int32_t n = 0;
    for (int32_t i = 0; i < l->n_passes; i++)
        if (pass_class((int64_t)l->passes[i].n_tok * group) == cls && l->passes[i].len > 0) idx[n++] = i;
    return n;
}

/* ---- step 2: split KV ------------------------------------------------------- */

/* Tasks of class cls (idx: its passes) when passes are split into chunks of
 * about L keys, as split_passes splits them; *maxch: the longest chunk. The
 * split depends on L only through each pass's chunk count; *next (where not
 * NULL): the least L' > L at which one of them changes (INT64_MAX: none
 * does). */
static int64_t class_tasks(const cas_cuda_attn *a, const cas_attn_pass *passes, const int32_t *idx, int32_t nidx,
                           int32_t group, int cls, int64_t L, int64_t *maxch, int64_t *next) {
    int64_t n = 0;
    const int rblk = class_rows(a, cls);
    *maxch = 0;
    if (next) *next = INT64_MAX;
    for (int32_t k = 0; k < nidx; k++) {
        const int32_t i = idx[k];
        int64_t rows = (int64_t)passes[i].n_tok * group, len = passes[i].len;
        int64_t ns = (len + L - 1) / L;
        if (ns > a->caps.max_split) ns = a->caps.max_split;
        /* ceil(len / L') drops below ns from L' = ceil(len / (ns - 1)) on */
        if (next && ns > 1 && (len + ns - 2) / (ns - 1) < *next) *next = (len + ns - 2) / (ns - 1);
        int64_t ch = ((len + ns - 1) / ns + 63) / 64 * 64;
        ns = (len + ch - 1) / ch;
        if (ch > *maxch) *maxch = ch < len ? ch : len;
        n += (rows + rblk - 1) / rblk * a->shape.num_kv_heads * ns;
    }
    return n;
}

/* When a many-rows kernel gets only a few waves of tasks (a shared prefix
 * over a decode batch), its time is waves x chunk: a split that leaves a last
 * wave nearly empty costs a whole chunk. The chunk length (at least 128 keys,
 * so that a small shared pass spreads over more SMs) for the passes of class
 * cls (idx: class_list's) on a persistent grid of `grid` CTAs that minimises
 * that; L if the class has no passes or many waves. */
static int64_t pick_chunk(const cas_cuda_attn *a, const cas_attn_pass *passes, const int32_t *idx, int32_t nidx,
                          int32_t group, int cls, int64_t grid, int64_t L) {
    if (grid <= 0) return L;
    int64_t maxch = 0, nt = class_tasks(a, passes, idx, nidx, group, cls, L, &maxch, NULL);
    if (nt <= 0 || nt >= 8 * grid) return L;
    int64_t best_l = L;
    double best = (double)((nt + grid - 1) / grid) * (double)(maxch + 128);
    int64_t maxlen = 0;
    for (int32_t k = 0; k < nidx; k++)
        if (passes[idx[k]].len > maxlen) maxlen = passes[idx[k]].len;
    /* c in steps of 64; the steps that leave every pass's chunk count as it
     * was are skipped (their cost is the same, and only a lower one counts) */
    for (int64_t c = 128; c <= 4 * L && c <= maxlen + 63;) {
        int64_t mc = 0, nx = 0, n = class_tasks(a, passes, idx, nidx, group, cls, c, &mc, &nx);
        double cost = (double)((n + grid - 1) / grid) * (double)(mc + 128);
        if (cost < best * 0.999) {
            best = cost;
            best_l = c;
        }
        if (nx == INT64_MAX) break;
        c += (nx - c + 63) / 64 * 64;
    }
    return best_l;
}

/* nsplit[i] chunks of chunk[i] keys for every pass: the narrow passes (and
 * the decode tails that join the wgmma list) in chunks of about L keys, L
 * such that the work spreads over two waves of the larger grid, the
 * many-rows passes by pick_chunk; L doubled until the tasks and states fit
 * the capacities. */
static cas_status split_passes(cas_cuda_attn *a, const cas_attn_pass_list *l, int32_t group) {
    const cas_attn_pass *passes = l->passes;
    const int32_t Hkv = a->shape.num_kv_heads;
    int64_t work = 0; /* CTA x keys */
    for (int32_t i = 0; i < l->n_passes; i++) {
        int64_t rows = (int64_t)passes[i].n_tok * group;
        int64_t rblk = class_rows(a, pass_class(rows));
        work += (rows + rblk - 1) / rblk * Hkv * passes[i].len;
    }
    const int occ_max = a->occ_wide > a->occ_narrow ? a->occ_wide : a->occ_narrow;
    const int64_t slots = 2 * (int64_t)a->num_sms * occ_max;
    int64_t L = work / (slots > 0 ? slots : 1);
    if (L < 512) L = 512;
    L = (L + 63) / 64 * 64;
    const int32_t ncls = class_list(l, group, CLS_WIDE, a->cls_idx);
    int64_t Lw = pick_chunk(a, passes, a->cls_idx, ncls, group, CLS_WIDE, a->wide_grid, L);
    for (int iter = 0;; iter++) {
        int64_t n_tasks = 0, n_states = 0;
        for (int32_t i = 0; i < l->n_passes; i++) {
            const int32_t len = passes[i].len;
            const int cls = pass_class((int64_t)passes[i].n_tok * group);
            const int64_t Li = cls == CLS_WIDE ? Lw : L;
            int32_t ns = (int32_t)((len + Li - 1) / Li);
            if (ns < 1) ns = 1;
            if (ns > a->caps.max_split) ns = a->caps.max_split;
            int32_t ch = (int32_t)(((int64_t)(len + ns - 1) / ns + 63) / 64 * 64);
            if (ch < 1) ch = 1;
            ns = len > 0 ? (len + ch - 1) / ch : 1;
            a->nsplit[i] = ns;
            a->chunk[i] = ch;
            int64_t rows = (int64_t)passes[i].n_tok * group, rblk = class_rows(a, cls);
            n_tasks += (rows + rblk - 1) / rblk * Hkv * ns;
            n_states += (int64_t)ns * passes[i].n_tok;
        }
        if (n_tasks <= a->cap_tasks && n_states <= a->cap_states) return CAS_OK;
        if (iter > 40)
            return cas_error(CAS_ERR_NOMEM, "cuda attn plan: %lld tasks / %lld states exceed capacity",
                             (long long)n_tasks, (long long)n_states);
        L *= 2;
        Lw *= 2;
    }
}

/* ---- step 3: direct tokens and scratch states ------------------------------ */

/* cnt[t]: the states token t gets; direct_tok[t]: 1 when its only state
 * comes from an unsplit pass (then written straight into o/lse); job_off[i]:
 * the scratch offset of pass i's first chunk, -1 for a direct pass. */
static cas_status assign_states(cas_cuda_attn *a, const cas_attn_pass_list *l) {
    const int32_t Hq = a->shape.num_qo_heads, D = a->shape.head_dim;
    const int32_t *tok_ids = l->tok_ids;
    for (int32_t t = 0; t < l->total_q; t++) {
        a->cnt[t] = 0;
        a->direct_tok[t] = 0;
    }
    for (int32_t i = 0; i < l->n_passes; i++)
        for (int32_t j = 0; j < l->passes[i].n_tok; j++) a->cnt[tok_ids[l->passes[i].tok_off + j]] += a->nsplit[i];
    for (int32_t t = 0; t < l->total_q; t++)
        if (a->cnt[t] == 0) return cas_error(CAS_ERR_INVALID, "cuda attn plan: token %d is in no pass", t);
    int64_t cur = 0; /* scratch floats */
    for (int32_t i = 0; i < l->n_passes; i++) {
        const cas_attn_pass *p = &l->passes[i];
        int direct = a->nsplit[i] == 1;
        for (int32_t j = 0; direct && j < p->n_tok; j++)
            if (a->cnt[tok_ids[p->tok_off + j]] != 1) direct = 0;
        if (direct) {
            a->job_off[i] = -1;
            for (int32_t j = 0; j < p->n_tok; j++) a->direct_tok[tok_ids[p->tok_off + j]] = 1;
        } else {
            a->job_off[i] = cur;
            cur += (int64_t)a->nsplit[i] * job_stride(p->n_tok, Hq, D);
        }
    }
    if (cur > a->scratch_floats) return cas_error(CAS_ERR_INTERNAL, "cuda attn plan: scratch overflow");
    return CAS_OK;
}

/* ---- step 4: passes, page ids, tokens -------------------------------------- */

/* of the page ids pg[0, n), how many are their predecessor + 1; 16 at a time
 * (a loop of a fixed count, which -O2 vectorizes) */
static int32_t page_steps(const int32_t *pg, int32_t n) {
    int32_t s = 0, j = 1;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++) s += pg[j + k] == pg[j + k - 1] + 1;
    for (; j < n; j++) s += pg[j] == pg[j - 1] + 1;
    return s;
}

/* The passes, their page ids and the tokens into the block from offset
 * *off on. The page ids the passes read go in once per pass where they are
 * fewer than the list's (a CPU plan's passes index every request's page
 * list, the shared prefix in each: B 64 x 32k keys is 133k ids, its passes
 * read 4k); else all of them as given. */
static void write_passes(cas_cuda_attn *a, const cas_attn_pass_list *l, cas_cuda_plan_hdr *h, int64_t *off) {
    char *S = a->stage;
    const int32_t P = a->shape.page_size;
    h->off_passes = *off;
    *off = ALIGN16(*off + (int64_t)l->n_passes * (int64_t)sizeof(cas_cuda_pass));
    int64_t pass_ids = 0;
    for (int32_t i = 0; i < l->n_passes; i++) pass_ids += ((int64_t)l->passes[i].len + P - 1) / P;
    const int compact = pass_ids < l->n_page_ids;
    const int64_t block_ids = compact ? pass_ids : l->n_page_ids;
    h->off_pages = *off;
    *off = ALIGN16(*off + block_ids * 4);
    h->off_tok_ids = *off;
    *off = ALIGN16(*off + (int64_t)l->n_tok_rows * 4);
    h->off_tok_pos = *off;
    *off = ALIGN16(*off + (int64_t)l->n_tok_rows * 4);

    cas_cuda_pass *gp = (cas_cuda_pass *)(S + h->off_passes);
    int32_t *gpages = (int32_t *)(S + h->off_pages);
    for (int32_t i = 0, at = 0; i < l->n_passes; i++) {
        const cas_attn_pass *p = &l->passes[i];
        const int32_t np_i = (int32_t)(((int64_t)p->len + P - 1) / P);
        if (compact) {
            if (np_i) memcpy(gpages + at, l->pages + p->page_off, (size_t)np_i * 4);
            gp[i].page_off = at;
            at += np_i;
        } else {
            gp[i].page_off = p->page_off;
        }
        gp[i].pos0 = p->pos0;
        gp[i].len = p->len;
        gp[i].tok_off = p->tok_off;
        gp[i].n_tok = p->n_tok;
        /* runs: at least half of the page ids are their predecessor + 1 */
        const int32_t nrun = page_steps(l->pages + p->page_off, np_i);
        gp[i].page_runs = np_i > 1 && 2 * nrun >= np_i - 1;
    }
    if (!compact && l->n_page_ids) memcpy(gpages, l->pages, (size_t)l->n_page_ids * 4);
    if (l->n_tok_rows) {
        memcpy(S + h->off_tok_ids, l->tok_ids, (size_t)l->n_tok_rows * 4);
        memcpy(S + h->off_tok_pos, l->tok_pos, (size_t)l->n_tok_rows * 4);
    }
}

/* ---- step 5: tasks ------------------------------------------------------------ */

/* Whether the decode tails (narrow passes) of this plan join the wgmma
 * kernel's list: only beside a many-rows pass (without one there is nothing
 * to run them beside, and the narrow kernel is faster), and a tail only
 * where the tails are at least a grid of unsplit tasks or it is short
 * (opts.tail_mix_len): few long tails ran faster on the narrow kernel. */
typedef struct {
    int on;
    int64_t n_tail_tasks;
} tail_rule;
static tail_rule tails_of(const cas_cuda_attn *a, const cas_attn_pass_list *l, int32_t group) {
    tail_rule r = {0, 0};
    if (a->wide != CAS_CUDA_WIDE_WGMMA) return r;
    for (int32_t i = 0; i < l->n_passes; i++)
        if (pass_class((int64_t)l->passes[i].n_tok * group) == CLS_WIDE && l->passes[i].len > 0) r.on = 1;
    for (int32_t i = 0; i < l->n_passes && r.on; i++)
        if (l->passes[i].n_tok > 0 && pass_class((int64_t)l->passes[i].n_tok * group) == CLS_NARROW)
            r.n_tail_tasks += a->shape.num_kv_heads *
                              (((int64_t)l->passes[i].n_tok * group + CAS_CUDA_NARROW_ROWS - 1) / CAS_CUDA_NARROW_ROWS);
    return r;
}
static int tail_joins(const cas_cuda_attn *a, const tail_rule *r, const cas_attn_pass *p, int32_t group) {
    return r->on && p->n_tok > 0 && pass_class((int64_t)p->n_tok * group) == CLS_NARROW &&
           (r->n_tail_tasks >= a->wide_grid || p->len <= a->opts.tail_mix_len);
}

/* Every (pass, chunk) cut into tasks per row block and KV head, in creation
 * order (seq), into the many-rows list (tw, with the joining tails marked
 * CAS_CUDA_TASK_TAIL) and the narrow list (tn). */
static void make_tasks(cas_cuda_attn *a, const cas_attn_pass_list *l, const cas_attn_params *params, int32_t group,
                       int32_t *nw_out, int32_t *nn_out) {
    const int32_t Hq = a->shape.num_qo_heads, Hkv = a->shape.num_kv_heads, D = a->shape.head_dim;
    const tail_rule tr = tails_of(a, l, group);
    int32_t nw = 0, nn = 0;
    int64_t kv_read = 0;
    for (int32_t i = 0; i < l->n_passes; i++) {
        const cas_attn_pass *p = &l->passes[i];
        const int32_t rows = p->n_tok * group;
        if (rows == 0) continue;
        const int cls = pass_class(rows);
        const int32_t rblk = class_rows(a, cls);
        const int tail = tail_joins(a, &tr, p, group);
        for (int32_t c = 0; c < a->nsplit[i]; c++) {
            int32_t c0 = c * a->chunk[i], c1 = c0 + a->chunk[i];
            if (c1 > p->len) c1 = p->len;
            for (int32_t r0 = 0; r0 < rows; r0 += rblk) {
                int32_t nr = rows - r0 < rblk ? rows - r0 : rblk;
                int32_t pmin = INT32_MAX, pmax = INT32_MIN;
                for (int32_t tk = r0 / group; tk <= (r0 + nr - 1) / group; tk++) {
                    int32_t ps = l->tok_pos[p->tok_off + tk];
                    if (ps < pmin) pmin = ps;
                    if (ps > pmax) pmax = ps;
                }
                int32_t k0 = c0, k1 = c1;
                if (params->causal && (int64_t)pmax - p->pos0 + 1 < k1) k1 = (int32_t)((int64_t)pmax - p->pos0 + 1);
                if (params->window_left >= 0 && (int64_t)pmin - params->window_left - p->pos0 > k0)
                    k0 = (int64_t)pmin - params->window_left - p->pos0 < c1
                             ? (int32_t)((int64_t)pmin - params->window_left - p->pos0)
                             : c1; /* every key of the chunk left of the window: empty, within the chunk */
                if (k1 < k0) k1 = k0;
                for (int32_t hk = 0; hk < Hkv; hk++) {
                    cas_cuda_task t;
                    t.flags = 0;
                    t.pass = i;
                    t.kv_head = hk;
                    t.row0 = r0;
                    t.nrows = nr;
                    t.kv0 = k0;
                    t.kv1 = k1;
                    t.qpos_min = pmin;
                    t.qpos_max = pmax;
                    if (a->job_off[i] < 0) {
                        t.o_off = -1;
                        t.lse_off = -1;
                    } else {
                        int64_t job = a->job_off[i] + (int64_t)c * job_stride(p->n_tok, Hq, D);
                        t.o_off = job;
                        t.lse_off = job + (int64_t)p->n_tok * Hq * D;
                    }
                    kv_read += k1 - k0;
                    if (cls == CLS_WIDE || tail) {
                        if (tail) t.flags = CAS_CUDA_TASK_TAIL;
                        t.seq = nw;
                        a->tw[nw++] = t;
                    } else {
                        t.seq = nn;
                        a->tn[nn++] = t;
                    }
                }
            }
        }
    }
    a->info.kv_tokens_read = kv_read;
    *nw_out = nw;
    *nn_out = nn;
}

static int64_t task_work(const cas_cuda_task *t) { return (int64_t)(t->kv1 - t->kv0) * t->nrows; }
static int cmp_task(const void *x, const void *y) {
    const cas_cuda_task *a = x, *b = y;
    const int64_t ca = task_work(a), cb = task_work(b);
    if (ca != cb) return ca > cb ? -1 : 1;
    return a->seq < b->seq ? -1 : a->seq > b->seq; /* stable */
}
static int bits_of(uint64_t x) {
    int b = 0;
    while (x >> b) b++;
    return b;
}
/* The tasks of src[0, ns) whose flags & fmask are fval into dst (another
 * array) in cmp_task's order, by a radix sort of one 64-bit key a task,
 * (longest - work) above seq, 8 bits a pass (a pass whose digit is the same
 * for all is skipped); qsort where the two do not fit in 64 bits. The keys
 * are distinct (seq is), so the order is qsort's. Returns their count. */
static int32_t sort_tasks(cas_cuda_attn *a, cas_cuda_task *dst, const cas_cuda_task *src, int32_t ns, int32_t fmask,
                          int32_t fval) {
    int64_t maxw = 0, minw = INT64_MAX, maxseq = 0;
    int neg = 0;
    int32_t *x = a->sidx, *x2 = a->sidx + a->cap_tasks, n = 0;
    for (int32_t i = 0; i < ns; i++) {
        if ((src[i].flags & fmask) != fval) continue;
        const int64_t w = task_work(&src[i]);
        if (w > maxw) maxw = w;
        if (w < minw) minw = w;
        if (src[i].seq > maxseq) maxseq = src[i].seq;
        neg |= src[i].seq < 0;
        x[n++] = i;
    }
    const int pb = bits_of((uint64_t)maxseq), kb = n > 0 ? bits_of((uint64_t)(maxw - minw)) : 0;
    if (neg || minw < 0 || pb + kb > 64) {
        for (int32_t i = 0; i < n; i++) dst[i] = src[x[i]];
        qsort(dst, (size_t)n, sizeof *dst, cmp_task);
        return n;
    }
    uint64_t *k = a->skey, *k2 = a->skey + a->cap_tasks;
    for (int32_t i = 0; i < n; i++) k[i] = (uint64_t)(maxw - task_work(&src[x[i]])) << pb | (uint64_t)src[x[i]].seq;
    for (int sh = 0; sh < pb + kb; sh += 8) {
        int32_t c[257] = {0};
        for (int32_t i = 0; i < n; i++) c[(k[i] >> sh & 255) + 1]++;
        int same = 0;
        for (int d = 1; d <= 256; d++) same |= c[d] == n;
        if (same) continue;
        for (int d = 0; d < 256; d++) c[d + 1] += c[d];
        for (int32_t i = 0; i < n; i++) {
            const int32_t j = c[k[i] >> sh & 255]++;
            k2[j] = k[i];
            x2[j] = x[i];
        }
        uint64_t *tk = k;
        k = k2;
        k2 = tk;
        int32_t *tx = x;
        x = x2;
        x2 = tx;
    }
    for (int32_t i = 0; i < n; i++) dst[i] = src[x[i]];
    return n;
}
/* a list sorted in place (through the scratch tp) */
static void sort_list(cas_cuda_attn *a, cas_cuda_task *t, int32_t n) {
    sort_tasks(a, a->tp, t, n, 0, 0);
    memcpy(t, a->tp, sizeof *t * (size_t)n);
}

/* A list that a persistent grid of g CTAs walks with stride g (CTA b takes
 * tasks b, b + g, ...), sorted longest first, with every odd round of g
 * tasks reversed: the CTA that got a round's longest task gets the next
 * round's shortest. Round-robin alone leaves CTA 0 with the longest task of
 * every round: on a 16k causal prefill (4096 tasks of 1 to 128 tiles on 132
 * CTAs) a simulation ends it 3.1% after the mean, the reversed rounds 0.1%
 * (measured: +2.6% TFLOP/s, bench/HISTORY.md). */
static void snake_rounds(cas_cuda_task *t, int32_t n, int32_t g) {
    if (g < 2) return;
    for (int32_t r0 = g; r0 + g <= n; r0 += 2 * g)
        for (int32_t i = 0, j = g - 1; i < j; i++, j--) {
            cas_cuda_task x = t[r0 + i];
            t[r0 + i] = t[r0 + j];
            t[r0 + j] = x;
        }
}

static int tiles_of(const cas_cuda_task *t) { return t->kv1 > t->kv0 ? (t->kv1 - t->kv0 + 127) / 128 : 0; }
static int heap_less(const struct cta_load_ent *x, const struct cta_load_ent *y) {
    return x->load < y->load || (x->load == y->load && x->cta < y->cta);
}
static void heap_down(struct cta_load_ent *hp, int32_t n, int32_t i) {
    const struct cta_load_ent x = hp[i];
    for (;;) {
        const int32_t l = 2 * i + 1, r = l + 1;
        if (l >= n) break;
        const int32_t m = r < n && heap_less(&hp[r], &hp[l]) ? r : l;
        if (!heap_less(&hp[m], &x)) break;
        hp[i] = hp[m];
        i = m;
    }
    hp[i] = x;
}

/* The wgmma kernel's list, tw[0, nw): its shared-pass tasks and the decode
 * tails that joined it (CAS_CUDA_TASK_TAIL). The shared-pass tasks keep the
 * persistent order (longest first, snake rounds: CTA b gets tasks b, b + g,
 * ...); the tails go, longest first, to the CTA with the least work so far
 * (a heap; a task costs its 128-key tiles, a tail's at opts.tail_cost, plus
 * 0.05 for its start). Each CTA runs its shared-pass tasks first, then its
 * tails: the tails take the HBM while the CTAs around them use the tensor
 * cores. The list is rewritten CTA by CTA; cta_ptr[b] is CTA b's first
 * task. */
static void arrange_wgmma(cas_cuda_attn *a, int32_t nw) {
    const int32_t g = a->wide_grid;
    cas_cuda_task *tw = a->tw, *tmp = a->tp;
    int32_t *cta = a->task_cta;
    const int32_t ns = sort_tasks(a, tmp, tw, nw, CAS_CUDA_TASK_TAIL, 0);
    sort_tasks(a, tmp + ns, tw, nw, CAS_CUDA_TASK_TAIL, CAS_CUDA_TASK_TAIL);
    snake_rounds(tmp, ns, g);
    struct cta_load_ent *hp = a->heap;
    for (int32_t b = 0; b < g; b++) hp[b] = (struct cta_load_ent){0.0, b};
    for (int32_t k = 0; k < ns; k++) {
        cta[k] = k % g;
        hp[k % g].load += tiles_of(&tmp[k]) + 0.05;
    }
    for (int32_t i = g / 2 - 1; i >= 0; i--) heap_down(hp, g, i);
    for (int32_t k = ns; k < nw; k++) {
        cta[k] = hp[0].cta;
        hp[0].load += tiles_of(&tmp[k]) * a->opts.tail_cost + 0.05;
        heap_down(hp, g, 0);
    }
    /* by CTA, stably: a CTA's shared-pass tasks (k < ns) come before its tails */
    for (int32_t b = 0; b <= g; b++) a->cta_ptr[b] = 0;
    for (int32_t k = 0; k < nw; k++) a->cta_ptr[cta[k] + 1]++;
    for (int32_t b = 0; b < g; b++) a->cta_ptr[b + 1] += a->cta_ptr[b];
    for (int32_t b = 0; b < g; b++) a->cta_pos[b] = a->cta_ptr[b];
    for (int32_t k = 0; k < nw; k++) {
        cas_cuda_task *t = &tw[a->cta_pos[cta[k]]++];
        *t = tmp[k];
        t->flags = 0;
    }
}

static void order_lists(cas_cuda_attn *a, int32_t nw, int32_t nn) {
    if (a->wide == CAS_CUDA_WIDE_WGMMA) {
        arrange_wgmma(a, nw);
    } else {
        sort_list(a, a->tw, nw);
        snake_rounds(a->tw, nw, a->wide_grid);
    }
    sort_list(a, a->tn, nn);
    snake_rounds(a->tn, nn, a->narrow_grid);
    for (int32_t i = 0; i < nw; i++) a->tw[i].seq = 0;
    for (int32_t i = 0; i < nn; i++) a->tn[i].seq = 0;
}

/* ---- step 6: the lists and the merges into the block ---------------------- */

static void write_lists(cas_cuda_attn *a, cas_cuda_plan_hdr *h, int64_t *off, int32_t nw, int32_t nn) {
    char *S = a->stage;
    h->off_tasks_wide = *off;
    memcpy(S + *off, a->tw, (size_t)nw * sizeof(cas_cuda_task));
    *off = ALIGN16(*off + (int64_t)nw * (int64_t)sizeof(cas_cuda_task));
    h->off_tasks_narrow = *off;
    memcpy(S + *off, a->tn, (size_t)nn * sizeof(cas_cuda_task));
    *off = ALIGN16(*off + (int64_t)nn * (int64_t)sizeof(cas_cuda_task));
    h->off_cta_ptr = *off;
    if (a->wide == CAS_CUDA_WIDE_WGMMA) {
        memcpy(S + *off, a->cta_ptr, ((size_t)a->wide_grid + 1) * 4);
        *off = ALIGN16(*off + ((int64_t)a->wide_grid + 1) * 4);
    }
    h->n_tasks_wide = nw;
    h->n_tasks_narrow = nn;
}

/* Every token that is not written directly, and its contributions: the
 * scratch offsets of its states' o and lse (contrib_indptr, CSR). */
static cas_status write_merges(cas_cuda_attn *a, const cas_attn_pass_list *l, cas_cuda_plan_hdr *h, int64_t *off) {
    char *S = a->stage;
    const int32_t Hq = a->shape.num_qo_heads, D = a->shape.head_dim;
    int32_t nm = 0;
    for (int32_t t = 0; t < l->total_q; t++)
        if (!a->direct_tok[t]) nm++;
    h->off_merge_tok = *off;
    *off = ALIGN16(*off + (int64_t)nm * 4);
    h->off_contrib_indptr = *off;
    *off = ALIGN16(*off + ((int64_t)nm + 1) * 4);
    int32_t *mtok = (int32_t *)(S + h->off_merge_tok);
    int32_t *ind = (int32_t *)(S + h->off_contrib_indptr);
    int32_t ncontrib = 0;
    nm = 0;
    ind[0] = 0;
    for (int32_t t = 0; t < l->total_q; t++) {
        a->fill[t] = -1;
        if (a->direct_tok[t]) continue;
        mtok[nm] = t;
        a->fill[t] = ncontrib; /* next free slot of t's list */
        ncontrib += a->cnt[t];
        ind[++nm] = ncontrib;
    }
    h->off_contrib_o = *off;
    *off = ALIGN16(*off + (int64_t)ncontrib * 8);
    h->off_contrib_lse = *off;
    *off = ALIGN16(*off + (int64_t)ncontrib * 8);
    if (*off > a->cap_bytes) return cas_error(CAS_ERR_INTERNAL, "cuda attn plan: block overflow");
    int64_t *co = (int64_t *)(S + h->off_contrib_o);
    int64_t *cl = (int64_t *)(S + h->off_contrib_lse);
    for (int32_t i = 0; i < l->n_passes; i++) {
        if (a->job_off[i] < 0) continue;
        const cas_attn_pass *p = &l->passes[i];
        for (int32_t c = 0; c < a->nsplit[i]; c++) {
            int64_t job = a->job_off[i] + (int64_t)c * job_stride(p->n_tok, Hq, D);
            for (int32_t j = 0; j < p->n_tok; j++) {
                int32_t t = l->tok_ids[p->tok_off + j];
                int32_t slot = a->fill[t]++;
                co[slot] = job + (int64_t)j * Hq * D;
                cl[slot] = job + (int64_t)p->n_tok * Hq * D + (int64_t)j * Hq;
            }
        }
    }
    h->n_merge_tok = nm;
    a->info.merge_tokens = nm;
    a->info.contribs = ncontrib;
    return CAS_OK;
}

/* ---- step 1 and the whole --------------------------------------------------- */

/* nonzero if one of the page ids pg[0, n) lies outside 0 .. np - 1 (as
 * unsigned, a negative id is too large; 16 at a time, which -O2 vectorizes) */
static uint32_t ids_outside(const int32_t *pg, int64_t n, int32_t np) {
    uint32_t out = 0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++) out |= (uint32_t)pg[j + k] >= (uint32_t)np;
    for (; j < n; j++) out |= (uint32_t)pg[j] >= (uint32_t)np;
    return out;
}

static cas_status check_passes(const cas_cuda_attn *a, const cas_attn_pass_list *l, const cas_attn_params *params) {
    const cas_cuda_attn_caps *cp = &a->caps;
    if (l->n_passes > cp->max_passes || l->n_tok_rows > cp->max_tok_rows || l->total_q > cp->max_total_q ||
        l->n_page_ids > cp->max_page_ids || l->n_passes < 0 || l->total_q < 0 || l->n_tok_rows < 0)
        return cas_error(CAS_ERR_NOMEM,
                         "cuda attn plan: over capacity (passes %d/%d, token rows %d/%d, tokens "
                         "%d/%d, page ids %lld/%lld)",
                         l->n_passes, cp->max_passes, l->n_tok_rows, cp->max_tok_rows, l->total_q,
                         cp->max_total_q, (long long)l->n_page_ids, (long long)cp->max_page_ids);
    if (params->window_left < -1 || !(params->logits_soft_cap >= 0.f) || !(params->sm_scale >= 0.f))
        return cas_error(CAS_ERR_INVALID, "cuda attn plan: bad params");
    const int32_t P = a->shape.page_size;
    for (int32_t i = 0; i < l->n_passes; i++) {
        const cas_attn_pass *p = &l->passes[i];
        int64_t np = ((int64_t)p->len + P - 1) / P;
        if (p->len < 0 || p->n_tok < 0 || p->pos0 < 0 || p->pos0 % P || p->page_off < 0 ||
            p->page_off + np > l->n_page_ids || p->tok_off < 0 || p->tok_off + p->n_tok > l->n_tok_rows)
            return cas_error(CAS_ERR_INVALID, "cuda attn plan: pass %d out of range", i);
        if (ids_outside(l->pages + p->page_off, np, l->num_pages))
            for (int64_t j = 0; j < np; j++)
                if (l->pages[p->page_off + j] < 0 || l->pages[p->page_off + j] >= l->num_pages)
                    return cas_error(CAS_ERR_INVALID, "cuda attn plan: pass %d page id %d outside pool", i,
                                     l->pages[p->page_off + j]);
        for (int32_t j = 0; j < p->n_tok; j++)
            if (l->tok_ids[p->tok_off + j] < 0 || l->tok_ids[p->tok_off + j] >= l->total_q)
                return cas_error(CAS_ERR_INVALID, "cuda attn plan: pass %d token id out of range", i);
    }
    return CAS_OK;
}

cas_status cas_cuda_attn_plan_passes(cas_cuda_attn *a, const cas_attn_pass_list *l) {
    if (!a || !l || (l->n_passes > 0 && (!l->passes || !l->tok_ids || !l->tok_pos)))
        return cas_error(CAS_ERR_INVALID, "cuda attn plan: NULL argument");
    const cas_attn_params *params = &l->params;
    const int32_t group = a->shape.num_qo_heads / a->shape.num_kv_heads;
    cas_status st = check_passes(a, l, params);
    if (st) return st;

    /* wait until the previous upload has read the staging */
    CAS_CUDA_CHECK(cudaEventSynchronize(a->upload_done));

    if ((st = split_passes(a, l, group)) || (st = assign_states(a, l))) return st;
    cas_cuda_plan_hdr *h = (cas_cuda_plan_hdr *)a->stage;
    memset(h, 0, sizeof *h);
    int64_t off = ALIGN16((int64_t)sizeof *h);
    write_passes(a, l, h, &off);
    int32_t nw = 0, nn = 0;
    make_tasks(a, l, params, group, &nw, &nn);
    order_lists(a, nw, nn);
    write_lists(a, h, &off, nw, nn);
    if ((st = write_merges(a, l, h, &off))) return st;

    h->n_passes = l->n_passes;
    h->total_q = l->total_q;
    h->causal = params->causal ? 1 : 0;
    h->window_left = params->window_left;
    h->scale = cas_attn_scale(&a->shape, params);
    h->scale_log2 = h->scale * 1.4426950408889634f;
    h->soft_cap = params->logits_soft_cap;
    h->group = group;
    h->block_bytes = off;

    a->info.passes = l->n_passes;
    a->info.tasks_wide = nw;
    a->info.tasks_narrow = nn;
    a->info.plan_bytes = off;
    return CAS_OK;
}

cas_status cas_cuda_attn_plan_flat(cas_cuda_attn *a, const cas_attn_batch *b, int32_t num_pages,
                                   const cas_attn_params *params) {
    if (!a) return cas_error(CAS_ERR_INVALID, "cuda attn plan: NULL context");
    cas_status st = cas_attn_validate(&a->shape, b, num_pages, params);
    if (st) return st;
    const int32_t B = b->batch, P = a->shape.page_size;
    const int32_t total_q = B ? b->qo_indptr[B] : 0;
    if (B > a->caps.max_passes || total_q > a->caps.max_tok_rows || total_q > a->caps.max_total_q)
        return cas_error(CAS_ERR_NOMEM, "cuda attn plan: batch of %d (%d tokens) over capacity", B,
                         total_q);
    for (int32_t r = 0; r < B; r++) {
        int32_t q0 = b->qo_indptr[r], ql = b->qo_indptr[r + 1] - q0;
        int32_t kv_len = (b->kv_indptr[r + 1] - b->kv_indptr[r] - 1) * P + b->kv_last_page_len[r];
        cas_attn_pass *p = &a->flat_passes[r];
        p->page_off = b->kv_indptr[r];
        p->pos0 = 0;
        p->len = kv_len;
        p->tok_off = q0;
        p->n_tok = ql;
        p->node = -1;
        for (int32_t i = 0; i < ql; i++) {
            a->flat_ids[q0 + i] = q0 + i;
            a->flat_pos[q0 + i] = kv_len - ql + i;
        }
    }
    cas_attn_pass_list l;
    memset(&l, 0, sizeof l);
    l.shape = a->shape;
    l.params = *params;
    l.num_pages = num_pages;
    l.total_q = total_q;
    l.n_passes = B;
    l.passes = a->flat_passes;
    l.pages = b->kv_indices;
    l.n_page_ids = B ? b->kv_indptr[B] : 0;
    l.tok_ids = a->flat_ids;
    l.tok_pos = a->flat_pos;
    l.n_tok_rows = total_q;
    return cas_cuda_attn_plan_passes(a, &l);
}

cas_status cas_cuda_attn_plan_from_cpu(cas_cuda_attn *a, const cas_attn_plan *plan) {
    if (!a || !plan) return cas_error(CAS_ERR_INVALID, "cuda attn plan: NULL argument");
    cas_attn_pass_list l;
    cas_attn_plan_passes(plan, &l);
    const cas_attn_shape *s = &l.shape;
    if (s->num_qo_heads != a->shape.num_qo_heads || s->num_kv_heads != a->shape.num_kv_heads ||
        s->head_dim != a->shape.head_dim || s->page_size != a->shape.page_size || s->kv_dtype != a->shape.kv_dtype)
        return cas_error(CAS_ERR_INVALID, "cuda attn plan: CPU plan has another shape");
    return cas_cuda_attn_plan_passes(a, &l);
}
