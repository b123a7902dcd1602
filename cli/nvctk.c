/* nvctk: the host CLI (info, configure, cdi, config, vgpu, sim, device-plugin,
 * labels). All of it is Python, in nvctk.cli.main; this is its launcher. */
#define NVCTK_PROGRAM "nvctk"
#define NVCTK_MODULE "nvctk.cli.main"
#include "../runtime_shim/launcher.c"
