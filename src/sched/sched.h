/*
 * sched.h: the scheduler of cascade. Continuous batching under a token budget
 * and a sequence limit, chunked prefill side by side with decodes, FCFS with
 * an optional priority, preemption by recompute when the KV pool runs dry.
 * It sits on the KV block manager (kv.h) and knows nothing of kernels or
 * models: it hands the engine, each step, which tokens of which requests to
 * run and the block tables to run them over, in the compressed-row form the
 * attention core takes (qo_indptr, kv_indptr, kv_indices, kv_last_page_len).
 *
 * One engine step is three calls (as in vLLM v1: schedule, execute, update):
 *
 *     cas_sched_step_plan(s, &plan);   // what to run
 *     ... the engine writes K/V of plan.token_ids at plan.slots, runs the
 *         model, and samples one token for every item with sample = 1 ...
 *     cas_sched_step_done(s, sampled, stop, finished);  // what happened
 *
 * Planning. Running requests keep their order (priority, then arrival).
 * Every running request first gets KV blocks for the tokens sampled last step;
 * when the pool is dry, running requests are preempted from the back of the
 * order (lowest priority, latest arrival), their blocks freed and the request
 * put back in the waiting queue with its generated tokens; it resumes later
 * by recomputing prompt + generated (mostly prefix-cache hits if its blocks
 * were not evicted). Then decodes are scheduled (one token each), then
 * prefill chunks of running requests and newly admitted ones (in the order
 * below); waiting requests are admitted in order while the budget, the
 * sequence limit and the pool allow and they would run this step: admission
 * takes KV blocks for all the request's known tokens at once (minus prefix
 * hits), which registers its full prompt blocks as pending cache keys at
 * once, so requests admitted after it with the same prefix attach to them
 * instead of computing them (cold-cache sharing). A request whose next block
 * is being computed by another request runs nothing until it is computed. The
 * first waiting request that may be admitted blocks the rest (FCFS) while it
 * does not fit; nothing is preempted to admit a request.
 *
 * Prefill order and the step's time. Prefill tokens are handed out after the
 * decodes, to requests with a prompt (or a recompute) left, in this order:
 * short ones first, then long ones, each group in service order. A prefill
 * is long when the tokens it has left to compute exceed long_prefill_tokens
 * (vLLM's long_prefill_token_threshold, 4% of the context by default); a
 * waiting request is classified by what the prefix cache would leave it
 * (cas_kv_match_peek), so a prompt behind a cached system prompt is short.
 * One long prefill runs at a time, as with vLLM's max_long_partial_prefills
 * = 1: while one is in progress, long waiting requests stay queued and short
 * ones behind them are admitted past them (the queue is scanned past at most
 * 64 such long requests a step); the next long one is admitted in the step
 * where those in progress can finish, and gets what they leave. So a short
 * prompt that arrives while a long one is mid-prefill is computed in the
 * next step instead of after it.
 *
 * With max_itl_ms > 0 and decodes in the step, prefill is also cut to time:
 * the scheduler predicts a step's seconds with a linear cost model,
 *
 *     seconds = step_s + token_s * tokens + sample_s * sampled rows
 *             + pair_s * (query, key) pairs of prefill attention
 *             + kv_s * KV tokens that decode rows read,
 *
 * and gives prefill the time the target leaves after the decodes: each
 * chunk is the most tokens whose predicted cost fits what is left (a chunk
 * deep in a long prompt costs more per token: its queries see more keys).
 * The engine reports every step's wall time (cas_sched_observe) and the
 * model is a non-negative least-squares fit to those, steps with and without
 * prefill kept in separate exponentially decayed sums (each forgets with a
 * factor 0.98 a step of its kind) so that a long stretch of decoding does not
 * erase what prefill steps taught. Until it has data it predicts 0, which
 * cuts nothing. Without decodes in the step the whole token budget goes to
 * prefill: nobody waits for a token. When the decodes alone come near or
 * past the target, prefill still gets half the longer of the target and
 * the decodes' own time (so such a step lasts at most 1.5 times that), and
 * prefill never stops: the first prefill of a step runs at least one token.
 *
 * Sharing a step's prefill budget. Short prefills go first, but the oldest
 * long one is guaranteed half of the step's prefill budget, in tokens and
 * (with a target) in time, where it can use it: shorts arriving all the
 * time cannot starve it, and a short one that arrives beside it still gets
 * the other half at once.
 *
 * Progress. A request is accepted only if it fits the pool alone, so the
 * first running request can always advance (everyone behind it can be
 * preempted), waits on shared blocks never form a cycle (kv.h), and every
 * step with work runs at least one token. No request is looped on forever.
 *
 * Ownership. The scheduler borrows the kv pool (it must outlive the
 * scheduler, and nothing else may create sequences in it while the scheduler
 * runs). cas_sched_add copies the prompt. The plan's arrays belong to the
 * scheduler: valid until the next step_plan or destroy.
 *
 * Threads. Not thread-safe: the engine calls everything from its one loop
 * thread (requests submitted from other threads are queued by the engine and
 * added from the loop).
 */
#ifndef CASCADE_SCHED_H
#define CASCADE_SCHED_H

#include "../core/core.h"
#include "../kv/kv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cas_sched cas_sched; /* opaque */

typedef struct {
    int32_t max_tokens_per_step; /* token budget of one step (decodes + prefill chunks) */
    int32_t max_seqs;            /* running requests at most (<= the kv pool's max_seqs) */
    int32_t max_context;         /* prompt + max_new_tokens at most (<= the block-table capacity) */
    int32_t max_prefill_chunk;   /* tokens of one request in one step; 0: the budget */
    int32_t use_priority;        /* 1: higher priority first, FCFS among equals; 0: FCFS */
    int32_t debug_checks;        /* 1: check scheduler and kv invariants every step (the
                                    engine's debug_checks sets it) */
    float max_itl_ms;            /* target of a step's time while requests decode, in
                                    milliseconds: prefill is cut to fit it (see above);
                                    0 = off, prefill takes the whole token budget */
    int32_t long_prefill_tokens; /* a prefill with more tokens left is long; 0 = 4% of
                                    max_context (at least 1); < 0 = none is long: plain
                                    FCFS chunks, the first prefill takes what it can */
} cas_sched_opts;

/* 2048 tokens per step, 64 sequences, max_context from the pool, no chunk cap,
 * FCFS, no time target (the scheduler alone has no step times to fit), long
 * prefills from 4% of the context. */
cas_sched_opts cas_sched_opts_default(void);

/* Creates a scheduler over a kv pool (borrowed; see above). Allocates the
 * plan buffers for the worst step once. Release with cas_sched_destroy. */
cas_status cas_sched_create(cas_kv *kv, const cas_sched_opts *opts, cas_sched **out);
/* Frees the scheduler, every request left (their kv sequences freed). */
void cas_sched_destroy(cas_sched *s);

/* Queues a request. id: the engine's id (unique among live requests).
 * prompt: n_prompt token ids (copied). Rejected with CAS_ERR_INVALID and a
 * message, nothing queued: a duplicate id, an empty prompt, a negative token,
 * max_new_tokens < 1, prompt + max_new_tokens > max_context; with
 * CAS_ERR_NOMEM: a request that could not fit the whole pool alone. May be
 * called between step_plan and step_done (it waits for the next plan). */
cas_status cas_sched_add(cas_sched *s, int64_t id, const int32_t *prompt, int32_t n_prompt,
                         int32_t max_new_tokens, int32_t priority);

/* Removes a request. Its blocks are freed at once, except when it is in the
 * plan in flight (between step_plan and step_done: its pages are being
 * written): then at step_done, which reports it as CAS_SCHED_ABORTED.
 * CAS_ERR_INVALID for an unknown id. */
cas_status cas_sched_abort(cas_sched *s, int64_t id);

/* One request's share of a step. */
typedef struct {
    int64_t id;      /* the request */
    int32_t seq;     /* its kv sequence */
    int32_t q_start; /* position of its first new token (= tokens whose KV is valid) */
    int32_t q_len;   /* new tokens this step, >= 1; rows qo_indptr[i] .. qo_indptr[i+1]-1 */
    int32_t sample;  /* 1: these tokens end the request's known tokens: sample one
                        token from the logits of its last row */
} cas_sched_item;

/* A step. All arrays are owned by the scheduler (valid until the next
 * step_plan). n_items = 0 means there is nothing to run now. */
typedef struct {
    int32_t n_items;
    const cas_sched_item *items; /* [n_items] */
    int32_t n_tokens;            /* total new tokens, qo_indptr[n_items] */
    const int32_t *token_ids;    /* [n_tokens] model inputs, items in order */
    const int32_t *positions;    /* [n_tokens] absolute positions */
    const int32_t *slots;        /* [n_tokens] block * page_size + offset: where each
                                    token's K and V are written */
    /* attention batch: B = n_items; kv_len(i) = q_start + q_len */
    const int32_t *qo_indptr;        /* [n_items + 1] */
    const int32_t *kv_indptr;        /* [n_items + 1] */
    const int32_t *kv_indices;       /* [kv_indptr[n_items]] block ids, in order */
    const int32_t *kv_last_page_len; /* [n_items], 1 .. page_size */
    int32_t n_preempted;             /* requests preempted while planning this step */
    const int64_t *preempted_ids;    /* [n_preempted] */
    int32_t n_waiting_shared;        /* running requests that wait this step for blocks
                                        another request is computing */
    double predicted_s;              /* the cost model's seconds for this step (0 before it
                                        has data) */
    int32_t time_limited;            /* 1: max_itl_ms cut a prefill chunk this step */
} cas_sched_plan;

/* Plans a step into *plan. CAS_ERR_INVALID if the previous plan was not
 * finished with step_done. Errors other than that mean a bug (internal). */
cas_status cas_sched_step_plan(cas_sched *s, cas_sched_plan *plan);

enum {
    CAS_SCHED_RUNNING = 0,         /* still going */
    CAS_SCHED_FINISHED_LENGTH = 1, /* max_new_tokens reached */
    CAS_SCHED_FINISHED_STOP = 2,   /* the engine said stop */
    CAS_SCHED_ABORTED = 3          /* aborted during the step */
};

/* Reports the step planned last: the computed tokens are committed (their
 * blocks become computed and shared), and for every item with sample = 1
 * sampled[i] is appended to the request; stop[i] != 0 (stop may be NULL)
 * finishes it (EOS, a stop string: the engine decides; the token is still
 * appended). Both arrays are indexed like plan.items; sampled is read only
 * where sample = 1 (may be NULL if none). finished (may be NULL) receives
 * one of the codes above per item. Finished requests are removed and their
 * blocks released (cached blocks stay for later hits). */
cas_status cas_sched_step_done(cas_sched *s, const int32_t *sampled, const uint8_t *stop,
                               uint8_t *finished);

/* ---- the step cost model --------------------------------------------------- */

/* Seconds per unit of each term of the model above. */
typedef struct {
    double step_s;   /* per step */
    double token_s;  /* per token run (decode or prefill) */
    double sample_s; /* per row whose logits are sampled */
    double pair_s;   /* per (query, key) pair of a prefill chunk's causal attention:
                        a chunk of n tokens from position p has n*p + n*(n+1)/2 */
    double kv_s;     /* per KV token a one-token row (a decode) attends to */
} cas_sched_cost;

/* Reports the wall time, in seconds, of the step planned last (call it after
 * step_done, once per plan with items; the engine times the whole step). The
 * model is refitted from it unless a fixed model was set. CAS_ERR_INVALID for
 * a negative or non-finite time, or when no step was planned since the last
 * report. */
cas_status cas_sched_observe(cas_sched *s, double seconds);

/* The model in use: fitted, or fixed with cas_sched_set_cost. */
void cas_sched_get_cost(const cas_sched *s, cas_sched_cost *c);

/* Fixes the model (tests; a device measured beforehand): observations are
 * still summed but no longer change it. NULL returns to the fitted model.
 * CAS_ERR_INVALID for a negative or non-finite coefficient. */
cas_status cas_sched_set_cost(cas_sched *s, const cas_sched_cost *c);

/* ---- inspection ---------------------------------------------------------- */

typedef struct {
    int32_t state;         /* 0 waiting, 1 running */
    int32_t n_prompt;
    int32_t n_generated;
    int32_t n_computed;    /* tokens with valid KV (0 while waiting) */
    int32_t n_preemptions;
    int32_t priority;
} cas_sched_req_info;

/* Information on a live (waiting or running) request; CAS_ERR_INVALID when
 * the id is unknown (never added, finished or aborted). */
cas_status cas_sched_get(const cas_sched *s, int64_t id, cas_sched_req_info *info);

typedef struct {
    int32_t running, waiting;
    int64_t steps;                  /* plans with at least one item */
    int64_t scheduled_tokens;       /* all tokens run */
    int64_t prompt_tokens_computed; /* tokens run at prompt positions (recompute included) */
    int64_t decode_tokens;          /* tokens run at generated positions */
    int64_t recomputed_tokens;      /* tokens run again after a preemption */
    int64_t preemptions;
    int64_t finished, aborted, rejected;
    int64_t time_limited_steps;     /* steps whose prefill max_itl_ms cut */
    int64_t observations;           /* step times reported to the cost model */
} cas_sched_stats;

void cas_sched_get_stats(const cas_sched *s, cas_sched_stats *st);

/* Checks the scheduler's own invariants and the kv pool's: every running
 * request holds a kv sequence whose tokens are a prefix of its own, waiting
 * ones hold none, counts and order hold. CAS_OK or CAS_ERR_INTERNAL. */
cas_status cas_sched_check(const cas_sched *s);

#ifdef __cplusplus
}
#endif

#endif
