#include "common.h"
#include "gguf_dot.h"

/* A decode step's routed experts over a GGUF file's blocks as stored, in one call (else three
   linear layers an expert, each a call from Python):
       out[t] = sum over the experts u of token t of  wt * down_u(silu(gate_u x[t]) * up_u x[t]),
   added in expert order, as the per-expert path adds them. Expert u takes the tokens
   tok[first[u] .. first[u + 1]) (at most MOE_BLOCK_ROWS) with router weights wt at the same
   places; w holds each expert's gate, up and down blocks in turn, types their GGUF types
   (gate's and up's the same: one quantized copy of x serves both).

   Each expert's rows of x are quantized once, its activation once; the three products'
   output rows are dealt to the threads in chunks of an even number of rows, each chunk
   through gguf_linear_q (the layer's own tiles: the AVX-512 tiles' row pairs fall where the
   whole layer's call puts them), so every product equals gguf_linear's, and a token's
   result does not depend on which other tokens share the step. */

#define MOE_BLOCK_ROWS 16
#define MOE_CHUNK 64  /* output rows a task (even) */

/* Output rows [o0, o0 + n) of weight w (rows of wrow bytes) for the M rows of x in xq, at
   dst[m * stride + o]; tmp holds M * n floats when M > 1. */
static int rows_of(int64_t type, const uint8_t *w, int64_t wrow, const uint8_t *xq,
                   int64_t M, int64_t K, int64_t o0, int64_t n, float *dst, int64_t stride,
                   float *tmp) {
    float *to = M == 1 ? dst + o0 : tmp;
    if (!gguf_linear_q(type, w + o0 * wrow, NULL, xq, NULL, to, M, n, K, 1))
        return 0;
    if (M > 1)
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < n; i++)
                dst[m * stride + o0 + i] = tmp[m * n + i];
    return 1;
}

int moe_gguf(const float *x, int64_t T, int64_t U, const int64_t *first, const int64_t *tok,
             const float *wt, const uint8_t *const *w, const int64_t *types, float *out,
             int64_t H, int64_t F, int64_t nthreads) {
    if (U <= 0 || T <= 0)
        return 0;
    const int64_t R = first[U];
    size_t xat[U + 1], aat[U + 1];  /* where each expert's quantized x and activation start */
    xat[0] = aat[0] = 0;
    for (int64_t u = 0; u < U; u++) {
        const int64_t M = first[u + 1] - first[u];
        const gguf_format *fg = gguf_format_of(types[3 * u]), *fd = gguf_format_of(types[3 * u + 2]);
        if (M < 1 || M > MOE_BLOCK_ROWS || types[3 * u + 1] != types[3 * u] || fg == NULL ||
            fd == NULL || H % fg->values || F % fd->values)
            return 0;
        xat[u + 1] = xat[u] + (size_t)(M * gguf_act_bytes(types[3 * u], H) + 63) / 64 * 64;
        aat[u + 1] = aat[u] + (size_t)(M * gguf_act_bytes(types[3 * u + 2], F) + 63) / 64 * 64;
    }
    static __thread void *buf;
    static __thread size_t have;
    /* gathered x [R, H]; gate and up outputs [R, F] each; down outputs [R, H] */
    const size_t floats = sizeof(float) * (2 * R * H + 2 * R * F);
    char *scratch = (char *)thread_scratch(&buf, &have, floats + xat[U] + aat[U] + 64);
    if (!scratch)
        return 0;
    float *X = (float *)scratch, *G = X + R * H, *Up = G + R * F, *Y = Up + R * F;
    uint8_t *xq = (uint8_t *)scratch + floats, *aq = xq + xat[U];
    const int64_t fchunks = (F + MOE_CHUNK - 1) / MOE_CHUNK;
    const int64_t hchunks = (H + MOE_CHUNK - 1) / MOE_CHUNK;
    int ok = 1;
    for (int64_t i = 0; i < T * H; i++)
        out[i] = 0.0f;
    #pragma omp parallel num_threads(nthreads) reduction(&& : ok)
    {
        float tmp[MOE_BLOCK_ROWS * MOE_CHUNK];
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < U; u++) {  /* each expert's rows of x, gathered, quantized */
            const int64_t M = first[u + 1] - first[u];
            float *Xu = X + first[u] * H;
            for (int64_t m = 0; m < M; m++)
                __builtin_memcpy(Xu + m * H, x + tok[first[u] + m] * H, sizeof(float) * H);
            gguf_quantize_act(types[3 * u], Xu, M, H, xq + xat[u], 1);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < 2 * U * fchunks; r++) {  /* gate and up rows of every expert */
            const int64_t u = r / (2 * fchunks), which = (r / fchunks) % 2;
            const int64_t o0 = (r % fchunks) * MOE_CHUNK;
            const int64_t n = F - o0 < MOE_CHUNK ? F - o0 : MOE_CHUNK;
            const int64_t at = 3 * u + which, M = first[u + 1] - first[u];
            const gguf_format *f = gguf_format_of(types[at]);
            ok = rows_of(types[at], w[at], H / f->values * f->bytes, xq + xat[u], M, H, o0, n,
                         (which ? Up : G) + first[u] * F, F, tmp) && ok;
        }
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < U; u++) {  /* silu(gate) * up, quantized for down */
            const int64_t M = first[u + 1] - first[u];
            float *g = G + first[u] * F;
            const float *up = Up + first[u] * F;
            for (int64_t i = 0; i < M * F; i++)
                g[i] = silu1(g[i]) * up[i];
            gguf_quantize_act(types[3 * u + 2], g, M, F, aq + aat[u], 1);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < U * hchunks; r++) {  /* down rows, expert by expert */
            const int64_t u = r / hchunks, o0 = (r % hchunks) * MOE_CHUNK;
            const int64_t n = H - o0 < MOE_CHUNK ? H - o0 : MOE_CHUNK;
            const int64_t at = 3 * u + 2, M = first[u + 1] - first[u];
            const gguf_format *f = gguf_format_of(types[at]);
            ok = rows_of(types[at], w[at], F / f->values * f->bytes, aq + aat[u], M, F, o0, n,
                         Y + first[u] * H, H, tmp) && ok;
        }
        #pragma omp for schedule(static)
        for (int64_t o = 0; o < H; o++)  /* each token's experts, weighted, in order */
            for (int64_t i = 0; i < R; i++)
                out[tok[i] * H + o] += Y[i * H + o] * wt[i];
    }
    return ok;
}
