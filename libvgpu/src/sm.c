/* sm.c: the SM share: a token bucket per GPU, debited with device time
 * measured by CUDA events around each launch (see libvgpu/README.md). */
#include "internal.h"

#include <signal.h>

/* ------------------------------------------------------------------ */
/* SM share: a token bucket per GPU in the accounting file, debited with  */
/* device time measured by CUDA events around each launch                 */

#define SM_BURST_NS 20000000ll /* at most 20 ms of device time banked */
#define SM_MAX_SLEEP_NS 100000000ll
#define SM_RING 64   /* timed launches in flight per process */
#define SM_POOL 32   /* spare events kept per context */
#define SM_NCTX 8    /* contexts with a pool */

static pthread_mutex_t tok_mu = PTHREAD_MUTEX_INITIALIZER; /* the buckets (smloc) */
static pthread_mutex_t sm_mu = PTHREAD_MUTEX_INITIALIZER;  /* estimates, the ring, event pools */
static __thread uint64_t rng_s __attribute__((tls_model("initial-exec"))); /* the sampling draw */
/* Part of every estimate's key (see kern_key): moves when a handle may mean
 * other work, and starts from a secret random value, so that nobody can
 * compute two shapes whose keys collide (a small launch pricing a big one). */
static uint64_t est_epoch = 1;
static uint64_t key_mul[5] = {0x9e3779b97f4a7c15ull, 0xbf58476d1ce4e5b9ull, 0x94d049bb133111ebull,
                              0xff51afd7ed558ccdull, 0xc4ceb9fe1a85ec53ull}; /* secret odd multipliers */


static unsigned sm_of(const struct ldev *ld) {
    unsigned pct = ld->sm, c2 = adv_sm_of((int)(ld - ldevs));
    if (c2 && (!pct || c2 < pct)) pct = c2;
    return pct >= 100 ? 0 : pct;
}

#define SM_BROKEN INT64_MIN /* the share cannot be established: gated launches are refused */
#define SM_SYNC_NS 2000000ull /* the split of the share is re-counted at least this often */
#define SM_STATS_NS 500000000ull /* statistics reach the accounting file at most this often (and at exit) */

/* Each process's bucket is its own: it earns the process's part of the
 * container's share — the share divided by the container's processes
 * launching on the device, counted from the presence markers in the kernel's
 * lock table (ledger.c, shm.h) — holds at most that part of 20 ms, and is
 * debited with the device time of the process's kernels. Nothing a container
 * process can write is read to gate a launch: the accounting file only
 * receives statistics, and a lock anybody adds only counts as one more
 * process, a smaller part for each. A new process starts with an empty
 * bucket (it earns before it spends), so starting processes gains nothing.
 * The count is renewed every SM_SYNC_NS; a process that stops launching stops
 * counting within three epochs (300 ms: a helper thread renews, at an epoch's
 * start, the marker of a device launched on in the epoch that ended).
 *
 * `tokens` is debited without a lock by the fast path (sm_fast: a launch
 * charged its shape's estimate); everything else (refill, corrections,
 * counting) happens under tok_mu, with atomic operations on `tokens`. */
struct smloc {
    int64_t tokens;             /* device time this process may use now (atomic) */
    uint64_t last_ns;           /* the last refill; 0 = not started */
    uint64_t rate_ppm;          /* its part of the GPU, parts per million */
    uint64_t sync_ns;           /* the last count (atomic; read by the fast path); 0 = count at the next launch */
    uint64_t stats_ns;          /* the last statistics update */
    int64_t stats_tokens;       /* tokens at the last statistics update */
    uint64_t earned;            /* tokens earned since then (busy = stats_tokens + earned - tokens) */
    uint64_t launches;          /* launches not yet in the file (statistics) */
    uint64_t pub_debt;          /* the debt last published in this process's slot (slot_debt_publish) */
    uint64_t pres_until;        /* the end of the epoch its presence marker is on (atomic; read by the fast path) */
    int active;                 /* the fast path charged a launch since the last epoch's start (atomic) */
};
static struct smloc smloc[VGPU_LDEV_MAX];

static int64_t tok_get(struct smloc *L) { return __atomic_load_n(&L->tokens, __ATOMIC_RELAXED); }
static void tok_add(struct smloc *L, int64_t d) { __atomic_add_fetch(&L->tokens, d, __ATOMIC_RELAXED); }

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
    int64_t t = tok_get(L), busy = L->stats_tokens + (int64_t)L->earned - t;
    if (ld->ce < 0 || data_lock() != 0) return;
    if (cache_read(&img, sizeof img, 0) == 0 && hdr_valid(&img.h)) {
        struct vgpu_shm_dev *d = &img.devs[ld->ce];
        d->busy_ns += busy > 0 ? (uint64_t)busy : 0;
        if (d->sm_debt_ns) {
            /* exited processes' debt: this process takes it over (it repays
             * it from its own part; a slot freed later hands it on again) */
            int64_t take = (int64_t)(d->sm_debt_ns > VGPU_SM_DEBT_MAX_NS ? VGPU_SM_DEBT_MAX_NS : d->sm_debt_ns);
            tok_add(L, -take);
            t -= take;
            L->stats_tokens -= take; /* not this process's busy time */
            d->sm_debt_ns = 0;
            vgpu_log(VGPU_LOG_DEBUG, "%s: took over %lld ns of SM debt from exited processes", ld->uuid,
                     (long long)take);
        }
        uint64_t n = __atomic_exchange_n(&L->launches, 0, __ATOMIC_RELAXED);
        d->launches += n;
        d->last_ns = now;
        if (cache_write(d, sizeof *d, DEVS_OFF + (size_t)ld->ce * sizeof *d) == 0) {
            L->stats_tokens = t;
            L->earned = 0;
        } else {
            __atomic_add_fetch(&L->launches, n, __ATOMIC_RELAXED);
        }
        adv_sm_set(li, d->sm_pct); /* only ever tightens (sm_of) */
    }
    data_unlock();
    uint64_t owe = t < 0 ? (uint64_t)-t : 0;
    if (owe != L->pub_debt && L->pub_debt != UINT64_MAX && slot_debt_publish(ld->ce, owe) == 0) L->pub_debt = owe;
}

/* Publishes the process's debt on li when it grew past what its slot says
 * (tok_mu held): were the process to end now, without its destructor, the
 * next one still repays it. Cheap when nothing grew (no system call). */
static void sm_owe(int li, int64_t t) {
    struct smloc *L = &smloc[li];
    if (t >= 0 || (uint64_t)-t <= L->pub_debt) return;
    if (slot_debt_publish(ldevs[li].ce, (uint64_t)-t) == 0) L->pub_debt = (uint64_t)-t;
}

/* The process's presence marker is on `epoch` (its lock taken): the fast path
 * may go on without renewing it until that epoch ends. */
static void pres_on(struct smloc *L, uint64_t epoch) {
    __atomic_store_n(&L->pres_until, (epoch + 1) * (uint64_t)VGPU_SM_PRES_EPOCH_NS, __ATOMIC_RELAXED);
}

/* Markers renewed ahead (issue 38): at the start of each epoch a helper thread
 * moves the marker of every device the fast path charged a launch on during
 * the epoch that just ended, so that a program launching in bursts finds its
 * marker current and its first launch after an idle gap makes no lock-table
 * calls (they were most of what a burst of 10 after 10 ms idle cost). Only
 * ever more presence, never less: the fast path still reads the clock and
 * renews a lapsed marker itself (a late or missing helper costs time, not the
 * share), and a process that stops launching is counted one epoch longer
 * (stops counting within three epochs, <= 300 ms: its neighbours' parts are
 * smaller meanwhile, never larger). */
static uint64_t n_ahead; /* markers renewed by the helper (atomic) */

static void *pres_ahead(void *arg) {
    (void)arg;
    for (;;) {
        uint64_t next = (now_ns() / VGPU_SM_PRES_EPOCH_NS + 1) * (uint64_t)VGPU_SM_PRES_EPOCH_NS;
        struct timespec ts = {(time_t)(next / 1000000000ull), (long)(next % 1000000000ull)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
        }
        uint64_t epoch = now_ns() / VGPU_SM_PRES_EPOCH_NS;
        for (int li = 0; li < VGPU_LDEV_MAX; li++) {
            struct smloc *L = &smloc[li];
            if (!__atomic_exchange_n(&L->active, 0, __ATOMIC_RELAXED)) continue;
            pthread_mutex_lock(&tok_mu);
            if (__atomic_load_n(&L->sync_ns, __ATOMIC_RELAXED) &&
                __atomic_load_n(&L->pres_until, __ATOMIC_RELAXED) <= epoch * (uint64_t)VGPU_SM_PRES_EPOCH_NS &&
                ledger_presence(ldevs[li].e, epoch) == 0) {
                pres_on(L, epoch);
                __atomic_add_fetch(&n_ahead, 1, __ATOMIC_RELAXED);
            }
            pthread_mutex_unlock(&tok_mu);
        }
    }
    return NULL;
}

static void pres_ahead_create(void) {
    sigset_t all, old;
    pthread_t t;
    pthread_attr_t a;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the application's signals are never delivered to it */
    if (pthread_attr_init(&a) == 0) {
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&a, 64 * 1024);
        if (pthread_create(&t, &a, pres_ahead, NULL) != 0)
            vgpu_log(VGPU_LOG_DEBUG, "sm: no helper thread; launches renew their presence markers themselves");
        pthread_attr_destroy(&a);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static pthread_once_t pres_ahead_once = PTHREAD_ONCE_INIT;
/* At the first count (tok_mu held: the helper takes it only after it was created). A
 * forked child never starts one (its SM-limited launches are refused). */
static void pres_ahead_start(void) { pthread_once(&pres_ahead_once, pres_ahead_create); }

/* Re-counts the container's launching processes on the device (tok_mu
 * held): this process's marker renewed, the others' counted, its part of the
 * share set. 0, or SM_BROKEN when the lock table cannot be used (fail closed). */
static int64_t sm_sync(int li, unsigned pct, uint64_t now) {
    const struct ldev *ld = &ldevs[li];
    struct smloc *L = &smloc[li];
    uint64_t epoch = now / VGPU_SM_PRES_EPOCH_NS;
    unsigned others = 0;
    __atomic_store_n(&L->sync_ns, 0, __ATOMIC_RELAXED); /* until this one succeeds */
    if (ledger_presence(ld->e, epoch) != 0 || ledger_presence_census(ld->e, epoch, &others) != 0) return SM_BROKEN;
    L->rate_ppm = (uint64_t)pct * 10000 / (others + 1);
    pres_on(L, epoch);
    pres_ahead_start();
    if (!L->last_ns) L->last_ns = now;
    if (now - L->stats_ns >= SM_STATS_NS) sm_stats(li, now);
    __atomic_store_n(&L->sync_ns, now ? now : 1, __ATOMIC_RELEASE);
    return 0;
}

/* The bucket earns its part of the wall time since the last refill, up to
 * its burst (tok_mu held; the fast path may debit meanwhile). */
static void sm_refill(struct smloc *L, uint64_t now) {
    if (!L->last_ns || now <= L->last_ns) return;
    unsigned __int128 add = (unsigned __int128)(now - L->last_ns) * L->rate_ppm / 1000000;
    int64_t burst = (int64_t)(SM_BURST_NS * L->rate_ppm / 1000000);
    int64_t a = add > (unsigned __int128)INT64_MAX / 2 ? INT64_MAX / 2 : (int64_t)add;
    int64_t t = tok_get(L);
    for (;;) {
        int64_t n = t > burst - a ? (t > burst ? t : burst) : t + a;
        if (__atomic_compare_exchange_n(&L->tokens, &t, n, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            L->earned += (uint64_t)(n - t);
            break;
        }
    }
    L->last_ns = now;
}

/* Debits `corr` ns of device time (negative: credits an over-estimate),
 * counts `nlaunch` launches, re-counts the split when due, refills; returns
 * the tokens. SM_BROKEN: see sm_sync. */
static int64_t sm_account(const struct ldev *ld, unsigned pct, int64_t corr, uint64_t nlaunch) {
    if (my_slot < 0) return 0;
    int li = (int)(ld - ldevs);
    struct smloc *L = &smloc[li];
    pthread_mutex_lock(&tok_mu);
    if (corr) tok_add(L, -corr);
    if (nlaunch) __atomic_add_fetch(&L->launches, nlaunch, __ATOMIC_RELAXED);
    uint64_t now = now_ns(), sy = __atomic_load_n(&L->sync_ns, __ATOMIC_RELAXED);
    int64_t t = 0;
    if (!sy || now - sy >= SM_SYNC_NS) t = sm_sync(li, pct, now);
    if (t != SM_BROKEN) {
        sm_refill(L, now);
        t = tok_get(L);
        sm_owe(li, t);
    }
    pthread_mutex_unlock(&tok_mu);
    return t;
}

/* A launch of unknown cost begins (start: 1) or has been charged (0): the
 * slot says "in flight since now" — a process that ends meanwhile owes the
 * time since — then the debt as it is. */
static void sm_unknown_mark(int li, int start) {
    struct smloc *L = &smloc[li];
    pthread_mutex_lock(&tok_mu);
    if (start) {
        if (slot_debt_publish(ldevs[li].ce, VGPU_SM_DEBT_INFLIGHT | now_ns()) == 0) L->pub_debt = UINT64_MAX;
    } else {
        int64_t t = tok_get(L);
        uint64_t owe = t < 0 ? (uint64_t)-t : 0;
        if (slot_debt_publish(ldevs[li].ce, owe) == 0) L->pub_debt = owe;
    }
    pthread_mutex_unlock(&tok_mu);
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
        if (smloc[i].stats_ns || __atomic_load_n(&smloc[i].launches, __ATOMIC_RELAXED)) sm_stats(i, now_ns());
    pthread_mutex_unlock(&tok_mu);
}

/* The estimate per launch shape, and the correction for time that is not the
 * kernel's own. Between its events a kernel's elapsed time also contains work
 * of other contexts the GPU ran meanwhile (time-slicing on a real GPU; on the
 * simulated one, waiting for the serialised device) and launch overhead: both
 * only add. So per key (function and shape, or graph) libvgpu keeps a floor:
 * the smallest elapsed time seen, relaxed upwards on each longer one (by 1/64
 * of the excess, at most 1/256 of the floor, per launch the sample stands for)
 * so that it follows a kernel that really got longer; a timed launch is
 * charged min(elapsed, floor), and an untimed one the floor.
 *
 * Read without a lock by the fast path (key checked before and after, so a
 * torn entry is never used); written under sm_mu. */
#define EST_SLOTS 256
static struct est {
    uintptr_t key;
    uint64_t floor1; /* what an untimed launch is charged (its price) + 1; 0 = none yet */
    uint64_t thr;    /* the fast path times a launch when its 32-bit draw is below this (sm_sample_thr) */
    uint64_t count;  /* untimed launches since (racy: a weight, and statistics) */
    uint64_t nsamp;  /* timed launches of the key so far */
    uint64_t lo;     /* the floor: the smallest elapsed time, relaxed upwards (sm_mu) */
    uint64_t mean;   /* the samples' running mean (sm_mu) */
} est_cache[EST_SLOTS];

/* The chance that a launch of a key is timed, as a 32-bit threshold on the
 * fast path's random draw: high at first (a half, halving every 4 samples:
 * a new key's runs are measured closely, so a program that makes its first
 * runs cheap is caught early), then as low as the timing's cost allows — a
 * timed launch costs two event records and the slow path (~3 us on the
 * simulator, more on a GPU), so a key is timed about as often as keeps that
 * cost near 1/64 of its own device time, between 1 in 16 and 1 in 1024. The
 * draw is random per launch, independent of time and of bursts: a program
 * cannot tell in advance which launch is timed, and the first launch after an
 * idle gap is no likelier than any other. A dispersed key (device_time) is
 * timed as often as that cost allows, without the 1 in 16 ceiling: its untimed
 * launches are charged its samples' mean, whose error is what a program mixing
 * cheap and expensive runs gains, and more samples shrink it (a 20/4000 us mix
 * under a 25 % limit reached 29 % with the ceiling, issue 38). */
#define SM_TIME_COST_NS 4000ull
static uint64_t sm_sample_thr(uint64_t est, uint64_t nsamp, int dispersed) {
    uint64_t want = est >= (1ull << 30) ? (1ull << 32) : (est << 32) / (est + 64 * SM_TIME_COST_NS);
    if (!dispersed && want > (1ull << 32) / 16) want = (1ull << 32) / 16;
    if (want < (1ull << 32) / 1024) want = (1ull << 32) / 1024;
    uint64_t early = nsamp / 4 >= 31 ? 0 : (1ull << 31) >> (nsamp / 4);
    return want > early ? want : early;
}

static unsigned est_slot(uintptr_t key) { return (unsigned)((key >> 4) ^ (key >> 12)) & (EST_SLOTS - 1); }

/* The coarse clock (vDSO, ~4 ns; a tick of 1-4 ms): staleness and "is a
 * re-count due" on the fast path. It lags CLOCK_MONOTONIC by at most a tick. */
static inline uint64_t coarse_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A completed timed launch of `key` took ns (sm_mu held): its charge, and
 * the key's price for its untimed launches. Between its events a kernel's
 * elapsed time also holds what the GPU ran for others meanwhile (time-slicing;
 * on the simulator, waiting for the serialised device) and launch overhead:
 * both only add. So per key libvgpu keeps a floor — the smallest elapsed time,
 * relaxed upwards on each longer one (by 1/64 of the excess, at most 1/256 of
 * the floor, per launch the sample stands for) so that it follows a kernel
 * that really got longer — and prices launches at the floor, timed ones at
 * min(elapsed, floor): time behind neighbours is not charged (what separates
 * a 30/70 split cleanly). But a floor alone could be steered: one kernel
 * launched alternately cheap and expensive was charged near its cheap cost.
 * So the samples' running mean (1/8 per sample) is kept too, and a key whose
 * mean passes 1.5 times its floor — more than waiting behind neighbours adds
 * on the simulator's tests — is *dispersed*: its timed launches are charged
 * their whole elapsed time and its untimed ones the mean, until its mean comes
 * back under. A program can gain at most that factor by mixing runs of one
 * shape. A dispersed key is sampled as often as timing's cost allows
 * (sm_sample_thr), not on every launch: the draw is random, so the mean of its
 * samples is that of its runs, and the cost rule keeps a small kernel whose
 * elapsed times are noisy (time-slicing, a loaded host) at its usual rate,
 * while a long one is timed nearly always (two event records on a launch of
 * milliseconds).
 * w: untimed launches of the key since its previous timed one. */
static uint64_t device_time(uintptr_t key, uint64_t ns, uint64_t w) {
    struct est *e = &est_cache[est_slot(key)];
    uint64_t f1 = __atomic_load_n(&e->floor1, __ATOMIC_RELAXED);
    if (e->key != key || !f1) {
        __atomic_store_n(&e->key, 0, __ATOMIC_RELEASE); /* readers see no half-written entry */
        __atomic_store_n(&e->floor1, ns + 1, __ATOMIC_RELAXED);
        __atomic_store_n(&e->count, 0, __ATOMIC_RELAXED);
        e->nsamp = 1;
        e->lo = e->mean = ns;
        __atomic_store_n(&e->thr, sm_sample_thr(ns, 1, 0), __ATOMIC_RELAXED);
        __atomic_store_n(&e->key, key, __ATOMIC_RELEASE);
        return ns;
    }
    uint64_t f = e->lo, charge = ns < f ? ns : f, n = ++e->nsamp;
    if (ns <= f) {
        f = ns;
    } else {
        /* creep up by 1/64 of the excess, at most 1/256 of the floor, per
         * launch this sample stands for; never past the sample itself */
        if (w < 1) w = 1;
        if (w > 256) w = 256;
        uint64_t ex = ns - f, up = (ex >> 6) * w, lim = (f >> 8) * w;
        if (up > lim) up = lim;
        if (up >= ex) up = ex - 1;
        f += up;
    }
    e->lo = f;
    e->mean = ns >= e->mean ? e->mean + (ns - e->mean + 7) / 8 : e->mean - (e->mean - ns) / 8;
    int dispersed = e->mean * 2 > f * 3;
    uint64_t price = dispersed ? e->mean : f;
    __atomic_store_n(&e->floor1, price + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&e->thr, sm_sample_thr(price, n, dispersed), __ATOMIC_RELAXED);
    return dispersed ? ns : charge;
}

/* The key's floor (0 unknown), and its weight taken (sm_mu held). */
static uint64_t est_take(uintptr_t key, uint64_t *w) {
    struct est *e = &est_cache[est_slot(key)];
    if (e->key != key) return *w = 0, 0;
    *w = __atomic_exchange_n(&e->count, 0, __ATOMIC_RELAXED);
    uint64_t f1 = __atomic_load_n(&e->floor1, __ATOMIC_RELAXED);
    return f1 ? f1 - 1 : 0;
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
    uint64_t est;  /* what it was charged at launch: its floor then (0 unknown) */
    uint64_t w;    /* untimed launches of its key it stands for */
    int li;        /* ldevs index */
};
static struct sm_rec ring[SM_RING];   /* oldest at ring_head; sm_mu */
static uint64_t n_timed, n_untimed;   /* launches timed; untimed as of their key's last sample (sm_mu) */
static uint64_t n_gated, n_renewed;   /* untimed launches that took the slow path; markers renewed alone (atomic) */
static unsigned ring_head, ring_n;
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

static void ring_push(const struct sm_rec *r) {
    ring[(ring_head + ring_n) % SM_RING] = *r;
    ring_n++;
    pend_n[r->li]++;
    pend_unknown[r->li] += !r->est;
}

static struct sm_rec ring_pop(void) {
    struct sm_rec r = ring[ring_head];
    ring_head = (ring_head + 1) % SM_RING;
    ring_n--;
    pend_n[r.li]--;
    pend_unknown[r.li] -= !r.est;
    return r;
}

/* A completed record: the difference between its device time and what it
 * was charged at launch into ch[] (sm_mu held). The sample also corrects
 * the estimate that prices the untimed launches of its key. */
static void rec_charge(const struct sm_rec *r, CUresult q, int64_t *ch, uint64_t *cnt) {
    float ms = 0;
    if (q == CUDA_SUCCESS && EV_ELAPSED(&ms, r->start, r->end) == CUDA_SUCCESS) {
        uint64_t ns = ms > 0 ? (uint64_t)((double)ms * 1e6) : 0;
        ch[r->li] += (int64_t)device_time(r->key, ns, r->w) - (int64_t)r->est;
        cnt[r->li] += r->w;
        n_untimed += r->w;
        ev_put(r->ctx, r->start);
        ev_put(r->ctx, r->end);
    }
    /* else the events are unusable (context gone?): dropped, charged its estimate */
}

/* Charges completed launches, oldest first, up to the first one still
 * running (non-blocking: one cuEventQuery when nothing completed). sm_mu held. */
static void poll_locked(int64_t *ch, uint64_t *cnt) {
    while (ring_n) {
        CUresult q = EV_QUERY(ring[ring_head].end);
        if (q == CUDA_ERROR_NOT_READY) break;
        struct sm_rec r = ring_pop();
        rec_charge(&r, q, ch, cnt);
    }
}

static void flush_charges(const int64_t *ch, const uint64_t *cnt) {
    for (int i = 0; i < nldev; i++)
        if (cnt[i] || ch[i]) sm_account(&ldevs[i], sm_of(&ldevs[i]), ch[i], cnt[i]);
}

/* Waits for the oldest launch in flight and charges it. */
static void retire_oldest(void) {
    int64_t ch[VGPU_LDEV_MAX] = {0};
    uint64_t cnt[VGPU_LDEV_MAX] = {0};
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

/* Before a timed launch on an SM-limited device: charges completed launches,
 * then waits while the process is in debt. Every launch is charged its
 * estimate when it is made, so a process can queue at most its bucket's worth
 * of work ahead of the GPU; while the ring is full, or a launch of a kernel
 * with no estimate yet (never seen complete) is in flight, or the bucket is
 * negative with timed launches in flight, the oldest is waited for and charged;
 * with nothing in flight and the bucket negative, it sleeps until it refills. */
static int sm_gate(const struct ldev *ld, unsigned pct) {
    int li = (int)(ld - ldevs);
    if (UNLIKELY(!vgpu_wipe_ok)) vgpu_fork_check(); /* no wiped state page: the pid decides */
    if (UNLIKELY(my_slot < 0)) {
        /* a forked child of a process that attached (or a launch after exit
         * began): it has no part of the share; fail closed */
        static int told;
        if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
            vgpu_log(VGPU_LOG_ERROR, "%s: a forked child of a process using the GPU: launches under the SM limit are "
                     "refused", ld->uuid);
        return -1;
    }
    for (;;) {
        int64_t ch[VGPU_LDEV_MAX] = {0};
        uint64_t cnt[VGPU_LDEV_MAX] = {0};
        pthread_mutex_lock(&sm_mu);
        poll_locked(ch, cnt);
        int full = ring_n >= SM_RING;
        unsigned np = pend_n[li], nu = pend_unknown[li];
        pthread_mutex_unlock(&sm_mu);
        for (int i = 0; i < nldev; i++)
            if ((cnt[i] || ch[i]) && i != li) sm_account(&ldevs[i], sm_of(&ldevs[i]), ch[i], cnt[i]);
        int64_t t = sm_account(ld, pct, ch[li], cnt[li]);
        if (t == SM_BROKEN) {
            static int told;
            if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
                vgpu_log(VGPU_LOG_ERROR, "%s: the container's share cannot be counted (ledger %s): launches "
                         "under the SM limit are refused", ld->uuid, cfg.limits_file[0] ? cfg.limits_file : cfg.cache);
            return -1;
        }
        if (full || nu || (np && t < 0)) {
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

/* ---- the fast path: most launches are charged their shape's estimate ---- */

/* Which launches are timed: the first of a key (waited for: its cost is
 * unknown), then each at random by the per-thread draw (sm_sample_thr). */

static uint64_t rng_seed(void) {
    uint64_t s = 0;
    if (syscall(SYS_getrandom, &s, sizeof s, 0x1 /* GRND_NONBLOCK */) != (long)sizeof s || !s) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        s = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)syscall(SYS_gettid) << 40) ^
            (uint64_t)(uintptr_t)&s;
    }
    return s | 1;
}

static inline uint64_t rng_next(void) {
    uint64_t x = rng_s;
    if (UNLIKELY(!x)) x = rng_seed();
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_s = x;
    return x * 0x2545f4914f6cdd1dull;
}

/* Whether s is capturing into a graph (or cannot be told: treated as capturing,
 * so the launch takes the timed path, which asks again). Out of line: only
 * processes that ever began a capture call it. */
static __attribute__((noinline)) int sm_capturing(CUstream s) {
    int cap = 0;
    typedef CUresult (*capt_t)(CUstream, int *);
    return !real_x[X_cuStreamIsCapturing] || HELP(cuStreamIsCapturing, capt_t)(s, &cap) != CUDA_SUCCESS || cap;
}

static int sm_fast_ok;   /* events usable: launches may go untimed */
static int sm_capture;   /* a stream capture was begun in this process (sticky) */

/* The fast path found its presence marker on an ended epoch: the marker alone
 * moves to the current one (two lock-table calls, no re-count, statistics or
 * refill: those wait for the slow path, which runs when the tokens run out or
 * a launch is timed). Once an epoch (100 ms) at most, so a program launching
 * in bursts with idle gaps between them does not pay a whole slow path
 * (~7 us on this VM) per epoch. 0, or -1: the slow path decides (tok_mu busy,
 * no count yet, the lock table refused). */
static __attribute__((noinline, cold)) int sm_renew(const struct ldev *ld) {
    struct smloc *L = &smloc[ld - ldevs];
    if (pthread_mutex_trylock(&tok_mu) != 0) return -1;
    int rc = -1;
    uint64_t now = now_ns(), epoch = now / VGPU_SM_PRES_EPOCH_NS;
    if (__atomic_load_n(&L->sync_ns, __ATOMIC_RELAXED) && ledger_presence(ld->e, epoch) == 0) {
        pres_on(L, epoch);
        __atomic_add_fetch(&n_renewed, 1, __ATOMIC_RELAXED);
        rc = 0;
    }
    pthread_mutex_unlock(&tok_mu);
    return rc;
}

/* What the fast path decided: SMF_DONE, the launch was charged its key's
 * estimate and goes untimed (no lock, no driver call); SMF_GATE, it goes
 * untimed too, but the bucket does not cover it or a re-count is due (the
 * gate waits, then charges *est); SMF_TIME, it is timed (slow path). */
enum { SMF_NONE = -1, SMF_TIME, SMF_DONE, SMF_GATE };

struct smf {
    int f;       /* SMF_* */
    int64_t est; /* the estimate charged (SMF_DONE) or to charge (SMF_GATE) */
};
static inline __attribute__((always_inline)) struct smf sm_fast(const struct ldev *ld, CUstream s, uintptr_t key) {
    struct smf r = {SMF_TIME, 0};
    if (!__atomic_load_n(&sm_fast_ok, __ATOMIC_RELAXED)) return r;
    struct smloc *L = &smloc[ld - ldevs];
    uint64_t now = coarse_ns();
    struct est *e = &est_cache[est_slot(key)];
    uintptr_t k = __atomic_load_n(&e->key, __ATOMIC_ACQUIRE);
    uint64_t f1 = __atomic_load_n(&e->floor1, __ATOMIC_RELAXED), thr = __atomic_load_n(&e->thr, __ATOMIC_RELAXED);
    if (k != key || !f1 || __atomic_load_n(&e->key, __ATOMIC_ACQUIRE) != key) return r;
    if ((rng_next() >> 32) < thr) return r; /* timed: random, unpredictable (sm_sample_thr) */
    if (UNLIKELY(__atomic_load_n(&sm_capture, __ATOMIC_RELAXED)) && sm_capturing(s)) return r;
    __atomic_store_n(&e->count, __atomic_load_n(&e->count, __ATOMIC_RELAXED) + 1, __ATOMIC_RELAXED);
    r.est = (int64_t)(f1 - 1);
    r.f = SMF_GATE;
    /* Its presence marker must be on the current epoch (the others count it):
     * renewed by the slow path's re-count, or here alone when an epoch ended
     * (sm_renew: no re-count). A stale count of the split does not matter
     * here: the fast path only spends tokens already earned; refills, and the
     * re-count at their rate, are the slow path's. */
    uint64_t sy = __atomic_load_n(&L->sync_ns, __ATOMIC_ACQUIRE);
    if (!sy) return r;
    if (UNLIKELY(now >= __atomic_load_n(&L->pres_until, __ATOMIC_RELAXED)) && sm_renew(ld) != 0) return r;
    if (__atomic_sub_fetch(&L->tokens, r.est, __ATOMIC_RELAXED) < 0) {
        tok_add(L, r.est); /* in debt: the gate waits */
        return r;
    }
    if (!__atomic_load_n(&L->active, __ATOMIC_RELAXED)) __atomic_store_n(&L->active, 1, __ATOMIC_RELAXED);
    r.f = SMF_DONE;
    return r;
}

/* A forked child (ledger_forked_child): nothing of its parent's bucket,
 * launches in flight or events (they are the parent's); with no slot, its
 * SM-limited launches are refused at the gate. */
void sm_atfork_child(void) {
    pthread_mutex_t init = PTHREAD_MUTEX_INITIALIZER;
    tok_mu = init;
    sm_mu = init;
    rng_s = 0; /* reseeded: a child does not repeat its parent's draws */
    __atomic_add_fetch(&vgpu_ctx_gen, 1, __ATOMIC_RELAXED); /* no context survives fork */
    memset(smloc, 0, sizeof smloc);
    memset(pools, 0, sizeof pools);
    memset(pend_n, 0, sizeof pend_n);
    memset(pend_unknown, 0, sizeof pend_unknown);
    ring_head = ring_n = 0;
    sm_fast_ok = 0; /* every launch takes the gate */
}

/* One gated launch in progress. */
struct sm_launch {
    const struct ldev *ld;
    int timed;         /* events recorded: 1; fallback to the call's duration: 0 */
    struct sm_rec rec;
    uint64_t t0;
};

/* Before the real launch on an SM-limited device: the fast path, else
 * gating, then the start event on the launch's stream. 0 = go ahead untimed
 * (charged its estimate), -1 = refused, 1 = call sm_end after it. */
/* The device a launch goes to if it has an SM limit (its share in *pct);
 * NULL: ungated; LD_REFUSE: refused (a device libvgpu cannot account for). */
static inline const struct ldev *sm_target(int st, unsigned *pct) {
    if (UNLIKELY(st != ST_ACTIVE)) return NULL; /* st: the caller's vgpu_enter() (one state load a launch) */
    const struct ldev *ld = cur_ldev_launch();
    if (UNLIKELY(!ld)) return NULL;
    if (UNLIKELY(ld == LD_REFUSE)) return cfg.sm_any && cfg.sm_any < 100 ? LD_REFUSE : NULL; /* unaccountable: fail closed */
    *pct = sm_of(ld);
    return *pct ? ld : NULL;
}

static int sm_begin(struct sm_launch *L, const struct ldev *ld, unsigned pct, CUstream s, uintptr_t key,
                    struct smf fr) {
    if (fr.f == SMF_NONE) fr = sm_fast(ld, s, key); /* else the wrapper's own try (its draw stands) */
    if (LIKELY(fr.f == SMF_DONE)) return 0;
    if (sm_gate(ld, pct) != 0) return -1;
    if (fr.f == SMF_GATE) {
        __atomic_add_fetch(&n_gated, 1, __ATOMIC_RELAXED);
        tok_add(&smloc[ld - ldevs], -fr.est); /* untimed: charged its estimate */
        return 0;
    }
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
    r->est = est_take(key, &r->w);
    n_timed++;
    pthread_mutex_unlock(&sm_mu);
    static int seeded;
    if (!__atomic_load_n(&seeded, __ATOMIC_RELAXED) && !__atomic_exchange_n(&seeded, 1, __ATOMIC_RELAXED)) {
        for (int i = 0; i < 5; i++) __atomic_store_n(&key_mul[i], rng_seed() | 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&est_epoch, rng_seed() << 1, __ATOMIC_RELAXED); /* this key stays unknown: timed */
    }
    if (!__atomic_load_n(&sm_fast_ok, __ATOMIC_RELAXED)) __atomic_store_n(&sm_fast_ok, 1, __ATOMIC_RELAXED);
    tok_add(&smloc[r->li], -(int64_t)r->est); /* charged its estimate now, corrected when it completes */
    __atomic_add_fetch(&smloc[r->li].launches, 1, __ATOMIC_RELAXED);
    if (!ok) return 1;
    if (!r->est) { /* unknown cost: waited for in sm_end */
        sm_unknown_mark(r->li, 1);
        L->t0 = now_ns();
    }
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
            ns = device_time(r->key, ns, 1);
            pthread_mutex_unlock(&sm_mu);
            sm_account(L->ld, sm_of(L->ld), (int64_t)ns, 0);
        }
        int li = (int)(L->ld - ldevs);
        if (__atomic_load_n(&smloc[li].pub_debt, __ATOMIC_RELAXED) == UINT64_MAX) sm_unknown_mark(li, 0);
        return;
    }
    if (lr != CUDA_SUCCESS || EV_RECORD(r->end, s) != CUDA_SUCCESS) {
        if (lr != CUDA_SUCCESS) tok_add(&smloc[r->li], (int64_t)r->est); /* nothing ran */
        pthread_mutex_lock(&sm_mu);
        ev_put(r->ctx, r->start); /* re-recording reuses them */
        ev_put(r->ctx, r->end);
        pthread_mutex_unlock(&sm_mu);
        if (!r->est) sm_unknown_mark(r->li, 0);
        return;
    }
    if (!r->est) {
        /* a launch of unknown cost is never free: waited for and charged
         * before the call returns (and published: the process may end next) */
        int64_t ch[VGPU_LDEV_MAX] = {0};
        uint64_t cnt[VGPU_LDEV_MAX] = {0};
        CUresult q = EV_SYNC(r->end);
        pthread_mutex_lock(&sm_mu);
        rec_charge(r, q, ch, cnt);
        pthread_mutex_unlock(&sm_mu);
        flush_charges(ch, cnt);
        if (q != CUDA_SUCCESS) /* not timed by its events: the time it was waited for */
            sm_account(L->ld, sm_of(L->ld), (int64_t)(now_ns() - L->t0), 0);
        sm_unknown_mark(r->li, 0);
        return;
    }
    for (;;) {
        pthread_mutex_lock(&sm_mu);
        if (ring_n < SM_RING) break;
        pthread_mutex_unlock(&sm_mu);
        retire_oldest(); /* other threads filled it meanwhile */
    }
    ring_push(r);
    pthread_mutex_unlock(&sm_mu);
}

/* At exit (debug log): how many launches were timed. */
void sm_exit_report(void) {
    if (!any_sm) return;
    pthread_mutex_lock(&sm_mu);
    uint64_t t = n_timed, u = n_untimed;
    pthread_mutex_unlock(&sm_mu);
    vgpu_log(VGPU_LOG_DEBUG, "sm: %llu launches timed, %llu charged their estimate; %llu untimed launches took the "
             "slow path, %llu presence markers were renewed alone, %llu ahead by the helper thread",
             (unsigned long long)t, (unsigned long long)u, (unsigned long long)__atomic_load_n(&n_gated, __ATOMIC_RELAXED),
             (unsigned long long)__atomic_load_n(&n_renewed, __ATOMIC_RELAXED),
             (unsigned long long)__atomic_load_n(&n_ahead, __ATOMIC_RELAXED));
}

/* Before a context is destroyed: its launches in flight are waited for and
 * charged, its spare events destroyed (they die with it). */
void sm_forget_ctx(CUcontext ctx) {
    if (!ctx || !any_sm || !events_usable()) return;
    int64_t ch[VGPU_LDEV_MAX] = {0};
    uint64_t cnt[VGPU_LDEV_MAX] = {0};
    pthread_mutex_lock(&sm_mu);
    unsigned n = ring_n;
    for (unsigned k = 0; k < n; k++) {
        struct sm_rec r = ring_pop();
        if (r.ctx == ctx) rec_charge(&r, EV_SYNC(r.end), ch, cnt);
        else ring_push(&r);
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

/* Stream capture: launches into a capturing stream run nothing (the graph is
 * charged when launched). Once any capture begins, the fast path asks the
 * driver about each launch's stream. */
#define CAPTURE_HOOK(name, args, call)                                  \
    EXPORT CUresult name args {                                         \
        __atomic_store_n(&sm_capture, 1, __ATOMIC_RELAXED);             \
        if (!REAL(name) && vgpu_enter() != ST_ERROR && !REAL(name))     \
            return CUDA_ERROR_NOT_FOUND;                                \
        return REAL(name) call;                                         \
    }
CAPTURE_HOOK(cuStreamBeginCapture, (CUstream s), (s))
CAPTURE_HOOK(cuStreamBeginCapture_ptsz, (CUstream s), (s))
CAPTURE_HOOK(cuStreamBeginCapture_v2, (CUstream s, int mode), (s, mode))
CAPTURE_HOOK(cuStreamBeginCapture_v2_ptsz, (CUstream s, int mode), (s, mode))
CAPTURE_HOOK(cuStreamBeginCaptureToGraph, (CUstream s, void *g, const void *deps, const void *data, size_t n, int mode),
             (s, g, deps, data, n, mode))
CAPTURE_HOOK(cuStreamBeginCaptureToGraph_ptsz,
             (CUstream s, void *g, const void *deps, const void *data, size_t n, int mode), (s, g, deps, data, n, mode))

/* What a floor is kept for: an estimate learnt on one launch prices only
 * launches of the same work. A kernel's key is its function with the launch's
 * shape (grid, block, shared memory); a graph's its exec handle. Both include
 * the epoch, bumped whenever a handle can start to mean other work (a graph
 * exec destroyed or updated, a node re-parameterised or toggled, a module or
 * library unloaded: the driver may hand the same handle value out again), so
 * no floor outlives what it was learnt on; records in flight keep their old
 * key and charge only it. */
static inline uint64_t mix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

static inline uint64_t rotl64(uint64_t x, int r) { return x << r | x >> (64 - r); }

/* Each field times its own secret odd multiplier (independent multiplies:
 * a few ns, this runs on every SM-limited launch), folded, then mixed. */
static uintptr_t kern_key(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned shm) {
    uint64_t a = ((uint64_t)(uintptr_t)f ^ __atomic_load_n(&est_epoch, __ATOMIC_RELAXED)) *
                 __atomic_load_n(&key_mul[0], __ATOMIC_RELAXED);
    uint64_t b = ((uint64_t)gx << 32 | gy) * __atomic_load_n(&key_mul[1], __ATOMIC_RELAXED);
    uint64_t c = ((uint64_t)gz << 32 | bx) * __atomic_load_n(&key_mul[2], __ATOMIC_RELAXED);
    uint64_t d = ((uint64_t)by << 32 | bz) * __atomic_load_n(&key_mul[3], __ATOMIC_RELAXED);
    uint64_t e = ((uint64_t)shm + 1) * __atomic_load_n(&key_mul[4], __ATOMIC_RELAXED);
    return (uintptr_t)mix64(a ^ rotl64(b, 13) ^ rotl64(c, 29) ^ rotl64(d, 43) ^ rotl64(e, 53));
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
/* an instantiated graph destroyed: its epoch moves, its graph allocations are credited */
EXPORT CUresult cuGraphExecDestroy(CUgraphExec g) {
    __atomic_add_fetch(&est_epoch, 1, __ATOMIC_RELAXED);
    if (!REAL(cuGraphExecDestroy) && vgpu_enter() != ST_ERROR && !REAL(cuGraphExecDestroy)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGraphExecDestroy)(g);
    __atomic_add_fetch(&est_epoch, 1, __ATOMIC_RELAXED);
    if (r == CUDA_SUCCESS && !vgpu_nested) gexec_release(g);
    return r;
}
/* the legacy launches' block shape and shared memory are the function's
 * state: a change makes every key new (a small shape never prices a big one) */
EPOCH_HOOK(cuFuncSetBlockShape, (CUfunction f, int x, int y, int z), (f, x, y, z))
EPOCH_HOOK(cuFuncSetSharedSize, (CUfunction f, unsigned bytes), (f, bytes))
EPOCH_HOOK(cuModuleUnload, (CUmodule m), (m))
EPOCH_HOOK(cuLibraryUnload, (void *l), (l))
EPOCH_HOOK(cuGraphExecUpdate, (CUgraphExec g, void *graph, void *node, void *res), (g, graph, node, res))
EPOCH_HOOK(cuGraphExecUpdate_v2, (CUgraphExec g, void *graph, void *info), (g, graph, info))
EPOCH_HOOK(cuGraphExecKernelNodeSetParams, (CUgraphExec g, void *node, const void *p), (g, node, p))
EPOCH_HOOK(cuGraphExecKernelNodeSetParams_v2, (CUgraphExec g, void *node, const void *p), (g, node, p))
EPOCH_HOOK(cuGraphExecNodeSetParams, (CUgraphExec g, void *node, void *p), (g, node, p))
EPOCH_HOOK(cuGraphExecChildGraphNodeSetParams, (CUgraphExec g, void *node, void *child), (g, node, child))
EPOCH_HOOK(cuGraphNodeSetEnabled, (CUgraphExec g, void *node, unsigned on), (g, node, on))

/* How each launch entry point's real function behaves, learnt by its slow
 * path: LD_UNKNOWN until a call of it succeeds; LD_DIRECT when that call
 * re-entered no launch wrapper; LD_REENTERS (sticky) once one did — a driver
 * whose launches call each other through the PLT, as the simulated
 * cuLaunchKernelEx calls cuLaunchKernel. Only an LD_DIRECT entry point's fast
 * path calls the driver without NESTED, which lets that call be a tail call
 * (no frame of ours around the driver: ~8 ns a launch on the simulator,
 * whose launch makes system calls, after which the return into a frame of
 * ours is mispredicted). Should a driver re-enter only sometimes, an inner
 * launch that runs unguarded is gated and charged on its own — more charged,
 * never less — until a slow-path call sees it and the entry point is
 * LD_REENTERS for good. */
enum { LD_UNKNOWN, LD_DIRECT, LD_REENTERS };
static unsigned char launch_kind[H_NCUDA];
static __thread int launch_reentered __attribute__((tls_model("initial-exec")));

static inline void launch_learn(int h, CUresult r) {
    if (launch_reentered) {
        __atomic_store_n(&launch_kind[h], LD_REENTERS, __ATOMIC_RELAXED);
    } else if (r == CUDA_SUCCESS && __atomic_load_n(&launch_kind[h], __ATOMIC_RELAXED) == LD_UNKNOWN) {
        unsigned char u = LD_UNKNOWN;
        __atomic_compare_exchange_n(&launch_kind[h], &u, LD_DIRECT, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
}

/* a real launch from the slow path: guarded, and whether it re-entered learnt */
#define LNESTED(h, expr)                                                  \
    ({                                                                  \
        launch_reentered = 0;                                           \
        vgpu_nested++;                                                  \
        CUresult r__ = (expr);                                          \
        vgpu_nested--;                                                  \
        launch_learn(h, r__);                                           \
        r__;                                                            \
    })

/* The launch wrappers. No SM limit anywhere: a tail call to the driver.
 * Otherwise the fast path (an LD_DIRECT entry point, not nested, attached):
 * a launch on a device without an SM limit, or one sm_fast charged its
 * estimate, is a tail call to the driver; anything else goes to the slow
 * path (name_slow) with what was found, so a launch the random draw picked
 * for timing is timed. `strm` is the stream the launch goes to (for _ptsz
 * variants, NULL means the per-thread default stream). */
#define WITH_FR(...) (__VA_ARGS__, struct smf fr_)
#define PASS_FR(...) (__VA_ARGS__, fr_)
#define LAUNCH(name, key, strm, args, call)                   \
    static __attribute__((noinline)) CUresult name##_slow WITH_FR args; \
    EXPORT CUresult name args {                                         \
        if (LIKELY(__atomic_load_n(&g_launch_fast, __ATOMIC_RELAXED)))  \
            return REAL(name) call;                                     \
        struct smf fr_ = {SMF_NONE, 0};                                 \
        if (LIKELY(__atomic_load_n(&launch_kind[H_##name], __ATOMIC_RELAXED) == LD_DIRECT && \
                   !vgpu_nested &&                                      \
                   __atomic_load_n(&g_state, __ATOMIC_ACQUIRE) == ST_ACTIVE)) { \
            unsigned pct_ = 0;                                          \
            const struct ldev *ld_ = sm_target(ST_ACTIVE, &pct_);       \
            if (!ld_) return REAL(name) call;                           \
            if (LIKELY(ld_ != LD_REFUSE)) {                             \
                fr_ = sm_fast(ld_, (strm), (uintptr_t)(key));           \
                if (LIKELY(fr_.f == SMF_DONE)) return REAL(name) call;  \
            }                                                           \
        }                                                               \
        return name##_slow PASS_FR call;                                \
    }                                                                   \
    static CUresult name##_slow WITH_FR args {                          \
        if (!REAL(name) && vgpu_enter() != ST_ERROR && !REAL(name))     \
            return CUDA_ERROR_NOT_FOUND;                                \
        if (UNLIKELY(vgpu_nested)) {                                    \
            launch_reentered = 1;                                       \
            return REAL(name) call;                                     \
        }                                                               \
        int st_ = vgpu_enter();                                         \
        if (UNLIKELY(st_ == ST_ERROR)) return CUDA_ERROR_NOT_INITIALIZED; \
        unsigned pct_ = 0;                                              \
        const struct ldev *ld_ = sm_target(st_, &pct_);                 \
        if (UNLIKELY(!ld_)) return LNESTED(H_##name, REAL(name) call);  \
        if (UNLIKELY(ld_ == LD_REFUSE)) return CUDA_ERROR_NOT_PERMITTED; \
        struct sm_launch L;                                             \
        CUstream s_ = (strm);                                           \
        int g_ = sm_begin(&L, ld_, pct_, s_, (uintptr_t)(key), fr_);    \
        if (UNLIKELY(g_ < 0)) return CUDA_ERROR_NOT_PERMITTED;          \
        if (LIKELY(!g_)) return LNESTED(H_##name, REAL(name) call);     \
        CUresult r = LNESTED(H_##name, REAL(name) call);                \
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

/* The legacy launches (a grid of w x h blocks of the function's block shape,
 * set by cuFuncSetBlockShape: an epoch hook above). Their keys carry a block
 * of 0, which no cuLaunchKernel has. */
LAUNCH(cuLaunch, kern_key(f, 1, 1, 1, 0, 0, 0, 0), NULL, (CUfunction f), (f))
LAUNCH(cuLaunchGrid, kern_key(f, (unsigned)w, (unsigned)h, 1, 0, 0, 0, 0), NULL, (CUfunction f, int w, int h),
       (f, w, h))
LAUNCH(cuLaunchGridAsync, kern_key(f, (unsigned)w, (unsigned)h, 1, 0, 0, 0, 0), s,
       (CUfunction f, int w, int h, CUstream s), (f, w, h, s))

/* The device of a stream's context (NULL stream: the current context's);
 * NULL: let the driver refuse; LD_REFUSE: cannot tell (fail closed). */
static const struct ldev *stream_ldev(CUstream s) {
    if (!s || s == CU_STREAM_PER_THREAD || s == (CUstream)(uintptr_t)1 /* legacy */) return cur_ldev();
    typedef CUresult (*sctx_t)(CUstream, CUcontext *);
    typedef CUresult (*push_t)(CUcontext);
    typedef CUresult (*pop_t)(CUcontext *);
    typedef CUresult (*getdev_t)(CUdevice *);
    CUcontext c = NULL, popped;
    CUdevice d;
    if (!real_x[X_cuStreamGetCtx] || !real_x[X_cuCtxPushCurrent_v2] || !real_x[X_cuCtxPopCurrent_v2])
        return LD_REFUSE;
    if (HELP(cuStreamGetCtx, sctx_t)(s, &c) != CUDA_SUCCESS || !c) return NULL;
    if (HELP(cuCtxPushCurrent_v2, push_t)(c) != CUDA_SUCCESS) return LD_REFUSE;
    CUresult r = HELP(cuCtxGetDevice, getdev_t)(&d);
    HELP(cuCtxPopCurrent_v2, pop_t)(&popped);
    return r == CUDA_SUCCESS ? ldev_for(d) : LD_REFUSE;
}

/* Several devices' launches in one call: each entry is gated and charged on
 * its stream's device as a launch of its own (events on its stream). */
EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *list, unsigned n, unsigned flags) {
    if (!REAL(cuLaunchCooperativeKernelMultiDevice) && vgpu_enter() != ST_ERROR &&
        !REAL(cuLaunchCooperativeKernelMultiDevice))
        return CUDA_ERROR_NOT_FOUND;
    if (__atomic_load_n(&g_launch_fast, __ATOMIC_RELAXED) || vgpu_nested)
        return REAL(cuLaunchCooperativeKernelMultiDevice)(list, n, flags);
    int st = vgpu_enter();
    if (st == ST_ERROR) return CUDA_ERROR_NOT_INITIALIZED;
    if (st != ST_ACTIVE || !list || !n) return NESTED(REAL(cuLaunchCooperativeKernelMultiDevice)(list, n, flags));
    if (n > VGPU_LDEV_MAX) return CUDA_ERROR_NOT_PERMITTED; /* more devices than libvgpu accounts for */
    struct sm_launch L[VGPU_LDEV_MAX];
    int go[VGPU_LDEV_MAX];
    for (unsigned i = 0; i < n; i++) {
        const CUDA_LAUNCH_PARAMS *p = &list[i];
        const struct ldev *ld = stream_ldev(p->hStream);
        unsigned pct = ld && ld != LD_REFUSE ? sm_of(ld) : 0;
        go[i] = 0;
        if (ld == LD_REFUSE && cfg.sm_any && cfg.sm_any < 100) go[i] = -1;
        else if (pct)
            go[i] = sm_begin(&L[i], ld, pct, p->hStream,
                             kern_key(p->function, p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX, p->blockDimY,
                                      p->blockDimZ, p->sharedMemBytes),
                             (struct smf){SMF_NONE, 0});
        if (go[i] < 0) { /* refused: the entries gated so far ran nothing */
            for (unsigned k = 0; k < i; k++)
                if (go[k] > 0) sm_end(&L[k], list[k].hStream, CUDA_ERROR_NOT_PERMITTED);
            return CUDA_ERROR_NOT_PERMITTED;
        }
    }
    CUresult r = NESTED(REAL(cuLaunchCooperativeKernelMultiDevice)(list, n, flags));
    for (unsigned i = 0; i < n; i++)
        if (go[i] > 0) sm_end(&L[i], list[i].hStream, r);
    return r;
}
