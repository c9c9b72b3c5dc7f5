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

/* The sum of a vector's eight lanes (halves added, then pairs). */
static inline float hsum8(v8 a) {
    typedef float v4 __attribute__((vector_size(16)));
    v4 lo = {a[0], a[1], a[2], a[3]}, hi = {a[4], a[5], a[6], a[7]};
    lo += hi;
    return (lo[0] + lo[2]) + (lo[1] + lo[3]);
}

/* exp(x) for eight floats, inlined (a libm vector call costs several times more per value
   in the short softmax loops). x = n ln2 + r with n an integer and |r| <= ln2 / 2; e^r by
   its Taylor series to r^6 (relative error under 5e-7, measured over the normal range); 2^n put
   in the exponent bits. Below -87.3 (2^n no longer a normal float) the result is 0, so
   hidden scores (-3e38) still weigh exactly nothing. */
static inline v8 exp8(v8 x) {
#ifdef __AVX2__
    const __m256 floor = _mm256_set1_ps(-87.3f);
    const __m256 keep = _mm256_cmp_ps((__m256)x, floor, _CMP_GE_OQ);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps((__m256)x, floor), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const v8 vn = (v8)n, r = ((v8)xc - vn * splat8(0.693145752f)) - vn * splat8(1.42860677e-6f);
    v8 p = splat8(1.0f / 720.0f);
    p = p * r + splat8(1.0f / 120.0f);
    p = p * r + splat8(1.0f / 24.0f);
    p = p * r + splat8(1.0f / 6.0f);
    p = p * r + splat8(0.5f);
    p = p * r + splat8(1.0f);
    p = p * r + splat8(1.0f);
    const __m256i pow2 = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return (v8)_mm256_and_ps(_mm256_mul_ps((__m256)p, _mm256_castsi256_ps(pow2)), keep);
#else
    v8 y;
    for (int i = 0; i < 8; i++)
        y[i] = expf(x[i]);
    return y;
#endif
}

/* z * sigmoid(z). The exponent is capped: under -ffast-math an exp that overflows to
   infinity (z below about -88) may turn the quotient into NaN; at the cap the result is
   already zero to float precision, as the exact value is. */
static inline float silu1(float z) {
    return z / (1.0f + expf(fminf(-z, 80.0f)));
}

/* x[i] = exp(x[i] - m) for i < n, and their sum. */
static inline float exp_shifted(float *x, int64_t n, float m) {
    const v8 vm = splat8(m);
    v8 sum = splat8(0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 e = exp8(load8(x + i) - vm);
        store8(x + i, e);
        sum += e;
    }
    if (i < n) {  /* the tail through the same function, padded with zeros' exponent */
        float pad[8];
        for (int64_t j = 0; j < 8; j++)
            pad[j] = i + j < n ? x[i + j] : -3.0e38f;
        const v8 e = exp8(load8(pad) - vm);
        for (int64_t j = 0; i + j < n; j++)
            x[i + j] = e[j];
        sum += e;
    }
    return ((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]));
}

#ifdef __AVX2__
/* The integer sums of one block of 64 4-bit codes (32 bytes, element 2j of the block in the
   low nibble of byte j, 2j + 1 in the high one) against one row of x, each 32-bit lane
   summing elements 8i .. 8i + 7. The 4-bit products (linear.c, linear_h16.h) share these two,
   so that every kernel gives the same integers. With VNNI (AVX512-VNNI with VL, or AVX-VNNI)
   a dot-product instruction adds four byte products (two 16-bit products) straight into each
   32-bit lane; without it the products go through 16-bit pair sums, exact in 16 bits (see
   below). Both ways compute the same exact integers (tests/test_vnni.py); only the float
   steps around them may round differently in the last bit, where -ffast-math lets the
   compiler fuse or reorder them differently in each build. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q4_VNNI 1
#define q4_dpbusd _mm256_dpbusd_epi32
#define q4_dpwssd _mm256_dpwssd_epi32
#elif defined(__AVXVNNI__)
#define Q4_VNNI 1
#define q4_dpbusd _mm256_dpbusd_avx_epi32
#define q4_dpwssd _mm256_dpwssd_avx_epi32
#endif

/* acc + (float)p * factor for a block's integer sums p, as one fused multiply-add written
   out: left to -ffast-math, the compiler may fuse it or not, or reorder the factor's
   product, differently where one row of x is multiplied and where several are, and a row
   must give the same floats alone as in a batch. */
static inline v8 q4_accumulate(v8 acc, __m256i p, v8 factor) {
#ifdef __FMA__
    return (v8)_mm256_fmadd_ps(_mm256_cvtepi32_ps(p), (__m256)factor, (__m256)acc);
#else
    return (v8)_mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(p), (__m256)factor),
                             (__m256)acc);
#endif
}

/* x in byte halves (x = 256 hi + lo per value; q[0], q[1]: hi of the even and odd
   elements, q[2], q[3]: lo), the codes unsigned bytes after a mask or a shift. Without VNNI,
   vpmaddubsw pairs: each product at most 15 * 128, a pair's sum plus another pair's at most
   7680, exact in 16 bits. */
static inline __m256i q4_block_bytes(__m256i c, const __m256i *q) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i even = _mm256_and_si256(c, nibble);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble);
#ifdef Q4_VNNI
    const __m256i zero = _mm256_setzero_si256();
    const __m256i hi = q4_dpbusd(q4_dpbusd(zero, even, _mm256_loadu_si256(q)), odd,
                                 _mm256_loadu_si256(q + 1));
    const __m256i lo = q4_dpbusd(q4_dpbusd(zero, even, _mm256_loadu_si256(q + 2)), odd,
                                 _mm256_loadu_si256(q + 3));
    return _mm256_add_epi32(_mm256_slli_epi32(hi, 8), lo);
#else
    const __m256i hi = _mm256_add_epi16(
        _mm256_maddubs_epi16(even, _mm256_loadu_si256(q)),
        _mm256_maddubs_epi16(odd, _mm256_loadu_si256(q + 1)));
    const __m256i lo = _mm256_add_epi16(
        _mm256_maddubs_epi16(even, _mm256_loadu_si256(q + 2)),
        _mm256_maddubs_epi16(odd, _mm256_loadu_si256(q + 3)));
    return _mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(lo, _mm256_set1_epi16(1)));
#endif
}

/* x in 16-bit planes (plane t holds x[4l + t] in 16-bit lane l), the codes c0 .. c3 already
   widened to 16-bit lanes (element 4l + t in lane l of c_t). Each 32-bit sum at most
   8 * 15 * 32768: exact. */
static inline __m256i q4_block_planes(__m256i c0, __m256i c1, __m256i c2, __m256i c3,
                                      const __m256i *q) {
#ifdef Q4_VNNI  /* two short chains, not one of four: the sums wait on fewer products */
    const __m256i a = q4_dpwssd(_mm256_madd_epi16(c0, _mm256_loadu_si256(q)), c1,
                                _mm256_loadu_si256(q + 1));
    const __m256i b = q4_dpwssd(_mm256_madd_epi16(c2, _mm256_loadu_si256(q + 2)), c3,
                                _mm256_loadu_si256(q + 3));
    return _mm256_add_epi32(a, b);
#else
    return _mm256_add_epi32(
        _mm256_add_epi32(_mm256_madd_epi16(c0, _mm256_loadu_si256(q)),
                         _mm256_madd_epi16(c1, _mm256_loadu_si256(q + 1))),
        _mm256_add_epi32(_mm256_madd_epi16(c2, _mm256_loadu_si256(q + 2)),
                         _mm256_madd_epi16(c3, _mm256_loadu_si256(q + 3))));
#endif
}
#endif

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
