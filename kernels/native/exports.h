/* The exported kernels one native source calls in another (fused.c,
 * gemm_bf16.c, decode_layer.c), declared once: each defining source
 * includes this too, so the compiler checks the two agree. */
#ifndef PDSERVE_NATIVE_EXPORTS_H
#define PDSERVE_NATIVE_EXPORTS_H

#include <stdint.h>

int pdserve_rms_norm(const void *x, long x_stride, const void *residual, long res_stride,
                     const void *weight, void *out, void *res_out, long rows, long hidden,
                     float eps, int dtype, int num_threads);
int pdserve_gemm_panels(const float *x, long x_stride, long M, const float *panels, long K,
                        long N, const float *bias, float *out, long out_stride, int num_threads);
int pdserve_gemm_panels_bf16(const uint16_t *x16, long x16_stride, long M,
                             const uint16_t *panels, long K, long N, const float *bias,
                             uint16_t *out, long out_stride, int num_threads);
int pdserve_silu_and_mul(const void *x, long x_stride, void *out, long rows, long inter,
                         int dtype, int num_threads);
int pdserve_paged_decode_attention(const void *q, long q_stride, const void *cache,
                                   const int32_t *tables, const int32_t *lens, void *out,
                                   int dtype, int batch, int num_q_heads, int num_kv_heads,
                                   int head_dim, int num_blocks, int block_size,
                                   int table_width, long table_stride, int window, float scale,
                                   float softcap, int num_threads);
int pdserve_decode_qkv_attention(void *qkv, long qkv_stride, void *cache, void *out,
                                 const int64_t *positions, const float *cos_sin,
                                 long max_positions, const int64_t *slots,
                                 const int32_t *tables, const int32_t *lens, int dtype,
                                 int batch, int num_q_heads, int num_kv_heads, int head_dim,
                                 int num_blocks, int block_size, int table_width,
                                 long table_stride, int window, float scale, float softcap,
                                 int num_threads);

#endif
