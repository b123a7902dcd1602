/* Shared state of the simulated GPUs, and the /dev rule; see nvsim_state.h.
 * Linked into each mock library (libnvidia-ml, libcuda) with the topology header
 * that nvctk/sim/build.py generates for the sim. */
#define _GNU_SOURCE
#include "nvsim_state.h"
#include "nvsim_topology.h" /* generated: defines nvsim_topo */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Slot i's owner holds an OFD write lock on byte LOCK_BASE + i of the state
 * file. OFD (not classic POSIX) locks, because POSIX locks die when the process
 * closes *any* fd of the file (e.g. state.py reading it in-process), and they
 * are per open file description, so libcuda's and libnvidia-ml's copies in one
 * process, and processes in other pid namespaces, all see each other's. */
#define LOCK_BASE (1ull << 30)

static struct nvsim_state *g_st;
static int g_fd = -1;          /* fd holding this process's slot locks; -1: anonymous state */
static pid_t g_fd_pid;         /* who opened g_fd: a forked child must not share its OFD */
static char g_path[PATH_MAX];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

uint64_t nvsim_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* snprintf into a path buffer; -1 when it does not fit (nothing is looked up then) */
static int mkpath(char *buf, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int mkpath(char *buf, size_t n, const char *fmt, ...)
{
    va_list ap;
    int r;
    va_start(ap, fmt);
    r = vsnprintf(buf, n, fmt, ap);
    va_end(ap);
    return r >= 0 && (size_t)r < n ? 0 : -1;
}

static int path_exists(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0;
}

static int is_dir(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* ---- the /dev rule ---- */

static char g_dev[PATH_MAX];
static int g_dev_is_host;
static pthread_once_t g_dev_once = PTHREAD_ONCE_INIT;

/* The simulated host itself, not a container: its control node or its run dir is
 * there. (Not <sim_root> alone: a container may hold <sim_root>/dev/..., as NVIDIA's
 * by-path links made at the dev root's host path.) */
static int on_host(void)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/dev/nvidiactl", nvsim_topo.sim_root);
    if (path_exists(p))
        return 1;
    snprintf(p, sizeof p, "%s/run/nvidia-sim", nvsim_topo.sim_root);
    return is_dir(p);
}

static void dev_init(void)
{
    char host[PATH_MAX];
    const char *env = getenv("NVSIM_DEV_DIR");
    snprintf(host, sizeof host, "%s/dev", nvsim_topo.sim_root);
    if (env && *env)
        snprintf(g_dev, sizeof g_dev, "%s", env);
    else if (on_host())
        snprintf(g_dev, sizeof g_dev, "%s", host);
    else
        snprintf(g_dev, sizeof g_dev, "/dev");
    g_dev_is_host = strcmp(g_dev, host) == 0;
}

const char *nvsim_dev_dir(void)
{
    pthread_once(&g_dev_once, dev_init);
    return g_dev;
}

unsigned nvsim_visible_gpus(unsigned *idx, unsigned max)
{
    const char *dev = nvsim_dev_dir();
    unsigned n = 0;
    for (unsigned i = 0; i < nvsim_topo.ngpus && n < max; i++) {
        char p[PATH_MAX];
        /* stat, not open: the nodes are real 195:N char devices with no driver behind them */
        if (mkpath(p, sizeof p, "%s/nvidia%u", dev, nvsim_topo.gpus[i].minor) == 0 &&
            path_exists(p))
            idx[n++] = i;
    }
    return n;
}

int nvsim_mig_visible(const struct nvsim_topo_mig *mig)
{
    char p[PATH_MAX];
    const char *dev = nvsim_dev_dir();
    if (g_dev_is_host)
        return 1;
    return mkpath(p, sizeof p, "%s/nvidia-caps/nvidia-cap%u", dev, mig->ci_cap_minor) == 0 &&
           path_exists(p);
}

/* ---- this process's identity ---- */

struct ident {
    pid_t pid;
    int32_t host_pid;
    uint64_t start_time;
    uint64_t pidns;
};

static void read_ident(struct ident *id)
{
    char buf[4096];
    FILE *f;
    struct stat sb;

    memset(id, 0, sizeof *id);
    id->pid = getpid();
    id->host_pid = id->pid;
    f = fopen("/proc/self/stat", "re");
    if (f) {
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        char *p;
        buf[n] = 0;
        fclose(f);
        /* comm may hold spaces and ')': the fields proper start after the last ')' */
        p = strrchr(buf, ')');
        if (p) {
            int field = 2;
            for (char *tok = strtok(p + 1, " "); tok; tok = strtok(NULL, " ")) {
                if (++field == 22) {
                    id->start_time = strtoull(tok, NULL, 10);
                    break;
                }
            }
        }
    }
    f = fopen("/proc/self/status", "re");
    if (f) {
        while (fgets(buf, sizeof buf, f)) {
            if (strncmp(buf, "NSpid:", 6) == 0) {
                id->host_pid = (int32_t)strtol(buf + 6, NULL, 10);
                break;
            }
        }
        fclose(f);
    }
    if (stat("/proc/self/ns/pid", &sb) == 0)
        id->pidns = (uint64_t)sb.st_ino;
}

static struct ident g_id;

static const struct ident *self_ident(void)
{
    if (g_id.pid != getpid())
        read_ident(&g_id);
    return &g_id;
}

/* ---- mapping ---- */

static void init_state(struct nvsim_state *st)
{
    pthread_mutexattr_t a;

    memset(st, 0, sizeof *st);
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&st->lock, &a);
    st->ngpus = nvsim_topo.ngpus < NVSIM_MAX_GPUS ? nvsim_topo.ngpus : NVSIM_MAX_GPUS;
    st->nprocs = NVSIM_MAX_PROCS;
    for (unsigned i = 0; i < st->ngpus; i++) {
        pthread_mutex_init(&st->gpus[i].run_lock, &a);
        st->gpus[i].mem_total = nvsim_topo.gpus[i].memory_mib << 20;
    }
    pthread_mutexattr_destroy(&a);
    st->version = NVSIM_STATE_VERSION;
    /* magic last: a reader that sees it sees an initialised file */
    __atomic_store_n(&st->magic, NVSIM_STATE_MAGIC, __ATOMIC_RELEASE);
}

/* Does this file describe our topology? A sim re-initialised with other GPUs
 * must not inherit the old file. */
static int state_valid(const struct nvsim_state *st)
{
    if (__atomic_load_n(&st->magic, __ATOMIC_ACQUIRE) != NVSIM_STATE_MAGIC ||
        st->version != NVSIM_STATE_VERSION || st->nprocs != NVSIM_MAX_PROCS ||
        st->ngpus != (nvsim_topo.ngpus < NVSIM_MAX_GPUS ? nvsim_topo.ngpus : NVSIM_MAX_GPUS))
        return 0;
    for (unsigned i = 0; i < st->ngpus; i++)
        if (st->gpus[i].mem_total != nvsim_topo.gpus[i].memory_mib << 20)
            return 0;
    return 1;
}

static int choose_path(void)
{
    const char *env = getenv("NVSIM_STATE");
    char dir[PATH_MAX];

    if (env && *env)
        return snprintf(g_path, sizeof g_path, "%s", env) < (int)sizeof g_path ? 0 : -1;
    snprintf(dir, sizeof dir, "%s/run/nvidia-sim", nvsim_topo.sim_root);
    if (!is_dir(dir) && on_host()) {
        /* the host, before anything created the run dir */
        char run[PATH_MAX];
        snprintf(run, sizeof run, "%s/run", nvsim_topo.sim_root);
        mkdir(run, 0755);
        /* sticky and world-writable like /tmp: container processes of any uid
         * create the state file if nobody has yet */
        if (mkdir(dir, 0777) == 0)
            chmod(dir, 01777);
    }
    if (is_dir(dir))
        return snprintf(g_path, sizeof g_path, "%s/state", dir) < (int)sizeof g_path ? 0 : -1;
    if (is_dir("/run/nvidia-sim"))
        return snprintf(g_path, sizeof g_path, "%s", NVSIM_STATE_CONTAINER) < (int)sizeof g_path
                   ? 0 : -1;
    return -1;
}

static struct nvsim_state *map_file(void)
{
    struct nvsim_state *st = MAP_FAILED;
    struct stat sb;
    int fd = open(g_path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);

    if (fd < 0)
        return NULL;
    /* other users (container processes with other uids) share the file */
    if (fstat(fd, &sb) == 0 && (sb.st_mode & 0777) != 0666 && sb.st_uid == geteuid())
        fchmod(fd, 0666);
    /* whoever gets the flock first initialises; the rest wait and find it valid */
    if (flock(fd, LOCK_EX) != 0)
        goto fail;
    if (fstat(fd, &sb) == 0 && (size_t)sb.st_size >= sizeof *st) {
        st = mmap(NULL, sizeof *st, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (st != MAP_FAILED && !state_valid(st)) {
            munmap(st, sizeof *st);
            st = MAP_FAILED;
        }
    }
    if (st == MAP_FAILED) {
        if (ftruncate(fd, 0) != 0 || ftruncate(fd, sizeof *st) != 0)
            goto fail_locked;
        st = mmap(NULL, sizeof *st, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (st == MAP_FAILED)
            goto fail_locked;
        init_state(st);
    }
    flock(fd, LOCK_UN);
    g_fd = fd;
    g_fd_pid = getpid();
    return st;
fail_locked:
    flock(fd, LOCK_UN);
fail:
    close(fd);
    return NULL;
}

static void open_once(void)
{
    struct nvsim_state *st = NULL;

    if (choose_path() == 0)
        st = map_file();
    if (!st) {
        st = mmap(NULL, sizeof *st, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (st == MAP_FAILED)
            return;
        init_state(st);
    }
    g_st = st;
}

struct nvsim_state *nvsim_state_open(void)
{
    pthread_once(&g_once, open_once);
    return g_st;
}

/* ---- locks ---- */

/* A state-lock holder that died may have updated a slot but not its GPU's
 * total (or the reverse), so totals are rebuilt from the slots. */
static void rebuild_totals(struct nvsim_state *st)
{
    for (unsigned g = 0; g < st->ngpus; g++)
        st->gpus[g].mem_used = 0;
    for (unsigned i = 0; i < NVSIM_MAX_PROCS; i++) {
        struct nvsim_proc *p = &st->procs[i];
        if (p->pid && p->gpu < st->ngpus)
            st->gpus[p->gpu].mem_used += p->mem_used;
    }
}

int nvsim_lock(pthread_mutex_t *m)
{
    int r = pthread_mutex_lock(m);
    if (r == EOWNERDEAD) {
        r = pthread_mutex_consistent(m);
        if (r == 0 && g_st && m == &g_st->lock)
            rebuild_totals(g_st);
    }
    return r == 0 ? 0 : -1;
}

void nvsim_unlock(pthread_mutex_t *m)
{
    pthread_mutex_unlock(m);
}

static int state_lock(struct nvsim_state *st)
{
    return nvsim_lock(&st->lock);
}

/* ---- slots ---- */

/* A forked child shares its parent's open file description, hence its slot
 * locks: give it its own, so the parent's slots die with the parent.
 * Called under st->lock. */
static void fix_fd_after_fork(void)
{
    if (g_fd >= 0 && g_fd_pid != getpid()) {
        int fd = open(g_path, O_RDWR | O_CLOEXEC);
        close(g_fd);
        g_fd = fd;
        g_fd_pid = getpid();
    }
}

static int slot_lock_op(int cmd, short type, unsigned i, struct flock *fl)
{
    memset(fl, 0, sizeof *fl);
    fl->l_type = type;
    fl->l_whence = SEEK_SET;
    fl->l_start = (off_t)(LOCK_BASE + i);
    fl->l_len = 1;
    return fcntl(g_fd, cmd, fl);
}

static int is_self(const struct nvsim_proc *p, const struct ident *id)
{
    return p->pid == id->pid && p->start_time == id->start_time && p->pidns == id->pidns;
}

int nvsim_proc_alive(struct nvsim_state *st, const struct nvsim_proc *p)
{
    struct flock fl;
    unsigned i = (unsigned)(p - st->procs);
    const struct ident *id = self_ident();

    if (!p->pid)
        return 0;
    if (is_self(p, id))
        return 1;
    if (g_fd < 0) {
        /* anonymous state is private to this process, and so are its slots */
        return 0;
    }
    if (slot_lock_op(F_OFD_GETLK, F_WRLCK, i, &fl) != 0)
        return 1; /* cannot tell: never reclaim on doubt */
    return fl.l_type != F_UNLCK;
}

static void free_slot(struct nvsim_state *st, struct nvsim_proc *p)
{
    memset(&st->hist[p - st->procs], 0, sizeof st->hist[0]);
    if (p->gpu < st->ngpus) {
        struct nvsim_gpu *g = &st->gpus[p->gpu];
        g->mem_used = g->mem_used > p->mem_used ? g->mem_used - p->mem_used : 0;
    }
    memset(p, 0, sizeof *p);
}

#define ALL_GPUS UINT32_MAX

static void reap_gpu_locked(struct nvsim_state *st, uint32_t gpu)
{
    fix_fd_after_fork();
    for (unsigned i = 0; i < NVSIM_MAX_PROCS; i++) {
        struct nvsim_proc *p = &st->procs[i];
        if (p->pid && (gpu == ALL_GPUS || p->gpu == gpu) && !nvsim_proc_alive(st, p))
            free_slot(st, p);
    }
}

static void reap_locked(struct nvsim_state *st)
{
    reap_gpu_locked(st, ALL_GPUS);
}

void nvsim_reap(struct nvsim_state *st)
{
    if (!st || state_lock(st) != 0)
        return;
    reap_locked(st);
    nvsim_unlock(&st->lock);
}

void nvsim_reap_gpu(struct nvsim_state *st, unsigned gpu)
{
    if (!st || state_lock(st) != 0)
        return;
    reap_gpu_locked(st, gpu);
    nvsim_unlock(&st->lock);
}

static struct nvsim_proc *slot_locked(struct nvsim_state *st, unsigned gpu)
{
    const struct ident *id = self_ident();
    struct flock fl;

    if (gpu >= st->ngpus)
        return NULL;
    fix_fd_after_fork();
    for (unsigned i = 0; i < NVSIM_MAX_PROCS; i++)
        if (st->procs[i].gpu == gpu && is_self(&st->procs[i], id))
            return &st->procs[i];
    for (int pass = 0; pass < 2; pass++) {
        for (unsigned i = 0; i < NVSIM_MAX_PROCS; i++) {
            struct nvsim_proc *p = &st->procs[i];
            if (p->pid)
                continue;
            /* fails only while a dying owner's lock lingers: try another slot */
            if (g_fd >= 0 && slot_lock_op(F_OFD_SETLK, F_WRLCK, i, &fl) != 0)
                continue;
            p->gpu = gpu;
            p->start_time = id->start_time;
            p->pidns = id->pidns;
            p->host_pid = id->host_pid;
            p->mem_used = p->busy_ns = p->kernels = 0;
            memset(&st->hist[i], 0, sizeof st->hist[i]);
            p->pid = id->pid;
            return p;
        }
        reap_locked(st);
    }
    return NULL;
}

struct nvsim_proc *nvsim_proc_slot(struct nvsim_state *st, unsigned gpu)
{
    struct nvsim_proc *p;

    if (!st || state_lock(st) != 0)
        return NULL;
    p = slot_locked(st, gpu);
    nvsim_unlock(&st->lock);
    return p;
}

int nvsim_mem_charge(struct nvsim_state *st, unsigned gpu, uint64_t bytes)
{
    struct nvsim_proc *p;
    struct nvsim_gpu *g;
    int rc = -1;

    if (!st || gpu >= st->ngpus || state_lock(st) != 0)
        return -1;
    g = &st->gpus[gpu];
    p = slot_locked(st, gpu);
    if (p && bytes <= g->mem_total && g->mem_used <= g->mem_total - bytes) {
        g->mem_used += bytes;
        p->mem_used += bytes;
        rc = 0;
    }
    nvsim_unlock(&st->lock);
    return rc;
}

void nvsim_mem_credit(struct nvsim_state *st, unsigned gpu, uint64_t bytes)
{
    struct nvsim_proc *p;
    struct nvsim_gpu *g;

    if (!st || gpu >= st->ngpus || state_lock(st) != 0)
        return;
    g = &st->gpus[gpu];
    p = slot_locked(st, gpu);
    /* credit only what this process holds, so a double free cannot eat other
     * processes' accounting */
    if (p) {
        if (bytes > p->mem_used)
            bytes = p->mem_used;
        p->mem_used -= bytes;
    }
    g->mem_used = g->mem_used > bytes ? g->mem_used - bytes : 0;
    nvsim_unlock(&st->lock);
}

/* Counts one kernel of ns ending at t1 (window from t0); run_lock held. */
static void count_kernel_locked(struct nvsim_gpu *g, uint64_t t0, uint64_t t1, uint64_t ns)
{
    uint64_t ws, wb;

    /* busy time counts the kernel's nominal length, so counters are exact
     * multiples of kernel_time whatever the sleep overshoot */
    __atomic_add_fetch(&g->busy_ns, ns, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g->kernels, 1, __ATOMIC_RELAXED);
    ws = g->window_start_ns ? g->window_start_ns : t0;
    wb = g->window_busy_ns + ns;
    if (t1 - ws >= NVSIM_UTIL_WINDOW_NS) {
        uint64_t pct = wb * 100 / (t1 - ws);
        __atomic_store_n(&g->last_util_pct, (uint32_t)(pct > 100 ? 100 : pct), __ATOMIC_RELAXED);
        __atomic_store_n(&g->window_busy_ns, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&g->window_start_ns, t1, __ATOMIC_RELEASE);
    } else {
        __atomic_store_n(&g->window_busy_ns, wb, __ATOMIC_RELAXED);
        __atomic_store_n(&g->window_start_ns, ws, __ATOMIC_RELEASE);
    }
}

uint64_t nvsim_realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The first kernel a slot counts in a period records the busy time before it:
 * NVML's per-process samples are differences of these (nvsim_busy_at). Only
 * the slot's owner writes its history; threads of one process racing here
 * at most record one kernel in the neighbouring period. */
static void record_period(struct nvsim_state *st, struct nvsim_proc *p)
{
    struct nvsim_hist *h = &st->hist[p - st->procs];
    uint64_t q = nvsim_realtime_ns() / NVSIM_HIST_PERIOD_NS;
    uint64_t last = __atomic_load_n(&h->last, __ATOMIC_RELAXED);
    unsigned k = (unsigned)(q % NVSIM_HIST);

    if (last == q || !__atomic_compare_exchange_n(&h->last, &last, q, 0, __ATOMIC_RELAXED,
                                                  __ATOMIC_RELAXED))
        return;
    __atomic_store_n(&h->period[k], 0, __ATOMIC_RELAXED);
    __atomic_store_n(&h->busy[k], __atomic_load_n(&p->busy_ns, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    __atomic_store_n(&h->period[k], q, __ATOMIC_RELEASE);
}

uint64_t nvsim_busy_at(const struct nvsim_state *st, unsigned i, uint64_t q, uint64_t cur_q,
                       uint64_t cur_busy)
{
    const struct nvsim_hist *h = &st->hist[i];
    for (uint64_t r = q; r <= cur_q && r + NVSIM_HIST > cur_q; r++) {
        unsigned k = (unsigned)(r % NVSIM_HIST);
        if (__atomic_load_n(&h->period[k], __ATOMIC_ACQUIRE) == r) {
            uint64_t b = __atomic_load_n(&h->busy[k], __ATOMIC_RELAXED);
            return b < cur_busy ? b : cur_busy;
        }
    }
    return cur_busy; /* no kernel since q */
}

static void count_proc(struct nvsim_state *st, struct nvsim_proc *p, uint64_t ns)
{
    if (p) {
        record_period(st, p);
        __atomic_add_fetch(&p->busy_ns, ns, __ATOMIC_RELAXED);
        __atomic_add_fetch(&p->kernels, 1, __ATOMIC_RELAXED);
    }
}

void nvsim_run_kernel(struct nvsim_state *st, unsigned gpu, uint64_t ns)
{
    struct nvsim_proc *p;
    struct nvsim_gpu *g;
    uint64_t t0, t1, queued;

    if (!st || gpu >= st->ngpus)
        return;
    g = &st->gpus[gpu];
    p = nvsim_proc_slot(st, gpu);
    if (nvsim_lock(&g->run_lock) != 0)
        return;
    t0 = nvsim_now_ns();
    /* after work that asynchronous processes queued (NVSIM_ASYNC) */
    queued = __atomic_load_n(&g->last_busy_end_ns, __ATOMIC_RELAXED);
    if (queued > t0)
        t0 = queued;
    if (ns || t0 > nvsim_now_ns()) {
        struct timespec dl = {(time_t)((t0 + ns) / 1000000000ull), (long)((t0 + ns) % 1000000000ull)};
        /* a kernel takes its time, not the default 50 us timer slack more */
        int slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
        prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0);
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &dl, NULL) == EINTR)
            ;
        if (slack > 0)
            prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
        t1 = nvsim_now_ns();
    } else {
        t1 = t0; /* a 0-ns kernel on an idle GPU: counted, no sleep */
    }
    count_kernel_locked(g, t0, t1, ns);
    __atomic_store_n(&g->last_busy_end_ns, t1, __ATOMIC_RELAXED);
    nvsim_unlock(&g->run_lock);
    count_proc(st, p, ns);
}

uint64_t nvsim_queue_kernel(struct nvsim_state *st, unsigned gpu, uint64_t ns, uint64_t not_before)
{
    struct nvsim_proc *p;
    struct nvsim_gpu *g;
    uint64_t now, start, end;

    now = nvsim_now_ns();
    if (!st || gpu >= st->ngpus)
        return now;
    g = &st->gpus[gpu];
    p = nvsim_proc_slot(st, gpu);
    if (nvsim_lock(&g->run_lock) != 0)
        return now;
    now = nvsim_now_ns();
    start = __atomic_load_n(&g->last_busy_end_ns, __ATOMIC_RELAXED);
    if (start < now)
        start = now;
    if (start < not_before)
        start = not_before;
    end = start + ns;
    /* the utilization window counts it when queued (its end is in the future) */
    count_kernel_locked(g, now, now, ns);
    __atomic_store_n(&g->last_busy_end_ns, end, __ATOMIC_RELAXED);
    nvsim_unlock(&g->run_lock);
    count_proc(st, p, ns);
    return end;
}

unsigned nvsim_gpu_util(struct nvsim_state *st, unsigned gpu)
{
    struct nvsim_gpu *g;
    uint64_t ws, wb, now, pct;

    if (!st || gpu >= st->ngpus)
        return 0;
    g = &st->gpus[gpu];
    /* lock-free: a reader must not queue behind a running kernel */
    ws = __atomic_load_n(&g->window_start_ns, __ATOMIC_ACQUIRE);
    wb = __atomic_load_n(&g->window_busy_ns, __ATOMIC_RELAXED);
    if (!ws)
        return 0;
    now = nvsim_now_ns();
    if (now - ws < NVSIM_UTIL_WINDOW_NS)
        return __atomic_load_n(&g->last_util_pct, __ATOMIC_RELAXED);
    /* no kernel closed a window lately: the device has idled since ws */
    pct = wb * 100 / (now - ws);
    return (unsigned)(pct > 100 ? 100 : pct);
}
