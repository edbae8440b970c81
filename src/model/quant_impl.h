/*
 * quant_impl.h: tensor element types and the CPU matrix kernels of the model
 * layer (internal to src/model). Weights stay in their file format (ggml's
 * 32-element blocks for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL; its 256-element super-
 * blocks for Q2_K .. Q6_K and IQ4_XS; plain F32, F16, BF16) and the
 * kernels read them in place, because decode is bound by the bytes of weights
 * read per token: unpacking to f32 first would multiply those bytes by 4-8.
 * The AMX kernels for batched calls read a packed copy instead (the same
 * bytes rearranged into 16-row panels, see "packed weights" below).
 *
 * Block formats (little-endian, no padding):
 *   Q8_0: f16 d, int8 q[32];             x[i] = d * q[i]
 *   Q4_0: f16 d, uint8 qs[16];           x[i] = d * (nib(i) - 8)
 *   Q4_1: f16 d, f16 m, uint8 qs[16];    x[i] = d * nib(i) + m
 * where nib(i) is the low nibble of qs[i] for i < 16 and the high nibble of
 * qs[i - 16] for i >= 16 (ggml's order).
 *
 * K-quants and IQ4 (quant_k.c has the byte layouts): a super-block of 256
 * elements in sub-blocks of 32 (Q4_K, Q5_K, IQ4_XS) or 16 (Q2_K, Q3_K,
 * Q6_K), each with an integer scale sc_j (and for Q2_K, Q4_K, Q5_K a minimum
 * mn_j) under the super-block's f16 d (and dmin):
 *   x = d * sc_j * v - dmin * mn_j
 *   Q2_K (84 bytes):  v 0..3,   sc, mn 4 bits   Q5_K (176):  v 0..31, 6 bits
 *   Q3_K (110):       v -4..3,  sc 6 bits       Q6_K (210):  v -32..31, sc int8
 *   Q4_K (144):       v 0..15,  sc, mn 6 bits   IQ4_XS (136): v = T[4 bits], sc 6 bits
 *   IQ4_NL (18, 32-element blocks): f16 d, x = d * T[4 bits]
 * where T is a fixed table of 16 values in -127..113 (cas_qk_iq4_values).
 * Q5_0 and Q5_1 (quant_k.c too, 32-element blocks: the 4-bit types with a
 * fifth bit per element in a 32-bit qh):
 *   Q5_0 (22): f16 d, u32 qh, qs[16];          x = d * (v - 16), v 0..31
 *   Q5_1 (24): f16 d, f16 m, u32 qh, qs[16];   x = d * v + m
 * Files mix them per tensor (a Q4_K_M file holds Q4_K and Q6_K matrices, and
 * falls back to other types for rows that are not a multiple of 256).
 *
 * For quantized weights the kernels first quantize the activation x to 8 bits
 * per 32-element block (an f32 scale, plus the block's sum for the zero-point
 * terms of Q4_0 and Q4_1) and compute exact integer dot products per block,
 * accumulating in f32 across blocks. The cost is an error on x of at most
 * half a step of its block scale: |y - y_exact| <= sum_b (amax_b(x) / 254) *
 * sum_{i in b} |w_i| plus f32 rounding. Float weights (F32, F16, BF16) use x
 * as given. The K-quant and IQ4_XS kernels quantize x per 256-element
 * super-block (the activation ggml calls Q8_K, with the sums of each 16
 * elements for the minimum and offset terms), IQ4_NL, Q5_0 and Q5_1 per
 * 32-element block; the same bound holds with those blocks.
 *
 * Batch invariance (K-quant, IQ4 and Q5 types): row i of cas_q_matmul(..., m,
 * ...) is bitwise identical to cas_q_matvec on row i of x alone, for every m,
 * every thread count and every instruction-set path (portable and AVX2 give
 * the same bits too), and to cas_q_matvec_range. Every path quantizes x per
 * token the same way, computes each block's integer dot product exactly
 * (int32), and accumulates one f32 chain per (weight row, token) over the
 * blocks in order: s = fma((float)isum_b, d_w * d_x, s), then for the types
 * with a minimum s = fma((float)imin_b, -(dmin_w * d_x), s) (Q5_1, whose
 * minimum m is added: s = fma((float)xsum_b, m_w * d_x, s)).
 *
 * Batch invariance: y for one token does not depend on the other tokens of
 * the call, on m, on the thread count or on which kernel ran, only on the
 * instruction set (and for the quantized types not even on that: the
 * portable, AVX2 and AMX kernels give the same bits). Every quantized kernel
 * computes y[r] by one chain per (row, token): for each block b in order, its
 * exact integer dot product s_b, then acc = fma((float)s_b, d_b * dx_b, acc)
 * and, for Q4_0 and Q4_1, acc = fma(m_b, sx_b, acc) with m_b = -8 d_b (Q4_0) or
 * the block minimum (Q4_1) and sx_b = dx_b * sum(q_x). Float weights: the
 * AVX2 kernels keep eight partial sums per (row, token) over elements i mod 8,
 * add them in hsum order, then the tail elements by fma; the portable one sums
 * in element order. A serving engine needs this so that a request's tokens do
 * not change with the requests batched beside it.
 *
 * Threading: every call is reentrant; the kernels split rows over OpenMP
 * threads inside the call (nthreads 0 = omp_get_max_threads()). Nothing is
 * allocated when the caller passes a workspace of cas_q_work_bytes().
 */
#ifndef CASCADE_MODEL_QUANT_IMPL_H
#define CASCADE_MODEL_QUANT_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "../core/core.h"
#include "tensor.h"

/* Elements per block of the quantized types. */
#define CAS_Q_BLOCK 32

/* ---- type info ---------------------------------------------------------- */

/* 1 when the kernels here can compute with type t (F32, F16, BF16, Q8_0,
 * Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS),
 * else 0. */
int cas_tensor_type_supported(int t);

/* Elements per block (1 for plain types, 32 or 256 for quantized); 0 if t is
 * not a supported type. */
int64_t cas_tensor_block_size(int t);

/* Bytes per block; 0 if t is not a supported type. */
size_t cas_tensor_block_bytes(int t);

/* A short name: "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", ...;
 * "?" otherwise. */
const char *cas_tensor_type_name(int t);

/* Bytes of one row of n elements into *bytes. CAS_ERR_UNSUPPORTED for a type
 * the kernels do not handle (the message names it), CAS_ERR_INVALID when
 * n <= 0 or n is not a multiple of the block size. */
cas_status cas_tensor_row_bytes(int t, int64_t n, size_t *bytes);

/* ---- conversion ---------------------------------------------------------- */

/* Dequantizes one row of n elements of type t at src into dst[n] (f32). */
cas_status cas_q_dequantize_row(int t, const void *src, float *dst, int64_t n);

/* Quantizes rows x rows of n f32 values (contiguous, row-major) into type t
 * at dst (rows * row_bytes). Round to nearest; the block scales are rounded
 * to f16 first and the values quantized against the stored scale, so the
 * round trip error is at most half a step (Q8_0, Q4_1) and one step for the
 * extreme opposite value of Q4_0, which has 8 steps below zero and 7 above.
 * The K-quant and IQ4 quantizers are as simple (bounds in quant_k.c and
 * tests/test_quant.c), not the error-minimizing searches of ggml's.
 * Values must be finite and below the f16 range times the step count.
 * Single-threaded (for tests and synthetic weights, not the hot path). */
cas_status cas_q_quantize_rows(int t, const float *x, void *dst, int64_t rows, int64_t n);

/* ---- matrix kernels ----------------------------------------------------- */

/* Instruction set of the kernels: AUTO picks AVX2+FMA+F16C when the CPU has
 * it (cas_cpu_features_get in src/core); for batched calls (m > 1) on
 * quantized weights whose packed copy is given (cas_q_opts.packed) it picks
 * the AMX-INT8 kernels when cas_q_amx_available(): a caller that wants no
 * AMX passes no packed copy or asks for AVX2. GENERIC forces the portable
 * path. AVX2 asks for AVX2 and fails with CAS_ERR_UNSUPPORTED
 * when the CPU lacks it. AMX asks for the AMX kernels for m > 1 (AVX2 for
 * m = 1) and fails with CAS_ERR_UNSUPPORTED when they cannot run, or with
 * CAS_ERR_INVALID when a batched call on a quantized type has no packed
 * copy. The K-quant and IQ4 types have no AMX kernels (and no packed
 * layout): for them AUTO and AMX take the best vector kernels. AVX512 asks
 * for the AVX-512 kernels where a type has them (the batched kernels of the
 * K-quant and IQ4 types, which also need AVX512-VNNI; AVX2 without it) and
 * AVX2 elsewhere, and fails with CAS_ERR_UNSUPPORTED when the CPU lacks
 * AVX-512. Every path gives the K-quant and IQ4 types the same bits. */
typedef enum {
    CAS_Q_SIMD_AUTO = 0,
    CAS_Q_SIMD_GENERIC = 1,
    CAS_Q_SIMD_AVX2 = 2,
    CAS_Q_SIMD_AMX = 3,
    CAS_Q_SIMD_AVX512 = 4
} cas_q_simd;

/* Options of a kernel call; a NULL pointer means all defaults (zeroes). */
typedef struct {
    int nthreads;       /* OpenMP threads; 0 = omp_get_max_threads() */
    cas_q_simd simd;    /* instruction set, see above */
    void *work;         /* scratch of at least work_bytes, 64-byte aligned; NULL = allocate in the call */
    size_t work_bytes;  /* size of work */
    const void *packed; /* the same W in the packed layout (cas_q_pack), or NULL: batched calls then
                           may take the AMX kernels */
    /* prep(prep_ctx, i), if set, makes row i of x (batched calls) before the call reads
     * it: the caller's elementwise step fused into the product (the AMX path runs it
     * where it quantizes that row, in the same parallel region; the others in a region
     * of their own first). Rows are independent; called once per row, any thread. */
    void (*prep)(void *prep_ctx, int64_t i);
    void *prep_ctx;
} cas_q_opts;

/* The name of the path AUTO resolves to on this machine now for a matrix-
 * vector product ("avx2" or "generic"). */
const char *cas_q_simd_name(void);

/* The name of the path AUTO resolves to for a batched call on quantized
 * weights with a packed copy: "amx", "avx2" or "generic". */
const char *cas_q_batch_simd_name(void);

/* ---- packed weights (the AMX kernels' layout) -----------------------------
 * Rows go in panels of CAS_Q_PANEL (the last one padded with zero rows);
 * panel p, block b is CAS_Q_PANEL rows x 32 elements at byte offset
 * (p * nb + b) * cas_q_packed_block_bytes(t), nb = n / 32:
 *   Q8_0: int8 q[8][16][4] (q[k][r][i] = element 4k+i of row r: the "VNNI"
 *         layout of an AMX B tile of 8 rows x 64 bytes), f16 d[16]: 544 bytes.
 *   Q4_0, Q4_1: uint8 qs[4][16][4], the same layout for elements 0..15 in
 *         the low nibbles and 16..31 in the high nibbles (each 4-byte group
 *         is 4 bytes of the row's own qs, so ggml's nibble order carries
 *         over), f16 d[16], and for Q4_1 f16 m[16]: 288 / 320 bytes.
 * The same bytes as the file's blocks, rearranged: a packed copy is as
 * large as the matrix (plus the padding rows). */
#define CAS_Q_PANEL 16

/* 1 when the AMX-INT8 kernels can run in this process: the CPU has
 * AMX-TILE, AMX-INT8, AVX-512 F/BW/VL/DQ and AVX2+FMA+F16C, the OS enables
 * the tile state (XCR0) and grants this process its use (arch_prctl
 * ARCH_REQ_XCOMP_PERM, asked once, on the first call); else 0 and the AVX2
 * kernels are used. Thread-safe. */
int cas_q_amx_available(void);

/* Bytes of one packed panel block of type t; 0 for types without a packed
 * layout (the float types). */
size_t cas_q_packed_block_bytes(int t);

/* Bytes of W[rows][n] of type t packed; 0 for types without a packed layout
 * or invalid shapes. */
size_t cas_q_packed_bytes(int t, int64_t rows, int64_t n);

/* Packs W[rows][n] of type t (file layout) into dst (cas_q_packed_bytes,
 * any alignment; 64 is best). Portable code, OpenMP over panels. */
cas_status cas_q_pack(int t, const void *w, int64_t rows, int64_t n, void *dst);

/* Bytes of scratch a call of cas_q_matmul with these arguments needs (m = 1
 * for cas_q_matvec); nthreads as in cas_q_opts. 0 if the arguments are
 * invalid. Allocate it once at start-up for the largest shapes and pass it in
 * cas_q_opts.work: then the kernels allocate nothing. */
size_t cas_q_work_bytes(int t, int64_t rows, int64_t n, int64_t m, int nthreads);

/* y[rows] = W[rows][n] . x[n]. W is rows rows of type t, each row_bytes(t, n)
 * bytes, contiguous. Every y[r] is written. x and y must not overlap W or
 * each other. */
cas_status cas_q_matvec(int t, const void *w, int64_t rows, int64_t n, const float *x, float *y,
                        const cas_q_opts *opt);

/* Y[m][rows] = X[m][n] . W[rows][n]^T: m tokens through one weight matrix,
 * which is read from memory once per call (rows are processed in tiles that
 * all m tokens use while the tile is in cache). X and Y are row-major and
 * contiguous. m = 1 is the same as cas_q_matvec. w may be NULL when
 * opt->packed is given: the call then fails with CAS_ERR_INVALID unless it
 * takes the AMX kernels. */
cas_status cas_q_matmul(int t, const void *w, int64_t rows, int64_t n, const float *x, int64_t m,
                        float *y, const cas_q_opts *opt);

/* ---- matrix-vector inside the caller's parallel region -------------------
 * For a forward pass that runs one OpenMP region over many matrices (single-
 * sequence decode), so that threads meet at a few barriers instead of
 * forking and joining per matrix: every thread quantizes x itself into its
 * own buffer (cheap: n values) and computes a range of rows. The results are
 * bit-identical to cas_q_matvec with the same instruction set. */

/* Bytes of one quantized x of n elements (any supported type; for float
 * types nothing is stored). */
size_t cas_q_xvec_bytes(int64_t n);

/* The instruction set `s` resolves to: 1 AVX2, 0 portable, -1 (error
 * recorded) when AVX2 is asked for but missing. */
int cas_q_resolve_avx2(cas_q_simd s);

/* The kernel level of cas_q_xvec_quantize and cas_q_matvec_range: 0
 * portable, 1 AVX2, 2 AVX2 with the AVX-512VL VNNI row kernels where a type
 * has them (the same bits). avx2 as cas_q_resolve_avx2 gives it; avx512: the
 * caller allows AVX-512. */
int cas_q_level(int avx2, int avx512);

/* x[n] quantized for weights of type t into buf (cas_q_xvec_bytes(n), 64-byte
 * aligned); nothing for float types. avx2: a level of cas_q_level. */
void cas_q_xvec_quantize(int t, const float *x, int64_t n, void *buf, int avx2);

/* y[r] = W[r] . x for r in [r0, r1), with x given both as floats (for float
 * types) and quantized in buf by cas_q_xvec_quantize. rb = row bytes of W;
 * avx2: a level of cas_q_level. */
void cas_q_matvec_range(int t, const void *w, size_t rb, int64_t n, int64_t r0, int64_t r1,
                        const float *x, const void *buf, float *y, int avx2);

/* The rows [*r0, *r1) thread tid of nth takes of a matrix of `rows` rows:
 * contiguous whole 4-row groups, as cas_q_matmul splits them. */
void cas_q_thread_rows(int64_t rows, int tid, int nth, int64_t *r0, int64_t *r1);

/* ---- benchmarks ----------------------------------------------------------- */

typedef struct {
    double seconds;      /* wall time of one call: mean over the best of ~8 windows */
    double weight_gbs;   /* weight bytes per call / seconds, 1e9 bytes/s */
    double gflops;       /* 2 * rows * n * m / seconds, 1e9/s */
    int64_t weight_bytes; /* bytes of one weight matrix */
    int copies;          /* distinct weight copies cycled through (cold runs) */
} cas_q_bench_result;

/* Times cas_q_matmul (cas_q_matvec when m = 1) on random weights of type t for
 * about min_seconds. cold != 0 cycles through enough copies of the matrix
 * (>= 256 MiB in all) that each call reads its weights from DRAM, as a model's
 * decode step does; cold == 0 measures a cache-resident matrix. */
cas_status cas_q_bench(int t, int64_t rows, int64_t n, int64_t m, int nthreads, int cold,
                       double min_seconds, cas_q_bench_result *out);

/* Read bandwidth of this machine in 1e9 bytes/s: nthreads threads sum a
 * buffer of `bytes` (use far more than the last-level cache) for about
 * min_seconds; the best pass is reported. */
cas_status cas_q_bench_read_bw(int nthreads, size_t bytes, double min_seconds, double *gbs);

/* Instruction-throughput ceilings of this machine with nthreads threads
 * (each runs independent chains for about min_seconds in all): int8 GOP/s
 * (2 ops per multiply-add) of _mm256_maddubs_epi16, the instruction the
 * quantized kernels are built on, and f32 GFLOP/s of FMA (core's
 * cas_measure_fma_flops, the same ceiling attn-bench reports).
 * CAS_ERR_UNSUPPORTED without AVX2. */
cas_status cas_q_bench_peak(int nthreads, double min_seconds, double *int8_gops, double *f32_gflops);

/* ---- internal: shared by quant.c and quant_avx2.c ------------------------ */

/* x quantized to 8 bits per block: x[i] ~= d * q[i]; s = d * sum(q). */
typedef struct {
    float d;
    float s;
    int8_t q[CAS_Q_BLOCK];
} cas_q8x_block;

/* Eight tokens' x for one block, transposed so that one vector holds four
 * consecutive elements of each of the eight tokens: q[k][t][i] is element
 * 4 k + i of token t. With it the batched kernel keeps tokens in SIMD lanes
 * and broadcasts four weight bytes against them (see quant_avx2.c). Missing
 * tokens of the last group are zero. 320 bytes, a multiple of 32. */
typedef struct {
    int8_t q[8][8][4];
    float d[8]; /* scale of each token's block */
    float s[8]; /* d * sum(q) of each token's block */
} cas_q8x8_block;

/* Rows per register tile of the kernels. */
#define CAS_Q_TILE_ROWS 4

/* AVX2 kernels (quant_avx2.c). Row ranges [r0, r1) of one thread; xq is x
 * quantized (nb = n / 32 blocks per token) and sx[m][nb] its block sums
 * (copies of xq[].s, contiguous); xf is the f32 x, used for float types. */
void cas_q_avx2_matvec_rows(int t, const uint8_t *w, size_t row_bytes, int64_t r0, int64_t r1,
                            int64_t n, const float *xf, const cas_q8x_block *xq, const float *sx,
                            float *y);
/* x of one token (nb blocks) quantized as quantize_x_row does, bit for bit. */
void cas_q_avx2_quantize_x(const float *x, int64_t nb, cas_q8x_block *xq, float *sx);
/* Block b of ntok <= 8 tokens (rows of x, n floats apart) quantized straight
 * into the token-lane layout; tokens past ntok are zero. */
void cas_q_avx2_quantize_x8(const float *x, int64_t n, int64_t ntok, int64_t b, cas_q8x8_block *o);
/* Float types t: one tile of nr <= CAS_Q_TILE_ROWS rows starting at r0, all m
 * tokens; y is Y[m][rows]. tile is 64-byte aligned scratch of
 * CAS_Q_TILE_ROWS * n floats (the tile's weights converted once, then used by
 * every token). */
void cas_q_avx2_matmul_tile(int t, const uint8_t *w, size_t row_bytes, int64_t r0, int64_t nr,
                            int64_t rows, int64_t n, const float *xf, const cas_q8x_block *xq,
                            const float *sx, int64_t m, float *y, void *tile);
/* The same for quantized t (every m > 1), from x8[ceil(m/8)][nb]. */
void cas_q_avx2_matmul_tile_lanes(int t, const uint8_t *w, size_t row_bytes, int64_t r0,
                                  int64_t nr, int64_t rows, int64_t n, const cas_q8x8_block *x8,
                                  int64_t m, float *y, void *tile);

/* x of 16 tokens for one block in the AMX layout: q[t] is token t's block
 * (an AMX A tile of 16 rows x 32 bytes), d and s as in cas_q8x_block.
 * Tokens past the call's m are zero. 640 bytes. */
typedef struct {
    int8_t q[CAS_Q_PANEL][CAS_Q_BLOCK];
    float d[CAS_Q_PANEL];
    float s[CAS_Q_PANEL];
} cas_q8x16_block;

/* Token t of a 16-token group, x[n] quantized as quantize_x_row does, bit
 * for bit, into g[0..nb) (the group's blocks) (quant_avx2.c). */
void cas_q_avx2_quantize_x16(const float *x, int64_t nb, int t, cas_q8x16_block *g);

/* AMX kernels (quant_amx.c): Y[m][rows] for the panels [p0, p1) of the
 * packed W, from x16[ceil(m/16)][nb]. scratch: cas_q_amx_scratch_bytes(n),
 * 64-byte aligned, per thread (a panel's Q4 weights unpacked to bytes, and
 * two int32 result tiles). The caller has checked cas_q_amx_available, and
 * the calling thread brackets its calls with cas_q_amx_begin (loads the
 * tile configuration) and cas_q_amx_end (releases the tile state). */
void cas_q_amx_begin(void);
void cas_q_amx_end(void);
static inline size_t cas_q_amx_scratch_bytes(int64_t n) { return (size_t)(n / 32) * 512 + 2048; }
void cas_q_amx_matmul_panels(int t, const uint8_t *packed, int64_t p0, int64_t p1, int64_t rows,
                             int64_t n, const cas_q8x16_block *x16, int64_t m, float *y, void *scratch);

/* Elementwise work of the forward pass, AVX2+FMA+F16C (quant_avx2.c):
 * h[i] = silu(g[i]) * u[i] with a vector e^x within 2 ulp, its argument
 * clamped to [-87.3, 88.3] (g above 87.3 gives g / (1 + 2^-126) = g; g
 * below -88.3 gives g e^-88.3, below 1e-36 |g|, instead of about 0);
 * f32 to f16 rounded to nearest even (as cas_f32_to_f16 for finite values);
 * RMSNorm out = x / sqrt(mean(x^2) + eps) * w with the sum of squares in
 * double, as the portable code does, in another order. */
void cas_q_avx2_silu_mul(const float *g, const float *u, float *h, int64_t n);
void cas_q_avx2_f32_to_f16(const float *src, uint16_t *dst, int64_t n);
void cas_q_avx2_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps);
/* RoPE of `heads` rows of head_dim floats: adjacent pairs of the first n_rot,
 * cs = (cos, sin) per pair (quant_avx2.c). */
void cas_q_avx2_rope(float *x, int32_t heads, int32_t head_dim, int32_t n_rot, const float *cs);
/* quant_avx512.c: SwiGLU on AVX-512 (call it only where
 * cas_cpu_features_get() reports avx512), giving cas_q_avx2_silu_mul's bits. */
void cas_q_avx512_silu_mul(const float *g, const float *u, float *h, int64_t n);

/* Instructions per second of one thread (quant_avx2.c). */
double cas_q_avx2_peak_maddubs(long iters);

#endif
