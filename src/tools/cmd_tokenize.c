/*
 * cmd_tokenize.c: `cascade tokenize [-m MODEL] TEXT`. Prints the token ids of
 * TEXT under the model's tokenizer as one JSON array on one line, so scripts
 * can compare them with another tokenizer. Special tokens written in the
 * text (<|im_start|>) become their ids, and BOS/EOS are added where the
 * model file asks for them; flags turn either off.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/model.h"
#include "tools.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static void usage(FILE *f) {
    fprintf(f,
            "usage: cascade tokenize [options] TEXT...\n"
            "  -m, --model PATH   GGUF model (default " DEFAULT_MODEL ")\n"
            "  --no-parse-special treat special-token text such as <|im_start|> as plain text\n"
            "  --no-add-special   do not add BOS/EOS even where the model asks for them\n"
            "  --pieces           also print each token's vocabulary text, one per line, on stderr\n"
            "Several TEXT arguments are joined with single spaces.\n");
}

int cmd_tokenize(int argc, char **argv) {
    const char *model = DEFAULT_MODEL;
    unsigned flags = CAS_TOK_PARSE_SPECIAL | CAS_TOK_ADD_SPECIAL;
    int pieces = 0, first_text = 0, opts_done = 0;
    size_t text_len = 0;
    char *text = NULL;
    int rc = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!opts_done && (!strcmp(a, "-h") || !strcmp(a, "--help"))) {
            usage(stdout);
            return 0;
        } else if (!opts_done && (!strcmp(a, "-m") || !strcmp(a, "--model"))) {
            if (i + 1 >= argc) {
                fprintf(stderr, "tokenize: %s needs a path\n", a);
                return 2;
            }
            model = argv[++i];
        } else if (!opts_done && !strcmp(a, "--no-parse-special")) {
            flags &= ~(unsigned)CAS_TOK_PARSE_SPECIAL;
        } else if (!opts_done && !strcmp(a, "--no-add-special")) {
            flags &= ~(unsigned)CAS_TOK_ADD_SPECIAL;
        } else if (!opts_done && !strcmp(a, "--pieces")) {
            pieces = 1;
        } else if (!opts_done && !strcmp(a, "--")) {
            opts_done = 1;
        } else if (!opts_done && a[0] == '-' && a[1]) {
            fprintf(stderr, "tokenize: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        } else {
            size_t n = strlen(a);
            char *p = realloc(text, text_len + n + 2);
            if (!p) {
                free(text);
                fprintf(stderr, "tokenize: out of memory\n");
                return 1;
            }
            text = p;
            if (first_text++) text[text_len++] = ' ';
            memcpy(text + text_len, a, n + 1);
            text_len += n;
        }
    }
    if (!text) {
        usage(stderr);
        return 2;
    }

    cas_gguf *g = NULL;
    cas_tok *tok = NULL;
    int32_t *ids = NULL;
    if (cas_gguf_open(model, &g) != CAS_OK) {
        fprintf(stderr, "tokenize: %s\n", cas_last_error());
        if (!strcmp(model, DEFAULT_MODEL)) fprintf(stderr, "tokenize: run `make model` to fetch the default model\n");
        goto done;
    }
    if (cas_tok_create(g, &tok) != CAS_OK) {
        fprintf(stderr, "tokenize: %s\n", cas_last_error());
        goto done;
    }
    size_t cap = cas_tok_max_ids(tok, text_len), n = 0;
    ids = malloc(cap * sizeof *ids);
    if (!ids || cas_tok_encode(tok, text, text_len, flags, ids, cap, &n) != CAS_OK) {
        fprintf(stderr, "tokenize: %s\n", ids ? cas_last_error() : "out of memory");
        goto done;
    }
    printf("[");
    for (size_t i = 0; i < n; i++) printf("%s%d", i ? ", " : "", (int)ids[i]);
    printf("]\n");
    if (pieces)
        for (size_t i = 0; i < n; i++) {
            size_t l;
            const char *s = cas_tok_text(tok, ids[i], &l);
            fprintf(stderr, "%6d  %.*s\n", (int)ids[i], (int)l, s);
        }
    rc = 0;
done:
    free(ids);
    free(text);
    cas_tok_destroy(tok);
    cas_gguf_close(g);
    return rc;
}
