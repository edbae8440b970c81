/*
 * paged_batch.h: a tiny paged "block manager" for the model tests: sequences
 * take consecutive pages of PAGED_BATCH_PAGE tokens, and a forward's batch
 * (model.h's cas_model_batch) is built from the tokens each adds. Header
 * only, like check.h; the arrays are static scratch of the including test
 * (the tests are single-threaded).
 */
#ifndef CASCADE_TEST_PAGED_BATCH_H
#define CASCADE_TEST_PAGED_BATCH_H

#include "../src/model/model.h"

#define PAGED_BATCH_PAGE 16

typedef struct {
    int32_t pages[512];
    int32_t n_pages;
    int32_t len; /* tokens with K/V in the cache */
} seq_t;

typedef struct {
    int32_t next_page;
} pager_t;

/* Grows s's page table to hold len + add tokens. */
static inline void seq_reserve(pager_t *pg, seq_t *s, int32_t add) {
    int32_t need = (s->len + add + PAGED_BATCH_PAGE - 1) / PAGED_BATCH_PAGE;
    while (s->n_pages < need) s->pages[s->n_pages++] = pg->next_page++;
}

/* The batch of nseq sequences, each adding counts[i] tokens from toks[i] (the
 * sequences' len advance); logits of each sequence's last token, or of every
 * token (all_logits). */
static inline cas_model_batch paged_batch(pager_t *pg, seq_t **seqs, const int32_t *const *toks,
                                          const int32_t *counts, int nseq, int all_logits) {
    static int32_t tokens[4096], qo[65], kvp[65], idx[16384], last[64], rows[4096];
    int32_t T = 0, P = 0;
    qo[0] = kvp[0] = 0;
    for (int i = 0; i < nseq; i++) {
        seq_reserve(pg, seqs[i], counts[i]);
        for (int32_t j = 0; j < counts[i]; j++) tokens[T++] = toks[i][j];
        seqs[i]->len += counts[i];
        int32_t np = (seqs[i]->len + PAGED_BATCH_PAGE - 1) / PAGED_BATCH_PAGE;
        for (int32_t j = 0; j < np; j++) idx[P++] = seqs[i]->pages[j];
        qo[i + 1] = T;
        kvp[i + 1] = P;
        last[i] = seqs[i]->len - (np - 1) * PAGED_BATCH_PAGE;
    }
    cas_model_batch b = {nseq, tokens, qo, kvp, idx, last, 0, NULL};
    if (all_logits) {
        for (int32_t t = 0; t < T; t++) rows[t] = t;
        b.n_logits = T;
        b.logit_rows = rows;
    }
    return b;
}

/* One sequence's forward on the CPU model: n tokens of toks added to s; logits
 * of its last token (all: of every token). */
static inline cas_status paged_forward1(cas_model *m, cas_model_kv *kv, pager_t *pg, seq_t *s,
                                        const int32_t *toks, int32_t n, int all, float *logits) {
    seq_t *sp = s;
    const int32_t *tp = toks;
    const cas_model_batch b = paged_batch(pg, &sp, &tp, &n, 1, all);
    return cas_model_forward(m, kv, &b, logits);
}

#endif
