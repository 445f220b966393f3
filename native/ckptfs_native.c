/*
 * ckptfs._native: the few things Python cannot do on a shared mapping.
 *
 *  - 64-bit atomics on mapped memory (the latest pointer and the version counter live in the
 *    region's model table and are updated by several threads and processes at once);
 *  - crc32_combine, so per-chunk checksums computed on the write path give per-tensor checksums
 *    without re-reading the data, and the CRCs of a chunk's pieces in one call with the GIL
 *    released (ISA-L's CRC, found in the isal extension, where it is loaded);
 *  - persistence of a range of a devdax mapping through libpmem (flush + fence), loaded with
 *    dlopen so that the extension builds and imports on machines without PMDK;
 *  - msync of a range of a file mapping with the GIL released (mmap.flush holds it for the
 *    whole disk flush, which stalls a training loop's Python thread behind every commit);
 *  - the snapshot copy: many (destination, source) byte ranges copied by several threads with
 *    the GIL released, because one thread of torch's element-wise copy does not reach the
 *    memory bandwidth a save's stall is measured against;
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

/* CRC32 (zlib's polynomial and conventions) of many spans of one buffer: ISA-L's
 * crc32_gzip_refl where the isal extension that ckptfs.checksum uses is loaded and exports it
 * (use_isal_crc32), else zlib's. */
typedef uint32_t (*crc32_fn)(uint32_t, const unsigned char *, uint64_t);

static int range_in(Py_buffer *view, Py_ssize_t offset, Py_ssize_t length);

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

static crc32_fn p_crc32 = zlib_crc32;

static PyObject *
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
static PyObject *
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

/* A range of bytes to copy (dst, src, len); a piece to checksum keeps its index in dst. */
typedef struct {
    char *dst;
    const char *src;
    size_t len;
} span_t;

/* The ranges of crc32_pieces / scatter_crc32, checked: each 4-tuple of ``seq_in`` (``what``
 * names the sequence in its TypeError) as a span_t (PyMem_Calloc'd, the caller frees it) over
 * its bytes of src. Without ``addresses``, a piece to checksum (ckptfs.chunks.Piece: (tensor,
 * tensor_start, length, buffer_start)), whose index goes in dst; with them (and ``sizes``:
 * buffers of uint64, the data pointers and byte sizes of targets the caller keeps alive), a
 * span to copy, (target, dst_offset, length, src_offset), whose destination is dst.
 * *sorted_out: whether they come in the order of their bytes. Every index and range is checked
 * before any byte is touched; NULL with an exception set otherwise. */
static span_t *
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

#define PIECES_WHAT "pieces must be a sequence of (tensor, tensor_start, length, src_offset)"

/* crc32_pieces(src, pieces) -> [crc32 of src[src_offset:src_offset + length] for each piece]
 * (see parse_ranges): every range is checked first, then the CRCs are computed with the GIL
 * released (a Python loop over 40,000 pieces held it for most of their time). */
static PyObject *
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
    span_t *pieces = parse_ranges(&src, seq_in, PIECES_WHAT, NULL, NULL, &n, &sorted);
    if (pieces == NULL)
        goto done;
    crcs = PyMem_Calloc(n ? n : 1, sizeof(uint32_t));
    if (crcs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
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
    if (offset < 0 || length < 0 || offset > view->len || length > view->len - offset) { /* no overflow */
        PyErr_Format(PyExc_ValueError, "%zd bytes at offset %zd are outside a %zd-byte buffer",
                     length, offset, view->len);
        return -1;
    }
    return 0;
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

/* ------------------------------------------------------------------ parallel copy of spans */

typedef struct {
    const span_t *spans;
    Py_ssize_t nspans;
    size_t begin, end; /* byte range of the concatenated spans this thread copies */
} copy_job_t;

#if defined(__x86_64__)
#include <emmintrin.h>
/* Large spans are copied with non-temporal stores: the staging buffer is read next by the
 * device (DMA) and the CRC, not from this core's cache, and skipping the read-for-ownership of
 * every destination line cuts the memory traffic of the copy by a third. */
static void
copy_bytes(char *dst, const char *src, size_t n)
{
    if (n < (256u << 10)) {
        memcpy(dst, src, n);
        return;
    }
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (size_t blocks = n / 64; blocks; blocks--) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        src += 64;
        dst += 64;
    }
    memcpy(dst, src, n & 63);
}
#define copy_fence() _mm_sfence()
#else
#define copy_bytes memcpy
#define copy_fence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#endif

static void *
copy_job_run(void *arg)
{
    const copy_job_t *job = (const copy_job_t *)arg;
    size_t pos = 0;
    for (Py_ssize_t i = 0; i < job->nspans && pos < job->end; i++) {
        const span_t *s = &job->spans[i];
        size_t lo = job->begin > pos ? job->begin - pos : 0;
        size_t hi = job->end - pos < s->len ? job->end - pos : s->len;
        if (lo < hi)
            copy_bytes(s->dst + lo, s->src + lo, hi - lo);
        pos += s->len;
    }
    copy_fence(); /* streaming stores are weakly ordered: drain them before the join */
    return NULL;
}

#define COPY_THREADS_MAX 16

/* Splits the bytes evenly over the threads (a span may be cut between two of them); the calling
 * thread copies the first share. Falls back to fewer threads if one cannot be started. */
static void
copy_spans_parallel(const span_t *spans, Py_ssize_t nspans, size_t total, int threads)
{
    copy_job_t jobs[COPY_THREADS_MAX];
    pthread_t tids[COPY_THREADS_MAX];
    int started[COPY_THREADS_MAX] = {0};
    for (int t = 0; t < threads; t++) {
        jobs[t].spans = spans;
        jobs[t].nspans = nspans;
        jobs[t].begin = total / threads * t;
        jobs[t].end = t == threads - 1 ? total : total / threads * (t + 1);
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tids[t], NULL, copy_job_run, &jobs[t]) == 0;
    copy_job_run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            copy_job_run(&jobs[t]);
    }
}

/* Copies the checked spans over up to ``threads`` threads with the GIL released; returns None. */
static PyObject *
run_spans(const span_t *spans, Py_ssize_t n, size_t total, int threads)
{
    if (threads < 1)
        threads = 1;
    if (threads > COPY_THREADS_MAX)
        threads = COPY_THREADS_MAX;
    /* a thread costs tens of microseconds to start: not worth it below a few MiB */
    if (total < ((size_t)threads << 21))
        threads = total < (4u << 20) ? 1 : (int)(total >> 21);
    Py_BEGIN_ALLOW_THREADS
    copy_spans_parallel(spans, n, total, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* copy_spans(dst, spans, threads): spans is a sequence of (dst_offset, src, src_offset, length);
 * every src is a bytes-like object. Ranges are checked; overlapping destinations are the
 * caller's business (ckptfs never makes them). */
static PyObject *
copy_spans_py(PyObject *self, PyObject *args)
{
    Py_buffer dst;
    PyObject *seq_in;
    int threads;
    if (!PyArg_ParseTuple(args, "w*Oi", &dst, &seq_in, &threads))
        return NULL;
    PyObject *seq = PySequence_Fast(seq_in, "spans must be a sequence of (dst_offset, src, src_offset, length)");
    if (seq == NULL) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    span_t *spans = PyMem_Calloc(n ? n : 1, sizeof(span_t));
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    Py_ssize_t held = 0;
    size_t total = 0;
    PyObject *result = NULL;
    if (spans == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t dst_offset, src_offset, length;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyArg_ParseTuple(item, "ny*nn", &dst_offset, &views[i], &src_offset, &length))
            goto done;
        held++;
        if (range_in(&dst, dst_offset, length) < 0 || range_in(&views[i], src_offset, length) < 0)
            goto done;
        spans[i].dst = (char *)dst.buf + dst_offset;
        spans[i].src = (const char *)views[i].buf + src_offset;
        spans[i].len = (size_t)length;
        total += (size_t)length;
    }
    result = run_spans(spans, n, total, threads);
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(spans);
    Py_DECREF(seq);
    PyBuffer_Release(&dst);
    return result;
}

/* The bytes of src are copied and checksummed this much at a time: the CRC reads them from
 * memory into the core's cache, and the copy then reads them from there, not from memory a second
 * time (a load's checker, one thread: 4.7 GB/s with a copy and a CRC of each whole span, 5.8 GB/s
 * this way). */
#define FUSED_WINDOW_BYTES (256u << 10)

static int
span_src_order(const void *a, const void *b)
{
    const char *x = ((const span_t *)a)->src, *y = ((const span_t *)b)->src;
    return x < y ? -1 : x > y;
}

/* The ranges sorted by source that hold bytes of [lo, hi), from *first on: *first is moved past
 * those that end before lo (the ranges before *first all do); then, for each k from *first
 * while ranges[k] starts before hi, window_part gives the part of range k in the window. */
static void
window_start(const span_t *ranges, Py_ssize_t n, Py_ssize_t *first, const char *lo)
{
    while (*first < n && ranges[*first].src + ranges[*first].len <= lo)
        (*first)++;
}

/* The part [*a, *a + return) of ``r`` inside [lo, hi); 0 where there is none. */
static size_t
window_part(const span_t *r, const char *lo, const char *hi, const char **a)
{
    const char *start = r->src > lo ? r->src : lo;
    const char *end = r->src + r->len < hi ? r->src + r->len : hi;
    *a = start;
    return start < end ? (size_t)(end - start) : 0;
}

/* scatter_crc32(src, addresses, sizes, spans, pieces) -> [CRC32 of each piece's bytes of src]:
 * copies each span (target, dst_offset, length, src_offset) of src into memory given by address
 * (addresses and sizes: buffers of uint64, the data pointers and byte sizes of targets the
 * caller keeps alive, e.g. contiguous CPU tensors: a buffer object of each of 40,000 tensors
 * costs more than their copy), and takes the CRC32 of each piece (a 4-tuple whose last two items
 * are length and src_offset: ckptfs.chunks.Piece), both in one pass over src, window by window
 * (FUSED_WINDOW_BYTES). Every index and range is checked before any byte is copied. */
static PyObject *
scatter_crc32_py(PyObject *self, PyObject *args)
{
    Py_buffer src, addresses, sizes;
    PyObject *spans_in, *pieces_in;
    if (!PyArg_ParseTuple(args, "y*y*y*OO", &src, &addresses, &sizes, &spans_in, &pieces_in))
        return NULL;
    PyObject *result = NULL;
    span_t *spans = NULL, *pieces = NULL;
    uint32_t *crcs = NULL;
    Py_ssize_t ns, np = 0;
    int spans_sorted, sorted;
    spans = parse_ranges(&src, spans_in, "spans must be a sequence of (target, dst_offset, length, src_offset)",
                         &addresses, &sizes, &ns, &spans_sorted);
    if (spans == NULL)
        goto done;
    pieces = parse_ranges(&src, pieces_in, PIECES_WHAT, NULL, NULL, &np, &sorted);
    if (pieces == NULL)
        goto done;
    crcs = PyMem_Calloc(np ? np : 1, sizeof(uint32_t));
    if (crcs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    crc32_fn fn = p_crc32;
    Py_BEGIN_ALLOW_THREADS
    /* a chunk's pieces and the copy runs of whole tensors come in buffer order; the spans of
     * parts of tensors follow them */
    if (!sorted)
        qsort(pieces, (size_t)np, sizeof(span_t), span_src_order);
    if (!spans_sorted)
        qsort(spans, (size_t)ns, sizeof(span_t), span_src_order);
    const char *lo = NULL, *hi = NULL;
    for (Py_ssize_t i = 0; i < np + ns; i++) {
        const span_t *x = i < np ? &pieces[i] : &spans[i - np];
        if (x->len == 0)
            continue;
        if (lo == NULL || x->src < lo)
            lo = x->src;
        if (hi == NULL || x->src + x->len > hi)
            hi = x->src + x->len;
    }
    Py_ssize_t first_piece = 0, first_span = 0;
    for (const char *w = lo; w != NULL && w < hi; w += (hi - w < FUSED_WINDOW_BYTES ? hi - w : FUSED_WINDOW_BYTES)) {
        const char *we = hi - w < FUSED_WINDOW_BYTES ? hi : w + FUSED_WINDOW_BYTES;
        const char *a;
        window_start(pieces, np, &first_piece, w);
        for (Py_ssize_t k = first_piece; k < np && pieces[k].src < we; k++) {
            size_t len = window_part(&pieces[k], w, we, &a);
            Py_ssize_t at = (Py_ssize_t)(uintptr_t)pieces[k].dst;
            if (len)
                crcs[at] = fn(crcs[at], (const unsigned char *)a, (uint64_t)len);
        }
        window_start(spans, ns, &first_span, w);
        for (Py_ssize_t k = first_span; k < ns && spans[k].src < we; k++) {
            size_t len = window_part(&spans[k], w, we, &a);
            if (len)
                copy_bytes(spans[k].dst + (a - spans[k].src), a, len);
        }
    }
    copy_fence(); /* streaming stores are weakly ordered: drained before the caller reads the targets */
    Py_END_ALLOW_THREADS
    result = crc_list(crcs, np);
done:
    PyMem_Free(crcs);
    PyMem_Free(pieces);
    PyMem_Free(spans);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&addresses);
    PyBuffer_Release(&src);
    return result;
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
