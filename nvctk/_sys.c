/* nvctk._sys: the Linux syscalls nvctk's hook and runtime need that `os` lacks, and
 * keyed BLAKE2b for the MACs nvctk seals its records with (libb2), and JSON (jansson to
 * decode, a compact encoder) for nvctk.base.jsonio.
 *
 * The hook and the runtime run in every GPU container's start, so they avoid
 * ctypes (~4 ms to import) and any private interpreter module; this extension uses
 * Python's public C API only and costs a dlopen to import. Every wrapper raises
 * OSError(errno, "<syscall>: <strerror>") on failure (the errno picks the subclass,
 * e.g. FileNotFoundError), and returns an fd, an int or None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <blake2.h>
#include <jansson.h>

#include <errno.h>
#include <math.h>
#include <linux/capability.h>
#include <stdint.h>
#include <string.h>
#include <stddef.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/vfs.h>
#include <time.h>
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

/* Keyed BLAKE2b: the MAC of the records a create seals (nvctk.spec.record,
 * nvctk.vgpu.authority), from libb2 (the BLAKE2 authors' library). hashlib would do
 * the same, but importing it loads OpenSSL (_hashlib, ~2 ms), which every CDI-mode
 * create would pay; tests/unit/test_mac.py checks it against hashlib. */
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
        uint8_t out[64];
        if (blake2b(out, data.buf, key.len ? key.buf : NULL, (size_t)size, (size_t)data.len,
                    (size_t)key.len) != 0)
            PyErr_SetString(PyExc_ValueError, "blake2b: libb2 refused the input");
        else
            result = PyBytes_FromStringAndSize((const char *)out, size);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&key);
    return result;
}

/* JSON for nvctk.base.jsonio: decoding through jansson (a well-kept C library) into
 * Python objects, and a compact encoder written against json.dumps' output. The start
 * path cannot import `json` (it imports `re`, ~5.5 ms per process). The decoder
 * accepts only documents on which jansson and json agree, and raises ValueError for
 * everything else, which jsonio then hands to json itself: duplicate keys (json keeps
 * the last, jansson refuses), integers beyond long long, NaN/Infinity, lone surrogates,
 * invalid UTF-8, and nesting deeper than JSON_MAX_DEPTH (json's own limit is the
 * interpreter's recursion limit, so a deep document gets json's answer). */

#define JSON_MAX_DEPTH 200

static PyObject *
json_to_python(json_t *j, int depth)
{
    if (depth > JSON_MAX_DEPTH) {
        PyErr_SetString(PyExc_ValueError, "json_loads: nested deeper than nvctk decodes");
        return NULL;
    }
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        PyObject *d = PyDict_New();
        const char *key;
        size_t key_len;
        json_t *value;
        if (d == NULL)
            return NULL;
        json_object_keylen_foreach(j, key, key_len, value) {
            PyObject *k = PyUnicode_DecodeUTF8(key, (Py_ssize_t)key_len, "strict");
            PyObject *v = k ? json_to_python(value, depth + 1) : NULL;
            if (v == NULL || PyDict_SetItem(d, k, v) < 0) {
                Py_XDECREF(k);
                Py_XDECREF(v);
                Py_DECREF(d);
                return NULL;
            }
            Py_DECREF(k);
            Py_DECREF(v);
        }
        return d;
    }
    case JSON_ARRAY: {
        size_t n = json_array_size(j);
        PyObject *l = PyList_New((Py_ssize_t)n);
        if (l == NULL)
            return NULL;
        for (size_t i = 0; i < n; i++) {
            PyObject *v = json_to_python(json_array_get(j, i), depth + 1);
            if (v == NULL) {
                Py_DECREF(l);
                return NULL;
            }
            PyList_SET_ITEM(l, (Py_ssize_t)i, v);
        }
        return l;
    }
    case JSON_STRING:
        return PyUnicode_DecodeUTF8(json_string_value(j), (Py_ssize_t)json_string_length(j),
                                    "strict");
    case JSON_INTEGER:
        return PyLong_FromLongLong(json_integer_value(j));
    case JSON_REAL:  /* jansson reads it with strtod, correctly rounded as float() */
        return PyFloat_FromDouble(json_real_value(j));
    case JSON_TRUE:
        Py_RETURN_TRUE;
    case JSON_FALSE:
        Py_RETURN_FALSE;
    case JSON_NULL:
        Py_RETURN_NONE;
    }
    PyErr_SetString(PyExc_SystemError, "json_loads: unknown jansson type");
    return NULL;
}

PyDoc_STRVAR(json_loads_doc,
             "json_loads(data) -> value: a UTF-8 JSON document (str or bytes) as "
             "json.loads reads it; ValueError for anything it does not decode as json "
             "would (an invalid document, or one json reads differently from jansson)");

static PyObject *
sys_json_loads(PyObject *self, PyObject *arg)
{
    const char *buf;
    Py_ssize_t len;
    Py_buffer view = {0};
    if (PyUnicode_Check(arg)) {
        buf = PyUnicode_AsUTF8AndSize(arg, &len);
        if (buf == NULL) {  /* lone surrogates: not UTF-8 */
            if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
                return NULL;
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "json_loads: the text is not UTF-8");
            return NULL;
        }
    } else if (!PyBytes_Check(arg) && !PyByteArray_Check(arg)) {  /* json says what */
        PyErr_SetString(PyExc_ValueError, "json_loads: not str, bytes or bytearray");
        return NULL;
    } else {
        if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
            return NULL;
        buf = view.buf;
        len = view.len;
    }
    json_error_t error;
    /* a raw NUL is valid nowhere in JSON text, but jansson takes it for the end of the
       document ("0\0x" would decode as 0) */
    if (memchr(buf, '\0', (size_t)len) != NULL) {
        if (view.obj != NULL)
            PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "json_loads: a NUL byte in the text");
        return NULL;
    }
    json_t *j = json_loadb(buf, (size_t)len,
                           JSON_REJECT_DUPLICATES | JSON_DECODE_ANY | JSON_ALLOW_NUL, &error);
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    if (j == NULL) {
        PyErr_Format(PyExc_ValueError, "json_loads: %s (line %d, column %d)", error.text,
                     error.line, error.column);
        return NULL;
    }
    PyObject *result = json_to_python(j, 0);
    json_decref(j);
    return result;
}

/* The encoder: the text grows in a buffer of code points (lone surrogates included,
 * which a str may hold and json.dumps copies when ensure_ascii is false). */
typedef struct {
    Py_UCS4 *buf;
    size_t len, cap;
    int sort_keys, ensure_ascii;
    PyObject *markers;  /* ids of the containers being written: json's circular check */
} json_out;

static int
out_reserve(json_out *o, size_t more)
{
    if (o->len + more <= o->cap)
        return 0;
    size_t cap = o->cap ? o->cap : 256;
    while (cap < o->len + more) {
        if (cap > PY_SSIZE_T_MAX / 2 / sizeof(Py_UCS4)) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    Py_UCS4 *b = PyMem_Realloc(o->buf, cap * sizeof(Py_UCS4));
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->buf = b;
    o->cap = cap;
    return 0;
}

static int
out_ascii(json_out *o, const char *s)
{
    size_t n = strlen(s);
    if (out_reserve(o, n) < 0)
        return -1;
    for (size_t i = 0; i < n; i++)
        o->buf[o->len++] = (unsigned char)s[i];
    return 0;
}

static int
out_str(json_out *o, PyObject *s)  /* an ASCII str from a repr */
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    if (out_reserve(o, (size_t)n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        o->buf[o->len++] = PyUnicode_READ_CHAR(s, i);
    return 0;
}

static const char hexdigits[] = "0123456789abcdef";

static void
out_u_escape(json_out *o, Py_UCS4 c)  /* room for 6 reserved by the caller */
{
    Py_UCS4 *p = o->buf + o->len;
    p[0] = '\\';
    p[1] = 'u';
    p[2] = hexdigits[(c >> 12) & 0xf];
    p[3] = hexdigits[(c >> 8) & 0xf];
    p[4] = hexdigits[(c >> 4) & 0xf];
    p[5] = hexdigits[c & 0xf];
    o->len += 6;
}

/* a string as json's encode_basestring(_ascii) writes it */
static int
out_string(json_out *o, PyObject *s)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    if (out_reserve(o, 2) < 0)
        return -1;
    o->buf[o->len++] = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (out_reserve(o, 13) < 0)  /* a surrogate pair, and the closing quote */
            return -1;
        switch (c) {
        case '"': o->buf[o->len++] = '\\'; o->buf[o->len++] = '"'; continue;
        case '\\': o->buf[o->len++] = '\\'; o->buf[o->len++] = '\\'; continue;
        case '\b': o->buf[o->len++] = '\\'; o->buf[o->len++] = 'b'; continue;
        case '\f': o->buf[o->len++] = '\\'; o->buf[o->len++] = 'f'; continue;
        case '\n': o->buf[o->len++] = '\\'; o->buf[o->len++] = 'n'; continue;
        case '\r': o->buf[o->len++] = '\\'; o->buf[o->len++] = 'r'; continue;
        case '\t': o->buf[o->len++] = '\\'; o->buf[o->len++] = 't'; continue;
        }
        if (c < 0x20 || (o->ensure_ascii && c >= 0x7f && c < 0x10000)) {
            out_u_escape(o, c);
        } else if (o->ensure_ascii && c >= 0x10000) {  /* a surrogate pair */
            Py_UCS4 v = c - 0x10000;
            out_u_escape(o, 0xd800 | ((v >> 10) & 0x3ff));
            out_u_escape(o, 0xdc00 | (v & 0x3ff));
        } else {
            o->buf[o->len++] = c;
        }
    }
    o->buf[o->len++] = '"';
    return 0;
}

static int
out_float(json_out *o, PyObject *f)  /* json: Infinity/-Infinity/NaN, else float's repr */
{
    double v = PyFloat_AS_DOUBLE(f);
    if (!isfinite(v))
        return out_ascii(o, v > 0 ? "Infinity" : v < 0 ? "-Infinity" : "NaN");
    PyObject *r = PyFloat_Type.tp_repr(f);
    if (r == NULL)
        return -1;
    int rc = out_str(o, r);
    Py_DECREF(r);
    return rc;
}

static int
out_int(json_out *o, PyObject *i)  /* int's repr, as json (an IntEnum writes its value) */
{
    PyObject *r = PyLong_Type.tp_repr(i);
    if (r == NULL)
        return -1;
    int rc = out_str(o, r);
    Py_DECREF(r);
    return rc;
}

static int out_value(json_out *o, PyObject *v);

/* enter a container: -1 with ValueError when it is already being written */
static PyObject *
out_mark(json_out *o, PyObject *v)
{
    PyObject *id = PyLong_FromVoidPtr(v);
    if (id == NULL)
        return NULL;
    int has = PySet_Contains(o->markers, id);
    if (has != 0 || PySet_Add(o->markers, id) < 0) {
        if (has > 0)
            PyErr_SetString(PyExc_ValueError, "Circular reference detected");
        Py_DECREF(id);
        return NULL;
    }
    return id;
}

static int
out_unmark(json_out *o, PyObject *id, int rc)
{
    if (PySet_Discard(o->markers, id) < 0)
        rc = -1;
    Py_DECREF(id);
    return rc;
}

static int
out_dict(json_out *o, PyObject *d)
{
    if (PyDict_GET_SIZE(d) == 0)
        return out_ascii(o, "{}");
    PyObject *id = out_mark(o, d);
    if (id == NULL)
        return -1;
    int rc = -1;
    PyObject *items = PyMapping_Items(d);  /* json sorts the (key, value) pairs */
    if (items == NULL || (o->sort_keys && PyList_Sort(items) < 0) || out_ascii(o, "{") < 0)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GetItem(item, 0), *value = PyTuple_GetItem(item, 1);
        if (key == NULL || value == NULL || (i > 0 && out_ascii(o, ",") < 0))
            goto done;
        int krc;
        if (PyUnicode_Check(key)) {
            krc = out_string(o, key);
        } else {  /* json's key rules: written as a string of the key's JSON */
            PyObject *k = NULL;
            if (PyFloat_Check(key)) {
                double v = PyFloat_AS_DOUBLE(key);
                k = isfinite(v) ? PyFloat_Type.tp_repr(key)
                                : PyUnicode_FromString(v > 0 ? "Infinity" : v < 0 ? "-Infinity" : "NaN");
            } else if (key == Py_True || key == Py_False || key == Py_None) {
                k = PyUnicode_FromString(key == Py_True ? "true" : key == Py_False ? "false" : "null");
            } else if (PyLong_Check(key)) {
                k = PyLong_Type.tp_repr(key);
            } else {
                PyErr_Format(PyExc_TypeError,
                             "keys must be str, int, float, bool or None, not %.100s",
                             Py_TYPE(key)->tp_name);
            }
            if (k == NULL)
                goto done;
            krc = out_string(o, k);
            Py_DECREF(k);
        }
        if (krc < 0 || out_ascii(o, ":") < 0 || out_value(o, value) < 0)
            goto done;
    }
    rc = out_ascii(o, "}");
done:
    Py_XDECREF(items);
    return out_unmark(o, id, rc);
}

static int
out_sequence(json_out *o, PyObject *seq)
{
    PyObject *fast = PySequence_Fast(seq, "a list or tuple");
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) == 0) {
        Py_DECREF(fast);
        return out_ascii(o, "[]");
    }
    PyObject *id = out_mark(o, seq);
    int rc = -1;
    if (id == NULL) {
        Py_DECREF(fast);
        return -1;
    }
    if (out_ascii(o, "[") < 0)
        goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        if (i > 0 && out_ascii(o, ",") < 0)
            goto done;
        /* held: sorting a nested dict's keys runs their __lt__, which may edit this list */
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        Py_INCREF(item);
        int irc = out_value(o, item);
        Py_DECREF(item);
        if (irc < 0)
            goto done;
    }
    rc = out_ascii(o, "]");
done:
    Py_DECREF(fast);
    return out_unmark(o, id, rc);
}

/* json's order of checks: None, True, False, str, int, float, list/tuple, dict */
static int
out_value(json_out *o, PyObject *v)
{
    if (v == Py_None)
        return out_ascii(o, "null");
    if (v == Py_True)
        return out_ascii(o, "true");
    if (v == Py_False)
        return out_ascii(o, "false");
    if (PyUnicode_Check(v))
        return out_string(o, v);
    if (PyLong_Check(v))
        return out_int(o, v);
    if (PyFloat_Check(v))
        return out_float(o, v);
    if (PyList_Check(v) || PyTuple_Check(v) || PyDict_Check(v)) {
        if (Py_EnterRecursiveCall(" while encoding a JSON object"))
            return -1;
        int rc = PyDict_Check(v) ? out_dict(o, v) : out_sequence(o, v);
        Py_LeaveRecursiveCall();
        return rc;
    }
    PyObject *cls = PyObject_GetAttrString(v, "__class__");
    PyObject *name = cls ? PyObject_GetAttrString(cls, "__name__") : NULL;
    if (name != NULL)
        PyErr_Format(PyExc_TypeError, "Object of type %S is not JSON serializable", name);
    Py_XDECREF(cls);
    Py_XDECREF(name);
    return -1;
}

PyDoc_STRVAR(json_dumps_doc,
             "json_dumps(obj, sort_keys, ensure_ascii) -> str: json.dumps(obj, "
             "separators=(',', ':'), sort_keys=sort_keys, ensure_ascii=ensure_ascii), "
             "with the same TypeError/ValueError for what json refuses");

static PyObject *
sys_json_dumps(PyObject *self, PyObject *args)
{
    PyObject *obj;
    json_out o = {0};
    if (!PyArg_ParseTuple(args, "Opp:json_dumps", &obj, &o.sort_keys, &o.ensure_ascii))
        return NULL;
    o.markers = PySet_New(NULL);
    if (o.markers == NULL)
        return NULL;
    PyObject *result = NULL;
    if (out_value(&o, obj) == 0)
        result = PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, o.buf, (Py_ssize_t)o.len);
    PyMem_Free(o.buf);
    Py_DECREF(o.markers);
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
    /* jansson seeds its hash tables from /dev/urandom on first use: an open() of a path
       that, in a hook's mount namespace, a container may have replaced (a FIFO would
       block). getrandom(2) opens nothing. */
    uint32_t seed = 0;
    if (getrandom(&seed, sizeof seed, GRND_NONBLOCK) != (ssize_t)sizeof seed)
        seed = (uint32_t)time(NULL) ^ (uint32_t)getpid();
    json_object_seed(seed ? seed : 1);  /* 0 would ask jansson to pick one */
    return PyModule_Create(&sys_module);
}
