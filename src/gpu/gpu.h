/*
 * gpu.h: the Llama-family forward pass on an NVIDIA GPU, the same contract as
 * the CPU's cas_model_forward (src/model/model.h): a ragged batch of new
 * tokens (prefill chunks and decode tokens side by side) over paged K/V, the
 * K/V of the new tokens written into their pages, logits for the wanted rows.
 *
 * A cas_gpu_model holds a GGUF file's weights on the device, converted once
 * at load to bf16 by kernels (f32, f16, bf16, q8_0, q4_0 and q4_1 in the
 * file; the query, key and value matrices side by side, and the gate and up
 * matrices), the fixed-capacity device buffers of one forward (activations,
 * the step's inputs, the attention plan) and the handles it runs with
 * (cuBLASLt, the CUDA attention context, one stream). Matrix products run
 * through cuBLASLt (bf16 operands, f32 accumulation; the residual adds are
 * the products' beta = 1); the elementwise work is a few fused kernels
 * (gather and norm, RoPE with the K/V store, SiLU times up, the logits rows'
 * norm). One cascade plan per forward serves every layer. Sampling can run
 * on the device too (cas_gpu_forward_sample), so that only tokens cross to
 * the host.
 *
 * A cas_gpu_kv is the paged K/V store in device memory, per layer a K and a V
 * pool of [num_pages][page_size][n_head_kv][head_dim] bf16, addressed by the
 * page ids of the kv layer's block pool like the CPU's.
 *
 * A build without CUDA (make without CUDA=1) has these functions too: they
 * return CAS_ERR_UNSUPPORTED with a message saying so, and
 * cas_gpu_available() is 0.
 *
 * Threads: one forward at a time per model. Nothing here reads the
 * environment.
 */
#ifndef CASCADE_GPU_H
#define CASCADE_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "../model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int32_t device;           /* CUDA device ordinal (default 0) */
    int32_t max_batch_tokens; /* most new tokens in one forward; default 512 */
    int32_t max_seqs;         /* most sequences in one forward; default 64 */
    int32_t max_logits;       /* most rows of logits one forward returns; default max_seqs */
    int32_t max_pages_per_seq; /* page table entries of one sequence (its longest context over
                                  the page size); default 8192 */
    cas_cascade_mode cascade; /* attention planner mode; default CAS_CASCADE_AUTO */
    /* 1 (default): cas_gpu_forward_sample runs a decode step (one new token
     * per sequence, a logits row each) as a CUDA graph, captured once per
     * batch-size bucket (1, 2, 4, 8, then multiples of 8 up to max_seqs) and
     * replayed with the step's inputs and attention plan rewritten in their
     * device buffers; the batch is padded to its bucket with rows that write
     * no K/V. 0: every step is launched eagerly. */
    int32_t graphs;
    /* Tensor parallelism. 0 (default): the model runs on `device` alone.
     * N >= 1: it is split over N ranks, each with a host thread (the
     * caller's for rank 0), a CUDA stream and its share of the weights: the
     * query and K/V heads and the MLP's hidden columns divided among the
     * ranks (n_head, n_head_kv and n_ff must divide by N), the embeddings,
     * norms and output matrix whole on each (the logits and sampling on rank
     * 0), the K/V pools split by K/V head, one attention plan for all; the
     * attention output and the down projection are summed over the ranks by
     * an all-reduce (NCCL). N = 1 is the same path with a one-rank NCCL
     * communicator. Rank i runs on devices[i] (devices NULL: device + i).
     * When every rank is given the same device (a test of the split on one
     * GPU: NCCL refuses two ranks on one device) the sums are made by
     * host-synchronized copies and decode steps run without graphs. */
    int32_t tensor_parallel;
    const int32_t *devices; /* [tensor_parallel] or NULL; read at create only */
} cas_gpu_opts;

/* The most ranks of tensor parallelism. */
#define CAS_GPU_MAX_RANKS 8

cas_gpu_opts cas_gpu_opts_default(void);

/* 1 when this build has the CUDA backend and a CUDA device is present. */
int cas_gpu_available(void);
/* 1 when this build has the CUDA backend (make CUDA=1). */
int cas_gpu_built(void);

typedef struct cas_gpu_model cas_gpu_model;

/* Builds the model of an open GGUF file (borrowed: the weights are copied to
 * the device, the file may be closed afterwards). CAS_ERR_UNSUPPORTED for an
 * architecture, head_dim or tensor type the GPU path lacks, or no CUDA;
 * CAS_ERR_NOMEM when the weights or buffers do not fit the device (the
 * message says how much was asked and is free); CAS_ERR_FORMAT as
 * cas_model_create. */
cas_status cas_gpu_model_create(const cas_gguf *g, const cas_gpu_opts *opts, cas_gpu_model **out);
/* A model of the given shape (cas_model_config_synthetic) with random bf16
 * weights made on the device from seed: uniform in +-sqrt(3 / inputs) for
 * each matrix, norms 1. For running and benchmarking shapes whose weights
 * cannot be had here; the same seed gives the same weights. */
cas_status cas_gpu_model_create_synthetic(const cas_model_config *cfg, uint64_t seed, const cas_gpu_opts *opts,
                                          cas_gpu_model **out);
void cas_gpu_model_destroy(cas_gpu_model *m);
const cas_model_config *cas_gpu_model_config(const cas_gpu_model *m);
/* Device memory the model holds (weights and buffers; every rank's), bytes. */
size_t cas_gpu_model_bytes(const cas_gpu_model *m);
/* The device's name ("none" without one; rank 0's under tensor parallelism). */
const char *cas_gpu_model_device_name(const cas_gpu_model *m);
void cas_gpu_model_set_cascade(cas_gpu_model *m, cas_cascade_mode mode);
/* The model's (rank 0's) device memory now: free and total bytes. */
/* The ranks of tensor parallelism (1 without it). */
int32_t cas_gpu_model_ranks(const cas_gpu_model *m);
cas_status cas_gpu_mem_info(const cas_gpu_model *m, size_t *free_bytes, size_t *total_bytes);

typedef struct cas_gpu_kv cas_gpu_kv;

/* The pages of page_size tokens (1..256) that fit budget_bytes of each
 * device's memory (all layers, K and V, bf16; under tensor parallelism a
 * rank's pools hold its K/V heads, and ranks sharing a device share it). */
int32_t cas_gpu_kv_pages_for_budget(const cas_gpu_model *m, int32_t page_size, size_t budget_bytes);
/* Device pools for num_pages pages, zero-filled (one per rank). */
cas_status cas_gpu_kv_create(const cas_gpu_model *m, int32_t num_pages, int32_t page_size, cas_gpu_kv **out);
void cas_gpu_kv_destroy(cas_gpu_kv *kv);
int32_t cas_gpu_kv_num_pages(const cas_gpu_kv *kv);
size_t cas_gpu_kv_bytes(const cas_gpu_kv *kv);

/* Runs the batch (model.h's cas_model_batch, the same checks): writes the
 * new tokens' K/V into their pages and logits[n_logits][n_vocab] (f32, host
 * memory) for the wanted rows. Allocates nothing; waits for the device. */
cas_status cas_gpu_forward(cas_gpu_model *m, cas_gpu_kv *kv, const cas_model_batch *b, float *logits);

/* One logits row's sampling (model.h's cas_sampler_params, with the draw
 * made by the caller): temperature 0 is greedy (argmax, ties to the lowest
 * id); otherwise top-k, min-p and top-p filter the weights
 * exp((logit - max) / temperature) as the CPU sampler does and u in [0, 1)
 * picks from what is left. want_logits: the row's logits are copied to the
 * host too (for log-probabilities). */
typedef struct {
    float temperature;
    int32_t top_k;
    float top_p;
    float min_p;
    float u;
    int32_t want_logits;
} cas_gpu_sample;

/* cas_gpu_forward, then the tokens of the wanted rows picked on the device:
 * tokens[n_logits] (host); logits (host, [n_logits][n_vocab]) receives only
 * the rows whose want_logits is set (NULL when none is). The same rows, the
 * same u and the same weights give the same tokens on every run. */
cas_status cas_gpu_forward_sample(cas_gpu_model *m, cas_gpu_kv *kv, const cas_model_batch *b,
                                  const cas_gpu_sample *rows, int32_t *tokens, float *logits);

/* How the steps ran: graphs captured, decode steps replayed from them,
 * decode steps padded to their bucket and launched eagerly because the
 * runtime could not capture (a warning is logged once; the numbers are the
 * graphs'), other steps launched eagerly. */
typedef struct {
    int64_t captures, replays, padded_eager, eager;
} cas_gpu_graph_info;
void cas_gpu_graph_stats(const cas_gpu_model *m, cas_gpu_graph_info *info);

/* What the attention plan of the last forward did. */
void cas_gpu_plan_info(const cas_gpu_model *m, cas_attn_plan_info *info);

#ifdef __cplusplus
}
#endif

#endif
