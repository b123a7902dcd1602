/* nvctk-hook: the OCI hooks nvctk puts into GPU containers' specs (prestart,
 * poststop, and the CDI spec's create-symlinks/update-ldcache). All of it is
 * Python, in nvctk.cli.hook; this is the launcher that starts it.
 *
 * One shortcut: `nvctk-hook prestart --served TOKEN` first offers its stdin (the OCI
 * state) to the server nvctk-runtime forked for this create (nvctk/hook/served.py),
 * which runs the same Python prestart without a second interpreter start, and exits
 * with its answer. Only a socket made by root in this hook's runc (the runtime that
 * became runc by exec) or in runc's parent (the runtime that started it) is trusted:
 * SO_PEERCRED names the process that listened. No server, or another one, and the
 * Python prestart runs here as without the flag.
 */
#define NVCTK_PROGRAM "nvctk-hook"
#define NVCTK_MODULE "nvctk.cli.hook"
#define NVCTK_CUSTOM_MAIN
#include "../runtime_shim/launcher.c"

#include <stddef.h>
#include <sys/socket.h>
#include <sys/un.h>

/* nvctk/hook/served.py NAME_PREFIX; nvctk/base/fileio.py MAX_HOOK_STATE (MAX_STATE); nvctk/edits.py SERVED_FLAG */
#define NAME_PREFIX "nvctk-prestart-"
#define MAX_STATE (4 << 20)
#define SERVED_FLAG "--served"

/* pid's parent from /proc/<pid>/status; -1 when unknown */
static long parent_of(long pid)
{
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%ld/status", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    char *p = strstr(buf, "\nPPid:");
    return p ? strtol(p + 6, NULL, 10) : -1;
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The server's socket, connected and checked; -1: run the prestart here. */
static int connect_server(const char *token)
{
    size_t plen = strlen(NAME_PREFIX), tlen = strlen(token);
    struct sockaddr_un a;
    if (tlen == 0 || tlen > 64 || strspn(token, "0123456789abcdef") != tlen)
        return -1;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path + 1, NAME_PREFIX, plen); /* sun_path[0] = 0: abstract */
    memcpy(a.sun_path + 1 + plen, token, tlen);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -1;
    socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + plen + tlen);
    struct ucred cr;
    socklen_t crlen = sizeof cr;
    long runc = (long)getppid();
    if (connect(s, (struct sockaddr *)&a, len) == 0 &&
        getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cr, &crlen) == 0 && cr.uid == 0 &&
        ((long)cr.pid == runc || (long)cr.pid == parent_of(runc)))
        return s;
    close(s);
    return -1;
}

/* Hand stdin to the server and relay its answer: the exit code. */
static int served(int s)
{
    static char buf[65536];
    size_t total = 0;
    for (;;) {
        ssize_t n = read(0, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            fprintf(stderr, "nvctk-hook: prestart: reading the state on stdin: %s\n",
                    strerror(errno));
            return 1;
        }
        if (n == 0)
            break;
        total += (size_t)n;
        if (total > MAX_STATE) {
            fprintf(stderr, "nvctk-hook: prestart: state larger than %d bytes\n", MAX_STATE);
            return 1;
        }
        if (write_all(s, buf, (size_t)n) < 0)
            goto lost;
    }
    shutdown(s, SHUT_WR);
    int code = -1;
    for (;;) {
        ssize_t n = read(s, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        const char *p = buf;
        if (code < 0) {
            code = (unsigned char)buf[0];
            p++;
            n--;
        }
        write_all(2, p, (size_t)n);
    }
    if (code >= 0)
        return code;
lost:
    fprintf(stderr, "nvctk-hook: prestart: nvctk-runtime's prestart server ended without an "
                    "answer\n");
    return 1;
}

int main(int argc, char **argv)
{
    if (argc == 4 && !strcmp(argv[1], "prestart") && !strcmp(argv[2], SERVED_FLAG)) {
        int s = connect_server(argv[3]);
        if (s >= 0)
            return served(s);
    }
    find_exe_dir();
    return launch_python(argc, argv);
}
