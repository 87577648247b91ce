/* y = x @ dequant(w).T (+ b) for a few float32 rows of x over GGUF-quantized weights
 * (Q8_0, Q4_0, Q4_1 here; the k-quants Q4_K and Q6_K in qgemv_k.c, included below and
 * served by the same entry points), and dequantization of such weights.
 *
 * GGUF block layouts (ggml, 32 weights per block, little-endian):
 *   Q8_0: fp16 d, int8 q[32]                  w = d * q                      (34 bytes)
 *   Q4_0: fp16 d, uint8 qs[16]                w = d * (nibble - 8)           (18 bytes)
 *   Q4_1: fp16 d, fp16 m, uint8 qs[16]        w = d * nibble + m             (20 bytes)
 * where weight j < 16 is the low nibble of qs[j] and weight j + 16 its high nibble.
 *
 * The GEMV reads the weights repacked once at load (lmkit_qpack) into groups of GR = 16
 * rows, so that one 512-bit vpdpbusd computes a 4-weight partial product for each of the
 * 16 rows: a group holds, for each block b of the rows (k / 32 of them),
 *   Q[b]: the quantized weights, 64-byte vectors j whose 4-byte lane r holds weights
 *         4j..4j+3 of row r: for Q4 types the vector t < 4 keeps weights 4t.. in its low
 *         nibbles and 16 + 4t.. in its high nibbles (the bytes of GGUF's qs, regrouped);
 *         for Q8_0 eight vectors of q ^ 0x80 (unsigned, q + 128);
 *   D[b]: the 16 rows' fp16 d, and for Q4_1 M[b]: the 16 rows' fp16 m;
 * laid out [Q for every b][D for every b][M for every b], padded to 64 bytes. Rows past
 * n in the last group are zero (scale 0). The bytes are those of the file, moved.
 *
 * As llama.cpp does, the rows of x are quantized per block of 32 to int8 (xd = max|x| /
 * 127, xq = round-to-even(x / xd), sx = sum(xq)), and each block's product is an integer
 * dot product (unsigned weights u times signed xq) scaled by the two block scales:
 *   Q8_0: d * xd * (sum(u * xq) - 128 * sx)
 *   Q4_0: d * xd * (sum(u * xq) - 8 * sx)
 *   Q4_1: d * xd * sum(u * xq) + m * xd * sx
 * so the error against float32 is the activation rounding (|err| <= xd / 2 per value).
 *
 * Two builds: lmkit_qgemv_avx512vnni (AVX-512 VNNI: one vpdpbusd per 4 weights of 16
 * rows) and lmkit_qgemv_avx2 (AVX2 + FMA: vpmaddubsw + vpmaddwd on the 8-row halves;
 * Q8_0 through the sign trick, so no product saturates). Up to MR rows of x share each
 * load of a weight group. Threads (the caller and pool helpers, see run_groups) claim
 * chunks of consecutive groups (one sequential stream each); every output element is
 * computed by one thread in a fixed order, so a row's result does not depend on m or
 * the number of threads, and both builds quantize x identically. Built at run time by
 * lmkit_kernels/cpu/build.py with -fopenmp (the dequantization's loop uses OpenMP,
 * sharing torch's runtime).
 */
#include <immintrin.h>
#include <math.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define QK 32
#define GR 16 /* weight rows per packed group */
#define MR 4  /* rows of x sharing one pass over a group */
enum { Q8_0 = 8, Q4_0 = 2, Q4_1 = 3 }; /* ggml type numbers */

int lmkit_qgemv_abi(void) { return 5; }

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

/* Bytes of one GGUF block of `type`, 0 for a type this file does not read. */
int lmkit_qgemv_block_bytes(int type) {
    return type == Q8_0 ? 34 : type == Q4_0 ? 18 : type == Q4_1 ? 20
        : type == 12 ? 144 : type == 14 ? 210 : 0; /* Q4_K, Q6_K: qgemv_k.c */
}

static inline int is_kquant(int type);
static long kgroup_bytes(int type, long k);
static void kpack(int type, const uint8_t* w, long ldw, long n, long k, uint8_t* out);

static long quant_bytes(int type) { return type == Q8_0 ? QK * GR : QK / 2 * GR; }

/* Bytes of one packed group of GR rows of k weights. */
long lmkit_qpack_group_bytes(int type, long k) {
    if (is_kquant(type)) return kgroup_bytes(type, k);
    long nb = k / QK, bytes = nb * (quant_bytes(type) + 2 * GR * (type == Q4_1 ? 2 : 1));
    return (bytes + 63) / 64 * 64;
}

/* GGUF rows w [n, ldw bytes] -> packed groups out [ceil(n / GR) * group bytes]. */
void lmkit_qpack(int type, const uint8_t* w, long ldw, long n, long k, uint8_t* out) {
    if (is_kquant(type)) { kpack(type, w, ldw, n, k, out); return; }
    long nb = k / QK, qb = quant_bytes(type), gbytes = lmkit_qpack_group_bytes(type, k);
    int bb = lmkit_qgemv_block_bytes(type);
    long groups = (n + GR - 1) / GR;
    memset(out, 0, (size_t)(groups * gbytes));
    for (long row = 0; row < n; row++) {
        uint8_t* g = out + row / GR * gbytes;
        long r = row % GR;
        for (long b = 0; b < nb; b++) {
            const uint8_t* blk = w + row * ldw + b * bb;
            uint8_t* q = g + b * qb + 4 * r;
            memcpy(g + nb * qb + b * 2 * GR + 2 * r, blk, 2);
            if (type == Q8_0) {
                for (int j = 0; j < 8; j++)
                    for (int i = 0; i < 4; i++) q[64 * j + i] = blk[2 + 4 * j + i] ^ 0x80;
                continue;
            }
            if (type == Q4_1) memcpy(g + nb * (qb + 2 * GR) + b * 2 * GR + 2 * r, blk + 2, 2);
            const uint8_t* qs = blk + (type == Q4_1 ? 4 : 2);
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < 4; i++) q[64 * t + i] = qs[4 * t + i];
        }
    }
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

/* ---- activations: x rows [m, k] -> xq [m, k] int8, xd, xs (int), xm = xd * xs ---- */
typedef struct { int8_t* q; float* d; int32_t* s; float* m; } xquant;

static void quantize_block_scalar(const float* v, int8_t* q, float* d, int32_t* s) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
    float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        q[j] = (int8_t)lrintf(v[j] * id);
        sum += q[j];
    }
    *d = dd;
    *s = sum;
}

/* the same arithmetic as quantize_block_scalar (IEEE max, divide, multiply, round to
 * even), so both builds quantize x to the same bytes */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void quantize_block_avx512(const float* v, int8_t* q, float* d, int32_t* s) {
    __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
    __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qb));
    *d = dd;
    *s = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

static void quantize_x(int avx512, const float* x, long ldx, long m, long k, xquant xq) {
    long nb = k / QK;
    for (long i = 0; i < m; i++)
        for (long b = 0; b < nb; b++) {
            long o = i * nb + b;
            if (avx512) quantize_block_avx512(x + i * ldx + b * QK, xq.q + i * k + b * QK,
                                              xq.d + o, xq.s + o);
            else quantize_block_scalar(x + i * ldx + b * QK, xq.q + i * k + b * QK,
                                       xq.d + o, xq.s + o);
            xq.m[o] = xq.d[o] * (float)xq.s[o];
        }
}

static inline int32_t load4(const int8_t* p) { int32_t v; memcpy(&v, p, 4); return v; }

/* Software prefetch PF_DIST bytes ahead of the stream: a group is read as one sweep of
 * `step` bytes per block (its quantized weights, then its scales), and a decode step's
 * weights (~100 MB for the default model) come from the shared L3 or DRAM. With the dot
 * products' work in the loop, the out-of-order window holds only a few blocks' loads, and
 * the hardware prefetcher alone leaves one core at about 60% of the rate of a loop that
 * only loads the same bytes. 16 KiB ahead (about 1 us of the loop) covers the latency,
 * into L2 (prefetcht1: at one thread 7 to 9% faster than into L1, whose fill buffers the
 * demand loads then keep; 8 KiB ahead or 32 KiB were slower); past the end of a call's
 * weight it reads into the next weight of the arena (the gguf method packs them in the
 * order a step reads them).
 * __builtin_prefetch, not _mm_prefetch: GCC 12 dropped _mm_prefetch from these
 * target("avx512...") loops (no prefetch instruction in the library;
 * tests/unit/test_cpu_qgemv_stream.py checks the built library has them). */
#define PF_DIST 16384
static inline void prefetch_block(const uint8_t* g, long b, long step) {
    for (long o = 0; o < step; o += 64) __builtin_prefetch(g + b * step + PF_DIST + o, 0, 2);
}

/* Bytes of one block's slice of a group (quantized weights and scales). */
static inline long block_step(int type) { return quant_bytes(type) + 2 * GR * (type == Q4_1 ? 2 : 1); }

/* ---- AVX-512 VNNI: one group (16 rows) against MM rows of x -> out[i][16] ---- */
#define VNNI "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"

__attribute__((target(VNNI), always_inline))
static inline void group_vnni(const int type, const int MM, const uint8_t* g, long nb, long k,
                              const int8_t* xq, const float* xd, const int32_t* xs,
                              const float* xm, __m512* out) {
    const long qb = quant_bytes(type);
    const uint8_t *Q = g, *D = g + nb * qb, *M = D + nb * 2 * GR;
    const int corr = type == Q8_0 ? 128 : type == Q4_0 ? 8 : 0;
    const __m512i lo = _mm512_set1_epi8(0x0f), hi = _mm512_set1_epi8((char)0xf0);
    __m512 acc[MR], macc[MR];
    for (int i = 0; i < MM; i++) { acc[i] = _mm512_setzero_ps(); macc[i] = _mm512_setzero_ps(); }
    for (long b = 0; b < nb; b++) {
        prefetch_block(g, b, block_step(type));
        /* Q4 types: w[t] the low nibbles, w[t + 4] the high ones kept in place (16 times
         * the weight: vpdpbusd does not saturate, and the block's sum of those products
         * shifted right by 4 is exact), one port-0 shift per block instead of four */
        __m512i w[8];
        if (type == Q8_0) {
            for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512(Q + b * qb + 64 * j);
        } else {
            for (int t = 0; t < 4; t++) {
                __m512i v = _mm512_loadu_si512(Q + b * qb + 64 * t);
                w[t] = _mm512_and_si512(v, lo);
                w[t + 4] = _mm512_and_si512(v, hi);
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(D + b * 2 * GR)));
        for (int i = 0; i < MM; i++) {
            const int8_t* xb = xq + i * k + b * QK;
            long o = i * nb + b;
            __m512i s0 = corr ? _mm512_set1_epi32(-corr * xs[o]) : _mm512_setzero_si512();
            __m512i s1 = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(load4(xb + 4 * j)));
                s1 = _mm512_dpbusd_epi32(s1, w[j + 4], _mm512_set1_epi32(load4(xb + 4 * j + 16)));
            }
            if (type != Q8_0) s1 = _mm512_srai_epi32(s1, 4);
            __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[i] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, _mm512_set1_ps(xd[o])), acc[i]);
            if (type == Q4_1) {
                __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(M + b * 2 * GR)));
                macc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xm[o]), macc[i]);
            }
        }
    }
    for (int i = 0; i < MM; i++) out[i] = _mm512_add_ps(acc[i], macc[i]);
}

__attribute__((target(VNNI)))
static void groups_vnni(int type, const uint8_t* w, long gbytes, long g0, long g1, xquant xq,
                        const float* bias, float* y, long ldy, long m, long n, long k) {
    long nb = k / QK;
    for (long g = g0; g < g1; g++) {
        const uint8_t* grp = w + g * gbytes;
        long r0 = g * GR, rows = n - r0 < GR ? n - r0 : GR;
        __mmask16 mask = (__mmask16)((1u << rows) - 1);
        __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + r0) : _mm512_setzero_ps();
        for (long i0 = 0; i0 < m; i0 += MR) {
            int mm = m - i0 < MR ? (int)(m - i0) : MR;
            const int8_t* q = xq.q + i0 * k;
            const float *d = xq.d + i0 * nb, *xm = xq.m + i0 * nb;
            const int32_t* s = xq.s + i0 * nb;
            __m512 out[MR];
#define CASE(T, MM) case MM: group_vnni(T, MM, grp, nb, k, q, d, s, xm, out); break;
#define TYPE(T) switch (mm) { CASE(T, 1) CASE(T, 2) CASE(T, 3) CASE(T, 4) } break;
            switch (type) { case Q8_0: TYPE(Q8_0) case Q4_0: TYPE(Q4_0) default: TYPE(Q4_1) }
#undef TYPE
#undef CASE
            for (int i = 0; i < mm; i++)
                _mm512_mask_storeu_ps(y + (i0 + i) * ldy + r0, mask, _mm512_add_ps(out[i], bv));
        }
    }
}

/* ---- AVX2: the same layout as two halves of 8 rows (32 bytes of each 64) ---- */
#define AVX2 "avx2,fma,f16c"

__attribute__((target(AVX2), always_inline))
static inline void half_avx2(const int type, const int MM, const uint8_t* g, long nb, long k,
                             int h, const int8_t* xq, const float* xd, const int32_t* xs,
                             const float* xm, __m256* out) {
    const long qb = quant_bytes(type);
    const uint8_t *Q = g + 32 * h, *D = g + nb * qb + 16 * h, *M = D + nb * 2 * GR;
    const int corr = type == Q4_0 ? 8 : 0; /* Q8_0 takes signed weights here */
    const __m256i lo = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR], macc[MR];
    for (int i = 0; i < MM; i++) { acc[i] = _mm256_setzero_ps(); macc[i] = _mm256_setzero_ps(); }
    for (long b = 0; b < nb; b++) {
        if (h == 0) prefetch_block(g, b, block_step(type)); /* the second half hits the cache */
        __m256i w[8];
        if (type == Q8_0) {
            for (int j = 0; j < 8; j++)
                w[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(Q + b * qb + 64 * j)),
                                        flip);
        } else {
            for (int t = 0; t < 4; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i*)(Q + b * qb + 64 * t));
                w[t] = _mm256_and_si256(v, lo);
                w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
            }
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(D + b * 2 * GR)));
        for (int i = 0; i < MM; i++) {
            const int8_t* xb = xq + i * k + b * QK;
            long o = i * nb + b;
            __m256i s = corr ? _mm256_set1_epi32(-corr * xs[o]) : _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                __m256i xv = _mm256_set1_epi32(load4(xb + 4 * j)), u = w[j];
                if (type == Q8_0) { xv = _mm256_sign_epi8(xv, w[j]); u = _mm256_sign_epi8(w[j], w[j]); }
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), ones));
            }
            __m256 p = _mm256_cvtepi32_ps(s);
            acc[i] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_set1_ps(xd[o])), acc[i]);
            if (type == Q4_1) {
                __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(M + b * 2 * GR)));
                macc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xm[o]), macc[i]);
            }
        }
    }
    for (int i = 0; i < MM; i++) out[i] = _mm256_add_ps(acc[i], macc[i]);
}

__attribute__((target(AVX2)))
static void groups_avx2(int type, const uint8_t* w, long gbytes, long g0, long g1, xquant xq,
                        const float* bias, float* y, long ldy, long m, long n, long k) {
    long nb = k / QK;
    for (long g = g0; g < g1; g++) {
        const uint8_t* grp = w + g * gbytes;
        for (int h = 0; h < 2; h++) {
            long r0 = g * GR + 8 * h, rows = n - r0 < 8 ? n - r0 : 8;
            if (rows <= 0) break;
            for (long i0 = 0; i0 < m; i0 += MR) {
                int mm = m - i0 < MR ? (int)(m - i0) : MR;
                const int8_t* q = xq.q + i0 * k;
                const float *d = xq.d + i0 * nb, *xm = xq.m + i0 * nb;
                const int32_t* s = xq.s + i0 * nb;
                __m256 out[MR];
#define CASE(T, MM) case MM: half_avx2(T, MM, grp, nb, k, h, q, d, s, xm, out); break;
#define TYPE(T) switch (mm) { CASE(T, 1) CASE(T, 2) CASE(T, 3) CASE(T, 4) } break;
                switch (type) { case Q8_0: TYPE(Q8_0) case Q4_0: TYPE(Q4_0) default: TYPE(Q4_1) }
#undef TYPE
#undef CASE
                for (int i = 0; i < mm; i++) {
                    float v[8];
                    _mm256_storeu_ps(v, out[i]);
                    for (long r = 0; r < rows; r++)
                        y[(i0 + i) * ldy + r0 + r] = v[r] + (bias ? bias[r0 + r] : 0.0f);
                }
            }
        }
    }
}

typedef void (*groups_fn)(int, const uint8_t*, long, long, long, xquant, const float*, float*,
                          long, long, long, long);

#include "qgemv_k.c"  /* Q4_K, Q6_K: kgroups_avx2, kgroups_vnni, quantize_x_k, ... */

/* ---- the thread pool: helpers that claim chunks of groups, the caller never waits on
 * a helper that has not started ----
 * An OpenMP team splits the groups statically and joins at a barrier: on a shared host
 * a helper that the OS has not scheduled yet stalls the caller for its time slice
 * (milliseconds, against ~70 us per GEMV). Here the caller publishes a job (the
 * generation `gen` and the next group to claim, packed in `state`), wakes the helpers
 * and claims chunks itself; each helper claims chunks with a compare-and-swap that also checks the
 * generation, so a helper that wakes late claims nothing of a finished job. The caller
 * then waits only for the chunks helpers claimed and are running. Each chunk is whole
 * groups (16 rows) computed as in one thread, so results do not depend on who runs it.
 * Helpers spin for SPIN_NS after a job (GEMVs of a step come tens of microseconds
 * apart), then sleep on a futex. */
#define POOL_MAX 64
#define SPIN_NS 200000L
#define LATE_NS 200000L /* a wait on helpers that counts as falling behind */

typedef struct {
    groups_fn fn; int type; const uint8_t* w; long gbytes; xquant xq; const float* bias;
    float* y; long ldy, m, n, k, groups; int helpers;
} job_t;

static job_t job;
static _Atomic uint64_t state;        /* gen << 32 | next group to claim */
static _Atomic uint32_t gen;          /* futex word: the newest job's generation */
static _Atomic long done;             /* groups of the current job finished */
static _Atomic int sleepers;
static int started;                   /* helpers running (guarded by pool_lock) */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claim and run chunks of job j (generation g) until none is left: guided sizes, each
 * claim takes 1 / (2 * threads) of the groups left (at least MIN_CHUNK), so the first
 * chunks are long sequential streams and the last ones short, for balance. */
#define MIN_CHUNK 2
static long run_chunks(uint32_t g, const job_t* j) {
    uint64_t s = atomic_load(&state);
    for (long ran = 0;; ) {
        long next = (long)(uint32_t)s;
        if ((uint32_t)(s >> 32) != g || next >= j->groups) return ran;
        long size = (j->groups - next) / (2L * (j->helpers + 1));
        long end = next + (size > MIN_CHUNK ? size : MIN_CHUNK);
        if (end > j->groups) end = j->groups;
        if (!atomic_compare_exchange_weak(&state, &s, ((uint64_t)g << 32) | (uint64_t)end))
            continue;
        j->fn(j->type, j->w, j->gbytes, next, end, j->xq, j->bias, j->y, j->ldy, j->m, j->n,
              j->k);
        atomic_fetch_add(&done, end - next);
        ran += end - next;
        s = atomic_load(&state);
    }
}

static void* helper(void* arg) {
    int id = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&gen);
    for (;;) {
        uint32_t g;
        long t0 = now_ns();
        for (int spins = 0; (g = atomic_load(&gen)) == seen; spins++) {
            _mm_pause();
            if ((spins & 63) == 63 && now_ns() - t0 > SPIN_NS) {
                atomic_fetch_add(&sleepers, 1);
                syscall(SYS_futex, &gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&sleepers, 1);
                t0 = now_ns();
            }
        }
        seen = g;
        /* a copy torn by the caller writing the next job claims nothing: the caller
         * closes a finished job's state before writing the next one, and the state is
         * read after the copy (x86 keeps loads in order; the barrier keeps the compiler
         * from moving the copy past it) */
        job_t j = job;
        __asm__ volatile("" ::: "memory");
        if (id < j.helpers) run_chunks(g, &j);
    }
    return NULL;
}

static void forget_pool(void) { started = 0; } /* a forked child has no helpers */

/* Helpers to have running: start them on first use (false: run on the caller only). */
static int ensure_helpers(int want) {
    static int atfork;
    if (want > POOL_MAX) want = POOL_MAX;
    if (!atfork) { pthread_atfork(NULL, NULL, forget_pool); atfork = 1; }
    while (started < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int err = pthread_create(&t, &attr, helper, (void*)(intptr_t)started);
        pthread_attr_destroy(&attr);
        if (err) break;
        started++;
    }
    return started < want ? started : want;
}

/* Back-off: when helpers fell behind (see run_groups), the next `solo` calls run on the
 * caller alone (the helpers then sleep); the count doubles on each such call (up to
 * SOLO_MAX calls, a few steps of a small model) and halves after SOLO_MIN calls in a row
 * where the helpers kept up, so a busy host costs about the single-thread time and a
 * free one gets every thread. */
#define SOLO_MIN 32
#define SOLO_MAX 8192
static int solo_left, solo = SOLO_MIN, kept_up; /* guarded by pool_lock */

static void run_groups(groups_fn fn, int type, const uint8_t* w, long gbytes, long groups,
                       xquant xq, const float* bias, float* y, long ldy, long m, long n,
                       long k, int threads) {
    /* one caller at a time owns the pool; a concurrent caller runs alone */
    if (threads <= 1 || groups < 2 || pthread_mutex_trylock(&pool_lock) != 0) {
        fn(type, w, gbytes, 0, groups, xq, bias, y, ldy, m, n, k);
        return;
    }
    if (solo_left > 0) {
        solo_left--;
        pthread_mutex_unlock(&pool_lock);
        fn(type, w, gbytes, 0, groups, xq, bias, y, ldy, m, n, k);
        return;
    }
    int helpers = ensure_helpers(threads - 1);
    job = (job_t){fn, type, w, gbytes, xq, bias, y, ldy, m, n, k, groups, helpers};
    atomic_store(&done, 0);
    uint32_t g = atomic_load(&gen) + 1;
    long t0 = now_ns();
    atomic_store(&state, (uint64_t)g << 32);
    atomic_store(&gen, g);
    int woke = atomic_load(&sleepers) > 0;
    if (woke) syscall(SYS_futex, &gen, FUTEX_WAKE_PRIVATE, helpers, NULL, NULL, 0);
    long ran = run_chunks(g, &job);
    long t1 = now_ns();
    /* chunks helpers are running; yield the core after a while, in case the helper
     * waits for it (fewer free cores than threads) */
    for (long spins = 0; atomic_load(&done) < groups; spins++) {
        _mm_pause();
        if (spins > 20000) sched_yield();
    }
    long waited = now_ns() - t1;
    atomic_store(&state, ((uint64_t)g << 32) | UINT32_MAX); /* closed: nothing to claim */
    /* helpers fell behind: one held the caller up, or none ran at all though one was
     * awake (spinning for a job, it takes CPU time from the caller on a host without a
     * free core); a helper just woken from its sleep may well miss a short job */
    if ((waited > t1 - t0 && waited > LATE_NS) || (ran == groups && !woke)) {
        solo_left = solo;
        solo = solo * 2 < SOLO_MAX ? solo * 2 : SOLO_MAX;
        kept_up = 0;
    } else if (++kept_up >= SOLO_MIN && solo > SOLO_MIN) {
        solo /= 2;
        kept_up = 0;
    }
    pthread_mutex_unlock(&pool_lock);
}

/* ---- prologues: the layer's input transform, folded into the activation quantization
 * (lmkit_qgemv_pro_*): PRO_ADD_RMS_NORM computes, per row, h = x + res (x alone without
 * res; h written to res_out when given) and rms_norm(h) * nw exactly as rms_norm.c's
 * lmkit_add_rms_norm does (the same code, built with the same flags, so bit-identical),
 * then quantizes that row; the float row never leaves the scratch. ---- */
enum { PRO_NONE = 0, PRO_SILU_MUL = 1, PRO_ADD_RMS_NORM = 2 };
typedef struct { int kind; const float* res; long ldr; const float* nw; float eps;
                 float* res_out; long ldo; void* exp16; } prologue_t;

/* PRO_SILU_MUL: each row of x holds gate [k] then up [k]; the row quantized is
 * silu(gate) * up computed as torch's vectorized CPU silu computes it, gate / (1 +
 * exp(-gate)) with Sleef's 16-lane expf (1 ulp, `exp16`: the Sleef_expf16_u10 that
 * torch's AVX-512 build runs, its address passed in), then the product: bit for bit
 * torch's F.silu(gate) * up when torch runs its AVX-512 kernels and k % 16 == 0. */
typedef __m512 (*exp16_fn)(__m512);
__attribute__((target("avx512f")))
static void silu_mul_row(void* exp16, const float* g, const float* u, float* o, long k) {
    exp16_fn ex = (exp16_fn)exp16;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (long i = 0; i < k; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, ex(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
}

#include "sum_squares.h"  /* sum_squares(): one reduction for both norms */

static void add_rms_norm_row(const float* x, const prologue_t* p, long r, long n, float* o) {
    const float* h = x;
    if (p->res) {
        float* hr = p->res_out + r * p->ldo;
        const float* rr = p->res + r * p->ldr;
        #pragma omp simd
        for (long i = 0; i < n; i++) hr[i] = x[i] + rr[i];
        h = hr;
    }
    float inv = 1.0f / sqrtf(sum_squares(h, n) / (float)n + p->eps);
    #pragma omp simd
    for (long i = 0; i < n; i++) o[i] = p->nw[i] * (h[i] * inv);
}

/* per-thread scratch for the quantized activations (and a prologue's float rows), grown
 * as needed (no allocation per call once warm; the Python thread that calls is the only
 * user of its buffer) */
static __thread void* scratch;
static __thread size_t scratch_size;

static int qgemv(groups_fn fn, int avx512, int type, const prologue_t* pro, const float* x,
                 long ldx, const uint8_t* w, const float* bias, float* y, long ldy, long m,
                 long n, long k, int threads) {
    long nb = k / QK;
    size_t rows = pro->kind != PRO_NONE ? (size_t)(m * k) * 4 + 64 : 0;
    size_t need = (size_t)(m * k) + (size_t)(m * nb) * 12 + 64 + rows;
    if (need > scratch_size) {
        free(scratch);
        scratch = malloc(need);
        scratch_size = scratch ? need : 0;
        if (!scratch) return 1;
    }
    float* f = (float*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    xquant xq = {(int8_t*)(f + 3 * m * nb), f, (int32_t*)(f + m * nb), f + 2 * m * nb};
    if (pro->kind != PRO_NONE) {
        float* h = (float*)(((uintptr_t)(xq.q + m * k) + 63) & ~(uintptr_t)63);
        for (long r = 0; r < m; r++) {
            if (pro->kind == PRO_ADD_RMS_NORM) add_rms_norm_row(x + r * ldx, pro, r, k, h + r * k);
            else silu_mul_row(pro->exp16, x + r * ldx, x + r * ldx + k, h + r * k, k);
        }
        x = h;
        ldx = k;
    }
    if (is_kquant(type)) { /* Q8_K activations in the same scratch (fewer bytes) */
        quantize_x_k(x, ldx, m, k, xq);
        fn = avx512 ? kgroups_vnni : kgroups_avx2;
    } else {
        quantize_x(avx512, x, ldx, m, k, xq);
    }
    long groups = (n + GR - 1) / GR, gbytes = lmkit_qpack_group_bytes(type, k);
    run_groups(fn, type, w, gbytes, groups, xq, bias, y, ldy, m, n, k, threads);
    return 0;
}

/* Entry points over packed weights: 0 on success, 1 when out of memory. k must be a
 * multiple of 32; y [m, n] rows ldy floats apart. */
static const prologue_t no_prologue = {PRO_NONE, NULL, 0, NULL, 0.0f, NULL, 0, NULL};

int lmkit_qgemv_avx512vnni(int type, const float* x, long ldx, const uint8_t* w,
                           const float* b, float* y, long ldy, long m, long n, long k,
                           int threads) {
    return qgemv(groups_vnni, 1, type, &no_prologue, x, ldx, w, b, y, ldy, m, n, k, threads);
}

int lmkit_qgemv_avx2(int type, const float* x, long ldx, const uint8_t* w, const float* b,
                     float* y, long ldy, long m, long n, long k, int threads) {
    return qgemv(groups_avx2, 0, type, &no_prologue, x, ldx, w, b, y, ldy, m, n, k, threads);
}

/* The same with a residual add + RMSNorm folded in (see prologue_t): res (rows ldr
 * apart, or NULL), norm weight nw [k], res_out [m, k] rows ldo apart (x + res). */
int lmkit_qgemv_norm_avx512vnni(int type, const float* x, long ldx, const float* res,
                                long ldr, const float* nw, float eps, float* res_out,
                                long ldo, const uint8_t* w, const float* b, float* y,
                                long ldy, long m, long n, long k, int threads) {
    prologue_t p = {PRO_ADD_RMS_NORM, res, ldr, nw, eps, res_out, ldo, NULL};
    return qgemv(groups_vnni, 1, type, &p, x, ldx, w, b, y, ldy, m, n, k, threads);
}

int lmkit_qgemv_norm_avx2(int type, const float* x, long ldx, const float* res, long ldr,
                          const float* nw, float eps, float* res_out, long ldo,
                          const uint8_t* w, const float* b, float* y, long ldy, long m,
                          long n, long k, int threads) {
    prologue_t p = {PRO_ADD_RMS_NORM, res, ldr, nw, eps, res_out, ldo, NULL};
    return qgemv(groups_avx2, 0, type, &p, x, ldx, w, b, y, ldy, m, n, k, threads);
}

/* The same with SiLU-and-multiply folded in (PRO_SILU_MUL): x rows hold gate then up
 * (2k floats used of each ldx), exp16 is Sleef_expf16_u10; AVX-512 build only. */
int lmkit_qgemv_silu_avx512vnni(int type, void* exp16, const float* x, long ldx,
                                const uint8_t* w, const float* b, float* y, long ldy,
                                long m, long n, long k, int threads) {
    prologue_t p = {PRO_SILU_MUL, NULL, 0, NULL, 0.0f, NULL, 0, exp16};
    return qgemv(groups_vnni, 1, type, &p, x, ldx, w, b, y, ldy, m, n, k, threads);
}

/* One block's 32 weights as floats, from a GGUF block or from row r of a packed group. */
static void gguf_block(int type, const uint8_t* blk, float* o) {
    float d = fp16(blk);
    if (type == Q8_0) {
        for (int j = 0; j < QK; j++) o[j] = d * (float)(int8_t)blk[2 + j];
        return;
    }
    float c = type == Q4_1 ? fp16(blk + 2) : -8.0f * d;
    const uint8_t* qs = blk + (type == Q4_1 ? 4 : 2);
    for (int j = 0; j < QK / 2; j++) {
        o[j] = d * (float)(qs[j] & 0x0f) + c;
        o[j + QK / 2] = d * (float)(qs[j] >> 4) + c;
    }
}

static void packed_block(int type, const uint8_t* g, long nb, long b, long r, float* o) {
    long qb = quant_bytes(type);
    const uint8_t *q = g + b * qb + 4 * r, *dp = g + nb * qb + b * 2 * GR + 2 * r;
    float d = fp16(dp);
    if (type == Q8_0) {
        for (int j = 0; j < QK; j++) o[j] = d * (float)(int8_t)(q[64 * (j / 4) + j % 4] ^ 0x80);
        return;
    }
    float c = type == Q4_1 ? fp16(dp + nb * 2 * GR) : -8.0f * d;
    for (int j = 0; j < QK / 2; j++) {
        uint8_t byte = q[64 * (j / 4) + j % 4];
        o[j] = d * (float)(byte & 0x0f) + c;
        o[j + QK / 2] = d * (float)(byte >> 4) + c;
    }
}

/* Weight rows idx[0..count) (rows 0..count when idx is NULL) as float32 out [count, k]
 * (rows `ldo` floats apart), from GGUF rows (`packed` 0: w [rows, ldw bytes]) or packed
 * groups (`packed` 1: w as lmkit_qpack wrote it, ldw unused). Scalar C: it runs once per
 * call on large batches (or per embedding lookup). */
void lmkit_dequantize_rows(int type, int packed, const uint8_t* w, long ldw, const long* idx,
                           long count, long k, float* out, long ldo, int threads) {
    if (is_kquant(type)) {
        kdequantize_rows(type, packed, w, ldw, idx, count, k, out, ldo, threads);
        return;
    }
    long nb = k / QK, gbytes = lmkit_qpack_group_bytes(type, k);
    int bytes = lmkit_qgemv_block_bytes(type);
    if (threads > count) threads = (int)count;
    if (threads < 1) threads = 1;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (long i = 0; i < count; i++) {
        long row = idx ? idx[i] : i;
        for (long b = 0; b < nb; b++) {
            if (packed) packed_block(type, w + row / GR * gbytes, nb, b, row % GR, out + i * ldo + b * QK);
            else gguf_block(type, w + row * ldw + b * bytes, out + i * ldo + b * QK);
        }
    }
}
