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

static inline __attribute__((always_inline)) void dot4x2(const float *x, const float *y,
                                                         const float *w, int64_t K,
                                                         float *acc) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f,
          b3 = 0.0f;
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

