/*
 * The bus guard: a SIGBUS in a region's mapping becomes a recorded fault instead of the end of
 * the process.
 *
 * A shared mapping of a file kills its process with SIGBUS where an access reaches a page past
 * the file's end (the file was truncated under it) or a page the device cannot read (a media
 * error on pmem reports SIGBUS too). A pre-check (fstat before an operation) cannot close the
 * window between the check and the access; this closes it. The handler, for an address inside
 * a guarded mapping, maps a zero page over the faulting page (MAP_FIXED, anonymous) and counts
 * the fault; the access then completes on that page: a read sees zeros, a write lands nowhere.
 * The caller learns it from the count, which it checks after every use of the mapping whose
 * result it is about to trust (ckptfs.region.backend.Backend.check_mapping): once a mapping has
 * faulted, it is never trusted again.
 *
 * A fault outside every guarded mapping goes to the handler that was there before (Python's
 * faulthandler in tests), or to the default action, as if the guard did not exist.
 */
#define _GNU_SOURCE
#include <Python.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "busguard.h"

#define GUARD_SLOTS 64

struct guard {
    uintptr_t start; /* 0: a free slot */
    uintptr_t end;
    uint64_t faults;
    uintptr_t first_fault; /* the address of the first fault, for the message */
};

static struct guard guards[GUARD_SLOTS];
static struct sigaction previous;
static uintptr_t page_bytes;

/* Put a zero page over the page of ``addr`` in guard ``i`` and count the fault; 0 on success.
 * Async-signal-safe: the raw system call (mmap(3) is not on the list, the syscall is). */
static int
zero_page(int i, uintptr_t addr)
{
    uintptr_t page = addr & ~(page_bytes - 1);
    long got = syscall(SYS_mmap, page, page_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (got != (long)page)
        return -1;
    uintptr_t none = 0;
    __atomic_compare_exchange_n(&guards[i].first_fault, &none, addr, 0, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
    __atomic_fetch_add(&guards[i].faults, 1, __ATOMIC_ACQ_REL);
    return 0;
}

static void
on_sigbus(int sig, siginfo_t *info, void *context)
{
    uintptr_t addr = (uintptr_t)info->si_addr;
    for (int i = 0; i < GUARD_SLOTS; i++) {
        uintptr_t start = __atomic_load_n(&guards[i].start, __ATOMIC_ACQUIRE);
        if (start == 0 || addr < start || addr >= __atomic_load_n(&guards[i].end, __ATOMIC_ACQUIRE))
            continue;
        if (zero_page(i, addr) < 0)
            break; /* cannot patch it: die as without the guard */
        return; /* the access repeats, on the zero page */
    }
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction != NULL) {
            previous.sa_sigaction(sig, info, context);
            return;
        }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* the default action: put it back; the access repeats and the process ends as it would have */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &dfl, NULL);
}

/* Install the handler unless it is already the current one (faulthandler.enable() after us
 * replaces it; the next guard_mapping puts it back, chaining to faulthandler). */
static int
install(void)
{
    struct sigaction current;
    if (sigaction(SIGBUS, NULL, &current) < 0)
        return -1;
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus)
        return 0;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&ours.sa_mask);
    page_bytes = (uintptr_t)sysconf(_SC_PAGESIZE);
    return sigaction(SIGBUS, &ours, &previous);
}

PyObject *
guard_mapping_py(PyObject *self, PyObject *args)
{
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view))
        return NULL;
    uintptr_t start = (uintptr_t)view.buf, end = start + (uintptr_t)view.len;
    PyBuffer_Release(&view); /* the caller keeps the mapping alive until unguard_mapping */
    if (install() < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    for (int i = 0; i < GUARD_SLOTS; i++) {
        uintptr_t none = 0;
        if (__atomic_load_n(&guards[i].start, __ATOMIC_ACQUIRE) != 0)
            continue;
        guards[i].faults = 0;
        guards[i].first_fault = 0;
        __atomic_store_n(&guards[i].end, end, __ATOMIC_RELEASE);
        if (__atomic_compare_exchange_n(&guards[i].start, &none, start, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return PyLong_FromLong(i);
    }
    PyErr_SetString(PyExc_RuntimeError, "more than 64 region mappings open in one process");
    return NULL;
}

static int
slot_arg(PyObject *args, int *slot)
{
    if (!PyArg_ParseTuple(args, "i", slot))
        return -1;
    if (*slot < 0 || *slot >= GUARD_SLOTS) {
        PyErr_Format(PyExc_ValueError, "no guard slot %d", *slot);
        return -1;
    }
    return 0;
}

PyObject *
mapping_faults_py(PyObject *self, PyObject *args)
{
    int slot;
    if (slot_arg(args, &slot) < 0)
        return NULL;
    uint64_t faults = __atomic_load_n(&guards[slot].faults, __ATOMIC_ACQUIRE);
    uintptr_t first = __atomic_load_n(&guards[slot].first_fault, __ATOMIC_ACQUIRE);
    uintptr_t start = __atomic_load_n(&guards[slot].start, __ATOMIC_ACQUIRE);
    return Py_BuildValue("(Kn)", (unsigned long long)faults,
                         (Py_ssize_t)(faults && start ? first - start : -1));
}

/* poison_page(slot, offset): what the handler does for a fault at ``offset`` of the guarded
 * mapping, done on purpose: the fault-injection harness (ckptfs.testing.anomaly) stands in for a
 * device page that cannot be read or written (a poisoned pmem line) with it. */
PyObject *
poison_page_py(PyObject *self, PyObject *args)
{
    int slot;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "in", &slot, &offset))
        return NULL;
    if (slot < 0 || slot >= GUARD_SLOTS || guards[slot].start == 0 || offset < 0
        || guards[slot].start + (uintptr_t)offset >= guards[slot].end) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not in guarded mapping %d", offset, slot);
        return NULL;
    }
    if (zero_page(slot, guards[slot].start + (uintptr_t)offset) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

PyObject *
unguard_mapping_py(PyObject *self, PyObject *args)
{
    int slot;
    if (slot_arg(args, &slot) < 0)
        return NULL;
    __atomic_store_n(&guards[slot].start, 0, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}
