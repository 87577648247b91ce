/* Float32 residual add + RMSNorm for a few rows (CPU decode).
 *
 * At decode time the norm sees one row per sequence (576 floats for SmolLM2); as torch
 * ops (add, rms_norm) its cost is dispatch and thread hand-off, tens of microseconds
 * per call inside a model. This runs on the calling thread and does each row in one
 * pass, following Hugging Face's float32 formula (variance = mean(h^2); h * (1 /
 * sqrt(variance + eps)) * weight); the sum of squares runs in 16 lanes and a fixed
 * tree (a different order than torch's reduction, so results may differ in the last
 * bit).
 *
 * Built at run time by lmkit_kernels/cpu/build.py with -O3 -fopenmp (the simd pragmas
 * vectorise the loops; nothing here starts threads).
 */
#include <math.h>
#include <stddef.h>

int lmkit_rms_norm_abi(void) { return 1; }

#include "sum_squares.h"  /* sum_squares(): one reduction for both norms */

/* out[r] = rms_norm(x[r] (+ residual[r])) * weight; with a residual, res_out[r] gets
 * x[r] + residual[r] (the new residual stream). Rows of x/residual/out/res_out are
 * ldx/ldr/n/n floats apart. */
void lmkit_add_rms_norm(const float* x, long ldx, const float* residual, long ldr,
                        const float* weight, float eps, float* out, float* res_out,
                        long m, long n) {
    for (long r = 0; r < m; r++) {
        const float* xr = x + r * ldx;
        float* o = out + r * n;
        const float* h = xr;
        if (residual) {
            float* hr = res_out + r * n;
            const float* rr = residual + r * ldr;
            #pragma omp simd
            for (long i = 0; i < n; i++) hr[i] = xr[i] + rr[i];
            h = hr;
        }
        float inv = 1.0f / sqrtf(sum_squares(h, n) / (float)n + eps);
        #pragma omp simd
        for (long i = 0; i < n; i++) o[i] = weight[i] * (h[i] * inv);
    }
}
