/* The launcher template: nvctk's three executables are this file compiled with
 * the Python module whose main() they run (cli/nvctk.c, hooks/nvctk-hook.c,
 * runtime_shim/nvctk-runtime.c). One ELF works unchanged in every layout (a
 * venv, an editable install, a wheel in a venv or under a prefix, pip --target,
 * the Debian package): it finds the interpreter and the package from its own
 * location, then execs
 *
 *     python3 -I -S -c BOOT PATHS MODULE ARGV0 ARGS...
 *
 * -I -S: no environment variables, no user site, no site module and no .pth
 * processing (site alone costs twice a bare interpreter start); PATHS are the
 * directories that hold nvctk and its dependencies, appended after the stdlib.
 *
 * The layouts, from the executable's directory BIN and PREFIX = BIN/..:
 *   PREFIX/lib/nvctk/python                          the Debian package
 *   PREFIX/lib/python3.N/{site,dist}-packages        venv, pip --prefix, /usr/local
 *   PREFIX                                           pip --target (BIN = PREFIX/bin)
 * The first that holds nvctk/__init__.py is the one. An editable install holds
 * instead a path file __editable__.nvctk-*.pth whose lines are directories
 * (site's documented .pth format): those come first, the dependencies after.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef NVCTK_MODULE
#error "define NVCTK_MODULE, the Python module whose main() this executable runs"
#endif

#define PATHS_MAX 8192

static const char BOOT[] =
    "import sys;a=sys.argv;sys.path+=a[1].split('\\n');m=a[2];del a[:3];"
    "__import__(m);sys.exit(sys.modules[m].main())";

/* the executable's own directory (symlinks resolved), or "" */
static char exe_dir[PATH_MAX];

static int is_file(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int join(char *out, size_t size, const char *a, const char *b)
{
    int n = snprintf(out, size, "%s/%s", a, b);
    return n > 0 && (size_t)n < size;
}

/* append DIR (and a newline before it unless first) to PATHS */
static int add_path(char *paths, const char *dir)
{
    size_t len = strlen(paths), add = strlen(dir);
    if (!add || strchr(dir, '\n') || len + add + 2 > PATHS_MAX)
        return 0;
    if (len)
        paths[len++] = '\n';
    memcpy(paths + len, dir, add + 1);
    return 1;
}

/* An editable install's path file in DIR: its directory lines, then DIR. */
static int editable(const char *dir, char *paths)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char pth[PATH_MAX], buf[4096];
    int found = 0;
    if (!d)
        return 0;
    while (!found && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (strncmp(e->d_name, "__editable__.nvctk-", 19) || n < 4 ||
            strcmp(e->d_name + n - 4, ".pth") || !join(pth, sizeof pth, dir, e->d_name))
            continue;
        int fd = open(pth, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
        if (fd < 0)
            continue;
        ssize_t got = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (got <= 0)
            continue;
        buf[got] = 0;
        for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
            line[strcspn(line, "\r")] = 0;
            if (line[0] == '/') /* not a comment, not an `import` line */
                found |= add_path(paths, line);
        }
    }
    closedir(d);
    return found && add_path(paths, dir);
}

static int holds_nvctk(const char *dir, char *paths)
{
    char init[PATH_MAX];
    if (join(init, sizeof init, dir, "nvctk/__init__.py") && is_file(init))
        return add_path(paths, dir);
    return editable(dir, paths);
}

static int find_package(char *paths)
{
    char prefix[PATH_MAX], lib[PATH_MAX], cand[PATH_MAX];
    snprintf(prefix, sizeof prefix, "%s", exe_dir);
    char *slash = strrchr(prefix, '/');
    if (!slash)
        return 0;
    *slash = 0;
    if (!prefix[0])
        strcpy(prefix, "/");
    if (join(cand, sizeof cand, prefix, "lib/nvctk/python") && holds_nvctk(cand, paths))
        return 1;
    if (join(lib, sizeof lib, prefix, "lib")) {
        DIR *d = opendir(lib);
        struct dirent *e;
        int found = 0;
        while (d && !found && (e = readdir(d))) {
            if (strncmp(e->d_name, "python3", 7))
                continue;
            static const char *const sub[] = {"site-packages", "dist-packages"};
            for (int i = 0; i < 2 && !found; i++) {
                char rel[NAME_MAX + 32];
                snprintf(rel, sizeof rel, "%s/%s", e->d_name, sub[i]);
                found = join(cand, sizeof cand, lib, rel) && holds_nvctk(cand, paths);
            }
        }
        if (d)
            closedir(d);
        if (found)
            return 1;
    }
    return holds_nvctk(prefix, paths);
}

/* Run NVCTK_MODULE's main() with this process's arguments; returns only on failure. */
static int launch_python(int argc, char **argv)
{
    static char paths[PATHS_MAX];
    char python[PATH_MAX];
    const char *name = argv[0] && argv[0][0] ? argv[0] : NVCTK_PROGRAM;
    if (!exe_dir[0] || !find_package(paths)) {
        fprintf(stderr, "%s: cannot find the nvctk Python package near %s\n", NVCTK_PROGRAM,
                exe_dir[0] ? exe_dir : "(unknown: /proc/self/exe unreadable)");
        return 1;
    }
    /* a venv's interpreter sits beside its scripts; the Debian package's is /usr/bin's */
    if (!join(python, sizeof python, exe_dir, "python3") || access(python, X_OK))
        strcpy(python, "/usr/bin/python3");
    char **args = calloc((size_t)argc + 8, sizeof *args);
    if (!args)
        return 1;
    int n = 0;
    args[n++] = python;
    args[n++] = "-I";
    args[n++] = "-S";
    args[n++] = "-c";
    args[n++] = (char *)BOOT;
    args[n++] = paths;
    args[n++] = NVCTK_MODULE;
    args[n++] = (char *)name;
    for (int i = 1; i < argc; i++)
        args[n++] = argv[i];
    args[n] = NULL;
    execv(python, args);
    fprintf(stderr, "%s: cannot run %s: %s\n", NVCTK_PROGRAM, python, strerror(errno));
    free(args);
    return 1;
}

static void find_exe_dir(void)
{
    ssize_t n = readlink("/proc/self/exe", exe_dir, sizeof exe_dir - 1);
    if (n <= 0 || n >= (ssize_t)sizeof exe_dir - 1) {
        exe_dir[0] = 0;
        return;
    }
    exe_dir[n] = 0;
    char *slash = strrchr(exe_dir, '/');
    if (slash)
        *slash = 0;
    if (!exe_dir[0])
        strcpy(exe_dir, "/");
}

#ifndef NVCTK_CUSTOM_MAIN
int main(int argc, char **argv)
{
    find_exe_dir();
    return launch_python(argc, argv);
}
#endif
