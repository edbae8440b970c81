/*
 * cuda_bench.c: what every benchmark of the CUDA attention backend measures
 * the same way (bench/cuda/attn_bench_cuda and `cascade attn-bench --backend
 * cuda`): the machine's two ceilings in the same run (a device-to-device copy,
 * bytes read + written; a bf16 matrix product through cuBLAS) and the time of
 * one run of an uploaded plan with CUDA events (warm-up, median), replayed
 * from a CUDA graph or launched eagerly.
 *
 * Timing follows the anchors' method (../shared/anchors): no L2 flush between
 * runs, the same buffers each time; CASCADE_BENCH_FLUSH=1 writes 256 MB
 * before every timed run instead (outside the timed region), so that a run
 * finds none of its bytes in the L2 (a model's step reads each layer's KV
 * once). These helpers allocate (benchmarks only, never the step loop).
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
                              int graph, double *ms) {
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    float *ts = NULL;
    void *fl = NULL;
    const size_t fl_bytes = (size_t)256 << 20;
    const char *fenv = getenv("CASCADE_BENCH_FLUSH");
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
    if (fenv && atoi(fenv)) TRY(cudaMalloc(&fl, fl_bytes));
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

void cas_cuda_attn_caps_fit(cas_cuda_attn_caps *caps, const struct cas_attn_plan *plan) {
    int64_t ids = plan->batch ? plan->kv_indptr[plan->batch] : 0;
    if (plan->total_q > caps->max_total_q) caps->max_total_q = plan->total_q;
    if (plan->n_passes > caps->max_passes) caps->max_passes = plan->n_passes;
    if (plan->n_tok_rows > caps->max_tok_rows) caps->max_tok_rows = plan->n_tok_rows;
    if (ids > caps->max_page_ids) caps->max_page_ids = ids;
    /* split-KV states: room for every pass split up to 64 ways */
    if (64 * (int64_t)plan->n_tok_rows > caps->max_states) caps->max_states = 64 * (int64_t)plan->n_tok_rows;
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
