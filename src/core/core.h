/*
 * core.h: the bottom layer of cascade. Status codes and error messages,
 * logging, aligned allocation, timing, CPU feature detection and machine
 * measurements, float16/bfloat16 conversion, vectorized tanh and GELU with
 * fixed bits, and .npy output. Every other layer includes this header and
 * nothing below it.
 *
 * Errors: library functions return a cas_status and record a message in a
 * thread-local buffer (cas_last_error()); they never exit or abort on bad
 * input. Only the command-line tool prints and exits.
 */
#ifndef CASCADE_CORE_H
#define CASCADE_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status and errors ------------------------------------------------ */

typedef enum {
    CAS_OK = 0,
    CAS_ERR_INVALID = 1,     /* a malformed argument or description */
    CAS_ERR_UNSUPPORTED = 2, /* valid, but not implemented (a head_dim, a type) */
    CAS_ERR_NOMEM = 3,       /* allocation failed or a fixed capacity is exceeded */
    CAS_ERR_IO = 4,          /* a file could not be read or written */
    CAS_ERR_FORMAT = 5,      /* a file's content is malformed */
    CAS_ERR_INTERNAL = 6     /* an invariant broke: a bug in cascade */
} cas_status;

/* Records status and a printf-style message for the calling thread and
 * returns the status, so that `return cas_error(CAS_ERR_INVALID, ...)` reads
 * naturally. */
cas_status cas_error(cas_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The message of the last error on this thread ("" when none). The pointer
 * stays valid until the next cas_error() on this thread. */
const char *cas_last_error(void);

/* A short name of a status ("invalid argument", ...). */
const char *cas_status_str(cas_status st);

/* Invariant check that reports file and line; always on (cheap checks only). */
#define CAS_ASSERT(cond)                                                       \
    do {                                                                       \
        if (!(cond)) cas_assert_fail(#cond, __FILE__, __LINE__);               \
    } while (0)
void cas_assert_fail(const char *expr, const char *file, int line)
    __attribute__((noreturn));

/* ---- logging ---------------------------------------------------------- */

typedef enum { CAS_LOG_ERROR = 0, CAS_LOG_WARN, CAS_LOG_INFO, CAS_LOG_DEBUG } cas_log_level;

/* Level starts from the environment variable CASCADE_LOG (error, warn, info,
 * debug); default warn. Messages go to stderr. Thread-safe. */
void cas_log_set_level(cas_log_level lvl);
int cas_log_enabled(cas_log_level lvl);
void cas_log(cas_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- memory ----------------------------------------------------------- */

/* 64-byte aligned allocation; NULL on failure or size overflow. Free with
 * cas_free. cas_alloc_array checks n * size for overflow. */
void *cas_alloc(size_t bytes);
void *cas_alloc_array(size_t n, size_t size);
void cas_free(void *p);

/* ---- time ------------------------------------------------------------- */

double cas_now_s(void); /* monotonic seconds */

/* ---- CPU features and machine measurements ---------------------------- */

/* What this CPU can run, detected once (CPUID and XGETBV) for every layer
 * that picks kernels: the attention kernels (src/attn) and the matrix kernels
 * (src/model) read it here, and their options (cas_attn_plan_opts.simd,
 * cas_model_opts.simd) choose among what it allows. Nothing here reads the
 * environment. */

/* Vector instruction levels, ordered: a level includes those below it.
 * In options, CAS_SIMD_AUTO (0) means the widest level this CPU has. */
typedef enum {
    CAS_SIMD_AUTO = 0,    /* options only: the widest level this CPU has */
    CAS_SIMD_GENERIC = 1, /* portable C */
    CAS_SIMD_AVX2 = 2,    /* AVX2, FMA and F16C */
    CAS_SIMD_AVX512 = 3   /* AVX-512 F, BW, VL and DQ, plus the AVX2 level */
} cas_simd_level;

/* Each flag is 1 when the CPU reports the instructions and, for vector
 * state, the OS saves their registers (XCR0: YMM for avx2, mask and ZMM
 * for avx512 and avx512_bf16). The AMX flags are CPUID bits only: tiles
 * can be used in this process only when cas_cpu_amx_ready() also says so. */
typedef struct {
    int32_t avx2;         /* AVX2, FMA and F16C */
    int32_t avx512;       /* AVX-512 F, BW, VL and DQ */
    int32_t avx512_bf16;  /* AVX512_BF16 (vdpbf16ps) */
    int32_t amx_tile;     /* AMX-TILE */
    int32_t amx_int8;     /* AMX-INT8 (tdpbssd and relatives) */
    int32_t amx_bf16;     /* AMX-BF16 (tdpbf16ps) */
    cas_simd_level simd;  /* the widest level: AVX512 (avx512 and avx2), AVX2 or GENERIC */
} cas_cpu_features;

/* The features of this CPU, detected on the first call. The struct is
 * static and never changes: any thread may call this and read it. */
const cas_cpu_features *cas_cpu_features_get(void);

/* "auto", "generic", "avx2", "avx512" ("?" for a value outside the enum). */
const char *cas_simd_name(cas_simd_level level);
/* The inverse of cas_simd_name; 0 on success, -1 (nothing written) for an
 * unknown name. */
int cas_simd_parse(const char *name, cas_simd_level *out);

/* The level an option asks for, on this CPU: CAS_SIMD_AUTO gives the CPU's
 * widest; an explicit level the CPU has is kept; a level it lacks (or a value
 * outside the enum) is refused with CAS_ERR_UNSUPPORTED (CAS_ERR_INVALID)
 * and a message naming `what`, so a test or benchmark that asks for a kernel
 * never silently measures another. */
cas_status cas_simd_resolve(cas_simd_level want, const char *what, cas_simd_level *out);

/* 1 if AMX tiles can be used in this process: the CPU has AMX-TILE, the OS
 * saves the tile state (XCR0 bits 17 and 18) and Linux granted this process
 * the tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM, asked once, on
 * the first call); else 0. Thread-safe. Callers check the AMX instruction
 * sets they use (cas_cpu_features: amx_bf16, amx_int8) themselves. */
int cas_cpu_amx_ready(void);

/* Machine ceilings that benchmarks print their results against
 * (core_measure.c). Streaming read bandwidth (bytes/s) over `bytes` with
 * `threads` threads, and the f32 FMA rate (FLOP/s, two per FMA) of the widest
 * vector unit this CPU has (cas_cpu_features_get()->simd); threads <= 0 means
 * all cores (omp_get_max_threads). Each returns the best of a few repeats;
 * 0 if the buffer cannot be allocated. Each runs for a fraction of a second. */
double cas_measure_read_bandwidth(size_t bytes, int threads);
double cas_measure_fma_flops(int threads);

/* ---- elementwise math ------------------------------------------------- */

/* tanh and the tanh-form GELU over float arrays, vectorized (AVX-512, AVX2)
 * and giving the same bits on every level, at every position of an array
 * and for every array length: the vector versions do the scalar ones'
 * IEEE operations lane for lane and finish their tails with them
 * (core_math.c). So a caller may split an array among threads any way it
 * likes, or pick any level, without changing a value. Accuracy against
 * float64 (tests/test_core.c): tanh within 3e-7 relative (measured 1.7e-7);
 * GELU within 1e-6 + 2e-7 |2z| relative for |x| <= 10 (the rounding of
 * the exp argument 2z is what grows for negative x). tanh(+-0) = +-0,
 * tanh(+-inf) = +-1, NaN stays NaN. Thread-safe; nothing allocated. */
float cas_tanhf(float x);
/* x / (1 + exp(-2z)), z = sqrt(2/pi) x (1 + 0.044715 x^2): 0.5 x (1 + tanh z) */
float cas_geluf(float x);
/* x[i] = out * tanh(in * x[i]), in place (a soft cap: in = 1 / cap, out = cap) */
void cas_tanh_scaled(float *x, int64_t n, float in, float out);
/* h[i] = gelu(g[i]) * u[i] (GeGLU); h may be g or u */
void cas_gelu_mul(const float *g, const float *u, float *h, int64_t n);
/* The same at a given level (tests and benchmarks): AUTO is the CPU's
 * widest, a level the CPU lacks falls back to the widest it has. */
void cas_tanh_scaled_at(cas_simd_level lvl, float *x, int64_t n, float in, float out);
void cas_gelu_mul_at(cas_simd_level lvl, const float *g, const float *u, float *h, int64_t n);

/* ---- number formats --------------------------------------------------- */

/* IEEE half and bfloat16, stored as raw 16-bit words. Conversions to float
 * are exact; conversions from float round to nearest even (NaN stays NaN). */
float cas_f16_to_f32(uint16_t h);
uint16_t cas_f32_to_f16(float f);
float cas_bf16_to_f32(uint16_t b);
uint16_t cas_f32_to_bf16(float f);

/* ---- .npy output ------------------------------------------------------ */

/* Writes a C-order array as a NumPy .npy file (format 1.0). dtype is one of
 * "<f4", "<i4", "<f8". shape has ndim entries. */
cas_status cas_npy_write(const char *path, const char *dtype, const int64_t *shape, int ndim,
                         const void *data);

/* ---- random numbers --------------------------------------------------- */

/* A small, seedable generator (splitmix64 seeded xoshiro-style) for tests
 * and benchmarks; not for cryptography. */
typedef struct {
    uint64_t s[4];
} cas_rng;
void cas_rng_seed(cas_rng *r, uint64_t seed);
uint64_t cas_rng_u64(cas_rng *r);
double cas_rng_uniform(cas_rng *r);            /* [0, 1) */
int64_t cas_rng_range(cas_rng *r, int64_t lo, int64_t hi); /* [lo, hi] */
double cas_rng_normal(cas_rng *r);

#ifdef __cplusplus
}
#endif

#endif
