#include "common.h"
#include "linear_h16.h"

/* out[m, o] = sum_k x[m, k] * w[o, k] (+ bias[o]): a decode step's linear layer in floats,
   each weight row read from memory once and dotted with every row of x while it is in cache.
   A block of WR weight rows meets XR rows of x at a time (WR x XR sums in registers, each
   weight vector loaded once for the XR rows, each x vector once for the WR rows): four
   weight rows for one or two rows of x, two for three or more, in passes of up to four rows
   of x (more weight rows per block would spill the sums out of the sixteen vector
   registers once x has three rows or more). The first pass over a block asks for the weight rows two
   blocks on into L2, one ask a line, so that memory works while the block computes; rows
   past the weight are never read (a prefetch does not fault). */
static inline __attribute__((always_inline)) void rows_block(
        const int WR, const int XR, const float *x, const float *w, int64_t K, int ask,
        float *acc) {
    v8 a[4][4];
    for (int i = 0; i < WR; i++)
        for (int r = 0; r < XR; r++)
            a[i][r] = splat8(0.0f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if (ask && (k & 15) == 0)
            for (int i = 0; i < WR; i++)
                __builtin_prefetch(w + (i + 2 * WR) * K + k, 0, 2);
        v8 xv[4];
        for (int r = 0; r < XR; r++)
            xv[r] = load8(x + r * K + k);
        for (int i = 0; i < WR; i++) {
            const v8 q = load8(w + i * K + k);
            for (int r = 0; r < XR; r++)
                a[i][r] += q * xv[r];
        }
    }
    for (int r = 0; r < XR; r++)
        for (int i = 0; i < WR; i++) {
            float t = hsum8(a[i][r]);
            for (int64_t j = k; j < K; j++)
                t += w[i * K + j] * x[r * K + j];
            acc[r * WR + i] = t;
        }
}

/* Weight rows o .. o + WR against every row of x, in passes of up to four rows. */
static inline __attribute__((always_inline)) void rows_all(
        const int WR, const float *x, const float *w, const float *bias, float *out,
        int64_t o, int64_t M, int64_t N, int64_t K) {
    float acc[16];
    for (int64_t m = 0; m < M; m += 4) {
        const int64_t n = M - m < 4 ? M - m : 4;
        const float *xm = x + m * K, *wo = w + o * K;
        switch (n) {  /* constant sizes: the sums stay in registers */
            case 1: rows_block(WR, 1, xm, wo, K, m == 0, acc); break;
            case 2: rows_block(WR, 2, xm, wo, K, m == 0, acc); break;
            case 3: rows_block(WR, 3, xm, wo, K, m == 0, acc); break;
            default: rows_block(WR, 4, xm, wo, K, m == 0, acc);
        }
        for (int64_t r = 0; r < n; r++)
            for (int64_t i = 0; i < WR; i++)
                out[(m + r) * N + o + i] = acc[r * WR + i] + (bias ? bias[o + i] : 0.0f);
    }
}

void linear_rows(const float *x, const float *w, const float *bias, float *out, int64_t M,
                 int64_t N, int64_t K, int64_t nthreads) {
    const int64_t wr = M <= 2 ? 4 : 2, blocks = N / wr;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < blocks; b++) {
        if (wr == 4)
            rows_all(4, x, w, bias, out, 4 * b, M, N, K);
        else
            rows_all(2, x, w, bias, out, 2 * b, M, N, K);
    }
    for (int64_t o = wr * blocks; o < N; o++)
        for (int64_t m = 0; m < M; m++) {
            float a = 0.0f;
            for (int64_t k = 0; k < K; k++)
                a += w[o * K + k] * x[m * K + k];
            out[m * N + o] = a + (bias ? bias[o] : 0.0f);
        }
}


#ifdef __AVX2__
/* Codes are asked for this many bytes ahead, into L1: a thread's rows are one stream, yet
   with one row of x (little arithmetic a byte) the hardware's own read-ahead does not keep
   memory busy; one page ahead covers memory's latency without evicting the block in use
   (benchmarks/decode_kernels.py times the choice). Past the weight's end an ask does not
   fault. */
#define Q4_AHEAD 4096

/* The end of output row o for one row of x: the float sums acc, plus the minimum's share
   (minimum[o, :] . xsum, xsum padded with zeros to GP; the row's last groups read with a
   mask), summed across lanes, plus the bias. */
static inline float q4_finish(v8 acc, const float *mo, const float *xsum, int64_t G,
                              __m256i tail, float bias) {
    int64_t g = 0;
    for (; g + 8 <= G; g += 8)
        acc += load8(mo + g) * load8(xsum + g);
    if (g < G)
        acc += (v8)_mm256_maskload_ps(mo + g, tail) * load8(xsum + g);
    return hsum8(acc) + bias;
}

/* The factor of 64-value block g's integer sums: the block's weight scale times x's step.
   Each 32-bit lane of the sums covers elements 8i .. 8i + 7 of the block, so with groups of
   32 lanes 0-3 take the first group's scale and lanes 4-7 the second's. */
static inline v8 q4_scales(const float *so, int64_t g, int64_t group, float step) {
    if (group == 64)
        return splat8(so[g] * step);
    const float a = so[2 * g], b = so[2 * g + 1];
    return (v8){a, a, a, a, b, b, b, b} * splat8(step);
}

/* Output rows o .. o + P (P <= 2) of linear_q4 for 2 <= M <= 8 rows of x, whose 16-bit
   values are laid out in planes (see below). Seen as 16 16-bit lanes, a group's 32 bytes of
   codes hold elements 4l .. 4l + 3 in lane l, a nibble each: four shifts and masks widen
   them (nothing crosses a lane), and plane t holds x[4l + t] in lane l. */
static inline __attribute__((always_inline)) void q4_rows(
        const int64_t M, const uint8_t *codes, const float *scale, const float *minimum,
        const float *bias, float *out, const int16_t *xq, const float *xs, const float *xsum,
        int64_t o, int64_t P, int64_t N, int64_t K, int64_t group, __m256i tail) {
    const int64_t G = K / 64, GW = K / group, GP = (GW + 7) / 8 * 8;
    const __m256i nibble = _mm256_set1_epi16(0x000F);
    for (int64_t r = 0; r < P; r++) {
        const uint8_t *co = codes + (o + r) * G * 32;
        const float *so = scale + (o + r) * GW;
        v8 acc[8] = {{0}};
        for (int64_t g = 0; g < G; g++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(co + g * 32));
            __builtin_prefetch(co + g * 32 + Q4_AHEAD, 0, 3);
            const __m256i c0 = _mm256_and_si256(c, nibble);
            const __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
            const __m256i c2 = _mm256_and_si256(_mm256_srli_epi16(c, 8), nibble);
            const __m256i c3 = _mm256_srli_epi16(c, 12);
            for (int64_t m = 0; m < M; m++) {
                const __m256i p = q4_block_planes(
                    c0, c1, c2, c3, (const __m256i *)(xq + m * K + g * 64));
                acc[m] = q4_accumulate(acc[m], p, q4_scales(so, g, group, xs[m * G + g]));
            }
        }
        for (int64_t m = 0; m < M; m++)
            out[m * N + o + r] = q4_finish(acc[m], minimum + (o + r) * GW, xsum + m * GP, GW,
                                           tail, bias ? bias[o + r] : 0.0f);
    }
}

/* Output rows o .. o + P of linear_q4 for one row of x, by byte products: x's 16-bit values
   split as 256 hi + lo (signed bytes: hi within +-127, lo -128 .. 127), and the codes,
   unsigned bytes after one mask or shift, multiply each (common.h's q4_block_bytes). Each
   32-bit lane sums elements 8i .. 8i + 7, as the 16-bit planes do: the same integers, the same float
   steps, so one row gives what it gives in any batch. Fewer operations a group than
   widening the codes, which matters when one row of x shares them. */
static inline __attribute__((always_inline)) void q4_row1(
        const uint8_t *codes, const float *scale, const float *minimum, const float *bias,
        float *out, const int8_t *xb, const float *xs, const float *xsum, int64_t o,
        int64_t P, int64_t K, int64_t group, __m256i tail) {
    const int64_t G = K / 64, GW = K / group;
    for (int64_t r = 0; r < P; r++) {
        const uint8_t *co = codes + (o + r) * G * 32;
        const float *so = scale + (o + r) * GW;
        v8 acc = {0};
        for (int64_t g = 0; g < G; g++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(co + g * 32));
            __builtin_prefetch(co + g * 32 + Q4_AHEAD, 0, 3);
            const __m256i p = q4_block_bytes(c, (const __m256i *)(xb + g * 128));
            acc = q4_accumulate(acc, p, q4_scales(so, g, group, xs[g]));
        }
        out[o + r] = q4_finish(acc, minimum + (o + r) * GW, xsum, GW, tail,
                               bias ? bias[o + r] : 0.0f);
    }
}
#endif

/* out[m, o] = sum_k x[m, k] * w[o, k] (+ bias[o]) for 4-bit group-quantized weights (the
   runtime's --compress-weight format, group 64, or a GGUF's Q4_0 / Q4_1 / Q4_K codes, group
   32): w[o, k] = code * scale[o, g] + minimum[o, g] for group g = k / group; codes
   [N, K / 2] bytes, element 2j of a group in the low nibble of its byte j, 2j + 1 in the
   high one (so two groups of 32 are laid out as one of 64). K is a multiple of 64. The
   weights are read as they are stored (a quarter of their float bytes), never expanded in
   memory.

   With AVX2: each row of x is rounded to 16-bit integers per group of 64 (max |x| to
   32639, so that q4_row1 can split them into two signed bytes), multiplied with the codes
   exactly in integers (q4_rows, q4_row1), the sums scaled per group and accumulated in
   floats; the minimum's share is minimum . (sum of x over the
   group), exact. (Rounding x to 8 bits, for byte products alone, is cheaper but loses the
   small entries of a group that holds an activation outlier, which moves key projections
   visibly.) Returns 0 when it cannot run (no AVX2). */
int linear_q4(const float *x, const uint8_t *codes, const float *scale, const float *minimum,
              const float *bias, float *out, int64_t M, int64_t N, int64_t K, int64_t group,
              int64_t nthreads) {
#ifdef __AVX2__
    if ((group != 64 && group != 32) || K % 64)
        return 0;
    const int64_t G = K / 64, GW = K / group, GP = (GW + 7) / 8 * 8;
    static __thread void *buf;
    static __thread size_t have;
    void *scratch = thread_scratch(&buf, &have, h16_prepare_bytes(M, K, group));
    if (!scratch)
        return 0;
    /* x rounded as linear_h16.h rounds it (shared: the same planes, steps and sums) */
    int16_t *xq;
    float *xs, *xsum;
    h16_prepare(x, M, K, group, scratch, &xq, &xs, &xsum);
    int8_t *xb = (int8_t *)xq;  /* one row: its bytes where the planes would be */
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(GW % 8)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < N; o += 2) {
        const int64_t pair = o + 1 < N ? 2 : 1;
        if (M == 1) {
            q4_row1(codes, scale, minimum, bias, out, xb, xs, xsum, o, pair, K, group, tail);
            continue;
        }
        for (int64_t m = 0; m < M; m += 8) {  /* constant row counts: sums in registers */
            float *om = out + m * N;
            const int16_t *xm = xq + m * K;
            const float *sm = xs + m * G, *tm = xsum + m * GP;
#define Q4(R) q4_rows(R, codes, scale, minimum, bias, om, xm, sm, tm, o, pair, N, K, group, \
                    tail); \
              break
            switch (M - m < 8 ? M - m : 8) {
                case 1: Q4(1); case 2: Q4(2); case 3: Q4(3); case 4: Q4(4);
                case 5: Q4(5); case 6: Q4(6); case 7: Q4(7); default: Q4(8);
            }
#undef Q4
        }
    }
    return 1;
#else
    (void)x; (void)codes; (void)scale; (void)minimum; (void)bias; (void)out; (void)M;
    (void)N; (void)K; (void)group; (void)nthreads;
    return 0;
#endif
}

/* out[m, o] = sum_k x[m, k] * w[o, k] (+ bias[o]) for weights kept as one signed byte a
   code (a GGUF's Q8_0, Q5_0, Q5_1, Q5_K, Q6_K): w[o, k] = code * scale[o, g] +
   minimum[o, g] for group g = k / group (group a multiple of 8, K a multiple of group);
   codes [N, K] int8. Per group the codes, widened to floats in registers, are dotted with
   x and scaled; the minimum adds minimum * (the group's sum of x). Plain C with vector
   types: AVX2 where the compiler targets it, whatever vector unit there is otherwise. Up
   to four rows of x share each load of the codes. Returns 0 when it cannot run. */
typedef int8_t c8 __attribute__((vector_size(8)));

static inline v8 widen8(const int8_t *p) {
#ifdef __AVX2__
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    c8 c;
    __builtin_memcpy(&c, p, 8);
    return __builtin_convertvector(c, v8);
#endif
}

static inline __attribute__((always_inline)) void q8_rows(
        const int XR, const float *x, const int8_t *co, const float *so, const float *mo,
        const float *xsum, int64_t K, int64_t group, float *acc) {
    const int64_t GW = K / group;
    v8 a[4];
    float lows[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < XR; r++)
        a[r] = splat8(0.0f);
    for (int64_t g = 0; g < GW; g++) {
        v8 part[4];
        for (int r = 0; r < XR; r++)
            part[r] = splat8(0.0f);
        for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
            const v8 w = widen8(co + k);
            for (int r = 0; r < XR; r++)
                part[r] += w * load8(x + r * K + k);
        }
        const v8 s = splat8(so[g]);
        for (int r = 0; r < XR; r++) {
            a[r] += part[r] * s;
            lows[r] += mo[g] * xsum[r * GW + g];
        }
    }
    for (int r = 0; r < XR; r++)
        acc[r] = hsum8(a[r]) + lows[r];
}

int linear_q8(const float *x, const int8_t *codes, const float *scale, const float *minimum,
              const float *bias, float *out, int64_t M, int64_t N, int64_t K, int64_t group,
              int64_t nthreads) {
    if (group % 8 || K % group)
        return 0;
    const int64_t GW = K / group;
    static __thread void *buf;
    static __thread size_t have;
    float *xsum = (float *)thread_scratch(&buf, &have, sizeof(float) * M * GW + 64);
    if (!xsum)
        return 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < GW; g++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < group; i++)
                sum += x[m * K + g * group + i];
            xsum[m * GW + g] = sum;
        }
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < N; o++) {
        const int8_t *co = codes + o * K;
        const float *so = scale + o * GW, *mo = minimum + o * GW;
        const float b = bias ? bias[o] : 0.0f;
        float acc[4];
        for (int64_t m = 0; m < M; m += 4) {
            const int64_t n = M - m < 4 ? M - m : 4;
            const float *xm = x + m * K, *sm = xsum + m * GW;
            switch (n) {  /* constant row counts: the sums stay in registers */
                case 1: q8_rows(1, xm, co, so, mo, sm, K, group, acc); break;
                case 2: q8_rows(2, xm, co, so, mo, sm, K, group, acc); break;
                case 3: q8_rows(3, xm, co, so, mo, sm, K, group, acc); break;
                default: q8_rows(4, xm, co, so, mo, sm, K, group, acc);
            }
            for (int64_t r = 0; r < n; r++)
                out[(m + r) * N + o] = acc[r] + b;
        }
    }
    return 1;
}

