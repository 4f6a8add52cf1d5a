/* The step's keys and values into the paged caches on a CPU, fp32: the native path's cache
 * write.
 *
 * Same contract as reference.write_kv_cache. torch builds the flat index (an arange, a product,
 * a sum), copies k and v head-major and scatters each with index_copy_; here every token's
 * heads are copied straight from the QKV projection's output into their slots. Built and
 * loaded by cpu_native.py.
 */
#include <stdint.h>
#include <string.h>

/* k, v [tokens, kv_heads, d] (token strides k_stride, v_stride; heads contiguous), caches
 * [kv_heads, slots_per_head, d]. Returns -1, or the first token whose slot is outside
 * [0, slots_per_head): then nothing was written. */
int64_t write_kv_cache_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                           float *v_cache, const int64_t *slots, int64_t tokens, int64_t kv_heads,
                           int64_t slots_per_head, int64_t d) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= slots_per_head) return t;
    size_t row_bytes = (size_t)d * sizeof(float);
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t row = (h * slots_per_head + slots[t]) * d;
            memcpy(k_cache + row, k + t * k_stride + h * d, row_bytes);
            memcpy(v_cache + row, v + t * v_stride + h * d, row_bytes);
        }
    return -1;
}
