/*
 * src/python/tier.c: the second tier from Python (kvpager/tier.h,
 * kvpager/tier_redis.h): the base type kvpager.Tier (close, closed, name,
 * keys_only, the context manager: kvp_tier_destroy, kvp_tier_name,
 * kvp_tier_keys_only) and its two kinds, kvpager.HostTier
 * (kvp_tier_host_create / kvp_tier_host_keys_create, kvp_tier_host_stats)
 * and kvpager.RedisTier (kvp_tier_redis_create, kvp_tier_redis_stats,
 * kvp_tier_redis_flush); the Pool methods attach_tier / detach_tier /
 * tier_stats (kvp_pool_tier_attach, _detach, _stats_get; pool.c lists them).
 * The loads from a pool's tier (group_tier_load) are group.c's.
 *
 * Owns: the Tier, HostTier and RedisTier types and those calls.
 * Invariants: a Pool with a tier attached holds a strong reference to its
 * Tier (KvpPyPool.tier) and counts in its `pools`, so the tier outlives
 * the attachment whatever order Python frees them in (tier.h: "the tier
 * outlives the attachment"; kvp_pool_destroy detaches), and Tier.close
 * refuses while a pool has it attached, or while a flush waits with the
 * GIL released (busy: RuntimeError). Both kinds share that code (the
 * base type's). Failed calls change nothing, as in C.
 * Callers: pool.c (the Pool methods, the release on close), module.c (the
 * types).
 */
#include "py_internal.h"

#include <string.h>

#include "kvpager/tier.h"
#include "kvpager/tier_redis.h"

typedef struct {
    PyObject_HEAD
    kvp_tier *tier;  /* owned; NULL once closed */
    Py_ssize_t pools; /* pools it is attached to */
    int busy;         /* flushes waiting with the GIL released: close refuses meanwhile */
} KvpPyTier;

/* A new Tier object of `type` owning `t` (destroyed when that fails). */
static PyObject *tier_wrap(PyTypeObject *type, kvp_tier *t)
{
    KvpPyTier *self = PyObject_New(KvpPyTier, type);
    if (!self) {
        (void)kvp_tier_destroy(t, NULL);
        return NULL;
    }
    self->tier = t;
    self->pools = 0;
    self->busy = 0;
    return (PyObject *)self;
}

static PyObject *host_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"budget_bytes", "keys_only", NULL};
    Py_ssize_t budget;
    int keys_only = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|p:HostTier", kwlist, &budget, &keys_only))
        return NULL;
    if (budget < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: budget_bytes must not be negative");
        return NULL;
    }
    kvp_tier *t = NULL;
    kvp_error err;
    kvp_status s = keys_only ? kvp_tier_host_keys_create((size_t)budget, &t, &err)
                             : kvp_tier_host_create((size_t)budget, &t, &err);
    if (s != KVP_OK)
        return kvp_py_raise(&err);
    return tier_wrap(type, t);
}

/* The unsigned (n) and size (z) fields of kvp_tier_redis_config a keyword sets. */
static const struct {
    const char *name;
    char kind; /* u: unsigned, z: size_t */
    size_t offset;
} redis_fields[] = {
    {"connect_timeout_ms", 'u', offsetof(kvp_tier_redis_config, connect_timeout_ms)},
    {"command_timeout_ms", 'u', offsetof(kvp_tier_redis_config, command_timeout_ms)},
    {"ttl_seconds", 'u', offsetof(kvp_tier_redis_config, ttl_seconds)},
    {"queue_entries", 'z', offsetof(kvp_tier_redis_config, queue_entries)},
    {"queue_bytes", 'z', offsetof(kvp_tier_redis_config, queue_bytes)},
    {"write_batch", 'z', offsetof(kvp_tier_redis_config, write_batch)},
    {"read_jobs", 'z', offsetof(kvp_tier_redis_config, read_jobs)},
    {"backoff_min_ms", 'u', offsetof(kvp_tier_redis_config, backoff_min_ms)},
    {"backoff_max_ms", 'u', offsetof(kvp_tier_redis_config, backoff_max_ms)},
};
#define REDIS_FIELDS (sizeof redis_fields / sizeof redis_fields[0])

/* Sets c's numeric field i from v (a non-negative int that fits); -1 with ValueError/TypeError. */
static int redis_field_set(kvp_tier_redis_config *c, size_t i, PyObject *v)
{
    size_t x = PyLong_AsSize_t(v);
    if (x == (size_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "kvpager: RedisTier: %s must be a non-negative int",
                     redis_fields[i].name);
        return -1;
    }
    char *at = (char *)c + redis_fields[i].offset;
    if (redis_fields[i].kind == 'z') {
        memcpy(at, &x, sizeof x);
        return 0;
    }
    if (x > (size_t)(unsigned)-1) {
        PyErr_Format(PyExc_ValueError, "kvpager: RedisTier: %s: %zu is too large",
                     redis_fields[i].name, x);
        return -1;
    }
    unsigned u = (unsigned)x;
    memcpy(at, &u, sizeof u);
    return 0;
}

static PyObject *redis_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"url",         "name_space",     "connect_timeout_ms",
                             "command_timeout_ms", "ttl_seconds", "queue_entries",
                             "queue_bytes", "write_batch",    "read_jobs",
                             "backoff_min_ms", "backoff_max_ms", NULL};
    const char *url, *ns = NULL;
    PyObject *v[REDIS_FIELDS] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s|zOOOOOOOOO:RedisTier", kwlist, &url, &ns,
                                     &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7],
                                     &v[8]))
        return NULL;
    kvp_tier_redis_config c;
    kvp_tier_redis_config_init(&c);
    c.url = url;
    c.name_space = ns;
    for (size_t i = 0; i < REDIS_FIELDS; i++)
        if (v[i] && redis_field_set(&c, i, v[i]) < 0)
            return NULL;
    kvp_tier *t = NULL;
    kvp_error err;
    if (kvp_tier_redis_create(&c, &t, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return tier_wrap(type, t);
}

static void tier_dealloc(KvpPyTier *self)
{
    if (self->tier) /* no pool holds it: each attached pool holds this object */
        (void)kvp_tier_destroy(self->tier, NULL);
    PyObject_Free(self);
}

static PyObject *tier_close(KvpPyTier *self, PyObject *unused)
{
    (void)unused;
    if (!self->tier)
        Py_RETURN_NONE;
    if (self->busy)
        return kvp_py_busy("tier");
    if (self->pools) {
        PyErr_SetString(PyExc_RuntimeError,
                        "kvpager: the tier is attached to a pool (Pool.detach_tier first)");
        return NULL;
    }
    (void)kvp_tier_destroy(self->tier, NULL);
    self->tier = NULL;
    Py_RETURN_NONE;
}

static PyObject *host_stats(KvpPyTier *self, PyObject *unused)
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

static PyObject *redis_stats(KvpPyTier *self, PyObject *unused)
{
    (void)unused;
    if (!self->tier)
        return kvp_py_closed("tier");
    kvp_tier_redis_stats s;
    kvp_tier_redis_stats_init(&s);
    kvp_error err;
    if (kvp_tier_redis_stats_get(self->tier, &s, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:n,s:n}",
        "round_trips", (unsigned long long)s.round_trips, "lookups",
        (unsigned long long)s.lookups, "hits", (unsigned long long)s.hits, "misses",
        (unsigned long long)s.misses, "too_big", (unsigned long long)s.too_big, "bytes_read",
        (unsigned long long)s.bytes_read, "puts", (unsigned long long)s.puts, "writes",
        (unsigned long long)s.writes, "bytes_written", (unsigned long long)s.bytes_written,
        "queue_drops", (unsigned long long)s.queue_drops, "write_errors",
        (unsigned long long)s.write_errors, "read_drops", (unsigned long long)s.read_drops,
        "errors", (unsigned long long)s.errors, "timeouts", (unsigned long long)s.timeouts,
        "connects", (unsigned long long)s.connects, "reconnects",
        (unsigned long long)s.reconnects, "queued", (Py_ssize_t)s.queued, "queued_bytes",
        (Py_ssize_t)s.queued_bytes);
}

static PyObject *redis_flush(KvpPyTier *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout_ms", NULL};
    unsigned int timeout = 1000;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|I:flush", kwlist, &timeout))
        return NULL;
    if (!self->tier)
        return kvp_py_closed("tier");
    kvp_error err;
    kvp_status s;
    kvp_tier *t = self->tier;
    self->busy++; /* close refuses while the handle is in use without the GIL */
    Py_BEGIN_ALLOW_THREADS
    s = kvp_tier_redis_flush(t, timeout, &err);
    Py_END_ALLOW_THREADS
    self->busy--;
    if (s != KVP_OK)
        return kvp_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *tier_get_closed(KvpPyTier *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(!self->tier);
}

static PyObject *tier_get_name(KvpPyTier *self, void *closure)
{
    (void)closure;
    if (!self->tier)
        return kvp_py_closed("tier");
    return PyUnicode_FromString(kvp_tier_name(self->tier));
}

static PyObject *tier_get_keys_only(KvpPyTier *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->tier && kvp_tier_keys_only(self->tier));
}

static PyObject *tier_enter(PyObject *self, PyObject *unused)
{
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *tier_exit(KvpPyTier *self, PyObject *args)
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
                                     &KvpPyTier_Type, &tier_obj, &secret, &write_through))
        return NULL;
    KvpPyTier *tier = (KvpPyTier *)tier_obj;
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
        ((KvpPyTier *)self->tier)->pools--;
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
    {"close", (PyCFunction)tier_close, METH_NOARGS,
     "close(): kvp_tier_destroy (RuntimeError while a pool has it attached)."},
    {"__enter__", tier_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)tier_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef tier_getset[] = {
    {"closed", (getter)tier_get_closed, NULL, "True after close().", NULL},
    {"name", (getter)tier_get_name, NULL,
     "kvp_tier_name: 'host', 'host-keys' or 'redis'.", NULL},
    {"keys_only", (getter)tier_get_keys_only, NULL,
     "kvp_tier_keys_only: True for HostTier(keys_only=True).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject KvpPyTier_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.Tier",
    .tp_basicsize = sizeof(KvpPyTier),
    .tp_dealloc = (destructor)tier_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A second tier (kvp_tier): HostTier or RedisTier; not made directly. "
              "Pool.attach_tier(tier, secret) gives it to a pool, which holds it alive while "
              "attached; close() (or `with`) destroys it and raises RuntimeError while a pool "
              "has it attached.",
    .tp_methods = tier_methods,
    .tp_getset = tier_getset,
};

static PyMethodDef host_methods[] = {
    {"stats", (PyCFunction)host_stats, METH_NOARGS,
     "stats() -> dict: kvp_tier_host_stats (budget_bytes, bytes, blocks, hits, misses, puts, "
     "evictions, rejected_puts)."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject KvpPyHostTier_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.HostTier",
    .tp_basicsize = sizeof(KvpPyTier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_base = &KvpPyTier_Type,
    .tp_doc = "HostTier(budget_bytes, keys_only=False)\n\nA second tier in this process's "
              "memory (kvp_tier_host_create): at most budget_bytes of blocks, least recently "
              "used dropped first. Pool.attach_tier(tier, secret) makes a pool write the "
              "published pages it evicts (or, write_through, every page it publishes) to it as "
              "verified blocks; group_tier_load(caches, keys) maps them back. keys_only "
              "(kvp_tier_host_keys_create): keeps the blocks' keys and sizes only, for a pool "
              "without data (slab_source='reserved'), the only tier such a pool takes. "
              "Thread-safe. A pool it is attached to holds it alive.",
    .tp_methods = host_methods,
    .tp_new = host_new,
};

static PyMethodDef redis_methods[] = {
    {"stats", (PyCFunction)redis_stats, METH_NOARGS,
     "stats() -> dict: kvp_tier_redis_stats (round_trips, lookups, hits, misses, puts, writes, "
     "bytes_written, queue_drops, write_errors, errors, timeouts, connects, queued, ...)."},
    {"flush", (PyCFunction)(void (*)(void))redis_flush, METH_VARARGS | METH_KEYWORDS,
     "flush(timeout_ms=1000): kvp_tier_redis_flush, the GIL released: waits until every put "
     "queued so far is written or has failed. TierUnavailable ('drain') when time ran out."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject KvpPyRedisTier_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.RedisTier",
    .tp_basicsize = sizeof(KvpPyTier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_base = &KvpPyTier_Type,
    .tp_doc = "RedisTier(url, name_space=None, connect_timeout_ms=0, command_timeout_ms=0, "
              "ttl_seconds=0, queue_entries=0, queue_bytes=0, write_batch=0, read_jobs=0, "
              "backoff_min_ms=0, backoff_max_ms=0)\n\nA second tier on a Redis server "
              "(kvp_tier_redis_create; 0 is each field's default, tier_redis.h): url "
              "redis://[user:password@]host[:port][/db]; blocks under 'kvp:[name_space:]<key>'. "
              "Puts are queued and written by the tier's writer thread (flush() waits for "
              "them); a server that is down fails batches (counted), not the create. Errors: "
              "InvalidArgument ('url' with `what` the bad part, 'name_space', ...). "
              "Thread-safe. A pool it is attached to holds it alive.",
    .tp_methods = redis_methods,
    .tp_new = redis_new,
};
