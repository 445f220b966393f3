/* A growing output buffer for the view writers in C (torchpickle.c, jsonviews.c): what they
 * write is appended here, then handed to Python as one bytes object. */
#ifndef CKPTFS_OUTBUF_H
#define CKPTFS_OUTBUF_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
} Out;

/* Append n bytes; -1 with MemoryError set when the buffer cannot grow. */
static inline int
out_put(Out *o, const void *p, Py_ssize_t n)
{
    if (o->len + n > o->cap) {
        Py_ssize_t cap = (o->cap ? o->cap * 2 : 4096);
        while (cap < o->len + n)
            cap *= 2;
        char *b = PyMem_Realloc(o->buf, (size_t)cap);
        if (b == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        o->buf = b;
        o->cap = cap;
    }
    memcpy(o->buf + o->len, p, (size_t)n);
    o->len += n;
    return 0;
}

static inline int
out_bytes(Out *o, PyObject *b)
{
    return out_put(o, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b));
}

static inline int
out_cstr(Out *o, const char *s)
{
    return out_put(o, s, (Py_ssize_t)strlen(s));
}

#endif
