/* RMSNorm on a CPU, fp32, optionally after a residual add: the native path's norms.
 *
 * Same contract as reference.rms_norm. torch runs the norm as six passes (square, mean, add,
 * rsqrt, two products) and the residual add as a seventh; here each row is read once for its
 * mean square and once to scale it. The products are the reference's in its order; the mean
 * square is summed in sixteen lanes, so it differs from torch's by rounding only. Built and
 * loaded by cpu_native.py.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_vectors.h"

static inline float mean_square(const float *row, int64_t width) {
    v16 lanes = {0};
    int64_t d = 0;
    for (; d + 16 <= width; d += 16) {
        v16 x = LOAD(row + d);
        lanes += x * x;
    }
    float sum = 0.f;
    for (int i = 0; i < 16; i++) sum += lanes[i];
    for (; d < width; d++) sum += row[d] * row[d];
    return sum / (float)width;
}

/* Gemma's scale is x * inv * (1 + w), Llama's w * (x * inv): the same product either way. */
static inline void scale_row(const float *row, const float *weight, float *out, int64_t width, float inv,
                             int unit_offset) {
    int64_t d = 0;
    for (; d + 16 <= width; d += 16) {
        v16 w = LOAD(weight + d);
        STORE(out + d, LOAD(row + d) * inv * (unit_offset ? 1.f + w : w));
    }
    for (; d < width; d++) out[d] = row[d] * inv * (unit_offset ? 1.f + weight[d] : weight[d]);
}

static inline void add_rows(const float *x, const float *residual, float *summed, int64_t width) {
    int64_t d = 0;
    for (; d + 16 <= width; d += 16) STORE(summed + d, LOAD(x + d) + LOAD(residual + d));
    for (; d < width; d++) summed[d] = x[d] + residual[d];
}

/* x, out [rows, width]; with residual (else NULL) summed = x + residual [rows, width] is
 * written and normed instead of x. Small inputs stay on one thread: a decode batch's norm
 * takes less time than waking the others. */
void rms_norm_f32(const float *x, const float *residual, float *summed, const float *weight, float *out,
                  int64_t rows, int64_t width, float eps, int unit_offset, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * width >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * width;
        if (residual) {
            add_rows(row, residual + r * width, summed + r * width, width);
            row = summed + r * width;
        }
        float inv = 1.f / sqrtf(mean_square(row, width) + eps);
        scale_row(row, weight, out + r * width, width, inv, unit_offset);
    }
}
