/*
 * src/python/cache.c: kvpager.Cache, a paged KV cache (kvpager/cache.h).
 *
 * Owns: the Cache type. An external cache (Cache(pool, ...)) takes rows from
 * Python: append_rows, reserve_rows / commit_rows / discard_rows (the GIL
 * released while rows are copied), fork, truncate, reset, promise, publish
 * and adopt; every cache gives keys()/values() copies and zero-copy views of
 * its block tables and pages (views.c). A layer-bound cache is a read-only
 * window on one layer of a Sequence (Sequence.cache(layer)); its changes
 * are the sequence's. A Layer.cache() cache (layer.c) is a cache of its own
 * bound to a standalone Layer.
 * Invariants: a Cache holds its Pool (and its Sequence, for a layer cache;
 * its Layer, for a Layer.cache() one and its forks) alive; every call that changes the cache first refuses while views'
 * buffers are exported (BufferError) or another thread runs a call on it
 * (RuntimeError), then bumps the generation when it succeeds, so older views
 * raise PageNotHeld. Failed calls change nothing, as in C.
 * Callers: module.c (the type), sequence.c (layer caches).
 */
#include "py_internal.h"

#include "kvpager/paged.h"

/* A layer cache is its sequence's: closed with it, busy while it steps. */
static int cache_closed(const KvpPyCache *self)
{
    return !self->cache || (self->owner && !((KvpPySequence *)self->owner)->sequence);
}

static int cache_busy(const KvpPyCache *self)
{
    return self->busy || (self->owner && ((KvpPySequence *)self->owner)->busy);
}

#define CACHE_OPEN(self)                                                                           \
    do {                                                                                           \
        if (cache_closed(self))                                                                    \
            return kvp_py_closed("cache");                                                         \
        if (cache_busy(self))                                                                      \
            return kvp_py_busy("cache");                                                           \
    } while (0)

static unsigned long *gen_of(KvpPyCache *self)
{
    return self->owner ? &((KvpPySequence *)self->owner)->generation : &self->generation;
}

static Py_ssize_t *exports_of(KvpPyCache *self)
{
    return self->owner ? &((KvpPySequence *)self->owner)->exports : &self->exports;
}

/* Before a change: open, owned by no sequence, no buffer exported, not busy. */
static int may_change(KvpPyCache *self)
{
    if (cache_closed(self)) {
        kvp_py_closed("cache");
        return -1;
    }
    if (self->owner) {
        PyErr_SetString(PyExc_TypeError,
                        "kvpager: a sequence's layer cache changes only through its Sequence");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "kvpager: the cache is in use by another thread");
        return -1;
    }
    return kvp_py_check_unexported(self->exports, "cache");
}

/* For attention.c and group.c: the same checks and fields, by function. */
int kvp_py_cache_may_change(KvpPyCache *self)
{
    return may_change(self);
}

int kvp_py_cache_may_read(KvpPyCache *self)
{
    if (cache_closed(self)) {
        kvp_py_closed("cache");
        return -1;
    }
    if (cache_busy(self)) {
        kvp_py_busy("cache");
        return -1;
    }
    return 0;
}

unsigned long *kvp_py_cache_generation(KvpPyCache *self)
{
    return gen_of(self);
}

int *kvp_py_cache_busy(KvpPyCache *self)
{
    return self->owner ? &((KvpPySequence *)self->owner)->busy : &self->busy;
}

static PyObject *cache_wrap(KvpPyPool *pool, kvp_cache *cache, PyObject *owner)
{
    KvpPyCache *c = PyObject_New(KvpPyCache, &KvpPyCache_Type);
    if (!c) {
        if (!owner)
            (void)kvp_cache_destroy(cache, NULL);
        return NULL;
    }
    c->cache = cache;
    c->pool = (KvpPyPool *)Py_NewRef((PyObject *)pool);
    c->owner = owner ? Py_NewRef(owner) : NULL;
    c->layer = NULL;
    c->generation = 0;
    c->exports = 0;
    c->busy = 0;
    return (PyObject *)c;
}

PyObject *kvp_py_layer_cache(KvpPyPool *pool, const kvp_cache *cache, PyObject *sequence)
{
    return cache_wrap(pool, (kvp_cache *)cache, sequence);
}

PyObject *kvp_py_bound_cache(KvpPyPool *pool, kvp_cache *cache, PyObject *layer)
{
    KvpPyCache *c = (KvpPyCache *)cache_wrap(pool, cache, NULL);
    if (c) {
        c->layer = Py_NewRef(layer);
        ((KvpPyLayer *)layer)->users++;
    }
    return (PyObject *)c;
}

/* A Layer.cache() cache lets its layer go (closed, or deallocated). */
static void cache_unbind(KvpPyCache *self)
{
    if (self->layer) {
        ((KvpPyLayer *)self->layer)->users--;
        Py_CLEAR(self->layer);
    }
}

static PyObject *cache_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)type;
    static char *kwlist[] = {"pool", "batch_size", "capacity", "identity", "revision",
                             "max_positions", NULL};
    PyObject *pool_obj;
    Py_ssize_t batch = 1, capacity = 0, max_positions = 0;
    unsigned long long identity = 0, revision = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!|nnKKn:Cache", kwlist, &KvpPyPool_Type,
                                     &pool_obj, &batch, &capacity, &identity, &revision,
                                     &max_positions))
        return NULL;
    KvpPyPool *pool = (KvpPyPool *)pool_obj;
    if (!pool->pool)
        return kvp_py_closed("pool");
    if (batch < 0 || capacity < 0 || max_positions < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: Cache sizes must not be negative");
        return NULL;
    }
    kvp_page_layout l;
    kvp_page_layout_init(&l);
    kvp_error err;
    kvp_binding b;
    kvp_cache *cache = NULL;
    if (kvp_pool_page_layout_get(pool->pool, &l, &err) != KVP_OK ||
        kvp_binding_init_external(&b, l.heads, l.head_width,
                                  max_positions ? (size_t)max_positions
                                                : (capacity ? (size_t)capacity : 1),
                                  identity, revision, &err) != KVP_OK ||
        kvp_cache_create(pool->pool, &b, (size_t)batch, (size_t)capacity, &cache, &err) !=
            KVP_OK)
        return kvp_py_raise(&err);
    return cache_wrap(pool, cache, NULL);
}

static void cache_dealloc(KvpPyCache *self)
{
    if (self->cache && !self->owner)
        (void)kvp_cache_destroy(self->cache, NULL);
    cache_unbind(self);
    Py_XDECREF(self->owner);
    Py_XDECREF((PyObject *)self->pool);
    PyObject_Free(self);
}

static PyObject *cache_close(KvpPyCache *self, PyObject *unused)
{
    (void)unused;
    if (cache_closed(self))
        Py_RETURN_NONE;
    if (may_change(self) < 0)
        return NULL;
    (void)kvp_cache_destroy(self->cache, NULL);
    self->cache = NULL;
    self->generation++;
    cache_unbind(self);
    Py_RETURN_NONE;
}

static PyObject *cache_enter(PyObject *self, PyObject *unused)
{
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *cache_exit(KvpPyCache *self, PyObject *args)
{
    (void)args;
    if (self->owner)
        Py_RETURN_FALSE;
    PyObject *r = cache_close(self, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static int shape_error(kvp_status status, const kvp_cache_info *info, const Py_buffer *v)
{
    kvp_error e = {0};
    e.status = status;
    e.expected.rank = 4;
    e.expected.dims[0] = info->batch_size;
    e.expected.dims[1] = info->binding.kv_heads;
    e.expected.dims[2] = v->ndim == 4 ? (size_t)v->shape[2] : 0;
    e.expected.dims[3] = info->binding.head_width;
    e.actual.rank = (size_t)v->ndim;
    for (int i = 0; i < v->ndim && i < KVP_MAX_RANK; i++)
        e.actual.dims[i] = (size_t)v->shape[i];
    kvp_py_raise(&e);
    return -1;
}

/* keys and values as [B, H_kv, rows, d_h] buffers of one dtype; *rows from their shape. */
static int rows_args(KvpPyCache *self, PyObject *k, PyObject *v, Py_buffer *kb, Py_buffer *vb,
                     kvp_dtype *dtype, size_t *rows)
{
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    kvp_error err;
    if (kvp_cache_info_get(self->cache, &info, &err) != KVP_OK) {
        kvp_py_raise(&err);
        return -1;
    }
    kvp_dtype vd;
    if (kvp_py_rows_buffer(k, kb, dtype, "keys") < 0)
        return -1;
    if (kvp_py_rows_buffer(v, vb, &vd, "values") < 0) {
        PyBuffer_Release(kb);
        return -1;
    }
    int bad = 0;
    const Py_buffer *which[2] = {kb, vb};
    for (int i = 0; i < 2 && !bad; i++) {
        const Py_buffer *b = which[i];
        if (b->ndim != 4 || (size_t)b->shape[0] != info.batch_size ||
            (size_t)b->shape[1] != info.binding.kv_heads ||
            (size_t)b->shape[3] != info.binding.head_width ||
            (i == 1 && b->shape[2] != kb->shape[2]))
            bad = shape_error(i ? KVP_VALUE_SHAPE_MISMATCH : KVP_KEY_SHAPE_MISMATCH, &info, b);
    }
    if (!bad && vd != *dtype) {
        PyErr_SetString(PyExc_TypeError, "kvpager: keys and values differ in dtype");
        bad = -1;
    }
    if (bad) {
        PyBuffer_Release(kb);
        PyBuffer_Release(vb);
        return -1;
    }
    *rows = (size_t)kb->shape[2];
    return 0;
}

static PyObject *rows_call(KvpPyCache *self, PyObject *args, int commit)
{
    PyObject *k, *v;
    if (!PyArg_ParseTuple(args, commit ? "OO:commit_rows" : "OO:append_rows", &k, &v))
        return NULL;
    if (may_change(self) < 0)
        return NULL;
    Py_buffer kb, vb;
    kvp_dtype dtype;
    size_t rows;
    if (rows_args(self, k, v, &kb, &vb, &dtype, &rows) < 0)
        return NULL;
    kvp_error err;
    kvp_status s;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    s = commit ? kvp_cache_commit_rows_typed(self->cache, dtype, kb.buf, vb.buf, rows, &err)
               : kvp_cache_append_rows_typed(self->cache, dtype, kb.buf, vb.buf, rows, &err);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyBuffer_Release(&kb);
    PyBuffer_Release(&vb);
    if (s != KVP_OK)
        return kvp_py_raise(&err);
    if (rows)
        self->generation++;
    Py_RETURN_NONE;
}

static PyObject *cache_append_rows(KvpPyCache *self, PyObject *args)
{
    return rows_call(self, args, 0);
}

static PyObject *cache_commit_rows(KvpPyCache *self, PyObject *args)
{
    return rows_call(self, args, 1);
}

/* The calls taking one size: reserve_rows, truncate, promise. */
static PyObject *size_call(KvpPyCache *self, PyObject *args, const char *fmt,
                           kvp_status (*fn)(kvp_cache *, size_t, kvp_error *))
{
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, fmt, &n))
        return NULL;
    if (may_change(self) < 0)
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: a negative count");
        return NULL;
    }
    kvp_error err;
    if (fn(self->cache, (size_t)n, &err) != KVP_OK)
        return kvp_py_raise(&err);
    self->generation++;
    Py_RETURN_NONE;
}

static PyObject *cache_reserve_rows(KvpPyCache *self, PyObject *args)
{
    return size_call(self, args, "n:reserve_rows", kvp_cache_reserve_rows);
}

static PyObject *cache_truncate(KvpPyCache *self, PyObject *args)
{
    return size_call(self, args, "n:truncate", kvp_cache_truncate);
}

static PyObject *cache_promise(KvpPyCache *self, PyObject *args)
{
    return size_call(self, args, "n:promise", kvp_cache_promise);
}

static PyObject *cache_discard_rows(KvpPyCache *self, PyObject *unused)
{
    (void)unused;
    if (may_change(self) < 0)
        return NULL;
    kvp_error err;
    if (kvp_cache_discard_rows(self->cache, &err) != KVP_OK)
        return kvp_py_raise(&err);
    self->generation++;
    Py_RETURN_NONE;
}

static PyObject *cache_reset(KvpPyCache *self, PyObject *unused)
{
    (void)unused;
    if (may_change(self) < 0)
        return NULL;
    kvp_error err;
    if (kvp_cache_reset(self->cache, &err) != KVP_OK)
        return kvp_py_raise(&err);
    self->generation++;
    Py_RETURN_NONE;
}

static PyObject *cache_fork(KvpPyCache *self, PyObject *unused)
{
    (void)unused;
    if (may_change(self) < 0)
        return NULL;
    kvp_cache *child = NULL;
    kvp_error err;
    if (kvp_cache_fork(self->cache, &child, &err) != KVP_OK)
        return kvp_py_raise(&err);
    self->generation++; /* the parent's partial last page turns copy-on-write */
    if (self->layer) /* a Layer.cache() fork is bound to the same Layer */
        return kvp_py_bound_cache(self->pool, child, self->layer);
    return cache_wrap(self->pool, child, NULL);
}

static PyObject *snapshot(KvpPyCache *self, int values)
{
    CACHE_OPEN(self);
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    kvp_error err;
    if (kvp_cache_info_get(self->cache, &info, &err) != KVP_OK)
        return kvp_py_raise(&err);
    size_t dims[4] = {info.batch_size, info.binding.kv_heads, info.len, info.binding.head_width};
    double *data;
    PyObject *arr = kvp_py_new_f64(4, dims, &data);
    if (!arr)
        return NULL;
    size_t n = dims[0] * dims[1] * dims[2] * dims[3];
    kvp_status s = values ? kvp_cache_values(self->cache, data, n, &err)
                          : kvp_cache_keys(self->cache, data, n, &err);
    if (s != KVP_OK) {
        Py_DECREF(arr);
        return kvp_py_raise(&err);
    }
    return arr;
}

static PyObject *cache_keys(KvpPyCache *self, PyObject *unused)
{
    (void)unused;
    return snapshot(self, 0);
}

static PyObject *cache_values(KvpPyCache *self, PyObject *unused)
{
    (void)unused;
    return snapshot(self, 1);
}

static PyObject *cache_block_table(KvpPyCache *self, PyObject *args)
{
    Py_ssize_t lane;
    if (!PyArg_ParseTuple(args, "n:block_table", &lane))
        return NULL;
    CACHE_OPEN(self);
    const uint32_t *table = NULL;
    size_t blocks = 0;
    kvp_error err;
    if (lane < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: block_table: negative lane");
        return NULL;
    }
    if (kvp_cache_block_table(self->cache, (size_t)lane, &table, &blocks, &err) != KVP_OK)
        return kvp_py_raise(&err);
    Py_ssize_t shape[1] = {(Py_ssize_t)blocks};
    Py_ssize_t strides[1] = {(Py_ssize_t)sizeof(uint32_t)};
    static uint32_t empty;
    return kvp_py_view_new(self, (PyObject *)self, gen_of(self), exports_of(self),
                           blocks ? (const void *)table : (const void *)&empty, "I",
                           (Py_ssize_t)sizeof(uint32_t), 1, shape, strides, 0, 0);
}

static const char *dtype_format(kvp_dtype d)
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

static PyObject *cache_page_view(KvpPyCache *self, PyObject *args)
{
    Py_ssize_t lane, block;
    if (!PyArg_ParseTuple(args, "nn:page_view", &lane, &block))
        return NULL;
    CACHE_OPEN(self);
    if (lane < 0 || block < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: page_view: negative lane or block");
        return NULL;
    }
    uint32_t page;
    const void *keys, *values;
    kvp_page_layout l;
    kvp_page_layout_init(&l);
    kvp_error err;
    if (kvp_cache_page(self->cache, (size_t)lane, (size_t)block, &page, &err) != KVP_OK ||
        kvp_pool_page_data(self->pool->pool, page, &keys, &values, &l, &err) != KVP_OK)
        return kvp_py_raise(&err);
    size_t len = kvp_cache_len(self->cache);
    size_t first = (size_t)block * l.block_tokens;
    size_t rows = len - first < l.block_tokens ? len - first : l.block_tokens;
    Py_ssize_t shape[4] = {2, (Py_ssize_t)l.heads, (Py_ssize_t)rows, (Py_ssize_t)l.head_width};
    Py_ssize_t strides[4] = {(Py_ssize_t)l.values_offset_bytes, (Py_ssize_t)l.head_stride_bytes,
                             (Py_ssize_t)l.row_stride_bytes, (Py_ssize_t)l.element_bytes};
    return kvp_py_view_new(self, (PyObject *)self, gen_of(self), exports_of(self), keys,
                           dtype_format(l.dtype), (Py_ssize_t)l.element_bytes, 4, shape,
                           strides, 1, page);
}

/* One [B, H or H_kv, d_h] buffer of the queries' format, or None. */
static int attention_input(PyObject *obj, Py_buffer *b, kvp_dtype want, const char *name)
{
    kvp_dtype got;
    if (obj == Py_None)
        return 0;
    if (kvp_py_rows_buffer(obj, b, &got, name) < 0)
        return -1;
    if (got != want || b->ndim != 3) {
        PyErr_Format(PyExc_ValueError,
                     "kvpager: paged_attention: %s must be [batch, heads, head_width] of the "
                     "queries' dtype (float64 or float32)",
                     name);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* A zeroed [B, H, d_h] array of the io dtype (float64 or float32). */
static PyObject *attention_output(const size_t dims[3], kvp_dtype io, void **data)
{
    double *d64;
    PyObject *out = kvp_py_new_f64(3, dims, &d64);
    *data = d64;
    if (!out || io != KVP_F32)
        return out;
    Py_SETREF(out, PyObject_CallMethod(out, "astype", "s", "float32"));
    Py_buffer ob;
    if (out && PyObject_GetBuffer(out, &ob, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) == 0) {
        *data = ob.buf; /* the array owns it; it outlives the release */
        PyBuffer_Release(&ob);
        return out;
    }
    Py_XDECREF(out);
    return NULL;
}

PyObject *kvp_py_paged_attention(KvpPyCache *self, PyObject *args, PyObject *kwds,
                                 KvpPyDecoder *dec)
{
    static char *kwlist[] = {"queries", "keys", "values", "scale", "accum", NULL};
    PyObject *q_obj, *k_obj = Py_None, *v_obj = Py_None;
    double scale = 0.0;
    const char *accum = "exact";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OOds:paged_attention", kwlist, &q_obj,
                                     &k_obj, &v_obj, &scale, &accum))
        return NULL;
    CACHE_OPEN(self);
    kvp_paged_attention_args a;
    kvp_paged_attention_args_init(&a);
    if (strcmp(accum, "exact") != 0 && strcmp(accum, "fast") != 0) {
        PyErr_Format(PyExc_ValueError, "kvpager: accum '%s': not 'exact' or 'fast'", accum);
        return NULL;
    }
    a.accum = accum[0] == 'f' ? KVP_ACCUM_FAST : KVP_ACCUM_EXACT;
    Py_buffer qb, kb = {0}, vb = {0};
    kvp_dtype qd;
    if (kvp_py_rows_buffer(q_obj, &qb, &qd, "queries") < 0)
        return NULL;
    if (qd == KVP_F16 || qb.ndim != 3) {
        PyBuffer_Release(&qb);
        PyErr_SetString(PyExc_ValueError, "kvpager: paged_attention: queries must be "
                                          "[batch, heads, head_width] float64 or float32");
        return NULL;
    }
    PyObject *out = NULL;
    if (attention_input(k_obj, &kb, qd, "keys") < 0 ||
        attention_input(v_obj, &vb, qd, "values") < 0)
        goto done;
    size_t dims[3] = {(size_t)qb.shape[0], (size_t)qb.shape[1], (size_t)qb.shape[2]};
    void *data;
    out = attention_output(dims, qd, &data);
    if (!out)
        goto done;
    a.cache = self->cache;
    a.heads = dims[1];
    a.io_dtype = qd;
    a.queries = qb.buf;
    a.keys = kb.obj ? kb.buf : NULL;
    a.values = vb.obj ? vb.buf : NULL;
    a.scale = scale;
    a.outputs = data;
    kvp_error err;
    kvp_status st;
    /* the cache (and the sequence owning it) must not change meanwhile */
    int *owner_busy = self->owner ? &((KvpPySequence *)self->owner)->busy : &self->busy;
    *owner_busy = 1;
    if (dec)
        dec->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = kvp_paged_attention(&a, dec ? dec->decoder : NULL, &err);
    Py_END_ALLOW_THREADS
    if (dec)
        dec->busy = 0;
    *owner_busy = 0;
    if (st != KVP_OK) {
        Py_CLEAR(out);
        kvp_py_raise(&err);
    }
done:
    PyBuffer_Release(&qb);
    PyBuffer_Release(&kb);
    PyBuffer_Release(&vb);
    return out;
}

static PyObject *cache_paged_attention(KvpPyCache *self, PyObject *args, PyObject *kwds)
{
    return kvp_py_paged_attention(self, args, kwds, NULL);
}

static PyObject *cache_digest(KvpPyCache *self, PyObject *unused)
{
    (void)unused;
    CACHE_OPEN(self);
    uint64_t d;
    kvp_error err;
    if (kvp_cache_digest(self->cache, &d, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return PyLong_FromUnsignedLongLong(d);
}

static int key_from(PyObject *obj, kvp_block_key *key)
{
    unsigned long long lo, hi;
    if (!PyArg_ParseTuple(obj, "KK", &lo, &hi))
        return -1;
    key->lo = lo;
    key->hi = hi;
    return 0;
}

static PyObject *cache_block_key(KvpPyCache *self, PyObject *args)
{
    PyObject *parent = Py_None;
    Py_buffer input;
    if (!PyArg_ParseTuple(args, "y*|O:block_key", &input, &parent))
        return NULL;
    kvp_block_key p, out;
    kvp_error err;
    PyObject *r = NULL;
    if (cache_closed(self))
        kvp_py_closed("cache");
    else if (parent != Py_None && (!PyTuple_Check(parent) || key_from(parent, &p) < 0))
        PyErr_SetString(PyExc_TypeError, "kvpager: block_key: parent is a (lo, hi) tuple");
    else if (kvp_block_key_chain(parent == Py_None ? NULL : &p, self->cache, input.buf,
                                 (size_t)input.len, NULL, &out, &err) != KVP_OK)
        kvp_py_raise(&err);
    else
        r = Py_BuildValue("(KK)", (unsigned long long)out.lo, (unsigned long long)out.hi);
    PyBuffer_Release(&input);
    return r;
}

static PyObject *cache_publish_block(KvpPyCache *self, PyObject *args)
{
    Py_ssize_t lane, block;
    PyObject *key_obj;
    if (!PyArg_ParseTuple(args, "nnO!:publish_block", &lane, &block, &PyTuple_Type, &key_obj))
        return NULL;
    kvp_block_key key;
    if (may_change(self) < 0 || key_from(key_obj, &key) < 0)
        return NULL;
    if (lane < 0 || block < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: publish_block: negative lane or block");
        return NULL;
    }
    kvp_error err;
    if (kvp_cache_publish_block(self->cache, (size_t)lane, (size_t)block, &key, &err) != KVP_OK)
        return kvp_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *cache_adopt_prefix(KvpPyCache *self, PyObject *args)
{
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "O:adopt_prefix", &seq))
        return NULL;
    if (may_change(self) < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "kvpager: adopt_prefix takes a list of (lo, hi) keys");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    size_t batch = 0;
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    kvp_error err;
    if (kvp_cache_info_get(self->cache, &info, &err) != KVP_OK) {
        Py_DECREF(fast);
        return kvp_py_raise(&err);
    }
    batch = info.batch_size;
    if (n % (Py_ssize_t)batch != 0) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError,
                        "kvpager: adopt_prefix: keys[b * batch + lane], a multiple of batch");
        return NULL;
    }
    kvp_block_key *keys = PyMem_Calloc((size_t)n + 1, sizeof *keys);
    PyObject *r = NULL;
    if (!keys) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (key_from(PySequence_Fast_GET_ITEM(fast, i), &keys[i]) < 0)
            goto done;
    size_t adopted = 0;
    if (kvp_cache_adopt_prefix(self->cache, keys, (size_t)n / batch, &adopted, &err) != KVP_OK) {
        kvp_py_raise(&err);
        goto done;
    }
    if (adopted)
        self->generation++;
    r = PyLong_FromSize_t(adopted);
done:
    PyMem_Free(keys);
    Py_DECREF(fast);
    return r;
}

static PyObject *cache_pages_for(KvpPyCache *self, PyObject *args)
{
    Py_ssize_t tokens;
    if (!PyArg_ParseTuple(args, "n:pages_for", &tokens))
        return NULL;
    CACHE_OPEN(self);
    return PyLong_FromSize_t(kvp_cache_pages_for(self->cache, tokens < 0 ? 0 : (size_t)tokens));
}

static PyObject *cache_info(KvpPyCache *self, PyObject *unused)
{
    (void)unused;
    CACHE_OPEN(self);
    kvp_cache_info i;
    kvp_cache_info_init(&i);
    kvp_error err;
    if (kvp_cache_info_get(self->cache, &i, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:s,s:n,s:n}",
                         "batch_size", (Py_ssize_t)i.batch_size, "capacity",
                         (Py_ssize_t)i.capacity, "len", (Py_ssize_t)i.len, "block_tokens",
                         (Py_ssize_t)i.block_tokens, "blocks_per_lane",
                         (Py_ssize_t)i.blocks_per_lane, "mapped_pages",
                         (Py_ssize_t)i.mapped_pages, "kv_heads", (Py_ssize_t)i.binding.kv_heads,
                         "head_width", (Py_ssize_t)i.binding.head_width, "max_positions",
                         (Py_ssize_t)i.binding.max_positions, "identity",
                         (unsigned long long)i.binding.owner_digest[0], "revision",
                         (unsigned long long)i.binding.owner_revision, "kind",
                         i.binding.kind == KVP_BINDING_EXTERNAL ? "external" : "layer",
                         "reserved_rows", (Py_ssize_t)kvp_cache_reserved_rows(self->cache),
                         "promised_pages", (Py_ssize_t)kvp_cache_promised_pages(self->cache));
}

static PyObject *cache_get_len(KvpPyCache *self, void *closure)
{
    (void)closure;
    CACHE_OPEN(self);
    return PyLong_FromSize_t(kvp_cache_len(self->cache));
}

static PyObject *cache_get_capacity(KvpPyCache *self, void *closure)
{
    (void)closure;
    CACHE_OPEN(self);
    return PyLong_FromSize_t(kvp_cache_capacity(self->cache));
}

static PyObject *cache_get_reserved(KvpPyCache *self, void *closure)
{
    (void)closure;
    CACHE_OPEN(self);
    return PyLong_FromSize_t(kvp_cache_reserved_rows(self->cache));
}

static PyObject *cache_get_closed(KvpPyCache *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(cache_closed(self));
}

static PyObject *cache_get_pool(KvpPyCache *self, void *closure)
{
    (void)closure;
    return Py_NewRef((PyObject *)self->pool);
}

static PyObject *cache_get_layer(KvpPyCache *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->layer ? self->layer : Py_None);
}

static PyMethodDef cache_methods[] = {
    {"append_rows", (PyCFunction)cache_append_rows, METH_VARARGS,
     "append_rows(keys, values): kvp_cache_append_rows(_typed). keys and values are "
     "[batch, kv_heads, rows, head_width] C-contiguous buffers of float64, float32 or float16 "
     "(used in place); anything else is converted once to float64. All or nothing; the GIL "
     "is released while rows are stored. Errors: CacheLayerBound, RowsReserved, Full, "
     "NonFiniteKey, NonFiniteValue, PoolExhausted, KeyShapeMismatch/ValueShapeMismatch."},
    {"reserve_rows", (PyCFunction)cache_reserve_rows, METH_VARARGS,
     "reserve_rows(rows): take now every page `rows` more rows need (all or none)."},
    {"commit_rows", (PyCFunction)cache_commit_rows, METH_VARARGS,
     "commit_rows(keys, values): commit the first rows of the reservation (as append_rows)."},
    {"discard_rows", (PyCFunction)cache_discard_rows, METH_NOARGS,
     "discard_rows(): end the reservation, its unused pages back to the pool."},
    {"reserved_slots", (PyCFunction)kvp_py_cache_reserved_slots, METH_VARARGS,
     "reserved_slots(lane) -> [dict(row, rows, page, view)]: kvp_cache_reserved_slots: where "
     "the pending reservation's rows of `lane` live, one span per page; each view is a "
     "writable zero-copy (2, kv_heads, rows, head_width) buffer of that page in its dtype "
     "(keys then values, as page_view). Write every element, release the arrays, then "
     "commit_written(rows). The views die with any change of the cache."},
    {"commit_written", (PyCFunction)kvp_py_cache_commit_written, METH_VARARGS,
     "commit_written(rows): kvp_cache_commit_written: the first `rows` reserved rows, written "
     "in place, become visible (checked finite first: NonFiniteKey, NonFiniteValue; "
     "RowsNotReserved; nothing changes on failure, the reservation stays). BufferError while "
     "arrays over the slot views are alive."},
    {"truncate", (PyCFunction)cache_truncate, METH_VARARGS,
     "truncate(new_len): shorten the cache (OutOfRange past len; RowsReserved)."},
    {"promise", (PyCFunction)cache_promise, METH_VARARGS,
     "promise(pages): set the cache's promise (kvp_cache_promise)."},
    {"reset", (PyCFunction)cache_reset, METH_NOARGS, "reset(): len 0, every page back."},
    {"fork", (PyCFunction)cache_fork, METH_NOARGS,
     "fork() -> Cache: a child sharing every page (copy-on-write for a partial last page)."},
    {"keys", (PyCFunction)cache_keys, METH_NOARGS,
     "keys() -> numpy.ndarray [batch, kv_heads, len, head_width] float64: a copy (widened)."},
    {"values", (PyCFunction)cache_values, METH_NOARGS, "values() -> a copy, as keys()."},
    {"block_table", (PyCFunction)cache_block_table, METH_VARARGS,
     "block_table(lane) -> View: the lane's page ids (uint32), zero-copy, valid until the "
     "cache changes."},
    {"page_view", (PyCFunction)cache_page_view, METH_VARARGS,
     "page_view(lane, block) -> View (2, kv_heads, rows, head_width) of the block's page in "
     "the pool's dtype (bf16 as uint16, fp8 as uint8): keys then values, only the rows the "
     "lane holds; zero-copy, valid until the cache changes."},
    {"paged_attention", (PyCFunction)(void (*)(void))cache_paged_attention,
     METH_VARARGS | METH_KEYWORDS,
     "paged_attention(queries, keys=None, values=None, scale=0.0, accum='exact')"
     " -> [batch, heads, head_width]: kvp_paged_attention over every lane's retained rows, read "
     "through the pages (vLLM's paged_attention), plus one candidate row per lane when keys "
     "and values ([batch, kv_heads, head_width]) are given. queries [batch, heads, head_width] "
     "(already rotated), float64 or float32 (the outputs' dtype); scale 0: 1/sqrt(head_width). "
     "The GIL is released. Decoder.paged_attention(cache, ...) spreads it over the decoder's "
     "threads (same bits)."},
    {"digest", (PyCFunction)cache_digest, METH_NOARGS, "digest() -> int: kvp_cache_digest."},
    {"block_key", (PyCFunction)cache_block_key, METH_VARARGS,
     "block_key(input: bytes, parent=None) -> (lo, hi): kvp_block_key_chain."},
    {"publish_block", (PyCFunction)cache_publish_block, METH_VARARGS,
     "publish_block(lane, block, key): register a full block in the pool's prefix index."},
    {"adopt_prefix", (PyCFunction)cache_adopt_prefix, METH_VARARGS,
     "adopt_prefix(keys) -> blocks adopted: keys[b * batch + lane], (lo, hi) each."},
    {"pages_for", (PyCFunction)cache_pages_for, METH_VARARGS,
     "pages_for(tokens) -> pages needed to grow to `tokens`."},
    {"info", (PyCFunction)cache_info, METH_NOARGS, "info() -> dict: kvp_cache_info."},
    {"close", (PyCFunction)cache_close, METH_NOARGS,
     "close(): kvp_cache_destroy, every page back (BufferError while views are exported)."},
    {"__enter__", cache_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)cache_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef cache_getset[] = {
    {"len", (getter)cache_get_len, NULL, "Positions held per lane.", NULL},
    {"capacity", (getter)cache_get_capacity, NULL, "Positions per lane at most.", NULL},
    {"reserved_rows", (getter)cache_get_reserved, NULL, "Rows reserved, not committed.", NULL},
    {"closed", (getter)cache_get_closed, NULL, "True after close().", NULL},
    {"pool", (getter)cache_get_pool, NULL, "The Pool the cache draws pages from.", NULL},
    {"layer", (getter)cache_get_layer, NULL,
     "The Layer of a Layer.cache() cache (and its forks), else None.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject KvpPyCache_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.Cache",
    .tp_basicsize = sizeof(KvpPyCache),
    .tp_dealloc = (destructor)cache_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Cache(pool, batch_size=1, capacity, identity=0, revision=0, max_positions=capacity)"
              "\n\nAn external paged KV cache (kvp_binding_init_external + kvp_cache_create) of "
              "batch_size lanes and capacity positions, with the pool's heads and head width. "
              "Threads: one owner at a time (a second thread's call while one runs raises "
              "RuntimeError); caches of one pool may be used on different threads at once. "
              "Holds its pool alive. Every error raises a kvpager.Error subclass and changes "
              "nothing.",
    .tp_methods = cache_methods,
    .tp_getset = cache_getset,
    .tp_new = cache_new,
};
