/* y = x @ dequant(w).T (+ b) for a few float32 rows of x over GGUF-quantized weights
 * (Q8_0, Q4_0, Q4_1 blocks kept as they are), and dequantization of such weights.
 *
 * Block layouts (ggml, 32 weights per block, little-endian):
 *   Q8_0: fp16 d, int8 q[32]                  w = d * q                      (34 bytes)
 *   Q4_0: fp16 d, uint8 qs[16]                w = d * (nibble - 8)           (18 bytes)
 *   Q4_1: fp16 d, fp16 m, uint8 qs[16]        w = d * nibble + m             (20 bytes)
 * where weight j < 16 is the low nibble of qs[j] and weight j + 16 its high nibble.
 * A weight matrix [n, k] is n rows of k / 32 blocks, `ldw` bytes apart.
 *
 * As llama.cpp does, the rows of x are first quantized per block of 32 to int8
 * (xd = max|x| / 127, xq = round(x / xd)), and each block's product is an integer dot
 * product scaled by the two block scales:
 *   Q8_0: dw * xd * sum(wq * xq)
 *   Q4_0: dw * xd * sum(nib * xq) - 8 * dw * xd * sum(xq)
 *   Q4_1: dw * xd * sum(nib * xq) + m * xd * sum(xq)
 * so the error against float32 is the activation rounding (|err| <= xd / 2 per value).
 *
 * Two builds: lmkit_qgemv_avx512vnni (AVX-512 VNNI on 256-bit vectors: one vpdpbusd
 * per block) and lmkit_qgemv_avx2 (AVX2 + FMA: vpmaddubsw + vpmaddwd). The threads
 * split w's rows into contiguous slices (one sequential stream each); every output
 * element is computed by one thread in a fixed order, so a row's result does not depend
 * on m or the number of threads. Built at run time by lmkit_kernels/cpu/build.py with
 * -fopenmp, sharing torch's OpenMP runtime.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define MAX_XROWS 4
enum { Q8_0 = 8, Q4_0 = 2, Q4_1 = 3 }; /* ggml type numbers */

int lmkit_qgemv_abi(void) { return 1; }

int lmkit_qgemv_isa_supported(const char* isa) {
    __builtin_cpu_init();
    if (strcmp(isa, "avx512vnni") == 0)
        return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
            && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma")
            && __builtin_cpu_supports("f16c") ? 1 : 0;
    if (strcmp(isa, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
            && __builtin_cpu_supports("f16c") ? 1 : 0;
    return 0;
}

/* Bytes of one block of `type`, 0 for a type this file does not read. */
int lmkit_qgemv_block_bytes(int type) {
    return type == Q8_0 ? 34 : type == Q4_0 ? 18 : type == Q4_1 ? 20 : 0;
}

static inline float fp16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, f;
    if (exp == 0) {
        if (man == 0) { f = sign; }
        else { /* subnormal */
            float v = ldexpf((float)man, -24);
            return sign ? -v : v;
        }
    } else if (exp == 31) {
        f = sign | 0x7f800000u | (man << 13);
    } else {
        f = sign | ((exp + 112) << 23) | (man << 13);
    }
    float out;
    memcpy(&out, &f, 4);
    return out;
}

/* x rows [m, k] -> int8 xq [m, k], scales xd [m, k/32], xs [m, k/32] = xd * sum(xq). */
static void quantize_rows(const float* x, long ldx, long m, long k, int8_t* xq, float* xd,
                          float* xs) {
    long nb = k / QK;
    for (long i = 0; i < m; i++) {
        for (long b = 0; b < nb; b++) {
            const float* v = x + i * ldx + b * QK;
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
            float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t* q = xq + i * k + b * QK;
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                q[j] = (int8_t)lrintf(v[j] * id);
                sum += q[j];
            }
            xd[i * nb + b] = d;
            xs[i * nb + b] = d * (float)sum;
        }
    }
}

/* ---- per-ISA integer dot products of one weight block with one x block ---- */
/* u: 32 unsigned bytes, s: 32 signed bytes -> 8 int32 lanes of partial sums */
__attribute__((target("avx2,fma,f16c")))
static inline __m256i dot_avx2(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

__attribute__((target("avx512vnni,avx512vl,avx512bw,avx2,fma,f16c")))
static inline __m256i dot_vnni(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

__attribute__((target("avx2,fma,f16c")))
static inline float h2f(const uint8_t* p) { /* fp16 -> float with F16C */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

__attribute__((target("avx2,fma,f16c")))
static inline __m256i unpack_nibbles(const uint8_t* qs) {
    __m128i b = _mm_loadu_si128((const __m128i*)qs);
    __m128i mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return _mm256_set_m128i(hi, lo);
}

__attribute__((target("avx2,fma,f16c")))
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One weight row against MM rows of x: y[i] = sum over blocks. DOT is the ISA's dot. */
#define DEFINE_ROW(ISA, TARGET, DOT, MM)                                                   \
__attribute__((target(TARGET)))                                                           \
static void row_##ISA##_##MM(int type, const uint8_t* w, const int8_t* xq, long k,         \
                             const float* xd, const float* xs, float* y, long ldy) {       \
    long nb = k / QK;                                                                     \
    __m256 acc[MM];                                                                       \
    float off[MM];                                                                        \
    for (int i = 0; i < MM; i++) { acc[i] = _mm256_setzero_ps(); off[i] = 0.0f; }         \
    if (type == Q8_0) {                                                                   \
        for (long b = 0; b < nb; b++, w += 34) {                                          \
            float dw = h2f(w);                                                           \
            __m256i q = _mm256_loadu_si256((const __m256i*)(w + 2));                      \
            __m256i u = _mm256_sign_epi8(q, q);                                           \
            for (int i = 0; i < MM; i++) {                                                \
                __m256i s = _mm256_sign_epi8(                                             \
                    _mm256_loadu_si256((const __m256i*)(xq + i * k + b * QK)), q);        \
                __m256 p = _mm256_cvtepi32_ps(DOT(u, s));                                 \
                acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * xd[i * nb + b]), acc[i]); \
            }                                                                             \
        }                                                                                 \
    } else {                                                                              \
        int has_min = type == Q4_1, step = has_min ? 20 : 18;                             \
        for (long b = 0; b < nb; b++, w += step) {                                        \
            float dw = h2f(w), c = has_min ? h2f(w + 2) : -8.0f * dw;                   \
            __m256i u = unpack_nibbles(w + (has_min ? 4 : 2));                            \
            for (int i = 0; i < MM; i++) {                                                \
                __m256i s = _mm256_loadu_si256((const __m256i*)(xq + i * k + b * QK));    \
                __m256 p = _mm256_cvtepi32_ps(DOT(u, s));                                 \
                acc[i] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * xd[i * nb + b]), acc[i]); \
                off[i] += c * xs[i * nb + b];                                             \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
    for (int i = 0; i < MM; i++) y[i * ldy] = hsum(acc[i]) + off[i];                      \
}

#define DEFINE_ROWS(ISA, TARGET, DOT)                                                      \
    DEFINE_ROW(ISA, TARGET, DOT, 1) DEFINE_ROW(ISA, TARGET, DOT, 2)                        \
    DEFINE_ROW(ISA, TARGET, DOT, 3) DEFINE_ROW(ISA, TARGET, DOT, 4)

DEFINE_ROWS(avx2, "avx2,fma,f16c", dot_avx2)
DEFINE_ROWS(vnni, "avx512vnni,avx512vl,avx512bw,avx2,fma,f16c", dot_vnni)

typedef void (*row_fn)(int, const uint8_t*, const int8_t*, long, const float*, const float*,
                       float*, long);
static const row_fn AVX2_ROWS[MAX_XROWS + 1] = {0, row_avx2_1, row_avx2_2, row_avx2_3,
                                                row_avx2_4};
static const row_fn VNNI_ROWS[MAX_XROWS + 1] = {0, row_vnni_1, row_vnni_2, row_vnni_3,
                                                row_vnni_4};

#define CHUNK 16 /* weight rows kept in cache while every block of x rows passes */

static int qgemv(const row_fn* rows, int type, const float* x, long ldx, const uint8_t* w,
                 long ldw, const float* bias, float* y, long ldy, long m, long n, long k,
                 int threads) {
    long nb = k / QK;
    int8_t* xq = malloc((size_t)(m * k));
    float* xd = malloc(sizeof(float) * (size_t)(m * nb) * 2);
    if (!xq || !xd) { free(xq); free(xd); return 1; }
    float* xs = xd + m * nb;
    quantize_rows(x, ldx, m, k, xq, xd, xs);
    long groups = (n + CHUNK - 1) / CHUNK;
    if (threads > groups) threads = (int)groups;
    if (threads < 1) threads = 1;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        long per = (groups + nt - 1) / nt;
        long n0 = t * per * CHUNK, n1 = (t + 1) * per * CHUNK;
        if (n1 > n) n1 = n;
        for (long c0 = n0; c0 < n1; c0 += CHUNK) {
            long c1 = c0 + CHUNK < n1 ? c0 + CHUNK : n1;
            for (long i0 = 0; i0 < m; i0 += MAX_XROWS) {
                long mm = m - i0 < MAX_XROWS ? m - i0 : MAX_XROWS;
                for (long r = c0; r < c1; r++)
                    rows[mm](type, w + r * ldw, xq + i0 * k, k, xd + i0 * nb, xs + i0 * nb,
                             y + i0 * ldy + r, ldy);
            }
        }
    }
    if (bias)
        for (long i = 0; i < m; i++)
            for (long r = 0; r < n; r++) y[i * ldy + r] += bias[r];
    free(xq);
    free(xd);
    return 0;
}

/* Entry points: 0 on success, 1 when out of memory. k must be a multiple of 32. */
int lmkit_qgemv_avx512vnni(int type, const float* x, long ldx, const uint8_t* w, long ldw,
                           const float* b, float* y, long ldy, long m, long n, long k,
                           int threads) {
    return qgemv(VNNI_ROWS, type, x, ldx, w, ldw, b, y, ldy, m, n, k, threads);
}

int lmkit_qgemv_avx2(int type, const float* x, long ldx, const uint8_t* w, long ldw,
                     const float* b, float* y, long ldy, long m, long n, long k, int threads) {
    return qgemv(AVX2_ROWS, type, x, ldx, w, ldw, b, y, ldy, m, n, k, threads);
}

/* Weight rows idx[0..count) (all rows 0..count when idx is NULL) of w dequantized to
 * float32 out [count, k] (rows `ldo` floats apart). Scalar C: the compiler vectorises it
 * well enough, and it runs once per call on large batches (or per embedding lookup). */
void lmkit_dequantize_rows(int type, const uint8_t* w, long ldw, const long* idx, long count,
                           long k, float* out, long ldo, int threads) {
    long nb = k / QK;
    int bytes = lmkit_qgemv_block_bytes(type);
    if (threads > count) threads = (int)count;
    if (threads < 1) threads = 1;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (long r = 0; r < count; r++) {
        const uint8_t* row = w + (idx ? idx[r] : r) * ldw;
        float* o = out + r * ldo;
        for (long b = 0; b < nb; b++) {
            const uint8_t* blk = row + b * bytes;
            float d = fp16(blk);
            if (type == Q8_0) {
                const int8_t* q = (const int8_t*)(blk + 2);
                for (int j = 0; j < QK; j++) o[b * QK + j] = d * (float)q[j];
            } else {
                float c = type == Q4_1 ? fp16(blk + 2) : -8.0f * d;
                const uint8_t* qs = blk + (type == Q4_1 ? 4 : 2);
                for (int j = 0; j < QK / 2; j++) {
                    o[b * QK + j] = d * (float)(qs[j] & 0x0f) + c;
                    o[b * QK + j + QK / 2] = d * (float)(qs[j] >> 4) + c;
                }
            }
        }
    }
}
