/*
 * gpu_logits.c: writes the logits of a greedy run for an independent
 * implementation to compare with (tests/cuda/check_gpu_transformers.py).
 *
 *   gpu_logits MODEL.gguf PROMPTS.txt STEPS OUT.bin gpu|cpu
 *
 * Every line of PROMPTS.txt is one prompt ("\n" in it a newline; tokenized with the model's
 * tokenizer, BOS added where the file asks); all of them are prefilled in one
 * forward, then STEPS forwards decode one token each, every sequence fed its
 * own greedy token. OUT.bin, little-endian: "CASL", int32 n_prompts, n_vocab,
 * steps; per prompt int32 length and its token ids; then for step s = 0 ..
 * steps (0 is the prefill's last row) and each prompt: int32 the greedy token,
 * float32 logits[n_vocab].
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/gpu/gpu.h"

#define PAGE 16
#define MAXP 64
#define MAXLEN 1024

static int fail(const char *what) {
    fprintf(stderr, "gpu_logits: %s: %s\n", what, cas_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 6 || (strcmp(argv[5], "gpu") && strcmp(argv[5], "cpu"))) {
        fprintf(stderr, "usage: gpu_logits MODEL.gguf PROMPTS.txt STEPS OUT.bin gpu|cpu\n");
        return 2;
    }
    const int gpu = !strcmp(argv[5], "gpu");
    const int steps = atoi(argv[3]);
    cas_model_opts mo = cas_model_opts_default();
    mo.max_batch_tokens = 2048;
    cas_model *cm = NULL;
    if (cas_model_load(argv[1], &mo, &cm)) return fail("load");
    cas_tok *tok = NULL;
    if (cas_tok_create(cas_model_gguf(cm), &tok)) return fail("tokenizer");
    const int32_t V = cas_model_config_of(cm)->n_vocab;

    static int32_t ids[MAXP][MAXLEN];
    int32_t len[MAXP];
    int np = 0;
    FILE *f = fopen(argv[2], "r");
    if (!f) return fail("prompts file");
    static char line[8192];
    while (np < MAXP && fgets(line, sizeof line, f)) {
        size_t n = strcspn(line, "\n");
        if (!n) continue;
        /* "\n" in a line stands for a newline */
        size_t w = 0;
        for (size_t r = 0; r < n; r++, w++) {
            if (line[r] == '\\' && r + 1 < n && line[r + 1] == 'n') line[w] = '\n', r++;
            else line[w] = line[r];
        }
        n = w;
        size_t got = 0;
        if (cas_tok_encode(tok, line, n, CAS_TOK_ADD_SPECIAL, ids[np], MAXLEN - steps - 1, &got)) return fail("encode");
        len[np++] = (int32_t)got;
    }
    fclose(f);

    cas_gpu_model *gm = NULL;
    cas_gpu_kv *gkv = NULL;
    cas_model_kv *ckv = NULL;
    const int32_t pages = np * (MAXLEN / PAGE);
    if (gpu) {
        cas_gpu_opts go = cas_gpu_opts_default();
        go.max_batch_tokens = 2048;
        if (cas_gpu_model_create(cas_model_gguf(cm), &go, &gm)) return fail("gpu model");
        if (cas_gpu_kv_create(gm, pages, PAGE, &gkv)) return fail("gpu kv");
        fprintf(stderr, "gpu_logits: %d prompts on %s\n", np, cas_gpu_model_device_name(gm));
    } else if (cas_model_kv_create(cm, pages, PAGE, CAS_F16, &ckv)) {
        return fail("cpu kv");
    }

    FILE *o = fopen(argv[4], "wb");
    if (!o) return fail("output file");
    const int32_t hdr[3] = {np, V, steps};
    fwrite("CASL", 1, 4, o);
    fwrite(hdr, 4, 3, o);
    for (int i = 0; i < np; i++) {
        fwrite(&len[i], 4, 1, o);
        fwrite(ids[i], 4, (size_t)len[i], o);
    }

    /* sequence i owns pages i * MAXLEN / PAGE ... */
    static int32_t tokens[MAXP * MAXLEN], qo[MAXP + 1], kvp[MAXP + 1], idx[MAXP * MAXLEN / PAGE], last[MAXP];
    float *logits = malloc(sizeof(float) * (size_t)V * (size_t)np);
    if (!logits) return fail("memory");
    int32_t cur[MAXP];
    for (int s = 0; s <= steps; s++) {
        int32_t T = 0, P = 0;
        qo[0] = kvp[0] = 0;
        for (int i = 0; i < np; i++) {
            if (s == 0) {
                memcpy(tokens + T, ids[i], sizeof(int32_t) * (size_t)len[i]);
                T += len[i];
            } else {
                tokens[T++] = cur[i];
                len[i]++;
            }
            const int32_t npg = (len[i] + PAGE - 1) / PAGE;
            for (int32_t j = 0; j < npg; j++) idx[P++] = i * (MAXLEN / PAGE) + j;
            qo[i + 1] = T;
            kvp[i + 1] = P;
            last[i] = len[i] - (npg - 1) * PAGE;
        }
        const cas_model_batch b = {np, tokens, qo, kvp, idx, last, 0, NULL};
        if (gpu ? cas_gpu_forward(gm, gkv, &b, logits) : cas_model_forward(cm, ckv, &b, logits))
            return fail("forward");
        for (int i = 0; i < np; i++) {
            const float *l = logits + (size_t)i * V;
            int32_t best = 0;
            for (int32_t v = 1; v < V; v++)
                if (l[v] > l[best]) best = v;
            cur[i] = best;
            fwrite(&best, 4, 1, o);
            fwrite(l, 4, (size_t)V, o);
        }
    }
    if (fclose(o)) return fail("writing the output");
    free(logits);
    cas_gpu_kv_destroy(gkv);
    cas_gpu_model_destroy(gm);
    cas_model_kv_destroy(ckv);
    cas_tok_destroy(tok);
    cas_model_destroy(cm);
    return 0;
}
