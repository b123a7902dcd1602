/* nvctk-runtime: a drop-in for runc.
 *
 * containerd and dockerd run it for every start/state/kill/delete of every
 * container on the node, so everything but `create` and `run` is exec'd into
 * the low-level runtime from here, without starting Python. Which runtime the
 * config names is what Python's config loader last read from that very file:
 * it leaves the answer in a passthrough cache (nvctk/runtime/passthrough.py), stamped
 * with the config file's identity (device, inode, size, mtime, ctime), or with
 * "absent" when there is none (the defaults are the loader's, not this file's). Any
 * doubt — no cache, another stamp, a file not root's, not root, no runtime
 * found — and the Python runtime decides (and writes the cache for next time).
 * This file reads no TOML: nvctk has one config loader.
 */
#define NVCTK_PROGRAM "nvctk-runtime"
#define NVCTK_MODULE "nvctk.cli.runtime"
#define NVCTK_CUSTOM_MAIN
#include "launcher.c"

#include <stdint.h>

#define DEFAULT_CONFIG "/etc/nvctk/config.toml"
#define DEFAULT_CACHE_DIR "/run/nvctk/passthrough"
#define CACHE_MAGIC "nvctk-passthrough 1\n"
#define CACHE_MAX 65536 /* nvctk/runtime/passthrough.py MAX_ENTRY + 1 */
/* set on the runtime it execs: a copy of nvctk-runtime named like the runtime (two
 * copies, each first on PATH for the other) must not exec back and forth forever */
#define HOP_VAR "NVCTK_RUNTIME_HOP"

/* runc's global flags that take a value (nvctk/oci/runc_argv.py GLOBAL_VALUE_FLAGS) */
static int global_value_flag(const char *tok)
{
    static const char *const names[] = {"log", "log-format", "root", "criu", "rootless"};
    const char *name = tok + (tok[1] == '-' ? 2 : 1);
    if (strchr(name, '='))
        return 0;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!strcmp(name, names[i]))
            return 1;
    return 0;
}

/* Whether runc's subcommand is create or run: global flags end at the first
 * token that is not one, as in Go's flag package, or after a "--" (which Go drops:
 * the token after it is the subcommand); nvctk/oci/runc_argv.py parse does the same. */
static int creates(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *tok = argv[i];
        if (!strcmp(tok, "--")) {
            tok = i + 1 < argc ? argv[i + 1] : "";
            return !strcmp(tok, "create") || !strcmp(tok, "run");
        }
        if (strlen(tok) < 2 || tok[0] != '-')
            return !strcmp(tok, "create") || !strcmp(tok, "run");
        if (global_value_flag(tok))
            i++;
    }
    return 0;
}

static uint64_t fnv1a64(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ULL;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ULL;
    return h;
}

/* The cache entry for CONFIG into BUF, checked: root's, nobody else may write it
 * or its directory, not a link, small. The runtimes list follows its header. */
static char *read_cache(const char *config, char *buf)
{
    const char *dir = getenv("NVCTK_PASSTHROUGH_CACHE");
    char name[32];
    struct stat st;
    if (!dir || !dir[0])
        dir = DEFAULT_CACHE_DIR;
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0)
        return NULL;
    if (fstat(dfd, &st) || st.st_uid != 0 || (st.st_mode & 022)) {
        close(dfd);
        return NULL;
    }
    snprintf(name, sizeof name, "%016llx", (unsigned long long)fnv1a64(config));
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    close(dfd);
    if (fd < 0)
        return NULL;
    ssize_t n = -1;
    if (!fstat(fd, &st) && S_ISREG(st.st_mode) && st.st_uid == 0 && !(st.st_mode & 022) &&
        st.st_size < CACHE_MAX)
        n = read(fd, buf, CACHE_MAX - 1);
    close(fd);
    if (n <= 0)
        return NULL;
    buf[n] = 0;
    return buf;
}

/* The runtimes (newline-separated, in place) if the cache holds CONFIG as it is now:
 * the file's identity, or "absent" when there is no file (the loader's defaults). */
static char *cached_runtimes(const char *config, char *buf)
{
    struct stat st;
    char stamp[PATH_MAX + 160];
    size_t magic = sizeof CACHE_MAGIC - 1;
    int n;
    if (config[0] != '/')
        return NULL;
    if (stat(config, &st) == 0) {
        if (!S_ISREG(st.st_mode))
            return NULL;
        n = snprintf(stamp, sizeof stamp, "%s\n%llu %llu %lld %lld %ld %lld %ld\n", config,
                     (unsigned long long)st.st_dev, (unsigned long long)st.st_ino,
                     (long long)st.st_size, (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec,
                     (long long)st.st_ctim.tv_sec, st.st_ctim.tv_nsec);
    } else if (errno == ENOENT) {
        n = snprintf(stamp, sizeof stamp, "%s\nabsent\n", config);
    } else {
        return NULL;
    }
    if (!read_cache(config, buf))
        return NULL;
    if (n <= 0 || (size_t)n >= sizeof stamp || strncmp(buf, CACHE_MAGIC, magic) ||
        strncmp(buf + magic, stamp, (size_t)n))
        return NULL;
    return buf + magic + (size_t)n;
}

static int is_runnable(const char *path, const struct stat *self)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0 &&
           !(st.st_dev == self->st_dev && st.st_ino == self->st_ino); /* never ourselves */
}

/* The first runtime that exists and is not this executable (runc_argv.find_runtime). */
static int find_runtime(char *runtimes, char *out, size_t size)
{
    struct stat self;
    const char *path = getenv("PATH");
    if (stat("/proc/self/exe", &self))
        return 0;
    if (!path)
        path = "/bin:/usr/bin"; /* Python's os.defpath */
    for (char *rt = strtok(runtimes, "\n"); rt; rt = strtok(NULL, "\n")) {
        if (strchr(rt, '/')) {
            if ((size_t)snprintf(out, size, "%s", rt) < size && is_runnable(out, &self))
                return 1;
            continue;
        }
        for (const char *p = path;; p++) {
            size_t len = strcspn(p, ":");
            int n = snprintf(out, size, "%.*s/%s", (int)len, len ? p : ".", rt);
            if (n > 0 && (size_t)n < size && is_runnable(out, &self))
                return 1;
            p += len;
            if (!*p)
                break;
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 1) /* argv[0] is overwritten below: never the NULL that ends argv */
        return 1;
    if (getenv(HOP_VAR)) {
        fprintf(stderr, "nvctk-runtime: started by nvctk-runtime: the low-level runtime it "
                        "found is a copy of nvctk-runtime (check the config's runtimes and "
                        "PATH); refusing to run itself in a loop\n");
        return 1;
    }
    if (!creates(argc, argv) && geteuid() == 0) {
        static char buf[CACHE_MAX];
        char runtime[PATH_MAX];
        const char *config = getenv("NVCTK_CONFIG");
        char *runtimes;
        if (!config || !config[0])
            config = DEFAULT_CONFIG;
        runtimes = cached_runtimes(config, buf);
        if (runtimes && find_runtime(runtimes, runtime, sizeof runtime)) {
            argv[0] = runtime;
            setenv(HOP_VAR, "1", 1);
            execv(runtime, argv);
            unsetenv(HOP_VAR);
        }
    }
    find_exe_dir(); /* only Python's start needs it: not on the passthrough's path */
    return launch_python(argc, argv);
}
