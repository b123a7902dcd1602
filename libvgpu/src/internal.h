/* libvgpu's units share this header (everything in it is hidden). See
 * libvgpu/README.md "Units" for what each file holds and its interface. */
#ifndef VGPU_INTERNAL_H
#define VGPU_INTERNAL_H
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
__asm__(".symver pthread_mutex_trylock,pthread_mutex_trylock@GLIBC_2.2.5");
/* the SM limiter's helper thread (sm.c) */
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_attr_setstacksize,pthread_attr_setstacksize@GLIBC_2.2.5");
__asm__(".symver pthread_sigmask,pthread_sigmask@GLIBC_2.2.5");

#define EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

#pragma GCC visibility push(hidden)

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
    X(cuCtxSetCurrent) X(cuCtxPushCurrent) X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent)      \
    X(cuCtxPopCurrent_v2) X(cuCtxCreate) X(cuCtxDestroy) X(cuCtxAttach) X(cuCtxDetach)    \
    X(cuDevicePrimaryCtxRelease) X(cuDevicePrimaryCtxReset) X(cuGreenCtxCreate)           \
    X(cuGreenCtxDestroy) X(cuCtxFromGreenCtx) X(cuGLCtxCreate) X(cuGLCtxCreate_v2)        \
    X(cuVDPAUCtxCreate) X(cuVDPAUCtxCreate_v2)                                            \
    X(cuLaunchKernel_ptsz) X(cuLaunchKernelEx) X(cuLaunchKernelEx_ptsz)                   \
    X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz) X(cuGraphLaunch)       \
    X(cuGraphLaunch_ptsz) X(cuStreamBeginCapture) X(cuStreamBeginCapture_ptsz) X(cuStreamBeginCapture_v2)  \
    X(cuStreamBeginCapture_v2_ptsz) X(cuStreamBeginCaptureToGraph) X(cuStreamBeginCaptureToGraph_ptsz)   \
    X(cuLaunch) X(cuLaunchGrid) X(cuLaunchGridAsync) X(cuLaunchCooperativeKernelMultiDevice)              \
    X(cuFuncSetBlockShape) X(cuFuncSetSharedSize) X(cuGraphAddMemAllocNode) X(cuGraphDestroy)             \
    X(cuGraphInstantiate) X(cuGraphInstantiate_v2) X(cuGraphInstantiateWithFlags) X(cuGraphInstantiateWithParams)
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

/* ---- symbols.c: symbol resolution ---- */
extern void *real_fn[H_N]; /* real entry points, by hook id */
extern void *real_x[X_N];  /* helpers */
#define REAL(n) ((__typeof__(&n))real_fn[H_##n])
#define HELP(n, type) ((type)real_x[X_##n])
extern void *(*vgpu_real_dlsym)(void *, const char *);
void resolve_dlsym(void);
void resolve_cuda_once(void);  /* libcuda's entry points (pthread_once inside) */
void resolve_nvml_once(void);  /* libnvidia-ml's, and its GPUs' UUIDs */
int nvml_ready(void);          /* NVML resolved and initialised */
int nvml_index_of(const char *uuid); /* the container's GPU index of a UUID, -1 unknown */

/* ---- limits.c: the configuration ---- */
extern struct vgpu_config cfg;
extern char cfg_err[8192];
int cfg_status(void);       /* loads it once: 0 ok, -1 malformed (message in cfg_err) */
int state_passthrough(void); /* 1: no limit at all (and nothing malformed) */

/* ---- common ---- */
#define LOCK_WAIT_NS 10000000000ull /* the longest a process waits for a lock */
uint64_t now_ns(void); /* CLOCK_MONOTONIC */
void backoff(uint64_t *sleep_ns);
static inline uint64_t sat_add(uint64_t a, uint64_t b) { return a + b < a ? UINT64_MAX : a + b; }

/* The first cuInit's stages, timed only in the trace build (-DVGPU_TRACE_INIT,
 * build/libvgpu-trace.so, used by bench/vgpu_overhead.py): nothing in the
 * normal one. */
enum { TR_ENTRY, TR_CONFIG, TR_DLOPEN_CUDA, TR_REAL_CUINIT, TR_NVML, TR_DEVICES, TR_CACHE_OPEN,
       TR_LEDGER_CLAIM, TR_SLOT, TR_N };
#ifdef VGPU_TRACE_INIT
extern uint64_t vgpu_trace[TR_N];
#define TRACE(stage) (vgpu_trace[stage] = now_ns())
void vgpu_trace_print(void);
#else
#define TRACE(stage) ((void)0)
#define vgpu_trace_print() ((void)0)
#endif

/* re-entry guard: calls made while this thread is inside a real call pass straight through */
extern __thread int vgpu_nested __attribute__((tls_model("initial-exec")));
#define NESTED(expr) ({ vgpu_nested++; __typeof__(expr) r__ = (expr); vgpu_nested--; r__; })

/* ---- devices.c: this process's devices, attach, the state machine ---- */
enum { ST_UNINIT = 0, ST_PASS = 1, ST_ACTIVE = 2, ST_ERROR = -1 };
/* The state lives in a page the kernel wipes in any forked child
 * (MADV_WIPEONFORK; a static int where the kernel lacks it): a child made by
 * fork(), glibc's or the raw system call, reads ST_UNINIT and takes the slow
 * path, which finds it is not the process that attached (vgpu_forked). */
extern int *vgpu_statep;
#define g_state (*vgpu_statep)
extern int vgpu_wipe_ok; /* the state page is wiped on fork: no pid check needed on fast paths */
int vgpu_fork_check(void); /* 1 (after making it a new, unattached process) in a forked child */
extern int g_launch_fast; /* launches need no gating: tail-call the real one */
int vgpu_enter_slow(int call_cuinit);
static inline int vgpu_enter(void) {
    int st = __atomic_load_n(&g_state, __ATOMIC_ACQUIRE);
    if (LIKELY(st > 0)) return st;
    if (st == ST_ERROR) return st;
    return vgpu_enter_slow(1);
}
#define ENTER_OR(errret)                                       \
    if (UNLIKELY(vgpu_nested)) return errret;                  \
    int st_ = vgpu_enter();                                    \
    if (UNLIKELY(st_ == ST_ERROR)) return CUDA_ERROR_NOT_INITIALIZED; \
    if (st_ != ST_ACTIVE) return errret;

struct ldev {
    CUdevice dev;
    int idx;          /* the container's GPU index (NVML order); -1 unknown */
    int e;            /* its ledger window: idx, or the last one for unknown devices */
    int ce;           /* entry in the accounting file; -1 none */
    uint64_t cap;     /* this process's own memory cap, 0 = none */
    unsigned sm;      /* this process's own SM share, 0 = none */
    int prim;         /* primary context retains */
    uint64_t prim_charge;
    CUcontext prim_ctx; /* the primary context's handle (from a retain) */
    char uuid[64];
};
extern struct ldev ldevs[VGPU_LDEV_MAX];
extern int nldev;
extern int any_sm;
extern int my_slot;
/* A device the driver reports that libvgpu has no entry for (past
 * VGPU_LDEV_MAX): calls that would hold memory on it are refused. */
#define LD_REFUSE ((struct ldev *)(uintptr_t)1)
struct ldev *ldev_of(CUdevice dev);
struct ldev *ldev_for(CUdevice dev);
struct ldev *cur_ldev(void);
/* the launch path's current device, cached per thread (devices.c) */
extern uint64_t vgpu_ctx_gen;
extern __thread uint64_t vgpu_cdev_gen __attribute__((tls_model("initial-exec")));
extern __thread struct ldev *vgpu_cdev __attribute__((tls_model("initial-exec")));
struct ldev *cur_ldev_query(void);
static inline struct ldev *cur_ldev_launch(void) {
    if (LIKELY(vgpu_cdev_gen == __atomic_load_n(&vgpu_ctx_gen, __ATOMIC_ACQUIRE))) return vgpu_cdev;
    return cur_ldev_query();
}
int gpu_index_of(const char *uuid); /* container GPU index: limits file's UUIDs, else NVML */
CUresult refuse_dev(const char *what);
uint64_t adv_cap_of(int li);  /* the container's strictest cap / SM share as last read */
extern unsigned vgpu_adv_sm[VGPU_LDEV_MAX];
static inline unsigned adv_sm_of(int li) { return __atomic_load_n(&vgpu_adv_sm[li], __ATOMIC_RELAXED); }
void adv_sm_set(int li, unsigned pct);
void adv_set(int li, uint64_t cap, unsigned pct);
extern pthread_mutex_t vgpu_init_mu; /* attaching (CUDA or NVML side), primary contexts */
void adv_refresh(void);
uint64_t current_ctx(void);

/* ---- shmfile.c: the accounting file (never mapped) ---- */
extern int cache_fd;
extern struct vgpu_shm *priv_img;
extern pid_t my_pid;
extern uint64_t my_pidns;
int data_lock(void);
void data_unlock(void);
int cache_read(void *buf, size_t len, size_t off);
int cache_write(const void *buf, size_t len, size_t off);
int hdr_valid(const struct vgpu_shm_hdr *h);
void hdr_init(struct vgpu_shm_hdr *h);
#define DEVS_OFF offsetof(struct vgpu_shm, devs)
#define SLOT_OFF(i) (offsetof(struct vgpu_shm, slots) + (size_t)(i) * sizeof(struct vgpu_shm_slot))
uint32_t img_n(const struct vgpu_shm *img);
int cache_load(struct vgpu_shm *img);
int cache_open(const char *path);
void reap(struct vgpu_shm *img, const int *cand, int n);
int shm_dev(struct vgpu_shm *img, const char *uuid, int create);
int shm_attach(int n);        /* takes a slot, publishes this process's limits */
void shm_detach(void);
int slot_debt_publish(int ce, uint64_t v);
void shm_atfork_child(void);
uint64_t proc_start_time(pid_t pid);

/* ---- ledger.c: the lock ledger (GPU memory) ---- */
#define LEDGER_NWIN VGPU_MAX_DEV
int ledger_open(void);
int ledger_claim(void);
void ledger_forked_child(void); /* a forked child holds nothing of its parent's */
void ledger_attached(int on);
int win_of(int idx);
uint64_t cap_of(const struct ldev *ld);
int charge(const struct ldev *ld, uint64_t bytes);
void credit(int w, uint64_t bytes);
int container_used(int w, uint64_t *used);
int ledger_presence(int w, uint64_t epoch);
int ledger_presence_census(int w, uint64_t epoch, unsigned *others);

/* ---- memory.c: allocations ---- */
void pm_drop_ctx(uint64_t ctx);
void pm_put_ctx(int which, uint64_t key, uint64_t size, int e, uint64_t ctx);
struct pm_ent {
    uint64_t key;
    uint64_t size;
    uint64_t ctx;
    int32_t e;
    uint32_t pool; /* stream-ordered: its pool's entry id (0 = none known) */
};
/* MAP_GRAPH: a graph's allocation nodes' bytes per device, MAP_GEXEC: what an
 * instantiated graph was charged for them (keys: gmem_key) */
enum { MAP_PTR, MAP_VMM, MAP_ARRAY, MAP_CTX, MAP_GRAPH, MAP_GEXEC, MAP_N };
void gexec_release(CUgraphExec g); /* an instantiated graph destroyed: its graph allocations credited */
int pm_take(int which, uint64_t key, struct pm_ent *out);
void pm_put(int which, uint64_t key, uint64_t size, int e);

/* ---- sm.c: the SM limiter ---- */
void sm_forget_ctx(CUcontext ctx);
void sm_return_all(void);
void sm_exit_report(void);
void sm_atfork_child(void);

/* ---- the wrappers (exported) ---- */
EXPORT CUresult cuInit(unsigned int flags);
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep);
EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool);
EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev);
EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s);
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s);
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s);
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s);
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem);
EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr);
EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s);
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s);
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags);
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags);
EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
EXPORT CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc);
EXPORT CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc);
EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc, unsigned int levels);
EXPORT CUresult cuArrayDestroy(CUarray arr);
EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr);
EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *params, int n, unsigned int flags, CUdevice dev);
EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags, CUdevice dev);
EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx);
EXPORT CUresult cuCtxSetCurrent(CUcontext c);
EXPORT CUresult cuCtxPushCurrent(CUcontext c);
EXPORT CUresult cuCtxPushCurrent_v2(CUcontext c);
EXPORT CUresult cuCtxPopCurrent(CUcontext *pc);
EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pc);
EXPORT CUresult cuCtxCreate(CUcontext *pc, unsigned flags, CUdevice dev);
EXPORT CUresult cuCtxDestroy(CUcontext c);
EXPORT CUresult cuCtxAttach(CUcontext *pc, unsigned flags);
EXPORT CUresult cuCtxDetach(CUcontext c);
EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev);
EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev);
EXPORT CUresult cuGreenCtxCreate(void **pg, void *desc, CUdevice dev, unsigned flags);
EXPORT CUresult cuGreenCtxDestroy(void *g);
EXPORT CUresult cuCtxFromGreenCtx(CUcontext *pc, void *g);
EXPORT CUresult cuGLCtxCreate(CUcontext *pc, unsigned flags, CUdevice dev);
EXPORT CUresult cuGLCtxCreate_v2(CUcontext *pc, unsigned flags, CUdevice dev);
EXPORT CUresult cuVDPAUCtxCreate(CUcontext *pc, unsigned flags, CUdevice dev, uint32_t vdp, void *gpa);
EXPORT CUresult cuVDPAUCtxCreate_v2(CUcontext *pc, unsigned flags, CUdevice dev, uint32_t vdp, void *gpa);
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);
EXPORT CUresult cuMemGetInfo_v2(size_t *freep, size_t *totalp);
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags);
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags, CUdriverProcAddressQueryResult *status);
EXPORT nvmlReturn_t nvmlInit_v2(void);
EXPORT nvmlReturn_t nvmlInit(void);
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags);
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem);
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem);
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t dev, unsigned *count, void *infos);
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t dev, unsigned *count, void *infos);
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t dev, unsigned *count, void *infos);
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_, CUstream s, void **params, void **extra);
EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_, CUstream s, void **params, void **extra);
EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra);
EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params, void **extra);
EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_, CUstream s, void **params);
EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_, CUstream s, void **params);
EXPORT CUresult cuGraphLaunch(CUgraphExec g, CUstream s);
EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s);
EXPORT CUresult cuStreamBeginCapture(CUstream s);
EXPORT CUresult cuStreamBeginCapture_ptsz(CUstream s);
EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, int mode);
EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream s, int mode);
EXPORT CUresult cuStreamBeginCaptureToGraph(CUstream s, void *g, const void *deps, const void *data, size_t n, int mode);
EXPORT CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream s, void *g, const void *deps, const void *data, size_t n, int mode);
EXPORT CUresult cuGraphExecDestroy(CUgraphExec g);
EXPORT CUresult cuLaunch(CUfunction f);
EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h);
EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s);
EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *list, unsigned n, unsigned flags);
EXPORT CUresult cuFuncSetBlockShape(CUfunction f, int x, int y, int z);
EXPORT CUresult cuFuncSetSharedSize(CUfunction f, unsigned bytes);
EXPORT CUresult cuGraphAddMemAllocNode(void **node, void *graph, const void *deps, size_t n, CUDA_MEM_ALLOC_NODE_PARAMS *p);
EXPORT CUresult cuGraphDestroy(void *graph);
EXPORT CUresult cuGraphInstantiate(CUgraphExec *g, void *graph, void *errnode, char *log, size_t logsize);
EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *g, void *graph, void *errnode, char *log, size_t logsize);
EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *g, void *graph, unsigned long long flags);
EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *g, void *graph, void *params);
EXPORT CUresult cuModuleUnload(CUmodule m);
EXPORT CUresult cuLibraryUnload(void *l);
EXPORT CUresult cuGraphExecUpdate(CUgraphExec g, void *graph, void *node, void *res);
EXPORT CUresult cuGraphExecUpdate_v2(CUgraphExec g, void *graph, void *info);
EXPORT CUresult cuGraphExecKernelNodeSetParams(CUgraphExec g, void *node, const void *p);
EXPORT CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec g, void *node, const void *p);
EXPORT CUresult cuGraphExecNodeSetParams(CUgraphExec g, void *node, void *p);
EXPORT CUresult cuGraphExecChildGraphNodeSetParams(CUgraphExec g, void *node, void *child);
EXPORT CUresult cuGraphNodeSetEnabled(CUgraphExec g, void *node, unsigned on);
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t dev, unsigned *count, void *infos);
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t dev, unsigned *count, void *infos);
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t dev, unsigned *count, void *infos);

#pragma GCC visibility pop
#endif
