/*
 * gpu_sample.cu: tokens from the logits rows on the device, so that only the
 * tokens cross to the host. The filters are the CPU sampler's
 * (src/model/sampler.c), in its order: temperature, then top-k, min-p and
 * top-p over the weights w = exp((logit - max) / temperature), then a draw
 * of u * (sum of what is left), u in [0, 1) given by the host (each
 * request's own generator, so a seeded request gives the same tokens
 * whatever shares its batch). Greedy (temperature 0) is the argmax, ties to
 * the lowest id.
 *
 * One block of 1024 threads per row; thread t owns the contiguous ids
 * [t C, (t + 1) C), C = ceil(V / 1024). Every set is a threshold on w with
 * ties at the threshold taken in id order, so the kept set is a predicate
 * each thread evaluates over its own ids from a few numbers in shared
 * memory, and every count and sum is reduced in a fixed order: the same row
 * and the same u give the same token on every run.
 *
 * - top-k: the k-th largest weight by a radix select over the bits of w
 *   (positive floats order as their bit patterns): four 8-bit passes of a
 *   histogram; the ties at the threshold kept are the lowest ids.
 * - min-p: the largest weight is exp(0) = 1 and top-k always keeps it, so
 *   min-p keeps w >= min_p.
 * - top-p: the CPU keeps the heaviest survivors, sorted by weight then id,
 *   until their sum reaches top_p times the total; here the threshold is
 *   found by bisection over the bit patterns of w (S(tau), the survivors'
 *   sum at w >= tau, falls as tau rises), then as many ties at it as needed.
 * - the draw walks the survivors in id order (the CPU walks its candidate
 *   order; both draw from the same distribution).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu_impl.h"

#define NT 1024
#define NW (NT / 32)

__device__ __forceinline__ uint32_t fbits(float x) { return __float_as_uint(x); }

/* fixed-order block sums: warp shuffles, then warp 0 over the warps' sums */
template <typename T> __device__ T block_sum(T v, T *sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    T t = 0;
    for (int w = 0; w < NW; w++) t += sh[w];
    return t;
}

/* exclusive prefix over threads of a per-thread count, in thread order */
__device__ int64_t block_excl_scan(int64_t v, int64_t *sh) {
    __syncthreads();
    sh[threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        int64_t acc = 0;
        for (int i = 0; i < NT; i++) {
            const int64_t x = sh[i];
            sh[i] = acc;
            acc += x;
        }
    }
    __syncthreads();
    return sh[threadIdx.x];
}

struct row_state {
    float m, invt, min_p;
    uint32_t tk;    /* top-k threshold bits (0: none) */
    int64_t ck;     /* ties at tk kept (lowest ids) */
    uint32_t tp;    /* top-p threshold bits (0: none) */
    int64_t cp;     /* ties at tp kept */
};

__device__ __forceinline__ float weight(const row_state &s, float l) { return expf((l - s.m) * s.invt); }

/* the survivors of top-k and min-p: keep_k(i) given the tie rank of i among w == tk */
__device__ __forceinline__ bool keep_k(const row_state &s, uint32_t b, int64_t rk, float w) {
    if (w <= 0.f) return false;
    if (s.tk && (b < s.tk || (b == s.tk && rk >= s.ck))) return false;
    return w >= s.min_p;
}

/* Whether a weight survives every filter, given the tie ranks of its id
 * (rk among w == tk, rp among the survivors of top-k and min-p at w == tp),
 * which it advances: called for a thread's ids in order. */
__device__ __forceinline__ bool survives(const row_state &s, float w, int64_t &rk, int64_t &rp) {
    const uint32_t b = fbits(w);
    bool k = keep_k(s, b, rk, w);
    if (s.tk && b == s.tk) rk++;
    if (k && s.tp) {
        if (b < s.tp || (b == s.tp && rp >= s.cp)) k = false;
        if (b == s.tp) rp++;
    }
    return k;
}

__global__ void __launch_bounds__(NT) sample_kernel(const float *__restrict__ logits, int32_t V,
                                                    const gpu_sample_row *__restrict__ rows,
                                                    int32_t *__restrict__ out) {
    const int r = blockIdx.x, t = threadIdx.x;
    const float *x = logits + (int64_t)r * V;
    const gpu_sample_row p = rows[r];
    const int32_t C = (V + NT - 1) / NT, lo = t * C < V ? t * C : V, hi = lo + C < V ? lo + C : V;
    __shared__ float shf[NW];
    __shared__ int32_t shi[NW];
    __shared__ double shd[NW];
    __shared__ int64_t shl[NT];
    __shared__ uint32_t hist[256];
    __shared__ row_state s;
    __shared__ int32_t result;

    /* argmax, ties to the lowest id */
    float bv = -INFINITY;
    int32_t bi = V;
    for (int32_t i = lo; i < hi; i++)
        if (x[i] > bv || (x[i] == bv && i < bi)) bv = x[i], bi = i;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    if ((t & 31) == 0) shf[t >> 5] = bv, shi[t >> 5] = bi;
    __syncthreads();
    if (t == 0) {
        float v = shf[0];
        int32_t id = shi[0];
        for (int w = 1; w < NW; w++)
            if (shf[w] > v || (shf[w] == v && shi[w] < id)) v = shf[w], id = shi[w];
        result = id < V ? id : 0;
        s.m = v;
        s.invt = p.temperature > 0.f ? 1.0f / p.temperature : 0.f;
        s.min_p = p.min_p;
        s.tk = 0, s.ck = 0, s.tp = 0, s.cp = 0;
    }
    __syncthreads();
    if (!(p.temperature > 0.f) || !isfinite(s.m)) {
        if (t == 0) out[r] = result;
        return;
    }

    /* top-k: the k-th largest w by radix select on its bits */
    int64_t npos = 0;
    for (int32_t i = lo; i < hi; i++) npos += weight(s, x[i]) > 0.f;
    npos = block_sum<int64_t>(npos, reinterpret_cast<int64_t *>(shd));
    if (p.top_k > 0 && p.top_k < npos) {
        uint32_t prefix = 0, mask = 0;
        int64_t krem = p.top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = t; i < 256; i += NT) hist[i] = 0;
            __syncthreads();
            for (int32_t i = lo; i < hi; i++) {
                const float w = weight(s, x[i]);
                const uint32_t b = fbits(w);
                if (w > 0.f && (b & mask) == prefix) atomicAdd(&hist[(b >> shift) & 255u], 1u);
            }
            __syncthreads();
            /* from the top bin down, the bin holding the krem-th largest */
            __shared__ uint32_t sel_bin;
            __shared__ int64_t sel_rem;
            if (t == 0) {
                int64_t acc = 0;
                int bin = 0;
                for (int bb = 255; bb >= 0; bb--) {
                    if (acc + hist[bb] >= krem) {
                        bin = bb;
                        break;
                    }
                    acc += hist[bb];
                }
                sel_bin = (uint32_t)bin;
                sel_rem = krem - acc;
            }
            __syncthreads();
            prefix |= sel_bin << shift;
            mask |= 255u << shift;
            krem = sel_rem;
            __syncthreads();
        }
        if (t == 0) s.tk = prefix, s.ck = krem;
        __syncthreads();
    }
    /* each thread's first tie rank at tk */
    int64_t eq = 0;
    if (s.tk)
        for (int32_t i = lo; i < hi; i++) eq += fbits(weight(s, x[i])) == s.tk;
    const int64_t rk0 = s.tk ? block_excl_scan(eq, shl) : 0;

    /* top-p over the survivors: bisection for the largest tau with S(tau) >= top_p * total */
    auto surv_sum = [&](uint32_t tau) -> double {
        double acc = 0;
        int64_t rk = rk0;
        for (int32_t i = lo; i < hi; i++) {
            const float w = weight(s, x[i]);
            const uint32_t b = fbits(w);
            const bool k = keep_k(s, b, rk, w);
            if (s.tk && b == s.tk) rk++;
            if (k && b >= tau) acc += (double)w;
        }
        return block_sum<double>(acc, shd);
    };
    int64_t nsurv = 0;
    {
        int64_t rk = rk0;
        for (int32_t i = lo; i < hi; i++) {
            const float w = weight(s, x[i]);
            const uint32_t b = fbits(w);
            nsurv += keep_k(s, b, rk, w);
            if (s.tk && b == s.tk) rk++;
        }
        nsurv = block_sum<int64_t>(nsurv, reinterpret_cast<int64_t *>(shd));
    }
    if (p.top_p < 1.f && nsurv > 1) {
        const double total = surv_sum(0u), target = (double)p.top_p * total;
        uint32_t lo_b = 0u, hi_b = fbits(1.0f); /* S(lo_b) >= target; find the largest such */
        while (lo_b < hi_b) {
            const uint32_t mid = lo_b + (hi_b - lo_b + 1) / 2;
            if (surv_sum(mid) >= target) lo_b = mid;
            else hi_b = mid - 1;
        }
        /* the ties at lo_b: enough of them (in id order) to reach the target */
        const double above = lo_b < fbits(1.0f) ? surv_sum(lo_b + 1) : 0.0;
        if (t == 0) {
            const float w = __uint_as_float(lo_b);
            const int64_t c = (int64_t)ceil((target - above) / (double)w);
            s.tp = lo_b;
            s.cp = c < 1 ? 1 : c;
        }
        __syncthreads();
    }
    /* each thread's first tie rank at tp among the survivors */
    int64_t eqp = 0;
    if (s.tp) {
        int64_t rk = rk0;
        for (int32_t i = lo; i < hi; i++) {
            const float w = weight(s, x[i]);
            const uint32_t b = fbits(w);
            if (keep_k(s, b, rk, w) && b == s.tp) eqp++;
            if (s.tk && b == s.tk) rk++;
        }
    }
    const int64_t rp0 = s.tp ? block_excl_scan(eqp, shl) : 0;

    /* the draw: the survivors' weights in id order, u times their sum */
    double part = 0;
    int32_t last = -1;
    {
        int64_t rk = rk0, rp = rp0;
        for (int32_t i = lo; i < hi; i++) {
            const float w = weight(s, x[i]);
            if (survives(s, w, rk, rp)) part += (double)w, last = i;
        }
    }
    const double total = block_sum<double>(part, shd);
    /* thread-order exclusive prefix of the parts (doubles in shl's storage) */
    __syncthreads();
    double *shp = reinterpret_cast<double *>(shl);
    shp[t] = part;
    __syncthreads();
    __shared__ int32_t owner;
    __shared__ double before;
    if (t == 0) {
        const double target = (double)p.u * total;
        double acc = 0;
        int w = -1;
        for (int i = 0; i < NT; i++) {
            if (shp[i] > 0 && acc + shp[i] > target) {
                w = i;
                break;
            }
            acc += shp[i];
        }
        if (w < 0) /* rounding: the last survivor */
            for (int i = NT - 1; i >= 0 && w < 0; i--)
                if (shp[i] > 0) w = i, acc -= shp[i];
        owner = w;
        before = acc;
    }
    __syncthreads();
    if (owner < 0) {
        if (t == 0) out[r] = result; /* nothing survived: the argmax */
        return;
    }
    if (t == owner) {
        const double target = (double)p.u * total;
        double acc = before;
        int64_t rk = rk0, rp = rp0;
        int32_t pick = last;
        for (int32_t i = lo; i < hi; i++) {
            const float w = weight(s, x[i]);
            if (!survives(s, w, rk, rp)) continue;
            acc += (double)w;
            if (acc > target) {
                pick = i;
                break;
            }
        }
        out[r] = pick;
    }
}

extern "C" int cas_gpu_sample_rows(const float *logits, int32_t n_rows, int32_t V, const gpu_sample_row *rows,
                              int32_t *out, void *stream) {
    if (n_rows <= 0) return 0;
    sample_kernel<<<n_rows, NT, 0, (cudaStream_t)stream>>>(logits, V, rows, out);
    return (int)cudaGetLastError();
}
