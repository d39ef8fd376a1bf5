/*
 * src/python/errors.c: the kvpager.Error hierarchy and the input buffers.
 *
 * Owns: kvpager.Error (an Exception) and one subclass per kvp_status but OK,
 * named by kvp_status_name ("PoolExhausted", ...), generated from
 * KVP_STATUS_MAP so the list can never drift from status.h. A raised error
 * carries `status` (the number), `name`, `message` (kvp_error_format's text)
 * and every detail field of kvp_error as an attribute of the same name
 * (shapes as tuples, geometries as (heads, head_width), RoPE configurations
 * as (feature_width, max_positions, base), first_mismatch as a dict or
 * None). Also the helpers that turn Python objects into row buffers.
 * Callers: the files of src/python/.
 */
#include "py_internal.h"

#include <stdio.h>

static PyObject *error_base;                      /* kvpager.Error */
static PyObject *error_classes[KVP_STATUS_COUNT_]; /* by status; [0] unused */
static PyObject *numpy_module;

int kvp_py_errors_init(PyObject *module)
{
    error_base = PyErr_NewExceptionWithDoc(
        "kvpager.Error",
        "A kvpager call failed. Attributes: status (int), name (the status's name), "
        "message (the full text) and the detail fields of kvp_error (argument, what, "
        "index, limit, needed, available, ...). As in C, nothing changed.",
        PyExc_Exception, NULL);
    if (!error_base || PyModule_AddObjectRef(module, "Error", error_base) < 0)
        return -1;
    PyObject *by_status = PyDict_New();
    if (!by_status)
        return -1;
    for (int s = 1; s < KVP_STATUS_COUNT_; s++) {
        char qualified[96];
        const char *name = kvp_status_name((kvp_status)s);
        snprintf(qualified, sizeof qualified, "kvpager.%s", name);
        PyObject *cls = PyErr_NewExceptionWithDoc(qualified, kvp_status_message((kvp_status)s),
                                                  error_base, NULL);
        if (!cls)
            return -1;
        error_classes[s] = cls;
        PyObject *key = PyLong_FromLong(s);
        int bad = !key || PyDict_SetItem(by_status, key, cls) < 0 ||
                  PyModule_AddObjectRef(module, name, cls) < 0;
        Py_XDECREF(key);
        if (bad)
            return -1;
    }
    if (PyModule_AddObject(module, "error_classes", by_status) < 0)
        return -1;
    numpy_module = PyImport_ImportModule("numpy");
    return numpy_module ? 0 : -1;
}

static PyObject *shape_tuple(const kvp_shape *shape)
{
    size_t rank = shape->rank < KVP_MAX_RANK ? shape->rank : KVP_MAX_RANK;
    PyObject *t = PyTuple_New((Py_ssize_t)rank);
    for (size_t i = 0; t && i < rank; i++)
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, PyLong_FromSize_t(shape->dims[i]));
    return t;
}

static PyObject *str_or_none(const char *s)
{
    if (s)
        return PyUnicode_FromString(s);
    Py_RETURN_NONE;
}

PyObject *kvp_py_mismatch_dict(const kvp_mismatch *m)
{
    return Py_BuildValue("{s:i,s:N,s:n,s:n,s:n,s:n}", "invariant", (int)m->invariant, "what",
                         str_or_none(m->what), "page", (Py_ssize_t)m->page, "lane",
                         (Py_ssize_t)m->lane, "expected", (Py_ssize_t)m->expected, "actual",
                         (Py_ssize_t)m->actual);
}

#define SIZE_FIELDS(X)                                                                             \
    X(index) X(limit) X(batch_size) X(heads) X(capacity) X(head_width) X(max_positions)           \
    X(block_tokens) X(bytes) X(budget_bytes) X(page_bytes) X(needed) X(available)                 \
    X(attached_caches) X(attached_reservations) X(held_pages) X(mismatches) X(rank) X(tokens)     \
    X(expected_size) X(actual_size) X(layer_size) X(cache_size) X(parameter) X(position)          \
    X(model_width) X(prepared_len) X(current_len) X(layer) X(token) X(kv_heads)                   \
    X(expected_kv_heads)

static int set_detail(PyObject *exc, const kvp_error *e)
{
    int bad = 0;
#define SET_(field, value)                                                                         \
    do {                                                                                           \
        PyObject *v_ = (value);                                                                    \
        bad |= !v_ || PyObject_SetAttrString(exc, field, v_) < 0;                                 \
        Py_XDECREF(v_);                                                                            \
    } while (0)
#define SIZE_(f) SET_(#f, PyLong_FromSize_t(e->f));
    SIZE_FIELDS(SIZE_)
#undef SIZE_
    SET_("status", PyLong_FromLong((long)e->status));
    SET_("name", PyUnicode_FromString(kvp_status_name(e->status)));
    SET_("argument", str_or_none(e->argument));
    SET_("what", str_or_none(e->what));
    SET_("value", PyFloat_FromDouble(e->value));
    SET_("expected", shape_tuple(&e->expected));
    SET_("actual", shape_tuple(&e->actual));
    SET_("pool_geometry",
         Py_BuildValue("(nn)", (Py_ssize_t)e->pool_geometry.heads,
                       (Py_ssize_t)e->pool_geometry.head_width));
    SET_("binding_geometry",
         Py_BuildValue("(nn)", (Py_ssize_t)e->binding_geometry.heads,
                       (Py_ssize_t)e->binding_geometry.head_width));
    SET_("cache_rope", Py_BuildValue("(nnd)", (Py_ssize_t)e->cache_rope.feature_width,
                                     (Py_ssize_t)e->cache_rope.max_positions, e->cache_rope.base));
    SET_("layer_rope", Py_BuildValue("(nnd)", (Py_ssize_t)e->layer_rope.feature_width,
                                     (Py_ssize_t)e->layer_rope.max_positions, e->layer_rope.base));
    SET_("cache_revision", PyLong_FromUnsignedLongLong(e->cache_revision));
    SET_("layer_revision", PyLong_FromUnsignedLongLong(e->layer_revision));
    if (e->status == KVP_AUDIT_FAILED)
        SET_("first_mismatch", kvp_py_mismatch_dict(&e->first_mismatch));
    else
        SET_("first_mismatch", Py_NewRef(Py_None));
#undef SET_
    return bad ? -1 : 0;
}

PyObject *kvp_py_error_new(const kvp_error *err)
{
    kvp_status s = err->status;
    PyObject *cls = (s > 0 && s < KVP_STATUS_COUNT_) ? error_classes[s] : error_base;
    char text[1024];
    kvp_error_format(err, text, sizeof text);
    PyObject *exc = PyObject_CallFunction(cls, "s", text);
    if (!exc)
        return NULL;
    PyObject *msg = PyUnicode_FromString(text);
    if (!msg || PyObject_SetAttrString(exc, "message", msg) < 0 || set_detail(exc, err) < 0) {
        Py_XDECREF(msg);
        Py_DECREF(exc);
        return NULL;
    }
    Py_DECREF(msg);
    return exc;
}

PyObject *kvp_py_raise(const kvp_error *err)
{
    PyObject *exc = kvp_py_error_new(err);
    if (!exc)
        return NULL;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

PyObject *kvp_py_closed(const char *what)
{
    PyErr_Format(PyExc_ValueError, "kvpager: the %s is closed", what);
    return NULL;
}

PyObject *kvp_py_busy(const char *what)
{
    PyErr_Format(PyExc_RuntimeError, "kvpager: the %s is in use by another thread", what);
    return NULL;
}

int kvp_py_check_unexported(Py_ssize_t exports, const char *what)
{
    if (exports == 0)
        return 0;
    PyErr_Format(PyExc_BufferError,
                 "kvpager: %zd buffer(s) of this %s's pages are exported (release the "
                 "NumPy arrays of its views first); nothing changed",
                 exports, what);
    return -1;
}

static int format_dtype(const char *format, kvp_dtype *dtype)
{
    if (!format)
        return -1;
    if (format[0] == '<' || format[0] == '=' || format[0] == '@')
        format++;
    if (strcmp(format, "d") == 0)
        *dtype = KVP_F64;
    else if (strcmp(format, "f") == 0)
        *dtype = KVP_F32;
    else if (strcmp(format, "e") == 0)
        *dtype = KVP_F16;
    else
        return -1;
    return 0;
}

static int converted_buffer(PyObject *obj, Py_buffer *view, const char *name)
{
    PyObject *arr = PyObject_CallMethod(numpy_module, "ascontiguousarray", "Os", obj, "float64");
    if (!arr)
        return -1;
    int rc = PyObject_GetBuffer(arr, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    Py_DECREF(arr); /* the buffer keeps the array alive (view->obj) */
    if (rc < 0)
        PyErr_Format(PyExc_TypeError, "kvpager: %s is not convertible to float64", name);
    return rc;
}

int kvp_py_rows_buffer(PyObject *obj, Py_buffer *view, kvp_dtype *dtype, const char *name)
{
    if (PyObject_CheckBuffer(obj) &&
        PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        if (format_dtype(view->format, dtype) == 0)
            return 0;
        PyBuffer_Release(view);
    }
    PyErr_Clear();
    *dtype = KVP_F64;
    return converted_buffer(obj, view, name);
}

int kvp_py_f64_buffer(PyObject *obj, Py_buffer *view, const char *name)
{
    kvp_dtype dtype;
    if (PyObject_CheckBuffer(obj) &&
        PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        if (format_dtype(view->format, &dtype) == 0 && dtype == KVP_F64)
            return 0;
        PyBuffer_Release(view);
    }
    PyErr_Clear();
    return converted_buffer(obj, view, name);
}

PyObject *kvp_py_new_f64(int ndim, const size_t *dims, double **data)
{
    PyObject *shape = PyTuple_New(ndim);
    for (int i = 0; shape && i < ndim; i++)
        PyTuple_SET_ITEM(shape, i, PyLong_FromSize_t(dims[i]));
    if (!shape)
        return NULL;
    PyObject *arr = PyObject_CallMethod(numpy_module, "zeros", "Os", shape, "float64");
    Py_DECREF(shape);
    if (!arr)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    *data = view.buf; /* the array owns the memory; it outlives the release */
    PyBuffer_Release(&view);
    return arr;
}
