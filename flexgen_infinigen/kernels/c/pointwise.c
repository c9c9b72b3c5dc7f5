#include "common.h"

/* Row-wise layer math of a decode step on a CPU (RMSNorm, rotary embedding). Each is little
   arithmetic on a token, where torch's seven or so small operations each pay a dispatch and
   a temporary; threads only for prefill-sized inputs. */
#define POINTWISE_THREADS_FROM 65536  /* values: below this, one thread does it all */

/* y = weight * (x / sqrt(mean(x^2) + eps)) for each row of n values (RMSNorm). */
void rms_norm_rows(const float *x, const float *weight, float *y, int64_t rows, int64_t n,
                   float eps, int64_t nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if (rows * n >= POINTWISE_THREADS_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        v8 acc = splat8(0.0f);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const v8 v = load8(xr + i);
            acc += v * v;
        }
        float squares = hsum8(acc);
        for (; i < n; i++)
            squares += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(squares / (float)n + eps);
        const v8 vinv = splat8(inv);
        for (i = 0; i + 8 <= n; i += 8)
            store8(yr + i, load8(weight + i) * (load8(xr + i) * vinv));
        for (; i < n; i++)
            yr[i] = weight[i] * (xr[i] * inv);
    }
}

/* Rotary embedding, half-split layout: y = x cos + (x2, x1) sin for each head of each
   token, x [tokens, heads, d], cos and sin [tokens, d] (sin with its first half negated,
   as models/llama.py encodes it), shared by a token's heads. */
void rotary_rows(const float *x, const float *cos, const float *sin, float *y, int64_t tokens,
                 int64_t heads, int64_t d, int64_t nthreads) {
    const int64_t half = d / 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if (tokens * heads * d >= POINTWISE_THREADS_FROM)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + (t * heads + h) * d;
            float *yr = y + (t * heads + h) * d;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                const v8 lo = load8(xr + i), hi = load8(xr + half + i);
                store8(yr + i, lo * load8(c + i) + hi * load8(s + i));
                store8(yr + half + i, hi * load8(c + half + i) + lo * load8(s + half + i));
            }
            for (; i < half; i++) {
                yr[i] = xr[i] * c[i] + xr[half + i] * s[i];
                yr[half + i] = xr[half + i] * c[half + i] + xr[i] * s[half + i];
            }
        }
    }
}
