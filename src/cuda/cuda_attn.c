/*
 * cuda_attn.c: host side of the CUDA attention backend (C11): the context
 * (its choice of kernels, the fixed-capacity device buffers and the pinned
 * staging of the plan), the upload of a plan, the run that launches the
 * kernels, and the device merges. The planner is cuda_attn_plan.c.
 *
 * A run launches the same kernels for every plan (their grids are
 * persistent and read their task counts on the device), so that a run
 * captured in a CUDA graph stays valid for every later plan:
 *   - on Hopper with head_dim 128: the narrow kernel, the wgmma kernel and
 *     the merge, on the caller's stream, the last two as programmatic
 *     dependents of the one before (each one's CTAs take the SMs the one
 *     before leaves; the wgmma kernel runs the cascade's decode tails too);
 *   - elsewhere: the narrow kernel on a side stream beside the 64-row
 *     mma.sync kernel on the caller's (decode rows are memory bound, the
 *     many-rows tasks tensor-core bound: they overlap), then the merge.
 */
#include <stdlib.h>
#include <string.h>

#include "cuda_attn_ctx.h"

cas_cuda_attn_opts cas_cuda_attn_opts_default(void) {
    cas_cuda_attn_opts o;
    o.kernel = CAS_CUDA_KERNEL_AUTO;
    o.tail_cost = 1.6;
    o.tail_mix_len = 512;
    return o;
}

void cas_cuda_attn_destroy(cas_cuda_attn *a) {
    if (!a) return;
    if (a->stage) cudaFreeHost(a->stage);
    if (a->dplan) cudaFree(a->dplan);
    if (a->dscratch) cudaFree(a->dscratch);
    if (a->upload_done) cudaEventDestroy(a->upload_done);
    if (a->ev_fork) cudaEventDestroy(a->ev_fork);
    if (a->ev_join) cudaEventDestroy(a->ev_join);
    if (a->side) cudaStreamDestroy(a->side);
    free(a->tw);
    free(a->tn);
    free(a->tp);
    free(a->task_cta);
    free(a->cta_ptr);
    free(a->cta_pos);
    free(a->heap);
    free(a->skey);
    free(a->sidx);
    free(a->cls_idx);
    free(a->cnt);
    free(a->fill);
    free(a->direct_tok);
    free(a->nsplit);
    free(a->chunk);
    free(a->job_off);
    free(a->flat_passes);
    free(a->flat_ids);
    free(a->flat_pos);
    free(a);
}

/* The many-rows kernel for this device and shape (opts->kernel AUTO: wgmma
 * where it runs), or an error for an explicit kernel that cannot run. */
static cas_status pick_kernel(cas_cuda_attn *a, const cas_cuda_attn_opts *o) {
    int major = 0, minor = 0;
    cas_status st = CAS_OK;
#define TRY(call) CAS_CUDA_TRY(call, fail)
    TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a->device));
    TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, a->device));
#undef TRY
    const int has_wgmma = major == 9 && minor == 0 && cas_cuda_wgmma_supported(a->shape.head_dim);
    switch (o->kernel) {
    case CAS_CUDA_KERNEL_AUTO: a->wide = has_wgmma ? CAS_CUDA_WIDE_WGMMA : CAS_CUDA_WIDE_MMA; break;
    case CAS_CUDA_KERNEL_MMA_SYNC: a->wide = CAS_CUDA_WIDE_MMA; break;
    case CAS_CUDA_KERNEL_WGMMA:
        if (!has_wgmma)
            return cas_error(CAS_ERR_UNSUPPORTED,
                             "cuda attn: the wgmma kernel needs compute capability 9.0 and head_dim 128 "
                             "(device %d.%d, head_dim %d)",
                             major, minor, a->shape.head_dim);
        a->wide = CAS_CUDA_WIDE_WGMMA;
        break;
    default: return cas_error(CAS_ERR_INVALID, "cuda attn: unknown kernel %d", (int)o->kernel);
    }
    a->wide_rows = cas_cuda_wide_rows(a->wide);
fail:
    return st;
}

cas_status cas_cuda_attn_create(cas_cuda_attn **out, const cas_attn_shape *shape,
                                const cas_cuda_attn_caps *caps, const cas_cuda_attn_opts *opts) {
    if (!out || !shape || !caps) return cas_error(CAS_ERR_INVALID, "cuda attn: NULL argument");
    *out = NULL;
    const cas_cuda_attn_opts o = opts ? *opts : cas_cuda_attn_opts_default();
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
    if (!(o.tail_cost > 0.0) || o.tail_mix_len < 0)
        return cas_error(CAS_ERR_INVALID, "cuda attn: tail_cost must be > 0 and tail_mix_len >= 0 (%g, %d)",
                         o.tail_cost, o.tail_mix_len);

    cas_cuda_attn *a = calloc(1, sizeof *a);
    if (!a) return cas_error(CAS_ERR_NOMEM, "cuda attn: out of memory");
    a->shape = *shape;
    a->caps = *caps;
    a->opts = o;
    if (a->caps.max_split <= 0) a->caps.max_split = 64;
    if (a->caps.max_states <= 0) a->caps.max_states = 8 * (int64_t)caps->max_tok_rows;
    a->geom.Hq = shape->num_qo_heads;
    a->geom.Hkv = shape->num_kv_heads;
    a->geom.D = shape->head_dim;
    a->geom.page_size = shape->page_size;
    a->geom.dtype = (int32_t)shape->kv_dtype;
    a->device = caps->device;
    cas_status st = CAS_OK;
#define TRY(call) CAS_CUDA_TRY(call, fail)
    TRY(cudaSetDevice(a->device));
    TRY(cudaDeviceGetAttribute(&a->num_sms, cudaDevAttrMultiProcessorCount, a->device));
    if ((st = pick_kernel(a, &o))) goto fail;
    {
        int e1 = cas_cuda_attn_occupancy(&a->geom, a->wide, &a->occ_wide);
        int e2 = cas_cuda_attn_occupancy(&a->geom, 0, &a->occ_narrow);
        if (e1 || e2 || a->occ_wide < 1 || a->occ_narrow < 1) {
            st = cas_error(CAS_ERR_INTERNAL, "cuda attn: kernel occupancy query failed: %s",
                           cas_cuda_error_string(e1 ? e1 : e2));
            goto fail;
        }
        a->wide_grid = a->num_sms * a->occ_wide;
        a->narrow_grid = a->num_sms * a->occ_narrow;
    }
    {
        /* tasks: per KV head, a few per pass (split KV) and per 16 rows */
        const int32_t group = shape->num_qo_heads / shape->num_kv_heads;
        int64_t base = (int64_t)shape->num_kv_heads *
                       ((int64_t)caps->max_passes + ((int64_t)caps->max_tok_rows * group + 15) / 16);
        a->cap_tasks = 4 * base + 64 * (int64_t)a->num_sms;
        a->cap_states = a->caps.max_states;
        a->cap_bytes = cas_cuda_plan_bytes_cap(&a->caps, a->cap_tasks, a->cap_states, a->wide_grid);
        /* a state per token and head, and a float of padding per (pass, chunk) at most */
        a->scratch_floats = a->cap_states * ((int64_t)shape->num_qo_heads * (shape->head_dim + 1) + 1);
    }
    TRY(cudaMallocHost((void **)&a->stage, (size_t)a->cap_bytes));
    TRY(cudaMalloc((void **)&a->dplan, (size_t)a->cap_bytes));
    TRY(cudaMalloc((void **)&a->dscratch, (size_t)(a->scratch_floats > 0 ? a->scratch_floats : 1) * 4));
    memset(a->stage, 0, (size_t)a->cap_bytes);
    TRY(cudaMemset(a->dplan, 0, (size_t)a->cap_bytes)); /* an empty plan: zero tasks */
    /* done before an upload on a caller's non-blocking stream could overtake it */
    TRY(cudaDeviceSynchronize());
    TRY(cudaEventCreateWithFlags(&a->upload_done, cudaEventDisableTiming));
    TRY(cudaEventCreateWithFlags(&a->ev_fork, cudaEventDisableTiming));
    TRY(cudaEventCreateWithFlags(&a->ev_join, cudaEventDisableTiming));
    TRY(cudaStreamCreateWithFlags(&a->side, cudaStreamNonBlocking));
#undef TRY
    const size_t ct = (size_t)a->cap_tasks, g = (size_t)a->wide_grid;
    const size_t mq = (size_t)caps->max_total_q, mp = (size_t)caps->max_passes;
    a->tw = malloc(sizeof(cas_cuda_task) * ct);
    a->tn = malloc(sizeof(cas_cuda_task) * ct);
    a->tp = malloc(sizeof(cas_cuda_task) * ct);
    a->task_cta = malloc(sizeof(int32_t) * ct);
    a->cta_ptr = malloc(sizeof(int32_t) * (g + 1));
    a->cta_pos = malloc(sizeof(int32_t) * g);
    a->heap = malloc(sizeof *a->heap * g);
    a->skey = malloc(sizeof(uint64_t) * 2 * ct);
    a->sidx = malloc(sizeof(int32_t) * 2 * ct);
    a->cls_idx = malloc(sizeof(int32_t) * mp);
    a->cnt = malloc(sizeof(int32_t) * mq);
    a->fill = malloc(sizeof(int32_t) * mq);
    a->direct_tok = malloc(sizeof(int32_t) * mq);
    a->nsplit = malloc(sizeof(int32_t) * mp);
    a->chunk = malloc(sizeof(int32_t) * mp);
    a->job_off = malloc(sizeof(int64_t) * mp);
    a->flat_passes = malloc(sizeof(cas_attn_pass) * mp);
    a->flat_ids = malloc(sizeof(int32_t) * mq);
    a->flat_pos = malloc(sizeof(int32_t) * mq);
    if (!a->tw || !a->tn || !a->tp || !a->task_cta || !a->cta_ptr || !a->cta_pos || !a->heap || !a->skey ||
        !a->sidx || !a->cls_idx || !a->cnt || !a->fill || !a->direct_tok || !a->nsplit || !a->chunk ||
        !a->job_off || !a->flat_passes || !a->flat_ids || !a->flat_pos) {
        st = cas_error(CAS_ERR_NOMEM, "cuda attn: out of host memory");
        goto fail;
    }
    *out = a;
    return CAS_OK;
fail:
    cas_cuda_attn_destroy(a);
    return st;
}

cas_status cas_cuda_attn_upload(cas_cuda_attn *a, cudaStream_t stream) {
    if (!a) return cas_error(CAS_ERR_INVALID, "cuda attn upload: NULL context");
    const cas_cuda_plan_hdr *h = (const cas_cuda_plan_hdr *)a->stage;
    int64_t bytes = h->block_bytes > 0 ? h->block_bytes : (int64_t)sizeof *h;
    CAS_CUDA_CHECK(cudaMemcpyAsync(a->dplan, a->stage, (size_t)bytes, cudaMemcpyHostToDevice, stream));
    CAS_CUDA_CHECK(cudaEventRecord(a->upload_done, stream));
    return CAS_OK;
}

/* a launcher's cudaError_t as a status naming what was launched */
static cas_status launched(int e, const char *what, int line) {
    if (!e) return CAS_OK;
    return cas_error(CAS_ERR_INTERNAL, "%s:%d: %s launch: %s", __FILE__, line, what, cas_cuda_error_string(e));
}

cas_status cas_cuda_attn_run(cas_cuda_attn *a, const void *k, const void *v, const void *q,
                             float *o, float *lse, cudaStream_t stream) {
    if (!a || !k || !v || !q || !o || !lse)
        return cas_error(CAS_ERR_INVALID, "cuda attn run: NULL argument");
    cas_status st;
    const int merge_grid = a->num_sms * 8;
    if (a->wide == CAS_CUDA_WIDE_WGMMA) {
        /* one stream: narrow, then wgmma and merge as programmatic dependents */
        if ((st = launched(cas_cuda_launch_attn(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch, 0, a->narrow_grid,
                                                stream),
                           "narrow attention", __LINE__)))
            return st;
        if ((st = launched(cas_cuda_launch_attn_wgmma(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch, a->wide_grid,
                                                      stream),
                           "wgmma attention", __LINE__)))
            return st;
        return launched(cas_cuda_launch_merge(&a->geom, a->dplan, o, lse, a->dscratch, merge_grid, 1, stream), "merge",
                        __LINE__);
    }
    /* the narrow kernel on the side stream beside the many-rows one */
    CAS_CUDA_CHECK(cudaEventRecord(a->ev_fork, stream));
    CAS_CUDA_CHECK(cudaStreamWaitEvent(a->side, a->ev_fork, 0));
    if ((st = launched(cas_cuda_launch_attn(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch, 0, a->narrow_grid,
                                            a->side),
                       "narrow attention", __LINE__)))
        return st;
    CAS_CUDA_CHECK(cudaEventRecord(a->ev_join, a->side));
    if ((st = launched(cas_cuda_launch_attn(&a->geom, a->dplan, k, v, q, o, lse, a->dscratch, a->wide, a->wide_grid,
                                            stream),
                       "wide attention", __LINE__)))
        return st;
    CAS_CUDA_CHECK(cudaStreamWaitEvent(stream, a->ev_join, 0));
    return launched(cas_cuda_launch_merge(&a->geom, a->dplan, o, lse, a->dscratch, merge_grid, 0, stream), "merge",
                    __LINE__);
}

cas_attn_cost cas_cuda_attn_cost(void) {
    cas_attn_cost c;
    c.bytes_per_s = 4.0e12;        /* flat decode streams KV at ~3.7-4.8 TB/s (L2 helps) */
    c.pack_bytes_per_s = 10e12;    /* re-reads of a run that stays in L2 */
    c.flops_per_s = 300e12;        /* shared pass, wgmma kernel (B 256: ~300 TFLOP/s) */
    c.cache_bytes = 8.0 * 1024 * 1024;
    /* an extra pass: the run launches the same kernels (narrow, many-rows,
     * merge) whether or not it has one, so it adds only a share of a wave
     * and the merge of its rows (row_merge_s); 3 us made the planner pick
     * flat at P 1024, B 8 where the cascade was 3-7 us faster */
    c.pass_overhead_s = 1e-6;
    c.row_merge_s = 5e-12;         /* per row x head x D element merged */
    return c;
}

void cas_cuda_attn_get_info(const cas_cuda_attn *a, cas_cuda_attn_info *info) {
    if (a && info) *info = a->info;
}

cas_cuda_kernel cas_cuda_attn_kernel(const cas_cuda_attn *a) {
    return a && a->wide == CAS_CUDA_WIDE_WGMMA ? CAS_CUDA_KERNEL_WGMMA : CAS_CUDA_KERNEL_MMA_SYNC;
}

const char *cas_cuda_attn_kernel_name(const cas_cuda_attn *a) {
    if (!a) return "none";
    return a->wide == CAS_CUDA_WIDE_WGMMA ? "wgmma" : "mma.sync";
}

cas_status cas_cuda_attn_merge2(float *o_out, float *lse_out, const float *o_a, const float *lse_a,
                                const float *o_b, const float *lse_b, int64_t rows,
                                int32_t head_dim, cudaStream_t stream) {
    return launched(cas_cuda_launch_merge2(o_out, lse_out, o_a, lse_a, o_b, lse_b, rows, head_dim, stream),
                    "merge2", __LINE__);
}

cas_status cas_cuda_attn_merge_n(float *o_out, float *lse_out, const float *o_in,
                                 const float *lse_in, int n, int64_t rows, int32_t head_dim,
                                 cudaStream_t stream) {
    return launched(cas_cuda_launch_merge_states(o_out, lse_out, o_in, lse_in, n, rows, head_dim, stream),
                    "merge_n", __LINE__);
}
