#include "linear_h16.h"

/* linear_q4 and linear_q8 (linear.c) for weights whose scales and minima are held as
   float16 (a GGUF's factors are float16 values: half the bytes of float32 per group, the
   same values). The factors are widened where they are used (F16C where the compiler
   targets it, else a portable conversion), and the rows are multiplied as linear.c
   multiplies float32 factors: the same integer products and float steps in the same
   order, so the outputs match the float32 form's. */

/* Exported for the tests: n float16s widened (checks the portable conversion too). */
void h16_widen_rows(const uint16_t *src, float *dst, int64_t n) { h16_widen(src, dst, n); }

/* out[m, o] = sum_k x[m, k] * w[o, k] (+ bias[o]) for 4-bit codes as linear_q4 reads them
   (groups of 64 or 32, K a multiple of 64), with float16 scale and minimum [N, K / group].
   With AVX2 it computes what linear_q4 computes (x rounded to 16 bits per 64 values, exact
   integer products); without, a plain float loop. Returns 0 when it cannot run. */
int linear_q4_h16(const float *x, const uint8_t *codes, const uint16_t *scale,
                  const uint16_t *minimum, const float *bias, float *out, int64_t M, int64_t N,
                  int64_t K, int64_t group, int64_t nthreads) {
    if ((group != 64 && group != 32) || K % 64)
        return 0;
    const int64_t GW = K / group;
#ifdef __AVX2__
    const int64_t G = K / 64, GP = (GW + 7) / 8 * 8;
    static __thread void *buf;
    static __thread size_t have;
    void *scratch = thread_scratch(&buf, &have, h16_prepare_bytes(M, K, group));
    if (!scratch)
        return 0;
    int16_t *xq;
    float *xs, *xsum;
    h16_layout(scratch, M, K, &xq, &xs, &xsum);
    if (M == 1)  /* a few blocks: not worth the threads' meeting */
        h16_prepare(x, M, K, group, scratch, &xq, &xs, &xsum);
    const int8_t *xb = (const int8_t *)xq;
#endif
    #pragma omp parallel num_threads(nthreads)
    {
#ifdef __AVX2__
    if (M > 1) {  /* the rows of x shared out, then every block ready before any product */
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < M * G; b++)
            h16_prepare_block(x, M, K, group, b / G, b % G, xq, xs, xsum);
    }
#endif
    #pragma omp for schedule(static)
    for (int64_t o = 0; o < N; o++) {
        const uint16_t *so = scale + o * GW, *mo = minimum + o * GW;
        const uint8_t *co = codes + o * (K / 2);
        const float b = bias ? bias[o] : 0.0f;
#ifdef __AVX2__
        if (M == 1) {  /* the group size a constant in each copy: no test per block */
            out[o] = group == 32 ? h16_q4_row1(co, so, mo, b, xb, xs, xsum, K, 32)
                                 : h16_q4_row1(co, so, mo, b, xb, xs, xsum, K, 64);
            continue;
        }
        for (int64_t m = 0; m < M; m += 8) {
            float *om = out + m * N + o;
            const int16_t *xm = xq + m * K;
            const float *sm = xs + m * G, *tm = xsum + m * GP;
#define H16(R) h16_q4_rows(R, co, so, mo, b, om, xm, sm, tm, N, K, group); break
            switch (M - m < 8 ? M - m : 8) {
                case 1: H16(1); case 2: H16(2); case 3: H16(3); case 4: H16(4);
                case 5: H16(5); case 6: H16(6); case 7: H16(7); default: H16(8);
            }
#undef H16
        }
#else
        for (int64_t m = 0; m < M; m++)
            out[m * N + o] = h16_q4_plain(co, so, mo, b, x + m * K, K, group);
#endif
    }
    }
    return 1;
}

/* linear.c's 8-bit kernel (linear_q8) with float16 scale and minimum [N, K / group]. */
typedef int8_t h16_c8 __attribute__((vector_size(8)));

static inline v8 h16_widen8(const int8_t *p) {
#ifdef __AVX2__
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    h16_c8 c;
    __builtin_memcpy(&c, p, 8);
    return __builtin_convertvector(c, v8);
#endif
}

static inline __attribute__((always_inline)) void h16_q8_rows(
        const int XR, const float *x, const int8_t *co, const uint16_t *so,
        const uint16_t *mo, const float *xsum, int64_t K, int64_t group, float *acc) {
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
            const v8 w = h16_widen8(co + k);
            for (int r = 0; r < XR; r++)
                part[r] += w * load8(x + r * K + k);
        }
        const v8 s = splat8(h16_to_f32(so[g]));
        const float low = h16_to_f32(mo[g]);
        for (int r = 0; r < XR; r++) {
            a[r] += part[r] * s;
            lows[r] += low * xsum[r * GW + g];
        }
    }
    for (int r = 0; r < XR; r++)
        acc[r] = hsum8(a[r]) + lows[r];
}

int linear_q8_h16(const float *x, const int8_t *codes, const uint16_t *scale,
                  const uint16_t *minimum, const float *bias, float *out, int64_t M, int64_t N,
                  int64_t K, int64_t group, int64_t nthreads) {
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
        const uint16_t *so = scale + o * GW, *mo = minimum + o * GW;
        const int8_t *co = codes + o * K;
        const float b = bias ? bias[o] : 0.0f;
        float acc[4];
        for (int64_t m = 0; m < M; m += 4) {
            const int64_t n = M - m < 4 ? M - m : 4;
            const float *xm = x + m * K, *sm = xsum + m * GW;
            switch (n) {
                case 1: h16_q8_rows(1, xm, co, so, mo, sm, K, group, acc); break;
                case 2: h16_q8_rows(2, xm, co, so, mo, sm, K, group, acc); break;
                case 3: h16_q8_rows(3, xm, co, so, mo, sm, K, group, acc); break;
                default: h16_q8_rows(4, xm, co, so, mo, sm, K, group, acc);
            }
            for (int64_t r = 0; r < n; r++)
                out[(m + r) * N + o] = acc[r] + b;
        }
    }
    return 1;
}
