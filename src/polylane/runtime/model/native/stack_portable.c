/* The layer stack's arithmetic outside the matrix products, in plain C (#included by decoder.c
 * where the CPU lacks AVX512-BF16 or the build is portable: AVX2-only x86, ARM; the compiler
 * vectorises the loops for what -march allows). stack_avx512.c is the same with AVX-512; on AVX2
 * CPUs stack_avx2.c's attention takes the place of the one here.
 *
 * What this file owns: e^x, bf16 stores of the KV cache, the per-token grouped-query attention
 * over the paged cache, and the MLP's gated activation. Each token's arithmetic is its own (no
 * sum crosses tokens, each runs in one fixed order), so a verify pass equals the decode steps.
 */

/* e^x as 2^n · p(r), x = n ln 2 + r, |r| <= ln 2 / 2, with Cephes' degree-7 polynomial for e^r
 * (relative error ~2e-7); n rounded by adding and removing 1.5 · 2^23, so the loops that call it
 * vectorise. x below -87 gives ~0 and above 88 gives e^88, never NaN or infinity. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float power;
    memcpy(&power, &bits, sizeof power);
    return p * power;
}

/* `size` floats rounded to bf16, to nearest even, as torch rounds them (NaN stays a quiet NaN). */
static inline void store_bf16(const float *x, int64_t size, uint16_t *out) {
    for (int64_t i = 0; i < size; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        out[i] = (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((bits >> 16) | 0x40u)
                                                    : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
}

#ifndef STACK_AVX2 /* (AVX2 CPUs take stack_avx2.c's attention) */
/* A cache row's `dim` values as float32: the row itself where the cache holds float32, else its bf16
 * values widened into `buffer`. */
static inline const float *float_row(const void *row, int64_t dim, const int bf16, float *buffer) {
    if (!bf16) return row;
    const uint16_t *v = row;
    for (int64_t d = 0; d < dim; d++) buffer[d] = bf16_value(v[d]);
    return buffer;
}

/* q · k over `dim` (a multiple of 8) values: eight running sums, then added pairwise, in one order
 * whatever the batch (the compiler keeps the eight sums in one vector register). */
static inline float dot(const float *q, const float *k, int64_t dim) {
    float lanes[8] = {0.0f};
    for (int64_t d = 0; d < dim; d += 8)
        for (int l = 0; l < 8; l++) lanes[l] += q[d + l] * k[d + l];
    return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

/* out (T, H * D): each token's query heads over the keys it may see (`visible_rows`, (T, C)), one KV
 * head's group at a time (grouped-query attention without repeating K/V), for the `count` tokens
 * listed in `todo` (NULL: tokens 0 .. count - 1); `scratch` holds a group's scores per thread
 * (threads * group * C floats). Per KV head: every seen key (read and widened once) scored against
 * the group's heads, the softmax, then every value row (read once) added into the heads' outputs
 * in key order. Head sizes are multiples of 16 up to 256 (checked in Python). */
static void attention_impl(const Model *model, const Layer *layer, const Step *step, const uint8_t *visible_rows,
                           const float *qkv, float *out, float *scratch, const int64_t *todo, int64_t count,
                           const int bf16) {
    const int64_t element = bf16 ? 2 : 4;
    const char *keys = layer->keys, *values = layer->values;
    const int64_t heads = model->heads, kv_heads = model->kv_heads, dim = model->head_dim;
    const int64_t group = heads / kv_heads, width = (heads + 2 * kv_heads) * dim;
    const int64_t kv_width = kv_heads * dim, context = step->context_len;
#pragma omp parallel num_threads(step->threads)
    {
        float *scores = scratch + (int64_t)omp_get_thread_num() * group * context;
        float row[256];
#pragma omp for schedule(static, 1) collapse(2) /* round robin: a causal prompt's later tokens see more keys */
        for (int64_t i = 0; i < count; i++) {
            for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
                const int64_t t = todo != NULL ? todo[i] : i;
                const float *q = qkv + t * width + kvh * group * dim;
                const int64_t *slots = step->context + step->sequence[t] * context;
                const uint8_t *visible = visible_rows + t * context;
                float *o = out + t * heads * dim + kvh * group * dim;
                for (int64_t c = 0; c < context; c++) {
                    if (!visible[c]) {
                        for (int64_t g = 0; g < group; g++) scores[g * context + c] = -INFINITY;
                        continue;
                    }
                    const float *key = float_row(keys + (slots[c] * kv_width + kvh * dim) * element, dim, bf16, row);
                    for (int64_t g = 0; g < group; g++) scores[g * context + c] = dot(q + g * dim, key, dim) * model->scale;
                }
                float inverse[group];
                for (int64_t g = 0; g < group; g++) { /* softmax numerators in place; unseen keys exactly 0 */
                    float *weights = scores + g * context, best = -INFINITY, total = 0.0f;
                    for (int64_t c = 0; c < context; c++) best = weights[c] > best ? weights[c] : best;
                    for (int64_t c = 0; c < context; c++) {
                        weights[c] = weights[c] == -INFINITY ? 0.0f : exp_approx(weights[c] - best);
                        total += weights[c];
                    }
                    inverse[g] = total > 0.0f ? 1.0f / total : 0.0f;
                }
                memset(o, 0, sizeof(float) * (size_t)(group * dim));
                for (int64_t c = 0; c < context; c++) {
                    if (!visible[c]) continue;
                    const float *value = float_row(values + (slots[c] * kv_width + kvh * dim) * element, dim, bf16, row);
                    for (int64_t g = 0; g < group; g++) {
                        const float weight = scores[g * context + c];
                        float *head = o + g * dim;
                        for (int64_t d = 0; d < dim; d++) head[d] += weight * value[d];
                    }
                }
                for (int64_t g = 0; g < group; g++)
                    for (int64_t d = 0; d < dim; d++) o[g * dim + d] *= inverse[g];
            }
        }
    }
}

#endif

/* out[i] = act(gate[i]) * up[i] for one token's MLP, act SiLU or GELU with the tanh approximation,
 * 0.5 g (1 + tanh(√(2/π) (g + 0.044715 g³))), as torch's "tanh" GELU. */
static void gated_activation(int64_t activation, const float *gate, const float *up, int64_t size, float *out) {
    if (activation == GELU_TANH) {
#pragma omp simd
        for (int64_t i = 0; i < size; i++) { /* tanh(u) = 1 - 2 / (e^2u + 1) */
            const float g = gate[i], u = 0.7978845608028654f * (0.044715f * g * g * g + g);
            const float tanh = 1.0f - 2.0f / (exp_approx(u + u) + 1.0f);
            out[i] = 0.5f * g * (1.0f + tanh) * up[i];
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < size; i++) out[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
    }
}
