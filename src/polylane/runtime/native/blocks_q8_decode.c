/* One activation row times the file's rows, straight from the blocks (included by blocks_q8.c).

What this file owns: the decode step's product (a single activation row) for the formats that
carry most of a K-quant model's bytes, Q4_K and Q6_K, on AVX-512 VNNI. coded_matmul codes four
weight rows into a buffer and then dots them; with one activation row each code is used once, so
storing and reloading the codes costs as much as the dot itself. Here each 64 codes are unpacked
in registers and dotted at once.

Bit-identical to the coded path: the codes, each lane's scale (the same floats, moved by a
permute instead of a store), the integer dot products and every float operation, in the same
order, are those of code_row → coded_tile_step → lanes_total + offset_term. So a decode step gives
the logits a verify pass or a prompt would give for that row (batch independence), and the
tests of the coded path hold for this one.
*/

#if defined(Q8_VNNI)

/* x·w for one weight row of `type` (k columns) and one coded activation row; 0 when the format has
   no kernel here (the caller takes the coded path). */
static int decode_row_dot(int64_t type, const uint8_t *restrict row, int64_t k, const CodedActivations *x, float *out) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(3);
    __m512 lanes = _mm512_setzero_ps(), offsets = _mm512_setzero_ps();
    switch (type) {
    case GGML_Q4_K: {
        /* 16-bit shift counts: 0 for the low 32 bytes (low nibbles), 4 for the high 32 */
        const __m512i nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        /* the block's 16 scale floats: lanes 0–7 sub-block scales, 8–15 sub-block offsets */
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
                const int64_t i = 256 * b + 64 * p;
                const __m512i packed = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 16 + 32 * p)));
                const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(packed, nibble_shift), low4);
                /* lanes 0–7 are sub-block 2p's, 8–15 sub-block 2p + 1's */
                const __m512i sub_block = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
                const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(sub_block, scales), _mm512_loadu_ps(x->lane_scale + i / 4));
                const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(x->q + i));
                lanes = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, lanes);
            }
            offsets = _mm512_fmadd_ps(_mm512_permutexvar_ps(group_offset, scales), _mm512_loadu_ps(x->group_sum + 16 * b), offsets);
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
                const int64_t i = 256 * b + 64 * c;
                const uint8_t *ql = row + 64 * (c / 2), *qh = row + 128 + 32 * (c / 2);
                const __m512i low_bytes = _mm512_loadu_si512(ql);
                const __m512i low = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(low_bytes, 4) : low_bytes, low4);
                const __m512i high = _mm512_and_si512(
                    _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh)), high_shift[c % 2]), low2);
                const __m512i codes = _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
                const __m512i group = _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                                                        4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3);
                const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(group, group_scale), _mm512_loadu_ps(x->lane_scale + i / 4));
                const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(x->q + i));
                lanes = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, lanes);
            }
            offsets = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(-32.0f), group_scale), _mm512_loadu_ps(x->group_sum + 16 * b), offsets);
        }
        break;
    }
    default:
        return 0;
    }
    *out = _mm512_reduce_add_ps(lanes) + _mm512_reduce_add_ps(offsets);
    return 1;
}

static int has_decode_kernel(int64_t type) { return type == GGML_Q4_K || type == GGML_Q6_K; }

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
