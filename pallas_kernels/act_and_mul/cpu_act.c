/* act(gate) * up on a CPU, fp32: the native path's fused MLP activation.
 *
 * Same contract as reference.act_and_mul for SiLU and tanh-approximated GELU. torch runs the
 * activation and the product as two passes over the gate (and GELU's tanh through a slow,
 * exact vector routine); here each row's gate and up are read once, sixteen features at a
 * time, and e^x comes from cpu_vectors.h's polynomial (within 2 ulp of expf). The formulas are
 * torch's own, so results differ from it by a few ulp: SiLU is x / (1 + e^-x), GELU
 * 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). Built and loaded by cpu_native.py.
 */
#include <stdint.h>

#include "cpu_vectors.h"

#define SILU 0
#define GELU_TANH 1

static inline v16 absolute(v16 x) { return (v16)((lanes16)x & 0x7fffffff); }

/* Lanes of `when_negative` where x < 0, of `otherwise` elsewhere. */
static inline v16 pick_negative(v16 x, v16 when_negative, v16 otherwise) {
    lanes16 negative = less16(x, (v16){0});
    return (v16)(((lanes16)when_negative & negative) | ((lanes16)otherwise & ~negative));
}

/* x / (1 + e^-x), through e^-|x| <= 1: for x < 0, x e^x / (e^x + 1). */
static inline v16 silu16(v16 x) {
    v16 small = exp16_nonpositive(-absolute(x));
    return pick_negative(x, x * small, x) / (1.f + small);
}

/* tanh y = sign(y) (1 - e^-2|y|) / (1 + e^-2|y|). */
static inline v16 tanh16(v16 y) {
    v16 small = exp16_nonpositive(-2.f * absolute(y));
    v16 magnitude = (1.f - small) / (1.f + small);
    return pick_negative(y, -magnitude, magnitude);
}

static inline v16 gelu_tanh16(v16 x) {
    v16 inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.f + tanh16(inner));
}

static inline v16 activate(v16 gate, int activation) {
    return activation == SILU ? silu16(gate) : gelu_tanh16(gate);
}

/* in [rows, 2 * width] (each row: gate, then up) -> out [rows, width]. */
void act_and_mul_f32(const float *in, float *out, int64_t rows, int64_t width, int activation, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = in + r * 2 * width, *up = gate + width;
        float *row = out + r * width;
        int64_t d = 0;
        for (; d + 16 <= width; d += 16) STORE(row + d, activate(LOAD(gate + d), activation) * LOAD(up + d));
        for (; d < width; d++) row[d] = activate((v16){gate[d]}, activation)[0] * up[d];
    }
}
