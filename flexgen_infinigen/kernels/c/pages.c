#include "selection.h"

/* Page-level speculation (Quest's idea on InfiniGen's skewed keys): a page of P consecutive
   tokens keeps the element-wise minimum and maximum of its projected keys, lo and hi
   [C, NP, W] (head-major, row stride W, column stride NPmax * W); q . k of any key of the
   page is at most sum_w max(q_w lo_w, q_w hi_w). For each column c: those bounds of its G
   query heads over the pages its tokens may be in, the softmax of each head over the pages
   with a visible token, summed over the group; then, best first, the pages that hold
   cap[c] visible tokens (at most a page's worth more; at least one page), their visible
   tokens in token order into order[c, 0 .. counts[c]); the rest of the row repeats them.
   visible: [b, T] bytes. */
void speculate_pages(const float *lo, const float *hi, const float *q,
                     const uint8_t *visible, const int64_t *cap, int64_t *order,
                     int64_t *counts, int64_t T, int64_t NPmax, int64_t C, int64_t KV,
                     int64_t W, int64_t G, int64_t P, int64_t width, int64_t nthreads) {
    const int64_t NP = (T + P - 1) / P;
    #pragma omp parallel num_threads(nthreads)
    {
        static __thread void *buf;
        static __thread size_t have;
        char *work = (char *)thread_scratch(&buf, &have, (sizeof(float) * (G + 2) + 2) * NP);
        float *s = (float *)work, *mass = s + G * NP, *tmp = mass + NP;
        uint8_t *open = (uint8_t *)(tmp + NP);  /* pages with a visible token */
        uint8_t *chosen = open + NP;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < C; c++) {
            const uint8_t *vis = visible + (c / KV) * T;
            for (int64_t p = 0; p < NP; p++) {
                uint8_t any = 0;
                for (int64_t t = p * P; t < (p + 1) * P && t < T; t++)
                    any |= vis[t];
                open[p] = any;
                const float *l = lo + (c * NPmax + p) * W, *h = hi + (c * NPmax + p) * W;
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = q + (c * G + g) * W;
                    float acc = 0.0f;
                    for (int64_t w = 0; w < W; w++) {
                        const float a = qg[w] * l[w], b = qg[w] * h[w];
                        acc += a > b ? a : b;
                    }
                    s[g * NP + p] = acc;
                }
            }
            /* pages by mass, best first, until they hold cap[c] visible tokens (whole
               pages: at most a page's worth more): the best `want` by a threshold (fewer
               cannot hold cap[c]), then the next best one at a time while short */
            column_mass(s, NP, open, G, NP, mass, tmp);
            int64_t m = 0;
            for (int64_t p = 0; p < NP; p++)
                if (open[p]) tmp[m++] = mass[p];
            int64_t want = (cap[c] + P - 1) / P;
            want = want < 1 ? 1 : (want > m ? m : want);
            int64_t above = 0, held = 0, got = 0;
            const float thr = m > 0 ? kth_largest_mass(tmp, m, want, G, &above) : 0.0f;
            int64_t ties = want - above;
            for (int64_t p = 0; p < NP; p++) {
                chosen[p] = open[p] && (mass[p] > thr || (mass[p] == thr && ties-- > 0));
                if (chosen[p]) {
                    got++;
                    for (int64_t t = p * P; t < (p + 1) * P && t < T; t++)
                        held += vis[t];
                }
            }
            while (held < cap[c] && got < m) {
                int64_t best = -1;
                for (int64_t p = 0; p < NP; p++)
                    if (open[p] && !chosen[p] && (best < 0 || mass[p] > mass[best]))
                        best = p;
                chosen[best] = 1;
                got++;
                for (int64_t t = best * P; t < (best + 1) * P && t < T; t++)
                    held += vis[t];
            }
            int64_t n = 0, *row = order + c * width;
            for (int64_t p = 0; p < NP; p++)
                if (chosen[p])
                    for (int64_t t = p * P; t < (p + 1) * P && t < T && n < width; t++)
                        if (vis[t]) row[n++] = t;
            counts[c] = n;
            for (int64_t i = n; i < width; i++)
                row[i] = n > 0 ? row[i % n] : 0;
        }
    }
}
