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

/* Same, the file read into memory instead of mapped: anonymous memory on
 * 2 MiB boundaries, advised as transparent huge pages (the file's mapping
 * has 4 KiB pages, and the matrix kernels stream the weights: one stream's
 * decode of the Q8_0 file 1.18x on the AMD EPYC development VM, where the
 * kernels wait on memory; bench/results/cpu-weights-hugepages.json).
 * Costs the file's size in private memory instead of a shared mapping. */
cas_status cas_gguf_open_read(const char *path, cas_gguf **out);

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
 * Built from a GGUF file's tokenizer.* metadata, as llama.cpp reads it.
 * "gpt2" vocabularies are byte-level BPE: the text is split on special
 * tokens, each piece is split by the pre-tokenizer regexes that
 * tokenizer.ggml.pre names (PCRE2, Unicode properties), each word's bytes
 * are mapped to printable code points and merged pairwise by merge rank.
 * "llama" vocabularies are SentencePiece (Llama 2, Mistral, Gemma): the
 * pieces between special tokens get a leading space where
 * tokenizer.ggml.add_space_prefix asks (the default), spaces become U+2581,
 * characters merge into tokens by tokenizer.ggml.scores, and characters the
 * vocabulary lacks become byte tokens <0xNN>; decoding drops the leading
 * space again from the first token.
 *
 * Ownership: the tokenizer copies everything it needs; the cas_gguf may be
 * closed after cas_tok_create. Thread safety: a created tokenizer is
 * read-only; encode and decode may run concurrently on one tokenizer (each
 * call allocates its own scratch).
 * ====================================================================== */

typedef enum {
    CAS_TOK_BPE = 1, /* "gpt2": byte-level BPE with merges */
    CAS_TOK_SPM = 2  /* "llama": SentencePiece with byte fallback */
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

/* Special token ids (-1 where the file names none; SentencePiece files
 * default to unk 0, bos 1, eos 2) and the file's choices about adding BOS/EOS
 * (SentencePiece: BOS unless the file says otherwise). */
typedef struct {
    int32_t bos, eos, eot, eom, unk, pad, sep;
    int add_bos, add_eos;
} cas_tok_special;

/* Encode flags. */
enum {
    CAS_TOK_ADD_SPECIAL = 1u << 0,  /* add BOS/EOS where the file asks for them */
    CAS_TOK_PARSE_SPECIAL = 1u << 1 /* control and unknown tokens in the text become their ids
                                       (user-defined ones always do) */
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
 * buffer; a cap of cas_tok_max_ids(t, len) always suffices). */
cas_status cas_tok_encode(const cas_tok *t, const char *text, size_t len, unsigned flags,
                          int32_t *ids, size_t cap, size_t *n_out);
/* The most ids len bytes of text can encode to: len + 2 (BPE: a byte is at
 * most one token, then BOS and EOS); 6 len + 2 (SentencePiece: a space may
 * take three byte tokens where the vocabulary lacks U+2581, and so may the
 * space put in front of each piece between special tokens). */
size_t cas_tok_max_ids(const cas_tok *t, size_t len);

/* The bytes of one token (empty for control tokens unless
 * CAS_TOK_DECODE_SPECIAL). Points into t; NULL (and *len 0) for a bad id. */
const char *cas_tok_piece(const cas_tok *t, int32_t id, unsigned flags, size_t *len);

/* Decodes ids into buf: writes up to cap bytes, sets *len_out to the total
 * byte length and NUL-terminates when there is room; CAS_ERR_NOMEM if the
 * text (plus NUL) does not fit; CAS_ERR_INVALID for an id out of range. As
 * llama_detokenize without removing BOS/EOS: a SentencePiece vocabulary that
 * adds a space prefix loses one leading space of the first token's piece
 * (none when that token is BOS, whose piece is empty or "<s>"). */
cas_status cas_tok_decode(const cas_tok *t, const int32_t *ids, size_t n, unsigned flags,
                          char *buf, size_t cap, size_t *len_out);

/* ======================================================================
 * Jinja templates (jinja.c)
 *
 * An interpreter for the Jinja subset chat templates use, with the
 * semantics of Python's jinja2 as Hugging Face's apply_chat_template sets
 * it up (trim_blocks, lstrip_blocks, tojson as json.dumps without ASCII
 * escaping, raise_exception, strftime_now, an immutable sandbox). A
 * compiled template is read-only: any number of threads may render it at
 * once. Every error (syntax, an unsupported tag, filter or test, a
 * runtime type error, a limit) is a status with a message naming the line
 * and column; nothing is read outside the source or the context.
 * ====================================================================== */

typedef struct cas_jinja cas_jinja; /* opaque: a compiled template */

/* Bounds on one render; 0 fields take the defaults. */
typedef struct {
    size_t max_output;  /* bytes of rendered text (default 16 MiB) */
    size_t max_memory;  /* bytes of values the render may hold (default 256 MiB) */
    int64_t max_steps;  /* loop iterations, macro calls and range() items together (default 1e6) */
    int64_t now;        /* strftime_now's time: seconds since the epoch, formatted in UTC;
                         * < 0: the clock, in local time */
} cas_jinja_limits;

/* Compiles len bytes of template source. CAS_ERR_UNSUPPORTED with
 * "jinja: line L column C: ..." for a syntax error or a construct outside
 * the subset. Free with cas_jinja_destroy (NULL is a no-op). */
cas_status cas_jinja_compile(const char *src, size_t len, cas_jinja **out);
void cas_jinja_destroy(cas_jinja *t);

/* Renders with the variables of a JSON object (len bytes; len 0: none),
 * e.g. {"messages": [...], "add_generation_prompt": true, "bos_token": ...}.
 * lim may be NULL. *out is NUL-terminated, *out_len (may be NULL) its byte
 * length; the caller frees *out with free(). Errors: CAS_ERR_INVALID for a
 * bad context or the template's raise_exception() (the conversation does
 * not fit the template), CAS_ERR_NOMEM for a limit of memory or output,
 * CAS_ERR_UNSUPPORTED for any other runtime error. */
cas_status cas_jinja_render(const cas_jinja *t, const char *context_json, size_t len, const cas_jinja_limits *lim,
                            char **out, size_t *out_len);

/* 1 if the template names the variable anywhere (reads it, or binds it with
 * set, for or a macro parameter), else 0: a template that never names
 * `tools` cannot show a request's tools to the model. Thread-safe. */
int cas_jinja_reads(const cas_jinja *t, const char *name);

/* ======================================================================
 * Chat templates (chat.c)
 *
 * The file's tokenizer.chat_template is compiled by the Jinja interpreter
 * above and rendered with messages, add_generation_prompt, bos_token,
 * eos_token and tools = none (cas_chat_apply), or with a context the caller
 * makes (cas_chat_apply_json: tools, tool calls and results, the template's
 * own variables). Two families are also recognised by their
 * markers and have a fixed C routine each, used only when the interpreter
 * cannot compile or run the file's template: ChatML
 * (<|im_start|>role\ncontent<|im_end|>\n), including templates that insert a
 * default system message when the conversation has none (SmolLM2), and
 * Llama 3 (<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\n
 * content<|eot_id|>).
 * ====================================================================== */

typedef enum {
    CAS_CHAT_UNKNOWN = 0,
    CAS_CHAT_CHATML = 1,
    CAS_CHAT_LLAMA3 = 2,
    CAS_CHAT_JINJA = 3 /* no known family: the interpreter alone renders it */
} cas_chat_kind;

typedef struct {
    const char *role;    /* "system", "user", "assistant", ... */
    const char *content; /* NUL-terminated UTF-8 */
} cas_chat_msg;

typedef struct {
    cas_chat_kind kind; /* the family the markers name, else CAS_CHAT_JINJA */
    /* ChatML: the system message the template adds when the first message
     * is not a system message; NULL for none. Owned (cas_chat_template_free). */
    char *default_system;
    /* 1 if the rendered text starts with the BOS token's text, so it should be
     * tokenized without CAS_TOK_ADD_SPECIAL adding another. */
    int includes_bos;
    cas_jinja *jinja;   /* the compiled template; NULL: the family's routine renders */
    char *bos_token;    /* the texts the template sees as bos_token and eos_token; owned */
    char *eos_token;
    int tool_call_tag;  /* the source has the text "<tool_call>" (cas_chat_template_tools) */
} cas_chat_template;

/* Compiles a Jinja template string, with bos_token and eos_token as the
 * template will see them (NULL: the family's usual tokens, else "").
 * CAS_ERR_UNSUPPORTED (kind UNKNOWN) when the interpreter cannot compile it
 * and it matches no known family. Free with cas_chat_template_free. */
cas_status cas_chat_template_create(const char *jinja, const char *bos_token, const char *eos_token,
                                    cas_chat_template *out);
/* cas_chat_template_create with the family's usual tokens. */
cas_status cas_chat_template_parse(const char *jinja, cas_chat_template *out);
/* From a file's tokenizer.chat_template, with its BOS and EOS tokens' texts;
 * CAS_ERR_FORMAT if it has none. */
cas_status cas_chat_template_from_gguf(const cas_gguf *g, cas_chat_template *out);
/* The same with another template's source (jinja; NULL: the file's own),
 * rendered with the file's BOS and EOS tokens' texts (cascade serve
 * --chat-template: a file whose own template is wrong or lacks tools). */
cas_status cas_chat_template_from_gguf_with(const cas_gguf *g, const char *jinja, cas_chat_template *out);
void cas_chat_template_free(cas_chat_template *tpl);
const char *cas_chat_kind_name(cas_chat_kind kind);

/* Renders n messages; with add_generation_prompt the text ends with the
 * opening of an assistant turn. *out is a NUL-terminated string that the
 * caller frees with free(). CAS_ERR_INVALID when the template refuses the
 * conversation (raise_exception: roles that do not alternate, a system
 * message it does not take). */
cas_status cas_chat_apply(const cas_chat_template *tpl, const cas_chat_msg *msgs, size_t n,
                          int add_generation_prompt, char **out);

/* Renders with a caller-made JSON context object (messages with content
 * parts or tool_calls, tools, add_generation_prompt, extra variables);
 * bos_token and eos_token are the template's unless the context sets them.
 * Needs the interpreter (CAS_ERR_UNSUPPORTED when tpl->jinja is NULL). lim
 * may be NULL. */
cas_status cas_chat_apply_json(const cas_chat_template *tpl, const char *context_json,
                               const cas_jinja_limits *lim, char **out);

/* 1 if the interpreter renders the template and it names the variable
 * (cas_jinja_reads), 0 if it renders it and never names it, -1 if the
 * interpreter does not render it (a family's routine does: no variables). */
int cas_chat_template_reads(const cas_chat_template *tpl, const char *name);

/* How a template asks the model to call tools. */
typedef enum {
    CAS_CHAT_TOOLS_NONE = 0,   /* it never names `tools`: tools would not reach the model */
    CAS_CHAT_TOOLS_HERMES = 1, /* it names them and its text has "<tool_call>": calls come as
                                  <tool_call>{"name", "arguments"}</tool_call> (Qwen2.5, Qwen3,
                                  Hermes 2 Pro and 3) */
    CAS_CHAT_TOOLS_OTHER = 2   /* it names them without that tag (Llama 3.1's bare JSON,
                                  Mistral's [TOOL_CALLS], ...) */
} cas_chat_tools;

/* The template's cas_chat_tools, or -1 when the interpreter does not run it. */
int cas_chat_template_tools(const cas_chat_template *tpl);

/* ======================================================================
 * Llama-family forward pass on the CPU (llama.c)
 *
 * A cas_model holds the weights of one GGUF file, kept in their file types
 * inside the mapping, plus the scratch of one forward pass sized at creation
 * from the largest batch: nothing is allocated per step. The architectures
 * are the Llama block (RMSNorm, RoPE, GQA, SwiGLU MLP, tied or separate
 * output) and its close relatives, read as llama.cpp reads them:
 *   llama  Llama 1-3.x, SmolLM, Mistral: RoPE on adjacent pairs; Llama 3.1+'s
 *          frequency factors (rope_freqs.weight), linear RoPE scaling, a
 *          sliding window (llama.attention.sliding_window) where present;
 *   qwen2  Qwen2, Qwen2.5: biases on Q, K and V; RoPE on halves;
 *   qwen3  Qwen3: RMSNorm of every Q and K head before RoPE; RoPE on halves;
 *   phi3   Phi-3, Phi-4-mini: Q, K, V in one matrix (attn_qkv), gate and up in
 *          one (ffn_up); RoPE on halves, possibly on part of each head;
 *   gemma2 Gemma 2: embeddings scaled by sqrt(n_embd), RMSNorm of the
 *          attention's and the MLP's outputs before their residuals
 *          (post_attention_norm, post_ffw_norm), a GELU (tanh) gate, soft-capped
 *          attention scores and logits, a sliding window on every other layer;
 *   gemma3 Gemma 3: as Gemma 2 without the attention soft cap (the logits'
 *          only where the file gives one), RMSNorm of every Q and K head, the
 *          window on five layers of six, whose RoPE has its own base
 *          (rope.freq_base_swa, 10000) and no linear scaling.
 *          Gemma's RMSNorm weights (1 + w) are stored with the 1 added by
 *          llama.cpp's converter, so they multiply as any other norm's.
 * Any architecture may keep Q, K and V in one attn_qkv matrix, and add biases.
 * Anything else in a file (another architecture, a tensor the forward would
 * not use, YaRN or LongRoPE scaling) is refused at load, naming it.
 *
 * A cas_model_kv is the model's paged K/V store, in the layout of the
 * attention contract (attn.h): per layer a K pool and a V pool of num_pages
 * pages of [page_size][n_head_kv][head_dim]. Page ids belong to the caller
 * (the kv layer's block pool, cas_kv in src/kv, which the engine runs, or
 * `cascade generate`): this store only holds the values.
 *
 * One forward call runs the new tokens of n sequences together (prefill
 * chunks and decode tokens side by side), described in compressed rows like
 * an attention batch whose page tables already include the new tokens:
 * token i of sequence r is at position kv_len(r) - q_len(r) + i and its K/V
 * are written to that slot of its pages before attention. The attention plan
 * is built once per call and serves every layer; shared pages (a common
 * prompt prefix) are found by the cascade planner.
 *
 * Threads: a model's weights are read-only, but its scratch and plan serve
 * one forward at a time: calls on one model must not overlap. The matrix
 * and attention kernels use `threads` OpenMP threads inside each call.
 * ====================================================================== */

#include "../attn/attn.h"

/* The architectures the forward runs (general.architecture). */
typedef enum {
    CAS_ARCH_LLAMA = 0, /* "llama" */
    CAS_ARCH_QWEN2 = 1, /* "qwen2" */
    CAS_ARCH_QWEN3 = 2, /* "qwen3" */
    CAS_ARCH_PHI3 = 3,  /* "phi3" */
    CAS_ARCH_GEMMA2 = 4, /* "gemma2" */
    CAS_ARCH_GEMMA3 = 5  /* "gemma3" */
} cas_model_arch;

/* "llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"; "?" outside the enum. */
const char *cas_model_arch_name(cas_model_arch arch);

/* Hyper-parameters, all read from the file. Keys are named for arch llama;
 * the other architectures' keys carry their own prefix (qwen2.block_count). */
typedef struct {
    int32_t n_layers;    /* llama.block_count */
    int32_t n_embd;      /* llama.embedding_length */
    int32_t n_ff;        /* llama.feed_forward_length */
    int32_t n_head;      /* llama.attention.head_count */
    int32_t n_head_kv;   /* llama.attention.head_count_kv (n_head if absent) */
    int32_t head_dim;    /* n_embd / n_head (or attention.key_length) */
    int32_t n_rot;       /* llama.rope.dimension_count (head_dim if absent) */
    int32_t n_vocab;     /* rows of token_embd.weight */
    int32_t n_ctx_train; /* llama.context_length */
    float rope_base;     /* llama.rope.freq_base (10000 if absent) */
    float rms_eps;       /* llama.attention.layer_norm_rms_epsilon */
    int tied_embeddings; /* 1: output.weight absent, logits use token_embd.weight */
    int64_t weight_bytes_per_token; /* matrix bytes one decode token reads (all layers + output) */
    cas_model_arch arch; /* general.architecture */
    int32_t rope_neox;   /* RoPE pairs: 0 adjacent (x[2i], x[2i+1]) as the llama converter permutes
                            Q and K for; 1 halves (x[i], x[i + n_rot/2]), qwen2, qwen3, phi3 */
    float rope_freq_scale; /* angles multiplied by this: 1 / llama.rope.scaling.factor (linear
                              scaling; its older name rope.scale_linear too); 1 without */
    int32_t rope_freq_factors; /* 1: rope_freqs.weight [n_rot/2] divides each frequency (Llama
                                  3.1-3.3's long-context scaling); 0: absent */
    int32_t sliding_window; /* llama.attention.sliding_window: a query sees the keys of the last
                               this many positions, its own included (Mistral); 0: all of them */
    int32_t qkv_bias;    /* 1: some layer adds attn_q/attn_k/attn_v.bias after its projection */
    int32_t qk_norm;     /* 1: attn_q_norm/attn_k_norm.weight [head_dim]: RMSNorm of each Q and
                            K head before RoPE (qwen3, gemma3) */
    /* Gemma's additions; 0 in every field means "not there" (a zeroed config is Llama's) */
    int32_t swa_pattern; /* which layers the sliding window applies to: 0 every layer; P > 0 layer l
                            when l % P < P - 1 (attention.sliding_window_pattern; Gemma 2: 2,
                            Gemma 3: 6); 1 none */
    float rope_base_swa;       /* RoPE base of the windowed layers (rope.freq_base_swa) ... */
    float rope_freq_scale_swa; /* ... and their frequency scale; 0: those of the other layers */
    float attn_scale;    /* score scale; 0: 1 / sqrt(head_dim) (Gemma 2/3 27B: 1 / sqrt(n_embd / n_head)) */
    float attn_softcap;  /* scores become cap * tanh(s / cap) (attn_logit_softcapping); 0: off */
    float final_softcap; /* logits become cap * tanh(l / cap) (final_logit_softcapping); 0: off */
    float embd_scale;    /* embeddings multiplied by this (Gemma: sqrt(n_embd)); 0: by 1 */
    int32_t post_norms;  /* 1: post_attention_norm/post_ffw_norm.weight [n_embd]: RMSNorm of the
                            attention's and the MLP's outputs before their residuals (Gemma) */
    int32_t gelu_gate;   /* 1: the MLP's gate is GELU (tanh approximation): GeGLU; 0: SiLU */
} cas_model_config;

/* 1 if layer l of c attends through the sliding window. */
int cas_model_layer_windowed(const cas_model_config *c, int32_t l);

/* The hyper-parameters of a file's model, checked (a known architecture,
 * shapes the attention core runs, no tensor the forward would leave unused,
 * no YaRN or LongRoPE scaling): what cas_model_create reads, for the other
 * forward passes (src/gpu), which refuse what they do not run.
 * weight_bytes_per_token is left 0. */
cas_status cas_model_config_read(const cas_gguf *g, cas_model_config *c);

/* The RoPE frequency of each rotated pair, inv_freq[n_rot / 2]:
 * rope_base^(-2i / n_rot) * rope_freq_scale / rope_freqs.weight[i] (the
 * factor only where c->rope_freq_factors; g may be NULL otherwise). Token
 * at position p rotates pair i by p * inv_freq[i]. */
cas_status cas_model_rope_freqs(const cas_gguf *g, const cas_model_config *c, float *inv_freq);

/* The shapes of well-known models for synthetic weights (no file; the GPU
 * path fills them from a seed): "llama-3.2-1b", "llama-3-8b", "llama-3-70b"
 * (head counts, widths, vocabulary and RoPE base as published; Llama 3.2's
 * long-context RoPE scaling is left out: random weights have no context to
 * stretch). CAS_ERR_INVALID with the list for another name. */
cas_status cas_model_config_synthetic(const char *name, cas_model_config *c);

typedef struct {
    int32_t max_batch_tokens; /* most new tokens in one forward (scratch size); default 512 */
    int32_t max_seqs;         /* most sequences in one forward; default 64 */
    int32_t max_logits;       /* most rows of logits one forward returns; default max_seqs */
    int32_t threads;          /* OpenMP threads of the kernels; 0: all cores */
    cas_cascade_mode cascade; /* attention planner mode; default CAS_CASCADE_AUTO */
    int32_t portable_kernels; /* 1: portable (non-SIMD) matrix kernels (tests) */
    int32_t batch_invariant;  /* 1 (default): a token's logits are bitwise the same whatever
                                 else is in the batch, with cascade on or off, with or without
                                 a cached prefix, chunked or not (the matrix kernels always are;
                                 this makes the attention plans so: cas_attn_plan_opts.
                                 batch_invariant). 0: the fastest attention plans, whose
                                 results vary with the batch by f32 rounding */
    cas_simd_level simd;      /* the widest vector instructions of the matrix, elementwise and
                                 attention kernels (core.h): CAS_SIMD_AUTO (default) the CPU's
                                 widest; GENERIC, AVX2 or AVX512 lower it to compare kernels
                                 (the results agree to f32 rounding); below AVX512 also no AMX.
                                 A level this CPU lacks fails creation with CAS_ERR_UNSUPPORTED */
    int32_t amx_off;          /* 1: never the AMX tile unit (the batched AMX-INT8 products and
                                 their packed weight copies; AMX-BF16 attention), for A/B runs
                                 and tests: the AVX2 products give the same bits. 0 (default):
                                 AMX where the CPU has it and Linux grants the tile state */
    int32_t mmap_weights;     /* cas_model_load only: 1: the weights stay in the file's mapping
                                 (cas_gguf_open: shared between processes, read on first use);
                                 0 (default): the file is read into huge pages
                                 (cas_gguf_open_read: faster decode, private memory) */
} cas_model_opts;

cas_model_opts cas_model_opts_default(void);

typedef struct cas_model cas_model;

/* Builds a model over an open GGUF file, which is borrowed: it must stay open
 * until cas_model_destroy. CAS_ERR_UNSUPPORTED for an architecture other than
 * those above, a tensor type the kernels lack or a tensor the
 * forward would not use, CAS_ERR_FORMAT for a missing
 * tensor or key or a shape that disagrees with the hyper-parameters; the
 * message names the tensor or key. */
cas_status cas_model_create(const cas_gguf *g, const cas_model_opts *opts, cas_model **out);
/* Opens the file and builds the model, which then owns the file. */
cas_status cas_model_load(const char *path, const cas_model_opts *opts, cas_model **out);
void cas_model_destroy(cas_model *m);

const cas_model_config *cas_model_config_of(const cas_model *m);
const cas_gguf *cas_model_gguf(const cas_model *m);
const cas_model_opts *cas_model_opts_of(const cas_model *m);
/* Changes the planner mode for later forwards. */
void cas_model_set_cascade(cas_model *m, cas_cascade_mode mode);

typedef struct cas_model_kv cas_model_kv;

/* Allocates the pools for num_pages pages of page_size tokens (1..256) in
 * dtype (f16 halves the bytes of f32 and is the default choice of
 * `cascade generate`; bf16 also works). Zero-filled. */
cas_status cas_model_kv_create(const cas_model *m, int32_t num_pages, int32_t page_size,
                               cas_dtype dtype, cas_model_kv **out);
/* The number of pages that fit in budget_bytes (all layers, K and V). */
int32_t cas_model_kv_pages_for_budget(const cas_model *m, int32_t page_size, cas_dtype dtype,
                                      size_t budget_bytes);
void cas_model_kv_destroy(cas_model_kv *kv);
int32_t cas_model_kv_num_pages(const cas_model_kv *kv);
int32_t cas_model_kv_page_size(const cas_model_kv *kv);
size_t cas_model_kv_bytes(const cas_model_kv *kv);

/* The new tokens of one forward. All arrays borrowed, read only. */
typedef struct {
    int32_t n_seqs;                  /* B */
    const int32_t *tokens;           /* [qo_indptr[B]] token ids, sequence after sequence */
    const int32_t *qo_indptr;        /* [B+1] new tokens of sequence r: qo_indptr[r] .. [r+1]-1 */
    const int32_t *kv_indptr;        /* [B+1] page table rows (after appending the new tokens) */
    const int32_t *kv_indices;       /* [kv_indptr[B]] page ids */
    const int32_t *kv_last_page_len; /* [B] tokens in each sequence's last page */
    int32_t n_logits;                /* rows of logits wanted */
    const int32_t *logit_rows;       /* [n_logits] token rows (0 .. qo_indptr[B]-1), or NULL:
                                        the last token of each sequence (n_logits = B) */
} cas_model_batch;

/* Runs the batch: writes the new tokens' K/V into their pages and
 * logits[n_logits][n_vocab] (f32, before any softmax). The pages a sequence
 * shares with another must hold K/V already or be written by this same call
 * (by the sequence that owns them). Allocates nothing (CAS_ERR_NOMEM when the
 * batch exceeds the capacities of the model's options). */
cas_status cas_model_forward(cas_model *m, cas_model_kv *kv, const cas_model_batch *b,
                             float *logits);

/* What the attention plan of the last forward did (tree nodes, shared passes,
 * KV tokens read): the engine counts steps that used cascade. Zeros before
 * the first forward. */
void cas_model_plan_info(const cas_model *m, cas_attn_plan_info *info);

/* ======================================================================
 * Sampler and stop conditions (sampler.c)
 *
 * Turns one row of logits into a token: greedy when temperature is 0, else
 * temperature, then top-k, top-p (nucleus) and min-p filtering, then a draw
 * from the sampler's own random generator, so that a request with a seed is
 * reproducible whatever else runs in its batch. One sampler per request;
 * not shared between threads. The stop checker watches the generated text
 * for stop strings and holds back the bytes that could still begin one.
 * ====================================================================== */

typedef struct {
    float temperature; /* >= 0; 0: greedy (argmax) */
    int32_t top_k;     /* >= 0; 0: off */
    float top_p;       /* (0, 1]; 1: off */
    float min_p;       /* [0, 1]; 0: off (keep tokens with p >= min_p * p_max) */
    uint64_t seed;
} cas_sampler_params;

/* temperature 0.7, top_k 40, top_p 0.95, min_p 0.05, seed 42 */
cas_sampler_params cas_sampler_params_default(void);
/* CAS_ERR_INVALID with a message naming the value when a field is out of range
 * (or NaN). */
cas_status cas_sampler_params_check(const cas_sampler_params *p);

typedef struct cas_sampler cas_sampler;
cas_status cas_sampler_create(const cas_sampler_params *p, int32_t n_vocab, cas_sampler **out);
void cas_sampler_destroy(cas_sampler *s);
/* The vocabulary-sized work arrays of sampling (about 16 bytes a token),
 * shared: a sampler made with cas_sampler_create_with borrows them instead of
 * owning its own, so that many live requests hold one copy. The samplers that
 * share one scratch must sample from one thread at a time (an engine's step
 * loop); the scratch outlives them. */
typedef struct cas_sampler_scratch cas_sampler_scratch;
cas_status cas_sampler_scratch_create(int32_t n_vocab, cas_sampler_scratch **out);
void cas_sampler_scratch_destroy(cas_sampler_scratch *sc);
cas_status cas_sampler_create_with(const cas_sampler_params *p, int32_t n_vocab, cas_sampler_scratch *scratch,
                                   cas_sampler **out);
/* Picks a token from logits[n_vocab] (not modified). Allocates nothing. */
int32_t cas_sampler_sample(cas_sampler *s, const float *logits);
/* The same with the draw u in [0, 1) given instead of taken from the
 * sampler's generator (ignored when greedy): a caller that keeps its own
 * generator (the engine's GPU path) picks on the host as it would on the
 * device. */
int32_t cas_sampler_sample_u(cas_sampler *s, const float *logits, double u);

/* What a request does to its logits row before the sampler, as vLLM and
 * OpenAI define it. Applied in this order: masked tokens to -inf and logit
 * biases added (vLLM's min_tokens and logit_bias processors), then the
 * repetition penalty on every token of the prompt or the output (a positive
 * logit divided by it, any other multiplied), then for each token generated
 * c > 0 times, logit -= frequency_penalty * c, then -= presence_penalty. */
typedef struct {
    float presence_penalty;   /* 0: off */
    float frequency_penalty;  /* 0: off */
    float repetition_penalty; /* > 0; 1 or 0: off */
    int32_t n_bias;
    const int32_t *bias_ids;  /* [n_bias] token ids */
    const float *bias;        /* [n_bias] added to those logits */
    int32_t n_mask;
    const int32_t *mask_ids;  /* [n_mask] token ids whose logits become -inf */
} cas_logit_adjust;

/* Applies a to logits[n_vocab] in place. prompt[n_prompt] and out[n_out] are
 * the request's prompt and generated tokens. scratch: [n_vocab] zeros,
 * zeros again on return. Ids outside the vocabulary are skipped. Allocates
 * nothing; O(n_mask + n_bias + n_prompt + n_out). */
void cas_logits_adjust(float *logits, int32_t n_vocab, const cas_logit_adjust *a, const int32_t *prompt,
                       int32_t n_prompt, const int32_t *out, int32_t n_out, int32_t *scratch);

typedef struct cas_stopper cas_stopper;
/* stops: n NUL-terminated strings (copied); n may be 0. */
cas_status cas_stopper_create(const char *const *stops, int32_t n, cas_stopper **out);
void cas_stopper_destroy(cas_stopper *st);
/* Appends len bytes of generated text. Returns 1 when a stop string has now
 * appeared (generation ends; the text before it is released, the stop
 * string itself is not). *emit / *emit_len: bytes now safe to show (they can
 * no longer be the start of a stop string); valid until the next call. */
int cas_stopper_push(cas_stopper *st, const char *text, size_t len, const char **emit,
                     size_t *emit_len);
/* keep 1: when a stop string appears, the text up to and including it is
 * released (vLLM's include_stop_str_in_output); 0 (default): up to it. */
void cas_stopper_keep_stop(cas_stopper *st, int keep);
/* The held-back bytes at the end of generation (no stop string came). */
void cas_stopper_flush(cas_stopper *st, const char **emit, size_t *emit_len);

#ifdef __cplusplus
}
#endif

#endif
