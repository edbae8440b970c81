/*
 * cmd_generate.c: `cascade generate`, text generation for one or several
 * prompts straight on the model layer (no engine, no server): every step is
 * one cas_model_forward over all live sequences, prefill chunks and decode
 * tokens together.
 *
 * Pages: this command is its own tiny block manager. Each sequence gets the
 * pages its prompt plus its generation need, once, at the start. A sequence
 * whose prompt shares a prefix with an earlier one points its page table at
 * that one's full pages instead of computing them again, and waits until
 * they are written (it may run in the same step: a forward writes every new
 * token's K/V before attention). The attention planner sees the shared pages
 * and reads them once for all sequences (cascade). The real prefix cache and
 * continuous batching live in the engine.
 *
 * Output: one prompt streams as it is generated; several prompts print each
 * answer, labelled, as it finishes. Timing goes to stderr at the end.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/model.h"
#include "tools.h"

#define DEFAULT_MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define PAGE 16
#define MAX_STOPS 16

static void usage(FILE *f) {
    fprintf(f,
            "usage: cascade generate [options] -p PROMPT [-p PROMPT ...]\n"
            "  -m, --model PATH     GGUF model (default " DEFAULT_MODEL ")\n"
            "  -p, --prompt TEXT    a prompt; repeat for several, generated together in one batch\n"
            "  --file PATH          more prompts, one per line (blank lines skipped)\n"
            "  --chat               wrap each prompt in the model's chat template as a user turn\n"
            "  --system TEXT        system message for --chat\n"
            "  -n, --max-tokens N   tokens to generate per prompt (default 128)\n"
            "  --temperature T      0 = greedy (default 0.7)\n"
            "  --top-k K            0 = off (default 40)\n"
            "  --top-p P            1 = off (default 0.95)\n"
            "  --min-p P            0 = off (default 0.05)\n"
            "  --seed S             random seed of every request (default 42)\n"
            "  --stop TEXT          stop when TEXT appears (repeatable)\n"
            "  --threads N          CPU threads (default: all cores)\n"
            "  --ctx N              context window per sequence (default: the model's, at most 8192)\n"
            "  --no-cascade         flat attention (no shared-prefix passes)\n"
            "  --no-share           give every sequence its own pages (no prefix page sharing)\n"
            "  -q, --quiet          print only the answers (no statistics)\n");
}

typedef struct {
    char *text;            /* the prompt as typed */
    int32_t *ids;          /* prompt tokens then generated ones */
    int32_t n_prompt, n_gen, cap;
    int32_t *pages, n_pages;
    int32_t n_done;        /* tokens with K/V in the cache */
    int32_t dep, dep_tokens; /* waits for sequence dep to have dep_tokens done (shared pages) */
    int32_t pending;       /* sampled token not yet fed, or -1 */
    int finished;
    cas_sampler *sampler;
    cas_stopper *stopper;
    char *out;             /* the answer (several prompts) */
    size_t out_len, out_cap;
} seq_t;

static int parse_int(const char *s, long lo, long hi, int32_t *out) {
    char *e;
    long v = strtol(s, &e, 10);
    if (!*s || *e || v < lo || v > hi) return 0;
    *out = (int32_t)v;
    return 1;
}

static int parse_float(const char *s, float *out) {
    char *e;
    double v = strtod(s, &e);
    if (!*s || *e) return 0;
    *out = (float)v;
    return 1;
}

static int append(seq_t *s, const char *p, size_t n) {
    if (s->out_len + n + 1 > s->out_cap) {
        size_t c = s->out_cap ? s->out_cap * 2 : 256;
        while (c < s->out_len + n + 1) c *= 2;
        char *q = realloc(s->out, c);
        if (!q) return 0;
        s->out = q;
        s->out_cap = c;
    }
    memcpy(s->out + s->out_len, p, n);
    s->out_len += n;
    s->out[s->out_len] = 0;
    return 1;
}

int cmd_generate(int argc, char **argv) {
    const char *model_path = DEFAULT_MODEL, *system_msg = NULL, *file = NULL;
    const char *stops[MAX_STOPS];
    int32_t n_stops = 0, max_tokens = 128, threads = 0, ctx = 0;
    int chat = 0, no_cascade = 0, no_share = 0, quiet = 0;
    cas_sampler_params sp = cas_sampler_params_default();
    char **texts = NULL, *file_buf = NULL;
    int32_t n_texts = 0;
    int rc = 1;
    cas_model *model = NULL;
    cas_tok *tok = NULL;
    cas_chat_template tpl;
    memset(&tpl, 0, sizeof tpl);
    cas_kv_cache *kv = NULL;
    seq_t *seqs = NULL;
    int32_t *b_tokens = NULL, *b_qo = NULL, *b_kvp = NULL, *b_idx = NULL, *b_last = NULL, *b_seq = NULL;
    float *logits = NULL;

#define NEED_ARG()                                                                     \
    do {                                                                               \
        if (i + 1 >= argc) {                                                           \
            fprintf(stderr, "generate: %s needs a value\n", a);                        \
            goto usage_fail;                                                           \
        }                                                                              \
    } while (0)
#define BAD_VALUE()                                                                    \
    do {                                                                               \
        fprintf(stderr, "generate: invalid value '%s' for %s\n", argv[i], a);          \
        goto usage_fail;                                                               \
    } while (0)
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            free(texts);
            return 0;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            NEED_ARG();
            model_path = argv[++i];
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            NEED_ARG();
            char **t = realloc(texts, sizeof(char *) * (size_t)(n_texts + 1));
            if (!t) goto oom;
            texts = t;
            texts[n_texts++] = argv[++i];
        } else if (!strcmp(a, "--file")) {
            NEED_ARG();
            file = argv[++i];
        } else if (!strcmp(a, "--chat")) {
            chat = 1;
        } else if (!strcmp(a, "--system")) {
            NEED_ARG();
            system_msg = argv[++i];
        } else if (!strcmp(a, "-n") || !strcmp(a, "--max-tokens")) {
            NEED_ARG();
            if (!parse_int(argv[++i], 1, 1 << 20, &max_tokens)) BAD_VALUE();
        } else if (!strcmp(a, "--temperature")) {
            NEED_ARG();
            if (!parse_float(argv[++i], &sp.temperature)) BAD_VALUE();
        } else if (!strcmp(a, "--top-k")) {
            NEED_ARG();
            if (!parse_int(argv[++i], -(1L << 30), 1L << 30, &sp.top_k)) BAD_VALUE();
        } else if (!strcmp(a, "--top-p")) {
            NEED_ARG();
            if (!parse_float(argv[++i], &sp.top_p)) BAD_VALUE();
        } else if (!strcmp(a, "--min-p")) {
            NEED_ARG();
            if (!parse_float(argv[++i], &sp.min_p)) BAD_VALUE();
        } else if (!strcmp(a, "--seed")) {
            NEED_ARG();
            char *e;
            sp.seed = strtoull(argv[++i], &e, 10);
            if (!*argv[i] || *e) BAD_VALUE();
        } else if (!strcmp(a, "--stop")) {
            NEED_ARG();
            if (n_stops >= MAX_STOPS) {
                fprintf(stderr, "generate: at most %d stop strings\n", MAX_STOPS);
                goto usage_fail;
            }
            stops[n_stops++] = argv[++i];
        } else if (!strcmp(a, "--threads")) {
            NEED_ARG();
            if (!parse_int(argv[++i], 1, 1024, &threads)) BAD_VALUE();
        } else if (!strcmp(a, "--ctx")) {
            NEED_ARG();
            if (!parse_int(argv[++i], 1, 1 << 20, &ctx)) BAD_VALUE();
        } else if (!strcmp(a, "--no-cascade")) {
            no_cascade = 1;
        } else if (!strcmp(a, "--no-share")) {
            no_share = 1;
        } else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) {
            quiet = 1;
        } else {
            fprintf(stderr, "generate: unknown option '%s'\n", a);
            goto usage_fail;
        }
    }
    if (cas_sampler_params_check(&sp) != CAS_OK) {
        fprintf(stderr, "generate: %s\n", cas_last_error());
        free(texts);
        return 2;
    }
    /* prompts from the file: one per line */
    if (file) {
        FILE *f = fopen(file, "rb");
        if (!f) {
            fprintf(stderr, "generate: cannot open %s\n", file);
            goto done;
        }
        size_t cap = 0, len = 0;
        char chunk[4096];
        size_t got;
        while ((got = fread(chunk, 1, sizeof chunk, f)) > 0) {
            if (len + got + 1 > cap) {
                cap = (len + got + 1) * 2;
                char *q = realloc(file_buf, cap);
                if (!q) {
                    fclose(f);
                    goto oom;
                }
                file_buf = q;
            }
            memcpy(file_buf + len, chunk, got);
            len += got;
        }
        fclose(f);
        if (file_buf) {
            file_buf[len] = 0;
            for (char *line = strtok(file_buf, "\n"); line; line = strtok(NULL, "\n")) {
                if (!*line || !strcmp(line, "\r")) continue;
                char **t = realloc(texts, sizeof(char *) * (size_t)(n_texts + 1));
                if (!t) goto oom;
                texts = t;
                texts[n_texts++] = line;
            }
        }
    }
    if (n_texts == 0) {
        fprintf(stderr, "generate: no prompt (use -p TEXT or --file PATH)\n");
        goto usage_fail;
    }

    /* model, tokenizer, template */
    seqs = calloc((size_t)n_texts, sizeof(seq_t));
    if (!seqs) goto oom;
    cas_model_opts mo = cas_model_opts_default();
    mo.max_batch_tokens = 512;
    mo.max_seqs = n_texts;
    mo.max_logits = n_texts;
    mo.threads = threads;
    mo.cascade = no_cascade ? CAS_CASCADE_OFF : CAS_CASCADE_AUTO;
    if (mo.max_batch_tokens < n_texts) mo.max_batch_tokens = n_texts;
    double t_load = cas_now_s();
    if (cas_model_load(model_path, &mo, &model) != CAS_OK) {
        fprintf(stderr, "generate: %s: %s\n", model_path, cas_last_error());
        goto done;
    }
    if (cas_tok_create(cas_model_gguf(model), &tok) != CAS_OK) {
        fprintf(stderr, "generate: tokenizer: %s\n", cas_last_error());
        goto done;
    }
    if (chat && cas_chat_template_from_gguf(cas_model_gguf(model), &tpl) != CAS_OK) {
        fprintf(stderr, "generate: --chat: %s\n", cas_last_error());
        goto done;
    }
    const cas_model_config *cfg = cas_model_config_of(model);
    if (ctx == 0) ctx = cfg->n_ctx_train < 8192 ? cfg->n_ctx_train : 8192;
    t_load = cas_now_s() - t_load;

    /* tokenize; check lengths against the context window */
    int64_t total_pages = 0;
    for (int32_t i = 0; i < n_texts; i++) {
        seq_t *s = &seqs[i];
        s->pending = -1;
        s->dep = -1;
        char *rendered = NULL;
        const char *text = texts[i];
        unsigned flags = CAS_TOK_ADD_SPECIAL;
        if (chat) {
            cas_chat_msg msgs[2];
            size_t nm = 0;
            if (system_msg) msgs[nm++] = (cas_chat_msg){"system", system_msg};
            msgs[nm++] = (cas_chat_msg){"user", texts[i]};
            if (cas_chat_apply(&tpl, msgs, nm, 1, &rendered) != CAS_OK) {
                fprintf(stderr, "generate: chat template: %s\n", cas_last_error());
                goto done;
            }
            text = rendered;
            flags = CAS_TOK_PARSE_SPECIAL | (tpl.includes_bos ? 0u : CAS_TOK_ADD_SPECIAL);
        }
        size_t len = strlen(text), n = 0;
        s->cap = (int32_t)(len + 2 + (size_t)max_tokens);
        s->ids = malloc(sizeof(int32_t) * (size_t)s->cap);
        if (!s->ids) {
            free(rendered);
            goto oom;
        }
        cas_status st = cas_tok_encode(tok, text, len, flags, s->ids, len + 2, &n);
        free(rendered);
        if (st != CAS_OK) {
            fprintf(stderr, "generate: prompt %d: %s\n", i + 1, cas_last_error());
            goto done;
        }
        if (n == 0) {
            fprintf(stderr, "generate: prompt %d is empty\n", i + 1);
            goto done;
        }
        if ((int64_t)n + max_tokens > ctx) {
            fprintf(stderr,
                    "generate: prompt %d has %zu tokens; with -n %d that exceeds the context window of "
                    "%d tokens\n",
                    i + 1, n, max_tokens, ctx);
            goto done;
        }
        s->n_prompt = (int32_t)n;
        s->text = texts[i];
        total_pages += (n + (size_t)max_tokens + PAGE - 1) / PAGE;
        if (cas_sampler_create(&sp, cfg->n_vocab, &s->sampler) != CAS_OK ||
            cas_stopper_create(stops, n_stops, &s->stopper) != CAS_OK) {
            fprintf(stderr, "generate: %s\n", cas_last_error());
            goto done;
        }
    }

    /* pages: share the full pages of the longest common prefix with an earlier prompt (keeping
     * at least one prompt token to compute, whose logits start the generation) */
    if (cas_kv_cache_create(model, (int32_t)total_pages, PAGE, CAS_F16, &kv) != CAS_OK) {
        fprintf(stderr, "generate: KV cache: %s\n", cas_last_error());
        goto done;
    }
    int32_t next_page = 0, shared_tokens = 0;
    for (int32_t i = 0; i < n_texts; i++) {
        seq_t *s = &seqs[i];
        int32_t need = (s->n_prompt + max_tokens + PAGE - 1) / PAGE;
        s->pages = malloc(sizeof(int32_t) * (size_t)need);
        if (!s->pages) goto oom;
        int32_t best = -1, best_len = 0;
        for (int32_t j = 0; j < i && !no_share; j++) {
            int32_t l = 0, lim = s->n_prompt - 1 < seqs[j].n_prompt ? s->n_prompt - 1 : seqs[j].n_prompt;
            while (l < lim && s->ids[l] == seqs[j].ids[l]) l++;
            if (l > best_len) best = j, best_len = l;
        }
        int32_t shp = best >= 0 ? best_len / PAGE : 0;
        for (int32_t p = 0; p < shp; p++) s->pages[p] = seqs[best].pages[p];
        for (int32_t p = shp; p < need; p++) s->pages[p] = next_page++;
        s->n_pages = need;
        if (shp > 0) {
            s->dep = best;
            s->dep_tokens = shp * PAGE;
            s->n_done = shp * PAGE;
            shared_tokens += shp * PAGE;
        }
    }

    /* batch scratch */
    int32_t B = n_texts, T = mo.max_batch_tokens;
    b_tokens = malloc(sizeof(int32_t) * (size_t)T);
    b_qo = malloc(sizeof(int32_t) * (size_t)(B + 1));
    b_kvp = malloc(sizeof(int32_t) * (size_t)(B + 1));
    b_idx = malloc(sizeof(int32_t) * (size_t)total_pages);
    b_last = malloc(sizeof(int32_t) * (size_t)B);
    b_seq = malloc(sizeof(int32_t) * (size_t)B);
    logits = malloc(sizeof(float) * (size_t)B * (size_t)cfg->n_vocab);
    if (!b_tokens || !b_qo || !b_kvp || !b_idx || !b_last || !b_seq || !logits) goto oom;

    int64_t prompt_computed = 0, generated = 0;
    double t0 = cas_now_s(), t_first_all = 0, t_prefill_done = 0;
    int32_t live = n_texts, steps = 0, cascade_steps = 0;
    while (live > 0) {
        int32_t nb = 0, nt = 0, np = 0;
        b_qo[0] = b_kvp[0] = 0;
        int any_prefill = 0;
        for (int32_t i = 0; i < n_texts && nt < T; i++) {
            seq_t *s = &seqs[i];
            if (s->finished) continue;
            int32_t take;
            const int32_t *src;
            if (s->pending >= 0) { /* decode */
                take = 1;
                src = &s->pending;
            } else { /* prefill chunk, once the pages it shares are written */
                if (s->dep >= 0 && seqs[s->dep].n_done < s->dep_tokens) continue;
                take = s->n_prompt - s->n_done;
                if (take > T - nt) take = T - nt;
                src = s->ids + s->n_done;
                any_prefill = 1;
                prompt_computed += take;
            }
            memcpy(b_tokens + nt, src, sizeof(int32_t) * (size_t)take);
            nt += take;
            s->n_done += take; /* visible to later sequences of this same step */
            int32_t npg = (s->n_done + PAGE - 1) / PAGE;
            memcpy(b_idx + np, s->pages, sizeof(int32_t) * (size_t)npg);
            np += npg;
            b_last[nb] = s->n_done - (npg - 1) * PAGE;
            b_seq[nb] = i;
            nb++;
            b_qo[nb] = nt;
            b_kvp[nb] = np;
        }
        cas_model_batch mb = {nb, b_tokens, b_qo, b_kvp, b_idx, b_last, 0, NULL};
        if (cas_model_forward(model, kv, &mb, logits) != CAS_OK) {
            fprintf(stderr, "generate: forward: %s\n", cas_last_error());
            goto done;
        }
        steps++;
        if (!any_prefill && t_prefill_done == 0) t_prefill_done = cas_now_s();
        (void)cascade_steps;
        for (int32_t k = 0; k < nb; k++) {
            seq_t *s = &seqs[b_seq[k]];
            if (s->n_done < s->n_prompt) continue; /* mid-prompt chunk: no token yet */
            int32_t t = cas_sampler_sample(s->sampler, logits + (size_t)k * cfg->n_vocab);
            s->ids[s->n_prompt + s->n_gen++] = t;
            generated++;
            s->pending = t;
            int stop = cas_tok_is_eog(tok, t);
            const char *emit = "";
            size_t emit_len = 0;
            if (!stop) {
                size_t pl = 0;
                const char *piece = cas_tok_piece(tok, t, 0, &pl);
                stop = cas_stopper_push(s->stopper, piece ? piece : "", pl, &emit, &emit_len);
            }
            if (!stop && s->n_gen >= max_tokens) {
                stop = 1;
                const char *e2;
                size_t l2;
                if (n_texts == 1) fwrite(emit, 1, emit_len, stdout);
                else append(s, emit, emit_len);
                cas_stopper_flush(s->stopper, &e2, &l2);
                emit = e2;
                emit_len = l2;
            }
            if (n_texts == 1) {
                fwrite(emit, 1, emit_len, stdout);
                fflush(stdout);
            } else if (!append(s, emit, emit_len)) {
                goto oom;
            }
            if (stop) {
                s->finished = 1;
                live--;
                if (n_texts == 1) {
                    printf("\n");
                } else {
                    printf("=== [%d] %s\n%s\n\n", b_seq[k] + 1, s->text, s->out ? s->out : "");
                }
                fflush(stdout);
            }
        }
        if (t_first_all == 0) {
            int all = 1;
            for (int32_t i = 0; i < n_texts; i++) all &= seqs[i].n_gen > 0;
            if (all) t_first_all = cas_now_s();
        }
    }
    double t_end = cas_now_s();
    if (t_prefill_done == 0) t_prefill_done = t_end;
    if (!quiet) {
        char threads_txt[16];
        if (threads) snprintf(threads_txt, sizeof threads_txt, "%d", threads);
        else snprintf(threads_txt, sizeof threads_txt, "all");
        double pre_s = t_first_all - t0, gen_s = t_end - t_first_all;
        int64_t gen_after = generated - n_texts;
        fprintf(stderr,
                "\n%d sequence%s, %d steps, threads %s, cascade %s, model load %.2f s\n"
                "prompt:     %lld tokens computed (%d more from shared pages) in %.3f s = %.1f tokens/s\n"
                "generation: %lld tokens in %.3f s = %.1f tokens/s (after each sequence's first token)\n",
                n_texts, n_texts == 1 ? "" : "s", steps, threads_txt,
                no_cascade ? "off" : "auto", t_load, (long long)prompt_computed, shared_tokens, pre_s,
                pre_s > 0 ? (double)prompt_computed / pre_s : 0.0, (long long)gen_after, gen_s,
                gen_s > 0 ? (double)gen_after / gen_s : 0.0);
    }
    rc = 0;
    goto done;

oom:
    fprintf(stderr, "generate: out of memory\n");
    rc = 1;
done:
    if (seqs)
        for (int32_t i = 0; i < n_texts; i++) {
            free(seqs[i].ids);
            free(seqs[i].pages);
            free(seqs[i].out);
            cas_sampler_destroy(seqs[i].sampler);
            cas_stopper_destroy(seqs[i].stopper);
        }
    free(seqs);
    free(b_tokens);
    free(b_qo);
    free(b_kvp);
    free(b_idx);
    free(b_last);
    free(b_seq);
    free(logits);
    cas_kv_cache_destroy(kv);
    cas_chat_template_free(&tpl);
    cas_tok_destroy(tok);
    cas_model_destroy(model);
    free(texts);
    free(file_buf);
    return rc;
usage_fail:
    usage(stderr);
    free(texts);
    free(file_buf);
    return 2;
}
