/* A scriptable CUDA driver client for libvgpu's tests. It loads the driver the
 * way a program does (dlopen "libcuda.so.1") and resolves every entry point in
 * one of three ways:
 *   --proc    (default) dlsym only cuGetProcAddress, then cuGetProcAddress_v2
 *             with base names and a CUDA version, as the CUDA runtime does
 *   --dlsym   dlsym(handle, exact name)
 *   --global  dlsym(RTLD_DEFAULT, exact name): the preloaded exports
 * then runs the commands given as arguments, printing one line per command:
 * "<cmd> <CUresult> [values]". See tests/test_vgpu_*.py for the commands. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_min.h"

typedef CUresult (*gpa_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
static gpa_t gpa;
static void *h;
static int mode; /* 0 proc, 1 dlsym, 2 global */

static void *get(const char *base, const char *exact) {
    void *p = NULL;
    if (mode == 0) {
        CUdriverProcAddressQueryResult st = 0;
        if (gpa(base, &p, 12040, 0, &st) != CUDA_SUCCESS) p = NULL;
    } else {
        p = dlsym(mode == 1 ? h : RTLD_DEFAULT, exact);
    }
    if (!p) {
        fprintf(stderr, "vgpu_probe: cannot resolve %s\n", base);
        exit(90);
    }
    return p;
}
#define F(var, base, exact, ...) CUresult (*var)(__VA_ARGS__) = get(base, exact)

static CUdeviceptr ptrs[1 << 16];
static int nptr;
static CUmemGenericAllocationHandle vmms[1024];
static int nvmm;
static void *arrays[1024];
static int narr;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    int i = 1;
    for (; i < argc && argv[i][0] == '-' && argv[i][1] == '-'; i++) {
        if (!strcmp(argv[i], "--dlsym")) mode = 1;
        else if (!strcmp(argv[i], "--global")) mode = 2;
        else if (!strcmp(argv[i], "--proc")) mode = 0;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    h = dlopen("libcuda.so.1", RTLD_NOW | (mode == 2 ? RTLD_GLOBAL : RTLD_LOCAL));
    if (!h) {
        fprintf(stderr, "vgpu_probe: %s\n", dlerror());
        return 91;
    }
    if (mode == 0) {
        CUresult (*gp1)(const char *, void **, int, cuuint64_t) = dlsym(h, "cuGetProcAddress");
        void *fn = NULL;
        if (!gp1 || gp1("cuGetProcAddress", &fn, 12040, 0) != CUDA_SUCCESS || !fn) return 92;
        gpa = (gpa_t)fn;
    }
    F(cuInit_, "cuInit", "cuInit", unsigned);
    F(cuDeviceGet_, "cuDeviceGet", "cuDeviceGet", CUdevice *, int);
    F(cuDeviceGetCount_, "cuDeviceGetCount", "cuDeviceGetCount", int *);
    F(cuDeviceGetUuid_, "cuDeviceGetUuid", "cuDeviceGetUuid", CUuuid *, CUdevice);
    F(retain, "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", CUcontext *, CUdevice);
    F(release, "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", CUdevice);
    F(setcur, "cuCtxSetCurrent", "cuCtxSetCurrent", CUcontext);
    F(ctxcreate, "cuCtxCreate", "cuCtxCreate_v3", CUcontext *, void *, int, unsigned, CUdevice);
    F(ctxdestroy, "cuCtxDestroy", "cuCtxDestroy_v2", CUcontext);
    F(alloc, "cuMemAlloc", "cuMemAlloc_v2", CUdeviceptr *, size_t);
    F(mfree, "cuMemFree", "cuMemFree_v2", CUdeviceptr);
    F(pitchf, "cuMemAllocPitch", "cuMemAllocPitch_v2", CUdeviceptr *, size_t *, size_t, size_t, unsigned);
    F(managed, "cuMemAllocManaged", "cuMemAllocManaged", CUdeviceptr *, size_t, unsigned);
    F(aasync, "cuMemAllocAsync", "cuMemAllocAsync", CUdeviceptr *, size_t, CUstream);
    F(fasync, "cuMemFreeAsync", "cuMemFreeAsync", CUdeviceptr, CUstream);
    F(getpool, "cuDeviceGetDefaultMemPool", "cuDeviceGetDefaultMemPool", CUmemoryPool *, CUdevice);
    F(apool, "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", CUdeviceptr *, size_t, CUmemoryPool, CUstream);
    F(mcreate, "cuMemCreate", "cuMemCreate", CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
      unsigned long long);
    F(mrelease, "cuMemRelease", "cuMemRelease", CUmemGenericAllocationHandle);
    F(acreate, "cuArrayCreate", "cuArrayCreate_v2", CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
    F(a3create, "cuArray3DCreate", "cuArray3DCreate_v2", CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
    F(mmcreate, "cuMipmappedArrayCreate", "cuMipmappedArrayCreate", CUmipmappedArray *,
      const CUDA_ARRAY3D_DESCRIPTOR *, unsigned);
    F(adestroy, "cuArrayDestroy", "cuArrayDestroy", CUarray);
    F(mmdestroy, "cuMipmappedArrayDestroy", "cuMipmappedArrayDestroy", CUmipmappedArray);
    F(meminfo, "cuMemGetInfo", "cuMemGetInfo_v2", size_t *, size_t *);
    F(totalmem, "cuDeviceTotalMem", "cuDeviceTotalMem_v2", size_t *, CUdevice);
    F(modload, "cuModuleLoadData", "cuModuleLoadData", void **, const void *);
    F(getfn, "cuModuleGetFunction", "cuModuleGetFunction", CUfunction *, void *, const char *);
    F(launch, "cuLaunchKernel", "cuLaunchKernel", CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
      unsigned, unsigned, CUstream, void **, void **);

    F(areserve, "cuMemAddressReserve", "cuMemAddressReserve", CUdeviceptr *, size_t, size_t, CUdeviceptr,
      unsigned long long);
    F(afree, "cuMemAddressFree", "cuMemAddressFree", CUdeviceptr, size_t);
    F(mmap_, "cuMemMap", "cuMemMap", CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    F(munmap_, "cuMemUnmap", "cuMemUnmap", CUdeviceptr, size_t);
    F(maccess, "cuMemSetAccess", "cuMemSetAccess", CUdeviceptr, size_t, const void *, size_t);
    F(mretain, "cuMemRetainAllocationHandle", "cuMemRetainAllocationHandle", CUmemGenericAllocationHandle *, void *);
    F(screate, "cuStreamCreate", "cuStreamCreate", CUstream *, unsigned);
    F(pcreate, "cuMemPoolCreate", "cuMemPoolCreate", CUmemoryPool *, const CUmemPoolProps *);
    F(ptrim, "cuMemPoolTrimTo", "cuMemPoolTrimTo", CUmemoryPool, size_t);
    F(pdestroy, "cuMemPoolDestroy", "cuMemPoolDestroy", CUmemoryPool);
    F(psetattr, "cuMemPoolSetAttribute", "cuMemPoolSetAttribute", CUmemoryPool, int, void *);
    F(gcreate, "cuGraphCreate", "cuGraphCreate", void **, unsigned);
    F(gaddk, "cuGraphAddKernelNode", "cuGraphAddKernelNode_v2", void **, void *, void *, size_t, const void *);
    F(ginst, "cuGraphInstantiate", "cuGraphInstantiateWithFlags", CUgraphExec *, void *, unsigned long long);
    F(glaunch, "cuGraphLaunch", "cuGraphLaunch", CUgraphExec, CUstream);
    F(gxdestroy, "cuGraphExecDestroy", "cuGraphExecDestroy", CUgraphExec);
    F(gdestroy, "cuGraphDestroy", "cuGraphDestroy", void *);
    static struct { CUdeviceptr va; size_t len; CUmemGenericAllocationHandle h; } maps[1024];
    static size_t vmm_size[1024];
    int nmaps = 0;
    CUstream strm = NULL;
    CUmemoryPool newpool = NULL;
    CUgraphExec gexec = NULL;
    unsigned gridx = 1;
    void *graph = NULL;

    CUdevice dev = 0;
    CUcontext ctx = NULL;
    CUfunction fn = NULL;
    for (; i < argc; i++) {
        const char *c = argv[i];
        const char *a1 = i + 1 < argc ? argv[i + 1] : "0";
        const char *a2 = i + 2 < argc ? argv[i + 2] : "0";
        const char *a3 = i + 3 < argc ? argv[i + 3] : "0";
        CUresult r = 0;
        if (!strcmp(c, "init")) {
            r = cuInit_(0);
            printf("init %d\n", r);
        } else if (!strcmp(c, "count")) {
            int n = 0;
            r = cuDeviceGetCount_(&n);
            printf("count %d %d\n", r, n);
        } else if (!strcmp(c, "uuids")) {
            int n = 0;
            cuDeviceGetCount_(&n);
            for (int d = 0; d < n; d++) {
                CUdevice dv;
                CUuuid u;
                cuDeviceGet_(&dv, d);
                r = cuDeviceGetUuid_(&u, dv);
                unsigned char *b = (unsigned char *)u.bytes;
                printf("uuid %d %d GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n", r, d,
                       b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
                       b[15]);
            }
        } else if (!strcmp(c, "ctx")) { /* ctx ORDINAL: primary context, made current */
            cuDeviceGet_(&dev, atoi(a1));
            i++;
            r = retain(&ctx, dev);
            if (!r) r = setcur(ctx);
            printf("ctx %d\n", r);
        } else if (!strcmp(c, "release")) {
            r = release(dev);
            printf("release %d\n", r);
        } else if (!strcmp(c, "ctxcreate")) {
            cuDeviceGet_(&dev, atoi(a1));
            i++;
            r = ctxcreate(&ctx, NULL, 0, 0, dev);
            printf("ctxcreate %d\n", r);
        } else if (!strcmp(c, "ctxdestroy")) {
            r = ctxdestroy(ctx);
            printf("ctxdestroy %d\n", r);
        } else if (!strcmp(c, "alloc") || !strcmp(c, "managed") || !strcmp(c, "async") || !strcmp(c, "pool")) {
            size_t n = strtoull(a1, NULL, 0);
            i++;
            CUdeviceptr p = 0;
            if (!strcmp(c, "alloc")) r = alloc(&p, n);
            else if (!strcmp(c, "managed")) r = managed(&p, n, 1);
            else if (!strcmp(c, "async")) r = aasync(&p, n, NULL);
            else {
                CUmemoryPool pool;
                r = getpool(&pool, dev);
                if (!r) r = apool(&p, n, pool, NULL);
            }
            if (!r) ptrs[nptr++] = p;
            printf("%s %d\n", c, r);
        } else if (!strcmp(c, "pitch")) {
            size_t pitch = 0;
            CUdeviceptr p = 0;
            r = pitchf(&p, &pitch, strtoull(a1, NULL, 0), strtoull(a2, NULL, 0), 4);
            i += 2;
            if (!r) ptrs[nptr++] = p;
            printf("pitch %d %zu\n", r, pitch);
        } else if (!strcmp(c, "free") || !strcmp(c, "freeasync")) {
            r = nptr ? (!strcmp(c, "free") ? mfree(ptrs[--nptr]) : fasync(ptrs[--nptr], NULL)) : -1;
            printf("%s %d\n", c, r);
        } else if (!strcmp(c, "freelast") || !strcmp(c, "freeasynclast")) {
            /* frees the last pointer but keeps it: a second call frees it twice */
            r = nptr ? (!strcmp(c, "freelast") ? mfree(ptrs[nptr - 1]) : fasync(ptrs[nptr - 1], NULL)) : -1;
            printf("%s %d\n", c, r);
        } else if (!strcmp(c, "freeasyncbadstream")) {
            /* the driver refuses the free (not a stream): the pointer stays allocated */
            static uint64_t not_a_stream[8];
            r = nptr ? fasync(ptrs[nptr - 1], (CUstream)not_a_stream) : -1;
            printf("%s %d\n", c, r);
        } else if (!strcmp(c, "freeoff")) { /* freeoff OFF: an interior pointer of the last allocation */
            r = nptr ? mfree(ptrs[nptr - 1] + strtoull(a1, NULL, 0)) : -1;
            i++;
            printf("freeoff %d\n", r);
        } else if (!strcmp(c, "freeraw") || !strcmp(c, "freeasyncraw")) { /* freeraw ADDR: any value */
            CUdeviceptr p = (CUdeviceptr)strtoull(a1, NULL, 0);
            i++;
            r = !strcmp(c, "freeraw") ? mfree(p) : fasync(p, NULL);
            printf("%s %d\n", c, r);
        } else if (!strcmp(c, "drop")) { /* forgets the last pointer without freeing it */
            r = nptr ? (nptr--, 0) : -1;
            printf("drop %d\n", r);
        } else if (!strcmp(c, "arraydestroylast")) { /* destroys the last array but keeps it */
            r = narr ? adestroy(arrays[narr - 1]) : -1;
            printf("arraydestroylast %d\n", r);
        } else if (!strcmp(c, "arraydestroyraw")) { /* arraydestroyraw HANDLE: any value */
            r = adestroy((CUarray)(uintptr_t)strtoull(a1, NULL, 0));
            i++;
            printf("arraydestroyraw %d\n", r);
        } else if (!strcmp(c, "vmmreleaselast")) { /* releases the last VMM handle but keeps it */
            r = nvmm ? mrelease(vmms[nvmm - 1]) : -1;
            printf("vmmreleaselast %d\n", r);
        } else if (!strcmp(c, "freeall")) {
            while (nptr) r |= mfree(ptrs[--nptr]);
            while (nvmm) r |= mrelease(vmms[--nvmm]);
            while (narr) r |= adestroy(arrays[--narr]);
            printf("freeall %d\n", r);
        } else if (!strcmp(c, "fill")) { /* fill CHUNK: allocate until refused */
            size_t chunk = strtoull(a1, NULL, 0), total = 0;
            i++;
            CUdeviceptr p;
            while (nptr < (int)(sizeof ptrs / sizeof ptrs[0]) && (r = alloc(&p, chunk)) == 0) {
                ptrs[nptr++] = p;
                total += chunk;
            }
            printf("fill %d %zu\n", r, total);
        } else if (!strcmp(c, "vmm") || !strcmp(c, "vmmhost")) {
            CUmemAllocationProp prop;
            memset(&prop, 0, sizeof prop);
            prop.type = 1; /* PINNED */
            prop.location.type = !strcmp(c, "vmm") ? CU_MEM_LOCATION_TYPE_DEVICE : 2 /* HOST */;
            prop.location.id = !strcmp(c, "vmm") ? dev : 0;
            CUmemGenericAllocationHandle hd = 0;
            r = mcreate(&hd, strtoull(a1, NULL, 0), &prop, 0);
            if (!r) vmm_size[nvmm] = strtoull(a1, NULL, 0);
            i++;
            if (!r) vmms[nvmm++] = hd;
            printf("%s %d\n", c, r);
        } else if (!strcmp(c, "vmmmap")) { /* maps the last handle whole at a new reservation */
            CUdeviceptr va = 0;
            size_t len = nvmm ? vmm_size[nvmm - 1] : 0;
            r = nvmm ? areserve(&va, len, 0, 0, 0) : -1;
            if (!r) r = mmap_(va, len, 0, vmms[nvmm - 1], 0);
            struct { struct { int type, id; } loc; int flags; } acc = {{CU_MEM_LOCATION_TYPE_DEVICE, dev}, 3};
            if (!r) r = maccess(va, len, &acc, 1);
            if (!r) {
                maps[nmaps].va = va;
                maps[nmaps].len = len;
                maps[nmaps++].h = vmms[nvmm - 1];
            }
            printf("vmmmap %d\n", r);
        } else if (!strcmp(c, "vmmunmap") || !strcmp(c, "vmmaddrfree")) {
            /* the last mapping: unmapped and its reservation freed, or (vmmaddrfree) only the
             * reservation freed, the mapping left in it */
            r = -1;
            if (nmaps) {
                nmaps--;
                r = !strcmp(c, "vmmunmap") ? munmap_(maps[nmaps].va, maps[nmaps].len) : 0;
                if (!r) r = afree(maps[nmaps].va, maps[nmaps].len);
            }
            printf("%s %d\n", c, r);
        } else if (!strcmp(c, "vmmretain")) { /* retains the handle of the last mapping */
            CUmemGenericAllocationHandle hd = 0;
            r = nmaps ? mretain(&hd, (void *)(uintptr_t)maps[nmaps - 1].va) : -1;
            if (!r) {
                vmm_size[nvmm] = maps[nmaps - 1].len;
                vmms[nvmm++] = hd;
            }
            printf("vmmretain %d %d\n", r, !r && hd == maps[nmaps - 1].h);
        } else if (!strcmp(c, "stream")) { /* a stream of the current context */
            r = screate(&strm, 0);
            printf("stream %d\n", r);
        } else if (!strcmp(c, "asyncs")) { /* asyncs N: cuMemAllocAsync on that stream */
            CUdeviceptr p = 0;
            r = aasync(&p, strtoull(a1, NULL, 0), strm);
            i++;
            if (!r) ptrs[nptr++] = p;
            printf("asyncs %d\n", r);
        } else if (!strcmp(c, "pooldev")) { /* pooldev ORDINAL N: from that device's default pool */
            CUdevice dv;
            CUmemoryPool pool;
            CUdeviceptr p = 0;
            cuDeviceGet_(&dv, atoi(a1));
            r = getpool(&pool, dv);
            if (!r) r = apool(&p, strtoull(a2, NULL, 0), pool, NULL);
            i += 2;
            if (!r) ptrs[nptr++] = p;
            printf("pooldev %d\n", r);
        } else if (!strcmp(c, "poolnew")) { /* poolnew ORDINAL: a new pool on that device */
            CUmemPoolProps pp;
            memset(&pp, 0, sizeof pp);
            pp.allocType = 1;
            pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            pp.location.id = atoi(a1);
            i++;
            r = pcreate(&newpool, &pp);
            printf("poolnew %d\n", r);
        } else if (!strcmp(c, "poolalloc")) { /* poolalloc N: from the new pool, on the NULL stream */
            CUdeviceptr p = 0;
            r = apool(&p, strtoull(a1, NULL, 0), newpool, NULL);
            i++;
            if (!r) ptrs[nptr++] = p;
            printf("poolalloc %d\n", r);
        } else if (!strcmp(c, "poolthr") || !strcmp(c, "defpoolthr")) {
            /* poolthr N / defpoolthr N: the release threshold of the new pool / the current device's default */
            CUmemoryPool pool = newpool;
            unsigned long long thr = strtoull(a1, NULL, 0);
            i++;
            r = !strcmp(c, "poolthr") ? 0 : getpool(&pool, dev);
            if (!r) r = psetattr(pool, 4 /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */, &thr);
            printf("%s %d\n", c, r);
        } else if (!strcmp(c, "grid")) { /* grid X: later launches use grid (X, 1, 1) */
            gridx = (unsigned)strtoul(a1, NULL, 0);
            i++;
            printf("grid 0\n");
        } else if (!strcmp(c, "pooltrim")) {
            r = ptrim(newpool, 0);
            printf("pooltrim %d\n", r);
        } else if (!strcmp(c, "pooldestroy")) {
            r = pdestroy(newpool);
            printf("pooldestroy %d\n", r);
        } else if (!strcmp(c, "graph") || !strcmp(c, "regraph")) {
            /* graph N: an exec of N kernel nodes; regraph N: the graph is built first, then the
             * old exec destroyed and the new one instantiated (the driver may reuse its handle) */
            if (!fn) {
                void *mod;
                r = modload(&mod, "fake-image");
                if (!r) r = getfn(&fn, mod, "busy");
            }
            struct {
                CUfunction func;
                unsigned g[3], b[3], shm;
                void **kp, **extra;
                void *kern, *ctx;
            } kp = {fn, {1, 1, 1}, {1, 1, 1}, 0, NULL, NULL, NULL, NULL};
            int n = atoi(a1);
            i++;
            if (!r) r = gcreate(&graph, 0);
            for (int k = 0; k < n && !r; k++) {
                void *node;
                r = gaddk(&node, graph, NULL, 0, &kp);
            }
            if (!r && !strcmp(c, "regraph")) r = gxdestroy(gexec);
            if (!r) r = ginst(&gexec, graph, 0);
            printf("%s %d %p\n", c, r, (void *)gexec);
        } else if (!strcmp(c, "graphlaunchfor")) { /* graphlaunchfor SECONDS */
            double end = now() + atof(a1);
            long n = 0;
            i++;
            while (now() < end && !(r = glaunch(gexec, NULL))) n++;
            printf("graphlaunchfor %d %ld\n", r, n);
        } else if (!strcmp(c, "graphdestroy")) {
            r = gxdestroy(gexec);
            if (!r) r = gdestroy(graph);
            printf("graphdestroy %d\n", r);
        } else if (!strcmp(c, "vmmrelease")) {
            r = nvmm ? mrelease(vmms[--nvmm]) : -1;
            printf("vmmrelease %d\n", r);
        } else if (!strcmp(c, "array")) { /* array W H: float, 1 channel */
            CUDA_ARRAY_DESCRIPTOR d = {strtoull(a1, NULL, 0), strtoull(a2, NULL, 0), CU_AD_FORMAT_FLOAT, 1};
            CUarray arr;
            i += 2;
            r = acreate(&arr, &d);
            if (!r) arrays[narr++] = arr;
            printf("array %d\n", r);
        } else if (!strcmp(c, "array3d")) { /* array3d W H D: uint8, 4 channels */
            CUDA_ARRAY3D_DESCRIPTOR d = {strtoull(a1, NULL, 0), strtoull(a2, NULL, 0), strtoull(a3, NULL, 0),
                                         CU_AD_FORMAT_UNSIGNED_INT8, 4, 0};
            CUarray arr;
            i += 3;
            r = a3create(&arr, &d);
            if (!r) arrays[narr++] = arr;
            printf("array3d %d\n", r);
        } else if (!strcmp(c, "mipmap")) { /* mipmap W H LEVELS: float, 1 channel */
            CUDA_ARRAY3D_DESCRIPTOR d = {strtoull(a1, NULL, 0), strtoull(a2, NULL, 0), 0, CU_AD_FORMAT_FLOAT, 1, 0};
            CUmipmappedArray arr;
            r = mmcreate(&arr, &d, (unsigned)atoi(a3));
            i += 3;
            printf("mipmap %d\n", r);
            if (!r) {
                r = mmdestroy(arr);
                printf("mipmapdestroy %d\n", r);
            }
        } else if (!strcmp(c, "arraydestroy")) {
            r = narr ? adestroy(arrays[--narr]) : -1;
            printf("arraydestroy %d\n", r);
        } else if (!strcmp(c, "forkchild")) { /* a child frees the last pointer, allocates, exits */
            fflush(stdout);
            pid_t pid = fork();
            if (pid == 0) {
                CUdeviceptr q = 0;
                printf("childfree %d\n", nptr ? mfree(ptrs[nptr - 1]) : -1);
                printf("childalloc %d\n", alloc(&q, 1 << 20));
                exit(0); /* runs libvgpu's destructor in the child */
            }
            int status = 0;
            waitpid(pid, &status, 0);
            printf("forkchild %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        } else if (!strcmp(c, "forkrun")) {
            /* forkrun glibc|raw N SECONDS BYTES: N children made by fork() or
             * the raw fork system call (no atfork handlers) each allocate BYTES
             * (if > 0) and launch for SECONDS (if > 0), then hold what they got
             * until this process exits; this process allocates BYTES after all
             * of them did. Prints childalloc/childlaunch per child, then
             * forkrun <parent's alloc result>. */
            int raw = !strcmp(a1, "raw"), n = atoi(a2);
            double secs = atof(a3);
            size_t bytes = (size_t)atoll(i + 4 < argc ? argv[i + 4] : "0");
            i += 4;
            if (!fn && secs > 0) {
                void *mod;
                if (!modload(&mod, "fake-image")) getfn(&fn, mod, "busy");
            }
            int ready[2], hold[2];
            if (pipe(ready) || pipe(hold)) return 91;
            fflush(stdout);
            for (int k = 0; k < n; k++) {
                pid_t pid = raw ? (pid_t)syscall(SYS_fork) : fork();
                if (pid < 0) return 92;
                if (pid) continue;
                close(ready[0]);
                close(hold[1]);
                if (bytes) {
                    CUdeviceptr q = 0;
                    printf("childalloc %d\n", alloc(&q, bytes));
                }
                if (secs > 0) {
                    long m = 0;
                    CUresult lr = 0;
                    double end = now() + secs;
                    while (now() < end && !(lr = launch(fn, gridx, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL))) m++;
                    printf("childlaunch %d %ld\n", lr, m);
                }
                fflush(stdout);
                char b = 1;
                if (write(ready[1], &b, 1) != 1) _exit(93);
                while (read(hold[0], &b, 1) > 0) {
                }
                _exit(0);
            }
            close(ready[1]);
            close(hold[0]);
            char b;
            for (int k = 0; k < n; k++)
                if (read(ready[0], &b, 1) != 1) return 94;
            close(ready[0]);
            r = 0;
            if (bytes) {
                CUdeviceptr q = 0;
                r = alloc(&q, bytes);
                if (!r) ptrs[nptr++] = q;
            }
            printf("forkrun %d\n", r); /* the children hold until this process exits (hold[1] closes) */
        } else if (!strcmp(c, "meminfo")) {
            size_t f = 0, t = 0;
            r = meminfo(&f, &t);
            printf("meminfo %d %zu %zu\n", r, f, t);
        } else if (!strcmp(c, "totalmem")) {
            size_t t = 0;
            CUdevice dv;
            cuDeviceGet_(&dv, atoi(a1));
            i++;
            r = totalmem(&t, dv);
            printf("totalmem %d %zu\n", r, t);
        } else if (!strcmp(c, "launch") || !strcmp(c, "launchfor")) {
            /* launch N: N kernels; launchfor SECONDS: as many as fit */
            if (!fn) {
                void *mod;
                r = modload(&mod, "fake-image");
                if (!r) r = getfn(&fn, mod, "busy");
                if (r) {
                    printf("%s %d\n", c, r);
                    continue;
                }
            }
            long n = 0, max = !strcmp(c, "launch") ? atol(a1) : -1;
            double end = now() + (max < 0 ? atof(a1) : 1e9);
            i++;
            while ((max < 0 || n < max) && (max >= 0 || now() < end)) {
                r = launch(fn, gridx, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
                if (r) break;
                n++;
            }
            printf("%s %d %ld\n", c, r, n);
        } else if (!strcmp(c, "sleep")) {
            usleep((useconds_t)atoi(a1) * 1000);
            i++;
            printf("sleep 0\n");
        } else if (!strcmp(c, "wait")) { /* print "ready", wait for a line on stdin */
            char buf[64];
            printf("ready 0\n");
            if (!fgets(buf, sizeof buf, stdin)) return 0;
        } else if (!strcmp(c, "die")) {
            raise(SIGKILL);
        } else if (!strcmp(c, "nvmlmem")) { /* nvmlmem INDEX [v2] */
            void *nh = dlopen("libnvidia-ml.so.1", RTLD_NOW);
            nvmlReturn_t (*ninit)(void) = nh ? dlsym(nh, "nvmlInit_v2") : NULL;
            nvmlReturn_t (*byidx)(unsigned, nvmlDevice_t *) = nh ? dlsym(nh, "nvmlDeviceGetHandleByIndex_v2") : NULL;
            nvmlReturn_t (*mi)(nvmlDevice_t, nvmlMemory_t *) = nh ? dlsym(nh, "nvmlDeviceGetMemoryInfo") : NULL;
            nvmlReturn_t (*mi2)(nvmlDevice_t, nvmlMemory_v2_t *) = nh ? dlsym(nh, "nvmlDeviceGetMemoryInfo_v2") : NULL;
            if (!ninit || !byidx || !mi || !mi2) {
                printf("nvmlmem -1\n");
                return 93;
            }
            nvmlDevice_t d;
            r = ninit();
            if (!r) r = byidx((unsigned)atoi(a1), &d);
            i++;
            nvmlMemory_t m = {0, 0, 0};
            nvmlMemory_v2_t m2 = {(unsigned)(sizeof m2 | (2u << 24)), 0, 0, 0, 0};
            if (!r) r = mi(d, &m);
            if (!r) r = mi2(d, &m2);
            printf("nvmlmem %d %llu %llu %llu %llu %llu\n", r, m.total, m.used, m.free, m2.total, m2.used);
        } else if (!strcmp(c, "nvmlprocs")) { /* nvmlprocs INDEX: pids via v1, v2, v3 (two-call protocol) */
            void *nh = dlopen("libnvidia-ml.so.1", RTLD_NOW);
            nvmlReturn_t (*ninit)(void) = nh ? dlsym(nh, "nvmlInit_v2") : NULL;
            nvmlReturn_t (*byidx)(unsigned, nvmlDevice_t *) = nh ? dlsym(nh, "nvmlDeviceGetHandleByIndex_v2") : NULL;
            static const char *const names[3] = {"nvmlDeviceGetComputeRunningProcesses",
                                                  "nvmlDeviceGetComputeRunningProcesses_v2",
                                                  "nvmlDeviceGetComputeRunningProcesses_v3"};
            nvmlDevice_t d;
            if (!ninit || !byidx || ninit() || byidx((unsigned)atoi(a1), &d)) {
                printf("nvmlprocs -1\n");
                return 93;
            }
            i++;
            printf("nvmlprocs 0");
            for (int v = 0; v < 3; v++) {
                nvmlReturn_t (*fnp)(nvmlDevice_t, unsigned *, void *) = dlsym(nh, names[v]);
                unsigned n = 0;
                nvmlReturn_t r1 = fnp ? fnp(d, &n, NULL) : -1; /* count query */
                nvmlProcessInfo_t big[64];
                nvmlProcessInfo_v1_t small[64];
                unsigned n2 = 64;
                nvmlReturn_t r2 = fnp ? fnp(d, &n2, v ? (void *)big : (void *)small) : -1;
                printf(" v%d:%d:%u:%d:%u", v + 1, r1, n, r2, n2);
                for (unsigned k = 0; k < n2 && k < 64; k++) printf(":%u", v ? big[k].pid : small[k].pid);
            }
            printf("\n");
        } else {
            fprintf(stderr, "vgpu_probe: unknown command %s\n", c);
            return 94;
        }
    }
    return 0;
}
