/*
 * gpu_model.c: the Llama-family forward on the GPU, host side (C11): loading
 * the weights to the device, the paged K/V pools, and one forward pass that
 * enqueues the kernels of gpu_kernels.cu, cuBLASLt's products and the CUDA
 * attention backend's run on one stream.
 *
 * Why it is built this way:
 * - Weights are bf16 on the device, converted there from the file's blocks
 *   (the file is read once, each tensor copied through one staging buffer),
 *   so that the products are cuBLASLt's bf16 ones with f32 accumulation; the
 *   query, key and value matrices lie side by side, and so do the gate and up
 *   matrices: one product each.
 * - The residual stream x stays f32 on the device; the attention output and
 *   the down projection add into it through the products' beta = 1.
 * - A step's inputs (token ids, positions, K/V slots, logit rows) go up in
 *   one copy from pinned staging into fixed device buffers, and the buffers
 *   of every activation are sized at create from the options: a forward
 *   allocates nothing (the CUDA graphs of decode steps need exactly that).
 * - The cascade plan is the CPU planner's (with the GPU cost model) turned
 *   into the CUDA backend's tasks once per forward; every layer runs it. A
 *   plan over the CUDA context's capacities falls back to a flat plan of the
 *   same batch, which always fits.
 */
#include "gpu.h"

cas_gpu_opts cas_gpu_opts_default(void) {
    cas_gpu_opts o;
    o.device = 0;
    o.max_batch_tokens = 512;
    o.max_seqs = 64;
    o.max_logits = 0;
    o.max_pages_per_seq = 8192;
    o.cascade = CAS_CASCADE_AUTO;
    o.graphs = 1;
    return o;
}

#if CAS_WITH_CUDA

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda/cuda_attn.h"
#include "gpu_impl.h"

/* ---- the model ------------------------------------------------------------ */

typedef struct {
    void *wqkv;    /* bf16 [QD + 2 KD][E] */
    void *wo;      /* bf16 [E][QD] */
    void *wgu;     /* bf16 [2 F][E] */
    void *wdown;   /* bf16 [E][F] */
    float *attn_norm, *ffn_norm; /* [E] */
} gpu_layer;

/* a decode step's graph for batches padded to t rows */
typedef struct {
    int32_t t;
    cudaGraphExec_t exec;
} gpu_graph;

/* a cached cuBLASLt choice for one product shape */
typedef struct {
    int32_t n, k, t, beta1;
    cublasLtMatmulAlgo_t algo;
} gemm_algo;
#define GEMM_CACHE 64

struct cas_gpu_model {
    cas_model_config cfg;
    cas_gpu_opts opts;
    char device_name[256];
    size_t bytes;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_work;
    size_t lt_work_bytes;
    gemm_algo algos[GEMM_CACHE];
    int n_algos, next_algo;

    /* weights */
    void *tok_embd;   /* bf16 [V][E] */
    void *output;     /* bf16 [V][E]: tok_embd when tied */
    float *out_norm;  /* [E] */
    float *inv_freq;  /* [n_rot / 2] */
    gpu_layer *layers;
    void *weights;    /* one allocation holding all of the above */

    /* a step's inputs: pinned staging and its device copy, one block */
    char *in_host, *in_dev;
    size_t in_bytes;
    int32_t *d_tokens, *d_pos, *d_rows;
    int64_t *d_slot;
    gpu_sample_row *d_samp;
    int32_t *h_tokens, *h_pos, *h_rows;
    int64_t *h_slot;
    gpu_sample_row *h_samp;
    /* sampled tokens: device and pinned host */
    int32_t *d_out, *h_out;

    /* activations */
    float *x;        /* [T][E] residual stream */
    void *xb;        /* bf16 [T][max(E, F)] normed input of a product, or the SwiGLU output */
    float *qkv;      /* [T][QD + 2 KD], also [T][2 F] of the gate and up product */
    void *q;         /* bf16 [T][QD] */
    float *att;      /* [T][QD] */
    float *lse;      /* [T][Hq] */
    void *attb;      /* bf16 [T][QD] */
    float *cs;       /* [T][n_rot / 2][2] */
    void *xl;        /* bf16 [L][E] */
    float *logits;   /* [L][V] */
    void *act;       /* one allocation holding the activations */

    /* attention */
    cas_attn_plan *plan;
    cas_attn_shape plan_shape;
    cas_cuda_attn *attn;
    int32_t attn_page_size;

    /* decode steps' graphs, valid for these pools and attention context */
    gpu_graph *graphs;
    int32_t n_graphs;
    const void *graph_kv;
    const cas_cuda_attn *graph_attn;
    int capture_failed; /* the runtime could not capture: padded steps run eagerly */
    cas_gpu_graph_info graph_info;
};

int cas_gpu_built(void) { return 1; }

int cas_gpu_available(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define CU(call)                                                                                 \
    do {                                                                                         \
        cudaError_t e_ = (call);                                                                 \
        if (e_ != cudaSuccess) {                                                                 \
            st = cas_error(e_ == cudaErrorMemoryAllocation ? CAS_ERR_NOMEM : CAS_ERR_INTERNAL,   \
                           "gpu: %s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            goto fail;                                                                           \
        }                                                                                        \
    } while (0)
#define KL(call)                                                                                  \
    do {                                                                                          \
        int e_ = (call);                                                                          \
        if (e_) {                                                                                 \
            st = cas_error(CAS_ERR_INTERNAL, "gpu: %s:%d: %s: %s", __FILE__, __LINE__, #call,    \
                           cudaGetErrorString((cudaError_t)e_));                                  \
            goto fail;                                                                            \
        }                                                                                         \
    } while (0)

static void graphs_drop(cas_gpu_model *m) {
    for (int32_t i = 0; i < m->n_graphs; i++) cudaGraphExecDestroy(m->graphs[i].exec);
    m->n_graphs = 0;
}

void cas_gpu_model_destroy(cas_gpu_model *m) {
    if (!m) return;
    if (m->stream) cudaStreamSynchronize(m->stream);
    graphs_drop(m);
    free(m->graphs);
    cas_cuda_attn_destroy(m->attn);
    cas_attn_plan_destroy(m->plan);
    if (m->act) cudaFree(m->act);
    if (m->in_dev) cudaFree(m->in_dev);
    if (m->in_host) cudaFreeHost(m->in_host);
    if (m->weights) cudaFree(m->weights);
    if (m->lt_work) cudaFree(m->lt_work);
    if (m->lt) cublasLtDestroy(m->lt);
    if (m->stream) cudaStreamDestroy(m->stream);
    free(m->layers);
    free(m);
}

/* the file types the conversion kernels read */
static int type_converts(int t) {
    return t == CAS_T_F32 || t == CAS_T_F16 || t == CAS_T_BF16 || t == CAS_T_Q8_0 || t == CAS_T_Q4_0 ||
           t == CAS_T_Q4_1;
}

/* A 2-D weight of the expected shape and a type the kernels convert. */
static cas_status find_weight(const cas_gguf *g, const char *name, int64_t rows, int64_t cols,
                              const cas_gguf_tensor **out) {
    const cas_gguf_tensor *t = cas_gguf_find_tensor(g, name);
    if (!t) return cas_error(CAS_ERR_FORMAT, "gpu: tensor %s is missing", name);
    if (!type_converts(t->type))
        return cas_error(CAS_ERR_UNSUPPORTED,
                         "gpu: tensor %s has type %s, which the GPU path cannot convert "
                         "(supported: f32, f16, bf16, q8_0, q4_0, q4_1)",
                         name, cas_ttype_name(t->type) ? cas_ttype_name(t->type) : "?");
    if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != 1 || t->ne[3] != 1)
        return cas_error(CAS_ERR_FORMAT, "gpu: tensor %s is %lld x %lld, expected %lld x %lld", name,
                         (long long)t->ne[1], (long long)t->ne[0], (long long)rows, (long long)cols);
    *out = t;
    return CAS_OK;
}

/* Copies a weight's blocks through the staging buffer and converts them
 * into dst (bf16, rows x cols, row r at dst + r * cols elements). */
static cas_status upload_mat(cas_gpu_model *m, const cas_gguf_tensor *t, void *dst, void *stage, size_t stage_bytes) {
    cas_status st = CAS_OK;
    if (t->nbytes > stage_bytes) return cas_error(CAS_ERR_INTERNAL, "gpu: staging for %s too small", t->name);
    /* on the kernel's stream: a plain cudaMemcpy from pageable memory may
     * return before its DMA lands, and the non-blocking stream would not wait */
    CU(cudaMemcpyAsync(stage, t->data, t->nbytes, cudaMemcpyHostToDevice, m->stream));
    KL(cas_gpu_dequant_bf16(t->type, stage, dst, t->ne[1], t->ne[0], t->ne[0], m->stream));
    CU(cudaStreamSynchronize(m->stream));
fail:
    return st;
}

static cas_status upload_vec(cas_gpu_model *m, const cas_gguf *g, const char *name, int64_t n, float *dst) {
    cas_status st = CAS_OK;
    const cas_gguf_tensor *t = cas_gguf_find_tensor(g, name);
    if (!t) return cas_error(CAS_ERR_FORMAT, "gpu: tensor %s is missing", name);
    if (t->n_elem != n || t->ne[0] != n)
        return cas_error(CAS_ERR_FORMAT, "gpu: tensor %s has %lld elements, expected %lld", name,
                         (long long)t->n_elem, (long long)n);
    if (t->type == CAS_T_F32) {
        CU(cudaMemcpyAsync(dst, t->data, (size_t)n * 4, cudaMemcpyHostToDevice, m->stream));
        CU(cudaStreamSynchronize(m->stream));
    } else if (t->type == CAS_T_F16 || t->type == CAS_T_BF16) {
        /* staged in cuBLASLt's workspace (idle while loading): converting in
         * place would let one thread's write overtake another's read */
        if ((size_t)n * 2 > m->lt_work_bytes) return cas_error(CAS_ERR_UNSUPPORTED, "gpu: norm %s is too long", name);
        CU(cudaMemcpyAsync(m->lt_work, t->data, (size_t)n * 2, cudaMemcpyHostToDevice, m->stream));
        KL(cas_gpu_to_f32(t->type, m->lt_work, dst, n, m->stream));
        CU(cudaStreamSynchronize(m->stream));
    } else {
        return cas_error(CAS_ERR_UNSUPPORTED, "gpu: norm %s has type %s", name,
                         cas_ttype_name(t->type) ? cas_ttype_name(t->type) : "?");
    }
fail:
    return st;
}

#define ALIGN256(x) (((x) + 255) & ~(size_t)255)

/* The model's handles and one allocation for all weights, laid out (the
 * contents are the caller's to fill): checks the options and the device. */
static cas_status model_begin(const cas_gpu_opts *opts_in, const cas_model_config *cfg, int has_output,
                              cas_gpu_model **out) {
    *out = NULL;
    cas_gpu_opts o = opts_in ? *opts_in : cas_gpu_opts_default();
    if (o.max_batch_tokens <= 0 || o.max_seqs <= 0 || o.max_logits < 0 || o.max_pages_per_seq <= 0)
        return cas_error(CAS_ERR_INVALID, "gpu: invalid options (max_batch_tokens %d, max_seqs %d, max_logits %d, "
                         "max_pages_per_seq %d)", o.max_batch_tokens, o.max_seqs, o.max_logits, o.max_pages_per_seq);
    if (o.max_logits == 0) o.max_logits = o.max_seqs;
    if (o.max_seqs > o.max_batch_tokens) o.max_seqs = o.max_batch_tokens;
    if (o.max_logits > o.max_batch_tokens) o.max_logits = o.max_batch_tokens;
    if (cfg->head_dim != 64 && cfg->head_dim != 96 && cfg->head_dim != 128 && cfg->head_dim != 256)
        return cas_error(CAS_ERR_UNSUPPORTED, "gpu: head_dim %d (the CUDA attention runs 64, 96, 128, 256)",
                         cfg->head_dim);
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0)
        return cas_error(CAS_ERR_UNSUPPORTED, "gpu: no CUDA device");
    if (o.device < 0 || o.device >= ndev)
        return cas_error(CAS_ERR_INVALID, "gpu: device %d (this machine has %d)", o.device, ndev);

    cas_gpu_model *m = calloc(1, sizeof *m);
    if (!m) return cas_error(CAS_ERR_NOMEM, "gpu: out of host memory");
    m->opts = o;
    m->cfg = *cfg;
    cas_status st = CAS_OK;
    const cas_model_config *c = &m->cfg;
    const int64_t E = c->n_embd, F = c->n_ff, V = c->n_vocab, QD = (int64_t)c->n_head * c->head_dim,
                  KD = (int64_t)c->n_head_kv * c->head_dim, L = c->n_layers;
    CU(cudaSetDevice(o.device));
    {
        struct cudaDeviceProp p;
        CU(cudaGetDeviceProperties(&p, o.device));
        snprintf(m->device_name, sizeof m->device_name, "%s", p.name);
    }
    CU(cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking));
    if (cublasLtCreate(&m->lt) != CUBLAS_STATUS_SUCCESS) {
        st = cas_error(CAS_ERR_INTERNAL, "gpu: cublasLtCreate failed");
        m->lt = NULL;
        goto fail;
    }
    m->lt_work_bytes = (size_t)32 << 20;
    CU(cudaMalloc(&m->lt_work, m->lt_work_bytes));
    m->layers = calloc((size_t)L, sizeof *m->layers);
    m->graphs = calloc((size_t)(4 + o.max_seqs / 8), sizeof *m->graphs);
    if (!m->layers || !m->graphs) {
        st = cas_error(CAS_ERR_NOMEM, "gpu: out of host memory");
        goto fail;
    }
    const size_t mat_qkv = ALIGN256((size_t)(QD + 2 * KD) * E * 2), mat_o = ALIGN256((size_t)E * QD * 2),
                 mat_gu = ALIGN256((size_t)2 * F * E * 2), mat_d = ALIGN256((size_t)E * F * 2),
                 vec = ALIGN256((size_t)E * 4), vocab = ALIGN256((size_t)V * E * 2);
    const size_t total = vocab + (has_output ? vocab : 0) + vec + ALIGN256((size_t)c->n_rot / 2 * 4) +
                         (size_t)L * (mat_qkv + mat_o + mat_gu + mat_d + 2 * vec);
    {
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        cudaError_t e = cudaMalloc(&m->weights, total);
        if (e != cudaSuccess) {
            cudaGetLastError();
            m->weights = NULL;
            st = cas_error(CAS_ERR_NOMEM,
                           "gpu: the weights need %.1f GiB of device memory, %.1f GiB of the %.1f GiB are free",
                           (double)total / 1073741824.0, (double)free_b / 1073741824.0,
                           (double)total_b / 1073741824.0);
            goto fail;
        }
    }
    m->bytes += total;
    char *w = m->weights;
    m->tok_embd = w, w += vocab;
    m->output = has_output ? (void *)w : m->tok_embd;
    if (has_output) w += vocab;
    m->out_norm = (float *)w, w += vec;
    m->inv_freq = (float *)w, w += ALIGN256((size_t)c->n_rot / 2 * 4);
    for (int64_t l = 0; l < L; l++) {
        gpu_layer *ly = &m->layers[l];
        ly->wqkv = w, w += mat_qkv;
        ly->wo = w, w += mat_o;
        ly->wgu = w, w += mat_gu;
        ly->wdown = w, w += mat_d;
        ly->attn_norm = (float *)w, w += vec;
        ly->ffn_norm = (float *)w, w += vec;
    }
    *out = m;
    return CAS_OK;
fail:
    cas_gpu_model_destroy(m);
    return st;
}

/* The RoPE frequencies (cas_model_rope_freqs: g holds rope_freqs.weight
 * where the config names it; NULL for a synthetic model) and the fixed
 * buffers of one forward (a step's inputs, the activations); on failure the
 * caller destroys m. */
static cas_status model_finish(cas_gpu_model *m, const cas_gguf *g) {
    cas_status st = CAS_OK;
    const cas_model_config *c = &m->cfg;
    const cas_gpu_opts o = m->opts;
    const int64_t E = c->n_embd, F = c->n_ff, V = c->n_vocab, QD = (int64_t)c->n_head * c->head_dim,
                  KD = (int64_t)c->n_head_kv * c->head_dim;
    {
        /* RoPE frequencies, the CPU's */
        const int32_t half = c->n_rot / 2;
        float *f = malloc(sizeof(float) * (size_t)(half > 0 ? half : 1));
        if (!f) return cas_error(CAS_ERR_NOMEM, "gpu: out of host memory");
        if ((st = cas_model_rope_freqs(g, c, f))) {
            free(f);
            return st;
        }
        cudaError_t e = cudaMemcpyAsync(m->inv_freq, f, sizeof(float) * (size_t)half, cudaMemcpyHostToDevice, m->stream);
        if (e == cudaSuccess) e = cudaStreamSynchronize(m->stream);
        free(f);
        CU(e);
    }
    /* a step's inputs and the activations */
    const int64_t T = o.max_batch_tokens, NL = o.max_logits, half = c->n_rot / 2;
    const size_t in_a = ALIGN256((size_t)T * 4), in_s = ALIGN256((size_t)T * 8),
                 in_r = ALIGN256((size_t)NL * sizeof(gpu_sample_row));
    m->in_bytes = in_a * 3 + in_s + in_r;
    CU(cudaMallocHost((void **)&m->in_host, m->in_bytes + ALIGN256((size_t)NL * 4)));
    CU(cudaMalloc((void **)&m->in_dev, m->in_bytes + ALIGN256((size_t)NL * 4)));
    m->h_tokens = (int32_t *)m->in_host, m->d_tokens = (int32_t *)m->in_dev;
    m->h_pos = (int32_t *)(m->in_host + in_a), m->d_pos = (int32_t *)(m->in_dev + in_a);
    m->h_rows = (int32_t *)(m->in_host + 2 * in_a), m->d_rows = (int32_t *)(m->in_dev + 2 * in_a);
    m->h_slot = (int64_t *)(m->in_host + 3 * in_a), m->d_slot = (int64_t *)(m->in_dev + 3 * in_a);
    m->h_samp = (gpu_sample_row *)(m->in_host + 3 * in_a + in_s);
    m->d_samp = (gpu_sample_row *)(m->in_dev + 3 * in_a + in_s);
    /* the outputs, past the inputs (not part of the step's one upload) */
    m->h_out = (int32_t *)(m->in_host + m->in_bytes), m->d_out = (int32_t *)(m->in_dev + m->in_bytes);
    const int64_t W = QD + 2 * KD > 2 * F ? QD + 2 * KD : 2 * F, XB = E > F ? E : F;
    const size_t sz[10] = {ALIGN256((size_t)T * E * 4),  ALIGN256((size_t)T * XB * 2),
                           ALIGN256((size_t)T * W * 4),  ALIGN256((size_t)T * QD * 2),
                           ALIGN256((size_t)T * QD * 4), ALIGN256((size_t)T * c->n_head * 4),
                           ALIGN256((size_t)T * QD * 2), ALIGN256((size_t)T * half * 2 * 4),
                           ALIGN256((size_t)NL * E * 2), ALIGN256((size_t)NL * V * 4)};
    size_t act = 0;
    for (int i = 0; i < 10; i++) act += sz[i];
    {
        cudaError_t e = cudaMalloc(&m->act, act);
        if (e != cudaSuccess) {
            cudaGetLastError();
            m->act = NULL;
            return cas_error(CAS_ERR_NOMEM, "gpu: the activations of %lld tokens need %.1f MiB of device memory",
                             (long long)T, (double)act / 1048576.0);
        }
    }
    /* zeroed: a padded row of a graph's batch reads attention rows no plan wrote */
    CU(cudaMemsetAsync(m->act, 0, act, m->stream));
    CU(cudaStreamSynchronize(m->stream));
    m->bytes += act;
    char *a = m->act;
    m->x = (float *)a, a += sz[0];
    m->xb = a, a += sz[1];
    m->qkv = (float *)a, a += sz[2];
    m->q = a, a += sz[3];
    m->att = (float *)a, a += sz[4];
    m->lse = (float *)a, a += sz[5];
    m->attb = a, a += sz[6];
    m->cs = (float *)a, a += sz[7];
    m->xl = a, a += sz[8];
    m->logits = (float *)a;
fail:
    return st;
}

cas_status cas_gpu_model_create(const cas_gguf *g, const cas_gpu_opts *opts_in, cas_gpu_model **out) {
    if (!g || !out) return cas_error(CAS_ERR_INVALID, "gpu: NULL argument");
    *out = NULL;
    cas_model_config cfg;
    cas_status st = cas_model_config_read(g, &cfg);
    if (st) return st;
    /* the GPU forward is the plain Llama block (RoPE frequency factors and linear scaling
     * included): the other architectures' additions run on the CPU */
    if (cfg.arch != CAS_ARCH_LLAMA || cfg.qkv_bias || cfg.qk_norm || cfg.sliding_window)
        return cas_error(CAS_ERR_UNSUPPORTED, "gpu: %s is not run on the GPU (--device cpu runs it)",
                         cfg.arch != CAS_ARCH_LLAMA ? cas_model_arch_name(cfg.arch)
                         : cfg.qkv_bias             ? "a model with Q/K/V biases"
                         : cfg.qk_norm              ? "a model with Q/K norms"
                                                    : "a sliding attention window");
    const int64_t E = cfg.n_embd, F = cfg.n_ff, V = cfg.n_vocab, QD = (int64_t)cfg.n_head * cfg.head_dim,
                  KD = (int64_t)cfg.n_head_kv * cfg.head_dim, L = cfg.n_layers;
    /* every tensor checked before anything is allocated */
    const cas_gguf_tensor *te = NULL, *tout = NULL, *t = NULL;
    if ((st = find_weight(g, "token_embd.weight", V, E, &te))) return st;
    if (!cfg.tied_embeddings && (st = find_weight(g, "output.weight", V, E, &tout))) return st;
    size_t stage_bytes = te->nbytes;
    if (tout && tout->nbytes > stage_bytes) stage_bytes = tout->nbytes;
    static const char *names[7] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"};
    for (int64_t l = 0; l < L; l++) {
        const int64_t rows[7] = {QD, KD, KD, E, F, F, E}, cols[7] = {E, E, E, QD, E, E, F};
        for (int k = 0; k < 7; k++) {
            char name[96];
            snprintf(name, sizeof name, "blk.%d.%s.weight", (int)l, names[k]);
            if ((st = find_weight(g, name, rows[k], cols[k], &t))) return st;
            if (t->nbytes > stage_bytes) stage_bytes = t->nbytes;
        }
    }
    cas_gpu_model *m = NULL;
    if ((st = model_begin(opts_in, &cfg, tout != NULL, &m))) return st;
    void *stage = NULL;
    CU(cudaMalloc(&stage, stage_bytes));
    if ((st = upload_mat(m, te, m->tok_embd, stage, stage_bytes))) goto fail;
    if (tout && (st = upload_mat(m, tout, m->output, stage, stage_bytes))) goto fail;
    if ((st = upload_vec(m, g, "output_norm.weight", E, m->out_norm))) goto fail;
    for (int64_t l = 0; l < L; l++) {
        gpu_layer *ly = &m->layers[l];
        char name[96];
#define NAME(s) (snprintf(name, sizeof name, "blk.%d." s, (int)l), name)
#define MAT(s, rows, cols, dst)                                                   \
    do {                                                                          \
        if ((st = find_weight(g, NAME(s), rows, cols, &t))) goto fail;            \
        if ((st = upload_mat(m, t, dst, stage, stage_bytes))) goto fail;          \
    } while (0)
        MAT("attn_q.weight", QD, E, ly->wqkv);
        MAT("attn_k.weight", KD, E, (char *)ly->wqkv + (size_t)QD * E * 2);
        MAT("attn_v.weight", KD, E, (char *)ly->wqkv + (size_t)(QD + KD) * E * 2);
        MAT("attn_output.weight", E, QD, ly->wo);
        MAT("ffn_gate.weight", F, E, ly->wgu);
        MAT("ffn_up.weight", F, E, (char *)ly->wgu + (size_t)F * E * 2);
        MAT("ffn_down.weight", E, F, ly->wdown);
        if ((st = upload_vec(m, g, NAME("attn_norm.weight"), E, ly->attn_norm))) goto fail;
        if ((st = upload_vec(m, g, NAME("ffn_norm.weight"), E, ly->ffn_norm))) goto fail;
#undef MAT
#undef NAME
    }
    cudaFree(stage);
    stage = NULL;
    if ((st = model_finish(m, g))) goto fail;
    *out = m;
    return CAS_OK;
fail:
    if (stage) cudaFree(stage);
    cas_gpu_model_destroy(m);
    return st;
}

cas_status cas_gpu_model_create_synthetic(const cas_model_config *cfg, uint64_t seed, const cas_gpu_opts *opts,
                                          cas_gpu_model **out) {
    if (!cfg || !out) return cas_error(CAS_ERR_INVALID, "gpu: NULL argument");
    *out = NULL;
    if (cfg->n_layers <= 0 || cfg->n_embd <= 0 || cfg->n_ff <= 0 || cfg->n_head <= 0 || cfg->n_head_kv <= 0 ||
        cfg->head_dim <= 0 || cfg->n_head % cfg->n_head_kv || cfg->n_vocab <= 0 || cfg->n_rot <= 0 ||
        cfg->n_rot > cfg->head_dim || cfg->n_rot % 2)
        return cas_error(CAS_ERR_INVALID, "gpu: synthetic model shape out of range");
    cas_gpu_model *m = NULL;
    cas_status st = model_begin(opts, cfg, !cfg->tied_embeddings, &m);
    if (st) return st;
    const int64_t E = cfg->n_embd, F = cfg->n_ff, V = cfg->n_vocab, QD = (int64_t)cfg->n_head * cfg->head_dim,
                  KD = (int64_t)cfg->n_head_kv * cfg->head_dim;
    /* uniform in [-a, a] with a = sqrt(3 / inputs): unit variance in, unit variance out */
    uint64_t stream_id = seed * 0x9e3779b97f4a7c15ull;
#define FILL(dst, n, inputs) KL(cas_gpu_fill_uniform_bf16(dst, (int64_t)(n), sqrtf(3.0f / (float)(inputs)), stream_id++, m->stream))
    FILL(m->tok_embd, V * E, 1);
    if (m->output != m->tok_embd) FILL(m->output, V * E, E);
    KL(cas_gpu_fill_f32(m->out_norm, E, 1.0f, m->stream));
    for (int32_t l = 0; l < cfg->n_layers; l++) {
        gpu_layer *ly = &m->layers[l];
        FILL(ly->wqkv, (QD + 2 * KD) * E, E);
        FILL(ly->wo, E * QD, QD);
        FILL(ly->wgu, 2 * F * E, E);
        FILL(ly->wdown, E * F, F);
        KL(cas_gpu_fill_f32(ly->attn_norm, E, 1.0f, m->stream));
        KL(cas_gpu_fill_f32(ly->ffn_norm, E, 1.0f, m->stream));
    }
#undef FILL
    CU(cudaStreamSynchronize(m->stream));
    if ((st = model_finish(m, NULL))) goto fail;
    *out = m;
    return CAS_OK;
fail:
    cas_gpu_model_destroy(m);
    return st;
}

const cas_model_config *cas_gpu_model_config(const cas_gpu_model *m) { return &m->cfg; }
size_t cas_gpu_model_bytes(const cas_gpu_model *m) { return m->bytes; }
const char *cas_gpu_model_device_name(const cas_gpu_model *m) { return m ? m->device_name : "none"; }
cas_status cas_gpu_mem_info(const cas_gpu_model *m, size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = 0;
    cudaError_t e = cudaSetDevice(m->opts.device);
    if (e == cudaSuccess) e = cudaMemGetInfo(free_bytes, total_bytes);
    if (e != cudaSuccess) return cas_error(CAS_ERR_INTERNAL, "gpu: cudaMemGetInfo: %s", cudaGetErrorString(e));
    return CAS_OK;
}

void cas_gpu_model_set_cascade(cas_gpu_model *m, cas_cascade_mode mode) {
    m->opts.cascade = mode;
    cas_attn_plan_destroy(m->plan); /* the next forward plans with the new mode */
    m->plan = NULL;
}

/* ---- the K/V store ------------------------------------------------------- */

struct cas_gpu_kv {
    int32_t num_pages, page_size, n_layers;
    size_t layer_bytes; /* one pool of one layer */
    void *mem;          /* [n_layers][K, V][num_pages][page_size][n_head_kv][head_dim] bf16 */
};

static size_t kv_page_bytes(const cas_gpu_model *m, int32_t page_size) {
    return (size_t)page_size * (size_t)m->cfg.n_head_kv * (size_t)m->cfg.head_dim * 2;
}

int32_t cas_gpu_kv_pages_for_budget(const cas_gpu_model *m, int32_t page_size, size_t budget_bytes) {
    if (!m || page_size <= 0) return 0;
    const size_t per = 2 * kv_page_bytes(m, page_size) * (size_t)m->cfg.n_layers;
    const size_t n = budget_bytes / per;
    return n > INT32_MAX ? INT32_MAX : (int32_t)n;
}

cas_status cas_gpu_kv_create(const cas_gpu_model *m, int32_t num_pages, int32_t page_size, cas_gpu_kv **out) {
    if (!m || !out) return cas_error(CAS_ERR_INVALID, "gpu kv: NULL argument");
    *out = NULL;
    if (num_pages <= 0 || page_size < 1 || page_size > CAS_ATTN_MAX_PAGE_SIZE)
        return cas_error(CAS_ERR_INVALID, "gpu kv: %d pages of %d tokens", num_pages, page_size);
    cas_gpu_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return cas_error(CAS_ERR_NOMEM, "gpu kv: out of host memory");
    kv->num_pages = num_pages;
    kv->page_size = page_size;
    kv->n_layers = m->cfg.n_layers;
    kv->layer_bytes = kv_page_bytes(m, page_size) * (size_t)num_pages;
    const size_t total = 2 * kv->layer_bytes * (size_t)kv->n_layers;
    cudaError_t e = cudaMalloc(&kv->mem, total);
    if (e != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        cudaGetLastError();
        cudaMemGetInfo(&free_b, &total_b);
        free(kv);
        return cas_error(CAS_ERR_NOMEM, "gpu kv: %d pages need %.1f MiB of device memory, %.1f MiB are free",
                         num_pages, (double)total / 1048576.0, (double)free_b / 1048576.0);
    }
    /* finished before any forward's stream touches the pools */
    if ((e = cudaMemset(kv->mem, 0, total)) != cudaSuccess || (e = cudaDeviceSynchronize()) != cudaSuccess) {
        cudaFree(kv->mem);
        free(kv);
        return cas_error(CAS_ERR_INTERNAL, "gpu kv: cudaMemset: %s", cudaGetErrorString(e));
    }
    *out = kv;
    return CAS_OK;
}

void cas_gpu_kv_destroy(cas_gpu_kv *kv) {
    if (!kv) return;
    if (kv->mem) cudaFree(kv->mem);
    free(kv);
}

int32_t cas_gpu_kv_num_pages(const cas_gpu_kv *kv) { return kv->num_pages; }
size_t cas_gpu_kv_bytes(const cas_gpu_kv *kv) { return 2 * kv->layer_bytes * (size_t)kv->n_layers; }

/* ---- matrix products ---------------------------------------------------- */

/* C[t][n] = A[t][:] . W[n][:] (+ C when beta1), t < T, n < N, over K: bf16
 * operands, f32 accumulation and output. Column-major for cuBLASLt: C is N x
 * T (ld N) = W^T (W is K x N col-major, ld K) times A (K x T, ld K). */
static cas_status gemm(cas_gpu_model *m, const void *W, const void *A, float *C, int32_t N, int32_t K, int32_t T,
                       int beta1) {
    cublasLtMatmulDescOpaque_t dop;
    cublasLtMatrixLayoutOpaque_t lw, la, lc;
    cublasLtMatmulDesc_t desc = (cublasLtMatmulDesc_t)&dop;
    cublasLtMatrixLayout_t Lw = (cublasLtMatrixLayout_t)&lw, La = (cublasLtMatrixLayout_t)&la,
                           Lc = (cublasLtMatrixLayout_t)&lc;
    const cublasOperation_t tr = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    if (cublasLtMatmulDescInit(desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof nt) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutInit(Lw, CUDA_R_16BF, (uint64_t)K, (uint64_t)N, K) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutInit(La, CUDA_R_16BF, (uint64_t)K, (uint64_t)T, K) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutInit(Lc, CUDA_R_32F, (uint64_t)N, (uint64_t)T, N) != CUBLAS_STATUS_SUCCESS)
        return cas_error(CAS_ERR_INTERNAL, "gpu: cuBLASLt descriptors for %d x %d x %d", N, K, T);
    /* the algorithm for this shape, chosen once */
    gemm_algo *ga = NULL;
    for (int i = 0; i < m->n_algos && !ga; i++)
        if (m->algos[i].n == N && m->algos[i].k == K && m->algos[i].t == T && m->algos[i].beta1 == beta1)
            ga = &m->algos[i];
    if (!ga) {
        cublasLtMatmulPreferenceOpaque_t pop;
        cublasLtMatmulPreference_t pref = (cublasLtMatmulPreference_t)&pop;
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        if (cublasLtMatmulPreferenceInit(pref) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &m->lt_work_bytes,
                                                 sizeof m->lt_work_bytes) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoGetHeuristic(m->lt, desc, Lw, La, Lc, Lc, pref, 1, &res, &found) !=
                CUBLAS_STATUS_SUCCESS ||
            found < 1)
            return cas_error(CAS_ERR_INTERNAL, "gpu: no cuBLASLt algorithm for %d x %d x %d", N, K, T);
        ga = &m->algos[m->n_algos < GEMM_CACHE ? m->n_algos++ : (m->next_algo++ % GEMM_CACHE)];
        ga->n = N, ga->k = K, ga->t = T, ga->beta1 = beta1;
        ga->algo = res.algo;
    }
    const float one = 1.f, beta = beta1 ? 1.f : 0.f;
    cublasStatus_t s = cublasLtMatmul(m->lt, desc, &one, W, Lw, A, La, &beta, C, Lc, C, Lc, &ga->algo, m->lt_work,
                                      m->lt_work_bytes, m->stream);
    if (s != CUBLAS_STATUS_SUCCESS)
        return cas_error(CAS_ERR_INTERNAL, "gpu: cublasLtMatmul %d x %d x %d failed (%d)", N, K, T, (int)s);
    return CAS_OK;
}

/* ---- the forward pass --------------------------------------------------- */

/* The attention context for pools of this page size, made once (the
 * capacities cover any batch the model's options allow). */
static cas_status attn_ready(cas_gpu_model *m, int32_t page_size) {
    if (m->attn && m->attn_page_size == page_size) return CAS_OK;
    cas_cuda_attn_destroy(m->attn);
    m->attn = NULL;
    const cas_model_config *c = &m->cfg;
    const cas_attn_shape sh = {c->n_head, c->n_head_kv, c->head_dim, page_size, CAS_BF16};
    cas_cuda_attn_caps caps;
    memset(&caps, 0, sizeof caps);
    caps.max_total_q = m->opts.max_batch_tokens;
    caps.max_passes = 2 * m->opts.max_seqs;
    caps.max_tok_rows = 4 * m->opts.max_batch_tokens;
    caps.max_page_ids = (int64_t)m->opts.max_seqs * m->opts.max_pages_per_seq;
    caps.max_states = 16 * (int64_t)m->opts.max_batch_tokens;
    caps.device = m->opts.device;
    cas_status st = cas_cuda_attn_create(&m->attn, &sh, &caps, NULL);
    if (st) return st;
    m->attn_page_size = page_size;
    return CAS_OK;
}

/* Checks the batch, plans its attention and writes the step's inputs
 * (and the sampling rows, when given) into the pinned staging; *T is the
 * batch's tokens and *n_logits its logits rows. No device work. */
static cas_status forward_prepare(cas_gpu_model *m, cas_gpu_kv *kv, const cas_model_batch *b,
                                  const cas_gpu_sample *samp, int32_t *T_out, int32_t *n_logits) {
    if (!m || !kv || !b || b->n_seqs <= 0 || !b->tokens || !b->qo_indptr || !b->kv_indptr || !b->kv_indices ||
        !b->kv_last_page_len)
        return cas_error(CAS_ERR_INVALID, "gpu forward: empty batch or NULL array");
    const cas_model_config *c = &m->cfg;
    if (kv->n_layers != c->n_layers) return cas_error(CAS_ERR_INVALID, "gpu forward: the K/V store is another model's");
    const int32_t B = b->n_seqs;
    if (B > m->opts.max_seqs)
        return cas_error(CAS_ERR_NOMEM, "gpu forward: %d sequences, capacity %d", B, m->opts.max_seqs);
    if (b->qo_indptr[0] != 0) return cas_error(CAS_ERR_INVALID, "gpu forward: qo_indptr[0] != 0");
    for (int32_t r = 0; r < B; r++) {
        if (b->qo_indptr[r + 1] <= b->qo_indptr[r])
            return cas_error(CAS_ERR_INVALID, "gpu forward: sequence %d has no new tokens", r);
        if (b->kv_indptr[r + 1] - b->kv_indptr[r] > m->opts.max_pages_per_seq)
            return cas_error(CAS_ERR_NOMEM, "gpu forward: sequence %d has %d pages, capacity %d", r,
                             b->kv_indptr[r + 1] - b->kv_indptr[r], m->opts.max_pages_per_seq);
    }
    const int32_t T = b->qo_indptr[B];
    if (T > m->opts.max_batch_tokens)
        return cas_error(CAS_ERR_NOMEM, "gpu forward: %d tokens, capacity %d", T, m->opts.max_batch_tokens);
    int32_t NL = b->logit_rows ? b->n_logits : B;
    if (NL < 0 || NL > m->opts.max_logits)
        return cas_error(CAS_ERR_NOMEM, "gpu forward: %d rows of logits, capacity %d", NL, m->opts.max_logits);
    for (int32_t i = 0; i < NL; i++) {
        const int32_t r = b->logit_rows ? b->logit_rows[i] : b->qo_indptr[i + 1] - 1;
        if (r < 0 || r >= T)
            return cas_error(CAS_ERR_INVALID, "gpu forward: logit row %d is outside 0..%d", r, T - 1);
        m->h_rows[i] = r;
    }
    for (int32_t i = 0; samp && i < NL; i++) {
        const cas_gpu_sample *q = &samp[i];
        if (!(q->temperature >= 0.f) || q->top_k < 0 || !(q->top_p > 0.f && q->top_p <= 1.f) ||
            !(q->min_p >= 0.f && q->min_p <= 1.f) || !(q->u >= 0.f && q->u < 1.f))
            return cas_error(CAS_ERR_INVALID, "gpu forward: sampling row %d is out of range", i);
        m->h_samp[i] = (gpu_sample_row){q->temperature, q->top_k, q->top_p, q->min_p, q->u, 0};
    }
    for (int32_t t = 0; t < T; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= c->n_vocab)
            return cas_error(CAS_ERR_INVALID, "gpu forward: token id %d at row %d is outside the vocabulary",
                             b->tokens[t], t);

    /* the plan (validates page ids, lengths, q_len <= kv_len) */
    cas_status st = CAS_OK;
    /* the current device is per thread: the engine steps on a thread of its own */
    CU(cudaSetDevice(m->opts.device));
    const int32_t ps = kv->page_size;
    const cas_attn_shape shape = {c->n_head, c->n_head_kv, c->head_dim, ps, CAS_BF16};
    if (m->plan && memcmp(&m->plan_shape, &shape, sizeof shape) != 0) {
        cas_attn_plan_destroy(m->plan);
        m->plan = NULL;
    }
    if (!m->plan) {
        cas_attn_plan_opts po = cas_attn_plan_opts_default();
        po.cascade = m->opts.cascade;
        po.threads = 1;
        po.cost = cas_cuda_attn_cost();
        if ((st = cas_attn_plan_create(&m->plan, &shape, &po, m->opts.max_seqs, m->opts.max_batch_tokens, 0)))
            return st;
        m->plan_shape = shape;
    }
    if ((st = attn_ready(m, ps))) return st;
    const cas_attn_batch ab = {B, b->qo_indptr, b->kv_indptr, b->kv_indices, b->kv_last_page_len};
    const cas_attn_params ap = cas_attn_params_default();
    if ((st = cas_attn_plan_build(m->plan, &ab, kv->num_pages, &ap))) return st;
    st = cas_cuda_attn_plan_from_cpu(m->attn, m->plan);
    if (st == CAS_ERR_NOMEM) st = cas_cuda_attn_plan_flat(m->attn, &ab, kv->num_pages, &ap); /* always fits */
    if (st) return st;

    /* the step's inputs: tokens, positions, K/V slots, logit rows */
    for (int32_t r = 0; r < B; r++) {
        const int32_t np = b->kv_indptr[r + 1] - b->kv_indptr[r];
        const int64_t kv_len = (int64_t)(np - 1) * ps + b->kv_last_page_len[r];
        const int32_t q0 = b->qo_indptr[r], ql = b->qo_indptr[r + 1] - q0;
        for (int32_t i = 0; i < ql; i++) {
            const int64_t p = kv_len - ql + i;
            m->h_tokens[q0 + i] = b->tokens[q0 + i];
            m->h_pos[q0 + i] = (int32_t)p;
            m->h_slot[q0 + i] = (int64_t)b->kv_indices[b->kv_indptr[r] + p / ps] * ps + p % ps;
        }
    }
    *T_out = T;
    *n_logits = NL;
fail:
    return st;
}

/* The staged inputs and attention plan to the device, on the model's stream. */
static cas_status forward_upload(cas_gpu_model *m) {
    cas_status st = CAS_OK;
    CU(cudaMemcpyAsync(m->in_dev, m->in_host, m->in_bytes, cudaMemcpyHostToDevice, m->stream));
    st = cas_cuda_attn_upload(m->attn, m->stream);
fail:
    return st;
}

/* Enqueues the layers over T tokens, the logits of NL rows into m->logits
 * and, when sample is set, their tokens into d_out: the work of a step after
 * its upload, the same launches whether run or captured. */
static cas_status forward_body(cas_gpu_model *m, cas_gpu_kv *kv, int32_t T, int32_t NL, int sample) {
    cas_status st = CAS_OK;
    const cas_model_config *c = &m->cfg;
    cudaStream_t s = m->stream;
    const int32_t E = c->n_embd, F = c->n_ff, QD = c->n_head * c->head_dim, KD = c->n_head_kv * c->head_dim;
    KL(cas_gpu_rope_table(m->d_pos, m->inv_freq, m->cs, T, c->n_rot / 2, s));
    KL(cas_gpu_embed(m->tok_embd, m->d_tokens, m->x, T, E, s));
    for (int32_t l = 0; l < c->n_layers; l++) {
        const gpu_layer *ly = &m->layers[l];
        char *kpool = (char *)kv->mem + (size_t)2 * l * kv->layer_bytes, *vpool = kpool + kv->layer_bytes;
        KL(cas_gpu_rmsnorm(m->x, NULL, ly->attn_norm, m->xb, T, E, c->rms_eps, s));
        if ((st = gemm(m, ly->wqkv, m->xb, m->qkv, QD + 2 * KD, E, T, 0))) return st;
        KL(cas_gpu_rope_store(m->qkv, m->cs, m->d_slot, m->q, kpool, vpool, T, c->n_head, c->n_head_kv, c->head_dim,
                              c->n_rot, s));
        if ((st = cas_cuda_attn_run(m->attn, kpool, vpool, m->q, m->att, m->lse, s))) return st;
        KL(cas_gpu_to_bf16(m->att, m->attb, (int64_t)T * QD, s));
        if ((st = gemm(m, ly->wo, m->attb, m->x, E, QD, T, 1))) return st;
        KL(cas_gpu_rmsnorm(m->x, NULL, ly->ffn_norm, m->xb, T, E, c->rms_eps, s));
        if ((st = gemm(m, ly->wgu, m->xb, m->qkv, 2 * F, E, T, 0))) return st;
        KL(cas_gpu_silu_mul(m->qkv, m->xb, T, F, s));
        if ((st = gemm(m, ly->wdown, m->xb, m->x, E, F, T, 1))) return st;
    }
    if (NL > 0) {
        KL(cas_gpu_rmsnorm(m->x, m->d_rows, m->out_norm, m->xl, NL, E, c->rms_eps, s));
        if ((st = gemm(m, m->output, m->xl, m->logits, c->n_vocab, E, NL, 0))) return st;
        if (sample) KL(cas_gpu_sample_rows(m->logits, NL, c->n_vocab, m->d_samp, m->d_out, s));
    }
fail:
    return st;
}

/* The graph bucket of a decode batch of n rows: 1, 2, 4, 8, then multiples
 * of 8, at most the capacity of sequences and logits rows. */
static int32_t graph_bucket(const cas_gpu_model *m, int32_t n) {
    int32_t t = n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : (n + 7) / 8 * 8;
    const int32_t cap = m->opts.max_seqs < m->opts.max_logits ? m->opts.max_seqs : m->opts.max_logits;
    return t < cap ? t : cap;
}

/* Runs the staged decode step of B rows through the graph of its bucket,
 * capturing it on first use: the rows past B get token 0 at position 0, no
 * K/V slot (slot -1: rope_store writes nothing) and greedy sampling. */
static cas_status forward_graph(cas_gpu_model *m, cas_gpu_kv *kv, int32_t B) {
    cas_status st = CAS_OK;
    if (m->graph_kv != kv->mem || m->graph_attn != m->attn) { /* pools or context changed: capture anew */
        graphs_drop(m);
        m->graph_kv = kv->mem;
        m->graph_attn = m->attn;
    }
    const int32_t Tp = graph_bucket(m, B);
    for (int32_t i = B; i < Tp; i++) {
        m->h_tokens[i] = 0;
        m->h_pos[i] = 0;
        m->h_slot[i] = -1;
        m->h_rows[i] = i;
        m->h_samp[i] = (gpu_sample_row){0.0f, 0, 1.0f, 0.0f, 0.0f, 0};
    }
    gpu_graph *g = NULL;
    for (int32_t i = 0; i < m->n_graphs && !g; i++)
        if (m->graphs[i].t == Tp) g = &m->graphs[i];
    if ((st = forward_upload(m))) return st;
    if (!g && !m->capture_failed) {
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        cudaError_t e = cudaStreamBeginCapture(m->stream, cudaStreamCaptureModeThreadLocal);
        if (e == cudaSuccess) {
            st = forward_body(m, kv, Tp, Tp, 1);
            e = cudaStreamEndCapture(m->stream, &graph);
            if (!st && e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
            if (graph) cudaGraphDestroy(graph);
        }
        if (st || e != cudaSuccess) {
            /* the same padded launches, eagerly from now on: same numbers */
            cas_log(CAS_LOG_WARN, "gpu: decode steps run without CUDA graphs: capturing %d rows failed: %s", Tp,
                    st ? cas_last_error() : cudaGetErrorString(e));
            cudaGetLastError();
            m->capture_failed = 1;
            st = CAS_OK;
        } else {
            g = &m->graphs[m->n_graphs++];
            g->t = Tp;
            g->exec = exec;
            m->graph_info.captures++;
        }
    }
    if (g) {
        CU(cudaGraphLaunch(g->exec, m->stream));
        m->graph_info.replays++;
    } else {
        if ((st = forward_body(m, kv, Tp, Tp, 1))) return st;
        m->graph_info.padded_eager++;
    }
fail:
    return st;
}

cas_status cas_gpu_forward(cas_gpu_model *m, cas_gpu_kv *kv, const cas_model_batch *b, float *logits) {
    if (!logits) return cas_error(CAS_ERR_INVALID, "gpu forward: NULL logits");
    int32_t T = 0, NL = 0;
    cas_status st = forward_prepare(m, kv, b, NULL, &T, &NL);
    if (st) return st;
    if ((st = forward_upload(m)) || (st = forward_body(m, kv, T, NL, 0))) goto fail;
    m->graph_info.eager++;
    if (NL > 0)
        CU(cudaMemcpyAsync(logits, m->logits, (size_t)NL * m->cfg.n_vocab * 4, cudaMemcpyDeviceToHost, m->stream));
    CU(cudaStreamSynchronize(m->stream));
fail:
    if (st) cudaStreamSynchronize(m->stream);
    return st;
}

cas_status cas_gpu_forward_sample(cas_gpu_model *m, cas_gpu_kv *kv, const cas_model_batch *b,
                                  const cas_gpu_sample *rows, int32_t *tokens, float *logits) {
    if (!rows || !tokens) return cas_error(CAS_ERR_INVALID, "gpu forward: NULL sampling rows or tokens");
    int32_t T = 0, NL = 0;
    cas_status st = forward_prepare(m, kv, b, rows, &T, &NL);
    if (st) return st;
    const int32_t V = m->cfg.n_vocab;
    cudaStream_t s = m->stream;
    for (int32_t i = 0; i < NL; i++)
        if (rows[i].want_logits && !logits)
            return cas_error(CAS_ERR_INVALID, "gpu forward: row %d wants logits and logits is NULL", i);
    /* a decode step (a token and a logits row per sequence, in order) replays a graph */
    int decode = m->opts.graphs && T == b->n_seqs && NL == T;
    for (int32_t i = 0; decode && i < NL; i++) decode = m->h_rows[i] == i;
    if (decode) {
        if ((st = forward_graph(m, kv, T))) goto fail;
    } else {
        if ((st = forward_upload(m)) || (st = forward_body(m, kv, T, NL, 1))) goto fail;
        m->graph_info.eager++;
    }
    if (NL > 0) {
        CU(cudaMemcpyAsync(m->h_out, m->d_out, (size_t)NL * 4, cudaMemcpyDeviceToHost, s));
        for (int32_t i = 0; i < NL; i++)
            if (rows[i].want_logits)
                CU(cudaMemcpyAsync(logits + (size_t)i * V, m->logits + (size_t)i * V, (size_t)V * 4,
                                   cudaMemcpyDeviceToHost, s));
    }
    CU(cudaStreamSynchronize(s));
    memcpy(tokens, m->h_out, (size_t)NL * 4);
fail:
    if (st) cudaStreamSynchronize(m->stream);
    return st;
}

void cas_gpu_graph_stats(const cas_gpu_model *m, cas_gpu_graph_info *info) {
    if (m) *info = m->graph_info;
    else memset(info, 0, sizeof *info);
}

void cas_gpu_plan_info(const cas_gpu_model *m, cas_attn_plan_info *info) {
    if (m && m->plan) cas_attn_plan_get_info(m->plan, info);
    else memset(info, 0, sizeof *info);
}

#else /* no CUDA in this build: the same entry points, refusing */

#include <string.h>

int cas_gpu_available(void) { return 0; }
int cas_gpu_built(void) { return 0; }
cas_status cas_gpu_model_create(const cas_gguf *g, const cas_gpu_opts *opts, cas_gpu_model **out) {
    if (out) *out = NULL;
    return cas_error(CAS_ERR_UNSUPPORTED, "gpu: this build has no CUDA (rebuild with make CUDA=1)");
}
cas_status cas_gpu_model_create_synthetic(const cas_model_config *cfg, uint64_t seed, const cas_gpu_opts *opts,
                                          cas_gpu_model **out) {
    if (out) *out = NULL;
    return cas_error(CAS_ERR_UNSUPPORTED, "gpu: this build has no CUDA (rebuild with make CUDA=1)");
}
void cas_gpu_model_destroy(cas_gpu_model *m) {}
const cas_model_config *cas_gpu_model_config(const cas_gpu_model *m) { return NULL; }
size_t cas_gpu_model_bytes(const cas_gpu_model *m) { return 0; }
const char *cas_gpu_model_device_name(const cas_gpu_model *m) { return "none"; }
void cas_gpu_model_set_cascade(cas_gpu_model *m, cas_cascade_mode mode) {}
cas_status cas_gpu_mem_info(const cas_gpu_model *m, size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = 0;
    return cas_error(CAS_ERR_UNSUPPORTED, "gpu: this build has no CUDA (rebuild with make CUDA=1)");
}
int32_t cas_gpu_kv_pages_for_budget(const cas_gpu_model *m, int32_t page_size, size_t budget_bytes) { return 0; }
cas_status cas_gpu_kv_create(const cas_gpu_model *m, int32_t num_pages, int32_t page_size, cas_gpu_kv **out) {
    if (out) *out = NULL;
    return cas_error(CAS_ERR_UNSUPPORTED, "gpu: this build has no CUDA (rebuild with make CUDA=1)");
}
void cas_gpu_kv_destroy(cas_gpu_kv *kv) {}
int32_t cas_gpu_kv_num_pages(const cas_gpu_kv *kv) { return 0; }
size_t cas_gpu_kv_bytes(const cas_gpu_kv *kv) { return 0; }
cas_status cas_gpu_forward(cas_gpu_model *m, cas_gpu_kv *kv, const cas_model_batch *b, float *logits) {
    return cas_error(CAS_ERR_UNSUPPORTED, "gpu: this build has no CUDA (rebuild with make CUDA=1)");
}
cas_status cas_gpu_forward_sample(cas_gpu_model *m, cas_gpu_kv *kv, const cas_model_batch *b,
                                  const cas_gpu_sample *rows, int32_t *tokens, float *logits) {
    return cas_error(CAS_ERR_UNSUPPORTED, "gpu: this build has no CUDA (rebuild with make CUDA=1)");
}
void cas_gpu_plan_info(const cas_gpu_model *m, cas_attn_plan_info *info) { memset(info, 0, sizeof *info); }
void cas_gpu_graph_stats(const cas_gpu_model *m, cas_gpu_graph_info *info) { memset(info, 0, sizeof *info); }

#endif
