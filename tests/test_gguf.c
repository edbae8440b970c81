/*
 * test_gguf.c: the GGUF reader against files built here by a tiny writer
 * (every value type, arrays, string arrays, tensors, v2 and v3, alignment)
 * and against many malformed variants, each of which must give an error and
 * never crash (run it under `make asan`). Then the real default model, which
 * must be present: CI runs `make model` first, so a missing file is a
 * failure, not a skip.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>

#include "check.h"
#include "../src/model/model.h"

#define MODEL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"

/* ---- a tiny GGUF writer ------------------------------------------------ */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} buf;

static void b_put(buf *b, const void *d, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}
static void b_u8(buf *b, uint8_t v) { b_put(b, &v, 1); }
static void b_u16(buf *b, uint16_t v) { b_put(b, &v, 2); }
static void b_u32(buf *b, uint32_t v) { b_put(b, &v, 4); }
static void b_u64(buf *b, uint64_t v) { b_put(b, &v, 8); }
static void b_f32(buf *b, float v) { b_put(b, &v, 4); }
static void b_f64(buf *b, double v) { b_put(b, &v, 8); }
static void b_str(buf *b, const char *s) {
    b_u64(b, strlen(s));
    b_put(b, s, strlen(s));
}
static void b_key(buf *b, const char *k, uint32_t type) {
    b_str(b, k);
    b_u32(b, type);
}
static void b_pad(buf *b, size_t align) {
    while (b->n % align) b_u8(b, 0);
}

/* Options for the well-formed test file. */
typedef struct {
    uint32_t version;
    uint32_t alignment; /* 0: no general.alignment key (default 32) */
} spec;

/* Writes a file with one key of every type, arrays of every element type,
 * a string array and three tensors (f32 [3,2], q4_0 [64], f16 [5]). */
static buf build_good(spec s) {
    buf b = {0};
    uint64_t n_kv = 13 + 12 + (s.alignment ? 1 : 0);
    uint32_t align = s.alignment ? s.alignment : 32;
    b_u32(&b, 0x46554747u);
    b_u32(&b, s.version);
    b_u64(&b, 3);
    b_u64(&b, n_kv);
    b_key(&b, "t.u8", CAS_GGUF_U8), b_u8(&b, 200);
    b_key(&b, "t.i8", CAS_GGUF_I8), b_u8(&b, (uint8_t)(int8_t)-100);
    b_key(&b, "t.u16", CAS_GGUF_U16), b_u16(&b, 60000);
    b_key(&b, "t.i16", CAS_GGUF_I16), b_u16(&b, (uint16_t)(int16_t)-30000);
    b_key(&b, "t.u32", CAS_GGUF_U32), b_u32(&b, 4000000000u);
    b_key(&b, "t.i32", CAS_GGUF_I32), b_u32(&b, (uint32_t)(int32_t)-2000000000);
    b_key(&b, "t.f32", CAS_GGUF_F32), b_f32(&b, 1.5f);
    b_key(&b, "t.bool", CAS_GGUF_BOOL), b_u8(&b, 1);
    b_key(&b, "t.str", CAS_GGUF_STRING), b_str(&b, "hello gguf");
    b_key(&b, "t.u64", CAS_GGUF_U64), b_u64(&b, 18000000000000000000ull);
    b_key(&b, "t.i64", CAS_GGUF_I64), b_u64(&b, (uint64_t)(int64_t)-9000000000000000000ll);
    b_key(&b, "t.f64", CAS_GGUF_F64), b_f64(&b, -2.25);
    b_key(&b, "t.empty_str", CAS_GGUF_STRING), b_str(&b, "");
    /* arrays: one of each scalar type with 3 elements 1,2,3 (bool: 1,0,1) */
    static const uint32_t at[] = {CAS_GGUF_U8,  CAS_GGUF_I8,  CAS_GGUF_U16, CAS_GGUF_I16,
                                  CAS_GGUF_U32, CAS_GGUF_I32, CAS_GGUF_F32, CAS_GGUF_BOOL,
                                  CAS_GGUF_U64, CAS_GGUF_I64, CAS_GGUF_F64};
    for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
        char key[32];
        snprintf(key, sizeof key, "a.%s", cas_gguf_type_name((int)at[k]));
        b_key(&b, key, CAS_GGUF_ARRAY);
        b_u32(&b, at[k]);
        b_u64(&b, 3);
        for (int v = 1; v <= 3; v++) {
            int x = at[k] == CAS_GGUF_BOOL ? v & 1 : v;
            switch (at[k]) {
            case CAS_GGUF_U8: case CAS_GGUF_I8: case CAS_GGUF_BOOL: b_u8(&b, (uint8_t)x); break;
            case CAS_GGUF_U16: case CAS_GGUF_I16: b_u16(&b, (uint16_t)x); break;
            case CAS_GGUF_U32: case CAS_GGUF_I32: b_u32(&b, (uint32_t)x); break;
            case CAS_GGUF_F32: b_f32(&b, (float)x); break;
            case CAS_GGUF_U64: case CAS_GGUF_I64: b_u64(&b, (uint64_t)x); break;
            case CAS_GGUF_F64: b_f64(&b, (double)x); break;
            }
        }
    }
    b_key(&b, "a.string", CAS_GGUF_ARRAY);
    b_u32(&b, CAS_GGUF_STRING);
    b_u64(&b, 4);
    b_str(&b, "alpha"), b_str(&b, ""), b_str(&b, "\xce\xb3 gamma"), b_str(&b, "<|im_end|>");
    if (s.alignment) b_key(&b, "general.alignment", CAS_GGUF_U32), b_u32(&b, s.alignment);
    /* tensors */
    uint64_t off = 0;
    b_str(&b, "w.f32"), b_u32(&b, 2), b_u64(&b, 3), b_u64(&b, 2), b_u32(&b, CAS_T_F32), b_u64(&b, off);
    off += 24;
    off = (off + align - 1) / align * align;
    uint64_t off_q = off;
    b_str(&b, "w.q4_0"), b_u32(&b, 1), b_u64(&b, 64), b_u32(&b, CAS_T_Q4_0), b_u64(&b, off);
    off += 2 * 18;
    off = (off + align - 1) / align * align;
    uint64_t off_h = off;
    b_str(&b, "w.f16"), b_u32(&b, 1), b_u64(&b, 5), b_u32(&b, CAS_T_F16), b_u64(&b, off);
    b_pad(&b, align);
    size_t data = b.n;
    for (int i = 0; i < 6; i++) b_f32(&b, (float)i * 0.5f);
    while (b.n < data + off_q) b_u8(&b, 0xee);
    for (int i = 0; i < 36; i++) b_u8(&b, (uint8_t)i);
    while (b.n < data + off_h) b_u8(&b, 0xee);
    for (int i = 0; i < 5; i++) b_u16(&b, cas_f32_to_f16((float)i));
    return b;
}

static void check_good(const cas_gguf *g, spec s) {
    uint32_t u32; int32_t i32; uint64_t u64; int64_t i64; float f32; double f64; int bl;
    const char *str; size_t len;
    CHECK(cas_gguf_version(g) == s.version);
    CHECK(cas_gguf_alignment(g) == (s.alignment ? s.alignment : 32));
    CHECK(cas_gguf_data_offset(g) % cas_gguf_alignment(g) == 0);
    CHECK(cas_gguf_n_kv(g) == 25 + (s.alignment ? 1 : 0));
    CHECK(cas_gguf_get_u32(g, "t.u8", &u32) == CAS_OK && u32 == 200);
    CHECK(cas_gguf_get_i32(g, "t.i8", &i32) == CAS_OK && i32 == -100);
    CHECK(cas_gguf_get_u32(g, "t.u16", &u32) == CAS_OK && u32 == 60000);
    CHECK(cas_gguf_get_i32(g, "t.i16", &i32) == CAS_OK && i32 == -30000);
    CHECK(cas_gguf_get_u32(g, "t.u32", &u32) == CAS_OK && u32 == 4000000000u);
    CHECK(cas_gguf_get_i32(g, "t.i32", &i32) == CAS_OK && i32 == -2000000000);
    CHECK(cas_gguf_get_f32(g, "t.f32", &f32) == CAS_OK && f32 == 1.5f);
    CHECK(cas_gguf_get_bool(g, "t.bool", &bl) == CAS_OK && bl == 1);
    CHECK(cas_gguf_get_str(g, "t.str", &str, &len) == CAS_OK && len == 10 && !strcmp(str, "hello gguf"));
    CHECK(cas_gguf_get_str(g, "t.empty_str", &str, &len) == CAS_OK && len == 0 && !strcmp(str, ""));
    CHECK(cas_gguf_get_u64(g, "t.u64", &u64) == CAS_OK && u64 == 18000000000000000000ull);
    CHECK(cas_gguf_get_i64(g, "t.i64", &i64) == CAS_OK && i64 == -9000000000000000000ll);
    CHECK(cas_gguf_get_f64(g, "t.f64", &f64) == CAS_OK && f64 == -2.25);
    /* widening and its limits */
    CHECK(cas_gguf_get_u64(g, "t.u8", &u64) == CAS_OK && u64 == 200);
    CHECK(cas_gguf_get_i64(g, "t.u32", &i64) == CAS_OK && i64 == 4000000000ll);
    CHECK(cas_gguf_get_f64(g, "t.f32", &f64) == CAS_OK && f64 == 1.5);
    /* mismatches and range errors */
    CHECK(cas_gguf_get_i32(g, "t.u32", &i32) == CAS_ERR_FORMAT);  /* 4e9 does not fit */
    CHECK(cas_gguf_get_u32(g, "t.i8", &u32) == CAS_ERR_FORMAT);   /* negative */
    CHECK(cas_gguf_get_i64(g, "t.u64", &i64) == CAS_ERR_FORMAT);  /* > INT64_MAX */
    CHECK(cas_gguf_get_u32(g, "t.str", &u32) == CAS_ERR_FORMAT);
    CHECK(cas_gguf_get_u32(g, "t.f32", &u32) == CAS_ERR_FORMAT);
    CHECK(cas_gguf_get_str(g, "t.u32", &str, &len) == CAS_ERR_FORMAT);
    CHECK(cas_gguf_get_bool(g, "t.u8", &bl) == CAS_ERR_FORMAT);
    CHECK(cas_gguf_get_f32(g, "t.str", &f32) == CAS_ERR_FORMAT);
    CHECK(cas_gguf_get_u32(g, "no.such.key", &u32) == CAS_ERR_FORMAT);
    CHECK(strstr(cas_last_error(), "no.such.key") != NULL);
    CHECK(cas_gguf_find_kv(g, "no.such.key") == -1);
    CHECK(cas_gguf_find_kv(g, "t.f64") >= 0);
    CHECK(cas_gguf_kv_type(g, cas_gguf_find_kv(g, "t.f64")) == CAS_GGUF_F64);
    CHECK(cas_gguf_kv_key(g, -1) == NULL && cas_gguf_kv_key(g, 1000) == NULL);
    /* arrays */
    cas_gguf_arr a;
    static const char *const an[] = {"a.u8", "a.i8", "a.u16", "a.i16", "a.u32", "a.i32",
                                     "a.u64", "a.i64", "a.bool"};
    for (size_t k = 0; k < sizeof an / sizeof an[0]; k++) {
        REQUIRE(cas_gguf_get_arr(g, an[k], -1, &a) == CAS_OK);
        CHECK(a.n == 3);
        for (uint64_t i = 0; i < 3; i++) {
            int64_t want = !strcmp(an[k], "a.bool") ? (int64_t)((i + 1) & 1) : (int64_t)i + 1;
            CHECKF(cas_gguf_arr_int(&a, i, &i64) == CAS_OK && i64 == want, "%s[%d]", an[k], (int)i);
        }
        CHECK(cas_gguf_arr_int(&a, 3, &i64) == CAS_ERR_INVALID);
        cas_gguf_str sv;
        CHECK(cas_gguf_arr_str(&a, 0, &sv) == CAS_ERR_INVALID);
    }
    REQUIRE(cas_gguf_get_arr(g, "a.f32", CAS_GGUF_F32, &a) == CAS_OK);
    CHECK(cas_gguf_arr_float(&a, 2, &f64) == CAS_OK && f64 == 3.0);
    CHECK(cas_gguf_arr_int(&a, 0, &i64) == CAS_ERR_INVALID);
    REQUIRE(cas_gguf_get_arr(g, "a.f64", CAS_GGUF_F64, &a) == CAS_OK);
    CHECK(cas_gguf_arr_float(&a, 1, &f64) == CAS_OK && f64 == 2.0);
    CHECK(cas_gguf_get_arr(g, "a.f64", CAS_GGUF_I32, &a) == CAS_ERR_FORMAT);
    CHECK(cas_gguf_get_arr(g, "t.u8", -1, &a) == CAS_ERR_FORMAT);
    REQUIRE(cas_gguf_get_arr(g, "a.string", CAS_GGUF_STRING, &a) == CAS_OK);
    REQUIRE(a.n == 4);
    cas_gguf_str sv;
    CHECK(cas_gguf_arr_str(&a, 0, &sv) == CAS_OK && sv.len == 5 && !memcmp(sv.ptr, "alpha", 5));
    CHECK(cas_gguf_arr_str(&a, 1, &sv) == CAS_OK && sv.len == 0);
    CHECK(cas_gguf_arr_str(&a, 2, &sv) == CAS_OK && sv.len == 8 && !memcmp(sv.ptr, "\xce\xb3 gamma", 8));
    CHECK(cas_gguf_arr_str(&a, 3, &sv) == CAS_OK && sv.len == 10 && !memcmp(sv.ptr, "<|im_end|>", 10));
    CHECK(cas_gguf_arr_str(&a, 4, &sv) == CAS_ERR_INVALID);
    CHECK(cas_gguf_arr_int(&a, 0, &i64) == CAS_ERR_INVALID);
    /* tensors */
    CHECK(cas_gguf_n_tensors(g) == 3);
    const cas_gguf_tensor *t = cas_gguf_find_tensor(g, "w.f32");
    REQUIRE(t);
    CHECK(t->type == CAS_T_F32 && t->n_dims == 2 && t->ne[0] == 3 && t->ne[1] == 2 && t->ne[2] == 1);
    CHECK(t->n_elem == 6 && t->nbytes == 24);
    CHECK(((uintptr_t)t->data - (uintptr_t)cas_gguf_tensor_at(g, 0)->data) == 0);
    float f[6];
    memcpy(f, t->data, sizeof f);
    CHECK(f[0] == 0.0f && f[5] == 2.5f);
    t = cas_gguf_find_tensor(g, "w.q4_0");
    REQUIRE(t);
    CHECK(t->type == CAS_T_Q4_0 && t->nbytes == 36 && ((const uint8_t *)t->data)[35] == 35);
    CHECK(t->offset % cas_gguf_alignment(g) == 0);
    t = cas_gguf_find_tensor(g, "w.f16");
    REQUIRE(t);
    uint16_t h[5];
    memcpy(h, t->data, sizeof h);
    CHECK(t->nbytes == 10 && cas_f16_to_f32(h[4]) == 4.0f);
    CHECK(cas_gguf_find_tensor(g, "w.none") == NULL);
    CHECK(cas_gguf_tensor_at(g, 3) == NULL);
}

static void test_good_files(void) {
    spec specs[] = {{3, 0}, {2, 0}, {3, 64}, {2, 8}, {3, 1}};
    for (size_t k = 0; k < sizeof specs / sizeof specs[0]; k++) {
        buf b = build_good(specs[k]);
        cas_gguf *g = NULL;
        cas_status st = cas_gguf_open_memory(b.p, b.n, &g);
        CHECKF(st == CAS_OK, "v%u align %u: %s", specs[k].version, specs[k].alignment, cas_last_error());
        if (g) check_good(g, specs[k]);
        cas_gguf_close(g);
        free(b.p);
    }
}

static void test_open_file(void) {
    buf b = build_good((spec){3, 0});
    char path[] = "/tmp/cas_test_gguf_XXXXXX";
    int fd = mkstemp(path);
    REQUIRE(fd >= 0);
    CHECK(write(fd, b.p, b.n) == (ssize_t)b.n);
    close(fd);
    /* mapped (cas_gguf_open) and read into memory (cas_gguf_open_read): the
     * same checks, the same bytes */
    for (int read_in = 0; read_in < 2; read_in++) {
        cas_status (*open_fn)(const char *, cas_gguf **) = read_in ? cas_gguf_open_read : cas_gguf_open;
        int wfd = open(path, O_WRONLY | O_TRUNC);
        REQUIRE(wfd >= 0);
        CHECK(write(wfd, b.p, b.n) == (ssize_t)b.n);
        close(wfd);
        cas_gguf *g = NULL;
        CHECK(open_fn(path, &g) == CAS_OK);
        if (g) {
            check_good(g, (spec){3, 0});
            CHECK(cas_gguf_file_size(g) == b.n);
            for (int64_t i = 0; i < cas_gguf_n_tensors(g); i++) {
                const cas_gguf_tensor *t = cas_gguf_tensor_at(g, i);
                CHECKF(!memcmp(t->data, (const uint8_t *)b.p + cas_gguf_data_offset(g) + t->offset, t->nbytes),
                       "tensor %lld's bytes (read_in %d)", (long long)i, read_in);
            }
        }
        cas_gguf_close(g);
        /* a truncated copy on disk fails with the path in the message */
        CHECK(truncate(path, (off_t)b.n - 1) == 0);
        g = NULL;
        CHECK(open_fn(path, &g) == CAS_ERR_FORMAT && g == NULL);
        CHECK(strstr(cas_last_error(), path) != NULL);
        CHECK(open_fn("/tmp", &g) == CAS_ERR_IO && g == NULL);
        CHECK(open_fn("/nonexistent/cas.gguf", &g) == CAS_ERR_IO && g == NULL);
    }
    unlink(path);
    cas_gguf *g = NULL;
    CHECK(cas_gguf_open(path, &g) == CAS_ERR_IO && g == NULL);
    free(b.p);
}

/* Every proper prefix of a good file must fail: the last tensor ends at the
 * end of the file, so no prefix is complete. */
static void test_truncations(void) {
    buf b = build_good((spec){3, 0});
    int fails = 0;
    for (size_t n = 0; n < b.n; n++) {
        uint8_t *copy = malloc(n ? n : 1); /* exact size: ASan sees any overread */
        memcpy(copy, b.p, n);
        cas_gguf *g = NULL;
        cas_status st = cas_gguf_open_memory(copy, n, &g);
        if (st == CAS_OK || g != NULL) fails++;
        cas_gguf_close(g);
        free(copy);
    }
    CHECKF(fails == 0, "%d truncated prefixes opened", fails);
    free(b.p);
}

/* Flipping any byte must not crash (most flips fail, some are harmless). */
static void test_corruptions(void) {
    buf b = build_good((spec){2, 0});
    uint8_t *copy = malloc(b.n);
    static const uint8_t vals[] = {0x00, 0xff, 0x7f, 0x80, 0x01, 0x05, 0x20};
    int opened = 0;
    for (size_t i = 0; i < b.n; i++)
        for (size_t v = 0; v < sizeof vals; v++) {
            memcpy(copy, b.p, b.n);
            copy[i] = vals[v];
            cas_gguf *g = NULL;
            if (cas_gguf_open_memory(copy, b.n, &g) == CAS_OK) {
                opened++;
                /* walk everything the reader hands out */
                for (int64_t k = 0; k < cas_gguf_n_kv(g); k++) {
                    const char *key = cas_gguf_kv_key(g, k);
                    CHECK(key && cas_gguf_find_kv(g, key) == k);
                }
                for (int64_t k = 0; k < cas_gguf_n_tensors(g); k++) {
                    const cas_gguf_tensor *t = cas_gguf_tensor_at(g, k);
                    volatile uint8_t sink = 0;
                    for (size_t j = 0; j < t->nbytes; j++) sink ^= ((const uint8_t *)t->data)[j];
                    (void)sink;
                }
            }
            cas_gguf_close(g);
        }
    CHECK(opened > 0);
    free(copy);
    free(b.p);
}

/* Builds a minimal file around one malformed piece. kind selects it. */
static buf build_bad(int kind) {
    buf b = {0};
    b_u32(&b, kind == 0 ? 0x46554746u : 0x46554747u);
    uint32_t version = kind == 1 ? 1 : kind == 2 ? 4 : kind == 3 ? 0x03000000u : 3;
    b_u32(&b, version);
    uint64_t n_tensors = kind == 4 ? (1ull << 60) : 1;
    uint64_t n_kv = kind == 5 ? UINT64_MAX : 2;
    b_u64(&b, n_tensors);
    b_u64(&b, n_kv);
    /* kv 1 */
    if (kind == 6) { b_u64(&b, UINT64_MAX - 3); b_put(&b, "k", 1); }           /* key length huge */
    else b_str(&b, "k1");
    if (kind == 7) b_u32(&b, 13);                                              /* bad value type */
    else if (kind == 8) { b_u32(&b, CAS_GGUF_STRING); b_u64(&b, 1ull << 62); } /* string length huge */
    else if (kind == 9) { b_u32(&b, CAS_GGUF_ARRAY); b_u32(&b, CAS_GGUF_U32); b_u64(&b, 1ull << 62); }
    else if (kind == 10) { b_u32(&b, CAS_GGUF_ARRAY); b_u32(&b, CAS_GGUF_STRING); b_u64(&b, UINT64_MAX / 4); }
    else if (kind == 11) { b_u32(&b, CAS_GGUF_ARRAY); b_u32(&b, CAS_GGUF_ARRAY); b_u64(&b, 1); }
    else if (kind == 12) { b_u32(&b, CAS_GGUF_ARRAY); b_u32(&b, 99); b_u64(&b, 1); }
    else if (kind == 13) { b_u32(&b, CAS_GGUF_ARRAY); b_u32(&b, CAS_GGUF_U64); b_u64(&b, UINT64_MAX / 8 + 2); }
    else { b_u32(&b, CAS_GGUF_U32); b_u32(&b, 7); }
    /* kv 2: alignment */
    b_str(&b, kind == 14 ? "k1" : "general.alignment");                        /* duplicate key */
    if (kind == 15) { b_u32(&b, CAS_GGUF_U64); b_u64(&b, 32); }                 /* wrong type */
    else { b_u32(&b, CAS_GGUF_U32); b_u32(&b, kind == 16 ? 24 : kind == 17 ? 0 : 32); }
    /* tensor */
    b_str(&b, "w");
    uint32_t n_dims = kind == 18 ? 5 : 2;
    b_u32(&b, n_dims);
    if (kind == 19) { b_u64(&b, 1ull << 32); b_u64(&b, 1ull << 32); }           /* product overflows */
    else if (kind == 20) { b_u64(&b, UINT64_MAX); b_u64(&b, 1); }               /* negative as int64 */
    else if (kind == 21) { b_u64(&b, 1ull << 40); b_u64(&b, 1ull << 22); }      /* bytes overflow */
    else { b_u64(&b, kind == 22 ? 48 : 32); b_u64(&b, 1); }                     /* 48: not a q4_0 row */
    for (uint32_t d = 2; d < n_dims; d++) b_u64(&b, 1);
    uint32_t type = kind == 23 ? 99 : kind == 24 ? 16 /* iq2_xxs: unsized here */ : kind == 25 ? 0xffffffffu : CAS_T_Q4_0;
    if (kind == 21) type = CAS_T_F32;
    b_u32(&b, type);
    b_u64(&b, kind == 26 ? 16 : kind == 27 ? 32 : kind == 28 ? UINT64_MAX - 31 : 0); /* 16: misaligned */
    b_pad(&b, 32);
    for (int i = 0; i < (kind == 29 ? 17 : 18); i++) b_u8(&b, (uint8_t)i);      /* 29: data cut short */
    return b;
}

static void test_malformed(void) {
    /* kind 30 is the control: the same builder with nothing wrong */
    for (int kind = 0; kind <= 30; kind++) {
        buf b = build_bad(kind);
        uint8_t *copy = malloc(b.n);
        memcpy(copy, b.p, b.n);
        cas_gguf *g = NULL;
        cas_status st = cas_gguf_open_memory(copy, b.n, &g);
        if (kind == 30) {
            CHECKF(st == CAS_OK, "control file: %s", cas_last_error());
        } else {
            CHECKF(st != CAS_OK && g == NULL, "malformed kind %d opened", kind);
            CHECKF(strlen(cas_last_error()) > 0, "kind %d: no message", kind);
            if (getenv("CAS_TEST_VERBOSE")) printf("  kind %d: %s\n", kind, cas_last_error());
        }
        cas_gguf_close(g);
        free(copy);
        free(b.p);
    }
    cas_gguf *g = NULL;
    CHECK(cas_gguf_open_memory(NULL, 0, &g) == CAS_ERR_FORMAT && !g);
    CHECK(cas_gguf_open_memory("GGUF", 4, &g) == CAS_ERR_FORMAT && !g);
    CHECK(cas_gguf_open_memory("GGUF", 4, NULL) == CAS_ERR_INVALID);
    /* the empty but valid file: 0 tensors, 0 keys */
    buf e = {0};
    b_u32(&e, 0x46554747u), b_u32(&e, 3), b_u64(&e, 0), b_u64(&e, 0);
    CHECK(cas_gguf_open_memory(e.p, e.n, &g) == CAS_OK && g && cas_gguf_n_kv(g) == 0 &&
          cas_gguf_n_tensors(g) == 0);
    cas_gguf_close(g);
    free(e.p);
    /* messages name the problem */
    buf b = build_bad(0);
    CHECK(cas_gguf_open_memory(b.p, b.n, &g) == CAS_ERR_FORMAT && strstr(cas_last_error(), "magic"));
    free(b.p);
    b = build_bad(1);
    CHECK(cas_gguf_open_memory(b.p, b.n, &g) == CAS_ERR_UNSUPPORTED && strstr(cas_last_error(), "version"));
    free(b.p);
    b = build_bad(18);
    CHECK(cas_gguf_open_memory(b.p, b.n, &g) == CAS_ERR_FORMAT && strstr(cas_last_error(), "dims"));
    free(b.p);
    b = build_bad(26);
    CHECK(cas_gguf_open_memory(b.p, b.n, &g) == CAS_ERR_FORMAT && strstr(cas_last_error(), "aligned"));
    free(b.p);
    b = build_bad(27);
    CHECK(cas_gguf_open_memory(b.p, b.n, &g) == CAS_ERR_FORMAT && strstr(cas_last_error(), "past the end"));
    free(b.p);
    b = build_bad(24); /* a type ggml defines and cascade cannot size: named, with the tensor */
    CHECK(cas_gguf_open_memory(b.p, b.n, &g) == CAS_ERR_UNSUPPORTED && strstr(cas_last_error(), "iq2_xxs") &&
          strstr(cas_last_error(), "id 16"));
    free(b.p);
    b = build_bad(23);
    CHECK(cas_gguf_open_memory(b.p, b.n, &g) == CAS_ERR_FORMAT && strstr(cas_last_error(), "unknown type id 99"));
    free(b.p);
}

static void test_type_traits(void) {
    CHECK(cas_ttype_nbytes(CAS_T_F32, 10) == 40);
    CHECK(cas_ttype_nbytes(CAS_T_Q4_1, 64) == 40);
    CHECK(cas_ttype_nbytes(CAS_T_Q8_0, 32) == 34);
    CHECK(cas_ttype_nbytes(CAS_T_Q4_0, 33) == -1);
    CHECK(cas_ttype_nbytes(99, 32) == -1);
    CHECK(cas_ttype_nbytes(CAS_T_F64, INT64_MAX) == -1);
    CHECK(cas_ttype_nbytes(CAS_T_Q6_K, 256) == 210);
    CHECK(cas_ttype_nbytes(CAS_T_IQ4_NL, 64) == 36 && cas_ttype_nbytes(CAS_T_IQ4_XS, 512) == 272);
    CHECK(!strcmp(cas_ttype_name(CAS_T_IQ4_XS), "iq4_xs") && !strcmp(cas_ttype_ggml_name(16), "iq2_xxs"));
    CHECK(!strcmp(cas_ttype_ggml_name(CAS_T_Q4_K), "q4_k") && cas_ttype_ggml_name(4) == NULL &&
          cas_ttype_ggml_name(99) == NULL && cas_ttype_ggml_name(-1) == NULL);
    CHECK(!strcmp(cas_ttype_name(CAS_T_BF16), "bf16") && cas_ttype_name(17) == NULL);
    CHECK(!strcmp(cas_gguf_type_name(CAS_GGUF_STRING), "string") && !strcmp(cas_gguf_type_name(77), "?"));
}

static void test_real_model(void) {
    if (access(MODEL_PATH, R_OK) != 0) {
        printf("FAIL test_real_model: %s is missing: run `make model` first\n", MODEL_PATH);
        CHECK(!"model file present (run `make model`)");
        return;
    }
    cas_gguf *g = NULL;
    cas_status st = cas_gguf_open(MODEL_PATH, &g);
    CHECKF(st == CAS_OK, "%s", cas_last_error());
    REQUIRE(g);
    const char *s;
    uint32_t u;
    float f;
    CHECK(cas_gguf_file_size(g) == 98362432);
    CHECK(cas_gguf_version(g) == 3);
    CHECK(cas_gguf_get_str(g, "general.architecture", &s, NULL) == CAS_OK && !strcmp(s, "llama"));
    CHECK(cas_gguf_get_u32(g, "llama.block_count", &u) == CAS_OK && u == 30);
    CHECK(cas_gguf_get_u32(g, "llama.embedding_length", &u) == CAS_OK && u == 576);
    CHECK(cas_gguf_get_u32(g, "llama.feed_forward_length", &u) == CAS_OK && u == 1536);
    CHECK(cas_gguf_get_u32(g, "llama.attention.head_count", &u) == CAS_OK && u == 9);
    CHECK(cas_gguf_get_u32(g, "llama.attention.head_count_kv", &u) == CAS_OK && u == 3);
    CHECK(cas_gguf_get_f32(g, "llama.rope.freq_base", &f) == CAS_OK && f > 0);
    CHECK(cas_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &f) == CAS_OK && f > 0 && f < 1e-3);
    CHECK(cas_gguf_get_str(g, "tokenizer.ggml.model", &s, NULL) == CAS_OK && !strcmp(s, "gpt2"));
    CHECK(cas_gguf_get_str(g, "tokenizer.ggml.pre", &s, NULL) == CAS_OK && !strcmp(s, "smollm"));
    cas_gguf_arr a;
    CHECK(cas_gguf_get_arr(g, "tokenizer.ggml.tokens", CAS_GGUF_STRING, &a) == CAS_OK && a.n == 49152);
    const cas_gguf_tensor *t = cas_gguf_find_tensor(g, "token_embd.weight");
    REQUIRE(t);
    CHECK(t->n_dims == 2 && t->ne[0] == 576 && t->ne[1] == 49152);
    CHECK(cas_gguf_find_tensor(g, "blk.29.attn_q.weight") != NULL);
    CHECK(cas_gguf_find_tensor(g, "blk.30.attn_q.weight") == NULL);
    int n_type[64] = {0};
    size_t total = 0;
    for (int64_t i = 0; i < cas_gguf_n_tensors(g); i++) {
        t = cas_gguf_tensor_at(g, i);
        n_type[t->type]++;
        total += t->nbytes;
        CHECK(((uintptr_t)t->data - (uintptr_t)cas_gguf_tensor_at(g, 0)->data) % cas_gguf_alignment(g) == 0);
    }
    CHECK(n_type[CAS_T_Q4_1] > 0 && n_type[CAS_T_F32] > 0);
    CHECK(total <= cas_gguf_file_size(g) - cas_gguf_data_offset(g));
    if (getenv("CAS_TEST_VERBOSE")) {
        printf("  %lld tensors, %lld keys, q4_1 %d q8_0 %d f32 %d\n", (long long)cas_gguf_n_tensors(g),
               (long long)cas_gguf_n_kv(g), n_type[CAS_T_Q4_1], n_type[CAS_T_Q8_0], n_type[CAS_T_F32]);
        for (int64_t i = 0; i < cas_gguf_n_kv(g); i++) {
            int ty = cas_gguf_kv_type(g, i);
            printf("  %s: %s", cas_gguf_kv_key(g, i), cas_gguf_type_name(ty));
            if (ty == CAS_GGUF_STRING) {
                size_t n;
                cas_gguf_get_str(g, cas_gguf_kv_key(g, i), &s, &n);
                printf(" = %.200s", s);
            } else if (ty != CAS_GGUF_ARRAY) {
                double d;
                if (cas_gguf_get_f64(g, cas_gguf_kv_key(g, i), &d) == CAS_OK) printf(" = %g", d);
            } else {
                cas_gguf_get_arr(g, cas_gguf_kv_key(g, i), -1, &a);
                printf(" of %s[%llu]", cas_gguf_type_name(a.type), (unsigned long long)a.n);
            }
            printf("\n");
        }
    }
    cas_gguf_close(g);
}

int main(void) {
    RUN(test_type_traits);
    RUN(test_good_files);
    RUN(test_open_file);
    RUN(test_truncations);
    RUN(test_corruptions);
    RUN(test_malformed);
    RUN(test_real_model);
    return check_summary();
}
