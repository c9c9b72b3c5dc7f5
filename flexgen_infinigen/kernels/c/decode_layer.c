
/* One decode step of a Llama-family layer (one new token per sequence) in one call, from an
   argument block that Python builds once per layer and shape (kernels/layer_call.py) and
   updates with a few pointers each step. It calls the library's own kernels in the order
   models/llama.py runs them, so it gives what the per-operation path gives, to rounding:
   RMSNorm, q/k/v (float rows, 4-bit or 8-bit codes), the q/k norms of a model that has
   them (per head: Qwen3; over all heads: OLMoE), the rotary embedding, the cache write
   and attention over every row of a float cache kept in CPU memory, the o-projection and its
   residual, then RMSNorm, the SwiGLU MLP and its residual. The parts run are chosen by
   `mode`: InfiniGen's attention over the rows it chose and the next layer's speculation
   (DL_CHOSEN, DL_SPECULATE, DL_OWN: decode_select.c, reached through the block's
   select_step slot, never called by name) run inside the same call; another KV policy
   keeps its own attention between an input call and an output call. */

#include "decode_layer.h"
#include "gguf_dot.h"

int decode_layer_q4_ready(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

int dl_run_linear(const dl_linear *l, const float *x, float *out, int64_t M, int64_t nt) {
    switch (l->kind) {
        case LIN_FLOAT:
            linear_rows(x, (const float *)l->w, l->bias, out, M, l->n, l->k, nt);
            return 1;
        case LIN_Q4:
            return linear_q4(x, (const uint8_t *)l->w, (const float *)l->scale,
                             (const float *)l->minimum, l->bias, out, M, l->n, l->k, l->group,
                             nt);
        case LIN_Q8:
            return linear_q8(x, (const int8_t *)l->w, (const float *)l->scale,
                             (const float *)l->minimum, l->bias, out, M, l->n, l->k, l->group,
                             nt);
        case LIN_Q4_H16:
            return linear_q4_h16(x, (const uint8_t *)l->w, (const uint16_t *)l->scale,
                                 (const uint16_t *)l->minimum, l->bias, out, M, l->n, l->k,
                                 l->group, nt);
        case LIN_Q8_H16:
            return linear_q8_h16(x, (const int8_t *)l->w, (const uint16_t *)l->scale,
                                 (const uint16_t *)l->minimum, l->bias, out, M, l->n, l->k,
                                 l->group, nt);
        case LIN_GGUF:
            return gguf_linear(l->group, (const uint8_t *)l->w, (const int32_t *)l->scale, x,
                               l->bias, out, M, l->n, l->k, nt);
    }
    return 0;
}

/* Runs the parts of `mode`; returns 0 when a linear kernel could not run (the caller
   decides once, at load, that they can: decode_layer_q4_ready). */
int decode_layer(const dl_args *a, int64_t mode) {
    const int64_t B = a->B, H = a->H, KV = a->KV, D = a->D, nt = a->nthreads;
    const int64_t hidden = a->hidden, C = B * KV, G = H / KV;
    const float *cur = a->h;
    int ok = 1;
    if (mode & DL_IN) {
        rms_norm_rows(a->h, a->attn_norm, a->x, B, hidden, (float)a->eps, nt);
        ok &= dl_run_linear(&a->q, a->x, a->lin, B, nt);
        if (a->q_norm)  /* in place: each row is read whole before it is written */
            rms_norm_rows(a->lin, a->q_norm, a->lin, a->qk_full ? B : B * H,
                          a->qk_full ? H * D : D, (float)a->eps, nt);
        rotary_rows(a->lin, a->cos, a->sin, a->q_rot, B, H, D, nt);
        ok &= dl_run_linear(&a->k, a->x, a->lin, B, nt);
        if (a->k_norm)
            rms_norm_rows(a->lin, a->k_norm, a->lin, a->qk_full ? B : B * KV,
                          a->qk_full ? KV * D : D, (float)a->eps, nt);
        rotary_rows(a->lin, a->cos, a->sin, a->kn, B, KV, D, nt);
        ok &= dl_run_linear(&a->v, a->x, a->vn, B, nt);
    }
    /* InfiniGen's part, through the slot its selection set (decode_select.c's
       dl_select_step): after the input half, before attention over every row */
    if (mode & (DL_SPECULATE | DL_OWN | DL_CHOSEN))
        ok &= a->select_step ? a->select_step(a, mode) : 0;
    if (mode & DL_ATTEND) {
        /* the new token's row first, then attention over rows first .. position */
        for (int64_t c = 0; c < C; c++) {
            __builtin_memcpy(a->kc + a->position * a->st + c * a->sc, a->kn + c * D,
                             sizeof(float) * D);
            __builtin_memcpy(a->vc + a->position * a->st + c * a->sc, a->vn + c * D,
                             sizeof(float) * D);
        }
        const int64_t T = a->position + 1 - a->first;
        for (int64_t c = 0; c < C; c++)  /* a sequence's mask, once per KV head column */
            __builtin_memcpy(a->bias_rows + c * T, a->bias + (c / KV) * a->bias_stride + a->first,
                             sizeof(float) * T);
        const float scale = 1.0f / sqrtf((float)D);
        for (int64_t i = 0; i < B * H * D; i++)  /* q [B, H, D] is [C, G, D] */
            a->lin[i] = a->q_rot[i] * scale;
        attend_rows(a->lin, a->kc + a->first * a->st, a->vc + a->first * a->st, a->bias_rows,
                    a->attn, NULL, T, C, G, D, a->st, a->sc, nt);
    }
    if (mode & DL_OUT) {
        float *dst = (mode & DL_MLP) ? a->mid : a->h_out;
        ok &= dl_run_linear(&a->o, a->attn, dst, B, nt);
        for (int64_t i = 0; i < B * hidden; i++)
            dst[i] += cur[i];
        cur = dst;
    }
    if (mode & DL_MLP) {
        const int64_t F = a->inter;
        rms_norm_rows(cur, a->mlp_norm, a->x2, B, hidden, (float)a->eps, nt);
        ok &= dl_run_linear(&a->gate, a->x2, a->g, B, nt);
        ok &= dl_run_linear(&a->up, a->x2, a->u, B, nt);
        for (int64_t i = 0; i < B * F; i++) {
            a->g[i] = silu1(a->g[i]) * a->u[i];
        }
        ok &= dl_run_linear(&a->down, a->g, a->h_out, B, nt);
        for (int64_t i = 0; i < B * hidden; i++)
            a->h_out[i] += cur[i];
    }
    return ok;
}
