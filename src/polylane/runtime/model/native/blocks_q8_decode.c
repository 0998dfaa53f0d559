/* One activation row times the file's rows, straight from the blocks (included by blocks_q8.c).

What this file owns: the decode step's product (a single activation row) for Q4_0, Q4_1, Q5_0,
Q8_0, Q4_K and Q6_K (every format of the catalogue's files), on AVX-512 VNNI and on AVX2.
coded_matmul codes four weight rows into a buffer and then dots them; with one activation row each
code is used once, so storing and reloading the codes costs as much as the dot itself. Here each
span's codes are unpacked in registers and dotted at once. Q4_K, the bulk of most K-quant files,
has its own one-row kernels (decode_span_k4 on VNNI, decode_superblock_k4 on AVX2) that read ahead
of the weights (K4_AHEAD).

Bit-identical to the coded path: the codes, the integer group sums (formed from natural-order dot
products instead of lane-layout ones: integer sums, so the same), each lane's scale (the same
floats, moved by a permute instead of a store) and every float operation, in the same order, are
those of code_row → to_lanes → coded_tile_step → lanes_total (decode_span_k4 keeps its lanes in
another order and puts them back before the sum). So a decode step gives the logits a
verify pass or a prompt would give for that row (batch independence), and the tests of the coded
path hold for this one.
*/

#if defined(Q8_VNNI) || defined(Q8_AVX2)

/* Activation row j of a batch whose coded rows lie `stride` bytes apart, as the same pointer type
   as `first` (row 0's): one base pointer for every row, so that the rows' addresses need no loads. */
#define row_at(first, j, stride) ((__typeof__(first))((const char *)(first) + (j) * (stride)))

/* The formats of blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0): bytes per block, and (below) their d and m
   exactly as simd_code_row makes them. */
static int64_t small_block_bytes(int64_t type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q8_0: return 34;
    default: return 0;
    }
}

/* Where a Q4_0, Q4_1 or Q5_0 block's 16 nibble bytes start (after d, then m or the fifth bits). */
static inline int nibble_offset(int64_t type) { return type == GGML_Q4_1 ? 4 : type == GGML_Q5_0 ? 6 : 2; }

static inline int32_t word_bits(const uint8_t *p) {
    int32_t w;
    memcpy(&w, p, 4);
    return w;
}

static inline uint16_t half_bits(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* The halves at `offset` in `count` (≤ 8) consecutive blocks of `bytes` as floats, zero past them
   (built in registers: a round trip through memory stalls store forwarding on every span). */
static inline __m256 small_block_halves(const uint8_t *row, int64_t bytes, int count, int offset) {
#define HALF(j) ((j) < count ? half_bits(row + (j) * bytes + offset) : 0)
    return _mm256_cvtph_ps(_mm_setr_epi16(HALF(0), HALF(1), HALF(2), HALF(3), HALF(4), HALF(5), HALF(6), HALF(7)));
#undef HALF
}

/* The first 32-bit words of `count` (<= 8) consecutive blocks of `bytes`, zero past them. */
static inline __m256i small_block_words(const uint8_t *row, int64_t bytes, int count) {
#define WORD(j) ((j) < count ? word_bits(row + (j) * bytes) : 0)
    return _mm256_setr_epi32(WORD(0), WORD(1), WORD(2), WORD(3), WORD(4), WORD(5), WORD(6), WORD(7));
#undef WORD
}

/* The blocks' d (from `row`, `count` of them) and their m, as simd_code_row makes them: one float
   per block, zero past them (the caller masks m where −0 could arise). */
static inline __m256 small_block_offsets(int64_t type, const uint8_t *row, int count, __m256 d) {
    switch (type) {
    case GGML_Q4_0: return _mm256_mul_ps(_mm256_set1_ps(-8.0f), d);
    case GGML_Q4_1: return small_block_halves(row, 20, count, 2);
    case GGML_Q5_0: return _mm256_mul_ps(_mm256_set1_ps(-16.0f), d);
#if defined(Q8_AVX2)
    default: return _mm256_setzero_ps();
#else
    default: return _mm256_mul_ps(_mm256_set1_ps(-128.0f), d);
#endif
    }
}

#endif

#if defined(Q8_VNNI)

#define DECODE_LANES __m512

/* A Q4_K super-block's d and dmin (its first two halves, one load), d in lanes 0–7 and dmin in
   lanes 8–15, dmin negated where `negate` (the coded path's offset factor −dmin · min). */
static inline __m512 k4_factors(const uint8_t *block, const int negate) {
    const __m512 factors = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm512_castps128_ps512(k4_halves(block)));
    return negate ? _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(factors), 0xFF00, _mm512_castps_si512(factors),
                                                              _mm512_set1_epi32(INT32_MIN)))
                  : factors;
}

/* One span (256 codes from column c) of a row of `type`, unpacked in registers: four natural-order
   pieces of 64 codes (zero past a short row's end), and the groups' d in lane order and m in natural
   order, as coded_tile_step reads them. */
static inline __attribute__((always_inline)) void span_codes(int64_t type, const uint8_t *row, int64_t c, int64_t k,
                                                             __m512i codes[4], __m512 *scale_out, __m512 *offset_out) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 scale, offset;
    if (type == GGML_Q4_K) {
        const uint8_t *block = row + c / 256 * 144;
        /* 16-bit shift counts: 0 for the low 32 bytes (low nibbles), 4 for the high 32 */
        const __m512i nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        for (int p = 0; p < 4; p++) {
            const __m512i packed = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 16 + 32 * p)));
            codes[p] = _mm512_and_si512(_mm512_srlv_epi16(packed, nibble_shift), low4);
        }
        /* 16 floats: sub-block scales in 0–7, offsets in 8–15; lane n's group is LANE_GROUPS[n] */
        const __m512 scales = _mm512_mul_ps(k4_factors(block, 1), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k4_scale_bytes(block))));
        scale = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7), scales);
        offset = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), scales);
    } else if (type == GGML_Q6_K) {
        const uint8_t *block = row + c / 256 * 210;
        /* high-bit shifts per 32 bytes: chunk 0 of a half takes bits 0–1 then 2–3, chunk 1 bits 4–5 then 6–7 */
        const __m512i high_shift[2] = {_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1),
                                       _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)};
        for (int p = 0; p < 4; p++) { /* chunk p: groups 4p..4p+3, from half p / 2 */
            const uint8_t *ql = block + 64 * (p / 2), *qh = block + 128 + 32 * (p / 2);
            const __m512i low_bytes = _mm512_loadu_si512(ql);
            const __m512i low = _mm512_and_si512(p % 2 ? _mm512_srli_epi16(low_bytes, 4) : low_bytes, low4);
            const __m512i high = _mm512_and_si512(
                _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh)), high_shift[p % 2]), _mm512_set1_epi8(3));
            codes[p] = _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
        }
        const __m512 group_scale = _mm512_mul_ps(_mm512_set1_ps(half_at(block + 208)),
                                                 _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 192)))));
        scale = _mm512_permutexvar_ps(LANE_GROUPS, group_scale);
        offset = _mm512_mul_ps(_mm512_set1_ps(-32.0f), group_scale);
    } else { /* blocks of 32: 8 to a span, the last span short when k is not a multiple of 256 */
        const int64_t bytes = small_block_bytes(type);
        const uint8_t *block = row + c / 32 * bytes;
        const int count = k - c >= 256 ? 8 : (int)((k - c) / 32);
        for (int p = 0; p < 4; p++) {
            if (2 * p >= count) {
                codes[p] = _mm512_setzero_si512();
                continue;
            }
            const uint8_t *first = block + 2 * p * bytes, *second = first + bytes;
            const int both = 2 * p + 1 < count;
            __m512i piece;
            if (type == GGML_Q8_0) {
                const __m256i high = both ? _mm256_loadu_si256((const __m256i *)(second + 2)) : _mm256_set1_epi8((char)0x80);
                piece = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(first + 2))), high, 1),
                                         _mm512_set1_epi8((char)0x80));
            } else { /* the two blocks' 16 nibble bytes, each twice: [first, first, second, second] */
                const int nibbles = nibble_offset(type);
                const __m512i doubled = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(first + nibbles))),
                                                                    both ? (__mmask16)0xFF00 : 0,
                                                                    _mm_loadu_si128((const __m128i *)(both ? second + nibbles : first + nibbles)));
                const __m512i nibble_shift = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0, 0x0004000400040004, 0x0004000400040004);
                piece = _mm512_and_si512(_mm512_srlv_epi16(doubled, nibble_shift), low4);
                if (type == GGML_Q5_0) { /* the fifth bits: bit j of a block's qh is its code j's */
                    uint32_t high_first, high_second = 0;
                    memcpy(&high_first, first + 2, 4);
                    if (both) memcpy(&high_second, second + 2, 4);
                    piece = _mm512_or_si512(piece, _mm512_maskz_mov_epi8(((__mmask64)high_second << 32) | high_first, _mm512_set1_epi8(0x10)));
                }
                if (!both) piece = _mm512_maskz_mov_epi8(0x00000000FFFFFFFFull, piece);
            }
            codes[p] = piece;
        }
        /* each block's first 32-bit word: d in its low half (Q4_1: m in its high half), by scalar
           loads (a vpgatherdd took more time than all the span's other unpacking) */
        const __m256i words = small_block_words(block, bytes, count);
        const __m256 d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words));
        const __m256 m = type == GGML_Q4_1 ? _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(words, 16)))
                                           : small_block_offsets(type, block, count, d);
        /* the block of lane n's group (LANE_GROUPS[n] / 2), and of each group in natural order */
        scale = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7), _mm512_castps256_ps512(d));
        offset = _mm512_maskz_permutexvar_ps((__mmask16)((1u << (2 * count)) - 1),
                                             _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castps256_ps512(m));
    }
    *scale_out = scale;
    *offset_out = offset;
}

/* One span of a row dotted with the activation row, added to `lanes`: four natural-order dot
   products of 64 codes, their group sums in lane order (group_sums), then the coded path's two
   multiply-adds. */
static inline __attribute__((always_inline)) __m512 decode_span(int64_t type, const uint8_t *row, int64_t c, int64_t k, const CodedActivations *x, __m512 lanes) {
    __m512i codes[4], sums[4];
    __m512 scale, offset;
    span_codes(type, row, c, k, codes, &scale, &offset);
    for (int p = 0; p < 4; p++) sums[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[p], _mm512_loadu_si512(x->q + c + 64 * p));
    const int64_t g = c / GROUP;
    lanes = _mm512_fmadd_ps(_mm512_cvtepi32_ps(group_sums(sums)), _mm512_mul_ps(scale, _mm512_loadu_ps(x->scale + g)), lanes);
    return _mm512_fmadd_ps(offset, _mm512_loadu_ps(x->group_sum + g), lanes);
}

/* One span of a row dotted with `count` activation rows, each added to its `lanes`: the codes
   unpacked once and put in lane layout in registers, then per activation row coded_tile_step's
   operations (dot products with its lane-layout codes, the two multiply-adds). */
static inline __attribute__((always_inline)) void decode_span_rows(int64_t type, const uint8_t *row, int64_t c, int64_t k,
                                                                   const CodedActivations *x, int64_t stride, int count, __m512 *lanes) {
    __m512i codes[4];
    __m512 scale, offset;
    span_codes(type, row, c, k, codes, &scale, &offset);
    transpose_words(codes);
    const int64_t g = c / GROUP;
    for (int j = 0; j < count; j++) {
        __m512i sum = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) sum = _mm512_dpbusd_epi32(sum, codes[p], _mm512_loadu_si512(row_at(x->lanes, j, stride) + c + 64 * p));
        lanes[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_loadu_ps(row_at(x->scale, j, stride) + g)), lanes[j]);
        lanes[j] = _mm512_fmadd_ps(offset, _mm512_loadu_ps(row_at(x->group_sum, j, stride) + g), lanes[j]);
    }
}

static inline float decode_total(__m512 lanes) { return _mm512_reduce_add_ps(lanes); }

/* Q4_K, one activation row: a super-block's 256 codes from two 64-byte loads (low and high nibbles
   of its four 32-byte chunks: vector p holds the groups K4_GROUPS[4b + p] in its 128-bit blocks b),
   dotted with the activations in that order (k4_order_span); the four vectors' four-code sums
   reduced to one sum per group by packing to 16 bits and adding pairs twice (exact: a four-code sum
   is at most 4 · 15 · 127 = 7,620, a pair of them 15,240), which leaves group K4_GROUPS[n] in lane n.
   The lanes then take the coded path's two multiply-adds with the same floats (the scales and
   offset factors permuted alike; the offset term subtracted with its factor's magnitude, which
   rounds as adding it with the negated factor), so each lane's chain of float operations is one of
   the coded path's lanes; decode_total_k4 puts the lanes back in its order before the sum. The codes and
   their group sums take 18 vector operations per super-block here, 27 by span_codes and group_sums. */
static inline __attribute__((always_inline)) __m512 decode_span_k4(const uint8_t *block, const CodedActivations *x, int64_t span, __m512 lanes) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi16(1);
    const __m512i first = _mm512_loadu_si512(block + 16), second = _mm512_loadu_si512(block + 80);
    const int8_t *xq = x->k4 + SPAN * span;
    const __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(first, low4), _mm512_loadu_si512(xq));
    const __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(first, 4), low4), _mm512_loadu_si512(xq + 64));
    const __m512i s2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(second, low4), _mm512_loadu_si512(xq + 128));
    const __m512i s3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(second, 4), low4), _mm512_loadu_si512(xq + 192));
    const __m512i pairs01 = _mm512_madd_epi16(_mm512_packs_epi32(s0, s1), ones), pairs23 = _mm512_madd_epi16(_mm512_packs_epi32(s2, s3), ones);
    const __m512i sums = _mm512_madd_epi16(_mm512_packs_epi32(pairs01, pairs23), ones);
    /* 16 floats: sub-block scales in 0–7, the offsets' magnitudes (dmin · min) in 8–15; lane n's
       sub-block is K4_GROUPS[n] / 2, its offset factor's lane_group(K4_GROUPS[n]) / 2. The offset
       term is subtracted (fnmadd) rather than its factor negated: the same float, one operation
       fewer. */
    const __m512 scales = _mm512_mul_ps(k4_factors(block, 0), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k4_scale_bytes(block))));
    const __m512 scale = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 4, 5, 0, 1, 4, 5, 2, 3, 6, 7, 2, 3, 6, 7), scales);
    const __m512 offset = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 12, 9, 13, 10, 14, 11, 15, 8, 12, 9, 13, 10, 14, 11, 15), scales);
    const int64_t g = span * SPAN_GROUPS;
    lanes = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, _mm512_loadu_ps(x->k4_scale + g)), lanes);
    return _mm512_fnmadd_ps(offset, _mm512_loadu_ps(x->k4_group_sum + g), lanes);
}

/* decode_span_k4's lanes in the coded path's order, summed: the coded path's lane n (group
   LANE_GROUPS[n]) is the lane here whose K4_GROUPS entry is that group. */
static inline float decode_total_k4(__m512 lanes) {
    return decode_total(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 2, 10, 4, 12, 6, 14, 1, 9, 3, 11, 5, 13, 7, 15), lanes));
}

#elif defined(Q8_AVX2)

#define DECODE_LANES __m256

/* One block's 32 codes exactly as simd_code_row makes them (AVX2). */
static inline __m256i small_block_codes(int64_t type, const uint8_t *block) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + nibble_offset(type)));
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
    }
    case GGML_Q5_0: {
        uint32_t qh;
        memcpy(&qh, block + 2, 4);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + nibble_offset(type)));
        return _mm256_set_m128i(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), fifth_bits(qh, 16)),
                                _mm_or_si128(_mm_and_si128(bytes, low4), fifth_bits(qh, 0)));
    }
    default: { /* Q8_0 */
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 2));
        return bytes; /* signed, as simd_code_row keeps them on AVX2 */
    }
    }
}

/* One span (128 codes from column c) unpacked as on VNNI, in four natural-order pieces of 32 codes
   (Q8_0's signed, as simd_code_row keeps them on AVX2). */
static inline __attribute__((always_inline)) void span_codes(int64_t type, const uint8_t *row, int64_t c, int64_t k,
                                                             __m256i codes[4], __m256 *scale_out, __m256 *offset_out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 scale, offset;
    if (type == GGML_Q4_K) { /* span h = (c / 128) % 2 of the super-block: sub-blocks 4h..4h+3 */
        const uint8_t *block = row + c / 256 * 144;
        const int h = (int)(c / 128 % 2);
        for (int p = 0; p < 2; p++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 16 + 64 * h + 32 * p));
            codes[2 * p] = _mm256_and_si256(bytes, low4);
            codes[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        }
        __m256 scales, mins;
        k4_sub_block_factors(block, 1, &scales, &mins);
        /* lane n's sub-block 4h + n % 4; group j's 4h + j / 2 */
        scale = _mm256_permutevar8x32_ps(scales, _mm256_add_epi32(_mm256_set1_epi32(4 * h), _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3)));
        offset = _mm256_permutevar8x32_ps(mins, _mm256_add_epi32(_mm256_set1_epi32(4 * h), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
    } else if (type == GGML_Q6_K) { /* one half of the super-block */
        const uint8_t *block = row + c / 256 * 210;
        const int half = (int)(c / 128 % 2);
        const uint8_t *ql = block + 64 * half, *qh = block + 128 + 32 * half;
        const __m256i low_a = _mm256_loadu_si256((const __m256i *)ql), low_b = _mm256_loadu_si256((const __m256i *)(ql + 32));
        const __m256i high = _mm256_loadu_si256((const __m256i *)qh);
        /* as simd_code_row: code q's fifth and sixth bits, bits 2q and 2q + 1 of qh, moved to bits 4
           and 5 by one 16-bit shift each (what crosses a byte lands outside the mask): fewer
           operations than a shift-and-mask per step (measurements: docs/performance.md). */
        const __m256i top_bits = _mm256_set1_epi8(0x30);
        codes[0] = _mm256_or_si256(_mm256_and_si256(low_a, low4), _mm256_and_si256(_mm256_slli_epi16(high, 4), top_bits));
        codes[1] = _mm256_or_si256(_mm256_and_si256(low_b, low4), _mm256_and_si256(_mm256_slli_epi16(high, 2), top_bits));
        codes[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low_a, 4), low4), _mm256_and_si256(high, top_bits));
        codes[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low_b, 4), low4), _mm256_and_si256(_mm256_srli_epi16(high, 2), top_bits));
        const __m256 group_scale = _mm256_mul_ps(
            _mm256_set1_ps(half_at(block + 208)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 192 + 8 * half)))));
        scale = _mm256_permutevar8x32_ps(group_scale, LANE_GROUPS);
        offset = _mm256_mul_ps(_mm256_set1_ps(-32.0f), group_scale);
    } else { /* blocks of 32: 4 to a span, the last span short when k is not a multiple of 128 */
        const int64_t bytes = small_block_bytes(type);
        const uint8_t *block = row + c / 32 * bytes;
        const int count = k - c >= 128 ? 4 : (int)((k - c) / 32);
        for (int t = 0; t < 4; t++) {
            codes[t] = t < count ? small_block_codes(type, block + t * bytes) : _mm256_setzero_si256();
        }
        const __m256 d = small_block_halves(block, bytes, count, 0), m = small_block_offsets(type, block, count, d);
        const __m256 present = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(2 * count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        /* the block of lane n's group (LANE_GROUPS[n] / 2), and of each group in natural order */
        scale = _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3));
        offset = _mm256_and_ps(_mm256_permutevar8x32_ps(m, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)), present);
    }
    *scale_out = scale;
    *offset_out = offset;
}

/* Four codes' sums per 32-bit lane of 32 codes times 32 activations (vpmaddubsw, vpmaddwd by ones):
   unsigned codes as they are, Q8_0's signed ones by magnitude times the activations with their
   signs (coded_tile_step's operations). */
static inline __m256i piece_dot(int64_t type, __m256i codes, __m256i xq) {
    const __m256i pairs = type == GGML_Q8_0 ? _mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(xq, codes))
                                            : _mm256_maddubs_epi16(codes, xq);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* The span's group sums in lane layout from natural-order codes and activations: the vpmaddubsw
   pairs added horizontally in 16 bits (vphaddw) down to eight codes a value, then by vpmaddwd,
   which leaves the 128-bit block b of piece p in lane 4b + p, as group_sums does with 15 operations
   rather than 8. Exact where the 16-bit sums fit (pair_steps: eight codes of 4 or 5 bits times 127
   at most 31,496; Q6_K's four at most 32,004, so its last step adds in 32 bits); Q8_0 goes by
   piece_dot and group_sums. */
static inline __attribute__((always_inline)) __m256i row_group_sums(int64_t type, const __m256i codes[4], const int8_t *xq) {
    if (type == GGML_Q8_0) {
        __m256i sums[4];
        for (int p = 0; p < 4; p++) sums[p] = piece_dot(type, codes[p], _mm256_loadu_si256((const __m256i *)(xq + 32 * p)));
        return group_sums(sums);
    }
    __m256i pairs[4];
    for (int p = 0; p < 4; p++) pairs[p] = _mm256_maddubs_epi16(codes[p], _mm256_loadu_si256((const __m256i *)(xq + 32 * p)));
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i fours01 = _mm256_hadd_epi16(pairs[0], pairs[1]), fours23 = _mm256_hadd_epi16(pairs[2], pairs[3]);
    if (pair_steps(type) < 4) return _mm256_hadd_epi32(_mm256_madd_epi16(fours01, ones), _mm256_madd_epi16(fours23, ones));
    return _mm256_madd_epi16(_mm256_hadd_epi16(fours01, fours23), ones);
}

/* One span of a row dotted with the activation row, added to `lanes`, as on VNNI. */
static inline __attribute__((always_inline)) __m256 decode_span(int64_t type, const uint8_t *row, int64_t c, int64_t k, const CodedActivations *x, __m256 lanes) {
    __m256i codes[4];
    __m256 scale, offset;
    span_codes(type, row, c, k, codes, &scale, &offset);
    const __m256i sums = row_group_sums(type, codes, x->q + c);
    const int64_t g = c / GROUP;
    lanes = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, _mm256_loadu_ps(x->scale + g)), lanes);
    return _mm256_fmadd_ps(offset, _mm256_loadu_ps(x->group_sum + g), lanes);
}

/* A Q4_K super-block (two spans from column c) dotted with the activation row, added to `lanes`:
   decode_span's operations for both halves, the scales unpacked once for both (d and dmin from one
   load; the offset term subtracted with dmin · min, as decode_span_k4 does). */
static inline __attribute__((always_inline)) __m256 decode_superblock_k4(const uint8_t *block, const CodedActivations *x, int64_t c, __m256 lanes) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 scales, mins; /* (mins times dmin, not −dmin: subtracted below) */
    k4_sub_block_factors(block, 0, &scales, &mins);
    for (int h = 0; h < 2; h++) { /* sub-blocks 4h..4h+3: lane n's 4h + n % 4; group j's 4h + j / 2 */
        __m256i codes[4];
        for (int p = 0; p < 2; p++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 16 + 64 * h + 32 * p));
            codes[2 * p] = _mm256_and_si256(bytes, low4);
            codes[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        }
        const __m256i sums = row_group_sums(GGML_Q4_K, codes, x->q + c + 128 * h);
        const __m256 scale = _mm256_permutevar8x32_ps(scales, h ? _mm256_setr_epi32(4, 5, 6, 7, 4, 5, 6, 7) : _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3));
        const __m256 offset = _mm256_permutevar8x32_ps(mins, h ? _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7) : _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
        const int64_t g = (c + 128 * h) / GROUP;
        lanes = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, _mm256_loadu_ps(x->scale + g)), lanes);
        lanes = _mm256_fnmadd_ps(offset, _mm256_loadu_ps(x->group_sum + g), lanes);
    }
    return lanes;
}

/* One span of a row dotted with `count` activation rows, as on VNNI. */
static inline __attribute__((always_inline)) void decode_span_rows(int64_t type, const uint8_t *row, int64_t c, int64_t k,
                                                                   const CodedActivations *x, int64_t stride, int count, __m256 *lanes) {
    __m256i codes[4];
    __m256 scale, offset;
    span_codes(type, row, c, k, codes, &scale, &offset);
    transpose_words(codes);
    const int64_t g = c / GROUP;
    for (int j = 0; j < count; j++) {
        __m256i xq[4];
        for (int p = 0; p < 4; p++) xq[p] = _mm256_loadu_si256((const __m256i *)(row_at(x->lanes, j, stride) + c + 32 * p));
        const __m256i sum = span_sum(pair_steps(type), codes, xq);
        lanes[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_loadu_ps(row_at(x->scale, j, stride) + g)), lanes[j]);
        lanes[j] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(row_at(x->group_sum, j, stride) + g), lanes[j]);
    }
}

static inline float decode_total(__m256 lanes) {
    float values[8];
    _mm256_storeu_ps(values, lanes);
    return lanes_total(values);
}

#endif

#if defined(Q8_VNNI) || defined(Q8_AVX2)

static int has_decode_kernel(int64_t type) { return type == GGML_Q4_K || type == GGML_Q6_K || small_block_bytes(type) > 0; }

/* Bytes read ahead of the Q4_K super-block being dotted by one activation row (32 super-blocks: the
   next rows of the tile and the next tiles, which follow in the file). Read ahead because
   decode_span_k4 (VNNI) and decode_superblock_k4 (AVX2) need so few operations per super-block
   that the hardware prefetcher alone leaves them waiting on the weights. On VNNI Q6_K rows stream
   at the memory's speed without it; on AVX2 they take Q6_AHEAD (measurements: docs/performance.md). */
#define K4_AHEAD 4608

/* Bytes read ahead of the Q6_K super-block being dotted by one activation row on AVX2 (11 super-
   blocks): without it the output matrix of Qwen2.5-Coder 1.5B (rows of 1,536 columns, six super-
   blocks) streamed at ~24 GB/s of the ~31 that the VNNI kernel reaches without it (measurements:
   docs/performance.md). */
#define Q6_AHEAD 2304

/* One row, span after span. */
static inline __attribute__((always_inline)) float decode_row(int64_t type, const uint8_t *row, int64_t k, const CodedActivations *x) {
    DECODE_LANES lanes = (DECODE_LANES){0};
#if defined(Q8_VNNI)
    if (type == GGML_Q4_K) {
        for (int64_t span = 0; span < k / SPAN; span++) {
            read_ahead(row + 144 * span + K4_AHEAD, 144);
            lanes = decode_span_k4(row + 144 * span, x, span, lanes);
        }
        return decode_total_k4(lanes);
    }
#endif
#if defined(Q8_AVX2)
    if (type == GGML_Q4_K) {
        for (int64_t c = 0; c < k; c += 256) {
            read_ahead(row + c / 256 * 144 + K4_AHEAD, 144);
            lanes = decode_superblock_k4(row + c / 256 * 144, x, c, lanes);
        }
        return decode_total(lanes);
    }
    if (type == GGML_Q6_K) { /* a super-block in two spans */
        for (int64_t c = 0; c < k; c += SPAN) {
            if (c % 256 == 0) read_ahead(row + c / 256 * 210 + Q6_AHEAD, 210);
            lanes = decode_span(GGML_Q6_K, row, c, k, x, lanes);
        }
        return decode_total(lanes);
    }
#endif
    for (int64_t c = 0; c < k; c += SPAN) lanes = decode_span(type, row, c, k, x, lanes);
    return decode_total(lanes);
}

/* The tile's four rows, all of `type`. On VNNI the blocks of 32 go span by span side by side: four
   independent chains of float operations, where one short row alone would wait on each
   multiply-add; K-quant rows are long enough to hide that and go faster one by one, as every row
   does on AVX2 (16 registers: four rows side by side spill). Inlined per format (a constant `type`),
   so that each format's loop is its own code; the operations per row are decode_row's. */
static inline __attribute__((always_inline)) void decode_rows(int64_t type, const uint8_t *const *rows, int64_t k,
                                                              const CodedActivations *x, float *totals) {
    if (type == GGML_Q4_K || type == GGML_Q6_K || SPAN != 256) {
        for (int r = 0; r < TILE_ROWS; r++) totals[r] = decode_row(type, rows[r], k, x);
        return;
    }
    DECODE_LANES lanes0 = (DECODE_LANES){0}, lanes1 = lanes0, lanes2 = lanes0, lanes3 = lanes0; /* (TILE_ROWS) */
    for (int64_t c = 0; c < k; c += SPAN) {
        lanes0 = decode_span(type, rows[0], c, k, x, lanes0);
        lanes1 = decode_span(type, rows[1], c, k, x, lanes1);
        lanes2 = decode_span(type, rows[2], c, k, x, lanes2);
        lanes3 = decode_span(type, rows[3], c, k, x, lanes3);
    }
    totals[0] = decode_total(lanes0);
    totals[1] = decode_total(lanes1);
    totals[2] = decode_total(lanes2);
    totals[3] = decode_total(lanes3);
}

/* out[r] = x · w[r] for the tile's rows, each of a format with a decode kernel (a short tile's
   repeated rows are computed and dropped). A tile across two formats goes row by row. */
static void decode_tile(const int64_t *types, const uint8_t *const *rows, int64_t count, int64_t k, const CodedActivations *x,
                        float *out) {
    float totals[TILE_ROWS];
    if (types[1] == types[0] && types[2] == types[0] && types[3] == types[0]) {
        switch (types[0]) {
        case GGML_Q4_K: decode_rows(GGML_Q4_K, rows, k, x, totals); break;
        case GGML_Q6_K: decode_rows(GGML_Q6_K, rows, k, x, totals); break;
        case GGML_Q4_0: decode_rows(GGML_Q4_0, rows, k, x, totals); break;
        case GGML_Q4_1: decode_rows(GGML_Q4_1, rows, k, x, totals); break;
        case GGML_Q5_0: decode_rows(GGML_Q5_0, rows, k, x, totals); break;
        default: decode_rows(GGML_Q8_0, rows, k, x, totals); break;
        }
    } else {
        for (int r = 0; r < TILE_ROWS; r++) totals[r] = decode_row(types[r], rows[r], k, x);
    }
    for (int64_t r = 0; r < count; r++) out[r] = totals[r];
}

/* lanes[j] += x_j · w over columns [c0, c1) (whole spans, or to k) for `count` (<= DECODE_ROWS)
   activation rows (`stride` bytes apart from x) and one weight row of `type`, reading ahead span by
   span the piece of weights that starts at `ahead` (decode_tile_rows's choice), the bytes of 256
   codes at a time: on AVX2 a span is 128 codes, half a K-quant super-block, which has no bytes of
   its own (block_row_bytes counts whole super-blocks: read ahead by spans, K-quant rows were not
   read ahead at all there; measurements, docs/performance.md); inlined per format, as decode_rows,
   and per constant count, so that the rows' running lanes stay in registers (with a count known
   only at run time GCC kept them in memory: a store and a reload per row and span). */
static inline __attribute__((always_inline)) void decode_row_rows(int64_t type, const uint8_t *row, const uint8_t *ahead, int64_t c0, int64_t c1,
                                                                  int64_t k, const CodedActivations *x, int64_t stride, int count,
                                                                  DECODE_LANES *lanes) {
    const int64_t block_bytes = block_row_bytes(type, 256); /* (c0 a multiple of 256) */
    DECODE_LANES held[DECODE_ROWS];
    for (int j = 0; j < count; j++) held[j] = c0 == 0 ? (DECODE_LANES){0} : lanes[j]; /* (the row's first columns: from zero) */
    for (int64_t c = c0; c < c1; c += SPAN) {
        read_ahead(ahead + block_row_bytes(type, (c - c0) / 256 * 256), block_bytes);
        decode_span_rows(type, row, c, k, x, stride, count, held);
    }
    for (int j = 0; j < count; j++) lanes[j] = held[j];
}

/* decode_row_rows for a row of any of the formats with decode kernels, `count` a constant. */
static inline __attribute__((always_inline)) void decode_row_rows_of(int64_t type, const uint8_t *row, const uint8_t *ahead, int64_t c0, int64_t c1,
                                                                     int64_t k, const CodedActivations *x, int64_t stride, int count,
                                                                     DECODE_LANES *lanes) {
    switch (type) {
    case GGML_Q4_K: decode_row_rows(GGML_Q4_K, row, ahead, c0, c1, k, x, stride, count, lanes); break;
    case GGML_Q6_K: decode_row_rows(GGML_Q6_K, row, ahead, c0, c1, k, x, stride, count, lanes); break;
    case GGML_Q4_0: decode_row_rows(GGML_Q4_0, row, ahead, c0, c1, k, x, stride, count, lanes); break;
    case GGML_Q4_1: decode_row_rows(GGML_Q4_1, row, ahead, c0, c1, k, x, stride, count, lanes); break;
    case GGML_Q5_0: decode_row_rows(GGML_Q5_0, row, ahead, c0, c1, k, x, stride, count, lanes); break;
    default: decode_row_rows(GGML_Q8_0, row, ahead, c0, c1, k, x, stride, count, lanes); break;
    }
}

/* y[j · ldy + r] = x_j · w[r] for the tile's `count` rows and `rows` (<= DECODE_ROWS) activation
   rows, `stride` bytes apart from x (a batch of decode tokens, a verify pass): each weight span
   unpacked once for all the activation rows, every (activation row, weight row) pair through
   coded_tile_step's operations, so each row's result is what it would be alone.

   Rows longer than WHOLE_DECODE_ROW columns go DECODE_CHUNK columns at a time for the tile's rows
   together, so that the activation rows' piece stays in L1 while the four weight rows take it
   (eight whole activation rows would not: at 8,960 columns they are 70 KB); shorter rows go whole.
   Each piece of a weight row (its columns of one chunk) is dotted while the piece PIECES_AHEAD
   later in that order is read ahead, past the tile's end into the rows that follow it (the next
   tile of this thread's share, where the rows lie one after another as in a matrix of the file; a
   read-ahead elsewhere costs only bandwidth). Eight activation rows take a span long enough for a
   read-ahead of a span or two within the row to arrive late, and a tile's pieces are too short
   for the hardware prefetcher to follow (measurements: docs/performance.md). None of this changes
   an operation of any output. */
#define DECODE_CHUNK 1024
#define WHOLE_DECODE_ROW 2048
#define PIECES_AHEAD 4
static void decode_tile_rows(const int64_t *types, const uint8_t *const *rows, int64_t count, int64_t k,
                             const CodedActivations *x, int64_t stride, int64_t activation_rows, float *y, int64_t ldy) {
    DECODE_LANES lanes[TILE_ROWS][DECODE_ROWS]; /* (set by the first chunk: zeroing them in memory cost 2 KB of stores a tile) */
    const int n = (int)activation_rows;
    const int64_t chunk = k <= WHOLE_DECODE_ROW ? k : DECODE_CHUNK, pieces = (k + chunk - 1) / chunk * count;
    const int64_t row_bytes = block_row_bytes(types[count - 1], k);
    for (int64_t c0 = 0; c0 < k; c0 += chunk) {
        const int64_t c1 = c0 + chunk < k ? c0 + chunk : k;
        for (int64_t r = 0; r < count; r++) {
            const int64_t later = c0 / chunk * count + r + PIECES_AHEAD; /* (chunk later / count, row later % count) */
            const uint8_t *ahead = later < pieces ? rows[later % count] + block_row_bytes(types[later % count], later / count * chunk)
                                                  : rows[count - 1] + row_bytes * (1 + later - pieces); /* the next tile's rows */
            switch (n) { /* a constant count per case */
            case 1: decode_row_rows_of(types[r], rows[r], ahead, c0, c1, k, x, stride, 1, lanes[r]); break;
            case 2: decode_row_rows_of(types[r], rows[r], ahead, c0, c1, k, x, stride, 2, lanes[r]); break;
            case 3: decode_row_rows_of(types[r], rows[r], ahead, c0, c1, k, x, stride, 3, lanes[r]); break;
            case 4: decode_row_rows_of(types[r], rows[r], ahead, c0, c1, k, x, stride, 4, lanes[r]); break;
            case 5: decode_row_rows_of(types[r], rows[r], ahead, c0, c1, k, x, stride, 5, lanes[r]); break;
            case 6: decode_row_rows_of(types[r], rows[r], ahead, c0, c1, k, x, stride, 6, lanes[r]); break;
            case 7: decode_row_rows_of(types[r], rows[r], ahead, c0, c1, k, x, stride, 7, lanes[r]); break;
            default: decode_row_rows_of(types[r], rows[r], ahead, c0, c1, k, x, stride, 8, lanes[r]); break;
            }
        }
    }
    for (int64_t r = 0; r < count; r++)
        for (int j = 0; j < n; j++) y[j * ldy + r] = decode_total(lanes[r][j]);
}

#else

static int has_decode_kernel(int64_t type) {
    (void)type;
    return 0;
}

static void decode_tile_rows(const int64_t *types, const uint8_t *const *rows, int64_t count, int64_t k,
                             const CodedActivations *x, int64_t stride, int64_t activation_rows, float *y, int64_t ldy) {
    (void)types, (void)rows, (void)count, (void)k, (void)x, (void)stride, (void)activation_rows, (void)y, (void)ldy;
}

static void decode_tile(const int64_t *types, const uint8_t *const *rows, int64_t count, int64_t k, const CodedActivations *x,
                        float *out) {
    (void)types, (void)rows, (void)count, (void)k, (void)x, (void)out;
}

#endif
