/* Mock NVML (libnvidia-ml.so.1) for the simulated host.
 *
 * Exports the subset of NVML that pynvml, nvctk and the mock nvidia-smi call,
 * with NVML's ABI (names, versioned entry points, struct layouts). A function
 * not exported here is one real pynvml reports as FunctionNotFound, as it does
 * against an older driver. Devices follow the /dev rule (nvsim_state.c): only
 * GPUs whose device node exists are enumerated, numbered in the order found, as
 * the real driver does inside a container. Memory use, utilization and process
 * lists come from the shared state that the mock libcuda writes.
 */
#define _GNU_SOURCE
#include "nvsim_state.h"

#include <dirent.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/stat.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu
#define NVML_MEMORY_V2_VERSION 0x02000028u        /* sizeof 40 | 2 << 24 */
#define NVML_GI_PROFILE_INFO_V2_VERSION 0x02000098u /* sizeof 152 | 2 << 24 */
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_NAME_V2_BUFFER_SIZE 96
#define MAX_MIG 8
/* H100 SXM: device 0x2330, vendor 0x10DE; the sim does not vary it per product */
#define PCI_DEVICE_ID 0x233010DEu
#define PCI_SUBSYS_ID 0x16C110DEu

/* ---- NVML's structs, as nvml.h (and pynvml) lay them out ---- */

typedef struct {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned pid;
    unsigned long long usedGpuMemory;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; /* _v2 and _v3 share this layout */

typedef struct {
    unsigned pid;
    unsigned long long timeStamp;
    unsigned smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct {
    unsigned id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount;
    unsigned copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned version;
    unsigned id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount;
    unsigned copyEngineCount, decoderCount, encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
} nvmlGpuInstanceProfileInfo_v2_t;

_Static_assert(sizeof(nvmlMemory_v2_t) == (NVML_MEMORY_V2_VERSION & 0xffffff), "nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_v2_t) == (NVML_GI_PROFILE_INFO_V2_VERSION & 0xffffff),
               "nvmlGpuInstanceProfileInfo_v2_t");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");

/* ---- handles ---- */

#define DEV_MAGIC 0x4e564d4cu
struct nvsim_dev {
    unsigned magic;
    int is_mig;
    unsigned gpu;                /* topology index */
    const struct nvsim_topo_mig *mig;
    struct nvsim_dev *parent;
};
typedef struct nvsim_dev *nvmlDevice_t;

/* Handles are static, so a handle stays valid across shutdown/init as NVML's do */
static struct nvsim_dev g_gpu[NVSIM_MAX_GPUS];
static struct nvsim_dev g_mig[NVSIM_MAX_GPUS][MAX_MIG];
static unsigned g_vis[NVSIM_MAX_GPUS], g_nvis;          /* visible GPUs, topology indexes */
static struct nvsim_dev *g_vis_mig[NVSIM_MAX_GPUS][MAX_MIG];
static unsigned g_nvis_mig[NVSIM_MAX_GPUS];
static int g_init;
static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;

static void enumerate(void)
{
    unsigned ngpus = nvsim_topo.ngpus < NVSIM_MAX_GPUS ? nvsim_topo.ngpus : NVSIM_MAX_GPUS;
    for (unsigned i = 0; i < ngpus; i++) {
        const struct nvsim_topo_gpu *t = &nvsim_topo.gpus[i];
        g_gpu[i] = (struct nvsim_dev){DEV_MAGIC, 0, i, NULL, NULL};
        for (unsigned m = 0; m < t->nmig && m < MAX_MIG; m++)
            g_mig[i][m] = (struct nvsim_dev){DEV_MAGIC, 1, i, &t->migs[m], &g_gpu[i]};
    }
    g_nvis = nvsim_visible_gpus(g_vis, NVSIM_MAX_GPUS);
    for (unsigned v = 0; v < g_nvis; v++) {
        unsigned i = g_vis[v], n = 0;
        const struct nvsim_topo_gpu *t = &nvsim_topo.gpus[i];
        for (unsigned m = 0; m < t->nmig && m < MAX_MIG; m++)
            if (nvsim_mig_visible(&t->migs[m]))
                g_vis_mig[i][n++] = &g_mig[i][m];
        g_nvis_mig[i] = n;
    }
}

static nvmlReturn_t do_init(void)
{
    char ctl[PATH_MAX];
    struct stat sb;
    /* The real library talks to the kernel module through /dev/nvidiactl: without it
     * (module unloaded, mid driver upgrade) init fails and nothing else works. */
    snprintf(ctl, sizeof ctl, "%s/nvidiactl", nvsim_dev_dir());
    if (stat(ctl, &sb) != 0)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    pthread_mutex_lock(&g_init_lock);
    /* devices are found at the first init, as the real library snapshots them */
    if (g_init++ == 0)
        enumerate();
    pthread_mutex_unlock(&g_init_lock);
    return NVML_SUCCESS;
}

static int initialized(void)
{
    return __atomic_load_n(&g_init, __ATOMIC_ACQUIRE) > 0;
}

/* Checks init and the handle (kind: 0 any, 1 GPU only, 2 MIG only). */
static nvmlReturn_t check(nvmlDevice_t d, int kind)
{
    int ok = 0;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (d >= &g_gpu[0] && d < &g_gpu[NVSIM_MAX_GPUS])
        ok = 1;
    else if (d >= &g_mig[0][0] && d < &g_mig[NVSIM_MAX_GPUS - 1][MAX_MIG])
        ok = 1;
    if (!ok || d->magic != DEV_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((kind == 1 && d->is_mig) || (kind == 2 && !d->is_mig))
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

static const struct nvsim_topo_gpu *topo(nvmlDevice_t d)
{
    return &nvsim_topo.gpus[d->gpu];
}

static int mig_capable(const struct nvsim_topo_gpu *t)
{
    int cc = t->cc_major * 10 + t->cc_minor;
    return t->nmig > 0 || cc == 80 || cc == 90;
}

/* The head of every device query: a valid handle of `kind` (check()), then the
 * caller's output pointers (`outs`: a condition on them) not NULL. */
#define DEVICE_QUERY(d, kind, outs)                                                                \
    do {                                                                                           \
        nvmlReturn_t r_ = check(d, kind);                                                          \
        if (r_)                                                                                    \
            return r_;                                                                             \
        if (!(outs))                                                                               \
            return NVML_ERROR_INVALID_ARGUMENT;                                                    \
    } while (0)

static nvmlReturn_t copy_str(char *dst, unsigned len, const char *src)
{
    size_t n = strlen(src);
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (n + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* ---- init, errors, system ---- */

/* as the real library (driver 580): the older entry points call nvmlInitWithFlags by
 * its exported name, so an interposer that wraps it sees that inner call too */
nvmlReturn_t nvmlInitWithFlags(unsigned flags) { (void)flags; return do_init(); }
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t r = NVML_SUCCESS;
    pthread_mutex_lock(&g_init_lock);
    if (g_init > 0)
        g_init--;
    else
        r = NVML_ERROR_UNINITIALIZED;
    pthread_mutex_unlock(&g_init_lock);
    return r;
}

const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 15: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned len)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return copy_str(version, len, nvsim_topo.driver_version);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned len)
{
    char buf[96];
    /* NVML's version is the CUDA major version before the driver version */
    snprintf(buf, sizeof buf, "%d.%s", nvsim_topo.cuda_version_int / 1000,
             nvsim_topo.driver_version);
    return copy_str(version, len, buf);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = nvsim_topo.cuda_version_int;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    return nvmlSystemGetCudaDriverVersion(v);
}

/* ---- device enumeration ---- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = g_nvis;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *dev)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!dev || index >= g_nvis)
        return NVML_ERROR_INVALID_ARGUMENT;
    *dev = &g_gpu[g_vis[index]];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned index, nvmlDevice_t *dev)
{
    return nvmlDeviceGetHandleByIndex_v2(index, dev);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *dev)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !dev)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned v = 0; v < g_nvis; v++) {
        unsigned i = g_vis[v];
        if (strcasecmp(uuid, nvsim_topo.gpus[i].uuid) == 0) {
            *dev = &g_gpu[i];
            return NVML_SUCCESS;
        }
        for (unsigned m = 0; m < g_nvis_mig[i]; m++) {
            if (strcasecmp(uuid, g_vis_mig[i][m]->mig->uuid) == 0) {
                *dev = g_vis_mig[i][m];
                return NVML_SUCCESS;
            }
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* Accepts NVML's forms: "dddddddd:bb:dd.f", the legacy "dddd:bb:dd.f", and "bb:dd.f". */
static int parse_bus_id(const char *s, unsigned *domain, unsigned *bus, unsigned *device)
{
    unsigned a, b, c, f;
    char tail;
    if (sscanf(s, "%x:%x:%x.%x%c", &a, &b, &c, &f, &tail) == 4) {
        *domain = a, *bus = b, *device = c;
        return 0;
    }
    if (sscanf(s, "%x:%x.%x%c", &b, &c, &f, &tail) == 3) {
        *domain = 0, *bus = b, *device = c;
        return 0;
    }
    return -1;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus_id, nvmlDevice_t *dev)
{
    unsigned d, b, dv;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!bus_id || !dev || parse_bus_id(bus_id, &d, &b, &dv) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned v = 0; v < g_nvis; v++) {
        const struct nvsim_topo_gpu *t = &nvsim_topo.gpus[g_vis[v]];
        if (t->pci_domain == d && t->pci_bus == b && t->pci_device == dv) {
            *dev = &g_gpu[g_vis[v]];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus_id, nvmlDevice_t *dev)
{
    return nvmlDeviceGetHandleByPciBusId_v2(bus_id, dev);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *index)
{
    nvmlReturn_t r = check(d, 1);
    if (r)
        return r;
    for (unsigned v = 0; v < g_nvis; v++) {
        if (g_vis[v] == d->gpu) {
            *index = v;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

/* ---- identity ---- */

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned len)
{
    char buf[NVML_DEVICE_NAME_V2_BUFFER_SIZE + 32];
    nvmlReturn_t r = check(d, 0);
    if (r)
        return r;
    if (!d->is_mig)
        return copy_str(name, len, topo(d)->name);
    /* what real NVML names a MIG device: the parent's name and the profile */
    snprintf(buf, sizeof buf, "%s MIG %s", topo(d)->name, d->mig->profile);
    return copy_str(name, len, buf);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned len)
{
    nvmlReturn_t r = check(d, 0);
    if (r)
        return r;
    return copy_str(uuid, len, d->is_mig ? d->mig->uuid : topo(d)->uuid);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci)
{
    const struct nvsim_topo_gpu *t;
    DEVICE_QUERY(d, 0, pci);
    t = topo(d); /* a MIG device reports its parent's PCI address */
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0",
             t->pci_domain & 0xffff, t->pci_bus & 0xff, t->pci_device & 0xff);
    snprintf(pci->busId, sizeof pci->busId, "%s", t->pci_bus_id);
    pci->domain = t->pci_domain;
    pci->bus = t->pci_bus;
    pci->device = t->pci_device;
    pci->pciDeviceId = PCI_DEVICE_ID;
    pci->pciSubSystemId = PCI_SUBSYS_ID;
    return NVML_SUCCESS;
}

/* The _v2 struct is the _v3 one with reserved words in place of busId, so
 * filling the shared prefix is all it needs. */
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_t *pci)
{
    nvmlPciInfo_t full;
    nvmlReturn_t r = nvmlDeviceGetPciInfo_v3(d, &full);
    if (r == NVML_SUCCESS) {
        memcpy(pci, &full, offsetof(nvmlPciInfo_t, busId));
        memset((char *)pci + offsetof(nvmlPciInfo_t, busId), 0, 16);
    }
    return r;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor)
{
    DEVICE_QUERY(d, 0, major && minor);
    *major = topo(d)->cc_major;
    *minor = topo(d)->cc_minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t d, int *brand)
{
    /* nvmlBrandType_t, by the names topology.py uses */
    static const struct { const char *name; int v; } brands[] = {
        {"quadro", 1}, {"tesla", 2}, {"nvs", 3}, {"grid", 4}, {"geforce", 5}, {"titan", 6},
        {"quadro_rtx", 12}, {"nvidia_rtx", 13}, {"nvidia", 14}, {"geforce_rtx", 15},
        {"titan_rtx", 16},
    };
    DEVICE_QUERY(d, 0, brand);
    *brand = 0;
    for (size_t i = 0; i < sizeof brands / sizeof brands[0]; i++)
        if (strcasecmp(topo(d)->brand, brands[i].name) == 0)
            *brand = brands[i].v;
    return NVML_SUCCESS;
}

/* ---- MIG ---- */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned *current, unsigned *pending)
{
    DEVICE_QUERY(d, 1, current && pending);
    if (!mig_capable(topo(d)))
        return NVML_ERROR_NOT_SUPPORTED;
    *current = *pending = topo(d)->nmig > 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned index,
                                                 nvmlDevice_t *mig)
{
    DEVICE_QUERY(d, 1, mig);
    if (!mig_capable(topo(d)))
        return NVML_ERROR_NOT_SUPPORTED;
    if (topo(d)->nmig == 0)
        return NVML_ERROR_INVALID_ARGUMENT; /* MIG mode is off */
    if (index >= g_nvis_mig[d->gpu])
        return NVML_ERROR_NOT_FOUND;
    *mig = g_vis_mig[d->gpu][index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t d, nvmlDevice_t *parent)
{
    nvmlReturn_t r = check(d, 2);
    if (r)
        return r == NVML_ERROR_NOT_SUPPORTED ? NVML_ERROR_INVALID_ARGUMENT : r;
    if (!parent)
        return NVML_ERROR_INVALID_ARGUMENT;
    *parent = d->parent;
    return NVML_SUCCESS;
}

/* NVML_GPU_INSTANCE_PROFILE_* -> the sim's profile of that shape */
static const struct nvsim_topo_profile *profile_by_enum(unsigned e)
{
    static const char *const names[] = {
        [0] = "1g.10gb", [1] = "2g.20gb", [2] = "3g.40gb", [3] = "4g.40gb", [4] = "7g.80gb",
        [9] = "1g.20gb", /* NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 */
    };
    if (e >= sizeof names / sizeof names[0] || !names[e])
        return NULL;
    for (unsigned i = 0; i < nvsim_topo.nprofiles; i++)
        if (strcmp(nvsim_topo.profiles[i].name, names[e]) == 0)
            return &nvsim_topo.profiles[i];
    return NULL;
}

static const struct nvsim_topo_profile *profile_by_id(unsigned id)
{
    for (unsigned i = 0; i < nvsim_topo.nprofiles; i++)
        if (nvsim_topo.profiles[i].id == id)
            return &nvsim_topo.profiles[i];
    return NULL;
}

static void fill_profile(const struct nvsim_topo_profile *p, nvmlGpuInstanceProfileInfo_v2_t *o)
{
    unsigned v = o->version;
    memset(o, 0, sizeof *o);
    o->version = v;
    o->id = p->id;
    o->sliceCount = p->slices;
    o->instanceCount = 7 / p->slices;
    o->multiprocessorCount = p->slices * 16;  /* an H100 slice: 16 SMs */
    o->copyEngineCount = p->slices;
    o->decoderCount = p->slices;
    o->jpegCount = p->slices;
    o->ofaCount = p->slices == 7;
    o->memorySizeMB = p->memory_mib;
    snprintf(o->name, sizeof o->name, "MIG %s", p->name);
}

static nvmlReturn_t profile_info(nvmlDevice_t d, const struct nvsim_topo_profile *p,
                                 nvmlGpuInstanceProfileInfo_v2_t *info)
{
    DEVICE_QUERY(d, 1, info);
    if (!mig_capable(topo(d)) || !p)
        return NVML_ERROR_NOT_SUPPORTED;
    if (info->version != NVML_GI_PROFILE_INFO_V2_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    fill_profile(p, info);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t d, unsigned profile,
                                                  nvmlGpuInstanceProfileInfo_v2_t *info)
{
    return profile_info(d, profile_by_enum(profile), info);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoByIdV(nvmlDevice_t d, unsigned id,
                                                      nvmlGpuInstanceProfileInfo_v2_t *info)
{
    return profile_info(d, profile_by_id(id), info);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t d, unsigned profile,
                                                 nvmlGpuInstanceProfileInfo_t *info)
{
    nvmlGpuInstanceProfileInfo_v2_t v2 = {.version = NVML_GI_PROFILE_INFO_V2_VERSION};
    nvmlReturn_t r;
    if (!info)
        return check(d, 1) ? check(d, 1) : NVML_ERROR_INVALID_ARGUMENT;
    r = profile_info(d, profile_by_enum(profile), &v2);
    if (r == NVML_SUCCESS) {
        /* v1 is v2 without version and name; the padding before memorySizeMB
         * differs, so the fields are copied one by one */
        *info = (nvmlGpuInstanceProfileInfo_t){
            v2.id, v2.isP2pSupported, v2.sliceCount, v2.instanceCount,
            v2.multiprocessorCount, v2.copyEngineCount, v2.decoderCount,
            v2.encoderCount, v2.jpegCount, v2.ofaCount, v2.memorySizeMB,
        };
    }
    return r;
}

/* ---- memory, utilization, processes: from the shared state ---- */

static void mem_of(nvmlDevice_t d, unsigned long long *total, unsigned long long *used)
{
    struct nvsim_state *st;
    if (d->is_mig) {
        /* the state accounts whole GPUs; a MIG slice shows its size, unused */
        *total = d->mig->memory_mib << 20;
        *used = 0;
        return;
    }
    *total = topo(d)->memory_mib << 20;
    *used = 0;
    st = nvsim_state_open();
    if (st && d->gpu < st->ngpus) {
        nvsim_reap(st); /* memory of crashed processes is free again, on every GPU */
        *used = __atomic_load_n(&st->gpus[d->gpu].mem_used, __ATOMIC_RELAXED);
        if (*used > *total)
            *used = *total;
    }
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *mem)
{
    DEVICE_QUERY(d, 0, mem);
    mem_of(d, &mem->total, &mem->used);
    mem->free = mem->total - mem->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *mem)
{
    DEVICE_QUERY(d, 0, mem);
    if (mem->version != NVML_MEMORY_V2_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    mem_of(d, &mem->total, &mem->used);
    mem->reserved = 0;
    mem->free = mem->total - mem->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *util)
{
    struct nvsim_state *st;
    nvmlReturn_t r = check(d, 1); /* as on real MIG devices: not supported */
    if (r)
        return r;
    if (!util)
        return NVML_ERROR_INVALID_ARGUMENT;
    st = nvsim_state_open();
    util->gpu = nvsim_gpu_util(st, d->gpu);
    /* memory = memory-controller busy time; the sim's kernels do not touch memory */
    util->memory = 0;
    return NVML_SUCCESS;
}

/* Visits the live slots on d's GPU; returns how many. idx (may be NULL) gets
 * their slot numbers. */
static unsigned live_procs(nvmlDevice_t d, struct nvsim_proc *out, unsigned *idx, unsigned max)
{
    struct nvsim_state *st = nvsim_state_open();
    unsigned n = 0;
    if (!st || d->is_mig || d->gpu >= st->ngpus)
        return 0;
    nvsim_reap_gpu(st, d->gpu);
    if (nvsim_lock(&st->lock) != 0)
        return 0;
    for (unsigned i = 0; i < NVSIM_MAX_PROCS; i++) {
        const struct nvsim_proc *p = &st->procs[i];
        if (p->pid && p->gpu == d->gpu) {
            if (n < max) {
                out[n] = *p;
                if (idx)
                    idx[n] = i;
            }
            n++;
        }
    }
    nvsim_unlock(&st->lock);
    return n;
}

/* ---- the pid NVML reports ----
 *
 * The real driver reports every process by its pid in the initial pid
 * namespace, the kernel module's view, also for processes inside containers.
 * A slot records its owner's pid in the owner's namespace, that namespace's
 * inode and its start time (nvsim_state.c): the mock finds the process in the
 * caller's /proc (the namespace inode of /proc/N/ns/pid, the last NSpid entry
 * and the start time must all match) and reports N, which is the host pid for
 * a caller on the host, as the real driver's. A caller in a container cannot
 * see other containers' processes: those keep their recorded pid (the real
 * driver would still give the host pid). Resolved pids are cached per process;
 * one /proc scan resolves every new slot of a call. */

#define PID_CACHE 4096 /* > NVSIM_MAX_PROCS: a full table of processes never thrashes it */
struct pid_map {
    int32_t pid;
    uint64_t pidns, start;
    int32_t seen; /* the pid in this process's /proc, -1: not visible here */
};
static struct pid_map g_pids[PID_CACHE];
static unsigned g_npids;
static pid_t g_pids_owner;
static pthread_mutex_t g_pids_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t self_pidns(void)
{
    struct stat sb;
    return stat("/proc/self/ns/pid", &sb) == 0 ? (uint64_t)sb.st_ino : 0;
}

/* /proc/<n>/<what> into buf (NUL-terminated, at most size - 1 bytes); 0 when unreadable */
static int read_proc(const char *n, const char *what, char *buf, size_t size)
{
    char path[300];
    ssize_t len;
    int fd;

    snprintf(path, sizeof path, "/proc/%s/%s", n, what);
    if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        return 0;
    len = read(fd, buf, size - 1);
    close(fd);
    if (len <= 0)
        return 0;
    buf[len] = 0;
    return 1;
}

/* NSpid's last entry and the start time of /proc/<n>; 0 when unreadable */
static int proc_facts(const char *n, int32_t *nspid, uint64_t *start)
{
    char buf[4096];
    char *p;

    if (!read_proc(n, "status", buf, sizeof buf))
        return 0;
    if (!(p = strstr(buf, "\nNSpid:")))
        return 0;
    p += 7;
    for (;;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p)
            break;
        *nspid = (int32_t)v;
        p = end;
    }
    if (!read_proc(n, "stat", buf, sizeof buf))
        return 0;
    if (!(p = strrchr(buf, ')')))
        return 0;
    for (int field = 2; p && field < 22; field++) /* to field 22 */
        p = strchr(p + 1, ' ');
    if (!p)
        return 0;
    *start = strtoull(p + 1, NULL, 10);
    return 1;
}

static struct pid_map *pid_cached(const struct nvsim_proc *p)
{
    for (unsigned i = 0; i < g_npids; i++)
        if (g_pids[i].pid == p->pid && g_pids[i].pidns == p->pidns && g_pids[i].start == p->start_time)
            return &g_pids[i];
    return NULL;
}

static void pid_remember(const struct nvsim_proc *p, int32_t seen)
{
    /* full: start over (the entries of dead processes go with it) */
    if (g_npids == PID_CACHE)
        g_npids = 0;
    g_pids[g_npids++] = (struct pid_map){p->pid, p->pidns, p->start_time, seen};
}

/* out[i]: the pid to report for procs[i] */
static void report_pids(const struct nvsim_proc *procs, unsigned n, unsigned *out)
{
    uint64_t mine = self_pidns();
    unsigned todo = 0;
    DIR *dir;
    struct dirent *e;

    pthread_mutex_lock(&g_pids_lock);
    if (g_pids_owner != getpid()) { /* a forked child has its own view */
        g_npids = 0;
        g_pids_owner = getpid();
    }
    for (unsigned i = 0; i < n; i++) {
        const struct pid_map *m;
        out[i] = 0;
        if (!procs[i].pidns || procs[i].pidns == mine)
            out[i] = (unsigned)procs[i].pid; /* the caller's own namespace */
        else if ((m = pid_cached(&procs[i])))
            out[i] = m->seen > 0 ? (unsigned)m->seen
                                 : (unsigned)(procs[i].host_pid ? procs[i].host_pid : procs[i].pid);
        else
            todo++;
    }
    if (todo && (dir = opendir("/proc"))) {
        while (todo && (e = readdir(dir))) {
            char path[300];
            struct stat sb;
            int32_t nspid = 0;
            uint64_t start = 0;
            int facts = 0;
            if (e->d_name[0] < '1' || e->d_name[0] > '9')
                continue;
            snprintf(path, sizeof path, "/proc/%s/ns/pid", e->d_name);
            /* a caller without ptrace access to it (a monitor with no capability) cannot
             * see its namespace: its innermost pid and start time name it alone, as the
             * driver's own record of the process would */
            int ns_seen = stat(path, &sb) == 0;
            if (ns_seen && (uint64_t)sb.st_ino == mine)
                continue;
            for (unsigned i = 0; i < n; i++) {
                if (out[i] || (ns_seen && procs[i].pidns != (uint64_t)sb.st_ino))
                    continue;
                if (!facts && !(facts = proc_facts(e->d_name, &nspid, &start)))
                    break;
                if (nspid == procs[i].pid && start == procs[i].start_time) {
                    out[i] = (unsigned)strtoul(e->d_name, NULL, 10);
                    pid_remember(&procs[i], (int32_t)out[i]);
                    todo--;
                }
            }
        }
        closedir(dir);
    }
    for (unsigned i = 0; i < n; i++) {
        if (!out[i]) {
            pid_remember(&procs[i], -1);
            out[i] = (unsigned)(procs[i].host_pid ? procs[i].host_pid : procs[i].pid);
        }
    }
    pthread_mutex_unlock(&g_pids_lock);
}

/* NVML's two-call protocol: a short (or NULL) array gets the needed count and
 * INSUFFICIENT_SIZE; no processes is success with count 0. */
static nvmlReturn_t running_procs(nvmlDevice_t d, unsigned *count, void *infos, int v1)
{
    struct nvsim_proc procs[NVSIM_MAX_PROCS];
    unsigned pids[NVSIM_MAX_PROCS];
    unsigned n;
    DEVICE_QUERY(d, 0, count);
    n = live_procs(d, procs, NULL, NVSIM_MAX_PROCS);
    if (n > *count || (n && !infos)) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = n;
    report_pids(procs, n, pids);
    for (unsigned i = 0; i < n; i++) {
        unsigned pid = pids[i];
        if (v1) {
            nvmlProcessInfo_v1_t *o = (nvmlProcessInfo_v1_t *)infos + i;
            o->pid = pid;
            o->usedGpuMemory = procs[i].mem_used;
        } else {
            nvmlProcessInfo_t *o = (nvmlProcessInfo_t *)infos + i;
            o->pid = pid;
            o->usedGpuMemory = procs[i].mem_used;
            o->gpuInstanceId = o->computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
        }
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned *count,
                                                  nvmlProcessInfo_v1_t *infos)
{
    return running_procs(d, count, infos, 1);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned *count,
                                                     nvmlProcessInfo_t *infos)
{
    return running_procs(d, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *count,
                                                     nvmlProcessInfo_t *infos)
{
    return running_procs(d, count, infos, 0);
}

/* The sim runs no graphics or MPS clients: those lists are always empty. */
static nvmlReturn_t no_procs(nvmlDevice_t d, unsigned *count)
{
    DEVICE_QUERY(d, 0, count);
    *count = 0;
    return NVML_SUCCESS;
}

/* graphics and MPS processes: the simulated GPUs run none */
#define NO_PROCS(name)                                                                             \
    nvmlReturn_t name(nvmlDevice_t d, unsigned *c, void *i)                                        \
    {                                                                                              \
        (void)i;                                                                                   \
        return no_procs(d, c);                                                                     \
    }
NO_PROCS(nvmlDeviceGetGraphicsRunningProcesses_v2)
NO_PROCS(nvmlDeviceGetGraphicsRunningProcesses_v3)
NO_PROCS(nvmlDeviceGetMPSComputeRunningProcesses_v2)
NO_PROCS(nvmlDeviceGetMPSComputeRunningProcesses_v3)

/* Samples since last_seen (microseconds, CLOCK_REALTIME; 0: the last second),
 * as the real driver keeps them: per process, from its busy-time history
 * (nvsim_state.h: struct nvsim_hist), over the whole sample periods between
 * last_seen and now. One sample per process that ran kernels in them, its
 * smUtil the percentage of that span its kernels took and its timeStamp the
 * span's end; nothing new is NOT_FOUND, as real NVML answers. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d,
                                             nvmlProcessUtilizationSample_t *samples,
                                             unsigned *count, unsigned long long last_seen)
{
    struct nvsim_proc procs[NVSIM_MAX_PROCS]; /* 70 KiB of stack, no TLS or heap */
    unsigned idx[NVSIM_MAX_PROCS], pids[NVSIM_MAX_PROCS], util[NVSIM_MAX_PROCS];
    struct nvsim_state *st;
    unsigned n, k = 0;
    uint64_t now_q, start_q, span;
    DEVICE_QUERY(d, 1, count);
    st = nvsim_state_open();
    now_q = nvsim_realtime_ns() / NVSIM_HIST_PERIOD_NS; /* the current, incomplete period */
    start_q = last_seen ? (last_seen * 1000ull + NVSIM_HIST_PERIOD_NS - 1) / NVSIM_HIST_PERIOD_NS
                        : now_q - 1000000000ull / NVSIM_HIST_PERIOD_NS;
    if (start_q + NVSIM_HIST - 1 < now_q)
        start_q = now_q - (NVSIM_HIST - 1); /* older than the history: what it holds */
    n = st && start_q < now_q ? live_procs(d, procs, idx, NVSIM_MAX_PROCS) : 0;
    span = (now_q - start_q) * NVSIM_HIST_PERIOD_NS;
    for (unsigned i = 0; i < n; i++) {
        uint64_t cur = __atomic_load_n(&st->procs[idx[i]].busy_ns, __ATOMIC_RELAXED);
        uint64_t b0 = nvsim_busy_at(st, idx[i], start_q, now_q, cur);
        uint64_t b1 = nvsim_busy_at(st, idx[i], now_q, now_q, cur);
        uint64_t pct;
        if (b1 <= b0)
            continue;
        pct = ((b1 - b0) * 100 + span / 2) / span;
        procs[k] = procs[i];
        util[k++] = (unsigned)(pct > 100 ? 100 : pct);
    }
    if (k == 0)
        return NVML_ERROR_NOT_FOUND;
    if (!samples || *count < k) {
        *count = k;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    report_pids(procs, k, pids);
    for (unsigned i = 0; i < k; i++) {
        samples[i] = (nvmlProcessUtilizationSample_t){
            .pid = pids[i],
            .timeStamp = (unsigned long long)(now_q * NVSIM_HIST_PERIOD_NS / 1000ull),
            .smUtil = util[i],
        };
    }
    *count = k;
    return NVML_SUCCESS;
}

/* ---- event sets (XID critical errors) ----
 *
 * The sim has no kernel driver to raise XIDs; `nvctk.sim.events.inject_xid`
 * appends a record to the events file beside the state file
 * (<sim-root>/run/nvidia-sim/events on the host, /run/nvidia-sim/events in a
 * container, $NVSIM_EVENTS if set). An event set remembers the file's size
 * when it was created, so it reports only XIDs injected after that, as the
 * real driver reports only events raised while the set exists. The record
 * layout is fixed (24 bytes, little-endian; nvctk/sim/events.py packs it). */

#define NVML_ERROR_TIMEOUT 10
#define NVML_EVENT_TYPE_XID 0x8ull
#define NVSIM_NO_INSTANCE 0xFFFFFFFFu
#define NVSIM_EVENT_POLL_NS 5000000L /* 5 ms: far below the 1 s health goal */

struct nvsim_event_rec {
    uint32_t gpu;  /* topology index */
    uint32_t gi;   /* GPU instance id, NVSIM_NO_INSTANCE for the whole GPU */
    uint32_t ci;   /* compute instance id, likewise */
    uint32_t _pad;
    uint64_t xid;
};
_Static_assert(sizeof(struct nvsim_event_rec) == 24, "nvsim_event_rec");

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

#define EVSET_MAGIC 0x4e564553u
struct nvsim_evset {
    unsigned magic;
    pthread_mutex_t lock;
    off_t offset;                               /* next record to read */
    unsigned long long types[NVSIM_MAX_GPUS];   /* registered event types per GPU */
};
typedef struct nvsim_evset *nvmlEventSet_t;

static const char *events_path(void)
{
    static char path[4200];
    char dir[4096];
    const char *env = getenv("NVSIM_EVENTS");
    struct stat sb;
    if (env && *env)
        return env;
    snprintf(dir, sizeof dir, "%s/run/nvidia-sim", nvsim_topo.sim_root);
    if (stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode))
        snprintf(path, sizeof path, "%s/events", dir);
    else
        snprintf(path, sizeof path, "/run/nvidia-sim/events");
    return path;
}

static off_t events_size(void)
{
    struct stat sb;
    return stat(events_path(), &sb) == 0 ? sb.st_size : 0;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    struct nvsim_evset *s;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    s = calloc(1, sizeof *s);
    if (!s)
        return NVML_ERROR_UNKNOWN;
    s->magic = EVSET_MAGIC;
    pthread_mutex_init(&s->lock, NULL);
    /* whole records only: a writer's append in progress is read later */
    s->offset = events_size() / (off_t)sizeof(struct nvsim_event_rec) *
                (off_t)sizeof(struct nvsim_event_rec);
    *set = s;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!set || set->magic != EVSET_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    pthread_mutex_destroy(&set->lock);
    free(set);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set)
{
    nvmlReturn_t r = check(d, 1);
    if (r)
        return r;
    if (!set || set->magic != EVSET_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~NVML_EVENT_TYPE_XID)
        return NVML_ERROR_NOT_SUPPORTED; /* as NVML does for a type the GPU lacks */
    pthread_mutex_lock(&set->lock);
    set->types[d->gpu] |= types;
    pthread_mutex_unlock(&set->lock);
    return NVML_SUCCESS;
}

/* One pass over the records not yet read: 1 and *out filled for the first that
 * this set registered for, else 0. */
static int next_event(nvmlEventSet_t set, nvmlEventData_t *out)
{
    struct nvsim_event_rec rec;
    int found = 0;
    int fd = open(events_path(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    pthread_mutex_lock(&set->lock);
    while (!found && pread(fd, &rec, sizeof rec, set->offset) == (ssize_t)sizeof rec) {
        set->offset += (off_t)sizeof rec;
        if (rec.gpu >= NVSIM_MAX_GPUS || rec.gpu >= nvsim_topo.ngpus ||
            !(set->types[rec.gpu] & NVML_EVENT_TYPE_XID))
            continue;
        *out = (nvmlEventData_t){&g_gpu[rec.gpu], NVML_EVENT_TYPE_XID, rec.xid, rec.gi, rec.ci};
        found = 1;
    }
    pthread_mutex_unlock(&set->lock);
    close(fd);
    return found;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms)
{
    struct timespec now, end;
    const struct timespec poll = {0, NVSIM_EVENT_POLL_NS};
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!set || set->magic != EVSET_MAGIC || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    clock_gettime(CLOCK_MONOTONIC, &end);
    end.tv_sec += timeout_ms / 1000;
    end.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (end.tv_nsec >= 1000000000L) {
        end.tv_sec++;
        end.tv_nsec -= 1000000000L;
    }
    for (;;) {
        if (next_event(set, data))
            return NVML_SUCCESS;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec > end.tv_sec || (now.tv_sec == end.tv_sec && now.tv_nsec >= end.tv_nsec))
            return NVML_ERROR_TIMEOUT;
        nanosleep(&poll, NULL);
    }
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned timeout_ms)
{
    return nvmlEventSetWait_v2(set, data, timeout_ms);
}

/* the getters of one shape: nvctk/sim/data/nvml_getters.txt, generated by build.py */
#include "nvml_getters.inc"

/* ---- health and performance readings: a model driven by the GPU's load ----
 *
 * A real GPU's temperature, power, clocks and bus traffic follow its load; the sim has
 * the load (the utilization window, the busy time, the memory held) and derives them
 * from it with the figures of an H100 SXM (idle 70 W, 700 W board limit, SM clock 345
 * MHz idle to 1980 MHz busy, HBM3 at 2619 MHz), so monitors see them move as on a real
 * node. Error counters (ECC, remapped rows, PCIe replays) are zero: the sim's memory
 * never fails. MIG device handles answer NOT_SUPPORTED, as NVML does for these. GPM
 * (Hopper and later, cc >= 9.0) samples the busy time; older GPUs answer NOT_SUPPORTED. */

#define IDLE_MW 70000u
#define MAX_MW 700000u
#define MEM_MW 30000u            /* memory held at full: its refresh and leakage */
#define SM_IDLE_MHZ 345u
#define SM_MAX_MHZ 1980u
#define MEM_MHZ 2619u
#define VIDEO_MHZ 1755u
#define PCIE_IDLE_KBS 64u        /* driver housekeeping */
#define PCIE_MAX_KBS 25000000u   /* 25 GB/s: a busy kernel's feeds at Gen5 x16 */

enum { CLOCK_GRAPHICS = 0, CLOCK_SM = 1, CLOCK_MEM = 2, CLOCK_VIDEO = 3 };

struct load {
    unsigned util;      /* percent, the last window */
    uint64_t busy_ns;   /* kernel time since the state was made */
    uint64_t mem_used, mem_total;
};

static struct load load_of(nvmlDevice_t d)
{
    struct load l = {0, 0, 0, topo(d)->memory_mib << 20};
    struct nvsim_state *st = nvsim_state_open();
    if (st && d->gpu < st->ngpus) {
        l.util = nvsim_gpu_util(st, d->gpu);
        l.busy_ns = __atomic_load_n(&st->gpus[d->gpu].busy_ns, __ATOMIC_RELAXED);
        l.mem_used = __atomic_load_n(&st->gpus[d->gpu].mem_used, __ATOMIC_RELAXED);
    }
    return l;
}

static unsigned power_mw(const struct load *l)
{
    return IDLE_MW + (MAX_MW - IDLE_MW) / 100u * l->util
           + (unsigned)(MEM_MW * (double)l->mem_used / (double)(l->mem_total ? l->mem_total : 1));
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *temp)
{
    struct load l;
    DEVICE_QUERY(d, 1, temp);
    if (sensor != 0) /* NVML_TEMPERATURE_GPU is the only sensor */
        return NVML_ERROR_INVALID_ARGUMENT;
    l = load_of(d);
    *temp = 31u + l.util * 45u / 100u + (unsigned)(4.0 * (double)l.mem_used / (double)l.mem_total);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned *mw)
{
    struct load l;
    DEVICE_QUERY(d, 1, mw);
    l = load_of(d);
    *mw = power_mw(&l);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned *mw)
{
    DEVICE_QUERY(d, 1, mw);
    *mw = MAX_MW;
    return NVML_SUCCESS;
}

/* Energy since the driver loaded (the boot: CLOCK_MONOTONIC): the idle draw all along
 * plus the busy draw for the kernel time; it never goes back. */
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *mj)
{
    struct load l;
    DEVICE_QUERY(d, 1, mj);
    l = load_of(d);
    *mj = (unsigned long long)(IDLE_MW / 1000u) * (nvsim_now_ns() / 1000000ull)
          + (unsigned long long)((MAX_MW - IDLE_MW) / 1000u) * (l.busy_ns / 1000000ull);
    return NVML_SUCCESS;
}

static unsigned clock_mhz(int type, unsigned util, int max)
{
    switch (type) {
    case CLOCK_GRAPHICS:
    case CLOCK_SM:
        return max || util ? SM_MAX_MHZ : SM_IDLE_MHZ;
    case CLOCK_MEM:
        return MEM_MHZ;
    case CLOCK_VIDEO:
        return VIDEO_MHZ;
    default:
        return 0;
    }
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t d, int type, unsigned *mhz)
{
    DEVICE_QUERY(d, 1, mhz);
    if (!clock_mhz(type, 0, 1))
        return NVML_ERROR_INVALID_ARGUMENT;
    *mhz = clock_mhz(type, load_of(d).util, 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t d, int type, unsigned *mhz)
{
    DEVICE_QUERY(d, 1, mhz);
    if (!clock_mhz(type, 0, 1))
        return NVML_ERROR_INVALID_ARGUMENT;
    *mhz = clock_mhz(type, 0, 1);
    return NVML_SUCCESS;
}

static unsigned pcie_kbs(unsigned util, int rx)
{
    /* the host feeds a busy GPU (rx) more than it reads back (tx) */
    return PCIE_IDLE_KBS + (PCIE_MAX_KBS / 100u) * util / (rx ? 1u : 4u);
}

/* counter: NVML_PCIE_UTIL_TX_BYTES 0, RX_BYTES 1; KB/s over the last window */
nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t d, int counter, unsigned *kbs)
{
    DEVICE_QUERY(d, 1, kbs);
    if (counter != 0 && counter != 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    *kbs = pcie_kbs(load_of(d).util, counter == 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t d, unsigned *value)
{
    DEVICE_QUERY(d, 1, value);
    *value = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int error_type, int counter_type,
                                         unsigned long long *count)
{
    DEVICE_QUERY(d, 1, count);
    if ((error_type != 0 && error_type != 1) || (counter_type != 0 && counter_type != 1))
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned *corr, unsigned *unc,
                                       unsigned *pending, unsigned *failure)
{
    DEVICE_QUERY(d, 1, corr && unc && pending && failure);
    *corr = *unc = *pending = *failure = 0;
    return NVML_SUCCESS;
}

/* the sim runs no video: 0 %, over NVML's encoder/decoder sample period */
nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t d, unsigned *util, unsigned *period_us)
{
    DEVICE_QUERY(d, 1, util && period_us);
    *util = 0;
    *period_us = 167000;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t d, unsigned *util, unsigned *period_us)
{
    return nvmlDeviceGetEncoderUtilization(d, util, period_us);
}

/* ---- GPM: GPU performance monitoring, Hopper and later ---- */

#define NVML_GPM_METRICS_GET_VERSION 1u
#define NVML_GPM_SUPPORT_VERSION 1u
#define NVML_GPM_METRIC_MAX 98u
#define GPM_MAGIC 0x47504d53u

typedef struct nvsim_gpm_sample {
    unsigned magic, gpu;
    int taken;
    uint64_t t_ns, busy_ns;
} *nvmlGpmSample_t;

typedef struct {
    unsigned metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    struct { char *shortName, *longName, *unit; } metricInfo;
} nvmlGpmMetric_t;

typedef struct {
    unsigned version, numMetrics;
    nvmlGpmSample_t sample1, sample2;
    nvmlGpmMetric_t metrics[NVML_GPM_METRIC_MAX];
} nvmlGpmMetricsGet_t;

typedef struct {
    unsigned version, isSupportedDevice;
} nvmlGpmSupport_t;

static int gpm_capable(nvmlDevice_t d)
{
    return topo(d)->cc_major >= 9;
}

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t d, nvmlGpmSupport_t *s)
{
    DEVICE_QUERY(d, 0, s);
    if (s->version != NVML_GPM_SUPPORT_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    s->isSupportedDevice = (unsigned)gpm_capable(d);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample)
{
    nvmlGpmSample_t s;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!sample)
        return NVML_ERROR_INVALID_ARGUMENT;
    s = calloc(1, sizeof(*s));
    if (!s)
        return NVML_ERROR_UNKNOWN;
    s->magic = GPM_MAGIC;
    *sample = s;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample)
{
    if (!sample || sample->magic != GPM_MAGIC)
        return NVML_ERROR_INVALID_ARGUMENT;
    sample->magic = 0;
    free(sample);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t d, nvmlGpmSample_t sample)
{
    DEVICE_QUERY(d, 1, sample && sample->magic == GPM_MAGIC);
    if (!gpm_capable(d))
        return NVML_ERROR_NOT_SUPPORTED;
    sample->gpu = d->gpu;
    sample->t_ns = nvsim_now_ns();
    sample->busy_ns = load_of(d).busy_ns;
    sample->taken = 1;
    return NVML_SUCCESS;
}

/* What each metric is, from the busy fraction between the two samples: the sim's
 * kernels keep every SM busy, half their warps resident, a tensor pipe and DRAM a set
 * share of the time (a dense training step's proportions). */
static int gpm_value(unsigned id, double busy, double *v)
{
    switch (id) {
    case 1: *v = 100.0 * busy; return 1;            /* GRAPHICS_UTIL */
    case 2: *v = 100.0 * busy; return 1;            /* SM_UTIL */
    case 3: *v = 50.0 * busy; return 1;             /* SM_OCCUPANCY */
    case 5: *v = 40.0 * busy; return 1;             /* ANY_TENSOR_UTIL */
    case 10: *v = 30.0 * busy; return 1;            /* DRAM_BW_UTIL */
    case 20: *v = (PCIE_IDLE_KBS + PCIE_MAX_KBS / 4.0 * busy) / 1024.0; return 1; /* PCIE_TX MiB/s */
    case 21: *v = (PCIE_IDLE_KBS + PCIE_MAX_KBS * busy) / 1024.0; return 1;       /* PCIE_RX MiB/s */
    default: return 0;
    }
}

nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *m)
{
    nvmlGpmSample_t a, b;
    double busy;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != NVML_GPM_METRICS_GET_VERSION)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    a = m->sample1;
    b = m->sample2;
    if (!a || !b || a->magic != GPM_MAGIC || b->magic != GPM_MAGIC || !a->taken || !b->taken
        || a->gpu != b->gpu || m->numMetrics > NVML_GPM_METRIC_MAX)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (b->t_ns < a->t_ns) { /* either order, as NVML takes them */
        nvmlGpmSample_t t = a;
        a = b;
        b = t;
    }
    busy = b->t_ns > a->t_ns ? (double)(b->busy_ns - a->busy_ns) / (double)(b->t_ns - a->t_ns) : 0.0;
    if (busy > 1.0)
        busy = 1.0;
    for (unsigned i = 0; i < m->numMetrics; i++) {
        nvmlGpmMetric_t *x = &m->metrics[i];
        x->nvmlReturn = gpm_value(x->metricId, busy, &x->value) ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
        x->metricInfo.shortName = x->metricInfo.longName = x->metricInfo.unit = NULL;
    }
    return NVML_SUCCESS;
}
