#include "linear_h16.h"

/* One token's routed experts of a mixture-of-experts MLP in one call: for each of its E
   experts e (in the order given), y_e = down_e(silu(gate_e x) * up_e x), and
   out = sum_e weight_e * y_e, added in that order from zero (what the per-expert path's
   index_add_ in expert order gives). Every matrix is 4-bit codes with float16 scale and
   minimum (a GGUF's Q4_0/Q4_1 kept as stored), multiplied as linear_q4_h16 multiplies
   them, so each y_e is that kernel's, to the rounding of silu. One parallel region instead
   of three kernel calls an expert (with a thread wake-up each): the gate and up rows of
   every expert are shared out together, then the down rows.

   codes, scales, minima: 3 E pointers, expert e's gate, up and down at 3e, 3e + 1, 3e + 2;
   gate and up [F, H], down [H, F], all with the same group (32 or 64); H and F multiples
   of 64. Returns 0 when it cannot run (the caller takes the per-expert path). */
int moe_token_q4_h16(const float *x, int64_t E, const uint8_t *const *codes,
                     const uint16_t *const *scales, const uint16_t *const *minima,
                     const float *weight, float *out, int64_t H, int64_t F, int64_t group,
                     int64_t nthreads) {
    if ((group != 64 && group != 32) || H % 64 || F % 64 || E <= 0)
        return 0;
    const int64_t GH = H / group, GF = F / group;
    static __thread void *buf;
    static __thread size_t have;
#ifdef __AVX2__
    const size_t xbytes = (h16_prepare_bytes(1, H, group) + 63) / 64 * 64;
    const size_t abytes = (h16_prepare_bytes(1, F, group) + 63) / 64 * 64;
#else
    const size_t xbytes = 0, abytes = 0;  /* the portable rows read floats: nothing to prepare */
#endif
    char *scratch = (char *)thread_scratch(&buf, &have,
                                           sizeof(float) * 2 * E * F + xbytes + E * abytes);
    if (!scratch)
        return 0;
    float *gu = (float *)scratch;  /* [E, 2, F]: gate rows, then up rows */
    char *xprep = scratch + sizeof(float) * 2 * E * F, *aprep = xprep + xbytes;
    (void)aprep;
#ifdef __AVX2__
    int16_t *xq;
    float *xs, *xsum;
    h16_prepare(x, 1, H, group, xprep, &xq, &xs, &xsum);
#endif
    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < 2 * E * F; r++) {
            const int64_t e = r / (2 * F), m = (r / F) % 2, o = r % F;
            const uint8_t *co = codes[3 * e + m] + o * (H / 2);
            const uint16_t *so = scales[3 * e + m] + o * GH, *mo = minima[3 * e + m] + o * GH;
#ifdef __AVX2__
            gu[r] = h16_q4_row1(co, so, mo, 0.0f, (const int8_t *)xq, xs, xsum, H, group);
#else
            gu[r] = h16_q4_plain(co, so, mo, 0.0f, x, H, group);
#endif
        }
        #pragma omp for schedule(static)
        for (int64_t e = 0; e < E; e++) {
            float *g = gu + 2 * e * F;
            const float *u = g + F;
            for (int64_t i = 0; i < F; i++)
                g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
#ifdef __AVX2__
            int16_t *aq;
            float *as, *asum;
            h16_prepare(g, 1, F, group, aprep + e * abytes, &aq, &as, &asum);
#endif
        }
        #pragma omp for schedule(static)
        for (int64_t o = 0; o < H; o++) {
            float acc = 0.0f;
            for (int64_t e = 0; e < E; e++) {
                const uint8_t *co = codes[3 * e + 2] + o * (F / 2);
                const uint16_t *so = scales[3 * e + 2] + o * GF;
                const uint16_t *mo = minima[3 * e + 2] + o * GF;
#ifdef __AVX2__
                /* expert e's activation as h16_prepare laid it out (the same offsets) */
                const int16_t *aq = (const int16_t *)(aprep + e * abytes);
                const float *as = (const float *)(aq + ((F + 31) / 32) * 32);
                const float *asum = as + F / 64;
                const float y = h16_q4_row1(co, so, mo, 0.0f, (const int8_t *)aq, as, asum,
                                            F, group);
#else
                const float y = h16_q4_plain(co, so, mo, 0.0f, gu + 2 * e * F, F, group);
#endif
                acc += y * weight[e];
            }
            out[o] = acc;
        }
    }
    return 1;
}
