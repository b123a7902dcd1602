/* Stress/fault client for libvgpu's tests.
 *   vgpu_stress churn ITER MAXMIB SEED   random cuMemAlloc_v2/cuMemFree_v2 on
 *        device 0 (primary context), ITER steps, sizes 1..MAXMIB MiB; frees all;
 *        prints "churn <ok allocs> <refused>"
 *   vgpu_stress lockdie PATH   takes the accounting file's locks (its data lock,
 *        an OFD write lock on byte 0, and the ledger's flock, see src/shm.h) and
 *        dies by SIGKILL while holding them
 *   vgpu_stress lockhold PATH  takes the ledger's flock (PATH opened read-only,
 *        as any process of the container can), prints "locked", sleeps forever */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "cuda_min.h"

typedef CUresult (*gpa_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "lockdie")) {
        int fd = open(argv[2], O_RDWR);
        if (fd < 0) return 2;
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
        if (fcntl(fd, F_OFD_SETLKW, &fl) != 0 || flock(fd, LOCK_EX) != 0) return 3;
        printf("locked\n");
        fflush(stdout);
        raise(SIGKILL);
        return 4;
    }
    if (argc == 3 && !strcmp(argv[1], "lockhold")) {
        int fd = open(argv[2], O_RDONLY);
        if (fd < 0 || flock(fd, LOCK_EX) != 0) return 2;
        printf("locked\n");
        fflush(stdout);
        for (;;) pause();
    }
    if (argc != 5 || strcmp(argv[1], "churn")) return 64;
    long iters = atol(argv[2]), maxmib = atol(argv[3]);
    srand((unsigned)atol(argv[4]));
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*gp1)(const char *, void **, int, cuuint64_t) = h ? dlsym(h, "cuGetProcAddress") : NULL;
    if (!gp1) return 5;
    CUresult (*init)(unsigned);
    CUresult (*get)(CUdevice *, int);
    CUresult (*retain)(CUcontext *, CUdevice);
    CUresult (*setcur)(CUcontext);
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*mfree)(CUdeviceptr);
    CUresult (*release)(CUdevice);
    if (gp1("cuInit", (void **)&init, 12040, 0) || gp1("cuDeviceGet", (void **)&get, 12040, 0) ||
        gp1("cuDevicePrimaryCtxRelease", (void **)&release, 12040, 0) ||
        gp1("cuDevicePrimaryCtxRetain", (void **)&retain, 12040, 0) ||
        gp1("cuCtxSetCurrent", (void **)&setcur, 12040, 0) || gp1("cuMemAlloc", (void **)&alloc, 12040, 0) ||
        gp1("cuMemFree", (void **)&mfree, 12040, 0))
        return 6;
    CUdevice dev;
    CUcontext ctx;
    if (init(0) || get(&dev, 0)) return 7;
    CUresult rr;
    /* the context's reserve may not fit while the others hold the cap: retry */
    for (int t = 0; (rr = retain(&ctx, dev)) == CUDA_ERROR_OUT_OF_MEMORY && t < 5000; t++) usleep(1000);
    if (rr || setcur(ctx)) return 11;
    CUdeviceptr live[64];
    int n = 0;
    long ok = 0, refused = 0;
    for (long i = 0; i < iters; i++) {
        if (n == 64 || (n && rand() % 2)) {
            int k = rand() % n;
            if (mfree(live[k])) return 8;
            live[k] = live[--n];
        } else {
            size_t sz = ((size_t)(rand() % maxmib) + 1) << 20;
            sz -= (size_t)(rand() % 4096);
            CUresult r = alloc(&live[n], sz);
            if (r == CUDA_SUCCESS) n++, ok++;
            else if (r == CUDA_ERROR_OUT_OF_MEMORY) refused++;
            else return 9;
        }
    }
    while (n) if (mfree(live[--n])) return 10;
    /* hand the context back while alive, as a well-behaved program does: at exit
     * the driver would hold its reserve a moment longer than libvgpu counts it
     * (reclaiming a dead member's memory is the SIGKILL tests' subject) */
    if (release(dev)) return 12;
    printf("churn %ld %ld\n", ok, refused);
    return 0;
}
