#include <string.h>

#include "common.h"
#include "gguf_dot.h"
#include "linear_h16.h"

/* Linear layers over GGUF blocks as the file stores them: activations are quantized per
   block to 8 bits (x = d * q, q in [-127, 127]), and each weight block meets them in
   integer dot products, as the formats were designed for. Nothing of the weight is widened
   or reordered; a float product is taken once per block (or per 32 values), not per value.

   Two activation forms, matching the weight's block:
   - xq_k for the K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256): one scale per 256
     values, the sums of each 16 codes (Q6_K's offset meets them) and, as floats, d times
     the sum of each 32 (Q4_K's and Q5_K's minima meet them);
   - xq_32 for the plain types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32): one scale per
     32 values, and d times their sum (the offset or minimum meets it).
   Integer sums cannot overflow: a 4-bit code times 127, summed over a super-block and
   times a 6-bit scale, stays under 2^23; a 6-bit one under 2^25. Two products of codes
   summed fit 16 bits (2 * 63 * 127 < 2^15), as the pair-summing multiply needs. */

typedef struct {
    float d;
    int8_t qs[256];
    int16_t bsums[16];
    float msum[8];
} xq_k;

typedef struct {
    float d, dsum;
    int8_t qs[32];
} xq_32;

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h16_to_f32(h);
}

/* The tiles compiled in: AVX-512 (BW) ones when the compiler targets it (two weight rows
   against eight rows of x), else AVX2 ones (one weight row against four), else the portable
   loop. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define GD512 1
#endif

/* ---- activations ----------------------------------------------------------------------- */

/* n values as codes q = round(x / d), d = max |x| / 127 (0 codes for a block of zeros);
   returns d. */
static float quantize_run(const float *x, int64_t n, int8_t *q) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t i = 0; i < n; i++)
        q[i] = (int8_t)nearbyintf(x[i] * id);
    return d;
}

static void quantize_k(const float *x, int64_t K, xq_k *out) {
    for (int64_t b = 0; b < K / 256; b++) {
        xq_k *y = out + b;
        y->d = quantize_run(x + 256 * b, 256, y->qs);
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++)
                s += y->qs[16 * g + i];
            y->bsums[g] = (int16_t)s;
        }
        for (int j = 0; j < 8; j++)
            y->msum[j] = y->d * (float)(y->bsums[2 * j] + y->bsums[2 * j + 1]);
    }
}

static void quantize_32(const float *x, int64_t K, xq_32 *out) {
    for (int64_t b = 0; b < K / 32; b++) {
        xq_32 *y = out + b;
        y->d = quantize_run(x + 32 * b, 32, y->qs);
        int s = 0;
        for (int i = 0; i < 32; i++)
            s += y->qs[i];
        y->dsum = y->d * (float)s;
    }
}

/* The eight 6-bit scales and minima of a K-quant super-block (12 bytes): bytes 0-3 hold
   scales 0-3, 4-7 minima 0-3 (low six bits); scales and minima 4-7 take their low four
   bits from bytes 8-11 and their top two from the spare bits of bytes 0-7. */
static inline void k_scales(const uint8_t *p, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63;
        mn[j] = p[j + 4] & 63;
        sc[j + 4] = (p[j + 8] & 0x0F) | ((p[j] >> 6) << 4);
        mn[j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
}

/* The minimum's share of a K-quant super-block: sum over its eight 32-value sub-blocks of
   minimum * (sum of x's codes there). */
static inline int k_min_dot(const uint8_t *mn, const int16_t *bsums) {
    int s = 0;
    for (int j = 0; j < 8; j++)
        s += mn[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return s;
}

/* MXFP4's block factor from its exponent byte: 2^(e - 128) (half of E8M0's 2^(e - 127),
   its codes naming twice the FP4 values), built from its bits; e < 2 is a subnormal. */
static inline float mxfp4_factor(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* MXFP4's sixteen values, what a code names (twice FP4 E2M1's), as a shuffle's table. The
   tiles multiply them signed, as Q8_0's codes (|q| against x with q's sign), not as an
   unsigned value and an offset taken back through x's block sum: the offset's term is 12
   times the block's sum, and subtracting it in floats loses bits the signed form keeps */
#define MXFP4_TABLE 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12

/* How a tile asks for weight bytes ahead (ahead): not at all (0), for one pass over the
   weight (ASK_STREAM), or for a first pass that later passes follow (ASK_REUSE). */
enum { ASK_STREAM = 1, ASK_REUSE = 2 };


#include "gguf_tiles_avx2.h"
#include "gguf_tiles_avx512.h"
#include "gguf_tiles_avx512_one.h"
#include "gguf_tiles_portable.h"

/* ---- the table of formats, and the layer ----------------------------------------------- */

typedef void (*tile_fn)(const uint8_t *, const uint8_t *, int64_t, int, int64_t, int, float *);

static const gguf_format FORMATS[] = {
    {GT_Q4_0, 18, 32}, {GT_Q4_1, 20, 32}, {GT_Q5_0, 22, 32}, {GT_Q5_1, 24, 32},
    {GT_Q8_0, 34, 32}, {GT_Q4_K, 144, 256}, {GT_Q5_K, 176, 256}, {GT_Q6_K, 210, 256},
    {GT_MXFP4, 17, 32},
};

const gguf_format *gguf_format_of(int64_t type) {
    for (size_t i = 0; i < sizeof(FORMATS) / sizeof(FORMATS[0]); i++)
        if (FORMATS[i].type == type)
            return FORMATS + i;
    return NULL;
}

/* One weight row against up to four rows of x: the AVX2 tiles (also in an AVX-512 build,
   for Q8_0 against one or two rows of x: see gguf_linear_q), or NULL: the portable loop. */
static tile_fn tile_of(int64_t type) {
#ifdef __AVX2__
    switch (type) {
        case GT_Q4_K: return run_q4_k;
        case GT_Q5_K: return run_q5_k;
        case GT_Q6_K: return run_q6_k;
        case GT_Q4_0: return run_q4_0;
        case GT_Q4_1: return run_q4_1;
        case GT_Q5_0: return run_q5_0;
        case GT_Q5_1: return run_q5_1;
        case GT_Q8_0: return run_q8_0;
        case GT_MXFP4: return run_mxfp4;
    }
#endif
    (void)type;
    return NULL;
}

#ifdef GD512
typedef void (*tile2_fn)(const uint8_t *, const uint8_t *, const uint8_t *, int64_t, int,
                         int64_t, int, float *);
static tile2_fn tile2_of(int64_t type) {
    switch (type) {
        case GT_Q4_K: return run2_q4_k;
        case GT_Q5_K: return run2_q5_k;
        case GT_Q6_K: return run2_q6_k;
        case GT_Q4_0: return run2_q4_0;
        case GT_Q4_1: return run2_q4_1;
        case GT_Q5_0: return run2_q5_0;
        case GT_Q5_1: return run2_q5_1;
        case GT_Q8_0: return run2_q8_0;
        case GT_MXFP4: return run2_mxfp4;
    }
    return NULL;
}
#endif

int64_t gguf_act_bytes(int64_t type, int64_t K) {
    const gguf_format *f = gguf_format_of(type);
    if (f == NULL || K % f->values)
        return 0;
    return f->values == 256 ? K / 256 * (int64_t)sizeof(xq_k) : K / 32 * (int64_t)sizeof(xq_32);
}

void gguf_quantize_act(int64_t type, const float *x, int64_t M, int64_t K, uint8_t *xq,
                       int64_t nthreads) {
    const gguf_format *f = gguf_format_of(type);
    const int64_t row = gguf_act_bytes(type, K);
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        if (f->values == 256)
            quantize_k(x + m * K, K, (xq_k *)(xq + m * row));
        else
            quantize_32(x + m * K, K, (xq_32 *)(xq + m * row));
    }
}

/* out[m, o] = x[m] . W[order ? order[o] : o] (+ bias[o]) with x already quantized (xq, rows
   gguf_act_bytes apart). x's rows are taken in chunks that stay in the core's L2 while every
   weight row passes them (a weight row is read once a chunk, not once a row of x); within a
   chunk a tile takes one weight row and four rows of x (AVX-512: two weight rows and eight
   rows of x). Threads split the output rows: one parallel region a chunk. */
int gguf_linear_q(int64_t type, const uint8_t *w, const int32_t *order, const uint8_t *xq,
                  const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                  int64_t nthreads) {
    const gguf_format *f = gguf_format_of(type);
    if (f == NULL || K % f->values)
        return 0;
    const int64_t nb = K / f->values, wrow = nb * f->bytes, xrow = gguf_act_bytes(type, K);
#ifdef GD512
    const tile2_fn tile2 = tile2_of(type);
    /* Q8_0's blocks are small (34 bytes), and the two-row tile widens and spreads two
       factors a block: with one or two rows of x (a decode step) that work, not memory,
       sets the pace, and the one-row AVX2 tile reads the weight faster */
    const int few = M <= 2 && type == GT_Q8_0 && tile_of(type) != NULL;
#ifdef GD512_ONE
    /* one row of x against a K-quant: the one-row tile, whose floats equal the two-row
       tile's for that row (see gguf_tiles_avx512_one.h) */
    const tile1_fn one = M == 1 ? tile1_of(type) : NULL;
    if (one != NULL) {
        #pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t o = 0; o < N; o++)
            out[o] = one(w + (int64_t)(order ? order[o] : o) * wrow, xq, nb) +
                     (bias ? bias[o] : 0.0f);
        return 1;
    }
#endif
    if (tile2 != NULL && !few) {
        /* half of L2: the rest holds the weight rows in use and what the other thread's
           output and the hardware's read-ahead bring in */
        int64_t chunk = (512 * 1024 / xrow) / X512 * X512;
        if (chunk < X512)
            chunk = X512;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
            #pragma omp parallel for schedule(static) num_threads(nthreads)
            for (int64_t p = 0; p < (N + 1) / 2; p++) {
                const int64_t o = 2 * p;
                const int wr = N - o < 2 ? 1 : 2;  /* a last odd row goes in as both rows */
                const uint8_t *w0 = w + (int64_t)(order ? order[o] : o) * wrow;
                const uint8_t *w1 = wr == 2 ? w + (int64_t)(order ? order[o + 1] : o + 1) * wrow
                                            : w0;
                for (int64_t r = 0; r < mc; r += X512) {
                    const int xr = mc - r < X512 ? (int)(mc - r) : X512;
                    float res[2 * X512];
                    tile2(w0, w1, xq + (m0 + r) * xrow, xrow, xr, nb, r == 0, res);
                    for (int i = 0; i < wr; i++)
                        for (int k = 0; k < xr; k++)
                            out[(m0 + r + k) * N + o + i] = res[X512 * i + k] +
                                                            (bias ? bias[o + i] : 0.0f);
                }
            }
        }
        return 1;
    }
#endif
    /* one weight row against four rows of x: the AVX2 tiles, or the portable loop for a
       type without a tile here */
    const tile_fn tile = tile_of(type);
    int64_t chunk = (256 * 1024 / xrow) & ~(int64_t)3;
    if (chunk < 4)
        chunk = 4;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
        #pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t o = 0; o < N; o++) {
            const uint8_t *wo = w + (int64_t)(order ? order[o] : o) * wrow;
            const float add = bias ? bias[o] : 0.0f;
            for (int64_t r = 0; r < mc; r += 4) {
                const int xr = mc - r < 4 ? (int)(mc - r) : 4;
                float res[4];
                const uint8_t *xr0 = xq + (m0 + r) * xrow;
                if (tile)
                    tile(wo, xr0, xrow, xr, nb, mc <= 4 ? ASK_STREAM : r == 0 ? ASK_REUSE : 0,
                         res);
                else
                    run_portable(type, wo, xr0, xrow, xr, nb, res);
                for (int i = 0; i < xr; i++)
                    out[(m0 + r + i) * N + o] = res[i] + add;
            }
        }
    }
    return 1;
}

int gguf_linear(int64_t type, const uint8_t *w, const int32_t *order, const float *x,
                const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                int64_t nthreads) {
    const int64_t row = gguf_act_bytes(type, K);
    if (row == 0)
        return 0;
    uint8_t *xq = malloc((size_t)(M * row));
    if (xq == NULL)
        return 0;
    gguf_quantize_act(type, x, M, K, xq, nthreads);
    const int ok = gguf_linear_q(type, w, order, xq, bias, out, M, N, K, nthreads);
    free(xq);
    return ok;
}

/* Rows of a weight as floats (an embedding lookup; the reference path): out[i] = row
   rows[i] of W, every value factor * code + minimum as the format defines it. */
int gguf_dequantize_rows(int64_t type, const uint8_t *w, const int64_t *rows, int64_t n,
                         int64_t K, float *out, int64_t nthreads) {
    const gguf_format *f = gguf_format_of(type);
    if (f == NULL || K % f->values)
        return 0;
    const int64_t nb = K / f->values, wrow = nb * f->bytes;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (n * K >= 65536)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *wr = w + rows[i] * wrow;
        for (int64_t b = 0; b < nb; b++) {
            int16_t q[256];
            float factor[16], minimum[16];
            const int group = unpack_block(type, wr + f->bytes * b, q, factor, minimum);
            float *o = out + i * K + b * f->values;
            for (int v = 0; v < f->values; v++)
                o[v] = factor[v / group] * (float)q[v] + minimum[v / group];
        }
    }
    return 1;
}
