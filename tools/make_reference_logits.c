/*
 * make_reference_logits.c: writes the reference-logits fixture that
 * tests/test_llama.c checks cascade's forward pass against. It is a small
 * driver of llama.cpp's public C API (llama.h), an implementation that is not
 * ours, built by tools/make_reference_logits.sh from the source distribution
 * of llama-cpp-python on PyPI (CPU only). Not part of the cascade build.
 *
 * For each prompt it tokenizes with llama.cpp's tokenizer, runs the whole
 * prompt as one batch with logits at every position, then decodes 32 greedy
 * tokens one at a time. It prints JSON: per prompt the ids, the top-20
 * (id, logit) pairs at every prompt position and after every greedy token,
 * and the greedy continuation. Strings after --tokenize are only tokenized:
 * their ids with special tokens parsed and BOS added as the file says
 * ("special"), and as plain text without BOS ("plain"); and those ids
 * decoded back to text by llama_detokenize ("special_text" with special
 * tokens rendered, "plain_text" without; neither removes BOS or EOS).
 *
 * Environment: REF_KV=f32 keeps K/V in f32, REF_FLASH=0/1 sets flash
 * attention, REF_TOPK=n lists n logits per position instead of 20.
 *
 * usage: make_reference_logits MODEL.gguf THREADS PROMPT... [--tokenize TEXT...] > fixture.json
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

#define MAXK 64
#define NGEN 32

static int TOPK = 20;

static void print_top(const float *lg, int n_vocab) {
    int idx[MAXK];
    for (int k = 0; k < TOPK; k++) idx[k] = -1;
    for (int i = 0; i < n_vocab; i++) {
        /* insertion into a small sorted list: ties keep the lower id first */
        int k = TOPK;
        while (k > 0 && (idx[k - 1] < 0 || lg[i] > lg[idx[k - 1]])) k--;
        if (k >= TOPK) continue;
        for (int j = TOPK - 1; j > k; j--) idx[j] = idx[j - 1];
        idx[k] = i;
    }
    printf("[");
    for (int k = 0; k < TOPK; k++) printf("%s[%d, %.6f]", k ? ", " : "", idx[k], (double)lg[idx[k]]);
    printf("]");
}

static int argmax(const float *lg, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (lg[i] > lg[b]) b = i;
    return b;
}

static void json_str(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') printf("\\%c", ch);
        else if (ch == '\n') printf("\\n");
        else if (ch < 0x20) printf("\\u%04x", ch);
        else putchar(ch);
    }
    putchar('"');
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL THREADS PROMPT...\n", argv[0]);
        return 2;
    }
    const char *tk = getenv("REF_TOPK");
    if (tk) TOPK = atoi(tk);
    if (TOPK < 2 || TOPK > MAXK) return 2;
    int n_prompts = argc;
    for (int a = 3; a < argc; a++)
        if (!strcmp(argv[a], "--tokenize")) {
            n_prompts = a;
            break;
        }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int n_vocab = llama_vocab_n_tokens(vocab);
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024;
    cp.n_batch = 1024;
    cp.n_ubatch = 1024;
    cp.n_threads = cp.n_threads_batch = atoi(argv[2]);
    /* The exact path: f32 K/V and the plain (non-flash) attention, so that the
     * reference adds no f16 rounding of its own beyond what its matmuls do. */
    const char *kvt = getenv("REF_KV");
    int kv_f32 = kvt && !strcmp(kvt, "f32");
    if (kv_f32) cp.type_k = cp.type_v = GGML_TYPE_F32;
    const char *fa = getenv("REF_FLASH");
    if (fa) cp.flash_attn_type = atoi(fa) ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;

    printf("{\"producer\": \"llama.cpp (vendored in llama-cpp-python %s sdist), CPU, %s KV cache, "
           "flash attention %s\",\n",
           LCPP_VERSION, kv_f32 ? "f32" : "f16", fa ? (atoi(fa) ? "on" : "off") : "auto");
    printf(" \"topk\": %d, \"n_gen\": %d,\n \"prompts\": [\n", TOPK, NGEN);
    for (int a = 3; a < n_prompts; a++) {
        const char *text = argv[a];
        int cap = (int)strlen(text) + 8;
        llama_token *toks = malloc(sizeof(llama_token) * (size_t)(cap + NGEN));
        int n = llama_tokenize(vocab, text, (int)strlen(text), toks, cap, true, true);
        if (n <= 0) return 1;
        llama_memory_clear(llama_get_memory(ctx), true);
        struct llama_batch bt = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) {
            bt.token[i] = toks[i];
            bt.pos[i] = i;
            bt.n_seq_id[i] = 1;
            bt.seq_id[i][0] = 0;
            bt.logits[i] = 1;
        }
        bt.n_tokens = n;
        if (llama_decode(ctx, bt)) return 1;
        printf("  {\"text\": ");
        json_str(text);
        printf(",\n   \"tokens\": [");
        for (int i = 0; i < n; i++) printf("%s%d", i ? ", " : "", toks[i]);
        printf("],\n   \"prompt_top\": [\n");
        for (int i = 0; i < n; i++) {
            printf("    ");
            print_top(llama_get_logits_ith(ctx, i), n_vocab);
            printf("%s\n", i + 1 < n ? "," : "");
        }
        llama_batch_free(bt);
        int next = argmax(llama_get_logits_ith(ctx, n - 1), n_vocab);
        int gen[NGEN];
        printf("   ],\n   \"gen_top\": [\n");
        for (int g = 0; g < NGEN; g++) {
            gen[g] = next;
            llama_token t = next;
            struct llama_batch one = llama_batch_get_one(&t, 1);
            if (llama_decode(ctx, one)) return 1;
            const float *lg = llama_get_logits_ith(ctx, -1);
            printf("    ");
            print_top(lg, n_vocab);
            printf("%s\n", g + 1 < NGEN ? "," : "");
            next = argmax(lg, n_vocab);
        }
        printf("   ],\n   \"greedy\": [");
        for (int g = 0; g < NGEN; g++) printf("%s%d", g ? ", " : "", gen[g]);
        printf("]}%s\n", a + 1 < n_prompts ? "," : "");
        free(toks);
    }
    printf(" ],\n \"tokenize\": [\n");
    for (int a = n_prompts + 1; a < argc; a++) {
        const char *text = argv[a];
        int cap = (int)strlen(text) + 8;
        llama_token *toks = malloc(sizeof(llama_token) * (size_t)cap);
        printf("  {\"text\": ");
        json_str(text);
        for (int plain = 0; plain < 2; plain++) {
            int n = llama_tokenize(vocab, text, (int)strlen(text), toks, cap, !plain, !plain);
            if (n < 0) return 1;
            printf(", \"%s\": [", plain ? "plain" : "special");
            for (int i = 0; i < n; i++) printf("%s%d", i ? ", " : "", toks[i]);
            printf("]");
            int tcap = 16 * cap + 16;
            char *back = malloc((size_t)tcap);
            int nb = llama_detokenize(vocab, toks, n, back, tcap - 1, false, !plain);
            if (nb < 0) return 1;
            back[nb] = 0;
            printf(", \"%s_text\": ", plain ? "plain" : "special");
            json_str(back);
            free(back);
        }
        printf("}%s\n", a + 1 < argc ? "," : "");
        free(toks);
    }
    printf(" ]}\n");
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
