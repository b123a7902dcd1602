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

#define SM_BROKEN INT64_MIN /* the share cannot be established: gated launches are refused */
#define SM_SYNC_NS 2000000ull /* the split of the share is re-counted at least this often */
#define SM_STATS_NS 50000000ull /* statistics reach the accounting file at least this often */

/* Each process's bucket is its own (tok_mu): it earns the process's part of
 * the container's share — the share divided by the container's processes
 * launching on the device, counted from the presence markers in the kernel's
 * lock table (ledger.c, shm.h) — holds at most that part of 20 ms, and is
 * debited with the device time of the process's kernels. Nothing a container
 * process can write is read to gate a launch: the accounting file only
 * receives statistics, and a lock anybody adds only counts as one more
 * process, a smaller part for each. A new process starts with an empty
 * bucket (it earns before it spends), so starting processes gains nothing.
 * The count is renewed every SM_SYNC_NS; a process that stops launching stops
 * counting within two epochs (200 ms). */
struct smloc {
    int64_t tokens;             /* device time this process may use now */
    uint64_t last_ns;           /* the last refill; 0 = not started */
    uint64_t rate_ppm;          /* its part of the GPU, parts per million */
    uint64_t busy_ns, launches; /* charges not yet in the file (statistics) */
    uint64_t sync_ns;           /* the last count; 0 = none (count at the next launch) */
    uint64_t stats_ns;          /* the last statistics update */
};
static struct smloc smloc[VGPU_LDEV_MAX];

static int64_t sat_add64(int64_t a, int64_t b) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? (b > 0 ? INT64_MAX : INT64_MIN + 1) : r;
}

/* Statistics (and the container's advisory SM share) with the accounting
 * file: best effort, never gating anything. tok_mu held. */
static void sm_stats(int li, uint64_t now) {
    const struct ldev *ld = &ldevs[li];
    struct smloc *L = &smloc[li];
    struct {
        struct vgpu_shm_hdr h;
        struct vgpu_shm_dev devs[VGPU_MAX_DEV];
    } img;
    L->stats_ns = now;
    if (ld->ce < 0 || data_lock() != 0) return;
    if (cache_read(&img, sizeof img, 0) == 0 && hdr_valid(&img.h)) {
        struct vgpu_shm_dev *d = &img.devs[ld->ce];
        d->busy_ns += L->busy_ns;
        d->launches += L->launches;
        d->last_ns = now;
        if (cache_write(d, sizeof *d, DEVS_OFF + (size_t)ld->ce * sizeof *d) == 0) L->busy_ns = L->launches = 0;
        adv_sm_set(li, d->sm_pct); /* only ever tightens (sm_of) */
    }
    data_unlock();
}

/* Re-counts the container's launching processes on the device (tok_mu
 * held): this process's marker renewed, the others' counted, its part of the
 * share set. 0, or SM_BROKEN when the lock table cannot be used (fail closed). */
static int64_t sm_sync(int li, unsigned pct, uint64_t now) {
    const struct ldev *ld = &ldevs[li];
    struct smloc *L = &smloc[li];
    uint64_t epoch = now / VGPU_SM_PRES_EPOCH_NS;
    unsigned others = 0;
    L->sync_ns = 0; /* until this one succeeds */
    if (ledger_presence(ld->e, epoch) != 0 || ledger_presence_census(ld->e, epoch, &others) != 0) return SM_BROKEN;
    L->rate_ppm = (uint64_t)pct * 10000 / (others + 1);
    if (!L->last_ns) L->last_ns = now;
    if (now - L->stats_ns >= SM_STATS_NS) sm_stats(li, now);
    L->sync_ns = now ? now : 1;
    return 0;
}

/* The bucket earns its part of the wall time since the last refill. */
static void sm_refill(struct smloc *L, uint64_t now) {
    if (!L->last_ns || now <= L->last_ns) return;
    unsigned __int128 add = (unsigned __int128)(now - L->last_ns) * L->rate_ppm / 1000000;
    int64_t burst = (int64_t)(SM_BURST_NS * L->rate_ppm / 1000000);
    L->tokens = sat_add64(L->tokens, add > INT64_MAX ? INT64_MAX : (int64_t)add);
    if (L->tokens > burst) L->tokens = burst;
    L->last_ns = now;
}

/* Debits ns of measured device time (0: none) from this process's bucket;
 * returns the tokens a launch may count on (`need`, the estimated work in
 * flight, is the caller's to compare). SM_BROKEN: see sm_sync. */
static int64_t sm_account(const struct ldev *ld, unsigned pct, uint64_t ns, uint64_t nlaunch, int64_t need) {
    (void)need;
    if (my_slot < 0) return 0;
    int li = (int)(ld - ldevs);
    struct smloc *L = &smloc[li];
    pthread_mutex_lock(&tok_mu);
    L->tokens = sat_add64(L->tokens, -(int64_t)(ns > (uint64_t)INT64_MAX ? INT64_MAX : ns));
    L->busy_ns += ns;
    L->launches += nlaunch;
    uint64_t now = now_ns();
    int64_t t = 0;
    if (!L->sync_ns || now - L->sync_ns >= SM_SYNC_NS) t = sm_sync(li, pct, now);
    if (t != SM_BROKEN) {
        sm_refill(L, now);
        t = L->tokens;
    }
    pthread_mutex_unlock(&tok_mu);
    return t;
}

/* This process's part of the GPU, parts per million (for the gate's sleep). */
static uint64_t sm_rate(int li) {
    pthread_mutex_lock(&tok_mu);
    uint64_t r = smloc[li].rate_ppm;
    pthread_mutex_unlock(&tok_mu);
    return r ? r : 1;
}

/* Statistics to the file (context destruction, exit). */
void sm_return_all(void) {
    if (my_slot < 0) return;
    pthread_mutex_lock(&tok_mu);
    for (int i = 0; i < nldev; i++)
        if (smloc[i].busy_ns || smloc[i].launches) sm_stats(i, now_ns());
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
                vgpu_log(VGPU_LOG_ERROR, "%s: the container's share cannot be counted (ledger %s): launches "
                         "under the SM limit are refused", ld->uuid, cfg.limits_file[0] ? cfg.limits_file : cfg.cache);
            return -1;
        }
        if (full || nu || (np && t - pe < 0)) {
            retire_oldest();
            continue;
        }
        if (t >= 0) return 0;
        int64_t wait = (int64_t)((uint64_t)(t < -SM_MAX_SLEEP_NS ? SM_MAX_SLEEP_NS : -t) * 1000000 / sm_rate(li));
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

