/* limits.c: the configuration in force (limits file and env, parsed by
 * config.c), loaded once; fail closed when hidden. */
#include "internal.h"

/* ------------------------------------------------------------------ */
/* configuration and state                                             */

struct vgpu_config cfg;
char cfg_err[8192];
static int cfg_rc; /* 0 ok, -1 malformed */
static pthread_once_t cfg_once = PTHREAD_ONCE_INIT;

static void cfg_load(void) {
    cfg_rc = vgpu_load_config(&cfg, cfg_err, sizeof cfg_err);
    /* Loaded from nvctk's container path, libvgpu was put there for a limit:
     * without the container's limits file (hidden, e.g. by a mount over
     * it) it must not run uncapped. */
    Dl_info di;
    if (cfg_rc == 0 && dladdr((void *)cfg_load, &di) && di.dli_fname &&
        strcmp(di.dli_fname, VGPU_CONTAINER_LIB) == 0 && strcmp(cfg.limits_file, VGPU_LIMITS_FILE) != 0) {
        snprintf(cfg_err, sizeof cfg_err, "libvgpu is loaded from %s but the limits file %s is missing",
                 VGPU_CONTAINER_LIB, VGPU_LIMITS_FILE);
        cfg_rc = -1;
    }
    if (cfg_rc < 0) {
        char m[8400];
        int n = snprintf(m, sizeof m, "libvgpu[%d]: error: %s; refusing to run without the limit\n",
                         (int)getpid(), cfg_err);
        ssize_t w = write(2, m, (size_t)n < sizeof m ? (size_t)n : sizeof m - 1);
        (void)w;
    }
}

int cfg_status(void) {
    pthread_once(&cfg_once, cfg_load);
    return cfg_rc;
}

/* 1 when no limit is configured at all (and nothing is malformed) */
int state_passthrough(void) { return cfg_status() == 0 && !cfg.active; }

