#include "common.h"

/* out[m, o] = sum_k x[m, k] * w[o, k] (+ bias[o]): a decode step's linear layer, each weight
   row read once and dotted with every row of x while it is in cache. Four weight rows at a
   time, so that four independent sums hide the multiply-add latency. */
static inline __attribute__((always_inline)) void dot4(const float *x, const float *w,
                                                       int64_t K, float *acc) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        const float xk = x[k];
        a0 += w0[k] * xk; a1 += w1[k] * xk; a2 += w2[k] * xk; a3 += w3[k] * xk;
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
}

/* Two rows of x against four weight rows. Each call also asks for the weight rows two
   blocks on (into L2), so that the memory works while the block computes; with several
   pairs a block the same rows are asked for again, which is what helps: asked once a block,
   the step took as long as not asking (an ask made while every fill buffer is busy is
   dropped); once a pair, 18-22% less at batch 8 (benchmarks/decode_kernels.py, linear).
   Rows past the weight are never read: a prefetch does not fault. */
static inline __attribute__((always_inline)) void dot4x2(const float *x, const float *y,
                                                         const float *w, int64_t K,
                                                         float *acc) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f,
          b3 = 0.0f;
    for (int64_t k = 0; k < 4 * K; k += 16)  /* the weights two blocks on, into L2 */
        __builtin_prefetch(w + 8 * K + k, 0, 2);
    for (int64_t k = 0; k < K; k++) {
        const float xk = x[k], yk = y[k];
        a0 += w0[k] * xk; a1 += w1[k] * xk; a2 += w2[k] * xk; a3 += w3[k] * xk;
        b0 += w0[k] * yk; b1 += w1[k] * yk; b2 += w2[k] * yk; b3 += w3[k] * yk;
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
    acc[4] = b0; acc[5] = b1; acc[6] = b2; acc[7] = b3;
}

void linear_rows(const float *x, const float *w, const float *bias, float *out, int64_t M,
                 int64_t N, int64_t K, int64_t nthreads) {
    const int64_t blocks = N / 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < blocks; b++) {
        float acc[8];
        int64_t m = 0;
        for (; m + 1 < M; m += 2) {  /* two rows of x against the four weight rows */
            dot4x2(x + m * K, x + (m + 1) * K, w + 4 * b * K, K, acc);
            for (int64_t i = 0; i < 4; i++) {
                const float add = bias ? bias[4 * b + i] : 0.0f;
                out[m * N + 4 * b + i] = acc[i] + add;
                out[(m + 1) * N + 4 * b + i] = acc[4 + i] + add;
            }
        }
        for (; m < M; m++) {
            dot4(x + m * K, w + 4 * b * K, K, acc);
            for (int64_t i = 0; i < 4; i++)
                out[m * N + 4 * b + i] = acc[i] + (bias ? bias[4 * b + i] : 0.0f);
        }
    }
    for (int64_t o = 4 * blocks; o < N; o++)
        for (int64_t m = 0; m < M; m++) {
            float a = 0.0f;
            for (int64_t k = 0; k < K; k++)
                a += w[o * K + k] * x[m * K + k];
            out[m * N + o] = a + (bias ? bias[o] : 0.0f);
        }
}


#ifdef __AVX2__
/* Output rows o .. o + P (P <= 2) of linear_q4 for M <= 8 rows of x (see below). */
static inline __attribute__((always_inline)) void q4_rows(
        const int64_t M, const uint8_t *codes, const float *scale, const float *minimum,
        const float *bias, float *out, const int16_t *xq, const float *xs, const float *xsum,
        int64_t o, int64_t P, int64_t N, int64_t K) {
    const int64_t G = K / 64;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int64_t r = 0; r < P; r++) {
        const uint8_t *co = codes + (o + r) * G * 32;
        const float *so = scale + (o + r) * G, *mo = minimum + (o + r) * G;
        v8 acc[8] = {{0}};
        for (int64_t g = 0; g < G; g++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(co + g * 32));
            const __m256i even = _mm256_and_si256(c, nibble);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
            /* the group's 64 codes as 16-bit integers: evens 0-15, 16-31, odds 0-15, 16-31 */
            const __m256i e0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(even));
            const __m256i e1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(even, 1));
            const __m256i o0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(odd));
            const __m256i o1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(odd, 1));
            for (int64_t m = 0; m < M; m++) {
                const __m256i *q = (const __m256i *)(xq + m * K + g * 64);
                const __m256i p = _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_madd_epi16(e0, _mm256_loadu_si256(q)),
                                     _mm256_madd_epi16(e1, _mm256_loadu_si256(q + 1))),
                    _mm256_add_epi32(_mm256_madd_epi16(o0, _mm256_loadu_si256(q + 2)),
                                     _mm256_madd_epi16(o1, _mm256_loadu_si256(q + 3))));
                acc[m] += (v8)_mm256_cvtepi32_ps(p) * splat8(so[g] * xs[m * G + g]);
            }
        }
        for (int64_t m = 0; m < M; m++) {
            v8 lo = {0};  /* the minimum's share: minimum . (sums of x per group) */
            int64_t g = 0;
            for (; g + 8 <= G; g += 8)
                lo += load8(mo + g) * load8(xsum + m * G + g);
            float rest = 0.0f;
            for (; g < G; g++)
                rest += mo[g] * xsum[m * G + g];
            const v8 a = acc[m] + lo;
            const float s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
            out[m * N + o + r] = s + rest + (bias ? bias[o + r] : 0.0f);
        }
    }
}
#endif

/* out[m, o] = sum_k x[m, k] * w[o, k] (+ bias[o]) for 4-bit group-quantized weights (the
   runtime's --compress-weight format): w[o, k] = code * scale[o, g] + minimum[o, g] for group
   g = k / 64; codes [N, K / 64, 32] bytes, element 2j of a group in the low nibble of byte j,
   2j + 1 in the high one. The weights are read as they are stored (a quarter of their float
   bytes), never expanded in memory.

   With AVX2: each row of x is rounded to 16-bit integers per group of 64 (max |x| to 32767)
   and laid out even elements then odd ones; a group's codes, widened to 16 bits once for all
   rows of x, multiply it with 16-bit products (vpmaddwd: every sum exact in 32 bits); the
   sums are scaled per group and accumulated in floats; the minimum's share is minimum .
   (sum of x over the group), exact. (Rounding x to 8 bits, for byte products, was cheaper
   but lost the small entries of a group that holds an outlier: up to 12% error in SmolLM2's
   key projections.) Returns 0 when it cannot run (no AVX2). */
int linear_q4(const float *x, const uint8_t *codes, const float *scale, const float *minimum,
              const float *bias, float *out, int64_t M, int64_t N, int64_t K,
              int64_t nthreads) {
#ifdef __AVX2__
    const int64_t G = K / 64;
    static __thread void *buf;
    static __thread size_t have;
    int16_t *xq = (int16_t *)thread_scratch(&buf, &have, 2 * M * K + 2 * sizeof(float) * M * G
                                                         + 64);
    if (!xq)
        return 0;
    float *xs = (float *)(xq + ((M * K + 31) / 32) * 32), *xsum = xs + M * G;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const float *xg = x + m * K + g * 64;
            float most = 0.0f, sum = 0.0f;
            for (int64_t i = 0; i < 64; i++) {
                most = fabsf(xg[i]) > most ? fabsf(xg[i]) : most;
                sum += xg[i];
            }
            const float step = most > 0.0f ? most / 32767.0f : 1.0f;
            int16_t *q = xq + m * K + g * 64;
            for (int64_t j = 0; j < 32; j++) {
                q[j] = (int16_t)lrintf(xg[2 * j] / step);
                q[32 + j] = (int16_t)lrintf(xg[2 * j + 1] / step);
            }
            xs[m * G + g] = step;
            xsum[m * G + g] = sum;
        }
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t o = 0; o < N; o += 2) {
        const int64_t pair = o + 1 < N ? 2 : 1;
        for (int64_t m = 0; m < M; m += 8) {  /* constant row counts: sums in registers */
            float *om = out + m * N;
            const int16_t *xm = xq + m * K;
            const float *sm = xs + m * G, *tm = xsum + m * G;
#define Q4(R) q4_rows(R, codes, scale, minimum, bias, om, xm, sm, tm, o, pair, N, K); break
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
    (void)N; (void)K; (void)nthreads;
    return 0;
#endif
}
