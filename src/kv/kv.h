/*
 * kv.h: the KV block manager of cascade. A pool of fixed-size blocks (one
 * block = page_size tokens of K and V in the attention pools; this layer only
 * does the bookkeeping: ids, reference counts, the token ids each block holds),
 * a block table per sequence, and automatic prefix caching. It knows nothing
 * of models or kernels: a block id here is a page id in the attention pools.
 *
 * Blocks. Every block is in exactly one of three states:
 *   free      ref 0, not in the cache map: reused first;
 *   cached    ref 0, in the cache map, KV computed: reusable on a prefix hit
 *             until evicted (LRU: freed last, evicted last);
 *   in use    ref > 0: held by ref block-table entries of live sequences.
 * Free and cached blocks sit on one list; allocation takes its head (evicting
 * a cached block there), a block whose last user leaves goes to the head when
 * it holds nothing reusable and to the tail when it is cached. A sequence
 * frees its blocks last-first, so a sequence's tail is evicted before its
 * prefix (the part most likely to be shared). Like SQLite's page cache: one
 * release (cas_kv_seq_free) for every sequence created or forked; blocks are
 * pinned until then.
 *
 * Prefix caching. A full block is keyed by a chained hash: XXH3 of its token
 * ids seeded with its parent block's hash (the first block is seeded with the
 * pool's seed), so equal tokens under different prefixes are different keys.
 * A block also stores its tokens and its parent's hash, and a match compares
 * both, so a 64-bit collision can never attach the wrong KV. A new sequence
 * attaches (ref++) the longest run of cached full blocks of its tokens; the
 * block holding the last token is never matched (its logits must be computed).
 *
 * Cold-cache sharing. A block becomes a key as soon as its tokens are known
 * (it is full), before its KV is computed: such a block is *pending*, and
 * one sequence, its *filler*, computes it. Sequences that attach to a pending
 * block wait at that point (cas_kv_seq_ready returns only the tokens before
 * it) until the filler's cas_kv_seq_commit marks it computed. When a filler
 * leaves (freed, preempted) before computing a block that others hold, the
 * next of them to reach the block claims it (cas_kv_seq_claim) and computes it
 * instead. Waits always point to a lower block index or to a sequence that can
 * run, so they never form a cycle. A pending block with no holders left is
 * dropped from the map (its KV is not valid).
 *
 * Sequences. A sequence is a handle (0 .. max_seqs-1) with a block table, a
 * token count (ids known: appended) and a computed count (tokens from position
 * 0 whose KV is valid). Tokens are appended (allocating blocks as the last
 * fills); computation is reported with claim (about to compute) and commit
 * (computed). A full block is immutable and may be shared; the last, partial
 * block of a sequence is always private (fork copies it).
 *
 * Errors and memory. Everything is allocated by cas_kv_create; no other call
 * allocates. An operation that would need more blocks than the pool has free
 * returns CAS_ERR_NOMEM and changes nothing (the scheduler then preempts).
 * Bad handles and arguments return CAS_ERR_INVALID. Nothing aborts.
 *
 * Debug checks. cas_kv_check verifies every invariant (O(blocks + table
 * entries)). With opts.debug_checks (the engine's debug_checks sets it)
 * every mutating call runs it afterwards and returns CAS_ERR_INTERNAL (with
 * the message) if it fails. It is not tied to NDEBUG because the Makefile
 * never defines NDEBUG and an O(pool) check per call would dominate a step
 * of a large pool.
 *
 * Threads. A cas_kv is not thread-safe: one thread (the engine loop) makes
 * every call; different pools are independent.
 */
#ifndef CASCADE_KV_H
#define CASCADE_KV_H

#include "../core/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cas_kv cas_kv; /* opaque; owned by its creator */

typedef struct {
    int32_t num_blocks;          /* blocks in the pool (the engine sizes it from a memory budget) */
    int32_t page_size;           /* tokens per block, >= 1 */
    int32_t max_seqs;            /* sequence handles available at once */
    int32_t max_blocks_per_seq;  /* block-table capacity: ceil(max context / page_size) */
    int32_t enable_prefix_cache; /* 0: no hashing, no matching, no cold-cache sharing */
    uint64_t hash_seed;          /* parent hash of a sequence's first block */
    uint64_t hash_mask;          /* tests only: keep these bits of every hash (forces
                                    collisions); 0 means all 64 bits */
    int32_t debug_checks;        /* 1: cas_kv_check after every mutating call */
} cas_kv_opts;

/* 1024 blocks of 16 tokens, 256 sequences of up to 8192 tokens, prefix cache
 * on, no debug checks. */
cas_kv_opts cas_kv_opts_default(void);

/* Creates a pool; every allocation this object will ever make happens here.
 * *out is owned by the caller: release with cas_kv_destroy. */
cas_status cas_kv_create(const cas_kv_opts *opts, cas_kv **out);
void cas_kv_destroy(cas_kv *kv); /* NULL is fine; live sequences are dropped */

/* ---- sequences --------------------------------------------------------- */

/* What a new sequence found in the prefix cache. */
typedef struct {
    int32_t hit_tokens;     /* leading tokens attached to cached, computed blocks */
    int32_t pending_tokens; /* tokens after those attached to pending blocks that
                               another sequence is computing (wait for them) */
    int32_t new_blocks;     /* blocks allocated for the rest */
} cas_kv_match;

/* Creates a sequence holding tokens[0..n) (n >= 0; copied): attaches the
 * longest run of cached or pending full blocks matching its prefix (when the
 * prefix cache is on) and allocates blocks for the rest. *seq receives the
 * handle; match (may be NULL) what was found. CAS_ERR_NOMEM (nothing changed)
 * if there are not enough free blocks or no free handle. The handle is owned
 * by the caller: one cas_kv_seq_free for it. */
cas_status cas_kv_seq_create(cas_kv *kv, const int32_t *tokens, int32_t n, int32_t *seq,
                             cas_kv_match *match);

/* What cas_kv_seq_create would find for tokens[0..n) now, without creating
 * anything or counting it in the stats: cached and pending prefix tokens,
 * and the blocks it would allocate (the scheduler sizes a waiting request's
 * prefill with it). All zero when the prefix cache is off, except new_blocks. */
void cas_kv_match_peek(const cas_kv *kv, const int32_t *tokens, int32_t n, cas_kv_match *match);

/* Appends n token ids (copied) to a sequence, allocating blocks when the last
 * fills; full blocks become pending keys of the cache. All or nothing:
 * CAS_ERR_NOMEM (nothing changed) when the pool cannot supply the blocks. */
cas_status cas_kv_seq_append(cas_kv *kv, int32_t seq, const int32_t *tokens, int32_t n);

/* A copy the engine must make in the attention pools: the first n_tokens
 * token slots of page src into page dst (src = -1: nothing to copy). */
typedef struct {
    int32_t src, dst, n_tokens;
} cas_kv_copy;

/* Forks a sequence (parallel sampling, beam search): the child shares every
 * full block of the parent (ref++) and gets a private copy of the parent's
 * partial last block, described in *copy; its computed count is the parent's.
 * CAS_ERR_NOMEM (nothing changed) without a free block or handle. */
cas_status cas_kv_seq_fork(cas_kv *kv, int32_t parent, int32_t *child, cas_kv_copy *copy);

/* Releases a sequence's blocks (last block first) and its handle. Cached
 * blocks stay reusable; pending blocks it was filling are left for their
 * other holders to claim. */
cas_status cas_kv_seq_free(cas_kv *kv, int32_t seq);

/* The scheduler's view of a sequence. First advances the computed count over
 * blocks that others have finished computing, then returns in *runnable how
 * many tokens from the computed count the sequence may compute now: up to the
 * end of its tokens, a block another sequence is filling, or a block already
 * computed (skipped at the next call). *waiting (may be NULL) receives 1 when
 * it stopped at a block another sequence is filling. */
cas_status cas_kv_seq_ready(cas_kv *kv, int32_t seq, int32_t *runnable, int32_t *waiting);

/* Before computing tokens [computed, computed + n) of a sequence (n no more
 * than cas_kv_seq_ready's runnable): makes it the filler of the pending blocks
 * in that range whose filler left. */
cas_status cas_kv_seq_claim(cas_kv *kv, int32_t seq, int32_t n);

/* After computing those n tokens: advances the computed count and marks the
 * blocks it completes computed (a pending key becomes a cache hit for all). */
cas_status cas_kv_seq_commit(cas_kv *kv, int32_t seq, int32_t n);

/* Accessors; -1 / NULL for a bad handle. The block array (num_blocks entries,
 * ceil(num_tokens / page_size)) stays valid until the next mutating call. */
int32_t cas_kv_seq_num_tokens(const cas_kv *kv, int32_t seq);
int32_t cas_kv_seq_num_computed(const cas_kv *kv, int32_t seq);
int32_t cas_kv_seq_num_blocks(const cas_kv *kv, int32_t seq);
const int32_t *cas_kv_seq_blocks(const cas_kv *kv, int32_t seq);
/* The token at a position of the sequence (-1 when out of range). */
int32_t cas_kv_seq_token(const cas_kv *kv, int32_t seq, int32_t pos);

/* ---- pool ---------------------------------------------------------------- */

int32_t cas_kv_page_size(const cas_kv *kv);
int32_t cas_kv_num_blocks(const cas_kv *kv);
int32_t cas_kv_max_seqs(const cas_kv *kv);
int32_t cas_kv_max_blocks_per_seq(const cas_kv *kv);
int32_t cas_kv_prefix_cache_enabled(const cas_kv *kv);
/* Blocks with ref 0 (free or cached): what an allocation can get. */
int32_t cas_kv_num_free_blocks(const cas_kv *kv);
/* Blocks needed to hold n tokens from scratch: ceil(n / page_size). */
int32_t cas_kv_blocks_for(const cas_kv *kv, int64_t n_tokens);

/* Block inspection (tests, debugging): reference count (-1 for a bad id) and
 * 1 when the block is a key of the cache map. */
int32_t cas_kv_block_ref(const cas_kv *kv, int32_t block);
int32_t cas_kv_block_is_cached(const cas_kv *kv, int32_t block);

/* Verifies every invariant: each block in one state; the free list holds
 * exactly the ref-0 blocks, linked both ways; refs equal block-table
 * references; the map holds exactly the hashed blocks at their own hash;
 * ref-0 keys are computed; partial blocks private; fillers alive and holding
 * their blocks; blocks inside a computed range are computed. CAS_OK or
 * CAS_ERR_INTERNAL with a message naming the broken invariant. */
cas_status cas_kv_check(const cas_kv *kv);

typedef struct {
    int32_t blocks_total;
    int32_t blocks_used;        /* ref > 0 */
    int32_t blocks_free;        /* ref 0, not cached */
    int32_t blocks_cached;      /* ref 0, cached (evictable) */
    int32_t blocks_hashed;      /* keys in the map (cached + in use, pending or computed) */
    int32_t blocks_pending;     /* keys whose KV is not computed yet */
    int32_t seqs_active;
    int64_t query_tokens;       /* tokens offered to prefix matching (cas_kv_seq_create) */
    int64_t hit_tokens;         /* of those, attached to computed blocks */
    int64_t pending_hit_tokens; /* of those, attached to pending blocks */
    int64_t evictions;          /* cached blocks reused for other data */
    int64_t collisions;         /* hash matches rejected by the token comparison */
    double hit_rate;            /* (hit + pending hit) / query tokens; 0 when none */
} cas_kv_stats;

void cas_kv_get_stats(const cas_kv *kv, cas_kv_stats *st);

#ifdef __cplusplus
}
#endif

#endif
