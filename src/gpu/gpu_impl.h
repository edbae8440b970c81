/*
 * gpu_impl.h: what the GPU forward's host code (gpu_model.c, C11) and its
 * kernels (gpu_kernels.cu) share: the kernels' launchers. Private to
 * src/gpu. Every launcher runs asynchronously on the stream it is given and
 * returns a cudaError_t as int.
 */
#ifndef CASCADE_GPU_IMPL_H
#define CASCADE_GPU_IMPL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Weights: rows x cols of the file's type t (cas_ttype; each row whole
 * blocks, rows back to back) into bf16 at dst, row r at dst + r * ld. */
int cas_gpu_dequant_bf16(int t, const void *src, void *dst, int64_t rows, int64_t cols, int64_t ld,
                         void *stream);
/* f32 values (a norm weight) n of them, f32 or f16 or bf16 in the file, to f32. */
int cas_gpu_to_f32(int t, const void *src, float *dst, int64_t n, void *stream);

/* dst[i] = bf16(a * uniform[-1, 1)) from a counter-based hash of (seed, i). */
int cas_gpu_fill_uniform_bf16(void *dst, int64_t n, float a, uint64_t seed, void *stream);
/* dst[i] = v */
int cas_gpu_fill_f32(float *dst, int64_t n, float v, void *stream);

/* The cos and sin of each new token's RoPE angles: cs[t][i] = (cos, sin) of
 * pos[t] * inv_freq[i] for i < half, in double precision before rounding
 * (the CPU's). */
int cas_gpu_rope_table(const int32_t *pos, const float *inv_freq, float *cs, int32_t T, int32_t half,
                       void *stream);
/* x[t][:] = the bf16 embedding row of token tokens[t], as f32. */
int cas_gpu_embed(const void *table, const int32_t *tokens, float *x, int32_t T, int32_t E, void *stream);
/* out[i][:] = bf16(x[r][:] / rms(x[r]) * w) for r = rows[i] (rows NULL: r = i), i < n. */
int cas_gpu_rmsnorm(const float *x, const int32_t *rows, const float *w, void *out, int32_t n, int32_t E,
                    float eps, void *stream);
/* From qkv [T][QD + 2 KD] (f32): q rotated into q_out (bf16 [T][QD]); k
 * rotated and v into the pools at slot[t] (bf16 [slot][KD] of the pool
 * viewed as rows of KD: slot = page * page_size + offset); a row whose slot
 * is negative (a graph's padding) stores no K/V. */
int cas_gpu_rope_store(const float *qkv, const float *cs, const int64_t *slot, void *q_out, void *kpool,
                       void *vpool, int32_t T, int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                       int32_t n_rot, void *stream);
/* h[t][i] = bf16(silu(gu[t][i]) * gu[t][F + i]) */
int cas_gpu_silu_mul(const float *gu, void *h, int32_t T, int32_t F, void *stream);
/* One row's sampling, as the device reads it (cas_gpu_sample's numbers). */
typedef struct {
    float temperature; /* 0: greedy */
    int32_t top_k;     /* 0: off */
    float top_p;       /* 1: off */
    float min_p;       /* 0: off */
    float u;           /* the draw, [0, 1) */
    int32_t pad;
} gpu_sample_row;

/* out[r] = the token of logits row r (f32 [n_rows][V]) under rows[r]
 * (gpu_sample.cu: the CPU sampler's filters, deterministic). */
int cas_gpu_sample_rows(const float *logits, int32_t n_rows, int32_t V, const gpu_sample_row *rows, int32_t *out,
                   void *stream);
/* out[i] = bf16(x[i]) */
int cas_gpu_to_bf16(const float *x, void *out, int64_t n, void *stream);
/* y[i] += x[i] (the sum over ranks sharing one device) */
int cas_gpu_add_f32(float *y, const float *x, int64_t n, void *stream);

#ifdef __cplusplus
}
#endif

#endif
