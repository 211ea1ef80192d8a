/* Element conversions shared by the native kernels: bfloat16 <-> float32
 * (round to nearest even, as torch does; NaN stays NaN) and float16 via
 * the compiler's _Float16. */
#ifndef PDSERVE_NATIVE_DTYPES_H
#define PDSERVE_NATIVE_DTYPES_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = (uint32_t)x << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
#define F16_LOAD(x) ((float)(x))
#define F16_STORE(x) ((_Float16)(x))

#endif
