/*
 * cmd_attn_bench.c: `cascade attn-bench`. Builds a random paged batch with a
 * sharing structure, runs flat (no cascade) and cascade attention through the
 * same kernel, checks both against the float64 reference (every row of a
 * sample of requests, each row's error over its norm: cas_attn_check_rows),
 * times them (warm-up, median of repeats) and reports achieved
 * bandwidth and FLOP/s next to the machine's ceilings measured in the same
 * run. `--dump DIR` writes NumPy files so the result can be checked without
 * this code.
 *
 * `--backend cuda` (a `make CUDA=1` build) runs the same batch through the
 * CUDA backend (src/cuda): the CPU planner's flat and cascade plans (with
 * the GPU's cost numbers) on the device, every row of every output checked
 * against the float64 reference computed on the device, timed with CUDA
 * events (CUDA-graph replay of one run, warm-up, median), next to the
 * ceilings measured in the same run there (device-to-device copy, cuBLAS
 * bf16 product).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../attn/attn.h"
#include "tools.h"
#if CAS_WITH_CUDA
#include "../cuda/cuda_attn.h"
#endif

typedef struct {
    int32_t batch, prefix, suffix, qlen, hq, hkv, head_dim, page_size, threads, repeats, warmup,
        check_requests, window, causal;
    float soft_cap;
    cas_dtype dtype;
    const char *tree, *dump, *backend, *kernel;
    int json, print_plan, calibrate, dtype_set, huge_pages, bf16_dot, amx_off;
    cas_simd_level simd;
    uint64_t seed;
} bench_opts;

static void usage(FILE *f) {
    fprintf(f,
            "usage: cascade attn-bench [options]\n"
            "  --batch N          requests (default 32)\n"
            "  --prefix N         tokens shared by all requests (default 8192)\n"
            "  --suffix N         private tokens per request (default 256)\n"
            "  --qlen N           queries per request, 1 = decode (default 1)\n"
            "  --heads HQ:HKV     query and KV heads (default 32:8)\n"
            "  --head-dim D       64, 96, 128 or 256 (default 128)\n"
            "  --page-size N      tokens per page, 1..256 (default 16)\n"
            "  --dtype T          KV storage: f32, f16 or bf16 (default f32; bf16 on cuda)\n"
            "  --backend B        cpu or cuda (cuda: a `make CUDA=1` build; default cpu)\n"
            "  --kernel K         cuda: the many-rows kernel, auto, wgmma or mma.sync (default auto)\n"
            "  --tree SPEC        multi-level sharing instead of --batch/--prefix:\n"
            "                     groups 'N*T' joined by '+', each optionally followed by\n"
            "                     '(sub-groups)'; N requests share T more tokens. Example:\n"
            "                     '40*1024(20*512)+10*768': 40 share 1024 tokens, 20 of them\n"
            "                     512 more, 10 others share 768; each then has --suffix own\n"
            "  --window N         sliding window (keys p-N..p); default off\n"
            "  --soft-cap X       logits soft cap; default off\n"
            "  --non-causal       every query sees all of its request's KV\n"
            "  --threads N        CPU threads (default: all cores)\n"
            "  --repeats N        timed runs per variant, median reported (default 10)\n"
            "  --warmup N         untimed runs first (default 2)\n"
            "  --check N          cpu: requests checked against the float64 reference, every row of\n"
            "                     each (default 8, 0 = none); cuda: 0 = none, else every row\n"
            "  --seed N           random seed (default 1)\n"
            "  --huge-pages       K and V pools in transparent huge pages (default: 4 KB pages)\n"
            "  --simd LEVEL       cpu: the kernels' SIMD level, generic, avx2 or avx512 (default: the\n"
            "                     widest this CPU has; a level it lacks is refused)\n"
            "  --no-amx           cpu: no AMX-BF16 tiles for --bf16-dot (AVX512_BF16 instructions)\n"
            "  --bf16-dot         bf16 KV on CPUs with AVX512_BF16: Q and P rounded to bf16, the\n"
            "                     bf16 dot-product instruction (cas_attn_plan_opts.bf16_dot)\n"
            "  --plan             print the cascade plan\n"
            "  --calibrate        measure the cost model's numbers for this shape and print them\n"
            "  --json             print one JSON object\n"
            "  --dump DIR         write q, pages, indptrs, outputs and lse as .npy files\n");
}

static int parse_int_arg(const char *s, int32_t *out, int32_t lo, int32_t hi, const char *name) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi) {
        fprintf(stderr, "attn-bench: %s must be an integer in %d..%d (got '%s')\n", name, lo, hi, s);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static int parse_opts(int argc, char **argv, bench_opts *o) {
    memset(o, 0, sizeof *o);
    o->batch = 32, o->prefix = 8192, o->suffix = 256, o->qlen = 1, o->hq = 32, o->hkv = 8;
    o->head_dim = 128, o->page_size = 16, o->threads = 0, o->repeats = 10, o->warmup = 2;
    o->check_requests = 8, o->window = -1, o->causal = 1, o->dtype = CAS_F32, o->seed = 1;
    o->backend = "cpu";
    o->kernel = "auto";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEEDV                                                                                      \
    do {                                                                                           \
        if (!v) {                                                                                  \
            fprintf(stderr, "attn-bench: %s needs a value\n", a);                                  \
            return -1;                                                                             \
        }                                                                                          \
        i++;                                                                                       \
    } while (0)
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(a, "--batch")) {
            NEEDV;
            if (parse_int_arg(v, &o->batch, 1, 1 << 20, a)) return -1;
        } else if (!strcmp(a, "--prefix")) {
            NEEDV;
            if (parse_int_arg(v, &o->prefix, 0, 1 << 24, a)) return -1;
        } else if (!strcmp(a, "--suffix")) {
            NEEDV;
            if (parse_int_arg(v, &o->suffix, 0, 1 << 24, a)) return -1;
        } else if (!strcmp(a, "--qlen")) {
            NEEDV;
            if (parse_int_arg(v, &o->qlen, 1, 1 << 20, a)) return -1;
        } else if (!strcmp(a, "--heads")) {
            NEEDV;
            if (sscanf(v, "%d:%d", &o->hq, &o->hkv) != 2 || o->hq < 1 || o->hkv < 1) {
                fprintf(stderr, "attn-bench: --heads wants HQ:HKV, e.g. 32:8\n");
                return -1;
            }
        } else if (!strcmp(a, "--head-dim")) {
            NEEDV;
            if (parse_int_arg(v, &o->head_dim, 1, 1024, a)) return -1;
        } else if (!strcmp(a, "--page-size")) {
            NEEDV;
            if (parse_int_arg(v, &o->page_size, 1, CAS_ATTN_MAX_PAGE_SIZE, a)) return -1;
        } else if (!strcmp(a, "--dtype")) {
            NEEDV;
            if (cas_dtype_parse(v, &o->dtype)) {
                fprintf(stderr, "attn-bench: --dtype is f32, f16 or bf16\n");
                return -1;
            }
            o->dtype_set = 1;
        } else if (!strcmp(a, "--tree")) {
            NEEDV;
            o->tree = v;
        } else if (!strcmp(a, "--window")) {
            NEEDV;
            if (parse_int_arg(v, &o->window, 0, 1 << 24, a)) return -1;
        } else if (!strcmp(a, "--soft-cap")) {
            NEEDV;
            o->soft_cap = strtof(v, NULL);
            if (!(o->soft_cap > 0)) {
                fprintf(stderr, "attn-bench: --soft-cap must be > 0\n");
                return -1;
            }
        } else if (!strcmp(a, "--non-causal")) {
            o->causal = 0;
        } else if (!strcmp(a, "--threads")) {
            NEEDV;
            if (parse_int_arg(v, &o->threads, 1, 1024, a)) return -1;
        } else if (!strcmp(a, "--repeats")) {
            NEEDV;
            if (parse_int_arg(v, &o->repeats, 1, 100000, a)) return -1;
        } else if (!strcmp(a, "--warmup")) {
            NEEDV;
            if (parse_int_arg(v, &o->warmup, 0, 100000, a)) return -1;
        } else if (!strcmp(a, "--check")) {
            NEEDV;
            if (parse_int_arg(v, &o->check_requests, 0, 1 << 20, a)) return -1;
        } else if (!strcmp(a, "--seed")) {
            NEEDV;
            o->seed = strtoull(v, NULL, 10);
        } else if (!strcmp(a, "--backend")) {
            NEEDV;
            o->backend = v;
        } else if (!strcmp(a, "--kernel")) {
            NEEDV;
            o->kernel = v;
            if (strcmp(v, "auto") && strcmp(v, "wgmma") && strcmp(v, "mma.sync")) {
                fprintf(stderr, "attn-bench: --kernel is auto, wgmma or mma.sync\n");
                return -1;
            }
        } else if (!strcmp(a, "--huge-pages")) {
            o->huge_pages = 1;
        } else if (!strcmp(a, "--bf16-dot")) {
            o->bf16_dot = 1;
        } else if (!strcmp(a, "--no-amx")) {
            o->amx_off = 1;
        } else if (!strcmp(a, "--simd")) {
            NEEDV;
            if (cas_simd_parse(v, &o->simd)) {
                fprintf(stderr, "attn-bench: --simd is generic, avx2 or avx512 (got '%s')\n", v);
                return -1;
            }
        } else if (!strcmp(a, "--calibrate")) {
            o->calibrate = 1;
        } else if (!strcmp(a, "--plan")) {
            o->print_plan = 1;
        } else if (!strcmp(a, "--json")) {
            o->json = 1;
        } else if (!strcmp(a, "--dump")) {
            NEEDV;
            o->dump = v;
        } else {
            fprintf(stderr, "attn-bench: unknown option '%s'\n", a);
            usage(stderr);
            return -1;
        }
#undef NEEDV
    }
    if (!strcmp(o->backend, "cuda")) {
#if CAS_WITH_CUDA
        if (!o->dtype_set) o->dtype = CAS_BF16;
        if (o->dtype == CAS_F32) {
            fprintf(stderr, "attn-bench: --backend cuda takes --dtype bf16 or f16\n");
            return -1;
        }
        if (o->calibrate) {
            fprintf(stderr, "attn-bench: --calibrate measures the CPU backend only\n");
            return -1;
        }
#else
        fprintf(stderr, "attn-bench: --backend cuda: built without CUDA (rebuild with make CUDA=1)\n");
        return -1;
#endif
    } else if (strcmp(o->backend, "cpu")) {
        fprintf(stderr, "attn-bench: --backend is cpu or cuda (got '%s')\n", o->backend);
        return -1;
    }
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median seconds of `repeats` runs after `warmup`; *best gets the fastest
 * (the ceilings are best-of runs too: on a shared machine compare like with
 * like). */
static double time_runs(cas_attn_plan *plan, const cas_kv_pool *pool, const float *q, float *o,
                        float *lse, int warmup, int repeats, double *best, cas_status *st) {
    double *t = malloc(sizeof(double) * (size_t)repeats);
    *st = CAS_OK;
    for (int i = 0; i < warmup && !*st; i++) *st = cas_attn_plan_run(plan, pool, q, o, lse);
    for (int i = 0; i < repeats && !*st; i++) {
        double t0 = cas_now_s();
        *st = cas_attn_plan_run(plan, pool, q, o, lse);
        t[i] = cas_now_s() - t0;
    }
    qsort(t, (size_t)repeats, sizeof(double), cmp_double);
    double med = repeats % 2 ? t[repeats / 2] : 0.5 * (t[repeats / 2 - 1] + t[repeats / 2]);
    *best = t[0];
    free(t);
    return med;
}

/* The worst row's relative error (cas_attn_check_rows) over a sample of
 * requests, every row of each; *bad: the rows over tol. The reference runs on
 * a sub-batch made of those requests (same pages), so big batches stay cheap. */
static double check_sample(const cas_attn_shape *shape, const cas_attn_synth *s,
                           const cas_attn_params *prm, const float *out, int32_t n_check,
                           uint64_t seed, double tol, int64_t *bad, cas_status *st) {
    const int32_t Hq = shape->num_qo_heads, D = shape->head_dim;
    int32_t n = n_check < s->batch ? n_check : s->batch;
    *st = CAS_OK;
    *bad = 0;
    if (n <= 0) return NAN;
    int32_t *req = malloc(sizeof(int32_t) * (size_t)n);
    cas_rng rng;
    cas_rng_seed(&rng, seed);
    for (int32_t i = 0; i < n; i++) {
        /* the first and last requests, then random ones */
        req[i] = i == 0 ? 0 : i == 1 ? s->batch - 1 : (int32_t)cas_rng_range(&rng, 0, s->batch - 1);
    }
    int32_t *qo = calloc((size_t)n + 1, 4), *kv = calloc((size_t)n + 1, 4), *last = calloc((size_t)n, 4);
    int64_t npg = 0, nq = 0;
    for (int32_t i = 0; i < n; i++) {
        npg += s->kv_indptr[req[i] + 1] - s->kv_indptr[req[i]];
        nq += s->qo_indptr[req[i] + 1] - s->qo_indptr[req[i]];
    }
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(npg + 1));
    float *q = malloc(sizeof(float) * (size_t)(nq * Hq * D + 1));
    double *oref = malloc(sizeof(double) * (size_t)(nq * Hq * D + 1));
    double worst = 0;
    if (!qo || !kv || !last || !idx || !q || !oref) {
        *st = cas_error(CAS_ERR_NOMEM, "attn-bench: out of memory for the check");
        goto done;
    }
    for (int32_t i = 0; i < n; i++) {
        int32_t r = req[i];
        int32_t np = s->kv_indptr[r + 1] - s->kv_indptr[r], ql = s->qo_indptr[r + 1] - s->qo_indptr[r];
        memcpy(idx + kv[i], s->kv_indices + s->kv_indptr[r], sizeof(int32_t) * (size_t)np);
        kv[i + 1] = kv[i] + np;
        memcpy(q + (size_t)qo[i] * Hq * D, s->q + (size_t)s->qo_indptr[r] * Hq * D,
               sizeof(float) * (size_t)ql * Hq * D);
        qo[i + 1] = qo[i] + ql;
        last[i] = s->kv_last_page_len[r];
    }
    cas_attn_batch sub = {n, qo, kv, idx, last};
    cas_kv_pool pool = cas_attn_synth_pool(s);
    *st = cas_attn_reference(shape, &pool, &sub, prm, q, oref, NULL);
    if (*st) goto done;
    for (int32_t i = 0; i < n; i++) {
        cas_attn_check ck;
        cas_attn_check_rows(out + (size_t)s->qo_indptr[req[i]] * Hq * D, NULL, oref + (size_t)qo[i] * Hq * D, NULL,
                            (int64_t)(qo[i + 1] - qo[i]) * Hq, D, tol, 0, &ck);
        *bad += ck.bad_rows;
        if (!(ck.max_rel <= worst)) worst = ck.max_rel;
    }
done:
    free(req), free(qo), free(kv), free(last), free(idx), free(q), free(oref);
    return worst;
}

static cas_status dump_all(const char *dir, const cas_attn_shape *shape, const cas_attn_synth *s,
                           const cas_attn_params *prm, const float *o_flat, const float *o_casc,
                           const float *lse) {
    if (mkdir(dir, 0755) && errno != EEXIST) return cas_error(CAS_ERR_IO, "attn-bench: cannot create %s", dir);
    char path[4096];
    const int64_t Hq = shape->num_qo_heads, Hkv = shape->num_kv_heads, D = shape->head_dim,
                  P = shape->page_size;
    cas_status st = CAS_OK;
#define NPY(name, dt, nd, data, ...)                                                              \
    do {                                                                                          \
        int64_t shp[] = {__VA_ARGS__};                                                            \
        snprintf(path, sizeof path, "%s/%s", dir, name);                                          \
        if (!st) st = cas_npy_write(path, dt, shp, nd, data);                                     \
    } while (0)
    NPY("q.npy", "<f4", 3, s->q, s->total_q, Hq, D);
    size_t elems = (size_t)s->num_pages * (size_t)(P * Hkv * D);
    float *up = malloc(sizeof(float) * (elems + 1));
    if (!up) return cas_error(CAS_ERR_NOMEM, "attn-bench: out of memory for the dump");
    const void *pools[2] = {s->k, s->v};
    const char *names[2] = {"k_pages.npy", "v_pages.npy"};
    for (int w = 0; w < 2; w++) {
        for (size_t i = 0; i < elems; i++) {
            if (shape->kv_dtype == CAS_F32) up[i] = ((const float *)pools[w])[i];
            else if (shape->kv_dtype == CAS_F16) up[i] = cas_f16_to_f32(((const uint16_t *)pools[w])[i]);
            else up[i] = cas_bf16_to_f32(((const uint16_t *)pools[w])[i]);
        }
        NPY(names[w], "<f4", 4, up, s->num_pages, P, Hkv, D);
    }
    free(up);
    NPY("qo_indptr.npy", "<i4", 1, s->qo_indptr, s->batch + 1);
    NPY("kv_indptr.npy", "<i4", 1, s->kv_indptr, s->batch + 1);
    NPY("kv_indices.npy", "<i4", 1, s->kv_indices, s->kv_indptr[s->batch]);
    NPY("kv_last_page_len.npy", "<i4", 1, s->kv_last_page_len, s->batch);
    NPY("out_flat.npy", "<f4", 3, o_flat, s->total_q, Hq, D);
    NPY("out_cascade.npy", "<f4", 3, o_casc, s->total_q, Hq, D);
    NPY("lse.npy", "<f4", 2, lse, s->total_q, Hq);
#undef NPY
    if (st) return st;
    snprintf(path, sizeof path, "%s/meta.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) return cas_error(CAS_ERR_IO, "attn-bench: cannot write %s", path);
    fprintf(f, "{\"sm_scale\": %.9g, \"causal\": %s, \"page_size\": %d, \"num_qo_heads\": %d, "
               "\"num_kv_heads\": %d, \"head_dim\": %d, \"kv_dtype\": \"%s\"",
            prm->sm_scale > 0 ? prm->sm_scale : 1.0 / sqrt((double)D), prm->causal ? "true" : "false",
            shape->page_size, shape->num_qo_heads, shape->num_kv_heads, shape->head_dim,
            cas_dtype_name(shape->kv_dtype));
    if (prm->logits_soft_cap > 0) fprintf(f, ", \"logits_soft_cap\": %.9g", prm->logits_soft_cap);
    if (prm->window_left >= 0) fprintf(f, ", \"window_left\": %d", prm->window_left);
    fprintf(f, "}\n");
    if (fclose(f)) return cas_error(CAS_ERR_IO, "attn-bench: cannot write %s", path);
    return CAS_OK;
}

/* A number for JSON: null when not measured (NaN). */
static const char *num_or_null(char *buf, double v) {
    if (isnan(v)) return "null";
    snprintf(buf, 32, "%.3e", v);
    return buf;
}

/* Useful FLOPs: 4 * D per (query row, visible key): QK^T and PV. */
static double useful_flops(const cas_attn_shape *shape, const cas_attn_synth *s, const cas_attn_params *prm) {
    double keys = 0;
    for (int32_t r = 0; r < s->batch; r++) {
        int64_t kv_len = (int64_t)(s->kv_indptr[r + 1] - s->kv_indptr[r] - 1) * shape->page_size +
                         s->kv_last_page_len[r];
        int32_t ql = s->qo_indptr[r + 1] - s->qo_indptr[r];
        for (int32_t i = 0; i < ql; i++) {
            int64_t pos = kv_len - ql + i;
            int64_t hi = prm->causal ? pos : kv_len - 1;
            int64_t lo = prm->window_left >= 0 ? pos - prm->window_left : 0;
            if (lo < 0) lo = 0;
            if (hi >= lo) keys += (double)(hi - lo + 1);
        }
    }
    return 4.0 * shape->head_dim * shape->num_qo_heads * keys;
}

/* The bytes a run must fetch from memory: every distinct KV token that some
 * query sees (a shared page once, however many requests read it) as K and V
 * of every KV head, plus q, o and lse. A flat run reads a shared prefix once
 * per request, but the repeats come from the caches: bandwidth over these
 * bytes stays under the memory's. */
static double fetched_bytes(const cas_attn_shape *shape, const cas_attn_synth *s, const cas_attn_params *prm,
                            size_t q_elem_bytes) {
    const int64_t P = shape->page_size, rows = (int64_t)s->num_pages * P;
    unsigned char *seen = calloc((size_t)rows + 1, 1);
    int64_t n = 0;
    for (int32_t r = 0; seen && r < s->batch; r++) {
        const int64_t kv_len = (int64_t)(s->kv_indptr[r + 1] - s->kv_indptr[r] - 1) * P + s->kv_last_page_len[r];
        const int32_t ql = s->qo_indptr[r + 1] - s->qo_indptr[r];
        /* the keys the request's queries see: [lo, hi) */
        int64_t lo = prm->window_left >= 0 ? kv_len - ql - prm->window_left : 0, hi = kv_len;
        if (lo < 0) lo = 0;
        for (int64_t j = lo; j < hi; j++) {
            const int64_t row = (int64_t)s->kv_indices[s->kv_indptr[r] + j / P] * P + j % P;
            n += !seen[row];
            seen[row] = 1;
        }
    }
    free(seen);
    const double tok = 2.0 * shape->num_kv_heads * shape->head_dim * (double)cas_dtype_size(shape->kv_dtype);
    const double nq = (double)s->total_q * shape->num_qo_heads;
    return (double)n * tok + nq * shape->head_dim * ((double)q_elem_bytes + 4.0) + nq * 4.0;
}

#if CAS_WITH_CUDA
/* ---- --backend cuda ------------------------------------------------------ */

#define CUDA_OK(call) CAS_CUDA_TRY(call, out)

/* The same batch, plans and checks as the CPU path, run by the CUDA backend.
 * q is rounded to the storage type first (the tensor cores take it so), and
 * the reference is computed from the rounded q. */
static int run_cuda(const bench_opts *o, const cas_attn_shape *shape, const cas_attn_params *prm) {
    enum { NV = 3 }; /* flat, cascade (cost model), cascade of every shared run */
    static const char *names[NV] = {"flat", "cascade", "cascade_all"};
    static const cas_cascade_mode modes[NV] = {CAS_CASCADE_OFF, CAS_CASCADE_AUTO, CAS_CASCADE_ALL};
    cas_attn_synth s;
    memset(&s, 0, sizeof s);
    cas_attn_plan *plan[NV] = {NULL, NULL, NULL};
    cas_cuda_attn *ctx = NULL;
    void *dk = NULL, *dv = NULL, *dq = NULL;
    float *dO = NULL, *dL = NULL, *out[NV] = {NULL, NULL, NULL}, *lse = NULL;
    uint16_t *q16 = NULL;
    cudaStream_t stream = NULL;
    double t_graph[NV] = {0}, t_eager[NV] = {0}, err[NV] = {0}, t_plan[NV] = {0};
    int64_t bad[NV] = {0};
    double *ref_o = NULL, *ref_l = NULL;
    cas_attn_plan_info info[NV];
    int rc = 1;
    cas_status st = cas_attn_synth_create(&s, shape, o->tree, o->batch, o->prefix, o->suffix,
                                          o->qlen, o->seed);
    if (st) {
        fprintf(stderr, "attn-bench: %s\n", cas_last_error());
        return 2;
    }
    const int32_t Hq = shape->num_qo_heads, D = shape->head_dim;
    const size_t no = (size_t)s.total_q * Hq * D, nl = (size_t)s.total_q * Hq;
    const size_t pool_bytes = (size_t)s.num_pages * shape->page_size * shape->num_kv_heads * D * 2;
    q16 = malloc(no * 2 + 2);
    if (!q16) {
        st = cas_error(CAS_ERR_NOMEM, "attn-bench: out of memory");
        goto out;
    }
    for (size_t i = 0; i < no; i++) {
        q16[i] = shape->kv_dtype == CAS_BF16 ? cas_f32_to_bf16(s.q[i]) : cas_f32_to_f16(s.q[i]);
        s.q[i] = shape->kv_dtype == CAS_BF16 ? cas_bf16_to_f32(q16[i]) : cas_f16_to_f32(q16[i]);
    }
    cas_attn_batch b = cas_attn_synth_batch(&s);
    cas_attn_plan_opts po = cas_attn_plan_opts_default();
    po.threads = o->threads;
    po.cost = cas_cuda_attn_cost();
    cas_cuda_attn_caps caps;
    memset(&caps, 0, sizeof caps);
    for (int m = 0; m < NV; m++) {
        po.cascade = modes[m];
        double t0 = cas_now_s();
        st = cas_attn_plan_create(&plan[m], shape, &po, 0, 0, 0);
        if (!st) st = cas_attn_plan_build(plan[m], &b, s.num_pages, prm);
        t_plan[m] = cas_now_s() - t0;
        if (st) goto out;
        cas_attn_plan_get_info(plan[m], &info[m]);
        cas_cuda_attn_caps_fit(&caps, plan[m]);
        out[m] = cas_alloc_array(no + 1, 4);
        if (!out[m]) {
            st = cas_error(CAS_ERR_NOMEM, "attn-bench: out of memory for outputs");
            goto out;
        }
    }
    if (o->print_plan) cas_attn_plan_print(plan[1], stderr);
    lse = cas_alloc_array(nl + 1, 4);
    if (!lse) {
        st = cas_error(CAS_ERR_NOMEM, "attn-bench: out of memory for outputs");
        goto out;
    }
    double peak_gbps = 0, peak_tflops = 0;
    if ((st = cas_cuda_measure_copy(0, &peak_gbps))) goto out;
    if ((st = cas_cuda_measure_gemm(0, 8192, &peak_tflops))) goto out;
    cas_cuda_attn_opts co = cas_cuda_attn_opts_default();
    co.kernel = !strcmp(o->kernel, "wgmma") ? CAS_CUDA_KERNEL_WGMMA
                : !strcmp(o->kernel, "mma.sync") ? CAS_CUDA_KERNEL_MMA_SYNC : CAS_CUDA_KERNEL_AUTO;
    if ((st = cas_cuda_attn_create(&ctx, shape, &caps, &co))) goto out;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_OK(cudaMalloc(&dk, pool_bytes + 16));
    CUDA_OK(cudaMalloc(&dv, pool_bytes + 16));
    CUDA_OK(cudaMalloc(&dq, no * 2 + 16));
    CUDA_OK(cudaMalloc((void **)&dO, no * 4 + 16));
    CUDA_OK(cudaMalloc((void **)&dL, nl * 4 + 16));
    CUDA_OK(cudaMemcpy(dk, s.k, pool_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dv, s.v, pool_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dq, q16, no * 2, cudaMemcpyHostToDevice));
    if (o->check_requests) {
        /* the float64 reference of every row, on the device */
        double *dro = NULL, *drl = NULL;
        ref_o = malloc(no * 8 + 8);
        ref_l = malloc(nl * 8 + 8);
        if (!ref_o || !ref_l) {
            st = cas_error(CAS_ERR_NOMEM, "attn-bench: out of memory for the reference");
            goto out;
        }
        CUDA_OK(cudaMalloc((void **)&dro, no * 8 + 8));
        CUDA_OK(cudaMalloc((void **)&drl, nl * 8 + 8));
        st = cas_cuda_attn_reference(shape, dk, dv, s.num_pages, &b, prm, dq, dro, drl);
        if (!st && (cudaMemcpy(ref_o, dro, no * 8, cudaMemcpyDeviceToHost) ||
                    cudaMemcpy(ref_l, drl, nl * 8, cudaMemcpyDeviceToHost)))
            st = cas_error(CAS_ERR_INTERNAL, "attn-bench: copying the reference back failed");
        cudaFree(dro);
        cudaFree(drl);
        if (st) goto out;
    }
    const double tol = shape->kv_dtype == CAS_BF16 ? CAS_ATTN_TOL_BF16 : CAS_ATTN_TOL_F16;
    for (int m = 0; m < NV; m++) {
        if ((st = cas_cuda_attn_plan_from_cpu(ctx, plan[m]))) goto out;
        if ((st = cas_cuda_attn_upload(ctx, stream))) goto out;
        CUDA_OK(cudaMemsetAsync(dO, 0xff, no * 4, stream)); /* NaN: every element must be written */
        if ((st = cas_cuda_attn_run(ctx, dk, dv, dq, dO, dL, stream))) goto out;
        CUDA_OK(cudaStreamSynchronize(stream));
        CUDA_OK(cudaMemcpy(out[m], dO, no * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(lse, dL, nl * 4, cudaMemcpyDeviceToHost));
        err[m] = NAN;
        if (ref_o) {
            cas_attn_check ck;
            cas_attn_check_rows(out[m], lse, ref_o, ref_l, (int64_t)nl, D, tol, CAS_ATTN_TOL_LSE, &ck);
            err[m] = ck.max_rel;
            bad[m] = ck.bad_rows;
        }
        if ((st = cas_cuda_attn_time(ctx, dk, dv, dq, dO, dL, stream, o->warmup, o->repeats, 1, 0,
                                     &t_graph[m])))
            goto out;
        if ((st = cas_cuda_attn_time(ctx, dk, dv, dq, dO, dL, stream, o->warmup, o->repeats, 0, 0,
                                     &t_eager[m])))
            goto out;
        t_graph[m] *= 1e-3;
        t_eager[m] *= 1e-3;
    }
    if (o->dump && (st = dump_all(o->dump, shape, &s, prm, out[0], out[1], lse))) goto out;
    /* the host side of a step with the cost model's plan: the CPU planner
     * rebuilt on the batch, then the CUDA planner and the upload (enqueued;
     * the next plan waits for it), median of 51 */
    double t_build[51], t_cuda[51];
    for (int i = 0; i < 51; i++) {
        const double t0 = cas_now_s();
        if ((st = cas_attn_plan_build(plan[1], &b, s.num_pages, prm))) goto out;
        const double t1 = cas_now_s();
        if ((st = cas_cuda_attn_plan_from_cpu(ctx, plan[1])) || (st = cas_cuda_attn_upload(ctx, stream))) goto out;
        t_build[i] = t1 - t0;
        t_cuda[i] = cas_now_s() - t1;
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    qsort(t_build, 51, sizeof(double), cmp_double);
    qsort(t_cuda, 51, sizeof(double), cmp_double);
    const double host_build_us = t_build[25] * 1e6, host_cuda_us = t_cuda[25] * 1e6;
    {
        char dev[256];
        cas_cuda_device_name(0, dev, sizeof dev);
        const double tok_bytes = 2.0 * shape->num_kv_heads * D * (double)cas_dtype_size(shape->kv_dtype);
        const double qo_bytes = no * 2.0 + no * 4.0 + nl * 4.0; /* q in, o and lse out */
        const double fetch = fetched_bytes(shape, &s, prm, 2);
        double bytes[NV], requested[NV];
        for (int m = 0; m < NV; m++) {
            bytes[m] = fetch;
            requested[m] = (double)info[m].kv_tokens_read * tok_bytes + qo_bytes;
        }
        double flops = useful_flops(shape, &s, prm);
        int ok = bad[0] == 0 && bad[1] == 0 && bad[2] == 0;
        if (o->json) {
            char e0[32], e1[32], e2[32];
            printf("{\"backend\": \"cuda\", \"device\": \"%s\", \"kernel\": \"%s\", \"simd\": \"none\", "
                   "\"threads\": %d, \"batch\": %d, \"prefix\": %d, "
                   "\"suffix\": %d, \"qlen\": %d, \"tree\": \"%s\", \"num_qo_heads\": %d, \"num_kv_heads\": %d, "
                   "\"head_dim\": %d, \"page_size\": %d, \"dtype\": \"%s\", \"total_q\": %d, "
                   "\"timing\": \"CUDA events, CUDA-graph replay of one run, %d warm-up, median of %d\", "
                   "\"flat_ms\": %.6f, \"cascade_ms\": %.6f, \"cascade_all_ms\": %.6f, \"speedup\": %.4f, "
                   "\"flat_eager_ms\": %.6f, \"cascade_eager_ms\": %.6f, \"cascade_all_eager_ms\": %.6f, "
                   "\"max_rel_err_flat\": %s, \"max_rel_err_cascade\": %s, \"max_rel_err_cascade_all\": %s, "
                   "\"bad_rows\": %lld, "
                   "\"fetched_bytes\": %.0f, \"flat_requested_bytes\": %.0f, \"cascade_requested_bytes\": %.0f, "
                   "\"cascade_all_requested_bytes\": %.0f, "
                   "\"flat_GBps\": %.3f, \"cascade_GBps\": %.3f, \"cascade_all_GBps\": %.3f, "
                   "\"peak_GBps\": %.3f, \"peak_source\": \"device-to-device copy, read + write\", "
                   "\"flops\": %.0f, \"flat_GFLOPs\": %.3f, \"cascade_GFLOPs\": %.3f, \"cascade_all_GFLOPs\": %.3f, "
                   "\"peak_GFLOPs\": %.3f, \"peak_flops_source\": \"cuBLAS bf16 8192^3\", "
                   "\"tree_nodes\": %d, \"shared_passes\": %d, \"passes\": %d, "
                   "\"work_items\": %d, \"est_cascade_ms\": %.6f, \"est_flat_ms\": %.6f, \"plan_ms\": %.4f, "
                   "\"plan_flat_ms\": %.4f, \"host_plan_build_us\": %.2f, \"host_cuda_plan_us\": %.2f, "
                   "\"checked_requests\": %d}\n",
                   dev, cas_cuda_attn_kernel_name(ctx), o->threads, s.batch, o->tree ? 0 : o->prefix,
                   o->suffix, o->qlen, o->tree ? o->tree : "", Hq, shape->num_kv_heads, D,
                   shape->page_size, cas_dtype_name(shape->kv_dtype), s.total_q, o->warmup, o->repeats,
                   t_graph[0] * 1e3, t_graph[1] * 1e3, t_graph[2] * 1e3, t_graph[0] / t_graph[1],
                   t_eager[0] * 1e3, t_eager[1] * 1e3, t_eager[2] * 1e3, num_or_null(e0, err[0]),
                   num_or_null(e1, err[1]), num_or_null(e2, err[2]), (long long)(bad[0] + bad[1] + bad[2]),
                   fetch, requested[0], requested[1], requested[2],
                   bytes[0] / t_graph[0] / 1e9, bytes[1] / t_graph[1] / 1e9, bytes[2] / t_graph[2] / 1e9,
                   peak_gbps, flops, flops / t_graph[0] / 1e9, flops / t_graph[1] / 1e9,
                   flops / t_graph[2] / 1e9, peak_tflops * 1e3, info[1].tree_nodes,
                   info[1].shared_passes, info[1].passes, info[1].work_items, info[1].est_cost_s * 1e3,
                   info[1].est_flat_cost_s * 1e3, t_plan[1] * 1e3, t_plan[0] * 1e3, host_build_us, host_cuda_us,
                   o->check_requests ? s.batch : 0);
        } else {
            printf("batch %d (%d query tokens), %s, heads %d:%d, head_dim %d, page %d, %s KV\n", s.batch,
                   s.total_q, o->tree ? o->tree : "one shared prefix", Hq, shape->num_kv_heads, D,
                   shape->page_size, cas_dtype_name(shape->kv_dtype));
            printf("device: %s, kernel %s; copy %.1f GB/s (read + write), cuBLAS bf16 %.1f TFLOP/s "
                   "(measured now)\n", dev, cas_cuda_attn_kernel_name(ctx), peak_gbps, peak_tflops);
            printf("plan: %d tree nodes, %d shared passes, %d passes (%.3f ms to create and plan; a step's "
                   "re-plan %.1f us, the CUDA plan and upload %.1f us)\n",
                   info[1].tree_nodes, info[1].shared_passes, info[1].passes, t_plan[1] * 1e3, host_build_us,
                   host_cuda_us);
            for (int m = 0; m < NV; m++)
                printf("%-12s %9.4f ms (eager %9.4f)  %7.1f GB/s (%4.0f%% of copy)  %8.1f TFLOP/s  max rel err %.2e\n",
                       names[m], t_graph[m] * 1e3, t_eager[m] * 1e3, bytes[m] / t_graph[m] / 1e9,
                       100 * bytes[m] / t_graph[m] / (peak_gbps * 1e9), flops / t_graph[m] / 1e12, err[m]);
            printf("speedup: %.2fx (cost model predicted flat %.3f ms, cascade %.3f ms)\n",
                   t_graph[0] / t_graph[1], info[1].est_flat_cost_s * 1e3, info[1].est_cost_s * 1e3);
        }
        if (!ok) {
            fprintf(stderr, "attn-bench: %lld rows differ from the float64 reference by more than %g of their norm "
                            "(worst: flat %.3g, cascade %.3g, all %.3g)\n",
                    (long long)(bad[0] + bad[1] + bad[2]), tol, err[0], err[1], err[2]);
            goto out;
        }
    }
    rc = 0;
out:
    if (st) fprintf(stderr, "attn-bench: %s\n", cas_last_error());
    if (stream) cudaStreamDestroy(stream);
    if (dk) cudaFree(dk);
    if (dv) cudaFree(dv);
    if (dq) cudaFree(dq);
    if (dO) cudaFree(dO);
    if (dL) cudaFree(dL);
    cas_cuda_attn_destroy(ctx);
    for (int m = 0; m < NV; m++) {
        cas_attn_plan_destroy(plan[m]);
        cas_free(out[m]);
    }
    cas_free(lse);
    free(q16);
    free(ref_o);
    free(ref_l);
    cas_attn_synth_destroy(&s);
    return rc;
}
#undef CUDA_OK
#endif

int cmd_attn_bench(int argc, char **argv) {
    bench_opts o;
    if (parse_opts(argc, argv, &o)) return 2;
    if (o.bf16_dot && (o.dtype != CAS_BF16 || strcmp(o.backend, "cpu") ||
                       !cas_attn_bf16_dot_available())) {
        fprintf(stderr, "attn-bench: --bf16-dot needs --dtype bf16, the cpu backend and a CPU with AVX512_BF16 "
                        "(this one: %s)\n", cas_attn_bf16_dot_available() ? "has it" : "has not");
        return 2;
    }
    cas_attn_shape shape = {o.hq, o.hkv, o.head_dim, o.page_size, o.dtype};
    cas_attn_params prm = cas_attn_params_default();
    prm.causal = o.causal;
    prm.window_left = o.window;
    prm.logits_soft_cap = o.soft_cap;
    int rc = 1;
#if CAS_WITH_CUDA
    if (!strcmp(o.backend, "cuda")) return run_cuda(&o, &shape, &prm);
#endif
    if (o.calibrate) {
        cas_attn_cost c, d = cas_attn_cost_default();
        cas_status cst = cas_attn_calibrate(&shape, o.threads, &c);
        if (cst) {
            fprintf(stderr, "attn-bench: %s\n", cas_last_error());
            return 1;
        }
        printf("{\"bytes_per_s\": %.4g, \"pack_bytes_per_s\": %.4g, \"flops_per_s\": %.4g, "
               "\"pass_overhead_s\": %.4g, \"default\": {\"bytes_per_s\": %.4g, \"pack_bytes_per_s\": %.4g, "
               "\"flops_per_s\": %.4g, \"pass_overhead_s\": %.4g}}\n",
               c.bytes_per_s, c.pack_bytes_per_s, c.flops_per_s, c.pass_overhead_s, d.bytes_per_s,
               d.pack_bytes_per_s, d.flops_per_s, d.pass_overhead_s);
        return 0;
    }
    cas_attn_synth s;
    memset(&s, 0, sizeof s);
    cas_attn_plan *flat = NULL, *casc = NULL;
    float *o_flat = NULL, *o_casc = NULL, *lse = NULL;
    cas_attn_synth_huge_pages(o.huge_pages);
    cas_status st = cas_attn_synth_create(&s, &shape, o.tree, o.batch, o.prefix, o.suffix, o.qlen, o.seed);
    if (st) {
        fprintf(stderr, "attn-bench: %s\n", cas_last_error());
        return 2;
    }
    cas_attn_batch b = cas_attn_synth_batch(&s);
    cas_kv_pool pool = cas_attn_synth_pool(&s);
    cas_attn_plan_opts po = cas_attn_plan_opts_default();
    po.threads = o.threads;
    po.cascade = CAS_CASCADE_OFF;
    po.bf16_dot = o.bf16_dot;
    po.simd = o.simd;
    po.amx_off = o.amx_off;
    double t_plan_flat = cas_now_s();
    st = cas_attn_plan_create(&flat, &shape, &po, 0, 0, 0);
    if (!st) st = cas_attn_plan_build(flat, &b, s.num_pages, &prm);
    t_plan_flat = cas_now_s() - t_plan_flat;
    po.cascade = CAS_CASCADE_AUTO;
    double t_plan = cas_now_s();
    if (!st) st = cas_attn_plan_create(&casc, &shape, &po, 0, 0, 0);
    if (!st) st = cas_attn_plan_build(casc, &b, s.num_pages, &prm);
    t_plan = cas_now_s() - t_plan;
    if (st) {
        fprintf(stderr, "attn-bench: %s\n", cas_last_error());
        rc = 2;
        goto out;
    }
    if (o.print_plan) cas_attn_plan_print(casc, stderr);
    size_t no = (size_t)s.total_q * o.hq * o.head_dim, nl = (size_t)s.total_q * o.hq;
    o_flat = cas_alloc_array(no + 1, 4);
    o_casc = cas_alloc_array(no + 1, 4);
    lse = cas_alloc_array(nl + 1, 4);
    if (!o_flat || !o_casc || !lse) {
        fprintf(stderr, "attn-bench: out of memory for outputs\n");
        goto out;
    }
    for (size_t i = 0; i < no; i++) o_flat[i] = o_casc[i] = NAN;
    int nt = o.threads > 0 ? o.threads : 0;
    double peak_bw = cas_measure_read_bandwidth((size_t)512 << 20, nt);
    double peak_flops = cas_measure_fma_flops(nt);
    double b_flat = 0, b_casc = 0;
    double t_flat = time_runs(flat, &pool, s.q, o_flat, lse, o.warmup, o.repeats, &b_flat, &st);
    double t_casc = 0;
    if (!st) t_casc = time_runs(casc, &pool, s.q, o_casc, lse, o.warmup, o.repeats, &b_casc, &st);
    if (st) {
        fprintf(stderr, "attn-bench: %s\n", cas_last_error());
        goto out;
    }
    /* f32 products; the bf16 dot products round Q and P to 8 significant bits */
    const double tol = o.bf16_dot ? 5e-2 : CAS_ATTN_TOL_F32;
    int64_t bad_flat = 0, bad_casc = 0;
    double err_flat = check_sample(&shape, &s, &prm, o_flat, o.check_requests, o.seed + 7, tol, &bad_flat, &st);
    double err_casc =
        st ? NAN : check_sample(&shape, &s, &prm, o_casc, o.check_requests, o.seed + 7, tol, &bad_casc, &st);
    if (st) {
        fprintf(stderr, "attn-bench: %s\n", cas_last_error());
        goto out;
    }
    cas_attn_plan_info fi, ci;
    cas_attn_plan_get_info(flat, &fi);
    cas_attn_plan_get_info(casc, &ci);
    const double tok_bytes = 2.0 * o.hkv * o.head_dim * (double)cas_dtype_size(o.dtype);
    const double qo_bytes = 2.0 * no * 4 + nl * 4;
    const double req_flat = (double)fi.kv_tokens_read * tok_bytes + qo_bytes;
    const double req_casc = (double)ci.kv_tokens_read * tok_bytes + qo_bytes;
    const double bytes_flat = fetched_bytes(&shape, &s, &prm, 4), bytes_casc = bytes_flat;
    double flops = useful_flops(&shape, &s, &prm);
    int threads = o.threads > 0 ? o.threads : 0;
    if (o.dump) {
        st = dump_all(o.dump, &shape, &s, &prm, o_flat, o_casc, lse);
        if (st) {
            fprintf(stderr, "attn-bench: %s\n", cas_last_error());
            goto out;
        }
    }
    int ok = bad_flat == 0 && bad_casc == 0;
    if (o.json) {
        char ef[32], ec[32];
        printf("{\"backend\": \"cpu\", \"huge_pages\": %d, \"bf16_dot\": %d, \"simd\": \"%s\", \"threads\": %d, \"batch\": %d, \"prefix\": %d, "
               "\"suffix\": %d, \"qlen\": %d, \"tree\": \"%s\", \"num_qo_heads\": %d, \"num_kv_heads\": %d, "
               "\"head_dim\": %d, \"page_size\": %d, \"dtype\": \"%s\", \"total_q\": %d, "
               "\"flat_ms\": %.6f, \"cascade_ms\": %.6f, \"speedup\": %.4f, "
               "\"max_rel_err_flat\": %s, \"max_rel_err_cascade\": %s, "
               "\"fetched_bytes\": %.0f, \"flat_requested_bytes\": %.0f, \"cascade_requested_bytes\": %.0f, "
               "\"flat_GBps\": %.3f, \"cascade_GBps\": %.3f, "
               "\"peak_GBps\": %.3f, \"flops\": %.0f, \"flat_GFLOPs\": %.3f, \"cascade_GFLOPs\": %.3f, "
               "\"peak_GFLOPs\": %.3f, \"tree_nodes\": %d, \"shared_passes\": %d, \"passes\": %d, "
               "\"work_items\": %d, \"est_cascade_ms\": %.6f, \"est_flat_ms\": %.6f, \"plan_ms\": %.4f, "
               "\"plan_flat_ms\": %.4f, \"checked_requests\": %d, \"flat_best_ms\": %.6f, "
               "\"cascade_best_ms\": %.6f}\n",
               o.huge_pages, o.bf16_dot, o.simd ? cas_simd_name(o.simd) : cas_attn_simd_name(), threads, s.batch, o.tree ? 0 : o.prefix, o.suffix, o.qlen,
               o.tree ? o.tree : "", o.hq, o.hkv, o.head_dim, o.page_size, cas_dtype_name(o.dtype),
               s.total_q, t_flat * 1e3, t_casc * 1e3, t_flat / t_casc, num_or_null(ef, err_flat),
               num_or_null(ec, err_casc), bytes_flat, req_flat,
               req_casc, bytes_flat / t_flat / 1e9, bytes_casc / t_casc / 1e9, peak_bw / 1e9, flops,
               flops / t_flat / 1e9, flops / t_casc / 1e9, peak_flops / 1e9, ci.tree_nodes,
               ci.shared_passes, ci.passes, ci.work_items, ci.est_cost_s * 1e3, ci.est_flat_cost_s * 1e3,
               t_plan * 1e3, t_plan_flat * 1e3, o.check_requests < s.batch ? o.check_requests : s.batch,
               b_flat * 1e3, b_casc * 1e3);
    } else {
        printf("batch %d (%d query tokens), %s, heads %d:%d, head_dim %d, page %d, %s KV, simd %s\n",
               s.batch, s.total_q, o.tree ? o.tree : "one shared prefix", o.hq, o.hkv, o.head_dim,
               o.page_size, cas_dtype_name(o.dtype), o.simd ? cas_simd_name(o.simd) : cas_attn_simd_name());
        printf("machine: read bandwidth %.1f GB/s, f32 FMA %.1f GFLOP/s (measured now)\n", peak_bw / 1e9,
               peak_flops / 1e9);
        printf("plan: %d tree nodes, %d shared passes, %d passes, %d work items (%.3f ms to plan)\n",
               ci.tree_nodes, ci.shared_passes, ci.passes, ci.work_items, t_plan * 1e3);
        printf("flat:    %9.3f ms  %7.1f GB/s (%4.0f%% of peak)  %7.1f GFLOP/s  max rel err %.2e\n", t_flat * 1e3,
               bytes_flat / t_flat / 1e9, 100 * bytes_flat / t_flat / peak_bw, flops / t_flat / 1e9, err_flat);
        printf("cascade: %9.3f ms  %7.1f GB/s (%4.0f%% of peak)  %7.1f GFLOP/s (%3.0f%% of peak)  max rel err %.2e\n",
               t_casc * 1e3, bytes_casc / t_casc / 1e9, 100 * bytes_casc / t_casc / peak_bw,
               flops / t_casc / 1e9, 100 * flops / t_casc / peak_flops, err_casc);
        printf("speedup: %.2fx (cost model predicted flat %.3f ms, cascade %.3f ms)\n", t_flat / t_casc,
               ci.est_flat_cost_s * 1e3, ci.est_cost_s * 1e3);
    }
    if (!ok) {
        fprintf(stderr, "attn-bench: %lld rows differ from the float64 reference by more than %g of their norm "
                        "(worst: flat %.3g, cascade %.3g)\n",
                (long long)(bad_flat + bad_casc), tol, err_flat, err_casc);
        goto out;
    }
    rc = 0;
out:
    cas_free(o_flat);
    cas_free(o_casc);
    cas_free(lse);
    cas_attn_plan_destroy(flat);
    cas_attn_plan_destroy(casc);
    cas_attn_synth_destroy(&s);
    return rc;
}
