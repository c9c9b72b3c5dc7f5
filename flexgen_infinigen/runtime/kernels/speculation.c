#include "common.h"

/* InfiniGen's speculation on a CPU: approximate attention scores of the next layer's query
   heads against its packed speculation keys, and the default selection rule ("mass") on
   them.

   Speculation keys are head-major: column c (batch x KV head) keeps its rows one after the
   other, codes [L, P] bytes (8 / bits codes a byte), a minimum and a scale per row. A code
   at bit s * bits of byte j is column j * per + s of the projected key (per = 8 / bits);
   queries come with their columns in that "slot-plane" order (x[s * P + j]), so that the
   score of a row is scale * (q . codes) + lo * sum(q).

   With AVX2, 4-bit codes and P a multiple of 32, q is rounded to 8-bit integers per query
   head (max |q| to 127; an error far below the 4-bit keys') and q . codes is an integer
   product of bytes (vpmaddubsw), eight rows reduced at once; otherwise codes are expanded
   to floats row by row. */

/* s[g * ld + t] for t < T: the scores of one column's rows against its G queries q [G, W]
   (slot-plane order), qsum [G] their sums. */
static void score_column(const uint8_t *codes, const float *scale, const float *lo,
                         const float *q, const float *qsum, float *s, int64_t ld, int64_t T,
                         int64_t P, int64_t G, int64_t bits) {
    const int64_t per = 8 / bits, W = P * per, mask = (1 << bits) - 1;
    int64_t t = 0;
    float rounded[16 * 256];  /* the queries as the byte products see them, for the tail */
#ifdef __AVX2__
    if (bits == 4 && P % 32 == 0 && P <= 128) {
        int8_t qi[16][256] __attribute__((aligned(32)));
        float qscale[16];
        for (int64_t g = 0; g < G; g++) {
            float m = 0.0f;
            for (int64_t w = 0; w < W; w++)
                m = fabsf(q[g * W + w]) > m ? fabsf(q[g * W + w]) : m;
            qscale[g] = m > 0.0f ? m / 127.0f : 1.0f;
            for (int64_t w = 0; w < W; w++) {
                qi[g][w] = (int8_t)lrintf(q[g * W + w] / qscale[g]);
                rounded[g * W + w] = qi[g][w] * qscale[g];
            }
        }
        q = rounded;
        const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
        for (; t + 8 <= T; t += 8) {
            for (int64_t g = 0; g < G; g++) {
                __m256i acc[8];
                for (int r = 0; r < 8; r++) {
                    const uint8_t *row = codes + (t + r) * P;
                    __m256i sum = _mm256_setzero_si256();
                    for (int64_t j = 0; j < P; j += 32) {
                        const __m256i c = _mm256_loadu_si256((const __m256i *)(row + j));
                        const __m256i lo4 = _mm256_and_si256(c, nibble);
                        const __m256i hi4 = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
                        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(
                            lo4, _mm256_load_si256((const __m256i *)(qi[g] + j))));
                        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(
                            hi4, _mm256_load_si256((const __m256i *)(qi[g] + P + j))));
                    }
                    acc[r] = _mm256_madd_epi16(sum, ones);
                }
                const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]),
                                                     _mm256_hadd_epi32(acc[2], acc[3]));
                const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[4], acc[5]),
                                                     _mm256_hadd_epi32(acc[6], acc[7]));
                const __m256i dots = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                                      _mm256_permute2x128_si256(u0, u1, 0x31));
                const v8 x = (v8)_mm256_cvtepi32_ps(dots);
                store8(s + g * ld + t, x * load8(scale + t) * splat8(qscale[g])
                                       + load8(lo + t) * splat8(qsum[g]));
            }
        }
    }
#endif
    float x[256];
    for (; t < T; t++) {
        const uint8_t *row = codes + t * P;
        for (int64_t k = 0; k < per; k++)
            for (int64_t j = 0; j < P; j++)
                x[k * P + j] = (float)((row[j] >> (k * bits)) & mask);
        for (int64_t g = 0; g < G; g++) {
            float acc = 0.0f;
            for (int64_t w = 0; w < W; w++)
                acc += q[g * W + w] * x[w];
            s[g * ld + t] = scale[t] * acc + lo[t] * qsum[g];
        }
    }
}

/* out[c, g, t] = scale[c, t] * (q[c, g] . codes[c, t]) + lo[c, t] * qsum[c, g] for t < T.
   codes: [C, L, P]; scale, lo: [C, L]; q: [C, G, W] (slot-plane order); qsum: [C, G]. */
void score_packed(const uint8_t *codes, const float *scale, const float *lo, const float *q,
                  const float *qsum, float *out, int64_t T, int64_t L, int64_t C, int64_t P,
                  int64_t G, int64_t bits, int64_t nthreads) {
    const int64_t W = P * (8 / bits), block = 1024, blocks = (T + block - 1) / block;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < C; c++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t t0 = b * block, n = t0 + block < T ? block : T - t0;
            score_column(codes + (c * L + t0) * P, scale + c * L + t0, lo + c * L + t0,
                         q + c * G * W, qsum + c * G, out + c * G * T + t0, T, n, P, G, bits);
        }
}

/* The k-th largest of x[0 .. n) (k >= 1), by quickselect (x is reordered). */
static float kth_largest(float *x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const float pivot = x[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) { const float t = x[i]; x[i] = x[j]; x[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return x[want];
}

/* The k-th largest of n >= k >= 1 non-negative floats x (reordered): their bit patterns
   order as the values do, so one histogram of the top 12 bits (exponent and 3 bits of
   mantissa) finds the bin the answer lies in; the few values of that bin are moved to the
   front and quickselect finishes among them (quickselect alone costs a mispredicted branch
   per value per pass). */
static float kth_largest_mass(float *x, int64_t n, int64_t k) {
    uint32_t hist[4096] = {0};
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        __builtin_memcpy(&u, x + i, 4);
        hist[u >> 20]++;
    }
    int64_t above = 0, bin = 4095;
    for (; bin > 0 && above + hist[bin] < (uint64_t)k; bin--)
        above += hist[bin];
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        __builtin_memcpy(&u, x + i, 4);
        const float v = x[i];
        x[m] = v;
        m += (int64_t)(u >> 20) == bin;
    }
    return kth_largest(x, m, k - above);
}

/* The "mass" rule for one column from its scores s [G, T] (row stride ld): the softmax of
   each query head over the tokens it may see, summed over the group; the cap tokens with
   the most mass (ties: the earlier token), in token order, into row[0 .. cap); the rest of
   the row repeats them (never read). mass, tmp: T floats of scratch. */
/* mass[t]: the softmax of each of the G query heads' scores s [G, T] (row stride ld) over
   the tokens it may see (vis), summed over the group; 0 where hidden. tmp: T floats. */
static void column_mass(const float *s, int64_t ld, const uint8_t *vis, int64_t G, int64_t T,
                        float *mass, float *tmp) {
    for (int64_t t = 0; t < T; t++)
        mass[t] = 0.0f;
    for (int64_t g = 0; g < G; g++) {  /* branch-free: hidden tokens get exp(-big) = 0 */
        const float *sg = s + g * ld;
        float m = -3.0e38f, l = 0.0f;
        for (int64_t t = 0; t < T; t++) {
            const float x = vis[t] ? sg[t] : -3.0e38f;
            m = x > m ? x : m;
        }
        for (int64_t t = 0; t < T; t++) {
            tmp[t] = expf((vis[t] ? sg[t] : -3.0e38f) - m);
            l += tmp[t];
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t t = 0; t < T; t++)
            mass[t] += tmp[t] * inv;
    }
}

/* The "mass" rule for one column from its scores s [G, T] (row stride ld): the cap tokens
   with the most mass (column_mass; ties: the earlier token), in token order, into
   row[0 .. cap); the rest of the row repeats them (never read). mass, tmp: T floats. */
static void select_column(const float *s, int64_t ld, const uint8_t *vis, int64_t cap,
                          int64_t *row, int64_t width, int64_t G, int64_t T, float *mass,
                          float *tmp) {
    column_mass(s, ld, vis, G, T, mass, tmp);
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++)
        if (vis[t]) tmp[n++] = mass[t];
    const int64_t k = cap < n ? cap : n;
    int64_t got = 0;
    if (k > 0) {
        const float thr = kth_largest_mass(tmp, n, k);
        int64_t above = 0;
        for (int64_t t = 0; t < T; t++)
            if (vis[t] && mass[t] > thr) above++;
        int64_t ties = k - above;
        for (int64_t t = 0; t < T && got < k; t++) {
            if (!vis[t]) continue;
            if (mass[t] > thr) row[got++] = t;
            else if (mass[t] == thr && ties > 0) { row[got++] = t; ties--; }
        }
    }
    for (int64_t i = got; i < width; i++)
        row[i] = got > 0 ? row[i % got] : 0;
}

/* The mass rule from precomputed scores [C, G, T] for every column c = b * KV + h:
   visible: [b, T] bytes (1: may be chosen); cap: [C]; order: [C, width]. */
void select_mass(const float *scores, const uint8_t *visible, const int64_t *cap,
                 int64_t *order, int64_t C, int64_t KV, int64_t G, int64_t T, int64_t width,
                 int64_t nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        static __thread void *buf;
        static __thread size_t have;
        float *work = (float *)thread_scratch(&buf, &have, sizeof(float) * 2 * T);
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < C; c++)
            select_column(scores + c * G * T, T, visible + (c / KV) * T, cap[c],
                          order + c * width, width, G, T, work, work + T);
    }
}

/* Speculation in one pass per column: its scores against the packed keys (as score_packed),
   then the mass rule (as select_mass), the scores never leaving the thread's cache. */
void speculate_mass(const uint8_t *codes, const float *scale, const float *lo, const float *q,
                    const float *qsum, const uint8_t *visible, const int64_t *cap,
                    int64_t *order, int64_t T, int64_t L, int64_t C, int64_t KV, int64_t P,
                    int64_t G, int64_t bits, int64_t width, int64_t nthreads) {
    const int64_t W = P * (8 / bits);
    #pragma omp parallel num_threads(nthreads)
    {
        static __thread void *buf;
        static __thread size_t have;
        float *work = (float *)thread_scratch(&buf, &have, sizeof(float) * (G + 2) * T);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < C; c++) {
            score_column(codes + c * L * P, scale + c * L, lo + c * L, q + c * G * W,
                         qsum + c * G, work, T, T, P, G, bits);
            select_column(work, T, visible + (c / KV) * T, cap[c], order + c * width, width,
                          G, T, work + G * T, work + (G + 1) * T);
        }
    }
}

/* Rows of projected keys x [n, C, W] (float) written as packed codes at rows start ..
   start + n of every column: codes [C, L, P], lo and scale [C, L]; per row the minimum and
   (max - min) / levels, codes rounded to nearest and packed per / byte (code s of byte j is
   column j * per + s, at bit s * bits), as SpeculationKeys.write does in torch. */
void spec_write(const float *x, uint8_t *codes, float *lo, float *scale, int64_t n,
                int64_t start, int64_t L, int64_t C, int64_t W, int64_t P, int64_t bits) {
    const int64_t per = 8 / bits, levels = (1 << bits) - 1;
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < C; c++) {
            const float *r = x + (i * C + c) * W;
            float mn = r[0], mx = r[0];
            for (int64_t w = 1; w < W; w++) {
                mn = r[w] < mn ? r[w] : mn;
                mx = r[w] > mx ? r[w] : mx;
            }
            float step = (mx - mn) / levels;
            step = step > 1e-8f ? step : 1e-8f;
            uint8_t *out = codes + (c * L + start + i) * P;
            for (int64_t j = 0; j < P; j++) {
                uint8_t byte = 0;
                for (int64_t s = 0; s < per; s++) {
                    const int64_t w = j * per + s;
                    if (w < W) {
                        float q = rintf((r[w] - mn) / step);
                        q = q < 0.0f ? 0.0f : (q > levels ? (float)levels : q);
                        byte |= (uint8_t)((int)q << (s * bits));
                    }
                }
                out[j] = byte;
            }
            lo[c * L + start + i] = mn;
            scale[c * L + start + i] = step;
        }
}

/* Page-level speculation (Quest's idea on InfiniGen's skewed keys): a page of P consecutive
   tokens keeps the element-wise minimum and maximum of its projected keys, lo and hi
   [C, NP, W] (head-major, row stride W, column stride NPmax * W); q . k of any key of the
   page is at most sum_w max(q_w lo_w, q_w hi_w). For each column c: those bounds of its G
   query heads over the pages its tokens may be in, the softmax of each head over the pages
   with a visible token, summed over the group; then, best first, the pages that hold
   cap[c] visible tokens (at most a page's worth more; at least one page), their visible tokens in token order into
   order[c, 0 .. counts[c]); the rest of the row repeats them. visible: [b, T] bytes. */
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
            const float thr = m > 0 ? kth_largest_mass(tmp, m, want) : 0.0f;
            int64_t above = 0, held = 0, got = 0;
            for (int64_t p = 0; p < NP; p++)
                above += open[p] && mass[p] > thr;
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
