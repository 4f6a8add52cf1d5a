/* Paged attention on a CPU, fp32: the native path's decode kernel, also its prefill kernel.
 *
 * Same contract as reference.paged_attention, with one addition: each query row may name the
 * block-table row it reads (a prompt's tokens share their prompt's table, each with its own
 * length: causal prefill attention). Each (query row, kv head) walks its pages in place (no
 * gathered copy of K/V) with an online softmax rescaled once per page; the heads of a GQA group
 * share each page while it is in cache. A page's keys are scored sixteen at a time (sixteen
 * independent sums, folded into one vector of scores), its value rows summed for up to four
 * heads at once in registers, and each page is prefetched two pages ahead, since pages lie
 * anywhere in the cache and no hardware prefetcher can guess where. Built and loaded by
 * cpu_native.py.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_vectors.h"

#define KEYS 16 /* keys scored at once: one sum each, folded together into one vector of scores */
#define QUERIES 4 /* queries of a GQA group summing one value row at once */
static const lanes16 LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Whether this build has AVX-512's 32 vector registers. With AVX2's sixteen a chunk's sixteen
 * partial sums spill: decode still beats eager SDPA there, but prefill (many queries over the
 * same keys, where SDPA's matmuls share the work) ran at a fifth of its speed, so
 * prefill_attention/cpu_native.py takes the kernel only with them. */
int paged_attention_f32_wide_vectors(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t dim) {
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t d = 0; d < dim; d++) sum += a[d] * b[d];
    return sum;
}

/* Adds the lanes picked by `low` to those picked by `high` from the pair (a, b). */
ALWAYS_INLINE v16 fold(v16 a, v16 b, lanes16 low, lanes16 high) {
    return __builtin_shuffle(a, b, low) + __builtin_shuffle(a, b, high);
}

/* Sixteen vectors of partial sums -> one vector of their sixteen totals, lane i the total of
 * sums[i]: four rounds, each halving the vectors and doubling the keys per vector (45
 * shuffles and adds, where one horizontal sum per key would take 16 dependent adds each). */
ALWAYS_INLINE v16 fold16(v16 sums[KEYS]) {
    const lanes16 low1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const lanes16 high1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const lanes16 low2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const lanes16 high2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const lanes16 low3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const lanes16 high3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const lanes16 low4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const lanes16 high4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    v16 keys2[8], keys4[4], keys8[2];
    for (int i = 0; i < 8; i++) keys2[i] = fold(sums[i], sums[i + 8], low1, high1);  /* keys i, i+8 */
    for (int i = 0; i < 4; i++) keys4[i] = fold(keys2[i], keys2[i + 4], low2, high2); /* i, +4, +8, +12 */
    for (int i = 0; i < 2; i++) keys8[i] = fold(keys4[i], keys4[i + 2], low3, high3); /* i + 2n */
    return fold(keys8[0], keys8[1], low4, high4);
}

/* scores[g][t] = queries[g] . k[t] for the page's rows [first, end); a chunk of 16 keys that
 * lies inside the page is scored whole (its rows past `end` are scored and never read). */
static void page_scores(const float *restrict queries, const float *restrict k, int64_t first, int64_t end,
                        int64_t group, int64_t page_size, int64_t dim, float *restrict scores) {
    int64_t vec_dim = dim - dim % 16;
    for (int64_t g = 0; g < group; g++) {
        const float *qg = queries + g * dim;
        float *s = scores + g * page_size;
        int64_t t = first;
        for (; t < end && t + KEYS <= page_size; t += KEYS) {
            const float *kt = k + t * dim;
            v16 sums[KEYS];
            for (int i = 0; i < KEYS; i++) sums[i] = (v16){0};
            for (int64_t d = 0; d < vec_dim; d += 16) {
                v16 qv = LOAD(qg + d);
                for (int i = 0; i < KEYS; i++) sums[i] += qv * LOAD(kt + i * dim + d);
            }
            v16 totals = fold16(sums);
            for (int64_t d = vec_dim; d < dim; d++)
                for (int i = 0; i < KEYS; i++) totals[i] += qg[d] * kt[i * dim + d];
            STORE(s + t, totals);
        }
        for (; t < end; t++) s[t] = dot(qg, k + t * dim, dim);
    }
}

/* acc[g] += sum over rows [first, end) of probs[g][t] * v[t], for `queries` (a constant once
 * inlined) queries and the 16 * width features from `at`, all accumulated in registers. */
ALWAYS_INLINE void values_tile(const float *restrict probs, const float *restrict v, int64_t first, int64_t end,
                               int queries, int width, int64_t page_size, int64_t dim, int64_t at,
                               float *restrict acc) {
    v16 lanes[QUERIES][4];
    for (int g = 0; g < queries; g++)
        for (int i = 0; i < width; i++) lanes[g][i] = LOAD(acc + g * dim + at + 16 * i);
    for (int64_t t = first; t < end; t++) {
        v16 row[4];
        for (int i = 0; i < width; i++) row[i] = LOAD(v + t * dim + at + 16 * i);
        for (int g = 0; g < queries; g++) {
            float p = probs[g * page_size + t];
            for (int i = 0; i < width; i++) lanes[g][i] += p * row[i];
        }
    }
    for (int g = 0; g < queries; g++)
        for (int i = 0; i < width; i++) STORE(acc + g * dim + at + 16 * i, lanes[g][i]);
}

/* values_tile over every feature: 64 at a time, then 16, then one by one. */
ALWAYS_INLINE void values_rows(const float *restrict probs, const float *restrict v, int64_t first, int64_t end,
                               int queries, int64_t page_size, int64_t dim, float *restrict acc) {
    int64_t d = 0;
    for (; d + 64 <= dim; d += 64) values_tile(probs, v, first, end, queries, 4, page_size, dim, d, acc);
    for (; d + 16 <= dim; d += 16) values_tile(probs, v, first, end, queries, 1, page_size, dim, d, acc);
    for (; d < dim; d++)
        for (int g = 0; g < queries; g++)
            for (int64_t t = first; t < end; t++) acc[g * dim + d] += probs[g * page_size + t] * v[t * dim + d];
}

/* acc[g] += sum over the page's rows [first, end) of probs[g][t] * v[t]; each value row is
 * read once for up to four queries of the group. */
static void page_values(const float *restrict probs, const float *restrict v, int64_t first, int64_t end,
                        int64_t group, int64_t page_size, int64_t dim, float *restrict acc) {
    for (int64_t g = 0; g < group; g += QUERIES) {
        const float *p = probs + g * page_size;
        float *a = acc + g * dim;
        switch (group - g) {
            case 1: values_rows(p, v, first, end, 1, page_size, dim, a); break;
            case 2: values_rows(p, v, first, end, 2, page_size, dim, a); break;
            case 3: values_rows(p, v, first, end, 3, page_size, dim, a); break;
            default: values_rows(p, v, first, end, 4, page_size, dim, a); break;
        }
    }
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
        float top = maxima[g], total = 0.f;
        int64_t t = first;
        v16 totals = {0};
        for (; t < end && t + KEYS <= page_size; t += KEYS) { /* whole chunks; lanes past `end` zeroed */
            v16 probs = exp16_nonpositive(LOAD(s + t) - top);
            probs = (v16)((lanes16)probs & less16i(LANE, (lanes16){0} + (int32_t)(end - t)));
            STORE(s + t, probs);
            totals += probs;
        }
        for (int i = 0; i < KEYS; i++) total += totals[i];
        for (; t < end; t++) {
            s[t] = exp_nonpositive(s[t] - top);
            total += s[t];
        }
        sums[g] += total;
    }
}

/* Pages lie anywhere in the cache, so no hardware prefetcher guesses the next one: each
 * page's keys and values are asked for AHEAD pages before they are read. */
#define AHEAD 2
static inline void prefetch_page(const float *k_head, const float *v_head, int64_t page, int64_t floats) {
    const char *k = (const char *)(k_head + page * floats), *v = (const char *)(v_head + page * floats);
    for (int64_t at = 0; at < floats * 4; at += 64) {
        __builtin_prefetch(k + at);
        __builtin_prefetch(v + at);
    }
}

/* One sequence's kv head over context positions [start, len). */
static void one_head(const float *restrict q, const float *restrict k_head, const float *restrict v_head,
                     const int64_t *restrict table, int64_t len, int64_t start, int64_t group,
                     int64_t page_size, int64_t dim, float scale, float soft_cap, float *restrict out) {
    float queries[group * dim], acc[group * dim], maxima[group], sums[group], scores[group * page_size];
    for (int64_t i = 0; i < group * dim; i++) { queries[i] = q[i] * scale; acc[i] = 0.f; }
    for (int64_t g = 0; g < group; g++) { maxima[g] = -INFINITY; sums[g] = 0.f; }
    for (int64_t page = start / page_size; page < start / page_size + AHEAD && page * page_size < len; page++)
        prefetch_page(k_head, v_head, table[page], page_size * dim);
    for (int64_t page = start / page_size; page * page_size < len; page++) {
        const float *k = k_head + table[page] * page_size * dim, *v = v_head + table[page] * page_size * dim;
        int64_t first = page * page_size > start ? 0 : start - page * page_size;
        int64_t end = (page + 1) * page_size <= len ? page_size : len - page * page_size;
        if ((page + AHEAD) * page_size < len) prefetch_page(k_head, v_head, table[page + AHEAD], page_size * dim);
        page_scores(queries, k, first, end, group, page_size, dim, scores);
        page_probs(scores, first, end, group, page_size, dim, soft_cap, maxima, sums, acc);
        page_values(scores, v, first, end, group, page_size, dim, acc);
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = sums[g] > 0.f ? acc[g * dim + d] / sums[g] : 0.f;
}

/* Whether every page the kernel would read exists: 0, or 1 + the first bad query row. */
static int64_t first_bad_row(const int64_t *lens, const int64_t *tables, const int64_t *rows, int64_t batch,
                             int64_t table_rows, int64_t num_pages, int64_t page_size, int64_t width) {
    for (int64_t b = 0; b < batch; b++) {
        int64_t row = rows ? rows[b] : b;
        if (row < 0 || row >= table_rows || lens[b] < 0 || lens[b] > width * page_size) return b + 1;
        for (int64_t page = 0; page * page_size < lens[b]; page++)
            if (tables[row * width + page] < 0 || tables[row * width + page] >= num_pages) return b + 1;
    }
    return 0;
}

/* q [batch, heads, dim] (row stride q_stride: q's heads may sit inside a wider QKV row, each
 * row's heads contiguous); k/v pages [kv_heads, num_pages, page_size, dim]; lens [batch];
 * tables [table_rows, width]; rows [batch], the table row of each query row (NULL: row b reads
 * table row b); out [batch, heads, dim]. soft_cap <= 0: none; window <= 0: none. Returns 0, or
 * 1 + the first query row whose table row, length or pages do not fit (nothing computed). */
int64_t paged_attention_f32(const float *q, int64_t q_stride, const float *k_pages, const float *v_pages, const int64_t *lens,
                            const int64_t *tables, const int64_t *rows, float *out, int64_t batch, int64_t heads,
                            int64_t kv_heads, int64_t num_pages, int64_t page_size, int64_t dim, int64_t width,
                            int64_t table_rows, float scale, float soft_cap, int64_t window, int threads) {
    int64_t bad = first_bad_row(lens, tables, rows, batch, table_rows, num_pages, page_size, width);
    if (bad) return bad;
    int64_t group = heads / kv_heads, head_stride = num_pages * page_size * dim;
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(threads)
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t len = lens[b], start = window > 0 && len > window ? len - window : 0;
            int64_t at = (b * heads + h * group) * dim, row = rows ? rows[b] : b;
            one_head(q + b * q_stride + h * group * dim, k_pages + h * head_stride, v_pages + h * head_stride, tables + row * width,
                     len, start, group, page_size, dim, scale, soft_cap, out + at);
        }
    return 0;
}
