/*
 * src/python/pool.c: kvpager.Pool, the shared page pool (kvpager/pool.h).
 *
 * Owns: the Pool type: creation from keyword arguments (kvp_pool_config),
 * stats, the audit (kvp_pool_check, the GIL released), the digest, the page
 * layout, admission, and closing (kvp_pool_destroy: PoolBusy while caches
 * are attached, and nothing changes). Every cache keeps its Pool object
 * alive, so a Pool is destroyed only after its caches, whatever order
 * Python frees them in.
 * Invariant: busy > 0 while a call runs with the GIL released; close waits
 * for none and refuses (RuntimeError) instead.
 * Callers: the module (module.c) and cache.c.
 */
#include "py_internal.h"

static int dtype_from_name(const char *name, kvp_dtype *out)
{
    static const kvp_dtype all[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        if (strcmp(name, kvp_dtype_name(all[i])) == 0) {
            *out = all[i];
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "kvpager: dtype '%s': not one of 'f64', 'f32', 'bf16', 'f16', 'fp8_e4m3'",
                 name);
    return -1;
}

static int pool_init(KvpPyPool *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"block_tokens", "heads", "head_width", "budget_bytes", "dtype",
                             "slab_source", "key_secret", NULL};
    kvp_pool_config c;
    kvp_pool_config_init(&c);
    const char *dtype = "f64";
    const char *source = "default";
    Py_ssize_t bt = (Py_ssize_t)c.block_tokens, heads = (Py_ssize_t)c.heads;
    Py_ssize_t hw = (Py_ssize_t)c.head_width, budget = (Py_ssize_t)c.budget_bytes;
    PyObject *ks_obj = Py_None;
    Py_buffer ks = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|nnnnssO:Pool", kwlist, &bt, &heads, &hw,
                                     &budget, &dtype, &source, &ks_obj))
        return -1;
    if (ks_obj != Py_None && PyObject_GetBuffer(ks_obj, &ks, PyBUF_SIMPLE) < 0)
        return -1;
    int ks_ok = !ks.obj || ks.len == KVP_KEY_SECRET_BYTES;
    if (ks_ok && ks.obj)
        memcpy(c.key_secret, ks.buf, KVP_KEY_SECRET_BYTES);
    if (ks.obj)
        PyBuffer_Release(&ks);
    if (!ks_ok) {
        PyErr_Format(PyExc_ValueError, "kvpager: key_secret: not %d bytes",
                     KVP_KEY_SECRET_BYTES);
        return -1;
    }
    if (bt < 0 || heads < 0 || hw < 0 || budget < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: Pool sizes must not be negative");
        return -1;
    }
    if (self->pool) {
        PyErr_SetString(PyExc_RuntimeError, "kvpager: Pool.__init__ called twice");
        return -1;
    }
    if (dtype_from_name(dtype, &c.dtype) < 0)
        return -1;
    if (strcmp(source, "default") == 0)
        c.slab_source = KVP_SLAB_DEFAULT;
    else if (strcmp(source, "mmap") == 0)
        c.slab_source = KVP_SLAB_MMAP;
    else if (strcmp(source, "reserved") == 0)
        c.slab_source = KVP_SLAB_RESERVED;
    else {
        PyErr_Format(PyExc_ValueError, "kvpager: slab_source '%s': not default, mmap or reserved",
                     source);
        return -1;
    }
    c.block_tokens = (size_t)bt;
    c.heads = (size_t)heads;
    c.head_width = (size_t)hw;
    c.budget_bytes = (size_t)budget;
    kvp_error err;
    if (kvp_pool_create(&c, &self->pool, &err) != KVP_OK) {
        kvp_py_raise(&err);
        return -1;
    }
    return 0;
}

static void pool_dealloc(KvpPyPool *self)
{
    /* No cache can be attached: each holds a reference to this object. */
    if (self->pool) {
        kvp_status ignored = kvp_pool_destroy(self->pool, NULL);
        (void)ignored;
    }
    kvp_py_pool_tier_release(self); /* destroyed: detached */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define POOL_OPEN(self)                                                                            \
    do {                                                                                           \
        if (!(self)->pool)                                                                         \
            return kvp_py_closed("pool");                                                          \
    } while (0)

PyObject *kvp_py_pool_stats(kvp_pool *pool)
{
    kvp_pool_stats s;
    kvp_pool_stats_init(&s);
    kvp_error err;
    if (kvp_pool_stats_get(pool, &s, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:K,s:K,s:K,s:n,s:n,s:n,s:n,s:n,s:n,s:s,s:n,s:s,s:n,s:n,s:K,s:K,s:K,"
        "s:K,s:K}",
        "total_pages", (Py_ssize_t)s.total_pages, "free_pages", (Py_ssize_t)s.free_pages,
        "held_pages", (Py_ssize_t)s.held_pages, "high_water_pages",
        (Py_ssize_t)s.high_water_pages, "acquires", (unsigned long long)s.acquires, "releases",
        (unsigned long long)s.releases, "exhaustions", (unsigned long long)s.exhaustions,
        "page_bytes", (Py_ssize_t)s.page_bytes, "slab_bytes", (Py_ssize_t)s.slab_bytes,
        "attached_caches", (Py_ssize_t)s.attached_caches, "attached_reservations",
        (Py_ssize_t)s.attached_reservations, "promised_pages", (Py_ssize_t)s.promised_pages,
        "tentative_pages", (Py_ssize_t)s.tentative_pages, "dtype", kvp_dtype_name(s.dtype),
        "element_bytes", (Py_ssize_t)s.element_bytes, "slab_source",
        kvp_slab_source_name(s.slab_source), "cached_pages", (Py_ssize_t)s.cached_pages,
        "evictable_pages", (Py_ssize_t)s.evictable_pages, "prefix_hits",
        (unsigned long long)s.prefix_hits, "prefix_misses", (unsigned long long)s.prefix_misses,
        "evictions", (unsigned long long)s.evictions, "cow_copies",
        (unsigned long long)s.cow_copies, "window_releases",
        (unsigned long long)s.window_releases);
}

static PyObject *pool_stats(KvpPyPool *self, PyObject *unused)
{
    (void)unused;
    POOL_OPEN(self);
    return kvp_py_pool_stats(self->pool);
}

typedef struct {
    kvp_mismatch found[KVP_POOL_CHECK_REPORTS];
    size_t count;
} audit_findings;

static void collect_finding(void *ctx, const kvp_mismatch *m)
{
    audit_findings *f = ctx;
    if (f->count < KVP_POOL_CHECK_REPORTS)
        f->found[f->count++] = *m;
}

static PyObject *pool_audit(KvpPyPool *self, PyObject *unused)
{
    (void)unused;
    POOL_OPEN(self);
    audit_findings f = {.count = 0};
    kvp_error err;
    kvp_status s;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    s = kvp_pool_check(self->pool, collect_finding, &f, &err);
    Py_END_ALLOW_THREADS
    self->busy--;
    if (s == KVP_OK)
        Py_RETURN_NONE;
    if (s != KVP_AUDIT_FAILED)
        return kvp_py_raise(&err);
    /* AuditFailed also carries `findings`: the first KVP_POOL_CHECK_REPORTS, as dicts. */
    PyObject *exc = kvp_py_error_new(&err);
    PyObject *list = exc ? PyList_New(0) : NULL;
    for (size_t i = 0; list && i < f.count; i++) {
        PyObject *d = kvp_py_mismatch_dict(&f.found[i]);
        if (!d || PyList_Append(list, d) < 0)
            Py_CLEAR(list);
        Py_XDECREF(d);
    }
    if (list && PyObject_SetAttrString(exc, "findings", list) == 0)
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_XDECREF(list);
    Py_XDECREF(exc);
    return NULL;
}

static PyObject *pool_digest(KvpPyPool *self, PyObject *unused)
{
    (void)unused;
    POOL_OPEN(self);
    uint64_t d = 0;
    kvp_error err;
    kvp_status s;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    s = kvp_pool_digest(self->pool, &d, &err);
    Py_END_ALLOW_THREADS
    self->busy--;
    if (s != KVP_OK)
        return kvp_py_raise(&err);
    return PyLong_FromUnsignedLongLong(d);
}

static PyObject *pool_page_layout(KvpPyPool *self, PyObject *unused)
{
    (void)unused;
    POOL_OPEN(self);
    kvp_page_layout l;
    kvp_page_layout_init(&l);
    kvp_error err;
    if (kvp_pool_page_layout_get(self->pool, &l, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return Py_BuildValue("{s:s,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n}", "dtype",
                         kvp_dtype_name(l.dtype), "element_bytes", (Py_ssize_t)l.element_bytes,
                         "heads", (Py_ssize_t)l.heads, "block_tokens",
                         (Py_ssize_t)l.block_tokens, "head_width", (Py_ssize_t)l.head_width,
                         "head_stride", (Py_ssize_t)l.head_stride, "row_stride",
                         (Py_ssize_t)l.row_stride, "head_stride_bytes",
                         (Py_ssize_t)l.head_stride_bytes, "row_stride_bytes",
                         (Py_ssize_t)l.row_stride_bytes, "values_offset_bytes",
                         (Py_ssize_t)l.values_offset_bytes, "page_bytes",
                         (Py_ssize_t)l.page_bytes);
}

static PyObject *pool_admit(KvpPyPool *self, PyObject *args)
{
    Py_ssize_t pages, watermark = 0;
    if (!PyArg_ParseTuple(args, "n|n:admit", &pages, &watermark))
        return NULL;
    POOL_OPEN(self);
    if (pages < 0 || watermark < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: admit: negative page count");
        return NULL;
    }
    kvp_admission a;
    kvp_error err;
    if (kvp_pool_admit(self->pool, (size_t)pages, (size_t)watermark, &a, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return PyUnicode_FromString(a == KVP_ADMIT_NOW ? "now" : a == KVP_ADMIT_LATER ? "later"
                                                                                : "never");
}

static PyObject *pool_close(KvpPyPool *self, PyObject *unused)
{
    (void)unused;
    if (!self->pool)
        Py_RETURN_NONE;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "kvpager: the pool is in use by another thread");
        return NULL;
    }
    if (self->users) {
        PyErr_SetString(PyExc_RuntimeError,
                        "kvpager: a Scheduler uses the pool: close the scheduler first");
        return NULL;
    }
    kvp_error err;
    if (kvp_pool_destroy(self->pool, &err) != KVP_OK)
        return kvp_py_raise(&err);
    self->pool = NULL;
    kvp_py_pool_tier_release(self); /* kvp_pool_destroy detached it */
    Py_RETURN_NONE;
}

static PyObject *pool_enter(PyObject *self, PyObject *unused)
{
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *pool_exit(KvpPyPool *self, PyObject *args)
{
    (void)args;
    PyObject *r = pool_close(self, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyObject *pool_get_closed(KvpPyPool *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->pool == NULL);
}

static PyMethodDef pool_methods[] = {
    {"stats", (PyCFunction)pool_stats, METH_NOARGS,
     "stats() -> dict: a consistent snapshot of kvp_pool_stats (thread-safe)."},
    {"audit", (PyCFunction)pool_audit, METH_NOARGS,
     "audit() -> None: kvp_pool_check, the full audit of invariants I1-I5, with the GIL "
     "released. Raises kvpager.AuditFailed (mismatches, first_mismatch, findings: the "
     "first 64 as dicts) on a finding. "
     "Changes nothing."},
    {"digest", (PyCFunction)pool_digest, METH_NOARGS,
     "digest() -> int: kvp_pool_digest, FNV-1a of every slab byte (not while rows are "
     "written into the pool's pages)."},
    {"page_layout", (PyCFunction)pool_page_layout, METH_NOARGS,
     "page_layout() -> dict: kvp_page_layout, the format of every page."},
    {"admit", (PyCFunction)pool_admit, METH_VARARGS,
     "admit(pages, watermark_pages=0) -> 'now' | 'later' | 'never' (kvp_pool_admit)."},
    {"attach_tier", (PyCFunction)(void (*)(void))kvp_py_pool_attach_tier,
     METH_VARARGS | METH_KEYWORDS,
     "attach_tier(tier, secret, write_through=False): kvp_pool_tier_attach: the pool writes "
     "each published page it evicts (write_through: each page it publishes) to `tier` (a "
     "HostTier or RedisTier, held alive while attached) as a block MACed under `secret` (32 "
     "bytes, not all zero; every pool sharing the tier must agree on it). Errors: "
     "InvalidArgument ('secret'; 'pool': a tier attached already, or a reserved slab and a "
     "tier not keys-only; 'tier': a keys-only tier given to a pool with data)."},
    {"detach_tier", (PyCFunction)kvp_py_pool_detach_tier, METH_NOARGS,
     "detach_tier(): kvp_pool_tier_detach (waits for writes in flight; without a tier does "
     "nothing). close() detaches too."},
    {"tier_stats", (PyCFunction)kvp_py_pool_tier_stats, METH_NOARGS,
     "tier_stats() -> dict: kvp_pool_tier_stats (writes, loads, misses, rejected, ...). "
     "InvalidArgument ('pool') without a tier."},
    {"close", (PyCFunction)pool_close, METH_NOARGS,
     "close(): kvp_pool_destroy. Raises kvpager.PoolBusy (nothing changes) while caches "
     "are attached or pages held. Closing twice does nothing."},
    {"__enter__", pool_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)pool_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"closed", (getter)pool_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject KvpPyPool_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.Pool",
    .tp_basicsize = sizeof(KvpPyPool),
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(block_tokens=16, heads=8, head_width=64, budget_bytes=64 MiB, dtype='f64', "
              "slab_source='default', key_secret=None)\n\n"
              "The shared page pool (kvp_pool_create): a fixed budget of equal pages, each "
              "holding K and V of block_tokens positions of `heads` KV heads of one cache lane, "
              "in dtype 'f64', 'f32', 'bf16', 'f16' or 'fp8_e4m3'. Every call is thread-safe. "
              "key_secret (32 bytes) keys the prefix index's block keys (kvp_block_key_chain); "
              "None draws a random one: give pools that must agree on keys (a shared tier) the "
              "same. A pool outlives its caches: each Cache holds a reference to it. Errors raise "
              "kvpager.Error subclasses (ZeroSize, BudgetTooSmall, ...); nothing changes.",
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
    .tp_init = (initproc)pool_init,
    .tp_new = PyType_GenericNew,
};
