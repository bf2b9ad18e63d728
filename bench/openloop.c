/* openloop: what the gate adds to open(2), without an interpreter around it.
 *
 *   openloop PATH COUNT REPEATS
 *
 * REPEATS times: COUNT open(PATH, O_RDONLY) + close, printing the mean nanoseconds per open of
 * each repeat, one per line. A failed open counts like a successful one: a granted NVIDIA node
 * without a driver fails with ENXIO after the gate let it through, which is what is timed.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: openloop PATH COUNT REPEATS\n");
        return 2;
    }
    long count = atol(argv[2]), repeats = atol(argv[3]);
    for (long r = 0; r < repeats; r++) {
        long long start = now_ns();
        for (long i = 0; i < count; i++) {
            int fd = open(argv[1], O_RDONLY | O_CLOEXEC);
            if (fd >= 0)
                close(fd);
        }
        printf("%lld\n", (now_ns() - start) / count);
    }
    return 0;
}
