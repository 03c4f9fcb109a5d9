/* Where this machine put our two threads: a cache line's round trip between them, OpenMP's
 * fork/join and barrier, and the read bandwidth of the two together.
 *
 * On a cloud VM the two vCPUs may share one L3 (one CCD on AMD EPYC) or sit on two, and the
 * hypervisor moves them. Six runs half a minute apart on 2026-12-03 (2 vCPUs of an AMD EPYC,
 * family 26): round trips of 88 to 701 ns, reads of 40 to 66 GB/s, the fastest reads with
 * the slowest round trips (two CCDs: two links to memory, a line between the threads ~4x
 * slower). benchmarks/gguf_decode.py's memory floor is the bytes a token reads over such a
 * read bandwidth, taken in the same run; a single-stream decode of a small model (SmolLM2:
 * 120 linears of 0.3-3.5 MB a token, each thread then reading what the other wrote) does not
 * speed up with it, so its TPOT / floor ratio moves with the placement (docs/benchmarks.md).
 * The placement changes within seconds: run this beside a benchmark to see how often.
 *
 *     gcc -O3 -march=native -fopenmp benchmarks/core_pingpong.c -o /tmp/core_pingpong
 *     OMP_NUM_THREADS=2 GOMP_SPINCOUNT=10000 /tmp/core_pingpong [ROUNDS [MIB]]
 *
 * ROUNDS round trips (default 200000) and fork/joins and barriers (a tenth as many), MIB MiB
 * read (default 512, best of 5). Prints one JSON object: pingpong_ns (one round trip),
 * fork_join_us, barrier_us, read_gbps.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* One line, written by each thread in turn. */
static volatile int64_t flag[16] __attribute__((aligned(64)));

int main(int argc, char **argv)
{
    const int rounds = argc > 1 ? atoi(argv[1]) : 200000;
    const int regions = rounds / 10 > 0 ? rounds / 10 : 1;
    const size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 512;
    if (rounds < 1 || mib < 1) {
        fprintf(stderr, "usage: %s [ROUNDS >= 1 [MIB >= 1]]\n", argv[0]);
        return 2;
    }
    volatile int sink = 0;
    #pragma omp parallel num_threads(2) /* the threads started before anything is timed */
    sink += 0;
    double t = now();
    #pragma omp parallel num_threads(2)
    {
        const int me = omp_get_thread_num();
        for (int64_t i = 0; i < rounds; i++) {
            if (me == 0) {
                flag[0] = 2 * i + 1;
                while (flag[0] != 2 * i + 2) {}
            } else if (me == 1) {
                while (flag[0] != 2 * i + 1) {}
                flag[0] = 2 * i + 2;
            }
        }
    }
    const double pingpong = (now() - t) / rounds;

    t = now();
    for (int i = 0; i < regions; i++) {
        #pragma omp parallel num_threads(2)
        sink += 0;
    }
    const double fork_join = (now() - t) / regions;

    t = now();
    #pragma omp parallel num_threads(2)
    for (int i = 0; i < regions; i++) {
        #pragma omp barrier
    }
    const double barrier = (now() - t) / regions;

    const size_t n = mib << 18; /* MIB MiB of 32-bit words (integer sums vectorize) */
    uint32_t *a = malloc(n * sizeof *a);
    if (!a) return 1;
    #pragma omp parallel for num_threads(2) schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = 1;
    double best = 1e9;
    for (int r = 0; r < 5; r++) {
        uint32_t sum = 0;
        t = now();
        #pragma omp parallel for num_threads(2) schedule(static) reduction(+ : sum)
        for (size_t i = 0; i < n; i++) sum += a[i];
        t = now() - t;
        if (t < best) best = t;
        sink += sum > 0;
    }
    free(a);
    printf("{\"pingpong_ns\": %.0f, \"fork_join_us\": %.2f, \"barrier_us\": %.2f, "
           "\"read_gbps\": %.1f}\n",
           pingpong * 1e9, fork_join * 1e6, barrier * 1e6, (double)(n * sizeof *a) / best / 1e9);
    return 0;
}
