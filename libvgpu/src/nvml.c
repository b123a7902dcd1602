/* nvml.c: NVML as the container sees it: memory capped, process lists
 * filtered to the container's. */
#include "internal.h"

/* ------------------------------------------------------------------ */
/* NVML                                                                */

static int nvml_state; /* 0 unknown, 1 pass, 2 active, -1 error */

/* A call the real NVML makes to its own exported names while libvgpu is inside a real
 * call (the driver's nvmlInit_v2 calls nvmlInitWithFlags through its PLT, which the
 * preload binds here) passes straight through: entering would wait on the NVML
 * resolution this very thread is running (a deadlock seen on driver 580). */
#define NVML_PASS_NESTED(name, args) \
    if (UNLIKELY(vgpu_nested)) return REAL(name) ? REAL(name) args : NVML_ERROR_UNKNOWN

static int nvml_enter(void) {
    int st = __atomic_load_n(&nvml_state, __ATOMIC_ACQUIRE);
    if (st) return st;
    int crc = cfg_status();
    resolve_nvml_once();
    pthread_mutex_lock(&vgpu_init_mu);
    if (crc < 0) st = -1;
    else if (!cfg.active) st = 1;
    else if (cache_open(cfg.cache) < 0 || ledger_open() < 0) {
        vgpu_log(VGPU_LOG_ERROR, "%s", cfg_err);
        st = -1;
    } else {
        if (!my_pid) my_pid = getpid();
        st = 2;
    }
    __atomic_store_n(&nvml_state, st, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&vgpu_init_mu);
    return st;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    NVML_PASS_NESTED(nvmlInit_v2, ());
    int st = nvml_enter();
    if (!REAL(nvmlInit_v2)) return NVML_ERROR_UNKNOWN;
    if (st < 0) return NVML_ERROR_UNKNOWN; /* fail closed: stderr names the variable */
    return NESTED(REAL(nvmlInit_v2)());
}

EXPORT nvmlReturn_t nvmlInit(void) {
    NVML_PASS_NESTED(nvmlInit, ());
    int st = nvml_enter();
    if (!REAL(nvmlInit)) return NVML_ERROR_UNKNOWN;
    if (st < 0) return NVML_ERROR_UNKNOWN;
    return NESTED(REAL(nvmlInit)());
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    NVML_PASS_NESTED(nvmlInitWithFlags, (flags));
    int st = nvml_enter();
    if (!REAL(nvmlInitWithFlags)) return NVML_ERROR_UNKNOWN;
    if (st < 0) return NVML_ERROR_UNKNOWN;
    return NESTED(REAL(nvmlInitWithFlags)(flags));
}

/* Cap and container usage for an NVML device; 0 if uncapped. */
static uint64_t nvml_cap(nvmlDevice_t dev, uint64_t *used) {
    typedef nvmlReturn_t (*uuid_t_)(nvmlDevice_t, char *, unsigned);
    char uuid[96];
    if (!real_x[X_nvmlDeviceGetUUID] || HELP(nvmlDeviceGetUUID, uuid_t_)(dev, uuid, sizeof uuid) != NVML_SUCCESS)
        return cfg.mem_any;
    int i = gpu_index_of(uuid);
    uint64_t cap = i >= 0 ? cfg.mem[i] : cfg.mem_any;
    struct vgpu_shm *img = calloc(1, sizeof *img); /* untouched pages: no faults */
    if (img && data_lock() == 0) {
        if (cache_load(img) == 0) { /* the advisory cap: a corrupt file is ignored */
            reap(img, NULL, 0);
            int e = shm_dev(img, uuid, 0);
            uint64_t c2 = e >= 0 ? img->devs[e].mem_cap : 0;
            if (c2 && (!cap || c2 < cap)) cap = c2;
        }
        data_unlock();
    }
    free(img);
    if (container_used(win_of(i), used) != 0) *used = cap; /* ledger unreadable: nothing free */
    return cap;
}

static void apply_cap(uint64_t cap, uint64_t used, unsigned long long *total, unsigned long long *freep,
                      unsigned long long *usedp) {
    uint64_t t = cap < *total ? cap : *total;
    uint64_t f = t > used ? t - used : 0;
    if (f > *freep) f = *freep;
    *total = t;
    *usedp = used;
    *freep = f;
}

/* The driver's answer to a memory query (r), returned as it is unless this
 * process's caps apply (st == 2) and the call filled `mem`. */
#define NVML_MEM_QUERY(name, args)                                  \
    NVML_PASS_NESTED(name, args);                                   \
    int st = nvml_enter();                                          \
    if (!REAL(name) || st < 0) return NVML_ERROR_UNKNOWN;           \
    nvmlReturn_t r = NESTED(REAL(name) args);                       \
    if (r != NVML_SUCCESS || st != 2 || !mem) return r

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    NVML_MEM_QUERY(nvmlDeviceGetMemoryInfo, (dev, mem));
    uint64_t used = 0, cap = nvml_cap(dev, &used);
    if (cap) apply_cap(cap, used, &mem->total, &mem->free, &mem->used);
    return r;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem) {
    NVML_MEM_QUERY(nvmlDeviceGetMemoryInfo_v2, (dev, mem));
    uint64_t used = 0, cap = nvml_cap(dev, &used);
    if (cap) {
        mem->reserved = 0;
        apply_cap(cap, used, &mem->total, &mem->free, &mem->used);
    }
    return r;
}

/* NVML's process lists show every process on the GPU, neighbours included.
 * Filtered to the container's: the pids NVML reports (host_pid of the live
 * slots of the accounting file). A process whose NVML pid is unknown, or
 * that is not in the container, is left out. The two-call protocol is kept
 * with the filtered count. `esz`: the entry size (pid first). */
static nvmlReturn_t procs_filtered(nvmlReturn_t (*fn)(nvmlDevice_t, unsigned *, void *), nvmlDevice_t dev,
                                   unsigned *count, void *infos, size_t esz) {
    if (!count) return NESTED(fn(dev, count, infos));
    unsigned cap = 64;
    char *buf = NULL;
    nvmlReturn_t r;
    unsigned n;
    for (int tries = 0;; tries++) {
        char *nb = realloc(buf, (size_t)cap * esz);
        if (!nb) {
            free(buf);
            return NVML_ERROR_UNKNOWN;
        }
        buf = nb;
        n = cap;
        r = NESTED(fn(dev, &n, buf));
        if (r != NVML_ERROR_INSUFFICIENT_SIZE || tries > 4) break;
        cap = n + 16;
    }
    if (r != NVML_SUCCESS) {
        free(buf);
        if (r == NVML_ERROR_INSUFFICIENT_SIZE) r = NVML_ERROR_UNKNOWN;
        return r;
    }
    int32_t mine[VGPU_MAX_SLOTS];
    unsigned nmine = 0;
    struct vgpu_shm *img = calloc(1, sizeof *img); /* untouched pages: no faults */
    if (img && data_lock() == 0) {
        if (cache_load(img) == 0) { /* corrupt: nobody is listed (fail closed) */
            reap(img, NULL, 0);
            for (int i = 0; i < (int)img_n(img); i++)
                if (img->slots[i].pid && img->slots[i].host_pid) mine[nmine++] = img->slots[i].host_pid;
        }
        data_unlock();
    }
    free(img);
    unsigned kept = 0;
    for (unsigned i = 0; i < n; i++) {
        uint32_t pid;
        memcpy(&pid, buf + (size_t)i * esz, sizeof pid);
        int in = 0;
        for (unsigned k = 0; k < nmine && !in; k++) in = (uint32_t)mine[k] == pid;
        if (!in) continue;
        if (kept != i) memmove(buf + (size_t)kept * esz, buf + (size_t)i * esz, esz);
        kept++;
    }
    if (kept > *count || (kept && !infos)) {
        *count = kept;
        free(buf);
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (kept) memcpy(infos, buf, (size_t)kept * esz);
    *count = kept;
    free(buf);
    return NVML_SUCCESS;
}

typedef nvmlReturn_t (*procs_fn)(nvmlDevice_t, unsigned *, void *);
#define PROCS_WRAPPER(name, esz)                                                    \
    EXPORT nvmlReturn_t name(nvmlDevice_t dev, unsigned *count, void *infos) {      \
        NVML_PASS_NESTED(name, (dev, count, infos));                                \
        int st = nvml_enter();                                                      \
        if (!REAL(name)) return NVML_ERROR_UNKNOWN;                                 \
        if (st < 0) return NVML_ERROR_UNKNOWN;                                      \
        if (st != 2) return NESTED(REAL(name)(dev, count, infos));                  \
        return procs_filtered((procs_fn)REAL(name), dev, count, infos, (esz));      \
    }
PROCS_WRAPPER(nvmlDeviceGetComputeRunningProcesses, sizeof(nvmlProcessInfo_v1_t))
PROCS_WRAPPER(nvmlDeviceGetComputeRunningProcesses_v2, sizeof(nvmlProcessInfo_t))
PROCS_WRAPPER(nvmlDeviceGetComputeRunningProcesses_v3, sizeof(nvmlProcessInfo_t))

