/* Choosing the tokens with the most softmax mass (InfiniGen's "mass" rule), shared by the
   speculation kernels (speculation.c, pages.c) and the selection from given scores
   (selection.c). */
#ifndef FLEXGEN_INFINIGEN_SELECTION_H
#define FLEXGEN_INFINIGEN_SELECTION_H
#include "common.h"

#define HIDDEN_SCORE (-3.0e38f)  /* a score whose exp is 0: a token that may not be chosen */

float kth_largest_mass(float *x, int64_t n, int64_t k, int64_t G, int64_t *above);
void column_mass(const float *s, int64_t ld, const uint8_t *vis, int64_t G, int64_t T,
                 float *mass, float *tmp);
void mass_of_masked(float *s, int64_t ld, const float *top, int64_t G, int64_t T,
                    float *mass);
void choose_by_mass(const float *mass, const uint8_t *vis, int64_t T, int64_t G,
                    int64_t cap, int64_t *row, int64_t width, float *tmp);
#endif
