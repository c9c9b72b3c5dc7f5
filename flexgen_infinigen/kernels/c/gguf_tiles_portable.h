/* The portable path of the GGUF linear layer: a block unpacked to integer codes, then integer
   dot products (any CPU; the embedding lookup and the reference use its unpacking).
   A private part of gguf_dot.c, included once there after its block types (xq_k, xq_32)
   and helpers; it is not a header of its own interface. */
#ifndef FLEXGEN_INFINIGEN_GGUF_TILES_PORTABLE_H
#define FLEXGEN_INFINIGEN_GGUF_TILES_PORTABLE_H

/* ---- the portable path: one block's values as integers, then integer dots -------------- */

/* Block b's 256 (K-quants) or 32 values as (code, scale index) pieces: codes q[i] with
   value = factor[group of i] * q[i] + minimum[group of i], groups of 32 (Q6_K: 16). */
static int unpack_block(int64_t type, const uint8_t *blk, int16_t *q, float *factor,
                        float *minimum) {
    switch (type) {
        case GT_Q4_K: case GT_Q5_K: {
            const float d = f16_at(blk), dmin = f16_at(blk + 2);
            uint8_t sc[8], mn[8];
            k_scales(blk + 4, sc, mn);
            const uint8_t *qs = blk + (type == GT_Q4_K ? 16 : 48), *qh = blk + 16;
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    int lo = qs[32 * j + l] & 0x0F, hi = qs[32 * j + l] >> 4;
                    if (type == GT_Q5_K) {
                        lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                    }
                    q[64 * j + l] = (int16_t)lo;
                    q[64 * j + 32 + l] = (int16_t)hi;
                }
            for (int s = 0; s < 8; s++) {
                factor[s] = d * sc[s];
                minimum[s] = -dmin * mn[s];
            }
            return 32;
        }
        case GT_Q6_K: {
            const float d = f16_at(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int n = 0; n < 2; n++)
                for (int t = 0; t < 4; t++)
                    for (int l = 0; l < 32; l++) {
                        const uint8_t lq = blk[64 * n + 32 * (t % 2) + l];
                        const int nib = t < 2 ? (lq & 0x0F) : (lq >> 4);
                        const int high = (blk[128 + 32 * n + l] >> (2 * t)) & 3;
                        q[128 * n + 32 * t + l] = (int16_t)((nib | (high << 4)) - 32);
                    }
            for (int g = 0; g < 16; g++) {
                factor[g] = d * sc[g];
                minimum[g] = 0.0f;
            }
            return 16;
        }
        case GT_MXFP4: {  /* gpt-oss's experts: 2^(e - 128) times twice an FP4 E2M1 value */
            static const int8_t values[16] = {MXFP4_TABLE};
            for (int l = 0; l < 16; l++) {
                q[l] = values[blk[1 + l] & 0x0F];
                q[l + 16] = values[blk[1 + l] >> 4];
            }
            factor[0] = mxfp4_factor(blk[0]);
            minimum[0] = 0.0f;
            return 32;
        }
        case GT_Q8_0:
            for (int i = 0; i < 32; i++)
                q[i] = ((const int8_t *)(blk + 2))[i];
            factor[0] = f16_at(blk);
            minimum[0] = 0.0f;
            return 32;
        default: {  /* Q4_0, Q4_1, Q5_0, Q5_1 */
            const int has_min = type == GT_Q4_1 || type == GT_Q5_1;
            const int five = type == GT_Q5_0 || type == GT_Q5_1;
            const uint8_t *qs = blk + 2 + 2 * has_min + 4 * five;
            uint32_t h = 0;
            if (five)
                memcpy(&h, blk + 2 + 2 * has_min, 4);
            for (int l = 0; l < 16; l++) {
                int lo = qs[l] & 0x0F, hi = qs[l] >> 4;
                if (five) {
                    lo |= ((h >> l) & 1) << 4;
                    hi |= ((h >> (l + 16)) & 1) << 4;
                }
                q[l] = (int16_t)lo;
                q[l + 16] = (int16_t)hi;
            }
            const float d = f16_at(blk);
            factor[0] = d;
            minimum[0] = has_min ? f16_at(blk + 2) : d * (five ? -16.0f : -8.0f);
            return 32;
        }
    }
}

static void run_portable(int64_t type, const uint8_t *w, const uint8_t *x, int64_t xs, int xr,
                         int64_t nb, float *res) {
    const gguf_format *f = gguf_format_of(type);
    for (int r = 0; r < xr; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int16_t q[256];
            float factor[16], minimum[16];
            const int group = unpack_block(type, w + f->bytes * b, q, factor, minimum);
            const int8_t *y;
            float dy;
            if (f->values == 256) {
                const xq_k *blk = (const xq_k *)(x + r * xs) + b;
                y = blk->qs;
                dy = blk->d;
            } else {
                const xq_32 *blk = (const xq_32 *)(x + r * xs) + b;
                y = blk->qs;
                dy = blk->d;
            }
            for (int g = 0; g < f->values / group; g++) {
                int dot = 0, ysum = 0;
                for (int i = 0; i < group; i++) {
                    dot += q[group * g + i] * y[group * g + i];
                    ysum += y[group * g + i];
                }
                total += dy * (factor[g] * (float)dot + minimum[g] * (float)ysum);
            }
        }
        res[r] = total;
    }
}

#endif
