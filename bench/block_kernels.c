/* The decode kernels alone on a synthetic matrix (bench/block_kernels.py builds and runs this).

Includes blocks.c, so it times the very kernels the build picks for this CPU: `rows` activation
rows (1: decode_tile, the one-row kernels; 2 to DECODE_ROWS: decode_tile_rows, the batch kernel)
times an n × k matrix of `type`'s blocks (random codes, every scale a small normal half), the tiles
shared out over `threads` threads as coded_matmul does, the best of `repeats` passes. After each
pass the same bytes are read by a plain vector loop on as many threads, so the kernel's rate can be
read against what the memory gave at that moment (this machine's streaming rate moves between
runs). Prints ns per (activation row, 256 columns) per thread, the weights' GB/s, the plain read's GB/s
and their ratio. usage: block_kernels TYPE N K ROWS THREADS REPEATS HUGE */
#include "blocks.c"

#include <stdio.h>
#include <sys/mman.h>

/* Every half-precision scale of the blocks set to 2^-7 (random bytes there could be inf or NaN). */
static void sane_scales(int64_t type, uint8_t *w, int64_t bytes) {
    const uint16_t half = 0x2000;
    int64_t block_bytes;
    block_geometry(type, &block_bytes);
    for (int64_t at = 0; at + block_bytes <= bytes; at += block_bytes) {
        if (type == GGML_Q6_K) {
            memcpy(w + at + 208, &half, 2);
            continue;
        }
        memcpy(w + at, &half, 2);
        if (type == GGML_Q4_K || type == GGML_Q4_1) memcpy(w + at + 2, &half, 2);
    }
}

/* The bytes read by `threads` threads, each its share, as 64-bit words the compiler vectorises; a
   sum so the reads are not dropped. */
static uint64_t plain_read(const uint8_t *w, int64_t bytes, int threads) {
    const uint64_t *words = (const uint64_t *)w;
    uint64_t total = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (int64_t at = 0; at < bytes / 8; at++) total += words[at];
    return total;
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s TYPE N K ROWS THREADS REPEATS HUGE\n", argv[0]);
        return 2;
    }
    const int64_t type = atol(argv[1]), n = atol(argv[2]), k = atol(argv[3]), rows = atol(argv[4]);
    const int threads = atoi(argv[5]), huge = atoi(argv[7]);
    const long repeats = atol(argv[6]);
    if (!has_decode_kernel(type)) {
        fprintf(stderr, "no decode kernel for type %ld in this build (the portable build has none)\n", (long)type);
        return 3;
    }
    if (rows < 1 || rows > DECODE_ROWS || n % TILE_ROWS != 0 || k % 256 != 0) {
        fprintf(stderr, "ROWS must be 1..%d, N a multiple of %d, K of 256\n", DECODE_ROWS, TILE_ROWS);
        return 2;
    }
    const int64_t row_bytes = block_row_bytes(type, k), bytes = row_bytes * n;
    const size_t page = (size_t)2 << 20, mapped = ((size_t)bytes + page - 1) / page * page;
    uint8_t *w = aligned_alloc(page, mapped);
    if (w == NULL) return 1;
    if (huge) madvise(w, mapped, MADV_HUGEPAGE);
    for (int64_t at = 0; at < bytes; at++) w[at] = (uint8_t)((uint64_t)at * 2654435761u >> 13);
    sane_scales(type, w, bytes);

    const int one_row = rows == 1 && type == GGML_Q4_K; /* the Q4_K one-row kernel's activation copy */
    const size_t x_bytes = (activation_bytes(k, one_row) + 63) & ~(size_t)63;
    uint8_t *coded = aligned_alloc(64, x_bytes * (size_t)rows);
    float *x = malloc(sizeof(float) * (size_t)k), *y = malloc(sizeof(float) * (size_t)(n * rows));
    for (int64_t j = 0; j < rows; j++) {
        for (int64_t c = 0; c < k; c++) x[c] = (float)((c * 7 + j * 13) % 2001 - 1000) / 300.0f;
        for (int64_t s = 0; s < whole_spans(k) / SPAN; s++) code_activation_span(x, k, activation_layout(coded + j * x_bytes, k, one_row), s);
    }
    const CodedActivations a = activation_layout(coded, k, one_row);

    double best = 1e30, best_plain = 1e30;
    uint64_t sink = 0;
    for (long repeat = 0; repeat < repeats; repeat++) {
        double start = omp_get_wtime();
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t n0 = 0; n0 < n; n0 += TILE_ROWS) {
            const uint8_t *sources[TILE_ROWS];
            int64_t types[TILE_ROWS];
            for (int r = 0; r < TILE_ROWS; r++) sources[r] = w + (n0 + r) * row_bytes, types[r] = type;
            if (rows == 1) {
                float totals[TILE_ROWS];
                decode_tile(types, sources, TILE_ROWS, k, &a, totals);
                memcpy(y + n0, totals, sizeof totals);
            } else {
                decode_tile_rows(types, sources, TILE_ROWS, k, &a, (int64_t)x_bytes, rows, y + n0, n);
            }
        }
        const double took = omp_get_wtime() - start;
        if (took < best) best = took;
        start = omp_get_wtime();
        sink += plain_read(w, bytes, threads);
        const double plain = omp_get_wtime() - start;
        if (plain < best_plain) best_plain = plain;
    }
    const double spans = (double)n * (double)(k / 256) * (double)rows;
    printf("{\"ns_per_row_256\": %.3f, \"weights_gb_per_s\": %.2f, \"plain_read_gb_per_s\": %.2f, \"of_plain_read\": %.3f, "
           "\"check\": %g, \"sink\": %d}\n",
           best * 1e9 * threads / spans, (double)bytes / best / 1e9, (double)bytes / best_plain / 1e9, best_plain / best, (double)y[0],
           (int)(sink & 1));
    return 0;
}
