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
    o.tensor_parallel = 0;
    o.devices = NULL;
    return o;
}

#if CAS_WITH_CUDA

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../cuda/cuda_attn.h"
#include "gpu_impl.h"

/* ---- the model ------------------------------------------------------------ */

typedef struct {
    void *wqkv;    /* bf16 [QD + 2 KD][E] (this rank's heads) */
    void *wo;      /* bf16 [E][QD] (this rank's columns) */
    void *wgu;     /* bf16 [2 F][E] (this rank's gate rows, then its up rows) */
    void *wdown;   /* bf16 [E][F] (this rank's columns) */
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

/* What one rank holds on its device: its share of the weights, the buffers
 * of a forward, its handles. Without tensor parallelism the model is one
 * rank whose share is everything. */
typedef struct {
    struct cas_gpu_model *model;
    int32_t rank, device;
    cas_model_config cfg; /* this rank's share: n_head, n_head_kv and n_ff divided by the ranks */
    size_t bytes;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_work;
    size_t lt_work_bytes;
    gemm_algo algos[GEMM_CACHE];
    int n_algos, next_algo;
    ncclComm_t comm; /* NULL: no NCCL (one rank without tensor parallelism, or ranks sharing a device) */

    /* weights */
    void *tok_embd;   /* bf16 [V][E] */
    void *output;     /* bf16 [V][E]: tok_embd when tied; rank 0 only */
    float *out_norm;  /* [E] */
    float *inv_freq;  /* [n_rot / 2] */
    gpu_layer *layers;
    void *weights;    /* one allocation holding all of the above */

    /* a step's inputs (the device copy of the model's pinned staging) */
    char *in_dev;
    int32_t *d_tokens, *d_pos, *d_rows;
    int64_t *d_slot;
    gpu_sample_row *d_samp;
    int32_t *d_out; /* sampled tokens */

    /* activations */
    float *x;        /* [T][E] residual stream, the same on every rank */
    void *xb;        /* bf16 [T][max(E, F)] normed input of a product, or the SwiGLU output */
    float *qkv;      /* [T][QD + 2 KD], also [T][2 F] of the gate and up product */
    void *q;         /* bf16 [T][QD] */
    float *att;      /* [T][QD] */
    float *lse;      /* [T][Hq] */
    void *attb;      /* bf16 [T][QD] */
    float *cs;       /* [T][n_rot / 2][2] */
    void *xl;        /* bf16 [L][E] (rank 0) */
    float *logits;   /* [L][V] (rank 0) */
    float *red;      /* [T][E]: the sum over ranks sharing a device */
    void *act;       /* one allocation holding the activations */

    /* attention */
    cas_cuda_attn *attn;
    int32_t attn_page_size;

    /* decode steps' graphs, valid for these pools and attention context */
    gpu_graph *graphs;
    int32_t n_graphs;
    const void *graph_kv;
    const cas_cuda_attn *graph_attn;
    int capture_failed; /* the runtime could not capture: padded steps run eagerly */

    /* the rank's thread (ranks past 0) and its last job's outcome */
    pthread_t thread;
    int thread_started;
    uint64_t seen;
    cas_status st;
    char err[512];
} gpu_rank;

/* A step as every rank runs it (the model's staging holds its inputs). */
typedef struct {
    cas_gpu_kv *kv;
    const cas_model_batch *b;
    int32_t T, NL;
    int graph;         /* a decode step through the graph of bucket T */
    int sample;        /* sample the logits rows into tokens */
    const cas_gpu_sample *rows; /* with sample: which rows also want their logits copied out */
    float *logits;     /* host: [NL][V] (eager, all rows) or the wanted rows */
} gpu_job;

struct cas_gpu_model {
    cas_model_config cfg; /* the whole model */
    cas_gpu_opts opts;
    char device_name[256];
    int32_t n_ranks;
    int tp;          /* tensor parallelism asked for (the all-reduces run, even for one rank) */
    int one_device;  /* ranks share a device: sums by host-synchronized copies */
    gpu_rank ranks[CAS_GPU_MAX_RANKS];

    /* a step's inputs: pinned staging, copied to every rank */
    char *in_host;
    size_t in_bytes;
    int32_t *h_tokens, *h_pos, *h_rows;
    int64_t *h_slot;
    gpu_sample_row *h_samp;
    int32_t *h_out; /* sampled tokens */

    /* the attention plan, the same for every rank */
    cas_attn_plan *plan;
    cas_attn_shape plan_shape;
    cas_gpu_graph_info graph_info;

    /* the ranks' threads */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    pthread_barrier_t barrier; /* the ranks meet after each step's upload, and at each sum when they share a device */
    int sync_ready, barrier_ready;
    uint64_t gen;
    int pending, quit;
    _Atomic int upload_failed; /* a rank could not prepare this step: none runs it */
    gpu_job job;
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
#define NC(call)                                                                                  \
    do {                                                                                          \
        ncclResult_t e_ = (call);                                                                 \
        if (e_ != ncclSuccess) {                                                                  \
            st = cas_error(CAS_ERR_INTERNAL, "gpu: %s:%d: %s: %s", __FILE__, __LINE__, #call,    \
                           ncclGetErrorString(e_));                                               \
            goto fail;                                                                            \
        }                                                                                         \
    } while (0)

static void graphs_drop(gpu_rank *r) {
    for (int32_t i = 0; i < r->n_graphs; i++) cudaGraphExecDestroy(r->graphs[i].exec);
    r->n_graphs = 0;
}

static void rank_free(gpu_rank *r) {
    if (r->device < 0) return;
    cudaSetDevice(r->device);
    if (r->stream) cudaStreamSynchronize(r->stream);
    graphs_drop(r);
    free(r->graphs);
    cas_cuda_attn_destroy(r->attn);
    if (r->comm) ncclCommDestroy(r->comm);
    if (r->act) cudaFree(r->act);
    if (r->in_dev) cudaFree(r->in_dev);
    if (r->weights) cudaFree(r->weights);
    if (r->lt_work) cudaFree(r->lt_work);
    if (r->lt) cublasLtDestroy(r->lt);
    if (r->stream) cudaStreamDestroy(r->stream);
    free(r->layers);
}

static void threads_stop(cas_gpu_model *m) {
    if (!m->sync_ready) return;
    pthread_mutex_lock(&m->mu);
    m->quit = 1;
    pthread_cond_broadcast(&m->go);
    pthread_mutex_unlock(&m->mu);
    for (int32_t i = 1; i < m->n_ranks; i++)
        if (m->ranks[i].thread_started) pthread_join(m->ranks[i].thread, NULL);
}

void cas_gpu_model_destroy(cas_gpu_model *m) {
    if (!m) return;
    threads_stop(m);
    /* the communicators finish together before any is freed (a lone
     * finalize of one of them could wait for the others) */
    int comms = 0;
    for (int32_t i = 0; i < m->n_ranks; i++) comms += m->ranks[i].comm != NULL;
    if (comms) {
        ncclGroupStart();
        for (int32_t i = 0; i < m->n_ranks; i++)
            if (m->ranks[i].comm) ncclCommFinalize(m->ranks[i].comm);
        ncclGroupEnd();
    }
    for (int32_t i = 0; i < m->n_ranks; i++) rank_free(&m->ranks[i]);
    if (m->n_ranks > 0) cudaSetDevice(m->ranks[0].device);
    cas_attn_plan_destroy(m->plan);
    if (m->in_host) cudaFreeHost(m->in_host);
    if (m->barrier_ready) pthread_barrier_destroy(&m->barrier);
    if (m->sync_ready) {
        pthread_mutex_destroy(&m->mu);
        pthread_cond_destroy(&m->go);
        pthread_cond_destroy(&m->done);
    }
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

/* Where a rank's weights come from while it loads: the file's tensors
 * (staged raw, converted on the device) or random ones made on the device
 * (a synthetic model: each whole tensor from its own stream of the seed, so
 * that every split of it holds the same numbers). full: bf16 scratch for a
 * whole matrix whose columns are split. */
typedef struct {
    void *stage;
    size_t stage_bytes;
    void *full;
    size_t full_bytes;
} loader;

/* A matrix of rows x cols (the file's tensor t, or when t is NULL the
 * synthetic one of stream `seed` with entries uniform in +-a): its rows
 * [r0, r0 + nr) and columns [c0, c0 + nc) into dst (bf16, nc a row). */
static cas_status put_slice(gpu_rank *r, loader *ld, const cas_gguf_tensor *t, uint64_t seed, float a, int64_t rows,
                            int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc, void *dst) {
    cas_status st = CAS_OK;
    const int whole_rows = c0 == 0 && nc == cols;
    if (!t && whole_rows && r0 != 0)
        return cas_error(CAS_ERR_INTERNAL, "gpu: a synthetic tensor's rows are made whole, from its first");
    if (!whole_rows && (size_t)(rows * cols * 2) > ld->full_bytes)
        return cas_error(CAS_ERR_INTERNAL, "gpu: scratch for a %lld x %lld matrix too small", (long long)rows,
                         (long long)cols);
    void *conv = whole_rows ? dst : ld->full; /* where the rows go as bf16, nc (= cols) or cols a row */
    if (t) {
        /* rows are whole blocks: rows [r0, r0 + nr) are one byte range */
        const size_t row_bytes = t->nbytes / (size_t)rows;
        const int64_t fr0 = whole_rows ? r0 : 0, fnr = whole_rows ? nr : rows;
        const size_t nb = row_bytes * (size_t)fnr;
        if (nb > ld->stage_bytes) return cas_error(CAS_ERR_INTERNAL, "gpu: staging for %s too small", t->name);
        /* on the kernel's stream: a plain cudaMemcpy from pageable memory may
         * return before its DMA lands, and the non-blocking stream would not wait */
        CU(cudaMemcpyAsync(ld->stage, (const char *)t->data + row_bytes * (size_t)fr0, nb, cudaMemcpyHostToDevice,
                           r->stream));
        KL(cas_gpu_dequant_bf16(t->type, ld->stage, conv, fnr, cols, cols, r->stream));
    } else {
        if (whole_rows)
            KL(cas_gpu_fill_uniform_bf16(conv, nr * cols, a, seed, r->stream)); /* whole tensors only */
        else
            KL(cas_gpu_fill_uniform_bf16(conv, rows * cols, a, seed, r->stream));
    }
    if (!whole_rows)
        CU(cudaMemcpy2DAsync(dst, (size_t)nc * 2, (const char *)ld->full + ((size_t)r0 * (size_t)cols + (size_t)c0) * 2,
                             (size_t)cols * 2, (size_t)nc * 2, (size_t)nr, cudaMemcpyDeviceToDevice, r->stream));
    CU(cudaStreamSynchronize(r->stream));
fail:
    return st;
}

static cas_status upload_vec(gpu_rank *r, const cas_gguf *g, const char *name, int64_t n, float *dst) {
    cas_status st = CAS_OK;
    const cas_gguf_tensor *t = cas_gguf_find_tensor(g, name);
    if (!t) return cas_error(CAS_ERR_FORMAT, "gpu: tensor %s is missing", name);
    if (t->n_elem != n || t->ne[0] != n)
        return cas_error(CAS_ERR_FORMAT, "gpu: tensor %s has %lld elements, expected %lld", name,
                         (long long)t->n_elem, (long long)n);
    if (t->type == CAS_T_F32) {
        CU(cudaMemcpyAsync(dst, t->data, (size_t)n * 4, cudaMemcpyHostToDevice, r->stream));
        CU(cudaStreamSynchronize(r->stream));
    } else if (t->type == CAS_T_F16 || t->type == CAS_T_BF16) {
        /* staged in cuBLASLt's workspace (idle while loading): converting in
         * place would let one thread's write overtake another's read */
        if ((size_t)n * 2 > r->lt_work_bytes) return cas_error(CAS_ERR_UNSUPPORTED, "gpu: norm %s is too long", name);
        CU(cudaMemcpyAsync(r->lt_work, t->data, (size_t)n * 2, cudaMemcpyHostToDevice, r->stream));
        KL(cas_gpu_to_f32(t->type, r->lt_work, dst, n, r->stream));
        CU(cudaStreamSynchronize(r->stream));
    } else {
        return cas_error(CAS_ERR_UNSUPPORTED, "gpu: norm %s has type %s", name,
                         cas_ttype_name(t->type) ? cas_ttype_name(t->type) : "?");
    }
fail:
    return st;
}

#define ALIGN256(x) (((x) + 255) & ~(size_t)255)

/* The ranks and their devices from the options; *n_out ranks. */
static cas_status ranks_plan(const cas_gpu_opts *o, const cas_model_config *cfg, int32_t *devs, int32_t *n_out,
                             int *one_device) {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0)
        return cas_error(CAS_ERR_UNSUPPORTED, "gpu: no CUDA device");
    const int32_t n = o->tensor_parallel > 0 ? o->tensor_parallel : 1;
    if (o->tensor_parallel < 0 || n > CAS_GPU_MAX_RANKS)
        return cas_error(CAS_ERR_INVALID, "gpu: tensor parallelism of %d (1 to %d)", o->tensor_parallel,
                         CAS_GPU_MAX_RANKS);
    if (cfg->n_head % n || cfg->n_head_kv % n || cfg->n_ff % n)
        return cas_error(CAS_ERR_INVALID,
                         "gpu: tensor parallelism of %d does not divide the model's %d query heads, %d K/V heads "
                         "and %d MLP columns",
                         n, cfg->n_head, cfg->n_head_kv, cfg->n_ff);
    int same = 1, distinct = 1;
    for (int32_t i = 0; i < n; i++) {
        devs[i] = o->tensor_parallel > 0 && o->devices ? o->devices[i] : o->device + i;
        if (devs[i] < 0 || devs[i] >= ndev)
            return n > 1 && !o->devices
                       ? cas_error(CAS_ERR_INVALID, "gpu: tensor parallelism of %d from device %d needs %d devices; "
                                   "this machine has %d", n, o->device, o->device + n, ndev)
                       : cas_error(CAS_ERR_INVALID, "gpu: device %d (this machine has %d)", devs[i], ndev);
        for (int32_t j = 0; j < i; j++) {
            if (devs[j] == devs[i]) distinct = 0;
            else same = 0;
        }
    }
    if (!distinct && !same)
        return cas_error(CAS_ERR_INVALID, "gpu: the ranks' devices must be all different or all the same");
    *n_out = n;
    *one_device = n > 1 && same;
    return CAS_OK;
}

/* The model's handles and each rank's one allocation for its weights, laid
 * out (the contents are the caller's to fill): checks the options and the
 * devices. */
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
    int32_t devs[CAS_GPU_MAX_RANKS], n = 1;
    int one_device = 0;
    cas_status st = ranks_plan(&o, cfg, devs, &n, &one_device);
    if (st) return st;
    o.devices = NULL; /* the caller's array is not kept */
    if (one_device) o.graphs = 0; /* the sums wait on the host: nothing to capture */

    cas_gpu_model *m = calloc(1, sizeof *m);
    if (!m) return cas_error(CAS_ERR_NOMEM, "gpu: out of host memory");
    m->opts = o;
    m->cfg = *cfg;
    m->n_ranks = n;
    m->tp = o.tensor_parallel > 0;
    m->one_device = one_device;
    for (int32_t i = 0; i < CAS_GPU_MAX_RANKS; i++) m->ranks[i].device = -1;
    const int64_t E = cfg->n_embd, V = cfg->n_vocab, L = cfg->n_layers;
    for (int32_t i = 0; i < n; i++) {
        gpu_rank *r = &m->ranks[i];
        r->model = m;
        r->rank = i;
        r->device = devs[i];
        r->cfg = *cfg;
        r->cfg.n_head /= n;
        r->cfg.n_head_kv /= n;
        r->cfg.n_ff /= n;
        const cas_model_config *c = &r->cfg;
        const int64_t F = c->n_ff, QD = (int64_t)c->n_head * c->head_dim, KD = (int64_t)c->n_head_kv * c->head_dim;
        CU(cudaSetDevice(r->device));
        if (i == 0) {
            struct cudaDeviceProp p;
            CU(cudaGetDeviceProperties(&p, r->device));
            snprintf(m->device_name, sizeof m->device_name, "%s", p.name);
        }
        CU(cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking));
        if (cublasLtCreate(&r->lt) != CUBLAS_STATUS_SUCCESS) {
            st = cas_error(CAS_ERR_INTERNAL, "gpu: cublasLtCreate failed");
            r->lt = NULL;
            goto fail;
        }
        r->lt_work_bytes = (size_t)32 << 20;
        CU(cudaMalloc(&r->lt_work, r->lt_work_bytes));
        r->layers = calloc((size_t)L, sizeof *r->layers);
        r->graphs = calloc((size_t)(4 + o.max_seqs / 8), sizeof *r->graphs);
        if (!r->layers || !r->graphs) {
            st = cas_error(CAS_ERR_NOMEM, "gpu: out of host memory");
            goto fail;
        }
        const int out_here = has_output && i == 0;
        const size_t mat_qkv = ALIGN256((size_t)(QD + 2 * KD) * E * 2), mat_o = ALIGN256((size_t)E * QD * 2),
                     mat_gu = ALIGN256((size_t)2 * F * E * 2), mat_d = ALIGN256((size_t)E * F * 2),
                     vec = ALIGN256((size_t)E * 4), vocab = ALIGN256((size_t)V * E * 2);
        const size_t total = vocab + (out_here ? vocab : 0) + vec + ALIGN256((size_t)c->n_rot / 2 * 4) +
                             (size_t)L * (mat_qkv + mat_o + mat_gu + mat_d + 2 * vec);
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        cudaError_t e = cudaMalloc(&r->weights, total);
        if (e != cudaSuccess) {
            cudaGetLastError();
            r->weights = NULL;
            st = cas_error(CAS_ERR_NOMEM,
                           "gpu: the weights%s need %.1f GiB of device %d's memory, %.1f GiB of the %.1f GiB are free",
                           n > 1 ? " of a rank" : "", (double)total / 1073741824.0, r->device,
                           (double)free_b / 1073741824.0, (double)total_b / 1073741824.0);
            goto fail;
        }
        r->bytes += total;
        char *w = r->weights;
        r->tok_embd = w, w += vocab;
        r->output = out_here ? (void *)w : i == 0 ? r->tok_embd : NULL;
        if (out_here) w += vocab;
        r->out_norm = (float *)w, w += vec;
        r->inv_freq = (float *)w, w += ALIGN256((size_t)c->n_rot / 2 * 4);
        for (int64_t l = 0; l < L; l++) {
            gpu_layer *ly = &r->layers[l];
            ly->wqkv = w, w += mat_qkv;
            ly->wo = w, w += mat_o;
            ly->wgu = w, w += mat_gu;
            ly->wdown = w, w += mat_d;
            ly->attn_norm = (float *)w, w += vec;
            ly->ffn_norm = (float *)w, w += vec;
        }
    }
    if (m->tp && !one_device) {
        /* one communicator per rank, made together (one process, one thread here) */
        ncclComm_t comms[CAS_GPU_MAX_RANKS];
        NC(ncclCommInitAll(comms, n, devs));
        for (int32_t i = 0; i < n; i++) m->ranks[i].comm = comms[i];
    }
    *out = m;
    return CAS_OK;
fail:
    cas_gpu_model_destroy(m);
    return st;
}

/* A rank's weights, whole or its share, from the file (g) or, with g NULL,
 * made on the device from seed as cas_gpu_model_create_synthetic says. */
static cas_status load_rank(cas_gpu_model *m, gpu_rank *r, const cas_gguf *g, uint64_t seed, loader *ld) {
    cas_status st = CAS_OK;
    const cas_model_config *c = &m->cfg;
    const int64_t E = c->n_embd, F = c->n_ff, V = c->n_vocab, QD = (int64_t)c->n_head * c->head_dim,
                  KD = (int64_t)c->n_head_kv * c->head_dim;
    /* this rank's share */
    const int64_t Fr = r->cfg.n_ff, QDr = (int64_t)r->cfg.n_head * c->head_dim,
                  KDr = (int64_t)r->cfg.n_head_kv * c->head_dim, rk = r->rank;
    const cas_gguf_tensor *t = NULL;
    CU(cudaSetDevice(r->device));
    /* uniform in [-a, a] with a = sqrt(3 / inputs): unit variance in, unit variance out */
    uint64_t sid = seed * 0x9e3779b97f4a7c15ull;
#define A(inputs) sqrtf(3.0f / (float)(inputs))
    if (g) {
        if ((st = find_weight(g, "token_embd.weight", V, E, &t)) ||
            (st = put_slice(r, ld, t, 0, 0, V, E, 0, V, 0, E, r->tok_embd)))
            goto fail;
        if (!c->tied_embeddings && r->output && r->output != r->tok_embd &&
            ((st = find_weight(g, "output.weight", V, E, &t)) ||
             (st = put_slice(r, ld, t, 0, 0, V, E, 0, V, 0, E, r->output))))
            goto fail;
        if ((st = upload_vec(r, g, "output_norm.weight", E, r->out_norm))) goto fail;
    } else {
        if ((st = put_slice(r, ld, NULL, sid++, A(1), V, E, 0, V, 0, E, r->tok_embd))) goto fail;
        if (!c->tied_embeddings) {
            const uint64_t s_out = sid++; /* every rank steps past the output's stream */
            if (r->output && r->output != r->tok_embd && (st = put_slice(r, ld, NULL, s_out, A(E), V, E, 0, V, 0, E, r->output)))
                goto fail;
        }
        KL(cas_gpu_fill_f32(r->out_norm, E, 1.0f, r->stream));
    }
    for (int32_t l = 0; l < c->n_layers; l++) {
        gpu_layer *ly = &r->layers[l];
        char *qkv = ly->wqkv, *gu = ly->wgu;
        if (g) {
            char name[96];
#define NAME(s) (snprintf(name, sizeof name, "blk.%d." s, (int)l), name)
#define SLICE(s, rows, cols, r0, nr, c0, nc, dst)                                                           \
    do {                                                                                                   \
        if ((st = find_weight(g, NAME(s), rows, cols, &t))) goto fail;                                     \
        if ((st = put_slice(r, ld, t, 0, 0, rows, cols, r0, nr, c0, nc, dst))) goto fail;                   \
    } while (0)
            SLICE("attn_q.weight", QD, E, rk * QDr, QDr, 0, E, qkv);
            SLICE("attn_k.weight", KD, E, rk * KDr, KDr, 0, E, qkv + (size_t)QDr * E * 2);
            SLICE("attn_v.weight", KD, E, rk * KDr, KDr, 0, E, qkv + (size_t)(QDr + KDr) * E * 2);
            SLICE("attn_output.weight", E, QD, 0, E, rk * QDr, QDr, ly->wo);
            SLICE("ffn_gate.weight", F, E, rk * Fr, Fr, 0, E, gu);
            SLICE("ffn_up.weight", F, E, rk * Fr, Fr, 0, E, gu + (size_t)Fr * E * 2);
            SLICE("ffn_down.weight", E, F, 0, E, rk * Fr, Fr, ly->wdown);
            if ((st = upload_vec(r, g, NAME("attn_norm.weight"), E, ly->attn_norm))) goto fail;
            if ((st = upload_vec(r, g, NAME("ffn_norm.weight"), E, ly->ffn_norm))) goto fail;
#undef SLICE
#undef NAME
        } else {
            /* the whole model's tensors are [q; k; v], wo, [gate; up], down, a stream each */
            const uint64_t s_qkv = sid++, s_o = sid++, s_gu = sid++, s_d = sid++;
            if (m->n_ranks == 1) {
                if ((st = put_slice(r, ld, NULL, s_qkv, A(E), QD + 2 * KD, E, 0, QD + 2 * KD, 0, E, qkv)) ||
                    (st = put_slice(r, ld, NULL, s_gu, A(E), 2 * F, E, 0, 2 * F, 0, E, gu)))
                    goto fail;
            } else {
                /* row slices of one synthetic tensor need it whole first: through the
                 * scratch (put_slice fills whole tensors only) */
                const int64_t rq[3] = {rk * QDr, QD + rk * KDr, QD + KD + rk * KDr}, nq[3] = {QDr, KDr, KDr};
                int64_t off = 0;
                KL(cas_gpu_fill_uniform_bf16(ld->full, (QD + 2 * KD) * E, A(E), s_qkv, r->stream));
                for (int k = 0; k < 3; k++) {
                    CU(cudaMemcpyAsync(qkv + (size_t)off * E * 2, (char *)ld->full + (size_t)rq[k] * E * 2,
                                       (size_t)nq[k] * E * 2, cudaMemcpyDeviceToDevice, r->stream));
                    off += nq[k];
                }
                KL(cas_gpu_fill_uniform_bf16(ld->full, 2 * F * E, A(E), s_gu, r->stream));
                CU(cudaMemcpyAsync(gu, (char *)ld->full + (size_t)rk * Fr * E * 2, (size_t)Fr * E * 2,
                                   cudaMemcpyDeviceToDevice, r->stream));
                CU(cudaMemcpyAsync(gu + (size_t)Fr * E * 2, (char *)ld->full + (size_t)(F + rk * Fr) * E * 2,
                                   (size_t)Fr * E * 2, cudaMemcpyDeviceToDevice, r->stream));
                CU(cudaStreamSynchronize(r->stream));
            }
            if ((st = put_slice(r, ld, NULL, s_o, A(QD), E, QD, 0, E, rk * QDr, QDr, ly->wo)) ||
                (st = put_slice(r, ld, NULL, s_d, A(F), E, F, 0, E, rk * Fr, Fr, ly->wdown)))
                goto fail;
            KL(cas_gpu_fill_f32(ly->attn_norm, E, 1.0f, r->stream));
            KL(cas_gpu_fill_f32(ly->ffn_norm, E, 1.0f, r->stream));
        }
    }
#undef A
    CU(cudaStreamSynchronize(r->stream));
fail:
    return st;
}

static void *rank_thread(void *arg);

/* The RoPE frequencies (cas_model_rope_freqs: g holds rope_freqs.weight
 * where the config names it; NULL for a synthetic model), the pinned
 * staging of a step's inputs, each rank's device copy of it and its
 * activations, and the ranks' threads; on failure the caller destroys m. */
static cas_status model_finish(cas_gpu_model *m, const cas_gguf *g) {
    cas_status st = CAS_OK;
    const cas_model_config *c = &m->cfg;
    const cas_gpu_opts o = m->opts;
    const int64_t E = c->n_embd, V = c->n_vocab;
    const int64_t T = o.max_batch_tokens, NL = o.max_logits, half = c->n_rot / 2;
    const size_t in_a = ALIGN256((size_t)T * 4), in_s = ALIGN256((size_t)T * 8),
                 in_r = ALIGN256((size_t)NL * sizeof(gpu_sample_row)), out_b = ALIGN256((size_t)NL * 4);
    float *f = malloc(sizeof(float) * (size_t)(half > 0 ? half : 1));
    if (!f) return cas_error(CAS_ERR_NOMEM, "gpu: out of host memory");
    if ((st = cas_model_rope_freqs(g, c, f))) goto fail;
    /* a step's inputs: [tokens, pos, rows][slot][sampling rows], then the sampled tokens */
    m->in_bytes = in_a * 3 + in_s + in_r;
    CU(cudaSetDevice(m->ranks[0].device));
    /* pinned memory is portable to every device of the process (unified addressing) */
    CU(cudaMallocHost((void **)&m->in_host, m->in_bytes + out_b));
    m->h_tokens = (int32_t *)m->in_host;
    m->h_pos = (int32_t *)(m->in_host + in_a);
    m->h_rows = (int32_t *)(m->in_host + 2 * in_a);
    m->h_slot = (int64_t *)(m->in_host + 3 * in_a);
    m->h_samp = (gpu_sample_row *)(m->in_host + 3 * in_a + in_s);
    m->h_out = (int32_t *)(m->in_host + m->in_bytes);
    for (int32_t i = 0; i < m->n_ranks; i++) {
        gpu_rank *r = &m->ranks[i];
        const cas_model_config *rc = &r->cfg;
        const int64_t F = rc->n_ff, QD = (int64_t)rc->n_head * rc->head_dim,
                      KD = (int64_t)rc->n_head_kv * rc->head_dim;
        const int64_t NLr = i == 0 ? NL : 0; /* logits on rank 0 only */
        CU(cudaSetDevice(r->device));
        CU(cudaMemcpyAsync(r->inv_freq, f, sizeof(float) * (size_t)half, cudaMemcpyHostToDevice, r->stream));
        CU(cudaStreamSynchronize(r->stream));
        CU(cudaMalloc((void **)&r->in_dev, m->in_bytes + out_b));
        r->d_tokens = (int32_t *)r->in_dev;
        r->d_pos = (int32_t *)(r->in_dev + in_a);
        r->d_rows = (int32_t *)(r->in_dev + 2 * in_a);
        r->d_slot = (int64_t *)(r->in_dev + 3 * in_a);
        r->d_samp = (gpu_sample_row *)(r->in_dev + 3 * in_a + in_s);
        r->d_out = (int32_t *)(r->in_dev + m->in_bytes);
        const int64_t W = QD + 2 * KD > 2 * F ? QD + 2 * KD : 2 * F, XB = E > F ? E : F;
        const size_t sz[11] = {ALIGN256((size_t)T * E * 4),  ALIGN256((size_t)T * XB * 2),
                               ALIGN256((size_t)T * W * 4),  ALIGN256((size_t)T * QD * 2),
                               ALIGN256((size_t)T * QD * 4), ALIGN256((size_t)T * rc->n_head * 4),
                               ALIGN256((size_t)T * QD * 2), ALIGN256((size_t)T * half * 2 * 4),
                               ALIGN256((size_t)NLr * E * 2), ALIGN256((size_t)NLr * V * 4),
                               m->one_device ? ALIGN256((size_t)T * E * 4) : 0};
        size_t act = 0;
        for (int k = 0; k < 11; k++) act += sz[k];
        cudaError_t e = cudaMalloc(&r->act, act);
        if (e != cudaSuccess) {
            cudaGetLastError();
            r->act = NULL;
            st = cas_error(CAS_ERR_NOMEM, "gpu: the activations of %lld tokens need %.1f MiB of device %d's memory",
                           (long long)T, (double)act / 1048576.0, r->device);
            goto fail;
        }
        /* zeroed: a padded row of a graph's batch reads attention rows no plan wrote */
        CU(cudaMemsetAsync(r->act, 0, act, r->stream));
        CU(cudaStreamSynchronize(r->stream));
        r->bytes += act + m->in_bytes + out_b;
        char *a = r->act;
        r->x = (float *)a, a += sz[0];
        r->xb = a, a += sz[1];
        r->qkv = (float *)a, a += sz[2];
        r->q = a, a += sz[3];
        r->att = (float *)a, a += sz[4];
        r->lse = (float *)a, a += sz[5];
        r->attb = a, a += sz[6];
        r->cs = (float *)a, a += sz[7];
        r->xl = a, a += sz[8];
        r->logits = (float *)a, a += sz[9];
        r->red = m->one_device ? (float *)a : NULL;
    }
    if (m->n_ranks > 1) {
        if (pthread_mutex_init(&m->mu, NULL) || pthread_cond_init(&m->go, NULL) || pthread_cond_init(&m->done, NULL)) {
            st = cas_error(CAS_ERR_INTERNAL, "gpu: cannot make the ranks' locks");
            goto fail;
        }
        m->sync_ready = 1;
        if (pthread_barrier_init(&m->barrier, NULL, (unsigned)m->n_ranks)) {
            st = cas_error(CAS_ERR_INTERNAL, "gpu: cannot make the ranks' barrier");
            goto fail;
        }
        m->barrier_ready = 1;
        for (int32_t i = 1; i < m->n_ranks; i++) {
            if (pthread_create(&m->ranks[i].thread, NULL, rank_thread, &m->ranks[i])) {
                st = cas_error(CAS_ERR_INTERNAL, "gpu: cannot start rank %d's thread", i);
                goto fail;
            }
            m->ranks[i].thread_started = 1;
        }
    }
    CU(cudaSetDevice(m->ranks[0].device));
fail:
    free(f);
    return st;
}

/* The scratch a rank's load needs: the file's largest tensor raw, and a
 * whole matrix in bf16 where columns (or a synthetic tensor's rows) are
 * split. */
static cas_status loader_make(cas_gpu_model *m, const gpu_rank *r, size_t stage_bytes, loader *ld) {
    cas_status st = CAS_OK;
    const cas_model_config *c = &m->cfg;
    const int64_t E = c->n_embd, F = c->n_ff, QD = (int64_t)c->n_head * c->head_dim,
                  KD = (int64_t)c->n_head_kv * c->head_dim;
    int64_t most = (QD + 2 * KD) * E;
    if (2 * F * E > most) most = 2 * F * E;
    if (E * QD > most) most = E * QD;
    memset(ld, 0, sizeof *ld);
    ld->stage_bytes = stage_bytes;
    ld->full_bytes = m->n_ranks > 1 ? (size_t)most * 2 : 0;
    CU(cudaSetDevice(r->device));
    if (stage_bytes) CU(cudaMalloc(&ld->stage, stage_bytes));
    if (ld->full_bytes) CU(cudaMalloc(&ld->full, ld->full_bytes));
fail:
    return st;
}

static void loader_free(const gpu_rank *r, loader *ld) {
    cudaSetDevice(r->device);
    if (ld->stage) cudaFree(ld->stage);
    if (ld->full) cudaFree(ld->full);
    memset(ld, 0, sizeof *ld);
}

/* Every rank's weights, one rank after another (the scratch of one at a time). */
static cas_status load_all(cas_gpu_model *m, const cas_gguf *g, uint64_t seed, size_t stage_bytes) {
    cas_status st = CAS_OK;
    for (int32_t i = 0; i < m->n_ranks && !st; i++) {
        loader ld;
        st = loader_make(m, &m->ranks[i], stage_bytes, &ld);
        if (!st) st = load_rank(m, &m->ranks[i], g, seed, &ld);
        loader_free(&m->ranks[i], &ld);
    }
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
    if ((st = load_all(m, g, 0, stage_bytes)) || (st = model_finish(m, g))) goto fail;
    *out = m;
    return CAS_OK;
fail:
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
    if ((st = load_all(m, NULL, seed, 0)) || (st = model_finish(m, NULL))) goto fail;
    *out = m;
    return CAS_OK;
fail:
    cas_gpu_model_destroy(m);
    return st;
}

const cas_model_config *cas_gpu_model_config(const cas_gpu_model *m) { return &m->cfg; }
size_t cas_gpu_model_bytes(const cas_gpu_model *m) {
    size_t n = 0;
    for (int32_t i = 0; i < m->n_ranks; i++) n += m->ranks[i].bytes;
    return n;
}
const char *cas_gpu_model_device_name(const cas_gpu_model *m) { return m ? m->device_name : "none"; }
int32_t cas_gpu_model_ranks(const cas_gpu_model *m) { return m ? m->n_ranks : 0; }
cas_status cas_gpu_mem_info(const cas_gpu_model *m, size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = 0;
    cudaError_t e = cudaSetDevice(m->ranks[0].device);
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
    int32_t num_pages, page_size, n_layers, n_ranks;
    size_t layer_bytes; /* one pool of one layer of one rank */
    void *mem[CAS_GPU_MAX_RANKS]; /* per rank: [n_layers][K, V][num_pages][page_size][its K/V heads][head_dim] bf16 */
    int32_t device[CAS_GPU_MAX_RANKS];
};

/* one page of one pool of one rank */
static size_t kv_page_bytes(const cas_gpu_model *m, int32_t page_size) {
    return (size_t)page_size * (size_t)m->ranks[0].cfg.n_head_kv * (size_t)m->cfg.head_dim * 2;
}

int32_t cas_gpu_kv_pages_for_budget(const cas_gpu_model *m, int32_t page_size, size_t budget_bytes) {
    if (!m || page_size <= 0) return 0;
    /* ranks sharing a device each hold a pool there */
    const size_t per = 2 * kv_page_bytes(m, page_size) * (size_t)m->cfg.n_layers * (m->one_device ? (size_t)m->n_ranks : 1);
    const size_t n = budget_bytes / per;
    return n > INT32_MAX ? INT32_MAX : (int32_t)n;
}

void cas_gpu_kv_destroy(cas_gpu_kv *kv) {
    if (!kv) return;
    for (int32_t i = 0; i < kv->n_ranks; i++)
        if (kv->mem[i]) {
            cudaSetDevice(kv->device[i]);
            cudaFree(kv->mem[i]);
        }
    free(kv);
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
    kv->n_ranks = m->n_ranks;
    kv->layer_bytes = kv_page_bytes(m, page_size) * (size_t)num_pages;
    const size_t total = 2 * kv->layer_bytes * (size_t)kv->n_layers;
    for (int32_t i = 0; i < m->n_ranks; i++) {
        kv->device[i] = m->ranks[i].device;
        cudaError_t e = cudaSetDevice(kv->device[i]);
        if (e == cudaSuccess) e = cudaMalloc(&kv->mem[i], total);
        if (e != cudaSuccess) {
            size_t free_b = 0, total_b = 0;
            cudaGetLastError();
            cudaMemGetInfo(&free_b, &total_b);
            kv->mem[i] = NULL;
            cas_gpu_kv_destroy(kv);
            cudaSetDevice(m->ranks[0].device);
            return cas_error(CAS_ERR_NOMEM, "gpu kv: %d pages need %.1f MiB of device %d's memory, %.1f MiB are free",
                             num_pages, (double)total / 1048576.0, m->ranks[i].device, (double)free_b / 1048576.0);
        }
        /* finished before any forward's stream touches the pools */
        if ((e = cudaMemset(kv->mem[i], 0, total)) != cudaSuccess || (e = cudaDeviceSynchronize()) != cudaSuccess) {
            cas_gpu_kv_destroy(kv);
            cudaSetDevice(m->ranks[0].device);
            return cas_error(CAS_ERR_INTERNAL, "gpu kv: cudaMemset: %s", cudaGetErrorString(e));
        }
    }
    cudaSetDevice(m->ranks[0].device);
    *out = kv;
    return CAS_OK;
}

int32_t cas_gpu_kv_num_pages(const cas_gpu_kv *kv) { return kv->num_pages; }
size_t cas_gpu_kv_bytes(const cas_gpu_kv *kv) { return 2 * kv->layer_bytes * (size_t)kv->n_layers * (size_t)kv->n_ranks; }

/* ---- matrix products ---------------------------------------------------- */

/* C[t][n] = A[t][:] . W[n][:] (+ C when beta1), t < T, n < N, over K: bf16
 * operands, f32 accumulation and output. Column-major for cuBLASLt: C is N x
 * T (ld N) = W^T (W is K x N col-major, ld K) times A (K x T, ld K). */
static cas_status gemm(gpu_rank *r, const void *W, const void *A, float *C, int32_t N, int32_t K, int32_t T,
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
    for (int i = 0; i < r->n_algos && !ga; i++)
        if (r->algos[i].n == N && r->algos[i].k == K && r->algos[i].t == T && r->algos[i].beta1 == beta1)
            ga = &r->algos[i];
    if (!ga) {
        cublasLtMatmulPreferenceOpaque_t pop;
        cublasLtMatmulPreference_t pref = (cublasLtMatmulPreference_t)&pop;
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        if (cublasLtMatmulPreferenceInit(pref) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &r->lt_work_bytes,
                                                 sizeof r->lt_work_bytes) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoGetHeuristic(r->lt, desc, Lw, La, Lc, Lc, pref, 1, &res, &found) !=
                CUBLAS_STATUS_SUCCESS ||
            found < 1)
            return cas_error(CAS_ERR_INTERNAL, "gpu: no cuBLASLt algorithm for %d x %d x %d", N, K, T);
        ga = &r->algos[r->n_algos < GEMM_CACHE ? r->n_algos++ : (r->next_algo++ % GEMM_CACHE)];
        ga->n = N, ga->k = K, ga->t = T, ga->beta1 = beta1;
        ga->algo = res.algo;
    }
    const float one = 1.f, beta = beta1 ? 1.f : 0.f;
    cublasStatus_t s = cublasLtMatmul(r->lt, desc, &one, W, Lw, A, La, &beta, C, Lc, C, Lc, &ga->algo, r->lt_work,
                                      r->lt_work_bytes, r->stream);
    if (s != CUBLAS_STATUS_SUCCESS)
        return cas_error(CAS_ERR_INTERNAL, "gpu: cublasLtMatmul %d x %d x %d failed (%d)", N, K, T, (int)s);
    return CAS_OK;
}

/* ---- the sum over ranks -------------------------------------------------- */

/* x[0 .. n) on every rank becomes the sum of all ranks' x. NCCL's
 * all-reduce where the ranks have devices of their own (and for one rank
 * under tensor parallelism, the same path); where they share one device,
 * each rank adds the others' x in rank order into its scratch once all have
 * finished writing theirs, and copies the sum back once all have read them
 * (the same bits on every rank, as NCCL's are). */
static cas_status ranks_sum(cas_gpu_model *m, gpu_rank *r, float *x, int64_t n) {
    cas_status st = CAS_OK;
    if (!m->tp) return CAS_OK;
    if (!m->one_device) {
        NC(ncclAllReduce(x, x, (size_t)n, ncclFloat32, ncclSum, r->comm, r->stream));
        return CAS_OK;
    }
    CU(cudaStreamSynchronize(r->stream));
    pthread_barrier_wait(&m->barrier);
    CU(cudaMemcpyAsync(r->red, m->ranks[0].x, (size_t)n * 4, cudaMemcpyDeviceToDevice, r->stream));
    for (int32_t j = 1; j < m->n_ranks; j++) KL(cas_gpu_add_f32(r->red, m->ranks[j].x, n, r->stream));
    CU(cudaStreamSynchronize(r->stream));
    pthread_barrier_wait(&m->barrier);
    CU(cudaMemcpyAsync(x, r->red, (size_t)n * 4, cudaMemcpyDeviceToDevice, r->stream));
fail:
    return st;
}

/* ---- the forward pass --------------------------------------------------- */

/* The attention context of a rank for pools of this page size, made once
 * (the capacities cover any batch the model's options allow). */
static cas_status attn_ready(const cas_gpu_model *m, gpu_rank *r, int32_t page_size) {
    if (r->attn && r->attn_page_size == page_size) return CAS_OK;
    cas_cuda_attn_destroy(r->attn);
    r->attn = NULL;
    const cas_model_config *c = &r->cfg;
    const cas_attn_shape sh = {c->n_head, c->n_head_kv, c->head_dim, page_size, CAS_BF16};
    cas_cuda_attn_caps caps;
    memset(&caps, 0, sizeof caps);
    caps.max_total_q = m->opts.max_batch_tokens;
    caps.max_passes = 2 * m->opts.max_seqs;
    caps.max_tok_rows = 4 * m->opts.max_batch_tokens;
    caps.max_page_ids = (int64_t)m->opts.max_seqs * m->opts.max_pages_per_seq;
    caps.max_states = 16 * (int64_t)m->opts.max_batch_tokens;
    caps.device = r->device;
    cas_status st = cas_cuda_attn_create(&r->attn, &sh, &caps, NULL);
    if (st) return st;
    r->attn_page_size = page_size;
    return CAS_OK;
}

/* Checks the batch, plans its attention (one plan, every rank's heads alike)
 * and writes the step's inputs (and the sampling rows, when given) into the
 * pinned staging; *T is the batch's tokens and *n_logits its logits rows. No
 * device work. */
static cas_status forward_prepare(cas_gpu_model *m, cas_gpu_kv *kv, const cas_model_batch *b,
                                  const cas_gpu_sample *samp, int32_t *T_out, int32_t *n_logits) {
    if (!m || !kv || !b || b->n_seqs <= 0 || !b->tokens || !b->qo_indptr || !b->kv_indptr || !b->kv_indices ||
        !b->kv_last_page_len)
        return cas_error(CAS_ERR_INVALID, "gpu forward: empty batch or NULL array");
    const cas_model_config *c = &m->cfg;
    if (kv->n_layers != c->n_layers || kv->n_ranks != m->n_ranks)
        return cas_error(CAS_ERR_INVALID, "gpu forward: the K/V store is another model's");
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

    /* the plan (validates page ids, lengths, q_len <= kv_len), over one rank's heads */
    cas_status st = CAS_OK;
    const int32_t ps = kv->page_size;
    const cas_model_config *rc = &m->ranks[0].cfg;
    const cas_attn_shape shape = {rc->n_head, rc->n_head_kv, rc->head_dim, ps, CAS_BF16};
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
    const cas_attn_batch ab = {B, b->qo_indptr, b->kv_indptr, b->kv_indices, b->kv_last_page_len};
    const cas_attn_params ap = cas_attn_params_default();
    if ((st = cas_attn_plan_build(m->plan, &ab, kv->num_pages, &ap))) return st;

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
    return CAS_OK;
}

/* A rank's attention tasks from the step's plan, and the staged inputs and
 * the tasks to its device, on its stream. */
static cas_status forward_upload(cas_gpu_model *m, gpu_rank *r, const gpu_job *j) {
    cas_status st = CAS_OK;
    if ((st = attn_ready(m, r, j->kv->page_size))) return st;
    st = cas_cuda_attn_plan_from_cpu(r->attn, m->plan);
    if (st == CAS_ERR_NOMEM) {
        /* over the context's capacities: a flat plan of the same batch always
         * fits (the same outcome on every rank: the same plan and capacities) */
        const cas_model_batch *b = j->b;
        const cas_attn_batch ab = {b->n_seqs, b->qo_indptr, b->kv_indptr, b->kv_indices, b->kv_last_page_len};
        const cas_attn_params ap = cas_attn_params_default();
        st = cas_cuda_attn_plan_flat(r->attn, &ab, j->kv->num_pages, &ap);
    }
    if (st) return st;
    CU(cudaMemcpyAsync(r->in_dev, m->in_host, m->in_bytes, cudaMemcpyHostToDevice, r->stream));
    st = cas_cuda_attn_upload(r->attn, r->stream);
fail:
    return st;
}

/* Enqueues a rank's layers over T tokens, the logits of NL rows into
 * r->logits and, when sample is set, their tokens into d_out (rank 0): the
 * work of a step after its upload, the same launches whether run or
 * captured. Under tensor parallelism each rank's attention output and down
 * products are its heads' and columns' share of the sum: rank 0 adds them
 * to the residual stream, the others write them alone, and the sum over the
 * ranks leaves every rank the same stream. */
static cas_status forward_body(cas_gpu_model *m, gpu_rank *r, cas_gpu_kv *kv, int32_t T, int32_t NL, int sample) {
    cas_status st = CAS_OK;
    const cas_model_config *c = &r->cfg;
    cudaStream_t s = r->stream;
    const int32_t E = c->n_embd, F = c->n_ff, QD = c->n_head * c->head_dim, KD = c->n_head_kv * c->head_dim;
    const int resid = r->rank == 0;
    KL(cas_gpu_rope_table(r->d_pos, r->inv_freq, r->cs, T, c->n_rot / 2, s));
    KL(cas_gpu_embed(r->tok_embd, r->d_tokens, r->x, T, E, s));
    for (int32_t l = 0; l < c->n_layers; l++) {
        const gpu_layer *ly = &r->layers[l];
        char *kpool = (char *)kv->mem[r->rank] + (size_t)2 * l * kv->layer_bytes, *vpool = kpool + kv->layer_bytes;
        KL(cas_gpu_rmsnorm(r->x, NULL, ly->attn_norm, r->xb, T, E, c->rms_eps, s));
        if ((st = gemm(r, ly->wqkv, r->xb, r->qkv, QD + 2 * KD, E, T, 0))) return st;
        KL(cas_gpu_rope_store(r->qkv, r->cs, r->d_slot, r->q, kpool, vpool, T, c->n_head, c->n_head_kv, c->head_dim,
                              c->n_rot, s));
        if ((st = cas_cuda_attn_run(r->attn, kpool, vpool, r->q, r->att, r->lse, s))) return st;
        KL(cas_gpu_to_bf16(r->att, r->attb, (int64_t)T * QD, s));
        if ((st = gemm(r, ly->wo, r->attb, r->x, E, QD, T, resid)) || (st = ranks_sum(m, r, r->x, (int64_t)T * E)))
            return st;
        KL(cas_gpu_rmsnorm(r->x, NULL, ly->ffn_norm, r->xb, T, E, c->rms_eps, s));
        if ((st = gemm(r, ly->wgu, r->xb, r->qkv, 2 * F, E, T, 0))) return st;
        KL(cas_gpu_silu_mul(r->qkv, r->xb, T, F, s));
        if ((st = gemm(r, ly->wdown, r->xb, r->x, E, F, T, resid)) || (st = ranks_sum(m, r, r->x, (int64_t)T * E)))
            return st;
    }
    if (NL > 0 && r->rank == 0) {
        KL(cas_gpu_rmsnorm(r->x, r->d_rows, r->out_norm, r->xl, NL, E, c->rms_eps, s));
        if ((st = gemm(r, r->output, r->xl, r->logits, c->n_vocab, E, NL, 0))) return st;
        if (sample) KL(cas_gpu_sample_rows(r->logits, NL, c->n_vocab, r->d_samp, r->d_out, s));
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

/* Pads the staged decode step of B rows to its graph bucket: the rows past B
 * get token 0 at position 0, no K/V slot (slot -1: rope_store writes
 * nothing) and greedy sampling. Returns the bucket. */
static int32_t graph_pad(cas_gpu_model *m, int32_t B) {
    const int32_t Tp = graph_bucket(m, B);
    for (int32_t i = B; i < Tp; i++) {
        m->h_tokens[i] = 0;
        m->h_pos[i] = 0;
        m->h_slot[i] = -1;
        m->h_rows[i] = i;
        m->h_samp[i] = (gpu_sample_row){0.0f, 0, 1.0f, 0.0f, 0.0f, 0};
    }
    return Tp;
}

/* Runs a rank's padded decode step of Tp rows through the graph of its
 * bucket, capturing it on first use. */
static cas_status forward_graph(cas_gpu_model *m, gpu_rank *r, cas_gpu_kv *kv, int32_t Tp) {
    cas_status st = CAS_OK;
    if (r->graph_kv != kv->mem[r->rank] || r->graph_attn != r->attn) { /* pools or context changed: capture anew */
        graphs_drop(r);
        r->graph_kv = kv->mem[r->rank];
        r->graph_attn = r->attn;
    }
    const int32_t NL = r->rank == 0 ? Tp : 0;
    gpu_graph *g = NULL;
    for (int32_t i = 0; i < r->n_graphs && !g; i++)
        if (r->graphs[i].t == Tp) g = &r->graphs[i];
    if (!g && !r->capture_failed) {
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        cudaError_t e = cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeThreadLocal);
        if (e == cudaSuccess) {
            st = forward_body(m, r, kv, Tp, NL, 1);
            e = cudaStreamEndCapture(r->stream, &graph);
            if (!st && e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
            if (graph) cudaGraphDestroy(graph);
        }
        if (st || e != cudaSuccess) {
            /* the same padded launches, eagerly from now on: same numbers */
            cas_log(CAS_LOG_WARN, "gpu: decode steps run without CUDA graphs: capturing %d rows failed: %s", Tp,
                    st ? cas_last_error() : cudaGetErrorString(e));
            cudaGetLastError();
            r->capture_failed = 1;
            st = CAS_OK;
        } else {
            g = &r->graphs[r->n_graphs++];
            g->t = Tp;
            g->exec = exec;
            if (r->rank == 0) m->graph_info.captures++;
        }
    }
    if (g) {
        CU(cudaGraphLaunch(g->exec, r->stream));
        if (r->rank == 0) m->graph_info.replays++;
    } else {
        if ((st = forward_body(m, r, kv, Tp, NL, 1))) return st;
        if (r->rank == 0) m->graph_info.padded_eager++;
    }
fail:
    return st;
}

#define OTHER_RANK_FAILED "another rank failed this step"

/* One rank's part of a step: upload, the layers (eager or the graph),
 * rank 0's results to the host, and the wait for its stream. */
static cas_status rank_step(cas_gpu_model *m, gpu_rank *r, const gpu_job *j) {
    cas_status st = CAS_OK;
    CU(cudaSetDevice(r->device)); /* the current device is per thread */
    st = forward_upload(m, r, j);
    if (m->n_ranks > 1) {
        /* a rank that cannot run the step must not leave the others waiting in a sum:
         * all learn of it before any starts */
        if (st) m->upload_failed = 1;
        pthread_barrier_wait(&m->barrier);
        if (!st && m->upload_failed) st = cas_error(CAS_ERR_INTERNAL, "gpu: %s", OTHER_RANK_FAILED);
    }
    if (st) goto fail;
    if (j->graph) st = forward_graph(m, r, j->kv, j->T);
    else st = forward_body(m, r, j->kv, j->T, r->rank == 0 ? j->NL : 0, j->sample);
    if (st) goto fail;
    if (r->rank == 0 && j->NL > 0) {
        const int32_t V = m->cfg.n_vocab;
        if (!j->sample) {
            CU(cudaMemcpyAsync(j->logits, r->logits, (size_t)j->NL * V * 4, cudaMemcpyDeviceToHost, r->stream));
        } else {
            CU(cudaMemcpyAsync(m->h_out, r->d_out, (size_t)j->NL * 4, cudaMemcpyDeviceToHost, r->stream));
            for (int32_t i = 0; i < j->NL; i++)
                if (j->rows[i].want_logits)
                    CU(cudaMemcpyAsync(j->logits + (size_t)i * V, r->logits + (size_t)i * V, (size_t)V * 4,
                                       cudaMemcpyDeviceToHost, r->stream));
        }
    }
    CU(cudaStreamSynchronize(r->stream));
fail:
    if (st) cudaStreamSynchronize(r->stream);
    return st;
}

static void *rank_thread(void *arg) {
    gpu_rank *r = arg;
    cas_gpu_model *m = r->model;
    pthread_mutex_lock(&m->mu);
    for (;;) {
        while (!m->quit && m->gen == r->seen) pthread_cond_wait(&m->go, &m->mu);
        if (m->quit) break;
        r->seen = m->gen;
        pthread_mutex_unlock(&m->mu);
        r->st = rank_step(m, r, &m->job);
        if (r->st) snprintf(r->err, sizeof r->err, "%s", cas_last_error());
        pthread_mutex_lock(&m->mu);
        if (--m->pending == 0) pthread_cond_signal(&m->done);
    }
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

/* Every rank runs the job: ranks past 0 on their threads, rank 0 here; the
 * first failure's message is raised on this thread (rank 0's own first).
 * A failure in preparing the step (its attention tasks, the upload) stops
 * every rank before the layers. A rank failing inside the layers would
 * leave the others waiting in a sum: every rank runs the same launches on
 * the same shapes, so that is a device's fault, not a batch's (bad batches
 * are refused before this). */
static cas_status ranks_run(cas_gpu_model *m, const gpu_job *j) {
    m->job = *j;
    m->upload_failed = 0;
    if (m->n_ranks > 1) {
        pthread_mutex_lock(&m->mu);
        m->pending = m->n_ranks - 1;
        m->gen++;
        pthread_cond_broadcast(&m->go);
        pthread_mutex_unlock(&m->mu);
    }
    gpu_rank *r0 = &m->ranks[0];
    r0->st = rank_step(m, r0, &m->job);
    if (m->n_ranks == 1) return r0->st;
    if (r0->st) snprintf(r0->err, sizeof r0->err, "%s", cas_last_error());
    pthread_mutex_lock(&m->mu);
    while (m->pending > 0) pthread_cond_wait(&m->done, &m->mu);
    pthread_mutex_unlock(&m->mu);
    cudaSetDevice(r0->device);
    /* the rank that failed, rather than one told that another did */
    for (int pass = 0; pass < 2; pass++)
        for (int32_t i = 0; i < m->n_ranks; i++) {
            const gpu_rank *r = &m->ranks[i];
            if (r->st && (pass || !strstr(r->err, OTHER_RANK_FAILED)))
                return cas_error(r->st, "gpu rank %d: %s", i, r->err);
        }
    return CAS_OK;
}

cas_status cas_gpu_forward(cas_gpu_model *m, cas_gpu_kv *kv, const cas_model_batch *b, float *logits) {
    if (!logits) return cas_error(CAS_ERR_INVALID, "gpu forward: NULL logits");
    int32_t T = 0, NL = 0;
    cas_status st = forward_prepare(m, kv, b, NULL, &T, &NL);
    if (st) return st;
    const gpu_job j = {kv, b, T, NL, 0, 0, NULL, logits};
    if ((st = ranks_run(m, &j))) return st;
    m->graph_info.eager++;
    return CAS_OK;
}

cas_status cas_gpu_forward_sample(cas_gpu_model *m, cas_gpu_kv *kv, const cas_model_batch *b,
                                  const cas_gpu_sample *rows, int32_t *tokens, float *logits) {
    if (!rows || !tokens) return cas_error(CAS_ERR_INVALID, "gpu forward: NULL sampling rows or tokens");
    int32_t T = 0, NL = 0;
    cas_status st = forward_prepare(m, kv, b, rows, &T, &NL);
    if (st) return st;
    for (int32_t i = 0; i < NL; i++)
        if (rows[i].want_logits && !logits)
            return cas_error(CAS_ERR_INVALID, "gpu forward: row %d wants logits and logits is NULL", i);
    /* a decode step (a token and a logits row per sequence, in order) replays a graph */
    int decode = m->opts.graphs && T == b->n_seqs && NL == T;
    for (int32_t i = 0; decode && i < NL; i++) decode = m->h_rows[i] == i;
    gpu_job j = {kv, b, T, NL, decode, 1, rows, logits};
    if (decode) j.T = graph_pad(m, T); /* padded rows' tokens are computed, not returned */
    if ((st = ranks_run(m, &j))) return st;
    if (!decode) m->graph_info.eager++;
    memcpy(tokens, m->h_out, (size_t)NL * 4);
    return CAS_OK;
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
int32_t cas_gpu_model_ranks(const cas_gpu_model *m) { return 0; }
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
