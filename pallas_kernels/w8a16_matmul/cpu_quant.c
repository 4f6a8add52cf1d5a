/* Weight-only INT8 and INT4 matmuls on a CPU, fp32 activations: the native path's quantized
 * linear layers.
 *
 * Same contracts as w8a16_matmul/reference.py and w4a16_matmul/reference.py, read in place:
 * the weight stays [k, n] int8 (INT4: [k / 2, n] bytes, a byte holding rows i and i + k / 2),
 * never dequantized whole. A tile of ROWS rows x VECS x 16 output features keeps its sums in
 * registers while k runs; at each k sixteen weights are loaded as bytes, widened to floats in
 * registers, multiplied by their scale (and less their zero), and meet every row's broadcast
 * input. Threads split the feature tiles; rows go in blocks whose x stays in cache while the
 * block meets every tile (a decode's rows are one block, so the weights are read once). Built
 * and loaded by cpu_native.py.
 */
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_vectors.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define ROWS 4
#define VECS 4 /* 4 x 4 sums + 4 weight vectors + scale + zero + broadcast: within AVX-512's 32 registers */

typedef int8_t bytes16 __attribute__((vector_size(16), aligned(1)));
typedef int32_t ints16 __attribute__((vector_size(64)));

/* Sixteen bytes sign-extended to 32-bit lanes: one vpmovsxbd with AVX-512 (GCC builds the
 * portable conversion a byte at a time, measured 5-8x slower kernels). */
ALWAYS_INLINE ints16 sign_extend(const int8_t *p) {
#ifdef __AVX512F__
    return (ints16)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return __builtin_convertvector(*(const bytes16 *)p, ints16);
#endif
}

/* Sixteen weights of one stored row as floats (INT4: the low nibbles, or with `high` the high
 * ones, sign-extended). */
ALWAYS_INLINE v16 widen(const int8_t *p, int bits, int high) {
    ints16 v = sign_extend(p);
    if (bits == 4) v = high ? v >> 4 : (v << 28) >> 28;
    return __builtin_convertvector(v, v16);
}

/* Sums of `rows` rows (constant per call site) against `vecs` vectors of features from j over
 * stored rows [k0, k1): weight row kk's values meet x column kk + x_offset. With `grouped`
 * scales each weight vector is scaled (less its zero) as it is loaded; per-channel scales wait
 * for the store. Each k prefetches the tile's row AHEAD rows on: the rows are n bytes apart. */
#define AHEAD 12
ALWAYS_INLINE void accumulate(v16 acc[ROWS][VECS], const float *x, int64_t x_stride, int rows, const int8_t *w,
                              int64_t n, int64_t j, int vecs, int64_t k0, int64_t k1, int64_t x_offset, int bits,
                              int high, int grouped, const float *scale, const float *zero) {
    v16 s[VECS], z[VECS];
    for (int v = 0; v < vecs; v++) {
        s[v] = grouped ? LOAD(scale + j + 16 * v) : (v16){0};
        z[v] = grouped && zero ? LOAD(zero + j + 16 * v) : (v16){0};
    }
    for (int64_t kk = k0; kk < k1; kk++) {
        __builtin_prefetch(w + (kk + AHEAD) * n + j);
        v16 wv[VECS];
        for (int v = 0; v < vecs; v++) {
            wv[v] = widen(w + kk * n + j + 16 * v, bits, high);
            if (grouped) wv[v] = (wv[v] - z[v]) * s[v];
        }
        for (int r = 0; r < rows; r++) {
            float xk = x[r * x_stride + kk + x_offset];
            for (int v = 0; v < vecs; v++) acc[r][v] += xk * wv[v];
        }
    }
}

/* One tile: every group of stored rows (INT4: each half of k through its own nibbles). */
ALWAYS_INLINE void tile(const float *x, int64_t x_stride, int rows, const int8_t *w, int64_t k_rows, int64_t n,
                        int64_t j, int vecs, int bits, int grouped, const float *scales, const float *zeros,
                        int64_t group, float *out) {
    v16 acc[ROWS][VECS];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < VECS; v++) acc[r][v] = (v16){0};
    int halves = bits == 4 ? 2 : 1;
    int64_t step = grouped ? group : k_rows;
    for (int h = 0; h < halves; h++)
        for (int64_t k0 = 0; k0 < k_rows; k0 += step) {
            int64_t g = (k0 + h * k_rows) / group, k1 = k0 + step < k_rows ? k0 + step : k_rows;
            accumulate(acc, x, x_stride, rows, w, n, j, vecs, k0, k1, h * k_rows, bits, h, grouped, scales + g * n,
                       zeros ? zeros + g * n : 0);
        }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++)
            STORE(out + r * n + j + 16 * v, grouped ? acc[r][v] : acc[r][v] * LOAD(scales + j + 16 * v));
}

/* tile() with the row and vector counts, the bits and the scales' kind as constants, so the
 * sums stay in registers and no branch is left in the k loop. */
static void any_tile(const float *x, int64_t x_stride, int rows, const int8_t *w, int64_t k_rows, int64_t n,
                     int64_t j, int vecs, int bits, int grouped, const float *scales, const float *zeros,
                     int64_t group, float *out) {
#define TILE(R, V, B, G) tile(x, x_stride, R, w, k_rows, n, j, V, B, G, scales, zeros, group, out)
#define BY_KIND(R, V) { if (bits == 4) TILE(R, V, 4, 1); else if (grouped) TILE(R, V, 8, 1); \
                        else TILE(R, V, 8, 0); }
#define BY_VECS(R) { if (vecs == 4) BY_KIND(R, 4) else if (vecs == 3) BY_KIND(R, 3) \
                     else if (vecs == 2) BY_KIND(R, 2) else BY_KIND(R, 1) break; }
    switch (rows) {
        case 1: BY_VECS(1)
        case 2: BY_VECS(2)
        case 3: BY_VECS(3)
        default: BY_VECS(4)
    }
#undef BY_VECS
#undef BY_KIND
#undef TILE
}

/* Output features past the last whole vector, one at a time. */
static void tail_features(const float *x, int64_t x_stride, int64_t m, const int8_t *w, int64_t k_rows, int64_t n,
                          int64_t j0, int bits, const float *scales, const float *zeros, int64_t group, float *out) {
    int halves = bits == 4 ? 2 : 1;
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = j0; j < n; j++) {
            float sum = 0.f;
            for (int h = 0; h < halves; h++)
                for (int64_t kk = 0; kk < k_rows; kk++) {
                    int32_t q = w[kk * n + j];
                    if (bits == 4) q = h ? q >> 4 : (int32_t)((uint32_t)q << 28) >> 28;
                    int64_t g = (kk + h * k_rows) / group;
                    float value = ((float)q - (zeros ? zeros[g * n + j] : 0.f)) * scales[g * n + j];
                    sum += x[r * x_stride + kk + h * k_rows] * value;
                }
            out[r * n + j] = sum;
        }
}

/* out [m, n] = x [m, k] (row stride x_stride) @ dequantize(w): `bits` 8 (w [k, n]) or 4 (w
 * [k / 2, n], two weights a byte); scales [k / group, n] (per channel: group = k, one row),
 * zeros likewise or NULL. Rows in blocks of about BLOCK_BYTES of x (at least 64 rows). */
#define BLOCK_BYTES (256 * 1024)
void quantized_matmul_f32(const float *x, int64_t x_stride, const int8_t *w, const float *scales,
                          const float *zeros, float *out, int64_t m, int64_t k, int64_t n, int64_t group, int bits,
                          int threads) {
    int64_t k_rows = bits == 4 ? k / 2 : k, whole = n / 16 * 16;
    int64_t tiles = (whole / 16 + VECS - 1) / VECS;
    int64_t block = BLOCK_BYTES / 4 / k / ROWS * ROWS;
    block = block < 64 ? 64 : block;
    #pragma omp parallel num_threads(threads)
    for (int64_t first = 0; first < m; first += block) {
        int64_t rows = m - first < block ? m - first : block;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t j = t * VECS * 16;
            int vecs = (int)((whole - j) / 16 < VECS ? (whole - j) / 16 : VECS);
            for (int64_t r = 0; r < rows; r += ROWS)
                any_tile(x + (first + r) * x_stride, x_stride, (int)(rows - r < ROWS ? rows - r : ROWS), w, k_rows,
                         n, j, vecs, bits, bits == 4 || group < k, scales, zeros, group, out + (first + r) * n);
        }
    }
    if (whole < n)
        tail_features(x, x_stride, m, w, k_rows, n, whole, bits, scales, zeros, group, out);
}
