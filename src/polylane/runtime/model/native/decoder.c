/* The whole layer stack of a Llama/Qwen2/Gemma 3 decoder, for a few tokens at a time.
 *
 * What this file owns: one call that runs every layer (RMSNorm, fused QKV, per-head QK norms,
 * RoPE, paged-KV write, grouped-query attention over the paged KV cache, global or sliding-window,
 * output projection, gated SiLU or GELU MLP, Gemma's norms after attention and MLP, residuals),
 * the final norm and the output projection for a flat batch of T tokens, in place of the ~45
 * eager torch ops per layer whose fixed costs dominate a decode step (docs/profile.md). Python
 * builds the model description once (runtime/model/native/stack.py) and the per-forward index arrays;
 * this file does arithmetic only and allocates nothing that outlives a call. Activations, norms
 * and attention are float32; the KV cache is bf16 or float32. The layer arithmetic outside the
 * matrix products (attention, e^x, the MLP's gate, bf16 stores) is in stack_avx512.c where the CPU
 * has AVX512-BF16 and VBMI, else in stack_portable.c (plain C: AVX2-only CPUs, ARM).
 *
 * Weights, each projection read in place in one of six forms:
 * - INT4: torch's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`): for each block of 64
 *   output rows and each pair of input columns (k = 2kk, 2kk + 1), 64 bytes where byte j < 32
 *   holds column 2kk and byte j >= 32 column 2kk + 1, of row j % 32 in the low nibble and row
 *   32 + j % 32 in the high nibble; one (scale, zero) bf16 pair per group of 32 columns and output
 *   row, w = (q - 8) * scale + zero. Activations are rounded to bf16, as torch's kernel takes
 *   them; each group's products accumulate in float32, then scale and zero apply.
 * - BF16: (N, K) bf16, activations rounded to bf16, float32 sums over all of K.
 * - INT8: (N, K) int8 (torch's `_weight_int8pack_mm` layout) and one float32 scale per output row,
 *   w = q * scale: activations rounded to bf16 times q (exact in bf16), float32 sums over all of
 *   K, then the scale; with AVX512-BF16 dot products (for AMX's tiles each block would first be
 *   converted, which costs a decode step more than the tiles save), except in prompt runs (below).
 * - FP32 (N, K) and FP32_INPUT_MAJOR (K, N): float32 throughout (AVX-512 FMAs).
 * - BLOCKS: a GGUF file's tensors in place (blocks.c), on every CPU.
 * The dense kinds (all but BLOCKS) need AVX512-BF16 and VBMI: elsewhere the stack runs BLOCKS
 * weights alone (`polylane_kernel` says 0, and stack.py describes no dense weight to it).
 * int4 and bf16 products run on AMX tiles where the CPU has them (up to 16 tokens per tile
 * product), else with AVX512-BF16 dot products; one process always uses one of the two.
 *
 * Every token's arithmetic is the same whatever else is in the batch (rows never mix, and each
 * row's sums run in one fixed order), so a verify pass gives a token exactly the logits a decode
 * step would, and a sequence's tokens do not depend on which others share its steps: speculation
 * stays lossless against these kernels. The one exception is a prompt run on AMX: RUN_ROWS or
 * more consecutive tokens of one sequence with at most one logit row (a prompt chunk, never a
 * verify pass) take their int4 products with bf16-rounded weights, their int8 products on tiles
 * (the same products, summed in another order), and attend on AMX tiles with
 * bf16-rounded queries and weights. Which path a token takes depends on its own sequence's chunk
 * alone: decode tokens and verify passes take the exact path whatever shares their step.
 */
#define _GNU_SOURCE
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.c" /* GGUF block formats in place: the BLOCKS kind */

#define QUANT_GROUP 32 /* int4 and int8 weights per scale (the dense kinds) */
/* A prompt run (see the header) has this many tokens or more: from here the prompt paths are about
 * as fast as the exact ones, and faster beyond (measurements: docs/performance.md). */
#define RUN_ROWS 16
/* Forwards of this many tokens or more run their per-token work (norms, RoPE, KV writes,
 * residuals, activation rounding) on all threads; fewer stay on one (no fork per op). */
#define PARALLEL_ROWS 32

/* `for (m = 0; m < rows; m++) body` on all `threads` (a name in scope) from PARALLEL_ROWS rows,
 * else on this thread alone without entering OpenMP: a parallel region costs a team set-up even when
 * its `if` clause keeps it on one thread, and a decode step runs ~300 of these loops. */
#define EACH_ROW(m, rows, ...)                                                    \
    do {                                                                          \
        if ((rows) >= PARALLEL_ROWS) {                                            \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")     \
            for (int64_t m = 0; m < (rows); m++) __VA_ARGS__;                     \
        } else {                                                                  \
            for (int64_t m = 0; m < (rows); m++) __VA_ARGS__;                     \
        }                                                                         \
    } while (0)
/* How far ahead of the column pair being multiplied the weight stream is prefetched: without it
 * one-row matmuls read memory well below the bandwidth the cores can stream (measurements:
 * docs/performance.md). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

enum { INT4 = 0, BF16 = 1, FP32 = 2, FP32_INPUT_MAJOR = 3, INT8 = 4, BLOCKS = 5 };

typedef struct {
    int64_t kind;            /* INT4, BF16, INT8, FP32, FP32_INPUT_MAJOR or BLOCKS */
    const void *weight;      /* INT4: packed (N/64, K/2, 64); BF16, INT8, FP32: (N, K); FP32_INPUT_MAJOR: (K, N) */
    const uint32_t *scales;  /* INT4: (K/32, N), bf16 scale in the low half, bf16 zero in the high;
                              * INT8: (N,) float32
                              * BLOCKS: `weight` is a BlockMatrix (blocks.c: a GGUF file's tensors
                              * in place, its own bias), scales and bias unused */
    const float *bias;       /* (N,) or NULL */
    int64_t in_features, out_features;
} Matrix;

typedef struct {
    const float *input_norm, *post_norm; /* (E,) before attention, before the MLP */
    Matrix qkv, o, gate_up, down;
    void *keys, *values; /* (slots, Hkv * D), bf16 or float32 (Model.kv_bf16) */
    void *boundary;      /* (slots, E) each slot's input to this layer, as the KV; NULL: not kept */
    uint8_t *boundary_valid; /* (slots,) that input belongs to the slot's K/V */
    const float *q_norm, *k_norm;               /* (D,) per-head norms before RoPE, or NULL */
    const float *attention_norm, *mlp_norm;     /* (E,) on the attention's and MLP's outputs, or NULL */
    int64_t sliding; /* attends through Step.local_visible with Step.local_rotations */
} Layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;
    float eps, scale;
    int64_t kv_bf16; /* the KV cache holds bf16 (else float32) */
    const Layer *layers;
    const float *final_norm;
    Matrix lm_head;
    Matrix embedding;      /* FP32 or BF16 (V, E), or FP32_INPUT_MAJOR (E, V) */
    float embedding_scale; /* the embedding rows are multiplied by it */
    void *final_boundary;  /* (slots, E) the last layer's output per slot, as `boundary`; NULL: not kept */
    uint8_t *final_boundary_valid;
    int64_t activation;    /* the MLP's gate: SILU or GELU_TANH */
} Model;

enum { SILU = 0, GELU_TANH = 1 };

typedef struct {
    int64_t tokens;            /* T */
    const int64_t *token_ids;  /* (T,) */
    const int64_t *positions;  /* (T,) */
    const float *rotations;    /* (P, D/2, 2): cos, sin of every position up to the largest */
    const int64_t *slots;    /* (T,) where each token's K/V is written */
    const int64_t *context;  /* (B, C) cache slots each sequence reads */
    int64_t context_len;     /* C */
    const int64_t *sequence; /* (T,) row of `context` each token reads */
    const uint8_t *visible;  /* (T, C): key c visible to token t */
    int64_t num_logits;      /* R */
    const int64_t *logit_rows; /* (R,) */
    int threads;
    int64_t start_layer;       /* the first layer run; above 0, `input` is its input */
    const float *input;        /* (T, E) or NULL: the tokens' embeddings */
    const float *local_rotations; /* as `rotations`, for sliding layers (their own RoPE base) */
    const uint8_t *local_visible; /* as `visible`, for sliding layers (keys within the window) */
} Step;

/* The layout of Matrix, Layer, Model and Step as stack.py mirrors them (checked before it binds,
 * runtime/model/native/abi.py; blocks.c has the version and the block structs'). */
static const AbiField STACK_ABI[] = {
    ABI_SIZE(Matrix),
    ABI_FIELD(Matrix, kind),
    ABI_FIELD(Matrix, weight),
    ABI_FIELD(Matrix, scales),
    ABI_FIELD(Matrix, bias),
    ABI_FIELD(Matrix, in_features),
    ABI_FIELD(Matrix, out_features),
    ABI_SIZE(Layer),
    ABI_FIELD(Layer, input_norm),
    ABI_FIELD(Layer, post_norm),
    ABI_FIELD(Layer, qkv),
    ABI_FIELD(Layer, o),
    ABI_FIELD(Layer, gate_up),
    ABI_FIELD(Layer, down),
    ABI_FIELD(Layer, keys),
    ABI_FIELD(Layer, values),
    ABI_FIELD(Layer, boundary),
    ABI_FIELD(Layer, boundary_valid),
    ABI_FIELD(Layer, q_norm),
    ABI_FIELD(Layer, k_norm),
    ABI_FIELD(Layer, attention_norm),
    ABI_FIELD(Layer, mlp_norm),
    ABI_FIELD(Layer, sliding),
    ABI_SIZE(Model),
    ABI_FIELD(Model, num_layers),
    ABI_FIELD(Model, hidden),
    ABI_FIELD(Model, heads),
    ABI_FIELD(Model, kv_heads),
    ABI_FIELD(Model, head_dim),
    ABI_FIELD(Model, intermediate),
    ABI_FIELD(Model, vocab),
    ABI_FIELD(Model, eps),
    ABI_FIELD(Model, scale),
    ABI_FIELD(Model, kv_bf16),
    ABI_FIELD(Model, layers),
    ABI_FIELD(Model, final_norm),
    ABI_FIELD(Model, lm_head),
    ABI_FIELD(Model, embedding),
    ABI_FIELD(Model, embedding_scale),
    ABI_FIELD(Model, final_boundary),
    ABI_FIELD(Model, final_boundary_valid),
    ABI_FIELD(Model, activation),
    ABI_SIZE(Step),
    ABI_FIELD(Step, tokens),
    ABI_FIELD(Step, token_ids),
    ABI_FIELD(Step, positions),
    ABI_FIELD(Step, rotations),
    ABI_FIELD(Step, slots),
    ABI_FIELD(Step, context),
    ABI_FIELD(Step, context_len),
    ABI_FIELD(Step, sequence),
    ABI_FIELD(Step, visible),
    ABI_FIELD(Step, num_logits),
    ABI_FIELD(Step, logit_rows),
    ABI_FIELD(Step, threads),
    ABI_FIELD(Step, start_layer),
    ABI_FIELD(Step, input),
    ABI_FIELD(Step, local_rotations),
    ABI_FIELD(Step, local_visible),
};

int64_t polylane_stack_abi(const AbiField **fields) {
    *fields = STACK_ABI;
    return (int64_t)(sizeof STACK_ABI / sizeof STACK_ABI[0]);
}

/* A prompt run: tokens first .. first + count - 1 of the step, all of sequence `sequence`. With
 * attention on tiles it also carries which keys it sees and room for its packed keys and values. */
typedef struct {
    int64_t sequence, first, count;
    uint8_t *seen;    /* (padded,) some token of the run sees key c */
    uint32_t *keys;   /* per KV head, per 16 keys and 32 dims: 16 dim pairs × 16 keys */
    uint32_t *values; /* per KV head, per 32 keys and 16 dims: 16 key pairs × 16 dims */
} Run;

/* A step's prompt runs (none where AMX is off) and the tokens outside them. */
typedef struct {
    int64_t count, padded; /* runs; keys per run's tiles (the context rounded up to 32) */
    Run *runs;             /* in token order */
    int tiles;             /* the runs attend on tiles (bf16 KV, head size 64 or 128) */
    int64_t left;          /* tokens outside the runs, listed in `others` */
    int64_t *others;
} Runs;

/* The dense kinds (INT4, BF16, INT8, FP32, FP32_INPUT_MAJOR) and the AVX-512 layer arithmetic
 * (stack_avx512.c) need AVX512-BF16 and VBMI. Elsewhere (AVX2 only, ARM, the portable build) the
 * stack runs BLOCKS weights alone, with the layer arithmetic in plain C (stack_portable.c). */
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && !defined(POLYLANE_PORTABLE)
#define HAVE_DENSE_KERNELS 1
#endif

#ifdef HAVE_DENSE_KERNELS

/* One row of activations (K) as bf16 column pairs and its bf16 sums per group (K/32). */
static void prepare_row(const float *x, int64_t k, uint16_t *x16, float *group_sums) {
    for (int64_t g = 0; g < k / QUANT_GROUP; g++) {
        const int64_t i = g * QUANT_GROUP;
        const __m256i low = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
        const __m256i high = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i + 16));
        _mm256_storeu_si256((__m256i *)(x16 + i), low);
        _mm256_storeu_si256((__m256i *)(x16 + i + 16), high);
        const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(low), 16)),
                                         _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(high), 16)));
        group_sums[g] = _mm512_reduce_add_ps(sum);
    }
}

/* Unpack the 64 bytes of one column pair of a 64-row block into four vectors of bf16 pairs
 * (rows 0-15, 16-31, 32-47, 48-63; each 32-bit lane holds the row's two columns). Each nibble q
 * becomes the bf16 number 128 + q by pairing it with the byte 0x43 (vpermt2b). */
static inline __attribute__((always_inline)) void unpack_pair(const uint8_t *bytes, const __m512i pick[2],
                                                              __m512bh w[4]) {
    const __m512i nibble = _mm512_set1_epi8(0x0f), exponent = _mm512_set1_epi8(0x43);
    const __m512i packed = _mm512_loadu_si512(bytes);
    const __m512i low = _mm512_and_si512(packed, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    w[0] = (__m512bh)_mm512_permutex2var_epi8(low, pick[0], exponent);
    w[1] = (__m512bh)_mm512_permutex2var_epi8(low, pick[1], exponent);
    w[2] = (__m512bh)_mm512_permutex2var_epi8(high, pick[0], exponent);
    w[3] = (__m512bh)_mm512_permutex2var_epi8(high, pick[1], exponent);
}

/* acc[m][j] = sum over one group's 16 column pairs of x pair · weight pair, for `rows` rows of x.
 * The pairs are split over four interleaved partial sums (pairs s, s + 4, s + 8, s + 12), added
 * in a fixed order: four independent chains keep the dot-product unit busy when one row runs
 * alone (a single chain is latency-bound), and a row's sum is the same whatever `rows` is. */
static inline __attribute__((always_inline)) void group_dot(const uint8_t *base, const uint32_t *x_pairs,
                                                            int64_t pairs, int64_t first, const int rows,
                                                            const __m512i pick[2], __m512 acc[4][4]) {
    for (int s = 0; s < 4; s++) {
        __m512 part[4][4];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < 4; j++) part[m][j] = _mm512_setzero_ps();
        for (int64_t kk = first + s; kk < first + QUANT_GROUP / 2; kk += 4) {
            __m512bh w[4];
            _mm_prefetch((const char *)(base + kk * 64 + PREFETCH_BYTES), _MM_HINT_T0);
            unpack_pair(base + kk * 64, pick, w);
            for (int m = 0; m < rows; m++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x_pairs[m * pairs + kk]);
                for (int j = 0; j < 4; j++) part[m][j] = _mm512_dpbf16_ps(part[m][j], w[j], xv);
            }
        }
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < 4; j++) acc[m][j] = s == 0 ? part[m][j] : _mm512_add_ps(acc[m][j], part[m][j]);
    }
}

/* y[m, 64b : 64b + 64] += b[64b : 64b + 64] for every row m (when the matrix has a bias). */
static void add_bias(const Matrix *w, int64_t rows, int64_t block, float *y, int64_t ldy) {
    if (w->bias == NULL) return;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t i = 0; i < 64; i++) y[m * ldy + block * 64 + i] += w->bias[block * 64 + i];
}

/* The vpermt2b indices of unpack_pair: 32-bit lane i of output r holds row 16r + i's nibbles of
 * columns 2kk and 2kk + 1 (bytes i and 32 + i of the nibble vector), each followed by 0x43. */
static void pick_tables(__m512i pick[2]) {
    for (int r = 0; r < 2; r++) {
        uint8_t table[64];
        for (int i = 0; i < 16; i++) {
            table[4 * i + 0] = (uint8_t)(16 * r + i);
            table[4 * i + 1] = 64;
            table[4 * i + 2] = (uint8_t)(32 + 16 * r + i);
            table[4 * i + 3] = 64;
        }
        pick[r] = _mm512_loadu_si512(table);
    }
}

/* Group g's scales of the four 16-row slices of a 64-row block, and offset = zero - 136 scale:
 * (q - 8) · scale + zero summed against x is scale · sum x (q + 128) + offset · sum x. */
static inline __attribute__((always_inline)) void group_scales(const Matrix *w, int64_t g, int64_t block,
                                                               __m512 scale[4], __m512 offset[4]) {
    for (int j = 0; j < 4; j++) {
        const __m512i packed = _mm512_loadu_si512(w->scales + g * w->out_features + block * 64 + 16 * j);
        scale[j] = _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16));
        const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(packed, _mm512_set1_epi32((int)0xffff0000u)));
        offset[j] = _mm512_fmadd_ps(scale[j], _mm512_set1_ps(-136.0f), zero);
    }
}

/* y[m, 64b : 64b + 64] for every row m of x, one block of 64 output rows, four rows of x at a
 * time. A group's dot product is sum x (q + 128); the (q - 8) * scale + zero form is restored once
 * per group: scale * acc + (zero - 136 scale) * sum x. */
static void int4_block(const Matrix *w, const uint32_t *x_pairs, const float *group_sums,
                       int64_t rows, int64_t block, float *y, int64_t ldy) {
    const int64_t k = w->in_features, n = w->out_features, pairs = k / 2, groups = k / QUANT_GROUP;
    __m512i pick[2];
    pick_tables(pick);
    const uint8_t *base = (const uint8_t *)w->weight + block * pairs * 64;
    for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int64_t count = rows - m0 < 4 ? rows - m0 : 4;
        const uint32_t *x = x_pairs + m0 * pairs;
        float *out = y + m0 * ldy + block * 64;
        for (int64_t m = 0; m < count; m++) memset(out + m * ldy, 0, 64 * sizeof(float));
        for (int64_t g = 0; g < groups; g++) {
            __m512 acc[4][4];
            const int64_t first = g * (QUANT_GROUP / 2);
            if (g + 2 < groups) /* scales lie a row of N apart per group: no stream to follow */
                for (int line = 0; line < 4; line++)
                    _mm_prefetch((const char *)(w->scales + (g + 2) * n + block * 64 + 16 * line), _MM_HINT_T0);
            if (count == 1) group_dot(base, x, pairs, first, 1, pick, acc);
            else if (count == 2) group_dot(base, x, pairs, first, 2, pick, acc);
            else if (count == 3) group_dot(base, x, pairs, first, 3, pick, acc);
            else group_dot(base, x, pairs, first, 4, pick, acc);
            __m512 scale[4], offset[4];
            group_scales(w, g, block, scale, offset);
            for (int j = 0; j < 4; j++)
                for (int64_t m = 0; m < count; m++) {
                    float *o = out + m * ldy + 16 * j;
                    const __m512 sum_x = _mm512_set1_ps(group_sums[(m0 + m) * groups + g]);
                    const __m512 v = _mm512_fmadd_ps(scale[j], acc[m][j], _mm512_loadu_ps(o));
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(offset[j], sum_x, v));
                }
        }
        add_bias(w, count, block, y + m0 * ldy, ldy);
    }
}

/* 32 int8 weights as bf16 (exact), in column order. */
static inline __m512 int8_as_bf16(const int8_t *q) {
    const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)q));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(wide)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(wide, 1)));
    return (__m512)_mm512_cvtne2ps_pbh(high, low);
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* Whether this process may use AMX tiles (Linux grants the tile state on request). */
static int amx_usable = -1;
static int use_amx = 1;

static int request_amx(void) {
    if (amx_usable < 0) amx_usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    return amx_usable;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-3: the four 16-row output slices of a 64-row block (rows of x × 16 floats); tile 4: a
 * group of x (rows × 16 column pairs); tiles 5-7: unpacked weights (16 column pairs × 16 rows).
 * The int4 kernels' layout, per group (int4_block_amx) or over all of K (the prompt kernel). */
static void configure_tiles(int64_t rows) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.colsb[i] = 64;
        config.rows[i] = (uint8_t)(i < 5 ? rows : 16);
    }
    _tile_loadconfig(&config);
}

/* Tiles 0-3, the float32 sums of four 16-column slices, set to zero. */
static inline void zero_sum_tiles(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Tiles 0-3 += a group of x (16 column pairs of each row, rows `stride` bytes apart) times four
 * 16 × 16-pair weight tiles, laid out one after another from `weight_tiles` (1 KiB each). (The
 * prompt attention's P V uses it too: softmax weights of 32 keys times four value tiles.) */
static inline void group_tile_products(const uint32_t *x, int64_t stride, const void *weight_tiles) {
    const uint8_t *w = weight_tiles;
    _tile_loadd(4, x, stride);
    _tile_loadd(5, w, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, w + 1024, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, w + 2048, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, w + 3072, 64);
    _tile_dpbf16ps(3, 4, 5);
}

/* The same product as int4_block with AMX: a group's 16 column pairs unpacked into three weight
 * tiles in turn and multiplied with up to 16 rows of x at once. The block's sums build up in a
 * contiguous buffer of up to 64 rows and go to y once: y's rows lie N floats apart, a multiple of
 * 4 KiB for most projections, so 16 rows of y would share one set of L1 lines and evict each
 * other every group. */
static void int4_block_amx(const Matrix *w, const uint32_t *x_pairs, const float *group_sums,
                           int64_t rows, int64_t block, float *y, int64_t ldy) {
    const int64_t k = w->in_features, n = w->out_features, pairs = k / 2, groups = k / QUANT_GROUP;
    __m512i pick[2];
    pick_tables(pick);
    /* two groups' unpacked weights: the next group is unpacked while the tiles multiply this one */
    __attribute__((aligned(64))) uint8_t weights[2][4][16][64];
    __attribute__((aligned(64))) float products[4][16][16];
    __attribute__((aligned(64))) float sums[64][64];
    const uint8_t *base = (const uint8_t *)w->weight + block * pairs * 64;
    for (int64_t r0 = 0; r0 < rows; r0 += 64) {
        const int64_t chunk = rows - r0 < 64 ? rows - r0 : 64;
        memset(sums, 0, sizeof(float) * 64 * (size_t)chunk);
        int64_t configured = chunk < 16 ? chunk : 16;
        configure_tiles(configured);
        for (int64_t g = -1; g < groups; g++) {
            if (g + 1 < groups) {
                const int64_t next = (g + 1) * (QUANT_GROUP / 2);
                for (int64_t i = 0; i < QUANT_GROUP / 2; i++) {
                    _mm_prefetch((const char *)(base + (next + i) * 64 + PREFETCH_BYTES), _MM_HINT_T0);
                    __m512bh unpacked[4];
                    unpack_pair(base + (next + i) * 64, pick, unpacked);
                    for (int j = 0; j < 4; j++) _mm512_store_si512(weights[(g + 1) & 1][j][i], (__m512i)unpacked[j]);
                }
            }
            if (g < 0) continue;
            const int64_t first = g * (QUANT_GROUP / 2);
            uint8_t(*tiles)[16][64] = weights[g & 1];
            if (g + 2 < groups)
                for (int line = 0; line < 4; line++)
                    _mm_prefetch((const char *)(w->scales + (g + 2) * n + block * 64 + 16 * line), _MM_HINT_T0);
            __m512 scale[4], offset[4];
            group_scales(w, g, block, scale, offset);
            for (int64_t m0 = 0; m0 < chunk; m0 += 16) {
                const int64_t count = chunk - m0 < 16 ? chunk - m0 : 16;
                if (count != configured) configure_tiles(configured = count);
                zero_sum_tiles();
                group_tile_products(x_pairs + (r0 + m0) * pairs + first, pairs * 4, tiles);
                _tile_stored(0, products[0], 64);
                _tile_stored(1, products[1], 64);
                _tile_stored(2, products[2], 64);
                _tile_stored(3, products[3], 64);
                for (int j = 0; j < 4; j++)
                    for (int64_t m = 0; m < count; m++) {
                        float *o = sums[m0 + m] + 16 * j;
                        const __m512 sum_x = _mm512_set1_ps(group_sums[(r0 + m0 + m) * groups + g]);
                        const __m512 v = _mm512_fmadd_ps(scale[j], _mm512_load_ps(products[j][m]), _mm512_load_ps(o));
                        _mm512_store_ps(o, _mm512_fmadd_ps(offset[j], sum_x, v));
                    }
            }
        }
        for (int64_t m = 0; m < chunk; m++) memcpy(y + (r0 + m) * ldy + block * 64, sums[m], sizeof sums[m]);
        add_bias(w, chunk, block, y + r0 * ldy, ldy);
    }
}

/* The int4 product for a prompt run, in two parts: a block's weights dequantised once into bf16
 * tiles, w = (q - 8) · scale + zero rounded to bf16 (the weight torch's dequantised path uses),
 * then each 16-row chunk of x accumulates over all of K in the tiles with no per-group fix-up.
 * `tiles` holds K/32 × 4 tiles of 16 × 16 pairs. Rounding the weights makes these sums differ
 * slightly from int4_block_amx's: only prompt runs take this path. */
static void dequantise_block(const Matrix *w, int64_t block, uint32_t *tiles) {
    const int64_t k = w->in_features, pairs = k / 2, groups = k / QUANT_GROUP;
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
    __m512i pick[2];
    pick_tables(pick);
    const uint8_t *base = (const uint8_t *)w->weight + block * pairs * 64;
    for (int64_t g = 0; g < groups; g++) {
        __m512 scale[4], offset[4];
        group_scales(w, g, block, scale, offset);
        for (int64_t i = 0; i < QUANT_GROUP / 2; i++) {
            __m512bh unpacked[4];
            unpack_pair(base + (g * (QUANT_GROUP / 2) + i) * 64, pick, unpacked);
            for (int j = 0; j < 4; j++) {
                const __m512i lanes = (__m512i)unpacked[j];
                const __m512 even = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16)), scale[j], offset[j]);
                const __m512 odd = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(lanes, high_half)), scale[j], offset[j]);
                const __m512i low = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
                const __m512i high = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd)), 16);
                _mm512_store_si512(tiles + ((g * 4 + j) * 16 + i) * 16, _mm512_or_si512(low, high));
            }
        }
    }
}

static void int4_block_on_tiles(const Matrix *w, const uint32_t *tiles, const uint32_t *x_pairs, int64_t rows,
                                int64_t block, float *y, int64_t ldy) {
    const int64_t pairs = w->in_features / 2, groups = w->in_features / QUANT_GROUP;
    int64_t configured = -1;
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
        const int64_t count = rows - m0 < 16 ? rows - m0 : 16;
        if (count != configured) configure_tiles(configured = count);
        zero_sum_tiles();
        for (int64_t g = 0; g < groups; g++) {
            group_tile_products(x_pairs + m0 * pairs + g * (QUANT_GROUP / 2), pairs * 4, tiles + g * 4 * 256);
        }
        float *out = y + m0 * ldy + block * 64;
        _tile_stored(0, out, ldy * 4);
        _tile_stored(1, out + 16, ldy * 4);
        _tile_stored(2, out + 32, ldy * 4);
        _tile_stored(3, out + 48, ldy * 4);
    }
    add_bias(w, rows, block, y, ldy);
}

/* Tiles 0-3: products of four 16-row slices of a 64-row weight block with up to 16 rows of x
 * (16 weight rows × the x rows); 4-5: weight rows (16 × 32 columns); 6: x (16 column pairs × rows). */
static void configure_dense_tiles(int64_t rows) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 7; i++) {
        config.colsb[i] = (uint16_t)(i == 4 || i == 5 ? 64 : 4 * rows);
        config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
}

/* y[m, 64b : 64b + 64] for rows first <= m < end of x (rows in all) = x W^T for a bf16 weight
 * (N, K), or an int8 one: the block's 64 bf16 rows (`base`: the weight as it lies in memory, or an
 * int8 block converted) are the tiles' A operand, x the B operand (`x_tiles`: per 16-row chunk of x
 * and group of 32 columns, 16 column pairs × 16 rows), and the float32 products accumulate over all
 * of K in the tiles, then an int8 row's scale applies. */
static void bf16_block_amx(const Matrix *w, const uint16_t *base, const uint32_t *x_tiles, int64_t rows, int64_t first,
                           int64_t end, int64_t block, float *y, int64_t ldy) {
    const int64_t k = w->in_features, groups = k / QUANT_GROUP;
    const float *scales = w->kind == INT8 ? (const float *)w->scales : NULL;
    __attribute__((aligned(64))) float products[4][16][16];
    int64_t configured = -1;
    for (int64_t m0 = first / 16 * 16; m0 < end; m0 += 16) {
        const int64_t count = rows - m0 < 16 ? rows - m0 : 16;
        if (count != configured) configure_dense_tiles(configured = count);
        const uint32_t *chunk = x_tiles + (m0 / 16) * groups * 256;
        zero_sum_tiles();
        for (int64_t g = 0; g < groups; g++) {
            if (g + 4 < groups) /* 64 row streams: fetch each a few groups ahead */
                for (int r = 0; r < 64; r++) _mm_prefetch((const char *)(base + r * k + (g + 4) * QUANT_GROUP), _MM_HINT_T0);
            _tile_loadd(6, chunk + g * 256, 64);
            _tile_loadd(4, base + g * QUANT_GROUP, k * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, base + 16 * k + g * QUANT_GROUP, k * 2);
            _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(4, base + 32 * k + g * QUANT_GROUP, k * 2);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(5, base + 48 * k + g * QUANT_GROUP, k * 2);
            _tile_dpbf16ps(3, 5, 6);
        }
        _tile_stored(0, products[0], 64);
        _tile_stored(1, products[1], 64);
        _tile_stored(2, products[2], 64);
        _tile_stored(3, products[3], 64);
        for (int64_t m = 0; m < count; m++) {
            if (m0 + m < first || m0 + m >= end) continue; /* (a chunk's rows outside the range) */
            for (int j = 0; j < 4; j++)
                for (int r = 0; r < 16; r++) {
                    const int64_t n = block * 64 + 16 * j + r;
                    const float product = scales ? products[j][r][m] * scales[n] : products[j][r][m];
                    y[(m0 + m) * ldy + n] = product + (w->bias != NULL ? w->bias[n] : 0.0f);
                }
        }
    }
}

/* Block `block` (64 rows) of an int8 weight as bf16 rows (64 × K, exact) into `rows16`. */
static void int8_block_as_bf16(const Matrix *w, int64_t block, uint16_t *rows16) {
    const int64_t k = w->in_features;
    const int8_t *base = (const int8_t *)w->weight + block * 64 * k;
    for (int64_t i = 0; i < 64 * k; i += 32) _mm512_storeu_ps((float *)(rows16 + i), int8_as_bf16(base + i));
}
#endif

/* x's bf16 column pairs (rows, K/2) laid out as AMX B tiles: per 16-row chunk and group of 32
 * columns, 16 pairs × 16 rows (rows past the end zero). */
static void pairs_as_tiles(const uint32_t *x_pairs, int64_t rows, int64_t pairs, uint32_t *x_tiles) {
    const int64_t groups = pairs / 16, chunks = (rows + 15) / 16;
    memset(x_tiles, 0, sizeof(uint32_t) * (size_t)(chunks * groups * 256));
    for (int64_t m = 0; m < rows; m++)
        for (int64_t kk = 0; kk < pairs; kk++)
            x_tiles[((m / 16) * groups + kk / 16) * 256 + (kk % 16) * 16 + m % 16] = x_pairs[m * pairs + kk];
}

/* Output n of a dense product from its dot product's lanes: the lane sum, times the row's scale
 * (int8), plus the bias. */
static inline float dense_output(const Matrix *w, __m512 acc, int64_t n) {
    const float sum = _mm512_reduce_add_ps(acc);
    return (w->kind == INT8 ? sum * ((const float *)w->scales)[n] : sum) + (w->bias != NULL ? w->bias[n] : 0.0f);
}

/* y[m, n0 : n0 + 4] = x W^T for a bf16, int8 or float32 weight (N, K), with AVX-512: four
 * weight rows × up to four rows of x at a time (int8: two weight rows × eight rows of x while
 * eight are left, so that each converted weight vector serves eight rows), each dot product one
 * chain over K then one lane sum, so a row's result does not depend on the others. bf16 and int8
 * multiply x's bf16 pairs (int8 then times its row's scale). */
static void dense_rows_avx(const Matrix *w, const float *x, const uint32_t *x_pairs, int64_t rows, int64_t n0,
                           float *y, int64_t ldy) {
    const int64_t k = w->in_features, int8 = w->kind == INT8, bf16 = w->kind == BF16 || int8;
    const int64_t step = bf16 ? 32 : 16; /* columns per vector */
    int64_t m0 = 0;
    for (; int8 && m0 + 8 <= rows; m0 += 8)
        for (int o0 = 0; o0 < 4; o0 += 2) {
            __m512 acc[8][2];
            for (int m = 0; m < 8; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
            for (int64_t c = 0; c < k; c += 32) {
                __m512 wv[2];
                for (int o = 0; o < 2; o++) {
                    const int8_t *row = (const int8_t *)w->weight + (n0 + o0 + o) * k + c;
                    _mm_prefetch((const char *)row + PREFETCH_BYTES, _MM_HINT_T0);
                    wv[o] = int8_as_bf16(row);
                }
                for (int m = 0; m < 8; m++) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x_pairs + (m0 + m) * (k / 2) + c / 2);
                    for (int o = 0; o < 2; o++) acc[m][o] = _mm512_dpbf16_ps(acc[m][o], (__m512bh)wv[o], xv);
                }
            }
            for (int m = 0; m < 8; m++)
                for (int o = 0; o < 2; o++) y[(m0 + m) * ldy + n0 + o0 + o] = dense_output(w, acc[m][o], n0 + o0 + o);
        }
    for (; m0 < rows; m0 += 4) {
        const int64_t count = rows - m0 < 4 ? rows - m0 : 4;
        __m512 acc[4][4];
        for (int m = 0; m < 4; m++)
            for (int o = 0; o < 4; o++) acc[m][o] = _mm512_setzero_ps();
        for (int64_t c = 0; c < k; c += step) {
            __m512 wv[4];
            for (int o = 0; o < 4; o++) {
                const char *row = int8   ? (const char *)((const int8_t *)w->weight + (n0 + o) * k + c)
                                  : bf16 ? (const char *)((const uint16_t *)w->weight + (n0 + o) * k + c)
                                         : (const char *)((const float *)w->weight + (n0 + o) * k + c);
                _mm_prefetch(row + PREFETCH_BYTES, _MM_HINT_T0);
                wv[o] = int8 ? int8_as_bf16((const int8_t *)row) : _mm512_loadu_ps((const float *)row);
            }
            for (int64_t m = 0; m < count; m++) {
                if (bf16) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x_pairs + (m0 + m) * (k / 2) + c / 2);
                    for (int o = 0; o < 4; o++) acc[m][o] = _mm512_dpbf16_ps(acc[m][o], (__m512bh)wv[o], xv);
                } else {
                    const __m512 xv = _mm512_loadu_ps(x + (m0 + m) * k + c);
                    for (int o = 0; o < 4; o++) acc[m][o] = _mm512_fmadd_ps(wv[o], xv, acc[m][o]);
                }
            }
        }
        for (int64_t m = 0; m < count; m++)
            for (int o = 0; o < 4; o++) y[(m0 + m) * ldy + n0 + o] = dense_output(w, acc[m][o], n0 + o);
    }
}

/* y = x W + b for a float32 weight stored (K, N). The input rows of W are split between the
 * threads, so each streams whole rows (a split by output columns reads 256-byte runs N floats
 * apart): thread t sums its k range, in order and eight rows of W at a time, into its partial
 * (thread 0's is y itself), and the partials are added in thread order. */
static void input_major_matmul(const Matrix *w, const float *x, int64_t rows, float *y, int threads) {
    const int64_t k = w->in_features, n = w->out_features;
    float *partials = threads > 1 ? malloc(sizeof(float) * (size_t)((threads - 1) * rows * n)) : NULL;
    if (threads > 1 && partials == NULL) threads = 1; /* no memory for partials: one thread */
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t first = k * t / count, last = k * (t + 1) / count;
        float *part = t == 0 ? y : partials + (t - 1) * rows * n;
        for (int64_t m0 = 0; m0 < rows; m0 += 4) {
            const int64_t height = rows - m0 < 4 ? rows - m0 : 4;
            for (int64_t c0 = first; c0 < last; c0 += 8) {
                const int64_t c1 = c0 + 8 < last ? c0 + 8 : last;
                for (int64_t n0 = 0; n0 < n; n0 += 64) {
                    __m512 acc[4][4];
                    for (int64_t m = 0; m < height; m++)
                        for (int j = 0; j < 4; j++)
                            acc[m][j] = c0 == first ? _mm512_setzero_ps()
                                                    : _mm512_loadu_ps(part + (m0 + m) * n + n0 + 16 * j);
                    for (int64_t c = c0; c < c1; c++) {
                        const float *row = (const float *)w->weight + c * n + n0;
                        _mm_prefetch((const char *)(row + 64 + PREFETCH_BYTES / 4), _MM_HINT_T0);
                        __m512 wv[4];
                        for (int j = 0; j < 4; j++) wv[j] = _mm512_loadu_ps(row + 16 * j);
                        for (int64_t m = 0; m < height; m++) {
                            const __m512 xv = _mm512_set1_ps(x[(m0 + m) * k + c]);
                            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_fmadd_ps(wv[j], xv, acc[m][j]);
                        }
                    }
                    for (int64_t m = 0; m < height; m++)
                        for (int j = 0; j < 4; j++) _mm512_storeu_ps(part + (m0 + m) * n + n0 + 16 * j, acc[m][j]);
                }
            }
            if (first == last) /* more threads than rows of W: an empty partial */
                for (int64_t m = 0; m < height; m++) memset(part + (m0 + m) * n, 0, sizeof(float) * (size_t)n);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * n; i += 16) {
            __m512 v = _mm512_loadu_ps(y + i);
            for (int64_t p = 0; p + 1 < count; p++) v = _mm512_add_ps(v, _mm512_loadu_ps(partials + p * rows * n + i));
            if (w->bias != NULL) v = _mm512_add_ps(v, _mm512_loadu_ps(w->bias + i % n));
            _mm512_storeu_ps(y + i, v);
        }
    }
    free(partials);
}
#endif /* HAVE_DENSE_KERNELS */

void polylane_use_amx(int on) {
#ifdef HAVE_AMX
    use_amx = on;
#else
    (void)on;
#endif
}

/* Scratch for `matmul` over at most `rows` rows of at most `width` columns. */
typedef struct {
    uint16_t *x16;     /* rows × width bf16 */
    float *sums;       /* rows × width / 32 */
    uint32_t *x_tiles; /* ceil(rows / 16) × width / 32 × 256 */
} Scratch;

static int scratch_alloc(Scratch *scratch, int64_t rows, int64_t width) {
    scratch->x16 = malloc(sizeof(uint16_t) * (size_t)(rows * width));
    scratch->sums = malloc(sizeof(float) * (size_t)(rows * (width / QUANT_GROUP + 1)));
    scratch->x_tiles = malloc(sizeof(uint32_t) * (size_t)((rows + 15) / 16 * (width / QUANT_GROUP + 1) * 256));
    return scratch->x16 && scratch->sums && scratch->x_tiles ? 0 : -1;
}

static void scratch_free(Scratch *scratch) {
    free(scratch->x16);
    free(scratch->sums);
    free(scratch->x_tiles);
}

static int amx_on(void) {
#ifdef HAVE_AMX
    return use_amx && request_amx();
#else
    return 0;
#endif
}

#ifdef HAVE_AMX
/* Rows first .. first + count - 1 of an int4 or int8 product's block on AMX: a prompt run's rows on
 * the block's `tiles` (int4 dequantised, int8 as bf16 rows) where there are some, else with the
 * exact kernel (int8: the dot products, as every int8 row outside a prompt run). */
static void quantised_rows_amx(const Matrix *w, const uint32_t *x_pairs, const float *group_sums,
                               const uint32_t *x_tiles, int64_t rows, int64_t first, int64_t count, int64_t block,
                               float *y, const uint32_t *tiles) {
    if (count <= 0) return;
    const int64_t pairs = w->in_features / 2, n = w->out_features;
    if (w->kind == INT8 && tiles) {
        bf16_block_amx(w, (const uint16_t *)tiles, x_tiles, rows, first, first + count, block, y, n);
    } else if (w->kind == INT8) {
        for (int64_t n0 = 64 * block; n0 < 64 * block + 64; n0 += 4)
            dense_rows_avx(w, NULL, x_pairs + first * pairs, count, n0, y + first * n, n);
    } else if (tiles) {
        int4_block_on_tiles(w, tiles, x_pairs + first * pairs, count, block, y + first * n, n);
    } else {
        int4_block_amx(w, x_pairs + first * pairs, group_sums + first * (w->in_features / QUANT_GROUP), count, block,
                       y + first * n, n);
    }
}
#endif

/* y (rows, N) = x (rows, K) W^T + b, float32 in and out, for any kind of weight; int4 and int8 rows
 * in `runs` (NULL: none) take the prompt kernels where AMX is on. 0, or -1 when the block kernels
 * found no scratch memory (y then holds nothing). */
static int matmul(const Matrix *w, const float *x, int64_t rows, float *y, const Scratch *scratch, int threads,
                  const Runs *runs) {
    if (rows == 0) return 0; /* e.g. a prompt chunk that needs no logits: no tile has zero rows */
    if (w->kind == BLOCKS) /* every row the same arithmetic, whatever the batch (blocks.c) */
        return polylane_blocks_matmul((const BlockMatrix *)w->weight, x, rows, y, threads) ? -1 : 0;
#ifndef HAVE_DENSE_KERNELS
    (void)x, (void)y, (void)scratch, (void)threads, (void)runs;
    return -2; /* (stack.py describes no dense weight to a build without their kernels) */
#else
    const int64_t blocks = w->out_features / 64;
    const uint32_t *x_pairs = (const uint32_t *)scratch->x16;
    const int dense32 = w->kind == FP32 || w->kind == FP32_INPUT_MAJOR;
    const int64_t k = w->in_features;
    if (!dense32) EACH_ROW(m, rows, prepare_row(x + m * k, k, scratch->x16 + m * k, scratch->sums + m * (k / QUANT_GROUP)));
    const int amx = amx_on();
#ifdef HAVE_AMX
    const int64_t prompt_runs = (w->kind == INT4 || w->kind == INT8) && runs ? runs->count : 0;
    /* (int8 outside prompt runs: the dot products below, whatever the batch) */
    if (amx && (w->kind == INT4 || w->kind == BF16 || (w->kind == INT8 && prompt_runs))) {
        if (w->kind != INT4) pairs_as_tiles(x_pairs, rows, w->in_features / 2, scratch->x_tiles);
#pragma omp parallel num_threads(threads)
        {
            /* int4: the dequantised block's tiles, int8: its 64 rows as bf16, the same size (without
             * memory for them the runs take the exact kernel) */
            uint32_t *tiles = prompt_runs ? aligned_alloc(64, sizeof(uint32_t) * (size_t)(w->in_features / QUANT_GROUP * 1024))
                                          : NULL;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                if (w->kind == BF16) {
                    bf16_block_amx(w, (const uint16_t *)w->weight + b * 64 * k, scratch->x_tiles, rows, 0, rows, b, y,
                                   w->out_features);
                    continue;
                }
                if (tiles && w->kind == INT4) dequantise_block(w, b, tiles);
                if (tiles && w->kind == INT8) int8_block_as_bf16(w, b, (uint16_t *)tiles);
                int64_t done = 0;
                for (int64_t r = 0; r < prompt_runs;) { /* (rows never mix: adjacent runs go as one) */
                    const int64_t first = runs->runs[r].first;
                    int64_t end = first + runs->runs[r].count;
                    while (++r < prompt_runs && runs->runs[r].first == end) end += runs->runs[r].count;
                    quantised_rows_amx(w, x_pairs, scratch->sums, scratch->x_tiles, rows, done, first - done, b, y, NULL);
                    quantised_rows_amx(w, x_pairs, scratch->sums, scratch->x_tiles, rows, first, end - first, b, y, tiles);
                    done = end;
                }
                quantised_rows_amx(w, x_pairs, scratch->sums, scratch->x_tiles, rows, done, rows - done, b, y, NULL);
            }
            free(tiles);
            _tile_release();
        }
        return 0;
    }
#endif
    (void)amx;
    if (w->kind == FP32_INPUT_MAJOR) {
        input_major_matmul(w, x, rows, y, threads);
    } else if (w->kind == INT4) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; b++) int4_block(w, x_pairs, scratch->sums, rows, b, y, w->out_features);
    } else { /* bf16, int8, float32: four output rows at a time (576 rows are 144 even shares, not
              * 9 blocks of 64) */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t n0 = 0; n0 < w->out_features; n0 += 4) dense_rows_avx(w, x, x_pairs, rows, n0, y, w->out_features);
    }
    return 0;
#endif
}

/* y (rows, N) = x (rows, K) W^T + b alone (for tests and benchmarks), all rows one prompt run if
 * `prompt`; returns -1 without memory. */
int polylane_matmul(const Matrix *w, const float *x, int64_t rows, float *y, int threads, int prompt) {
    Scratch scratch;
    Run run = {.first = 0, .count = rows};
    const Runs runs = {.count = prompt && amx_on() ? 1 : 0, .runs = &run};
    int status = scratch_alloc(&scratch, rows, w->in_features);
    if (status == 0) status = matmul(w, x, rows, y, &scratch, threads, &runs);
    scratch_free(&scratch);
    return status;
}

/* Which kernel multiplies the dense kinds: 2 = AMX tiles, 1 = AVX512-BF16 dot products, 0 = none
 * (this build runs BLOCKS weights alone). */
int polylane_kernel(void) {
#ifdef HAVE_AMX
    if (amx_on()) return 2;
#endif
#ifdef HAVE_DENSE_KERNELS
    return 1;
#else
    return 0;
#endif
}

static void rms_norm(const float *row, const float *weight, int64_t size, float eps, float *y) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < size; i++) sum += row[i] * row[i];
    const float inv = 1.0f / sqrtf(sum / (float)size + eps);
    for (int64_t i = 0; i < size; i++) y[i] = row[i] * inv * weight[i];
}

/* A bf16 value as float32 (exact). */
static inline float bf16_value(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* Rotate interleaved (even, odd) pairs of `heads` heads of one token by its (cos, sin) table. */
static void rotate(float *x, int64_t heads, int64_t head_dim, const float *rotation) {
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * head_dim;
        for (int64_t i = 0; i < head_dim / 2; i++) {
            const float c = rotation[2 * i], s = rotation[2 * i + 1];
            const float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * c - b * s;
            v[2 * i + 1] = a * s + b * c;
        }
    }
}

#ifdef HAVE_DENSE_KERNELS
#include "stack_avx512.c" /* e^x, bf16 loads and stores, attention, the MLP's gate: AVX-512 */
#elif defined(__AVX2__) && defined(__FMA__) && !defined(POLYLANE_PORTABLE)
#define STACK_AVX2 1
#include "stack_portable.c" /* e^x, bf16 stores, the MLP's gate in plain C */
#include "stack_avx2.c"     /* the attention with AVX2 */
#else
#include "stack_portable.c" /* the same in plain C */
#endif

/* One token's QKV row: its query and key heads normed (where the layer norms them) and rotated,
 * then its K and V into cache slot `slot`. */
static void rotate_and_store(const Model *model, const Layer *layer, float *row, const float *rotation, int64_t slot) {
    const int64_t dim = model->head_dim, q_width = model->heads * dim, kv_width = model->kv_heads * dim;
    if (layer->q_norm) {
        for (int64_t h = 0; h < model->heads; h++) rms_norm(row + h * dim, layer->q_norm, dim, model->eps, row + h * dim);
        for (int64_t h = 0; h < model->kv_heads; h++)
            rms_norm(row + q_width + h * dim, layer->k_norm, dim, model->eps, row + q_width + h * dim);
    }
    rotate(row, model->heads + model->kv_heads, dim, rotation);
    if (model->kv_bf16) {
        store_bf16(row + q_width, kv_width, (uint16_t *)layer->keys + slot * kv_width);
        store_bf16(row + q_width + kv_width, kv_width, (uint16_t *)layer->values + slot * kv_width);
    } else {
        memcpy((float *)layer->keys + slot * kv_width, row + q_width, sizeof(float) * (size_t)kv_width);
        memcpy((float *)layer->values + slot * kv_width, row + q_width + kv_width, sizeof(float) * (size_t)kv_width);
    }
}

#ifdef HAVE_AMX
/* Prompt attention on AMX tiles. A prompt run takes its query heads 16 tokens at a time: per KV
 * head the run's keys and values are packed once as B tiles, then per (query head, 16-token
 * block) the scores S = Q K^T come from tiles (Q rounded to bf16), the softmax is float32, and
 * O = P V comes from tiles again (P rounded to bf16). The rounding makes these tokens' outputs
 * differ slightly from the per-token loop's, so only prompt runs take this path, as they take the
 * int4 prompt kernel; head sizes 64, 128 or 256. */

/* All eight tiles 16 rows × 64 bytes: 0-3 float32 sums, 2-5 also the query tiles while scoring,
 * 4-7 weights and packed keys or values. */
static void configure_square_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.colsb[i] = 64;
        config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
}

/* One KV head's keys and values of a run as tiles; keys no token of the run sees are zero (their
 * cache slots may hold anything, and 0 × NaN would poison the sums). */
static void pack_run(const Layer *layer, const Step *step, const Run *run, int64_t kv_width, int64_t dim,
                     int64_t kvh, int64_t padded) {
    const int64_t *slots = step->context + run->sequence * step->context_len;
    const int64_t pairs = dim / 2, chunks = dim / 32, slices = dim / 16;
    uint32_t *keys = run->keys + kvh * padded * pairs;
    uint16_t *values = (uint16_t *)(run->values + kvh * padded * pairs);
    for (int64_t c = 0; c < padded; c++) {
        const int used = run->seen[c];
        const int64_t offset = used ? slots[c] * kv_width + kvh * dim : 0;
        const uint32_t *key = (const uint32_t *)((const uint16_t *)layer->keys + offset);
        const uint16_t *value = (const uint16_t *)layer->values + offset;
        for (int64_t kk = 0; kk < pairs; kk++)
            keys[(((c / 16) * chunks + kk / 16) * 16 + kk % 16) * 16 + c % 16] = used ? key[kk] : 0;
        for (int64_t d = 0; d < dim; d++)
            values[((((c / 32) * slices + d / 16) * 16 + (c % 32) / 2) * 16 + d % 16) * 2 + c % 2] = used ? value[d] : 0;
    }
}

/* Per-thread work space of attend_block. */
typedef struct {
    float *scores;     /* 16 × padded */
    uint16_t *weights; /* 16 × padded bf16 softmax numerators */
    uint16_t *queries; /* 16 × head_dim bf16 */
    uint16_t *masks;   /* 16 × padded / 16: which keys of each 16 a row sees */
} BlockWork;

/* Query head `head` of a run's 16-token block `block`: those tokens' attention output rows, over
 * the keys `visible_rows` (T, C) lets each see. */
static void attend_block(const Model *model, const Step *step, const uint8_t *visible_rows, const Run *run,
                         int64_t head, int64_t block, const float *qkv, float *out, int64_t padded,
                         const BlockWork *work) {
    const int64_t dim = model->head_dim, heads = model->heads, context = step->context_len;
    const int64_t width = (heads + 2 * model->kv_heads) * dim, kvh = head / (heads / model->kv_heads);
    const int64_t chunks = dim / 32, key_blocks = padded / 16, first = run->first + 16 * block;
    const int64_t rows = run->count - 16 * block < 16 ? run->count - 16 * block : 16;
    const uint32_t *keys = run->keys + kvh * padded * (dim / 2);
    const uint32_t *values = run->values + kvh * padded * (dim / 2);
    float *scores = work->scores;
    uint16_t *weights = work->weights, *queries = work->queries, *masks = work->masks;
    for (int64_t i = 0; i < 16; i++) {
        if (i < rows) store_bf16(qkv + (first + i) * width + head * dim, dim, queries + i * dim);
        else memset(queries + i * dim, 0, sizeof(uint16_t) * (size_t)dim);
        for (int64_t j = 0; j < key_blocks; j++) {
            const int64_t span = i >= rows || context <= 16 * j ? 0 : context - 16 * j < 16 ? context - 16 * j : 16;
            const __mmask16 lanes = span == 16 ? 0xffff : (__mmask16)((1u << span) - 1);
            masks[i * key_blocks + j] = span == 0 ? 0 : _mm_mask_cmpneq_epi8_mask(
                lanes, _mm_maskz_loadu_epi8(lanes, visible_rows + (first + i) * context + 16 * j), _mm_setzero_si128());
        }
    }
    if (chunks <= 4) { /* up to 128 dims: the query tiles stay loaded (2-5); 256: loaded per use */
        _tile_loadd(2, queries, dim * 2);
        _tile_loadd(3, queries + 32, dim * 2);
        if (chunks > 2) {
            _tile_loadd(4, queries + 64, dim * 2);
            _tile_loadd(5, queries + 96, dim * 2);
        }
    }
    /* which pairs of key blocks (32 keys) some row sees: the others are skipped below, twice */
    uint8_t seen_pair[key_blocks / 2];
    for (int64_t j = 0; j < key_blocks; j += 2) {
        int any = 0;
        for (int64_t i = 0; i < rows; i++) any |= masks[i * key_blocks + j] | masks[i * key_blocks + j + 1];
        seen_pair[j / 2] = any != 0;
    }
    /* scores, two key blocks at a time (two independent sums): tiles 0 and 1 += query tile q times
     * the two blocks' key tiles for the same 32 dims (`offset` into each block's tiles) */
#define KEY_PAIR_PRODUCTS(q, offset)          \
    do {                                      \
        _tile_loadd(6, k0 + (offset), 64);    \
        _tile_dpbf16ps(0, q, 6);              \
        _tile_loadd(7, k1 + (offset), 64);    \
        _tile_dpbf16ps(1, q, 7);              \
    } while (0)
    for (int64_t j = 0; j < key_blocks; j += 2) {
        if (!seen_pair[j / 2]) continue;
        const uint32_t *k0 = keys + j * chunks * 256, *k1 = k0 + chunks * 256;
        _tile_zero(0);
        _tile_zero(1);
        if (chunks <= 4) {
            KEY_PAIR_PRODUCTS(2, 0);
            KEY_PAIR_PRODUCTS(3, 256);
            if (chunks > 2) {
                KEY_PAIR_PRODUCTS(4, 512);
                KEY_PAIR_PRODUCTS(5, 768);
            }
        } else {
            for (int64_t c = 0; c < chunks; c++) {
                _tile_loadd(2, queries + 32 * c, dim * 2);
                KEY_PAIR_PRODUCTS(2, 256 * c);
            }
        }
        _tile_stored(0, scores + 16 * j, padded * 4);
        _tile_stored(1, scores + 16 * j + 16, padded * 4);
    }
#undef KEY_PAIR_PRODUCTS
    /* softmax numerators as bf16 (unseen keys exactly 0) and each row's 1 / sum */
    float inverse[16];
    const __m512 scale = _mm512_set1_ps(model->scale);
    for (int64_t i = 0; i < 16; i++) {
        const uint16_t *seen = masks + i * key_blocks;
        float *row = scores + i * padded;
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < key_blocks; j++)
            if (seen[j]) best = _mm512_mask_max_ps(best, seen[j], best, _mm512_mul_ps(_mm512_loadu_ps(row + 16 * j), scale));
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < key_blocks; j++) {
            __m512 e = _mm512_setzero_ps();
            if (seen[j]) e = _mm512_maskz_mov_ps(seen[j], exp16(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * j), scale, top)));
            total = _mm512_add_ps(total, e);
            _mm256_storeu_si256((__m256i *)(weights + i * padded + 16 * j), (__m256i)_mm512_cvtneps_pbh(e));
        }
        const float sum = _mm512_reduce_add_ps(total);
        inverse[i] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
    /* O = P V, 64 dims (four tiles) at a time over 32 keys at a time */
    __attribute__((aligned(64))) float sums[16][64];
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        zero_sum_tiles();
        for (int64_t j = 0; j < key_blocks; j += 2) {
            if (!seen_pair[j / 2]) continue;
            /* 32 keys' weights of the 16 rows times four 16-dim value tiles */
            group_tile_products((const uint32_t *)(weights + 16 * j), padded * 2,
                                values + ((j / 2) * (dim / 16) + d0 / 16) * 256);
        }
        _tile_stored(0, sums[0], 256);
        _tile_stored(1, sums[0] + 16, 256);
        _tile_stored(2, sums[0] + 32, 256);
        _tile_stored(3, sums[0] + 48, 256);
        for (int64_t i = 0; i < rows; i++) {
            float *o = out + (first + i) * heads * dim + head * dim + d0;
            for (int64_t k = 0; k < 64; k += 16)
                _mm512_storeu_ps(o + k, _mm512_mul_ps(_mm512_load_ps(sums[i] + k), _mm512_set1_ps(inverse[i])));
        }
    }
}

/* The step's prompt runs on tiles, this layer: each run's keys and values packed, then the 16-token
 * blocks of every (run, query head) shared out. Returns 0, or -1 when memory ran out (the caller
 * then computes every token with the per-token loop). */
static int attend_runs(const Model *model, const Layer *layer, const Step *step, const Runs *runs, const float *qkv,
                       float *out) {
    const int64_t dim = model->head_dim, padded = runs->padded, kv_width = model->kv_heads * dim;
    const uint8_t *visible = layer->sliding ? step->local_visible : step->visible;
    const Run *run = runs->runs;
    int64_t items = 0;
    for (int64_t r = 0; r < runs->count; r++) items += model->heads * ((run[r].count + 15) / 16);
    int status = 0;
#pragma omp parallel num_threads(step->threads)
    {
        configure_square_tiles();
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t r = 0; r < runs->count; r++)
            for (int64_t kvh = 0; kvh < model->kv_heads; kvh++) pack_run(layer, step, &run[r], kv_width, dim, kvh, padded);
        BlockWork work = {aligned_alloc(64, sizeof(float) * (size_t)(16 * padded)),
                          aligned_alloc(64, sizeof(uint16_t) * (size_t)(16 * padded)),
                          aligned_alloc(64, sizeof(uint16_t) * (size_t)(16 * dim)),
                          malloc(sizeof(uint16_t) * (size_t)(padded + 16))};
        const int ready = work.scores && work.weights && work.queries && work.masks;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!ready) continue; /* (a thread without work space leaves its items undone: -1 below) */
            int64_t r = 0, rest = item; /* later blocks see more keys: they go first */
            while (rest >= model->heads * ((run[r].count + 15) / 16)) rest -= model->heads * ((run[r++].count + 15) / 16);
            const int64_t blocks = (run[r].count + 15) / 16;
            attend_block(model, step, visible, &run[r], rest % model->heads, blocks - 1 - rest / model->heads, qkv, out,
                         padded, &work);
        }
#pragma omp atomic
        status |= ready ? 0 : -1;
        free(work.scores);
        free(work.weights);
        free(work.queries);
        free(work.masks);
        _tile_release();
    }
    return status;
}
#endif

/* The step's prompt runs, where AMX is on: each stretch of RUN_ROWS or more consecutive tokens of
 * one sequence with at most one logit row. Where they attend on tiles, also each run's keys seen
 * and room for its packed keys and values. Returns 0, or -1 when memory ran out. */
static int find_runs(const Model *model, const Step *step, Runs *runs) {
    const int64_t tokens = step->tokens, context = step->context_len, dim = model->head_dim;
    const int amx = amx_on();
    runs->padded = (context + 31) / 32 * 32;
    runs->tiles = amx && model->kv_bf16 && (dim == 64 || dim == 128 || dim == 256);
    runs->runs = malloc(sizeof(Run) * (size_t)(tokens / RUN_ROWS + 1));
    runs->others = malloc(sizeof(int64_t) * (size_t)(tokens + 1));
    uint8_t *logit = calloc((size_t)tokens + 1, 1);
    int status = runs->runs && runs->others && logit ? 0 : -1;
    if (status == 0) {
        for (int64_t r = 0; r < step->num_logits; r++) logit[step->logit_rows[r]] = 1;
        const size_t pack = sizeof(uint32_t) * (size_t)(model->kv_heads * runs->padded * dim / 2);
        for (int64_t t = 0; t < tokens;) {
            int64_t end = t + 1, logits = logit[t];
            while (end < tokens && step->sequence[end] == step->sequence[t]) logits += logit[end++];
            if (amx && end - t >= RUN_ROWS && logits <= 1) {
                Run *run = &runs->runs[runs->count++];
                *run = (Run){step->sequence[t], t, end - t, NULL, NULL, NULL};
                if (runs->tiles) {
                    run->seen = calloc((size_t)runs->padded, 1);
                    run->keys = aligned_alloc(64, pack);
                    run->values = aligned_alloc(64, pack);
                    if (!run->seen || !run->keys || !run->values) status = -1;
                    else
                        for (int64_t i = t; i < end; i++)
                            for (int64_t c = 0; c < context; c++) run->seen[c] |= step->visible[i * context + c];
                }
            } else {
                for (int64_t i = t; i < end; i++) runs->others[runs->left++] = i;
            }
            t = end;
        }
    }
    free(logit);
    return status;
}

static void free_runs(Runs *runs) {
    for (int64_t r = 0; r < runs->count; r++) {
        free(runs->runs[r].seen);
        free(runs->runs[r].keys);
        free(runs->runs[r].values);
    }
    free(runs->runs);
    free(runs->others);
}

/* The step's attention: prompt runs on tiles where they may (attend_runs), every other token with
 * the per-token loop. */
static void attention(const Model *model, const Layer *layer, const Step *step, const Runs *runs, const float *qkv,
                      float *out, float *scratch) {
    int64_t count = step->tokens;
    const int64_t *listed = NULL;
#ifdef HAVE_AMX
    if (runs->tiles && runs->count > 0 && attend_runs(model, layer, step, runs, qkv, out) == 0)
        count = runs->left, listed = runs->others;
#endif
    if (count == 0) return;
    const uint8_t *visible = layer->sliding ? step->local_visible : step->visible;
    if (model->kv_bf16) attention_impl(model, layer, step, visible, qkv, out, scratch, listed, count, 1);
    else attention_impl(model, layer, step, visible, qkv, out, scratch, listed, count, 0);
}

/* Token `token`'s embedding row (E) as float32, times the model's embedding scale. */
static void embed(const Model *model, int64_t token, float *row) {
    const Matrix *table = &model->embedding;
    const int64_t e = table->in_features, v = table->out_features;
    if (table->kind == BLOCKS) {
        int64_t type;
        const uint8_t *source = source_row((const BlockMatrix *)table->weight, token, &type);
        dequantise_row(type, source, e, row);
    } else if (table->kind == BF16) {
        const uint16_t *source = (const uint16_t *)table->weight + token * e;
        for (int64_t i = 0; i < e; i++) row[i] = bf16_value(source[i]);
    } else if (table->kind == FP32_INPUT_MAJOR) {
        for (int64_t i = 0; i < e; i++) row[i] = ((const float *)table->weight)[i * v + token];
    } else {
        memcpy(row, (const float *)table->weight + token * e, sizeof(float) * (size_t)e);
    }
    if (model->embedding_scale != 1.0f)
        for (int64_t i = 0; i < e; i++) row[i] *= model->embedding_scale;
}

/* Keep each token's hidden state `hidden` (T, E) at its slot of `states` (the KV cache's element
 * type) and mark it valid: the boundary states a model sharing its lower layers continues from
 * (runtime/kv/kv_cache.py `write_boundary`, the same rounding). */
static void record_boundary(const Model *model, const Step *step, const float *hidden, void *states,
                            uint8_t *valid) {
    const int64_t e = model->hidden;
    for (int64_t i = 0; i < step->tokens; i++) {
        const int64_t slot = step->slots[i];
        if (model->kv_bf16) store_bf16(hidden + i * e, e, (uint16_t *)states + slot * e);
        else memcpy((float *)states + slot * e, hidden + i * e, sizeof(float) * (size_t)e);
        valid[slot] = 1;
    }
}

/* hidden += residual for `t` tokens, the residual normed first where `norm` is given (Gemma's
 * norms on the attention's and the MLP's outputs; in place, `residual` is scratch). */
static void add_residual(const Model *model, const float *norm, float *residual, int64_t t, int threads, float *hidden) {
    const int64_t e = model->hidden;
    if (norm) EACH_ROW(i, t, rms_norm(residual + i * e, norm, e, model->eps, residual + i * e));
    EACH_ROW(i, t, for (int64_t j = i * e; j < (i + 1) * e; j++) hidden[j] += residual[j]);
}

/* Embed the step's tokens, run every layer over them, then the final norm and output projection of
 * the rows `step->logit_rows` into `logits` (R, V). Returns 0, or -1 when scratch memory ran out. */
int polylane_forward(const Model *model, const Step *step, float *logits) {
    const int threads = step->threads;
    const int64_t t = step->tokens, e = model->hidden, dim = model->head_dim;
    const int64_t q_width = model->heads * dim, kv_width = model->kv_heads * dim;
    const int64_t qkv_width = q_width + 2 * kv_width, inter = model->intermediate;
    int64_t widest = e > q_width ? e : q_width;
    if (2 * inter > widest) widest = 2 * inter;
    if (qkv_width > widest) widest = qkv_width;
    const int64_t rows = t > step->num_logits ? t : step->num_logits;
    float *normed = malloc(sizeof(float) * (size_t)(rows * e));
    float *wide = malloc(sizeof(float) * (size_t)(t * widest));
    float *narrow = malloc(sizeof(float) * (size_t)(t * (q_width > inter ? q_width : inter)));
    float *residual = malloc(sizeof(float) * (size_t)(t * e));
    float *hidden = malloc(sizeof(float) * (size_t)(t * e));
    Scratch scratch;
    const int scratch_status = scratch_alloc(&scratch, rows, widest);
    float *scores = malloc(sizeof(float) * (size_t)(step->threads * model->heads * step->context_len));
    Runs runs = {0};
    const int runs_status = find_runs(model, step, &runs);
    int status = 0;
    if (!normed || !wide || !narrow || !residual || !hidden || scratch_status || !scores || runs_status) {
        status = -1;
        goto done;
    }
    if (step->input) memcpy(hidden, step->input, sizeof(float) * (size_t)(t * e));
    else EACH_ROW(i, t, embed(model, step->token_ids[i], hidden + i * e));
    for (int64_t l = step->start_layer; l < model->num_layers; l++) {
        const Layer *layer = &model->layers[l];
        if (layer->boundary) record_boundary(model, step, hidden, layer->boundary, layer->boundary_valid);
        EACH_ROW(i, t, rms_norm(hidden + i * e, layer->input_norm, e, model->eps, normed + i * e));
        if ((status = matmul(&layer->qkv, normed, t, wide, &scratch, threads, &runs)) != 0) goto done;
        const float *rotations = layer->sliding ? step->local_rotations : step->rotations;
        EACH_ROW(i, t, rotate_and_store(model, layer, wide + i * qkv_width, rotations + step->positions[i] * dim,
                                        step->slots[i]));
        attention(model, layer, step, &runs, wide, narrow, scores);
        if ((status = matmul(&layer->o, narrow, t, residual, &scratch, threads, &runs)) != 0) goto done;
        add_residual(model, layer->attention_norm, residual, t, threads, hidden);
        EACH_ROW(i, t, rms_norm(hidden + i * e, layer->post_norm, e, model->eps, normed + i * e));
        if ((status = matmul(&layer->gate_up, normed, t, wide, &scratch, threads, &runs)) != 0) goto done;
        EACH_ROW(i, t, gated_activation(model->activation, wide + i * 2 * inter, wide + i * 2 * inter + inter, inter,
                                        narrow + i * inter));
        if ((status = matmul(&layer->down, narrow, t, residual, &scratch, threads, &runs)) != 0) goto done;
        add_residual(model, layer->mlp_norm, residual, t, threads, hidden);
    }
    if (model->final_boundary) record_boundary(model, step, hidden, model->final_boundary, model->final_boundary_valid);
    for (int64_t r = 0; r < step->num_logits; r++)
        rms_norm(hidden + step->logit_rows[r] * e, model->final_norm, e, model->eps, normed + r * e);
    status = matmul(&model->lm_head, normed, step->num_logits, logits, &scratch, threads, NULL); /* logit rows: exact */
done:
    free(normed);
    free(wide);
    free(narrow);
    free(residual);
    free(hidden);
    scratch_free(&scratch);
    free(scores);
    free_runs(&runs);
    return status;
}

