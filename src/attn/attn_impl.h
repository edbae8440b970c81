/*
 * attn_impl.h: internals of the attention layer shared by its .c files and by
 * backends that execute a plan built on the host (src/cuda). Not part of the
 * public contract; layout may change together with its users.
 *
 * A built plan is a list of passes. A pass is a set of query tokens (rows of
 * q, each with its absolute position in its request) against one contiguous
 * segment of KV (a run of pages, its first key at absolute position pos0).
 * Masking is applied per (query position, key position), so the same pass
 * code serves decode rows, prefill chunks, shared nodes and tails.
 *
 * A pass is split into jobs along its KV (split-KV); a job is split into work
 * items along KV heads and row blocks. Each job writes one attention state per
 * (token, q head) into scratch (or straight into the output when it is the
 * token's only contribution: `direct`). Then every token merges its
 * contributions, listed in CSR form (contrib_indptr / contrib_*).
 */
#ifndef CASCADE_ATTN_IMPL_H
#define CASCADE_ATTN_IMPL_H

#include "attn.h"

/* cas_attn_validate in two parts: everything but the page ids (after it the
 * indptrs are sound), then the page ids (copy: where not NULL, they are
 * copied there on the way, kv_indptr[batch] of them). */
cas_status cas_attn_validate_head(const cas_attn_shape *shape, const cas_attn_batch *batch,
                                  int32_t num_pages, const cas_attn_params *params);
cas_status cas_attn_check_pages(const cas_attn_batch *batch, int32_t num_pages, int32_t *copy);
/* Nonzero if one of the page ids src[0, n) is outside 0..np-1; copies them to
 * dst on the way where dst is not NULL (dst and src must not overlap). */
uint32_t cas_attn_ids_outside(uint32_t *restrict dst, const uint32_t *restrict src, int32_t n, uint32_t np);

/* Tokens of KV per tile in the CPU kernel; jobs split KV at multiples of it. */
#define CAS_ATTN_TILE 128
/* Keys per tile when one item spans every KV head (decode): a tile of all
 * heads then stays in L2 while the next one is prefetched. */
#define CAS_ATTN_SHORT_TILE CAS_ATTN_TILE
/* Most rows (token x group head) one CPU work item holds. */
#define CAS_ATTN_ROW_BLOCK 128

/* cas_attn_pass: attn.h */

typedef struct {
    int32_t pass;      /* index into plan->passes */
    int32_t kv0, kv1;  /* key range within the pass's segment, [kv0, kv1) */
    int32_t direct;    /* 1: writes o/lse rows of token tok_ids[...] directly */
    int32_t level;     /* batch-invariant plans: runs after every job of a lower level */
    int64_t o_off;     /* scratch offset (floats) of o for (pass token 0, head 0): [n_tok][Hq][D] */
    int64_t lse_off;   /* scratch offset (floats) of lse: [n_tok][Hq] */
} cas_attn_job;

typedef struct {
    int32_t job;       /* index into plan->jobs */
    int32_t kv_head0, kv_head1; /* KV heads [kv_head0, kv_head1); rows below repeat for each */
    int32_t row0, row1; /* rows [row0, row1) of the job's pass, row = pass_token * group + g */
    int32_t tile;      /* keys per tile (<= CAS_ATTN_TILE); small when the item spans heads */
    int32_t kv0, kv1;  /* visible key range within the segment (masking trims it), may be empty */
    int32_t level;     /* its job's level */
} cas_attn_item;

typedef struct {
    int32_t lo, hi;           /* requests sorted[lo..hi) share this node */
    int32_t depth0, depth1;   /* pages [depth0, depth1) of each member's page list */
    int32_t parent;           /* enclosing node, -1 at the top */
    int32_t chosen;           /* 1 if the cost model made it a shared pass */
    int64_t rows;             /* query tokens below it */
} cas_attn_node;

/* The CPU work item kernel, one per SIMD level; writes the item's states. */
typedef void (*cas_attn_item_fn)(const struct cas_attn_plan *plan, const cas_attn_item *item,
                                 const cas_kv_pool *pool, const float *q, float *o, float *lse,
                                 float *work);

struct cas_attn_plan {
    cas_attn_shape shape;
    cas_attn_plan_opts opts;
    cas_attn_params params;
    float scale;
    int32_t threads;
    int32_t num_pages;

    /* the CPU kernel, chosen at create from opts and the CPU (cas_attn_cpu_select) */
    cas_attn_item_fn kernel;
    cas_simd_level simd;       /* the level opts.simd resolved to */
    int32_t amx_bf16;          /* 1: the bf16 dot-product kernel multiplies on AMX-BF16 tiles */
    /* Most query rows per KV head for which the SIMD kernels take their decode
     * path (8, its maximum; 0 turns it off), and fewest for which the AVX-512
     * f32 kernel computes scores transposed (32; INT32_MAX turns it off). Either
     * path computes the bits of the blocked kernel, so these change speed only;
     * tests set them on a created plan to compare the paths. */
    int32_t decode_rows;
    int32_t stile_rows;

    /* the batch, copied */
    int32_t batch;
    int32_t total_q;
    int32_t *qo_indptr;        /* [batch+1] */
    int32_t *kv_indptr;        /* [batch+1] */
    int32_t *pages;            /* [kv_indptr[batch]] kv_indices copy */
    int32_t *last_len;         /* [batch] */
    int32_t *kv_len;           /* [batch] tokens */

    /* prefix tree */
    int32_t *sorted;           /* [batch] requests in lexicographic page order */
    int32_t *lcp;              /* [batch] shared pages with the previous sorted request */
    cas_attn_node *nodes;      /* [n_nodes] */
    int32_t n_nodes;

    /* passes, jobs, items */
    cas_attn_pass *passes;
    int32_t n_passes;
    int32_t *tok_ids;          /* [n_tok_rows] global query token of each pass row */
    int32_t *tok_pos;          /* [n_tok_rows] its absolute position */
    int32_t n_tok_rows;
    cas_attn_job *jobs;
    int32_t n_jobs;
    cas_attn_item *items;
    int32_t n_items;

    /* merge lists: contributions of token t are contrib_*[contrib_indptr[t] .. [t+1]) */
    int32_t *contrib_indptr;   /* [total_q+1] */
    int64_t *contrib_o;        /* scratch offset of o for (t, head 0) */
    int64_t *contrib_lse;      /* scratch offset of lse for (t, head 0) */
    int32_t n_contrib;
    int32_t *direct_tok;       /* [total_q] 1 if token t was written directly */

    /* batch-invariant plans (opts.batch_invariant): a token's passes form a chain
     * in key order. Per pass row (as tok_ids): the scratch offset of the running
     * state the row starts from (init) and of the one it leaves for the next pass
     * of its token (carry), -1 for none; a state is O [Hq][D] unnormalized, then
     * M [Hq] and L [Hq]. A row without a carry writes its token's output. Items
     * are sorted by level; level_start[k] is the first of level k. */
    int64_t *tok_init, *tok_carry;
    int32_t *row_pass;         /* [n_tok_rows] pass of each pass row */
    int32_t *chain;            /* [n_tok_rows] each token's pass rows, in key order */
    int32_t *pass_level;       /* [n_passes] */
    int32_t *level_start;      /* [n_levels + 1] */
    int32_t n_levels;
    int32_t split_heads;       /* 1: items span one KV head (few items; batch-invariant plans) */
    int32_t cap_chain, cap_pass_level, cap_levels;

    /* scratch states and per-thread kernel workspace */
    float *scratch;
    int64_t scratch_floats;
    float *work;               /* [threads][work_floats] */
    int64_t work_floats;

    cas_attn_plan_info info;

    /* capacities of the arrays above (elements) */
    int32_t cap_batch, cap_q, cap_nodes, cap_passes, cap_tok_rows, cap_tok_pos, cap_jobs, cap_items,
        cap_contrib;
    int64_t cap_pages, cap_scratch;
    /* build_tree's sort: keys, an index buffer and a stack of groups */
    void *sort_work;
    int64_t cap_sort_work; /* bytes */
};

/* The running state a batch-invariant plan hands from one pass of a token to
 * its next (NULL for none, and always in other plans): pass row ti of pass
 * ps starts from cas_attn_init_state and leaves cas_attn_carry_state. A state
 * holds O [Hq][D] (not divided by the sum), then M [Hq], then L [Hq]. */
static inline const float *cas_attn_init_state(const struct cas_attn_plan *p, const cas_attn_pass *ps, int32_t ti) {
    if (!p->opts.batch_invariant) return NULL;
    int64_t off = p->tok_init[ps->tok_off + ti];
    return off >= 0 ? p->scratch + off : NULL;
}
static inline float *cas_attn_carry_state(const struct cas_attn_plan *p, const cas_attn_pass *ps, int32_t ti) {
    if (!p->opts.batch_invariant) return NULL;
    int64_t off = p->tok_carry[ps->tok_off + ti];
    return off >= 0 ? p->scratch + off : NULL;
}

/* The kernels (attn_cpu.c, attn_cpu_avx2.c, attn_cpu_avx512.c,
 * attn_cpu_avx512bf16.c); each runs only where cas_attn_cpu_select picked it. */
void cas_attn_item_generic(const struct cas_attn_plan *plan, const cas_attn_item *item,
                           const cas_kv_pool *pool, const float *q, float *o, float *lse,
                           float *work);
void cas_attn_item_avx2(const struct cas_attn_plan *plan, const cas_attn_item *item,
                        const cas_kv_pool *pool, const float *q, float *o, float *lse,
                        float *work);
void cas_attn_item_avx512(const struct cas_attn_plan *plan, const cas_attn_item *item,
                          const cas_kv_pool *pool, const float *q, float *o, float *lse,
                          float *work);
void cas_attn_item_avx512bf16(const struct cas_attn_plan *plan, const cas_attn_item *item,
                              const cas_kv_pool *pool, const float *q, float *o, float *lse,
                              float *work);
/* Sets the plan's kernel, simd, amx_bf16, decode_rows and stile_rows from
 * its shape and options and the CPU (attn_cpu.c; plan create calls it).
 * CAS_ERR_UNSUPPORTED when opts.simd names a level this CPU lacks. */
cas_status cas_attn_cpu_select(cas_attn_plan *plan);
/* 1 if the bf16 dot-product kernel may use AMX-BF16 tiles in this process:
 * the CPU has AMX-BF16 and cas_cpu_amx_ready() (which asks Linux for the tile
 * state on its first call). */
int cas_attn_amx_bf16_available(void);

/* floats of per-thread workspace the kernels need for a head_dim */
int64_t cas_attn_work_floats(int32_t head_dim);

#endif
