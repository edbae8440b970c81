/*
 * attn_ref.c: the float64 reference of the attention function in attn.h,
 * batch validation, dtype helpers and the merge of attention states.
 *
 * The reference is written to be obviously right rather than fast: for every
 * query row it walks the request's keys in order, upcasts K and V to double,
 * applies the mask exactly as the header states it and computes the softmax
 * with a max shift. Every fast path is tested against it.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "attn_impl.h"

size_t cas_dtype_size(cas_dtype t) { return t == CAS_F32 ? 4 : 2; }

const char *cas_dtype_name(cas_dtype t) {
    switch (t) {
    case CAS_F32: return "f32";
    case CAS_F16: return "f16";
    case CAS_BF16: return "bf16";
    }
    return "?";
}

int cas_dtype_parse(const char *s, cas_dtype *out) {
    if (!strcmp(s, "f32")) *out = CAS_F32;
    else if (!strcmp(s, "f16")) *out = CAS_F16;
    else if (!strcmp(s, "bf16")) *out = CAS_BF16;
    else return -1;
    return 0;
}

int cas_attn_head_dim_supported(int32_t d) { return d == 64 || d == 96 || d == 128 || d == 256; }

cas_attn_params cas_attn_params_default(void) {
    cas_attn_params p = {0.0f, 0.0f, -1, 1};
    return p;
}

float cas_attn_scale(const cas_attn_shape *shape, const cas_attn_params *params) {
    return params->sm_scale > 0.0f ? params->sm_scale : 1.0f / sqrtf((float)shape->head_dim);
}

/* ---- validation --------------------------------------------------------- */

static cas_status validate_shape(const cas_attn_shape *s) {
    if (!s) return cas_error(CAS_ERR_INVALID, "attn: shape is NULL");
    if (s->num_kv_heads <= 0 || s->num_qo_heads <= 0)
        return cas_error(CAS_ERR_INVALID, "attn: head counts must be positive (Hq=%d, Hkv=%d)",
                         s->num_qo_heads, s->num_kv_heads);
    if (s->num_qo_heads % s->num_kv_heads)
        return cas_error(CAS_ERR_INVALID,
                         "attn: num_qo_heads (%d) is not a multiple of num_kv_heads (%d)",
                         s->num_qo_heads, s->num_kv_heads);
    if (!cas_attn_head_dim_supported(s->head_dim))
        return cas_error(CAS_ERR_UNSUPPORTED, "attn: head_dim %d is not supported (64, 96, 128, 256)",
                         s->head_dim);
    if (s->page_size < 1 || s->page_size > CAS_ATTN_MAX_PAGE_SIZE)
        return cas_error(CAS_ERR_INVALID, "attn: page_size %d outside 1..%d", s->page_size,
                         CAS_ATTN_MAX_PAGE_SIZE);
    if (s->kv_dtype != CAS_F32 && s->kv_dtype != CAS_F16 && s->kv_dtype != CAS_BF16)
        return cas_error(CAS_ERR_INVALID, "attn: unknown kv dtype %d", (int)s->kv_dtype);
    return CAS_OK;
}

cas_status cas_attn_validate_head(const cas_attn_shape *shape, const cas_attn_batch *b,
                                  int32_t num_pages, const cas_attn_params *params) {
    cas_status st = validate_shape(shape);
    if (st) return st;
    if (!b || !params) return cas_error(CAS_ERR_INVALID, "attn: batch or params is NULL");
    if (b->batch < 0) return cas_error(CAS_ERR_INVALID, "attn: negative batch size %d", b->batch);
    if (num_pages < 0) return cas_error(CAS_ERR_INVALID, "attn: negative num_pages");
    if (b->batch > 0 && (!b->qo_indptr || !b->kv_indptr || !b->kv_last_page_len))
        return cas_error(CAS_ERR_INVALID, "attn: batch arrays are NULL");
    if (b->batch == 0) return CAS_OK;
    if (b->qo_indptr[0] != 0 || b->kv_indptr[0] != 0)
        return cas_error(CAS_ERR_INVALID, "attn: qo_indptr[0] and kv_indptr[0] must be 0 (got %d, %d)",
                         b->qo_indptr[0], b->kv_indptr[0]);
    if (b->kv_indptr[b->batch] > 0 && !b->kv_indices)
        return cas_error(CAS_ERR_INVALID, "attn: kv_indices is NULL");
    if (params->window_left < -1)
        return cas_error(CAS_ERR_INVALID, "attn: window_left %d (use -1 to disable)", params->window_left);
    if (!(params->logits_soft_cap >= 0.0f) || !isfinite(params->logits_soft_cap))
        return cas_error(CAS_ERR_INVALID, "attn: logits_soft_cap must be finite and >= 0");
    if (!(params->sm_scale >= 0.0f) || !isfinite(params->sm_scale))
        return cas_error(CAS_ERR_INVALID, "attn: sm_scale must be finite and >= 0 (0 = default)");
    for (int32_t r = 0; r < b->batch; r++) {
        int32_t q0 = b->qo_indptr[r], q1 = b->qo_indptr[r + 1];
        int32_t k0 = b->kv_indptr[r], k1 = b->kv_indptr[r + 1];
        if (q1 < q0)
            return cas_error(CAS_ERR_INVALID, "attn: qo_indptr not monotone at request %d (%d > %d)", r,
                             q0, q1);
        if (k1 < k0)
            return cas_error(CAS_ERR_INVALID, "attn: kv_indptr not monotone at request %d (%d > %d)", r,
                             k0, k1);
        if (k1 == k0)
            return cas_error(CAS_ERR_INVALID, "attn: request %d has no KV pages", r);
        int32_t last = b->kv_last_page_len[r];
        if (last < 1 || last > shape->page_size)
            return cas_error(CAS_ERR_INVALID,
                             "attn: kv_last_page_len[%d] = %d outside 1..page_size (%d)", r, last,
                             shape->page_size);
        int64_t kv_len = (int64_t)(k1 - k0 - 1) * shape->page_size + last;
        if (params->causal && (int64_t)(q1 - q0) > kv_len)
            return cas_error(CAS_ERR_INVALID,
                             "attn: request %d has %d queries but only %lld KV tokens (causal "
                             "queries sit at the end of their KV)",
                             r, q1 - q0, (long long)kv_len);
    }
    return CAS_OK;
}

/* (attn_impl.h) 16 at a time: loops of a fixed count, which -O2 vectorizes
 * (a long shared prefix repeated in every request is most of a plan's page
 * ids); restrict parameters, so no alias check */
uint32_t cas_attn_ids_outside(uint32_t *restrict dst, const uint32_t *restrict src, int32_t n, uint32_t np) {
    uint32_t out = 0;
    int32_t i0 = 0;
    if (dst) {
        for (; i0 + 16 <= n; i0 += 16)
            for (int j = 0; j < 16; j++) {
                out |= src[i0 + j] >= np;
                dst[i0 + j] = src[i0 + j];
            }
        for (; i0 < n; i0++) {
            out |= src[i0] >= np;
            dst[i0] = src[i0];
        }
    } else {
        for (; i0 + 16 <= n; i0 += 16)
            for (int j = 0; j < 16; j++) out |= src[i0 + j] >= np;
        for (; i0 < n; i0++) out |= src[i0] >= np;
    }
    return out;
}

cas_status cas_attn_check_pages(const cas_attn_batch *b, int32_t num_pages, int32_t *copy) {
    if (b->batch == 0) return CAS_OK;
    const int32_t n = b->kv_indptr[b->batch];
    const uint32_t out = cas_attn_ids_outside((uint32_t *)copy, (const uint32_t *)b->kv_indices, n, (uint32_t)num_pages);
    if (!out) return CAS_OK;
    for (int32_t r = 0, i = 0; i < n; i++) {
        while (b->kv_indptr[r + 1] <= i) r++;
        const int32_t p = b->kv_indices[i];
        if (p < 0 || p >= num_pages)
            return cas_error(CAS_ERR_INVALID, "attn: kv_indices[%d] = %d (request %d) outside the pool of %d pages",
                             i, p, r, num_pages);
    }
    return CAS_OK;
}

cas_status cas_attn_validate(const cas_attn_shape *shape, const cas_attn_batch *b,
                             int32_t num_pages, const cas_attn_params *params) {
    cas_status st = cas_attn_validate_head(shape, b, num_pages, params);
    return st ? st : cas_attn_check_pages(b, num_pages, NULL);
}

/* ---- reference ---------------------------------------------------------- */

static double load_elem(const void *base, cas_dtype t, size_t idx) {
    switch (t) {
    case CAS_F32: return ((const float *)base)[idx];
    case CAS_F16: return cas_f16_to_f32(((const uint16_t *)base)[idx]);
    case CAS_BF16: return cas_bf16_to_f32(((const uint16_t *)base)[idx]);
    }
    return NAN;
}

cas_status cas_attn_reference(const cas_attn_shape *shape, const cas_kv_pool *pool,
                              const cas_attn_batch *b, const cas_attn_params *params,
                              const float *q, double *o_ref, double *lse_ref) {
    cas_status st = cas_attn_validate(shape, b, pool ? pool->num_pages : 0, params);
    if (st) return st;
    const int32_t Hq = shape->num_qo_heads, Hkv = shape->num_kv_heads, D = shape->head_dim;
    const int32_t P = shape->page_size, group = Hq / Hkv;
    const double scale = cas_attn_scale(shape, params);
    const double cap = params->logits_soft_cap;

    int64_t max_kv = 0;
    for (int32_t r = 0; r < b->batch; r++) {
        int64_t len = (int64_t)(b->kv_indptr[r + 1] - b->kv_indptr[r] - 1) * P + b->kv_last_page_len[r];
        if (len > max_kv) max_kv = len;
    }
    double *s = malloc(sizeof(double) * (size_t)(max_kv ? max_kv : 1));
    double *acc = malloc(sizeof(double) * (size_t)D);
    if (!s || !acc) {
        free(s);
        free(acc);
        return cas_error(CAS_ERR_NOMEM, "attn reference: out of memory");
    }

    for (int32_t r = 0; r < b->batch; r++) {
        const int32_t *pages = b->kv_indices + b->kv_indptr[r];
        int64_t kv_len = (int64_t)(b->kv_indptr[r + 1] - b->kv_indptr[r] - 1) * P + b->kv_last_page_len[r];
        int32_t q_len = b->qo_indptr[r + 1] - b->qo_indptr[r];
        for (int32_t i = 0; i < q_len; i++) {
            int64_t t = b->qo_indptr[r] + i;
            int64_t pos = kv_len - q_len + i;
            for (int32_t h = 0; h < Hq; h++) {
                int32_t hk = h / group;
                const float *qv = q + ((size_t)t * Hq + h) * D;
                double m = -INFINITY;
                for (int64_t j = 0; j < kv_len; j++) {
                    int visible = (!params->causal || j <= pos) &&
                                  (params->window_left < 0 || j >= pos - params->window_left);
                    if (!visible) {
                        s[j] = -INFINITY;
                        continue;
                    }
                    size_t base = (((size_t)pages[j / P] * P + (size_t)(j % P)) * Hkv + hk) * D;
                    double dot = 0;
                    for (int32_t d = 0; d < D; d++) dot += (double)qv[d] * load_elem(pool->k, shape->kv_dtype, base + d);
                    double sc = dot * scale;
                    if (cap > 0) sc = cap * tanh(sc / cap);
                    s[j] = sc;
                    if (sc > m) m = sc;
                }
                for (int32_t d = 0; d < D; d++) acc[d] = 0;
                double sum = 0;
                if (m != -INFINITY) {
                    for (int64_t j = 0; j < kv_len; j++) {
                        if (s[j] == -INFINITY) continue;
                        double w = exp(s[j] - m);
                        sum += w;
                        size_t base = (((size_t)pages[j / P] * P + (size_t)(j % P)) * Hkv + hk) * D;
                        for (int32_t d = 0; d < D; d++) acc[d] += w * load_elem(pool->v, shape->kv_dtype, base + d);
                    }
                }
                size_t orow = ((size_t)t * Hq + h);
                if (o_ref)
                    for (int32_t d = 0; d < D; d++) o_ref[orow * D + d] = sum > 0 ? acc[d] / sum : 0.0;
                if (lse_ref) lse_ref[orow] = sum > 0 ? m + log(sum) : -INFINITY;
            }
        }
    }
    free(s);
    free(acc);
    return CAS_OK;
}

/* ---- merge -------------------------------------------------------------- */

/* Weights of two states in their merge, with the empty state (-inf) handled
 * so that no NaN appears: if both are empty the result is empty. */
static inline void merge_weights(float la, float lb, float *wa, float *wb, float *lse) {
    if (la == -INFINITY && lb == -INFINITY) {
        *wa = 0.0f;
        *wb = 0.0f;
        *lse = -INFINITY;
        return;
    }
    float m = la > lb ? la : lb;
    float ea = expf(la - m), eb = expf(lb - m); /* exp(-inf) = 0 */
    float s = ea + eb;
    *wa = ea / s;
    *wb = eb / s;
    *lse = m + logf(s);
}

void cas_attn_merge2(float *o_out, float *lse_out, const float *o_a, const float *lse_a,
                     const float *o_b, const float *lse_b, int64_t rows, int32_t D) {
    for (int64_t r = 0; r < rows; r++) {
        float wa, wb, l;
        merge_weights(lse_a[r], lse_b[r], &wa, &wb, &l);
        const float *a = o_a + r * D, *bb = o_b + r * D;
        float *o = o_out + r * D;
        if (l == -INFINITY) {
            for (int32_t d = 0; d < D; d++) o[d] = 0.0f;
        } else {
            for (int32_t d = 0; d < D; d++) {
                /* an empty side contributes exactly nothing, whatever its o holds */
                float va = wa != 0.0f ? wa * a[d] : 0.0f;
                float vb = wb != 0.0f ? wb * bb[d] : 0.0f;
                o[d] = va + vb;
            }
        }
        lse_out[r] = l;
    }
}

void cas_attn_merge_inplace(float *o_a, float *lse_a, const float *o_b, const float *lse_b,
                            int64_t rows, int32_t D) {
    cas_attn_merge2(o_a, lse_a, o_a, lse_a, o_b, lse_b, rows, D);
}

void cas_attn_merge_n(float *o_out, float *lse_out, const float *const *o_in,
                      const float *const *lse_in, int n, int64_t rows, int32_t D) {
    for (int64_t r = 0; r < rows; r++) {
        float m = -INFINITY;
        for (int i = 0; i < n; i++)
            if (lse_in[i][r] > m) m = lse_in[i][r];
        float *o = o_out + r * D;
        for (int32_t d = 0; d < D; d++) o[d] = 0.0f;
        if (m == -INFINITY) {
            lse_out[r] = -INFINITY;
            continue;
        }
        float s = 0.0f;
        for (int i = 0; i < n; i++) {
            float l = lse_in[i][r];
            if (l == -INFINITY) continue;
            float w = expf(l - m);
            s += w;
            const float *oi = o_in[i] + r * D;
            for (int32_t d = 0; d < D; d++) o[d] += w * oi[d];
        }
        float inv = 1.0f / s;
        for (int32_t d = 0; d < D; d++) o[d] *= inv;
        lse_out[r] = m + logf(s);
    }
}

int cas_attn_check_rows(const float *o, const float *lse, const double *o_ref, const double *lse_ref,
                        int64_t rows, int32_t D, double tol_rel, double tol_lse, cas_attn_check *out) {
    cas_attn_check c = {rows, 0, -1, 0.0, 0.0};
    for (int64_t r = 0; r < rows; r++) {
        const float *x = o + r * D;
        const double *y = o_ref + r * D;
        double num = 0, den = 0;
        int finite = 1;
        for (int32_t d = 0; d < D; d++) {
            const double e = (double)x[d] - y[d];
            finite &= isfinite(x[d]) != 0;
            num += e * e;
            den += y[d] * y[d];
        }
        const int empty = lse_ref ? isinf(lse_ref[r]) && lse_ref[r] < 0 : den == 0;
        double rel = !finite ? INFINITY : empty ? (num > 0 ? INFINITY : 0) : sqrt(num / den);
        double el = 0;
        if (lse && lse_ref) {
            if (empty) el = isinf(lse[r]) && lse[r] < 0 ? 0 : INFINITY;
            else el = isfinite(lse[r]) ? fabs((double)lse[r] - lse_ref[r]) : INFINITY;
        }
        if (!(rel <= c.max_rel)) {
            c.max_rel = rel;
            c.worst_row = r;
        }
        if (!(el <= c.max_lse)) c.max_lse = el;
        c.bad_rows += !(rel <= tol_rel && el <= tol_lse);
    }
    if (out) *out = c;
    return c.bad_rows == 0;
}
