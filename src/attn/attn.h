/*
 * attn.h: the attention contract of cascade. Paged KV, batch descriptions,
 * attention states and their merge, cascade planning, the CPU backend and
 * the float64 reference. Every backend (CPU here, CUDA in src/cuda) computes
 * exactly the function described in this header; the reference is the oracle.
 *
 * The function. For query row (query t, head h) with absolute position p and
 * the keys j of its request (positions 0 .. kv_len-1):
 *
 *     s_j  = sm_scale * dot(q[t][h], k[j][h / group])
 *     s_j  = cap * tanh(s_j / cap)                 if logits_soft_cap = cap > 0
 *     key j visible iff (!causal || j <= p) && (window_left < 0 || j >= p - window_left)
 *     lse  = log(sum over visible j of exp(s_j))   natural log; -inf if none visible
 *     o    = sum over visible j of exp(s_j - lse) * v[j][h / group]   (0 if none)
 *
 * group = num_qo_heads / num_kv_heads (GQA; 1 is multi-head attention).
 * Query i of request r sits at p = kv_len(r) - q_len(r) + i: queries are
 * aligned to the end of their KV (the new tokens whose K and V are already in
 * the pages).
 *
 * Paged KV. K and V live in two pools of pages, each page
 * [page_size][num_kv_heads][head_dim] elements of one storage type (f32, f16
 * or bf16; arithmetic is f32). Request r owns the pages
 * kv_indices[kv_indptr[r] .. kv_indptr[r+1]-1] in order; all are full except
 * the last, which holds kv_last_page_len[r] tokens (1 .. page_size). A page
 * may appear in several requests (a shared prefix) at the same index.
 *
 * Cascade. cas_attn_plan_build() finds runs of pages that several requests
 * share at the same place (a prefix tree), and for each run decides with a
 * cost model whether one multi-query pass over it for every query below it is
 * cheaper than each request reading it on its own. The plan is then a list of
 * passes, each a set of query rows against one contiguous run of KV; every
 * pass yields an attention state per row, and the states of a row merge
 * through their log-sum-exp into the final (o, lse). A plan built with
 * cascade off has one pass per request: that is flat paged attention. Both go
 * through the same kernel, which serves decode rows (q_len 1) and prefill
 * chunks side by side: there is no separate prefill or decode entry point.
 *
 * Lifetime and threads. A plan is created once with capacities, rebuilt for
 * each batch (no allocation unless a capacity must grow) and run by every
 * layer (no allocation ever). One plan must not be built or run by two
 * threads at once; different plans are independent. cas_attn_plan_run uses
 * the plan's thread count internally (OpenMP). The reference and the merge
 * functions are reentrant.
 */
#ifndef CASCADE_ATTN_H
#define CASCADE_ATTN_H

#include "../core/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- storage types ---------------------------------------------------- */

typedef enum { CAS_F32 = 0, CAS_F16 = 1, CAS_BF16 = 2 } cas_dtype;

size_t cas_dtype_size(cas_dtype t);      /* bytes per element: 4, 2, 2 */
const char *cas_dtype_name(cas_dtype t); /* "f32", "f16", "bf16" */
int cas_dtype_parse(const char *s, cas_dtype *out); /* 0 on success */

/* ---- geometry, pools, batches ------------------------------------------ */

#define CAS_ATTN_MAX_PAGE_SIZE 256

/* The head_dims the backends implement (a head_dim outside this list is
 * rejected with CAS_ERR_UNSUPPORTED). */
int cas_attn_head_dim_supported(int32_t head_dim);

/* The shape of a model's attention; the same for every layer. */
typedef struct {
    int32_t num_qo_heads; /* Hq, a multiple of num_kv_heads */
    int32_t num_kv_heads; /* Hkv */
    int32_t head_dim;     /* D: 64, 96, 128 or 256 */
    int32_t page_size;    /* tokens per page, 1 .. 256 */
    cas_dtype kv_dtype;   /* storage type of the K and V pools */
} cas_attn_shape;

/* K and V pools: k and v each point to num_pages pages of
 * [page_size][num_kv_heads][head_dim] elements of kv_dtype, contiguous, page
 * p at byte offset p * page_size * Hkv * D * size. Borrowed, read only. */
typedef struct {
    const void *k;
    const void *v;
    int32_t num_pages;
} cas_kv_pool;

/* A batch in compressed rows. All arrays borrowed; read only; int32. */
typedef struct {
    int32_t batch;                   /* B, number of requests */
    const int32_t *qo_indptr;        /* [B+1], 0-based, qo_indptr[0] = 0; queries of request r
                                        are rows qo_indptr[r] .. qo_indptr[r+1]-1 of q and o */
    const int32_t *kv_indptr;        /* [B+1], kv_indptr[0] = 0, offsets into kv_indices */
    const int32_t *kv_indices;       /* [kv_indptr[B]], page ids in the pool */
    const int32_t *kv_last_page_len; /* [B], tokens in each request's last page, 1..page_size */
} cas_attn_batch;

/* Options of the attention function itself. */
typedef struct {
    float sm_scale;        /* score scale; 0 means 1/sqrt(head_dim) */
    float logits_soft_cap; /* > 0 enables s = cap * tanh(s / cap); 0 disables */
    int32_t window_left;   /* >= 0: a query at p sees keys p-window_left .. p; -1 disables */
    int32_t causal;        /* 1: key j visible only if j <= p; 0: every key of the request */
} cas_attn_params;

/* Defaults: sm_scale 0 (1/sqrt(D)), no soft cap, no window, causal. */
cas_attn_params cas_attn_params_default(void);
/* sm_scale with the default applied: sm_scale, or 1/sqrt(head_dim) where it is 0. */
float cas_attn_scale(const cas_attn_shape *shape, const cas_attn_params *params);

/* Checks a batch against a shape, a pool size and the params: indptr
 * monotone, page ids in range, last_page_len in 1..page_size, every request
 * with KV, q_len <= kv_len under causal masking, Hq a multiple of Hkv, a
 * supported head_dim. CAS_OK or CAS_ERR_INVALID / CAS_ERR_UNSUPPORTED with a
 * message naming the request and field. Every entry point calls it. */
cas_status cas_attn_validate(const cas_attn_shape *shape, const cas_attn_batch *batch,
                             int32_t num_pages, const cas_attn_params *params);

/* ---- attention states and merge ----------------------------------------- */

/* A state is (o[D], lse) for one row: o normalised, lse natural log. The empty
 * state (lse = -inf, o anything finite) is the identity of merge. */

/* (o_a, lse_a) <- merge((o_a, lse_a), (o_b, lse_b)) for `rows` rows of length
 * D (o row-major [rows][D], lse [rows]). o_a may not alias o_b. */
void cas_attn_merge_inplace(float *o_a, float *lse_a, const float *o_b, const float *lse_b,
                            int64_t rows, int32_t head_dim);

/* out = merge(a, b); out may alias a or b (or both). */
void cas_attn_merge2(float *o_out, float *lse_out, const float *o_a, const float *lse_a,
                     const float *o_b, const float *lse_b, int64_t rows, int32_t head_dim);

/* out = merge of n states: o_in[i] is [rows][D], lse_in[i] is [rows]. The
 * output may alias none of the inputs. n = 0 writes the empty state (o = 0,
 * lse = -inf). */
void cas_attn_merge_n(float *o_out, float *lse_out, const float *const *o_in,
                      const float *const *lse_in, int n, int64_t rows, int32_t head_dim);

/* ---- float64 reference -------------------------------------------------- */

/* The definition above computed directly in double precision, one row at a
 * time, over the flat view of the batch. q is [total_q][Hq][D] float32; K and
 * V are read from the pools and upcast; o_ref [total_q][Hq][D] and lse_ref
 * [total_q][Hq] double (either may be NULL). Validates first. Slow: tests and
 * benchmarks only. */
cas_status cas_attn_reference(const cas_attn_shape *shape, const cas_kv_pool *pool,
                              const cas_attn_batch *batch, const cas_attn_params *params,
                              const float *q, double *o_ref, double *lse_ref);

/* A computed output against the reference, row by row (a row: one query
 * token and q head, D elements). A row passes when |o - o_ref|_2 <= tol_rel
 * * |o_ref|_2 and |lse - lse_ref| <= tol_lse, everything finite; a row the
 * reference leaves empty (lse_ref -inf: no visible key) passes only with o
 * all zero and lse -inf. The error is scaled to each row, so a wrong key
 * range shows at any key count: at 32k keys an output element is about 0.01,
 * under any useful absolute tolerance. Tolerances for f32 P V products:
 * CAS_ATTN_TOL_F32; probabilities rounded to f16 or bf16 for the tensor
 * cores (unit roundoff 2^-11, 2^-8, so a row's relative error is about
 * u / sqrt(3), measured in tests/cuda): CAS_ATTN_TOL_F16, CAS_ATTN_TOL_BF16. */
typedef struct {
    int64_t rows;      /* rows compared */
    int64_t bad_rows;  /* rows that failed */
    int64_t worst_row; /* the row of max_rel (-1: none) */
    double max_rel;    /* largest relative error of a row's o (inf: not finite) */
    double max_lse;    /* largest |lse - lse_ref| (inf: not finite or an empty row's lse wrong) */
} cas_attn_check;
#define CAS_ATTN_TOL_F32 1e-4
#define CAS_ATTN_TOL_F16 2e-3
#define CAS_ATTN_TOL_BF16 1e-2
#define CAS_ATTN_TOL_LSE 2e-3
/* o [rows][head_dim], lse [rows] (NULL: not compared) against o_ref,
 * lse_ref (lse_ref NULL: empty rows are known by o_ref alone, all zero);
 * fills *out and returns 1 when every row passes. */
int cas_attn_check_rows(const float *o, const float *lse, const double *o_ref, const double *lse_ref,
                        int64_t rows, int32_t head_dim, double tol_rel, double tol_lse, cas_attn_check *out);

/* ---- cascade plan and run (CPU backend) --------------------------------- */

typedef enum {
    CAS_CASCADE_OFF = 0,  /* flat: every request reads all of its KV */
    CAS_CASCADE_AUTO = 1, /* shared runs chosen by the cost model */
    CAS_CASCADE_ALL = 2   /* every run shared by >= 2 requests (tests, benchmarks) */
} cas_cascade_mode;

/* The cost model's machine numbers. A pass costs the larger of its memory
 * time (KV bytes not already in cache over bytes_per_s) and its compute time
 * (KV bytes converted into tiles over pack_bytes_per_s, plus its FLOPs over
 * flops_per_s); an extra pass adds pass_overhead_s and a merge of its rows.
 * Defaults were measured on the 2-core development machine with
 * `cascade attn-bench --calibrate` (bench/HISTORY.md). */
typedef struct {
    double bytes_per_s;      /* KV streaming rate from memory */
    double pack_bytes_per_s; /* rate of turning KV (already in cache) into tiles */
    double flops_per_s;      /* f32 rate of the blocked multi-row kernel */
    double cache_bytes;      /* a shared run this small is re-read from cache */
    double pass_overhead_s;  /* fixed cost of one extra pass */
    double row_merge_s;      /* cost per row and head_dim element of one extra merge */
} cas_attn_cost;

cas_attn_cost cas_attn_cost_default(void);

/* Measures the cost model's numbers for a shape on this machine with
 * `threads` threads (0: all) by timing a few synthetic runs (about a second).
 * The engine can call it at start-up; `cascade attn-bench --calibrate` prints
 * the result. */
cas_status cas_attn_calibrate(const cas_attn_shape *shape, int32_t threads, cas_attn_cost *out);

typedef struct {
    cas_cascade_mode cascade;
    int32_t threads;      /* 0: all cores (omp_get_max_threads) */
    int32_t min_shared_tokens; /* ignore shared runs shorter than this (0: none) */
    cas_attn_cost cost;   /* cost model numbers */
    /* bf16 KV only, CPUs with AVX512_BF16 (cas_attn_bf16_dot_available):
     * 1 = the kernels round queries and probabilities to bf16 and use the
     * bf16 dot-product instruction, about twice the multiply-add rate of the
     * f32 path on shared-prefix passes, at bf16 precision (outputs differ
     * from the default by ~1e-3 relative). With AMX-BF16 the products run
     * on the tile unit. 0 (default) or no AVX512_BF16 (or simd below
     * AVX512): K and V are widened to f32 and Q stays f32. */
    int32_t bf16_dot;
    /* The vector instructions of the CPU kernels (core.h): CAS_SIMD_AUTO
     * (default) the widest this CPU has (cas_attn_simd_name); GENERIC, AVX2
     * or AVX512 run that kernel, to compare them (tests, benchmarks). Every
     * level computes the same function; a level this CPU lacks fails
     * cas_attn_plan_create with CAS_ERR_UNSUPPORTED. */
    cas_simd_level simd;
    /* 1: the bf16 dot-product kernel (bf16_dot) never uses AMX-BF16 tiles,
     * only AVX512_BF16 (tests compare the two: the same function, its f32
     * sums in another order, which can move a probability to the
     * neighbouring bf16 value). 0 (default): tiles where the CPU has
     * AMX-BF16 and Linux grants the tile state (cas_cpu_amx_ready). */
    int32_t amx_off;
    /* 1: batch-invariant plans (CPU backend): a token's output and lse are
     * bitwise the same whatever else is in the batch, with cascade on or off,
     * whatever part of its KV was cached or how its prompt was chunked. The
     * kernels already compute each row the same way on every path; what
     * varies with the batch is where a token's keys are cut into passes and
     * jobs and how their states are merged. So: keys go through tiles of
     * CAS_ATTN_TILE at absolute positions (a shared run is trimmed to whole
     * tiles, the rest of its keys read by each request), a pass is never
     * split along its keys, and instead of a merge of independent states a
     * token's passes run one after another in key order, each starting from
     * the previous one's running max, sum and unnormalized output: the same
     * online softmax, in the same order, as one flat pass over all its keys.
     * The cost: passes of one request no longer run at the same time (a
     * single long sequence is split by KV head, not by keys), and a shared
     * run shorter than a tile is read per request. 0 (default): the fastest
     * plan, whose results vary with the batch by f32 rounding. */
    int32_t batch_invariant;
} cas_attn_plan_opts;

cas_attn_plan_opts cas_attn_plan_opts_default(void);

typedef struct cas_attn_plan cas_attn_plan;

/* Creates a plan for one attention shape. Capacities are hints for the
 * first builds (0 is fine); a build that needs more grows the buffers (the
 * only allocation a build may do). */
cas_status cas_attn_plan_create(cas_attn_plan **out, const cas_attn_shape *shape,
                                const cas_attn_plan_opts *opts, int32_t max_batch,
                                int32_t max_total_q, int64_t max_pages);
void cas_attn_plan_destroy(cas_attn_plan *plan);

/* Plans a batch: validates it, builds the prefix tree of shared page runs,
 * applies the cost model and lays out the passes and the work split across
 * threads. The batch arrays are copied; they may change after the call. */
cas_status cas_attn_plan_build(cas_attn_plan *plan, const cas_attn_batch *batch,
                               int32_t num_pages, const cas_attn_params *params);

/* Runs the plan on one layer's q and pools: q [total_q][Hq][D] float32, o
 * [total_q][Hq][D] float32, lse [total_q][Hq] float32 natural log (lse may be
 * NULL). pool->num_pages must equal the num_pages the plan was built for.
 * Allocates nothing; every element of o and lse is written. */
cas_status cas_attn_plan_run(cas_attn_plan *plan, const cas_kv_pool *pool, const float *q,
                             float *o, float *lse);

/* What a built plan does, for logs, stats, benchmarks and tests. */
typedef struct {
    int32_t tree_nodes;       /* nodes of the shared-run tree (runs shared by >= 2 requests) */
    int32_t shared_passes;    /* of those, passes chosen by the cost model */
    int32_t passes;           /* all passes (shared + per-request) */
    int32_t work_items;       /* units handed to threads */
    int64_t kv_tokens_read;   /* KV tokens read by one run (per KV head) */
    int64_t kv_tokens_flat;   /* KV tokens a flat run would read */
    int64_t shared_rows;      /* query rows (query x head) in shared passes */
    double est_cost_s;        /* cost-model estimate of the run */
    double est_flat_cost_s;   /* cost-model estimate of the flat run */
} cas_attn_plan_info;

void cas_attn_plan_get_info(const cas_attn_plan *plan, cas_attn_plan_info *info);

/* A built plan as a list of passes, for backends that execute it elsewhere
 * (src/cuda). A pass is a set of query tokens (rows of q, each with its
 * absolute position in its request) against one contiguous segment of KV (a
 * run of pages, its first key at absolute position pos0); masking is per
 * (query position, key position), so the same pass serves decode rows,
 * prefill chunks, shared nodes and request tails. Every token appears in at
 * least one pass; its states merge by log-sum-exp. */
typedef struct {
    int32_t page_off; /* offset into pages[]: the segment's page ids */
    int32_t pos0;     /* absolute position of the segment's first key (multiple of page_size) */
    int32_t len;      /* tokens in the segment */
    int32_t tok_off;  /* offset into tok_ids[] / tok_pos[] */
    int32_t n_tok;    /* query tokens of the pass */
    int32_t node;     /* tree node it serves, -1 for a request's own KV */
} cas_attn_pass;

typedef struct {
    cas_attn_shape shape;
    cas_attn_params params;
    int32_t num_pages;           /* pool size the plan was built for */
    int32_t total_q;             /* query tokens of the batch */
    int32_t n_passes;
    const cas_attn_pass *passes; /* [n_passes] */
    const int32_t *pages;        /* [n_page_ids] page ids the passes index */
    int64_t n_page_ids;
    const int32_t *tok_ids;      /* [n_tok_rows] batch token of each pass row */
    const int32_t *tok_pos;      /* [n_tok_rows] its absolute position */
    int32_t n_tok_rows;
} cas_attn_pass_list;

/* The passes of the plan's last build, borrowed: valid until the plan is
 * built again or destroyed. */
void cas_attn_plan_passes(const cas_attn_plan *plan, cas_attn_pass_list *out);

/* Dumps the plan's tree and passes to f (debugging). */
void cas_attn_plan_print(const cas_attn_plan *plan, FILE *f);

/* One-shot convenience: create, build, run, destroy. Allocates; use a plan
 * in the step loop. */
cas_status cas_attn_forward(const cas_attn_shape *shape, const cas_kv_pool *pool,
                            const cas_attn_batch *batch, const cas_attn_params *params,
                            const cas_attn_plan_opts *opts, const float *q, float *o,
                            float *lse);

/* ---- what the CPU backend runs here ------------------------------------- */

/* The SIMD level a plan with opts.simd = CAS_SIMD_AUTO runs: "avx512", "avx2"
 * or "generic" (cas_simd_name of the CPU's widest level). The machine
 * ceilings benchmarks compare against (cas_measure_read_bandwidth,
 * cas_measure_fma_flops) are in core.h. */
const char *cas_attn_simd_name(void);
/* 1 if this CPU runs cas_attn_plan_opts.bf16_dot (AVX-512 and AVX512_BF16);
 * a plan asks for it with simd AUTO or AVX512. */
int cas_attn_bf16_dot_available(void);


/* ---- synthetic batches (tests and benchmarks) ---------------------------- */

/* A random paged batch with a sharing structure, and its owned arrays.
 *
 * Tree spec (the `--tree` option of attn-bench): a list of groups joined by
 * '+', each group `N*T` = N requests sharing T tokens below their parent's,
 * optionally followed by `(list)` of sub-groups among those N requests (their
 * counts may add up to fewer than N: the rest share nothing more). Example:
 * "40*1024(20*512)+10*768" = 40 requests share 1024 tokens, 20 of those share
 * 512 more, 10 others share 768. Shared tokens fill whole pages; what does not
 * fill a page (T % page_size) becomes private tokens of each request. Every
 * request then has `suffix` private tokens more. With tree NULL or "", the
 * spec is "batch*prefix".
 *
 * qlen > 0: every request has qlen queries (at most its KV length); qlen < 0:
 * each has a random count in 1..-qlen. suffix < 0: each has a random private
 * length in 0..-suffix. K, V (in shape->kv_dtype) and q are N(0, 1). */
typedef struct {
    int32_t batch, total_q, num_pages;
    int32_t *qo_indptr, *kv_indptr, *kv_indices, *kv_last_page_len; /* owned */
    void *k, *v;     /* owned pools, num_pages pages each */
    float *q;        /* owned, [total_q][Hq][D] */
    int64_t unique_kv_tokens; /* distinct KV tokens (shared counted once) */
    int64_t flat_kv_tokens;   /* sum of every request's KV length */
} cas_attn_synth;

cas_status cas_attn_synth_create(cas_attn_synth *out, const cas_attn_shape *shape, const char *tree,
                                 int32_t batch, int32_t prefix, int32_t suffix, int32_t qlen,
                                 uint64_t seed);
void cas_attn_synth_destroy(cas_attn_synth *s);
/* on != 0: the K and V pools of later cas_attn_synth_create calls are asked
 * for transparent huge pages (madvise). Each key row of one KV head sits on
 * its own 4 KB page, so a pass over one head misses the TLB on every key; in
 * a VM each miss is a two-level page walk. For benchmarks; not thread-safe
 * against concurrent synth_create calls. */
void cas_attn_synth_huge_pages(int on);
/* Views of a synthetic batch as the contract's structs. */
cas_attn_batch cas_attn_synth_batch(const cas_attn_synth *s);
cas_kv_pool cas_attn_synth_pool(const cas_attn_synth *s);

#ifdef __cplusplus
}
#endif

#endif
