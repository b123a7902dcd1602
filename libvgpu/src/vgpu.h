/* libvgpu internals shared by its translation units (all hidden). */
#ifndef VGPU_H
#define VGPU_H

#include <stdint.h>

#pragma GCC visibility push(hidden)

#define VGPU_MAX_DEV 16 /* GPUs with their own limit variables, accounting entries and ledger windows */
/* CUDA devices one process can account for (MIG: 8 GPUs x 7). Devices beyond
 * it fail closed; devices past VGPU_MAX_DEV share the last ledger window and
 * have no accounting-file entry (their SM-limited launches are refused). */
#define VGPU_LDEV_MAX 64
#ifndef VGPU_LIMITS_FILE
#define VGPU_LIMITS_FILE "/run/nvctk/vgpu/limits" /* fixed path inside containers */
#endif
#ifndef VGPU_CONTAINER_LIB
#define VGPU_CONTAINER_LIB "/run/nvctk/libvgpu.so" /* where nvctk mounts it inside containers */
#endif
#define VGPU_DEFAULT_RESERVE (64ull << 20)

/* ---- config.c ---- */

/* The value grammar shared with nvctk/vgpu/limits.py (see libvgpu/README.md).
 * 0 on success, -1 if malformed. */
int vgpu_parse_memory(const char *s, uint64_t *out);
int vgpu_parse_sm(const char *s, unsigned *out);

/* Limits from one source (env or the limits file). */
struct vgpu_src {
    uint64_t mem_all, mem[VGPU_MAX_DEV];
    unsigned sm_all, sm[VGPU_MAX_DEV];
    uint32_t mem_set, sm_set;   /* bit i: the _<i> variable was given */
    int mem_all_set, sm_all_set;
    uint64_t reserve;
    int reserve_set;
    char cache[4096];
    int cache_set;
    char uuid[VGPU_MAX_DEV][64]; /* NVCTK_VGPU_UUID_<i>: the limits file only */
    uint32_t uuid_set;
};

struct vgpu_config {
    int active;                  /* any limit at all */
    uint64_t mem[VGPU_MAX_DEV];  /* per container GPU index; 0 = none */
    unsigned sm[VGPU_MAX_DEV];
    uint64_t mem_any;            /* strictest cap of all: for unmappable devices */
    unsigned sm_any;
    uint64_t reserve;            /* per-context memory charge */
    char cache[4096];            /* accounting file; "" = private (anonymous) */
    char limits_file[4096];      /* the limits file used; "" = none */
    char uuid[VGPU_MAX_DEV][64]; /* container GPU i's UUID, from the limits file (no NVML needed) */
    uint32_t uuid_set;           /* bit i: uuid[i] given; 0: map through NVML */
    int log_level;
};

/* Loads the configuration from the environment and the limits file.
 * 0 on success; -1 with a message naming the variable in err. */
int vgpu_load_config(struct vgpu_config *cfg, char *err, unsigned errlen);

/* Parses one KEY=VALUE into src. 0, or -1 with err set. `what` names the source. */
int vgpu_src_set(struct vgpu_src *src, const char *key, const char *value, const char *what,
                 char *err, unsigned errlen);

enum { VGPU_LOG_OFF = 0, VGPU_LOG_ERROR, VGPU_LOG_WARN, VGPU_LOG_INFO, VGPU_LOG_DEBUG };
extern int vgpu_log_level;
void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#pragma GCC visibility pop
#endif
