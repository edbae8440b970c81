/*
 * model_bench.c: prefill and decode tokens/s of the CPU forward pass, single
 * sequence and many sequences, against the roofline of single-sequence
 * decode: every decode step reads every weight matrix once, so it cannot be
 * faster than (weight bytes per token) / (read bandwidth). The bandwidth is
 * measured in the same run with the same thread count. For the many-sequence
 * decode, which is compute-bound, the same run also measures the int8
 * (vpmaddubsw) and f32 (FMA) instruction peaks and the batched Q4_1 kernel (on
 * the path the model's batched forward takes, "batch_simd": AMX-INT8 where the
 * machine has it), and reports the step's matrix GFLOP/s next to what 8x the
 * single-sequence rate would need. Built and run by bench/model_bench.sh, which writes
 * bench/results/cpu-model.json.
 *
 * usage: model_bench MODEL THREADS [SEQS] [--no-batch-invariance] [--mmap] > result.json
 * (--no-batch-invariance: the fastest attention plans instead of the
 * batch-invariant ones, cas_model_opts.batch_invariant = 0; --mmap: the
 * weights in the file's mapping, cas_model_opts.mmap_weights = 1)
 *        model_bench MODEL THREADS --sweep 1,2,4,... > result.json
 * (the many-sequence run alone for each count: prefill and decode tokens/s
 * of that many sequences of 64 prompt tokens and 64 decode steps, the shape
 * of llama-batched-bench -npp 64 -ntg 64 -npl COUNT; bench/seqs_sweep.sh)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/model/model.h"
#include "../src/model/quant_impl.h"

#define PAGE 16
#define PREFILL 256 /* prompt tokens per sequence, single-sequence run */
#define MPREFILL 64 /* prompt tokens per sequence, many-sequence run */
#define DECODE 64   /* decode steps */

static void die(const char *what) {
    fprintf(stderr, "model_bench: %s: %s\n", what, cas_last_error());
    exit(1);
}

/* nseq sequences of plen random tokens each, pages laid out consecutively per sequence; runs
 * the prompts in forwards of at most 512 tokens, then `DECODE` decode steps. Returns the
 * prefill and decode tokens/s (best of `reps`). */
static void run(cas_model *m, int nseq, int plen, int reps, double *pre_tps, double *dec_tps) {
    const cas_model_config *c = cas_model_config_of(m);
    int32_t per = (plen + DECODE + PAGE - 1) / PAGE;
    cas_model_kv *kv = NULL;
    if (cas_model_kv_create(m, per * nseq, PAGE, CAS_F16, &kv)) die("model kv");
    int32_t *tok = malloc(sizeof(int32_t) * 4096), *qo = malloc(sizeof(int32_t) * (nseq + 1)),
            *kvp = malloc(sizeof(int32_t) * (nseq + 1)), *idx = malloc(sizeof(int32_t) * per * nseq),
            *last = malloc(sizeof(int32_t) * nseq), *len = calloc((size_t)nseq, sizeof(int32_t));
    float *logits = malloc(sizeof(float) * (size_t)nseq * c->n_vocab);
    cas_rng rng;
    cas_rng_seed(&rng, 7);
    *pre_tps = *dec_tps = 0;
    for (int rep = 0; rep < reps; rep++) {
        memset(len, 0, sizeof(int32_t) * nseq);
        double t0 = cas_now_s();
        /* prefill: whole sequences per forward, up to 512 tokens */
        for (int s0 = 0; s0 < nseq;) {
            int nb = 0, nt = 0, np = 0;
            qo[0] = kvp[0] = 0;
            while (s0 + nb < nseq && nt + plen <= 512) {
                int s = s0 + nb;
                for (int i = 0; i < plen; i++) tok[nt++] = (int32_t)cas_rng_range(&rng, 100, c->n_vocab - 1);
                len[s] = plen;
                int npg = (plen + PAGE - 1) / PAGE;
                for (int p = 0; p < npg; p++) idx[np++] = s * per + p;
                last[nb] = plen - (npg - 1) * PAGE;
                nb++;
                qo[nb] = nt;
                kvp[nb] = np;
            }
            cas_model_batch b = {nb, tok, qo, kvp, idx, last, 0, NULL};
            if (cas_model_forward(m, kv, &b, logits)) die("prefill");
            s0 += nb;
        }
        double t1 = cas_now_s();
        for (int step = 0; step < DECODE; step++) {
            int np = 0;
            qo[0] = kvp[0] = 0;
            for (int s = 0; s < nseq; s++) {
                tok[s] = (int32_t)cas_rng_range(&rng, 100, c->n_vocab - 1);
                len[s]++;
                int npg = (len[s] + PAGE - 1) / PAGE;
                for (int p = 0; p < npg; p++) idx[np++] = s * per + p;
                last[s] = len[s] - (npg - 1) * PAGE;
                qo[s + 1] = s + 1;
                kvp[s + 1] = np;
            }
            cas_model_batch b = {nseq, tok, qo, kvp, idx, last, 0, NULL};
            if (cas_model_forward(m, kv, &b, logits)) die("decode");
        }
        double t2 = cas_now_s();
        double p = (double)nseq * plen / (t1 - t0), d = (double)nseq * DECODE / (t2 - t1);
        if (p > *pre_tps) *pre_tps = p;
        if (d > *dec_tps) *dec_tps = d;
    }
    free(tok);
    free(qo);
    free(kvp);
    free(idx);
    free(last);
    free(len);
    free(logits);
    cas_model_kv_destroy(kv);
}

/* model_bench MODEL THREADS --sweep LIST */
static int sweep(const char *path, int threads, const char *list) {
    int counts[64], nc = 0, most = 0;
    for (const char *p = list; *p && nc < 64;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > 512) {
            fprintf(stderr, "model_bench: --sweep wants counts 1..512 separated by commas: %s\n", list);
            return 2;
        }
        counts[nc++] = (int)v;
        if (v > most) most = (int)v;
        p = *end == ',' ? end + 1 : end;
    }
    cas_model_opts o = cas_model_opts_default();
    o.threads = threads;
    o.max_batch_tokens = 512;
    o.max_seqs = most;
    cas_model *m = NULL;
    if (cas_model_load(path, &o, &m)) die(path);
    printf("{\n  \"model\": \"%s\",\n  \"threads\": %d,\n  \"simd\": \"%s\",\n  \"batch_simd\": \"%s\",\n"
           "  \"prompt_tokens_each\": %d,\n  \"decode_steps\": %d,\n  \"sweep\": [",
           path, threads, cas_q_simd_name(), cas_q_batch_simd_name(), MPREFILL, DECODE);
    for (int i = 0; i < nc; i++) {
        double p, d;
        run(m, counts[i], MPREFILL, 2, &p, &d);
        printf("%s\n    {\"sequences\": %d, \"prefill_tokens_per_s\": %.1f, \"decode_tokens_per_s\": %.1f}",
               i ? "," : "", counts[i], p, d);
        fprintf(stderr, "%d seqs: prefill %.0f, decode %.1f tok/s\n", counts[i], p, d);
    }
    printf("\n  ]\n}\n");
    cas_model_destroy(m);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && !strcmp(argv[3], "--sweep")) return sweep(argv[1], atoi(argv[2]), argv[4]);
    int inv = 1, mmap_w = 0;
    for (int k = 0; k < 2; k++) {
        if (argc > 3 && !strcmp(argv[argc - 1], "--no-batch-invariance")) inv = 0, argc--;
        if (argc > 3 && !strcmp(argv[argc - 1], "--mmap")) mmap_w = 1, argc--;
    }
    if (argc < 3) {
        fprintf(stderr, "usage: model_bench MODEL THREADS [SEQS] [--no-batch-invariance] [--mmap]\n");
        return 2;
    }
    int threads = atoi(argv[2]), many = argc > 3 ? atoi(argv[3]) : 32;
    cas_model_opts o = cas_model_opts_default();
    o.batch_invariant = inv;
    o.mmap_weights = mmap_w;
    o.threads = threads;
    o.max_batch_tokens = 512;
    o.max_seqs = many;
    cas_model *m = NULL;
    if (cas_model_load(argv[1], &o, &m)) die(argv[1]);
    const cas_model_config *c = cas_model_config_of(m);
    double bw = 0;
    if (cas_q_bench_read_bw(threads, (size_t)512 << 20, 1.0, &bw)) die("read bandwidth");
    double roof = bw * 1e9 / (double)c->weight_bytes_per_token;
    double p1, d1, pm, dm;
    run(m, 1, PREFILL, 3, &p1, &d1);
    run(m, many, MPREFILL, 2, &pm, &dm);
    /* compute ceilings for the many-sequence decode, same run: the int8 multiply-add
     * instruction's peak, f32 FMA's, and the batched Q4_1 kernel on a cache-resident
     * 1536 x 576 matrix (the model's gate/up shape) with `many` tokens */
    double i8 = 0, f32 = 0;
    cas_q_bench_peak(threads, 1.0, &i8, &f32);
    cas_q_bench_result kr;
    memset(&kr, 0, sizeof kr);
    cas_q_bench(CAS_T_Q4_1, 1536, 576, many, threads, 0, 1.0, &kr);
    /* matrix multiply-adds per token: every projection of every layer, and the logits */
    const double E = c->n_embd, F = c->n_ff, QD = (double)c->n_head * c->head_dim,
                 KD = (double)c->n_head_kv * c->head_dim;
    double macs = c->n_layers * (E * (QD + 2 * KD) + QD * E + 3 * E * F) + (double)c->n_vocab * E;
    double step_gflop = 2 * macs * many * 1e-9, step_s = many / dm, need_s = many / (8 * d1);
    /* bandwidth again after the runs, so a noisy neighbour shows as a spread */
    double bw2 = 0;
    cas_q_bench_read_bw(threads, (size_t)512 << 20, 1.0, &bw2);
    printf("{\n  \"model\": \"%s\",\n  \"threads\": %d,\n  \"simd\": \"%s\",\n  \"batch_simd\": \"%s\",\n",
           argv[1], threads, cas_q_simd_name(), cas_q_batch_simd_name());
    printf("  \"batch_invariant\": %s,\n", inv ? "true" : "false");
    printf("  \"mmap_weights\": %s,\n", mmap_w ? "true" : "false");
    printf("  \"weight_bytes_per_token\": %lld,\n", (long long)c->weight_bytes_per_token);
    printf("  \"read_bandwidth_gbs\": %.2f,\n  \"read_bandwidth_after_gbs\": %.2f,\n", bw, bw2);
    printf("  \"decode_roofline_tokens_per_s\": %.1f,\n", roof);
    printf("  \"single\": {\"prompt_tokens\": %d, \"prefill_tokens_per_s\": %.1f, \"decode_steps\": %d, "
           "\"decode_tokens_per_s\": %.1f, \"decode_fraction_of_roofline\": %.3f},\n",
           PREFILL, p1, DECODE, d1, d1 / roof);
    printf("  \"batch\": {\"sequences\": %d, \"prompt_tokens_each\": %d, \"prefill_tokens_per_s\": %.1f, "
           "\"decode_steps\": %d, \"decode_tokens_per_s\": %.1f, \"decode_speedup_over_single\": %.2f},\n",
           many, MPREFILL, pm, DECODE, dm, dm / d1);
    printf("  \"ceilings\": {\"int8_maddubs_gops\": %.0f, \"f32_fma_gflops\": %.0f, "
           "\"q4_1_matmul_1536x576_%dtok_gflops\": %.1f},\n",
           i8, f32, many, kr.gflops);
    printf("  \"batch_compute\": {\"matrix_gflop_per_step\": %.2f, \"step_ms\": %.1f, \"achieved_gflops\": %.1f, "
           "\"step_ms_for_8x\": %.1f, \"gflops_needed_for_8x\": %.1f},\n",
           step_gflop, 1e3 * step_s, step_gflop / step_s, 1e3 * need_s, step_gflop / need_s);
    printf("  \"targets\": {\"single_decode_ge_60pct_roofline\": %s, \"batch_decode_ge_8x_single\": %s}\n}\n",
           d1 >= 0.6 * roof ? "true" : "false", dm >= 8 * d1 ? "true" : "false");
    fprintf(stderr, "bandwidth %.1f GB/s, roofline %.0f tok/s; single: prefill %.0f, decode %.1f tok/s (%.0f%%); "
            "%d seqs: prefill %.0f, decode %.0f tok/s (%.1fx); int8 peak %.0f GOP/s, f32 peak %.0f GFLOP/s, "
            "q4_1 kernel (%s) %.0f GFLOP/s, step %.0f GFLOP/s (8x needs %.0f)\n",
            bw, roof, p1, d1, 100 * d1 / roof, many, pm, dm, dm / d1, i8, f32, cas_q_batch_simd_name(), kr.gflops,
            step_gflop / step_s, step_gflop / need_s);
    cas_model_destroy(m);
    return 0;
}
