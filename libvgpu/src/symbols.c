/* libvgpu: caps a container's GPU memory and SM share by interposing the CUDA
 * driver API and NVML. See libvgpu/README.md for the design.
 *
 * symbols.c: which names are wrapped, the real entry points (libvgpu's own
 * dlopen of libcuda/libnvidia-ml), the dlsym override and cuGetProcAddress. */
#include "internal.h"

/* A driver whose exported functions call each other through the PLT (the
 * simulated one: cuCtxCreate_v3 -> cuCtxCreate_v2, cuLaunchKernelEx ->
 * cuLaunchKernel) would re-enter our wrappers from inside a real call and
 * count twice: calls made while this thread is inside a real call (NESTED)
 * pass straight through. */
__thread int vgpu_nested __attribute__((tls_model("initial-exec")));

void *real_fn[H_N]; /* real entry points, by hook id */
void *real_x[X_N];  /* helpers */

struct hook {
    const char *name;
    void *wrapper;
};
static const struct hook hooks[H_N]; /* defined at the end */
static const char *const helper_names[X_N] = {
#define NAME(n) #n,
    CUDA_HELPERS(NAME) NVML_HELPERS(NAME)
#undef NAME
};

/* ------------------------------------------------------------------ */
/* dlsym: the real one, and an override that routes the exact names    */

void *(*vgpu_real_dlsym)(void *, const char *);

void resolve_dlsym(void) {
    if (vgpu_real_dlsym) return;
    void *p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!p) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (!p) {
        static const char m[] = "libvgpu: fatal: cannot find the real dlsym\n";
        ssize_t w = write(2, m, sizeof m - 1);
        (void)w;
        abort();
    }
    __atomic_store_n(&vgpu_real_dlsym, (void *(*)(void *, const char *))p, __ATOMIC_RELEASE);
}

static int hook_find(const char *name) {
    if (name[0] == 'c' && name[1] == 'u') {
        for (int i = 0; i < H_NCUDA; i++)
            if (strcmp(hooks[i].name, name) == 0) return i;
    } else if (strncmp(name, "nvml", 4) == 0) {
        for (int i = H_NCUDA + 1; i < H_N; i++)
            if (strcmp(hooks[i].name, name) == 0) return i;
    }
    return -1;
}

/* Called by the dlsym trampoline: our wrapper for an exact wrapped name the
 * handle really provides, else NULL (the trampoline then tail-jumps to the
 * real dlsym, so the caller's return address — which RTLD_NEXT lookups
 * depend on — is preserved). */
__attribute__((visibility("hidden"), used)) void *vgpu_dlsym_route(void *handle, const char *name) {
    resolve_dlsym();
    if (!name) return NULL;
    if (!((name[0] == 'c' && name[1] == 'u') || name[0] == 'n')) return NULL;
    int k = hook_find(name);
    if (k < 0) return NULL;
    if (state_passthrough()) return NULL;
    if (!vgpu_real_dlsym(handle, name)) return NULL;
    return hooks[k].wrapper;
}

#if defined(__x86_64__)
__asm__(".text\n"
        ".globl dlsym\n"
        ".type dlsym,@function\n"
        "dlsym:\n"
        "  push %rdi\n"
        "  push %rsi\n"
        "  sub $8, %rsp\n"
        "  call vgpu_dlsym_route\n"
        "  add $8, %rsp\n"
        "  pop %rsi\n"
        "  pop %rdi\n"
        "  test %rax, %rax\n"
        "  jnz 1f\n"
        "  jmp *vgpu_real_dlsym(%rip)\n"
        "1: ret\n"
        ".size dlsym, .-dlsym\n");
#else
EXPORT void *dlsym(void *handle, const char *name) {
    void *w = vgpu_dlsym_route(handle, name);
    return w ? w : vgpu_real_dlsym(handle, name);
}
#endif

static void *cuda_handle, *nvml_handle;
static pthread_once_t cuda_once = PTHREAD_ONCE_INIT, nvml_once = PTHREAD_ONCE_INIT;

static void *sym_from(void *h, const char *name, void *wrapper) {
    if (!h) return NULL;
    void *p = vgpu_real_dlsym(h, name);
    return p == wrapper ? NULL : p;
}

static void resolve_cuda(void) {
    resolve_dlsym();
    cuda_handle = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!cuda_handle) {
        vgpu_log(VGPU_LOG_ERROR, "cannot load libcuda.so.1");
        return;
    }
    for (int i = 0; i < H_NCUDA; i++) real_fn[i] = sym_from(cuda_handle, hooks[i].name, hooks[i].wrapper);
    for (int i = 0; i < X_nvmlDeviceGetCount_v2; i++) real_x[i] = sym_from(cuda_handle, helper_names[i], NULL);
}

static int nvml_ok;
static unsigned n_nvml;
static char nvml_uuid[VGPU_LDEV_MAX][96];

static void resolve_nvml(void) {
    resolve_dlsym();
    nvml_handle = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!nvml_handle) return;
    for (int i = H_NCUDA + 1; i < H_N; i++) real_fn[i] = sym_from(nvml_handle, hooks[i].name, hooks[i].wrapper);
    for (int i = X_nvmlDeviceGetCount_v2; i < X_N; i++) real_x[i] = sym_from(nvml_handle, helper_names[i], NULL);
    typedef nvmlReturn_t (*count_t)(unsigned *);
    typedef nvmlReturn_t (*byidx_t)(unsigned, nvmlDevice_t *);
    typedef nvmlReturn_t (*uuid_t_)(nvmlDevice_t, char *, unsigned);
    if (!REAL(nvmlInit_v2) || !real_x[X_nvmlDeviceGetCount_v2] || !real_x[X_nvmlDeviceGetHandleByIndex_v2] ||
        !real_x[X_nvmlDeviceGetUUID])
        return;
    /* nested: the real NVML's calls to its own exported names pass straight through
     * our wrappers (entering them would wait on this very resolution) */
    if (NESTED(REAL(nvmlInit_v2)()) != NVML_SUCCESS) return;
    unsigned n = 0;
    if (NESTED(HELP(nvmlDeviceGetCount_v2, count_t)(&n)) != NVML_SUCCESS) return;
    if (n > VGPU_LDEV_MAX) n = VGPU_LDEV_MAX;
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t d;
        nvml_uuid[i][0] = 0;
        if (NESTED(HELP(nvmlDeviceGetHandleByIndex_v2, byidx_t)(i, &d)) == NVML_SUCCESS)
            (void)NESTED(HELP(nvmlDeviceGetUUID, uuid_t_)(d, nvml_uuid[i], sizeof nvml_uuid[i]));
    }
    n_nvml = n;
    nvml_ok = 1;
}

int nvml_index_of(const char *uuid) {
    for (unsigned i = 0; i < n_nvml; i++)
        if (strcasecmp(nvml_uuid[i], uuid) == 0) return (int)i;
    return -1;
}

void resolve_cuda_once(void) { pthread_once(&cuda_once, resolve_cuda); }
void resolve_nvml_once(void) { pthread_once(&nvml_once, resolve_nvml); }
int nvml_ready(void) { return nvml_ok; }

/* ------------------------------------------------------------------ */
/* cuGetProcAddress: the path the CUDA runtime uses since 11.3          */

static void *translate(void *p) {
    for (int i = 0; i < H_NCUDA; i++) {
        if (p == hooks[i].wrapper) return p;
        if (real_fn[i] && p == real_fn[i]) return hooks[i].wrapper;
    }
    return p; /* not a wrapped entry point: untouched */
}

static int proc_translate(void) {
    int pass = state_passthrough();
    resolve_cuda_once();
    return !pass;
}

EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags) {
    int tr = proc_translate();
    if (!REAL(cuGetProcAddress)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGetProcAddress)(symbol, pfn, ver, flags);
    if (tr && r == CUDA_SUCCESS && pfn && *pfn) *pfn = translate(*pfn);
    return r;
}

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status) {
    int tr = proc_translate();
    if (!REAL(cuGetProcAddress_v2)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGetProcAddress_v2)(symbol, pfn, ver, flags, status);
    if (tr && r == CUDA_SUCCESS && pfn && *pfn) *pfn = translate(*pfn);
    return r;
}

/* ------------------------------------------------------------------ */

static const struct hook hooks[H_N] = {
#define ENTRY(n) [H_##n] = {#n, (void *)n},
    CUDA_HOOKS(ENTRY) NVML_HOOKS(ENTRY)
#undef ENTRY
};
