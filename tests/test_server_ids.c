/*
 * test_server_ids.c: response ids (cas_server_make_id). 100,000 ids must be
 * distinct and each "cmpl-" or "chatcmpl-" followed by 32 lowercase hex
 * digits; the digits must look random (every hex digit about equally often
 * in every position), not a counter, which would pass the uniqueness check
 * alone. Also: a buffer too small is cut, never overrun.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/server/server.h"
#include "check.h"

#define N_IDS 100000
#define HEX 32

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int well_formed(const char *id, const char *prefix) {
    size_t pl = strlen(prefix);
    if (strncmp(id, prefix, pl) || strlen(id) != pl + HEX) return 0;
    for (size_t i = pl; i < pl + HEX; i++)
        if (!((id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'f'))) return 0;
    return 1;
}

static void test_ids_unique(void) {
    char *buf = malloc((size_t)N_IDS * 48);
    char **ids = malloc((size_t)N_IDS * sizeof *ids);
    REQUIRE(buf && ids);
    static long counts[HEX][16];
    memset(counts, 0, sizeof counts);
    int bad = 0;
    for (int i = 0; i < N_IDS; i++) {
        const char *prefix = i % 2 ? "chatcmpl-" : "cmpl-";
        ids[i] = buf + (size_t)i * 48;
        CHECK(cas_server_make_id(ids[i], 48, prefix) == 0);
        if (!well_formed(ids[i], prefix)) {
            if (bad++ < 3) printf("  malformed id: %s\n", ids[i]);
            continue;
        }
        const char *hex = ids[i] + strlen(prefix);
        for (int k = 0; k < HEX; k++) counts[k][hex[k] <= '9' ? hex[k] - '0' : hex[k] - 'a' + 10]++;
    }
    CHECK(bad == 0);
    /* duplicates: compare the random parts (the prefix alternates) */
    for (int i = 0; i < N_IDS; i++) ids[i] += i % 2 ? 9 : 5;
    qsort(ids, N_IDS, sizeof *ids, cmp_str);
    int dups = 0;
    for (int i = 1; i < N_IDS; i++) dups += !strcmp(ids[i - 1], ids[i]);
    CHECKF(dups == 0, "%d repeated ids", dups);
    /* each digit position: 16 values, 6,250 expected each; a fair source
     * stays within +-10% (that is 8 standard deviations) */
    int skewed = 0;
    for (int k = 0; k < HEX; k++)
        for (int v = 0; v < 16; v++)
            if (counts[k][v] < 5625 || counts[k][v] > 6875) skewed++;
    CHECKF(skewed == 0, "%d (position, digit) counts outside 6250 +- 10%%", skewed);
    free(ids);
    free(buf);
}

/* Ids made by several threads at once are distinct too. */
#define N_THREADS 4
#define PER_THREAD 5000
static char thread_ids[N_THREADS * PER_THREAD][48];

static void *make_many(void *arg) {
    int t = (int)(intptr_t)arg;
    for (int i = 0; i < PER_THREAD; i++) cas_server_make_id(thread_ids[t * PER_THREAD + i], 48, "cmpl-");
    return NULL;
}

static int cmp_row(const void *a, const void *b) { return strcmp(a, b); }

static void test_ids_threads(void) {
    pthread_t th[N_THREADS];
    for (int t = 0; t < N_THREADS; t++) REQUIRE(pthread_create(&th[t], NULL, make_many, (void *)(intptr_t)t) == 0);
    for (int t = 0; t < N_THREADS; t++) pthread_join(th[t], NULL);
    qsort(thread_ids, N_THREADS * PER_THREAD, 48, cmp_row);
    int dups = 0;
    for (int i = 1; i < N_THREADS * PER_THREAD; i++) dups += !strcmp(thread_ids[i - 1], thread_ids[i]);
    CHECK(dups == 0);
}

static void test_ids_small_buffer(void) {
    char b[12];
    memset(b, 'x', sizeof b);
    cas_server_make_id(b, 8, "cmpl-");
    CHECK(strlen(b) < 8);
    CHECK(!strncmp(b, "cmpl-", 5));
    CHECK(b[8] == 'x' && b[11] == 'x');
    char z = 'x';
    cas_server_make_id(&z, 0, "cmpl-");
    CHECK(z == 'x');
}

int main(void) {
    RUN(test_ids_unique);
    RUN(test_ids_threads);
    RUN(test_ids_small_buffer);
    return check_summary();
}
