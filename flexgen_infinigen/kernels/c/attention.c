#include "attention.h"

/* Attention over float rows: every row (the full cache, a layer InfiniGen reads whole) or
   chosen ones (InfiniGen's selection), read where the cache keeps them; see attention.h
   for the layouts and the work items. */

/* Attention over every row: row t of column c of k and v is at t * st + c * sc floats
   (token-major [T, C, D]: st = C * D, sc = D; head-major [C, T, D]: st = D, sc = T' * D).
   q: [C, G, D]; bias: [C, T]; out: [C, G, D]. Work items are (column, range of rows; see
   ranges_of), each walked in order, so that a head-major cache is read as one stream per item.
   sinks: NULL or [C, G], see merge_states. */
void attend_rows(const float *q, const float *k, const float *v, const float *bias,
                 float *out, const float *sinks, int64_t T, int64_t C, int64_t G, int64_t D, int64_t st,
                 int64_t sc, int64_t nthreads) {
    const int64_t R = ranges_of(T), S = G * (D + 2);
    float *part = (float *)malloc(sizeof(float) * C * R * S);
    int64_t *first = first_rows(bias, C, T);
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t item = 0; item < C * R; item++) {
        const int64_t c = item / R, r = item % R;
        const int64_t lo = first[c] + r * RANGE;
        const int64_t hi = lo + RANGE < T ? lo + RANGE : T;
        float *state = part + (r * C + c) * S;
        float s[16 * TB];
        const float *kr[TB], *vr[TB], *ahead[2 * TB];
        init_states(state, G, D);
        for (int64_t t0 = lo; t0 < hi; t0 += TB) {
            const int64_t n = t0 + TB < hi ? TB : hi - t0;
            for (int64_t i = 0; i < n; i++) {
                kr[i] = k + (t0 + i) * st + c * sc;
                vr[i] = v + (t0 + i) * st + c * sc;
            }
            int64_t na = 0;  /* the next block's K and V rows, asked for while this one scores */
            for (int64_t j = t0 + NEXT; j < t0 + NEXT + n && j < T; j++) {
                ahead[na++] = k + j * st + c * sc;
                ahead[na++] = v + j * st + c * sc;
            }
            attend_block(q + c * G * D, kr, vr, bias + c * T + t0, n, G, D, state, s, ahead, na,
                         NULL, 0);
        }
    }
    merge_states(out, part, C * G, D, R, sinks);
    free(part);
    free(first);
}

/* Attention over chosen rows read where the cache keeps them (InfiniGen's selected tokens):
   column c attends to rows index[c, 0 .. counts[c]) of k and v (row t of column c at
   t * st + c * sc), then to its new token k_new[c], v_new[c]. q, out: [C, G, D]. */
void attend_indexed(const float *q, const float *k, const float *v, const int64_t *index,
                    const int64_t *counts, int64_t n, const float *k_new, const float *v_new,
                    float *out, const float *sinks, int64_t C, int64_t G, int64_t D,
                    int64_t st, int64_t sc, int64_t nthreads) {
    const int64_t R = ranges_of(n + 1), S = G * (D + 2);
    float *part = (float *)malloc(sizeof(float) * C * R * S);
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t item = 0; item < C * R; item++) {
        const int64_t c = item / R, r = item % R, used = counts[c] + 1;
        const int64_t lo = r * RANGE, hi = lo + RANGE < used ? lo + RANGE : used;
        const int64_t *idx = index + c * n;
        float *state = part + (r * C + c) * S;
        float s[16 * TB];
        const float *kr[TB], *vr[TB], *ahead[2 * TB], *vahead[TB];
        init_states(state, G, D);
        for (int64_t t0 = lo; t0 < hi; t0 += TB) {
            const int64_t m = t0 + TB < hi ? TB : hi - t0;
            for (int64_t i = 0; i < m; i++) {
                const int64_t j = t0 + i;
                kr[i] = j < counts[c] ? k + idx[j] * st + c * sc : k_new + c * D;
                vr[i] = j < counts[c] ? v + idx[j] * st + c * sc : v_new + c * D;
            }
            /* the K rows AHEAD chosen rows on are asked for while this block scores, their V
               rows while it adds values: one ask a row read, not the block's in one burst
               that would fill the line-fill buffers while scoring waits */
            int64_t na = 0;
            for (int64_t j = t0 + AHEAD; j < t0 + AHEAD + m && j < counts[c]; j++) {
                ahead[na] = k + idx[j] * st + c * sc;
                vahead[na++] = v + idx[j] * st + c * sc;
            }
            attend_block(q + c * G * D, kr, vr, NULL, m, G, D, state, s, ahead, na, vahead, na);
        }
    }
    merge_states(out, part, C * G, D, R, sinks);
    free(part);
}
