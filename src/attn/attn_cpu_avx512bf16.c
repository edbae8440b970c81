/*
 * attn_cpu_avx512bf16.c: the blocked attention kernel (attn_kern.inc) for
 * bf16 KV with the AVX-512 BF16 dot-product instruction (vdpbf16ps): queries
 * and probabilities are rounded to bf16 and each instruction sums two
 * products per lane, so the shared-prefix pass does twice the multiply-adds
 * per instruction of the f32 FMA kernel. Opt-in (cas_attn_plan_opts.bf16_dot)
 * because of that rounding; every item takes the blocked path (no decode
 * path), so a row's output still does not depend on the batch around it.
 * Compiled with AVX-512 + BF16 flags; attn_cpu.c picks it only when the CPU
 * has AVX-512 and AVX512_BF16.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attn_impl.h"

#include "attn_vec512.h"

/* acc += a.pairs . b.pairs, the operands as raw 32-bit lanes of two bf16 each */
#define VDPBF(acc, a, b) \
    _mm512_dpbf16_ps((acc), (__m512bh)_mm512_castps_si512(a), (__m512bh)_mm512_castps_si512(b))
#define KERNEL_NAME cas_attn_item_avx512bf16

#include "attn_kern.inc"
