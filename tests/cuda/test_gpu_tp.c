/*
 * test_gpu_tp.c: tensor parallelism (cas_gpu_opts.tensor_parallel) on a
 * synthetic model shape, against the same weights on one device. Needs a
 * GPU with room for the shape twice: `test_gpu_tp [SHAPE]` (default
 * llama-3-8b: 32 query heads, 8 K/V heads, 16 GB of bf16 weights).
 *
 * For every split N in 1, 2, 4, 8 that divides the K/V heads: the model made
 * again from the same seed split over N ranks (over N devices where the
 * machine has them, else all on device 0, where the ranks sum through
 * host-synchronized copies instead of NCCL), a prefill of 4 random prompts
 * and 12 decode steps fed the single model's greedy tokens; every step's
 * logits are compared with the single model's.
 *
 * How close is close: a split changes only the order of f32 sums (each
 * rank's share of the attention output and down products, then the sum over
 * ranks), and so does running the same tokens through other product shapes.
 * The floor is measured in the same run: the single model's logits with the
 * prompts prefilled in two chunks against one. A split must stay within
 * 4x that floor's largest difference (and 4x its worst step's mean), and
 * give the single model's greedy token wherever its top-two gap exceeds
 * 4x the floor's largest difference. N = 1 is the same arithmetic as the
 * single model: bitwise equal.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "check.h"
#include "paged_batch.h"
#include "../../src/gpu/gpu.h"

#define PAGE PAGED_BATCH_PAGE
#define NS 4
#define PROMPT 200
#define STEPS 12
#define SEED 1234

static int32_t V;

static int32_t argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}
static float margin(const float *x, int32_t n) {
    float a = -INFINITY, b = -INFINITY;
    for (int32_t i = 0; i < n; i++) {
        if (x[i] > a) b = a, a = x[i];
        else if (x[i] > b) b = x[i];
    }
    return a - b;
}

/* The logits of a run: [STEPS + 1][NS][V], step 0 the prefill's. chunks: the
 * prefill in that many pieces. forced: the tokens fed at each decode step
 * (NULL: this run's own greedy tokens, written to own). */
static cas_status run(cas_gpu_model *m, int chunks, const int32_t *prompts, const int32_t *forced, int32_t *own,
                      float *logits) {
    cas_gpu_kv *kv = NULL;
    cas_status st = cas_gpu_kv_create(m, NS * ((PROMPT + STEPS) / PAGE + 2), PAGE, &kv);
    if (st) return st;
    pager_t pg = {0};
    seq_t s[NS], *q[NS];
    const int32_t *toks[NS];
    int32_t counts[NS], next[NS];
    memset(s, 0, sizeof s);
    for (int i = 0; i < NS; i++) q[i] = &s[i];
    const int32_t piece = PROMPT / chunks;
    for (int c = 0; c < chunks && !st; c++) {
        for (int i = 0; i < NS; i++) {
            toks[i] = prompts + (size_t)i * PROMPT + (size_t)c * piece;
            counts[i] = c == chunks - 1 ? PROMPT - c * piece : piece;
        }
        const cas_model_batch b = paged_batch(&pg, q, toks, counts, NS, 0);
        st = cas_gpu_forward(m, kv, &b, logits);
    }
    for (int stp = 1; stp <= STEPS && !st; stp++) {
        const float *prev = logits + (size_t)(stp - 1) * NS * V;
        cas_gpu_sample sp[NS];
        for (int i = 0; i < NS; i++) {
            next[i] = forced ? forced[(size_t)(stp - 1) * NS + i] : argmax(prev + (size_t)i * V, V);
            if (own) own[(size_t)(stp - 1) * NS + i] = next[i];
            toks[i] = &next[i];
            counts[i] = 1;
            sp[i] = (cas_gpu_sample){0.0f, 0, 1.0f, 0.0f, 0.0f, 1};
        }
        int32_t picked[NS];
        const cas_model_batch b = paged_batch(&pg, q, toks, counts, NS, 0);
        st = cas_gpu_forward_sample(m, kv, &b, sp, picked, logits + (size_t)stp * NS * V);
    }
    cas_gpu_kv_destroy(kv);
    return st;
}

/* the largest difference, and the worst step's mean */
static void diff(const float *a, const float *b, float *worst, double *mean_worst) {
    *worst = 0.0f;
    *mean_worst = 0.0;
    for (int stp = 0; stp <= STEPS; stp++) {
        double sum = 0;
        const size_t n = (size_t)NS * V, o = (size_t)stp * n;
        for (size_t i = 0; i < n; i++) {
            const float d = fabsf(a[o + i] - b[o + i]);
            sum += d;
            if (d > *worst) *worst = d;
        }
        if (sum / (double)n > *mean_worst) *mean_worst = sum / (double)n;
    }
}

int main(int argc, char **argv) {
    const char *shape = argc > 1 ? argv[1] : "llama-3-8b";
    if (!cas_gpu_available()) {
        printf("FAIL: no CUDA device (this test is for a GPU machine)\n0 passed, 1 failed\n");
        return 1;
    }
    cas_model_config cfg;
    if (cas_model_config_synthetic(shape, &cfg)) {
        printf("FAIL: %s\n0 passed, 1 failed\n", cas_last_error());
        return 1;
    }
    V = cfg.n_vocab;
    cas_gpu_opts go = cas_gpu_opts_default();
    go.max_batch_tokens = NS * PROMPT;
    go.max_seqs = NS;
    go.max_logits = NS;
    go.max_pages_per_seq = (PROMPT + STEPS) / PAGE + 2;
    cas_gpu_model *one = NULL;
    if (cas_gpu_model_create_synthetic(&cfg, SEED, &go, &one)) {
        printf("FAIL: %s\n0 passed, 1 failed\n", cas_last_error());
        return 1;
    }
    const size_t per = (size_t)(STEPS + 1) * NS * V;
    float *ref = malloc(sizeof(float) * per), *floor_l = malloc(sizeof(float) * per),
          *got = malloc(sizeof(float) * per);
    int32_t *prompts = malloc(sizeof(int32_t) * NS * PROMPT), greedy[STEPS * NS];
    REQUIRE_MAIN(ref && floor_l && got && prompts);
    cas_rng rng;
    cas_rng_seed(&rng, 7);
    for (int i = 0; i < NS * PROMPT; i++) prompts[i] = (int32_t)(cas_rng_uniform(&rng) * (V - 1));
    REQUIRE_MAIN(run(one, 1, prompts, NULL, greedy, ref) == CAS_OK);
    REQUIRE_MAIN(run(one, 2, prompts, greedy, NULL, floor_l) == CAS_OK);
    float fw;
    double fm;
    diff(ref, floor_l, &fw, &fm);
    printf("shape %s: %d layers, %d/%d heads; floor (prefill in 2 chunks against 1): max %.4f, worst step mean %.5f\n",
           shape, cfg.n_layers, cfg.n_head, cfg.n_head_kv, (double)fw, fm);
    int ndev = 0;
    cudaGetDeviceCount(&ndev);
    const int32_t zeros[CAS_GPU_MAX_RANKS] = {0};
    for (int32_t n = 1; n <= 8; n *= 2) {
        if (cfg.n_head_kv % n) continue;
        cas_gpu_opts o = go;
        o.tensor_parallel = n;
        o.devices = ndev >= n ? NULL : zeros;
        cas_gpu_model *tp = NULL;
        cas_status st = cas_gpu_model_create_synthetic(&cfg, SEED, &o, &tp);
        CHECKF(st == CAS_OK, "tensor parallel %d: %s", n, cas_last_error());
        if (st) continue;
        st = run(tp, 1, prompts, greedy, NULL, got);
        CHECKF(st == CAS_OK, "tensor parallel %d: %s", n, cas_last_error());
        cas_gpu_model_destroy(tp);
        if (st) continue;
        float w;
        double mn;
        diff(ref, got, &w, &mn);
        int same = 0, compared = 0;
        for (int stp = 0; stp <= STEPS; stp++)
            for (int i = 0; i < NS; i++) {
                const float *a = ref + ((size_t)stp * NS + i) * V, *b = got + ((size_t)stp * NS + i) * V;
                if (margin(a, V) > 4 * fw) {
                    compared++;
                    same += argmax(a, V) == argmax(b, V);
                }
            }
        const int bitwise = memcmp(ref, got, sizeof(float) * per) == 0;
        printf("  tensor parallel %d (%s): max %.4f, worst step mean %.5f%s; greedy the same in %d of %d rows with "
               "a gap over %.4f\n",
               n, n == 1 ? "NCCL, one rank" : ndev >= n ? "NCCL" : "one device", (double)w, mn,
               bitwise ? ", bitwise equal" : "", same, compared, 4.0 * fw);
        if (n == 1) CHECKF(bitwise, "tensor parallel 1 differs from the single model (max %.4g)", (double)w);
        else CHECKF(w <= 4 * fw && mn <= 4 * fm && same == compared, "tensor parallel %d: max %.4f mean %.5f", n,
                    (double)w, mn);
    }
    cas_gpu_model_destroy(one);
    free(ref);
    free(floor_l);
    free(got);
    free(prompts);
    return check_summary();
}
