/* Configuration: the value grammar, the environment and the limits file.
 * No driver calls here; unit-tested through build/vgpu_parse. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vgpu.h"

extern char **environ;

int vgpu_log_level = VGPU_LOG_WARN;

void vgpu_log(int level, const char *fmt, ...) {
    if (level > vgpu_log_level) return;
    static const char *names[] = {"", "error", "warning", "info", "debug"};
    char buf[1024];
    int n = snprintf(buf, sizeof buf, "libvgpu[%d]: %s: ", (int)getpid(), names[level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof buf - (unsigned)n - 1, fmt, ap);
    va_end(ap);
    if (m < 0) m = 0;
    size_t len = (size_t)n + (size_t)m;
    if (len > sizeof buf - 2) len = sizeof buf - 2;
    buf[len++] = '\n';
    ssize_t w = write(2, buf, len);
    (void)w;
}

static int is_blank(char c) { return c == ' ' || c == '\t'; }

/* [ \t]* ( D+ ( '.' D* )? | '.' D+ ) unit? ( 'b' | unit 'ib' )? [ \t]*
 * unit = k|m|g|t (case-insensitive, powers of 1024); decimals need a unit;
 * the result is floored to a whole byte and must stay below 2^63. */
int vgpu_parse_memory(const char *s, uint64_t *out) {
    if (!s) return -1;
    while (is_blank(*s)) s++;
    unsigned __int128 ip = 0, fp = 0, fscale = 1;
    int nd = 0, nf = 0, dot = 0;
    while (*s >= '0' && *s <= '9') {
        ip = ip * 10 + (unsigned)(*s++ - '0');
        if (++nd > 20) return -1;
    }
    if (*s == '.') {
        dot = 1;
        s++;
        while (*s >= '0' && *s <= '9') {
            fp = fp * 10 + (unsigned)(*s++ - '0');
            fscale *= 10;
            if (++nf > 18) return -1;
        }
    }
    if (nd == 0 && nf == 0) return -1;
    unsigned shift = 0;
    int unit = 1;
    switch (*s) {
    case 'k': case 'K': shift = 10; break;
    case 'm': case 'M': shift = 20; break;
    case 'g': case 'G': shift = 30; break;
    case 't': case 'T': shift = 40; break;
    default: unit = 0;
    }
    if (unit) s++;
    if (dot && !unit) return -1;
    if (unit && (*s == 'i' || *s == 'I')) {
        s++;
        if (*s != 'b' && *s != 'B') return -1;
        s++;
    } else if (*s == 'b' || *s == 'B') {
        s++;
    }
    while (is_blank(*s)) s++;
    if (*s) return -1;
    unsigned __int128 mult = (unsigned __int128)1 << shift;
    unsigned __int128 v = ip * mult + (fp * mult) / fscale;
    if (v >= ((unsigned __int128)1 << 63)) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* [ \t]* D{1,3} [ \t]*, 0..100 */
int vgpu_parse_sm(const char *s, unsigned *out) {
    if (!s) return -1;
    while (is_blank(*s)) s++;
    unsigned v = 0;
    int nd = 0;
    while (*s >= '0' && *s <= '9') {
        v = v * 10 + (unsigned)(*s++ - '0');
        if (++nd > 3) return -1;
    }
    while (is_blank(*s)) s++;
    if (nd == 0 || *s || v > 100) return -1;
    *out = v;
    return 0;
}

/* "_<digits>" suffix → index; -1 if malformed. */
static long parse_index(const char *s) {
    if (*s != '_') return -1;
    s++;
    long v = 0;
    int nd = 0;
    while (*s >= '0' && *s <= '9') {
        v = v * 10 + (*s++ - '0');
        if (++nd > 6) return -1;
    }
    if (nd == 0 || *s) return -1;
    return v;
}

#define K_MEM "CUDA_DEVICE_MEMORY_LIMIT"
#define K_SM "CUDA_DEVICE_SM_LIMIT"
#define K_CACHE "CUDA_DEVICE_MEMORY_SHARED_CACHE"
#define K_RESERVE "NVCTK_VGPU_CONTEXT_RESERVE"
#define K_UUID "NVCTK_VGPU_UUID" /* _<i>: the container's GPU i (limits file only; never read from the env) */

int vgpu_src_set(struct vgpu_src *src, const char *key, const char *value, const char *what,
                 char *err, unsigned errlen) {
    size_t lm = strlen(K_MEM), ls = strlen(K_SM);
    if (strcmp(key, K_CACHE) == 0) {
        if (value[0] != '/' || strlen(value) >= sizeof src->cache) {
            snprintf(err, errlen, "%s%s=\"%s\": not an absolute path", what, key, value);
            return -1;
        }
        strcpy(src->cache, value);
        src->cache_set = 1;
        return 0;
    }
    if (strcmp(key, K_RESERVE) == 0) {
        if (vgpu_parse_memory(value, &src->reserve) != 0) {
            snprintf(err, errlen, "%s%s=\"%s\": not a memory size", what, key, value);
            return -1;
        }
        src->reserve_set = 1;
        return 0;
    }
    if (strncmp(key, K_MEM, lm) == 0) {
        uint64_t v;
        long i = key[lm] ? parse_index(key + lm) : -2;
        if (i == -1) {
            snprintf(err, errlen, "%s%s: not CUDA_DEVICE_MEMORY_LIMIT or CUDA_DEVICE_MEMORY_LIMIT_<index>", what, key);
            return -1;
        }
        if (vgpu_parse_memory(value, &v) != 0) {
            snprintf(err, errlen,
                     "%s%s=\"%s\": not a memory size (bytes, or a number with k/m/g/t, e.g. 4096m, 1.5g)",
                     what, key, value);
            return -1;
        }
        if (i == -2) {
            src->mem_all = v;
            src->mem_all_set = 1;
        } else if (i < VGPU_MAX_DEV) {
            src->mem[i] = v;
            src->mem_set |= 1u << i;
        } else {
            vgpu_log(VGPU_LOG_WARN, "%s%s: no such GPU index, ignored", what, key);
        }
        return 0;
    }
    if (strncmp(key, K_SM, ls) == 0) {
        unsigned v;
        long i = key[ls] ? parse_index(key + ls) : -2;
        if (i == -1) {
            snprintf(err, errlen, "%s%s: not CUDA_DEVICE_SM_LIMIT or CUDA_DEVICE_SM_LIMIT_<index>", what, key);
            return -1;
        }
        if (vgpu_parse_sm(value, &v) != 0) {
            snprintf(err, errlen, "%s%s=\"%s\": not a percentage 0-100 (0 = no limit)", what, key,
                     value);
            return -1;
        }
        if (i == -2) {
            src->sm_all = v;
            src->sm_all_set = 1;
        } else if (i < VGPU_MAX_DEV) {
            src->sm[i] = v;
            src->sm_set |= 1u << i;
        } else {
            vgpu_log(VGPU_LOG_WARN, "%s%s: no such GPU index, ignored", what, key);
        }
        return 0;
    }
    if (strncmp(key, K_UUID, strlen(K_UUID)) == 0 && *what) {
        long i = parse_index(key + strlen(K_UUID));
        size_t n = strlen(value), ok = n > 0 && n < sizeof src->uuid[0];
        for (size_t k = 0; ok && k < n; k++)
            ok = (value[k] >= '0' && value[k] <= '9') || (value[k] >= 'a' && value[k] <= 'z') ||
                 (value[k] >= 'A' && value[k] <= 'Z') || value[k] == '-';
        if (i < 0 || !ok) {
            snprintf(err, errlen, "%s%s=\"%s\": not NVCTK_VGPU_UUID_<index>=<GPU UUID>", what, key, value);
            return -1;
        }
        if (i < VGPU_MAX_DEV) {
            strcpy(src->uuid[i], value);
            src->uuid_set |= 1u << i;
        }
        return 0;
    }
    return 1; /* not ours */
}

static int load_env(struct vgpu_src *src, char *err, unsigned errlen) {
    for (char **e = environ; e && *e; e++) {
        const char *eq = strchr(*e, '=');
        if (!eq || strncmp(*e, "CUDA_DEVICE_", 12) != 0) {
            if (eq && strncmp(*e, K_RESERVE "=", strlen(K_RESERVE) + 1) == 0) {
                if (vgpu_src_set(src, K_RESERVE, eq + 1, "", err, errlen) < 0) return -1;
            }
            continue;
        }
        char key[128];
        size_t kl = (size_t)(eq - *e);
        if (kl >= sizeof key) continue;
        memcpy(key, *e, kl);
        key[kl] = 0;
        if (vgpu_src_set(src, key, eq + 1, "", err, errlen) < 0) return -1;
    }
    return 0;
}

/* 1 loaded, 0 absent, -1 error */
static int load_file(const char *path, struct vgpu_src *src, char *err, unsigned errlen) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return 0;
        snprintf(err, errlen, "limits file %s: %s", path, strerror(errno));
        return -1;
    }
    char buf[16384];
    size_t len = 0;
    for (;;) {
        ssize_t r = read(fd, buf + len, sizeof buf - 1 - len);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            snprintf(err, errlen, "limits file %s: %s", path, strerror(errno));
            close(fd);
            return -1;
        }
        if (r == 0) break;
        len += (size_t)r;
        if (len == sizeof buf - 1) {
            snprintf(err, errlen, "limits file %s: too large", path);
            close(fd);
            return -1;
        }
    }
    close(fd);
    buf[len] = 0;
    char what[4200];
    snprintf(what, sizeof what, "limits file %s: ", path);
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        while (is_blank(*line)) line++;
        size_t l = strlen(line);
        while (l && (is_blank(line[l - 1]) || line[l - 1] == '\r')) line[--l] = 0;
        if (!*line || *line == '#') continue;
        char *eq = strchr(line, '=');
        if (!eq) {
            snprintf(err, errlen, "%sline \"%s\": not KEY=VALUE", what, line);
            return -1;
        }
        *eq = 0;
        int r = vgpu_src_set(src, line, eq + 1, what, err, errlen);
        if (r < 0) return -1;
        if (r > 0) {
            snprintf(err, errlen, "%sunknown key %s", what, line);
            return -1;
        }
    }
    return 1;
}

static uint64_t mem_of(const struct vgpu_src *s, int i) {
    return (s->mem_set >> i) & 1 ? s->mem[i] : s->mem_all;
}
static unsigned sm_of(const struct vgpu_src *s, int i) {
    return (s->sm_set >> i) & 1 ? s->sm[i] : s->sm_all;
}
static uint64_t stricter64(uint64_t a, uint64_t b) {
    if (!a) return b;
    if (!b) return a;
    return a < b ? a : b;
}

int vgpu_load_config(struct vgpu_config *cfg, char *err, unsigned errlen) {
    memset(cfg, 0, sizeof *cfg);
    const char *ll = getenv("LIBVGPU_LOG_LEVEL");
    if (ll && *ll) {
        static const char *names[] = {"off", "error", "warn", "info", "debug"};
        int lv = -1;
        for (int i = 0; i < 5; i++)
            if (strcasecmp(ll, names[i]) == 0 || (ll[0] == '0' + i && !ll[1])) lv = i;
        if (lv >= 0) vgpu_log_level = lv;
        else vgpu_log(VGPU_LOG_WARN, "LIBVGPU_LOG_LEVEL=\"%s\" unknown (off|error|warn|info|debug)", ll);
    }
    cfg->log_level = vgpu_log_level;

    static struct vgpu_src env, file;
    memset(&env, 0, sizeof env);
    memset(&file, 0, sizeof file);
    if (load_env(&env, err, errlen) < 0) return -1;

    /* The fixed path wins; the override is honoured only where it is absent
     * (tests on the host), so a process inside an nvctk container cannot
     * point libvgpu at a file of its own. */
    int have_file = load_file(VGPU_LIMITS_FILE, &file, err, errlen);
    if (have_file < 0) return -1;
    if (have_file) {
        snprintf(cfg->limits_file, sizeof cfg->limits_file, "%s", VGPU_LIMITS_FILE);
    } else {
        const char *ov = getenv("NVCTK_VGPU_LIMITS_FILE");
        if (ov && *ov) {
            have_file = load_file(ov, &file, err, errlen);
            if (have_file < 0) return -1;
            if (have_file) snprintf(cfg->limits_file, sizeof cfg->limits_file, "%s", ov);
        }
    }

    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        cfg->mem[i] = stricter64(mem_of(&env, i), mem_of(&file, i));
        unsigned a = sm_of(&env, i), b = sm_of(&file, i);
        cfg->sm[i] = (unsigned)stricter64(a, b);
        cfg->mem_any = stricter64(cfg->mem_any, cfg->mem[i]);
        cfg->sm_any = (unsigned)stricter64(cfg->sm_any, cfg->sm[i]);
        if (cfg->mem[i] || cfg->sm[i]) cfg->active = 1;
    }
    /* With a limits file its reserve (the default where it has no line) is a
     * floor the environment can only raise: a process must not set itself a
     * reserve of 0 and so hold the context's real memory uncharged. */
    cfg->reserve = VGPU_DEFAULT_RESERVE;
    if (file.reserve_set) cfg->reserve = file.reserve;
    if (env.reserve_set && (!have_file || env.reserve > cfg->reserve))
        cfg->reserve = env.reserve; /* stricter = larger */

    if (have_file) {
        memcpy(cfg->uuid, file.uuid, sizeof cfg->uuid);
        cfg->uuid_set = file.uuid_set;
        if (file.cache_set) {
            snprintf(cfg->cache, sizeof cfg->cache, "%s", file.cache);
        } else {
            /* beside the limits file */
            snprintf(cfg->cache, sizeof cfg->cache, "%s", cfg->limits_file);
            char *slash = strrchr(cfg->cache, '/');
            if (slash) snprintf(slash + 1, sizeof cfg->cache - (size_t)(slash + 1 - cfg->cache), "cache");
        }
        if (env.cache_set && strcmp(env.cache, cfg->cache) != 0)
            vgpu_log(VGPU_LOG_WARN,
                     "CUDA_DEVICE_MEMORY_SHARED_CACHE=%s ignored: the container's accounting file is %s",
                     env.cache, cfg->cache);
    } else if (env.cache_set) {
        snprintf(cfg->cache, sizeof cfg->cache, "%s", env.cache);
    }
    return 0;
}
