/* The AVX2 tiles of the GGUF linear layer (one weight row against up to four rows of x), and
   the AVX2 helpers the AVX-512 tiles share.
   A private part of gguf_dot.c, included once there after its block types (xq_k, xq_32)
   and helpers; it is not a header of its own interface. */
#ifndef FLEXGEN_INFINIGEN_GGUF_TILES_AVX2_H
#define FLEXGEN_INFINIGEN_GGUF_TILES_AVX2_H

#ifdef __AVX2__
static inline __m256i nib_lo(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline __m256i nib_hi(__m256i v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline float hsum_ps(__m256 v) { return hsum8((v8)v); }

/* Sixteen bytes of nibbles as 32 bytes: low nibbles (values 0-15) then high (16-31). */
static inline __m256i nibbles_32(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return nib_lo(_mm256_set_m128i(_mm_srli_epi16(b, 4), b));
}

/* Byte j of the result is 0x10 when bit j of the 32 bits is set (Q5_0/Q5_1's fifth bits). */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t h;
    memcpy(&h, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)h),
        _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                           0x0303030303030303LL));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* Unsigned codes u (<= 63) times signed codes s, pairs summed to 16 bits, then each pair
   of those times the 16-bit scale in sc and summed: eight 32-bit sums. */
static inline __m256i dot_scaled(__m256i u, __m256i s, __m256i sc) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc);
}
static inline __m256i dot_plain(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* Weight bytes are asked for this far ahead of the block in use: each thread reads its rows
   as one stream, yet with few rows of x (little arithmetic a byte) the hardware's own
   read-ahead leaves memory idle between blocks; a few pages ahead covers memory's latency
   and stays inside what L2 holds. An ask past the weight's end does not fault. */
#define W_AHEAD 4096
#define ASK_AHEAD(blk, bytes)                                                                 \
    for (int c_ = 0; c_ < (bytes); c_ += 64)                                                  \
        __builtin_prefetch((const char *)(blk) + W_AHEAD + c_, 0, 0)
/* An ask (ahead bytes ahead) that keeps the bytes in every cache level, for a first pass
   that later rows of x follow (an ask that keeps them out of L2 sends each later pass back
   to memory), and for the AVX-512 tiles, which read two rows side by side. */
#define ASK_KEEP(blk, bytes, ahead)                                                           \
    for (int c_ = 0; c_ < (bytes); c_ += 64)                                                  \
        __builtin_prefetch((const char *)(blk) + (ahead) + c_, 0, 3)
#define ASK(ahead, blk, bytes)                                                                \
    do {                                                                                      \
        if ((ahead) == ASK_STREAM)                                                            \
            ASK_AHEAD(blk, bytes);                                                            \
        else if ((ahead) == ASK_REUSE)                                                        \
            ASK_KEEP(blk, bytes, W_AHEAD);                                                    \
    } while (0)

/* One weight row against XR rows of x (x rows xs bytes apart): res[r] = the row's dot with
   x row r. The weight's codes are unpacked once for every row of x. */
#define X_K(r, b) ((const xq_k *)(x + (r) * xs) + (b))
#define X_32(r, b) ((const xq_32 *)(x + (r) * xs) + (b))

static inline __attribute__((always_inline)) void tile_q4_k(
        const int XR, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t nb, int ahead,
        float *res) {
    __m256 acc[4];
    float macc[4] = {0, 0, 0, 0};
    for (int r = 0; r < XR; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + 144 * b, *qs = blk + 16;
        ASK(ahead, blk, 144);
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        uint8_t sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        __m256i sum[4];
        for (int r = 0; r < XR; r++)
            sum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i bits = load32(qs + 32 * j), lo = nib_lo(bits), hi = nib_hi(bits);
            const __m256i s0 = _mm256_set1_epi16(sc[2 * j]), s1 = _mm256_set1_epi16(sc[2 * j + 1]);
            for (int r = 0; r < XR; r++) {
                const int8_t *y = X_K(r, b)->qs + 64 * j;
                sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(
                    dot_scaled(lo, load32(y), s0), dot_scaled(hi, load32(y + 32), s1)));
            }
        }
        for (int r = 0; r < XR; r++) {
            const xq_k *y = X_K(r, b);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(sum[r]), acc[r]);
            macc[r] += dmin * y->d * (float)k_min_dot(mn, y->bsums);
        }
    }
    for (int r = 0; r < XR; r++)
        res[r] = hsum_ps(acc[r]) - macc[r];
}

static inline __attribute__((always_inline)) void tile_q5_k(
        const int XR, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t nb, int ahead,
        float *res) {
    __m256 acc[4];
    float macc[4] = {0, 0, 0, 0};
    for (int r = 0; r < XR; r++)
        acc[r] = _mm256_setzero_ps();
    const __m256i one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + 176 * b, *qh = blk + 16, *qs = blk + 48;
        ASK(ahead, blk, 176);
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        uint8_t sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        const __m256i hbits = load32(qh);
        __m256i sum[4];
        for (int r = 0; r < XR; r++)
            sum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i bits = load32(qs + 32 * j);
            /* bit 2j of qh[l] is value 64j + l's fifth bit, bit 2j + 1 value 64j + 32 + l's */
            const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one);
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one);
            const __m256i lo = _mm256_or_si256(nib_lo(bits), _mm256_slli_epi16(h0, 4));
            const __m256i hi = _mm256_or_si256(nib_hi(bits), _mm256_slli_epi16(h1, 4));
            const __m256i s0 = _mm256_set1_epi16(sc[2 * j]), s1 = _mm256_set1_epi16(sc[2 * j + 1]);
            for (int r = 0; r < XR; r++) {
                const int8_t *y = X_K(r, b)->qs + 64 * j;
                sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(
                    dot_scaled(lo, load32(y), s0), dot_scaled(hi, load32(y + 32), s1)));
            }
        }
        for (int r = 0; r < XR; r++) {
            const xq_k *y = X_K(r, b);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(sum[r]), acc[r]);
            macc[r] += dmin * y->d * (float)k_min_dot(mn, y->bsums);
        }
    }
    for (int r = 0; r < XR; r++)
        res[r] = hsum_ps(acc[r]) - macc[r];
}

/* Q6_K: value 128n + 32t + l (l < 32) is (nibble | two high bits) - 32, its nibble the low
   (t = 0, 1) or high (t = 2, 3) one of ql[64n + 32 (t % 2) + l], its high bits bits 2t, 2t+1
   of qh[32n + l]; a signed 8-bit scale for each 16 values. The -32 meets x's 16-value sums. */
static inline __attribute__((always_inline)) void tile_q6_k(
        const int XR, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t nb, int ahead,
        float *res) {
    __m256 acc[4];
    for (int r = 0; r < XR; r++)
        acc[r] = _mm256_setzero_ps();
    const __m256i three = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + 210 * b;
        ASK(ahead, blk, 210);
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16_at(blk + 208);
        __m256i sum[4];
        for (int r = 0; r < XR; r++)
            sum[r] = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++) {
            const __m256i l0 = load32(blk + 64 * n), l1 = load32(blk + 64 * n + 32);
            const __m256i h = load32(blk + 128 + 32 * n);
            __m256i q[4];
            q[0] = _mm256_or_si256(nib_lo(l0), _mm256_slli_epi16(_mm256_and_si256(h, three), 4));
            q[1] = _mm256_or_si256(nib_lo(l1), _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4));
            q[2] = _mm256_or_si256(nib_hi(l0), _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4));
            q[3] = _mm256_or_si256(nib_hi(l1), _mm256_slli_epi16(
                _mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4));
            for (int t = 0; t < 4; t++) {
                const int g = 8 * n + 2 * t;
                const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]),
                                                   _mm_set1_epi16(sc[g]));
                for (int r = 0; r < XR; r++)
                    sum[r] = _mm256_add_epi32(sum[r], dot_scaled(
                        q[t], load32(X_K(r, b)->qs + 128 * n + 32 * t), s));
            }
        }
        for (int r = 0; r < XR; r++) {
            const xq_k *y = X_K(r, b);
            int off = 0;
            for (int g = 0; g < 16; g++)
                off += sc[g] * y->bsums[g];
            sum[r] = _mm256_sub_epi32(sum[r], _mm256_setr_epi32(32 * off, 0, 0, 0, 0, 0, 0, 0));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(sum[r]), acc[r]);
        }
    }
    for (int r = 0; r < XR; r++)
        res[r] = hsum_ps(acc[r]);
}

/* The plain types, blocks of 32: unsigned codes u (Q8_0: |q| with x's sign moved onto it),
   a factor d and, per type, an offset (Q4_0 -8, Q5_0 -16) or a minimum m (Q4_1, Q5_1):
   value = d (u + offset) or d u + m. */
#define PLAIN_TILE(NAME, BYTES, UNPACK, FACTORS)                                              \
static inline __attribute__((always_inline)) void NAME(                                      \
        const int XR, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t nb, int ahead, \
        float *res) {                                                                         \
    __m256 acc[4];                                                                            \
    float extra[4] = {0, 0, 0, 0};                                                            \
    for (int r = 0; r < XR; r++)                                                              \
        acc[r] = _mm256_setzero_ps();                                                         \
    for (int64_t b = 0; b < nb; b++) {                                                        \
        const uint8_t *blk = w + (BYTES) * b;                                                 \
        if ((b & 1) == 0)                                                                     \
            ASK(ahead, blk, 64);                                                               \
        float d, m = 0.0f;                                                                    \
        int off = 0;                                                                          \
        FACTORS;                                                                              \
        __m256i u;                                                                            \
        UNPACK;                                                                               \
        for (int r = 0; r < XR; r++) {                                                        \
            const xq_32 *y = X_32(r, b);                                                      \
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d),                                \
                                     _mm256_cvtepi32_ps(dot_plain(u, load32(y->qs))), acc[r]);\
            extra[r] += (d * (float)off + m) * y->dsum;                                       \
        }                                                                                     \
    }                                                                                         \
    for (int r = 0; r < XR; r++)                                                              \
        res[r] = hsum_ps(acc[r]) + extra[r];                                                  \
}

PLAIN_TILE(tile_q4_0, 18, u = nibbles_32(blk + 2), (d = f16_at(blk), off = -8))
PLAIN_TILE(tile_q4_1, 20, u = nibbles_32(blk + 4), (d = f16_at(blk), m = f16_at(blk + 2)))
PLAIN_TILE(tile_q5_0, 22, u = _mm256_or_si256(nibbles_32(blk + 6), fifth_bits(blk + 2)),
           (d = f16_at(blk), off = -16))
PLAIN_TILE(tile_q5_1, 24, u = _mm256_or_si256(nibbles_32(blk + 8), fifth_bits(blk + 4)),
           (d = f16_at(blk), m = f16_at(blk + 2)))

/* Q8_0: both sides signed; the weight's sign moves onto x (maddubs takes one side
   unsigned). */
static inline __attribute__((always_inline)) void tile_q8_0(
        const int XR, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t nb, int ahead,
        float *res) {
    __m256 acc[4];
    for (int r = 0; r < XR; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + 34 * b;
        if ((b & 1) == 0)
            ASK(ahead, blk, 64);
        const float d = f16_at(blk);
        const __m256i q = load32(blk + 2), u = _mm256_sign_epi8(q, q);
        for (int r = 0; r < XR; r++) {
            const xq_32 *y = X_32(r, b);
            const __m256i s = _mm256_sign_epi8(load32(y->qs), q);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d),
                                     _mm256_cvtepi32_ps(dot_plain(u, s)), acc[r]);
        }
    }
    for (int r = 0; r < XR; r++)
        res[r] = hsum_ps(acc[r]);
}

/* MXFP4: each nibble names a signed value (MXFP4_TABLE, looked up by a shuffle), then as
   Q8_0; the factor is the block's power of two. */
static inline __attribute__((always_inline)) void tile_mxfp4(
        const int XR, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t nb, int ahead,
        float *res) {
    const __m256i table = _mm256_setr_epi8(MXFP4_TABLE, MXFP4_TABLE);
    __m256 acc[4];
    for (int r = 0; r < XR; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + 17 * b;
        if ((b & 3) == 0)
            ASK(ahead, blk, 64);
        const float d = mxfp4_factor(blk[0]);
        const __m256i q = _mm256_shuffle_epi8(table, nibbles_32(blk + 1));
        const __m256i u = _mm256_sign_epi8(q, q);
        for (int r = 0; r < XR; r++) {
            const xq_32 *y = X_32(r, b);
            const __m256i s = _mm256_sign_epi8(load32(y->qs), q);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d),
                                     _mm256_cvtepi32_ps(dot_plain(u, s)), acc[r]);
        }
    }
    for (int r = 0; r < XR; r++)
        res[r] = hsum_ps(acc[r]);
}

#define DISPATCH(NAME)                                                                        \
static void run_##NAME(const uint8_t *w, const uint8_t *x, int64_t xs, int xr, int64_t nb,   \
                       int ahead, float *res) {                                               \
    switch (xr) {                                                                             \
        case 1: tile_##NAME(1, w, x, xs, nb, ahead, res); break;                        \
        case 2: tile_##NAME(2, w, x, xs, nb, ahead, res); break;                        \
        case 3: tile_##NAME(3, w, x, xs, nb, ahead, res); break;                        \
        default: tile_##NAME(4, w, x, xs, nb, ahead, res);                              \
    }                                                                                         \
}
DISPATCH(q4_k)
DISPATCH(q5_k)
DISPATCH(q6_k)
DISPATCH(q4_0)
DISPATCH(q4_1)
DISPATCH(q5_0)
DISPATCH(q5_1)
DISPATCH(q8_0)
DISPATCH(mxfp4)
#endif  /* __AVX2__ */

#endif
