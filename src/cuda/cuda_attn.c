/*
 * cuda_attn.c: host side of the CUDA attention backend (C11): the context,
 * the GPU plan (tasks, split-KV, merge lists) built in pinned staging, its
 * upload, and the run that launches the kernels of cuda_attn_kernels.cu.
 *
 * Planning is pure host work over arrays allocated at create time. Each pass
 * (query tokens x one KV segment) is split along its KV into chunks so that
 * the GPU has a few waves of CTAs, then into tasks per KV head and row block
 * (64 rows for the wide kernel, 16 for the narrow one); each task's key range
 * is trimmed by the causal and window masks of its rows. A token whose only
 * state comes from one unsplit pass is written directly; the others get
 * scratch states and a merge list. Tasks are ordered longest first
 * (stable), so row blocks over the same KV run side by side and share L2.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_attn.h"
#include "cuda_attn_impl.h"

/* The default many-rows kernel kind where the device has wgmma (17: the
 * warp-specialized wgmma kernel with TMA page loads that also runs the
 * decode tails of a cascade, its launches chained by programmatic
 * dependence; 9 is it without either, 6 kind 9 with cp.async only, 3 is
 * v4's) or not (then 1 regardless). */
#define CAS_CUDA_DEFAULT_WIDE 17
/* kinds 17 and 18 (17 with the merge in the attention kernels) plan alike */
#define MIX_KIND(k) ((k) == 17 || (k) == 18)
/* Passes of at most this many rows per KV head (tokens x group heads) run on
 * the 64-row mma.sync kernel next to wgmma (see mid_rows below); 0: off.
 * Off by default: on the H200 with 64 it was slower than wgmma in 23 of the
 * 24 grid cases with 32-64 rows per KV head (1.10x in geometric mean, same
 * run; bench/NOTES.md, v4d). CASCADE_CUDA_MID_ROWS=64 turns it on. */
#define CAS_CUDA_DEFAULT_MID_ROWS 0
/* Kind 11 (an experiment, slower than kind 9 on the H200: bench/NOTES.md,
 * v8): decode tails of at most this many rows per KV head (tokens x group
 * heads: the N of the tail warps' transposed products) run on the many-rows
 * kernel's spare producer warps, split into tasks of about
 * CAS_CUDA_DEFAULT_FUSE_CHUNK keys (the tail warps take one at a time while
 * their CTA's consumers have more tiles left than the last task took:
 * smaller tasks end closer together, more of them cost more states to
 * merge). */
#define CAS_CUDA_FUSED_ROWS 8
#define CAS_CUDA_DEFAULT_FUSE_CHUNK 256

#define ALIGN16(x) (((x) + 15) & ~(int64_t)15)

/* Floats of scratch one (pass, chunk) takes: its tokens' states [n_tok][Hq][D], then their
 * LSEs [n_tok][Hq], rounded up to an even count, so that every state starts on 8 bytes (the
 * kernels store pairs of floats; with Hq and n_tok odd the count is odd) */
static int64_t job_stride(int32_t n_tok, int32_t Hq, int32_t D) {
    const int64_t f = (int64_t)n_tok * Hq * (D + 1);
    return f + (f & 1);
}

/* a CTA in arrange_mix's heap, by (load, cta) */
struct cta_load_ent {
    double load;
    int32_t cta;
};
struct mix_item {
    double key;    /* order within the CTA */
    int32_t cta;   /* the CTA that runs the task */
    int32_t idx;   /* the task */
};

struct cas_cuda_attn {
    cas_attn_shape shape;
    cas_cuda_attn_caps caps;
    cas_cuda_geom geom;
    int device, num_sms, occ_wide, occ_narrow;
    int wide_grid; /* CTAs of the many-rows kernel's persistent grid */
    int wide_kind, wide_rows; /* kernel kind of the many-rows tasks and its rows per CTA */
    /* passes of more than CAS_CUDA_NARROW_ROWS and at most mid_rows rows per
     * KV head go to the 64-row mma.sync kernel (mid task list) when the
     * many-rows kernel is wgmma, whose 128-row CTA would be mostly padding;
     * 0: no mid list (every such pass on the many-rows kernel) */
    int mid_rows, occ_mid, mid_grid;
    /* kind 11: decode-tail passes of at most CAS_CUDA_FUSED_ROWS rows go to
     * the fused list, in chunks of about fuse_chunk keys, when the plan has
     * many-rows work for them to run beside */
    int fuse_chunk;
    int snake; /* persistent lists walked snake-wise (snake_rounds); CASCADE_CUDA_SNAKE=0: not */
    /* kind 17: the decode tails join the many-rows list (when the plan has a
     * many-rows pass), arranged per CTA (arrange_mix): tail_cost is a tail
     * tile's cost against a many-rows tile (CASCADE_CUDA_TAIL_COST), tail_order
     * how a CTA's tails and shared tasks follow each other
     * (CASCADE_CUDA_TAIL_ORDER: 0 tails first, 1 shared first, 2 interleaved
     * with a phase per KV chunk, 3 interleaved; tail_cost default 1.6). v18's
     * order 4 (CTAs of their own for the tails) measured slower in 8 of 10
     * decode cases and was removed (bench/NOTES.md v18-v19; git history) */
    double tail_cost;
    int tail_order;
    /* probe CASCADE_CUDA_XV=35 (kind 17, bf16, head_dim 128): a
     * tail of at most 8 rows may go to its CTA's tail warps (flags bit 5)
     * instead of the consumers, whichever ends sooner at tw_cost a tile (a
     * tail warps' tile against a many-rows tile, CASCADE_CUDA_TW_COST) and
     * tw_task a task (CASCADE_CUDA_TW_TASK_COST) */
    double tw_cost, tw_task;
    /* a tail pass joins the list when the tails are at least a grid of
     * (unsplit) tasks or it has at most tail_mix_len keys
     * (CASCADE_CUDA_TAIL_MIX_LEN): few long tails ran faster on the narrow
     * kernel (bench/NOTES.md, v11) */
    int tail_mix_len;
    /* kind 17: one stream, the many-rows kernel a programmatic dependent of
     * the narrow one and the merge of it (CASCADE_CUDA_PDL=0: two streams,
     * plain launches, as the other kinds; the many-rows kernel first and the
     * narrow one its dependent measured slower where tails stay narrow:
     * bench/NOTES.md, v11) */
    int pdl;
    /* kind 18 probes: fm18 0 (CASCADE_CUDA_FM=0) plans without the fused
     * merge and launches the merge kernel after the two; order18 1
     * (CASCADE_CUDA_ORDER18=1) always launches the narrow kernel first */
    int fm18, order18;
    int run_mask; /* CASCADE_CUDA_RUN_MASK (a timing probe, wrong results): the run
                     launches the narrow (1), many-rows (2) and merge (4) kernels of its bits */
    int32_t *cta_ptr;  /* [wide_grid + 1] */
    struct mix_item *mix; /* [2 cap_tasks] CTA and order of each task */
    double *cta_load;  /* [4 wide_grid] */
    struct cta_load_ent *heap; /* [2 wide_grid]: the consumers', then the tail warps' */
    int32_t *cta_pos;  /* [wide_grid] */
    uint64_t *skey;    /* [4 cap_tasks]: sort_tasks' keys (two buffers) */
    int32_t *sidx;     /* [4 cap_tasks]: and their tasks */
    int32_t *cls_idx;  /* [max_passes]: the passes of one class (class_list) */
    int64_t cap_tasks, cap_states, cap_bytes, scratch_floats;

    /* pinned staging and its device copy */
    char *stage;
    char *dplan;
    float *dscratch;
    int *dcounter; /* kind 11: the fused list's next task (zeroed by each run) */
    int *dmcnt;    /* kind 18: the merge counters [max_total_q][Hkv] (cuda_attn_fuse.cuh) */
    cudaEvent_t upload_done, ev_fork, ev_join, ev_join2;
    cudaStream_t side, side2;

    /* host work arrays (allocated at create) */
    cas_cuda_task *tw, *tn, *tm, *tf; /* [2 cap_tasks] wide (kind 10: pairs with stand-ins),
                                         [cap_tasks] narrow, mid, fused */
    cas_cuda_task *tp;           /* [2 cap_tasks] kind 10: the pairs being built */
    int32_t *cnt, *fill;     /* [max_total_q] */
    int32_t *direct_tok;     /* [max_total_q] */
    int32_t *need_tok;       /* [max_total_q] kind 18: writer units of a token per KV head */
    int32_t *nsplit, *chunk; /* [max_passes] */
    int64_t *job_off;        /* [max_passes] scratch offset of the pass's first chunk, -1 direct */
    cas_attn_pass *flat_passes;        /* [max_passes] */
    int32_t *flat_ids, *flat_pos;      /* [max_total_q] */

    cas_cuda_attn_info info;
};

static int64_t plan_bytes_cap(const cas_cuda_attn_caps *c, int64_t cap_tasks, int64_t cap_states,
                              int64_t grid) {
    int64_t b = ALIGN16((int64_t)sizeof(cas_cuda_plan_hdr));
    b += ALIGN16((grid + 1) * 4); /* kind 17: CTA ranges of the wide list */
    b += ALIGN16((int64_t)c->max_passes * (int64_t)sizeof(cas_cuda_pass));
    b += ALIGN16(c->max_page_ids * 4);
    b += 2 * ALIGN16((int64_t)c->max_tok_rows * 4);
    b += 4 * ALIGN16(cap_tasks * (int64_t)sizeof(cas_cuda_task)); /* the wide list twice */
    b += 16; /* the fused list: its tasks are counted in the narrow list's capacity */
    b += ALIGN16((int64_t)c->max_total_q * 4) + ALIGN16(((int64_t)c->max_total_q + 1) * 4);
    b += 2 * ALIGN16((int64_t)c->max_total_q * 4); /* kind 18: tok_merge, merge_need */
    b += 2 * ALIGN16(cap_states * 8);
    return b + 64;
}

void cas_cuda_attn_destroy(cas_cuda_attn *a) {
    if (!a) return;
    if (a->stage) cudaFreeHost(a->stage);
    if (a->dplan) cudaFree(a->dplan);
    if (a->dscratch) cudaFree(a->dscratch);
    if (a->dcounter) cudaFree(a->dcounter);
    if (a->dmcnt) cudaFree(a->dmcnt);
    if (a->upload_done) cudaEventDestroy(a->upload_done);
    if (a->ev_fork) cudaEventDestroy(a->ev_fork);
    if (a->ev_join) cudaEventDestroy(a->ev_join);
    if (a->ev_join2) cudaEventDestroy(a->ev_join2);
    if (a->side) cudaStreamDestroy(a->side);
    if (a->side2) cudaStreamDestroy(a->side2);
    free(a->tw);
    free(a->tp);
    free(a->tn);
    free(a->tm);
    free(a->tf);
    free(a->cnt);
    free(a->fill);
    free(a->direct_tok);
    free(a->need_tok);
    free(a->nsplit);
    free(a->chunk);
    free(a->job_off);
    free(a->flat_passes);
    free(a->flat_ids);
    free(a->flat_pos);
    free(a->cta_ptr);
    free(a->mix);
    free(a->cta_load);
    free(a->heap);
    free(a->cta_pos);
    free(a->skey);
    free(a->sidx);
    free(a->cls_idx);
    free(a);
}

cas_status cas_cuda_attn_create(cas_cuda_attn **out, const cas_attn_shape *shape,
                                const cas_cuda_attn_caps *caps) {
    if (!out || !shape || !caps) return cas_error(CAS_ERR_INVALID, "cuda attn: NULL argument");
    *out = NULL;
    if (shape->kv_dtype != CAS_BF16 && shape->kv_dtype != CAS_F16)
        return cas_error(CAS_ERR_UNSUPPORTED, "cuda attn: kv dtype %s (bf16 and f16 only)",
                         cas_dtype_name(shape->kv_dtype));
    if (!(shape->head_dim == 64 || shape->head_dim == 96 || shape->head_dim == 128 ||
          shape->head_dim == 256))
        return cas_error(CAS_ERR_UNSUPPORTED, "cuda attn: head_dim %d", shape->head_dim);
    if (shape->num_kv_heads <= 0 || shape->num_qo_heads % shape->num_kv_heads ||
        shape->page_size < 1 || shape->page_size > CAS_ATTN_MAX_PAGE_SIZE)
        return cas_error(CAS_ERR_INVALID, "cuda attn: bad shape (Hq %d, Hkv %d, page %d)",
                         shape->num_qo_heads, shape->num_kv_heads, shape->page_size);
    if (caps->max_total_q <= 0 || caps->max_passes <= 0 || caps->max_tok_rows <= 0 ||
        caps->max_page_ids <= 0)
        return cas_error(CAS_ERR_INVALID, "cuda attn: capacities must be positive");

    cas_cuda_attn *a = calloc(1, sizeof *a);
    if (!a) return cas_error(CAS_ERR_NOMEM, "cuda attn: out of memory");
    a->shape = *shape;
    a->caps = *caps;
    if (a->caps.max_split <= 0) a->caps.max_split = 64;
    if (a->caps.max_states <= 0) a->caps.max_states = 8 * (int64_t)caps->max_tok_rows;
    a->geom.Hq = shape->num_qo_heads;
    a->geom.Hkv = shape->num_kv_heads;
    a->geom.D = shape->head_dim;
    a->geom.page_size = shape->page_size;
    a->geom.dtype = (int32_t)shape->kv_dtype;
    a->geom.xv = getenv("CASCADE_CUDA_XV") ? atoi(getenv("CASCADE_CUDA_XV")) : 0;
    a->device = caps->device;
    cas_status st = CAS_OK;
#define TRY(call) CAS_CUDA_TRY(call, fail)
    TRY(cudaSetDevice(a->device));
    TRY(cudaDeviceGetAttribute(&a->num_sms, cudaDevAttrMultiProcessorCount, a->device));
    {
        /* The many-rows kernel: CAS_CUDA_DEFAULT_WIDE (wgmma needs compute
         * capability 9.0 and head_dim 128), else mma.sync. CASCADE_CUDA_WIDE=1
         * (mma.sync, 64 rows), 2 (mma.sync, 2 m-tiles), 3 (wgmma), 4 (wgmma,
         * next S during this softmax), 6 (wgmma, warp-specialized: producer
         * warpgroup, mbarriers, two consumers taking turns; 128-key tiles) or
         * 7 (the same with 64-key tiles, 4 stages) or 8 (kind 6 with the
         * softmax of the next tile during this tile's P V) or 9 (kind 6 with
         * full tiles loaded by the bulk tensor copy engine, TMA, where the
         * page size allows) or 10 (kind 9 in clusters of two CTAs, K and V
         * multicast to the pair of row blocks of one KV chunk) or 11 (kind 9
         * whose spare producer warps run the decode tails beside the
         * many-rows tasks) or 16 (kind 9 as in v9) or 17 (kind 9 with the
         * decode tails of a cascade in its own list and programmatic launch
         * dependence) forces a kind (benchmarks, tests); a kind the device
         * lacks falls back to 1. */
        int major = 0, minor = 0;
        TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a->device));
        TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, a->device));
        const int has_wgmma = major == 9 && minor == 0 && cas_cuda_wgmma_supported(shape->head_dim);
        const char *env = getenv("CASCADE_CUDA_WIDE");
        int kind = env && *env ? atoi(env) : CAS_CUDA_DEFAULT_WIDE;
        if (!cas_cuda_attn_kind_known(kind) || (kind >= 3 && !has_wgmma)) kind = 1;
        a->wide_kind = kind;
        a->wide_rows = cas_cuda_wide_rows(shape->head_dim, a->wide_kind);
        /* mid list: only under wgmma; CASCADE_CUDA_MID_ROWS=0 turns it off
         * (every many-rows pass on wgmma, as in v4c), another value moves the
         * threshold (rows per KV head of a pass) */
        const char *menv = getenv("CASCADE_CUDA_MID_ROWS");
        a->mid_rows = kind >= 3 ? (menv && *menv ? atoi(menv) : CAS_CUDA_DEFAULT_MID_ROWS) : 0;
        /* (kinds 11 and 18 launch no mid list) */
        if (a->mid_rows <= CAS_CUDA_NARROW_ROWS || kind == 11 || kind == 18) a->mid_rows = 0;
        /* CASCADE_CUDA_FUSE_CHUNK: keys per fused task (default 256) */
        const char *fenv = getenv("CASCADE_CUDA_FUSE_CHUNK");
        a->fuse_chunk = fenv && *fenv ? atoi(fenv) : CAS_CUDA_DEFAULT_FUSE_CHUNK;
        if (a->fuse_chunk < 16) a->fuse_chunk = 16;
        a->fuse_chunk = (a->fuse_chunk + 15) / 16 * 16;
        /* CASCADE_CUDA_SNAKE=0: the persistent lists round-robin (measurement) */
        const char *senv = getenv("CASCADE_CUDA_SNAKE");
        a->snake = senv && *senv ? atoi(senv) != 0 : 1;
        const char *tcenv = getenv("CASCADE_CUDA_TAIL_COST"), *toenv = getenv("CASCADE_CUDA_TAIL_ORDER");
        a->tail_order = toenv && *toenv ? atoi(toenv) : 1;
        if (a->tail_order < 0 || a->tail_order > 3) a->tail_order = 1;
        a->tail_cost = tcenv && *tcenv ? atof(tcenv) : 1.6;
        if (!(a->tail_cost > 0.0)) a->tail_cost = 1.6;
        const char *twenv = getenv("CASCADE_CUDA_TW_COST"), *twtenv = getenv("CASCADE_CUDA_TW_TASK_COST");
        a->tw_cost = twenv && *twenv ? atof(twenv) : 0.6;
        if (!(a->tw_cost > 0.0)) a->tw_cost = 0.6;
        a->tw_task = twtenv && *twtenv ? atof(twtenv) : 0.1;
        if (!(a->tw_task >= 0.0)) a->tw_task = 0.1;
        const char *tlenv = getenv("CASCADE_CUDA_TAIL_MIX_LEN");
        a->tail_mix_len = tlenv && *tlenv ? atoi(tlenv) : 512;
        const char *rmenv = getenv("CASCADE_CUDA_RUN_MASK");
        a->run_mask = rmenv && *rmenv ? atoi(rmenv) : 7;
        const char *pdenv = getenv("CASCADE_CUDA_PDL");
        const char *fmenv = getenv("CASCADE_CUDA_FM"), *orenv = getenv("CASCADE_CUDA_ORDER18");
        a->fm18 = fmenv && *fmenv ? atoi(fmenv) != 0 : 1;
        a->order18 = orenv && *orenv ? atoi(orenv) : 0;
        a->pdl = kind == 17 && (pdenv && *pdenv ? atoi(pdenv) != 0 : 1);
    }
    {
        int e1 = cas_cuda_attn_occupancy(&a->geom, a->wide_kind, &a->occ_wide);
        int e2 = cas_cuda_attn_occupancy(&a->geom, 0, &a->occ_narrow);
        if (e1 || e2 || a->occ_wide < 1 || a->occ_narrow < 1) {
            st = cas_error(CAS_ERR_INTERNAL, "cuda attn: kernel occupancy query failed: %s",
                           cas_cuda_error_string(e1 ? e1 : e2));
            goto fail;
        }
        a->wide_grid = a->num_sms * a->occ_wide;
        if (a->wide_kind == 10) { /* clusters of two: the pairs that fit at once */
            int ctas = 0, e4 = cas_cuda_wgmma_cluster_grid(&a->geom, a->wide_kind, &ctas);
            if (e4 || ctas < 2) {
                st = cas_error(CAS_ERR_INTERNAL, "cuda attn: cluster occupancy query failed: %s",
                               cas_cuda_error_string(e4));
                goto fail;
            }
            a->wide_grid = ctas;
        }
        if (a->mid_rows > 0) {
            int e3 = cas_cuda_attn_occupancy(&a->geom, 1, &a->occ_mid);
            if (e3 || a->occ_mid < 1) {
                st = cas_error(CAS_ERR_INTERNAL, "cuda attn: kernel occupancy query failed: %s",
                               cas_cuda_error_string(e3));
                goto fail;
            }
            a->mid_grid = a->num_sms * a->occ_mid;
        }
    }
    {
        const int32_t group = shape->num_qo_heads / shape->num_kv_heads;
        int64_t base = (int64_t)shape->num_kv_heads *
                       ((int64_t)caps->max_passes + ((int64_t)caps->max_tok_rows * group + 15) / 16);
        a->cap_tasks = 4 * base + 64 * (int64_t)a->num_sms;
        a->cap_states = a->caps.max_states;
        a->cap_bytes = plan_bytes_cap(&a->caps, a->cap_tasks, a->cap_states, a->wide_grid);
        /* a state per token and head, and a float of padding per (pass, chunk) at most (job_stride) */
        a->scratch_floats = a->cap_states * ((int64_t)shape->num_qo_heads * (shape->head_dim + 1) + 1);
    }
    TRY(cudaMallocHost((void **)&a->stage, (size_t)a->cap_bytes));
    TRY(cudaMalloc((void **)&a->dplan, (size_t)a->cap_bytes));
    TRY(cudaMalloc((void **)&a->dscratch, (size_t)(a->scratch_floats > 0 ? a->scratch_floats : 1) * 4));
    TRY(cudaMalloc((void **)&a->dcounter, 256));
    TRY(cudaMemset(a->dcounter, 0, 256));
    if (a->wide_kind == 18) {
        const size_t nc = (size_t)caps->max_total_q * (size_t)shape->num_kv_heads;
        TRY(cudaMalloc((void **)&a->dmcnt, nc * sizeof(int)));
        TRY(cudaMemset(a->dmcnt, 0, nc * sizeof(int)));
    }
    memset(a->stage, 0, (size_t)a->cap_bytes);
    TRY(cudaMemset(a->dplan, 0, (size_t)a->cap_bytes)); /* an empty plan: zero tasks */
    TRY(cudaEventCreateWithFlags(&a->upload_done, cudaEventDisableTiming));
    TRY(cudaEventCreateWithFlags(&a->ev_fork, cudaEventDisableTiming));
    TRY(cudaEventCreateWithFlags(&a->ev_join, cudaEventDisableTiming));
    TRY(cudaStreamCreateWithFlags(&a->side, cudaStreamNonBlocking));
    if (a->mid_rows > 0) {
        TRY(cudaEventCreateWithFlags(&a->ev_join2, cudaEventDisableTiming));
        TRY(cudaStreamCreateWithFlags(&a->side2, cudaStreamNonBlocking));
    }
#undef TRY
    a->tw = malloc(sizeof(cas_cuda_task) * 2 * (size_t)a->cap_tasks);
    a->tp = malloc(sizeof(cas_cuda_task) * 2 * (size_t)a->cap_tasks);
    a->tn = malloc(sizeof(cas_cuda_task) * (size_t)a->cap_tasks);
    a->tm = malloc(sizeof(cas_cuda_task) * (size_t)a->cap_tasks);
    a->tf = malloc(sizeof(cas_cuda_task) * (size_t)a->cap_tasks);
    a->cnt = malloc(sizeof(int32_t) * (size_t)caps->max_total_q);
    a->fill = malloc(sizeof(int32_t) * (size_t)caps->max_total_q);
    a->direct_tok = malloc(sizeof(int32_t) * (size_t)caps->max_total_q);
    a->need_tok = malloc(sizeof(int32_t) * (size_t)caps->max_total_q);
    a->nsplit = malloc(sizeof(int32_t) * (size_t)caps->max_passes);
    a->chunk = malloc(sizeof(int32_t) * (size_t)caps->max_passes);
    a->job_off = malloc(sizeof(int64_t) * (size_t)caps->max_passes);
    a->flat_passes = malloc(sizeof(cas_attn_pass) * (size_t)caps->max_passes);
    a->flat_ids = malloc(sizeof(int32_t) * (size_t)caps->max_total_q);
    a->flat_pos = malloc(sizeof(int32_t) * (size_t)caps->max_total_q);
    a->cta_ptr = malloc(sizeof(int32_t) * ((size_t)a->wide_grid + 1));
    a->mix = malloc(sizeof(struct mix_item) * 2 * (size_t)a->cap_tasks);
    a->cta_load = malloc(sizeof(double) * 4 * (size_t)a->wide_grid);
    a->heap = malloc(sizeof *a->heap * 2 * (size_t)a->wide_grid);
    a->cta_pos = malloc(sizeof(int32_t) * (size_t)a->wide_grid);
    a->skey = malloc(sizeof(uint64_t) * 4 * (size_t)a->cap_tasks);
    a->sidx = malloc(sizeof(int32_t) * 4 * (size_t)a->cap_tasks);
    a->cls_idx = malloc(sizeof(int32_t) * (size_t)caps->max_passes);
    if (!a->flat_passes || !a->flat_ids || !a->flat_pos || !a->tw || !a->tp || !a->tn || !a->tm || !a->tf || !a->cnt || !a->fill || !a->direct_tok || !a->need_tok || !a->nsplit || !a->chunk ||
        !a->job_off || !a->cta_ptr || !a->mix || !a->cta_load || !a->heap || !a->cta_pos || !a->cls_idx ||
        !a->skey || !a->sidx) {
        st = cas_error(CAS_ERR_NOMEM, "cuda attn: out of host memory");
        goto fail;
    }
    *out = a;
    return CAS_OK;
fail:
    cas_cuda_attn_destroy(a);
    return st;
}

/* ---- planning ----------------------------------------------------------- */

static int64_t task_work(const cas_cuda_task *t) { return (int64_t)(t->kv1 - t->kv0) * t->nrows; }
static int cmp_task(const void *x, const void *y) {
    const cas_cuda_task *a = x, *b = y;
    const int64_t ca = task_work(a), cb = task_work(b);
    if (ca != cb) return ca > cb ? -1 : 1;
    /* stable: pad holds the creation index */
    return a->pad < b->pad ? -1 : a->pad > b->pad;
}
static int bits_of(uint64_t x) {
    int b = 0;
    while (x >> b) b++;
    return b;
}
/* The tasks of src[0, ns) whose flags & fmask are fval into dst (another
 * array) in cmp_task's order, by a radix sort of one 64-bit key a task,
 * (longest - work) above pad, 8 bits a pass (a pass whose digit is the same
 * for all is skipped); qsort where the two do not fit in 64 bits. The keys
 * are distinct (pad is), so the order is qsort's. Returns their count. */
static int32_t sort_tasks(cas_cuda_attn *a, cas_cuda_task *dst, const cas_cuda_task *src, int32_t ns, int32_t fmask,
                          int32_t fval) {
    int64_t maxw = 0, minw = INT64_MAX, maxpad = 0;
    int neg = 0;
    int32_t *x = a->sidx, *x2 = a->sidx + 2 * a->cap_tasks, n = 0;
    for (int32_t i = 0; i < ns; i++) {
        if ((src[i].flags & fmask) != fval) continue;
        const int64_t w = task_work(&src[i]);
        if (w > maxw) maxw = w;
        if (w < minw) minw = w;
        if (src[i].pad > maxpad) maxpad = src[i].pad;
        neg |= src[i].pad < 0;
        x[n++] = i;
    }
    const int pb = bits_of((uint64_t)maxpad), kb = n > 0 ? bits_of((uint64_t)(maxw - minw)) : 0;
    if (neg || minw < 0 || pb + kb > 64) {
        for (int32_t i = 0; i < n; i++) dst[i] = src[x[i]];
        qsort(dst, (size_t)n, sizeof *dst, cmp_task);
        return n;
    }
    uint64_t *k = a->skey, *k2 = a->skey + 2 * a->cap_tasks;
    for (int32_t i = 0; i < n; i++) k[i] = (uint64_t)(maxw - task_work(&src[x[i]])) << pb | (uint64_t)src[x[i]].pad;
    for (int sh = 0; sh < pb + kb; sh += 8) {
        int32_t c[257] = {0};
        for (int32_t i = 0; i < n; i++) c[(k[i] >> sh & 255) + 1]++;
        int same = 0;
        for (int d = 1; d <= 256; d++) same |= c[d] == n;
        if (same) continue;
        for (int d = 0; d < 256; d++) c[d + 1] += c[d];
        for (int32_t i = 0; i < n; i++) {
            const int32_t j = c[k[i] >> sh & 255]++;
            k2[j] = k[i];
            x2[j] = x[i];
        }
        uint64_t *tk = k;
        k = k2;
        k2 = tk;
        int32_t *tx = x;
        x = x2;
        x2 = tx;
    }
    for (int32_t i = 0; i < n; i++) dst[i] = src[x[i]];
    return n;
}
/* a list sorted in place (through the scratch tp, which it must not be) */
static void sort_list(cas_cuda_attn *a, cas_cuda_task *t, int32_t n) {
    sort_tasks(a, a->tp, t, n, 0, 0);
    memcpy(t, a->tp, sizeof *t * (size_t)n);
}

/* A list that a persistent grid of g CTAs walks with stride g (CTA b takes
 * tasks b, b + g, ...), sorted longest first, with every odd round of g
 * tasks reversed: the CTA that got a round's longest task gets the next
 * round's shortest. Round-robin alone leaves CTA 0 with the longest task of
 * every round: on a 16k causal prefill (4096 tasks of 1 to 128 tiles on 132
 * CTAs) a simulation ends it 3.1% after the mean, the reversed rounds 0.1%
 * (measured: +2.6% TFLOP/s, bench/NOTES.md v9). */
static void snake_rounds(cas_cuda_task *t, int32_t n, int32_t g) {
    if (g < 2) return;
    for (int32_t r0 = g; r0 + g <= n; r0 += 2 * g)
        for (int32_t i = 0, j = g - 1; i < j; i++, j--) {
            cas_cuda_task x = t[r0 + i];
            t[r0 + i] = t[r0 + j];
            t[r0 + j] = x;
        }
}

/* Which kernel a pass of `rows` rows per KV head goes to: 0 narrow, 1 the
 * many-rows kernel, 2 the mid list (64-row mma.sync next to wgmma). */
enum { CLS_NARROW = 0, CLS_WIDE = 1, CLS_MID = 2 };
/* host-only: here rather than beside the kernels, so that the planner links
 * without them (tests/cuda/test_cuda_plan.c) */
int cas_cuda_wide_rows(int D, int kind) {
    if (kind >= 3) return 128;
    if (kind == 2) return D <= 128 ? 128 : 64;
    return kind ? 64 : CAS_CUDA_NARROW_ROWS;
}
static int pass_class(const cas_cuda_attn *a, int64_t rows) {
    if (rows <= CAS_CUDA_NARROW_ROWS) return CLS_NARROW;
    return rows <= a->mid_rows ? CLS_MID : CLS_WIDE;
}
static int class_rows(const cas_cuda_attn *a, int cls) {
    return cls == CLS_WIDE ? a->wide_rows
                           : cls == CLS_MID ? cas_cuda_wide_rows(a->shape.head_dim, 1)
                                            : CAS_CUDA_NARROW_ROWS;
}

/* Kind 10 runs the many-rows tasks in clusters of two CTAs, one pair of tasks
 * per cluster (tasks 2i and 2i + 1), with the same number of key tiles so
 * that the two pipelines stay in step. Row blocks b and b + 1 of one (pass,
 * chunk, KV head) become a multicast pair over the union of their key ranges
 * (a key outside a task's own range is masked by causality or the window
 * that trimmed it); the rest are paired by equal tile counts, each loading
 * its own keys, and the last one of a count gets a stand-in: a copy of
 * itself that shares its loads and writes nothing. Pairs are ordered by
 * work, largest first. tw[0, nw) is in creation order (pass, chunk, row
 * block, KV head) with pad the creation index; the pairs replace it; returns
 * the new count (2 x pairs). */
static int cmp_pair(const void *x, const void *y) {
    const cas_cuda_task *a = x, *b = y;
    int64_t wa = task_work(&a[0]) > task_work(&a[1]) ? task_work(&a[0]) : task_work(&a[1]);
    int64_t wb = task_work(&b[0]) > task_work(&b[1]) ? task_work(&b[0]) : task_work(&b[1]);
    if (wa != wb) return wa > wb ? -1 : 1;
    return a[0].pad < b[0].pad ? -1 : a[0].pad > b[0].pad;
}
static int tiles_of(const cas_cuda_task *t) { return t->kv1 > t->kv0 ? (t->kv1 - t->kv0 + 127) / 128 : 0; }
static int cmp_tiles(const void *x, const void *y) {
    const cas_cuda_task *a = x, *b = y;
    int ta = tiles_of(a), tb = tiles_of(b);
    if (ta != tb) return ta > tb ? -1 : 1;
    return a->pad < b->pad ? -1 : a->pad > b->pad;
}
static int32_t pair_tasks(cas_cuda_attn *a, int32_t nw, int32_t Hkv) {
    cas_cuda_task *tw = a->tw, *tp = a->tp;
    int32_t np = 0, ns = 0;
    for (int32_t x = 0; x < nw; x++) tw[x].flags = 0;
    /* bit 2 of flags marks a task already in a pair (cleared below) */
    for (int32_t x = 0; x < nw; x++) {
        if (tw[x].flags & 4) continue;
        int32_t y = x + Hkv;
        if (y < nw && tw[y].pass == tw[x].pass && tw[y].kv_head == tw[x].kv_head &&
            tw[y].row0 == tw[x].row0 + tw[x].nrows) {
            cas_cuda_task p = tw[x], q = tw[y];
            /* an empty task (every key of the chunk masked for its rows) may
             * carry a range outside the chunk: it takes its partner's */
            int32_t k0, k1;
            if (p.kv1 <= p.kv0) k0 = q.kv0, k1 = q.kv1;
            else if (q.kv1 <= q.kv0) k0 = p.kv0, k1 = p.kv1;
            else k0 = p.kv0 < q.kv0 ? p.kv0 : q.kv0, k1 = p.kv1 > q.kv1 ? p.kv1 : q.kv1;
            p.kv0 = q.kv0 = k0;
            p.kv1 = q.kv1 = k1;
            p.flags = q.flags = 1;
            tp[2 * np] = p;
            tp[2 * np + 1] = q;
            np++;
            tw[x].flags = tw[y].flags = 4;
        }
    }
    /* the unpaired ones, compacted to the front of tw, by tile count */
    for (int32_t x = 0; x < nw; x++)
        if (!(tw[x].flags & 4)) tw[ns++] = tw[x];
    qsort(tw, (size_t)ns, sizeof(cas_cuda_task), cmp_tiles);
    for (int32_t x = 0; x < ns;) {
        if (x + 1 < ns && tiles_of(&tw[x + 1]) == tiles_of(&tw[x])) {
            tp[2 * np] = tw[x];
            tp[2 * np + 1] = tw[x + 1];
            x += 2;
        } else {
            tp[2 * np] = tw[x];
            tp[2 * np].flags = 1;
            tp[2 * np + 1] = tp[2 * np];
            tp[2 * np + 1].flags = 3;
            x += 1;
        }
        np++;
    }
    qsort(tp, (size_t)np, 2 * sizeof(cas_cuda_task), cmp_pair);
    memcpy(tw, tp, sizeof(cas_cuda_task) * 2 * (size_t)np);
    return 2 * np;
}

/* Kind 17: tw[0, nw) holds many-rows tasks and decode tails (flags bit 3).
 * The many-rows tasks keep the persistent order (longest first, snake
 * rounds: CTA b gets tasks b, b + g, ...). The tails go, longest first, to
 * the CTA with the least work so far (a heap; a many-rows tile costs 1, a
 * tail tile tail_cost). Each CTA's tasks are then ordered by tail_order: the
 * tails take the HBM while the CTAs around them use the tensor cores. With
 * order 2 the tails of a CTA sit at a phase drawn from its first many-rows
 * task's (pass, chunk, KV head), so the CTAs of the row blocks of one KV
 * chunk stay in step (their K and V shared in L2) while the others are
 * staggered. The list is rewritten CTA by CTA; cta_ptr[b] is CTA b's first
 * task. */
static int heap_less(const struct cta_load_ent *x, const struct cta_load_ent *y) {
    return x->load < y->load || (x->load == y->load && x->cta < y->cta);
}
static void heap_down(struct cta_load_ent *hp, int32_t n, int32_t i) {
    const struct cta_load_ent x = hp[i];
    for (;;) {
        const int32_t l = 2 * i + 1, r = l + 1;
        if (l >= n) break;
        const int32_t m = r < n && heap_less(&hp[r], &hp[l]) ? r : l;
        if (!heap_less(&hp[m], &x)) break;
        hp[i] = hp[m];
        i = m;
    }
    hp[i] = x;
}
static int cmp_mix(const void *x, const void *y) {
    const struct mix_item *a = x, *b = y;
    if (a->cta != b->cta) return a->cta < b->cta ? -1 : 1;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return a->idx < b->idx ? -1 : a->idx > b->idx;
}
/* a task's cost in arrange_mix: its tiles (a tail's at tail_cost) plus its start */
static double mix_cost(const cas_cuda_attn *a, const cas_cuda_task *t, int tail) {
    return tiles_of(t) * (tail ? a->tail_cost : 1.0) + 0.05;
}
/* whether the many-rows kernel runs tails on its producer's spare warps (probe XV 35) */
static int mix_tw(const cas_cuda_attn *a) {
    return a->wide_kind == 17 && a->shape.kv_dtype == CAS_BF16 && a->shape.head_dim == 128 && a->geom.xv == 35;
}
#define TW_ROWS 8 /* the N of the tail warps' m16n8k16 */
/* the shared tasks round-robin, the tails to the least loaded
 * CTA, each CTA's two classes ordered by tail_order; with mix_tw a tail of at
 * most TW_ROWS rows goes to the tail warps of the CTA whose tail warps end
 * soonest (flags bit 5) when they end it sooner than the least loaded
 * consumers would */
static void order_mix(cas_cuda_attn *a, cas_cuda_task *tmp, int32_t ns, int32_t nw) {
    const int32_t g = a->wide_grid;
    struct mix_item *m = a->mix;
    double *load = a->cta_load, *tot_s = load + g, *tot_t = load + 2 * g, *cum = load + 3 * g;
    if (a->snake) snake_rounds(tmp, ns, g);
    for (int32_t b = 0; b < g; b++) load[b] = tot_s[b] = tot_t[b] = 0.0;
    for (int32_t k = 0; k < ns; k++) {
        const int32_t b = k % g;
        const double c = mix_cost(a, &tmp[k], 0);
        m[k].cta = b;
        load[b] += c;
        tot_s[b] += c;
    }
    for (int32_t b = 0; b < g; b++) a->heap[b] = (struct cta_load_ent){load[b], b};
    for (int32_t i = g / 2 - 1; i >= 0; i--) heap_down(a->heap, g, i);
    const int tw = mix_tw(a);
    struct cta_load_ent *hw = a->heap + g;
    for (int32_t b = 0; b < g; b++) hw[b] = (struct cta_load_ent){0.0, b};
    for (int32_t k = ns; k < nw; k++) {
        const double c = mix_cost(a, &tmp[k], 1);
        if (tw && tmp[k].nrows <= TW_ROWS) {
            const double cw = tiles_of(&tmp[k]) * a->tw_cost + a->tw_task;
            if (hw[0].load + cw <= a->heap[0].load + c) {
                m[k].cta = hw[0].cta;
                tmp[k].flags |= 32;
                hw[0].load += cw;
                heap_down(hw, g, 0);
                continue;
            }
        }
        const int32_t b = a->heap[0].cta;
        m[k].cta = b;
        a->heap[0].load += c;
        tot_t[b] += c;
        heap_down(a->heap, g, 0);
    }
    /* keys: the middle of each task on its class's cost line of the CTA */
    for (int32_t b = 0; b < g; b++) cum[b] = 0.0;
    for (int32_t k = 0; k < ns; k++) {
        const int32_t b = m[k].cta;
        const double c = mix_cost(a, &tmp[k], 0);
        m[k].key = a->tail_order == 0 ? 2.0 + k : a->tail_order == 1 ? -2.0 + (double)k / nw : (cum[b] + 0.5 * c) / tot_s[b];
        m[k].idx = k;
        cum[b] += c;
    }
    for (int32_t b = 0; b < g; b++) cum[b] = 0.0;
    for (int32_t k = ns; k < nw; k++) {
        const int32_t b = m[k].cta;
        const double c = mix_cost(a, &tmp[k], 1);
        double phase = 0.0;
        if (tmp[k].flags & 32) { /* the tail warps' (the kernel interleaves them itself) */
            m[k].key = 4.0 + k;
            m[k].idx = k;
            continue;
        }
        if (a->tail_order == 2) {
            /* the first many-rows task of the CTA (b < ns), else the CTA */
            uint32_t hsh = (uint32_t)b * 2654435761u;
            if (b < ns)
                hsh = (uint32_t)tmp[b].pass * 2654435761u ^ (uint32_t)tmp[b].kv0 * 40503u ^
                      (uint32_t)tmp[b].kv_head * 2246822519u;
            hsh ^= hsh >> 15;
            hsh *= 2246822519u;
            hsh ^= hsh >> 13;
            phase = (double)(hsh >> 8) / 16777216.0;
        }
        double f = (cum[b] + 0.5 * c) / tot_t[b] + phase;
        f -= (double)(int64_t)f;
        m[k].key = a->tail_order == 0 ? -2.0 + (double)k / nw : a->tail_order == 1 ? 2.0 + k : f;
        m[k].idx = k;
        cum[b] += c;
    }
}
static void arrange_mix(cas_cuda_attn *a, int32_t nw) {
    const int32_t g = a->wide_grid;
    cas_cuda_task *tw = a->tw, *tmp = a->tp;
    struct mix_item *m = a->mix;
    /* the shared tasks, then the tails (flags bit 3), each sorted, into tp;
     * arranged from there back into tw */
    const int32_t ns = sort_tasks(a, tmp, tw, nw, 8, 0);
    sort_tasks(a, tmp + ns, tw, nw, 8, 8);
    order_mix(a, tmp, ns, nw);
    /* m in cmp_mix's order (CTA, key, idx): by CTA, stable (m[k].idx is k,
     * so a CTA's items come in idx order), then a CTA's items sorted by key
     * where they are not already (orders 0, 2, 3) */
    for (int32_t b = 0; b <= g; b++) a->cta_ptr[b] = 0;
    for (int32_t i = 0; i < nw; i++) a->cta_ptr[m[i].cta + 1]++;
    for (int32_t b = 0; b < g; b++) a->cta_ptr[b + 1] += a->cta_ptr[b];
    {
        /* mix holds 2 cap_tasks and nw <= n_tasks <= cap_tasks (the planner's check) */
        struct mix_item *o = m + a->cap_tasks;
        int32_t *pos = a->cta_pos;
        for (int32_t b = 0; b < g; b++) pos[b] = a->cta_ptr[b];
        for (int32_t i = 0; i < nw; i++) o[pos[m[i].cta]++] = m[i];
        for (int32_t b = 0; b < g; b++) {
            const int32_t i0 = a->cta_ptr[b], n = a->cta_ptr[b + 1] - i0;
            int sorted = 1;
            for (int32_t i = 1; i < n && sorted; i++) sorted = cmp_mix(&o[i0 + i - 1], &o[i0 + i]) < 0;
            if (!sorted) qsort(o + i0, (size_t)n, sizeof *o, cmp_mix);
        }
        m = o;
    }
    for (int32_t i = 0; i < nw; i++) {
        tw[i] = tmp[m[i].idx];
        tw[i].flags &= 32; /* the tail warps' (order_mix) */
    }
}

/* The passes of class cls into idx (the planner's cls_idx); returns their count. */
static int32_t class_list(const cas_cuda_attn *a, int32_t n_passes, const cas_attn_pass *passes, int32_t group,
                          int cls, int32_t *idx) {
    int32_t n = 0;
    for (int32_t i = 0; i < n_passes; i++)
        if (pass_class(a, (int64_t)passes[i].n_tok * group) == cls && passes[i].len > 0) idx[n++] = i;
    return n;
}
/* Tasks of class cls (1: the many-rows kernel, 2: the mid list; idx: its
 * passes) when passes are split into chunks of about L keys, as the planner
 * below splits them; *maxch: the longest chunk. The split depends on L only
 * through each pass's chunk count; *next (where not NULL): the least L' > L
 * at which one of them changes (INT64_MAX: none does). */
static int64_t class_tasks(const cas_cuda_attn *a, const cas_attn_pass *passes, const int32_t *idx, int32_t nidx,
                           int32_t group, int cls, int64_t L, int64_t *maxch, int64_t *next) {
    int64_t n = 0;
    const int rblk = class_rows(a, cls);
    *maxch = 0;
    if (next) *next = INT64_MAX;
    for (int32_t k = 0; k < nidx; k++) {
        const int32_t i = idx[k];
        int64_t rows = (int64_t)passes[i].n_tok * group, len = passes[i].len;
        int64_t ns = (len + L - 1) / L;
        if (ns > a->caps.max_split) ns = a->caps.max_split;
        /* ceil(len / L') drops below ns from L' = ceil(len / (ns - 1)) on */
        if (next && ns > 1 && (len + ns - 2) / (ns - 1) < *next) *next = (len + ns - 2) / (ns - 1);
        int64_t ch = ((len + ns - 1) / ns + 63) / 64 * 64;
        ns = (len + ch - 1) / ch;
        if (ch > *maxch) *maxch = ch < len ? ch : len;
        n += (rows + rblk - 1) / rblk * a->shape.num_kv_heads * ns;
    }
    return n;
}

/* When a many-rows kernel gets only a few waves of tasks (a shared prefix
 * over a decode batch), its time is waves x chunk: a split that leaves a last
 * wave nearly empty costs a whole chunk. The chunk length for the passes of
 * class cls (idx: class_list's) on a persistent grid of `grid` CTAs that
 * minimises that (split_rule 1: chunks of at least 512 keys, 2: at least
 * 128); L if the class has no passes or many waves. */
static int64_t pick_chunk(const cas_cuda_attn *a, const cas_attn_pass *passes, const int32_t *idx, int32_t nidx,
                          int32_t group, int cls, int64_t grid, int64_t L, int split_rule) {
    if (grid <= 0 || split_rule == 0) return L;
    int64_t maxch = 0, nt = class_tasks(a, passes, idx, nidx, group, cls, L, &maxch, NULL);
    if (nt <= 0 || nt >= 8 * grid) return L;
    int64_t best_l = L;
    double best = (double)((nt + grid - 1) / grid) * (double)(maxch + 128);
    /* rule 2: a small shared pass (few tasks) may go down to 128-key chunks,
     * so that it spreads over more SMs; rule 1: 512 */
    int64_t lo = split_rule >= 2 ? 128 : (L / 2 < 512 ? 512 : (L / 2 + 63) / 64 * 64);
    int64_t maxlen = 0;
    for (int32_t k = 0; k < nidx; k++)
        if (passes[idx[k]].len > maxlen) maxlen = passes[idx[k]].len;
    /* c in steps of 64; the steps that leave every pass's chunk count as it
     * was are skipped (their cost is the same, and only a lower one counts) */
    for (int64_t c = lo; c <= 4 * L && c <= maxlen + 63;) {
        int64_t mc = 0, nx = 0, n = class_tasks(a, passes, idx, nidx, group, cls, c, &mc, &nx);
        double cost = (double)((n + grid - 1) / grid) * (double)(mc + 128);
        if (cost < best * 0.999) {
            best = cost;
            best_l = c;
        }
        if (nx == INT64_MAX) break;
        c += (nx - c + 63) / 64 * 64;
    }
    return best_l;
}

/* of the page ids pg[0, n), how many are their predecessor + 1; 16 at a time
 * (a loop of a fixed count, which -O2 vectorizes) */
static int32_t page_steps(const int32_t *pg, int32_t n) {
    int32_t s = 0, j = 1;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++) s += pg[j + k] == pg[j + k - 1] + 1;
    for (; j < n; j++) s += pg[j] == pg[j - 1] + 1;
    return s;
}

cas_status cas_cuda_attn_plan_passes(cas_cuda_attn *a, const cas_attn_params *params,
                                     int32_t num_pages, int32_t n_passes,
                                     const cas_attn_pass *passes, const int32_t *pages,
                                     int64_t n_page_ids, const int32_t *tok_ids,
                                     const int32_t *tok_pos, int32_t n_tok_rows, int32_t total_q) {
    if (!a || !params || (n_passes > 0 && (!passes || !tok_ids || !tok_pos)))
        return cas_error(CAS_ERR_INVALID, "cuda attn plan: NULL argument");
    const cas_cuda_attn_caps *cp = &a->caps;
    if (n_passes > cp->max_passes || n_tok_rows > cp->max_tok_rows || total_q > cp->max_total_q ||
        n_page_ids > cp->max_page_ids || n_passes < 0 || total_q < 0 || n_tok_rows < 0)
        return cas_error(CAS_ERR_NOMEM,
                         "cuda attn plan: over capacity (passes %d/%d, token rows %d/%d, tokens "
                         "%d/%d, page ids %lld/%lld)",
                         n_passes, cp->max_passes, n_tok_rows, cp->max_tok_rows, total_q,
                         cp->max_total_q, (long long)n_page_ids, (long long)cp->max_page_ids);
    const int32_t Hq = a->shape.num_qo_heads, Hkv = a->shape.num_kv_heads, D = a->shape.head_dim;
    const int32_t P = a->shape.page_size, group = Hq / Hkv;
    if (params->window_left < -1 || !(params->logits_soft_cap >= 0.f) || !(params->sm_scale >= 0.f))
        return cas_error(CAS_ERR_INVALID, "cuda attn plan: bad params");

    /* validate the passes */
    for (int32_t i = 0; i < n_passes; i++) {
        const cas_attn_pass *p = &passes[i];
        int64_t np = ((int64_t)p->len + P - 1) / P;
        if (p->len < 0 || p->n_tok < 0 || p->pos0 < 0 || p->pos0 % P || p->page_off < 0 ||
            p->page_off + np > n_page_ids || p->tok_off < 0 || p->tok_off + p->n_tok > n_tok_rows)
            return cas_error(CAS_ERR_INVALID, "cuda attn plan: pass %d out of range", i);
        if (cas_attn_ids_outside(NULL, (const uint32_t *)pages + p->page_off, (int32_t)np, (uint32_t)num_pages))
            for (int64_t j = 0; j < np; j++)
                if (pages[p->page_off + j] < 0 || pages[p->page_off + j] >= num_pages)
                    return cas_error(CAS_ERR_INVALID, "cuda attn plan: pass %d page id %d outside pool",
                                     i, pages[p->page_off + j]);
        for (int32_t j = 0; j < p->n_tok; j++)
            if (tok_ids[p->tok_off + j] < 0 || tok_ids[p->tok_off + j] >= total_q)
                return cas_error(CAS_ERR_INVALID, "cuda attn plan: pass %d token id out of range", i);
    }

    /* wait until the previous upload has read the staging */
    CAS_CUDA_CHECK(cudaEventSynchronize(a->upload_done));

    /* kind 11: which passes go to the fused list (decode tails beside a
     * many-rows pass; without one there is nothing to run them beside and
     * the narrow kernel is faster) */
    int has_wide = 0;
    for (int32_t i = 0; i < n_passes && (a->wide_kind == 11 || MIX_KIND(a->wide_kind)); i++)
        if (pass_class(a, (int64_t)passes[i].n_tok * group) == CLS_WIDE && passes[i].len > 0) has_wide = 1;
    const int fuse11 = has_wide && a->wide_kind == 11, tails17 = has_wide && MIX_KIND(a->wide_kind);
#define FUSED(i) (fuse11 && passes[i].n_tok > 0 && (int64_t)passes[i].n_tok * group <= CAS_CUDA_FUSED_ROWS)
    /* kind 17: the decode tails (narrow passes) join the many-rows list when
     * they are many (unsplit tasks at least the grid) or short */
    int64_t n_tail_tasks = 0;
    for (int32_t i = 0; i < n_passes && tails17; i++)
        if (passes[i].n_tok > 0 && pass_class(a, (int64_t)passes[i].n_tok * group) == CLS_NARROW)
            n_tail_tasks += Hkv * (((int64_t)passes[i].n_tok * group + CAS_CUDA_NARROW_ROWS - 1) / CAS_CUDA_NARROW_ROWS);
#define TAIL17(i)                                                                                   \
    (tails17 && passes[i].n_tok > 0 && pass_class(a, (int64_t)passes[i].n_tok * group) == CLS_NARROW && \
     (n_tail_tasks >= a->wide_grid || passes[i].len <= a->tail_mix_len))
    int64_t Lf = a->fuse_chunk;

    /* split-KV: aim for a couple of waves of CTAs */
    int64_t work = 0; /* CTA x keys */
    for (int32_t i = 0; i < n_passes; i++) {
        int64_t rows = (int64_t)passes[i].n_tok * group;
        int64_t rblk = class_rows(a, pass_class(a, rows));
        work += (rows + rblk - 1) / rblk * Hkv * passes[i].len;
    }
    int occ_max = a->occ_wide > a->occ_narrow ? a->occ_wide : a->occ_narrow;
    if (a->occ_mid > occ_max) occ_max = a->occ_mid;
    const int64_t slots = 2 * (int64_t)a->num_sms * occ_max;
    int64_t L = work / (slots > 0 ? slots : 1);
    if (L < 512) L = 512;
    L = (L + 63) / 64 * 64;
    /* chunk lengths of the many-rows passes (Lw) and the mid passes (Lm),
     * each picked for its kernel's grid by pick_chunk (CASCADE_CUDA_SPLIT=0:
     * L only, 1: chunks of at least 512 keys, 2 (default): at least 128); L
     * is that of the narrow passes */
    const int split_rule = getenv("CASCADE_CUDA_SPLIT") ? atoi(getenv("CASCADE_CUDA_SPLIT")) : 2;
    int32_t ncls = class_list(a, n_passes, passes, group, CLS_WIDE, a->cls_idx);
    int64_t Lw = pick_chunk(a, passes, a->cls_idx, ncls, group, CLS_WIDE, a->wide_grid, L, split_rule);
    ncls = class_list(a, n_passes, passes, group, CLS_MID, a->cls_idx);
    int64_t Lm = pick_chunk(a, passes, a->cls_idx, ncls, group, CLS_MID, a->mid_grid, L, split_rule);
    int64_t n_tasks = 0, n_states = 0;
    for (int iter = 0;; iter++) {
        n_tasks = 0;
        n_states = 0;
        for (int32_t i = 0; i < n_passes; i++) {
            int32_t len = passes[i].len;
            const int cls = pass_class(a, (int64_t)passes[i].n_tok * group);
            const int64_t Li = cls == CLS_WIDE ? Lw : cls == CLS_MID ? Lm : FUSED(i) ? (Lf < L ? Lf : L) : L;
            int32_t ns = (int32_t)((len + Li - 1) / Li);
            if (ns < 1) ns = 1;
            if (ns > cp->max_split) ns = cp->max_split;
            int32_t ch = (int32_t)(((int64_t)(len + ns - 1) / ns + 63) / 64 * 64);
            if (ch < 1) ch = 1;
            ns = len > 0 ? (len + ch - 1) / ch : 1;
            a->nsplit[i] = ns;
            a->chunk[i] = ch;
            int64_t rows = (int64_t)passes[i].n_tok * group, rblk = class_rows(a, cls);
            n_tasks += (rows + rblk - 1) / rblk * Hkv * ns;
            n_states += (int64_t)ns * passes[i].n_tok;
        }
        if (n_tasks <= a->cap_tasks && n_states <= a->cap_states) break;
        if (iter > 40)
            return cas_error(CAS_ERR_NOMEM, "cuda attn plan: %lld tasks / %lld states exceed capacity",
                             (long long)n_tasks, (long long)n_states);
        L *= 2;
        Lw *= 2;
        Lm *= 2;
        Lf *= 2;
    }

    /* contributions per token, direct passes */
    for (int32_t t = 0; t < total_q; t++) {
        a->cnt[t] = 0;
        a->direct_tok[t] = 0;
        a->need_tok[t] = 0;
    }
    for (int32_t i = 0; i < n_passes; i++)
        for (int32_t j = 0; j < passes[i].n_tok; j++) a->cnt[tok_ids[passes[i].tok_off + j]] += a->nsplit[i];
    for (int32_t t = 0; t < total_q; t++)
        if (a->cnt[t] == 0)
            return cas_error(CAS_ERR_INVALID, "cuda attn plan: token %d is in no pass", t);
    int64_t cur = 0; /* scratch floats */
    for (int32_t i = 0; i < n_passes; i++) {
        int direct = a->nsplit[i] == 1;
        for (int32_t j = 0; direct && j < passes[i].n_tok; j++)
            if (a->cnt[tok_ids[passes[i].tok_off + j]] != 1) direct = 0;
        if (direct) {
            a->job_off[i] = -1;
            for (int32_t j = 0; j < passes[i].n_tok; j++) a->direct_tok[tok_ids[passes[i].tok_off + j]] = 1;
        } else {
            a->job_off[i] = cur;
            cur += (int64_t)a->nsplit[i] * job_stride(passes[i].n_tok, Hq, D);
        }
    }
    if (cur > a->scratch_floats)
        return cas_error(CAS_ERR_INTERNAL, "cuda attn plan: scratch overflow");

    /* layout of the block */
    char *S = a->stage;
    cas_cuda_plan_hdr *h = (cas_cuda_plan_hdr *)S;
    memset(h, 0, sizeof *h);
    int64_t off = ALIGN16((int64_t)sizeof *h);
    h->off_passes = off;
    off = ALIGN16(off + (int64_t)n_passes * (int64_t)sizeof(cas_cuda_pass));
    /* the page ids the passes read, each pass's run once, where they are
     * fewer than the batch's (a CPU plan's passes index every request's
     * list, the shared prefix in each: B64 x 32k keys is 133k ids, its
     * passes read 4k); else all of them as given */
    int64_t pass_ids = 0;
    for (int32_t i = 0; i < n_passes; i++) pass_ids += ((int64_t)passes[i].len + P - 1) / P;
    const int compact = pass_ids < n_page_ids;
    const int64_t block_ids = compact ? pass_ids : n_page_ids;
    h->off_pages = off;
    off = ALIGN16(off + block_ids * 4);
    h->off_tok_ids = off;
    off = ALIGN16(off + (int64_t)n_tok_rows * 4);
    h->off_tok_pos = off;
    off = ALIGN16(off + (int64_t)n_tok_rows * 4);

    cas_cuda_pass *gp = (cas_cuda_pass *)(S + h->off_passes);
    int32_t *gpages = (int32_t *)(S + h->off_pages);
    for (int32_t i = 0, at = 0; i < n_passes; i++) {
        const int32_t np_i = (int32_t)(((int64_t)passes[i].len + P - 1) / P);
        if (compact) {
            if (np_i) memcpy(gpages + at, pages + passes[i].page_off, (size_t)np_i * 4);
            gp[i].page_off = at;
            at += np_i;
        } else {
            gp[i].page_off = passes[i].page_off;
        }
        gp[i].pos0 = passes[i].pos0;
        gp[i].len = passes[i].len;
        gp[i].tok_off = passes[i].tok_off;
        gp[i].n_tok = passes[i].n_tok;
        /* runs: at least half of the page ids are their predecessor + 1 */
        const int32_t nrun = page_steps(pages + passes[i].page_off, np_i);
        gp[i].page_runs = np_i > 1 && 2 * nrun >= np_i - 1;
    }
    if (!compact && n_page_ids) memcpy(gpages, pages, (size_t)n_page_ids * 4);
    if (n_tok_rows) {
        memcpy(S + h->off_tok_ids, tok_ids, (size_t)n_tok_rows * 4);
        memcpy(S + h->off_tok_pos, tok_pos, (size_t)n_tok_rows * 4);
    }

    /* tasks */
    int32_t nw = 0, nn = 0, nmid = 0, nf = 0;
    const int fuse18 = a->wide_kind == 18 && a->fm18;
    int64_t kv_read = 0;
    for (int32_t i = 0; i < n_passes; i++) {
        const cas_attn_pass *p = &passes[i];
        const int32_t rows = p->n_tok * group;
        if (rows == 0) continue;
        const int cls = pass_class(a, rows);
        const int32_t rblk = class_rows(a, cls);
        for (int32_t c = 0; c < a->nsplit[i]; c++) {
            int32_t c0 = c * a->chunk[i], c1 = c0 + a->chunk[i];
            if (c1 > p->len) c1 = p->len;
            for (int32_t r0 = 0; r0 < rows; r0 += rblk) {
                int32_t nr = rows - r0 < rblk ? rows - r0 : rblk;
                int32_t pmin = INT32_MAX, pmax = INT32_MIN;
                for (int32_t tk = r0 / group; tk <= (r0 + nr - 1) / group; tk++) {
                    int32_t ps = tok_pos[p->tok_off + tk];
                    if (ps < pmin) pmin = ps;
                    if (ps > pmax) pmax = ps;
                }
                int32_t k0 = c0, k1 = c1;
                if (params->causal && (int64_t)pmax - p->pos0 + 1 < k1)
                    k1 = (int32_t)((int64_t)pmax - p->pos0 + 1);
                if (params->window_left >= 0 && (int64_t)pmin - params->window_left - p->pos0 > k0)
                    k0 = (int64_t)pmin - params->window_left - p->pos0 < c1
                             ? (int32_t)((int64_t)pmin - params->window_left - p->pos0)
                             : c1; /* every key of the chunk left of the window: empty, within the chunk */
                if (k1 < k0) k1 = k0;
                for (int32_t hk = 0; hk < Hkv; hk++) {
                    cas_cuda_task t;
                    t.flags = 0;
                    t.pass = i;
                    t.kv_head = hk;
                    t.row0 = r0;
                    t.nrows = nr;
                    t.kv0 = k0;
                    t.kv1 = k1;
                    t.qpos_min = pmin;
                    t.qpos_max = pmax;
                    if (a->job_off[i] < 0) {
                        t.o_off = -1;
                        t.lse_off = -1;
                    } else {
                        int64_t job = a->job_off[i] + (int64_t)c * job_stride(p->n_tok, Hq, D);
                        t.o_off = job;
                        t.lse_off = job + (int64_t)p->n_tok * Hq * D;
                    }
                    kv_read += k1 - k0;
                    if (fuse18 && hk == 0 && a->job_off[i] >= 0) {
                        /* its writer units: 64 rows of a many-rows task (a
                         * consumer warpgroup), or the whole narrow task */
                        const int32_t unit = cls == CLS_WIDE || TAIL17(i) ? 64 : nr;
                        for (int32_t u0 = r0; u0 < r0 + nr; u0 += unit) {
                            const int32_t u1 = u0 + unit < r0 + nr ? u0 + unit : r0 + nr;
                            for (int32_t tk = u0 / group; tk <= (u1 - 1) / group; tk++)
                                a->need_tok[tok_ids[p->tok_off + tk]]++;
                        }
                    }
                    if (cls == CLS_WIDE) {
                        t.pad = nw;
                        a->tw[nw++] = t;
                    } else if (cls == CLS_MID) {
                        t.pad = nmid;
                        a->tm[nmid++] = t;
                    } else if (FUSED(i)) {
                        t.pad = nf;
                        a->tf[nf++] = t;
                    } else if (TAIL17(i)) {
                        t.flags = 8;
                        t.pad = nw;
                        a->tw[nw++] = t;
                    } else {
                        t.pad = nn;
                        a->tn[nn++] = t;
                    }
                }
            }
        }
    }
    if (a->wide_kind == 10) nw = pair_tasks(a, nw, Hkv);
    else if (MIX_KIND(a->wide_kind)) arrange_mix(a, nw);
    else sort_list(a, a->tw, nw);
    sort_list(a, a->tn, nn);
    sort_list(a, a->tm, nmid);
    sort_list(a, a->tf, nf);
    /* the fused list is taken from a counter, kind 10's pairs by clusters */
    if (a->snake) {
        if (a->wide_kind != 10 && !MIX_KIND(a->wide_kind)) snake_rounds(a->tw, nw, a->wide_grid);
        snake_rounds(a->tn, nn, a->num_sms * a->occ_narrow);
        if (a->mid_rows > 0) snake_rounds(a->tm, nmid, a->mid_grid);
    }
#undef FUSED
#undef TAIL17
    for (int32_t i = 0; i < nw; i++) a->tw[i].pad = 0;
    for (int32_t i = 0; i < nn; i++) a->tn[i].pad = 0;
    for (int32_t i = 0; i < nmid; i++) a->tm[i].pad = 0;
    for (int32_t i = 0; i < nf; i++) a->tf[i].pad = 0;
    h->off_tasks_wide = off;
    memcpy(S + off, a->tw, (size_t)nw * sizeof(cas_cuda_task));
    off = ALIGN16(off + (int64_t)nw * (int64_t)sizeof(cas_cuda_task));
    h->off_tasks_narrow = off;
    memcpy(S + off, a->tn, (size_t)nn * sizeof(cas_cuda_task));
    off = ALIGN16(off + (int64_t)nn * (int64_t)sizeof(cas_cuda_task));
    h->off_tasks_mid = off;
    memcpy(S + off, a->tm, (size_t)nmid * sizeof(cas_cuda_task));
    off = ALIGN16(off + (int64_t)nmid * (int64_t)sizeof(cas_cuda_task));
    h->off_tasks_fused = off;
    memcpy(S + off, a->tf, (size_t)nf * sizeof(cas_cuda_task));
    off = ALIGN16(off + (int64_t)nf * (int64_t)sizeof(cas_cuda_task));
    h->off_cta_ptr = off;
    if (MIX_KIND(a->wide_kind)) {
        memcpy(S + off, a->cta_ptr, ((size_t)a->wide_grid + 1) * 4);
        off = ALIGN16(off + ((int64_t)a->wide_grid + 1) * 4);
    }

    /* merge lists */
    int32_t nm = 0;
    for (int32_t t = 0; t < total_q; t++)
        if (!a->direct_tok[t]) nm++;
    h->off_merge_tok = off;
    off = ALIGN16(off + (int64_t)nm * 4);
    h->off_contrib_indptr = off;
    off = ALIGN16(off + ((int64_t)nm + 1) * 4);
    int32_t *mtok = (int32_t *)(S + h->off_merge_tok);
    int32_t *ind = (int32_t *)(S + h->off_contrib_indptr);
    int32_t ncontrib = 0;
    nm = 0;
    ind[0] = 0;
    for (int32_t t = 0; t < total_q; t++) {
        a->fill[t] = -1;
        if (a->direct_tok[t]) continue;
        mtok[nm] = t;
        a->fill[t] = ncontrib; /* next free slot of t's list */
        ncontrib += a->cnt[t];
        ind[++nm] = ncontrib;
    }
    h->off_contrib_o = off;
    off = ALIGN16(off + (int64_t)ncontrib * 8);
    h->off_contrib_lse = off;
    off = ALIGN16(off + (int64_t)ncontrib * 8);
    if (fuse18) {
        /* kind 18: each token's merge index and the writer units the
         * kernels count on its counters before the last one merges */
        h->merge_fused = 1;
        h->merge_cnt = (int64_t)(uintptr_t)a->dmcnt;
        h->off_tok_merge = off;
        off = ALIGN16(off + (int64_t)total_q * 4);
        h->off_merge_need = off;
        off = ALIGN16(off + (int64_t)nm * 4);
        if (off > a->cap_bytes) return cas_error(CAS_ERR_INTERNAL, "cuda attn plan: block overflow");
        int32_t *tm = (int32_t *)(S + h->off_tok_merge), *nd = (int32_t *)(S + h->off_merge_need);
        for (int32_t t = 0, j = 0; t < total_q; t++) {
            tm[t] = a->direct_tok[t] ? -1 : j;
            if (!a->direct_tok[t]) nd[j++] = a->need_tok[t];
        }
    }
    if (off > a->cap_bytes) return cas_error(CAS_ERR_INTERNAL, "cuda attn plan: block overflow");
    int64_t *co = (int64_t *)(S + h->off_contrib_o);
    int64_t *cl = (int64_t *)(S + h->off_contrib_lse);
    for (int32_t i = 0; i < n_passes; i++) {
        if (a->job_off[i] < 0) continue;
        const cas_attn_pass *p = &passes[i];
        for (int32_t c = 0; c < a->nsplit[i]; c++) {
            int64_t job = a->job_off[i] + (int64_t)c * job_stride(p->n_tok, Hq, D);
            for (int32_t j = 0; j < p->n_tok; j++) {
                int32_t t = tok_ids[p->tok_off + j];
                int32_t slot = a->fill[t]++;
                co[slot] = job + (int64_t)j * Hq * D;
                cl[slot] = job + (int64_t)p->n_tok * Hq * D + (int64_t)j * Hq;
            }
        }
    }

    h->n_passes = n_passes;
    h->n_tasks_wide = nw;
    h->n_tasks_narrow = nn;
    h->n_tasks_mid = nmid;
    h->n_tasks_fused = nf;
    h->total_q = total_q;
    h->n_merge_tok = nm;
    h->causal = params->causal ? 1 : 0;
    h->window_left = params->window_left;
    h->scale = cas_attn_scale(&a->shape, params);
    h->scale_log2 = h->scale * 1.4426950408889634f;
    h->soft_cap = params->logits_soft_cap;
    h->group = group;
    h->block_bytes = off;

    a->info.passes = n_passes;
    a->info.tasks_wide = nw;
    a->info.tasks_narrow = nn;
    a->info.tasks_mid = nmid;
    a->info.tasks_fused = nf;
    a->info.merge_tokens = nm;
    a->info.contribs = ncontrib;
    a->info.plan_bytes = off;
    a->info.kv_tokens_read = kv_read;
    return CAS_OK;
}

cas_status cas_cuda_attn_plan_flat(cas_cuda_attn *a, const cas_attn_batch *b, int32_t num_pages,
                                   const cas_attn_params *params) {
    if (!a) return cas_error(CAS_ERR_INVALID, "cuda attn plan: NULL context");
    cas_status st = cas_attn_validate(&a->shape, b, num_pages, params);
    if (st) return st;
    const int32_t B = b->batch, P = a->shape.page_size;
    const int32_t total_q = B ? b->qo_indptr[B] : 0;
    if (B > a->caps.max_passes || total_q > a->caps.max_tok_rows || total_q > a->caps.max_total_q)
        return cas_error(CAS_ERR_NOMEM, "cuda attn plan: batch of %d (%d tokens) over capacity", B,
                         total_q);
    for (int32_t r = 0; r < B; r++) {
        int32_t q0 = b->qo_indptr[r], ql = b->qo_indptr[r + 1] - q0;
        int32_t kv_len = (b->kv_indptr[r + 1] - b->kv_indptr[r] - 1) * P + b->kv_last_page_len[r];
        cas_attn_pass *p = &a->flat_passes[r];
        p->page_off = b->kv_indptr[r];
        p->pos0 = 0;
        p->len = kv_len;
        p->tok_off = q0;
        p->n_tok = ql;
        p->node = -1;
        for (int32_t i = 0; i < ql; i++) {
            a->flat_ids[q0 + i] = q0 + i;
            a->flat_pos[q0 + i] = kv_len - ql + i;
        }
    }
    return cas_cuda_attn_plan_passes(a, params, num_pages, B, a->flat_passes, b->kv_indices,
                                     B ? b->kv_indptr[B] : 0, a->flat_ids, a->flat_pos, total_q,
                                     total_q);
}

cas_status cas_cuda_attn_plan_from_cpu(cas_cuda_attn *a, const struct cas_attn_plan *plan) {
    if (!a || !plan) return cas_error(CAS_ERR_INVALID, "cuda attn plan: NULL argument");
    const cas_attn_shape *s = &plan->shape;
    if (s->num_qo_heads != a->shape.num_qo_heads || s->num_kv_heads != a->shape.num_kv_heads ||
        s->head_dim != a->shape.head_dim || s->page_size != a->shape.page_size ||
        s->kv_dtype != a->shape.kv_dtype)
        return cas_error(CAS_ERR_INVALID, "cuda attn plan: CPU plan has another shape");
    int64_t n_page_ids = plan->batch ? plan->kv_indptr[plan->batch] : 0;
    return cas_cuda_attn_plan_passes(a, &plan->params, plan->num_pages, plan->n_passes,
                                     plan->passes, plan->pages, n_page_ids, plan->tok_ids,
                                     plan->tok_pos, plan->n_tok_rows, plan->total_q);
}

cas_status cas_cuda_attn_upload(cas_cuda_attn *a, cudaStream_t stream) {
    if (!a) return cas_error(CAS_ERR_INVALID, "cuda attn upload: NULL context");
    const cas_cuda_plan_hdr *h = (const cas_cuda_plan_hdr *)a->stage;
    int64_t bytes = h->block_bytes > 0 ? h->block_bytes : (int64_t)sizeof *h;
    CAS_CUDA_CHECK(cudaMemcpyAsync(a->dplan, a->stage, (size_t)bytes, cudaMemcpyHostToDevice, stream));
    /* kind 18: the runs leave the merge counters at zero; zeroed here too,
     * so that a run cut short (a CASCADE_CUDA_RUN_MASK probe) cannot leave
     * counts for the next plan */
    if (a->dmcnt && h->merge_fused)
        CAS_CUDA_CHECK(cudaMemsetAsync(a->dmcnt, 0, (size_t)h->n_merge_tok * (size_t)a->shape.num_kv_heads * sizeof(int), stream));
    CAS_CUDA_CHECK(cudaEventRecord(a->upload_done, stream));
    return CAS_OK;
}

cas_status cas_cuda_attn_run(cas_cuda_attn *a, const void *k, const void *v, const void *q,
                             float *o, float *lse, cudaStream_t stream) {
    if (!a || !k || !v || !q || !o || !lse)
        return cas_error(CAS_ERR_INVALID, "cuda attn run: NULL argument");
    int e;
    if (a->wide_kind == 11) {
        /* the many-rows kernel with the decode tails on its spare warps, then
         * the narrow kernel (a programmatic dependent: its CTAs take SMs as
         * they free up) for its own list and the fused tasks left; one
         * stream, the counter zeroed first (a memset node in a graph) */
        CAS_CUDA_CHECK(cudaMemsetAsync(a->dcounter, 0, 3 * sizeof(int), stream));
        e = cas_cuda_launch_attn_fused(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch, a->dcounter,
                                       a->wide_grid, a->num_sms * a->occ_narrow, stream);
        if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: fused attention launch: %s", __FILE__,
                                __LINE__, cas_cuda_error_string(e));
        e = cas_cuda_launch_merge(&a->geom, a->dplan, o, lse, a->dscratch, a->num_sms * 8, 0, stream);
        if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: merge launch: %s", __FILE__, __LINE__,
                                cas_cuda_error_string(e));
        return CAS_OK;
    }
    if (a->wide_kind == 18) {
        /* kind 18: the attention kernels merge the split states, so two
         * launches chained by programmatic dependence: the narrow kernel
         * first where the plan has narrow tasks (the many-rows CTAs take
         * SMs as the narrow ones leave), else the many-rows kernel first and
         * the empty narrow kernel after it. Either order computes the same;
         * a captured graph keeps the order of its capture. */
        const int narrow_first = a->info.tasks_narrow > 0 || a->info.tasks_wide == 0 || a->order18 == 1;
        if (narrow_first) {
            e = !(a->run_mask & 1) ? 0 : cas_cuda_launch_attn_narrow_fm(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch,
                                                                         a->num_sms * a->occ_narrow, 0, stream);
            if (!e && (a->run_mask & 2))
                e = cas_cuda_launch_attn_wgmma(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch, NULL,
                                               a->wide_kind, a->wide_grid, 1, stream);
        } else {
            e = !(a->run_mask & 2) ? 0 : cas_cuda_launch_attn_wgmma(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch,
                                                                     NULL, a->wide_kind, a->wide_grid, 0, stream);
            if (!e && (a->run_mask & 1))
                e = cas_cuda_launch_attn_narrow_fm(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch,
                                                   a->num_sms * a->occ_narrow, 1, stream);
        }
        if (!e && !a->fm18 && (a->run_mask & 4))
            e = cas_cuda_launch_merge(&a->geom, a->dplan, o, lse, a->dscratch, a->num_sms * 8, 1, stream);
        if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: attention launch: %s", __FILE__, __LINE__,
                                cas_cuda_error_string(e));
        return CAS_OK;
    }
    if (a->pdl && a->mid_rows == 0) {
        /* kind 17: narrow, many-rows and merge kernels on the caller's
         * stream, the last two as programmatic dependents: each one's CTAs
         * take the SMs that the one before leaves, and the merge's read
         * their plan lists before the states are done */
        e = !(a->run_mask & 1) ? 0 : cas_cuda_launch_attn(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch, 0,
                                                           a->num_sms * a->occ_narrow, stream);
        if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: narrow attention launch: %s", __FILE__, __LINE__,
                                cas_cuda_error_string(e));
        e = !(a->run_mask & 2) ? 0 : cas_cuda_launch_attn_wgmma(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch,
                                                                 NULL, a->wide_kind, a->wide_grid, 1, stream);
        if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: wide attention launch: %s", __FILE__, __LINE__,
                                cas_cuda_error_string(e));
        e = !(a->run_mask & 4) ? 0 : cas_cuda_launch_merge(&a->geom, a->dplan, o, lse, a->dscratch, a->num_sms * 8, 1, stream);
        if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: merge launch: %s", __FILE__, __LINE__,
                                cas_cuda_error_string(e));
        return CAS_OK;
    }
    /* narrow tasks (decode rows, memory bound) on the side stream, wide ones
     * (many rows, tensor-core bound) on the caller's: they overlap */
    CAS_CUDA_CHECK(cudaEventRecord(a->ev_fork, stream));
    CAS_CUDA_CHECK(cudaStreamWaitEvent(a->side, a->ev_fork, 0));
    e = !(a->run_mask & 1) ? 0 : cas_cuda_launch_attn(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch, 0,
                             a->num_sms * a->occ_narrow, a->side);
    if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: narrow attention launch: %s", __FILE__, __LINE__,
                            cas_cuda_error_string(e));
    CAS_CUDA_CHECK(cudaEventRecord(a->ev_join, a->side));
    /* mid tasks (a few rows per KV head, 64-row mma.sync) on a second side
     * stream: launched whenever the context has the list, so that a graph
     * captured once stays valid for every plan */
    if (a->mid_rows > 0) {
        CAS_CUDA_CHECK(cudaStreamWaitEvent(a->side2, a->ev_fork, 0));
        e = cas_cuda_launch_attn_mid(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch, a->mid_grid,
                                     a->side2);
        if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: mid attention launch: %s", __FILE__,
                                __LINE__, cas_cuda_error_string(e));
        CAS_CUDA_CHECK(cudaEventRecord(a->ev_join2, a->side2));
    }
    e = !(a->run_mask & 2) ? 0 : cas_cuda_launch_attn(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch, a->wide_kind,
                             a->wide_grid, stream);
    if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: wide attention launch: %s", __FILE__, __LINE__,
                            cas_cuda_error_string(e));
    CAS_CUDA_CHECK(cudaStreamWaitEvent(stream, a->ev_join, 0));
    if (a->mid_rows > 0) CAS_CUDA_CHECK(cudaStreamWaitEvent(stream, a->ev_join2, 0));
    e = !(a->run_mask & 4) ? 0 : cas_cuda_launch_merge(&a->geom, a->dplan, o, lse, a->dscratch, a->num_sms * 8, 0, stream);
    if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: merge launch: %s", __FILE__, __LINE__,
                            cas_cuda_error_string(e));
    return CAS_OK;
}

cas_attn_cost cas_cuda_attn_cost(void) {
    cas_attn_cost c;
    c.bytes_per_s = 4.0e12;        /* flat decode streams KV at ~3.7-4.8 TB/s (L2 helps) */
    c.pack_bytes_per_s = 10e12;    /* re-reads of a run that stays in L2 */
    c.flops_per_s = 300e12;        /* shared pass, wgmma kernel (B 256: ~300 TFLOP/s) */
    c.cache_bytes = 8.0 * 1024 * 1024;
    /* an extra pass: the run launches the same kernels (narrow, many-rows,
     * mid, merge) whether or not it has one, so it adds only a share of a
     * wave and the merge of its rows (row_merge_s); 3 us made the planner
     * pick flat at P 1024, B 8 where the cascade was 3-7 us faster */
    c.pass_overhead_s = 1e-6;
    c.row_merge_s = 5e-12;         /* per row x head x D element merged */
    return c;
}

cas_status cas_cuda_attn_fused_split(cas_cuda_attn *a, int32_t *by_tail_warps, int32_t *by_narrow) {
    if (!a || !by_tail_warps || !by_narrow) return cas_error(CAS_ERR_INVALID, "cuda attn: NULL argument");
    int32_t c[3] = {0, 0, 0};
    if (a->wide_kind == 11) {
        CAS_CUDA_CHECK(cudaDeviceSynchronize());
        CAS_CUDA_CHECK(cudaMemcpy(c, a->dcounter, sizeof c, cudaMemcpyDeviceToHost));
    }
    *by_tail_warps = c[1];
    *by_narrow = c[2];
    return CAS_OK;
}

void cas_cuda_attn_get_info(const cas_cuda_attn *a, cas_cuda_attn_info *info) {
    if (a && info) *info = a->info;
}

int cas_cuda_attn_kind_known(int kind) {
    return (kind >= 1 && kind <= 11 && kind != 5) || (kind >= 16 && kind <= 18);
}

const char *cas_cuda_attn_kernel_name(const cas_cuda_attn *a) {
    if (!a) return "none";
    switch (a->wide_kind) {
    case 11: return "wgmma-ws-tma-tails";
    case 10: return "wgmma-ws-mc";
    case 9: return "wgmma-ws-tma";
    case 16: return "wgmma-ws-tma-v9";
    case 17: return "wgmma-ws-tma-mix";
    case 18: return "wgmma-ws-tma-mix-fm";
    case 8: return "wgmma-ws-overlap";
    case 7: return "wgmma-ws64";
    case 6: return "wgmma-ws";
    case 4: return "wgmma-overlap";
    case 3: return "wgmma";
    case 2: return "mma.sync-2mtile";
    default: return "mma.sync";
    }
}

cas_status cas_cuda_attn_merge2(float *o_out, float *lse_out, const float *o_a, const float *lse_a,
                                const float *o_b, const float *lse_b, int64_t rows,
                                int32_t head_dim, cudaStream_t stream) {
    int e = cas_cuda_launch_merge2(o_out, lse_out, o_a, lse_a, o_b, lse_b, rows, head_dim, stream);
    if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: merge2: %s", __FILE__, __LINE__,
                            cas_cuda_error_string(e));
    return CAS_OK;
}

cas_status cas_cuda_attn_merge_n(float *o_out, float *lse_out, const float *o_in,
                                 const float *lse_in, int n, int64_t rows, int32_t head_dim,
                                 cudaStream_t stream) {
    int e = cas_cuda_launch_merge_states(o_out, lse_out, o_in, lse_in, n, rows, head_dim, stream);
    if (e) return cas_error(CAS_ERR_INTERNAL, "%s:%d: merge_n: %s", __FILE__, __LINE__,
                            cas_cuda_error_string(e));
    return CAS_OK;
}
