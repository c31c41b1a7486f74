/* out[M, N] = x[M, K] @ W[K, N] in float32, each output element summed over k in the same order whatever M and
 * the thread count, so a row's result never depends on the rows beside it (batch invariance).
 *
 * W is packed in tiles of 32 columns, [ceil(N / 32), K, 32] (rowgemm.py packs it), so a tile streams from memory
 * once and serves every row. Per element: acc = fma(x[m, k], w[k, n], acc) for k = 0 .. K-1 from acc = 0; the
 * two-row and one-row kernels below do exactly that per row, and threads split whole tiles only. Built with
 * -mavx2 -mfma (no -ffast-math), on x86-64 CPUs that have both; rowgemm.py checks the CPU first.
 */
#include <immintrin.h>
#include <string.h>

#define TILE 32
#define PARALLEL_MACS 4e6

static void store_tile(float *out, const __m256 acc[4], long cols) {
    if (cols == TILE) {
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
        return;
    }
    float tmp[TILE];
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(tmp + 8 * j, acc[j]);
    memcpy(out, tmp, (size_t)cols * sizeof(float));
}

static void two_rows(const float *x0, const float *x1, const float *w, long K, long ldw, float *o0, float *o1,
                     long cols) {
    __m256 a[4], b[4];
    for (int j = 0; j < 4; j++) a[j] = b[j] = _mm256_setzero_ps();
    for (long k = 0; k < K; k++, w += ldw) {
        __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        __m256 w2 = _mm256_loadu_ps(w + 16), w3 = _mm256_loadu_ps(w + 24);
        __m256 s = _mm256_broadcast_ss(x0 + k), t = _mm256_broadcast_ss(x1 + k);
        a[0] = _mm256_fmadd_ps(s, w0, a[0]);
        a[1] = _mm256_fmadd_ps(s, w1, a[1]);
        a[2] = _mm256_fmadd_ps(s, w2, a[2]);
        a[3] = _mm256_fmadd_ps(s, w3, a[3]);
        b[0] = _mm256_fmadd_ps(t, w0, b[0]);
        b[1] = _mm256_fmadd_ps(t, w1, b[1]);
        b[2] = _mm256_fmadd_ps(t, w2, b[2]);
        b[3] = _mm256_fmadd_ps(t, w3, b[3]);
    }
    store_tile(o0, a, cols);
    store_tile(o1, b, cols);
}

static void one_row(const float *x0, const float *w, long K, long ldw, float *o0, long cols) {
    __m256 a[4];
    for (int j = 0; j < 4; j++) a[j] = _mm256_setzero_ps();
    for (long k = 0; k < K; k++, w += ldw) {
        __m256 s = _mm256_broadcast_ss(x0 + k);
        a[0] = _mm256_fmadd_ps(s, _mm256_loadu_ps(w), a[0]);
        a[1] = _mm256_fmadd_ps(s, _mm256_loadu_ps(w + 8), a[1]);
        a[2] = _mm256_fmadd_ps(s, _mm256_loadu_ps(w + 16), a[2]);
        a[3] = _mm256_fmadd_ps(s, _mm256_loadu_ps(w + 24), a[3]);
    }
    store_tile(o0, a, cols);
}

/* For b < batch: out_b[M, N] = x_b[M, K] @ w_b, x_b = x + b * bx row-major, out_b = out + b * bo row-major,
 * w_b = w + b * bw, with column tile t's row k at w_b + t * tstride + k * ldw (packed: tstride = K * 32, ldw = 32;
 * a row-major [K, >= N] matrix with row length L: tstride = 32, ldw = L, N a multiple of 32). */
void rowgemm(const float *x, long M, long K, const float *w, long ldw, long tstride, long N, float *out, long batch,
             long bx, long bw, long bo) {
    long tiles = (N + TILE - 1) / TILE;
    /* Threads only where the product is big enough to repay waking them: a decode step's layer products take
     * tens of microseconds, and a thread that the OS has parked makes the others wait (and spin). */
    int big = (double)batch * M * K * N >= PARALLEL_MACS;
#pragma omp parallel for schedule(static) if (big)
    for (long bt = 0; bt < batch * tiles; bt++) {
        long b = bt / tiles, t = bt % tiles;
        const float *xb = x + b * bx, *wt = w + b * bw + t * tstride;
        float *ob = out + b * bo;
        long n0 = t * TILE, cols = N - n0 < TILE ? N - n0 : TILE;
        long m = 0;
        for (; m + 1 < M; m += 2)
            two_rows(xb + m * K, xb + (m + 1) * K, wt, K, ldw, ob + m * N + n0, ob + (m + 1) * N + n0, cols);
        if (m < M) one_row(xb + m * K, wt, K, ldw, ob + m * N + n0, cols);
    }
}
