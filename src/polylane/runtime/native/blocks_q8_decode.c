/* One activation row times the file's rows, straight from the blocks (included by blocks_q8.c).

What this file owns: the decode step's product (a single activation row) for Q4_0, Q4_1, Q5_0,
Q8_0, Q4_K and Q6_K (every format of the catalogue's files), on AVX-512 VNNI and on AVX2. coded_matmul codes four
weight rows into a buffer and then dots them; with one activation row each code is used once, so
storing and reloading the codes costs as much as the dot itself. Here each 64 codes are unpacked
in registers and dotted at once.

Bit-identical to the coded path: the codes, the integer group sums (formed from natural-order dot
products instead of lane-layout ones: integer sums, so the same), each lane's scale (the same floats,
moved by a permute instead of a store) and every float operation, in the same order, are those of
code_row → to_lanes → coded_tile_step → lanes_total. So a decode step gives
the logits a verify pass or a prompt would give for that row (batch independence), and the
tests of the coded path hold for this one.
*/

#if defined(Q8_VNNI) || defined(Q8_AVX2)

/* The formats of blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0): bytes per block, and one block's 32 codes
   and its d and m exactly as simd_code_row makes them. */
static int64_t small_block_bytes(int64_t type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q8_0: return 34;
    default: return 0;
    }
}

static inline __m256i small_block_codes(int64_t type, const uint8_t *block) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + (type == GGML_Q4_0 ? 2 : 4)));
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
    }
    case GGML_Q5_0: {
        uint32_t qh;
        memcpy(&qh, block + 2, 4);
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 6));
        return _mm256_set_m128i(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), fifth_bits(qh, 16)),
                                _mm_or_si128(_mm_and_si128(bytes, low4), fifth_bits(qh, 0)));
    }
    default: { /* Q8_0 */
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 2));
#if defined(Q8_AVX2)
        return bytes;
#else
        return _mm256_xor_si256(bytes, _mm256_set1_epi8((char)0x80));
#endif
    }
    }
}

/* d and m of `count` blocks of 32 from `row`, one per group (two per block), zero past them. */
static inline void small_block_scales(int64_t type, const uint8_t *row, int count, float *d, float *m) {
    const int64_t bytes = small_block_bytes(type);
    for (int j = 0; j < count; j++, row += bytes) {
        const float scale = half_at(row);
        float offset;
        switch (type) {
        case GGML_Q4_0: offset = -8.0f * scale; break;
        case GGML_Q4_1: offset = half_at(row + 2); break;
        case GGML_Q5_0: offset = -16.0f * scale; break;
#if defined(Q8_AVX2)
        default: offset = 0.0f; break;
#else
        default: offset = -128.0f * scale; break;
#endif
        }
        d[2 * j] = d[2 * j + 1] = scale;
        m[2 * j] = m[2 * j + 1] = offset;
    }
}

#endif

#if defined(Q8_VNNI)

/* x·w for one weight row of `type` (k columns) and one coded activation row; 0 when the format has
   no kernel here (the caller takes the coded path). Per super-block (one span): four natural-order
   dot products of 64 codes, their group sums in lane order (group_sums), then the coded path's
   multiply-add with the group scales permuted to lane order. */
static int decode_row_dot(int64_t type, const uint8_t *restrict row, int64_t k, const CodedActivations *x, float *out) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(3);
    __m512 lanes = _mm512_setzero_ps();
    __m512i sums[4];
    switch (type) {
    case GGML_Q4_K: {
        /* 16-bit shift counts: 0 for the low 32 bytes (low nibbles), 4 for the high 32 */
        const __m512i nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        /* the block's 16 scale floats hold sub-block scales in 0–7 and offsets in 8–15; lane n's
           group is LANE_GROUPS[n], its sub-block half that */
        const __m512i lane_sub_block = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7);
        const __m512i group_offset = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
        for (int64_t b = 0; b < k / 256; b++, row += 144) {
            uint32_t words[4]; /* as k4_group_scales */
            memcpy(words, row + 4, 12);
            words[3] = ((words[2] >> 4) & 0x0f0f0f0f) | (((words[1] >> 6) & 0x03030303) << 4);
            const uint32_t mins_low = words[1] & 0x3f3f3f3f;
            words[1] = (words[2] & 0x0f0f0f0f) | (((words[0] >> 6) & 0x03030303) << 4);
            words[2] = mins_low;
            words[0] &= 0x3f3f3f3f;
            const __m512 factors = _mm512_insertf32x8(_mm512_set1_ps(half_at(row)), _mm256_set1_ps(-half_at(row + 2)), 1);
            const __m512 scales = _mm512_mul_ps(factors, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)words))));
            for (int p = 0; p < 4; p++) {
                const __m512i packed = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 16 + 32 * p)));
                const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(packed, nibble_shift), low4);
                sums[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(x->q + 256 * b + 64 * p));
            }
            const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(lane_sub_block, scales), _mm512_loadu_ps(x->scale + 16 * b));
            lanes = _mm512_fmadd_ps(_mm512_cvtepi32_ps(group_sums(sums)), scale, lanes);
            lanes = _mm512_fmadd_ps(_mm512_permutexvar_ps(group_offset, scales), _mm512_loadu_ps(x->group_sum + 16 * b), lanes);
        }
        break;
    }
    case GGML_Q6_K: {
        /* high-bit shifts per 32 bytes: chunk 0 of a half takes bits 0–1 then 2–3, chunk 1 bits 4–5 then 6–7 */
        const __m512i high_shift[2] = {_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1),
                                       _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)};
        for (int64_t b = 0; b < k / 256; b++, row += 210) {
            const __m512 group_scale = _mm512_mul_ps(_mm512_set1_ps(half_at(row + 208)),
                                                     _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 192)))));
            for (int c = 0; c < 4; c++) { /* chunk c: groups 4c..4c+3, from half c / 2 */
                const uint8_t *ql = row + 64 * (c / 2), *qh = row + 128 + 32 * (c / 2);
                const __m512i low_bytes = _mm512_loadu_si512(ql);
                const __m512i low = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(low_bytes, 4) : low_bytes, low4);
                const __m512i high = _mm512_and_si512(
                    _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh)), high_shift[c % 2]), low2);
                const __m512i codes = _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
                sums[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(x->q + 256 * b + 64 * c));
            }
            const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(LANE_GROUPS, group_scale), _mm512_loadu_ps(x->scale + 16 * b));
            lanes = _mm512_fmadd_ps(_mm512_cvtepi32_ps(group_sums(sums)), scale, lanes);
            lanes = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(-32.0f), group_scale), _mm512_loadu_ps(x->group_sum + 16 * b), lanes);
        }
        break;
    }
    case GGML_Q4_0:
    case GGML_Q4_1:
    case GGML_Q5_0:
    case GGML_Q8_0: { /* spans of 8 blocks, the last one short when k is not a multiple of 256 */
        const int64_t bytes = small_block_bytes(type);
        for (int64_t c = 0; c < k; c += 256, row += 8 * bytes) {
            const int count = k - c >= 256 ? 8 : (int)((k - c) / 32);
            for (int p = 0; p < 4; p++) {
                if (2 * p >= count) {
                    sums[p] = _mm512_setzero_si512();
                    continue;
                }
                const __m256i second = 2 * p + 1 < count ? small_block_codes(type, row + (2 * p + 1) * bytes) : _mm256_setzero_si256();
                const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(small_block_codes(type, row + 2 * p * bytes)), second, 1);
                sums[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(x->q + c + 64 * p));
            }
            float d[16] = {0}, m[16] = {0};
            small_block_scales(type, row, count, d, m);
            const int64_t g = c / GROUP;
            const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(LANE_GROUPS, _mm512_loadu_ps(d)), _mm512_loadu_ps(x->scale + g));
            lanes = _mm512_fmadd_ps(_mm512_cvtepi32_ps(group_sums(sums)), scale, lanes);
            lanes = _mm512_fmadd_ps(_mm512_loadu_ps(m), _mm512_loadu_ps(x->group_sum + g), lanes);
        }
        break;
    }
    default:
        return 0;
    }
    *out = _mm512_reduce_add_ps(lanes);
    return 1;
}

static int has_decode_kernel(int64_t type) { return type == GGML_Q4_K || type == GGML_Q6_K || small_block_bytes(type) > 0; }

#elif defined(Q8_AVX2)

/* The same on AVX2, as code_row → coded_tile_step (AVX2) → lanes_total computes it: spans of 128
   codes, four natural-order pieces of 32 (vpmaddubsw, vpmaddwd by ones) each. */
static inline __m256i piece_sums(__m256i codes, const CodedActivations *x, int64_t i) {
    const __m256i pairs = _mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i *)(x->q + i)));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

static int decode_row_dot(int64_t type, const uint8_t *restrict row, int64_t k, const CodedActivations *x, float *out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3);
    const __m256i first = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), second = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    __m256 lanes = _mm256_setzero_ps();
    __m256i sums[4];
    switch (type) {
    case GGML_Q4_K:
        for (int64_t b = 0; b < k / 256; b++, row += 144) {
            uint32_t words[4]; /* as k4_group_scales */
            memcpy(words, row + 4, 12);
            words[3] = ((words[2] >> 4) & 0x0f0f0f0f) | (((words[1] >> 6) & 0x03030303) << 4);
            const uint32_t mins_low = words[1] & 0x3f3f3f3f;
            words[1] = (words[2] & 0x0f0f0f0f) | (((words[0] >> 6) & 0x03030303) << 4);
            words[2] = mins_low;
            words[0] &= 0x3f3f3f3f;
            const __m128i packed = _mm_loadu_si128((const __m128i *)words);
            const __m256 scales = _mm256_mul_ps(_mm256_set1_ps(half_at(row)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed)));
            const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(-half_at(row + 2)),
                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))));
            for (int h = 0; h < 2; h++) { /* span h: sub-blocks 4h..4h+3; lane n's sub-block 4h + n % 4 */
                for (int p = 0; p < 2; p++) {
                    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + 16 + 64 * h + 32 * p));
                    sums[2 * p] = piece_sums(_mm256_and_si256(bytes, low4), x, 256 * b + 128 * h + 64 * p);
                    sums[2 * p + 1] = piece_sums(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4), x, 256 * b + 128 * h + 64 * p + 32);
                }
                const __m256i sub_block = _mm256_setr_epi32(4 * h, 4 * h + 1, 4 * h + 2, 4 * h + 3, 4 * h, 4 * h + 1, 4 * h + 2, 4 * h + 3);
                const __m256 scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(scales, sub_block), _mm256_loadu_ps(x->scale + 16 * b + 8 * h));
                lanes = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_sums(sums)), scale, lanes);
                lanes = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(mins, h ? second : first), _mm256_loadu_ps(x->group_sum + 16 * b + 8 * h), lanes);
            }
        }
        break;
    case GGML_Q6_K:
        for (int64_t b = 0; b < k / 256; b++, row += 210) {
            const float scale = half_at(row + 208);
            for (int half = 0; half < 2; half++) { /* one span */
                const uint8_t *ql = row + 64 * half, *qh = row + 128 + 32 * half;
                const __m256 group_scale = _mm256_mul_ps(
                    _mm256_set1_ps(scale), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + 192 + 8 * half)))));
                const __m256i low_a = _mm256_loadu_si256((const __m256i *)ql), low_b = _mm256_loadu_si256((const __m256i *)(ql + 32));
                const __m256i high = _mm256_loadu_si256((const __m256i *)qh);
                for (int q = 0; q < 4; q++) { /* as simd_code_row */
                    const __m256i low = q & 1 ? low_b : low_a;
                    const __m256i nibble = _mm256_and_si256(q < 2 ? low : _mm256_srli_epi16(low, 4), low4);
                    const __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * q)), low2), 4);
                    sums[q] = piece_sums(_mm256_or_si256(nibble, top), x, 256 * b + 128 * half + 32 * q);
                }
                const __m256 lane_scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(group_scale, LANE_GROUPS),
                                                        _mm256_loadu_ps(x->scale + 16 * b + 8 * half));
                lanes = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_sums(sums)), lane_scale, lanes);
                lanes = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(-32.0f), group_scale),
                                        _mm256_loadu_ps(x->group_sum + 16 * b + 8 * half), lanes);
            }
        }
        break;
    case GGML_Q4_0:
    case GGML_Q4_1:
    case GGML_Q5_0:
    case GGML_Q8_0: { /* spans of 4 blocks, the last one short when k is not a multiple of 128 */
        const int64_t bytes = small_block_bytes(type);
        for (int64_t c = 0; c < k; c += 128, row += 4 * bytes) {
            const int count = k - c >= 128 ? 4 : (int)((k - c) / 32);
            for (int t = 0; t < 4; t++) {
                if (t >= count) {
                    sums[t] = _mm256_setzero_si256();
                    continue;
                }
                const __m256i w = small_block_codes(type, row + t * bytes);
                if (type == GGML_Q8_0) { /* signed, as coded_tile_step takes Q8_0 rows */
                    const __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + c + 32 * t));
                    sums[t] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xq, w)), _mm256_set1_epi16(1));
                } else {
                    sums[t] = piece_sums(w, x, c + 32 * t);
                }
            }
            float d[8] = {0}, m[8] = {0};
            small_block_scales(type, row, count, d, m);
            const int64_t g = c / GROUP;
            const __m256 scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(d), LANE_GROUPS), _mm256_loadu_ps(x->scale + g));
            lanes = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_sums(sums)), scale, lanes);
            lanes = _mm256_fmadd_ps(_mm256_loadu_ps(m), _mm256_loadu_ps(x->group_sum + g), lanes);
        }
        break;
    }
    default:
        return 0;
    }
    float lane_values[8];
    _mm256_storeu_ps(lane_values, lanes);
    *out = lanes_total(lane_values);
    return 1;
}

static int has_decode_kernel(int64_t type) { return type == GGML_Q4_K || type == GGML_Q6_K || small_block_bytes(type) > 0; }

#else

static int decode_row_dot(int64_t type, const uint8_t *restrict row, int64_t k, const CodedActivations *x, float *out) {
    (void)type, (void)row, (void)k, (void)x, (void)out;
    return 0;
}

static int has_decode_kernel(int64_t type) {
    (void)type;
    return 0;
}

#endif
