/*
 * engine.h: the serving engine's public API. An engine owns a model, a KV
 * block pool with automatic prefix caching, a scheduler doing continuous
 * batching with chunked prefill, and the attention planner that turns every
 * step's block tables into a cascade plan. Requests go in from any thread;
 * outputs come back through a callback (called on the engine's thread) as
 * tokens are produced.
 *
 * Threads. cas_engine_submit, cas_engine_abort and cas_engine_get_stats are
 * safe from any thread. cas_engine_step and cas_engine_run_until_idle must be
 * called from one thread at a time (the engine thread); cas_engine_start runs
 * such a thread in the background until cas_engine_stop. Callbacks run on the
 * engine thread and must not block; they may call submit and abort.
 */
#ifndef CASCADE_ENGINE_H
#define CASCADE_ENGINE_H

#include <stdint.h>

#include "../core/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cas_engine cas_engine;

/* The most GPUs of tensor parallelism (cas_engine_opts.tensor_parallel). */
#define CAS_ENGINE_MAX_TENSOR_PARALLEL 8

/* Where the model runs. AUTO: a CUDA device when this build has the CUDA
 * backend and the machine a GPU, else the CPU. */
typedef enum { CAS_DEVICE_AUTO = 0, CAS_DEVICE_CPU = 1, CAS_DEVICE_CUDA = 2 } cas_device;

typedef struct {
    const char *model_path;   /* GGUF file */
    cas_device device;        /* default CAS_DEVICE_AUTO */
    int32_t gpu_device;       /* CUDA device ordinal (default 0) */
    float gpu_memory_fraction; /* CUDA: the share of the GPU's memory the engine may hold in all
                                  (weights, buffers, KV pool), as vLLM's gpu_memory_utilization;
                                  the KV pool gets what the weights and buffers leave of it.
                                  0 = 0.9. A kv_cache_bytes > 0 sizes the pool instead. */
    int32_t threads;          /* CPU threads, 0 = all cores */
    int64_t kv_cache_bytes;   /* memory budget of the KV block pool; 0 = 256 MiB on the CPU,
                                 gpu_memory_fraction's rest on a GPU */
    int32_t page_size;        /* tokens per KV block, 1..256; 0 = 16 */
    int32_t max_batch_tokens; /* tokens per step (decode tokens + prefill chunks); 0 = 512 */
    float max_itl_ms;         /* target of a step's time, in ms, while requests decode: prefill
                                 chunks are cut so that running streams wait about this long
                                 between tokens, from a cost model fitted to measured steps, and
                                 short prompts are prefilled before long ones (sched.h);
                                 cas_engine_opts_default: 100 (10 tokens/s per stream, faster than
                                 anyone reads); 0 = off, prefill takes the whole token budget */
    int32_t max_seqs;         /* sequences per step; 0 = 256 */
    int32_t max_context;      /* tokens per sequence; 0 = the model's context length */
    int32_t cascade;          /* 1: cascade attention chosen by the cost model; 0: flat; 2: every
                                 run of pages two requests share as a cascade pass, whatever
                                 the cost model says (tests: the cascade path on any device) */
    int32_t tensor_parallel;  /* CUDA: 0 (default): the model on gpu_device alone; N >= 1: split
                                 over N GPUs, gpu_device to gpu_device + N - 1, one thread each,
                                 NCCL all-reduces (cas_gpu_opts.tensor_parallel; the model's
                                 query heads, K/V heads and MLP columns must divide by N; the
                                 KV pool of gpu_memory_fraction or kv_cache_bytes is per GPU) */
    int32_t enforce_eager;    /* CUDA: 1 launches every step's kernels eagerly; 0 (default):
                                 decode steps replay CUDA graphs captured per batch-size bucket
                                 (cas_gpu_opts.graphs), as vLLM without --enforce-eager */
    int32_t prefix_cache;     /* 1: automatic prefix caching; 0: off */
    int32_t no_batch_invariance; /* CPU: 0 (default): a request's tokens and log-probabilities are
                                 bitwise the same whether it runs alone or beside any other
                                 requests, with cascade on or off, with or without prefix cache
                                 hits, chunked or not (cas_model_opts.batch_invariant); 1: the
                                 fastest attention plans instead, whose results vary with the
                                 batch by f32 rounding. The GPU engine is not batch-invariant */
    cas_simd_level simd;      /* the kernels' vector instructions (cas_model_opts.simd): 0 =
                                 CAS_SIMD_AUTO, the CPU's widest; a lower level to compare; a
                                 level the CPU lacks fails create with CAS_ERR_UNSUPPORTED */
    int32_t amx_off;          /* 1: never the AMX tile unit (cas_model_opts.amx_off); 0: where
                                 the CPU and OS allow it */
    int32_t mmap_weights;     /* CPU: 1: the weights stay in the file's shared read-only mapping;
                                 0 (default): the file is read into huge pages, private to this
                                 process (cas_model_opts.mmap_weights: faster decode) */
    int32_t debug_checks;     /* 1: the KV block pool and the scheduler check every invariant
                                 after each change (cas_kv_opts / cas_sched_opts.debug_checks;
                                 O(pool) per call: for tests and debugging); 0: off */
    const char *chat_template; /* Jinja source of the chat template, used instead of the file's
                                 own (with the file's BOS and EOS texts; copied at create, which
                                 fails if it does not compile); NULL (default): the file's */
    /* Optional: called on the creating thread while cas_engine_create reads the
     * model's weights into memory (every page of the mapped file is touched once,
     * so the first requests do not pay the page faults), with bytes read so far
     * and the total; the last call has done == total. NULL: no calls. */
    void (*load_progress)(void *user, int64_t done, int64_t total);
    void *load_progress_user;
} cas_engine_opts;

cas_engine_opts cas_engine_opts_default(void);

typedef enum {
    CAS_FINISH_NONE = 0,   /* still running */
    CAS_FINISH_STOP = 1,   /* end-of-generation token or a stop string */
    CAS_FINISH_LENGTH = 2, /* max_tokens or the context length */
    CAS_FINISH_ABORT = 3,  /* aborted by the caller */
    CAS_FINISH_ERROR = 4   /* failed inside the engine */
} cas_finish_reason;

typedef struct {
    float temperature;   /* 0 = greedy */
    int32_t top_k;       /* 0 = off */
    float top_p;         /* 1 = off */
    float min_p;         /* 0 = off */
    uint64_t seed;       /* per request; same seed, same tokens */
    int32_t max_tokens;  /* >= 1 */
    int32_t n_stop;      /* stop strings (copied at submit) */
    const char *const *stop;
    int32_t logprobs;    /* number of top log-probabilities to report per token (0..20) */
    int32_t ignore_eos;  /* 1: keep going past end-of-generation tokens */
    /* Token ids that end generation when sampled (copied at submit), as
     * end-of-generation tokens do; the token's text is not in the output. */
    int32_t n_stop_token_ids;
    const int32_t *stop_token_ids;
    int32_t min_tokens;  /* >= 0, <= max_tokens: end-of-generation tokens and stop_token_ids
                            are masked (logit -inf) until this many tokens are generated,
                            and stop strings are looked for only in the text after them */
    int32_t include_stop_str; /* 1: the matched stop string, or the stop token's text, stays
                                 in the output (vLLM's include_stop_str_in_output) */
    /* OpenAI's penalties over the generated tokens: the logit of a token
     * generated c > 0 times drops by frequency_penalty * c + presence_penalty;
     * each in [-2, 2], 0 = off */
    float presence_penalty;
    float frequency_penalty;
    float repetition_penalty; /* vLLM's: > 0, 0 or 1 = off; a token of the prompt or the
                                 output has its logit divided by it (logit > 0) or
                                 multiplied by it (logit <= 0) */
    /* OpenAI's logit_bias: logit_bias[i], in [-100, 100], is added to the logit
     * of token logit_bias_ids[i] (copied at submit) */
    int32_t n_logit_bias;
    const int32_t *logit_bias_ids;
    const float *logit_bias;
    int32_t echo;        /* 1: the first event's text is the prompt (the text as given, or the
                            token ids decoded), before any generated text */
    /* Biases, penalties and the min_tokens mask change the row the sampler
     * picks from (greedy too), in cas_logits_adjust's order, before
     * temperature, top-k, min-p and top-p; reported log-probabilities are the
     * model's own (vLLM's raw logprobs). */
} cas_engine_sampling;

cas_engine_sampling cas_engine_sampling_default(void);

/* One event for a request: new text (and tokens) and, at the end, why it finished. */
typedef struct {
    uint64_t id;
    const char *text;          /* new text since the last event (UTF-8, may be empty) */
    size_t text_len;
    const int32_t *tokens;     /* new tokens since the last event */
    int32_t n_tokens;
    const float *logprobs;     /* [n_tokens] log-probability of each new token, or NULL */
    const int32_t *top_ids;    /* [n_tokens][logprobs] top alternatives, or NULL */
    const float *top_logprobs; /* [n_tokens][logprobs] */
    cas_finish_reason finish;  /* CAS_FINISH_NONE until the last event */
    int32_t prompt_tokens;     /* usage, in every event */
    int32_t completion_tokens;
    int32_t cached_tokens;     /* prompt tokens served from the prefix cache */
} cas_engine_event;

typedef void (*cas_engine_cb)(void *user, const cas_engine_event *ev);

typedef struct {
    const char *prompt;        /* text (tokenized with special tokens parsed), or */
    const int32_t *tokens;     /* token ids (used when prompt is NULL) */
    int32_t n_tokens;
    cas_engine_sampling sampling;
    int32_t priority;          /* higher runs first; FCFS within a priority */
    cas_engine_cb cb;          /* required */
    void *user;
} cas_engine_request;

cas_status cas_engine_create(cas_engine **out, const cas_engine_opts *opts);
void cas_engine_destroy(cas_engine *e);

/* Validates and queues a request (copies everything it needs). An empty
 * prompt, a prompt longer than the context, max_tokens < 1 or invalid
 * sampling values are rejected here with CAS_ERR_INVALID and a message; the
 * engine is unaffected. *id is the request's id. */
cas_status cas_engine_submit(cas_engine *e, const cas_engine_request *req, uint64_t *id);

/* Aborts a request: its blocks are freed at the next step boundary (at once
 * when called on the engine thread), and its callback gets a final event with
 * CAS_FINISH_ABORT. Unknown or finished ids are ignored. */
cas_status cas_engine_abort(cas_engine *e, uint64_t id);

/* Runs one step (schedule, forward, sample, update); *busy is 0 when there
 * was nothing to do. */
cas_status cas_engine_step(cas_engine *e, int *busy);

/* Steps until no request is left. */
cas_status cas_engine_run_until_idle(cas_engine *e);

/* A background thread that steps while there is work and sleeps otherwise. */
cas_status cas_engine_start(cas_engine *e);
void cas_engine_stop(cas_engine *e);

typedef struct {
    int32_t running, waiting;
    int64_t kv_blocks_total, kv_blocks_used, kv_blocks_free, kv_blocks_cached;
    int64_t prefix_queries_tokens, prefix_hit_tokens; /* hit rate = hit / queries */
    int64_t prompt_tokens_computed;   /* prompt tokens the model actually ran */
    int64_t prompt_tokens_total;      /* prompt tokens submitted */
    int64_t generation_tokens;
    int64_t steps, cascade_steps;     /* steps, and steps whose plan had a shared pass */
    int64_t requests_finished, requests_aborted, preemptions;
    int64_t itl_limited_steps;        /* steps whose prefill max_itl_ms cut */
    double busy_seconds;              /* time spent in steps */
    /* the last step: its wall time, sequences, new tokens, prompt tokens among
     * them, and the distinct KV tokens its attention must read (every page
     * the batch refers to once: what a step reads at the least) */
    double last_step_s, last_step_predicted_s; /* and the scheduler's cost model's guess */
    int32_t last_step_seqs, last_step_tokens, last_step_prompt_tokens;
    int64_t last_step_kv_tokens;
    /* CUDA: decode steps replayed from graphs, and the other steps */
    int64_t graph_steps, eager_steps;
    double generation_tok_per_s;      /* generation_tokens / busy_seconds */
} cas_engine_stats;

void cas_engine_get_stats(cas_engine *e, cas_engine_stats *st);

/* Model facts the server needs. The strings stay valid until destroy. */
const char *cas_engine_model_name(const cas_engine *e);
/* Where the model runs: CAS_DEVICE_CPU or CAS_DEVICE_CUDA (never AUTO), and
 * in words ("cpu", or "cuda:0 NVIDIA H100 80GB HBM3"). */
cas_device cas_engine_device(const cas_engine *e);
const char *cas_engine_device_name(const cas_engine *e);
/* "auto", "cpu" or "cuda" into *out; -1 for anything else. */
int cas_device_parse(const char *s, cas_device *out);
/* What AUTO means on this machine and build (CPU or CUDA); others unchanged. */
cas_device cas_device_resolve(cas_device d);
int32_t cas_engine_context_length(const cas_engine *e);

/* The bytes of one token (logprob alternatives); NULL for an id outside the
 * vocabulary. Points into the engine; valid until destroy. Thread-safe. */
const char *cas_engine_token_text(const cas_engine *e, int32_t id, size_t *len);

/* Chat: renders messages through the model's chat template with the
 * generation prompt appended. *out is malloc'd; the caller frees it. */
typedef struct {
    const char *role;    /* "system", "user", "assistant" */
    const char *content;
} cas_engine_msg;
cas_status cas_engine_apply_chat(const cas_engine *e, const cas_engine_msg *msgs, int32_t n, char **out);

/* Chat with a caller-made JSON context object for the model's Jinja template
 * (cas_chat_apply_json: messages with tool_calls, role "tool", tools,
 * add_generation_prompt, the template's own variables such as
 * enable_thinking); bos_token and eos_token are added unless the context
 * sets them. CAS_ERR_UNSUPPORTED when the model has no template or the
 * interpreter does not run it; CAS_ERR_INVALID when the template refuses
 * the conversation. *out is malloc'd; the caller frees it. Thread-safe. */
cas_status cas_engine_apply_chat_json(const cas_engine *e, const char *context_json, char **out);

/* How the model's chat template asks for tool calls (cas_chat_template_tools):
 * 0 it never uses tools, 1 as Hermes-style <tool_call> blocks, 2 in another
 * format; -1 the template is not run by the interpreter or there is none.
 * Thread-safe. */
int cas_engine_chat_tools(const cas_engine *e);

/* Token count of a text as a prompt (for errors and usage before submit). */
cas_status cas_engine_count_tokens(const cas_engine *e, const char *text, int32_t *n);

#ifdef __cplusplus
}
#endif

#endif
