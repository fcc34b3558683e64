/* MX quantize-dequantize on the CPU, in one pass per block: the reference is qlab.quantize.qdq.

   x is float32, contiguous, viewed as (outer, length, inner); blocks of `block` elements run along
   `length` (the scale axis), so inner == 1 is the last axis. The last block may be partial: the
   reference pads with zeros, which change no amax. Per block (OCP MX v1.0, qlab.scaling):

     amax   = max |x| over the block (NaN if any element is NaN)
     b      = the E8M0 byte of amax for `mode` (floor, ceil, even, rceil), in [0, 254]
     X      = 2^(b - 127) (the float32 subnormal 2^-127 for b = 0);  1/X from the bits (254 - b) << 23
     out    = round_rne(min(|x / X|, elem_max)) * sign(x) * X       (element format: mbits, bias)
     a non-finite amax (NaN or inf): the block is all NaN (0x7FC00000, as 0 * NaN gives in torch).

   Rounding is the add-and-subtract trick of qlab.formats._cast_rne_float32: adding 2^(e + 23 - m)
   to a float32 of exponent e rounds it to m mantissa bits, ties to even, with e clamped below at the
   element's smallest normal exponent so its subnormals share one quantum. Build with
   -ffp-contract=off: a fused multiply-add would change the bits. */

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { MODE_FLOOR = 0, MODE_CEIL = 1, MODE_EVEN = 2, MODE_RCEIL = 3 };
#define TILE 256 /* columns handled together when blocks run down a non-last axis */

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

/* The E8M0 byte of a finite float32 amax (qlab.scaling._mx_biased_exponent). */
static inline int32_t biased_exponent(float amax, int mode, int mbits, int emax, float elem_max) {
    if (mode == MODE_RCEIL) {
        float descale = amax / elem_max;
        uint32_t bits = bits_of(descale);
        int32_t exponent = (int32_t)((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0);
        if (descale < 0x1p-126f) exponent = descale > 0x1p-127f ? -126 : -127;
        if (exponent > 127) exponent = 127;
        if (exponent < -127) exponent = -127;
        return exponent + 127;
    }
    uint32_t bits = bits_of(amax);
    if (mode == MODE_EVEN) bits = (bits + (1u << (22 - mbits))) & 0x7F800000u;
    int32_t field = (int32_t)((bits >> 23) & 0xFF);
    if (mode == MODE_CEIL) field += (bits & 0x7FFFFF) != 0;
    field -= emax;
    return field < 0 ? 0 : (field > 254 ? 254 : field);
}

/* x rounded to the element format, ties to even, saturating at elem_max; x is never NaN here.
   Written with bit operations and a plain comparison (not fminf/copysignf) so that it vectorizes. */
static inline float round_element(float scaled, int mbits, int min_field, float elem_max) {
    uint32_t bits = bits_of(scaled);
    float magnitude = float_of(bits & 0x7FFFFFFFu);
    magnitude = magnitude < elem_max ? magnitude : elem_max;
    int32_t field = (int32_t)(bits_of(magnitude) >> 23);
    field = field < min_field ? min_field : field;
    float magic = float_of((uint32_t)(field + 23 - mbits) << 23);
    float rounded = (magnitude + magic) - magic;
    return float_of(bits_of(rounded) | (bits & 0x80000000u));
}

typedef struct {
    int mode, mbits, min_field, emax;
    float elem_max;
} mx_format;

/* X and 1/X for a block whose largest |x| has the bits `amax` (the bits of |x| order as the
   magnitudes do, and any NaN lies above inf); returns 0 for a non-finite amax. */
static inline int block_scale(uint32_t amax, const mx_format *f, float *scale, float *inverse) {
    if (amax >= 0x7F800000u) return 0; /* NaN or inf */
    int32_t b = biased_exponent(float_of(amax), f->mode, f->mbits, f->emax, f->elem_max);
    *scale = b == 0 ? float_of(1u << 22) : float_of((uint32_t)b << 23);
    *inverse = float_of((uint32_t)(254 - b) << 23);
    return 1;
}

static inline void qdq_row_block(const float *restrict x, float *restrict out, int64_t n, const mx_format *f) {
    uint32_t amax = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
        amax = a > amax ? a : amax;
    }
    float scale, inverse;
    if (!block_scale(amax, f, &scale, &inverse)) {
        for (int64_t i = 0; i < n; i++) out[i] = float_of(0x7FC00000u);
        return;
    }
    const int mbits = f->mbits, min_field = f->min_field;
    const float elem_max = f->elem_max;
    for (int64_t i = 0; i < n; i++) out[i] = round_element(x[i] * inverse, mbits, min_field, elem_max) * scale;
}

/* Blocks of `rows` rows (stride `inner`) times `cols` columns starting at x. */
static void qdq_column_blocks(const float *restrict x, float *restrict out, int64_t rows, int64_t inner, int64_t cols,
                              const mx_format *f) {
    uint32_t amax[TILE];
    float scale[TILE], inverse[TILE];
    for (int64_t j = 0; j < cols; j++) amax[j] = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * inner;
        for (int64_t j = 0; j < cols; j++) {
            uint32_t a = bits_of(row[j]) & 0x7FFFFFFFu;
            amax[j] = a > amax[j] ? a : amax[j];
        }
    }
    for (int64_t j = 0; j < cols; j++) {
        if (!block_scale(amax[j], f, &scale[j], &inverse[j])) {
            scale[j] = float_of(0x7FC00000u);
            inverse[j] = 0.0f; /* 0 * anything finite is ±0, times the NaN scale: NaN */
        }
    }
    const int mbits = f->mbits, min_field = f->min_field;
    const float elem_max = f->elem_max;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * inner;
        float *row_out = out + r * inner;
        for (int64_t j = 0; j < cols; j++) {
            float scaled = row[j] * inverse[j];
            scaled = scaled == scaled ? scaled : 0.0f; /* x = NaN or inf in a NaN block */
            row_out[j] = round_element(scaled, mbits, min_field, elem_max) * scale[j];
        }
    }
}

void qlab_mx_qdq(const float *x, float *out, int64_t outer, int64_t length, int64_t inner, int64_t block,
                 int mode, int mbits, int bias, int emax, float elem_max, int threads) {
    mx_format f = {mode, mbits, 128 - bias, emax, elem_max};
    int64_t blocks = (length + block - 1) / block;
    if (inner == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t k = 0; k < outer * blocks; k++) {
            int64_t row = k / blocks, start = (k % blocks) * block;
            int64_t n = length - start < block ? length - start : block;
            const int64_t offset = row * length + start;
            if (n == 32)  /* the MX block: a constant trip count, which the compiler unrolls */
                qdq_row_block(x + offset, out + offset, 32, &f);
            else
                qdq_row_block(x + offset, out + offset, n, &f);
        }
        return;
    }
    int64_t tiles = (inner + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < outer * blocks * tiles; k++) {
        int64_t tile = k % tiles, b = (k / tiles) % blocks, o = k / (tiles * blocks);
        int64_t start = b * block, rows = length - start < block ? length - start : block;
        int64_t col = tile * TILE, cols = inner - col < TILE ? inner - col : TILE;
        const int64_t offset = (o * length + start) * inner + col;
        qdq_column_blocks(x + offset, out + offset, rows, inner, cols, &f);
    }
}
