/* y[m, n] = sum_k w[n, k] * x[m, k] (+ bias[n]): bfloat16 (or float16)
 * weights, float32 inputs and outputs, for x86-64 with AVX2, FMA and F16C
 * (models/cpu_kernel.py).
 *
 * A decode step multiplies a few input rows by every weight once, so the
 * product is bound by reading the weights: bf16 halves the bytes of float32.
 * Each weight row is read from memory once per call: every input row (four
 * at a time) runs over it while it sits in the L1 cache.
 *
 * Every output value is accumulated the same way whatever the number of
 * input rows or threads (fixed_sums.h). So a verify window of W tokens
 * computes each token's products bit for bit as a single token's step does.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "fixed_sums.h"
#include "row_threads.h"

/* Weights (bf16 elements) to prefetch ahead of the stream: 2 KB ahead cut
 * 5-15 % off products of 1-7 rows on the 2-core AVX2 machine. A prefetch is
 * a hint: past the end of the weights it does not fault. */
#define PREFETCH 1024

typedef struct {
    const uint16_t *w;
    const float *x;
    const float *bias;
    float *y;
    long n0, n1, n, k, m;
    int f16; /* the weights are float16 (else bfloat16) */
} job_t;

static inline __m256 load_bf16(const uint16_t *p) {
    __m128i half = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

static inline float bf16_value(uint16_t bits) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)bits << 16;
    return v.f;
}

/* float16 weights: F16C's conversion, exact (every float16 is a float32) */
static inline __m256 load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline float f16_value(uint16_t bits) { return _cvtsh_ss(bits); }

#define PREFETCH_AHEAD(k) _mm_prefetch((const char *)(w + (k) + PREFETCH), _MM_HINT_T0)
FIXED_PASS(pass_1, 1, uint16_t, load_bf16, bf16_value, PREFETCH_AHEAD)
FIXED_PASS(pass_2, 2, uint16_t, load_bf16, bf16_value, PREFETCH_AHEAD)
FIXED_PASS(pass_3, 3, uint16_t, load_bf16, bf16_value, PREFETCH_AHEAD)
FIXED_PASS(pass_4, 4, uint16_t, load_bf16, bf16_value, PREFETCH_AHEAD)
FIXED_PASS(half_pass_1, 1, uint16_t, load_f16, f16_value, PREFETCH_AHEAD)
FIXED_PASS(half_pass_2, 2, uint16_t, load_f16, f16_value, PREFETCH_AHEAD)
FIXED_PASS(half_pass_3, 3, uint16_t, load_f16, f16_value, PREFETCH_AHEAD)
FIXED_PASS(half_pass_4, 4, uint16_t, load_f16, f16_value, PREFETCH_AHEAD)

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    const long K = j->k;
    for (long n = j->n0; n < j->n1; n++) {
        const uint16_t *w = j->w + n * K;
        const float bias = j->bias ? j->bias[n] : 0.0f;
        if (j->f16)
            ALL_ROWS(half_pass_, w, j->x, K, j->m, bias, j->y + n, j->n);
        else
            ALL_ROWS(pass_, w, j->x, K, j->m, bias, j->y + n, j->n);
    }
    return NULL;
}

static void matmul(const uint16_t *w, const float *x, const float *bias, float *y, long n,
                   long k, long m, int threads, int f16) {
    job_t jobs[MAX_THREADS];
    threads = thread_count(threads, n);
    for (int t = 0; t < threads; t++) {
        long n0, n1;
        row_share(n, threads, t, &n0, &n1);
        jobs[t] = (job_t){w, x, bias, y, n0, n1, n, k, m, f16};
    }
    spread(run, jobs, sizeof(job_t), threads);
}

void specpipe_bf16_matmul(const uint16_t *w, const float *x, const float *bias, float *y,
                          long n, long k, long m, int threads) {
    matmul(w, x, bias, y, n, k, m, threads, 0);
}

void specpipe_f16_matmul(const uint16_t *w, const float *x, const float *bias, float *y,
                         long n, long k, long m, int threads) {
    matmul(w, x, bias, y, n, k, m, threads, 1);
}
