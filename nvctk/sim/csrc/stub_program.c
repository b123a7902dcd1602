/* The driver's programs the sim does not simulate (nvidia-debugdump, the MPS daemons,
 * ...): a real ELF executable, as the driver's are (nvctk passes scripts over when it
 * looks for them), copied to each name; it only says what it is. */
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    (void)argc;
    const char *name = strrchr(argv[0], '/');
    fprintf(stderr, "%s: not part of the simulated driver\n", name ? name + 1 : argv[0]);
    return 1;
}
