/*
 * core_math.c: elementwise tanh and GELU over float arrays with the same
 * bits on every path (core.h, "elementwise math"). Gemma's soft caps (the
 * attention scores', the final logits') and its GeGLU call them per element,
 * so they are vectorized (core_math_avx2.c, core_math_avx512.c); and since a
 * token's results must not depend on its batch, on the thread count or on the
 * kernel that ran, every version computes one function: the same IEEE
 * operations in the same order, lane for lane, with every multiply-add an
 * explicit fused one (the build's -ffp-contract=fast cannot fuse what is
 * already fused, and nothing here leaves a multiply feeding an add). The
 * scalar twins below are that function one value at a time: the portable
 * path, and the tail of every vector loop. tests/test_core.c checks the bits
 * of every level against them and their error against float64.
 *
 * exp: 2^n p(r), n = rint(x log2 e), r = x - n ln 2 in two steps, p the
 * degree-6 Taylor polynomial (relative error ~2e-7), x clamped to [-87, 88].
 * tanh |x| < 0.625: Cephes' odd minimax polynomial; above: (1 - t) / (1 + t)
 * with t = exp(-2|x|) (no cancellation there, t <= 0.29); the sign put back
 * last, so tanh(-0) = -0, tanh(+-inf) = +-1 and NaN stays NaN.
 * GELU: x / (1 + exp(-2z)), z = sqrt(2/pi) x (1 + 0.044715 x^2), which is
 * 0.5 x (1 + tanh z) without its cancellation for negative x.
 */
#include <math.h>
#include <string.h>

#include "core.h"
#include "core_math_impl.h"

/* p(r) and 2^n of exp(x), x already clamped: exp(x) = p * s */
static inline void exp_parts(float x, float *p, float *s) {
    float n = rintf(x * CAS_M_LOG2E);
    float r = fmaf(-n, CAS_M_LN2_HI, x);
    r = fmaf(-n, CAS_M_LN2_LO, r);
    float pl = 1.0f / 720;
    pl = fmaf(pl, r, 1.0f / 120);
    pl = fmaf(pl, r, 1.0f / 24);
    pl = fmaf(pl, r, 1.0f / 6);
    pl = fmaf(pl, r, 0.5f);
    pl = fmaf(pl, r, 1.0f);
    pl = fmaf(pl, r, 1.0f);
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    memcpy(s, &bits, sizeof *s);
    *p = pl;
}

float cas_tanhf(float x) {
    uint32_t xb, sb;
    memcpy(&xb, &x, sizeof xb);
    sb = xb & 0x80000000u;
    float ax = fabsf(x), r;
    if (ax >= CAS_M_TANH_SMALL) {
        float a = fmaxf(-2.0f * ax, CAS_M_EXP_LO), p, s;
        exp_parts(a, &p, &s);
        r = fmaf(-p, s, 1.0f) / fmaf(p, s, 1.0f);
    } else { /* NaN too */
        float z = ax * ax;
        float pl = fmaf(CAS_M_TP0, z, CAS_M_TP1);
        pl = fmaf(pl, z, CAS_M_TP2);
        pl = fmaf(pl, z, CAS_M_TP3);
        pl = fmaf(pl, z, CAS_M_TP4);
        r = fmaf(pl * z, ax, ax);
    }
    uint32_t rb;
    memcpy(&rb, &r, sizeof rb);
    rb |= sb;
    memcpy(&r, &rb, sizeof r);
    return r;
}

float cas_geluf(float x) {
    float a = x * fmaf(CAS_M_G3, x * x, CAS_M_G1);
    /* fminf/fmaxf as minps/maxps order them: a NaN argument gives the bound */
    a = fmaxf(fminf(a, CAS_M_EXP_HI), CAS_M_EXP_LO);
    float p, s;
    exp_parts(a, &p, &s);
    return x / fmaf(p, s, 1.0f);
}

static void tanh_scaled_generic(float *x, int64_t n, float in, float out) {
    for (int64_t i = 0; i < n; i++) x[i] = out * cas_tanhf(in * x[i]);
}

static void gelu_mul_generic(const float *g, const float *u, float *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] = cas_geluf(g[i]) * u[i];
}

void cas_tanh_scaled_at(cas_simd_level lvl, float *x, int64_t n, float in, float out) {
    const cas_simd_level have = cas_cpu_features_get()->simd;
    if (lvl == CAS_SIMD_AUTO || lvl > have) lvl = have;
    int64_t i = 0;
    if (lvl == CAS_SIMD_AVX512) i = cas_m_avx512_tanh_scaled(x, n, in, out);
    else if (lvl == CAS_SIMD_AVX2) i = cas_m_avx2_tanh_scaled(x, n, in, out);
    tanh_scaled_generic(x + i, n - i, in, out);
}

void cas_gelu_mul_at(cas_simd_level lvl, const float *g, const float *u, float *h, int64_t n) {
    const cas_simd_level have = cas_cpu_features_get()->simd;
    if (lvl == CAS_SIMD_AUTO || lvl > have) lvl = have;
    int64_t i = 0;
    if (lvl == CAS_SIMD_AVX512) i = cas_m_avx512_gelu_mul(g, u, h, n);
    else if (lvl == CAS_SIMD_AVX2) i = cas_m_avx2_gelu_mul(g, u, h, n);
    gelu_mul_generic(g + i, u + i, h + i, n - i);
}

void cas_tanh_scaled(float *x, int64_t n, float in, float out) {
    cas_tanh_scaled_at(CAS_SIMD_AUTO, x, n, in, out);
}

void cas_gelu_mul(const float *g, const float *u, float *h, int64_t n) {
    cas_gelu_mul_at(CAS_SIMD_AUTO, g, u, h, n);
}
