/*
 * src/python/slots.c: writing reserved rows in place from Python (cache.h,
 * "Writing in place", vLLM's reshape_and_cache): Cache.reserved_slots
 * (kvp_cache_reserved_slots: writable zero-copy views of the reserved
 * rows' slots in their pages) and Cache.commit_written
 * (kvp_cache_commit_written). cache.c lists both methods.
 *
 * Owns: those two methods.
 * Invariants: a slot view is a View (views.c) made writable, tied to the
 * cache's generation like every view: any change of the cache (a commit
 * included) makes it refuse to export (PageNotHeld), and while an array over
 * it is alive every change of the cache raises BufferError, so
 * commit_written runs only after every writer's array was released and no
 * pointer outlives the reservation. Like cache.c's changes, both refuse a
 * sequence's layer cache (TypeError), a closed or busy cache, and (commit)
 * exported views, before any C call; the C calls change nothing on failure.
 * Uses only the KvpPyCache fields (py_internal.h), views.c and errors.c.
 * Callers: cache.c (the method table).
 */
#include "py_internal.h"

#include <stdint.h>

static int slots_may_change(KvpPyCache *self, int exports_matter)
{
    if (!self->cache || self->owner) {
        if (!self->cache)
            kvp_py_closed("cache");
        else
            PyErr_SetString(PyExc_TypeError,
                            "kvpager: a sequence's layer cache changes only through its Sequence");
        return -1;
    }
    if (self->busy) {
        kvp_py_busy("cache");
        return -1;
    }
    return exports_matter ? kvp_py_check_unexported(self->exports, "cache") : 0;
}

static const char *format_of(kvp_dtype d)
{
    switch (d) {
    case KVP_F64:
        return "d";
    case KVP_F32:
        return "f";
    case KVP_F16:
        return "e";
    case KVP_BF16:
        return "H";
    default:
        return "B";
    }
}

/* One span as a dict with its writable (2, kv_heads, rows, head_width) view. */
static PyObject *span_dict(KvpPyCache *self, const kvp_slot_span *s, const kvp_page_layout *l)
{
    Py_ssize_t shape[4] = {2, (Py_ssize_t)l->heads, (Py_ssize_t)s->rows,
                           (Py_ssize_t)l->head_width};
    Py_ssize_t strides[4] = {(Py_ssize_t)((intptr_t)s->values - (intptr_t)s->keys),
                             (Py_ssize_t)s->head_stride_bytes, (Py_ssize_t)s->row_stride_bytes,
                             (Py_ssize_t)l->element_bytes};
    PyObject *view = kvp_py_view_new(self, (PyObject *)self, &self->generation, &self->exports,
                                     s->keys, format_of(l->dtype),
                                     (Py_ssize_t)l->element_bytes, 4, shape, strides, 1,
                                     s->page);
    if (!view)
        return NULL;
    kvp_py_view_set_writable(view);
    return Py_BuildValue("{s:n,s:n,s:k,s:N}", "row", (Py_ssize_t)s->row, "rows",
                         (Py_ssize_t)s->rows, "page", (unsigned long)s->page, "view", view);
}

PyObject *kvp_py_cache_reserved_slots(KvpPyCache *self, PyObject *args)
{
    Py_ssize_t lane;
    if (!PyArg_ParseTuple(args, "n:reserved_slots", &lane))
        return NULL;
    /* it may evict a borrowed page (cache.h): a change, but not of what views show */
    if (slots_may_change(self, 0) < 0)
        return NULL;
    if (lane < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: reserved_slots: negative lane");
        return NULL;
    }
    kvp_page_layout l;
    kvp_page_layout_init(&l);
    kvp_error err;
    size_t count = 0;
    if (kvp_pool_page_layout_get(self->pool->pool, &l, &err) != KVP_OK ||
        kvp_cache_reserved_slots(self->cache, (size_t)lane, NULL, 0, &count, &err) != KVP_OK)
        return kvp_py_raise(&err);
    kvp_slot_span *spans = PyMem_Calloc(count + 1, sizeof *spans);
    if (!spans)
        return PyErr_NoMemory();
    PyObject *list = NULL;
    if (kvp_cache_reserved_slots(self->cache, (size_t)lane, spans, count, &count, &err) !=
        KVP_OK) {
        kvp_py_raise(&err);
        goto done;
    }
    list = PyList_New((Py_ssize_t)count);
    for (size_t i = 0; list && i < count; i++) {
        PyObject *d = span_dict(self, &spans[i], &l);
        if (!d)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, (Py_ssize_t)i, d);
    }
done:
    PyMem_Free(spans);
    return list;
}

PyObject *kvp_py_cache_commit_written(KvpPyCache *self, PyObject *args)
{
    Py_ssize_t rows;
    if (!PyArg_ParseTuple(args, "n:commit_written", &rows))
        return NULL;
    if (slots_may_change(self, 1) < 0)
        return NULL;
    if (rows < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: commit_written: a negative count");
        return NULL;
    }
    kvp_error err;
    if (kvp_cache_commit_written(self->cache, (size_t)rows, &err) != KVP_OK)
        return kvp_py_raise(&err);
    if (rows)
        self->generation++;
    Py_RETURN_NONE;
}
