/*
 * gpu_stub.c: stand-ins for what the GPU forward's host code (src/gpu/gpu_model.c,
 * compiled with CAS_WITH_CUDA) calls on the device side, so that it, and the
 * engine's CUDA path above it, run on a machine without a GPU (CI): the CUDA
 * runtime calls it makes beyond tests/cuda/cuda_rt_stub.c, cuBLASLt's matrix
 * product, the kernels' launchers of gpu_impl.h, and the CUDA attention API
 * (cuda_attn.h) carried out by the CPU attention on the same plan.
 *
 * "Device" memory is host memory and every call completes before it returns.
 * The arithmetic is the kernels' written plainly in C: bf16 operands, f32
 * accumulation and activations, the same roundings; the CPU attention reads
 * the bf16 pools with the queries widened to f32. What this checks is the
 * host side: the step's inputs, slots, rows, plans and buffers, the engine's
 * device path and its errors. The kernels themselves are checked on a GPU
 * (make CUDA=1 test-cuda); the sampler here is sample_ref.h, the semantics
 * the device's sampler is tested against.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "../../src/cuda/cuda_attn.h"
#include "../../src/gpu/gpu_impl.h"
#include "../../src/model/model.h"
#include "cuda_stub.h"
#include "sample_ref.h"

/* ---- the runtime calls gpu_model.c makes beyond cuda_rt_stub.c ------------ */

cudaError_t cudaGetDeviceCount(int *n) {
    *n = CAS_STUB_DEVICES;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int device) {
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "host stand-in");
    return device >= 0 && device < CAS_STUB_DEVICES ? cudaSuccess : cudaErrorInvalidDevice;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) { return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
/* Graphs: the stand-ins run every call at once, so nothing can be captured;
 * the forward then runs its graphs' padded launches eagerly (the path a
 * runtime that refuses capture takes). */
cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode mode) {
    return cudaErrorStreamCaptureUnsupported;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    *g = NULL;
    return cudaErrorStreamCaptureInvalidated;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags) {
    return cudaErrorInvalidValue;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) { return cudaErrorInvalidValue; }
cudaError_t cudaGraphDestroy(cudaGraph_t g) { return cudaSuccess; }
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) { return cudaSuccess; }

/* ---- cuBLASLt: the descriptors remember what the product needs ----------- */

typedef struct {
    int32_t transa, transb;
} desc_t;
typedef struct {
    cudaDataType type;
    uint64_t rows, cols;
    int64_t ld;
} layout_t;

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    static char handle[1];
    *h = (cublasLtHandle_t)(void *)handle;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) { return CUBLAS_STATUS_SUCCESS; }
cublasStatus_t cublasLtMatmulDescInit_internal(cublasLtMatmulDesc_t d, size_t size, cublasComputeType_t c,
                                               cudaDataType_t scale) {
    memset(d, 0, size);
    return c == CUBLAS_COMPUTE_32F && scale == CUDA_R_32F ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
    desc_t *x = (desc_t *)(void *)d;
    const int32_t v = *(const int32_t *)buf;
    if (attr == CUBLASLT_MATMUL_DESC_TRANSA) x->transa = v;
    else if (attr == CUBLASLT_MATMUL_DESC_TRANSB) x->transb = v;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutInit_internal(cublasLtMatrixLayout_t l, size_t size, cudaDataType type,
                                                 uint64_t rows, uint64_t cols, int64_t ld) {
    memset(l, 0, size);
    layout_t *x = (layout_t *)(void *)l;
    x->type = type, x->rows = rows, x->cols = cols, x->ld = ld;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceInit_internal(cublasLtMatmulPreference_t p, size_t size) {
    memset(p, 0, size);
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t a, const void *buf,
                                                    size_t size) {
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t dd, cublasLtMatmulPreference_t p, int req,
                                              cublasLtMatmulHeuristicResult_t *res, int *found) {
    memset(res, 0, sizeof *res);
    *found = 1;
    return CUBLAS_STATUS_SUCCESS;
}

static inline float bf(uint16_t b) { return cas_bf16_to_f32(b); }

/* D = alpha op(A) op(B) + beta C for the products gpu_model.c asks for:
 * A bf16 K x N read transposed, B bf16 K x T, C = D f32 N x T (column-major). */
cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t Ad, const void *B, cublasLtMatrixLayout_t Bd, const void *beta,
                              const void *C, cublasLtMatrixLayout_t Cd, void *D, cublasLtMatrixLayout_t Dd,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t wsb, cudaStream_t stream) {
    const desc_t *dc = (const desc_t *)(const void *)desc;
    const layout_t *la = (const layout_t *)(const void *)Ad, *lb = (const layout_t *)(const void *)Bd,
                   *lc = (const layout_t *)(const void *)Cd;
    if (dc->transa != CUBLAS_OP_T || dc->transb != CUBLAS_OP_N || la->type != CUDA_R_16BF ||
        lb->type != CUDA_R_16BF || lc->type != CUDA_R_32F || C != D || la->rows != lb->rows)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    const int64_t K = (int64_t)la->rows, N = (int64_t)la->cols, T = (int64_t)lb->cols;
    const float al = *(const float *)alpha, be = *(const float *)beta;
    const uint16_t *a = A, *b = B;
    float *d = D;
    float *b32 = malloc(sizeof(float) * (size_t)(K * T));
    if (!b32) return CUBLAS_STATUS_ALLOC_FAILED;
    for (int64_t i = 0; i < K * T; i++) b32[i] = bf(b[i]);
#pragma omp parallel
    {
        float *row = malloc(sizeof(float) * (size_t)K);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!row) continue;
            for (int64_t k = 0; k < K; k++) row[k] = bf(a[n * la->ld + k]);
            for (int64_t t = 0; t < T; t++) {
                const float *bt = b32 + t * lb->ld;
                float s = 0.f;
                for (int64_t k = 0; k < K; k++) s += row[k] * bt[k];
                float *o = d + t * lc->ld + n;
                *o = al * s + (be != 0.f ? be * *o : 0.f);
            }
        }
        free(row);
    }
    free(b32);
    return CUBLAS_STATUS_SUCCESS;
}

/* ---- the kernels of gpu_kernels.cu and gpu_sample.cu, plainly ------------- */

static float half_at(const uint8_t *p) { return cas_f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }

int cas_gpu_dequant_bf16(int t, const void *src, void *dst, int64_t rows, int64_t cols, int64_t ld,
                         void *stream) {
    const uint8_t *s = src;
    uint16_t *d = dst;
    const int64_t per_row = t == CAS_T_F32 || t == CAS_T_F16 || t == CAS_T_BF16 ? cols : cols / 32;
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *o = d + r * ld;
        for (int64_t b = 0; b < per_row; b++) {
            const int64_t i = r * per_row + b;
            switch (t) {
            case CAS_T_F32: o[b] = cas_f32_to_bf16(((const float *)src)[i]); break;
            case CAS_T_F16: o[b] = cas_f32_to_bf16(cas_f16_to_f32(((const uint16_t *)src)[i])); break;
            case CAS_T_BF16: o[b] = ((const uint16_t *)src)[i]; break;
            case CAS_T_Q8_0: {
                const uint8_t *p = s + i * 34;
                for (int j = 0; j < 32; j++) o[b * 32 + j] = cas_f32_to_bf16(half_at(p) * (float)(int8_t)p[2 + j]);
                break;
            }
            case CAS_T_Q4_0: {
                const uint8_t *p = s + i * 18;
                for (int j = 0; j < 16; j++) {
                    o[b * 32 + j] = cas_f32_to_bf16(half_at(p) * (float)((p[2 + j] & 15) - 8));
                    o[b * 32 + 16 + j] = cas_f32_to_bf16(half_at(p) * (float)((p[2 + j] >> 4) - 8));
                }
                break;
            }
            case CAS_T_Q4_1: {
                const uint8_t *p = s + i * 20;
                for (int j = 0; j < 16; j++) {
                    o[b * 32 + j] = cas_f32_to_bf16(half_at(p) * (float)(p[4 + j] & 15) + half_at(p + 2));
                    o[b * 32 + 16 + j] = cas_f32_to_bf16(half_at(p) * (float)(p[4 + j] >> 4) + half_at(p + 2));
                }
                break;
            }
            default: return (int)cudaErrorInvalidValue;
            }
        }
    }
    return 0;
}

int cas_gpu_to_f32(int t, const void *src, float *dst, int64_t n, void *stream) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = t == CAS_T_F32   ? ((const float *)src)[i]
                 : t == CAS_T_F16 ? cas_f16_to_f32(((const uint16_t *)src)[i])
                                  : bf(((const uint16_t *)src)[i]);
    return 0;
}

int cas_gpu_fill_uniform_bf16(void *dst, int64_t n, float a, uint64_t seed, void *stream) {
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) {
        uint64_t z = seed + 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        d[i] = cas_f32_to_bf16(a * (2.0f * (float)(z >> 40) * (1.0f / 16777216.0f) - 1.0f));
    }
    return 0;
}

int cas_gpu_add_f32(float *y, const float *x, int64_t n, void *stream) {
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
    return 0;
}

int cas_gpu_fill_f32(float *dst, int64_t n, float v, void *stream) {
    for (int64_t i = 0; i < n; i++) dst[i] = v;
    return 0;
}

int cas_gpu_rope_table(const int32_t *pos, const float *inv_freq, float *cs, int32_t T, int32_t half,
                       void *stream) {
    for (int64_t i = 0; i < (int64_t)T * half; i++) {
        const double ang = (double)pos[i / half] * (double)inv_freq[i % half];
        cs[2 * i] = (float)cos(ang);
        cs[2 * i + 1] = (float)sin(ang);
    }
    return 0;
}

int cas_gpu_embed(const void *table, const int32_t *tokens, float *x, int32_t T, int32_t E, void *stream) {
    for (int32_t t = 0; t < T; t++)
        for (int32_t i = 0; i < E; i++) x[(int64_t)t * E + i] = bf(((const uint16_t *)table)[(int64_t)tokens[t] * E + i]);
    return 0;
}

int cas_gpu_rmsnorm(const float *x, const int32_t *rows, const float *w, void *out, int32_t n, int32_t E,
                    float eps, void *stream) {
    for (int32_t i = 0; i < n; i++) {
        const float *xr = x + (int64_t)(rows ? rows[i] : i) * E;
        float ss = 0.f;
        for (int32_t k = 0; k < E; k++) ss += xr[k] * xr[k];
        const float s = 1.0f / sqrtf(ss / (float)E + eps);
        for (int32_t k = 0; k < E; k++) ((uint16_t *)out)[(int64_t)i * E + k] = cas_f32_to_bf16(xr[k] * s * w[k]);
    }
    return 0;
}

int cas_gpu_rope_store(const float *qkv, const float *cs, const int64_t *slot, void *q_out, void *kpool,
                       void *vpool, int32_t T, int32_t n_head, int32_t n_head_kv, int32_t D, int32_t n_rot,
                       void *stream) {
    const int32_t QD = n_head * D, KD = n_head_kv * D, W = QD + 2 * KD, half = n_rot / 2;
    uint16_t *q = q_out, *kp = kpool, *vp = vpool;
    for (int32_t t = 0; t < T; t++) {
        const float *row = qkv + (int64_t)t * W, *c = cs + (int64_t)t * half * 2;
        for (int32_t h = 0; h < n_head + n_head_kv; h++) {
            const int is_k = h >= n_head;
            const float *v = row + (is_k ? QD + (h - n_head) * D : h * D);
            if (is_k && slot[t] < 0) continue; /* a graph's padding row: no K/V */
            uint16_t *dst = is_k ? kp + slot[t] * KD + (h - n_head) * D : q + (int64_t)t * QD + h * D;
            for (int32_t i = 0; i < D / 2; i++) {
                float a = v[2 * i], b = v[2 * i + 1];
                if (i < half) {
                    const float a2 = a * c[2 * i] - b * c[2 * i + 1], b2 = a * c[2 * i + 1] + b * c[2 * i];
                    a = a2, b = b2;
                }
                dst[2 * i] = cas_f32_to_bf16(a);
                dst[2 * i + 1] = cas_f32_to_bf16(b);
            }
        }
        for (int32_t e = 0; slot[t] >= 0 && e < KD; e++) vp[slot[t] * KD + e] = cas_f32_to_bf16(row[QD + KD + e]);
    }
    return 0;
}

int cas_gpu_silu_mul(const float *gu, void *h, int32_t T, int32_t F, void *stream) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < F; j++) {
            const float g = gu[t * 2 * F + j], u = gu[t * 2 * F + F + j];
            ((uint16_t *)h)[t * F + j] = cas_f32_to_bf16(g / (1.0f + expf(-g)) * u);
        }
    return 0;
}

int cas_gpu_to_bf16(const float *x, void *out, int64_t n, void *stream) {
    for (int64_t i = 0; i < n; i++) ((uint16_t *)out)[i] = cas_f32_to_bf16(x[i]);
    return 0;
}

int cas_gpu_sample_rows(const float *logits, int32_t n_rows, int32_t V, const gpu_sample_row *rows, int32_t *out,
                        void *stream) {
    uint8_t *keep = malloc((size_t)V);
    sample_ref_wid *buf = malloc(sizeof *buf * (size_t)V);
    if (!keep || !buf) {
        free(keep);
        free(buf);
        return (int)cudaErrorMemoryAllocation;
    }
    for (int32_t r = 0; r < n_rows; r++) {
        const gpu_sample_row *p = &rows[r];
        out[r] = sample_ref(logits + (size_t)r * V, V, p->temperature, p->top_k, p->top_p, p->min_p, p->u, keep, buf);
    }
    free(keep);
    free(buf);
    return 0;
}

/* ---- the CUDA attention API, by the CPU attention on the same plan -------- */

struct cas_cuda_attn {
    cas_attn_shape shape;
    cas_cuda_attn_caps caps;
    cas_attn_plan *plan; /* the plan to run: the caller's (plan_from_cpu) or own */
    cas_attn_plan *own;  /* plan_flat's */
    float *q32;          /* [max_total_q][Hq][D] */
};

cas_status cas_cuda_attn_create(cas_cuda_attn **out, const cas_attn_shape *shape, const cas_cuda_attn_caps *caps,
                                const cas_cuda_attn_opts *opts) {
    cas_cuda_attn *a = calloc(1, sizeof *a);
    if (!a) return cas_error(CAS_ERR_NOMEM, "stand-in attention: out of memory");
    a->shape = *shape;
    a->caps = *caps;
    a->q32 = malloc(sizeof(float) * (size_t)caps->max_total_q * (size_t)shape->num_qo_heads * (size_t)shape->head_dim);
    if (!a->q32) {
        free(a);
        return cas_error(CAS_ERR_NOMEM, "stand-in attention: out of memory");
    }
    *out = a;
    return CAS_OK;
}

void cas_cuda_attn_destroy(cas_cuda_attn *a) {
    if (!a) return;
    cas_attn_plan_destroy(a->own);
    free(a->q32);
    free(a);
}

cas_status cas_cuda_attn_plan_from_cpu(cas_cuda_attn *a, const cas_attn_plan *plan) {
    cas_attn_pass_list l;
    cas_attn_plan_passes(plan, &l);
    if (l.total_q > a->caps.max_total_q || l.n_passes > a->caps.max_passes || l.n_tok_rows > a->caps.max_tok_rows ||
        l.n_page_ids > a->caps.max_page_ids)
        return cas_error(CAS_ERR_NOMEM, "stand-in attention: the plan exceeds the context's capacities");
    a->plan = (cas_attn_plan *)plan;
    return CAS_OK;
}

cas_status cas_cuda_attn_plan_flat(cas_cuda_attn *a, const cas_attn_batch *batch, int32_t num_pages,
                                   const cas_attn_params *params) {
    cas_attn_plan_destroy(a->own);
    a->own = NULL;
    cas_attn_plan_opts po = cas_attn_plan_opts_default();
    po.cascade = CAS_CASCADE_OFF;
    po.threads = 1;
    cas_status st = cas_attn_plan_create(&a->own, &a->shape, &po, batch->batch, 0, 0);
    if (!st) st = cas_attn_plan_build(a->own, batch, num_pages, params);
    a->plan = st ? NULL : a->own;
    return st;
}

cas_status cas_cuda_attn_upload(cas_cuda_attn *a, cudaStream_t stream) { return CAS_OK; }

cas_status cas_cuda_attn_run(cas_cuda_attn *a, const void *k, const void *v, const void *q, float *o, float *lse,
                             cudaStream_t stream) {
    if (!a->plan) return cas_error(CAS_ERR_INVALID, "stand-in attention: no plan");
    cas_attn_pass_list l;
    cas_attn_plan_passes(a->plan, &l);
    const int64_t n = (int64_t)l.total_q * a->shape.num_qo_heads * a->shape.head_dim;
    for (int64_t i = 0; i < n; i++) a->q32[i] = bf(((const uint16_t *)q)[i]);
    const cas_kv_pool pool = {k, v, l.num_pages};
    /* the ranks of tensor parallelism run one CPU plan, whose scratch is its own: one at a time */
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&mu);
    const cas_status st = cas_attn_plan_run(a->plan, &pool, a->q32, o, lse);
    pthread_mutex_unlock(&mu);
    return st;
}

cas_attn_cost cas_cuda_attn_cost(void) { return cas_attn_cost_default(); }
