/*
 * engine.c: the step loop. Each step is three calls, as in the design: the
 * scheduler picks requests and token counts under a token budget (decode
 * tokens and prefill chunks side by side, blocks from the KV pool with
 * automatic prefix caching, preemption when the pool runs dry); the model
 * runs them in one forward pass whose attention plan finds the shared
 * prefixes (cascade); the sampler picks tokens and the scheduler appends
 * them, finishes requests and frees their blocks (cached blocks stay until
 * evicted). Text is streamed to each request's callback as it is produced.
 *
 * Requests enter from any thread through a queue under a mutex; the engine
 * thread moves them into the scheduler at the start of a step, so the HTTP
 * threads never wait for a step and a step never waits for them.
 */
#include "engine.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../gpu/gpu.h"
#include "../kv/kv.h"
#include "../model/model.h"
#include "../sched/sched.h"

#define MAX_LOGPROBS 20

typedef struct req {
    uint64_t id;
    int32_t *prompt;   /* owned */
    int32_t n_prompt;
    cas_engine_sampling sp;
    char **stops;      /* owned copies */
    int32_t priority;
    cas_engine_cb cb;
    void *user;
    cas_sampler *sampler; /* the CPU's draws */
    cas_rng rng;          /* the GPU's draws (the same seed) */
    cas_stopper *stopper;
    /* what the request does to its logits row (cas_engine_sampling) */
    int32_t *stop_ids;    /* [sp.n_stop_token_ids] owned */
    int32_t *bias_ids;    /* [sp.n_logit_bias] owned */
    float *bias;          /* [sp.n_logit_bias] owned */
    int32_t *min_mask;    /* [n_min_mask] ids masked until min_tokens: end-of-generation ids
                             (unless ignore_eos) and stop_ids; owned */
    int32_t n_min_mask;
    int32_t *out_toks;    /* [sp.max_tokens] generated tokens, kept when a penalty needs them */
    int32_t n_out;
    int32_t adjust;       /* 1: biases or penalties: every row is adjusted on the host */
    char *echo;           /* the prompt's text until the first event carries it; owned */
    size_t echo_len;
    int32_t n_generated;
    int32_t cached_tokens;
    int32_t prompt_computed; /* prompt tokens this request ran itself */
    int32_t in_sched;  /* added to the scheduler */
    int32_t abort_req; /* abort asked from another thread */
    char utf8_hold[8]; /* bytes of an incomplete UTF-8 character */
    int32_t n_hold;
    struct req *next;  /* queue / table chain */
} req;

/* The step's forward on the engine's device, one interface with a CPU and a
 * CUDA implementation: runs the batch and leaves in e->row_tokens the token
 * of each wanted row (mb->logit_rows' order; row_req[i] is its request, NULL
 * when gone) and in e->logits the logits of the rows whose request asks for
 * log-probabilities. The CPU computes every wanted row's logits and samples
 * them on the host; the GPU samples on the device, and only the tokens and
 * the asked-for rows cross to the host. */
typedef struct {
    cas_status (*forward)(cas_engine *e, const cas_model_batch *mb, req *const *row_req);
    void (*plan_info)(const cas_engine *e, cas_attn_plan_info *info);
} engine_fwd;

struct cas_engine {
    cas_engine_opts opts;
    const engine_fwd *fwd;
    cas_device device;
    char device_name[300];
    cas_model *model;       /* CPU */
    cas_model_kv *cache;    /* CPU */
    cas_gguf *gguf;         /* GPU: the file (the CPU's is the model's) */
    cas_gpu_model *gpu;     /* GPU */
    cas_gpu_kv *gkv;        /* GPU */
    cas_model_config gcfg;  /* GPU */
    cas_gpu_sample *gsamp;  /* GPU: [max_seqs] the rows' sampling */
    int32_t *row_tokens;    /* [max_seqs] each wanted row's token */
    cas_tok *tok;
    cas_chat_template chat;
    int has_chat;
    cas_kv *kv;
    cas_sched *sched;
    const cas_model_config *cfg;
    int32_t max_context;
    char model_name[256];

    float *logits;      /* [max_seqs][n_vocab] */
    int32_t *logit_rows; /* [max_seqs] */
    req **row_req;      /* [max_seqs] */
    int32_t *sampled;   /* [max_seqs] */
    uint8_t *stop;      /* [max_seqs] */
    uint8_t *finished;  /* [max_seqs] */
    char *text_buf;     /* scratch for one event's text */
    size_t text_cap;
    float *lp_buf;      /* [MAX_LOGPROBS + 1] */
    int32_t *lp_ids;
    uint32_t *page_mark; /* [pages] the step that last counted the page (distinct KV tokens) */
    float *adj_row;      /* [n_vocab] a row with a request's biases and penalties (engine thread) */
    int32_t *adj_scratch; /* [n_vocab] zeros between uses (cas_logits_adjust) */
    cas_sampler_scratch *samp_scratch; /* every request's sampler borrows it (engine thread samples) */
    int32_t *eog_ids;    /* [n_eog] the vocabulary's end-of-generation tokens */
    int32_t n_eog;
    uint32_t mark_step;

    /* requests by id: open hashing */
    req **table;
    int32_t table_cap;

    pthread_mutex_t mu;       /* guards the queues, next_id and stats */
    pthread_cond_t cv;        /* signals new work to the background thread */
    req *incoming_head, *incoming_tail;
    uint64_t *aborts;
    int32_t n_aborts, cap_aborts;
    uint64_t next_id;
    cas_engine_stats stats;

    pthread_t thread;
    int thread_running, thread_stop;
};

cas_engine_opts cas_engine_opts_default(void) {
    cas_engine_opts o;
    memset(&o, 0, sizeof o);
    o.model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    o.cascade = 1;
    o.prefix_cache = 1;
    o.max_itl_ms = 100.0f;
    return o;
}

/* Reads one byte of every page of every tensor, so the mapped weights are in
 * memory before the first request, reporting progress in steps of 4 MiB. */
static void prefault_weights(const cas_gguf *g, void (*progress)(void *, int64_t, int64_t), void *user) {
    int64_t total = 0, done = 0, reported = 0;
    int64_t n = cas_gguf_n_tensors(g);
    for (int64_t i = 0; i < n; i++) total += (int64_t)cas_gguf_tensor_at(g, i)->nbytes;
    if (progress) progress(user, 0, total);
    volatile unsigned char sink = 0;
    for (int64_t i = 0; i < n; i++) {
        const cas_gguf_tensor *t = cas_gguf_tensor_at(g, i);
        const unsigned char *p = t->data;
        for (size_t off = 0; off < t->nbytes; off += 4096) sink ^= p[off];
        done += (int64_t)t->nbytes;
        if (progress && (done - reported >= ((int64_t)4 << 20) || done == total)) {
            progress(user, done, total);
            reported = done;
        }
    }
    (void)sink;
}

cas_engine_sampling cas_engine_sampling_default(void) {
    cas_engine_sampling s;
    memset(&s, 0, sizeof s);
    s.temperature = 0.0f;
    s.top_p = 1.0f;
    s.max_tokens = 16;
    s.seed = 0;
    return s;
}

/* ---- request table ------------------------------------------------------- */

static req **slot_of(cas_engine *e, uint64_t id) {
    uint32_t h = (uint32_t)(id * 0x9e3779b97f4a7c15ull >> 40) & (uint32_t)(e->table_cap - 1);
    return &e->table[h];
}

static void table_put(cas_engine *e, req *r) {
    req **s = slot_of(e, r->id);
    r->next = *s;
    *s = r;
}

static req *table_get(cas_engine *e, uint64_t id) {
    for (req *r = *slot_of(e, id); r; r = r->next)
        if (r->id == id) return r;
    return NULL;
}

static void table_del(cas_engine *e, uint64_t id) {
    for (req **p = slot_of(e, id); *p; p = &(*p)->next)
        if ((*p)->id == id) {
            *p = (*p)->next;
            return;
        }
}

static void req_free(req *r) {
    if (!r) return;
    free(r->prompt);
    if (r->stops)
        for (int32_t i = 0; i < r->sp.n_stop; i++) free(r->stops[i]);
    free(r->stops);
    free(r->stop_ids);
    free(r->bias_ids);
    free(r->bias);
    free(r->min_mask);
    free(r->out_toks);
    free(r->echo);
    cas_sampler_destroy(r->sampler);
    cas_stopper_destroy(r->stopper);
    free(r);
}

/* ---- create / destroy ---------------------------------------------------- */

/* The model is loaded on a short-lived thread. Loading runs OpenMP regions,
 * and libgomp keeps the worker threads of a thread's regions until that
 * thread exits. Loaded on the caller's thread, whose pool then stays idle
 * while another thread (cas_engine_start's) runs the steps with a team of its
 * own, that made three OpenMP threads on two CPUs, and libgomp then cuts the
 * spinning of every worker between regions from 300000 to 100 iterations:
 * the step thread's worker slept and woke between every two regions of a
 * step (`cascade serve` on 2 cores: 76-78% of the offline run's throughput,
 * 88-96% with the load on its own thread). */
typedef struct {
    const char *path;
    const cas_model_opts *mo;
    cas_model **model;
    cas_status st;
    char err[512];
} load_job;

static void *load_model(void *arg) {
    load_job *j = arg;
    j->st = cas_model_load(j->path, j->mo, j->model);
    if (j->st != CAS_OK) snprintf(j->err, sizeof j->err, "%s", cas_last_error());
    return NULL;
}

/* ---- the forward on each device (engine_fwd) ------------------------------ */

/* 1 when r's next token is picked from an adjusted row: biases or penalties,
 * or tokens masked until min_tokens. */
static int needs_adjust(const req *r) { return r->adjust || (r->n_generated < r->sp.min_tokens && r->n_min_mask > 0); }

/* The row r samples its next token from: the model's row, or a copy in
 * e->adj_row with r's mask, biases and penalties applied (cas_logits_adjust).
 * The model's row stays as it is for the reported log-probabilities. */
static const float *sampling_row(cas_engine *e, const req *r, const float *row) {
    if (!needs_adjust(r)) return row;
    const int32_t V = e->cfg->n_vocab;
    memcpy(e->adj_row, row, sizeof(float) * (size_t)V);
    const cas_logit_adjust a = {r->sp.presence_penalty,
                                r->sp.frequency_penalty,
                                r->sp.repetition_penalty,
                                r->sp.n_logit_bias,
                                r->bias_ids,
                                r->bias,
                                r->n_generated < r->sp.min_tokens ? r->n_min_mask : 0,
                                r->min_mask};
    cas_logits_adjust(e->adj_row, V, &a, r->prompt, r->n_prompt, r->out_toks, r->n_out, e->adj_scratch);
    return e->adj_row;
}

static cas_status cpu_forward(cas_engine *e, const cas_model_batch *mb, req *const *row_req) {
    cas_status st = cas_model_forward(e->model, e->cache, mb, e->logits);
    if (st) return st;
    const int32_t V = e->cfg->n_vocab;
    for (int32_t i = 0; i < mb->n_logits; i++) {
        const float *row = e->logits + (size_t)i * V;
        e->row_tokens[i] = row_req[i] ? cas_sampler_sample(row_req[i]->sampler, sampling_row(e, row_req[i], row)) : -1;
    }
    return CAS_OK;
}

static void cpu_plan_info(const cas_engine *e, cas_attn_plan_info *info) { cas_model_plan_info(e->model, info); }

static cas_status gpu_forward(cas_engine *e, const cas_model_batch *mb, req *const *row_req) {
    int any_logits = 0;
    for (int32_t i = 0; i < mb->n_logits; i++) {
        cas_gpu_sample *g = &e->gsamp[i];
        const req *r = row_req[i];
        if (!r) {
            *g = (cas_gpu_sample){0.0f, 0, 1.0f, 0.0f, 0.0f, 0};
            continue;
        }
        g->temperature = r->sp.temperature;
        g->top_k = r->sp.top_k;
        g->top_p = r->sp.top_p;
        g->min_p = r->sp.min_p;
        /* the request's own generator, drawn only when sampling (as the CPU's) */
        g->u = r->sp.temperature > 0.0f ? (float)cas_rng_uniform(&row_req[i]->rng) : 0.0f;
        if (g->u >= 1.0f) g->u = nextafterf(1.0f, 0.0f);
        /* a row with biases, penalties or a mask comes to the host and is picked there */
        g->want_logits = r->sp.logprobs > 0 || needs_adjust(r);
        any_logits |= g->want_logits;
    }
    cas_status st = cas_gpu_forward_sample(e->gpu, e->gkv, mb, e->gsamp, e->row_tokens, any_logits ? e->logits : NULL);
    if (st) return st;
    const int32_t V = e->cfg->n_vocab;
    for (int32_t i = 0; i < mb->n_logits; i++) {
        req *r = row_req[i];
        if (!r || !needs_adjust(r)) continue;
        /* the same draw as the device's, so the request's generator advances alike on either side */
        e->row_tokens[i] = cas_sampler_sample_u(r->sampler, sampling_row(e, r, e->logits + (size_t)i * V), e->gsamp[i].u);
    }
    return CAS_OK;
}

static void gpu_plan_info(const cas_engine *e, cas_attn_plan_info *info) { cas_gpu_plan_info(e->gpu, info); }

static const engine_fwd cpu_fwd = {cpu_forward, cpu_plan_info};
static const engine_fwd gpu_fwd = {gpu_forward, gpu_plan_info};

/* The planner's mode for the engine's cascade option (0 off, 1 auto, 2 all). */
static cas_cascade_mode cascade_mode(int32_t c) {
    return c == 0 ? CAS_CASCADE_OFF : c == 2 ? CAS_CASCADE_ALL : CAS_CASCADE_AUTO;
}

/* The context length: the option, else the model's (2048 when it says none). */
static void set_context(cas_engine *e) {
    e->max_context = e->opts.max_context > 0 ? e->opts.max_context : e->cfg->n_ctx_train;
    if (e->max_context <= 0) e->max_context = 2048;
}

/* The KV pages one full-context sequence needs must fit the pool. */
static cas_status check_pages(const cas_engine *e, int32_t pages, int32_t per_seq, const char *budget) {
    if (pages >= per_seq) return CAS_OK;
    return cas_error(CAS_ERR_INVALID,
                     "engine: %s holds %d KV pages of %d tokens; one full-context sequence needs %d "
                     "(raise the budget or lower the context)",
                     budget, pages, e->opts.page_size, per_seq);
}

/* model_path "synthetic:NAME": a model of a known shape with random weights
 * made on the GPU (cas_model_config_synthetic), always from this seed */
#define SYNTHETIC "synthetic:"
#define SYNTHETIC_SEED 1
static int is_synthetic(const char *path) { return !strncmp(path, SYNTHETIC, strlen(SYNTHETIC)); }

/* CPU: the model (on a short-lived thread, see load_job) and its KV pool. */
static cas_status cpu_open(cas_engine *e, int32_t *pages_out, int32_t *per_seq_out) {
    const cas_engine_opts *o = &e->opts;
    cas_status st;
    if (is_synthetic(o->model_path))
        return cas_error(CAS_ERR_UNSUPPORTED, "engine: synthetic models run on the GPU only (device cuda)");
    cas_model_opts mo = cas_model_opts_default();
    mo.max_batch_tokens = o->max_batch_tokens;
    mo.max_seqs = o->max_seqs;
    mo.max_logits = o->max_seqs;
    mo.threads = o->threads;
    mo.cascade = cascade_mode(o->cascade);
    mo.simd = o->simd;
    mo.amx_off = o->amx_off;
    mo.mmap_weights = o->mmap_weights;
    mo.batch_invariant = !o->no_batch_invariance;
    load_job job = {.path = o->model_path, .mo = &mo, .model = &e->model, .st = CAS_OK, .err = ""};
    pthread_t loader;
    if (pthread_create(&loader, NULL, load_model, &job))
        return cas_error(CAS_ERR_INTERNAL, "engine: cannot start the model-loading thread");
    pthread_join(loader, NULL);
    if ((st = job.st)) return cas_error(st, "%s", job.err); /* the message was the loading thread's */
    e->cfg = cas_model_config_of(e->model);
    prefault_weights(cas_model_gguf(e->model), o->load_progress, o->load_progress_user);
    set_context(e);
    const int32_t pages = cas_model_kv_pages_for_budget(e->model, o->page_size, CAS_F16, (size_t)o->kv_cache_bytes);
    const int32_t per_seq = (e->max_context + o->page_size - 1) / o->page_size;
    char budget[96];
    snprintf(budget, sizeof budget, "a KV budget of %lld bytes", (long long)o->kv_cache_bytes);
    if ((st = check_pages(e, pages, per_seq, budget))) return st;
    if ((st = cas_model_kv_create(e->model, pages, o->page_size, CAS_F16, &e->cache))) return st;
    snprintf(e->device_name, sizeof e->device_name, "cpu");
    *pages_out = pages;
    *per_seq_out = per_seq;
    return CAS_OK;
}

/* CUDA: the file read through the GGUF reader, its weights uploaded, and a
 * KV pool of what gpu_memory_fraction of the device leaves after them (or
 * kv_bytes when > 0). */
static cas_status gpu_open(cas_engine *e, int64_t kv_bytes, int32_t *pages_out, int32_t *per_seq_out) {
    const cas_engine_opts *o = &e->opts;
    cas_status st;
    if (!cas_gpu_available())
        return cas_error(CAS_ERR_UNSUPPORTED, "engine: device cuda: %s",
                         cas_gpu_built() ? "no CUDA device found on this machine"
                                         : "this build has no CUDA (rebuild with make CUDA=1)");
    const int synthetic = is_synthetic(o->model_path);
    if (synthetic) {
        /* the shape by name, the default model's file for the tokenizer */
        if ((st = cas_model_config_synthetic(o->model_path + strlen(SYNTHETIC), &e->gcfg))) return st;
        if ((st = cas_gguf_open(cas_engine_opts_default().model_path, &e->gguf)))
            return cas_error(st, "engine: a synthetic model takes the default model's tokenizer: %s", cas_last_error());
    } else {
        if ((st = cas_gguf_open(o->model_path, &e->gguf))) return st;
        if ((st = cas_model_config_read(e->gguf, &e->gcfg))) return st;
        prefault_weights(e->gguf, o->load_progress, o->load_progress_user); /* the upload reads it all anyway */
    }
    e->cfg = &e->gcfg;
    set_context(e);
    const int32_t per_seq = (e->max_context + o->page_size - 1) / o->page_size;
    cas_gpu_opts go = cas_gpu_opts_default();
    go.device = o->gpu_device;
    go.max_batch_tokens = o->max_batch_tokens;
    go.max_seqs = o->max_seqs;
    go.max_logits = o->max_seqs;
    go.max_pages_per_seq = per_seq + 1;
    go.cascade = cascade_mode(o->cascade);
    go.graphs = !o->enforce_eager;
    go.tensor_parallel = o->tensor_parallel;
    _Static_assert(CAS_ENGINE_MAX_TENSOR_PARALLEL == CAS_GPU_MAX_RANKS, "the engine's limit is the GPU layer's");
    if ((st = synthetic ? cas_gpu_model_create_synthetic(&e->gcfg, SYNTHETIC_SEED, &go, &e->gpu)
                        : cas_gpu_model_create(e->gguf, &go, &e->gpu)))
        return st;
    size_t free_b = 0, total_b = 0;
    if ((st = cas_gpu_mem_info(e->gpu, &free_b, &total_b))) return st;
    char budget[160];
    if (kv_bytes <= 0) {
        /* what the fraction leaves after everything already on the device (ours and others') */
        const double allowed = (double)o->gpu_memory_fraction * (double)total_b, used = (double)(total_b - free_b);
        kv_bytes = allowed > used ? (int64_t)(allowed - used) : 0;
        snprintf(budget, sizeof budget,
                 "--gpu-memory-fraction %.2f of %.1f GiB (%.1f GiB in use after the weights)",
                 (double)o->gpu_memory_fraction, (double)total_b / 1073741824.0, used / 1073741824.0);
    } else {
        if ((size_t)kv_bytes > free_b)
            return cas_error(CAS_ERR_NOMEM, "engine: a KV budget of %.1f GiB does not fit the %.1f GiB free on %s",
                             (double)kv_bytes / 1073741824.0, (double)free_b / 1073741824.0,
                             cas_gpu_model_device_name(e->gpu));
        snprintf(budget, sizeof budget, "a KV budget of %lld bytes", (long long)kv_bytes);
    }
    const int32_t pages = cas_gpu_kv_pages_for_budget(e->gpu, o->page_size, (size_t)kv_bytes);
    if ((st = check_pages(e, pages, per_seq, budget))) return st;
    if ((st = cas_gpu_kv_create(e->gpu, pages, o->page_size, &e->gkv))) return st;
    e->gsamp = calloc((size_t)o->max_seqs, sizeof *e->gsamp);
    if (!e->gsamp) return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
    if (o->tensor_parallel > 0)
        snprintf(e->device_name, sizeof e->device_name, "cuda:%d-%d %s, tensor parallel %d", o->gpu_device,
                 o->gpu_device + o->tensor_parallel - 1, cas_gpu_model_device_name(e->gpu), o->tensor_parallel);
    else
        snprintf(e->device_name, sizeof e->device_name, "cuda:%d %s", o->gpu_device, cas_gpu_model_device_name(e->gpu));
    *pages_out = pages;
    *per_seq_out = per_seq;
    return CAS_OK;
}

cas_status cas_engine_create(cas_engine **out, const cas_engine_opts *opts) {
    *out = NULL;
    cas_engine *e = calloc(1, sizeof *e);
    if (!e) return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
    e->opts = opts ? *opts : cas_engine_opts_default();
    cas_engine_opts *o = &e->opts;
    if (!o->model_path) o->model_path = cas_engine_opts_default().model_path;
    if (o->page_size <= 0) o->page_size = 16;
    if (o->max_batch_tokens <= 0) o->max_batch_tokens = 512;
    if (o->max_seqs <= 0) o->max_seqs = 256;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->next_id = 1;
    cas_status st;
    if (o->page_size > CAS_ATTN_MAX_PAGE_SIZE || o->max_batch_tokens < 1 || o->max_seqs < 1) {
        st = cas_error(CAS_ERR_INVALID, "engine: page_size 1..256, max_batch_tokens and max_seqs >= 1");
        goto fail;
    }
    if (o->max_seqs > o->max_batch_tokens) o->max_seqs = o->max_batch_tokens;

    o->device = cas_device_resolve(o->device);
    if (o->device != CAS_DEVICE_CPU && o->device != CAS_DEVICE_CUDA) {
        st = cas_error(CAS_ERR_INVALID, "engine: device %d is not auto, cpu or cuda", (int)o->device);
        goto fail;
    }
    if (o->tensor_parallel < 0 || o->tensor_parallel > CAS_ENGINE_MAX_TENSOR_PARALLEL ||
        (o->tensor_parallel > 0 && o->device != CAS_DEVICE_CUDA)) {
        st = cas_error(CAS_ERR_INVALID, "engine: tensor parallelism of %d (1 to %d GPUs, device cuda only)",
                       o->tensor_parallel, CAS_ENGINE_MAX_TENSOR_PARALLEL);
        goto fail;
    }
    if (!(o->max_itl_ms >= 0.0f && o->max_itl_ms <= 1e7f)) {
        st = cas_error(CAS_ERR_INVALID, "engine: max_itl_ms must be in [0, 1e7] milliseconds (got %g)",
                       (double)o->max_itl_ms);
        goto fail;
    }
    if (o->cascade < 0 || o->cascade > 2) {
        st = cas_error(CAS_ERR_INVALID, "engine: cascade must be 0 (off), 1 (cost model) or 2 (all) (got %d)",
                       o->cascade);
        goto fail;
    }
    if (o->gpu_memory_fraction == 0.0f) o->gpu_memory_fraction = 0.9f;
    if (!(o->gpu_memory_fraction > 0.0f && o->gpu_memory_fraction <= 1.0f)) {
        st = cas_error(CAS_ERR_INVALID, "engine: gpu_memory_fraction must be in (0, 1] (got %g)",
                       (double)o->gpu_memory_fraction);
        goto fail;
    }
    e->device = o->device;
    const int64_t kv_bytes_asked = o->kv_cache_bytes;
    if (e->device == CAS_DEVICE_CPU && o->kv_cache_bytes <= 0) o->kv_cache_bytes = (int64_t)256 << 20;
    const cas_gguf *g = NULL;
    int32_t pages = 0, per_seq = 0;
    if (e->device == CAS_DEVICE_CPU) {
        if ((st = cpu_open(e, &pages, &per_seq))) goto fail;
        g = cas_model_gguf(e->model);
    } else {
        if ((st = gpu_open(e, kv_bytes_asked, &pages, &per_seq))) goto fail;
        g = e->gguf;
    }
    e->fwd = e->device == CAS_DEVICE_CPU ? &cpu_fwd : &gpu_fwd;
    if ((st = cas_tok_create(g, &e->tok))) goto fail;
    if (o->chat_template) {
        /* asked for by name: a template that does not compile is an error, not a fallback */
        if ((st = cas_chat_template_from_gguf_with(g, o->chat_template, &e->chat))) goto fail;
        e->has_chat = 1;
    } else {
        e->has_chat = cas_chat_template_from_gguf(g, &e->chat) == CAS_OK;
    }
    {
        const char *name = NULL;
        size_t nlen = 0;
        if (is_synthetic(o->model_path)) {
            snprintf(e->model_name, sizeof e->model_name, "%s", o->model_path);
        } else if (cas_gguf_get_str(g, "general.name", &name, &nlen) == CAS_OK && nlen < sizeof e->model_name) {
            memcpy(e->model_name, name, nlen);
            e->model_name[nlen] = 0;
        } else {
            const char *base = strrchr(o->model_path, '/');
            snprintf(e->model_name, sizeof e->model_name, "%s", base ? base + 1 : o->model_path);
        }
    }
    cas_kv_opts ko = cas_kv_opts_default();
    ko.num_blocks = pages;
    ko.page_size = o->page_size;
    ko.max_seqs = o->max_seqs * 2 + 16;
    ko.max_blocks_per_seq = per_seq + 1;
    ko.enable_prefix_cache = o->prefix_cache;
    ko.debug_checks = o->debug_checks;
    if ((st = cas_kv_create(&ko, &e->kv))) goto fail;
    cas_sched_opts so = cas_sched_opts_default();
    so.max_tokens_per_step = o->max_batch_tokens;
    so.max_seqs = o->max_seqs;
    so.max_context = e->max_context;
    so.use_priority = 1;
    so.debug_checks = o->debug_checks;
    so.max_itl_ms = o->max_itl_ms;
    if ((st = cas_sched_create(e->kv, &so, &e->sched))) goto fail;

    int32_t V = e->cfg->n_vocab;
    e->logits = cas_alloc_array((size_t)o->max_seqs * (size_t)V, sizeof(float));
    e->logit_rows = calloc((size_t)o->max_seqs, sizeof(int32_t));
    e->row_req = calloc((size_t)o->max_seqs, sizeof(req *));
    e->row_tokens = calloc((size_t)o->max_seqs, sizeof(int32_t));
    e->sampled = calloc((size_t)o->max_seqs, sizeof(int32_t));
    e->stop = calloc((size_t)o->max_seqs, 1);
    e->finished = calloc((size_t)o->max_seqs, 1);
    e->text_cap = 4096;
    e->text_buf = malloc(e->text_cap);
    e->lp_buf = malloc(sizeof(float) * (MAX_LOGPROBS + 1));
    e->lp_ids = malloc(sizeof(int32_t) * (MAX_LOGPROBS + 1));
    e->table_cap = 1024;
    e->table = calloc((size_t)e->table_cap, sizeof(req *));
    e->page_mark = calloc((size_t)pages, sizeof(uint32_t));
    e->adj_row = malloc(sizeof(float) * (size_t)V);
    if ((st = cas_sampler_scratch_create(V, &e->samp_scratch))) goto fail;
    e->adj_scratch = calloc((size_t)V, sizeof(int32_t));
    e->eog_ids = malloc(sizeof(int32_t) * (size_t)V);
    if (e->eog_ids)
        for (int32_t t = 0; t < V; t++)
            if (cas_tok_is_eog(e->tok, t)) e->eog_ids[e->n_eog++] = t;
    if (!e->adj_row || !e->adj_scratch || !e->eog_ids || !e->page_mark || !e->logits || !e->logit_rows || !e->row_req || !e->row_tokens || !e->sampled || !e->stop || !e->finished || !e->text_buf ||
        !e->lp_buf || !e->lp_ids || !e->table) {
        st = cas_error(CAS_ERR_NOMEM, "engine: out of memory");
        goto fail;
    }
    e->stats.kv_blocks_total = pages;
    e->stats.kv_blocks_free = pages; /* all free before the first step refreshes it */
    *out = e;
    const size_t kv_bytes = e->gkv ? cas_gpu_kv_bytes(e->gkv) : cas_model_kv_bytes(e->cache);
    cas_log(CAS_LOG_INFO,
            "engine: %s on %s, %d KV pages of %d tokens (%.1f MiB), context %d, %d seqs x %d tokens per step, "
            "ITL target %g ms",
            e->model_name, e->device_name, pages, o->page_size, (double)kv_bytes / (1 << 20), e->max_context,
            o->max_seqs, o->max_batch_tokens, (double)o->max_itl_ms);
    return CAS_OK;
fail:
    cas_engine_destroy(e);
    return st;
}

void cas_engine_destroy(cas_engine *e) {
    if (!e) return;
    cas_engine_stop(e);
    if (e->table)
        for (int32_t i = 0; i < e->table_cap; i++)
            for (req *r = e->table[i], *n; r; r = n) {
                n = r->next;
                req_free(r);
            }
    for (req *r = e->incoming_head, *n; r; r = n) {
        n = r->next;
        req_free(r);
    }
    cas_sched_destroy(e->sched);
    cas_kv_destroy(e->kv);
    cas_model_kv_destroy(e->cache);
    if (e->has_chat) cas_chat_template_free(&e->chat);
    cas_tok_destroy(e->tok);
    cas_model_destroy(e->model);
    cas_gpu_kv_destroy(e->gkv);
    cas_gpu_model_destroy(e->gpu);
    cas_gguf_close(e->gguf);
    free(e->gsamp);
    cas_free(e->logits);
    free(e->logit_rows);
    free(e->row_req);
    free(e->row_tokens);
    free(e->sampled);
    free(e->stop);
    free(e->finished);
    free(e->text_buf);
    free(e->lp_buf);
    free(e->lp_ids);
    free(e->page_mark);
    free(e->adj_row);
    free(e->adj_scratch);
    cas_sampler_scratch_destroy(e->samp_scratch); /* after the requests' samplers, freed above */
    free(e->eog_ids);
    free(e->table);
    free(e->aborts);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

/* ---- submit / abort ------------------------------------------------------ */

/* The token lists, penalties and biases of a request's sampling. */
static cas_status check_adjust(const cas_engine *e, const cas_engine_sampling *sp) {
    const int32_t V = e->cfg->n_vocab;
    if (sp->min_tokens < 0 || sp->min_tokens > sp->max_tokens)
        return cas_error(CAS_ERR_INVALID, "min_tokens must be between 0 and max_tokens (%d), got %d", sp->max_tokens,
                         sp->min_tokens);
    if (sp->n_stop_token_ids < 0 || (sp->n_stop_token_ids > 0 && !sp->stop_token_ids))
        return cas_error(CAS_ERR_INVALID, "bad stop_token_ids list");
    for (int32_t i = 0; i < sp->n_stop_token_ids; i++)
        if (sp->stop_token_ids[i] < 0 || sp->stop_token_ids[i] >= V)
            return cas_error(CAS_ERR_INVALID, "stop_token_ids: token id %d is outside the vocabulary (0..%d)",
                             sp->stop_token_ids[i], V - 1);
    if (!(sp->presence_penalty >= -2.0f && sp->presence_penalty <= 2.0f))
        return cas_error(CAS_ERR_INVALID, "presence_penalty must be between -2 and 2 (got %g)", (double)sp->presence_penalty);
    if (!(sp->frequency_penalty >= -2.0f && sp->frequency_penalty <= 2.0f))
        return cas_error(CAS_ERR_INVALID, "frequency_penalty must be between -2 and 2 (got %g)",
                         (double)sp->frequency_penalty);
    if (!(sp->repetition_penalty >= 0.0f && isfinite(sp->repetition_penalty)))
        return cas_error(CAS_ERR_INVALID, "repetition_penalty must be > 0 (got %g)", (double)sp->repetition_penalty);
    if (sp->n_logit_bias < 0 || (sp->n_logit_bias > 0 && (!sp->logit_bias_ids || !sp->logit_bias)))
        return cas_error(CAS_ERR_INVALID, "bad logit_bias list");
    for (int32_t i = 0; i < sp->n_logit_bias; i++) {
        if (sp->logit_bias_ids[i] < 0 || sp->logit_bias_ids[i] >= V)
            return cas_error(CAS_ERR_INVALID, "logit_bias: token id %d is outside the vocabulary (0..%d)",
                             sp->logit_bias_ids[i], V - 1);
        if (!(sp->logit_bias[i] >= -100.0f && sp->logit_bias[i] <= 100.0f))
            return cas_error(CAS_ERR_INVALID, "logit_bias values must be between -100 and 100 (got %g)",
                             (double)sp->logit_bias[i]);
    }
    return CAS_OK;
}

/* Copies n values of size sz (NULL when n is 0). */
static void *dup_array(const void *a, int32_t n, size_t sz) {
    if (n <= 0) return NULL;
    void *d = malloc(sz * (size_t)n);
    if (d) memcpy(d, a, sz * (size_t)n);
    return d;
}

/* r's own copies of the sampling's lists, its min_tokens mask, its output
 * list for the penalties and its echo text. */
static cas_status setup_adjust(cas_engine *e, req *r, const cas_engine_request *rq) {
    const cas_engine_sampling *sp = &rq->sampling;
    const int32_t ns = sp->n_stop_token_ids, nb = sp->n_logit_bias;
    r->stop_ids = dup_array(sp->stop_token_ids, ns, sizeof(int32_t));
    r->bias_ids = dup_array(sp->logit_bias_ids, nb, sizeof(int32_t));
    r->bias = dup_array(sp->logit_bias, nb, sizeof(float));
    if ((ns && !r->stop_ids) || (nb && (!r->bias_ids || !r->bias))) return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
    r->sp.stop_token_ids = r->stop_ids;
    r->sp.logit_bias_ids = r->bias_ids;
    r->sp.logit_bias = r->bias;
    if (sp->min_tokens > 0) {
        const int32_t ne = sp->ignore_eos ? 0 : e->n_eog;
        if (ne + ns > 0 && !(r->min_mask = malloc(sizeof(int32_t) * (size_t)(ne + ns))))
            return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
        for (int32_t i = 0; i < ne; i++) r->min_mask[r->n_min_mask++] = e->eog_ids[i];
        for (int32_t i = 0; i < ns; i++) r->min_mask[r->n_min_mask++] = r->stop_ids[i];
    }
    const int rep = sp->repetition_penalty > 0.0f && sp->repetition_penalty != 1.0f;
    const int pen = sp->presence_penalty != 0.0f || sp->frequency_penalty != 0.0f || rep;
    r->adjust = pen || nb > 0;
    if (pen && !(r->out_toks = malloc(sizeof(int32_t) * (size_t)r->sp.max_tokens)))
        return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
    if (sp->echo) {
        if (rq->prompt) {
            r->echo_len = strlen(rq->prompt);
            r->echo = strdup(rq->prompt);
        } else {
            /* the ids decoded as the generated text is (control tokens render as nothing) */
            size_t cap = 64, len = 0;
            for (int32_t i = 0; i < r->n_prompt; i++) {
                size_t n = 0;
                cas_tok_piece(e->tok, r->prompt[i], 0, &n);
                cap += n;
            }
            if ((r->echo = malloc(cap)) && cas_tok_decode(e->tok, r->prompt, (size_t)r->n_prompt, 0, r->echo, cap, &len))
                len = 0;
            r->echo_len = len;
        }
        if (!r->echo) return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
    }
    return CAS_OK;
}

cas_status cas_engine_submit(cas_engine *e, const cas_engine_request *rq, uint64_t *id) {
    if (!e || !rq || !id) return cas_error(CAS_ERR_INVALID, "engine: NULL argument");
    if (!rq->cb) return cas_error(CAS_ERR_INVALID, "engine: a request needs a callback");
    const cas_engine_sampling *sp = &rq->sampling;
    if (sp->max_tokens < 1) return cas_error(CAS_ERR_INVALID, "max_tokens must be at least 1 (got %d)", sp->max_tokens);
    if (sp->logprobs < 0 || sp->logprobs > MAX_LOGPROBS)
        return cas_error(CAS_ERR_INVALID, "logprobs must be between 0 and %d", MAX_LOGPROBS);
    if (sp->n_stop < 0 || (sp->n_stop > 0 && !sp->stop)) return cas_error(CAS_ERR_INVALID, "bad stop list");
    cas_sampler_params pp = {sp->temperature, sp->top_k, sp->top_p, sp->min_p, sp->seed};
    cas_status st = cas_sampler_params_check(&pp);
    if (st) return st;
    for (int32_t i = 0; i < sp->n_stop; i++)
        if (!sp->stop[i] || !sp->stop[i][0]) return cas_error(CAS_ERR_INVALID, "stop strings must not be empty");
    if ((st = check_adjust(e, sp))) return st;

    req *r = calloc(1, sizeof *r);
    if (!r) return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
    if (rq->prompt) {
        size_t len = strlen(rq->prompt);
        size_t cap = cas_tok_max_ids(e->tok, len), n = 0;
        r->prompt = malloc(sizeof(int32_t) * cap);
        if (!r->prompt) {
            req_free(r);
            return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
        }
        st = cas_tok_encode(e->tok, rq->prompt, len, CAS_TOK_ADD_SPECIAL | CAS_TOK_PARSE_SPECIAL, r->prompt, cap, &n);
        if (st) {
            req_free(r);
            return st;
        }
        r->n_prompt = (int32_t)n;
    } else {
        if (rq->n_tokens < 0 || (rq->n_tokens > 0 && !rq->tokens)) {
            req_free(r);
            return cas_error(CAS_ERR_INVALID, "bad token list");
        }
        r->prompt = malloc(sizeof(int32_t) * (size_t)(rq->n_tokens + 1));
        if (!r->prompt) {
            req_free(r);
            return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
        }
        for (int32_t i = 0; i < rq->n_tokens; i++) {
            if (rq->tokens[i] < 0 || rq->tokens[i] >= e->cfg->n_vocab) {
                req_free(r);
                return cas_error(CAS_ERR_INVALID, "token id %d at %d is outside the vocabulary (0..%d)",
                                 rq->tokens[i], i, e->cfg->n_vocab - 1);
            }
            r->prompt[i] = rq->tokens[i];
        }
        r->n_prompt = rq->n_tokens;
    }
    if (r->n_prompt < 1) {
        req_free(r);
        return cas_error(CAS_ERR_INVALID, "the prompt is empty");
    }
    if (r->n_prompt >= e->max_context) {
        int32_t n = r->n_prompt;
        req_free(r);
        return cas_error(CAS_ERR_INVALID,
                         "the prompt has %d tokens; this model's context is %d tokens (the prompt must leave room "
                         "for at least one generated token)",
                         n, e->max_context);
    }
    r->sp = *sp;
    if (r->sp.max_tokens > e->max_context - r->n_prompt) r->sp.max_tokens = e->max_context - r->n_prompt;
    r->sp.stop = NULL;
    if ((st = setup_adjust(e, r, rq))) {
        req_free(r);
        return st;
    }
    if (sp->n_stop) {
        r->stops = calloc((size_t)sp->n_stop, sizeof(char *));
        for (int32_t i = 0; r->stops && i < sp->n_stop; i++) r->stops[i] = strdup(sp->stop[i]);
    }
    r->priority = rq->priority;
    r->cb = rq->cb;
    r->user = rq->user;
    cas_rng_seed(&r->rng, pp.seed);
    if ((st = cas_sampler_create_with(&pp, e->cfg->n_vocab, e->samp_scratch, &r->sampler)) ||
        (st = cas_stopper_create((const char *const *)r->stops, sp->n_stop, &r->stopper))) {
        req_free(r);
        return st;
    }
    cas_stopper_keep_stop(r->stopper, sp->include_stop_str);
    pthread_mutex_lock(&e->mu);
    /* the id is read under the lock: once it is released the engine thread may
     * finish the request and free r */
    const uint64_t rid = r->id = e->next_id++;
    if (e->incoming_tail) e->incoming_tail->next = r;
    else e->incoming_head = r;
    e->incoming_tail = r;
    e->stats.waiting++;
    e->stats.prompt_tokens_total += r->n_prompt;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    *id = rid;
    return CAS_OK;
}

cas_status cas_engine_abort(cas_engine *e, uint64_t id) {
    if (!e) return cas_error(CAS_ERR_INVALID, "engine: NULL engine");
    pthread_mutex_lock(&e->mu);
    if (e->n_aborts == e->cap_aborts) {
        int32_t nc = e->cap_aborts ? e->cap_aborts * 2 : 64;
        uint64_t *a = realloc(e->aborts, sizeof(uint64_t) * (size_t)nc);
        if (!a) {
            pthread_mutex_unlock(&e->mu);
            return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
        }
        e->aborts = a;
        e->cap_aborts = nc;
    }
    e->aborts[e->n_aborts++] = id;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return CAS_OK;
}

/* ---- events -------------------------------------------------------------- */

static void emit(cas_engine *e, req *r, const char *text, size_t len, const int32_t *toks, int32_t n_toks,
                 const float *lps, const int32_t *top_ids, const float *top_lps, cas_finish_reason fin) {
    cas_engine_event ev;
    memset(&ev, 0, sizeof ev);
    ev.id = r->id;
    ev.text = text ? text : "";
    ev.text_len = len;
    ev.tokens = toks;
    ev.n_tokens = n_toks;
    ev.logprobs = lps;
    ev.top_ids = top_ids;
    ev.top_logprobs = top_lps;
    ev.finish = fin;
    ev.prompt_tokens = r->n_prompt;
    ev.completion_tokens = r->n_generated;
    ev.cached_tokens = r->cached_tokens;
    r->cb(r->user, &ev);
}

/* Length of the longest prefix of s that ends on a whole UTF-8 character. */
static size_t utf8_complete(const char *s, size_t n) {
    size_t i = n, back = 0;
    while (i > 0 && back < 4) {
        unsigned char c = (unsigned char)s[i - 1];
        if ((c & 0xC0) != 0x80) {
            size_t need = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
            return back + 1 >= need ? n : i - 1;
        }
        i--;
        back++;
    }
    return n; /* not UTF-8 anyway: pass the bytes on */
}

/* The first event of an echoing request: the prompt's text (an incomplete
 * last character is held back for the generated bytes that complete it). */
static void emit_echo(cas_engine *e, req *r) {
    size_t whole = utf8_complete(r->echo, r->echo_len);
    size_t rest = r->echo_len - whole;
    if (rest <= sizeof r->utf8_hold) {
        memcpy(r->utf8_hold, r->echo + whole, rest);
        r->n_hold = (int32_t)rest;
    } else {
        whole = r->echo_len;
    }
    emit(e, r, r->echo, whole, NULL, 0, NULL, NULL, NULL, CAS_FINISH_NONE);
    free(r->echo);
    r->echo = NULL;
}

static void finish_req(cas_engine *e, req *r, cas_finish_reason why) {
    const char *tail = NULL;
    size_t tail_len = 0;
    if (why != CAS_FINISH_ABORT && why != CAS_FINISH_ERROR) cas_stopper_flush(r->stopper, &tail, &tail_len);
    /* held-back bytes of an incomplete character go out as they are */
    size_t need = (size_t)r->n_hold + tail_len;
    if (need > e->text_cap) {
        char *b = realloc(e->text_buf, need);
        if (b) e->text_buf = b, e->text_cap = need;
        else need = 0;
    }
    size_t n = 0;
    if (need) {
        if (tail_len) memcpy(e->text_buf, tail, tail_len);
        n = tail_len;
        if (r->n_hold) memcpy(e->text_buf + n, r->utf8_hold, (size_t)r->n_hold), n += (size_t)r->n_hold;
    }
    emit(e, r, e->text_buf, n, NULL, 0, NULL, NULL, NULL, why);
    pthread_mutex_lock(&e->mu);
    if (why == CAS_FINISH_ABORT) e->stats.requests_aborted++;
    else e->stats.requests_finished++;
    pthread_mutex_unlock(&e->mu);
    table_del(e, r->id);
    req_free(r);
}

/* log-softmax of one logits row: the sampled token's value and the top n */
static void logprobs_of(const float *x, int32_t V, int32_t tok, int32_t n, float *lp, int32_t *ids, float *top) {
    float m = -INFINITY;
    for (int32_t i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
    double s = 0;
    for (int32_t i = 0; i < V; i++) s += exp((double)(x[i] - m));
    float lz = m + (float)log(s);
    *lp = x[tok] - lz;
    for (int32_t k = 0; k < n; k++) ids[k] = -1, top[k] = -INFINITY;
    for (int32_t i = 0; i < V; i++) {
        float v = x[i] - lz;
        if (n == 0 || v <= top[n - 1]) continue;
        int32_t k = n - 1;
        while (k > 0 && top[k - 1] < v) {
            top[k] = top[k - 1];
            ids[k] = ids[k - 1];
            k--;
        }
        top[k] = v;
        ids[k] = i;
    }
}

/* ---- step ---------------------------------------------------------------- */

static void take_incoming(cas_engine *e) {
    pthread_mutex_lock(&e->mu);
    req *head = e->incoming_head;
    e->incoming_head = e->incoming_tail = NULL;
    uint64_t aborts[64];
    int32_t na = 0;
    while (e->n_aborts > 0 && na < 64) aborts[na++] = e->aborts[--e->n_aborts];
    pthread_mutex_unlock(&e->mu);
    for (req *r = head, *n; r; r = n) {
        n = r->next;
        r->next = NULL;
        table_put(e, r);
        cas_status st = cas_sched_add(e->sched, (int64_t)r->id, r->prompt, r->n_prompt, r->sp.max_tokens, r->priority);
        if (st) {
            cas_log(CAS_LOG_WARN, "engine: request %llu rejected by the scheduler: %s", (unsigned long long)r->id,
                    cas_last_error());
            finish_req(e, r, CAS_FINISH_ERROR);
            continue;
        }
        r->in_sched = 1;
    }
    for (int32_t i = 0; i < na; i++) {
        req *r = table_get(e, aborts[i]);
        if (!r) continue;
        if (r->in_sched) cas_sched_abort(e->sched, (int64_t)r->id);
        finish_req(e, r, CAS_FINISH_ABORT);
    }
}

/* Refreshes the scheduler and KV numbers of the stats (engine thread). */
static void refresh_stats(cas_engine *e) {
    cas_sched_stats ss;
    cas_sched_get_stats(e->sched, &ss);
    cas_kv_stats ks;
    cas_kv_get_stats(e->kv, &ks);
    pthread_mutex_lock(&e->mu);
    e->stats.running = ss.running;
    e->stats.waiting = ss.waiting;
    e->stats.kv_blocks_used = ks.blocks_used;
    e->stats.kv_blocks_free = ks.blocks_free + ks.blocks_cached;
    e->stats.kv_blocks_cached = ks.blocks_cached;
    e->stats.prefix_queries_tokens = ks.query_tokens;
    e->stats.prefix_hit_tokens = ks.hit_tokens + ks.pending_hit_tokens;
    e->stats.prompt_tokens_computed = ss.prompt_tokens_computed;
    e->stats.preemptions = ss.preemptions;
    e->stats.itl_limited_steps = ss.time_limited_steps;
    pthread_mutex_unlock(&e->mu);
}

/* The distinct KV tokens a batch's attention reads: each page it refers to
 * once, full pages whole, a sequence's last page to its length. */
static int64_t distinct_kv_tokens(cas_engine *e, const cas_sched_plan *p) {
    if (++e->mark_step == 0) {
        memset(e->page_mark, 0, sizeof(uint32_t) * (size_t)e->stats.kv_blocks_total);
        e->mark_step = 1;
    }
    const int32_t ps = e->opts.page_size;
    int64_t n = 0;
    for (int32_t r = 0; r < p->n_items; r++)
        for (int32_t j = p->kv_indptr[r]; j < p->kv_indptr[r + 1]; j++) {
            const int32_t pg = p->kv_indices[j];
            if (pg < 0 || pg >= e->stats.kv_blocks_total || e->page_mark[pg] == e->mark_step) continue;
            e->page_mark[pg] = e->mark_step;
            n += j + 1 < p->kv_indptr[r + 1] ? ps : p->kv_last_page_len[r];
        }
    return n;
}

cas_status cas_engine_step(cas_engine *e, int *busy) {
    *busy = 0;
    take_incoming(e);
    double t0 = cas_now_s();
    cas_sched_plan plan;
    cas_status st = cas_sched_step_plan(e->sched, &plan);
    if (st) return st;
    if (plan.n_items == 0) {
        /* nothing could run (e.g. every request waits for shared blocks): close the step */
        if ((st = cas_sched_step_done(e->sched, e->sampled, e->stop, e->finished))) return st;
        refresh_stats(e);
        return CAS_OK;
    }
    *busy = 1;
    /* logits for the rows that end a request's known tokens */
    int32_t n_logits = 0;
    for (int32_t i = 0; i < plan.n_items; i++)
        if (plan.items[i].sample) {
            e->row_req[n_logits] = table_get(e, (uint64_t)plan.items[i].id);
            e->logit_rows[n_logits++] = plan.qo_indptr[i + 1] - 1;
        }
    cas_model_batch mb = {plan.n_items, plan.token_ids, plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                          plan.kv_last_page_len, n_logits, e->logit_rows};
    const int64_t kv_read = distinct_kv_tokens(e, &plan);
    const int64_t prompt_before = e->stats.prompt_tokens_computed;
    st = e->fwd->forward(e, &mb, e->row_req);
    if (st) return st;
    cas_attn_plan_info pinfo;
    e->fwd->plan_info(e, &pinfo);
    /* the blocks this step holds are in the stats before its tokens reach a
     * client: one that has a token and reads the metrics sees them */
    refresh_stats(e);

    /* sample, detokenize, stop conditions */
    const int32_t V = e->cfg->n_vocab;
    int32_t li = 0;
    for (int32_t i = 0; i < plan.n_items; i++) {
        const cas_sched_item *it = &plan.items[i];
        e->stop[i] = 0;
        e->sampled[i] = -1;
        req *rr = table_get(e, (uint64_t)it->id);
        if (rr && rr->n_generated == 0 && it->q_start < rr->n_prompt) {
            int32_t end = it->q_start + it->q_len < rr->n_prompt ? it->q_start + it->q_len : rr->n_prompt;
            rr->prompt_computed += end - it->q_start;
        }
        if (!it->sample) continue;
        req *r = rr;
        const float *row = e->logits + (size_t)li * V;
        const int32_t tok = e->row_tokens[li];
        li++;
        if (!r) continue;
        e->sampled[i] = tok;
        if (r->n_generated == 0) {
            int32_t c = r->n_prompt - r->prompt_computed;
            r->cached_tokens = c > 0 ? c : 0;
            if (r->echo) emit_echo(e, r);
        }
        r->n_generated++;
        if (r->out_toks && r->n_out < r->sp.max_tokens) r->out_toks[r->n_out++] = tok;
        /* end-of-generation and stop tokens end it from min_tokens on (vLLM's check_stop) */
        const int may_stop = r->n_generated >= r->sp.min_tokens;
        int eog = may_stop && !r->sp.ignore_eos && cas_tok_is_eog(e->tok, tok);
        for (int32_t k = 0; may_stop && !eog && k < r->sp.n_stop_token_ids; k++) eog = tok == r->stop_ids[k];
        size_t plen = 0;
        const char *piece = eog && !r->sp.include_stop_str ? "" : cas_tok_piece(e->tok, tok, 0, &plen);
        /* hold back an incomplete UTF-8 character across tokens */
        char buf[256];
        size_t n = 0;
        if (r->n_hold) memcpy(buf, r->utf8_hold, (size_t)r->n_hold), n = (size_t)r->n_hold;
        size_t take = plen < sizeof buf - n ? plen : sizeof buf - n;
        if (piece && take) memcpy(buf + n, piece, take), n += take;
        size_t whole = utf8_complete(buf, n);
        r->n_hold = (int32_t)(n - whole);
        if (r->n_hold > (int32_t)sizeof r->utf8_hold) r->n_hold = 0;
        memcpy(r->utf8_hold, buf + whole, (size_t)r->n_hold);
        const char *out = buf;
        size_t out_len = whole;
        /* stop strings are looked for only in the text after min_tokens tokens (vLLM) */
        int hit_stop = r->n_generated > r->sp.min_tokens ? cas_stopper_push(r->stopper, buf, whole, &out, &out_len) : 0;
        float lp = 0;
        int32_t nlp = r->sp.logprobs;
        if (nlp > 0) logprobs_of(row, V, tok, nlp, &lp, e->lp_ids, e->lp_buf);
        emit(e, r, out, out_len, &tok, 1, nlp > 0 ? &lp : NULL, nlp > 0 ? e->lp_ids : NULL,
             nlp > 0 ? e->lp_buf : NULL, CAS_FINISH_NONE);
        if (eog || hit_stop) e->stop[i] = 1;
    }
    st = cas_sched_step_done(e->sched, e->sampled, e->stop, e->finished);
    if (st) return st;
    int64_t gen = 0;
    for (int32_t i = 0; i < plan.n_items; i++) {
        if (e->sampled[i] >= 0) gen++;
        if (e->finished[i] == CAS_SCHED_RUNNING) continue;
        req *r = table_get(e, (uint64_t)plan.items[i].id);
        if (!r) continue;
        cas_finish_reason why = e->finished[i] == CAS_SCHED_FINISHED_LENGTH ? CAS_FINISH_LENGTH
                                : e->finished[i] == CAS_SCHED_ABORTED    ? CAS_FINISH_ABORT
                                                                         : CAS_FINISH_STOP;
        if (why == CAS_FINISH_LENGTH && e->stop[i]) why = CAS_FINISH_STOP;
        finish_req(e, r, why);
    }
    /* the whole step's time teaches the scheduler's cost model (sched.h); a
     * time it refuses costs the model one sample, not the step */
    const double step_s = cas_now_s() - t0;
    if (cas_sched_observe(e->sched, step_s) != CAS_OK)
        cas_log(CAS_LOG_WARN, "engine: step time not used: %s", cas_last_error());
    /* stats */
    refresh_stats(e);
    pthread_mutex_lock(&e->mu);
    e->stats.generation_tokens += gen;
    e->stats.steps++;
    if (pinfo.shared_passes > 0) e->stats.cascade_steps++;
    e->stats.last_step_s = step_s;
    e->stats.last_step_predicted_s = plan.predicted_s;
    e->stats.busy_seconds += e->stats.last_step_s;
    e->stats.last_step_seqs = plan.n_items;
    e->stats.last_step_tokens = plan.n_tokens;
    e->stats.last_step_prompt_tokens = (int32_t)(e->stats.prompt_tokens_computed - prompt_before);
    e->stats.last_step_kv_tokens = kv_read;
    if (e->gpu) {
        cas_gpu_graph_info gi;
        cas_gpu_graph_stats(e->gpu, &gi);
        e->stats.graph_steps = gi.replays + gi.padded_eager;
        e->stats.eager_steps = gi.eager;
    }
    pthread_mutex_unlock(&e->mu);
    if (cas_log_enabled(CAS_LOG_DEBUG))
        cas_log(CAS_LOG_DEBUG, "step %lld: %d seqs, %d tokens, attention %d tree nodes, %d shared passes, KV read %lld of %lld tokens, %.1f ms (predicted %.1f%s)",
                (long long)e->stats.steps, plan.n_items, plan.n_tokens, pinfo.tree_nodes, pinfo.shared_passes,
                (long long)pinfo.kv_tokens_read, (long long)pinfo.kv_tokens_flat, step_s * 1e3, plan.predicted_s * 1e3,
                plan.time_limited ? ", prefill cut to the ITL target" : "");
    return CAS_OK;
}

cas_status cas_engine_run_until_idle(cas_engine *e) {
    for (;;) {
        int busy;
        cas_status st = cas_engine_step(e, &busy);
        if (st) return st;
        if (!busy) {
            pthread_mutex_lock(&e->mu);
            int more = e->incoming_head != NULL || e->n_aborts > 0 || e->stats.running > 0 || e->stats.waiting > 0;
            pthread_mutex_unlock(&e->mu);
            if (!more) return CAS_OK;
        }
    }
}

/* ---- background thread --------------------------------------------------- */

static void *engine_thread(void *arg) {
    cas_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->thread_stop && !e->incoming_head && e->n_aborts == 0 && e->stats.running == 0 &&
               e->stats.waiting == 0)
            pthread_cond_wait(&e->cv, &e->mu);
        int stop = e->thread_stop;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
        int busy = 0;
        cas_status st = cas_engine_step(e, &busy);
        if (st) {
            cas_log(CAS_LOG_ERROR, "engine step failed: %s", cas_last_error());
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        } else if (!busy) {
            /* waiting requests that could not run (e.g. blocked on shared blocks): don't spin hot */
            struct timespec ts = {0, 200 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    return NULL;
}

cas_status cas_engine_start(cas_engine *e) {
    if (e->thread_running) return CAS_OK;
    e->thread_stop = 0;
    if (pthread_create(&e->thread, NULL, engine_thread, e))
        return cas_error(CAS_ERR_INTERNAL, "engine: cannot start the engine thread");
    e->thread_running = 1;
    return CAS_OK;
}

void cas_engine_stop(cas_engine *e) {
    if (!e || !e->thread_running) return;
    pthread_mutex_lock(&e->mu);
    e->thread_stop = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    e->thread_running = 0;
}

/* ---- info ---------------------------------------------------------------- */

void cas_engine_get_stats(cas_engine *e, cas_engine_stats *st) {
    pthread_mutex_lock(&e->mu);
    *st = e->stats;
    pthread_mutex_unlock(&e->mu);
    st->generation_tok_per_s = st->busy_seconds > 0 ? (double)st->generation_tokens / st->busy_seconds : 0.0;
}

const char *cas_engine_model_name(const cas_engine *e) { return e->model_name; }
cas_device cas_engine_device(const cas_engine *e) { return e->device; }
const char *cas_engine_device_name(const cas_engine *e) { return e->device_name; }

cas_device cas_device_resolve(cas_device d) {
    if (d != CAS_DEVICE_AUTO) return d;
    return cas_gpu_available() ? CAS_DEVICE_CUDA : CAS_DEVICE_CPU;
}

int cas_device_parse(const char *s, cas_device *out) {
    if (!s) return -1;
    if (!strcmp(s, "auto")) *out = CAS_DEVICE_AUTO;
    else if (!strcmp(s, "cpu")) *out = CAS_DEVICE_CPU;
    else if (!strcmp(s, "cuda") || !strcmp(s, "gpu")) *out = CAS_DEVICE_CUDA;
    else return -1;
    return 0;
}

const char *cas_engine_token_text(const cas_engine *e, int32_t id, size_t *len) {
    *len = 0;
    if (id < 0 || id >= e->cfg->n_vocab) return NULL;
    return cas_tok_piece(e->tok, id, CAS_TOK_DECODE_SPECIAL, len);
}

int32_t cas_engine_context_length(const cas_engine *e) { return e->max_context; }

cas_status cas_engine_apply_chat(const cas_engine *e, const cas_engine_msg *msgs, int32_t n, char **out) {
    *out = NULL;
    if (!e->has_chat) return cas_error(CAS_ERR_UNSUPPORTED, "this model has no chat template cascade knows");
    if (n < 1) return cas_error(CAS_ERR_INVALID, "messages must not be empty");
    for (int32_t i = 0; i < n; i++) {
        if (!msgs[i].role || !msgs[i].content) return cas_error(CAS_ERR_INVALID, "message %d lacks role or content", i);
        if (strcmp(msgs[i].role, "system") && strcmp(msgs[i].role, "user") && strcmp(msgs[i].role, "assistant"))
            return cas_error(CAS_ERR_INVALID, "message %d has role '%s' (system, user or assistant)", i, msgs[i].role);
    }
    cas_chat_msg *m = malloc(sizeof *m * (size_t)n);
    if (!m) return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
    for (int32_t i = 0; i < n; i++) m[i].role = msgs[i].role, m[i].content = msgs[i].content;
    cas_status st = cas_chat_apply(&e->chat, m, (size_t)n, 1, out);
    free(m);
    return st;
}

cas_status cas_engine_apply_chat_json(const cas_engine *e, const char *context_json, char **out) {
    *out = NULL;
    if (!e->has_chat) return cas_error(CAS_ERR_UNSUPPORTED, "this model has no chat template cascade knows");
    if (!e->chat.jinja)
        return cas_error(CAS_ERR_UNSUPPORTED, "this model's chat template is rendered by cascade's built-in %s routine "
                                              "(the Jinja interpreter cannot run it), which takes roles and texts only",
                         cas_chat_kind_name(e->chat.kind));
    return cas_chat_apply_json(&e->chat, context_json, NULL, out);
}

int cas_engine_chat_tools(const cas_engine *e) { return e->has_chat ? cas_chat_template_tools(&e->chat) : -1; }

cas_status cas_engine_count_tokens(const cas_engine *e, const char *text, int32_t *n) {
    size_t len = strlen(text), cap = cas_tok_max_ids(e->tok, len), got = 0;
    int32_t *ids = malloc(sizeof(int32_t) * cap);
    if (!ids) return cas_error(CAS_ERR_NOMEM, "engine: out of memory");
    cas_status st = cas_tok_encode(e->tok, text, len, CAS_TOK_ADD_SPECIAL | CAS_TOK_PARSE_SPECIAL, ids, cap, &got);
    free(ids);
    *n = (int32_t)got;
    return st;
}
