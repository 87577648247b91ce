/* Float32 y = x @ w.T + b for a few rows of x (CPU decode), reading w once per call.
 *
 * Two builds of the same kernel: lmkit_row_gemv_avx512f (16 lanes, tiles of 4 weight
 * rows x 4 rows of x: 16 of the 32 vector registers hold sums) and lmkit_row_gemv_avx2
 * (AVX2 + FMA: 8 lanes, tiles of 4 x 3: 12 sums, 3 inputs and a weight vector fill the
 * 16 registers). lmkit_row_gemv_isa_supported() says which ones this CPU runs.
 *
 * w is [n, k] with rows `ldw` floats apart (the unit stride along k), x is [m, k]
 * (`ldx`), y is [m, n] (`ldy`), b is [n] or NULL. Every output element is one dot
 * product computed by one thread in a fixed order (the lanes accumulate k a vector at a
 * time, then a fixed reduction tree), so for a given build a row's result does not
 * depend on m, on which other rows share the call, or on the number of threads.
 *
 * The threads split w's rows into contiguous slices: each thread reads its slice as
 * one sequential stream (four rows at a time, each weight vector used for every row of
 * x in the block), which is what keeps a memory-bound matrix-vector product near the
 * machine's read bandwidth. Rows of x come in blocks (four or three, by build), each
 * block passing over a chunk of 16 weight rows while the chunk is in cache; the kernel
 * is meant for decode batches (m up to a few dozen), not prefill.
 *
 * Tiles of three or four x rows do twelve to sixteen FMAs per weight vector they load,
 * so their loads come too slowly for the hardware prefetcher to keep enough of the
 * stream in flight: with each weight vector they prefetch the one ROWS rows further
 * on, the next tile's (a prefetch never faults, so addresses past the matrix's end are
 * harmless). Measured on a 2-core AMD EPYC (Zen 5) VM over every decode projection of a
 * model's layers, this build against one without prefetches alternating in one process
 * (median per-round speedup): SmolLM2-135M 1.11x at 4 rows, 1.07x at 3 and 8; Qwen3-0.6B
 * 1.13x at 4 rows, 1.09x at 8. At one and two rows prefetching measured neutral to
 * slower (0.98-1.01x; at one row with a fixed 8 KiB distance 6-10% slower), and a fixed
 * distance in bytes lost on Qwen3-0.6B's longer rows (0.95x at 4 rows), so one- and
 * two-row tiles leave the stream to the hardware. The results are the same bits.
 *
 * Built at run time by lmkit_kernels/cpu/build.py with -fopenmp; in-process it shares
 * torch's OpenMP runtime (same libgomp), so it uses the same worker threads.
 */
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <string.h>

#define ROWS 4   /* weight rows per tile */
#define CHUNK 16 /* weight rows kept in cache while every block of x rows passes */
#define MAX_XROWS 4

/* Version of this file's interface; the loader refuses a library with another. */
int lmkit_row_gemv_abi(void) { return 2; }

/* 1 when this CPU (and OS) runs the build named `isa` ("avx512f" or "avx2"), else 0. */
int lmkit_row_gemv_isa_supported(const char* isa) {
    __builtin_cpu_init();
    if (strcmp(isa, "avx512f") == 0) return __builtin_cpu_supports("avx512f") ? 1 : 0;
    if (strcmp(isa, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
    return 0;
}

typedef void (*tile_fn)(const float*, long, const float*, long, const float*, float*, long, long);

/* One tile: R weight rows x MM rows of x, acc[r][i] sums w[r] * x[i] over k, a vector
 * of LANES floats at a time; the last k % LANES columns load under a mask. The ISA
 * macros below (V_*) say how, for one target. */
#define DEFINE_TILE(ISA, R, MM)                                                           \
__attribute__((target(V_TARGET)))                                                         \
static void tile_##ISA##_##R##_##MM(const float* x, long ldx, const float* w, long ldw,   \
                                    const float* b, float* y, long ldy, long k) {         \
    V_TYPE acc[R][MM];                                                                    \
    for (int r = 0; r < R; r++)                                                           \
        for (int i = 0; i < MM; i++) acc[r][i] = V_ZERO();                                \
    long kk = 0;                                                                          \
    for (; kk + V_LANES <= k; kk += V_LANES) {                                            \
        V_TYPE xv[MM];                                                                    \
        for (int i = 0; i < MM; i++) xv[i] = V_LOAD(x + i * ldx + kk);                    \
        for (int r = 0; r < R; r++) {                                                     \
            if (MM > 2) /* the next tile's row (see the header) */                       \
                __builtin_prefetch(w + (r + ROWS) * ldw + kk, 0, 3); /* prefetcht0 */   \
            V_TYPE wv = V_LOAD(w + r * ldw + kk);                                         \
            for (int i = 0; i < MM; i++) acc[r][i] = V_FMADD(wv, xv[i], acc[r][i]);       \
        }                                                                                 \
    }                                                                                     \
    if (kk < k) {                                                                         \
        V_MASK_TYPE tail = V_MASK(k - kk);                                                \
        V_TYPE xv[MM];                                                                    \
        for (int i = 0; i < MM; i++) xv[i] = V_MASKLOAD(tail, x + i * ldx + kk);          \
        for (int r = 0; r < R; r++) {                                                     \
            V_TYPE wv = V_MASKLOAD(tail, w + r * ldw + kk);                               \
            for (int i = 0; i < MM; i++) acc[r][i] = V_FMADD(wv, xv[i], acc[r][i]);       \
        }                                                                                 \
    }                                                                                     \
    for (int r = 0; r < R; r++)                                                           \
        for (int i = 0; i < MM; i++)                                                      \
            y[i * ldy + r] = V_REDUCE(acc[r][i]) + (b ? b[r] : 0.0f);                     \
}

/* ---- AVX-512F: 16 lanes, x rows in blocks of 4 ---- */
#define V_TARGET "avx512f"
#define V_TYPE __m512
#define V_LANES 16
#define V_ZERO _mm512_setzero_ps
#define V_LOAD _mm512_loadu_ps
#define V_FMADD _mm512_fmadd_ps
#define V_MASK_TYPE __mmask16
#define V_MASK(n) ((__mmask16)((1u << (n)) - 1u))
#define V_MASKLOAD _mm512_maskz_loadu_ps
#define V_REDUCE _mm512_reduce_add_ps
DEFINE_TILE(avx512f, 4, 1) DEFINE_TILE(avx512f, 4, 2) DEFINE_TILE(avx512f, 4, 3)
DEFINE_TILE(avx512f, 4, 4) DEFINE_TILE(avx512f, 1, 1) DEFINE_TILE(avx512f, 1, 2)
DEFINE_TILE(avx512f, 1, 3) DEFINE_TILE(avx512f, 1, 4)
#undef V_TARGET
#undef V_TYPE
#undef V_LANES
#undef V_ZERO
#undef V_LOAD
#undef V_FMADD
#undef V_MASK_TYPE
#undef V_MASK
#undef V_MASKLOAD
#undef V_REDUCE

/* ---- AVX2 + FMA: 8 lanes, x rows in blocks of 3 ---- */
__attribute__((target("avx2,fma")))
static inline __m256i avx2_tail_mask(long n) { /* lanes [0, n) set, n < 8 */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

__attribute__((target("avx2,fma")))
static inline float avx2_reduce(__m256 v) { /* (lo + hi) -> 4 -> 2 -> 1 lanes */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define V_TARGET "avx2,fma"
#define V_TYPE __m256
#define V_LANES 8
#define V_ZERO _mm256_setzero_ps
#define V_LOAD _mm256_loadu_ps
#define V_FMADD _mm256_fmadd_ps
#define V_MASK_TYPE __m256i
#define V_MASK avx2_tail_mask
#define V_MASKLOAD(m, p) _mm256_maskload_ps((p), (m))
#define V_REDUCE avx2_reduce
DEFINE_TILE(avx2, 4, 1) DEFINE_TILE(avx2, 4, 2) DEFINE_TILE(avx2, 4, 3)
DEFINE_TILE(avx2, 1, 1) DEFINE_TILE(avx2, 1, 2) DEFINE_TILE(avx2, 1, 3)

/* A build: its tiles for ROWS and for 1 weight row, indexed by the x block's rows. */
typedef struct {
    int xrows; /* rows of x per block */
    tile_fn rows4[MAX_XROWS + 1], rows1[MAX_XROWS + 1];
} build_t;

static const build_t AVX512F = {4, {0, tile_avx512f_4_1, tile_avx512f_4_2, tile_avx512f_4_3,
                                    tile_avx512f_4_4},
                                {0, tile_avx512f_1_1, tile_avx512f_1_2, tile_avx512f_1_3,
                                 tile_avx512f_1_4}};
static const build_t AVX2 = {3, {0, tile_avx2_4_1, tile_avx2_4_2, tile_avx2_4_3, 0},
                             {0, tile_avx2_1_1, tile_avx2_1_2, tile_avx2_1_3, 0}};

/* Rows [n0, n1) of w against all m rows of x, in chunks of CHUNK weight rows: a chunk
 * comes from memory once (for the first block of x rows) and from the L1/L2 cache for
 * the other blocks, so m up to a few dozen rows still reads the weight once. */
static void row_slice(const build_t* bd, const float* x, long ldx, const float* w, long ldw,
                      const float* b, float* y, long ldy, long m, long n0, long n1, long k) {
    for (long c0 = n0; c0 < n1; c0 += CHUNK) {
        long c1 = c0 + CHUNK < n1 ? c0 + CHUNK : n1;
        for (long i0 = 0; i0 < m; i0 += bd->xrows) {
            long mm = m - i0 < bd->xrows ? m - i0 : bd->xrows;
            const float* xb = x + i0 * ldx;
            float* yb = y + i0 * ldy;
            long n = c0;
            for (; n + ROWS <= c1; n += ROWS)
                bd->rows4[mm](xb, ldx, w + n * ldw, ldw, b ? b + n : NULL, yb + n, ldy, k);
            for (; n < c1; n++)
                bd->rows1[mm](xb, ldx, w + n * ldw, ldw, b ? b + n : NULL, yb + n, ldy, k);
        }
    }
}

/* y[m, n] = x[m, k] @ w[n, k].T (+ b[n]) with build `bd` on `threads` OpenMP threads. */
static void row_gemv(const build_t* bd, const float* x, long ldx, const float* w, long ldw,
                     const float* b, float* y, long ldy, long m, long n, long k, int threads) {
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
        if (n0 < n1) row_slice(bd, x, ldx, w, ldw, b, y, ldy, m, n0, n1, k);
    }
}

/* The entry points (same arguments); call only a build the CPU runs. */
void lmkit_row_gemv_avx512f(const float* x, long ldx, const float* w, long ldw, const float* b,
                            float* y, long ldy, long m, long n, long k, int threads) {
    row_gemv(&AVX512F, x, ldx, w, ldw, b, y, ldy, m, n, k, threads);
}

void lmkit_row_gemv_avx2(const float* x, long ldx, const float* w, long ldw, const float* b,
                         float* y, long ldy, long m, long n, long k, int threads) {
    row_gemv(&AVX2, x, ldx, w, ldw, b, y, ldy, m, n, k, threads);
}
