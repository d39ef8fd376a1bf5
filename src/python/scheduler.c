/*
 * src/python/scheduler.c: kvpager.Scheduler, continuous batching
 * (kvpager/scheduler.h).
 *
 * Owns: the Scheduler type: creation from keyword arguments
 * (kvp_scheduler_config), submit (a prompt array and/or an `input`
 * callable, an optional `on_token` callable, samples, sessions), step (the
 * GIL released; the callables run on the calling thread, taking the GIL
 * back), collect, request_state, stats and close.
 * Invariants: the scheduler holds its Model, Pool and Decoder objects alive
 * (the C scheduler holds their handles without owning them); each request's
 * record (its prompt buffer and callables, the C request's ctx) lives in
 * `records`, keyed by id, until the request is collected or the scheduler
 * closed, as kvp_scheduler_submit requires. An exception raised by a
 * callable is kept and raised by the step after it returns (the step itself
 * completed; an `input` that raised gave NaN rows, so its request fails with
 * a non-finite status); later exceptions of the same step are printed as
 * unraisable.
 * Callers: module.c.
 */
#include "py_internal.h"

#include <math.h>

#include "kvpager/scheduler.h"

typedef struct {
    PyObject_HEAD
    kvp_scheduler *scheduler;
    PyObject *model;   /* strong, or NULL (compute 0 without a model) */
    KvpPyPool *pool;   /* strong */
    PyObject *decoder; /* strong, or NULL */
    PyObject *records; /* dict: id -> capsule of a request_record */
    PyObject *pending; /* the first exception a callable raised in this step */
    size_t width;
    int busy;
} KvpPyScheduler;

typedef struct {
    KvpPyScheduler *owner; /* borrowed: the record lives in owner->records */
    PyObject *input;       /* callable(id, sample, position) -> row, or NULL */
    PyObject *on_token;    /* callable(id, sample, position, output), or NULL */
    Py_buffer prompt;      /* obj NULL when there is none */
} request_record;

static void record_free(PyObject *capsule)
{
    request_record *r = PyCapsule_GetPointer(capsule, "kvpager.request");
    if (!r)
        return;
    Py_XDECREF(r->input);
    Py_XDECREF(r->on_token);
    PyBuffer_Release(&r->prompt);
    PyMem_Free(r);
}

static void keep_exception(KvpPyScheduler *s)
{
    if (!s->pending) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb)
            PyException_SetTraceback(value, tb);
        s->pending = value;
        Py_XDECREF(type);
        Py_XDECREF(tb);
    } else {
        PyErr_WriteUnraisable(NULL);
    }
}

static void input_cb(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                     size_t width)
{
    request_record *r = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    int ok = 0;
    PyObject *got = PyObject_CallFunction(r->input, "Knn", (unsigned long long)id,
                                          (Py_ssize_t)sample, (Py_ssize_t)position);
    Py_buffer b;
    if (got && kvp_py_f64_buffer(got, &b, "the input row") == 0) {
        if ((size_t)b.len == width * sizeof(double)) {
            memcpy(row, b.buf, width * sizeof(double));
            ok = 1;
        } else {
            PyErr_Format(PyExc_ValueError, "kvpager: input gave %zd values, not %zu",
                         b.len / (Py_ssize_t)sizeof(double), width);
        }
        PyBuffer_Release(&b);
    }
    Py_XDECREF(got);
    if (!ok) {
        keep_exception(r->owner);
        for (size_t i = 0; i < width; i++)
            row[i] = NAN; /* the request fails with a non-finite status */
    }
    PyGILState_Release(g);
}

static void token_cb(void *ctx, uint64_t id, size_t sample, size_t position,
                     const double *output, size_t width)
{
    request_record *r = ctx;
    PyGILState_STATE g = PyGILState_Ensure();
    double *data;
    size_t dims[1] = {width};
    PyObject *arr = kvp_py_new_f64(1, dims, &data);
    PyObject *got = NULL;
    if (arr) {
        memcpy(data, output, width * sizeof(double));
        got = PyObject_CallFunction(r->on_token, "KnnO", (unsigned long long)id,
                                    (Py_ssize_t)sample, (Py_ssize_t)position, arr);
    }
    Py_XDECREF(arr);
    if (!got)
        keep_exception(r->owner);
    Py_XDECREF(got);
    PyGILState_Release(g);
}

/* kvp_scheduler_config.tier_loads from "model", "always" or "never"; -1 with an exception. */
static int tier_loads_from(PyObject *v, uint64_t *out)
{
    static const char *const names[] = {"model", "always", "never"};
    static const uint64_t values[] = {KVP_TIER_LOADS_MODEL, KVP_TIER_LOADS_ALWAYS,
                                      KVP_TIER_LOADS_NEVER};
    const char *name = PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : NULL;
    if (!name) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "kvpager: Scheduler: tier_loads must be a str");
        return -1;
    }
    for (size_t i = 0; i < 3; i++) {
        if (strcmp(name, names[i]) == 0) {
            *out = values[i];
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "kvpager: Scheduler: tier_loads '%s': not 'model', 'always' or 'never'", name);
    return -1;
}

static int config_from(PyObject *kwds, kvp_scheduler_config *c, int *has_model)
{
    (void)has_model;
    static const struct {
        const char *name;
        char kind; /* n: size_t, d: double, b: int flag, k: uint64, t: a kvp_tier_loads name */
        size_t offset;
    } fields[] = {
        {"capacity", 'n', offsetof(kvp_scheduler_config, capacity)},
        {"watermark", 'd', offsetof(kvp_scheduler_config, watermark)},
        {"reserve_tokens", 'n', offsetof(kvp_scheduler_config, reserve_tokens)},
        {"max_running", 'n', offsetof(kvp_scheduler_config, max_running)},
        {"compute", 'b', offsetof(kvp_scheduler_config, compute)},
        {"identity", 'k', offsetof(kvp_scheduler_config, identity)},
        {"sharing", 'b', offsetof(kvp_scheduler_config, sharing)},
        {"cache_aware", 'k', offsetof(kvp_scheduler_config, schedule)},
        {"session_ttl", 'n', offsetof(kvp_scheduler_config, session_ttl)},
        {"session_fraction", 'd', offsetof(kvp_scheduler_config, session_fraction)},
        {"layers", 'n', offsetof(kvp_scheduler_config, layers)},
        {"model_width", 'n', offsetof(kvp_scheduler_config, model_width)},
        {"tier_loads", 't', offsetof(kvp_scheduler_config, tier_loads)},
        {"tier_prefetch", 'n', offsetof(kvp_scheduler_config, tier_prefetch)},
    };
    Py_ssize_t used = 0;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        PyObject *v = kwds ? PyDict_GetItemString(kwds, fields[i].name) : NULL;
        if (!v)
            continue;
        used++;
        char *at = (char *)c + fields[i].offset;
        if (fields[i].kind == 'n') {
            size_t x = PyLong_AsSize_t(v);
            if (x == (size_t)-1 && PyErr_Occurred())
                return -1;
            memcpy(at, &x, sizeof x);
        } else if (fields[i].kind == 'd') {
            double x = PyFloat_AsDouble(v);
            if (x == -1.0 && PyErr_Occurred())
                return -1;
            memcpy(at, &x, sizeof x);
        } else if (fields[i].kind == 't') {
            uint64_t x;
            if (tier_loads_from(v, &x) < 0)
                return -1;
            memcpy(at, &x, sizeof x);
        } else if (fields[i].kind == 'b') {
            int x = PyObject_IsTrue(v);
            if (x < 0)
                return -1;
            memcpy(at, &x, sizeof x);
        } else {
            uint64_t x = PyObject_IsTrue(v) && fields[i].name[0] == 'c'
                             ? (uint64_t)KVP_SCHEDULE_CACHE_AWARE
                             : (uint64_t)PyLong_AsUnsignedLongLongMask(v);
            if (PyErr_Occurred())
                return -1;
            memcpy(at, &x, sizeof x);
        }
    }
    if (kwds && used != PyDict_Size(kwds)) {
        PyErr_SetString(PyExc_TypeError, "kvpager: Scheduler: an unknown keyword argument");
        return -1;
    }
    return 0;
}

static PyObject *sched_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *model = Py_None, *pool = NULL, *decoder = Py_None;
    if (!PyArg_ParseTuple(args, "OO!|O:Scheduler", &model, &KvpPyPool_Type, &pool, &decoder))
        return NULL;
    if ((model != Py_None && !PyObject_TypeCheck(model, &KvpPyModel_Type)) ||
        (decoder != Py_None && !PyObject_TypeCheck(decoder, &KvpPyDecoder_Type))) {
        PyErr_SetString(PyExc_TypeError,
                        "kvpager: Scheduler(model or None, pool, decoder or None, **config)");
        return NULL;
    }
    kvp_scheduler_config c;
    kvp_scheduler_config_init(&c);
    int has_model = model != Py_None;
    if (config_from(kwds, &c, &has_model) < 0)
        return NULL;
    const kvp_model *m = has_model ? ((KvpPyModel *)model)->model : NULL;
    kvp_decoder *d = decoder != Py_None ? ((KvpPyDecoder *)decoder)->decoder : NULL;
    if ((has_model && !m) || (decoder != Py_None && !d) || !((KvpPyPool *)pool)->pool)
        return kvp_py_closed("model, decoder or pool");
    kvp_scheduler *sched = NULL;
    kvp_error err;
    if (kvp_scheduler_create(m, ((KvpPyPool *)pool)->pool, d, &c, &sched, &err) != KVP_OK)
        return kvp_py_raise(&err);
    KvpPyScheduler *self = PyObject_New(KvpPyScheduler, type);
    PyObject *records = PyDict_New();
    if (!self || !records) {
        kvp_status ignored = kvp_scheduler_destroy(sched, NULL);
        (void)ignored;
        Py_XDECREF(records);
        if (self)
            PyObject_Free(self);
        return NULL;
    }
    self->scheduler = sched;
    self->model = has_model ? Py_NewRef(model) : NULL;
    self->pool = (KvpPyPool *)Py_NewRef(pool);
    self->decoder = d ? Py_NewRef(decoder) : NULL;
    self->records = records;
    self->pending = NULL;
    self->busy = 0;
    self->width = c.model_width;
    /* Closing any of the three would free a handle the C scheduler uses. */
    self->pool->users++;
    if (self->model)
        ((KvpPyModel *)self->model)->users++;
    if (self->decoder)
        ((KvpPyDecoder *)self->decoder)->users++;
    if (m) {
        kvp_model_info info;
        kvp_model_info_init(&info);
        if (kvp_model_info_get(m, &info, NULL) == KVP_OK)
            self->width = info.model_width;
    }
    return (PyObject *)self;
}

static void sched_destroy(KvpPyScheduler *self)
{
    if (self->scheduler) {
        kvp_status ignored = kvp_scheduler_destroy(self->scheduler, NULL);
        (void)ignored;
        self->scheduler = NULL;
        self->pool->users--;
        if (self->model)
            ((KvpPyModel *)self->model)->users--;
        if (self->decoder)
            ((KvpPyDecoder *)self->decoder)->users--;
    }
    if (self->records)
        PyDict_Clear(self->records); /* after the destroy: no callback runs any more */
}

static void sched_dealloc(KvpPyScheduler *self)
{
    sched_destroy(self);
    Py_XDECREF(self->records);
    Py_XDECREF(self->pending);
    Py_XDECREF(self->model);
    Py_XDECREF((PyObject *)self->pool);
    Py_XDECREF(self->decoder);
    PyObject_Free(self);
}

#define SCHED_OPEN(self)                                                                           \
    do {                                                                                           \
        if (!(self)->scheduler)                                                                    \
            return kvp_py_closed("scheduler");                                                     \
        if ((self)->busy)                                                                          \
            return kvp_py_busy("scheduler");                                                       \
    } while (0)

static PyObject *sched_close(KvpPyScheduler *self, PyObject *unused)
{
    (void)unused;
    if (self->busy)
        return kvp_py_busy("scheduler");
    sched_destroy(self);
    Py_RETURN_NONE;
}

static int record_setup(request_record *r, PyObject *prompt, PyObject *input, PyObject *on_token,
                        kvp_request *req, size_t width)
{
    if (prompt != Py_None) {
        if (kvp_py_f64_buffer(prompt, &r->prompt, "prompt") < 0)
            return -1;
        size_t n = (size_t)r->prompt.len / sizeof(double);
        if (width == 0 || n % width != 0 || n == 0) {
            PyErr_Format(PyExc_ValueError,
                         "kvpager: submit: the prompt holds %zu values, not a multiple of the "
                         "width %zu",
                         n, width);
            return -1;
        }
        req->prompt = r->prompt.buf;
        if (req->prompt_tokens == 0)
            req->prompt_tokens = n / width;
    }
    if (input != Py_None) {
        r->input = Py_NewRef(input);
        req->input = input_cb;
    }
    if (on_token != Py_None) {
        r->on_token = Py_NewRef(on_token);
        req->on_token = token_cb;
    }
    req->ctx = r;
    return 0;
}

static PyObject *sched_submit(KvpPyScheduler *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"prompt",  "max_new_tokens", "samples",       "input",
                             "on_token", "session",       "prompt_tokens", NULL};
    PyObject *prompt = Py_None, *input = Py_None, *on_token = Py_None;
    Py_ssize_t max_new = 1, samples = 1, prompt_tokens = 0;
    unsigned long long session = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|nnOOKn:submit", kwlist, &prompt, &max_new,
                                     &samples, &input, &on_token, &session, &prompt_tokens))
        return NULL;
    SCHED_OPEN(self);
    if (max_new < 0 || samples < 0 || prompt_tokens < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: submit: negative count");
        return NULL;
    }
    kvp_request req;
    kvp_request_init(&req);
    req.max_new_tokens = (size_t)max_new;
    req.samples = (size_t)samples;
    req.session = session;
    req.prompt_tokens = (size_t)prompt_tokens;
    request_record *r = PyMem_Calloc(1, sizeof *r);
    if (!r)
        return PyErr_NoMemory();
    r->owner = self;
    PyObject *capsule = PyCapsule_New(r, "kvpager.request", record_free);
    if (!capsule) {
        PyMem_Free(r);
        return NULL;
    }
    uint64_t id;
    kvp_error err;
    PyObject *key = NULL;
    if (record_setup(r, prompt, input, on_token, &req, self->width) < 0)
        goto fail;
    if (kvp_scheduler_submit(self->scheduler, &req, &id, &err) != KVP_OK) {
        kvp_py_raise(&err);
        goto fail;
    }
    key = PyLong_FromUnsignedLongLong(id);
    if (!key || PyDict_SetItem(self->records, key, capsule) < 0)
        goto fail; /* cannot happen but out of memory; the request then keeps a dead ctx */
    Py_DECREF(capsule);
    return key;
fail:
    Py_XDECREF(key);
    Py_DECREF(capsule);
    return NULL;
}

static PyObject *step_dict(const kvp_step_stats *s)
{
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,"
                         "s:n,s:n}",
                         "admitted", (Py_ssize_t)s->admitted, "rejected", (Py_ssize_t)s->rejected,
                         "preempted", (Py_ssize_t)s->preempted, "decoded", (Py_ssize_t)s->decoded,
                         "finished", (Py_ssize_t)s->finished, "failed", (Py_ssize_t)s->failed,
                         "running", (Py_ssize_t)s->running, "waiting", (Py_ssize_t)s->waiting,
                         "prefill_tokens", (Py_ssize_t)s->prefill_tokens, "held_pages",
                         (Py_ssize_t)s->held_pages, "total_pages", (Py_ssize_t)s->total_pages,
                         "prompt_tokens", (Py_ssize_t)s->prompt_tokens, "prefix_hit_tokens",
                         (Py_ssize_t)s->prefix_hit_tokens, "stale_preempted",
                         (Py_ssize_t)s->stale_preempted, "retained_pages",
                         (Py_ssize_t)s->retained_pages, "sliding_held_pages",
                         (Py_ssize_t)s->sliding_held_pages, "unshared_pages",
                         (Py_ssize_t)s->unshared_pages, "cached_pages",
                         (Py_ssize_t)s->cached_pages, "evictable_pages",
                         (Py_ssize_t)s->evictable_pages);
}

static PyObject *sched_step(KvpPyScheduler *self, PyObject *unused)
{
    (void)unused;
    SCHED_OPEN(self);
    KvpPyDecoder *dec = (KvpPyDecoder *)self->decoder;
    KvpPyModel *model = (KvpPyModel *)self->model;
    if (dec && dec->busy)
        return kvp_py_busy("decoder");
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    kvp_error err;
    kvp_status s;
    self->busy = 1;
    if (dec)
        dec->busy = 1;
    if (model)
        model->busy++;
    Py_BEGIN_ALLOW_THREADS
    s = kvp_scheduler_step(self->scheduler, &st, &err);
    Py_END_ALLOW_THREADS
    if (model)
        model->busy--;
    if (dec)
        dec->busy = 0;
    self->busy = 0;
    if (self->pending) {
        PyObject *e = self->pending;
        self->pending = NULL;
        PyErr_SetObject((PyObject *)Py_TYPE(e), e);
        Py_DECREF(e);
        return NULL;
    }
    if (s != KVP_OK)
        return kvp_py_raise(&err);
    return step_dict(&st);
}

static PyObject *result_dict(const kvp_request_result *r)
{
    PyObject *error = Py_None;
    if (r->status != KVP_OK) {
        error = kvp_py_error_new(&r->error);
        if (!error)
            return NULL;
    } else {
        Py_INCREF(error);
    }
    return Py_BuildValue("{s:K,s:n,s:n,s:O,s:s,s:N,s:n,s:n,s:n,s:K,s:K,s:K}", "id",
                         (unsigned long long)r->id, "tokens_generated",
                         (Py_ssize_t)r->tokens_generated, "preemptions",
                         (Py_ssize_t)r->preemptions, "rejected", r->rejected ? Py_True : Py_False,
                         "status", kvp_status_name(r->status), "error", error, "admissions",
                         (Py_ssize_t)r->admissions, "first_hit_tokens",
                         (Py_ssize_t)r->first_hit_tokens, "recomputed_tokens",
                         (Py_ssize_t)r->recomputed_tokens, "admitted_step",
                         (unsigned long long)r->admitted_step, "first_token_step",
                         (unsigned long long)r->first_token_step, "finished_step",
                         (unsigned long long)r->finished_step);
}

static PyObject *sched_collect(KvpPyScheduler *self, PyObject *unused)
{
    (void)unused;
    SCHED_OPEN(self);
    PyObject *list = PyList_New(0);
    kvp_request_result batch[16];
    size_t n;
    do {
        for (size_t i = 0; i < 16; i++)
            kvp_request_result_init(&batch[i]);
        kvp_error err;
        if (kvp_scheduler_collect(self->scheduler, batch, 16, &n, &err) != KVP_OK) {
            Py_XDECREF(list);
            return kvp_py_raise(&err);
        }
        for (size_t i = 0; list && i < n; i++) {
            PyObject *d = result_dict(&batch[i]);
            PyObject *key = PyLong_FromUnsignedLongLong(batch[i].id);
            if (!d || !key || PyList_Append(list, d) < 0 ||
                (PyDict_GetItem(self->records, key) && PyDict_DelItem(self->records, key) < 0))
                Py_CLEAR(list);
            Py_XDECREF(d);
            Py_XDECREF(key);
        }
    } while (list && n == 16);
    return list;
}

static PyObject *sched_request_state(KvpPyScheduler *self, PyObject *args)
{
    unsigned long long id;
    if (!PyArg_ParseTuple(args, "K:request_state", &id))
        return NULL;
    SCHED_OPEN(self);
    kvp_request_state st;
    kvp_error err;
    if (kvp_scheduler_request_state(self->scheduler, id, &st, &err) != KVP_OK)
        return kvp_py_raise(&err);
    return PyUnicode_FromString(st == KVP_REQUEST_WAITING   ? "waiting"
                                : st == KVP_REQUEST_RUNNING ? "running"
                                                            : "finished");
}

/* The counters of kvp_scheduler_stats the first dict of stats() leaves out: the second
   tier's (6.) and stale_preemptions; merged into it. */
static PyObject *tier_stats_dict(const kvp_scheduler_stats *s)
{
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:d,s:K,s:K,s:K,s:d,s:d,s:K,s:K,s:K,s:K,s:K}", "tier_hit_blocks",
        (unsigned long long)s->tier_hit_blocks, "tier_hit_tokens",
        (unsigned long long)s->tier_hit_tokens, "tier_load_bytes",
        (unsigned long long)s->tier_load_bytes, "tier_load_seconds", s->tier_load_seconds,
        "tier_rejected", (unsigned long long)s->tier_rejected, "tier_errors",
        (unsigned long long)s->tier_errors, "tier_recomputes",
        (unsigned long long)s->tier_recomputes, "tier_bytes_per_second",
        s->tier_bytes_per_second, "prefill_tokens_per_second", s->prefill_tokens_per_second,
        "tier_prefetches", (unsigned long long)s->tier_prefetches, "tier_prefetch_used",
        (unsigned long long)s->tier_prefetch_used, "tier_prefetch_late",
        (unsigned long long)s->tier_prefetch_late, "tier_prefetch_wasted",
        (unsigned long long)s->tier_prefetch_wasted, "stale_preemptions",
        (unsigned long long)s->stale_preemptions);
}

static PyObject *sched_stats(KvpPyScheduler *self, PyObject *unused)
{
    (void)unused;
    SCHED_OPEN(self);
    kvp_scheduler_stats s;
    kvp_scheduler_stats_init(&s);
    kvp_error err;
    if (kvp_scheduler_stats_get(self->scheduler, &s, &err) != KVP_OK)
        return kvp_py_raise(&err);
    PyObject *d = Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:K,s:n,s:n,s:K,s:K,s:K}",
        "submitted", (unsigned long long)s.submitted, "completed",
        (unsigned long long)s.completed, "rejected", (unsigned long long)s.rejected, "failed",
        (unsigned long long)s.failed, "preemptions", (unsigned long long)s.preemptions,
        "tokens_generated", (unsigned long long)s.tokens_generated, "prefill_tokens",
        (unsigned long long)s.prefill_tokens, "steps", (unsigned long long)s.steps, "running",
        (Py_ssize_t)s.running, "waiting", (Py_ssize_t)s.waiting, "uncollected",
        (Py_ssize_t)s.uncollected, "peak_running", (Py_ssize_t)s.peak_running, "held_samples",
        (Py_ssize_t)s.held_samples, "prompt_tokens", (unsigned long long)s.prompt_tokens,
        "prefix_hit_tokens", (unsigned long long)s.prefix_hit_tokens, "forks",
        (unsigned long long)s.forks, "retained", (Py_ssize_t)s.retained, "retained_pages",
        (Py_ssize_t)s.retained_pages, "session_keeps", (unsigned long long)s.session_keeps,
        "session_hits", (unsigned long long)s.session_hits, "session_drops",
        (unsigned long long)s.session_drops);
    PyObject *tier = tier_stats_dict(&s);
    if (!d || !tier || PyDict_Update(d, tier) < 0)
        Py_CLEAR(d);
    Py_XDECREF(tier);
    return d;
}

static PyObject *sched_enter(PyObject *self, PyObject *unused)
{
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *sched_exit(KvpPyScheduler *self, PyObject *args)
{
    (void)args;
    PyObject *r = sched_close(self, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyObject *sched_get_pending_records(KvpPyScheduler *self, void *closure)
{
    (void)closure;
    return PyLong_FromSsize_t(PyDict_Size(self->records));
}

static PyMethodDef sched_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))sched_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(prompt, max_new_tokens=1, samples=1, input=None, on_token=None, session=0, "
     "prompt_tokens=0) -> id. prompt: [T, width] float64 rows (converted once) or None "
     "(then `input` gives every row and prompt_tokens says how many are the prompt); "
     "input(id, sample, position) -> the row of a decoded position (required with compute); "
     "on_token(id, sample, position, output). Kept until collected. Errors: Full, "
     "InvalidArgument, NullArgument (no input with compute), as kvp_scheduler_submit."},
    {"step", (PyCFunction)sched_step, METH_NOARGS,
     "step() -> dict: one step (admission, prefill, preemption, decode), the GIL released; "
     "the callables run on this thread. Raises the first exception a callable raised."},
    {"collect", (PyCFunction)sched_collect, METH_NOARGS,
     "collect() -> list of dicts: every finished request, oldest first (status, error: the "
     "kvpager.Error of a failure or None, tokens_generated, preemptions, ...)."},
    {"request_state", (PyCFunction)sched_request_state, METH_VARARGS,
     "request_state(id) -> 'waiting' | 'running' | 'finished' (RequestUnknown once collected)."},
    {"stats", (PyCFunction)sched_stats, METH_NOARGS, "stats() -> dict: kvp_scheduler_stats."},
    {"close", (PyCFunction)sched_close, METH_NOARGS,
     "close(): kvp_scheduler_destroy: every sequence's pages back; uncollected requests dropped."},
    {"__enter__", sched_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)sched_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef sched_getset[] = {
    {"records", (getter)sched_get_pending_records, NULL,
     "Requests submitted and not yet collected (their prompts and callables are kept).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject KvpPyScheduler_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.Scheduler",
    .tp_basicsize = sizeof(KvpPyScheduler),
    .tp_dealloc = (destructor)sched_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Scheduler(model, pool, decoder, capacity=..., watermark=0.01, reserve_tokens=16, "
              "max_running=0, compute=True, identity=0, sharing=True, cache_aware=False, "
              "session_ttl=0, session_fraction=0.5, layers=0, model_width=0, tier_loads='model', "
              "tier_prefetch=2)\n\n"
              "Continuous batching over `model` in `pool` on `decoder` "
              "(kvp_scheduler_create); model and decoder may be None with compute=False (the "
              "allocator alone; layers and model_width then). Holds the three alive. One "
              "caller at a time.",
    .tp_methods = sched_methods,
    .tp_getset = sched_getset,
    .tp_new = sched_new,
};
