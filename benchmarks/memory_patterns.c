/* What this machine's memory gives for the access patterns of decode attention, with no
   arithmetic beyond an add: the bound a kernel that reads that way can reach.

     gcc -O3 -march=native -fopenmp benchmarks/memory_patterns.c -o /tmp/memory_patterns
     /tmp/memory_patterns

   Shapes: SmolLM2 batch 8 (24 columns of 8,192 rows of 64 floats, K and V of one layer,
   head-major, 2 MB pages), six layers cycled so that every read is from memory, 2 threads.
   Patterns, GB/s of rows read:
     stream      each column's K whole, then its V (one stream at a time)
     blocks      K and V in alternating blocks of 64 rows (how attention over every row reads)
     gather      20% of each column's rows, sorted (how InfiniGen's chosen rows are read),
                 K and V in their own arrays, blocks of 64 chosen rows
     asked       the same, each chosen row asked for (prefetched into L2) 64 rows before it
                 is read, as the attention kernel does
     adjacent    the same rows with a token's K and V next to each other (512 bytes) */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <immintrin.h>

enum { C = 24, T = 8192, D = 64, LAYERS = 6, CHOSEN = T / 5, REPEATS = 5 };

static float *big(size_t floats) {
    const size_t bytes = floats * sizeof(float);
    float *p = aligned_alloc(1 << 21, bytes);
    madvise(p, bytes, MADV_HUGEPAGE);
    memset(p, 1, bytes);
    return p;
}

static inline __m256 add_row(__m256 a, const float *r, int64_t n) {
    for (int64_t d = 0; d < n; d += 8)
        a = _mm256_add_ps(a, _mm256_load_ps(r + d));
    return a;
}

/* seconds a layer of `pattern` takes (the best of REPEATS passes over the layers) */
static double run(int pattern, float **k, float **v, float **kv, const int64_t *idx) {
    double best = 1e30;
    for (int rep = 0; rep < REPEATS; rep++) {
        const double start = omp_get_wtime();
        float sink = 0;
        for (int l = 0; l < LAYERS; l++) {
            #pragma omp parallel for schedule(static) num_threads(2) reduction(+:sink)
            for (int64_t c = 0; c < C; c++) {
                __m256 a = _mm256_setzero_ps();
                const float *kc = k[l] + c * T * D, *vc = v[l] + c * T * D;
                const int64_t *ix = idx + c * CHOSEN;
                if (pattern == 0) {
                    a = add_row(a, kc, T * D);
                    a = add_row(a, vc, T * D);
                } else if (pattern == 1) {
                    for (int64_t t = 0; t < T; t += 64) {
                        a = add_row(a, kc + t * D, 64 * D);
                        a = add_row(a, vc + t * D, 64 * D);
                    }
                } else if (pattern == 2) {
                    for (int64_t j0 = 0; j0 < CHOSEN; j0 += 64) {
                        const int64_t j1 = j0 + 64 < CHOSEN ? j0 + 64 : CHOSEN;
                        for (int64_t j = j0; j < j1; j++) a = add_row(a, kc + ix[j] * D, D);
                        for (int64_t j = j0; j < j1; j++) a = add_row(a, vc + ix[j] * D, D);
                    }
                } else if (pattern == 3) {
                    for (int64_t j = 0; j < CHOSEN; j++) {
                        if (j + 64 < CHOSEN)
                            for (int64_t d = 0; d < D; d += 16) {
                                __builtin_prefetch(kc + ix[j + 64] * D + d, 0, 2);
                                __builtin_prefetch(vc + ix[j + 64] * D + d, 0, 2);
                            }
                        a = add_row(a, kc + ix[j] * D, D);
                        a = add_row(a, vc + ix[j] * D, D);
                    }
                } else {
                    const float *both = kv[l] + c * T * 2 * D;
                    for (int64_t j = 0; j < CHOSEN; j++)
                        a = add_row(a, both + ix[j] * 2 * D, 2 * D);
                }
                float lanes[8];
                _mm256_storeu_ps(lanes, a);
                sink += lanes[0];
            }
        }
        const double seconds = (omp_get_wtime() - start) / LAYERS;
        best = seconds < best ? seconds : best;
        if (sink == 12345.0f) printf(" ");  /* keep the reads */
    }
    return best;
}

int main(void) {
    float *k[LAYERS], *v[LAYERS], *kv[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        k[l] = big((size_t)C * T * D);
        v[l] = big((size_t)C * T * D);
        kv[l] = big((size_t)C * T * 2 * D);
    }
    int64_t *idx = malloc(sizeof(int64_t) * C * CHOSEN);
    srand(1);
    for (int64_t c = 0; c < C; c++) {  /* each row with probability 1/5, in order */
        int64_t m = 0;
        for (int64_t t = 0; t < T && m < CHOSEN; t++)
            if (rand() % 5 == 0 || T - t <= CHOSEN - m)
                idx[c * CHOSEN + m++] = t;
    }
    const char *names[] = {"stream", "blocks", "gather", "asked", "adjacent"};
    for (int p = 0; p < 5; p++) {
        const double rows = p < 2 ? (double)T : (double)CHOSEN;
        const double bytes = 2.0 * C * rows * D * sizeof(float);
        const double s = run(p, k, v, kv, idx);
        printf("%-9s %7.2f ms a layer  %6.1f MB  %5.1f GB/s\n", names[p], s * 1e3, bytes / 1e6,
               bytes / s / 1e9);
    }
    return 0;
}
