/*
 * src/python/group.c: sharing over a group of caches at once
 * (kvpager/cache.h, "Sharing for a group of caches"): the module functions
 * kvpager.group_probe, group_adopt, group_publish and group_tier_load over
 * kvp_cache_group_probe / _adopt / _publish and kvp_cache_group_tier_load
 * (the pool's tier: tier.c attaches it; the GIL released while it waits).
 *
 * Owns: those functions and the conversion of their key lists: keys is a
 * flat sequence of (lo, hi) block keys in the C layout, keys[(j * count + c)
 * * batch + lane] for block j of cache c (count = len(caches)), so its
 * length is a multiple of count * batch and gives the blocks.
 * Invariants: every Python-side check (closed, busy, exported views, a
 * sequence's caches for the changing calls, the key list) runs before the C
 * call, and the C calls change nothing on failure; adopt bumps the
 * generation of every cache it grew, so their older views raise PageNotHeld.
 * Callers: module.c (the module's method table).
 */
#include "py_internal.h"

#include "kvpager/tier.h"

typedef struct {
    PyObject *fast;      /* the caches as a sequence */
    KvpPyCache **objs;   /* PyMem: their objects (borrowed from fast) */
    kvp_cache **caches;  /* PyMem */
    kvp_block_key *keys; /* PyMem */
    size_t count;
    size_t blocks;       /* len(keys) / (count * batch) */
} group_args;

static void group_free(group_args *g)
{
    PyMem_Free(g->objs);
    PyMem_Free(g->caches);
    PyMem_Free(g->keys);
    Py_XDECREF(g->fast);
}

static int key_at(PyObject *obj, kvp_block_key *key)
{
    unsigned long long lo, hi;
    if (!PyTuple_Check(obj) || !PyArg_ParseTuple(obj, "KK", &lo, &hi)) {
        PyErr_SetString(PyExc_TypeError, "kvpager: a block key is a (lo, hi) tuple of ints");
        return -1;
    }
    key->lo = lo;
    key->hi = hi;
    return 0;
}

static int group_keys(group_args *g, PyObject *keys_obj)
{
    PyObject *kf = PySequence_Fast(keys_obj, "kvpager: keys is a sequence of (lo, hi) keys");
    if (!kf)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(kf);
    size_t unit = 1;
    if (g->count) {
        kvp_cache_info i;
        kvp_cache_info_init(&i);
        if (kvp_cache_info_get(g->caches[0], &i, NULL) == KVP_OK && i.batch_size)
            unit = g->count * i.batch_size;
    }
    int rc = -1;
    if ((size_t)n % unit != 0) {
        PyErr_Format(PyExc_ValueError,
                     "kvpager: %zd keys: keys[(block * len(caches) + cache) * batch + lane] "
                     "needs a multiple of len(caches) * batch = %zu",
                     n, unit);
        goto done;
    }
    g->blocks = (size_t)n / unit;
    g->keys = PyMem_Calloc((size_t)n + 1, sizeof *g->keys);
    if (!g->keys) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (key_at(PySequence_Fast_GET_ITEM(kf, i), &g->keys[i]) < 0)
            goto done;
    rc = 0;
done:
    Py_DECREF(kf);
    return rc;
}

/* caches and keys from the arguments; `change`: the call changes the caches. */
static int group_parse(group_args *g, PyObject *caches_obj, PyObject *keys_obj, int change)
{
    *g = (group_args){0};
    g->fast = PySequence_Fast(caches_obj, "kvpager: caches is a sequence of kvpager.Cache");
    if (!g->fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(g->fast);
    g->count = (size_t)n;
    g->caches = PyMem_Calloc((size_t)n + 1, sizeof *g->caches);
    g->objs = PyMem_Calloc((size_t)n + 1, sizeof *g->objs);
    if (!g->caches || !g->objs) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = PySequence_Fast_GET_ITEM(g->fast, i);
        if (!PyObject_TypeCheck(c, &KvpPyCache_Type)) {
            PyErr_Format(PyExc_TypeError, "kvpager: caches[%zd] is not a kvpager.Cache", i);
            return -1;
        }
        KvpPyCache *kc = (KvpPyCache *)c;
        if ((change ? kvp_py_cache_may_change(kc) : kvp_py_cache_may_read(kc)) < 0)
            return -1;
        g->caches[i] = kc->cache;
        g->objs[i] = kc;
    }
    return group_keys(g, keys_obj);
}

static PyObject *group_probe(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *caches, *keys;
    if (!PyArg_ParseTuple(args, "OO:group_probe", &caches, &keys))
        return NULL;
    group_args g;
    PyObject *r = NULL;
    if (group_parse(&g, caches, keys, 0) == 0) {
        size_t blocks = 0, evictable = 0;
        kvp_error err;
        if (kvp_cache_group_probe((const kvp_cache *const *)g.caches, g.count, g.keys, g.blocks,
                                  &blocks, &evictable, &err) != KVP_OK)
            kvp_py_raise(&err);
        else
            r = Py_BuildValue("(nn)", (Py_ssize_t)blocks, (Py_ssize_t)evictable);
    }
    group_free(&g);
    return r;
}

static PyObject *group_adopt(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *caches, *keys;
    if (!PyArg_ParseTuple(args, "OO:group_adopt", &caches, &keys))
        return NULL;
    group_args g;
    PyObject *r = NULL;
    if (group_parse(&g, caches, keys, 1) == 0) {
        size_t adopted = 0;
        kvp_error err;
        if (kvp_cache_group_adopt(g.caches, g.count, g.keys, g.blocks, &adopted, &err) !=
            KVP_OK) {
            kvp_py_raise(&err);
        } else {
            for (size_t i = 0; adopted && i < g.count; i++)
                (*kvp_py_cache_generation(
                    (KvpPyCache *)PySequence_Fast_GET_ITEM(g.fast, (Py_ssize_t)i)))++;
            r = PyLong_FromSize_t(adopted);
        }
    }
    group_free(&g);
    return r;
}

static PyObject *group_publish(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *caches, *keys;
    if (!PyArg_ParseTuple(args, "OO:group_publish", &caches, &keys))
        return NULL;
    group_args g;
    PyObject *r = NULL;
    if (group_parse(&g, caches, keys, 1) == 0) {
        kvp_error err;
        if (kvp_cache_group_publish(g.caches, g.count, g.keys, g.blocks, &err) != KVP_OK)
            kvp_py_raise(&err);
        else
            r = PyLong_FromSize_t(g.blocks);
    }
    group_free(&g);
    return r;
}

/* kvp_cache_group_tier_load over checked caches: the GIL released, the caches and
 * their pools busy (Pool.detach_tier and close raise RuntimeError meanwhile). */
static PyObject *tier_load(KvpPyCache **objs, kvp_cache **caches, size_t count,
                           const kvp_block_key *keys, size_t blocks)
{
    size_t loaded = 0;
    kvp_status stop = KVP_OK, s;
    kvp_error err;
    for (size_t i = 0; i < count; i++) { /* the pools too: detach_tier refuses meanwhile */
        *kvp_py_cache_busy(objs[i]) = 1;
        objs[i]->pool->busy++;
    }
    Py_BEGIN_ALLOW_THREADS
    s = kvp_cache_group_tier_load(caches, count, keys, blocks, &loaded, &stop, &err);
    Py_END_ALLOW_THREADS
    for (size_t i = 0; i < count; i++) {
        *kvp_py_cache_busy(objs[i]) = 0;
        objs[i]->pool->busy--;
    }
    if (s != KVP_OK)
        return kvp_py_raise(&err);
    for (size_t i = 0; loaded && i < count; i++)
        (*kvp_py_cache_generation(objs[i]))++;
    if (stop == KVP_OK)
        return Py_BuildValue("(nO)", (Py_ssize_t)loaded, Py_None);
    return Py_BuildValue("(ns)", (Py_ssize_t)loaded, kvp_status_name(stop));
}

static PyObject *group_tier_load(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *caches, *keys;
    if (!PyArg_ParseTuple(args, "OO:group_tier_load", &caches, &keys))
        return NULL;
    group_args g;
    PyObject *r = NULL;
    if (group_parse(&g, caches, keys, 1) == 0)
        r = tier_load(g.objs, g.caches, g.count, g.keys, g.blocks);
    group_free(&g);
    return r;
}

PyMethodDef kvp_py_group_functions[] = {
    {"group_probe", group_probe, METH_VARARGS,
     "group_probe(caches, keys) -> (blocks, evictable_pages): kvp_cache_group_probe: how many "
     "leading blocks group_adopt would adopt now (every key of the block in the pool's prefix "
     "index, room in every cache) and how many of their pages no table names. keys is flat: "
     "keys[(j * len(caches) + c) * batch + lane] names block j past the caches' common length "
     "of cache c, lane `lane`, as (lo, hi) (Cache.block_key). Changes nothing, counters "
     "included. Errors: InvalidArgument ('count': no caches; 'caches': not one pool, batch "
     "size and length), BlockBindingMismatch."},
    {"group_adopt", group_adopt, METH_VARARGS,
     "group_adopt(caches, keys) -> blocks adopted: kvp_cache_group_adopt: block j is mapped in "
     "every cache or in none, under one hold of the pool's mutex (the layers of one sequence "
     "stay the same length); keys as group_probe. Errors, adopting nothing: the group's, "
     "RowsReserved, NotAtBlockBoundary, BlockBindingMismatch (err.layer = the cache). "
     "BufferError while views of a cache are exported; TypeError for a Sequence's caches."},
    {"group_publish", group_publish, METH_VARARGS,
     "group_publish(caches, keys) -> blocks: kvp_cache_group_publish: registers the first "
     "len(keys) / (len(caches) * batch) full blocks of every cache and lane, all or nothing; "
     "keys[(j * len(caches) + c) * batch + lane] counted from block 0. Errors, registering "
     "nothing: the group's, OutOfRange ('blocks': more than the full blocks), PagePublished "
     "(err.index = the page, err.layer = its cache)."},
    {"group_tier_load", group_tier_load, METH_VARARGS,
     "group_tier_load(caches, keys) -> (blocks loaded, stop): kvp_cache_group_tier_load: "
     "maps the next blocks (keys as group_adopt, counted from the caches' common length, a "
     "block boundary) from the pool's tier (Pool.attach_tier) into fresh pages, each block "
     "verified under the pool's secret, all or nothing per block, in chain order, published "
     "under its key. stop is None (every block, or one the tier did not hold) or the status "
     "name that ended the run ('TierBlockRejected', 'TierUnavailable', 'BufferTooSmall'). "
     "The GIL is released (it waits for the tier). Errors, changing nothing: "
     "InvalidArgument ('pool': no tier; as group_adopt), RowsReserved, "
     "NotAtBlockBoundary, PoolExhausted."},
    {NULL, NULL, 0, NULL},
};
