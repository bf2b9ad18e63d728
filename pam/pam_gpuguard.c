/*
 * pam_gpuguard: hand a session its GPUs at login.
 *
 *   session optional pam_gpuguard.so [socket=PATH] [grant=auto|always|never] [quiet] [debug]
 *
 * open_session sends one JSON line to the gpuguard daemon, for example
 *   {"v":1,"op":"session_open","user":"alice","service":"sshd","rhost":"10.0.0.7","tty":"ssh","pid":1234}
 * and reads one JSON line back:
 *   {"v":1,"ok":true,"cuda_visible_devices":"GPU-...","message":"gpuguard: GPU 3 (...) is yours ...",...}
 * A non-empty cuda_visible_devices becomes CUDA_VISIBLE_DEVICES in the session's
 * environment (pam_putenv; sshd, login and su copy it into the user's shell) and the
 * message is shown with pam_info unless `quiet` or PAM_SILENT. close_session sends
 * {"op":"session_close",...} so the daemon can release the grant.
 *
 * The request goes to root's door, root/<name> in the socket's directory (which only root may
 * enter, so no user's flood of the socket can delay a login), or to socket= itself when no
 * daemon serves root's door (one from before it).
 *
 * grant= says whether this stack's sessions may take GPUs: "auto" (the default) leaves it to
 * the daemon ([sessions] in gpuguard.toml: sessions with a terminal, or listed services),
 * "always" and "never" decide for every session of this stack. Sessions that take none still
 * get CUDA_VISIBLE_DEVICES for the GPUs the user holds.
 *
 * The pid is getpid(): sshd runs session modules in its privileged process before the
 * shell exists, so the PAM caller is what identifies the session, at open and at close.
 *
 * This module never blocks or fails a login. Whatever goes wrong (no daemon, a slow
 * daemon, a refusal, a garbled reply) it writes one syslog line and returns PAM_SUCCESS;
 * GPU access then simply stays closed, because the gate denies by default. The whole
 * exchange is bounded by a 2 s deadline. All policy lives in the daemon.
 *
 * At a login with no usable answer the user is told so in one line (UNAVAILABLE), and the
 * GPUs they still hold (the gate keeps grants while the daemon is down) go into
 * CUDA_VISIBLE_DEVICES from the file the daemon keeps for them beside its socket,
 * <socket directory>/held/<uid> (root's, read only when it is a root-owned regular file
 * that nobody else may write).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <syslog.h>
#include <time.h>
#include <unistd.h>

#define PAM_SM_SESSION
#include <security/pam_ext.h>
#include <security/pam_modules.h>
#include <security/pam_modutil.h>

#include "reply.h"

#define DEFAULT_SOCKET "/run/gpuguard/gpuguard.sock"
#define TIMEOUT_MS 2000
#define MAX_REQUEST 8192        /* user, service, rhost and tty: far less in practice */
#define MAX_REPLY (64 * 1024)   /* a session reply is a few hundred bytes */
#define UNAVAILABLE "gpuguard: GPU service not answering: no new GPUs now, held ones stay yours; tell your admin (`sudo gpuguard doctor` says why)"

struct options {
    const char *socket;
    const char *grant;          /* "auto", "always" or "never" */
    int quiet;
    int debug;
};


/* grant=auto|always|never; 0 (an unknown option) for anything else. */
static int parse_grant_option(const char *arg, struct options *opt)
{
    static const char *const values[] = {"auto", "always", "never"};

    if (strncmp(arg, "grant=", 6) != 0)
        return 0;
    for (size_t i = 0; i < sizeof values / sizeof *values; i++) {
        if (strcmp(arg + 6, values[i]) == 0) {
            opt->grant = values[i];
            return 1;
        }
    }
    return 0;
}

static void parse_options(pam_handle_t *pamh, int argc, const char **argv, struct options *opt)
{
    opt->socket = DEFAULT_SOCKET;
    opt->grant = "auto";
    opt->quiet = 0;
    opt->debug = 0;
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "socket=", 7) == 0 && argv[i][7] != '\0')
            opt->socket = argv[i] + 7;
        else if (strcmp(argv[i], "quiet") == 0)
            opt->quiet = 1;
        else if (strcmp(argv[i], "debug") == 0)
            opt->debug = 1;
        else if (parse_grant_option(argv[i], opt))
            continue;
        else
            pam_syslog(pamh, LOG_ERR, "unknown option: %s", argv[i]);
    }
}

/* ---------------------------------------------------------------- request */

struct buf {
    char data[MAX_REQUEST];
    size_t len;
    int overflow;
};

static void put(struct buf *b, const char *s, size_t n)
{
    if (b->overflow || n >= sizeof b->data - b->len) {
        b->overflow = 1;
        return;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static void put_literal(struct buf *b, const char *s)
{
    put(b, s, strlen(s));
}

/* A JSON string: quotes, backslashes and control characters escaped; other bytes
 * (UTF-8) pass through. A missing PAM item is sent as "". */
static void put_string(struct buf *b, const char *s)
{
    put_literal(b, "\"");
    for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
        char esc[8];
        if (*p == '"' || *p == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*p;
            put(b, esc, 2);
        } else if (*p < 0x20 || *p == 0x7f) {
            snprintf(esc, sizeof esc, "\\u%04x", *p);
            put(b, esc, 6);
        } else {
            put(b, (const char *)p, 1);
        }
    }
    put_literal(b, "\"");
}

static void put_field(struct buf *b, const char *name, const char *value)
{
    put_literal(b, ",\"");
    put_literal(b, name);
    put_literal(b, "\":");
    put_string(b, value);
}

static const char *item(pam_handle_t *pamh, int type)
{
    const void *value = NULL;
    if (pam_get_item(pamh, type, &value) != PAM_SUCCESS)
        return NULL;
    return value;
}

/* ---------------------------------------------------------------- socket */

static long ms_left(const struct timespec *deadline)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (deadline->tv_sec - now.tv_sec) * 1000L + (deadline->tv_nsec - now.tv_nsec) / 1000000L;
}

/* Wait until fd is ready for `events` or the deadline passes (errno ETIMEDOUT). */
static int wait_fd(int fd, short events, const struct timespec *deadline)
{
    for (;;) {
        long left = ms_left(deadline);
        if (left <= 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        struct pollfd pfd = {.fd = fd, .events = events};
        int n = poll(&pfd, 1, (int)left);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return -1;
    }
}

/*
 * A connected socket to path, tried again while its listen queue is full (EAGAIN), until
 * the deadline; -1 with errno set otherwise.
 */
static int connect_door(const char *path, const struct timespec *deadline)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    int fd, saved;

    if (strlen(path) >= sizeof addr.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(addr.sun_path, path);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    while (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN) {          /* listen backlog full: try again shortly */
            long left = ms_left(deadline);
            if (left <= 0) {
                errno = ETIMEDOUT;
                goto fail;
            }
            poll(NULL, 0, left < 10 ? (int)left : 10);
            continue;
        }
        if (errno == EINPROGRESS) {     /* not for AF_UNIX today, but cheap to handle */
            int err = 0;
            socklen_t size = sizeof err;
            if (wait_fd(fd, POLLOUT, deadline) < 0)
                goto fail;
            if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &size) < 0)
                goto fail;
            if (err) {
                errno = err;
                goto fail;
            }
            break;
        }
        goto fail;
    }

    /* Only root's daemon may answer: a reply sets the session's environment, and a socket
     * path can be taken by anyone while the daemon is down or the directory is wrong. */
    struct ucred peer;
    socklen_t peer_size = sizeof peer;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &peer_size) < 0)
        goto fail;
    if (peer.uid != 0) {
        errno = EPERM;
        goto fail;
    }
    return fd;

fail:
    saved = errno;
    close(fd);
    errno = saved;
    return -1;
}

/*
 * Root's door for the users' socket `path` (the daemon's root/ directory beside it, which
 * only root may enter, so no user's flood of the users' socket can delay a login) into
 * out[cap]; "" when it does not fit.
 */
static void root_door(const char *path, char *out, size_t cap)
{
    const char *slash = strrchr(path, '/');
    int n = slash ? snprintf(out, cap, "%.*s/root/%s", (int)(slash - path), path, slash + 1)
                  : snprintf(out, cap, "root/%s", path);
    if (n < 0 || (size_t)n >= cap)
        out[0] = '\0';
}

/*
 * Connect (to root's door, or to the users' socket `path` when no daemon serves root's door:
 * one from before it), send `request`, read one reply line into reply[cap] (NUL-terminated).
 * Everything shares one deadline. On failure returns -1 with errno set and *step
 * naming what failed.
 */
static int exchange(const char *path, const char *request, size_t len,
                    char *reply, size_t cap, const char **step)
{
    char door[sizeof ((struct sockaddr_un *)0)->sun_path];
    struct timespec deadline;
    size_t done = 0;
    int fd, saved;

    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += TIMEOUT_MS / 1000;
    deadline.tv_nsec += (TIMEOUT_MS % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }

    *step = "connect";
    root_door(path, door, sizeof door);
    fd = door[0] ? connect_door(door, &deadline) : -1;
    if (fd < 0)
        fd = connect_door(path, &deadline);
    if (fd < 0)
        return -1;

    *step = "send";
    while (done < len) {
        ssize_t n = send(fd, request + done, len - done, MSG_NOSIGNAL);
        if (n > 0) {
            done += (size_t)n;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (wait_fd(fd, POLLOUT, &deadline) < 0)
                goto fail;
        } else if (n < 0 && errno != EINTR) {
            goto fail;
        }
    }

    *step = "receive";
    done = 0;
    for (;;) {
        ssize_t n;
        if (done >= cap - 1) {
            errno = EMSGSIZE;
            goto fail;
        }
        n = recv(fd, reply + done, cap - 1 - done, 0);
        if (n > 0) {
            int end = memchr(reply + done, '\n', (size_t)n) != NULL;
            done += (size_t)n;
            if (end)
                break;
        } else if (n == 0) {
            break;                      /* EOF: the daemon closed after its line */
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (wait_fd(fd, POLLIN, &deadline) < 0)
                goto fail;
        } else if (errno != EINTR) {
            goto fail;
        }
    }
    reply[done] = '\0';
    if (done == 0) {
        errno = ECONNRESET;
        goto fail;
    }
    close(fd);
    return 0;

fail:
    saved = errno;
    close(fd);
    errno = saved;
    return -1;
}

/* ---------------------------------------------------------------- PAM */

/* Build and send one request; parse the reply into r. Logs and returns -1 on failure. */
static int ask_daemon(pam_handle_t *pamh, const struct options *opt, const char *op,
                      int with_details, struct reply *r)
{
    const char *user = item(pamh, PAM_USER);
    const char *service = item(pamh, PAM_SERVICE);
    const char *step;
    struct buf request = {.len = 0};
    char *answer;
    char pid[32];
    int rc = -1;

    if (!user || !*user) {
        pam_syslog(pamh, LOG_WARNING, "gpuguard %s skipped: no user name", op);
        return -1;
    }
    snprintf(pid, sizeof pid, "%ld", (long)getpid());
    put_literal(&request, "{\"v\":1");
    put_field(&request, "op", op);
    put_field(&request, "user", user);
    put_field(&request, "service", service);
    if (with_details) {
        put_field(&request, "rhost", item(pamh, PAM_RHOST));
        put_field(&request, "tty", item(pamh, PAM_TTY));
        put_field(&request, "grant", opt->grant);
    }
    put_literal(&request, ",\"pid\":");
    put_literal(&request, pid);
    put_literal(&request, "}\n");
    if (request.overflow) {
        pam_syslog(pamh, LOG_WARNING, "gpuguard %s for %s skipped: request too large", op, user);
        return -1;
    }
    if (opt->debug)
        pam_syslog(pamh, LOG_DEBUG, "gpuguard request to %s: %.*s", opt->socket,
                   (int)request.len - 1, request.data);

    answer = malloc(MAX_REPLY);
    if (!answer) {
        pam_syslog(pamh, LOG_WARNING, "gpuguard %s for %s: out of memory", op, user);
        return -1;
    }
    if (exchange(opt->socket, request.data, request.len, answer, MAX_REPLY, &step) < 0) {
        pam_syslog(pamh, LOG_WARNING, "gpuguard %s for %s: daemon not reachable at %s (%s: %m); "
                   "no GPUs for this session", op, user, opt->socket, step);
    } else if (gg_parse_reply(answer, r) < 0) {
        pam_syslog(pamh, LOG_WARNING, "gpuguard %s for %s: unreadable reply from daemon", op, user);
    } else if (!r->ok) {
        gg_sanitize(r->error);
        pam_syslog(pamh, LOG_WARNING, "gpuguard %s for %s refused: %s", op, user,
                   r->error[0] ? r->error : "no reason given");
    } else {
        if (opt->debug)
            pam_syslog(pamh, LOG_DEBUG, "gpuguard %s for %s: CUDA_VISIBLE_DEVICES=\"%s\"",
                       op, user, r->cuda);
        rc = 0;
    }
    free(answer);
    return rc;
}

/*
 * The GPUs the user held when the daemon last wrote <socket directory>/held/<uid> into
 * out[cap]; "" when there is no such file or it is not to be trusted.
 */
static void held_devices(pam_handle_t *pamh, const struct options *opt, char *out, size_t cap)
{
    const char *user = item(pamh, PAM_USER);
    const char *slash = strrchr(opt->socket, '/');
    const struct passwd *pw;
    struct stat st;
    char path[4096];
    ssize_t n;
    int fd;

    out[0] = '\0';
    if (!user || !slash || !(pw = pam_modutil_getpwnam(pamh, user)))
        return;
    if (snprintf(path, sizeof path, "%.*s/held/%lu", (int)(slash - opt->socket), opt->socket,
                 (unsigned long)pw->pw_uid) >= (int)sizeof path)
        return;
    fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == 0 && !(st.st_mode & 022)) {
        n = read(fd, out, cap - 1);
        out[n > 0 ? n : 0] = '\0';
        out[strcspn(out, "\n")] = '\0';
        if (!gg_valid_devices(out)) {
            pam_syslog(pamh, LOG_WARNING, "gpuguard: ignoring malformed %s", path);
            out[0] = '\0';
        }
    }
    close(fd);
}

static void set_devices(pam_handle_t *pamh, const char *devices)
{
    char env[sizeof ((struct reply *)0)->cuda + 32];

    if (!devices[0])
        return;
    snprintf(env, sizeof env, "CUDA_VISIBLE_DEVICES=%s", devices);
    if (pam_putenv(pamh, env) != PAM_SUCCESS)
        pam_syslog(pamh, LOG_WARNING, "gpuguard: pam_putenv failed");
}

PAM_EXTERN int pam_sm_open_session(pam_handle_t *pamh, int flags, int argc, const char **argv)
{
    struct options opt;
    struct reply *r;

    parse_options(pamh, argc, argv, &opt);
    r = calloc(1, sizeof *r);
    if (!r)
        return PAM_SUCCESS;
    if (ask_daemon(pamh, &opt, "session_open", 1, r) == 0) {
        if (r->cuda_truncated || !gg_valid_devices(r->cuda))
            pam_syslog(pamh, LOG_WARNING, "gpuguard: ignoring malformed cuda_visible_devices from daemon");
        else
            set_devices(pamh, r->cuda);
        gg_sanitize(r->message);
        if (r->message[0] && !opt.quiet && !(flags & PAM_SILENT))
            pam_info(pamh, "%s", r->message);
    } else if (item(pamh, PAM_USER) && *item(pamh, PAM_USER)) {
        held_devices(pamh, &opt, r->cuda, sizeof r->cuda);  /* the reply's buffer: unused now */
        set_devices(pamh, r->cuda);
        if (!opt.quiet && !(flags & PAM_SILENT))
            pam_info(pamh, "%s", UNAVAILABLE);
    }
    free(r);
    return PAM_SUCCESS;
}

PAM_EXTERN int pam_sm_close_session(pam_handle_t *pamh, int flags, int argc, const char **argv)
{
    struct options opt;
    struct reply *r;

    (void)flags;
    parse_options(pamh, argc, argv, &opt);
    r = calloc(1, sizeof *r);
    if (r)
        ask_daemon(pamh, &opt, "session_close", 0, r);
    free(r);
    return PAM_SUCCESS;
}
