/*
 * The per-tensor loops of two JSON views in C: the tensor entries of a safetensors header
 * (ckptfs/views/safetensors.py) and the "tensors" array of metadata.json
 * (ckptfs/views/metadata.py). A version of 40,000 tensors runs both on the first listing of its
 * directory. The Python functions stay the reference: tests/test_views.py holds the bytes of
 * both to theirs, and theirs to json.dumps.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "jsonviews.h"
#include "outbuf.h"

/* TensorRecord's fields (ckptfs/manifest.py), a named tuple */
enum { REC_NAME, REC_DTYPE, REC_SHAPE, REC_OFFSET, REC_NBYTES, REC_CRC32, REC_FIELDS };

static const char HEX[] = "0123456789abcdef";

static int
out_u4(Out *o, unsigned int c)
{
    char b[6] = {'\\', 'u', HEX[(c >> 12) & 0xF], HEX[(c >> 8) & 0xF], HEX[(c >> 4) & 0xF], HEX[c & 0xF]};
    return out_put(o, b, 6);
}

/* ``s`` as json's encode_basestring_ascii writes it: quoted, ASCII, \uXXXX (lowercase, surrogate
 * pairs past the BMP) for everything outside ' '..'~' that has no short escape. */
static int
out_quoted(Out *o, PyObject *s)
{
    if (!PyUnicode_Check(s)) {
        PyErr_Format(PyExc_TypeError, "expected a str, got %.80s", Py_TYPE(s)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    int narrow = kind == PyUnicode_1BYTE_KIND; /* plain characters are copied in runs */
    Py_ssize_t run = 0; /* start of the pending run of plain characters (narrow only) */
    if (out_put(o, "\"", 1) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c >= ' ' && c <= '~' && c != '"' && c != '\\') {
            char ch = (char)c;
            if (!narrow && out_put(o, &ch, 1) < 0)
                return -1;
            continue;
        }
        if (narrow && i > run && out_put(o, (const char *)data + run, i - run) < 0)
            return -1;
        run = i + 1;
        const char *esc = NULL;
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        }
        int bad;
        if (esc != NULL)
            bad = out_put(o, esc, 2) < 0;
        else if (c >= 0x10000) {
            Py_UCS4 v = c - 0x10000;
            bad = out_u4(o, 0xD800 | (v >> 10)) < 0 || out_u4(o, 0xDC00 | (v & 0x3FF)) < 0;
        } else
            bad = out_u4(o, c) < 0;
        if (bad)
            return -1;
    }
    if (narrow && n > run && out_put(o, (const char *)data + run, n - run) < 0)
        return -1;
    return out_put(o, "\"", 1);
}

/* a non-negative int as decimal digits */
static int
out_u64(Out *o, unsigned long long v)
{
    char b[24];
    int i = sizeof b;
    do {
        b[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return out_put(o, b + i, (Py_ssize_t)sizeof b - i);
}

/* field ``i`` of a record as a non-negative int; -1 with an error set otherwise */
static long long
rec_count(PyObject *rec, int i, const char *what)
{
    long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(rec, i));
    if (v < 0 && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "a tensor record's %s is negative", what);
    return v;
}

static PyObject *
as_record(PyObject *rec)
{
    if (!PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) < REC_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "expected a TensorRecord");
        return NULL;
    }
    return rec;
}

/* cache[key], made by make(arg) on a miss and checked to be a str */
static PyObject *
cached_text(PyObject *cache, PyObject *key, PyObject *make, PyObject *arg)
{
    PyObject *text = PyDict_GetItemWithError(cache, key); /* borrowed */
    if (text != NULL || PyErr_Occurred())
        return text;
    text = PyObject_CallOneArg(make, arg);
    if (text == NULL)
        return NULL;
    if (!PyUnicode_Check(text) || !PyUnicode_IS_ASCII(text)) {
        Py_DECREF(text);
        PyErr_SetString(PyExc_TypeError, "a cached JSON fragment must be an ASCII str");
        return NULL;
    }
    int bad = PyDict_SetItem(cache, key, text) < 0;
    Py_DECREF(text); /* the cache holds it */
    return bad ? NULL : text;
}

static int
out_ascii(Out *o, PyObject *text)
{
    return out_put(o, PyUnicode_DATA(text), PyUnicode_GET_LENGTH(text));
}

/* safetensors_entries(pairs, heads, head_of) -> (entries, extents, data_bytes)

   ``pairs``: a sequence of (name, TensorRecord), the file's tensors in order, contiguous from data offset 0.
   ``entries``: the bytes ``"NAME":{HEAD<start>,<end>]}`` of each, joined by commas, where HEAD is
   ``heads[(dtype, shape)]`` (``head_of(record)`` on a miss, then cached). ``extents``: the
   records' (offset, nbytes) in order, each that continues the one before merged into it, and
   empty ones left out. ``data_bytes``: the sum of the nbytes. */
PyObject *
safetensors_entries_py(PyObject *self, PyObject *args)
{
    PyObject *seq, *heads, *head_of;
    if (!PyArg_ParseTuple(args, "OO!O", &seq, &PyDict_Type, &heads, &head_of))
        return NULL;
    PyObject *pairs = PySequence_Fast(seq, "pairs must be a sequence");
    if (pairs == NULL)
        return NULL;
    Out o = {NULL, 0, 0};
    PyObject *extents = PyList_New(0);
    if (extents == NULL) {
        Py_DECREF(pairs);
        return NULL;
    }
    long long data = 0, start = -1, end = -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(pairs, i), *rec;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "expected (name, TensorRecord) pairs");
            goto fail;
        }
        if ((rec = as_record(PyTuple_GET_ITEM(pair, 1))) == NULL)
            goto fail;
        long long offset = rec_count(rec, REC_OFFSET, "offset"), nbytes = rec_count(rec, REC_NBYTES, "nbytes");
        if (offset < 0 || nbytes < 0)
            goto fail;
        PyObject *key = PyTuple_Pack(2, PyTuple_GET_ITEM(rec, REC_DTYPE), PyTuple_GET_ITEM(rec, REC_SHAPE));
        PyObject *head = key == NULL ? NULL : cached_text(heads, key, head_of, rec);
        Py_XDECREF(key);
        if (head == NULL || (i > 0 && out_put(&o, ",", 1) < 0) || out_quoted(&o, PyTuple_GET_ITEM(pair, 0)) < 0 ||
            out_put(&o, ":{", 2) < 0 || out_ascii(&o, head) < 0 || out_u64(&o, (unsigned long long)data) < 0 ||
            out_put(&o, ",", 1) < 0 || out_u64(&o, (unsigned long long)(data + nbytes)) < 0 ||
            out_put(&o, "]}", 2) < 0)
            goto fail;
        data += nbytes;
        if (nbytes == 0)
            continue;
        if (offset == end) {
            end += nbytes;
            continue;
        }
        if (start >= 0) {
            PyObject *pair_out = Py_BuildValue("(LL)", start, end - start);
            if (pair_out == NULL || PyList_Append(extents, pair_out) < 0) {
                Py_XDECREF(pair_out);
                goto fail;
            }
            Py_DECREF(pair_out);
        }
        start = offset;
        end = offset + nbytes;
    }
    if (start >= 0) {
        PyObject *pair_out = Py_BuildValue("(LL)", start, end - start);
        if (pair_out == NULL || PyList_Append(extents, pair_out) < 0) {
            Py_XDECREF(pair_out);
            goto fail;
        }
        Py_DECREF(pair_out);
    }
    Py_DECREF(pairs);
    PyObject *entries = PyBytes_FromStringAndSize(o.buf, o.len);
    PyMem_Free(o.buf);
    if (entries == NULL) {
        Py_DECREF(extents);
        return NULL;
    }
    return Py_BuildValue("(NNL)", entries, extents, data);
fail:
    PyMem_Free(o.buf);
    Py_DECREF(extents);
    Py_DECREF(pairs);
    return NULL;
}

/* metadata_tensor_list(tensors, shapes, shape_of) -> str

   The items of metadata.json's "tensors" array as json.dumps(indent=2) writes them at depth 2,
   joined by ",\n": name, dtype, shape (``shapes[shape]``, ``shape_of(shape)`` on a miss, then
   cached), nbytes and crc32 as 8 lowercase hex digits. */
PyObject *
metadata_tensor_list_py(PyObject *self, PyObject *args)
{
    PyObject *seq, *shapes, *shape_of;
    if (!PyArg_ParseTuple(args, "OO!O", &seq, &PyDict_Type, &shapes, &shape_of))
        return NULL;
    PyObject *tensors = PySequence_Fast(seq, "tensors must be a sequence");
    if (tensors == NULL)
        return NULL;
    Out o = {NULL, 0, 0};
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tensors);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = as_record(PySequence_Fast_GET_ITEM(tensors, i));
        if (rec == NULL)
            goto fail;
        long long nbytes = rec_count(rec, REC_NBYTES, "nbytes"), crc = rec_count(rec, REC_CRC32, "crc32");
        if (nbytes < 0 || crc < 0)
            goto fail;
        PyObject *shape = PyTuple_GET_ITEM(rec, REC_SHAPE);
        PyObject *shape_text = cached_text(shapes, shape, shape_of, shape);
        char crc_hex[8];
        for (int k = 0; k < 8; k++)
            crc_hex[k] = HEX[(crc >> (28 - 4 * k)) & 0xF];
        if (shape_text == NULL || (i > 0 && out_put(&o, ",\n", 2) < 0) ||
            out_cstr(&o, "    {\n      \"name\": ") < 0 || out_quoted(&o, PyTuple_GET_ITEM(rec, REC_NAME)) < 0 ||
            out_cstr(&o, ",\n      \"dtype\": ") < 0 || out_quoted(&o, PyTuple_GET_ITEM(rec, REC_DTYPE)) < 0 ||
            out_cstr(&o, ",\n      \"shape\": ") < 0 || out_ascii(&o, shape_text) < 0 ||
            out_cstr(&o, ",\n      \"nbytes\": ") < 0 || out_u64(&o, (unsigned long long)nbytes) < 0 ||
            out_cstr(&o, ",\n      \"crc32\": \"") < 0 || out_put(&o, crc_hex, 8) < 0 ||
            out_cstr(&o, "\"\n    }") < 0)
            goto fail;
    }
    Py_DECREF(tensors);
    PyObject *text = PyUnicode_DecodeASCII(o.buf ? o.buf : "", o.len, NULL);
    PyMem_Free(o.buf);
    return text;
fail:
    PyMem_Free(o.buf);
    Py_DECREF(tensors);
    return NULL;
}

#define SKELETON_MAX_DEPTH 2000 /* beyond the manifest's own limit: a guard, not a rule */

static int
out_skeleton(Out *o, PyObject *v, PyObject *names, int depth)
{
    if (depth > SKELETON_MAX_DEPTH) {
        PyErr_SetString(PyExc_RecursionError, "skeleton nests too deep");
        return -1;
    }
    if (v == Py_None)
        return out_put(o, "null", 4);
    if (v == Py_True)
        return out_put(o, "true", 4);
    if (v == Py_False)
        return out_put(o, "false", 5);
    if (PyUnicode_Check(v))
        return out_quoted(o, v);
    if (PyLong_CheckExact(v)) {
        PyObject *text = PyObject_Str(v);
        int bad = text == NULL || out_ascii(o, text) < 0;
        Py_XDECREF(text);
        return bad ? -1 : 0;
    }
    if (PyList_Check(v) || PyTuple_Check(v)) {
        PyObject *items = PySequence_Fast(v, "");
        if (items == NULL)
            return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
        int bad = out_put(o, "[", 1) < 0;
        for (Py_ssize_t i = 0; i < n && !bad; i++)
            bad = (i > 0 && out_put(o, ",", 1) < 0) ||
                  out_skeleton(o, PySequence_Fast_GET_ITEM(items, i), names, depth + 1) < 0;
        Py_DECREF(items);
        return bad || out_put(o, "]", 1) < 0 ? -1 : 0;
    }
    if (PyDict_Check(v)) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        if (PyDict_GET_SIZE(v) == 1) {
            PyDict_Next(v, &pos, &key, &value);
            if (PyUnicode_Check(key) && PyUnicode_CompareWithASCIIString(key, "tensor") == 0) {
                /* a tensor node: its reference becomes the text names[reference] */
                PyObject *name = PyObject_GetItem(names, value);
                int bad = name == NULL || out_put(o, "{\"tensor\":", 10) < 0 ||
                          out_skeleton(o, name, names, depth + 1) < 0 || out_put(o, "}", 1) < 0;
                Py_XDECREF(name);
                return bad ? -1 : 0;
            }
            pos = 0;
        }
        if (out_put(o, "{", 1) < 0)
            return -1;
        int first = 1;
        while (PyDict_Next(v, &pos, &key, &value)) {
            if (!PyUnicode_Check(key)) {
                PyErr_SetString(PyExc_TypeError, "a skeleton object's keys must be str");
                return -1;
            }
            if ((!first && out_put(o, ",", 1) < 0) || out_quoted(o, key) < 0 || out_put(o, ":", 1) < 0 ||
                out_skeleton(o, value, names, depth + 1) < 0)
                return -1;
            first = 0;
        }
        return out_put(o, "}", 1);
    }
    PyErr_Format(PyExc_TypeError, "a skeleton holds no %.80s", Py_TYPE(v)->tp_name);
    return -1;
}

/* skeleton_json(skeleton, names) -> str

   ``json.dumps(skeleton, separators=(",", ":"), ensure_ascii=True)`` of the skeleton with each
   tensor node ``{"tensor": r}`` written as ``{"tensor": names[r]}``, in one pass (the whole-state
   safetensors file carries it, made on the first listing of a version). */
PyObject *
skeleton_json_py(PyObject *self, PyObject *args)
{
    PyObject *skeleton, *names;
    if (!PyArg_ParseTuple(args, "OO", &skeleton, &names))
        return NULL;
    Out o = {NULL, 0, 0};
    if (out_skeleton(&o, skeleton, names, 0) < 0) {
        PyMem_Free(o.buf);
        return NULL;
    }
    PyObject *text = PyUnicode_DecodeASCII(o.buf, o.len, NULL);
    PyMem_Free(o.buf);
    return text;
}
