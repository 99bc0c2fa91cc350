/* How both CPU kernels spread a product's weight rows over threads
 * (bf16_matmul.c, affine_matmul.c): `threads` contiguous shares of rows
 * [0, n), shares 1.. on threads of their own, share 0 on the calling
 * thread; a share whose thread cannot start runs on the calling thread too.
 */
#ifndef SPECPIPE_ROW_THREADS_H
#define SPECPIPE_ROW_THREADS_H

#include <pthread.h>
#include <stddef.h>

#define MAX_THREADS 64

/* The thread count for n rows: 1..MAX_THREADS and at most n (1 for n == 0:
 * no rows, no division by zero). */
static inline int thread_count(int threads, long n) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = (int)n;
    return threads < 1 ? 1 : threads;
}

/* Share t of n rows over `threads`: rows [*n0, *n1). */
static inline void row_share(long n, int threads, int t, long *n0, long *n1) {
    const long per = (n + threads - 1) / threads;
    *n0 = t * per < n ? t * per : n;
    *n1 = *n0 + per > n ? n : *n0 + per;
}

/* run(jobs + t * size) for t < threads, as above; whether any run returned
 * non-NULL (it could not do its share). */
static inline int spread(void *(*run)(void *), void *jobs, size_t size, int threads) {
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    char *job = (char *)jobs;
    int failed = 0;
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tid[t], NULL, run, job + t * size) == 0;
    failed |= run(job) != NULL;
    for (int t = 1; t < threads; t++) {
        void *result = NULL;
        if (started[t]) pthread_join(tid[t], &result);
        else result = run(job + t * size);
        failed |= result != NULL;
    }
    return failed;
}

#endif
