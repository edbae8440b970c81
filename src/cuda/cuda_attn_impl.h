/*
 * cuda_attn_impl.h: what the host side of the CUDA attention backend
 * (cuda_attn.c, C11) and its kernels (cuda_attn_kernels.cu) share: the layout
 * of the GPU plan in device memory and the launchers of the kernels.
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
 * merge kernel combines the states of each token by their log-sum-exp (kind
 * 18: the last attention task to write a token's states merges them,
 * cuda_attn_fuse.cuh).
 */
#ifndef CASCADE_CUDA_ATTN_IMPL_H
#define CASCADE_CUDA_ATTN_IMPL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A pass: query tokens against one contiguous KV segment (same meaning as
 * cas_attn_pass in src/attn/attn_impl.h). */
typedef struct {
    int32_t page_off; /* offset into pages[]: the segment's page ids */
    int32_t pos0;     /* absolute position of the segment's first key */
    int32_t len;      /* tokens in the segment */
    int32_t tok_off;  /* offset into tok_ids[] / tok_pos[] */
    int32_t n_tok;    /* query tokens of the pass */
    int32_t page_runs; /* 1: most page ids follow their predecessor (pages allocated
                          in a row): kind 9 looks for run boxes (its check costs
                          where there are none) */
} cas_cuda_pass;

typedef struct {
    int32_t pass;    /* index into passes[] */
    int32_t kv_head; /* KV head */
    int32_t row0;    /* first row of the pass (row = tok * group + g) */
    int32_t nrows;   /* rows, at most the kernel's rows per CTA */
    int32_t kv0, kv1; /* key range [kv0, kv1) within the segment (trimmed by the masks) */
    int32_t qpos_min, qpos_max; /* least and greatest query position of the rows */
    int32_t pad;     /* host: creation order (stable sort); 0 on the device */
    int32_t flags;   /* kind 10's task pairs: bit 0 the pair shares its keys (multicast),
                        bit 1 a stand-in that writes nothing (partner of an unpaired task) */
    int64_t o_off;   /* -1: direct into o/lse; else scratch float offset of (pass tok 0, head 0),
                        states [n_tok][Hq][D] */
    int64_t lse_off; /* scratch float offset of lse [n_tok][Hq] */
} cas_cuda_task;

/* Header of the plan block; every offset is in bytes from the block start. */
typedef struct {
    int32_t n_passes;
    int32_t n_tasks_wide;   /* tasks for the many-rows kernel */
    int32_t n_tasks_narrow; /* tasks for the few-rows kernel (decode rows) */
    int32_t total_q;
    int32_t n_merge_tok;    /* tokens needing a merge, listed in merge_tok[] */
    int32_t causal;
    int32_t window_left;
    float scale_log2;       /* sm_scale * log2(e) */
    float soft_cap;         /* 0: off */
    float scale;            /* sm_scale */
    int32_t group;          /* Hq / Hkv */
    int32_t n_tasks_mid;    /* tasks of passes with few rows per KV head for the 64-row
                               mma.sync kernel when the many-rows kernel is wgmma */
    int32_t n_tasks_fused;  /* kind 11: decode-tail tasks (at most 8 rows) that the
                               many-rows kernel's spare producer warps and then the narrow
                               kernel take from a shared counter (cas_cuda_launch_attn_fused) */
    int32_t merge_fused;    /* kind 18: the attention kernels merge the split states
                               (cuda_attn_fuse.cuh): no merge kernel */
    int64_t off_passes, off_pages, off_tok_ids, off_tok_pos, off_tasks_wide, off_tasks_narrow,
        off_merge_tok, off_contrib_indptr, off_contrib_o, off_contrib_lse, off_tasks_mid,
        off_tasks_fused;
    int64_t off_cta_ptr;    /* kind 17: int32 [grid + 1], CTA b's tasks of the wide list */
    int64_t off_tok_merge;  /* merge_fused: int32 [total_q], a token's index in merge_tok[]
                               or -1 (written directly) */
    int64_t off_merge_need; /* merge_fused: int32 [n_merge_tok], the writer units of a merge
                               token per KV head (a narrow task, or 64 rows of a wide one) */
    int64_t merge_cnt;      /* merge_fused: device address of the int counters
                               [n_merge_tok][Hkv], zero between runs */
    int64_t block_bytes;    /* bytes of the whole block */
} cas_cuda_plan_hdr;

/* Probe XV 35 (cuda_attn_wgmma.cu): a CTA's positions of the stage ring,
 * nb of the tail warps' tiles among n, walked in order. Position k is owed
 * to the tail warps when (k + 1) nb / n passes an integer (acc: (k nb) mod
 * n, from 0; owed: those not yet given), and they take it while the
 * consumers have tiles left (a_left) only if the two positions before were
 * not both theirs (run): a consumer holds a tile's V stage until the next
 * tile's K has come, and with three tail-warp positions between two tiles of
 * one consumer task the third would be waiting for that stage. Returns 1
 * where position k is the tail warps'. */
typedef struct {
    int32_t acc, owed, run, a_left;
} cas_cuda_tw_walk;
#ifdef __CUDACC__
__host__ __device__ __forceinline__
#else
static inline
#endif
int cas_cuda_tw_next(cas_cuda_tw_walk *w, int32_t nb, int32_t n) {
    const int due = w->acc + nb >= n;
    w->acc += due ? nb - n : nb;
    w->owed += due;
    const int b = w->a_left == 0 || (w->owed > 0 && w->run < 2);
    if (b) {
        w->owed--;
        w->run++;
    } else {
        w->a_left--;
        w->run = 0;
    }
    return b;
}

/* Geometry the kernels are launched with. */
typedef struct {
    int32_t Hq, Hkv, D, page_size;
    int32_t dtype; /* cas_dtype: 1 f16, 2 bf16 */
    int32_t xv;    /* kind 17's probe variant (CASCADE_CUDA_XV when the context was
                      created; measurement only), 0: none */
} cas_cuda_geom;

/* Rows one CTA of the narrow kernel holds; cas_cuda_wide_rows(D, kind) gives
 * those of a kernel kind (0 narrow, 1 wide: 64 rows, 2 wide2: 2 m-tiles per
 * warp, 128 rows for D <= 128; 3 and 4 wgmma: two warpgroups, 128 rows). */
int cas_cuda_wide_rows(int D, int kind);
#define CAS_CUDA_NARROW_ROWS 16

/* Launchers (cuda_attn_kernels.cu). plan points to the device copy of the
 * block. Grids are persistent (fixed size derived from the device), so the
 * launches are identical for every plan: graph capture safe. `wide` is the
 * kernel kind (0 narrow, 1 wide, 2 wide2) and selects the task list. Return a
 * cudaError_t as int. cas_cuda_launch_attn_mid runs the mid task list with
 * the 64-row mma.sync kernel (kind 1's occupancy). */
int cas_cuda_launch_attn(const cas_cuda_geom *g, const void *plan, const void *k, const void *v,
                         const void *q, float *o, float *lse, float *scratch, int wide,
                         int grid, void *stream);
int cas_cuda_launch_attn_mid(const cas_cuda_geom *g, const void *plan, const void *k,
                             const void *v, const void *q, float *o, float *lse, float *scratch,
                             int grid, void *stream);
/* Kind 11: the many-rows kernel (wgmma, TMA) whose producer warpgroup runs
 * the fused list's decode tails on its three spare warps while the
 * consumers run the many-rows tasks, then the narrow kernel (its own list,
 * then what is left of the fused list), launched as a programmatic
 * dependent of the first so that its CTAs take SMs as they free up.
 * counter (device int) must be zero before the launch; the two kernels
 * take fused tasks from it. wide_grid: CTAs of the many-rows kernel,
 * narrow_grid: of the narrow one. */
int cas_cuda_launch_attn_fused(const cas_cuda_geom *g, const void *plan, const void *k,
                               const void *v, const void *q, float *o, float *lse, float *scratch,
                               int *counter, int wide_grid, int narrow_grid, void *stream);
/* Kind 18: the narrow kernel over its list, merging split states itself
 * (cuda_attn_fuse.cuh); pdl: as a programmatic dependent of the many-rows
 * kernel launched before it on stream (a plan without narrow tasks: its
 * empty CTAs then run as the many-rows ones leave). */
int cas_cuda_launch_attn_narrow_fm(const cas_cuda_geom *g, const void *plan, const void *k,
                                   const void *v, const void *q, float *o, float *lse,
                                   float *scratch, int grid, int pdl, void *stream);
/* pdl: launched as a programmatic dependent of the kernel before it on the
 * stream (kind 17: that kernel does not complete before the one before it) */
int cas_cuda_launch_merge(const cas_cuda_geom *g, const void *plan, float *o, float *lse,
                          const float *scratch, int grid, int pdl, void *stream);
/* CTAs per SM the attention kernel reaches (occupancy), for the grid size.
 * Also sets the kernels' shared-memory attributes; call before launching. */
int cas_cuda_attn_occupancy(const cas_cuda_geom *g, int wide, int *ctas_per_sm);
/* Merge of n states [n][rows][D] (o) and [n][rows] (lse) into out. */
int cas_cuda_launch_merge_states(float *o_out, float *lse_out, const float *o_in,
                                 const float *lse_in, int n, int64_t rows, int32_t D,
                                 void *stream);
int cas_cuda_launch_merge2(float *o_out, float *lse_out, const float *o_a, const float *lse_a,
                           const float *o_b, const float *lse_b, int64_t rows, int32_t D,
                           void *stream);
const char *cas_cuda_error_string(int err);

/* The Hopper wgmma kernels (cuda_attn_wgmma.cu, sm_90a), kinds 3 (plain),
 * 4 (the next tile's S overlaps this tile's softmax), 6 and 7
 * (warp-specialized, 128- and 64-key tiles), 8 (6 with the next tile's
 * softmax during this tile's P V), 9 (6 with TMA page loads), 10 (9 in
 * clusters of two, pairs of tasks sharing keys multicast), 11 (9 whose
 * spare producer warps run decode tails; counter: see
 * cas_cuda_launch_attn_fused, NULL for the other kinds), 16 (v9's 9), 17 (9
 * with decode tails in its list, arranged per CTA; pdl: launched as a
 * programmatic dependent of the narrow kernel, whose end it waits for
 * before it completes), 18 (17 merging the split states itself, the plan's
 * merge_fused): head_dim 128 only (cas_cuda_wgmma_supported); the
 * launch and occupancy calls of those kinds forward here. */
int cas_cuda_wgmma_supported(int D);
int cas_cuda_launch_attn_wgmma(const cas_cuda_geom *g, const void *plan, const void *k,
                               const void *v, const void *q, float *o, float *lse, float *scratch,
                               int *counter, int kind, int grid, int pdl, void *stream);
int cas_cuda_wgmma_occupancy(const cas_cuda_geom *g, int kind, int *ctas_per_sm);
/* Kind 10 runs in clusters of two CTAs over a list of task pairs (see the
 * planner): *ctas is its persistent grid (clusters that fit at once x 2);
 * 0 for the other kinds. */
int cas_cuda_wgmma_cluster_grid(const cas_cuda_geom *g, int kind, int *ctas);

#ifdef __cplusplus
}
#endif

#endif
