/*
 * core_math_impl.h: the per-instruction-set versions of core_math.c's
 * elementwise functions (core_math_avx2.c, core_math_avx512.c). Internal to
 * src/core. Each processes whole vectors only and returns how many elements
 * it did; the caller finishes the rest with the scalar twins, which give the
 * same bits (core_math.c says how).
 */
#ifndef CAS_CORE_MATH_IMPL_H
#define CAS_CORE_MATH_IMPL_H

#include <stdint.h>

/* The constants every version shares, so that they compute one function. */
#define CAS_M_EXP_LO -87.0f             /* exp arguments are clamped to [LO, HI] */
#define CAS_M_EXP_HI 88.0f
#define CAS_M_LOG2E 1.44269504088896341f
#define CAS_M_LN2_HI 0.693359375f       /* ln 2 = HI + LO, HI with few bits */
#define CAS_M_LN2_LO -2.12194440e-4f
#define CAS_M_TANH_SMALL 0.625f         /* |x| below: the odd polynomial */
/* Cephes tanhf's minimax polynomial on [0, 0.625]: tanh x = x + x^3 P(x^2) */
#define CAS_M_TP0 -5.70498872745e-3f
#define CAS_M_TP1 2.06390887954e-2f
#define CAS_M_TP2 -5.37397155531e-2f
#define CAS_M_TP3 1.33314422036e-1f
#define CAS_M_TP4 -3.33332819422e-1f
/* GELU (tanh form): x / (1 + exp(x (G1 + G3 x^2))), G1 = -2 sqrt(2/pi), G3 = 0.044715 G1 */
#define CAS_M_G1 -1.59576912160573071176f
#define CAS_M_G3 -0.07135481627260025f

int64_t cas_m_avx2_tanh_scaled(float *x, int64_t n, float in, float out);
int64_t cas_m_avx2_gelu_mul(const float *g, const float *u, float *h, int64_t n);
int64_t cas_m_avx512_tanh_scaled(float *x, int64_t n, float in, float out);
int64_t cas_m_avx512_gelu_mul(const float *g, const float *u, float *h, int64_t n);

#endif
