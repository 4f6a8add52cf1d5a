/* Paged decode attention on a CPU, fp32: the native path's fused kernel.
 *
 * Same contract as reference.paged_attention. Each (sequence, kv head) walks its own pages in
 * place (no gathered copy of K/V) with an online softmax rescaled once per page; the heads of a
 * GQA group share each page while it is in cache. A page's scores are taken eight keys at a
 * time (eight independent sums, so the multiply-adds do not wait on one another) and its values
 * are summed 64 features at a time in registers; the next page is prefetched, since pages lie
 * anywhere in the cache and no hardware prefetcher can guess where. Built and loaded by
 * cpu_native.py.
 */
#include <math.h>
#include <stdint.h>

/* GCC's portable vectors (whatever SIMD -march=native has): 8 floats, loaded unaligned. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
#define LOAD(p) (*(const v8u *)(p))
#define STORE(p, x) (*(v8u *)(p) = (x))
#define KEYS 8 /* keys scored at once: independent sums, so the FMAs do not wait on each other */
#define LANES 64 /* output features accumulated at once, in registers */

static inline float hsum(v8 x) {
    float sum = 0.f;
    for (int i = 0; i < 8; i++) sum += x[i];
    return sum;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t dim) {
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t d = 0; d < dim; d++) sum += a[d] * b[d];
    return sum;
}

/* scores[g][t] = queries[g] . k[t] for the page's rows [first, end). */
static void page_scores(const float *restrict queries, const float *restrict k, int64_t first, int64_t end,
                        int64_t group, int64_t page_size, int64_t dim, float *restrict scores) {
    int64_t vec_dim = dim - dim % 8;
    for (int64_t g = 0; g < group; g++) {
        const float *qg = queries + g * dim;
        float *s = scores + g * page_size;
        int64_t t = first;
        for (; t + KEYS <= end; t += KEYS) {
            const float *kt = k + t * dim;
            v8 sums[KEYS] = {{0}};
            for (int64_t d = 0; d < vec_dim; d += 8) {
                v8 qv = LOAD(qg + d);
                for (int i = 0; i < KEYS; i++) sums[i] += qv * LOAD(kt + i * dim + d);
            }
            for (int i = 0; i < KEYS; i++) {
                s[t + i] = hsum(sums[i]);
                for (int64_t d = vec_dim; d < dim; d++) s[t + i] += qg[d] * kt[i * dim + d];
            }
        }
        for (; t < end; t++) s[t] = dot(qg, k + t * dim, dim);
    }
}

/* acc[g] += sum over the page's rows [first, end) of probs[g][t] * v[t]. */
static void page_values(const float *restrict probs, const float *restrict v, int64_t first, int64_t end,
                        int64_t group, int64_t page_size, int64_t dim, float *restrict acc) {
    for (int64_t g = 0; g < group; g++) {
        const float *p = probs + g * page_size;
        float *a = acc + g * dim;
        int64_t d = 0;
        for (; d + LANES <= dim; d += LANES) {
            v8 lanes[LANES / 8];
            for (int i = 0; i < LANES / 8; i++) lanes[i] = LOAD(a + d + 8 * i);
            for (int64_t t = first; t < end; t++)
                for (int i = 0; i < LANES / 8; i++) lanes[i] += p[t] * LOAD(v + t * dim + d + 8 * i);
            for (int i = 0; i < LANES / 8; i++) STORE(a + d + 8 * i, lanes[i]);
        }
        for (; d + 8 <= dim; d += 8) {
            v8 lane = LOAD(a + d);
            for (int64_t t = first; t < end; t++) lane += p[t] * LOAD(v + t * dim + d);
            STORE(a + d, lane);
        }
        for (; d < dim; d++)
            for (int64_t t = first; t < end; t++) a[d] += p[t] * v[t * dim + d];
    }
}

/* e^x for x <= 0 (a score less its running maximum), in plain arithmetic that vectorizes
 * (libm's expf is one call per score): x = n ln2 + r, e^r by Cephes' polynomial (within
 * 2 ulp of expf), 2^n built in the exponent bits. Below -87 the result is flushed to 0. */
static inline float exp_nonpositive(float x) {
    float n = floorf(x * 1.44269504f + 0.5f), small = x < -87.f ? 0.f : 1.f;
    n = n < -126.f ? -126.f : n;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { int32_t bits; float value; } two_n = {.bits = ((int32_t)n + 127) << 23};
    return p * two_n.value * small;
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
        #pragma omp simd reduction(+:total)
        for (int64_t t = first; t < end; t++) {
            s[t] = exp_nonpositive(s[t] - top);
            total += s[t];
        }
        sums[g] += total;
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
        if ((page + 1) * page_size < len) { /* the next page: scattered in memory, so no prefetcher guesses it */
            const char *next_k = (const char *)(k_head + table[page + 1] * page_size * dim);
            const char *next_v = (const char *)(v_head + table[page + 1] * page_size * dim);
            for (int64_t at = 0; at < page_size * dim * 4; at += 64) {
                __builtin_prefetch(next_k + at);
                __builtin_prefetch(next_v + at);
            }
        }
        page_scores(queries, k, first, end, group, page_size, dim, scores);
        page_probs(scores, first, end, group, page_size, dim, soft_cap, maxima, sums, acc);
        page_values(scores, v, first, end, group, page_size, dim, acc);
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
