/* Unit driver for libvgpu's value grammar: reads "mem VALUE" / "sm VALUE" lines
 * on stdin, prints "ok N" or "err" per line (compared with nvctk/vgpu/limits.py). With
 * argument "config", loads the config from the environment and prints it. */
#include <stdio.h>
#include <string.h>
#include "vgpu.h"

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "config") == 0) {
        struct vgpu_config c;
        char err[1024];
        if (vgpu_load_config(&c, err, sizeof err) < 0) {
            printf("error %s\n", err);
            return 1;
        }
        printf("active %d\ncache %s\nlimits_file %s\nreserve %llu\n", c.active, c.cache, c.limits_file,
               (unsigned long long)c.reserve);
        for (int i = 0; i < 4; i++) printf("mem%d %llu\nsm%d %u\n", i, (unsigned long long)c.mem[i], i, c.sm[i]);
        return 0;
    }
    char line[4096];
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (strncmp(line, "mem ", 4) == 0) {
            uint64_t v;
            if (vgpu_parse_memory(line + 4, &v) == 0) printf("ok %llu\n", (unsigned long long)v);
            else printf("err\n");
        } else if (strncmp(line, "sm ", 3) == 0) {
            unsigned v;
            if (vgpu_parse_sm(line + 3, &v) == 0) printf("ok %u\n", v);
            else printf("err\n");
        } else {
            printf("err\n");
        }
        fflush(stdout);
    }
    return 0;
}
