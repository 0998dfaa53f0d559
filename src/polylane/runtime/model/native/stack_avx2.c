/* The per-token attention with AVX2 and FMA (#included by decoder.c after stack_portable.c where the
 * CPU has AVX2 but not AVX512-BF16: AMD EPYC Zen 2/3, most laptops and desktops). stack_portable.c
 * keeps e^x, the bf16 stores and the MLP's gate for these CPUs; stack_avx512.c is the AVX-512 stack.
 *
 * What this file owns: the grouped-query attention over the paged cache: per query head its scores
 * eight keys at a time, the softmax, then the value rows weighted in key order. A work item is a
 * token's KV head (its keys widened once for the group's heads) or, where there are too few of
 * those to keep the threads busy (a decode step: SmolLM2's three KV heads on two threads left one
 * thread a third of the work), a token's query head. Each head's arithmetic is the same either way
 * and whatever the batch or the thread, so a verify pass equals the decode steps.
 */

/* e^x, 8 lanes: exp_approx's polynomial and rounding, lane by lane (the same floats). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 shifter = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), shifter), shifter);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* 8 keys or values of a cache row from `offset`, as float32 (the cache holds bf16 or float32). */
static inline __attribute__((always_inline)) __m256 load_kv8(const void *row, int64_t offset, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + offset);
    const __m128i halves = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + offset));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

/* Lane c of the result = the sum of the 8 lanes of v[c] (an 8 x 8 transpose-and-add). */
static inline __m256 sum8(const __m256 v[8]) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3); /* per 128-bit half: keys 0–3, 4–7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* The lanes of a mask of `span` (<= 8) keys: all ones in lanes below it. */
static inline __m256 first_lanes(int64_t span) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)span), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* One query head's softmax weights over the `context` keys in `scores` (numerators in place, keys
 * scored -inf exactly 0); returns 1 / their sum. */
static inline float softmax_numerators(float *scores, int64_t context) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    int64_t c = 0;
    for (; c + 8 <= context; c += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(scores + c));
    float best = -INFINITY;
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    for (; c < context; c++) best = scores[c] > best ? scores[c] : best;
    __m256 total = _mm256_setzero_ps();
    for (c = 0; c < context; c += 8) {
        const int64_t span = context - c < 8 ? context - c : 8;
        const __m256 in = first_lanes(span);
        const __m256 x = _mm256_maskload_ps(scores + c, _mm256_castps_si256(in));
        const __m256 seen = _mm256_and_ps(in, _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
        const __m256 e = _mm256_and_ps(seen, exp8(_mm256_sub_ps(x, _mm256_set1_ps(best))));
        _mm256_maskstore_ps(scores + c, _mm256_castps_si256(in), e);
        total = _mm256_add_ps(total, e);
    }
    _mm256_storeu_ps(lanes, total);
    const float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    return sum > 0.0f ? 1.0f / sum : 0.0f;
}

/* o = inverse · Σ_c weights[c] · V[c] over `vectors` (<= 8) × 8 dims of one head, the value rows at
 * `values` + slot · `row_bytes`, in key order; keys weighed 0 (unseen) are skipped. */
static inline __attribute__((always_inline)) void head_value_sum(const float *weights, int64_t context, const int64_t *slots,
                                                                 const char *values, int64_t row_bytes, const int64_t vectors,
                                                                 const int bf16, float inverse, float *o) {
    __m256 acc[8];
    for (int64_t v = 0; v < vectors; v++) acc[v] = _mm256_setzero_ps();
    for (int64_t c = 0; c < context; c++) {
        if (weights[c] == 0.0f) continue;
        const char *value = values + slots[c] * row_bytes;
        if (c + 8 < context)
            for (int64_t b = 0; b < vectors * 8 * (bf16 ? 2 : 4); b += 64) _mm_prefetch(values + slots[c + 8] * row_bytes + b, _MM_HINT_T0);
        const __m256 weight = _mm256_set1_ps(weights[c]);
        for (int64_t v = 0; v < vectors; v++) acc[v] = _mm256_fmadd_ps(weight, load_kv8(value, 8 * v, bf16), acc[v]);
    }
    for (int64_t v = 0; v < vectors; v++) _mm256_storeu_ps(o + 8 * v, _mm256_mul_ps(acc[v], _mm256_set1_ps(inverse)));
}

/* Keys read ahead of the ones being widened (attend_heads), one row at a time: as in stack_avx512.c,
 * a burst of eight rows' reads every eight keys stalls on the CPU's outstanding misses. */
#define KEYS_AHEAD 32

/* Query heads h0 .. h0 + n - 1 (of one KV head's group) of token t over the keys it may see:
 * per 8 keys, each key widened to float32 once (into `widened`) and scored against each head (sum8),
 * then per head the softmax and the value rows; `scores` holds n rows of C floats. Each head's
 * operations are the same whichever heads share its call. */
static inline __attribute__((always_inline)) void attend_heads(const Model *model, const Layer *layer, const Step *step,
                                                               const uint8_t *visible_rows, const float *qkv, float *out,
                                                               float *scores, int64_t t, int64_t h0, int64_t n,
                                                               const int bf16) {
    const int64_t element = bf16 ? 2 : 4, dim = model->head_dim, heads = model->heads, kv_heads = model->kv_heads;
    const int64_t kvh = h0 / (heads / kv_heads), width = (heads + 2 * kv_heads) * dim, kv_width = kv_heads * dim;
    const int64_t context = step->context_len, vectors = dim / 8;
    const int64_t *slots = step->context + step->sequence[t] * context;
    const uint8_t *visible = visible_rows + t * context;
    const char *head_keys = layer->keys + kvh * dim * element;
    float widened[8 * 256] __attribute__((aligned(32)));
    for (int64_t c0 = 0; c0 < context; c0 += 8) { /* scores, 8 keys at a time */
        const int64_t span = context - c0 < 8 ? context - c0 : 8;
        uint64_t seen_bytes = 0;
        memcpy(&seen_bytes, visible + c0, (size_t)span);
        if (seen_bytes == 0) { /* none visible (a causal prompt's later keys): no products */
            for (int64_t g = 0; g < n; g++)
                for (int64_t c = c0; c < c0 + span; c++) scores[g * context + c] = -INFINITY;
            continue;
        }
        for (int64_t c = 0; c < 8; c++) {
            if (c0 + KEYS_AHEAD + c < context) /* one row at a time, between the widenings */
                read_ahead(head_keys + slots[c0 + KEYS_AHEAD + c] * kv_width * element, dim * element);
            const char *key = head_keys + slots[c0 + (c < span ? c : 0)] * kv_width * element;
            for (int64_t v = 0; v < vectors; v++) _mm256_store_ps(widened + c * dim + 8 * v, load_kv8(key, 8 * v, bf16));
        }
        for (int64_t g = 0; g < n; g++) {
            const float *q = qkv + t * width + (h0 + g) * dim;
            __m256 products[8];
            for (int64_t c = 0; c < 8; c++) {
                const float *key = widened + c * dim;
                __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_load_ps(key));
                for (int64_t v = 1; v < vectors; v++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * v), _mm256_load_ps(key + 8 * v), acc);
                products[c] = acc;
            }
            float sums[8];
            _mm256_storeu_ps(sums, _mm256_mul_ps(sum8(products), _mm256_set1_ps(model->scale)));
            for (int64_t c = 0; c < span; c++) scores[g * context + c0 + c] = visible[c0 + c] ? sums[c] : -INFINITY;
        }
    }
    const char *head_values = layer->values + kvh * dim * element;
    for (int64_t g = 0; g < n; g++) {
        float *weights = scores + g * context;
        const float inverse = softmax_numerators(weights, context);
        float *o = out + t * heads * dim + (h0 + g) * dim;
        for (int64_t v0 = 0; v0 < vectors; v0 += 8) /* 64 dims (8 vectors of accumulators) at a time */
            if (vectors - v0 >= 8)
                head_value_sum(weights, context, slots, head_values + 8 * v0 * element, kv_width * element, 8, bf16, inverse, o + 8 * v0);
            else
                head_value_sum(weights, context, slots, head_values + 8 * v0 * element, kv_width * element, vectors - v0, bf16,
                               inverse, o + 8 * v0);
    }
}

/* Fewer (token, KV head) pairs than this per thread, and not a multiple of the threads: the work
 * goes out by query head instead, so that a decode step's few KV heads do not leave a thread idle
 * (SmolLM2's three on two threads; each head's arithmetic the same). Pairs that share out evenly
 * (Qwen's two KV heads on two threads) stay pairs: each key widened once for the group, not once
 * per head (measurements: docs/performance.md). */
#define KV_ITEMS_PER_THREAD 4

/* out (T, H * D): each token's query heads over the keys it may see (`visible_rows`, (T, C)), for
 * the `count` tokens listed in `todo` (NULL: tokens 0 .. count - 1); `scratch` holds a group's
 * scores per thread (threads * group * C floats). Head sizes are multiples of 16 up to 256 (checked
 * in Python). */
static void attention_impl(const Model *model, const Layer *layer, const Step *step, const uint8_t *visible_rows,
                           const float *qkv, float *out, float *scratch, const int64_t *todo, int64_t count,
                           const int bf16) {
    const int64_t group = model->heads / model->kv_heads, context = step->context_len;
    /* per KV head (its keys widened once for its group), or per query head for few uneven items */
    const int64_t kv_items = count * model->kv_heads;
    const int64_t per_item = kv_items >= KV_ITEMS_PER_THREAD * step->threads || kv_items % step->threads == 0 ? group : 1;
    const int64_t items = model->heads / per_item;
#pragma omp parallel num_threads(step->threads)
    {
        float *scores = scratch + (int64_t)omp_get_thread_num() * group * context;
#pragma omp for schedule(static, 1) collapse(2) /* round robin: a causal prompt's later tokens see more keys */
        for (int64_t i = 0; i < count; i++) {
            for (int64_t item = 0; item < items; item++) {
                const int64_t t = todo != NULL ? todo[i] : i;
                if (bf16) attend_heads(model, layer, step, visible_rows, qkv, out, scores, t, item * per_item, per_item, 1);
                else attend_heads(model, layer, step, visible_rows, qkv, out, scores, t, item * per_item, per_item, 0);
            }
        }
    }
}
