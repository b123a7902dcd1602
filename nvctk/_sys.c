/* nvctk._sys: the Linux syscalls nvctk's hook and runtime need that `os` lacks, and the
 * module itself. Its other half, nvctk/_sys_codec.c, holds the codec: keyed BLAKE2b for
 * the MACs nvctk seals its records with (libb2) and JSON (jansson to decode, a compact
 * encoder) for nvctk.base.jsonio; nvctk/_sys.h is what the two share.
 *
 * The hook and the runtime run in every GPU container's start, so they avoid
 * ctypes (~4 ms to import) and any private interpreter module; this extension uses
 * Python's public C API only and costs a dlopen to import. Every wrapper raises
 * OSError(errno, "<syscall>: <strerror>") on failure (the errno picks the subclass,
 * e.g. FileNotFoundError), and returns an fd, an int or None.
 */
#include "_sys.h"

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

/* statx(2)'s buffer as the kernel's UAPI lays it out (glibc's struct statx keeps
   stx_mnt_id in its padding) */
struct kstatx {
    uint32_t mask, blksize;
    uint64_t attributes;
    uint32_t nlink, uid, gid;
    uint16_t mode, pad1;
    uint64_t ino, size, blocks, attributes_mask;
    struct { int64_t sec; uint32_t nsec; int32_t pad; } atime, btime, ctime, mtime;
    uint32_t rdev_major, rdev_minor, dev_major, dev_minor;
    uint64_t mnt_id;
    uint64_t spare[13];
};
_Static_assert(offsetof(struct kstatx, mnt_id) == 0x90, "statx's stx_mnt_id is at 0x90");
_Static_assert(sizeof(struct kstatx) == 0x100, "statx's buffer is 256 bytes");
#define KSTATX_MNT_ID 0x1000u

WRAPPER(mount_id, "mount_id(fd) -> the id of the mount fd lies on, as mountinfo's; -1 where "
                  "statx cannot tell (Linux < 5.8)")
{
    int fd;
    if (!PyArg_ParseTuple(args, "i:mount_id", &fd))
        return NULL;
    struct kstatx st;
    memset(&st, 0, sizeof st);
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, KSTATX_MNT_ID, &st) < 0) {
        if (errno == ENOSYS)
            return PyLong_FromLong(-1);
        return raise_errno("statx");
    }
    if (!(st.mask & KSTATX_MNT_ID))
        return PyLong_FromLong(-1);
    return PyLong_FromUnsignedLongLong(st.mnt_id);
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
    {"mount_id", sys_mount_id, METH_VARARGS, mount_id_doc},
    {"prctl", sys_prctl, METH_VARARGS, prctl_doc},
    {"capget", sys_capget, METH_NOARGS, capget_doc},
    {"capset", sys_capset, METH_VARARGS, capset_doc},
    {"listen_abstract", sys_listen_abstract, METH_VARARGS, listen_abstract_doc},
    {"accept_peer", sys_accept_peer, METH_VARARGS, accept_peer_doc},
    {"blake2b", sys_blake2b, METH_VARARGS, blake2b_doc},
    {"json_loads", sys_json_loads, METH_O, json_loads_doc},
    {"json_dumps", sys_json_dumps, METH_VARARGS, json_dumps_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sys_module = {
    PyModuleDef_HEAD_INIT, "nvctk._sys",
    "The Linux syscalls nvctk needs that os lacks, keyed BLAKE2b (libb2) and JSON (jansson); "
    "public C API only.", -1, sys_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__sys(void)
{
    codec_init();
    return PyModule_Create(&sys_module);
}
