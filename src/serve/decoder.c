/*
 * decoder.c: batched decoding of many sequences on a fixed set of threads
 * (see kvp_decoder_* in kvpager/sequence.h).
 *
 * Owns: threads - 1 worker threads, started at creation and joined at
 * destruction, and the hand-off of one batch at a time.
 *
 * Protocol (all shared fields under `lock`):
 *   kvp_decoder_step publishes the batch (jobs, count, next = 0), bumps
 *   `generation`, wakes the workers and works itself; each thread claims job
 *   indices under the lock until none are left and reports when it is done;
 *   the caller returns once `busy` reaches 0. One step at a time: `stepping`
 *   is set when a step takes the batch slot and cleared when it returns, and
 *   a step that finds it set is refused with DECODER_BUSY before it writes
 *   anything (a second thread, or a next_input callback calling back in).
 *   Jobs are independent sequences, so each job's result equals a lone
 *   kvp_sequence_step (a step job) or kvp_sequence_prefill (a prefill job).
 *   Plain mutexes and condition variables only, so helgrind and DRD can
 *   follow every hand-off.
 * Global state: the thread-start fault injector (decoder_internal.h).
 * Callers: the public API.
 */
#include "kvpager/sequence.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "serve/decoder_internal.h"

#include "pager/alloc.h"
#include "pager/error.h"

struct kvp_decoder {
    size_t threads;             /* workers + the calling thread */
    pthread_t *workers;         /* [threads - 1] */
    pthread_mutex_t lock;
    pthread_cond_t work_ready;
    pthread_cond_t work_done;
    uint64_t generation;        /* bumped once per published batch */
    int shutdown;
    kvp_decode_job *jobs;
    size_t count;
    size_t next;                /* the next unclaimed job */
    size_t busy;                /* workers still on the current batch */
    int stepping;               /* a kvp_decoder_step owns the batch slot */
    kvp_next_input_fn next_input;
    void *ctx;
};

static atomic_uint_fast64_t thread_calls;  /* thread starts since arm */
static atomic_uint_fast64_t thread_target; /* 0: disarmed */
static atomic_int thread_fired;

void kvpi_thread_fault_arm(uint64_t nth)
{
    atomic_store(&thread_target, 0);
    atomic_store(&thread_calls, 0);
    atomic_store(&thread_fired, 0);
    atomic_store(&thread_target, (uint_fast64_t)nth);
}

uint64_t kvpi_thread_fault_calls(void)
{
    return (uint64_t)atomic_load(&thread_calls);
}

int kvpi_thread_fault_fired(void)
{
    return atomic_load(&thread_fired);
}

/* pthread_create, unless the injector fails this start (EAGAIN, nothing started). */
static int thread_start(pthread_t *thread, void *(*fn)(void *), void *arg)
{
    uint_fast64_t call = atomic_fetch_add(&thread_calls, 1) + 1;
    if (call == atomic_load(&thread_target)) {
        atomic_store(&thread_fired, 1);
        return EAGAIN;
    }
    return pthread_create(thread, NULL, fn, arg);
}

size_t kvpi_decoder_default_threads(long cores)
{
    if (cores <= 0) {
        return 1;
    }
    return cores > 4096 ? 4096 : (size_t)cores;
}

/* Claims and runs jobs until none are left. Called without the lock held. */
static void run_jobs(kvp_decoder *d)
{
    for (;;) {
        pthread_mutex_lock(&d->lock);
        size_t index = d->next < d->count ? d->next++ : d->count;
        kvp_decode_job *jobs = d->jobs;
        kvp_next_input_fn next_input = d->next_input;
        void *ctx = d->ctx;
        size_t count = d->count;
        pthread_mutex_unlock(&d->lock);
        if (index >= count) {
            return;
        }
        kvp_decode_job *job = &jobs[index];
        if (job->kind == KVP_JOB_PREFILL) {
            job->status = kvp_sequence_prefill(job->sequence, &job->input, next_input, ctx,
                                               job->output, job->output_len, &job->error);
        } else {
            job->status = kvp_sequence_step(job->sequence, &job->input, next_input, ctx,
                                            job->output, job->output_len, &job->error);
        }
    }
}

static void *worker_main(void *arg)
{
    kvp_decoder *d = arg;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&d->lock);
        while (!d->shutdown && d->generation == seen) {
            pthread_cond_wait(&d->work_ready, &d->lock);
        }
        if (d->shutdown) {
            pthread_mutex_unlock(&d->lock);
            return NULL;
        }
        seen = d->generation;
        pthread_mutex_unlock(&d->lock);
        run_jobs(d);
        pthread_mutex_lock(&d->lock);
        if (--d->busy == 0) {
            pthread_cond_signal(&d->work_done);
        }
        pthread_mutex_unlock(&d->lock);
    }
}

/* Stops and joins the first `started` workers, then frees the decoder. */
static void decoder_free(kvp_decoder *d, size_t started)
{
    pthread_mutex_lock(&d->lock);
    d->shutdown = 1;
    pthread_cond_broadcast(&d->work_ready);
    pthread_mutex_unlock(&d->lock);
    for (size_t i = 0; i < started; i++) {
        pthread_join(d->workers[i], NULL);
    }
    pthread_cond_destroy(&d->work_done);
    pthread_cond_destroy(&d->work_ready);
    pthread_mutex_destroy(&d->lock);
    kvpi_free(d->workers);
    kvpi_free(d);
}

kvp_status kvp_decoder_create(size_t threads, kvp_decoder **out, kvp_error *err)
{
    if (out == NULL) {
        return kvpi_fail_null(err, "out");
    }
    if (threads == 0) {
        threads = kvpi_decoder_default_threads(sysconf(_SC_NPROCESSORS_ONLN));
    }
    if (threads > 4096) {
        return kvpi_fail_invalid(err, "threads", "at most 4096 threads");
    }
    kvp_decoder *d = kvpi_calloc(KVPI_SITE_SCRATCH, 1, sizeof *d);
    if (d == NULL) {
        return kvpi_fail_alloc(err, "decoder", sizeof *d);
    }
    d->workers = kvpi_calloc(KVPI_SITE_SCRATCH, threads, sizeof *d->workers);
    if (d->workers == NULL) {
        kvpi_free(d);
        return kvpi_fail_alloc(err, "decoder threads", threads * sizeof(pthread_t));
    }
    d->threads = threads;
    pthread_mutex_init(&d->lock, NULL);
    pthread_cond_init(&d->work_ready, NULL);
    pthread_cond_init(&d->work_done, NULL);
    for (size_t i = 0; i + 1 < threads; i++) {
        if (thread_start(&d->workers[i], worker_main, d) != 0) {
            decoder_free(d, i);
            kvp_error e = kvpi_error_begin(KVP_THREAD_FAILED);
            e.index = i;
            e.limit = threads - 1;
            return kvpi_error_emit(err, &e);
        }
    }
    *out = d;
    return KVP_OK;
}

kvp_status kvp_decoder_destroy(kvp_decoder *decoder, kvp_error *err)
{
    if (decoder == NULL) {
        return kvpi_fail_null(err, "decoder");
    }
    decoder_free(decoder, decoder->threads - 1);
    return KVP_OK;
}

size_t kvp_decoder_threads(const kvp_decoder *decoder)
{
    return decoder != NULL ? decoder->threads : 0;
}

/*
 * INVALID_ARGUMENT when two jobs share a sequence (they would race) or a
 * job's kind is unknown. O(n^2), n small.
 */
static kvp_status check_jobs(const kvp_decode_job *jobs, size_t count, kvp_error *err)
{
    for (size_t i = 0; i < count; i++) {
        if (jobs[i].sequence == NULL) {
            return kvpi_fail_null(err, "jobs[i].sequence");
        }
        if (jobs[i].kind != KVP_JOB_STEP && jobs[i].kind != KVP_JOB_PREFILL) {
            return kvpi_fail_invalid(err, "jobs[i].kind", "a step or a prefill");
        }
        for (size_t j = 0; j < i; j++) {
            if (jobs[j].sequence == jobs[i].sequence) {
                return kvpi_fail_invalid(err, "jobs", "two jobs name the same sequence");
            }
        }
    }
    return KVP_OK;
}

kvp_status kvp_decoder_step(kvp_decoder *decoder, kvp_decode_job *jobs, size_t count,
                            kvp_next_input_fn next_input, void *ctx, kvp_error *err)
{
    if (decoder == NULL) {
        return kvpi_fail_null(err, "decoder");
    }
    if (jobs == NULL && count != 0) {
        return kvpi_fail_null(err, "jobs");
    }
    kvp_status status = check_jobs(jobs, count, err);
    if (status != KVP_OK) {
        return status;
    }
    pthread_mutex_lock(&decoder->lock);
    if (decoder->stepping) {
        pthread_mutex_unlock(&decoder->lock);
        kvp_error e = kvpi_error_begin(KVP_DECODER_BUSY);
        return kvpi_error_emit(err, &e);
    }
    if (count == 0) {
        pthread_mutex_unlock(&decoder->lock);
        return KVP_OK;
    }
    decoder->stepping = 1;
    decoder->jobs = jobs;
    decoder->count = count;
    decoder->next = 0;
    decoder->next_input = next_input;
    decoder->ctx = ctx;
    decoder->busy = decoder->threads - 1;
    decoder->generation++;
    pthread_cond_broadcast(&decoder->work_ready);
    pthread_mutex_unlock(&decoder->lock);

    run_jobs(decoder);

    pthread_mutex_lock(&decoder->lock);
    while (decoder->busy > 0) {
        pthread_cond_wait(&decoder->work_done, &decoder->lock);
    }
    decoder->jobs = NULL;
    decoder->count = 0;
    decoder->stepping = 0;
    pthread_mutex_unlock(&decoder->lock);
    return KVP_OK;
}
