/* pamloop: time PAM session open+close in one process, without a PAM client's own start-up.
 *
 *   pamloop SERVICE USER COUNT
 *
 * pam_start once, then COUNT times pam_open_session + pam_close_session, printing the
 * nanoseconds each pair took, one per line (bench/pam_rows.py takes medians). Messages the
 * modules send (the grant line) are accepted and dropped. Exit 1 on a PAM error.
 */
#include <security/pam_appl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int quiet_conv(int n, const struct pam_message **msg, struct pam_response **resp, void *data)
{
    (void)msg;
    (void)data;
    *resp = calloc((size_t)n, sizeof **resp); /* no answers: info and error lines only */
    return *resp ? PAM_SUCCESS : PAM_BUF_ERR;
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: pamloop SERVICE USER COUNT\n");
        return 2;
    }
    int count = atoi(argv[3]);
    struct pam_conv conv = {quiet_conv, NULL};
    pam_handle_t *pamh = NULL;
    int rc = pam_start(argv[1], argv[2], &conv, &pamh);
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
