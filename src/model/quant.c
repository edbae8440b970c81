/*
 * quant.c: tensor types of the model layer (sizes, names), quantization and
 * dequantization of rows, the portable matrix kernels, the dispatch to the
 * AVX2 kernels of quant_avx2.c, and small benchmarks.
 *
 * The portable path is the same algorithm as the AVX2 path (x quantized to 8
 * bits per block, exact integer dot products per block, f32 accumulation),
 * so the two differ only by f32 summation order and the tests can compare
 * them tightly. It also serves CPUs without AVX2 and callers that ask for it
 * (CAS_Q_SIMD_GENERIC; a model with simd GENERIC or portable_kernels).
 *
 * Threading is OpenMP inside each call: rows are split into contiguous
 * ranges, one per thread, so that each thread streams its own part of the
 * weights (decode is bound by memory bandwidth, not by compute).
 */
#include "quant_impl.h"
#include "quant_k.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ---- type info ---------------------------------------------------------- */

int cas_tensor_type_supported(int t) {
    switch (t) {
    case CAS_T_F32: case CAS_T_F16: case CAS_T_BF16:
    case CAS_T_Q8_0: case CAS_T_Q4_0: case CAS_T_Q4_1:
        return 1;
    default:
        return cas_qk_type(t);
    }
}

static int is_quant(int t) { return t == CAS_T_Q8_0 || t == CAS_T_Q4_0 || t == CAS_T_Q4_1; }

int64_t cas_tensor_block_size(int t) {
    if (!cas_tensor_type_supported(t)) return 0;
    if (cas_qk_type(t)) return cas_qk_block_size(t);
    return is_quant(t) ? CAS_Q_BLOCK : 1;
}

size_t cas_tensor_block_bytes(int t) {
    switch (t) {
    case CAS_T_F32: return 4;
    case CAS_T_F16: return 2;
    case CAS_T_BF16: return 2;
    case CAS_T_Q8_0: return 2 + 32;
    case CAS_T_Q4_0: return 2 + 16;
    case CAS_T_Q4_1: return 2 + 2 + 16;
    default: return cas_qk_block_bytes(t);
    }
}

const char *cas_tensor_type_name(int t) {
    switch (t) {
    case CAS_T_F32: return "f32";
    case CAS_T_F16: return "f16";
    case CAS_T_BF16: return "bf16";
    case CAS_T_Q8_0: return "q8_0";
    case CAS_T_Q4_0: return "q4_0";
    case CAS_T_Q4_1: return "q4_1";
    default: return cas_qk_type(t) ? cas_qk_name(t) : "?";
    }
}

cas_status cas_tensor_row_bytes(int t, int64_t n, size_t *bytes) {
    if (!bytes) return cas_error(CAS_ERR_INVALID, "tensor row bytes: NULL output");
    *bytes = 0;
    if (!cas_tensor_type_supported(t))
        return cas_error(CAS_ERR_UNSUPPORTED, "tensor type %s (id %d) is not supported by the CPU kernels",
                         cas_ttype_ggml_name(t) ? cas_ttype_ggml_name(t) : "?", t);
    int64_t bs = cas_tensor_block_size(t);
    if (n <= 0 || n % bs)
        return cas_error(CAS_ERR_INVALID, "%s row of %lld elements: must be a positive multiple of %lld",
                         cas_tensor_type_name(t), (long long)n, (long long)bs);
    if ((uint64_t)(n / bs) > SIZE_MAX / 64)
        return cas_error(CAS_ERR_INVALID, "%s row of %lld elements is too long", cas_tensor_type_name(t),
                         (long long)n);
    *bytes = (size_t)(n / bs) * cas_tensor_block_bytes(t);
    return CAS_OK;
}

/* ---- block access --------------------------------------------------------
 * Blocks are read through byte pointers and memcpy, so that the unaligned
 * f16 fields (blocks are 18, 20 or 34 bytes) are read without alignment or
 * aliasing assumptions; compilers turn these into plain loads. */

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline void wr16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

/* ---- quantize / dequantize --------------------------------------------- */

cas_status cas_q_dequantize_row(int t, const void *src, float *dst, int64_t n) {
    size_t rb;
    if (!src || !dst) return cas_error(CAS_ERR_INVALID, "dequantize: NULL pointer");
    cas_status st = cas_tensor_row_bytes(t, n, &rb);
    if (st) return st;
    const uint8_t *p = src;
    switch (t) {
    case CAS_T_F32: memcpy(dst, src, (size_t)n * 4); break;
    case CAS_T_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = cas_f16_to_f32(rd16(p + 2 * i));
        break;
    case CAS_T_BF16:
        for (int64_t i = 0; i < n; i++) dst[i] = cas_bf16_to_f32(rd16(p + 2 * i));
        break;
    case CAS_T_Q8_0:
        for (int64_t b = 0; b < n / 32; b++, p += 34) {
            float d = cas_f16_to_f32(rd16(p));
            for (int i = 0; i < 32; i++) dst[b * 32 + i] = d * (float)(int8_t)p[2 + i];
        }
        break;
    case CAS_T_Q4_0:
        for (int64_t b = 0; b < n / 32; b++, p += 18) {
            float d = cas_f16_to_f32(rd16(p));
            for (int i = 0; i < 16; i++) {
                dst[b * 32 + i] = d * (float)((p[2 + i] & 15) - 8);
                dst[b * 32 + 16 + i] = d * (float)((p[2 + i] >> 4) - 8);
            }
        }
        break;
    case CAS_T_Q4_1:
        for (int64_t b = 0; b < n / 32; b++, p += 20) {
            float d = cas_f16_to_f32(rd16(p)), m = cas_f16_to_f32(rd16(p + 2));
            for (int i = 0; i < 16; i++) {
                dst[b * 32 + i] = d * (float)(p[4 + i] & 15) + m;
                dst[b * 32 + 16 + i] = d * (float)(p[4 + i] >> 4) + m;
            }
        }
        break;
    default:
        if (!cas_qk_type(t)) return cas_error(CAS_ERR_INTERNAL, "dequantize: type %d", t);
        cas_qk_dequantize_row(t, p, dst, n);
        break;
    }
    return CAS_OK;
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* q = round(x / d) against the stored (f16-rounded) scale d. */
static inline int qround(float x, float id) { return (int)lrintf(x * id); }

static void quant_block_q8_0(const float *x, uint8_t *o) {
    float amax = 0;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    uint16_t dh = cas_f32_to_f16(amax / 127.0f);
    float d = cas_f16_to_f32(dh), id = d != 0 ? 1.0f / d : 0.0f;
    wr16(o, dh);
    for (int i = 0; i < 32; i++) o[2 + i] = (uint8_t)(int8_t)clampi(qround(x[i], id), -127, 127);
}

/* Q4_0 has levels -8..7: the value of largest magnitude, with its sign, maps
 * to -8 so that all 16 levels are used on its side of zero. */
static void quant_block_q4_0(const float *x, uint8_t *o) {
    float amax = 0, vmax = 0;
    for (int i = 0; i < 32; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), vmax = x[i];
    uint16_t dh = cas_f32_to_f16(vmax / -8.0f);
    float d = cas_f16_to_f32(dh), id = d != 0 ? 1.0f / d : 0.0f;
    wr16(o, dh);
    for (int i = 0; i < 16; i++) {
        int lo = clampi(qround(x[i], id) + 8, 0, 15), hi = clampi(qround(x[16 + i], id) + 8, 0, 15);
        o[2 + i] = (uint8_t)(lo | hi << 4);
    }
}

static void quant_block_q4_1(const float *x, uint8_t *o) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < 32; i++) lo = fminf(lo, x[i]), hi = fmaxf(hi, x[i]);
    uint16_t mh = cas_f32_to_f16(lo);
    float m = cas_f16_to_f32(mh);
    uint16_t dh = cas_f32_to_f16((hi - m) / 15.0f);
    float d = cas_f16_to_f32(dh), id = d != 0 ? 1.0f / d : 0.0f;
    wr16(o, dh);
    wr16(o + 2, mh);
    for (int i = 0; i < 16; i++) {
        int a = clampi(qround(x[i] - m, id), 0, 15), b = clampi(qround(x[16 + i] - m, id), 0, 15);
        o[4 + i] = (uint8_t)(a | b << 4);
    }
}

cas_status cas_q_quantize_rows(int t, const float *x, void *dst, int64_t rows, int64_t n) {
    size_t rb;
    if (!x || !dst) return cas_error(CAS_ERR_INVALID, "quantize: NULL pointer");
    if (rows < 0) return cas_error(CAS_ERR_INVALID, "quantize: %lld rows", (long long)rows);
    cas_status st = cas_tensor_row_bytes(t, n, &rb);
    if (st) return st;
    uint8_t *o = dst;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        uint8_t *orow = o + (size_t)r * rb;
        switch (t) {
        case CAS_T_F32: memcpy(orow, xr, (size_t)n * 4); break;
        case CAS_T_F16:
            for (int64_t i = 0; i < n; i++) wr16(orow + 2 * i, cas_f32_to_f16(xr[i]));
            break;
        case CAS_T_BF16:
            for (int64_t i = 0; i < n; i++) wr16(orow + 2 * i, cas_f32_to_bf16(xr[i]));
            break;
        case CAS_T_Q8_0:
            for (int64_t b = 0; b < n / 32; b++) quant_block_q8_0(xr + 32 * b, orow + 34 * b);
            break;
        case CAS_T_Q4_0:
            for (int64_t b = 0; b < n / 32; b++) quant_block_q4_0(xr + 32 * b, orow + 18 * b);
            break;
        case CAS_T_Q4_1:
            for (int64_t b = 0; b < n / 32; b++) quant_block_q4_1(xr + 32 * b, orow + 20 * b);
            break;
        default:
            if (!cas_qk_type(t)) return cas_error(CAS_ERR_INTERNAL, "quantize: type %d", t);
            cas_qk_quantize_row(t, xr, orow, n);
            break;
        }
    }
    return CAS_OK;
}

/* x to 8 bits per block, symmetric, with the f32 scale kept exactly (not
 * rounded to f16: it costs nothing here and keeps the error at half a step).
 * sx[b] = d * sum(q), the block sum the zero-point terms need, stored
 * contiguously so the kernels can apply them eight blocks at a time. */
static void quantize_x_row(const float *x, int64_t nb, cas_q8x_block *xq, float *sx) {
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float d = amax / 127.0f, id = d != 0 ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            int q = clampi(qround(xb[i], id), -127, 127);
            xq[b].q[i] = (int8_t)q;
            sum += q;
        }
        xq[b].d = d;
        xq[b].s = d * (float)sum;
        sx[b] = xq[b].s;
    }
}

/* ---- portable kernels ---------------------------------------------------- */

/* Dot product of one weight row with one token (x as f32 for float types,
 * quantized for the others). */
static float dot_row_generic(int t, const uint8_t *w, int64_t n, const float *xf,
                             const cas_q8x_block *xq) {
    int64_t nb = n / 32;
    float acc = 0;
    switch (t) {
    case CAS_T_F32: {
        const float *wf = (const float *)(const void *)w;
        for (int64_t i = 0; i < n; i++) acc += wf[i] * xf[i];
        break;
    }
    case CAS_T_F16:
        for (int64_t i = 0; i < n; i++) acc += cas_f16_to_f32(rd16(w + 2 * i)) * xf[i];
        break;
    case CAS_T_BF16:
        for (int64_t i = 0; i < n; i++) acc += cas_bf16_to_f32(rd16(w + 2 * i)) * xf[i];
        break;
    /* the quantized types: the chain of the batch-invariance contract
     * (quant_impl.h), so these give the AVX2 and AMX kernels' bits */
    case CAS_T_Q8_0:
        for (int64_t b = 0; b < nb; b++, w += 34) {
            int s = 0;
            for (int i = 0; i < 32; i++) s += (int8_t)w[2 + i] * xq[b].q[i];
            acc = fmaf((float)s, cas_f16_to_f32(rd16(w)) * xq[b].d, acc);
        }
        break;
    case CAS_T_Q4_0:
        for (int64_t b = 0; b < nb; b++, w += 18) {
            int s = 0;
            for (int i = 0; i < 16; i++)
                s += (w[2 + i] & 15) * xq[b].q[i] + (w[2 + i] >> 4) * xq[b].q[16 + i];
            float d = cas_f16_to_f32(rd16(w));
            acc = fmaf((float)s, d * xq[b].d, acc);
            acc = fmaf(-8.0f * d, xq[b].s, acc);
        }
        break;
    case CAS_T_Q4_1:
        for (int64_t b = 0; b < nb; b++, w += 20) {
            int s = 0;
            for (int i = 0; i < 16; i++)
                s += (w[4 + i] & 15) * xq[b].q[i] + (w[4 + i] >> 4) * xq[b].q[16 + i];
            acc = fmaf((float)s, cas_f16_to_f32(rd16(w)) * xq[b].d, acc);
            acc = fmaf(cas_f16_to_f32(rd16(w + 2)), xq[b].s, acc);
        }
        break;
    default: break;
    }
    return acc;
}

/* ---- dispatch ------------------------------------------------------------ */

/* The CPU's features come from src/core (cas_cpu_features_get), detected
 * once for every layer. */
static int cpu_has_avx2(void) { return cas_cpu_features_get()->avx2; }

/* AMX-INT8 needs the CPU (AMX-INT8; AVX-512 for the scaling) and the tile
 * state granted to this process (cas_cpu_amx_ready in src/core: AMX-TILE,
 * XCR0 bits 17 and 18, the Linux permission asked once). Any refusal leaves
 * the AVX2 kernels in use. */
int cas_q_amx_available(void) {
    const cas_cpu_features *f = cas_cpu_features_get();
    return f->avx2 && f->avx512 && f->amx_int8 && cas_cpu_amx_ready();
}

const char *cas_q_simd_name(void) { return cpu_has_avx2() ? "avx2" : "generic"; }

/* AMX for a batched call under AUTO */
static int auto_amx(void) { return cas_q_amx_available(); }

const char *cas_q_batch_simd_name(void) {
    return auto_amx() ? "amx" : cpu_has_avx2() && cas_qk_avx512_available() ? "avx512-vnni" : cas_q_simd_name();
}

/* 1 for AVX2, 0 for portable, -1 (error recorded) when AVX2 is asked for
 * but missing. */
static int pick_avx2(cas_q_simd s) {
    switch (s) {
    case CAS_Q_SIMD_GENERIC: return 0;
    case CAS_Q_SIMD_AVX512:
        if (!cpu_has_avx2() || !cas_cpu_features_get()->avx512) {
            cas_error(CAS_ERR_UNSUPPORTED, "AVX-512 kernels requested; this CPU lacks them");
            return -1;
        }
        return 1;
    case CAS_Q_SIMD_AVX2:
    case CAS_Q_SIMD_AMX:
        if (!cpu_has_avx2()) {
            cas_error(CAS_ERR_UNSUPPORTED, "AVX2+FMA+F16C kernels requested; this CPU lacks them");
            return -1;
        }
        return 1;
    default: return cpu_has_avx2();
    }
}

static int resolve_threads(int nthreads) {
    int mx = omp_get_max_threads();
    return nthreads > 0 ? nthreads : mx > 0 ? mx : 1;
}

static size_t align64(size_t v) { return (v + 63) & ~(size_t)63; }

/* Workspace layout: xq[m][nb] | sx[m][nb] | x8[ceil(m/8)][nb] |
 * tile[nthreads] of tile_bytes; for m > 1 on quantized types also
 * x16[ceil(m/16)][nb] | amx scratch[nthreads]. */
static size_t tile_bytes(int64_t n) { return align64((size_t)n * 4 * CAS_Q_TILE_ROWS); }
/* Bytes that shift each thread's AMX scratch (unpacked weights, result
 * tiles) against the x groups it reads. The kernel stores each result tile
 * and soon after loads the next x and weight tiles; a load whose address
 * equals an in-flight store's modulo 4 KiB waits for that store (4K
 * aliasing), and with the scratch right after x that happened often enough
 * to cost 25% of a 32-token call. Measured on the model's shapes (2 threads,
 * 32 tokens): 3072x576 133 -> 96 us, 960x576 46 -> 37, 576x576 31 -> 25,
 * 576x1536 75 -> 70, 49152x576 Q8_0 1501 -> 1463; 512 tokens unchanged. */
#define AMX_SCRATCH_SKEW 2112
/* Bytes between two threads' AMX scratch: a multiple of 4 KiB, so that every
 * thread's scratch has the offset (modulo 4 KiB) against x that the skew was
 * measured for. With a 64-byte multiple the second thread's result tiles sat
 * elsewhere: it ended the 3072 x 576 products 8% after the first (per-thread
 * end times, 32 tokens); this stride made the 32-seq decode step about 2%
 * faster in three A/B pairs. */
static size_t amx_thread_stride(int64_t n) {
    return (cas_q_amx_scratch_bytes(n) + AMX_SCRATCH_SKEW + 4095) & ~(size_t)4095;
}

static size_t x16_bytes(int64_t m, int64_t nb) {
    return align64((size_t)((m + CAS_Q_PANEL - 1) / CAS_Q_PANEL) * (size_t)nb * sizeof(cas_q8x16_block));
}

size_t cas_q_work_bytes(int t, int64_t rows, int64_t n, int64_t m, int nthreads) {
    size_t rb;
    if (rows <= 0 || m <= 0 || nthreads < 0) return 0;
    if (cas_tensor_row_bytes(t, n, &rb) != CAS_OK) return 0;
    if (cas_qk_type(t)) return cas_qk_work_bytes(t, n, m, resolve_threads(nthreads));
    size_t nt = (size_t)resolve_threads(nthreads);
    size_t nb = is_quant(t) ? (size_t)(n / 32) : 0;
    size_t bytes = align64((size_t)m * nb * sizeof(cas_q8x_block)) + align64((size_t)m * nb * 4);
    bytes += align64((size_t)((m + 7) / 8) * nb * sizeof(cas_q8x8_block));
    if (m > 1) bytes += nt * tile_bytes(n);
    if (m > 1 && nb)
        bytes += x16_bytes(m, (int64_t)nb) + nt * amx_thread_stride(n) + AMX_SCRATCH_SKEW;
    return bytes + 64;
}

/* ---- matrix kernels ------------------------------------------------------ */

/* Token slot i of the 16-token groups xs[ceil(m/16)][nb]: x[i] quantized, or
 * zero past the m tokens. */
static void quantize_x16_slot(const float *x, int64_t n, int64_t nb, int64_t m, int64_t i, cas_q8x16_block *xs) {
    cas_q8x16_block *g = xs + i / CAS_Q_PANEL * nb;
    int k = (int)(i % CAS_Q_PANEL);
    if (i < m) {
        cas_q_avx2_quantize_x16(x + i * n, nb, k, g);
        return;
    }
    for (int64_t b = 0; b < nb; b++) {
        memset(g[b].q[k], 0, CAS_Q_BLOCK);
        g[b].d[k] = g[b].s[k] = 0;
    }
}

/* Block b of tokens [16 g, 16 g + 16) of xq[m][nb] in the layout of the
 * AVX-512 token-lane kernel: q[e] holds elements 4e .. 4e+3 of each token, xs
 * each token's integer sum, d its scale; zero past the m tokens. */
static void pack_x16(const cas_q8x_block *xq, int64_t nb, int64_t m, int64_t g, int64_t b, cas_q8b16_block *o) {
    memset(o, 0, sizeof *o);
    for (int64_t i = 0; i < 16 && 16 * g + i < m; i++) {
        const cas_q8x_block *x = xq + (16 * g + i) * nb + b;
        int32_t s = 0;
        for (int e = 0; e < 32; e++) s += x->q[e];
        for (int e = 0; e < 8; e++) memcpy(o->q[e] + 4 * i, x->q + 4 * e, 4);
        o->xs[i] = s;
        o->d[i] = x->d;
    }
}

static cas_status check_args(const char *what, int t, const void *w, const void *packed, int64_t rows,
                             int64_t n, const float *x, int64_t m, float *y, size_t *rb) {
    if ((!w && !packed) || !x || !y) return cas_error(CAS_ERR_INVALID, "%s: NULL pointer", what);
    if (rows <= 0 || m <= 0)
        return cas_error(CAS_ERR_INVALID, "%s: %lld rows, %lld tokens", what, (long long)rows,
                         (long long)m);
    return cas_tensor_row_bytes(t, n, rb);
}

cas_status cas_q_matvec(int t, const void *w, int64_t rows, int64_t n, const float *x, float *y,
                        const cas_q_opts *opt) {
    return cas_q_matmul(t, w, rows, n, x, 1, y, opt);
}

cas_status cas_q_matmul(int t, const void *w, int64_t rows, int64_t n, const float *x, int64_t m,
                        float *y, const cas_q_opts *opt) {
    static const cas_q_opts defaults = {0, CAS_Q_SIMD_AUTO, NULL, 0, NULL, NULL, NULL};
    size_t rb;
    if (!opt) opt = &defaults;
    cas_status st = check_args(m == 1 ? "matvec" : "matmul", t, w, opt->packed, rows, n, x, m, y, &rb);
    if (st) return st;
    if (opt->nthreads < 0) return cas_error(CAS_ERR_INVALID, "matmul: %d threads", opt->nthreads);
    int avx2 = pick_avx2(opt->simd);
    if (avx2 < 0) return CAS_ERR_UNSUPPORTED;
    int nt = resolve_threads(opt->nthreads);
    size_t need = cas_q_work_bytes(t, rows, n, m, nt);
    uint8_t *work = opt->work, *owned = NULL;
    if (!work) {
        work = owned = cas_alloc(need);
        if (!work) return cas_error(CAS_ERR_NOMEM, "matmul: %zu bytes of scratch", need);
    } else if (opt->work_bytes < need) {
        return cas_error(CAS_ERR_INVALID, "matmul: workspace of %zu bytes, %zu needed", opt->work_bytes,
                         need);
    }
    work = (uint8_t *)align64((size_t)work);
    /* the widest vector kernels allowed (AMX, where it has no kernel, asks for them too) */
    const int best = opt->simd == CAS_Q_SIMD_AUTO || opt->simd == CAS_Q_SIMD_AMX || opt->simd == CAS_Q_SIMD_AVX512;
    if (cas_qk_type(t)) { /* no AMX kernels: AMX asks for the best vector path */
        if (!w) {
            cas_free(owned);
            return cas_error(CAS_ERR_INVALID, "%s: %s weights have no packed layout", m == 1 ? "matvec" : "matmul",
                             cas_tensor_type_name(t));
        }
        if (opt->prep) {
#pragma omp parallel for num_threads(nt) schedule(static)
            for (int64_t i = 0; i < m; i++) opt->prep(opt->prep_ctx, i);
        }
        cas_qk_matmul(t, w, rb, rows, n, x, m, y, avx2 && best && cas_qk_avx512_available() ? 2 : avx2, nt, work);
        cas_free(owned);
        return CAS_OK;
    }

    const int quant = is_quant(t);
    const int64_t nb = quant ? n / 32 : 0;
    cas_q8x_block *xq = (cas_q8x_block *)(void *)work;
    float *sx = (float *)(void *)(work + align64((size_t)m * nb * sizeof(cas_q8x_block)));
    cas_q8x8_block *x8 = (cas_q8x8_block *)(void *)((uint8_t *)sx + align64((size_t)m * nb * 4));
    uint8_t *tiles = (uint8_t *)x8 + align64((size_t)((m + 7) / 8) * nb * sizeof(cas_q8x8_block));
    int amx = 0;
    if (quant && m > 1) {
        if (opt->simd == CAS_Q_SIMD_AMX) {
            if (!cas_q_amx_available()) {
                cas_free(owned);
                return cas_error(CAS_ERR_UNSUPPORTED, "AMX-INT8 kernels requested; this CPU or OS lacks them");
            }
            if (!opt->packed) {
                cas_free(owned);
                return cas_error(CAS_ERR_INVALID, "matmul: AMX kernels need the packed weights (cas_q_pack)");
            }
            amx = 1;
        } else if (opt->simd == CAS_Q_SIMD_AUTO && avx2 && opt->packed) {
            amx = auto_amx();
        }
    }
    if (!w && !amx) {
        cas_free(owned);
        return cas_error(CAS_ERR_INVALID, "%s: only the packed weights given, and the AMX kernels do not take "
                         "this call", m == 1 ? "matvec" : "matmul");
    }
    if (opt->prep && !amx) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t i = 0; i < m; i++) opt->prep(opt->prep_ctx, i);
    }
    /* AVX-512 VNNI: sixteen tokens in the lanes (quant_k_avx512vnni.c's 32-element kernel) */
    const int vnni = !amx && avx2 && quant && best && cas_qk_avx512_available();
    /* up to CAS_Q_FEW_MAX_M tokens: eight rows in the lanes, codes decoded once for up to eight tokens */
    const int few = vnni && m > 1 && m <= CAS_Q_FEW_MAX_M;
    const int v16 = vnni && !few && m >= CAS_QK_LANE16_MIN_M;
    const int lanes = !amx && !v16 && !few && avx2 && quant && m > 1;
    const uint8_t *wb = w;
    uint8_t *amx_base = tiles + (m > 1 ? (size_t)nt * tile_bytes(n) : 0);
    cas_q8x16_block *x16 = (cas_q8x16_block *)(void *)amx_base;
    cas_q8b16_block *xv16 = (cas_q8b16_block *)(void *)amx_base; /* the same bytes, for the VNNI kernel */
    _Static_assert(sizeof(cas_q8b16_block) == sizeof(cas_q8x16_block), "x16_bytes serves both layouts");
    uint8_t *amx_scratch = amx_base + (amx ? x16_bytes(m, nb) : 0);
    const int64_t panels = (rows + CAS_Q_PANEL - 1) / CAS_Q_PANEL;

    /* Threads beyond the work only add start-up cost. */
    int64_t groups = (rows + CAS_Q_TILE_ROWS - 1) / CAS_Q_TILE_ROWS;
    if (nt > groups) nt = (int)groups;
    if (amx && nt > panels) nt = (int)panels;

#pragma omp parallel num_threads(nt)
    {
        if (amx) {
            /* x into 16-token groups; the padding tokens of the last group are zero */
            const int64_t mp = (m + CAS_Q_PANEL - 1) / CAS_Q_PANEL * CAS_Q_PANEL;
            /* the first two panels of the run this thread will most likely take (the
             * kernel prefetches ahead only within a run), a few lines per token it
             * quantizes */
            {
                const int tid0 = omp_get_thread_num(), nth0 = omp_get_num_threads();
                const int64_t ch = (panels + nth0 - 1) / nth0, pp0 = (int64_t)tid0 * ch;
                const size_t pbytes = (size_t)nb * cas_q_packed_block_bytes(t);
                const size_t want = pp0 < panels ? (pp0 + 2 <= panels ? 2 : 1) * pbytes : 0;
                const int64_t mine = (mp + nth0 - 1) / nth0; /* tokens this thread quantizes */
                const size_t per = mine > 0 ? ((want + (size_t)mine - 1) / (size_t)mine + 63) & ~(size_t)63 : 0;
                const char *first = (const char *)opt->packed + (size_t)pp0 * pbytes;
                size_t off = 0;
#pragma omp for schedule(static)
                for (int64_t i = 0; i < mp; i++) {
                    for (size_t e = off + per; off < e && off < want; off += 64) __builtin_prefetch(first + off, 0, 3);
                    if (opt->prep && i < m) opt->prep(opt->prep_ctx, i);
                    quantize_x16_slot(x, n, nb, m, i, x16);
                }
            }
            /* One contiguous run of panels per thread (the next-panel prefetch runs
             * ahead within it), handed out as threads arrive, so that a thread that
             * starts late on a busy machine does not hold the other back at the start.
             * Measured in the model against 2 and 3 runs per thread: 2-4% faster. */
            int tid = omp_get_thread_num(), nth = omp_get_num_threads();
            const int64_t chunk = (panels + nth - 1) / nth;
            uint8_t *scr = amx_scratch + AMX_SCRATCH_SKEW + (size_t)tid * amx_thread_stride(n);
            cas_q_amx_begin();
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t c = 0; c < (panels + chunk - 1) / chunk; c++) {
                int64_t p0 = c * chunk, p1 = p0 + chunk < panels ? p0 + chunk : panels;
                cas_q_amx_matmul_panels(t, opt->packed, p0, p1, rows, n, x16, m, y, scr);
            }
            cas_q_amx_end();
        } else if (v16) {
            /* each token quantized as for the other kernels, then moved into the 16-lane layout */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) cas_q_avx2_quantize_x(x + i * n, nb, xq + i * nb, sx + i * nb);
#pragma omp for schedule(static)
            for (int64_t gb = 0; gb < (m + 15) / 16 * nb; gb++) pack_x16(xq, nb, m, gb / nb, gb % nb, xv16 + gb);
        } else if (quant && lanes) {
            /* straight into the token-lane layout, one (group, block) at a time */
#pragma omp for schedule(static)
            for (int64_t gb = 0; gb < (m + 7) / 8 * nb; gb++) {
                int64_t g = gb / nb, k = m - 8 * g < 8 ? m - 8 * g : 8;
                cas_q_avx2_quantize_x8(x + 8 * g * n, n, k, gb % nb, x8 + gb);
            }
        } else if (quant) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) {
                if (avx2)
                    cas_q_avx2_quantize_x(x + i * n, nb, xq + i * nb, sx + i * nb);
                else
                    quantize_x_row(x + i * n, nb, xq + i * nb, sx + i * nb);
            }
        }
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        /* Contiguous ranges of whole 4-row groups, one per thread. */
        int64_t g0 = groups * tid / nth, g1 = groups * (tid + 1) / nth;
        int64_t r0 = g0 * CAS_Q_TILE_ROWS, r1 = g1 * CAS_Q_TILE_ROWS;
        if (r1 > rows) r1 = rows;
        if (amx) {
            /* done above */
        } else if (m == 1) {
            if (avx2)
                cas_q_avx2_matvec_rows(t, wb, rb, r0, r1, n, x, xq, sx, y);
            else
                for (int64_t r = r0; r < r1; r++) y[r] = dot_row_generic(t, wb + (size_t)r * rb, n, x, xq);
        } else if (few) {
            cas_qk_avx512_rows_few(t, wb, rb, n, r0, r1, rows, xq, (size_t)nb * sizeof(cas_q8x_block), m, y);
        } else if (v16) {
            cas_qk_avx512_rows_lanes(t, wb, rb, n, r0, r1, rows, xv16, m, y, tiles + (size_t)tid * tile_bytes(n));
        } else if (avx2) {
            void *tile = tiles + (size_t)tid * tile_bytes(n);
            for (int64_t r = r0; r < r1; r += CAS_Q_TILE_ROWS) {
                int64_t nr = r1 - r < CAS_Q_TILE_ROWS ? r1 - r : CAS_Q_TILE_ROWS;
                if (lanes)
                    cas_q_avx2_matmul_tile_lanes(t, wb, rb, r, nr, rows, n, x8, m, y, tile);
                else
                    cas_q_avx2_matmul_tile(t, wb, rb, r, nr, rows, n, x, xq, sx, m, y, tile);
            }
        } else {
            /* A weight row (at most a few KiB) stays in L1 while every token
             * uses it, so the weights are still read from memory once. */
            for (int64_t r = r0; r < r1; r++)
                for (int64_t i = 0; i < m; i++)
                    y[i * rows + r] = dot_row_generic(t, wb + (size_t)r * rb, n, x + i * n, xq + i * nb);
        }
    }
    cas_free(owned);
    return CAS_OK;
}

/* ---- packed weights ----------------------------------------------------- */

size_t cas_q_packed_block_bytes(int t) {
    switch (t) {
    case CAS_T_Q8_0: return 512 + 32;
    case CAS_T_Q4_0: return 256 + 32;
    case CAS_T_Q4_1: return 256 + 64;
    default: return 0;
    }
}

size_t cas_q_packed_bytes(int t, int64_t rows, int64_t n) {
    size_t rb;
    if (!is_quant(t) || rows <= 0 || cas_tensor_row_bytes(t, n, &rb) != CAS_OK) return 0;
    size_t panels = (size_t)((rows + CAS_Q_PANEL - 1) / CAS_Q_PANEL);
    return panels * (size_t)(n / 32) * cas_q_packed_block_bytes(t);
}

cas_status cas_q_pack(int t, const void *w, int64_t rows, int64_t n, void *dst) {
    size_t rb;
    if (!w || !dst) return cas_error(CAS_ERR_INVALID, "pack: NULL pointer");
    if (!is_quant(t)) return cas_error(CAS_ERR_UNSUPPORTED, "pack: %s has no packed layout", cas_tensor_type_name(t));
    if (rows <= 0) return cas_error(CAS_ERR_INVALID, "pack: %lld rows", (long long)rows);
    cas_status st = cas_tensor_row_bytes(t, n, &rb);
    if (st) return st;
    const int64_t nb = n / 32, panels = (rows + CAS_Q_PANEL - 1) / CAS_Q_PANEL;
    const size_t pb = cas_q_packed_block_bytes(t), bb = cas_tensor_block_bytes(t);
    const int q8 = t == CAS_T_Q8_0;
    const size_t qoff = t == CAS_T_Q4_1 ? 4 : 2, groups = q8 ? 8 : 4, dat = q8 ? 512 : 256;
    const uint8_t *src = w;
    uint8_t *out = dst;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + ((size_t)p * (size_t)nb + (size_t)b) * pb;
            memset(o, 0, pb);
            for (int64_t r = 0; r < CAS_Q_PANEL && p * CAS_Q_PANEL + r < rows; r++) {
                const uint8_t *blk = src + (size_t)(p * CAS_Q_PANEL + r) * rb + (size_t)b * bb;
                for (size_t k = 0; k < groups; k++) memcpy(o + 64 * k + 4 * (size_t)r, blk + qoff + 4 * k, 4);
                memcpy(o + dat + 2 * r, blk, 2);                                  /* d */
                if (t == CAS_T_Q4_1) memcpy(o + dat + 32 + 2 * r, blk + 2, 2); /* m */
            }
        }
    }
    return CAS_OK;
}

/* ---- matrix-vector inside the caller's parallel region ------------------- */

size_t cas_q_xvec_bytes(int64_t n) {
    size_t nb = (size_t)(n / 32), k = cas_qk_x_bytes(CAS_T_Q4_K, n), k32 = cas_qk_x_bytes(CAS_T_IQ4_NL, n);
    size_t b = align64(nb * sizeof(cas_q8x_block)) + align64(nb * 4);
    b = b > k ? b : k;
    return b > k32 ? b : k32;
}

int cas_q_resolve_avx2(cas_q_simd s) { return pick_avx2(s); }

int cas_q_level(int avx2, int avx512) { return !avx2 ? 0 : avx512 && cas_qk_avx512_available() ? 2 : 1; }

void cas_q_xvec_quantize(int t, const float *x, int64_t n, void *buf, int avx2) {
    if (cas_qk_type(t)) {
        cas_qk_quantize_x(t, x, n, buf, avx2);
        return;
    }
    if (!is_quant(t)) return;
    int64_t nb = n / 32;
    cas_q8x_block *xq = buf;
    float *sx = (float *)(void *)((uint8_t *)buf + align64((size_t)nb * sizeof(cas_q8x_block)));
    if (avx2)
        cas_q_avx2_quantize_x(x, nb, xq, sx);
    else
        quantize_x_row(x, nb, xq, sx);
}

void cas_q_matvec_range(int t, const void *w, size_t rb, int64_t n, int64_t r0, int64_t r1,
                        const float *x, const void *buf, float *y, int avx2) {
    if (cas_qk_type(t)) {
        cas_qk_matvec_range(t, w, rb, n, r0, r1, buf, y, avx2);
        return;
    }
    int64_t nb = is_quant(t) ? n / 32 : 0;
    const cas_q8x_block *xq = buf;
    const float *sx = (const float *)(const void *)((const uint8_t *)buf +
                                                    align64((size_t)nb * sizeof(cas_q8x_block)));
    if (avx2)
        cas_q_avx2_matvec_rows(t, w, rb, r0, r1, n, x, xq, sx, y);
    else
        for (int64_t r = r0; r < r1; r++) y[r] = dot_row_generic(t, (const uint8_t *)w + (size_t)r * rb, n, x, xq);
}

void cas_q_thread_rows(int64_t rows, int tid, int nth, int64_t *r0, int64_t *r1) {
    int64_t groups = (rows + CAS_Q_TILE_ROWS - 1) / CAS_Q_TILE_ROWS;
    *r0 = groups * tid / nth * CAS_Q_TILE_ROWS;
    *r1 = groups * (tid + 1) / nth * CAS_Q_TILE_ROWS;
    if (*r1 > rows) *r1 = rows;
    if (*r0 > rows) *r0 = rows;
}

/* ---- benchmarks ------------------------------------------------------------ */

cas_status cas_q_bench(int t, int64_t rows, int64_t n, int64_t m, int nthreads, int cold,
                       double min_seconds, cas_q_bench_result *out) {
    size_t rb;
    if (!out) return cas_error(CAS_ERR_INVALID, "bench: NULL result");
    memset(out, 0, sizeof *out);
    if (rows <= 0 || m <= 0) return cas_error(CAS_ERR_INVALID, "bench: bad shape");
    cas_status st = cas_tensor_row_bytes(t, n, &rb);
    if (st) return st;
    size_t wbytes = rb * (size_t)rows;
    int copies = 1;
    if (cold) {
        size_t want = (size_t)256 << 20;
        copies = (int)((want + wbytes - 1) / wbytes);
        if (copies < 2) copies = 2;
    }
    int nt = resolve_threads(nthreads);
    size_t wsz = cas_q_work_bytes(t, rows, n, m, nt);
    uint8_t *w = cas_alloc_array((size_t)copies, wbytes), *packed = NULL;
    float *src = cas_alloc_array((size_t)n, 4 * (size_t)(rows < 64 ? rows : 64));
    float *x = cas_alloc_array((size_t)m * (size_t)n, 4);
    float *y = cas_alloc_array((size_t)m * (size_t)rows, 4);
    void *work = cas_alloc(wsz);
    if (!w || !src || !x || !y || !work) {
        st = cas_error(CAS_ERR_NOMEM, "bench: %d copies of %zu bytes", copies, wbytes);
        goto done;
    }
    cas_rng rng;
    cas_rng_seed(&rng, 1234);
    int64_t srows = rows < 64 ? rows : 64;
    for (int64_t i = 0; i < srows * n; i++) src[i] = (float)cas_rng_normal(&rng);
    for (int64_t i = 0; i < m * n; i++) x[i] = (float)cas_rng_normal(&rng);
    /* 64 distinct random rows repeated: the content does not change the
     * speed, and quantizing millions of rows would dominate the run. */
    for (int64_t r = 0; r < rows; r += srows) {
        int64_t k = rows - r < srows ? rows - r : srows;
        if ((st = cas_q_quantize_rows(t, src, w + (size_t)r * rb, k, n))) goto done;
    }
    for (int c = 1; c < copies; c++) memcpy(w + (size_t)c * wbytes, w, wbytes);
    /* batched calls run as a model runs them: on the packed copy where the
     * AMX kernels will take it */
    size_t pbytes = m > 1 && auto_amx() ? cas_q_packed_bytes(t, rows, n) : 0;
    if (pbytes) {
        if (!(packed = cas_alloc_array((size_t)copies, pbytes))) {
            st = cas_error(CAS_ERR_NOMEM, "bench: %d packed copies of %zu bytes", copies, pbytes);
            goto done;
        }
        if ((st = cas_q_pack(t, w, rows, n, packed))) goto done;
        for (int c = 1; c < copies; c++) memcpy(packed + (size_t)c * pbytes, packed, pbytes);
    }
    cas_q_opts o = {nt, CAS_Q_SIMD_AUTO, work, wsz, packed, NULL, NULL};
    if ((st = cas_q_matmul(t, w, rows, n, x, m, y, &o))) goto done; /* warm-up */
    /* The best of several windows: other processes on a small machine only
     * ever slow a window down, so the best one is the kernel's own speed. */
    int64_t calls = 0;
    double best = 1e30, t_start = cas_now_s();
    do {
        double t0 = cas_now_s();
        int64_t k = 0;
        do {
            for (int i = 0; i < 4; i++, k++, calls++) {
                o.packed = packed ? packed + (size_t)(calls % copies) * pbytes : NULL;
                if ((st = cas_q_matmul(t, w + (size_t)(calls % copies) * wbytes, rows, n, x, m, y, &o)))
                    goto done;
            }
        } while (cas_now_s() - t0 < min_seconds / 8);
        double per = (cas_now_s() - t0) / (double)k;
        if (per < best) best = per;
    } while (cas_now_s() - t_start < min_seconds);
    out->seconds = best;
    out->weight_bytes = (int64_t)wbytes;
    out->weight_gbs = (double)wbytes / out->seconds * 1e-9;
    out->gflops = 2.0 * (double)rows * (double)n * (double)m / out->seconds * 1e-9;
    out->copies = copies;
done:
    cas_free(w);
    cas_free(packed);
    cas_free(src);
    cas_free(x);
    cas_free(y);
    cas_free(work);
    return st;
}

cas_status cas_q_bench_read_bw(int nthreads, size_t bytes, double min_seconds, double *gbs) {
    if (!gbs || bytes < 4096) return cas_error(CAS_ERR_INVALID, "read bandwidth: bad arguments");
    size_t nw = bytes / 8;
    uint64_t *buf = cas_alloc_array(nw, 8);
    if (!buf) return cas_error(CAS_ERR_NOMEM, "read bandwidth: %zu bytes", bytes);
    int nt = resolve_threads(nthreads);
    /* Touch with the same thread split as the reads (first-touch placement). */
#pragma omp parallel for num_threads(nt) schedule(static)
    for (size_t i = 0; i < nw; i++) buf[i] = i;
    double best = 0, t_start = cas_now_s();
    volatile uint64_t sink = 0;
    do {
        uint64_t total = 0;
        double t0 = cas_now_s();
        /* One cache line per step, prefetched 2 KiB ahead as the kernels
         * prefetch their weights: without it a single core's outstanding
         * misses, not the memory, limit the rate on some CPUs, and the
         * kernels would seem to beat the ceiling. */
#pragma omp parallel for num_threads(nt) schedule(static) reduction(+ : total)
        for (size_t i = 0; i < nw / 8; i++) {
            const uint64_t *p = buf + 8 * i;
            __builtin_prefetch(p + 256);
            total += (p[0] + p[1]) + (p[2] + p[3]) + (p[4] + p[5]) + (p[6] + p[7]);
        }
        double el = cas_now_s() - t0;
        sink += total;
        double g = (double)(nw / 8 * 64) / el * 1e-9;
        if (g > best) best = g;
    } while (cas_now_s() - t_start < min_seconds);
    (void)sink;
    cas_free(buf);
    *gbs = best;
    return CAS_OK;
}

cas_status cas_q_bench_peak(int nthreads, double min_seconds, double *int8_gops, double *f32_gflops) {
    if (!int8_gops || !f32_gflops) return cas_error(CAS_ERR_INVALID, "peak: NULL output");
    *int8_gops = *f32_gflops = 0;
    if (!cpu_has_avx2()) return cas_error(CAS_ERR_UNSUPPORTED, "peak: needs AVX2");
    int nt = resolve_threads(nthreads);
    /* best of several short windows: a neighbour only ever slows one down */
    const long iters = 2000000;
    double t_start = cas_now_s(), best_i = 0;
    do {
        double si = 0;
#pragma omp parallel num_threads(nt) reduction(+ : si)
        si += cas_q_avx2_peak_maddubs(iters);
        if (si > best_i) best_i = si;
    } while (cas_now_s() - t_start < min_seconds);
    *int8_gops = best_i * 64e-9; /* 32 multiply-adds per instruction */
    *f32_gflops = cas_measure_fma_flops(nt) * 1e-9;
    return CAS_OK;
}
