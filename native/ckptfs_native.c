/*
 * ckptfs._native: the few things Python cannot do on a shared mapping.
 *
 *  - 64-bit atomics on mapped memory (the latest pointer and the version counter live in the
 *    region's model table and are updated by several threads and processes at once);
 *  - crc32_combine, so per-chunk checksums computed on the write path give per-tensor checksums
 *    without re-reading the data;
 *  - byte ranges (crc.c, spans.c): the CRCs of a chunk's pieces in one call with the GIL released
 *    (ISA-L's CRC, found in the isal extension, where it is loaded), the snapshot copy (many
 *    (destination, source) ranges copied by several threads with the GIL released, because one
 *    thread of torch's element-wise copy does not reach the memory bandwidth a save's stall is
 *    measured against), and a load's copy out of its bounce buffers with the CRCs in one pass;
 *  - persistence of a range of a devdax mapping through libpmem (flush + fence), loaded with
 *    dlopen so that the extension builds and imports on machines without PMDK;
 *  - msync of a range of a file mapping with the GIL released (mmap.flush holds it for the
 *    whole disk flush, which stalls a training loop's Python thread behind every commit);
 *  - the bus guard (busguard.c): a SIGBUS in a region's mapping becomes a counted fault;
 *  - the usual items of a synthesized checkpoint.pt's pickle (torchpickle.c), which the mount
 *    writes for every tensor on the first stat of a version's files.
 *
 * Arguments are validated in Python (ckptfs/checksum.py, ckptfs/memcopy.py); here we only check
 * what would crash.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include "busguard.h"
#include "jsonviews.h"
#include "spans.h"
#include "torchpickle.h"

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

/* Parses (writable buffer, offset, length) and checks the range; on failure the buffer is
 * released and an exception set. */
static int
parse_buffer_range(PyObject *args, Py_buffer *view, Py_ssize_t *offset, Py_ssize_t *length)
{
    if (!PyArg_ParseTuple(args, "w*nn", view, offset, length))
        return -1;
    if (range_in(view, *offset, *length) < 0) {
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *
pmem_persist_py(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset, length;
    if (!load_pmem()) {
        PyErr_SetString(PyExc_OSError, "libpmem.so.1 is not available; install libpmem1");
        return NULL;
    }
    if (parse_buffer_range(args, &view, &offset, &length) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    p_persist((char *)view.buf + offset, (size_t)length);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* call(first page, length, arg) over the pages covering view[offset, offset+length) with the GIL
   released (msync, madvise); releases the view; OSError if it fails. */
static PyObject *
on_pages(Py_buffer *view, Py_ssize_t offset, Py_ssize_t length, int (*call)(void *, size_t, int), int arg)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)view->buf + (uintptr_t)offset;
    uintptr_t aligned = start - start % page;
    size_t span = (size_t)(start + (uintptr_t)length - aligned);
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = call((void *)aligned, span, arg);
    if (rc != 0)
        err = errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(view);
    if (rc != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* madvise(advice) of the pages covering buf[offset, offset+length), GIL released: mmap.madvise
   holds it, and MADV_POPULATE_WRITE of a staging pool faults in hundreds of MB (the writer does
   it on a thread of its own beside the training loop). */
static PyObject *
madvise_range(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset, length;
    int advice;
    if (!PyArg_ParseTuple(args, "w*nni", &view, &offset, &length, &advice))
        return NULL;
    if (range_in(&view, offset, length) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    return on_pages(&view, offset, length, madvise, advice);
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* populate_write(address, length) -> bool: MADV_POPULATE_WRITE of the whole pages inside
   [address, address + length) of memory the caller owns (a fresh tensor's), GIL released: its
   page faults, taken ahead of the copy that fills it; the contents are not touched. False where
   the kernel has no such advice (before Linux 5.14); other refusals are ignored (it is advice). */
static PyObject *
populate_write_py(PyObject *self, PyObject *args)
{
    unsigned long long address, length;
    if (!PyArg_ParseTuple(args, "KK", &address, &length))
        return NULL;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)address + page - 1) / page * page;
    uintptr_t hi = ((uintptr_t)address + (uintptr_t)length) / page * page;
    int rc = 0, err = 0;
    if (hi > lo) {
        Py_BEGIN_ALLOW_THREADS
        rc = madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE);
        err = errno;
        Py_END_ALLOW_THREADS
    }
    return PyBool_FromLong(!(rc != 0 && err == EINVAL));
}

/* msync(MS_SYNC) of the pages covering buf[offset, offset+length), GIL released. */
static PyObject *
msync_range(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t offset, length;
    if (parse_buffer_range(args, &view, &offset, &length) < 0)
        return NULL;
    return on_pages(&view, offset, length, msync, MS_SYNC);
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
    {"use_isal_crc32", use_isal_crc32_py, METH_VARARGS,
     "use_isal_crc32(path of the loaded isal extension) -> bool: crc32_pieces uses ISA-L's CRC (\"\": zlib's)"},
    {"crc32_pieces", crc32_pieces_py, METH_VARARGS,
     "crc32_pieces(src, [(tensor, tensor_start, length, src_offset)]) -> [CRC32], GIL released"},
    {"pmem_available", pmem_available, METH_NOARGS, "whether libpmem could be loaded"},
    {"pmem_persist", pmem_persist_py, METH_VARARGS, "pmem_persist(buf, offset, length)"},
    {"pmem_memcpy_persist", pmem_memcpy_persist_py, METH_VARARGS,
     "pmem_memcpy_persist(dst, offset, src)"},
    {"msync_range", msync_range, METH_VARARGS, "msync_range(mapping, offset, length): MS_SYNC, GIL released"},
    {"madvise_range", madvise_range, METH_VARARGS,
     "madvise_range(mapping, offset, length, advice): madvise, GIL released"},
    {"populate_write", populate_write_py, METH_VARARGS,
     "populate_write(address, length) -> bool: MADV_POPULATE_WRITE of the pages inside, GIL released"},
    {"pmem_is_pmem", pmem_is_pmem_py, METH_VARARGS, "pmem_is_pmem(buf) -> bool"},
    {"copy_spans", copy_spans_py, METH_VARARGS,
     "copy_spans(dst, [(dst_offset, src, src_offset, length), ...], threads)"},
    {"copy_spans_crc32", copy_spans_crc32_py, METH_VARARGS,
     "copy_spans_crc32(dst, [(dst_offset, src, src_offset, length)], pieces, threads) -> [CRC32 of each piece]"},
    {"scatter_crc32", scatter_crc32_py, METH_VARARGS,
     "scatter_crc32(src, addresses, sizes, [(target, dst_offset, length, src_offset)], pieces) -> [CRC32]"},
    {"safetensors_entries", safetensors_entries_py, METH_VARARGS,
     "safetensors_entries(pairs, heads, head_of) -> (entries bytes, merged extents, data bytes): jsonviews.c"},
    {"metadata_tensor_list", metadata_tensor_list_py, METH_VARARGS,
     "metadata_tensor_list(tensors, shapes, shape_of) -> str: jsonviews.c"},
    {"skeleton_json", skeleton_json_py, METH_VARARGS,
     "skeleton_json(skeleton, names) -> str: compact JSON, tensor references as names[r] (jsonviews.c)"},
    {"pickle_tensor_items", pickle_tensor_items_py, METH_VARARGS,
     "pickle_tensor_items(out, pairs, start, memo, tensor_memo, storage_order, tensors, templates, memo_size) "
     "-> (stop, memo_size): see torchpickle.c"},
    {"guard_mapping", guard_mapping_py, METH_VARARGS,
     "guard_mapping(mapping) -> slot: a SIGBUS inside it is counted, not fatal (busguard.c)"},
    {"mapping_faults", mapping_faults_py, METH_VARARGS,
     "mapping_faults(slot) -> (faults, offset of the first one or -1)"},
    {"unguard_mapping", unguard_mapping_py, METH_VARARGS, "unguard_mapping(slot): before the unmap"},
    {"poison_page", poison_page_py, METH_VARARGS,
     "poison_page(slot, offset): a fault there, as the handler records one (fault injection)"},
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
