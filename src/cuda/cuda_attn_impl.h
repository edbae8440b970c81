/*
 * cuda_attn_impl.h: what the host side of the CUDA attention backend
 * (cuda_attn.c, cuda_attn_plan.c: C11) and its kernels (*.cu) share: the
 * layout of the GPU plan in device memory and the launchers of the kernels.
 * Private to src/cuda (and its tests).
 *
 * The GPU plan is one block of memory, laid out identically in pinned host
 * staging and in device memory, so a re-plan is one host-to-device copy. Its
 * arrays have fixed capacities chosen at create time; the kernels read their
 * counts from the header in device memory, never from launch arguments, so a
 * captured CUDA graph stays valid when the plan changes (same capacities).
 *
 * Work is described as tasks: one task is (pass, KV head, a block of rows of
 * that pass, a key range of the pass's segment). A row of a pass is
 * (pass token, group head): row = tok * group + g. A task writes one state
 * per row, either straight into o/lse (direct) or into scratch, from where the
 * merge kernel combines the states of each token by their log-sum-exp.
 *
 * Two task lists: the narrow one (passes of at most CAS_CUDA_NARROW_ROWS
 * rows per KV head: decode rows, request tails), run by the mma.sync kernel
 * with 16 rows a CTA whose warps split each tile's keys; and the many-rows
 * one (shared-prefix passes, prefill chunks), run by the wgmma kernel on
 * Hopper (then it also holds the decode tails of a cascade, arranged per CTA:
 * cta_ptr) or by the 64-row mma.sync kernel elsewhere (then CTA b takes
 * tasks b, b + grid, ...).
 */
#ifndef CASCADE_CUDA_ATTN_IMPL_H
#define CASCADE_CUDA_ATTN_IMPL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A pass as the kernels read it: cas_attn_pass (attn.h) with, instead of the
 * tree node, whether its page ids run in a row. */
typedef struct {
    int32_t page_off; /* offset into pages[]: the segment's page ids */
    int32_t pos0;     /* absolute position of the segment's first key */
    int32_t len;      /* tokens in the segment */
    int32_t tok_off;  /* offset into tok_ids[] / tok_pos[] */
    int32_t n_tok;    /* query tokens of the pass */
    int32_t page_runs; /* 1: most page ids follow their predecessor (pages allocated in a row):
                          the wgmma kernel looks for 64-key boxes of the row map (its check
                          costs where there are none) */
} cas_cuda_pass;

typedef struct {
    int32_t pass;    /* index into passes[] */
    int32_t kv_head; /* KV head */
    int32_t row0;    /* first row of the pass (row = tok * group + g) */
    int32_t nrows;   /* rows, at most the kernel's rows per CTA */
    int32_t kv0, kv1; /* key range [kv0, kv1) within the segment (trimmed by the masks) */
    int32_t qpos_min, qpos_max; /* least and greatest query position of the rows */
    int32_t seq;     /* host: creation order (the sorts are stable by it); 0 on the device */
    int32_t flags;   /* host: CAS_CUDA_TASK_TAIL while planning; 0 on the device */
    int64_t o_off;   /* -1: direct into o/lse; else scratch float offset of (pass tok 0, head 0),
                        states [n_tok][Hq][D] */
    int64_t lse_off; /* scratch float offset of lse [n_tok][Hq] */
} cas_cuda_task;
/* a decode tail that joins the wgmma kernel's list (the planner's mark) */
#define CAS_CUDA_TASK_TAIL 8

/* Header of the plan block; every offset is in bytes from the block start. */
typedef struct {
    int32_t n_passes;
    int32_t n_tasks_wide;   /* tasks for the many-rows kernel */
    int32_t n_tasks_narrow; /* tasks for the narrow kernel (decode rows) */
    int32_t total_q;
    int32_t n_merge_tok;    /* tokens needing a merge, listed in merge_tok[] */
    int32_t causal;
    int32_t window_left;
    float scale_log2;       /* sm_scale * log2(e) */
    float soft_cap;         /* 0: off */
    float scale;            /* sm_scale */
    int32_t group;          /* Hq / Hkv */
    int32_t reserved;       /* 0 */
    int64_t off_passes, off_pages, off_tok_ids, off_tok_pos, off_tasks_wide, off_tasks_narrow,
        off_merge_tok, off_contrib_indptr, off_contrib_o, off_contrib_lse;
    int64_t off_cta_ptr;    /* wgmma: int32 [grid + 1], CTA b's tasks of the many-rows list */
    int64_t block_bytes;    /* bytes of the whole block */
} cas_cuda_plan_hdr;

/* The many-rows kernels (cas_cuda_kernel of cuda_attn.h without AUTO). */
enum { CAS_CUDA_WIDE_MMA = 1, CAS_CUDA_WIDE_WGMMA = 2 };

/* Geometry the kernels are launched with. */
typedef struct {
    int32_t Hq, Hkv, D, page_size;
    int32_t dtype; /* cas_dtype: 1 f16, 2 bf16 */
} cas_cuda_geom;

/* Rows one CTA of the narrow kernel holds, and of a many-rows kernel
 * (cas_cuda_wide_rows: 64 for mma.sync, 128 for wgmma). */
#define CAS_CUDA_NARROW_ROWS 16
int cas_cuda_wide_rows(int wide);

/* Launchers (cuda_attn_mma.cu, cuda_attn_wgmma.cu, cuda_attn_merge.cu).
 * plan points to the device copy of the block. Grids are persistent (fixed
 * size derived from the device), so the launches are identical for every
 * plan: graph capture safe. Each returns a cudaError_t as int. */

/* The mma.sync kernel over the narrow list (wide 0) or the many-rows list
 * (wide CAS_CUDA_WIDE_MMA). The narrow kernel lets a programmatic dependent
 * start its CTAs as its own leave (without a dependent that does nothing). */
int cas_cuda_launch_attn(const cas_cuda_geom *g, const void *plan, const void *k, const void *v,
                         const void *q, float *o, float *lse, float *scratch, int wide, int grid,
                         void *stream);
/* The wgmma kernel over the many-rows list, as a programmatic dependent of
 * the kernel before it on the stream (the narrow one), whose end it waits
 * for before it completes. Head_dim 128 only (cas_cuda_wgmma_supported). */
int cas_cuda_wgmma_supported(int D);
int cas_cuda_launch_attn_wgmma(const cas_cuda_geom *g, const void *plan, const void *k,
                               const void *v, const void *q, float *o, float *lse, float *scratch,
                               int grid, void *stream);
/* CTAs per SM the kernel of `wide` (0 narrow) reaches, for the grid size.
 * Also sets the kernels' shared-memory attributes; call before launching. */
int cas_cuda_attn_occupancy(const cas_cuda_geom *g, int wide, int *ctas_per_sm);
int cas_cuda_wgmma_occupancy(const cas_cuda_geom *g, int *ctas_per_sm);
/* The merge of the plan's split states into o/lse; pdl: as a programmatic
 * dependent of the kernel before it on the stream. */
int cas_cuda_launch_merge(const cas_cuda_geom *g, const void *plan, float *o, float *lse,
                          const float *scratch, int grid, int pdl, void *stream);
/* Merge of n states [n][rows][D] (o) and [n][rows] (lse) into out. */
int cas_cuda_launch_merge_states(float *o_out, float *lse_out, const float *o_in,
                                 const float *lse_in, int n, int64_t rows, int32_t D,
                                 void *stream);
int cas_cuda_launch_merge2(float *o_out, float *lse_out, const float *o_a, const float *lse_a,
                           const float *o_b, const float *lse_b, int64_t rows, int32_t D,
                           void *stream);
/* The float64 reference on the device (cuda_attn_ref.cu): one warp per
 * (query token, q head). Arrays in device memory: tok_req, tok_pos
 * [total_q] (each token's request and absolute position), kv_indptr,
 * kv_indices (the batch's), kv_len [batch] (each request's keys). */
int cas_cuda_launch_reference(const cas_cuda_geom *g, const void *k, const void *v, const void *q,
                              const int32_t *tok_req, const int32_t *tok_pos, const int32_t *kv_indptr,
                              const int32_t *kv_indices, const int32_t *kv_len, int32_t total_q, int causal,
                              int window_left, float soft_cap, float scale, double *o_ref, double *lse_ref,
                              void *stream);
const char *cas_cuda_error_string(int err);

#ifdef __cplusplus
}
#endif

#endif
