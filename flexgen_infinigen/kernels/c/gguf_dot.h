/* GGUF's quantized block formats as the CPU kernels read them (gguf_dot.c): each type by
   ggml's type number, its bytes and values a block. decode_layer.c reaches the layer through
   gguf_linear (a linear layer of kind LIN_GGUF). */
#ifndef FLEXGEN_INFINIGEN_GGUF_DOT_H
#define FLEXGEN_INFINIGEN_GGUF_DOT_H
#include <stdint.h>

enum { GT_Q4_0 = 2, GT_Q4_1 = 3, GT_Q5_0 = 6, GT_Q5_1 = 7, GT_Q8_0 = 8, GT_Q4_K = 12,
       GT_Q5_K = 13, GT_Q6_K = 14, GT_MXFP4 = 39 };

typedef struct {
    int64_t type, bytes, values;
} gguf_format;

const gguf_format *gguf_format_of(int64_t type);
int64_t gguf_act_bytes(int64_t type, int64_t K);
void gguf_quantize_act(int64_t type, const float *x, int64_t M, int64_t K, uint8_t *xq,
                       int64_t nthreads);
int gguf_linear_q(int64_t type, const uint8_t *w, const int32_t *order, const uint8_t *xq,
                  const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                  int64_t nthreads);
int gguf_linear(int64_t type, const uint8_t *w, const int32_t *order, const float *x,
                const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                int64_t nthreads);
int gguf_dequantize_rows(int64_t type, const uint8_t *w, const int64_t *rows, int64_t n,
                         int64_t K, float *out, int64_t nthreads);
#endif
