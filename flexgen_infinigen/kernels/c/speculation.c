#include "selection.h"

#define AHEAD_ROWS 64  /* speculation keys asked for this many rows ahead of the scoring */

/* InfiniGen's speculation on a CPU: approximate attention scores of the next layer's query
   heads against its packed speculation keys, and the default selection rule ("mass") on
   them.

   Speculation keys are head-major: column c (batch x KV head) keeps its rows one after the
   other, codes [L, P] bytes (8 / bits codes a byte), a minimum and a scale per row. A code
   at bit s * bits of byte j is column j * per + s of the projected key (per = 8 / bits);
   queries come with their columns in that "slot-plane" order (x[s * P + j]), so that the
   score of a row is scale * (q . codes) + lo * sum(q).

   With AVX2, 4-bit codes and P of 16 or a multiple of 32 up to 128, q is rounded to 8-bit
   integers per query head (max |q| to 127; an error far below the 4-bit keys') and
   q . codes is an integer product of bytes (vpmaddubsw), eight rows reduced at once. With
   8-bit codes and P a multiple of 16 up to 256, q is rounded to 16-bit integers (max |q| to
   Q16_MAX) and the codes widened to 16 bits for vpmaddwd. Otherwise codes are expanded to
   floats row by row. */

/* 8-bit keys' queries: |q| <= Q16_MAX so that a row's sum, 256 codes of at most 255 times
   Q16_MAX, stays below 2^31 (2.1e9 > 256 * 255 * 8191 = 5.3e8); a rounding error of 1/16382
   of the largest |q|, far below the keys' own 1/510 of their range. */
#define Q16_MAX 8191.0f

#ifdef __AVX2__
/* Eight rows' 32-bit partial sums acc[r] reduced to one vector: lane r the sum of acc[r]. */
static inline __attribute__((always_inline)) __m256i sum_rows8(const __m256i *acc) {
    const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]),
                                         _mm256_hadd_epi32(acc[2], acc[3]));
    const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[4], acc[5]),
                                         _mm256_hadd_epi32(acc[6], acc[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                            _mm256_permute2x128_si256(u0, u1, 0x31));
}

/* dots[g] (g < NG, NG <= 4): the integer products of eight rows of codes (row stride P bytes,
   P a multiple of 32) with the 8-bit queries qi[g0 + g] (low nibbles against the first P
   bytes, high ones against the next P). Each row's codes are loaded and split into nibbles
   once for all NG heads; a head's byte products of a row are summed in 16 bits (at most
   2 * 15 * 127 per pair of bytes, four pairs: no overflow) and then in 32, or with VNNI
   straight into 32 bits (common.h's q4_dpbusd): the same integers. */
static inline __attribute__((always_inline)) void dots8(const uint8_t *codes, int64_t P,
                                                        const int8_t (*qi)[256], int64_t g0,
                                                        const int NG, __m256i *dots) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
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
#ifdef Q4_VNNI  /* four byte products into each 32-bit lane at once: the same sums */
                sum[g] = q4_dpbusd(sum[g], lo4,
                                   _mm256_load_si256((const __m256i *)(qi[g0 + g] + j)));
                sum[g] = q4_dpbusd(sum[g], hi4,
                                   _mm256_load_si256((const __m256i *)(qi[g0 + g] + P + j)));
#else
                sum[g] = _mm256_add_epi16(sum[g], _mm256_maddubs_epi16(
                    lo4, _mm256_load_si256((const __m256i *)(qi[g0 + g] + j))));
                sum[g] = _mm256_add_epi16(sum[g], _mm256_maddubs_epi16(
                    hi4, _mm256_load_si256((const __m256i *)(qi[g0 + g] + P + j))));
#endif
            }
        }
        for (int g = 0; g < NG; g++)
#ifdef Q4_VNNI
            acc[g][r] = sum[g];
#else
            acc[g][r] = _mm256_madd_epi16(sum[g], _mm256_set1_epi16(1));
#endif
    }
    for (int g = 0; g < NG; g++)
        dots[g] = sum_rows8(acc[g]);
}

/* dots8 for 8-bit codes: dots[g] the products of eight rows of P bytes (P a multiple of 16)
   with the 16-bit queries qw[g0 + g], 16 codes at a time widened to 16 bits and multiplied
   pairwise into 32-bit sums (vpmaddwd). */
static inline __attribute__((always_inline)) void dots16(const uint8_t *codes, int64_t P,
                                                         const int16_t (*qw)[256], int64_t g0,
                                                         const int NG, __m256i *dots) {
    __m256i acc[4][8];
    for (int r = 0; r < 8; r++) {
        const uint8_t *row = codes + r * P;
        for (int g = 0; g < NG; g++)
            acc[g][r] = _mm256_setzero_si256();
        for (int64_t j = 0; j < P; j += 16) {
            const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + j)));
            for (int g = 0; g < NG; g++)
                acc[g][r] = _mm256_add_epi32(acc[g][r], _mm256_madd_epi16(
                    c, _mm256_load_si256((const __m256i *)(qw[g0 + g] + j))));
        }
    }
    for (int g = 0; g < NG; g++)
        dots[g] = sum_rows8(acc[g]);
}

/* dots8 for rows of exactly 32 bytes (64 columns: head dim 64), its sums across rows made
   with unpacks and adds (vphaddw/vphaddd decode into several micro-ops, an unpack into one). A row's
   byte products for a head (16 lanes of 16 bits, each at most 2 * 2 * 15 * 127 = 7620) are
   folded twice in 16 bits, the lanes of one row kept side by side (32-bit then 64-bit
   unpacks of two rows, added: at most 4 * 7620 = 30480, no overflow), then widened by
   vpmaddwd, which adds each row's two neighbouring lanes. */
static inline __attribute__((always_inline)) __m256i fold_rows2(__m256i a, __m256i b) {
    /* [a01 b01 a23 b23 | ...] + [a45 b45 a67 b67 | ...]: int16 pairs of one row stay adjacent */
    return _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}

static inline __attribute__((always_inline)) __m256i fold_rows4(__m256i ab, __m256i cd) {
    return _mm256_add_epi16(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

static inline __attribute__((always_inline)) void dots8_p32(const uint8_t *codes,
                                                            const int8_t (*qi)[256], int64_t g0,
                                                            const int NG, __m256i *dots) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i quad[2][4];
    for (int h = 0; h < 2; h++) {
        __m256i pair[2][4];
        for (int p = 0; p < 2; p++) {
            __m256i row[2][4];
            for (int r = 0; r < 2; r++) {
                const __m256i c = _mm256_loadu_si256(
                    (const __m256i *)(codes + (4 * h + 2 * p + r) * 32));
                const __m256i lo4 = _mm256_and_si256(c, nibble);
                const __m256i hi4 = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
                for (int g = 0; g < NG; g++)
                    row[r][g] = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo4, _mm256_load_si256((const __m256i *)qi[g0 + g])),
                        _mm256_maddubs_epi16(hi4, _mm256_load_si256(
                            (const __m256i *)(qi[g0 + g] + 32))));
            }
            for (int g = 0; g < NG; g++)
                pair[p][g] = fold_rows2(row[0][g], row[1][g]);
        }
        for (int g = 0; g < NG; g++)  /* per 128-bit half: rows 4h .. 4h + 3, one lane each */
            quad[h][g] = _mm256_madd_epi16(fold_rows4(pair[0][g], pair[1][g]), ones);
    }
    for (int g = 0; g < NG; g++)  /* [rows 0-3 | 0-3] and [4-7 | 4-7], 128-bit halves */
        dots[g] = _mm256_add_epi32(_mm256_permute2x128_si256(quad[0][g], quad[1][g], 0x20),
                                   _mm256_permute2x128_si256(quad[0][g], quad[1][g], 0x31));
}

/* dots8 for rows of 16 bytes (32 columns: keys of half a head of 64), two rows to a
   vector: each head's products of a vector (eight lanes of 16 bits per row) folded as
   dots8_p32 folds them (at most 4 * 7620 = 30480), giving rows [0 2 4 6 | 1 3 5 7], put in
   order by one permute. The query's 16 bytes of a slot plane are read into both halves. */
static inline __attribute__((always_inline)) void dots8_p16(const uint8_t *codes,
                                                            const int8_t (*qi)[256], int64_t g0,
                                                            const int NG, __m256i *dots) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i pair[2][4];
    for (int p = 0; p < 2; p++) {
        __m256i two[2][4];
        for (int r = 0; r < 2; r++) {  /* rows 4p + 2r and 4p + 2r + 1 */
            const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + (2 * p + r) * 32));
            const __m256i lo4 = _mm256_and_si256(c, nibble);
            const __m256i hi4 = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
            for (int g = 0; g < NG; g++)
                two[r][g] = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo4, _mm256_broadcastsi128_si256(
                        _mm_load_si128((const __m128i *)qi[g0 + g]))),
                    _mm256_maddubs_epi16(hi4, _mm256_broadcastsi128_si256(
                        _mm_load_si128((const __m128i *)(qi[g0 + g] + 16)))));
        }
        for (int g = 0; g < NG; g++)
            pair[p][g] = fold_rows2(two[0][g], two[1][g]);
    }
    for (int g = 0; g < NG; g++)
        dots[g] = _mm256_permutevar8x32_epi32(
            _mm256_madd_epi16(fold_rows4(pair[0][g], pair[1][g]), ones), order);
}

/* Eight rows' scores for the NG heads g0 .. g0 + NG: scale * (q . codes) + lo * sum(q), into
   s[g * ld .. + 8]; with `masked`, hidden rows (lanes of `shown` clear) get HIDDEN_SCORE and
   vbest[g] keeps each head's largest. 4-bit codes against qi, or (qw not NULL) 8-bit ones
   against qw. */
static inline __attribute__((always_inline)) void block8(
        const uint8_t *rows, int64_t P, const int8_t (*qi)[256], const int16_t (*qw)[256],
        int64_t g0, const int NG, v8 sc, v8 lo8, const float *qscale, const float *qsum,
        int masked, __m256 shown, v8 *vbest, float *s, int64_t ld) {
    __m256i d[4];
    if (qw)
        dots16(rows, P, qw, g0, NG, d);
    else if (P == 32)
        dots8_p32(rows, qi, g0, NG, d);
    else if (P == 16)
        dots8_p16(rows, qi, g0, NG, d);
    else
        dots8(rows, P, qi, g0, NG, d);
    for (int g = 0; g < NG; g++) {
        v8 y = (v8)_mm256_cvtepi32_ps(d[g]) * (sc * splat8(qscale[g0 + g]))
               + lo8 * splat8(qsum[g0 + g]);
        if (masked) {
            y = (v8)_mm256_blendv_ps(_mm256_set1_ps(HIDDEN_SCORE), (__m256)y, shown);
            vbest[g0 + g] = (v8)_mm256_max_ps((__m256)vbest[g0 + g], (__m256)y);
        }
        store8(s + (g0 + g) * ld, y);
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
    const int four = bits == 4 && (P == 16 || (P % 32 == 0 && P <= 128));
    const int eight = bits == 8 && P % 16 == 0 && P <= 256;
    if (four || eight) {
        int8_t qi[16][256] __attribute__((aligned(32)));
        int16_t qw_[16][256] __attribute__((aligned(32)));
        const int16_t (*qw)[256] = eight ? (const int16_t (*)[256])qw_ : NULL;
        const float top_q = eight ? Q16_MAX : 127.0f;
        float qscale[16];
        for (int64_t g = 0; g < G; g++) {
            float m = 0.0f;
            for (int64_t w = 0; w < W; w++)
                m = fabsf(q[g * W + w]) > m ? fabsf(q[g * W + w]) : m;
            qscale[g] = m > 0.0f ? m / top_q : 1.0f;
            for (int64_t w = 0; w < W; w++) {
                const long v = lrintf(q[g * W + w] / qscale[g]);
                if (eight)
                    qw_[g][w] = (int16_t)v;
                else
                    qi[g][w] = (int8_t)v;
                rounded[g * W + w] = v * qscale[g];
            }
        }
        q = rounded;
        v8 vbest[16];
        for (int64_t g = 0; g < G; g++)
            vbest[g] = splat8(HIDDEN_SCORE);
        for (; t + 8 <= T; t += 8) {
            __m256 shown = _mm256_setzero_ps();
            if (vis) {
                const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(vis + t)));
                shown = _mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_setzero_si256()));
            }
            const v8 sc = load8(scale + t), lo8 = load8(lo + t);
            const uint8_t *rows = codes + t * P;
            /* the codes, scales and minimums 64 rows on, asked for, so that keys too large
               for the cache arrive while this block scores (asks past the end of the keys
               do not fault) */
            for (int64_t k = 0; k < 8 * P; k += 64)
                _mm_prefetch((const char *)(rows + AHEAD_ROWS * P + k), _MM_HINT_T0);
            if ((t & 15) == 0) {
                _mm_prefetch((const char *)(scale + t + AHEAD_ROWS), _MM_HINT_T0);
                _mm_prefetch((const char *)(lo + t + AHEAD_ROWS), _MM_HINT_T0);
            }
            const int masked = vis != NULL;
            for (int64_t g0 = 0; g0 < G; g0 += 4) {  /* head counts as constants: in registers */
#define BLOCK8(NG) block8(rows, P, qi, qw, g0, NG, sc, lo8, qscale, qsum, masked, shown, \
                          vbest, s + t, ld)
                const int64_t ng = G - g0 < 4 ? G - g0 : 4;
                if (ng == 4) BLOCK8(4);
                else if (ng == 3) BLOCK8(3);
                else if (ng == 2) BLOCK8(2);
                else BLOCK8(1);
#undef BLOCK8
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
