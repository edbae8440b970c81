/*
 * core.c: errors, logging, allocation, time, number formats, .npy output, a
 * small random generator and what this CPU can run (features, SIMD level, AMX
 * permission). Nothing here knows about attention or models; the machine
 * measurements, which need OpenMP and vector code, are in core_measure*.c.
 */
#define _POSIX_C_SOURCE 200809L
#include "core.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* ---- errors ----------------------------------------------------------- */

static _Thread_local char err_buf[1024];

cas_status cas_error(cas_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err_buf, sizeof err_buf, fmt, ap);
    va_end(ap);
    return st;
}

const char *cas_last_error(void) { return err_buf; }

const char *cas_status_str(cas_status st) {
    switch (st) {
    case CAS_OK: return "ok";
    case CAS_ERR_INVALID: return "invalid argument";
    case CAS_ERR_UNSUPPORTED: return "unsupported";
    case CAS_ERR_NOMEM: return "out of memory";
    case CAS_ERR_IO: return "i/o error";
    case CAS_ERR_FORMAT: return "bad format";
    case CAS_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

void cas_assert_fail(const char *expr, const char *file, int line) {
    fprintf(stderr, "cascade: assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

/* ---- logging ---------------------------------------------------------- */

static int log_level = -1;
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;

static int log_level_get(void) {
    int lvl = __atomic_load_n(&log_level, __ATOMIC_RELAXED);
    if (lvl >= 0) return lvl;
    lvl = CAS_LOG_WARN;
    const char *e = getenv("CASCADE_LOG");
    if (e) {
        if (!strcmp(e, "error")) lvl = CAS_LOG_ERROR;
        else if (!strcmp(e, "warn")) lvl = CAS_LOG_WARN;
        else if (!strcmp(e, "info")) lvl = CAS_LOG_INFO;
        else if (!strcmp(e, "debug")) lvl = CAS_LOG_DEBUG;
    }
    __atomic_store_n(&log_level, lvl, __ATOMIC_RELAXED);
    return lvl;
}

void cas_log_set_level(cas_log_level lvl) { __atomic_store_n(&log_level, (int)lvl, __ATOMIC_RELAXED); }

int cas_log_enabled(cas_log_level lvl) { return (int)lvl <= log_level_get(); }

void cas_log(cas_log_level lvl, const char *fmt, ...) {
    if (!cas_log_enabled(lvl)) return;
    static const char *names[] = {"error", "warn", "info", "debug"};
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&log_mu);
    fprintf(stderr, "[cascade %s] ", names[lvl]);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    pthread_mutex_unlock(&log_mu);
    va_end(ap);
}

/* ---- memory ----------------------------------------------------------- */

void *cas_alloc(size_t bytes) {
    if (bytes == 0) bytes = 64;
    if (bytes > SIZE_MAX - 64) return NULL;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    return aligned_alloc(64, rounded);
}

void *cas_alloc_array(size_t n, size_t size) {
    if (size && n > SIZE_MAX / size) return NULL;
    return cas_alloc(n * size);
}

void cas_free(void *p) { free(p); }

/* ---- time ------------------------------------------------------------- */

double cas_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- number formats --------------------------------------------------- */

static float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint32_t bits_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

float cas_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24 */
        float v = (float)man * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));
    return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t cas_f32_to_f16(float f) {
    uint32_t x = bits_from_f32(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to inf */
    if (ax < 0x38800000u) {
        /* result is subnormal or zero: round ax * 2^24 to an integer, ties even */
        float v = f32_from_bits(ax) * 16777216.0f;
        float r = nearbyintf(v); /* default rounding mode: nearest even */
        return (uint16_t)(sign | (uint16_t)r);
    }
    uint32_t exp = (ax >> 23) - 112;
    uint32_t man = ax & 0x7fffff;
    uint32_t h = (exp << 10) | (man >> 13);
    uint32_t rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++; /* carries into exp correctly */
    return (uint16_t)(sign | h);
}

float cas_bf16_to_f32(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }

uint16_t cas_f32_to_bf16(float f) {
    uint32_t x = bits_from_f32(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet nan */
    uint32_t lsb = (x >> 16) & 1;
    x += 0x7fffu + lsb;
    return (uint16_t)(x >> 16);
}

/* ---- .npy ------------------------------------------------------------- */

cas_status cas_npy_write(const char *path, const char *dtype, const int64_t *shape, int ndim,
                         const void *data) {
    size_t elem;
    if (!strcmp(dtype, "<f4") || !strcmp(dtype, "<i4")) elem = 4;
    else if (!strcmp(dtype, "<f8")) elem = 8;
    else return cas_error(CAS_ERR_INVALID, "npy: unsupported dtype %s", dtype);
    if (ndim < 0 || ndim > 8) return cas_error(CAS_ERR_INVALID, "npy: bad ndim %d", ndim);

    char shp[256];
    size_t off = 0;
    size_t count = 1;
    shp[0] = 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return cas_error(CAS_ERR_INVALID, "npy: negative dimension");
        off += (size_t)snprintf(shp + off, sizeof shp - off, "%lld,%s", (long long)shape[i],
                                (i + 1 < ndim) ? " " : "");
        if (off >= sizeof shp) return cas_error(CAS_ERR_INVALID, "npy: shape too long");
        count *= (size_t)shape[i];
    }
    /* a one-element tuple keeps its trailing comma; longer ones may too */
    char header[512];
    int hl = snprintf(header, sizeof header, "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }",
                      dtype, shp);
    if (hl < 0 || (size_t)hl >= sizeof header - 64)
        return cas_error(CAS_ERR_INVALID, "npy: header too long");
    /* magic(6) + version(2) + len(2) + header + padding + '\n' multiple of 64 */
    size_t total = 10 + (size_t)hl + 1;
    size_t pad = (64 - total % 64) % 64;
    memset(header + hl, ' ', pad);
    header[hl + (int)pad] = '\n';
    uint16_t hlen = (uint16_t)(hl + (int)pad + 1);

    FILE *f = fopen(path, "wb");
    if (!f) return cas_error(CAS_ERR_IO, "npy: cannot open %s for writing", path);
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(hlen & 0xff),
                             (unsigned char)(hlen >> 8)};
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(header, 1, hlen, f) == hlen &&
             (count == 0 || fwrite(data, elem, count, f) == count);
    ok = (fclose(f) == 0) && ok;
    if (!ok) return cas_error(CAS_ERR_IO, "npy: write to %s failed", path);
    return CAS_OK;
}

/* ---- random numbers --------------------------------------------------- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void cas_rng_seed(cas_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t cas_rng_u64(cas_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double cas_rng_uniform(cas_rng *r) { return (double)(cas_rng_u64(r) >> 11) * 0x1.0p-53; }

int64_t cas_rng_range(cas_rng *r, int64_t lo, int64_t hi) {
    if (hi <= lo) return lo;
    uint64_t span = (uint64_t)(hi - lo) + 1;
    return lo + (int64_t)(cas_rng_u64(r) % span);
}

double cas_rng_normal(cas_rng *r) {
    double u1 = cas_rng_uniform(r), u2 = cas_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* ---- CPU features --------------------------------------------------- */

static cas_cpu_features cpu_features;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

/* CPUID and XGETBV read the way libgcc's __builtin_cpu_supports reads them
 * (a vector feature counts only where the OS saves its registers), so the
 * kernels are picked as they were when each layer asked the compiler; done
 * by hand because not every compiler that builds this file (clang for the
 * fuzzers) knows every feature name. */
static void cpu_probe(void) {
    cas_cpu_features f;
    memset(&f, 0, sizeof f);
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    const unsigned max_leaf = __get_cpuid_max(0, NULL);
    if (max_leaf >= 1) {
        __cpuid(1, a, b, c, d);
        int os_avx = 0, os_avx512 = 0;
        if (c & (1u << 27)) { /* OSXSAVE: XGETBV may be used */
            unsigned lo, hi;
            __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
            (void)hi;
            os_avx = (lo & 0x6u) == 0x6u;                    /* XMM, YMM */
            os_avx512 = os_avx && (lo & 0xe0u) == 0xe0u;     /* opmask, ZMM0-15 upper, ZMM16-31 */
        }
        const int fma = os_avx && (c & (1u << 12)), f16c = os_avx && (c & (1u << 29));
        if (max_leaf >= 7) {
            __cpuid_count(7, 0, a, b, c, d);
            const unsigned max_sub = a;
            f.avx2 = os_avx && (b & (1u << 5)) && fma && f16c;
            f.avx512 = os_avx512 && (b & (1u << 16)) /* F */ && (b & (1u << 17)) /* DQ */ &&
                       (b & (1u << 30)) /* BW */ && (b & (1u << 31)) /* VL */;
            f.amx_bf16 = (d >> 22) & 1;
            f.amx_tile = (d >> 24) & 1;
            f.amx_int8 = (d >> 25) & 1;
            if (max_sub >= 1) {
                __cpuid_count(7, 1, a, b, c, d);
                f.avx512_bf16 = os_avx512 && (a & (1u << 5));
            }
        }
    }
#endif
    f.simd = f.avx2 && f.avx512 ? CAS_SIMD_AVX512 : f.avx2 ? CAS_SIMD_AVX2 : CAS_SIMD_GENERIC;
    cpu_features = f;
}

const cas_cpu_features *cas_cpu_features_get(void) {
    pthread_once(&cpu_once, cpu_probe);
    return &cpu_features;
}

const char *cas_simd_name(cas_simd_level level) {
    switch (level) {
    case CAS_SIMD_AUTO: return "auto";
    case CAS_SIMD_GENERIC: return "generic";
    case CAS_SIMD_AVX2: return "avx2";
    case CAS_SIMD_AVX512: return "avx512";
    }
    return "?";
}

int cas_simd_parse(const char *name, cas_simd_level *out) {
    static const cas_simd_level all[] = {CAS_SIMD_AUTO, CAS_SIMD_GENERIC, CAS_SIMD_AVX2, CAS_SIMD_AVX512};
    for (size_t i = 0; name && i < sizeof all / sizeof all[0]; i++)
        if (!strcmp(name, cas_simd_name(all[i]))) {
            *out = all[i];
            return 0;
        }
    return -1;
}

cas_status cas_simd_resolve(cas_simd_level want, const char *what, cas_simd_level *out) {
    const cas_simd_level have = cas_cpu_features_get()->simd;
    if (want == CAS_SIMD_AUTO) {
        *out = have;
        return CAS_OK;
    }
    if ((int)want < (int)CAS_SIMD_GENERIC || (int)want > (int)CAS_SIMD_AVX512)
        return cas_error(CAS_ERR_INVALID, "%s: simd level %d is not a cas_simd_level", what, (int)want);
    if (want > have)
        return cas_error(CAS_ERR_UNSUPPORTED, "%s: %s kernels requested; this CPU has %s at most", what,
                         cas_simd_name(want), cas_simd_name(have));
    *out = want;
    return CAS_OK;
}

static int amx_ready;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void) {
#if defined(__x86_64__) && defined(__linux__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return; /* OSXSAVE */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return; /* AMX-TILE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    (void)hi;
    if ((lo & (3u << 17)) != (3u << 17)) return; /* XTILECFG, XTILEDATA */
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return;
    amx_ready = 1;
#endif
}

int cas_cpu_amx_ready(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_ready;
}
