/* cuda-vectoradd: the CUDA vectorAdd sample, written against the driver API the
 * way the CUDA runtime reaches it: dlopen("libcuda.so.1"), dlsym only
 * cuGetProcAddress, and every other entry point through cuGetProcAddress with a
 * base name and a CUDA version. An interposer (libvgpu) therefore sees exactly
 * the lookups and calls a real CUDA program makes.
 *
 *   cuda-vectoradd [--device D] [--n N] [--kernels K] [--graph]
 *       C = A + B on N floats (default 50000), launched K times (default 1);
 *       --graph launches through a captured CUDA graph. Prints "Test PASSED"
 *       and exits 0 only when every element checks, else "Test FAILED", exit 1.
 *   cuda-vectoradd --alloc-mib M [--device D]
 *       cuMemAlloc M MiB and report "alloc M MiB: OK" (exit 0) or
 *       "alloc M MiB: FAILED <name> (<CUresult>)" (exit 2).
 *   cuda-vectoradd --info
 *       device count, then per device: index, name, UUID, free and total bytes
 *       from cuMemGetInfo (the device's primary context is created to ask).
 * Exit 3: the driver could not be loaded or initialised.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_types.h"

#define CUDA_VER 12040 /* the runtime version this sample claims to be */

static PFN_cuGetProcAddress_v12000 getproc;

/* Resolves a base name as the runtime does; the sample cannot go on without it. */
static void *sym(const char *name)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = getproc(name, &fn, CUDA_VER, CU_GET_PROC_ADDRESS_DEFAULT, &st);
    if (r != CUDA_SUCCESS || !fn) {
        fprintf(stderr, "cuGetProcAddress(%s, %d) failed: %d (status %d)\n", name, CUDA_VER, r,
                st);
        exit(3);
    }
    return fn;
}

#define DECL(name, ...) static CUresult (*p_##name)(__VA_ARGS__)
DECL(cuInit, unsigned);
DECL(cuGetErrorName, CUresult, const char **);
DECL(cuDeviceGetCount, int *);
DECL(cuDeviceGet, CUdevice *, int);
DECL(cuDeviceGetName, char *, int, CUdevice);
DECL(cuDeviceGetUuid, CUuuid *, CUdevice);
DECL(cuDevicePrimaryCtxRetain, CUcontext *, CUdevice);
DECL(cuDevicePrimaryCtxRelease, CUdevice);
DECL(cuCtxSetCurrent, CUcontext);
DECL(cuCtxSynchronize, void);
DECL(cuMemGetInfo, size_t *, size_t *);
DECL(cuMemAlloc, CUdeviceptr *, size_t);
DECL(cuMemFree, CUdeviceptr);
DECL(cuMemcpyHtoD, CUdeviceptr, const void *, size_t);
DECL(cuMemcpyDtoH, void *, CUdeviceptr, size_t);
DECL(cuModuleLoadData, CUmodule *, const void *);
DECL(cuModuleGetFunction, CUfunction *, CUmodule, const char *);
DECL(cuModuleUnload, CUmodule);
DECL(cuLaunchKernel, CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
     unsigned, CUstream, void **, void **);
DECL(cuStreamCreate, CUstream *, unsigned);
DECL(cuStreamDestroy, CUstream);
DECL(cuStreamSynchronize, CUstream);
DECL(cuStreamBeginCapture, CUstream, CUstreamCaptureMode);
DECL(cuStreamEndCapture, CUstream, CUgraph *);
DECL(cuGraphInstantiate, CUgraphExec *, CUgraph, unsigned long long);
DECL(cuGraphLaunch, CUgraphExec, CUstream);
DECL(cuGraphExecDestroy, CUgraphExec);
DECL(cuGraphDestroy, CUgraph);

#define LOAD(name) p_##name = (__typeof__(p_##name))sym(#name)

static void load_driver(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        fprintf(stderr, "cannot load libcuda.so.1: %s\n", dlerror());
        exit(3);
    }
    PFN_cuGetProcAddress_v11030 gp1 = (PFN_cuGetProcAddress_v11030)dlsym(h, "cuGetProcAddress");
    if (!gp1) {
        fprintf(stderr, "libcuda.so.1 has no cuGetProcAddress\n");
        exit(3);
    }
    /* the runtime upgrades to the newest cuGetProcAddress the driver offers */
    void *fn = NULL;
    if (gp1("cuGetProcAddress", &fn, CUDA_VER, CU_GET_PROC_ADDRESS_DEFAULT) != CUDA_SUCCESS ||
        !fn) {
        fprintf(stderr, "cuGetProcAddress(cuGetProcAddress) failed\n");
        exit(3);
    }
    getproc = (PFN_cuGetProcAddress_v12000)fn;
    LOAD(cuInit);
    LOAD(cuGetErrorName);
    LOAD(cuDeviceGetCount);
    LOAD(cuDeviceGet);
    LOAD(cuDeviceGetName);
    LOAD(cuDeviceGetUuid);
    LOAD(cuDevicePrimaryCtxRetain);
    LOAD(cuDevicePrimaryCtxRelease);
    LOAD(cuCtxSetCurrent);
    LOAD(cuCtxSynchronize);
    LOAD(cuMemGetInfo);
    LOAD(cuMemAlloc);
    LOAD(cuMemFree);
    LOAD(cuMemcpyHtoD);
    LOAD(cuMemcpyDtoH);
    LOAD(cuModuleLoadData);
    LOAD(cuModuleGetFunction);
    LOAD(cuModuleUnload);
    LOAD(cuLaunchKernel);
    LOAD(cuStreamCreate);
    LOAD(cuStreamDestroy);
    LOAD(cuStreamSynchronize);
    LOAD(cuStreamBeginCapture);
    LOAD(cuStreamEndCapture);
    LOAD(cuGraphInstantiate);
    LOAD(cuGraphLaunch);
    LOAD(cuGraphExecDestroy);
    LOAD(cuGraphDestroy);
}

static const char *errname(CUresult r)
{
    const char *s = NULL;
    if (p_cuGetErrorName(r, &s) != CUDA_SUCCESS || !s)
        s = "CUDA_ERROR_UNKNOWN";
    return s;
}

#define CHECK(call)                                                                                \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            fprintf(stderr, "%s failed: %s (%d)\n", #call, errname(r_), r_);                       \
            printf("Test FAILED\n");                                                               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static void init_or_exit(void)
{
    CUresult r = p_cuInit(0);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "cuInit failed: %s (%d)\n", errname(r), r);
        exit(3);
    }
}

static CUcontext use_device(int ordinal)
{
    CUdevice dev;
    CUcontext ctx;
    CHECK(p_cuDeviceGet(&dev, ordinal));
    CHECK(p_cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(p_cuCtxSetCurrent(ctx));
    return ctx;
}

static int info(void)
{
    int n = 0;
    CHECK(p_cuDeviceGetCount(&n));
    printf("devices: %d\n", n);
    for (int i = 0; i < n; i++) {
        char name[256];
        CUuuid u;
        size_t freeb = 0, total = 0;
        CHECK(p_cuDeviceGetName(name, sizeof name, i));
        CHECK(p_cuDeviceGetUuid(&u, i));
        use_device(i);
        CHECK(p_cuMemGetInfo(&freeb, &total));
        const unsigned char *b = (const unsigned char *)u.bytes;
        /* cuDeviceGetUuid (v2 at this version) gives a MIG device's own UUID */
        const char *kind = strstr(name, " MIG ") ? "MIG" : "GPU";
        printf("device %d: %s %s-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
               "%02x%02x%02x%02x%02x%02x free %zu total %zu\n",
               i, name, kind, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
               b[12], b[13], b[14], b[15], freeb, total);
    }
    return 0;
}

static int alloc_only(int device, unsigned long long mib)
{
    use_device(device);
    CUdeviceptr p = 0;
    CUresult r = p_cuMemAlloc(&p, (size_t)(mib << 20));
    if (r != CUDA_SUCCESS) {
        printf("alloc %llu MiB: FAILED %s (%d)\n", mib, errname(r), r);
        return 2;
    }
    printf("alloc %llu MiB: OK\n", mib);
    CHECK(p_cuMemFree(p));
    return 0;
}

static int vector_add(int device, int n, int kernels, int graph)
{
    printf("[Vector addition of %d elements]\n", n);
    CUcontext ctx = use_device(device);
    (void)ctx;
    size_t bytes = (size_t)n * sizeof(float);
    float *a = malloc(bytes), *b = malloc(bytes), *c = malloc(bytes);
    if (!a || !b || !c) {
        fprintf(stderr, "out of host memory\n");
        return 1;
    }
    srand(1);
    for (int i = 0; i < n; i++) {
        a[i] = (float)rand() / (float)RAND_MAX;
        b[i] = (float)rand() / (float)RAND_MAX;
        c[i] = -1.0f;
    }
    CUdeviceptr da, db, dc;
    CHECK(p_cuMemAlloc(&da, bytes));
    CHECK(p_cuMemAlloc(&db, bytes));
    CHECK(p_cuMemAlloc(&dc, bytes));
    CHECK(p_cuMemcpyHtoD(da, a, bytes));
    CHECK(p_cuMemcpyHtoD(db, b, bytes));

    /* the mock takes any image; a real driver would want the sample's fatbin */
    static const char image[] = "// vectorAdd PTX placeholder\n";
    CUmodule mod;
    CUfunction fn;
    CHECK(p_cuModuleLoadData(&mod, image));
    CHECK(p_cuModuleGetFunction(&fn, mod, "vectorAdd"));

    unsigned threads = 256, blocks = ((unsigned)n + threads - 1) / threads;
    void *args[] = {&da, &db, &dc, &n};
    printf("CUDA kernel launch with %u blocks of %u threads\n", blocks, threads);
    if (graph) {
        CUstream s;
        CUgraph gr;
        CUgraphExec ex;
        CHECK(p_cuStreamCreate(&s, 0));
        CHECK(p_cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
        CHECK(p_cuLaunchKernel(fn, blocks, 1, 1, threads, 1, 1, 0, s, args, NULL));
        CHECK(p_cuStreamEndCapture(s, &gr));
        CHECK(p_cuGraphInstantiate(&ex, gr, 0));
        for (int k = 0; k < kernels; k++)
            CHECK(p_cuGraphLaunch(ex, s));
        CHECK(p_cuStreamSynchronize(s));
        CHECK(p_cuGraphExecDestroy(ex));
        CHECK(p_cuGraphDestroy(gr));
        CHECK(p_cuStreamDestroy(s));
    } else {
        for (int k = 0; k < kernels; k++)
            CHECK(p_cuLaunchKernel(fn, blocks, 1, 1, threads, 1, 1, 0, NULL, args, NULL));
    }
    CHECK(p_cuCtxSynchronize());
    CHECK(p_cuMemcpyDtoH(c, dc, bytes));

    int ok = 1;
    for (int i = 0; i < n; i++) {
        float diff = a[i] + b[i] - c[i];
        if (diff > 1e-5f || diff < -1e-5f || diff != diff) {
            fprintf(stderr, "Result verification failed at element %d: %f + %f != %f\n", i,
                    (double)a[i], (double)b[i], (double)c[i]);
            ok = 0;
            break;
        }
    }
    CHECK(p_cuMemFree(da));
    CHECK(p_cuMemFree(db));
    CHECK(p_cuMemFree(dc));
    CHECK(p_cuModuleUnload(mod));
    CHECK(p_cuDevicePrimaryCtxRelease(device));
    free(a);
    free(b);
    free(c);
    printf("%s\n", ok ? "Test PASSED" : "Test FAILED");
    if (ok)
        printf("Done\n");
    return ok ? 0 : 1;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: cuda-vectoradd [--device D] [--n N] [--kernels K] [--graph]\n"
            "       cuda-vectoradd --alloc-mib M [--device D]\n"
            "       cuda-vectoradd --info\n"
            "  default       C = A + B on N floats (50000), K launches (1); prints Test PASSED\n"
            "  --graph       launch through a captured CUDA graph\n"
            "  --alloc-mib M cuMemAlloc M MiB, print OK (exit 0) or FAILED <error> (exit 2)\n"
            "  --info        device count; per device name, UUID, cuMemGetInfo free/total\n");
}

int main(int argc, char **argv)
{
    int device = 0, n = 50000, kernels = 1, graph = 0, do_info = 0;
    long long alloc_mib = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--info")) {
            do_info = 1;
        } else if (!strcmp(a, "--graph")) {
            graph = 1;
        } else if (!strcmp(a, "--device") && has_val) {
            device = atoi(argv[++i]);
        } else if (!strcmp(a, "--n") && has_val) {
            n = atoi(argv[++i]);
        } else if (!strcmp(a, "--kernels") && has_val) {
            kernels = atoi(argv[++i]);
        } else if (!strcmp(a, "--alloc-mib") && has_val) {
            alloc_mib = atoll(argv[++i]);
        } else {
            usage(stderr);
            return 64;
        }
    }
    if (n <= 0 || kernels < 0 || (alloc_mib < 0 && alloc_mib != -1)) {
        usage(stderr);
        return 64;
    }
    load_driver();
    init_or_exit();
    if (do_info)
        return info();
    if (alloc_mib >= 0)
        return alloc_only(device, (unsigned long long)alloc_mib);
    return vector_add(device, n, kernels, graph);
}
