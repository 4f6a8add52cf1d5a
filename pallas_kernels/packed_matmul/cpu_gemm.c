/* x @ W on a CPU, fp32, for a weight packed once into panels: the native path's linear layers.
 *
 * Same contract as reference.packed_matmul. The weight [K, N] is stored as ceil(N / 16) panels
 * of [K, 16] (panel p holds output features 16p .. 16p + 15, zero past N), so the sixteen
 * features of one panel at one input feature are one vector, and a panel is read front to back.
 * Output tiles of ROWS rows x PANELS panels stay in registers while k runs over every input
 * feature (one broadcast of x per row and k, one vector load per panel and k). Threads split
 * the panel groups; the tiles of a row block read a group in turn (from memory the first time,
 * from cache after) and, a slice each, prefetch the thread's next group: at decode sizes (8-64
 * rows) the weights do not fit any cache between steps, and oneDNN's packed matmul waited on
 * them (about 21 of the machine's 47 GB/s; docs/kernels.md). Built and loaded by cpu_native.py.
 */
#include <stdint.h>

#include "cpu_vectors.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define ROWS 8   /* 8 x 3 accumulators + 3 panel vectors + 1 broadcast: 28 of AVX-512's 32 registers */
#define PANELS 3

/* Whether this build has AVX-512's registers. With AVX2's sixteen the tiles spill, and the
 * kernel ran 5-7x slower than oneDNN: cpu_native.py then leaves the layers to oneDNN. */
int packed_matmul_f32_fits_registers(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* out[r][16j + l] (r < rows, j < panels) = x[r] . W[:, 16j + l] for one tile; `width` features of
 * the last panel are stored (16 for the others). Prefetches `ahead_lines` 64-byte lines from
 * `ahead` (a slice of the thread's next group), `per_k` of them at each k. */
ALWAYS_INLINE void tile(const float *restrict x, int64_t x_stride, int rows, const float *restrict w, int panels,
                        int64_t k_size, float *restrict out, int64_t out_stride, int width,
                        const float *restrict ahead, int64_t ahead_lines, int64_t per_k) {
    v16 acc[ROWS][PANELS];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < PANELS; j++) acc[r][j] = (v16){0};
    for (int64_t k = 0; k < k_size; k++) {
        v16 panel[PANELS];
        for (int j = 0; j < panels; j++) panel[j] = LOAD(w + (j * k_size + k) * 16);
        for (int64_t line = k * per_k; line < (k + 1) * per_k && line < ahead_lines; line++)
            __builtin_prefetch(ahead + line * 16);
        for (int r = 0; r < rows; r++) {
            float xk = x[r * x_stride + k];
            for (int j = 0; j < panels; j++) acc[r][j] += xk * panel[j];
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j + 1 < panels; j++) STORE(out + r * out_stride + 16 * j, acc[r][j]);
        float *last = out + r * out_stride + 16 * (panels - 1);
        if (width == 16) STORE(last, acc[r][panels - 1]);
        else for (int l = 0; l < width; l++) last[l] = acc[r][panels - 1][l];
    }
}

/* tile() with the row and panel counts as constants, so the loops above unroll into registers. */
static void any_tile(const float *x, int64_t x_stride, int rows, const float *w, int panels, int64_t k_size,
                     float *out, int64_t out_stride, int width, const float *ahead, int64_t ahead_lines) {
    int64_t per_k = (ahead_lines + k_size - 1) / k_size;
#define TILE(R, P) tile(x, x_stride, R, w, P, k_size, out, out_stride, width, ahead, ahead_lines, per_k)
#define BY_PANELS(R) { if (panels == 3) TILE(R, 3); else if (panels == 2) TILE(R, 2); else TILE(R, 1); break; }
    switch (rows) {
        case 1: BY_PANELS(1)
        case 2: BY_PANELS(2)
        case 3: BY_PANELS(3)
        case 4: BY_PANELS(4)
        case 5: BY_PANELS(5)
        case 6: BY_PANELS(6)
        case 7: BY_PANELS(7)
        default: BY_PANELS(8)
    }
#undef BY_PANELS
#undef TILE
}

/* Panels in group g of a weight with panel_count panels: PANELS, fewer in the last group. */
static inline int panels_in_group(int64_t panel_count, int64_t g) {
    int64_t left = panel_count - g * PANELS;
    return (int)(left < PANELS ? left : PANELS);
}

/* One row block's products with panel group g (threads split the groups): each tile of the
 * block reads the group, the tiles prefetching the thread's next group between them. */
static void group_products(const float *x, int64_t x_stride, int64_t m, const float *panels, float *out,
                           int64_t k, int64_t n, int64_t g) {
    int64_t panel_count = (n + 15) / 16, groups = (panel_count + PANELS - 1) / PANELS;
    int64_t tiles = (m + ROWS - 1) / ROWS, lines_per_tile = (PANELS * k + tiles - 1) / tiles;
    int p = panels_in_group(panel_count, g);
    int width = g + 1 < groups || n % 16 == 0 ? 16 : (int)(n % 16);
    const float *w = panels + g * PANELS * k * 16;
    int64_t next_lines = g + 1 < groups ? panels_in_group(panel_count, g + 1) * k : 0;
    for (int64_t t = 0; t < tiles; t++) {
        int64_t first = t * lines_per_tile, lines = next_lines - first;
        lines = lines < 0 ? 0 : lines < lines_per_tile ? lines : lines_per_tile;
        int rows = (int)(m - t * ROWS < ROWS ? m - t * ROWS : ROWS);
        any_tile(x + t * ROWS * x_stride, x_stride, rows, w, p, k, out + t * ROWS * n + g * PANELS * 16, n, width,
                 lines ? w + (PANELS * k + first) * 16 : w, lines);
    }
}

/* out [m, n] (row stride n) = x [m, k] (row stride x_stride) @ the weight packed in `panels`.
 * Rows go in blocks of about BLOCK_BYTES of x, which stay in a core's L2 cache while the
 * block meets every panel group (a prefill's x does not fit there whole); at least 64 rows,
 * so that a decode-sized input is one block and reads each group once (3,072 -> 768 features
 * at 32 rows, weights cold: 485 us in 16-row blocks, 367 in one). */
#define BLOCK_BYTES (256 * 1024)
void packed_matmul_f32(const float *x, int64_t x_stride, const float *panels, float *out, int64_t m, int64_t k,
                       int64_t n, int threads) {
    int64_t groups = ((n + 15) / 16 + PANELS - 1) / PANELS;
    int64_t block = BLOCK_BYTES / 4 / k / ROWS * ROWS;
    block = block < 64 ? 64 : block;
    #pragma omp parallel num_threads(threads)
    for (int64_t first = 0; first < m; first += block) {
        int64_t rows = m - first < block ? m - first : block;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++)
            group_products(x + first * x_stride, x_stride, rows, panels, out + first * n, k, n, g);
    }
}
