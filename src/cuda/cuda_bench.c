/*
 * cuda_bench.c: what every benchmark and test of the CUDA attention backend
 * measures or checks the same way (bench/cuda/attn_bench_cuda,
 * tests/cuda/test_cuda_attn and `cascade attn-bench --backend cuda`): the
 * machine's two ceilings in the same run (a device-to-device copy, bytes read
 * + written; a bf16 matrix product through cuBLAS), the time of one run of an
 * uploaded plan with CUDA events (warm-up, median), replayed from a CUDA
 * graph or launched eagerly, and the float64 reference on the device.
 *
 * Timing follows the anchors' method (../shared/anchors): by default no L2
 * flush between runs, the same buffers each time. These helpers allocate
 * (benchmarks and tests only, never the step loop).
 */
#include <cublas_v2.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_attn.h"
#include "cuda_attn_impl.h"

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

cas_status cas_cuda_measure_copy(int device, double *gbps) {
    const size_t bytes = (size_t)2 << 30;
    void *a = NULL, *b = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float ts[20];
    cas_status st = CAS_OK;
    *gbps = 0;
#define TRY(call) CAS_CUDA_TRY(call, out)
    TRY(cudaSetDevice(device));
    TRY(cudaMalloc(&a, bytes));
    TRY(cudaMalloc(&b, bytes));
    TRY(cudaMemset(a, 1, bytes));
    TRY(cudaEventCreate(&e0));
    TRY(cudaEventCreate(&e1));
    for (int i = 0; i < 23; i++) {
        TRY(cudaEventRecord(e0, 0));
        TRY(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        TRY(cudaEventRecord(e1, 0));
        TRY(cudaEventSynchronize(e1));
        if (i >= 3) TRY(cudaEventElapsedTime(&ts[i - 3], e0, e1));
    }
    qsort(ts, 20, sizeof(float), cmp_float);
    *gbps = 2.0 * (double)bytes / ((double)ts[10] * 1e-3) / 1e9;
out:
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (a) cudaFree(a);
    if (b) cudaFree(b);
    return st;
}

/* random bf16 bits in [-1, 1): the rate on zeros is higher than on data */
static void fill_bf16(uint16_t *h, size_t n) {
    uint64_t x = 0x2545f4914f6cdd1dull;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        h[i] = cas_f32_to_bf16((float)(x & 0xffff) / 32768.0f - 1.0f);
    }
}

cas_status cas_cuda_measure_gemm(int device, int n, double *tflops) {
    const size_t elems = (size_t)n * n;
    void *a = NULL, *b = NULL, *c = NULL;
    uint16_t *h = NULL;
    cublasHandle_t hd = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float ts[10];
    cas_status st = CAS_OK;
    *tflops = 0;
    TRY(cudaSetDevice(device));
    TRY(cudaMalloc(&a, elems * 2));
    TRY(cudaMalloc(&b, elems * 2));
    TRY(cudaMalloc(&c, elems * 2));
    h = malloc(elems * 2);
    if (!h) {
        st = cas_error(CAS_ERR_NOMEM, "gemm rate: out of host memory");
        goto out;
    }
    fill_bf16(h, elems);
    TRY(cudaMemcpy(a, h, elems * 2, cudaMemcpyHostToDevice));
    TRY(cudaMemcpy(b, h, elems * 2, cudaMemcpyHostToDevice));
    if (cublasCreate(&hd) != CUBLAS_STATUS_SUCCESS) {
        st = cas_error(CAS_ERR_INTERNAL, "gemm rate: cublasCreate failed");
        hd = NULL;
        goto out;
    }
    TRY(cudaEventCreate(&e0));
    TRY(cudaEventCreate(&e1));
    const float one = 1.f, zero = 0.f;
    for (int i = 0; i < 13; i++) {
        TRY(cudaEventRecord(e0, 0));
        cublasStatus_t cs = cublasGemmEx(hd, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n,
                                         b, CUDA_R_16BF, n, &zero, c, CUDA_R_16BF, n,
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (cs != CUBLAS_STATUS_SUCCESS) {
            st = cas_error(CAS_ERR_INTERNAL, "gemm rate: cublasGemmEx failed (%d)", (int)cs);
            goto out;
        }
        TRY(cudaEventRecord(e1, 0));
        TRY(cudaEventSynchronize(e1));
        if (i >= 3) TRY(cudaEventElapsedTime(&ts[i - 3], e0, e1));
    }
    qsort(ts, 10, sizeof(float), cmp_float);
    *tflops = 2.0 * (double)n * n * n / ((double)ts[5] * 1e-3) / 1e12;
out:
    if (hd) cublasDestroy(hd);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    free(h);
    if (a) cudaFree(a);
    if (b) cudaFree(b);
    if (c) cudaFree(c);
    return st;
}

cas_status cas_cuda_attn_time(cas_cuda_attn *a, const void *k, const void *v, const void *q,
                              float *o, float *lse, cudaStream_t s, int warmup, int iters,
                              int graph, int flush_l2, double *ms) {
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float *ts = NULL;
    void *fl = NULL;
    const size_t fl_bytes = (size_t)256 << 20;
    cas_status st = CAS_OK;
    *ms = 0;
    if (iters < 1) iters = 1;
    ts = malloc(sizeof(float) * (size_t)iters);
    if (!ts) return cas_error(CAS_ERR_NOMEM, "attn time: out of memory");
    if (graph) {
        TRY(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        st = cas_cuda_attn_run(a, k, v, q, o, lse, s);
        cudaError_t ce = cudaStreamEndCapture(s, &g);
        if (st) goto out;
        TRY(ce);
        TRY(cudaGraphInstantiate(&ge, g, 0));
    }
    TRY(cudaEventCreate(&e0));
    TRY(cudaEventCreate(&e1));
    if (flush_l2) TRY(cudaMalloc(&fl, fl_bytes));
    for (int i = 0; i < warmup + iters; i++) {
        if (fl) TRY(cudaMemsetAsync(fl, i & 0xff, fl_bytes, s));
        TRY(cudaEventRecord(e0, s));
        if (ge) TRY(cudaGraphLaunch(ge, s));
        else if ((st = cas_cuda_attn_run(a, k, v, q, o, lse, s))) goto out;
        TRY(cudaEventRecord(e1, s));
        TRY(cudaEventSynchronize(e1));
        if (i >= warmup) TRY(cudaEventElapsedTime(&ts[i - warmup], e0, e1));
    }
    qsort(ts, (size_t)iters, sizeof(float), cmp_float);
    *ms = iters % 2 ? ts[iters / 2] : 0.5 * ((double)ts[iters / 2 - 1] + ts[iters / 2]);
out:
#undef TRY
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (fl) cudaFree(fl);
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);
    free(ts);
    return st;
}

void cas_cuda_attn_caps_fit(cas_cuda_attn_caps *caps, const cas_attn_plan *plan) {
    cas_attn_pass_list l;
    cas_attn_plan_passes(plan, &l);
    if (l.total_q > caps->max_total_q) caps->max_total_q = l.total_q;
    if (l.n_passes > caps->max_passes) caps->max_passes = l.n_passes;
    if (l.n_tok_rows > caps->max_tok_rows) caps->max_tok_rows = l.n_tok_rows;
    if (l.n_page_ids > caps->max_page_ids) caps->max_page_ids = l.n_page_ids;
    /* split-KV states: room for every pass split up to 64 ways */
    if (64 * (int64_t)l.n_tok_rows > caps->max_states) caps->max_states = 64 * (int64_t)l.n_tok_rows;
}

cas_status cas_cuda_attn_reference(const cas_attn_shape *shape, const void *k, const void *v,
                                   int32_t num_pages, const cas_attn_batch *b,
                                   const cas_attn_params *params, const void *q, double *o_ref,
                                   double *lse_ref) {
    if (!shape || !k || !v || !b || !params || !q || !o_ref || !lse_ref)
        return cas_error(CAS_ERR_INVALID, "cuda reference: NULL argument");
    if (shape->kv_dtype != CAS_BF16 && shape->kv_dtype != CAS_F16)
        return cas_error(CAS_ERR_UNSUPPORTED, "cuda reference: kv dtype %s (bf16 and f16 only)",
                         cas_dtype_name(shape->kv_dtype));
    cas_status st = cas_attn_validate(shape, b, num_pages, params);
    if (st) return st;
    const int32_t B = b->batch, P = shape->page_size, total_q = B ? b->qo_indptr[B] : 0;
    const int64_t nids = B ? b->kv_indptr[B] : 0;
    int32_t *h = malloc(sizeof(int32_t) * ((size_t)2 * total_q + B + 1 + B + 1));
    int32_t *d = NULL;
    if (!h) return cas_error(CAS_ERR_NOMEM, "cuda reference: out of host memory");
    /* tok_req, tok_pos [total_q], kv_indptr [B + 1], kv_len [B] */
    int32_t *tok_req = h, *tok_pos = h + total_q, *indptr = h + 2 * total_q, *kv_len = indptr + B + 1;
    for (int32_t r = 0; r <= B; r++) indptr[r] = b->kv_indptr[r];
    for (int32_t r = 0; r < B; r++) {
        kv_len[r] = (b->kv_indptr[r + 1] - b->kv_indptr[r] - 1) * P + b->kv_last_page_len[r];
        const int32_t q0 = b->qo_indptr[r], ql = b->qo_indptr[r + 1] - q0;
        for (int32_t i = 0; i < ql; i++) {
            tok_req[q0 + i] = r;
            tok_pos[q0 + i] = kv_len[r] - ql + i;
        }
    }
    const size_t nh = (size_t)2 * total_q + B + 1 + B;
    const cas_cuda_geom g = {shape->num_qo_heads, shape->num_kv_heads, shape->head_dim, P, (int32_t)shape->kv_dtype};
#define TRY(call) CAS_CUDA_TRY(call, out)
    TRY(cudaMalloc((void **)&d, sizeof(int32_t) * (nh + (size_t)(nids > 0 ? nids : 1))));
    TRY(cudaMemcpy(d, h, sizeof(int32_t) * nh, cudaMemcpyHostToDevice));
    if (nids) TRY(cudaMemcpy(d + nh, b->kv_indices, sizeof(int32_t) * (size_t)nids, cudaMemcpyHostToDevice));
    {
        const int e = cas_cuda_launch_reference(&g, k, v, q, d, d + total_q, d + 2 * total_q, d + nh,
                                                d + 2 * total_q + B + 1, total_q, params->causal,
                                                params->window_left, params->logits_soft_cap,
                                                cas_attn_scale(shape, params), o_ref, lse_ref, NULL);
        if (e) {
            st = cas_error(CAS_ERR_INTERNAL, "cuda reference: launch: %s", cas_cuda_error_string(e));
            goto out;
        }
    }
    TRY(cudaDeviceSynchronize());
#undef TRY
out:
    if (d) cudaFree(d);
    free(h);
    return st;
}

const char *cas_cuda_device_name(int device, char *buf, size_t n) {
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
        snprintf(buf, n, "unknown");
        return buf;
    }
    snprintf(buf, n, "%s", p.name);
    return buf;
}
