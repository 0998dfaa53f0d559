/* GGUF's block formats multiplied where they lie: y = x·Wᵀ with W read from the file's mapping.

What this file owns: turning a row of a GGUF tensor (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
F16, BF16 or F32) into float32 values exactly as ggml defines them, and the products of float32
activations with such rows, for any number of activation rows, over OpenMP threads. Nothing is
converted ahead of time and nothing is copied: a weight is a list of segments (a tensor's rows,
each segment in its own format, optionally through a row map), pointing into the mapping.

Two kinds of product, chosen per matrix (BlockMatrix.activation_bits): float32 activations times
the weights dequantised per block, the fp32 product of the file's own weights up to summation order
(this file); or activations rounded to 8 bits per group of 16 times the blocks' integer codes, by
integer dot products as llama.cpp does (blocks_q8.c, dtype auto's default).

Batch independence: every output y[m][n] is the same sequence of float operations whatever the
number of rows, the row's place in the batch, the thread count or the tile it falls in: rows of W
are dequantised into a buffer and every activation row is dotted with four weight rows at a time
by one function whose per-row arithmetic does not depend on its neighbours. A verify pass
therefore gives the logits of the decode steps it stands for.

Instruction sets are chosen when the file is compiled for the machine (-march=native, see
build.py): AVX-512F, AVX2 with FMA, or portable C with no intrinsics (POLYLANE_PORTABLE, or any
other CPU, ARM included).
*/
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(POLYLANE_PORTABLE) && defined(__AVX512F__)
#define ISA_AVX512 1
#include <immintrin.h>
#elif !defined(POLYLANE_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define ISA_AVX2 1
#include <immintrin.h>
#elif !defined(POLYLANE_PORTABLE) && defined(__F16C__)
#include <immintrin.h>
#endif

/* ggml's type ids (the values stored in a GGUF tensor info) */
enum {
    GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_BF16 = 30
};

#define TILE_ROWS 4       /* weight rows dequantised together and dotted with each activation row */
#define X_BLOCK_BYTES (256 * 1024) /* activation rows taken per pass over W (kept in L2) */

typedef struct {
    int64_t type;
    const uint8_t *data;    /* the tensor's first row in the mapping */
    int64_t rows;           /* output rows this segment gives */
    const int64_t *row_map; /* NULL: rows in order; else the tensor row of each output row */
} Segment;

typedef struct {
    int64_t in_features;
    int64_t out_features;
    int64_t num_segments;
    const Segment *segments;
    const float *bias; /* NULL or out_features floats */
    int64_t activation_bits; /* 32: float32 activations; 8: rounded to 8 bits (blocks_q8.c) */
} BlockMatrix;

/* The binary interface Python checks before it binds (runtime/model/native/abi.py): a version that changes
   whenever a struct Python mirrors changes, and each mirrored struct's size and fields' places. */
#define POLYLANE_ABI_VERSION 1
typedef struct {
    const char *structure;
    const char *field; /* "" for the struct's own size */
    int64_t offset;
    int64_t size;
} AbiField;
#define ABI_SIZE(type) {#type, "", 0, (int64_t)sizeof(type)}
#define ABI_FIELD(type, name) {#type, #name, (int64_t)offsetof(type, name), (int64_t)sizeof(((type *)0)->name)}

int64_t polylane_abi_version(void) { return POLYLANE_ABI_VERSION; }

static const AbiField BLOCKS_ABI[] = {
    ABI_SIZE(Segment),
    ABI_FIELD(Segment, type),
    ABI_FIELD(Segment, data),
    ABI_FIELD(Segment, rows),
    ABI_FIELD(Segment, row_map),
    ABI_SIZE(BlockMatrix),
    ABI_FIELD(BlockMatrix, in_features),
    ABI_FIELD(BlockMatrix, out_features),
    ABI_FIELD(BlockMatrix, num_segments),
    ABI_FIELD(BlockMatrix, segments),
    ABI_FIELD(BlockMatrix, bias),
    ABI_FIELD(BlockMatrix, activation_bits),
};

/* The layout of Segment and BlockMatrix (*fields), and how many entries it has. */
int64_t polylane_blocks_abi(const AbiField **fields) {
    *fields = BLOCKS_ABI;
    return (int64_t)(sizeof BLOCKS_ABI / sizeof BLOCKS_ABI[0]);
}

int polylane_blocks_isa(void) {
#if defined(ISA_AVX512)
    return 2;
#elif defined(ISA_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------- formats */

#if !defined(POLYLANE_PORTABLE) && defined(__F16C__)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0) {
        float value = (float)mantissa * 5.9604644775390625e-08f; /* subnormal: mantissa · 2^-24 */
        return sign ? -value : value;
    }
    if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    float value;
    memcpy(&value, &bits, 4);
    return value;
}
#endif

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Elements per block and bytes per block of a type; 0 for a type without a kernel. Inlined where
   the kernels ask (per tile, and per span with a constant type in the per-format loops); the
   exported function below goes through the PLT, a call each time. */
static inline int64_t block_geometry(int64_t type, int64_t *block_bytes) {
    switch (type) {
    case GGML_F32: *block_bytes = 4; return 1;
    case GGML_F16: *block_bytes = 2; return 1;
    case GGML_BF16: *block_bytes = 2; return 1;
    case GGML_Q4_0: *block_bytes = 18; return 32;
    case GGML_Q4_1: *block_bytes = 20; return 32;
    case GGML_Q5_0: *block_bytes = 22; return 32;
    case GGML_Q5_1: *block_bytes = 24; return 32;
    case GGML_Q8_0: *block_bytes = 34; return 32;
    case GGML_Q4_K: *block_bytes = 144; return 256;
    case GGML_Q5_K: *block_bytes = 176; return 256;
    case GGML_Q6_K: *block_bytes = 210; return 256;
    default: *block_bytes = 0; return 0;
    }
}

int64_t polylane_blocks_geometry(int64_t type, int64_t *block_bytes) { return block_geometry(type, block_bytes); }

static inline int64_t block_row_bytes(int64_t type, int64_t k) {
    int64_t block_bytes;
    int64_t elements = block_geometry(type, &block_bytes);
    return elements ? k / elements * block_bytes : 0;
}

#if !defined(POLYLANE_PORTABLE) && defined(__AVX2__)
/* The cache lines over `bytes` from `at` read ahead into L1 (NULL: none): the weights' read-aheads
   (blocks_q8_decode.c) and the AVX2 attention's (stack_avx2.c; stack_avx512.c reads the KV cache
   ahead into L2, read_kv_ahead). */
static inline __attribute__((always_inline)) void read_ahead(const void *at, int64_t bytes) {
    if (at == NULL) return;
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)at + line, _MM_HINT_T0);
}

#define SIMD_DEQUANTISE 1
/* The hot formats with AVX2 intrinsics: the same float operations, in the same order, as the C of
   `dequantise_row` (a product then a sum, never fused), so both give the same bits. */

/* 16 int32 codes (two halves of 8) minus `bias`, as float, times `scale` (+ `offset` if `add`,
   − `offset` if `subtract`) into out[0..15]. */
static inline void codes16(__m128i bytes, int signed_bytes, int bias, __m256 scale, __m256 offset, int mode,
                           float *out) {
    __m256i first = signed_bytes ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    __m256i second = signed_bytes ? _mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)) : _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    if (bias) {
        first = _mm256_sub_epi32(first, _mm256_set1_epi32(bias));
        second = _mm256_sub_epi32(second, _mm256_set1_epi32(bias));
    }
    __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(first), scale), b = _mm256_mul_ps(_mm256_cvtepi32_ps(second), scale);
    if (mode == 1) {
        a = _mm256_add_ps(a, offset);
        b = _mm256_add_ps(b, offset);
    } else if (mode == 2) {
        a = _mm256_sub_ps(a, offset);
        b = _mm256_sub_ps(b, offset);
    }
    _mm256_storeu_ps(out, a);
    _mm256_storeu_ps(out + 8, b);
}

/* 16 bits of `bits` (from bit `first`) as 16 bytes 0x10 or 0: Q5's fifth bits. */
static inline __m128i fifth_bits(uint32_t bits, int first) {
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)(bits >> first)),
                                            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m128i masks = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, (char)128, 1, 2, 4, 8, 16, 32, 64, (char)128);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, masks), masks), _mm_set1_epi8(0x10));
}

static int simd_dequantise_row(int64_t type, const uint8_t *restrict row, int64_t k, float *restrict y) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256 zero = _mm256_setzero_ps();
    switch (type) {
    case GGML_Q4_0:
        for (int64_t b = 0; b < k / 32; b++, row += 18, y += 32) {
            const __m256 d = _mm256_set1_ps(half_at(row));
            const __m128i qs = _mm_loadu_si128((const __m128i *)(row + 2));
            codes16(_mm_and_si128(qs, low4), 0, 8, d, zero, 0, y);
            codes16(_mm_and_si128(_mm_srli_epi16(qs, 4), low4), 0, 8, d, zero, 0, y + 16);
        }
        return 1;
    case GGML_Q4_1:
        for (int64_t b = 0; b < k / 32; b++, row += 20, y += 32) {
            const __m256 d = _mm256_set1_ps(half_at(row)), m = _mm256_set1_ps(half_at(row + 2));
            const __m128i qs = _mm_loadu_si128((const __m128i *)(row + 4));
            codes16(_mm_and_si128(qs, low4), 0, 0, d, m, 1, y);
            codes16(_mm_and_si128(_mm_srli_epi16(qs, 4), low4), 0, 0, d, m, 1, y + 16);
        }
        return 1;
    case GGML_Q5_0:
        for (int64_t b = 0; b < k / 32; b++, row += 22, y += 32) {
            const __m256 d = _mm256_set1_ps(half_at(row));
            uint32_t qh;
            memcpy(&qh, row + 2, 4);
            const __m128i qs = _mm_loadu_si128((const __m128i *)(row + 6));
            codes16(_mm_or_si128(_mm_and_si128(qs, low4), fifth_bits(qh, 0)), 0, 16, d, zero, 0, y);
            codes16(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), low4), fifth_bits(qh, 16)), 0, 16, d, zero, 0, y + 16);
        }
        return 1;
    case GGML_Q8_0:
        for (int64_t b = 0; b < k / 32; b++, row += 34, y += 32) {
            const __m256 d = _mm256_set1_ps(half_at(row));
            codes16(_mm_loadu_si128((const __m128i *)(row + 2)), 1, 0, d, zero, 0, y);
            codes16(_mm_loadu_si128((const __m128i *)(row + 18)), 1, 0, d, zero, 0, y + 16);
        }
        return 1;
    case GGML_Q4_K:
        for (int64_t b = 0; b < k / 256; b++, row += 144) {
            const float d = half_at(row), dmin = half_at(row + 2);
            const uint8_t *scales = row + 4, *q = row + 16;
            for (int j = 0; j < 4; j++, q += 32, y += 64) {
                uint8_t scale, min;
                scale_min_k4(2 * j, scales, &scale, &min);
                const __m256 d1 = _mm256_set1_ps(d * scale), m1 = _mm256_set1_ps(dmin * min);
                scale_min_k4(2 * j + 1, scales, &scale, &min);
                const __m256 d2 = _mm256_set1_ps(d * scale), m2 = _mm256_set1_ps(dmin * min);
                for (int half = 0; half < 2; half++) {
                    const __m128i qs = _mm_loadu_si128((const __m128i *)(q + 16 * half));
                    codes16(_mm_and_si128(qs, low4), 0, 0, d1, m1, 2, y + 16 * half);
                    codes16(_mm_and_si128(_mm_srli_epi16(qs, 4), low4), 0, 0, d2, m2, 2, y + 32 + 16 * half);
                }
            }
        }
        return 1;
    }
    return 0;
}
#endif

/* One row of k elements of `type` at `row` as float32, the values ggml's dequantize_row_* gives. */
static void dequantise_row(int64_t type, const uint8_t *restrict row, int64_t k, float *restrict y) {
#ifdef SIMD_DEQUANTISE
    if (simd_dequantise_row(type, row, k, y)) return;
#endif
    switch (type) {
    case GGML_F32:
        memcpy(y, row, (size_t)k * 4);
        return;
    case GGML_F16:
        for (int64_t i = 0; i < k; i++) y[i] = half_at(row + 2 * i);
        return;
    case GGML_BF16:
        for (int64_t i = 0; i < k; i++) {
            uint16_t h;
            memcpy(&h, row + 2 * i, 2);
            uint32_t bits = (uint32_t)h << 16;
            memcpy(y + i, &bits, 4);
        }
        return;
    case GGML_Q4_0:
        for (int64_t b = 0; b < k / 32; b++, row += 18, y += 32) {
            const float d = half_at(row);
            const uint8_t *restrict qs = row + 2;
            for (int j = 0; j < 16; j++) y[j] = (float)((qs[j] & 0xF) - 8) * d;
            for (int j = 0; j < 16; j++) y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
        }
        return;
    case GGML_Q4_1:
        for (int64_t b = 0; b < k / 32; b++, row += 20, y += 32) {
            const float d = half_at(row), m = half_at(row + 2);
            const uint8_t *restrict qs = row + 4;
            for (int j = 0; j < 16; j++) y[j] = (float)(qs[j] & 0xF) * d + m;
            for (int j = 0; j < 16; j++) y[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
        return;
    case GGML_Q5_0:
        for (int64_t b = 0; b < k / 32; b++, row += 22, y += 32) {
            const float d = half_at(row);
            uint32_t qh;
            memcpy(&qh, row + 2, 4);
            const uint8_t *restrict qs = row + 6;
            for (int j = 0; j < 16; j++) y[j] = (float)((int)((qs[j] & 0xF) | (((qh >> j) << 4) & 0x10)) - 16) * d;
            for (int j = 0; j < 16; j++) y[j + 16] = (float)((int)((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16) * d;
        }
        return;
    case GGML_Q5_1:
        for (int64_t b = 0; b < k / 32; b++, row += 24, y += 32) {
            const float d = half_at(row), m = half_at(row + 2);
            uint32_t qh;
            memcpy(&qh, row + 4, 4);
            const uint8_t *restrict qs = row + 8;
            for (int j = 0; j < 16; j++) y[j] = (float)((qs[j] & 0xF) | (((qh >> j) << 4) & 0x10)) * d + m;
            for (int j = 0; j < 16; j++) y[j + 16] = (float)((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) * d + m;
        }
        return;
    case GGML_Q8_0:
        for (int64_t b = 0; b < k / 32; b++, row += 34, y += 32) {
            const float d = half_at(row);
            const int8_t *qs = (const int8_t *)(row + 2);
            for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
        }
        return;
    case GGML_Q4_K:
        for (int64_t b = 0; b < k / 256; b++, row += 144) {
            const float d = half_at(row), dmin = half_at(row + 2);
            const uint8_t *scales = row + 4, *q = row + 16;
            for (int j = 0; j < 4; j++, q += 32, y += 64) {
                uint8_t scale, min;
                scale_min_k4(2 * j, scales, &scale, &min);
                const float d1 = d * scale, m1 = dmin * min;
                scale_min_k4(2 * j + 1, scales, &scale, &min);
                const float d2 = d * scale, m2 = dmin * min;
                for (int l = 0; l < 32; l++) y[l] = d1 * (float)(q[l] & 0xF) - m1;
                for (int l = 0; l < 32; l++) y[32 + l] = d2 * (float)(q[l] >> 4) - m2;
            }
        }
        return;
    case GGML_Q5_K:
        for (int64_t b = 0; b < k / 256; b++, row += 176) {
            const float d = half_at(row), dmin = half_at(row + 2);
            const uint8_t *scales = row + 4, *qh = row + 16, *ql = row + 48;
            for (int j = 0; j < 4; j++, ql += 32, y += 64) {
                uint8_t scale, min;
                scale_min_k4(2 * j, scales, &scale, &min);
                const float d1 = d * scale, m1 = dmin * min;
                scale_min_k4(2 * j + 1, scales, &scale, &min);
                const float d2 = d * scale, m2 = dmin * min;
                const uint8_t bit1 = (uint8_t)(1u << (2 * j)), bit2 = (uint8_t)(2u << (2 * j));
                for (int l = 0; l < 32; l++) y[l] = d1 * (float)((ql[l] & 0xF) + (qh[l] & bit1 ? 16 : 0)) - m1;
                for (int l = 0; l < 32; l++) y[32 + l] = d2 * (float)((ql[l] >> 4) + (qh[l] & bit2 ? 16 : 0)) - m2;
            }
        }
        return;
    case GGML_Q6_K:
        for (int64_t b = 0; b < k / 256; b++, row += 210) {
            const float d = half_at(row + 208);
            const uint8_t *restrict ql = row, *restrict qh = row + 128;
            const int8_t *sc = (const int8_t *)(row + 192);
            for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128) {
                /* ggml's order: quarter q of the 128 (element l + 32q) takes scale sc[l / 16 + 2q];
                   its low 4 bits from ql (quarters 0, 1: low nibbles of ql[l], ql[l + 32]; 2, 3:
                   their high nibbles), its high 2 bits from qh[l] >> 2q */
#if !defined(POLYLANE_PORTABLE) && defined(__AVX2__)
#define Q6_PART(q, part, low, shift_low)                                                          \
    do {                                                                                          \
        const __m256 scale = _mm256_set1_ps(d * (float)sc[(part) + 2 * (q)]);                     \
        const __m128i mask4 = _mm_set1_epi8(0x0F), mask2 = _mm_set1_epi8(3);                      \
        const __m128i lo = _mm_and_si128(                                                         \
            _mm_srli_epi16(_mm_loadu_si128((const __m128i *)((low) + 16 * (part))), shift_low), mask4); \
        const __m128i hi = _mm_slli_epi16(                                                        \
            _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(qh + 16 * (part))), 2 * (q)), mask2), 4); \
        const __m128i codes = _mm_or_si128(lo, hi);                                               \
        const __m256i bias = _mm256_set1_epi32(32);                                               \
        const __m256i first = _mm256_sub_epi32(_mm256_cvtepu8_epi32(codes), bias);                \
        const __m256i second = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)), bias); \
        float *out = y + 32 * (q) + 16 * (part);                                                  \
        _mm256_storeu_ps(out, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(first)));                   \
        _mm256_storeu_ps(out + 8, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(second)));              \
    } while (0)
#else
#define Q6_PART(q, part, low, shift_low)                                                          \
    do {                                                                                          \
        const float scale = d * (float)sc[(part) + 2 * (q)];                                      \
        for (int l = 16 * (part); l < 16 * (part) + 16; l++)                                      \
            y[32 * (q) + l] = scale * (float)(((((low)[l] >> (shift_low)) & 0xF) |                \
                                               (((qh[l] >> (2 * (q))) & 3) << 4)) - 32);            \
    } while (0)
#endif
                Q6_PART(0, 0, ql, 0);
                Q6_PART(0, 1, ql, 0);
                Q6_PART(1, 0, ql + 32, 0);
                Q6_PART(1, 1, ql + 32, 0);
                Q6_PART(2, 0, ql, 4);
                Q6_PART(2, 1, ql, 4);
                Q6_PART(3, 0, ql + 32, 4);
                Q6_PART(3, 1, ql + 32, 4);
#undef Q6_PART
            }
        }
        return;
    }
}

/* ---------------------------------------------------------------- dot products */

/* out[r] = x · w[r] for r < TILE_ROWS (rows `ld` floats apart), k a multiple of 32. Each row's
   sum is the same operations in the same order whatever the other rows hold. */
static void tile_dots(const float *x, const float *w, int64_t ld, int64_t k, float *out) {
#if defined(ISA_AVX512)
    __m512 acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
        for (int r = 0; r < TILE_ROWS; r++) {
            acc[r][0] = _mm512_fmadd_ps(x0, _mm512_loadu_ps(w + r * ld + i), acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(x1, _mm512_loadu_ps(w + r * ld + i + 16), acc[r][1]);
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#elif defined(ISA_AVX2)
    __m256 acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        for (int r = 0; r < TILE_ROWS; r++) {
            acc[r][0] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w + r * ld + i), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w + r * ld + i + 8), acc[r][1]);
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) {
        const __m256 sum8 = _mm256_add_ps(acc[r][0], acc[r][1]);
        __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
        sum4 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
        sum4 = _mm_add_ss(sum4, _mm_movehdup_ps(sum4));
        out[r] = _mm_cvtss_f32(sum4);
    }
#else
    float acc[TILE_ROWS][8];
    for (int r = 0; r < TILE_ROWS; r++)
        for (int j = 0; j < 8; j++) acc[r][j] = 0.0f;
    for (int64_t i = 0; i < k; i += 8)
        for (int r = 0; r < TILE_ROWS; r++)
            for (int j = 0; j < 8; j++) acc[r][j] += x[i + j] * w[r * ld + i + j];
    for (int r = 0; r < TILE_ROWS; r++)
        out[r] = ((acc[r][0] + acc[r][4]) + (acc[r][2] + acc[r][6])) + ((acc[r][1] + acc[r][5]) + (acc[r][3] + acc[r][7]));
#endif
}

/* ---------------------------------------------------------------- products */

/* The tensor row and segment behind output row n. */
static const uint8_t *source_row(const BlockMatrix *w, int64_t n, int64_t *type) {
    for (int64_t s = 0; s < w->num_segments; s++) {
        const Segment *segment = &w->segments[s];
        if (n < segment->rows) {
            const int64_t row = segment->row_map ? segment->row_map[n] : n;
            *type = segment->type;
            return segment->data + row * block_row_bytes(segment->type, w->in_features);
        }
        n -= segment->rows;
    }
    *type = -1;
    return NULL;
}

/* Checks a matrix before it is used: every segment's format has a kernel and whole blocks, rows
   add up. 0 when usable, else the index + 1 of the first bad segment (or -1: rows/columns). */
int polylane_blocks_check(const BlockMatrix *w) {
    int64_t rows = 0;
    if (w->in_features % 32) return -1;
    for (int64_t s = 0; s < w->num_segments; s++) {
        int64_t block_bytes;
        const int64_t elements = block_geometry(w->segments[s].type, &block_bytes);
        if (elements == 0 || w->in_features % elements) return (int)s + 1;
        rows += w->segments[s].rows;
    }
    return rows == w->out_features ? 0 : -1;
}

#include "blocks_q8.c" /* the 8-bit activation products */

/* y (rows, out_features) = x (rows, in_features) · Wᵀ + bias. 0, or 1 when scratch memory ran out. */
int polylane_blocks_matmul(const BlockMatrix *w, const float *x, int64_t rows, float *y, int threads) {
    if (w->activation_bits == 8 && coded_matrix(w)) return coded_matmul(w, x, rows, y, threads);
    const int64_t k = w->in_features, n_total = w->out_features;
    const int64_t tiles = (n_total + TILE_ROWS - 1) / TILE_ROWS;
    int64_t x_block = X_BLOCK_BYTES / (k * 4);
    if (x_block < 16) x_block = 16;
    if (threads < 1) threads = 1;
    float *buffers = (float *)calling_thread_scratch((size_t)(threads * TILE_ROWS * k) * sizeof(float));
    if (buffers == NULL) return 1;
#pragma omp parallel num_threads(threads)
    {
        float *buffer = buffers + (int64_t)omp_get_thread_num() * TILE_ROWS * k;
        for (int64_t m0 = 0; m0 < rows; m0 += x_block) {
            const int64_t m1 = m0 + x_block < rows ? m0 + x_block : rows;
#pragma omp for schedule(static)
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t n0 = tile * TILE_ROWS;
                const int64_t count = n0 + TILE_ROWS <= n_total ? TILE_ROWS : n_total - n0;
                for (int64_t r = 0; r < TILE_ROWS; r++) {
                    if (r < count) {
                        int64_t type;
                        const uint8_t *source = source_row(w, n0 + r, &type);
                        dequantise_row(type, source, k, buffer + r * k);
                    } else {
                        memcpy(buffer + r * k, buffer, (size_t)k * sizeof(float));
                    }
                }
                for (int64_t m = m0; m < m1; m++) {
                    float out[TILE_ROWS];
                    tile_dots(x + m * k, buffer, k, k, out);
                    for (int64_t r = 0; r < count; r++)
                        y[m * n_total + n0 + r] = w->bias ? out[r] + w->bias[n0 + r] : out[r];
                }
            }
        }
    }
    return 0;
}

/* Rows `ids` (count of them) of a (?, k) tensor of `type` as float32 into out (count, k): the
   embedding lookup. */
void polylane_blocks_rows(int64_t type, const uint8_t *data, int64_t k, const int64_t *ids, int64_t count, float *out) {
    const int64_t stride = block_row_bytes(type, k);
    for (int64_t i = 0; i < count; i++) dequantise_row(type, data + ids[i] * stride, k, out + i * k);
}
