/* libvgpu overhead micro-benchmark client (driven by bench/vgpu_overhead.py).
 *   vgpu_overhead launch N   ns per cuLaunchKernel (kernel "busy"; run with NVSIM_KERNEL_US=0)
 *   vgpu_overhead launchnull N  ns per cuLaunchKernel of a NULL function (rejected)
 *   vgpu_overhead launchgap N   ns per cuLaunchKernel, in blocks of 1000 with 0.5 ms idle
 *                            (untimed) between them: under an SM limit the share is not
 *                            binding, so this is the limiter's cost, not its waiting
 *   vgpu_overhead alloc N    ns per cuMemAlloc_v2 + cuMemFree_v2 pair (4 KiB)
 *   vgpu_overhead init       ns from the first CUDA call (dlopen of libcuda.so.1, then
 *                            cuGetProcAddress) to the first cuInit's return, and of that
 *                            cuInit alone
 *   vgpu_overhead launchself OFF N  median over N pairs of blocks of 1000 launches, 0.5 ms
 *                            idle before each pair, of (ns per launch through the entry point
 *                            cuGetProcAddress gives - through the driver's own cuLaunchKernel,
 *                            found at OFF, its offset in libcuda's file): in one process, so
 *                            robust to the machine's load; under an SM limit, all of libvgpu's
 *                            cost (the limiter's, and the entry's)
 *   vgpu_overhead launch2 N  median over N pairs of blocks of 1000 launches, 0.5 ms idle
 *                            before each pair (so the share is not binding), of (ns per
 *                            launch on device 0 - on device 1), in one process: with an SM
 *                            limit on device 0 only, the limiter's own cost, robust to load
 *                            from other work on the machine
 *   vgpu_overhead pattern KIND B GAP_US N [THREADS]
 *                            N pairs of bursts of B launches, each burst after GAP_US of idle
 *                            (0: back to back), one burst on device 0 and one on device 1,
 *                            alternating which goes first; prints the median over the pairs of
 *                            (ns per launch on device 0 - on device 1) and the median ns per
 *                            launch on device 0. KIND: kernel (cuLaunchKernel), ex
 *                            (cuLaunchKernelEx), coop (cuLaunchCooperativeKernel), graph
 *                            (cuGraphLaunch of a 1-node graph), streams (cuLaunchKernel over 4
 *                            streams in turn), clock (cuLaunchKernel, on device 0 each after a
 *                            CLOCK_MONOTONIC_COARSE read: without an interposer, that read's cost); THREADS > 1: that many threads at once on the
 *                            same contexts, each pairing its own bursts (the figures are the
 *                            medians over all threads' pairs)
 *   vgpu_overhead pattern KIND B GAP_US N THREADS OFF
 *                            the same, each pair with a third burst on device 0 through the
 *                            driver's own entry point for KIND (kernel, streams: cuLaunchKernel;
 *                            graph: cuGraphLaunch; found at OFF, its offset in libcuda's file),
 *                            the three in turn; prints also the median of (ns per launch on
 *                            device 0 through the entry point cuGetProcAddress gives - through
 *                            the driver's own): all of an interposer's cost, in one process
 * Entry points come through cuGetProcAddress, as the CUDA runtime gets them. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_min.h"

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

/* Prints the median of v[0..n) (sorted in place: insertion sort, n is small); 0. */
static int print_median(double *v, long n) {
    for (long i = 1; i < n; i++)
        for (long j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double x = v[j];
            v[j] = v[j - 1];
            v[j - 1] = x;
        }
    printf("%.2f\n", v[n / 2]);
    return 0;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- the pattern mode: bursts on two devices (device 0 SM-limited) ---- */
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*coop_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            CUstream, void **);
typedef CUresult (*ex_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*glaunch_fn)(CUgraphExec, CUstream);
static struct {
    const char *kind;
    long b, gap_us, n;
    CUcontext ctx[2];
    CUfunction f[2];
    CUstream st[2][4];
    CUgraphExec gx[2];
    launch_fn launch;
    coop_fn coop;
    ex_fn ex;
    glaunch_fn glaunch;
    CUresult (*setcur)(CUcontext);
    launch_fn own_launch; /* the driver's own entry points (OFF given), else NULL */
    glaunch_fn own_glaunch;
} P;

static volatile unsigned long clock_sink;

/* A burst on device d (2: device 0 through the driver's own entry point). */
static int burst(int d) {
    launch_fn launch = d == 2 ? P.own_launch : P.launch;
    glaunch_fn glaunch = d == 2 ? P.own_glaunch : P.glaunch;
    if (d == 2) d = 0;
    for (long k = 0; k < P.b; k++) {
        CUresult r;
        if (!strcmp(P.kind, "ex")) {
            CUlaunchConfig c = {1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0};
            r = P.ex(&c, P.f[d], NULL, NULL);
        } else if (!strcmp(P.kind, "coop")) {
            r = P.coop(P.f[d], 1, 1, 1, 1, 1, 1, 0, NULL, NULL);
        } else if (!strcmp(P.kind, "graph")) {
            r = glaunch(P.gx[d], NULL);
        } else if (!strcmp(P.kind, "streams")) {
            r = launch(P.f[d], 1, 1, 1, 1, 1, 1, 0, P.st[d][k & 3], NULL, NULL);
        } else {
            if (d == 0 && !strcmp(P.kind, "clock")) { /* what libvgpu's fast path reads */
                struct timespec ts;
                clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
                clock_sink += (unsigned long)ts.tv_nsec;
            }
            r = launch(P.f[d], 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        }
        if (r) return -1;
    }
    return 0;
}

struct pres {
    double *diff, *abs0, *self;
    int rc;
};

static void *pattern_thread(void *arg) {
    struct pres *o = arg;
    o->rc = 0;
    int nb = P.own_launch || P.own_glaunch ? 3 : 2;
    for (int w = 0; w < 3; w++) /* warm the paths and estimates */
        for (int d = 0; d < nb; d++)
            if (P.setcur(P.ctx[d & 1]) || burst(d)) return o->rc = 6, NULL;
    for (long i = 0; i < P.n; i++) {
        double t[3];
        for (int j = 0; j < nb; j++) {
            int d = (int)((i + j) % nb); /* rotate which burst goes first */
            if (P.setcur(P.ctx[d & 1])) return o->rc = 6, NULL;
            if (P.gap_us) {
                struct timespec gap = {P.gap_us / 1000000, (P.gap_us % 1000000) * 1000};
                nanosleep(&gap, NULL);
            }
            double t0 = now_ns();
            if (burst(d)) return o->rc = 6, NULL;
            t[d] = (now_ns() - t0) / (double)P.b;
        }
        o->diff[i] = t[0] - t[1];
        o->abs0[i] = t[0];
        o->self[i] = nb == 3 ? t[0] - t[2] : 0;
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) return 64;
    /* init: from the program's first CUDA call on (an interposer may set up its state when
     * libcuda or cuGetProcAddress is first reached, before cuInit: HAMi-core does) */
    double start = now_ns();
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*gp)(const char *, void **, int, cuuint64_t) = h ? dlsym(h, "cuGetProcAddress") : NULL;
    if (!gp) return 2;
#define GET(var, name) if (gp(name, (void **)&var, 12040, 0)) return 3
    CUresult (*init)(unsigned);
    GET(init, "cuInit");
    if (!strcmp(argv[1], "init")) {
        double t0 = now_ns();
        CUresult r = init(0);
        double t1 = now_ns();
        printf("%.0f %.0f\n", t1 - start, t1 - t0);
        return r;
    }
    long n = argc > 2 ? atol(argv[2]) : 1000000;
    CUresult (*get)(CUdevice *, int), (*retain)(CUcontext *, CUdevice), (*setcur)(CUcontext);
    GET(get, "cuDeviceGet");
    GET(retain, "cuDevicePrimaryCtxRetain");
    GET(setcur, "cuCtxSetCurrent");
    CUdevice dev;
    CUcontext ctx;
    if (init(0) || get(&dev, 0) || retain(&ctx, dev) || setcur(ctx)) return 4;
    /* every launch* mode: cuLaunchKernel and the kernel "busy" in device 0's context */
    typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 unsigned, CUstream, void **, void **);
    CUresult (*load)(void **, const void *) = NULL, (*getfn)(CUfunction *, void *, const char *) = NULL;
    launch_t launch = NULL;
    void *mod;
    CUfunction f = NULL;
    if (!strncmp(argv[1], "launch", 6) || !strcmp(argv[1], "pattern")) {
        GET(load, "cuModuleLoadData");
        GET(getfn, "cuModuleGetFunction");
        GET(launch, "cuLaunchKernel");
        if (load(&mod, "x") || getfn(&f, mod, "busy")) return 5;
    }
    if (!strcmp(argv[1], "launch") || !strcmp(argv[1], "launchnull") || !strcmp(argv[1], "launchgap")) {
        /* launchnull: a NULL function, which the driver rejects at once; the
         * interposer's path is the same, so the difference is its cost alone */
        CUresult want = 0;
        if (!strcmp(argv[1], "launchnull")) f = NULL, want = launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        for (int i = 0; i < 1000; i++) launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        if (!strcmp(argv[1], "launchgap")) {
            double sum = 0;
            for (long i = 0; i < n; i += 1000) {
                struct timespec gap = {0, 500000};
                nanosleep(&gap, NULL);
                double t0 = now_ns();
                for (int k = 0; k < 1000; k++)
                    if (launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != want) return 6;
                sum += now_ns() - t0;
            }
            printf("%.2f\n", sum / ((n + 999) / 1000 * 1000));
            return 0;
        }
        double t0 = now_ns();
        for (long i = 0; i < n; i++)
            if (launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) != want) return 6;
        printf("%.2f\n", (now_ns() - t0) / n);
        return 0;
    }
    if (!strcmp(argv[1], "launchself")) {
        launch_t via = launch, own;
        /* the driver's own entry point: libcuda's load address (its link map: an interposer
         * may wrap dlsym itself, as HAMi-core does) plus the symbol's offset in the file (the
         * caller reads it with nm) */
        struct link_map *lm;
        if (dlinfo(h, RTLD_DI_LINKMAP, &lm) || argc < 4) return 8;
        own = (launch_t)(void *)((char *)lm->l_addr + strtol(argv[2], NULL, 16));
        n = atol(argv[3]);
        for (int i = 0; i < 1000; i++)
            if (via(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) || own(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL))
                return 6;
        double *diff = malloc(sizeof(double) * (size_t)n);
        for (long i = 0; i < n; i++) {
            double t[2];
            struct timespec gap = {0, 500000};
            nanosleep(&gap, NULL);
            for (int j = 0; j < 2; j++) {
                int w = (int)((i + j) % 2); /* alternate which goes first */
                launch_t L = w ? via : own;
                double t0 = now_ns();
                for (int k = 0; k < 1000; k++)
                    if (L(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) return 6;
                t[w] = (now_ns() - t0) / 1000;
            }
            diff[i] = t[1] - t[0];
        }
        return print_median(diff, n);
    }
    if (!strcmp(argv[1], "launch2")) {
        CUdevice d1;
        CUcontext c1;
        void *m1;
        CUfunction f0 = f, f1;
        if (get(&d1, 1) || retain(&c1, d1)) return 4;
        if (setcur(c1) || load(&m1, "x") || getfn(&f1, m1, "busy") || setcur(ctx)) return 5;
        enum { B = 1000 };
        double *diff = malloc(sizeof(double) * (size_t)n);
        for (int w = 0; w < 3; w++)
            for (int k = 0; k < B; k++)
                if (setcur(ctx) || launch(f0, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL) || setcur(c1) ||
                    launch(f1, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL))
                    return 6;
        for (long i = 0; i < n; i++) {
            double t[2];
            struct timespec gap = {0, 500000};
            nanosleep(&gap, NULL);
            for (int j = 0; j < 2; j++) {
                int d = (int)((i + j) % 2); /* alternate which device goes first */
                if (setcur(d ? c1 : ctx)) return 6;
                double t0 = now_ns();
                for (int k = 0; k < B; k++)
                    if (launch(d ? f1 : f0, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)) return 6;
                t[d] = (now_ns() - t0) / B;
            }
            diff[i] = t[0] - t[1];
        }
        return print_median(diff, n);
    }
    if (!strcmp(argv[1], "pattern")) {
        if (argc < 6) return 64;
        P.kind = argv[2], P.b = atol(argv[3]), P.gap_us = atol(argv[4]), P.n = atol(argv[5]);
        int nt = argc > 6 ? atoi(argv[6]) : 1;
        if (nt < 1 || nt > 16 || P.b < 1 || P.n < 1) return 64;
        if (argc > 7) { /* OFF: the kind's function in libcuda's file (kernel, streams, graph) */
            struct link_map *lm;
            if (dlinfo(h, RTLD_DI_LINKMAP, &lm)) return 8;
            void *own = (char *)lm->l_addr + strtol(argv[7], NULL, 16);
            if (!strcmp(P.kind, "graph")) P.own_glaunch = (glaunch_fn)own;
            else if (!strcmp(P.kind, "kernel") || !strcmp(P.kind, "streams")) P.own_launch = (launch_fn)own;
            else return 64;
        }
        CUresult (*screate)(CUstream *, unsigned), (*gcreate)(void **, unsigned),
            (*gadd)(void **, void *, void *, size_t, const void *), (*ginst)(CUgraphExec *, void *, unsigned long long);
        GET(P.coop, "cuLaunchCooperativeKernel");
        GET(P.ex, "cuLaunchKernelEx");
        GET(P.glaunch, "cuGraphLaunch");
        GET(screate, "cuStreamCreate");
        GET(gcreate, "cuGraphCreate");
        GET(gadd, "cuGraphAddKernelNode");
        GET(ginst, "cuGraphInstantiate");
        P.launch = launch, P.setcur = setcur;
        CUdevice d1;
        if (get(&d1, 1) || retain(&P.ctx[1], d1)) return 4;
        P.ctx[0] = ctx, P.f[0] = f;
        for (int d = 0; d < 2; d++) {
            void *m, *g, *node;
            if (setcur(P.ctx[d])) return 5;
            if (d && (load(&m, "x") || getfn(&P.f[1], m, "busy"))) return 5;
            for (int k = 0; k < 4; k++)
                if (screate(&P.st[d][k], 0)) return 5;
            CUDA_KERNEL_NODE_PARAMS kp = {.v1 = {.func = P.f[d], .gridDimX = 1, .gridDimY = 1,
                                                 .gridDimZ = 1, .blockDimX = 1, .blockDimY = 1,
                                                 .blockDimZ = 1}};
            if (gcreate(&g, 0) || gadd(&node, g, NULL, 0, &kp) || ginst(&P.gx[d], g, 0)) return 5;
        }
        pthread_t th[16];
        struct pres o[16];
        for (int t = 0; t < nt; t++) {
            o[t].diff = malloc(sizeof(double) * (size_t)P.n);
            o[t].abs0 = malloc(sizeof(double) * (size_t)P.n);
            o[t].self = malloc(sizeof(double) * (size_t)P.n);
            if (pthread_create(&th[t], NULL, pattern_thread, &o[t])) return 9;
        }
        size_t m = (size_t)(P.n * nt);
        double *all = malloc(sizeof(double) * m), *abs0 = malloc(sizeof(double) * m), *self = malloc(sizeof(double) * m);
        for (int t = 0; t < nt; t++) {
            pthread_join(th[t], NULL);
            if (o[t].rc) return o[t].rc;
            memcpy(all + t * P.n, o[t].diff, sizeof(double) * (size_t)P.n);
            memcpy(abs0 + t * P.n, o[t].abs0, sizeof(double) * (size_t)P.n);
            memcpy(self + t * P.n, o[t].self, sizeof(double) * (size_t)P.n);
        }
        qsort(all, m, sizeof(double), cmp_d);
        qsort(abs0, m, sizeof(double), cmp_d);
        qsort(self, m, sizeof(double), cmp_d);
        printf("%.2f %.2f %.2f\n", all[m / 2], abs0[m / 2], self[m / 2]);
        return 0;
    }
    if (!strcmp(argv[1], "alloc")) {
        CUresult (*alloc)(CUdeviceptr *, size_t), (*mfree)(CUdeviceptr);
        GET(alloc, "cuMemAlloc");
        GET(mfree, "cuMemFree");
        CUdeviceptr p;
        for (int i = 0; i < 1000; i++) alloc(&p, 4096), mfree(p);
        double t0 = now_ns();
        for (long i = 0; i < n; i++)
            if (alloc(&p, 4096) || mfree(p)) return 7;
        printf("%.2f\n", (now_ns() - t0) / n);
        return 0;
    }
    return 64;
}
