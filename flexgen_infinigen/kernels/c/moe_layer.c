#include "common.h"

#define MOE_MAX_ROWS 16  /* as moe_experts.c */
#define MOE_MAX_TOP_K 64  /* a token's experts the buffers below hold */

int moe_q4_h16(const float *x, int64_t T, int64_t U, const int64_t *first, const int64_t *tok,
               const float *wt, const uint8_t *const *codes, const uint16_t *const *scales,
               const uint16_t *const *minima, float *out, int64_t H, int64_t F, int64_t group,
               int64_t nthreads);
void rms_norm_rows(const float *x, const float *weight, float *y, int64_t rows, int64_t n,
                   float eps, int64_t nthreads);
void linear_rows(const float *x, const float *w, const float *bias, float *out, int64_t M,
                 int64_t N, int64_t K, int64_t nthreads);

/* A decode step's whole MoE MLP stage for T <= MOE_MAX_ROWS tokens h [T, H] in one call, as
   models/llama.py's mlp and models/moe.py's mlp compute it one operation at a time:
   x = RMSNorm(h) (the same kernel), the router's logits x . router [E, H] (the same float
   kernel), their softmax in float32, each token's K largest probabilities (in descending
   order; a tie at the K-th one returns 0, below), divided by their sum when `renorm`
   (norm_topk_prob), the experts the tokens chose grouped as models/moe.py's _by_expert
   groups them (ascending experts, each one's tokens ascending), moe_q4_h16 on them, and
   out = h + their sum. The softmax and the renormalising sum are this loop's, not torch's
   vectorised ones: probabilities may differ from torch's in the last bit (which changes
   the choice only between experts whose logits tie to that bit). codes, scales, minima:
   3 E pointers, expert e's gate, up and down at 3e, 3e + 1, 3e + 2, for every expert of the
   layer. Returns 0 where it cannot run (the caller takes the per-operation path). */
int moe_layer_q4_h16(const float *h, int64_t T, const float *norm_w, float eps,
                     const float *router, int64_t E, int64_t K, int64_t renorm,
                     const uint8_t *const *codes, const uint16_t *const *scales,
                     const uint16_t *const *minima, float *out, int64_t H, int64_t F,
                     int64_t group, int64_t nthreads) {
    if (T < 1 || T > MOE_MAX_ROWS || K < 1 || K > E || K > MOE_MAX_TOP_K)
        return 0;
    static __thread void *buf;  /* x, the logits (then probabilities) and the experts' sum */
    static __thread size_t have;
    float *x = (float *)thread_scratch(&buf, &have, sizeof(float) * T * (2 * H + E));
    if (!x)
        return 0;
    const int64_t R = T * K;  /* routed rows: at most MOE_MAX_ROWS * MOE_MAX_TOP_K */
    float *logits = x + T * H, *y = logits + T * E, wt[R];
    int64_t chosen[R];
    rms_norm_rows(h, norm_w, x, T, H, eps, nthreads);
    linear_rows(x, router, NULL, logits, T, E, H, nthreads);
    for (int64_t t = 0; t < T; t++) {
        float *p = logits + t * E, m = p[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++)
            m = p[e] > m ? p[e] : m;
        for (int64_t e = 0; e < E; e++) {
            p[e] = expf(p[e] - m);
            sum += p[e];
        }
        for (int64_t e = 0; e < E; e++)
            p[e] /= sum;
        float top = 0.0f;
        for (int64_t i = 0; i < K; i++) {  /* the largest left (of equals, the lower expert) */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t j = 0; j < i; j++)
                    taken |= chosen[t * K + j] == e;
                if (!taken && (best < 0 || p[e] > p[best]))
                    best = e;
            }
            chosen[t * K + i] = best;
            wt[t * K + i] = p[best];
            top += p[best];
        }
        /* an expert left out with the K-th one's probability: torch.topk's choice among
           equal values follows no index order, so the caller's top-k decides */
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < K; j++)
                taken |= chosen[t * K + j] == e;
            if (!taken && p[e] == wt[t * K + K - 1])
                return 0;
        }
        for (int64_t i = 0; renorm && i < K; i++)
            wt[t * K + i] /= top;
    }
    /* the experts used, ascending; each one's tokens ascending, with their weights */
    int64_t first[R + 1], tok[R], U = 0;
    float w_by[R];
    const uint8_t *c_u[3 * R];
    const uint16_t *s_u[3 * R], *m_u[3 * R];
    first[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t n = first[U];
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < K; i++)
                if (chosen[t * K + i] == e) {
                    tok[n] = t;
                    w_by[n++] = wt[t * K + i];
                }
        if (n == first[U])
            continue;
        for (int64_t m = 0; m < 3; m++) {
            c_u[3 * U + m] = codes[3 * e + m];
            s_u[3 * U + m] = scales[3 * e + m];
            m_u[3 * U + m] = minima[3 * e + m];
        }
        first[++U] = n;
    }
    if (!moe_q4_h16(x, T, U, first, tok, w_by, c_u, s_u, m_u, y, H, F, group, nthreads))
        return 0;
    for (int64_t i = 0; i < T * H; i++)
        out[i] = h[i] + y[i];
    return 1;
}
