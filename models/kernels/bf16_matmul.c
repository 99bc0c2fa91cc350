/* y[m, n] = sum_k w[n, k] * x[m, k] (+ bias[n]): bfloat16 weights, float32
 * inputs and outputs, for x86-64 with AVX2 and FMA (models/cpu_kernel.py).
 *
 * A decode step multiplies a few input rows by every weight once, so the
 * product is bound by reading the weights: bf16 halves the bytes of float32.
 * Each weight row is read from memory once per call: every input row (four
 * at a time) runs over it while it sits in the L1 cache.
 *
 * Every output value is accumulated the same way whatever the number of
 * input rows or threads: two 8-lane float32 accumulators over k in steps of
 * 16 (lanes k..k+7 and k+8..k+15), their sum reduced in a fixed order, then
 * the tail (k not a multiple of 16) in order (built with -ffp-contract=off,
 * so no pass fuses it differently), then the bias. So a verify
 * window of W tokens computes each token's products bit for bit as a single
 * token's step does.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_THREADS 64
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

static inline float reduce(__m256 a, __m256 b) {
    __m256 s = _mm256_add_ps(a, b);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    __m128 hi = _mm_movehl_ps(lo, lo);
    lo = _mm_add_ps(lo, hi);
    hi = _mm_shuffle_ps(lo, lo, 0x1);
    return _mm_cvtss_f32(_mm_add_ss(lo, hi));
}

/* One pass of `ROWS` input rows over weight row w: outputs y[i * ldy]. */
#define PASS(ROWS)                                                                  \
    static inline void pass_##ROWS(const uint16_t *w, const float *x, long K,       \
                                   float bias, float *y, long ldy) {                \
        const long body = K - K % 16;                                               \
        __m256 lo[ROWS], hi[ROWS];                                                  \
        for (int i = 0; i < ROWS; i++) {                                            \
            lo[i] = _mm256_setzero_ps();                                            \
            hi[i] = _mm256_setzero_ps();                                            \
        }                                                                           \
        for (long k = 0; k < body; k += 16) {                                       \
            _mm_prefetch((const char *)(w + k + PREFETCH), _MM_HINT_T0);             \
            const __m256 w0 = load_bf16(w + k), w1 = load_bf16(w + k + 8);          \
            for (int i = 0; i < ROWS; i++) {                                        \
                lo[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * K + k), lo[i]); \
                hi[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * K + k + 8), hi[i]); \
            }                                                                       \
        }                                                                           \
        for (int i = 0; i < ROWS; i++) {                                            \
            float s = reduce(lo[i], hi[i]);                                         \
            for (long k = body; k < K; k++) s += bf16_value(w[k]) * x[i * K + k];   \
            y[i * ldy] = s + bias;                                                  \
        }                                                                           \
    }
PASS(1)
PASS(2)
PASS(3)
PASS(4)

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    const long K = j->k;
    for (long n = j->n0; n < j->n1; n++) {
        const uint16_t *w = j->w + n * K;
        const float bias = j->bias ? j->bias[n] : 0.0f;
        long m0 = 0;
        for (; m0 + 4 <= j->m; m0 += 4) pass_4(w, j->x + m0 * K, K, bias, j->y + m0 * j->n + n, j->n);
        switch (j->m - m0) {
        case 3: pass_3(w, j->x + m0 * K, K, bias, j->y + m0 * j->n + n, j->n); break;
        case 2: pass_2(w, j->x + m0 * K, K, bias, j->y + m0 * j->n + n, j->n); break;
        case 1: pass_1(w, j->x + m0 * K, K, bias, j->y + m0 * j->n + n, j->n); break;
        default: break;
        }
    }
    return NULL;
}

/* A worker that cannot start has its share run on the calling thread. */
void specpipe_bf16_matmul(const uint16_t *w, const float *x, const float *bias, float *y,
                          long n, long k, long m, int threads) {
    pthread_t tid[MAX_THREADS];
    job_t jobs[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = (int)n;
    if (threads < 1) threads = 1; /* also for n == 0: no rows, no division by zero */
    const long per = (n + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
        const long n0 = t * per < n ? t * per : n;
        const long n1 = n0 + per > n ? n : n0 + per;
        jobs[t] = (job_t){w, x, bias, y, n0, n1, n, k, m};
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tid[t], NULL, run, &jobs[t]) == 0;
    run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run(&jobs[t]);
    }
}
