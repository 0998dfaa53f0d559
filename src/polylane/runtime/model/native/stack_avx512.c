/* The layer stack's arithmetic outside the matrix products, with AVX-512 (#included by decoder.c
 * where the CPU has AVX512-BF16 and VBMI; stack_portable.c is the same in plain C).
 *
 * What this file owns: e^x over 16 lanes, bf16 loads and stores of the KV cache, the per-token
 * grouped-query attention over the paged cache, and the MLP's gated activation. Each token's
 * arithmetic is its own (no sum crosses tokens), so a verify pass equals the decode steps.
 */

/* e^x, 16 lanes: 2^n · p(r) with x = n ln 2 + r, |r| <= ln 2 / 2, and Cephes' degree-7
 * polynomial for e^r (relative error ~2e-7 on float32); lanes below -87 give ~0, never NaN. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* 16 bf16 values as float32 (exact). */
static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* `size` floats (a multiple of 16) rounded to bf16, to nearest even, as torch rounds them. */
static inline void store_bf16(const float *x, int64_t size, uint16_t *out) {
    for (int64_t i = 0; i < size; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

/* Lane c of the result = the sum of the 16 lanes of v[c] (a 16 x 16 transpose-and-add). */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: v[2i] at positions 0, 2; v[2i + 1] at 1, 3 */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: keys 4i .. 4i + 3 in order */
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 16 keys or values of a cache row from `offset`, as float32 (the cache holds bf16 or float32). */
static inline __attribute__((always_inline)) __m512 load_kv(const void *row, int64_t offset, const int bf16) {
    return bf16 ? load_bf16((const uint16_t *)row + offset) : _mm512_loadu_ps((const float *)row + offset);
}

/* The cache lines over `bytes` from `at` read ahead into L2 (NULL: none): the KV cache's
 * read-aheads here. Into L1 (read_ahead) the prefetches themselves stalled on the core's
 * outstanding misses once the cache came from memory (a quarter of the attention's samples sat
 * on them); into L2 a batch's attention over 1,024 positions took 12–17% less time. The AVX2 build
 * keeps L1, where L2 was slower (measurements: docs/performance.md). */
static inline __attribute__((always_inline)) void read_kv_ahead(const void *at, int64_t bytes) {
    if (at == NULL) return;
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)at + line, _MM_HINT_T1);
}

/* o[h] = inverse[h] · Σ_c weights[h][c] · V[c] for `count` (<= 7) query heads of one KV group at
 * once, each value row (`vectors` (<= 4) × 16 dims at `values` + slot · `row_bytes`) read once; a
 * key all the heads weigh 0 (unseen) is skipped. Each head's sum runs over c in order, as alone;
 * head h's output starts at o + h · `head_stride`. */
static inline __attribute__((always_inline)) void value_sums(const float *weights, int64_t context,
                                                             const int64_t *slots, const char *values,
                                                             int64_t row_bytes, const int64_t count,
                                                             const int64_t vectors, const int bf16,
                                                             const float *inverse, float *o,
                                                             const int64_t head_stride) {
    const int64_t dim = 16 * vectors;
    __m512 acc[7][4];
    for (int64_t h = 0; h < count; h++)
        for (int64_t v = 0; v < vectors; v++) acc[h][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < context; c++) {
        int any = 0;
        for (int64_t h = 0; h < count; h++) any |= weights[h * context + c] != 0.0f;
        if (!any) continue;
        const char *value = values + slots[c] * row_bytes;
        if (c + 8 < context) read_kv_ahead(values + slots[c + 8] * row_bytes, dim * (bf16 ? 2 : 4));
        for (int64_t v = 0; v < vectors; v++) {
            const __m512 x = load_kv(value, 16 * v, bf16);
            for (int64_t h = 0; h < count; h++)
                acc[h][v] = _mm512_fmadd_ps(_mm512_set1_ps(weights[h * context + c]), x, acc[h][v]);
        }
    }
    for (int64_t h = 0; h < count; h++)
        for (int64_t v = 0; v < vectors; v++)
            _mm512_storeu_ps(o + h * head_stride + 16 * v, _mm512_mul_ps(acc[h][v], _mm512_set1_ps(inverse[h])));
}

/* value_sums over keys [begin, end) only: acc[h] += Σ_c weights[h][c] · V[c] for `count` (<= 7)
 * query heads of one KV group at once, each value row (`vectors` (<= 4) × 16 dims at `values` +
 * slot · `row_bytes`) read once; a key all the heads weigh 0 (unseen) is skipped. The running sums start from zero where
 * `begin` is 0 and are kept in `acc` (head h's at acc + h · `head_stride`) between ranges: each
 * head's sum runs over c in order, whatever the ranges. Reads ahead `ahead_bytes` of the value
 * rows (from `ahead`, the row's first byte this call wants in cache) 8 keys on. */
static inline __attribute__((always_inline)) void range_value_sums(const float *weights, int64_t begin, int64_t end,
                                                                   int64_t context, const int64_t *slots,
                                                                   const char *values, int64_t row_bytes,
                                                                   const int64_t count, const int64_t vectors,
                                                                   const int bf16, const char *ahead,
                                                                   int64_t ahead_bytes, float *acc_mem,
                                                                   const int64_t head_stride) {
    __m512 acc[7][4];
    for (int64_t h = 0; h < count; h++)
        for (int64_t v = 0; v < vectors; v++)
            acc[h][v] = begin == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_mem + h * head_stride + 16 * v);
    for (int64_t c = begin; c < end; c++) {
        int any = 0;
        for (int64_t h = 0; h < count; h++) any |= weights[h * context + c] != 0.0f;
        if (c + 8 < context) read_kv_ahead(ahead + slots[c + 8] * row_bytes, ahead_bytes);
        if (!any) continue;
        const char *value = values + slots[c] * row_bytes;
        for (int64_t v = 0; v < vectors; v++) {
            const __m512 x = load_kv(value, 16 * v, bf16);
            for (int64_t h = 0; h < count; h++)
                acc[h][v] = _mm512_fmadd_ps(_mm512_set1_ps(weights[h * context + c]), x, acc[h][v]);
        }
    }
    for (int64_t h = 0; h < count; h++)
        for (int64_t v = 0; v < vectors; v++) _mm512_storeu_ps(acc_mem + h * head_stride + 16 * v, acc[h][v]);
}

/* The value sums' pieces of a KV head's `group` query heads: 64 dims (four vectors of running sums
 * per head) at a time for up to seven heads, 28 vectors of sums in registers, each value row's piece
 * widened once for all of them (`CALL(count, vectors, first head, first vector)`, count and vectors
 * constants where they can be, so that the sums stay in registers). */
#define EACH_VALUE_PIECE(group, all_vectors, CALL)                                                        \
    for (int64_t v0_ = 0; v0_ < (all_vectors); v0_ += 4)                                                  \
        for (int64_t g0_ = 0; g0_ < (group); g0_ += 7) {                                                  \
            const int64_t n_ = (group) - g0_ < 7 ? (group) - g0_ : 7;                                     \
            if ((all_vectors) - v0_ < 4) {                                                                \
                CALL(n_, (all_vectors) - v0_, g0_, v0_);                                                  \
                continue;                                                                                 \
            }                                                                                             \
            switch (n_) {                                                                                 \
            case 1: CALL(1, 4, g0_, v0_); break;                                                          \
            case 2: CALL(2, 4, g0_, v0_); break;                                                          \
            case 3: CALL(3, 4, g0_, v0_); break;                                                          \
            case 4: CALL(4, 4, g0_, v0_); break;                                                          \
            case 5: CALL(5, 4, g0_, v0_); break;                                                          \
            case 6: CALL(6, 4, g0_, v0_); break;                                                          \
            default: CALL(7, 4, g0_, v0_); break;                                                         \
            }                                                                                             \
        }

/* range_value_sums for one KV group's `group` query heads (weights `context` floats apart), in the
 * pieces of EACH_VALUE_PIECE; reads ahead `ahead_bytes` of each value row once. */
static inline __attribute__((always_inline)) void group_value_sums(const float *weights, int64_t begin, int64_t end,
                                                                   int64_t context, const int64_t *slots,
                                                                   const char *head_values, int64_t row_bytes,
                                                                   int64_t group, int64_t dim, const int bf16,
                                                                   const char *ahead, int64_t ahead_bytes, float *acc) {
    const int64_t element = bf16 ? 2 : 4;
#define RANGE_PIECE(count, vectors, g, v0)                                                                               \
    range_value_sums(weights + (g) * context, begin, end, context, slots, head_values + 16 * (v0) * element, row_bytes, \
                     count, vectors, bf16, ahead, ahead_bytes, acc + (g) * dim + 16 * (v0), dim);                       \
    ahead_bytes = 0 /* (read ahead once) */
    EACH_VALUE_PIECE(group, dim / 16, RANGE_PIECE)
#undef RANGE_PIECE
}

/* Query heads sharing a KV head from which each key is widened from bf16 once for all of them
 * (key_block_scores): each head's product vectors then go through memory, which costs more than
 * widening the key again for fewer heads (measurements: docs/performance.md). */
#define WIDEN_ONCE_GROUP 4

/* Keys read ahead of the one being scored (key_block_scores): one key's row of a KV head at a time,
 * between the products, so that the reads reach the memory spread out (16 keys' rows at once, in
 * a burst every 16 keys, stalled on the CPU's outstanding misses; measurements: docs/performance.md). */
#define KEYS_AHEAD 32

/* Products of `group` query heads (q, `dim` floats apart) with 16 keys, each key widened once: head
 * g's vector for key c at products + 16 · (16 g + c) (`vectors` a constant where inlined); key c's
 * turn reads ahead[c]'s row. */
static inline __attribute__((always_inline)) void widened_products(const char *const *key, const char *const *ahead, const float *q,
                                                                   int64_t group, int64_t dim, const int64_t vectors,
                                                                   float *products, const int bf16) {
    for (int64_t c = 0; c < 16; c++) {
        read_kv_ahead(ahead[c], dim * (bf16 ? 2 : 4));
        __m512 k[16];
        for (int64_t v = 0; v < vectors; v++) k[v] = load_kv(key[c], 16 * v, bf16);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
            for (int64_t v = 1; v < vectors; v++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * v), k[v], acc);
            _mm512_store_ps(products + 16 * (16 * g + c), acc);
        }
    }
}

/* One KV group's `group` query heads (q, `dim` floats apart) against 16 keys from c0 (`span` of
 * them before the context's end, `seen` those the token may see): scale · q · k per key, one product
 * vector per key (a multiply, then multiply-adds over the vectors in order) summed across lanes for
 * all 16 at once (sum16), at scores + g · context + c0; keys a token may not see score -inf. From
 * WIDEN_ONCE_GROUP heads on, each key is widened once (widened_products, through `products`: 256 ·
 * group floats, 64-byte aligned); the same operations either way. Each key's turn reads ahead the
 * head's part of the row KEYS_AHEAD keys on. */
static inline __attribute__((always_inline)) void key_block_scores(const Model *model, const char *head_keys,
                                                                   int64_t row_bytes, const float *q,
                                                                   const int64_t *slots, int64_t c0, int64_t span,
                                                                   __mmask16 lanes, __mmask16 seen, int64_t group,
                                                                   int64_t context, float *scores, float *products,
                                                                   const int bf16) {
    const int64_t dim = model->head_dim, vectors = dim / 16;
    const char *key[16], *ahead[16];
    for (int64_t c = 0; c < 16; c++) {
        key[c] = head_keys + slots[c0 + (c < span ? c : 0)] * row_bytes;
        ahead[c] = c0 + KEYS_AHEAD + c < context ? head_keys + slots[c0 + KEYS_AHEAD + c] * row_bytes : NULL;
    }
    const int widen_once = group >= WIDEN_ONCE_GROUP;
    if (widen_once) {
        if (vectors == 4) widened_products(key, ahead, q, group, dim, 4, products, bf16);
        else if (vectors == 8) widened_products(key, ahead, q, group, dim, 8, products, bf16);
        else widened_products(key, ahead, q, group, dim, vectors, products, bf16);
    }
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * dim;
        __m512 rows[16];
        for (int64_t c = 0; c < 16; c++) {
            if (widen_once) {
                rows[c] = _mm512_load_ps(products + 16 * (16 * g + c));
                continue;
            }
            if (g == 0) read_kv_ahead(ahead[c], dim * (bf16 ? 2 : 4));
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), load_kv(key[c], 0, bf16));
            for (int64_t v = 1; v < vectors; v++)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * v), load_kv(key[c], 16 * v, bf16), acc);
            rows[c] = acc;
        }
        const __m512 sums = _mm512_mul_ps(sum16(rows), _mm512_set1_ps(model->scale));
        _mm512_mask_storeu_ps(scores + g * context + c0, lanes, _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), sums));
    }
}

/* A score row's softmax numerators in place (masked keys, -inf, become exactly 0); returns
 * 1 / their sum. */
static inline float softmax_numerators(float *row, int64_t context) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < context; c += 16) {
        const __mmask16 lanes = context - c >= 16 ? 0xffff : (__mmask16)((1u << (context - c)) - 1);
        top = _mm512_mask_max_ps(top, lanes, top, _mm512_maskz_loadu_ps(lanes, row + c));
    }
    const float best = _mm512_reduce_max_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t c = 0; c < context; c += 16) {
        const __mmask16 lanes = context - c >= 16 ? 0xffff : (__mmask16)((1u << (context - c)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(lanes, row + c);
        const __mmask16 seen = _mm512_mask_cmp_ps_mask(lanes, x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, _mm512_set1_ps(best))));
        _mm512_mask_storeu_ps(row + c, lanes, e);
        total = _mm512_add_ps(total, e);
    }
    return 1.0f / _mm512_reduce_add_ps(total);
}

/* Keys (or values) a token's attention reads in one stretch when a thread takes all its KV heads
 * (attend_token): a stretch's rows are read whole and in order, so that the hardware reads ahead of
 * them (head by head over the whole context each head's rows lie a row apart and the reads wait on
 * memory; measurements: docs/performance.md). */
#define KEYS_TOGETHER 64

/* Token t's attention, every KV head, into out: the scores of each 16 keys for all heads
 * (key_block_scores; `scores`: H rows of `context` floats), each head's softmax, then the value sums
 * KEYS_TOGETHER keys at a time for all heads (`acc`: H · D floats). Each head's operations are those
 * of attention_impl's loop by KV head. */
static inline __attribute__((always_inline)) void attend_token(const Model *model, const Layer *layer, const Step *step,
                                                               const uint8_t *visible_rows, const float *qkv, float *out,
                                                               float *scores, float *acc, float *products, int64_t t,
                                                               const int bf16) {
    const int64_t element = bf16 ? 2 : 4;
    const int64_t heads = model->heads, kv_heads = model->kv_heads, dim = model->head_dim;
    const int64_t group = heads / kv_heads, width = (heads + 2 * kv_heads) * dim;
    const int64_t row_bytes = kv_heads * dim * element, context = step->context_len;
    const int64_t *slots = step->context + step->sequence[t] * context;
    const uint8_t *visible = visible_rows + t * context;
    for (int64_t c0 = 0; c0 < context; c0 += 16) {
        const int64_t span = context - c0 < 16 ? context - c0 : 16;
        const __mmask16 lanes = span == 16 ? 0xffff : (__mmask16)((1u << span) - 1);
        const __mmask16 seen = _mm_mask_cmpneq_epi8_mask(lanes, _mm_maskz_loadu_epi8(lanes, visible + c0), _mm_setzero_si128());
        if (seen == 0) { /* none visible (a causal prompt's later keys): no products */
            for (int64_t h = 0; h < heads; h++) _mm512_mask_storeu_ps(scores + h * context + c0, lanes, _mm512_set1_ps(-INFINITY));
            continue;
        }
        for (int64_t kvh = 0; kvh < kv_heads; kvh++)
            key_block_scores(model, layer->keys + kvh * dim * element, row_bytes, qkv + t * width + kvh * group * dim, slots, c0,
                             span, lanes, seen, group, context, scores + kvh * group * context, products, bf16);
    }
    float inverse[heads];
    for (int64_t h = 0; h < heads; h++) inverse[h] = softmax_numerators(scores + h * context, context);
    for (int64_t c0 = 0; c0 < context; c0 += KEYS_TOGETHER) {
        const int64_t c1 = c0 + KEYS_TOGETHER < context ? c0 + KEYS_TOGETHER : context;
        for (int64_t kvh = 0; kvh < kv_heads; kvh++)
            group_value_sums(scores + kvh * group * context, c0, c1, context, slots, layer->values + kvh * dim * element, row_bytes,
                             group, dim, bf16, layer->values, kvh == 0 ? row_bytes : 0, acc + kvh * group * dim);
    }
    float *o = out + t * heads * dim;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(o + h * dim + d, _mm512_mul_ps(_mm512_loadu_ps(acc + h * dim + d), _mm512_set1_ps(inverse[h])));
}

/* out (T, H * D): each token's query heads over the keys it may see (`visible_rows`, (T, C)), one KV
 * head's group at a time (grouped-query attention without repeating K/V), for the `count` tokens
 * listed in `todo` (NULL: tokens 0 .. count - 1). With as many tokens as threads a thread takes
 * whole tokens, all their KV heads at once (attend_token, which reads the cache's rows in order);
 * with fewer, each (token, KV head) pair is one thread's (a one-token step's heads shared out; the
 * same operations per head, and faster there than attend_token: measurements, docs/performance.md).
 * Head sizes are multiples of 16 up to 256 (checked in Python); `scratch` holds threads · H · C
 * floats. */
static inline __attribute__((always_inline)) void attention_impl(const Model *model, const Layer *layer,
                                                                 const Step *step, const uint8_t *visible_rows,
                                                                 const float *qkv, float *out, float *scratch,
                                                                 const int64_t *todo, int64_t count,
                                                                 const int bf16) {
    const int64_t element = bf16 ? 2 : 4;
    const char *keys = layer->keys, *values = layer->values;
    const int64_t heads = model->heads, kv_heads = model->kv_heads, dim = model->head_dim;
    const int64_t group = heads / kv_heads, width = (heads + 2 * kv_heads) * dim;
    const int64_t kv_width = kv_heads * dim, context = step->context_len, vectors = dim / 16;
    if (count >= step->threads) { /* a token to a thread, its KV heads together */
#pragma omp parallel num_threads(step->threads)
        {
            float *scores = scratch + (int64_t)omp_get_thread_num() * heads * context;
            float acc[heads * dim];
            float products[256 * group] __attribute__((aligned(64))); /* (key_block_scores) */
#pragma omp for schedule(static, 1) /* round robin: a causal prompt's later tokens see more keys */
            for (int64_t i = 0; i < count; i++)
                attend_token(model, layer, step, visible_rows, qkv, out, scores, acc, products, todo != NULL ? todo[i] : i, bf16);
        }
        return;
    }
#pragma omp parallel num_threads(step->threads)
    {
        float *scores = scratch + (int64_t)omp_get_thread_num() * group * context;
        float products[256 * group] __attribute__((aligned(64))); /* (key_block_scores) */
#pragma omp for schedule(static, 1) collapse(2) /* round robin: a causal prompt's later tokens see more keys */
        for (int64_t i = 0; i < count; i++) {
            for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
                const int64_t t = todo != NULL ? todo[i] : i;
                const float *q = qkv + t * width + kvh * group * dim;
                const int64_t *slots = step->context + step->sequence[t] * context;
                const uint8_t *visible = visible_rows + t * context;
                /* scores, 16 keys at a time: one product vector per key, summed across lanes
                 * for all 16 at once (sum16); keys a token may not see score -inf */
                for (int64_t c0 = 0; c0 < context; c0 += 16) {
                    const int64_t span = context - c0 < 16 ? context - c0 : 16;
                    const __mmask16 lanes = span == 16 ? 0xffff : (__mmask16)((1u << span) - 1);
                    const __mmask16 seen = _mm_mask_cmpneq_epi8_mask(
                        lanes, _mm_maskz_loadu_epi8(lanes, visible + c0), _mm_setzero_si128());
                    if (seen == 0) { /* none visible (a causal prompt's later keys): no products */
                        for (int64_t g = 0; g < group; g++)
                            _mm512_mask_storeu_ps(scores + g * context + c0, lanes, _mm512_set1_ps(-INFINITY));
                        continue;
                    }
                    key_block_scores(model, keys + kvh * dim * element, kv_width * element, q, slots, c0, span, lanes, seen,
                                     group, context, scores, products, bf16);
                }
                float *o = out + t * heads * dim + kvh * group * dim;
                float inverse[group];
                for (int64_t g = 0; g < group; g++) inverse[g] = softmax_numerators(scores + g * context, context);
                const char *head_values = values + kvh * dim * element;
#define WHOLE_PIECE(count, n, g, v0)                                                                                   \
    value_sums(scores + (g) * context, context, slots, head_values + 16 * (v0) * element, kv_width * element, count, n, \
               bf16, inverse + (g), o + (g) * dim + 16 * (v0), dim)
                EACH_VALUE_PIECE(group, vectors, WHOLE_PIECE)
#undef WHOLE_PIECE
            }
        }
    }
}

/* out[i] = act(gate[i]) * up[i] for one token's MLP (`size` a multiple of 16), act SiLU or GELU
 * with the tanh approximation, 0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³))), as torch's "tanh" GELU. */
static void gated_activation(int64_t activation, const float *gate, const float *up, int64_t size, float *out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < size; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        __m512 a;
        if (activation == GELU_TANH) { /* tanh(u) = 1 - 2 / (e^2u + 1) */
            const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                           _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
            const __m512 e = exp16(_mm512_add_ps(u, u));
            const __m512 tanh = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
            a = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, tanh));
        } else {
            a = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        }
        _mm512_storeu_ps(out + i, _mm512_mul_ps(a, _mm512_loadu_ps(up + i)));
    }
}

