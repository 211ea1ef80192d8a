/* 16-float vectors (GCC vector extensions; one AVX-512 register, two AVX2
 * ones) shared by the native kernels: loads of 16 elements of each storage
 * type as floats, and a vectorised exp for SiLU. */
#ifndef PDSERVE_NATIVE_VEC_H
#define PDSERVE_NATIVE_VEC_H

#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint16_t vhalfbits __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vbits __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef _Float16 vhalf __attribute__((vector_size(LANES * sizeof(_Float16))));

static inline vfloat load_f32(const float *p) {
  vfloat v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline vfloat load_bf16(const uint16_t *p) {
  vhalfbits raw;
  memcpy(&raw, p, sizeof raw);
  vbits wide = __builtin_convertvector(raw, vbits) << 16;
  vfloat v;
  memcpy(&v, &wide, sizeof v);
  return v;
}

static inline vfloat load_f16(const _Float16 *p) {
  vhalf raw;
  memcpy(&raw, p, sizeof raw);
  return __builtin_convertvector(raw, vfloat);
}

/* exp(x) per lane: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes'
 * degree-6 polynomial, times 2^n built in the exponent bits; within ~2 ulp
 * of expf over [-87.3, 88.3] (x is clamped to that range: exp(-88.3) is
 * already below float32's normal range, exp(88.3) near its top). */
static inline void store_f32(float *p, vfloat v) { memcpy(p, &v, sizeof v); }

/* float32 rounded to bfloat16 (nearest even; NaN stays NaN, dtypes.h's
 * rule), still in float32 lanes: the low 16 bits of each lane are zero. */
static inline vbits bf16_rounded_bits(vfloat v) {
  vbits bits;
  memcpy(&bits, &v, sizeof bits);
  const vint nan = (vint)((bits & 0x7fffffffu) > 0x7f800000u);
  const vbits rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const vbits quiet = (bits | 0x400000u) & 0xffff0000u;
  return (vbits)((nan & (vint)quiet) | (~nan & (vint)rounded));
}

static inline vhalfbits to_bf16(vfloat v) {
  return __builtin_convertvector(bf16_rounded_bits(v) >> 16, vhalfbits);
}

static inline void store_bf16(uint16_t *p, vfloat v) {
  const vhalfbits h = to_bf16(v);
  memcpy(p, &h, sizeof h);
}

static inline void store_f16(_Float16 *p, vfloat v) {
  const vhalf h = __builtin_convertvector(v, vhalf);
  memcpy(p, &h, sizeof h);
}

/* v rounded to each storage type and back: what a store and a load give. */
static inline vfloat round_f32(vfloat v) { return v; }

static inline vfloat round_bf16(vfloat v) {
  const vbits bits = bf16_rounded_bits(v);
  vfloat out;
  memcpy(&out, &bits, sizeof out);
  return out;
}

static inline vfloat round_f16(vfloat v) {
  return __builtin_convertvector(__builtin_convertvector(v, vhalf), vfloat);
}

/* a where mask (-1) else b, per lane (C has no vector ?:). */
static inline vfloat vselect(vint mask, vfloat a, vfloat b) {
  return (vfloat)((mask & (vint)a) | (~mask & (vint)b));
}

static inline vfloat vexp(vfloat x) {
  const vfloat hi = (vfloat){0} + 88.3762626647949f, lo = (vfloat){0} - 87.3365447504f;
  x = vselect(x > hi, hi, x);
  x = vselect(x < lo, lo, x);
  const vfloat t = x * 1.44269504088896341f + 0.5f;
  vint n = __builtin_convertvector(t, vint);        /* truncates toward zero */
  n += (vint)(__builtin_convertvector(n, vfloat) > t); /* -1 where that rounded up: floor */
  const vfloat nf = __builtin_convertvector(n, vfloat);
  const vfloat r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vfloat p = (vfloat){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint scale_bits = (n + 127) << 23;
  vfloat scale;
  memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

/* tanh(x) per lane, as Cephes' tanhf: x + x^3 P(x^2) for |x| < 0.625,
 * else sign(x) (1 - 2 / (exp(2|x|) + 1)) (no cancellation there: the result
 * is above 0.55); a few ulp from tanhf. exp's clamp makes large |x| +-1. */
static inline vfloat vtanh(vfloat x) {
  const vfloat zero = {0};
  const vint negative = (vint)(x < zero);
  const vfloat ax = vselect(negative, -x, x);
  vfloat large = 1.0f - 2.0f / (vexp(ax + ax) + 1.0f);
  large = vselect(negative, -large, large);
  const vfloat s = x * x;
  vfloat p = zero - 5.70498872745e-3f;
  p = p * s + 2.06390887954e-2f;
  p = p * s - 5.37397155531e-2f;
  p = p * s + 1.33314422036e-1f;
  p = p * s - 3.33332819422e-1f;
  const vfloat small = p * s * x + x;
  return vselect((vint)(ax < zero + 0.625f), small, large);
}

#endif
