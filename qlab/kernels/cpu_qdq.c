/* Block quantize-dequantize on the CPU, one pass per block; the reference is qlab.quantize.qdq.
   (Near the end, two per-tensor or per-line recipes in two passes: FP8 current scaling,
   qlab_fp8_tensor_qdq, and symmetric integers, qlab_int_qdq.)

   x is float32, contiguous, viewed as (outer, length, inner); blocks of `block` elements run along
   `length` (the scale axis), so inner == 1 is the last axis. With `square`, a block × block tile of
   (length, inner) shares one scale (2-D weight blocks: the same tiles whichever axis the spec names). The last block may be partial: the
   reference pads with zeros, which change no amax. Every block is
     amax = max |x| over the block;  (inverse, multiplier) = the recipe's factors for amax;
     out  = round(min(|x · inverse|, elem_max)) · sign(x) · multiplier
   with round to nearest even, or stochastic rounding by a given uniform draw per element;
   and a block whose amax is not finite (a NaN or inf in it) is all NaN (0x7FC00000, the bits the
   reference's 0 · NaN gives). The factors, as qlab.scaling computes them in float32:

   MX (OCP v1.0): b = the E8M0 byte of amax for the mode (floor, ceil, even, rceil), in [0, 254];
     multiplier X = 2^(b - 127) (the float32 subnormal 2^-127 for b = 0), inverse = bits (254 - b) << 23.
   NVFP4, NVIDIA's convention (TransformerEngine): with the tensor amax A, S_enc = min(fl(2688 / A),
     FLT_MAX) (1 if A is 0 or not finite) and S_dec = fl(1 / S_enc):
     s_block    = E4M3_rne(min(amax · fl(S_enc · fl(1/6)), 448))       (no lower clamp)
     inverse    = min(fl(1 / fl(s_block · S_dec)), FLT_MAX)
     multiplier = fl(fl(s_block · A) · fl(1/2688)), or s_block · S_dec where S_enc was clamped or A is
                  not finite; without a global scale S_enc = S_dec = 1 and the multiplier is s_block.

   Rounding is the add-and-subtract trick of qlab.formats.cast_rne_float32: adding 2^(e + 23 - m)
   to a float32 of exponent e rounds it to m mantissa bits, ties to even, with e clamped below at the
   format's smallest normal exponent so its subnormals share one quantum. Build with
   -ffp-contract=off: a fused multiply-add would change the bits. */

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { MODE_FLOOR = 0, MODE_CEIL = 1, MODE_EVEN = 2, MODE_RCEIL = 3 };
enum { RECIPE_MX = 0, RECIPE_NVFP4 = 1 };
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1024 /* floats: 4 KiB */
#endif
#define TILE 256 /* blocks handled together along a row; columns in the Hadamard and integer paths */
/* Columns handled together when blocks run down a non-last axis: items up to a 4096-float row
   segment, which streams each of the block's rows (4096², two threads: NVFP4 16×16 tiles and MXFP8
   blocks down axis 0 4-14 % faster than with 256 columns, whose short strided segments the
   quantizing pass re-read after they had left the L1 cache); more, narrower items (down to about
   256 columns) while there are fewer than 4 a thread, all of one width, whole square tiles. */
#ifndef COLUMN_TILE
#define COLUMN_TILE 4096
#endif
_Static_assert(COLUMN_TILE >= 256, "an item must hold a 2-D tile of cpu_qdq.SQUARE_BLOCK_LIMIT (256) columns");
#define FLOAT32_MAX 3.4028234663852886e38f
#define NAN_BITS 0x7FC00000u

static inline uint32_t bits_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    return bits;
}

static inline float float_of(uint32_t bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

/* x rounded to a float format of mbits mantissa bits, ties to even, saturating at max_value; x is
   never NaN here. Bit operations and plain comparisons (not fminf/copysignf), so that it vectorizes. */
static inline float round_rne(float x, int mbits, int min_field, float max_value) {
    uint32_t bits = bits_of(x);
    float magnitude = float_of(bits & 0x7FFFFFFFu);
    magnitude = magnitude < max_value ? magnitude : max_value;
    int32_t field = (int32_t)(bits_of(magnitude) >> 23);
    field = field < min_field ? min_field : field;
    float magic = float_of((uint32_t)(field + 23 - mbits) << 23);
    float rounded = (magnitude + magic) - magic;
    return float_of(bits_of(rounded) | (bits & 0x80000000u));
}

/* x rounded stochastically (qlab.formats._cast_stochastic_float32): floor(|x|/q + u) · q, never more
   than one step up, saturating at max_value, with q the quantum at |x|'s exponent and u in [0, 1). */
static inline float round_stochastic(float x, float u, int mbits, int min_field, float max_value) {
    uint32_t bits = bits_of(x);
    float magnitude = float_of(bits & 0x7FFFFFFFu);
    magnitude = magnitude < max_value ? magnitude : max_value;
    int32_t field = (int32_t)(bits_of(magnitude) >> 23);
    field = field < min_field ? min_field : field;
    float quantum = float_of((uint32_t)(field - mbits) << 23);
    float scaled = magnitude / quantum;
    float up = floorf(scaled + u), next = floorf(scaled) + 1.0f;
    float value = (up < next ? up : next) * quantum;
    value = value < max_value ? value : max_value;
    return float_of(bits_of(value) | (bits & 0x80000000u));
}

typedef struct {
    int recipe, block;
    int mbits, min_field; /* the element format */
    float elem_max;
    int mode, emax;       /* MX */
    int global_scale;     /* NVFP4 */
    int square;           /* 2-D tiles: blocks of `block` rows times `block` columns share one scale */
    float tensor_amax, encode_over_6, decode, usual;
} recipe_t;

/* The E8M0 byte of a finite float32 amax (qlab.scaling._mx_biased_exponent). */
static inline int32_t mx_biased_exponent(float amax, int mode, const recipe_t *r) {
    if (mode == MODE_RCEIL) {
        float descale = amax / r->elem_max;
        uint32_t bits = bits_of(descale);
        int32_t exponent = (int32_t)((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0);
        if (descale < 0x1p-126f) exponent = descale > 0x1p-127f ? -126 : -127;
        if (exponent > 127) exponent = 127;
        if (exponent < -127) exponent = -127;
        return exponent + 127;
    }
    uint32_t bits = bits_of(amax);
    if (mode == MODE_EVEN) bits = (bits + (1u << (22 - r->mbits))) & 0x7F800000u;
    int32_t field = (int32_t)((bits >> 23) & 0xFF);
    if (mode == MODE_CEIL) field += (bits & 0x7FFFFF) != 0;
    field -= r->emax;
    return field < 0 ? 0 : (field > 254 ? 254 : field);
}

static inline __attribute__((always_inline)) void mx_factors(const uint32_t *amax, float *inverse, float *multiplier,
                                                             int64_t count, int mode, const recipe_t *r) {
    for (int64_t j = 0; j < count; j++) {
        int32_t b = mx_biased_exponent(float_of(amax[j]), mode, r);
        int finite = amax[j] < 0x7F800000u;
        float scale = float_of(b == 0 ? 1u << 22 : (uint32_t)b << 23);
        multiplier[j] = finite ? scale : float_of(NAN_BITS);
        inverse[j] = finite ? float_of((uint32_t)(254 - b) << 23) : 0.0f;
    }
}

/* (inverse, multiplier) of `count` blocks whose largest |x| have the bits amax[j] (the bits of |x|
   order as the magnitudes do, and any NaN lies above inf). A non-finite block gets inverse 0 and a
   NaN multiplier, so each of its elements comes out NaN (with the element loops' NaN guard). Written
   without early exits so that the loop over blocks vectorizes (NVFP4's division among them). */
static void block_factors(const uint32_t *amax, float *inverse, float *multiplier, int64_t count,
                          const recipe_t *r) {
    if (r->recipe == RECIPE_MX) { /* one loop per mode, each of which vectorizes */
        switch (r->mode) {
        case MODE_FLOOR: mx_factors(amax, inverse, multiplier, count, MODE_FLOOR, r); break;
        case MODE_CEIL: mx_factors(amax, inverse, multiplier, count, MODE_CEIL, r); break;
        case MODE_EVEN: mx_factors(amax, inverse, multiplier, count, MODE_EVEN, r); break;
        default: mx_factors(amax, inverse, multiplier, count, MODE_RCEIL, r);
        }
        return;
    }
    const float encode_over_6 = r->encode_over_6, decode = r->global_scale ? r->decode : 1.0f;
    const float tensor_amax = r->tensor_amax;
    const int with_amax = r->global_scale && r->usual, global_scale = r->global_scale;
    for (int64_t j = 0; j < count; j++) {
        int finite = amax[j] < 0x7F800000u;
        float wanted = (finite ? float_of(amax[j]) : 0.0f) * encode_over_6;
        float scale = round_rne(wanted < 448.0f ? wanted : 448.0f, 3, 121, 448.0f); /* E4M3: 3 bits, bias 7 */
        float reciprocal = 1.0f / (global_scale ? scale * decode : scale);
        float dequantize = with_amax ? (scale * tensor_amax) * (float)(1.0 / 2688.0) : scale * decode;
        inverse[j] = finite ? (reciprocal < FLOAT32_MAX ? reciprocal : FLOAT32_MAX) : 0.0f;
        multiplier[j] = finite ? dequantize : float_of(NAN_BITS);
    }
}

/* The elements of one block: n along a row (stride 1); the NaN guard maps x · 0 of a NaN or inf in
   a non-finite block to 0, whose product with the NaN multiplier is NaN. */
static inline void qdq_elements(const float *restrict x, float *restrict out, const float *restrict noise, int64_t n,
                                float inverse, float multiplier, const recipe_t *r) {
    const int mbits = r->mbits, min_field = r->min_field;
    const float elem_max = r->elem_max;
    if (noise) {
        for (int64_t i = 0; i < n; i++) {
            float scaled = x[i] * inverse;
            scaled = scaled == scaled ? scaled : 0.0f;
            out[i] = round_stochastic(scaled, noise[i], mbits, min_field, elem_max) * multiplier;
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float scaled = x[i] * inverse;
            scaled = scaled == scaled ? scaled : 0.0f;
            out[i] = round_rne(scaled, mbits, min_field, elem_max) * multiplier;
        }
    }
}

static inline uint32_t block_amax(const float *restrict x, int64_t n) {
    uint32_t amax = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* GCC's vector extensions (no intrinsics: any target GCC builds for) for the reductions and the
   Hadamard transform along a row, where autovectorized loops would reduce one block at a time or go
   through memory; other compilers take the plain loops. */
#if defined(__GNUC__) && !defined(__clang__)
#define GCC_VECTORS 1
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

static inline u32x16 vector_max(u32x16 a, u32x16 b) {
    u32x16 greater = (u32x16)(a > b);
    return (a & greater) | (b & ~greater);
}

/* The largest of the 16 lanes, by the same butterfly pattern: after the four steps every lane holds it. */
static inline uint32_t lanes_max(u32x16 v) {
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int step = 8; step >= 1; step /= 2) v = vector_max(v, __builtin_shuffle(v, lane ^ step));
    return v[0];
}

/* The 16 lanes of each of w[0..15] reduced at once: lane j of the result is the largest of w[j]'s
   lanes. Four levels, each halving the vectors: a pair's lanes are split in two halves by two
   two-vector shuffles, whose lane-wise max keeps half of each vector's candidates; the last level
   leaves the maxima in bit-reversed order, which one shuffle undoes. */
static inline u32x16 vectors_max(u32x16 *w) {
    const i32x16 lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                 lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                 lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                 lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
                 reversed = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    const i32x16 lows[4] = {lo1, lo2, lo3, lo4};
    const int halves[4] = {8, 4, 2, 1}; /* the high half's shuffle is the low one's plus this */
    int count = 16;
    for (int level = 0; level < 4; level++, count /= 2)
        for (int k = 0; k < count / 2; k++)
            w[k] = vector_max(__builtin_shuffle(w[2 * k], w[2 * k + 1], lows[level]),
                              __builtin_shuffle(w[2 * k], w[2 * k + 1], lows[level] + halves[level]));
    return __builtin_shuffle(w[0], reversed);
}

#else
#define GCC_VECTORS 0
#endif

/* amax and qdq of `count` whole blocks of `block` elements along a row; inlined where `block` is a
   constant, so that each block's loops are unrolled and no loop counter spills to the stack. The amax
   loop prefetches the blocks PREFETCH_AHEAD floats ahead: the hardware prefetcher alone leaves this
   first read of each cache line waiting (a prefetch never faults, even past the end of x). */
static inline __attribute__((always_inline)) void row_amax(const float *restrict x, int64_t count, int64_t block,
                                                          uint32_t *restrict amax) {
    for (int64_t j = 0; j < count; j++) {
        for (int64_t line = 0; line < block; line += 16) __builtin_prefetch(x + j * block + line + PREFETCH_AHEAD, 0, 3);
        amax[j] = block_amax(x + j * block, block);
    }
}

static inline __attribute__((always_inline)) void row_qdq(const float *restrict x, float *restrict out,
                                                         const float *restrict noise, int64_t count, int64_t block,
                                                         const float *inverse, const float *multiplier,
                                                         const recipe_t *r) {
    for (int64_t j = 0; j < count; j++)
        qdq_elements(x + j * block, out + j * block, noise ? noise + j * block : NULL, block, inverse[j],
                     multiplier[j], r);
}

/* row_qdq with a constant trip count for the usual blocks of 16 and 32. */
static inline __attribute__((always_inline)) void row_qdq_blocks(const float *restrict x, float *restrict out,
                                                                const float *restrict noise, int64_t count,
                                                                int64_t block, const float *inverse,
                                                                const float *multiplier, const recipe_t *r) {
    if (block == 16)
        row_qdq(x, out, noise, count, 16, inverse, multiplier, r);
    else if (block == 32)
        row_qdq(x, out, noise, count, 32, inverse, multiplier, r);
    else
        row_qdq(x, out, noise, count, block, inverse, multiplier, r);
}

/* Up to TILE consecutive blocks of one row, the last of which may be partial (`length` elements in all). */
static void qdq_row_blocks(const float *restrict x, float *restrict out, const float *restrict noise, int64_t length,
                           int64_t block, const recipe_t *r) {
    uint32_t amax[TILE];
    float inverse[TILE], multiplier[TILE];
    int64_t whole = length / block, count = (length + block - 1) / block, tail = length - whole * block;
    if (block == 32) /* the usual blocks get constant trip counts */
        row_amax(x, whole, 32, amax);
    else if (block == 16)
        row_amax(x, whole, 16, amax);
    else
        row_amax(x, whole, block, amax);
    if (tail) amax[whole] = block_amax(x + whole * block, tail);
    block_factors(amax, inverse, multiplier, count, r);
    row_qdq_blocks(x, out, noise, whole, block, inverse, multiplier, r);
    if (tail)
        qdq_elements(x + whole * block, out + whole * block, noise ? noise + whole * block : NULL, tail,
                     inverse[whole], multiplier[whole], r);
}

/* amax[j] = the largest |x| bits of column j over `rows` rows of stride `stride`, for `cols` columns. */
static inline void column_amax(const float *restrict x, int64_t rows, int64_t stride, int64_t cols,
                               uint32_t *restrict amax) {
    for (int64_t j = 0; j < cols; j++) amax[j] = 0;
    for (int64_t i = 0; i < rows; i++) {
        const float *row = x + i * stride;
        for (int64_t j = 0; j < cols; j++) {
            uint32_t a = bits_of(row[j]) & 0x7FFFFFFFu;
            amax[j] = a > amax[j] ? a : amax[j];
        }
    }
}

/* n lanes of one row quantized with lane j's factors, and its draw noise[j · noise_stride] when
   rounding stochastically (the NaN guard as in qdq_elements). x may be out (in place). */
static inline __attribute__((always_inline)) void quantize_lanes(const float *x, float *out, const float *noise,
                                                                 int64_t noise_stride, int64_t n, const float *inverse,
                                                                 const float *multiplier, const recipe_t *r) {
    const int mbits = r->mbits, min_field = r->min_field;
    const float elem_max = r->elem_max;
    if (noise) {
        for (int64_t j = 0; j < n; j++) {
            float scaled = x[j] * inverse[j];
            scaled = scaled == scaled ? scaled : 0.0f;
            out[j] = round_stochastic(scaled, noise[j * noise_stride], mbits, min_field, elem_max) * multiplier[j];
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            float scaled = x[j] * inverse[j];
            scaled = scaled == scaled ? scaled : 0.0f;
            out[j] = round_rne(scaled, mbits, min_field, elem_max) * multiplier[j];
        }
    }
}

/* Blocks of `rows` rows (stride `inner`) times `cols` columns starting at x. */
static void qdq_column_blocks(const float *restrict x, float *restrict out, const float *restrict noise,
                              int64_t rows, int64_t inner, int64_t cols, const recipe_t *r) {
    uint32_t amax[COLUMN_TILE];
    float inverse[COLUMN_TILE], multiplier[COLUMN_TILE];
    column_amax(x, rows, inner, cols, amax);
    if (r->square) /* the item's width is a multiple of the block: a tile never straddles two items */
        for (int64_t g = 0; g < cols; g += r->block) {
            int64_t end = g + r->block < cols ? g + r->block : cols;
            uint32_t tile_amax = 0;
            for (int64_t j = g; j < end; j++) tile_amax = amax[j] > tile_amax ? amax[j] : tile_amax;
            for (int64_t j = g; j < end; j++) amax[j] = tile_amax;
        }
    block_factors(amax, inverse, multiplier, cols, r);
    for (int64_t i = 0; i < rows; i++)
        quantize_lanes(x + i * inner, out + i * inner, noise ? noise + i * inner : NULL, 1, cols, inverse, multiplier, r);
}

/* noise: NULL (RNE) or one uniform draw per element of the reference's layout, which pads `length`
   to whole blocks: the draw of element (o, i, j) is noise[(o · padded_length + i) · inner + j]. */
static void qdq_blocks(const float *x, float *out, const float *noise, int64_t outer, int64_t length, int64_t inner,
                       int64_t block, const recipe_t *r, int threads) {
    int64_t blocks = (length + block - 1) / block, padded = blocks * block;
    if (inner == 1) { /* rows cut into groups of up to TILE blocks */
        int64_t groups = (blocks + TILE - 1) / TILE, span = TILE * block;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t k = 0; k < outer * groups; k++) {
            int64_t row = k / groups, start = (k % groups) * span;
            int64_t n = length - start < span ? length - start : span;
            const float *draws = noise ? noise + row * padded + start : NULL;
            qdq_row_blocks(x + row * length + start, out + row * length + start, draws, n, block, r);
        }
        return;
    }
    /* widths are multiples of `unit` up to `widest`; ceil(inner / tiles) ≤ widest, so the rounded
       width is too (the caller keeps a square block ≤ 256) */
    const int64_t unit = r->square ? block : 16, widest = COLUMN_TILE - COLUMN_TILE % unit;
    int64_t tiles = (inner + widest - 1) / widest;
    while (outer * blocks * tiles < 4 * (int64_t)threads && inner / (2 * tiles) >= 256) tiles *= 2;
    const int64_t width = ((inner + tiles - 1) / tiles + unit - 1) / unit * unit;
    tiles = (inner + width - 1) / width;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < outer * blocks * tiles; k++) {
        int64_t tile = k % tiles, b = (k / tiles) % blocks, o = k / (tiles * blocks);
        int64_t start = b * block, rows = length - start < block ? length - start : block;
        int64_t col = tile * width, cols = inner - col < width ? inner - col : width;
        const int64_t offset = (o * length + start) * inner + col;
        const float *draws = noise ? noise + (o * padded + start) * inner + col : NULL;
        qdq_column_blocks(x + offset, out + offset, draws, rows, inner, cols, r);
    }
}

/* The seeded randomized Hadamard transform of qlab.scaling.hadamard_transform, in its float32 order
   (x 1/4 first, the signs before the four butterfly stages, or after them for the inverse, stages of
   strides 8, 4, 2, 1), of v[p][j]: `positions` (a multiple of 16) along the axis times `lanes`,
   row-major with row stride `stride`. The lanes are independent, so every loop runs across them. */
#define HADAMARD_BUFFER 8192 /* floats in a work item: 32 KiB, so it stays in the L1/L2 cache */
static inline void rotate(float *v, int64_t positions, int64_t lanes, int64_t stride, const float *signs,
                          int inverse) {
    for (int64_t p = 0; p < positions; p++) {
        float sign = inverse ? 1.0f : signs[p % 16];
        float *row = v + p * stride;
        for (int64_t j = 0; j < lanes; j++) row[j] = row[j] * 0.25f * sign;
    }
    for (int64_t chunk = 0; chunk < positions; chunk += 16)
        for (int step = 8; step >= 1; step /= 2)
            for (int i = 0; i < 16; i++)
                if (!(i & step)) {
                    float *a = v + (chunk + i) * stride, *b = v + (chunk + i + step) * stride;
                    for (int64_t j = 0; j < lanes; j++) {
                        float sum = a[j] + b[j], difference = a[j] - b[j];
                        a[j] = sum;
                        b[j] = difference;
                    }
                }
    if (inverse)
        for (int64_t p = 0; p < positions; p++) {
            float *row = v + p * stride;
            for (int64_t j = 0; j < lanes; j++) row[j] *= signs[p % 16];
        }
}

/* How many of an item's lanes hold a position before the axis' end, at position offset p: positions
   run first + p + j · lane_step (lane_step 0: all lanes, or none, share one position). */
static inline int64_t lanes_in_axis(int64_t first, int64_t p, int64_t lane_step, int64_t lanes, int64_t length) {
    int64_t left = length - first - p;
    if (left <= 0) return 0;
    if (lane_step == 0) return lanes;
    int64_t n = (left + lane_step - 1) / lane_step;
    return n < lanes ? n : lanes;
}

/* One work item of hadamard_qdq; lane_stride is a literal 1 for columns, so those loops copy rows. */
static inline __attribute__((always_inline)) void hadamard_item(
    const float *restrict x, float *restrict out, const float *restrict noise, const float *signs, float *restrict v,
    int64_t length, int64_t first, int64_t lane_step, int64_t position_stride, int64_t lane_stride, int64_t lanes,
    const recipe_t *r, uint32_t *tensor_amax) {
    const int64_t block = r->block;
    uint32_t block_amax[TILE];
    float inverse[TILE], multiplier[TILE];
    for (int64_t p = 0; p < block; p++) {
        int64_t valid = lanes_in_axis(first, p, lane_step, lanes, length);
        const float *from = x + p * position_stride;
        float *row = v + p * lanes;
        for (int64_t j = 0; j < valid; j++) row[j] = from[j * lane_stride];
        for (int64_t j = valid; j < lanes; j++) row[j] = 0.0f; /* the reference's zero padding */
    }
    rotate(v, block, lanes, lanes, signs, 0);
    column_amax(v, block, lanes, lanes, block_amax);
    if (tensor_amax) {
        for (int64_t j = 0; j < lanes; j++) *tensor_amax = block_amax[j] > *tensor_amax ? block_amax[j] : *tensor_amax;
        return;
    }
    block_factors(block_amax, inverse, multiplier, lanes, r);
    for (int64_t p = 0; p < block; p++) /* the noise's padded layout has x's strides */
        quantize_lanes(v + p * lanes, v + p * lanes, noise ? noise + p * position_stride : NULL, lane_stride, lanes,
                       inverse, multiplier, r);
    rotate(v, block, lanes, lanes, signs, 1);
    for (int64_t p = 0; p < block; p++) {
        int64_t valid = lanes_in_axis(first, p, lane_step, lanes, length);
        float *to = out + p * position_stride;
        const float *row = v + p * lanes;
        for (int64_t j = 0; j < valid; j++) to[j * lane_stride] = row[j];
    }
}

#if GCC_VECTORS
/* Along a row the 16 positions of a transform are 16 consecutive floats: one vector, whose butterfly
   stages are lane shuffles. Stage `step` pairs lane i with u[i] = v[i ^ step]: the lower lane gets
   a + b = v + u, the upper a - b = u - v, computed as u + (-v) (IEEE subtraction is that addition;
   addition commutes), so one shuffle, one sign flip of the upper lanes and one add. NaNs may come out
   with another sign or payload than rotate()'s, but a NaN makes its block all NaN whatever its bits. */
static inline f32x16 butterfly(f32x16 v, i32x16 partner, u32x16 upper_sign) {
    f32x16 u = __builtin_shuffle(v, partner);
    return u + (f32x16)((u32x16)v ^ upper_sign);
}

/* rotate()'s butterflies where position i is the vector w[i] (the lanes are independent columns). */
static inline void rotate_vectors(f32x16 *w) {
    for (int step = 8; step >= 1; step /= 2)
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            if (!(i & step)) {
                f32x16 sum = w[i] + w[i + step], difference = w[i] - w[i + step];
                w[i] = sum;
                w[i + step] = difference;
            }
}

static inline f32x16 hadamard16(f32x16 v) {
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int step = 8; step >= 1; step /= 2)
        v = butterfly(v, lane ^ step, (u32x16)((lane & step) != 0) & 0x80000000u); /* true is all bits set */
    return v;
}

/* A row item of hadamard_qdq where every lane is a whole block inside the axis (block a multiple of
   16): each 16 positions rotated in registers into v, the block amaxes taken, then quantized from v
   into out and rotated back there. The noise is the row's, laid out as x. */
static void hadamard_row_item(const float *restrict x, float *restrict out, const float *restrict noise,
                              const float *signs, float *restrict v, int64_t lanes, const recipe_t *r,
                              uint32_t *tensor_amax) {
    const int64_t block = r->block, n = lanes * block;
    uint32_t amax[TILE];
    float inverse[TILE], multiplier[TILE];
    const f32x16 sign = load16(signs);
    if (tensor_amax) { /* the rotated tensor's amax alone: one running maximum, no block bookkeeping */
        u32x16 largest = {0};
        for (int64_t p = 0; p < n; p += 16) {
            __builtin_prefetch(x + p + PREFETCH_AHEAD, 0, 3);
            largest = vector_max(largest, (u32x16)hadamard16(load16(x + p) * 0.25f * sign) & 0x7FFFFFFFu);
        }
        uint32_t item_amax = lanes_max(largest);
        *tensor_amax = item_amax > *tensor_amax ? item_amax : *tensor_amax;
        return;
    }
    for (int64_t group = 0; group < lanes; group += 16) { /* TILE is a multiple of 16 */
        u32x16 largest[16] = {{0}};
        for (int64_t j = 0; j < 16 && group + j < lanes; j++)
            for (int64_t p = (group + j) * block; p < (group + j + 1) * block; p += 16) {
                __builtin_prefetch(x + p + PREFETCH_AHEAD, 0, 3);
                f32x16 rotated = hadamard16(load16(x + p) * 0.25f * sign);
                store16(v + p, rotated);
                largest[j] = vector_max(largest[j], (u32x16)rotated & 0x7FFFFFFFu);
            }
        u32x16 maxima = vectors_max(largest);
        memcpy(amax + group, &maxima, sizeof maxima);
    }
    block_factors(amax, inverse, multiplier, lanes, r);
    row_qdq_blocks(v, out, noise, lanes, block, inverse, multiplier, r);
    for (int64_t p = 0; p < n; p += 16) store16(out + p, hadamard16(load16(out + p) * 0.25f * 1.0f) * sign);
}

/* A column item of hadamard_qdq whose block lies inside the axis and whose lanes (columns, at row
   stride `stride`) come in whole groups of 16: for each group, the 16 positions of a transform are 16
   vectors whose butterflies pair whole vectors, so it runs in registers (no shuffles); v holds the
   group's rotated block (block × 16) between the amax and the quantization. */
static void hadamard_column_item(const float *restrict x, float *restrict out, const float *restrict noise,
                                 const float *signs, float *restrict v, int64_t stride, int64_t lanes,
                                 const recipe_t *r, uint32_t *tensor_amax) {
    const int64_t block = r->block;
    uint32_t amax[16];
    float inverse[16], multiplier[16];
    for (int64_t c = 0; c < lanes; c += 16) {
        u32x16 largest = {0};
        for (int64_t q = 0; q < block; q += 16) {
            f32x16 w[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {
                __builtin_prefetch(x + (q + i) * stride + c + 32, 0, 3); /* two groups ahead, as the row streams */
                w[i] = load16(x + (q + i) * stride + c) * 0.25f * signs[i];
            }
            rotate_vectors(w);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {
                largest = vector_max(largest, (u32x16)w[i] & 0x7FFFFFFFu);
                store16(v + (q + i) * 16, w[i]);
            }
        }
        if (tensor_amax) {
            uint32_t group_amax = lanes_max(largest);
            *tensor_amax = group_amax > *tensor_amax ? group_amax : *tensor_amax;
            continue;
        }
        memcpy(amax, &largest, sizeof amax);
        block_factors(amax, inverse, multiplier, 16, r);
        for (int64_t p = 0; p < block; p++)
            quantize_lanes(v + p * 16, v + p * 16, noise ? noise + p * stride + c : NULL, 1, 16, inverse, multiplier, r);
        for (int64_t q = 0; q < block; q += 16) {
            f32x16 w[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) w[i] = load16(v + (q + i) * 16) * 0.25f * 1.0f;
            rotate_vectors(w);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) store16(out + (q + i) * stride + c, w[i] * signs[i]);
        }
    }
}
#endif

/* qdq with the Hadamard transform around it, fused per work item: one block along the axis times up
   to `lanes_per_item` lanes is read into a local buffer v[p][j] (zero past the axis' end: the
   reference pads to whole blocks first), rotated, quantized there, rotated back and written to out,
   so the rotated tensor never goes through memory. Along the last axis (inner == 1) the lanes are a
   row's consecutive blocks: element (p, j) sits at position first + j·block + p; otherwise the lanes
   are columns and the positions rows. Where GCC builds the file, an item of whole blocks takes the
   register paths instead: hadamard_row_item along a row, hadamard_column_item for NVFP4's blocks of 16
   down 16 columns at a time (same bits). With `amax`, only the rotated tensor's amax (bits) is taken,
   for NVFP4's global scale, and nothing is written. */
static void hadamard_qdq(const float *x, float *out, const float *noise, const float *signs, int64_t outer,
                         int64_t length, int64_t inner, const recipe_t *r, int threads, uint32_t *amax) {
    const int64_t block = r->block, blocks = (length + block - 1) / block, padded = blocks * block;
    const int along_rows = inner == 1;
    int64_t lanes_per_item = HADAMARD_BUFFER / block < TILE ? HADAMARD_BUFFER / block : TILE;
    const int64_t lane_count = along_rows ? blocks : inner, slabs = along_rows ? 1 : blocks;
    const int64_t tiles = (lane_count + lanes_per_item - 1) / lanes_per_item;
    uint32_t tensor_amax = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max : tensor_amax)
    for (int64_t k = 0; k < outer * slabs * tiles; k++) {
        int64_t tile = k % tiles, slab = (k / tiles) % slabs, o = k / (tiles * slabs);
        int64_t lane = tile * lanes_per_item;
        int64_t lanes = lane_count - lane < lanes_per_item ? lane_count - lane : lanes_per_item;
        float v[HADAMARD_BUFFER];
        uint32_t *item_amax = amax ? &tensor_amax : NULL;
        if (along_rows && GCC_VECTORS && block % 16 == 0 && length % block == 0) {
#if GCC_VECTORS
            int64_t offset = o * length + lane * block;
            hadamard_row_item(x + offset, out + offset, noise ? noise + o * padded + lane * block : NULL, signs, v,
                              lanes, r, item_amax);
#endif
        } else if (along_rows) { /* (p, j) at position lane · block + j · block + p of row o */
            int64_t first = lane * block, offset = o * length + first;
            hadamard_item(x + offset, out + offset, noise ? noise + o * padded + first : NULL, signs, v, length,
                          first, block, 1, block, lanes, r, item_amax);
        } else if (GCC_VECTORS && block == 16 && slab * block + block <= length && lanes % 16 == 0) {
#if GCC_VECTORS
            int64_t offset = (o * length + slab * block) * inner + lane;
            const float *draws = noise ? noise + (o * padded + slab * block) * inner + lane : NULL;
            hadamard_column_item(x + offset, out + offset, draws, signs, v, inner, lanes, r, item_amax);
#endif
        } else { /* (p, j) at row slab · block + p, column lane + j */
            int64_t first = slab * block, offset = (o * length + first) * inner + lane;
            const float *draws = noise ? noise + (o * padded + first) * inner + lane : NULL;
            hadamard_item(x + offset, out + offset, draws, signs, v, length, first, 0, inner, 1, lanes, r, item_amax);
        }
    }
    if (amax) *amax = tensor_amax;
}

/* The bits of max |x| over n elements. */
static uint32_t tensor_amax_bits(const float *x, int64_t n, int threads) {
    uint32_t amax = 0;
    int64_t chunks = (n + 1023) / 1024;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max : amax)
    for (int64_t c = 0; c < chunks; c++) { /* chunks of 4 KiB, each prefetched a chunk ahead */
        const float *chunk = x + c * 1024;
        int64_t n_chunk = n - c * 1024 < 1024 ? n - c * 1024 : 1024;
        for (int64_t line = 0; line < 1024; line += 16) __builtin_prefetch(chunk + PREFETCH_AHEAD + line, 0, 3);
        uint32_t chunk_amax = n_chunk == 1024 ? block_amax(chunk, 1024) : block_amax(chunk, n_chunk);
        amax = chunk_amax > amax ? chunk_amax : amax;
    }
    return amax;
}

/* NVFP4's global factors from the tensor amax A (its bits): S_enc, S_dec and the rest. */
static void nvfp4_tensor_scale(uint32_t amax, recipe_t *r) {
    float tensor_amax = float_of(amax), encode = 1.0f;
    if (amax < 0x7F800000u && amax > 0) {
        encode = 2688.0f / tensor_amax;
        encode = encode < FLOAT32_MAX ? encode : FLOAT32_MAX;
    }
    r->tensor_amax = tensor_amax;
    r->decode = 1.0f / encode;
    r->encode_over_6 = encode * (float)(1.0 / 6.0);
    r->usual = amax < 0x7F800000u && encode < FLOAT32_MAX;
}

/* qdq_blocks, or hadamard_qdq when `signs` is given (NVFP4's tensor amax then the rotated one's). */
static void qdq(const float *x, float *out, const float *noise, const float *signs, int64_t outer, int64_t length,
                int64_t inner, int64_t block, recipe_t *r, int threads) {
    if (r->recipe == RECIPE_NVFP4 && r->global_scale) {
        uint32_t amax;
        if (signs)
            hadamard_qdq(x, out, noise, signs, outer, length, inner, r, threads, &amax);
        else
            amax = tensor_amax_bits(x, outer * length * inner, threads);
        nvfp4_tensor_scale(amax, r);
    }
    if (signs)
        hadamard_qdq(x, out, noise, signs, outer, length, inner, r, threads, NULL);
    else
        qdq_blocks(x, out, noise, outer, length, inner, block, r, threads);
}

void qlab_mx_qdq(const float *x, float *out, const float *noise, const float *signs, int64_t outer,
                 int64_t length, int64_t inner, int64_t block, int square, int mode, int mbits, int bias, int emax,
                 float elem_max, int threads) {
    recipe_t r = {.recipe = RECIPE_MX, .block = (int)block, .square = square, .mbits = mbits,
                  .min_field = 128 - bias, .elem_max = elem_max, .mode = mode, .emax = emax};
    qdq(x, out, noise, signs, outer, length, inner, block, &r, threads);
}

void qlab_nvfp4_qdq(const float *x, float *out, const float *noise, const float *signs,
                    int64_t outer, int64_t length, int64_t inner, int square, int global_scale, int threads) {
    recipe_t r = {.recipe = RECIPE_NVFP4, .block = 16, .square = square, .mbits = 1, .min_field = 127,
                  .elem_max = 6.0f, /* E2M1: 1 mantissa bit, bias 1 */
                  .global_scale = global_scale, .encode_over_6 = (float)(1.0 / 6.0)};
    qdq(x, out, noise, signs, outer, length, inner, 16, &r, threads);
}

/* FP8 current scaling per tensor (qlab.quantize.TensorwiseSpec, granularity "tensor", RNE; TE's
   formula as qlab.scaling.fp8_current_scale computes it): with A the tensor amax,
     scale = fl(fmt_max / max(A, eps)), the float32 max where that overflows, 1 where A is not finite
             or max(A, eps) is 0; with pow2 its mantissa bits zeroed;
     out   = round(x · scale) · fl(1/scale)  (NVIDIA: cuBLAS and TE multiply by scale_inv), or
             round(x · scale) / scale (torchao's convention),
   the rounding RNE to the element format, saturating at ±fmt_max (inf included). A NaN stays NaN with
   the bits torch's own float8 cast gives it back (sign, all-ones exponent, all-ones mantissa field:
   0x7FF00000 for E4M3), which the eager reference goes through. Two passes: the amax, then elements. */
void qlab_fp8_tensor_qdq(const float *x, float *out, int64_t n, int mbits, int bias, float fmt_max, float eps,
                         int pow2, int divide, int threads) {
    uint32_t amax_bits = tensor_amax_bits(x, n, threads);
    float amax = float_of(amax_bits), floored = amax < eps ? eps : amax, scale = 1.0f;
    if (amax_bits < 0x7F800000u && floored > 0.0f) {
        scale = fmt_max / floored;
        scale = scale < FLOAT32_MAX ? scale : FLOAT32_MAX;
    }
    if (pow2) scale = float_of(bits_of(scale) & 0x7F800000u);
    const float inverse = 1.0f / scale;
    const int min_field = 128 - bias;
    const uint32_t nan_bits = 0x7F800000u | (((1u << mbits) - 1) << (23 - mbits));
    int64_t chunks = (n + 1023) / 1024;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t start = c * 1024, end = n - start < 1024 ? n : start + 1024;
        for (int64_t i = start; i < end; i++) {
            float scaled = x[i] * scale;
            float rounded = round_rne(scaled, mbits, min_field, fmt_max);
            uint32_t nan = (bits_of(scaled) & 0x80000000u) | nan_bits;
            rounded = scaled == scaled ? rounded : float_of(nan);
            out[i] = divide ? rounded / scale : rounded * inverse;
        }
    }
}

/* Symmetric integer qdq (qlab.quantize.IntSpec, symmetric, RNE; qlab.scaling.int_symmetric_scale):
   scale = fl(amax / qmax), 1 where amax is not finite or the quotient is 0;
   out   = (round(clamp(x / scale, qmin, qmax)) + 0) · scale, RNE, -0 made +0 as integers have none
   (the add-and-subtract rounding below never gives -0); a NaN stays NaN (clamp and round keep it).
   The spec refuses inf and NaN eagerly; compiled code does not look, and gets the traced reference's
   values: scale 1 for a non-finite amax, ±inf clamped to qmax and qmin. One amax per tensor, or per line along `length` of the
   (outer, length, inner) view: a row of length elements (inner == 1) or a column of `length` rows. */
static inline float int_scale(uint32_t amax_bits, float qmax) {
    float scale = float_of(amax_bits) / qmax;
    return amax_bits < 0x7F800000u && scale > 0.0f ? scale : 1.0f;
}

static inline float int_qdq_element(float x, float scale, float qmin, float qmax) {
    float v = x / scale;
    v = v < qmin ? qmin : v; /* comparisons leave a NaN as it is */
    v = v > qmax ? qmax : v;
    return ((v + 12582912.0f) - 12582912.0f) * scale; /* 1.5 · 2^23: RNE to an integer for |v| < 2^22 */
}

void qlab_int_qdq(const float *x, float *out, int64_t outer, int64_t length, int64_t inner, int per_tensor,
                  float qmin, float qmax, int threads) {
    if (per_tensor) {
        int64_t n = outer * length * inner, chunks = (n + 1023) / 1024;
        const float scale = int_scale(tensor_amax_bits(x, n, threads), qmax);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t c = 0; c < chunks; c++)
            for (int64_t i = c * 1024; i < n && i < (c + 1) * 1024; i++) out[i] = int_qdq_element(x[i], scale, qmin, qmax);
        return;
    }
    if (inner == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t row = 0; row < outer; row++) {
            const float *line = x + row * length;
            const float scale = int_scale(block_amax(line, length), qmax);
            for (int64_t i = 0; i < length; i++) out[row * length + i] = int_qdq_element(line[i], scale, qmin, qmax);
        }
        return;
    }
    int64_t tiles = (inner + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < outer * tiles; k++) { /* TILE columns down the whole axis */
        int64_t o = k / tiles, col = (k % tiles) * TILE, cols = inner - col < TILE ? inner - col : TILE;
        const float *from = x + o * length * inner + col;
        float *to = out + o * length * inner + col;
        uint32_t amax[TILE];
        float scale[TILE];
        column_amax(from, length, inner, cols, amax);
        for (int64_t j = 0; j < cols; j++) scale[j] = int_scale(amax[j], qmax);
        for (int64_t i = 0; i < length; i++)
            for (int64_t j = 0; j < cols; j++)
                to[i * inner + j] = int_qdq_element(from[i * inner + j], scale[j], qmin, qmax);
    }
}

/* Stochastic rounding's uniform draws (qlab.formats.stochastic_noise) straight from the state of a
   torch CPU generator, as Tensor.random_ on int32 would draw them: `words` = ceil(count / 2) outputs
   of PyTorch's MT19937 (at::mt19937), each reduced mod 2^31; word i gives draw i = (word & 0x7FFF) · 2^-15
   and draw words + i = ((word >> 15) & 0x7FFF) · 2^-15 (the last high half is dropped for an odd count).
   `state` is the bytes of Generator.get_state(): the engine's `left` (int32) at byte 8, `next` (uint64)
   at 16 and its 624 words (as uint64) from 24; they are advanced in place. The Python side checks on
   first use that this gives random_'s numbers and leaves the generator where random_ leaves it. */
#define MT_N 624
#define MT_M 397

static inline uint32_t mt_twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7FFFFFFFu)) >> 1) ^ ((0u - (v & 1u)) & 0x9908B0DFu);
}

static void mt_next_state(uint32_t *restrict mt) {
    for (int i = 0; i < MT_N - MT_M; ++i) mt[i] = mt[i + MT_M] ^ mt_twist(mt[i], mt[i + 1]);
    for (int i = MT_N - MT_M; i < MT_N - 1; ++i) mt[i] = mt[i + MT_M - MT_N] ^ mt_twist(mt[i], mt[i + 1]);
    mt[MT_N - 1] = mt[MT_M - 1] ^ mt_twist(mt[MT_N - 1], mt[0]);
}

void qlab_stochastic_noise(uint8_t *state, float *restrict out, int64_t count) {
    int32_t left;
    uint64_t next, word;
    uint32_t mt[MT_N], tempered[MT_N];
    memcpy(&left, state + 8, 4);
    memcpy(&next, state + 16, 8);
    for (int i = 0; i < MT_N; ++i) {
        memcpy(&word, state + 24 + 8 * i, 8);
        mt[i] = (uint32_t)word;
    }
    const int64_t words = (count + 1) / 2, highs = count - words;
    const float step = 1.0f / 32768.0f;
    for (int64_t done = 0; done < words;) {
        if (left == 1) { /* random_'s next call regenerates the state and takes its first word */
            mt_next_state(mt);
            left = MT_N + 1;
            next = 0;
        }
        int64_t n = words - done < left - 1 ? words - done : left - 1;
        const uint32_t *source = mt + next;
        for (int64_t j = 0; j < n; ++j) {
            uint32_t y = source[j];
            y ^= y >> 11;
            y ^= (y << 7) & 0x9D2C5680u;
            y ^= (y << 15) & 0xEFC60000u;
            y ^= y >> 18;
            tempered[j] = y; /* random_ keeps it mod 2^31, which changes none of the 30 bits used */
        }
        for (int64_t j = 0; j < n; ++j) out[done + j] = (float)(tempered[j] & 0x7FFF) * step;
        int64_t n_high = highs - done < n ? highs - done : n;
        for (int64_t j = 0; j < n_high; ++j) out[words + done + j] = (float)((tempered[j] >> 15) & 0x7FFF) * step;
        next += n;
        left -= (int32_t)n;
        done += n;
    }
    memcpy(state + 8, &left, 4);
    memcpy(state + 16, &next, 8);
    for (int i = 0; i < MT_N; ++i) {
        word = mt[i];
        memcpy(state + 24 + 8 * i, &word, 8);
    }
}
