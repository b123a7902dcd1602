/* The container's shared state: the accounting file's layout (read and
 * written with pread/pwrite, never mapped) and the lock ledger's geometry.
 * nvctk/vgpu/limits.py reads both: keep the offsets and constants in step. */
#ifndef VGPU_SHM_H
#define VGPU_SHM_H

#include <stdint.h>
#include "vgpu.h"

#define VGPU_SHM_MAGIC 0x55504756u /* "VGPU" */
/* 2: memory lives in the lock ledger; no mutex in the file (it is never mapped) */
#define VGPU_SHM_VERSION 2u
#define VGPU_MAX_SLOTS 1024
/* Each live slot's owner holds an OFD write lock on byte LOCKBASE + slot of the
 * accounting file; byte DATA_LOCK is the file's mutex (an OFD write lock). */
#define VGPU_SLOT_LOCKBASE (1ll << 30)
#define VGPU_DATA_LOCK 0

/* The lock ledger (see libvgpu/README.md): OFD read locks on the limits file
 * (on the accounting file where there is none). Region r is claimed by a
 * 1-byte lock at MARK_BASE + r; its lease on device window d is the lock at
 * LEASE_BASE + ((r * VGPU_MAX_DEV + d) << WIN_SHIFT), length = bytes leased. */
#define VGPU_LEDGER_NREG 4096
#define VGPU_LEDGER_MARK_BASE (1ll << 32)
#define VGPU_LEDGER_WIN_SHIFT 40
#define VGPU_LEDGER_WIN (1ll << VGPU_LEDGER_WIN_SHIFT)
#define VGPU_LEDGER_LEASE_BASE (1ll << 40)
#define VGPU_LEDGER_LEASE_END \
    (VGPU_LEDGER_LEASE_BASE + ((long long)VGPU_LEDGER_NREG * VGPU_MAX_DEV << VGPU_LEDGER_WIN_SHIFT))
#define VGPU_LEDGER_MAX_QUERIES 4096 /* census: more locks than that => fail closed */

/* The SM share's presence markers, on the same file: a process launching
 * under an SM limit on device window d holds a 1-byte read lock at
 * PRES_BASE + (r * VGPU_MAX_DEV + d) * PRES_EPOCHS + (epoch % PRES_EPOCHS),
 * epoch = CLOCK_MONOTONIC / PRES_EPOCH_NS, renewed while it launches. The
 * container's share on d is split evenly among the slots with a marker at the
 * current or the previous epoch; a lock anybody adds only counts as one more
 * process (a smaller share each), so nothing a container writes raises it. */
#define VGPU_SM_PRES_BASE (1ll << 58)
#define VGPU_SM_PRES_EPOCHS 4
#define VGPU_SM_PRES_EPOCH_NS 100000000ll
#define VGPU_SM_PRES_END \
    (VGPU_SM_PRES_BASE + (long long)VGPU_LEDGER_NREG * VGPU_MAX_DEV * VGPU_SM_PRES_EPOCHS)

/* A slot's sm_debt while a launch of unknown cost runs: the flag and its start.
 * A slot freed in that state owes the time since (at most VGPU_SM_DEBT_MAX_NS). */
#define VGPU_SM_DEBT_INFLIGHT (1ull << 63)
#define VGPU_SM_DEBT_MAX_NS 60000000000ull /* the most debt carried over per device entry */

struct vgpu_shm_hdr {          /* 128 bytes */
    uint32_t magic;
    uint32_t version;
    uint32_t size;
    uint32_t nslots;
    uint32_t hwm;              /* slots from here up have never been taken (readers read fewer; a forged
                                  low value only hides slots: their locks still guard them) */
    char _pad[108];
};

struct vgpu_shm_dev {          /* 128 bytes */
    char uuid[64];             /* "GPU-..."; "" = free entry */
    uint64_t used;             /* unused since version 2: usage is in the ledger */
    uint64_t mem_cap;          /* strictest cap among live processes, 0 = none (advisory: only tightens) */
    uint32_t sm_pct;           /* strictest SM share among live processes, 0 = none */
    uint32_t win;              /* its ledger window + 1 (0 = unknown): statistics */
    int64_t tokens_ns;         /* unused since the buckets are per process (presence markers) */
    uint64_t last_ns;          /* CLOCK_MONOTONIC of the last statistics update */
    uint64_t busy_ns;          /* measured kernel time (statistics) */
    uint64_t launches;
    uint64_t sm_debt_ns;       /* device time exited processes used beyond their part, not yet repaid: the
                                  next process launching on it takes it over (the share is the container's) */
};

struct vgpu_shm_slot {         /* 352 bytes */
    int32_t pid;               /* 0 = free */
    uint32_t flags;
    uint64_t start_time;       /* /proc/<pid>/stat field 22 */
    uint64_t pidns;            /* inode of the owner's pid namespace */
    uint64_t sm_debt[VGPU_MAX_DEV]; /* per device entry: its SM debt (ns) as last published, or
                                  VGPU_SM_DEBT_INFLIGHT | CLOCK_MONOTONIC start of a launch of unknown cost
                                  in progress; moved to the device entry when the slot is freed or reaped */
    uint64_t mem_cap[VGPU_MAX_DEV];
    uint32_t sm[VGPU_MAX_DEV];
    int32_t host_pid;          /* the pid NVML reports for it (first NSpid entry); 0 = unknown */
    uint32_t _pad;
};

struct vgpu_shm {
    struct vgpu_shm_hdr hdr;
    struct vgpu_shm_dev devs[VGPU_MAX_DEV];     /* offset 128 */
    struct vgpu_shm_slot slots[VGPU_MAX_SLOTS]; /* offset 128 + 16*128 */
};

_Static_assert(sizeof(struct vgpu_shm_hdr) == 128, "header layout");
_Static_assert(sizeof(struct vgpu_shm_dev) == 128, "dev layout");
_Static_assert(sizeof(struct vgpu_shm_slot) == 352, "slot layout");
_Static_assert(VGPU_LEDGER_LEASE_END > 0 && VGPU_LEDGER_LEASE_END < (1ll << 62), "ledger below 2^63");

#endif
