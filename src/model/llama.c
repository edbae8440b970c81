/*
 * llama.c: the Llama-family forward pass on the CPU.
 *
 * The file reads top to bottom like the model: hyper-parameters and weights
 * from the GGUF file, the paged K/V store, then one forward pass over a
 * ragged batch (embeddings; per layer RMSNorm, Q/K/V projections, RoPE, K/V
 * written into their pages, attention through the cascade plan, output
 * projection, SwiGLU MLP; final norm and logits for the wanted rows).
 *
 * Why it is built this way:
 * - Weights stay in their file types inside the mapping: decode is bound by
 *   the bytes of weights read per token, and the quantized kernels
 *   (quant_impl.h) read Q4_1/Q8_0 blocks in place. Only the small 1-D norm
 *   vectors are converted to f32 at load. Where the AMX kernels run, the
 *   matrices of the batched forward also get a packed copy (the same bytes
 *   in 16-row panels, on huge pages), made once at load.
 * - All tokens of a step, whatever sequence they belong to, go through each
 *   weight matrix in one cas_q_matmul call, so one read of the weights
 *   serves the whole batch; per-sequence structure only matters in attention,
 *   which takes the batch in the contract's compressed rows.
 * - The attention plan is built once per forward and run by every layer:
 *   the page tables are the same for all layers, only the pools differ.
 * - Scratch (activations, kernel workspace, RoPE tables) is sized at creation
 *   from max_batch_tokens and max_logits; the forward allocates nothing.
 *
 * RoPE: arch llama in GGUF uses the "normal" rotation of adjacent pairs
 * (x[2i], x[2i+1]) by pos * base^(-2i/n_rot); the converter from Hugging Face
 * permutes the Q and K weights so that this equals HF's rotate-half form.
 * qwen2, qwen3 and phi3 files are not permuted and rotate halves (x[i],
 * x[i+n_rot/2]); phi3 keeps Q, K, V in one matrix and gate, up in another,
 * which the batched forward multiplies by as they are.
 *
 * The other architectures are the same block with per-token additions
 * between the Q/K/V projections and the K/V store (qkv_token): biases
 * (qwen2), RMSNorm of every Q and K head (qwen3). They act on one token's
 * rows, so a token's logits stay independent of its batch.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <omp.h>

#include "model.h"
#include "quant_impl.h"

/* ---- weights -------------------------------------------------------------- */

/* A weight matrix of `rows` outputs by `cols` inputs, in the mapping. */
typedef struct {
    const void *data;
    int type; /* cas_ttype */
    int64_t rows, cols;
    size_t bytes;
    const void *packed; /* the same matrix in the AMX kernels' layout (quant_impl.h), or NULL */
} cas_mat;

typedef struct {
    float *attn_norm; /* [n_embd], owned f32 */
    float *ffn_norm;  /* [n_embd], owned f32 */
    float *bq, *bk, *bv; /* [n_head * head_dim], [n_head_kv * head_dim] x 2: biases of the
                            projections (qwen2), owned f32; NULL where the file has none */
    float *q_norm, *k_norm; /* [head_dim] RMSNorm weights of every Q and K head (qwen3, gemma3),
                               owned f32; NULL for the other architectures */
    float *attn_post_norm, *ffn_post_norm; /* [n_embd] RMSNorm weights of the attention's and the
                                              MLP's outputs (Gemma), owned f32; else NULL */
    cas_mat wq;       /* [n_head * head_dim][n_embd] */
    cas_mat wk;       /* [n_head_kv * head_dim][n_embd] */
    cas_mat wv;       /* [n_head_kv * head_dim][n_embd] */
    cas_mat wo;       /* [n_embd][n_head * head_dim] */
    cas_mat w_gate;   /* [n_ff][n_embd] */
    cas_mat w_up;     /* [n_ff][n_embd] */
    cas_mat w_down;   /* [n_embd][n_ff] */
    /* Fused matrices for the batched forward, when the parts share a type: one kernel call
     * (one pass of thread start-up and one tail imbalance instead of three or two) per
     * projection. Where the AMX kernels run they exist only packed (data NULL: the packed
     * copy of the parts, one after the other, is the packed fused matrix); elsewhere as a
     * copy in the file layout. rows == 0 when not fused. */
    cas_mat wqkv;     /* [(n_head + 2 n_head_kv) * head_dim][n_embd]: wq, wk, wv rows */
    cas_mat w_gu;     /* [2 n_ff][n_embd]: w_gate then w_up rows */
    void *fused;      /* owned storage of the file-layout fused copies, or NULL */
} cas_layer;

struct cas_model {
    cas_model_config cfg;
    cas_model_opts opts;
    const cas_gguf *g;
    cas_gguf *owned_g; /* set when cas_model_load opened the file */

    cas_mat tok_embd;  /* [n_vocab][n_embd] */
    cas_mat output;    /* [n_vocab][n_embd]; the embedding when tied */
    void *packed;      /* owned storage of every packed matrix (cas_mat.packed points in), or NULL */
    float *out_norm;   /* [n_embd] */
    cas_layer *layers; /* [n_layers] */
    float *inv_freq;   /* [n_rot / 2] cas_model_rope_freqs: base^(-2i / n_rot), scaled */
    float *inv_freq_swa; /* [n_rot / 2] the same for the windowed layers where their RoPE differs
                            (Gemma 3), else NULL */

    /* scratch of one forward; T = max_batch_tokens, L = max_logits */
    float *x;     /* [T][n_embd] residual stream */
    float *xb;    /* [T][n_embd] normed input of a projection */
    float *q;     /* [T][n_head * head_dim] */
    float *k;     /* [T][n_head_kv * head_dim] */
    float *v;     /* [T][n_head_kv * head_dim] */
    float *att;   /* [T][n_head * head_dim] attention output */
    float *proj;  /* [T][n_embd] output of wo / w_down */
    float *gate;  /* [T][n_ff] */
    float *up;    /* [T][n_ff] */
    float *fout;  /* [T][max(QD + 2 KD, 2 n_ff)] output of a fused projection */
    float *rope;  /* [T][n_rot / 2][2] cos, sin of each token's position */
    float *rope_swa; /* [T][n_rot / 2][2] the same by inv_freq_swa, or NULL */
    float *xl;    /* [L][n_embd] normed rows that get logits */
    int32_t *pos; /* [T] */
    int32_t *seq_of; /* [T] */
    int32_t *logit_rows; /* [max_seqs] default rows */
    void *work;   /* matmul workspace */
    size_t work_bytes;
    /* single-token forward: per-thread normed x and its quantized form */
    int nt;          /* threads of every parallel region */
    cas_simd_level simd; /* opts.simd resolved on this CPU (attention and matrix kernels) */
    int avx2;        /* kernels' instruction set (1 AVX2, 0 portable) */
    int qlevel;      /* the single-token kernels' level (cas_q_level) */
    int avx512;      /* batched SwiGLU on AVX-512; only with avx2 */
    int amx;         /* batched products on AMX-INT8, from packed copies of the weights */
    float *tx;       /* [nt][tx_stride] */
    uint8_t *tq;     /* [nt][tq_stride] */
    size_t tx_stride, tq_stride;
    cas_attn_plan *plan[2];    /* [0] the layers without the sliding window, [1] those with it
                                  (attention params differ, the page tables do not); NULL where
                                  no layer needs it */
    cas_attn_shape plan_shape; /* the KV geometry the plans were created for */
};

struct cas_model_kv {
    int32_t num_pages, page_size, n_layers;
    cas_dtype dtype;
    size_t layer_bytes; /* bytes of one pool of one layer */
    void *k;            /* [n_layers][num_pages][page_size][n_head_kv][head_dim] */
    void *v;
    cas_attn_shape shape;
};

cas_model_opts cas_model_opts_default(void) {
    cas_model_opts o;
    o.max_batch_tokens = 512;
    o.max_seqs = 64;
    o.max_logits = 0;
    o.threads = 0;
    o.cascade = CAS_CASCADE_AUTO;
    o.portable_kernels = 0;
    o.batch_invariant = 1;
    o.simd = CAS_SIMD_AUTO;
    o.amx_off = 0;
    return o;
}

static cas_status get_u32_opt(const cas_gguf *g, const char *key, int32_t def, int32_t *out) {
    if (cas_gguf_find_kv(g, key) < 0) {
        if (def < 0) return cas_error(CAS_ERR_FORMAT, "model: missing key %s", key);
        *out = def;
        return CAS_OK;
    }
    uint32_t v;
    cas_status st = cas_gguf_get_u32(g, key, &v);
    if (st) return st;
    if (v == 0 || v > (1u << 30)) return cas_error(CAS_ERR_FORMAT, "model: %s = %u is out of range", key, v);
    *out = (int32_t)v;
    return CAS_OK;
}

/* Finds a 2-D weight of the expected shape and a type the kernels handle. */
static cas_status find_mat(const cas_gguf *g, const char *name, int64_t rows, int64_t cols,
                           cas_mat *out) {
    const cas_gguf_tensor *t = cas_gguf_find_tensor(g, name);
    if (!t) return cas_error(CAS_ERR_FORMAT, "model: tensor %s is missing", name);
    if (!cas_tensor_type_supported(t->type))
        return cas_error(CAS_ERR_UNSUPPORTED,
                         "model: tensor %s has type %s, which cascade cannot compute with "
                         "(supported: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, "
                         "iq4_nl, iq4_xs)",
                         name, cas_ttype_ggml_name(t->type) ? cas_ttype_ggml_name(t->type) : "?");
    if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != 1 || t->ne[3] != 1)
        return cas_error(CAS_ERR_FORMAT, "model: tensor %s is %lld x %lld, expected %lld x %lld",
                         name, (long long)t->ne[1], (long long)t->ne[0], (long long)rows,
                         (long long)cols);
    out->data = t->data;
    out->type = t->type;
    out->rows = rows;
    out->cols = cols;
    out->bytes = t->nbytes;
    return CAS_OK;
}

/* Rows r0 .. r0 + n - 1 of w, in place (rows lie one after the other in every type). */
static cas_mat mat_rows(const cas_mat *w, int64_t r0, int64_t n) {
    const size_t rb = w->bytes / (size_t)w->rows;
    return (cas_mat){(const uint8_t *)w->data + (size_t)r0 * rb, w->type, n, w->cols, (size_t)n * rb, NULL};
}

/* A 1-D norm weight, converted to an owned f32 vector. */
static cas_status load_vec(const cas_gguf *g, const char *name, int64_t n, float **out) {
    const cas_gguf_tensor *t = cas_gguf_find_tensor(g, name);
    if (!t) return cas_error(CAS_ERR_FORMAT, "model: tensor %s is missing", name);
    if (t->n_elem != n || t->ne[0] != n)
        return cas_error(CAS_ERR_FORMAT, "model: tensor %s has %lld elements, expected %lld", name,
                         (long long)t->n_elem, (long long)n);
    if (!cas_tensor_type_supported(t->type))
        return cas_error(CAS_ERR_UNSUPPORTED, "model: tensor %s has unsupported type %s", name,
                         cas_ttype_ggml_name(t->type) ? cas_ttype_ggml_name(t->type) : "?");
    float *v = cas_alloc_array((size_t)n, sizeof(float));
    if (!v) return cas_error(CAS_ERR_NOMEM, "model: %s", name);
    cas_status st = cas_q_dequantize_row(t->type, t->data, v, n);
    if (st) {
        cas_free(v);
        return st;
    }
    *out = v;
    return CAS_OK;
}

cas_status cas_model_config_synthetic(const char *name, cas_model_config *c) {
    static const struct {
        const char *name;
        int32_t layers, embd, ff, heads, kv_heads, head_dim, vocab, ctx;
        float rope_base;
        int tied;
    } known[] = {
        {"llama-3.2-1b", 16, 2048, 8192, 32, 8, 64, 128256, 131072, 500000.0f, 1},
        {"llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256, 8192, 500000.0f, 0},
        {"llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256, 8192, 500000.0f, 0},
    };
    for (size_t i = 0; name && i < sizeof known / sizeof known[0]; i++) {
        if (strcmp(name, known[i].name)) continue;
        memset(c, 0, sizeof *c);
        c->n_layers = known[i].layers;
        c->n_embd = known[i].embd;
        c->n_ff = known[i].ff;
        c->n_head = known[i].heads;
        c->n_head_kv = known[i].kv_heads;
        c->head_dim = known[i].head_dim;
        c->n_rot = known[i].head_dim;
        c->n_vocab = known[i].vocab;
        c->n_ctx_train = known[i].ctx;
        c->rope_base = known[i].rope_base;
        c->rms_eps = 1e-5f;
        c->tied_embeddings = known[i].tied;
        c->arch = CAS_ARCH_LLAMA;
        c->rope_freq_scale = 1.0f;
        return CAS_OK;
    }
    return cas_error(CAS_ERR_INVALID, "model: no synthetic model '%s' (llama-3.2-1b, llama-3-8b, llama-3-70b)",
                     name ? name : "(null)");
}

const char *cas_model_arch_name(cas_model_arch arch) {
    switch (arch) {
    case CAS_ARCH_LLAMA: return "llama";
    case CAS_ARCH_QWEN2: return "qwen2";
    case CAS_ARCH_QWEN3: return "qwen3";
    case CAS_ARCH_PHI3: return "phi3";
    case CAS_ARCH_GEMMA2: return "gemma2";
    case CAS_ARCH_GEMMA3: return "gemma3";
    }
    return "?";
}

int cas_model_layer_windowed(const cas_model_config *c, int32_t l) {
    const int32_t p = c->swa_pattern;
    return c->sliding_window > 0 && (p == 0 || l % p < p - 1);
}

static int is_gemma(cas_model_arch a) { return a == CAS_ARCH_GEMMA2 || a == CAS_ARCH_GEMMA3; }

/* Whether the forward of c's architecture reads the tensor of this name: a
 * tensor it would leave unused (an output bias, a per-layer scale of another
 * family) would change the model's output, so the file is refused instead. */
static int tensor_used(const char *name, const cas_model_config *c) {
    static const char *const top[] = {"token_embd.weight", "output.weight", "output_norm.weight"};
    static const char *const blk[] = {"attn_norm.weight", "ffn_norm.weight", "attn_q.weight",  "attn_k.weight",
                                      "attn_v.weight",    "attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                                      "ffn_down.weight",  "attn_q.bias",     "attn_k.bias",    "attn_v.bias"};
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        if (!strcmp(name, top[i])) return 1;
    if (c->arch == CAS_ARCH_LLAMA && !strcmp(name, "rope_freqs.weight")) return 1;
    if (strncmp(name, "blk.", 4)) return 0;
    const char *p = name + 4;
    long l = 0;
    if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] != '.')) return 0; /* blk.01 is not layer 1's */
    while (*p >= '0' && *p <= '9' && l <= INT32_MAX) l = l * 10 + (*p++ - '0');
    if (*p++ != '.' || l >= c->n_layers) return 0;
    for (size_t i = 0; i < sizeof blk / sizeof blk[0]; i++)
        if (!strcmp(p, blk[i])) return 1;
    if (c->arch != CAS_ARCH_PHI3 && !strcmp(p, "ffn_gate.weight")) return 1; /* phi3's is in ffn_up */
    if (is_gemma(c->arch) && (!strcmp(p, "post_attention_norm.weight") || !strcmp(p, "post_ffw_norm.weight")))
        return 1;
    return (c->arch == CAS_ARCH_QWEN3 || c->arch == CAS_ARCH_GEMMA3) &&
           (!strcmp(p, "attn_q_norm.weight") || !strcmp(p, "attn_k_norm.weight"));
}

/* attention.sliding_window_pattern: a period P (layer l windowed when l % P < P - 1; 0 all,
 * 1 none), or one flag per layer, which must follow such a period. */
static cas_status read_swa_pattern(const cas_gguf *g, const char *key, cas_model_config *c) {
    if (cas_gguf_kv_type(g, cas_gguf_find_kv(g, key)) != CAS_GGUF_ARRAY) {
        uint32_t p;
        cas_status st = cas_gguf_get_u32(g, key, &p);
        if (st) return st;
        if (p > (1u << 30)) return cas_error(CAS_ERR_FORMAT, "model: %s = %u is out of range", key, p);
        c->swa_pattern = (int32_t)p;
        return CAS_OK;
    }
    cas_gguf_arr a;
    cas_status st = cas_gguf_get_arr(g, key, -1, &a);
    if (st) return st;
    if (a.n != (uint64_t)c->n_layers)
        return cas_error(CAS_ERR_FORMAT, "model: %s has %llu flags for %d layers", key, (unsigned long long)a.n,
                         c->n_layers);
    for (int32_t p = 0; p <= c->n_layers + 1; p++) {
        int same = 1;
        for (int32_t l = 0; l < c->n_layers && same; l++) {
            int64_t v;
            if ((st = cas_gguf_arr_int(&a, (uint64_t)l, &v))) return st;
            same = (v != 0) == (p == 0 || l % p < p - 1);
        }
        if (same) {
            c->swa_pattern = p;
            return CAS_OK;
        }
    }
    return cas_error(CAS_ERR_UNSUPPORTED, "model: %s: windowed layers that repeat no period are not supported", key);
}

cas_status cas_model_config_read(const cas_gguf *g, cas_model_config *c) {
    const char *arch = NULL;
    cas_status st = cas_gguf_get_str(g, "general.architecture", &arch, NULL);
    if (st) return st;
    memset(c, 0, sizeof *c);
    if (!strcmp(arch, "llama")) c->arch = CAS_ARCH_LLAMA;
    else if (!strcmp(arch, "qwen2")) c->arch = CAS_ARCH_QWEN2;
    else if (!strcmp(arch, "qwen3")) c->arch = CAS_ARCH_QWEN3;
    else if (!strcmp(arch, "phi3")) c->arch = CAS_ARCH_PHI3;
    else if (!strcmp(arch, "gemma2")) c->arch = CAS_ARCH_GEMMA2;
    else if (!strcmp(arch, "gemma3")) c->arch = CAS_ARCH_GEMMA3;
    else
        return cas_error(CAS_ERR_UNSUPPORTED, "model: architecture '%s' is not supported (cascade runs llama, qwen2, "
                         "qwen3, phi3, gemma2, gemma3)", arch);
    /* the hyper-parameters' keys carry the architecture's name */
    char k[128];
#define KEY(s) (snprintf(k, sizeof k, "%s." s, arch), k)
    if ((st = get_u32_opt(g, KEY("block_count"), -1, &c->n_layers))) return st;
    if ((st = get_u32_opt(g, KEY("embedding_length"), -1, &c->n_embd))) return st;
    if ((st = get_u32_opt(g, KEY("feed_forward_length"), -1, &c->n_ff))) return st;
    if ((st = get_u32_opt(g, KEY("attention.head_count"), -1, &c->n_head))) return st;
    if ((st = get_u32_opt(g, KEY("attention.head_count_kv"), c->n_head, &c->n_head_kv))) return st;
    if ((st = get_u32_opt(g, KEY("context_length"), 2048, &c->n_ctx_train))) return st;
    if (c->n_embd % c->n_head)
        return cas_error(CAS_ERR_FORMAT, "model: embedding length %d is not a multiple of %d heads",
                         c->n_embd, c->n_head);
    if ((st = get_u32_opt(g, KEY("attention.key_length"), c->n_embd / c->n_head, &c->head_dim))) return st;
    int32_t vlen;
    if ((st = get_u32_opt(g, KEY("attention.value_length"), c->head_dim, &vlen))) return st;
    if (vlen != c->head_dim)
        return cas_error(CAS_ERR_UNSUPPORTED, "model: value heads of %d differ from key heads of %d", vlen,
                         c->head_dim);
    if ((st = get_u32_opt(g, KEY("rope.dimension_count"), c->head_dim, &c->n_rot))) return st;
    if (c->n_head % c->n_head_kv)
        return cas_error(CAS_ERR_FORMAT, "model: %d query heads are not a multiple of %d KV heads",
                         c->n_head, c->n_head_kv);
    if (c->n_rot > c->head_dim || c->n_rot % 2)
        return cas_error(CAS_ERR_FORMAT, "model: rope dimension %d does not fit head_dim %d",
                         c->n_rot, c->head_dim);
    if (!cas_attn_head_dim_supported(c->head_dim))
        return cas_error(CAS_ERR_UNSUPPORTED, "model: head_dim %d is not supported by the attention core",
                         c->head_dim);
    c->rope_base = 10000.0f;
    if (cas_gguf_find_kv(g, KEY("rope.freq_base")) >= 0 && (st = cas_gguf_get_f32(g, k, &c->rope_base)))
        return st;
    if ((st = cas_gguf_get_f32(g, KEY("attention.layer_norm_rms_epsilon"), &c->rms_eps))) return st;
    if (!(c->rope_base > 0) || !(c->rms_eps >= 0))
        return cas_error(CAS_ERR_FORMAT, "model: rope base %g or rms eps %g out of range",
                         (double)c->rope_base, (double)c->rms_eps);
    /* RoPE scaling: linear (positions divided by the factor, which llama.cpp applies whenever
     * the file gives one) runs; YaRN and LongRoPE change more than the frequencies */
    if (cas_gguf_find_kv(g, KEY("rope.scaling.type")) >= 0) {
        const char *sc = NULL;
        if ((st = cas_gguf_get_str(g, k, &sc, NULL))) return st;
        if (strcmp(sc, "none") && strcmp(sc, "linear"))
            return cas_error(CAS_ERR_UNSUPPORTED, "model: rope scaling '%s' is not supported (none, linear)", sc);
    }
    float factor = 0;
    if (cas_gguf_find_kv(g, KEY("rope.scaling.factor")) >= 0 || cas_gguf_find_kv(g, KEY("rope.scale_linear")) >= 0)
        if ((st = cas_gguf_get_f32(g, k, &factor))) return st;
    if (!(factor >= 0) || isinf(factor))
        return cas_error(CAS_ERR_FORMAT, "model: %s = %g is out of range", k, (double)factor);
    c->rope_freq_scale = factor > 0 ? 1.0f / factor : 1.0f;
    c->rope_neox = c->arch != CAS_ARCH_LLAMA;
    /* Only llama and Gemma read a window (Mistral's, Gemma's local layers); qwen2 files may
     * carry an unused one (its use_sliding_window is off), phi3 files one that llama.cpp does
     * not apply either, and a per-layer pattern is Gemma's only */
    const int gemma = is_gemma(c->arch);
    if ((c->arch == CAS_ARCH_LLAMA || gemma) && cas_gguf_find_kv(g, KEY("attention.sliding_window")) >= 0) {
        uint32_t w;
        if ((st = cas_gguf_get_u32(g, k, &w))) return st;
        if (w > (1u << 30)) return cas_error(CAS_ERR_FORMAT, "model: %s = %u is out of range", k, w);
        c->sliding_window = (int32_t)w;
    } else if (c->arch == CAS_ARCH_GEMMA2) {
        c->sliding_window = 4096; /* Gemma 2's, which llama.cpp assumes without the key */
    }
    if (cas_gguf_find_kv(g, KEY("attention.sliding_window_pattern")) >= 0) {
        if (!gemma)
            return cas_error(CAS_ERR_UNSUPPORTED, "model: %s (sliding windows on some layers only) is not supported "
                             "for %s", k, arch);
        if ((st = read_swa_pattern(g, k, c))) return st;
    } else if (gemma) {
        c->swa_pattern = c->arch == CAS_ARCH_GEMMA2 ? 2 : 6;
    }
    if (gemma) {
        /* as llama.cpp's Gemma graphs: the embeddings scaled, post-norms, GeGLU, the query
         * scale of head_dim except in the 27B models (recognised by their layer counts, as
         * llama.cpp does: Gemma's query_pre_attn_scalar is not in the file) */
        c->embd_scale = sqrtf((float)c->n_embd);
        c->post_norms = 1;
        c->gelu_gate = 1;
        const int big = c->n_layers == (c->arch == CAS_ARCH_GEMMA2 ? 46 : 62);
        c->attn_scale = 1.0f / sqrtf((float)(big ? c->n_embd / c->n_head : c->head_dim));
        /* the soft caps: Gemma 2 always, with defaults; Gemma 3 the logits' where given */
        float acap = c->arch == CAS_ARCH_GEMMA2 ? 50.0f : 0.0f, fcap = c->arch == CAS_ARCH_GEMMA2 ? 30.0f : 0.0f;
        if (c->arch == CAS_ARCH_GEMMA2 && cas_gguf_find_kv(g, KEY("attn_logit_softcapping")) >= 0 &&
            (st = cas_gguf_get_f32(g, k, &acap)))
            return st;
        if (cas_gguf_find_kv(g, KEY("final_logit_softcapping")) >= 0 && (st = cas_gguf_get_f32(g, k, &fcap)))
            return st;
        if (!(acap >= 0) || !(fcap >= 0) || isinf(acap) || isinf(fcap))
            return cas_error(CAS_ERR_FORMAT, "model: soft caps %g and %g are out of range", (double)acap,
                             (double)fcap);
        c->attn_softcap = acap;
        c->final_softcap = fcap;
        /* the windowed layers' RoPE: Gemma 2 as the others', Gemma 3 base 10000 and no scaling */
        c->rope_base_swa = c->arch == CAS_ARCH_GEMMA2 ? c->rope_base : 10000.0f;
        c->rope_freq_scale_swa = c->arch == CAS_ARCH_GEMMA2 ? c->rope_freq_scale : 1.0f;
        if (cas_gguf_find_kv(g, KEY("rope.freq_base_swa")) >= 0 && (st = cas_gguf_get_f32(g, k, &c->rope_base_swa)))
            return st;
        if (!(c->rope_base_swa > 0))
            return cas_error(CAS_ERR_FORMAT, "model: %s = %g is out of range", k, (double)c->rope_base_swa);
    }
#undef KEY
    /* the vocabulary is the embedding's rows; without output.weight the logits use it too */
    const cas_gguf_tensor *te = cas_gguf_find_tensor(g, "token_embd.weight");
    if (!te) return cas_error(CAS_ERR_FORMAT, "model: tensor token_embd.weight is missing");
    if (te->ne[1] <= 0 || te->ne[1] > INT32_MAX)
        return cas_error(CAS_ERR_FORMAT, "model: token_embd.weight has %lld rows", (long long)te->ne[1]);
    c->n_vocab = (int32_t)te->ne[1];
    c->tied_embeddings = cas_gguf_find_tensor(g, "output.weight") == NULL;
    /* every tensor is one the forward reads; which optional ones are there */
    for (int64_t i = 0; i < cas_gguf_n_tensors(g); i++) {
        const char *name = cas_gguf_tensor_at(g, i)->name;
        if (!tensor_used(name, c))
            return cas_error(CAS_ERR_UNSUPPORTED, "model: tensor %s is not part of the %s architecture as cascade "
                             "runs it", name, arch);
        size_t n = strlen(name);
        if (n > 5 && !strcmp(name + n - 5, ".bias")) c->qkv_bias = 1;
        if (strstr(name, "_norm.weight") && (strstr(name, "attn_q_norm") || strstr(name, "attn_k_norm")))
            c->qk_norm = 1;
        if (!strcmp(name, "rope_freqs.weight")) c->rope_freq_factors = 1;
    }
    if ((c->arch == CAS_ARCH_QWEN3 || c->arch == CAS_ARCH_GEMMA3) && !c->qk_norm)
        return cas_error(CAS_ERR_FORMAT, "model: tensor blk.0.attn_q_norm.weight is missing (%s)", arch);
    if (c->rope_freq_factors) {
        const cas_gguf_tensor *t = cas_gguf_find_tensor(g, "rope_freqs.weight");
        if (t->n_elem != c->n_rot / 2 || t->ne[0] != c->n_rot / 2)
            return cas_error(CAS_ERR_FORMAT, "model: tensor rope_freqs.weight has %lld elements, expected %d",
                             (long long)t->n_elem, c->n_rot / 2);
        if (!cas_tensor_type_supported(t->type))
            return cas_error(CAS_ERR_UNSUPPORTED, "model: tensor rope_freqs.weight has unsupported type %s",
                             cas_ttype_name(t->type) ? cas_ttype_name(t->type) : "?");
    }
    return CAS_OK;
}

cas_status cas_model_rope_freqs(const cas_gguf *g, const cas_model_config *c, float *inv_freq) {
    const int32_t half = c->n_rot / 2;
    const cas_gguf_tensor *t = NULL;
    if (c->rope_freq_factors) {
        t = g ? cas_gguf_find_tensor(g, "rope_freqs.weight") : NULL;
        if (!t || t->n_elem != half)
            return cas_error(CAS_ERR_FORMAT, "model: tensor rope_freqs.weight is missing or not %d long", half);
        /* the factors go through inv_freq first: a scratch of the right length */
        cas_status st = cas_q_dequantize_row(t->type, t->data, inv_freq, half);
        if (st) return st;
        for (int32_t i = 0; i < half; i++)
            if (!(inv_freq[i] > 0) || isinf(inv_freq[i]))
                return cas_error(CAS_ERR_FORMAT, "model: rope_freqs.weight[%d] = %g is not a positive factor", (int)i,
                                 (double)inv_freq[i]);
    }
    /* 0: a config filled by hand, before the field existed */
    const double scale = c->rope_freq_scale > 0 ? (double)c->rope_freq_scale : 1.0;
    for (int32_t i = 0; i < half; i++) {
        double f = pow((double)c->rope_base, -2.0 * i / c->n_rot) * scale;
        inv_freq[i] = (float)(t ? f / (double)inv_freq[i] : f);
    }
    return CAS_OK;
}

void cas_model_destroy(cas_model *m) {
    if (!m) return;
    if (m->layers) {
        for (int32_t l = 0; l < m->cfg.n_layers; l++) {
            cas_free(m->layers[l].attn_norm);
            cas_free(m->layers[l].ffn_norm);
            cas_free(m->layers[l].bq);
            cas_free(m->layers[l].bk);
            cas_free(m->layers[l].bv);
            cas_free(m->layers[l].q_norm);
            cas_free(m->layers[l].k_norm);
            cas_free(m->layers[l].attn_post_norm);
            cas_free(m->layers[l].ffn_post_norm);
            cas_free(m->layers[l].fused);
        }
        free(m->layers);
    }
    cas_free(m->out_norm);
    free(m->packed); /* aligned_alloc */
    cas_free(m->inv_freq);
    cas_free(m->inv_freq_swa);
    float *bufs[] = {m->x, m->xb, m->q, m->k, m->v, m->att, m->proj, m->gate, m->up, m->rope, m->xl, m->fout,
                     m->rope_swa};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cas_free(bufs[i]);
    cas_free(m->pos);
    cas_free(m->seq_of);
    cas_free(m->logit_rows);
    cas_free(m->work);
    cas_free(m->tx);
    cas_free(m->tq);
    cas_attn_plan_destroy(m->plan[0]);
    cas_attn_plan_destroy(m->plan[1]);
    cas_gguf_close(m->owned_g);
    free(m);
}

/* Bytes the packed copies of the quantized matrices among ms[k] take, each
 * rounded up to 64. */
static size_t packed_size(cas_mat *const *ms, int k) {
    size_t total = 0;
    for (int i = 0; i < k; i++) total += (cas_q_packed_bytes(ms[i]->type, ms[i]->rows, ms[i]->cols) + 63) & ~(size_t)63;
    return total;
}

/* Packs the quantized matrices among ms[k] (cas_q_pack) at *cur, back to
 * back, and advances *cur; the others keep packed = NULL. */
static cas_status pack_mats(uint8_t **cur, cas_mat *const *ms, int k) {
    for (int i = 0; i < k; i++) {
        size_t b = cas_q_packed_bytes(ms[i]->type, ms[i]->rows, ms[i]->cols);
        if (!b) continue;
        cas_status st = cas_q_pack(ms[i]->type, ms[i]->data, ms[i]->rows, ms[i]->cols, *cur);
        if (st) return st;
        ms[i]->packed = *cur;
        *cur += (b + 63) & ~(size_t)63;
    }
    return CAS_OK;
}

/* The matrices of a layer the batched forward multiplies by, in packing
 * order: for a fused layer the parts of each fused matrix back to back
 * (which is the packed fused matrix when the parts' rows are whole panels). */
static void layer_mats(cas_layer *L, cas_mat *ms[7]) {
    cas_mat *fused[7] = {&L->wq, &L->wk, &L->wv, &L->w_gate, &L->w_up, &L->wo, &L->w_down};
    cas_mat *parts[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
    memcpy(ms, L->wqkv.rows ? fused : parts, sizeof fused);
}

static cas_status pack_layer(cas_layer *L, uint8_t **cur) {
    cas_mat *ms[7];
    layer_mats(L, ms);
    cas_status st = pack_mats(cur, ms, 7);
    if (st || !L->wqkv.rows) return st;
    L->wqkv.packed = L->wq.packed;
    L->w_gu.packed = L->w_gate.packed;
    L->wq.packed = L->wk.packed = L->wv.packed = L->w_gate.packed = L->w_up.packed = NULL;
    return CAS_OK;
}

/* All packed weights in one allocation on 2 MiB boundaries, advised as huge
 * pages where the OS has them: about 100 MB stream through every batched
 * step, and with 4 KiB pages a TLB walk every few panels cost 3-6% of a
 * cold 32-token matmul (measured: 3072x576 Q4_1 168-173 -> 162-167 us,
 * 49152x576 Q8_0 2447 -> 2293-2348 us, 2 threads). Freed with free(). */
static void *alloc_huge(size_t bytes) {
    const size_t a = (size_t)2 << 20, r = (bytes + a - 1) & ~(a - 1);
    void *p = aligned_alloc(a, r);
#ifdef MADV_HUGEPAGE
    if (p) (void)madvise(p, r, MADV_HUGEPAGE);
#endif
    return p;
}

/* Largest matmul workspace over the model's matrices for m tokens. */
static size_t work_for(const cas_mat *w, int64_t m, int nt, size_t cur) {
    size_t b = cas_q_work_bytes(w->type, w->rows, w->cols, m, nt);
    return b > cur ? b : cur;
}

cas_status cas_model_create(const cas_gguf *g, const cas_model_opts *opts_in, cas_model **out) {
    *out = NULL;
    cas_model_opts o = opts_in ? *opts_in : cas_model_opts_default();
    if (o.max_batch_tokens <= 0 || o.max_seqs <= 0 || o.max_logits < 0 || o.threads < 0)
        return cas_error(CAS_ERR_INVALID, "model: invalid options (max_batch_tokens %d, max_seqs %d, "
                         "max_logits %d, threads %d)", o.max_batch_tokens, o.max_seqs, o.max_logits,
                         o.threads);
    cas_simd_level simd;
    cas_status st = cas_simd_resolve(o.simd, "model", &simd);
    if (st) return st;
    if (o.max_logits == 0) o.max_logits = o.max_seqs;
    if (o.max_seqs > o.max_batch_tokens) o.max_seqs = o.max_batch_tokens;
    if (o.max_logits > o.max_batch_tokens) o.max_logits = o.max_batch_tokens;

    cas_model *m = calloc(1, sizeof *m);
    if (!m) return cas_error(CAS_ERR_NOMEM, "model");
    m->g = g;
    m->opts = o;
    m->simd = simd;
    /* AMX-INT8 needs AVX-512 for its scaling: a lower level turns it off too */
    m->amx = !o.portable_kernels && !o.amx_off && simd == CAS_SIMD_AVX512 && cas_q_amx_available();
    st = cas_model_config_read(g, &m->cfg);
    if (st) goto fail;
    cas_model_config *c = &m->cfg;
    const int64_t E = c->n_embd, F = c->n_ff, QD = (int64_t)c->n_head * c->head_dim,
                  KD = (int64_t)c->n_head_kv * c->head_dim;

    if ((st = find_mat(g, "token_embd.weight", c->n_vocab, E, &m->tok_embd))) goto fail;
    if (!c->tied_embeddings) {
        if ((st = find_mat(g, "output.weight", c->n_vocab, E, &m->output))) goto fail;
    } else {
        m->output = m->tok_embd;
    }
    if ((st = load_vec(g, "output_norm.weight", E, &m->out_norm))) goto fail;
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) {
        st = cas_error(CAS_ERR_NOMEM, "model: layers");
        goto fail;
    }
    int64_t wbytes = (int64_t)m->output.bytes;
    /* packed copies for the AMX kernels of batched forwards, only where they will run */
    const int pack = m->amx;
    for (int32_t l = 0; l < c->n_layers; l++) {
        cas_layer *L = &m->layers[l];
        char name[96];
#define NAME(s) (snprintf(name, sizeof name, "blk.%d." s, (int)l), name)
        if ((st = load_vec(g, NAME("attn_norm.weight"), E, &L->attn_norm))) goto fail;
        if ((st = load_vec(g, NAME("ffn_norm.weight"), E, &L->ffn_norm))) goto fail;
        /* Q, K and V as three matrices or one (attn_qkv, rows in that order); gate and up
         * as two or, in phi3, one (ffn_up, gate rows first): the parts are row ranges of
         * the fused matrix then */
        cas_mat file_qkv = {0}, file_gu = {0};
        if (cas_gguf_find_tensor(g, NAME("attn_qkv.weight"))) {
            if ((st = find_mat(g, name, QD + 2 * KD, E, &file_qkv))) goto fail;
            L->wq = mat_rows(&file_qkv, 0, QD);
            L->wk = mat_rows(&file_qkv, QD, KD);
            L->wv = mat_rows(&file_qkv, QD + KD, KD);
        } else {
            if ((st = find_mat(g, NAME("attn_q.weight"), QD, E, &L->wq))) goto fail;
            if ((st = find_mat(g, NAME("attn_k.weight"), KD, E, &L->wk))) goto fail;
            if ((st = find_mat(g, NAME("attn_v.weight"), KD, E, &L->wv))) goto fail;
        }
        if ((st = find_mat(g, NAME("attn_output.weight"), E, QD, &L->wo))) goto fail;
        if (c->arch == CAS_ARCH_PHI3) {
            if ((st = find_mat(g, NAME("ffn_up.weight"), 2 * F, E, &file_gu))) goto fail;
            L->w_gate = mat_rows(&file_gu, 0, F);
            L->w_up = mat_rows(&file_gu, F, F);
        } else {
            if ((st = find_mat(g, NAME("ffn_gate.weight"), F, E, &L->w_gate))) goto fail;
            if ((st = find_mat(g, NAME("ffn_up.weight"), F, E, &L->w_up))) goto fail;
        }
        if ((st = find_mat(g, NAME("ffn_down.weight"), E, F, &L->w_down))) goto fail;
        /* the optional biases, each on its own as llama.cpp reads them */
        if (cas_gguf_find_tensor(g, NAME("attn_q.bias")) && (st = load_vec(g, name, QD, &L->bq))) goto fail;
        if (cas_gguf_find_tensor(g, NAME("attn_k.bias")) && (st = load_vec(g, name, KD, &L->bk))) goto fail;
        if (cas_gguf_find_tensor(g, NAME("attn_v.bias")) && (st = load_vec(g, name, KD, &L->bv))) goto fail;
        if (c->qk_norm) {
            if ((st = load_vec(g, NAME("attn_q_norm.weight"), c->head_dim, &L->q_norm))) goto fail;
            if ((st = load_vec(g, NAME("attn_k_norm.weight"), c->head_dim, &L->k_norm))) goto fail;
        }
        if (c->post_norms) {
            if ((st = load_vec(g, NAME("post_attention_norm.weight"), E, &L->attn_post_norm))) goto fail;
            if ((st = load_vec(g, NAME("post_ffw_norm.weight"), E, &L->ffn_post_norm))) goto fail;
        }
#undef NAME
        /* fused matrices: packed only where AMX runs and the parts are whole panels (and the
         * packed sizes multiples of 64, so that pack_mats lays them back to back), else a
         * copy in the file layout */
        const int uniform = L->wq.type == L->wk.type && L->wk.type == L->wv.type && L->w_gate.type == L->w_up.type;
        const size_t pbq = cas_q_packed_block_bytes(L->wq.type), pbg = cas_q_packed_block_bytes(L->w_gate.type);
        const int packed_only = uniform && pack && pbq && pbg && QD % CAS_Q_PANEL == 0 &&
                                KD % CAS_Q_PANEL == 0 && F % CAS_Q_PANEL == 0 &&
                                (size_t)(E / 32) * pbq * (KD / CAS_Q_PANEL) % 64 == 0 &&
                                (size_t)(E / 32) * pbq * (QD / CAS_Q_PANEL) % 64 == 0 &&
                                (size_t)(E / 32) * pbg * (F / CAS_Q_PANEL) % 64 == 0;
        if (packed_only) {
            size_t a = L->wq.bytes + L->wk.bytes + L->wv.bytes, b2 = L->w_gate.bytes + L->w_up.bytes;
            L->wqkv = (cas_mat){NULL, L->wq.type, QD + 2 * KD, E, a, NULL};
            L->w_gu = (cas_mat){NULL, L->w_gate.type, 2 * F, E, b2, NULL};
        } else if (uniform) {
            /* a copy of the parts the file keeps apart; the file's own fused matrices as they are */
            size_t a = L->wq.bytes + L->wk.bytes + L->wv.bytes, b2 = L->w_gate.bytes + L->w_up.bytes;
            size_t need = (file_qkv.data ? 0 : a) + (file_gu.data ? 0 : b2);
            uint8_t *f = need ? cas_alloc(need) : NULL;
            if (need && !f) {
                st = cas_error(CAS_ERR_NOMEM, "model: fused weights of layer %d", (int)l);
                goto fail;
            }
            L->fused = f;
            if (file_qkv.data) {
                L->wqkv = file_qkv;
            } else {
                memcpy(f, L->wq.data, L->wq.bytes);
                memcpy(f + L->wq.bytes, L->wk.data, L->wk.bytes);
                memcpy(f + L->wq.bytes + L->wk.bytes, L->wv.data, L->wv.bytes);
                L->wqkv = (cas_mat){f, L->wq.type, QD + 2 * KD, E, a, NULL};
                f += a;
            }
            if (file_gu.data) {
                L->w_gu = file_gu;
            } else {
                memcpy(f, L->w_gate.data, L->w_gate.bytes);
                memcpy(f + L->w_gate.bytes, L->w_up.data, L->w_up.bytes);
                L->w_gu = (cas_mat){f, L->w_gate.type, 2 * F, E, b2, NULL};
            }
        }
        wbytes += (int64_t)(L->wq.bytes + L->wk.bytes + L->wv.bytes + L->wo.bytes + L->w_gate.bytes +
                            L->w_up.bytes + L->w_down.bytes);
    }
    c->weight_bytes_per_token = wbytes;
    if (pack) {
        size_t total = packed_size((cas_mat *[]){&m->output}, 1);
        for (int32_t l = 0; l < c->n_layers; l++) {
            cas_mat *ms[7];
            layer_mats(&m->layers[l], ms);
            total += packed_size(ms, 7);
        }
        uint8_t *cur = m->packed = total ? alloc_huge(total) : NULL;
        if (total && !cur) {
            st = cas_error(CAS_ERR_NOMEM, "model: %zu bytes of packed weights", total);
            goto fail;
        }
        if ((st = pack_mats(&cur, (cas_mat *[]){&m->output}, 1))) goto fail;
        for (int32_t l = 0; l < c->n_layers; l++)
            if ((st = pack_layer(&m->layers[l], &cur))) goto fail;
    }

    m->inv_freq = cas_alloc_array((size_t)c->n_rot / 2 + 1, sizeof(float));
    if (!m->inv_freq) {
        st = cas_error(CAS_ERR_NOMEM, "model: rope table");
        goto fail;
    }
    if ((st = cas_model_rope_freqs(g, c, m->inv_freq))) goto fail;
    if (c->sliding_window > 0 && c->rope_base_swa > 0 &&
        (c->rope_base_swa != c->rope_base || c->rope_freq_scale_swa != c->rope_freq_scale)) {
        cas_model_config cs = *c;
        cs.rope_base = c->rope_base_swa;
        cs.rope_freq_scale = c->rope_freq_scale_swa;
        m->inv_freq_swa = cas_alloc_array((size_t)c->n_rot / 2 + 1, sizeof(float));
        if (!m->inv_freq_swa) {
            st = cas_error(CAS_ERR_NOMEM, "model: rope table");
            goto fail;
        }
        if ((st = cas_model_rope_freqs(g, &cs, m->inv_freq_swa))) goto fail;
    }

    /* scratch */
    const size_t T = (size_t)o.max_batch_tokens, Lr = (size_t)o.max_logits;
#define ALLOC(p, n)                                                                  \
    do {                                                                             \
        if (!((p) = cas_alloc_array((n), sizeof *(p)))) {                            \
            st = cas_error(CAS_ERR_NOMEM, "model: scratch for %zu tokens", T);       \
            goto fail;                                                               \
        }                                                                            \
    } while (0)
    ALLOC(m->x, T * E);
    ALLOC(m->xb, T * E);
    ALLOC(m->q, T * QD);
    ALLOC(m->k, T * KD);
    ALLOC(m->v, T * KD);
    ALLOC(m->att, T * QD);
    ALLOC(m->proj, T * E);
    ALLOC(m->gate, T * F);
    ALLOC(m->up, T * F);
    ALLOC(m->fout, T * (size_t)(QD + 2 * KD > 2 * F ? QD + 2 * KD : 2 * F));
    ALLOC(m->rope, T * (size_t)(c->n_rot / 2 + 1) * 2);
    if (m->inv_freq_swa) ALLOC(m->rope_swa, T * (size_t)(c->n_rot / 2 + 1) * 2);
    ALLOC(m->xl, Lr * E);
    ALLOC(m->pos, T);
    ALLOC(m->seq_of, T);
    ALLOC(m->logit_rows, (size_t)o.max_seqs);
#undef ALLOC
    int nt = o.threads > 0 ? o.threads : omp_get_max_threads();
    size_t wb = 0;
    for (int32_t l = 0; l < c->n_layers; l++) {
        const cas_layer *L = &m->layers[l];
        const cas_mat *ms[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down,
                               &L->wqkv, &L->w_gu};
        for (size_t i = 0; i < (L->wqkv.rows ? 9u : 7u); i++) {
            wb = work_for(ms[i], (int64_t)T, nt, wb);
            wb = work_for(ms[i], 1, nt, wb);
        }
    }
    for (int64_t r = 1; r <= (int64_t)Lr; r *= 2) wb = work_for(&m->output, r, nt, wb);
    wb = work_for(&m->output, (int64_t)Lr, nt, wb);
    m->work_bytes = wb + 64;
    m->work = cas_alloc(m->work_bytes);
    if (!m->work) {
        st = cas_error(CAS_ERR_NOMEM, "model: matmul workspace of %zu bytes", m->work_bytes);
        goto fail;
    }
    m->nt = nt;
    m->avx2 = cas_q_resolve_avx2(o.portable_kernels || simd == CAS_SIMD_GENERIC ? CAS_Q_SIMD_GENERIC
                                                                                : CAS_Q_SIMD_AUTO);
    m->avx512 = m->avx2 && simd == CAS_SIMD_AVX512;
    m->qlevel = cas_q_level(m->avx2, m->avx512);
    {
        int64_t mx = E > QD ? E : QD;
        if (F > mx) mx = F;
        m->tx_stride = ((size_t)mx + 15) & ~(size_t)15;
        m->tq_stride = cas_q_xvec_bytes(mx);
        m->tx = cas_alloc_array((size_t)nt * m->tx_stride, sizeof(float));
        m->tq = cas_alloc_array((size_t)nt, m->tq_stride);
        if (!m->tx || !m->tq) {
            st = cas_error(CAS_ERR_NOMEM, "model: per-thread scratch");
            goto fail;
        }
    }
    *out = m;
    return CAS_OK;
fail:
    cas_model_destroy(m);
    return st;
}

cas_status cas_model_load(const char *path, const cas_model_opts *opts, cas_model **out) {
    *out = NULL;
    cas_gguf *g = NULL;
    cas_status st = opts && opts->mmap_weights ? cas_gguf_open(path, &g) : cas_gguf_open_read(path, &g);
    if (st) return st;
    st = cas_model_create(g, opts, out);
    if (st) {
        cas_gguf_close(g);
        return st;
    }
    (*out)->owned_g = g;
    return CAS_OK;
}

const cas_model_config *cas_model_config_of(const cas_model *m) { return &m->cfg; }
const cas_gguf *cas_model_gguf(const cas_model *m) { return m->g; }
const cas_model_opts *cas_model_opts_of(const cas_model *m) { return &m->opts; }

void cas_model_set_cascade(cas_model *m, cas_cascade_mode mode) {
    if (m->opts.cascade != mode) {
        m->opts.cascade = mode;
        for (int i = 0; i < 2; i++) { /* rebuilt with the new mode at the next forward */
            cas_attn_plan_destroy(m->plan[i]);
            m->plan[i] = NULL;
        }
    }
}

/* ---- paged K/V store (cas_model_kv) --------------------------------------- */

static size_t page_bytes(const cas_model *m, int32_t page_size, cas_dtype dtype) {
    return (size_t)page_size * (size_t)m->cfg.n_head_kv * (size_t)m->cfg.head_dim *
           cas_dtype_size(dtype);
}

int32_t cas_model_kv_pages_for_budget(const cas_model *m, int32_t page_size, cas_dtype dtype,
                                      size_t budget_bytes) {
    if (page_size <= 0) return 0;
    size_t per = page_bytes(m, page_size, dtype) * 2 * (size_t)m->cfg.n_layers;
    size_t n = budget_bytes / per;
    return n > INT32_MAX ? INT32_MAX : (int32_t)n;
}

cas_status cas_model_kv_create(const cas_model *m, int32_t num_pages, int32_t page_size,
                               cas_dtype dtype, cas_model_kv **out) {
    *out = NULL;
    if (page_size < 1 || page_size > CAS_ATTN_MAX_PAGE_SIZE)
        return cas_error(CAS_ERR_INVALID, "model kv: page size %d is outside 1..%d", page_size,
                         CAS_ATTN_MAX_PAGE_SIZE);
    if (num_pages < 1) return cas_error(CAS_ERR_INVALID, "model kv: %d pages", num_pages);
    if (dtype != CAS_F32 && dtype != CAS_F16 && dtype != CAS_BF16)
        return cas_error(CAS_ERR_INVALID, "model kv: unknown storage type %d", (int)dtype);
    cas_model_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return cas_error(CAS_ERR_NOMEM, "model kv");
    kv->num_pages = num_pages;
    kv->page_size = page_size;
    kv->n_layers = m->cfg.n_layers;
    kv->dtype = dtype;
    kv->layer_bytes = page_bytes(m, page_size, dtype) * (size_t)num_pages;
    size_t total = kv->layer_bytes * (size_t)kv->n_layers;
    if (total / kv->n_layers != kv->layer_bytes) {
        free(kv);
        return cas_error(CAS_ERR_NOMEM, "model kv: size overflows");
    }
    /* huge pages too: attention reads each sequence's pages wherever they are */
    kv->k = alloc_huge(total);
    kv->v = alloc_huge(total);
    if (!kv->k || !kv->v) {
        cas_model_kv_destroy(kv);
        return cas_error(CAS_ERR_NOMEM, "model kv: 2 x %zu bytes for %d pages", total, num_pages);
    }
    memset(kv->k, 0, total);
    memset(kv->v, 0, total);
    kv->shape.num_qo_heads = m->cfg.n_head;
    kv->shape.num_kv_heads = m->cfg.n_head_kv;
    kv->shape.head_dim = m->cfg.head_dim;
    kv->shape.page_size = page_size;
    kv->shape.kv_dtype = dtype;
    *out = kv;
    return CAS_OK;
}

void cas_model_kv_destroy(cas_model_kv *kv) {
    if (!kv) return;
    free(kv->k); /* aligned_alloc */
    free(kv->v);
    free(kv);
}

int32_t cas_model_kv_num_pages(const cas_model_kv *kv) { return kv->num_pages; }
int32_t cas_model_kv_page_size(const cas_model_kv *kv) { return kv->page_size; }
size_t cas_model_kv_bytes(const cas_model_kv *kv) { return 2 * kv->layer_bytes * (size_t)kv->n_layers; }

/* ---- forward ----------------------------------------------------------------- */

static void rmsnorm_rows(float *out, const float *x, const float *w, int64_t rows, int64_t n,
                         float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        double ss = 0;
        for (int64_t i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        float s = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
        for (int64_t i = 0; i < n; i++) o[i] = xr[i] * s * w[i];
    }
}

/* Rotates adjacent pairs of the first n_rot elements of each head. */
static void rope_rows(float *x, int64_t rows, int32_t heads, int32_t head_dim, int32_t n_rot,
                      const float *cs) {
    const int32_t half = n_rot / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cs + t * (int64_t)half * 2;
        for (int32_t h = 0; h < heads; h++) {
            float *v = x + (t * heads + h) * head_dim;
            for (int32_t i = 0; i < half; i++) {
                float co = c[2 * i], si = c[2 * i + 1];
                float a = v[2 * i], b = v[2 * i + 1];
                v[2 * i] = a * co - b * si;
                v[2 * i + 1] = a * si + b * co;
            }
        }
    }
}

/* Rotates pairs (x[i], x[i + n_rot/2]) of each head of one token: the
 * rotate-half form that qwen2, qwen3 and phi3 files keep (their converters do
 * not permute Q and K into adjacent pairs); the dims past n_rot stay. */
static void rope_rows_neox(float *x, int32_t heads, int32_t head_dim, int32_t n_rot, const float *cs) {
    const int32_t half = n_rot / 2;
    for (int32_t h = 0; h < heads; h++) {
        float *v = x + (int64_t)h * head_dim;
        for (int32_t i = 0; i < half; i++) {
            float co = cs[2 * i], si = cs[2 * i + 1];
            float a = v[i], b = v[i + half];
            v[i] = a * co - b * si;
            v[i + half] = a * si + b * co;
        }
    }
}

/* y = W x for rows rows of x; prep (or NULL) makes each row of x first (cas_q_opts.prep). */
static cas_status matmul_prep(const cas_model *m, const cas_mat *w, const float *x, int64_t rows, float *y,
                              void (*prep)(void *, int64_t), void *prep_ctx) {
    cas_q_opts o;
    memset(&o, 0, sizeof o);
    o.prep = prep;
    o.prep_ctx = prep_ctx;
    o.nthreads = m->opts.threads;
    /* AUTO takes AMX for a batched call given the packed copy, which exists only where m->amx;
     * AVX512 takes the AVX-512 kernels of the types that have them (the K-quants) */
    o.simd = !m->avx2 ? CAS_Q_SIMD_GENERIC : m->amx ? CAS_Q_SIMD_AUTO : m->avx512 ? CAS_Q_SIMD_AVX512 : CAS_Q_SIMD_AVX2;
    o.work = m->work;
    o.work_bytes = m->work_bytes;
    o.packed = w->packed;
    if (rows == 1) return cas_q_matvec(w->type, w->data, w->rows, w->cols, x, y, &o);
    return cas_q_matmul(w->type, w->data, w->rows, w->cols, x, rows, y, &o);
}

static cas_status matmul(const cas_model *m, const cas_mat *w, const float *x, int64_t rows, float *y) {
    return matmul_prep(m, w, x, rows, y, NULL, NULL);
}

/* Stores one token's K (or V) row of n f32 values in the pool's storage type
 * (F16 with F16C where the kernels are SIMD: the same rounding). */
static void store_row(cas_dtype dt, void *dst, const float *src, int64_t n, int avx2) {
    if (dt == CAS_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dt == CAS_F16 && avx2) {
        cas_q_avx2_f32_to_f16(src, dst, n);
    } else if (dt == CAS_F16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = cas_f32_to_f16(src[i]);
    } else {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = cas_f32_to_bf16(src[i]);
    }
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* The elementwise steps shared by the single-token and batched forwards, so
 * that both give the same bits: SIMD versions where the kernels are SIMD
 * (quant_avx2.c), else the portable loops. */
static void norm_vec(const cas_model *m, float *out, const float *x, const float *w, int64_t n) {
    if (m->avx2)
        cas_q_avx2_rmsnorm(out, x, w, n, m->cfg.rms_eps);
    else
        rmsnorm_rows(out, x, w, 1, n, m->cfg.rms_eps);
}

static void norm_row(const cas_model *m, float *out, const float *x, const float *w) {
    norm_vec(m, out, x, w, m->cfg.n_embd);
}

/* wide: the batched forward, which may use 512-bit vectors (same bits) */
static void silu_mul(const cas_model *m, const float *g, const float *u, float *h, int64_t n, int wide) {
    if (wide && m->avx512)
        cas_q_avx512_silu_mul(g, u, h, n);
    else if (m->avx2)
        cas_q_avx2_silu_mul(g, u, h, n);
    else
        for (int64_t i = 0; i < n; i++) h[i] = silu(g[i]) * u[i];
}

/* The batched forward's elementwise steps between the matrix products, one
 * token row at a time, run by the next product's kernels where they quantize
 * that row (cas_q_opts.prep): no parallel region and pass over the rows of
 * their own. */
typedef struct {
    const cas_model *m;
    const float *norm; /* RMSNorm weights: xb row = norm(x row) */
    int add;           /* x row += proj row first (the residual of the last product) */
    int fused;         /* SwiGLU: 1 gate and up side by side in fout, 0 in gate and up */
    const float *post; /* RMSNorm weights of the proj row before it is added (Gemma), or NULL */
} prep_ctx;

/* x row += proj row (normed by c->post first, in place, where given). */
static void add_residual(const prep_ctx *c, int64_t t) {
    const cas_model *m = c->m;
    const int64_t E = m->cfg.n_embd;
    float *xt = m->x + t * E, *pt = m->proj + t * E;
    if (c->post) norm_vec(m, pt, pt, c->post, E);
    for (int64_t i = 0; i < E; i++) xt[i] += pt[i];
}

static void prep_residual_norm(void *ctx, int64_t t) {
    const prep_ctx *c = ctx;
    const cas_model *m = c->m;
    const int64_t E = m->cfg.n_embd;
    if (c->add) add_residual(c, t);
    norm_row(m, m->xb + t * E, m->x + t * E, c->norm);
}

/* GELU, tanh approximation (Gemma's gelu_pytorch_tanh), times up: GeGLU.
 * src/core's vector version: the same bits on every level and at every
 * position, so portable and SIMD models, and any split of the rows, agree. */
static void gelu_mul(const float *g, const float *u, float *h, int64_t n) { cas_gelu_mul(g, u, h, n); }

static void prep_swiglu(void *ctx, int64_t t) {
    const prep_ctx *c = ctx;
    const cas_model *m = c->m;
    const int64_t F = m->cfg.n_ff;
    const float *g = c->fused ? m->fout + t * 2 * F : m->gate + t * F;
    const float *u = c->fused ? m->fout + t * 2 * F + F : m->up + t * F;
    if (m->cfg.gelu_gate)
        gelu_mul(g, u, m->gate + t * F, F);
    else
        silu_mul(m, g, u, m->gate + t * F, F, 1);
}

/* RoPE of one token's heads rows (q or k), the same function in both forwards. */
static void rope_token(const cas_model *m, float *x, int32_t heads, const float *cs) {
    const cas_model_config *c = &m->cfg;
    if (c->rope_neox)
        rope_rows_neox(x, heads, c->head_dim, c->n_rot, cs);
    else if (m->avx2)
        cas_q_avx2_rope(x, heads, c->head_dim, c->n_rot, cs);
    else
        rope_rows(x, 1, heads, c->head_dim, c->n_rot, cs);
}

/* What happens to one token's q, k and v rows between the projections and the
 * K/V store: the biases, the per-head norms, RoPE. One token at a time, the
 * same function in both forwards, so a token's rows do not depend on its
 * batch. */
static void qkv_token(const cas_model *m, const cas_layer *L, float *q, float *k, float *v, const float *cs) {
    const cas_model_config *c = &m->cfg;
    const int64_t D = c->head_dim, QD = (int64_t)c->n_head * D, KD = (int64_t)c->n_head_kv * D;
    if (L->bq)
        for (int64_t i = 0; i < QD; i++) q[i] += L->bq[i];
    if (L->bk)
        for (int64_t i = 0; i < KD; i++) k[i] += L->bk[i];
    if (L->bv)
        for (int64_t i = 0; i < KD; i++) v[i] += L->bv[i];
    if (L->q_norm)
        for (int32_t h = 0; h < c->n_head; h++) norm_vec(m, q + h * D, q + h * D, L->q_norm, D);
    if (L->k_norm)
        for (int32_t h = 0; h < c->n_head_kv; h++) norm_vec(m, k + h * D, k + h * D, L->k_norm, D);
    rope_token(m, q, c->n_head, cs);
    rope_token(m, k, c->n_head_kv, cs);
}

/* One layer for a batch of one token (single-sequence decode), in two
 * parallel regions around the attention instead of one region per matrix:
 * every thread normalizes and quantizes the (small) input vector itself,
 * computes its own rows of each matrix and the elementwise work on them
 * (residual adds, SwiGLU), and threads meet only where a full vector is
 * needed next. Bit-identical to the batched path with T = 1 (same kernels,
 * same per-row arithmetic). Needs wq, wk, wv of one type, and w_gate, w_up
 * of one type (x is quantized once for each group). */
static cas_status layer_one_token(cas_model *m, const cas_layer *L, cas_model_kv *kv, int32_t l,
                                  size_t kv_at, cas_attn_plan *plan, const float *rope) {
    const cas_model_config *c = &m->cfg;
    const int64_t E = c->n_embd, QD = (int64_t)c->n_head * c->head_dim,
                  KD = (int64_t)c->n_head_kv * c->head_dim, F = c->n_ff;
    const int avx2 = m->avx2, ql = m->qlevel;
    const size_t rb_q = L->wq.bytes / (size_t)QD, rb_k = L->wk.bytes / (size_t)KD, rb_o = L->wo.bytes / (size_t)E,
                 rb_g = L->w_gate.bytes / (size_t)F, rb_d = L->w_down.bytes / (size_t)E;
    uint8_t *kpool = (uint8_t *)kv->k + (size_t)l * kv->layer_bytes;
    uint8_t *vpool = (uint8_t *)kv->v + (size_t)l * kv->layer_bytes;
    float *qkv = m->fout; /* [q | k | v] of the token */
#pragma omp parallel num_threads(m->nt)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        float *xf = m->tx + (size_t)tid * m->tx_stride;
        uint8_t *xq = m->tq + (size_t)tid * m->tq_stride;
        int64_t r0, r1;
        norm_row(m, xf, m->x, L->attn_norm);
        /* q, k and v rows of this thread (x quantized once: the three share a type) */
        cas_q_xvec_quantize(L->wq.type, xf, E, xq, ql);
        cas_q_thread_rows(QD, tid, nth, &r0, &r1);
        cas_q_matvec_range(L->wq.type, L->wq.data, rb_q, E, r0, r1, xf, xq, qkv, ql);
        cas_q_thread_rows(KD, tid, nth, &r0, &r1);
        cas_q_matvec_range(L->wk.type, L->wk.data, rb_k, E, r0, r1, xf, xq, qkv + QD, ql);
        cas_q_matvec_range(L->wv.type, L->wv.data, rb_k, E, r0, r1, xf, xq, qkv + QD + KD, ql);
#pragma omp barrier
#pragma omp single nowait
        {
            qkv_token(m, L, qkv, qkv + QD, qkv + QD + KD, rope);
            store_row(kv->dtype, kpool + kv_at, qkv + QD, KD, avx2);
            store_row(kv->dtype, vpool + kv_at, qkv + QD + KD, KD, avx2);
        }
    }
    cas_kv_pool pool = {kpool, vpool, kv->num_pages};
    cas_status st = cas_attn_plan_run(plan, &pool, qkv, m->att, NULL);
    if (st) return st;
#pragma omp parallel num_threads(m->nt)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        float *xf = m->tx + (size_t)tid * m->tx_stride;
        uint8_t *xq = m->tq + (size_t)tid * m->tq_stride;
        int64_t r0, r1;
        /* attention output projection and residual, own rows */
        cas_q_xvec_quantize(L->wo.type, m->att, QD, xq, ql);
        cas_q_thread_rows(E, tid, nth, &r0, &r1);
        cas_q_matvec_range(L->wo.type, L->wo.data, rb_o, QD, r0, r1, m->att, xq, m->proj, ql);
        for (int64_t i = r0; i < r1; i++) m->x[i] += m->proj[i];
#pragma omp barrier
        /* gate and up rows [r0, r1) of this thread, then SwiGLU on them */
        norm_row(m, xf, m->x, L->ffn_norm);
        cas_q_xvec_quantize(L->w_gate.type, xf, E, xq, ql);
        cas_q_thread_rows(F, tid, nth, &r0, &r1);
        cas_q_matvec_range(L->w_gate.type, L->w_gate.data, rb_g, E, r0, r1, xf, xq, m->fout, ql);
        cas_q_matvec_range(L->w_up.type, L->w_up.data, rb_g, E, r0, r1, xf, xq, m->fout + F, ql);
        silu_mul(m, m->fout + r0, m->fout + F + r0, m->gate + r0, r1 - r0, 0);
#pragma omp barrier
        /* down projection and residual, own rows */
        cas_q_xvec_quantize(L->w_down.type, m->gate, F, xq, ql);
        cas_q_thread_rows(E, tid, nth, &r0, &r1);
        cas_q_matvec_range(L->w_down.type, L->w_down.data, rb_d, F, r0, r1, m->gate, xq, m->proj, ql);
        for (int64_t i = r0; i < r1; i++) m->x[i] += m->proj[i];
    }
    return CAS_OK;
}

cas_status cas_model_forward(cas_model *m, cas_model_kv *kv, const cas_model_batch *b,
                             float *logits) {
    const cas_model_config *c = &m->cfg;
    if (!b || b->n_seqs <= 0 || !b->tokens || !b->qo_indptr || !b->kv_indptr || !b->kv_indices ||
        !b->kv_last_page_len || !logits)
        return cas_error(CAS_ERR_INVALID, "forward: empty batch or NULL array");
    if (kv->n_layers != c->n_layers || kv->shape.num_kv_heads != c->n_head_kv ||
        kv->shape.head_dim != c->head_dim)
        return cas_error(CAS_ERR_INVALID, "forward: the K/V store was made for another model");
    const int32_t B = b->n_seqs;
    if (B > m->opts.max_seqs)
        return cas_error(CAS_ERR_NOMEM, "forward: %d sequences, capacity %d", B, m->opts.max_seqs);
    if (b->qo_indptr[0] != 0) return cas_error(CAS_ERR_INVALID, "forward: qo_indptr[0] != 0");
    for (int32_t r = 0; r < B; r++)
        if (b->qo_indptr[r + 1] <= b->qo_indptr[r])
            return cas_error(CAS_ERR_INVALID, "forward: sequence %d has no new tokens", r);
    const int64_t T = b->qo_indptr[B];
    if (T > m->opts.max_batch_tokens)
        return cas_error(CAS_ERR_NOMEM, "forward: %lld tokens, capacity %d", (long long)T,
                         m->opts.max_batch_tokens);
    const int32_t *lrows = b->logit_rows;
    int32_t NL = b->n_logits;
    if (!lrows) {
        for (int32_t r = 0; r < B; r++) m->logit_rows[r] = b->qo_indptr[r + 1] - 1;
        lrows = m->logit_rows;
        NL = B;
    }
    if (NL < 0 || NL > m->opts.max_logits)
        return cas_error(CAS_ERR_NOMEM, "forward: %d rows of logits, capacity %d", NL, m->opts.max_logits);
    for (int32_t i = 0; i < NL; i++)
        if (lrows[i] < 0 || lrows[i] >= T)
            return cas_error(CAS_ERR_INVALID, "forward: logit row %d is outside 0..%lld", lrows[i],
                             (long long)T - 1);
    for (int64_t t = 0; t < T; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= c->n_vocab)
            return cas_error(CAS_ERR_INVALID, "forward: token id %d at row %lld is outside the vocabulary",
                             b->tokens[t], (long long)t);

    /* The attention batch; the plan validates page ids, lengths and q_len <= kv_len. */
    cas_attn_batch ab = {B, b->qo_indptr, b->kv_indptr, b->kv_indices, b->kv_last_page_len};
    cas_attn_params ap = cas_attn_params_default();
    ap.sm_scale = c->attn_scale;
    ap.logits_soft_cap = c->attn_softcap;
    cas_status st;
    /* The plans know the page size and storage type of the pools: a forward on a cache of
     * another geometry needs new plans (once, when the caller switches caches). */
    if (memcmp(&m->plan_shape, &kv->shape, sizeof kv->shape) != 0)
        for (int w = 0; w < 2; w++) {
            cas_attn_plan_destroy(m->plan[w]);
            m->plan[w] = NULL;
        }
    for (int w = 0; w < 2; w++) {
        int used = 0; /* a layer with (w = 1) or without the window */
        for (int32_t l = 0; l < c->n_layers && !used; l++) used = cas_model_layer_windowed(c, l) == w;
        if (!used) continue;
        if (!m->plan[w]) {
            m->plan_shape = kv->shape;
            cas_attn_plan_opts po = cas_attn_plan_opts_default();
            po.cascade = m->opts.cascade;
            po.threads = m->opts.threads;
            po.simd = m->simd;
            po.amx_off = m->opts.amx_off;
            po.batch_invariant = m->opts.batch_invariant;
            if ((st = cas_attn_plan_create(&m->plan[w], &kv->shape, &po, m->opts.max_seqs,
                                           m->opts.max_batch_tokens, 0)))
                return st;
        }
        ap.window_left = w ? c->sliding_window - 1 : -1; /* the query's own key is one of them */
        if ((st = cas_attn_plan_build(m->plan[w], &ab, kv->num_pages, &ap))) return st;
    }

    /* positions of the new tokens, and the cos/sin of their RoPE angles (once per forward,
     * shared by every layer) */
    const int32_t ps = kv->page_size, half = c->n_rot / 2;
    for (int32_t r = 0; r < B; r++) {
        int32_t np = b->kv_indptr[r + 1] - b->kv_indptr[r];
        int64_t kv_len = (int64_t)(np - 1) * ps + b->kv_last_page_len[r];
        int64_t ql = b->qo_indptr[r + 1] - b->qo_indptr[r];
        for (int64_t i = 0; i < ql; i++) {
            int64_t t = b->qo_indptr[r] + i;
            m->pos[t] = (int32_t)(kv_len - ql + i);
            m->seq_of[t] = r;
        }
    }
    for (int64_t t = 0; t < T; t++) {
        float *cs = m->rope + t * (int64_t)half * 2, *cw = m->rope_swa ? m->rope_swa + t * (int64_t)half * 2 : NULL;
        for (int32_t i = 0; i < half; i++) {
            double a = (double)m->pos[t] * (double)m->inv_freq[i];
            cs[2 * i] = (float)cos(a);
            cs[2 * i + 1] = (float)sin(a);
            if (!cw) continue;
            a = (double)m->pos[t] * (double)m->inv_freq_swa[i];
            cw[2 * i] = (float)cos(a);
            cw[2 * i + 1] = (float)sin(a);
        }
    }
    const int64_t E = c->n_embd, QD = (int64_t)c->n_head * c->head_dim,
                  KD = (int64_t)c->n_head_kv * c->head_dim;

    /* embeddings */
    for (int64_t t = 0; t < T; t++) {
        const uint8_t *row = (const uint8_t *)m->tok_embd.data +
                             (size_t)b->tokens[t] * (m->tok_embd.bytes / (size_t)c->n_vocab);
        if ((st = cas_q_dequantize_row(m->tok_embd.type, row, m->x + t * E, E))) return st;
        if (c->embd_scale > 0)
            for (int64_t i = 0; i < E; i++) m->x[t * E + i] *= c->embd_scale;
    }

    const size_t es = cas_dtype_size(kv->dtype);
    const size_t pbytes = (size_t)ps * (size_t)KD * es;
    int residual_due = 0; /* m->proj still to be added to m->x (the last down projection's) */
    const float *due_post = NULL; /* the norm of that projection first (Gemma's post_ffw_norm), or NULL */
    for (int32_t l = 0; l < c->n_layers; l++) {
        const cas_layer *L = &m->layers[l];
        const int win = cas_model_layer_windowed(c, l);
        cas_attn_plan *plan = m->plan[win];
        const float *rope = win && m->rope_swa ? m->rope_swa : m->rope;
        /* the single-token layer adds each residual by rows of its threads: no post-norm, whose
         * RMS needs the whole row, and no GELU gate */
        if (T == 1 && L->wqkv.rows && !c->post_norms && !c->gelu_gate) {
            /* the residual of the layer before, where it ran the batched path (a file
             * whose layers mix types, so that only some are fused), as its next
             * product would have added it (no post-norm: no model here has one) */
            if (residual_due) {
                for (int64_t i = 0; i < E; i++) m->x[i] += m->proj[i];
                residual_due = 0;
            }
            int32_t p = m->pos[0];
            int32_t page = b->kv_indices[b->kv_indptr[0] + p / ps];
            size_t at = (size_t)page * pbytes + (size_t)(p % ps) * (size_t)KD * es;
            if ((st = layer_one_token(m, L, kv, l, at, plan, rope))) return st;
            continue;
        }
        /* The elementwise steps run over tokens in parallel regions of their own
         * (the matrix kernels open theirs). */
        const int nt = m->nt;
        const int avx2 = m->avx2;
        uint8_t *kpool = (uint8_t *)kv->k + (size_t)l * kv->layer_bytes;
        uint8_t *vpool = (uint8_t *)kv->v + (size_t)l * kv->layer_bytes;
        /* the input norm (after the last layer's residual) in the first product */
        prep_ctx in_prep = {m, L->attn_norm, residual_due, 0, due_post};
        residual_due = 0;
        float *kr = m->k, *vr = m->v; /* K and V rows of token 0, kw floats apart */
        int64_t kw = KD;
        /* the fused matrices, where they can run now (a packed-only one needs the AMX path) */
        const int fq = L->wqkv.rows && (L->wqkv.data || (L->wqkv.packed && m->amx));
        const int fg = L->w_gu.rows && (L->w_gu.data || (L->w_gu.packed && m->amx));
        if (fq) {
            const int64_t W = QD + 2 * KD;
            if ((st = matmul_prep(m, &L->wqkv, m->xb, T, m->fout, prep_residual_norm, &in_prep))) return st;
            kr = m->fout + QD, vr = m->fout + QD + KD, kw = W;
        } else {
            if ((st = matmul_prep(m, &L->wq, m->xb, T, m->q, prep_residual_norm, &in_prep))) return st;
            if ((st = matmul(m, &L->wk, m->xb, T, m->k))) return st;
            if ((st = matmul(m, &L->wv, m->xb, T, m->v))) return st;
        }
        /* RoPE on q and k, then K and V of the new tokens into their pages: position p of
         * sequence r is slot p % page_size of its page p / page_size */
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *qt = m->q + t * QD, *kt = kr + t * kw;
            const float *cs = rope + t * (int64_t)half * 2;
            if (fq) memcpy(qt, m->fout + t * kw, sizeof(float) * (size_t)QD);
            qkv_token(m, L, qt, kt, vr + t * kw, cs);
            int32_t r = m->seq_of[t], p = m->pos[t];
            int32_t page = b->kv_indices[b->kv_indptr[r] + p / ps], off = p % ps;
            size_t at = (size_t)page * pbytes + (size_t)off * (size_t)KD * es;
            store_row(kv->dtype, kpool + at, kt, KD, avx2);
            store_row(kv->dtype, vpool + at, vr + t * kw, KD, avx2);
        }
        cas_kv_pool pool = {kpool, vpool, kv->num_pages};
        if ((st = cas_attn_plan_run(plan, &pool, m->q, m->att, NULL))) return st;

        if ((st = matmul(m, &L->wo, m->att, T, m->proj))) return st;
        /* residual and FFN norm in the gate/up product, SwiGLU in the down product,
         * and its residual in the next layer's first product (or after the loop) */
        prep_ctx ffn_prep = {m, L->ffn_norm, 1, 0, L->attn_post_norm}, glu_prep = {m, NULL, 0, fg, NULL};
        if (fg) {
            if ((st = matmul_prep(m, &L->w_gu, m->xb, T, m->fout, prep_residual_norm, &ffn_prep))) return st;
        } else {
            if ((st = matmul_prep(m, &L->w_gate, m->xb, T, m->gate, prep_residual_norm, &ffn_prep))) return st;
            if ((st = matmul(m, &L->w_up, m->xb, T, m->up))) return st;
        }
        if ((st = matmul_prep(m, &L->w_down, m->gate, T, m->proj, prep_swiglu, &glu_prep))) return st;
        residual_due = 1;
        due_post = L->ffn_post_norm;
    }
    if (residual_due) {
        prep_ctx last = {m, NULL, 1, 0, due_post};
#pragma omp parallel for num_threads(m->nt) schedule(static)
        for (int64_t t = 0; t < T; t++) add_residual(&last, t);
    }

    /* final norm and logits of the wanted rows only */
#pragma omp parallel for num_threads(m->nt) schedule(static) if (NL > 1)
    for (int32_t i = 0; i < NL; i++) norm_row(m, m->xl + (int64_t)i * E, m->x + (int64_t)lrows[i] * E, m->out_norm);
    if (NL > 0 && (st = matmul(m, &m->output, m->xl, NL, logits))) return st;
    if (c->final_softcap > 0) {
        /* as llama.cpp computes it: scaled by 1 / cap, tanh, scaled by cap;
         * src/core's vector tanh gives every element the same bits wherever
         * the chunks of the threads split the rows */
        const float cap = c->final_softcap, inv = 1.0f / cap;
        const int64_t n = (int64_t)NL * c->n_vocab, chunk = 16384;
#pragma omp parallel for num_threads(m->nt) schedule(static) if (n > 65536)
        for (int64_t i = 0; i < n; i += chunk) cas_tanh_scaled(logits + i, n - i < chunk ? n - i : chunk, inv, cap);
    }
    return CAS_OK;
}

void cas_model_plan_info(const cas_model *m, cas_attn_plan_info *info) {
    /* the plans differ only in the window: either tells what the step did */
    const cas_attn_plan *p = m->plan[0] ? m->plan[0] : m->plan[1];
    if (p) cas_attn_plan_get_info(p, info);
    else memset(info, 0, sizeof *info);
}
