/* ledger.c: GPU memory: the lock ledger (see libvgpu/README.md). */
#include "internal.h"

/* ------------------------------------------------------------------ */
/* the lock ledger: GPU memory                                          */
/* Each process's usage is private; what it may use is published as a   */
/* lease, an OFD read lock whose length is the bytes leased (shm.h for   */
/* the geometry). The kernel's lock table cannot be written by files,    */
/* a lock cannot be removed by another process, and it vanishes with its */
/* holder. Leases grow only under flock(LOCK_EX) on the same file, after */
/* a census of everyone else's: so their sum never exceeds the cap.      */

#define LEDGER_CHUNK (64ull << 20)     /* at most this much unused lease per device... */
#define LEDGER_SLACK_ROOM (1ull << 30) /* ...and only while this much (and a quarter of the cap) stays free */

static int lk_fd = -1;         /* the ledger's file, O_RDONLY; -1 with lk_private: no file at all */
static int lk_private;
static pthread_mutex_t lk_open_mu = PTHREAD_MUTEX_INITIALIZER;
static int my_region = -1;
static int64_t pres_pos[LEDGER_NWIN] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
static int mem_attached;       /* this process may charge (not a forked child) */
static uint64_t own_used[LEDGER_NWIN], own_lease[LEDGER_NWIN]; /* mem_mu */
static unsigned char own_tight[LEDGER_NWIN]; /* granted with no slack: frees hand everything back */
static pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t grant_mu = PTHREAD_MUTEX_INITIALIZER; /* one slow path per process at a time */

static const char *ledger_path(void) { return cfg.limits_file[0] ? cfg.limits_file : cfg.cache; }

/* A forked child (glibc's fork, or the raw system call: devices.c notices
 * the pid change) holds nothing of its parent's: it never charges or credits
 * its parent's memory, and its allocations and SM-limited launches are refused
 * (CUDA state does not survive fork on a real driver; libvgpu does not rely
 * on that). Its copy of the ledger's descriptor is closed (the open file
 * description, and the parent's leases and markers on it, stay the parent's;
 * a lock call on it would change the parent's); a later query opens a fresh
 * one. Idempotent: both the atfork handler and the pid check may run it. */
void ledger_forked_child(void) {
    pthread_mutex_t init = PTHREAD_MUTEX_INITIALIZER;
    mem_mu = init;
    grant_mu = init;
    lk_open_mu = init;
    mem_attached = 0;
    my_region = -1;
    for (int w = 0; w < LEDGER_NWIN; w++) pres_pos[w] = -1;
    memset(own_used, 0, sizeof own_used);
    memset(own_lease, 0, sizeof own_lease);
    if (lk_fd >= 0) close(lk_fd);
    lk_fd = -1;
    shm_atfork_child();
    sm_atfork_child();
}
static void atfork_child(void) { ledger_forked_child(); }
static void atfork_register(void) { pthread_atfork(NULL, NULL, atfork_child); }
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

void ledger_attached(int on) {
    pthread_mutex_lock(&mem_mu);
    mem_attached = on;
    pthread_mutex_unlock(&mem_mu);
}

/* Opens the ledger's file once (again in a forked child). 0, or -1 with cfg_err set. */
int ledger_open(void) {
    pthread_once(&atfork_once, atfork_register);
    if (__atomic_load_n(&lk_fd, __ATOMIC_ACQUIRE) >= 0 || lk_private) return 0;
    pthread_mutex_lock(&lk_open_mu);
    int rc = 0;
    const char *p = ledger_path();
    if (lk_fd >= 0 || lk_private) {
    } else if (!*p) {
        lk_private = 1;
    } else {
        int fd = open(p, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
        if (fd < 0) {
            snprintf(cfg_err, sizeof cfg_err, "ledger %s: %s", p, strerror(errno));
            rc = -1;
        } else {
            __atomic_store_n(&lk_fd, fd, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&lk_open_mu);
    return rc;
}

/* flock(LOCK_EX) on the ledger, waited for at most LOCK_WAIT_NS. 0 or -1. */
static int ledger_lock(void) {
    if (lk_fd < 0) return 0;
    uint64_t t0 = now_ns(), sl = 5000;
    while (flock(lk_fd, LOCK_EX | LOCK_NB) != 0) {
        if ((errno != EWOULDBLOCK && errno != EINTR) || now_ns() - t0 > LOCK_WAIT_NS) return -1;
        backoff(&sl);
    }
    return 0;
}
static void ledger_unlock(void) {
    if (lk_fd >= 0) flock(lk_fd, LOCK_UN);
}


/* The container's leases per device window, everyone's but this process's
 * own (locks of our own open file description never conflict with our
 * query). Recursive window splitting: a query returns one lock overlapping
 * the window; its overlap is counted and the parts left and right of it are
 * queried again. Overlapping locks (an attacker copying a range) are counted
 * once as their union, so nothing a process adds can hide a lease; a lock
 * spanning several windows counts in each. 0, or -1 (more than MAX_QUERIES
 * queries, or an error): the caller fails closed. */
static int census(uint64_t tot[LEDGER_NWIN], unsigned *nlocks) {
    memset(tot, 0, sizeof(uint64_t) * LEDGER_NWIN);
    *nlocks = 0;
    if (ledger_open() != 0) return -1;
    if (lk_fd < 0) return 0; /* private: nobody else */
    struct win {
        int64_t a, b;
    };
    struct win *st = malloc((VGPU_LEDGER_MAX_QUERIES + 2) * sizeof *st);
    if (!st) return -1;
    size_t n = 0;
    int q = 0, rc = 0;
    st[n++] = (struct win){VGPU_LEDGER_LEASE_BASE, VGPU_LEDGER_LEASE_END};
    while (n) {
        struct win w = st[--n];
        if (w.a >= w.b) continue;
        if (++q > VGPU_LEDGER_MAX_QUERIES) {
            rc = -1;
            break;
        }
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = w.a, .l_len = w.b - w.a};
        if (fcntl(lk_fd, F_OFD_GETLK, &fl) != 0) {
            rc = -1;
            break;
        }
        if (fl.l_type == F_UNLCK) continue;
        int64_t s = fl.l_start, e = fl.l_len > 0 && fl.l_len <= INT64_MAX - fl.l_start ? fl.l_start + fl.l_len
                                                                                      : INT64_MAX;
        if (s < w.a) s = w.a;
        if (e > w.b) e = w.b;
        if (s >= e) { /* not in the window: cannot happen; never loop on it */
            rc = -1;
            break;
        }
        (*nlocks)++;
        for (int64_t k = (s - VGPU_LEDGER_LEASE_BASE) >> VGPU_LEDGER_WIN_SHIFT,
                     kl = (e - 1 - VGPU_LEDGER_LEASE_BASE) >> VGPU_LEDGER_WIN_SHIFT;
             k <= kl; k++) {
            int64_t lo = VGPU_LEDGER_LEASE_BASE + (k << VGPU_LEDGER_WIN_SHIFT), hi = lo + VGPU_LEDGER_WIN;
            if (lo < s) lo = s;
            if (hi > e) hi = e;
            tot[k % LEDGER_NWIN] = sat_add(tot[k % LEDGER_NWIN], (uint64_t)(hi - lo));
        }
        st[n++] = (struct win){w.a, s};
        st[n++] = (struct win){e, w.b};
    }
    free(st);
    return rc;
}

static int64_t lease_base(int region, int w) {
    return VGPU_LEDGER_LEASE_BASE + ((int64_t)(region * VGPU_MAX_DEV + w) << VGPU_LEDGER_WIN_SHIFT);
}

/* Window w's lease becomes len bytes (the lock clamps at the window's 2^40).
 * Growing re-locks the longer range (one atomic replacement), shrinking
 * unlocks the tail: the lock is never shorter than both. mem_mu held.
 * 0, or -1 (unchanged). */
static int lease_set(int w, uint64_t len) {
    uint64_t old = own_lease[w];
    if (lk_fd >= 0 && my_region >= 0) {
        uint64_t lo = old < (uint64_t)VGPU_LEDGER_WIN ? old : (uint64_t)VGPU_LEDGER_WIN;
        uint64_t ln = len < (uint64_t)VGPU_LEDGER_WIN ? len : (uint64_t)VGPU_LEDGER_WIN;
        int64_t base = lease_base(my_region, w);
        struct flock fl = {.l_whence = SEEK_SET};
        if (ln > lo) {
            fl.l_type = F_RDLCK;
            fl.l_start = base;
            fl.l_len = (off_t)ln;
        } else if (ln < lo) {
            fl.l_type = F_UNLCK;
            fl.l_start = base + (int64_t)ln;
            fl.l_len = (off_t)(lo - ln);
        }
        if (ln != lo && fcntl(lk_fd, F_OFD_SETLK, &fl) != 0) return -1;
    }
    own_lease[w] = len;
    return 0;
}

/* Claims a region: one whose mark byte nobody holds, under the flock so two
 * claimers cannot pick the same. 0, or -1 with cfg_err set. */
int ledger_claim(void) {
    if (ledger_open() != 0) return -1;
    if (lk_fd < 0) return 0;
    if (ledger_lock() != 0) {
        snprintf(cfg_err, sizeof cfg_err, "ledger %s: its lock is held by another process", ledger_path());
        return -1;
    }
    int start = (int)((unsigned)getpid() % VGPU_LEDGER_NREG), got = -1;
    for (int k = 0; k < VGPU_LEDGER_NREG && got < 0; k++) {
        int r = (start + k) % VGPU_LEDGER_NREG;
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_LEDGER_MARK_BASE + r, .l_len = 1};
        if (fcntl(lk_fd, F_OFD_GETLK, &fl) != 0 || fl.l_type != F_UNLCK) continue;
        fl.l_type = F_RDLCK;
        if (fcntl(lk_fd, F_OFD_SETLK, &fl) == 0) got = r;
    }
    ledger_unlock();
    if (got < 0) {
        snprintf(cfg_err, sizeof cfg_err, "ledger %s: no free region", ledger_path());
        return -1;
    }
    my_region = got;
    return 0;
}

/* ------------------------------------------------------------------ */
/* charges and credits against the ledger                              */

int win_of(int idx) { return idx >= 0 && idx < LEDGER_NWIN ? idx : LEDGER_NWIN - 1; }

uint64_t cap_of(const struct ldev *ld) {
    uint64_t cap = ld->cap, c2 = adv_cap_of((int)(ld - ldevs));
    if (c2 && (!cap || c2 < cap)) cap = c2;
    return cap;
}

/* The slow path: under the ledger's flock, a census of the others' leases;
 * granted iff others + own usage + bytes <= cap, and the lease set to the new
 * usage plus some slack (none near the cap, so the cap stays exact). */
static int charge_slow(const struct ldev *ld, uint64_t bytes) {
    int w = ld->e, rc = -1;
    uint64_t others[LEDGER_NWIN] = {0}, used = 0, cap;
    unsigned k = 0;
    const char *why = NULL;
    pthread_mutex_lock(&grant_mu);
    adv_refresh();
    cap = cap_of(ld);
    if (ledger_lock() != 0) {
        why = "the container's memory ledger is locked by another process (waited 10 s)";
        goto out;
    }
    if (census(others, &k) != 0) {
        why = "the container's memory ledger holds too many locks";
        goto unlock;
    }
    pthread_mutex_lock(&mem_mu);
    used = own_used[w];
    if (mem_attached) {
        uint64_t need = sat_add(sat_add(others[w], used), bytes);
        if (!cap || need <= cap) {
            uint64_t room = cap ? cap - need : UINT64_MAX, slack = 0;
            if (room >= LEDGER_SLACK_ROOM && (!cap || room >= cap / 4)) {
                slack = room / (2 * ((uint64_t)k + 1));
                if (slack > LEDGER_CHUNK) slack = LEDGER_CHUNK;
            }
            own_tight[w] = slack == 0;
            if (lease_set(w, used + bytes + slack) == 0 || (slack && lease_set(w, used + bytes) == 0)) {
                own_used[w] = used + bytes;
                rc = 0;
            } else {
                why = "cannot lock its lease";
            }
        } else if (own_lease[w] > used) {
            own_tight[w] = 1;
            lease_set(w, used); /* near the cap: show the others our room */
        }
    }
    pthread_mutex_unlock(&mem_mu);
unlock:
    ledger_unlock();
out:
    pthread_mutex_unlock(&grant_mu);
    if (why)
        vgpu_log(VGPU_LOG_ERROR, "%s: %llu bytes refused: %s", ld->uuid, (unsigned long long)bytes, why);
    else if (rc)
        vgpu_log(VGPU_LOG_INFO, "%s: %llu bytes refused: container uses %llu of its cap %llu", ld->uuid,
                 (unsigned long long)bytes, (unsigned long long)sat_add(others[w], used), (unsigned long long)cap);
    return rc;
}

/* Charges bytes (cap checked); 0 or -1 (over the cap). Within this
 * process's lease: no system call. */
int charge(const struct ldev *ld, uint64_t bytes) {
    int w = ld->e;
    if (UNLIKELY(!vgpu_wipe_ok)) vgpu_fork_check(); /* no wiped state page: the pid decides */
    pthread_mutex_lock(&mem_mu);
    if (LIKELY(mem_attached && bytes <= own_lease[w] - own_used[w])) {
        own_used[w] += bytes;
        pthread_mutex_unlock(&mem_mu);
        return 0;
    }
    int attached = mem_attached;
    pthread_mutex_unlock(&mem_mu);
    return attached ? charge_slow(ld, bytes) : -1;
}

/* Credits bytes back (clamped at zero). The lease shrinks when its unused
 * part passes a chunk, and to the usage itself near the cap. */
void credit(int w, uint64_t bytes) {
    pthread_mutex_lock(&mem_mu);
    if (bytes > own_used[w]) bytes = own_used[w]; /* never below zero */
    uint64_t used = own_used[w] -= bytes, lease = own_lease[w];
    if (lease > used && (own_tight[w] || lease - used > LEDGER_CHUNK))
        lease_set(w, own_tight[w] ? used : used + LEDGER_CHUNK); /* failure: the bigger lease stays */
    pthread_mutex_unlock(&mem_mu);
}

/* The container's usage on window w: the census plus this process's own
 * (its own leases are invisible to its census). 0, or -1 (fail closed). */
int container_used(int w, uint64_t *used) {
    uint64_t others[LEDGER_NWIN];
    unsigned k;
    if (census(others, &k) != 0) return -1;
    pthread_mutex_lock(&mem_mu);
    *used = sat_add(others[w], own_used[w]);
    pthread_mutex_unlock(&mem_mu);
    return 0;
}


/* ------------------------------------------------------------------ */
/* the SM share's presence markers (shm.h): the split of a container's  */
/* share among its launching processes, in the kernel's lock table      */

/* This process is launching on window w in `epoch`: its marker moves to the
 * epoch's byte (the new one locked before the old one goes). Callers
 * serialise per process (tok_mu). 0, or -1 (fail closed). */
int ledger_presence(int w, uint64_t epoch) {
    if (ledger_open() != 0) return -1;
    if (lk_fd < 0) return 0; /* private: nobody else */
    if (my_region < 0) return -1;
    int64_t pos = VGPU_SM_PRES_BASE + ((int64_t)my_region * VGPU_MAX_DEV + w) * VGPU_SM_PRES_EPOCHS +
                  (int64_t)(epoch % VGPU_SM_PRES_EPOCHS);
    if (pres_pos[w] == pos) return 0;
    struct flock fl = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = pos, .l_len = 1};
    if (fcntl(lk_fd, F_OFD_SETLK, &fl) != 0) return -1;
    if (pres_pos[w] >= 0) {
        fl.l_type = F_UNLCK;
        fl.l_start = pres_pos[w];
        fcntl(lk_fd, F_OFD_SETLK, &fl);
    }
    pres_pos[w] = pos;
    return 0;
}

/* How many other processes of the container launched on window w in this or
 * the previous epoch: process slots (region, window) with a lock on one of
 * those two bytes. Our own markers are invisible to our query. Any lock
 * counts for every slot whose fresh byte it covers (union of overlapping
 * locks, as the memory census): added locks only add processes. 0, or -1
 * (fail closed). */
int ledger_presence_census(int w, uint64_t epoch, unsigned *others) {
    *others = 0;
    if (ledger_open() != 0) return -1;
    if (lk_fd < 0) return 0;
    enum { NSLOT = VGPU_LEDGER_NREG * VGPU_MAX_DEV };
    struct win {
        int64_t a, b;
    };
    /* one bit per region (window w's slot in it: only those are counted, so
     * neither a bitmap of every slot nor a scan of it runs every 2 ms) and
     * the split stack, kept (callers hold tok_mu) */
    static unsigned char seen[VGPU_LEDGER_NREG / 8];
    static struct win *st;
    if (w < 0 || w >= VGPU_MAX_DEV) return -1;
    if (!st && !(st = malloc((VGPU_LEDGER_MAX_QUERIES + 2) * sizeof *st))) return -1;
    memset(seen, 0, sizeof seen);
    size_t n = 0;
    int q = 0;
    int64_t e1 = (int64_t)(epoch % VGPU_SM_PRES_EPOCHS), e0 = (int64_t)((epoch + VGPU_SM_PRES_EPOCHS - 1) % VGPU_SM_PRES_EPOCHS);
    st[n++] = (struct win){VGPU_SM_PRES_BASE, VGPU_SM_PRES_END};
    while (n) {
        struct win x = st[--n];
        if (x.a >= x.b) continue;
        if (++q > VGPU_LEDGER_MAX_QUERIES) return -1;
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = x.a, .l_len = x.b - x.a};
        if (fcntl(lk_fd, F_OFD_GETLK, &fl) != 0) return -1;
        if (fl.l_type == F_UNLCK) continue;
        int64_t s = fl.l_start, e = fl.l_len > 0 && fl.l_len <= INT64_MAX - fl.l_start ? fl.l_start + fl.l_len : INT64_MAX;
        if (s < x.a) s = x.a;
        if (e > x.b) e = x.b;
        if (s >= e) return -1;
        /* slots k = region * VGPU_MAX_DEV + window: window w's from the first at or after k0 */
        int64_t k0 = (s - VGPU_SM_PRES_BASE) / VGPU_SM_PRES_EPOCHS;
        for (int64_t k = k0 + ((w - k0 % VGPU_MAX_DEV) + VGPU_MAX_DEV) % VGPU_MAX_DEV,
                     kl = (e - 1 - VGPU_SM_PRES_BASE) / VGPU_SM_PRES_EPOCHS; k <= kl && k < NSLOT; k += VGPU_MAX_DEV) {
            int64_t b0 = VGPU_SM_PRES_BASE + k * VGPU_SM_PRES_EPOCHS, r = k / VGPU_MAX_DEV;
            unsigned char bit = (unsigned char)(1u << (r % 8));
            if (((b0 + e0 >= s && b0 + e0 < e) || (b0 + e1 >= s && b0 + e1 < e)) && !(seen[r / 8] & bit)) {
                seen[r / 8] |= bit;
                ++*others;
            }
        }
        /* the rest, left then right: depth-first keeps the stack short */
        st[n++] = (struct win){e, x.b};
        st[n++] = (struct win){x.a, s};
    }
    return 0;
}
