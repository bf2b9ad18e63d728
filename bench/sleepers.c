/* sleepers: make a host busy with N sleeping processes, cheaply (forks of one small program).
 *
 *   sleepers N
 *
 * Forks N children that sleep until this process ends (PR_SET_PDEATHSIG), prints "ready", and
 * exits when stdin reaches EOF, taking the children with it. Exit 1 if a fork fails.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: sleepers N\n");
        return 2;
    }
    pid_t parent = getpid();
    long n = atol(argv[1]);
    for (long i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("sleepers: fork");
            return 1;
        }
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) /* the parent is gone already */
                _exit(0);
            for (;;)
                pause();
        }
    }
    printf("ready\n");
    fflush(stdout);
    while (getchar() != EOF)
        ;
    return 0;
}
