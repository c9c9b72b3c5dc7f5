/* What the CPU kernels share (cpu_kernels.py compiles every .c file of this folder into one
   library and loads it with ctypes). Plain C with GCC vector extensions; AVX2 intrinsics
   where the compiler targets it, a portable path otherwise. */
#ifndef FLEXGEN_INFINIGEN_KERNELS_H
#define FLEXGEN_INFINIGEN_KERNELS_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 r; __builtin_memcpy(&r, p, 32); return r; }
static inline void store8(float *p, v8 x) { __builtin_memcpy(p, &x, 32); }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* A thread's scratch of at least n bytes, kept between calls (the kernels run every decode
   step: no allocation, no page faults once it has grown). */
static inline void *thread_scratch(void **buf, size_t *have, size_t n) {
    if (*have < n) {
        free(*buf);
        *buf = malloc(n);
        *have = *buf ? n : 0;
    }
    return *buf;
}

#endif
