/* nvctk._sys's two halves (nvctk/_sys.c: the syscalls and the module; nvctk/_sys_codec.c:
 * keyed BLAKE2b and JSON): what the codec half gives the module's method table. */
#ifndef NVCTK_SYS_H
#define NVCTK_SYS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *sys_blake2b(PyObject *self, PyObject *args);
PyObject *sys_json_loads(PyObject *self, PyObject *arg);
PyObject *sys_json_dumps(PyObject *self, PyObject *args);
extern const char blake2b_doc[], json_loads_doc[], json_dumps_doc[];
void codec_init(void);  /* once, before the module is made */

#endif
