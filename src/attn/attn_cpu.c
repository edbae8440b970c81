/*
 * attn_cpu.c: the portable CPU work-item kernel, the workspace layout shared
 * with the SIMD kernels (attn_kern.inc), and the machine measurements the
 * benchmarks report as ceilings (read bandwidth, f32 FMA rate).
 *
 * The portable kernel is the fallback for CPUs without AVX2 and the second
 * opinion in tests: one query row at a time, online softmax over the keys of
 * its item. Its output is the same function as the SIMD kernels'.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "attn_impl.h"

int64_t cas_attn_work_floats(int32_t head_dim) {
    const int64_t R = CAS_ATTN_ROW_BLOCK + 4, T = CAS_ATTN_TILE;
    /* Q, O: [R][D]; M, L, pos: [R] (+4 to align); Kt: [D][T]; V: [T][D]; S/P: [R][T]; + slack.
     * R * 3 + 4 is a multiple of 16, so every region starts 64-byte aligned. */
    return 2 * R * head_dim + 3 * R + 4 + 2 * (int64_t)head_dim * T + R * T + 16 * 8;
}

static inline float load_kv(const void *base, cas_dtype t, size_t idx) {
    switch (t) {
    case CAS_F32: return ((const float *)base)[idx];
    case CAS_F16: return cas_f16_to_f32(((const uint16_t *)base)[idx]);
    case CAS_BF16: return cas_bf16_to_f32(((const uint16_t *)base)[idx]);
    }
    return 0.0f;
}

void cas_attn_item_generic(const cas_attn_plan *p, const cas_attn_item *it, const cas_kv_pool *pool,
                           const float *q, float *o, float *lse, float *work) {
    const cas_attn_job *job = &p->jobs[it->job];
    const cas_attn_pass *ps = &p->passes[job->pass];
    const int32_t Hq = p->shape.num_qo_heads, Hkv = p->shape.num_kv_heads, D = p->shape.head_dim;
    const int32_t G = Hq / Hkv, P = p->shape.page_size;
    const int causal = p->params.causal, W = p->params.window_left;
    const float cap = p->params.logits_soft_cap, scale = p->scale;
    const int32_t *pages = p->pages + ps->page_off;
    float *acc = work;
    for (int32_t hk = it->kv_head0; hk < it->kv_head1; hk++)
    for (int32_t row = it->row0; row < it->row1; row++) {
        int32_t ti = row / G, g = row % G, h = hk * G + g;
        int32_t tok = p->tok_ids[ps->tok_off + ti];
        int64_t pos = p->tok_pos[ps->tok_off + ti];
        const float *qr = q + ((size_t)tok * Hq + h) * D;
        float m = -INFINITY, l = 0.0f;
        for (int32_t d = 0; d < D; d++) acc[d] = 0.0f;
        for (int32_t k = it->kv0; k < it->kv1; k++) {
            int64_t kp = (int64_t)ps->pos0 + k;
            if (causal && kp > pos) continue;
            if (W >= 0 && kp < pos - W) continue;
            size_t base = (((size_t)pages[k / P] * P + (size_t)(k % P)) * Hkv + hk) * D;
            float s = 0.0f;
            for (int32_t d = 0; d < D; d++) s += qr[d] * load_kv(pool->k, p->shape.kv_dtype, base + d);
            s *= scale;
            if (cap > 0.0f) s = cap * tanhf(s / cap);
            float mn = s > m ? s : m;
            float alpha = expf(m - mn), w = expf(s - mn);
            l = l * alpha + w;
            for (int32_t d = 0; d < D; d++)
                acc[d] = acc[d] * alpha + w * load_kv(pool->v, p->shape.kv_dtype, base + d);
            m = mn;
        }
        float *orow;
        float *lrow;
        if (job->direct) {
            orow = o + ((size_t)tok * Hq + h) * D;
            lrow = lse ? lse + (size_t)tok * Hq + h : NULL;
        } else {
            orow = p->scratch + job->o_off + ((int64_t)ti * Hq + h) * D;
            lrow = p->scratch + job->lse_off + (int64_t)ti * Hq + h;
        }
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int32_t d = 0; d < D; d++) orow[d] = acc[d] * inv;
        if (lrow) *lrow = l > 0.0f ? m + logf(l) : -INFINITY;
    }
}

/* ---- machine measurements ------------------------------------------------ */

double cas_measure_read_bw_avx2(const float *buf, size_t n, int threads);
double cas_measure_read_bw_avx512(const float *buf, size_t n, int threads);

double cas_measure_read_bandwidth(size_t bytes, int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
    size_t n = bytes / sizeof(float);
    float *buf = cas_alloc_array(n, sizeof(float));
    if (!buf) return 0.0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 1023) * 0.5f;
    double best = 0.0;
    const char *simd = cas_attn_simd_name();
    if (!strcmp(simd, "avx512")) best = cas_measure_read_bw_avx512(buf, n, threads);
    else if (!strcmp(simd, "avx2")) best = cas_measure_read_bw_avx2(buf, n, threads);
    else {
        volatile float sink = 0.0f;
        for (int rep = 0; rep < 5; rep++) {
            double t0 = cas_now_s();
            float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
            {
                float s[16] = {0};
#pragma omp for schedule(static)
                for (size_t i = 0; i < n / 16; i++)
                    for (int k = 0; k < 16; k++) s[k] += buf[i * 16 + k];
                for (int k = 0; k < 16; k++) total += s[k];
            }
            double dt = cas_now_s() - t0;
            sink += total;
            double bw = (double)(n / 16 * 16) * sizeof(float) / dt;
            if (bw > best) best = bw;
        }
        (void)sink;
    }
    cas_free(buf);
    return best;
}

/* The FMA loops are in the SIMD files; this portable one is the fallback. */
double cas_measure_fma_flops_generic(int threads);
double cas_measure_fma_flops_avx2(int threads);
double cas_measure_fma_flops_avx512(int threads);

double cas_measure_fma_flops_generic(int threads) {
    const long iters = 20000000;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = cas_now_s();
        float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            float a[8] = {1.0f, 1.01f, 1.02f, 1.03f, 1.04f, 1.05f, 1.06f, 1.07f}; /* distinct: no merged chains */
            volatile float mv = 0.9999999f, cv = 1e-7f; /* opaque: no folding at compile time */
            const float m = mv, c = cv;
            for (long i = 0; i < iters; i++)
                for (int k = 0; k < 8; k++) a[k] = a[k] * m + c;
            for (int k = 0; k < 8; k++) total += a[k];
        }
        double dt = cas_now_s() - t0;
        double f = 2.0 * 8 * iters * threads / dt;
        if (total == 12345.0f) f += 1; /* keep the loop alive */
        if (f > best) best = f;
    }
    return best;
}

double cas_measure_fma_flops(int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
    const char *s = cas_attn_simd_name();
    if (!strcmp(s, "avx512")) return cas_measure_fma_flops_avx512(threads);
    if (!strcmp(s, "avx2")) return cas_measure_fma_flops_avx2(threads);
    return cas_measure_fma_flops_generic(threads);
}
