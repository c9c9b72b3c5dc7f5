#include "attention.h"

/* One row of 4-bit codes expanded to floats (the runtime's compression: groups of 64 along
   D, element 2j of a group in the low nibble of byte j, 2j + 1 in the high one, a scale and
   a minimum per group). */
static inline void expand_q4(const uint8_t *codes, const float *scale, const float *minimum,
                             int64_t D, float *out) {
    for (int64_t g = 0; g < D / 64; g++) {
        const uint8_t *c = codes + g * 32;
        const float s = scale[g], m = minimum[g];
        float *o = out + g * 64;
        for (int64_t j = 0; j < 32; j++) {
            o[2 * j] = (float)(c[j] & 15) * s + m;
            o[2 * j + 1] = (float)(c[j] >> 4) * s + m;
        }
    }
}

/* Attention over every row of a 4-bit KV cache read where it is, then each column's new
   token (exact floats). Row t of column c has its D / 2 code bytes at kc + t * cs0 + c * cs1
   and its D / 64 scales and minima at ks, km + t * ss0 + c * ss1 (V alike); a block's rows
   are expanded into a small buffer that the float path then reads. q, out: [C, G, D];
   bias: [C, T] for the cached rows; k_new, v_new: [C, D]. D a multiple of 64. With an
   index ([C, T], not NULL) the t-th row of column c is the cache's row index[c * T + t]
   (chosen rows read where they are, never gathered). */
void attend_rows_q4(const float *q, const uint8_t *kc, const float *ks, const float *km,
                    const uint8_t *vc, const float *vs, const float *vm, const float *bias,
                    const int64_t *index, const float *k_new, const float *v_new, float *out,
                    const float *sinks, int64_t T, int64_t C, int64_t G, int64_t D, int64_t cs0, int64_t cs1,
                    int64_t ss0, int64_t ss1, int64_t nthreads) {
    const int64_t R = ranges_of(T + 1), S = G * (D + 2);
    float *part = (float *)malloc(sizeof(float) * C * R * S);
    int64_t *first = first_rows(bias, C, T);
    #pragma omp parallel num_threads(nthreads)
    {
        static __thread void *buf;
        static __thread size_t have;
        float *rows = (float *)thread_scratch(&buf, &have, sizeof(float) * 2 * TB * D);
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < C * R; item++) {
            const int64_t c = item / R, r = item % R;
            const int64_t lo = first[c] + r * RANGE;
            const int64_t hi = lo + RANGE < T + 1 ? lo + RANGE : T + 1;
            float *state = part + (r * C + c) * S;
            float s[16 * TB], b[TB];
            const float *kr[TB], *vr[TB];
            init_states(state, G, D);
            for (int64_t t0 = lo; t0 < hi; t0 += TB) {
                const int64_t n = t0 + TB < hi ? TB : hi - t0;
                for (int64_t i = 0; i < n; i++) {
                    const int64_t t = t0 + i;
                    if (t < T) {
                        float *kx = rows + i * D, *vx = rows + (TB + i) * D;
                        const int64_t u = index ? index[c * T + t] : t;
                        expand_q4(kc + u * cs0 + c * cs1, ks + u * ss0 + c * ss1,
                                  km + u * ss0 + c * ss1, D, kx);
                        expand_q4(vc + u * cs0 + c * cs1, vs + u * ss0 + c * ss1,
                                  vm + u * ss0 + c * ss1, D, vx);
                        kr[i] = kx;
                        vr[i] = vx;
                        b[i] = bias[c * T + t];
                    } else {  /* the new token */
                        kr[i] = k_new + c * D;
                        vr[i] = v_new + c * D;
                        b[i] = 0.0f;
                    }
                }
                attend_block(q + c * G * D, kr, vr, b, n, G, D, state, s, NULL, 0, NULL, 0);
            }
        }
    }
    merge_states(out, part, C * G, D, R, sinks);
    free(part);
    free(first);
}
