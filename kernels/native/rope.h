/* Neox rotary embedding of one head, shared by the RoPE kernel
 * (elementwise.c) and the fused decode attention (fused.c):
 * x1 = x[:D/2], x2 = x[D/2:], out = [x1*cos - x2*sin, x2*cos + x1*sin] with
 * cos/sin one row of the float32 cache (cos in its first D/2 columns).
 * float32 math, rounded to the element type; `in` may be `out`. */
#ifndef PDSERVE_NATIVE_ROPE_H
#define PDSERVE_NATIVE_ROPE_H

#include <stdint.h>

#include "dtypes.h"

#define DEFINE_ROPE_HEAD(NAME, ELEM, LOAD, STORE)                                          \
  static inline void NAME(const ELEM *in, ELEM *out, long half, const float *cos,         \
                          const float *sin) {                                              \
    for (long j = 0; j < half; j++) {                                                      \
      const float x1 = LOAD(in[j]), x2 = LOAD(in[j + half]);                               \
      out[j] = STORE(x1 * cos[j] - x2 * sin[j]);                                           \
      out[j + half] = STORE(x2 * cos[j] + x1 * sin[j]);                                    \
    }                                                                                      \
  }

DEFINE_ROPE_HEAD(rope_head_f32, float, F32_LOAD, F32_STORE)
DEFINE_ROPE_HEAD(rope_head_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ROPE_HEAD(rope_head_f16, _Float16, F16_LOAD, F16_STORE)

#endif
