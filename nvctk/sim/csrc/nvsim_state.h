/* The simulated GPUs' shared state: one mmapped file that every process using
 * the sim (host processes and processes in every container, where the runtime
 * bind-mounts it) maps, as all processes share one real GPU.
 *
 * Located by nvsim_state_open(): $NVSIM_STATE if set, else the sim dir's
 * <sim-root>/run/nvidia-sim/state (compiled in) on the host (that run dir or
 * <sim-root>/dev/nvidiactl exists; the run dir is created, mode 1777, if missing), else /run/nvidia-sim/state when
 * that directory exists (the path the runtime mounts the sim's
 * run/nvidia-sim dir at in containers). When none of these can be opened, the
 * process gets a private anonymous copy, so the mocks still work (unshared).
 *
 * Layout is fixed-size and versioned; nvctk/sim/state.py reads it with struct
 * (tests/integration/test_sim_nvml_state.py compares its offsets with offsetof()).
 *
 * Every helper declared here is hidden: libnvidia-ml and libcuda each link
 * their own copy of nvsim_state.c, and a process that loads both must not have
 * one library's calls bound to the other's copy (its statics, its mapping).
 */
#ifndef NVSIM_STATE_H
#define NVSIM_STATE_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#pragma GCC visibility push(hidden)

#define NVSIM_STATE_MAGIC 0x4e565349u /* "NVSI" */
#define NVSIM_STATE_VERSION 4u /* 3: per-process utilization history; 4: 1280 slots */
#define NVSIM_MAX_GPUS 16
#define NVSIM_MAX_PROCS 1280 /* 8 GPUs x 128 containers (bench/monitor.py), and room */
#define NVSIM_STATE_REL "run/nvidia-sim/state"
#define NVSIM_STATE_CONTAINER "/run/nvidia-sim/state"
/* NVML's utilization sample period: busy time is averaged over windows this long */
#define NVSIM_UTIL_WINDOW_NS 100000000ull
/* nvmlDeviceGetProcessUtilization's sample period (CLOCK_REALTIME, as NVML's
 * timestamps) and how many periods each process's history keeps */
#define NVSIM_HIST_PERIOD_NS 100000000ull
#define NVSIM_HIST 128

/* A process's use of one GPU. pid + start_time (field 22 of /proc/pid/stat,
 * clock ticks since boot) + pid namespace identify the process. Its owner holds
 * an OFD lock on one byte of the state file per slot (see nvsim_state.c), which
 * the kernel drops when the process dies in whatever pid namespace it lived;
 * so slots of dead processes are reclaimed (their memory credited back) by
 * whoever next takes a slot or lists processes. Pids are the caller's; host_pid
 * is the first NSpid entry (the host's view when /proc shows it). */
struct nvsim_proc {
    int32_t pid;            /* 0 = free slot */
    uint32_t gpu;           /* topology index */
    uint64_t start_time;
    uint64_t mem_used;      /* bytes held on this GPU (allocations + context reserve) */
    uint64_t busy_ns;       /* kernel time this process had on the device */
    uint64_t kernels;       /* kernels run */
    int32_t host_pid;       /* pid in the initial pid namespace, when known (else = pid) */
    uint32_t _pad;
    uint64_t pidns;         /* inode of the owner's /proc/self/ns/pid (0 = unknown) */
};

struct nvsim_gpu {
    pthread_mutex_t run_lock; /* robust, process-shared: held while a kernel runs */
    uint64_t mem_total;       /* bytes */
    uint64_t mem_used;        /* bytes, all processes */
    uint64_t busy_ns;         /* total kernel time on the device */
    uint64_t kernels;         /* total kernels run */
    uint64_t last_busy_end_ns;/* CLOCK_MONOTONIC of the last kernel's end (future: queued work) */
    /* utilization window for NVML: busy ns accumulated since window_start_ns */
    uint64_t window_start_ns;
    uint64_t window_busy_ns;
    uint32_t last_util_pct;   /* utilization of the last complete window */
    uint32_t _pad;
};

/* A slot's busy time at the start of each period it ran kernels in: ring entry
 * q % NVSIM_HIST holds period q (CLOCK_REALTIME / NVSIM_HIST_PERIOD_NS) when
 * period[] says so. Written by the slot's owner when it counts its first
 * kernel of a period; a period without an entry had no kernel, so the busy
 * time at any period boundary is that of the next entry (or the current
 * count). Cleared with the slot. */
struct nvsim_hist {
    uint64_t last;            /* the last period recorded */
    uint64_t period[NVSIM_HIST];
    uint64_t busy[NVSIM_HIST];
};

struct nvsim_state {
    uint32_t magic;
    uint32_t version;
    uint32_t ngpus;
    uint32_t nprocs;          /* = NVSIM_MAX_PROCS */
    pthread_mutex_t lock;     /* robust, process-shared: guards mem and slots */
    struct nvsim_gpu gpus[NVSIM_MAX_GPUS];
    struct nvsim_proc procs[NVSIM_MAX_PROCS];
    struct nvsim_hist hist[NVSIM_MAX_PROCS]; /* per slot, after the slots: their offsets stay */
};

/* ---- topology compiled into each mock (generated nvsim_topology.h) ---- */

struct nvsim_topo_mig {
    unsigned index;           /* position under its parent GPU */
    const char *uuid;         /* MIG-... */
    const char *profile;      /* "1g.10gb" */
    unsigned profile_id;      /* NVML GPU instance profile id */
    unsigned slices;          /* of 7 */
    unsigned gi, ci;          /* GPU / compute instance ids */
    uint64_t memory_mib;
    unsigned gi_cap_minor, ci_cap_minor;
};

struct nvsim_topo_gpu {
    unsigned index, minor;
    const char *uuid;         /* GPU-... */
    const char *name;
    const char *pci_bus_id;   /* 00000000:1B:00.0 */
    unsigned pci_domain, pci_bus, pci_device;
    uint64_t memory_mib;
    int cc_major, cc_minor;
    const char *brand;        /* nvml brand name: "nvidia", "tesla", ... */
    unsigned nmig;
    const struct nvsim_topo_mig *migs;
};

struct nvsim_topo_profile {  /* the MIG profiles this GPU kind offers */
    const char *name;         /* "1g.10gb" */
    unsigned slices;
    uint64_t memory_mib;
    unsigned id;
};

struct nvsim_topo {
    const char *driver_version;  /* "550.54.15" */
    const char *cuda_version;    /* "12.4" */
    int cuda_version_int;        /* 12040 */
    unsigned kernel_time_us;
    const char *sim_root;        /* the sim dir on the host */
    unsigned ngpus;
    const struct nvsim_topo_gpu *gpus;
    unsigned nprofiles;
    const struct nvsim_topo_profile *profiles;
};

extern const struct nvsim_topo nvsim_topo;

/* ---- the /dev rule ---- */

/* Where device nodes are looked for: $NVSIM_DEV_DIR, else <sim_root>/dev on the
 * host (<sim_root>/dev/nvidiactl or <sim_root>/run/nvidia-sim exists), else /dev
 * (container). The result is static. */
const char *nvsim_dev_dir(void);
/* Fills idx with the topology indexes of GPUs whose <dev>/nvidia<minor> exists,
 * in topology order (a container's device 0, 1, ...); returns how many. */
unsigned nvsim_visible_gpus(unsigned *idx, unsigned max);
/* A MIG device of a visible GPU is visible on the host (dev dir is
 * <sim_root>/dev) always, elsewhere when <dev>/nvidia-caps/nvidia-cap<ci_cap_minor>
 * exists. */
int nvsim_mig_visible(const struct nvsim_topo_mig *mig);

/* ---- shared state ---- */

/* Maps the state file once per process (later calls return the same pointer),
 * creating or re-initialising it from the topology under flock when it is
 * missing, short, or of another magic/version. Never NULL unless even an
 * anonymous mapping fails. */
struct nvsim_state *nvsim_state_open(void);
/* Robust-mutex lock: a holder that died leaves the mutex consistent again.
 * Returns 0, or -1 if the mutex is unrecoverable. */
int nvsim_lock(pthread_mutex_t *m);
void nvsim_unlock(pthread_mutex_t *m);
/* This process's slot on topology GPU gpu, created if needed (reclaiming dead
 * processes' slots first when the table is full of them). NULL when gpu is out
 * of range or every slot belongs to a live process. */
struct nvsim_proc *nvsim_proc_slot(struct nvsim_state *st, unsigned gpu);
/* Frees the slots of dead processes, crediting their memory back to the GPU. */
void nvsim_reap(struct nvsim_state *st);
/* The same for one GPU's slots only: a process query of a GPU checks the owners of that
 * GPU's slots, not the whole table's (one lock test per slot: at 1024 processes a
 * whole-table reap per query was most of a monitor's collection). */
void nvsim_reap_gpu(struct nvsim_state *st, unsigned gpu);
/* Charges bytes to the GPU and this process's slot: 0, or -1 (nothing charged)
 * when mem_used would exceed mem_total or no slot is free. */
int nvsim_mem_charge(struct nvsim_state *st, unsigned gpu, uint64_t bytes);
/* Credits bytes back to the GPU and this process's slot, clamped at zero. */
void nvsim_mem_credit(struct nvsim_state *st, unsigned gpu, uint64_t bytes);
/* Runs one kernel: holds the GPU's run_lock for ns (sleeping, as a real GPU
 * does not spin the CPU; after any queued asynchronous work, see below; a
 * 0-ns kernel on an idle GPU does not sleep) and counts it on the GPU and this
 * process's slot. */
void nvsim_run_kernel(struct nvsim_state *st, unsigned gpu, uint64_t ns);
/* Queues one kernel without waiting (NVSIM_ASYNC): it starts at
 * max(now, the end of the GPU's queued work = last_busy_end_ns, not_before)
 * and lasts ns; counted at once. Returns its end (CLOCK_MONOTONIC ns). */
uint64_t nvsim_queue_kernel(struct nvsim_state *st, unsigned gpu, uint64_t ns, uint64_t not_before);
/* GPU utilization in percent over the last NVSIM_UTIL_WINDOW_NS window. */
unsigned nvsim_gpu_util(struct nvsim_state *st, unsigned gpu);
/* The busy time of slot i at the start of period q, cur_q being the current
 * period and cur_busy the slot's busy_ns read before this call; q must lie in
 * (cur_q - NVSIM_HIST, cur_q]. */
uint64_t nvsim_busy_at(const struct nvsim_state *st, unsigned i, uint64_t q, uint64_t cur_q,
                       uint64_t cur_busy);
uint64_t nvsim_realtime_ns(void); /* CLOCK_REALTIME */
/* Is the slot's owner alive (it holds its slot's lock)? */
int nvsim_proc_alive(struct nvsim_state *st, const struct nvsim_proc *p);
uint64_t nvsim_now_ns(void); /* CLOCK_MONOTONIC */

#pragma GCC visibility pop

#endif
