/* The container's accounting file: layout shared by every process of one
 * container (and read by nvctk/vgpu.py: keep the offsets in step). */
#ifndef VGPU_SHM_H
#define VGPU_SHM_H

#include <pthread.h>
#include <stdint.h>
#include "vgpu.h"

#define VGPU_SHM_MAGIC 0x55504756u /* "VGPU" */
#define VGPU_SHM_VERSION 1u
#define VGPU_MAX_SLOTS 1024
/* Each live slot's owner holds an OFD write lock on byte LOCKBASE + slot. */
#define VGPU_SLOT_LOCKBASE (1ll << 30)

struct vgpu_shm_dev {          /* 128 bytes */
    char uuid[64];             /* "GPU-..."; "" = free entry */
    uint64_t used;             /* bytes held by the container's live processes */
    uint64_t mem_cap;          /* strictest cap among live processes, 0 = none */
    uint32_t sm_pct;           /* strictest SM share among live processes, 0 = none */
    uint32_t _pad;
    int64_t tokens_ns;         /* SM token bucket: device time the container may use now */
    uint64_t last_ns;          /* CLOCK_MONOTONIC of the last refill */
    uint64_t busy_ns;          /* measured kernel time (statistics) */
    uint64_t launches;
    uint64_t _pad2;
};

struct vgpu_shm_slot {         /* 352 bytes */
    int32_t pid;               /* 0 = free */
    uint32_t flags;
    uint64_t start_time;       /* /proc/<pid>/stat field 22 */
    uint64_t pidns;            /* inode of the owner's pid namespace */
    uint64_t used[VGPU_MAX_DEV];
    uint64_t mem_cap[VGPU_MAX_DEV];
    uint32_t sm[VGPU_MAX_DEV];
    int32_t host_pid;          /* the pid NVML reports for it (first NSpid entry); 0 = unknown */
    uint32_t _pad;
};

struct vgpu_shm {
    uint32_t magic;
    uint32_t version;
    uint32_t size;
    uint32_t nslots;
    pthread_mutex_t lock;      /* robust, process-shared; offset 16 */
    char _pad[128 - 16 - sizeof(pthread_mutex_t)];
    struct vgpu_shm_dev devs[VGPU_MAX_DEV];     /* offset 128 */
    struct vgpu_shm_slot slots[VGPU_MAX_SLOTS]; /* offset 128 + 16*128 */
};

_Static_assert(sizeof(struct vgpu_shm_dev) == 128, "dev layout");
_Static_assert(sizeof(struct vgpu_shm_slot) == 352, "slot layout");
_Static_assert(sizeof(pthread_mutex_t) <= 112, "mutex");

#endif
