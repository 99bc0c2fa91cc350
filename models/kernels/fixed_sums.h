/* The one accumulation order both CPU kernels use (bf16_matmul.c,
 * affine_matmul.c): two 8-lane float32 accumulators over k in steps of 16
 * (lanes k..k+7 and k+8..k+15), their sum reduced in a fixed order, then the
 * tail (k not a multiple of 16) in order, then the bias. Built with
 * -ffp-contract=off, so no pass fuses it differently: an output's value does
 * not depend on how many input rows or threads a call has.
 */
#ifndef SPECPIPE_FIXED_SUMS_H
#define SPECPIPE_FIXED_SUMS_H

#include <immintrin.h>

static inline float reduce(__m256 a, __m256 b) {
    __m256 s = _mm256_add_ps(a, b);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    __m128 hi = _mm_movehl_ps(lo, lo);
    lo = _mm_add_ps(lo, hi);
    hi = _mm_shuffle_ps(lo, lo, 0x1);
    return _mm_cvtss_f32(_mm_add_ss(lo, hi));
}

/* NAME(w, x, K, bias, y, ldy): `ROWS` input rows (x, row stride K) over one
 * weight row w of type WTYPE; LOAD8(p) gives 8 weights as floats, SCALAR(v)
 * one; HINT(k) runs before each step of 16 (a prefetch, or nothing). */
#define FIXED_PASS(NAME, ROWS, WTYPE, LOAD8, SCALAR, HINT)                          \
    static inline void NAME(const WTYPE *w, const float *x, long K, float bias,     \
                            float *y, long ldy) {                                   \
        const long body = K - K % 16;                                               \
        __m256 lo[ROWS], hi[ROWS];                                                  \
        for (int i = 0; i < ROWS; i++) {                                            \
            lo[i] = _mm256_setzero_ps();                                            \
            hi[i] = _mm256_setzero_ps();                                            \
        }                                                                           \
        for (long k = 0; k < body; k += 16) {                                       \
            HINT(k);                                                                \
            const __m256 w0 = LOAD8(w + k), w1 = LOAD8(w + k + 8);                  \
            for (int i = 0; i < ROWS; i++) {                                        \
                lo[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * K + k), lo[i]); \
                hi[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * K + k + 8), hi[i]); \
            }                                                                       \
        }                                                                           \
        for (int i = 0; i < ROWS; i++) {                                            \
            float s = reduce(lo[i], hi[i]);                                         \
            for (long k = body; k < K; k++) s += SCALAR(w[k]) * x[i * K + k];       \
            y[i * ldy] = s + bias;                                                  \
        }                                                                           \
    }

/* Every input row of x (m rows) over weight row w, four at a time:
 * outputs y[row * ldy]. PASS is a FIXED_PASS name prefix. */
#define ALL_ROWS(PASS, w, x, K, m, bias, y, ldy)                                    \
    do {                                                                            \
        long m0_ = 0;                                                               \
        for (; m0_ + 4 <= (m); m0_ += 4)                                            \
            PASS##4(w, (x) + m0_ * (K), K, bias, (y) + m0_ * (ldy), ldy);           \
        switch ((m) - m0_) {                                                        \
        case 3: PASS##3(w, (x) + m0_ * (K), K, bias, (y) + m0_ * (ldy), ldy); break; \
        case 2: PASS##2(w, (x) + m0_ * (K), K, bias, (y) + m0_ * (ldy), ldy); break; \
        case 1: PASS##1(w, (x) + m0_ * (K), K, bias, (y) + m0_ * (ldy), ldy); break; \
        default: break;                                                             \
        }                                                                           \
    } while (0)

#endif
