/* The batched LoRA matmul on a CPU, fp32: the native path's adapters.
 *
 * Same contract as reference.lora_matmul. The tokens are put in the order of their slots (a
 * counting sort) and taken TOKENS at a time within a slot, so each vector of A or B loaded
 * serves TOKENS tokens from registers: first the block's rank products (x A, up to 64 rank
 * columns a pass), then its outputs (shrunk B, sixteen features at a time). Blocks are split
 * among the threads; a thread's blocks are mostly one adapter's, read from cache after the
 * first. Built and loaded by cpu_native.py.
 */
#include <stdint.h>

#include "cpu_vectors.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define TOKENS 4  /* a block's tokens: 4 x 4 accumulators + 4 vectors of A in the shrink */
#define VECTORS 4 /* rank columns a shrink pass keeps in registers: 4 x 16 */

/* shrunk[j][c0 .. c0 + 16 vectors) = x_j . A[:, those columns] for the TOKENS tokens x_j of a
 * block (a short block repeats its last token). */
ALWAYS_INLINE void shrink_pass(const float *const x[TOKENS], const float *restrict a, int64_t in_features,
                               int64_t rank, int64_t c0, int vectors, float *restrict shrunk) {
    v16 acc[TOKENS][VECTORS];
    for (int j = 0; j < TOKENS; j++)
        for (int v = 0; v < VECTORS; v++) acc[j][v] = (v16){0};
    for (int64_t k = 0; k < in_features; k++) {
        v16 column[VECTORS];
        for (int v = 0; v < vectors; v++) column[v] = LOAD(a + k * rank + c0 + 16 * v);
        for (int j = 0; j < TOKENS; j++) {
            float xk = x[j][k];
            for (int v = 0; v < vectors; v++) acc[j][v] += xk * column[v];
        }
    }
    for (int j = 0; j < TOKENS; j++)
        for (int v = 0; v < vectors; v++) STORE(shrunk + j * rank + c0 + 16 * v, acc[j][v]);
}

/* Every rank column of a block: passes of up to VECTORS vectors (constant counts, so the
 * accumulators stay in registers), then the columns past the last whole vector one by one. */
static void shrink(const float *const x[TOKENS], const float *restrict a, int64_t in_features, int64_t rank,
                   float *restrict shrunk) {
    int64_t c0 = 0;
    for (; c0 + 16 <= rank; c0 += 16 * VECTORS) {
        int64_t left = (rank - c0) / 16;
        switch (left >= VECTORS ? VECTORS : left) {
        case 1: shrink_pass(x, a, in_features, rank, c0, 1, shrunk); break;
        case 2: shrink_pass(x, a, in_features, rank, c0, 2, shrunk); break;
        case 3: shrink_pass(x, a, in_features, rank, c0, 3, shrunk); break;
        default: shrink_pass(x, a, in_features, rank, c0, VECTORS, shrunk); break;
        }
    }
    for (int64_t c = rank / 16 * 16; c < rank; c++)
        for (int j = 0; j < TOKENS; j++) {
            float sum = 0.f;
            for (int64_t k = 0; k < in_features; k++) sum += x[j][k] * a[k * rank + c];
            shrunk[j * rank + c] = sum;
        }
}

/* out_j[o0 .. o1) = shrunk_j[c0 .. c1) . B[c0 .. c1, o0 .. o1) for the block's `count` real
 * tokens, B [rank, out]: one projection's block. */
static void expand(const float *restrict shrunk, const float *restrict b, int64_t rank, int64_t out_features,
                   int64_t c0, int64_t c1, int64_t o0, int64_t o1, float *const out[TOKENS], int count) {
    int64_t o = o0;
    for (; o + 16 <= o1; o += 16) {
        v16 acc[TOKENS];
        for (int j = 0; j < TOKENS; j++) acc[j] = (v16){0};
        for (int64_t c = c0; c < c1; c++) {
            v16 row = LOAD(b + c * out_features + o);
            for (int j = 0; j < TOKENS; j++) acc[j] += shrunk[j * rank + c] * row;
        }
        for (int j = 0; j < count; j++) STORE(out[j] + o, acc[j]);
    }
    for (; o < o1; o++)
        for (int j = 0; j < count; j++) {
            float sum = 0.f;
            for (int64_t c = c0; c < c1; c++) sum += shrunk[j * rank + c] * b[c * out_features + o];
            out[j][o] = sum;
        }
}

/* Sorts the tokens by slot into `order`; start[s] .. start[s + 1] are slot s's. Returns -1
 * where a slot index is out of range, else 0. */
static int sort_by_slot(const int64_t *slots, int64_t tokens, int64_t num_slots, int64_t *order, int64_t *start) {
    for (int64_t s = 0; s <= num_slots; s++) start[s] = 0;
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
        start[slots[t] + 1]++;
    }
    for (int64_t s = 0; s < num_slots; s++) start[s + 1] += start[s];
    for (int64_t t = 0; t < tokens; t++) order[start[slots[t]]++] = t; /* start[s] moves to slot s + 1's */
    for (int64_t s = num_slots; s > 0; s--) start[s] = start[s - 1];
    start[0] = 0;
    return 0;
}

/* The first token (in `order`) of each block: TOKENS consecutive tokens of one slot past slot
 * 0's (a slot's last block may be short). Returns the number of blocks. */
static int64_t split_blocks(const int64_t *start, int64_t num_slots, int64_t *blocks) {
    int64_t count = 0;
    for (int64_t s = 1; s < num_slots; s++)
        for (int64_t first = start[s]; first < start[s + 1]; first += TOKENS) blocks[count++] = first;
    return count;
}

/* x [tokens, in] (row stride x_stride), a [slots, in, rank], b [slots, rank, out], slots
 * [tokens], out [tokens, out]: slot 0's rows zeroed, the others' features of every projection
 * written. `out_slices` [projections, 2]: each projection's (first feature, features); its
 * rank columns are the projection's share of `rank`, in order. `scratch` holds
 * 2 x tokens + 2 x num_slots + 1 integers. A block's rank products live on its thread's stack
 * (TOKENS x rank floats: rank is a few hundred at most). Returns -1, writing nothing, where a
 * slot index is out of range, else 0. */
int lora_matmul_f32(const float *x, int64_t x_stride, const float *a, const float *b, const int64_t *slots,
                    float *out, int64_t tokens, int64_t num_slots, int64_t in_features, int64_t rank,
                    int64_t out_features, const int64_t *out_slices, int64_t projections, int64_t *scratch,
                    int threads) {
    int64_t *order = scratch, *start = scratch + tokens, *blocks = start + num_slots + 1;
    if (sort_by_slot(slots, tokens, num_slots, order, start)) return -1;
    for (int64_t i = 0; i < start[1]; i++) /* slot 0: the base model */
        for (int64_t o = 0; o < out_features; o++) out[order[i] * out_features + o] = 0.f;
    int64_t num_blocks = split_blocks(start, num_slots, blocks);
    #pragma omp parallel for schedule(static) num_threads(threads) \
        if ((tokens - start[1]) * (in_features + out_features) * rank >= (1 << 18))
    for (int64_t block = 0; block < num_blocks; block++) {
        int64_t first = blocks[block], slot = slots[order[first]];
        int count = start[slot + 1] - first < TOKENS ? (int)(start[slot + 1] - first) : TOKENS;
        const float *x_rows[TOKENS];
        float *out_rows[TOKENS];
        for (int j = 0; j < TOKENS; j++) { /* a short block repeats its last token */
            int64_t t = order[first + (j < count ? j : count - 1)];
            x_rows[j] = x + t * x_stride;
            out_rows[j] = out + t * out_features;
        }
        float shrunk[TOKENS * rank];
        shrink(x_rows, a + slot * in_features * rank, in_features, rank, shrunk);
        int64_t width = rank / projections;
        for (int64_t p = 0; p < projections; p++)
            expand(shrunk, b + slot * rank * out_features, rank, out_features, p * width, (p + 1) * width,
                   out_slices[2 * p], out_slices[2 * p] + out_slices[2 * p + 1], out_rows, count);
    }
    return 0;
}
