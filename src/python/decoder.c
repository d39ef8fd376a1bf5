/*
 * src/python/decoder.c: kvpager.Decoder, batched decoding across threads
 * (kvp_decoder_*, kvpager/sequence.h).
 *
 * Owns: the Decoder type: creation with a thread count, step(jobs) running
 * every job (a step or a prefill of one Sequence) on the decoder's threads
 * with the GIL released, and close. A job's failure is its own: step
 * returns, per job, the output array or the kvpager.Error instance its
 * status gives (not raised); a refusal of the whole batch (two jobs on one
 * sequence, DecoderBusy) raises and runs nothing.
 * Invariants: while a step runs, every job's Sequence is marked busy (other
 * threads' calls on it raise RuntimeError) and so is its model (no
 * parameter update), and the Decoder itself (a second step, or close,
 * raises RuntimeError; C's DECODER_BUSY then never arises from Python).
 * Callers: module.c; scheduler.c borrows the decoder handle.
 */
#include "py_internal.h"

static PyObject *decoder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"threads", NULL};
    Py_ssize_t threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:Decoder", kwlist, &threads))
        return NULL;
    if (threads < 0) {
        PyErr_SetString(PyExc_ValueError, "kvpager: Decoder threads must not be negative");
        return NULL;
    }
    kvp_decoder *d = NULL;
    kvp_error err;
    if (kvp_decoder_create((size_t)threads, &d, &err) != KVP_OK)
        return kvp_py_raise(&err);
    KvpPyDecoder *self = PyObject_New(KvpPyDecoder, type);
    if (!self) {
        kvp_status ignored = kvp_decoder_destroy(d, NULL);
        (void)ignored;
        return NULL;
    }
    self->decoder = d;
    self->busy = 0;
    self->users = 0;
    return (PyObject *)self;
}

static void decoder_dealloc(KvpPyDecoder *self)
{
    if (self->decoder) {
        kvp_status ignored = kvp_decoder_destroy(self->decoder, NULL);
        (void)ignored;
    }
    PyObject_Free(self);
}

static PyObject *decoder_close(KvpPyDecoder *self, PyObject *unused)
{
    (void)unused;
    if (!self->decoder)
        Py_RETURN_NONE;
    if (self->busy || self->users) {
        PyErr_SetString(PyExc_RuntimeError,
                        "kvpager: the decoder is in use (a step runs, or a Scheduler holds it)");
        return NULL;
    }
    kvp_status ignored = kvp_decoder_destroy(self->decoder, NULL);
    (void)ignored;
    self->decoder = NULL;
    Py_RETURN_NONE;
}

/* One job's Python side: the sequence, its input buffer and output array. */
typedef struct {
    KvpPySequence *seq;
    Py_buffer in;
    PyObject *out;
} job_side;

static void release_sides(job_side *sides, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyBuffer_Release(&sides[i].in);
        Py_XDECREF(sides[i].out);
    }
}

/* Parses job i, (sequence, input) or (sequence, prompt, "prefill"). */
static int parse_job(PyObject *item, job_side *side, kvp_decode_job *job)
{
    PyObject *seq, *in;
    const char *kind = "step";
    if (!PyArg_ParseTuple(item, "O!O|s:a job", &KvpPySequence_Type, &seq, &in, &kind))
        return -1;
    side->seq = (KvpPySequence *)seq;
    if (!side->seq->sequence) {
        kvp_py_closed("sequence");
        return -1;
    }
    if (strcmp(kind, "step") != 0 && strcmp(kind, "prefill") != 0) {
        PyErr_Format(PyExc_ValueError, "kvpager: job kind '%s': not 'step' or 'prefill'", kind);
        return -1;
    }
    if (kvp_py_f64_buffer(in, &side->in, "input") < 0)
        return -1;
    job->sequence = side->seq->sequence;
    job->kind = kind[0] == 'p' ? KVP_JOB_PREFILL : KVP_JOB_STEP;
    job->input.data = side->in.buf;
    job->input.shape.rank = (size_t)side->in.ndim;
    for (int d = 0; d < side->in.ndim && d < KVP_MAX_RANK; d++)
        job->input.shape.dims[d] = (size_t)side->in.shape[d];
    size_t dims[3] = {0, 0, 0};
    if (side->in.ndim == 3)
        for (int d = 0; d < 3; d++)
            dims[d] = (size_t)side->in.shape[d];
    double *data;
    side->out = kvp_py_new_f64(3, dims, &data);
    if (!side->out)
        return -1;
    job->output = data;
    job->output_len = dims[0] * dims[1] * dims[2];
    return 0;
}

static int mark_busy(job_side *sides, Py_ssize_t n, int on)
{
    if (on) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (sides[i].seq->busy) {
                kvp_py_busy("sequence");
                return -1;
            }
            if (kvp_py_check_unexported(sides[i].seq->exports, "sequence") < 0)
                return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        sides[i].seq->busy = on;
        sides[i].seq->model->busy += on ? 1 : -1;
    }
    return 0;
}

static PyObject *results(job_side *sides, kvp_decode_job *jobs, Py_ssize_t n)
{
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        PyObject *r;
        if (jobs[i].status == KVP_OK) {
            sides[i].seq->generation++;
            r = Py_NewRef(sides[i].out);
        } else {
            r = kvp_py_error_new(&jobs[i].error);
        }
        if (!r) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, r);
    }
    return list;
}

static PyObject *decoder_step(KvpPyDecoder *self, PyObject *args)
{
    PyObject *job_list;
    if (!PyArg_ParseTuple(args, "O:step", &job_list))
        return NULL;
    if (!self->decoder)
        return kvp_py_closed("decoder");
    if (self->busy)
        return kvp_py_busy("decoder");
    PyObject *fast = PySequence_Fast(job_list, "kvpager: step takes a list of jobs");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    kvp_decode_job *jobs = PyMem_Calloc((size_t)n + 1, sizeof *jobs);
    job_side *sides = PyMem_Calloc((size_t)n + 1, sizeof *sides);
    PyObject *r = NULL;
    Py_ssize_t parsed = 0;
    if (!jobs || !sides) {
        PyErr_NoMemory();
        goto done;
    }
    for (; parsed < n; parsed++)
        if (parse_job(PySequence_Fast_GET_ITEM(fast, parsed), &sides[parsed], &jobs[parsed]) < 0)
            goto done;
    if (mark_busy(sides, n, 1) < 0)
        goto done;
    kvp_error err;
    kvp_status s;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    s = kvp_decoder_step(self->decoder, jobs, (size_t)n, NULL, NULL, &err);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    mark_busy(sides, n, 0);
    r = s == KVP_OK ? results(sides, jobs, n) : kvp_py_raise(&err);
done:
    if (sides)
        release_sides(sides, n); /* zeroed entries (not parsed) release nothing */
    PyMem_Free(sides);
    PyMem_Free(jobs);
    Py_DECREF(fast);
    return r;
}

static PyObject *decoder_paged_attention(KvpPyDecoder *self, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) < 1 || !PyObject_TypeCheck(PyTuple_GET_ITEM(args, 0),
                                                          &KvpPyCache_Type)) {
        PyErr_SetString(PyExc_TypeError,
                        "kvpager: Decoder.paged_attention(cache, queries, ...): a Cache first");
        return NULL;
    }
    if (!self->decoder)
        return kvp_py_closed("decoder");
    if (self->busy)
        return kvp_py_busy("decoder");
    PyObject *rest = PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args));
    if (!rest)
        return NULL;
    PyObject *r =
        kvp_py_paged_attention((KvpPyCache *)PyTuple_GET_ITEM(args, 0), rest, kwds, self);
    Py_DECREF(rest);
    return r;
}

static PyObject *decoder_get_threads(KvpPyDecoder *self, void *closure)
{
    (void)closure;
    if (!self->decoder)
        return kvp_py_closed("decoder");
    return PyLong_FromSize_t(kvp_decoder_threads(self->decoder));
}

static PyObject *decoder_enter(PyObject *self, PyObject *unused)
{
    (void)unused;
    return Py_NewRef(self);
}

static PyObject *decoder_exit(KvpPyDecoder *self, PyObject *args)
{
    (void)args;
    PyObject *r = decoder_close(self, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyMethodDef decoder_methods[] = {
    {"step", (PyCFunction)decoder_step, METH_VARARGS,
     "step(jobs) -> list: runs every job once on the decoder's threads, the GIL released "
     "(kvp_decoder_step). A job is (sequence, input) for one token ([batch, 1, width]) or "
     "(sequence, prompt, 'prefill'). Returns, per job, its output array or the "
     "kvpager.Error its failure gives (a failed job changes nothing). Two jobs on one "
     "sequence raise InvalidArgument and run nothing."},
    {"paged_attention", (PyCFunction)(void (*)(void))decoder_paged_attention,
     METH_VARARGS | METH_KEYWORDS,
     "paged_attention(cache, queries, keys=None, values=None, scale=0.0, accum='exact'): "
     "Cache.paged_attention on the decoder's threads (kvp_paged_attention with `threads`): "
     "the same bits."},
    {"close", (PyCFunction)decoder_close, METH_NOARGS, "close(): stop and join the threads."},
    {"__enter__", decoder_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)decoder_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef decoder_getset[] = {
    {"threads", (getter)decoder_get_threads, NULL, "Threads, the caller's included.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject KvpPyDecoder_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpager.Decoder",
    .tp_basicsize = sizeof(KvpPyDecoder),
    .tp_dealloc = (destructor)decoder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Decoder(threads=0)\n\nA pool of threads (0: one per core) running batches of "
              "sequence steps and prefills (kvp_decoder_create). One step at a time.",
    .tp_methods = decoder_methods,
    .tp_getset = decoder_getset,
    .tp_new = decoder_new,
};
