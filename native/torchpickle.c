/*
 * The usual dict items of data.pkl (ckptfs/views/torchpickle.py) written in C: a str key and a
 * tensor whose dtype's template is known. A state dict of 40,000 tensors is 40,000 such items,
 * and this runs on the first stat of a version's files; the Python writer keeps everything else
 * (every other node, the first tensor of each dtype, numbers past 2**31) and stays the reference:
 * the bytes are the same, opcode for opcode (tests/test_views.py holds both to a Pickler).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "outbuf.h"
#include "torchpickle.h"

#define MAX_DIMS 64
#define INT_OP_MAX 0x7FFFFFFFLL /* past it the Python writer encodes (LONG1) */

static void
le32(char *p, uint32_t v)
{
    p[0] = (char)(v & 0xFF);
    p[1] = (char)((v >> 8) & 0xFF);
    p[2] = (char)((v >> 16) & 0xFF);
    p[3] = (char)((v >> 24) & 0xFF);
}

/* BINPUT / LONG_BINPUT n, or with get: BINGET / LONG_BINGET n */
static int
memo_op(Out *o, Py_ssize_t n, int get)
{
    char b[5];
    if (n < 256) {
        b[0] = get ? 'h' : 'q';
        b[1] = (char)n;
        return out_put(o, b, 2);
    }
    b[0] = get ? 'j' : 'r';
    le32(b + 1, (uint32_t)n);
    return out_put(o, b, 5);
}

/* BININT1 / BININT2 / BININT of 0 <= x <= INT_OP_MAX, as the Pickler chooses */
static int
int_op(Out *o, long long x)
{
    char b[5];
    if (x <= 0xFF) {
        b[0] = 'K';
        b[1] = (char)x;
        return out_put(o, b, 2);
    }
    if (x <= 0xFFFF) {
        b[0] = 'M';
        b[1] = (char)(x & 0xFF);
        b[2] = (char)(x >> 8);
        return out_put(o, b, 3);
    }
    b[0] = 'J';
    le32(b + 1, (uint32_t)x);
    return out_put(o, b, 5);
}

/* a fresh tuple of ints; its BINPUT (when not empty) at *n */
static int
int_tuple_op(Out *o, const long long *v, int count, Py_ssize_t *n)
{
    static const char tuple_n[] = {0, (char)0x85, (char)0x86, (char)0x87};
    if (count == 0)
        return out_put(o, ")", 1); /* EMPTY_TUPLE, never memoized */
    if (count > 3 && out_put(o, "(", 1) < 0)
        return -1;
    for (int i = 0; i < count; i++)
        if (int_op(o, v[i]) < 0)
            return -1;
    if (out_put(o, count > 3 ? "t" : &tuple_n[count], 1) < 0)
        return -1;
    return memo_op(o, (*n)++, 0);
}

/* The tensor index of a {"tensor": i} node with 0 <= i < ntensors, or -1 for any other node. */
static Py_ssize_t
tensor_leaf(PyObject *node, PyObject *tensor_key, Py_ssize_t ntensors)
{
    if (!PyDict_CheckExact(node) || PyDict_GET_SIZE(node) != 1)
        return -1;
    PyObject *v = PyDict_GetItemWithError(node, tensor_key);
    if (v == NULL || !PyLong_CheckExact(v))
        return -1;
    Py_ssize_t i = PyLong_AsSsize_t(v);
    if (i == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return (i >= 0 && i < ntensors) ? i : -1;
}

/*
 * pickle_tensor_items(out, pairs, start, memo, tensor_memo, storage_order, tensors, templates,
 *                     memo_size) -> (stop, memo_size)
 *
 * Appends to bytearray ``out`` the items pairs[start:stop] (each [key node, value node]) while
 * they are a {"str": s} key and a {"tensor": i} value whose tensor was pickled already (a BINGET)
 * or has its dtype's template in ``templates`` and counts, shape and strides below 2**31;
 * stops at the first other item (the Python writer pickles it) without writing any of it.
 * Updates memo (id of a str -> memo index), tensor_memo (tensor index -> memo index) and
 * storage_order as the Python writer does.
 */
PyObject *
pickle_tensor_items_py(PyObject *self, PyObject *args)
{
    PyObject *out, *pairs, *memo, *tensor_memo, *storage_order, *tensors, *templates;
    Py_ssize_t start, memo_size;
    if (!PyArg_ParseTuple(args, "O!O!nO!O!O!O!O!n", &PyByteArray_Type, &out, &PyList_Type, &pairs, &start,
                          &PyDict_Type, &memo, &PyDict_Type, &tensor_memo, &PyList_Type, &storage_order,
                          &PyTuple_Type, &tensors, &PyDict_Type, &templates, &memo_size))
        return NULL;
    PyObject *str_key = PyUnicode_InternFromString("str");
    PyObject *tensor_key = PyUnicode_InternFromString("tensor");
    if (str_key == NULL || tensor_key == NULL) {
        Py_XDECREF(str_key);
        Py_XDECREF(tensor_key);
        return NULL;
    }
    Out o = {NULL, 0, 0};
    Py_ssize_t ntensors = PyTuple_GET_SIZE(tensors), i = start, n = memo_size;
    int failed = 0;
    for (; i < PyList_GET_SIZE(pairs); i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        PyObject *key, *value;
        if (PyList_CheckExact(pair) && PyList_GET_SIZE(pair) == 2) {
            key = PyList_GET_ITEM(pair, 0);
            value = PyList_GET_ITEM(pair, 1);
        } else if (PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2) {
            key = PyTuple_GET_ITEM(pair, 0);
            value = PyTuple_GET_ITEM(pair, 1);
        } else {
            break;
        }
        if (!PyDict_CheckExact(key) || PyDict_GET_SIZE(key) != 1)
            break;
        PyObject *text = PyDict_GetItemWithError(key, str_key);
        if (text == NULL || !PyUnicode_CheckExact(text))
            break;
        Py_ssize_t index = tensor_leaf(value, tensor_key, ntensors);
        if (index < 0)
            break;
        PyObject *index_obj = PyDict_GetItemWithError(value, tensor_key); /* borrowed, exact int */
        PyObject *seen = PyDict_GetItemWithError(tensor_memo, index_obj);
        if (seen == NULL && PyErr_Occurred()) {
            failed = 1;
            break;
        }

        /* everything the tensor needs, checked before anything of the item is written */
        PyObject *template = NULL;
        long long count = 0, shape[MAX_DIMS], strides[MAX_DIMS];
        int ndims = 0;
        if (seen == NULL) {
            PyObject *record = PyTuple_GET_ITEM(tensors, index);
            if (!PyTuple_Check(record) || PyTuple_GET_SIZE(record) < 5)
                break;
            template = PyDict_GetItemWithError(templates, PyTuple_GET_ITEM(record, 1));
            if (template == NULL || !PyTuple_CheckExact(template) || PyTuple_GET_SIZE(template) != 5)
                break;
            PyObject *dims = PyTuple_GET_ITEM(record, 2);
            if (!PyTuple_CheckExact(dims) || PyTuple_GET_SIZE(dims) > MAX_DIMS)
                break;
            ndims = (int)PyTuple_GET_SIZE(dims);
            int ok = 1;
            long long numel = 1;
            for (int d = 0; d < ndims && ok; d++) {
                long long x = PyLong_AsLongLong(PyTuple_GET_ITEM(dims, d));
                if (x == -1 && PyErr_Occurred()) {
                    PyErr_Clear();
                    ok = 0;
                } else if (x < 0 || x > INT_OP_MAX) {
                    ok = 0;
                } else {
                    shape[d] = x;
                    numel = (x == 0 || numel <= INT_OP_MAX / x) ? numel * x : INT_OP_MAX + 1;
                }
            }
            long long step = 1; /* contiguous strides, a dimension of size 0 counting as 1 */
            for (int d = ndims - 1; d >= 0 && ok; d--) {
                strides[d] = step;
                long long size = shape[d] > 1 ? shape[d] : 1;
                if (step > INT_OP_MAX / size)
                    ok = 0; /* the next stride would pass 2**31: the Python writer */
                else
                    step *= size;
            }
            int legacy = PyObject_IsTrue(PyTuple_GET_ITEM(template, 4));
            if (legacy < 0) {
                failed = 1;
                break;
            }
            if (legacy) {
                count = numel;
            } else {
                count = PyLong_AsLongLong(PyTuple_GET_ITEM(record, 4));
                if (count == -1 && PyErr_Occurred()) {
                    PyErr_Clear();
                    ok = 0;
                }
            }
            if (!ok || count < 0 || count > INT_OP_MAX)
                break;
            for (int t = 0; t < 4; t++)
                if (!PyBytes_CheckExact(PyTuple_GET_ITEM(template, t)))
                    ok = 0;
            if (!ok)
                break;
        }

        /* the key: a BINGET of a str pickled before, or BINUNICODE and a BINPUT */
        PyObject *id = PyLong_FromVoidPtr(text);
        if (id == NULL) {
            failed = 1;
            break;
        }
        PyObject *known = PyDict_GetItemWithError(memo, id);
        if (known != NULL) {
            Py_ssize_t k = PyLong_AsSsize_t(known);
            if ((k == -1 && PyErr_Occurred()) || memo_op(&o, k, 1) < 0) {
                Py_DECREF(id);
                failed = 1;
                break;
            }
        } else {
            PyObject *raw = PyErr_Occurred() ? NULL : PyUnicode_AsEncodedString(text, "utf-8", "surrogatepass");
            PyObject *nobj = raw == NULL ? NULL : PyLong_FromSsize_t(n);
            char head[5];
            head[0] = 'X';
            if (raw != NULL)
                le32(head + 1, (uint32_t)PyBytes_GET_SIZE(raw));
            int bad = raw == NULL || nobj == NULL || out_put(&o, head, 5) < 0 || out_bytes(&o, raw) < 0 ||
                      memo_op(&o, n, 0) < 0 || PyDict_SetItem(memo, id, nobj) < 0;
            Py_XDECREF(raw);
            Py_XDECREF(nobj);
            if (bad) {
                Py_DECREF(id);
                failed = 1;
                break;
            }
            n++;
        }
        Py_DECREF(id);

        /* the value */
        if (seen != NULL) {
            Py_ssize_t k = PyLong_AsSsize_t(seen);
            if ((k == -1 && PyErr_Occurred()) || memo_op(&o, k, 1) < 0) {
                failed = 1;
                break;
            }
            continue;
        }
        char key_digits[32], head[5];
        int key_len = snprintf(key_digits, sizeof key_digits, "%zd", PyList_GET_SIZE(storage_order));
        head[0] = 'X';
        le32(head + 1, (uint32_t)key_len);
        Py_ssize_t put_tensor;
        int bad = out_bytes(&o, PyTuple_GET_ITEM(template, 0)) < 0 || out_put(&o, head, 5) < 0 ||
                  out_put(&o, key_digits, key_len) < 0 || memo_op(&o, n++, 0) < 0 ||
                  out_bytes(&o, PyTuple_GET_ITEM(template, 1)) < 0 || int_op(&o, count) < 0 ||
                  out_put(&o, "t", 1) < 0 || memo_op(&o, n++, 0) < 0 || out_put(&o, "QK\0", 3) < 0 ||
                  int_tuple_op(&o, shape, ndims, &n) < 0 || int_tuple_op(&o, strides, ndims, &n) < 0 ||
                  out_bytes(&o, PyTuple_GET_ITEM(template, 2)) < 0 || memo_op(&o, n++, 0) < 0 ||
                  out_bytes(&o, PyTuple_GET_ITEM(template, 3)) < 0 || memo_op(&o, n++, 0) < 0 ||
                  out_put(&o, "R", 1) < 0 || memo_op(&o, (put_tensor = n++), 0) < 0;
        if (bad) {
            failed = 1;
            break;
        }
        PyObject *put_obj = PyLong_FromSsize_t(put_tensor);
        if (put_obj == NULL || PyDict_SetItem(tensor_memo, index_obj, put_obj) < 0 ||
            PyList_Append(storage_order, index_obj) < 0) {
            Py_XDECREF(put_obj);
            failed = 1;
            break;
        }
        Py_DECREF(put_obj);
    }
    Py_DECREF(str_key);
    Py_DECREF(tensor_key);
    if (!failed && PyErr_Occurred())
        failed = 1;
    if (!failed && o.len) {
        Py_ssize_t old = PyByteArray_GET_SIZE(out);
        if (PyByteArray_Resize(out, old + o.len) < 0)
            failed = 1;
        else
            memcpy(PyByteArray_AS_STRING(out) + old, o.buf, (size_t)o.len);
    }
    PyMem_Free(o.buf);
    if (failed)
        return NULL;
    return Py_BuildValue("nn", i, n);
}
