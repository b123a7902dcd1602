/* memory.c: every path that holds device memory (allocations, arrays, VMM,
 * stream-ordered pools), each charged before the driver call and credited
 * when the driver frees it. */
#include "internal.h"

/* process-local maps: device pointer / VMM handle / array / context -> size.
 * ctx: the context current at allocation (pointers, arrays), whose destruction
 * frees the allocation in the driver. */
struct ptrmap {
    struct pm_ent *t;
    size_t cap, n;
};
static struct ptrmap maps[MAP_N];
static pthread_mutex_t local_mu = PTHREAD_MUTEX_INITIALIZER;

static inline size_t pm_hash(uint64_t k, size_t mask) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (size_t)k & mask;
}

static int pm_grow(struct ptrmap *m) {
    size_t ncap = m->cap ? m->cap * 2 : 1024;
    struct pm_ent *nt = calloc(ncap, sizeof *nt);
    if (!nt) return -1;
    for (size_t i = 0; i < m->cap; i++)
        if (m->t[i].key) {
            size_t j = pm_hash(m->t[i].key, ncap - 1);
            while (nt[j].key) j = (j + 1) & (ncap - 1);
            nt[j] = m->t[i];
        }
    free(m->t);
    m->t = nt;
    m->cap = ncap;
    return 0;
}

static void pm_put_full(int which, uint64_t key, uint64_t size, int e, uint64_t ctx, uint32_t pool) {
    struct ptrmap *m = &maps[which];
    pthread_mutex_lock(&local_mu);
    if ((m->n + 1) * 2 > m->cap && pm_grow(m) < 0) {
        pthread_mutex_unlock(&local_mu);
        return;
    }
    size_t mask = m->cap - 1, i = pm_hash(key, mask);
    while (m->t[i].key && m->t[i].key != key) i = (i + 1) & mask;
    if (!m->t[i].key) m->n++;
    m->t[i].key = key;
    m->t[i].size = size;
    m->t[i].e = e;
    m->t[i].ctx = ctx;
    m->t[i].pool = pool;
    pthread_mutex_unlock(&local_mu);
}

void pm_put_ctx(int which, uint64_t key, uint64_t size, int e, uint64_t ctx) {
    pm_put_full(which, key, size, e, ctx, 0);
}

static void ent_credit(const struct pm_ent *ent); /* a freed entry's bytes (through its pool) */

void pm_put(int which, uint64_t key, uint64_t size, int e) { pm_put_ctx(which, key, size, e, 0); }

/* The context current on this thread (0 if none or unknown). */
uint64_t current_ctx(void) {
    typedef CUresult (*getcur_t)(CUcontext *);
    CUcontext c = NULL;
    if (!real_x[X_cuCtxGetCurrent] || HELP(cuCtxGetCurrent, getcur_t)(&c) != CUDA_SUCCESS) return 0;
    return (uint64_t)(uintptr_t)c;
}

/* Removes key; 1 with its entry in *out, or 0. */
int pm_take(int which, uint64_t key, struct pm_ent *out) {
    struct ptrmap *m = &maps[which];
    pthread_mutex_lock(&local_mu);
    if (!m->cap || !key) {
        pthread_mutex_unlock(&local_mu);
        return 0;
    }
    size_t mask = m->cap - 1, i = pm_hash(key, mask);
    while (m->t[i].key && m->t[i].key != key) i = (i + 1) & mask;
    if (!m->t[i].key) {
        pthread_mutex_unlock(&local_mu);
        return 0;
    }
    *out = m->t[i];
    m->t[i].key = 0;
    m->n--;
    /* backward-shift deletion keeps probe chains intact */
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!m->t[j].key) break;
        size_t k = pm_hash(m->t[j].key, mask);
        if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) {
            m->t[i] = m->t[j];
            m->t[j].key = 0;
            i = j;
        }
    }
    pthread_mutex_unlock(&local_mu);
    return 1;
}

/* The driver frees a context's allocations with it: credit what this process
 * recorded against ctx (pointers and arrays), so the cap gets them back. */
void pm_drop_ctx(uint64_t ctx) {
    if (!ctx) return;
    static const int kinds[] = {MAP_PTR, MAP_ARRAY};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        struct ptrmap *m = &maps[kinds[k]];
        for (;;) { /* take one at a time: deletion shifts entries */
            uint64_t key = 0;
            pthread_mutex_lock(&local_mu);
            for (size_t i = 0; i < m->cap; i++)
                if (m->t[i].key && m->t[i].ctx == ctx) {
                    key = m->t[i].key;
                    break;
                }
            pthread_mutex_unlock(&local_mu);
            struct pm_ent ent;
            if (!key || !pm_take(kinds[k], key, &ent)) break;
            ent_credit(&ent);
        }
    }
}

/* ------------------------------------------------------------------ */
/* VMM: the charge follows the driver's lifetime of physical memory      */
/* A handle's memory lives until its last reference (cuMemCreate, each   */
/* cuMemRetainAllocationHandle) is released AND its last mapping is      */
/* unmapped: cuMemCreate charges, and the bytes come back only when both */
/* counts reach zero (a release while mapped, as PyTorch's expandable    */
/* segments do, keeps the charge until the unmap).                       */

struct vmm_h {
    uint64_t h, size;
    int e, refs, maps;
};
struct vmm_m {
    uint64_t va, len, h;
};
static struct vmm_h *vmm_hs;
static struct vmm_m *vmm_ms;
static size_t vmm_nh, vmm_ch, vmm_nm, vmm_cm;
static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;

static int grow(void **p, size_t *cap, size_t n, size_t esz) {
    if (n < *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 64;
    void *np = realloc(*p, nc * esz);
    if (!np) return -1;
    *p = np;
    *cap = nc;
    return 0;
}

/* the oldest entry for h (a handle value the driver reused comes later) */
static long vmm_find(uint64_t h) {
    for (size_t i = 0; i < vmm_nh; i++)
        if (vmm_hs[i].h == h) return (long)i;
    return -1;
}

/* Credits and forgets handle i once nothing holds its memory. vmm_mu held. */
static void vmm_settle(long i) {
    struct vmm_h *v = &vmm_hs[i];
    if (v->refs > 0 || v->maps > 0) return;
    credit(v->e, v->size);
    memmove(v, v + 1, (vmm_nh - (size_t)i - 1) * sizeof *v);
    vmm_nh--;
}

static void vmm_add(uint64_t h, uint64_t size, int e) {
    pthread_mutex_lock(&vmm_mu);
    if (grow((void **)&vmm_hs, &vmm_ch, vmm_nh, sizeof *vmm_hs) == 0)
        vmm_hs[vmm_nh++] = (struct vmm_h){h, size, e, 1, 0};
    /* else: never credited (the process only loses) */
    pthread_mutex_unlock(&vmm_mu);
}

/* One reference more (retain) or less (release) that the driver accepted. */
static void vmm_ref(uint64_t h, int delta) {
    pthread_mutex_lock(&vmm_mu);
    long i = vmm_find(h);
    if (i >= 0) {
        vmm_hs[i].refs += delta;
        vmm_settle(i);
    }
    pthread_mutex_unlock(&vmm_mu);
}

static void vmm_mapped(uint64_t va, uint64_t len, uint64_t h) {
    pthread_mutex_lock(&vmm_mu);
    long i = vmm_find(h);
    if (i >= 0 && grow((void **)&vmm_ms, &vmm_cm, vmm_nm, sizeof *vmm_ms) == 0) {
        vmm_hs[i].maps++;
        vmm_ms[vmm_nm++] = (struct vmm_m){va, len, h};
    } else if (i >= 0) {
        vmm_hs[i].refs = 1 << 30; /* cannot follow its mappings: never credited */
    }
    pthread_mutex_unlock(&vmm_mu);
}

/* The mappings that start in [va, va + len) are gone. */
static void vmm_unmapped(uint64_t va, uint64_t len) {
    pthread_mutex_lock(&vmm_mu);
    for (size_t k = 0; k < vmm_nm;) {
        struct vmm_m m = vmm_ms[k];
        if (m.va < va || m.va - va >= len) {
            k++;
            continue;
        }
        vmm_ms[k] = vmm_ms[--vmm_nm];
        long i = vmm_find(m.h);
        if (i >= 0) {
            vmm_hs[i].maps--;
            vmm_settle(i);
        }
    }
    pthread_mutex_unlock(&vmm_mu);
}

/* The generic alloc-then-record pattern: charge first, credit on failure. */
#define ALLOC_BODY(realcall, ptrexpr, size, mapkind)                      \
    do {                                                                  \
        struct ldev *ld = cur_ldev();                                     \
        if (!ld) return realcall;                                         \
        if (ld == LD_REFUSE) return refuse_dev("an allocation");          \
        uint64_t sz_ = (uint64_t)(size);                                  \
        if (charge(ld, sz_) < 0) return CUDA_ERROR_OUT_OF_MEMORY;         \
        CUresult r_ = NESTED(realcall);                                   \
        if (r_ != CUDA_SUCCESS) {                                         \
            credit(ld->e, sz_);                                           \
            return r_;                                                    \
        }                                                                 \
        pm_put_ctx(mapkind, (uint64_t)(ptrexpr), sz_, ld->e, current_ctx()); \
        return r_;                                                        \
    } while (0)

/* The generic forget-then-free pattern: the entry leaves the map before the
 * real call (a racing free of the same key credits nothing twice); on success
 * its size is credited, on failure the whole entry goes back. */
#define FREE_BODY(mapkind, k, realcall)                                    \
    do {                                                                  \
        struct pm_ent ent_;                                               \
        int had_ = pm_take(mapkind, (uint64_t)(uintptr_t)(k), &ent_);    \
        CUresult r_ = NESTED(realcall);                                   \
        if (had_) {                                                       \
            if (r_ == CUDA_SUCCESS) ent_credit(&ent_);                   \
            else pm_put_full(mapkind, ent_.key, ent_.size, ent_.e, ent_.ctx, ent_.pool); \
        }                                                                 \
        return r_;                                                        \
    } while (0)

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    ENTER_OR(REAL(cuMemAlloc_v2)(dptr, bytesize));
    if (!dptr) return REAL(cuMemAlloc_v2)(dptr, bytesize);
    ALLOC_BODY(REAL(cuMemAlloc_v2)(dptr, bytesize), *dptr, bytesize, MAP_PTR);
}

EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    ENTER_OR(REAL(cuMemAllocManaged)(dptr, bytesize, flags));
    if (!dptr) return REAL(cuMemAllocManaged)(dptr, bytesize, flags);
    ALLOC_BODY(REAL(cuMemAllocManaged)(dptr, bytesize, flags), *dptr, bytesize, MAP_PTR);
}

/* ---- stream-ordered allocation: charged to the device and the lifetime
 * that own the memory. The pool's device (cuMemAllocAsync: the device of the
 * stream's context, whose current pool serves it), not the current context's;
 * recorded against the stream's context, whose destruction frees it (the
 * current context may be a throw-away one). */

/* A pool's charge is the larger of what it handed out (and libvgpu charged)
 * and what it reserves on the GPU: a pool keeps freed memory up to its
 * release threshold, so a free credits only what the pool really gave back,
 * and cuMemPoolTrimTo / cuMemPoolDestroy the rest. Every adjustment after
 * the charge made before an allocation is a credit: the cap never needs a
 * second check. */
struct pool_ent {
    uint64_t pool;
    CUdevice dev;
    int e;          /* its device's ledger window; -1: not accountable */
    uint32_t id;    /* what allocations remember (handles are reused) */
    uint64_t out;   /* bytes handed out and not freed */
    uint64_t chg;   /* bytes charged for it: max(out, reserved) as last seen */
};
static struct pool_ent *pools_t;
static size_t pools_n, pools_c;
static uint32_t pool_ids;
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;

#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5

static long pool_find(uint64_t pool) {
    for (size_t i = 0; i < pools_n; i++)
        if (pools_t[i].pool == pool) return (long)i;
    return -1;
}

static long pool_find_id(uint32_t id) {
    for (size_t i = 0; id && i < pools_n; i++)
        if (pools_t[i].id == id) return (long)i;
    return -1;
}

static void pool_note(CUmemoryPool pool, CUdevice dev) {
    pthread_mutex_lock(&pool_mu);
    long i = pool_find((uint64_t)(uintptr_t)pool);
    if (i < 0 && grow((void **)&pools_t, &pools_c, pools_n, sizeof *pools_t) == 0) {
        struct ldev *ld = ldev_for(dev);
        pools_t[pools_n] = (struct pool_ent){(uint64_t)(uintptr_t)pool, dev,
                                             ld && ld != LD_REFUSE ? ld->e : -1, ++pool_ids, 0, 0};
        pools_n++;
    }
    pthread_mutex_unlock(&pool_mu);
}

/* Credits what pool i no longer holds: its charge comes down to
 * max(out, reserved), or to `out` when gone (or the driver cannot say). pool_mu held. */
static void pool_settle(long i, int gone) {
    typedef CUresult (*pattr_t)(CUmemoryPool, int, void *);
    struct pool_ent *p = &pools_t[i];
    uint64_t target = p->out, res = 0;
    if (!gone && real_x[X_cuMemPoolGetAttribute] &&
        NESTED(HELP(cuMemPoolGetAttribute, pattr_t)((CUmemoryPool)(uintptr_t)p->pool,
                                                    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res)) == CUDA_SUCCESS &&
        res > target)
        target = res;
    if (p->chg > target && p->e >= 0) {
        credit(p->e, p->chg - target);
        p->chg = target;
    }
}

static void pool_forget(CUmemoryPool pool) {
    pthread_mutex_lock(&pool_mu);
    long i = pool_find((uint64_t)(uintptr_t)pool);
    if (i >= 0) {
        pool_settle(i, 1); /* what it kept went with it; its allocations keep their own charges */
        pools_t[i] = pools_t[--pools_n];
    }
    pthread_mutex_unlock(&pool_mu);
}

static void ent_credit(const struct pm_ent *ent) {
    if (ent->pool) {
        pthread_mutex_lock(&pool_mu);
        long i = pool_find_id(ent->pool);
        if (i >= 0) {
            struct pool_ent *p = &pools_t[i];
            uint64_t b = ent->size < p->out ? ent->size : p->out;
            p->out -= b;
            pool_settle(i, 0);
            pthread_mutex_unlock(&pool_mu);
            return;
        }
        pthread_mutex_unlock(&pool_mu);
    }
    credit(ent->e, ent->size);
}

EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    ENTER_OR(REAL(cuMemPoolTrimTo)(pool, keep));
    CUresult r = NESTED(REAL(cuMemPoolTrimTo)(pool, keep));
    if (r == CUDA_SUCCESS) {
        pthread_mutex_lock(&pool_mu);
        long i = pool_find((uint64_t)(uintptr_t)pool);
        if (i >= 0) pool_settle(i, 0);
        pthread_mutex_unlock(&pool_mu);
    }
    return r;
}

/* 0 with the pool's device, or -1: a pool libvgpu never saw made */
static int pool_dev(CUmemoryPool pool, CUdevice *dev) {
    pthread_mutex_lock(&pool_mu);
    long i = pool_find((uint64_t)(uintptr_t)pool);
    if (i >= 0) *dev = pools_t[i].dev;
    pthread_mutex_unlock(&pool_mu);
    return i >= 0 ? 0 : -1;
}

EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    ENTER_OR(REAL(cuMemPoolCreate)(pool, props));
    CUresult r = NESTED(REAL(cuMemPoolCreate)(pool, props));
    if (r == CUDA_SUCCESS && pool && props && props->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        pool_note(*pool, props->location.id);
    return r;
}

EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    ENTER_OR(REAL(cuMemPoolDestroy)(pool));
    CUresult r = NESTED(REAL(cuMemPoolDestroy)(pool));
    if (r == CUDA_SUCCESS) pool_forget(pool); /* its allocations keep their charges until freed */
    return r;
}

EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    ENTER_OR(REAL(cuDeviceGetDefaultMemPool)(pool, dev));
    CUresult r = NESTED(REAL(cuDeviceGetDefaultMemPool)(pool, dev));
    if (r == CUDA_SUCCESS && pool) pool_note(*pool, dev);
    return r;
}

EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    ENTER_OR(REAL(cuDeviceGetMemPool)(pool, dev));
    CUresult r = NESTED(REAL(cuDeviceGetMemPool)(pool, dev));
    if (r == CUDA_SUCCESS && pool) pool_note(*pool, dev);
    return r;
}

/* The context ctx's device (see ldev_for); NULL if the driver cannot say. */
static struct ldev *ctx_ldev(CUcontext ctx) {
    typedef CUresult (*push_t)(CUcontext);
    typedef CUresult (*pop_t)(CUcontext *);
    typedef CUresult (*getdev_t)(CUdevice *);
    if ((uint64_t)(uintptr_t)ctx == current_ctx()) return cur_ldev();
    if (!real_x[X_cuCtxPushCurrent_v2] || !real_x[X_cuCtxPopCurrent_v2] || !real_x[X_cuCtxGetDevice])
        return LD_REFUSE;
    if (HELP(cuCtxPushCurrent_v2, push_t)(ctx) != CUDA_SUCCESS) return NULL;
    CUdevice d;
    CUresult r = HELP(cuCtxGetDevice, getdev_t)(&d);
    CUcontext popped;
    HELP(cuCtxPopCurrent_v2, pop_t)(&popped);
    return r == CUDA_SUCCESS ? ldev_for(d) : NULL;
}

/* Who owns a stream-ordered allocation: *ld the device to charge (NULL: let
 * the driver refuse; LD_REFUSE: refuse), *ctx the context whose destruction
 * frees it. 0, or the driver's error for the stream. */
static CUresult async_owner(CUstream s, const CUmemoryPool *pool, struct ldev **ld, uint64_t *ctx) {
    typedef CUresult (*sctx_t)(CUstream, CUcontext *);
    CUcontext c = NULL;
    if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) {
        c = (CUcontext)(uintptr_t)current_ctx();
    } else if (!real_x[X_cuStreamGetCtx]) {
        *ld = LD_REFUSE; /* cannot tell: fail closed */
        return CUDA_SUCCESS;
    } else {
        CUresult r = HELP(cuStreamGetCtx, sctx_t)(s, &c);
        if (r != CUDA_SUCCESS) return r;
    }
    *ctx = (uint64_t)(uintptr_t)c;
    if (pool) {
        CUdevice d;
        if (pool_dev(*pool, &d) != 0) {
            vgpu_log(VGPU_LOG_ERROR, "allocation from a memory pool libvgpu did not see made (imported?) refused");
            *ld = LD_REFUSE;
        } else {
            *ld = ldev_for(d);
        }
    } else {
        *ld = c ? ctx_ldev(c) : NULL;
    }
    return CUDA_SUCCESS;
}

/* The pool serving an allocation: the given one, or the device's current. */
static CUmemoryPool async_pool(const CUmemoryPool *pool, const struct ldev *ld) {
    if (pool) return *pool;
    CUmemoryPool p = NULL;
    if (!REAL(cuDeviceGetMemPool) || NESTED(REAL(cuDeviceGetMemPool)(&p, ld->dev)) != CUDA_SUCCESS) return NULL;
    pool_note(p, ld->dev);
    return p;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s);
EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s);
EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s);
EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s);
EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s);
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s);

/* The real stream-ordered calls, by variant: bit 0 _ptsz, bit 1 from a pool. */
static CUresult async_real(int v, CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream s) {
    switch (v) {
    case 0: return REAL(cuMemAllocAsync)(d, n, s);
    case 1: return REAL(cuMemAllocAsync_ptsz)(d, n, s);
    case 2: return REAL(cuMemAllocFromPoolAsync)(d, n, p, s);
    default: return REAL(cuMemAllocFromPoolAsync_ptsz)(d, n, p, s);
    }
}

static uint64_t pool_reserved(CUmemoryPool pool) {
    typedef CUresult (*pattr_t)(CUmemoryPool, int, void *);
    uint64_t res = 0;
    if (real_x[X_cuMemPoolGetAttribute])
        NESTED(HELP(cuMemPoolGetAttribute, pattr_t)(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res));
    return res;
}

/* A stream-ordered allocation. What its pool kept from earlier frees (charged
 * already) serves it first, so only the rest is charged before the call; if
 * the pool grew by more than that (a real pool may not find a kept block big
 * enough), the growth is charged after it, and where that is refused the
 * allocation is freed, the pool trimmed back and the call refused. Pool
 * bookkeeping is under pool_mu for the whole call. */
static CUresult async_alloc(int v, CUdeviceptr *dptr, size_t bytes, const CUmemoryPool *pool, CUstream s) {
    CUmemoryPool pl = pool ? *pool : NULL;
    if (!dptr) return async_real(v, dptr, bytes, pl, s);
    struct ldev *ld = NULL;
    uint64_t octx = 0;
    CUresult r = async_owner(s, pool, &ld, &octx);
    if (r != CUDA_SUCCESS) return r;
    if (!ld) return async_real(v, dptr, bytes, pl, s);
    if (ld == LD_REFUSE) return refuse_dev("a stream-ordered allocation");
    CUmemoryPool p = async_pool(pool, ld);
    pthread_mutex_lock(&pool_mu);
    long pi = p ? pool_find((uint64_t)(uintptr_t)p) : -1;
    struct pool_ent *pe = pi >= 0 ? &pools_t[pi] : NULL;
    uint64_t kept = pe && pe->chg > pe->out ? pe->chg - pe->out : 0;
    uint64_t need = bytes > kept ? bytes - kept : 0, res0 = pe ? pool_reserved(p) : 0;
    if (charge(ld, need) < 0) {
        pthread_mutex_unlock(&pool_mu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r = NESTED(async_real(v, dptr, bytes, pl, s));
    if (r != CUDA_SUCCESS) {
        credit(ld->e, need);
        pthread_mutex_unlock(&pool_mu);
        return r;
    }
    uint32_t id = 0;
    if (pe) {
        pe->out += bytes;
        pe->chg += need;
        uint64_t res = pool_reserved(p);
        if (res > pe->chg && charge(ld, res - pe->chg) != 0) {
            NESTED((v & 1 ? REAL(cuMemFreeAsync_ptsz) : REAL(cuMemFreeAsync))(*dptr, s));
            if (REAL(cuMemPoolTrimTo)) NESTED(REAL(cuMemPoolTrimTo)(p, res0));
            pe->out -= bytes;
            pool_settle(pi, 0);
            pthread_mutex_unlock(&pool_mu);
            *dptr = 0;
            vgpu_log(VGPU_LOG_INFO, "%s: the pool grew past the cap: %zu bytes refused", ld->uuid, bytes);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        if (res > pe->chg) pe->chg = res;
        pool_settle(pi, 0);
        id = pe->id;
    }
    pthread_mutex_unlock(&pool_mu);
    pm_put_full(MAP_PTR, *dptr, bytes, ld->e, octx, id);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    ENTER_OR(REAL(cuMemAllocAsync)(dptr, bytesize, s));
    return async_alloc(0, dptr, bytesize, NULL, s);
}

EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    ENTER_OR(REAL(cuMemAllocAsync_ptsz)(dptr, bytesize, s));
    return async_alloc(1, dptr, bytesize, NULL, s);
}

EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    ENTER_OR(REAL(cuMemAllocFromPoolAsync)(dptr, bytesize, pool, s));
    return async_alloc(2, dptr, bytesize, &pool, s);
}

EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    ENTER_OR(REAL(cuMemAllocFromPoolAsync_ptsz)(dptr, bytesize, pool, s));
    return async_alloc(3, dptr, bytesize, &pool, s);
}

EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                   unsigned int elem) {
    ENTER_OR(REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, elem));
    CUresult r = NESTED(REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, elem));
    if (r != CUDA_SUCCESS || !dptr || !pitch) return r;
    struct ldev *ld = cur_ldev();
    if (!ld) return r;
    /* the pitch is the driver's choice: charge the real pitch x height */
    unsigned __int128 sz = (unsigned __int128)*pitch * height;
    if (ld == LD_REFUSE || sz >> 63 || charge(ld, (uint64_t)sz) < 0) {
        NESTED(REAL(cuMemFree_v2)(*dptr));
        *dptr = 0;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pm_put_ctx(MAP_PTR, *dptr, (uint64_t)sz, ld->e, current_ctx());
    return r;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    ENTER_OR(REAL(cuMemFree_v2)(dptr));
    FREE_BODY(MAP_PTR, dptr, REAL(cuMemFree_v2)(dptr));
}

static CUresult free_async(CUresult (*fn)(CUdeviceptr, CUstream), CUdeviceptr dptr, CUstream s) {
    FREE_BODY(MAP_PTR, dptr, fn(dptr, s));
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) {
    ENTER_OR(REAL(cuMemFreeAsync)(dptr, s));
    return free_async(REAL(cuMemFreeAsync), dptr, s);
}

EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) {
    ENTER_OR(REAL(cuMemFreeAsync_ptsz)(dptr, s));
    return free_async(REAL(cuMemFreeAsync_ptsz), dptr, s);
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    ENTER_OR(REAL(cuMemCreate)(handle, size, prop, flags));
    /* only device-resident physical memory counts */
    if (!handle || !prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return REAL(cuMemCreate)(handle, size, prop, flags);
    struct ldev *ld = ldev_for(prop->location.id);
    if (!ld) return REAL(cuMemCreate)(handle, size, prop, flags);
    if (ld == LD_REFUSE) return refuse_dev("cuMemCreate");
    if (charge(ld, size) < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = NESTED(REAL(cuMemCreate)(handle, size, prop, flags));
    if (r != CUDA_SUCCESS) credit(ld->e, size);
    else vmm_add(*handle, size, ld->e);
    return r;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    ENTER_OR(REAL(cuMemRelease)(handle));
    CUresult r = NESTED(REAL(cuMemRelease)(handle));
    if (r == CUDA_SUCCESS) vmm_ref(handle, -1);
    return r;
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    ENTER_OR(REAL(cuMemRetainAllocationHandle)(handle, addr));
    CUresult r = NESTED(REAL(cuMemRetainAllocationHandle)(handle, addr));
    if (r == CUDA_SUCCESS && handle) vmm_ref(*handle, +1);
    return r;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags) {
    ENTER_OR(REAL(cuMemMap)(ptr, size, offset, handle, flags));
    CUresult r = NESTED(REAL(cuMemMap)(ptr, size, offset, handle, flags));
    if (r == CUDA_SUCCESS) vmm_mapped(ptr, size, handle);
    return r;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    ENTER_OR(REAL(cuMemUnmap)(ptr, size));
    CUresult r = NESTED(REAL(cuMemUnmap)(ptr, size));
    if (r == CUDA_SUCCESS) vmm_unmapped(ptr, size);
    return r;
}

/* A driver may drop the mappings left in a freed reservation (the simulated
 * one does; a real one refuses): they are unmapped for the charge too. */
EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    ENTER_OR(REAL(cuMemAddressFree)(ptr, size));
    CUresult r = NESTED(REAL(cuMemAddressFree)(ptr, size));
    if (r == CUDA_SUCCESS) vmm_unmapped(ptr, size);
    return r;
}

/* Bytes per element and the channel count a format implies (0: NumChannels). */
static uint64_t elem_bytes(int format, unsigned *fixed) {
    *fixed = 0;
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: case CU_AD_FORMAT_FLOAT: return 4;
    case 0xc0: case 0xc6: *fixed = 1; return 1; /* [US]NORM_INT8X1 */
    case 0xc1: case 0xc7: *fixed = 2; return 1;
    case 0xc2: case 0xc8: *fixed = 4; return 1;
    case 0xc3: case 0xc9: *fixed = 1; return 2; /* [US]NORM_INT16X1 */
    case 0xc4: case 0xca: *fixed = 2; return 2;
    case 0xc5: case 0xcb: *fixed = 4; return 2;
    default: *fixed = 4; return 4; /* unknown: count generously (16 bytes/element) */
    }
}

#define CU_AD_FORMAT_NV12 0xb0
#define ARRAY3D_LAYERED 0x01
#define ARRAY3D_CUBEMAP 0x04

/* width x height x depth x element size (x channels); NV12 = luma + half chroma */
static uint64_t array_bytes(size_t w, size_t h, size_t d, int format, unsigned ch) {
    if (format == CU_AD_FORMAT_NV12) {
        unsigned __int128 b = (unsigned __int128)(w ? w : 1) * (h ? h : 1);
        b += b / 2;
        return b >> 62 ? (1ull << 62) : (uint64_t)b;
    }
    unsigned fixed;
    uint64_t es = elem_bytes(format, &fixed);
    if (fixed) ch = fixed;
    unsigned __int128 v = (unsigned __int128)(w ? w : 1) * (h ? h : 1) * (d ? d : 1) * es * (ch ? ch : 1);
    return v >> 62 ? (1ull << 62) : (uint64_t)v;
}

EXPORT CUresult cuArrayCreate_v2(CUarray *arr, const CUDA_ARRAY_DESCRIPTOR *desc) {
    ENTER_OR(REAL(cuArrayCreate_v2)(arr, desc));
    if (!arr || !desc) return REAL(cuArrayCreate_v2)(arr, desc);
    ALLOC_BODY(REAL(cuArrayCreate_v2)(arr, desc), (uintptr_t)*arr,
               array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels), MAP_ARRAY);
}

EXPORT CUresult cuArray3DCreate_v2(CUarray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    ENTER_OR(REAL(cuArray3DCreate_v2)(arr, desc));
    if (!arr || !desc) return REAL(cuArray3DCreate_v2)(arr, desc);
    ALLOC_BODY(REAL(cuArray3DCreate_v2)(arr, desc), (uintptr_t)*arr,
               array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels), MAP_ARRAY);
}

/* the sum of the levels; a level halves each spatial extent (at least 1),
 * layers and cube faces are not spatial */
static uint64_t mipmap_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels) {
    int layered = (d->Flags & (ARRAY3D_LAYERED | ARRAY3D_CUBEMAP)) != 0;
    uint64_t total = 0;
    for (unsigned l = 0; l < (levels ? levels : 1) && l < 64; l++) {
        size_t w = d->Width >> l ? d->Width >> l : 1;
        size_t h = d->Height ? (d->Height >> l ? d->Height >> l : 1) : 0;
        size_t z = d->Depth;
        if (d->Depth && !layered) z = d->Depth >> l ? d->Depth >> l : 1;
        uint64_t b = array_bytes(w, h, z, d->Format, d->NumChannels);
        total = total + b < total ? (1ull << 62) : total + b;
    }
    return total;
}

EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *arr, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                       unsigned int levels) {
    ENTER_OR(REAL(cuMipmappedArrayCreate)(arr, desc, levels));
    if (!arr || !desc) return REAL(cuMipmappedArrayCreate)(arr, desc, levels);
    ALLOC_BODY(REAL(cuMipmappedArrayCreate)(arr, desc, levels), (uintptr_t)*arr, mipmap_bytes(desc, levels),
               MAP_ARRAY);
}

EXPORT CUresult cuArrayDestroy(CUarray arr) {
    ENTER_OR(REAL(cuArrayDestroy)(arr));
    FREE_BODY(MAP_ARRAY, arr, REAL(cuArrayDestroy)(arr));
}

EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray arr) {
    ENTER_OR(REAL(cuMipmappedArrayDestroy)(arr));
    FREE_BODY(MAP_ARRAY, arr, REAL(cuMipmappedArrayDestroy)(arr));
}


/* ---- graph memory nodes (issue 25, family 10): an allocation node holds
 * nothing itself; each graph instantiated from its graph holds the memory
 * (a real driver backs graph allocations per instantiated graph) from its
 * instantiation to its destruction. So the node's bytes are noted per graph
 * and device, charged at each instantiation before the driver's call (refused
 * over the cap), credited when that instantiated graph is destroyed. Sizes
 * are rounded up to 2 MiB (the driver's granularity for them: never less). */
#define GMEM_ALIGN (2ull << 20)
static uint64_t gmem_key(const void *h, int li) { return (uint64_t)(uintptr_t)h ^ ((uint64_t)li << 57); }

#define GUARD_REAL(name)                                             \
    if (!REAL(name) && vgpu_enter() != ST_ERROR && !REAL(name)) return CUDA_ERROR_NOT_FOUND

EXPORT CUresult cuGraphAddMemAllocNode(void **node, void *graph, const void *deps, size_t n,
                                       CUDA_MEM_ALLOC_NODE_PARAMS *p) {
    GUARD_REAL(cuGraphAddMemAllocNode);
    ENTER_OR(REAL(cuGraphAddMemAllocNode)(node, graph, deps, n, p));
    struct ldev *ld = NULL;
    if (p && p->poolProps.location.type == 1 /* CU_MEM_LOCATION_TYPE_DEVICE */)
        ld = ldev_for(p->poolProps.location.id);
    if (ld == LD_REFUSE) return refuse_dev("a graph memory allocation node");
    CUresult r = NESTED(REAL(cuGraphAddMemAllocNode)(node, graph, deps, n, p));
    if (r != CUDA_SUCCESS || !ld || !graph) return r;
    int li = (int)(ld - ldevs);
    uint64_t bytes = (p->bytesize + GMEM_ALIGN - 1) / GMEM_ALIGN * GMEM_ALIGN;
    if (bytes < p->bytesize) bytes = UINT64_MAX; /* wrapped: nothing can grant it */
    struct pm_ent ent;
    if (pm_take(MAP_GRAPH, gmem_key(graph, li), &ent)) bytes = sat_add(bytes, ent.size);
    pm_put(MAP_GRAPH, gmem_key(graph, li), bytes, ld->e);
    return r;
}

EXPORT CUresult cuGraphDestroy(void *graph) {
    GUARD_REAL(cuGraphDestroy);
    ENTER_OR(REAL(cuGraphDestroy)(graph));
    CUresult r = NESTED(REAL(cuGraphDestroy)(graph));
    if (r == CUDA_SUCCESS) {
        struct pm_ent ent;
        for (int li = 0; li < nldev; li++) pm_take(MAP_GRAPH, gmem_key(graph, li), &ent);
    }
    return r;
}

/* Charges what instantiating graph holds, per device, into got[]. 0, or -1
 * (refused over a cap: nothing stays charged). */
static int gexec_charge(void *graph, uint64_t *got) {
    for (int li = 0; li < nldev; li++) {
        struct pm_ent ent;
        got[li] = 0;
        if (!pm_take(MAP_GRAPH, gmem_key(graph, li), &ent)) continue;
        pm_put(MAP_GRAPH, gmem_key(graph, li), ent.size, ent.e);
        if (charge(&ldevs[li], ent.size) < 0) {
            for (int k = 0; k < li; k++)
                if (got[k]) credit(ldevs[k].e, got[k]);
            return -1;
        }
        got[li] = ent.size;
    }
    return 0;
}

static CUresult gexec_done(CUresult r, CUgraphExec *g, const uint64_t *got) {
    for (int li = 0; li < nldev; li++) {
        if (!got[li]) continue;
        if (r == CUDA_SUCCESS && g && *g) pm_put(MAP_GEXEC, gmem_key(*g, li), got[li], ldevs[li].e);
        else credit(ldevs[li].e, got[li]);
    }
    return r;
}

void gexec_release(CUgraphExec g) {
    if (__atomic_load_n(&g_state, __ATOMIC_ACQUIRE) != ST_ACTIVE) return;
    struct pm_ent ent;
    for (int li = 0; li < nldev; li++)
        if (pm_take(MAP_GEXEC, gmem_key(g, li), &ent)) credit(ent.e, ent.size);
}

#define INSTANTIATE(name, args, call)                                          \
    EXPORT CUresult name args {                                                \
        GUARD_REAL(name);                                                      \
        ENTER_OR(REAL(name) call);                                             \
        uint64_t got_[VGPU_LDEV_MAX];                                          \
        if (gexec_charge(graph, got_) < 0) return CUDA_ERROR_OUT_OF_MEMORY;    \
        return gexec_done(NESTED(REAL(name) call), g, got_);                   \
    }
INSTANTIATE(cuGraphInstantiate, (CUgraphExec *g, void *graph, void *errnode, char *log, size_t logsize),
            (g, graph, errnode, log, logsize))
INSTANTIATE(cuGraphInstantiate_v2, (CUgraphExec *g, void *graph, void *errnode, char *log, size_t logsize),
            (g, graph, errnode, log, logsize))
INSTANTIATE(cuGraphInstantiateWithFlags, (CUgraphExec *g, void *graph, unsigned long long flags), (g, graph, flags))
INSTANTIATE(cuGraphInstantiateWithParams, (CUgraphExec *g, void *graph, void *params), (g, graph, params))
