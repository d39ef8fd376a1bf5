/*
 * src/python/attention.c: one layer's attention steps from Python
 * (kvpager/attention.h): kvpager.Ticket (kvp_ticket_create / commit /
 * discard / result / destroy) and the Layer methods forward
 * (kvp_attention_forward), prepare (kvp_attention_prepare) and reference
 * (kvp_attention_reference(_stored)), over a layer-bound Cache
 * (Layer.cache()).
 *
 * Owns: the Ticket type and those three methods (layer.c lists them).
 * Invariants: a Ticket holds the Cache it was sized for and the Cache of its
 * last successful prepare (so the pool its reserved pages came from outlives
 * them: destroying a ticket discards its row); prepare, forward and
 * reference run with the GIL released while the layer's `busy`, the
 * ticket's and the cache's busy flags refuse every other call that would
 * change them (RuntimeError); a commit bumps the cache's generation (older
 * views raise PageNotHeld) and is refused while views' buffers are exported
 * (BufferError). Every failure raises before or instead of a change: the C
 * calls change nothing on failure.
 * Callers: layer.c (the methods), module.c (the type).
 */
#include "py_internal.h"

#include <string.h>

#include "kvpager/attention.h"

typedef struct {
    PyObject_HEAD
    kvp_ticket *ticket;   /* owned; NULL once closed */
    PyObject *cache;      /* strong: the Cache it was made for */
    PyObject *prepared;   /* strong: the Cache of the last successful prepare, or NULL */
    int busy;             /* a prepare or forward runs with the GIL released */
} KvpPyTicket;

int kvp_py_layer_idle(KvpPyLayer *self)
{
    if (!self->busy)
        return 0;
    kvp_py_busy("layer");
    return -1;
}

static PyObject *ticket_wrap(PyObject *cache, kvp_ticket *ticket)
{
    KvpPyTicket *t = PyObject_New(KvpPyTicket, &KvpPyTicket_Type);
    if (!t) {
        (void)kvp_ticket_destroy(ticket, NULL);
        return NULL;
    }
    t->ticket = ticket;
    t->cache = Py_NewRef(cache);
    t->prepared = NULL;
    t->busy = 0;
    return (PyObject *)t;
}

static PyObject *ticket_make(KvpPyCache *cache)
{
    if (kvp_py_cache_may_read(cache) < 0)
        return NULL;
    kvp_ticket *t = NULL;
    kvp_error err;
    if (kvp_ticket_create(cache->cache, &t, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return ticket_wrap((PyObject *)cache, t);
}

static PyObject *ticket_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)type;
    static char *kwlist[] = {"cache", NULL};
    PyObject *cache;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!:Ticket", kwlist, &KvpPyCache_Type, &cache))
        return NULL;
    return ticket_make((KvpPyCache *)cache);
}

static void ticket_dealloc(KvpPyTicket *self)
{
    if (self->ticket) /* discards a prepared row: its pool is alive through `prepared` */
        (void)kvp_ticket_destroy(self->ticket, NULL);
    Py_XDECREF(self->prepared);
    Py_XDECREF(self->cache);
    PyObject_Free(self);
}

static int ticket_usable(KvpPyTicket *self)
{
    if (!self->ticket) {
        kvp_py_closed("ticket");
        return -1;
    }
    if (self->busy) {
        kvp_py_busy("ticket");
        return -1;
    }
    return 0;
}

static PyObject *ticket_close(KvpPyTicket *self, PyObject *unused)
{
    (void)unused;
    if (!self->ticket)
        Py_RETURN_NONE;
    if (ticket_usable(self) < 0)
        return NULL;
    (void)kvp_ticket_destroy(self->ticket, NULL);
    self->ticket = NULL;
    Py_CLEAR(self->prepared);
    Py_RETURN_NONE;
}

static PyObject *ticket_commit(KvpPyTicket *self, PyObject *args)
{
    PyObject *cache_obj;
    if (!PyArg_ParseTuple(args, "O!:commit", &KvpPyCache_Type, &cache_obj))
        return NULL;
    KvpPyCache *cache = (KvpPyCache *)cache_obj;
    if (ticket_usable(self) < 0 || kvp_py_cache_may_change(cache) < 0)
        return NULL;
    kvp_error err;
    if (kvp_ticket_commit(self->ticket, cache->cache, &err) != KVP_OK)
        return kvp_py_raise(&err);
    (*kvp_py_cache_generation(cache))++;
    Py_RETURN_NONE;
}

static PyObject *ticket_discard(KvpPyTicket *self, PyObject *unused)
{
    (void)unused;
    if (ticket_usable(self) < 0)
        return NULL;
    kvp_error err;
    if (kvp_ticket_discard(self->ticket, &err) != KVP_OK)
        return kvp_py_raise(&err);
    Py_RETURN_NONE;
}

/* A new float64 array of `dims` holding a copy of `src`. */
static PyObject *copy_f64(int ndim, const size_t *dims, const double *src)
{
    double *data;
    PyObject *arr = kvp_py_new_f64(ndim, dims, &data);
    size_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= dims[i];
    if (arr && n)
        memcpy(data, src, n * sizeof(double));
    return arr;
}

static PyObject *ticket_result(KvpPyTicket *self, PyObject *unused)
{
    (void)unused;
    if (ticket_usable(self) < 0)
        return NULL;
    kvp_attention_result r;
    kvp_error err;
    if (kvp_ticket_result(self->ticket, &r, &err) != KVP_OK)
        return kvp_py_raise(&err);
    size_t od[3] = {r.batch_size, 1, r.model_width};
    size_t wd[4] = {r.batch_size, r.heads, 1, r.keys};
    PyObject *out = copy_f64(3, od, r.output);
    PyObject *w = out ? copy_f64(4, wd, r.weights) : NULL;
    if (!w) {
        Py_XDECREF(out);
        return NULL;
    }
    return Py_BuildValue("{s:N,s:N,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:O}", "output", out,
                         "weights", w, "batch_size", (Py_ssize_t)r.batch_size, "heads",
                         (Py_ssize_t)r.heads, "model_width", (Py_ssize_t)r.model_width, "keys",
                         (Py_ssize_t)r.keys, "position", (Py_ssize_t)r.work.position,
                         "full_prefix_rows_per_projection",
                         (Py_ssize_t)r.work.full_prefix_rows_per_projection,
                         "incremental_rows_per_projection",
                         (Py_ssize_t)r.work.incremental_rows_per_projection,
                         "reused_key_value_rows", (Py_ssize_t)r.work.reused_key_value_rows,
                         "reserved_pages", (Py_ssize_t)r.reserved_pages, "committed",
                         r.committed ? Py_True : Py_False);
}

static PyObject *ticket_get_closed(KvpPyTicket *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(!self->ticket);
}

static PyObject *ticket_enter(PyObject *self, PyObject *unused)
{
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *ticket_exit(KvpPyTicket *self, PyObject *args)
{
    (void)args;
    PyObject *r = ticket_close(self, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

/* input as a [.., .., D] float64 tensor (converted once); b released by the caller. */
static int input_tensor(PyObject *in, Py_buffer *b, kvp_tensor *t)
{
    if (kvp_py_f64_buffer(in, b, "input") < 0)
        return -1;
    memset(t, 0, sizeof *t);
    t->data = b->buf;
    t->shape.rank = (size_t)b->ndim;
    for (int i = 0; i < b->ndim && i < KVP_MAX_RANK; i++)
        t->shape.dims[i] = (size_t)b->shape[i];
    return 0;
}

/* forward (commit 1) or prepare (0) of one token through `cache`. */
static PyObject *layer_step(KvpPyLayer *self, PyObject *args, PyObject *kwds, int commit)
{
    static char *kwlist[] = {"cache", "input", "ticket", NULL};
    PyObject *cache_obj, *in, *ticket_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, commit ? "O!O|O:forward" : "O!O|O:prepare",
                                     kwlist, &KvpPyCache_Type, &cache_obj, &in, &ticket_obj))
        return NULL;
    KvpPyCache *cache = (KvpPyCache *)cache_obj;
    if (ticket_obj != Py_None && !PyObject_TypeCheck(ticket_obj, &KvpPyTicket_Type)) {
        PyErr_SetString(PyExc_TypeError, "kvpager: ticket must be a kvpager.Ticket or None");
        return NULL;
    }
    if (!self->layer)
        return kvp_py_closed("layer");
    if ((commit ? kvp_py_cache_may_change(cache) : kvp_py_cache_may_read(cache)) < 0)
        return NULL;
    PyObject *tobj = ticket_obj == Py_None ? ticket_make(cache) : Py_NewRef(ticket_obj);
    if (!tobj)
        return NULL;
    KvpPyTicket *t = (KvpPyTicket *)tobj;
    Py_buffer b;
    kvp_tensor x;
    if (ticket_usable(t) < 0 || input_tensor(in, &b, &x) < 0) {
        Py_DECREF(tobj);
        return NULL;
    }
    kvp_error err;
    kvp_status s;
    int *cache_busy = kvp_py_cache_busy(cache);
    *cache_busy = 1;
    t->busy = 1;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    s = commit ? kvp_attention_forward(self->layer, &x, cache->cache, t->ticket, &err)
               : kvp_attention_prepare(self->layer, &x, cache->cache, t->ticket, &err);
    Py_END_ALLOW_THREADS
    self->busy--;
    t->busy = 0;
    *cache_busy = 0;
    PyBuffer_Release(&b);
    if (s != KVP_OK) {
        Py_DECREF(tobj);
        return kvp_py_raise(&err);
    }
    Py_XSETREF(t->prepared, Py_NewRef(cache_obj)); /* its pages' pool stays alive */
    if (!commit)
        return tobj;
    (*kvp_py_cache_generation(cache))++;
    PyObject *result = ticket_result(t, NULL);
    PyObject *out = result ? Py_XNewRef(PyDict_GetItemString(result, "output")) : NULL;
    Py_XDECREF(result);
    Py_DECREF(tobj);
    return out;
}

PyObject *kvp_py_layer_forward(KvpPyLayer *self, PyObject *args, PyObject *kwds)
{
    return layer_step(self, args, kwds, 1);
}

PyObject *kvp_py_layer_prepare(KvpPyLayer *self, PyObject *args, PyObject *kwds)
{
    return layer_step(self, args, kwds, 0);
}

static int dtype_named(const char *name, kvp_dtype *out)
{
    static const kvp_dtype all[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(name, kvp_dtype_name(all[i])) == 0) {
            *out = all[i];
            return 0;
        }
    PyErr_Format(PyExc_ValueError,
                 "kvpager: dtype '%s': not one of 'f64', 'f32', 'bf16', 'f16', 'fp8_e4m3'", name);
    return -1;
}

PyObject *kvp_py_layer_reference(KvpPyLayer *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"input", "dtype", NULL};
    PyObject *in;
    const char *dname = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|z:reference", kwlist, &in, &dname))
        return NULL;
    if (!self->layer)
        return kvp_py_closed("layer");
    kvp_dtype dtype = KVP_F64;
    if (dname && dtype_named(dname, &dtype) < 0)
        return NULL;
    kvp_layer_info li;
    kvp_layer_info_init(&li);
    kvp_error err;
    if (kvp_layer_info_get(self->layer, &li, &err) != KVP_OK)
        return kvp_py_raise(&err);
    Py_buffer b;
    kvp_tensor x;
    if (input_tensor(in, &b, &x) < 0)
        return NULL;
    /* a wrong shape gets arrays of the right rank but no room: C names the error */
    int ok = b.ndim == 3;
    size_t B = ok ? (size_t)b.shape[0] : 0, T = ok ? (size_t)b.shape[1] : 0;
    size_t od[3] = {B, T, li.model_width}, kd[4] = {B, li.kv_heads, T, li.head_width};
    double *o, *k, *v;
    PyObject *out = kvp_py_new_f64(3, od, &o);
    PyObject *keys = out ? kvp_py_new_f64(4, kd, &k) : NULL;
    PyObject *vals = keys ? kvp_py_new_f64(4, kd, &v) : NULL;
    if (!vals) {
        Py_XDECREF(out);
        Py_XDECREF(keys);
        PyBuffer_Release(&b);
        return NULL;
    }
    size_t on = B * T * li.model_width, kn = B * li.kv_heads * T * li.head_width;
    kvp_status s;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    s = dname ? kvp_attention_reference_stored(self->layer, dtype, &x, o, on, k, v, kn, &err)
              : kvp_attention_reference(self->layer, &x, o, on, k, v, kn, &err);
    Py_END_ALLOW_THREADS
    self->busy--;
    PyBuffer_Release(&b);
    if (s != KVP_OK) {
        Py_DECREF(out);
        Py_DECREF(keys);
        Py_DECREF(vals);
        return kvp_py_raise(&err);
    }
    return Py_BuildValue("(NNN)", out, keys, vals);
}

static PyMethodDef ticket_methods[] = {
    {"commit", (PyCFunction)ticket_commit, METH_VARARGS,
     "commit(cache): kvp_ticket_commit: make the prepared row visible in `cache` (len + 1). "
     "Refuses, changing nothing: TicketEmpty (nothing prepared, or already committed or "
     "discarded), TicketForeignCache (prepared for another cache), TicketStale (the cache "
     "changed since the prepare); a refused ticket keeps its row and pages until discard(). "
     "BufferError while views of the cache are exported; TypeError for a sequence's cache."},
    {"discard", (PyCFunction)ticket_discard, METH_NOARGS,
     "discard(): kvp_ticket_discard: drop a prepared row, its reserved pages back to the pool. "
     "Idempotent."},
    {"result", (PyCFunction)ticket_result, METH_NOARGS,
     "result() -> dict: kvp_ticket_result of the last prepare (copies): output [B, 1, D], "
     "weights [B, H, 1, keys], batch_size, heads, model_width, keys (positions attended, the "
     "candidate included), position, full_prefix_rows_per_projection, "
     "incremental_rows_per_projection, reused_key_value_rows, reserved_pages (held for the "
     "commit), committed. TicketEmpty when nothing was prepared."},
    {"close", (PyCFunction)ticket_close, METH_NOARGS,
     "close(): kvp_ticket_destroy (a prepared row is discarded, its pages returned)."},
    {"__enter__", ticket_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)ticket_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ticket_getset[] = {
    {"closed", (getter)ticket_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject KvpPyTicket_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.Ticket",
    .tp_basicsize = sizeof(KvpPyTicket),
    .tp_dealloc = (destructor)ticket_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ticket(cache)\n\nA two-phase attention step's holder (kvp_ticket_create): sized "
              "for `cache` (its batch, heads, KV heads, head width, capacity), it serves any "
              "layer-bound cache of that geometry and no larger capacity. Layer.prepare(cache, "
              "x, ticket) computes one token's output and holds its rotated key, value and the "
              "pages a commit needs; commit(cache) makes the row visible, discard() drops it. "
              "Threads: one owner at a time (RuntimeError while another thread's prepare on "
              "it runs). Holds its cache (and so its pool) alive.",
    .tp_methods = ticket_methods,
    .tp_getset = ticket_getset,
    .tp_new = ticket_new,
};
