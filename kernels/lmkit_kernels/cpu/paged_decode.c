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
 * subtracted, out = sum_j p_j v_j, all in float32 in a fixed order, so a request's
 * output does not depend on the rest of the batch or the thread count. Work is split
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

static float dot(const float* a, const float* b, long n) {
    float acc[16] = {0};
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        #pragma omp simd
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    }
    for (; i < n; i++) acc[i % 16] += a[i] * b[i];
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

/* One (request, KV head): its `group` query heads over keys [start, end). */
static void attend(const float* q, float* out, const float* kcache, const float* vcache,
                   const int32_t* table, long start, long end, long kvh, long group,
                   long num_kv_heads, long head_size, long block_size, float scale,
                   float* scores) {
    long kv_width = num_kv_heads * head_size;
    if (end <= start) { /* no keys (not a decode step): zeros, not NaN */
        memset(out + kvh * group * head_size, 0, group * head_size * sizeof(float));
        return;
    }
    for (long g = 0; g < group; g++) {
        const float* qh = q + (kvh * group + g) * head_size;
        float* oh = out + (kvh * group + g) * head_size;
        float mx = -INFINITY;
        for (long j = start; j < end; j++) {
            long slot = (long)table[j / block_size] * block_size + j % block_size;
            float s = scale * dot(qh, kcache + slot * kv_width + kvh * head_size, head_size);
            scores[j - start] = s;
            if (s > mx) mx = s;
        }
        float denom = 0.0f;
        for (long j = 0; j < end - start; j++) {
            scores[j] = expf(scores[j] - mx);
            denom += scores[j];
        }
        for (long i = 0; i < head_size; i++) oh[i] = 0.0f;
        for (long j = start; j < end; j++) {
            long slot = (long)table[j / block_size] * block_size + j % block_size;
            const float* vr = vcache + slot * kv_width + kvh * head_size;
            float p = scores[j - start];
            #pragma omp simd
            for (long i = 0; i < head_size; i++) oh[i] += p * vr[i];
        }
        float inv = 1.0f / denom;
        #pragma omp simd
        for (long i = 0; i < head_size; i++) oh[i] *= inv;
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
    long group = num_heads / num_kv_heads, max_len = 0, work = 0;
    for (long r = 0; r < num_reqs; r++) {
        if (seq_lens[r] > max_len) max_len = seq_lens[r];
        work += seq_lens[r];
    }
    /* below ~16K key reads per call, waking threads costs more than it saves */
    if (work * num_heads < 16384) threads = 1;
    if (threads < 1) threads = 1;
    size_t per_thread = (size_t)(max_len > 0 ? max_len : 1);
    float* scratch = malloc(per_thread * (size_t)threads * sizeof(float));
    if (!scratch) return -1;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float* scores = scratch + per_thread * (size_t)omp_get_thread_num();
        #pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < num_reqs * num_kv_heads; task++) {
            long r = task / num_kv_heads, kvh = task % num_kv_heads;
            long end = seq_lens[r];
            long start = window > 0 && end > window ? end - window : 0;
            attend(q + r * ldq, out + r * num_heads * head_size, cache, vcache,
                   block_tables + r * ldbt, start, end, kvh, group, num_kv_heads,
                   head_size, block_size, scale, scores);
        }
    }
    free(scratch);
    return 0;
}
