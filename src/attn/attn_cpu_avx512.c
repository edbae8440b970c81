/*
 * attn_cpu_avx512.c: the blocked attention kernel (attn_kern.inc) with
 * 16-wide AVX-512 vectors (tile packing stays 8-wide: AVX-512 implies AVX2).
 * Compiled with AVX-512 flags; attn_plan.c calls it only when the CPU has
 * AVX-512 F/BW/VL/DQ.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attn_impl.h"

#include "attn_vec512.h"

#define KERNEL_NAME cas_attn_item_avx512
#define FMA_FLOPS_NAME cas_measure_fma_flops_avx512
#define READ_BW_NAME cas_measure_read_bw_avx512
double cas_measure_read_bw_avx512(const float *buf, size_t n, int threads);

double cas_measure_fma_flops_avx512(int threads);

#include "attn_kern.inc"
