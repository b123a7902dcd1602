/* cuprobe: a CUDA driver-API client for the real-GPU checks (bench/gpu/real_driver.sh).
 * No CUDA toolkit needed: libcuda.so.1 is dlopen'ed, as a CUDA program in a container
 * finds it (the prestart hook mounts it).
 *   cuprobe info            devices, names, cuMemGetInfo of device 0
 *   cuprobe alloc MIB N     allocate MIB MiB up to N times on device 0; prints how many
 *                           succeeded and the total (a libvgpu cap shows as an early stop)
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;

#define LOAD(name) do { *(void **)&name = dlsym(lib, #name); \
    if (!name) { fprintf(stderr, "cuprobe: no %s\n", #name); return 2; } } while (0)

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGetCount)(int *);
static CUresult (*cuDeviceGet)(CUdevice *, int);
static CUresult (*cuDeviceGetName)(char *, int, CUdevice);
static CUresult (*cuDeviceTotalMem_v2)(size_t *, CUdevice);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuMemGetInfo_v2)(size_t *, size_t *);
static CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);

int main(int argc, char **argv)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "cuprobe: %s\n", dlerror()); return 2; }
    LOAD(cuInit); LOAD(cuDeviceGetCount); LOAD(cuDeviceGet); LOAD(cuDeviceGetName);
    LOAD(cuDeviceTotalMem_v2); LOAD(cuDevicePrimaryCtxRetain); LOAD(cuCtxSetCurrent);
    LOAD(cuMemGetInfo_v2); LOAD(cuMemAlloc_v2);
    CUresult r = cuInit(0);
    if (r) { printf("cuInit: error %d\n", r); return 1; }
    int n = 0;
    cuDeviceGetCount(&n);
    printf("devices: %d\n", n);
    for (int i = 0; i < n; i++) {
        CUdevice d; char name[128] = ""; size_t total = 0;
        cuDeviceGet(&d, i);
        cuDeviceGetName(name, sizeof name, d);
        cuDeviceTotalMem_v2(&total, d);
        printf("device %d: %s, total %zu MiB\n", i, name, total >> 20);
    }
    if (n < 1) return 1;
    CUdevice d0; CUcontext ctx;
    cuDeviceGet(&d0, 0);
    if ((r = cuDevicePrimaryCtxRetain(&ctx, d0)) || (r = cuCtxSetCurrent(ctx))) {
        printf("context: error %d\n", r);
        return 1;
    }
    size_t free_b = 0, total_b = 0;
    cuMemGetInfo_v2(&free_b, &total_b);
    printf("cuMemGetInfo: free %zu MiB, total %zu MiB\n", free_b >> 20, total_b >> 20);
    if (argc >= 4 && !strcmp(argv[1], "alloc")) {
        size_t mib = strtoull(argv[2], NULL, 10);
        int times = atoi(argv[3]), ok = 0;
        for (int i = 0; i < times; i++) {
            CUdeviceptr p;
            r = cuMemAlloc_v2(&p, mib << 20);
            if (r) { printf("alloc %d of %zu MiB: error %d\n", i + 1, mib, r); break; }
            ok++;
        }
        printf("allocated: %d x %zu MiB = %zu MiB\n", ok, mib, ok * mib);
    }
    return 0;
}
