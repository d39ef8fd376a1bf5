/*
 * src/python/views.c: kvpager.View, a zero-copy read-only buffer over memory
 * a cache owns: a page's rows (kvp_pool_page_data) or a lane's block table
 * (kvp_cache_block_table), through the buffer protocol and DLPack.
 *
 * The C API makes such memory valid until the next call that changes the
 * cache (cache.h, kvp_cache_block_table and kvp_pool_page_data), and gives
 * no way to hold a page from outside. So a view enforces that rule itself:
 *   - it records the generation of its cache (or of the sequence owning the
 *     cache) when made; every call that changes the cache bumps it, and a
 *     view whose generation is old refuses to export (PageNotHeld, what
 *     "released"): a released page's view raises;
 *   - while a buffer it exported is alive (a NumPy array over it), the owner
 *     refuses every change (BufferError, as bytearray refuses to resize), so
 *     no exported pointer can ever outlive its memory.
 * Invariant: *exports_of counts the buffers exported by all views of the
 * owner and not yet released. Callers: pool.c and sequence.c make views.
 */
#include "py_internal.h"

#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *keeper; /* strong: the Cache or Sequence whose fields follow */
    unsigned long *generation_of;
    Py_ssize_t *exports_of;
    unsigned long generation;
    Py_ssize_t exports;
    const void *buf;
    const char *format;
    Py_ssize_t itemsize;
    int ndim;
    Py_ssize_t shape[4];
    Py_ssize_t strides[4];
    int is_page;
    uint32_t page;
    int writable; /* a reserved slot's view (slots.c): exports writable buffers */
} KvpPyView;

PyObject *kvp_py_view_new(KvpPyCache *cache, PyObject *keeper, unsigned long *generation_of,
                          Py_ssize_t *exports_of, const void *buf, const char *format,
                          Py_ssize_t itemsize, int ndim, const Py_ssize_t *shape,
                          const Py_ssize_t *strides, int is_page, uint32_t page)
{
    (void)cache;
    KvpPyView *v = PyObject_New(KvpPyView, &KvpPyView_Type);
    if (!v)
        return NULL;
    v->keeper = Py_NewRef(keeper);
    v->generation_of = generation_of;
    v->exports_of = exports_of;
    v->generation = *generation_of;
    v->exports = 0;
    v->buf = buf;
    v->format = format;
    v->itemsize = itemsize;
    v->ndim = ndim;
    for (int i = 0; i < ndim; i++) {
        v->shape[i] = shape[i];
        v->strides[i] = strides[i];
    }
    v->is_page = is_page;
    v->page = page;
    v->writable = 0;
    return (PyObject *)v;
}

void kvp_py_view_set_writable(PyObject *view)
{
    ((KvpPyView *)view)->writable = 1;
}

static void view_dealloc(KvpPyView *v)
{
    Py_XDECREF(v->keeper);
    PyObject_Free(v);
}

static int view_valid(const KvpPyView *v)
{
    return *v->generation_of == v->generation;
}

static int view_getbuffer(KvpPyView *v, Py_buffer *out, int flags)
{
    if (!view_valid(v)) {
        kvp_error e = {0};
        e.status = KVP_PAGE_NOT_HELD;
        e.what = "released";
        e.index = v->page;
        kvp_py_raise(&e);
        out->obj = NULL;
        return -1;
    }
    if ((flags & PyBUF_WRITABLE) && !v->writable) {
        PyErr_SetString(PyExc_BufferError, "kvpager: views are read-only");
        out->obj = NULL;
        return -1;
    }
    Py_ssize_t len = v->itemsize;
    for (int i = 0; i < v->ndim; i++)
        len *= v->shape[i];
    out->buf = (void *)v->buf;
    out->obj = Py_NewRef((PyObject *)v);
    out->len = len;
    out->readonly = !v->writable;
    out->itemsize = v->itemsize;
    out->format = (flags & PyBUF_FORMAT) ? (char *)v->format : NULL;
    out->ndim = v->ndim;
    out->shape = v->shape;
    out->strides = v->strides;
    out->suboffsets = NULL;
    out->internal = NULL;
    if ((flags & PyBUF_STRIDES) != PyBUF_STRIDES) {
        /* a consumer without strides gets only a contiguous view */
        Py_ssize_t expect = v->itemsize;
        for (int i = v->ndim - 1; i >= 0; i--) {
            if (v->shape[i] > 1 && v->strides[i] != expect) {
                Py_CLEAR(out->obj);
                PyErr_SetString(PyExc_BufferError, "kvpager: this view needs strides");
                return -1;
            }
            expect *= v->shape[i];
        }
        out->strides = NULL;
        if ((flags & PyBUF_ND) != PyBUF_ND)
            out->shape = NULL;
    }
    v->exports++;
    (*v->exports_of)++;
    return 0;
}

static void view_releasebuffer(KvpPyView *v, Py_buffer *view)
{
    (void)view;
    v->exports--;
    (*v->exports_of)--;
}

static PyBufferProcs view_as_buffer = {
    .bf_getbuffer = (getbufferproc)view_getbuffer,
    .bf_releasebuffer = (releasebufferproc)view_releasebuffer,
};

static PyObject *view_get_valid(KvpPyView *v, void *closure)
{
    (void)closure;
    return PyBool_FromLong(view_valid(v));
}

static PyObject *view_get_page(KvpPyView *v, void *closure)
{
    (void)closure;
    if (!v->is_page)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(v->page);
}

static PyObject *view_get_shape(KvpPyView *v, void *closure)
{
    (void)closure;
    PyObject *t = PyTuple_New(v->ndim);
    for (int i = 0; t && i < v->ndim; i++)
        PyTuple_SET_ITEM(t, i, PyLong_FromSsize_t(v->shape[i]));
    return t;
}

static PyObject *view_get_writable(KvpPyView *v, void *closure)
{
    (void)closure;
    return PyBool_FromLong(v->writable);
}

static PyObject *view_get_exports(KvpPyView *v, void *closure)
{
    (void)closure;
    return PyLong_FromSsize_t(v->exports);
}

/* numpy.asarray(view): NumPy tries the buffer first and, when that raises,
 * falls back to __array__, which must raise too (else a stale view would
 * become a 0-d object array). */
static PyObject *view_numpy(KvpPyView *v, PyObject *args)
{
    (void)args;
    PyObject *mv = PyMemoryView_FromObject((PyObject *)v);
    if (!mv)
        return NULL;
    PyObject *np = PyImport_ImportModule("numpy");
    PyObject *arr = np ? PyObject_CallMethod(np, "asarray", "O", mv) : NULL;
    Py_XDECREF(np);
    Py_DECREF(mv);
    return arr;
}

/* ---- DLPack (dlpack.h v0.6+, the stable ABI; written out: Debian has no
 * dlpack header). torch.from_dlpack(view) wraps the page without copying;
 * bf16 pages come out as torch.bfloat16. The export counts as one buffer
 * export of the view until the consumer's tensor dies (the deleter). DLPack
 * before 1.0 has no read-only flag: the tensor must not be written. */
typedef struct {
    int32_t device_type;
    int32_t device_id;
} kvp_dl_device;
typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} kvp_dl_dtype;
typedef struct {
    void *data;
    kvp_dl_device device;
    int32_t ndim;
    kvp_dl_dtype dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} kvp_dl_tensor;
typedef struct kvp_dl_managed {
    kvp_dl_tensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct kvp_dl_managed *self);
} kvp_dl_managed;

typedef struct {
    kvp_dl_managed managed;
    int64_t shape[4];
    int64_t strides[4];
    KvpPyView *view;
} dl_export;

static void dl_deleter(kvp_dl_managed *m)
{
    dl_export *e = m->manager_ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    e->view->exports--;
    (*e->view->exports_of)--;
    Py_DECREF((PyObject *)e->view);
    PyMem_Free(e);
    PyGILState_Release(g);
}

static void dl_capsule_free(PyObject *capsule)
{
    /* Not consumed (still named "dltensor"): the deleter is ours to call. */
    if (!PyCapsule_IsValid(capsule, "dltensor"))
        return;
    kvp_dl_managed *m = PyCapsule_GetPointer(capsule, "dltensor");
    if (m && m->deleter)
        m->deleter(m);
}

static int dl_type_of(const char *format, kvp_dl_dtype *t)
{
    static const struct {
        char format;
        uint8_t code, bits;
    } map[] = {{'d', 2, 64}, {'f', 2, 32}, {'e', 2, 16}, {'H', 4, 16}, {'B', 1, 8}, {'I', 1, 32}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        if (format[0] == map[i].format) {
            t->code = map[i].code;
            t->bits = map[i].bits;
            t->lanes = 1;
            return 0;
        }
    }
    return -1;
}

static PyObject *view_dlpack(KvpPyView *v, PyObject *args, PyObject *kwds)
{
    (void)args;
    (void)kwds; /* stream: CPU memory needs none */
    Py_buffer probe;
    if (view_getbuffer(v, &probe, PyBUF_RECORDS_RO) < 0)
        return NULL; /* a stale view raises PageNotHeld */
    dl_export *e = PyMem_Calloc(1, sizeof *e);
    if (!e || dl_type_of(v->format, &e->managed.dl_tensor.dtype) < 0) {
        PyMem_Free(e);
        PyBuffer_Release(&probe);
        return e ? PyErr_Format(PyExc_BufferError, "kvpager: no DLPack type") : PyErr_NoMemory();
    }
    for (int i = 0; i < v->ndim; i++) {
        e->shape[i] = v->shape[i];
        e->strides[i] = v->strides[i] / v->itemsize;
    }
    kvp_dl_tensor *t = &e->managed.dl_tensor;
    t->data = (void *)v->buf;
    t->device.device_type = 1; /* kDLCPU */
    t->ndim = v->ndim;
    t->shape = e->shape;
    t->strides = e->strides;
    e->managed.manager_ctx = e;
    e->managed.deleter = dl_deleter;
    /* The probe's export becomes the tensor's: its release is the deleter's. */
    e->view = (KvpPyView *)probe.obj; /* the reference the probe took */
    PyObject *capsule = PyCapsule_New(&e->managed, "dltensor", dl_capsule_free);
    if (!capsule)
        dl_deleter(&e->managed);
    return capsule;
}

static PyObject *view_dlpack_device(KvpPyView *v, PyObject *unused)
{
    (void)v;
    (void)unused;
    return Py_BuildValue("(ii)", 1, 0); /* kDLCPU, device 0 */
}

static PyMethodDef view_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))view_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None): a DLPack capsule over the view (torch.from_dlpack(view)); bf16 "
     "pages as bfloat16. The view counts it as an export until the tensor dies; do not write "
     "through it."},
    {"__dlpack_device__", (PyCFunction)view_dlpack_device, METH_NOARGS, "(kDLCPU, 0)."},
    {"numpy", (PyCFunction)view_numpy, METH_NOARGS,
     "numpy() -> numpy.ndarray over the view's memory, zero-copy (as numpy.asarray(view)). "
     "Raises kvpager.PageNotHeld once the cache changed."},
    {"__array__", (PyCFunction)view_numpy, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef view_getset[] = {
    {"valid", (getter)view_get_valid, NULL,
     "True while the memory is the cache's: no call changed the cache since the view was made.",
     NULL},
    {"page", (getter)view_get_page, NULL, "The page id of a page view (None for a block table).",
     NULL},
    {"shape", (getter)view_get_shape, NULL, "The shape of the buffer.", NULL},
    {"exports", (getter)view_get_exports, NULL, "Buffers of this view still exported.", NULL},
    {"writable", (getter)view_get_writable, NULL,
     "True for a reserved slot's view (Cache.reserved_slots): arrays over it may be written "
     "until commit_written or any other change of the cache.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject KvpPyView_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.View",
    .tp_basicsize = sizeof(KvpPyView),
    .tp_dealloc = (destructor)view_dealloc,
    .tp_as_buffer = &view_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A zero-copy, read-only buffer over a cache's memory: a page's rows "
              "(Cache.page_view: shape (2, heads, rows, head_width), keys then values, in "
              "the pool's dtype; bf16 as uint16, fp8 as uint8) or a lane's block table "
              "(Cache.block_table: uint32 page ids). numpy.asarray(view) wraps it without "
              "copying. Valid until the next call that changes the cache: then exporting "
              "raises kvpager.PageNotHeld (what 'released'); while an exported array is "
              "alive, calls that would change the cache raise BufferError.",
    .tp_getset = view_getset,
    .tp_methods = view_methods,
};
