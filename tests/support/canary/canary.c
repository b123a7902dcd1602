/* Canary for the hostile-image tests: a library an image LD_PRELOADs (or lists in
 * /etc/ld.so.preload). Every process that loads it appends
 *     "<pid> <exe> <dev>:<ino of its />"
 * to CANARY_LOG (an absolute path; inside a container it resolves in the rootfs).
 * A record whose root is not the container's rootfs means a host-side process
 * ran image code. */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef CANARY_LOG
#define CANARY_LOG "/canary.log"
#endif

__attribute__((constructor)) static void canary(void)
{
    char exe[512];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n < 0)
        n = 0;
    exe[n] = 0;
    struct stat st;
    if (stat("/", &st) != 0)
        memset(&st, 0, sizeof st);
    char line[700];
    int len = snprintf(line, sizeof line, "%d %s %lu:%lu\n", (int)getpid(), n ? exe : "?",
                       (unsigned long)st.st_dev, (unsigned long)st.st_ino);
    int fd = open(CANARY_LOG, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0) {
        if (write(fd, line, (size_t)len) < 0) {
        }
        close(fd);
    }
}
