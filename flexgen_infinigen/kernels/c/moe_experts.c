#include "linear_h16.h"

/* A decode step's routed experts of a mixture-of-experts MLP in one call. Tokens x [T, H];
   the U experts they use, in the order given (ascending ids); expert u takes the rows
   tok[first[u] .. first[u + 1]) of x (each token at most once, ascending) with router
   weights wt at the same places. For each expert, Y = down(silu(gate X) * up X) over its
   rows X, and out[t] = sum over the experts of t, in order, of wt * Y[t], added from zero:
   what the per-expert path (a linear call a matrix, then index_add_ in expert order)
   gives. Every matrix is 4-bit codes with float16 scale and minimum (a GGUF's Q4_0, Q4_1,
   Q4_K ... kept as stored), multiplied by the row products linear_q4_h16 uses for the same
   number of rows, so each Y is that kernel's, to the rounding of silu. An expert's codes are
   read once for all its rows. One parallel region instead of three kernel calls an expert
   (each waking the threads): the gate and up rows of every expert are shared out together,
   then SiLU times up, then the down rows expert by expert (each thread reading a few
   matrices' rows in order, not every expert's row o at once), then the weighted sums.

   codes, scales, minima: 3 U pointers, expert u's gate, up and down at 3u, 3u + 1, 3u + 2;
   gate and up [F, H], down [H, F], all with the same group (32 or 64); H and F multiples
   of 64; at most MOE_MAX_ROWS rows an expert. Returns 0 when it cannot run (the caller
   takes the per-expert path). */
#define MOE_MAX_ROWS 16

#ifdef __AVX2__
/* Output row o of a [N, K] matrix for the M prepared rows (h16_prepare's layout): out[m *
   stride] for m < M, as linear_q4_h16 computes it for M rows. */
static inline void moe_row(const uint8_t *co, const uint16_t *so, const uint16_t *mo,
                           const char *prep, int64_t M, int64_t K, int64_t group, float *out,
                           int64_t stride) {
    const int64_t G = K / 64, GW = K / group, GP = (GW + 7) / 8 * 8;
    const int16_t *xq = (const int16_t *)prep;
    const float *xs = (const float *)(xq + ((M * K + 31) / 32) * 32), *xsum = xs + M * G;
    if (M == 1) {
        const int8_t *xb = (const int8_t *)xq;  /* the group size a constant in each copy */
        out[0] = group == 32 ? h16_q4_row1(co, so, mo, 0.0f, xb, xs, xsum, K, 32)
                             : h16_q4_row1(co, so, mo, 0.0f, xb, xs, xsum, K, 64);
        return;
    }
    for (int64_t m = 0; m < M; m += 8) {
        float *om = out + m * stride;
        const int16_t *xm = xq + m * K;
        const float *sm = xs + m * G, *tm = xsum + m * GP;
#define MOE_ROWS(R) h16_q4_rows(R, co, so, mo, 0.0f, om, xm, sm, tm, stride, K, group); break
        switch (M - m < 8 ? M - m : 8) {
            case 1: MOE_ROWS(1); case 2: MOE_ROWS(2); case 3: MOE_ROWS(3); case 4: MOE_ROWS(4);
            case 5: MOE_ROWS(5); case 6: MOE_ROWS(6); case 7: MOE_ROWS(7); default: MOE_ROWS(8);
        }
#undef MOE_ROWS
    }
}
#else
/* Portable: the same output row from the rows as floats (X [M, K] contiguous). */
static inline void moe_row(const uint8_t *co, const uint16_t *so, const uint16_t *mo,
                           const float *X, int64_t M, int64_t K, int64_t group, float *out,
                           int64_t stride) {
    for (int64_t m = 0; m < M; m++)
        out[m * stride] = h16_q4_plain(co, so, mo, 0.0f, X + m * K, K, group);
}
#endif

int moe_q4_h16(const float *x, int64_t T, int64_t U, const int64_t *first, const int64_t *tok,
               const float *wt, const uint8_t *const *codes, const uint16_t *const *scales,
               const uint16_t *const *minima, float *out, int64_t H, int64_t F, int64_t group,
               int64_t nthreads) {
    if ((group != 64 && group != 32) || H % 64 || F % 64 || U <= 0 || T <= 0)
        return 0;
    const int64_t R = first[U];  /* rows over all experts */
    for (int64_t u = 0; u < U; u++)
        if (first[u + 1] - first[u] < 1 || first[u + 1] - first[u] > MOE_MAX_ROWS)
            return 0;
    const int64_t GH = H / group, GF = F / group;
    /* scratch: X gathered per expert [R, H]; gate and up outputs [R, 2, F] (per expert
       [2, M, F]); down outputs Y [R, H]; then each expert's prepared X and activation */
    /* where each expert's prepared rows start (whole 64-byte blocks each) and their ends */
    size_t xat[U + 1], aat[U + 1];
    xat[0] = aat[0] = 0;
    for (int64_t u = 0; u < U; u++) {
#ifdef __AVX2__
        const int64_t M = first[u + 1] - first[u];
        xat[u + 1] = xat[u] + (h16_prepare_bytes(M, H, group) + 63) / 64 * 64;
        aat[u + 1] = aat[u] + (h16_prepare_bytes(M, F, group) + 63) / 64 * 64;
#else
        xat[u + 1] = aat[u + 1] = 0;  /* the portable rows read the floats themselves */
#endif
    }
    static __thread void *buf;
    static __thread size_t have;
    const size_t floats = sizeof(float) * (2 * R * H + 2 * R * F);
    char *scratch = (char *)thread_scratch(&buf, &have, floats + xat[U] + aat[U] + 64);
    if (!scratch)
        return 0;
    float *X = (float *)scratch, *gu = X + R * H, *Y = gu + 2 * R * F;
    char *xp = scratch + floats, *ap = xp + xat[U];
    for (int64_t i = 0; i < T * H; i++)
        out[i] = 0.0f;
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < U; u++) {  /* each expert's rows of x, gathered, prepared */
            const int64_t M = first[u + 1] - first[u];
            float *Xu = X + first[u] * H;
            for (int64_t m = 0; m < M; m++)
                __builtin_memcpy(Xu + m * H, x + tok[first[u] + m] * H, sizeof(float) * H);
#ifdef __AVX2__
            int16_t *q;
            float *s, *t;
            h16_prepare(Xu, M, H, group, xp + xat[u], &q, &s, &t);
#endif
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < 2 * U * F; r++) {  /* gate and up rows of every expert */
            const int64_t u = r / (2 * F), which = (r / F) % 2, o = r % F;
            const int64_t M = first[u + 1] - first[u];
            const int64_t at = 3 * u + which;
            float *dst = gu + 2 * first[u] * F + which * M * F + o;
#ifdef __AVX2__
            const void *rows = xp + xat[u];
#else
            const float *rows = X + first[u] * H;
#endif
            moe_row(codes[at] + o * (H / 2), scales[at] + o * GH, minima[at] + o * GH,
                    rows, M, H, group, dst, F);
        }
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < U; u++) {  /* silu(gate) * up, prepared for down */
            const int64_t M = first[u + 1] - first[u];
            float *g = gu + 2 * first[u] * F;
            const float *up = g + M * F;
            for (int64_t i = 0; i < M * F; i++)
                g[i] = silu1(g[i]) * up[i];
#ifdef __AVX2__
            int16_t *q;
            float *s, *t;
            h16_prepare(g, M, F, group, ap + aat[u], &q, &s, &t);
#endif
        }
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < U * H; r++) {  /* down rows, expert by expert */
            const int64_t u = r / H, o = r % H, at = 3 * u + 2;
            const int64_t M = first[u + 1] - first[u];
#ifdef __AVX2__
            const void *rows = ap + aat[u];
#else
            const float *rows = gu + 2 * first[u] * F;
#endif
            moe_row(codes[at] + o * (F / 2), scales[at] + o * GF, minima[at] + o * GF,
                    rows, M, F, group, Y + first[u] * H + o, H);
        }
        #pragma omp for schedule(static)
        for (int64_t o = 0; o < H; o++)  /* each token's experts, weighted, in order */
            for (int64_t i = 0; i < R; i++)
                out[tok[i] * H + o] += Y[i * H + o] * wt[i];
    }
    return 1;
}
