/*
 * fuzz_gguf.c: libFuzzer harness for the GGUF reader, the one part of
 * cascade that parses untrusted bytes. Each input is opened from memory; if
 * the reader accepts it, everything it hands out is read back (every key
 * through every getter, every array element, every tensor byte), and the
 * tokenizer is built from it and run, and K-quant, IQ4 and Q5 tensors go
 * through their kernels, so that a header the reader lets through cannot
 * crash its first consumers either. Build and run with
 * `make fuzz` (clang, -fsanitize=fuzzer,address,undefined); see README.md.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../src/model/model.h"
#include "../src/model/quant_k.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A tensor of a K-quant, IQ4 or Q5 type goes through the dequantizer, the
 * activation quantizer and the matrix-vector kernels (portable, and AVX2
 * where the CPU has it) on its first rows: any bytes are valid blocks (every
 * code and scale field is in range by construction; the f16 scales may be
 * NaN or infinite, which only reaches the floats), so none of them may crash
 * or read outside the tensor. */
static void kernels(const cas_gguf_tensor *t) {
    if (!cas_qk_type(t->type)) return;
    const int64_t n = t->ne[0], bs = cas_qk_block_size(t->type);
    if (n <= 0 || n > 65536 || n % bs) return;
    const int64_t rows = t->n_elem / n < 8 ? t->n_elem / n : 8;
    const size_t rb = (size_t)(n / bs) * cas_qk_block_bytes(t->type);
    float *f = malloc(sizeof(float) * (size_t)n), *x = malloc(sizeof(float) * (size_t)n), y[8];
    void *xq = aligned_alloc(64, (cas_qk_x_bytes(t->type, n) + 63) / 64 * 64);
    if (f && x && xq && rows > 0) {
        for (int64_t r = 0; r < rows; r++) cas_qk_dequantize_row(t->type, (const uint8_t *)t->data + (size_t)r * rb, f, n);
        for (int64_t i = 0; i < n; i++) x[i] = (float)(i % 7) - 3.0f + f[i] * 0.0f; /* f's NaNs reach x */
        for (int level = 0; level <= (cas_cpu_features_get()->avx2 ? 1 : 0); level++) {
            cas_qk_quantize_x(t->type, x, n, xq, level);
            cas_qk_matvec_range(t->type, t->data, rb, n, 0, rows, xq, y, level);
        }
    }
    free(f);
    free(x);
    free(xq);
}

static void walk(const cas_gguf *g) {
    volatile uint64_t sink = 0;
    for (int64_t i = 0; i < cas_gguf_n_kv(g); i++) {
        const char *key = cas_gguf_kv_key(g, i);
        uint32_t u32; int32_t i32; uint64_t u64; int64_t i64; float f; double d; int b;
        const char *s; size_t n;
        if (!cas_gguf_get_u32(g, key, &u32)) sink += u32;
        if (!cas_gguf_get_i32(g, key, &i32)) sink += (uint64_t)i32;
        if (!cas_gguf_get_u64(g, key, &u64)) sink += u64;
        if (!cas_gguf_get_i64(g, key, &i64)) sink += (uint64_t)i64;
        if (!cas_gguf_get_f32(g, key, &f)) sink += (uint64_t)(f == f);
        if (!cas_gguf_get_f64(g, key, &d)) sink += (uint64_t)(d == d);
        if (!cas_gguf_get_bool(g, key, &b)) sink += (uint64_t)b;
        if (!cas_gguf_get_str(g, key, &s, &n)) sink += n ? (uint8_t)s[n - 1] : 0;
        cas_gguf_arr a;
        if (!cas_gguf_get_arr(g, key, -1, &a))
            for (uint64_t k = 0; k < a.n && k < 4096; k++) {
                cas_gguf_str sv;
                if (!cas_gguf_arr_int(&a, k, &i64)) sink += (uint64_t)i64;
                if (!cas_gguf_arr_float(&a, k, &d)) sink += (uint64_t)(d == d);
                if (!cas_gguf_arr_str(&a, k, &sv) && sv.len) sink += (uint8_t)sv.ptr[sv.len - 1];
            }
    }
    for (int64_t i = 0; i < cas_gguf_n_tensors(g); i++) {
        const cas_gguf_tensor *t = cas_gguf_tensor_at(g, i);
        if (cas_gguf_find_tensor(g, t->name) != t) abort();
        for (size_t k = 0; k < t->nbytes; k++) sink += ((const uint8_t *)t->data)[k];
        kernels(t);
    }
    (void)sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cas_log_set_level(CAS_LOG_ERROR); /* the tokenizer's warnings would flood the log */
    /* an exact-size copy, so that ASan sees a read one byte past the end */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    memcpy(copy, data, size);
    cas_gguf *g = NULL;
    if (cas_gguf_open_memory(copy, size, &g) == CAS_OK) {
        walk(g);
        cas_tok *tok = NULL;
        if (cas_tok_create(g, &tok) == CAS_OK) {
            static const char text[] = "Hello, world! 123 <|im_start|>caf\xc3\xa9 \xff\xfe  x";
            int32_t ids[64];
            size_t n = 0;
            char back[256];
            size_t len;
            if (cas_tok_encode(tok, text, sizeof text - 1, CAS_TOK_PARSE_SPECIAL | CAS_TOK_ADD_SPECIAL, ids, 64,
                               &n) == CAS_OK)
                cas_tok_decode(tok, ids, n, CAS_TOK_DECODE_SPECIAL, back, sizeof back, &len);
            cas_tok_destroy(tok);
        }
        cas_chat_template tpl;
        if (cas_chat_template_from_gguf(g, &tpl) == CAS_OK) {
            cas_chat_msg m = {"user", "hi"};
            char *out = NULL;
            if (cas_chat_apply(&tpl, &m, 1, 1, &out) == CAS_OK) free(out);
        }
        cas_chat_template_free(&tpl);
        cas_gguf_close(g);
    }
    free(copy);
    return 0;
}
