/* libvgpu: caps a container's GPU memory and SM share by interposing the CUDA
 * driver API and NVML. See libvgpu/README.md for the design. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cuda_min.h"
#include "shm.h"
#include "vgpu.h"

/* Bind to the oldest versions of the symbols glibc 2.34 moved into libc, so
 * the library loads in images with glibc >= 2.17 (checked by a test). */
__asm__(".symver dlvsym,dlvsym@GLIBC_2.2.5");
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dladdr,dladdr@GLIBC_2.2.5");
__asm__(".symver pthread_once,pthread_once@GLIBC_2.2.5");

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ------------------------------------------------------------------ */
/* the names libvgpu wraps (exact; anything else passes through)       */

#define CUDA_HOOKS(X)                                                                     \
    X(cuMemMap) X(cuMemUnmap) X(cuMemAddressFree) X(cuMemRetainAllocationHandle)          \
    X(cuMemPoolCreate) X(cuMemPoolDestroy) X(cuMemPoolTrimTo) X(cuDeviceGetDefaultMemPool) X(cuDeviceGetMemPool) \
    X(cuGraphExecDestroy) X(cuModuleUnload) X(cuGraphExecUpdate)   \
    X(cuGraphExecUpdate_v2) X(cuGraphExecKernelNodeSetParams) X(cuGraphExecKernelNodeSetParams_v2) \
    X(cuGraphExecNodeSetParams) X(cuGraphExecChildGraphNodeSetParams) X(cuGraphNodeSetEnabled) \
    X(cuLibraryUnload)                                                                     \
    X(cuInit) X(cuGetProcAddress) X(cuGetProcAddress_v2) X(cuMemAlloc_v2)                 \
    X(cuMemAllocPitch_v2) X(cuMemAllocManaged) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz) \
    X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) X(cuMemFree_v2)            \
    X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuMemCreate) X(cuMemRelease)              \
    X(cuArrayCreate_v2) X(cuArray3DCreate_v2) X(cuMipmappedArrayCreate) X(cuArrayDestroy) \
    X(cuMipmappedArrayDestroy) X(cuMemGetInfo_v2) X(cuDeviceTotalMem_v2) X(cuCtxCreate_v2) \
    X(cuCtxCreate_v3) X(cuCtxCreate_v4) X(cuCtxDestroy_v2) X(cuDevicePrimaryCtxRetain)   \
    X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxReset_v2) X(cuLaunchKernel)       \
    X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz)                   \
    X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz) X(cuGraphLaunch)       \
    X(cuGraphLaunch_ptsz)
#define NVML_HOOKS(X)                                                                                     \
    X(nvmlInit) X(nvmlInit_v2) X(nvmlInitWithFlags) X(nvmlDeviceGetMemoryInfo) X(nvmlDeviceGetMemoryInfo_v2) \
    X(nvmlDeviceGetComputeRunningProcesses) X(nvmlDeviceGetComputeRunningProcesses_v2)                     \
    X(nvmlDeviceGetComputeRunningProcesses_v3)
/* real functions used but not wrapped */
#define CUDA_HELPERS(X)                                                                         \
    X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetUuid) X(cuCtxGetDevice) X(cuCtxGetCurrent)    \
    X(cuStreamIsCapturing) X(cuEventCreate) X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) \
    X(cuEventElapsedTime) X(cuEventDestroy_v2) X(cuStreamGetCtx) X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2) \
    X(cuMemPoolGetAttribute)
#define NVML_HELPERS(X) \
    X(nvmlDeviceGetCount_v2) X(nvmlDeviceGetHandleByIndex_v2) X(nvmlDeviceGetUUID)

#define ENUM(n) H_##n,
enum { CUDA_HOOKS(ENUM) H_NCUDA, NVML_HOOKS(ENUM) H_N };
#undef ENUM
#define XENUM(n) X_##n,
enum { CUDA_HELPERS(XENUM) NVML_HELPERS(XENUM) X_N };
#undef XENUM

EXPORT CUresult cuInit(unsigned int flags);
EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr);
EXPORT nvmlReturn_t nvmlInit(void);
EXPORT nvmlReturn_t nvmlInit_v2(void);
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags);

static void *real_fn[H_N]; /* real entry points, by hook id */
static void *real_x[X_N];  /* helpers */
#define REAL(n) ((__typeof__(&n))real_fn[H_##n])
#define HELP(n, type) ((type)real_x[X_##n])

struct hook {
    const char *name;
    void *wrapper;
};
static const struct hook hooks[H_N]; /* defined at the end, after the wrappers */
static const char *const helper_names[X_N] = {
#define NAME(n) #n,
    CUDA_HELPERS(NAME) NVML_HELPERS(NAME)
#undef NAME
};

/* ------------------------------------------------------------------ */
/* dlsym: the real one, and an override that routes the exact names    */

__attribute__((visibility("hidden"))) void *(*vgpu_real_dlsym)(void *, const char *);

static void resolve_dlsym(void) {
    if (vgpu_real_dlsym) return;
    void *p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!p) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (!p) {
        static const char m[] = "libvgpu: fatal: cannot find the real dlsym\n";
        ssize_t w = write(2, m, sizeof m - 1);
        (void)w;
        abort();
    }
    __atomic_store_n(&vgpu_real_dlsym, (void *(*)(void *, const char *))p, __ATOMIC_RELEASE);
}

static int hook_find(const char *name) {
    if (name[0] == 'c' && name[1] == 'u') {
        for (int i = 0; i < H_NCUDA; i++)
            if (strcmp(hooks[i].name, name) == 0) return i;
    } else if (strncmp(name, "nvml", 4) == 0) {
        for (int i = H_NCUDA + 1; i < H_N; i++)
            if (strcmp(hooks[i].name, name) == 0) return i;
    }
    return -1;
}

static int state_passthrough(void);

/* Called by the dlsym trampoline: our wrapper for an exact wrapped name the
 * handle really provides, else NULL (the trampoline then tail-jumps to the
 * real dlsym, so the caller's return address — which RTLD_NEXT lookups
 * depend on — is preserved). */
__attribute__((visibility("hidden"), used)) void *vgpu_dlsym_route(void *handle, const char *name) {
    resolve_dlsym();
    if (!name) return NULL;
    if (!((name[0] == 'c' && name[1] == 'u') || name[0] == 'n')) return NULL;
    int k = hook_find(name);
    if (k < 0) return NULL;
    if (state_passthrough()) return NULL;
    if (!vgpu_real_dlsym(handle, name)) return NULL;
    return hooks[k].wrapper;
}

#if defined(__x86_64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym,@function\n"
        "dlsym:\n"
        "  push %rdi\n"
        "  push %rsi\n"
        "  sub $8, %rsp\n"
        "  call vgpu_dlsym_route\n"
        "  add $8, %rsp\n"
        "  pop %rsi\n"
        "  pop %rdi\n"
        "  test %rax, %rax\n"
        "  jnz 1f\n"
        "  jmp *vgpu_real_dlsym(%rip)\n"
        "1: ret\n"
        ".size dlsym, .-dlsym\n");
#else
EXPORT void *dlsym(void *handle, const char *name) {
    void *w = vgpu_dlsym_route(handle, name);
    return w ? w : vgpu_real_dlsym(handle, name);
}
#endif

/* ------------------------------------------------------------------ */
/* configuration and state                                             */

static struct vgpu_config cfg;
static char cfg_err[8192];
static int cfg_rc; /* 0 ok, -1 malformed */
static pthread_once_t cfg_once = PTHREAD_ONCE_INIT;

static void cfg_load(void) {
    cfg_rc = vgpu_load_config(&cfg, cfg_err, sizeof cfg_err);
    /* Loaded from nvctk's container path, libvgpu was put there for a limit:
     * without the container's limits file (hidden, e.g. by a mount over
     * it) it must not run uncapped. */
    Dl_info di;
    if (cfg_rc == 0 && dladdr((void *)cfg_load, &di) && di.dli_fname &&
        strcmp(di.dli_fname, VGPU_CONTAINER_LIB) == 0 && strcmp(cfg.limits_file, VGPU_LIMITS_FILE) != 0) {
        snprintf(cfg_err, sizeof cfg_err, "libvgpu is loaded from %s but the limits file %s is missing",
                 VGPU_CONTAINER_LIB, VGPU_LIMITS_FILE);
        cfg_rc = -1;
    }
    if (cfg_rc < 0) {
        char m[8400];
        int n = snprintf(m, sizeof m, "libvgpu[%d]: error: %s; refusing to run without the limit\n",
                         (int)getpid(), cfg_err);
        ssize_t w = write(2, m, (size_t)n < sizeof m ? (size_t)n : sizeof m - 1);
        (void)w;
    }
}

/* 1 when no limit is configured at all (and nothing is malformed) */
static int state_passthrough(void) {
    pthread_once(&cfg_once, cfg_load);
    return cfg_rc == 0 && !cfg.active;
}

static void *cuda_handle, *nvml_handle;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT, nvml_once = PTHREAD_ONCE_INIT;

static void *sym_from(void *h, const char *name, void *wrapper) {
    if (!h) return NULL;
    void *p = vgpu_real_dlsym(h, name);
    return p == wrapper ? NULL : p;
}

static void resolve_cuda(void) {
    resolve_dlsym();
    cuda_handle = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!cuda_handle) {
        vgpu_log(VGPU_LOG_ERROR, "cannot load libcuda.so.1");
        return;
    }
    for (int i = 0; i < H_NCUDA; i++) real_fn[i] = sym_from(cuda_handle, hooks[i].name, hooks[i].wrapper);
    for (int i = 0; i < X_nvmlDeviceGetCount_v2; i++) real_x[i] = sym_from(cuda_handle, helper_names[i], NULL);
}

static int nvml_ok;
static unsigned n_nvml;
static char nvml_uuid[VGPU_LDEV_MAX][96];

static void resolve_nvml(void) {
    resolve_dlsym();
    nvml_handle = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!nvml_handle) return;
    for (int i = H_NCUDA + 1; i < H_N; i++) real_fn[i] = sym_from(nvml_handle, hooks[i].name, hooks[i].wrapper);
    for (int i = X_nvmlDeviceGetCount_v2; i < X_N; i++) real_x[i] = sym_from(nvml_handle, helper_names[i], NULL);
    typedef nvmlReturn_t (*count_t)(unsigned *);
    typedef nvmlReturn_t (*byidx_t)(unsigned, nvmlDevice_t *);
    typedef nvmlReturn_t (*uuid_t_)(nvmlDevice_t, char *, unsigned);
    if (!REAL(nvmlInit_v2) || !real_x[X_nvmlDeviceGetCount_v2] || !real_x[X_nvmlDeviceGetHandleByIndex_v2] ||
        !real_x[X_nvmlDeviceGetUUID])
        return;
    if (REAL(nvmlInit_v2)() != NVML_SUCCESS) return;
    unsigned n = 0;
    if (HELP(nvmlDeviceGetCount_v2, count_t)(&n) != NVML_SUCCESS) return;
    if (n > VGPU_LDEV_MAX) n = VGPU_LDEV_MAX;
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d;
        nvml_uuid[i][0] = 0;
        if (HELP(nvmlDeviceGetHandleByIndex_v2, byidx_t)(i, &d) == NVML_SUCCESS)
            HELP(nvmlDeviceGetUUID, uuid_t_)(d, nvml_uuid[i], sizeof nvml_uuid[i]);
    }
    n_nvml = n;
    nvml_ok = 1;
}

static int nvml_index_of(const char *uuid) {
    for (unsigned i = 0; i < n_nvml; i++)
        if (strcasecmp(nvml_uuid[i], uuid) == 0) return (int)i;
    return -1;
}

/* ------------------------------------------------------------------ */
/* the accounting file: SM token bucket, NVML pids, statistics          */
/* (never mapped: read and written with pread/pwrite under its lock, so  */
/* a container process that truncates or scribbles on it crashes nobody) */

static int cache_fd = -1;           /* the accounting file, O_RDWR */
static struct vgpu_shm *priv_img;   /* no file at all: this process's own copy */
static pthread_mutex_t data_mu = PTHREAD_MUTEX_INITIALIZER; /* threads: OFD locks don't exclude them */
static int my_slot = -1;
static pid_t my_pid;
static uint64_t my_pidns;

#define LOCK_WAIT_NS 10000000000ull /* the longest a process waits for a lock */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Backoff for bounded waits: 50 us doubling to 10 ms. */
static void backoff(uint64_t *sleep_ns) {
    struct timespec ts = {0, (long)*sleep_ns};
    nanosleep(&ts, NULL);
    if (*sleep_ns < 10000000) *sleep_ns *= 2;
}

static uint64_t proc_start_time(pid_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    p++;
    for (int field = 3; field <= 22; field++) {
        while (*p == ' ') p++;
        if (field == 22) return strtoull(p, NULL, 10);
        while (*p && *p != ' ') p++;
    }
    return 0;
}

/* The pid NVML reports for this process: the first NSpid entry of
 * /proc/self/status, i.e. its pid in the pid namespace /proc was mounted
 * for (the host's only when that /proc is the host's); 0 if unreadable. */
static int32_t host_pid_of_self(void) {
    char buf[4096];
    int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strstr(buf, "\nNSpid:");
    return p ? (int32_t)strtol(p + 7, NULL, 10) : 0;
}

static uint64_t pidns_inode(void) {
    char buf[64];
    ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strchr(buf, '[');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

/* The file's lock: a process-local mutex, then an OFD write lock on its
 * byte DATA_LOCK, waited for at most LOCK_WAIT_NS. 0, or -1 (not taken). */
static int data_lock(void) {
    pthread_mutex_lock(&data_mu);
    if (cache_fd < 0) return 0;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_DATA_LOCK, .l_len = 1};
    uint64_t t0 = now_ns(), sl = 50000;
    while (fcntl(cache_fd, F_OFD_SETLK, &fl) != 0) {
        if ((errno != EAGAIN && errno != EACCES && errno != EINTR) || now_ns() - t0 > LOCK_WAIT_NS) {
            pthread_mutex_unlock(&data_mu);
            return -1;
        }
        backoff(&sl);
    }
    return 0;
}

static void data_unlock(void) {
    if (cache_fd >= 0) {
        struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = VGPU_DATA_LOCK, .l_len = 1};
        fcntl(cache_fd, F_OFD_SETLK, &fl);
    }
    pthread_mutex_unlock(&data_mu);
}

/* Whole reads and writes of the file (or of the private copy). 0 or -1. */
static int cache_read(void *buf, size_t len, size_t off) {
    if (cache_fd < 0) {
        if (!priv_img) return -1;
        memcpy(buf, (char *)priv_img + off, len);
        return 0;
    }
    size_t done = 0;
    while (done < len) {
        ssize_t n = pread(cache_fd, (char *)buf + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1; /* short: truncated by someone */
        done += (size_t)n;
    }
    return 0;
}

static int cache_write(const void *buf, size_t len, size_t off) {
    if (cache_fd < 0) {
        if (!priv_img) return -1;
        memcpy((char *)priv_img + off, buf, len);
        return 0;
    }
    size_t done = 0;
    while (done < len) {
        ssize_t n = pwrite(cache_fd, (const char *)buf + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        done += (size_t)n;
    }
    return 0;
}

static int hdr_valid(const struct vgpu_shm_hdr *h) {
    return h->magic == VGPU_SHM_MAGIC && h->version == VGPU_SHM_VERSION && h->size == sizeof(struct vgpu_shm) &&
           h->nslots == VGPU_MAX_SLOTS;
}

static void hdr_init(struct vgpu_shm_hdr *h) {
    memset(h, 0, sizeof *h);
    h->magic = VGPU_SHM_MAGIC;
    h->version = VGPU_SHM_VERSION;
    h->size = sizeof(struct vgpu_shm);
    h->nslots = VGPU_MAX_SLOTS;
}

#define DEVS_OFF offsetof(struct vgpu_shm, devs)
#define SLOT_OFF(i) (offsetof(struct vgpu_shm, slots) + (size_t)(i) * sizeof(struct vgpu_shm_slot))

/* Slots img holds: those below the high-water mark (the rest were never
 * taken, or a forged mark hides them: their owners' locks still guard them).
 * Nothing reads img's slots from here up: they are not even touched, so a
 * calloc'd image costs no page faults there. */
static uint32_t img_n(const struct vgpu_shm *img) {
    return img->hdr.hwm < VGPU_MAX_SLOTS ? img->hdr.hwm : VGPU_MAX_SLOTS;
}

/* The file into img (header, devices, the slots below the high-water mark);
 * 0, or -1 if unreadable or not in the layout (a container process truncated
 * or overwrote it). Lock held. */
static int cache_load(struct vgpu_shm *img) {
    if (cache_read(img, offsetof(struct vgpu_shm, slots), 0) != 0 || !hdr_valid(&img->hdr)) return -1;
    /* only the slots below the high-water mark: a few KiB, not 354, for a
     * container's processes starting together */
    uint32_t hwm = img_n(img);
    return hwm && cache_read(img->slots, hwm * sizeof img->slots[0], SLOT_OFF(0)) != 0 ? -1 : 0;
}

/* Slot `slot` is taken: the high-water mark covers it. Lock held. 0 or -1. */
static int hwm_cover(struct vgpu_shm *img, int slot) {
    if (img->hdr.hwm > (uint32_t)slot && img->hdr.hwm <= VGPU_MAX_SLOTS) return 0;
    img->hdr.hwm = (uint32_t)slot + 1;
    return cache_write(&img->hdr.hwm, sizeof img->hdr.hwm, offsetof(struct vgpu_shm_hdr, hwm));
}

/* Opens the accounting file ("" = a private copy). libvgpu never grows it:
 * nvctk preallocates it; a short one is allocated here (posix_fallocate), and
 * one that cannot be (a full tmpfs) fails closed. 0, or -1 with cfg_err set. */
static int cache_open(const char *path) {
    if (cache_fd >= 0 || priv_img) return 0;
    my_pid = getpid();
    my_pidns = pidns_inode();
    if (!*path) {
        priv_img = calloc(1, sizeof *priv_img);
        if (!priv_img) goto fail;
        hdr_init(&priv_img->hdr);
        return 0;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK, 0666);
    if (fd < 0) goto fail;
    struct stat st;
    /* the fstat system call itself: glibc's fstat symbol is GLIBC_2.33 */
    if (syscall(SYS_fstat, fd, &st) != 0) {
        close(fd);
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: not a regular file", path);
        return -1;
    }
    if (st.st_size < (off_t)sizeof(struct vgpu_shm)) {
        int e = posix_fallocate(fd, 0, sizeof(struct vgpu_shm));
        if (e) {
            close(fd);
            snprintf(cfg_err, sizeof cfg_err,
                     "accounting file %s: %lld bytes, cannot allocate the %zu it needs (%s); refusing to run "
                     "without the limit",
                     path, (long long)st.st_size, sizeof(struct vgpu_shm), strerror(e));
            return -1;
        }
        if (st.st_size == 0) fchmod(fd, 0666); /* created now: the container's other users share it */
    }
    cache_fd = fd;
    if (data_lock() != 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: its lock is held by another process", path);
        return -1;
    }
    struct vgpu_shm_hdr h;
    int rc = 0;
    if (cache_read(&h, sizeof h, 0) != 0 || !hdr_valid(&h)) {
        /* fresh (nvctk preallocates zeros) or overwritten: (re)initialised */
        struct vgpu_shm *z = calloc(1, sizeof *z);
        if (!z) rc = -1;
        else {
            hdr_init(&z->hdr);
            rc = cache_write(z, sizeof *z, 0);
            free(z);
        }
    }
    data_unlock();
    if (rc == 0) return 0;
    snprintf(cfg_err, sizeof cfg_err, "accounting file %s: cannot initialise it", path);
    return -1;
fail:
    snprintf(cfg_err, sizeof cfg_err, "accounting file %s (CUDA_DEVICE_MEMORY_SHARED_CACHE): %s", path,
             strerror(errno));
    return -1;
}

static void recompute(struct vgpu_shm *img) {
    for (int e = 0; e < VGPU_MAX_DEV; e++) {
        struct vgpu_shm_dev *d = &img->devs[e];
        if (!d->uuid[0]) continue;
        uint64_t cap = 0;
        uint32_t sm = 0;
        for (uint32_t i = 0, n = img_n(img); i < n; i++) {
            struct vgpu_shm_slot *s = &img->slots[i];
            if (!s->pid) continue;
            if (s->mem_cap[e] && (!cap || s->mem_cap[e] < cap)) cap = s->mem_cap[e];
            if (s->sm[e] && (!sm || s->sm[e] < sm)) sm = s->sm[e];
        }
        d->used = 0;
        d->mem_cap = cap;
        d->sm_pct = sm;
    }
}

static int slot_alive(const struct vgpu_shm *img, int i) {
    const struct vgpu_shm_slot *s = &img->slots[i];
    if (!s->pid) return 0;
    if (i == my_slot) return 1;
    if (cache_fd >= 0) {
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCKBASE + i, .l_len = 1};
        if (fcntl(cache_fd, F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK) return 0;
    }
    if (s->pidns == my_pidns && proc_start_time(s->pid) != s->start_time) return 0;
    return 1;
}

/* Frees dead processes' slots in img and the file (cand: the ones to judge,
 * NULL = all); recomputes and stores the device entries. Lock held. */
static void reap(struct vgpu_shm *img, const int *cand, int n) {
    for (int k = 0; k < (cand ? n : (int)img_n(img)); k++) {
        int i = cand ? cand[k] : k;
        if (img->slots[i].pid && !slot_alive(img, i)) {
            vgpu_log(VGPU_LOG_INFO, "reclaimed slot of dead pid %d", img->slots[i].pid);
            memset(&img->slots[i], 0, sizeof img->slots[i]);
            cache_write(&img->slots[i], sizeof img->slots[i], SLOT_OFF(i));
        }
    }
    recompute(img);
    cache_write(img->devs, sizeof img->devs, DEVS_OFF);
}

/* Index of uuid's entry in img, created if `create`; -1 if none/full. */
static int shm_dev(struct vgpu_shm *img, const char *uuid, int create) {
    int free_e = -1;
    for (int e = 0; e < VGPU_MAX_DEV; e++) {
        if (strncmp(img->devs[e].uuid, uuid, sizeof img->devs[e].uuid) == 0) return e;
        if (!img->devs[e].uuid[0] && free_e < 0) free_e = e;
    }
    if (!create || free_e < 0) return -1;
    struct vgpu_shm_dev *d = &img->devs[free_e];
    memset(d, 0, sizeof *d);
    snprintf(d->uuid, sizeof d->uuid, "%s", uuid);
    return free_e;
}

/* ------------------------------------------------------------------ */
/* the lock ledger: GPU memory                                          */
/* Each process's usage is private; what it may use is published as a   */
/* lease, an OFD read lock whose length is the bytes leased (shm.h for   */
/* the geometry). The kernel's lock table cannot be written by files,    */
/* a lock cannot be removed by another process, and it vanishes with its */
/* holder. Leases grow only under flock(LOCK_EX) on the same file, after */
/* a census of everyone else's: so their sum never exceeds the cap.      */

#define LEDGER_CHUNK (64ull << 20)     /* at most this much unused lease per device... */
#define LEDGER_SLACK_ROOM (1ull << 30) /* ...and only while this much (and a quarter of the cap) stays free */
#define LEDGER_NWIN VGPU_MAX_DEV

static int lk_fd = -1;         /* the ledger's file, O_RDONLY; -1 with lk_private: no file at all */
static int lk_private;
static pthread_mutex_t lk_open_mu = PTHREAD_MUTEX_INITIALIZER;
static int my_region = -1;
static int mem_attached;       /* this process may charge (not a forked child) */
static uint64_t own_used[LEDGER_NWIN], own_lease[LEDGER_NWIN]; /* mem_mu */
static unsigned char own_tight[LEDGER_NWIN]; /* granted with no slack: frees hand everything back */
static pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t grant_mu = PTHREAD_MUTEX_INITIALIZER; /* one slow path per process at a time */
static pthread_mutex_t tok_mu = PTHREAD_MUTEX_INITIALIZER;    /* the SM slices (smloc) */

static const char *ledger_path(void) { return cfg.limits_file[0] ? cfg.limits_file : cfg.cache; }

/* Opens the ledger's file once (again in a forked child). 0, or -1 with cfg_err set. */
static void vgpu_atfork_child(void);
static void atfork_register(void) { pthread_atfork(NULL, NULL, vgpu_atfork_child); }
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static int ledger_open(void) {
    pthread_once(&atfork_once, atfork_register);
    if (__atomic_load_n(&lk_fd, __ATOMIC_ACQUIRE) >= 0 || lk_private) return 0;
    pthread_mutex_lock(&lk_open_mu);
    int rc = 0;
    const char *p = ledger_path();
    if (lk_fd >= 0 || lk_private) {
    } else if (!*p) {
        lk_private = 1;
    } else {
        int fd = open(p, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
        if (fd < 0) {
            snprintf(cfg_err, sizeof cfg_err, "ledger %s: %s", p, strerror(errno));
            rc = -1;
        } else {
            __atomic_store_n(&lk_fd, fd, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&lk_open_mu);
    return rc;
}

/* flock(LOCK_EX) on the ledger, waited for at most LOCK_WAIT_NS. 0 or -1. */
static int ledger_lock(void) {
    if (lk_fd < 0) return 0;
    uint64_t t0 = now_ns(), sl = 50000;
    while (flock(lk_fd, LOCK_EX | LOCK_NB) != 0) {
        if ((errno != EWOULDBLOCK && errno != EINTR) || now_ns() - t0 > LOCK_WAIT_NS) return -1;
        backoff(&sl);
    }
    return 0;
}
static void ledger_unlock(void) {
    if (lk_fd >= 0) flock(lk_fd, LOCK_UN);
}

static inline uint64_t sat_add(uint64_t a, uint64_t b) { return a + b < a ? UINT64_MAX : a + b; }

/* The container's leases per device window, everyone's but this process's
 * own (locks of our own open file description never conflict with our
 * query). Recursive window splitting: a query returns one lock overlapping
 * the window; its overlap is counted and the parts left and right of it are
 * queried again. Overlapping locks (an attacker copying a range) are counted
 * once as their union, so nothing a process adds can hide a lease; a lock
 * spanning several windows counts in each. 0, or -1 (more than MAX_QUERIES
 * queries, or an error): the caller fails closed. */
static int census(uint64_t tot[LEDGER_NWIN], unsigned *nlocks) {
    memset(tot, 0, sizeof(uint64_t) * LEDGER_NWIN);
    *nlocks = 0;
    if (ledger_open() != 0) return -1;
    if (lk_fd < 0) return 0; /* private: nobody else */
    struct win {
        int64_t a, b;
    };
    struct win *st = malloc((VGPU_LEDGER_MAX_QUERIES + 2) * sizeof *st);
    if (!st) return -1;
    size_t n = 0;
    int q = 0, rc = 0;
    st[n++] = (struct win){VGPU_LEDGER_LEASE_BASE, VGPU_LEDGER_LEASE_END};
    while (n) {
        struct win w = st[--n];
        if (w.a >= w.b) continue;
        if (++q > VGPU_LEDGER_MAX_QUERIES) {
            rc = -1;
            break;
        }
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = w.a, .l_len = w.b - w.a};
        if (fcntl(lk_fd, F_OFD_GETLK, &fl) != 0) {
            rc = -1;
            break;
        }
        if (fl.l_type == F_UNLCK) continue;
        int64_t s = fl.l_start, e = fl.l_len > 0 && fl.l_len <= INT64_MAX - fl.l_start ? fl.l_start + fl.l_len
                                                                                      : INT64_MAX;
        if (s < w.a) s = w.a;
        if (e > w.b) e = w.b;
        if (s >= e) { /* not in the window: cannot happen; never loop on it */
            rc = -1;
            break;
        }
        (*nlocks)++;
        for (int64_t k = (s - VGPU_LEDGER_LEASE_BASE) >> VGPU_LEDGER_WIN_SHIFT,
                     kl = (e - 1 - VGPU_LEDGER_LEASE_BASE) >> VGPU_LEDGER_WIN_SHIFT;
             k <= kl; k++) {
            int64_t lo = VGPU_LEDGER_LEASE_BASE + (k << VGPU_LEDGER_WIN_SHIFT), hi = lo + VGPU_LEDGER_WIN;
            if (lo < s) lo = s;
            if (hi > e) hi = e;
            tot[k % LEDGER_NWIN] = sat_add(tot[k % LEDGER_NWIN], (uint64_t)(hi - lo));
        }
        st[n++] = (struct win){w.a, s};
        st[n++] = (struct win){e, w.b};
    }
    free(st);
    return rc;
}

static int64_t lease_base(int region, int w) {
    return VGPU_LEDGER_LEASE_BASE + ((int64_t)(region * VGPU_MAX_DEV + w) << VGPU_LEDGER_WIN_SHIFT);
}

/* Window w's lease becomes len bytes (the lock clamps at the window's 2^40).
 * Growing re-locks the longer range (one atomic replacement), shrinking
 * unlocks the tail: the lock is never shorter than both. mem_mu held.
 * 0, or -1 (unchanged). */
static int lease_set(int w, uint64_t len) {
    uint64_t old = own_lease[w];
    if (lk_fd >= 0 && my_region >= 0) {
        uint64_t lo = old < (uint64_t)VGPU_LEDGER_WIN ? old : (uint64_t)VGPU_LEDGER_WIN;
        uint64_t ln = len < (uint64_t)VGPU_LEDGER_WIN ? len : (uint64_t)VGPU_LEDGER_WIN;
        int64_t base = lease_base(my_region, w);
        struct flock fl = {.l_whence = SEEK_SET};
        if (ln > lo) {
            fl.l_type = F_RDLCK;
            fl.l_start = base;
            fl.l_len = (off_t)ln;
        } else if (ln < lo) {
            fl.l_type = F_UNLCK;
            fl.l_start = base + (int64_t)ln;
            fl.l_len = (off_t)(lo - ln);
        }
        if (ln != lo && fcntl(lk_fd, F_OFD_SETLK, &fl) != 0) return -1;
    }
    own_lease[w] = len;
    return 0;
}

/* Claims a region: one whose mark byte nobody holds, under the flock so two
 * claimers cannot pick the same. 0, or -1 with cfg_err set. */
static int ledger_claim(void) {
    if (ledger_open() != 0) return -1;
    if (lk_fd < 0) return 0;
    if (ledger_lock() != 0) {
        snprintf(cfg_err, sizeof cfg_err, "ledger %s: its lock is held by another process", ledger_path());
        return -1;
    }
    int start = (int)((unsigned)getpid() % VGPU_LEDGER_NREG), got = -1;
    for (int k = 0; k < VGPU_LEDGER_NREG && got < 0; k++) {
        int r = (start + k) % VGPU_LEDGER_NREG;
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_LEDGER_MARK_BASE + r, .l_len = 1};
        if (fcntl(lk_fd, F_OFD_GETLK, &fl) != 0 || fl.l_type != F_UNLCK) continue;
        fl.l_type = F_RDLCK;
        if (fcntl(lk_fd, F_OFD_SETLK, &fl) == 0) got = r;
    }
    ledger_unlock();
    if (got < 0) {
        snprintf(cfg_err, sizeof cfg_err, "ledger %s: no free region", ledger_path());
        return -1;
    }
    my_region = got;
    return 0;
}

/* ------------------------------------------------------------------ */
/* this process's devices                                              */

struct ldev {
    CUdevice dev;
    int idx;          /* the container's GPU index (NVML order); -1 unknown */
    int e;            /* its ledger window: idx, or the last one for unknown devices */
    int ce;           /* entry in the accounting file */
    uint64_t cap;     /* this process's own memory cap, 0 = none */
    unsigned sm;      /* this process's own SM share, 0 = none */
    int prim;         /* primary context retains */
    uint64_t prim_charge;
    CUcontext prim_ctx; /* the primary context's handle (from a retain) */
    char uuid[64];
};
static struct ldev ldevs[VGPU_LDEV_MAX];
static int nldev;
static int n_cuda; /* devices the driver reports (nldev is at most VGPU_LDEV_MAX of them) */
static int any_sm;
/* the container's strictest cap / SM share per ldev as last read from the
 * accounting file (advisory: it can only tighten this process's own) */
static uint64_t adv_cap[VGPU_LDEV_MAX];
static unsigned adv_sm[VGPU_LDEV_MAX];

static int win_of(int idx) { return idx >= 0 && idx < LEDGER_NWIN ? idx : LEDGER_NWIN - 1; }

enum { ST_UNINIT = 0, ST_PASS = 1, ST_ACTIVE = 2, ST_ERROR = -1 };
static int g_state;
static int g_launch_fast; /* launches need no gating: tail-call the real one */
static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t local_mu = PTHREAD_MUTEX_INITIALIZER;

/* A forked child is a new process: it never charges or credits its parent's
 * memory (CUDA state does not survive fork anyway, so its allocations are
 * refused). Its copy of the ledger's descriptor is closed (the open file
 * description, and the parent's leases on it, stay the parent's); a later
 * query opens a fresh one. */
static void vgpu_atfork_child(void) {
    pthread_mutex_t init = PTHREAD_MUTEX_INITIALIZER;
    mem_mu = init;
    grant_mu = init;
    data_mu = init;
    lk_open_mu = init;
    tok_mu = init;
    mem_attached = 0;
    my_region = -1;
    my_slot = -1;
    memset(own_used, 0, sizeof own_used);
    memset(own_lease, 0, sizeof own_lease);
    if (lk_fd >= 0) close(lk_fd);
    lk_fd = -1;
}

static void fmt_uuid(const CUuuid *u, char *out, size_t n) {
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, n, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

static struct ldev *ldev_of(CUdevice dev) {
    for (int i = 0; i < nldev; i++)
        if (ldevs[i].dev == dev) return &ldevs[i];
    return NULL;
}

/* A device the driver reports that libvgpu has no entry for (past
 * VGPU_LDEV_MAX): calls that would hold memory on it are refused, never
 * passed through uncharged. */
#define LD_REFUSE ((struct ldev *)(uintptr_t)1)

/* dev's entry; LD_REFUSE for a device libvgpu cannot account for; NULL for
 * no device at all (the real call fails on its own). */
static struct ldev *ldev_for(CUdevice dev) {
    struct ldev *ld = ldev_of(dev);
    if (ld) return ld;
    return dev >= 0 && dev < n_cuda ? LD_REFUSE : NULL;
}

static CUresult refuse_dev(const char *what) {
    vgpu_log(VGPU_LOG_ERROR, "%s refused: the device is beyond the %d libvgpu can account for", what, VGPU_LDEV_MAX);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The current context's device (see ldev_for); NULL with no context. */
static struct ldev *cur_ldev(void) {
    if (nldev == 1 && n_cuda == 1) return &ldevs[0];
    CUdevice d;
    typedef CUresult (*getdev_t)(CUdevice *);
    if (!real_x[X_cuCtxGetDevice] || HELP(cuCtxGetDevice, getdev_t)(&d) != CUDA_SUCCESS) return NULL;
    return ldev_for(d);
}

/* Refreshes adv_cap/adv_sm from the accounting file's device entries (a
 * corrupt file leaves them as they were). */
static void adv_refresh(void) {
    struct vgpu_shm_dev devs[VGPU_MAX_DEV];
    struct vgpu_shm_hdr h;
    if (data_lock() != 0) return;
    int ok = cache_read(&h, sizeof h, 0) == 0 && hdr_valid(&h) && cache_read(devs, sizeof devs, DEVS_OFF) == 0;
    data_unlock();
    if (!ok) return;
    for (int i = 0; i < nldev; i++) {
        if (ldevs[i].ce < 0) continue;
        __atomic_store_n(&adv_cap[i], devs[ldevs[i].ce].mem_cap, __ATOMIC_RELAXED);
        __atomic_store_n(&adv_sm[i], devs[ldevs[i].ce].sm_pct, __ATOMIC_RELAXED);
    }
}

static void detach(void);
static void sm_forget_ctx(CUcontext ctx);
static void sm_return_all(void);

/* Slots that look dead, judged from a snapshot without the lock. slot_alive
 * reads /proc for every live member: done under the lock, a container's
 * processes starting together would do those reads one after another. */
static int dead_candidates(struct vgpu_shm *img, int *out) {
    int n = 0;
    if (cache_load(img) != 0) return 0;
    for (int i = 0; i < (int)img_n(img); i++)
        if (img->slots[i].pid && !slot_alive(img, i)) out[n++] = i;
    return n;
}

/* A device entry takes this process's limits: the strictest of the live
 * ones stays (0 = none). Warns when they differ. */
static void dev_merge(struct vgpu_shm_dev *d, const struct ldev *ld) {
    if ((d->mem_cap && d->mem_cap != ld->cap) || (d->sm_pct && d->sm_pct != ld->sm))
        vgpu_log(VGPU_LOG_WARN,
                 "%s: this process's limits (memory %llu, sm %u%%) differ from its container's (memory "
                 "%llu, sm %u%%); the stricter hold",
                 ld->uuid, (unsigned long long)ld->cap, ld->sm, (unsigned long long)d->mem_cap, d->sm_pct);
    d->win = (uint32_t)ld->e + 1;
}

/* This process's slot in `img` (identity, its own caps and SM share) and its
 * devices' entries (found or made, merged); `tighten`: its limits also tighten the
 * entries at once (the full path recomputes them from every slot instead).
 * -1 when the file has no device entry left (nothing is written here). */
static int slot_fill(struct vgpu_shm *img, int slot, int n, uint64_t my_start, int32_t my_host_pid,
                     int tighten) {
    struct vgpu_shm_slot *s = &img->slots[slot];
    memset(s, 0, sizeof *s);
    s->start_time = my_start;
    s->pidns = my_pidns;
    s->host_pid = my_host_pid;
    for (int i = 0; i < n; i++) {
        struct ldev *ld = &ldevs[i];
        ld->ce = shm_dev(img, ld->uuid, 1);
        if (ld->ce < 0) continue; /* no entry left: capped by its ledger window; SM launches refused */
        struct vgpu_shm_dev *d = &img->devs[ld->ce];
        dev_merge(d, ld);
        if (tighten) {
            if (ld->cap && (!d->mem_cap || ld->cap < d->mem_cap)) d->mem_cap = ld->cap;
            if (ld->sm && (!d->sm_pct || ld->sm < d->sm_pct)) d->sm_pct = ld->sm;
        }
        s->mem_cap[ld->ce] = ld->cap;
        s->sm[ld->ce] = ld->sm;
    }
    s->pid = (int32_t)my_pid;
    return 0;
}

/* attach's common case, the accounting file's lock held: no dead slot in
 * the snapshot `img` (so the device entries are the live members' already),
 * so only the header and device entries are read (2 KiB, not the whole
 * 354 KiB file, which 64 processes starting together would read one after
 * another), a slot free in the snapshot is taken by its lock, and this
 * process's limits tighten the entries. 0 done, 1 not possible here (the
 * caller takes the full path; nothing was written), -1 error (cfg_err). */
static int attach_fast(struct vgpu_shm *img, int n, uint64_t my_start, int32_t my_host_pid) {
    if (cache_fd < 0) return 1;
    int snap = hdr_valid(&img->hdr) ? (int)img_n(img) : 0; /* the snapshot's slots: hints only */
    if (cache_read(img, DEVS_OFF + sizeof img->devs, 0) != 0 || !hdr_valid(&img->hdr)) return 1;
    int slot = -1;
    for (int i = 0; i < VGPU_MAX_SLOTS && slot < 0; i++) {
        if (i < snap && img->slots[i].pid) continue;
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCKBASE + i, .l_len = 1};
        if (fcntl(cache_fd, F_OFD_SETLK, &fl) != 0) continue;
        int32_t pid = -1;
        if (cache_read(&pid, sizeof pid, SLOT_OFF(i)) == 0 && pid == 0) {
            slot = i;
        } else { /* written since the snapshot: the full path judges it */
            fl.l_type = F_UNLCK;
            fcntl(cache_fd, F_OFD_SETLK, &fl);
        }
    }
    if (slot < 0) return 1;
    struct vgpu_shm_slot *s = &img->slots[slot];
    int rc = 0;
    if (slot_fill(img, slot, n, my_start, my_host_pid, 1) != 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: too many devices", cfg.cache);
        rc = -1;
    } else if (hwm_cover(img, slot) != 0 || cache_write(s, sizeof *s, SLOT_OFF(slot)) != 0 ||
               cache_write(img->devs, sizeof img->devs, DEVS_OFF) != 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: cannot write it", cfg.cache);
        rc = -1;
    }
    if (rc) {
        struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCKBASE + slot, .l_len = 1};
        fcntl(cache_fd, F_OFD_SETLK, &fl);
        return -1;
    }
    my_slot = slot;
    for (int i = 0; i < n; i++)
        if (ldevs[i].sm) any_sm = 1;
    return 0;
}

/* After the real cuInit: maps devices, opens the accounting file and the
 * ledger, claims a ledger region and a slot. */
static int attach(void) {
    typedef CUresult (*count_t)(int *);
    typedef CUresult (*get_t)(CUdevice *, int);
    typedef CUresult (*uuid_t_)(CUuuid *, CUdevice);
    if (!real_x[X_cuDeviceGetCount] || !real_x[X_cuDeviceGet] || !real_x[X_cuDeviceGetUuid]) {
        snprintf(cfg_err, sizeof cfg_err, "libcuda lacks cuDeviceGetCount/cuDeviceGet/cuDeviceGetUuid");
        return -1;
    }
    pthread_once(&nvml_once, resolve_nvml);
    int n = 0;
    if (HELP(cuDeviceGetCount, count_t)(&n) != CUDA_SUCCESS) n = 0;
    n_cuda = n;
    if (n > VGPU_LDEV_MAX) {
        vgpu_log(VGPU_LOG_WARN, "the driver reports %d devices; devices %d and up are refused (libvgpu accounts for %d)",
                 n, VGPU_LDEV_MAX, VGPU_LDEV_MAX);
        n = VGPU_LDEV_MAX;
    }
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    for (int i = 0; i < n; i++) {
        struct ldev *ld = &ldevs[i];
        CUuuid u;
        memset(ld, 0, sizeof *ld);
        ld->idx = -1;
        if (HELP(cuDeviceGet, get_t)(&ld->dev, i) != CUDA_SUCCESS) ld->dev = i;
        if (HELP(cuDeviceGetUuid, uuid_t_)(&u, ld->dev) == CUDA_SUCCESS) fmt_uuid(&u, ld->uuid, sizeof ld->uuid);
        else snprintf(ld->uuid, sizeof ld->uuid, "cuda-%d", i);
        if (nvml_ok) ld->idx = nvml_index_of(ld->uuid);
        else if (!cvd) ld->idx = i; /* no NVML: CUDA order is the container's order */
        if (ld->idx >= 0 && ld->idx < VGPU_MAX_DEV) {
            ld->cap = cfg.mem[ld->idx];
            ld->sm = cfg.sm[ld->idx];
        } else {
            /* cannot tell which of the container's GPUs this is, or it has no
             * variables of its own: fail closed */
            ld->cap = cfg.mem_any;
            ld->sm = cfg.sm_any;
            vgpu_log(VGPU_LOG_WARN, "device %d (%s): container GPU %d has no limits of its own; applying the strictest",
                     i, ld->uuid, ld->idx);
        }
        ld->e = win_of(ld->idx); /* unknown devices share one window: they can only lose */
        vgpu_log(VGPU_LOG_DEBUG, "cuda device %d = %s = container GPU %d: memory cap %llu, sm %u%%", i, ld->uuid,
                 ld->idx, (unsigned long long)ld->cap, ld->sm);
    }
    if (cache_open(cfg.cache) < 0 || ledger_claim() < 0) return -1;
    uint64_t my_start = proc_start_time(my_pid);
    int32_t my_host_pid = host_pid_of_self();
    struct vgpu_shm *img = calloc(1, sizeof *img); /* untouched pages: no faults */
    int *cand = malloc(VGPU_MAX_SLOTS * sizeof *cand);
    if (!img || !cand) {
        free(img);
        free(cand);
        snprintf(cfg_err, sizeof cfg_err, "out of memory");
        return -1;
    }
    int ncand = dead_candidates(img, cand);
    int rc = -1;
    if (data_lock() != 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: its lock is held by another process", cfg.cache);
        goto out;
    }
    if (ncand == 0) {
        int f = attach_fast(img, n, my_start, my_host_pid);
        if (f < 0) goto unlock;
        if (f == 0) goto done;
    }
    if (cache_load(img) != 0) {
        /* overwritten since cache_open: start it afresh (it holds no memory) */
        memset(img, 0, sizeof *img);
        hdr_init(&img->hdr);
        if (cache_write(img, sizeof *img, 0) != 0) {
            snprintf(cfg_err, sizeof cfg_err, "accounting file %s: cannot initialise it", cfg.cache);
            goto unlock;
        }
        ncand = 0;
    }
    reap(img, cand, ncand);
    int slot = -1;
    for (int pass = 0; pass < 2 && slot < 0; pass++) {
        if (pass) reap(img, NULL, 0); /* all taken: judge every member under the lock */
        for (int i = 0; i < VGPU_MAX_SLOTS && slot < 0; i++) {
            if (i < (int)img_n(img) && img->slots[i].pid) continue;
            if (cache_fd >= 0) {
                struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCKBASE + i,
                                   .l_len = 1};
                if (fcntl(cache_fd, F_OFD_SETLK, &fl) != 0) continue;
            }
            slot = i;
        }
    }
    if (slot < 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: no free process slot", cfg.cache);
        goto unlock;
    }
    struct vgpu_shm_slot *s = &img->slots[slot];
    if (slot_fill(img, slot, n, my_start, my_host_pid, 0) != 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: too many devices", cfg.cache);
        goto unlock;
    }
    for (int i = 0; i < n; i++)
        if (ldevs[i].sm) any_sm = 1;
    my_slot = slot;
    recompute(img);
    if (hwm_cover(img, slot) != 0 || cache_write(s, sizeof *s, SLOT_OFF(slot)) != 0 ||
        cache_write(img->devs, sizeof img->devs, DEVS_OFF) != 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: cannot write it", cfg.cache);
        goto unlock;
    }
done:
    for (int i = 0; i < n; i++) {
        if (ldevs[i].ce < 0) continue;
        adv_cap[i] = img->devs[ldevs[i].ce].mem_cap;
        adv_sm[i] = img->devs[ldevs[i].ce].sm_pct;
        if (adv_sm[i]) any_sm = 1;
    }
    rc = 0;
unlock:
    data_unlock();
out:
    free(img);
    free(cand);
    if (rc == 0) {
        nldev = n;
        pthread_mutex_lock(&mem_mu);
        mem_attached = 1;
        pthread_mutex_unlock(&mem_mu);
    }
    return rc;
}

static void detach(void) {
    if (my_slot < 0 || (cache_fd < 0 && !priv_img)) return;
    sm_return_all();
    struct vgpu_shm *img = calloc(1, sizeof *img); /* untouched pages: no faults */
    if (!img) return;
    if (data_lock() == 0) {
        if (cache_load(img) == 0) {
            memset(&img->slots[my_slot], 0, sizeof img->slots[my_slot]);
            cache_write(&img->slots[my_slot], sizeof img->slots[my_slot], SLOT_OFF(my_slot));
            recompute(img);
            cache_write(img->devs, sizeof img->devs, DEVS_OFF);
        }
        data_unlock();
    }
    free(img);
    my_slot = -1;
}

__attribute__((destructor)) static void vgpu_fini(void) { detach(); }

/* Slow path of every wrapper: loads config, resolves the driver, attaches.
 * Returns ST_PASS, ST_ACTIVE or ST_ERROR. */
static int vgpu_enter_slow(int call_cuinit) {
    pthread_once(&cfg_once, cfg_load);
    pthread_once(&cuda_once, resolve_cuda);
    pthread_mutex_lock(&init_mu);
    int st = __atomic_load_n(&g_state, __ATOMIC_ACQUIRE);
    if (st != ST_UNINIT) goto out;
    if (cfg_rc < 0) {
        st = ST_ERROR;
    } else if (!cfg.active) {
        st = ST_PASS;
    } else if (!REAL(cuInit)) {
        st = ST_ERROR;
    } else {
        if (call_cuinit && REAL(cuInit)(0) != CUDA_SUCCESS) goto out; /* stays uninitialised */
        if (attach() < 0) {
            vgpu_log(VGPU_LOG_ERROR, "%s", cfg_err);
            st = ST_ERROR;
        } else {
            st = ST_ACTIVE;
        }
    }
    __atomic_store_n(&g_launch_fast, st == ST_PASS || (st == ST_ACTIVE && !any_sm), __ATOMIC_RELEASE);
    __atomic_store_n(&g_state, st, __ATOMIC_RELEASE);
out:
    pthread_mutex_unlock(&init_mu);
    return st;
}

static inline int vgpu_enter(void) {
    int st = __atomic_load_n(&g_state, __ATOMIC_ACQUIRE);
    if (LIKELY(st > 0)) return st;
    if (st == ST_ERROR) return st;
    return vgpu_enter_slow(1);
}

/* ------------------------------------------------------------------ */
/* memory accounting                                                   */

static uint64_t cap_of(const struct ldev *ld) {
    uint64_t cap = ld->cap, c2 = __atomic_load_n(&adv_cap[ld - ldevs], __ATOMIC_RELAXED);
    if (c2 && (!cap || c2 < cap)) cap = c2;
    return cap;
}

/* The slow path: under the ledger's flock, a census of the others' leases;
 * granted iff others + own usage + bytes <= cap, and the lease set to the new
 * usage plus some slack (none near the cap, so the cap stays exact). */
static int charge_slow(const struct ldev *ld, uint64_t bytes) {
    int w = ld->e, rc = -1;
    uint64_t others[LEDGER_NWIN] = {0}, used = 0, cap;
    unsigned k = 0;
    const char *why = NULL;
    pthread_mutex_lock(&grant_mu);
    adv_refresh();
    cap = cap_of(ld);
    if (ledger_lock() != 0) {
        why = "the container's memory ledger is locked by another process (waited 10 s)";
        goto out;
    }
    if (census(others, &k) != 0) {
        why = "the container's memory ledger holds too many locks";
        goto unlock;
    }
    pthread_mutex_lock(&mem_mu);
    used = own_used[w];
    if (mem_attached) {
        uint64_t need = sat_add(sat_add(others[w], used), bytes);
        if (!cap || need <= cap) {
            uint64_t room = cap ? cap - need : UINT64_MAX, slack = 0;
            if (room >= LEDGER_SLACK_ROOM && (!cap || room >= cap / 4)) {
                slack = room / (2 * ((uint64_t)k + 1));
                if (slack > LEDGER_CHUNK) slack = LEDGER_CHUNK;
            }
            own_tight[w] = slack == 0;
            if (lease_set(w, used + bytes + slack) == 0 || (slack && lease_set(w, used + bytes) == 0)) {
                own_used[w] = used + bytes;
                rc = 0;
            } else {
                why = "cannot lock its lease";
            }
        } else if (own_lease[w] > used) {
            own_tight[w] = 1;
            lease_set(w, used); /* near the cap: show the others our room */
        }
    }
    pthread_mutex_unlock(&mem_mu);
unlock:
    ledger_unlock();
out:
    pthread_mutex_unlock(&grant_mu);
    if (why)
        vgpu_log(VGPU_LOG_ERROR, "%s: %llu bytes refused: %s", ld->uuid, (unsigned long long)bytes, why);
    else if (rc)
        vgpu_log(VGPU_LOG_INFO, "%s: %llu bytes refused: container uses %llu of its cap %llu", ld->uuid,
                 (unsigned long long)bytes, (unsigned long long)sat_add(others[w], used), (unsigned long long)cap);
    return rc;
}

/* Charges bytes (cap checked); 0 or -1 (over the cap). Within this
 * process's lease: no system call. */
static int charge(const struct ldev *ld, uint64_t bytes) {
    int w = ld->e;
    pthread_mutex_lock(&mem_mu);
    if (LIKELY(mem_attached && bytes <= own_lease[w] - own_used[w])) {
        own_used[w] += bytes;
        pthread_mutex_unlock(&mem_mu);
        return 0;
    }
    int attached = mem_attached;
    pthread_mutex_unlock(&mem_mu);
    return attached ? charge_slow(ld, bytes) : -1;
}

/* Credits bytes back (clamped at zero). The lease shrinks when its unused
 * part passes a chunk, and to the usage itself near the cap. */
static void credit(int w, uint64_t bytes) {
    pthread_mutex_lock(&mem_mu);
    if (bytes > own_used[w]) bytes = own_used[w]; /* never below zero */
    uint64_t used = own_used[w] -= bytes, lease = own_lease[w];
    if (lease > used && (own_tight[w] || lease - used > LEDGER_CHUNK))
        lease_set(w, own_tight[w] ? used : used + LEDGER_CHUNK); /* failure: the bigger lease stays */
    pthread_mutex_unlock(&mem_mu);
}

/* The container's usage on window w: the census plus this process's own
 * (its own leases are invisible to its census). 0, or -1 (fail closed). */
static int container_used(int w, uint64_t *used) {
    uint64_t others[LEDGER_NWIN];
    unsigned k;
    if (census(others, &k) != 0) return -1;
    pthread_mutex_lock(&mem_mu);
    *used = sat_add(others[w], own_used[w]);
    pthread_mutex_unlock(&mem_mu);
    return 0;
}

/* process-local maps: device pointer / VMM handle / array / context -> size.
 * ctx: the context current at allocation (pointers, arrays), whose destruction
 * frees the allocation in the driver. */
struct pm_ent {
    uint64_t key;
    uint64_t size;
    uint64_t ctx;
    int32_t e;
    uint32_t pool; /* stream-ordered: its pool's entry id (0 = none known) */
};
struct ptrmap {
    struct pm_ent *t;
    size_t cap, n;
};
enum { MAP_PTR, MAP_VMM, MAP_ARRAY, MAP_CTX, MAP_N };
static struct ptrmap maps[MAP_N];

static inline size_t pm_hash(uint64_t k, size_t mask) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (size_t)k & mask;
}

static int pm_grow(struct ptrmap *m) {
    size_t ncap = m->cap ? m->cap * 2 : 1024;
    struct pm_ent *nt = calloc(ncap, sizeof *nt);
    if (!nt) return -1;
    for (size_t i = 0; i < m->cap; i++)
        if (m->t[i].key) {
            size_t j = pm_hash(m->t[i].key, ncap - 1);
            while (nt[j].key) j = (j + 1) & (ncap - 1);
            nt[j] = m->t[i];
        }
    free(m->t);
    m->t = nt;
    m->cap = ncap;
    return 0;
}

static void pm_put_full(int which, uint64_t key, uint64_t size, int e, uint64_t ctx, uint32_t pool) {
    struct ptrmap *m = &maps[which];
    pthread_mutex_lock(&local_mu);
    if ((m->n + 1) * 2 > m->cap && pm_grow(m) < 0) {
        pthread_mutex_unlock(&local_mu);
        return;
    }
    size_t mask = m->cap - 1, i = pm_hash(key, mask);
    while (m->t[i].key && m->t[i].key != key) i = (i + 1) & mask;
    if (!m->t[i].key) m->n++;
    m->t[i].key = key;
    m->t[i].size = size;
    m->t[i].e = e;
    m->t[i].ctx = ctx;
    m->t[i].pool = pool;
    pthread_mutex_unlock(&local_mu);
}

static void pm_put_ctx(int which, uint64_t key, uint64_t size, int e, uint64_t ctx) {
    pm_put_full(which, key, size, e, ctx, 0);
}

static void ent_credit(const struct pm_ent *ent); /* a freed entry's bytes (through its pool) */

static void pm_put(int which, uint64_t key, uint64_t size, int e) { pm_put_ctx(which, key, size, e, 0); }

/* The context current on this thread (0 if none or unknown). */
static uint64_t current_ctx(void) {
    typedef CUresult (*getcur_t)(CUcontext *);
    CUcontext c = NULL;
    if (!real_x[X_cuCtxGetCurrent] || HELP(cuCtxGetCurrent, getcur_t)(&c) != CUDA_SUCCESS) return 0;
    return (uint64_t)(uintptr_t)c;
}

/* Removes key; 1 with its entry in *out, or 0. */
static int pm_take(int which, uint64_t key, struct pm_ent *out) {
    struct ptrmap *m = &maps[which];
    pthread_mutex_lock(&local_mu);
    if (!m->cap || !key) {
        pthread_mutex_unlock(&local_mu);
        return 0;
    }
    size_t mask = m->cap - 1, i = pm_hash(key, mask);
    while (m->t[i].key && m->t[i].key != key) i = (i + 1) & mask;
    if (!m->t[i].key) {
        pthread_mutex_unlock(&local_mu);
        return 0;
    }
    *out = m->t[i];
    m->t[i].key = 0;
    m->n--;
    /* backward-shift deletion keeps probe chains intact */
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!m->t[j].key) break;
        size_t k = pm_hash(m->t[j].key, mask);
        if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) {
            m->t[i] = m->t[j];
            m->t[j].key = 0;
            i = j;
        }
    }
    pthread_mutex_unlock(&local_mu);
    return 1;
}

/* The driver frees a context's allocations with it: credit what this process
 * recorded against ctx (pointers and arrays), so the cap gets them back. */
static void pm_drop_ctx(uint64_t ctx) {
    if (!ctx) return;
    static const int kinds[] = {MAP_PTR, MAP_ARRAY};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        struct ptrmap *m = &maps[kinds[k]];
        for (;;) { /* take one at a time: deletion shifts entries */
            uint64_t key = 0;
            pthread_mutex_lock(&local_mu);
            for (size_t i = 0; i < m->cap; i++)
                if (m->t[i].key && m->t[i].ctx == ctx) {
                    key = m->t[i].key;
                    break;
                }
            pthread_mutex_unlock(&local_mu);
            struct pm_ent ent;
            if (!key || !pm_take(kinds[k], key, &ent)) break;
            ent_credit(&ent);
        }
    }
}

/* ------------------------------------------------------------------ */
/* VMM: the charge follows the driver's lifetime of physical memory      */
/* A handle's memory lives until its last reference (cuMemCreate, each   */
/* cuMemRetainAllocationHandle) is released AND its last mapping is      */
/* unmapped: cuMemCreate charges, and the bytes come back only when both */
/* counts reach zero (a release while mapped, as PyTorch's expandable    */
/* segments do, keeps the charge until the unmap).                       */

struct vmm_h {
    uint64_t h, size;
    int e, refs, maps;
};
struct vmm_m {
    uint64_t va, len, h;
};
static struct vmm_h *vmm_hs;
static struct vmm_m *vmm_ms;
static size_t vmm_nh, vmm_ch, vmm_nm, vmm_cm;
static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;

static int grow(void **p, size_t *cap, size_t n, size_t esz) {
    if (n < *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 64;
    void *np = realloc(*p, nc * esz);
    if (!np) return -1;
    *p = np;
    *cap = nc;
    return 0;
}

/* the oldest entry for h (a handle value the driver reused comes later) */
static long vmm_find(uint64_t h) {
    for (size_t i = 0; i < vmm_nh; i++)
        if (vmm_hs[i].h == h) return (long)i;
    return -1;
}

/* Credits and forgets handle i once nothing holds its memory. vmm_mu held. */
static void vmm_settle(long i) {
    struct vmm_h *v = &vmm_hs[i];
    if (v->refs > 0 || v->maps > 0) return;
    credit(v->e, v->size);
    memmove(v, v + 1, (vmm_nh - (size_t)i - 1) * sizeof *v);
    vmm_nh--;
}

static void vmm_add(uint64_t h, uint64_t size, int e) {
    pthread_mutex_lock(&vmm_mu);
    if (grow((void **)&vmm_hs, &vmm_ch, vmm_nh, sizeof *vmm_hs) == 0)
        vmm_hs[vmm_nh++] = (struct vmm_h){h, size, e, 1, 0};
    /* else: never credited (the process only loses) */
    pthread_mutex_unlock(&vmm_mu);
}

/* One reference more (retain) or less (release) that the driver accepted. */
static void vmm_ref(uint64_t h, int delta) {
    pthread_mutex_lock(&vmm_mu);
    long i = vmm_find(h);
    if (i >= 0) {
        vmm_hs[i].refs += delta;
        vmm_settle(i);
    }
    pthread_mutex_unlock(&vmm_mu);
}

static void vmm_mapped(uint64_t va, uint64_t len, uint64_t h) {
    pthread_mutex_lock(&vmm_mu);
    long i = vmm_find(h);
    if (i >= 0 && grow((void **)&vmm_ms, &vmm_cm, vmm_nm, sizeof *vmm_ms) == 0) {
        vmm_hs[i].maps++;
        vmm_ms[vmm_nm++] = (struct vmm_m){va, len, h};
    } else if (i >= 0) {
        vmm_hs[i].refs = 1 << 30; /* cannot follow its mappings: never credited */
    }
    pthread_mutex_unlock(&vmm_mu);
}

/* The mappings that start in [va, va + len) are gone. */
static void vmm_unmapped(uint64_t va, uint64_t len) {
    pthread_mutex_lock(&vmm_mu);
    for (size_t k = 0; k < vmm_nm;) {
        struct vmm_m m = vmm_ms[k];
        if (m.va < va || m.va - va >= len) {
            k++;
            continue;
        }
        vmm_ms[k] = vmm_ms[--vmm_nm];
        long i = vmm_find(m.h);
        if (i >= 0) {
            vmm_hs[i].maps--;
            vmm_settle(i);
        }
    }
    pthread_mutex_unlock(&vmm_mu);
}

/* ------------------------------------------------------------------ */
/* CUDA wrappers                                                       */

/* A driver whose exported functions call each other through the PLT (the
 * simulated one: cuCtxCreate_v3 -> cuCtxCreate_v2, cuLaunchKernelEx ->
 * cuLaunchKernel) would re-enter our wrappers from inside a real call and
 * count twice: calls made while this thread is inside a real call pass
 * straight through. */
static __thread int vgpu_nested __attribute__((tls_model("initial-exec")));
#define NESTED(expr) ({ vgpu_nested++; __typeof__(expr) r__ = (expr); vgpu_nested--; r__; })

#define ENTER_OR(errret)                                       \
    if (UNLIKELY(vgpu_nested)) return errret;                  \
    int st_ = vgpu_enter();                                    \
    if (UNLIKELY(st_ == ST_ERROR)) return CUDA_ERROR_NOT_INITIALIZED; \
    if (st_ != ST_ACTIVE) return errret;

EXPORT CUresult cuInit(unsigned int flags) {
    pthread_once(&cfg_once, cfg_load);
    pthread_once(&cuda_once, resolve_cuda);
    if (cfg_rc < 0) return CUDA_ERROR_INVALID_VALUE; /* fail closed; stderr names the variable */
    if (!REAL(cuInit)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuInit)(flags);
    if (r != CUDA_SUCCESS) return r;
    int st = vgpu_enter_slow(0);
    return st == ST_ERROR ? CUDA_ERROR_INVALID_VALUE : r;
}

/* The generic alloc-then-record pattern: charge first, credit on failure. */
#define ALLOC_BODY(realcall, ptrexpr, size, mapkind)                      \
    do {                                                                  \
        struct ldev *ld = cur_ldev();                                     \
        if (!ld) return realcall;                                         \
        if (ld == LD_REFUSE) return refuse_dev("an allocation");          \
        uint64_t sz_ = (uint64_t)(size);                                  \
        if (charge(ld, sz_) < 0) return CUDA_ERROR_OUT_OF_MEMORY;         \
        CUresult r_ = NESTED(realcall);                                   \
        if (r_ != CUDA_SUCCESS) {                                         \
            credit(ld->e, sz_);                                           \
            return r_;                                                    \
        }                                                                 \
        pm_put_ctx(mapkind, (uint64_t)(ptrexpr), sz_, ld->e, current_ctx()); \
        return r_;                                                        \
    } while (0)

/* The generic forget-then-free pattern: the entry leaves the map before the
 * real call (a racing free of the same key credits nothing twice); on success
 * its size is credited, on failure the whole entry goes back. */
#define FREE_BODY(mapkind, k, realcall)                                    \
    do {                                                                  \
        struct pm_ent ent_;                                               \
        int had_ = pm_take(mapkind, (uint64_t)(uintptr_t)(k), &ent_);    \
        CUresult r_ = NESTED(realcall);                                   \
        if (had_) {                                                       \
            if (r_ == CUDA_SUCCESS) ent_credit(&ent_);                   \
            else pm_put_full(mapkind, ent_.key, ent_.size, ent_.e, ent_.ctx, ent_.pool); \
        }                                                                 \
        return r_;                                                        \
    } while (0)

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    ENTER_OR(REAL(cuMemAlloc_v2)(dptr, bytesize));
    if (!dptr) return REAL(cuMemAlloc_v2)(dptr, bytesize);
    ALLOC_BODY(REAL(cuMemAlloc_v2)(dptr, bytesize), *dptr, bytesize, MAP_PTR);
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    ENTER_OR(REAL(cuMemAllocManaged)(dptr, bytesize, flags));
    if (!dptr) return REAL(cuMemAllocManaged)(dptr, bytesize, flags);
    ALLOC_BODY(REAL(cuMemAllocManaged)(dptr, bytesize, flags), *dptr, bytesize, MAP_PTR);
}

/* ---- stream-ordered allocation: charged to the device and the lifetime
 * that own the memory. The pool's device (cuMemAllocAsync: the device of the
 * stream's context, whose current pool serves it), not the current context's;
 * recorded against the stream's context, whose destruction frees it (the
 * current context may be a throw-away one). */

/* A pool's charge is the larger of what it handed out (and libvgpu charged)
 * and what it reserves on the GPU: a pool keeps freed memory up to its
 * release threshold, so a free credits only what the pool really gave back,
 * and cuMemPoolTrimTo / cuMemPoolDestroy the rest. Every adjustment after
 * the charge made before an allocation is a credit: the cap never needs a
 * second check. */
struct pool_ent {
    uint64_t pool;
    CUdevice dev;
    int e;          /* its device's ledger window; -1: not accountable */
    uint32_t id;    /* what allocations remember (handles are reused) */
    uint64_t out;   /* bytes handed out and not freed */
    uint64_t chg;   /* bytes charged for it: max(out, reserved) as last seen */
};
static struct pool_ent *pools_t;
static size_t pools_n, pools_c;
static uint32_t pool_ids;
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;

#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5

static long pool_find(uint64_t pool) {
    for (size_t i = 0; i < pools_n; i++)
        if (pools_t[i].pool == pool) return (long)i;
    return -1;
}

static long pool_find_id(uint32_t id) {
    for (size_t i = 0; id && i < pools_n; i++)
        if (pools_t[i].id == id) return (long)i;
    return -1;
}

static void pool_note(CUmemoryPool pool, CUdevice dev) {
    pthread_mutex_lock(&pool_mu);
    long i = pool_find((uint64_t)(uintptr_t)pool);
    if (i < 0 && grow((void **)&pools_t, &pools_c, pools_n, sizeof *pools_t) == 0) {
        struct ldev *ld = ldev_for(dev);
        pools_t[pools_n] = (struct pool_ent){(uint64_t)(uintptr_t)pool, dev,
                                             ld && ld != LD_REFUSE ? ld->e : -1, ++pool_ids, 0, 0};
        pools_n++;
    }
    pthread_mutex_unlock(&pool_mu);
}

/* Credits what pool i no longer holds: its charge comes down to
 * max(out, reserved), or to `out` when gone (or the driver cannot say). pool_mu held. */
static void pool_settle(long i, int gone) {
    typedef CUresult (*pattr_t)(CUmemoryPool, int, void *);
    struct pool_ent *p = &pools_t[i];
    uint64_t target = p->out, res = 0;
    if (!gone && real_x[X_cuMemPoolGetAttribute] &&
        NESTED(HELP(cuMemPoolGetAttribute, pattr_t)((CUmemoryPool)(uintptr_t)p->pool,
                                                    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res)) == CUDA_SUCCESS &&
        res > target)
        target = res;
    if (p->chg > target && p->e >= 0) {
        credit(p->e, p->chg - target);
        p->chg = target;
    }
}

static void pool_forget(CUmemoryPool pool) {
    pthread_mutex_lock(&pool_mu);
    long i = pool_find((uint64_t)(uintptr_t)pool);
    if (i >= 0) {
        pool_settle(i, 1); /* what it kept went with it; its allocations keep their own charges */
        pools_t[i] = pools_t[--pools_n];
    }
    pthread_mutex_unlock(&pool_mu);
}

static void ent_credit(const struct pm_ent *ent) {
    if (ent->pool) {
        pthread_mutex_lock(&pool_mu);
        long i = pool_find_id(ent->pool);
        if (i >= 0) {
            struct pool_ent *p = &pools_t[i];
            uint64_t b = ent->size < p->out ? ent->size : p->out;
            p->out -= b;
            pool_settle(i, 0);
            pthread_mutex_unlock(&pool_mu);
            return;
        }
        pthread_mutex_unlock(&pool_mu);
    }
    credit(ent->e, ent->size);
}

EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    ENTER_OR(REAL(cuMemPoolTrimTo)(pool, keep));
    CUresult r = NESTED(REAL(cuMemPoolTrimTo)(pool, keep));
    if (r == CUDA_SUCCESS) {
        pthread_mutex_lock(&pool_mu);
        long i = pool_find((uint64_t)(uintptr_t)pool);
        if (i >= 0) pool_settle(i, 0);
        pthread_mutex_unlock(&pool_mu);
    }
    return r;
}

/* 0 with the pool's device, or -1: a pool libvgpu never saw made */
static int pool_dev(CUmemoryPool pool, CUdevice *dev) {
    pthread_mutex_lock(&pool_mu);
    long i = pool_find((uint64_t)(uintptr_t)pool);
    if (i >= 0) *dev = pools_t[i].dev;
    pthread_mutex_unlock(&pool_mu);
    return i >= 0 ? 0 : -1;
}

EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    ENTER_OR(REAL(cuMemPoolCreate)(pool, props));
    CUresult r = NESTED(REAL(cuMemPoolCreate)(pool, props));
    if (r == CUDA_SUCCESS && pool && props && props->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        pool_note(*pool, props->location.id);
    return r;
}

EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    ENTER_OR(REAL(cuMemPoolDestroy)(pool));
    CUresult r = NESTED(REAL(cuMemPoolDestroy)(pool));
    if (r == CUDA_SUCCESS) pool_forget(pool); /* its allocations keep their charges until freed */
    return r;
}

EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    ENTER_OR(REAL(cuDeviceGetDefaultMemPool)(pool, dev));
    CUresult r = NESTED(REAL(cuDeviceGetDefaultMemPool)(pool, dev));
    if (r == CUDA_SUCCESS && pool) pool_note(*pool, dev);
    return r;
}

EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    ENTER_OR(REAL(cuDeviceGetMemPool)(pool, dev));
    CUresult r = NESTED(REAL(cuDeviceGetMemPool)(pool, dev));
    if (r == CUDA_SUCCESS && pool) pool_note(*pool, dev);
    return r;
}

#define CU_STREAM_LEGACY_ ((CUstream)0x1)

/* The context ctx's device (see ldev_for); NULL if the driver cannot say. */
static struct ldev *ctx_ldev(CUcontext ctx) {
    typedef CUresult (*push_t)(CUcontext);
    typedef CUresult (*pop_t)(CUcontext *);
    typedef CUresult (*getdev_t)(CUdevice *);
    if ((uint64_t)(uintptr_t)ctx == current_ctx()) return cur_ldev();
    if (!real_x[X_cuCtxPushCurrent_v2] || !real_x[X_cuCtxPopCurrent_v2] || !real_x[X_cuCtxGetDevice])
        return LD_REFUSE;
    if (HELP(cuCtxPushCurrent_v2, push_t)(ctx) != CUDA_SUCCESS) return NULL;
    CUdevice d;
    CUresult r = HELP(cuCtxGetDevice, getdev_t)(&d);
    CUcontext popped;
    HELP(cuCtxPopCurrent_v2, pop_t)(&popped);
    return r == CUDA_SUCCESS ? ldev_for(d) : NULL;
}

/* Who owns a stream-ordered allocation: *ld the device to charge (NULL: let
 * the driver refuse; LD_REFUSE: refuse), *ctx the context whose destruction
 * frees it. 0, or the driver's error for the stream. */
static CUresult async_owner(CUstream s, const CUmemoryPool *pool, struct ldev **ld, uint64_t *ctx) {
    typedef CUresult (*sctx_t)(CUstream, CUcontext *);
    CUcontext c = NULL;
    if (!s || s == CU_STREAM_LEGACY_ || s == CU_STREAM_PER_THREAD) {
        c = (CUcontext)(uintptr_t)current_ctx();
    } else if (!real_x[X_cuStreamGetCtx]) {
        *ld = LD_REFUSE; /* cannot tell: fail closed */
        return CUDA_SUCCESS;
    } else {
        CUresult r = HELP(cuStreamGetCtx, sctx_t)(s, &c);
        if (r != CUDA_SUCCESS) return r;
    }
    *ctx = (uint64_t)(uintptr_t)c;
    if (pool) {
        CUdevice d;
        if (pool_dev(*pool, &d) != 0) {
            vgpu_log(VGPU_LOG_ERROR, "allocation from a memory pool libvgpu did not see made (imported?) refused");
            *ld = LD_REFUSE;
        } else {
            *ld = ldev_for(d);
        }
    } else {
        *ld = c ? ctx_ldev(c) : NULL;
    }
    return CUDA_SUCCESS;
}

/* The pool serving an allocation: the given one, or the device's current. */
static CUmemoryPool async_pool(const CUmemoryPool *pool, const struct ldev *ld) {
    if (pool) return *pool;
    CUmemoryPool p = NULL;
    if (!REAL(cuDeviceGetMemPool) || NESTED(REAL(cuDeviceGetMemPool)(&p, ld->dev)) != CUDA_SUCCESS) return NULL;
    pool_note(p, ld->dev);
    return p;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s);
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s);
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s);
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s);
EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s);
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s);

/* The real stream-ordered calls, by variant: bit 0 _ptsz, bit 1 from a pool. */
static CUresult async_real(int v, CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream s) {
    switch (v) {
    case 0: return REAL(cuMemAllocAsync)(d, n, s);
    case 1: return REAL(cuMemAllocAsync_ptsz)(d, n, s);
    case 2: return REAL(cuMemAllocFromPoolAsync)(d, n, p, s);
    default: return REAL(cuMemAllocFromPoolAsync_ptsz)(d, n, p, s);
    }
}

static uint64_t pool_reserved(CUmemoryPool pool) {
    typedef CUresult (*pattr_t)(CUmemoryPool, int, void *);
    uint64_t res = 0;
    if (real_x[X_cuMemPoolGetAttribute])
        NESTED(HELP(cuMemPoolGetAttribute, pattr_t)(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res));
    return res;
}

/* A stream-ordered allocation. What its pool kept from earlier frees (charged
 * already) serves it first, so only the rest is charged before the call; if
 * the pool grew by more than that (a real pool may not find a kept block big
 * enough), the growth is charged after it, and where that is refused the
 * allocation is freed, the pool trimmed back and the call refused. Pool
 * bookkeeping is under pool_mu for the whole call. */
static CUresult async_alloc(int v, CUdeviceptr *dptr, size_t bytes, const CUmemoryPool *pool, CUstream s) {
    CUmemoryPool pl = pool ? *pool : NULL;
    if (!dptr) return async_real(v, dptr, bytes, pl, s);
    struct ldev *ld = NULL;
    uint64_t octx = 0;
    CUresult r = async_owner(s, pool, &ld, &octx);
    if (r != CUDA_SUCCESS) return r;
    if (!ld) return async_real(v, dptr, bytes, pl, s);
    if (ld == LD_REFUSE) return refuse_dev("a stream-ordered allocation");
    CUmemoryPool p = async_pool(pool, ld);
    pthread_mutex_lock(&pool_mu);
    long pi = p ? pool_find((uint64_t)(uintptr_t)p) : -1;
    struct pool_ent *pe = pi >= 0 ? &pools_t[pi] : NULL;
    uint64_t kept = pe && pe->chg > pe->out ? pe->chg - pe->out : 0;
    uint64_t need = bytes > kept ? bytes - kept : 0, res0 = pe ? pool_reserved(p) : 0;
    if (charge(ld, need) < 0) {
        pthread_mutex_unlock(&pool_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r = NESTED(async_real(v, dptr, bytes, pl, s));
    if (r != CUDA_SUCCESS) {
        credit(ld->e, need);
        pthread_mutex_unlock(&pool_mu);
        return r;
    }
    uint32_t id = 0;
    if (pe) {
        pe->out += bytes;
        pe->chg += need;
        uint64_t res = pool_reserved(p);
        if (res > pe->chg && charge(ld, res - pe->chg) != 0) {
            NESTED((v & 1 ? REAL(cuMemFreeAsync_ptsz) : REAL(cuMemFreeAsync))(*dptr, s));
            if (REAL(cuMemPoolTrimTo)) NESTED(REAL(cuMemPoolTrimTo)(p, res0));
            pe->out -= bytes;
            pool_settle(pi, 0);
            pthread_mutex_unlock(&pool_mu);
            *dptr = 0;
            vgpu_log(VGPU_LOG_INFO, "%s: the pool grew past the cap: %zu bytes refused", ld->uuid, bytes);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        if (res > pe->chg) pe->chg = res;
        pool_settle(pi, 0);
        id = pe->id;
    }
    pthread_mutex_unlock(&pool_mu);
    pm_put_full(MAP_PTR, *dptr, bytes, ld->e, octx, id);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    ENTER_OR(REAL(cuMemAllocAsync)(dptr, bytesize, s));
    return async_alloc(0, dptr, bytesize, NULL, s);
}

EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    ENTER_OR(REAL(cuMemAllocAsync_ptsz)(dptr, bytesize, s));
    return async_alloc(1, dptr, bytesize, NULL, s);
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    ENTER_OR(REAL(cuMemAllocFromPoolAsync)(dptr, bytesize, pool, s));
    return async_alloc(2, dptr, bytesize, &pool, s);
}

EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    ENTER_OR(REAL(cuMemAllocFromPoolAsync_ptsz)(dptr, bytesize, pool, s));
    return async_alloc(3, dptr, bytesize, &pool, s);
}

EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                   unsigned int elem) {
    ENTER_OR(REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, elem));
    CUresult r = NESTED(REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, elem));
    if (r != CUDA_SUCCESS || !dptr || !pitch) return r;
    struct ldev *ld = cur_ldev();
    if (!ld) return r;
    /* the pitch is the driver's choice: charge the real pitch x height */
    unsigned __int128 sz = (unsigned __int128)*pitch * height;
    if (ld == LD_REFUSE || sz >> 63 || charge(ld, (uint64_t)sz) < 0) {
        NESTED(REAL(cuMemFree_v2)(*dptr));
        *dptr = 0;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pm_put_ctx(MAP_PTR, *dptr, (uint64_t)sz, ld->e, current_ctx());
    return r;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    ENTER_OR(REAL(cuMemFree_v2)(dptr));
    FREE_BODY(MAP_PTR, dptr, REAL(cuMemFree_v2)(dptr));
}

static CUresult free_async(CUresult (*fn)(CUdeviceptr, CUstream), CUdeviceptr dptr, CUstream s) {
    FREE_BODY(MAP_PTR, dptr, fn(dptr, s));
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) {
    ENTER_OR(REAL(cuMemFreeAsync)(dptr, s));
    return free_async(REAL(cuMemFreeAsync), dptr, s);
}

EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) {
    ENTER_OR(REAL(cuMemFreeAsync_ptsz)(dptr, s));
    return free_async(REAL(cuMemFreeAsync_ptsz), dptr, s);
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    ENTER_OR(REAL(cuMemCreate)(handle, size, prop, flags));
    /* only device-resident physical memory counts */
    if (!handle || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return REAL(cuMemCreate)(handle, size, prop, flags);
    struct ldev *ld = ldev_for(prop->location.id);
    if (!ld) return REAL(cuMemCreate)(handle, size, prop, flags);
    if (ld == LD_REFUSE) return refuse_dev("cuMemCreate");
    if (charge(ld, size) < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NESTED(REAL(cuMemCreate)(handle, size, prop, flags));
    if (r != CUDA_SUCCESS) credit(ld->e, size);
    else vmm_add(*handle, size, ld->e);
    return r;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    ENTER_OR(REAL(cuMemRelease)(handle));
    CUresult r = NESTED(REAL(cuMemRelease)(handle));
    if (r == CUDA_SUCCESS) vmm_ref(handle, -1);
    return r;
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    ENTER_OR(REAL(cuMemRetainAllocationHandle)(handle, addr));
    CUresult r = NESTED(REAL(cuMemRetainAllocationHandle)(handle, addr));
    if (r == CUDA_SUCCESS && handle) vmm_ref(*handle, +1);
    return r;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags) {
    ENTER_OR(REAL(cuMemMap)(ptr, size, offset, handle, flags));
    CUresult r = NESTED(REAL(cuMemMap)(ptr, size, offset, handle, flags));
    if (r == CUDA_SUCCESS) vmm_mapped(ptr, size, handle);
    return r;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    ENTER_OR(REAL(cuMemUnmap)(ptr, size));
    CUresult r = NESTED(REAL(cuMemUnmap)(ptr, size));
    if (r == CUDA_SUCCESS) vmm_unmapped(ptr, size);
    return r;
}

/* A driver may drop the mappings left in a freed reservation (the simulated
 * one does; a real one refuses): they are unmapped for the charge too. */
EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    ENTER_OR(REAL(cuMemAddressFree)(ptr, size));
    CUresult r = NESTED(REAL(cuMemAddressFree)(ptr, size));
    if (r == CUDA_SUCCESS) vmm_unmapped(ptr, size);
    return r;
}

/* Bytes per element and the channel count a format implies (0: NumChannels). */
static uint64_t elem_bytes(int format, unsigned *fixed) {
    *fixed = 0;
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: case CU_AD_FORMAT_FLOAT: return 4;
    case 0xc0: case 0xc6: *fixed = 1; return 1; /* [US]NORM_INT8X1 */
    case 0xc1: case 0xc7: *fixed = 2; return 1;
    case 0xc2: case 0xc8: *fixed = 4; return 1;
    case 0xc3: case 0xc9: *fixed = 1; return 2; /* [US]NORM_INT16X1 */
    case 0xc4: case 0xca: *fixed = 2; return 2;
    case 0xc5: case 0xcb: *fixed = 4; return 2;
    default: *fixed = 4; return 4; /* unknown: count generously (16 bytes/element) */
    }
}

#define CU_AD_FORMAT_NV12 0xb0
#define ARRAY3D_LAYERED 0x01
#define ARRAY3D_CUBEMAP 0x04

/* width x height x depth x element size (x channels); NV12 = luma + half chroma */
static uint64_t array_bytes(size_t w, size_t h, size_t d, int format, unsigned ch) {
    if (format == CU_AD_FORMAT_NV12) {
        unsigned __int128 b = (unsigned __int128)(w ? w : 1) * (h ? h : 1);
        b += b / 2;
        return b >> 62 ? (1ull << 62) : (uint64_t)b;
    }
    unsigned fixed;
    uint64_t es = elem_bytes(format, &fixed);
    if (fixed) ch = fixed;
    unsigned __int128 v = (unsigned __int128)(w ? w : 1) * (h ? h : 1) * (d ? d : 1) * es * (ch ? ch : 1);
    return v >> 62 ? (1ull << 62) : (uint64_t)v;
}

EXPORT CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc) {
    ENTER_OR(REAL(cuArrayCreate_v2)(arr, desc));
    if (!arr || !desc) return REAL(cuArrayCreate_v2)(arr, desc);
    ALLOC_BODY(REAL(cuArrayCreate_v2)(arr, desc), (uintptr_t)*arr,
               array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels), MAP_ARRAY);
}

EXPORT CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    ENTER_OR(REAL(cuArray3DCreate_v2)(arr, desc));
    if (!arr || !desc) return REAL(cuArray3DCreate_v2)(arr, desc);
    ALLOC_BODY(REAL(cuArray3DCreate_v2)(arr, desc), (uintptr_t)*arr,
               array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels), MAP_ARRAY);
}

/* the sum of the levels; a level halves each spatial extent (at least 1),
 * layers and cube faces are not spatial */
static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
    int layered = (d->Flags & (ARRAY3D_LAYERED | ARRAY3D_CUBEMAP)) != 0;
    uint64_t total = 0;
    for (unsigned l = 0; l < (levels ? levels : 1) && l < 64; l++) {
        size_t w = d->Width >> l ? d->Width >> l : 1;
        size_t h = d->Height ? (d->Height >> l ? d->Height >> l : 1) : 0;
        size_t z = d->Depth;
        if (d->Depth && !layered) z = d->Depth >> l ? d->Depth >> l : 1;
        uint64_t b = array_bytes(w, h, z, d->Format, d->NumChannels);
        total = total + b < total ? (1ull << 62) : total + b;
    }
    return total;
}

EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                       unsigned int levels) {
    ENTER_OR(REAL(cuMipmappedArrayCreate)(arr, desc, levels));
    if (!arr || !desc) return REAL(cuMipmappedArrayCreate)(arr, desc, levels);
    ALLOC_BODY(REAL(cuMipmappedArrayCreate)(arr, desc, levels), (uintptr_t)*arr, mipmap_bytes(desc, levels),
               MAP_ARRAY);
}

EXPORT CUresult cuArrayDestroy(CUarray arr) {
    ENTER_OR(REAL(cuArrayDestroy)(arr));
    FREE_BODY(MAP_ARRAY, arr, REAL(cuArrayDestroy)(arr));
}

EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr) {
    ENTER_OR(REAL(cuMipmappedArrayDestroy)(arr));
    FREE_BODY(MAP_ARRAY, arr, REAL(cuMipmappedArrayDestroy)(arr));
}

/* contexts: memory the driver takes outside allocations, charged as a reserve */
#define CTX_CREATE_BODY(realcall, dev)                                   \
    do {                                                                 \
        struct ldev *ld = ldev_for(dev);                                 \
        if (!ld || !pctx) return realcall;                               \
        if (ld == LD_REFUSE) return refuse_dev("a context");             \
        if (charge(ld, cfg.reserve) < 0) return CUDA_ERROR_OUT_OF_MEMORY; \
        CUresult r_ = NESTED(realcall);                                  \
        if (r_ != CUDA_SUCCESS) credit(ld->e, cfg.reserve);              \
        else pm_put(MAP_CTX, (uintptr_t)*pctx, cfg.reserve, ld->e);      \
        return r_;                                                       \
    } while (0)

EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    ENTER_OR(REAL(cuCtxCreate_v2)(pctx, flags, dev));
    CTX_CREATE_BODY(REAL(cuCtxCreate_v2)(pctx, flags, dev), dev);
}

EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int n, unsigned int flags, CUdevice dev) {
    ENTER_OR(REAL(cuCtxCreate_v3)(pctx, params, n, flags, dev));
    CTX_CREATE_BODY(REAL(cuCtxCreate_v3)(pctx, params, n, flags, dev), dev);
}

EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags, CUdevice dev) {
    ENTER_OR(REAL(cuCtxCreate_v4)(pctx, params, flags, dev));
    CTX_CREATE_BODY(REAL(cuCtxCreate_v4)(pctx, params, flags, dev), dev);
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    ENTER_OR(REAL(cuCtxDestroy_v2)(ctx));
    sm_forget_ctx(ctx);
    struct pm_ent ent;
    int had = pm_take(MAP_CTX, (uintptr_t)ctx, &ent);
    CUresult r = NESTED(REAL(cuCtxDestroy_v2)(ctx));
    if (r == CUDA_SUCCESS) pm_drop_ctx((uint64_t)(uintptr_t)ctx);
    if (had) {
        if (r == CUDA_SUCCESS) credit(ent.e, ent.size);
        else pm_put(MAP_CTX, ent.key, ent.size, ent.e);
    }
    return r;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    ENTER_OR(REAL(cuDevicePrimaryCtxRetain)(pctx, dev));
    struct ldev *ld = ldev_for(dev);
    if (!ld) return REAL(cuDevicePrimaryCtxRetain)(pctx, dev);
    if (ld == LD_REFUSE) return refuse_dev("a primary context");
    pthread_mutex_lock(&init_mu);
    uint64_t charged = 0;
    if (ld->prim == 0) {
        if (charge(ld, cfg.reserve) < 0) {
            pthread_mutex_unlock(&init_mu);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        charged = cfg.reserve;
    }
    CUresult r = NESTED(REAL(cuDevicePrimaryCtxRetain)(pctx, dev));
    if (r == CUDA_SUCCESS) {
        ld->prim++;
        if (pctx) ld->prim_ctx = *pctx;
        if (charged) ld->prim_charge = charged;
    } else if (charged) {
        credit(ld->e, charged);
    }
    pthread_mutex_unlock(&init_mu);
    return r;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    ENTER_OR(REAL(cuDevicePrimaryCtxRelease_v2)(dev));
    struct ldev *ld = ldev_of(dev);
    pthread_mutex_lock(&init_mu);
    if (ld && ld->prim == 1) sm_forget_ctx(ld->prim_ctx); /* the last release destroys it */
    CUresult r = NESTED(REAL(cuDevicePrimaryCtxRelease_v2)(dev));
    if (r == CUDA_SUCCESS && ld && ld->prim > 0 && --ld->prim == 0) {
        pm_drop_ctx((uint64_t)(uintptr_t)ld->prim_ctx);
        credit(ld->e, ld->prim_charge);
        ld->prim_charge = 0;
    }
    pthread_mutex_unlock(&init_mu);
    return r;
}

EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    ENTER_OR(REAL(cuDevicePrimaryCtxReset_v2)(dev));
    struct ldev *ld = ldev_of(dev);
    pthread_mutex_lock(&init_mu);
    if (ld && ld->prim_ctx) sm_forget_ctx(ld->prim_ctx);
    CUresult r = NESTED(REAL(cuDevicePrimaryCtxReset_v2)(dev));
    if (r == CUDA_SUCCESS && ld && ld->prim > 0) {
        ld->prim = 0;
        pm_drop_ctx((uint64_t)(uintptr_t)ld->prim_ctx);
        credit(ld->e, ld->prim_charge);
        ld->prim_charge = 0;
    }
    pthread_mutex_unlock(&init_mu);
    return r;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *freep, size_t *totalp) {
    ENTER_OR(REAL(cuMemGetInfo_v2)(freep, totalp));
    CUresult r = NESTED(REAL(cuMemGetInfo_v2)(freep, totalp));
    struct ldev *ld = cur_ldev();
    if (r != CUDA_SUCCESS || !ld || !freep || !totalp) return r;
    if (ld == LD_REFUSE) { /* nothing can be allocated there */
        *freep = 0;
        return r;
    }
    adv_refresh();
    uint64_t cap = cap_of(ld), used;
    if (!cap) return r;
    if (container_used(ld->e, &used) != 0) used = cap; /* ledger unreadable: report nothing free */
    uint64_t total = cap < *totalp ? cap : *totalp;
    uint64_t fr = total > used ? total - used : 0;
    if (fr > *freep) fr = *freep;
    *totalp = total;
    *freep = fr;
    return r;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    ENTER_OR(REAL(cuDeviceTotalMem_v2)(bytes, dev));
    CUresult r = NESTED(REAL(cuDeviceTotalMem_v2)(bytes, dev));
    struct ldev *ld = ldev_of(dev);
    if (r != CUDA_SUCCESS || !ld || !bytes) return r;
    uint64_t cap = cap_of(ld);
    if (cap && cap < *bytes) *bytes = cap;
    return r;
}

/* ------------------------------------------------------------------ */
/* SM share: a token bucket per GPU in the accounting file, debited with  */
/* device time measured by CUDA events around each launch                 */

#define SM_BURST_NS 20000000ll /* at most 20 ms of device time banked */
#define SM_MAX_SLEEP_NS 100000000ll
#define SM_RING 64   /* timed launches in flight per process */
#define SM_POOL 32   /* spare events kept per context */
#define SM_NCTX 8    /* contexts with a pool */

static unsigned sm_of(const struct ldev *ld) {
    unsigned pct = ld->sm, c2 = __atomic_load_n(&adv_sm[ld - ldevs], __ATOMIC_RELAXED);
    if (c2 && (!pct || c2 < pct)) pct = c2;
    return pct >= 100 ? 0 : pct;
}

#define SM_BROKEN INT64_MIN /* the accounting file is unusable: gated launches are refused */
#define SM_SYNC_NS 2000000ull /* a process's slice of the bucket meets the file at least this often */

/* This process's slice of each device's bucket (tok_mu). A sync (the file's
 * lock, one read, one write) hands the slice and the charges since back to
 * the file's bucket, refills it, and takes all of its positive balance as the
 * new slice; between syncs launches are gated on the slice alone, with no
 * system call. Tokens are conserved (a slice is only ever moved, never
 * copied), so the container's share is as exact as with every launch going
 * to the file; a SIGKILLed process's slice is lost (its container only gets
 * less). Syncs: every SM_SYNC_NS, whenever the slice does not cover what a
 * launch needs, and (returning the slice) at context destruction and exit. */
struct smloc {
    int64_t tokens;            /* slice left: taken minus charged since */
    uint64_t busy_ns, launches; /* charges not yet in the file (statistics) */
    uint64_t sync_ns;          /* the last sync; 0 = none (sync at the next launch) */
};
static struct smloc smloc[VGPU_LDEV_MAX];

static int64_t sat_add64(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? (b > 0 ? INT64_MAX : INT64_MIN + 1) : r;
}

/* Meets the file's bucket (tok_mu held): returns the slice and the charges,
 * refills, and takes the positive balance when `take`. Returns the
 * container's tokens on the device, or SM_BROKEN when the accounting file
 * cannot be locked or is no longer in the layout (fail closed). */
static int64_t sm_sync(int li, unsigned pct, uint64_t now, int take) {
    const struct ldev *ld = &ldevs[li];
    struct smloc *L = &smloc[li];
    struct {
        struct vgpu_shm_hdr h;
        struct vgpu_shm_dev devs[VGPU_MAX_DEV];
    } img;
    L->sync_ns = 0; /* until this one succeeds */
    if (ld->ce < 0) return SM_BROKEN; /* no bucket for it in the file: fail closed */
    if (data_lock() != 0) return SM_BROKEN;
    if (cache_read(&img, sizeof img, 0) != 0 || !hdr_valid(&img.h)) {
        data_unlock();
        return SM_BROKEN;
    }
    struct vgpu_shm_dev *d = &img.devs[ld->ce];
    if (!d->last_ns || now < d->last_ns) {
        d->last_ns = now;
        d->tokens_ns = 0;
    }
    int64_t s = d->tokens_ns;
    if (pct) s = sat_add64(s, (int64_t)((now - d->last_ns) / 100 * pct));
    s = sat_add64(s, L->tokens);
    if (pct && s > SM_BURST_NS * (int64_t)pct / 100) s = SM_BURST_NS * (int64_t)pct / 100;
    if (s == SM_BROKEN) s++;
    int64_t slice = take && s > 0 ? s : 0;
    d->last_ns = now;
    d->tokens_ns = s - slice;
    d->busy_ns += L->busy_ns;
    d->launches += L->launches;
    int wr = cache_write(d, sizeof *d, DEVS_OFF + (size_t)ld->ce * sizeof *d);
    data_unlock();
    __atomic_store_n(&adv_sm[li], d->sm_pct, __ATOMIC_RELAXED);
    if (wr != 0) return SM_BROKEN; /* nothing moved: the slice and charges stay ours */
    L->tokens = slice;
    L->busy_ns = L->launches = 0;
    L->sync_ns = now ? now : 1;
    return s;
}

/* Debits ns of measured device time (0: none) from this process's slice;
 * returns the tokens a launch may count on, syncing with the file first when
 * the slice is stale or does not cover `need` (the estimated work this
 * process has in flight). SM_BROKEN: see sm_sync. */
static int64_t sm_account(const struct ldev *ld, unsigned pct, uint64_t ns, uint64_t nlaunch, int64_t need) {
    if (my_slot < 0) return 0;
    int li = (int)(ld - ldevs);
    struct smloc *L = &smloc[li];
    pthread_mutex_lock(&tok_mu);
    L->tokens = sat_add64(L->tokens, -(int64_t)(ns > (uint64_t)INT64_MAX ? INT64_MAX : ns));
    L->busy_ns += ns;
    L->launches += nlaunch;
    uint64_t now = now_ns();
    int64_t t = L->tokens;
    if (!L->sync_ns || now - L->sync_ns >= SM_SYNC_NS || t <= 0 || t - need < 0) t = sm_sync(li, pct, now, 1);
    pthread_mutex_unlock(&tok_mu);
    return t;
}

/* Hands every slice back to the file (context destruction, exit). */
static void sm_return_all(void) {
    if (my_slot < 0) return;
    pthread_mutex_lock(&tok_mu);
    for (int i = 0; i < nldev; i++)
        if (smloc[i].sync_ns || smloc[i].launches) sm_sync(i, sm_of(&ldevs[i]), now_ns(), 0);
    pthread_mutex_unlock(&tok_mu);
}

/* The correction for time that is not the kernel's own. Between its events a
 * kernel's elapsed time also contains work of other contexts the GPU ran
 * meanwhile (time-slicing on a real GPU; on the simulated one, waiting for the
 * serialised device) and launch overhead: both only add. So per kernel
 * (function or graph) libvgpu keeps a floor: the smallest elapsed time seen,
 * relaxed upwards on each longer launch (by 1/64 of the excess, at most 1/256
 * of the floor) so that it follows a kernel that really got longer; a launch
 * is charged min(elapsed, floor). The floor is also the
 * estimate of a launch still in flight. Guarded by sm_mu. */
#define EST_SLOTS 256
static struct {
    uintptr_t key;
    uint64_t floor_ns;
} est_cache[EST_SLOTS];
static pthread_mutex_t sm_mu = PTHREAD_MUTEX_INITIALIZER;

static unsigned est_slot(uintptr_t key) { return (unsigned)((key >> 4) ^ (key >> 12)) & (EST_SLOTS - 1); }

static uint64_t device_time(uintptr_t key, uint64_t ns) {
    unsigned i = est_slot(key);
    if (est_cache[i].key != key || !est_cache[i].floor_ns) {
        est_cache[i].key = key;
        est_cache[i].floor_ns = ns;
        return ns;
    }
    uint64_t f = est_cache[i].floor_ns;
    if (ns <= f) {
        est_cache[i].floor_ns = ns;
        return ns;
    }
    /* creep up by 1/64 of the excess, at most 1/256 of the floor: jitter of
     * a few us does not lift it, a kernel that got longer is followed */
    uint64_t up = (ns - f) >> 6;
    est_cache[i].floor_ns = f + (up < (f >> 8) ? up : (f >> 8)) + 1;
    return f;
}

static uint64_t est_peek(uintptr_t key) {
    unsigned i = est_slot(key);
    return est_cache[i].key == key ? est_cache[i].floor_ns : 0;
}

/* the real event functions (helpers from libvgpu's own dlopen of libcuda) */
typedef CUresult (*ev_create_t)(CUevent *, unsigned);
typedef CUresult (*ev_record_t)(CUevent, CUstream);
typedef CUresult (*ev_one_t)(CUevent);
typedef CUresult (*ev_elapsed_t)(float *, CUevent, CUevent);
typedef CUresult (*ctx_cur_t)(CUcontext *);
typedef CUresult (*capturing_t)(CUstream, int *);
#define EV_CREATE HELP(cuEventCreate, ev_create_t)
#define EV_RECORD HELP(cuEventRecord, ev_record_t)
#define EV_QUERY HELP(cuEventQuery, ev_one_t)
#define EV_SYNC HELP(cuEventSynchronize, ev_one_t)
#define EV_ELAPSED HELP(cuEventElapsedTime, ev_elapsed_t)
#define EV_DESTROY HELP(cuEventDestroy_v2, ev_one_t)

static int events_usable(void) {
    return real_x[X_cuEventCreate] && real_x[X_cuEventRecord] && real_x[X_cuEventQuery] &&
           real_x[X_cuEventSynchronize] && real_x[X_cuEventElapsedTime] && real_x[X_cuEventDestroy_v2] &&
           real_x[X_cuCtxGetCurrent];
}

/* A timed launch in flight: start/end events around it on its stream. */
struct sm_rec {
    CUevent start, end;
    CUcontext ctx;
    uintptr_t key;
    uint64_t est;  /* its floor when launched (0 unknown) */
    int li;        /* ldevs index */
};
static struct sm_rec ring[SM_RING];   /* oldest at ring_head; sm_mu */
static unsigned ring_head, ring_n;
static uint64_t pend_est[VGPU_LDEV_MAX];
static unsigned pend_n[VGPU_LDEV_MAX], pend_unknown[VGPU_LDEV_MAX]; /* in flight; of which with no estimate */

/* spare events per context (created with default flags: timing enabled) */
static struct evpool {
    CUcontext ctx;
    unsigned n;
    CUevent ev[SM_POOL];
} pools[SM_NCTX];

static struct evpool *pool_of(CUcontext ctx, int create) {
    struct evpool *fr = NULL;
    for (int i = 0; i < SM_NCTX; i++) {
        if (pools[i].ctx == ctx) return &pools[i];
        if (!pools[i].ctx && !fr) fr = &pools[i];
    }
    if (!create || !fr) return NULL;
    fr->ctx = ctx;
    fr->n = 0;
    return fr;
}

/* sm_mu held; ctx is current */
static int ev_get(CUcontext ctx, CUevent *e) {
    struct evpool *p = pool_of(ctx, 1);
    if (p && p->n) {
        *e = p->ev[--p->n];
        return 0;
    }
    return EV_CREATE(e, 0) == CUDA_SUCCESS ? 0 : -1;
}

static void ev_put(CUcontext ctx, CUevent e) {
    struct evpool *p = pool_of(ctx, 0);
    if (p && p->n < SM_POOL) p->ev[p->n++] = e;
    else EV_DESTROY(e);
}

static struct sm_rec ring_pop(void) {
    struct sm_rec r = ring[ring_head];
    ring_head = (ring_head + 1) % SM_RING;
    ring_n--;
    pend_n[r.li]--;
    pend_est[r.li] -= r.est;
    pend_unknown[r.li] -= !r.est;
    return r;
}

/* A completed record: its device time into ch[] (sm_mu held). */
static void rec_charge(const struct sm_rec *r, CUresult q, uint64_t *ch, uint64_t *cnt) {
    float ms = 0;
    if (q == CUDA_SUCCESS && EV_ELAPSED(&ms, r->start, r->end) == CUDA_SUCCESS) {
        uint64_t ns = ms > 0 ? (uint64_t)((double)ms * 1e6) : 0;
        ch[r->li] += device_time(r->key, ns);
        cnt[r->li]++;
        ev_put(r->ctx, r->start);
        ev_put(r->ctx, r->end);
    }
    /* else the events are unusable (context gone?): dropped uncharged */
}

/* Charges completed launches, oldest first, up to the first one still
 * running (non-blocking: one cuEventQuery when nothing completed). sm_mu held. */
static void poll_locked(uint64_t *ch, uint64_t *cnt) {
    while (ring_n) {
        CUresult q = EV_QUERY(ring[ring_head].end);
        if (q == CUDA_ERROR_NOT_READY) break;
        struct sm_rec r = ring_pop();
        rec_charge(&r, q, ch, cnt);
    }
}

static void flush_charges(const uint64_t *ch, const uint64_t *cnt) {
    for (int i = 0; i < nldev; i++)
        if (cnt[i]) sm_account(&ldevs[i], sm_of(&ldevs[i]), ch[i], cnt[i], 0);
}

/* Waits for the oldest launch in flight and charges it. */
static void retire_oldest(void) {
    uint64_t ch[VGPU_LDEV_MAX] = {0}, cnt[VGPU_LDEV_MAX] = {0};
    pthread_mutex_lock(&sm_mu);
    if (!ring_n) {
        pthread_mutex_unlock(&sm_mu);
        return;
    }
    struct sm_rec r = ring_pop();
    pthread_mutex_unlock(&sm_mu);
    CUresult q = EV_SYNC(r.end); /* blocks until the GPU is past it */
    pthread_mutex_lock(&sm_mu);
    rec_charge(&r, q, ch, cnt);
    pthread_mutex_unlock(&sm_mu);
    flush_charges(ch, cnt);
}

/* Before a launch on an SM-limited device: charges completed launches, then
 * waits while the container is in debt. Work in flight is bounded: while the
 * ring is full, or the tokens do not cover the estimated work this process
 * has in flight on the device, or a launch of a kernel with no estimate yet
 * (never seen complete) is in flight, the oldest launch is waited for and
 * charged (so a process cannot queue work ahead of its budget); with nothing
 * in flight and the bucket negative, it sleeps until the bucket refills. */
static int sm_gate(const struct ldev *ld, unsigned pct) {
    int li = (int)(ld - ldevs);
    for (;;) {
        uint64_t ch[VGPU_LDEV_MAX] = {0}, cnt[VGPU_LDEV_MAX] = {0};
        pthread_mutex_lock(&sm_mu);
        poll_locked(ch, cnt);
        int full = ring_n >= SM_RING;
        unsigned np = pend_n[li], nu = pend_unknown[li];
        int64_t pe = (int64_t)pend_est[li];
        pthread_mutex_unlock(&sm_mu);
        for (int i = 0; i < nldev; i++)
            if (cnt[i] && i != li) sm_account(&ldevs[i], sm_of(&ldevs[i]), ch[i], cnt[i], 0);
        int64_t t = sm_account(ld, pct, ch[li], cnt[li], np ? pe : 0);
        if (t == SM_BROKEN) {
            static int told;
            if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
                vgpu_log(VGPU_LOG_ERROR, "%s: the accounting file %s is locked by another process or was "
                         "overwritten: launches under the SM limit are refused", ld->uuid, cfg.cache);
            return -1;
        }
        if (full || nu || (np && t - pe < 0)) {
            retire_oldest();
            continue;
        }
        if (t >= 0) return 0;
        int64_t wait = (t < -SM_MAX_SLEEP_NS ? SM_MAX_SLEEP_NS : -t) * 100 / (int64_t)pct;
        if (wait > SM_MAX_SLEEP_NS) wait = SM_MAX_SLEEP_NS;
        if (wait < 20000) wait = 20000;
        struct timespec ts = {wait / 1000000000, wait % 1000000000};
        nanosleep(&ts, NULL);
    }
}

/* One gated launch in progress. */
struct sm_launch {
    const struct ldev *ld;
    int timed;         /* events recorded: 1; fallback to the call's duration: 0 */
    struct sm_rec rec;
    uint64_t t0;
};

/* Before the real launch: gating, then the start event on the launch's
 * stream. 0 = ungated (no SM limit on this device), -1 = refused. */
static int sm_begin(struct sm_launch *L, CUstream s, uintptr_t key) {
    if (vgpu_enter() != ST_ACTIVE) return 0;
    const struct ldev *ld = cur_ldev();
    if (!ld) return 0;
    if (ld == LD_REFUSE) return cfg.sm_any && cfg.sm_any < 100 ? -1 : 0; /* unaccountable: fail closed */
    unsigned pct = sm_of(ld);
    if (!pct) return 0;
    if (sm_gate(ld, pct) != 0) return -1;
    L->ld = ld;
    L->timed = 0;
    L->t0 = 0;
    L->rec.key = key;
    if (!events_usable()) {
        L->t0 = now_ns(); /* no events: the call's duration (right for synchronous drivers only) */
        return 1;
    }
    int cap = 0;
    typedef CUresult (*capt_t)(CUstream, int *);
    if (real_x[X_cuStreamIsCapturing] && HELP(cuStreamIsCapturing, capt_t)(s, &cap) == CUDA_SUCCESS && cap)
        return 1; /* captured into a graph: nothing runs now, nothing to charge */
    CUcontext ctx = NULL;
    if (HELP(cuCtxGetCurrent, ctx_cur_t)(&ctx) != CUDA_SUCCESS || !ctx) return 1;
    struct sm_rec *r = &L->rec;
    r->ctx = ctx;
    r->key = key;
    r->li = (int)(ld - ldevs);
    pthread_mutex_lock(&sm_mu);
    int ok = ev_get(ctx, &r->start) == 0;
    if (ok && ev_get(ctx, &r->end) != 0) {
        ev_put(ctx, r->start);
        ok = 0;
    }
    r->est = est_peek(key);
    pthread_mutex_unlock(&sm_mu);
    if (!ok) return 1;
    if (EV_RECORD(r->start, s) != CUDA_SUCCESS) {
        pthread_mutex_lock(&sm_mu);
        ev_put(ctx, r->start);
        ev_put(ctx, r->end);
        pthread_mutex_unlock(&sm_mu);
        return 1;
    }
    L->timed = 1;
    return 1;
}

/* After the real launch: the end event, and the record into the ring. */
static void sm_end(struct sm_launch *L, CUstream s, CUresult lr) {
    struct sm_rec *r = &L->rec;
    if (!L->timed) {
        if (L->t0 && lr == CUDA_SUCCESS) {
            uint64_t ns = now_ns() - L->t0;
            pthread_mutex_lock(&sm_mu);
            ns = device_time(r->key, ns);
            pthread_mutex_unlock(&sm_mu);
            sm_account(L->ld, sm_of(L->ld), ns, 1, 0);
        }
        return;
    }
    if (lr != CUDA_SUCCESS || EV_RECORD(r->end, s) != CUDA_SUCCESS) {
        pthread_mutex_lock(&sm_mu);
        ev_put(r->ctx, r->start); /* re-recording reuses them */
        ev_put(r->ctx, r->end);
        pthread_mutex_unlock(&sm_mu);
        return;
    }
    for (;;) {
        pthread_mutex_lock(&sm_mu);
        if (ring_n < SM_RING) break;
        pthread_mutex_unlock(&sm_mu);
        retire_oldest(); /* other threads filled it meanwhile */
    }
    ring[(ring_head + ring_n) % SM_RING] = *r;
    ring_n++;
    pend_n[r->li]++;
    pend_est[r->li] += r->est;
    pend_unknown[r->li] += !r->est;
    pthread_mutex_unlock(&sm_mu);
}

/* Before a context is destroyed: its launches in flight are waited for and
 * charged, its spare events destroyed (they die with it). */
static void sm_forget_ctx(CUcontext ctx) {
    if (!ctx || !any_sm || !events_usable()) return;
    uint64_t ch[VGPU_LDEV_MAX] = {0}, cnt[VGPU_LDEV_MAX] = {0};
    pthread_mutex_lock(&sm_mu);
    unsigned n = ring_n;
    for (unsigned k = 0; k < n; k++) {
        struct sm_rec r = ring_pop();
        if (r.ctx == ctx) {
            rec_charge(&r, EV_SYNC(r.end), ch, cnt);
        } else {
            ring[(ring_head + ring_n) % SM_RING] = r;
            ring_n++;
            pend_n[r.li]++;
            pend_est[r.li] += r.est;
            pend_unknown[r.li] += !r.est;
        }
    }
    struct evpool *p = pool_of(ctx, 0);
    if (p) {
        while (p->n) EV_DESTROY(p->ev[--p->n]);
        p->ctx = NULL;
    }
    pthread_mutex_unlock(&sm_mu);
    flush_charges(ch, cnt);
    sm_return_all();
}

/* What a floor is kept for: an estimate learnt on one launch prices only
 * launches of the same work. A kernel's key is its function with the launch's
 * shape (grid, block, shared memory); a graph's its exec handle. Both include
 * the epoch, bumped whenever a handle can start to mean other work (a graph
 * exec destroyed or updated, a node re-parameterised or toggled, a module or
 * library unloaded: the driver may hand the same handle value out again), so
 * no floor outlives what it was learnt on; records in flight keep their old
 * key and charge only it. */
static uint64_t est_epoch = 1;

static inline uint64_t mix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

static uintptr_t kern_key(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned shm) {
    uint64_t k = mix64((uint64_t)(uintptr_t)f ^ mix64(__atomic_load_n(&est_epoch, __ATOMIC_RELAXED)));
    k = mix64(k ^ ((uint64_t)gx << 32 | gy));
    k = mix64(k ^ ((uint64_t)gz << 32 | bx));
    k = mix64(k ^ ((uint64_t)by << 32 | bz));
    return (uintptr_t)mix64(k ^ shm);
}

static uintptr_t ex_key(CUfunction f, const CUlaunchConfig *c) {
    if (!c) return kern_key(f, 0, 0, 0, 0, 0, 0, 0);
    return kern_key(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
                    c->sharedMemBytes);
}

static uintptr_t graph_key(CUgraphExec g) {
    return (uintptr_t)mix64(mix64((uint64_t)(uintptr_t)g ^ 0x9e3779b97f4a7c15ull) ^
                            __atomic_load_n(&est_epoch, __ATOMIC_RELAXED));
}

/* Calls after which a handle may mean other work: the epoch moves first. */
#define EPOCH_HOOK(name, args, call)                                      \
    EXPORT CUresult name args {                                         \
        __atomic_add_fetch(&est_epoch, 1, __ATOMIC_RELAXED);            \
        if (!REAL(name) && vgpu_enter() != ST_ERROR && !REAL(name))     \
            return CUDA_ERROR_NOT_FOUND;                                \
        CUresult r = REAL(name) call;                                   \
        __atomic_add_fetch(&est_epoch, 1, __ATOMIC_RELAXED);            \
        return r;                                                       \
    }
EPOCH_HOOK(cuGraphExecDestroy, (CUgraphExec g), (g))
EPOCH_HOOK(cuModuleUnload, (CUmodule m), (m))
EPOCH_HOOK(cuLibraryUnload, (void *l), (l))
EPOCH_HOOK(cuGraphExecUpdate, (CUgraphExec g, void *graph, void *node, void *res), (g, graph, node, res))
EPOCH_HOOK(cuGraphExecUpdate_v2, (CUgraphExec g, void *graph, void *info), (g, graph, info))
EPOCH_HOOK(cuGraphExecKernelNodeSetParams, (CUgraphExec g, void *node, const void *p), (g, node, p))
EPOCH_HOOK(cuGraphExecKernelNodeSetParams_v2, (CUgraphExec g, void *node, const void *p), (g, node, p))
EPOCH_HOOK(cuGraphExecNodeSetParams, (CUgraphExec g, void *node, void *p), (g, node, p))
EPOCH_HOOK(cuGraphExecChildGraphNodeSetParams, (CUgraphExec g, void *node, void *child), (g, node, child))
EPOCH_HOOK(cuGraphNodeSetEnabled, (CUgraphExec g, void *node, unsigned on), (g, node, on))

/* The launch wrappers. No SM limit anywhere: a tail call to the driver.
 * `strm` is the stream the launch goes to (for _ptsz variants, NULL means
 * the per-thread default stream). */
#define LAUNCH(name, key, strm, args, call)                                   \
    EXPORT CUresult name args {                                         \
        if (LIKELY(__atomic_load_n(&g_launch_fast, __ATOMIC_RELAXED)))  \
            return REAL(name) call;                                     \
        if (!REAL(name) && vgpu_enter() != ST_ERROR && !REAL(name))     \
            return CUDA_ERROR_NOT_FOUND;                                \
        if (vgpu_nested) return REAL(name) call;                        \
        if (vgpu_enter() == ST_ERROR) return CUDA_ERROR_NOT_INITIALIZED; \
        struct sm_launch L;                                             \
        CUstream s_ = (strm);                                           \
        int g_ = sm_begin(&L, s_, (uintptr_t)(key));                   \
        if (g_ < 0) return CUDA_ERROR_NOT_PERMITTED;                    \
        if (!g_) return NESTED(REAL(name) call);                        \
        CUresult r = NESTED(REAL(name) call);                           \
        sm_end(&L, s_, r);                                              \
        return r;                                                       \
    }

#define PTSZ(s) ((s) ? (s) : CU_STREAM_PER_THREAD)
LAUNCH(cuLaunchKernel, kern_key(f, gx, gy, gz, bx, by, bz, shm_), s,
       (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_,
        CUstream s, void **params, void **extra),
       (f, gx, gy, gz, bx, by, bz, shm_, s, params, extra))
LAUNCH(cuLaunchKernel_ptsz, kern_key(f, gx, gy, gz, bx, by, bz, shm_), PTSZ(s),
       (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_,
        CUstream s, void **params, void **extra),
       (f, gx, gy, gz, bx, by, bz, shm_, s, params, extra))
LAUNCH(cuLaunchKernelEx, ex_key(f, c), c ? c->hStream : NULL, (const CUlaunchConfig *c, CUfunction f, void **params, void **extra),
       (c, f, params, extra))
LAUNCH(cuLaunchKernelEx_ptsz, ex_key(f, c), PTSZ(c ? c->hStream : NULL),
       (const CUlaunchConfig *c, CUfunction f, void **params, void **extra), (c, f, params, extra))
LAUNCH(cuLaunchCooperativeKernel, kern_key(f, gx, gy, gz, bx, by, bz, shm_), s,
       (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_,
        CUstream s, void **params),
       (f, gx, gy, gz, bx, by, bz, shm_, s, params))
LAUNCH(cuLaunchCooperativeKernel_ptsz, kern_key(f, gx, gy, gz, bx, by, bz, shm_), PTSZ(s),
       (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_,
        CUstream s, void **params),
       (f, gx, gy, gz, bx, by, bz, shm_, s, params))
LAUNCH(cuGraphLaunch, graph_key(g), s, (CUgraphExec g, CUstream s), (g, s))
LAUNCH(cuGraphLaunch_ptsz, graph_key(g), PTSZ(s), (CUgraphExec g, CUstream s), (g, s))

/* ------------------------------------------------------------------ */
/* cuGetProcAddress: the path the CUDA runtime uses since 11.3          */

static void *translate(void *p) {
    for (int i = 0; i < H_NCUDA; i++) {
        if (p == hooks[i].wrapper) return p;
        if (real_fn[i] && p == real_fn[i]) return hooks[i].wrapper;
    }
    return p; /* not a wrapped entry point: untouched */
}

static int proc_translate(void) {
    pthread_once(&cfg_once, cfg_load);
    pthread_once(&cuda_once, resolve_cuda);
    return !(cfg_rc == 0 && !cfg.active);
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags) {
    int tr = proc_translate();
    if (!REAL(cuGetProcAddress)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGetProcAddress)(symbol, pfn, ver, flags);
    if (tr && r == CUDA_SUCCESS && pfn && *pfn) *pfn = translate(*pfn);
    return r;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status) {
    int tr = proc_translate();
    if (!REAL(cuGetProcAddress_v2)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGetProcAddress_v2)(symbol, pfn, ver, flags, status);
    if (tr && r == CUDA_SUCCESS && pfn && *pfn) *pfn = translate(*pfn);
    return r;
}

/* ------------------------------------------------------------------ */
/* NVML                                                                */

static int nvml_state; /* 0 unknown, 1 pass, 2 active, -1 error */

static int nvml_enter(void) {
    int st = __atomic_load_n(&nvml_state, __ATOMIC_ACQUIRE);
    if (st) return st;
    pthread_once(&cfg_once, cfg_load);
    pthread_once(&nvml_once, resolve_nvml);
    pthread_mutex_lock(&init_mu);
    if (cfg_rc < 0) st = -1;
    else if (!cfg.active) st = 1;
    else if (cache_open(cfg.cache) < 0 || ledger_open() < 0) {
        vgpu_log(VGPU_LOG_ERROR, "%s", cfg_err);
        st = -1;
    } else {
        if (!my_pid) my_pid = getpid();
        st = 2;
    }
    __atomic_store_n(&nvml_state, st, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&init_mu);
    return st;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    int st = nvml_enter();
    if (!REAL(nvmlInit_v2)) return NVML_ERROR_UNKNOWN;
    if (st < 0) return NVML_ERROR_UNKNOWN; /* fail closed: stderr names the variable */
    return REAL(nvmlInit_v2)();
}

EXPORT nvmlReturn_t nvmlInit(void) {
    int st = nvml_enter();
    if (!REAL(nvmlInit)) return NVML_ERROR_UNKNOWN;
    if (st < 0) return NVML_ERROR_UNKNOWN;
    return REAL(nvmlInit)();
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    int st = nvml_enter();
    if (!REAL(nvmlInitWithFlags)) return NVML_ERROR_UNKNOWN;
    if (st < 0) return NVML_ERROR_UNKNOWN;
    return REAL(nvmlInitWithFlags)(flags);
}

/* Cap and container usage for an NVML device; 0 if uncapped. */
static uint64_t nvml_cap(nvmlDevice_t dev, uint64_t *used) {
    typedef nvmlReturn_t (*uuid_t_)(nvmlDevice_t, char *, unsigned);
    char uuid[96];
    if (!real_x[X_nvmlDeviceGetUUID] || HELP(nvmlDeviceGetUUID, uuid_t_)(dev, uuid, sizeof uuid) != NVML_SUCCESS)
        return cfg.mem_any;
    int i = nvml_index_of(uuid);
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

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    int st = nvml_enter();
    if (!REAL(nvmlDeviceGetMemoryInfo)) return NVML_ERROR_UNKNOWN;
    if (st < 0) return NVML_ERROR_UNKNOWN;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo)(dev, mem);
    if (r != NVML_SUCCESS || st != 2 || !mem) return r;
    uint64_t used = 0, cap = nvml_cap(dev, &used);
    if (cap) apply_cap(cap, used, &mem->total, &mem->free, &mem->used);
    return r;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem) {
    int st = nvml_enter();
    if (!REAL(nvmlDeviceGetMemoryInfo_v2)) return NVML_ERROR_UNKNOWN;
    if (st < 0) return NVML_ERROR_UNKNOWN;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo_v2)(dev, mem);
    if (r != NVML_SUCCESS || st != 2 || !mem) return r;
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
    if (!count) return fn(dev, count, infos);
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
        r = fn(dev, &n, buf);
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
        int st = nvml_enter();                                                      \
        if (!REAL(name)) return NVML_ERROR_UNKNOWN;                                 \
        if (st < 0) return NVML_ERROR_UNKNOWN;                                      \
        if (st != 2) return REAL(name)(dev, count, infos);                          \
        return procs_filtered((procs_fn)REAL(name), dev, count, infos, (esz));      \
    }
PROCS_WRAPPER(nvmlDeviceGetComputeRunningProcesses, sizeof(nvmlProcessInfo_v1_t))
PROCS_WRAPPER(nvmlDeviceGetComputeRunningProcesses_v2, sizeof(nvmlProcessInfo_t))
PROCS_WRAPPER(nvmlDeviceGetComputeRunningProcesses_v3, sizeof(nvmlProcessInfo_t))

/* ------------------------------------------------------------------ */

static const struct hook hooks[H_N] = {
#define ENTRY(n) [H_##n] = {#n, (void *)n},
    CUDA_HOOKS(ENTRY) NVML_HOOKS(ENTRY)
#undef ENTRY
};
