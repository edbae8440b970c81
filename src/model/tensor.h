/*
 * tensor.h: tensor element types of the model layer, numbered as in GGUF
 * (ggml's type ids) so that a file's type field maps directly. Quantized types
 * store blocks of 32 elements, or super-blocks of 256 (the K-quants and
 * IQ4_XS). Internal to src/model (the layer's public
 * header, model.h, includes it).
 */
#ifndef CASCADE_MODEL_TENSOR_H
#define CASCADE_MODEL_TENSOR_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    CAS_T_F32 = 0,
    CAS_T_F16 = 1,
    CAS_T_Q4_0 = 2,
    CAS_T_Q4_1 = 3,
    CAS_T_Q8_0 = 8,
    CAS_T_BF16 = 30,
    /* Types the GGUF reader can size and map but the kernels may not compute
     * with (they report CAS_ERR_UNSUPPORTED). */
    CAS_T_Q5_0 = 6,
    CAS_T_Q5_1 = 7,
    CAS_T_Q8_1 = 9,
    CAS_T_Q2_K = 10,
    CAS_T_Q3_K = 11,
    CAS_T_Q4_K = 12,
    CAS_T_Q5_K = 13,
    CAS_T_Q6_K = 14,
    CAS_T_Q8_K = 15,
    CAS_T_IQ4_NL = 20,
    CAS_T_IQ4_XS = 23,
    CAS_T_I8 = 24,
    CAS_T_I16 = 25,
    CAS_T_I32 = 26,
    CAS_T_I64 = 27,
    CAS_T_F64 = 28
} cas_ttype;

/* ---- type traits -------------------------------------------------------
 * A tensor row of n elements of type t takes n / block_size(t) blocks of
 * block_bytes(t) bytes each; n must be a multiple of the block size. Unknown
 * type ids give block size 0 and name NULL, which is how callers (the GGUF
 * reader) recognise an id they cannot size. */

/* Elements per block (1 for plain types, 32 or 256 for quantized); 0 if the
 * id is unknown. */
static inline int64_t cas_ttype_block_size(int t) {
    switch (t) {
    case CAS_T_F32: case CAS_T_F16: case CAS_T_BF16: case CAS_T_F64:
    case CAS_T_I8: case CAS_T_I16: case CAS_T_I32: case CAS_T_I64:
        return 1;
    case CAS_T_Q4_0: case CAS_T_Q4_1: case CAS_T_Q5_0: case CAS_T_Q5_1:
    case CAS_T_Q8_0: case CAS_T_Q8_1: case CAS_T_IQ4_NL:
        return 32;
    case CAS_T_Q2_K: case CAS_T_Q3_K: case CAS_T_Q4_K: case CAS_T_Q5_K:
    case CAS_T_Q6_K: case CAS_T_Q8_K: case CAS_T_IQ4_XS:
        return 256;
    default:
        return 0;
    }
}

/* Bytes per block; 0 if the id is unknown. */
static inline int64_t cas_ttype_block_bytes(int t) {
    switch (t) {
    case CAS_T_F32: return 4;
    case CAS_T_F16: return 2;
    case CAS_T_BF16: return 2;
    case CAS_T_F64: return 8;
    case CAS_T_I8: return 1;
    case CAS_T_I16: return 2;
    case CAS_T_I32: return 4;
    case CAS_T_I64: return 8;
    case CAS_T_Q4_0: return 2 + 16;      /* f16 scale, 32 x 4 bits */
    case CAS_T_Q4_1: return 2 + 2 + 16;  /* f16 scale and min, 32 x 4 bits */
    case CAS_T_Q5_0: return 2 + 4 + 16;  /* + 32 high bits */
    case CAS_T_Q5_1: return 2 + 2 + 4 + 16;
    case CAS_T_Q8_0: return 2 + 32;      /* f16 scale, 32 x int8 */
    case CAS_T_Q8_1: return 2 + 2 + 32;  /* f16 scale and sum, 32 x int8 */
    case CAS_T_Q2_K: return 84;
    case CAS_T_Q3_K: return 110;
    case CAS_T_Q4_K: return 144;
    case CAS_T_Q5_K: return 176;
    case CAS_T_Q6_K: return 210;
    case CAS_T_Q8_K: return 292;
    case CAS_T_IQ4_NL: return 2 + 16;   /* f16 scale, 32 x 4-bit indices into a fixed table */
    case CAS_T_IQ4_XS: return 136;
    default: return 0;
    }
}

/* A short name ("f32", "q4_1", ...); NULL if the id is unknown. */
static inline const char *cas_ttype_name(int t) {
    switch (t) {
    case CAS_T_F32: return "f32";
    case CAS_T_F16: return "f16";
    case CAS_T_BF16: return "bf16";
    case CAS_T_F64: return "f64";
    case CAS_T_I8: return "i8";
    case CAS_T_I16: return "i16";
    case CAS_T_I32: return "i32";
    case CAS_T_I64: return "i64";
    case CAS_T_Q4_0: return "q4_0";
    case CAS_T_Q4_1: return "q4_1";
    case CAS_T_Q5_0: return "q5_0";
    case CAS_T_Q5_1: return "q5_1";
    case CAS_T_Q8_0: return "q8_0";
    case CAS_T_Q8_1: return "q8_1";
    case CAS_T_Q2_K: return "q2_k";
    case CAS_T_Q3_K: return "q3_k";
    case CAS_T_Q4_K: return "q4_k";
    case CAS_T_Q5_K: return "q5_k";
    case CAS_T_Q6_K: return "q6_k";
    case CAS_T_Q8_K: return "q8_k";
    case CAS_T_IQ4_NL: return "iq4_nl";
    case CAS_T_IQ4_XS: return "iq4_xs";
    default: return NULL;
    }
}

/* ggml's name of any type id a GGUF file may carry, including those cascade
 * cannot size or compute with ("iq2_xxs", "tq1_0", ...), for error messages
 * that name the type; NULL for ids ggml does not define. */
static inline const char *cas_ttype_ggml_name(int t) {
    switch (t) {
    case 16: return "iq2_xxs";
    case 17: return "iq2_xs";
    case 18: return "iq3_xxs";
    case 19: return "iq1_s";
    case 21: return "iq3_s";
    case 22: return "iq2_s";
    case 29: return "iq1_m";
    case 34: return "tq1_0";
    case 35: return "tq2_0";
    case 39: return "mxfp4";
    case 40: return "nvfp4";
    case 41: return "q1_0";
    default: return cas_ttype_name(t);
    }
}

/* Bytes of n elements of type t, or -1 when the id is unknown, n is negative
 * or not a multiple of the block size, or the size overflows int64. */
static inline int64_t cas_ttype_nbytes(int t, int64_t n) {
    int64_t bs = cas_ttype_block_size(t), bb = cas_ttype_block_bytes(t);
    if (bs <= 0 || n < 0 || n % bs) return -1;
    int64_t nb = n / bs;
    if (nb > INT64_MAX / bb) return -1;
    return nb * bb;
}

#endif
