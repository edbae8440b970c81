/*
 * model.h: the model layer's public contract. It reads model files (GGUF),
 * turns text into token ids and back (the tokenizer that the file describes),
 * and renders chat conversations into prompt text (the file's chat template).
 * The forward pass, the quantized kernels and the sampler are declared in
 * their own sections below as they land.
 *
 * Everything here is built from one memory-mapped GGUF file: the reader
 * validates the whole header against the file size once, at open, so that
 * every later lookup is a plain read that cannot go out of bounds. Objects
 * built from the file (the tokenizer) copy what they keep and do not need the
 * file afterwards.
 *
 * Errors follow core.h: functions return a cas_status and leave a message in
 * cas_last_error(); nothing here exits or aborts on bad input.
 */
#ifndef CASCADE_MODEL_H
#define CASCADE_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "../core/core.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================
 * GGUF reader (gguf.c)
 *
 * Versions 2 and 3 (little-endian) of the GGUF format: a header, typed
 * key/value metadata, tensor descriptions, then the tensor data at an aligned
 * offset. Ownership: every pointer the reader hands out (keys, strings, array
 * elements, tensor names and data) points into the cas_gguf object or the
 * mapped file and stays valid until cas_gguf_close(). Thread safety: once
 * open, a cas_gguf is read-only; any number of threads may call the getters
 * at the same time. Closing must not race with other calls.
 * ====================================================================== */

/* Metadata value types, numbered as in the file. */
typedef enum {
    CAS_GGUF_U8 = 0,
    CAS_GGUF_I8 = 1,
    CAS_GGUF_U16 = 2,
    CAS_GGUF_I16 = 3,
    CAS_GGUF_U32 = 4,
    CAS_GGUF_I32 = 5,
    CAS_GGUF_F32 = 6,
    CAS_GGUF_BOOL = 7,
    CAS_GGUF_STRING = 8,
    CAS_GGUF_ARRAY = 9,
    CAS_GGUF_U64 = 10,
    CAS_GGUF_I64 = 11,
    CAS_GGUF_F64 = 12
} cas_gguf_type;

/* A name such as "u32" or "string"; "?" for ids outside the enum. */
const char *cas_gguf_type_name(int type);

typedef struct cas_gguf cas_gguf; /* opaque */

/* A string inside the file: len bytes at ptr, NOT NUL-terminated, may hold
 * any bytes (array elements are returned this way). */
typedef struct {
    const char *ptr;
    uint64_t len;
} cas_gguf_str;

/* An array value. Numeric elements lie packed, little-endian and possibly
 * unaligned at data: read them with cas_gguf_arr_int / cas_gguf_arr_float
 * (or memcpy). String elements are read with cas_gguf_arr_str. */
typedef struct {
    cas_gguf_type type;    /* element type (never CAS_GGUF_ARRAY: nested arrays are refused) */
    uint64_t n;            /* number of elements */
    const void *data;      /* numeric: n * element size bytes; strings: first length prefix */
    const uint64_t *offs_; /* private: strings' offsets in the file, [n] */
    const uint8_t *base_;  /* private: start of the file */
} cas_gguf_arr;

/* A tensor. Dims follow ggml: ne[0] is the fastest-varying (contiguous)
 * dimension, so a weight matrix of `rows` outputs by `cols` inputs has
 * ne = {cols, rows, 1, 1}. Dims past n_dims are 1. */
typedef struct {
    const char *name; /* NUL-terminated */
    cas_ttype type;
    uint32_t n_dims;  /* 0..4 (0: a scalar) */
    int64_t ne[4];    /* elements per dimension */
    int64_t n_elem;   /* product of ne */
    uint64_t offset;  /* bytes from the start of the data section */
    size_t nbytes;    /* bytes of data */
    const void *data; /* in the mapping; aligned to cas_gguf_alignment() within the file */
} cas_gguf_tensor;

/* Opens and validates a file, which is memory-mapped read-only. Any defect
 * (wrong magic, version other than 2 or 3, truncation, a length or count
 * that runs past the end or overflows, an unknown value or tensor type, more
 * than 4 dims, misaligned or out-of-bounds tensor data, duplicate keys or
 * tensor names) gives CAS_ERR_FORMAT or CAS_ERR_UNSUPPORTED with a message
 * naming the problem and its byte offset. On success *out owns the mapping;
 * free it with cas_gguf_close. */
cas_status cas_gguf_open(const char *path, cas_gguf **out);

/* Same over a buffer in memory, which is borrowed: it must stay unchanged
 * and alive until cas_gguf_close. Used by tests and the fuzzer. */
cas_status cas_gguf_open_memory(const void *data, size_t size, cas_gguf **out);

/* Frees the reader and unmaps the file. NULL is a no-op. */
void cas_gguf_close(cas_gguf *g);

uint32_t cas_gguf_version(const cas_gguf *g);
uint32_t cas_gguf_alignment(const cas_gguf *g);  /* general.alignment or 32 */
uint64_t cas_gguf_data_offset(const cas_gguf *g); /* file offset of the data section */
size_t cas_gguf_file_size(const cas_gguf *g);

/* ---- metadata ---------------------------------------------------------- */

int64_t cas_gguf_n_kv(const cas_gguf *g);
const char *cas_gguf_kv_key(const cas_gguf *g, int64_t i);  /* NUL-terminated; NULL if i out of range */
int cas_gguf_kv_type(const cas_gguf *g, int64_t i); /* a cas_gguf_type; -1 if i out of range */
/* Index of a key, or -1 when absent. */
int64_t cas_gguf_find_kv(const cas_gguf *g, const char *key);

/* Typed getters. A missing key gives CAS_ERR_FORMAT ("missing key"); use
 * cas_gguf_find_kv first for optional keys. Integer getters accept any
 * integer (or bool) value type whose value fits the target and refuse the
 * rest (CAS_ERR_FORMAT, naming both types); float getters accept f32 and
 * f64 (and integers, converted); the string getter only strings. */
cas_status cas_gguf_get_u32(const cas_gguf *g, const char *key, uint32_t *out);
cas_status cas_gguf_get_i32(const cas_gguf *g, const char *key, int32_t *out);
cas_status cas_gguf_get_u64(const cas_gguf *g, const char *key, uint64_t *out);
cas_status cas_gguf_get_i64(const cas_gguf *g, const char *key, int64_t *out);
cas_status cas_gguf_get_f32(const cas_gguf *g, const char *key, float *out);
cas_status cas_gguf_get_f64(const cas_gguf *g, const char *key, double *out);
cas_status cas_gguf_get_bool(const cas_gguf *g, const char *key, int *out);
/* *out is NUL-terminated (a copy held by g); *len (may be NULL) is its byte
 * length, which can be less than strlen's if the value holds a NUL byte. */
cas_status cas_gguf_get_str(const cas_gguf *g, const char *key, const char **out, size_t *len);
/* An array value. want is the required element type, or -1 for any. */
cas_status cas_gguf_get_arr(const cas_gguf *g, const char *key, int want, cas_gguf_arr *out);

/* Element i of an array: integer elements (and bool) as int64 (u64 values
 * above INT64_MAX are refused), float elements as double, strings as views
 * into the file. CAS_ERR_INVALID on a wrong element type or i >= n. */
cas_status cas_gguf_arr_int(const cas_gguf_arr *a, uint64_t i, int64_t *out);
cas_status cas_gguf_arr_float(const cas_gguf_arr *a, uint64_t i, double *out);
cas_status cas_gguf_arr_str(const cas_gguf_arr *a, uint64_t i, cas_gguf_str *out);

/* ---- tensors ----------------------------------------------------------- */

int64_t cas_gguf_n_tensors(const cas_gguf *g);
/* NULL if i is out of range. */
const cas_gguf_tensor *cas_gguf_tensor_at(const cas_gguf *g, int64_t i);
/* NULL when no tensor has that name. */
const cas_gguf_tensor *cas_gguf_find_tensor(const cas_gguf *g, const char *name);

/* ======================================================================
 * Tokenizer (tokenizer.c)
 *
 * Built from a GGUF file's tokenizer.* metadata. "gpt2" vocabularies are
 * byte-level BPE: the text is split on special tokens, each piece is split
 * by the pre-tokenizer regexes that tokenizer.ggml.pre names (PCRE2, Unicode
 * properties), each word's bytes are mapped to printable code points and
 * merged pairwise by merge rank. Other vocabularies (SentencePiece "llama")
 * plug in behind the same functions; they report CAS_ERR_UNSUPPORTED today.
 *
 * Ownership: the tokenizer copies everything it needs; the cas_gguf may be
 * closed after cas_tok_create. Thread safety: a created tokenizer is
 * read-only; encode and decode may run concurrently on one tokenizer (each
 * call allocates its own scratch).
 * ====================================================================== */

typedef enum {
    CAS_TOK_BPE = 1, /* "gpt2": byte-level BPE with merges */
    CAS_TOK_SPM = 2  /* "llama": SentencePiece (reserved, not implemented) */
} cas_tok_kind;

/* token_type values in GGUF */
typedef enum {
    CAS_TOKTYPE_UNDEFINED = 0,
    CAS_TOKTYPE_NORMAL = 1,
    CAS_TOKTYPE_UNKNOWN = 2,
    CAS_TOKTYPE_CONTROL = 3,
    CAS_TOKTYPE_USER_DEFINED = 4,
    CAS_TOKTYPE_UNUSED = 5,
    CAS_TOKTYPE_BYTE = 6
} cas_toktype;

typedef struct cas_tok cas_tok; /* opaque */

/* Special token ids (-1 where the file names none) and the file's choices
 * about adding BOS/EOS. */
typedef struct {
    int32_t bos, eos, eot, eom, unk, pad, sep;
    int add_bos, add_eos;
} cas_tok_special;

/* Encode flags. */
enum {
    CAS_TOK_ADD_SPECIAL = 1u << 0,  /* add BOS/EOS where the file asks for them */
    CAS_TOK_PARSE_SPECIAL = 1u << 1 /* control tokens in the text become their ids */
};
/* Decode flags. */
enum {
    CAS_TOK_DECODE_SPECIAL = 1u << 0 /* render control tokens as their text (else nothing) */
};

/* Builds the tokenizer of a GGUF file. CAS_ERR_FORMAT on missing or
 * inconsistent tokenizer metadata, CAS_ERR_UNSUPPORTED for vocabulary kinds
 * not implemented. Free with cas_tok_destroy. */
cas_status cas_tok_create(const cas_gguf *g, cas_tok **out);
void cas_tok_destroy(cas_tok *t);

cas_tok_kind cas_tok_kind_of(const cas_tok *t);
int32_t cas_tok_n_vocab(const cas_tok *t);
const cas_tok_special *cas_tok_specials(const cas_tok *t);
/* The pre-tokenizer name from the file ("smollm", "gpt2", ...). */
const char *cas_tok_pre_name(const cas_tok *t);
/* Token type of id (CAS_TOKTYPE_*), or -1 for an id out of range. */
int cas_tok_type(const cas_tok *t, int32_t id);
/* 1 if id ends generation (eos, eot, eom, or a control token the file marks
 * as such, e.g. <|im_end|>, <|eot_id|>). */
int cas_tok_is_eog(const cas_tok *t, int32_t id);
/* The id of a token given its vocabulary text (e.g. "<|im_end|>"), or -1. */
int32_t cas_tok_lookup(const cas_tok *t, const char *text, size_t len);
/* The vocabulary text of id (byte-level form for BPE, e.g. "Ġthe"); not
 * NUL-terminated; NULL for an id out of range. */
const char *cas_tok_text(const cas_tok *t, int32_t id, size_t *len);

/* Encodes len bytes of text (any bytes: invalid UTF-8 is encoded byte by
 * byte). Writes up to cap ids and sets *n_out to the number the text needs;
 * returns CAS_ERR_NOMEM if that exceeds cap (call again with a larger
 * buffer; a cap of len + 2 always suffices). */
cas_status cas_tok_encode(const cas_tok *t, const char *text, size_t len, unsigned flags,
                          int32_t *ids, size_t cap, size_t *n_out);

/* The bytes of one token (empty for control tokens unless
 * CAS_TOK_DECODE_SPECIAL). Points into t; NULL (and *len 0) for a bad id. */
const char *cas_tok_piece(const cas_tok *t, int32_t id, unsigned flags, size_t *len);

/* Decodes ids into buf: writes up to cap bytes, sets *len_out to the total
 * byte length and NUL-terminates when there is room; CAS_ERR_NOMEM if the
 * text (plus NUL) does not fit; CAS_ERR_INVALID for an id out of range. */
cas_status cas_tok_decode(const cas_tok *t, const int32_t *ids, size_t n, unsigned flags,
                          char *buf, size_t cap, size_t *len_out);

/* ======================================================================
 * Chat templates (chat.c)
 *
 * No Jinja interpreter: the file's tokenizer.chat_template is recognised by
 * its markers and rendered by a fixed C routine per family. ChatML
 * (<|im_start|>role\ncontent<|im_end|>\n), including templates that insert a
 * default system message when the conversation has none (SmolLM2), and
 * Llama 3 (<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\n
 * content<|eot_id|>).
 * ====================================================================== */

typedef enum {
    CAS_CHAT_UNKNOWN = 0,
    CAS_CHAT_CHATML = 1,
    CAS_CHAT_LLAMA3 = 2
} cas_chat_kind;

typedef struct {
    const char *role;    /* "system", "user", "assistant", ... */
    const char *content; /* NUL-terminated UTF-8 */
} cas_chat_msg;

typedef struct {
    cas_chat_kind kind;
    /* ChatML: the system message the template adds when the first message
     * is not a system message; NULL for none. Owned (cas_chat_template_free). */
    char *default_system;
    /* 1 if the rendered text starts with the BOS token's text, so it should be
     * tokenized without CAS_TOK_ADD_SPECIAL adding another. */
    int includes_bos;
} cas_chat_template;

/* Recognises a Jinja template string. CAS_ERR_UNSUPPORTED (kind UNKNOWN)
 * when it matches no known family. Free with cas_chat_template_free. */
cas_status cas_chat_template_parse(const char *jinja, cas_chat_template *out);
/* From a file's tokenizer.chat_template; CAS_ERR_FORMAT if it has none. */
cas_status cas_chat_template_from_gguf(const cas_gguf *g, cas_chat_template *out);
void cas_chat_template_free(cas_chat_template *tpl);
const char *cas_chat_kind_name(cas_chat_kind kind);

/* Renders n messages; with add_generation_prompt the text ends with the
 * opening of an assistant turn. *out is a NUL-terminated string that the
 * caller frees with free(). */
cas_status cas_chat_apply(const cas_chat_template *tpl, const cas_chat_msg *msgs, size_t n,
                          int add_generation_prompt, char **out);

#ifdef __cplusplus
}
#endif

#endif
