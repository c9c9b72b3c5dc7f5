/* Decode attention's shared pieces (attention.c: float rows; attention_q4.c: 4-bit rows):
   one block of rows scored and added into each head's running softmax state, and the
   states of a column's ranges merged. Static: each kernel file has its own copy, inlined
   where it is used. */
#ifndef FLEXGEN_INFINIGEN_ATTENTION_H
#define FLEXGEN_INFINIGEN_ATTENTION_H
#include "common.h"

/* Decode attention: one query token per sequence, keys and values read where the cache
   keeps them. A cache is [T, C, D] rows (C = batch x KV heads columns), each row of D floats
   contiguous; row t of column c sits at t * st + c * sc floats: token-major (st = C * D,
   sc = D) or head-major (st = D, sc = T' * D: every column's rows one after the other, the
   layout a CPU cache uses, so that a column is read as one stream). q: [C, G, D], pre-scaled;
   D a multiple of 8, at most 256; G at most 16.

   Work items are (column, range of rows), so that every thread has work when columns are few;
   an item walks its rows in blocks of TB: the block's G scores (three or two heads against
   four rows at a time, the partial sums in registers), each head's running softmax (max m, sum
   l), then the block's values added into each head's weighted sum (up to three heads, even
   and odd rows in separate registers). A (column, head) state is m, l and D sums; the states
   of a column's ranges are merged at the end. */
#define TB 64
/* rows read ahead are asked for into L2 (locality 2): two blocks of K and V ahead are 64 KB,
   twice L1, so rows asked for into L1 are evicted before their turn */
#define AHEAD_LOCALITY 2
#ifndef NEXT
#define NEXT (2 * TB)  /* attention over every row asks for the rows this many rows on */
#endif
#ifndef AHEAD
#define AHEAD 48  /* selected rows are asked for this many rows before they are read */
#endif

static inline float dot(const float *a, const float *b, int64_t D) {
    v8 s0 = {0}, s1 = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        s0 += load8(a + d) * load8(b + d);
        s1 += load8(a + d + 8) * load8(b + d + 8);
    }
    for (; d < D; d += 8)
        s0 += load8(a + d) * load8(b + d);
    return hsum8(s0 + s1);
}

/* Eight sums at once: lane j of the result is the sum of the lanes of a[j]. */
static inline v8 reduce8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
#ifdef __AVX__
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_permute2f128_ps(u0, u1, 0x20) + _mm256_permute2f128_ps(u0, u1, 0x31);
#else
    return (v8){hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3), hsum8(a4), hsum8(a5), hsum8(a6),
                hsum8(a7)};
#endif
}

/* The rows ahead[*asked .. upto) asked for (spread over the block, not a burst). */
static inline void ask_ahead(const float *const *ahead, int64_t n_ahead, int64_t *asked,
                             int64_t upto, int64_t D) {
    for (; *asked < n_ahead && *asked < upto; (*asked)++)
        for (int64_t d = 0; d < D; d += 16)
            __builtin_prefetch(ahead[*asked] + d, 0, AHEAD_LOCALITY);
}

/* s[g * TB + i] = q[g] . rows[i] for every head g < G and row i < n: with an odd G of 3 or
   more, the first three heads against four rows at a time (twelve sums in registers, each
   row loaded once for the three), then heads in pairs against four rows (eight sums), an
   odd last head (G = 1) against eight rows. The rows ``ahead`` (of a later block) are asked
   for along the way, spread evenly over every pass over the rows. */
static void score_block(const float *q, const float *const *rows, int64_t n, int64_t G,
                        int64_t D, float *s, const float *const *ahead, int64_t n_ahead) {
    int64_t g = 0, asked = 0;
    /* the passes over the rows (a triple of heads, pairs, a single head). Asking for every
       row ahead during the first pass (as before) stalled that pass on the full queue of
       outstanding misses while the later passes, reading from cache, left memory idle. */
    const int64_t passes = (G >= 3 && G % 2 == 1) ? 1 + (G - 3) / 2 : G / 2 + G % 2;
    int64_t pass = 0;
#define SPREAD(i) ((n_ahead * (pass * n + (i)) + passes * n - 1) / (passes * n))
    if (G % 2 == 1 && G >= 3) {
        const float *q0 = q, *q1 = q + D, *q2 = q + 2 * D;
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
            ask_ahead(ahead, n_ahead, &asked, SPREAD(i + 4), D);
            const float *r0 = rows[i], *r1 = rows[i + 1], *r2 = rows[i + 2], *r3 = rows[i + 3];
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            v8 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
            for (int64_t d = 0; d < D; d += 8) {
                const v8 x = load8(q0 + d), y = load8(q1 + d), z = load8(q2 + d);
                v8 k = load8(r0 + d);
                a0 += k * x; b0 += k * y; c0 += k * z;
                k = load8(r1 + d);
                a1 += k * x; b1 += k * y; c1 += k * z;
                k = load8(r2 + d);
                a2 += k * x; b2 += k * y; c2 += k * z;
                k = load8(r3 + d);
                a3 += k * x; b3 += k * y; c3 += k * z;
            }
            const v8 r = reduce8(a0, a1, a2, a3, b0, b1, b2, b3);
            const v8 zero = {0};
            const v8 u = reduce8(c0, c1, c2, c3, zero, zero, zero, zero);
            float *s0 = s + i, *s1 = s0 + TB, *s2 = s1 + TB;
            s0[0] = r[0]; s0[1] = r[1]; s0[2] = r[2]; s0[3] = r[3];
            s1[0] = r[4]; s1[1] = r[5]; s1[2] = r[6]; s1[3] = r[7];
            s2[0] = u[0]; s2[1] = u[1]; s2[2] = u[2]; s2[3] = u[3];
        }
        for (; i < n; i++) {
            s[i] = dot(q0, rows[i], D);
            s[TB + i] = dot(q1, rows[i], D);
            s[2 * TB + i] = dot(q2, rows[i], D);
        }
        g = 3;
        pass++;
    }
    for (; g + 2 <= G; g += 2) {
        const float *q0 = q + g * D, *q1 = q0 + D;
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
            ask_ahead(ahead, n_ahead, &asked, SPREAD(i + 4), D);
            const float *r0 = rows[i], *r1 = rows[i + 1], *r2 = rows[i + 2], *r3 = rows[i + 3];
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            for (int64_t d = 0; d < D; d += 8) {
                const v8 x = load8(q0 + d), y = load8(q1 + d);
                const v8 k0 = load8(r0 + d), k1 = load8(r1 + d), k2 = load8(r2 + d),
                         k3 = load8(r3 + d);
                a0 += k0 * x; a1 += k1 * x; a2 += k2 * x; a3 += k3 * x;
                b0 += k0 * y; b1 += k1 * y; b2 += k2 * y; b3 += k3 * y;
            }
            const v8 r = reduce8(a0, a1, a2, a3, b0, b1, b2, b3);
            float *s0 = s + g * TB + i, *s1 = s0 + TB;
            s0[0] = r[0]; s0[1] = r[1]; s0[2] = r[2]; s0[3] = r[3];
            s1[0] = r[4]; s1[1] = r[5]; s1[2] = r[6]; s1[3] = r[7];
        }
        for (; i < n; i++) {
            s[g * TB + i] = dot(q0, rows[i], D);
            s[(g + 1) * TB + i] = dot(q1, rows[i], D);
        }
        pass++;
    }
    if (g < G) {
        const float *q0 = q + g * D;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            ask_ahead(ahead, n_ahead, &asked, SPREAD(i + 8), D);
            const float *const *r = rows + i;
            v8 a[8] = {{0}};
            for (int64_t d = 0; d < D; d += 8) {
                const v8 x = load8(q0 + d);
                for (int j = 0; j < 8; j++)
                    a[j] += load8(r[j] + d) * x;
            }
            store8(s + g * TB + i, reduce8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
        }
        for (; i < n; i++)
            s[g * TB + i] = dot(q0, rows[i], D);
    }
    ask_ahead(ahead, n_ahead, &asked, n_ahead, D);
#undef SPREAD
}

/* acc[g0 + g] += sum_i p[(g0 + g) * TB + i] * rows[i] for NG <= 3 heads, W vectors of 8
   floats of the row at a time (D a multiple of 8 * W, NG * W <= 12): the NG * W sums stay
   in registers for the whole block (every size a constant once inlined), a row's values
   loaded once for the NG heads. The rows ``ahead`` (of a later block) are asked for, one
   per row added. */
static inline __attribute__((always_inline)) void add_values_w(
        const float *p, const float *const *rows, int64_t n, int64_t g0, const int NG,
        const int W, int64_t D, float *const *acc, const float *const *ahead, int64_t n_ahead) {
    for (int64_t d = 0; d < D; d += 8 * W) {
        v8 a[3][8];
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < W; j++)
                a[g][j] = load8(acc[g0 + g] + d + 8 * j);
        for (int64_t i = 0; i < n; i++) {
            if (d == 0 && i < n_ahead)
                for (int64_t e = 0; e < D; e += 16)
                    __builtin_prefetch(ahead[i] + e, 0, AHEAD_LOCALITY);
            const float *r = rows[i] + d;
            v8 pg[3];
            for (int g = 0; g < NG; g++)
                pg[g] = splat8(p[(g0 + g) * TB + i]);
            for (int j = 0; j < W; j++) {
                const v8 x = load8(r + 8 * j);
                for (int g = 0; g < NG; g++)
                    a[g][j] += pg[g] * x;
            }
        }
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < W; j++)
                store8(acc[g0 + g] + d + 8 * j, a[g][j]);
    }
}

/* The values of a block added for heads g0 .. g0 + NG (NG <= 3): as many vectors of the row
   at a time as keep at least eight independent sums where D allows. */
static void add_values(const float *p, const float *const *rows, int64_t n, int64_t g0,
                       int64_t NG, int64_t D, float *const *acc, const float *const *va,
                       int64_t nva) {
    if (NG == 3 && D % 32 == 0) add_values_w(p, rows, n, g0, 3, 4, D, acc, va, nva);
    else if (NG == 2 && D % 32 == 0) add_values_w(p, rows, n, g0, 2, 4, D, acc, va, nva);
    else if (NG == 1 && D % 64 == 0) add_values_w(p, rows, n, g0, 1, 8, D, acc, va, nva);
    else if (NG == 3) add_values_w(p, rows, n, g0, 3, 1, D, acc, va, nva);
    else if (NG == 2) add_values_w(p, rows, n, g0, 2, 1, D, acc, va, nva);
    else add_values_w(p, rows, n, g0, 1, 1, D, acc, va, nva);
}

/* One block of n <= TB rows for one column: scores (plus bias[i] when given), the running
   softmax of each head updated, the values added. state: G x (m, l, acc[D]). The rows
   ``ahead`` are asked for while the block scores, ``vahead`` while it adds values. */
static void attend_block(const float *q, const float *const *krows, const float *const *vrows,
                         const float *bias, int64_t n, int64_t G, int64_t D, float *state,
                         float *s, const float *const *ahead, int64_t n_ahead,
                         const float *const *vahead, int64_t n_vahead) {
    score_block(q, krows, n, G, D, s, ahead, n_ahead);
    float *acc[16];
    int64_t g;
    for (g = 0; g < G; g++) {
        float *sg = s + g * TB, *st = state + g * (D + 2);
        if (bias)
            for (int64_t i = 0; i < n; i++)
                sg[i] += bias[i];
        float m = st[0];
        for (int64_t i = 0; i < n; i++)
            m = sg[i] > m ? sg[i] : m;
        const float rescale = expf(st[0] - m);
        const float l = exp_shifted(sg, n, m);
        st[0] = m;
        st[1] = st[1] * rescale + l;
        acc[g] = st + 2;
        if (rescale != 1.0f)
            for (int64_t d = 0; d < D; d++)
                acc[g][d] *= rescale;
    }
    for (g = 0; g < G; g += 3)
        add_values(s, vrows, n, g, G - g < 3 ? G - g : 3, D, acc, g == 0 ? vahead : NULL,
                   g == 0 ? n_vahead : 0);
}

static void init_states(float *state, int64_t n, int64_t D) {
    for (int64_t i = 0; i < n; i++) {
        float *st = state + i * (D + 2);
        st[0] = -3.0e38f;
        st[1] = 0.0f;
        for (int64_t d = 0; d < D; d++)
            st[2 + d] = 0.0f;
    }
}

/* out[c, g] from the states of `parts` ranges of every (column, head): range r's state of
   (column, head) cg, (m, l, acc[D]), at part + (r * CG + cg) * (D + 2). sinks: NULL, or a
   logit per (column, head) [CG] that joins the normalizer with no value (gpt-oss's
   attention sinks): a state (sink, 1, 0) merged with the ranges'. */
static void merge_states(float *out, const float *part, int64_t CG, int64_t D, int64_t parts,
                         const float *sinks) {
    for (int64_t cg = 0; cg < CG; cg++) {
        float m = sinks ? sinks[cg] : -3.0e38f, l = 0.0f;
        for (int64_t r = 0; r < parts; r++) {
            const float mr = part[(r * CG + cg) * (D + 2)];
            m = mr > m ? mr : m;
        }
        if (sinks)
            l = expf(sinks[cg] - m);
        float *o = out + cg * D;
        for (int64_t d = 0; d < D; d++)
            o[d] = 0.0f;
        for (int64_t r = 0; r < parts; r++) {
            const float *st = part + (r * CG + cg) * (D + 2);
            if (st[1] == 0.0f)
                continue;
            const float w = expf(st[0] - m);
            l += w * st[1];
            for (int64_t d = 0; d < D; d++)
                o[d] += w * st[2 + d];
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int64_t d = 0; d < D; d++)
            o[d] *= inv;
    }
}

/* A column's rows are walked from its first unmasked one (a bias above MASKED; left
   padding and keys past a sliding window are masked) in ranges of RANGE rows, and the
   ranges' states merged in order. The cut depends on the column's own rows only, never on
   how many columns or threads there are: a row's sums fall in the same ranges, blocks and
   lanes alone, left-padded, or beside any other rows, so that at temperature 0 a request
   answers what it answers alone (8-bit activations turn the last bit of a difference into
   a different token). A column whose every row is masked is walked whole. */
#define RANGE (16 * TB)
#define MASKED (-1.0e30f)

static inline int64_t first_unmasked(const float *bias, int64_t T) {
    for (int64_t t = 0; t < T; t++)
        if (bias[t] > MASKED)
            return t;
    return 0;
}

/* Each column's first unmasked row (bias [C, T], or NULL: row 0), found once for all the
   column's ranges; the caller frees it. */
static int64_t *first_rows(const float *bias, int64_t C, int64_t T) {
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (C > 0 ? C : 1));
    for (int64_t c = 0; c < C; c++)
        first[c] = bias ? first_unmasked(bias + c * T, T) : 0;
    return first;
}

/* Ranges of the longest column (a shorter column's last ones are empty). */
static inline int64_t ranges_of(int64_t rows) {
    const int64_t r = (rows + RANGE - 1) / RANGE;
    return r < 1 ? 1 : r;
}

#endif
