/*
 * gpu_kernels.cu: the GPU forward's kernels other than the matrix products
 * (cuBLASLt) and attention (src/cuda): the weights' conversion to bf16 at
 * load, and per step the embedding gather, RMSNorm, RoPE with the store of
 * the new K and V into their pages, SiLU times up, and conversions.
 *
 * Each is a plain grid-stride or row-per-block kernel: they move a few
 * megabytes per layer next to the matrix products, and their launch count,
 * not their bandwidth, is what shows in a step (fusing more of them and
 * CUDA graphs are what shortens it). Arithmetic follows the CPU forward (src/model/llama.c):
 * RMSNorm's sum in f32 per thread then a block reduction, RoPE's angles in
 * double, SiLU as x / (1 + exp(-x)).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu_impl.h"

/* ggml's block types (src/model/tensor.h numbering) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_BF16 = 30 };

static int grid_for(int64_t n, int per_block) {
    int64_t g = (n + per_block - 1) / per_block;
    if (g > 65535 * 8) g = 65535 * 8;
    return g < 1 ? 1 : (int)g;
}

__device__ __forceinline__ float half_at(const uint8_t *p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

/* one thread per 32-element block (quantized) or per element (plain) */
__global__ void dequant_kernel(int t, const uint8_t *__restrict__ src, __nv_bfloat16 *__restrict__ dst, int64_t rows,
                               int64_t cols, int64_t ld) {
    const int64_t per_row = (t == T_Q8_0 || t == T_Q4_0 || t == T_Q4_1) ? cols / 32 : cols;
    const int64_t n = rows * per_row;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / per_row, b = i - r * per_row;
        __nv_bfloat16 *d = dst + r * ld;
        switch (t) {
        case T_F32: d[b] = __float2bfloat16(reinterpret_cast<const float *>(src)[i]); break;
        case T_F16: d[b] = __float2bfloat16(__half2float(reinterpret_cast<const __half *>(src)[i])); break;
        case T_BF16: d[b] = reinterpret_cast<const __nv_bfloat16 *>(src)[i]; break;
        case T_Q8_0: {
            const uint8_t *p = src + i * 34;
            const float s = half_at(p);
            for (int j = 0; j < 32; j++) d[b * 32 + j] = __float2bfloat16(s * (float)(int8_t)p[2 + j]);
            break;
        }
        case T_Q4_0: {
            const uint8_t *p = src + i * 18;
            const float s = half_at(p);
            for (int j = 0; j < 16; j++) {
                d[b * 32 + j] = __float2bfloat16(s * (float)((p[2 + j] & 15) - 8));
                d[b * 32 + 16 + j] = __float2bfloat16(s * (float)((p[2 + j] >> 4) - 8));
            }
            break;
        }
        case T_Q4_1: {
            const uint8_t *p = src + i * 20;
            const float s = half_at(p), m = half_at(p + 2);
            for (int j = 0; j < 16; j++) {
                d[b * 32 + j] = __float2bfloat16(s * (float)(p[4 + j] & 15) + m);
                d[b * 32 + 16 + j] = __float2bfloat16(s * (float)(p[4 + j] >> 4) + m);
            }
            break;
        }
        default: break;
        }
    }
}

extern "C" int cas_gpu_dequant_bf16(int t, const void *src, void *dst, int64_t rows, int64_t cols, int64_t ld,
                                    void *stream) {
    if (t != T_F32 && t != T_F16 && t != T_BF16 && t != T_Q8_0 && t != T_Q4_0 && t != T_Q4_1)
        return (int)cudaErrorInvalidValue;
    const int64_t n = rows * ((t == T_Q8_0 || t == T_Q4_0 || t == T_Q4_1) ? cols / 32 : cols);
    dequant_kernel<<<grid_for(n, 256), 256, 0, (cudaStream_t)stream>>>(t, (const uint8_t *)src, (__nv_bfloat16 *)dst,
                                                                       rows, cols, ld);
    return (int)cudaGetLastError();
}

/* splitmix64's finalizer: a counter-based generator, the same values for any grid */
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__global__ void fill_uniform_kernel(__nv_bfloat16 *__restrict__ dst, int64_t n, float a, uint64_t seed) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const uint64_t h = mix64(seed + 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1));
        const float u = (float)(h >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
        dst[i] = __float2bfloat16(a * (2.0f * u - 1.0f));
    }
}

extern "C" int cas_gpu_fill_uniform_bf16(void *dst, int64_t n, float a, uint64_t seed, void *stream) {
    if (n <= 0) return 0;
    fill_uniform_kernel<<<grid_for(n, 256), 256, 0, (cudaStream_t)stream>>>((__nv_bfloat16 *)dst, n, a, seed);
    return (int)cudaGetLastError();
}

__global__ void fill_f32_kernel(float *__restrict__ dst, int64_t n, float v) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = v;
}

extern "C" int cas_gpu_fill_f32(float *dst, int64_t n, float v, void *stream) {
    if (n <= 0) return 0;
    fill_f32_kernel<<<grid_for(n, 256), 256, 0, (cudaStream_t)stream>>>(dst, n, v);
    return (int)cudaGetLastError();
}

__global__ void to_f32_kernel(int t, const uint8_t *__restrict__ src, float *__restrict__ dst, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        if (t == T_F32) dst[i] = reinterpret_cast<const float *>(src)[i];
        else if (t == T_F16) dst[i] = __half2float(reinterpret_cast<const __half *>(src)[i]);
        else dst[i] = __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(src)[i]);
    }
}

extern "C" int cas_gpu_to_f32(int t, const void *src, float *dst, int64_t n, void *stream) {
    if (t != T_F32 && t != T_F16 && t != T_BF16) return (int)cudaErrorInvalidValue;
    to_f32_kernel<<<grid_for(n, 256), 256, 0, (cudaStream_t)stream>>>(t, (const uint8_t *)src, dst, n);
    return (int)cudaGetLastError();
}

__global__ void rope_table_kernel(const int32_t *__restrict__ pos, const float *__restrict__ inv_freq,
                                  float *__restrict__ cs, int32_t T, int32_t half) {
    const int64_t n = (int64_t)T * half;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / half;
        const int j = (int)(i - t * half);
        double s, c;
        sincos((double)pos[t] * (double)inv_freq[j], &s, &c);
        cs[2 * i] = (float)c;
        cs[2 * i + 1] = (float)s;
    }
}

extern "C" int cas_gpu_rope_table(const int32_t *pos, const float *inv_freq, float *cs, int32_t T, int32_t half,
                                  void *stream) {
    if (T <= 0) return 0;
    rope_table_kernel<<<grid_for((int64_t)T * half, 256), 256, 0, (cudaStream_t)stream>>>(pos, inv_freq, cs, T, half);
    return (int)cudaGetLastError();
}

__global__ void embed_kernel(const __nv_bfloat16 *__restrict__ table, const int32_t *__restrict__ tokens,
                             float *__restrict__ x, int32_t E) {
    const int t = blockIdx.x;
    const __nv_bfloat16 *row = table + (int64_t)tokens[t] * E;
    for (int i = threadIdx.x; i < E; i += blockDim.x) x[(int64_t)t * E + i] = __bfloat162float(row[i]);
}

extern "C" int cas_gpu_embed(const void *table, const int32_t *tokens, float *x, int32_t T, int32_t E, void *stream) {
    if (T <= 0) return 0;
    embed_kernel<<<T, 256, 0, (cudaStream_t)stream>>>((const __nv_bfloat16 *)table, tokens, x, E);
    return (int)cudaGetLastError();
}

/* one block of 256 threads per row */
__global__ void rmsnorm_kernel(const float *__restrict__ x, const int32_t *__restrict__ rows,
                               const float *__restrict__ w, __nv_bfloat16 *__restrict__ out, int32_t E, float eps) {
    const int i = blockIdx.x;
    const float *xr = x + (int64_t)(rows ? rows[i] : i) * E;
    float ss = 0.f;
    for (int k = threadIdx.x; k < E; k += blockDim.x) ss += xr[k] * xr[k];
    __shared__ float part[8];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
#pragma unroll
    for (int k = 0; k < 8; k++) tot += part[k];
    const float s = rsqrtf(tot / (float)E + eps);
    for (int k = threadIdx.x; k < E; k += blockDim.x) out[(int64_t)i * E + k] = __float2bfloat16(xr[k] * s * w[k]);
}

extern "C" int cas_gpu_rmsnorm(const float *x, const int32_t *rows, const float *w, void *out, int32_t n, int32_t E,
                               float eps, void *stream) {
    if (n <= 0) return 0;
    rmsnorm_kernel<<<n, 256, 0, (cudaStream_t)stream>>>(x, rows, w, (__nv_bfloat16 *)out, E, eps);
    return (int)cudaGetLastError();
}

/* one block per token; threads over (head, pair) of q, then of k, then v's elements */
__global__ void rope_store_kernel(const float *__restrict__ qkv, const float *__restrict__ cs,
                                  const int64_t *__restrict__ slot, __nv_bfloat16 *__restrict__ q_out,
                                  __nv_bfloat16 *__restrict__ kpool, __nv_bfloat16 *__restrict__ vpool,
                                  int32_t n_head, int32_t n_head_kv, int32_t D, int32_t n_rot) {
    const int t = blockIdx.x;
    const int QD = n_head * D, KD = n_head_kv * D, W = QD + 2 * KD, half = n_rot / 2, hd = D / 2;
    const float *row = qkv + (int64_t)t * W;
    const float *c = cs + (int64_t)t * half * 2;
    const int64_t s = slot[t];
    /* q and k: pairs (2i, 2i + 1) rotated for i < half, the rest copied */
    for (int e = threadIdx.x; e < (n_head + n_head_kv) * hd; e += blockDim.x) {
        const int h = e / hd, i = e - h * hd;
        const int is_k = h >= n_head;
        const float *v = row + (is_k ? QD + (h - n_head) * D : h * D);
        float a = v[2 * i], b = v[2 * i + 1];
        if (i < half) {
            const float co = c[2 * i], si = c[2 * i + 1];
            const float a2 = a * co - b * si, b2 = a * si + b * co;
            a = a2;
            b = b2;
        }
        if (is_k && s < 0) continue; /* a padding row: no K/V */
        __nv_bfloat16 *dst = is_k ? kpool + s * KD + (h - n_head) * D : q_out + (int64_t)t * QD + h * D;
        dst[2 * i] = __float2bfloat16(a);
        dst[2 * i + 1] = __float2bfloat16(b);
    }
    if (s < 0) return;
    for (int e = threadIdx.x; e < KD; e += blockDim.x) vpool[s * KD + e] = __float2bfloat16(row[QD + KD + e]);
}

extern "C" int cas_gpu_rope_store(const float *qkv, const float *cs, const int64_t *slot, void *q_out, void *kpool,
                                  void *vpool, int32_t T, int32_t n_head, int32_t n_head_kv, int32_t head_dim,
                                  int32_t n_rot, void *stream) {
    if (T <= 0) return 0;
    rope_store_kernel<<<T, 256, 0, (cudaStream_t)stream>>>(qkv, cs, slot, (__nv_bfloat16 *)q_out,
                                                           (__nv_bfloat16 *)kpool, (__nv_bfloat16 *)vpool, n_head,
                                                           n_head_kv, head_dim, n_rot);
    return (int)cudaGetLastError();
}

__global__ void silu_mul_kernel(const float *__restrict__ gu, __nv_bfloat16 *__restrict__ h, int32_t T, int32_t F) {
    const int64_t n = (int64_t)T * F;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / F, j = i - t * F;
        const float g = gu[t * 2 * F + j], u = gu[t * 2 * F + F + j];
        h[i] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
    }
}

extern "C" int cas_gpu_silu_mul(const float *gu, void *h, int32_t T, int32_t F, void *stream) {
    if (T <= 0) return 0;
    silu_mul_kernel<<<grid_for((int64_t)T * F, 256), 256, 0, (cudaStream_t)stream>>>(gu, (__nv_bfloat16 *)h, T, F);
    return (int)cudaGetLastError();
}

__global__ void to_bf16_kernel(const float *__restrict__ x, __nv_bfloat16 *__restrict__ out, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(x[i]);
}

extern "C" int cas_gpu_to_bf16(const float *x, void *out, int64_t n, void *stream) {
    if (n <= 0) return 0;
    to_bf16_kernel<<<grid_for(n, 256), 256, 0, (cudaStream_t)stream>>>(x, (__nv_bfloat16 *)out, n);
    return (int)cudaGetLastError();
}

__global__ void add_f32_kernel(float *__restrict__ y, const float *__restrict__ x, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] += x[i];
}

extern "C" int cas_gpu_add_f32(float *y, const float *x, int64_t n, void *stream) {
    if (n <= 0) return 0;
    add_f32_kernel<<<grid_for(n, 256), 256, 0, (cudaStream_t)stream>>>(y, x, n);
    return (int)cudaGetLastError();
}
