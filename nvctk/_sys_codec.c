/* nvctk._sys's codec half (nvctk/_sys.c is the module and its syscalls): keyed BLAKE2b
 * (libb2) and JSON (jansson to decode, a compact encoder of its own) for nvctk.base.jsonio.
 * Measured reasons (docs/decisions.md): hashlib would load OpenSSL and the json module
 * its own start cost in every GPU container's start. Python's public C API only. */
#include "_sys.h"

#include <blake2.h>
#include <jansson.h>

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

void
codec_init(void)
{
    /* jansson seeds its hash tables from /dev/urandom on first use: an open() of a path
       that, in a hook's mount namespace, a container may have replaced (a FIFO would
       block). getrandom(2) opens nothing. */
    uint32_t seed = 0;
    if (getrandom(&seed, sizeof seed, GRND_NONBLOCK) != (ssize_t)sizeof seed)
        seed = (uint32_t)time(NULL) ^ (uint32_t)getpid();
    json_object_seed(seed ? seed : 1);  /* 0 would ask jansson to pick one */
}

/* Keyed BLAKE2b: the MAC of the records a create seals (nvctk.spec.record,
 * nvctk.vgpu.authority), from libb2 (the BLAKE2 authors' library). hashlib would do
 * the same, but importing it loads OpenSSL (_hashlib, ~2 ms), which every CDI-mode
 * create would pay; tests/unit/test_mac.py checks it against hashlib. */
const char blake2b_doc[] = PyDoc_STR("blake2b(data, key, digest_size) -> bytes: keyed BLAKE2b, as hashlib."
    "blake2b(data, key=key, digest_size=digest_size).digest(); ValueError for a key over 64 bytes or a size outside 1..64");

PyObject *
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

const char json_loads_doc[] = PyDoc_STR("json_loads(data) -> value: a UTF-8 JSON document (str or bytes) as json.loads"
    " reads it; ValueError for anything it does not decode as json would (an invalid document, or one json reads"
    " differently from jansson)");

PyObject *
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
out_made(json_out *o, PyObject *text, int quoted)  /* text made for it (a new reference; NULL: failed) */
{
    if (text == NULL)
        return -1;
    int rc = quoted ? out_string(o, text) : out_str(o, text);
    Py_DECREF(text);
    return rc;
}

static int
out_float(json_out *o, PyObject *f)  /* json: Infinity/-Infinity/NaN, else float's repr */
{
    double v = PyFloat_AS_DOUBLE(f);
    if (!isfinite(v))
        return out_ascii(o, v > 0 ? "Infinity" : v < 0 ? "-Infinity" : "NaN");
    return out_made(o, PyFloat_Type.tp_repr(f), 0);
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

/* a container's items between its brackets, marked while written (a cycle is an error) */
static int
out_container(json_out *o, PyObject *v, PyObject *items, const char *open, const char *close,
              int (*body)(json_out *, PyObject *))
{
    PyObject *id = out_mark(o, v);
    if (id == NULL)
        return -1;
    int rc = out_ascii(o, open) < 0 || body(o, items) < 0 ? -1 : out_ascii(o, close);
    return out_unmark(o, id, rc);
}

static PyObject *
key_text(PyObject *key)  /* json's key rules: a key not a string is written as its JSON, quoted */
{
    if (PyFloat_Check(key)) {
        double v = PyFloat_AS_DOUBLE(key);
        return isfinite(v) ? PyFloat_Type.tp_repr(key)
                           : PyUnicode_FromString(v > 0 ? "Infinity" : v < 0 ? "-Infinity" : "NaN");
    }
    if (key == Py_True || key == Py_False || key == Py_None)
        return PyUnicode_FromString(key == Py_True ? "true" : key == Py_False ? "false" : "null");
    if (PyLong_Check(key))
        return PyLong_Type.tp_repr(key);
    PyErr_Format(PyExc_TypeError, "keys must be str, int, float, bool or None, not %.100s",
                 Py_TYPE(key)->tp_name);
    return NULL;
}

static int
out_key(json_out *o, PyObject *key)
{
    return PyUnicode_Check(key) ? out_string(o, key) : out_made(o, key_text(key), 1);
}

static int
out_pairs(json_out *o, PyObject *items)  /* a dict's (key, value) list */
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GetItem(item, 0), *value = PyTuple_GetItem(item, 1);
        if (key == NULL || value == NULL || (i > 0 && out_ascii(o, ",") < 0) || out_key(o, key) < 0 ||
            out_ascii(o, ":") < 0 || out_value(o, value) < 0)
            return -1;
    }
    return 0;
}

static int
out_dict(json_out *o, PyObject *d)
{
    if (PyDict_GET_SIZE(d) == 0)
        return out_ascii(o, "{}");
    PyObject *items = PyMapping_Items(d);  /* json sorts the (key, value) pairs */
    if (items == NULL)
        return -1;
    int rc = o->sort_keys && PyList_Sort(items) < 0 ? -1 : out_container(o, d, items, "{", "}", out_pairs);
    Py_DECREF(items);
    return rc;
}

static int
out_elements(json_out *o, PyObject *fast)  /* a list's or tuple's items */
{
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        if (i > 0 && out_ascii(o, ",") < 0)
            return -1;
        /* held: sorting a nested dict's keys runs their __lt__, which may edit this list */
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        Py_INCREF(item);
        int irc = out_value(o, item);
        Py_DECREF(item);
        if (irc < 0)
            return -1;
    }
    return 0;
}

static int
out_sequence(json_out *o, PyObject *seq)
{
    PyObject *fast = PySequence_Fast(seq, "a list or tuple");
    if (fast == NULL)
        return -1;
    int rc = PySequence_Fast_GET_SIZE(fast) == 0 ? out_ascii(o, "[]")
                                                 : out_container(o, seq, fast, "[", "]", out_elements);
    Py_DECREF(fast);
    return rc;
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
    if (PyLong_Check(v))  /* int's repr, as json (an IntEnum writes its value) */
        return out_made(o, PyLong_Type.tp_repr(v), 0);
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

const char json_dumps_doc[] = PyDoc_STR(
             "json_dumps(obj, sort_keys, ensure_ascii) -> str: json.dumps(obj, "
             "separators=(',', ':'), sort_keys=sort_keys, ensure_ascii=ensure_ascii), "
             "with the same TypeError/ValueError for what json refuses");

PyObject *
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

