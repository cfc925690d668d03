/* The page allocator's per-page bookkeeping in C (issue 13): the loops behind
 * PageAllocator.alloc / release / held_once and the cache's slot-ownership marks.
 *
 * _slots.py keeps the readable torch version of every one of these; this module only
 * runs the same loops without a torch op's fixed cost (a few microseconds each, and an
 * eviction or insert makes several). Callers pass the addresses of CPU tensors they own
 * (int32 counts, int64 slot ids, bool marks) and their lengths; every slot id read here
 * is range-checked before it indexes anything, and every function either does all of its
 * work or leaves the buffers exactly as it found them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Slot ids are read at ids[i * stride] (stride in elements: a tensor view's stride). */
#define ID(i) (ids[(Py_ssize_t)(i) * stride])

/* mark_held(held, stack, start, count): held[stack[start + i]] = 1 for each i (alloc's
 * pages, which the allocator itself put on its free stack). */
static PyObject *mark_held(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long held_addr, stack_addr;
    Py_ssize_t start, count;
    if (!PyArg_ParseTuple(args, "KKnn", &held_addr, &stack_addr, &start, &count))
        return NULL;
    int32_t *held = (int32_t *)(uintptr_t)held_addr;
    const int64_t *stack = (const int64_t *)(uintptr_t)stack_addr + start;
    for (Py_ssize_t i = 0; i < count; i++)
        held[stack[i]] = 1;
    Py_RETURN_NONE;
}

/* put_back(held, ids, count, stride): held[id] = 1 for each id (undoing take_once). */
static void put_back(int32_t *held, const int64_t *ids, Py_ssize_t count, Py_ssize_t stride) {
    for (Py_ssize_t i = 0; i < count; i++)
        held[ID(i)] = 1;
}

/* in_range(ids, count, stride, num_slots): whether every id is in [0, num_slots). */
static int in_range(const int64_t *ids, Py_ssize_t count, Py_ssize_t stride,
                    Py_ssize_t num_slots) {
    for (Py_ssize_t i = 0; i < count; i++)
        if (ID(i) < 0 || ID(i) >= num_slots)
            return 0;
    return 1;
}

/* take_once(held, num_slots, ids, count, stride): each id must be in range with count 1
 * (an allocated page's head, not yet taken by this call); each is set to 0. Returns -1
 * when all were, else the index of the first that was not, with every count restored. */
static Py_ssize_t take_once(int32_t *held, Py_ssize_t num_slots, const int64_t *ids,
                            Py_ssize_t count, Py_ssize_t stride) {
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t id = ID(i);
        if (id < 0 || id >= num_slots || held[id] != 1) {
            put_back(held, ids, i, stride);
            return i;
        }
        held[id] = 0;
    }
    return -1;
}

/* One part of a release: a CPU int64 tensor's slot ids (address, length, stride in
 * elements). */
typedef struct {
    const int64_t *ids;
    Py_ssize_t count, stride;
} Part;

#define PARTS_ON_STACK 8

/* The release proper, over parts already read: -1 (nothing changed) or the new top. */
static Py_ssize_t release_parts(int32_t *held, Py_ssize_t num_slots, int64_t *stack,
                                Py_ssize_t top, uint8_t *marks, Py_ssize_t page_size,
                                const Part *parts, Py_ssize_t count) {
    Py_ssize_t pages = 0;
    for (Py_ssize_t p = 0; p < count; p++) {
        if (parts[p].count % page_size)
            return -1;
        pages += parts[p].count / page_size;
        /* Only page heads index ``held`` (take_once checks their range); the other ids
         * index the marks, if any. At page size 1 every id is a head. */
        if (marks && page_size > 1 &&
            !in_range(parts[p].ids, parts[p].count, parts[p].stride, num_slots))
            return -1;
    }
    if (pages > top)
        return -1;
    /* Heads are taken part by part; a head repeated in a later part finds its count 0
     * and fails, so a page twice in one release is caught across parts as within one. */
    for (Py_ssize_t p = 0; p < count; p++) {
        if (take_once(held, num_slots, parts[p].ids, parts[p].count / page_size,
                      parts[p].stride * page_size) >= 0) {
            for (Py_ssize_t q = 0; q < p; q++)
                put_back(held, parts[q].ids, parts[q].count / page_size,
                         parts[q].stride * page_size);
            return -1;
        }
    }
    Py_ssize_t at = top - pages;
    for (Py_ssize_t p = 0; p < count; p++) {
        const int64_t *ids = parts[p].ids;
        Py_ssize_t stride = parts[p].stride * page_size;
        for (Py_ssize_t i = 0; i < parts[p].count / page_size; i++)
            stack[at++] = ID(i);
        if (marks) {
            stride = parts[p].stride;
            for (Py_ssize_t i = 0; i < parts[p].count; i++)
                marks[ID(i)] = 0;
        }
    }
    return top - pages;
}

/* release(held, num_slots, stack, top, marks, page_size, parts): ``parts`` a tuple
 * (address, length, stride, address, length, stride, ...) of slot id runs, each a whole
 * number of pages in order. Every page head must be an allocated page's, none twice in
 * the whole call; their counts go to 0 and they are pushed on the free stack below
 * ``top``, the first on top, in the parts' order. ``marks`` (0: none) is a bool flag per
 * slot, cleared for every released slot (the cache's ownership flags, in the same call).
 * Returns the new top, or -1 (nothing changed). */
static PyObject *release(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long held_addr, stack_addr, marks_addr;
    Py_ssize_t num_slots, top, page_size;
    PyObject *flat;
    if (!PyArg_ParseTuple(args, "KnKnKnO!", &held_addr, &num_slots, &stack_addr, &top,
                          &marks_addr, &page_size, &PyTuple_Type, &flat))
        return NULL;
    Py_ssize_t items = PyTuple_GET_SIZE(flat);
    if (items % 3 || page_size < 1) {
        PyErr_SetString(PyExc_ValueError, "release: parts must be (address, length, stride) "
                                          "triples and page_size >= 1");
        return NULL;
    }
    Py_ssize_t count = items / 3;
    Part on_stack[PARTS_ON_STACK];
    Part *parts = count <= PARTS_ON_STACK ? on_stack : PyMem_New(Part, count);
    if (parts == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t p = 0; p < count; p++) {
        parts[p].ids = (const int64_t *)(uintptr_t)PyLong_AsUnsignedLongLong(
            PyTuple_GET_ITEM(flat, 3 * p));
        parts[p].count = PyLong_AsSsize_t(PyTuple_GET_ITEM(flat, 3 * p + 1));
        parts[p].stride = PyLong_AsSsize_t(PyTuple_GET_ITEM(flat, 3 * p + 2));
    }
    PyObject *result = NULL;
    if (!PyErr_Occurred())
        result = PyLong_FromSsize_t(release_parts(
            (int32_t *)(uintptr_t)held_addr, num_slots, (int64_t *)(uintptr_t)stack_addr, top,
            (uint8_t *)(uintptr_t)marks_addr, page_size, parts, count));
    if (parts != on_stack)
        PyMem_Free(parts);
    return result;
}

/* held_once(held, num_slots, ids, count, stride): whether every id is an allocated page's
 * head and none occurs twice. The counts are left as they were. */
static PyObject *held_once(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long held_addr, ids_addr;
    Py_ssize_t num_slots, count, stride;
    if (!PyArg_ParseTuple(args, "KnKnn", &held_addr, &num_slots, &ids_addr, &count, &stride))
        return NULL;
    int32_t *held = (int32_t *)(uintptr_t)held_addr;
    const int64_t *ids = (const int64_t *)(uintptr_t)ids_addr;
    if (take_once(held, num_slots, ids, count, stride) >= 0)
        Py_RETURN_FALSE;
    put_back(held, ids, count, stride);
    Py_RETURN_TRUE;
}

/* any_marked(marks, num_slots, ids, count, stride): 1 if a mark of ids is set, 0 if
 * none is, -1 if an id is out of range. */
static PyObject *any_marked(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long marks_addr, ids_addr;
    Py_ssize_t num_slots, count, stride;
    if (!PyArg_ParseTuple(args, "KnKnn", &marks_addr, &num_slots, &ids_addr, &count, &stride))
        return NULL;
    const uint8_t *marks = (const uint8_t *)(uintptr_t)marks_addr;
    const int64_t *ids = (const int64_t *)(uintptr_t)ids_addr;
    long found = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t id = ID(i);
        if (id < 0 || id >= num_slots)
            return PyLong_FromLong(-1);
        found |= marks[id];
    }
    return PyLong_FromLong(found != 0);
}

/* set_marks(marks, num_slots, ids, count, stride, value): marks[id] = value for each id;
 * False (nothing set) if an id is out of range. */
static PyObject *set_marks(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long marks_addr, ids_addr;
    Py_ssize_t num_slots, count, stride;
    int value;
    if (!PyArg_ParseTuple(args, "KnKnnp", &marks_addr, &num_slots, &ids_addr, &count, &stride,
                          &value))
        return NULL;
    uint8_t *marks = (uint8_t *)(uintptr_t)marks_addr;
    const int64_t *ids = (const int64_t *)(uintptr_t)ids_addr;
    for (Py_ssize_t i = 0; i < count; i++)
        if (ID(i) < 0 || ID(i) >= num_slots)
            Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < count; i++)
        marks[ID(i)] = (uint8_t)value;
    Py_RETURN_TRUE;
}

/* copy_rows(src, src_plane, src_slot, src_slots, src_ids, src_stride,
 *           dst, dst_plane, dst_slot, dst_slots, dst_ids, dst_stride,
 *           count, planes, row_bytes):
 * for every plane p and i < count, the row_bytes at src + p * src_plane + src_ids[i] *
 * src_slot go to dst + p * dst_plane + dst_ids[i] * dst_slot (plane and slot strides in
 * bytes; id strides in elements). One memcpy per row, plane by plane, without the GIL:
 * the byte copy of a host backup or load-back between two CPU buffers. False (nothing
 * copied) if an id is out of its buffer's range. */
static PyObject *copy_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long src_addr, src_ids_addr, dst_addr, dst_ids_addr;
    Py_ssize_t src_plane, src_slot, src_slots, src_stride;
    Py_ssize_t dst_plane, dst_slot, dst_slots, dst_stride, count, planes, row_bytes;
    if (!PyArg_ParseTuple(args, "KnnnKnKnnnKnnnn", &src_addr, &src_plane, &src_slot,
                          &src_slots, &src_ids_addr, &src_stride, &dst_addr, &dst_plane,
                          &dst_slot, &dst_slots, &dst_ids_addr, &dst_stride, &count, &planes,
                          &row_bytes))
        return NULL;
    const int64_t *src_ids = (const int64_t *)(uintptr_t)src_ids_addr;
    const int64_t *dst_ids = (const int64_t *)(uintptr_t)dst_ids_addr;
    if (!in_range(src_ids, count, src_stride, src_slots) ||
        !in_range(dst_ids, count, dst_stride, dst_slots))
        Py_RETURN_FALSE;
    const char *src = (const char *)(uintptr_t)src_addr;
    char *dst = (char *)(uintptr_t)dst_addr;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < planes; p++) {
        const char *from = src + p * src_plane;
        char *to = dst + p * dst_plane;
        for (Py_ssize_t i = 0; i < count; i++)
            memcpy(to + dst_ids[i * dst_stride] * dst_slot,
                   from + src_ids[i * src_stride] * src_slot, (size_t)row_bytes);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"mark_held", mark_held, METH_VARARGS, "held[stack[start + i]] = 1 for i < count"},
    {"release", release, METH_VARARGS, "take allocated page heads once each, push them, clear their marks"},
    {"held_once", held_once, METH_VARARGS, "every id an allocated page head, none twice"},
    {"any_marked", any_marked, METH_VARARGS, "1 if a mark is set, 0 if none, -1 out of range"},
    {"set_marks", set_marks, METH_VARARGS, "set the marks of ids; False if one is out of range"},
    {"copy_rows", copy_rows, METH_VARARGS, "copy rows between two CPU buffers, plane by plane"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hiradix._pagebits",
                                    "The page allocator's bookkeeping loops in C (issue 13).",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pagebits(void) { return PyModule_Create(&module); }
