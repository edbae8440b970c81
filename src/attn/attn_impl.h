/*
 * attn_impl.h: internals of the attention layer shared by its .c files (and
 * by backends that execute a CPU-built plan). Not part of the contract.
 */
#ifndef CASCADE_ATTN_IMPL_H
#define CASCADE_ATTN_IMPL_H

#include "attn.h"

/* sm_scale with the default applied. */
float cas_attn_scale(const cas_attn_shape *shape, const cas_attn_params *params);

#endif
