#include "common.h"

/* InfiniGen's skew applied per KV head: out[b, n, k, :] = x[b, n, k, :] . P[b, k] for rows of
   width d and projections P [d, r] (r a multiple of 8, at most 128). Strides are in floats:
   x's and out's for the batch, row and KV-head dimensions, P's for the batch (0: one
   projection shared by the batch). A row's r sums stay in registers while x's entries are
   broadcast against P's rows; a projection (16 KB at 64 x 64) stays in L1. */
#define PROJECT_THREADS_FROM 262144  /* multiply-adds: below this, one thread does it all */

static inline __attribute__((always_inline)) void project_row(const int64_t VR,
                                                              const float *xr,
                                                              const float *p, int64_t d,
                                                              float *o) {
    v8 acc[16];
    for (int64_t j = 0; j < VR; j++)
        acc[j] = splat8(0.0f);
    for (int64_t c = 0; c < d; c++) {
        const v8 xc = splat8(xr[c]);
        for (int64_t j = 0; j < VR; j++)
            acc[j] += xc * load8(p + c * VR * 8 + 8 * j);
    }
    for (int64_t j = 0; j < VR; j++)
        store8(o + 8 * j, acc[j]);
}

void project_heads(const float *x, const float *P, float *out, int64_t B, int64_t N,
                   int64_t KV, int64_t d, int64_t r, int64_t xsb, int64_t xsn, int64_t xsk,
                   int64_t osb, int64_t osn, int64_t osk, int64_t psb, int64_t nthreads) {
    const int64_t work = B * N * KV;
    #pragma omp parallel for schedule(static) num_threads(nthreads) \
        if (work * d * r >= PROJECT_THREADS_FROM)
    for (int64_t i = 0; i < work; i++) {
        const int64_t b = i / (N * KV), n = (i / KV) % N, k = i % KV;
        const float *xr = x + b * xsb + n * xsn + k * xsk, *p = P + b * psb + k * d * r;
        float *o = out + b * osb + n * osn + k * osk;
        switch (r / 8) {  /* constant counts: the sums in registers */
            case 4: project_row(4, xr, p, d, o); break;
            case 8: project_row(8, xr, p, d, o); break;
            case 16: project_row(16, xr, p, d, o); break;
            default: project_row(r / 8, xr, p, d, o);
        }
    }
}
