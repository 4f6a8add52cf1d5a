/* Paged decode attention on a CPU, fp32: the native path's fused kernel.
 *
 * Same contract as reference.paged_attention. Each (sequence, kv head) walks its own pages in
 * place (no gathered copy of K/V) with an online softmax rescaled once per page; the heads of a
 * GQA group share each K and V row they read. Built and loaded by cpu_native.py.
 */
#include <math.h>
#include <stdint.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t dim) {
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t d = 0; d < dim; d++) sum += a[d] * b[d];
    return sum;
}

static inline void add_scaled(float weight, const float *restrict x, float *restrict y, int64_t dim) {
    #pragma omp simd
    for (int64_t d = 0; d < dim; d++) y[d] += weight * x[d];
}

/* Scores of one page's rows [first, end) for `group` queries -> probabilities against the
 * running maxima (acc and sums rescaled when a maximum grows). */
static void page_probs(float *restrict scores, int64_t first, int64_t end, int64_t group,
                       int64_t page_size, int64_t dim, float soft_cap, float *restrict maxima,
                       float *restrict sums, float *restrict acc) {
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * page_size, page_max = -INFINITY;
        for (int64_t t = first; t < end; t++) {
            if (soft_cap > 0.f) s[t] = soft_cap * tanhf(s[t] / soft_cap);
            page_max = s[t] > page_max ? s[t] : page_max;
        }
        if (page_max > maxima[g]) {
            float shrink = expf(maxima[g] - page_max);
            sums[g] *= shrink;
            for (int64_t d = 0; d < dim; d++) acc[g * dim + d] *= shrink;
            maxima[g] = page_max;
        }
        for (int64_t t = first; t < end; t++) {
            s[t] = expf(s[t] - maxima[g]);
            sums[g] += s[t];
        }
    }
}

/* One sequence's kv head over context positions [start, len). */
static void one_head(const float *restrict q, const float *restrict k_head, const float *restrict v_head,
                     const int64_t *restrict table, int64_t len, int64_t start, int64_t group,
                     int64_t page_size, int64_t dim, float scale, float soft_cap, float *restrict out) {
    float queries[group * dim], acc[group * dim], maxima[group], sums[group], scores[group * page_size];
    for (int64_t i = 0; i < group * dim; i++) { queries[i] = q[i] * scale; acc[i] = 0.f; }
    for (int64_t g = 0; g < group; g++) { maxima[g] = -INFINITY; sums[g] = 0.f; }
    for (int64_t page = start / page_size; page * page_size < len; page++) {
        const float *k = k_head + table[page] * page_size * dim, *v = v_head + table[page] * page_size * dim;
        int64_t first = page * page_size > start ? 0 : start - page * page_size;
        int64_t end = (page + 1) * page_size <= len ? page_size : len - page * page_size;
        for (int64_t t = first; t < end; t++)
            for (int64_t g = 0; g < group; g++) scores[g * page_size + t] = dot(queries + g * dim, k + t * dim, dim);
        page_probs(scores, first, end, group, page_size, dim, soft_cap, maxima, sums, acc);
        for (int64_t t = first; t < end; t++)
            for (int64_t g = 0; g < group; g++) add_scaled(scores[g * page_size + t], v + t * dim, acc + g * dim, dim);
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = sums[g] > 0.f ? acc[g * dim + d] / sums[g] : 0.f;
}

/* Whether every page the kernel would read exists: 0, or 1 + the first bad row. */
static int64_t first_bad_row(const int64_t *lens, const int64_t *tables, int64_t batch, int64_t num_pages,
                             int64_t page_size, int64_t width) {
    for (int64_t b = 0; b < batch; b++) {
        if (lens[b] < 0 || lens[b] > width * page_size) return b + 1;
        for (int64_t page = 0; page * page_size < lens[b]; page++)
            if (tables[b * width + page] < 0 || tables[b * width + page] >= num_pages) return b + 1;
    }
    return 0;
}

/* q [batch, heads, dim]; k/v pages [kv_heads, num_pages, page_size, dim]; lens [batch];
 * tables [batch, width]; out [batch, heads, dim]. soft_cap <= 0: none; window <= 0: none.
 * Returns 0, or 1 + the first row whose length or pages do not fit (nothing computed). */
int64_t paged_attention_f32(const float *q, const float *k_pages, const float *v_pages, const int64_t *lens,
                            const int64_t *tables, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                            int64_t num_pages, int64_t page_size, int64_t dim, int64_t width, float scale,
                            float soft_cap, int64_t window, int threads) {
    int64_t bad = first_bad_row(lens, tables, batch, num_pages, page_size, width);
    if (bad) return bad;
    int64_t group = heads / kv_heads, head_stride = num_pages * page_size * dim;
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(threads)
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t len = lens[b], start = window > 0 && len > window ? len - window : 0;
            int64_t at = (b * heads + h * group) * dim;
            one_head(q + at, k_pages + h * head_stride, v_pages + h * head_stride, tables + b * width,
                     len, start, group, page_size, dim, scale, soft_cap, out + at);
        }
    return 0;
}
