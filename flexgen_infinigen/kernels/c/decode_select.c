#include "decode_layer.h"

/* InfiniGen's decode-step work inside the fused layer call (decode_layer.c), computed by the
   same kernels the per-operation path calls one by one (kv/infinigen/cache.py), so that a
   selecting layer is one foreign call:

   - DL_CHOSEN: the new key projected and packed into this layer's speculation keys
     (InfiniGenCache._write_keys), attention over the rows the previous layer's speculation
     chose, read where the cache keeps them, plus the new token (_attend_in_place), then the
     new row written into the cache (store_token);
   - DL_SPECULATE: the next layer's rehearsal from this layer's attention input x
     (Rehearsal.projected_query: its q projection, the rotary embedding, the per-KV-head
     projection) and its selection (SpeculationKeys.select_mass: scores against the packed
     keys and the mass rule), written to `order` for the next layer's load;
   - DL_OWN: the same scoring and rule for this layer itself, from its own rotated query
     (InfiniGenCache.attend's OWN branch), the order read by DL_CHOSEN as its index.

   decode_layer.c reaches these through the block's select_step slot (dl_select_step), set
   by kv/infinigen/fused_select.py: this file calls decode_layer.c (dl_run_linear), never
   the other way. */

void project_heads(const float *x, const float *P, float *out, int64_t B, int64_t N,
                   int64_t KV, int64_t d, int64_t r, int64_t xsb, int64_t xsn, int64_t xsk,
                   int64_t osb, int64_t osn, int64_t osk, int64_t psb, int64_t nthreads);
void spec_write(const float *x, uint8_t *codes, float *lo, float *scale, int64_t n,
                int64_t start, int64_t L, int64_t C, int64_t W, int64_t P, int64_t bits);
void speculate_mass(const uint8_t *codes, const float *scale, const float *lo, const float *q,
                    const float *qsum, const uint8_t *visible, const int64_t *cap,
                    int64_t *order, int64_t T, int64_t L, int64_t C, int64_t KV, int64_t P,
                    int64_t G, int64_t bits, int64_t width, int64_t nthreads);
void attend_indexed(const float *q, const float *k, const float *v, const int64_t *index,
                    const int64_t *counts, int64_t n, const float *k_new, const float *v_new,
                    float *out, const float *sinks, int64_t C, int64_t G, int64_t D,
                    int64_t st, int64_t sc, int64_t nthreads);

static int dl_attend_chosen(const dl_args *a) {
    const dl_select *s = a->sel;
    const int64_t B = a->B, H = a->H, KV = a->KV, D = a->D, C = B * KV, nt = a->nthreads;
    if (s->codes) {  /* kn [B, 1, KV, D] -> rows [B, KV, r] (one token: n = 1) */
        project_heads(a->kn, s->proj, s->s_rows, B, 1, KV, D, s->r, KV * D, KV * D, D,
                      KV * s->r, KV * s->r, s->r, s->proj_sb, nt);
        spec_write(s->s_rows, s->codes, s->lo, s->scale, 1, a->position, s->L, C, s->r, s->P,
                   s->bits);
    }
    const float scale = 1.0f / sqrtf((float)D);
    for (int64_t i = 0; i < B * H * D; i++)  /* q [B, H, D] is [C, G, D] */
        a->lin[i] = a->q_rot[i] * scale;
    attend_indexed(a->lin, a->kc, a->vc, s->index, s->counts, s->n, a->kn, a->vn, a->attn,
                   NULL, C, H / KV, D, a->st, a->sc, nt);
    /* the chosen rows are all before `position`: the new row is written after attention */
    for (int64_t c = 0; c < C; c++) {
        __builtin_memcpy(a->kc + a->position * a->st + c * a->sc, a->kn + c * D,
                         sizeof(float) * D);
        __builtin_memcpy(a->vc + a->position * a->st + c * a->sc, a->vn + c * D,
                         sizeof(float) * D);
    }
    return 1;
}

static int dl_speculate(const dl_args *a, int own) {
    const dl_select *s = a->sel;
    const int64_t B = a->B, H = a->H, KV = a->KV, D = a->D, C = B * KV, G = H / KV;
    const int64_t nt = a->nthreads, r = s->nr, per = 8 / s->nbits, P = s->nP, W = P * per;
    const float *rot = a->q_rot;  /* DL_OWN: the layer's own rotated query */
    if (!own) {  /* the rehearsal: the next layer's query from this layer's input x */
        const float *x = a->x;
        if (s->nscale_x) {  /* x renormed (InfiniGen's Rehearsal.renormed) */
            for (int64_t b = 0; b < B; b++)
                for (int64_t j = 0; j < a->hidden; j++) {
                    const float y = x[b * a->hidden + j] * s->nscale_x[j];
                    s->s_x[b * a->hidden + j] = s->nshift_x ? s->nshift_x[j] + y : y;
                }
            x = s->s_x;
        }
        if (!dl_run_linear(&s->nq, x, s->s_lin, B, nt))
            return 0;
        rotary_rows(s->s_lin, a->cos, a->sin, s->s_rot, B, H, D, nt);
        rot = s->s_rot;
    }
    /* q [B, H, D] seen as [B, G, KV, D] (head k * G + g), projected into pq [B, KV, G, r] */
    project_heads(rot, s->nproj, s->s_pq, B, G, KV, D, r, H * D, D, G * D, KV * G * r, r,
                  G * r, s->nproj_sb, nt);
    /* the kernel's slot-plane column order (column j * per + t at t * P + j), zero columns
       past r, and each query's sum */
    for (int64_t i = 0; i < C * G; i++) {
        const float *q = s->s_pq + i * r;
        float *out = s->s_packed + i * W, sum = 0.0f;
        for (int64_t w = 0; w < W; w++) {
            const float v = w < r ? q[w] : 0.0f;
            out[(w % per) * P + w / per] = v;
            sum += v;
        }
        s->s_qsum[i] = sum;
    }
    speculate_mass(s->ncodes, s->nscale, s->nlo, s->s_packed, s->s_qsum, s->visible, s->cap,
                   s->order, s->T, s->nL, C, KV, P, G, s->nbits, s->width, nt);
    return 1;
}

/* The slot's function: the parts of `mode` in the order decode_layer ran them before the
   slot (the next layer's speculation reads x only; the layer's own choice comes before its
   attention over the rows chosen). Every part asked for runs; 0 when one could not. */
int dl_select_step(const dl_args *a, int64_t mode) {
    int ok = 1;
    if (mode & DL_SPECULATE)
        ok &= dl_speculate(a, 0);
    if (mode & DL_OWN)
        ok &= dl_speculate(a, 1);
    if (mode & DL_CHOSEN)
        ok &= dl_attend_chosen(a);
    return ok;
}
