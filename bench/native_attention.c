/* The native stack's attention alone (bench/native_attention.py builds and runs this).

Includes decoder.c, so it times the very `attention_impl` the build picks for this CPU: `layers`
separate caches of `tokens` sequences × `context` keys (bf16, every key visible), the queries
random, one call per layer, the best of `repeats` passes. Prints ns per (token, key, layer) (the
pass's time over tokens × keys × layers; its JSON key says ns_per_token_key) and the cache's read
rate. usage: native_attention HEADS KV_HEADS HEAD_DIM LAYERS TOKENS CONTEXT REPEATS THREADS */
#include "decoder.c"

#include <stdio.h>
#include <time.h>

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: %s HEADS KV_HEADS HEAD_DIM LAYERS TOKENS CONTEXT REPEATS THREADS\n", argv[0]);
        return 2;
    }
    Model model;
    memset(&model, 0, sizeof model);
    model.heads = atol(argv[1]), model.kv_heads = atol(argv[2]), model.head_dim = atol(argv[3]);
    model.scale = 1.0f / sqrtf((float)model.head_dim), model.kv_bf16 = 1;
    const int64_t layers = atol(argv[4]), tokens = atol(argv[5]), context = atol(argv[6]), repeats = atol(argv[7]);
    const int64_t kv_width = model.kv_heads * model.head_dim, slots = tokens * context;
    const int64_t width = (model.heads + 2 * model.kv_heads) * model.head_dim;
    Layer *layer = calloc((size_t)layers, sizeof(Layer));
    for (int64_t l = 0; l < layers; l++) {
        uint16_t *keys = aligned_alloc(64, sizeof(uint16_t) * (size_t)(kv_width * slots));
        uint16_t *values = aligned_alloc(64, sizeof(uint16_t) * (size_t)(kv_width * slots));
        for (int64_t i = 0; i < kv_width * slots; i++) /* bf16 values in [1/128, 1) */
            keys[i] = (uint16_t)(0x3c00 + (i * 7 + l) % 200), values[i] = (uint16_t)(0x3c00 + (i * 13 + l) % 200);
        layer[l].keys = (char *)keys, layer[l].values = (char *)values;
    }
    int64_t *context_slots = malloc(sizeof(int64_t) * (size_t)slots), *sequence = malloc(sizeof(int64_t) * (size_t)tokens);
    for (int64_t t = 0; t < tokens; t++) {
        sequence[t] = t;
        for (int64_t c = 0; c < context; c++) context_slots[t * context + c] = t * context + c;
    }
    Step step;
    memset(&step, 0, sizeof step);
    step.context = context_slots, step.sequence = sequence, step.context_len = context;
    step.threads = atoi(argv[8]), step.tokens = tokens;
    uint8_t *visible = malloc((size_t)slots);
    memset(visible, 1, (size_t)slots);
    float *qkv = malloc(sizeof(float) * (size_t)(tokens * width));
    for (int64_t i = 0; i < tokens * width; i++) qkv[i] = (float)((i * 31) % 100) / 100.0f - 0.5f;
    float *out = malloc(sizeof(float) * (size_t)(tokens * model.heads * model.head_dim));
    float *scratch = malloc(sizeof(float) * (size_t)(step.threads * model.heads * context));
    double best = 1e30;
    for (int64_t r = 0; r < repeats; r++) {
        const double start = seconds_now();
        for (int64_t l = 0; l < layers; l++) attention_impl(&model, &layer[l], &step, visible, qkv, out, scratch, NULL, tokens, 1);
        const double took = seconds_now() - start;
        if (took < best) best = took;
    }
    const double keys_read = (double)(layers * tokens * context);
    printf("{\"ns_per_token_key\": %.2f, \"gb_per_s\": %.2f, \"ms_per_pass\": %.3f, \"check\": %g}\n", best * 1e9 / keys_read,
           keys_read * (double)(2 * kv_width * 2) / best / 1e9, best * 1e3, (double)out[model.head_dim + 1]);
    return 0;
}
