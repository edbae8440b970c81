/* cuda_stub.h: what tests/cuda/cuda_stub.c gives the planner's test. */
#ifndef CASCADE_TEST_CUDA_STUB_H
#define CASCADE_TEST_CUDA_STUB_H

#include <stddef.h>

#include "../../src/cuda/cuda_attn_impl.h"

#define CAS_STUB_SMS 132
/* the stand-in devices: 4 (tensor parallelism over several), sharing one
 * budget of memory, 16 GiB */
#define CAS_STUB_DEVICES 4
#define CAS_STUB_DEVICE_BYTES ((size_t)16 << 30)
/* the destination and size of the last host-to-device copy (a plan's upload) */
extern void *cas_stub_last_h2d;
extern size_t cas_stub_last_h2d_bytes;

#endif
