/* The AVX-512 build's one-row tiles for the K-quants: one weight row against one row of x
   (a decode step at batch 1), in 256-bit vectors.
   A private part of gguf_dot.c, included once there after gguf_tiles_avx512.h; it is not a
   header of its own interface.

   Why a tile of its own: with one row of x, the two-row tile's work per weight byte (each
   vector built from two rows' halves, scale words spread across both halves) and not memory
   sets the pace. Why these exact steps: a row's output must not depend on how many rows of
   x come with it, so each tile here computes, lane for lane, what the lower half of the
   two-row tile (tile512_k45, tile512_q6_k) computes for one weight row: the same integer
   sum in each 32-bit lane, then the same float steps in the same order, then the same
   horizontal sum. tests/test_gguf_kernels.py checks the floats are equal, bit for bit. */
#ifndef FLEXGEN_INFINIGEN_GGUF_TILES_AVX512_ONE_H
#define FLEXGEN_INFINIGEN_GGUF_TILES_AVX512_ONE_H

#if defined(GD512) && defined(__AVX512VL__)
#define GD512_ONE 1

/* acc + the 16-bit pair products p * sc summed into 32-bit lanes (dot16_acc's half). */
static inline __m256i dot16_acc256(__m256i acc, __m256i p, __m256i sc) {
#ifdef __AVX512VNNI__
    return _mm256_dpwssd_epi32(acc, p, sc);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
#endif
}

static inline __m256i shift16_256(__m256i v, const int s) {
    return s > 0 ? _mm256_slli_epi16(v, s) : s < 0 ? _mm256_srli_epi16(v, -s) : v;
}

/* Q4_K (FIVE = 0) and Q5_K (FIVE = 1), as tile512_k45 computes weight row 0. */
static inline __attribute__((always_inline)) float tile1_k45(
        const int FIVE, const uint8_t *w, const xq_k *y, int64_t nb) {
    const int64_t bytes = FIVE ? 176 : 144, qs = FIVE ? 48 : 16;
    const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, y++) {
        const uint8_t *blk = w + bytes * b;
        ASK_AHEAD(blk, bytes);
        uint64_t sc, mn;
        k_scales64(blk + 4, &sc, &mn);
        const __m256i scb = _mm256_set1_epi64x((long long)sc);
        const __m256 d = _mm256_set1_ps(f16_at(blk));
        const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(f16_at(blk + 2)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
        __m256i hq = _mm256_setzero_si256();
        if (FIVE)
            hq = load32(blk + 16);
        __m256i sum = _mm256_setzero_si256();
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256i v = load32(blk + qs + 32 * j);
            __m256i lo, hi;
            if (FIVE) {
                lo = _mm256_ternarylogic_epi32(
                    v, _mm256_and_si256(shift16_256(hq, 4 - 2 * j), bit4), low, SELECT_AB);
                hi = _mm256_ternarylogic_epi32(
                    _mm256_srli_epi16(v, 4),
                    _mm256_and_si256(shift16_256(hq, 3 - 2 * j), bit4), low, SELECT_AB);
            } else {
                lo = _mm256_and_si256(v, low);
                hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            /* every word the scale byte of sub-block 2j (then 2j + 1), zero-extended */
            const __m256i s_lo = _mm256_shuffle_epi8(scb, _mm256_set1_epi16((short)(0x8000 | (2 * j))));
            const __m256i s_hi = _mm256_shuffle_epi8(scb, _mm256_set1_epi16((short)(0x8000 | (2 * j + 1))));
            sum = dot16_acc256(sum, _mm256_maddubs_epi16(lo, load32(y->qs + 64 * j)), s_lo);
            sum = dot16_acc256(sum, _mm256_maddubs_epi16(hi, load32(y->qs + 64 * j + 32)), s_hi);
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(y->d)),
                              acc);
        acc = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(y->msum), acc);
    }
    return hsum_ps(acc);
}

/* Q6_K, as tile512_q6_k computes weight row 0. */
static inline __attribute__((always_inline)) float tile1_q6_k_body(
        const uint8_t *w, const xq_k *y, int64_t nb) {
    const __m256i low = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, y++) {
        const uint8_t *blk = w + 210 * b;
        ASK_AHEAD(blk, 210);
        const __m256i sw = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256i off = _mm256_mullo_epi16(sw, _mm256_set1_epi16(-32));
        const __m256 d = _mm256_set1_ps(f16_at(blk + 208));
        __m256i sum = dot16_acc256(_mm256_setzero_si256(), load32(y->bsums), off);
        #pragma GCC unroll 4
        for (int n = 0; n < 2; n++) {
            const __m256i la = load32(blk + 64 * n), lb = load32(blk + 64 * n + 32);
            const __m256i h = load32(blk + 128 + 32 * n);
            #pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const __m256i l = t % 2 ? lb : la;
                const __m256i q = _mm256_ternarylogic_epi32(
                    t < 2 ? l : _mm256_srli_epi16(l, 4),
                    _mm256_and_si256(shift16_256(h, 4 - 2 * t), bits45), low, SELECT_AB);
                const int g = 8 * n + 2 * t;
                /* words 0-7 the scale of values 32t..+15 of this slice, 8-15 of the next 16 */
                const __m256i s = _mm256_permutexvar_epi16(_mm256_set_epi16(
                    1 + g, 1 + g, 1 + g, 1 + g, 1 + g, 1 + g, 1 + g, 1 + g,
                    g, g, g, g, g, g, g, g), sw);
                sum = dot16_acc256(sum, _mm256_maddubs_epi16(
                    q, load32(y->qs + 128 * n + 32 * t)), s);
            }
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(y->d)),
                              acc);
    }
    return hsum_ps(acc);
}

static float tile1_q4_k(const uint8_t *w, const uint8_t *x, int64_t nb) {
    return tile1_k45(0, w, (const xq_k *)x, nb);
}
static float tile1_q5_k(const uint8_t *w, const uint8_t *x, int64_t nb) {
    return tile1_k45(1, w, (const xq_k *)x, nb);
}
static float tile1_q6_k(const uint8_t *w, const uint8_t *x, int64_t nb) {
    return tile1_q6_k_body(w, (const xq_k *)x, nb);
}

typedef float (*tile1_fn)(const uint8_t *, const uint8_t *, int64_t);

/* The one-row tile of a type, or NULL where the two-row tile serves one row too. */
static tile1_fn tile1_of(int64_t type) {
    switch (type) {
        case GT_Q4_K: return tile1_q4_k;
        case GT_Q5_K: return tile1_q5_k;
        case GT_Q6_K: return tile1_q6_k;
    }
    return NULL;
}
#endif  /* AVX-512 with VL */

#endif
