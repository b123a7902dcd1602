/* nvidia-smi for the simulated host: a small subset of the real tool, over
 * whatever libnvidia-ml.so.1 the dynamic loader finds (as the real binary does,
 * so inside a container it sees what the container's NVML sees).
 *
 *   nvidia-smi                      a short status table
 *   nvidia-smi -L                   GPUs and their MIG devices
 *   nvidia-smi --query-gpu=F,... --format=csv[,noheader][,nounits] [-i N]
 *   nvidia-smi --query-compute-apps=F,... --format=csv[,noheader][,nounits]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned gpu, memory;
} nvmlUtilization_t;
typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct {
    unsigned pid;
    unsigned long long usedGpuMemory;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define MIB (1024ull * 1024ull)

/* the NVML entry points used, resolved with dlsym */
static struct {
    int (*init)(void);
    int (*shutdown)(void);
    const char *(*error_string)(int);
    int (*driver_version)(char *, unsigned);
    int (*cuda_version)(int *);
    int (*count)(unsigned *);
    int (*by_index)(unsigned, nvmlDevice_t *);
    int (*name)(nvmlDevice_t, char *, unsigned);
    int (*uuid)(nvmlDevice_t, char *, unsigned);
    int (*memory)(nvmlDevice_t, nvmlMemory_t *);
    int (*util)(nvmlDevice_t, nvmlUtilization_t *);
    int (*pci)(nvmlDevice_t, nvmlPciInfo_t *);
    int (*cc)(nvmlDevice_t, int *, int *);
    int (*mig_mode)(nvmlDevice_t, unsigned *, unsigned *);
    int (*max_mig)(nvmlDevice_t, unsigned *);
    int (*mig_by_index)(nvmlDevice_t, unsigned, nvmlDevice_t *);
    int (*procs)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *);
} nvml;

static int load_nvml(void)
{
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) {
        fprintf(stderr,
                "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make "
                "sure that the NVIDIA Display Driver is properly installed and present in your "
                "system.\nPlease also try adding directory that contains libnvidia-ml.so to "
                "your system PATH.\n");
        return -1;
    }
#define SYM(field, name)                                                  \
    do {                                                                  \
        *(void **)&nvml.field = dlsym(h, name);                           \
        if (!nvml.field) {                                                \
            fprintf(stderr, "nvidia-smi: libnvidia-ml.so.1 lacks %s\n", name); \
            return -1;                                                    \
        }                                                                 \
    } while (0)
    SYM(init, "nvmlInit_v2");
    SYM(shutdown, "nvmlShutdown");
    SYM(error_string, "nvmlErrorString");
    SYM(driver_version, "nvmlSystemGetDriverVersion");
    SYM(cuda_version, "nvmlSystemGetCudaDriverVersion");
    SYM(count, "nvmlDeviceGetCount_v2");
    SYM(by_index, "nvmlDeviceGetHandleByIndex_v2");
    SYM(name, "nvmlDeviceGetName");
    SYM(uuid, "nvmlDeviceGetUUID");
    SYM(memory, "nvmlDeviceGetMemoryInfo");
    SYM(util, "nvmlDeviceGetUtilizationRates");
    SYM(pci, "nvmlDeviceGetPciInfo_v3");
    SYM(cc, "nvmlDeviceGetCudaComputeCapability");
    SYM(mig_mode, "nvmlDeviceGetMigMode");
    SYM(max_mig, "nvmlDeviceGetMaxMigDeviceCount");
    SYM(mig_by_index, "nvmlDeviceGetMigDeviceHandleByIndex");
    SYM(procs, "nvmlDeviceGetComputeRunningProcesses_v3");
#undef SYM
    return 0;
}

/* ---- -L ---- */

static int list_gpus(unsigned n)
{
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d, m;
        char name[96] = "", uuid[96] = "";
        unsigned cur = 0, pend = 0, max = 0, shown = 0;
        if (nvml.by_index(i, &d))
            continue;
        nvml.name(d, name, sizeof name);
        nvml.uuid(d, uuid, sizeof uuid);
        printf("GPU %u: %s (UUID: %s)\n", i, name, uuid);
        if (nvml.mig_mode(d, &cur, &pend) || !cur || nvml.max_mig(d, &max))
            continue;
        for (unsigned k = 0; k < max; k++) {
            const char *profile;
            if (nvml.mig_by_index(d, k, &m))
                continue;
            nvml.name(m, name, sizeof name);
            nvml.uuid(m, uuid, sizeof uuid);
            /* a MIG device's NVML name is "<GPU name> MIG <profile>" */
            profile = strstr(name, "MIG ");
            profile = profile ? profile + 4 : name;
            printf("  MIG %-11s Device %2u: (UUID: %s)\n", profile, shown++, uuid);
        }
    }
    return 0;
}

/* ---- --query-* --format=csv ---- */

struct fmt {
    int header, units;
};

static void print_mib(unsigned long long bytes, const struct fmt *f)
{
    printf(f->units ? "%llu MiB" : "%llu", bytes / MIB);
}

/* Splits a comma list in place; returns the count. */
static int split(char *s, char **out, int max)
{
    int n = 0;
    for (char *tok = strtok(s, ","); tok && n < max; tok = strtok(NULL, ","))
        out[n++] = tok + strspn(tok, " ");
    return n;
}

static const char *gpu_header(const char *field, const struct fmt *f)
{
    static char buf[128];
    const char *unit = NULL;
    if (!strcmp(field, "memory.total") || !strcmp(field, "memory.used") ||
        !strcmp(field, "memory.free"))
        unit = "MiB";
    else if (!strcmp(field, "utilization.gpu") || !strcmp(field, "utilization.memory"))
        unit = "%";
    if (!unit || !f->units)
        return field;
    snprintf(buf, sizeof buf, "%s [%s]", field, unit);
    return buf;
}

static int gpu_field(const char *field, unsigned idx, nvmlDevice_t d, unsigned n,
                     const struct fmt *f)
{
    char s[128] = "";
    nvmlMemory_t mem = {0};
    nvmlUtilization_t u = {0};
    nvmlPciInfo_t pci;

    if (!strcmp(field, "index")) {
        printf("%u", idx);
    } else if (!strcmp(field, "count")) {
        printf("%u", n);
    } else if (!strcmp(field, "uuid") || !strcmp(field, "gpu_uuid")) {
        nvml.uuid(d, s, sizeof s);
        printf("%s", s);
    } else if (!strcmp(field, "name") || !strcmp(field, "gpu_name")) {
        nvml.name(d, s, sizeof s);
        printf("%s", s);
    } else if (!strcmp(field, "pci.bus_id") || !strcmp(field, "gpu_bus_id")) {
        nvml.pci(d, &pci);
        printf("%s", pci.busId);
    } else if (!strcmp(field, "driver_version")) {
        nvml.driver_version(s, sizeof s);
        printf("%s", s);
    } else if (!strcmp(field, "compute_cap")) {
        int ma = 0, mi = 0;
        nvml.cc(d, &ma, &mi);
        printf("%d.%d", ma, mi);
    } else if (!strncmp(field, "memory.", 7)) {
        nvml.memory(d, &mem);
        if (!strcmp(field, "memory.total"))
            print_mib(mem.total, f);
        else if (!strcmp(field, "memory.used"))
            print_mib(mem.used, f);
        else if (!strcmp(field, "memory.free"))
            print_mib(mem.free, f);
        else
            return -1;
    } else if (!strcmp(field, "utilization.gpu") || !strcmp(field, "utilization.memory")) {
        nvml.util(d, &u);
        printf(f->units ? "%u %%" : "%u", field[12] == 'g' ? u.gpu : u.memory);
    } else if (!strcmp(field, "mig.mode.current")) {
        unsigned cur, pend;
        printf("%s", nvml.mig_mode(d, &cur, &pend) ? "[N/A]" : cur ? "Enabled" : "Disabled");
    } else {
        return -1;
    }
    return 0;
}

static int bad_field(const char *opt, const char *field)
{
    fprintf(stderr, "Field \"%s\" is not a valid field to query.\n\n", field);
    (void)opt;
    return 2;
}

/* 0 when every name is one of known, else bad_field's status for the first that is not */
static int check_fields(char *const *names, int nf, const char *const *known, size_t nknown,
                        const char *opt)
{
    for (int k = 0; k < nf; k++) {
        int ok = 0;
        for (size_t j = 0; j < nknown; j++)
            ok |= !strcmp(names[k], known[j]);
        if (!ok)
            return bad_field(opt, names[k]);
    }
    return 0;
}

static int query_gpu(char *fields, const struct fmt *f, int only, unsigned n)
{
    char *names[64];
    int nf = split(fields, names, 64);
    static const char *const known[] = {
        "index", "count", "uuid", "gpu_uuid", "name", "gpu_name", "pci.bus_id",
        "gpu_bus_id", "driver_version", "compute_cap", "memory.total", "memory.used",
        "memory.free", "utilization.gpu", "utilization.memory", "mig.mode.current",
    };
    /* validate before printing anything */
    int bad = check_fields(names, nf, known, sizeof known / sizeof known[0], "--query-gpu");
    if (bad)
        return bad;
    if (f->header) {
        for (int k = 0; k < nf; k++)
            printf("%s%s", k ? ", " : "", gpu_header(names[k], f));
        printf("\n");
    }
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d;
        if ((only >= 0 && (unsigned)only != i) || nvml.by_index(i, &d))
            continue;
        for (int k = 0; k < nf; k++) {
            if (k)
                printf(", ");
            gpu_field(names[k], i, d, n, f);
        }
        printf("\n");
    }
    return 0;
}

static void proc_name(unsigned pid, char *out, size_t len)
{
    char p[64];
    FILE *fp;
    snprintf(p, sizeof p, "/proc/%u/comm", pid);
    snprintf(out, len, "[Not Found]");
    fp = fopen(p, "re");
    if (fp) {
        if (fgets(out, (int)len, fp))
            out[strcspn(out, "\n")] = 0;
        fclose(fp);
    }
}

static int query_apps(char *fields, const struct fmt *f, int only, unsigned n)
{
    static const char *const known[] = {"pid", "process_name", "name", "gpu_uuid", "gpu_name",
                                        "gpu_bus_id", "used_memory", "used_gpu_memory"};
    char *names[32];
    int nf = split(fields, names, 32);
    int bad = check_fields(names, nf, known, sizeof known / sizeof known[0],
                           "--query-compute-apps");
    if (bad)
        return bad;
    if (f->header) {
        for (int k = 0; k < nf; k++) {
            int mem = !strncmp(names[k], "used_", 5);
            printf("%s%s%s", k ? ", " : "", mem ? "used_gpu_memory" : names[k],
                   mem && f->units ? " [MiB]" : "");
        }
        printf("\n");
    }
    for (unsigned i = 0; i < n; i++) {
        static nvmlProcessInfo_t procs[512];
        unsigned cnt = 512;
        nvmlDevice_t d;
        if ((only >= 0 && (unsigned)only != i) || nvml.by_index(i, &d))
            continue;
        if (nvml.procs(d, &cnt, procs))
            continue;
        for (unsigned p = 0; p < cnt; p++) {
            for (int k = 0; k < nf; k++) {
                char s[128];
                if (k)
                    printf(", ");
                if (!strcmp(names[k], "pid")) {
                    printf("%u", procs[p].pid);
                } else if (!strcmp(names[k], "process_name") || !strcmp(names[k], "name")) {
                    proc_name(procs[p].pid, s, sizeof s);
                    printf("%s", s);
                } else if (!strncmp(names[k], "used_", 5)) {
                    print_mib(procs[p].usedGpuMemory, f);
                } else {
                    gpu_field(names[k], i, d, n, f);
                }
            }
            printf("\n");
        }
    }
    return 0;
}

/* ---- the default table ---- */

static int table(unsigned n)
{
    char drv[96] = "", name[96], c1[128], c2[128], c3[128];
    int cuda = 0;
    const char *bar = "+-----------------------------------------+------------------------"
                      "+----------------------+";
    nvml.driver_version(drv, sizeof drv);
    nvml.cuda_version(&cuda);
    printf("%s\n", bar);
    snprintf(c1, sizeof c1, "NVIDIA-SMI %s (simulated)    Driver Version: %s    CUDA Version: %d.%d",
             drv, drv, cuda / 1000, (cuda % 1000) / 10);
    printf("| %-87s |\n", c1);
    printf("|-----------------------------------------+------------------------"
           "+----------------------|\n");
    printf("| %-39s | %-22s | %-20s |\n", "GPU  Name", "Bus-Id          MIG M.",
           "Memory-Usage    Util");
    printf("|=========================================+========================"
           "+======================|\n");
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d;
        nvmlMemory_t mem = {0};
        nvmlUtilization_t u = {0};
        nvmlPciInfo_t pci = {0};
        unsigned cur = 0, pend = 0;
        int mig_ok;
        if (nvml.by_index(i, &d))
            continue;
        name[0] = 0;
        nvml.name(d, name, sizeof name);
        nvml.memory(d, &mem);
        nvml.util(d, &u);
        nvml.pci(d, &pci);
        mig_ok = nvml.mig_mode(d, &cur, &pend) == 0;
        snprintf(c1, sizeof c1, "%3u  %.34s", i, name);
        snprintf(c2, sizeof c2, "%-16.16s %5s", pci.busId, mig_ok ? (cur ? "On" : "Off") : "N/A");
        snprintf(c3, sizeof c3, "%5llu/%5lluMiB %3u%%", mem.used / MIB, mem.total / MIB, u.gpu);
        printf("| %-39s | %-22s | %20s |\n", c1, c2, c3);
        printf("%s\n", bar);
    }
    printf("\nProcesses:\n  GPU        PID   GPU Memory Usage\n");
    for (unsigned i = 0; i < n; i++) {
        static nvmlProcessInfo_t procs[512];
        unsigned cnt = 512;
        nvmlDevice_t d;
        if (nvml.by_index(i, &d) || nvml.procs(d, &cnt, procs))
            continue;
        for (unsigned p = 0; p < cnt; p++)
            printf("  %3u %10u   %llu MiB\n", i, procs[p].pid, procs[p].usedGpuMemory / MIB);
    }
    return 0;
}

static void usage(FILE *out)
{
    fprintf(out, "usage: nvidia-smi [-L] [-i N] [--query-gpu=F,...|--query-compute-apps=F,...]"
                 " [--format=csv[,noheader][,nounits]]\n");
}

int main(int argc, char **argv)
{
    struct fmt f = {1, 1};
    char *query = NULL;
    int list = 0, apps = 0, only = -1, csv = 0, rc;
    unsigned n = 0;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = NULL;
        if (!strcmp(a, "-L") || !strcmp(a, "--list-gpus")) {
            list = 1;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strncmp(a, "--query-gpu", 11) || !strncmp(a, "--query-compute-apps", 20)) {
            apps = a[8] == 'c';
            val = strchr(a, '=');
            if (val)
                query = (char *)val + 1;
            else if (i + 1 < argc)
                query = argv[++i];
        } else if (!strncmp(a, "--format", 8) || !strcmp(a, "-i") || !strncmp(a, "--id", 4)) {
            val = strchr(a, '=');
            if (val)
                val++;
            else if (i + 1 < argc)
                val = argv[++i];
            if (!val) {
                usage(stderr);
                return 2;
            }
            if (a[2] == 'f') {
                char buf[128], *parts[8];
                int np;
                snprintf(buf, sizeof buf, "%s", val);
                np = split(buf, parts, 8);
                for (int k = 0; k < np; k++) {
                    if (!strcmp(parts[k], "csv"))
                        csv = 1;
                    else if (!strcmp(parts[k], "noheader"))
                        f.header = 0;
                    else if (!strcmp(parts[k], "nounits"))
                        f.units = 0;
                }
            } else {
                only = atoi(val);
            }
        } else {
            fprintf(stderr, "Invalid combination of input arguments. Please run "
                            "'nvidia-smi -h' for help.\n");
            return 2;
        }
    }
    if (query && !csv) {
        fprintf(stderr, "Missing format argument. Please use --format=csv\n");
        return 2;
    }
    if (load_nvml() != 0)
        return 12;
    if ((rc = nvml.init()) != 0) {
        fprintf(stderr, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                        "driver. Make sure that the latest NVIDIA driver is installed and "
                        "running. (%s)\n", nvml.error_string(rc));
        return 9;
    }
    nvml.count(&n);
    if (n == 0 && !query) {
        printf("No devices were found\n");
        nvml.shutdown();
        return 6;
    }
    if (list)
        rc = list_gpus(n);
    else if (query)
        rc = apps ? query_apps(query, &f, only, n) : query_gpu(query, &f, only, n);
    else
        rc = table(n);
    nvml.shutdown();
    return rc;
}
