/*
 * attn_calib.c: measures the cost model's machine numbers (attn.h,
 * cas_attn_cost) by timing the real kernel on synthetic batches: a flat
 * decode over KV far larger than the caches (memory rate), the same over KV
 * that stays in cache (packing rate), a shared pass with many rows (FLOP
 * rate), and a tiny shared pass against none (the fixed cost of a pass).
 */
#include <math.h>
#include <string.h>

#include "attn.h"

/* Median seconds of a plan run over a synthetic batch. */
static cas_status time_case(const cas_attn_shape *shape, int32_t threads, cas_cascade_mode mode,
                            const char *tree, int32_t suffix, int reps, double *secs, double *kv_bytes,
                            double *flops) {
    cas_attn_synth s;
    cas_status st = cas_attn_synth_create(&s, shape, tree, 0, 0, suffix, 1, 42);
    if (st) return st;
    cas_attn_plan_opts opts = cas_attn_plan_opts_default();
    opts.cascade = mode;
    opts.threads = threads;
    cas_attn_plan *plan = NULL;
    float *o = cas_alloc_array((size_t)s.total_q * shape->num_qo_heads * shape->head_dim, 4);
    cas_attn_batch b = cas_attn_synth_batch(&s);
    cas_kv_pool pool = cas_attn_synth_pool(&s);
    cas_attn_params prm = cas_attn_params_default();
    st = o ? cas_attn_plan_create(&plan, shape, &opts, 0, 0, 0) : cas_error(CAS_ERR_NOMEM, "calibrate: out of memory");
    if (!st) st = cas_attn_plan_build(plan, &b, s.num_pages, &prm);
    double best[32];
    int n = reps < 32 ? reps : 32;
    for (int i = 0; i < 2 && !st; i++) st = cas_attn_plan_run(plan, &pool, s.q, o, NULL);
    for (int i = 0; i < n && !st; i++) {
        double t0 = cas_now_s();
        st = cas_attn_plan_run(plan, &pool, s.q, o, NULL);
        best[i] = cas_now_s() - t0;
    }
    if (!st) {
        /* median */
        for (int i = 1; i < n; i++)
            for (int j = i; j > 0 && best[j - 1] > best[j]; j--) {
                double t = best[j];
                best[j] = best[j - 1];
                best[j - 1] = t;
            }
        *secs = best[n / 2];
        cas_attn_plan_info info;
        cas_attn_plan_get_info(plan, &info);
        *kv_bytes = (double)info.kv_tokens_read * 2.0 * shape->num_kv_heads * shape->head_dim *
                    (double)cas_dtype_size(shape->kv_dtype);
        *flops = 4.0 * shape->head_dim * shape->num_qo_heads * (double)s.flat_kv_tokens;
    }
    cas_attn_plan_destroy(plan);
    cas_free(o);
    cas_attn_synth_destroy(&s);
    return st;
}

cas_status cas_attn_calibrate(const cas_attn_shape *shape, int32_t threads, cas_attn_cost *out) {
    cas_attn_cost c = cas_attn_cost_default();
    double t, bytes, flops;
    char tree[64];
    int32_t nt = threads > 0 ? threads : 2;
    double tok_bytes = 2.0 * shape->num_kv_heads * shape->head_dim * (double)cas_dtype_size(shape->kv_dtype);
    /* memory: about 256 MiB of KV, nothing shared */
    int32_t per = (int32_t)((256.0 * 1024 * 1024) / tok_bytes / (4 * nt));
    if (per < 256) per = 256;
    snprintf(tree, sizeof tree, "%d*0", 4 * nt);
    cas_status st = time_case(shape, threads, CAS_CASCADE_OFF, tree, per, 5, &t, &bytes, &flops);
    if (st) return st;
    c.bytes_per_s = bytes / t;
    /* packing: KV that stays in cache (about 256 KiB per thread), many runs */
    per = (int32_t)((256.0 * 1024) / tok_bytes);
    if (per < 64) per = 64;
    snprintf(tree, sizeof tree, "%d*0", 4 * nt);
    double t_pack, pack_bytes;
    st = time_case(shape, threads, CAS_CASCADE_OFF, tree, per, 21, &t_pack, &pack_bytes, &flops);
    if (st) return st;
    double fl_small = flops;
    /* FLOPs: 64 requests' rows against one shared run */
    st = time_case(shape, threads, CAS_CASCADE_ALL, "64*2048", 16, 5, &t, &bytes, &flops);
    if (st) return st;
    c.flops_per_s = flops / t;
    /* the packing rate is what remains of the cached flat run once its FLOPs are paid */
    double rest = t_pack - fl_small / c.flops_per_s;
    c.pack_bytes_per_s = rest > 0 ? pack_bytes / rest : pack_bytes / t_pack * 4;
    /* pass overhead: 8 requests sharing one page, shared pass against none */
    double t_off, t_all;
    snprintf(tree, sizeof tree, "8*%d", shape->page_size);
    st = time_case(shape, threads, CAS_CASCADE_OFF, tree, 32, 41, &t_off, &bytes, &flops);
    if (!st) st = time_case(shape, threads, CAS_CASCADE_ALL, tree, 32, 41, &t_all, &bytes, &flops);
    if (st) return st;
    double pb = shape->page_size * tok_bytes;
    /* the shared pass saved 7 packings of one page and paid the overhead */
    double ov = t_all - t_off + 7 * pb / c.pack_bytes_per_s;
    c.pass_overhead_s = ov > 1e-7 ? ov : 1e-7;
    *out = c;
    return CAS_OK;
}
