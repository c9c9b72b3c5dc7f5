#include "selection.h"

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

#ifdef __AVX2__
/* dots[g] (g < NG, NG <= 4): the integer products of eight rows of codes (row stride P bytes,
   P a multiple of 32) with the 8-bit queries qi[g0 + g] (low nibbles against the first P
   bytes, high ones against the next P). Each row's codes are loaded and split into nibbles
   once for all NG heads; a head's byte products of a row are summed in 16 bits (at most
   2 * 15 * 127 per pair of bytes, four pairs: no overflow) and then in 32. */
static inline __attribute__((always_inline)) void dots8(const uint8_t *codes, int64_t P,
                                                        const int8_t (*qi)[256], int64_t g0,
                                                        const int NG, __m256i *dots) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i acc[4][8];
    for (int r = 0; r < 8; r++) {
        const uint8_t *row = codes + r * P;
        __m256i sum[4];
        for (int g = 0; g < NG; g++)
            sum[g] = _mm256_setzero_si256();
        for (int64_t j = 0; j < P; j += 32) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(row + j));
            const __m256i lo4 = _mm256_and_si256(c, nibble);
            const __m256i hi4 = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
            for (int g = 0; g < NG; g++) {
                sum[g] = _mm256_add_epi16(sum[g], _mm256_maddubs_epi16(
                    lo4, _mm256_load_si256((const __m256i *)(qi[g0 + g] + j))));
                sum[g] = _mm256_add_epi16(sum[g], _mm256_maddubs_epi16(
                    hi4, _mm256_load_si256((const __m256i *)(qi[g0 + g] + P + j))));
            }
        }
        for (int g = 0; g < NG; g++)
            acc[g][r] = _mm256_madd_epi16(sum[g], ones);
    }
    for (int g = 0; g < NG; g++) {
        const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[g][0], acc[g][1]),
                                             _mm256_hadd_epi32(acc[g][2], acc[g][3]));
        const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[g][4], acc[g][5]),
                                             _mm256_hadd_epi32(acc[g][6], acc[g][7]));
        dots[g] = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                   _mm256_permute2x128_si256(u0, u1, 0x31));
    }
}
#endif

/* s[g * ld + t] for t < T: the scores of one column's rows against its G queries q [G, W]
   (slot-plane order), qsum [G] their sums. With vis (not NULL), a token whose vis[t] is 0
   gets HIDDEN_SCORE and top[g] is the largest score of head g (HIDDEN_SCORE if none). */
static void score_column(const uint8_t *codes, const float *scale, const float *lo,
                         const float *q, const float *qsum, float *s, int64_t ld, int64_t T,
                         int64_t P, int64_t G, int64_t bits, const uint8_t *vis, float *top) {
    const int64_t per = 8 / bits, W = P * per, mask = (1 << bits) - 1;
    int64_t t = 0;
    float rounded[16 * 256];  /* the queries as the byte products see them, for the tail */
    float best[16];
    for (int64_t g = 0; g < G; g++)
        best[g] = HIDDEN_SCORE;
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
        v8 vbest[16];
        for (int64_t g = 0; g < G; g++)
            vbest[g] = splat8(HIDDEN_SCORE);
        const __m256 hidden = _mm256_set1_ps(HIDDEN_SCORE);
        for (; t + 8 <= T; t += 8) {
            __m256 shown = _mm256_setzero_ps();
            if (vis) {
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(vis + t)));
                shown = _mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_setzero_si256()));
            }
            for (int64_t g0 = 0; g0 < G; g0 += 4) {
                const int64_t ng = G - g0 < 4 ? G - g0 : 4;
                __m256i d[4];
                const uint8_t *rows = codes + t * P;
                if (ng == 4) dots8(rows, P, qi, g0, 4, d);
                else if (ng == 3) dots8(rows, P, qi, g0, 3, d);
                else if (ng == 2) dots8(rows, P, qi, g0, 2, d);
                else dots8(rows, P, qi, g0, 1, d);
                for (int64_t g = g0; g < g0 + ng; g++) {
                    const v8 x = (v8)_mm256_cvtepi32_ps(d[g - g0]);
                    v8 y = x * load8(scale + t) * splat8(qscale[g])
                           + load8(lo + t) * splat8(qsum[g]);
                    if (vis) {
                        y = (v8)_mm256_blendv_ps(hidden, (__m256)y, shown);
                        vbest[g] = (v8)_mm256_max_ps((__m256)vbest[g], (__m256)y);
                    }
                    store8(s + g * ld + t, y);
                }
            }
        }
        for (int64_t g = 0; g < G && vis; g++)
            for (int i = 0; i < 8; i++)
                best[g] = vbest[g][i] > best[g] ? vbest[g][i] : best[g];
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
            float y = scale[t] * acc + lo[t] * qsum[g];
            if (vis) {
                y = vis[t] ? y : HIDDEN_SCORE;
                best[g] = y > best[g] ? y : best[g];
            }
            s[g * ld + t] = y;
        }
    }
    for (int64_t g = 0; g < G && top; g++)
        top[g] = best[g];
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
                         q + c * G * W, qsum + c * G, out + c * G * T + t0, T, n, P, G, bits,
                         NULL, NULL);
        }
}

/* Speculation in one pass per column: its scores against the packed keys (as score_packed,
   hidden tokens masked and each head's maximum found while scoring), then the mass rule (as
   select_mass), the scores never leaving the thread's cache. */
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
        float top[16];
        #pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < C; c++) {
            const uint8_t *vis = visible + (c / KV) * T;
            score_column(codes + c * L * P, scale + c * L, lo + c * L, q + c * G * W,
                         qsum + c * G, work, T, T, P, G, bits, vis, top);
            mass_of_masked(work, T, top, G, T, work + G * T);
            choose_by_mass(work + G * T, vis, T, G, cap[c], order + c * width, width,
                           work + (G + 1) * T);
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
