/*
 * server_metrics.c: GET /metrics in the Prometheus text format (version
 * 0.0.4). Engine counters and gauges come from cas_engine_get_stats at
 * scrape time; latency histograms (time to first token, time per output
 * token, end-to-end) are kept here, fed by the HTTP layer when a request
 * finishes, under a mutex held only for a few additions.
 *
 * Names follow Prometheus conventions (a cascade_ prefix, _total on
 * counters, _seconds on durations) and mirror vLLM's where one exists, so
 * dashboards built for it translate directly.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server_impl.h"

static const double ttft_bounds[CAS_SRV_HIST_BUCKETS] = {
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0};
static const double tpot_bounds[CAS_SRV_HIST_BUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3,   0.4,    0.5,   0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0};
static const double e2e_bounds[CAS_SRV_HIST_BUCKETS] = {
    0.01, 0.025, 0.05, 0.1,  0.25, 0.5,  1.0,   2.5,   5.0,   10.0,
    15.0, 20.0,  30.0, 40.0, 60.0, 90.0, 120.0, 240.0, 480.0, 960.0};

void cas_srv_metrics_init(cas_srv_metrics *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    m->ttft.bounds = ttft_bounds;
    m->tpot.bounds = tpot_bounds;
    m->e2e.bounds = e2e_bounds;
}

void cas_srv_metrics_destroy(cas_srv_metrics *m) { pthread_mutex_destroy(&m->mu); }

static void hist_add(cas_srv_hist *h, double v) {
    int b = 0;
    while (b < CAS_SRV_HIST_BUCKETS && v > h->bounds[b]) b++;
    h->counts[b]++;
    h->n++;
    h->sum += v;
}

void cas_srv_metrics_observe(cas_srv_metrics *m, double ttft, double tpot, double e2e) {
    pthread_mutex_lock(&m->mu);
    if (ttft >= 0) hist_add(&m->ttft, ttft);
    if (tpot >= 0) hist_add(&m->tpot, tpot);
    if (e2e >= 0) hist_add(&m->e2e, e2e);
    pthread_mutex_unlock(&m->mu);
}

void cas_srv_metrics_http(cas_srv_metrics *m, int status) {
    int c = status / 100;
    if (c < 1 || c > 5) return;
    pthread_mutex_lock(&m->mu);
    m->http_by_status[c]++;
    pthread_mutex_unlock(&m->mu);
}

typedef struct {
    char *p;
    size_t len, cap;
    int failed;
} buf;

static void put(buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(buf *b, const char *fmt, ...) {
    if (b->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->failed = 1;
            return;
        }
        if (b->p && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->len + (size_t)n + 1) cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->failed = 1;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
}

static void metric(buf *b, const char *name, const char *type, const char *help, double v) {
    put(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

static void hist(buf *b, const char *name, const char *help, const cas_srv_hist *h) {
    put(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < CAS_SRV_HIST_BUCKETS; i++) {
        cum += h->counts[i];
        put(b, "%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i], (unsigned long long)cum);
    }
    cum += h->counts[CAS_SRV_HIST_BUCKETS];
    put(b, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.17g\n%s_count %llu\n", name, (unsigned long long)cum,
        name, h->sum, name, (unsigned long long)h->n);
}

char *cas_srv_metrics_text(cas_srv_metrics *m, const cas_engine_stats *st) {
    buf b = {0};
    metric(&b, "cascade_num_requests_running", "gauge", "Requests in the engine's running batch.", st->running);
    metric(&b, "cascade_num_requests_waiting", "gauge", "Requests waiting to be scheduled.", st->waiting);
    metric(&b, "cascade_kv_pages_total", "gauge", "KV cache pages (blocks) in the pool.", (double)st->kv_blocks_total);
    metric(&b, "cascade_kv_pages_used", "gauge", "KV pages held by live requests.", (double)st->kv_blocks_used);
    /* The engine counts free pages after each step; before its first step no
     * page was ever taken, so every page is free. */
    int64_t kv_free = st->steps == 0 && st->kv_blocks_used == 0 ? st->kv_blocks_total : st->kv_blocks_free;
    metric(&b, "cascade_kv_pages_free", "gauge", "KV pages not held by any request.", (double)kv_free);
    metric(&b, "cascade_kv_pages_cached", "gauge", "Free KV pages that still hold a cached prefix.",
           (double)st->kv_blocks_cached);
    metric(&b, "cascade_kv_cache_usage_perc", "gauge", "Fraction of KV pages held by live requests.",
           st->kv_blocks_total ? (double)st->kv_blocks_used / (double)st->kv_blocks_total : 0.0);
    metric(&b, "cascade_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           (double)st->prefix_queries_tokens);
    metric(&b, "cascade_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
           (double)st->prefix_hit_tokens);
    metric(&b, "cascade_prefix_cache_hit_rate", "gauge", "Prefix-cache hits over queries, in tokens, since start.",
           st->prefix_queries_tokens ? (double)st->prefix_hit_tokens / (double)st->prefix_queries_tokens : 0.0);
    metric(&b, "cascade_steps_total", "counter", "Engine steps.", (double)st->steps);
    metric(&b, "cascade_cascade_steps_total", "counter", "Engine steps whose attention plan had a shared (cascade) pass.",
           (double)st->cascade_steps);
    metric(&b, "cascade_prompt_tokens_total", "counter", "Prompt tokens submitted.", (double)st->prompt_tokens_total);
    metric(&b, "cascade_prompt_tokens_computed_total", "counter", "Prompt tokens the model ran (not served from cache).",
           (double)st->prompt_tokens_computed);
    metric(&b, "cascade_generation_tokens_total", "counter", "Tokens generated.", (double)st->generation_tokens);
    metric(&b, "cascade_requests_finished_total", "counter", "Engine requests finished.", (double)st->requests_finished);
    metric(&b, "cascade_requests_aborted_total", "counter", "Engine requests aborted.", (double)st->requests_aborted);
    metric(&b, "cascade_preemptions_total", "counter", "Requests preempted for lack of KV pages.", (double)st->preemptions);
    metric(&b, "cascade_engine_busy_seconds_total", "counter", "Time spent in engine steps.", st->busy_seconds);
    metric(&b, "cascade_itl_limited_steps_total", "counter",
           "Engine steps whose prefill was cut to keep decoding streams under the inter-token latency target.",
           (double)st->itl_limited_steps);
    pthread_mutex_lock(&m->mu);
    hist(&b, "cascade_time_to_first_token_seconds", "Time from request arrival to its first token.", &m->ttft);
    hist(&b, "cascade_time_per_output_token_seconds", "Mean time between output tokens of a request, after the first.",
         &m->tpot);
    hist(&b, "cascade_e2e_request_latency_seconds", "Time from request arrival to its last token.", &m->e2e);
    put(&b, "# HELP cascade_http_responses_total HTTP responses by status class.\n"
            "# TYPE cascade_http_responses_total counter\n");
    for (int c = 1; c <= 5; c++)
        put(&b, "cascade_http_responses_total{code=\"%dxx\"} %llu\n", c, (unsigned long long)m->http_by_status[c]);
    put(&b, "# HELP cascade_requests_cancelled_total Requests whose client went away before the end.\n"
            "# TYPE cascade_requests_cancelled_total counter\ncascade_requests_cancelled_total %llu\n",
        (unsigned long long)m->requests_cancelled);
    metric(&b, "cascade_http_connections", "gauge", "Open client connections.", (double)m->conns_open);
    put(&b, "# HELP cascade_http_connections_closed_total Connections the server closed while they waited for "
            "request headers: past the header timeout, or the oldest such at the connection limit.\n"
            "# TYPE cascade_http_connections_closed_total counter\n"
            "cascade_http_connections_closed_total{reason=\"header_timeout\"} %llu\n"
            "cascade_http_connections_closed_total{reason=\"evicted\"} %llu\n",
        (unsigned long long)m->conns_header_timeout, (unsigned long long)m->conns_evicted);
    metric(&b, "cascade_server_draining", "gauge", "1 while the server drains for shutdown.", (double)m->draining);
    pthread_mutex_unlock(&m->mu);
    if (b.failed) {
        free(b.p);
        return NULL;
    }
    return b.p;
}
