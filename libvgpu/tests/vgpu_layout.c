/* Prints shm.h's layouts and constants as "name value" lines: the one source
 * of them. tests/integration/test_vgpu_layout.py compares nvctk/vgpu/ledger.py's view with it. */
#include <stddef.h>
#include <stdio.h>

#include "shm.h"

#define SZ(t) printf("sizeof(struct %s) %zu\n", #t, sizeof(struct t))
#define OFF(t, f) printf("%s.%s %zu\n", #t, #f, offsetof(struct t, f))
#define K(c) printf("%s %lld\n", #c, (long long)(c))

int main(void) {
    SZ(vgpu_shm_hdr);
    SZ(vgpu_shm_dev);
    SZ(vgpu_shm_slot);
    SZ(vgpu_shm);
    OFF(vgpu_shm, devs);
    OFF(vgpu_shm, slots);
    OFF(vgpu_shm_hdr, magic);
    OFF(vgpu_shm_hdr, version);
    OFF(vgpu_shm_hdr, size);
    OFF(vgpu_shm_hdr, nslots);
    OFF(vgpu_shm_hdr, hwm);
    OFF(vgpu_shm_dev, uuid);
    OFF(vgpu_shm_dev, used);
    OFF(vgpu_shm_dev, mem_cap);
    OFF(vgpu_shm_dev, sm_pct);
    OFF(vgpu_shm_dev, win);
    OFF(vgpu_shm_dev, tokens_ns);
    OFF(vgpu_shm_dev, last_ns);
    OFF(vgpu_shm_dev, busy_ns);
    OFF(vgpu_shm_dev, launches);
    OFF(vgpu_shm_dev, sm_debt_ns);
    OFF(vgpu_shm_slot, pid);
    OFF(vgpu_shm_slot, flags);
    OFF(vgpu_shm_slot, start_time);
    OFF(vgpu_shm_slot, pidns);
    OFF(vgpu_shm_slot, sm_debt);
    OFF(vgpu_shm_slot, mem_cap);
    OFF(vgpu_shm_slot, sm);
    OFF(vgpu_shm_slot, host_pid);
    K(VGPU_SHM_MAGIC);
    K(VGPU_SHM_VERSION);
    K(VGPU_MAX_DEV);
    K(VGPU_MAX_SLOTS);
    K(VGPU_SLOT_LOCKBASE);
    K(VGPU_DATA_LOCK);
    K(VGPU_LEDGER_NREG);
    K(VGPU_LEDGER_MARK_BASE);
    K(VGPU_LEDGER_WIN_SHIFT);
    K(VGPU_LEDGER_LEASE_BASE);
    K(VGPU_LEDGER_LEASE_END);
    K(VGPU_LEDGER_MAX_QUERIES);
    K(VGPU_DEFAULT_RESERVE);
    K(VGPU_SM_PRES_BASE);
    K(VGPU_SM_PRES_EPOCHS);
    K(VGPU_SM_PRES_EPOCH_NS);
    K(VGPU_SM_PRES_END);
    return 0;
}
