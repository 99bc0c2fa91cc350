/* y[m, n] = sum_k w[n, k] * x[m, k] for an MLX affine-quantized weight
 * (w = scale * q + bias per group of `group` values (16, 32, 64 or 128:
 * a GGUF's Q6_K blocks are groups of 16); q packed `bits` wide,
 * value k at bit k * bits of the row's little-endian bit stream), float32
 * inputs and outputs, for x86-64 with AVX2 and FMA (models/cpu_kernel.py; built with F16C too).
 *
 * MLX's CPU quantized product reads every input row over the packed weight
 * separately: a 5-row verify window costs five single-token products
 * (bench/RESULTS.md). Here each weight row is unpacked once per call, into
 * float32 values in a row buffer that stays in cache, and every input row
 * (four at a time) then runs over that buffer: a window costs about what
 * one token does, as it does for float weights.
 *
 * Each weight value is scale * q rounded, plus bias rounded (no fused
 * multiply-add: -ffp-contract=off), the value MLX's dequantize gives. Every
 * output is accumulated the same way whatever the number of input rows or
 * threads (fixed_sums.h, the bf16 kernel's order). So a verify window
 * computes each token's products bit for bit as a single token's step does.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "fixed_sums.h"
#include "row_threads.h"


typedef struct {
    const uint8_t *w; /* packed rows, row_bytes each: [experts, n] */
    const float *scales, *biases; /* [segments, n, k / group]: each segment's expert's */
    const float *x; /* [m, k], grouped by expert */
    float *y; /* [m, n] */
    const int32_t *ids; /* segment s: rows starts[s] .. starts[s + 1] of x, expert ids[s] */
    const long *starts;
    int segments;
    long n0, n1, n, k, rows_total, row_bytes;
    int bits, group;
} job_t;

/* Eight values 0..255 (as 32-bit lanes) to weights scale * q + bias. */
static inline __m256 weights8(__m256i q, __m256 scale, __m256 bias) {
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), scale), bias);
}

/* Where each of eight `bits`-wide values of a chunk (`bits` bytes) lies: the
 * 16 bits from its first byte on (byte lanes 4j, 4j + 1 of 32-bit lane j;
 * both 128-bit halves index the same 16 loaded bytes), and the shift that
 * brings it down. For the widths that are not whole nibbles or bytes. */
typedef struct {
    __m256i spread, shift, mask;
} stream_t;

static stream_t stream_tables(int bits) {
    int8_t spread[32];
    int32_t shift[8];
    for (int j = 0; j < 8; j++) {
        const int first = bits * j / 8;
        spread[4 * j] = (int8_t)first;
        spread[4 * j + 1] = (int8_t)(first + 1);
        spread[4 * j + 2] = spread[4 * j + 3] = -1; /* zero */
        shift[j] = bits * j % 8;
    }
    stream_t t;
    t.spread = _mm256_loadu_si256((const __m256i *)spread);
    t.shift = _mm256_loadu_si256((const __m256i *)shift);
    t.mask = _mm256_set1_epi32((1 << bits) - 1);
    return t;
}

/* Unpack 32 values starting at value `at` of a packed row into out[0..31]:
 * values 0..15 with scale[0], bias[0], values 16..31 with scale[1], bias[1]
 * (groups of 16, Q6_K's; a larger group passes its one pair twice). */
static inline void unpack32(const uint8_t *row, long at, int bits, const stream_t *t,
                            const float scale[2], const float bias[2], int overread,
                            float *out) {
    const __m256 sv[2] = {_mm256_set1_ps(scale[0]), _mm256_set1_ps(scale[1])};
    const __m256 bv[2] = {_mm256_set1_ps(bias[0]), _mm256_set1_ps(bias[1])};
#define S8(i) sv[(i) / 2], bv[(i) / 2] /* the pair of out[8i .. 8i + 7] */
    if (bits == 8) {
        const uint8_t *p = row + at;
        for (int i = 0; i < 4; i++) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(p + 8 * i));
            _mm256_storeu_ps(out + 8 * i, weights8(_mm256_cvtepu8_epi32(bytes), S8(i)));
        }
    } else if (bits == 4) {
        /* 16 bytes, value 2i in byte i's low nibble, 2i + 1 in its high one */
        __m128i packed = _mm_loadu_si128((const __m128i *)(row + at / 2));
        const __m128i nibble = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(packed, nibble);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
        __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);
        _mm256_storeu_ps(out, weights8(_mm256_cvtepu8_epi32(first), S8(0)));
        _mm256_storeu_ps(out + 8, weights8(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)), S8(1)));
        _mm256_storeu_ps(out + 16, weights8(_mm256_cvtepu8_epi32(second), S8(2)));
        _mm256_storeu_ps(out + 24, weights8(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)), S8(3)));
    } else { /* 2, 3, 5 or 6 bits: eight values in each `bits` bytes */
        const uint8_t *p = row + at / 8 * bits;
        if (overread) { /* 8-byte loads: 8 - bits bytes past each chunk, inside the weights */
            for (int i = 0; i < 4; i++) {
                __m128i bytes = _mm_loadl_epi64((const __m128i *)(p + bits * i));
                __m256i both = _mm256_broadcastsi128_si256(bytes);
                __m256i q = _mm256_and_si256(
                    _mm256_srlv_epi32(_mm256_shuffle_epi8(both, t->spread), t->shift), t->mask);
                _mm256_storeu_ps(out + 8 * i, weights8(q, S8(i)));
            }
        } else { /* the weights' last 32 values: no byte past them is read */
            int32_t q[32];
            const uint64_t mask = ((uint64_t)1 << bits) - 1;
            for (int i = 0; i < 4; i++) {
                const uint8_t *c = p + bits * i;
                uint64_t v = 0;
                for (int byte = 0; byte < bits; byte++) v |= (uint64_t)c[byte] << (8 * byte);
                for (int j = 0; j < 8; j++) q[8 * i + j] = (int32_t)((v >> (bits * j)) & mask);
            }
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(out + 8 * i,
                                 weights8(_mm256_loadu_si256((const __m256i *)(q + 8 * i)), S8(i)));
        }
    }
}
#undef S8

#define NO_HINT(k) ((void)0)
#define AS_FLOAT(v) (v)
FIXED_PASS(pass_1, 1, float, _mm256_loadu_ps, AS_FLOAT, NO_HINT)
FIXED_PASS(pass_2, 2, float, _mm256_loadu_ps, AS_FLOAT, NO_HINT)
FIXED_PASS(pass_3, 3, float, _mm256_loadu_ps, AS_FLOAT, NO_HINT)
FIXED_PASS(pass_4, 4, float, _mm256_loadu_ps, AS_FLOAT, NO_HINT)

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    const long K = j->k, groups = K / j->group;
    float *w = aligned_alloc(64, (size_t)((K + 15) / 16 * 16) * sizeof(float));
    if (w == NULL) return (void *)1;
    const stream_t tables = stream_tables(j->bits);
    for (int s = 0; s < j->segments; s++) {
        const long m0 = j->starts[s], m = j->starts[s + 1] - m0;
        if (m <= 0) continue;
        for (long n = j->n0; n < j->n1; n++) {
            const long r = (long)j->ids[s] * j->n + n; /* the row among all experts' */
            const uint8_t *row = j->w + r * j->row_bytes;
            for (long at = 0; at < K; at += 32) {
                const long g = ((long)s * j->n + n) * groups + at / j->group;
                const long g1 = g + (j->group == 16); /* values at + 16 .. at + 31 */
                const float scale[2] = {j->scales[g], j->scales[g1]};
                const float bias[2] = {j->biases[g], j->biases[g1]};
                /* 8-byte loads may pass a chunk's end except at the weights' end */
                const int overread = r + 1 < j->rows_total || at + 32 < K;
                unpack32(row, at, j->bits, &tables, scale, bias, overread, w + at);
            }
            ALL_ROWS(pass_, w, j->x + m0 * K, K, m, 0.0f, j->y + m0 * j->n + n, j->n);
        }
    }
    free(w);
    return NULL;
}

/* Stacked experts' products: weights [experts, n, k * bits / 8 bytes], x's m
 * rows grouped so that rows starts[s] .. starts[s + 1] go to expert ids[s]
 * (starts: segments + 1 entries), y[m, n]; scales and biases the segments'
 * own, [segments, n, k / group] (only the experts used are converted to
 * float32 by the caller). Each expert row used is unpacked
 * once per call, whatever the number of rows routed to it; each output sums
 * in the same fixed order as a lone row's. Returns 0, or -1 when a buffer
 * could not be had (the caller then runs MLX's product). k must be a multiple
 * of 32 and of group; group 16, 32, 64 or 128; bits 2, 3, 4, 5, 6 or 8. */
int specpipe_affine_gather(const uint8_t *w, const float *scales, const float *biases,
                           const float *x, float *y, long n, long k, long experts,
                           const int32_t *ids, const long *starts, int segments, int bits,
                           int group, int threads) {
    job_t jobs[MAX_THREADS];
    threads = thread_count(threads, n);
    for (int t = 0; t < threads; t++) {
        long n0, n1;
        row_share(n, threads, t, &n0, &n1);
        jobs[t] = (job_t){w, scales, biases, x, y, ids, starts, segments,
                          n0, n1, n, k, experts * n, k * bits / 8, bits, group};
    }
    return spread(run, jobs, sizeof(job_t), threads) ? -1 : 0;
}
