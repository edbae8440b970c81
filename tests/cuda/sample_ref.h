/*
 * sample_ref.h: the GPU sampler's semantics (src/gpu/gpu_sample.cu) read
 * plainly on the host: the CPU sampler's filters (temperature, then top-k,
 * min-p and top-p over the weights w = exp((logit - max) / temperature),
 * sorted by weight with ties by id), then the draw u * total over the
 * survivors in id order. test_gpu_model compares the device's tokens with
 * it; the runtime stand-ins (gpu_stub.c) sample with it.
 */
#ifndef CASCADE_TEST_SAMPLE_REF_H
#define CASCADE_TEST_SAMPLE_REF_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float w;
    int32_t id;
} sample_ref_wid;

static int sample_ref_cmp(const void *a, const void *b) {
    const sample_ref_wid *x = a, *y = b;
    if (x->w != y->w) return x->w > y->w ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The token of logits x[V]; keep[V] receives the survivors, buf[V] is scratch. */
static inline int32_t sample_ref(const float *x, int32_t V, float temperature, int32_t top_k, float top_p,
                                 float min_p, float u, uint8_t *keep, sample_ref_wid *buf) {
    int32_t best = 0;
    for (int32_t i = 1; i < V; i++)
        if (x[i] > x[best]) best = i;
    memset(keep, 0, (size_t)V);
    if (temperature == 0.f) {
        keep[best] = 1;
        return best;
    }
    const float m = x[best], invt = 1.0f / temperature;
    int32_t n = 0;
    for (int32_t i = 0; i < V; i++) {
        const float w = expf((x[i] - m) * invt);
        if (w > 0.f) buf[n].w = w, buf[n].id = i, n++;
    }
    qsort(buf, (size_t)n, sizeof *buf, sample_ref_cmp);
    if (top_k > 0 && top_k < n) n = top_k;
    int32_t k = 0;
    for (int32_t i = 0; i < n; i++)
        if (buf[i].w >= min_p) buf[k++] = buf[i];
    n = k;
    if (top_p < 1.f && n > 1) {
        double total = 0, acc = 0;
        for (int32_t i = 0; i < n; i++) total += buf[i].w;
        k = 0;
        while (k < n) {
            acc += buf[k++].w;
            if (acc >= (double)top_p * total) break;
        }
        n = k;
    }
    for (int32_t i = 0; i < n; i++) keep[buf[i].id] = 1;
    double total = 0;
    for (int32_t i = 0; i < V; i++)
        if (keep[i]) total += expf((x[i] - m) * invt);
    const double target = (double)u * total;
    double acc = 0;
    int32_t last = best;
    for (int32_t i = 0; i < V; i++) {
        if (!keep[i]) continue;
        acc += expf((x[i] - m) * invt);
        last = i;
        if (acc > target) return i;
    }
    return last;
}

#endif
