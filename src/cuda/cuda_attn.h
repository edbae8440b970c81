/*
 * cuda_attn.h: the attention contract of src/attn/attn.h on NVIDIA GPUs.
 *
 * The same function, batch descriptions, masks and merge semantics as the
 * CPU backend; the float64 reference (cas_attn_reference) is the oracle.
 * Differences at the interface, all on the device side:
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
#include "../attn/attn_impl.h"

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

typedef struct {
    int32_t max_total_q;     /* query tokens in one batch */
    int32_t max_passes;      /* passes in one plan (flat: the batch size) */
    int32_t max_tok_rows;    /* sum over passes of their query tokens */
    int64_t max_page_ids;    /* page ids the passes refer to (flat: kv_indptr[B]) */
    int32_t max_split;       /* most KV chunks one pass may be split into (0: 64) */
    int64_t max_states;      /* token states (all heads) in split-KV scratch (0: 8 * max_tok_rows) */
    int32_t device;          /* CUDA device ordinal */
} cas_cuda_attn_caps;

typedef struct cas_cuda_attn cas_cuda_attn;

cas_status cas_cuda_attn_create(cas_cuda_attn **out, const cas_attn_shape *shape,
                                const cas_cuda_attn_caps *caps);
void cas_cuda_attn_destroy(cas_cuda_attn *a);

/* Plans a batch without cascade: one pass per request. */
cas_status cas_cuda_attn_plan_flat(cas_cuda_attn *a, const cas_attn_batch *batch,
                                   int32_t num_pages, const cas_attn_params *params);

/* Plans the passes of a CPU plan (struct cas_attn_plan, src/attn/attn_impl.h)
 * after cas_attn_plan_build: the shared-node passes and the tails. The GPU
 * chooses its own split of every pass. */
cas_status cas_cuda_attn_plan_from_cpu(cas_cuda_attn *a, const struct cas_attn_plan *plan);

/* Plans an explicit pass list (the layout of src/attn/attn_impl.h):
 * passes[i] covers pages[page_off .. page_off + ceil(len / page_size)) from
 * key position pos0 (a multiple of page_size), for the query tokens
 * tok_ids[tok_off .. tok_off + n_tok) at positions tok_pos[...]. Every token
 * 0 .. total_q-1 must appear in at least one pass. */
cas_status cas_cuda_attn_plan_passes(cas_cuda_attn *a, const cas_attn_params *params,
                                     int32_t num_pages, int32_t n_passes,
                                     const cas_attn_pass *passes,
                                     const int32_t *pages, int64_t n_page_ids,
                                     const int32_t *tok_ids, const int32_t *tok_pos,
                                     int32_t n_tok_rows, int32_t total_q);

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
 * H200 (bench/NOTES.md). */
cas_attn_cost cas_cuda_attn_cost(void);

/* What the last plan does. */
typedef struct {
    int32_t passes, tasks_wide, tasks_narrow, merge_tokens, contribs;
    int32_t tasks_mid; /* tasks of few-row passes on mma.sync next to wgmma */
    int32_t tasks_fused; /* kind 11: decode-tail tasks run beside the many-rows tasks */
    int64_t plan_bytes;     /* bytes uploaded */
    int64_t kv_tokens_read; /* per KV head, over all tasks (each row block reads its range) */
} cas_cuda_attn_info;
void cas_cuda_attn_get_info(const cas_cuda_attn *a, cas_cuda_attn_info *info);
/* Kind 11, measurement: of the last finished run's fused tasks, how many the
 * many-rows kernel's tail warps ran and how many the narrow kernel did
 * (synchronous; zeros for the other kinds). */
cas_status cas_cuda_attn_fused_split(cas_cuda_attn *a, int32_t *by_tail_warps, int32_t *by_narrow);

/* The many-rows (shared pass, prefill) kernel this context runs: "wgmma"
 * (Hopper, head_dim 128), "wgmma-overlap", "wgmma-ws" (warp-specialized),
 * "wgmma-ws64", "wgmma-ws-overlap", "wgmma-ws-tma" (TMA page loads),
 * "wgmma-ws-mc" (clusters, multicast), "wgmma-ws-tma-tails" (TMA, decode
 * tails on the spare producer warps), "wgmma-ws-tma-v9" (16: kind 9 as it
 * was in v9), "wgmma-ws-tma-mix" (17: kind 9 running the decode tails too,
 * in task lists arranged per CTA), "wgmma-ws-tma-mix-fm" (18: kind 17 with
 * the merge of split states inside the attention kernels, no merge kernel),
 * "mma.sync" or "mma.sync-2mtile". Chosen at create; the environment variable
 * CASCADE_CUDA_WIDE=1|2|3|4|6|7|8|9|10|11|16|17|18 forces one
 * (a kind the device lacks falls back to mma.sync). */
const char *cas_cuda_attn_kernel_name(const cas_cuda_attn *a);
/* Whether `kind` names a many-rows kernel kind of CASCADE_CUDA_WIDE (1-4,
 * 6-11, 16-18); other values fall back to the default. Tuning knobs of
 * kinds 17 and 18, read at create: CASCADE_CUDA_TAIL_COST (a tail tile's cost
 * against a shared-pass tile when tails are given to CTAs, default 1.6),
 * CASCADE_CUDA_TAIL_ORDER (0 tails first in a CTA, 1 shared tasks first,
 * the default, 2 and 3 interleaved; other values 1), CASCADE_CUDA_TAIL_MIX_LEN (tails of at
 * most this many keys join the many-rows list even when they are few,
 * default 512), CASCADE_CUDA_PDL=0 (kind 17: two streams instead of the
 * chained launches). CASCADE_CUDA_RUN_MASK is a timing probe only (launches just
 * the kernels of its bits: 1 narrow, 2 many-rows, 4 merge; results wrong).
 * Kind 18 probes: CASCADE_CUDA_FM=0 (plan and run it without the fused
 * merge, the merge kernel after the two), CASCADE_CUDA_ORDER18=1 (the narrow
 * kernel first even when it has no tasks). Kind 18 is correct but slower than
 * 17 on the H200 (bench/NOTES.md, v12): a writer unit that is last for
 * many tokens merges them one warp per head in turn, on its CTA's path. */
int cas_cuda_attn_kind_known(int kind);

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

/* ---- measurement (benchmarks; these allocate) -------------------------- */

/* Device-to-device copy rate over 2 GiB in GB/s, bytes read + written
 * (median of 20 after 3 warm-up copies): the bandwidth ceiling. */
cas_status cas_cuda_measure_copy(int device, double *gbps);
/* bf16 matrix product n x n x n through cuBLAS on random data, f32
 * accumulation, in TFLOP/s (median of 10): the tensor-core ceiling. */
cas_status cas_cuda_measure_gemm(int device, int n, double *tflops);
/* Median milliseconds of `iters` runs of the uploaded plan after `warmup`
 * untimed ones, each between two CUDA events on stream s; graph = 1 captures
 * one run in a CUDA graph and times its replays, 0 launches eagerly. */
cas_status cas_cuda_attn_time(cas_cuda_attn *a, const void *k, const void *v, const void *q,
                              float *o, float *lse, cudaStream_t s, int warmup, int iters,
                              int graph, double *ms);
/* Raises caps (start from zeros) so that the CPU plan fits (a context made
 * with the result takes every plan passed here). */
void cas_cuda_attn_caps_fit(cas_cuda_attn_caps *caps, const struct cas_attn_plan *plan);
/* The device's name into buf. */
const char *cas_cuda_device_name(int device, char *buf, size_t n);

#ifdef __cplusplus
}
#endif

#endif
