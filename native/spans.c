/*
 * Copies of byte ranges for ckptfs._native (ckptfs/memcopy.py): the snapshot's multi-threaded copy
 * of spans into a staging buffer, with or without the CRCs of its pieces taken in the same pass,
 * and a load's copy out of a bounce buffer into tensors with its CRCs. Every range is checked
 * (crc.c's parse_ranges, range_in) before any byte is touched; the work runs with the GIL
 * released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "spans.h"

/* ------------------------------------------------------------------ parallel copy of spans */

/* The bytes are copied and checksummed this much at a time: the CRC reads them from memory into
 * the core's cache, and the copy then reads them from there, not from memory a second time (a
 * load's checker, one thread: 4.7 GB/s with a copy and a CRC of each whole span, 5.8 GB/s this
 * way). */
#define FUSED_WINDOW_BYTES (256u << 10)

static int
span_src_order(const void *a, const void *b)
{
    const char *x = ((const span_t *)a)->src, *y = ((const span_t *)b)->src;
    return x < y ? -1 : x > y;
}

static int
span_dst_order(const void *a, const void *b)
{
    const char *x = ((const span_t *)a)->dst, *y = ((const span_t *)b)->dst;
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

typedef struct {
    const span_t *spans;
    Py_ssize_t nspans;
    size_t begin, end; /* byte range of the concatenated spans this thread copies */
    /* copy_spans_crc32: the pieces to checksum, sorted by their place in the destination (a
     * piece's src is that place, its dst its index), and this thread's CRC and byte count of
     * each; NULL for a copy alone */
    const span_t *pieces;
    Py_ssize_t npieces;
    uint32_t *crcs;
    uint64_t *lens;
    crc32_fn crc;
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

/* Bytes [lo, hi) of span ``s``, window by window: the CRCs of the pieces' parts in the window,
 * taken from the source, then the copy of the window from the cache the CRC left it in.
 * ``*first``: the first piece that may still be in a window (the windows come in order). */
static void
copy_crc_part(const copy_job_t *job, const span_t *s, size_t lo, size_t hi, Py_ssize_t *first)
{
    while (lo < hi) {
        size_t end = hi - lo < FUSED_WINDOW_BYTES ? hi : lo + FUSED_WINDOW_BYTES;
        const char *w = s->dst + lo, *we = s->dst + end, *a;
        window_start(job->pieces, job->npieces, first, w);
        for (Py_ssize_t k = *first; k < job->npieces && job->pieces[k].src < we; k++) {
            size_t len = window_part(&job->pieces[k], w, we, &a);
            Py_ssize_t at = (Py_ssize_t)(uintptr_t)job->pieces[k].dst;
            if (len) {
                job->crcs[at] = job->crc(job->crcs[at], (const unsigned char *)s->src + (a - s->dst), len);
                job->lens[at] += len;
            }
        }
        copy_bytes(s->dst + lo, s->src + lo, end - lo);
        lo = end;
    }
}

static void *
copy_job_run(void *arg)
{
    const copy_job_t *job = (const copy_job_t *)arg;
    size_t pos = 0;
    Py_ssize_t first = 0;
    for (Py_ssize_t i = 0; i < job->nspans && pos < job->end; i++) {
        const span_t *s = &job->spans[i];
        size_t lo = job->begin > pos ? job->begin - pos : 0;
        size_t hi = job->end - pos < s->len ? job->end - pos : s->len;
        if (lo < hi) {
            if (job->pieces)
                copy_crc_part(job, s, lo, hi, &first);
            else
                copy_bytes(s->dst + lo, s->src + lo, hi - lo);
        }
        pos += s->len;
    }
    copy_fence(); /* streaming stores are weakly ordered: drain them before the join */
    return NULL;
}

#define COPY_THREADS_MAX 16

/* The threads worth starting for ``total`` bytes, of the ``threads`` asked for. */
static int
copy_threads(size_t total, int threads)
{
    if (threads < 1)
        threads = 1;
    if (threads > COPY_THREADS_MAX)
        threads = COPY_THREADS_MAX;
    /* a thread costs tens of microseconds to start: not worth it below a few MiB */
    if (total < ((size_t)threads << 21))
        threads = total < (4u << 20) ? 1 : (int)(total >> 21);
    return threads;
}

/* Runs jobs[0..threads) (copy_threads' count), each filled in but for its byte range: the bytes
 * are split evenly (a span may be cut between two threads, the earlier bytes to the earlier
 * thread); the calling thread runs the first share. Falls back to fewer threads if one cannot be
 * started. Call with the GIL released. */
static void
copy_spans_parallel(copy_job_t *jobs, size_t total, int threads)
{
    pthread_t tids[COPY_THREADS_MAX];
    int started[COPY_THREADS_MAX] = {0};
    for (int t = 0; t < threads; t++) {
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

#define SPANS_WHAT "spans must be a sequence of (dst_offset, src, src_offset, length)"

/* The spans (dst_offset, src, src_offset, length) of copy_spans / copy_spans_crc32 over ``dst``,
 * checked: *spans (PyMem_Calloc'd) and *views (the n source buffers, of which *held are to be
 * released) for the caller to free, *total their bytes, *sorted whether they come in the order
 * of their destinations. -1 with an exception set on a bad span. */
static int
parse_copy_spans(Py_buffer *dst, PyObject *seq_in, span_t **spans, Py_buffer **views, Py_ssize_t *held,
                 Py_ssize_t *n_out, size_t *total, int *sorted)
{
    PyObject *seq = PySequence_Fast(seq_in, SPANS_WHAT);
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int rc = -1;
    *spans = PyMem_Calloc(n ? n : 1, sizeof(span_t));
    *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    *held = 0;
    *total = 0;
    *sorted = 1;
    if (*spans == NULL || *views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t dst_offset, src_offset, length;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyArg_ParseTuple(item, "ny*nn", &dst_offset, &(*views)[i], &src_offset, &length))
            goto done;
        (*held)++;
        if (range_in(dst, dst_offset, length) < 0 || range_in(&(*views)[i], src_offset, length) < 0)
            goto done;
        span_t *s = &(*spans)[i];
        s->dst = (char *)dst->buf + dst_offset;
        s->src = (const char *)(*views)[i].buf + src_offset;
        s->len = (size_t)length;
        *total += (size_t)length;
        *sorted &= i == 0 || s[-1].dst <= s->dst;
    }
    *n_out = n;
    rc = 0;
done:
    Py_DECREF(seq);
    return rc;
}

static void
release_views(Py_buffer *views, Py_ssize_t held)
{
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
}

/* copy_spans(dst, spans, threads): spans is a sequence of (dst_offset, src, src_offset, length);
 * every src is a bytes-like object. Ranges are checked; overlapping destinations are the
 * caller's business (ckptfs never makes them). The bytes are copied by up to ``threads``
 * threads with the GIL released. */
PyObject *
copy_spans_py(PyObject *self, PyObject *args)
{
    Py_buffer dst;
    PyObject *seq_in;
    int threads;
    if (!PyArg_ParseTuple(args, "w*Oi", &dst, &seq_in, &threads))
        return NULL;
    span_t *spans = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t held = 0, n = 0;
    size_t total;
    int sorted;
    PyObject *result = NULL;
    if (parse_copy_spans(&dst, seq_in, &spans, &views, &held, &n, &total, &sorted) == 0) {
        copy_job_t jobs[COPY_THREADS_MAX] = {{0}};
        int threads_run = copy_threads(total, threads);
        for (int t = 0; t < threads_run; t++) {
            jobs[t].spans = spans;
            jobs[t].nspans = n;
        }
        Py_BEGIN_ALLOW_THREADS
        copy_spans_parallel(jobs, total, threads_run);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    release_views(views, held);
    PyMem_Free(spans);
    PyBuffer_Release(&dst);
    return result;
}

/* copy_spans_crc32(dst, spans, pieces, threads) -> [CRC32 of each piece's bytes of dst]: the
 * copy of copy_spans, and the CRC32 of each piece (a 4-tuple whose last two items are length
 * and offset in dst: ckptfs.chunks.Piece) in the same pass, window by window
 * (FUSED_WINDOW_BYTES): each thread checksums its share of the bytes from the source, then
 * copies it from the cache, and its CRCs of a piece's parts are combined (crc32_combine) in
 * the order of the bytes. A snapshot reads its tensors from memory once, where a copy and then
 * a CRC of the staging buffer read the bytes twice. Every piece must lie inside the spans'
 * destinations (ValueError otherwise, before the CRCs are returned). */
PyObject *
copy_spans_crc32_py(PyObject *self, PyObject *args)
{
    Py_buffer dst;
    PyObject *seq_in, *pieces_in;
    int threads;
    if (!PyArg_ParseTuple(args, "w*OOi", &dst, &seq_in, &pieces_in, &threads))
        return NULL;
    span_t *spans = NULL, *pieces = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t held = 0, n = 0, np = 0;
    size_t total;
    int spans_sorted, sorted;
    uint32_t *crcs = NULL;
    uint64_t *lens = NULL;
    PyObject *result = NULL;
    if (parse_copy_spans(&dst, seq_in, &spans, &views, &held, &n, &total, &spans_sorted) < 0)
        goto done;
    pieces = parse_ranges(&dst, pieces_in, PIECES_WHAT, NULL, NULL, &np, &sorted);
    if (pieces == NULL)
        goto done;
    int threads_run = copy_threads(total, threads);
    /* per thread, its CRC and byte count of each piece; then, in crcs[0..np), the whole CRCs */
    crcs = PyMem_Calloc((size_t)(np ? np : 1) * (threads_run + 1), sizeof(uint32_t));
    lens = PyMem_Calloc((size_t)(np ? np : 1) * threads_run, sizeof(uint64_t));
    if (crcs == NULL || lens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t missing = -1;
    Py_BEGIN_ALLOW_THREADS
    /* the thread's shares follow the spans' order: the destinations', so that a piece's parts
     * come in the order of its bytes */
    if (!spans_sorted)
        qsort(spans, (size_t)n, sizeof(span_t), span_dst_order);
    if (!sorted)
        qsort(pieces, (size_t)np, sizeof(span_t), span_src_order);
    copy_job_t jobs[COPY_THREADS_MAX] = {{0}};
    for (int t = 0; t < threads_run; t++) {
        jobs[t] = (copy_job_t){.spans = spans, .nspans = n, .pieces = pieces, .npieces = np,
                               .crcs = crcs + (size_t)np * (t + 1), .lens = lens + (size_t)np * t, .crc = p_crc32};
    }
    copy_spans_parallel(jobs, total, threads_run);
    for (Py_ssize_t i = 0; i < np; i++) {
        Py_ssize_t at = (Py_ssize_t)(uintptr_t)pieces[i].dst;
        uint64_t seen = 0;
        uint32_t crc = 0;
        for (int t = 0; t < threads_run; t++) {
            uint64_t len = jobs[t].lens[at];
            if (len)
                crc = seen ? (uint32_t)crc32_combine64(crc, jobs[t].crcs[at], (z_off64_t)len) : jobs[t].crcs[at];
            seen += len;
        }
        crcs[at] = crc;
        if (seen != pieces[i].len && missing < 0)
            missing = at;
    }
    Py_END_ALLOW_THREADS
    if (missing >= 0)
        PyErr_Format(PyExc_ValueError, "piece %zd is not all inside the spans' destinations", missing);
    else
        result = crc_list(crcs, np);
done:
    PyMem_Free(lens);
    PyMem_Free(crcs);
    PyMem_Free(pieces);
    release_views(views, held);
    PyMem_Free(spans);
    PyBuffer_Release(&dst);
    return result;
}

/* scatter_crc32(src, addresses, sizes, spans, pieces) -> [CRC32 of each piece's bytes of src]:
 * copies each span (target, dst_offset, length, src_offset) of src into memory given by address
 * (addresses and sizes: buffers of uint64, the data pointers and byte sizes of targets the
 * caller keeps alive, e.g. contiguous CPU tensors: a buffer object of each of 40,000 tensors
 * costs more than their copy), and takes the CRC32 of each piece (a 4-tuple whose last two items
 * are length and src_offset: ckptfs.chunks.Piece), both in one pass over src, window by window
 * (FUSED_WINDOW_BYTES). Every index and range is checked before any byte is copied. */
PyObject *
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
    pieces = parse_pieces(&src, pieces_in, &np, &sorted, &crcs);
    if (pieces == NULL)
        goto done;
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
