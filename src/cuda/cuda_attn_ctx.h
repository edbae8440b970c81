/*
 * cuda_attn_ctx.h: the context of the CUDA attention backend, shared by its
 * host files (cuda_attn.c: create, upload, run; cuda_attn_plan.c: the
 * planner). Private to src/cuda.
 */
#ifndef CASCADE_CUDA_ATTN_CTX_H
#define CASCADE_CUDA_ATTN_CTX_H

#include "cuda_attn.h"
#include "cuda_attn_impl.h"

/* a CTA in the planner's heap of loads, by (load, cta) */
struct cta_load_ent {
    double load;
    int32_t cta;
};

struct cas_cuda_attn {
    cas_attn_shape shape;
    cas_cuda_attn_caps caps;
    cas_cuda_attn_opts opts;
    cas_cuda_geom geom;
    int device, num_sms, occ_wide, occ_narrow;
    int wide;      /* CAS_CUDA_WIDE_WGMMA or CAS_CUDA_WIDE_MMA: the many-rows kernel */
    int wide_rows; /* its rows per CTA */
    int wide_grid; /* CTAs of its persistent grid */
    int narrow_grid;
    int64_t cap_tasks, cap_states, cap_bytes, scratch_floats;

    /* pinned staging and its device copy */
    char *stage;
    char *dplan;
    float *dscratch;
    cudaEvent_t upload_done, ev_fork, ev_join;
    cudaStream_t side; /* mma.sync: the narrow kernel beside the many-rows one */

    /* the planner's work arrays (allocated at create) */
    cas_cuda_task *tw, *tn;  /* [cap_tasks] the many-rows and the narrow list */
    cas_cuda_task *tp;       /* [cap_tasks] sort output, the list being arranged */
    int32_t *task_cta;       /* [cap_tasks] wgmma: the CTA each many-rows task goes to */
    int32_t *cta_ptr;        /* [wide_grid + 1] wgmma: CTA b's range of the list */
    int32_t *cta_pos;        /* [wide_grid] */
    struct cta_load_ent *heap; /* [wide_grid] */
    uint64_t *skey;          /* [2 cap_tasks]: sort_tasks' keys (two buffers) */
    int32_t *sidx;           /* [2 cap_tasks]: and their tasks */
    int32_t *cls_idx;        /* [max_passes]: the passes of one class (class_list) */
    int32_t *cnt, *fill;     /* [max_total_q] */
    int32_t *direct_tok;     /* [max_total_q] */
    int32_t *nsplit, *chunk; /* [max_passes] */
    int64_t *job_off;        /* [max_passes] scratch offset of the pass's first chunk, -1 direct */
    cas_attn_pass *flat_passes;   /* [max_passes] plan_flat's passes */
    int32_t *flat_ids, *flat_pos; /* [max_total_q] */

    cas_cuda_attn_info info;
};

/* Bytes of a plan block for these capacities (cuda_attn_plan.c). */
int64_t cas_cuda_plan_bytes_cap(const cas_cuda_attn_caps *c, int64_t cap_tasks, int64_t cap_states,
                                int64_t grid);

#endif
