/* Shared by the native path's C kernels (``cpu_library.py`` builds them): GCC's portable
 * vectors of sixteen floats (AVX-512 where -march=native has it, two AVX2 halves elsewhere)
 * and a vectorised e^x for x <= 0. */
#ifndef TPU_EXECUTOR_CPU_VECTORS_H
#define TPU_EXECUTOR_CPU_VECTORS_H
#include <stdint.h>

/* Loaded and stored unaligned. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t lanes16 __attribute__((vector_size(64)));
#define LOAD(p) (*(const v16u *)(p))
#define STORE(p, x) (*(v16u *)(p) = (x))

/* a < b lane by lane (all ones where true). Without AVX-512 GCC compares a 64-byte vector one
 * lane at a time (a scalar compare and insert per lane, measured 3-7x slower kernels on an
 * AVX2 EPYC), so there it compares the two 32-byte halves, which AVX2 does in one instruction
 * each. */
#ifdef __AVX512F__
static inline lanes16 less16(v16 a, v16 b) { return a < b; }
static inline lanes16 less16i(lanes16 a, lanes16 b) { return a < b; }
#else
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t lanes8 __attribute__((vector_size(32)));
#define LOW8(x) __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
#define HIGH8(x) __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15)
#define JOIN16(lo, hi) __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
static inline lanes16 less16(v16 a, v16 b) {
    lanes8 lo = LOW8(a) < LOW8(b), hi = HIGH8(a) < HIGH8(b);
    return JOIN16(lo, hi);
}
static inline lanes16 less16i(lanes16 a, lanes16 b) {
    lanes8 lo = LOW8(a) < LOW8(b), hi = HIGH8(a) < HIGH8(b);
    return JOIN16(lo, hi);
}
#endif
/* e^x for x <= 0 (a score less its running maximum, minus a magnitude), sixteen at a time in
 * plain arithmetic (libm's expf is one call per value): x = n ln2 + r, e^r by Cephes' polynomial (within 2 ulp
 * of expf), 2^n built in the exponent bits. Below -87 the result is flushed to 0. */
static inline v16 exp16_nonpositive(v16 x) {
    lanes16 n = __builtin_convertvector(x * 1.44269504f - 0.5f, lanes16); /* round(x log2 e), x <= 0 */
    lanes16 below = less16i(n, (lanes16){0} - 126);
    n = (n & ~below) | (-126 & below);
    v16 whole = __builtin_convertvector(n, v16);
    v16 r = x - whole * 0.693359375f + whole * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    v16 result = p * (v16)((n + 127) << 23);
    return (v16)((lanes16)result & ~less16(x, (v16){0} - 87.f));
}

static inline float exp_nonpositive(float x) { return exp16_nonpositive((v16){x})[0]; }

#endif
