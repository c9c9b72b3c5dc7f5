/* The AVX-512 (BW, and VNNI where compiled in) tiles of the GGUF linear layer: two weight
   rows against up to eight rows of x.
   A private part of gguf_dot.c, included once there after its block types (xq_k, xq_32)
   and helpers; it is not a header of its own interface. */
#ifndef FLEXGEN_INFINIGEN_GGUF_TILES_AVX512_H
#define FLEXGEN_INFINIGEN_GGUF_TILES_AVX512_H

/* ---- AVX-512: two weight rows against up to eight rows of x ----------------------------- */

#ifdef GD512
#define X512 8  /* rows of x a tile takes (run2_* below handle 1 to 8) */
/* How far ahead each of the two rows read side by side asks: twice W_AHEAD, since at
   W_AHEAD the reads caught up with the asks (from DRAM and from L3 alike). */
#define W_AHEAD2 (2 * W_AHEAD)

/* A 512-bit vector holds 32 values of each of the two weight rows: bytes 0-31 from the
   first, 32-63 from the second, meeting the same 32 bytes of x in both halves. Their
   integer sums land in separate lanes (0-7 the first row's, 8-15 the second's), so one
   float step serves both rows, and each x vector loaded feeds both; each weight vector
   unpacked feeds eight rows of x. */

/* acc + the 16-bit pair products p * sc summed into 32-bit lanes. */
static inline __m512i dot16_acc(__m512i acc, __m512i p, __m512i sc) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, p, sc);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, sc));
#endif
}

/* 32 bytes at a and 32 at b, one vector. */
static inline __m512i pair32(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* 32 bytes in both halves. */
static inline __m512i twice32(const void *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

/* v shifted by s bits (left when s > 0) in 16-bit lanes; the bits wanted never cross a
   byte. */
static inline __m512i shift16(__m512i v, const int s) {
    return s > 0 ? _mm512_slli_epi16(v, s) : s < 0 ? _mm512_srli_epi16(v, -s) : v;
}

/* The sums of lanes 0-7 (the first weight row's) and 8-15 (the second's). */
static inline void row_sums(__m512 acc, float *first, float *second) {
    *first = hsum_ps(_mm512_castps512_ps256(acc));
    *second = hsum_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
}

/* ternary-logic table for c ? a : b, bit by bit */
#define SELECT_AB 0xE4

/* d (at offset at) of both rows' blocks: [d0 x 8, d1 x 8]; with the f16 after it (dmin) in
   *second the same way. */
static inline __m512 pair_f16(const uint8_t *b0, const uint8_t *b1, int at, __m512 *second) {
    uint32_t h0, h1;
    memcpy(&h0, b0 + at, 4);
    memcpy(&h1, b1 + at, 4);
    const __m512 f = _mm512_castps128_ps512(
        _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)h1, (int)h0)));
    const __m512i lo = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    if (second)
        *second = _mm512_permutexvar_ps(_mm512_add_epi32(lo, _mm512_set1_epi32(1)), f);
    return _mm512_permutexvar_ps(lo, f);
}

/* Q4_K/Q5_K scale and minimum bytes (see k_scales) as two 64-bit words, byte j of each
   the j-th sub-block's. */
static inline void k_scales64(const uint8_t *p, uint64_t *sc, uint64_t *mn) {
    uint32_t u0, u1, u2;
    memcpy(&u0, p, 4);
    memcpy(&u1, p + 4, 4);
    memcpy(&u2, p + 8, 4);
    const uint32_t s_lo = u0 & 0x3F3F3F3Fu, m_lo = u1 & 0x3F3F3F3Fu;
    const uint32_t s_hi = (u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u);
    const uint32_t m_hi = ((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u);
    *sc = s_lo | (uint64_t)s_hi << 32;
    *mn = m_lo | (uint64_t)m_hi << 32;
}

/* Q4_K (FIVE = 0) and Q5_K (FIVE = 1): a super-block's integer sums with the 6-bit scales
   applied (exact in 32 bits, see the top), times d dy; the minima's share in floats,
   dmin m_j times x's msum_j, subtracted. res[8 i + r]: weight row i, x row r. */
static inline __attribute__((always_inline)) void tile512_k45(
        const int FIVE, const int XR, const uint8_t *w0, const uint8_t *w1, const uint8_t *x,
        int64_t xs, int64_t nb, int ahead, float *res) {
    const int64_t bytes = FIVE ? 176 : 144, qs = FIVE ? 48 : 16;
    const __m512i low = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[X512];
    for (int r = 0; r < XR; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *b0 = w0 + bytes * b, *b1 = w1 + bytes * b;
        if (ahead) {
            ASK_KEEP(b0, bytes, W_AHEAD2);
            ASK_KEEP(b1, bytes, W_AHEAD2);
        }
        uint64_t sc0, mn0, sc1, mn1;
        k_scales64(b0 + 4, &sc0, &mn0);
        k_scales64(b1 + 4, &sc1, &mn1);
        /* every 128-bit lane: row 0's eight scale bytes, then row 1's */
        const __m512i scb = _mm512_broadcast_i32x4(
            _mm_set_epi64x((long long)sc1, (long long)sc0));
        __m512 dmin;
        const __m512 d = pair_f16(b0, b1, 0, &dmin);
        const __m512 mins = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_set_epi64x((long long)mn1, (long long)mn0))));
        __m512i hq = _mm512_setzero_si512();
        if (FIVE)
            hq = pair32(b0 + 16, b1 + 16);
        __m512i sum[X512];
        for (int r = 0; r < XR; r++)
            sum[r] = _mm512_setzero_si512();
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m512i v = pair32(b0 + qs + 32 * j, b1 + qs + 32 * j);
            __m512i lo, hi;
            if (FIVE) {
                /* value 64j + l's fifth bit is bit 2j of qh[l], 64j + 32 + l's bit 2j + 1:
                   moved to bit 4 */
                lo = _mm512_ternarylogic_epi32(
                    v, _mm512_and_si512(shift16(hq, 4 - 2 * j), bit4), low, SELECT_AB);
                hi = _mm512_ternarylogic_epi32(
                    _mm512_srli_epi16(v, 4), _mm512_and_si512(shift16(hq, 3 - 2 * j), bit4),
                    low, SELECT_AB);
            } else {
                lo = _mm512_and_si512(v, low);
                hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            /* scale words: sub-block k's of row 0 in the lower half, row 1's in the upper */
            const __m512i s_lo = _mm512_shuffle_epi8(scb, _mm512_mask_blend_epi16(
                0xFFFF0000u, _mm512_set1_epi16((short)(0x8000 | (2 * j))),
                _mm512_set1_epi16((short)(0x8000 | (8 + 2 * j)))));
            const __m512i s_hi = _mm512_shuffle_epi8(scb, _mm512_mask_blend_epi16(
                0xFFFF0000u, _mm512_set1_epi16((short)(0x8000 | (2 * j + 1))),
                _mm512_set1_epi16((short)(0x8000 | (9 + 2 * j)))));
            for (int r = 0; r < XR; r++) {
                const int8_t *y = X_K(r, b)->qs + 64 * j;
                sum[r] = dot16_acc(sum[r], _mm512_maddubs_epi16(lo, twice32(y)), s_lo);
                sum[r] = dot16_acc(sum[r], _mm512_maddubs_epi16(hi, twice32(y + 32)), s_hi);
            }
        }
        for (int r = 0; r < XR; r++) {
            const xq_k *y = X_K(r, b);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]),
                                     _mm512_mul_ps(d, _mm512_set1_ps(y->d)), acc[r]);
            acc[r] = _mm512_fnmadd_ps(mins, _mm512_castsi512_ps(twice32(y->msum)), acc[r]);
        }
    }
    for (int r = 0; r < XR; r++)
        row_sums(acc[r], res + r, res + X512 + r);
}

/* Q6_K (layout at tile_q6_k): slice (n, t) is values 128n + 32t .. + 31, its codes 0-63;
   each 16 values' signed scale fills a 128-bit lane. The -32 offset meets x's 16-value
   sums in the same integer sum. */
static inline __attribute__((always_inline)) void tile512_q6_k(
        const int XR, const uint8_t *w0, const uint8_t *w1, const uint8_t *x, int64_t xs,
        int64_t nb, int ahead, float *res) {
    const __m512i low = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    __m512 acc[X512];
    for (int r = 0; r < XR; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *b0 = w0 + 210 * b, *b1 = w1 + 210 * b;
        if (ahead) {
            ASK_KEEP(b0, 210, W_AHEAD2);
            ASK_KEEP(b1, 210, W_AHEAD2);
        }
        /* words 0-15 row 0's sixteen scales, 16-31 row 1's */
        const __m512i sw = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + 192))),
            _mm_loadu_si128((const __m128i *)(b1 + 192)), 1));
        const __m512i off = _mm512_mullo_epi16(sw, _mm512_set1_epi16(-32));
        const __m512 d = pair_f16(b0, b1, 208, NULL);
        __m512i sum[X512];
        for (int r = 0; r < XR; r++)
            sum[r] = dot16_acc(_mm512_setzero_si512(), twice32(X_K(r, b)->bsums), off);
        #pragma GCC unroll 4
        for (int n = 0; n < 2; n++) {
            const __m512i la = pair32(b0 + 64 * n, b1 + 64 * n);
            const __m512i lb = pair32(b0 + 64 * n + 32, b1 + 64 * n + 32);
            const __m512i h = pair32(b0 + 128 + 32 * n, b1 + 128 + 32 * n);
            #pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const __m512i l = t % 2 ? lb : la;
                /* the nibble (low for t < 2), and bits 2t, 2t + 1 of qh moved to bits 4-5 */
                const __m512i q = _mm512_ternarylogic_epi32(
                    t < 2 ? l : _mm512_srli_epi16(l, 4),
                    _mm512_and_si512(shift16(h, 4 - 2 * t), bits45), low, SELECT_AB);
                const int g = 8 * n + 2 * t;
                const __m512i idx = _mm512_set_epi16(
                    17 + g, 17 + g, 17 + g, 17 + g, 17 + g, 17 + g, 17 + g, 17 + g,
                    16 + g, 16 + g, 16 + g, 16 + g, 16 + g, 16 + g, 16 + g, 16 + g,
                    1 + g, 1 + g, 1 + g, 1 + g, 1 + g, 1 + g, 1 + g, 1 + g,
                    g, g, g, g, g, g, g, g);
                const __m512i s = _mm512_permutexvar_epi16(idx, sw);
                for (int r = 0; r < XR; r++)
                    sum[r] = dot16_acc(sum[r], _mm512_maddubs_epi16(
                        q, twice32(X_K(r, b)->qs + 128 * n + 32 * t)), s);
            }
        }
        for (int r = 0; r < XR; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]),
                                     _mm512_mul_ps(d, _mm512_set1_ps(X_K(r, b)->d)), acc[r]);
    }
    for (int r = 0; r < XR; r++)
        row_sums(acc[r], res + r, res + X512 + r);
}

static inline __attribute__((always_inline)) void tile512_q4_k(
        const int XR, const uint8_t *w0, const uint8_t *w1, const uint8_t *x, int64_t xs,
        int64_t nb, int ahead, float *res) {
    tile512_k45(0, XR, w0, w1, x, xs, nb, ahead, res);
}
static inline __attribute__((always_inline)) void tile512_q5_k(
        const int XR, const uint8_t *w0, const uint8_t *w1, const uint8_t *x, int64_t xs,
        int64_t nb, int ahead, float *res) {
    tile512_k45(1, XR, w0, w1, x, xs, nb, ahead, res);
}

/* The plain types (blocks of 32, see PLAIN_TILE): a vector holds one block of each weight
   row, codes u in bytes (Q8_0: |q|, its sign moved onto x). The offset (Q4_0 -8, Q5_0 -16)
   or minimum m meets x's dsum (dy times the block's code sum) in floats, spread over the
   row's eight lanes. */
static inline __attribute__((always_inline)) void tile512_plain(
        const int TYPE, const int XR, const uint8_t *w0, const uint8_t *w1, const uint8_t *x,
        int64_t xs, int64_t nb, int ahead, float *res) {
    const int64_t bytes = TYPE == GT_Q4_0 ? 18 : TYPE == GT_Q4_1 ? 20 : TYPE == GT_Q5_0 ? 22
                        : TYPE == GT_Q5_1 ? 24 : TYPE == GT_MXFP4 ? 17 : 34;
    const int signed_codes = TYPE == GT_Q8_0 || TYPE == GT_MXFP4;  /* |q|, sign onto x */
    const int has_min = TYPE == GT_Q4_1 || TYPE == GT_Q5_1;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[X512];
    for (int r = 0; r < XR; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *b0 = w0 + bytes * b, *b1 = w1 + bytes * b;
        if (ahead && (b & 1) == 0) {
            ASK_KEEP(b0, 64, W_AHEAD2);
            ASK_KEEP(b1, 64, W_AHEAD2);
        }
        __m512 m, d;
        if (TYPE == GT_MXFP4)
            d = _mm512_insertf32x8(_mm512_set1_ps(mxfp4_factor(b0[0])),
                                   _mm256_set1_ps(mxfp4_factor(b1[0])), 1);
        else
            d = pair_f16(b0, b1, 0, &m);
        __m512i u;
        __mmask64 neg = 0;
        if (TYPE == GT_Q8_0) {
            const __m512i q = pair32(b0 + 2, b1 + 2);
            u = _mm512_abs_epi8(q);
            neg = _mm512_movepi8_mask(q);
        } else {
            /* lanes: row 0's sixteen bytes twice, row 1's twice; the second copy's high
               nibbles are values 16-31 */
            const int at = TYPE == GT_MXFP4 ? 1 :
                           2 + 2 * has_min + (TYPE == GT_Q5_0 || TYPE == GT_Q5_1 ? 4 : 0);
            const __m512i t = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)(b0 + at)))),
                _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b1 + at))), 1);
            u = _mm512_and_si512(_mm512_mask_srli_epi16(t, 0xFF00FF00u, t, 4), low);
            if (TYPE == GT_Q5_0 || TYPE == GT_Q5_1) {
                uint32_t h0, h1;
                memcpy(&h0, b0 + 2 + 2 * has_min, 4);
                memcpy(&h1, b1 + 2 + 2 * has_min, 4);
                u = _mm512_mask_add_epi8(u, _cvtu64_mask64(h0 | (uint64_t)h1 << 32), u,
                                         _mm512_set1_epi8(0x10));
            }
            if (TYPE == GT_MXFP4) {  /* the values the codes name, then as Q8_0 */
                const __m512i q = _mm512_shuffle_epi8(
                    _mm512_broadcast_i32x4(_mm_setr_epi8(MXFP4_TABLE)), u);
                u = _mm512_abs_epi8(q);
                neg = _mm512_movepi8_mask(q);
            }
        }
        /* each lane's share of the offset or minimum term: an eighth of the row's */
        __m512 off = _mm512_setzero_ps();
        if (has_min)
            off = _mm512_mul_ps(m, _mm512_set1_ps(0.125f));
        else if (!signed_codes)
            off = _mm512_mul_ps(d, _mm512_set1_ps(TYPE == GT_Q4_0 ? -1.0f : -2.0f));
        for (int r = 0; r < XR; r++) {
            const xq_32 *y = X_32(r, b);
            __m512i v = twice32(y->qs);
            if (signed_codes)
                v = _mm512_mask_sub_epi8(v, neg, _mm512_setzero_si512(), v);
#ifdef __AVX512VNNI__
            const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, v);
#else
            const __m512i s = _mm512_madd_epi16(_mm512_maddubs_epi16(u, v),
                                                _mm512_set1_epi16(1));
#endif
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                     _mm512_mul_ps(d, _mm512_set1_ps(y->d)), acc[r]);
            if (!signed_codes)
                acc[r] = _mm512_fmadd_ps(off, _mm512_set1_ps(y->dsum), acc[r]);
        }
    }
    for (int r = 0; r < XR; r++)
        row_sums(acc[r], res + r, res + X512 + r);
}

#define PLAIN512(NAME, TYPE)                                                                  \
static inline __attribute__((always_inline)) void tile512_##NAME(                            \
        const int XR, const uint8_t *w0, const uint8_t *w1, const uint8_t *x, int64_t xs,    \
        int64_t nb, int ahead, float *res) {                                                  \
    tile512_plain(TYPE, XR, w0, w1, x, xs, nb, ahead, res);                                   \
}
PLAIN512(q4_0, GT_Q4_0)
PLAIN512(q4_1, GT_Q4_1)
PLAIN512(q5_0, GT_Q5_0)
PLAIN512(q5_1, GT_Q5_1)
PLAIN512(q8_0, GT_Q8_0)
PLAIN512(mxfp4, GT_MXFP4)

/* Weight rows w0, w1 against xr (1 to X512) rows of x: res[X512 i + r]. With ahead set (the
   first rows of x to pass these weight rows in a chunk) the tile asks for the rows' bytes
   ahead. */
#define DISPATCH2(NAME)                                                                       \
static void run2_##NAME(const uint8_t *w0, const uint8_t *w1, const uint8_t *x, int64_t xs,  \
                        int xr, int64_t nb, int ahead, float *res) {                          \
    switch (xr) {                                                                             \
        case 1: tile512_##NAME(1, w0, w1, x, xs, nb, ahead, res); break;                      \
        case 2: tile512_##NAME(2, w0, w1, x, xs, nb, ahead, res); break;                      \
        case 3: tile512_##NAME(3, w0, w1, x, xs, nb, ahead, res); break;                      \
        case 4: tile512_##NAME(4, w0, w1, x, xs, nb, ahead, res); break;                      \
        case 5: tile512_##NAME(5, w0, w1, x, xs, nb, ahead, res); break;                      \
        case 6: tile512_##NAME(6, w0, w1, x, xs, nb, ahead, res); break;                      \
        case 7: tile512_##NAME(7, w0, w1, x, xs, nb, ahead, res); break;                      \
        default: tile512_##NAME(8, w0, w1, x, xs, nb, ahead, res);                            \
    }                                                                                         \
}
DISPATCH2(q4_k)
DISPATCH2(q5_k)
DISPATCH2(q6_k)
DISPATCH2(q4_0)
DISPATCH2(q4_1)
DISPATCH2(q5_0)
DISPATCH2(q5_1)
DISPATCH2(q8_0)
DISPATCH2(mxfp4)
#endif  /* AVX-512 */

#endif
