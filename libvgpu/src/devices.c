/* devices.c: this process's devices (CUDA device -> container GPU -> limits),
 * attaching at the first cuInit, the state every wrapper checks, and the
 * wrappers of contexts and memory queries. */
#include "internal.h"
#include <sys/mman.h>

struct ldev ldevs[VGPU_LDEV_MAX];
int nldev;
static int n_cuda; /* devices the driver reports (nldev is at most VGPU_LDEV_MAX of them) */
int any_sm;
/* the container's strictest cap / SM share per ldev as last read from the
 * accounting file (advisory: it can only tighten this process's own) */
static uint64_t adv_cap[VGPU_LDEV_MAX];
unsigned vgpu_adv_sm[VGPU_LDEV_MAX];

uint64_t adv_cap_of(int li) { return __atomic_load_n(&adv_cap[li], __ATOMIC_RELAXED); }
void adv_sm_set(int li, unsigned pct) { __atomic_store_n(&vgpu_adv_sm[li], pct, __ATOMIC_RELAXED); }
void adv_set(int li, uint64_t cap, unsigned pct) {
    __atomic_store_n(&adv_cap[li], cap, __ATOMIC_RELAXED);
    adv_sm_set(li, pct);
}

static int state_static;
int *vgpu_statep = &state_static;
int vgpu_wipe_ok;
static pid_t att_pid; /* the process that attached; 0 = none yet */
int g_launch_fast; /* launches need no gating: tail-call the real one */
pthread_mutex_t vgpu_init_mu = PTHREAD_MUTEX_INITIALIZER;

static void fmt_uuid(const CUuuid *u, char *out, size_t n) {
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, n, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

struct ldev *ldev_of(CUdevice dev) {
    if ((unsigned)dev < (unsigned)nldev && ldevs[dev].dev == dev) return &ldevs[dev]; /* the usual numbering */
    for (int i = 0; i < nldev; i++)
        if (ldevs[i].dev == dev) return &ldevs[i];
    return NULL;
}

/* dev's entry; LD_REFUSE for a device libvgpu cannot account for; NULL for
 * no device at all (the real call fails on its own). */
struct ldev *ldev_for(CUdevice dev) {
    struct ldev *ld = ldev_of(dev);
    if (ld) return ld;
    return dev >= 0 && dev < n_cuda ? LD_REFUSE : NULL;
}

CUresult refuse_dev(const char *what) {
    vgpu_log(VGPU_LOG_ERROR, "%s refused: the device is beyond the %d libvgpu can account for", what, VGPU_LDEV_MAX);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The container's GPU index of a UUID, -1 unknown: from the limits file's
 * NVCTK_VGPU_UUID_<i> where it has them, else NVML's order. */
int gpu_index_of(const char *uuid) {
    if (!cfg.uuid_set) return nvml_index_of(uuid);
    for (int i = 0; i < VGPU_MAX_DEV; i++)
        if ((cfg.uuid_set >> i) & 1 && strcasecmp(cfg.uuid[i], uuid) == 0) return i;
    return -1;
}

/* The current context's device (see ldev_for); NULL with no context. */
struct ldev *cur_ldev(void) {
    if (nldev == 1 && n_cuda == 1) return &ldevs[0];
    CUdevice d;
    typedef CUresult (*getdev_t)(CUdevice *);
    if (!real_x[X_cuCtxGetDevice] || HELP(cuCtxGetDevice, getdev_t)(&d) != CUDA_SUCCESS) return NULL;
    return ldev_for(d);
}

/* The launch path's current device, cached per thread (cuCtxGetDevice is
 * ~5 ns of an SM-limited launch on the simulator). A cached answer is the
 * driver's own, taken while vgpu_ctx_gen had the value it was cached with;
 * every wrapped call that can change a thread's current context, or create,
 * destroy or reset any context (so that a handle could come to mean a
 * context on another device), moves vgpu_ctx_gen before and after the real
 * call (ctx_gen_bump): the next launch of every thread asks the driver again.
 * The generation is read before the driver is asked, so an answer that may
 * predate such a call is never kept past it. */
uint64_t vgpu_ctx_gen = 1;
__thread uint64_t vgpu_cdev_gen __attribute__((tls_model("initial-exec")));
__thread struct ldev *vgpu_cdev __attribute__((tls_model("initial-exec")));

struct ldev *cur_ldev_query(void) {
    uint64_t g = __atomic_load_n(&vgpu_ctx_gen, __ATOMIC_ACQUIRE);
    struct ldev *ld = cur_ldev();
    if (ld) { /* no context (NULL) is not kept: the launch fails in the driver anyway */
        vgpu_cdev = ld;
        vgpu_cdev_gen = g;
    }
    return ld;
}

static inline void ctx_gen_bump(void) { __atomic_add_fetch(&vgpu_ctx_gen, 1, __ATOMIC_SEQ_CST); }

/* The calls that change or end contexts: the generation moves around each
 * (whatever libvgpu does besides: the _acct bodies below). Reached by direct
 * linking, dlsym and cuGetProcAddress alike (symbols.c routes all three). */
#define CTX_GEN_HOOK(name, args, call)                                  \
    EXPORT CUresult name args {                                         \
        if (!REAL(name)) resolve_cuda_once();                           \
        if (!REAL(name)) return CUDA_ERROR_NOT_FOUND;                   \
        ctx_gen_bump();                                                 \
        CUresult r_ = REAL(name) call;                                  \
        ctx_gen_bump();                                                 \
        return r_;                                                      \
    }
#define CTX_GEN_WRAP(name, args, call)                                  \
    EXPORT CUresult name args {                                         \
        ctx_gen_bump();                                                 \
        CUresult r_ = name##_acct call;                                 \
        ctx_gen_bump();                                                 \
        return r_;                                                      \
    }
CTX_GEN_HOOK(cuCtxSetCurrent, (CUcontext c), (c))
CTX_GEN_HOOK(cuCtxPushCurrent, (CUcontext c), (c))
CTX_GEN_HOOK(cuCtxPushCurrent_v2, (CUcontext c), (c))
CTX_GEN_HOOK(cuCtxPopCurrent, (CUcontext *pc), (pc))
CTX_GEN_HOOK(cuCtxPopCurrent_v2, (CUcontext *pc), (pc))
CTX_GEN_HOOK(cuCtxCreate, (CUcontext *pc, unsigned flags, CUdevice dev), (pc, flags, dev))
CTX_GEN_HOOK(cuCtxDestroy, (CUcontext c), (c))
CTX_GEN_HOOK(cuCtxAttach, (CUcontext *pc, unsigned flags), (pc, flags))
CTX_GEN_HOOK(cuCtxDetach, (CUcontext c), (c))
CTX_GEN_HOOK(cuDevicePrimaryCtxRelease, (CUdevice dev), (dev))
CTX_GEN_HOOK(cuDevicePrimaryCtxReset, (CUdevice dev), (dev))
CTX_GEN_HOOK(cuGreenCtxCreate, (void **pg, void *desc, CUdevice dev, unsigned flags), (pg, desc, dev, flags))
CTX_GEN_HOOK(cuGreenCtxDestroy, (void *g), (g))
CTX_GEN_HOOK(cuCtxFromGreenCtx, (CUcontext *pc, void *g), (pc, g))
CTX_GEN_HOOK(cuGLCtxCreate, (CUcontext *pc, unsigned flags, CUdevice dev), (pc, flags, dev))
CTX_GEN_HOOK(cuGLCtxCreate_v2, (CUcontext *pc, unsigned flags, CUdevice dev), (pc, flags, dev))
CTX_GEN_HOOK(cuVDPAUCtxCreate, (CUcontext *pc, unsigned flags, CUdevice dev, uint32_t vdp, void *gpa),
             (pc, flags, dev, vdp, gpa))
CTX_GEN_HOOK(cuVDPAUCtxCreate_v2, (CUcontext *pc, unsigned flags, CUdevice dev, uint32_t vdp, void *gpa),
             (pc, flags, dev, vdp, gpa))

/* Refreshes adv_cap/adv_sm from the accounting file's device entries (a
 * corrupt file leaves them as they were). */
void adv_refresh(void) {
    struct vgpu_shm_dev devs[VGPU_MAX_DEV];
    struct vgpu_shm_hdr h;
    if (data_lock() != 0) return;
    int ok = cache_read(&h, sizeof h, 0) == 0 && hdr_valid(&h) && cache_read(devs, sizeof devs, DEVS_OFF) == 0;
    data_unlock();
    if (!ok) return;
    for (int i = 0; i < nldev; i++) {
        if (ldevs[i].ce < 0) continue;
        __atomic_store_n(&adv_cap[i], devs[ldevs[i].ce].mem_cap, __ATOMIC_RELAXED);
        __atomic_store_n(&vgpu_adv_sm[i], devs[ldevs[i].ce].sm_pct, __ATOMIC_RELAXED);
    }
}

/* After the real cuInit: maps the driver's devices to the container's GPUs
 * and their limits, opens the accounting file and the ledger, claims a
 * ledger region and a slot. */
static int attach(void) {
    typedef CUresult (*count_t)(int *);
    typedef CUresult (*get_t)(CUdevice *, int);
    typedef CUresult (*uuid_t_)(CUuuid *, CUdevice);
    if (!real_x[X_cuDeviceGetCount] || !real_x[X_cuDeviceGet] || !real_x[X_cuDeviceGetUuid]) {
        snprintf(cfg_err, sizeof cfg_err, "libcuda lacks cuDeviceGetCount/cuDeviceGet/cuDeviceGetUuid");
        return -1;
    }
    /* The limits file nvctk writes names each container GPU's UUID: mapped
     * from it, NVML is not loaded here (~70 us of the first cuInit); without
     * it (env-only use), NVML's order is the container's. */
    if (!cfg.uuid_set) resolve_nvml_once();
    TRACE(TR_NVML);
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
        if (cfg.uuid_set || nvml_ready()) ld->idx = gpu_index_of(ld->uuid);
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
    TRACE(TR_DEVICES);
    if (cache_open(cfg.cache) < 0) return -1;
    TRACE(TR_CACHE_OPEN);
    if (ledger_claim() < 0) return -1;
    TRACE(TR_LEDGER_CLAIM);
    if (shm_attach(n) < 0) return -1;
    TRACE(TR_SLOT);
    nldev = n;
    for (int i = 0; i < n; i++)
        if (ldevs[i].sm || adv_sm_of(i)) any_sm = 1;
    ledger_attached(1);
    return 0;
}

__attribute__((destructor)) static void vgpu_fini(void) {
    sm_exit_report();
    shm_detach();
}

#ifndef MADV_WIPEONFORK
#define MADV_WIPEONFORK 18
#endif
/* Moves the state into a page the kernel zeroes in a forked child (Linux
 * >= 4.14), so that every wrapper of a child, made by glibc's fork or the raw
 * system call, finds ST_UNINIT and comes here (vgpu_init_mu held). */
static void state_page(void) {
    if (vgpu_statep != &state_static) return;
    void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    if (madvise(p, 4096, MADV_WIPEONFORK) != 0) {
        munmap(p, 4096); /* old kernel: the pid is compared on the slow paths (vgpu_fork_check) */
        return;
    }
    *(int *)p = __atomic_load_n(&state_static, __ATOMIC_ACQUIRE);
    __atomic_store_n(&vgpu_statep, (int *)p, __ATOMIC_RELEASE);
    __atomic_store_n(&vgpu_wipe_ok, 1, __ATOMIC_RELEASE);
}

/* In a child of a process that attached (any fork): it becomes a process that
 * holds nothing of its parent's (ledger_forked_child: its allocations and
 * SM-limited launches are refused), and 1 is returned. Else 0. */
int vgpu_fork_check(void) {
    pid_t a = __atomic_load_n(&att_pid, __ATOMIC_ACQUIRE);
    if (!a || getpid() == a) return 0;
    pthread_mutex_t init = PTHREAD_MUTEX_INITIALIZER;
    vgpu_init_mu = init; /* a raw fork copies mutexes other threads held */
    ledger_forked_child();
    __atomic_store_n(&att_pid, getpid(), __ATOMIC_RELEASE); /* a grandchild is told apart from us */
    __atomic_store_n(&g_state, ST_ACTIVE, __ATOMIC_RELEASE); /* wiped in a child: the wrappers run again */
    vgpu_log(VGPU_LOG_DEBUG, "a forked child: no allocations or SM-limited launches of its own");
    return 1;
}

/* Slow path of every wrapper: loads config, resolves the driver, attaches.
 * Returns ST_PASS, ST_ACTIVE or ST_ERROR. */
int vgpu_enter_slow(int call_cuinit) {
    if (vgpu_fork_check()) return ST_ACTIVE;
    int crc = cfg_status();
    resolve_cuda_once();
    pthread_mutex_lock(&vgpu_init_mu);
    state_page();
    int st = __atomic_load_n(&g_state, __ATOMIC_ACQUIRE);
    if (st != ST_UNINIT) goto out;
    if (crc < 0) {
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
            __atomic_store_n(&att_pid, getpid(), __ATOMIC_RELEASE);
        }
    }
    __atomic_store_n(&g_launch_fast, st == ST_PASS || (st == ST_ACTIVE && !any_sm), __ATOMIC_RELEASE);
    __atomic_store_n(&g_state, st, __ATOMIC_RELEASE);
out:
    pthread_mutex_unlock(&vgpu_init_mu);
    return st;
}

EXPORT CUresult cuInit(unsigned int flags) {
    TRACE(TR_ENTRY);
    int crc = cfg_status();
    TRACE(TR_CONFIG);
    resolve_cuda_once();
    TRACE(TR_DLOPEN_CUDA);
    if (crc < 0) return CUDA_ERROR_INVALID_VALUE; /* fail closed; stderr names the variable */
    if (!REAL(cuInit)) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = REAL(cuInit)(flags);
    TRACE(TR_REAL_CUINIT);
    if (r != CUDA_SUCCESS) return r;
    int st = vgpu_enter_slow(0);
    vgpu_trace_print();
    return st == ST_ERROR ? CUDA_ERROR_INVALID_VALUE : r;
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

static CUresult cuCtxCreate_v2_acct(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    ENTER_OR(REAL(cuCtxCreate_v2)(pctx, flags, dev));
    CTX_CREATE_BODY(REAL(cuCtxCreate_v2)(pctx, flags, dev), dev);
}

static CUresult cuCtxCreate_v3_acct(CUcontext *pctx, void *params, int n, unsigned int flags, CUdevice dev) {
    ENTER_OR(REAL(cuCtxCreate_v3)(pctx, params, n, flags, dev));
    CTX_CREATE_BODY(REAL(cuCtxCreate_v3)(pctx, params, n, flags, dev), dev);
}

static CUresult cuCtxCreate_v4_acct(CUcontext *pctx, void *params, unsigned int flags, CUdevice dev) {
    ENTER_OR(REAL(cuCtxCreate_v4)(pctx, params, flags, dev));
    CTX_CREATE_BODY(REAL(cuCtxCreate_v4)(pctx, params, flags, dev), dev);
}

static CUresult cuCtxDestroy_v2_acct(CUcontext ctx) {
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

static CUresult cuDevicePrimaryCtxRetain_acct(CUcontext *pctx, CUdevice dev) {
    ENTER_OR(REAL(cuDevicePrimaryCtxRetain)(pctx, dev));
    struct ldev *ld = ldev_for(dev);
    if (!ld) return REAL(cuDevicePrimaryCtxRetain)(pctx, dev);
    if (ld == LD_REFUSE) return refuse_dev("a primary context");
    pthread_mutex_lock(&vgpu_init_mu);
    uint64_t charged = 0;
    if (ld->prim == 0) {
        if (charge(ld, cfg.reserve) < 0) {
            pthread_mutex_unlock(&vgpu_init_mu);
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
    pthread_mutex_unlock(&vgpu_init_mu);
    return r;
}

static CUresult cuDevicePrimaryCtxRelease_v2_acct(CUdevice dev) {
    ENTER_OR(REAL(cuDevicePrimaryCtxRelease_v2)(dev));
    struct ldev *ld = ldev_of(dev);
    pthread_mutex_lock(&vgpu_init_mu);
    if (ld && ld->prim == 1) sm_forget_ctx(ld->prim_ctx); /* the last release destroys it */
    CUresult r = NESTED(REAL(cuDevicePrimaryCtxRelease_v2)(dev));
    if (r == CUDA_SUCCESS && ld && ld->prim > 0 && --ld->prim == 0) {
        pm_drop_ctx((uint64_t)(uintptr_t)ld->prim_ctx);
        credit(ld->e, ld->prim_charge);
        ld->prim_charge = 0;
    }
    pthread_mutex_unlock(&vgpu_init_mu);
    return r;
}

static CUresult cuDevicePrimaryCtxReset_v2_acct(CUdevice dev) {
    ENTER_OR(REAL(cuDevicePrimaryCtxReset_v2)(dev));
    struct ldev *ld = ldev_of(dev);
    pthread_mutex_lock(&vgpu_init_mu);
    if (ld && ld->prim_ctx) sm_forget_ctx(ld->prim_ctx);
    CUresult r = NESTED(REAL(cuDevicePrimaryCtxReset_v2)(dev));
    if (r == CUDA_SUCCESS && ld && ld->prim > 0) {
        ld->prim = 0;
        pm_drop_ctx((uint64_t)(uintptr_t)ld->prim_ctx);
        credit(ld->e, ld->prim_charge);
        ld->prim_charge = 0;
    }
    pthread_mutex_unlock(&vgpu_init_mu);
    return r;
}

CTX_GEN_WRAP(cuCtxCreate_v2, (CUcontext *pctx, unsigned int flags, CUdevice dev), (pctx, flags, dev))
CTX_GEN_WRAP(cuCtxCreate_v3, (CUcontext *pctx, void *params, int n, unsigned int flags, CUdevice dev),
             (pctx, params, n, flags, dev))
CTX_GEN_WRAP(cuCtxCreate_v4, (CUcontext *pctx, void *params, unsigned int flags, CUdevice dev), (pctx, params, flags, dev))
CTX_GEN_WRAP(cuCtxDestroy_v2, (CUcontext ctx), (ctx))
CTX_GEN_WRAP(cuDevicePrimaryCtxRetain, (CUcontext *pctx, CUdevice dev), (pctx, dev))
CTX_GEN_WRAP(cuDevicePrimaryCtxRelease_v2, (CUdevice dev), (dev))
CTX_GEN_WRAP(cuDevicePrimaryCtxReset_v2, (CUdevice dev), (dev))

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


#ifdef VGPU_TRACE_INIT
uint64_t vgpu_trace[TR_N];

/* one line on stderr: microseconds per stage of the first cuInit */
void vgpu_trace_print(void) {
    static int done;
    static const char *const names[TR_N] = {"entry", "config", "dlopen_cuda", "real_cuinit", "nvml",
                                            "devices", "cache_open", "ledger_claim", "slot"};
    if (done++ || !vgpu_trace[TR_SLOT]) return;
    char buf[512];
    int n = snprintf(buf, sizeof buf, "vgpu-init-trace");
    for (int i = 1; i < TR_N; i++)
        n += snprintf(buf + n, sizeof buf - (size_t)n, " %s=%.1f", names[i],
                      (double)(vgpu_trace[i] - vgpu_trace[i - 1]) / 1e3);
    n += snprintf(buf + n, sizeof buf - (size_t)n, " total=%.1f\n",
                  (double)(vgpu_trace[TR_SLOT] - vgpu_trace[TR_ENTRY]) / 1e3);
    ssize_t w = write(2, buf, (size_t)n);
    (void)w;
}
#endif
