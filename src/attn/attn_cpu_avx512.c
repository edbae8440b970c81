/*
 * attn_cpu_avx512.c: the blocked attention kernel (attn_kern.inc) with
 * 16-wide AVX-512 vectors (tile packing stays 8-wide: AVX-512 implies AVX2).
 * Compiled with AVX-512 flags; attn_cpu.c picks it only when the CPU has
 * AVX-512 F/BW/VL/DQ.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attn_impl.h"

#include "attn_vec512.h"

#define KERNEL_NAME cas_attn_item_avx512

#include "attn_kern.inc"
