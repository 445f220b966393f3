/* Byte ranges of ckptfs._native: CRCs of pieces and the parsing of ranges (crc.c), copies of
 * spans with or without CRCs (spans.c). */
#ifndef CKPTFS_SPANS_H
#define CKPTFS_SPANS_H
#include <Python.h>
#include <stdint.h>

/* CRC32 (zlib's polynomial and conventions), continuing from crc: ISA-L's crc32_gzip_refl where
 * use_isal_crc32 found it, else zlib's. */
typedef uint32_t (*crc32_fn)(uint32_t, const unsigned char *, uint64_t);
extern crc32_fn p_crc32;

/* A range of bytes to copy (dst, src, len); a piece to checksum keeps its index in dst. */
typedef struct {
    char *dst;
    const char *src;
    size_t len;
} span_t;

#define PIECES_WHAT "pieces must be a sequence of (tensor, tensor_start, length, src_offset)"

/* 0 if [offset, offset + length) lies inside ``view``; else -1 with ValueError set. */
int range_in(Py_buffer *view, Py_ssize_t offset, Py_ssize_t length);

/* The ranges of ``seq_in`` over ``src``, checked (see crc.c); PyMem_Calloc'd, NULL with an
 * exception set on a bad one. */
span_t *parse_ranges(Py_buffer *src, PyObject *seq_in, const char *what, Py_buffer *addresses, Py_buffer *sizes,
                     Py_ssize_t *n_out, int *sorted_out);

/* parse_ranges of a chunk's pieces (ckptfs.chunks.Piece) over ``src``, and *crcs_out: a zeroed
 * CRC for each (both PyMem, the caller frees them); NULL with an exception set, nothing to free. */
span_t *parse_pieces(Py_buffer *src, PyObject *pieces_in, Py_ssize_t *n_out, int *sorted_out, uint32_t **crcs_out);

/* The list of ``n`` CRCs as Python ints; NULL with an exception set on failure. */
PyObject *crc_list(const uint32_t *crcs, Py_ssize_t n);

PyObject *use_isal_crc32_py(PyObject *self, PyObject *args);
PyObject *crc32_pieces_py(PyObject *self, PyObject *args);
PyObject *copy_spans_py(PyObject *self, PyObject *args);
PyObject *copy_spans_crc32_py(PyObject *self, PyObject *args);
PyObject *scatter_crc32_py(PyObject *self, PyObject *args);

#endif
