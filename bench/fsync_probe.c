/* fsync_probe N FILE: N times write 4 KiB at the start of FILE and fdatasync it; print p50 and p99 in
 * microseconds. Static, written into a sandbox by bench/io.py (and run on the host for the baseline). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    int n = atoi(argv[1]);
    int fd = open(argv[2], O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) { perror("open"); return 1; }
    char buf[4096];
    memset(buf, 'x', sizeof buf);
    double *t = calloc((size_t)n, sizeof *t);
    for (int i = 0; i < n; i++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        if (pwrite(fd, buf, sizeof buf, 0) != (ssize_t)sizeof buf || fdatasync(fd)) { perror("write"); return 1; }
        clock_gettime(CLOCK_MONOTONIC, &b);
        t[i] = (b.tv_sec - a.tv_sec) * 1e6 + (b.tv_nsec - a.tv_nsec) / 1e3;
    }
    qsort(t, (size_t)n, sizeof *t, cmp);
    printf("%.0f %.0f\n", t[n / 2], t[(n * 99) / 100]);
    return 0;
}
