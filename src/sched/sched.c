/*
 * sched.c: continuous batching over the kv block manager (see sched.h for
 * the contract). Requests live in two arrays kept in service order (priority
 * when enabled, then arrival): waiting and running. A step is planned in
 * three passes (blocks and decodes, prefill chunks, admission) into buffers
 * sized once at creation for the worst step, so planning allocates nothing;
 * only cas_sched_add allocates (the request and its token array, sized for
 * prompt + max_new_tokens so that appending sampled tokens never allocates).
 *
 * The kv layer does the block-level work: prefix matching at admission,
 * pending shared blocks (cas_kv_seq_ready says how far a request may run),
 * claims and commits. This file only decides who runs how much and who is
 * preempted, and lays the result out as the attention core's batch.
 *
 * Prefill is handed out in two steps: the candidates are collected first
 * (running requests with tokens left, then admissions), each claiming its
 * runnable range at once so that a later candidate's cas_kv_seq_ready sees it
 * as the filler of any block both could compute; then every candidate's
 * grant is laid out. The step cost model (sched.h) is a non-negative least
 * squares over five terms, solved by trying every subset of terms (31
 * systems of at most 5 unknowns) at each observation.
 */
#include "sched.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { REQ_WAITING = 0, REQ_RUNNING = 1 };

typedef struct sched_req_s {
    int64_t id;
    int32_t priority;
    uint64_t arrival;     /* order of cas_sched_add calls */
    int32_t *tokens;      /* [n_prompt + max_new]: prompt, then generated */
    int32_t n_prompt, n_tokens, max_new, n_generated;
    int32_t hi_computed;  /* most tokens ever computed (recompute accounting) */
    int32_t seq;          /* kv sequence while running, else -1 */
    int32_t state;
    int32_t in_plan;      /* in the plan in flight */
    int32_t abort_pending;
    int32_t n_preempt;
} sched_req;

/* The cost model's terms, in the order of cas_sched_cost's fields. */
enum { CF_STEP, CF_TOKEN, CF_SAMPLE, CF_PAIR, CF_KV, CF_N };

/* Features are scaled to about 1 for a typical step before they enter the
 * normal equations, so that their sums stay well conditioned. */
static const double cf_scale[CF_N] = {1.0, 1.0 / 512, 1.0 / 64, 1.0 / (1 << 21), 1.0 / (1 << 16)};

/* Each kind of step forgets with this factor per step of its kind. */
#define COST_DECAY 0.98
/* Steps observed before predictions are trusted enough to clip outliers. */
#define COST_WARM 16
/* An observed step counts at most this many times its prediction (a step the
 * OS descheduled must not teach the model that everything got slower). */
#define COST_CLIP 4.0
/* Long waiting requests the admission scan passes over in one step. */
#define MAX_SKIPS 64

/* Decayed normal equations of one kind of step: sum of x x^T, x y, y^2. */
typedef struct {
    double xx[CF_N][CF_N], xy[CF_N], yy;
    int64_t n;
} cost_sums;

/* A prefill candidate of the step being planned. */
typedef struct {
    struct sched_req_s *r;
    int32_t q0;      /* its computed tokens: the first position it would run */
    int32_t run;     /* tokens it may run now */
    int32_t n;       /* tokens granted */
    int32_t is_long;
} pf_cand;

/* What is left of a step's budget while prefill is handed out. */
typedef struct {
    int32_t tok;     /* tokens */
    int32_t reserve; /* tokens held back for the first long prefill */
    double t;        /* seconds (INFINITY: no time target this step) */
    double reserve_t; /* and the seconds, already taken off t */
    int32_t cut;     /* a grant was cut by time */
} pf_budget;

struct cas_sched {
    cas_kv *kv;
    cas_sched_opts o;
    int32_t ps, debug;
    uint64_t next_arrival;
    int32_t long_tokens;

    sched_req **waiting; /* [cap_waiting], service order */
    int32_t n_waiting, cap_waiting;
    sched_req **running; /* [max_seqs], service order */
    int32_t n_running;

    /* plan buffers, sized for the worst step */
    int32_t in_step;
    int32_t n_items, n_tok, n_preempted, n_wait_shared, max_bps;
    cas_sched_item *items;  /* [max_seqs] */
    sched_req **plan_reqs;  /* [max_seqs] */
    int32_t *tok, *pos, *slot;           /* [budget] */
    int32_t *qo_indptr, *kv_indptr;      /* [max_seqs + 1] */
    int32_t *kv_indices;                 /* [max_seqs * max_bps] */
    int32_t *last_len;                   /* [max_seqs] */
    int64_t *preempted;                  /* [max_seqs] */
    pf_cand *cand;                       /* [max_seqs] prefill candidates */

    /* the step cost model */
    cost_sums sums[2];       /* [0] steps without prefill tokens, [1] with */
    double w[CF_N];          /* seconds per unscaled unit of each term */
    int32_t cost_fixed;      /* 1: w was set, observations do not change it */
    double plan_x[CF_N];     /* the unscaled terms of the plan in flight */
    int32_t plan_prefill;    /* it has prefill tokens */
    int32_t observable;      /* a plan with items awaits its time */

    cas_sched_stats st;
};

cas_sched_opts cas_sched_opts_default(void) {
    cas_sched_opts o;
    memset(&o, 0, sizeof o);
    o.max_tokens_per_step = 2048;
    o.max_seqs = 64;
    o.max_context = 0; /* from the pool */
    o.max_prefill_chunk = 0;
    o.use_priority = 0;
    o.debug_checks = 0;
    o.max_itl_ms = 0;
    o.long_prefill_tokens = 0; /* 4% of max_context */
    return o;
}

/* Does a come before b in service order? */
static int req_before(const cas_sched *s, const sched_req *a, const sched_req *b) {
    if (s->o.use_priority && a->priority != b->priority) return a->priority > b->priority;
    return a->arrival < b->arrival;
}

/* Inserts r into arr[0..*n) at its place in service order (capacity checked
 * by the caller). */
static void insert_ordered(const cas_sched *s, sched_req **arr, int32_t *n, sched_req *r) {
    int32_t lo = 0, hi = *n;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (req_before(s, r, arr[mid])) hi = mid; else lo = mid + 1;
    }
    memmove(arr + lo + 1, arr + lo, (size_t)(*n - lo) * sizeof *arr);
    arr[lo] = r;
    (*n)++;
}

static void remove_at(sched_req **arr, int32_t *n, int32_t i) {
    memmove(arr + i, arr + i + 1, (size_t)(*n - i - 1) * sizeof *arr);
    (*n)--;
}

static int32_t find_in(sched_req *const *arr, int32_t n, int64_t id) {
    for (int32_t i = 0; i < n; i++)
        if (arr[i]->id == id) return i;
    return -1;
}

static void req_free(sched_req *r) {
    if (!r) return;
    free(r->tokens);
    free(r);
}

/* ---- create / destroy ------------------------------------------------------ */

cas_status cas_sched_create(cas_kv *kv, const cas_sched_opts *opts, cas_sched **out) {
    if (!kv || !opts || !out) return cas_error(CAS_ERR_INVALID, "sched_create: NULL argument");
    *out = NULL;
    cas_sched_opts o = *opts;
    int64_t cap_tokens = (int64_t)cas_kv_max_blocks_per_seq(kv) * cas_kv_page_size(kv);
    if (o.max_context == 0) o.max_context = (int32_t)cap_tokens;
    if (o.max_tokens_per_step < 1 || o.max_seqs < 1 || o.max_context < 1 || o.max_prefill_chunk < 0)
        return cas_error(CAS_ERR_INVALID,
                         "sched_create: max_tokens_per_step (%d), max_seqs (%d) and max_context "
                         "(%d) must be >= 1, max_prefill_chunk (%d) >= 0",
                         o.max_tokens_per_step, o.max_seqs, o.max_context, o.max_prefill_chunk);
    if (!(o.max_itl_ms >= 0 && o.max_itl_ms <= 1e7f))
        return cas_error(CAS_ERR_INVALID, "sched_create: max_itl_ms must be in [0, 1e7] (got %g)",
                         (double)o.max_itl_ms);
    if (o.max_seqs > cas_kv_max_seqs(kv))
        return cas_error(CAS_ERR_INVALID, "sched_create: max_seqs %d > the pool's %d sequences",
                         o.max_seqs, cas_kv_max_seqs(kv));
    if (o.max_context > cap_tokens)
        return cas_error(CAS_ERR_INVALID,
                         "sched_create: max_context %d > the pool's block-table capacity %lld",
                         o.max_context, (long long)cap_tokens);
    cas_sched *s = calloc(1, sizeof *s);
    if (!s) return cas_error(CAS_ERR_NOMEM, "sched_create: out of memory");
    s->kv = kv;
    s->o = o;
    s->ps = cas_kv_page_size(kv);
    s->debug = o.debug_checks != 0;
    s->long_tokens = o.long_prefill_tokens < 0   ? INT32_MAX
                     : o.long_prefill_tokens > 0 ? o.long_prefill_tokens
                                                 : (o.max_context / 25 > 1 ? o.max_context / 25 : 1);
    s->max_bps = cas_kv_blocks_for(kv, o.max_context);
    size_t ms = (size_t)o.max_seqs, bud = (size_t)o.max_tokens_per_step;
    s->cap_waiting = 64;
    s->waiting = malloc((size_t)s->cap_waiting * sizeof *s->waiting);
    s->running = malloc(ms * sizeof *s->running);
    s->items = malloc(ms * sizeof *s->items);
    s->plan_reqs = malloc(ms * sizeof *s->plan_reqs);
    s->tok = malloc(bud * sizeof(int32_t));
    s->pos = malloc(bud * sizeof(int32_t));
    s->slot = malloc(bud * sizeof(int32_t));
    s->qo_indptr = malloc((ms + 1) * sizeof(int32_t));
    s->kv_indptr = malloc((ms + 1) * sizeof(int32_t));
    s->kv_indices = malloc(ms * (size_t)s->max_bps * sizeof(int32_t));
    s->last_len = malloc(ms * sizeof(int32_t));
    s->preempted = malloc(ms * sizeof(int64_t));
    s->cand = malloc(ms * sizeof *s->cand);
    if (!s->waiting || !s->running || !s->items || !s->plan_reqs || !s->tok || !s->pos ||
        !s->slot || !s->qo_indptr || !s->kv_indptr || !s->kv_indices || !s->last_len ||
        !s->preempted || !s->cand) {
        cas_sched_destroy(s);
        return cas_error(CAS_ERR_NOMEM, "sched_create: out of memory for the plan buffers");
    }
    s->qo_indptr[0] = s->kv_indptr[0] = 0;
    *out = s;
    return CAS_OK;
}

void cas_sched_destroy(cas_sched *s) {
    if (!s) return;
    for (int32_t i = 0; s->running && i < s->n_running; i++) {
        cas_kv_seq_free(s->kv, s->running[i]->seq);
        req_free(s->running[i]);
    }
    for (int32_t i = 0; s->waiting && i < s->n_waiting; i++) req_free(s->waiting[i]);
    free(s->waiting);
    free(s->running);
    free(s->items);
    free(s->plan_reqs);
    free(s->tok);
    free(s->pos);
    free(s->slot);
    free(s->qo_indptr);
    free(s->kv_indptr);
    free(s->kv_indices);
    free(s->last_len);
    free(s->preempted);
    free(s->cand);
    free(s);
}

/* ---- requests ---------------------------------------------------------------- */

cas_status cas_sched_add(cas_sched *s, int64_t id, const int32_t *prompt, int32_t n_prompt,
                         int32_t max_new_tokens, int32_t priority) {
    if (!s) return cas_error(CAS_ERR_INVALID, "sched_add: NULL scheduler");
    cas_status err = CAS_OK;
    if (n_prompt < 1 || !prompt)
        err = cas_error(CAS_ERR_INVALID, "request %lld: empty prompt", (long long)id);
    else if (max_new_tokens < 1)
        err = cas_error(CAS_ERR_INVALID, "request %lld: max_new_tokens %d < 1", (long long)id,
                        max_new_tokens);
    else if ((int64_t)n_prompt + max_new_tokens > s->o.max_context)
        err = cas_error(CAS_ERR_INVALID,
                        "request %lld: prompt of %d tokens + max_new_tokens %d exceeds the "
                        "context of %d tokens",
                        (long long)id, n_prompt, max_new_tokens, s->o.max_context);
    else if (find_in(s->waiting, s->n_waiting, id) >= 0 || find_in(s->running, s->n_running, id) >= 0)
        err = cas_error(CAS_ERR_INVALID, "request %lld: id already in use", (long long)id);
    else {
        for (int32_t i = 0; i < n_prompt; i++)
            if (prompt[i] < 0) {
                err = cas_error(CAS_ERR_INVALID, "request %lld: token %d is negative (%d)",
                                (long long)id, i, prompt[i]);
                break;
            }
    }
    if (err == CAS_OK) {
        /* the most KV it can ever hold: the last sampled token is never computed */
        int32_t need = cas_kv_blocks_for(s->kv, (int64_t)n_prompt + max_new_tokens - 1);
        if (need > cas_kv_num_blocks(s->kv))
            err = cas_error(CAS_ERR_NOMEM,
                            "request %lld: needs up to %d KV blocks, the pool has %d: it can "
                            "never fit",
                            (long long)id, need, cas_kv_num_blocks(s->kv));
    }
    if (err != CAS_OK) {
        s->st.rejected++;
        return err;
    }
    /* waiting must hold every live request: preemption moves running ones
     * back without allocating */
    if (s->n_waiting + s->n_running >= s->cap_waiting) {
        int32_t cap = s->cap_waiting * 2;
        sched_req **w = realloc(s->waiting, (size_t)cap * sizeof *w);
        if (!w) return cas_error(CAS_ERR_NOMEM, "sched_add: out of memory");
        s->waiting = w;
        s->cap_waiting = cap;
    }
    sched_req *r = calloc(1, sizeof *r);
    int32_t *t = malloc(((size_t)n_prompt + (size_t)max_new_tokens) * sizeof(int32_t));
    if (!r || !t) {
        free(r);
        free(t);
        return cas_error(CAS_ERR_NOMEM, "sched_add: out of memory");
    }
    memcpy(t, prompt, (size_t)n_prompt * sizeof(int32_t));
    r->id = id;
    r->priority = priority;
    r->arrival = s->next_arrival++;
    r->tokens = t;
    r->n_prompt = r->n_tokens = n_prompt;
    r->max_new = max_new_tokens;
    r->seq = -1;
    r->state = REQ_WAITING;
    insert_ordered(s, s->waiting, &s->n_waiting, r);
    return CAS_OK;
}

/* Removes running request r (at index i) and frees it and its blocks. */
static void drop_running(cas_sched *s, int32_t i) {
    sched_req *r = s->running[i];
    cas_kv_seq_free(s->kv, r->seq);
    remove_at(s->running, &s->n_running, i);
    req_free(r);
}

cas_status cas_sched_abort(cas_sched *s, int64_t id) {
    if (!s) return cas_error(CAS_ERR_INVALID, "sched_abort: NULL scheduler");
    int32_t i = find_in(s->waiting, s->n_waiting, id);
    if (i >= 0) {
        req_free(s->waiting[i]);
        remove_at(s->waiting, &s->n_waiting, i);
        s->st.aborted++;
        return CAS_OK;
    }
    i = find_in(s->running, s->n_running, id);
    if (i < 0) return cas_error(CAS_ERR_INVALID, "sched_abort: unknown request %lld", (long long)id);
    sched_req *r = s->running[i];
    if (r->in_plan) {
        r->abort_pending = 1; /* its pages are being written: freed at step_done */
        return CAS_OK;
    }
    drop_running(s, i);
    s->st.aborted++;
    return CAS_OK;
}

/* ---- the step cost model --------------------------------------------------- */

static double cost_of(const double *w, const double *x) {
    double t = 0;
    for (int k = 0; k < CF_N; k++) t += w[k] * x[k];
    return t;
}

/* Solves m z = r for the leading k x k block in place (Gaussian elimination
 * with partial pivoting); 0 when singular. */
static int solve_small(double m[CF_N][CF_N], double *r, int k) {
    for (int c = 0; c < k; c++) {
        int p = c;
        for (int i = c + 1; i < k; i++)
            if (fabs(m[i][c]) > fabs(m[p][c])) p = i;
        if (!(fabs(m[p][c]) > 1e-300)) return 0;
        if (p != c) {
            for (int j = 0; j < k; j++) {
                double t = m[c][j];
                m[c][j] = m[p][j];
                m[p][j] = t;
            }
            double t = r[c];
            r[c] = r[p];
            r[p] = t;
        }
        for (int i = c + 1; i < k; i++) {
            double f = m[i][c] / m[c][c];
            for (int j = c; j < k; j++) m[i][j] -= f * m[c][j];
            r[i] -= f * r[c];
        }
    }
    for (int c = k - 1; c >= 0; c--) {
        double t = r[c];
        for (int j = c + 1; j < k; j++) t -= m[c][j] * r[j];
        r[c] = t / m[c][c];
    }
    return 1;
}

/* Refits s->w: the least-squares solution with every coefficient >= 0, found
 * by solving the normal equations restricted to each subset of the terms and
 * keeping the feasible one with the smallest residual. Each subset is scaled
 * to a unit diagonal and gets a tiny ridge, so terms that never varied apart
 * (decode steps alone: one token, one sample per row) still give a solution. */
static void cost_fit(cas_sched *s) {
    double xx[CF_N][CF_N], xy[CF_N], yy = s->sums[0].yy + s->sums[1].yy;
    for (int i = 0; i < CF_N; i++) {
        xy[i] = s->sums[0].xy[i] + s->sums[1].xy[i];
        for (int j = 0; j < CF_N; j++) xx[i][j] = s->sums[0].xx[i][j] + s->sums[1].xx[i][j];
    }
    double best = INFINITY, bw[CF_N] = {0};
    for (int mask = 1; mask < (1 << CF_N); mask++) {
        int idx[CF_N], k = 0, ok = 1;
        for (int j = 0; j < CF_N && ok; j++)
            if (mask >> j & 1) {
                if (!(xx[j][j] > 0)) ok = 0;
                idx[k++] = j;
            }
        if (!ok) continue;
        double m[CF_N][CF_N], r[CF_N], d[CF_N], w[CF_N] = {0};
        for (int i = 0; i < k; i++) d[i] = 1.0 / sqrt(xx[idx[i]][idx[i]]);
        for (int i = 0; i < k; i++) {
            r[i] = xy[idx[i]] * d[i];
            for (int j = 0; j < k; j++) m[i][j] = xx[idx[i]][idx[j]] * d[i] * d[j] + (i == j ? 1e-9 : 0.0);
        }
        if (!solve_small(m, r, k)) continue;
        for (int i = 0; i < k && ok; i++) {
            w[idx[i]] = r[i] * d[i];
            if (!(w[idx[i]] >= 0)) ok = 0;
        }
        if (!ok) continue;
        double rss = yy;
        for (int i = 0; i < CF_N; i++) {
            rss -= 2 * w[i] * xy[i];
            for (int j = 0; j < CF_N; j++) rss += w[i] * w[j] * xx[i][j];
        }
        if (rss < best) {
            best = rss;
            memcpy(bw, w, sizeof bw);
        }
    }
    for (int j = 0; j < CF_N; j++) s->w[j] = bw[j] * cf_scale[j];
}

cas_status cas_sched_observe(cas_sched *s, double seconds) {
    if (!s) return cas_error(CAS_ERR_INVALID, "sched_observe: NULL scheduler");
    if (!(seconds >= 0) || !isfinite(seconds))
        return cas_error(CAS_ERR_INVALID, "sched_observe: step time %g s", seconds);
    if (!s->observable || s->in_step)
        return cas_error(CAS_ERR_INVALID, "sched_observe: no finished step since the last report");
    s->observable = 0;
    double y = seconds, pred = cost_of(s->w, s->plan_x);
    if (s->st.observations >= COST_WARM && pred > 0 && y > COST_CLIP * pred) y = COST_CLIP * pred;
    cost_sums *c = &s->sums[s->plan_prefill];
    double x[CF_N];
    for (int k = 0; k < CF_N; k++) x[k] = s->plan_x[k] * cf_scale[k];
    for (int i = 0; i < CF_N; i++) {
        c->xy[i] = COST_DECAY * c->xy[i] + x[i] * y;
        for (int j = 0; j < CF_N; j++) c->xx[i][j] = COST_DECAY * c->xx[i][j] + x[i] * x[j];
    }
    c->yy = COST_DECAY * c->yy + y * y;
    c->n++;
    s->st.observations++;
    if (!s->cost_fixed) cost_fit(s);
    return CAS_OK;
}

void cas_sched_get_cost(const cas_sched *s, cas_sched_cost *c) {
    c->step_s = s->w[CF_STEP];
    c->token_s = s->w[CF_TOKEN];
    c->sample_s = s->w[CF_SAMPLE];
    c->pair_s = s->w[CF_PAIR];
    c->kv_s = s->w[CF_KV];
}

cas_status cas_sched_set_cost(cas_sched *s, const cas_sched_cost *c) {
    if (!s) return cas_error(CAS_ERR_INVALID, "sched_set_cost: NULL scheduler");
    if (!c) {
        s->cost_fixed = 0;
        cost_fit(s);
        return CAS_OK;
    }
    const double w[CF_N] = {c->step_s, c->token_s, c->sample_s, c->pair_s, c->kv_s};
    for (int k = 0; k < CF_N; k++)
        if (!(w[k] >= 0) || !isfinite(w[k]))
            return cas_error(CAS_ERR_INVALID, "sched_set_cost: coefficient %d is %g", k, w[k]);
    memcpy(s->w, w, sizeof w);
    s->cost_fixed = 1;
    return CAS_OK;
}

/* ---- planning -------------------------------------------------------------- */

/* Moves the last running request back to waiting, freeing its blocks. */
static void preempt_last(cas_sched *s) {
    sched_req *v = s->running[s->n_running - 1];
    cas_kv_seq_free(s->kv, v->seq);
    v->seq = -1;
    v->state = REQ_WAITING;
    v->n_preempt++;
    s->n_running--;
    insert_ordered(s, s->waiting, &s->n_waiting, v);
    s->preempted[s->n_preempted++] = v->id;
    s->st.preemptions++;
    cas_log(CAS_LOG_DEBUG, "sched: preempted request %lld (%d tokens, %d generated)",
            (long long)v->id, v->n_tokens, v->n_generated);
}

/* Adds n tokens of running request r to the plan. */
static cas_status schedule(cas_sched *s, sched_req *r, int32_t n) {
    cas_kv *kv = s->kv;
    int32_t start = cas_kv_seq_num_computed(kv, r->seq);
    cas_status st = cas_kv_seq_claim(kv, r->seq, n);
    if (st != CAS_OK) return cas_error(CAS_ERR_INTERNAL, "sched: %s", cas_last_error());
    const int32_t *blocks = cas_kv_seq_blocks(kv, r->seq);
    int32_t k = s->n_items, ps = s->ps;
    cas_sched_item *it = &s->items[k];
    it->id = r->id;
    it->seq = r->seq;
    it->q_start = start;
    it->q_len = n;
    it->sample = start + n == r->n_tokens;
    for (int32_t p = start; p < start + n; p++) {
        s->tok[s->n_tok] = r->tokens[p];
        s->pos[s->n_tok] = p;
        s->slot[s->n_tok] = blocks[p / ps] * ps + p % ps;
        s->n_tok++;
        if (p < r->n_prompt) s->st.prompt_tokens_computed++;
        else s->st.decode_tokens++;
        if (p < r->hi_computed) s->st.recomputed_tokens++;
    }
    s->plan_x[CF_TOKEN] += n;
    if (it->sample) s->plan_x[CF_SAMPLE] += 1;
    if (n == 1) s->plan_x[CF_KV] += start + 1;
    else s->plan_x[CF_PAIR] += (double)n * start + (double)n * (n + 1) / 2;
    int32_t kv_len = start + n, nb = (kv_len + ps - 1) / ps;
    memcpy(s->kv_indices + s->kv_indptr[k], blocks, (size_t)nb * sizeof(int32_t));
    s->kv_indptr[k + 1] = s->kv_indptr[k] + nb;
    s->qo_indptr[k + 1] = s->qo_indptr[k] + n;
    s->last_len[k] = kv_len - (nb - 1) * ps;
    s->plan_reqs[k] = r;
    r->in_plan = 1;
    s->n_items++;
    s->st.scheduled_tokens += n;
    return CAS_OK;
}

/* Predicted seconds of n prefill tokens of r from position from: the tokens,
 * their causal attention, and a sampled row when they end r's known tokens. */
static double chunk_cost(const cas_sched *s, const sched_req *r, int32_t from, int32_t n) {
    double t = s->w[CF_TOKEN] * n + s->w[CF_PAIR] * ((double)n * from + (double)n * (n + 1) / 2);
    if (from + n == r->n_tokens) t += s->w[CF_SAMPLE];
    return t;
}

/* The most tokens, up to max_n, of r from position from that fit t seconds. */
static int32_t fit_tokens(const cas_sched *s, const sched_req *r, int32_t from, int32_t max_n, double t) {
    if (chunk_cost(s, r, from, max_n) <= t) return max_n;
    int32_t lo = 0, hi = max_n - 1; /* the cost grows with n */
    while (lo < hi) {
        int32_t mid = lo + (hi - lo + 1) / 2;
        if (chunk_cost(s, r, from, mid) <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Makes r a prefill candidate with run tokens it may compute now, claiming
 * them at once (see the top of this file). */
static cas_status add_cand(cas_sched *s, sched_req *r, int32_t run, int32_t *nc) {
    if (cas_kv_seq_claim(s->kv, r->seq, run) != CAS_OK)
        return cas_error(CAS_ERR_INTERNAL, "sched: %s", cas_last_error());
    pf_cand *c = &s->cand[(*nc)++];
    c->r = r;
    c->q0 = cas_kv_seq_num_computed(s->kv, r->seq);
    c->run = run;
    c->n = 0;
    c->is_long = r->n_tokens - c->q0 > s->long_tokens;
    return CAS_OK;
}

/* Grants candidate c up to want more tokens: what the token budget (less the
 * reserve), max_prefill_chunk and the time left allow, but at least floor
 * tokens where the budget has them, whatever the time says. */
static void grant(const cas_sched *s, pf_budget *b, pf_cand *c, int32_t want, int32_t floor) {
    int32_t n = want, avail = b->tok - b->reserve;
    if (n > avail) n = avail;
    if (s->o.max_prefill_chunk > 0 && n > s->o.max_prefill_chunk - c->n) n = s->o.max_prefill_chunk - c->n;
    if (n <= 0) return;
    if (isfinite(b->t)) {
        const int32_t from = c->q0 + c->n;
        int32_t fit = fit_tokens(s, c->r, from, n, b->t);
        if (fit < n) b->cut = 1;
        if (floor > n) floor = n;
        n = fit > floor ? fit : floor;
        b->t -= chunk_cost(s, c->r, from, n);
    }
    b->tok -= n;
    c->n += n;
}

/* Holds back for long candidate c (the oldest long prefill) half of the
 * step's prefill budget b0, in tokens and, with a time target, in seconds
 * (at least one token), but no more than what b still has: short prefills
 * come first but cannot take it all. */
static void reserve_long(const cas_sched *s, pf_budget *b, const pf_budget *b0, const pf_cand *c) {
    int32_t n = c->run, half = b0->tok / 2 > 1 ? b0->tok / 2 : 1;
    if (n > half) n = half;
    if (n > b->tok) n = b->tok;
    if (s->o.max_prefill_chunk > 0 && n > s->o.max_prefill_chunk) n = s->o.max_prefill_chunk;
    if (n <= 0) return;
    if (isfinite(b->t)) {
        const double t = b0->t / 2 < b->t ? b0->t / 2 : b->t;
        const int32_t fit = fit_tokens(s, c->r, c->q0, n, t);
        n = fit > 1 ? fit : 1;
        b->reserve_t = chunk_cost(s, c->r, c->q0, n);
        b->t -= b->reserve_t;
    }
    b->reserve = n;
}

cas_status cas_sched_step_plan(cas_sched *s, cas_sched_plan *plan) {
    if (!s || !plan) return cas_error(CAS_ERR_INVALID, "sched_step_plan: NULL argument");
    if (s->in_step)
        return cas_error(CAS_ERR_INVALID, "sched_step_plan: the previous plan was not finished "
                                          "with step_done");
    memset(plan, 0, sizeof *plan);
    cas_kv *kv = s->kv;
    cas_status st;
    s->n_items = s->n_tok = s->n_preempted = s->n_wait_shared = 0;
    memset(s->plan_x, 0, sizeof s->plan_x);
    s->plan_x[CF_STEP] = 1;
    int32_t budget = s->o.max_tokens_per_step;
    int32_t run, wait;

    /* pass 1: blocks for tokens sampled last step (preempting from the back
     * when the pool is dry), and decodes */
    for (int32_t i = 0; i < s->n_running; i++) {
        sched_req *r = s->running[i];
        int32_t have = cas_kv_seq_num_tokens(kv, r->seq);
        if (have < r->n_tokens) {
            for (;;) {
                st = cas_kv_seq_append(kv, r->seq, r->tokens + have, r->n_tokens - have);
                if (st == CAS_OK) break;
                if (st != CAS_ERR_NOMEM) return cas_error(CAS_ERR_INTERNAL, "sched: %s", cas_last_error());
                sched_req *victim = s->running[s->n_running - 1];
                preempt_last(s);
                if (victim == r) break;
            }
            if (r->state != REQ_RUNNING) break; /* it was the last one */
        }
        if (budget == 0) continue;
        if ((st = cas_kv_seq_ready(kv, r->seq, &run, &wait)) != CAS_OK) return st;
        if (run == 1 && r->n_tokens - cas_kv_seq_num_computed(kv, r->seq) == 1) {
            if ((st = schedule(s, r, 1)) != CAS_OK) return st;
            budget--;
        }
    }

    /* pass 2: prefill, short ones first (sched.h). The time the target
     * leaves after the decodes, and never less than half the longer of the
     * target and the decodes' own time. */
    pf_budget b = {budget, 0, INFINITY, 0, 0};
    if (s->o.max_itl_ms > 0 && s->n_items > 0) {
        const double target = (double)s->o.max_itl_ms * 1e-3, base = cost_of(s->w, s->plan_x);
        const double floor = 0.5 * (base > target ? base : target);
        b.t = target - base > floor ? target - base : floor;
    }
    const pf_budget b0 = b;
    int32_t nc = 0, first_long = -1, have_short = 0;
    for (int32_t i = 0; i < s->n_running; i++) {
        sched_req *r = s->running[i];
        if (r->in_plan) continue;
        if ((st = cas_kv_seq_ready(kv, r->seq, &run, &wait)) != CAS_OK) return st;
        if (run == 0) {
            if (wait) s->n_wait_shared++;
            continue;
        }
        if ((st = add_cand(s, r, run, &nc)) != CAS_OK) return st;
    }
    /* the oldest long prefill's share is held back from the short ones; the
     * first short one runs at least a token whatever the time says */
    for (int32_t k = 0; k < nc && first_long < 0; k++)
        if (s->cand[k].is_long) {
            first_long = k;
            reserve_long(s, &b, &b0, &s->cand[k]);
        }
    for (int32_t k = 0; k < nc; k++)
        if (!s->cand[k].is_long) {
            grant(s, &b, &s->cand[k], s->cand[k].run, have_short ? 0 : 1);
            have_short = 1;
        }

    /* pass 3: admission in order (not in a step that had to preempt: the
     * blocks just freed would be taken back at once), of requests that would
     * run this step or wait on blocks others compute; long ones wait while a
     * long prefill is in progress, unless the long ones admitted could all
     * finish in what is left of this step (then the next gets the rest) */
    int32_t at = 0, skips = 0, long_tok = 0;
    double long_t = 0;
    for (int32_t k = 0; k < nc; k++)
        if (s->cand[k].is_long) {
            long_tok += s->cand[k].run;
            long_t += chunk_cost(s, s->cand[k].r, s->cand[k].q0, s->cand[k].run);
        }
    while (s->n_preempted == 0 && at < s->n_waiting && s->n_running < s->o.max_seqs &&
           b.tok - b.reserve > 0) {
        sched_req *r = s->waiting[at];
        cas_kv_match m;
        cas_kv_match_peek(kv, r->tokens, r->n_tokens, &m);
        const int is_long = r->n_tokens - m.hit_tokens - m.pending_tokens > s->long_tokens;
        if (is_long && first_long >= 0 && (long_tok >= b.tok || (isfinite(b.t) && long_t >= b.t))) {
            if (++skips > MAX_SKIPS) break;
            at++;
            continue;
        }
        if (!is_long && m.pending_tokens == 0 && have_short && isfinite(b.t) &&
            chunk_cost(s, r, m.hit_tokens, 1) > b.t)
            break; /* no time left for it, and the first short one ran */
        int32_t seq;
        st = cas_kv_seq_create(kv, r->tokens, r->n_tokens, &seq, &m);
        if (st == CAS_ERR_NOMEM) break; /* it waits for blocks, and those behind it (FCFS) */
        if (st != CAS_OK) return cas_error(CAS_ERR_INTERNAL, "sched: %s", cas_last_error());
        remove_at(s->waiting, &s->n_waiting, at);
        r->seq = seq;
        r->state = REQ_RUNNING;
        insert_ordered(s, s->running, &s->n_running, r);
        cas_log(CAS_LOG_DEBUG, "sched: admitted request %lld: %d tokens, %d cached, %d pending",
                (long long)r->id, r->n_tokens, m.hit_tokens, m.pending_tokens);
        if ((st = cas_kv_seq_ready(kv, seq, &run, &wait)) != CAS_OK) return st;
        if (run == 0) {
            if (wait) s->n_wait_shared++;
            continue;
        }
        if ((st = add_cand(s, r, run, &nc)) != CAS_OK) return st;
        pf_cand *c = &s->cand[nc - 1];
        if (!c->is_long) {
            grant(s, &b, c, c->run, have_short ? 0 : 1);
            have_short = 1;
            continue;
        }
        if (first_long < 0) {
            first_long = nc - 1;
            reserve_long(s, &b, &b0, c);
        }
        long_tok += c->run;
        long_t += chunk_cost(s, r, c->q0, c->run);
    }

    /* long prefills get what is left, in order; the first at least its share */
    for (int32_t k = 0; k < nc; k++) {
        pf_cand *c = &s->cand[k];
        if (!c->is_long) continue;
        int32_t floor = 0;
        if (k == first_long) {
            floor = b.reserve;
            b.reserve = 0;
            b.t += b.reserve_t;
        }
        grant(s, &b, c, c->run - c->n, floor);
    }
    for (int32_t k = 0; k < nc; k++)
        if (s->cand[k].n > 0 && (st = schedule(s, s->cand[k].r, s->cand[k].n)) != CAS_OK) return st;
    if (b.cut) s->st.time_limited_steps++;

    s->in_step = 1;
    s->observable = s->n_items > 0;
    s->plan_prefill = s->plan_x[CF_PAIR] > 0;
    if (s->n_items > 0) s->st.steps++;
    plan->n_items = s->n_items;
    plan->items = s->items;
    plan->n_tokens = s->n_tok;
    plan->token_ids = s->tok;
    plan->positions = s->pos;
    plan->slots = s->slot;
    plan->qo_indptr = s->qo_indptr;
    plan->kv_indptr = s->kv_indptr;
    plan->kv_indices = s->kv_indices;
    plan->kv_last_page_len = s->last_len;
    plan->n_preempted = s->n_preempted;
    plan->preempted_ids = s->preempted;
    plan->n_waiting_shared = s->n_wait_shared;
    plan->predicted_s = s->n_items > 0 ? cost_of(s->w, s->plan_x) : 0.0;
    plan->time_limited = b.cut;
    if (s->debug && (st = cas_sched_check(s)) != CAS_OK) {
        cas_log(CAS_LOG_ERROR, "sched: invariant broken after step_plan: %s", cas_last_error());
        return st;
    }
    return CAS_OK;
}

cas_status cas_sched_step_done(cas_sched *s, const int32_t *sampled, const uint8_t *stop,
                               uint8_t *finished) {
    if (!s) return cas_error(CAS_ERR_INVALID, "sched_step_done: NULL scheduler");
    if (!s->in_step) return cas_error(CAS_ERR_INVALID, "sched_step_done: no plan in flight");
    for (int32_t k = 0; k < s->n_items; k++) {
        if (!s->items[k].sample || s->plan_reqs[k]->abort_pending) continue;
        if (!sampled)
            return cas_error(CAS_ERR_INVALID, "sched_step_done: item %d needs a sampled token", k);
        if (sampled[k] < 0)
            return cas_error(CAS_ERR_INVALID, "sched_step_done: item %d: sampled token %d", k,
                             sampled[k]);
    }
    cas_status first = CAS_OK;
    for (int32_t k = 0; k < s->n_items; k++) {
        sched_req *r = s->plan_reqs[k];
        const cas_sched_item *it = &s->items[k];
        int32_t code = CAS_SCHED_RUNNING;
        r->in_plan = 0;
        int32_t idx = find_in(s->running, s->n_running, r->id);
        CAS_ASSERT(idx >= 0);
        if (r->abort_pending) {
            drop_running(s, idx);
            s->st.aborted++;
            if (finished) finished[k] = CAS_SCHED_ABORTED;
            continue;
        }
        cas_status st = cas_kv_seq_commit(s->kv, r->seq, it->q_len);
        if (st != CAS_OK && first == CAS_OK) first = cas_error(CAS_ERR_INTERNAL, "sched: %s", cas_last_error());
        if (it->q_start + it->q_len > r->hi_computed) r->hi_computed = it->q_start + it->q_len;
        if (it->sample) {
            r->tokens[r->n_tokens++] = sampled[k];
            r->n_generated++;
            if (stop && stop[k]) code = CAS_SCHED_FINISHED_STOP;
            else if (r->n_generated >= r->max_new) code = CAS_SCHED_FINISHED_LENGTH;
            if (code != CAS_SCHED_RUNNING) {
                drop_running(s, idx);
                s->st.finished++;
            }
        }
        if (finished) finished[k] = (uint8_t)code;
    }
    s->in_step = 0;
    if (first != CAS_OK) return first;
    cas_status st;
    if (s->debug && (st = cas_sched_check(s)) != CAS_OK) {
        cas_log(CAS_LOG_ERROR, "sched: invariant broken after step_done: %s", cas_last_error());
        return st;
    }
    return CAS_OK;
}

/* ---- inspection ----------------------------------------------------------- */

cas_status cas_sched_get(const cas_sched *s, int64_t id, cas_sched_req_info *info) {
    if (!s || !info) return cas_error(CAS_ERR_INVALID, "sched_get: NULL argument");
    const sched_req *r = NULL;
    int32_t i = find_in(s->waiting, s->n_waiting, id);
    if (i >= 0) r = s->waiting[i];
    else if ((i = find_in(s->running, s->n_running, id)) >= 0) r = s->running[i];
    if (!r) return cas_error(CAS_ERR_INVALID, "sched_get: unknown request %lld", (long long)id);
    info->state = r->state;
    info->n_prompt = r->n_prompt;
    info->n_generated = r->n_generated;
    info->n_computed = r->seq >= 0 ? cas_kv_seq_num_computed(s->kv, r->seq) : 0;
    info->n_preemptions = r->n_preempt;
    info->priority = r->priority;
    return CAS_OK;
}

void cas_sched_get_stats(const cas_sched *s, cas_sched_stats *st) {
    *st = s->st;
    st->running = s->n_running;
    st->waiting = s->n_waiting;
}

#define SCHED_BAD(...) return cas_error(CAS_ERR_INTERNAL, "sched_check: " __VA_ARGS__)

cas_status cas_sched_check(const cas_sched *s) {
    if (!s) return cas_error(CAS_ERR_INVALID, "sched_check: NULL scheduler");
    if (s->n_running > s->o.max_seqs) SCHED_BAD("%d running > max_seqs %d", s->n_running, s->o.max_seqs);
    for (int32_t i = 0; i < s->n_running; i++) {
        const sched_req *r = s->running[i];
        if (r->state != REQ_RUNNING || r->seq < 0)
            SCHED_BAD("running request %lld: state %d, seq %d", (long long)r->id, r->state, r->seq);
        if (i > 0 && req_before(s, r, s->running[i - 1]))
            SCHED_BAD("running request %lld out of order", (long long)r->id);
        for (int32_t j = 0; j < i; j++)
            if (s->running[j]->seq == r->seq) SCHED_BAD("two running requests hold sequence %d", r->seq);
        int32_t n = cas_kv_seq_num_tokens(s->kv, r->seq);
        if (n < 0 || n > r->n_tokens)
            SCHED_BAD("request %lld: kv sequence %d holds %d tokens of %d", (long long)r->id,
                      r->seq, n, r->n_tokens);
        if (n < r->n_tokens - 1)
            SCHED_BAD("request %lld: kv sequence lags %d tokens", (long long)r->id, r->n_tokens - n);
        for (int32_t p = 0; p < n; p++)
            if (cas_kv_seq_token(s->kv, r->seq, p) != r->tokens[p])
                SCHED_BAD("request %lld: kv token %d differs", (long long)r->id, p);
        if (!s->in_step && r->in_plan) SCHED_BAD("request %lld in a finished plan", (long long)r->id);
    }
    for (int32_t i = 0; i < s->n_waiting; i++) {
        const sched_req *r = s->waiting[i];
        if (r->state != REQ_WAITING || r->seq >= 0 || r->in_plan)
            SCHED_BAD("waiting request %lld: state %d, seq %d", (long long)r->id, r->state, r->seq);
        if (i > 0 && req_before(s, r, s->waiting[i - 1]))
            SCHED_BAD("waiting request %lld out of order", (long long)r->id);
    }
    cas_kv_stats ks;
    cas_kv_get_stats(s->kv, &ks);
    if (ks.seqs_active != s->n_running)
        SCHED_BAD("%d kv sequences active, %d requests running", ks.seqs_active, s->n_running);
    return cas_kv_check(s->kv);
}
