/* K-quants (Q4_K, Q6_K) for qgemv.c: the GEMV over GGUF super-blocks of 256 weights,
 * their dequantization, and the activation quantization to Q8_K. Included by qgemv.c
 * (one library: the same entry points, prologues and thread pool serve every type).
 *
 * GGUF block layouts (ggml, QK_K = 256 weights per super-block, little-endian):
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, uint8 scales[12], uint8 qs[128]
 *     8 sub-blocks of 32 with 6-bit scale sc[j] and min mn[j] packed in scales (see
 *     q4k_scales); chunk c < 4 of qs (32 bytes) holds sub-block 2c in its low nibbles and
 *     2c + 1 in its high nibbles: w = d * sc[j] * nibble - dmin * mn[j].
 *   Q6_K (210 bytes): uint8 ql[128], uint8 qh[64], int8 scales[16], fp16 d
 *     half h < 2 covers weights 128h..128h+127 from ql[64h..], qh[32h..]: weight
 *     128h + 32t + l (t < 4, l < 32) is (ql nibble | 2 bits of qh[32h + l] << 4) - 32,
 *     the low nibble of ql[64h + l + 32 (t & 1)] for t < 2 and its high nibble for t >= 2,
 *     qh bits 2t..2t+1; w = d * scales[weight / 16] * q.
 *
 * The weights are not regrouped: a packed k-quant weight is the file's rows, GR of them
 * per group (the pool's unit of work), each group padded to 64 bytes. As llama.cpp does,
 * each row of x is quantized per 256 values to Q8_K (xd = max|x| / 127, xq =
 * round-to-even(x / xd), and the sums of each 16 xq), and a super-block's product is
 *   Q4_K: xd * (d * sum_j sc[j] * dot(nibbles_j, xq_j) - dmin * sum_j mn[j] * sum(xq_j))
 *   Q6_K: xd * d * sum_i scales[i] * (dot(q6u_i, xq_i) - 32 * sum(xq_i))   (q6u = q + 32)
 * with the integer dot products of unsigned weights and signed xq (vpmaddubsw, then
 * vpmaddwd by the sub-block scales: AVX2; vpdpwssd, AVX-512 VNNI).
 * Every output element is computed by one thread in a fixed order, and both builds
 * quantize x with the same C code, so results do not depend on m or the thread count.
 */
#define QK_K 256
enum { Q4_K = 12, Q6_K = 14 }; /* ggml type numbers */

static inline int is_kquant(int type) { return type == Q4_K || type == Q6_K; }
static inline int kblock_bytes(int type) { return type == Q4_K ? 144 : type == Q6_K ? 210 : 0; }
static inline long krow_bytes(int type, long k) { return k / QK_K * kblock_bytes(type); }
static long kgroup_bytes(int type, long k) {
    return (GR * krow_bytes(type, k) + 63) / 64 * 64;
}

/* GGUF rows w [n, ldw bytes] -> groups of GR rows (the same bytes, rows past n zero). */
static void kpack(int type, const uint8_t* w, long ldw, long n, long k, uint8_t* out) {
    long rb = krow_bytes(type, k), gbytes = kgroup_bytes(type, k);
    memset(out, 0, (size_t)((n + GR - 1) / GR * gbytes));
    for (long row = 0; row < n; row++)
        memcpy(out + row / GR * gbytes + row % GR * rb, w + row * ldw, (size_t)rb);
}

/* The 6-bit scales and mins of a Q4_K super-block (ggml's get_scale_min_k4). */
static inline void q4k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* One super-block's 256 weights as floats. */
static void kblock_dequant(int type, const uint8_t* blk, float* o) {
    if (type == Q4_K) {
        float d = fp16(blk), dmin = fp16(blk + 2);
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        const uint8_t* qs = blk + 16;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                uint8_t q = qs[32 * c + l];
                o[64 * c + l] = d * sc[2 * c] * (float)(q & 0x0f) - dmin * mn[2 * c];
                o[64 * c + 32 + l] = d * sc[2 * c + 1] * (float)(q >> 4) - dmin * mn[2 * c + 1];
            }
        return;
    }
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t* sc = (const int8_t*)(blk + 192);
    float d = fp16(blk + 208);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++) {
                uint8_t b = ql[64 * h + l + 32 * (t & 1)];
                int q = ((t < 2 ? b & 0x0f : b >> 4) | (((qh[32 * h + l] >> (2 * t)) & 3) << 4)) - 32;
                int pos = 128 * h + 32 * t + l;
                o[pos] = d * (float)sc[pos / 16] * (float)q;
            }
}

/* Rows of a k-quant weight as float32 (lmkit_dequantize_rows' k-quant half). */
static void kdequantize_rows(int type, int packed, const uint8_t* w, long ldw, const long* idx,
                             long count, long k, float* out, long ldo, int threads) {
    long nbk = k / QK_K, rb = krow_bytes(type, k), gbytes = kgroup_bytes(type, k);
    int bb = kblock_bytes(type);
    if (threads > count) threads = (int)count;
    if (threads < 1) threads = 1;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (long i = 0; i < count; i++) {
        long row = idx ? idx[i] : i;
        const uint8_t* r = packed ? w + row / GR * gbytes + row % GR * rb : w + row * ldw;
        for (long b = 0; b < nbk; b++) kblock_dequant(type, r + b * bb, out + i * ldo + b * QK_K);
    }
}

/* x rows [m, k] -> Q8_K: xq.q [m, k] int8, xq.d [m * k / 256] scales, and the sums of
 * each 16 values as int16 [m * k / 16] where xq.s points (|sum| <= 2032; plain C, the
 * same bytes in both builds). */
static void quantize_x_k(const float* x, long ldx, long m, long k, xquant xq) {
    long nbk = k / QK_K;
    for (long i = 0; i < m; i++)
        for (long b = 0; b < nbk; b++) {
            const float* v = x + i * ldx + b * QK_K;
            int8_t* q = xq.q + i * k + b * QK_K;
            float amax = 0.0f;
            for (int j = 0; j < QK_K; j++) amax = fmaxf(amax, fabsf(v[j]));
            float dd = amax / 127.0f, id = dd > 0.0f ? 1.0f / dd : 0.0f;
            for (int j = 0; j < QK_K; j++) q[j] = (int8_t)lrintf(v[j] * id);
            int16_t* s = (int16_t*)xq.s + (i * nbk + b) * 16;
            for (int j = 0; j < 16; j++) {
                int sum = 0;
                for (int l = 0; l < 16; l++) sum += q[16 * j + l];
                s[j] = (int16_t)sum;
            }
            xq.d[i * nbk + b] = dd;
        }
}

static inline void kprefetch(const uint8_t* blk, int bb) {
    for (int o = 0; o < bb; o += 64) __builtin_prefetch(blk + PF_DIST + o, 0, 2);
}

/* The 6-bit scales (bytes 0..7) and mins (bytes 8..15) of a Q4_K super-block from its
 * 12 packed bytes, with 32-bit operations (llama.cpp's utmp unpacking; q4k_scales is
 * the byte-wise reference). */
static inline void q4k_scales_fast(const uint8_t* s, uint32_t u[4]) {
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    memcpy(u, s, 12);
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
    uint32_t mins_lo = u[1] & m1;
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
    u[2] = mins_lo;
    u[0] &= m1;
}

/* 16 int16 per super-block for the correction: Q4_K's mins, each twice (sub-blocks of
 * 32 cover two sums of 16), or Q6_K's scales; vpmaddwd with the xq sums of 16 then
 * gives 8 int32 whose total is the super-block's correction */
__attribute__((target("avx2,fma,f16c")))
static inline __m256i kcorr_weights(int type, const uint8_t* blk, const uint32_t* u) {
    if (type == Q4_K) {
        __m128i mn = _mm_loadl_epi64((const __m128i*)((const uint8_t*)u + 8));
        return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn, mn));
    }
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 192)));
}

__attribute__((target("f16c")))
static inline float f16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* ---- AVX2: one weight row against MM rows of x -> out[MM] ---- */
__attribute__((target(AVX2), always_inline))
static inline void krow_avx2(const int type, const int MM, const uint8_t* wr, long nbk, long k,
                             const int8_t* xq, const float* xd, const int32_t* xs, float* out) {
    const __m256i lo = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
    const int16_t* bsum = (const int16_t*)xs;
    const int bb = kblock_bytes(type);
    __m256 acc[MR];
    for (int i = 0; i < MM; i++) acc[i] = _mm256_setzero_ps();
    for (long b = 0; b < nbk; b++) {
        const uint8_t* blk = wr + b * bb;
        kprefetch(blk, bb);
        __m256i u[8], scv[8];
        float d, c;      /* super-block scale; the correction's scale (dmin, or 32 d) */
        uint32_t sm[4];  /* Q4_K: scales (bytes 0..7) and mins (8..15) */
        if (type == Q4_K) {
            d = f16(blk);
            c = f16(blk + 2);
            q4k_scales_fast(blk + 4, sm);
            const uint8_t* sc = (const uint8_t*)sm;
            for (int t = 0; t < 4; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * t));
                u[2 * t] = _mm256_and_si256(v, lo);
                u[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
                scv[2 * t] = _mm256_set1_epi16(sc[2 * t]);
                scv[2 * t + 1] = _mm256_set1_epi16(sc[2 * t + 1]);
            }
        } else {
            const int8_t* s6 = (const int8_t*)(blk + 192);
            d = f16(blk + 208);
            c = 32.0f * d;
            for (int h = 0; h < 2; h++) {
                __m256i q0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h));
                __m256i q1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32));
                __m256i hb = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
                __m256i n[4] = {_mm256_and_si256(q0, lo), _mm256_and_si256(q1, lo),
                                _mm256_and_si256(_mm256_srli_epi16(q0, 4), lo),
                                _mm256_and_si256(_mm256_srli_epi16(q1, 4), lo)};
                for (int t = 0; t < 4; t++) {
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * t), three);
                    u[4 * h + t] = _mm256_or_si256(n[t], _mm256_slli_epi16(hi, 4));
                    int j = 8 * h + 2 * t;
                    scv[4 * h + t] = _mm256_setr_m128i(_mm_set1_epi16(s6[j]), _mm_set1_epi16(s6[j + 1]));
                }
            }
        }
        const __m256i cw = kcorr_weights(type, blk, sm);
        for (int i = 0; i < MM; i++) {
            const int8_t* xb = xq + i * k + b * QK_K;
            __m256i s = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                __m256i p = _mm256_maddubs_epi16(u[t], _mm256_loadu_si256((const __m256i*)(xb + 32 * t)));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, scv[t]));
            }
            __m256i corr = _mm256_madd_epi16(cw, _mm256_loadu_si256((const __m256i*)(bsum + (i * nbk + b) * 16)));
            float dx = xd[i * nbk + b];
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * dx), acc[i]);
            acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_set1_ps(c * dx), acc[i]);
        }
    }
    for (int i = 0; i < MM; i++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[i] = _mm_cvtss_f32(h);
    }
}

/* ---- AVX-512 VNNI: the same, 64 weights per vpmaddubsw + vpdpwssd ---- */
__attribute__((target(VNNI), always_inline))
static inline void krow_vnni(const int type, const int MM, const uint8_t* wr, long nbk, long k,
                             const int8_t* xq, const float* xd, const int32_t* xs, float* out) {
    const __m512i lo = _mm512_set1_epi8(0x0f), three = _mm512_set1_epi8(3);
    /* int16 lane l of vector t takes the scale of sub-block (64 t + 2 l) / sub-block size */
    const __m512i idx4 = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                          0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i idx6 = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                          1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const int16_t* bsum = (const int16_t*)xs;
    const int bb = kblock_bytes(type);
    __m512 acc[MR];
    __m256 cacc[MR];
    for (int i = 0; i < MM; i++) { acc[i] = _mm512_setzero_ps(); cacc[i] = _mm256_setzero_ps(); }
    for (long b = 0; b < nbk; b++) {
        const uint8_t* blk = wr + b * bb;
        kprefetch(blk, bb);
        __m512i u[4], scv[4];
        float d, c;
        uint32_t sm[4];
        if (type == Q4_K) {
            d = f16(blk);
            c = f16(blk + 2);
            q4k_scales_fast(blk + 4, sm);
            __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)sm)));
            for (int t = 0; t < 4; t++) { /* weights 64t..64t+63: chunk t's low, then high nibbles */
                __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * t));
                __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
                u[t] = _mm512_and_si512(w, lo);
                scv[t] = _mm512_permutexvar_epi16(_mm512_add_epi16(idx4, _mm512_set1_epi16((short)(2 * t))), s16);
            }
        } else {
            const int8_t* s6 = (const int8_t*)(blk + 192);
            d = f16(blk + 208);
            c = 32.0f * d;
            __m512i s16 = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)s6)));
            for (int h = 0; h < 2; h++) { /* weights 128h..+63, then 128h+64..+127 */
                __m512i q = _mm512_loadu_si512(blk + 64 * h);
                __m256i hb = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
                __m512i hw = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
                __m512i h01 = _mm512_slli_epi16(_mm512_and_si512(hw, three), 4);
                __m512i h23 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hw, 4), three), 4);
                u[2 * h] = _mm512_or_si512(_mm512_and_si512(q, lo), h01);
                u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), lo), h23);
                scv[2 * h] = _mm512_permutexvar_epi16(_mm512_add_epi16(idx6, _mm512_set1_epi16((short)(8 * h))), s16);
                scv[2 * h + 1] = _mm512_permutexvar_epi16(_mm512_add_epi16(idx6, _mm512_set1_epi16((short)(8 * h + 4))), s16);
            }
        }
        const __m256i cw = kcorr_weights(type, blk, sm);
        for (int i = 0; i < MM; i++) {
            const int8_t* xb = xq + i * k + b * QK_K;
            __m512i s = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++)
                s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(u[t], _mm512_loadu_si512(xb + 64 * t)), scv[t]);
            __m256i corr = _mm256_madd_epi16(cw, _mm256_loadu_si256((const __m256i*)(bsum + (i * nbk + b) * 16)));
            float dx = xd[i * nbk + b];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d * dx), acc[i]);
            cacc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_set1_ps(c * dx), cacc[i]);
        }
    }
    for (int i = 0; i < MM; i++) {
        __m256 h = _mm256_sub_ps(_mm256_add_ps(_mm512_castps512_ps256(acc[i]),
                                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1))), cacc[i]);
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        q = _mm_add_ss(q, _mm_movehdup_ps(q));
        out[i] = _mm_cvtss_f32(q);
    }
}

/* groups g0..g1 of a packed k-quant weight (groups_fn): each row against the rows of x */
#define KGROUPS(NAME, ROW, TARGET)                                                          \
__attribute__((target(TARGET)))                                                            \
static void NAME(int type, const uint8_t* w, long gbytes, long g0, long g1, xquant xq,      \
                 const float* bias, float* y, long ldy, long m, long n, long k) {          \
    long nbk = k / QK_K, rb = krow_bytes(type, k);                                          \
    for (long row = g0 * GR; row < g1 * GR && row < n; row++) {                             \
        const uint8_t* wr = w + row / GR * gbytes + row % GR * rb;                          \
        for (long i0 = 0; i0 < m; i0 += MR) {                                               \
            int mm = m - i0 < MR ? (int)(m - i0) : MR;                                      \
            const int8_t* q = xq.q + i0 * k;                                                \
            const float* d = xq.d + i0 * nbk;                                               \
            const int32_t* s = (const int32_t*)((const int16_t*)xq.s + i0 * nbk * 16);      \
            float out[MR];                                                                  \
            if (type == Q4_K) switch (mm) {                                                 \
                case 1: ROW(Q4_K, 1, wr, nbk, k, q, d, s, out); break;                      \
                case 2: ROW(Q4_K, 2, wr, nbk, k, q, d, s, out); break;                      \
                case 3: ROW(Q4_K, 3, wr, nbk, k, q, d, s, out); break;                      \
                default: ROW(Q4_K, 4, wr, nbk, k, q, d, s, out); break;                     \
            } else switch (mm) {                                                            \
                case 1: ROW(Q6_K, 1, wr, nbk, k, q, d, s, out); break;                      \
                case 2: ROW(Q6_K, 2, wr, nbk, k, q, d, s, out); break;                      \
                case 3: ROW(Q6_K, 3, wr, nbk, k, q, d, s, out); break;                      \
                default: ROW(Q6_K, 4, wr, nbk, k, q, d, s, out); break;                     \
            }                                                                               \
            for (int i = 0; i < mm; i++)                                                    \
                y[(i0 + i) * ldy + row] = out[i] + (bias ? bias[row] : 0.0f);               \
        }                                                                                   \
    }                                                                                       \
}
KGROUPS(kgroups_avx2, krow_avx2, AVX2)
KGROUPS(kgroups_vnni, krow_vnni, VNNI)
#undef KGROUPS
