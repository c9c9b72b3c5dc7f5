/* The float16-factor 4-bit row products shared by linear_h16.c (linear_q4_h16) and
   moe_experts.c (a token's routed experts in one call): float16 widening, the rows of x
   rounded to 16 bits per 64 values (h16_prepare), and one output row's product. */
#ifndef FLEXGEN_INFINIGEN_LINEAR_H16_H
#define FLEXGEN_INFINIGEN_LINEAR_H16_H
#include "common.h"

/* A float16's bits as the float32 of the same value. */
static inline float h16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    uint32_t bits;
    if (e == 0x1F) {         /* infinity or NaN */
        bits = sign | 0x7F800000u | (m << 13);
    } else if (e != 0) {     /* normal: rebias the exponent (15 -> 127) */
        bits = sign | ((e + 112) << 23) | (m << 13);
    } else if (m == 0) {     /* zero */
        bits = sign;
    } else {                 /* subnormal: m * 2^-24, normal in float32 */
        int shift = 0;
        uint32_t mm = m;
        while (!(mm & 0x400)) {
            mm <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mm & 0x3FF) << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
#endif
}

/* n float16s from src widened into dst. */
static inline void h16_widen(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++)
        dst[i] = h16_to_f32(src[i]);
}

/* Eight float16s widened; past n (< 8), zeros. */
static inline v8 h16_load8(const uint16_t *p, int64_t n) {
    uint16_t pad[8] = {0};
    if (n < 8) {
        for (int64_t i = 0; i < n; i++)
            pad[i] = p[i];
        p = pad;
    }
#ifdef __F16C__
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    v8 r;
    for (int i = 0; i < 8; i++)
        r[i] = h16_to_f32(p[i]);
    return r;
#endif
}

#ifdef __AVX2__
#define H16_AHEAD 4096  /* codes asked for this many bytes ahead, as linear.c's Q4_AHEAD */

/* The last n < 8 float16s of a row widened, zeros past them: the same lanes as h16_load8.
   With at least 8 - n values of the row before p (`before`), the eight that end at p + n are
   loaded and moved down in registers; h16_load8's copy into a padded buffer is a narrow
   store read back wide, which waits for the store to land (it was a quarter of a batch's
   product time on rows of 18 groups). */
static inline v8 h16_tail8(const uint16_t *p, int64_t n, int64_t before) {
#ifdef __F16C__
    if (before + n < 8)
        return h16_load8(p, n);
    const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + n - 8)));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 moved = _mm256_permutevar8x32_ps(
        w, _mm256_add_epi32(lane, _mm256_set1_epi32((int)(8 - n))));
    return (v8)_mm256_and_ps(moved, _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane)));
#else
    (void)before;
    return h16_load8(p, n);
#endif
}

/* The end of an output row: the sums plus minimum . xsum (xsum padded with zeros to a
   multiple of 8 groups, the last minima read as zeros past the row, as linear.c's masked
   read), across lanes, plus the bias. */
static inline float h16_finish(v8 acc, const uint16_t *mo, const float *xsum, int64_t G,
                               float bias) {
    int64_t g = 0;
    for (; g + 8 <= G; g += 8)
        acc += h16_load8(mo + g, 8) * load8(xsum + g);
    if (g < G)
        acc += h16_tail8(mo + g, G - g, g) * load8(xsum + g);
    return hsum8(acc) + bias;
}

/* Block g's float16 scales widened to its eight lanes of sums: one scale in all eight
   (groups of 64), or the two groups' scales four lanes each (groups of 32). A block's
   factors (linear.c's q4_scales) are these times the step of x's block. */
static inline v8 h16_scale_lanes(const uint16_t *so, int64_t g, int64_t group) {
    if (group == 64)
        return splat8(h16_to_f32(so[g]));
#ifdef __F16C__
    uint32_t two;  /* both scales in one load and one widening */
    __builtin_memcpy(&two, so + 2 * g, 4);
    const __m256 ab = _mm256_cvtph_ps(_mm_cvtsi32_si128((int)two));
    return (v8)_mm256_permutevar8x32_ps(ab, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
#else
    const float a = h16_to_f32(so[2 * g]), b = h16_to_f32(so[2 * g + 1]);
    return (v8){a, a, a, a, b, b, b, b};
#endif
}

/* One output row for 2 <= M <= 8 rows of x in 16-bit planes (linear.c's q4_rows). */
static inline __attribute__((always_inline)) void h16_q4_rows(
        const int64_t M, const uint8_t *co, const uint16_t *so, const uint16_t *mo,
        float bias,
        float *out, const int16_t *xq, const float *xs, const float *xsum, int64_t N,
        int64_t K, int64_t group) {
    const int64_t G = K / 64, GW = K / group, GP = (GW + 7) / 8 * 8;
    const __m256i nibble = _mm256_set1_epi16(0x000F);
    v8 acc[8] = {{0}};
    for (int64_t g = 0; g < G; g++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(co + g * 32));
        __builtin_prefetch(co + g * 32 + H16_AHEAD, 0, 3);
        const __m256i c0 = _mm256_and_si256(c, nibble);
        const __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
        const __m256i c2 = _mm256_and_si256(_mm256_srli_epi16(c, 8), nibble);
        const __m256i c3 = _mm256_srli_epi16(c, 12);
        const v8 sc = h16_scale_lanes(so, g, group);
        for (int64_t m = 0; m < M; m++) {
            const __m256i p = q4_block_planes(
                c0, c1, c2, c3, (const __m256i *)(xq + m * K + g * 64));
            acc[m] = q4_accumulate(acc[m], p, sc * splat8(xs[m * G + g]));
        }
    }
    for (int64_t m = 0; m < M; m++)
        out[m * N] = h16_finish(acc[m], mo, xsum + m * GP, GW, bias);
}

/* One output row for one row of x by byte products (linear.c's q4_row1). */
static inline __attribute__((always_inline)) float h16_q4_row1(
        const uint8_t *co, const uint16_t *so, const uint16_t *mo, float bias, const int8_t *xb,
        const float *xs, const float *xsum, int64_t K, int64_t group) {
    const int64_t G = K / 64, GW = K / group;
    v8 acc = {0};
    for (int64_t g = 0; g < G; g++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(co + g * 32));
        __builtin_prefetch(co + g * 32 + H16_AHEAD, 0, 3);
        const __m256i p = q4_block_bytes(c, (const __m256i *)(xb + g * 128));
        acc = q4_accumulate(acc, p, h16_scale_lanes(so, g, group) * splat8(xs[g]));
    }
    return h16_finish(acc, mo, xsum, GW, bias);
}
#else
/* Portable: one output row against one row of x, a group at a time in floats. */
static inline float h16_q4_plain(const uint8_t *co, const uint16_t *so, const uint16_t *mo,
                          float bias, const float *x, int64_t K, int64_t group) {
    float total = 0.0f;
    for (int64_t g = 0; g < K / group; g++) {
        const uint8_t *c = co + g * group / 2;
        const float *xg = x + g * group;
        float dot = 0.0f, sum = 0.0f;
        for (int64_t j = 0; j < group / 2; j++) {
            dot += (float)(c[j] & 0x0F) * xg[2 * j] + (float)(c[j] >> 4) * xg[2 * j + 1];
            sum += xg[2 * j] + xg[2 * j + 1];
        }
        total += dot * h16_to_f32(so[g]) + sum * h16_to_f32(mo[g]);
    }
    return total + bias;
}
#endif

#ifdef __AVX2__
/* Bytes of h16_prepare's scratch for M rows of K values. */
static inline size_t h16_prepare_bytes(int64_t M, int64_t K, int64_t group) {
    const int64_t G = K / 64, GW = K / group, GP = (GW + 7) / 8 * 8;
    return 2 * M * K + sizeof(float) * M * (G + GP) + 64;
}

/* Where h16_prepare puts its parts in scratch (of h16_prepare_bytes). */
static inline void h16_layout(void *scratch, int64_t M, int64_t K, int16_t **xq, float **xs,
                              float **xsum) {
    *xq = (int16_t *)scratch;
    *xs = (float *)(*xq + ((M * K + 31) / 32) * 32);
    *xsum = *xs + M * (K / 64);
}

/* Block g (64 values) of row m of x as the row products read it (h16_prepare). */
static inline void h16_prepare_block(const float *x, int64_t M, int64_t K, int64_t group,
                                     int64_t m, int64_t g, int16_t *xq, float *xs,
                                     float *xsum) {
    const int64_t G = K / 64, GW = K / group, GP = (GW + 7) / 8 * 8;
    const float *xg = x + m * K + g * 64;
    float most = 0.0f, sum = 0.0f, half = 0.0f;
    for (int64_t i = 0; i < 64; i++) {
        most = fabsf(xg[i]) > most ? fabsf(xg[i]) : most;
        sum += xg[i];
        if (i == 31)
            half = sum;
    }
    const float step = most > 0.0f ? most / 32639.0f : 1.0f;
    if (M == 1) {
        int8_t *xb = (int8_t *)xq;
        for (int64_t i = 0; i < 64; i++) {
            const int v = (int)lrintf(xg[i] / step);
            const int64_t at = g * 128 + (i & 1) * 32 + i / 2;
            const int hi = (v + 128) >> 8;
            xb[at] = (int8_t)hi;
            xb[at + 64] = (int8_t)(v - 256 * hi);
        }
    } else {  /* plane p holds elements p, p + 4, ...: written a plane at a time */
        int16_t *out = xq + m * K + g * 64;
        for (int64_t p = 0; p < 4; p++)
            for (int64_t l = 0; l < 16; l++)
                out[p * 16 + l] = (int16_t)lrintf(xg[4 * l + p] / step);
    }
    xs[m * G + g] = step;
    if (group == 64) {
        xsum[m * GP + g] = sum;
    } else {
        float second = 0.0f;
        for (int64_t i = 32; i < 64; i++)
            second += xg[i];
        xsum[m * GP + 2 * g] = half;
        xsum[m * GP + 2 * g + 1] = second;
    }
    if (g == G - 1)  /* zeros past the last group, for h16_finish */
        for (int64_t w = GW; w < GP; w++)
            xsum[m * GP + w] = 0.0f;
}

/* The M rows of x as the row products read them, into scratch of h16_prepare_bytes: each
   block of 64 values rounded to 16-bit integers with one step (int16 planes for M > 1,
   byte halves for M == 1), the steps (xs) and the sums of each group of x (xsum, padded
   with zeros to a multiple of 8 groups). */
static inline void h16_prepare(const float *x, int64_t M, int64_t K, int64_t group,
                               void *scratch, int16_t **xq_out, float **xs_out,
                               float **xsum_out) {
    h16_layout(scratch, M, K, xq_out, xs_out, xsum_out);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / 64; g++)
            h16_prepare_block(x, M, K, group, m, g, *xq_out, *xs_out, *xsum_out);
}
#endif

#endif
