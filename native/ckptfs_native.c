/*
 * ckptfs._native: the few things Python cannot do on a shared mapping.
 *
 *  - 64-bit atomics on mapped memory (the latest pointer and the version counter live in the
 *    region's model table and are updated by several threads and processes at once);
 *  - crc32_combine, so per-chunk checksums computed on the write path give per-tensor checksums
 *    without re-reading the data;
 *  - persistence of a range of a devdax mapping through libpmem (flush + fence), loaded with
 *    dlopen so that the extension builds and imports on machines without PMDK.
 *
 * Arguments are validated in Python (ckptfs/native.py); here we only check what would crash.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

static int
word_at(Py_buffer *view, Py_ssize_t offset, int writable, uint64_t **out)
{
    if (offset < 0 || offset % 8 != 0 || offset + 8 > view->len) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not an aligned 8-byte word inside a %zd-byte buffer",
                     offset, view->len);
        return -1;
    }
    if (writable && view->readonly) {
        PyErr_SetString(PyExc_ValueError, "buffer is read-only");
        return -1;
    }
    *out = (uint64_t *)((char *)view->buf + offset);
    return 0;
}

static PyObject *
atomic_load_u64(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset;
    uint64_t *word;
    if (!PyArg_ParseTuple(args, "y*n", &view, &offset))
        return NULL;
    if (word_at(&view, offset, 0, &word) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *
atomic_store_u64(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset;
    unsigned long long value;
    uint64_t *word;
    if (!PyArg_ParseTuple(args, "w*nK", &view, &offset, &value))
        return NULL;
    if (word_at(&view, offset, 1, &word) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    __atomic_store_n(word, (uint64_t)value, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* Returns (swapped, value seen before the attempt). */
static PyObject *
atomic_cas_u64(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset;
    unsigned long long expected, desired;
    uint64_t *word;
    if (!PyArg_ParseTuple(args, "w*nKK", &view, &offset, &expected, &desired))
        return NULL;
    if (word_at(&view, offset, 1, &word) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t seen = (uint64_t)expected;
    int swapped = __atomic_compare_exchange_n(word, &seen, (uint64_t)desired, 0,
                                              __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return Py_BuildValue("(NK)", PyBool_FromLong(swapped), (unsigned long long)seen);
}

static PyObject *
atomic_fetch_add_u64(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset;
    unsigned long long delta;
    uint64_t *word;
    if (!PyArg_ParseTuple(args, "w*nK", &view, &offset, &delta))
        return NULL;
    if (word_at(&view, offset, 1, &word) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t old = __atomic_fetch_add(word, (uint64_t)delta, __ATOMIC_ACQ_REL);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(old);
}

static PyObject *
crc32_combine_py(PyObject *self, PyObject *args)
{
    unsigned long crc1, crc2;
    long long len2;
    if (!PyArg_ParseTuple(args, "kkL", &crc1, &crc2, &len2))
        return NULL;
    if (len2 < 0) {
        PyErr_SetString(PyExc_ValueError, "len2 must be >= 0");
        return NULL;
    }
    return PyLong_FromUnsignedLong(crc32_combine64(crc1, crc2, (z_off64_t)len2) & 0xffffffffUL);
}

/* libpmem, resolved lazily. */
typedef void (*pmem_persist_fn)(const void *, size_t);
typedef void *(*pmem_memcpy_persist_fn)(void *, const void *, size_t);
typedef int (*pmem_is_pmem_fn)(const void *, size_t);
static pmem_persist_fn p_persist;
static pmem_memcpy_persist_fn p_memcpy_persist;
static pmem_is_pmem_fn p_is_pmem;
static int pmem_tried;

static int
load_pmem(void)
{
    if (!pmem_tried) {
        pmem_tried = 1;
        void *lib = dlopen("libpmem.so.1", RTLD_NOW | RTLD_LOCAL);
        if (lib) {
            p_persist = (pmem_persist_fn)dlsym(lib, "pmem_persist");
            p_memcpy_persist = (pmem_memcpy_persist_fn)dlsym(lib, "pmem_memcpy_persist");
            p_is_pmem = (pmem_is_pmem_fn)dlsym(lib, "pmem_is_pmem");
        }
    }
    return p_persist && p_memcpy_persist && p_is_pmem;
}

static PyObject *
pmem_available(PyObject *self, PyObject *noargs)
{
    return PyBool_FromLong(load_pmem());
}

static int
range_in(Py_buffer *view, Py_ssize_t offset, Py_ssize_t length)
{
    if (offset < 0 || length < 0 || offset + length > view->len) {
        PyErr_Format(PyExc_ValueError, "range [%zd, %zd) is outside a %zd-byte buffer",
                     offset, offset + length, view->len);
        return -1;
    }
    return 0;
}

static PyObject *
pmem_persist_py(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset, length;
    if (!PyArg_ParseTuple(args, "w*nn", &view, &offset, &length))
        return NULL;
    if (!load_pmem()) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_OSError, "libpmem.so.1 is not available; install libpmem1");
        return NULL;
    }
    if (range_in(&view, offset, length) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    p_persist((char *)view.buf + offset, (size_t)length);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* Copies src into dst[offset:] with non-temporal stores and a final fence (devdax write path). */
static PyObject *
pmem_memcpy_persist_py(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "w*ny*", &dst, &offset, &src))
        return NULL;
    PyObject *result = NULL;
    if (!load_pmem()) {
        PyErr_SetString(PyExc_OSError, "libpmem.so.1 is not available; install libpmem1");
    } else if (range_in(&dst, offset, src.len) == 0) {
        Py_BEGIN_ALLOW_THREADS
        p_memcpy_persist((char *)dst.buf + offset, src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyObject *
pmem_is_pmem_py(PyObject *self, PyObject *args)
{
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view))
        return NULL;
    int result = load_pmem() ? p_is_pmem(view.buf, (size_t)view.len) : 0;
    PyBuffer_Release(&view);
    return PyBool_FromLong(result);
}

static PyMethodDef methods[] = {
    {"atomic_load_u64", atomic_load_u64, METH_VARARGS, "atomic_load_u64(buf, offset) -> int"},
    {"atomic_store_u64", atomic_store_u64, METH_VARARGS, "atomic_store_u64(buf, offset, value)"},
    {"atomic_cas_u64", atomic_cas_u64, METH_VARARGS,
     "atomic_cas_u64(buf, offset, expected, desired) -> (swapped, seen)"},
    {"atomic_fetch_add_u64", atomic_fetch_add_u64, METH_VARARGS,
     "atomic_fetch_add_u64(buf, offset, delta) -> previous value"},
    {"crc32_combine", crc32_combine_py, METH_VARARGS,
     "crc32_combine(crc1, crc2, len2) -> CRC32 of the concatenation"},
    {"pmem_available", pmem_available, METH_NOARGS, "whether libpmem could be loaded"},
    {"pmem_persist", pmem_persist_py, METH_VARARGS, "pmem_persist(buf, offset, length)"},
    {"pmem_memcpy_persist", pmem_memcpy_persist_py, METH_VARARGS,
     "pmem_memcpy_persist(dst, offset, src)"},
    {"pmem_is_pmem", pmem_is_pmem_py, METH_VARARGS, "pmem_is_pmem(buf) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ckptfs._native", "Private native helpers of ckptfs.", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModule_Create(&module);
}
