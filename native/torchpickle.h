/* The usual dict items of data.pkl in C (torchpickle.c). */
#ifndef CKPTFS_TORCHPICKLE_H
#define CKPTFS_TORCHPICKLE_H
#include <Python.h>

PyObject *pickle_tensor_items_py(PyObject *self, PyObject *args);

#endif
