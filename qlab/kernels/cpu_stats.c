/* The statistics a probe records (qlab.probes._stats_rows) of one float32 tensor, in one pass over it
   and without a copy; the reference is _stats_rows in float64 torch ops.

   x is contiguous, (rows, channels). result receives 11 float64 values:
     min, max, mean, variance (Σ(x − mean)² / n), Σx², Σ|x|, amax, the smallest non-zero |x| (inf if
     there is none), the number of exact zeros, and with `outliers` the largest and the lower median of
     the channels' amax (else the smallest non-zero |x| twice).
   One pass: x is read in blocks of BLOCK floats (8 KiB, in L1). Each block gives its 32-bit statistics
   and its float64 Σx, Σ|x| and Σx² in one loop, and its M2 = Σ(x − block mean)²: Σx² − mean·Σx where
   that loses at most one bit to cancellation (the block's |mean| at most its standard deviation), else
   another sweep over the block from L1, Σ(x − mean)². The blocks' (count, mean, M2) are merged by Chan, Golub and
   LeVeque's formula: E[x²] − E[x]² is never taken over data far off zero, the variance is as exact as
   a two-pass one over the whole tensor (to about 2⁻⁴⁵·Σx²), and memory is read once.
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

#define BLOCK 2048
#define LANES 16 /* float64 partial sums per accumulator: the adds pipeline instead of waiting on one */

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

/* The k-th smallest of a[0..n) (0-based), by quickselect with a median-of-three pivot; reorders a. */
static uint32_t select_kth(uint32_t *a, int64_t n, int64_t k) {
    int64_t low = 0, high = n - 1;
    while (high > low) {
        int64_t middle = low + (high - low) / 2;
        uint32_t x = a[low], y = a[middle], z = a[high]; /* the median of three as the pivot */
        uint32_t pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = low, j = high;
        while (i <= j) { /* Hoare's partition: a[low..j] ≤ pivot ≤ a[i..high] */
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) {
                uint32_t swap = a[i];
                a[i++] = a[j];
                a[j--] = swap;
            }
        }
        if (k <= j) high = j;
        else if (k >= i) low = i;
        else return a[k]; /* between the two parts: equal to the pivot */
    }
    return a[k];
}

/* What one thread gathers over its blocks; a cache line (or two) of its own, so that two threads
   writing their neighbouring Partials do not pass one line back and forth. */
typedef struct {
    float low, high;
    uint32_t amax, smallest; /* the bits of |x|, order-preserving; smallest = inf's bits: none yet */
    int64_t zeros, count;
    double sum, squares, l1, mean, m2; /* mean and m2: the running (Chan) merge of the blocks */
} __attribute__((aligned(64))) Partial;

#define LINE_WORDS 16 /* uint32 in a 64-byte cache line */

static void partial_init(Partial *p) {
    p->low = INFINITY;
    p->high = -INFINITY;
    p->amax = 0;
    p->smallest = 0x7F800000u;
    p->zeros = p->count = 0;
    p->sum = p->squares = p->l1 = p->mean = p->m2 = 0.0;
}

/* Fold (count, mean, m2) of a part into p: Chan et al., "Updating formulae and a pairwise algorithm
   for computing sample variances" (1979). */
static void merge_moments(Partial *p, int64_t count, double mean, double m2) {
    if (count == 0) return;
    if (p->count == 0) {
        p->count = count, p->mean = mean, p->m2 = m2;
        return;
    }
    double total = (double)(p->count + count), delta = mean - p->mean;
    p->mean += delta * ((double)count / total);
    p->m2 += m2 + delta * delta * ((double)p->count * (double)count / total);
    p->count += count;
}

/* The n ≤ BLOCK floats at x into p: one loop for the 32-bit statistics and Σx, Σ|x|, Σx² (LANES
   floats a step), then the block's M2. With channel_amax (channels a multiple of LANES, x starting at
   channel `column`, a multiple of LANES too), the same loop keeps each channel's largest |x| bits:
   every step of LANES floats lies within one row, at channels column.. column + LANES − 1. */
static inline __attribute__((always_inline)) void add_block(const float *x, int64_t n, Partial *p,
                                                            uint32_t *channel_amax, int64_t channels,
                                                            int64_t column, const int fused) {
    float low[LANES], high[LANES];
    uint32_t amax[LANES], below[LANES]; /* bits − 1 wraps a zero to the top and puts a NaN above inf */
    int32_t zeros[LANES];
    double sum[LANES], l1[LANES], squares[LANES];
    for (int k = 0; k < LANES; k++) {
        low[k] = p->low, high[k] = p->high, amax[k] = p->amax, below[k] = p->smallest - 1u, zeros[k] = 0;
        sum[k] = l1[k] = squares[k] = 0.0;
    }
    int64_t whole = n / LANES * LANES;
    for (int64_t c = 0; c < whole; c += LANES) {
        uint32_t slot[LANES];
        if (fused) memcpy(slot, channel_amax + column, sizeof slot);
        for (int k = 0; k < LANES; k++) {
            float value = x[c + k];
            uint32_t bits = magnitude_bits(value);
            low[k] = value < low[k] ? value : low[k];
            high[k] = value > high[k] ? value : high[k];
            amax[k] = bits > amax[k] ? bits : amax[k]; /* a NaN's bits lie above inf's: amax tells */
            below[k] = bits - 1u < below[k] ? bits - 1u : below[k];
            zeros[k] += bits == 0;
            double wide = (double)value;
            sum[k] += wide;
            l1[k] += fabs(wide);
            squares[k] = fma(wide, wide, squares[k]);
            if (fused) slot[k] = bits > slot[k] ? bits : slot[k];
        }
        if (fused) {
            memcpy(channel_amax + column, slot, sizeof slot);
            column = column + LANES == channels ? 0 : column + LANES;
        }
    }
    for (int64_t i = whole; i < n; i++) { /* the tail, into lane 0 (none when fused: n is a multiple of LANES) */
        float value = x[i];
        uint32_t bits = magnitude_bits(value);
        low[0] = value < low[0] ? value : low[0];
        high[0] = value > high[0] ? value : high[0];
        amax[0] = bits > amax[0] ? bits : amax[0];
        below[0] = bits - 1u < below[0] ? bits - 1u : below[0];
        zeros[0] += bits == 0;
        sum[0] += (double)value;
        l1[0] += fabs((double)value);
        squares[0] = fma((double)value, (double)value, squares[0]);
    }
    double block_sum = 0.0, block_l1 = 0.0, block_squares = 0.0, block_m2 = 0.0;
    for (int k = 0; k < LANES; k++) {
        p->low = low[k] < p->low ? low[k] : p->low;
        p->high = high[k] > p->high ? high[k] : p->high;
        p->amax = amax[k] > p->amax ? amax[k] : p->amax;
        below[0] = below[k] < below[0] ? below[k] : below[0];
        p->zeros += zeros[k];
        block_sum += sum[k], block_l1 += l1[k], block_squares += squares[k];
    }
    p->smallest = below[0] + 1u; /* below starts at inf's bits − 1: zeros and NaNs never come under it */

    double mean = block_sum / (double)n;
    /* M2 = Σx² − mean·Σx where that cancels at most one bit (n·mean² ≤ M2, i.e. |mean| ≤ the block's
       standard deviation: activations, gradients and weights nearly always): its error is that of the
       two sums, about 2⁻⁴⁵·Σx² (128 terms a lane) ≤ 2⁻⁴⁴·M2. Else (and for an inf or NaN, where the
       comparison fails) another sweep from L1, Σ(x − mean)², as exact however far the data sit from 0 */
    block_m2 = block_squares - block_sum * mean;
    if (!(block_sum * mean <= block_m2)) {
        double two_pass[LANES];
        for (int k = 0; k < LANES; k++) two_pass[k] = 0.0;
        for (int64_t c = 0; c < whole; c += LANES)
            for (int k = 0; k < LANES; k++) {
                double deviation = (double)x[c + k] - mean;
                two_pass[k] = fma(deviation, deviation, two_pass[k]); /* one rounding, one instruction */
            }
        block_m2 = 0.0;
        for (int k = 0; k < LANES; k++) block_m2 += two_pass[k];
        for (int64_t i = whole; i < n; i++) {
            double deviation = (double)x[i] - mean;
            block_m2 = fma(deviation, deviation, block_m2);
        }
    }
    p->sum += block_sum, p->l1 += block_l1, p->squares += block_squares;
    merge_moments(p, n, mean, block_m2);
}

/* channel_amax[j] = max over the elements start ≤ i < end of channel j = i mod channels of |x_i|'s bits. */
static void add_channel_amax(const float *x, int64_t start, int64_t end, int64_t channels, uint32_t *channel_amax) {
    int64_t column = start % channels;
    for (int64_t i = start; i < end; column = 0) { /* a row's stretch at a time: its channels in order */
        int64_t count = channels - column < end - i ? channels - column : end - i;
        const float *row = x + i;
        uint32_t *slot = channel_amax + column;
        for (int64_t k = 0; k < count; k++) {
            uint32_t bits = magnitude_bits(row[k]);
            slot[k] = bits > slot[k] ? bits : slot[k];
        }
        i += count;
    }
}

/* Thread `thread` of `size`'s share of the blocks (a contiguous run of them, in order) into `mine`,
   and with `outliers` its channel maxima into its own row `mine_amax`. */
static void add_share(const float *x, int64_t n, int64_t blocks, int64_t channels, int outliers, int fused,
                      Partial *mine, uint32_t *mine_amax, int thread, int size) {
    partial_init(mine);
    int64_t first = blocks * thread / size, last = blocks * (thread + 1) / size;
    for (int64_t b = first; b < last; b++) {
        int64_t start = b * BLOCK, end = start + BLOCK < n ? start + BLOCK : n;
        if (fused) add_block(x + start, end - start, mine, mine_amax, channels, start % channels, 1);
        else {
            add_block(x + start, end - start, mine, NULL, channels, 0, 0);
            if (outliers) add_channel_amax(x, start, end, channels, mine_amax);
        }
    }
}

void qlab_tensor_stats(const float *x, int64_t rows, int64_t channels, int outliers, double *result, int threads) {
    const int64_t n = rows * channels, blocks = (n + BLOCK - 1) / BLOCK;
    if (threads > blocks) threads = (int)blocks;
    if (threads < 1) threads = 1;
    Partial parts[threads];
    /* the channel maxima, a row per thread, each row starting a cache line (two threads updating one
       line shared by the end of a row and the start of the next cost 30-40 % of a call): on the stack
       when small (a call costs ~1 µs less) */
    const int64_t stride = (channels + LINE_WORDS - 1) / LINE_WORDS * LINE_WORDS;
    const int64_t scratch = outliers ? threads * stride : 0;
    uint32_t small[scratch <= 4096 ? scratch + LINE_WORDS : 1];
    uint32_t *allocated = scratch <= 4096 ? small : malloc((size_t)(scratch + LINE_WORDS) * sizeof(uint32_t));
    if (allocated == NULL) { /* no memory for the channel maxima: NaN, never a wrong number */
        for (int k = 0; k < 11; k++) result[k] = (double)NAN;
        return;
    }
    uint32_t *channel_amax = (uint32_t *)(((uintptr_t)allocated + 63) & ~(uintptr_t)63);
    if (outliers) memset(channel_amax, 0, (size_t)scratch * sizeof(uint32_t));
    const int fused = outliers && channels % LANES == 0; /* channel maxima in add_block's own loop */
    int team = 1; /* the threads OpenMP gives, which may be fewer than asked (OMP_THREAD_LIMIT, nesting) */
    if (threads == 1) /* no parallel region: entering one costs ~0.3 µs, a small tensor's whole call */
        add_share(x, n, blocks, channels, outliers, fused, parts, outliers ? channel_amax : NULL, 0, 1);
    else {
#pragma omp parallel num_threads(threads)
        {
            int thread = 0, size = 1;
#ifdef _OPENMP
            thread = omp_get_thread_num(), size = omp_get_num_threads();
#endif
            if (thread == 0) team = size; /* read after the region's closing barrier */
            uint32_t *mine_amax = outliers ? channel_amax + (int64_t)thread * stride : NULL;
            add_share(x, n, blocks, channels, outliers, fused, &parts[thread], mine_amax, thread, size);
        }
    }
    Partial *all = &parts[0];
    for (int t = 1; t < team; t++) {
        Partial *p = &parts[t];
        all->low = p->low < all->low ? p->low : all->low;
        all->high = p->high > all->high ? p->high : all->high;
        all->amax = p->amax > all->amax ? p->amax : all->amax;
        all->smallest = p->smallest < all->smallest ? p->smallest : all->smallest;
        all->zeros += p->zeros;
        all->sum += p->sum, all->squares += p->squares, all->l1 += p->l1;
        merge_moments(all, p->count, p->mean, p->m2);
    }
    double nan = (double)NAN;
    int any_nan = all->amax > 0x7F800000u;
    result[0] = any_nan ? nan : (double)all->low;
    result[1] = any_nan ? nan : (double)all->high;
    result[2] = all->sum / (double)n; /* from the sum, as torch's mean: inf, −inf or NaN where it is */
    result[3] = all->m2 / (double)n;
    result[4] = all->squares;
    result[5] = all->l1;
    result[6] = (double)float_from_bits(all->amax); /* NaN bits lie above inf's */
    result[7] = (double)float_from_bits(all->smallest);
    result[8] = (double)all->zeros;
    result[9] = result[10] = result[7];
    if (outliers) {
        for (int t = 1; t < team; t++)
            for (int64_t j = 0; j < channels; j++) {
                uint32_t theirs = channel_amax[(int64_t)t * stride + j];
                channel_amax[j] = theirs > channel_amax[j] ? theirs : channel_amax[j];
            }
        /* the top channel's amax is the tensor's; the median is torch's lower one */
        result[9] = any_nan ? nan : result[6];
        result[10] = any_nan ? nan : (double)float_from_bits(select_kth(channel_amax, channels, (channels - 1) / 2));
        if (allocated != small) free(allocated);
    }
}
