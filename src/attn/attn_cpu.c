/*
 * attn_cpu.c: running a plan on the CPU. The choice of work-item kernel
 * (made once, when a plan is created, from its options and the CPU features
 * that src/core detects), the workspace layout shared with the SIMD kernels
 * (attn_kern.inc), the portable kernel, and the run itself: every work item
 * in parallel, then the per-token merge of their states.
 *
 * The planner (attn_plan.c) calls into this file; nothing here calls the
 * planner, and the SIMD kernels read only the plan they are given.
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
        const float *init = cas_attn_init_state(p, ps, ti);
        for (int32_t d = 0; d < D; d++) acc[d] = init ? init[(size_t)h * D + d] : 0.0f;
        if (init) m = init[(size_t)Hq * D + h], l = init[(size_t)Hq * D + Hq + h];
        for (int32_t k = it->kv0; k < it->kv1; k++) {
            int64_t kp = (int64_t)ps->pos0 + k;
            if (causal && kp > pos) continue;
            if (W >= 0 && kp < pos - W) continue;
            size_t base = (((size_t)pages[k / P] * P + (size_t)(k % P)) * Hkv + hk) * D;
            float s = 0.0f;
            for (int32_t d = 0; d < D; d++) s += qr[d] * load_kv(pool->k, p->shape.kv_dtype, base + d);
            s *= scale;
            if (cap > 0.0f) s = cap * cas_tanhf(s * (1.0f / cap)); /* the SIMD kernels' bits */
            float mn = s > m ? s : m;
            float alpha = expf(m - mn), w = expf(s - mn);
            l = l * alpha + w;
            for (int32_t d = 0; d < D; d++)
                acc[d] = acc[d] * alpha + w * load_kv(pool->v, p->shape.kv_dtype, base + d);
            m = mn;
        }
        float *orow;
        float *lrow;
        float *carry = cas_attn_carry_state(p, ps, ti);
        if (carry) { /* the running state, for the token's next pass */
            for (int32_t d = 0; d < D; d++) carry[(size_t)h * D + d] = acc[d];
            carry[(size_t)Hq * D + h] = m;
            carry[(size_t)Hq * D + Hq + h] = l;
            continue;
        }
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

/* ---- kernel choice -------------------------------------------------------- */

const char *cas_attn_simd_name(void) { return cas_simd_name(cas_cpu_features_get()->simd); }

int cas_attn_bf16_dot_available(void) {
    const cas_cpu_features *f = cas_cpu_features_get();
    return f->simd == CAS_SIMD_AVX512 && f->avx512_bf16;
}

int cas_attn_amx_bf16_available(void) {
    return cas_cpu_features_get()->amx_bf16 && cas_cpu_amx_ready();
}

cas_status cas_attn_cpu_select(cas_attn_plan *p) {
    cas_simd_level lvl;
    cas_status st = cas_simd_resolve(p->opts.simd, "attn plan", &lvl);
    if (st) return st;
    p->simd = lvl;
    p->amx_bf16 = 0;
    p->decode_rows = 8;
    p->stile_rows = 32;
    if (p->opts.bf16_dot && p->shape.kv_dtype == CAS_BF16 && lvl == CAS_SIMD_AVX512 &&
        cas_cpu_features_get()->avx512_bf16) {
        p->kernel = cas_attn_item_avx512bf16;
        p->amx_bf16 = !p->opts.amx_off && cas_attn_amx_bf16_available();
    } else if (lvl == CAS_SIMD_AVX512) {
        p->kernel = cas_attn_item_avx512;
    } else if (lvl == CAS_SIMD_AVX2) {
        p->kernel = cas_attn_item_avx2;
    } else {
        p->kernel = cas_attn_item_generic;
    }
    return CAS_OK;
}

/* ---- run ------------------------------------------------------------------ */

static void merge_token(const cas_attn_plan *p, int32_t t, float *o, float *lse) {
    const int32_t Hq = p->shape.num_qo_heads, D = p->shape.head_dim;
    const int32_t c0 = p->contrib_indptr[t], c1 = p->contrib_indptr[t + 1];
    const float *S = p->scratch;
    for (int32_t h = 0; h < Hq; h++) {
        float m = -INFINITY;
        for (int32_t c = c0; c < c1; c++) {
            float l = S[p->contrib_lse[c] + h];
            if (l > m) m = l;
        }
        float *out = o + ((size_t)t * Hq + h) * D;
        for (int32_t d = 0; d < D; d++) out[d] = 0.0f;
        if (m == -INFINITY) {
            if (lse) lse[(size_t)t * Hq + h] = -INFINITY;
            continue;
        }
        float sum = 0.0f;
        for (int32_t c = c0; c < c1; c++) {
            float l = S[p->contrib_lse[c] + h];
            if (l == -INFINITY) continue;
            float w = expf(l - m);
            sum += w;
            const float *src = S + p->contrib_o[c] + (int64_t)h * D;
            for (int32_t d = 0; d < D; d++) out[d] += w * src[d];
        }
        float inv = 1.0f / sum;
        for (int32_t d = 0; d < D; d++) out[d] *= inv;
        if (lse) lse[(size_t)t * Hq + h] = m + logf(sum);
    }
}

cas_status cas_attn_plan_run(cas_attn_plan *p, const cas_kv_pool *pool, const float *q, float *o,
                             float *lse) {
    if (!p || !pool || (!q && p->total_q) || (!o && p->total_q))
        return cas_error(CAS_ERR_INVALID, "attn run: NULL argument");
    if (pool->num_pages != p->num_pages)
        return cas_error(CAS_ERR_INVALID, "attn run: pool has %d pages, plan was built for %d",
                         pool->num_pages, p->num_pages);
    if (p->n_items && (!pool->k || !pool->v)) return cas_error(CAS_ERR_INVALID, "attn run: NULL K or V pool");
    const cas_attn_item_fn fn = p->kernel;
    const int32_t total_q = p->total_q;
    const int need_merge = p->n_contrib > 0;
#pragma omp parallel num_threads(p->threads)
    {
        float *work = p->work + (size_t)omp_get_thread_num() * (size_t)p->work_floats;
        /* levels one after another (batch-invariant plans: a token's later
         * passes start from the states its earlier ones leave) */
        for (int32_t k = 0; k < p->n_levels; k++) {
#pragma omp for schedule(dynamic, 1)
            for (int32_t i = p->level_start[k]; i < p->level_start[k + 1]; i++) fn(p, &p->items[i], pool, q, o, lse, work);
        }
        if (need_merge) {
#pragma omp for schedule(static)
            for (int32_t t = 0; t < total_q; t++)
                if (!p->direct_tok[t]) merge_token(p, t, o, lse);
        }
    }
    return CAS_OK;
}
