/* Float32 y = x @ w.T + b for a few rows of x (CPU decode), reading w once per call.
 *
 * w is [n, k] with rows `ldw` floats apart (the unit stride along k), x is [m, k]
 * (`ldx`), y is [m, n] (`ldy`), b is [n] or NULL. Every output element is one dot
 * product computed by one thread in a fixed order (16 lanes accumulate k in steps of
 * 16, then a fixed reduction tree), so a row's result does not depend on m, on which
 * other rows share the call, or on the number of threads.
 *
 * The threads split w's rows into contiguous slices: each thread reads its slice as
 * one sequential stream (four rows at a time, each weight vector used for up to four
 * rows of x), which is what keeps a memory-bound matrix-vector product near the
 * machine's read bandwidth. Rows of x come in blocks of four, each block passing over
 * a chunk of 16 weight rows while the chunk is in cache; the kernel is meant for
 * decode batches (m up to a few dozen), not prefill.
 *
 * Built at run time by lmkit_kernels/cpu/build.py with -fopenmp; in-process it shares
 * torch's OpenMP runtime (same libgomp), so it uses the same worker threads.
 */
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>

#define ROWS 4   /* weight rows per step */
#define XROWS 4  /* rows of x per step */
#define CHUNK 16 /* weight rows kept in cache while every block of x rows passes */

/* 1 when this CPU (and OS) runs AVX-512F code, else 0: the kernel is only used then. */
int lmkit_row_gemv_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
}

/* Version of this file's interface; the loader refuses a library with another. */
int lmkit_row_gemv_abi(void) { return 1; }

/* R weight rows x MM rows of x: acc[r][i] sums w[r] * x[i] over k. */
#define DEFINE_TILE(R, MM)                                                              \
__attribute__((target("avx512f")))                                                       \
static void tile_##R##_##MM(const float* x, long ldx, const float* w, long ldw,          \
                            const float* b, float* y, long ldy, long k) {               \
    __m512 acc[R][MM];                                                                   \
    for (int r = 0; r < R; r++)                                                          \
        for (int i = 0; i < MM; i++) acc[r][i] = _mm512_setzero_ps();                    \
    long kk = 0;                                                                         \
    for (; kk + 16 <= k; kk += 16) {                                                     \
        __m512 xv[MM];                                                                   \
        for (int i = 0; i < MM; i++) xv[i] = _mm512_loadu_ps(x + i * ldx + kk);          \
        for (int r = 0; r < R; r++) {                                                    \
            __m512 wv = _mm512_loadu_ps(w + r * ldw + kk);                               \
            for (int i = 0; i < MM; i++) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]); \
        }                                                                                \
    }                                                                                    \
    if (kk < k) {                                                                        \
        __mmask16 tail = (__mmask16)((1u << (k - kk)) - 1u);                             \
        __m512 xv[MM];                                                                   \
        for (int i = 0; i < MM; i++) xv[i] = _mm512_maskz_loadu_ps(tail, x + i * ldx + kk); \
        for (int r = 0; r < R; r++) {                                                    \
            __m512 wv = _mm512_maskz_loadu_ps(tail, w + r * ldw + kk);                   \
            for (int i = 0; i < MM; i++) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]); \
        }                                                                                \
    }                                                                                    \
    for (int r = 0; r < R; r++)                                                          \
        for (int i = 0; i < MM; i++)                                                     \
            y[i * ldy + r] = _mm512_reduce_add_ps(acc[r][i]) + (b ? b[r] : 0.0f);        \
}

DEFINE_TILE(4, 1) DEFINE_TILE(4, 2) DEFINE_TILE(4, 3) DEFINE_TILE(4, 4)
DEFINE_TILE(1, 1) DEFINE_TILE(1, 2) DEFINE_TILE(1, 3) DEFINE_TILE(1, 4)

typedef void (*tile_fn)(const float*, long, const float*, long, const float*, float*, long, long);
static const tile_fn TILES4[XROWS + 1] = {0, tile_4_1, tile_4_2, tile_4_3, tile_4_4};
static const tile_fn TILES1[XROWS + 1] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4};

/* Rows [n0, n1) of w against all m rows of x, in chunks of CHUNK weight rows: a chunk
 * comes from memory once (for the first block of x rows) and from the L1/L2 cache for
 * the other blocks, so m up to a few dozen rows still reads the weight once. */
static void row_slice(const float* x, long ldx, const float* w, long ldw, const float* b,
                      float* y, long ldy, long m, long n0, long n1, long k) {
    for (long c0 = n0; c0 < n1; c0 += CHUNK) {
        long c1 = c0 + CHUNK < n1 ? c0 + CHUNK : n1;
        for (long i0 = 0; i0 < m; i0 += XROWS) {
            long mm = m - i0 < XROWS ? m - i0 : XROWS;
            const float* xb = x + i0 * ldx;
            float* yb = y + i0 * ldy;
            long n = c0;
            for (; n + ROWS <= c1; n += ROWS)
                TILES4[mm](xb, ldx, w + n * ldw, ldw, b ? b + n : NULL, yb + n, ldy, k);
            for (; n < c1; n++)
                TILES1[mm](xb, ldx, w + n * ldw, ldw, b ? b + n : NULL, yb + n, ldy, k);
        }
    }
}

/* y[m, n] = x[m, k] @ w[n, k].T (+ b[n]) on `threads` OpenMP threads. */
void lmkit_row_gemv(const float* x, long ldx, const float* w, long ldw, const float* b,
                    float* y, long ldy, long m, long n, long k, int threads) {
    /* slices of whole 16-row groups; small outputs are not worth waking threads for */
    long groups = (n + 15) / 16;
    if (threads > groups) threads = (int)groups;
    if (threads < 1) threads = 1;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        long per = (groups + nt - 1) / nt;
        long n0 = t * per * 16, n1 = (t + 1) * per * 16;
        if (n1 > n) n1 = n;
        if (n0 < n1) row_slice(x, ldx, w, ldw, b, y, ldy, m, n0, n1, k);
    }
}
