/*
 * test_kv.c: the KV block manager. Allocation and release, prefix hits and
 * misses, chained hashes, LRU eviction order, revival on a hit, collisions
 * (with a hash mask that forces them), pool exhaustion, pending blocks and
 * fillers (cold-cache sharing), fork, and a randomized workload in which a
 * fake KV (a chained value per token slot, written on commit) proves that
 * every attached block holds exactly its sequence's prefix. The invariant
 * checker runs after every operation.
 */
#include "../src/kv/kv.h"
#include "check.h"

#include <string.h>

#define KV_OK(kv) CHECKF(cas_kv_check(kv) == CAS_OK, "%s", cas_last_error())

static cas_kv *make_kv(int32_t nb, int32_t ps, int32_t seqs, int32_t bps, uint64_t mask) {
    cas_kv_opts o = cas_kv_opts_default();
    o.num_blocks = nb;
    o.page_size = ps;
    o.max_seqs = seqs;
    o.max_blocks_per_seq = bps;
    o.hash_mask = mask;
    o.debug_checks = 1;
    cas_kv *kv = NULL;
    if (cas_kv_create(&o, &kv) != CAS_OK) return NULL;
    return kv;
}

static void fill_tokens(int32_t *t, int32_t n, int32_t base) {
    for (int32_t i = 0; i < n; i++) t[i] = base + i;
}

/* Computes all of a sequence's runnable tokens until it is complete or waits. */
static void compute_all(cas_kv *kv, int32_t s) {
    for (int guard = 0; guard < 1000; guard++) {
        int32_t run, wait;
        CHECK(cas_kv_seq_ready(kv, s, &run, &wait) == CAS_OK);
        if (run == 0) return;
        CHECK(cas_kv_seq_claim(kv, s, run) == CAS_OK);
        CHECK(cas_kv_seq_commit(kv, s, run) == CAS_OK);
    }
}

static void test_create_bad(void) {
    cas_kv_opts o = cas_kv_opts_default();
    cas_kv *kv = NULL;
    o.num_blocks = 0;
    CHECK(cas_kv_create(&o, &kv) == CAS_ERR_INVALID && kv == NULL);
    o = cas_kv_opts_default();
    o.page_size = 0;
    CHECK(cas_kv_create(&o, &kv) == CAS_ERR_INVALID);
    CHECK(cas_kv_create(NULL, &kv) == CAS_ERR_INVALID);
    cas_kv_destroy(NULL);
}

static void test_alloc_free(void) {
    cas_kv *kv = make_kv(16, 4, 4, 8, 0);
    REQUIRE(kv);
    int32_t t[32], s;
    fill_tokens(t, 32, 100);
    cas_kv_match m;
    REQUIRE(cas_kv_seq_create(kv, t, 10, &s, &m) == CAS_OK);
    KV_OK(kv);
    CHECK(m.hit_tokens == 0 && m.pending_tokens == 0 && m.new_blocks == 3);
    CHECK(cas_kv_seq_num_blocks(kv, s) == 3 && cas_kv_seq_num_tokens(kv, s) == 10);
    CHECK(cas_kv_num_free_blocks(kv) == 13);
    for (int32_t p = 0; p < 10; p++) CHECK(cas_kv_seq_token(kv, s, p) == 100 + p);
    CHECK(cas_kv_seq_token(kv, s, 10) == -1);
    /* append within the last block, then across blocks */
    CHECK(cas_kv_seq_append(kv, s, t + 10, 2) == CAS_OK);
    CHECK(cas_kv_seq_num_blocks(kv, s) == 3);
    CHECK(cas_kv_seq_append(kv, s, t + 12, 5) == CAS_OK);
    CHECK(cas_kv_seq_num_blocks(kv, s) == 5 && cas_kv_seq_num_tokens(kv, s) == 17);
    for (int32_t p = 0; p < 17; p++) CHECK(cas_kv_seq_token(kv, s, p) == 100 + p);
    KV_OK(kv);
    const int32_t *b = cas_kv_seq_blocks(kv, s);
    for (int i = 0; i < 5; i++) CHECK(cas_kv_block_ref(kv, b[i]) == 1);
    /* an empty sequence, appended later */
    int32_t e;
    CHECK(cas_kv_seq_create(kv, NULL, 0, &e, NULL) == CAS_OK);
    CHECK(cas_kv_seq_num_blocks(kv, e) == 0);
    CHECK(cas_kv_seq_append(kv, e, t, 1) == CAS_OK);
    CHECK(cas_kv_seq_num_blocks(kv, e) == 1);
    CHECK(cas_kv_seq_free(kv, s) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, e) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, s) == CAS_ERR_INVALID); /* double free is an error, not a crash */
    CHECK(cas_kv_num_free_blocks(kv) == 16);
    KV_OK(kv);
    /* bad handles */
    CHECK(cas_kv_seq_append(kv, 99, t, 1) == CAS_ERR_INVALID);
    CHECK(cas_kv_seq_num_tokens(kv, -1) == -1);
    CHECK(cas_kv_seq_blocks(kv, 3) == NULL);
    cas_kv_destroy(kv);
}

static void test_prefix_hit_miss(void) {
    cas_kv *kv = make_kv(64, 4, 8, 16, 0);
    REQUIRE(kv);
    int32_t t[64], u[64], a, b;
    fill_tokens(t, 64, 1);
    cas_kv_match m;
    REQUIRE(cas_kv_seq_create(kv, t, 23, &a, &m) == CAS_OK); /* 5 full blocks + 3 */
    compute_all(kv, a);
    CHECK(cas_kv_seq_num_computed(kv, a) == 23);
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    KV_OK(kv);
    cas_kv_stats st;
    cas_kv_get_stats(kv, &st);
    CHECK(st.blocks_cached == 5 && st.blocks_used == 0);
    /* same prompt: all 5 full blocks hit */
    REQUIRE(cas_kv_seq_create(kv, t, 23, &b, &m) == CAS_OK);
    CHECK(m.hit_tokens == 20 && m.pending_tokens == 0 && m.new_blocks == 1);
    int32_t run, wait;
    CHECK(cas_kv_seq_ready(kv, b, &run, &wait) == CAS_OK);
    CHECK(run == 3 && wait == 0 && cas_kv_seq_num_computed(kv, b) == 20);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    /* a prompt that ends exactly at a block boundary: its last block is not matched */
    REQUIRE(cas_kv_seq_create(kv, t, 20, &b, &m) == CAS_OK);
    CHECK(m.hit_tokens == 16 && m.new_blocks == 1);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    /* diverging after 2 blocks */
    memcpy(u, t, sizeof u);
    u[9] = 999;
    REQUIRE(cas_kv_seq_create(kv, u, 23, &b, &m) == CAS_OK);
    CHECK(m.hit_tokens == 8);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    /* different from the start: a miss */
    fill_tokens(u, 64, 500);
    REQUIRE(cas_kv_seq_create(kv, u, 23, &b, &m) == CAS_OK);
    CHECK(m.hit_tokens == 0 && m.pending_tokens == 0);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    cas_kv_get_stats(kv, &st);
    CHECK(st.query_tokens == 23 * 5 + 20 - 23);
    CHECK(st.hit_tokens == 20 + 16 + 8);
    CHECK(st.hit_rate > 0.3 && st.hit_rate < 0.5);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

static void test_prefix_cache_off(void) {
    cas_kv_opts o = cas_kv_opts_default();
    o.num_blocks = 32;
    o.page_size = 4;
    o.enable_prefix_cache = 0;
    o.debug_checks = 1;
    cas_kv *kv;
    REQUIRE(cas_kv_create(&o, &kv) == CAS_OK);
    int32_t t[20], a, b;
    cas_kv_match m;
    fill_tokens(t, 20, 7);
    REQUIRE(cas_kv_seq_create(kv, t, 20, &a, NULL) == CAS_OK);
    compute_all(kv, a);
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    REQUIRE(cas_kv_seq_create(kv, t, 20, &b, &m) == CAS_OK);
    CHECK(m.hit_tokens == 0 && m.pending_tokens == 0 && m.new_blocks == 5);
    cas_kv_stats st;
    cas_kv_get_stats(kv, &st);
    CHECK(st.blocks_hashed == 0 && st.blocks_cached == 0);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

static void test_chained_hash(void) {
    cas_kv *kv = make_kv(64, 4, 8, 16, 0);
    REQUIRE(kv);
    /* A = [X Y z], B = [W Y z]: the same block Y under different parents */
    int32_t A[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, B[9] = {11, 12, 13, 14, 5, 6, 7, 8, 9};
    int32_t a, b, c;
    cas_kv_match m;
    REQUIRE(cas_kv_seq_create(kv, A, 9, &a, NULL) == CAS_OK);
    compute_all(kv, a);
    REQUIRE(cas_kv_seq_create(kv, B, 9, &b, &m) == CAS_OK);
    CHECK(m.hit_tokens == 0 && m.pending_tokens == 0);
    compute_all(kv, b);
    const int32_t *ba = cas_kv_seq_blocks(kv, a), *bb = cas_kv_seq_blocks(kv, b);
    CHECK(ba[1] != bb[1]);
    CHECK(cas_kv_block_is_cached(kv, ba[1]) && cas_kv_block_is_cached(kv, bb[1]));
    /* each is found under its own chain */
    int32_t C[9] = {11, 12, 13, 14, 5, 6, 7, 8, 42};
    REQUIRE(cas_kv_seq_create(kv, C, 9, &c, &m) == CAS_OK);
    CHECK(m.hit_tokens == 8);
    const int32_t *bc = cas_kv_seq_blocks(kv, c);
    CHECK(bc[0] == bb[0] && bc[1] == bb[1]);
    CHECK(cas_kv_block_ref(kv, bb[1]) == 2);
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, c) == CAS_OK);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

static void test_lru_eviction(void) {
    /* 6 blocks of 2 tokens */
    cas_kv *kv = make_kv(6, 2, 8, 8, 0);
    REQUIRE(kv);
    int32_t A[5] = {1, 2, 3, 4, 5}, B[5] = {11, 12, 13, 14, 15}, X[6] = {21, 22, 23, 24, 25, 26};
    int32_t a, b, x;
    cas_kv_match m;
    REQUIRE(cas_kv_seq_create(kv, A, 5, &a, NULL) == CAS_OK); /* 2 full + 1 partial */
    REQUIRE(cas_kv_seq_create(kv, B, 5, &b, NULL) == CAS_OK);
    compute_all(kv, a);
    compute_all(kv, b);
    CHECK(cas_kv_num_free_blocks(kv) == 0);
    int32_t a0 = cas_kv_seq_blocks(kv, a)[0], a1 = cas_kv_seq_blocks(kv, a)[1];
    int32_t b0 = cas_kv_seq_blocks(kv, b)[0], b1 = cas_kv_seq_blocks(kv, b)[1];
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK); /* A freed first: older in the LRU */
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    cas_kv_stats st;
    cas_kv_get_stats(kv, &st);
    CHECK(st.blocks_cached == 4 && st.blocks_free == 2);
    /* X needs 3 blocks: the 2 uncached ones, then A's tail block (A's prefix
     * and all of B stay) */
    REQUIRE(cas_kv_seq_create(kv, X, 6, &x, NULL) == CAS_OK);
    const int32_t *bx = cas_kv_seq_blocks(kv, x);
    int took_a1 = 0, took_a0 = 0;
    for (int i = 0; i < 3; i++) {
        took_a1 |= bx[i] == a1;
        took_a0 |= bx[i] == a0;
    }
    CHECK(took_a1 && !took_a0);
    cas_kv_get_stats(kv, &st);
    CHECK(st.evictions == 1 && st.blocks_cached == 3);
    int32_t c;
    REQUIRE(cas_kv_seq_create(kv, A, 5, &c, &m) == CAS_OK);
    CHECKF(m.hit_tokens == 2, "hit %d", m.hit_tokens); /* only A's first block survived */
    CHECK(cas_kv_seq_blocks(kv, c)[0] == a0);
    /* A's 3 remaining tokens took 2 more blocks: the oldest cached ones, B's
     * tail block first, then its head */
    const int32_t *bc = cas_kv_seq_blocks(kv, c);
    CHECK(bc[1] == b1 && bc[2] == b0);
    cas_kv_get_stats(kv, &st);
    CHECK(st.evictions == 3 && st.blocks_cached == 0);
    CHECK(cas_kv_seq_free(kv, c) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, x) == CAS_OK);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

static void test_revive_on_hit(void) {
    cas_kv *kv = make_kv(8, 2, 4, 8, 0);
    REQUIRE(kv);
    int32_t A[5] = {1, 2, 3, 4, 5}, a, b;
    cas_kv_match m;
    REQUIRE(cas_kv_seq_create(kv, A, 5, &a, NULL) == CAS_OK);
    compute_all(kv, a);
    int32_t a0 = cas_kv_seq_blocks(kv, a)[0], a1 = cas_kv_seq_blocks(kv, a)[1];
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    CHECK(cas_kv_block_ref(kv, a0) == 0 && cas_kv_block_is_cached(kv, a0));
    CHECK(cas_kv_num_free_blocks(kv) == 8);
    REQUIRE(cas_kv_seq_create(kv, A, 5, &b, &m) == CAS_OK);
    CHECK(m.hit_tokens == 4 && m.new_blocks == 1);
    CHECK(cas_kv_block_ref(kv, a0) == 1 && cas_kv_block_ref(kv, a1) == 1);
    CHECK(cas_kv_num_free_blocks(kv) == 5); /* revived blocks left the free list */
    KV_OK(kv);
    /* a revived block is not evicted by later allocations */
    int32_t X[10], x;
    fill_tokens(X, 10, 50);
    REQUIRE(cas_kv_seq_create(kv, X, 10, &x, NULL) == CAS_OK);
    CHECK(cas_kv_seq_blocks(kv, b)[0] == a0 && cas_kv_seq_token(kv, b, 0) == 1);
    CHECK(cas_kv_seq_create(kv, X, 10, &a, NULL) == CAS_ERR_NOMEM);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, x) == CAS_OK);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

static void test_pool_exhaustion(void) {
    cas_kv *kv = make_kv(4, 4, 2, 8, 0);
    REQUIRE(kv);
    int32_t t[40], a, b, c;
    fill_tokens(t, 40, 1);
    CHECK(cas_kv_seq_create(kv, t, 17, &a, NULL) == CAS_ERR_NOMEM); /* 5 blocks */
    CHECK(a == -1 && cas_kv_num_free_blocks(kv) == 4);
    CHECK(cas_kv_seq_create(kv, t, 32, &a, NULL) == CAS_ERR_NOMEM);
    CHECK(cas_kv_seq_create(kv, t, 33, &a, NULL) == CAS_ERR_INVALID); /* > table capacity */
    REQUIRE(cas_kv_seq_create(kv, t, 14, &a, NULL) == CAS_OK);
    CHECK(cas_kv_seq_append(kv, a, t, 2) == CAS_OK);
    CHECK(cas_kv_seq_append(kv, a, t, 1) == CAS_ERR_NOMEM);
    CHECK(cas_kv_seq_num_tokens(kv, a) == 16 && cas_kv_seq_num_blocks(kv, a) == 4);
    int32_t f;
    cas_kv_copy cp;
    CHECK(cas_kv_seq_fork(kv, a, &f, &cp) == CAS_OK); /* all full: no block needed */
    CHECK(cp.src == -1);
    CHECK(cas_kv_seq_create(kv, NULL, 0, &c, NULL) == CAS_ERR_NOMEM); /* 2 handles */
    CHECK(cas_kv_seq_free(kv, f) == CAS_OK);
    REQUIRE(cas_kv_seq_create(kv, NULL, 0, &b, NULL) == CAS_OK);
    CHECK(cas_kv_seq_append(kv, b, t + 20, 1) == CAS_ERR_NOMEM);
    CHECK(cas_kv_seq_num_tokens(kv, b) == 0);
    KV_OK(kv);
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    CHECK(cas_kv_seq_append(kv, b, t + 20, 16) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    CHECK(cas_kv_num_free_blocks(kv) == 4);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

/* Cold-cache sharing at the block level: B attaches to A's pending blocks and
 * waits for them; A's commits release B block by block. */
static void test_pending_blocks(void) {
    cas_kv *kv = make_kv(32, 4, 4, 16, 0);
    REQUIRE(kv);
    int32_t P[14], Q[14], a, b;
    fill_tokens(P, 14, 1);
    memcpy(Q, P, sizeof Q);
    Q[12] = 77; /* same first 3 blocks */
    cas_kv_match m;
    REQUIRE(cas_kv_seq_create(kv, P, 14, &a, &m) == CAS_OK);
    REQUIRE(cas_kv_seq_create(kv, Q, 14, &b, &m) == CAS_OK);
    CHECK(m.hit_tokens == 0 && m.pending_tokens == 12 && m.new_blocks == 1);
    cas_kv_stats st;
    cas_kv_get_stats(kv, &st);
    CHECK(st.blocks_pending == 3 && st.pending_hit_tokens == 12);
    int32_t run, wait;
    CHECK(cas_kv_seq_ready(kv, b, &run, &wait) == CAS_OK);
    CHECK(run == 0 && wait == 1);
    CHECK(cas_kv_seq_claim(kv, b, 1) == CAS_ERR_INVALID); /* A is computing it */
    CHECK(cas_kv_seq_ready(kv, a, &run, &wait) == CAS_OK);
    CHECK(run == 14 && wait == 0);
    CHECK(cas_kv_seq_claim(kv, a, 6) == CAS_OK);
    CHECK(cas_kv_seq_commit(kv, a, 6) == CAS_OK);
    KV_OK(kv);
    CHECK(cas_kv_seq_ready(kv, b, &run, &wait) == CAS_OK);
    CHECK(run == 0 && wait == 1 && cas_kv_seq_num_computed(kv, b) == 4);
    CHECK(cas_kv_seq_claim(kv, a, 8) == CAS_OK);
    CHECK(cas_kv_seq_commit(kv, a, 8) == CAS_OK);
    CHECK(cas_kv_seq_ready(kv, b, &run, &wait) == CAS_OK);
    CHECK(run == 2 && wait == 0 && cas_kv_seq_num_computed(kv, b) == 12);
    cas_kv_get_stats(kv, &st);
    CHECK(st.blocks_pending == 0);
    CHECK(cas_kv_seq_commit(kv, b, 2) == CAS_OK); /* b's own block: filler from the start */
    CHECK(cas_kv_seq_commit(kv, b, 1) == CAS_ERR_INVALID); /* past its tokens */
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

/* cas_kv_match_peek answers what cas_kv_seq_create then finds (computed,
 * pending and new blocks) and changes nothing: no stats, no blocks. */
static void test_match_peek(void) {
    cas_kv *kv = make_kv(32, 4, 4, 16, 0);
    REQUIRE(kv);
    int32_t P[14], Q[22], a, b;
    fill_tokens(P, 14, 1);
    fill_tokens(Q, 22, 1); /* P's 3 full blocks, then more */
    cas_kv_match pk, m;
    cas_kv_match_peek(kv, Q, 22, &pk);
    CHECK(pk.hit_tokens == 0 && pk.pending_tokens == 0 && pk.new_blocks == 6);
    REQUIRE(cas_kv_seq_create(kv, P, 14, &a, &m) == CAS_OK);
    CHECK(cas_kv_seq_claim(kv, a, 6) == CAS_OK);
    CHECK(cas_kv_seq_commit(kv, a, 6) == CAS_OK); /* block 0 computed; 1 and 2 pending */
    cas_kv_stats before, after;
    cas_kv_get_stats(kv, &before);
    int32_t nfree = cas_kv_num_free_blocks(kv);
    cas_kv_match_peek(kv, Q, 22, &pk);
    CHECK(pk.hit_tokens == 4 && pk.pending_tokens == 8 && pk.new_blocks == 3);
    cas_kv_get_stats(kv, &after);
    CHECK(after.query_tokens == before.query_tokens && after.hit_tokens == before.hit_tokens &&
          after.pending_hit_tokens == before.pending_hit_tokens && after.seqs_active == 1);
    CHECK(cas_kv_num_free_blocks(kv) == nfree);
    REQUIRE(cas_kv_seq_create(kv, Q, 22, &b, &m) == CAS_OK);
    CHECK(m.hit_tokens == pk.hit_tokens && m.pending_tokens == pk.pending_tokens && m.new_blocks == pk.new_blocks);
    /* the block of the last token is never matched */
    cas_kv_match_peek(kv, P, 12, &pk);
    CHECK(pk.hit_tokens + pk.pending_tokens == 8 && pk.new_blocks == 1);
    cas_kv_match_peek(kv, P, 0, &pk);
    CHECK(pk.hit_tokens == 0 && pk.new_blocks == 0);
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

/* The filler leaves before computing: the waiter claims and computes. A
 * pending block nobody holds any more is dropped from the map. */
static void test_filler_leaves(void) {
    cas_kv *kv = make_kv(32, 4, 4, 16, 0);
    REQUIRE(kv);
    int32_t P[10], a, b, c;
    fill_tokens(P, 10, 1);
    cas_kv_match m;
    REQUIRE(cas_kv_seq_create(kv, P, 10, &a, NULL) == CAS_OK);
    REQUIRE(cas_kv_seq_create(kv, P, 10, &b, &m) == CAS_OK);
    CHECK(m.pending_tokens == 8);
    CHECK(cas_kv_seq_claim(kv, a, 5) == CAS_OK);
    CHECK(cas_kv_seq_commit(kv, a, 5) == CAS_OK); /* block 0 done, block 1 half */
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    KV_OK(kv);
    int32_t run, wait;
    CHECK(cas_kv_seq_ready(kv, b, &run, &wait) == CAS_OK);
    CHECK(cas_kv_seq_num_computed(kv, b) == 4 && run == 6 && wait == 0);
    CHECK(cas_kv_seq_claim(kv, b, run) == CAS_OK);
    CHECK(cas_kv_seq_commit(kv, b, run) == CAS_OK);
    KV_OK(kv);
    /* pending keys without holders vanish */
    REQUIRE(cas_kv_seq_create(kv, P + 1, 9, &c, NULL) == CAS_OK);
    cas_kv_stats st;
    cas_kv_get_stats(kv, &st);
    int32_t hashed = st.blocks_hashed;
    CHECK(st.blocks_pending == 2);
    CHECK(cas_kv_seq_free(kv, c) == CAS_OK);
    cas_kv_get_stats(kv, &st);
    CHECK(st.blocks_pending == 0 && st.blocks_hashed == hashed - 2);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

static void test_fork(void) {
    cas_kv *kv = make_kv(16, 4, 4, 8, 0);
    REQUIRE(kv);
    int32_t P[10], a, f;
    fill_tokens(P, 10, 1);
    REQUIRE(cas_kv_seq_create(kv, P, 10, &a, NULL) == CAS_OK);
    compute_all(kv, a);
    cas_kv_copy cp;
    REQUIRE(cas_kv_seq_fork(kv, a, &f, &cp) == CAS_OK);
    KV_OK(kv);
    const int32_t *ba = cas_kv_seq_blocks(kv, a), *bf = cas_kv_seq_blocks(kv, f);
    CHECK(bf[0] == ba[0] && bf[1] == ba[1] && bf[2] != ba[2]);
    CHECK(cp.src == ba[2] && cp.dst == bf[2] && cp.n_tokens == 2);
    CHECK(cas_kv_block_ref(kv, ba[0]) == 2);
    CHECK(cas_kv_seq_num_computed(kv, f) == 10);
    int32_t x = 500, y = 600;
    CHECK(cas_kv_seq_append(kv, a, &x, 1) == CAS_OK);
    CHECK(cas_kv_seq_append(kv, f, &y, 1) == CAS_OK);
    CHECK(cas_kv_seq_token(kv, a, 10) == 500 && cas_kv_seq_token(kv, f, 10) == 600);
    CHECK(cas_kv_seq_token(kv, f, 9) == 10);
    KV_OK(kv);
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, f) == CAS_OK);
    CHECK(cas_kv_num_free_blocks(kv) == 16);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

/* ---- randomized workload with a fake KV ------------------------------------ */

static uint64_t mix(uint64_t h, int32_t t) {
    uint64_t z = h ^ ((uint64_t)(uint32_t)t * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#define RS_MAXSEQ 12
#define RS_MAXTOK 96

typedef struct {
    int live;
    int32_t seq, n;
    int32_t tok[RS_MAXTOK];
    uint64_t chain[RS_MAXTOK]; /* chain value after each token */
} rs_seq;

static void rs_rechain(rs_seq *q) {
    uint64_t h = 0x1234;
    for (int32_t i = 0; i < q->n; i++) q->chain[i] = h = mix(h, q->tok[i]);
}

/* Checks that every computed position of q reads its own prefix's value. */
static int rs_verify(const cas_kv *kv, const rs_seq *q, const uint64_t *mem, int32_t ps) {
    int32_t c = cas_kv_seq_num_computed(kv, q->seq);
    const int32_t *b = cas_kv_seq_blocks(kv, q->seq);
    for (int32_t p = 0; p < c; p++) {
        if (mem[(size_t)b[p / ps] * ps + p % ps] != q->chain[p]) return 0;
        if (cas_kv_seq_token(kv, q->seq, p) != q->tok[p]) return 0;
    }
    return 1;
}

static void random_workload(uint64_t seed, uint64_t mask, int32_t nb, int32_t ps, int steps) {
    cas_kv *kv = make_kv(nb, ps, RS_MAXSEQ, RS_MAXTOK / ps + 1, mask);
    REQUIRE(kv);
    cas_rng rng;
    cas_rng_seed(&rng, seed);
    uint64_t *mem = calloc((size_t)nb * ps, sizeof *mem);
    rs_seq *qs = calloc(RS_MAXSEQ, sizeof *qs);
    /* a few templates so prefixes are shared */
    int32_t tmpl[4][RS_MAXTOK];
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < RS_MAXTOK; i++) tmpl[k][i] = (int32_t)cas_rng_range(&rng, 0, 5);
    int nomem = 0, bad = 0, ops = 0;
    for (int step = 0; step < steps && !bad; step++) {
        int i = (int)cas_rng_range(&rng, 0, RS_MAXSEQ - 1);
        rs_seq *q = &qs[i];
        int op = (int)cas_rng_range(&rng, 0, 9);
        cas_status st = CAS_OK;
        if (!q->live) {
            int k = (int)cas_rng_range(&rng, 0, 3);
            q->n = (int32_t)cas_rng_range(&rng, 1, RS_MAXTOK / 2);
            int32_t keep = (int32_t)cas_rng_range(&rng, 0, q->n);
            for (int32_t p = 0; p < q->n; p++)
                q->tok[p] = p < keep ? tmpl[k][p] : (int32_t)cas_rng_range(&rng, 0, 5);
            if (op == 0) { /* fork a random live sequence instead */
                int j = (int)cas_rng_range(&rng, 0, RS_MAXSEQ - 1);
                if (qs[j].live) {
                    int32_t child;
                    cas_kv_copy cp;
                    st = cas_kv_seq_fork(kv, qs[j].seq, &child, &cp);
                    if (st == CAS_OK) {
                        *q = qs[j];
                        q->seq = child;
                        if (cp.src >= 0)
                            memcpy(&mem[(size_t)cp.dst * ps], &mem[(size_t)cp.src * ps],
                                   (size_t)cp.n_tokens * sizeof *mem);
                    }
                    goto done;
                }
            }
            rs_rechain(q);
            st = cas_kv_seq_create(kv, q->tok, q->n, &q->seq, NULL);
            if (st == CAS_OK) q->live = 1;
        } else if (op < 2) {
            st = cas_kv_seq_free(kv, q->seq);
            q->live = 0;
        } else if (op < 4 && q->n < RS_MAXTOK) {
            int32_t k = (int32_t)cas_rng_range(&rng, 1, RS_MAXTOK - q->n < 6 ? RS_MAXTOK - q->n : 6);
            int32_t add[6];
            for (int32_t p = 0; p < k; p++) add[p] = (int32_t)cas_rng_range(&rng, 0, 5);
            st = cas_kv_seq_append(kv, q->seq, add, k);
            if (st == CAS_OK) {
                memcpy(q->tok + q->n, add, (size_t)k * sizeof *add);
                q->n += k;
                rs_rechain(q);
            }
        } else { /* compute a chunk: write the fake KV, then commit */
            int32_t run, wait;
            st = cas_kv_seq_ready(kv, q->seq, &run, &wait);
            if (st == CAS_OK && run > 0) {
                int32_t n = (int32_t)cas_rng_range(&rng, 1, run);
                int32_t c = cas_kv_seq_num_computed(kv, q->seq);
                /* everything before c must already hold this prefix */
                if (!rs_verify(kv, q, mem, ps)) bad = 1;
                st = cas_kv_seq_claim(kv, q->seq, n);
                const int32_t *b = cas_kv_seq_blocks(kv, q->seq);
                for (int32_t p = c; p < c + n && st == CAS_OK; p++) {
                    uint64_t prev = p == 0 ? 0x1234 : mem[(size_t)b[(p - 1) / ps] * ps + (p - 1) % ps];
                    mem[(size_t)b[p / ps] * ps + p % ps] = mix(prev, q->tok[p]);
                }
                if (st == CAS_OK) st = cas_kv_seq_commit(kv, q->seq, n);
            }
        }
    done:
        ops++;
        if (st == CAS_ERR_NOMEM) nomem++;
        else CHECKF(st == CAS_OK, "op %d: %s", op, cas_last_error());
        CHECKF(cas_kv_check(kv) == CAS_OK, "step %d: %s", step, cas_last_error());
        if (q->live && !rs_verify(kv, q, mem, ps)) bad = 1;
    }
    CHECKF(!bad, "a sequence read KV of another prefix (seed %llu)", (unsigned long long)seed);
    for (int i = 0; i < RS_MAXSEQ; i++)
        if (qs[i].live) {
            CHECK(rs_verify(kv, &qs[i], mem, ps));
            CHECK(cas_kv_seq_free(kv, qs[i].seq) == CAS_OK);
        }
    cas_kv_stats st;
    cas_kv_get_stats(kv, &st);
    CHECK(st.blocks_used == 0 && st.blocks_free + st.blocks_cached == nb && st.seqs_active == 0);
    CHECK(st.blocks_pending == 0);
    CHECK(st.hit_tokens + st.pending_hit_tokens > 0);
    if (mask) CHECK(st.collisions > 0);
    CHECK(nomem > 0);
    KV_OK(kv);
    free(mem);
    free(qs);
    cas_kv_destroy(kv);
}

static void test_random_workload(void) {
    for (uint64_t seed = 1; seed <= 6; seed++) random_workload(seed, 0, 40, 4, 4000);
    random_workload(7, 0, 24, 1, 4000);
    random_workload(8, 0, 20, 7, 4000);
}

/* A 2-bit hash: almost every key collides; matches must still be exact. */
static void test_collisions_guarded(void) {
    for (uint64_t seed = 11; seed <= 14; seed++) random_workload(seed, 0x3, 40, 4, 4000);
    random_workload(15, 0x1, 30, 2, 4000);
    /* a direct case: two different blocks under the same 1-bit hash space */
    cas_kv *kv = make_kv(16, 2, 4, 8, 0x1);
    REQUIRE(kv);
    int32_t A[3] = {1, 2, 3}, B[3] = {4, 5, 6}, C[3] = {7, 8, 9}, a, b, c;
    cas_kv_match m;
    REQUIRE(cas_kv_seq_create(kv, A, 3, &a, NULL) == CAS_OK);
    compute_all(kv, a);
    REQUIRE(cas_kv_seq_create(kv, B, 3, &b, &m) == CAS_OK);
    CHECK(m.hit_tokens == 0 && m.pending_tokens == 0);
    REQUIRE(cas_kv_seq_create(kv, C, 3, &c, &m) == CAS_OK);
    CHECK(m.hit_tokens == 0 && m.pending_tokens == 0);
    for (int p = 0; p < 3; p++) CHECK(cas_kv_seq_token(kv, c, p) == C[p]);
    cas_kv_stats st;
    cas_kv_get_stats(kv, &st);
    CHECK(st.collisions >= 1);
    CHECK(cas_kv_seq_free(kv, a) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, b) == CAS_OK);
    CHECK(cas_kv_seq_free(kv, c) == CAS_OK);
    KV_OK(kv);
    cas_kv_destroy(kv);
}

int main(void) {
    RUN(test_create_bad);
    RUN(test_alloc_free);
    RUN(test_prefix_hit_miss);
    RUN(test_prefix_cache_off);
    RUN(test_chained_hash);
    RUN(test_lru_eviction);
    RUN(test_revive_on_hit);
    RUN(test_pool_exhaustion);
    RUN(test_pending_blocks);
    RUN(test_match_peek);
    RUN(test_filler_leaves);
    RUN(test_fork);
    RUN(test_random_workload);
    RUN(test_collisions_guarded);
    return check_summary();
}
