/* Mock CUDA driver (libcuda.so.<driver version>) for the simulated host.
 *
 * Installed by nvctk/sim/build.py with the topology compiled in (nvsim_topo,
 * nvsim_state.h). It answers the driver API the way a real libcuda does for a
 * process that sees the simulated GPUs, so the CUDA sample, the interposer
 * (libvgpu) and anything else built against cuda.h run unchanged.
 *
 * Design decisions (and where the mock knowingly differs from a real driver):
 *
 * Devices. A GPU is visible when <dev dir>/nvidia<minor> exists (the same /dev
 * rule as the NVML mock: nvsim_visible_gpus()). A visible GPU with MIG enabled
 * shows its MIG devices (those nvsim_mig_visible() admits) instead of itself,
 * as CUDA does; unlike CUDA 12 the mock enumerates all of them, not only the
 * first. Devices are numbered from 0 in that order (a container's view).
 * CUDA_VISIBLE_DEVICES then selects and reorders: entries are indexes into that
 * list, GPU-/MIG- UUIDs or unambiguous UUID prefixes; the first invalid,
 * ambiguous or repeated entry ends the list, as in CUDA. With no device left,
 * cuInit fails with CUDA_ERROR_NO_DEVICE and every later call reports
 * CUDA_ERROR_NOT_INITIALIZED (what CUDA_VISIBLE_DEVICES="" does to a real
 * driver).
 *
 * Memory. Device memory is host memory: each allocation is its own
 * mmap(MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE), so memcpy/memset and kernels
 * really work and untouched pages cost nothing (an 80 GiB "GPU" fits anywhere);
 * a CUdeviceptr is the host address. Every allocation charges the shared state
 * (nvsim_mem_charge: one pool per GPU for all processes, on the host and in
 * containers) with the size a real driver would consume, and every free credits
 * exactly what was charged, from a per-process table (ptr -> size, gpu):
 *   cuMemAlloc/Managed/Async/FromPoolAsync  the requested bytes
 *   cuMemAllocPitch    pitch (width rounded up to 512) x height
 *   arrays             width x height x depth x element size (x channels),
 *                      mipmapped arrays the sum of their levels
 *   cuMemCreate        its size, at create, for device locations only (host
 *                      locations are not device memory); freed when released
 *                      and unmapped, as the driver does
 * Context creation (cuCtxCreate, first primary-context retain) charges a
 * per-context reserve, 64 MiB or $NVSIM_CONTEXT_RESERVE_MIB, as a real context
 * costs device memory; destroying it (or the last primary release) credits the
 * reserve and frees everything allocated in it. Over capacity ->
 * CUDA_ERROR_OUT_OF_MEMORY. MIG devices charge their parent GPU's pool (that is
 * what NVML shows) and cap this process's use at the MIG device's memory; the
 * state has no per-MIG counters, so two processes on one MIG device are not
 * capped jointly. Memory pools release freed memory at once (release threshold
 * 0), so pool allocations charge and credit exactly like cuMemAlloc. Memory a
 * killed process held is credited back by the state's slot reclamation, which
 * the mock triggers (nvsim_reap) before reporting OUT_OF_MEMORY and in
 * cuMemGetInfo, so a dead process's memory never looks used.
 *
 * Kernels. cuModuleLoad* accepts any image (no PTX/cubin is parsed).
 * cuModuleGetFunction knows "vectorAdd" (also its C++ mangled name
 * _Z9vectorAdd...; params float *A, float *B, float *C, int n; computes
 * C = A + B for the launched threads, like the CUDA sample); names starting
 * with "missing" give CUDA_ERROR_NOT_FOUND so tests can exercise that path;
 * any other name is a kernel that only occupies the device. Launches are
 * synchronous: the calling thread holds the simulated GPU (nvsim_run_kernel,
 * serialised across all processes) for $NVSIM_KERNEL_US microseconds if set,
 * else the topology's kernel_time_us (0: no sleep, the kernel is only counted),
 * then does the computation; so streams, events and synchronisation are
 * trivially ordered and errors surface at launch (and are not sticky).
 * With NVSIM_ASYNC=1 launches are asynchronous in time, as on a real GPU: the
 * call returns at once and the kernel is queued on the GPU's timeline in the
 * shared state (nvsim_queue_kernel: it starts when the GPU has finished all
 * work queued before it by any process, and after the previous work on its
 * stream); the computation is still done at launch, so results are visible
 * early, only timing is deferred. Each stream has a tail (the end of its last
 * queued work; the default streams share their context's); an event is stamped
 * with max(record time, its stream's tail), cuEventQuery answers
 * CUDA_ERROR_NOT_READY until then, cuEventSynchronize/cuStreamSynchronize/
 * cuCtxSynchronize sleep until it, cuEventElapsedTime is NOT_READY while either
 * event is pending, cuStreamWaitEvent moves the stream's tail. A launch blocks
 * while the GPU has more than 1024 kernels' worth of work queued (a real
 * GPU's finite launch queue). Synchronous copies do not wait for the queue.
 * Busy counters count a queued kernel at launch. In the default (synchronous)
 * mode tails stay 0, so events complete when recorded. Graphs (cuGraphAddKernelNode or stream capture) hold
 * kernel nodes only and run them in insertion order, which is a topological
 * order because a node's dependencies must exist before it; copies, memsets,
 * event records, synchronisation and stream-ordered allocation on a capturing
 * stream return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED rather than being
 * captured.
 *
 * Entry points. cuGetProcAddress(_v2) resolves base names with the caller's
 * CUDA version through one table (name, first version, function), picking the
 * newest entry not newer than the caller asked for, as the real driver does
 * ("cuMemAlloc" at 12040 -> cuMemAlloc_v2, "cuCtxCreate" -> cuCtxCreate_v3).
 * Pre-3.2 32-bit entry points are not implemented: asking for them gives
 * CUDA_ERROR_NOT_FOUND (VERSION_NOT_SUFFICIENT). Per-thread-default-stream
 * variants resolve to the same functions (launches are synchronous anyway).
 *
 * Threads. Handles are checked by a magic number. One mutex guards the
 * allocation table, contexts and pools; it is never held while a kernel runs.
 * The context stack is per thread, as in CUDA.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cuda_types.h"
#include "nvsim_state.h"

#define CUAPI __attribute__((visibility("default")))

#define MIB (1024ull * 1024ull)
#define VMM_GRANULARITY (2 * MIB) /* what real GPUs report for cuMemCreate */
#define PITCH_ALIGN 512
#define DEFAULT_CONTEXT_RESERVE_MIB 64
#define MAX_DEVICES (NVSIM_MAX_GPUS * 8)
#define CTX_STACK_MAX 64

/* return err when cond holds: the checks that open nearly every entry point, one line each */
#define FAIL_IF(cond, err)                                                                         \
    do {                                                                                           \
        if (cond)                                                                                  \
            return (err);                                                                          \
    } while (0)

enum {
    MAGIC_CTX = 0x43545831,
    MAGIC_MOD = 0x4d4f4431,
    MAGIC_FUNC = 0x46554e31,
    MAGIC_STREAM = 0x53545231,
    MAGIC_EVENT = 0x45564e31,
    MAGIC_POOL = 0x504f4f31,
    MAGIC_VMM = 0x564d4d31,
    MAGIC_GRAPH = 0x47525031,
    MAGIC_NODE = 0x4e4f4431,
    MAGIC_EXEC = 0x45584531,
    MAGIC_ARRAY = 0x41525231,
    MAGIC_DEAD = 0x44454144,
};

struct dev;

struct ctx {
    uint32_t magic;
    int alive;
    int primary;
    unsigned flags;
    struct dev *d;
    uint64_t tail_ns;     /* NVSIM_ASYNC: end of the default streams' queued work */
    uint64_t tail_all_ns; /* NVSIM_ASYNC: end of all this context's queued work */
};

struct pool {
    uint32_t magic;
    struct dev *d;
    uint64_t used, used_high;
    uint64_t idle; /* freed bytes the pool keeps (up to its release threshold), still on the GPU */
    uint64_t release_threshold;
    int reuse[3];
};

struct dev {
    unsigned gpu;                         /* topology index: the shared state's GPU */
    const struct nvsim_topo_gpu *t;
    const struct nvsim_topo_mig *mig;     /* non-NULL: this device is a MIG device */
    uint64_t total;                       /* bytes */
    uint64_t local_used;                  /* this process's charges (MIG cap) */
    struct ctx pctx;                      /* the primary context */
    int pctx_refs;
    unsigned pctx_flags;
    struct pool default_pool;
    struct pool *cur_pool;
};

enum kind { K_LINEAR, K_ARRAY, K_VMM_RESERVE, K_VMM_MAP };

struct vmm {
    uint32_t magic;
    int fd;
    size_t size;
    uint64_t charged;
    struct dev *d; /* NULL for host locations */
    int refs;  /* cuMemCreate's reference plus each cuMemRetainAllocationHandle's */
    int maps;
};

/* One row per live allocation, reservation or mapping of this process. */
struct alloc {
    uintptr_t base;
    size_t len;        /* bytes mapped at base (LINEAR, RESERVE, MAP) */
    size_t size;       /* bytes the caller asked for */
    uint64_t charged;  /* bytes charged to d */
    struct dev *d;
    struct ctx *ctx;   /* freed with it; NULL = not context-bound */
    int kind;
    struct pool *pool;
    struct vmm *h;     /* K_VMM_MAP */
    int access;        /* K_VMM_MAP: cuMemSetAccess done */
};

struct array {
    uint32_t magic;
};

struct module {
    uint32_t magic;
    struct ctx *ctx;
};

enum kernel { KERNEL_BUSY, KERNEL_VECTORADD, KERNEL_SPIN };

struct func {
    uint32_t magic;
    int kernel;
    struct module *m;
    char name[128];
    unsigned block[3]; /* cuFuncSetBlockShape (legacy launches); 0 = 1 */
    unsigned shmem;    /* cuFuncSetSharedSize */
};

struct kargs {
    CUdeviceptr a, b, c;
    int n;
    uint64_t spin_ns; /* KERNEL_SPIN: how long this launch occupies the GPU */
};

struct launch {
    struct func *f;
    unsigned grid[3], block[3], shmem;
    struct kargs args;
};

struct gnode {
    uint32_t magic;
    struct launch l;
};

struct graph {
    uint32_t magic;
    size_t n, cap;
    struct gnode **nodes;
    /* memory allocation nodes: address ranges reserved at the node's creation;
     * the memory behind them is held by each instantiated graph (exec), as a
     * real driver backs them per exec, from instantiation to its destruction */
    struct gnode *anodes[16];
    uintptr_t abase[16];
    size_t alen[16], na;
    uint64_t abytes;
    struct dev *adev;
};

struct exec {
    uint32_t magic;
    size_t n;
    struct launch *l;
    uint64_t abytes; /* graph allocations held (charged on adev) */
    struct dev *adev;
};
static struct exec *exec_free; /* destroyed execs, reused (lk); chained through l */

struct stream {
    uint32_t magic;
    struct ctx *ctx;
    unsigned flags;
    int priority;
    struct graph *capture; /* non-NULL while capturing */
    uint64_t tail_ns;      /* NVSIM_ASYNC: end of its last queued work */
};

struct event {
    uint32_t magic;
    unsigned flags;
    int recorded;
    uint64_t t_ns;
};

static struct {
    pthread_once_t once;
    CUresult init_result;
    int initialized;
    struct nvsim_state *st;
    int ndev;
    struct dev devs[MAX_DEVICES];
    uint64_t kernel_ns;
    int async;            /* NVSIM_ASYNC=1: kernels run later, on the GPU's timeline */
    uint64_t ctx_reserve;
    struct alloc *tab;
    size_t ntab, captab;
} g = {.once = PTHREAD_ONCE_INIT};

static pthread_mutex_t lk = PTHREAD_MUTEX_INITIALIZER;

static __thread struct ctx *tls_stack[CTX_STACK_MAX];
static __thread int tls_depth;

/* ---- NVSIM_ASYNC timelines (all 0 in synchronous mode) ---- */

static void sleep_until(uint64_t t_ns)
{
    struct timespec dl = {(time_t)(t_ns / 1000000000ull), (long)(t_ns % 1000000000ull)};
    if (t_ns > nvsim_now_ns())
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &dl, NULL) == EINTR)
            ;
}

static void atomic_max(uint64_t *p, uint64_t v)
{
    uint64_t cur = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        ;
}

static uint64_t *tail_of(struct ctx *c, struct stream *sp)
{
    return sp ? &sp->tail_ns : &c->tail_ns;
}

/* ------------------------------------------------------------------ */
/* enumeration                                                         */

static uint64_t env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    char *end;
    if (!v || !*v)
        return dflt;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || *end)
        return dflt;
    return x;
}

static int ci_prefix(const char *s, const char *prefix)
{
    return strncasecmp(s, prefix, strlen(prefix)) == 0;
}

static const char *dev_uuid(const struct dev *d)
{
    return d->mig ? d->mig->uuid : d->t->uuid;
}

/* CUDA_VISIBLE_DEVICES entry -> position in all[], or -1. */
static int cvd_lookup(const char *e, const struct dev *all, int n)
{
    if (ci_prefix(e, "GPU-") || ci_prefix(e, "MIG-")) {
        int hit = -1;
        size_t len = strlen(e);
        for (int i = 0; i < n; i++) {
            if (strncasecmp(dev_uuid(&all[i]), e, len) == 0) {
                if (hit >= 0)
                    return -1; /* ambiguous prefix */
                hit = i;
            }
        }
        return hit;
    }
    char *end;
    errno = 0;
    long v = strtol(e, &end, 10);
    if (end == e || *end || errno || v < 0 || v >= n)
        return -1;
    return (int)v;
}

static void enumerate(void)
{
    static struct dev all[MAX_DEVICES];
    unsigned idx[NVSIM_MAX_GPUS];
    unsigned ng = nvsim_visible_gpus(idx, NVSIM_MAX_GPUS);
    int n = 0;
    for (unsigned i = 0; i < ng; i++) {
        const struct nvsim_topo_gpu *t = &nvsim_topo.gpus[idx[i]];
        if (t->nmig == 0) {
            all[n++] = (struct dev){.gpu = idx[i], .t = t, .total = t->memory_mib * MIB};
            continue;
        }
        for (unsigned m = 0; m < t->nmig && n < MAX_DEVICES; m++) {
            if (nvsim_mig_visible(&t->migs[m]))
                all[n++] = (struct dev){.gpu = idx[i], .t = t, .mig = &t->migs[m],
                                        .total = t->migs[m].memory_mib * MIB};
        }
    }

    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (!cvd) {
        memcpy(g.devs, all, sizeof(all[0]) * (size_t)n);
        g.ndev = n;
        return;
    }
    char *copy = strdup(cvd), *save = NULL;
    int used[MAX_DEVICES] = {0};
    g.ndev = 0;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*tok))
            tok++;
        char *e = tok + strlen(tok);
        while (e > tok && isspace((unsigned char)e[-1]))
            *--e = 0;
        int k = cvd_lookup(tok, all, n);
        if (k < 0 || used[k])
            break;
        used[k] = 1;
        g.devs[g.ndev++] = all[k];
    }
    free(copy);
}

static void init_once(void)
{
    g.st = nvsim_state_open();
    if (!g.st) {
        g.init_result = CUDA_ERROR_OPERATING_SYSTEM;
        return;
    }
    g.kernel_ns = env_u64("NVSIM_KERNEL_US", nvsim_topo.kernel_time_us) * 1000ull;
    g.async = env_u64("NVSIM_ASYNC", 0) != 0;
    g.ctx_reserve = env_u64("NVSIM_CONTEXT_RESERVE_MIB", DEFAULT_CONTEXT_RESERVE_MIB) * MIB;
    enumerate();
    for (int i = 0; i < g.ndev; i++) {
        struct dev *d = &g.devs[i];
        d->pctx = (struct ctx){.magic = MAGIC_CTX, .primary = 1, .d = d};
        d->default_pool = (struct pool){.magic = MAGIC_POOL, .d = d};
        d->cur_pool = &d->default_pool;
    }
    if (g.ndev == 0) {
        g.init_result = CUDA_ERROR_NO_DEVICE;
        return;
    }
    g.init_result = CUDA_SUCCESS;
    g.initialized = 1;
}

CUAPI CUresult cuInit(unsigned int Flags)
{
    FAIL_IF(Flags != 0, CUDA_ERROR_INVALID_VALUE);
    pthread_once(&g.once, init_once);
    return g.init_result;
}

#define NEED_INIT()                                                                                \
    do {                                                                                           \
        if (!g.initialized)                                                                        \
            return CUDA_ERROR_NOT_INITIALIZED;                                                     \
    } while (0)

static CUresult get_dev(CUdevice dev, struct dev **out)
{
    FAIL_IF(!g.initialized, CUDA_ERROR_NOT_INITIALIZED);
    FAIL_IF(dev < 0 || dev >= g.ndev, CUDA_ERROR_INVALID_DEVICE);
    *out = &g.devs[dev];
    return CUDA_SUCCESS;
}

/* `d` = the device of ordinal `dev`, or return get_dev()'s error (the head of every
 * per-device entry point) */
#define GET_DEV(dev, d)                                                                            \
    do {                                                                                           \
        CUresult r_ = get_dev(dev, &(d));                                                          \
        if (r_)                                                                                    \
            return r_;                                                                             \
    } while (0)

/* struct dev *d of `ordinal`, with the out pointer `out` not NULL: how most device
   queries open */
#define DEV_QUERY(ordinal, d, out)                                                                 \
    struct dev *d;                                                                                 \
    GET_DEV(ordinal, d);                                                                           \
    FAIL_IF(!(out), CUDA_ERROR_INVALID_VALUE)

static CUdevice dev_ordinal(const struct dev *d)
{
    return (CUdevice)(d - g.devs);
}

/* ------------------------------------------------------------------ */
/* errors and versions                                                 */

static const struct {
    CUresult r;
    const char *name, *str;
} errtab[] = {
#include "cuda_errors.inc" /* nvctk/sim/data/cuda_errors.txt */
};

/* errtab's name (want_name) or description of `error` into *pStr; NULL and
 * CUDA_ERROR_INVALID_VALUE for a code the driver does not know */
static CUresult error_text(CUresult error, const char **pStr, int want_name)
{
    FAIL_IF(!pStr, CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < sizeof(errtab) / sizeof(errtab[0]); i++) {
        if (errtab[i].r == error) {
            *pStr = want_name ? errtab[i].name : errtab[i].str;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    return error_text(error, pStr, 0);
}

CUAPI CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    return error_text(error, pStr, 1);
}

/* Works before cuInit, as in the real driver: the runtime asks first. */
CUAPI CUresult cuDriverGetVersion(int *driverVersion)
{
    FAIL_IF(!driverVersion, CUDA_ERROR_INVALID_VALUE);
    *driverVersion = nvsim_topo.cuda_version_int;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* devices                                                             */

CUAPI CUresult cuDeviceGetCount(int *count)
{
    NEED_INIT();
    FAIL_IF(!count, CUDA_ERROR_INVALID_VALUE);
    *count = g.ndev;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    DEV_QUERY(ordinal, d, device);
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    struct dev *d;
    GET_DEV(dev, d);
    FAIL_IF(!name || len <= 0, CUDA_ERROR_INVALID_VALUE);
    if (d->mig)
        snprintf(name, (size_t)len, "%s MIG %s", d->t->name, d->mig->profile);
    else
        snprintf(name, (size_t)len, "%s", d->t->name);
    return CUDA_SUCCESS;
}

/* "GPU-xxxxxxxx-xxxx-..." -> the 16 raw bytes. */
static void parse_uuid(const char *s, CUuuid *out)
{
    memset(out, 0, sizeof(*out));
    const char *p = strchr(s, '-');
    p = p ? p + 1 : s;
    int nib = 0;
    for (; *p && nib < 32; p++) {
        int v;
        if (*p >= '0' && *p <= '9')
            v = *p - '0';
        else if (*p >= 'a' && *p <= 'f')
            v = *p - 'a' + 10;
        else if (*p >= 'A' && *p <= 'F')
            v = *p - 'A' + 10;
        else
            continue;
        out->bytes[nib / 2] = (char)(out->bytes[nib / 2] | (v << (nib % 2 ? 0 : 4)));
        nib++;
    }
}

/* v1 gives a MIG device's parent GPU; v2 (CUDA 11.4+) the MIG device itself. */
CUAPI CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    DEV_QUERY(dev, d, uuid);
    parse_uuid(d->t->uuid, uuid);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    DEV_QUERY(dev, d, uuid);
    parse_uuid(dev_uuid(d), uuid);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    DEV_QUERY(dev, d, bytes);
    *bytes = d->total;
    return CUDA_SUCCESS;
}

static int sm_count(const struct dev *d)
{
    int sms;
    if (d->t->cc_major >= 9)
        sms = 132;
    else if (d->t->cc_major == 8 && d->t->cc_minor == 0)
        sms = 108;
    else if (d->t->cc_major == 8)
        sms = 84;
    else if (d->t->cc_major == 7)
        sms = 80;
    else
        sms = 40;
    if (d->mig)
        sms = sms * (int)d->mig->slices / 7;
    return sms > 0 ? sms : 1;
}

CUAPI CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    DEV_QUERY(dev, d, pi);
    int hopper = d->t->cc_major >= 9;
    int v;
    switch (attrib) {
#include "cuda_attributes.inc" /* nvctk/sim/data/cuda_attributes.txt */
    default:
        /* Attributes the mock has no opinion on are valid but unsupported (0),
         * as a real driver reports features a device lacks; beyond the enum's
         * end they are invalid. */
        FAIL_IF((int)attrib <= 0 || (int)attrib >= 140, CUDA_ERROR_INVALID_VALUE);
        v = 0;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    struct dev *d;
    GET_DEV(dev, d);
    FAIL_IF(!major || !minor, CUDA_ERROR_INVALID_VALUE);
    *major = d->t->cc_major;
    *minor = d->t->cc_minor;
    return CUDA_SUCCESS;
}

/* CUDA's form: 4-digit domain, upper-case hex (NVML's has 8 digits). */
CUAPI CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    struct dev *d;
    GET_DEV(dev, d);
    FAIL_IF(!pciBusId || len <= 0, CUDA_ERROR_INVALID_VALUE);
    snprintf(pciBusId, (size_t)len, "%04X:%02X:%02X.0", d->t->pci_domain, d->t->pci_bus,
             d->t->pci_device);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId)
{
    NEED_INIT();
    FAIL_IF(!dev || !pciBusId, CUDA_ERROR_INVALID_VALUE);
    unsigned dom = 0, bus, devno, fn = 0;
    if (sscanf(pciBusId, "%x:%x:%x.%x", &dom, &bus, &devno, &fn) < 3) {
        dom = 0;
        FAIL_IF(sscanf(pciBusId, "%x:%x.%x", &bus, &devno, &fn) < 2, CUDA_ERROR_INVALID_VALUE);
    }
    for (int i = 0; i < g.ndev; i++) {
        const struct nvsim_topo_gpu *t = g.devs[i].t;
        if (t->pci_domain == dom && t->pci_bus == bus && t->pci_device == devno) {
            *dev = i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

/* ------------------------------------------------------------------ */
/* charging                                                            */

static CUresult charge(struct dev *d, uint64_t bytes)
{
    if (bytes == 0)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&lk);
    if (d->mig && d->local_used + bytes > d->total) {
        pthread_mutex_unlock(&lk);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* Memory of processes that died is only given back when someone reaps
     * their slots; do that before calling the device full. */
    if (nvsim_mem_charge(g.st, d->gpu, bytes) != 0 &&
        (nvsim_reap(g.st), nvsim_mem_charge(g.st, d->gpu, bytes) != 0)) {
        pthread_mutex_unlock(&lk);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    d->local_used += bytes;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

/* Caller holds lk. */
static void credit_locked(struct dev *d, uint64_t bytes)
{
    if (!d || bytes == 0)
        return;
    nvsim_mem_credit(g.st, d->gpu, bytes);
    d->local_used = d->local_used >= bytes ? d->local_used - bytes : 0;
}

static void credit(struct dev *d, uint64_t bytes)
{
    pthread_mutex_lock(&lk);
    credit_locked(d, bytes);
    pthread_mutex_unlock(&lk);
}

/* ------------------------------------------------------------------ */
/* the allocation table (callers hold lk)                              */

static int tab_add(const struct alloc *a)
{
    if (g.ntab == g.captab) {
        size_t cap = g.captab ? g.captab * 2 : 64;
        struct alloc *t = realloc(g.tab, cap * sizeof(*t));
        if (!t)
            return -1;
        g.tab = t;
        g.captab = cap;
    }
    g.tab[g.ntab++] = *a;
    return 0;
}

static void tab_del(size_t i)
{
    g.tab[i] = g.tab[--g.ntab];
}

static long tab_find(uintptr_t base, int kind)
{
    for (size_t i = 0; i < g.ntab; i++)
        if (g.tab[i].base == base && g.tab[i].kind == kind)
            return (long)i;
    return -1;
}

/* The K_LINEAR / K_VMM_MAP row containing p, or -1. */
static long tab_containing(uintptr_t p)
{
    for (size_t i = 0; i < g.ntab; i++) {
        const struct alloc *a = &g.tab[i];
        if ((a->kind == K_LINEAR || a->kind == K_VMM_MAP) && p >= a->base &&
            p - a->base < a->len)
            return (long)i;
    }
    return -1;
}

/* Is [p, p+n) device memory this process may touch? VMM ranges may span
 * several adjacent mappings, each of which must have had cuMemSetAccess. */
static int dev_range_ok(CUdeviceptr p, size_t n)
{
    uintptr_t cur = (uintptr_t)p, end = (uintptr_t)p + n;
    if (n == 0)
        return 1;
    if (end < cur)
        return 0;
    pthread_mutex_lock(&lk);
    int ok = 1;
    while (cur < end) {
        long i = tab_containing(cur);
        if (i < 0 || (g.tab[i].kind == K_VMM_MAP && !g.tab[i].access)) {
            ok = 0;
            break;
        }
        if (g.tab[i].kind == K_LINEAR && end - g.tab[i].base > g.tab[i].size) {
            ok = 0; /* past the end of what was allocated */
            break;
        }
        cur = g.tab[i].base + g.tab[i].len;
    }
    pthread_mutex_unlock(&lk);
    return ok;
}

static void vmm_destroy_locked(struct vmm *h)
{
    credit_locked(h->d, h->charged);
    close(h->fd);
    h->magic = MAGIC_DEAD;
    free(h);
}

/* Releases row i's resources and removes it. */
static void release_row_locked(size_t i)
{
    struct alloc *a = &g.tab[i];
    switch (a->kind) {
    case K_LINEAR:
        munmap((void *)a->base, a->len);
        if (a->pool) {
            struct pool *p = a->pool;
            p->used = p->used >= a->charged ? p->used - a->charged : 0;
            /* a pool keeps freed memory until it holds its release threshold,
             * as a real driver's does: still on the GPU, reused by its next
             * allocations, given back by cuMemPoolTrimTo */
            uint64_t held = p->used + p->idle, keep = 0;
            if (p->release_threshold > held)
                keep = p->release_threshold - held < a->charged ? p->release_threshold - held : a->charged;
            p->idle += keep;
            credit_locked(a->d, a->charged - keep);
            tab_del(i);
            return;
        }
        break;
    case K_ARRAY:
        ((struct array *)a->base)->magic = MAGIC_DEAD;
        free((void *)a->base);
        break;
    case K_VMM_MAP:
        /* back to a reservation, as cuMemUnmap leaves the range */
        mmap((void *)a->base, a->len, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        if (--a->h->maps == 0 && a->h->refs == 0)
            vmm_destroy_locked(a->h);
        break;
    case K_VMM_RESERVE:
        munmap((void *)a->base, a->len);
        break;
    }
    credit_locked(a->d, a->charged);
    tab_del(i);
}

/* Everything a context owned goes with it, as in a real driver. */
static void free_ctx_allocs_locked(struct ctx *c)
{
    for (size_t i = 0; i < g.ntab;) {
        if (g.tab[i].ctx == c)
            release_row_locked(i); /* moves the last row into i */
        else
            i++;
    }
}

/* ------------------------------------------------------------------ */
/* contexts                                                            */

static struct ctx *cur_ctx(void)
{
    return tls_depth ? tls_stack[tls_depth - 1] : NULL;
}

static CUresult need_ctx(struct ctx **out)
{
    FAIL_IF(!g.initialized, CUDA_ERROR_NOT_INITIALIZED);
    struct ctx *c = cur_ctx();
    FAIL_IF(!c || c->magic != MAGIC_CTX || !c->alive, CUDA_ERROR_INVALID_CONTEXT);
    *out = c;
    return CUDA_SUCCESS;
}

/* struct ctx *c: the calling thread's current context, or return need_ctx's error */
#define NEED_CTX(c)                                                                                \
    struct ctx *c;                                                                                 \
    do {                                                                                           \
        CUresult r_ = need_ctx(&(c));                                                              \
        if (r_)                                                                                    \
            return r_;                                                                             \
    } while (0)

static CUresult ctx_open(struct dev *d)
{
    CUresult r = charge(d, g.ctx_reserve);
    FAIL_IF(r, r);
    /* registers this process on the GPU even with a zero reserve, so NVML
     * lists it as soon as it has a context, as with a real GPU */
    nvsim_proc_slot(g.st, d->gpu);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    DEV_QUERY(dev, d, pctx);
    pthread_mutex_lock(&lk);
    if (d->pctx_refs == 0) {
        pthread_mutex_unlock(&lk);
        CUresult r = ctx_open(d);
        FAIL_IF(r, r);
        pthread_mutex_lock(&lk);
        if (d->pctx_refs == 0) {
            d->pctx.alive = 1;
            d->pctx.flags = d->pctx_flags;
        } else {
            credit_locked(d, g.ctx_reserve); /* another thread won the race */
        }
    }
    d->pctx_refs++;
    pthread_mutex_unlock(&lk);
    *pctx = (CUcontext)&d->pctx;
    return CUDA_SUCCESS;
}

static void primary_destroy_locked(struct dev *d)
{
    free_ctx_allocs_locked(&d->pctx);
    credit_locked(d, g.ctx_reserve);
    d->pctx.alive = 0;
    d->pctx_refs = 0;
}

CUAPI CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    struct dev *d;
    GET_DEV(dev, d);
    pthread_mutex_lock(&lk);
    if (d->pctx_refs == 0) {
        pthread_mutex_unlock(&lk);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    if (--d->pctx_refs == 0)
        primary_destroy_locked(d);
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    struct dev *d;
    GET_DEV(dev, d);
    pthread_mutex_lock(&lk);
    if (d->pctx_refs > 0)
        primary_destroy_locked(d);
    d->pctx_flags = 0;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    struct dev *d;
    GET_DEV(dev, d);
    FAIL_IF(flags & ~(unsigned)CU_CTX_FLAGS_MASK, CUDA_ERROR_INVALID_VALUE);
    pthread_mutex_lock(&lk);
    d->pctx_flags = flags;
    d->pctx.flags = flags;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    struct dev *d;
    GET_DEV(dev, d);
    FAIL_IF(!flags || !active, CUDA_ERROR_INVALID_VALUE);
    pthread_mutex_lock(&lk);
    *flags = d->pctx_flags;
    *active = d->pctx_refs > 0;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

static CUresult push(struct ctx *c)
{
    FAIL_IF(tls_depth == CTX_STACK_MAX, CUDA_ERROR_UNKNOWN);
    tls_stack[tls_depth++] = c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    struct dev *d;
    GET_DEV(dev, d);
    FAIL_IF(!pctx || (flags & ~(unsigned)CU_CTX_FLAGS_MASK), CUDA_ERROR_INVALID_VALUE);
    struct ctx *c = calloc(1, sizeof(*c));
    FAIL_IF(!c, CUDA_ERROR_OUT_OF_MEMORY);
    CUresult r = ctx_open(d);
    if (r) {
        free(c);
        return r;
    }
    *c = (struct ctx){.magic = MAGIC_CTX, .alive = 1, .flags = flags, .d = d};
    r = push(c);
    if (r) {
        credit(d, g.ctx_reserve);
        free(c);
        return r;
    }
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                              unsigned int flags, CUdevice dev)
{
    /* SM-count affinity is accepted and ignored: the simulated GPU runs one
     * kernel at a time whatever its share. */
    FAIL_IF(numParams < 0 || (numParams > 0 && !paramsArray), CUDA_ERROR_INVALID_VALUE);
    return cuCtxCreate_v2(pctx, flags, dev);
}

CUAPI CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
                              unsigned int flags, CUdevice dev)
{
    if (ctxCreateParams) {
        if (ctxCreateParams->cigParams)
            return CUDA_ERROR_NOT_SUPPORTED; /* no graphics interop in the sim */
        return cuCtxCreate_v3(pctx, ctxCreateParams->execAffinityParams,
                              ctxCreateParams->numExecAffinityParams, flags, dev);
    }
    return cuCtxCreate_v2(pctx, flags, dev);
}

CUAPI CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    NEED_INIT();
    struct ctx *c = (struct ctx *)ctx;
    FAIL_IF(!c, CUDA_ERROR_INVALID_VALUE);
    FAIL_IF(c->magic != MAGIC_CTX || !c->alive || c->primary, CUDA_ERROR_INVALID_CONTEXT);
    pthread_mutex_lock(&lk);
    free_ctx_allocs_locked(c);
    credit_locked(c->d, g.ctx_reserve);
    c->alive = 0;
    /* the handle stays allocated (marked dead) so stale uses fail cleanly */
    c->magic = MAGIC_DEAD;
    pthread_mutex_unlock(&lk);
    int k = 0;
    for (int i = 0; i < tls_depth; i++)
        if (tls_stack[i] != c)
            tls_stack[k++] = tls_stack[i];
    tls_depth = k;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxSetCurrent(CUcontext ctx)
{
    NEED_INIT();
    struct ctx *c = (struct ctx *)ctx;
    if (!c) {
        if (tls_depth)
            tls_depth--;
        return CUDA_SUCCESS;
    }
    FAIL_IF(c->magic != MAGIC_CTX, CUDA_ERROR_INVALID_CONTEXT);
    if (tls_depth)
        tls_stack[tls_depth - 1] = c;
    else
        tls_stack[tls_depth++] = c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    NEED_INIT();
    FAIL_IF(!pctx, CUDA_ERROR_INVALID_VALUE);
    *pctx = (CUcontext)cur_ctx();
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    NEED_INIT();
    struct ctx *c = (struct ctx *)ctx;
    FAIL_IF(!c, CUDA_ERROR_INVALID_VALUE);
    FAIL_IF(c->magic != MAGIC_CTX, CUDA_ERROR_INVALID_CONTEXT);
    return push(c);
}

CUAPI CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    NEED_INIT();
    FAIL_IF(!tls_depth, CUDA_ERROR_INVALID_CONTEXT);
    struct ctx *c = tls_stack[--tls_depth];
    if (pctx)
        *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxGetDevice(CUdevice *device)
{
    NEED_CTX(c);
    FAIL_IF(!device, CUDA_ERROR_INVALID_VALUE);
    *device = dev_ordinal(c->d);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxGetFlags(unsigned int *flags)
{
    NEED_CTX(c);
    FAIL_IF(!flags, CUDA_ERROR_INVALID_VALUE);
    *flags = c->flags;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    NEED_INIT();
    struct ctx *c = ctx ? (struct ctx *)ctx : cur_ctx();
    FAIL_IF(!version, CUDA_ERROR_INVALID_VALUE);
    FAIL_IF(!c || c->magic != MAGIC_CTX || !c->alive, CUDA_ERROR_INVALID_CONTEXT);
    *version = 3020;
    return CUDA_SUCCESS;
}

/* Work completes at launch (NVSIM_ASYNC: at the context's tail). */
CUAPI CUresult cuCtxSynchronize(void)
{
    NEED_CTX(c);
    sleep_until(__atomic_load_n(&c->tail_all_ns, __ATOMIC_RELAXED));
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* linear memory                                                       */

static size_t page_round(size_t n)
{
    size_t pg = 4096;
    return (n + pg - 1) & ~(pg - 1);
}

/* Maps and charges `charged` bytes on d for a `size`-byte allocation, of
 * which `prepaid` are already on the device (a pool's kept memory). */
static CUresult linear_alloc_prepaid(CUdeviceptr *dptr, size_t size, uint64_t charged, uint64_t prepaid,
                                     struct dev *d, struct ctx *c, struct pool *pool)
{
    FAIL_IF(!dptr, CUDA_ERROR_INVALID_VALUE);
    FAIL_IF(size == 0, CUDA_ERROR_INVALID_VALUE);
    size_t len = page_round(size);
    FAIL_IF(len < size, CUDA_ERROR_OUT_OF_MEMORY);
    CUresult r = charge(d, charged - prepaid);
    FAIL_IF(r, r);
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
        credit(d, charged - prepaid);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct alloc a = {.base = (uintptr_t)p, .len = len, .size = size, .charged = charged,
                      .d = d, .ctx = c, .kind = K_LINEAR, .pool = pool};
    pthread_mutex_lock(&lk);
    int bad = tab_add(&a);
    if (!bad && pool) {
        pool->used += charged;
        if (pool->used > pool->used_high)
            pool->used_high = pool->used;
    }
    pthread_mutex_unlock(&lk);
    if (bad) {
        munmap(p, len);
        credit(d, charged - prepaid);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

static CUresult linear_alloc(CUdeviceptr *dptr, size_t size, uint64_t charged, struct dev *d,
                             struct ctx *c, struct pool *pool)
{
    return linear_alloc_prepaid(dptr, size, charged, 0, d, c, pool);
}

CUAPI CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    NEED_CTX(c);
    return linear_alloc(dptr, bytesize, bytesize, c->d, c, NULL);
}

CUAPI CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                  size_t Height, unsigned int ElementSizeBytes)
{
    NEED_CTX(c);
    if (!pPitch || WidthInBytes == 0 || Height == 0 ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (WidthInBytes + PITCH_ALIGN - 1) / PITCH_ALIGN * PITCH_ALIGN;
    FAIL_IF(pitch < WidthInBytes || Height > SIZE_MAX / pitch, CUDA_ERROR_OUT_OF_MEMORY);
    size_t bytes = pitch * Height;
    CUresult r = linear_alloc(dptr, bytes, bytes, c->d, c, NULL);
    if (r == CUDA_SUCCESS)
        *pPitch = pitch;
    return r;
}

CUAPI CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    NEED_CTX(c);
    FAIL_IF(flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST, CUDA_ERROR_INVALID_VALUE);
    /* Managed memory migrates to the device on use; the simulated device holds
     * it from the start, so the cap sees it whichever side touches it. */
    return linear_alloc(dptr, bytesize, bytesize, c->d, c, NULL);
}

/* Releases the table row of `base` (of `kind`): `missing` when there is none. */
static CUresult release_base(uintptr_t base, int kind, CUresult missing)
{
    pthread_mutex_lock(&lk);
    long i = tab_find(base, kind);
    if (i >= 0)
        release_row_locked((size_t)i);
    pthread_mutex_unlock(&lk);
    return i < 0 ? missing : CUDA_SUCCESS;
}

static CUresult linear_free(CUdeviceptr dptr)
{
    if (dptr == 0)
        return CUDA_SUCCESS; /* cuMemFree(0) is a no-op in the real driver */
    return release_base((uintptr_t)dptr, K_LINEAR, CUDA_ERROR_INVALID_VALUE);
}

CUAPI CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    NEED_CTX(c);
    return linear_free(dptr);
}

CUAPI CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    NEED_CTX(c);
    pthread_mutex_lock(&lk);
    long i = tab_containing((uintptr_t)dptr);
    if (i < 0 || (uintptr_t)dptr - g.tab[i].base >= g.tab[i].size) {
        pthread_mutex_unlock(&lk);
        return CUDA_ERROR_NOT_FOUND;
    }
    if (pbase)
        *pbase = (CUdeviceptr)g.tab[i].base;
    if (psize)
        *psize = g.tab[i].size;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemGetInfo_v2(size_t *free_, size_t *total)
{
    NEED_CTX(c);
    FAIL_IF(!free_ || !total, CUDA_ERROR_INVALID_VALUE);
    struct dev *d = c->d;
    uint64_t used;
    if (d->mig) {
        pthread_mutex_lock(&lk);
        used = d->local_used;
        pthread_mutex_unlock(&lk);
    } else {
        nvsim_reap(g.st); /* dead processes' memory is free memory */
        used = __atomic_load_n(&g.st->gpus[d->gpu].mem_used, __ATOMIC_RELAXED);
    }
    *total = d->total;
    *free_ = used >= d->total ? 0 : d->total - used;
    return CUDA_SUCCESS;
}

/* Pinned host memory is not device memory: nothing to charge. */
CUAPI CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    NEED_CTX(c);
    (void)Flags;
    FAIL_IF(!pp || bytesize == 0, CUDA_ERROR_INVALID_VALUE);
    void *p = NULL;
    FAIL_IF(posix_memalign(&p, 4096, bytesize), CUDA_ERROR_OUT_OF_MEMORY);
    *pp = p;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    return cuMemHostAlloc(pp, bytesize, 0);
}

CUAPI CUresult cuMemFreeHost(void *p)
{
    NEED_CTX(c);
    free(p);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* streams (declared early: allocation and copies take one)            */

/* The context a stream's work runs in: its creator's, or for the default
 * streams the current one. */
static CUresult stream_ctx(CUstream s, struct ctx **c, struct stream **sp)
{
    CUresult r = need_ctx(c);
    FAIL_IF(r, r);
    *sp = NULL;
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD)
        return CUDA_SUCCESS;
    struct stream *st = (struct stream *)s;
    FAIL_IF(st->magic != MAGIC_STREAM, CUDA_ERROR_INVALID_HANDLE);
    FAIL_IF(!st->ctx->alive, CUDA_ERROR_CONTEXT_IS_DESTROYED);
    *c = st->ctx;
    *sp = st;
    return CUDA_SUCCESS;
}

/* Work that the mock cannot record into a graph refuses to run on a
 * capturing stream instead of silently running outside the capture. */
static CUresult stream_uncapturable(CUstream s, struct ctx **c)
{
    struct stream *sp;
    CUresult r = stream_ctx(s, c, &sp);
    FAIL_IF(r, r);
    FAIL_IF(sp && sp->capture, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    return CUDA_SUCCESS;
}

/* struct ctx *c and struct stream *sp of stream handle h, or return stream_ctx's error;
   UNCAPTURED_: also refused while the stream captures (stream_uncapturable) */
#define STREAM_CTX(h, c, sp)                                                                       \
    struct ctx *c;                                                                                 \
    struct stream *sp;                                                                             \
    do {                                                                                           \
        CUresult r_ = stream_ctx(h, &(c), &(sp));                                                  \
        if (r_)                                                                                    \
            return r_;                                                                             \
    } while (0)
#define UNCAPTURED_STREAM_CTX(h, c, sp)                                                            \
    struct ctx *c;                                                                                 \
    struct stream *sp;                                                                             \
    do {                                                                                           \
        CUresult r_ = stream_uncapturable(h, &(c));                                                \
        if (r_ || (r_ = stream_ctx(h, &(c), &(sp))))                                               \
            return r_;                                                                             \
    } while (0)

CUAPI CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    NEED_CTX(c);
    FAIL_IF(!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING), CUDA_ERROR_INVALID_VALUE);
    struct stream *s = calloc(1, sizeof(*s));
    FAIL_IF(!s, CUDA_ERROR_OUT_OF_MEMORY);
    *s = (struct stream){.magic = MAGIC_STREAM, .ctx = c, .flags = flags, .priority = priority};
    *phStream = (CUstream)s;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
    return cuStreamCreateWithPriority(phStream, Flags, 0);
}

static void graph_free(struct graph *gr);

CUAPI CUresult cuStreamDestroy_v2(CUstream hStream)
{
    NEED_INIT();
    struct stream *s = (struct stream *)hStream;
    if (!s || s == (struct stream *)CU_STREAM_LEGACY || s == (struct stream *)CU_STREAM_PER_THREAD ||
        s->magic != MAGIC_STREAM)
        return CUDA_ERROR_INVALID_HANDLE;
    if (s->capture)
        graph_free(s->capture);
    s->magic = MAGIC_DEAD;
    free(s);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx)
{
    STREAM_CTX(hStream, c, sp);
    FAIL_IF(!pctx, CUDA_ERROR_INVALID_VALUE);
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuStreamSynchronize(CUstream hStream)
{
    UNCAPTURED_STREAM_CTX(hStream, c, sp);
    sleep_until(__atomic_load_n(tail_of(c, sp), __ATOMIC_RELAXED));
    return CUDA_SUCCESS;
}

CUAPI CUresult cuStreamQuery(CUstream hStream)
{
    UNCAPTURED_STREAM_CTX(hStream, c, sp);
    return __atomic_load_n(tail_of(c, sp), __ATOMIC_RELAXED) > nvsim_now_ns() ? CUDA_ERROR_NOT_READY
                                                                             : CUDA_SUCCESS;
}

CUAPI CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
    STREAM_CTX(hStream, c, sp);
    (void)Flags;
    struct event *e = (struct event *)hEvent;
    FAIL_IF(!e || e->magic != MAGIC_EVENT, CUDA_ERROR_INVALID_HANDLE);
    /* later work on the stream starts after the event's work */
    if (e->recorded)
        atomic_max(tail_of(c, sp), e->t_ns);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* stream-ordered allocation and pools                                 */

static CUresult pool_alloc(CUdeviceptr *dptr, size_t bytesize, struct pool *p, CUstream hStream)
{
    struct ctx *c;
    CUresult r = stream_uncapturable(hStream, &c);
    FAIL_IF(r, r);
    FAIL_IF(!p || p->magic != MAGIC_POOL, CUDA_ERROR_INVALID_VALUE);
    /* the allocation belongs to the pool's device, whichever context asked;
     * what the pool kept from earlier frees serves it first */
    pthread_mutex_lock(&lk);
    uint64_t reuse = p->idle < bytesize ? p->idle : bytesize;
    p->idle -= reuse;
    pthread_mutex_unlock(&lk);
    r = linear_alloc_prepaid(dptr, bytesize, bytesize, reuse, p->d, c, p);
    if (r) {
        pthread_mutex_lock(&lk);
        p->idle += reuse;
        pthread_mutex_unlock(&lk);
    }
    return r;
}

CUAPI CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    STREAM_CTX(hStream, c, sp);
    return pool_alloc(dptr, bytesize, c->d->cur_pool, hStream);
}

CUAPI CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                       CUstream hStream)
{
    return pool_alloc(dptr, bytesize, (struct pool *)pool, hStream);
}

CUAPI CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    struct ctx *c;
    CUresult r = stream_uncapturable(hStream, &c);
    FAIL_IF(r, r);
    FAIL_IF(dptr == 0, CUDA_ERROR_INVALID_VALUE);
    return linear_free(dptr);
}

CUAPI CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    NEED_INIT();
    if (!pool || !poolProps || poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    struct dev *d;
    FAIL_IF(get_dev(poolProps->location.id, &d), CUDA_ERROR_INVALID_VALUE);
    struct pool *p = calloc(1, sizeof(*p));
    FAIL_IF(!p, CUDA_ERROR_OUT_OF_MEMORY);
    *p = (struct pool){.magic = MAGIC_POOL, .d = d};
    *pool = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    NEED_INIT();
    struct pool *p = (struct pool *)pool;
    FAIL_IF(!p || p->magic != MAGIC_POOL || p == &p->d->default_pool, CUDA_ERROR_INVALID_VALUE);
    pthread_mutex_lock(&lk);
    /* outstanding allocations stay valid until freed; they just forget the pool */
    for (size_t i = 0; i < g.ntab; i++)
        if (g.tab[i].pool == p)
            g.tab[i].pool = NULL;
    if (p->d->cur_pool == p)
        p->d->cur_pool = &p->d->default_pool;
    credit_locked(p->d, p->idle); /* what it kept goes back with it */
    p->idle = 0;
    p->magic = MAGIC_DEAD;
    pthread_mutex_unlock(&lk);
    free(p);
    return CUDA_SUCCESS;
}

/* The kept memory beyond minBytesToKeep (of the pool's whole) goes back. */
CUAPI CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    NEED_INIT();
    struct pool *p = (struct pool *)pool;
    FAIL_IF(!p || p->magic != MAGIC_POOL, CUDA_ERROR_INVALID_VALUE);
    pthread_mutex_lock(&lk);
    uint64_t held = p->used + p->idle;
    uint64_t give = held > minBytesToKeep ? held - minBytesToKeep : 0;
    if (give > p->idle)
        give = p->idle;
    p->idle -= give;
    credit_locked(p->d, give);
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

/* cuMemPoolSetAttribute (set) and cuMemPoolGetAttribute: one table of what each
   attribute reads and writes */
static CUresult pool_attribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value, int set)
{
    NEED_INIT();
    struct pool *p = (struct pool *)pool;
    FAIL_IF(!p || p->magic != MAGIC_POOL || !value, CUDA_ERROR_INVALID_VALUE);
    int *flag = value;
    cuuint64_t *bytes = value;
    pthread_mutex_lock(&lk);
    CUresult r = CUDA_SUCCESS;
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        if (set)
            p->reuse[attr - 1] = *flag;
        else
            *flag = p->reuse[attr - 1];
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        if (set)
            p->release_threshold = *bytes;
        else
            *bytes = p->release_threshold;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
        if (set)
            r = CUDA_ERROR_INVALID_VALUE; /* read-only */
        else
            *bytes = p->used + (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT ? p->idle : 0);
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        if (!set)
            *bytes = p->used_high;
        else if (*bytes != 0)
            r = CUDA_ERROR_INVALID_VALUE; /* only resettable to zero */
        else
            p->used_high = p->used;
        break;
    default:
        r = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&lk);
    return r;
}

CUAPI CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    return pool_attribute(pool, attr, value, 1);
}

CUAPI CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    return pool_attribute(pool, attr, value, 0);
}

CUAPI CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    DEV_QUERY(dev, d, pool_out);
    *pool_out = (CUmemoryPool)&d->default_pool;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    DEV_QUERY(dev, d, pool);
    pthread_mutex_lock(&lk);
    *pool = (CUmemoryPool)d->cur_pool;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    struct dev *d;
    GET_DEV(dev, d);
    struct pool *p = (struct pool *)pool;
    FAIL_IF(!p || p->magic != MAGIC_POOL || p->d != d, CUDA_ERROR_INVALID_VALUE);
    pthread_mutex_lock(&lk);
    d->cur_pool = p;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* arrays                                                              */

/* Bytes per element of one channel-set, and how many channels the format
 * itself implies (0: take NumChannels). */
static int format_bytes(CUarray_format f, unsigned *bytes, unsigned *fixed_channels)
{
    *fixed_channels = 0;
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: *bytes = 1; return 0;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: *bytes = 2; return 0;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: *bytes = 4; return 0;
    case CU_AD_FORMAT_UNORM_INT8X1 ... CU_AD_FORMAT_SNORM_INT16X4: {
        /* 0xc0-0xc5 UNORM, 0xc6-0xcb SNORM: each INT8X1, X2, X4, then INT16X1, X2, X4 */
        unsigned k = (unsigned)(f - CU_AD_FORMAT_UNORM_INT8X1) % 6;
        *bytes = k < 3 ? 1 : 2;
        *fixed_channels = 1u << (k % 3);
        return 0;
    }
    default: return -1;
    }
}

static int mul_ok(uint64_t *acc, uint64_t x)
{
    if (x && *acc > UINT64_MAX / x)
        return 0;
    *acc *= x;
    return 1;
}

/* Size of one array (level), or 0 when the description is invalid. NV12 is
 * a luma plane plus a half-height interleaved chroma plane. */
static uint64_t array_bytes(size_t w, size_t h, size_t depth, CUarray_format f, unsigned ch)
{
    if (w == 0)
        return 0;
    if (f == CU_AD_FORMAT_NV12) {
        if (h == 0 || depth > 1)
            return 0;
        uint64_t b = w;
        if (!mul_ok(&b, h))
            return 0;
        return b + b / 2;
    }
    unsigned es, fixed;
    if (format_bytes(f, &es, &fixed))
        return 0;
    if (fixed)
        ch = fixed;
    else if (ch != 1 && ch != 2 && ch != 4)
        return 0;
    uint64_t b = w;
    if (!mul_ok(&b, h ? h : 1) || !mul_ok(&b, depth ? depth : 1) || !mul_ok(&b, (uint64_t)es * ch))
        return 0;
    return b;
}

static CUresult array_create(void **out, uint64_t bytes)
{
    NEED_CTX(c);
    FAIL_IF(!out, CUDA_ERROR_INVALID_VALUE);
    FAIL_IF(bytes == 0, CUDA_ERROR_INVALID_VALUE);
    struct array *a = malloc(sizeof(*a));
    FAIL_IF(!a, CUDA_ERROR_OUT_OF_MEMORY);
    a->magic = MAGIC_ARRAY;
    CUresult r = charge(c->d, bytes);
    if (r) {
        free(a);
        return r;
    }
    struct alloc row = {.base = (uintptr_t)a, .len = 1, .size = bytes, .charged = bytes,
                        .d = c->d, .ctx = c, .kind = K_ARRAY};
    pthread_mutex_lock(&lk);
    int bad = tab_add(&row);
    pthread_mutex_unlock(&lk);
    if (bad) {
        credit(c->d, bytes);
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = a;
    return CUDA_SUCCESS;
}

static CUresult array_destroy(void *h)
{
    NEED_INIT();
    FAIL_IF(!h, CUDA_ERROR_INVALID_HANDLE);
    return release_base((uintptr_t)h, K_ARRAY, CUDA_ERROR_INVALID_HANDLE);
}

CUAPI CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    FAIL_IF(!d, CUDA_ERROR_INVALID_VALUE);
    uint64_t bytes = array_bytes(d->Width, d->Height, 0, d->Format, d->NumChannels);
    return array_create((void **)pHandle, bytes);
}

CUAPI CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    FAIL_IF(!d, CUDA_ERROR_INVALID_VALUE);
    if ((d->Flags & CUDA_ARRAY3D_CUBEMAP) &&
        (d->Depth == 0 || d->Depth % 6 || (!(d->Flags & CUDA_ARRAY3D_LAYERED) && d->Depth != 6)))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes = array_bytes(d->Width, d->Height, d->Depth, d->Format, d->NumChannels);
    return array_create((void **)pHandle, bytes);
}

CUAPI CUresult cuArrayDestroy(CUarray hArray)
{
    return array_destroy(hArray);
}

/* Level l halves each spatial extent (at least 1); layers and cube faces are
 * not spatial and stay. A 1D or 2D array keeps its absent extents absent. */
CUAPI CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                      unsigned int numMipmapLevels)
{
    FAIL_IF(!d || numMipmapLevels == 0, CUDA_ERROR_INVALID_VALUE);
    int layered = (d->Flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP)) != 0;
    size_t maxext = d->Width;
    if (d->Height > maxext)
        maxext = d->Height;
    if (!layered && d->Depth > maxext)
        maxext = d->Depth;
    unsigned maxlevels = 0;
    for (size_t e = maxext; e; e >>= 1)
        maxlevels++;
    FAIL_IF(numMipmapLevels > maxlevels, CUDA_ERROR_INVALID_VALUE);
    uint64_t total = 0;
    for (unsigned l = 0; l < numMipmapLevels; l++) {
        size_t w = d->Width >> l ? d->Width >> l : 1;
        size_t h = d->Height ? (d->Height >> l ? d->Height >> l : 1) : 0;
        size_t dep = d->Depth;
        if (d->Depth && !layered)
            dep = d->Depth >> l ? d->Depth >> l : 1;
        uint64_t b = array_bytes(w, h, dep, d->Format, d->NumChannels);
        FAIL_IF(b == 0 || total + b < total, CUDA_ERROR_INVALID_VALUE);
        total += b;
    }
    return array_create((void **)pHandle, total);
}

CUAPI CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    return array_destroy(hMipmappedArray);
}

/* ------------------------------------------------------------------ */
/* virtual memory management                                           */

static struct vmm *vmm_get(CUmemGenericAllocationHandle h)
{
    struct vmm *v = (struct vmm *)(uintptr_t)h;
    return v && v->magic == MAGIC_VMM ? v : NULL;
}

CUAPI CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                             CUmemAllocationGranularity_flags option)
{
    NEED_INIT();
    (void)option;
    FAIL_IF(!granularity || !prop, CUDA_ERROR_INVALID_VALUE);
    *granularity = VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                           const CUmemAllocationProp *prop, unsigned long long flags)
{
    NEED_INIT();
    if (!handle || !prop || flags || size == 0 || size % VMM_GRANULARITY ||
        prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    struct dev *d = NULL;
    switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        FAIL_IF(get_dev(prop->location.id, &d), CUDA_ERROR_INVALID_DEVICE);
        break;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        break; /* host memory: not charged */
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct vmm *v = calloc(1, sizeof(*v));
    FAIL_IF(!v, CUDA_ERROR_OUT_OF_MEMORY);
    /* a memfd lets one handle back any number of mappings, at any offset */
    v->fd = memfd_create("nvsim-vmm", MFD_CLOEXEC);
    if (v->fd < 0 || ftruncate(v->fd, (off_t)size) != 0) {
        if (v->fd >= 0)
            close(v->fd);
        free(v);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (d) {
        CUresult r = charge(d, size);
        if (r) {
            close(v->fd);
            free(v);
            return r;
        }
        v->charged = size;
    }
    v->magic = MAGIC_VMM;
    v->refs = 1;
    v->size = size;
    v->d = d;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    NEED_INIT();
    pthread_mutex_lock(&lk);
    struct vmm *v = vmm_get(handle);
    if (!v || v->refs == 0) {
        pthread_mutex_unlock(&lk);
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* the memory lives until the last reference is released and the last
     * mapping unmapped, as on a real GPU */
    if (--v->refs == 0 && v->maps == 0)
        vmm_destroy_locked(v);
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

/* The handle a mapping at addr was made from, with one more reference (each
 * needs its own cuMemRelease). */
CUAPI CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    NEED_INIT();
    FAIL_IF(!handle, CUDA_ERROR_INVALID_VALUE);
    pthread_mutex_lock(&lk);
    long i = tab_containing((uintptr_t)addr);
    if (i < 0 || g.tab[i].kind != K_VMM_MAP) {
        pthread_mutex_unlock(&lk);
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct vmm *v = g.tab[i].h;
    v->refs++;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                   CUdeviceptr addr, unsigned long long flags)
{
    NEED_INIT();
    (void)flags;
    if (!ptr || size == 0 || size % VMM_GRANULARITY ||
        (alignment && (alignment & (alignment - 1))))
        return CUDA_ERROR_INVALID_VALUE;
    size_t align = alignment > VMM_GRANULARITY ? alignment : VMM_GRANULARITY;
    /* over-reserve, then trim to an aligned window */
    size_t span = size + align;
    char *p = mmap((void *)(uintptr_t)addr, span, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    FAIL_IF(p == MAP_FAILED, CUDA_ERROR_OUT_OF_MEMORY);
    uintptr_t start = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
    if (start > (uintptr_t)p)
        munmap(p, start - (uintptr_t)p);
    uintptr_t end = start + size, pend = (uintptr_t)p + span;
    if (pend > end)
        munmap((void *)end, pend - end);
    struct alloc a = {.base = start, .len = size, .size = size, .kind = K_VMM_RESERVE};
    pthread_mutex_lock(&lk);
    int bad = tab_add(&a);
    pthread_mutex_unlock(&lk);
    if (bad) {
        munmap((void *)start, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = (CUdeviceptr)start;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    NEED_INIT();
    pthread_mutex_lock(&lk);
    long i = tab_find((uintptr_t)ptr, K_VMM_RESERVE);
    if (i < 0 || g.tab[i].len != size) {
        pthread_mutex_unlock(&lk);
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* mappings left inside go too (the real driver requires unmapping first,
     * but leaving them would leak the handles' charges) */
    uintptr_t lo = (uintptr_t)ptr, hi = lo + size;
    for (size_t k = 0; k < g.ntab;) {
        if (g.tab[k].kind == K_VMM_MAP && g.tab[k].base >= lo && g.tab[k].base < hi)
            release_row_locked(k);
        else
            k++;
    }
    i = tab_find((uintptr_t)ptr, K_VMM_RESERVE);
    release_row_locked((size_t)i);
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

/* Caller holds lk: is [lo, hi) inside one reservation and free of mappings? */
static CUresult map_range_check(uintptr_t lo, uintptr_t hi)
{
    int inside = 0;
    for (size_t i = 0; i < g.ntab; i++) {
        const struct alloc *a = &g.tab[i];
        if (a->kind == K_VMM_RESERVE && lo >= a->base && hi <= a->base + a->len)
            inside = 1;
        if (a->kind == K_VMM_MAP && lo < a->base + a->len && a->base < hi)
            return CUDA_ERROR_ALREADY_MAPPED;
    }
    return inside ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                        CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    NEED_INIT();
    if (flags || size == 0 || size % VMM_GRANULARITY || offset % VMM_GRANULARITY ||
        ptr % VMM_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lk);
    struct vmm *v = vmm_get(handle);
    CUresult r = CUDA_SUCCESS;
    if (!v || v->refs == 0 || offset > v->size || size > v->size - offset)
        r = CUDA_ERROR_INVALID_VALUE;
    if (!r)
        r = map_range_check((uintptr_t)ptr, (uintptr_t)ptr + size);
    if (r) {
        pthread_mutex_unlock(&lk);
        return r;
    }
    /* mapped but inaccessible until cuMemSetAccess, as on a real GPU */
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, v->fd,
                   (off_t)offset);
    if (p == MAP_FAILED) {
        pthread_mutex_unlock(&lk);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct alloc a = {.base = (uintptr_t)ptr, .len = size, .size = size, .kind = K_VMM_MAP, .h = v};
    if (tab_add(&a)) {
        mmap(p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        pthread_mutex_unlock(&lk);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    v->maps++;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    NEED_INIT();
    uintptr_t lo = (uintptr_t)ptr, hi = lo + size;
    FAIL_IF(size == 0, CUDA_ERROR_INVALID_VALUE);
    pthread_mutex_lock(&lk);
    /* the range must cover whole mappings */
    for (size_t i = 0; i < g.ntab; i++) {
        const struct alloc *a = &g.tab[i];
        if (a->kind == K_VMM_MAP && a->base < hi && lo < a->base + a->len &&
            (a->base < lo || a->base + a->len > hi)) {
            pthread_mutex_unlock(&lk);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    for (size_t i = 0; i < g.ntab;) {
        if (g.tab[i].kind == K_VMM_MAP && g.tab[i].base >= lo && g.tab[i].base < hi)
            release_row_locked(i);
        else
            i++;
    }
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                              size_t count)
{
    NEED_INIT();
    FAIL_IF(!desc || count == 0 || size == 0, CUDA_ERROR_INVALID_VALUE);
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
            continue;
        struct dev *d;
        FAIL_IF(get_dev(desc[i].location.id, &d), CUDA_ERROR_INVALID_DEVICE);
        if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            prot = PROT_READ | PROT_WRITE;
        else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ && prot == PROT_NONE)
            prot = PROT_READ;
    }
    uintptr_t lo = (uintptr_t)ptr, hi = lo + size;
    pthread_mutex_lock(&lk);
    /* every byte of the range must be mapped */
    uintptr_t cur = lo;
    while (cur < hi) {
        long i = tab_containing(cur);
        if (i < 0 || g.tab[i].kind != K_VMM_MAP) {
            pthread_mutex_unlock(&lk);
            return CUDA_ERROR_INVALID_VALUE;
        }
        cur = g.tab[i].base + g.tab[i].len;
    }
    if (mprotect((void *)lo, size, prot) != 0) {
        pthread_mutex_unlock(&lk);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (size_t i = 0; i < g.ntab; i++)
        if (g.tab[i].kind == K_VMM_MAP && g.tab[i].base >= lo && g.tab[i].base < hi)
            g.tab[i].access = prot != PROT_NONE;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* copies and sets                                                     */

static CUresult copy(void *dst, const void *src, size_t n)
{
    if (n)
        memmove(dst, src, n);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
    NEED_CTX(c);
    if ((!srcHost && ByteCount) || !dev_range_ok(dstDevice, ByteCount))
        return CUDA_ERROR_INVALID_VALUE;
    return copy((void *)(uintptr_t)dstDevice, srcHost, ByteCount);
}

CUAPI CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
    NEED_CTX(c);
    if ((!dstHost && ByteCount) || !dev_range_ok(srcDevice, ByteCount))
        return CUDA_ERROR_INVALID_VALUE;
    return copy(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount);
}

CUAPI CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
    NEED_CTX(c);
    if (!dev_range_ok(dstDevice, ByteCount) || !dev_range_ok(srcDevice, ByteCount))
        return CUDA_ERROR_INVALID_VALUE;
    return copy((void *)(uintptr_t)dstDevice, (const void *)(uintptr_t)srcDevice, ByteCount);
}

/* Unified addressing: either side may be host memory, which the mock cannot
 * check; device-side ranges it knows are checked. */
static int uva_ok(CUdeviceptr p, size_t n)
{
    pthread_mutex_lock(&lk);
    long i = tab_containing((uintptr_t)p);
    pthread_mutex_unlock(&lk);
    return p != 0 && (i < 0 || dev_range_ok(p, n));
}

CUAPI CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount)
{
    NEED_CTX(c);
    if (ByteCount && (!uva_ok(dst, ByteCount) || !uva_ok(src, ByteCount)))
        return CUDA_ERROR_INVALID_VALUE;
    return copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, ByteCount);
}

CUAPI CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
    struct ctx *c;
    CUresult r = stream_uncapturable(hStream, &c);
    return r ? r : cuMemcpy(dst, src, ByteCount);
}

CUAPI CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                    CUstream hStream)
{
    struct ctx *c;
    CUresult r = stream_uncapturable(hStream, &c);
    return r ? r : cuMemcpyHtoD_v2(dstDevice, srcHost, ByteCount);
}

CUAPI CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                    CUstream hStream)
{
    struct ctx *c;
    CUresult r = stream_uncapturable(hStream, &c);
    return r ? r : cuMemcpyDtoH_v2(dstHost, srcDevice, ByteCount);
}

CUAPI CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                    size_t ByteCount, CUstream hStream)
{
    struct ctx *c;
    CUresult r = stream_uncapturable(hStream, &c);
    return r ? r : cuMemcpyDtoD_v2(dstDevice, srcDevice, ByteCount);
}

static CUresult memset_n(CUdeviceptr dst, const void *val, unsigned es, size_t n)
{
    NEED_CTX(c);
    FAIL_IF(dst % es || n > SIZE_MAX / es || !dev_range_ok(dst, n * es), CUDA_ERROR_INVALID_VALUE);
    unsigned char *p = (unsigned char *)(uintptr_t)dst;
    if (es == 1) {
        memset(p, *(const unsigned char *)val, n);
        return CUDA_SUCCESS;
    }
    for (size_t i = 0; i < n; i++)
        memcpy(p + i * es, val, es);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
    return memset_n(dstDevice, &uc, 1, N);
}

CUAPI CUresult cuMemsetD16_v2(CUdeviceptr dstDevice, unsigned short us, size_t N)
{
    return memset_n(dstDevice, &us, 2, N);
}

CUAPI CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N)
{
    return memset_n(dstDevice, &ui, 4, N);
}

CUAPI CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream)
{
    struct ctx *c;
    CUresult r = stream_uncapturable(hStream, &c);
    return r ? r : memset_n(dstDevice, &uc, 1, N);
}

CUAPI CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N,
                                CUstream hStream)
{
    struct ctx *c;
    CUresult r = stream_uncapturable(hStream, &c);
    return r ? r : memset_n(dstDevice, &us, 2, N);
}

CUAPI CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream)
{
    struct ctx *c;
    CUresult r = stream_uncapturable(hStream, &c);
    return r ? r : memset_n(dstDevice, &ui, 4, N);
}

/* ------------------------------------------------------------------ */
/* modules and functions                                               */

static CUresult module_new(CUmodule *module)
{
    NEED_CTX(c);
    struct module *m = calloc(1, sizeof(*m));
    FAIL_IF(!m, CUDA_ERROR_OUT_OF_MEMORY);
    *m = (struct module){.magic = MAGIC_MOD, .ctx = c};
    *module = (CUmodule)m;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    FAIL_IF(!module || !image, CUDA_ERROR_INVALID_VALUE);
    return module_new(module);
}

CUAPI CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                  int *options, void **optionValues)
{
    (void)numOptions, (void)options, (void)optionValues;
    return cuModuleLoadData(module, image);
}

CUAPI CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    return cuModuleLoadData(module, fatCubin);
}

CUAPI CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    NEED_INIT();
    FAIL_IF(!module || !fname, CUDA_ERROR_INVALID_VALUE);
    FAIL_IF(access(fname, R_OK) != 0, CUDA_ERROR_FILE_NOT_FOUND);
    return module_new(module);
}

/* Functions stay valid until the process ends: a real driver frees them with
 * their module, but handing out dangling handles buys nothing here. */
CUAPI CUresult cuModuleUnload(CUmodule hmod)
{
    NEED_INIT();
    struct module *m = (struct module *)hmod;
    FAIL_IF(!m || m->magic != MAGIC_MOD, CUDA_ERROR_INVALID_HANDLE);
    m->magic = MAGIC_DEAD;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    NEED_INIT();
    struct module *m = (struct module *)hmod;
    FAIL_IF(!hfunc || !name, CUDA_ERROR_INVALID_VALUE);
    FAIL_IF(!m || m->magic != MAGIC_MOD, CUDA_ERROR_INVALID_HANDLE);
    FAIL_IF(strncmp(name, "missing", 7) == 0, CUDA_ERROR_NOT_FOUND);
    struct func *f = calloc(1, sizeof(*f));
    FAIL_IF(!f, CUDA_ERROR_OUT_OF_MEMORY);
    f->magic = MAGIC_FUNC;
    f->m = m;
    f->kernel = strcmp(name, "vectorAdd") == 0 || strncmp(name, "_Z9vectorAdd", 12) == 0
                    ? KERNEL_VECTORADD
                    : strcmp(name, "spin") == 0 ? KERNEL_SPIN : KERNEL_BUSY;
    snprintf(f->name, sizeof(f->name), "%s", name);
    *hfunc = (CUfunction)f;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* launches                                                            */

/* vectorAdd's parameters, from kernelParams or a packed `extra` buffer
 * (3 pointers then an int, at their natural alignment). */
static CUresult decode_args(const struct func *f, void **params, void **extra, struct kargs *out)
{
    memset(out, 0, sizeof(*out));
    if (f->kernel == KERNEL_SPIN) { /* spin(unsigned us): runs for us microseconds */
        unsigned us = 0;
        if (params && params[0])
            memcpy(&us, params[0], sizeof us);
        out->spin_ns = (uint64_t)us * 1000ull;
        return CUDA_SUCCESS;
    }
    if (f->kernel != KERNEL_VECTORADD)
        return CUDA_SUCCESS;
    if (params) {
        FAIL_IF(!params[0] || !params[1] || !params[2] || !params[3], CUDA_ERROR_INVALID_VALUE);
        memcpy(&out->a, params[0], sizeof(CUdeviceptr));
        memcpy(&out->b, params[1], sizeof(CUdeviceptr));
        memcpy(&out->c, params[2], sizeof(CUdeviceptr));
        memcpy(&out->n, params[3], sizeof(int));
        return CUDA_SUCCESS;
    }
    const char *buf = NULL;
    size_t size = 0;
    for (size_t i = 0; extra && extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
        if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER)
            buf = extra[i + 1];
        else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE)
            size = *(size_t *)extra[i + 1];
        else
            return CUDA_ERROR_INVALID_VALUE;
    }
    FAIL_IF(!buf || size < 3 * sizeof(CUdeviceptr) + sizeof(int), CUDA_ERROR_INVALID_VALUE);
    memcpy(&out->a, buf, sizeof(CUdeviceptr));
    memcpy(&out->b, buf + 8, sizeof(CUdeviceptr));
    memcpy(&out->c, buf + 16, sizeof(CUdeviceptr));
    memcpy(&out->n, buf + 24, sizeof(int));
    return CUDA_SUCCESS;
}

static CUresult check_dims(const struct launch *l)
{
    FAIL_IF(!l->f || l->f->magic != MAGIC_FUNC, CUDA_ERROR_INVALID_HANDLE);
    for (int i = 0; i < 3; i++)
        FAIL_IF(l->grid[i] == 0 || l->block[i] == 0, CUDA_ERROR_INVALID_VALUE);
    if (l->grid[1] > 65535 || l->grid[2] > 65535 || l->block[0] > 1024 || l->block[1] > 1024 ||
        l->block[2] > 64 || (uint64_t)l->block[0] * l->block[1] * l->block[2] > 1024 ||
        l->shmem > 49152)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

/* Occupies the shared device for the kernel time (NVSIM_ASYNC: queues it on
 * the GPU's timeline after the stream's previous work), then does the work. */
static CUresult run(struct ctx *c, struct stream *sp, const struct launch *l)
{
    if (l->f->kernel == KERNEL_VECTORADD) {
        const struct kargs *a = &l->args;
        size_t bytes = a->n > 0 ? (size_t)a->n * sizeof(float) : 0;
        if (!dev_range_ok(a->a, bytes) || !dev_range_ok(a->b, bytes) || !dev_range_ok(a->c, bytes))
            return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    uint64_t kns = l->f->kernel == KERNEL_SPIN ? l->args.spin_ns : g.kernel_ns;
    if (g.async) {
        uint64_t *tail = tail_of(c, sp);
        uint64_t end = nvsim_queue_kernel(g.st, c->d->gpu, kns, __atomic_load_n(tail, __ATOMIC_RELAXED));
        atomic_max(tail, end);
        atomic_max(&c->tail_all_ns, end);
        /* a real GPU's launch queue is finite: the call blocks when it is full */
        if (g.kernel_ns && end > 1024 * g.kernel_ns)
            sleep_until(end - 1024 * g.kernel_ns);
    } else {
        nvsim_run_kernel(g.st, c->d->gpu, kns);
    }
    if (l->f->kernel == KERNEL_VECTORADD) {
        const struct kargs *a = &l->args;
        const float *A = (const float *)(uintptr_t)a->a, *B = (const float *)(uintptr_t)a->b;
        float *C = (float *)(uintptr_t)a->c;
        /* one thread per element along x, as the sample's kernel indexes */
        uint64_t threads = (uint64_t)l->grid[0] * l->block[0];
        uint64_t n = a->n > 0 ? (uint64_t)a->n : 0;
        if (threads < n)
            n = threads;
        for (uint64_t i = 0; i < n; i++)
            C[i] = A[i] + B[i];
    }
    return CUDA_SUCCESS;
}

static CUresult graph_append(struct graph *gr, const struct launch *l, struct gnode **out);

static CUresult launch(const struct launch *l, CUstream hStream)
{
    STREAM_CTX(hStream, c, sp);
    CUresult r = check_dims(l);
    FAIL_IF(r, r);
    if (sp && sp->capture)
        return graph_append(sp->capture, l, NULL);
    return run(c, sp, l);
}

CUAPI CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                              unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                              unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                              void **kernelParams, void **extra)
{
    NEED_INIT();
    struct func *fn = (struct func *)f;
    FAIL_IF(!fn || fn->magic != MAGIC_FUNC, CUDA_ERROR_INVALID_HANDLE);
    struct launch l = {.f = fn, .grid = {gridDimX, gridDimY, gridDimZ},
                       .block = {blockDimX, blockDimY, blockDimZ}, .shmem = sharedMemBytes};
    CUresult r = decode_args(fn, kernelParams, extra, &l.args);
    return r ? r : launch(&l, hStream);
}

CUAPI CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                void **extra)
{
    FAIL_IF(!config, CUDA_ERROR_INVALID_VALUE);
    return cuLaunchKernel(f, config->gridDimX, config->gridDimY, config->gridDimZ,
                          config->blockDimX, config->blockDimY, config->blockDimZ,
                          config->sharedMemBytes, config->hStream, kernelParams, extra);
}

CUAPI CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                         unsigned int gridDimZ, unsigned int blockDimX,
                                         unsigned int blockDimY, unsigned int blockDimZ,
                                         unsigned int sharedMemBytes, CUstream hStream,
                                         void **kernelParams)
{
    NEED_CTX(c);
    /* all blocks must be resident at once */
    uint64_t blocks = (uint64_t)gridDimX * gridDimY * gridDimZ;
    FAIL_IF(blocks > (uint64_t)sm_count(c->d) * 32, CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
    return cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                          sharedMemBytes, hStream, kernelParams, NULL);
}

/* The legacy launches: the function's block shape and shared memory
 * (cuFuncSetBlockShape, cuFuncSetSharedSize), a grid of w x h blocks, no
 * parameters (cuParamSet* are not simulated: kernels that need them fail).
 * They and cuLaunchCooperativeKernelMultiDevice launch through the internal
 * launch(), not the exported cuLaunchKernel: a real driver's entry points do
 * not call each other through interposable symbols, so an interposer must
 * wrap each of them. */
CUAPI CUresult cuFuncSetBlockShape(CUfunction f, int x, int y, int z)
{
    NEED_INIT();
    struct func *fn = (struct func *)f;
    FAIL_IF(!fn || fn->magic != MAGIC_FUNC, CUDA_ERROR_INVALID_HANDLE);
    FAIL_IF(x <= 0 || y <= 0 || z <= 0, CUDA_ERROR_INVALID_VALUE);
    fn->block[0] = (unsigned)x, fn->block[1] = (unsigned)y, fn->block[2] = (unsigned)z;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuFuncSetSharedSize(CUfunction f, unsigned int bytes)
{
    NEED_INIT();
    struct func *fn = (struct func *)f;
    FAIL_IF(!fn || fn->magic != MAGIC_FUNC, CUDA_ERROR_INVALID_HANDLE);
    fn->shmem = bytes;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream hStream)
{
    NEED_INIT();
    struct func *fn = (struct func *)f;
    FAIL_IF(!fn || fn->magic != MAGIC_FUNC, CUDA_ERROR_INVALID_HANDLE);
    FAIL_IF(w <= 0 || h <= 0, CUDA_ERROR_INVALID_VALUE);
    struct launch l = {.f = fn, .grid = {(unsigned)w, (unsigned)h, 1},
                       .block = {fn->block[0] ? fn->block[0] : 1, fn->block[1] ? fn->block[1] : 1,
                                 fn->block[2] ? fn->block[2] : 1},
                       .shmem = fn->shmem};
    CUresult r = decode_args(fn, NULL, NULL, &l.args);
    return r ? r : launch(&l, hStream);
}

CUAPI CUresult cuLaunchGrid(CUfunction f, int w, int h)
{
    return cuLaunchGridAsync(f, w, h, NULL);
}

CUAPI CUresult cuLaunch(CUfunction f)
{
    return cuLaunchGridAsync(f, 1, 1, NULL);
}

/* Each entry on its own stream (and so its stream's device), in order. */
CUAPI CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *list, unsigned int n,
                                                    unsigned int flags)
{
    NEED_INIT();
    (void)flags;
    FAIL_IF(!list || n == 0, CUDA_ERROR_INVALID_VALUE);
    for (unsigned i = 0; i < n; i++)
        FAIL_IF(!list[i].hStream, CUDA_ERROR_INVALID_HANDLE); /* each needs its own stream */
    for (unsigned i = 0; i < n; i++) {
        const CUDA_LAUNCH_PARAMS *p = &list[i];
        struct func *fn = (struct func *)p->function;
        FAIL_IF(!fn || fn->magic != MAGIC_FUNC, CUDA_ERROR_INVALID_HANDLE);
        struct launch l = {.f = fn, .grid = {p->gridDimX, p->gridDimY, p->gridDimZ},
                           .block = {p->blockDimX, p->blockDimY, p->blockDimZ}, .shmem = p->sharedMemBytes};
        CUresult r = decode_args(fn, p->kernelParams, NULL, &l.args);
        if (!r)
            r = launch(&l, p->hStream);
        FAIL_IF(r, r);
    }
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* graph memory nodes                                                  */

/* The node reserves an address range; each graph instantiated from the
 * graph holds the memory (charged to the device) until it is destroyed. All
 * of a graph's allocation nodes are on one device, at most 16 of them. */
CUAPI CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                      const CUgraphNode *dependencies, size_t numDependencies,
                                      CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    NEED_INIT();
    struct graph *gr = (struct graph *)hGraph;
    if (!phGraphNode || !p || !gr || gr->magic != MAGIC_GRAPH || (numDependencies && !dependencies))
        return CUDA_ERROR_INVALID_VALUE;
    FAIL_IF(p->bytesize == 0 || p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE,
            CUDA_ERROR_INVALID_VALUE);
    struct dev *d;
    CUresult r = get_dev(p->poolProps.location.id, &d);
    FAIL_IF(r, CUDA_ERROR_INVALID_DEVICE);
    FAIL_IF(gr->na == 16 || (gr->adev && gr->adev != d), CUDA_ERROR_NOT_SUPPORTED);
    size_t len = page_round(p->bytesize);
    FAIL_IF(len < p->bytesize, CUDA_ERROR_OUT_OF_MEMORY);
    void *va = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    FAIL_IF(va == MAP_FAILED, CUDA_ERROR_OUT_OF_MEMORY);
    struct gnode *nd = calloc(1, sizeof(*nd));
    if (!nd) {
        munmap(va, len);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    nd->magic = MAGIC_NODE;
    gr->anodes[gr->na] = nd;
    gr->abase[gr->na] = (uintptr_t)va;
    gr->alen[gr->na++] = len;
    gr->abytes += len;
    gr->adev = d;
    p->dptr = (CUdeviceptr)(uintptr_t)va;
    *phGraphNode = (CUgraphNode)nd;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* events                                                              */

CUAPI CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    NEED_CTX(c);
    FAIL_IF(!phEvent || (Flags & ~0xfu), CUDA_ERROR_INVALID_VALUE);
    struct event *e = calloc(1, sizeof(*e));
    FAIL_IF(!e, CUDA_ERROR_OUT_OF_MEMORY);
    *e = (struct event){.magic = MAGIC_EVENT, .flags = Flags};
    *phEvent = (CUevent)e;
    return CUDA_SUCCESS;
}

static struct event *event_get(CUevent h)
{
    struct event *e = (struct event *)h;
    return e && e->magic == MAGIC_EVENT ? e : NULL;
}

/* The event completes when the stream reaches it: when everything queued
 * before it on the stream has completed, or now if that is done already
 * (always, for synchronous launches); that moment is its timestamp. */
CUAPI CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
    UNCAPTURED_STREAM_CTX(hStream, c, sp);
    struct event *e = event_get(hEvent);
    FAIL_IF(!e, CUDA_ERROR_INVALID_HANDLE);
    uint64_t now = nvsim_now_ns(), tail = __atomic_load_n(tail_of(c, sp), __ATOMIC_RELAXED);
    e->t_ns = tail > now ? tail : now;
    e->recorded = 1;
    return CUDA_SUCCESS;
}

/* A never-recorded event counts as complete, as in CUDA. */
CUAPI CUresult cuEventQuery(CUevent hEvent)
{
    NEED_INIT();
    struct event *e = event_get(hEvent);
    FAIL_IF(!e, CUDA_ERROR_INVALID_HANDLE);
    return e->recorded && e->t_ns > nvsim_now_ns() ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

CUAPI CUresult cuEventSynchronize(CUevent hEvent)
{
    NEED_INIT();
    struct event *e = event_get(hEvent);
    FAIL_IF(!e, CUDA_ERROR_INVALID_HANDLE);
    if (e->recorded)
        sleep_until(e->t_ns);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
    NEED_INIT();
    struct event *s = event_get(hStart), *e = event_get(hEnd);
    FAIL_IF(!pMilliseconds, CUDA_ERROR_INVALID_VALUE);
    if (!s || !e || !s->recorded || !e->recorded || (s->flags & CU_EVENT_DISABLE_TIMING) ||
        (e->flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = nvsim_now_ns();
    FAIL_IF(s->t_ns > now || e->t_ns > now, CUDA_ERROR_NOT_READY);
    *pMilliseconds = (float)((double)((int64_t)(e->t_ns - s->t_ns)) / 1e6);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuEventDestroy_v2(CUevent hEvent)
{
    NEED_INIT();
    struct event *e = event_get(hEvent);
    FAIL_IF(!e, CUDA_ERROR_INVALID_HANDLE);
    e->magic = MAGIC_DEAD;
    free(e);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* graphs                                                              */

static CUresult graph_append(struct graph *gr, const struct launch *l, struct gnode **out)
{
    if (gr->n == gr->cap) {
        size_t cap = gr->cap ? gr->cap * 2 : 8;
        struct gnode **nn = realloc(gr->nodes, cap * sizeof(*nn));
        FAIL_IF(!nn, CUDA_ERROR_OUT_OF_MEMORY);
        gr->nodes = nn;
        gr->cap = cap;
    }
    struct gnode *node = calloc(1, sizeof(*node));
    FAIL_IF(!node, CUDA_ERROR_OUT_OF_MEMORY);
    node->magic = MAGIC_NODE;
    node->l = *l; /* parameters are copied when the node is made, as in CUDA */
    gr->nodes[gr->n++] = node;
    if (out)
        *out = node;
    return CUDA_SUCCESS;
}

static void graph_free(struct graph *gr)
{
    for (size_t i = 0; i < gr->n; i++) {
        gr->nodes[i]->magic = MAGIC_DEAD;
        free(gr->nodes[i]);
    }
    for (size_t i = 0; i < gr->na; i++) {
        gr->anodes[i]->magic = MAGIC_DEAD;
        free(gr->anodes[i]);
        munmap((void *)gr->abase[i], gr->alen[i]);
    }
    free(gr->nodes);
    gr->magic = MAGIC_DEAD;
    free(gr);
}

static struct graph *graph_new(void)
{
    struct graph *gr = calloc(1, sizeof(*gr));
    if (gr)
        gr->magic = MAGIC_GRAPH;
    return gr;
}

CUAPI CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    NEED_INIT();
    FAIL_IF(!phGraph || flags, CUDA_ERROR_INVALID_VALUE);
    struct graph *gr = graph_new();
    FAIL_IF(!gr, CUDA_ERROR_OUT_OF_MEMORY);
    *phGraph = (CUgraph)gr;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGraphDestroy(CUgraph hGraph)
{
    NEED_INIT();
    struct graph *gr = (struct graph *)hGraph;
    FAIL_IF(!gr || gr->magic != MAGIC_GRAPH, CUDA_ERROR_INVALID_VALUE);
    graph_free(gr);
    return CUDA_SUCCESS;
}

static CUresult add_kernel_node(CUgraphNode *phGraphNode, CUgraph hGraph,
                                const CUgraphNode *dependencies, size_t numDependencies,
                                CUfunction func, const unsigned dims[7], void **kernelParams,
                                void **extra)
{
    NEED_INIT();
    struct graph *gr = (struct graph *)hGraph;
    if (!phGraphNode || !gr || gr->magic != MAGIC_GRAPH || (numDependencies && !dependencies))
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < numDependencies; i++) {
        const struct gnode *dep = (const struct gnode *)dependencies[i];
        FAIL_IF(!dep || dep->magic != MAGIC_NODE, CUDA_ERROR_INVALID_VALUE);
    }
    struct func *fn = (struct func *)func;
    FAIL_IF(!fn || fn->magic != MAGIC_FUNC, CUDA_ERROR_INVALID_VALUE);
    struct launch l = {.f = fn, .grid = {dims[0], dims[1], dims[2]},
                       .block = {dims[3], dims[4], dims[5]}, .shmem = dims[6]};
    CUresult r = check_dims(&l);
    if (!r)
        r = decode_args(fn, kernelParams, extra, &l.args);
    FAIL_IF(r, r);
    return graph_append(gr, &l, (struct gnode **)phGraphNode);
}

CUAPI CUresult cuGraphAddKernelNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph,
                                       const CUgraphNode *dependencies, size_t numDependencies,
                                       const CUDA_KERNEL_NODE_PARAMS *p)
{
    /* v1's fields are its first member; kern and ctx are not simulated */
    return cuGraphAddKernelNode(phGraphNode, hGraph, dependencies, numDependencies,
                                p ? &p->v1 : NULL);
}

CUAPI CUresult cuGraphAddKernelNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                    const CUgraphNode *dependencies, size_t numDependencies,
                                    const CUDA_KERNEL_NODE_PARAMS_v1 *p)
{
    FAIL_IF(!p, CUDA_ERROR_INVALID_VALUE);
    unsigned dims[7] = {p->gridDimX,  p->gridDimY,  p->gridDimZ,     p->blockDimX,
                        p->blockDimY, p->blockDimZ, p->sharedMemBytes};
    return add_kernel_node(phGraphNode, hGraph, dependencies, numDependencies, p->func, dims,
                           p->kernelParams, p->extra);
}

CUAPI CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                           unsigned long long flags)
{
    NEED_INIT();
    (void)flags;
    struct graph *gr = (struct graph *)hGraph;
    FAIL_IF(!phGraphExec || !gr || gr->magic != MAGIC_GRAPH, CUDA_ERROR_INVALID_VALUE);
    /* a destroyed exec's handle value is handed out again (last destroyed
     * first), as real drivers recycle handles */
    pthread_mutex_lock(&lk);
    struct exec *x = exec_free;
    if (x)
        exec_free = (struct exec *)x->l;
    pthread_mutex_unlock(&lk);
    if (!x)
        x = malloc(sizeof(*x));
    FAIL_IF(!x, CUDA_ERROR_OUT_OF_MEMORY);
    memset(x, 0, sizeof(*x));
    x->l = calloc(gr->n ? gr->n : 1, sizeof(*x->l));
    if (!x->l) {
        free(x);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (size_t i = 0; i < gr->n; i++)
        x->l[i] = gr->nodes[i]->l;
    x->n = gr->n;
    if (gr->abytes) {
        CUresult r = charge(gr->adev, gr->abytes);
        if (r) {
            free(x->l);
            free(x);
            return r;
        }
        x->abytes = gr->abytes;
        x->adev = gr->adev;
    }
    x->magic = MAGIC_EXEC;
    *phGraphExec = (CUgraphExec)x;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize)
{
    if (phErrorNode)
        *phErrorNode = NULL;
    if (logBuffer && bufferSize)
        logBuffer[0] = 0;
    return cuGraphInstantiateWithFlags(phGraphExec, hGraph, 0);
}

CUAPI CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    NEED_INIT();
    struct exec *x = (struct exec *)hGraphExec;
    FAIL_IF(!x || x->magic != MAGIC_EXEC, CUDA_ERROR_INVALID_VALUE);
    for (size_t i = 0; i < x->n; i++) {
        CUresult r = launch(&x->l[i], hStream);
        FAIL_IF(r, r);
    }
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    NEED_INIT();
    struct exec *x = (struct exec *)hGraphExec;
    FAIL_IF(!x || x->magic != MAGIC_EXEC, CUDA_ERROR_INVALID_VALUE);
    x->magic = MAGIC_DEAD;
    free(x->l);
    pthread_mutex_lock(&lk);
    credit_locked(x->adev, x->abytes);
    x->l = (struct launch *)exec_free;
    exec_free = x;
    pthread_mutex_unlock(&lk);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
    STREAM_CTX(hStream, c, sp);
    FAIL_IF((unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED, CUDA_ERROR_INVALID_VALUE);
    if (!sp) /* the legacy default stream cannot be captured */
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    FAIL_IF(sp->capture, CUDA_ERROR_ILLEGAL_STATE);
    sp->capture = graph_new();
    return sp->capture ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUAPI CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    STREAM_CTX(hStream, c, sp);
    FAIL_IF(!phGraph, CUDA_ERROR_INVALID_VALUE);
    FAIL_IF(!sp || !sp->capture, CUDA_ERROR_ILLEGAL_STATE);
    *phGraph = (CUgraph)sp->capture;
    sp->capture = NULL;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
    STREAM_CTX(hStream, c, sp);
    FAIL_IF(!captureStatus, CUDA_ERROR_INVALID_VALUE);
    *captureStatus = sp && sp->capture ? CU_STREAM_CAPTURE_STATUS_ACTIVE
                                       : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ */
/* cuGetProcAddress                                                    */

typedef void (*fnptr)(void);

/* generated with the stubs (build.py): the newest form of each base name */
__attribute__((visibility("hidden"))) fnptr nvsim_cuda_proc_lookup(const char *name);

/* base name, first CUDA version it has this form, the function: the
 * versions are cudaTypedefs.h's PFN_<name>_v<version> suffixes. */
static const struct proc {
    const char *name;
    int version;
    fnptr fn;
} procs[] = {
/* nvctk/sim/data/cuda_procs.txt, generated by build.py */
#include "cuda_procs.inc"
};

CUAPI CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                   cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    (void)flags; /* per-thread-stream variants are the same functions here */
    FAIL_IF(!symbol || !pfn, CUDA_ERROR_INVALID_VALUE);
    *pfn = NULL;
    const struct proc *best = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof(procs) / sizeof(procs[0]); i++) {
        if (strcmp(procs[i].name, symbol) != 0)
            continue;
        known = 1;
        if (procs[i].version <= cudaVersion && (!best || procs[i].version > best->version))
            best = &procs[i];
    }
    if (!best && !known) {
        /* every other entry point of the driver API (generated table, build.py):
         * simulated ones or stubs returning CUDA_ERROR_NOT_SUPPORTED */
        fnptr fn = nvsim_cuda_proc_lookup(symbol);
        if (fn) {
            if (symbolStatus)
                *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
            *pfn = (void *)fn;
            return CUDA_SUCCESS;
        }
    }
    if (!best) {
        if (symbolStatus)
            *symbolStatus = known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                                  : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    if (symbolStatus)
        *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
    *pfn = (void *)best->fn;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
