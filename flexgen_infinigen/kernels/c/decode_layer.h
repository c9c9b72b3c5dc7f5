/* The argument blocks of a fused decode step (decode_layer.c: the layer; decode_select.c:
   InfiniGen's chosen rows and the next layer's speculation, inside the same call). The ctypes
   mirrors in kernels/layer_args.py and kv/infinigen/fused_select.py list the fields in order.
   decode_layer.c reaches decode_select.c only through the select_step slot, so that the two
   files do not call each other (decode_select.c calls dl_run_linear: one direction). */
#ifndef FLEXGEN_INFINIGEN_DECODE_LAYER_H
#define FLEXGEN_INFINIGEN_DECODE_LAYER_H
#include "common.h"

void rms_norm_rows(const float *x, const float *weight, float *y, int64_t rows, int64_t n,
                   float eps, int64_t nthreads);
void rotary_rows(const float *x, const float *cos, const float *sin, float *y, int64_t tokens,
                 int64_t heads, int64_t d, int64_t nthreads);
void linear_rows(const float *x, const float *w, const float *bias, float *out, int64_t M,
                 int64_t N, int64_t K, int64_t nthreads);
int linear_q4(const float *x, const uint8_t *codes, const float *scale, const float *minimum,
              const float *bias, float *out, int64_t M, int64_t N, int64_t K, int64_t group,
              int64_t nthreads);
int linear_q8(const float *x, const int8_t *codes, const float *scale, const float *minimum,
              const float *bias, float *out, int64_t M, int64_t N, int64_t K, int64_t group,
              int64_t nthreads);
int linear_q4_h16(const float *x, const uint8_t *codes, const uint16_t *scale,
                  const uint16_t *minimum, const float *bias, float *out, int64_t M, int64_t N,
                  int64_t K, int64_t group, int64_t nthreads);
int linear_q8_h16(const float *x, const int8_t *codes, const uint16_t *scale,
                  const uint16_t *minimum, const float *bias, float *out, int64_t M, int64_t N,
                  int64_t K, int64_t group, int64_t nthreads);
void attend_rows(const float *q, const float *k, const float *v, const float *bias,
                 float *out, const float *sinks, int64_t T, int64_t C, int64_t G, int64_t D,
                 int64_t st, int64_t sc, int64_t nthreads);

enum { LIN_FLOAT = 0, LIN_Q4 = 1, LIN_Q8 = 2, LIN_Q4_H16 = 3, LIN_Q8_H16 = 4, LIN_GGUF = 5 };
enum { DL_IN = 1, DL_ATTEND = 2, DL_OUT = 4, DL_MLP = 8, DL_CHOSEN = 16,
       DL_SPECULATE = 32, DL_OWN = 64 };

/* A linear layer as stored: float32 rows [n, k], or codes with float32 scales and minimums
   per group (the layouts linear_q4 / linear_q8 read), or the same codes with float16 scales
   and minimums (the _H16 kinds: linear_q4_h16 / linear_q8_h16), or a GGUF file's blocks as
   stored (LIN_GGUF: group holds the GGUF type number, w the blocks, scale the int32 row
   order or NULL; gguf_dot.c's gguf_linear). bias may be NULL. */
typedef struct {
    int64_t kind, n, k, group;
    const void *w;
    const void *scale, *minimum;
    const float *bias;
} dl_linear;

/* Every field is 8 bytes wide (the ctypes mirror in layer_args.py lists them in order). */
typedef struct dl_args {
    int64_t B, H, KV, D, hidden, inter, nthreads;
    double eps;
    const float *attn_norm, *mlp_norm;
    dl_linear q, k, v, o, gate, up, down;
    /* per step */
    const float *h;            /* [B, hidden] the layer's input */
    float *h_out;              /* [B, hidden] its output */
    const float *cos, *sin;    /* [B, D] this step's rotary encoding */
    const float *bias;         /* [B, bias_stride]: the additive mask over the cache's columns */
    int64_t bias_stride;
    float *kc, *vc;            /* the cache: row t of column c at t * st + c * sc floats */
    int64_t st, sc, position, first;
    /* outputs of DL_IN (x: the attention input, q/kn/vn: after the rotary embedding), the
       attention output DL_OUT reads, and scratch */
    float *x, *q_rot, *kn, *vn, *attn;
    float *lin, *mid, *x2, *g, *u, *bias_rows;
    const struct dl_select *sel;  /* DL_CHOSEN / DL_SPECULATE / DL_OWN: decode_select.c */
    /* what runs those three modes: dl_select_step (decode_select.c), set by whoever sets sel;
       NULL: the call fails if they are asked for */
    int (*select_step)(const struct dl_args *a, int64_t mode);
    /* RMSNorm weights of q and k, applied after the projection and before the rotary
       embedding, or NULL: per head ([D], Qwen3), or over all of a token's heads at once
       when qk_full ([H D] and [KV D], OLMoE) */
    const float *q_norm, *k_norm;
    int64_t qk_full;
} dl_args;

/* InfiniGen inside the fused call (decode_select.c). Every field is 8 bytes wide. */
typedef struct dl_select {
    /* DL_CHOSEN: column c attends to rows index[c * n + i] (i < counts[c]) of kc / vc, then
       to its new token; the new row is written at `position` after */
    const int64_t *index, *counts;
    int64_t n;
    /* this layer's speculation keys: the new key projected by proj [B, KV, D, r] (batch
       stride proj_sb floats, 0: one for the batch) and packed at `position` (codes NULL:
       none) */
    const float *proj;
    int64_t proj_sb;
    uint8_t *codes;
    float *lo, *scale;
    int64_t L, P, r, bits;
    /* DL_SPECULATE: the next layer's query from x (its q weights nq, the rotary encoding of
       this step), projected per KV head (nproj [B, KV, D, nr], times 1/sqrt(D)), scored
       against its packed keys (ncodes [C, nL, nP], nlo / nscale [C, nL]) over the first T
       rows and chosen by the mass rule: order [C, width]. DL_OWN (--speculation-query own):
       the same fields hold this layer's own projection and packed keys, and the query is
       its own q_rot (no nq); the order is then this layer's index, chosen before it
       attends */
    dl_linear nq;
    const float *nproj;
    int64_t nproj_sb, nr;
    const uint8_t *ncodes;
    const float *nlo, *nscale;
    int64_t nL, nP, nbits;
    const uint8_t *visible;  /* [B, T]: the tokens that may be chosen */
    const int64_t *cap;      /* [C]: tokens each column keeps */
    int64_t *order;
    int64_t T, width;
    /* scratch: rows [C, r], lin and rot [B, H * D], pq [C, G, nr], packed [C, G, nP * 8 /
       nbits], qsum [C, G] */
    float *s_rows, *s_lin, *s_rot, *s_pq, *s_packed, *s_qsum;
    /* --speculation-query renorm: x * nscale_x (+ nshift_x) [hidden] is the next layer's
       norm of this layer's residual, taken by nq instead of x (nscale_x NULL: x itself);
       s_x [B, hidden] holds it */
    const float *nscale_x, *nshift_x;
    float *s_x;
} dl_select;

int dl_run_linear(const dl_linear *l, const float *x, float *out, int64_t M, int64_t nt);
int dl_select_step(const dl_args *a, int64_t mode);

#endif
