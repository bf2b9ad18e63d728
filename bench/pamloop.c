/* pamloop: PAM session timings from one small C process (a PAM client's own start-up, as
 * pamtester's, would dominate what is measured).
 *
 *   pamloop SERVICE USER COUNT
 *       pam_start once, then COUNT times pam_open_session + pam_close_session; prints the
 *       nanoseconds of each pair, one per line.
 *   pamloop --hold SERVICE USER COUNT [ECHO_SOCKET]
 *       opens COUNT sessions, each with a handle of its own, printing the nanoseconds of each
 *       open (plus one line-echo round trip on ECHO_SOCKET when given: the floor of any module
 *       that asks a daemon); then "opened", and closes them all when stdin reaches EOF.
 *
 * Messages the modules send (the grant line) are accepted and dropped. Exit 1 on a PAM error.
 */
#include <security/pam_appl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static int quiet_conv(int n, const struct pam_message **msg, struct pam_response **resp, void *data)
{
    (void)msg;
    (void)data;
    *resp = calloc((size_t)n, sizeof **resp); /* no answers: info and error lines only */
    return *resp ? PAM_SUCCESS : PAM_BUF_ERR;
}

static const struct pam_conv conv = {quiet_conv, NULL};

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int echo(const char *path)
{
    static const char request[] = "{\"v\":1,\"op\":\"session_open\",\"user\":\"x\",\"pid\":1}\n";
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    char reply[256];
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
    int ok = fd >= 0 && connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0 &&
             write(fd, request, sizeof request - 1) == (ssize_t)(sizeof request - 1) &&
             read(fd, reply, sizeof reply) > 0;
    if (fd >= 0)
        close(fd);
    return ok ? 0 : -1;
}

static int pairs(const char *service, const char *user, int count)
{
    pam_handle_t *pamh = NULL;
    int rc = pam_start(service, user, &conv, &pamh);
    for (int i = 0; rc == PAM_SUCCESS && i < count; i++) {
        long long start = now_ns();
        rc = pam_open_session(pamh, 0);
        if (rc == PAM_SUCCESS)
            rc = pam_close_session(pamh, 0);
        printf("%lld\n", now_ns() - start);
    }
    if (rc != PAM_SUCCESS)
        fprintf(stderr, "pamloop: %s\n", pam_strerror(pamh, rc));
    pam_end(pamh, rc);
    return rc == PAM_SUCCESS ? 0 : 1;
}

static int hold(const char *service, const char *user, int count, const char *echo_path)
{
    pam_handle_t **handles = calloc((size_t)count, sizeof *handles);
    int failed = 0, c;
    for (int i = 0; handles && i < count; i++) {
        long long start = now_ns();
        int rc = pam_start(service, user, &conv, &handles[i]);
        if (rc == PAM_SUCCESS)
            rc = pam_open_session(handles[i], 0);
        if (rc == PAM_SUCCESS && echo_path && echo(echo_path) != 0)
            rc = PAM_SYSTEM_ERR;
        if (rc != PAM_SUCCESS) {
            fprintf(stderr, "pamloop: open %d: %s\n", i, pam_strerror(handles[i], rc));
            failed = 1;
        }
        printf("%lld\n", now_ns() - start);
    }
    printf("opened\n");
    fflush(stdout);
    while ((c = getchar()) != EOF)
        ;
    for (int i = 0; handles && i < count; i++) {
        if (handles[i]) {
            pam_close_session(handles[i], 0);
            pam_end(handles[i], PAM_SUCCESS);
        }
    }
    free(handles);
    return failed || !handles;
}

int main(int argc, char **argv)
{
    if (argc == 4)
        return pairs(argv[1], argv[2], atoi(argv[3]));
    if ((argc == 5 || argc == 6) && strcmp(argv[1], "--hold") == 0)
        return hold(argv[2], argv[3], atoi(argv[4]), argc == 6 ? argv[5] : NULL);
    fprintf(stderr, "usage: pamloop SERVICE USER COUNT | pamloop --hold SERVICE USER COUNT [ECHO_SOCKET]\n");
    return 2;
}
