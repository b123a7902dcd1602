/* sm.c: the SM share: a token bucket per GPU, debited with device time
 * measured by CUDA events around each launch (see libvgpu/README.md). */
#include "internal.h"

/* ------------------------------------------------------------------ */
/* SM share: a token bucket per GPU in the accounting file, debited with  */
/* device time measured by CUDA events around each launch                 */

#define SM_BURST_NS 20000000ll /* at most 20 ms of device time banked */
#define SM_MAX_SLEEP_NS 100000000ll
#define SM_RING 64   /* timed launches in flight per process */
#define SM_POOL 32   /* spare events kept per context */
#define SM_NCTX 8    /* contexts with a pool */

static pthread_mutex_t tok_mu = PTHREAD_MUTEX_INITIALIZER; /* the slices (smloc) */

void sm_atfork_child(void) {
    pthread_mutex_t init = PTHREAD_MUTEX_INITIALIZER;
    tok_mu = init;
}

static unsigned sm_of(const struct ldev *ld) {
    unsigned pct = ld->sm, c2 = adv_sm_of((int)(ld - ldevs));
    if (c2 && (!pct || c2 < pct)) pct = c2;
    return pct >= 100 ? 0 : pct;
}

#define SM_BROKEN INT64_MIN /* the accounting file is unusable: gated launches are refused */
#define SM_SYNC_NS 2000000ull /* a process's slice of the bucket meets the file at least this often */

/* This process's slice of each device's bucket (tok_mu). A sync (the file's
 * lock, one read, one write) hands the slice and the charges since back to
 * the file's bucket, refills it, and takes all of its positive balance as the
 * new slice; between syncs launches are gated on the slice alone, with no
 * system call. Tokens are conserved (a slice is only ever moved, never
 * copied), so the container's share is as exact as with every launch going
 * to the file; a SIGKILLed process's slice is lost (its container only gets
 * less). Syncs: every SM_SYNC_NS, whenever the slice does not cover what a
 * launch needs, and (returning the slice) at context destruction and exit. */
struct smloc {
    int64_t tokens;            /* slice left: taken minus charged since */
    uint64_t busy_ns, launches; /* charges not yet in the file (statistics) */
    uint64_t sync_ns;          /* the last sync; 0 = none (sync at the next launch) */
};
static struct smloc smloc[VGPU_LDEV_MAX];

static int64_t sat_add64(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? (b > 0 ? INT64_MAX : INT64_MIN + 1) : r;
}

/* Meets the file's bucket (tok_mu held): returns the slice and the charges,
 * refills, and takes the positive balance when `take`. Returns the
 * container's tokens on the device, or SM_BROKEN when the accounting file
 * cannot be locked or is no longer in the layout (fail closed). */
static int64_t sm_sync(int li, unsigned pct, uint64_t now, int take) {
    const struct ldev *ld = &ldevs[li];
    struct smloc *L = &smloc[li];
    struct {
        struct vgpu_shm_hdr h;
        struct vgpu_shm_dev devs[VGPU_MAX_DEV];
    } img;
    L->sync_ns = 0; /* until this one succeeds */
    if (ld->ce < 0) return SM_BROKEN; /* no bucket for it in the file: fail closed */
    if (data_lock() != 0) return SM_BROKEN;
    if (cache_read(&img, sizeof img, 0) != 0 || !hdr_valid(&img.h)) {
        data_unlock();
        return SM_BROKEN;
    }
    struct vgpu_shm_dev *d = &img.devs[ld->ce];
    if (!d->last_ns || now < d->last_ns) {
        d->last_ns = now;
        d->tokens_ns = 0;
    }
    int64_t s = d->tokens_ns;
    if (pct) s = sat_add64(s, (int64_t)((now - d->last_ns) / 100 * pct));
    s = sat_add64(s, L->tokens);
    if (pct && s > SM_BURST_NS * (int64_t)pct / 100) s = SM_BURST_NS * (int64_t)pct / 100;
    if (s == SM_BROKEN) s++;
    int64_t slice = take && s > 0 ? s : 0;
    d->last_ns = now;
    d->tokens_ns = s - slice;
    d->busy_ns += L->busy_ns;
    d->launches += L->launches;
    int wr = cache_write(d, sizeof *d, DEVS_OFF + (size_t)ld->ce * sizeof *d);
    data_unlock();
    adv_sm_set(li, d->sm_pct);
    if (wr != 0) return SM_BROKEN; /* nothing moved: the slice and charges stay ours */
    L->tokens = slice;
    L->busy_ns = L->launches = 0;
    L->sync_ns = now ? now : 1;
    return s;
}

/* Debits ns of measured device time (0: none) from this process's slice;
 * returns the tokens a launch may count on, syncing with the file first when
 * the slice is stale or does not cover `need` (the estimated work this
 * process has in flight). SM_BROKEN: see sm_sync. */
static int64_t sm_account(const struct ldev *ld, unsigned pct, uint64_t ns, uint64_t nlaunch, int64_t need) {
    if (my_slot < 0) return 0;
    int li = (int)(ld - ldevs);
    struct smloc *L = &smloc[li];
    pthread_mutex_lock(&tok_mu);
    L->tokens = sat_add64(L->tokens, -(int64_t)(ns > (uint64_t)INT64_MAX ? INT64_MAX : ns));
    L->busy_ns += ns;
    L->launches += nlaunch;
    uint64_t now = now_ns();
    int64_t t = L->tokens;
    if (!L->sync_ns || now - L->sync_ns >= SM_SYNC_NS || t <= 0 || t - need < 0) t = sm_sync(li, pct, now, 1);
    pthread_mutex_unlock(&tok_mu);
    return t;
}

/* Hands every slice back to the file (context destruction, exit). */
void sm_return_all(void) {
    if (my_slot < 0) return;
    pthread_mutex_lock(&tok_mu);
    for (int i = 0; i < nldev; i++)
        if (smloc[i].sync_ns || smloc[i].launches) sm_sync(i, sm_of(&ldevs[i]), now_ns(), 0);
    pthread_mutex_unlock(&tok_mu);
}

/* The correction for time that is not the kernel's own. Between its events a
 * kernel's elapsed time also contains work of other contexts the GPU ran
 * meanwhile (time-slicing on a real GPU; on the simulated one, waiting for the
 * serialised device) and launch overhead: both only add. So per kernel
 * (function or graph) libvgpu keeps a floor: the smallest elapsed time seen,
 * relaxed upwards on each longer launch (by 1/64 of the excess, at most 1/256
 * of the floor) so that it follows a kernel that really got longer; a launch
 * is charged min(elapsed, floor). The floor is also the
 * estimate of a launch still in flight. Guarded by sm_mu. */
#define EST_SLOTS 256
static struct {
    uintptr_t key;
    uint64_t floor_ns;
} est_cache[EST_SLOTS];
static pthread_mutex_t sm_mu = PTHREAD_MUTEX_INITIALIZER;

static unsigned est_slot(uintptr_t key) { return (unsigned)((key >> 4) ^ (key >> 12)) & (EST_SLOTS - 1); }

static uint64_t device_time(uintptr_t key, uint64_t ns) {
    unsigned i = est_slot(key);
    if (est_cache[i].key != key || !est_cache[i].floor_ns) {
        est_cache[i].key = key;
        est_cache[i].floor_ns = ns;
        return ns;
    }
    uint64_t f = est_cache[i].floor_ns;
    if (ns <= f) {
        est_cache[i].floor_ns = ns;
        return ns;
    }
    /* creep up by 1/64 of the excess, at most 1/256 of the floor: jitter of
     * a few us does not lift it, a kernel that got longer is followed */
    uint64_t up = (ns - f) >> 6;
    est_cache[i].floor_ns = f + (up < (f >> 8) ? up : (f >> 8)) + 1;
    return f;
}

static uint64_t est_peek(uintptr_t key) {
    unsigned i = est_slot(key);
    return est_cache[i].key == key ? est_cache[i].floor_ns : 0;
}

/* the real event functions (helpers from libvgpu's own dlopen of libcuda) */
typedef CUresult (*ev_create_t)(CUevent *, unsigned);
typedef CUresult (*ev_record_t)(CUevent, CUstream);
typedef CUresult (*ev_one_t)(CUevent);
typedef CUresult (*ev_elapsed_t)(float *, CUevent, CUevent);
typedef CUresult (*ctx_cur_t)(CUcontext *);
typedef CUresult (*capturing_t)(CUstream, int *);
#define EV_CREATE HELP(cuEventCreate, ev_create_t)
#define EV_RECORD HELP(cuEventRecord, ev_record_t)
#define EV_QUERY HELP(cuEventQuery, ev_one_t)
#define EV_SYNC HELP(cuEventSynchronize, ev_one_t)
#define EV_ELAPSED HELP(cuEventElapsedTime, ev_elapsed_t)
#define EV_DESTROY HELP(cuEventDestroy_v2, ev_one_t)

static int events_usable(void) {
    return real_x[X_cuEventCreate] && real_x[X_cuEventRecord] && real_x[X_cuEventQuery] &&
           real_x[X_cuEventSynchronize] && real_x[X_cuEventElapsedTime] && real_x[X_cuEventDestroy_v2] &&
           real_x[X_cuCtxGetCurrent];
}

/* A timed launch in flight: start/end events around it on its stream. */
struct sm_rec {
    CUevent start, end;
    CUcontext ctx;
    uintptr_t key;
    uint64_t est;  /* its floor when launched (0 unknown) */
    int li;        /* ldevs index */
};
static struct sm_rec ring[SM_RING];   /* oldest at ring_head; sm_mu */
static unsigned ring_head, ring_n;
static uint64_t pend_est[VGPU_LDEV_MAX];
static unsigned pend_n[VGPU_LDEV_MAX], pend_unknown[VGPU_LDEV_MAX]; /* in flight; of which with no estimate */

/* spare events per context (created with default flags: timing enabled) */
static struct evpool {
    CUcontext ctx;
    unsigned n;
    CUevent ev[SM_POOL];
} pools[SM_NCTX];

static struct evpool *pool_of(CUcontext ctx, int create) {
    struct evpool *fr = NULL;
    for (int i = 0; i < SM_NCTX; i++) {
        if (pools[i].ctx == ctx) return &pools[i];
        if (!pools[i].ctx && !fr) fr = &pools[i];
    }
    if (!create || !fr) return NULL;
    fr->ctx = ctx;
    fr->n = 0;
    return fr;
}

/* sm_mu held; ctx is current */
static int ev_get(CUcontext ctx, CUevent *e) {
    struct evpool *p = pool_of(ctx, 1);
    if (p && p->n) {
        *e = p->ev[--p->n];
        return 0;
    }
    return EV_CREATE(e, 0) == CUDA_SUCCESS ? 0 : -1;
}

static void ev_put(CUcontext ctx, CUevent e) {
    struct evpool *p = pool_of(ctx, 0);
    if (p && p->n < SM_POOL) p->ev[p->n++] = e;
    else EV_DESTROY(e);
}

static struct sm_rec ring_pop(void) {
    struct sm_rec r = ring[ring_head];
    ring_head = (ring_head + 1) % SM_RING;
    ring_n--;
    pend_n[r.li]--;
    pend_est[r.li] -= r.est;
    pend_unknown[r.li] -= !r.est;
    return r;
}

/* A completed record: its device time into ch[] (sm_mu held). */
static void rec_charge(const struct sm_rec *r, CUresult q, uint64_t *ch, uint64_t *cnt) {
    float ms = 0;
    if (q == CUDA_SUCCESS && EV_ELAPSED(&ms, r->start, r->end) == CUDA_SUCCESS) {
        uint64_t ns = ms > 0 ? (uint64_t)((double)ms * 1e6) : 0;
        ch[r->li] += device_time(r->key, ns);
        cnt[r->li]++;
        ev_put(r->ctx, r->start);
        ev_put(r->ctx, r->end);
    }
    /* else the events are unusable (context gone?): dropped uncharged */
}

/* Charges completed launches, oldest first, up to the first one still
 * running (non-blocking: one cuEventQuery when nothing completed). sm_mu held. */
static void poll_locked(uint64_t *ch, uint64_t *cnt) {
    while (ring_n) {
        CUresult q = EV_QUERY(ring[ring_head].end);
        if (q == CUDA_ERROR_NOT_READY) break;
        struct sm_rec r = ring_pop();
        rec_charge(&r, q, ch, cnt);
    }
}

static void flush_charges(const uint64_t *ch, const uint64_t *cnt) {
    for (int i = 0; i < nldev; i++)
        if (cnt[i]) sm_account(&ldevs[i], sm_of(&ldevs[i]), ch[i], cnt[i], 0);
}

/* Waits for the oldest launch in flight and charges it. */
static void retire_oldest(void) {
    uint64_t ch[VGPU_LDEV_MAX] = {0}, cnt[VGPU_LDEV_MAX] = {0};
    pthread_mutex_lock(&sm_mu);
    if (!ring_n) {
        pthread_mutex_unlock(&sm_mu);
        return;
    }
    struct sm_rec r = ring_pop();
    pthread_mutex_unlock(&sm_mu);
    CUresult q = EV_SYNC(r.end); /* blocks until the GPU is past it */
    pthread_mutex_lock(&sm_mu);
    rec_charge(&r, q, ch, cnt);
    pthread_mutex_unlock(&sm_mu);
    flush_charges(ch, cnt);
}

/* Before a launch on an SM-limited device: charges completed launches, then
 * waits while the container is in debt. Work in flight is bounded: while the
 * ring is full, or the tokens do not cover the estimated work this process
 * has in flight on the device, or a launch of a kernel with no estimate yet
 * (never seen complete) is in flight, the oldest launch is waited for and
 * charged (so a process cannot queue work ahead of its budget); with nothing
 * in flight and the bucket negative, it sleeps until the bucket refills. */
static int sm_gate(const struct ldev *ld, unsigned pct) {
    int li = (int)(ld - ldevs);
    for (;;) {
        uint64_t ch[VGPU_LDEV_MAX] = {0}, cnt[VGPU_LDEV_MAX] = {0};
        pthread_mutex_lock(&sm_mu);
        poll_locked(ch, cnt);
        int full = ring_n >= SM_RING;
        unsigned np = pend_n[li], nu = pend_unknown[li];
        int64_t pe = (int64_t)pend_est[li];
        pthread_mutex_unlock(&sm_mu);
        for (int i = 0; i < nldev; i++)
            if (cnt[i] && i != li) sm_account(&ldevs[i], sm_of(&ldevs[i]), ch[i], cnt[i], 0);
        int64_t t = sm_account(ld, pct, ch[li], cnt[li], np ? pe : 0);
        if (t == SM_BROKEN) {
            static int told;
            if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
                vgpu_log(VGPU_LOG_ERROR, "%s: the accounting file %s is locked by another process or was "
                         "overwritten: launches under the SM limit are refused", ld->uuid, cfg.cache);
            return -1;
        }
        if (full || nu || (np && t - pe < 0)) {
            retire_oldest();
            continue;
        }
        if (t >= 0) return 0;
        int64_t wait = (t < -SM_MAX_SLEEP_NS ? SM_MAX_SLEEP_NS : -t) * 100 / (int64_t)pct;
        if (wait > SM_MAX_SLEEP_NS) wait = SM_MAX_SLEEP_NS;
        if (wait < 20000) wait = 20000;
        struct timespec ts = {wait / 1000000000, wait % 1000000000};
        nanosleep(&ts, NULL);
    }
}

/* One gated launch in progress. */
struct sm_launch {
    const struct ldev *ld;
    int timed;         /* events recorded: 1; fallback to the call's duration: 0 */
    struct sm_rec rec;
    uint64_t t0;
};

/* Before the real launch: gating, then the start event on the launch's
 * stream. 0 = ungated (no SM limit on this device), -1 = refused. */
static int sm_begin(struct sm_launch *L, CUstream s, uintptr_t key) {
    if (vgpu_enter() != ST_ACTIVE) return 0;
    const struct ldev *ld = cur_ldev();
    if (!ld) return 0;
    if (ld == LD_REFUSE) return cfg.sm_any && cfg.sm_any < 100 ? -1 : 0; /* unaccountable: fail closed */
    unsigned pct = sm_of(ld);
    if (!pct) return 0;
    if (sm_gate(ld, pct) != 0) return -1;
    L->ld = ld;
    L->timed = 0;
    L->t0 = 0;
    L->rec.key = key;
    if (!events_usable()) {
        L->t0 = now_ns(); /* no events: the call's duration (right for synchronous drivers only) */
        return 1;
    }
    int cap = 0;
    typedef CUresult (*capt_t)(CUstream, int *);
    if (real_x[X_cuStreamIsCapturing] && HELP(cuStreamIsCapturing, capt_t)(s, &cap) == CUDA_SUCCESS && cap)
        return 1; /* captured into a graph: nothing runs now, nothing to charge */
    CUcontext ctx = NULL;
    if (HELP(cuCtxGetCurrent, ctx_cur_t)(&ctx) != CUDA_SUCCESS || !ctx) return 1;
    struct sm_rec *r = &L->rec;
    r->ctx = ctx;
    r->key = key;
    r->li = (int)(ld - ldevs);
    pthread_mutex_lock(&sm_mu);
    int ok = ev_get(ctx, &r->start) == 0;
    if (ok && ev_get(ctx, &r->end) != 0) {
        ev_put(ctx, r->start);
        ok = 0;
    }
    r->est = est_peek(key);
    pthread_mutex_unlock(&sm_mu);
    if (!ok) return 1;
    if (EV_RECORD(r->start, s) != CUDA_SUCCESS) {
        pthread_mutex_lock(&sm_mu);
        ev_put(ctx, r->start);
        ev_put(ctx, r->end);
        pthread_mutex_unlock(&sm_mu);
        return 1;
    }
    L->timed = 1;
    return 1;
}

/* After the real launch: the end event, and the record into the ring. */
static void sm_end(struct sm_launch *L, CUstream s, CUresult lr) {
    struct sm_rec *r = &L->rec;
    if (!L->timed) {
        if (L->t0 && lr == CUDA_SUCCESS) {
            uint64_t ns = now_ns() - L->t0;
            pthread_mutex_lock(&sm_mu);
            ns = device_time(r->key, ns);
            pthread_mutex_unlock(&sm_mu);
            sm_account(L->ld, sm_of(L->ld), ns, 1, 0);
        }
        return;
    }
    if (lr != CUDA_SUCCESS || EV_RECORD(r->end, s) != CUDA_SUCCESS) {
        pthread_mutex_lock(&sm_mu);
        ev_put(r->ctx, r->start); /* re-recording reuses them */
        ev_put(r->ctx, r->end);
        pthread_mutex_unlock(&sm_mu);
        return;
    }
    for (;;) {
        pthread_mutex_lock(&sm_mu);
        if (ring_n < SM_RING) break;
        pthread_mutex_unlock(&sm_mu);
        retire_oldest(); /* other threads filled it meanwhile */
    }
    ring[(ring_head + ring_n) % SM_RING] = *r;
    ring_n++;
    pend_n[r->li]++;
    pend_est[r->li] += r->est;
    pend_unknown[r->li] += !r->est;
    pthread_mutex_unlock(&sm_mu);
}

/* Before a context is destroyed: its launches in flight are waited for and
 * charged, its spare events destroyed (they die with it). */
void sm_forget_ctx(CUcontext ctx) {
    if (!ctx || !any_sm || !events_usable()) return;
    uint64_t ch[VGPU_LDEV_MAX] = {0}, cnt[VGPU_LDEV_MAX] = {0};
    pthread_mutex_lock(&sm_mu);
    unsigned n = ring_n;
    for (unsigned k = 0; k < n; k++) {
        struct sm_rec r = ring_pop();
        if (r.ctx == ctx) {
            rec_charge(&r, EV_SYNC(r.end), ch, cnt);
        } else {
            ring[(ring_head + ring_n) % SM_RING] = r;
            ring_n++;
            pend_n[r.li]++;
            pend_est[r.li] += r.est;
            pend_unknown[r.li] += !r.est;
        }
    }
    struct evpool *p = pool_of(ctx, 0);
    if (p) {
        while (p->n) EV_DESTROY(p->ev[--p->n]);
        p->ctx = NULL;
    }
    pthread_mutex_unlock(&sm_mu);
    flush_charges(ch, cnt);
    sm_return_all();
}

/* What a floor is kept for: an estimate learnt on one launch prices only
 * launches of the same work. A kernel's key is its function with the launch's
 * shape (grid, block, shared memory); a graph's its exec handle. Both include
 * the epoch, bumped whenever a handle can start to mean other work (a graph
 * exec destroyed or updated, a node re-parameterised or toggled, a module or
 * library unloaded: the driver may hand the same handle value out again), so
 * no floor outlives what it was learnt on; records in flight keep their old
 * key and charge only it. */
static uint64_t est_epoch = 1;

static inline uint64_t mix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

static uintptr_t kern_key(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned shm) {
    uint64_t k = mix64((uint64_t)(uintptr_t)f ^ mix64(__atomic_load_n(&est_epoch, __ATOMIC_RELAXED)));
    k = mix64(k ^ ((uint64_t)gx << 32 | gy));
    k = mix64(k ^ ((uint64_t)gz << 32 | bx));
    k = mix64(k ^ ((uint64_t)by << 32 | bz));
    return (uintptr_t)mix64(k ^ shm);
}

static uintptr_t ex_key(CUfunction f, const CUlaunchConfig *c) {
    if (!c) return kern_key(f, 0, 0, 0, 0, 0, 0, 0);
    return kern_key(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
                    c->sharedMemBytes);
}

static uintptr_t graph_key(CUgraphExec g) {
    return (uintptr_t)mix64(mix64((uint64_t)(uintptr_t)g ^ 0x9e3779b97f4a7c15ull) ^
                            __atomic_load_n(&est_epoch, __ATOMIC_RELAXED));
}

/* Calls after which a handle may mean other work: the epoch moves first. */
#define EPOCH_HOOK(name, args, call)                                      \
    EXPORT CUresult name args {                                         \
        __atomic_add_fetch(&est_epoch, 1, __ATOMIC_RELAXED);            \
        if (!REAL(name) && vgpu_enter() != ST_ERROR && !REAL(name))     \
            return CUDA_ERROR_NOT_FOUND;                                \
        CUresult r = REAL(name) call;                                   \
        __atomic_add_fetch(&est_epoch, 1, __ATOMIC_RELAXED);            \
        return r;                                                       \
    }
EPOCH_HOOK(cuGraphExecDestroy, (CUgraphExec g), (g))
EPOCH_HOOK(cuModuleUnload, (CUmodule m), (m))
EPOCH_HOOK(cuLibraryUnload, (void *l), (l))
EPOCH_HOOK(cuGraphExecUpdate, (CUgraphExec g, void *graph, void *node, void *res), (g, graph, node, res))
EPOCH_HOOK(cuGraphExecUpdate_v2, (CUgraphExec g, void *graph, void *info), (g, graph, info))
EPOCH_HOOK(cuGraphExecKernelNodeSetParams, (CUgraphExec g, void *node, const void *p), (g, node, p))
EPOCH_HOOK(cuGraphExecKernelNodeSetParams_v2, (CUgraphExec g, void *node, const void *p), (g, node, p))
EPOCH_HOOK(cuGraphExecNodeSetParams, (CUgraphExec g, void *node, void *p), (g, node, p))
EPOCH_HOOK(cuGraphExecChildGraphNodeSetParams, (CUgraphExec g, void *node, void *child), (g, node, child))
EPOCH_HOOK(cuGraphNodeSetEnabled, (CUgraphExec g, void *node, unsigned on), (g, node, on))

/* The launch wrappers. No SM limit anywhere: a tail call to the driver.
 * `strm` is the stream the launch goes to (for _ptsz variants, NULL means
 * the per-thread default stream). */
#define LAUNCH(name, key, strm, args, call)                                   \
    EXPORT CUresult name args {                                         \
        if (LIKELY(__atomic_load_n(&g_launch_fast, __ATOMIC_RELAXED)))  \
            return REAL(name) call;                                     \
        if (!REAL(name) && vgpu_enter() != ST_ERROR && !REAL(name))     \
            return CUDA_ERROR_NOT_FOUND;                                \
        if (vgpu_nested) return REAL(name) call;                        \
        if (vgpu_enter() == ST_ERROR) return CUDA_ERROR_NOT_INITIALIZED; \
        struct sm_launch L;                                             \
        CUstream s_ = (strm);                                           \
        int g_ = sm_begin(&L, s_, (uintptr_t)(key));                   \
        if (g_ < 0) return CUDA_ERROR_NOT_PERMITTED;                    \
        if (!g_) return NESTED(REAL(name) call);                        \
        CUresult r = NESTED(REAL(name) call);                           \
        sm_end(&L, s_, r);                                              \
        return r;                                                       \
    }

#define PTSZ(s) ((s) ? (s) : CU_STREAM_PER_THREAD)
LAUNCH(cuLaunchKernel, kern_key(f, gx, gy, gz, bx, by, bz, shm_), s,
       (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_,
        CUstream s, void **params, void **extra),
       (f, gx, gy, gz, bx, by, bz, shm_, s, params, extra))
LAUNCH(cuLaunchKernel_ptsz, kern_key(f, gx, gy, gz, bx, by, bz, shm_), PTSZ(s),
       (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_,
        CUstream s, void **params, void **extra),
       (f, gx, gy, gz, bx, by, bz, shm_, s, params, extra))
LAUNCH(cuLaunchKernelEx, ex_key(f, c), c ? c->hStream : NULL, (const CUlaunchConfig *c, CUfunction f, void **params, void **extra),
       (c, f, params, extra))
LAUNCH(cuLaunchKernelEx_ptsz, ex_key(f, c), PTSZ(c ? c->hStream : NULL),
       (const CUlaunchConfig *c, CUfunction f, void **params, void **extra), (c, f, params, extra))
LAUNCH(cuLaunchCooperativeKernel, kern_key(f, gx, gy, gz, bx, by, bz, shm_), s,
       (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_,
        CUstream s, void **params),
       (f, gx, gy, gz, bx, by, bz, shm_, s, params))
LAUNCH(cuLaunchCooperativeKernel_ptsz, kern_key(f, gx, gy, gz, bx, by, bz, shm_), PTSZ(s),
       (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm_,
        CUstream s, void **params),
       (f, gx, gy, gz, bx, by, bz, shm_, s, params))
LAUNCH(cuGraphLaunch, graph_key(g), s, (CUgraphExec g, CUstream s), (g, s))
LAUNCH(cuGraphLaunch_ptsz, graph_key(g), PTSZ(s), (CUgraphExec g, CUstream s), (g, s))

