/*
 * nccl_stub.c: NCCL's calls of the GPU forward (src/gpu/gpu_model.c) as
 * host stand-ins, for the stand-in build of tests/cuda/gpu_stub.c: the
 * communicators of one ncclCommInitAll are one group, and an all-reduce is
 * carried out when every rank's thread has called it (the ranks run on
 * threads of their own, as on GPUs): each rank sums all ranks' buffers in
 * rank order, so every rank gets the same bits, as from NCCL. Only what the
 * forward uses: f32 sums.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <nccl.h>

#define STUB_MAX_RANKS 16

typedef struct {
    int n, refs;
    pthread_barrier_t bar;
    pthread_mutex_t mu;
    const float *send[STUB_MAX_RANKS];
} stub_group;

struct ncclComm {
    stub_group *g;
    int rank;
};

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int n, const int *devlist) {
    if (n < 1 || n > STUB_MAX_RANKS) return ncclInvalidArgument;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (devlist[i] == devlist[j]) return ncclInvalidUsage; /* NCCL: two ranks on one device */
    stub_group *g = calloc(1, sizeof *g);
    if (!g) return ncclSystemError;
    g->n = g->refs = n;
    pthread_barrier_init(&g->bar, NULL, (unsigned)n);
    pthread_mutex_init(&g->mu, NULL);
    for (int i = 0; i < n; i++) {
        comms[i] = calloc(1, sizeof *comms[i]);
        if (!comms[i]) return ncclSystemError;
        comms[i]->g = g;
        comms[i]->rank = i;
    }
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    if (datatype != ncclFloat32 || op != ncclSum) return ncclInvalidArgument;
    stub_group *g = comm->g;
    if (g->n == 1) {
        memmove(recvbuff, sendbuff, count * sizeof(float));
        return ncclSuccess;
    }
    float *sum = malloc(count * sizeof(float));
    if (!sum) return ncclSystemError;
    g->send[comm->rank] = sendbuff;
    pthread_barrier_wait(&g->bar); /* every rank's buffer is in */
    memcpy(sum, g->send[0], count * sizeof(float));
    for (int j = 1; j < g->n; j++)
        for (size_t i = 0; i < count; i++) sum[i] += g->send[j][i];
    pthread_barrier_wait(&g->bar); /* every rank has read every buffer */
    memcpy(recvbuff, sum, count * sizeof(float));
    free(sum);
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) { return ncclSuccess; }

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclSuccess;
    stub_group *g = comm->g;
    pthread_mutex_lock(&g->mu);
    const int last = --g->refs == 0;
    pthread_mutex_unlock(&g->mu);
    if (last) {
        pthread_barrier_destroy(&g->bar);
        pthread_mutex_destroy(&g->mu);
        free(g);
    }
    free(comm);
    return ncclSuccess;
}

/* nccl.h declares these without a parameter list */
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclGroupStart(void) { return ncclSuccess; }
ncclResult_t ncclGroupEnd(void) { return ncclSuccess; }
const char *ncclGetErrorString(ncclResult_t result) { return result == ncclSuccess ? "no error" : "error (stub)"; }
