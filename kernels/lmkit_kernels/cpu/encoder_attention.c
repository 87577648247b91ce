/* Bidirectional (encoder) attention over packed variable-length requests on the CPU,
 * in bfloat16 or float32: every query of request r sees every key of request r, the
 * rows cu_seqlens[r] .. cu_seqlens[r + 1] - 1. No padding and no gather: q, k and v
 * are read in place from their rows (any row stride, e.g. column slices of a fused QKV
 * projection's output; each row's heads contiguous), the output is written as
 * [num_tokens, num_heads, head_size], contiguous.
 *
 * Per (request, query head), in float32: the queries (scale folded in) and values are
 * converted to [len, head_size], the keys to [head_size, len16] (transposed, len16 =
 * len rounded up to 16, zeros after len); scores = q k^T in tiles of 4 queries x 16
 * keys, softmax with the maximum subtracted (a vectorised exp of about 1 ulp; keys
 * after len masked), out = p v in tiles of 4 queries x 16 head dims, divided by the
 * sum of p. The tiles are GCC vector types (one AVX-512 register, or two AVX2 ones
 * where the CPU has no AVX-512). Everything runs in a fixed order, so
 * a request's output depends neither on the rest of the batch nor on the thread count;
 * bfloat16 outputs are rounded to nearest even, as torch rounds. torch's CPU flash
 * attention needs the requests padded into a few [R, heads, max_len, head_size] calls
 * (gathers, padded keys, a kernel tuned for long sequences); for sentence-length
 * requests (all-MiniLM-L6-v2, 6 to 40 words) this kernel is several times faster.
 *
 * Built at run time by lmkit_kernels/cpu/build.py with -O3 -fopenmp.
 */
#pragma GCC diagnostic ignored "-Wpsabi" /* v16 helpers are always inlined */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

int lmkit_encoder_attention_abi(void) { return 1; }

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define INLINE static inline __attribute__((always_inline))
#define TILE 4 /* queries per register tile */

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

INLINE v16 splat(float x) { return (v16){0} + x; }

INLINE float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)x << 16};
    return c.f;
}

INLINE uint16_t f32_to_bf16(float x) { /* round to nearest even (finite x) */
    union { float f; uint32_t u; } c = {.f = x};
    return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}

/* Horizontal max and sum of 16 lanes in a fixed tree (16 -> 8 -> 4 -> 2 -> 1): a
 * dependency chain of 4, not 16. */
INLINE float hmax(v16 x) {
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; j++) x[j] = x[j + w] > x[j] ? x[j + w] : x[j];
    return x[0];
}

INLINE float hsum(v16 x) {
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; j++) x[j] += x[j + w];
    return x[0];
}

/* exp(x) for x <= 0 (softmax after subtracting the maximum; -inf gives 0): Cephes'
 * expf range reduction and polynomial (about 1 ulp), 0 below -87.3. */
INLINE v16 exp_nonpositive(v16 x) {
    v16i keep = x >= -87.3f;
    x = (v16)((v16i)x & keep); /* -inf and tiny: computed as exp(0), then zeroed */
    v16 t = x * 1.44269504088896341f;
    v16i ni = __builtin_convertvector(t - 0.5f, v16i); /* round(t) for t <= 0 */
    v16 n = __builtin_convertvector(ni, v16);
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16i scale = (ni + 127) << 23;
    return (v16)((v16i)(p * (v16)scale) & keep);
}

/* One (request, query head) in float32 scratch: qs [len, d] (scaled), kt [d, len16]
 * (zeros after len), vs [len, d], s [TILE, len16]; out rows (o, ldo floats apart) get
 * the result. d is a multiple of 16. */
CLONES static void attend(const float* qs, const float* kt, const float* vs, float* s,
                          long len, long d, float* o, long ldo) {
    long nb = (len + 15) / 16, len16 = nb * 16, db = d / 16;
    v16 pad = splat(0.0f); /* added to the last key block: -inf on keys after len */
    for (long j = len - (nb - 1) * 16; j < 16; j++) pad[j] = -INFINITY;
    for (long i0 = 0; i0 < len; i0 += TILE) {
        long m = len - i0 < TILE ? len - i0 : TILE;
        for (long b = 0; b < nb; b++) { /* scores: TILE queries x 16 keys */
            v16 acc[TILE] = {0};
            for (long e = 0; e < d; e++) {
                v16 kv = *(const v16*)(kt + e * len16 + b * 16);
                for (long t = 0; t < TILE; t++) /* (a last tile's spare rows: row i0) */
                    acc[t] += qs[(i0 + (t < m ? t : 0)) * d + e] * kv;
            }
            for (long t = 0; t < TILE; t++)
                *(v16*)(s + t * len16 + b * 16) = b == nb - 1 ? acc[t] + pad : acc[t];
        }
        float inv[TILE];
        for (long t = 0; t < TILE; t++) { /* softmax numerators and their sums */
            v16* row = (v16*)(s + t * len16);
            v16 mx = row[0];
            for (long b = 1; b < nb; b++) {
                v16i ge = mx >= row[b];
                mx = (v16)(((v16i)mx & ge) | ((v16i)row[b] & ~ge));
            }
            const float m1 = hmax(mx);
            v16 sum = splat(0.0f);
            for (long b = 0; b < nb; b++) {
                row[b] = exp_nonpositive(row[b] - m1);
                sum += row[b];
            }
            inv[t] = 1.0f / hsum(sum);
        }
        for (long c = 0; c < db; c++) { /* out: TILE queries x 16 head dims */
            v16 acc[TILE] = {0};
            for (long j = 0; j < len; j++) {
                v16 vv = *(const v16*)(vs + j * d + c * 16);
                for (long t = 0; t < TILE; t++) acc[t] += s[t * len16 + j] * vv;
            }
            for (long t = 0; t < m; t++) {
                v16 r = acc[t] * inv[t];
                __builtin_memcpy(o + (i0 + t) * ldo + c * 16, &r, sizeof r);
            }
        }
    }
}

/* One (request r's rows t0 .. t0 + len - 1, query head h over KV head kh): convert to
 * the float32 scratch (qs, kt, vs: len16 x d each; s: TILE x len16; o: len x d),
 * attend, write the rows of out back in T. */
#define DEFINE_HEAD(NAME, T, TO_F32, FROM_F32)                                           \
    CLONES static void NAME(const T* q, long ldq, const T* k, long ldk, const T* v,      \
                            long ldv, T* out, long num_heads, long d, float scale,       \
                            long t0, long len, long h, long kh, float* qs, float* kt,    \
                            float* vs, float* s, float* o) {                             \
        long l16 = (len + 15) / 16 * 16;                                                 \
        for (long j = 0; j < len; j++) {                                                 \
            const T* qr = q + (t0 + j) * ldq + h * d;                                    \
            const T* kr = k + (t0 + j) * ldk + kh * d;                                   \
            const T* vr = v + (t0 + j) * ldv + kh * d;                                   \
            for (long e = 0; e < d; e++) qs[j * d + e] = scale * TO_F32(qr[e]);          \
            for (long e = 0; e < d; e++) vs[j * d + e] = TO_F32(vr[e]);                  \
            for (long e = 0; e < d; e++) o[j * d + e] = TO_F32(kr[e]); /* keys, for now */ \
        }                                                                                \
        for (long e = 0; e < d; e++) {                                                   \
            for (long j = 0; j < len; j++) kt[e * l16 + j] = o[j * d + e];               \
            for (long j = len; j < l16; j++) kt[e * l16 + j] = 0.0f;                     \
        }                                                                                \
        attend(qs, kt, vs, s, len, d, o, d);                                             \
        for (long j = 0; j < len; j++) {                                                 \
            T* dst = out + ((t0 + j) * num_heads + h) * d;                               \
            for (long e = 0; e < d; e++) dst[e] = FROM_F32(o[j * d + e]);                \
        }                                                                                \
    }

INLINE float f32_id(float x) { return x; }

DEFINE_HEAD(head_f32, float, f32_id, f32_id)
DEFINE_HEAD(head_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Every request's queries over all of its keys. cu_seqlens: int64 [num_reqs + 1] row
 * offsets; q rows ldq elements apart ([num_heads, head_size] each), k and v rows ldk /
 * ldv apart ([num_kv_heads, head_size]); query head h reads KV head h / (num_heads /
 * num_kv_heads); head_size a multiple of 16. Returns 0, -1 when scratch memory cannot
 * be allocated, -2 for a head size that is not a multiple of 16. */
#define DEFINE_ENTRY(NAME, T, HEAD)                                                      \
    int NAME(const T* q, long ldq, const T* k, long ldk, const T* v, long ldv, T* out,   \
             const int64_t* cu_seqlens, long num_reqs, long num_heads, long num_kv_heads, \
             long head_size, float scale, int threads) {                                 \
        long d = head_size, max_len = 0, work = 0, group = num_heads / num_kv_heads;     \
        if (d % 16) return -2;                                                           \
        for (long r = 0; r < num_reqs; r++) {                                            \
            long len = (long)(cu_seqlens[r + 1] - cu_seqlens[r]);                        \
            if (len > max_len) max_len = len;                                            \
            work += len * len;                                                           \
        }                                                                                \
        /* below ~64K query-key pairs, waking threads costs more than it saves */        \
        if (work * num_heads < 65536 || num_reqs * num_heads < 2) threads = 1;           \
        if (threads < 1) threads = 1;                                                    \
        size_t len16 = (size_t)(max_len + 15) / 16 * 16;                                 \
        size_t per = 4 * len16 * (size_t)d + TILE * len16;                               \
        float* scratch = aligned_alloc(64, per * (size_t)threads * sizeof(float));       \
        if (!scratch) return -1;                                                         \
        _Pragma("omp parallel num_threads(threads) if (threads > 1)")                    \
        {                                                                                \
            float* qs = scratch + per * (size_t)omp_get_thread_num();                    \
            float* kt = qs + len16 * d;                                                  \
            float* vs = kt + len16 * d;                                                  \
            float* o = vs + len16 * d;                                                   \
            float* s = o + len16 * d;                                                    \
            _Pragma("omp for schedule(dynamic, 1)")                                      \
            for (long w = 0; w < num_reqs * num_heads; w++) {                            \
                long r = w / num_heads, h = w % num_heads;                               \
                long t0 = (long)cu_seqlens[r], len = (long)cu_seqlens[r + 1] - t0;       \
                if (len > 0)                                                             \
                    HEAD(q, ldq, k, ldk, v, ldv, out, num_heads, d, scale, t0, len, h,   \
                         h / group, qs, kt, vs, s, o);                                   \
            }                                                                            \
        }                                                                                \
        free(scratch);                                                                   \
        return 0;                                                                        \
    }

DEFINE_ENTRY(lmkit_encoder_attention_f32, float, head_f32)
DEFINE_ENTRY(lmkit_encoder_attention_bf16, uint16_t, head_bf16)
