/*
 * CRC32s of byte ranges for ckptfs._native (ckptfs/checksum.py): ISA-L's CRC where the isal
 * extension is loaded (else zlib's), the CRCs of a chunk's pieces in one call with the GIL
 * released, and the checked parsing of the ranges that spans.c copies and checksums.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "spans.h"

/* The four integers of a chunk's piece (ckptfs.chunks.Piece: (tensor, tensor_start, length,
 * buffer_start)), read straight from the tuple: crc32_pieces and scatter_crc32 take 40,000 of
 * them per chunk of small tensors. -1 with an exception set if ``item`` is not such a tuple. */
static int
piece_fields(PyObject *item, Py_ssize_t out[4])
{
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
        PyErr_SetString(PyExc_TypeError, "a piece is a 4-tuple of ints (target, offset, length, src_offset)");
        return -1;
    }
    for (int k = 0; k < 4; k++) {
        out[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, k));
        if (out[k] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* zlib's CRC32 for a length past its 32-bit argument: the CRC until use_isal_crc32 finds
 * ISA-L's crc32_gzip_refl in the isal extension that ckptfs.checksum loads. */
static uint32_t
zlib_crc32(uint32_t crc, const unsigned char *buf, uint64_t len)
{
    while (len > 0) {
        uInt n = len > 0x40000000u ? 0x40000000u : (uInt)len;
        crc = (uint32_t)crc32(crc, buf, n);
        buf += n;
        len -= n;
    }
    return crc;
}

crc32_fn p_crc32 = zlib_crc32;

PyObject *
use_isal_crc32_py(PyObject *self, PyObject *args)
{
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    void *lib = *path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
    crc32_fn fn = lib ? (crc32_fn)dlsym(lib, "crc32_gzip_refl") : NULL;
    p_crc32 = fn ? fn : zlib_crc32; /* "" (or an extension without it): zlib's */
    return PyBool_FromLong(fn != NULL);
}

/* The list of ``n`` CRCs as Python ints; NULL with an exception set on failure. */
PyObject *
crc_list(const uint32_t *crcs, Py_ssize_t n)
{
    PyObject *result = PyList_New(n);
    if (result == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
        if (v == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        PyList_SET_ITEM(result, i, v);
    }
    return result;
}

/* The ranges of crc32_pieces / scatter_crc32, checked: each 4-tuple of ``seq_in`` (``what``
 * names the sequence in its TypeError) as a span_t (PyMem_Calloc'd, the caller frees it) over
 * its bytes of src. Without ``addresses``, a piece to checksum (ckptfs.chunks.Piece: (tensor,
 * tensor_start, length, buffer_start)), whose index goes in dst; with them (and ``sizes``:
 * buffers of uint64, the data pointers and byte sizes of targets the caller keeps alive), a
 * span to copy, (target, dst_offset, length, src_offset), whose destination is dst.
 * *sorted_out: whether they come in the order of their bytes. Every index and range is checked
 * before any byte is touched; NULL with an exception set otherwise. */
span_t *
parse_ranges(Py_buffer *src, PyObject *seq_in, const char *what, Py_buffer *addresses, Py_buffer *sizes,
             Py_ssize_t *n_out, int *sorted_out)
{
    Py_ssize_t targets = addresses ? addresses->len / 8 : 0;
    if (addresses && (addresses->len % 8 || sizes->len != addresses->len)) {
        PyErr_SetString(PyExc_ValueError, "addresses and sizes must be uint64 buffers of the same length");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(seq_in, what);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    span_t *ranges = PyMem_Calloc(n ? n : 1, sizeof(span_t));
    if (ranges == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t f[4];
        if (piece_fields(PySequence_Fast_GET_ITEM(seq, i), f) < 0)
            goto fail;
        Py_ssize_t target = f[0], dst_offset = f[1], length = f[2], src_offset = f[3];
        if (addresses) {
            if (target < 0 || target >= targets) {
                PyErr_Format(PyExc_ValueError, "target %zd of %zd", target, targets);
                goto fail;
            }
            uint64_t address, size;
            memcpy(&address, (const char *)addresses->buf + 8 * target, 8);
            memcpy(&size, (const char *)sizes->buf + 8 * target, 8);
            if (dst_offset < 0 || length < 0 || (uint64_t)dst_offset > size
                    || (uint64_t)length > size - (uint64_t)dst_offset) {
                PyErr_Format(PyExc_ValueError, "%zd bytes at offset %zd are outside target %zd's %llu bytes",
                             length, dst_offset, target, (unsigned long long)size);
                goto fail;
            }
            ranges[i].dst = (char *)(uintptr_t)address + dst_offset;
        } else {
            ranges[i].dst = (char *)(uintptr_t)i; /* its place in the result, through a sort */
        }
        if (range_in(src, src_offset, length) < 0)
            goto fail;
        ranges[i].src = (const char *)src->buf + src_offset;
        ranges[i].len = (size_t)length;
        sorted &= i == 0 || ranges[i - 1].src <= ranges[i].src;
    }
    Py_DECREF(seq);
    *n_out = n;
    *sorted_out = sorted;
    return ranges;
fail:
    PyMem_Free(ranges);
    Py_DECREF(seq);
    return NULL;
}

span_t *
parse_pieces(Py_buffer *src, PyObject *pieces_in, Py_ssize_t *n_out, int *sorted_out, uint32_t **crcs_out)
{
    span_t *pieces = parse_ranges(src, pieces_in, PIECES_WHAT, NULL, NULL, n_out, sorted_out);
    if (pieces == NULL)
        return NULL;
    *crcs_out = PyMem_Calloc(*n_out ? *n_out : 1, sizeof(uint32_t));
    if (*crcs_out == NULL) {
        PyMem_Free(pieces);
        PyErr_NoMemory();
        return NULL;
    }
    return pieces;
}

/* crc32_pieces(src, pieces) -> [crc32 of src[src_offset:src_offset + length] for each piece]
 * (see parse_ranges): every range is checked first, then the CRCs are computed with the GIL
 * released (a Python loop over 40,000 pieces held it for most of their time). */
PyObject *
crc32_pieces_py(PyObject *self, PyObject *args)
{
    Py_buffer src;
    PyObject *seq_in;
    if (!PyArg_ParseTuple(args, "y*O", &src, &seq_in))
        return NULL;
    PyObject *result = NULL;
    uint32_t *crcs = NULL;
    Py_ssize_t n;
    int sorted;
    span_t *pieces = parse_pieces(&src, seq_in, &n, &sorted, &crcs);
    if (pieces == NULL)
        goto done;
    crc32_fn fn = p_crc32;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        crcs[i] = fn(0, (const unsigned char *)pieces[i].src, (uint64_t)pieces[i].len);
    Py_END_ALLOW_THREADS
    result = crc_list(crcs, n);
done:
    PyMem_Free(crcs);
    PyMem_Free(pieces);
    PyBuffer_Release(&src);
    return result;
}


int
range_in(Py_buffer *view, Py_ssize_t offset, Py_ssize_t length)
{
    if (offset < 0 || length < 0 || offset > view->len || length > view->len - offset) { /* no overflow */
        PyErr_Format(PyExc_ValueError, "%zd bytes at offset %zd are outside a %zd-byte buffer",
                     length, offset, view->len);
        return -1;
    }
    return 0;
}
