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
 * over (request, KV head) pairs across OpenMP threads when there is enough of it.
 *
 * Built at run time by lmkit_kernels/cpu/build.py with -O3 -fopenmp.
 */
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
    for (long j = start; j < end; j++) {
        long slot = (long)table[j / block_size] * block_size + j % block_size; /* per key */
        const float* kr = kcache + slot * kv_width;
        for (long kh = 0, h = 0; kh < num_kv_heads; kh++)
            for (long g = 0; g < group; g++, h++)
                scores[h * len + (j - start)] =
                    scale * dot(q + h * head_size, kr + kh * head_size, head_size);
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
    for (long j = start; j < end; j++) {
        long slot = (long)table[j / block_size] * block_size + j % block_size;
        const float* vr = vcache + slot * kv_width;
        for (long kh = 0, h = 0; kh < num_kv_heads; kh++) {
            const float* vh = vr + kh * head_size;
            for (long g = 0; g < group; g++, h++) {
                float p = scores[h * len + (j - start)];
                float* oh = out + h * head_size;
                #pragma omp simd
                for (long i = 0; i < head_size; i++) oh[i] += p * vh[i];
            }
        }
    }
    for (long h = 0; h < num_heads; h++) {
        float* oh = out + h * head_size;
        #pragma omp simd
        for (long i = 0; i < head_size; i++) oh[i] *= inv[h];
    }
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
    size_t per_thread = (size_t)num_heads * (size_t)(max_len > 0 ? max_len : 1);
    float* scratch = malloc(per_thread * (size_t)threads * sizeof(float));
    if (!scratch) return -1;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float* scores = scratch + per_thread * (size_t)omp_get_thread_num();
        #pragma omp for schedule(dynamic, 1)
        for (long r = 0; r < num_reqs; r++) {
            long end = seq_lens[r];
            long start = window > 0 && end > window ? end - window : 0;
            attend(q + r * ldq, out + r * num_heads * head_size, cache, vcache,
                   block_tables + r * ldbt, start, end, num_heads, num_kv_heads,
                   head_size, block_size, scale, scores);
        }
    }
    free(scratch);
    return 0;
}
