/*
 * kv.c: the KV block pool, block tables and the prefix cache (see kv.h for
 * the contract). Everything lives in flat arrays allocated once: the block
 * records, the token ids of every block (num_blocks * page_size int32, tiny
 * next to the KV itself), one block table per sequence handle, and an
 * open-addressing hash map (linear probing, backward-shift deletion, so no
 * tombstones pile up) from chained block hash to block id. The free list is
 * an intrusive doubly linked list through the block records, so taking,
 * reviving and releasing a block are O(1).
 *
 * A match is verified by the block's tokens and by its parent: the parent's
 * block id and the generation that block had when the child was filled
 * (bumped on every reuse). Matching walks from the first block, so by
 * induction a matched run holds exactly the sequence's tokens, whatever the
 * hash width; a key whose parent was evicted (an orphan) fails the check, and
 * when nobody holds it it is dropped so the key can be refilled.
 */
#include "kv.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

typedef struct {
    uint64_t hash;        /* chained hash, valid when hashed */
    uint64_t parent_hash; /* the hash it was chained from */
    int32_t parent;       /* parent block id when filled (-1: first block) */
    uint32_t parent_gen;  /* the parent's generation then */
    uint32_t gen;         /* bumped each time the block is allocated */
    int32_t ref;          /* block-table references */
    int32_t ntok;         /* tokens written, 0 .. page_size */
    int32_t prev, next;   /* free-list links while ref == 0 (-1 ends) */
    int32_t filler;       /* sequence computing it; -1 when computed or left */
    uint8_t hashed;       /* full, hash/parent fields valid */
    uint8_t in_map;       /* the map's entry for hash is this block */
    uint8_t computed;     /* full and its KV computed */
} kv_block;

typedef struct {
    int32_t active;
    int32_t ntok;     /* tokens known */
    int32_t computed; /* tokens with valid KV, from position 0 */
    int32_t nblocks;
    int32_t *blocks;  /* [max_blocks_per_seq], into cas_kv.tables */
} kv_seq;

struct cas_kv {
    int32_t num_blocks, page_size, max_seqs, max_bps;
    int32_t prefix_cache, debug;
    uint64_t seed, mask;

    kv_block *blk;   /* [num_blocks] */
    int32_t *tok;    /* [num_blocks][page_size] token ids */
    int32_t head, tail, nfree, ncached;

    uint64_t *mkey;  /* [mcap] */
    int32_t *mval;   /* [mcap], -1 empty */
    size_t mcap;
    int mshift;
    int32_t mcount;

    kv_seq *seqs;     /* [max_seqs] */
    int32_t *tables;  /* [max_seqs][max_bps] */
    int32_t *hstack;  /* [max_seqs] free handles */
    int32_t nhfree;
    int32_t *scratch; /* [max_bps] matched blocks */
    int32_t *chk_ref, *chk_fill; /* [num_blocks] check scratch */

    int64_t query_tokens, hit_tokens, pending_hit_tokens, evictions, collisions;
};

/* ---- options ------------------------------------------------------------ */

cas_kv_opts cas_kv_opts_default(void) {
    cas_kv_opts o;
    memset(&o, 0, sizeof o);
    o.num_blocks = 1024;
    o.page_size = 16;
    o.max_seqs = 256;
    o.max_blocks_per_seq = 512;
    o.enable_prefix_cache = 1;
    o.hash_seed = 0x63617363616465ull; /* "cascade" */
    o.hash_mask = 0;
    o.debug_checks = 0;
    return o;
}

/* ---- hash map ------------------------------------------------------------ */

static size_t map_home(const cas_kv *kv, uint64_t h) {
    return (size_t)((h * 0x9E3779B97F4A7C15ull) >> kv->mshift);
}

static int32_t map_find(const cas_kv *kv, uint64_t h) {
    size_t m = kv->mcap - 1;
    for (size_t i = map_home(kv, h);; i = (i + 1) & m) {
        if (kv->mval[i] < 0) return -1;
        if (kv->mkey[i] == h) return kv->mval[i];
    }
}

static void map_insert(cas_kv *kv, uint64_t h, int32_t b) {
    size_t m = kv->mcap - 1, i = map_home(kv, h);
    while (kv->mval[i] >= 0) i = (i + 1) & m;
    kv->mkey[i] = h;
    kv->mval[i] = b;
    kv->mcount++;
}

static void map_remove(cas_kv *kv, uint64_t h) {
    size_t m = kv->mcap - 1, i = map_home(kv, h);
    while (kv->mval[i] >= 0 && kv->mkey[i] != h) i = (i + 1) & m;
    if (kv->mval[i] < 0) return;
    /* backward shift: pull later entries of the probe run into the hole when
     * their home does not lie cyclically in (hole, their slot] */
    size_t j = i;
    for (;;) {
        j = (j + 1) & m;
        if (kv->mval[j] < 0) break;
        size_t k = map_home(kv, kv->mkey[j]);
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        kv->mkey[i] = kv->mkey[j];
        kv->mval[i] = kv->mval[j];
        i = j;
    }
    kv->mval[i] = -1;
    kv->mcount--;
}

/* ---- free list ----------------------------------------------------------- */

static void list_remove(cas_kv *kv, int32_t b) {
    kv_block *x = &kv->blk[b];
    if (x->prev >= 0) kv->blk[x->prev].next = x->next; else kv->head = x->next;
    if (x->next >= 0) kv->blk[x->next].prev = x->prev; else kv->tail = x->prev;
    x->prev = x->next = -1;
    kv->nfree--;
    if (x->in_map) kv->ncached--;
}

static void list_push_head(cas_kv *kv, int32_t b) {
    kv_block *x = &kv->blk[b];
    x->prev = -1;
    x->next = kv->head;
    if (kv->head >= 0) kv->blk[kv->head].prev = b; else kv->tail = b;
    kv->head = b;
    kv->nfree++;
    if (x->in_map) kv->ncached++;
}

static void list_push_tail(cas_kv *kv, int32_t b) {
    kv_block *x = &kv->blk[b];
    x->next = -1;
    x->prev = kv->tail;
    if (kv->tail >= 0) kv->blk[kv->tail].next = b; else kv->head = b;
    kv->tail = b;
    kv->nfree++;
    if (x->in_map) kv->ncached++;
}

/* ---- blocks -------------------------------------------------------------- */

static uint64_t block_hash(const cas_kv *kv, const int32_t *toks, uint64_t parent) {
    uint64_t h = XXH3_64bits_withSeed(toks, (size_t)kv->page_size * sizeof(int32_t), parent);
    return h & kv->mask;
}

/* Drops a ref-0 cached block from the map: it stays on the free list, moved to
 * the head since it no longer holds anything reusable. */
static void drop_cached(cas_kv *kv, int32_t b) {
    kv_block *x = &kv->blk[b];
    list_remove(kv, b);
    map_remove(kv, x->hash);
    x->in_map = 0;
    list_push_head(kv, b);
}

/* Takes the head of the free list (evicting it if cached) for sequence s. */
static int32_t block_alloc(cas_kv *kv, int32_t s) {
    int32_t b = kv->head;
    CAS_ASSERT(b >= 0);
    list_remove(kv, b);
    kv_block *x = &kv->blk[b];
    if (x->in_map) {
        map_remove(kv, x->hash);
        kv->evictions++;
    }
    uint32_t gen = x->gen + 1;
    memset(x, 0, sizeof *x);
    x->gen = gen;
    x->ref = 1;
    x->prev = x->next = -1;
    x->parent = -1;
    x->filler = s;
    return b;
}

/* One reference of sequence s to block b goes away. */
static void block_release(cas_kv *kv, int32_t b, int32_t s) {
    kv_block *x = &kv->blk[b];
    if (x->filler == s) x->filler = -1;
    if (--x->ref > 0) return;
    if (x->in_map && x->computed) {
        list_push_tail(kv, b);
        return;
    }
    if (x->in_map) { /* pending key nobody will compute */
        map_remove(kv, x->hash);
        x->in_map = 0;
    }
    list_push_head(kv, b);
}

/* Is the keyed block c a valid child of parent block pb (with generation
 * pgen) holding toks? */
static int block_matches(const cas_kv *kv, int32_t c, int32_t pb, uint64_t phash,
                         const int32_t *toks) {
    const kv_block *x = &kv->blk[c];
    if (x->parent != pb || x->parent_hash != phash) return 0;
    if (pb >= 0 && x->parent_gen != kv->blk[pb].gen) return 0;
    return memcmp(&kv->tok[(size_t)c * kv->page_size], toks,
                  (size_t)kv->page_size * sizeof(int32_t)) == 0;
}

/* Tries to make block i of sequence q (full, hashed) the map's entry for its
 * hash; a ref-0 entry that is not a valid match (orphan, collision) is
 * dropped to make room. */
static void block_register(cas_kv *kv, kv_seq *q, int32_t i) {
    int32_t b = q->blocks[i];
    kv_block *x = &kv->blk[b];
    int32_t c = map_find(kv, x->hash);
    if (c >= 0) {
        int32_t pb = i > 0 ? q->blocks[i - 1] : -1;
        if (kv->blk[c].ref > 0 ||
            block_matches(kv, c, pb, x->parent_hash, &kv->tok[(size_t)b * kv->page_size]))
            return; /* a live or equal block keeps the key; b stays private */
        drop_cached(kv, c);
    }
    map_insert(kv, x->hash, b);
    x->in_map = 1;
}

/* Block i of sequence q has just become full. */
static void block_filled(cas_kv *kv, kv_seq *q, int32_t i) {
    if (!kv->prefix_cache) return;
    int32_t b = q->blocks[i];
    kv_block *x = &kv->blk[b];
    int32_t pb = i > 0 ? q->blocks[i - 1] : -1;
    x->parent = pb;
    x->parent_gen = pb >= 0 ? kv->blk[pb].gen : 0;
    x->parent_hash = pb >= 0 ? kv->blk[pb].hash : kv->seed;
    x->hash = block_hash(kv, &kv->tok[(size_t)b * kv->page_size], x->parent_hash);
    x->hashed = 1;
    block_register(kv, q, i);
}

/* ---- create / destroy ------------------------------------------------------ */

cas_status cas_kv_create(const cas_kv_opts *opts, cas_kv **out) {
    if (!opts || !out) return cas_error(CAS_ERR_INVALID, "kv_create: NULL argument");
    *out = NULL;
    if (opts->num_blocks < 1 || opts->page_size < 1 || opts->max_seqs < 1 ||
        opts->max_blocks_per_seq < 1)
        return cas_error(CAS_ERR_INVALID,
                         "kv_create: num_blocks (%d), page_size (%d), max_seqs (%d) and "
                         "max_blocks_per_seq (%d) must be >= 1",
                         opts->num_blocks, opts->page_size, opts->max_seqs,
                         opts->max_blocks_per_seq);
    if ((int64_t)opts->max_blocks_per_seq * opts->page_size > INT32_MAX ||
        (int64_t)opts->num_blocks * opts->page_size > INT32_MAX)
        return cas_error(CAS_ERR_INVALID, "kv_create: token counts overflow int32");
    cas_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return cas_error(CAS_ERR_NOMEM, "kv_create: out of memory");
    kv->num_blocks = opts->num_blocks;
    kv->page_size = opts->page_size;
    kv->max_seqs = opts->max_seqs;
    kv->max_bps = opts->max_blocks_per_seq;
    kv->prefix_cache = opts->enable_prefix_cache != 0;
    kv->debug = opts->debug_checks != 0;
    kv->seed = opts->hash_seed;
    kv->mask = opts->hash_mask ? opts->hash_mask : ~0ull;

    int bits = 4;
    while (((size_t)1 << bits) < (size_t)kv->num_blocks * 2) bits++;
    kv->mcap = (size_t)1 << bits;
    kv->mshift = 64 - bits;

    size_t nb = (size_t)kv->num_blocks, ns = (size_t)kv->max_seqs;
    kv->blk = cas_alloc_array(nb, sizeof *kv->blk);
    kv->tok = cas_alloc_array(nb * (size_t)kv->page_size, sizeof(int32_t));
    kv->mkey = cas_alloc_array(kv->mcap, sizeof *kv->mkey);
    kv->mval = cas_alloc_array(kv->mcap, sizeof *kv->mval);
    kv->seqs = cas_alloc_array(ns, sizeof *kv->seqs);
    kv->tables = cas_alloc_array(ns * (size_t)kv->max_bps, sizeof(int32_t));
    kv->hstack = cas_alloc_array(ns, sizeof(int32_t));
    kv->scratch = cas_alloc_array((size_t)kv->max_bps, sizeof(int32_t));
    kv->chk_ref = cas_alloc_array(nb, sizeof(int32_t));
    kv->chk_fill = cas_alloc_array(nb, sizeof(int32_t));
    if (!kv->blk || !kv->tok || !kv->mkey || !kv->mval || !kv->seqs || !kv->tables ||
        !kv->hstack || !kv->scratch || !kv->chk_ref || !kv->chk_fill) {
        cas_kv_destroy(kv);
        return cas_error(CAS_ERR_NOMEM, "kv_create: out of memory for %d blocks x %d tokens",
                         opts->num_blocks, opts->page_size);
    }
    memset(kv->blk, 0, nb * sizeof *kv->blk);
    memset(kv->tok, 0, nb * (size_t)kv->page_size * sizeof(int32_t));
    for (size_t i = 0; i < kv->mcap; i++) kv->mval[i] = -1;
    kv->head = kv->tail = -1;
    for (int32_t b = 0; b < kv->num_blocks; b++) {
        kv->blk[b].filler = -1;
        kv->blk[b].parent = -1;
        list_push_tail(kv, b);
    }
    for (size_t s = 0; s < ns; s++) {
        kv->seqs[s].active = 0;
        kv->seqs[s].blocks = kv->tables + s * (size_t)kv->max_bps;
        kv->hstack[ns - 1 - s] = (int32_t)s; /* handle 0 is taken first */
    }
    kv->nhfree = kv->max_seqs;
    *out = kv;
    return CAS_OK;
}

void cas_kv_destroy(cas_kv *kv) {
    if (!kv) return;
    cas_free(kv->blk);
    cas_free(kv->tok);
    cas_free(kv->mkey);
    cas_free(kv->mval);
    cas_free(kv->seqs);
    cas_free(kv->tables);
    cas_free(kv->hstack);
    cas_free(kv->scratch);
    cas_free(kv->chk_ref);
    cas_free(kv->chk_fill);
    free(kv);
}

/* ---- sequences ------------------------------------------------------------- */

static kv_seq *seq_get(const cas_kv *kv, int32_t s) {
    if (!kv || s < 0 || s >= kv->max_seqs || !kv->seqs[s].active) return NULL;
    return &kv->seqs[s];
}

static cas_status debug_check(const cas_kv *kv, const char *op) {
    if (!kv->debug) return CAS_OK;
    cas_status st = cas_kv_check(kv);
    if (st != CAS_OK) {
        cas_log(CAS_LOG_ERROR, "kv: invariant broken after %s: %s", op, cas_last_error());
        return st;
    }
    return CAS_OK;
}

/* New blocks needed to append n tokens to q (0 when they fit in the last). */
static int64_t blocks_to_append(const cas_kv *kv, const kv_seq *q, int64_t n) {
    int64_t room = (int64_t)q->nblocks * kv->page_size - q->ntok;
    if (n <= room) return 0;
    return (n - room + kv->page_size - 1) / kv->page_size;
}

/* Appends after the capacity checks passed: cannot fail. */
static void seq_append(cas_kv *kv, int32_t s, const int32_t *toks, int32_t n) {
    kv_seq *q = &kv->seqs[s];
    int32_t ps = kv->page_size;
    int32_t i = 0;
    while (i < n) {
        if (q->ntok == q->nblocks * ps) q->blocks[q->nblocks++] = block_alloc(kv, s);
        int32_t bi = q->nblocks - 1, b = q->blocks[bi];
        kv_block *x = &kv->blk[b];
        int32_t k = ps - x->ntok;
        if (k > n - i) k = n - i;
        memcpy(&kv->tok[(size_t)b * ps + (size_t)x->ntok], toks + i, (size_t)k * sizeof(int32_t));
        x->ntok += k;
        q->ntok += k;
        i += k;
        if (x->ntok == ps) block_filled(kv, q, bi);
    }
}

cas_status cas_kv_seq_create(cas_kv *kv, const int32_t *tokens, int32_t n, int32_t *seq,
                             cas_kv_match *match) {
    if (!kv || !seq || n < 0 || (n > 0 && !tokens))
        return cas_error(CAS_ERR_INVALID, "kv_seq_create: bad argument (n = %d)", n);
    *seq = -1;
    if (match) memset(match, 0, sizeof *match);
    if ((int64_t)n > (int64_t)kv->max_bps * kv->page_size)
        return cas_error(CAS_ERR_INVALID,
                         "kv_seq_create: %d tokens exceed the block-table capacity (%d tokens)",
                         n, kv->max_bps * kv->page_size);
    if (kv->nhfree == 0)
        return cas_error(CAS_ERR_NOMEM, "kv_seq_create: all %d sequence handles in use",
                         kv->max_seqs);
    int32_t ps = kv->page_size, nmatch = 0, revive = 0, nhit = 0;
    if (kv->prefix_cache && n > 0) {
        int32_t maxm = (n - 1) / ps; /* never the block holding the last token */
        uint64_t parent = kv->seed;
        int32_t pb = -1;
        for (int32_t i = 0; i < maxm; i++) {
            const int32_t *t = tokens + (size_t)i * ps;
            uint64_t h = block_hash(kv, t, parent);
            int32_t c = map_find(kv, h);
            if (c < 0) break;
            if (!block_matches(kv, c, pb, parent, t)) {
                kv->collisions++;
                if (kv->blk[c].ref == 0) drop_cached(kv, c);
                break;
            }
            kv->scratch[nmatch++] = c;
            if (kv->blk[c].ref == 0) revive++;
            if (kv->blk[c].computed && nhit == i) nhit = i + 1;
            parent = h;
            pb = c;
        }
    }
    int64_t rest = (int64_t)n - (int64_t)nmatch * ps;
    int64_t newb = (rest + ps - 1) / ps;
    if (newb > (int64_t)kv->nfree - revive)
        return cas_error(CAS_ERR_NOMEM,
                         "kv_seq_create: %lld blocks needed, %d free", (long long)newb,
                         kv->nfree - revive);
    int32_t s = kv->hstack[--kv->nhfree];
    kv_seq *q = &kv->seqs[s];
    q->active = 1;
    q->ntok = nmatch * ps;
    q->computed = 0;
    q->nblocks = nmatch;
    for (int32_t i = 0; i < nmatch; i++) {
        int32_t b = kv->scratch[i];
        if (kv->blk[b].ref == 0) list_remove(kv, b);
        kv->blk[b].ref++;
        q->blocks[i] = b;
    }
    if (rest > 0) seq_append(kv, s, tokens + (size_t)nmatch * ps, (int32_t)rest);
    if (kv->prefix_cache) {
        kv->query_tokens += n;
        kv->hit_tokens += (int64_t)nhit * ps;
        kv->pending_hit_tokens += (int64_t)(nmatch - nhit) * ps;
    }
    if (match) {
        match->hit_tokens = nhit * ps;
        match->pending_tokens = (nmatch - nhit) * ps;
        match->new_blocks = (int32_t)newb;
    }
    *seq = s;
    return debug_check(kv, "seq_create");
}

void cas_kv_match_peek(const cas_kv *kv, const int32_t *tokens, int32_t n, cas_kv_match *match) {
    memset(match, 0, sizeof *match);
    if (!kv || n <= 0 || !tokens) return;
    int32_t ps = kv->page_size, nmatch = 0, nhit = 0;
    if (kv->prefix_cache) {
        /* the loop of cas_kv_seq_create, without its side effects */
        int32_t maxm = (n - 1) / ps;
        uint64_t parent = kv->seed;
        int32_t pb = -1;
        for (int32_t i = 0; i < maxm; i++) {
            const int32_t *t = tokens + (size_t)i * ps;
            uint64_t h = block_hash(kv, t, parent);
            int32_t c = map_find(kv, h);
            if (c < 0 || !block_matches(kv, c, pb, parent, t)) break;
            nmatch++;
            if (kv->blk[c].computed && nhit == i) nhit = i + 1;
            parent = h;
            pb = c;
        }
    }
    match->hit_tokens = nhit * ps;
    match->pending_tokens = (nmatch - nhit) * ps;
    match->new_blocks = cas_kv_blocks_for(kv, (int64_t)n - (int64_t)nmatch * ps);
}

cas_status cas_kv_seq_append(cas_kv *kv, int32_t seq, const int32_t *tokens, int32_t n) {
    kv_seq *q = seq_get(kv, seq);
    if (!q) return cas_error(CAS_ERR_INVALID, "kv_seq_append: bad sequence %d", seq);
    if (n < 0 || (n > 0 && !tokens))
        return cas_error(CAS_ERR_INVALID, "kv_seq_append: bad token array (n = %d)", n);
    if (n == 0) return CAS_OK;
    int64_t newb = blocks_to_append(kv, q, n);
    if (q->nblocks + newb > kv->max_bps)
        return cas_error(CAS_ERR_INVALID,
                         "kv_seq_append: sequence %d would exceed %d tokens", seq,
                         kv->max_bps * kv->page_size);
    if (newb > kv->nfree)
        return cas_error(CAS_ERR_NOMEM, "kv_seq_append: %lld blocks needed, %d free",
                         (long long)newb, kv->nfree);
    seq_append(kv, seq, tokens, n);
    return debug_check(kv, "seq_append");
}

cas_status cas_kv_seq_fork(cas_kv *kv, int32_t parent, int32_t *child, cas_kv_copy *copy) {
    kv_seq *p = seq_get(kv, parent);
    if (!p || !child || !copy)
        return cas_error(CAS_ERR_INVALID, "kv_seq_fork: bad sequence %d or NULL output", parent);
    *child = -1;
    copy->src = copy->dst = -1;
    copy->n_tokens = 0;
    int32_t ps = kv->page_size;
    int partial = p->ntok % ps != 0;
    if (kv->nhfree == 0)
        return cas_error(CAS_ERR_NOMEM, "kv_seq_fork: all %d sequence handles in use",
                         kv->max_seqs);
    if (partial && kv->nfree == 0)
        return cas_error(CAS_ERR_NOMEM, "kv_seq_fork: no free block for the last page");
    int32_t s = kv->hstack[--kv->nhfree];
    kv_seq *q = &kv->seqs[s];
    p = &kv->seqs[parent];
    q->active = 1;
    q->ntok = p->ntok;
    q->computed = p->computed;
    q->nblocks = p->nblocks;
    int32_t nfull = partial ? p->nblocks - 1 : p->nblocks;
    for (int32_t i = 0; i < nfull; i++) {
        q->blocks[i] = p->blocks[i];
        kv->blk[p->blocks[i]].ref++;
    }
    if (partial) {
        int32_t src = p->blocks[nfull];
        int32_t dst = block_alloc(kv, s);
        kv->blk[dst].ntok = kv->blk[src].ntok;
        memcpy(&kv->tok[(size_t)dst * ps], &kv->tok[(size_t)src * ps],
               (size_t)kv->blk[src].ntok * sizeof(int32_t));
        q->blocks[nfull] = dst;
        int32_t done = p->computed - nfull * ps;
        copy->src = src;
        copy->dst = dst;
        copy->n_tokens = done > 0 ? done : 0;
    }
    *child = s;
    return debug_check(kv, "seq_fork");
}

cas_status cas_kv_seq_free(cas_kv *kv, int32_t seq) {
    kv_seq *q = seq_get(kv, seq);
    if (!q) return cas_error(CAS_ERR_INVALID, "kv_seq_free: bad sequence %d", seq);
    for (int32_t i = q->nblocks - 1; i >= 0; i--) block_release(kv, q->blocks[i], seq);
    q->active = 0;
    q->nblocks = q->ntok = q->computed = 0;
    kv->hstack[kv->nhfree++] = seq;
    return debug_check(kv, "seq_free");
}

cas_status cas_kv_seq_ready(cas_kv *kv, int32_t seq, int32_t *runnable, int32_t *waiting) {
    kv_seq *q = seq_get(kv, seq);
    if (!q || !runnable)
        return cas_error(CAS_ERR_INVALID, "kv_seq_ready: bad sequence %d", seq);
    int32_t ps = kv->page_size, pos = q->computed, run = 0, wait = 0;
    while (pos < q->ntok) {
        int32_t i = pos / ps;
        const kv_block *x = &kv->blk[q->blocks[i]];
        if (x->computed) {
            if (run > 0) break;
            q->computed = pos = (i + 1) * ps;
            continue;
        }
        if (x->filler >= 0 && x->filler != seq) {
            wait = 1;
            break;
        }
        int32_t end = (i + 1) * ps < q->ntok ? (i + 1) * ps : q->ntok;
        run += end - pos;
        pos = end;
    }
    *runnable = run;
    if (waiting) *waiting = wait;
    return CAS_OK;
}

cas_status cas_kv_seq_claim(cas_kv *kv, int32_t seq, int32_t n) {
    kv_seq *q = seq_get(kv, seq);
    if (!q) return cas_error(CAS_ERR_INVALID, "kv_seq_claim: bad sequence %d", seq);
    if (n < 0 || q->computed + (int64_t)n > q->ntok)
        return cas_error(CAS_ERR_INVALID, "kv_seq_claim: %d tokens from %d exceed %d known", n,
                         q->computed, q->ntok);
    if (n == 0) return CAS_OK;
    int32_t ps = kv->page_size;
    int32_t b0 = q->computed / ps, b1 = (q->computed + n - 1) / ps;
    for (int32_t i = b0; i <= b1; i++) {
        const kv_block *x = &kv->blk[q->blocks[i]];
        if (x->computed || (x->filler >= 0 && x->filler != seq))
            return cas_error(CAS_ERR_INVALID,
                             "kv_seq_claim: sequence %d block %d is %s", seq, i,
                             x->computed ? "already computed" : "being computed by another sequence");
    }
    for (int32_t i = b0; i <= b1; i++) kv->blk[q->blocks[i]].filler = seq;
    return debug_check(kv, "seq_claim");
}

cas_status cas_kv_seq_commit(cas_kv *kv, int32_t seq, int32_t n) {
    kv_seq *q = seq_get(kv, seq);
    if (!q) return cas_error(CAS_ERR_INVALID, "kv_seq_commit: bad sequence %d", seq);
    if (n < 0 || q->computed + (int64_t)n > q->ntok)
        return cas_error(CAS_ERR_INVALID, "kv_seq_commit: %d tokens from %d exceed %d known", n,
                         q->computed, q->ntok);
    if (n == 0) return CAS_OK;
    int32_t ps = kv->page_size;
    int32_t b0 = q->computed / ps, b1 = (q->computed + n - 1) / ps;
    for (int32_t i = b0; i <= b1; i++)
        if (kv->blk[q->blocks[i]].filler != seq)
            return cas_error(CAS_ERR_INVALID,
                             "kv_seq_commit: sequence %d did not claim block %d", seq, i);
    q->computed += n;
    for (int32_t i = b0; i <= b1 && (i + 1) * ps <= q->computed; i++) {
        kv_block *x = &kv->blk[q->blocks[i]];
        x->computed = 1;
        x->filler = -1;
        if (kv->prefix_cache && x->hashed && !x->in_map) block_register(kv, q, i);
    }
    return debug_check(kv, "seq_commit");
}

int32_t cas_kv_seq_num_tokens(const cas_kv *kv, int32_t seq) {
    const kv_seq *q = seq_get(kv, seq);
    return q ? q->ntok : -1;
}

int32_t cas_kv_seq_num_computed(const cas_kv *kv, int32_t seq) {
    const kv_seq *q = seq_get(kv, seq);
    return q ? q->computed : -1;
}

int32_t cas_kv_seq_num_blocks(const cas_kv *kv, int32_t seq) {
    const kv_seq *q = seq_get(kv, seq);
    return q ? q->nblocks : -1;
}

const int32_t *cas_kv_seq_blocks(const cas_kv *kv, int32_t seq) {
    const kv_seq *q = seq_get(kv, seq);
    return q ? q->blocks : NULL;
}

int32_t cas_kv_seq_token(const cas_kv *kv, int32_t seq, int32_t pos) {
    const kv_seq *q = seq_get(kv, seq);
    if (!q || pos < 0 || pos >= q->ntok) return -1;
    int32_t b = q->blocks[pos / kv->page_size];
    return kv->tok[(size_t)b * kv->page_size + (size_t)(pos % kv->page_size)];
}

/* ---- pool ---------------------------------------------------------------- */

int32_t cas_kv_page_size(const cas_kv *kv) { return kv->page_size; }
int32_t cas_kv_num_blocks(const cas_kv *kv) { return kv->num_blocks; }
int32_t cas_kv_max_seqs(const cas_kv *kv) { return kv->max_seqs; }
int32_t cas_kv_max_blocks_per_seq(const cas_kv *kv) { return kv->max_bps; }
int32_t cas_kv_prefix_cache_enabled(const cas_kv *kv) { return kv->prefix_cache; }
int32_t cas_kv_num_free_blocks(const cas_kv *kv) { return kv->nfree; }

int32_t cas_kv_blocks_for(const cas_kv *kv, int64_t n_tokens) {
    if (n_tokens <= 0) return 0;
    int64_t b = (n_tokens + kv->page_size - 1) / kv->page_size;
    return b > INT32_MAX ? INT32_MAX : (int32_t)b;
}

int32_t cas_kv_block_ref(const cas_kv *kv, int32_t block) {
    if (!kv || block < 0 || block >= kv->num_blocks) return -1;
    return kv->blk[block].ref;
}

int32_t cas_kv_block_is_cached(const cas_kv *kv, int32_t block) {
    if (!kv || block < 0 || block >= kv->num_blocks) return 0;
    return kv->blk[block].in_map;
}

/* ---- invariants and stats ---------------------------------------------------- */

#define KV_BAD(...) return cas_error(CAS_ERR_INTERNAL, "kv_check: " __VA_ARGS__)

cas_status cas_kv_check(const cas_kv *kv) {
    if (!kv) return cas_error(CAS_ERR_INVALID, "kv_check: NULL pool");
    int32_t nb = kv->num_blocks, ps = kv->page_size;
    int32_t *ref = kv->chk_ref, *fill = kv->chk_fill;
    memset(ref, 0, (size_t)nb * sizeof *ref);
    memset(fill, 0, (size_t)nb * sizeof *fill);

    /* free list: ref-0 blocks only, each once, links both ways */
    int32_t walked = 0, prev = -1, cached = 0;
    for (int32_t b = kv->head; b >= 0; b = kv->blk[b].next) {
        if (b >= nb) KV_BAD("free list holds block id %d", b);
        if (walked++ > nb) KV_BAD("free list has a cycle");
        if (kv->blk[b].ref != 0) KV_BAD("block %d is free and in use (ref %d)", b, kv->blk[b].ref);
        if (kv->blk[b].prev != prev) KV_BAD("block %d prev link %d, expected %d", b, kv->blk[b].prev, prev);
        if (fill[b]) KV_BAD("block %d twice on the free list", b);
        fill[b] = 1;
        if (kv->blk[b].in_map) cached++;
        prev = b;
    }
    if (prev != kv->tail) KV_BAD("free list tail %d, walk ended at %d", kv->tail, prev);
    if (walked != kv->nfree) KV_BAD("free count %d, list holds %d", kv->nfree, walked);
    if (cached != kv->ncached) KV_BAD("cached count %d, list holds %d", kv->ncached, cached);
    memset(fill, 0, (size_t)nb * sizeof *fill);

    /* sequences: tables consistent, references counted */
    int32_t active = 0;
    for (int32_t s = 0; s < kv->max_seqs; s++) {
        const kv_seq *q = &kv->seqs[s];
        if (!q->active) continue;
        active++;
        if (q->ntok < 0 || q->computed < 0 || q->computed > q->ntok)
            KV_BAD("sequence %d: computed %d, tokens %d", s, q->computed, q->ntok);
        if (q->nblocks != (q->ntok + ps - 1) / ps || q->nblocks > kv->max_bps)
            KV_BAD("sequence %d: %d blocks for %d tokens", s, q->nblocks, q->ntok);
        for (int32_t i = 0; i < q->nblocks; i++) {
            int32_t b = q->blocks[i];
            if (b < 0 || b >= nb) KV_BAD("sequence %d block %d: bad id %d", s, i, b);
            const kv_block *x = &kv->blk[b];
            ref[b]++;
            if (x->filler == s) fill[b] = 1;
            int32_t want = i < q->nblocks - 1 ? ps : q->ntok - i * ps;
            if (x->ntok != want) KV_BAD("sequence %d block %d (%d): %d tokens, expected %d", s, i, b, x->ntok, want);
            if (want < ps && (x->ref != 1 || x->in_map || x->hashed))
                KV_BAD("partial block %d of sequence %d is shared or keyed", b, s);
            if ((i + 1) * ps <= q->computed && !x->computed)
                KV_BAD("sequence %d block %d (%d) inside the computed range but not computed", s, i, b);
            if (i > 0 && x->hashed && kv->prefix_cache && x->in_map) {
                const kv_block *p = &kv->blk[q->blocks[i - 1]];
                if (x->parent != q->blocks[i - 1] || x->parent_hash != p->hash)
                    KV_BAD("keyed block %d of sequence %d chained from block %d, the table "
                           "has %d before it", b, s, x->parent, q->blocks[i - 1]);
            }
        }
    }
    if (active + kv->nhfree != kv->max_seqs)
        KV_BAD("%d active sequences + %d free handles != %d", active, kv->nhfree, kv->max_seqs);

    /* blocks: counts balance, states exclusive */
    int32_t free0 = 0, inmap = 0;
    for (int32_t b = 0; b < nb; b++) {
        const kv_block *x = &kv->blk[b];
        if (x->ref != ref[b]) KV_BAD("block %d: ref %d, %d table references", b, x->ref, ref[b]);
        if (x->ref == 0) {
            free0++;
            if (x->filler != -1) KV_BAD("free block %d has filler %d", b, x->filler);
            if (x->in_map && !x->computed) KV_BAD("free block %d is a pending key", b);
        }
        if (x->filler >= 0 && !fill[b])
            KV_BAD("block %d filler %d does not hold it", b, x->filler);
        if (x->computed && (x->ntok != ps || x->filler != -1))
            KV_BAD("computed block %d: %d tokens, filler %d", b, x->ntok, x->filler);
        if (x->in_map) {
            inmap++;
            if (!x->hashed || x->ntok != ps) KV_BAD("keyed block %d is not full and hashed", b);
            if (map_find(kv, x->hash) != b) KV_BAD("keyed block %d not found under its hash", b);
            if (!kv->prefix_cache) KV_BAD("block %d keyed with the prefix cache off", b);
        }
    }
    if (free0 != kv->nfree) KV_BAD("%d blocks with ref 0, free list holds %d", free0, kv->nfree);
    int32_t entries = 0;
    for (size_t i = 0; i < kv->mcap; i++) {
        int32_t b = kv->mval[i];
        if (b < 0) continue;
        entries++;
        if (b >= nb) KV_BAD("map entry %zu holds block id %d", i, b);
        if (!kv->blk[b].in_map || kv->blk[b].hash != kv->mkey[i])
            KV_BAD("map entry %zu -> block %d that is not keyed under it", i, b);
    }
    if (entries != kv->mcount || entries != inmap)
        KV_BAD("map holds %d entries, count %d, %d keyed blocks", entries, kv->mcount, inmap);
    return CAS_OK;
}

void cas_kv_get_stats(const cas_kv *kv, cas_kv_stats *st) {
    memset(st, 0, sizeof *st);
    st->blocks_total = kv->num_blocks;
    st->blocks_used = kv->num_blocks - kv->nfree;
    st->blocks_free = kv->nfree - kv->ncached;
    st->blocks_cached = kv->ncached;
    st->blocks_hashed = kv->mcount;
    for (size_t i = 0; i < kv->mcap; i++)
        if (kv->mval[i] >= 0 && !kv->blk[kv->mval[i]].computed) st->blocks_pending++;
    st->seqs_active = kv->max_seqs - kv->nhfree;
    st->query_tokens = kv->query_tokens;
    st->hit_tokens = kv->hit_tokens;
    st->pending_hit_tokens = kv->pending_hit_tokens;
    st->evictions = kv->evictions;
    st->collisions = kv->collisions;
    st->hit_rate = kv->query_tokens > 0
                       ? (double)(kv->hit_tokens + kv->pending_hit_tokens) / (double)kv->query_tokens
                       : 0.0;
}
