/* The CPU kernels of flexgen_infinigen (cpu_kernels.py compiles and loads them). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* One row's codes as floats, slot plane after slot plane: x[s * P + j] is the code at
   bit s * bits of byte j (the query's columns are permuted to match by the caller). */
static inline __attribute__((always_inline)) void expand(const uint8_t *row, float *x,
                                                         const int64_t P, const int64_t bits) {
    const int64_t per = 8 / bits, mask = (1 << bits) - 1;
    for (int64_t s = 0; s < per; s++)
        for (int64_t j = 0; j < P; j++)
            x[s * P + j] = (float)((row[j] >> (s * bits)) & mask);
}

static inline __attribute__((always_inline)) void score_rows(
        const uint8_t *codes, const float *scale, const float *lo, const float *qc,
        const float *qs, float *out, int64_t T, int64_t C, int64_t c, int64_t t0, int64_t t1,
        const int64_t P, const int64_t G, const int64_t bits) {
    const int64_t W = P * (8 / bits);
    float x[256];
    for (int64_t t = t0; t < t1; t++) {
        expand(codes + (t * C + c) * P, x, P, bits);
        const float sc = scale[t * C + c], mn = lo[t * C + c];
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qc + g * W;
            float acc = 0.0f;
            for (int64_t w = 0; w < W; w++)
                acc += qg[w] * x[w];
            out[g * T + t] = sc * acc + mn * qs[g];
        }
    }
}

/* out[c, g, t] = scale[t, c] * sum_w q[c, g, w] * code(t, c, w) + lo[t, c] * qsum[c, g]
   codes: [T, C, P] bytes of 8 / bits codes; scale, lo: [T, C]; q: [C, G, W] (W = P * 8 /
   bits, columns in slot-plane order); qsum: [C, G]. Common shapes get constant sizes, so
   that the compiler unrolls and vectorizes them. */
void score_packed(const uint8_t *codes, const float *scale, const float *lo, const float *q,
                  const float *qsum, float *out, int64_t T, int64_t C, int64_t P, int64_t G,
                  int64_t bits, int64_t nthreads) {
    const int64_t W = P * (8 / bits), block = 256, blocks = (T + block - 1) / block;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < C; c++) {
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t t0 = b * block, t1 = t0 + block < T ? t0 + block : T;
            const float *qc = q + c * G * W, *qs = qsum + c * G;
            float *oc = out + c * G * T;
            if (P == 32 && bits == 4 && G == 1)
                score_rows(codes, scale, lo, qc, qs, oc, T, C, c, t0, t1, 32, 1, 4);
            else if (P == 32 && bits == 4 && G == 2)
                score_rows(codes, scale, lo, qc, qs, oc, T, C, c, t0, t1, 32, 2, 4);
            else if (P == 32 && bits == 4 && G == 3)
                score_rows(codes, scale, lo, qc, qs, oc, T, C, c, t0, t1, 32, 3, 4);
            else if (P == 32 && bits == 4 && G == 4)
                score_rows(codes, scale, lo, qc, qs, oc, T, C, c, t0, t1, 32, 4, 4);
            else if (P == 32 && bits == 4 && G == 7)
                score_rows(codes, scale, lo, qc, qs, oc, T, C, c, t0, t1, 32, 7, 4);
            else if (P == 32 && bits == 4 && G == 8)
                score_rows(codes, scale, lo, qc, qs, oc, T, C, c, t0, t1, 32, 8, 4);
            else if (P == 32 && bits == 4)
                score_rows(codes, scale, lo, qc, qs, oc, T, C, c, t0, t1, 32, G, 4);
            else
                score_rows(codes, scale, lo, qc, qs, oc, T, C, c, t0, t1, P, G, bits);
        }
    }
}

/* out[m, o] = sum_k x[m, k] * w[o, k] (+ bias[o]): a decode step's linear layer, each weight
   row read once and dotted with every row of x while it is in cache. Four weight rows at a
   time, so that four independent sums hide the multiply-add latency. */
static inline __attribute__((always_inline)) void dot4(const float *x, const float *w,
                                                       int64_t K, float *acc) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        const float xk = x[k];
        a0 += w0[k] * xk; a1 += w1[k] * xk; a2 += w2[k] * xk; a3 += w3[k] * xk;
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
}

static inline __attribute__((always_inline)) void dot4x2(const float *x, const float *y,
                                                         const float *w, int64_t K,
                                                         float *acc) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f,
          b3 = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        const float xk = x[k], yk = y[k];
        a0 += w0[k] * xk; a1 += w1[k] * xk; a2 += w2[k] * xk; a3 += w3[k] * xk;
        b0 += w0[k] * yk; b1 += w1[k] * yk; b2 += w2[k] * yk; b3 += w3[k] * yk;
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3;
    acc[4] = b0; acc[5] = b1; acc[6] = b2; acc[7] = b3;
}

void linear_rows(const float *x, const float *w, const float *bias, float *out, int64_t M,
                 int64_t N, int64_t K, int64_t nthreads) {
    const int64_t blocks = N / 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < blocks; b++) {
        float acc[8];
        int64_t m = 0;
        for (; m + 1 < M; m += 2) {  /* two rows of x against the four weight rows */
            dot4x2(x + m * K, x + (m + 1) * K, w + 4 * b * K, K, acc);
            for (int64_t i = 0; i < 4; i++) {
                const float add = bias ? bias[4 * b + i] : 0.0f;
                out[m * N + 4 * b + i] = acc[i] + add;
                out[(m + 1) * N + 4 * b + i] = acc[4 + i] + add;
            }
        }
        for (; m < M; m++) {
            dot4(x + m * K, w + 4 * b * K, K, acc);
            for (int64_t i = 0; i < 4; i++)
                out[m * N + 4 * b + i] = acc[i] + (bias ? bias[4 * b + i] : 0.0f);
        }
    }
    for (int64_t o = 4 * blocks; o < N; o++)
        for (int64_t m = 0; m < M; m++) {
            float a = 0.0f;
            for (int64_t k = 0; k < K; k++)
                a += w[o * K + k] * x[m * K + k];
            out[m * N + o] = a + (bias ? bias[o] : 0.0f);
        }
}

/* Decode attention of one query token per sequence over token-major cache rows.
   q: [C, G, D] (pre-scaled); k, v: T rows of [C, D], row stride C * D; bias: [C, T];
   out: [C, G, D]; D a multiple of 8, at most 256. Work items are (column, chunk of CH
   tokens): each keeps its scores, their max and sum and its weighted sum of values (in
   registers, 8 floats a vector); the chunks of a column are merged after. */
#define CH 512
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 r; __builtin_memcpy(&r, p, 32); return r; }

static inline float dot(const float *a, const float *b, int64_t D) {
    v8 s0 = {0}, s1 = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        s0 += load8(a + d) * load8(b + d);
        s1 += load8(a + d + 8) * load8(b + d + 8);
    }
    for (; d < D; d += 8)
        s0 += load8(a + d) * load8(b + d);
    s0 += s1;
    return s0[0] + s0[1] + s0[2] + s0[3] + s0[4] + s0[5] + s0[6] + s0[7];
}

/* The chunks of every column combined: rescaled by their max, normalized by the sum. */
static void merge_chunks(float *out, const float *part, int64_t C, int64_t G, int64_t D,
                         int64_t chunks) {
    const int64_t stride = G * (D + 2);
    for (int64_t c = 0; c < C; c++)
        for (int64_t g = 0; g < G; g++) {
            float m = -3.0e38f, l = 0.0f;
            for (int64_t h = 0; h < chunks; h++) {
                const float mh = part[(c * chunks + h) * stride + g * (D + 2)];
                m = mh > m ? mh : m;
            }
            float *o = out + (c * G + g) * D;
            for (int64_t d = 0; d < D; d++)
                o[d] = 0.0f;
            for (int64_t h = 0; h < chunks; h++) {
                const float *r = part + (c * chunks + h) * stride + g * (D + 2);
                const float w = expf(r[0] - m);
                l += w * r[1];
                for (int64_t d = 0; d < D; d++)
                    o[d] += w * r[2 + d];
            }
            for (int64_t d = 0; d < D; d++)
                o[d] /= l;
        }
}

void attend_rows(const float *q, const float *k, const float *v, const float *bias,
                 float *out, float *part, int64_t T, int64_t C, int64_t G, int64_t D,
                 int64_t nthreads) {
    const int64_t chunks = (T + CH - 1) / CH, stride = G * (D + 2), V = D / 8;
    /* a thread takes whole chunks of tokens and, token by token, every column: it streams
       one contiguous block of the cache (a column's rows alone are C * D floats apart) */
    #pragma omp parallel num_threads(nthreads)
    {
        float *s = (float *)malloc(sizeof(float) * C * G * CH);
        #pragma omp for schedule(static)
        for (int64_t h = 0; h < chunks; h++) {
            const int64_t t0 = h * CH, n = (t0 + CH < T ? CH : T - t0);
            for (int64_t i = 0; i < n; i++)
                for (int64_t c = 0; c < C; c++) {
                    const float *kr = k + ((t0 + i) * C + c) * D;
                    const float bi = bias[c * T + t0 + i];
                    for (int64_t g = 0; g < G; g++)
                        s[(c * G + g) * CH + i] = dot(q + (c * G + g) * D, kr, D) + bi;
                }
            for (int64_t cg = 0; cg < C * G; cg++) {
                float *sg = s + cg * CH, m = -3.0e38f, l = 0.0f;
                for (int64_t i = 0; i < n; i++)
                    m = sg[i] > m ? sg[i] : m;
                for (int64_t i = 0; i < n; i++) {
                    sg[i] = expf(sg[i] - m);
                    l += sg[i];
                }
                float *r = part + ((cg / G) * chunks + h) * stride + (cg % G) * (D + 2);
                r[0] = m;
                r[1] = l;
                for (int64_t d = 0; d < D; d++)
                    r[2 + d] = 0.0f;
            }
            for (int64_t i = 0; i < n; i++)
                for (int64_t c = 0; c < C; c++) {
                    const float *vr = v + ((t0 + i) * C + c) * D;
                    for (int64_t g = 0; g < G; g++) {
                        float *acc = part + (c * chunks + h) * stride + g * (D + 2) + 2;
                        const v8 p = (v8){0} + s[(c * G + g) * CH + i];
                        for (int64_t j = 0; j < V; j++) {
                            v8 a = load8(acc + 8 * j) + p * load8(vr + 8 * j);
                            __builtin_memcpy(acc + 8 * j, &a, 32);
                        }
                    }
                }
        }
        free(s);
    }
    merge_chunks(out, part, C, G, D, chunks);
}

/* Decode attention over chosen rows of a token-major cache, read in place (InfiniGen's
   selected tokens): column c attends to rows index[c, 0 .. counts[c]) of k and v (each
   [T, C, D] in memory, row stride C * D), then to its new token k_new[c], v_new[c].
   q: [C, G, D] pre-scaled; out: [C, G, D]; part: scratch of C * chunks * G * (D + 2). */
void attend_indexed(const float *q, const float *k, const float *v, const int64_t *index,
                    const int64_t *counts, int64_t n, const float *k_new, const float *v_new,
                    float *out, float *part, int64_t C, int64_t G, int64_t D,
                    int64_t nthreads) {
    const int64_t chunks = (n + 1 + CH - 1) / CH, stride = G * (D + 2), V = D / 8;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < C; c++) {
        for (int64_t h = 0; h < chunks; h++) {
            const int64_t used = counts[c] + 1;  /* the selected rows and the new token */
            const int64_t t0 = h * CH, t1 = (t0 + CH < used ? t0 + CH : used);
            float *res = part + (c * chunks + h) * stride;
            float s[16 * CH];
            for (int64_t g = 0; g < G; g++) {
                float *r = res + g * (D + 2);
                r[0] = -3.0e38f;
                r[1] = 0.0f;
                for (int64_t d = 0; d < D; d++)
                    r[2 + d] = 0.0f;
            }
            if (t1 <= t0)
                continue;
            for (int64_t i = t0; i < t1; i++) {
                if (i + 8 < counts[c]) {  /* scattered rows: ask for one a few rows ahead */
                    const float *ahead = k + (index[c * n + i + 8] * C + c) * D;
                    for (int64_t d = 0; d < D; d += 16)
                        __builtin_prefetch(ahead + d);
                }
                const float *kr = i < counts[c] ? k + (index[c * n + i] * C + c) * D
                                                : k_new + c * D;
                for (int64_t g = 0; g < G; g++)
                    s[g * CH + i - t0] = dot(q + (c * G + g) * D, kr, D);
            }
            for (int64_t g = 0; g < G; g++) {
                float *sg = s + g * CH, m = -3.0e38f, l = 0.0f;
                for (int64_t i = 0; i < t1 - t0; i++)
                    m = sg[i] > m ? sg[i] : m;
                for (int64_t i = 0; i < t1 - t0; i++) {
                    sg[i] = expf(sg[i] - m);
                    l += sg[i];
                }
                v8 acc[32];
                for (int64_t j = 0; j < V; j++)
                    acc[j] = (v8){0};
                for (int64_t i = t0; i < t1; i++) {
                    if (g == 0 && i + 8 < counts[c]) {
                        const float *ahead = v + (index[c * n + i + 8] * C + c) * D;
                        for (int64_t d = 0; d < D; d += 16)
                            __builtin_prefetch(ahead + d);
                    }
                    const float *vr = i < counts[c] ? v + (index[c * n + i] * C + c) * D
                                                    : v_new + c * D;
                    const v8 p = (v8){0} + sg[i - t0];
                    for (int64_t j = 0; j < V; j++)
                        acc[j] += p * load8(vr + 8 * j);
                }
                float *r = res + g * (D + 2);
                r[0] = m;
                r[1] = l;
                __builtin_memcpy(r + 2, acc, D * sizeof(float));
            }
        }
    }
    merge_chunks(out, part, C, G, D, chunks);
}

/* The k-th largest of x[0 .. n) (k >= 1), by quickselect on a scratch copy. */
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

/* InfiniGen's default selection rule ("mass") for every column c of C = b * KV: the softmax
   of each of its G query heads' scores over the tokens it may see, summed over the group;
   then the cap[c] tokens with the most mass (ties: the earlier token), in token order, into
   order[c, 0 .. cap[c]); the rest of the row repeats them (never read).
   scores: [C, G, T]; visible: [b, T] bytes (1: may be chosen); work: 2 * C * T floats. */
void select_mass(const float *scores, const uint8_t *visible, const int64_t *cap,
                 int64_t *order, float *work, int64_t C, int64_t KV, int64_t G, int64_t T,
                 int64_t width, int64_t nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < C; c++) {
        const uint8_t *vis = visible + (c / KV) * T;
        float *mass = work + 2 * c * T, *tmp = mass + T;
        for (int64_t t = 0; t < T; t++)
            mass[t] = 0.0f;
        for (int64_t g = 0; g < G; g++) {  /* branch-free: hidden tokens get exp(-big) = 0 */
            const float *s = scores + (c * G + g) * T;
            float m = -3.0e38f, l = 0.0f;
            for (int64_t t = 0; t < T; t++) {
                const float x = vis[t] ? s[t] : -3.0e38f;
                m = x > m ? x : m;
            }
            for (int64_t t = 0; t < T; t++) {
                tmp[t] = expf((vis[t] ? s[t] : -3.0e38f) - m);
                l += tmp[t];
            }
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (int64_t t = 0; t < T; t++)
                mass[t] += tmp[t] * inv;
        }
        int64_t n = 0;
        for (int64_t t = 0; t < T; t++)
            if (vis[t]) tmp[n++] = mass[t];
        int64_t k = cap[c] < n ? cap[c] : n, got = 0;
        int64_t *row = order + c * width;
        if (k > 0) {
            const float thr = kth_largest(tmp, n, k);
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
}
