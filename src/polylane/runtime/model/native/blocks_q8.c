/* GGUF's block formats times 8-bit activations, by integer dot products (included by blocks.c).

What this file owns: the fast product of blocks.c. Each activation row is rounded to 8 bits per
group of 16 (one float scale dx per group; llama.cpp's Q8 activations take one per 32 or 256),
each weight row is unpacked to unsigned 8-bit codes u with one float scale d and one float offset m
per group of 16 (w = d·u + m: every GGUF quantised format fits this, the symmetric ones with
m = −offset·d), and their products are exact integer sums per group, scaled in float:

    x·w = Σ_g dx_g · (d_g · Σ_i u_i·q_i  +  m_g · Σ_i q_i)

The integer sums are exact on every instruction set (AVX-512 VNNI `vpdpbusd`, AVX2 `vpmaddubsw`,
portable C); only the float scaling's order differs between them. Each group's sum is complete in
integers before its one float multiply-add (codes and activations in "lane layout", below).

Batch independence holds as in blocks.c: an activation row is quantised alone, and each output is
one fixed sequence of operations on its own activation row and weight row, whatever the batch,
thread count or tile. A single activation row (a decode step), and a few (a decode batch, a verify
pass: fewer than DECODE_ROWS_BELOW), take blocks_q8_decode.c's kernels where the tile's formats
have them: the same operations, without coding the weights first.

Float weight tensors (F32, F16, BF16) have no codes: a matrix with such a segment takes the float
path of blocks.c.
*/

#if !defined(POLYLANE_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define Q8_VNNI 1
#elif !defined(POLYLANE_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define Q8_AVX2 1
#endif

#define GROUP 16  /* weights per (d, m) pair */
#define MAX_CHUNK 2560      /* columns of a tile's rows coded at a time for prompts (codes stay in L1) */
#define WHOLE_ROWS_BELOW 16 /* fewer activation rows than this: weight rows coded whole */
/* Coded activation rows taken per pass over W (a prompt's weight codes are made once per pass).
   Larger than blocks.c's X_BLOCK_BYTES: the rows stream from L2 or L3 well enough, and the coding
   is the dearer part: fewer passes code W fewer times (measurements: docs/performance.md). */
#define CODED_BLOCK_BYTES (4096 * 1024)
/* Fewer activation rows than this (decode batches, verify passes) and a tile whose formats have
   decode kernels: each weight span is unpacked in registers for DECODE_ROWS activation rows at a
   time (blocks_q8_decode.c: each pair's running lanes kept across spans) instead of coded into a buffer.
   With few activation rows that is faster than coding the weights first; with many the two are
   about even. DECODE_ROWS is 8 because 16 activation rows at a time spill registers
   (measurements: docs/performance.md). */
#define DECODE_ROWS_BELOW 32
#define DECODE_ROWS 8
/* Codes whose group sums are formed in integers before any float operation: a span's groups take
   one SIMD lane each (see "lane layout" below). */
#if defined(Q8_VNNI)
#define SPAN 256
#elif defined(Q8_AVX2)
#define SPAN 128
#else
#define SPAN GROUP
#endif
#define SPAN_GROUPS (SPAN / GROUP)

static inline int64_t whole_spans(int64_t columns) { return (columns + SPAN - 1) / SPAN * SPAN; }

/* One weight row (or a chunk of one) as codes: u[k], d[k/16], m[k/16], natural order. */
typedef struct {
    uint8_t *u;
    float *d;
    float *m;
} CodedRow;

static int has_codes(int64_t type) {
    return type != GGML_F32 && type != GGML_F16 && type != GGML_BF16;
}

/* 32 codes from 16 bytes of nibbles: low nibbles first, then high nibbles (ggml's order). */
static inline void nibbles32(const uint8_t *restrict qs, uint8_t *restrict u) {
    for (int j = 0; j < 16; j++) {
        u[j] = qs[j] & 0xF;
        u[j + 16] = qs[j] >> 4;
    }
}

static inline void set_groups(float *d, float *m, int count, float scale, float offset) {
    for (int g = 0; g < count; g++) {
        d[g] = scale;
        m[g] = offset;
    }
}

#if !defined(POLYLANE_PORTABLE) && defined(__AVX2__)
/* The hot formats' codes with AVX2 intrinsics (the same codes as the C below). */
static inline void nibbles_simd(const uint8_t *restrict qs, uint8_t *restrict u) { /* 16 bytes → 32 codes */
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0F);
    _mm_storeu_si128((__m128i *)u, _mm_and_si128(bytes, low4));
    _mm_storeu_si128((__m128i *)(u + 16), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
}

/* A 32-block's d and m for its two groups. */
static inline void set_block_scales(float *d, float *m, float scale, float offset) {
    d[0] = d[1] = scale;
    m[0] = m[1] = offset;
}

/* A Q4_K/Q5_K super-block's eight 6-bit (scale, min) pairs unpacked as ggml's vec_dot does (four
   32-bit words): bytes 0–7 the sub-blocks' scales, 8–15 their mins. With the 12 packed bytes' words
   a, b, c: a & 0x3f3f3f3f, (c & 0x0f0f0f0f) | the top two bits of a's bytes at bits 4–5, b &
   0x3f3f3f3f, (c >> 4 & 0x0f0f0f0f) | b's top two bits likewise. Built in vector registers from one
   load (a super-block's 144 bytes cover the 16 read): the same words from scalar loads, masks and
   inserts made the one-row Q4_K kernel 3% slower, and a round trip through memory stalls store
   forwarding (measurements: docs/performance.md). */
static inline __m128i k4_scale_bytes(const uint8_t *block) {
    const __m128i words = _mm_loadu_si128((const __m128i *)(block + 4));    /* a, b, c and the next word */
    const __m128i low = _mm_shuffle_epi32(words, _MM_SHUFFLE(2, 1, 2, 0));  /* a, c, b, c */
    const __m128i high = _mm_shuffle_epi32(words, _MM_SHUFFLE(1, 1, 0, 0)); /* a, a, b, b */
    const __m128i low_bits = _mm_and_si128(_mm_srlv_epi32(low, _mm_setr_epi32(0, 0, 0, 4)),
                                           _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i top_bits = _mm_and_si128(_mm_srli_epi32(high, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(low_bits, top_bits);
}

/* A Q4_K/Q5_K super-block's d and dmin (its first two halves) as floats in lanes 0 and 1: one 32-bit
   load and one conversion (exact, as half_at's), for every Q4_K path. */
static inline __m128 k4_halves(const uint8_t *block) {
    int32_t word;
    memcpy(&word, block, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(word));
}

/* A Q4_K/Q5_K super-block's eight sub-block scales times d, and its eight mins times dmin, negated
   where `negate` (the coded path's offsets −dmin · min; the one-row AVX2 kernel subtracts dmin · min
   instead): the floats of every Q4_K path on AVX2. */
static inline __attribute__((always_inline)) void k4_sub_block_factors(const uint8_t *block, const int negate, __m256 *scales,
                                                                       __m256 *mins) {
    const __m128i packed = k4_scale_bytes(block);
    const __m128 halves = k4_halves(block), dmin = _mm_movehdup_ps(halves);
    *scales = _mm256_mul_ps(_mm256_broadcastss_ps(halves), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed)));
    *mins = _mm256_mul_ps(_mm256_broadcastss_ps(negate ? _mm_xor_ps(dmin, _mm_set1_ps(-0.0f)) : dmin),
                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))));
}

/* A Q4_K/Q5_K super-block's 16 group scales and offsets: its sub-blocks' scales and mins times d
   and −dmin, each for two groups. */
static inline void k4_group_scales(const uint8_t *block, float *d, float *m) {
    __m256 scales, mins;
    k4_sub_block_factors(block, 1, &scales, &mins);
    const __m256i first = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), second = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    _mm256_storeu_ps(d, _mm256_permutevar8x32_ps(scales, first));
    _mm256_storeu_ps(d + 8, _mm256_permutevar8x32_ps(scales, second));
    _mm256_storeu_ps(m, _mm256_permutevar8x32_ps(mins, first));
    _mm256_storeu_ps(m + 8, _mm256_permutevar8x32_ps(mins, second));
}

static int simd_code_row(int64_t type, const uint8_t *restrict row, int64_t k, CodedRow out) {
    uint8_t *restrict u = out.u;
    float *restrict d = out.d, *restrict m = out.m;
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
    switch (type) {
    case GGML_Q4_0:
        for (int64_t b = 0; b < k / 32; b++, row += 18, u += 32, d += 2, m += 2) {
            const float scale = half_at(row);
            nibbles_simd(row + 2, u);
            set_block_scales(d, m, scale, -8.0f * scale);
        }
        return 1;
    case GGML_Q4_1:
        for (int64_t b = 0; b < k / 32; b++, row += 20, u += 32, d += 2, m += 2) {
            nibbles_simd(row + 4, u);
            set_block_scales(d, m, half_at(row), half_at(row + 2));
        }
        return 1;
    case GGML_Q5_0:
        for (int64_t b = 0; b < k / 32; b++, row += 22, u += 32, d += 2, m += 2) {
            const float scale = half_at(row);
            uint32_t qh;
            memcpy(&qh, row + 2, 4);
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(row + 6)), nibble = _mm_set1_epi8(0x0F);
            _mm_storeu_si128((__m128i *)u, _mm_or_si128(_mm_and_si128(bytes, nibble), fifth_bits(qh, 0)));
            _mm_storeu_si128((__m128i *)(u + 16),
                             _mm_or_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), fifth_bits(qh, 16)));
            set_block_scales(d, m, scale, -16.0f * scale);
        }
        return 1;
    case GGML_Q8_0:
        for (int64_t b = 0; b < k / 32; b++, row += 34, u += 32, d += 2, m += 2) {
            const float scale = half_at(row);
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + 2));
#if defined(Q8_AVX2) /* the int8 values as they are (vpmaddubsw would saturate on int8 + 128) */
            _mm256_storeu_si256((__m256i *)u, bytes);
            set_block_scales(d, m, scale, 0.0f);
#else
            _mm256_storeu_si256((__m256i *)u, _mm256_xor_si256(bytes, _mm256_set1_epi8((char)0x80)));
            set_block_scales(d, m, scale, -128.0f * scale);
#endif
        }
        return 1;
    case GGML_Q4_K:
        for (int64_t b = 0; b < k / 256; b++, row += 144, d += 16, m += 16) {
            const uint8_t *q = row + 16;
            for (int j = 0; j < 4; j++, q += 32, u += 64) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)q);
                _mm256_storeu_si256((__m256i *)u, _mm256_and_si256(bytes, low4));
                _mm256_storeu_si256((__m256i *)(u + 32), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
            }
            k4_group_scales(row, d, m);
        }
        return 1;
    case GGML_Q6_K:
        for (int64_t b = 0; b < k / 256; b++, row += 210) {
            const float scale = half_at(row + 208);
            const uint8_t *ql = row, *qh = row + 128;
            const int8_t *sc = (const int8_t *)(row + 192);
            for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, u += 128, d += 8, m += 8) {
                const __m256i low_a = _mm256_loadu_si256((const __m256i *)ql);
                const __m256i low_b = _mm256_loadu_si256((const __m256i *)(ql + 32));
                const __m256i high = _mm256_loadu_si256((const __m256i *)qh);
                for (int q = 0; q < 4; q++) {
                    const __m256i low = q & 1 ? low_b : low_a;
                    const __m256i nibble = _mm256_and_si256(q < 2 ? low : _mm256_srli_epi16(low, 4), low4);
                    const __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * q)), low2), 4);
                    _mm256_storeu_si256((__m256i *)(u + 32 * q), _mm256_or_si256(nibble, top));
                }
                /* group 2q + part takes sc[2q + part]: the scales are in group order */
                const __m256 group_scale = _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
                _mm256_storeu_ps(d, group_scale);
                _mm256_storeu_ps(m, _mm256_mul_ps(_mm256_set1_ps(-32.0f), group_scale));
            }
        }
        return 1;
    }
    return 0;
}
#endif

static void scalar_code_row(int64_t type, const uint8_t *restrict row, int64_t k, CodedRow out);

/* A row of k elements of a quantised `type` as codes, scales and offsets (see the file comment). */
static void code_row(int64_t type, const uint8_t *restrict row, int64_t k, CodedRow out) {
#if !defined(POLYLANE_PORTABLE) && defined(__AVX2__)
    if (simd_code_row(type, row, k, out)) return;
#endif
    scalar_code_row(type, row, k, out);
}

/* code_row in C, d one float per group. */
static void scalar_code_row(int64_t type, const uint8_t *restrict row, int64_t k, CodedRow out) {
    uint8_t *restrict u = out.u;
    float *restrict d = out.d, *restrict m = out.m;
    switch (type) {
    case GGML_Q4_0:
        for (int64_t b = 0; b < k / 32; b++, row += 18, u += 32, d += 2, m += 2) {
            const float scale = half_at(row);
            nibbles32(row + 2, u);
            set_groups(d, m, 2, scale, -8.0f * scale);
        }
        return;
    case GGML_Q4_1:
        for (int64_t b = 0; b < k / 32; b++, row += 20, u += 32, d += 2, m += 2) {
            nibbles32(row + 4, u);
            set_groups(d, m, 2, half_at(row), half_at(row + 2));
        }
        return;
    case GGML_Q5_0:
    case GGML_Q5_1: {
        const int64_t block_bytes = type == GGML_Q5_0 ? 22 : 24, header = type == GGML_Q5_0 ? 2 : 4;
        for (int64_t b = 0; b < k / 32; b++, row += block_bytes, u += 32, d += 2, m += 2) {
            const float scale = half_at(row);
            uint32_t qh;
            memcpy(&qh, row + header, 4);
            nibbles32(row + header + 4, u);
            for (int j = 0; j < 32; j++) u[j] |= (uint8_t)(((qh >> j) & 1) << 4);
            set_groups(d, m, 2, scale, type == GGML_Q5_0 ? -16.0f * scale : half_at(row + 2));
        }
        return;
    }
    case GGML_Q8_0:
        for (int64_t b = 0; b < k / 32; b++, row += 34, u += 32, d += 2, m += 2) {
            const float scale = half_at(row);
            for (int j = 0; j < 32; j++) u[j] = row[2 + j] ^ 0x80; /* int8 + 128 */
            set_groups(d, m, 2, scale, -128.0f * scale);
        }
        return;
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const int five = type == GGML_Q5_K;
        const int64_t block_bytes = five ? 176 : 144;
        for (int64_t b = 0; b < k / 256; b++, row += block_bytes) {
            const float scale = half_at(row), min_scale = half_at(row + 2);
            const uint8_t *scales = row + 4, *qh = row + 16, *q = row + (five ? 48 : 16);
            for (int j = 0; j < 4; j++, q += 32, u += 64, d += 4, m += 4) {
                uint8_t sc, mn;
                for (int l = 0; l < 32; l++) {
                    u[l] = q[l] & 0xF;
                    u[32 + l] = q[l] >> 4;
                }
                if (five) {
                    for (int l = 0; l < 32; l++) {
                        u[l] |= (uint8_t)(((qh[l] >> (2 * j)) & 1) << 4);
                        u[32 + l] |= (uint8_t)(((qh[l] >> (2 * j + 1)) & 1) << 4);
                    }
                }
                scale_min_k4(2 * j, scales, &sc, &mn);
                set_groups(d, m, 2, scale * sc, -(min_scale * mn));
                scale_min_k4(2 * j + 1, scales, &sc, &mn);
                set_groups(d + 2, m + 2, 2, scale * sc, -(min_scale * mn));
            }
        }
        return;
    }
    case GGML_Q6_K:
        for (int64_t b = 0; b < k / 256; b++, row += 210) {
            const float scale = half_at(row + 208);
            const uint8_t *ql = row, *qh = row + 128;
            const int8_t *sc = (const int8_t *)(row + 192);
            for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, u += 128, d += 8, m += 8) {
                /* element l + 32q of the 128: low 4 bits from ql[l] (q 0, 2) or ql[l + 32] (q 1, 3),
                   low nibble for q < 2, high for q ≥ 2; high 2 bits from qh[l] >> 2q; scale
                   sc[l / 16 + 2q] */
                for (int q = 0; q < 4; q++) {
                    const uint8_t *low = ql + (q & 1) * 32;
                    const int shift = q < 2 ? 0 : 4;
                    for (int l = 0; l < 32; l++)
                        u[32 * q + l] = (uint8_t)(((low[l] >> shift) & 0xF) | (((qh[l] >> (2 * q)) & 3) << 4));
                    for (int part = 0; part < 2; part++) {
                        const float group_scale = scale * (float)sc[part + 2 * q];
                        d[2 * q + part] = group_scale;
                        m[2 * q + part] = -32.0f * group_scale;
                    }
                }
            }
        }
        return;
    }
}

/* ---------------------------------------------------------------- lane layout

A span's codes in "lane layout": the group sums of a span are formed in integers, one group per
32-bit lane, before any float operation (one float multiply-add per group rather than one per four
codes). vpdpbusd (and vpmaddubsw + vpmaddwd) sum four adjacent bytes into a lane, so the span's
bytes are reordered: step s (64 bytes on VNNI, 32 on AVX2) holds in lane n the bytes 4s..4s+3 of
group g(n), and four steps summed give each lane its group's whole sum. The reorder is a 4×4
transpose of 32-bit words inside each 128-bit lane, so g(n) = 4(n % 4) + n / 4 on VNNI (16 groups)
and 2(n % 4) + n / 4 on AVX2 (8 groups); the group scales are permuted alike. Weight rows are
coded this way once per tile and activation rows once per product, so a prompt pays for the
reorder once per row and no more in the dot. Portable C keeps the natural order (SPAN = GROUP). */

#if defined(Q8_VNNI)
/* v[s] ← 32-bit word s of each 128-bit lane of the four v, lane by lane (the transpose above).
   group_sums: the four so transposed, summed: the lane-order group sums of four natural-order
   vectors of four-code sums (what the decode kernels have). */
static inline void transpose_words(__m512i v[4]) {
    const __m512i a = _mm512_unpacklo_epi32(v[0], v[1]), b = _mm512_unpackhi_epi32(v[0], v[1]);
    const __m512i c = _mm512_unpacklo_epi32(v[2], v[3]), e = _mm512_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm512_unpacklo_epi64(a, c);
    v[1] = _mm512_unpackhi_epi64(a, c);
    v[2] = _mm512_unpacklo_epi64(b, e);
    v[3] = _mm512_unpackhi_epi64(b, e);
}

static inline __m512i group_sums(__m512i v[4]) {
    transpose_words(v);
    return _mm512_add_epi32(_mm512_add_epi32(v[0], v[1]), _mm512_add_epi32(v[2], v[3]));
}

/* the group in lane n: 4(n % 4) + n / 4 */
#define LANE_GROUPS _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)

/* A span's four natural-order steps `v` (in registers) stored at `bytes` in lane layout, and its
   group scales permuted alike in place. */
static inline void steps_to_lanes(__m512i v[4], uint8_t *bytes, float *scales) {
    transpose_words(v);
    for (int s = 0; s < 4; s++) _mm512_storeu_si512(bytes + 64 * s, v[s]);
    _mm512_storeu_ps(scales, _mm512_permutexvar_ps(LANE_GROUPS, _mm512_loadu_ps(scales)));
}

static void span_to_lanes(uint8_t *bytes, float *scales) {
    __m512i v[4];
    for (int s = 0; s < 4; s++) v[s] = _mm512_loadu_si512(bytes + 64 * s);
    steps_to_lanes(v, bytes, scales);
}
#elif defined(Q8_AVX2)
static inline void transpose_words(__m256i v[4]) {
    const __m256i a = _mm256_unpacklo_epi32(v[0], v[1]), b = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i c = _mm256_unpacklo_epi32(v[2], v[3]), e = _mm256_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm256_unpacklo_epi64(a, c);
    v[1] = _mm256_unpackhi_epi64(a, c);
    v[2] = _mm256_unpacklo_epi64(b, e);
    v[3] = _mm256_unpackhi_epi64(b, e);
}

static inline __m256i group_sums(__m256i v[4]) {
    transpose_words(v);
    return _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
}

/* the group in lane n: 2(n % 4) + n / 4 */
#define LANE_GROUPS _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)

static inline void steps_to_lanes(__m256i v[4], uint8_t *bytes, float *scales) {
    transpose_words(v);
    for (int s = 0; s < 4; s++) _mm256_storeu_si256((__m256i *)(bytes + 32 * s), v[s]);
    _mm256_storeu_ps(scales, _mm256_permutevar8x32_ps(_mm256_loadu_ps(scales), LANE_GROUPS));
}

static void span_to_lanes(uint8_t *bytes, float *scales) {
    __m256i v[4];
    for (int s = 0; s < 4; s++) v[s] = _mm256_loadu_si256((const __m256i *)(bytes + 32 * s));
    steps_to_lanes(v, bytes, scales);
}
#else
static void span_to_lanes(uint8_t *bytes, float *scales) { (void)bytes, (void)scales; }
#endif

/* `columns` codes and their group scales, natural order, into lane layout in place; the buffers
   hold whole spans, and the columns past `columns` are set to zero codes and zero scales. */
static void to_lanes(uint8_t *codes, float *scales, int64_t columns) {
    const int64_t padded = whole_spans(columns);
    memset(codes + columns, 0, (size_t)(padded - columns));
    for (int64_t g = columns / GROUP; g < padded / GROUP; g++) scales[g] = 0.0f;
    for (int64_t c = 0; c < padded; c += SPAN) span_to_lanes(codes + c, scales + c / GROUP);
}

/* ---------------------------------------------------------------- activations */

/* An activation row rounded to 8 bits: q (int8, natural order: the decode kernels' input) and the
   same values in lane layout, each group's scale in lane layout, and per group (natural order)
   scale·Σq, the offset term's factor. Buffers hold whole spans. A single row (decode) on VNNI also
   has its values, scales and offset factors in the order of blocks_q8_decode.c's Q4_K kernel
   (`k4`, `k4_scale`, `k4_group_sum`; NULL otherwise). */
typedef struct {
    int8_t *q;
    int8_t *lanes;
    float *scale;
    float *group_sum;
    int8_t *k4;
    float *k4_scale;
    float *k4_group_sum;
} CodedActivations;

/* Bytes of one coded activation row of k columns; `decode`: with the Q4_K kernel's copy (VNNI). */
static size_t activation_bytes(int64_t k, int decode) {
    const size_t padded = (size_t)whole_spans(k);
    const size_t coded = 2 * padded + 2 * (padded / GROUP) * sizeof(float);
#if defined(Q8_VNNI)
    if (decode) return 2 * coded;
#endif
    (void)decode;
    return coded;
}

static CodedActivations activation_layout(uint8_t *base, int64_t k, int decode) {
    const size_t padded = (size_t)whole_spans(k);
    CodedActivations a;
    a.q = (int8_t *)base;
    a.lanes = (int8_t *)(base + padded);
    a.scale = (float *)(base + 2 * padded);
    a.group_sum = a.scale + padded / GROUP;
    a.k4 = NULL;
    a.k4_scale = a.k4_group_sum = NULL;
#if defined(Q8_VNNI)
    if (decode) {
        a.k4 = (int8_t *)(a.group_sum + padded / GROUP);
        a.k4_scale = (float *)(base + 3 * padded + 2 * (padded / GROUP) * sizeof(float));
        a.k4_group_sum = a.k4_scale + padded / GROUP;
    }
#endif
    (void)decode;
    return a;
}

#if defined(Q8_VNNI)
/* The Q4_K decode kernel's order (blocks_q8_decode.c decode_span_k4). It unpacks a super-block's
   four 64-code vectors from two 64-byte loads: vector p (low or high nibbles of 64 bytes) holds in
   its 128-bit block b the natural group K4_GROUPS[4b + p]; lane n of its group sums (after the
   pack-and-add reduction) holds that group. So the activations go in that order (vector p's 64
   values: the groups K4_GROUPS[p], [4 + p], [8 + p], [12 + p]), their scales by lane likewise,
   and the offset factor in lane n is that of natural group lane_group(K4_GROUPS[n]) (the coded path
   adds in lane n the sum term of group LANE_GROUPS[n] and the offset term of group n). */
static const int K4_GROUPS[16] = {0, 2, 8, 10, 1, 3, 9, 11, 4, 6, 12, 14, 5, 7, 13, 15};
static inline int lane_group(int n) { return 4 * (n % 4) + n / 4; } /* LANE_GROUPS[n] */

static void k4_order_span(CodedActivations a, int64_t span) {
    const int64_t g0 = span * SPAN_GROUPS;
    for (int p = 0; p < 4; p++)
        for (int b = 0; b < 4; b++) memcpy(a.k4 + SPAN * span + 64 * p + 16 * b, a.q + GROUP * (g0 + K4_GROUPS[4 * b + p]), GROUP);
    for (int n = 0; n < 16; n++) {
        a.k4_scale[g0 + n] = a.scale[g0 + K4_GROUPS[n]];
        a.k4_group_sum[g0 + n] = a.group_sum[g0 + lane_group(K4_GROUPS[n])];
    }
}
#endif

#if defined(Q8_VNNI) || defined(Q8_AVX2)
/* Group g of x[k] rounded to 8 bits (code_activation_span's C, in vectors: the same floats, the
   rounding to nearest even as nearbyintf's, the integer sum exact): its 16 codes, returned, and its
   scale and offset factor, stored. Zeros past k. */
static inline __attribute__((always_inline)) __m128i code_activation_group(const float *restrict x, int64_t k, CodedActivations a,
                                                                           int64_t g) {
    if (g >= k / GROUP) {
        a.scale[g] = a.group_sum[g] = 0.0f;
        return _mm_setzero_si128();
    }
#if defined(Q8_VNNI)
    const __m512 values = _mm512_loadu_ps(x + GROUP * g);
    const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(values));
    const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(values, _mm512_set1_ps(inverse)),
                                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    a.scale[g] = scale;
    a.group_sum[g] = scale * (float)_mm512_reduce_add_epi32(q);
    return _mm512_cvtepi32_epi8(q);
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 low = _mm256_loadu_ps(x + GROUP * g), high = _mm256_loadu_ps(x + GROUP * g + 8);
    __m256 top = _mm256_max_ps(_mm256_andnot_ps(sign, low), _mm256_andnot_ps(sign, high));
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
    const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 factor = _mm256_set1_ps(inverse);
    const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256i q_low = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(low, factor), rounding));
    const __m256i q_high = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(high, factor), rounding));
    const __m256i words = _mm256_packs_epi32(q_low, q_high); /* (per 128-bit half: low 4, high 4) */
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    __m256i total8 = _mm256_add_epi32(q_low, q_high);
    __m128i total4 = _mm_add_epi32(_mm256_castsi256_si128(total8), _mm256_extracti128_si256(total8, 1));
    total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, _MM_SHUFFLE(1, 0, 3, 2)));
    total4 = _mm_add_epi32(total4, _mm_shuffle_epi32(total4, _MM_SHUFFLE(2, 3, 0, 1)));
    a.scale[g] = scale;
    a.group_sum[g] = scale * (float)_mm_cvtsi128_si32(total4);
    return _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0));
#endif
}
#endif

/* Rounds span `span` (SPAN columns) of x[k] to 8 bits per group of 16 (the weights' group):
   scale = max|x| / 127, q = round(x · 127 / max|x|), and writes the span's lane layout. Groups of 16
   rather than llama.cpp's 32 or 256 halve the reach of an outlier, at no cost in the dot products
   (the weights have a scale per 16 anyway). Columns past k are zeros. With SIMD each of the span's
   four steps is built in a register, stored whole, and put in lane layout in registers: reading the
   codes back from their 16-byte stores stalled on store forwarding (5% of a batch-8 decode step). */
static void code_activation_span(const float *restrict x, int64_t k, CodedActivations a, int64_t span) {
    const int64_t g0 = span * SPAN_GROUPS;
#if defined(Q8_VNNI)
    __m512i steps[4];
    for (int s = 0; s < 4; s++) {
        const __m128i b0 = code_activation_group(x, k, a, g0 + 4 * s), b1 = code_activation_group(x, k, a, g0 + 4 * s + 1);
        const __m128i b2 = code_activation_group(x, k, a, g0 + 4 * s + 2), b3 = code_activation_group(x, k, a, g0 + 4 * s + 3);
        steps[s] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(b1, b0)), _mm256_set_m128i(b3, b2), 1);
        _mm512_storeu_si512(a.q + SPAN * span + 64 * s, steps[s]);
    }
    if (a.k4) k4_order_span(a, span);
    steps_to_lanes(steps, (uint8_t *)a.lanes + SPAN * span, a.scale + g0);
#elif defined(Q8_AVX2)
    __m256i steps[4];
    for (int s = 0; s < 4; s++) {
        const __m128i b0 = code_activation_group(x, k, a, g0 + 2 * s), b1 = code_activation_group(x, k, a, g0 + 2 * s + 1);
        steps[s] = _mm256_set_m128i(b1, b0);
        _mm256_storeu_si256((__m256i *)(a.q + SPAN * span + 32 * s), steps[s]);
    }
    steps_to_lanes(steps, (uint8_t *)a.lanes + SPAN * span, a.scale + g0);
#else
    for (int64_t g = g0; g < g0 + SPAN_GROUPS; g++) {
        if (g >= k / GROUP) {
            memset(a.q + GROUP * g, 0, GROUP);
            a.scale[g] = a.group_sum[g] = 0.0f;
            continue;
        }
        float amax = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            const float magnitude = fabsf(x[GROUP * g + j]);
            amax = magnitude > amax ? magnitude : amax; /* (vectorises; fmaxf calls libm) */
        }
        const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        a.scale[g] = scale;
        int sum = 0;
        for (int j = 0; j < GROUP; j++) {
            const int q = (int)nearbyintf(x[GROUP * g + j] * inverse);
            a.q[GROUP * g + j] = (int8_t)q;
            sum += q;
        }
        a.group_sum[g] = scale * (float)sum;
    }
    memcpy(a.lanes + SPAN * span, a.q + SPAN * span, SPAN); /* (portable: the lane layout is the natural order) */
#endif
}

/* ---------------------------------------------------------------- dot products */

/* Holds a loaded vector in a register from here on: without it GCC folds the load into each
   instruction that uses the vector (a memory operand per use), and the product waits on loads. */
#if defined(Q8_VNNI) || defined(Q8_AVX2)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#endif

#if defined(Q8_AVX2)
/* How many of a span's four steps sum their vpmaddubsw pairs in 16 bits before one vpmaddwd by
   ones: a pair of codes up to c times activations up to 127 in magnitude is at most 2·127·c
   (4-bit codes 3,810, 5-bit 7,874, 6-bit 16,002), so four steps of 4- and 5-bit codes fit in 16
   bits, two of Q6_K's, and one of Q8_0's magnitudes (up to 128: 32,512). The sums are exact
   integers however they are grouped: every path's group sums stay the same. */
static inline int pair_steps(int64_t type) {
    switch (type) {
    case GGML_Q6_K: return 2;
    case GGML_Q8_0: return 1;
    default: return 4;
    }
}

/* A span's group sums in lane layout: codes w[s] (unsigned; Q8_0's signed, see simd_code_row)
   times activations xq[s], s < 4, by vpmaddubsw (Q8_0: magnitudes times the activations with the
   codes' signs, vpsignb), `steps` (pair_steps) of them summed in 16 bits per vpmaddwd. */
static inline __attribute__((always_inline)) __m256i span_sum(int steps, const __m256i w[4], const __m256i xq[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (steps == 4) {
        const __m256i low = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], xq[0]), _mm256_maddubs_epi16(w[1], xq[1]));
        const __m256i high = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], xq[2]), _mm256_maddubs_epi16(w[3], xq[3]));
        return _mm256_madd_epi16(_mm256_add_epi16(low, high), ones);
    }
    if (steps == 2) {
        const __m256i low = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], xq[0]), _mm256_maddubs_epi16(w[1], xq[1]));
        const __m256i high = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], xq[2]), _mm256_maddubs_epi16(w[3], xq[3]));
        return _mm256_add_epi32(_mm256_madd_epi16(low, ones), _mm256_madd_epi16(high, ones));
    }
    __m256i sum = _mm256_setzero_si256();
    for (int s = 0; s < 4; s++)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[s]), _mm256_sign_epi8(xq[s], w[s])), ones));
    return sum;
}
#endif

/* A tile's running sums: per weight row, one vector of lanes (16 floats for VNNI, 8 for AVX2, the
   first only in C), kept between the chunks of a row. */
typedef struct {
    float lanes[TILE_ROWS][16];
} TileSums;

/* Adds x[c0, c0 + len) · w[r][c0, c0 + len) to sums for r < TILE_ROWS: w the tile's coded chunk in
   lane layout (codes `chunk` bytes apart, group scales `chunk / 16` floats apart; chunk and c0 whole
   spans), m the rows' offsets (natural order, `m_ld` floats apart, from column 0). Per span and
   row: the group sums in integers, then lanes += float(sum) · (d · dx) and lanes += m · dx·Σq (the
   offsets in natural group order). Every row's lanes see the same operations whatever the other
   rows hold or the batch is. */
static void coded_tile_step(const CodedActivations *x, int64_t c0, int64_t len, int64_t chunk, const uint8_t *u,
                            const float *d, const float *m, int64_t m_ld, const int64_t *types, TileSums *sums) {
    const int64_t d_ld = chunk / GROUP;
    (void)types; /* used by AVX2 only */
#if defined(Q8_VNNI)
    for (int r = 0; r < TILE_ROWS; r++) {
        __m512 lanes = _mm512_loadu_ps(sums->lanes[r]);
        for (int64_t i = 0; i < len; i += SPAN) {
            const uint8_t *codes = u + r * chunk + i;
            const int8_t *xq = x->lanes + c0 + i;
            __m512i sum = _mm512_setzero_si512();
            for (int s = 0; s < 4; s++)
                sum = _mm512_dpbusd_epi32(sum, _mm512_loadu_si512(codes + 64 * s), _mm512_loadu_si512(xq + 64 * s));
            const int64_t g = (c0 + i) / GROUP;
            const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(d + r * d_ld + i / GROUP), _mm512_loadu_ps(x->scale + g));
            lanes = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, lanes);
            lanes = _mm512_fmadd_ps(_mm512_loadu_ps(m + r * m_ld + g), _mm512_loadu_ps(x->group_sum + g), lanes);
        }
        _mm512_storeu_ps(sums->lanes[r], lanes);
    }
#elif defined(Q8_AVX2)
    int steps[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) steps[r] = pair_steps(types[r]);
    __m256 lanes[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) lanes[r] = _mm256_loadu_ps(sums->lanes[r]);
    for (int64_t i = 0; i < len; i += SPAN) { /* the four rows together: each activation vector loaded once */
        __m256i xq[4];
        for (int s = 0; s < 4; s++) {
            xq[s] = _mm256_loadu_si256((const __m256i *)(x->lanes + c0 + i + 32 * s));
            IN_REGISTER(xq[s]);
        }
        const int64_t g = (c0 + i) / GROUP;
        const __m256 xs = _mm256_loadu_ps(x->scale + g), gs = _mm256_loadu_ps(x->group_sum + g);
        for (int r = 0; r < TILE_ROWS; r++) {
            __m256i w[4];
            for (int s = 0; s < 4; s++) w[s] = _mm256_loadu_si256((const __m256i *)(u + r * chunk + i + 32 * s));
            const __m256i sum = span_sum(steps[r], w, xq);
            const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(d + r * d_ld + i / GROUP), xs);
            lanes[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, lanes[r]);
            lanes[r] = _mm256_fmadd_ps(_mm256_loadu_ps(m + r * m_ld + g), gs, lanes[r]);
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) _mm256_storeu_ps(sums->lanes[r], lanes[r]);
#else
    for (int r = 0; r < TILE_ROWS; r++) {
        float lanes = sums->lanes[r][0];
        for (int64_t i = 0; i < len; i += GROUP) {
            const int64_t g = (c0 + i) / GROUP;
            int32_t sum = 0;
            for (int j = 0; j < GROUP; j++) sum += (int32_t)u[r * chunk + i + j] * (int32_t)x->q[c0 + i + j];
            lanes += (float)sum * (d[r * d_ld + i / GROUP] * x->scale[g]);
            lanes += m[r * m_ld + g] * x->group_sum[g];
        }
        sums->lanes[r][0] = lanes;
    }
#endif
}

#if defined(Q8_VNNI)
/* coded_tile_step for two activation rows at once, the tile's four weight rows taken together in
   each step of 64 codes: each code vector is loaded once for both activation rows and each
   activation vector once for the four weight rows. Every (activation row, weight row) pair's lanes
   take exactly the operations coded_tile_step gives them. */
static void coded_tile_step_pair(const CodedActivations *x0, const CodedActivations *x1, int64_t c0, int64_t len,
                                 int64_t chunk, const uint8_t *u, const float *d, const float *m, int64_t m_ld,
                                 TileSums *sums0, TileSums *sums1) {
    const int64_t d_ld = chunk / GROUP;
    __m512 lanes[2][TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) {
        lanes[0][r] = _mm512_loadu_ps(sums0->lanes[r]);
        lanes[1][r] = _mm512_loadu_ps(sums1->lanes[r]);
    }
    for (int64_t i = 0; i < len; i += SPAN) {
        __m512i sum[2][TILE_ROWS];
        for (int r = 0; r < TILE_ROWS; r++) sum[0][r] = sum[1][r] = _mm512_setzero_si512();
        for (int s = 0; s < 4; s++) {
            __m512i xq0 = _mm512_loadu_si512(x0->lanes + c0 + i + 64 * s), xq1 = _mm512_loadu_si512(x1->lanes + c0 + i + 64 * s);
            IN_REGISTER(xq0);
            IN_REGISTER(xq1);
            for (int r = 0; r < TILE_ROWS; r++) {
                const __m512i w = _mm512_loadu_si512(u + r * chunk + i + 64 * s);
                sum[0][r] = _mm512_dpbusd_epi32(sum[0][r], w, xq0);
                sum[1][r] = _mm512_dpbusd_epi32(sum[1][r], w, xq1);
            }
        }
        const int64_t g = (c0 + i) / GROUP;
        const __m512 xs0 = _mm512_loadu_ps(x0->scale + g), xs1 = _mm512_loadu_ps(x1->scale + g);
        const __m512 gs0 = _mm512_loadu_ps(x0->group_sum + g), gs1 = _mm512_loadu_ps(x1->group_sum + g);
        for (int r = 0; r < TILE_ROWS; r++) {
            const __m512 scale = _mm512_loadu_ps(d + r * d_ld + i / GROUP), offset = _mm512_loadu_ps(m + r * m_ld + g);
            lanes[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[0][r]), _mm512_mul_ps(scale, xs0), lanes[0][r]);
            lanes[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[1][r]), _mm512_mul_ps(scale, xs1), lanes[1][r]);
            lanes[0][r] = _mm512_fmadd_ps(offset, gs0, lanes[0][r]);
            lanes[1][r] = _mm512_fmadd_ps(offset, gs1, lanes[1][r]);
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) {
        _mm512_storeu_ps(sums0->lanes[r], lanes[0][r]);
        _mm512_storeu_ps(sums1->lanes[r], lanes[1][r]);
    }
}
#endif

/* A row pair's result: the sum of its lanes (see TileSums). */
static inline float lanes_total(const float *lanes) {
#if defined(Q8_VNNI)
    return _mm512_reduce_add_ps(_mm512_loadu_ps(lanes));
#elif defined(Q8_AVX2)
    const __m256 acc = _mm256_loadu_ps(lanes);
    __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    sum4 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
    sum4 = _mm_add_ss(sum4, _mm_movehdup_ps(sum4));
    return _mm_cvtss_f32(sum4);
#else
    return lanes[0];
#endif
}

#include "blocks_q8_decode.c" /* one activation row: the hot formats dotted straight from the blocks */

/* ---------------------------------------------------------------- products */

static int has_segment(const BlockMatrix *w, int64_t type) {
    for (int64_t s = 0; s < w->num_segments; s++)
        if (w->segments[s].type == type) return 1;
    return 0;
}

static int coded_matrix(const BlockMatrix *w) {
    for (int64_t s = 0; s < w->num_segments; s++)
        if (!has_codes(w->segments[s].type)) return 0;
    return 1;
}

/* Whether every row of a tile has a decode kernel (blocks_q8_decode.c). */
static int decodes_tile(const int64_t *types, int64_t count) {
    for (int64_t r = 0; r < count; r++)
        if (!has_decode_kernel(types[r])) return 0;
    return 1;
}

/* At least `bytes` of 64-byte aligned memory for the calling thread's products, kept from one
   product to the next and grown when a larger one asks (a decode step makes one or two hundred
   products; fresh memory each time, page faults included, cost as much as a small product). Each
   thread that multiplies keeps its largest (a prompt's: a few hundred KB) until the process ends.
   NULL without memory. */
static uint8_t *calling_thread_scratch(size_t bytes) {
    static _Thread_local uint8_t *memory;
    static _Thread_local size_t capacity;
    if (bytes > capacity) {
        free(memory);
        capacity = (bytes + 63) & ~(size_t)63;
        memory = aligned_alloc(64, capacity);
        if (memory == NULL) capacity = 0;
    }
    return memory;
}

/* y (rows, out_features) = x·Wᵀ + bias with x rounded to 8 bits per group (blocks.c's matmul when
   the matrix asks for 8-bit activations). 0, or 1 when scratch memory ran out.

   Per thread, a tile of TILE_ROWS weight rows is coded `chunk` columns at a time into a buffer (in
   lane layout), and every activation row of the block takes that chunk before the next is coded;
   each (activation row, weight row) pair keeps its running lanes in a TileSums between chunks. A
   single activation row (decode) skips the buffer where blocks_q8_decode.c has the tile's formats. */
static int coded_matmul(const BlockMatrix *w, const float *x, int64_t rows, float *y, int threads) {
    const int64_t k = w->in_features, n_total = w->out_features;
    const int64_t tiles = (n_total + TILE_ROWS - 1) / TILE_ROWS;
    const int one_row = rows == 1 && has_segment(w, GGML_Q4_K); /* the Q4_K kernel's activation copy */
    const size_t x_bytes = (activation_bytes(k, one_row) + 63) & ~(size_t)63;
    int64_t x_block = CODED_BLOCK_BYTES / (int64_t)x_bytes;
    if (x_block < 16) x_block = 16;
    if (x_block > rows) x_block = rows;
    if (threads < 1) threads = 1;
    /* A few activation rows (decode, verify): whole weight rows, read straight through (in pieces,
       the rows' scattered starts leave the hardware prefetcher behind: Q6_K rows of 8,960 columns
       code at half the speed). Many (prompts): pieces of whole super-blocks that stay in L1 while
       every activation row takes them. The pieces change no operation of any output. */
    const int64_t max_chunk = rows < WHOLE_ROWS_BELOW ? k : MAX_CHUNK;
    const int64_t pieces = (k + max_chunk - 1) / max_chunk;
    const int64_t chunk = whole_spans(((k / pieces + 255) / 256) * 256 < k ? ((k / pieces + 255) / 256) * 256 : k);
    const int64_t d_ld = chunk / GROUP;
    /* per thread: codes, d and the whole rows' m for the tile, then the pairs' running sums */
    const size_t codes_bytes = (size_t)TILE_ROWS * chunk, d_bytes = (size_t)TILE_ROWS * d_ld * sizeof(float);
    const int64_t m_ld = whole_spans(k) / GROUP; /* a row's offsets, zero past its groups */
    const size_t m_bytes = ((size_t)TILE_ROWS * m_ld * sizeof(float) + 63) & ~(size_t)63;
    const size_t thread_bytes = codes_bytes + d_bytes + m_bytes + (size_t)x_block * sizeof(TileSums);
    /* A decode step's or a small batch's rows: each thread codes them all into its own copy, so the
       products need not wait at a barrier for the threads to share the coding (a few spans a row:
       less time than the threads' skew at a barrier). */
    const int own_copy = rows <= DECODE_ROWS;
    const size_t activation_total = x_bytes * (size_t)x_block * (size_t)(own_copy ? threads : 1);
    uint8_t *activations = calling_thread_scratch(activation_total + ((thread_bytes + 63) & ~(size_t)63) * (size_t)threads);
    if (activations == NULL) return 1;
    uint8_t *scratch_all = activations + activation_total;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *scratch = scratch_all + ((thread_bytes + 63) & ~(size_t)63) * (size_t)omp_get_thread_num();
        uint8_t *codes = scratch;
        float *d = (float *)(scratch + codes_bytes), *m = (float *)(scratch + codes_bytes + d_bytes);
        TileSums *sums = (TileSums *)(scratch + codes_bytes + d_bytes + m_bytes);
        uint8_t *coded = own_copy ? activations + x_bytes * (size_t)x_block * (size_t)omp_get_thread_num() : activations;
        for (int64_t m0 = 0; m0 < rows; m0 += x_block) {
            const int64_t m1 = m0 + x_block < rows ? m0 + x_block : rows;
            /* spans, so that one row is shared by the threads: each its share, or all into its own copy */
            const int64_t row_spans = whole_spans(k) / SPAN, items = (m1 - m0) * row_spans;
            const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
            const int64_t first = own_copy ? 0 : items * t / team, last = own_copy ? items : items * (t + 1) / team;
            for (int64_t item = first; item < last; item++) {
                const int64_t row = m0 + item / row_spans;
                code_activation_span(x + row * k, k, activation_layout(coded + (size_t)(row - m0) * x_bytes, k, one_row), item % row_spans);
            }
            if (!own_copy) {
#pragma omp barrier
            }
#pragma omp for schedule(static) nowait /* (the barrier below where the next rows' coding could overwrite these) */
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t n0 = tile * TILE_ROWS;
                const int64_t count = n0 + TILE_ROWS <= n_total ? TILE_ROWS : n_total - n0;
                const uint8_t *sources[TILE_ROWS];
                int64_t types[TILE_ROWS];
                for (int64_t r = 0; r < TILE_ROWS; r++) /* a short last tile repeats its first row */
                    sources[r] = source_row(w, n0 + (r < count ? r : 0), &types[r]);
                if (rows == 1 && decodes_tile(types, count)) { /* the same numbers, without the codes' round trip */
                    const CodedActivations a = activation_layout(coded, k, one_row);
                    float totals[TILE_ROWS];
                    decode_tile(types, sources, count, k, &a, totals);
                    for (int64_t r = 0; r < count; r++) y[n0 + r] = w->bias ? totals[r] + w->bias[n0 + r] : totals[r];
                    continue;
                }
                if (rows < DECODE_ROWS_BELOW && decodes_tile(types, count)) {
                    for (int64_t j0 = m0; j0 < m1; j0 += DECODE_ROWS) {
                        const int64_t n = m1 - j0 < DECODE_ROWS ? m1 - j0 : DECODE_ROWS;
                        const CodedActivations a = activation_layout(coded + (size_t)(j0 - m0) * x_bytes, k, 0);
                        decode_tile_rows(types, sources, count, k, &a, (int64_t)x_bytes, n, y + j0 * n_total + n0, n_total);
                    }
                    if (w->bias)
                        for (int64_t row = m0; row < m1; row++)
                            for (int64_t r = 0; r < count; r++) y[row * n_total + n0 + r] += w->bias[n0 + r];
                    continue;
                }
                memset(sums, 0, (size_t)(m1 - m0) * sizeof(TileSums));
                for (int64_t r = 0; r < TILE_ROWS; r++)
                    for (int64_t g = k / GROUP; g < m_ld; g++) m[r * m_ld + g] = 0.0f;
                for (int64_t c0 = 0; c0 < k; c0 += chunk) {
                    const int64_t len = k - c0 < chunk ? k - c0 : chunk;
                    for (int64_t r = 0; r < TILE_ROWS; r++) {
                        const CodedRow coded = {codes + r * chunk, d + r * d_ld, m + r * m_ld + c0 / GROUP};
                        code_row(types[r], sources[r] + block_row_bytes(types[r], c0), len, coded);
                        to_lanes(coded.u, coded.d, len);
                    }
                    const int64_t span_len = whole_spans(len);
                    for (int64_t row = m0; row < m1; row++) {
                        const CodedActivations a = activation_layout(coded + (size_t)(row - m0) * x_bytes, k, 0);
#if defined(Q8_VNNI)
                        if (row + 1 < m1) {
                            const CodedActivations next = activation_layout(coded + (size_t)(row + 1 - m0) * x_bytes, k, 0);
                            coded_tile_step_pair(&a, &next, c0, span_len, chunk, codes, d, m, m_ld, &sums[row - m0], &sums[row + 1 - m0]);
                            row++;
                            continue;
                        }
#endif
                        coded_tile_step(&a, c0, span_len, chunk, codes, d, m, m_ld, types, &sums[row - m0]);
                    }
                }
                for (int64_t row = m0; row < m1; row++) {
                    for (int64_t r = 0; r < count; r++) {
                        const float total = lanes_total(sums[row - m0].lanes[r]);
                        y[row * n_total + n0 + r] = w->bias ? total + w->bias[n0 + r] : total;
                    }
                }
            }
            if (!own_copy) {
#pragma omp barrier
            }
        }
    }
    return 0;
}
