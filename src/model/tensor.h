/*
 * tensor.h: tensor element types of the model layer, numbered as in GGUF
 * (ggml's type ids) so that a file's type field maps directly. Quantized types
 * store blocks of 32 elements. Internal to src/model (the layer's public
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
    CAS_T_BF16 = 30
} cas_ttype;

#endif
