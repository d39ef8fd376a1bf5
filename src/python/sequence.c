/*
 * src/python/sequence.c: kvpager.Model and kvpager.Sequence (kvpager/model.h,
 * kvpager/sequence.h).
 *
 * Owns: Model.random (kvp_model_create_random(_grouped)), info, parameter
 * reads and updates (kvp_param_update), close; Sequence(model, pool, ...):
 * step and prefill (the GIL released), fork, truncate, reset, promise,
 * adopt_prefix / publish_prefix, its layers' caches (read-only Cache
 * objects) and close.
 * Invariants: a Sequence holds its Model and Pool alive (a model is
 * destroyed only after its sequences: MODEL_BUSY cannot arise from the
 * garbage collector); Model.busy counts its sequences' steps running with
 * the GIL released, and a parameter update refuses (RuntimeError) while any
 * runs, as kvp_param_update's contract demands; Sequence.busy refuses a
 * second thread's call on the same sequence.
 * Callers: module.c.
 */
#include "py_internal.h"

#include "kvpager/layer.h"
#include "kvpager/param.h"

static PyObject *model_random(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"layers", "model_width", "heads", "max_positions", "rope_base",
                             "seed", "kv_heads", NULL};
    Py_ssize_t layers, width, heads, maxpos, kv_heads = 0;
    double base = 10000.0;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nnnn|dKn:random", kwlist, &layers, &width,
                                     &heads, &maxpos, &base, &seed, &kv_heads))
        return NULL;
    if (layers < 0 || width < 0 || heads < 0 || maxpos < 0 || kv_heads < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: Model sizes must not be negative");
        return NULL;
    }
    kvp_model *model = NULL;
    kvp_error err;
    kvp_status s =
        kv_heads ? kvp_model_create_random_grouped((size_t)layers, (size_t)width, (size_t)heads,
                                                   (size_t)kv_heads, (size_t)maxpos, base, seed,
                                                   &model, &err)
                 : kvp_model_create_random((size_t)layers, (size_t)width, (size_t)heads,
                                           (size_t)maxpos, base, seed, &model, &err);
    if (s != KVP_OK)
        return kvp_py_raise(&err);
    KvpPyModel *m = PyObject_New(KvpPyModel, type);
    if (!m) {
        (void)kvp_model_destroy(model, NULL);
        return NULL;
    }
    m->model = model;
    m->busy = 0;
    m->users = 0;
    return (PyObject *)m;
}

/* One layer from its four weight arrays (converted once to float64). */
int kvp_py_layer_from(PyObject *ws, size_t heads, size_t kv_heads, size_t maxpos, double base,
                      kvp_layer **out, kvp_error *err)
{
    PyObject *fast = PySequence_Fast(ws, "kvpager: a layer is (W_q, W_k, W_v, W_o)");
    if (!fast)
        return -1;
    kvp_param *p[KVP_PARAM_COUNT] = {NULL, NULL, NULL, NULL};
    int rc = -1;
    if (PySequence_Fast_GET_SIZE(fast) != KVP_PARAM_COUNT) {
        PyErr_SetString(PyExc_ValueError, "kvpager: a layer is (W_q, W_k, W_v, W_o)");
        goto done;
    }
    for (int i = 0; i < KVP_PARAM_COUNT; i++) {
        Py_buffer b;
        if (kvp_py_f64_buffer(PySequence_Fast_GET_ITEM(fast, i), &b, "a weight") < 0)
            goto done;
        size_t rows = b.ndim == 2 ? (size_t)b.shape[0] : 0;
        size_t cols = b.ndim == 2 ? (size_t)b.shape[1] : 0;
        kvp_status s = kvp_param_create_matrix(rows, cols, b.buf, &p[i], err);
        PyBuffer_Release(&b);
        if (s != KVP_OK) {
            kvp_py_raise(err);
            goto done;
        }
    }
    if (kvp_layer_create_grouped(p[0], p[1], p[2], p[3], heads, kv_heads, maxpos, base, out,
                                 err) != KVP_OK) {
        kvp_py_raise(err);
        goto done;
    }
    rc = 0;
done:
    for (int i = 0; i < KVP_PARAM_COUNT; i++) {
        kvp_status ignored = kvp_param_release(p[i], NULL); /* the layer holds its own */
        (void)ignored;
    }
    Py_DECREF(fast);
    return rc;
}

static PyObject *model_create(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"weights", "heads", "max_positions", "rope_base", "kv_heads", NULL};
    PyObject *weights;
    Py_ssize_t heads, maxpos, kv_heads = 0;
    double base = 10000.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onn|dn:create", kwlist, &weights, &heads,
                                     &maxpos, &base, &kv_heads))
        return NULL;
    if (heads < 0 || maxpos < 0 || kv_heads < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: Model sizes must not be negative");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(weights, "kvpager: weights is a list of layers");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    kvp_layer **layers = PyMem_Calloc((size_t)n + 1, sizeof *layers);
    kvp_model *model = NULL;
    kvp_error err;
    PyObject *r = NULL;
    Py_ssize_t made = 0;
    if (!layers) {
        PyErr_NoMemory();
        goto done;
    }
    for (; made < n; made++)
        if (kvp_py_layer_from(PySequence_Fast_GET_ITEM(fast, made), (size_t)heads,
                              kv_heads ? (size_t)kv_heads : (size_t)heads, (size_t)maxpos, base,
                              &layers[made], &err) < 0)
            goto done;
    if (kvp_model_create((const kvp_layer *const *)layers, (size_t)n, &model, &err) != KVP_OK) {
        kvp_py_raise(&err);
        goto done;
    }
    KvpPyModel *m = PyObject_New(KvpPyModel, type);
    if (!m) {
        kvp_status ignored = kvp_model_destroy(model, NULL);
        (void)ignored;
        goto done;
    }
    m->model = model;
    m->busy = 0;
    m->users = 0;
    r = (PyObject *)m;
done:
    for (Py_ssize_t i = 0; layers && i < made; i++) {
        kvp_status ignored = kvp_layer_destroy(layers[i], NULL); /* the model keeps its own */
        (void)ignored;
    }
    PyMem_Free(layers);
    Py_DECREF(fast);
    return r;
}

static void model_dealloc(KvpPyModel *self)
{
    if (self->model)
        (void)kvp_model_destroy(self->model, NULL); /* no sequence: each holds this object */
    PyObject_Free(self);
}

static PyObject *model_close(KvpPyModel *self, PyObject *unused)
{
    (void)unused;
    if (!self->model)
        Py_RETURN_NONE;
    if (self->busy || self->users) {
        PyErr_SetString(PyExc_RuntimeError,
                        "kvpager: the model is in use (a step runs, or a Scheduler holds it)");
        return NULL;
    }
    kvp_error err;
    if (kvp_model_destroy(self->model, &err) != KVP_OK)
        return kvp_py_raise(&err);
    self->model = NULL;
    Py_RETURN_NONE;
}

static PyObject *model_info(KvpPyModel *self, PyObject *unused)
{
    (void)unused;
    if (!self->model)
        return kvp_py_closed("model");
    kvp_model_info i;
    kvp_model_info_init(&i);
    kvp_error err;
    if (kvp_model_info_get(self->model, &i, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n}", "layers", (Py_ssize_t)i.layers, "model_width",
                         (Py_ssize_t)i.model_width, "heads", (Py_ssize_t)i.heads, "kv_heads",
                         (Py_ssize_t)i.kv_heads, "head_width", (Py_ssize_t)i.head_width);
}

static kvp_param *model_param_at(KvpPyModel *self, PyObject *args, const char *fmt,
                                 PyObject **values)
{
    Py_ssize_t layer, index;
    int ok = values ? PyArg_ParseTuple(args, fmt, &layer, &index, values)
                    : PyArg_ParseTuple(args, fmt, &layer, &index);
    if (!ok)
        return NULL;
    if (!self->model) {
        kvp_py_closed("model");
        return NULL;
    }
    kvp_param *p = (layer < 0 || index < 0)
                       ? NULL
                       : kvp_model_param_mut(self->model, (size_t)layer, (size_t)index);
    if (!p) {
        kvp_error e = {0};
        e.status = KVP_OUT_OF_RANGE;
        e.argument = layer < 0 || !kvp_model_layer(self->model, (size_t)layer) ? "layer"
                                                                               : "index";
        e.index = (size_t)(layer < 0 ? 0 : layer);
        kvp_py_raise(&e);
    }
    return p;
}

static PyObject *model_param(KvpPyModel *self, PyObject *args)
{
    kvp_param *p = model_param_at(self, args, "nn:param", NULL);
    if (!p)
        return NULL;
    size_t dims[2] = {kvp_param_rows(p), kvp_param_cols(p)};
    double *data;
    PyObject *arr = kvp_py_new_f64(2, dims, &data);
    if (arr)
        memcpy(data, kvp_param_values(p), dims[0] * dims[1] * sizeof(double));
    return arr;
}

static PyObject *model_update_param(KvpPyModel *self, PyObject *args)
{
    PyObject *values;
    kvp_param *p = model_param_at(self, args, "nnO:update_param", &values);
    if (!p)
        return NULL;
    if (self->busy)
        return kvp_py_busy("model");
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

static PyObject *model_set_accum(KvpPyModel *self, PyObject *args)
{
    const char *accum;
    if (!PyArg_ParseTuple(args, "s:set_accum", &accum))
        return NULL;
    if (!self->model)
        return kvp_py_closed("model");
    if (self->busy)
        return kvp_py_busy("model");
    if (strcmp(accum, "exact") != 0 && strcmp(accum, "fast") != 0) {
        PyErr_Format(PyExc_ValueError, "kvpager: accum '%s': not 'exact' or 'fast'", accum);
        return NULL;
    }
    kvp_error err;
    if (kvp_model_set_accum(self->model, accum[0] == 'f' ? KVP_ACCUM_FAST : KVP_ACCUM_EXACT,
                            &err) != KVP_OK)
        return kvp_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *any_enter(PyObject *self, PyObject *unused)
{
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *model_exit(KvpPyModel *self, PyObject *args)
{
    (void)args;
    PyObject *r = model_close(self, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyMethodDef model_methods[] = {
    {"random", (PyCFunction)(void (*)(void))model_random, METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Model.random(layers, model_width, heads, max_positions, rope_base=10000.0, seed=0, "
     "kv_heads=0) -> Model: random layers for experiments (kvp_model_create_random; "
     "kv_heads > 0: grouped-query, kvp_model_create_random_grouped)."},
    {"create", (PyCFunction)(void (*)(void))model_create, METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Model.create(weights, heads, max_positions, rope_base=10000.0, kv_heads=0) -> Model: "
     "layers from weights, a list of (W_q, W_k, W_v, W_o) per layer (y = x W; W_q and W_o "
     "D x D, W_k and W_v D x (kv_heads * D / heads); converted once to float64; "
     "kvp_param_create_matrix, kvp_layer_create_grouped, kvp_model_create). Errors: "
     "ParameterWidthMismatch, HeadsDoNotDivideWidth, KvHeadsDoNotDivideHeads, Rope*."},
    {"info", (PyCFunction)model_info, METH_NOARGS, "info() -> dict: kvp_model_info."},
    {"param", (PyCFunction)model_param, METH_VARARGS,
     "param(layer, index) -> numpy.ndarray: a copy of W_q, W_k, W_v or W_o (index 0..3)."},
    {"update_param", (PyCFunction)model_update_param, METH_VARARGS,
     "update_param(layer, index, values) -> new revision: kvp_param_update (values converted "
     "once to float64). Sequences bound before it are stale (CacheLayerRevisionMismatch). "
     "RuntimeError while a sequence of the model steps on another thread."},
    {"set_accum", (PyCFunction)model_set_accum, METH_VARARGS,
     "set_accum(accum): kvp_model_set_accum: 'exact' (default) or 'fast' for every layer's "
     "decode steps over narrow pages (all layers or none). RuntimeError while a sequence of "
     "the model steps on another thread."},
    {"close", (PyCFunction)model_close, METH_NOARGS,
     "close(): kvp_model_destroy (ModelBusy while sequences live)."},
    {"__enter__", any_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)model_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyTypeObject KvpPyModel_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.Model",
    .tp_basicsize = sizeof(KvpPyModel),
    .tp_dealloc = (destructor)model_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A stack of attention layers (kvp_model). Make one with Model.random(...). "
              "Each Sequence holds its model alive.",
    .tp_methods = model_methods,
};

/* ---- Sequence ------------------------------------------------------------ */

static PyObject *seq_wrap(kvp_sequence *s, KvpPyModel *model, KvpPyPool *pool)
{
    KvpPySequence *q = PyObject_New(KvpPySequence, &KvpPySequence_Type);
    if (!q) {
        (void)kvp_sequence_destroy(s, NULL);
        return NULL;
    }
    q->sequence = s;
    q->model = (KvpPyModel *)Py_NewRef((PyObject *)model);
    q->pool = (KvpPyPool *)Py_NewRef((PyObject *)pool);
    q->generation = 0;
    q->exports = 0;
    q->busy = 0;
    return (PyObject *)q;
}

static PyObject *seq_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)type;
    static char *kwlist[] = {"model", "pool", "batch_size", "capacity", NULL};
    PyObject *m, *p;
    Py_ssize_t batch = 1, capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!|nn:Sequence", kwlist, &KvpPyModel_Type, &m,
                                     &KvpPyPool_Type, &p, &batch, &capacity))
        return NULL;
    KvpPyModel *model = (KvpPyModel *)m;
    KvpPyPool *pool = (KvpPyPool *)p;
    if (!model->model)
        return kvp_py_closed("model");
    if (!pool->pool)
        return kvp_py_closed("pool");
    if (batch < 0 || capacity < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: Sequence sizes must not be negative");
        return NULL;
    }
    kvp_sequence *s = NULL;
    kvp_error err;
    if (kvp_sequence_create(model->model, pool->pool, (size_t)batch, (size_t)capacity, &s,
                            &err) != KVP_OK)
        return kvp_py_raise(&err);
    return seq_wrap(s, model, pool);
}

static void seq_dealloc(KvpPySequence *self)
{
    if (self->sequence)
        (void)kvp_sequence_destroy(self->sequence, NULL);
    Py_XDECREF((PyObject *)self->model);
    Py_XDECREF((PyObject *)self->pool);
    PyObject_Free(self);
}

static int seq_may_change(KvpPySequence *self)
{
    if (!self->sequence) {
        kvp_py_closed("sequence");
        return -1;
    }
    if (self->busy) {
        kvp_py_busy("sequence");
        return -1;
    }
    return kvp_py_check_unexported(self->exports, "sequence");
}

/* step (prefill 0) or prefill (1): input [B, T, D] f64 -> output [B, T, D]. */
static PyObject *seq_run(KvpPySequence *self, PyObject *args, int prefill)
{
    PyObject *in;
    if (!PyArg_ParseTuple(args, prefill ? "O:prefill" : "O:step", &in))
        return NULL;
    if (seq_may_change(self) < 0)
        return NULL;
    Py_buffer b;
    if (kvp_py_f64_buffer(in, &b, "input") < 0)
        return NULL;
    kvp_tensor t = {.data = b.buf};
    t.shape.rank = (size_t)b.ndim;
    size_t out_n = 1;
    for (int i = 0; i < b.ndim && i < KVP_MAX_RANK; i++) {
        t.shape.dims[i] = (size_t)b.shape[i];
        out_n *= (size_t)b.shape[i];
    }
    size_t dims[3] = {b.ndim == 3 ? (size_t)b.shape[0] : 0, b.ndim == 3 ? (size_t)b.shape[1] : 0,
                      b.ndim == 3 ? (size_t)b.shape[2] : 0};
    double *out = NULL;
    PyObject *arr = kvp_py_new_f64(3, dims, &out);
    if (!arr) {
        PyBuffer_Release(&b);
        return NULL;
    }
    kvp_error err;
    kvp_status s;
    self->busy = 1;
    self->model->busy++;
    Py_BEGIN_ALLOW_THREADS
    s = prefill ? kvp_sequence_prefill(self->sequence, &t, NULL, NULL, out,
                                       b.ndim == 3 ? out_n : 0, &err)
                : kvp_sequence_step(self->sequence, &t, NULL, NULL, out, b.ndim == 3 ? out_n : 0,
                                    &err);
    Py_END_ALLOW_THREADS
    self->model->busy--;
    self->busy = 0;
    PyBuffer_Release(&b);
    if (s != KVP_OK) {
        Py_DECREF(arr);
        return kvp_py_raise(&err);
    }
    self->generation++;
    return arr;
}

static PyObject *seq_step(KvpPySequence *self, PyObject *args)
{
    return seq_run(self, args, 0);
}

static PyObject *seq_prefill(KvpPySequence *self, PyObject *args)
{
    return seq_run(self, args, 1);
}

static PyObject *seq_size_call(KvpPySequence *self, PyObject *args, const char *fmt,
                               kvp_status (*fn)(kvp_sequence *, size_t, kvp_error *))
{
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, fmt, &n))
        return NULL;
    if (seq_may_change(self) < 0)
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: a negative count");
        return NULL;
    }
    kvp_error err;
    if (fn(self->sequence, (size_t)n, &err) != KVP_OK)
        return kvp_py_raise(&err);
    self->generation++;
    Py_RETURN_NONE;
}

static PyObject *seq_truncate(KvpPySequence *self, PyObject *args)
{
    return seq_size_call(self, args, "n:truncate", kvp_sequence_truncate);
}

static PyObject *seq_promise(KvpPySequence *self, PyObject *args)
{
    return seq_size_call(self, args, "n:promise", kvp_sequence_promise);
}

static PyObject *seq_reset(KvpPySequence *self, PyObject *unused)
{
    (void)unused;
    if (seq_may_change(self) < 0)
        return NULL;
    kvp_error err;
    if (kvp_sequence_reset(self->sequence, &err) != KVP_OK)
        return kvp_py_raise(&err);
    self->generation++;
    Py_RETURN_NONE;
}

static PyObject *seq_fork(KvpPySequence *self, PyObject *unused)
{
    (void)unused;
    if (seq_may_change(self) < 0)
        return NULL;
    kvp_sequence *child = NULL;
    kvp_error err;
    if (kvp_sequence_fork(self->sequence, &child, &err) != KVP_OK)
        return kvp_py_raise(&err);
    self->generation++;
    return seq_wrap(child, self->model, self->pool);
}

static PyObject *seq_prefix(KvpPySequence *self, PyObject *args, PyObject *kwds, int publish)
{
    static char *kwlist[] = {"prompt", "salt", NULL};
    PyObject *in;
    unsigned long long salt_lo = 0, salt_hi = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, publish ? "O|(KK):publish_prefix"
                                                         : "O|(KK):adopt_prefix",
                                     kwlist, &in, &salt_lo, &salt_hi))
        return NULL;
    const kvp_block_key salt = {.lo = salt_lo, .hi = salt_hi};
    if (seq_may_change(self) < 0)
        return NULL;
    Py_buffer b;
    if (kvp_py_f64_buffer(in, &b, "prompt") < 0)
        return NULL;
    kvp_tensor t = {.data = b.buf};
    t.shape.rank = (size_t)b.ndim;
    for (int i = 0; i < b.ndim && i < KVP_MAX_RANK; i++)
        t.shape.dims[i] = (size_t)b.shape[i];
    size_t n = 0;
    kvp_error err;
    kvp_status s = publish
                       ? kvp_sequence_publish_prefix_salted(self->sequence, &t, &salt, &n, &err)
                       : kvp_sequence_adopt_prefix_salted(self->sequence, &t, &salt, &n, &err);
    PyBuffer_Release(&b);
    if (s != KVP_OK)
        return kvp_py_raise(&err);
    if (!publish && n)
        self->generation++;
    return PyLong_FromSize_t(n);
}

static PyObject *seq_adopt_prefix(KvpPySequence *self, PyObject *args, PyObject *kwds)
{
    return seq_prefix(self, args, kwds, 0);
}

static PyObject *seq_publish_prefix(KvpPySequence *self, PyObject *args, PyObject *kwds)
{
    return seq_prefix(self, args, kwds, 1);
}

static PyObject *seq_cache(KvpPySequence *self, PyObject *args)
{
    Py_ssize_t layer;
    if (!PyArg_ParseTuple(args, "n:cache", &layer))
        return NULL;
    if (!self->sequence)
        return kvp_py_closed("sequence");
    const kvp_cache *c = layer < 0 ? NULL : kvp_sequence_cache(self->sequence, (size_t)layer);
    if (!c) {
        kvp_error e = {0};
        e.status = KVP_OUT_OF_RANGE;
        e.argument = "layer";
        e.index = (size_t)(layer < 0 ? 0 : layer);
        return kvp_py_raise(&e);
    }
    return kvp_py_layer_cache(self->pool, c, (PyObject *)self);
}

static PyObject *seq_close(KvpPySequence *self, PyObject *unused)
{
    (void)unused;
    if (!self->sequence)
        Py_RETURN_NONE;
    if (seq_may_change(self) < 0)
        return NULL;
    (void)kvp_sequence_destroy(self->sequence, NULL);
    self->sequence = NULL;
    self->generation++;
    Py_RETURN_NONE;
}

static PyObject *seq_exit(KvpPySequence *self, PyObject *args)
{
    (void)args;
    PyObject *r = seq_close(self, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

#define SEQ_GETTER(name, expr)                                                                     \
    static PyObject *seq_get_##name(KvpPySequence *self, void *closure)                           \
    {                                                                                              \
        (void)closure;                                                                             \
        if (!self->sequence)                                                                       \
            return kvp_py_closed("sequence");                                                      \
        if (self->busy)                                                                            \
            return kvp_py_busy("sequence");                                                        \
        return PyLong_FromSize_t(expr(self->sequence));                                            \
    }
SEQ_GETTER(len, kvp_sequence_len)
SEQ_GETTER(capacity, kvp_sequence_capacity)
SEQ_GETTER(held_pages, kvp_sequence_held_pages)
SEQ_GETTER(promised_pages, kvp_sequence_promised_pages)

static PyObject *seq_get_closed(KvpPySequence *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->sequence == NULL);
}

static PyMethodDef seq_methods[] = {
    {"step", (PyCFunction)seq_step, METH_VARARGS,
     "step(input) -> numpy.ndarray: one token for every layer (kvp_sequence_step). input is "
     "[batch, 1, model_width] float64 (converted once otherwise); the output is the residual "
     "stream after the last layer, same shape. The GIL is released; other sequences may "
     "step on other threads at once."},
    {"prefill", (PyCFunction)seq_prefill, METH_VARARGS,
     "prefill(prompt) -> numpy.ndarray [batch, T, model_width]: T tokens (kvp_sequence_prefill), "
     "the GIL released. Nothing changes on failure (pages and counters; see sequence.h)."},
    {"fork", (PyCFunction)seq_fork, METH_NOARGS,
     "fork() -> Sequence sharing every page (copy-on-write)."},
    {"truncate", (PyCFunction)seq_truncate, METH_VARARGS, "truncate(new_len)."},
    {"promise", (PyCFunction)seq_promise, METH_VARARGS, "promise(pages)."},
    {"reset", (PyCFunction)seq_reset, METH_NOARGS, "reset(): length 0, every page back."},
    {"adopt_prefix", (PyCFunction)(void (*)(void))seq_adopt_prefix, METH_VARARGS | METH_KEYWORDS,
     "adopt_prefix(prompt, salt=None) -> tokens adopted from the pool's prefix index (empty "
     "sequence). salt (lo, hi) (kvp_sequence_adopt_prefix_salted, vLLM's cache_salt): only "
     "blocks published under the same salt are found; None or (0, 0): no salt."},
    {"publish_prefix", (PyCFunction)(void (*)(void))seq_publish_prefix,
     METH_VARARGS | METH_KEYWORDS,
     "publish_prefix(prompt, salt=None) -> blocks published (the prompt's full blocks computed "
     "so far), under salt (kvp_sequence_publish_prefix_salted) when given."},
    {"cache", (PyCFunction)seq_cache, METH_VARARGS,
     "cache(layer) -> Cache: a read-only layer-bound Cache (keys, values, block_table, "
     "page_view); its views are valid until the sequence changes."},
    {"close", (PyCFunction)seq_close, METH_NOARGS, "close(): kvp_sequence_destroy."},
    {"__enter__", any_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)seq_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef seq_getset[] = {
    {"len", (getter)seq_get_len, NULL, "Positions computed per lane.", NULL},
    {"capacity", (getter)seq_get_capacity, NULL, "Positions per lane at most.", NULL},
    {"held_pages", (getter)seq_get_held_pages, NULL, "Pages its caches hold.", NULL},
    {"promised_pages", (getter)seq_get_promised_pages, NULL, "Promise not yet taken.", NULL},
    {"closed", (getter)seq_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject KvpPySequence_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.Sequence",
    .tp_basicsize = sizeof(KvpPySequence),
    .tp_dealloc = (destructor)seq_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sequence(model, pool, batch_size=1, capacity)\n\nA model's layer caches for "
              "batch_size lanes of capacity positions in `pool` (kvp_sequence_create). "
              "Threads: one owner at a time (another thread's call while one runs raises "
              "RuntimeError); sequences of one pool step on different threads at once, the "
              "GIL released. Holds its model and pool alive.",
    .tp_methods = seq_methods,
    .tp_getset = seq_getset,
    .tp_new = seq_new,
};
