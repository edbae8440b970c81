/*
 * test_cuda_attn.c: the CUDA attention backend against the float64
 * reference (cas_attn_reference), every row of every output gated by
 * cas_attn_check_rows (the error over the norm of the row's reference): flat
 * batches over a grid of dtypes, head dims, GQA groups, page sizes, ragged
 * queries, causal/window/soft-cap; page ids in runs (the TMA row boxes); a
 * two-level cascade built from explicit passes (also with a window that
 * empties the shared states, so the merge sees -inf); the CPU planner's
 * plan; GPU merges against the CPU merges; a CUDA graph captured once and
 * replayed after re-plans of other batches; the device's float64 reference
 * (cas_cuda_attn_reference) against the CPU's on every case; and the gates
 * themselves: at 1k and at 32k keys a run that misses one 64-key tile, or
 * reads one page one id off, must fail them (test_gates).
 *
 * Every case runs with each many-rows kernel the device has (the default:
 * wgmma on Hopper with head_dim 128; and mma.sync, forced by the options).
 * Outputs are poisoned (NaN) before each run. Built only by `make CUDA=1
 * test-cuda`; needs a GPU. `test_cuda_attn --quick 1` runs a subset (for
 * compute-sanitizer memcheck), `--quick 2` a smaller one (racecheck).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "../../src/cuda/cuda_attn.h"

static int quick;
/* the kernel the cases run on (the options of every context they create) */
static cas_cuda_kernel kernel = CAS_CUDA_KERNEL_AUTO;
/* 1: page ids in runs of consecutive ids (a fresh pool), broken every few
 * pages, instead of a random permutation: the TMA kernel's run boxes */
static int page_runs;

#define CU(call)                                                                              \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            printf("CUDA error %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            CHECK(0);                                                                         \
            return;                                                                           \
        }                                                                                     \
    } while (0)

/* ---- a random paged batch ---------------------------------------------- */

typedef struct {
    cas_attn_shape shape;
    cas_attn_params params;
    int32_t B, num_pages, total_q, npre; /* npre: shared prefix pages of every request */
    int32_t *qo, *kvp, *idx, *last;
    uint16_t *k, *v, *q16;
    float *q;     /* q rounded to the storage type, as f32 */
    double *oref, *lref;
    void *dk, *dv, *dq;
    float *dO, *dL;
    float *o, *l;
} tcase;

static uint16_t to16(cas_dtype t, float x) { return t == CAS_BF16 ? cas_f32_to_bf16(x) : cas_f32_to_f16(x); }
static float from16(cas_dtype t, uint16_t x) { return t == CAS_BF16 ? cas_bf16_to_f32(x) : cas_f16_to_f32(x); }

static void tcase_free(tcase *c) {
    free(c->qo); free(c->kvp); free(c->idx); free(c->last);
    free(c->k); free(c->v); free(c->q16); free(c->q); free(c->oref); free(c->lref);
    free(c->o); free(c->l);
    if (c->dk) cudaFree(c->dk);
    if (c->dv) cudaFree(c->dv);
    if (c->dq) cudaFree(c->dq);
    if (c->dO) cudaFree(c->dO);
    if (c->dL) cudaFree(c->dL);
    memset(c, 0, sizeof *c);
}

static cas_attn_batch tcase_batch(const tcase *c) {
    cas_attn_batch b = {c->B, c->qo, c->kvp, c->idx, c->last};
    return b;
}

/* the device's float64 reference of c against the CPU's: the same function
 * up to double rounding */
static void check_device_reference(const tcase *c) {
    const size_t nq = (size_t)c->total_q * c->shape.num_qo_heads * c->shape.head_dim;
    const size_t nl = (size_t)c->total_q * c->shape.num_qo_heads;
    double *dor = NULL, *dlr = NULL, *ho = malloc(nq * 8 + 8), *hl = malloc(nl * 8 + 8);
    cas_attn_batch b = tcase_batch(c);
    int ok = ho && hl && !cudaMalloc((void **)&dor, nq * 8 + 8) && !cudaMalloc((void **)&dlr, nl * 8 + 8);
    cas_status st = ok ? cas_cuda_attn_reference(&c->shape, c->dk, c->dv, c->num_pages, &b, &c->params, c->dq, dor, dlr)
                       : CAS_ERR_NOMEM;
    CHECKF(st == CAS_OK, "device reference: %s", cas_last_error());
    if (st == CAS_OK && !cudaMemcpy(ho, dor, nq * 8, cudaMemcpyDeviceToHost) &&
        !cudaMemcpy(hl, dlr, nl * 8, cudaMemcpyDeviceToHost)) {
        double eo = 0, el = 0;
        for (size_t i = 0; i < nq; i++) eo = fmax(eo, fabs(ho[i] - c->oref[i]));
        int bad = 0;
        for (size_t i = 0; i < nl; i++) {
            if (isinf(c->lref[i])) bad += hl[i] != c->lref[i];
            else el = fmax(el, fabs(hl[i] - c->lref[i]));
        }
        CHECKF(bad == 0 && eo < 1e-9 && el < 1e-9, "device reference: %d empty rows differ, max |do| %.3g |dlse| %.3g",
               bad, eo, el);
    }
    if (dor) cudaFree(dor);
    if (dlr) cudaFree(dlr);
    free(ho);
    free(hl);
}

/* qlen[r], kvlen[r]; npre pages shared by all requests (0: none). */
static int tcase_make(tcase *c, cas_rng *rng, cas_dtype dt, int D, int Hq, int Hkv, int P, int B,
                      const int *qlen, const int *kvlen, int npre, cas_attn_params params) {
    memset(c, 0, sizeof *c);
    c->shape = (cas_attn_shape){Hq, Hkv, D, P, dt};
    c->params = params;
    c->B = B;
    c->npre = npre;
    c->qo = malloc(sizeof(int32_t) * (size_t)(B + 1));
    c->kvp = malloc(sizeof(int32_t) * (size_t)(B + 1));
    c->last = malloc(sizeof(int32_t) * (size_t)B);
    c->qo[0] = c->kvp[0] = 0;
    for (int r = 0; r < B; r++) {
        int np = (kvlen[r] + P - 1) / P;
        c->qo[r + 1] = c->qo[r] + qlen[r];
        c->kvp[r + 1] = c->kvp[r] + np;
        c->last[r] = kvlen[r] - (np - 1) * P;
    }
    c->total_q = c->qo[B];
    int32_t nid = c->kvp[B];
    c->num_pages = nid + 3; /* a few unused pages */
    c->idx = malloc(sizeof(int32_t) * (size_t)nid);
    /* a random permutation of page ids; the prefix pages are request 0's */
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)c->num_pages);
    for (int i = 0; i < c->num_pages; i++) perm[i] = i;
    for (int i = c->num_pages - 1; i > 0 && !page_runs; i--) {
        int j = (int)cas_rng_range(rng, 0, i);
        int32_t tmp = perm[i]; perm[i] = perm[j]; perm[j] = tmp;
    }
    for (int i = 5; i + 1 < c->num_pages && page_runs; i += 11) { /* breaks */
        int32_t tmp = perm[i]; perm[i] = perm[i + 1]; perm[i + 1] = tmp;
    }
    for (int i = 0; i < nid; i++) c->idx[i] = perm[i];
    for (int r = 1; r < B; r++)
        for (int j = 0; j < npre; j++) c->idx[c->kvp[r] + j] = c->idx[j];
    free(perm);
    size_t pool = (size_t)c->num_pages * P * Hkv * D;
    c->k = malloc(pool * 2);
    c->v = malloc(pool * 2);
    for (size_t i = 0; i < pool; i++) {
        c->k[i] = to16(dt, (float)cas_rng_normal(rng));
        c->v[i] = to16(dt, (float)cas_rng_normal(rng));
    }
    size_t nq = (size_t)c->total_q * Hq * D;
    c->q16 = malloc(nq * 2);
    c->q = malloc(nq * 4);
    for (size_t i = 0; i < nq; i++) {
        c->q16[i] = to16(dt, (float)cas_rng_normal(rng));
        c->q[i] = from16(dt, c->q16[i]);
    }
    c->oref = malloc(sizeof(double) * nq);
    c->lref = malloc(sizeof(double) * (size_t)c->total_q * Hq);
    c->o = malloc(nq * 4);
    c->l = malloc(sizeof(float) * (size_t)c->total_q * Hq);
    cas_kv_pool kp = {c->k, c->v, c->num_pages};
    cas_attn_batch b = {B, c->qo, c->kvp, c->idx, c->last};
    if (cas_attn_reference(&c->shape, &kp, &b, &c->params, c->q, c->oref, c->lref) != CAS_OK) {
        printf("reference failed: %s\n", cas_last_error());
        return -1;
    }
    if (cudaMalloc(&c->dk, pool * 2) || cudaMalloc(&c->dv, pool * 2) || cudaMalloc(&c->dq, nq * 2) ||
        cudaMalloc((void **)&c->dO, nq * 4) || cudaMalloc((void **)&c->dL, (size_t)c->total_q * Hq * 4))
        return -1;
    if (cudaMemcpy(c->dk, c->k, pool * 2, cudaMemcpyHostToDevice) ||
        cudaMemcpy(c->dv, c->v, pool * 2, cudaMemcpyHostToDevice) ||
        cudaMemcpy(c->dq, c->q16, nq * 2, cudaMemcpyHostToDevice))
        return -1;
    check_device_reference(c);
    return 0;
}

static void poison(tcase *c) {
    size_t nq = (size_t)c->total_q * c->shape.num_qo_heads * c->shape.head_dim;
    cudaMemset(c->dO, 0xff, nq * 4); /* NaN */
    cudaMemset(c->dL, 0xff, (size_t)c->total_q * c->shape.num_qo_heads * 4);
}

static double tol_rel(cas_dtype t) { return t == CAS_BF16 ? CAS_ATTN_TOL_BF16 : CAS_ATTN_TOL_F16; }

/* Gates the device output against the reference, every row; returns 1 when
 * it passes (want: whether it should) */
static int gate(tcase *c, const char *what, int want) {
    size_t nq = (size_t)c->total_q * c->shape.num_qo_heads * c->shape.head_dim;
    size_t nl = (size_t)c->total_q * c->shape.num_qo_heads;
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(c->o, c->dO, nq * 4, cudaMemcpyDeviceToHost) ||
        cudaMemcpy(c->l, c->dL, nl * 4, cudaMemcpyDeviceToHost)) {
        printf("%s: CUDA error %s\n", what, cudaGetErrorString(cudaGetLastError()));
        CHECK(0);
        return 0;
    }
    cas_attn_check ck;
    const int pass = cas_attn_check_rows(c->o, c->l, c->oref, c->lref, (int64_t)nl, c->shape.head_dim,
                                         tol_rel(c->shape.kv_dtype), CAS_ATTN_TOL_LSE, &ck);
    CHECKF(pass == want, "%s: %lld of %lld rows over the gate (want %s), worst row %lld: rel %.3g (tol %.3g), "
           "|dlse| %.3g", what, (long long)ck.bad_rows, (long long)ck.rows, want ? "none" : "some",
           (long long)ck.worst_row, ck.max_rel, tol_rel(c->shape.kv_dtype), ck.max_lse);
    printf("  %-56s rows %7lld  max rel %.2e  max |dlse| %.2e%s\n", what, (long long)ck.rows, ck.max_rel, ck.max_lse,
           want ? "" : (pass ? "  (fault NOT caught)" : "  (fault caught)"));
    return pass;
}

static cas_cuda_attn *ctx_for(const cas_attn_shape *s, int maxq, int maxp, int64_t maxids) {
    cas_cuda_attn_caps caps = {0};
    caps.max_total_q = maxq;
    caps.max_passes = maxp;
    caps.max_tok_rows = 2 * maxq;
    caps.max_page_ids = maxids;
    cas_cuda_attn_opts o = cas_cuda_attn_opts_default();
    o.kernel = kernel;
    cas_cuda_attn *a = NULL;
    if (cas_cuda_attn_create(&a, s, &caps, &o) != CAS_OK) {
        printf("create failed: %s\n", cas_last_error());
        return NULL;
    }
    return a;
}

/* plans l on a, uploads, runs on c's buffers (poisoned first) */
static cas_status run_list(cas_cuda_attn *a, tcase *c, const cas_attn_pass_list *l) {
    cas_status st = cas_cuda_attn_plan_passes(a, l);
    if (st) return st;
    poison(c);
    if ((st = cas_cuda_attn_upload(a, 0))) return st;
    return cas_cuda_attn_run(a, c->dk, c->dv, c->dq, c->dO, c->dL, 0);
}

/* ---- flat grid ---------------------------------------------------------- */

typedef struct {
    cas_dtype dt;
    int D, Hq, Hkv, P, B;
    int qlen[8], kvlen[8];
    int causal, window;
    float cap;
} flat_cfg;

static void run_flat(const flat_cfg *f, cas_rng *rng, const char *label) {
    cas_attn_params pr = cas_attn_params_default();
    pr.causal = f->causal;
    pr.window_left = f->window;
    pr.logits_soft_cap = f->cap;
    tcase c;
    REQUIRE(tcase_make(&c, rng, f->dt, f->D, f->Hq, f->Hkv, f->P, f->B, f->qlen, f->kvlen, 0, pr) == 0);
    cas_cuda_attn *a = ctx_for(&c.shape, c.total_q, c.B, c.kvp[c.B]);
    REQUIRE(a);
    cas_attn_batch b = tcase_batch(&c);
    cas_status st = cas_cuda_attn_plan_flat(a, &b, c.num_pages, &pr);
    CHECKF(st == CAS_OK, "plan: %s", cas_last_error());
    poison(&c);
    CHECK(cas_cuda_attn_upload(a, 0) == CAS_OK);
    st = cas_cuda_attn_run(a, c.dk, c.dv, c.dq, c.dO, c.dL, 0);
    CHECKF(st == CAS_OK, "run: %s", cas_last_error());
    char what[160];
    cas_cuda_attn_info info;
    cas_cuda_attn_get_info(a, &info);
    snprintf(what, sizeof what, "%s %s D%d %d:%d P%d B%d c%d w%d cap%g (tasks %d+%d)", label,
             cas_dtype_name(f->dt), f->D, f->Hq, f->Hkv, f->P, f->B, f->causal, f->window, (double)f->cap,
             info.tasks_wide, info.tasks_narrow);
    gate(&c, what, 1);
    cas_cuda_attn_destroy(a);
    tcase_free(&c);
}

static void test_flat_grid(void) {
    static const flat_cfg cfgs[] = {
        {CAS_BF16, 128, 32, 8, 16, 6, {1, 1, 5, 17, 1, 40}, {1, 300, 77, 17, 1500, 600}, 1, -1, 0},
        {CAS_F16, 128, 32, 8, 16, 6, {1, 1, 5, 17, 1, 40}, {1, 300, 77, 17, 1500, 600}, 1, -1, 0},
        {CAS_F16, 64, 8, 8, 1, 3, {1, 3, 2}, {5, 40, 2}, 1, -1, 0},
        {CAS_BF16, 256, 16, 2, 256, 3, {70, 1, 9}, {300, 700, 9}, 1, -1, 0},
        {CAS_F16, 96, 12, 4, 7, 3, {4, 1, 30}, {50, 99, 64}, 0, 20, 30.0f},
        {CAS_BF16, 128, 8, 1, 32, 4, {1, 1, 1, 2}, {2000, 1999, 64, 3000}, 1, 50, 10.0f},
        {CAS_BF16, 64, 4, 4, 16, 1, {200}, {200}, 1, -1, 0},
        {CAS_F16, 256, 8, 8, 3, 2, {3, 33}, {40, 33}, 1, 5, 0},
        {CAS_BF16, 96, 6, 3, 64, 2, {1, 8}, {4096, 130}, 0, -1, 0},
        {CAS_F16, 64, 16, 2, 128, 3, {1, 1, 1}, {9000, 129, 128}, 1, -1, 50.0f},
        /* many-rows tasks at head_dim 128 (the wgmma kernel): group 1 and 8,
         * pages of 5 (keys straddle pages), partial tiles, window, soft cap */
        {CAS_BF16, 128, 8, 8, 5, 2, {150, 33}, {301, 33}, 1, -1, 0},
        {CAS_F16, 128, 32, 4, 16, 2, {70, 19}, {333, 1000}, 1, 40, 20.0f},
        {CAS_BF16, 128, 16, 8, 1, 2, {130, 9}, {130, 77}, 0, -1, 0},
        /* group 6: a token's rows straddle row blocks and the 64-row halves
         * of a many-rows task */
        {CAS_BF16, 128, 24, 4, 16, 3, {40, 3, 1}, {700, 2000, 3000}, 1, -1, 0},
    };
    int n = (int)(sizeof cfgs / sizeof cfgs[0]);
    cas_rng rng;
    cas_rng_seed(&rng, 1234);
    for (int i = 0; i < n; i++) {
        if ((quick == 1 && i > 3) || (quick >= 2 && i > 1)) break;
        run_flat(&cfgs[i], &rng, "flat");
    }
}

/* Page ids in runs: the TMA kernel loads 64 keys of consecutive pages as one
 * box; pages of 8, 16 and 32, prefill rows and decode rows, causal, a
 * window that starts tasks off the box grid. */
static void test_page_runs(void) {
    static const flat_cfg cfgs[] = {
        {CAS_BF16, 128, 32, 8, 16, 3, {300, 1, 40}, {1200, 2000, 700}, 1, -1, 0},
        {CAS_F16, 128, 16, 4, 8, 2, {200, 9}, {900, 1500}, 1, -1, 0},
        {CAS_BF16, 128, 16, 2, 32, 2, {150, 70}, {1000, 333}, 1, 100, 0},
    };
    int n = (int)(sizeof cfgs / sizeof cfgs[0]);
    cas_rng rng;
    cas_rng_seed(&rng, 4321);
    page_runs = 1;
    for (int i = 0; i < n; i++) {
        if (quick >= 2 && i > 0) break;
        run_flat(&cfgs[i], &rng, "page runs");
    }
    page_runs = 0;
}

/* ---- cascade from explicit passes --------------------------------------- */

/* Pass 0: every token over the npre shared pages; pass 1+r: request r's
 * tokens over its own pages. Arrays sized by the caller. */
static cas_attn_pass_list cascade_passes(const tcase *c, cas_attn_pass *ps, int32_t *ids, int32_t *pos) {
    const int P = c->shape.page_size;
    int32_t n = 0, rows = 0;
    ps[n++] = (cas_attn_pass){c->kvp[0], 0, c->npre * P, 0, c->total_q, 0};
    for (int r = 0; r < c->B; r++) {
        int32_t kvl = (c->kvp[r + 1] - c->kvp[r] - 1) * P + c->last[r];
        int32_t ql = c->qo[r + 1] - c->qo[r];
        for (int i = 0; i < ql; i++) {
            ids[rows] = c->qo[r] + i;
            pos[rows] = kvl - ql + i;
            rows++;
        }
    }
    for (int r = 0; r < c->B; r++) {
        int32_t kvl = (c->kvp[r + 1] - c->kvp[r] - 1) * P + c->last[r];
        int32_t ql = c->qo[r + 1] - c->qo[r];
        ps[n++] = (cas_attn_pass){c->kvp[r] + c->npre, c->npre * P, kvl - c->npre * P, rows, ql, -1};
        for (int i = 0; i < ql; i++) {
            ids[rows] = c->qo[r] + i;
            pos[rows] = kvl - ql + i;
            rows++;
        }
    }
    cas_attn_pass_list l;
    memset(&l, 0, sizeof l);
    l.params = c->params;
    l.num_pages = c->num_pages;
    l.total_q = c->total_q;
    l.n_passes = n;
    l.passes = ps;
    l.pages = c->idx;
    l.n_page_ids = c->kvp[c->B];
    l.tok_ids = ids;
    l.tok_pos = pos;
    l.n_tok_rows = rows;
    return l;
}

static void run_cascade_case(cas_dtype dt, int D, int Hq, int Hkv, int P, int window, int npre,
                             const char *label) {
    int qlen[6] = {1, 1, 8, 1, 3, 1}, kvlen[6];
    cas_rng rng;
    cas_rng_seed(&rng, 99 + (uint64_t)D + (uint64_t)window);
    for (int r = 0; r < 6; r++) kvlen[r] = npre * P + 1 + (int)cas_rng_range(&rng, 8, 300);
    cas_attn_params pr = cas_attn_params_default();
    pr.window_left = window;
    tcase c;
    REQUIRE(tcase_make(&c, &rng, dt, D, Hq, Hkv, P, 6, qlen, kvlen, npre, pr) == 0);
    cas_cuda_attn *a = ctx_for(&c.shape, c.total_q, c.B + 1, c.kvp[c.B]);
    REQUIRE(a);
    cas_attn_pass ps[8];
    int32_t ids[64], pos[64];
    const cas_attn_pass_list l = cascade_passes(&c, ps, ids, pos);
    cas_status st = run_list(a, &c, &l);
    CHECKF(st == CAS_OK, "plan and run: %s", cas_last_error());
    gate(&c, label, 1);
    cas_cuda_attn_destroy(a);
    tcase_free(&c);
}

static void test_cascade_passes(void) {
    run_cascade_case(CAS_BF16, 128, 32, 8, 16, -1, 40, "cascade bf16 D128 32:8 P16 prefix 640");
    if (quick >= 2) return;
    run_cascade_case(CAS_BF16, 128, 32, 8, 16, 50, 40, "cascade + window 50 (empty shared states)");
    if (!quick) {
        run_cascade_case(CAS_F16, 64, 8, 1, 5, -1, 300, "cascade f16 D64 8:1 P5 prefix 1500");
        run_cascade_case(CAS_BF16, 256, 4, 4, 64, -1, 20, "cascade bf16 D256 4:4 P64 prefix 1280");
        run_cascade_case(CAS_F16, 128, 32, 4, 5, -1, 301, "cascade f16 D128 32:4 P5 prefix 1505");
        run_cascade_case(CAS_BF16, 128, 24, 4, 16, -1, 40, "cascade bf16 D128 24:4 (group 6) prefix 640");
    }
}

/* ---- the gates catch a wrong run ------------------------------------------ */

/* At 1k and at 32k keys, flat decode rows and a cascade (a shared prefix
 * under 8 decode tails) each run three times: as planned (the gate passes),
 * with one 64-key tile of the longest pass missing (its pass split in two
 * around the hole: what a kernel that skipped a tile computes), and with one
 * page id of the longest pass one off (what a kernel that read the wrong
 * page computes); the reference is the correct batch's, and the gate must
 * fail both faults. */
static void fault_runs(tcase *c, cas_cuda_attn *a, cas_attn_pass_list l, const char *label) {
    char what[160];
    snprintf(what, sizeof what, "%s as planned", label);
    CHECKF(run_list(a, c, &l) == CAS_OK, "%s: %s", what, cas_last_error());
    gate(c, what, 1);
    /* the longest pass, and a tile in its middle (64 keys on a page boundary) */
    int32_t li = 0;
    for (int32_t i = 1; i < l.n_passes; i++)
        if (l.passes[i].len > l.passes[li].len) li = i;
    const cas_attn_pass p = l.passes[li];
    const int32_t P = c->shape.page_size, hole = (p.len / 2) / 64 * 64;
    cas_attn_pass *ps = malloc(sizeof *ps * (size_t)(l.n_passes + 1));
    memcpy(ps, l.passes, sizeof *ps * (size_t)l.n_passes);
    ps[li].len = hole;
    ps[l.n_passes] = (cas_attn_pass){p.page_off + (hole + 64) / P, p.pos0 + hole + 64, p.len - hole - 64,
                                     p.tok_off, p.n_tok, p.node};
    cas_attn_pass_list skip = l;
    skip.passes = ps;
    skip.n_passes = l.n_passes + 1;
    snprintf(what, sizeof what, "%s, keys %d..%d skipped", label, p.pos0 + hole, p.pos0 + hole + 63);
    CHECKF(run_list(a, c, &skip) == CAS_OK, "%s: %s", what, cas_last_error());
    gate(c, what, 0);
    free(ps);
    int32_t *pg = malloc(sizeof(int32_t) * (size_t)l.n_page_ids);
    memcpy(pg, l.pages, sizeof(int32_t) * (size_t)l.n_page_ids);
    const int64_t at = p.page_off + (p.len / P) / 2;
    pg[at] = (pg[at] + 1) % c->num_pages;
    cas_attn_pass_list off = l;
    off.pages = pg;
    snprintf(what, sizeof what, "%s, page %lld one id off", label, (long long)(at - p.page_off));
    CHECKF(run_list(a, c, &off) == CAS_OK, "%s: %s", what, cas_last_error());
    gate(c, what, 0);
    free(pg);
}

static void test_gates(void) {
    const int keys[2] = {1024, 32768};
    for (int ki = 0; ki < 2; ki++) {
        if (quick && ki) break;
        cas_rng rng;
        cas_rng_seed(&rng, 777 + (uint64_t)ki);
        const int K = keys[ki], P = 16;
        cas_attn_params pr = cas_attn_params_default();
        char label[96];
        /* flat: 4 decode rows over K keys each */
        {
            int qlen[4] = {1, 1, 1, 1}, kvlen[4] = {K, K - 5, K + 9, K - 100};
            tcase c;
            REQUIRE(tcase_make(&c, &rng, CAS_BF16, 128, 16, 4, P, 4, qlen, kvlen, 0, pr) == 0);
            cas_cuda_attn *a = ctx_for(&c.shape, c.total_q, 2 * c.B, c.kvp[c.B]);
            REQUIRE(a);
            cas_attn_pass ps[8];
            int32_t ids[16], pos[16];
            cas_attn_pass_list l = cascade_passes(&c, ps, ids, pos); /* npre 0: pass 0 is empty */
            l.passes = ps + 1;
            l.n_passes = c.B;
            snprintf(label, sizeof label, "gate flat %dk keys", K / 1024);
            fault_runs(&c, a, l, label);
            cas_cuda_attn_destroy(a);
            tcase_free(&c);
        }
        /* cascade: a K-key prefix under 8 decode tails of 40-300 keys */
        {
            int qlen[8], kvlen[8];
            for (int r = 0; r < 8; r++) qlen[r] = 1, kvlen[r] = K + 40 + (int)cas_rng_range(&rng, 0, 260);
            tcase c;
            REQUIRE(tcase_make(&c, &rng, CAS_BF16, 128, 16, 4, P, 8, qlen, kvlen, K / P, pr) == 0);
            cas_cuda_attn *a = ctx_for(&c.shape, c.total_q, c.B + 2, c.kvp[c.B]);
            REQUIRE(a);
            cas_attn_pass ps[12];
            int32_t ids[32], pos[32];
            const cas_attn_pass_list l = cascade_passes(&c, ps, ids, pos);
            snprintf(label, sizeof label, "gate cascade %dk-key prefix", K / 1024);
            fault_runs(&c, a, l, label);
            cas_cuda_attn_destroy(a);
            tcase_free(&c);
        }
    }
}

/* ---- the CPU planner's plan --------------------------------------------- */

static void test_cpu_plan(void) {
    int qlen[6] = {1, 1, 8, 1, 3, 1}, kvlen[6];
    cas_rng rng;
    cas_rng_seed(&rng, 7);
    for (int r = 0; r < 6; r++) kvlen[r] = 37 * 16 + 1 + (int)cas_rng_range(&rng, 8, 300);
    cas_attn_params pr = cas_attn_params_default();
    tcase c;
    REQUIRE(tcase_make(&c, &rng, CAS_BF16, 128, 32, 8, 16, 6, qlen, kvlen, 37, pr) == 0);
    cas_attn_plan_opts opts = cas_attn_plan_opts_default();
    opts.cascade = CAS_CASCADE_ALL;
    cas_attn_plan *plan = NULL;
    cas_status st = cas_attn_plan_create(&plan, &c.shape, &opts, c.B, c.total_q, c.kvp[c.B]);
    CHECKF(st == CAS_OK, "cpu plan create: %s", cas_last_error());
    cas_attn_batch b = tcase_batch(&c);
    if (st == CAS_OK) st = cas_attn_plan_build(plan, &b, c.num_pages, &pr);
    CHECKF(st == CAS_OK, "cpu plan build: %s", cas_last_error());
    cas_attn_pass_list l;
    memset(&l, 0, sizeof l);
    if (st == CAS_OK) cas_attn_plan_passes(plan, &l);
    CHECK(l.n_passes > c.B); /* the shared run is a pass of its own */
    if (st == CAS_OK && l.n_passes > 0) {
        cas_cuda_attn_caps caps = {0};
        cas_cuda_attn_caps_fit(&caps, plan);
        cas_cuda_attn_opts o = cas_cuda_attn_opts_default();
        o.kernel = kernel;
        cas_cuda_attn *a = NULL;
        st = cas_cuda_attn_create(&a, &c.shape, &caps, &o);
        CHECKF(st == CAS_OK, "create: %s", cas_last_error());
        if (a) {
            st = cas_cuda_attn_plan_from_cpu(a, plan);
            CHECKF(st == CAS_OK, "plan_from_cpu: %s", cas_last_error());
            poison(&c);
            cas_cuda_attn_upload(a, 0);
            CHECK(cas_cuda_attn_run(a, c.dk, c.dv, c.dq, c.dO, c.dL, 0) == CAS_OK);
            char what[96];
            snprintf(what, sizeof what, "CPU planner's plan (%d passes)", l.n_passes);
            gate(&c, what, 1);
            cas_cuda_attn_destroy(a);
        }
    }
    if (plan) cas_attn_plan_destroy(plan);
    tcase_free(&c);
}

/* ---- merges ------------------------------------------------------------- */

static void test_merge(void) {
    const int n = 3, D = 128;
    const int64_t rows = 37;
    cas_rng rng;
    cas_rng_seed(&rng, 5);
    size_t no = (size_t)n * rows * D, nl = (size_t)n * rows;
    float *o = malloc(no * 4), *l = malloc(nl * 4), *ro = malloc((size_t)rows * D * 4),
          *rl = malloc((size_t)rows * 4), *go = malloc((size_t)rows * D * 4), *gl = malloc((size_t)rows * 4);
    for (size_t i = 0; i < no; i++) o[i] = (float)cas_rng_normal(&rng);
    for (size_t i = 0; i < nl; i++) l[i] = (float)(cas_rng_normal(&rng) * 5);
    /* empty states: row 0 all empty, row 1 one empty, row 2 two empty */
    for (int i = 0; i < n; i++) l[i * rows + 0] = -INFINITY;
    l[0 * rows + 1] = -INFINITY;
    l[1 * rows + 2] = l[2 * rows + 2] = -INFINITY;
    const float *oi[3] = {o, o + rows * D, o + 2 * rows * D}, *li[3] = {l, l + rows, l + 2 * rows};
    cas_attn_merge_n(ro, rl, oi, li, n, rows, D);
    float *dO_in, *dL_in, *dO, *dL;
    CU(cudaMalloc((void **)&dO_in, no * 4));
    CU(cudaMalloc((void **)&dL_in, nl * 4));
    CU(cudaMalloc((void **)&dO, (size_t)rows * D * 4));
    CU(cudaMalloc((void **)&dL, (size_t)rows * 4));
    CU(cudaMemcpy(dO_in, o, no * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dL_in, l, nl * 4, cudaMemcpyHostToDevice));
    CHECK(cas_cuda_attn_merge_n(dO, dL, dO_in, dL_in, n, rows, D, 0) == CAS_OK);
    CU(cudaMemcpy(go, dO, (size_t)rows * D * 4, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(gl, dL, (size_t)rows * 4, cudaMemcpyDeviceToHost));
    double e = 0;
    int bad = 0;
    for (int64_t i = 0; i < rows * D; i++) {
        if (!isfinite(go[i])) bad++;
        else if (fabs(go[i] - ro[i]) > e) e = fabs(go[i] - ro[i]);
    }
    for (int64_t r = 0; r < rows; r++) {
        if (isinf(rl[r])) bad += !(isinf(gl[r]) && gl[r] < 0);
        else if (fabs(gl[r] - rl[r]) > 1e-4) bad++;
    }
    CHECKF(bad == 0 && e < 1e-5, "merge_n: bad %d err %g", bad, e);
    /* merge2 in place: out aliases a */
    cas_attn_merge2(ro, rl, oi[0], li[0], oi[1], li[1], rows, D);
    CHECK(cas_cuda_attn_merge2(dO_in, dL_in, dO_in, dL_in, dO_in + rows * D, dL_in + rows, rows, D, 0) == CAS_OK);
    CU(cudaMemcpy(go, dO_in, (size_t)rows * D * 4, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(gl, dL_in, (size_t)rows * 4, cudaMemcpyDeviceToHost));
    e = 0;
    bad = 0;
    for (int64_t i = 0; i < rows * D; i++) {
        if (!isfinite(go[i])) bad++;
        else if (fabs(go[i] - ro[i]) > e) e = fabs(go[i] - ro[i]);
    }
    for (int64_t r = 0; r < rows; r++) {
        if (isinf(rl[r])) bad += !(isinf(gl[r]) && gl[r] < 0);
        else if (fabs(gl[r] - rl[r]) > 1e-4) bad++;
    }
    CHECKF(bad == 0 && e < 1e-5, "merge2: bad %d err %g", bad, e);
    cudaFree(dO_in); cudaFree(dL_in); cudaFree(dO); cudaFree(dL);
    free(o); free(l); free(ro); free(rl); free(go); free(gl);
}

/* ---- CUDA graph: capture once, re-plan, replay -------------------------- */

static void test_graph_replan(void) {
    const cas_dtype dt = CAS_BF16;
    const int D = 128, Hq = 16, Hkv = 4, P = 16;
    cas_rng rng;
    cas_rng_seed(&rng, 2024);
    cas_attn_params pr = cas_attn_params_default();
    /* three batches, one context with capacities covering all of them */
    int qa[8] = {1, 1, 1, 4, 1, 1, 9, 1}, ka[8] = {100, 700, 33, 64, 1200, 5, 90, 2500};
    int qb[6] = {1, 1, 8, 1, 3, 1}, kb[6];
    for (int r = 0; r < 6; r++) kb[r] = 50 * 16 + 1 + (int)cas_rng_range(&rng, 8, 400);
    int qc[3] = {30, 1, 1}, kc[3] = {30, 4000, 17};
    tcase A, B, C;
    REQUIRE(tcase_make(&A, &rng, dt, D, Hq, Hkv, P, 8, qa, ka, 0, pr) == 0);
    REQUIRE(tcase_make(&B, &rng, dt, D, Hq, Hkv, P, 6, qb, kb, 50, pr) == 0);
    REQUIRE(tcase_make(&C, &rng, dt, D, Hq, Hkv, P, 3, qc, kc, 0, pr) == 0);
    /* the graph reads fixed buffers: q, pools and outputs of the largest case */
    int maxq = 64;
    size_t nq = (size_t)maxq * Hq * D;
    size_t maxpool = 0;
    tcase *cs[3] = {&A, &B, &C};
    for (int i = 0; i < 3; i++) {
        size_t p = (size_t)cs[i]->num_pages * P * Hkv * D * 2;
        if (p > maxpool) maxpool = p;
        REQUIRE(cs[i]->total_q <= maxq);
    }
    void *gk, *gv, *gq;
    float *gO, *gL;
    CU(cudaMalloc(&gk, maxpool));
    CU(cudaMalloc(&gv, maxpool));
    CU(cudaMalloc(&gq, nq * 2));
    CU(cudaMalloc((void **)&gO, nq * 4));
    CU(cudaMalloc((void **)&gL, (size_t)maxq * Hq * 4));
    cas_cuda_attn_caps caps = {0};
    caps.max_total_q = maxq;
    caps.max_passes = 16;
    caps.max_tok_rows = 2 * maxq;
    caps.max_page_ids = 4096;
    cas_cuda_attn_opts o = cas_cuda_attn_opts_default();
    o.kernel = kernel;
    cas_cuda_attn *a = NULL;
    REQUIRE(cas_cuda_attn_create(&a, &A.shape, &caps, &o) == CAS_OK);
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    for (int i = 0; i < 3; i++) {
        tcase *c = cs[i];
        cas_attn_batch b = tcase_batch(c);
        cas_status st;
        if (c->npre) {
            cas_attn_pass ps[8];
            int32_t ids[64], pos[64];
            const cas_attn_pass_list l = cascade_passes(c, ps, ids, pos);
            st = cas_cuda_attn_plan_passes(a, &l);
        } else {
            st = cas_cuda_attn_plan_flat(a, &b, c->num_pages, &pr);
        }
        CHECKF(st == CAS_OK, "plan %d: %s", i, cas_last_error());
        size_t pool = (size_t)c->num_pages * P * Hkv * D * 2;
        CU(cudaMemcpyAsync(gk, c->dk, pool, cudaMemcpyDeviceToDevice, s));
        CU(cudaMemcpyAsync(gv, c->dv, pool, cudaMemcpyDeviceToDevice, s));
        CU(cudaMemcpyAsync(gq, c->dq, (size_t)c->total_q * Hq * D * 2, cudaMemcpyDeviceToDevice, s));
        CU(cudaMemsetAsync(gO, 0xff, nq * 4, s));
        CU(cudaMemsetAsync(gL, 0xff, (size_t)maxq * Hq * 4, s));
        CHECK(cas_cuda_attn_upload(a, s) == CAS_OK);
        if (i == 0) {
            CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            st = cas_cuda_attn_run(a, gk, gv, gq, gO, gL, s);
            CHECKF(st == CAS_OK, "run in capture: %s", cas_last_error());
            CU(cudaStreamEndCapture(s, &graph));
            CU(cudaGraphInstantiate(&exec, graph, 0));
        }
        CU(cudaGraphLaunch(exec, s));
        CU(cudaStreamSynchronize(s));
        CU(cudaMemcpy(c->dO, gO, (size_t)c->total_q * Hq * D * 4, cudaMemcpyDeviceToDevice));
        CU(cudaMemcpy(c->dL, gL, (size_t)c->total_q * Hq * 4, cudaMemcpyDeviceToDevice));
        char what[64];
        snprintf(what, sizeof what, "graph replay %d (%s, B=%d)", i, c->npre ? "cascade" : "flat", c->B);
        gate(c, what, 1);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
    cas_cuda_attn_destroy(a);
    cudaFree(gk); cudaFree(gv); cudaFree(gq); cudaFree(gO); cudaFree(gL);
    tcase_free(&A);
    tcase_free(&B);
    tcase_free(&C);
}

static void test_rejects(void) {
    cas_attn_shape s = {8, 8, 128, 16, CAS_F32};
    cas_cuda_attn_caps caps = {0};
    caps.max_total_q = caps.max_passes = caps.max_tok_rows = 4;
    caps.max_page_ids = 4;
    cas_cuda_attn *a = NULL;
    CHECK(cas_cuda_attn_create(&a, &s, &caps, NULL) == CAS_ERR_UNSUPPORTED);
    s.kv_dtype = CAS_BF16;
    s.head_dim = 80;
    CHECK(cas_cuda_attn_create(&a, &s, &caps, NULL) == CAS_ERR_UNSUPPORTED);
    s.head_dim = 128;
    REQUIRE(cas_cuda_attn_create(&a, &s, &caps, NULL) == CAS_OK);
    int32_t qo[3] = {0, 1, 2}, kvp[3] = {0, 1, 2}, idx[2] = {0, 9}, last[2] = {16, 16};
    cas_attn_batch b = {2, qo, kvp, idx, last};
    cas_attn_params pr = cas_attn_params_default();
    CHECK(cas_cuda_attn_plan_flat(a, &b, 4, &pr) == CAS_ERR_INVALID); /* page 9 outside pool */
    int32_t qo5[6] = {0, 1, 2, 3, 4, 5}, kvp5[6] = {0, 1, 2, 3, 4, 5}, idx5[5] = {0}, last5[5] = {1, 1, 1, 1, 1};
    cas_attn_batch b5 = {5, qo5, kvp5, idx5, last5};
    CHECK(cas_cuda_attn_plan_flat(a, &b5, 4, &pr) == CAS_ERR_NOMEM); /* over capacity */
    cas_cuda_attn_destroy(a);
}

int main(int argc, char **argv) {
    int ndev = 0;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--quick") && i + 1 < argc) quick = atoi(argv[++i]);
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("skip: no CUDA device\n");
        return check_summary();
    }
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
    RUN(test_rejects);
    RUN(test_merge);
    /* the default many-rows kernel (wgmma on Hopper), then mma.sync forced
     * where the default is another */
    const cas_cuda_kernel kernels[2] = {CAS_CUDA_KERNEL_AUTO, CAS_CUDA_KERNEL_MMA_SYNC};
    cas_cuda_kernel first = CAS_CUDA_KERNEL_AUTO;
    for (int k = 0; k < 2; k++) {
        kernel = kernels[k];
        cas_attn_shape probe = {32, 8, 128, 16, CAS_BF16};
        cas_cuda_attn *a = ctx_for(&probe, 4, 4, 64);
        if (!a) {
            printf("FAIL: context for kernel %d\n", (int)kernel);
            return 1;
        }
        const cas_cuda_kernel got = cas_cuda_attn_kernel(a);
        const char *name = cas_cuda_attn_kernel_name(a);
        cas_cuda_attn_destroy(a);
        if (k == 0) first = got;
        else if (got == first) break; /* no wgmma here: the default was mma.sync already */
        printf("== many-rows kernel %s (head_dim 128; other head_dims run mma.sync)\n", name);
        RUN(test_flat_grid);
        RUN(test_cascade_passes);
        RUN(test_page_runs);
        RUN(test_gates);
        if (quick < 2) {
            RUN(test_cpu_plan);
            RUN(test_graph_replan);
        }
    }
    return check_summary();
}
