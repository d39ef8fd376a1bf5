/*
 * src/python/py_internal.h: what the files of the Python extension module
 * (_kvpager) share: the object structs, the error helpers and the type
 * objects.
 *
 * Owns: nothing at run time; declares. The module uses the public API only
 * (include/kvpager/): it is the top layer beside cli (DESIGN.md, Layout).
 * Invariants: a Cache, Sequence or view holds a strong reference to every
 * object whose handle it needs (a cache its pool, a sequence its model and
 * pool, a view its cache), so C handles are destroyed in a safe order
 * whatever order Python frees the objects in.
 * Callers: the files of src/python/ only.
 */
#ifndef KVP_PY_INTERNAL_H
#define KVP_PY_INTERNAL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kvpager/cache.h"
#include "kvpager/layer.h"
#include "kvpager/model.h"
#include "kvpager/pool.h"
#include "kvpager/sequence.h"
#include "kvpager/status.h"

typedef struct {
    PyObject_HEAD
    kvp_pool *pool;
    int busy;  /* calls running with the GIL released: close refuses meanwhile */
    int users; /* schedulers holding the handle (they hold it without owning it) */
    PyObject *tier; /* strong: the Tier attached (tier.c), or NULL */
} KvpPyPool;

typedef struct {
    PyObject_HEAD
    kvp_cache *cache;
    KvpPyPool *pool;        /* strong */
    PyObject *owner;        /* strong: the Sequence a layer cache belongs to, or NULL */
    PyObject *layer;        /* strong: the Layer a Layer.cache() cache is bound to, or NULL */
    unsigned long generation; /* bumped by every call that changes the cache */
    Py_ssize_t exports;     /* buffers exported by views of this cache and not released */
    int busy;               /* a call runs with the GIL released */
} KvpPyCache;

typedef struct {
    PyObject_HEAD
    kvp_model *model;
    int busy;  /* steps of its sequences running with the GIL released */
    int users; /* schedulers holding the handle */
} KvpPyModel;

typedef struct {
    PyObject_HEAD
    kvp_layer *layer; /* owned; NULL once closed */
    Py_ssize_t users; /* open caches created by Layer.cache: close refuses meanwhile */
    Py_ssize_t busy;  /* attention calls computing with it, the GIL released (attention.c):
                         its changes (close, set_*, update_param, cache) refuse meanwhile */
} KvpPyLayer;

typedef struct {
    PyObject_HEAD
    kvp_sequence *sequence;
    KvpPyModel *model; /* strong */
    KvpPyPool *pool;   /* strong */
    unsigned long generation;
    Py_ssize_t exports; /* buffers exported by views of its layers' caches */
    int busy;
} KvpPySequence;

typedef struct {
    PyObject_HEAD
    kvp_decoder *decoder;
    int busy;  /* a step runs (this object's, or its scheduler's) */
    int users; /* schedulers holding the handle */
} KvpPyDecoder;

extern PyTypeObject KvpPyDecoder_Type;
extern PyTypeObject KvpPyScheduler_Type;
extern PyTypeObject KvpPyPool_Type;
extern PyTypeObject KvpPyCache_Type;
extern PyTypeObject KvpPyView_Type;
extern PyTypeObject KvpPyModel_Type;
extern PyTypeObject KvpPyLayer_Type;
extern PyTypeObject KvpPySequence_Type;
extern PyTypeObject KvpPyTicket_Type;
extern PyTypeObject KvpPyTier_Type; /* the base of the two below */
extern PyTypeObject KvpPyHostTier_Type;
extern PyTypeObject KvpPyRedisTier_Type;

/* errors.c */
int kvp_py_errors_init(PyObject *module);
/* A new instance of the kvpager.Error subclass of err->status (not raised). */
PyObject *kvp_py_error_new(const kvp_error *err);
/* An audit finding as a dict (invariant, what, page, lane, expected, actual). */
PyObject *kvp_py_mismatch_dict(const kvp_mismatch *m);
/* Raises the kvpager.Error subclass of err->status; returns NULL. */
PyObject *kvp_py_raise(const kvp_error *err);
/* Raises ValueError "... is closed"; returns NULL. */
PyObject *kvp_py_closed(const char *what);
/* Raises RuntimeError "... is in use by another thread"; returns NULL. */
PyObject *kvp_py_busy(const char *what);
/* A read-only Cache over a layer cache of a sequence (sequence.c). */
PyObject *kvp_py_layer_cache(KvpPyPool *pool, const kvp_cache *cache, PyObject *sequence);
/* A cache of its own bound to a standalone Layer (layer.c): holds the Layer
 * alive and counts in its users until closed; destroys the cache on failure. */
PyObject *kvp_py_bound_cache(KvpPyPool *pool, kvp_cache *cache, PyObject *layer);
/* A Python object's C-contiguous buffer of one of the row dtypes ('d' f64,
 * 'f' f32, 'e' f16); anything else is converted once to f64 with
 * numpy.ascontiguousarray. On success *dtype names its type and view must be
 * released with PyBuffer_Release. */
int kvp_py_rows_buffer(PyObject *obj, Py_buffer *view, kvp_dtype *dtype, const char *name);
/* The same, always f64 (converted once when it is not). */
int kvp_py_f64_buffer(PyObject *obj, Py_buffer *view, const char *name);
/* A new numpy.ndarray of doubles with the given shape (zeroed). */
PyObject *kvp_py_new_f64(int ndim, const size_t *dims, double **data);
/* One layer from a (W_q, W_k, W_v, W_o) sequence of arrays (sequence.c); -1
 * with a Python exception set on failure. Used by Model.create and Layer.create. */
int kvp_py_layer_from(PyObject *ws, size_t heads, size_t kv_heads, size_t maxpos, double base,
                      kvp_layer **out, kvp_error *err);
/* stats dict of a pool */
PyObject *kvp_py_pool_stats(kvp_pool *pool);

/* views.c: a read-only buffer over memory a cache owns. */
PyObject *kvp_py_view_new(KvpPyCache *cache, PyObject *keeper, unsigned long *generation_of,
                          Py_ssize_t *exports_of, const void *buf, const char *format,
                          Py_ssize_t itemsize, int ndim, const Py_ssize_t *shape,
                          const Py_ssize_t *strides, int is_page, uint32_t page);

/* views.c: makes a view export writable buffers (a reserved slot's, slots.c). */
void kvp_py_view_set_writable(PyObject *view);

/* slots.c: Cache.reserved_slots and Cache.commit_written (cache.c lists them). */
PyObject *kvp_py_cache_reserved_slots(KvpPyCache *self, PyObject *args);
PyObject *kvp_py_cache_commit_written(KvpPyCache *self, PyObject *args);

/* cache.c: Cache.paged_attention's work, on `dec`'s threads when not NULL
 * (Decoder.paged_attention; the caller checked it is open and idle). */
PyObject *kvp_py_paged_attention(KvpPyCache *self, PyObject *args, PyObject *kwds,
                                 KvpPyDecoder *dec);

/* cache.c, for attention.c and group.c: -1 with an exception set unless the
 * cache may change (open, no sequence's, not busy, nothing exported) or be
 * read (open, not busy); its generation (its sequence's for a layer cache)
 * and the busy flag to set while a call runs with the GIL released. */
int kvp_py_cache_may_change(KvpPyCache *self);
int kvp_py_cache_may_read(KvpPyCache *self);
unsigned long *kvp_py_cache_generation(KvpPyCache *self);
int *kvp_py_cache_busy(KvpPyCache *self);

/* attention.c: the Layer methods over the attention API (layer.c lists them). */
PyObject *kvp_py_layer_forward(KvpPyLayer *self, PyObject *args, PyObject *kwds);
PyObject *kvp_py_layer_prepare(KvpPyLayer *self, PyObject *args, PyObject *kwds);
PyObject *kvp_py_layer_reference(KvpPyLayer *self, PyObject *args, PyObject *kwds);
/* -1 with RuntimeError set while an attention call computes with the layer. */
int kvp_py_layer_idle(KvpPyLayer *self);

/* tier.c: the Pool's tier methods (pool.c lists them) and the release of its
 * Tier once the pool is destroyed or detached. */
PyObject *kvp_py_pool_attach_tier(KvpPyPool *self, PyObject *args, PyObject *kwds);
PyObject *kvp_py_pool_detach_tier(KvpPyPool *self, PyObject *unused);
PyObject *kvp_py_pool_tier_stats(KvpPyPool *self, PyObject *unused);
void kvp_py_pool_tier_release(KvpPyPool *self);

/* group.c: the module's functions (kvp_cache_group_*). */
extern PyMethodDef kvp_py_group_functions[];

/* A change refused because views of the cache's memory are exported. */
int kvp_py_check_unexported(Py_ssize_t exports, const char *what);

#endif /* KVP_PY_INTERNAL_H */
