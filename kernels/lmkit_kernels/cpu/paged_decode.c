/* Float32 decode attention over the paged KV cache on the CPU: one query token per
 * request, read straight from the cache's blocks (no gather), after storing the step's
 * new keys and values at their slots.
 *
 * Cache: [2, num_blocks, block_size, num_kv_heads, head_size] (keys, then values);
 * slot s is block s / block_size, offset s % block_size. Request r's query heads
 * [h * group, (h + 1) * group) read KV head h (GQA); it sees keys
 * [max(0, seq_len - window), seq_len) (window 0: all).
 *
 * Per (request, query head): scores = scale * q . k_j, softmax with the maximum
 * subtracted (a vectorised exp of about 1 ulp), out = sum_j p_j v_j / sum_j p_j, all
 * in float32 in a fixed order, so a request's output does not depend on the rest of
 * the batch or the thread count. Work is split
 * over requests across OpenMP threads when there is enough of it. On AVX-512 CPUs (head
 * size a multiple of 16, at most 128) attend_avx512() does the same with explicit
 * vectors (about 3x faster per key than the compiler's code for attend(); the last bits
 * of the sums differ from it, as the order differs).
 *
 * Built at run time by lmkit_kernels/cpu/build.py with -O3 -fopenmp.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int lmkit_paged_decode_abi(void) { return 1; }

/* Store token t's keys/values (rows of k and v ldk/ldv floats apart, [num_kv_heads,
 * head_size] each) at slot_mapping[t]. */
void lmkit_store_kv(const float* k, long ldk, const float* v, long ldv,
                    const int64_t* slot_mapping, long num_tokens, float* cache,
                    long num_slots, long kv_width) {
    float* vcache = cache + num_slots * kv_width;
    for (long t = 0; t < num_tokens; t++) {
        long slot = (long)slot_mapping[t];
        if (slot < 0) continue; /* padding tokens write nothing */
        memcpy(cache + slot * kv_width, k + t * ldk, kv_width * sizeof(float));
        memcpy(vcache + slot * kv_width, v + t * ldv, kv_width * sizeof(float));
    }
}

/* Each hot function is compiled for AVX-512, AVX2 and baseline x86-64 and picked when
 * the library loads (GCC target_clones), so the loops vectorise on any x86-64 CPU. */
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define INLINE static inline __attribute__((always_inline))

INLINE float dot(const float* a, const float* b, long n) {
    float s = 0.0f;
    #pragma omp simd reduction(+ : s)
    for (long i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* exp(x) for x <= 0 (softmax after subtracting the maximum), vectorisable: Cephes'
 * expf range reduction and polynomial (about 1 ulp), 0 below -87.3. */
INLINE float exp_nonpositive(float x) {
    float t = x * 1.44269504088896341f;
    float n = (float)(int)(t - 0.5f); /* round(t) for t <= 0 */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int i; float f; } scale = {.i = ((int)n + 127) << 23};
    return x < -87.3f ? 0.0f : p * scale.f;
}

/* The slot of key j and how many keys from j on (below end) follow it in its block. */
INLINE long run_of_slots(const int32_t* table, long j, long end, long block_size, long* run) {
    long off = j % block_size;
    *run = block_size - off < end - j ? block_size - off : end - j;
    return (long)table[j / block_size] * block_size + off;
}

/* One request: all its query heads over keys [start, end); scores is num_heads *
 * (end - start) floats. Keys and values are read in cache order, each slot's row (all
 * KV heads) once, so every block is one sequential read. */
CLONES
static void attend(const float* q, float* out, const float* kcache, const float* vcache,
                   const int32_t* table, long start, long end, long num_heads,
                   long num_kv_heads, long head_size, long block_size, float scale,
                   float* scores) {
    long kv_width = num_kv_heads * head_size, len = end - start;
    long group = num_heads / num_kv_heads;
    memset(out, 0, num_heads * head_size * sizeof(float));
    if (len <= 0) return; /* no keys (not a decode step): zeros, not NaN */
    for (long j = start; j < end; ) {
        long run, slot = run_of_slots(table, j, end, block_size, &run);
        const float* kr = kcache + slot * kv_width;
        for (long t = j - start, stop = t + run; t < stop; t++, kr += kv_width)
            for (long kh = 0, h = 0; kh < num_kv_heads; kh++)
                for (long g = 0; g < group; g++, h++)
                    scores[h * len + t] = scale * dot(q + h * head_size, kr + kh * head_size, head_size);
        j += run;
    }
    float inv[num_heads];
    for (long h = 0; h < num_heads; h++) {
        float* sh = scores + h * len;
        float mx = -INFINITY, denom = 0.0f;
        for (long j = 0; j < len; j++) mx = sh[j] > mx ? sh[j] : mx;
        #pragma omp simd reduction(+ : denom)
        for (long j = 0; j < len; j++) {
            sh[j] = exp_nonpositive(sh[j] - mx);
            denom += sh[j];
        }
        inv[h] = 1.0f / denom;
    }
    for (long j = start; j < end; ) {
        long run, slot = run_of_slots(table, j, end, block_size, &run);
        const float* vr = vcache + slot * kv_width;
        for (long t = j - start, stop = t + run; t < stop; t++, vr += kv_width)
            for (long kh = 0, h = 0; kh < num_kv_heads; kh++) {
                const float* vh = vr + kh * head_size;
                for (long g = 0; g < group; g++, h++) {
                    float p = scores[h * len + t];
                    float* oh = out + h * head_size;
                    #pragma omp simd
                    for (long i = 0; i < head_size; i++) oh[i] += p * vh[i];
                }
            }
        j += run;
    }
    for (long h = 0; h < num_heads; h++) {
        float* oh = out + h * head_size;
        #pragma omp simd
        for (long i = 0; i < head_size; i++) oh[i] *= inv[h];
    }
}

/* ---- AVX-512, head_size a multiple of 16 up to 128: the same three passes with the
 * dot products of 16 keys reduced together (one transpose-and-add tree instead of a
 * horizontal sum per key), the exponentials 16 at a time and each head's output in
 * registers; about 10x less work per key than what the compiler makes of attend(). The
 * sums run in another order than attend()'s (float32 rounding differs in the last bits),
 * the same order for every request, batch and thread count. ---- */
#define AVX512 __attribute__((target("avx512f")))
#define MAX_NV 8 /* head_size / 16 */

/* lane t of the result = the sum of v[t]'s 16 lanes */
AVX512 static inline __m512 sum16(__m512* v) {
    __m512 w[8], u[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                               _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                               _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88),
                         _mm512_shuffle_f32x4(s01, s23, 0xdd));
}

/* exp_nonpositive() on 16 lanes (the same reduction and polynomial) */
AVX512 static inline __m512 exp16_nonpositive(__m512 x) {
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512i ni = _mm512_cvttps_epi32(_mm512_sub_ps(t, _mm512_set1_ps(0.5f)));
    __m512 n = _mm512_cvtepi32_ps(ni);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                               _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23));
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
    return _mm512_maskz_mul_ps(live, p, scale);
}

/* One query head h of attend_avx512(): NV = head_size / 16, a constant in each copy, so
 * that q, the 16 dot products and the output stay in registers. */
AVX512 static inline __attribute__((always_inline)) void head_avx512(
        const int NV, const float* qh, float* oh, const float* kcache, const float* vcache,
        const long* slots, long len, float scale, float* sh) {
    __m512 qv[MAX_NV];
    for (int i = 0; i < NV; i++) qv[i] = _mm512_loadu_ps(qh + 16 * i);
    /* scores: 16 keys at a time (a short last tile adds zero vectors) */
    for (long t0 = 0; t0 < len; t0 += 16) {
        long count = len - t0 < 16 ? len - t0 : 16;
        __m512 acc[16];
        for (long t = 0; t < 16; t++) {
            acc[t] = _mm512_setzero_ps();
            if (t >= count) continue;
            const float* kr = kcache + slots[t0 + t];
            for (int i = 0; i < NV; i++)
                acc[t] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kr + 16 * i), acc[t]);
        }
        __m512 sc = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(sh + t0, (__mmask16)((1u << count) - 1), sc);
    }
    /* softmax: maximum, exponentials, their sum */
    __m512 mx = _mm512_set1_ps(-INFINITY);
    long t = 0;
    for (; t + 16 <= len; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sh + t));
    float m = _mm512_reduce_max_ps(mx);
    for (; t < len; t++) m = sh[t] > m ? sh[t] : m;
    __m512 den = _mm512_setzero_ps(), mv = _mm512_set1_ps(m);
    for (t = 0; t < len; t += 16) {
        __mmask16 k = len - t < 16 ? (__mmask16)((1u << (len - t)) - 1) : (__mmask16)0xffff;
        __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + t), mv));
        e = _mm512_maskz_mov_ps(k, e);
        _mm512_mask_storeu_ps(sh + t, k, e);
        den = _mm512_add_ps(den, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(den));
    /* output: sum_t p_t v_t, even and odd keys in two sets of registers (two chains of
     * dependent FMAs instead of one) */
    __m512 o0[MAX_NV], o1[MAX_NV];
    for (int i = 0; i < NV; i++) { o0[i] = _mm512_setzero_ps(); o1[i] = _mm512_setzero_ps(); }
    for (t = 0; t + 2 <= len; t += 2) {
        const float *v0 = vcache + slots[t], *v1 = vcache + slots[t + 1];
        __m512 p0 = _mm512_set1_ps(sh[t]), p1 = _mm512_set1_ps(sh[t + 1]);
        for (int i = 0; i < NV; i++) {
            o0[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * i), o0[i]);
            o1[i] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * i), o1[i]);
        }
    }
    if (t < len) {
        const float* v0 = vcache + slots[t];
        __m512 p0 = _mm512_set1_ps(sh[t]);
        for (int i = 0; i < NV; i++) o0[i] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * i), o0[i]);
    }
    for (int i = 0; i < NV; i++)
        _mm512_storeu_ps(oh + 16 * i, _mm512_mul_ps(_mm512_add_ps(o0[i], o1[i]), inv));
}

/* attend() for head_size % 16 == 0, head_size <= 16 * MAX_NV; slots: scratch for len
 * longs (each key's offset in the cache) */
AVX512 static void attend_avx512(const float* q, float* out, const float* kcache,
                                 const float* vcache, const int32_t* table, long start,
                                 long end, long num_heads, long num_kv_heads, long head_size,
                                 long block_size, float scale, float* scores, long* slots) {
    long kv_width = num_kv_heads * head_size, len = end - start;
    long group = num_heads / num_kv_heads;
    if (len <= 0) { memset(out, 0, num_heads * head_size * sizeof(float)); return; }
    for (long j = start, t = 0; j < end; ) { /* one division per block, not per key */
        long run, slot = run_of_slots(table, j, end, block_size, &run);
        for (long i = 0; i < run; i++) slots[t++] = (slot + i) * kv_width;
        j += run;
    }
    for (long h = 0; h < num_heads; h++) {
        const float *qh = q + h * head_size, *kc = kcache + h / group * head_size;
        const float* vc = vcache + h / group * head_size;
        float *oh = out + h * head_size, *sh = scores + h * len;
        switch (head_size / 16) {
#define NV_CASE(N) case N: head_avx512(N, qh, oh, kc, vc, slots, len, scale, sh); break;
            NV_CASE(1) NV_CASE(2) NV_CASE(3) NV_CASE(4) NV_CASE(5) NV_CASE(6) NV_CASE(7)
            NV_CASE(8)
#undef NV_CASE
        }
    }
}

static int use_avx512(long head_size) {
    static int avx512 = -1; /* whether the CPU runs AVX-512F (a race writes the same) */
    if (avx512 < 0) {
        __builtin_cpu_init();
        avx512 = __builtin_cpu_supports("avx512f") ? 1 : 0;
    }
    return avx512 && head_size % 16 == 0 && head_size <= 16 * MAX_NV;
}

/* Request r of lmkit_paged_decode() (its arguments), with one thread's scratch. */
static void attend_request(int fast, long r, const float* q, long ldq, const float* cache,
                           const float* vcache, const int32_t* block_tables, long ldbt,
                           const int32_t* seq_lens, float* out, long num_heads,
                           long num_kv_heads, long head_size, long block_size, float scale,
                           long window, float* scores, long* slots) {
    long end = seq_lens[r];
    long start = window > 0 && end > window ? end - window : 0;
    if (fast)
        attend_avx512(q + r * ldq, out + r * num_heads * head_size, cache, vcache,
                      block_tables + r * ldbt, start, end, num_heads, num_kv_heads,
                      head_size, block_size, scale, scores, slots);
    else
        attend(q + r * ldq, out + r * num_heads * head_size, cache, vcache,
               block_tables + r * ldbt, start, end, num_heads, num_kv_heads, head_size,
               block_size, scale, scores);
}

/* out[r] = attention of q[r] (rows ldq floats apart, [num_heads, head_size]) over
 * request r's context; out rows are num_heads * head_size floats. Returns 0, or -1
 * when scratch memory cannot be allocated. */
int lmkit_paged_decode(const float* q, long ldq, const float* cache, long num_slots,
                       const int32_t* block_tables, long ldbt, const int32_t* seq_lens,
                       float* out, long num_reqs, long num_heads, long num_kv_heads,
                       long head_size, long block_size, float scale, long window,
                       int threads) {
    long kv_width = num_kv_heads * head_size;
    const float* vcache = cache + num_slots * kv_width;
    long max_len = 0, work = 0;
    for (long r = 0; r < num_reqs; r++) {
        if (seq_lens[r] > max_len) max_len = seq_lens[r];
        work += seq_lens[r];
    }
    /* below ~16K key reads per call, waking threads costs more than it saves */
    if (work * num_heads < 16384 || num_reqs < 2) threads = 1;
    if (threads < 1) threads = 1;
    size_t len_max = (size_t)(max_len > 0 ? max_len : 1);
    size_t num_scores = (size_t)num_heads * len_max;
    num_scores += num_scores & 1; /* the slots after them 8-byte aligned */
    size_t per_thread = num_scores + 2 * len_max; /* floats: scores, then longs: slots */
    float* scratch = malloc(per_thread * (size_t)threads * sizeof(float));
    if (!scratch) return -1;
    int fast = use_avx512(head_size);
#define REQUEST(r, scores) attend_request(fast, r, q, ldq, cache, vcache, block_tables, ldbt, \
        seq_lens, out, num_heads, num_kv_heads, head_size, block_size, scale, window, \
        scores, (long*)((scores) + num_scores))
    if (threads == 1) { /* no parallel region to enter and leave */
        for (long r = 0; r < num_reqs; r++) REQUEST(r, scratch);
    } else {
        #pragma omp parallel num_threads(threads)
        {
            float* scores = scratch + per_thread * (size_t)omp_get_thread_num();
            #pragma omp for schedule(dynamic, 1)
            for (long r = 0; r < num_reqs; r++) REQUEST(r, scores);
        }
    }
#undef REQUEST
    free(scratch);
    return 0;
}
