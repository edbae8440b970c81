/*
 * test_sched.c: the scheduler, driven by a fake engine. The fake engine keeps
 * one 64-bit value per KV slot: running token p writes mix(value at p-1, token)
 * into p's slot, read through the plan's block table, and "samples" a token
 * from the last value. So a request's outputs are a function of its own
 * tokens only, and any wrong page (a stale block, another prefix, a block read
 * before it was computed, a bad slot) changes them; the test keeps the
 * expected chain of every request and compares every slot read and written.
 * Covered: bad input, chunked prefill, decodes first, token budget and
 * sequence limit every step, FCFS and priority, aborts (waiting, running, in
 * flight), stop, the step protocol, cold-cache sharing arithmetic (64 x 2000
 * prefix), and long random workloads on tiny pools (preemption, resume,
 * shared prefixes) that must end with every request finished and every block
 * free. The kv and scheduler invariant checkers run every step.
 *
 * Prefill under an inter-token latency target: a fake clock (a cost model
 * the test writes out again, set with cas_sched_set_cost or fed through
 * cas_sched_observe) checks that chunks beside decodes are the most tokens
 * whose predicted time fits the target, that prefill keeps its share when
 * the decodes alone fill the target, that short prompts arriving every step
 * cannot starve a long one, that a step without decodes takes the whole
 * budget, that a short prompt runs in the step after it arrives while
 * a long one is mid-prefill (and waits with plain FCFS), that the fitted
 * model finds the clock's coefficients and ignores one absurd step, and the
 * random workloads again with a target.
 */
#include "../src/sched/sched.h"
#include "check.h"

#include <math.h>
#include <string.h>

#define VOCAB 1000
#define SEED0 0x5eed5eedull

static uint64_t mix(uint64_t h, int32_t t) {
    uint64_t z = h ^ ((uint64_t)(uint32_t)t * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int32_t sample_of(uint64_t v) { return (int32_t)((v >> 11) % VOCAB); }

typedef struct {
    int used, done, code;
    int32_t *tok;
    uint64_t *chain; /* value after each token */
    int32_t n, nprompt, max_new, ngen;
} treq;

typedef struct {
    cas_kv *kv;
    cas_sched *s;
    int32_t ps, nb, budget, max_seqs;
    uint64_t *mem;
    int64_t *stamp;
    int64_t step;
    treq *r;
    int nreq;
    double stop_p;
    cas_rng rng;
    int bad;       /* first failure message printed once */
    int verify;    /* check every slot read */
    int64_t live;  /* requests added, not done */
    int64_t wait_shared; /* sum of plan.n_waiting_shared */
    int32_t *sampled;
    uint8_t *stop, *fin;
    /* a fake clock: when on, every step "takes" the time this cost model
     * gives its plan, and the scheduler is told (cas_sched_observe) */
    int clock_on;
    cas_sched_cost clock;
    double clock_noise; /* relative: time *= 1 + noise * uniform(-1, 1) */
    double last_s;      /* the last step's fake time */
} sim;

/* The scheduler's opts of a sim (debug checks on). */
static cas_sched_opts sim_opts(int32_t max_seqs, int32_t budget, int32_t max_context, int32_t chunk, int prio) {
    cas_sched_opts so = cas_sched_opts_default();
    so.max_tokens_per_step = budget;
    so.max_seqs = max_seqs;
    so.max_context = max_context;
    so.max_prefill_chunk = chunk;
    so.use_priority = prio;
    so.debug_checks = 1;
    return so;
}

static int sim_init_opts(sim *m, int32_t nb, int32_t ps, int prefix_cache, int nreq, const cas_sched_opts *so) {
    memset(m, 0, sizeof *m);
    cas_kv_opts ko = cas_kv_opts_default();
    ko.num_blocks = nb;
    ko.page_size = ps;
    ko.max_seqs = so->max_seqs;
    ko.max_blocks_per_seq = (so->max_context + ps - 1) / ps;
    ko.enable_prefix_cache = prefix_cache;
    if (cas_kv_create(&ko, &m->kv) != CAS_OK) return 0;
    if (cas_sched_create(m->kv, so, &m->s) != CAS_OK) return 0;
    int32_t max_seqs = so->max_seqs, budget = so->max_tokens_per_step;
    m->ps = ps;
    m->nb = nb;
    m->budget = budget;
    m->max_seqs = max_seqs;
    m->mem = calloc((size_t)nb * ps, sizeof *m->mem);
    m->stamp = calloc((size_t)nb * ps, sizeof *m->stamp);
    for (size_t i = 0; i < (size_t)nb * ps; i++) m->stamp[i] = -1;
    m->r = calloc((size_t)nreq, sizeof *m->r);
    m->nreq = nreq;
    m->sampled = calloc((size_t)max_seqs, sizeof *m->sampled);
    m->stop = calloc((size_t)max_seqs, 1);
    m->fin = calloc((size_t)max_seqs, 1);
    m->verify = 1;
    cas_rng_seed(&m->rng, 99);
    return 1;
}

static int sim_init(sim *m, int32_t nb, int32_t ps, int32_t max_seqs, int32_t budget,
                    int32_t max_context, int32_t chunk, int prio, int prefix_cache, int nreq) {
    cas_sched_opts so = sim_opts(max_seqs, budget, max_context, chunk, prio);
    return sim_init_opts(m, nb, ps, prefix_cache, nreq, &so);
}

/* The cost model of sched.h, written out again here: seconds of a plan. */
static double plan_seconds(const cas_sched_cost *c, const cas_sched_plan *p) {
    double t = c->step_s;
    for (int i = 0; i < p->n_items; i++) {
        const cas_sched_item *it = &p->items[i];
        double n = it->q_len, q0 = it->q_start;
        t += c->token_s * n + (it->sample ? c->sample_s : 0.0);
        if (it->q_len == 1) t += c->kv_s * (q0 + 1);
        else t += c->pair_s * (n * q0 + n * (n + 1) / 2);
    }
    return t;
}

static void sim_free(sim *m) {
    cas_sched_destroy(m->s);
    cas_kv_destroy(m->kv);
    for (int i = 0; i < m->nreq; i++) {
        free(m->r[i].tok);
        free(m->r[i].chain);
    }
    free(m->r);
    free(m->mem);
    free(m->stamp);
    free(m->sampled);
    free(m->stop);
    free(m->fin);
}

static void treq_push(treq *t, int32_t tok) {
    uint64_t prev = t->n ? t->chain[t->n - 1] : SEED0;
    t->tok[t->n] = tok;
    t->chain[t->n] = mix(prev, tok);
    t->n++;
}

static cas_status sim_add(sim *m, int id, const int32_t *prompt, int32_t n, int32_t max_new,
                          int32_t prio) {
    cas_status st = cas_sched_add(m->s, id, prompt, n, max_new, prio);
    if (st != CAS_OK) return st;
    treq *t = &m->r[id];
    t->used = 1;
    t->tok = malloc(((size_t)n + (size_t)max_new) * sizeof *t->tok);
    t->chain = malloc(((size_t)n + (size_t)max_new) * sizeof *t->chain);
    t->nprompt = n;
    t->max_new = max_new;
    for (int32_t i = 0; i < n; i++) treq_push(t, prompt[i]);
    m->live++;
    return CAS_OK;
}

#define SIM_FAIL(...)                                                                  \
    do {                                                                               \
        if (!m->bad) {                                                                 \
            printf("step %lld: ", (long long)m->step);                                 \
            printf(__VA_ARGS__);                                                       \
            printf("\n");                                                              \
        }                                                                              \
        m->bad = 1;                                                                    \
        CHECK(0);                                                                      \
        return -1;                                                                     \
    } while (0)

/* One engine step. Returns the number of items run, -1 on a failure. abort_id
 * >= 0 aborts that request between plan and done. */
static int sim_step(sim *m, cas_sched_plan *out, int abort_id) {
    cas_sched_plan p;
    cas_status st = cas_sched_step_plan(m->s, &p);
    if (st != CAS_OK) SIM_FAIL("step_plan: %s", cas_last_error());
    m->wait_shared += p.n_waiting_shared;
    if (out) *out = p;
    int32_t ps = m->ps;
    if (p.n_tokens > m->budget) SIM_FAIL("%d tokens > budget %d", p.n_tokens, m->budget);
    if (p.n_items > m->max_seqs) SIM_FAIL("%d items > %d seqs", p.n_items, m->max_seqs);
    if (p.qo_indptr[0] != 0 || p.kv_indptr[0] != 0) SIM_FAIL("indptr[0] != 0");
    if (p.qo_indptr[p.n_items] != p.n_tokens) SIM_FAIL("qo_indptr end %d != %d", p.qo_indptr[p.n_items], p.n_tokens);
    for (int i = 0; i < p.n_items; i++) {
        const cas_sched_item *it = &p.items[i];
        if (it->id < 0 || it->id >= m->nreq || !m->r[it->id].used || m->r[it->id].done)
            SIM_FAIL("item %d: bad id %lld", i, (long long)it->id);
        for (int j = 0; j < i; j++)
            if (p.items[j].id == it->id) SIM_FAIL("request %lld twice", (long long)it->id);
        treq *t = &m->r[it->id];
        int32_t kv_len = it->q_start + it->q_len;
        if (it->q_len < 1 || kv_len > t->n) SIM_FAIL("item %d: q %d+%d of %d", i, it->q_start, it->q_len, t->n);
        if (it->sample != (kv_len == t->n)) SIM_FAIL("item %d: sample flag %d", i, it->sample);
        if (p.qo_indptr[i + 1] - p.qo_indptr[i] != it->q_len) SIM_FAIL("qo_indptr");
        int32_t nbk = (kv_len + ps - 1) / ps;
        if (p.kv_indptr[i + 1] - p.kv_indptr[i] != nbk) SIM_FAIL("kv_indptr: %d pages for %d", p.kv_indptr[i + 1] - p.kv_indptr[i], kv_len);
        if (p.kv_last_page_len[i] != kv_len - (nbk - 1) * ps) SIM_FAIL("last_page_len");
        const int32_t *pages = p.kv_indices + p.kv_indptr[i];
        for (int32_t k = 0; k < nbk; k++)
            if (pages[k] < 0 || pages[k] >= m->nb) SIM_FAIL("page id %d", pages[k]);
        if (m->verify)
            for (int32_t q = 0; q < it->q_start; q++) {
                size_t sl = (size_t)pages[q / ps] * ps + q % ps;
                if (m->stamp[sl] < 0 || m->stamp[sl] >= m->step || m->mem[sl] != t->chain[q])
                    SIM_FAIL("request %lld reads a wrong value at position %d (stamp %lld)",
                             (long long)it->id, q, (long long)m->stamp[sl]);
            }
        for (int32_t q = 0; q < it->q_len; q++) {
            int32_t pos = it->q_start + q, row = p.qo_indptr[i] + q;
            size_t sl = (size_t)pages[pos / ps] * ps + pos % ps;
            if (p.positions[row] != pos || p.token_ids[row] != t->tok[pos] ||
                p.slots[row] != (int32_t)sl)
                SIM_FAIL("request %lld row %d: position/token/slot", (long long)it->id, row);
            if (m->stamp[sl] == m->step) SIM_FAIL("slot %zu written twice in a step", sl);
            uint64_t prev = pos == 0 ? SEED0 : m->mem[(size_t)pages[(pos - 1) / ps] * ps + (pos - 1) % ps];
            m->mem[sl] = mix(prev, t->tok[pos]);
            m->stamp[sl] = m->step;
            if (m->mem[sl] != t->chain[pos])
                SIM_FAIL("request %lld position %d computed a wrong value", (long long)it->id, pos);
        }
        if (it->sample)
            m->sampled[i] = sample_of(m->mem[(size_t)pages[(kv_len - 1) / ps] * ps + (kv_len - 1) % ps]);
        m->stop[i] = it->sample && m->stop_p > 0 && cas_rng_uniform(&m->rng) < m->stop_p;
    }
    if (abort_id >= 0) {
        if (cas_sched_abort(m->s, abort_id) == CAS_OK) {
            m->r[abort_id].done = 1;
            m->r[abort_id].code = CAS_SCHED_ABORTED;
            m->live--;
        }
    }
    st = cas_sched_step_done(m->s, m->sampled, m->stop, m->fin);
    if (st != CAS_OK) SIM_FAIL("step_done: %s", cas_last_error());
    if (m->clock_on && p.n_items > 0) {
        m->last_s = plan_seconds(&m->clock, &p) * (1 + m->clock_noise * (2 * cas_rng_uniform(&m->rng) - 1));
        if (cas_sched_observe(m->s, m->last_s) != CAS_OK) SIM_FAIL("observe: %s", cas_last_error());
    }
    for (int i = 0; i < p.n_items; i++) {
        const cas_sched_item *it = &p.items[i];
        treq *t = &m->r[it->id];
        if (m->fin[i] == CAS_SCHED_ABORTED) {
            if (it->id != abort_id) SIM_FAIL("request %lld aborted unasked", (long long)it->id);
            continue;
        }
        if (t->done) SIM_FAIL("request %lld ran after it finished", (long long)it->id);
        if (it->sample) {
            treq_push(t, m->sampled[i]);
            t->ngen++;
        }
        int want = !it->sample ? CAS_SCHED_RUNNING
                   : m->stop[i] ? CAS_SCHED_FINISHED_STOP
                   : t->ngen >= t->max_new ? CAS_SCHED_FINISHED_LENGTH : CAS_SCHED_RUNNING;
        if (m->fin[i] != want) SIM_FAIL("request %lld: finish code %d, expected %d", (long long)it->id, m->fin[i], want);
        if (want != CAS_SCHED_RUNNING) {
            t->done = 1;
            t->code = want;
            m->live--;
        }
    }
    m->step++;
    return p.n_items;
}

/* Steps until no request is live; fails on a step cap (a deadlock). */
static int sim_drain(sim *m, int64_t max_steps) {
    int64_t idle = 0;
    for (int64_t k = 0; k < max_steps && m->live > 0; k++) {
        int n = sim_step(m, NULL, -1);
        if (n < 0) return 0;
        idle = n == 0 ? idle + 1 : 0;
        if (idle > 2) {
            printf("no progress with %lld live requests\n", (long long)m->live);
            return 0;
        }
    }
    return m->live == 0;
}

static void check_all_free(sim *m) {
    cas_kv_stats ks;
    cas_kv_get_stats(m->kv, &ks);
    CHECKF(ks.blocks_used == 0 && ks.seqs_active == 0 && ks.blocks_free + ks.blocks_cached == m->nb,
           "used %d, active %d", ks.blocks_used, ks.seqs_active);
    CHECK(ks.blocks_pending == 0);
    cas_sched_stats ss;
    cas_sched_get_stats(m->s, &ss);
    CHECK(ss.running == 0 && ss.waiting == 0);
    CHECKF(cas_sched_check(m->s) == CAS_OK, "%s", cas_last_error());
}

/* ---- tests ------------------------------------------------------------------- */

static void test_bad_input(void) {
    sim m;
    REQUIRE(sim_init(&m, 16, 4, 4, 32, 48, 0, 0, 1, 8));
    int32_t t[64];
    for (int i = 0; i < 64; i++) t[i] = i;
    CHECK(cas_sched_add(m.s, 1, t, 0, 4, 0) == CAS_ERR_INVALID);
    CHECK(strstr(cas_last_error(), "empty prompt") != NULL);
    CHECK(cas_sched_add(m.s, 1, NULL, 3, 4, 0) == CAS_ERR_INVALID);
    CHECK(cas_sched_add(m.s, 1, t, 4, 0, 0) == CAS_ERR_INVALID);
    CHECK(strstr(cas_last_error(), "max_new_tokens") != NULL);
    CHECK(cas_sched_add(m.s, 1, t, 4, -3, 0) == CAS_ERR_INVALID);
    CHECK(cas_sched_add(m.s, 1, t, 49, 1, 0) == CAS_ERR_INVALID); /* prompt longer than the context */
    CHECK(strstr(cas_last_error(), "context") != NULL);
    CHECK(cas_sched_add(m.s, 1, t, 40, 9, 0) == CAS_ERR_INVALID); /* prompt + max_new > context */
    int32_t neg[2] = {3, -1};
    CHECK(cas_sched_add(m.s, 1, neg, 2, 4, 0) == CAS_ERR_INVALID);
    CHECK(sim_add(&m, 1, t, 4, 4, 0) == CAS_OK);
    CHECK(cas_sched_add(m.s, 1, t, 4, 4, 0) == CAS_ERR_INVALID); /* duplicate id */
    CHECK(strstr(cas_last_error(), "already") != NULL);
    cas_sched_stats ss;
    cas_sched_get_stats(m.s, &ss);
    CHECK(ss.rejected == 8 && ss.waiting == 1);
    CHECK(sim_drain(&m, 100));
    check_all_free(&m);
    sim_free(&m);

    /* a request that could never fit the pool: 16 blocks of 4 = 64 tokens */
    REQUIRE(sim_init(&m, 16, 4, 4, 32, 128, 0, 0, 1, 8));
    int32_t big[100];
    for (int i = 0; i < 100; i++) big[i] = i;
    CHECK(cas_sched_add(m.s, 2, big, 60, 8, 0) == CAS_ERR_NOMEM);
    CHECK(strstr(cas_last_error(), "never fit") != NULL);
    CHECK(sim_add(&m, 3, big, 60, 5, 0) == CAS_OK); /* 64 tokens of KV: fits exactly */
    CHECK(sim_drain(&m, 100));
    CHECK(m.r[3].code == CAS_SCHED_FINISHED_LENGTH && m.r[3].ngen == 5);
    check_all_free(&m);
    sim_free(&m);

    cas_sched *s = NULL;
    cas_sched_opts so = cas_sched_opts_default();
    CHECK(cas_sched_create(NULL, &so, &s) == CAS_ERR_INVALID);
}

static void test_single_chunked(void) {
    sim m;
    REQUIRE(sim_init(&m, 32, 4, 4, 4, 64, 0, 0, 1, 4));
    int32_t t[10] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    REQUIRE(sim_add(&m, 0, t, 10, 5, 0) == CAS_OK);
    cas_sched_plan p;
    int32_t want[][2] = {{0, 4}, {4, 4}, {8, 2}, {10, 1}, {11, 1}, {12, 1}, {13, 1}};
    for (int k = 0; k < 7; k++) {
        REQUIRE(sim_step(&m, &p, -1) == 1);
        CHECK(p.items[0].q_start == want[k][0] && p.items[0].q_len == want[k][1]);
    }
    CHECK(m.r[0].done && m.r[0].code == CAS_SCHED_FINISHED_LENGTH && m.r[0].ngen == 5);
    REQUIRE(sim_step(&m, &p, -1) == 0);
    check_all_free(&m);
    cas_sched_stats ss;
    cas_sched_get_stats(m.s, &ss);
    CHECK(ss.prompt_tokens_computed == 10 && ss.decode_tokens == 4 && ss.finished == 1);
    sim_free(&m);
}

static void test_decodes_first(void) {
    sim m;
    REQUIRE(sim_init(&m, 64, 4, 4, 8, 128, 0, 0, 1, 4));
    int32_t a[4] = {1, 2, 3, 4}, b[100];
    for (int i = 0; i < 100; i++) b[i] = 100 + i;
    REQUIRE(sim_add(&m, 0, a, 4, 20, 0) == CAS_OK);
    REQUIRE(sim_step(&m, NULL, -1) == 1); /* A's prompt; A samples */
    REQUIRE(sim_add(&m, 1, b, 100, 2, 0) == CAS_OK);
    cas_sched_plan p;
    for (int k = 0; k < 10; k++) {
        REQUIRE(sim_step(&m, &p, -1) == 2);
        CHECK(p.items[0].id == 0 && p.items[0].q_len == 1 && p.items[0].sample);
        CHECK(p.items[1].id == 1 && p.items[1].q_len == 7 && p.items[1].q_start == 7 * k);
        CHECK(p.n_tokens == 8);
    }
    CHECK(sim_drain(&m, 100));
    check_all_free(&m);
    sim_free(&m);
}

static void test_fcfs_and_priority(void) {
    int32_t t[6] = {9, 8, 7, 6, 5, 4};
    for (int prio = 0; prio <= 1; prio++) {
        sim m;
        REQUIRE(sim_init(&m, 64, 4, 1, 64, 64, 0, prio, 1, 8));
        int32_t pr[5] = {0, 0, 5, 0, 9};
        for (int i = 0; i < 5; i++) {
            t[0] = i;
            REQUIRE(sim_add(&m, i, t, 6, 3, pr[i]) == CAS_OK);
        }
        int order[5], n = 0;
        cas_sched_plan p;
        for (int k = 0; k < 100 && m.live > 0; k++) {
            int r = sim_step(&m, &p, -1);
            REQUIRE(r >= 0);
            CHECK(r <= 1);
            if (r == 1 && p.items[0].q_start == 0) order[n++] = (int)p.items[0].id;
        }
        REQUIRE(n == 5);
        int want0[5] = {0, 1, 2, 3, 4}, want1[5] = {4, 2, 0, 1, 3};
        for (int i = 0; i < 5; i++) CHECK(order[i] == (prio ? want1[i] : want0[i]));
        check_all_free(&m);
        sim_free(&m);
    }
}

static void test_seq_limit_and_budget(void) {
    sim m;
    REQUIRE(sim_init(&m, 512, 4, 3, 10, 64, 0, 0, 1, 40));
    int32_t t[30];
    for (int i = 0; i < 40; i++) {
        for (int k = 0; k < 30; k++) t[k] = (int32_t)cas_rng_range(&m.rng, 0, VOCAB - 1);
        REQUIRE(sim_add(&m, i, t, (int32_t)cas_rng_range(&m.rng, 1, 30),
                        (int32_t)cas_rng_range(&m.rng, 1, 12), 0) == CAS_OK);
    }
    for (int k = 0; k < 2000 && m.live > 0; k++) {
        REQUIRE(sim_step(&m, NULL, -1) >= 0); /* checks budget and limit */
        cas_sched_stats ss;
        cas_sched_get_stats(m.s, &ss);
        CHECK(ss.running <= 3);
    }
    CHECK(m.live == 0);
    check_all_free(&m);
    sim_free(&m);
}

static void test_abort(void) {
    sim m;
    REQUIRE(sim_init(&m, 64, 4, 4, 16, 64, 0, 0, 1, 8));
    int32_t t[20];
    for (int i = 0; i < 20; i++) t[i] = 300 + i;
    REQUIRE(sim_add(&m, 0, t, 20, 10, 0) == CAS_OK);
    REQUIRE(sim_add(&m, 1, t, 6, 10, 0) == CAS_OK);
    t[0] = 1;
    REQUIRE(sim_add(&m, 2, t, 6, 10, 0) == CAS_OK);
    REQUIRE(sim_add(&m, 3, t, 6, 10, 0) == CAS_OK);
    CHECK(cas_sched_abort(m.s, 3) == CAS_OK); /* waiting */
    m.r[3].done = 1;
    m.live--;
    CHECK(cas_sched_abort(m.s, 3) == CAS_ERR_INVALID);
    CHECK(cas_sched_abort(m.s, 77) == CAS_ERR_INVALID);
    REQUIRE(sim_step(&m, NULL, -1) >= 1);
    REQUIRE(sim_step(&m, NULL, -1) >= 1);
    cas_sched_req_info info;
    REQUIRE(cas_sched_get(m.s, 2, &info) == CAS_OK);
    CHECK(info.state == 1);
    /* running, not in a plan: its private blocks come back at once */
    int32_t before = cas_kv_num_free_blocks(m.kv);
    CHECK(cas_sched_abort(m.s, 2) == CAS_OK);
    m.r[2].done = 1;
    m.live--;
    CHECK(cas_kv_num_free_blocks(m.kv) > before);
    CHECK(cas_sched_get(m.s, 2, &info) == CAS_ERR_INVALID);
    /* in flight: reported at step_done */
    cas_sched_plan p;
    REQUIRE(sim_step(&m, &p, 0) >= 1);
    CHECK(m.r[0].done && m.r[0].code == CAS_SCHED_ABORTED);
    CHECK(cas_sched_get(m.s, 0, &info) == CAS_ERR_INVALID);
    CHECK(sim_drain(&m, 100));
    CHECK(m.r[1].code == CAS_SCHED_FINISHED_LENGTH);
    cas_sched_stats ss;
    cas_sched_get_stats(m.s, &ss);
    CHECK(ss.aborted == 3 && ss.finished == 1);
    check_all_free(&m);
    sim_free(&m);
}

static void test_stop_and_protocol(void) {
    sim m;
    REQUIRE(sim_init(&m, 64, 4, 4, 16, 64, 0, 0, 1, 4));
    int32_t t[5] = {1, 2, 3, 4, 5};
    REQUIRE(sim_add(&m, 0, t, 5, 50, 0) == CAS_OK);
    cas_sched_plan p;
    CHECK(cas_sched_step_done(m.s, NULL, NULL, NULL) == CAS_ERR_INVALID); /* nothing planned */
    REQUIRE(cas_sched_step_plan(m.s, &p) == CAS_OK);
    CHECK(cas_sched_step_plan(m.s, &p) == CAS_ERR_INVALID); /* previous not done */
    CHECK(cas_sched_step_done(m.s, NULL, NULL, NULL) == CAS_ERR_INVALID); /* needs a token */
    int32_t bad = -5;
    CHECK(cas_sched_step_done(m.s, &bad, NULL, NULL) == CAS_ERR_INVALID);
    for (int32_t row = 0; row < p.n_tokens; row++) { /* the fake engine's writes */
        m.mem[p.slots[row]] = m.r[0].chain[p.positions[row]];
        m.stamp[p.slots[row]] = m.step;
    }
    m.step++;
    int32_t tok = sample_of(m.r[0].chain[4]);
    uint8_t fin = 9;
    CHECK(cas_sched_step_done(m.s, &tok, NULL, &fin) == CAS_OK);
    CHECK(fin == CAS_SCHED_RUNNING);
    treq_push(&m.r[0], tok);
    m.r[0].ngen++;
    m.stop_p = 1.0; /* the engine stops it at the next token */
    REQUIRE(sim_step(&m, &p, -1) == 1);
    CHECK(m.r[0].done && m.r[0].code == CAS_SCHED_FINISHED_STOP && m.r[0].ngen == 2);
    check_all_free(&m);
    sim_free(&m);
}

/* The victim of a preemption is the latest arrival (FCFS) or the lowest
 * priority; it resumes by recomputing prompt + generated and produces the same
 * tokens (the fake engine checks every value). */
static void test_preempt_victim(void) {
    for (int prio = 0; prio <= 1; prio++) {
        sim m;
        REQUIRE(sim_init(&m, 6, 4, 3, 64, 64, 0, prio, 1, 4));
        int32_t pr[3] = {0, 0, 5};
        for (int i = 0; i < 3; i++) {
            int32_t t[4] = {10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4};
            REQUIRE(sim_add(&m, i, t, 4, 8, pr[i]) == CAS_OK);
        }
        cas_sched_plan p;
        int64_t victim = -1;
        for (int k = 0; k < 100 && m.live > 0; k++) {
            REQUIRE(sim_step(&m, &p, -1) >= 0);
            if (p.n_preempted > 0 && victim < 0) {
                victim = p.preempted_ids[0];
                CHECK(p.n_preempted == 1);
                cas_sched_req_info info;
                REQUIRE(cas_sched_get(m.s, victim, &info) == CAS_OK);
                CHECK(info.state == 0 && info.n_preemptions == 1 && info.n_generated > 0);
                for (int i = 0; i < p.n_items; i++) CHECK(p.items[i].id != victim);
            }
        }
        CHECKF(victim == (prio ? 1 : 2), "priority %d: victim %lld", prio, (long long)victim);
        CHECK(m.live == 0);
        for (int i = 0; i < 3; i++) CHECK(m.r[i].code == CAS_SCHED_FINISHED_LENGTH && m.r[i].ngen == 8);
        cas_sched_stats ss;
        cas_sched_get_stats(m.s, &ss);
        CHECK(ss.preemptions >= 1 && ss.recomputed_tokens > 0);
        check_all_free(&m);
        sim_free(&m);
    }
}

/* Cold-cache sharing: 64 requests, one 2000-token prefix, 32-token suffixes,
 * all arriving at once. */
static int64_t cold_cache_run(int32_t budget, int prefix_cache, int32_t prefix) {
    sim m;
    int32_t suffix = 32, n = prefix + suffix;
    if (!sim_init(&m, 1024, 16, 64, budget, 4096, 0, 0, prefix_cache, 64)) return -1;
    m.verify = 1;
    int32_t *t = malloc((size_t)n * sizeof *t);
    for (int32_t k = 0; k < prefix; k++) t[k] = (int32_t)cas_rng_range(&m.rng, 0, VOCAB - 1);
    for (int i = 0; i < 64; i++) {
        for (int32_t k = prefix; k < n; k++) t[k] = (int32_t)cas_rng_range(&m.rng, 0, VOCAB - 1);
        if (sim_add(&m, i, t, n, 4, 0) != CAS_OK) return -1;
    }
    free(t);
    int ok = sim_drain(&m, 10000);
    CHECK(ok);
    for (int i = 0; i < 64; i++) CHECK(m.r[i].done && m.r[i].ngen == 4);
    cas_sched_stats ss;
    cas_sched_get_stats(m.s, &ss);
    CHECK(ss.preemptions == 0);
    check_all_free(&m);
    cas_kv_stats ks;
    cas_kv_get_stats(m.kv, &ks);
    if (prefix_cache) CHECK(ks.pending_hit_tokens + ks.hit_tokens >= (int64_t)63 * (prefix / 16) * 16);
    sim_free(&m);
    return ok ? ss.prompt_tokens_computed : -1;
}

static void test_cold_cache_sharing(void) {
    int64_t want = 2000 + 64 * 32;
    int64_t a = cold_cache_run(2048, 1, 2000);
    CHECKF(a == want, "budget 2048: %lld prompt tokens computed, expected %lld", (long long)a, (long long)want);
    int64_t b = cold_cache_run(512, 1, 2000);
    CHECKF(b == want, "budget 512: %lld prompt tokens computed, expected %lld", (long long)b, (long long)want);
    int64_t c = cold_cache_run(8192, 1, 2000);
    CHECKF(c == want, "budget 8192: %lld", (long long)c);
    /* a prefix that ends inside a block: its last partial block is computed per request */
    int64_t d = cold_cache_run(2048, 1, 2007);
    CHECKF(d >= 2007 + 64 * 32 && d <= 2007 + 64 * (32 + 16), "unaligned prefix: %lld", (long long)d);
    int64_t off = cold_cache_run(2048, 0, 2000);
    CHECKF(off == 64 * 2032, "prefix cache off: %lld", (long long)off);
    printf("  cold cache: %lld prompt tokens computed (%lld without prefix caching)\n",
           (long long)a, (long long)off);
}

/* Random workloads on tiny pools: arrivals over time, shared prefixes, random
 * stops and aborts; must end with everything finished and every block free. */
static void random_sched(uint64_t seed, int32_t nb, int32_t ps, int32_t seqs, int32_t budget,
                         int32_t chunk, int prio, int nreq, int itl, int64_t *acc) {
    sim m;
    int32_t ctx = 96;
    cas_sched_opts so = sim_opts(seqs, budget, ctx, chunk, prio);
    if (itl) {
        /* a target the fake clock often exceeds: every floor and cut is taken */
        so.max_itl_ms = 2.0f;
        so.long_prefill_tokens = 12;
    }
    REQUIRE(sim_init_opts(&m, nb, ps, 1, nreq, &so));
    if (itl) {
        m.clock_on = 1;
        m.clock = (cas_sched_cost){0.0002, 0.0001, 0.0002, 1e-6, 1e-6};
        m.clock_noise = 0.3;
    }
    cas_rng_seed(&m.rng, seed);
    m.stop_p = 0.02;
    int32_t tmpl[3][64], t[96];
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 64; i++) tmpl[k][i] = (int32_t)cas_rng_range(&m.rng, 0, VOCAB - 1);
    int next = 0;
    int64_t steps = 0;
    while ((next < nreq || m.live > 0) && steps < 200000) {
        int arrivals = (int)cas_rng_range(&m.rng, 0, 2);
        for (int a = 0; a < arrivals && next < nreq; a++, next++) {
            int32_t n = (int32_t)cas_rng_range(&m.rng, 1, 48);
            int32_t keep = (int32_t)cas_rng_range(&m.rng, 0, n);
            int k = (int)cas_rng_range(&m.rng, 0, 2);
            for (int32_t i = 0; i < n; i++)
                t[i] = i < keep ? tmpl[k][i] : (int32_t)cas_rng_range(&m.rng, 0, VOCAB - 1);
            int32_t max_new = (int32_t)cas_rng_range(&m.rng, 1, 40);
            /* the largest request fits the pool alone; some do not and are rejected */
            cas_status st = sim_add(&m, next, t, n, max_new, (int32_t)cas_rng_range(&m.rng, 0, 3));
            int32_t need = (n + max_new - 1 + ps - 1) / ps;
            CHECK(st == (need > nb ? CAS_ERR_NOMEM : CAS_OK));
        }
        int abort_id = -1;
        if (cas_rng_uniform(&m.rng) < 0.01) {
            int id = (int)cas_rng_range(&m.rng, 0, next > 0 ? next - 1 : 0);
            if (next > 0 && m.r[id].used && !m.r[id].done) abort_id = id;
        }
        if (sim_step(&m, NULL, abort_id) < 0) break;
        steps++;
    }
    CHECKF(m.live == 0 && next == nreq, "seed %llu: %lld live after %lld steps", (unsigned long long)seed,
           (long long)m.live, (long long)steps);
    for (int i = 0; i < nreq; i++)
        if (m.r[i].used) CHECK(m.r[i].done);
    check_all_free(&m);
    cas_sched_stats ss;
    cas_sched_get_stats(m.s, &ss);
    acc[0] += ss.preemptions;
    if (getenv("SCHED_VERBOSE")) printf("  seed %llu: %lld preemptions, %lld steps, %lld recomputed\n", (unsigned long long)seed, (long long)ss.preemptions, (long long)steps, (long long)ss.recomputed_tokens);
    acc[1] += steps;
    acc[2] += m.wait_shared;
    sim_free(&m);
}

static void test_random_preemption(void) {
    int64_t acc[3] = {0, 0, 0}; /* preemptions, steps, waits on shared blocks */
    random_sched(1, 24, 4, 8, 32, 0, 0, 400, 0, acc);
    random_sched(2, 24, 4, 8, 32, 8, 1, 400, 0, acc);
    random_sched(3, 40, 2, 16, 64, 0, 0, 400, 0, acc);
    random_sched(4, 14, 8, 6, 16, 0, 1, 400, 0, acc);
    random_sched(5, 100, 1, 12, 24, 5, 0, 300, 0, acc);
    random_sched(6, 30, 4, 30, 200, 0, 0, 400, 0, acc);
    /* the same with an inter-token latency target and a fake clock */
    random_sched(7, 24, 4, 8, 32, 0, 0, 400, 1, acc);
    random_sched(8, 40, 2, 16, 64, 6, 1, 400, 1, acc);
    random_sched(9, 30, 4, 30, 200, 0, 0, 400, 1, acc);
    CHECKF(acc[0] > 100, "only %lld preemptions: the pools are not tight", (long long)acc[0]);
    CHECK(acc[2] > 0);
    printf("  random workloads: %lld steps, %lld preemptions, %lld waits on shared blocks, "
           "all requests finished\n", (long long)acc[1], (long long)acc[0], (long long)acc[2]);
}

/* ---- prefill under an inter-token latency target ------------------------------ */

/* Seconds of one item under cost model c (sched.h's terms, written out again). */
static double item_seconds(const cas_sched_cost *c, int32_t q0, int32_t n, int sample) {
    double t = c->token_s * n + (sample ? c->sample_s : 0.0);
    if (n == 1) return t + c->kv_s * (q0 + 1);
    return t + c->pair_s * ((double)n * q0 + (double)n * (n + 1) / 2);
}

/* A sim with nd requests decoding (8-token prompts, many tokens to go) under
 * a fixed cost model and target; returns 0 on failure. */
static int itl_setup(sim *m, float target_ms, const cas_sched_cost *cost, int nd, int32_t budget,
                     int32_t long_tokens) {
    cas_sched_opts so = sim_opts(16, budget, 4096, 0, 0);
    so.max_itl_ms = target_ms;
    so.long_prefill_tokens = long_tokens;
    if (!sim_init_opts(m, 2048, 16, 1, 64, &so)) return 0;
    if (cost && cas_sched_set_cost(m->s, cost) != CAS_OK) return 0;
    for (int i = 0; i < nd; i++) {
        int32_t t[8];
        for (int k = 0; k < 8; k++) t[k] = 10 * i + k + 1;
        if (sim_add(m, i, t, 8, 1000, 0) != CAS_OK) return 0;
    }
    return nd == 0 || sim_step(m, NULL, -1) == nd; /* all prompts in one step: nobody decodes yet */
}

/* Adds request id with n random tokens (max_new new ones). */
static int add_random(sim *m, int id, int32_t n, int32_t max_new) {
    int32_t *t = malloc(sizeof(int32_t) * (size_t)n);
    if (!t) return 0;
    for (int32_t k = 0; k < n; k++) t[k] = (int32_t)cas_rng_range(&m->rng, 0, VOCAB - 1);
    int ok = sim_add(m, id, t, n, max_new, 0) == CAS_OK;
    free(t);
    return ok;
}

/* Finds request id among a plan's items; -1 if absent. */
static int item_of(const cas_sched_plan *p, int64_t id) {
    for (int i = 0; i < p->n_items; i++)
        if (p->items[i].id == id) return i;
    return -1;
}

/* With decodes running, a long prompt's chunks are the most tokens whose
 * predicted time fits what the target leaves after the decodes, and they
 * shrink as the prompt gets deeper (each token attends to more keys). */
static void test_itl_chunks_fit_target(void) {
    const cas_sched_cost c = {0.005, 0.0005, 0.001, 2e-7, 1e-7};
    const double target = 0.1;
    sim m;
    REQUIRE(itl_setup(&m, 100.0f, &c, 8, 512, 0));
    REQUIRE(add_random(&m, 8, 3000, 2));
    cas_sched_plan p;
    int steps = 0, first_chunk = 0, deep_chunk = 0, bad_fit = 0, not_max = 0, bad_pred = 0;
    for (;;) {
        REQUIRE(sim_step(&m, &p, -1) > 0);
        steps++;
        int li = item_of(&p, 8);
        REQUIRE(li >= 0);
        const cas_sched_item *it = &p.items[li];
        /* every stream decodes in every step */
        int decodes = 0;
        double base = c.step_s;
        for (int i = 0; i < p.n_items; i++)
            if (p.items[i].id != 8) {
                CHECK(p.items[i].q_len == 1 && p.items[i].sample);
                decodes++;
                base += item_seconds(&c, p.items[i].q_start, 1, 1);
            }
        CHECK(decodes == 8);
        const double half = (base > target ? base : target) / 2;
        const double allow = target - base > half ? target - base : half;
        const double cost = item_seconds(&c, it->q_start, it->q_len, it->sample);
        const int32_t left = 3000 - it->q_start, room = 512 - decodes;
        const int32_t floor = left < 16 ? left : 16;
        if (cost > allow + 1e-12 && it->q_len > floor) bad_fit++;
        if (it->q_len < left && it->q_len < room && item_seconds(&c, it->q_start, it->q_len + 1, 0) <= allow)
            not_max++;
        if (fabs(p.predicted_s - (base + cost)) > 1e-9) bad_pred++;
        if (it->q_start == 0) first_chunk = it->q_len;
        if (it->q_start + it->q_len <= 3000 && it->q_start >= 2400 && !deep_chunk) deep_chunk = it->q_len;
        if (it->sample) break;
    }
    CHECKF(bad_fit == 0, "%d chunks over the time left", bad_fit);
    CHECKF(not_max == 0, "%d chunks smaller than the time allows", not_max);
    CHECKF(bad_pred == 0, "%d predictions differ from the model", bad_pred);
    CHECKF(first_chunk > deep_chunk && deep_chunk > 0, "first chunk %d, deep chunk %d", first_chunk, deep_chunk);
    cas_sched_stats ss;
    cas_sched_get_stats(m.s, &ss);
    CHECK(ss.time_limited_steps >= steps - 1);
    printf("  3000-token prompt beside 8 decodes in %d steps, chunks %d at the start, %d past 2400\n", steps,
           first_chunk, deep_chunk);
    sim_free(&m);
}

/* Beside decodes that take part of the target, more than it, or so much
 * that no prefill token fits, each step's chunk is the most tokens whose time
 * fits max(target - decodes, max(target, decodes) / 2), and at least one. */
static void test_itl_min_progress(void) {
    const cas_sched_cost cs[3] = {
        {0.02, 0.001, 0.001, 1e-12, 1e-12},  /* decodes 36 ms */
        {0.2, 0.001, 0.001, 1e-12, 1e-12},   /* decodes 216 ms: past the target */
        {0.001, 0.001, 0.001, 0.1, 1e-9},    /* a prompt token costs 100 ms and more: none fits */
    };
    const int32_t expect[3] = {63, 107, 1};
    for (int k = 0; k < 3; k++) {
        sim m;
        REQUIRE(itl_setup(&m, 100.0f, &cs[k], 8, 512, 0));
        REQUIRE(add_random(&m, 8, 1000, 1));
        cas_sched_plan p;
        for (int step = 0; step < 3; step++) {
            REQUIRE(sim_step(&m, &p, -1) == 9);
            int li = item_of(&p, 8);
            REQUIRE(li >= 0);
            double base = cs[k].step_s;
            for (int i = 0; i < p.n_items; i++)
                if (i != li) base += item_seconds(&cs[k], p.items[i].q_start, 1, 1);
            const double longer = base > 0.1 ? base : 0.1;
            const double allow = 0.1 - base > longer / 2 ? 0.1 - base : longer / 2;
            int32_t want = 0;
            while (item_seconds(&cs[k], p.items[li].q_start, want + 1, 0) <= allow) want++;
            if (want < 1) want = 1;
            if (step == 0) printf("  decodes %.0f ms: %d tokens of prefill a step\n", base * 1e3, p.items[li].q_len);
            CHECKF(p.items[li].q_len == want && (step > 0 || want == expect[k]),
                   "decodes %.0f ms, step %d: %d tokens, expected %d", base * 1e3, step, p.items[li].q_len, want);
        }
        sim_free(&m);
    }
}

/* Short prompts arriving every step go first but cannot starve the long one
 * in progress: it keeps half the step's prefill time. */
static void test_long_keeps_half(void) {
    const cas_sched_cost c = {0.005, 0.001, 0.001, 1e-12, 1e-12};
    sim m;
    REQUIRE(itl_setup(&m, 100.0f, &c, 8, 512, 0));
    REQUIRE(add_random(&m, 8, 3000, 1));
    cas_sched_plan p;
    REQUIRE(sim_step(&m, &p, -1) == 9);
    for (int step = 0; step < 10; step++) {
        REQUIRE(add_random(&m, 9 + step, 150, 1)); /* a new one every step (ids are never reused) */
        REQUIRE(sim_step(&m, &p, -1) > 0);
        int li = item_of(&p, 8);
        REQUIRE(li >= 0);
        double base = c.step_s, shorts = 0;
        for (int i = 0; i < p.n_items; i++) {
            const cas_sched_item *it = &p.items[i];
            if (it->q_len == 1) base += item_seconds(&c, it->q_start, 1, 1);
            else if (i != li) shorts += item_seconds(&c, it->q_start, it->q_len, it->sample);
        }
        const double allow = 0.1 - base, own = item_seconds(&c, p.items[li].q_start, p.items[li].q_len, 0);
        CHECKF(own >= allow / 2 - 0.001 && shorts > 0 && own + shorts <= allow + 1e-9,
               "step %d: the long prompt ran %.1f ms, short ones %.1f ms, of %.1f ms", step, own * 1e3, shorts * 1e3,
               allow * 1e3);
    }
    sim_free(&m);
}

/* Without decodes nobody waits for a token: the whole budget goes to prefill
 * whatever the time; with the target off, too. */
static void test_itl_budget_without_decodes(void) {
    const cas_sched_cost c = {0.5, 0.01, 0.01, 1e-6, 1e-6}; /* every step is over the target */
    sim m;
    REQUIRE(itl_setup(&m, 100.0f, &c, 0, 512, 0));
    REQUIRE(add_random(&m, 0, 1500, 2));
    cas_sched_plan p;
    int32_t want[] = {512, 512, 476};
    for (int k = 0; k < 3; k++) {
        REQUIRE(sim_step(&m, &p, -1) == 1);
        CHECKF(p.items[0].q_len == want[k], "step %d: %d tokens", k, p.items[0].q_len);
        CHECK(!p.time_limited);
    }
    sim_free(&m);
    REQUIRE(itl_setup(&m, 0.0f, &c, 8, 512, 0));
    REQUIRE(add_random(&m, 8, 1500, 2));
    REQUIRE(sim_step(&m, &p, -1) == 9);
    int li = item_of(&p, 8);
    REQUIRE(li >= 0);
    CHECKF(p.items[li].q_len == 504, "target off: %d tokens", p.items[li].q_len);
    CHECK(!p.time_limited);
    sim_free(&m);
}

/* A short prompt that arrives while a long one is mid-prefill is computed in
 * the next step (and one behind a cached prefix counts as short), ahead of a
 * second long one that waits for the first; with long_prefill_tokens < 0
 * (plain FCFS chunks) it waits for the long one. */
static void test_short_beside_long(void) {
    for (int fcfs = 0; fcfs <= 1; fcfs++) {
        sim m;
        REQUIRE(itl_setup(&m, 0.0f, NULL, 0, 64, fcfs ? -1 : 0));
        REQUIRE(add_random(&m, 0, 1000, 2)); /* A */
        cas_sched_plan p;
        for (int k = 0; k < 3; k++) REQUIRE(sim_step(&m, &p, -1) == 1);
        REQUIRE(add_random(&m, 1, 1000, 2)); /* B: long, behind A */
        REQUIRE(add_random(&m, 2, 20, 2));   /* C: short, behind B */
        REQUIRE(sim_step(&m, &p, -1) >= 1);
        int ia = item_of(&p, 0), ic = item_of(&p, 2);
        cas_sched_req_info info;
        REQUIRE(cas_sched_get(m.s, 1, &info) == CAS_OK);
        if (fcfs) {
            /* B is admitted after A (strict FCFS) and C waits behind both */
            CHECK(ia >= 0 && p.items[ia].q_len == 64 && ic < 0);
        } else {
            CHECKF(ic >= 0 && p.items[ic].q_start == 0 && p.items[ic].q_len == 20 && p.items[ic].sample,
                   "the short request did not run whole");
            CHECK(ia >= 0 && p.items[ia].q_len == 44);
            CHECK(info.state == 0); /* B waits while A is long */
            /* D: A's first 192 tokens (computed, cached) and 10 of its own: short */
            int32_t d[202];
            for (int k = 0; k < 192; k++) d[k] = m.r[0].tok[k];
            for (int k = 192; k < 202; k++) d[k] = 7;
            REQUIRE(sim_add(&m, 3, d, 202, 2, 0) == CAS_OK);
            REQUIRE(sim_step(&m, &p, -1) >= 1);
            int id = item_of(&p, 3);
            CHECKF(id >= 0 && p.items[id].q_start == 192 && p.items[id].q_len == 10, "the cached request did not run");
            REQUIRE(cas_sched_get(m.s, 1, &info) == CAS_OK);
            CHECK(info.state == 0);
            /* B is admitted in the step where A can finish, and gets the rest */
            int b_first = -1;
            for (int k = 0; k < 40 && b_first < 0; k++) {
                REQUIRE(sim_step(&m, &p, -1) >= 1);
                int ib = item_of(&p, 1);
                ia = item_of(&p, 0);
                if (ib >= 0) {
                    b_first = k;
                    CHECKF(ia >= 0 && p.items[ia].sample, "B ran before A's last chunk");
                    CHECK(p.n_tokens == 64);
                }
            }
            CHECK(b_first >= 0);
        }
        CHECK(sim_drain(&m, 1000));
        check_all_free(&m);
        sim_free(&m);
    }
}

/* The fitted model: a fake clock with 5% noise drives a mixed workload; the
 * fit finds the clock's coefficients, keeps steps with decodes near the
 * target, and shrugs off a step that took 100 times too long. */
static void test_cost_fit(void) {
    const cas_sched_cost truth = {0.004, 0.0003, 0.0008, 1e-7, 5e-8};
    cas_sched_opts so = sim_opts(32, 512, 4096, 0, 0);
    so.max_itl_ms = 60.0f;
    sim m;
    REQUIRE(sim_init_opts(&m, 4096, 16, 1, 204, &so));
    m.clock_on = 1;
    m.clock = truth;
    m.clock_noise = 0.05;
    int next = 0, over = 0, with_decodes = 0;
    double err = 0;
    int n_err = 0;
    cas_sched_plan p;
    for (int step = 0; step < 3000 && (next < 200 || m.live > 0); step++) {
        if (next < 200 && cas_rng_uniform(&m.rng) < 0.15) {
            int32_t n = cas_rng_uniform(&m.rng) < 0.1 ? (int32_t)cas_rng_range(&m.rng, 1000, 2500)
                                                      : (int32_t)cas_rng_range(&m.rng, 4, 80);
            REQUIRE(add_random(&m, next, n, (int32_t)cas_rng_range(&m.rng, 20, 120)));
            next++;
        }
        REQUIRE(sim_step(&m, &p, -1) >= 0);
        if (p.n_items == 0 || step < 100) continue;
        err += fabs(p.predicted_s - m.last_s) / m.last_s;
        n_err++;
        /* steps with decodes and a prefill cut to time: at most the target (or
         * the decodes plus half of it), give or take the noise */
        int decodes = 0;
        double base = truth.step_s;
        for (int i = 0; i < p.n_items; i++)
            if (p.items[i].q_len == 1) decodes++, base += item_seconds(&truth, p.items[i].q_start, 1, 1);
        if (decodes > 0 && p.time_limited) {
            with_decodes++;
            double longer = base > 0.06 ? base : 0.06, bound = 0.06 > base + longer / 2 ? 0.06 : base + longer / 2;
            if (m.last_s > 1.15 * bound) over++;
        }
    }
    CHECK(m.live == 0 && next == 200);
    cas_sched_cost f;
    cas_sched_get_cost(m.s, &f);
    printf("  fit: step %.2f ms, token %.3f ms, sample %.3f ms, pair %.3g s, kv %.3g s; "
           "mean prediction error %.1f%%; %d of %d cut steps over the target\n",
           f.step_s * 1e3, f.token_s * 1e3, f.sample_s * 1e3, f.pair_s, f.kv_s, 100 * err / n_err, over,
           with_decodes);
    CHECKF(err / n_err < 0.06, "mean prediction error %.3f", err / n_err);
    CHECK(with_decodes > 50);
    CHECKF(over <= with_decodes / 50, "%d of %d steps over the target", over, with_decodes);
    CHECK(fabs(f.token_s / truth.token_s - 1) < 0.25 && fabs(f.pair_s / truth.pair_s - 1) < 0.25);
    CHECK(f.step_s >= 0 && f.sample_s >= 0 && f.kv_s >= 0);
    /* an empty plan has no time to report */
    REQUIRE(sim_step(&m, &p, -1) == 0);
    CHECK(cas_sched_observe(m.s, 1.0) == CAS_ERR_INVALID);
    /* one step 100x too long (the OS took the cores) */
    for (int i = 200; i < 204; i++) REQUIRE(add_random(&m, i, 8, 50));
    for (int k = 0; k < 5; k++) REQUIRE(sim_step(&m, &p, -1) > 0);
    m.clock_on = 0;
    REQUIRE(sim_step(&m, &p, -1) == 4);
    REQUIRE(cas_sched_observe(m.s, 100 * plan_seconds(&truth, &p)) == CAS_OK);
    REQUIRE(sim_step(&m, &p, -1) == 4);
    cas_sched_get_cost(m.s, &f);
    const double want = plan_seconds(&truth, &p), got = plan_seconds(&f, &p);
    CHECKF(fabs(got / want - 1) < 0.3, "after an outlier: %.2f ms predicted, %.2f ms true", got * 1e3, want * 1e3);
    sim_free(&m);
}

/* The model's contract: bad times and coefficients are refused, a fixed model
 * is used as given, and NULL returns to the fit. */
static void test_cost_api(void) {
    sim m;
    REQUIRE(itl_setup(&m, 50.0f, NULL, 2, 64, 0));
    cas_sched_cost c;
    cas_sched_get_cost(m.s, &c);
    CHECK(c.step_s == 0 && c.token_s == 0 && c.pair_s == 0); /* nothing observed */
    CHECK(cas_sched_observe(m.s, 0.01) == CAS_OK);            /* the set-up's step */
    CHECK(cas_sched_observe(m.s, 0.01) == CAS_ERR_INVALID);   /* no step since */
    cas_sched_plan p;
    REQUIRE(sim_step(&m, &p, -1) == 2);
    CHECK(cas_sched_observe(m.s, -1.0) == CAS_ERR_INVALID);
    CHECK(cas_sched_observe(m.s, NAN) == CAS_ERR_INVALID);
    CHECK(cas_sched_observe(m.s, 0.01) == CAS_OK);
    CHECK(cas_sched_observe(m.s, 0.01) == CAS_ERR_INVALID); /* once per step */
    REQUIRE(cas_sched_step_plan(m.s, &p) == CAS_OK);
    CHECK(cas_sched_observe(m.s, 0.01) == CAS_ERR_INVALID); /* the step is in flight */
    for (int i = 0; i < p.n_items; i++) m.sampled[i] = 1;
    REQUIRE(cas_sched_step_done(m.s, m.sampled, NULL, NULL) == CAS_OK);
    CHECK(cas_sched_observe(m.s, 0.01) == CAS_OK);
    cas_sched_get_cost(m.s, &c);
    CHECK(c.step_s > 0 || c.token_s > 0 || c.sample_s > 0 || c.kv_s > 0);
    cas_sched_cost bad = {0.001, -1e-3, 0, 0, 0};
    CHECK(cas_sched_set_cost(m.s, &bad) == CAS_ERR_INVALID);
    bad.token_s = INFINITY;
    CHECK(cas_sched_set_cost(m.s, &bad) == CAS_ERR_INVALID);
    cas_sched_cost fixed = {0.001, 0.002, 0.003, 4e-9, 5e-9};
    CHECK(cas_sched_set_cost(m.s, &fixed) == CAS_OK);
    cas_sched_get_cost(m.s, &c);
    CHECK(c.step_s == 0.001 && c.token_s == 0.002 && c.sample_s == 0.003 && c.pair_s == 4e-9 && c.kv_s == 5e-9);
    CHECK(cas_sched_set_cost(m.s, NULL) == CAS_OK);
    cas_sched_get_cost(m.s, &c);
    CHECK(c.token_s != 0.002);
    sim_free(&m);
    /* bad options */
    cas_kv_opts ko = cas_kv_opts_default();
    cas_kv *kv = NULL;
    REQUIRE(cas_kv_create(&ko, &kv) == CAS_OK);
    cas_sched *s = NULL;
    cas_sched_opts so = cas_sched_opts_default();
    so.max_itl_ms = -5;
    CHECK(cas_sched_create(kv, &so, &s) == CAS_ERR_INVALID && strstr(cas_last_error(), "max_itl_ms"));
    so.max_itl_ms = NAN;
    CHECK(cas_sched_create(kv, &so, &s) == CAS_ERR_INVALID);
    so.max_itl_ms = 1e9f;
    CHECK(cas_sched_create(kv, &so, &s) == CAS_ERR_INVALID);
    cas_kv_destroy(kv);
}

int main(void) {
    RUN(test_bad_input);
    RUN(test_single_chunked);
    RUN(test_decodes_first);
    RUN(test_fcfs_and_priority);
    RUN(test_seq_limit_and_budget);
    RUN(test_abort);
    RUN(test_stop_and_protocol);
    RUN(test_preempt_victim);
    RUN(test_cold_cache_sharing);
    RUN(test_random_preemption);
    RUN(test_itl_chunks_fit_target);
    RUN(test_itl_min_progress);
    RUN(test_long_keeps_half);
    RUN(test_itl_budget_without_decodes);
    RUN(test_short_beside_long);
    RUN(test_cost_fit);
    RUN(test_cost_api);
    return check_summary();
}
