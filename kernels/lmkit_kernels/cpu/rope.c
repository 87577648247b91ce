/* In-place rotary embedding (RoPE, "rotate half") of query and key heads for a few
 * float32 rows (CPU decode).
 *
 * At decode time a layer rotates one row of 12 heads of 64 floats (SmolLM2); as torch
 * ops (mul, flip, mul, add) that is about 20 us of dispatch per layer. This rotates a
 * row in well under a microsecond on the calling thread, with torch's arithmetic:
 *   out[i]        = x[i] * cos[i]               + x[i + half] * sin[i]
 *   out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half]
 * each product rounded, then the sum (sin carries the sign of "rotate half"), so the
 * result is RotaryEmbedding.apply's bit for bit. fp-contract is off so that the
 * compiler never fuses a product and the sum into one FMA (which rounds once).
 *
 * Built at run time by lmkit_kernels/cpu/build.py; nothing here starts threads.
 */
int lmkit_rope_abi(void) { return 1; }

/* x: rows [m], each `heads` heads of `dim` floats (heads contiguous, rows ldx floats
 * apart), rotated in place; cos/sin: [m, dim] (rows dim floats apart). */
__attribute__((optimize("fp-contract=off")))
void lmkit_rope_inplace(float* x, long ldx, const float* cos, const float* sin, long m,
                        long heads, long dim) {
    long half = dim / 2;
    for (long r = 0; r < m; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (long h = 0; h < heads; h++) {
            float* v = x + r * ldx + h * dim;
            #pragma omp simd
            for (long i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                float lo1 = a * c[i], lo2 = b * s[i];
                float hi1 = b * c[i + half], hi2 = a * s[i + half];
                v[i] = lo1 + lo2;
                v[i + half] = hi1 + hi2;
            }
        }
    }
}
