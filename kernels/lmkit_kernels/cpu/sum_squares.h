/* Sum of squares of n floats in 16 lanes and a fixed tree (16 -> 8 -> 4 -> 2 -> 1): the
 * reduction of lmkit's RMSNorm, shared by rms_norm.c and the norm folded into qgemv.c so
 * that both give bit-identical results. Its order differs from torch's reduction, so a
 * result may differ from torch's in the last bit. Compiled with -fopenmp (the simd
 * pragma vectorises the lane loop; nothing here starts threads). */
#ifndef LMKIT_SUM_SQUARES_H
#define LMKIT_SUM_SQUARES_H

#define LMKIT_SUM_LANES 16

static inline float sum_squares(const float* h, long n) {
    float lanes[LMKIT_SUM_LANES] = {0};
    long i = 0;
    for (; i + LMKIT_SUM_LANES <= n; i += LMKIT_SUM_LANES) {
        #pragma omp simd
        for (int j = 0; j < LMKIT_SUM_LANES; j++) lanes[j] += h[i + j] * h[i + j];
    }
    for (; i < n; i++) lanes[i % LMKIT_SUM_LANES] += h[i] * h[i];
    for (int width = LMKIT_SUM_LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) lanes[j] += lanes[j + width];
    return lanes[0];
}

#endif
