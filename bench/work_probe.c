/* bench.cpuclass's probe: N times, sleep a little (an agent between commands), then do a fixed piece of CPU
 * work and time it (wall clock); prints the p50 and p99 in microseconds. Static, so any image runs it. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000LL + t.tv_nsec / 1000;
}

static int cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 200;
    long work = argc > 2 ? atol(argv[2]) : 2000000;
    long long *t = calloc((size_t)n, sizeof *t);
    volatile unsigned long sink = 0;
    for (int i = 0; i < n; i++) {
        struct timespec pause = {0, 5 * 1000 * 1000};
        nanosleep(&pause, NULL);
        long long t0 = now_us();
        for (long k = 0; k < work; k++) sink += (unsigned long)k * 2654435761u;
        t[i] = now_us() - t0;
    }
    qsort(t, (size_t)n, sizeof *t, cmp);
    printf("%lld %lld\n", t[n / 2], t[(n * 99) / 100]);
    return 0;
}
