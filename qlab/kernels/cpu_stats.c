/* The statistics a probe records (qlab.probes._stats_rows) of one float32 tensor, in two passes over
   it and without a copy; the reference is _stats_rows in float64 torch ops.

   x is contiguous, (rows, channels). result receives 11 float64 values:
     min, max, mean, variance (two-pass: Σ(x − mean)² / n, never E[x²] − E[x]²), Σx², Σ|x|, amax,
     the smallest non-zero |x| (inf if there is none), the number of exact zeros, and with `outliers`
     the largest and the lower median of the channels' amax (else the smallest non-zero |x| twice).
   NaN: min, max, mean, the variance, the sums, amax and the channel statistics are NaN when any element
   is, as torch's reductions propagate it; the smallest non-zero |x| and the zero count skip NaNs.
   Sums are float64 in a different order from torch's, so they agree to float64 rounding, not bits. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline uint32_t magnitude_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    return bits & 0x7FFFFFFFu;
}

static inline float float_from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static int compare_bits(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* Over the n floats of x, in float64: with centered == 0, out = (Σx, Σx², Σ|x|); else out[1] =
   Σ(x − mean)². LANES partial sums per thread, so the additions pipeline instead of waiting on one
   accumulator (a float64 add's latency is four of its throughput). */
#define LANES 32
static void float_sums(const float *x, int64_t n, double mean, int centered, double *out, int threads) {
    double total = 0.0, total_squares = 0.0, total_l1 = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total, total_squares, total_l1)
    {
        double sum[LANES] = {0}, squares[LANES] = {0}, l1[LANES] = {0};
        int64_t chunks = n / LANES;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const float *chunk = x + c * LANES;
            if (centered)
                for (int k = 0; k < LANES; k++) {
                    double deviation = (double)chunk[k] - mean;
                    squares[k] += deviation * deviation;
                }
            else
                for (int k = 0; k < LANES; k++) {
                    double wide = (double)chunk[k];
                    sum[k] += wide;
                    squares[k] += wide * wide;
                    l1[k] += fabs(wide);
                }
        }
        for (int k = 0; k < LANES; k++) {
            total += sum[k];
            total_squares += squares[k];
            total_l1 += l1[k];
        }
    }
    for (int64_t i = n / LANES * LANES; i < n; i++) { /* the tail */
        double wide = (double)x[i], deviation = wide - mean;
        total += wide;
        total_squares += centered ? deviation * deviation : wide * wide;
        total_l1 += fabs(wide);
    }
    out[0] = total;
    out[1] = total_squares;
    out[2] = total_l1;
}

/* channel_amax: `threads` · channels scratch uint32 (one row of channel maxima per thread). */
void qlab_tensor_stats(const float *x, int64_t rows, int64_t channels, int outliers, double *result,
                       uint32_t *channel_amax, int threads) {
    const int64_t n = rows * channels;
    if (n < 65536) threads = 1; /* a thread team costs more than a small tensor's reduction */
    float low = INFINITY, high = -INFINITY;
    uint32_t amax = 0, smallest = 0x7F800000u; /* the bits of |x|, order-preserving; inf: none yet */
    int64_t zeros = 0, nans = 0;
    if (outliers) memset(channel_amax, 0, sizeof(uint32_t) * threads * channels);
#pragma omp parallel num_threads(threads)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        uint32_t *mine = channel_amax + thread * channels;
#pragma omp for schedule(static) reduction(min : low, smallest) reduction(max : high, amax) reduction(+ : zeros, nans)
        for (int64_t i = 0; i < rows; i++) {
            const float *row = x + i * channels;
#pragma omp simd reduction(min : low, smallest) reduction(max : high, amax) reduction(+ : zeros, nans)
            for (int64_t j = 0; j < channels; j++) { /* the 32-bit statistics, 16 lanes at a time */
                float value = row[j];
                uint32_t bits = magnitude_bits(value);
                low = value < low ? value : low;
                high = value > high ? value : high;
                amax = bits > amax ? bits : amax;
                uint32_t nonzero = bits == 0 || bits > 0x7F800000u ? 0x7F800000u : bits; /* zeros and NaNs skipped */
                smallest = nonzero < smallest ? nonzero : smallest;
                zeros += bits == 0;
                nans += bits > 0x7F800000u;
            }
            if (outliers)
                for (int64_t j = 0; j < channels; j++) {
                    uint32_t bits = magnitude_bits(row[j]);
                    mine[j] = bits > mine[j] ? bits : mine[j];
                }
        }
    }
    double sums[3];
    float_sums(x, n, 0.0, 0, sums, threads); /* Σx, Σx², Σ|x| */
    double mean = sums[0] / (double)n, squares = sums[1], l1 = sums[2], centered[3];
    float_sums(x, n, mean, 1, centered, threads); /* Σ(x − mean)² */
    double nan = (double)NAN;
    result[0] = nans ? nan : (double)low;
    result[1] = nans ? nan : (double)high;
    result[2] = mean;
    result[3] = centered[1] / (double)n;
    result[4] = squares;
    result[5] = l1;
    result[6] = (double)float_from_bits(amax); /* NaN bits lie above inf's */
    result[7] = (double)float_from_bits(smallest);
    result[8] = (double)zeros;
    result[9] = result[10] = result[7];
    if (outliers) {
        for (int t = 1; t < threads; t++)
            for (int64_t j = 0; j < channels; j++)
                channel_amax[j] = channel_amax[t * channels + j] > channel_amax[j] ? channel_amax[t * channels + j]
                                                                                   : channel_amax[j];
        qsort(channel_amax, (size_t)channels, sizeof(uint32_t), compare_bits);
        int any_nan = channel_amax[channels - 1] > 0x7F800000u;
        result[9] = any_nan ? nan : (double)float_from_bits(channel_amax[channels - 1]);
        result[10] = any_nan ? nan : (double)float_from_bits(channel_amax[(channels - 1) / 2]); /* torch's lower median */
    }
}
