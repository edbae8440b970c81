/* GPU timeline recorder for machines without Nsight Systems: a shared library
 * that the CUDA driver loads into any CUDA program through its injection hook,
 * records every kernel, memcpy and memset with CUPTI's activity API and, at
 * exit, writes them to one CSV file for tools/cuda_idle.py.
 *
 * Usage (a CUDA=1 build; `make CUDA=1 BUILD=build-cuda build-cuda/libcas_cuda_trace.so`):
 *
 *   CUDA_INJECTION64_PATH=$PWD/build-cuda/libcas_cuda_trace.so CAS_TRACE_OUT=/tmp/t.csv \
 *     ./build-cuda/cascade bench ...
 *   python3 tools/cuda_idle.py /tmp/t.csv --skip 5
 *
 * CAS_TRACE_OUT names the output (default cuda_trace.csv in the working
 * directory). CAS_TRACE_SKIP_S=<seconds> drops records that start earlier than
 * that many seconds after the first record (model loading, warm-up). The file
 * has a header line, then one line per record:
 *
 *   kind,start_ns,end_ns,stream,graph_id,name
 *
 * kind is kernel, memcpy or memset; times are CUPTI's GPU timestamps in ns;
 * graph_id is 0 for work launched outside a CUDA graph; name is the kernel's
 * mangled name, the copy's direction (HtoD, DtoH, DtoD, ...) or "memset".
 *
 * Why built this way: CUPTI hands records over in buffers from its own thread;
 * each completed buffer is converted at once into compact 32-byte records kept
 * in 8 MiB chunks (a linked list) with kernel names interned, so millions of
 * records cost little memory, the kernel name pointers inside CUPTI's records
 * are not needed after the callback, and nothing is written to disk while the
 * program runs. The file is written once, from an atexit handler registered
 * in InitializeInjection (it runs before the CUDA runtime's own exit handlers,
 * while contexts are alive, so the final forced flush still sees them) or,
 * failing that, from the library's destructor; a flag makes it happen once.
 * A program that ends in _exit or a signal writes nothing.
 *
 * The record structs are those named by CUDA 13.0's cupti_activity.h for each
 * kind (CUpti_ActivityKernel10, CUpti_ActivityMemcpy6, CUpti_ActivityMemset4);
 * another CUPTI may rename them, and the library warns when the libcupti it
 * runs with is older than the header it was compiled against.
 */
#include <cupti.h>

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CUPTI_BUF_BYTES ((size_t)8 << 20) /* one CUPTI activity buffer */
#define CHUNK_BYTES ((size_t)8 << 20)     /* one chunk of converted records */

enum { REC_KERNEL, REC_MEMCPY, REC_MEMSET };
static const char *const rec_kind_name[] = {"kernel", "memcpy", "memset"};

/* One GPU activity, as written to the CSV. */
typedef struct {
    uint64_t start, end; /* GPU timestamps, ns */
    uint32_t stream;     /* CUPTI stream id */
    uint32_t graph_id;   /* 0 outside a CUDA graph */
    uint32_t name;       /* index into names[] */
    uint8_t kind;        /* REC_* */
} trace_rec;

typedef struct chunk {
    struct chunk *next;
    size_t n; /* records used */
    trace_rec rec[];
} chunk;

#define CHUNK_CAP ((CHUNK_BYTES - sizeof(chunk)) / sizeof(trace_rec))

/* All state below is guarded by lock: CUPTI completes buffers on its own
 * thread, and the exit path reads what it filled. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static chunk *head, *tail;     /* converted records, oldest chunk first */
static uint64_t n_records;     /* records kept */
static uint64_t n_incomplete;  /* records without timestamps (not written) */
static uint64_t n_dropped;     /* records CUPTI dropped (buffer full) */
static int out_of_memory;      /* a chunk or name could not be allocated */

/* Interned names: names[i] is a private copy; slots is an open-addressed
 * hash table of indices + 1 (0 = empty) with n_slots a power of two. */
static char **names;
static uint32_t n_names, cap_names;
static uint32_t *slots;
static uint32_t n_slots;

static atomic_int written;   /* the CSV was written (or is being written) */
static atomic_int injected;  /* InitializeInjection ran */

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* Grows the hash table to twice its size (or 1024) and reinserts every name. */
static int grow_slots(void) {
    uint32_t n = n_slots ? 2 * n_slots : 1024;
    uint32_t *s = calloc(n, sizeof *s);
    if (!s) return -1;
    for (uint32_t i = 0; i < n_names; i++) {
        uint32_t j = (uint32_t)hash_str(names[i]) & (n - 1);
        while (s[j]) j = (j + 1) & (n - 1);
        s[j] = i + 1;
    }
    free(slots);
    slots = s;
    n_slots = n;
    return 0;
}

/* The index of name in names[], added if new; UINT32_MAX when out of memory.
 * Called with lock held. */
static uint32_t intern(const char *name) {
    if (!name) name = "?";
    if (2 * (n_names + 1) > n_slots && grow_slots()) return UINT32_MAX;
    uint32_t j = (uint32_t)hash_str(name) & (n_slots - 1);
    for (; slots[j]; j = (j + 1) & (n_slots - 1))
        if (!strcmp(names[slots[j] - 1], name)) return slots[j] - 1;
    if (n_names == cap_names) {
        uint32_t cap = cap_names ? 2 * cap_names : 256;
        char **nn = realloc(names, cap * sizeof *nn);
        if (!nn) return UINT32_MAX;
        names = nn;
        cap_names = cap;
    }
    char *copy = strdup(name);
    if (!copy) return UINT32_MAX;
    names[n_names] = copy;
    slots[j] = n_names + 1;
    return n_names++;
}

/* Appends one record. Called with lock held. */
static void push(uint8_t kind, uint64_t start, uint64_t end, uint32_t stream, uint32_t graph_id,
                 const char *name) {
    if (start == 0 || end < start) {
        n_incomplete++;
        return;
    }
    if (!tail || tail->n == CHUNK_CAP) {
        chunk *c = malloc(CHUNK_BYTES);
        if (!c) {
            out_of_memory = 1;
            return;
        }
        c->next = NULL;
        c->n = 0;
        if (tail) tail->next = c;
        else head = c;
        tail = c;
    }
    uint32_t id = intern(name);
    if (id == UINT32_MAX) {
        out_of_memory = 1;
        return;
    }
    tail->rec[tail->n++] = (trace_rec){start, end, stream, graph_id, id, kind};
    n_records++;
}

static const char *memcpy_kind_name(uint8_t k) {
    switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOA: return "HtoA";
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOH: return "AtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOA: return "AtoA";
    case CUPTI_ACTIVITY_MEMCPY_KIND_ATOD: return "AtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOA: return "DtoA";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "PtoP";
    default: return "unknown";
    }
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    /* CUPTI wants 8-byte aligned buffers; NULL makes it drop records. */
    *buffer = aligned_alloc(8, CUPTI_BUF_BYTES);
    *size = *buffer ? CUPTI_BUF_BYTES : 0;
    *max_records = 0; /* as many as fit */
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer, size_t size,
                                      size_t valid_size) {
    (void)size;
    CUpti_Activity *r = NULL;
    pthread_mutex_lock(&lock);
    while (valid_size > 0 && cuptiActivityGetNextRecord(buffer, valid_size, &r) == CUPTI_SUCCESS) {
        switch (r->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
            push(REC_KERNEL, k->start, k->end, k->streamId, k->graphId, k->name);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
            push(REC_MEMCPY, m->start, m->end, m->streamId, m->graphId, memcpy_kind_name(m->copyKind));
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
            push(REC_MEMSET, m->start, m->end, m->streamId, m->graphId, "memset");
            break;
        }
        default: break;
        }
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream_id, &dropped) == CUPTI_SUCCESS) n_dropped += dropped;
    pthread_mutex_unlock(&lock);
    free(buffer);
}

/* Writes s as one CSV field, quoted only when it holds a comma, quote or
 * line break (mangled names never do; demangled ones may). */
static void put_field(FILE *f, const char *s) {
    if (!strpbrk(s, ",\"\r\n")) {
        fputs(s, f);
        return;
    }
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

/* Flushes CUPTI's buffers and writes every record once; later calls return. */
static void write_trace(void) {
    if (!atomic_load(&injected) || atomic_exchange(&written, 1)) return;
    CUptiResult fr = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (fr != CUPTI_SUCCESS) {
        const char *msg = "?";
        cuptiGetResultString(fr, &msg);
        fprintf(stderr, "cuda_trace: cuptiActivityFlushAll: %s (records still in CUPTI's buffers are lost)\n", msg);
    }

    const char *path = getenv("CAS_TRACE_OUT");
    if (!path || !*path) path = "cuda_trace.csv";
    const char *skip_env = getenv("CAS_TRACE_SKIP_S");
    double skip_s = skip_env ? strtod(skip_env, NULL) : 0.0;

    pthread_mutex_lock(&lock);
    uint64_t first = UINT64_MAX;
    for (const chunk *c = head; c; c = c->next)
        for (size_t i = 0; i < c->n; i++)
            if (c->rec[i].start < first) first = c->rec[i].start;
    uint64_t from = 0;
    if (skip_s > 0 && first != UINT64_MAX) from = first + (uint64_t)(skip_s * 1e9);

    FILE *f = fopen(path, "w");
    if (!f) {
        perror("cuda_trace: cannot open CAS_TRACE_OUT");
        pthread_mutex_unlock(&lock);
        return;
    }
    static char iobuf[1 << 20];
    setvbuf(f, iobuf, _IOFBF, sizeof iobuf);
    fputs("kind,start_ns,end_ns,stream,graph_id,name\n", f);
    uint64_t n_out = 0;
    for (const chunk *c = head; c; c = c->next)
        for (size_t i = 0; i < c->n; i++) {
            const trace_rec *r = &c->rec[i];
            if (r->start < from) continue;
            fprintf(f, "%s,%" PRIu64 ",%" PRIu64 ",%" PRIu32 ",%" PRIu32 ",", rec_kind_name[r->kind], r->start,
                    r->end, r->stream, r->graph_id);
            put_field(f, names[r->name]);
            fputc('\n', f);
            n_out++;
        }
    int werr = ferror(f);
    if (fclose(f) || werr) fprintf(stderr, "cuda_trace: error writing %s\n", path);
    fprintf(stderr, "cuda_trace: %" PRIu64 " of %" PRIu64 " records written to %s", n_out, n_records, path);
    if (n_incomplete) fprintf(stderr, ", %" PRIu64 " without timestamps left out", n_incomplete);
    if (n_dropped) fprintf(stderr, ", %" PRIu64 " DROPPED by CUPTI", n_dropped);
    if (out_of_memory) fprintf(stderr, ", some LOST (out of memory)");
    fputc('\n', stderr);
    pthread_mutex_unlock(&lock);
}

/* Called by the CUDA driver during cuInit when CUDA_INJECTION64_PATH names
 * this library. Returns 1 on success, 0 when CUPTI could not be set up (the
 * program then runs untraced). */
int InitializeInjection(void);
int InitializeInjection(void) {
    if (atomic_exchange(&injected, 1)) return 1;
    uint32_t version = 0;
    if (cuptiGetVersion(&version) == CUPTI_SUCCESS && version < CUPTI_API_VERSION)
        fprintf(stderr, "cuda_trace: libcupti API version %u is older than the header's %u; records may be misread\n",
                version, (unsigned)CUPTI_API_VERSION);
    CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (r == CUPTI_SUCCESS) r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (r == CUPTI_SUCCESS) r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    if (r == CUPTI_SUCCESS) r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    if (r != CUPTI_SUCCESS) {
        const char *msg = "?";
        cuptiGetResultString(r, &msg);
        fprintf(stderr, "cuda_trace: CUPTI setup failed: %s; not tracing\n", msg);
        atomic_store(&injected, 0);
        return 0;
    }
    if (atexit(write_trace)) fprintf(stderr, "cuda_trace: atexit failed; writing from the destructor\n");
    return 1;
}

/* The fallback when the atexit handler did not run (e.g. the library is
 * unloaded first); a no-op when it did. */
__attribute__((destructor)) static void cuda_trace_fini(void) { write_trace(); }
