/*
 * cuda_attn.h: the attention contract of src/attn/attn.h on NVIDIA GPUs.
 *
 * The same function, batch descriptions, masks and merge semantics as the
 * CPU backend; the float64 reference (cas_attn_reference, or its device
 * twin cas_cuda_attn_reference below) is the oracle. Differences at the
 * interface, all on the device side:
 *
 *   - K and V pools live in device memory, bf16 or f16 (f32 pools are
 *     rejected with CAS_ERR_UNSUPPORTED), [num_pages][page_size][Hkv][D].
 *   - q is in device memory in the pools' storage type (bf16 or f16),
 *     [total_q][Hq][D]: the tensor cores take it in that type, and the QKV
 *     projection that produces it writes it so.
 *   - o is f32 [total_q][Hq][D] and lse f32 [total_q][Hq] (natural log), both
 *     in device memory; lse may not be NULL (the merge needs it anyway).
 *   - head_dim 64, 96, 128, 256; page_size 1..256; any GQA group.
 *
 * Kernels. Decode rows (passes of at most 16 rows per KV head) run on an
 * mma.sync kernel whose warps split the keys of each tile. The many-rows
 * passes (a cascade's shared prefixes, prefill chunks) run on Hopper
 * (compute capability 9.0) with head_dim 128 on a warp-specialized wgmma
 * kernel fed by the bulk tensor copy engine, which then also takes the
 * decode tails of a cascade, each CTA given its own range of one task list;
 * elsewhere on a 64-row mma.sync kernel. Split states merge in a third
 * kernel. On Hopper the three are chained on one stream by programmatic
 * dependent launch.
 *
 * Plan and run. A context (cas_cuda_attn) owns fixed-capacity device buffers
 * and a pinned staging copy of the GPU plan. cas_cuda_attn_plan_*() turns a
 * batch (flat), a list of passes, or a CPU plan built by cas_attn_plan_build
 * into GPU tasks in the staging copy (host only, no allocation, no device
 * call except waiting for the previous upload to finish reading the staging).
 * cas_cuda_attn_upload() copies it to the device on a stream (one copy).
 * cas_cuda_attn_run() launches the kernels on a stream; it never allocates
 * and its launches do not depend on the plan (counts are read on the
 * device), so a run captured once in a CUDA graph replays correctly after
 * any later plan + upload that fits the capacities.
 *
 * Threads: one context is used by one thread at a time.
 */
#ifndef CASCADE_CUDA_ATTN_H
#define CASCADE_CUDA_ATTN_H

#include <cuda_runtime_api.h>

#include "../attn/attn.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Host code: evaluates a CUDA runtime call; on failure stores a cas_error
 * naming the call, file and line in `st` (a cas_status in scope) and jumps
 * to `label`. */
#define CAS_CUDA_TRY(call, label)                                                             \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            st = cas_error(CAS_ERR_INTERNAL, "%s:%d: %s: %s", __FILE__, __LINE__, #call,     \
                           cudaGetErrorString(e_));                                           \
            goto label;                                                                       \
        }                                                                                     \
    } while (0)

/* Reports a failed CUDA runtime call as a cas_status with file and line. */
#define CAS_CUDA_CHECK(call)                                                              \
    do {                                                                                  \
        cudaError_t cas_e_ = (call);                                                      \
        if (cas_e_ != cudaSuccess)                                                        \
            return cas_error(CAS_ERR_INTERNAL, "%s:%d: %s: %s", __FILE__, __LINE__, #call, \
                             cudaGetErrorString(cas_e_));                                 \
    } while (0)

/* Capacities of a context: every plan must fit them (a plan that does not
 * is refused with CAS_ERR_NOMEM and the context stays usable). */
typedef struct {
    int32_t max_total_q;     /* query tokens in one batch */
    int32_t max_passes;      /* passes in one plan (flat: the batch size) */
    int32_t max_tok_rows;    /* sum over passes of their query tokens */
    int64_t max_page_ids;    /* page ids the passes refer to (flat: kv_indptr[B]) */
    int32_t max_split;       /* most KV chunks one pass may be split into (0: 64) */
    int64_t max_states;      /* token states (all heads) in split-KV scratch (0: 8 * max_tok_rows) */
    int32_t device;          /* CUDA device ordinal */
} cas_cuda_attn_caps;

/* The many-rows kernel. */
typedef enum {
    CAS_CUDA_KERNEL_AUTO = 0,     /* wgmma where the device and head_dim allow it, else mma.sync */
    CAS_CUDA_KERNEL_MMA_SYNC = 1, /* 64-row mma.sync kernel, any sm_80+ GPU, every head_dim */
    CAS_CUDA_KERNEL_WGMMA = 2     /* Hopper wgmma kernel: compute capability 9.0, head_dim 128 */
} cas_cuda_kernel;

/* How a context runs; cas_cuda_attn_opts_default() gives the defaults (a NULL
 * opts at create means them). */
typedef struct {
    /* AUTO picks wgmma where it can run; an explicit kernel the device or
     * shape cannot run is refused at create (CAS_ERR_UNSUPPORTED) */
    cas_cuda_kernel kernel;
    /* wgmma: a decode tail's 128-key tile against a shared-pass tile when the
     * planner spreads the tails over the CTAs (> 0; default 1.6, measured on
     * an H200: bench/HISTORY.md) */
    double tail_cost;
    /* wgmma: a cascade's decode tails join the many-rows list when they are
     * at least a grid of tasks, or when they have at most this many keys
     * (>= 0; default 512: few long tails ran faster on the narrow kernel) */
    int32_t tail_mix_len;
} cas_cuda_attn_opts;

cas_cuda_attn_opts cas_cuda_attn_opts_default(void);

typedef struct cas_cuda_attn cas_cuda_attn;

/* Creates a context for one attention shape on caps->device; opts NULL:
 * the defaults. Allocates everything the context will use. */
cas_status cas_cuda_attn_create(cas_cuda_attn **out, const cas_attn_shape *shape,
                                const cas_cuda_attn_caps *caps, const cas_cuda_attn_opts *opts);
void cas_cuda_attn_destroy(cas_cuda_attn *a);

/* Plans a batch without cascade: one pass per request. */
cas_status cas_cuda_attn_plan_flat(cas_cuda_attn *a, const cas_attn_batch *batch,
                                   int32_t num_pages, const cas_attn_params *params);

/* Plans an explicit pass list (attn.h: cas_attn_pass_list; its shape is not
 * read): passes[i] covers pages[page_off .. page_off + ceil(len /
 * page_size)) from key position pos0 (a multiple of page_size), for the
 * query tokens tok_ids[tok_off .. tok_off + n_tok) at positions tok_pos[...].
 * Every token 0 .. total_q-1 must appear in at least one pass. The GPU
 * chooses its own split of every pass. */
cas_status cas_cuda_attn_plan_passes(cas_cuda_attn *a, const cas_attn_pass_list *list);

/* Plans the passes of a CPU plan after cas_attn_plan_build (the shared-node
 * passes and the tails; cas_attn_plan_passes), which must have this
 * context's shape. */
cas_status cas_cuda_attn_plan_from_cpu(cas_cuda_attn *a, const cas_attn_plan *plan);

/* Copies the staged plan to the device, asynchronously on `stream`. */
cas_status cas_cuda_attn_upload(cas_cuda_attn *a, cudaStream_t stream);

/* Runs the uploaded plan: k, v are the device pools, q [total_q][Hq][D] of the
 * pools' type, o [total_q][Hq][D] f32 and lse [total_q][Hq] f32. Every
 * element of o and lse of tokens 0..total_q-1 is written. Capturable. */
cas_status cas_cuda_attn_run(cas_cuda_attn *a, const void *k, const void *v, const void *q,
                             float *o, float *lse, cudaStream_t stream);

/* Cost-model numbers of this backend for the CPU planner
 * (cas_attn_plan_opts.cost), so that cas_attn_plan_build decides flat or
 * cascade per node for the GPU: HBM and L2 rates, the shared pass's
 * tensor-core rate and the fixed cost of a pass plus merge, as measured on an
 * H200 (bench/HISTORY.md). */
cas_attn_cost cas_cuda_attn_cost(void);

/* What the last plan does. */
typedef struct {
    int32_t passes, tasks_wide, tasks_narrow, merge_tokens, contribs;
    int64_t plan_bytes;     /* bytes uploaded */
    int64_t kv_tokens_read; /* per KV head, over all tasks (each row block reads its range) */
} cas_cuda_attn_info;
void cas_cuda_attn_get_info(const cas_cuda_attn *a, cas_cuda_attn_info *info);

/* The many-rows kernel this context runs (never AUTO), and its name:
 * "wgmma" or "mma.sync". */
cas_cuda_kernel cas_cuda_attn_kernel(const cas_cuda_attn *a);
const char *cas_cuda_attn_kernel_name(const cas_cuda_attn *a);

/* Merges of attention states in device memory (f32), the semantics of
 * cas_attn_merge2 / cas_attn_merge_n: lse -inf is the empty state. merge2:
 * out may alias a or b. merge_n: inputs stacked, o_in [n][rows][D], lse_in
 * [n][rows]; the output aliases no input. Asynchronous on stream. */
cas_status cas_cuda_attn_merge2(float *o_out, float *lse_out, const float *o_a,
                                const float *lse_a, const float *o_b, const float *lse_b,
                                int64_t rows, int32_t head_dim, cudaStream_t stream);
cas_status cas_cuda_attn_merge_n(float *o_out, float *lse_out, const float *o_in,
                                 const float *lse_in, int n, int64_t rows, int32_t head_dim,
                                 cudaStream_t stream);

/* ---- measurement and checking (tests and benchmarks; these allocate) ----- */

/* The definition of attn.h computed in float64 on the device, one warp per
 * (query token, q head), directly from the pools and the batch (no plan):
 * the oracle for batches whose CPU reference would take minutes. k, v, q in
 * device memory as for cas_cuda_attn_run (q in the pools' type); the batch's
 * arrays on the host (validated, then copied); o_ref [total_q][Hq][D] and
 * lse_ref [total_q][Hq] double in device memory. Synchronous. */
cas_status cas_cuda_attn_reference(const cas_attn_shape *shape, const void *k, const void *v,
                                   int32_t num_pages, const cas_attn_batch *batch,
                                   const cas_attn_params *params, const void *q, double *o_ref,
                                   double *lse_ref);

/* Device-to-device copy rate over 2 GiB in GB/s, bytes read + written
 * (median of 20 after 3 warm-up copies): the bandwidth ceiling. */
cas_status cas_cuda_measure_copy(int device, double *gbps);
/* bf16 matrix product n x n x n through cuBLAS on random data, f32
 * accumulation, in TFLOP/s (median of 10): the tensor-core ceiling. */
cas_status cas_cuda_measure_gemm(int device, int n, double *tflops);
/* Median milliseconds of `iters` runs of the uploaded plan after `warmup`
 * untimed ones, each between two CUDA events on stream s; graph = 1 captures
 * one run in a CUDA graph and times its replays, 0 launches eagerly;
 * flush_l2 = 1 writes 256 MB before every run (outside the timed region), so
 * that a run finds none of its bytes in the L2, as a model's step reading
 * each layer's KV once would. */
cas_status cas_cuda_attn_time(cas_cuda_attn *a, const void *k, const void *v, const void *q,
                              float *o, float *lse, cudaStream_t s, int warmup, int iters,
                              int graph, int flush_l2, double *ms);
/* Raises caps (start from zeros) so that the CPU plan fits (a context made
 * with the result takes every plan passed here). */
void cas_cuda_attn_caps_fit(cas_cuda_attn_caps *caps, const cas_attn_plan *plan);
/* The device's name into buf. */
const char *cas_cuda_device_name(int device, char *buf, size_t n);

#ifdef __cplusplus
}
#endif

#endif
