/* The per-tensor loops of the safetensors and metadata.json views in C (jsonviews.c). */
#ifndef CKPTFS_JSONVIEWS_H
#define CKPTFS_JSONVIEWS_H
#include <Python.h>

PyObject *safetensors_entries_py(PyObject *self, PyObject *args);
PyObject *metadata_tensor_list_py(PyObject *self, PyObject *args);
PyObject *skeleton_json_py(PyObject *self, PyObject *args);

#endif
