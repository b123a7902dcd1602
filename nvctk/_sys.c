/* nvctk._sys: the Linux syscalls nvctk's hook and runtime need that `os` lacks, and
 * keyed BLAKE2b for the MACs nvctk seals its records with.
 *
 * The hook and the runtime run in every GPU container's start, so they avoid
 * ctypes (~4 ms to import) and any private interpreter module; this extension uses
 * Python's public C API only and costs a dlopen to import. Every wrapper raises
 * OSError(errno, "<syscall>: <strerror>") on failure (the errno picks the subclass,
 * e.g. FileNotFoundError), and returns an fd, an int or None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/capability.h>
#include <stdint.h>
#include <string.h>
#include <stddef.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/vfs.h>
#include <unistd.h>

/* the new mount API and openat2 (x86-64 and the generic table agree) */
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_fsopen
#define SYS_fsopen 430
#endif
#ifndef SYS_fsconfig
#define SYS_fsconfig 431
#endif
#ifndef SYS_fsmount
#define SYS_fsmount 432
#endif
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif

/* the kernel's layouts (linux/openat2.h, linux/mount.h), spelled out so that the
   build does not depend on how new the installed headers are */
struct nvctk_open_how {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};

struct nvctk_mount_attr {
    uint64_t attr_set;
    uint64_t attr_clr;
    uint64_t propagation;
    uint64_t userns_fd;
};

static PyObject *
raise_errno(const char *what)
{
    int e = errno;
    PyObject *msg = PyUnicode_FromFormat("%s: %s", what, strerror(e));
    if (msg == NULL)
        return NULL;
    PyObject *args = Py_BuildValue("(iN)", e, msg);
    if (args == NULL)
        return NULL;
    PyErr_SetObject(PyExc_OSError, args);
    Py_DECREF(args);
    return NULL;
}

/* "O&" converter: str/bytes/PathLike -> bytes; None -> NULL (for optional args) */
static int
opt_path(PyObject *arg, void *addr)
{
    if (arg == NULL) { /* cleanup call */
        Py_CLEAR(*(PyObject **)addr);
        return 1;
    }
    if (arg == Py_None) {
        *(PyObject **)addr = NULL;
        return 1;
    }
    return PyUnicode_FSConverter(arg, addr);
}

static const char *
str_or_null(PyObject *b)
{
    return b == NULL ? NULL : PyBytes_AS_STRING(b);
}

static PyObject *
fd_result(long ret, const char *what)
{
    if (ret < 0)
        return raise_errno(what);
    return PyLong_FromLong(ret);
}

static PyObject *
none_result(long ret, const char *what)
{
    if (ret < 0)
        return raise_errno(what);
    Py_RETURN_NONE;
}

/* A wrapper's docstring and the head of its sys_<name>(self, args). */
#define WRAPPER(name, doc)                                                                  \
    PyDoc_STRVAR(name##_doc, doc);                                                          \
    static PyObject *sys_##name(PyObject *self, PyObject *args)

/* ret = call with the GIL released: a mount or an open may wait on a slow file system */
#define WITHOUT_GIL(ret, call)                                                              \
    do {                                                                                    \
        Py_BEGIN_ALLOW_THREADS                                                              \
        (ret) = (call);                                                                     \
        Py_END_ALLOW_THREADS                                                                \
    } while (0)

/* syscall nr(dirfd, path, a, b, c) without the GIL, then path's reference dropped (the
   kernel ignores the arguments a call does not take) */
static long
path_syscall(long nr, int dirfd, PyObject *path, long a, long b, long c)
{
    long ret;
    WITHOUT_GIL(ret, syscall(nr, dirfd, PyBytes_AS_STRING(path), a, b, c));
    Py_DECREF(path);
    return ret;
}

/* RESOLVE_IN_ROOT/BENEATH fail with EAGAIN when a rename or mount anywhere on the host
   raced a ".." step (openat2(2)): the path was not looked at, so look again; bounded,
   so a host renaming without pause still gets an answer */
#define OPENAT2_RETRIES 1000

static long
openat2_resolved(int dirfd, const char *path, struct nvctk_open_how *how)
{
    long ret;
    for (int tries = 0;; tries++) {
        ret = syscall(SYS_openat2, dirfd, path, how, sizeof *how);
        if (ret >= 0 || errno != EAGAIN || tries == OPENAT2_RETRIES)
            return ret;
    }
}

WRAPPER(openat2, "openat2(dirfd, path, flags, mode, resolve) -> fd")
{
    int dirfd;
    PyObject *path = NULL;
    unsigned long long flags, mode, resolve;
    if (!PyArg_ParseTuple(args, "iO&KKK:openat2", &dirfd, PyUnicode_FSConverter, &path,
                          &flags, &mode, &resolve))
        return NULL;
    struct nvctk_open_how how = {flags, mode, resolve};
    long ret;
    WITHOUT_GIL(ret, openat2_resolved(dirfd, PyBytes_AS_STRING(path), &how));
    Py_DECREF(path);
    return fd_result(ret, "openat2");
}

WRAPPER(open_tree, "open_tree(dirfd, path, flags) -> fd")
{
    int dirfd;
    PyObject *path = NULL;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "iO&I:open_tree", &dirfd, PyUnicode_FSConverter, &path, &flags))
        return NULL;
    return fd_result(path_syscall(SYS_open_tree, dirfd, path, flags, 0, 0), "open_tree");
}

WRAPPER(move_mount, "move_mount(from_dirfd, from_path, to_dirfd, to_path, flags)")
{
    int from_fd, to_fd;
    PyObject *from_path = NULL, *to_path = NULL;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "iO&iO&I:move_mount", &from_fd, PyUnicode_FSConverter,
                          &from_path, &to_fd, PyUnicode_FSConverter, &to_path, &flags))
        return NULL;
    long ret;
    WITHOUT_GIL(ret, syscall(SYS_move_mount, from_fd, PyBytes_AS_STRING(from_path), to_fd,
                             PyBytes_AS_STRING(to_path), flags));
    Py_DECREF(from_path);
    Py_DECREF(to_path);
    return none_result(ret, "move_mount");
}

WRAPPER(mount_setattr,
        "mount_setattr(dirfd, path, flags, attr_set, attr_clr, propagation, userns_fd)")
{
    int dirfd;
    PyObject *path = NULL;
    unsigned int flags;
    unsigned long long set, clr, prop, userns;
    if (!PyArg_ParseTuple(args, "iO&IKKKK:mount_setattr", &dirfd, PyUnicode_FSConverter, &path,
                          &flags, &set, &clr, &prop, &userns))
        return NULL;
    struct nvctk_mount_attr attr = {set, clr, prop, userns};
    long ret = path_syscall(SYS_mount_setattr, dirfd, path, flags, (long)&attr, sizeof attr);
    return none_result(ret, "mount_setattr");
}

WRAPPER(fsopen, "fsopen(fsname, flags) -> fd")
{
    PyObject *name = NULL;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "O&I:fsopen", PyUnicode_FSConverter, &name, &flags))
        return NULL;
    long ret = syscall(SYS_fsopen, PyBytes_AS_STRING(name), flags);
    Py_DECREF(name);
    return fd_result(ret, "fsopen");
}

WRAPPER(fsconfig, "fsconfig(fd, cmd, key, value, aux): key and value may be None")
{
    int fd, aux;
    unsigned int cmd;
    PyObject *key = NULL, *value = NULL;
    if (!PyArg_ParseTuple(args, "iIO&O&i:fsconfig", &fd, &cmd, opt_path, &key, opt_path, &value,
                          &aux)) {
        Py_XDECREF(key);
        return NULL;
    }
    long ret;
    WITHOUT_GIL(ret, syscall(SYS_fsconfig, fd, cmd, str_or_null(key), str_or_null(value), aux));
    Py_XDECREF(key);
    Py_XDECREF(value);
    return none_result(ret, "fsconfig");
}

WRAPPER(fsmount, "fsmount(fd, flags, attr_flags) -> fd")
{
    int fd;
    unsigned int flags, attrs;
    if (!PyArg_ParseTuple(args, "iII:fsmount", &fd, &flags, &attrs))
        return NULL;
    long ret;
    WITHOUT_GIL(ret, syscall(SYS_fsmount, fd, flags, attrs));
    return fd_result(ret, "fsmount");
}

WRAPPER(mount, "mount(source, target, fstype, flags, data): source, fstype, data may be None")
{
    PyObject *source = NULL, *target = NULL, *fstype = NULL, *data = NULL;
    unsigned long flags;
    if (!PyArg_ParseTuple(args, "O&O&O&kO&:mount", opt_path, &source, PyUnicode_FSConverter,
                          &target, opt_path, &fstype, &flags, opt_path, &data)) {
        Py_XDECREF(source);
        Py_XDECREF(target);
        Py_XDECREF(fstype);
        return NULL;
    }
    int ret;
    WITHOUT_GIL(ret, mount(str_or_null(source), PyBytes_AS_STRING(target),
                           str_or_null(fstype), flags, str_or_null(data)));
    Py_XDECREF(source);
    Py_DECREF(target);
    Py_XDECREF(fstype);
    Py_XDECREF(data);
    return none_result(ret, "mount");
}

WRAPPER(umount2, "umount2(target, flags)")
{
    PyObject *target = NULL;
    int flags;
    if (!PyArg_ParseTuple(args, "O&i:umount2", PyUnicode_FSConverter, &target, &flags))
        return NULL;
    int ret;
    WITHOUT_GIL(ret, umount2(PyBytes_AS_STRING(target), flags));
    Py_DECREF(target);
    return none_result(ret, "umount2");
}

WRAPPER(setns, "setns(fd, nstype)")
{
    int fd, nstype;
    if (!PyArg_ParseTuple(args, "ii:setns", &fd, &nstype))
        return NULL;
    return none_result(setns(fd, nstype), "setns");
}

WRAPPER(unshare, "unshare(flags)")
{
    int flags;
    if (!PyArg_ParseTuple(args, "i:unshare", &flags))
        return NULL;
    return none_result(unshare(flags), "unshare");
}

WRAPPER(fstatfs_type, "fstatfs_type(fd) -> f_type of the filesystem fd lies on")
{
    int fd;
    if (!PyArg_ParseTuple(args, "i:fstatfs_type", &fd))
        return NULL;
    struct statfs st;
    if (fstatfs(fd, &st) < 0)
        return raise_errno("fstatfs");
    return PyLong_FromLong((long)st.f_type);
}

WRAPPER(prctl, "prctl(option, arg2=0, arg3=0, arg4=0, arg5=0) -> int")
{
    int option;
    unsigned long a2 = 0, a3 = 0, a4 = 0, a5 = 0;
    if (!PyArg_ParseTuple(args, "i|kkkk:prctl", &option, &a2, &a3, &a4, &a5))
        return NULL;
    int ret = prctl(option, a2, a3, a4, a5);
    if (ret < 0)
        return raise_errno("prctl");
    return PyLong_FromLong(ret);
}

PyDoc_STRVAR(capget_doc,
             "capget() -> (effective, permitted, inheritable): this thread's sets as bit masks");

static PyObject *
sys_capget(PyObject *self, PyObject *noargs)
{
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capget, &hdr, data) < 0)
        return raise_errno("capget");
    unsigned long long eff = data[0].effective | ((unsigned long long)data[1].effective << 32);
    unsigned long long perm = data[0].permitted | ((unsigned long long)data[1].permitted << 32);
    unsigned long long inh =
        data[0].inheritable | ((unsigned long long)data[1].inheritable << 32);
    return Py_BuildValue("(KKK)", eff, perm, inh);
}

WRAPPER(capset, "capset(effective, permitted, inheritable): bit masks, this thread")
{
    unsigned long long eff, perm, inh;
    if (!PyArg_ParseTuple(args, "KKK:capset", &eff, &perm, &inh))
        return NULL;
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];
    data[0].effective = (uint32_t)eff;
    data[1].effective = (uint32_t)(eff >> 32);
    data[0].permitted = (uint32_t)perm;
    data[1].permitted = (uint32_t)(perm >> 32);
    data[0].inheritable = (uint32_t)inh;
    data[1].inheritable = (uint32_t)(inh >> 32);
    return none_result(syscall(SYS_capset, &hdr, data), "capset");
}

/* The prestart server's socket (nvctk.hook.served): `import socket` costs more than the
 * hook it saves (enum, selectors), and its C module is the interpreter's private part. */
WRAPPER(listen_abstract,
        "listen_abstract(name: bytes) -> fd: a listening unix stream socket (close-on-exec) "
        "bound to the abstract name")
{
    const char *name;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "y#:listen_abstract", &name, &len))
        return NULL;
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    if (len < 1 || (size_t)len >= sizeof a.sun_path) {
        errno = ENAMETOOLONG;
        return raise_errno("bind");
    }
    memcpy(a.sun_path + 1, name, (size_t)len); /* sun_path[0] = 0: the abstract namespace */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return raise_errno("socket");
    socklen_t alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)len);
    if (bind(fd, (struct sockaddr *)&a, alen) < 0 || listen(fd, 8) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return raise_errno("bind");
    }
    return PyLong_FromLong(fd);
}

WRAPPER(accept_peer,
        "accept_peer(fd) -> (conn_fd, pid, uid): the next connection (close-on-exec) and "
        "its peer's credentials as the kernel took them at connect (SO_PEERCRED)")
{
    int fd, conn;
    if (!PyArg_ParseTuple(args, "i:accept_peer", &fd))
        return NULL;
    WITHOUT_GIL(conn, accept4(fd, NULL, NULL, SOCK_CLOEXEC));
    if (conn < 0)
        return raise_errno("accept4");
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0) {
        int e = errno;
        close(conn);
        errno = e;
        return raise_errno("getsockopt");
    }
    return Py_BuildValue("(iii)", conn, (int)cr.pid, (int)cr.uid);
}

/* Keyed BLAKE2b (RFC 7693; this is its reference code, appendix C): the MAC of the
 * records a create seals (nvctk.spec.record, nvctk.vgpu.authority). hashlib would do
 * the same, but importing it loads OpenSSL (_hashlib, ~2 ms), which every CDI-mode
 * create would pay; tests/unit/test_mac.py checks it against hashlib. */
typedef struct {
    uint8_t b[128];  /* the input block */
    uint64_t h[8];   /* the chained state */
    uint64_t t[2];   /* bytes counted */
    size_t c;        /* bytes in b */
    size_t outlen;
} b2b_ctx;

static const uint64_t b2b_iv[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

/* the message schedule: round i uses row i % 10 (rounds 10 and 11 repeat rows 0 and 1) */
static const uint8_t b2b_sigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

#define B2B_ROTR64(x, y) (((x) >> (y)) ^ ((x) << (64 - (y))))

/* the mixing function G on words a, b, c, d of v, with message words x, y */
static inline void
b2b_g(uint64_t *v, const uint8_t *q, uint64_t x, uint64_t y)
{
    const uint8_t a = q[0], b = q[1], c = q[2], d = q[3];
    v[a] = v[a] + v[b] + x;
    v[d] = B2B_ROTR64(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d];
    v[b] = B2B_ROTR64(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y;
    v[d] = B2B_ROTR64(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = B2B_ROTR64(v[b] ^ v[c], 63);
}

/* G's words in a round: the four columns, then the four diagonals */
static const uint8_t b2b_quads[8][4] = {
    {0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15},
    {0, 5, 10, 15}, {1, 6, 11, 12}, {2, 7, 8, 13}, {3, 4, 9, 14},
};

static void
b2b_compress(b2b_ctx *ctx, int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = ctx->h[i];
        v[i + 8] = b2b_iv[i];
    }
    v[12] ^= ctx->t[0];
    v[13] ^= ctx->t[1];
    if (last)
        v[14] = ~v[14];
    for (int i = 0; i < 16; i++) {  /* little-endian words, whatever the host's order */
        const uint8_t *p = &ctx->b[8 * i];
        m[i] = (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 |
               (uint64_t)p[3] << 24 | (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 |
               (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
    }
    for (int i = 0; i < 12; i++)
        for (int j = 0; j < 8; j++)
            b2b_g(v, b2b_quads[j], m[b2b_sigma[i % 10][2 * j]],
                  m[b2b_sigma[i % 10][2 * j + 1]]);
    for (int i = 0; i < 8; i++)
        ctx->h[i] ^= v[i] ^ v[i + 8];
}

static void
b2b_update(b2b_ctx *ctx, const uint8_t *in, size_t inlen)
{
    for (size_t i = 0; i < inlen; i++) {
        if (ctx->c == 128) {  /* a full block, and more follows: not the last one */
            ctx->t[0] += ctx->c;
            if (ctx->t[0] < ctx->c)
                ctx->t[1]++;
            b2b_compress(ctx, 0);
            ctx->c = 0;
        }
        ctx->b[ctx->c++] = in[i];
    }
}

static void
b2b_init(b2b_ctx *ctx, size_t outlen, const uint8_t *key, size_t keylen)
{
    for (int i = 0; i < 8; i++)
        ctx->h[i] = b2b_iv[i];
    ctx->h[0] ^= 0x01010000 ^ (keylen << 8) ^ outlen;
    ctx->t[0] = ctx->t[1] = 0;
    ctx->c = 0;
    ctx->outlen = outlen;
    memset(ctx->b, 0, sizeof ctx->b);
    if (keylen > 0) {  /* the key, zero-padded, is the first block */
        b2b_update(ctx, key, keylen);
        ctx->c = 128;
    }
}

static void
b2b_final(b2b_ctx *ctx, uint8_t *out)
{
    ctx->t[0] += ctx->c;
    if (ctx->t[0] < ctx->c)
        ctx->t[1]++;
    while (ctx->c < 128)
        ctx->b[ctx->c++] = 0;
    b2b_compress(ctx, 1);
    for (size_t i = 0; i < ctx->outlen; i++)
        out[i] = (ctx->h[i >> 3] >> (8 * (i & 7))) & 0xFF;
}

PyDoc_STRVAR(blake2b_doc,
             "blake2b(data, key, digest_size) -> bytes: keyed BLAKE2b, as "
             "hashlib.blake2b(data, key=key, digest_size=digest_size).digest(); "
             "ValueError for a key over 64 bytes or a size outside 1..64");

static PyObject *
sys_blake2b(PyObject *self, PyObject *args)
{
    Py_buffer data, key;
    int size;
    if (!PyArg_ParseTuple(args, "y*y*i:blake2b", &data, &key, &size))
        return NULL;
    PyObject *result = NULL;
    if (key.len > 64) {
        PyErr_SetString(PyExc_ValueError, "blake2b: the key is longer than 64 bytes");
    } else if (size < 1 || size > 64) {
        PyErr_SetString(PyExc_ValueError, "blake2b: digest_size must be 1..64");
    } else {
        b2b_ctx ctx;
        uint8_t out[64];
        b2b_init(&ctx, (size_t)size, key.buf, (size_t)key.len);
        b2b_update(&ctx, data.buf, (size_t)data.len);
        b2b_final(&ctx, out);
        result = PyBytes_FromStringAndSize((const char *)out, size);
        memset(&ctx, 0, sizeof ctx);  /* the key's block */
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&key);
    return result;
}

static PyMethodDef sys_methods[] = {
    {"openat2", sys_openat2, METH_VARARGS, openat2_doc},
    {"open_tree", sys_open_tree, METH_VARARGS, open_tree_doc},
    {"move_mount", sys_move_mount, METH_VARARGS, move_mount_doc},
    {"mount_setattr", sys_mount_setattr, METH_VARARGS, mount_setattr_doc},
    {"fsopen", sys_fsopen, METH_VARARGS, fsopen_doc},
    {"fsconfig", sys_fsconfig, METH_VARARGS, fsconfig_doc},
    {"fsmount", sys_fsmount, METH_VARARGS, fsmount_doc},
    {"mount", sys_mount, METH_VARARGS, mount_doc},
    {"umount2", sys_umount2, METH_VARARGS, umount2_doc},
    {"setns", sys_setns, METH_VARARGS, setns_doc},
    {"unshare", sys_unshare, METH_VARARGS, unshare_doc},
    {"fstatfs_type", sys_fstatfs_type, METH_VARARGS, fstatfs_type_doc},
    {"prctl", sys_prctl, METH_VARARGS, prctl_doc},
    {"capget", sys_capget, METH_NOARGS, capget_doc},
    {"capset", sys_capset, METH_VARARGS, capset_doc},
    {"listen_abstract", sys_listen_abstract, METH_VARARGS, listen_abstract_doc},
    {"accept_peer", sys_accept_peer, METH_VARARGS, accept_peer_doc},
    {"blake2b", sys_blake2b, METH_VARARGS, blake2b_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sys_module = {
    PyModuleDef_HEAD_INIT, "nvctk._sys",
    "The Linux syscalls nvctk needs that os lacks, and keyed BLAKE2b (public C API only).", -1, sys_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__sys(void)
{
    return PyModule_Create(&sys_module);
}
