/* shmfile.c: the container's accounting file (never mapped: read and written
 * with pread/pwrite under its lock, so a container process that truncates or
 * scribbles on it crashes nobody): the process slots, the device entries'
 * advisory limits, the SM buckets' storage. */
#include "internal.h"

int cache_fd = -1;           /* the accounting file, O_RDWR */
struct vgpu_shm *priv_img;   /* no file at all: this process's own copy */
static pthread_mutex_t data_mu = PTHREAD_MUTEX_INITIALIZER; /* threads: OFD locks don't exclude them */
int my_slot = -1;
pid_t my_pid;
uint64_t my_pidns;

uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Backoff for bounded waits: 5 us doubling to 1 ms. (A cap of 10 ms left the
 * last of 64 processes starting together sleeping long after the lock was
 * free: p90 of their first cuInit ~10 ms.) */
#ifndef VGPU_BACKOFF_MAX_NS
#define VGPU_BACKOFF_MAX_NS 1000000
#endif
void backoff(uint64_t *sleep_ns) {
    struct timespec ts = {0, (long)*sleep_ns};
    nanosleep(&ts, NULL);
    if (*sleep_ns < VGPU_BACKOFF_MAX_NS) *sleep_ns *= 2;
    if (*sleep_ns > VGPU_BACKOFF_MAX_NS) *sleep_ns = VGPU_BACKOFF_MAX_NS;
}

/* pid's start time (field 22 of /proc/<pid>/stat: its thread-group leader's)
 * read from the leader's own task entry, whose field 22 is the same. Not
 * /proc/<pid>/stat itself: for the reader's own process the kernel first
 * brings the reader's CPU time up to date (thread_group_cputime ->
 * task_sched_runtime), and a process whose time slice is spent is switched
 * out right there. 64 processes starting at once on 2 CPUs spent a median
 * 1.1 ms of their first cuInit in that one read (issue 29). The process's
 * own file where the task's cannot be opened. */
uint64_t proc_start_time(pid_t pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/task/%d/stat", (int)pid, (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
        fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    p++;
    for (int field = 3; field <= 22; field++) {
        while (*p == ' ') p++;
        if (field == 22) return strtoull(p, NULL, 10);
        while (*p && *p != ' ') p++;
    }
    return 0;
}

/* The pid NVML reports for this process: the first NSpid entry of
 * /proc/self/status, i.e. its pid in the pid namespace /proc was mounted
 * for (the host's only when that /proc is the host's); 0 if unreadable. */
static int32_t host_pid_of_self(void) {
    /* /proc/self names this process's pid in the pid namespace of the /proc
     * mount: the first NSpid entry of /proc/self/status, for one readlink
     * instead of generating the whole status file (~10 us) */
    char buf[32];
    ssize_t n = readlink("/proc/self", buf, sizeof buf - 1);
    if (n <= 0) return 0;
    buf[n] = 0;
    return (int32_t)strtol(buf, NULL, 10);
}

static uint64_t pidns_inode(void) {
    char buf[64];
    ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strchr(buf, '[');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

/* The file's lock: a process-local mutex, then an OFD write lock on its
 * byte DATA_LOCK, waited for at most LOCK_WAIT_NS. 0, or -1 (not taken). */
int data_lock(void) {
    pthread_mutex_lock(&data_mu);
    if (cache_fd < 0) return 0;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_DATA_LOCK, .l_len = 1};
    uint64_t t0 = now_ns(), sl = 5000;
    while (fcntl(cache_fd, F_OFD_SETLK, &fl) != 0) {
        if ((errno != EAGAIN && errno != EACCES && errno != EINTR) || now_ns() - t0 > LOCK_WAIT_NS) {
            pthread_mutex_unlock(&data_mu);
            return -1;
        }
        backoff(&sl);
    }
    return 0;
}

void data_unlock(void) {
    if (cache_fd >= 0) {
        struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = VGPU_DATA_LOCK, .l_len = 1};
        fcntl(cache_fd, F_OFD_SETLK, &fl);
    }
    pthread_mutex_unlock(&data_mu);
}

/* Whole reads and writes of the file (or of the private copy). 0 or -1. */
int cache_read(void *buf, size_t len, size_t off) {
    if (cache_fd < 0) {
        if (!priv_img) return -1;
        memcpy(buf, (char *)priv_img + off, len);
        return 0;
    }
    size_t done = 0;
    while (done < len) {
        ssize_t n = pread(cache_fd, (char *)buf + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1; /* short: truncated by someone */
        done += (size_t)n;
    }
    return 0;
}

int cache_write(const void *buf, size_t len, size_t off) {
    if (cache_fd < 0) {
        if (!priv_img) return -1;
        memcpy((char *)priv_img + off, buf, len);
        return 0;
    }
    size_t done = 0;
    while (done < len) {
        ssize_t n = pwrite(cache_fd, (const char *)buf + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        done += (size_t)n;
    }
    return 0;
}

int hdr_valid(const struct vgpu_shm_hdr *h) {
    return h->magic == VGPU_SHM_MAGIC && h->version == VGPU_SHM_VERSION && h->size == sizeof(struct vgpu_shm) &&
           h->nslots == VGPU_MAX_SLOTS;
}

void hdr_init(struct vgpu_shm_hdr *h) {
    memset(h, 0, sizeof *h);
    h->magic = VGPU_SHM_MAGIC;
    h->version = VGPU_SHM_VERSION;
    h->size = sizeof(struct vgpu_shm);
    h->nslots = VGPU_MAX_SLOTS;
}


/* Slots img holds: those below the high-water mark (the rest were never
 * taken, or a forged mark hides them: their owners' locks still guard them).
 * Nothing reads img's slots from here up: they are not even touched, so a
 * calloc'd image costs no page faults there. */
uint32_t img_n(const struct vgpu_shm *img) {
    return img->hdr.hwm < VGPU_MAX_SLOTS ? img->hdr.hwm : VGPU_MAX_SLOTS;
}

/* The file into img (header, devices, the slots below the high-water mark);
 * 0, or -1 if unreadable or not in the layout (a container process truncated
 * or overwrote it). Lock held. */
int cache_load(struct vgpu_shm *img) {
    if (cache_read(img, offsetof(struct vgpu_shm, slots), 0) != 0 || !hdr_valid(&img->hdr)) return -1;
    /* only the slots below the high-water mark: a few KiB, not 354, for a
     * container's processes starting together */
    uint32_t hwm = img_n(img);
    return hwm && cache_read(img->slots, hwm * sizeof img->slots[0], SLOT_OFF(0)) != 0 ? -1 : 0;
}

/* Slot `slot` is taken: the high-water mark covers it. Lock held. 0 or -1. */
static int hwm_cover(struct vgpu_shm *img, int slot) {
    if (img->hdr.hwm > (uint32_t)slot && img->hdr.hwm <= VGPU_MAX_SLOTS) return 0;
    img->hdr.hwm = (uint32_t)slot + 1;
    return cache_write(&img->hdr.hwm, sizeof img->hdr.hwm, offsetof(struct vgpu_shm_hdr, hwm));
}

/* Opens the accounting file ("" = a private copy). libvgpu never grows it:
 * nvctk preallocates it; a short one is allocated here (posix_fallocate), and
 * one that cannot be (a full tmpfs) fails closed. 0, or -1 with cfg_err set. */
int cache_open(const char *path) {
    if (cache_fd >= 0 || priv_img) return 0;
    my_pid = getpid();
    my_pidns = pidns_inode();
    if (!*path) {
        priv_img = calloc(1, sizeof *priv_img);
        if (!priv_img) goto fail;
        hdr_init(&priv_img->hdr);
        return 0;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK, 0666);
    if (fd < 0) goto fail;
    struct stat st;
    /* the fstat system call itself: glibc's fstat symbol is GLIBC_2.33 */
    if (syscall(SYS_fstat, fd, &st) != 0) {
        close(fd);
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: not a regular file", path);
        return -1;
    }
    if (st.st_size < (off_t)sizeof(struct vgpu_shm)) {
        int e = posix_fallocate(fd, 0, sizeof(struct vgpu_shm));
        if (e) {
            close(fd);
            snprintf(cfg_err, sizeof cfg_err,
                     "accounting file %s: %lld bytes, cannot allocate the %zu it needs (%s); refusing to run "
                     "without the limit",
                     path, (long long)st.st_size, sizeof(struct vgpu_shm), strerror(e));
            return -1;
        }
        if (st.st_size == 0) fchmod(fd, 0666); /* created now: the container's other users share it */
    }
    cache_fd = fd;
    if (data_lock() != 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: its lock is held by another process", path);
        return -1;
    }
    struct vgpu_shm_hdr h;
    int rc = 0;
    if (cache_read(&h, sizeof h, 0) != 0 || !hdr_valid(&h)) {
        /* fresh (nvctk preallocates zeros) or overwritten: (re)initialised.
         * Only the header and the device entries are written (2 KiB, not the
         * whole file: that was 0.6 ms of the first cuInit): with the
         * high-water mark at 0 no slot is read, and a slot is written whole
         * when taken (its lock, not its bytes, says whether it is live). */
        struct {
            struct vgpu_shm_hdr h;
            struct vgpu_shm_dev d[VGPU_MAX_DEV];
        } z;
        memset(&z, 0, sizeof z);
        hdr_init(&z.h);
        rc = cache_write(&z, sizeof z, 0);
    }
    data_unlock();
    if (rc == 0) return 0;
    snprintf(cfg_err, sizeof cfg_err, "accounting file %s: cannot initialise it", path);
    return -1;
fail:
    snprintf(cfg_err, sizeof cfg_err, "accounting file %s (CUDA_DEVICE_MEMORY_SHARED_CACHE): %s", path,
             strerror(errno));
    return -1;
}

static void recompute(struct vgpu_shm *img) {
    for (int e = 0; e < VGPU_MAX_DEV; e++) {
        struct vgpu_shm_dev *d = &img->devs[e];
        if (!d->uuid[0]) continue;
        uint64_t cap = 0;
        uint32_t sm = 0;
        for (uint32_t i = 0, n = img_n(img); i < n; i++) {
            struct vgpu_shm_slot *s = &img->slots[i];
            if (!s->pid) continue;
            if (s->mem_cap[e] && (!cap || s->mem_cap[e] < cap)) cap = s->mem_cap[e];
            if (s->sm[e] && (!sm || s->sm[e] < sm)) sm = s->sm[e];
        }
        d->used = 0;
        d->mem_cap = cap;
        d->sm_pct = sm;
    }
}

static int slot_alive(const struct vgpu_shm *img, int i) {
    const struct vgpu_shm_slot *s = &img->slots[i];
    if (!s->pid) return 0;
    if (i == my_slot) return 1;
    if (cache_fd >= 0) {
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCKBASE + i, .l_len = 1};
        if (fcntl(cache_fd, F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK) return 0;
    }
    if (s->pidns == my_pidns && proc_start_time(s->pid) != s->start_time) return 0;
    return 1;
}

/* A slot being freed hands its SM debt to the device entries (img; the
 * caller writes them): the share is the container's, so what a process used
 * beyond its part outlives it — the next process launching on the device
 * takes it over (sm.c). A launch of unknown cost still in progress owes the
 * time since it began. Lock held. */
static void slot_debt_release(struct vgpu_shm *img, int i) {
    struct vgpu_shm_slot *s = &img->slots[i];
    uint64_t now = 0;
    for (int e = 0; e < VGPU_MAX_DEV; e++) {
        uint64_t v = s->sm_debt[e];
        if (!v || !img->devs[e].uuid[0]) continue;
        if (v & VGPU_SM_DEBT_INFLIGHT) {
            if (!now) now = now_ns();
            v &= ~VGPU_SM_DEBT_INFLIGHT;
            v = now > v ? now - v : 0;
        }
        uint64_t d = sat_add(img->devs[e].sm_debt_ns, v);
        img->devs[e].sm_debt_ns = d > VGPU_SM_DEBT_MAX_NS ? VGPU_SM_DEBT_MAX_NS : d;
    }
}

/* This process's SM debt on device entry ce as the container sees it if the
 * process ends now (see slot_debt_release). 0 or -1. */
int slot_debt_publish(int ce, uint64_t v) {
    if (my_slot < 0 || ce < 0) return -1;
    if (data_lock() != 0) return -1;
    int rc = cache_write(&v, sizeof v,
                         SLOT_OFF(my_slot) + offsetof(struct vgpu_shm_slot, sm_debt) + (size_t)ce * sizeof v);
    data_unlock();
    return rc;
}

/* Frees dead processes' slots in img and the file (cand: the ones to judge,
 * NULL = all); recomputes and stores the device entries. Lock held. */
void reap(struct vgpu_shm *img, const int *cand, int n) {
    for (int k = 0; k < (cand ? n : (int)img_n(img)); k++) {
        int i = cand ? cand[k] : k;
        if (img->slots[i].pid && !slot_alive(img, i)) {
            vgpu_log(VGPU_LOG_INFO, "reclaimed slot of dead pid %d", img->slots[i].pid);
            slot_debt_release(img, i);
            memset(&img->slots[i], 0, sizeof img->slots[i]);
            cache_write(&img->slots[i], sizeof img->slots[i], SLOT_OFF(i));
        }
    }
    recompute(img);
    cache_write(img->devs, sizeof img->devs, DEVS_OFF);
}

/* Index of uuid's entry in img, created if `create`; -1 if none/full. */
int shm_dev(struct vgpu_shm *img, const char *uuid, int create) {
    int free_e = -1;
    for (int e = 0; e < VGPU_MAX_DEV; e++) {
        if (strncmp(img->devs[e].uuid, uuid, sizeof img->devs[e].uuid) == 0) return e;
        if (!img->devs[e].uuid[0] && free_e < 0) free_e = e;
    }
    if (!create || free_e < 0) return -1;
    struct vgpu_shm_dev *d = &img->devs[free_e];
    memset(d, 0, sizeof *d);
    snprintf(d->uuid, sizeof d->uuid, "%s", uuid);
    return free_e;
}

/* Slots that look dead, judged from a snapshot without the lock. slot_alive
 * reads /proc for every live member: done under the lock, a container's
 * processes starting together would do those reads one after another. */
static int dead_candidates(struct vgpu_shm *img, int *out) {
    int n = 0;
    if (cache_load(img) != 0) return 0;
    for (int i = 0; i < (int)img_n(img); i++)
        if (img->slots[i].pid && !slot_alive(img, i)) out[n++] = i;
    return n;
}

/* A device entry takes this process's limits: the strictest of the live
 * ones stays (0 = none). Warns when they differ. */
static void dev_merge(struct vgpu_shm_dev *d, const struct ldev *ld) {
    if ((d->mem_cap && d->mem_cap != ld->cap) || (d->sm_pct && d->sm_pct != ld->sm))
        vgpu_log(VGPU_LOG_WARN,
                 "%s: this process's limits (memory %llu, sm %u%%) differ from its container's (memory "
                 "%llu, sm %u%%); the stricter hold",
                 ld->uuid, (unsigned long long)ld->cap, ld->sm, (unsigned long long)d->mem_cap, d->sm_pct);
    d->win = (uint32_t)ld->e + 1;
}

/* This process's slot in `img` (identity, its own caps and SM share) and its
 * devices' entries (found or made, merged; a device with no entry left has
 * none: its ledger window caps it, its SM-limited launches are refused);
 * `tighten`: its limits also tighten the entries at once (the full path
 * recomputes them from every slot instead). Nothing is written here. */
static void slot_fill(struct vgpu_shm *img, int slot, int n, uint64_t my_start, int32_t my_host_pid,
                     int tighten) {
    struct vgpu_shm_slot *s = &img->slots[slot];
    memset(s, 0, sizeof *s);
    s->start_time = my_start;
    s->pidns = my_pidns;
    s->host_pid = my_host_pid;
    for (int i = 0; i < n; i++) {
        struct ldev *ld = &ldevs[i];
        ld->ce = shm_dev(img, ld->uuid, 1);
        if (ld->ce < 0) continue; /* no entry left: capped by its ledger window; SM launches refused */
        struct vgpu_shm_dev *d = &img->devs[ld->ce];
        dev_merge(d, ld);
        if (tighten) {
            if (ld->cap && (!d->mem_cap || ld->cap < d->mem_cap)) d->mem_cap = ld->cap;
            if (ld->sm && (!d->sm_pct || ld->sm < d->sm_pct)) d->sm_pct = ld->sm;
        }
        s->mem_cap[ld->ce] = ld->cap;
        s->sm[ld->ce] = ld->sm;
    }
    s->pid = (int32_t)my_pid;
}

/* The one publish sequence: the high-water mark covers the slot, then the
 * slot, then the device entries are written. Lock held. 0, or -1 (cfg_err). */
static int slot_publish(struct vgpu_shm *img, int slot) {
    if (hwm_cover(img, slot) != 0 || cache_write(&img->slots[slot], sizeof img->slots[slot], SLOT_OFF(slot)) != 0 ||
        cache_write(img->devs, sizeof img->devs, DEVS_OFF) != 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: cannot write it", cfg.cache);
        return -1;
    }
    return 0;
}

/* attach's common case, the accounting file's lock held: no dead slot in
 * the snapshot `img` (so the device entries are the live members' already),
 * so only the header and device entries are read (2 KiB, not the whole
 * 354 KiB file, which 64 processes starting together would read one after
 * another), a slot free in the snapshot is taken by its lock, and this
 * process's limits tighten the entries. 0 done, 1 not possible here (the
 * caller takes the full path; nothing was written), -1 error (cfg_err). */
static int attach_fast(struct vgpu_shm *img, int n, uint64_t my_start, int32_t my_host_pid) {
    if (cache_fd < 0) return 1;
    int snap = hdr_valid(&img->hdr) ? (int)img_n(img) : 0; /* the snapshot's slots: hints only */
    if (cache_read(img, DEVS_OFF + sizeof img->devs, 0) != 0 || !hdr_valid(&img->hdr)) return 1;
    int slot = -1;
    for (int i = 0; i < VGPU_MAX_SLOTS && slot < 0; i++) {
        if (i < snap && img->slots[i].pid) continue;
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCKBASE + i, .l_len = 1};
        if (fcntl(cache_fd, F_OFD_SETLK, &fl) != 0) continue;
        int32_t pid = -1;
        if (cache_read(&pid, sizeof pid, SLOT_OFF(i)) == 0 && pid == 0) {
            slot = i;
        } else { /* written since the snapshot: the full path judges it */
            fl.l_type = F_UNLCK;
            fcntl(cache_fd, F_OFD_SETLK, &fl);
        }
    }
    if (slot < 0) return 1;
    slot_fill(img, slot, n, my_start, my_host_pid, 1);
    if (slot_publish(img, slot) != 0) {
        struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCKBASE + slot, .l_len = 1};
        fcntl(cache_fd, F_OFD_SETLK, &fl);
        return -1;
    }
    my_slot = slot;
    return 0;
}

/* Takes a slot in the accounting file for this process and its first n
 * devices (ldevs), publishing its own limits; the device entries' strictest
 * limits come back through adv_set. 0, or -1 with cfg_err set. */
int shm_attach(int n) {
    uint64_t my_start = proc_start_time(my_pid);
    int32_t my_host_pid = host_pid_of_self();
    struct vgpu_shm *img = calloc(1, sizeof *img); /* untouched pages: no faults */
    int *cand = malloc(VGPU_MAX_SLOTS * sizeof *cand);
    if (!img || !cand) {
        free(img);
        free(cand);
        snprintf(cfg_err, sizeof cfg_err, "out of memory");
        return -1;
    }
    int ncand = dead_candidates(img, cand);
    int rc = -1;
    if (data_lock() != 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: its lock is held by another process", cfg.cache);
        goto out;
    }
    if (ncand == 0) {
        int f = attach_fast(img, n, my_start, my_host_pid);
        if (f < 0) goto unlock;
        if (f == 0) goto done;
    }
    if (cache_load(img) != 0) {
        /* overwritten since cache_open: start it afresh (it holds no memory;
         * header and device entries only, as in cache_open) */
        memset(img, 0, offsetof(struct vgpu_shm, slots));
        hdr_init(&img->hdr);
        if (cache_write(img, offsetof(struct vgpu_shm, slots), 0) != 0) {
            snprintf(cfg_err, sizeof cfg_err, "accounting file %s: cannot initialise it", cfg.cache);
            goto unlock;
        }
        ncand = 0;
    }
    reap(img, cand, ncand);
    int slot = -1;
    for (int pass = 0; pass < 2 && slot < 0; pass++) {
        if (pass) reap(img, NULL, 0); /* all taken: judge every member under the lock */
        for (int i = 0; i < VGPU_MAX_SLOTS && slot < 0; i++) {
            if (i < (int)img_n(img) && img->slots[i].pid) continue;
            if (cache_fd >= 0) {
                struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCKBASE + i,
                                   .l_len = 1};
                if (fcntl(cache_fd, F_OFD_SETLK, &fl) != 0) continue;
            }
            slot = i;
        }
    }
    if (slot < 0) {
        snprintf(cfg_err, sizeof cfg_err, "accounting file %s: no free process slot", cfg.cache);
        goto unlock;
    }
    slot_fill(img, slot, n, my_start, my_host_pid, 0);
    my_slot = slot;
    recompute(img);
    if (slot_publish(img, slot) != 0) goto unlock;
done:
    for (int i = 0; i < n; i++)
        if (ldevs[i].ce >= 0) adv_set(i, img->devs[ldevs[i].ce].mem_cap, img->devs[ldevs[i].ce].sm_pct);
    rc = 0;
unlock:
    data_unlock();
out:
    free(img);
    free(cand);
    return rc;
}


void shm_detach(void) {
    if (my_slot < 0 || (cache_fd < 0 && !priv_img)) return;
    sm_return_all();
    struct vgpu_shm *img = calloc(1, sizeof *img); /* untouched pages: no faults */
    if (!img) return;
    if (data_lock() == 0) {
        if (cache_load(img) == 0) {
            slot_debt_release(img, my_slot);
            memset(&img->slots[my_slot], 0, sizeof img->slots[my_slot]);
            cache_write(&img->slots[my_slot], sizeof img->slots[my_slot], SLOT_OFF(my_slot));
            recompute(img);
            cache_write(img->devs, sizeof img->devs, DEVS_OFF);
        }
        data_unlock();
    }
    free(img);
    my_slot = -1;
}


/* a forked child holds no slot; its copy of the descriptor shares the
 * parent's locks (its data lock would be the parent's), so it is closed */
void shm_atfork_child(void) {
    pthread_mutex_t init = PTHREAD_MUTEX_INITIALIZER;
    data_mu = init;
    my_slot = -1;
    if (cache_fd >= 0) close(cache_fd);
    cache_fd = -1;
}
