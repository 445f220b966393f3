/* Byte ranges: CRCs of pieces, copies of spans, fused copies and CRCs (spans.c). */
#ifndef CKPTFS_SPANS_H
#define CKPTFS_SPANS_H
#include <Python.h>

/* 0 if [offset, offset + length) lies inside ``view``; else -1 with ValueError set. */
int range_in(Py_buffer *view, Py_ssize_t offset, Py_ssize_t length);

PyObject *use_isal_crc32_py(PyObject *self, PyObject *args);
PyObject *crc32_pieces_py(PyObject *self, PyObject *args);
PyObject *copy_spans_py(PyObject *self, PyObject *args);
PyObject *copy_spans_crc32_py(PyObject *self, PyObject *args);
PyObject *scatter_crc32_py(PyObject *self, PyObject *args);

#endif
