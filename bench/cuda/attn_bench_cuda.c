/*
 * attn_bench_cuda.c: benchmark of the CUDA attention backend, flat vs
 * cascade, on batches of B requests that share a prefix of P tokens and own U
 * tokens each (decode: qlen queries per request), the shapes of the anchors in
 * ../shared/anchors (FlashInfer and PyTorch on an H200): the grid of issue 5
 * in one process. `cascade attn-bench --backend cuda` measures one case of
 * any sharing tree with the same helpers (src/cuda/cuda_bench.c).
 *
 * Timing: CUDA events around one run (the three launches of
 * cas_cuda_attn_run, replayed from a CUDA graph, and also eager), after
 * warm-up, median of --iters; the same method as the anchors' scripts
 * (no L2 flush, same pool). The ceiling is a device-to-device copy measured
 * in the same process (bytes read + written), and the roofline's matrix
 * rate is a cuBLAS bf16 product measured there too (src/cuda/cuda_bench.c,
 * shared with `cascade attn-bench --backend cuda`). Errors are max |o - ref|
 * against the float64 reference for the last request of the batch (the
 * reference of a whole batch of 256 x 32k would take minutes).
 *
 *   attn_bench_cuda [--batch B] [--prefix P] [--suffix U] [--qlen Q]
 *                   [--heads HQ:HKV] [--head-dim D] [--page-size S]
 *                   [--dtype bf16|f16] [--iters N] [--grid] [--unshared]
 *                   [--prefill L] [--shuffle-pages] [--cases "P,B,U;P,B,U..."]
 *                   [--json FILE]
 *
 * --cases runs those cases of the grid (or any) in one process, like --grid.
 * CASCADE_BENCH_AB="kind[:ENV=VAL,...];..." times each cascade also with
 * those variants (see run_case).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/cuda/cuda_attn.h"

#ifndef CAS_HAVE_CPU_PLANNER
#define CAS_HAVE_CPU_PLANNER 0
#endif

#define CU(call)                                                                            \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) {                                                            \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)
#define CS(call)                                                                            \
    do {                                                                                    \
        cas_status s_ = (call);                                                             \
        if (s_ != CAS_OK) {                                                                 \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cas_last_error()); \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

typedef struct {
    int Hq, Hkv, D, page;
    cas_dtype dt;
    int iters, warm;
    int shuffle; /* --shuffle-pages: page ids scattered over the pool instead of in runs */
} opts_t;

/* one pool for all cases, filled once (host copy kept for the reference) */
static uint16_t *hk, *hv;
static void *dk, *dv;
static int64_t pool_pages;

/* max |o - ref| over request r's rows */
static double check_request(const opts_t *o, const cas_attn_batch *b, int r, const cas_attn_params *pr,
                            const float *qf, const float *O) {
    cas_attn_shape sh = {o->Hq, o->Hkv, o->D, o->page, o->dt};
    int32_t q0 = b->qo_indptr[r], ql = b->qo_indptr[r + 1] - q0;
    int32_t qo[2] = {0, ql}, kvp[2] = {0, b->kv_indptr[r + 1] - b->kv_indptr[r]};
    cas_attn_batch sb = {1, qo, kvp, b->kv_indices + b->kv_indptr[r], b->kv_last_page_len + r};
    cas_kv_pool kp = {hk, hv, (int32_t)pool_pages};
    size_t n = (size_t)ql * o->Hq * o->D;
    double *ref = malloc(n * sizeof(double));
    CS(cas_attn_reference(&sh, &kp, &sb, pr, qf + (size_t)q0 * o->Hq * o->D, ref, NULL));
    double e = 0;
    const float *Or = O + (size_t)q0 * o->Hq * o->D;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)Or[i] - ref[i]);
        if (!(d <= e)) e = isfinite(d) ? d : INFINITY;
    }
    free(ref);
    return e;
}

typedef struct {
    int B, P, U, Q;
    double flat_ms, cascade_ms, planned_ms, flat_eager_ms, cascade_eager_ms;
    double cascade_mid_ms; /* same cascade with the shared pass on the 64-row mma.sync kernel, or NaN */
    double cascade_ab_ms;  /* same cascade with the first variant of CASCADE_BENCH_AB, or NaN */
    int n_ab;              /* variants of CASCADE_BENCH_AB timed (ab_ms, ab_err) */
    double shared_only_ms, tails_only_ms; /* CASCADE_BENCH_PARTS=1: the cascade's shared
                                             pass alone, its decode tails alone (NaN: not run) */
    double ab_ms[8], ab_err[8];
    double err_flat, err_cascade, err_planned;
    double flat_GBps, cascade_GBps, roofline_ms;
    int planned_shared;
    int fused_tail, fused_narrow; /* kind 11: the cascade's fused tasks by who ran them (-1: none) */
} result_t;

static void run_case(const opts_t *o, int B, int P, int U, int Q, double peak, double tflops,
                     result_t *res) {
    const int ps = o->page, pp = P / ps, up = (U + ps - 1) / ps;
    const int lastlen = U - (up - 1) * ps;
    const int total_q = B * Q;
    const cas_attn_shape sh = {o->Hq, o->Hkv, o->D, ps, o->dt};
    res->fused_tail = res->fused_narrow = -1;
    if ((int64_t)pp + (int64_t)B * up > pool_pages) {
        fprintf(stderr, "pool too small\n");
        exit(1);
    }
    int32_t *qo = malloc(sizeof(int32_t) * (size_t)(B + 1)), *kvp = malloc(sizeof(int32_t) * (size_t)(B + 1));
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)B * (pp + up)), *last = malloc(sizeof(int32_t) * (size_t)B);
    qo[0] = kvp[0] = 0;
    for (int r = 0; r < B; r++) {
        qo[r + 1] = qo[r] + Q;
        kvp[r + 1] = kvp[r] + pp + up;
        last[r] = lastlen;
        for (int j = 0; j < pp; j++) idx[kvp[r] + j] = j;
        for (int j = 0; j < up; j++) idx[kvp[r] + pp + j] = pp + r * up + j;
    }
    if (o->shuffle) { /* x -> x A mod pages, A prime to the pool size: no two ids in a row */
        int64_t A = 1000003;
        while (pool_pages % A == 0) A += 2;
        for (int64_t i = 0; i < (int64_t)kvp[B]; i++) idx[i] = (int32_t)((int64_t)idx[i] * A % pool_pages);
    }
    cas_attn_batch b = {B, qo, kvp, idx, last};
    cas_attn_params pr = cas_attn_params_default(); /* causal */
    /* q, rounded; outputs */
    size_t nq = (size_t)total_q * o->Hq * o->D;
    uint16_t *q16 = malloc(nq * 2);
    float *qf = malloc(nq * 4), *Oh = malloc(nq * 4);
    cas_rng rng;
    cas_rng_seed(&rng, (uint64_t)(B * 131 + P * 7 + U));
    for (size_t i = 0; i < nq; i++) {
        float x = (float)cas_rng_normal(&rng);
        q16[i] = o->dt == CAS_BF16 ? cas_f32_to_bf16(x) : cas_f32_to_f16(x);
        qf[i] = o->dt == CAS_BF16 ? cas_bf16_to_f32(q16[i]) : cas_f16_to_f32(q16[i]);
    }
    void *dq;
    float *dO, *dL;
    CU(cudaMalloc(&dq, nq * 2));
    CU(cudaMalloc((void **)&dO, nq * 4));
    CU(cudaMalloc((void **)&dL, (size_t)total_q * o->Hq * 4));
    CU(cudaMemcpy(dq, q16, nq * 2, cudaMemcpyHostToDevice));
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    cas_cuda_attn_caps caps = {0};
    caps.max_total_q = total_q;
    caps.max_passes = B + 1;
    caps.max_tok_rows = 2 * total_q;
    caps.max_page_ids = (int64_t)B * (pp + up);
    caps.max_states = 64 * (int64_t)total_q;
    cas_cuda_attn *a;
    CS(cas_cuda_attn_create(&a, &sh, &caps));

    /* passes of the two-level cascade */
    cas_attn_pass *pass = malloc(sizeof(cas_attn_pass) * (size_t)(B + 1));
    int32_t *ids = malloc(sizeof(int32_t) * 2 * (size_t)total_q), *pos = malloc(sizeof(int32_t) * 2 * (size_t)total_q);
    int32_t kvl = P + U;
    pass[0] = (cas_attn_pass){0, 0, P, 0, total_q, 0};
    for (int r = 0; r < B; r++) {
        pass[1 + r] = (cas_attn_pass){kvp[r] + pp, P, U, total_q + r * Q, Q, -1};
        for (int i = 0; i < Q; i++) {
            ids[r * Q + i] = ids[total_q + r * Q + i] = r * Q + i;
            pos[r * Q + i] = pos[total_q + r * Q + i] = kvl - Q + i;
        }
    }

    double kv_bytes_tok = 2.0 * o->Hkv * o->D * 2; /* K + V per token */
    double flat_bytes = (double)B * kvl * kv_bytes_tok, dedup_bytes = ((double)P + (double)B * U) * kv_bytes_tok;
    for (int mode = 0; mode < 3; mode++) {
        cas_status st = CAS_OK;
#if CAS_HAVE_CPU_PLANNER
        cas_attn_plan *cplan = NULL;
#endif
        if (mode == 0) st = cas_cuda_attn_plan_flat(a, &b, (int32_t)pool_pages, &pr);
        else if (mode == 1)
            st = cas_cuda_attn_plan_passes(a, &pr, (int32_t)pool_pages, B + 1, pass, idx,
                                           (int64_t)B * (pp + up), ids, pos, 2 * total_q, total_q);
        else {
#if CAS_HAVE_CPU_PLANNER
            cas_attn_plan_opts po = cas_attn_plan_opts_default();
            po.cascade = CAS_CASCADE_AUTO;
            po.cost = cas_cuda_attn_cost();
            st = cas_attn_plan_create(&cplan, &sh, &po, B, total_q, (int64_t)B * (pp + up));
            if (st == CAS_OK) st = cas_attn_plan_build(cplan, &b, (int32_t)pool_pages, &pr);
            if (st == CAS_OK) {
                cas_attn_plan_info inf;
                cas_attn_plan_get_info(cplan, &inf);
                res->planned_shared = inf.shared_passes;
                st = cas_cuda_attn_plan_from_cpu(a, cplan);
            }
            if (st != CAS_OK) fprintf(stderr, "planned run skipped: %s\n", cas_last_error());
#else
            st = CAS_ERR_UNSUPPORTED;
#endif
            if (st != CAS_OK) {
                res->planned_ms = NAN;
                res->err_planned = NAN;
                continue;
            }
        }
        if (st != CAS_OK) {
            fprintf(stderr, "plan failed: %s\n", cas_last_error());
            exit(1);
        }
        CS(cas_cuda_attn_upload(a, s));
        CU(cudaMemsetAsync(dO, 0xff, nq * 4, s));
        CS(cas_cuda_attn_run(a, dk, dv, dq, dO, dL, s));
        CU(cudaStreamSynchronize(s));
        CU(cudaMemcpy(Oh, dO, nq * 4, cudaMemcpyDeviceToHost));
        /* the reference of a long prefill would take minutes: skipped (NaN) */
        double err = (double)Q * kvl * o->Hq * o->D > 2e10 ? NAN : check_request(o, &b, B - 1, &pr, qf, Oh);
        /* also the first request's first row must be written */
        if (!isfinite(Oh[0])) err = INFINITY;
        double tg, te;
        CS(cas_cuda_attn_time(a, dk, dv, dq, dO, dL, s, o->warm, o->iters, 1, &tg));
        CS(cas_cuda_attn_time(a, dk, dv, dq, dO, dL, s, o->warm, o->iters, 0, &te));
        if (mode == 0) {
            res->flat_ms = tg;
            res->flat_eager_ms = te;
            res->err_flat = err;
        } else if (mode == 1) {
            cas_cuda_attn_info inf;
            cas_cuda_attn_get_info(a, &inf);
            if (inf.tasks_fused > 0) CS(cas_cuda_attn_fused_split(a, &res->fused_tail, &res->fused_narrow));
            res->cascade_ms = tg;
            res->cascade_eager_ms = te;
            res->err_cascade = err;
        } else {
            res->planned_ms = tg;
            res->err_planned = err;
        }
#if CAS_HAVE_CPU_PLANNER
        if (cplan) cas_attn_plan_destroy(cplan);
#endif
    }
    /* A/B in the same process: where the shared pass has at most 64 rows per
     * KV head, also time it on the 64-row mma.sync kernel next to wgmma
     * (CASCADE_CUDA_MID_ROWS=64; off by default) */
    res->cascade_mid_ms = NAN;
    if (!strcmp(cas_cuda_attn_kernel_name(a), "wgmma") && !getenv("CASCADE_CUDA_MID_ROWS") &&
        (int64_t)total_q * (o->Hq / o->Hkv) <= 64) {
        cas_cuda_attn *a2 = NULL;
        setenv("CASCADE_CUDA_MID_ROWS", "64", 1);
        CS(cas_cuda_attn_create(&a2, &sh, &caps));
        unsetenv("CASCADE_CUDA_MID_ROWS");
        CS(cas_cuda_attn_plan_passes(a2, &pr, (int32_t)pool_pages, B + 1, pass, idx,
                                     (int64_t)B * (pp + up), ids, pos, 2 * total_q, total_q));
        CS(cas_cuda_attn_upload(a2, s));
        CS(cas_cuda_attn_time(a2, dk, dv, dq, dO, dL, s, o->warm, o->iters, 1, &res->cascade_mid_ms));
        cas_cuda_attn_destroy(a2);
    }
    /* A/B in the same process: CASCADE_BENCH_AB="spec;spec;..." also times
     * the cascade with each spec, "kind[:ENV=VAL[,ENV=VAL]]": the many-rows
     * kernel kind (CASCADE_CUDA_WIDE) and environment settings that hold
     * while its context is created (checked against the reference too) */
    res->cascade_ab_ms = NAN;
    res->n_ab = 0;
    const char *abenv = getenv("CASCADE_BENCH_AB");
    for (const char *sp = abenv; sp && *sp && res->n_ab < 8;) {
        char spec[256];
        size_t n = strcspn(sp, ";");
        if (n >= sizeof spec) n = sizeof spec - 1;
        memcpy(spec, sp, n);
        spec[n] = 0;
        sp += n + (sp[n] == ';');
        if (atoi(spec) <= 0) continue;
        /* the variant's settings, the old values kept to restore them */
        char *names[9], *olds[9];
        int nset = 0;
        char kbuf[16];
        snprintf(kbuf, sizeof kbuf, "%d", atoi(spec));
        const char *sets[9][2];
        sets[nset][0] = "CASCADE_CUDA_WIDE";
        sets[nset++][1] = kbuf;
        char *colon = strchr(spec, ':');
        for (char *tok = colon ? strtok(colon + 1, ",") : NULL; tok && nset < 9; tok = strtok(NULL, ",")) {
            char *eq = strchr(tok, '=');
            if (!eq) continue;
            *eq = 0;
            sets[nset][0] = tok;
            sets[nset++][1] = eq + 1;
        }
        for (int i = 0; i < nset; i++) {
            const char *v = getenv(sets[i][0]);
            names[i] = strdup(sets[i][0]);
            olds[i] = v ? strdup(v) : NULL;
            setenv(sets[i][0], sets[i][1], 1);
        }
        cas_cuda_attn *a2 = NULL;
        CS(cas_cuda_attn_create(&a2, &sh, &caps));
        for (int i = 0; i < nset; i++) {
            if (olds[i]) setenv(names[i], olds[i], 1);
            else unsetenv(names[i]);
            free(names[i]);
            free(olds[i]);
        }
        CS(cas_cuda_attn_plan_passes(a2, &pr, (int32_t)pool_pages, B + 1, pass, idx,
                                     (int64_t)B * (pp + up), ids, pos, 2 * total_q, total_q));
        CS(cas_cuda_attn_upload(a2, s));
        CU(cudaMemsetAsync(dO, 0xff, nq * 4, s));
        CS(cas_cuda_attn_run(a2, dk, dv, dq, dO, dL, s));
        CU(cudaStreamSynchronize(s));
        CU(cudaMemcpy(Oh, dO, nq * 4, cudaMemcpyDeviceToHost));
        double err = check_request(o, &b, B - 1, &pr, qf, Oh);
        if (!isfinite(Oh[0])) err = INFINITY;
        res->ab_err[res->n_ab] = err;
        CS(cas_cuda_attn_time(a2, dk, dv, dq, dO, dL, s, o->warm, o->iters, 1, &res->ab_ms[res->n_ab]));
        if (res->n_ab == 0) res->cascade_ab_ms = res->ab_ms[0];
        res->n_ab++;
        cas_cuda_attn_destroy(a2);
    }
    /* CASCADE_BENCH_PARTS=1: the two levels of the cascade timed alone (a
     * plan of the shared pass only, one of the tails only; each covers every
     * token, so both are valid plans), where the time of a run goes */
    res->shared_only_ms = res->tails_only_ms = NAN;
    if (getenv("CASCADE_BENCH_PARTS") && atoi(getenv("CASCADE_BENCH_PARTS")) > 0 && P > 0) {
        CS(cas_cuda_attn_plan_passes(a, &pr, (int32_t)pool_pages, 1, pass, idx, (int64_t)B * (pp + up), ids,
                                     pos, 2 * total_q, total_q));
        CS(cas_cuda_attn_upload(a, s));
        CS(cas_cuda_attn_time(a, dk, dv, dq, dO, dL, s, o->warm, o->iters, 1, &res->shared_only_ms));
        CS(cas_cuda_attn_plan_passes(a, &pr, (int32_t)pool_pages, B, pass + 1, idx, (int64_t)B * (pp + up),
                                     ids, pos, 2 * total_q, total_q));
        CS(cas_cuda_attn_upload(a, s));
        CS(cas_cuda_attn_time(a, dk, dv, dq, dO, dL, s, o->warm, o->iters, 1, &res->tails_only_ms));
    }
    res->B = B;
    res->P = P;
    res->U = U;
    res->Q = Q;
    res->flat_GBps = flat_bytes / (res->flat_ms * 1e-3) / 1e9;
    res->cascade_GBps = dedup_bytes / (res->cascade_ms * 1e-3) / 1e9;
    double flops = 4.0 * B * Q * o->Hq * (double)P * o->D;
    double t1 = dedup_bytes / (peak * 1e9), t2 = flops / (tflops * 1e12);
    res->roofline_ms = (t1 > t2 ? t1 : t2) * 1e3;
    cas_cuda_attn_destroy(a);
    cudaStreamDestroy(s);
    cudaFree(dq);
    cudaFree(dO);
    cudaFree(dL);
    free(qo); free(kvp); free(idx); free(last); free(q16); free(qf); free(Oh);
    free(pass); free(ids); free(pos);
}

static void fill_pool(const opts_t *o, int64_t pages) {
    size_t n = (size_t)pages * o->page * o->Hkv * o->D;
    hk = malloc(n * 2);
    hv = malloc(n * 2);
    if (!hk || !hv) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < (int64_t)(n / 4096 + 1); c++) {
        uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(c + 1);
        for (size_t i = (size_t)c * 4096; i < n && i < (size_t)(c + 1) * 4096; i++) {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            /* uniform in [-2, 2) then rounded: not zeros, not huge */
            float a = ((float)(x & 0xffffff) / 16777216.0f) * 4.0f - 2.0f;
            float b2 = ((float)((x >> 32) & 0xffffff) / 16777216.0f) * 4.0f - 2.0f;
            hk[i] = o->dt == CAS_BF16 ? cas_f32_to_bf16(a) : cas_f32_to_f16(a);
            hv[i] = o->dt == CAS_BF16 ? cas_f32_to_bf16(b2) : cas_f32_to_f16(b2);
        }
    }
    CU(cudaMalloc(&dk, n * 2));
    CU(cudaMalloc(&dv, n * 2));
    CU(cudaMemcpy(dk, hk, n * 2, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dv, hv, n * 2, cudaMemcpyHostToDevice));
    pool_pages = pages;
}

static void print_result(FILE *f, const result_t *r, int comma) {
    fprintf(f,
            "  {\"B\": %d, \"P\": %d, \"U\": %d, \"qlen\": %d, \"flat_ms\": %.5f, \"cascade_ms\": %.5f, "
            "\"flat_eager_ms\": %.5f, \"cascade_eager_ms\": %.5f, ",
            r->B, r->P, r->U, r->Q, r->flat_ms, r->cascade_ms, r->flat_eager_ms, r->cascade_eager_ms);
    if (isfinite(r->planned_ms))
        fprintf(f, "\"planned_ms\": %.5f, \"planned_shared_passes\": %d, \"max_abs_err_planned\": %.3g, ",
                r->planned_ms, r->planned_shared, r->err_planned);
    if (isfinite(r->cascade_mid_ms))
        fprintf(f, "\"cascade_mid_ms\": %.5f, ", r->cascade_mid_ms);
    if (isfinite(r->cascade_ab_ms))
        fprintf(f, "\"cascade_ab_ms\": %.5f, \"ab_kind\": %d, ", r->cascade_ab_ms, atoi(getenv("CASCADE_BENCH_AB")));
    if (isfinite(r->shared_only_ms))
        fprintf(f, "\"shared_only_ms\": %.5f, \"tails_only_ms\": %.5f, ", r->shared_only_ms, r->tails_only_ms);
    if (r->n_ab > 0) {
        /* every variant, in the order of CASCADE_BENCH_AB */
        fprintf(f, "\"ab\": [");
        for (int i = 0; i < r->n_ab; i++) {
            /* a probe's error may be inf or NaN, which JSON lacks: null */
            char eb[32] = "null";
            if (isfinite(r->ab_err[i])) snprintf(eb, sizeof eb, "%.3g", r->ab_err[i]);
            fprintf(f, "{\"ms\": %.5f, \"max_abs_err\": %s}%s", r->ab_ms[i], eb, i + 1 < r->n_ab ? ", " : "");
        }
        fprintf(f, "], \"ab_specs\": \"%s\", ", getenv("CASCADE_BENCH_AB"));
    }
    if (r->fused_tail >= 0)
        fprintf(f, "\"fused_tasks_tail_warps\": %d, \"fused_tasks_narrow\": %d, ", r->fused_tail, r->fused_narrow);
    fprintf(f,
            "\"max_abs_err_flat\": %.3g, \"max_abs_err_cascade\": %.3g, \"flat_GBps\": %.1f, "
            "\"cascade_GBps\": %.1f, \"roofline_ms\": %.5f}%s\n",
            r->err_flat, r->err_cascade, r->flat_GBps, r->cascade_GBps, r->roofline_ms,
            comma ? "," : "");
}

int main(int argc, char **argv) {
    opts_t o = {32, 8, 128, 16, CAS_BF16, 30, 5, 0};
    int B = 64, P = 32768, U = 512, Q = 1, grid = 0, unshared = 0, prefill = 0;
    const char *json = NULL, *cases = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--batch")) B = atoi(v), i++;
        else if (!strcmp(a, "--prefix")) P = atoi(v), i++;
        else if (!strcmp(a, "--suffix")) U = atoi(v), i++;
        else if (!strcmp(a, "--qlen")) Q = atoi(v), i++;
        else if (!strcmp(a, "--heads")) { if (sscanf(v, "%d:%d", &o.Hq, &o.Hkv) != 2) return 2; i++; }
        else if (!strcmp(a, "--head-dim")) o.D = atoi(v), i++;
        else if (!strcmp(a, "--page-size")) o.page = atoi(v), i++;
        else if (!strcmp(a, "--dtype")) { if (cas_dtype_parse(v, &o.dt)) return 2; i++; }
        else if (!strcmp(a, "--iters")) o.iters = atoi(v), i++;
        else if (!strcmp(a, "--json")) json = v, i++;
        else if (!strcmp(a, "--grid")) grid = 1;
        else if (!strcmp(a, "--cases")) cases = v, i++;
        else if (!strcmp(a, "--unshared")) unshared = 1;
        else if (!strcmp(a, "--prefill")) prefill = atoi(v), i++;
        else if (!strcmp(a, "--shuffle-pages")) o.shuffle = 1;
        else {
            fprintf(stderr, "unknown option %s\n", a);
            return 2;
        }
    }
    if (P % o.page) {
        fprintf(stderr, "--prefix must be a multiple of --page-size\n");
        return 2;
    }
    /* run_case times at most 8 variants of CASCADE_BENCH_AB: refuse more
     * rather than drop them */
    const char *abl = getenv("CASCADE_BENCH_AB");
    int n_specs = abl && *abl ? 1 : 0;
    for (const char *c = abl; c && *c; c++) n_specs += *c == ';' && c[1];
    if (n_specs > 8) {
        fprintf(stderr, "CASCADE_BENCH_AB: %d variants, at most 8 are timed\n", n_specs);
        return 2;
    }
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    double peak, tflops;
    CS(cas_cuda_measure_copy(0, &peak));
    CS(cas_cuda_measure_gemm(0, 8192, &tflops));
    fprintf(stderr, "device %s, copy %.0f GB/s (read + write), cuBLAS bf16 %.0f TFLOP/s, wide kernel %s\n",
            prop.name, peak, tflops, getenv("CASCADE_CUDA_WIDE") ? getenv("CASCADE_CUDA_WIDE") : "default");

    static const int Ps[4] = {1024, 4096, 16384, 32768}, Bs[5] = {8, 16, 64, 128, 256}, Us[3] = {128, 512, 2048};
    /* --cases: a list of P,B,U (at most 64) run like the grid */
    int cP[64], cB[64], cU[64], nc = 0;
    for (const char *c = cases; c && *c && nc < 64;) {
        int p1, b1, u1, used = 0;
        if (sscanf(c, "%d,%d,%d%n", &p1, &b1, &u1, &used) != 3 || p1 < 0 || p1 % o.page || b1 < 1 ||
            u1 < 1 || b1 > 4096 || p1 > (1 << 20) || u1 > (1 << 20)) {
            fprintf(stderr, "--cases: want P,B,U;P,B,U... (P a multiple of the page size)\n");
            return 2;
        }
        cP[nc] = p1, cB[nc] = b1, cU[nc] = u1, nc++;
        c += used;
        while (*c == ';' || *c == ' ') c++;
    }
    int ncase = grid ? 60 : nc ? nc : 1;
    result_t *res = calloc((size_t)ncase, sizeof(result_t));
    int64_t need = grid ? 32768 / o.page + 256LL * 2048 / o.page
                        : (int64_t)P / o.page + (int64_t)B * ((U + o.page - 1) / o.page);
    for (int i = 0; i < nc; i++) {
        int64_t ni = (int64_t)cP[i] / o.page + (int64_t)cB[i] * ((cU[i] + o.page - 1) / o.page);
        if (ni > need) need = ni;
    }
    if (unshared && need < 64LL * 4096 / o.page) need = 64LL * 4096 / o.page;
    if (prefill && need < (int64_t)prefill / o.page + 1) need = (int64_t)prefill / o.page + 1;
    fill_pool(&o, need);
    if (grid) {
        int k = 0;
        for (int a = 0; a < 4; a++)
            for (int bb = 0; bb < 5; bb++)
                for (int c = 0; c < 3; c++) {
                    run_case(&o, Bs[bb], Ps[a], Us[c], Q, peak, tflops, &res[k]);
                    fprintf(stderr, "P %5d B %3d U %4d: flat %.4f cascade %.4f (mid %.4f, ab %.4f) planned %.4f ms (roof %.4f) err %.2g %.2g\n",
                            Ps[a], Bs[bb], Us[c], res[k].flat_ms, res[k].cascade_ms, res[k].cascade_mid_ms, res[k].cascade_ab_ms,
                            res[k].planned_ms, res[k].roofline_ms, res[k].err_flat, res[k].err_cascade);
                    k++;
                }
    } else if (nc) {
        for (int k = 0; k < nc; k++) {
            run_case(&o, cB[k], cP[k], cU[k], Q, peak, tflops, &res[k]);
            fprintf(stderr, "P %5d B %3d U %4d: flat %.4f cascade %.4f planned %.4f ms (roof %.4f) err %.2g %.2g; ab",
                    cP[k], cB[k], cU[k], res[k].flat_ms, res[k].cascade_ms, res[k].planned_ms,
                    res[k].roofline_ms, res[k].err_flat, res[k].err_cascade);
            for (int i = 0; i < res[k].n_ab; i++) fprintf(stderr, " %.4f (%.1g)", res[k].ab_ms[i], res[k].ab_err[i]);
            if (isfinite(res[k].shared_only_ms))
                fprintf(stderr, "; shared alone %.4f, tails alone %.4f", res[k].shared_only_ms, res[k].tails_only_ms);
            fprintf(stderr, "\n");
        }
    } else if (!unshared && !prefill) {
        run_case(&o, B, P, U, Q, peak, tflops, &res[0]);
    }
    result_t un = {0}, pf = {0};
    if (unshared) {
        /* B=64 x 4096 tokens, nothing shared: the flat kernel's bandwidth */
        run_case(&o, 64, 0, 4096, 1, peak, tflops, &un);
        fprintf(stderr, "unshared B64 x 4096: flat %.4f ms, %.0f GB/s (%.0f%% of copy)\n", un.flat_ms,
                un.flat_GBps, 100 * un.flat_GBps / peak);
    }
    if (prefill) {
        run_case(&o, 1, 0, prefill, prefill, peak, tflops, &pf);
        double fl = 4.0 * prefill * (double)prefill / 2 * o.D * o.Hq;
        fprintf(stderr, "prefill L=%d causal: %.4f ms, %.1f TFLOP/s\n", prefill, pf.flat_ms,
                fl / (pf.flat_ms * 1e-3) / 1e12);
    }
    FILE *f = json ? fopen(json, "w") : stdout;
    if (!f) return 1;
    fprintf(f, "{\"device\": \"%s\", \"backend\": \"cuda\", \"heads\": \"%d:%d\", \"head_dim\": %d, "
               "\"page_size\": %d, \"dtype\": \"%s\", \"peak_GBps\": %.1f, \"peak_TFLOPs\": %.1f, \"timing\": "
               "\"CUDA events, graph replay of one run, %d warm-up, median of %d\",\n",
            prop.name, o.Hq, o.Hkv, o.D, o.page, cas_dtype_name(o.dt), peak, tflops, o.warm, o.iters);
    if (unshared)
        fprintf(f, "\"flat_unshared\": {\"B\": 64, \"L\": 4096, \"ms\": %.5f, \"GBps\": %.1f, \"max_abs_err\": %.3g},\n",
                un.flat_ms, un.flat_GBps, un.err_flat);
    if (prefill) {
        double fl = 4.0 * prefill * (double)prefill / 2 * o.D * o.Hq;
        /* the float64 reference of a 16k prefill would take minutes: null (tests cover the kernel) */
        fprintf(f, "\"prefill\": {\"L\": %d, \"ms\": %.5f, \"TFLOPs\": %.1f, \"max_abs_err_last_rows\": null},\n",
                prefill, pf.flat_ms, fl / (pf.flat_ms * 1e-3) / 1e12);
    }
    fprintf(f, "\"cases\": [\n");
    int nprint = (grid || nc || (!unshared && !prefill)) ? ncase : 0;
    for (int i = 0; i < nprint; i++) print_result(f, &res[i], i + 1 < nprint);
    fprintf(f, "]}\n");
    if (json) fclose(f);
    /* short table last */
    printf("%6s %4s %5s | %9s %9s %9s | %9s | %7s %7s\n", "P", "B", "U", "flat", "cascade", "planned",
           "roof", "GB/s", "err");
    for (int i = 0; i < nprint; i++)
        printf("%6d %4d %5d | %9.4f %9.4f %9.4f | %9.4f | %7.0f %7.1e\n", res[i].P, res[i].B, res[i].U,
               res[i].flat_ms, res[i].cascade_ms, res[i].planned_ms, res[i].roofline_ms,
               res[i].cascade_GBps, fmax(res[i].err_flat, res[i].err_cascade));
    free(res);
    return 0;
}
