/* RoPE on a CPU, fp32 ("rotate half" layout): the native path's q and k rotation.
 *
 * Same contract as reference.rotary_embedding. torch runs it as a negation, a concatenation,
 * two products and a sum, each a pass over q and k; here each head's two halves are read once
 * and both rotated halves written: out1 = x1 c - x2 s, out2 = x2 c + x1 s, the reference's
 * own products and sums (x * cos + (-x2) * sin), so the results are bit-identical. Built and
 * loaded by cpu_native.py.
 */
#include <stdint.h>

#include "cpu_vectors.h"

/* Separate products and sums, as torch's: a fused multiply-add would round differently. */
#pragma GCC optimize("fp-contract=off")

static inline void rotate_head(const float *x, const float *c, const float *s, float *out, int64_t half) {
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
        v16 x1 = LOAD(x + i), x2 = LOAD(x + half + i), c1 = LOAD(c + i), s1 = LOAD(s + i);
        v16 c2 = LOAD(c + half + i), s2 = LOAD(s + half + i);
        STORE(out + i, x1 * c1 + (-x2) * s1);
        STORE(out + half + i, x2 * c2 + x1 * s2);
    }
    for (; i < half; i++) {
        float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * c[i] + (-x2) * s[i];
        out[half + i] = x2 * c[half + i] + x1 * s[half + i];
    }
}

/* x [tokens, heads, d] (token stride x_stride, heads contiguous), cos/sin [tokens, d],
 * out [tokens, heads, d] contiguous. */
void rotary_f32(const float *x, int64_t x_stride, const float *cos, const float *sin, float *out,
                int64_t tokens, int64_t heads, int64_t d, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (tokens * heads * d >= (1 << 16))
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++)
            rotate_head(x + t * x_stride + h * d, cos + t * d, sin + t * d, out + (t * heads + h) * d, d / 2);
}
