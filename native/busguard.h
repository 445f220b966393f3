/* The bus guard (busguard.c): SIGBUS in a region's mapping becomes a counted fault. */
#ifndef CKPTFS_BUSGUARD_H
#define CKPTFS_BUSGUARD_H
#include <Python.h>

PyObject *guard_mapping_py(PyObject *self, PyObject *args);
PyObject *mapping_faults_py(PyObject *self, PyObject *args);
PyObject *unguard_mapping_py(PyObject *self, PyObject *args);
PyObject *poison_page_py(PyObject *self, PyObject *args);

#endif
