/* Body of the driver libraries nothing in the sim calls (libnvidia-cfg, the GL
 * and video stacks, ...): a real ELF shared object, so ldconfig, the hook's
 * mounts and the ld cache treat it like the real thing. build.py links it once
 * and only swaps the SONAME for each library. */
int nvsim_stub_library(void);

int nvsim_stub_library(void)
{
    return 0;
}
