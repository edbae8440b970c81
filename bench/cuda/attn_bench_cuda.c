/*
 * attn_bench_cuda.c: benchmark of the CUDA attention backend, flat against
 * cascade, on batches of B requests that share a prefix of P tokens and own U
 * tokens each (decode: qlen queries per request), the shapes of the anchors in
 * ../shared/anchors (FlashInfer and PyTorch on an H200): the whole grid in one
 * process. `cascade attn-bench --backend cuda` measures one case of any
 * sharing tree with the same helpers (src/cuda/cuda_bench.c).
 *
 * Per case, three plans of the same batch: flat (one pass per request),
 * cascade (the shared prefix as one pass, then each request's tail) and
 * planned (the CPU planner with the GPU's cost numbers decides). Timing: CUDA
 * events around one run (the launches of cas_cuda_attn_run, replayed from a
 * CUDA graph, and also eager), after warm-up, median of --iters; the anchors'
 * method (no L2 flush, same pool; --flush-l2 writes 256 MB before every run).
 * The ceilings are a device-to-device copy (bytes read + written) and a
 * cuBLAS bf16 product measured in the same process.
 *
 * Every run's output is checked, every row, against the float64 reference
 * computed on the device (cas_cuda_attn_reference) with the row gate of
 * cas_attn_check_rows; the exit status is 1 if any gate fails. --fault
 * skip-tile|page-off runs the flat and cascade plans with one 64-key tile of
 * their longest pass missing, or one of its page ids one off (what a kernel
 * with that bug computes): then every such run must fail its gate, and the
 * exit status is 1 if one passes.
 *
 * Bandwidth is the bytes a run must fetch from memory (every distinct KV
 * token once, shared prefix included, plus q, o and lse) over its time, for
 * flat and cascade alike: a flat run reads the shared prefix once per
 * request, but the repeats come from the L2.
 *
 *   attn_bench_cuda [--batch B] [--prefix P] [--suffix U] [--qlen Q]
 *                   [--heads HQ:HKV] [--head-dim D] [--page-size S]
 *                   [--dtype bf16|f16] [--iters N] [--grid] [--unshared]
 *                   [--prefill L] [--shuffle-pages] [--cases "P,B,U;P,B,U..."]
 *                   [--kernel auto|wgmma|mma.sync] [--flush-l2]
 *                   [--fault skip-tile|page-off] [--json FILE]
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/cuda/cuda_attn.h"

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

enum { FAULT_NONE, FAULT_SKIP_TILE, FAULT_PAGE_OFF };

typedef struct {
    int Hq, Hkv, D, page;
    cas_dtype dt;
    int iters, warm;
    int shuffle; /* --shuffle-pages: page ids scattered over the pool instead of in runs */
    int flush;   /* --flush-l2 */
    int fault;
    cas_cuda_kernel kernel;
} opts_t;

/* one pool for all cases, filled once */
static void *dk, *dv;
static int64_t pool_pages;

typedef struct {
    int B, P, U, Q;
    double flat_ms, cascade_ms, planned_ms, flat_eager_ms, cascade_eager_ms;
    double rel_flat, rel_cascade, rel_planned; /* the worst row's relative error of each run */
    int64_t bad_rows;                          /* rows over the gate in the three runs */
    double flat_GBps, cascade_GBps, roofline_ms;
    int planned_shared;
} result_t;

static int gate_fail_count; /* runs whose gate result was not the one wanted */

/* gates a run's output (device) against the reference (host); returns its worst row's error */
static double check_run(const opts_t *o, const float *dO, const float *dL, const double *oref, const double *lref,
                        int64_t rows, float *Oh, float *Lh, int64_t *bad, const char *what) {
    CU(cudaMemcpy(Oh, dO, (size_t)rows * o->D * 4, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(Lh, dL, (size_t)rows * 4, cudaMemcpyDeviceToHost));
    cas_attn_check ck;
    const double tol = o->dt == CAS_BF16 ? CAS_ATTN_TOL_BF16 : CAS_ATTN_TOL_F16;
    const int pass = cas_attn_check_rows(Oh, Lh, oref, lref, rows, o->D, tol, CAS_ATTN_TOL_LSE, &ck);
    *bad += ck.bad_rows;
    const int want = o->fault == FAULT_NONE;
    if (pass != want) {
        gate_fail_count++;
        fprintf(stderr, "%s: %lld of %lld rows over the gate (worst row %lld: rel %.3g, tol %.3g; |dlse| %.3g)%s\n",
                what, (long long)ck.bad_rows, (long long)rows, (long long)ck.worst_row, ck.max_rel, tol, ck.max_lse,
                want ? "" : ": the fault was NOT caught");
    }
    return ck.max_rel;
}

/* the list with the fault of o->fault in its longest pass (pg: room for its page ids) */
static cas_attn_pass_list with_fault(const opts_t *o, cas_attn_pass_list l, cas_attn_pass *ps, int32_t *pg) {
    if (o->fault == FAULT_NONE || l.n_passes == 0) return l;
    int32_t li = 0;
    for (int32_t i = 1; i < l.n_passes; i++)
        if (l.passes[i].len > l.passes[li].len) li = i;
    const cas_attn_pass p = l.passes[li];
    memcpy(ps, l.passes, sizeof *ps * (size_t)l.n_passes);
    memcpy(pg, l.pages, sizeof *pg * (size_t)l.n_page_ids);
    if (o->fault == FAULT_SKIP_TILE && p.len >= 128) {
        const int32_t hole = (p.len / 2) / 64 * 64;
        ps[li].len = hole;
        ps[l.n_passes] = (cas_attn_pass){p.page_off + (hole + 64) / o->page, p.pos0 + hole + 64, p.len - hole - 64,
                                         p.tok_off, p.n_tok, p.node};
        l.n_passes++;
    } else if (o->fault == FAULT_PAGE_OFF) {
        const int64_t at = p.page_off + (p.len / o->page) / 2;
        pg[at] = (int32_t)((pg[at] + 1) % pool_pages);
    }
    l.passes = ps;
    l.pages = pg;
    return l;
}

static void run_case(const opts_t *o, int B, int P, int U, int Q, double peak, double tflops, result_t *res) {
    const int ps = o->page, pp = P / ps, up = (U + ps - 1) / ps;
    const int lastlen = U - (up - 1) * ps;
    const int total_q = B * Q;
    const cas_attn_shape sh = {o->Hq, o->Hkv, o->D, ps, o->dt};
    if ((int64_t)pp + (int64_t)B * up > pool_pages) {
        fprintf(stderr, "pool too small\n");
        exit(1);
    }
    const int64_t nids = (int64_t)B * (pp + up);
    int32_t *qo = malloc(sizeof(int32_t) * (size_t)(B + 1)), *kvp = malloc(sizeof(int32_t) * (size_t)(B + 1));
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)nids), *last = malloc(sizeof(int32_t) * (size_t)B);
    int32_t *fpg = malloc(sizeof(int32_t) * (size_t)nids);
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
        for (int64_t i = 0; i < nids; i++) idx[i] = (int32_t)((int64_t)idx[i] * A % pool_pages);
    }
    cas_attn_batch b = {B, qo, kvp, idx, last};
    cas_attn_params pr = cas_attn_params_default(); /* causal */
    /* q, rounded to the storage type */
    const size_t nq = (size_t)total_q * o->Hq * o->D, nl = (size_t)total_q * o->Hq;
    uint16_t *q16 = malloc(nq * 2);
    float *Oh = malloc(nq * 4), *Lh = malloc(nl * 4);
    double *oref = malloc(nq * 8), *lref = malloc(nl * 8);
    cas_rng rng;
    cas_rng_seed(&rng, (uint64_t)(B * 131 + P * 7 + U));
    for (size_t i = 0; i < nq; i++) {
        float x = (float)cas_rng_normal(&rng);
        q16[i] = o->dt == CAS_BF16 ? cas_f32_to_bf16(x) : cas_f32_to_f16(x);
    }
    void *dq;
    float *dO, *dL;
    double *dor, *dlr;
    CU(cudaMalloc(&dq, nq * 2));
    CU(cudaMalloc((void **)&dO, nq * 4));
    CU(cudaMalloc((void **)&dL, nl * 4));
    CU(cudaMalloc((void **)&dor, nq * 8));
    CU(cudaMalloc((void **)&dlr, nl * 8));
    CU(cudaMemcpy(dq, q16, nq * 2, cudaMemcpyHostToDevice));
    /* the reference of the batch, every row */
    CS(cas_cuda_attn_reference(&sh, dk, dv, (int32_t)pool_pages, &b, &pr, dq, dor, dlr));
    CU(cudaMemcpy(oref, dor, nq * 8, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(lref, dlr, nl * 8, cudaMemcpyDeviceToHost));
    cudaFree(dor);
    cudaFree(dlr);
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    cas_cuda_attn_caps caps = {0};
    caps.max_total_q = total_q;
    caps.max_passes = B + 2;
    caps.max_tok_rows = 2 * total_q;
    caps.max_page_ids = nids;
    caps.max_states = 64 * (int64_t)total_q;
    cas_cuda_attn_opts co = cas_cuda_attn_opts_default();
    co.kernel = o->kernel;
    cas_cuda_attn *a;
    CS(cas_cuda_attn_create(&a, &sh, &caps, &co));

    /* passes of the flat plan (one per request) and of the two-level cascade */
    cas_attn_pass *flat = malloc(sizeof(cas_attn_pass) * (size_t)(B + 1));
    cas_attn_pass *pass = malloc(sizeof(cas_attn_pass) * (size_t)(B + 2));
    cas_attn_pass *fps = malloc(sizeof(cas_attn_pass) * (size_t)(B + 2));
    int32_t *ids = malloc(sizeof(int32_t) * 2 * (size_t)total_q), *pos = malloc(sizeof(int32_t) * 2 * (size_t)total_q);
    const int32_t kvl = P + U;
    pass[0] = (cas_attn_pass){0, 0, P, 0, total_q, 0};
    for (int r = 0; r < B; r++) {
        flat[r] = (cas_attn_pass){kvp[r], 0, kvl, r * Q, Q, -1};
        pass[1 + r] = (cas_attn_pass){kvp[r] + pp, P, U, total_q + r * Q, Q, -1};
        for (int i = 0; i < Q; i++) {
            ids[r * Q + i] = ids[total_q + r * Q + i] = r * Q + i;
            pos[r * Q + i] = pos[total_q + r * Q + i] = kvl - Q + i;
        }
    }
    cas_attn_pass_list lf = {sh, pr, (int32_t)pool_pages, total_q, B, flat, idx, nids, ids, pos, 2 * total_q};
    cas_attn_pass_list lc = lf;
    lc.n_passes = P > 0 ? B + 1 : B;
    lc.passes = P > 0 ? pass : pass + 1;

    const double kv_bytes_tok = 2.0 * o->Hkv * o->D * 2; /* K + V per token */
    const double io_bytes = nq * 2.0 + nq * 4.0 + nl * 4.0;
    const double fetch_bytes = ((double)P + (double)B * U) * kv_bytes_tok + io_bytes;
    res->bad_rows = 0;
    for (int mode = 0; mode < 3; mode++) {
        cas_status st = CAS_OK;
        cas_attn_plan *cplan = NULL;
        if (mode < 2) {
            const cas_attn_pass_list l = with_fault(o, mode ? lc : lf, fps, fpg);
            st = cas_cuda_attn_plan_passes(a, &l);
        }
        if (mode == 2) {
            if (o->fault) { /* faults go into the two explicit plans */
                res->planned_ms = res->rel_planned = NAN;
                continue;
            }
            cas_attn_plan_opts po = cas_attn_plan_opts_default();
            po.cascade = CAS_CASCADE_AUTO;
            po.cost = cas_cuda_attn_cost();
            st = cas_attn_plan_create(&cplan, &sh, &po, B, total_q, nids);
            if (st == CAS_OK) st = cas_attn_plan_build(cplan, &b, (int32_t)pool_pages, &pr);
            if (st == CAS_OK) {
                cas_attn_plan_info inf;
                cas_attn_plan_get_info(cplan, &inf);
                res->planned_shared = inf.shared_passes;
                st = cas_cuda_attn_plan_from_cpu(a, cplan);
            }
        }
        if (st != CAS_OK) {
            fprintf(stderr, "plan failed: %s\n", cas_last_error());
            exit(1);
        }
        CS(cas_cuda_attn_upload(a, s));
        CU(cudaMemsetAsync(dO, 0xff, nq * 4, s)); /* NaN: every element must be written */
        CU(cudaMemsetAsync(dL, 0xff, nl * 4, s));
        CS(cas_cuda_attn_run(a, dk, dv, dq, dO, dL, s));
        CU(cudaStreamSynchronize(s));
        char what[96];
        static const char *names[3] = {"flat", "cascade", "planned"};
        snprintf(what, sizeof what, "P %d B %d U %d Q %d %s", P, B, U, Q, names[mode]);
        const double rel = check_run(o, dO, dL, oref, lref, (int64_t)nl, Oh, Lh, &res->bad_rows, what);
        double tg, te = NAN;
        CS(cas_cuda_attn_time(a, dk, dv, dq, dO, dL, s, o->warm, o->iters, 1, o->flush, &tg));
        if (mode < 2) CS(cas_cuda_attn_time(a, dk, dv, dq, dO, dL, s, o->warm, o->iters, 0, o->flush, &te));
        if (mode == 0) res->flat_ms = tg, res->flat_eager_ms = te, res->rel_flat = rel;
        else if (mode == 1) res->cascade_ms = tg, res->cascade_eager_ms = te, res->rel_cascade = rel;
        else res->planned_ms = tg, res->rel_planned = rel;
        if (cplan) cas_attn_plan_destroy(cplan);
    }
    res->B = B;
    res->P = P;
    res->U = U;
    res->Q = Q;
    res->flat_GBps = fetch_bytes / (res->flat_ms * 1e-3) / 1e9;
    res->cascade_GBps = fetch_bytes / (res->cascade_ms * 1e-3) / 1e9;
    double flops = 4.0 * B * Q * o->Hq * (double)P * o->D;
    double t1 = fetch_bytes / (peak * 1e9), t2 = flops / (tflops * 1e12);
    res->roofline_ms = (t1 > t2 ? t1 : t2) * 1e3;
    cas_cuda_attn_destroy(a);
    cudaStreamDestroy(s);
    cudaFree(dq);
    cudaFree(dO);
    cudaFree(dL);
    free(qo); free(kvp); free(idx); free(last); free(fpg); free(q16); free(Oh); free(Lh); free(oref); free(lref);
    free(flat); free(pass); free(fps); free(ids); free(pos);
}

static void fill_pool(const opts_t *o, int64_t pages) {
    size_t n = (size_t)pages * o->page * o->Hkv * o->D;
    uint16_t *hk = malloc(n * 2), *hv = malloc(n * 2);
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
    free(hk);
    free(hv);
    pool_pages = pages;
}

/* a number for JSON (NaN: null) */
static const char *jnum(char *buf, int digits, double v) {
    if (!isfinite(v)) return "null";
    snprintf(buf, 32, "%.*g", digits, v);
    return buf;
}

static void print_result(FILE *f, const result_t *r, int comma) {
    char b1[32], b2[32], b3[32], b4[32];
    fprintf(f,
            "  {\"B\": %d, \"P\": %d, \"U\": %d, \"qlen\": %d, \"flat_ms\": %.5f, \"cascade_ms\": %.5f, "
            "\"planned_ms\": %s, \"planned_shared_passes\": %d, \"flat_eager_ms\": %.5f, \"cascade_eager_ms\": %.5f, "
            "\"max_rel_err_flat\": %s, \"max_rel_err_cascade\": %s, \"max_rel_err_planned\": %s, \"bad_rows\": %lld, "
            "\"flat_GBps\": %.1f, \"cascade_GBps\": %.1f, \"roofline_ms\": %.5f}%s\n",
            r->B, r->P, r->U, r->Q, r->flat_ms, r->cascade_ms, jnum(b1, 5, r->planned_ms), r->planned_shared,
            r->flat_eager_ms, r->cascade_eager_ms, jnum(b2, 3, r->rel_flat), jnum(b3, 3, r->rel_cascade),
            jnum(b4, 3, r->rel_planned), (long long)r->bad_rows, r->flat_GBps, r->cascade_GBps, r->roofline_ms,
            comma ? "," : "");
}

int main(int argc, char **argv) {
    opts_t o = {32, 8, 128, 16, CAS_BF16, 30, 5, 0, 0, FAULT_NONE, CAS_CUDA_KERNEL_AUTO};
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
        else if (!strcmp(a, "--flush-l2")) o.flush = 1;
        else if (!strcmp(a, "--kernel")) {
            if (!strcmp(v, "auto")) o.kernel = CAS_CUDA_KERNEL_AUTO;
            else if (!strcmp(v, "wgmma")) o.kernel = CAS_CUDA_KERNEL_WGMMA;
            else if (!strcmp(v, "mma.sync")) o.kernel = CAS_CUDA_KERNEL_MMA_SYNC;
            else { fprintf(stderr, "--kernel is auto, wgmma or mma.sync\n"); return 2; }
            i++;
        } else if (!strcmp(a, "--fault")) {
            if (!strcmp(v, "skip-tile")) o.fault = FAULT_SKIP_TILE;
            else if (!strcmp(v, "page-off")) o.fault = FAULT_PAGE_OFF;
            else { fprintf(stderr, "--fault is skip-tile or page-off\n"); return 2; }
            i++;
        } else {
            fprintf(stderr, "unknown option %s\n", a);
            return 2;
        }
    }
    if (P % o.page) {
        fprintf(stderr, "--prefix must be a multiple of --page-size\n");
        return 2;
    }
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    double peak, tflops;
    CS(cas_cuda_measure_copy(0, &peak));
    CS(cas_cuda_measure_gemm(0, 8192, &tflops));
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
    const char *kname = "?";
    {
        const cas_attn_shape sh = {o.Hq, o.Hkv, o.D, o.page, o.dt};
        cas_cuda_attn_caps caps = {0};
        caps.max_total_q = caps.max_passes = caps.max_tok_rows = 1;
        caps.max_page_ids = 1;
        cas_cuda_attn_opts co = cas_cuda_attn_opts_default();
        co.kernel = o.kernel;
        cas_cuda_attn *a = NULL;
        CS(cas_cuda_attn_create(&a, &sh, &caps, &co));
        kname = cas_cuda_attn_kernel_name(a);
        cas_cuda_attn_destroy(a);
    }
    fprintf(stderr, "device %s, copy %.0f GB/s (read + write), cuBLAS bf16 %.0f TFLOP/s, many-rows kernel %s%s\n",
            prop.name, peak, tflops, kname, o.fault ? ", faults injected" : "");
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
    int nrun = 0;
    if (grid) {
        for (int a = 0; a < 4; a++)
            for (int bb = 0; bb < 5; bb++)
                for (int c = 0; c < 3; c++, nrun++) {
                    run_case(&o, Bs[bb], Ps[a], Us[c], Q, peak, tflops, &res[nrun]);
                    fprintf(stderr, "P %5d B %3d U %4d: flat %.4f cascade %.4f planned %.4f ms (roof %.4f) rel err %.2g %.2g %.2g\n",
                            Ps[a], Bs[bb], Us[c], res[nrun].flat_ms, res[nrun].cascade_ms, res[nrun].planned_ms,
                            res[nrun].roofline_ms, res[nrun].rel_flat, res[nrun].rel_cascade, res[nrun].rel_planned);
                }
    } else if (nc) {
        for (; nrun < nc; nrun++) {
            run_case(&o, cB[nrun], cP[nrun], cU[nrun], Q, peak, tflops, &res[nrun]);
            fprintf(stderr, "P %5d B %3d U %4d: flat %.4f cascade %.4f planned %.4f ms (roof %.4f) rel err %.2g %.2g %.2g\n",
                    cP[nrun], cB[nrun], cU[nrun], res[nrun].flat_ms, res[nrun].cascade_ms, res[nrun].planned_ms,
                    res[nrun].roofline_ms, res[nrun].rel_flat, res[nrun].rel_cascade, res[nrun].rel_planned);
        }
    } else if (!unshared && !prefill) {
        run_case(&o, B, P, U, Q, peak, tflops, &res[nrun++]);
    }
    result_t un = {0}, pf = {0};
    if (unshared) {
        /* B=64 x 4096 tokens, nothing shared: the flat kernel's bandwidth */
        run_case(&o, 64, 0, 4096, 1, peak, tflops, &un);
        fprintf(stderr, "unshared B64 x 4096: flat %.4f ms, %.0f GB/s (%.0f%% of copy), rel err %.2g\n", un.flat_ms,
                un.flat_GBps, 100 * un.flat_GBps / peak, un.rel_flat);
    }
    if (prefill) {
        run_case(&o, 1, 0, prefill, prefill, peak, tflops, &pf);
        double fl = 4.0 * prefill * (double)prefill / 2 * o.D * o.Hq;
        fprintf(stderr, "prefill L=%d causal: %.4f ms, %.1f TFLOP/s, rel err %.2g\n", prefill, pf.flat_ms,
                fl / (pf.flat_ms * 1e-3) / 1e12, pf.rel_flat);
    }
    FILE *f = json ? fopen(json, "w") : stdout;
    if (!f) return 1;
    char e1[32], e2[32];
    fprintf(f, "{\"device\": \"%s\", \"backend\": \"cuda\", \"kernel\": \"%s\", \"heads\": \"%d:%d\", \"head_dim\": %d, "
               "\"page_size\": %d, \"dtype\": \"%s\", \"peak_GBps\": %.1f, \"peak_TFLOPs\": %.1f, \"timing\": "
               "\"CUDA events, graph replay of one run, %d warm-up, median of %d%s\", \"check\": \"every row of "
               "every run against the float64 reference on the device; relative error of a row's output, gate %g (%s)\", "
               "\"fault\": \"%s\", \"gate_failures\": %d,\n",
            prop.name, kname, o.Hq, o.Hkv, o.D, o.page, cas_dtype_name(o.dt), peak, tflops, o.warm, o.iters,
            o.flush ? ", L2 flushed before each run" : "", o.dt == CAS_BF16 ? CAS_ATTN_TOL_BF16 : CAS_ATTN_TOL_F16,
            cas_dtype_name(o.dt), o.fault == FAULT_SKIP_TILE ? "skip-tile" : o.fault == FAULT_PAGE_OFF ? "page-off" : "none",
            gate_fail_count);
    if (unshared)
        fprintf(f, "\"flat_unshared\": {\"B\": 64, \"L\": 4096, \"ms\": %.5f, \"GBps\": %.1f, \"max_rel_err\": %s},\n",
                un.flat_ms, un.flat_GBps, jnum(e1, 3, un.rel_flat));
    if (prefill) {
        double fl = 4.0 * prefill * (double)prefill / 2 * o.D * o.Hq;
        fprintf(f, "\"prefill\": {\"L\": %d, \"ms\": %.5f, \"TFLOPs\": %.1f, \"max_rel_err\": %s},\n", prefill,
                pf.flat_ms, fl / (pf.flat_ms * 1e-3) / 1e12, jnum(e2, 3, pf.rel_flat));
    }
    fprintf(f, "\"cases\": [\n");
    for (int i = 0; i < nrun; i++) print_result(f, &res[i], i + 1 < nrun);
    fprintf(f, "]}\n");
    if (json) fclose(f);
    /* short table last */
    printf("%6s %4s %5s | %9s %9s %9s | %9s | %7s %8s\n", "P", "B", "U", "flat", "cascade", "planned", "roof",
           "GB/s", "rel err");
    for (int i = 0; i < nrun; i++)
        printf("%6d %4d %5d | %9.4f %9.4f %9.4f | %9.4f | %7.0f %8.1e\n", res[i].P, res[i].B, res[i].U,
               res[i].flat_ms, res[i].cascade_ms, res[i].planned_ms, res[i].roofline_ms, res[i].cascade_GBps,
               fmax(res[i].rel_flat, res[i].rel_cascade));
    if (gate_fail_count)
        fprintf(stderr, "%d runs %s\n", gate_fail_count,
                o.fault ? "passed their gate with a fault injected" : "failed their gate");
    free(res);
    return gate_fail_count ? 1 : 0;
}
