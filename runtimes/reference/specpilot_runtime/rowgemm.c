/* out[M, N] = x[M, K] @ W[K, N] in float32, each output element summed over k in the same order whatever M and
 * the thread count, so a row's result never depends on the rows beside it (batch invariance).
 *
 * Per element: acc = fma(x[m, k], w[k, n], acc) for k = 0 .. K-1 from acc = 0. Every microkernel below does
 * exactly that for each of its rows and columns (they differ only in how many rows and columns they keep in
 * registers at once), and threads split whole 32-column tiles only. Built with -mavx2 -mfma (no -ffast-math), on
 * x86-64 CPUs that have both; rowgemm.py checks the CPU first.
 *
 * W is packed in panels of 16 columns, [2 * ceil(N / 32), K, 16] (rowgemm.py packs it), two panels to a tile. From
 * a few rows on (a verify step, a prefill) a product is compute-bound, so each microkernel keeps 8-12 accumulators
 * in ymm registers, enough independent FMA chains to keep both FMA pipes busy: 3 x 32 outputs (4 weight loads and
 * 3 broadcasts per 12 FMAs) or 6 x 16 (2 weight loads, 6 broadcasts), and the smaller blocks a row count leaves
 * (see `tile`). Measured in benchmarks/reference_runtime.md: ~100 of the 117 GFLOP/s an EPYC core's FMAs give.
 */
#include <immintrin.h>
#include <string.h>

#define TILE 32
#define PANEL 16
#define MAX_ROWS 6
#define PREFETCH 64
#define PARALLEL_MACS 4e6

/* rows x (8 * vecs) outputs, all in registers: columns 0-15 from panel w0, 16-31 from panel w1 (vecs 4, rows <= 3)
 * or columns 0-15 from w0 alone (vecs 2, rows <= 6). rows and vecs are constants once inlined, so the loops
 * unroll and acc stays in registers. */
static inline __attribute__((always_inline)) void block(const float *x, long ldx, const float *w0, const float *w1,
                                                        long K, long ldw, float *out, long ldo, long cols,
                                                        const int rows, const int vecs) {
    __m256 acc[MAX_ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int j = 0; j < vecs; j++) acc[r][j] = _mm256_setzero_ps();
    for (long k = 0; k < K; k++, w0 += ldw, w1 += ldw) {
        __m256 wv[4];
        /* a panel of 4+ rows' blocks streams 64 bytes per k, too slowly for the hardware prefetcher alone to keep
         * a memory-bound product (lm_head) fed: ask for the line PREFETCH rows of k ahead (past the end: a no-op) */
        if (vecs == 2) _mm_prefetch((const char *)(w0 + PREFETCH * ldw), _MM_HINT_T0);
        wv[0] = _mm256_loadu_ps(w0);
        wv[1] = _mm256_loadu_ps(w0 + 8);
        if (vecs == 4) {
            wv[2] = _mm256_loadu_ps(w1);
            wv[3] = _mm256_loadu_ps(w1 + 8);
        }
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            __m256 s = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
            for (int j = 0; j < vecs; j++) acc[r][j] = _mm256_fmadd_ps(s, wv[j], acc[r][j]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++) {
        float *o = out + r * ldo;
        if (cols == 8 * vecs) {
#pragma GCC unroll 4
            for (int j = 0; j < vecs; j++) _mm256_storeu_ps(o + 8 * j, acc[r][j]);
        } else {
            float tmp[TILE];
#pragma GCC unroll 4
            for (int j = 0; j < vecs; j++) _mm256_storeu_ps(tmp + 8 * j, acc[r][j]);
            memcpy(o, tmp, (size_t)cols * sizeof(float));
        }
    }
}

/* Rows [0, rows) (rows <= 6; tile() gives 4-6) of one 16-column panel (cols <= 16 of them real). */
static void panel_rows(const float *x, long K, const float *w, long ldw, float *out, long N, long cols, long rows) {
    switch (rows) {
    case 1: block(x, K, w, w, K, ldw, out, N, cols, 1, 2); return;
    case 2: block(x, K, w, w, K, ldw, out, N, cols, 2, 2); return;
    case 3: block(x, K, w, w, K, ldw, out, N, cols, 3, 2); return;
    case 4: block(x, K, w, w, K, ldw, out, N, cols, 4, 2); return;
    case 5: block(x, K, w, w, K, ldw, out, N, cols, 5, 2); return;
    default: block(x, K, w, w, K, ldw, out, N, cols, 6, 2); return;
    }
}

/* All M rows of one 32-column tile (panels w0 and w1, cols <= 32 of them real). Blocks of up to 3 rows read both
 * panels in one pass; blocks of 4-6 rows go panel by panel, so a panel comes from memory once and from cache for
 * the other blocks. Any M but 1-3 and 7 splits into blocks of 4-6 (as even as may be: 13 = 4 + 4 + 5); 7 = 3 + 4.
 * Every block keeps 8-12 accumulators, but a lone row's 4. */
static void tile(const float *x, long M, long K, const float *w0, const float *w1, long ldw, float *out, long N,
                 long cols) {
    long wide = M <= 3 ? M : M == 7 ? 3 : 0;
    switch (wide) {
    case 1: block(x, K, w0, w1, K, ldw, out, N, cols, 1, 4); break;
    case 2: block(x, K, w0, w1, K, ldw, out, N, cols, 2, 4); break;
    case 3: block(x, K, w0, w1, K, ldw, out, N, cols, 3, 4); break;
    }
    long lo = cols < PANEL ? cols : PANEL;
    for (int half = 0; half < 2; half++) {
        long c = half ? cols - lo : lo;
        if (c <= 0) break;
        for (long m = wide, rows; m < M; m += rows) {
            long left = M - m;
            rows = left / ((left + MAX_ROWS - 1) / MAX_ROWS);
            panel_rows(x + m * K, K, half ? w1 : w0, ldw, out + m * N + half * PANEL, N, c, rows);
        }
    }
}

/* For b < batch: out_b[M, N] = x_b[M, K] @ w_b, x_b = x + b * bx row-major, out_b = out + b * bo row-major,
 * w_b = w + b * bw, with 16-column panel p's row k at w_b + p * pstride + k * ldw, and panels up to a whole number
 * of 32-column tiles (packed: [2 * ceil(N / 32), K, 16], pstride = K * 16, ldw = 16; a row-major [K, >= N] matrix
 * with row length L: pstride = 16, ldw = L, N a multiple of 32). */
void rowgemm(const float *x, long M, long K, const float *w, long ldw, long pstride, long N, float *out, long batch,
             long bx, long bw, long bo) {
    long tiles = (N + TILE - 1) / TILE;
    /* Threads only where the product is big enough to repay waking them: a decode step's layer products take
     * tens of microseconds, and a thread that the OS has parked makes the others wait (and spin). */
    int big = (double)batch * M * K * N >= PARALLEL_MACS;
#pragma omp parallel for schedule(static) if (big)
    for (long bt = 0; bt < batch * tiles; bt++) {
        long b = bt / tiles, t = bt % tiles;
        const float *xb = x + b * bx, *w0 = w + b * bw + 2 * t * pstride;
        long n0 = t * TILE, cols = N - n0 < TILE ? N - n0 : TILE;
        tile(xb, M, K, w0, w0 + pstride, ldw, out + b * bo + n0, N, cols);
    }
}
