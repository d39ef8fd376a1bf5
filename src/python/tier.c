/*
 * src/python/tier.c: the second tier from Python (kvpager/tier.h):
 * kvpager.HostTier (kvp_tier_host_create, its stats, kvp_tier_destroy), the
 * Pool methods attach_tier / detach_tier / tier_stats (kvp_pool_tier_attach,
 * _detach, _stats_get; pool.c lists them). The loads from a pool's tier
 * (group_tier_load) are group.c's.
 *
 * Owns: the HostTier type and those calls.
 * Invariants: a Pool with a tier attached holds a strong reference to its
 * HostTier (KvpPyPool.tier) and counts in its `pools`, so the tier outlives
 * the attachment whatever order Python frees them in (tier.h: "the tier
 * outlives the attachment"; kvp_pool_destroy detaches), and HostTier.close
 * refuses while a pool has it attached. Failed calls change nothing, as in C.
 * Callers: pool.c (the Pool methods, the release on close), module.c (the
 * type).
 */
#include "py_internal.h"

#include <string.h>

#include "kvpager/tier.h"

typedef struct {
    PyObject_HEAD
    kvp_tier *tier;  /* owned; NULL once closed */
    Py_ssize_t pools; /* pools it is attached to */
} KvpPyHostTier;

static PyObject *tier_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"budget_bytes", NULL};
    Py_ssize_t budget;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n:HostTier", kwlist, &budget))
        return NULL;
    if (budget < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: budget_bytes must not be negative");
        return NULL;
    }
    kvp_tier *t = NULL;
    kvp_error err;
    if (kvp_tier_host_create((size_t)budget, &t, &err) != KVP_OK)
        return kvp_py_raise(&err);
    KvpPyHostTier *self = PyObject_New(KvpPyHostTier, type);
    if (!self) {
        (void)kvp_tier_destroy(t, NULL);
        return NULL;
    }
    self->tier = t;
    self->pools = 0;
    return (PyObject *)self;
}

static void tier_dealloc(KvpPyHostTier *self)
{
    if (self->tier) /* no pool holds it: each attached pool holds this object */
        (void)kvp_tier_destroy(self->tier, NULL);
    PyObject_Free(self);
}

static PyObject *tier_close(KvpPyHostTier *self, PyObject *unused)
{
    (void)unused;
    if (!self->tier)
        Py_RETURN_NONE;
    if (self->pools) {
        PyErr_SetString(PyExc_RuntimeError,
                        "kvpager: the tier is attached to a pool (Pool.detach_tier first)");
        return NULL;
    }
    (void)kvp_tier_destroy(self->tier, NULL);
    self->tier = NULL;
    Py_RETURN_NONE;
}

static PyObject *tier_stats(KvpPyHostTier *self, PyObject *unused)
{
    (void)unused;
    if (!self->tier)
        return kvp_py_closed("tier");
    kvp_tier_host_stats s;
    kvp_tier_host_stats_init(&s);
    kvp_error err;
    if (kvp_tier_host_stats_get(self->tier, &s, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return Py_BuildValue("{s:n,s:n,s:n,s:K,s:K,s:K,s:K,s:K}", "budget_bytes",
                         (Py_ssize_t)s.budget_bytes, "bytes", (Py_ssize_t)s.bytes, "blocks",
                         (Py_ssize_t)s.blocks, "hits", (unsigned long long)s.hits, "misses",
                         (unsigned long long)s.misses, "puts", (unsigned long long)s.puts,
                         "evictions", (unsigned long long)s.evictions, "rejected_puts",
                         (unsigned long long)s.rejected_puts);
}

static PyObject *tier_get_closed(KvpPyHostTier *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(!self->tier);
}

static PyObject *tier_enter(PyObject *self, PyObject *unused)
{
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *tier_exit(KvpPyHostTier *self, PyObject *args)
{
    (void)args;
    PyObject *r = tier_close(self, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

/* ---- the Pool's methods ---------------------------------------------------- */

PyObject *kvp_py_pool_attach_tier(KvpPyPool *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tier", "secret", "write_through", NULL};
    PyObject *tier_obj;
    Py_buffer secret;
    int write_through = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!y*|p:attach_tier", kwlist,
                                     &KvpPyHostTier_Type, &tier_obj, &secret, &write_through))
        return NULL;
    KvpPyHostTier *tier = (KvpPyHostTier *)tier_obj;
    PyObject *r = NULL;
    kvp_tier_policy policy;
    kvp_tier_policy_init(&policy);
    kvp_error err;
    if (!self->pool)
        kvp_py_closed("pool");
    else if (!tier->tier)
        kvp_py_closed("tier");
    else if (secret.len != KVP_TIER_SECRET_BYTES)
        PyErr_Format(PyExc_ValueError, "kvpager: secret: %zd bytes, not %d", secret.len,
                     KVP_TIER_SECRET_BYTES);
    else {
        memcpy(policy.secret, secret.buf, KVP_TIER_SECRET_BYTES);
        policy.write_through = write_through;
        if (kvp_pool_tier_attach(self->pool, tier->tier, &policy, &err) != KVP_OK) {
            kvp_py_raise(&err);
        } else {
            self->tier = Py_NewRef(tier_obj);
            tier->pools++;
            r = Py_NewRef(Py_None);
        }
        memset(policy.secret, 0, sizeof policy.secret);
    }
    PyBuffer_Release(&secret);
    return r;
}

void kvp_py_pool_tier_release(KvpPyPool *self)
{
    if (self->tier) {
        ((KvpPyHostTier *)self->tier)->pools--;
        Py_CLEAR(self->tier);
    }
}

PyObject *kvp_py_pool_detach_tier(KvpPyPool *self, PyObject *unused)
{
    (void)unused;
    if (!self->pool)
        return kvp_py_closed("pool");
    if (self->busy)
        return kvp_py_busy("pool");
    kvp_error err;
    if (kvp_pool_tier_detach(self->pool, &err) != KVP_OK)
        return kvp_py_raise(&err);
    kvp_py_pool_tier_release(self);
    Py_RETURN_NONE;
}

PyObject *kvp_py_pool_tier_stats(KvpPyPool *self, PyObject *unused)
{
    (void)unused;
    if (!self->pool)
        return kvp_py_closed("pool");
    kvp_pool_tier_stats s;
    kvp_pool_tier_stats_init(&s);
    kvp_error err;
    if (kvp_pool_tier_stats_get(self->pool, &s, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return Py_BuildValue("{s:n,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "block_bytes",
                         (Py_ssize_t)s.block_bytes, "writes", (unsigned long long)s.writes,
                         "write_failures", (unsigned long long)s.write_failures, "loads",
                         (unsigned long long)s.loads, "load_bytes",
                         (unsigned long long)s.load_bytes, "misses",
                         (unsigned long long)s.misses, "load_failures",
                         (unsigned long long)s.load_failures, "rejected",
                         (unsigned long long)s.rejected, "rejected_header",
                         (unsigned long long)s.rejected_header, "rejected_mac",
                         (unsigned long long)s.rejected_mac, "rejected_geometry",
                         (unsigned long long)s.rejected_geometry, "rejected_key",
                         (unsigned long long)s.rejected_key, "rejected_binding",
                         (unsigned long long)s.rejected_binding);
}

static PyMethodDef tier_methods[] = {
    {"stats", (PyCFunction)tier_stats, METH_NOARGS,
     "stats() -> dict: kvp_tier_host_stats (budget_bytes, bytes, blocks, hits, misses, puts, "
     "evictions, rejected_puts)."},
    {"close", (PyCFunction)tier_close, METH_NOARGS,
     "close(): kvp_tier_destroy (RuntimeError while a pool has it attached)."},
    {"__enter__", tier_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)tier_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef tier_getset[] = {
    {"closed", (getter)tier_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject KvpPyHostTier_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.HostTier",
    .tp_basicsize = sizeof(KvpPyHostTier),
    .tp_dealloc = (destructor)tier_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "HostTier(budget_bytes)\n\nA second tier in this process's memory "
              "(kvp_tier_host_create): at most budget_bytes of blocks, least recently used "
              "dropped first. Pool.attach_tier(tier, secret) makes a pool write the published "
              "pages it evicts (or, write_through, every page it publishes) to it as verified "
              "blocks; group_tier_load(caches, keys) maps them back. Thread-safe. A pool it is "
              "attached to holds it alive.",
    .tp_methods = tier_methods,
    .tp_getset = tier_getset,
    .tp_new = tier_new,
};
