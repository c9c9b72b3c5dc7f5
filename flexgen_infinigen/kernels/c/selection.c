#include "selection.h"

/* The mass rule: for one column (a sequence's KV head), the softmax of each of its G query
   heads' scores over the tokens it may see, summed over the group, and the `cap` tokens with
   the most of it (ties: the earlier token), in token order. */

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

static inline uint32_t bin_of(float v) {  /* exponent and 3 bits of mantissa (v >= 0) */
    uint32_t u;
    __builtin_memcpy(&u, &v, 4);
    return u >> 20;
}

/* The k-th largest of n >= k >= 1 masses x, each in [0, G] (reordered); *above (if not
   NULL) gets how many are larger. Non-negative floats' bit patterns order as their values
   do, so a histogram of the top 12 bits (exponent and 3 bits of mantissa) finds the bin the
   answer lies in, and quickselect finishes among that bin's few values, moved to the front
   (quickselect alone costs a mispredicted branch per value per pass). Only the bins up to
   G's can hold a mass; four histograms, value i into the (i % 4)-th, so that runs of equal
   bins do not wait on each other's increments; the bin's members are found eight at a
   time (most groups hold none). */
float kth_largest_mass(float *x, int64_t n, int64_t k, int64_t G, int64_t *above) {
    const uint32_t top = bin_of((float)G) + 1;
    uint32_t hist[4][4096];
    for (int h = 0; h < 4; h++)
        __builtin_memset(hist[h], 0, sizeof(uint32_t) * top);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int h = 0; h < 4; h++)
            hist[h][bin_of(x[i + h])]++;
    for (; i < n; i++)
        hist[0][bin_of(x[i])]++;
    int64_t larger = 0, bin = top - 1;
    for (; bin > 0; bin--) {
        const int64_t here = hist[0][bin] + hist[1][bin] + hist[2][bin] + hist[3][bin];
        if (larger + here >= k)
            break;
        larger += here;
    }
    int64_t m = 0;
    i = 0;
#ifdef __AVX2__
    const __m256i want = _mm256_set1_epi32((int)bin);
    for (; i + 8 <= n; i += 8) {
        float v[8];
        const __m256 x8 = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(v, x8);  /* read before x[m..] (m <= i) is written */
        uint32_t in = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(
            _mm256_srli_epi32(_mm256_castps_si256(x8), 20), want)));
        for (; in; in &= in - 1)
            x[m++] = v[__builtin_ctz(in)];
    }
#endif
    for (; i < n; i++) {
        const float v = x[i];
        x[m] = v;
        m += bin_of(v) == (uint32_t)bin;
    }
    const float thr = kth_largest(x, m, k - larger);
    if (above) {
        for (int64_t j = 0; j < m; j++)
            larger += x[j] > thr;
        *above = larger;
    }
    return thr;
}

/* mass[t]: the softmax of each of the G query heads' scores s [G, T] (row stride ld) over
   the tokens it may see (vis), summed over the group; 0 where hidden. tmp: T floats. */
void column_mass(const float *s, int64_t ld, const uint8_t *vis, int64_t G, int64_t T,
                 float *mass, float *tmp) {
    for (int64_t t = 0; t < T; t++)
        mass[t] = 0.0f;
    for (int64_t g = 0; g < G; g++) {  /* branch-free: hidden tokens get exp(-big) = 0 */
        const float *sg = s + g * ld;
        float m = HIDDEN_SCORE, l = 0.0f;
        for (int64_t t = 0; t < T; t++) {
            const float x = vis[t] ? sg[t] : HIDDEN_SCORE;
            m = x > m ? x : m;
        }
        for (int64_t t = 0; t < T; t++)
            tmp[t] = vis[t] ? sg[t] : HIDDEN_SCORE;
        l = exp_shifted(tmp, T, m);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t t = 0; t < T; t++)
            mass[t] += tmp[t] * inv;
    }
}

/* column_mass for scores already masked (hidden tokens hold HIDDEN_SCORE) whose maxima per
   head are known (top [G]): the same values, without a pass for the maxima and without
   scratch (s is overwritten by the exponentials). */
void mass_of_masked(float *s, int64_t ld, const float *top, int64_t G, int64_t T,
                    float *mass) {
    float inv[16];
    for (int64_t g = 0; g < G; g++) {
        const float l = exp_shifted(s + g * ld, T, top[g]);
        inv[g] = l > 0.0f ? 1.0f / l : 0.0f;
    }
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) {  /* every head's share of a token in one pass */
        v8 m = load8(s + t) * splat8(inv[0]);
        for (int64_t g = 1; g < G; g++)
            m += load8(s + g * ld + t) * splat8(inv[g]);
        store8(mass + t, m);
    }
    for (; t < T; t++) {
        float m = 0.0f;
        for (int64_t g = 0; g < G; g++)
            m += s[g * ld + t] * inv[g];
        mass[t] = m;
    }
}

/* Indices t0 + i of the lanes set in `bits` (8 lanes), appended at row[got ..]; row has room
   for 8 more. */
static inline int64_t append_lanes(int64_t *row, int64_t got, uint32_t bits, int64_t t0) {
#ifdef __AVX2__
    /* lane numbers of the set bits, packed to the front: from the byte-wise pdep of 0..7 */
    const uint64_t spread = _pdep_u64(bits, 0x0101010101010101ULL) * 0xFF;
    const uint64_t lanes = _pext_u64(0x0706050403020100ULL, spread);
    const __m128i idx = _mm_cvtsi64_si128((long long)lanes);
    const __m256i base = _mm256_set1_epi64x(t0);
    _mm256_storeu_si256((__m256i *)(row + got),
                        _mm256_add_epi64(_mm256_cvtepu8_epi64(idx), base));
    _mm256_storeu_si256((__m256i *)(row + got + 4),
                        _mm256_add_epi64(_mm256_cvtepu8_epi64(_mm_srli_si128(idx, 4)), base));
    return got + __builtin_popcount(bits);
#else
    for (int64_t i = 0; i < 8; i++)
        if (bits >> i & 1) row[got++] = t0 + i;
    return got;
#endif
}

/* The cap tokens with the most mass among those visible (ties: the earlier token), in token
   order, into row[0 .. cap); the rest of the row repeats them (never read). Hidden tokens
   have mass exactly 0; no mass exceeds G. tmp: T floats of scratch. */
void choose_by_mass(const float *mass, const uint8_t *vis, int64_t T, int64_t G,
                    int64_t cap, int64_t *row, int64_t width, float *tmp) {
    int64_t n = 0, u = 0;  /* the visible masses, into tmp: eight at a time where all are */
    for (; u + 8 <= T; u += 8) {
        uint64_t shown;
        __builtin_memcpy(&shown, vis + u, 8);
        if (shown == 0x0101010101010101ULL) {
            store8(tmp + n, load8(mass + u));
            n += 8;
            continue;
        }
        for (int64_t i = u; i < u + 8; i++) {
            tmp[n] = mass[i];
            n += vis[i] != 0;
        }
    }
    for (; u < T; u++) {
        tmp[n] = mass[u];
        n += vis[u] != 0;
    }
    const int64_t k = cap < n ? cap : n;
    int64_t got = 0;
    if (k > 0) {
        int64_t above;
        const float thr = kth_largest_mass(tmp, n, k, G, &above);
        int64_t ties = k - above;  /* tokens at the threshold to take, the earliest first */
        int64_t t = 0;
#ifdef __AVX2__
        const __m256 vthr = _mm256_set1_ps(thr);
        for (; t + 8 <= T && got + 8 <= width && got < k; t += 8) {
            const __m256 x = _mm256_loadu_ps(mass + t);
            uint32_t gt = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(x, vthr, _CMP_GT_OQ));
            const uint32_t eq = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(x, vthr, _CMP_EQ_OQ));
            if (eq && ties > 0)  /* rare: ties at the threshold, visible ones in token order */
                for (int64_t i = 0; i < 8; i++)
                    if ((eq >> i & 1) && vis[t + i] && ties > 0) { gt |= 1u << i; ties--; }
            got = append_lanes(row, got, gt, t);
        }
#endif
        for (; t < T && got < k; t++) {
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
        for (int64_t c = 0; c < C; c++) {
            const uint8_t *vis = visible + (c / KV) * T;
            column_mass(scores + c * G * T, T, vis, G, T, work, work + T);
            choose_by_mass(work, vis, T, G, cap[c], order + c * width, width, work + T);
        }
    }
}
