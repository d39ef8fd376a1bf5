/*
 * src/python/layer.c: kvpager.Layer, one attention layer (kvpager/layer.h).
 *
 * Owns: Layer.create (from four weight arrays: kvp_param_create_matrix,
 * kvp_layer_create_grouped), Layer.random (kvp_layer_create_random(_grouped)),
 * info (kvp_layer_info_get), set_window (kvp_layer_set_window), parameter
 * reads and updates (kvp_layer_param(_mut), kvp_param_update), layer-bound
 * caches (kvp_layer_binding_get + kvp_cache_create; cache.c wraps them) and
 * close (kvp_layer_destroy).
 * Invariants: the object owns its kvp_layer alone (Model.create copies layers
 * into its own model); each Layer.cache() Cache holds the Layer alive and
 * counts in `users` until closed, so close refuses while one is open and the
 * deallocator runs only after them; every failing call raises before
 * changing the layer (the C API's "nothing changed" contract).
 * Callers: module.c.
 */
#include "py_internal.h"

#include <string.h>

#include "kvpager/param.h"

static PyObject *layer_wrap(PyTypeObject *type, kvp_layer *layer)
{
    KvpPyLayer *l = PyObject_New(KvpPyLayer, type);
    if (!l) {
        (void)kvp_layer_destroy(layer, NULL);
        return NULL;
    }
    l->layer = layer;
    l->users = 0;
    l->busy = 0;
    return (PyObject *)l;
}

static PyObject *layer_random(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"model_width", "heads", "max_positions", "rope_base",
                             "seed",        "kv_heads", NULL};
    Py_ssize_t width, heads, maxpos, kv_heads = 0;
    double base = 10000.0;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nnn|dKn:random", kwlist, &width, &heads,
                                     &maxpos, &base, &seed, &kv_heads))
        return NULL;
    if (width < 0 || heads < 0 || maxpos < 0 || kv_heads < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: Layer sizes must not be negative");
        return NULL;
    }
    kvp_layer *layer = NULL;
    kvp_error err;
    kvp_status s = kv_heads ? kvp_layer_create_random_grouped((size_t)width, (size_t)heads,
                                                              (size_t)kv_heads, (size_t)maxpos,
                                                              base, seed, &layer, &err)
                            : kvp_layer_create_random((size_t)width, (size_t)heads,
                                                      (size_t)maxpos, base, seed, &layer, &err);
    if (s != KVP_OK)
        return kvp_py_raise(&err);
    return layer_wrap(type, layer);
}

static PyObject *layer_create(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"weights", "heads", "max_positions", "rope_base", "kv_heads", NULL};
    PyObject *weights;
    Py_ssize_t heads, maxpos, kv_heads = 0;
    double base = 10000.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onn|dn:create", kwlist, &weights, &heads,
                                     &maxpos, &base, &kv_heads))
        return NULL;
    if (heads < 0 || maxpos < 0 || kv_heads < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: Layer sizes must not be negative");
        return NULL;
    }
    kvp_layer *layer = NULL;
    kvp_error err;
    if (kvp_py_layer_from(weights, (size_t)heads, kv_heads ? (size_t)kv_heads : (size_t)heads,
                          (size_t)maxpos, base, &layer, &err) < 0)
        return NULL;
    return layer_wrap(type, layer);
}

static void layer_dealloc(KvpPyLayer *self)
{
    if (self->layer)
        (void)kvp_layer_destroy(self->layer, NULL);
    PyObject_Free(self);
}

static PyObject *layer_close(KvpPyLayer *self, PyObject *unused)
{
    (void)unused;
    if (!self->layer)
        Py_RETURN_NONE;
    if (kvp_py_layer_idle(self) < 0)
        return NULL;
    if (self->users) {
        PyErr_SetString(PyExc_RuntimeError, "kvpager: the layer is in use (open caches bound to it)");
        return NULL;
    }
    kvp_error err;
    if (kvp_layer_destroy(self->layer, &err) != KVP_OK)
        return kvp_py_raise(&err);
    self->layer = NULL;
    Py_RETURN_NONE;
}

static PyObject *layer_info(KvpPyLayer *self, PyObject *unused)
{
    (void)unused;
    if (!self->layer)
        return kvp_py_closed("layer");
    kvp_layer_info i;
    kvp_layer_info_init(&i);
    kvp_error err;
    if (kvp_layer_info_get(self->layer, &i, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:s}", "model_width",
                         (Py_ssize_t)i.model_width, "heads", (Py_ssize_t)i.heads, "kv_heads",
                         (Py_ssize_t)i.kv_heads, "head_width", (Py_ssize_t)i.head_width,
                         "window", (Py_ssize_t)i.window, "sink_tokens",
                         (Py_ssize_t)i.sink_tokens, "accum",
                         i.accum == KVP_ACCUM_FAST ? "fast" : "exact");
}

static PyObject *layer_set_window(KvpPyLayer *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"window", "sink_tokens", NULL};
    Py_ssize_t window, sinks = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|n:set_window", kwlist, &window, &sinks))
        return NULL;
    if (!self->layer)
        return kvp_py_closed("layer");
    if (kvp_py_layer_idle(self) < 0)
        return NULL;
    if (window < 0 || sinks < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: window and sink_tokens must not be negative");
        return NULL;
    }
    kvp_error err;
    if (kvp_layer_set_window(self->layer, (size_t)window, (size_t)sinks, &err) != KVP_OK)
        return kvp_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *layer_set_accum(KvpPyLayer *self, PyObject *args)
{
    const char *accum;
    if (!PyArg_ParseTuple(args, "s:set_accum", &accum))
        return NULL;
    if (!self->layer)
        return kvp_py_closed("layer");
    if (kvp_py_layer_idle(self) < 0)
        return NULL;
    if (strcmp(accum, "exact") != 0 && strcmp(accum, "fast") != 0) {
        PyErr_Format(PyExc_ValueError, "kvpager: accum '%s': not 'exact' or 'fast'", accum);
        return NULL;
    }
    kvp_error err;
    if (kvp_layer_set_accum(self->layer, accum[0] == 'f' ? KVP_ACCUM_FAST : KVP_ACCUM_EXACT,
                            &err) != KVP_OK)
        return kvp_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *layer_set_kv_scales(KvpPyLayer *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"k_scale", "v_scale", NULL};
    double k, v;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "dd:set_kv_scales", kwlist, &k, &v))
        return NULL;
    if (!self->layer)
        return kvp_py_closed("layer");
    if (kvp_py_layer_idle(self) < 0)
        return NULL;
    kvp_error err;
    if (kvp_layer_set_kv_scales(self->layer, k, v, &err) != KVP_OK)
        return kvp_py_raise(&err);
    Py_RETURN_NONE;
}

static kvp_param *layer_param_at(KvpPyLayer *self, Py_ssize_t index)
{
    if (!self->layer) {
        kvp_py_closed("layer");
        return NULL;
    }
    kvp_param *p = index < 0 ? NULL : kvp_layer_param_mut(self->layer, (size_t)index);
    if (!p) {
        kvp_error e = {0};
        e.status = KVP_OUT_OF_RANGE;
        e.argument = "index";
        e.index = (size_t)(index < 0 ? 0 : index);
        kvp_py_raise(&e);
    }
    return p;
}

static PyObject *layer_param(KvpPyLayer *self, PyObject *args)
{
    Py_ssize_t index;
    if (!PyArg_ParseTuple(args, "n:param", &index))
        return NULL;
    kvp_param *p = layer_param_at(self, index);
    if (!p)
        return NULL;
    size_t dims[2] = {kvp_param_rows(p), kvp_param_cols(p)};
    double *data;
    PyObject *arr = kvp_py_new_f64(2, dims, &data);
    if (arr)
        memcpy(data, kvp_param_values(p), dims[0] * dims[1] * sizeof(double));
    return arr;
}

static PyObject *layer_update_param(KvpPyLayer *self, PyObject *args)
{
    Py_ssize_t index;
    PyObject *values;
    if (!PyArg_ParseTuple(args, "nO:update_param", &index, &values))
        return NULL;
    kvp_param *p = layer_param_at(self, index);
    if (!p || kvp_py_layer_idle(self) < 0)
        return NULL;
    Py_buffer b;
    if (kvp_py_f64_buffer(values, &b, "values") < 0)
        return NULL;
    size_t n = kvp_param_rows(p) * kvp_param_cols(p);
    if ((size_t)b.len != n * sizeof(double)) {
        kvp_error e = {0};
        e.status = KVP_PARAMETER_WIDTH_MISMATCH;
        e.expected.rank = 2;
        e.expected.dims[0] = kvp_param_rows(p);
        e.expected.dims[1] = kvp_param_cols(p);
        e.actual.rank = 1;
        e.actual.dims[0] = (size_t)b.len / sizeof(double);
        PyBuffer_Release(&b);
        return kvp_py_raise(&e);
    }
    kvp_error err;
    kvp_status s = kvp_param_update(p, b.buf, &err);
    PyBuffer_Release(&b);
    if (s != KVP_OK)
        return kvp_py_raise(&err);
    return PyLong_FromUnsignedLongLong(kvp_param_revision(p));
}

static PyObject *layer_cache(KvpPyLayer *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"pool", "batch_size", "capacity", NULL};
    PyObject *pool_obj;
    Py_ssize_t batch = 1, capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!|nn:cache", kwlist, &KvpPyPool_Type,
                                     &pool_obj, &batch, &capacity))
        return NULL;
    KvpPyPool *pool = (KvpPyPool *)pool_obj;
    if (!self->layer)
        return kvp_py_closed("layer");
    if (kvp_py_layer_idle(self) < 0)
        return NULL;
    if (!pool->pool)
        return kvp_py_closed("pool");
    if (batch < 0 || capacity < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: Cache sizes must not be negative");
        return NULL;
    }
    kvp_binding b;
    kvp_cache *cache = NULL;
    kvp_error err;
    if (kvp_layer_binding_get(self->layer, &b, &err) != KVP_OK ||
        kvp_cache_create(pool->pool, &b, (size_t)batch, (size_t)capacity, &cache, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return kvp_py_bound_cache(pool, cache, (PyObject *)self);
}

static PyObject *layer_enter(PyObject *self, PyObject *unused)
{
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *layer_exit(KvpPyLayer *self, PyObject *args)
{
    (void)args;
    PyObject *r = layer_close(self, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyMethodDef layer_methods[] = {
    {"random", (PyCFunction)(void (*)(void))layer_random, METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Layer.random(model_width, heads, max_positions, rope_base=10000.0, seed=0, kv_heads=0) "
     "-> Layer: random weights for experiments (kvp_layer_create_random; kv_heads > 0: "
     "grouped-query, kvp_layer_create_random_grouped)."},
    {"create", (PyCFunction)(void (*)(void))layer_create, METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Layer.create(weights, heads, max_positions, rope_base=10000.0, kv_heads=0) -> Layer: "
     "weights is (W_q, W_k, W_v, W_o) (y = x W; W_q and W_o D x D, W_k and W_v "
     "D x (kv_heads * D / heads); converted once to float64; kvp_layer_create_grouped). "
     "Errors: ParameterWidthMismatch, HeadsDoNotDivideWidth, KvHeadsDoNotDivideHeads, Rope*."},
    {"info", (PyCFunction)layer_info, METH_NOARGS,
     "info() -> dict: kvp_layer_info (model_width, heads, kv_heads, head_width, window, "
     "sink_tokens)."},
    {"set_window", (PyCFunction)(void (*)(void))layer_set_window, METH_VARARGS | METH_KEYWORDS,
     "set_window(window, sink_tokens=0): kvp_layer_set_window: attention covers the last "
     "window positions plus the first sink_tokens (window 0: full attention)."},
    {"param", (PyCFunction)layer_param, METH_VARARGS,
     "param(index) -> numpy.ndarray: a copy of W_q, W_k, W_v or W_o (index 0..3)."},
    {"update_param", (PyCFunction)layer_update_param, METH_VARARGS,
     "update_param(index, values) -> new revision: kvp_param_update (values converted once to "
     "float64; ParameterWidthMismatch unless the shape's size matches)."},
    {"cache", (PyCFunction)(void (*)(void))layer_cache, METH_VARARGS | METH_KEYWORDS,
     "cache(pool, batch_size=1, capacity=0) -> Cache: a cache bound to this layer "
     "(kvp_layer_binding_get + kvp_cache_create: its binding records the layer's weights' "
     "revisions, window and scales as of now). The cache holds the layer alive. Errors: "
     "kvp_cache_create's (ZeroCapacity, CapacityExceedsPositions, GeometryMismatch, ...)."},
    {"forward", (PyCFunction)(void (*)(void))kvp_py_layer_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(cache, input, ticket=None) -> numpy.ndarray [B, 1, D]: one token through this "
     "layer and a cache bound to it (kvp_attention_forward: prepare + commit; len + 1). input "
     "[B, 1, D], converted once to float64. The GIL is released while it computes. A ticket "
     "(kvpager.Ticket) is made for the call unless one is given. Errors, changing nothing: "
     "prepare's (InputRank, SingleTokenRequired, InputBatchMismatch, InputWidthMismatch, "
     "CacheLayerMismatch (another layer's or an external cache), CacheLayerRevisionMismatch "
     "(the weights changed since the cache was made), CacheWindowMismatch, Full, "
     "NonFiniteProjection, ..., PoolExhausted), TicketBusy. BufferError while views of the "
     "cache are exported; TypeError for a Sequence's layer cache."},
    {"prepare", (PyCFunction)(void (*)(void))kvp_py_layer_prepare, METH_VARARGS | METH_KEYWORDS,
     "prepare(cache, input, ticket=None) -> Ticket: kvp_attention_prepare: the token's output "
     "against the cache's rows plus its own, held in the ticket with the pages a commit needs; "
     "the cache does not change (Ticket.commit(cache) does). The GIL is released. Errors as "
     "forward, none changing the cache or the pool; a failed prepare leaves a fresh ticket "
     "empty."},
    {"reference", (PyCFunction)(void (*)(void))kvp_py_layer_reference,
     METH_VARARGS | METH_KEYWORDS,
     "reference(input, dtype=None) -> (output [B, T, D], keys, values [B, kv_heads, T, "
     "head_width]): the full-prefix causal reference (kvp_attention_reference; with a dtype "
     "name, kvp_attention_reference_stored: as a pool of that dtype stores K and V), "
     "independent of any cache; token t's output equals forward's at position t. The GIL is "
     "released. Errors: ReferenceInputShape, RopePositionOutOfRange, NonFinite*."},
    {"set_accum", (PyCFunction)layer_set_accum, METH_VARARGS,
     "set_accum(accum): kvp_layer_set_accum: 'exact' (default) or 'fast' for the layer's "
     "decode steps over narrow pages (f64 pages are always exact)."},
    {"set_kv_scales", (PyCFunction)(void (*)(void))layer_set_kv_scales,
     METH_VARARGS | METH_KEYWORDS,
     "set_kv_scales(k_scale, v_scale): kvp_layer_set_kv_scales: the fp8 scales of caches "
     "created from now on (and of reference(dtype='fp8_e4m3')). InvalidArgument ('k_scale', "
     "'v_scale': not finite, normal and > 0) changes nothing."},
    {"close", (PyCFunction)layer_close, METH_NOARGS,
     "close(): kvp_layer_destroy (RuntimeError while caches from cache() are open)."},
    {"__enter__", layer_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)layer_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyTypeObject KvpPyLayer_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.Layer",
    .tp_basicsize = sizeof(KvpPyLayer),
    .tp_dealloc = (destructor)layer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One attention layer (kvp_layer): Layer.create(weights, ...) or "
              "Layer.random(...); info, set_window, set_accum, set_kv_scales, param and "
              "update_param; cache(pool, ...) makes a cache bound to it, which forward(cache, x) "
              "(or prepare + Ticket.commit) fills one token at a time; reference(x) is the "
              "full-prefix oracle. Threads: computations (forward, prepare, reference) may "
              "run on several threads at once; its changes raise RuntimeError meanwhile.",
    .tp_methods = layer_methods,
};
