/* nvctk-hook: the OCI hooks nvctk puts into GPU containers' specs (prestart,
 * poststop, and the CDI spec's create-symlinks/update-ldcache). All of it is
 * Python, in nvctk.cli.hook; this is the launcher that starts it. */
#define NVCTK_PROGRAM "nvctk-hook"
#define NVCTK_MODULE "nvctk.cli.hook"
#include "../runtime_shim/launcher.c"
