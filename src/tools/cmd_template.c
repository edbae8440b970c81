/*
 * cmd_template.c: `cascade template [-m MODEL | -t FILE] [-c CONTEXT]`.
 * Renders a chat template, the model file's own or a Jinja file, over a
 * JSON context ({"messages": [...], "add_generation_prompt": true, ...})
 * and prints the text exactly, with no newline added, so that scripts can
 * compare it byte for byte with another renderer (tools/check_templates.py
 * and tests/check_jinja.py compare it with Python's jinja2).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/model.h"
#include "tools.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static void usage(FILE *f) {
    fprintf(f,
            "usage: cascade template [options]\n"
            "  -m, --model PATH     the chat template of a GGUF model (default " DEFAULT_MODEL ")\n"
            "  -t, --template FILE  a Jinja template file instead\n"
            "  -c, --context FILE   the JSON context object ('-': stdin; default: one user message\n"
            "                       and add_generation_prompt); bos_token and eos_token come from\n"
            "                       the model unless the context sets them\n"
            "  --bos TEXT, --eos TEXT  bos_token and eos_token with --template (default empty)\n"
            "  --now SECONDS        the time strftime_now formats (UTC; default the clock, local)\n"
            "  --steps N            the render's step limit (loop iterations, calls)\n");
}

/* tools.h */
char *cas_tool_read_file(const char *path) {
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) return NULL;
    size_t n = 0, cap = 4096;
    char *s = malloc(cap);
    while (s) {
        n += fread(s + n, 1, cap - n - 1, f);
        if (n + 1 < cap) break;
        char *p = realloc(s, cap * 2);
        if (!p) {
            free(s);
            s = NULL;
        } else {
            s = p;
            cap *= 2;
        }
    }
    if (s && ferror(f)) {
        free(s);
        s = NULL;
    }
    if (s) s[n] = 0;
    if (f != stdin) fclose(f);
    return s;
}

int cmd_template(int argc, char **argv) {
    const char *model = DEFAULT_MODEL, *tfile = NULL, *cfile = NULL, *bos = "", *eos = "";
    cas_jinja_limits lim = {0, 0, 0, -1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && has) {
            model = argv[++i];
        } else if ((!strcmp(a, "-t") || !strcmp(a, "--template")) && has) {
            tfile = argv[++i];
        } else if ((!strcmp(a, "-c") || !strcmp(a, "--context")) && has) {
            cfile = argv[++i];
        } else if (!strcmp(a, "--bos") && has) {
            bos = argv[++i];
        } else if (!strcmp(a, "--eos") && has) {
            eos = argv[++i];
        } else if (!strcmp(a, "--now") && has) {
            lim.now = strtoll(argv[++i], NULL, 10);
        } else if (!strcmp(a, "--steps") && has) {
            lim.max_steps = strtoll(argv[++i], NULL, 10);
        } else {
            fprintf(stderr, "template: unknown option or missing value '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    int rc = 1;
    cas_gguf *g = NULL;
    char *src = NULL, *ctx = NULL, *out = NULL;
    cas_chat_template tpl;
    memset(&tpl, 0, sizeof tpl);
    if (tfile) {
        if (!(src = cas_tool_read_file(tfile))) {
            fprintf(stderr, "template: cannot read %s\n", tfile);
            goto done;
        }
        if (cas_chat_template_create(src, bos, eos, &tpl) != CAS_OK) {
            fprintf(stderr, "template: %s\n", cas_last_error());
            goto done;
        }
    } else {
        if (cas_gguf_open(model, &g) != CAS_OK || cas_chat_template_from_gguf(g, &tpl) != CAS_OK) {
            fprintf(stderr, "template: %s\n", cas_last_error());
            goto done;
        }
    }
    if (cfile) {
        if (!(ctx = cas_tool_read_file(cfile))) {
            fprintf(stderr, "template: cannot read %s\n", cfile);
            goto done;
        }
    } else {
        const char *dflt = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"add_generation_prompt\": true}";
        ctx = malloc(strlen(dflt) + 1);
        if (!ctx) goto done;
        memcpy(ctx, dflt, strlen(dflt) + 1);
    }
    if (cas_chat_apply_json(&tpl, ctx, &lim, &out) != CAS_OK) {
        fprintf(stderr, "template: %s\n", cas_last_error());
        goto done;
    }
    fwrite(out, 1, strlen(out), stdout);
    fflush(stdout);
    rc = 0;
done:
    free(out);
    free(ctx);
    free(src);
    cas_chat_template_free(&tpl);
    cas_gguf_close(g);
    return rc;
}
