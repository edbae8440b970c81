/*
 * quant_k.h: the K-quant, IQ4 and Q5 weight types, internal to src/model. Their
 * formats and the contract they keep (bitwise batch invariance) are described
 * in quant_impl.h with the other types; quant.c forwards every call on one of
 * these types here (cas_qk_type), so that the code for them lives apart from
 * the 32-element block kernels: quant_k.c holds the formats, the activation
 * quantizer, the portable kernels and the threading, quant_k_avx2.c the AVX2
 * kernels, quant_k_avx512vnni.c the AVX-512 batched kernels.
 *
 * Every path computes, for one weight row and one token, the same f32 chain:
 * the activation x is quantized per token the same way everywhere, each
 * (super-)block's integer dot product is exact (int32), and the f32 result
 * is one sequential fused multiply-add chain over the blocks in order,
 *     s = fma((float)isum_b, d_w * d_x, s)   [+ s = fma((float)imin_b, -(dmin_w * d_x), s)]
 * (Q5_1, whose minimum m is added rather than subtracted: the second step is
 * s = fma((float)xsum_b, m_w * d_x, s), xsum_b the block's sum of x codes)
 * so the result is the same bits in the portable, AVX2, AVX-512 and
 * batched kernels, for any thread count and whatever other tokens share the
 * call.
 *
 * The types of 32-element blocks (IQ4_NL, Q5_0, Q5_1: cas_qk_b32) pair with
 * an activation of 32-element blocks too (cas_q8b_block), so that their rows
 * need only be a multiple of 32: llama.cpp's K-quant files use Q5_0, Q5_1
 * (and Q8_0) for the matrices whose width is not a multiple of 256.
 */
#ifndef CASCADE_MODEL_QUANT_K_H
#define CASCADE_MODEL_QUANT_K_H

#include <stddef.h>
#include <stdint.h>

#include "../core/core.h"
#include "tensor.h"

#define CAS_QK_SUPER 256 /* elements per super-block */

/* x quantized per 256-element super-block for the super-block types (the
 * activation ggml calls Q8_K): x[i] ~= d * q[i], d = amax / 127, q rounded to
 * nearest (ties to even) and clamped to +-127; bsum[k] = sum of q[16k ..
 * 16k+15], which the zero-point and offset terms need. 320 bytes, so that
 * every q row of a 64-byte aligned array is aligned. */
typedef struct {
    int8_t q[CAS_QK_SUPER];
    int16_t bsum[16];
    float d;
    uint8_t pad[28];
} cas_q8k_block;

/* x quantized per 32-element block for the 32-element block types (whose
 * rows need only be a multiple of 32): x[i] ~= d * q[i] as above, s the sum
 * of q (for Q5_0's offset and Q5_1's minimum). 64 bytes. */
typedef struct {
    int8_t q[32];
    float d;
    int32_t s;
    uint8_t pad[24];
} cas_q8b_block;

/* Eight tokens' x for one super-block, transposed for the batched kernels:
 * q[g] holds elements 4g .. 4g+3 of each token (token t in bytes 4t .. 4t+3),
 * so that four weight codes broadcast against it give every token's partial
 * sums in its own lane; bs[p] holds each token's sums of the 16-element
 * groups 2p and 2p+1 (token t in 16-bit lanes 2t, 2t+1); d the tokens'
 * scales. Tokens past the call's m are zero. 2336 bytes, a multiple of 32. */
typedef struct {
    int8_t q[64][32];
    int16_t bs[8][16];
    float d[8];
} cas_q8k8_block;

/* The same for the 32-element blocks: q[g] elements 4g .. 4g+3 of each
 * token, xs each token's sum of q, d the tokens' scales. 320 bytes. */
typedef struct {
    int8_t q[8][32];
    int32_t xs[8];
    float d[8];
} cas_q8b8_block;

/* Sixteen tokens' x for the AVX-512 batched kernels: the layout of
 * cas_q8k8_block with 16 tokens (q[g] 64 bytes, bs[p] 32 int16), and xs[j]
 * each token's sum over the 32-element sub-block j. 5184 bytes. */
typedef struct {
    int8_t q[64][64];
    int16_t bs[8][32];
    int32_t xs[8][16];
    float d[16];
} cas_q8k16_block;

/* The same for the 32-element blocks. 640 bytes. */
typedef struct {
    int8_t q[8][64];
    int32_t xs[16];
    float d[16];
} cas_q8b16_block;

/* Batched calls with at least this many tokens use the token-lane kernels:
 * they pad to multiples of eight tokens, so below this the row-lane kernel,
 * run once per token (the row group from L1 after the first), does less
 * work. Measured with the weights streamed from memory (2 threads, AVX-512
 * VNNI machine): 9216 x 2304 Q4_K rows-per-token faster up to 11 tokens,
 * 2304 x 9216 Q6_K token lanes faster from 6. */
#define CAS_QK_LANE_MIN_M 7

/* Rows the token-lane kernels decode at a time, and the bytes of one row's
 * block decoded (cas_qk_tblk, cas_qk_tblk_nl). */
#define CAS_QK_TILE 4
#define CAS_QK_TILE_BLOCK_BYTES 384
#define CAS_QK_TILE_BLOCK_BYTES_NL 64

/* The 16 values of the IQ4 formats' 4-bit indices (the format's table). */
extern const int8_t cas_qk_iq4_values[16];

/* 1 for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, Q5_0, Q5_1; else 0. */
int cas_qk_type(int t);

/* 1 for the types of 32-element blocks among them: IQ4_NL, Q5_0, Q5_1. */
static inline int cas_qk_b32(int t) { return t == CAS_T_IQ4_NL || t == CAS_T_Q5_0 || t == CAS_T_Q5_1; }

/* Elements per block (256; 32 for cas_qk_b32), bytes per block, name ("q4_k",
 * ...); 0 / 0 / NULL for other types. */
int64_t cas_qk_block_size(int t);
size_t cas_qk_block_bytes(int t);
const char *cas_qk_name(int t);

/* One row of n elements (a multiple of the block size; checked by the
 * caller). */
void cas_qk_dequantize_row(int t, const uint8_t *src, float *dst, int64_t n);
void cas_qk_quantize_row(int t, const float *x, uint8_t *dst, int64_t n);

/* Bytes of one token's quantized x for weights of type t with n columns. */
size_t cas_qk_x_bytes(int t, int64_t n);

/* Scratch of a cas_qk_matmul call (m tokens, nt threads). */
size_t cas_qk_work_bytes(int t, int64_t n, int64_t m, int nt);

/* Kernel level: 0 portable, 1 AVX2+FMA+F16C, 2 the same and the AVX-512 VNNI
 * kernels (batched; Q5's one-token rows) (the caller has checked the CPU:
 * cas_qk_avx512_available). */

/* 1 when the AVX-512 VNNI kernels can run: AVX-512 F/BW/VL/DQ (src/core's
 * check, which includes the OS's state saving), AVX2 and AVX512-VNNI. */
int cas_qk_avx512_available(void);

/* Y[m][rows] = X[m][n] . W^T as cas_q_matmul specifies (arguments checked by
 * the caller; rb = row bytes; work: cas_qk_work_bytes, 64-byte aligned; nt
 * OpenMP threads). */
void cas_qk_matmul(int t, const uint8_t *w, size_t rb, int64_t rows, int64_t n, const float *x, int64_t m,
                   float *y, int level, int nt, void *work);

/* x[n] quantized for weights of type t into buf (cas_qk_x_bytes). */
void cas_qk_quantize_x(int t, const float *x, int64_t n, void *buf, int level);

/* y[r] = W[r] . x for r in [r0, r1), x quantized in buf by cas_qk_quantize_x. */
void cas_qk_matvec_range(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1,
                         const void *buf, float *y, int level);

/* ---- AVX2 (quant_k_avx2.c) ------------------------------------------------ */

/* x quantized as cas_qk_quantize_x does, bit for bit. */
void cas_qk_avx2_quantize_x(int t, const float *x, int64_t n, void *buf);

/* Rows [r0, r1) of W against m tokens of quantized x (token i at xq + i *
 * xstride bytes), into Y[m][rows] (token i's row at y + i * rows): eight
 * rows in the lanes, the tokens one after another. */
void cas_qk_avx2_rows(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                      const uint8_t *xq, size_t xstride, int64_t m, float *y);

/* One row's super-block decoded for the token-lane kernels (CAS_QK_TILE_BLOCK_BYTES). */
typedef struct {
    uint8_t c[CAS_QK_SUPER]; /* codes in element order (IQ4_XS: the signed table values, or with
                                iq4_offset those plus 128, as unsigned bytes) */
    int32_t sc[16];          /* sub-block j's scale in both 16-bit halves */
    int32_t sp[8];           /* 16-bit pairs against bsum pair p: (sc_2p, sc_2p+1) for Q6_K and Q3_K's
                                offsets, the minimums (mn_p, mn_p) for Q4_K, Q5_K, (mn_2p, mn_2p+1) for Q2_K */
    float d, dmin;
    uint8_t pad[24];
} cas_qk_tblk;

/* One block of a 32-element block type decoded (CAS_QK_TILE_BLOCK_BYTES_NL):
 * IQ4_NL's table values (plus 128 with iq4_offset), or Q5_0's and Q5_1's
 * codes 0..31 (Q5_0's value is the code minus 16); d, and Q5_1's m. */
typedef struct {
    int8_t v[32];
    float d, m;
    uint8_t pad[24];
} cas_qk_tblk_nl;

/* A block of type t (a super-block type) decoded, or one of a 32-element
 * block type t. */
void cas_qk_avx2_decode(int t, const uint8_t *blk, cas_qk_tblk *o, int iq4_offset);
void cas_qk_avx2_decode_nl(int t, const uint8_t *blk, cas_qk_tblk_nl *o, int iq4_offset);

/* The same with the tokens in the lanes, from x8[ceil(m / 8)][blocks]
 * (cas_q8k8_block, or cas_q8b8_block for cas_qk_b32); tile: CAS_QK_TILE *
 * blocks * CAS_QK_TILE_BLOCK_BYTES (CAS_QK_TILE_BLOCK_BYTES_NL for cas_qk_b32)
 * of 32-byte aligned scratch, one row's block decoded taking that many. */
void cas_qk_avx2_rows_lanes(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                            const void *x8, int64_t m, float *y, void *tile);

/* ---- AVX-512 with VNNI (quant_k_avx512vnni.c) ------------------------------ */

/* Batched calls with at least this many tokens take the AVX-512 kernels
 * (sixteen tokens in the lanes) where they may run. */
#define CAS_QK_LANE16_MIN_M 12

/* As cas_qk_avx2_rows (the same bits) on AVX-512VL with VNNI in 256-bit
 * vectors: one token of Q5_0 and Q5_1 by their own row kernel, several by
 * cas_qk_avx512_rows_few (the super-block types from CAS_QK_FEW_MIN_M); the
 * rest go to cas_qk_avx2_rows. */
void cas_qk_avx512_rows(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                        const uint8_t *xq, size_t xstride, int64_t m, float *y);

/* As cas_qk_avx2_rows_lanes with sixteen tokens in the lanes, from
 * x16[ceil(m / 16)][blocks] (cas_q8k16_block, cas_q8b16_block for cas_qk_b32);
 * also quant.c's Q8_0, Q4_0 and Q4_1 (their 16-lane x in cas_q8b16_block). */
void cas_qk_avx512_rows_lanes(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                              const void *x16, int64_t m, float *y, void *tile);

/* Calls of a few tokens on AVX-512VL VNNI (quant_k_avx512vnni.c): rows
 * [r0, r1) against m tokens (token i's x at xq + i * xstride bytes) into
 * Y[m][rows], eight rows in the lanes and each block's codes decoded once
 * for up to eight tokens; the bits of each token's matvec. The 32-element
 * block types take it for 2 to CAS_Q_FEW_MAX_M tokens: Q8_0, Q4_0, Q4_1
 * (quant.c's, x as cas_q8x_block[n / 32] per token) and IQ4_NL, Q5_0, Q5_1
 * (x as cas_qk_quantize_x makes it); the super-block types for
 * CAS_QK_FEW_MIN_M to CAS_QK_FEW_MAX_M (x likewise). Measured with the
 * weights streamed from memory (2 threads, Zen 4): against the token-lane
 * kernels the 32-element types' kernel is faster up to 24 tokens and even at
 * 32 (Q4_1 49152 x 576, 16 tokens: 2.9 vs 4.0 ms); the super-block types'
 * (their rows decoded and transposed per super-block) is slower than the
 * per-token row kernel at 2 tokens (Q4_K 9216 x 2304: 0.96 vs 0.72 ms),
 * even at 3 and faster from 4 (1.12 vs 1.44 ms), and even with the 16-token
 * kernel at 12. */
#define CAS_Q_FEW_MAX_M 31
#define CAS_QK_FEW_MIN_M 3
#define CAS_QK_FEW_MAX_M 11
void cas_qk_avx512_rows_few(int t, const uint8_t *w, size_t rb, int64_t n, int64_t r0, int64_t r1, int64_t rows,
                            const void *xq, size_t xstride, int64_t m, float *y);

#endif
