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
 */
#include "sched.h"

#include <stdlib.h>
#include <string.h>

enum { REQ_WAITING = 0, REQ_RUNNING = 1 };

typedef struct {
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

struct cas_sched {
    cas_kv *kv;
    cas_sched_opts o;
    int32_t ps, debug;
    uint64_t next_arrival;

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
    if (!s->waiting || !s->running || !s->items || !s->plan_reqs || !s->tok || !s->pos ||
        !s->slot || !s->qo_indptr || !s->kv_indptr || !s->kv_indices || !s->last_len ||
        !s->preempted) {
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

static int32_t chunk_of(const cas_sched *s, int32_t runnable, int32_t budget) {
    int32_t n = runnable < budget ? runnable : budget;
    if (s->o.max_prefill_chunk > 0 && n > s->o.max_prefill_chunk) n = s->o.max_prefill_chunk;
    return n;
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

    /* pass 2: prefill chunks of running requests, in order */
    for (int32_t i = 0; i < s->n_running; i++) {
        sched_req *r = s->running[i];
        if (r->in_plan) continue;
        if ((st = cas_kv_seq_ready(kv, r->seq, &run, &wait)) != CAS_OK) return st;
        if (run == 0) {
            if (wait) s->n_wait_shared++;
            continue;
        }
        if (budget == 0) continue;
        int32_t n = chunk_of(s, run, budget);
        if ((st = schedule(s, r, n)) != CAS_OK) return st;
        budget -= n;
    }

    /* pass 3: admission in order (not in a step that had to preempt: the
     * blocks just freed would be taken back at once) */
    while (s->n_preempted == 0 && s->n_waiting > 0 && s->n_running < s->o.max_seqs && budget > 0) {
        sched_req *r = s->waiting[0];
        int32_t seq;
        cas_kv_match m;
        st = cas_kv_seq_create(kv, r->tokens, r->n_tokens, &seq, &m);
        if (st == CAS_ERR_NOMEM) break; /* the head waits for blocks (strict FCFS) */
        if (st != CAS_OK) return cas_error(CAS_ERR_INTERNAL, "sched: %s", cas_last_error());
        remove_at(s->waiting, &s->n_waiting, 0);
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
        int32_t n = chunk_of(s, run, budget);
        if ((st = schedule(s, r, n)) != CAS_OK) return st;
        budget -= n;
    }

    s->in_step = 1;
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
