/*
 * scheduler_queue.c: the waiting queue, a request's rows, and the end of a
 * request (the scheduler's rooms: scheduler_internal.h).
 *
 * Owns: the ring of waiting ids (s->waiting, in queue order from
 * waiting_head), the layout of the rows a request's admission reads
 * (rows_needed, fill_request), and the moves that end a request or a
 * running slot: finish (a result in `done`, kvp_request_result_init's
 * defaults), retire (its leases reset to the idle list), mark and fail (a
 * job's failure fails its whole request).
 *
 * Invariants: the queue holds each waiting request once, in the order the
 * scheduler's header states (a session's request jumps per queue_jump's
 * bound); the moves here allocate nothing: the step made room for every
 * result and lease first, and kvpi_sched_queue_grow grows the ring before
 * any push.
 * Callers: the scheduler's rooms (scheduler_internal.h). Calls leases only.
 */
#include <string.h>

#include "pager/alloc.h"
#include "serve/scheduler_internal.h"

/* Grows a heap array of `size`-byte items to hold `need`; 0, or -1 changing nothing. */
int kvpi_sched_grow(void **items, size_t *room, size_t need, size_t size)
{
    if (need <= *room) {
        return 0;
    }
    size_t bigger = *room ? *room : 16;
    while (bigger < need) {
        if (bigger > SIZE_MAX / 2) {
            return -1;
        }
        bigger *= 2;
    }
    void *grown = kvpi_calloc(KVPI_SITE_SCRATCH, bigger, size);
    if (grown == NULL) {
        return -1;
    }
    if (*items != NULL) {
        memcpy(grown, *items, *room * size);
    }
    kvpi_free(*items);
    *items = grown;
    *room = bigger;
    return 0;
}

void kvpi_sched_queue_push_back(kvp_scheduler *s, uint64_t id)
{
    s->waiting[queue_at(s, s->waiting_count)] = id;
    s->waiting_count++;
}

void kvpi_sched_queue_push_front(kvp_scheduler *s, uint64_t id)
{
    s->waiting_head = (s->waiting_head + s->waiting_room - 1) % s->waiting_room;
    s->waiting[s->waiting_head] = id;
    s->waiting_count++;
}

uint64_t kvpi_sched_queue_pop_front(kvp_scheduler *s)
{
    uint64_t id = s->waiting[s->waiting_head];
    s->waiting_head = (s->waiting_head + 1) % s->waiting_room;
    s->waiting_count--;
    return id;
}

/*
 * A session's request whose sequence is kept (5.): at the front of the
 * queue, but behind every waiting request overtaken
 * KVP_SESSION_MAX_OVERTAKES times already; each request it goes ahead of
 * counts one more overtaking. So no waiting request is overtaken more than
 * KVP_SESSION_MAX_OVERTAKES times by session requests (the bound of
 * scheduler.h, 5.). Room was made first.
 */
void kvpi_sched_queue_jump(kvp_scheduler *s, uint64_t id)
{
    size_t at = 0;
    for (size_t i = 0; i < s->waiting_count; i++) {
        const record *r = record_of(s, s->waiting[queue_at(s, i)]);
        if (r->overtaken >= KVP_SESSION_MAX_OVERTAKES) {
            at = i + 1;
        }
    }
    for (size_t i = at; i < s->waiting_count; i++) {
        record_of(s, s->waiting[queue_at(s, i)])->overtaken++;
    }
    s->waiting_count++;
    for (size_t i = s->waiting_count - 1; i > at; i--) {
        s->waiting[queue_at(s, i)] = s->waiting[queue_at(s, i - 1)];
    }
    s->waiting[queue_at(s, at)] = id;
}

/* Grows the ring to `need`, keeping the queue's order. */
int kvpi_sched_queue_grow(kvp_scheduler *s, size_t need)
{
    if (need <= s->waiting_room) {
        return 0;
    }
    uint64_t *linear = NULL;
    size_t room = 0;
    if (kvpi_sched_grow((void **)&linear, &room, need, sizeof *linear) != 0) {
        return -1;
    }
    for (size_t i = 0; i < s->waiting_count; i++) {
        linear[i] = s->waiting[queue_at(s, i)];
    }
    kvpi_free(s->waiting);
    s->waiting = linear;
    s->waiting_room = room;
    s->waiting_head = 0;
    return 0;
}

/* 1 when the request's prompt rows can be keyed (sharing on, and rows to read). */
int kvpi_sched_keyed(const kvp_scheduler *s, const kvp_request *q)
{
    return s->config.sharing && (s->config.compute || q->prompt != NULL || q->input != NULL ||
                                 q->block_digest != NULL);
}

/*
 * The rows a request's admission reads, back to back:
 *   compute, sharing on: the prompt, then each sample's generated tokens;
 *   compute, sharing off: each sample's prompt and generated tokens;
 *   compute off: the prompt when it is keyed by rows (its keys), else
 *   nothing (block digests key it without rows).
 */
size_t kvpi_sched_rows_needed(const kvp_scheduler *s, const record *r)
{
    const kvp_request *q = &r->request;
    if (!s->config.compute) {
        return kvpi_sched_keyed(s, q) && q->block_digest == NULL ? q->prompt_tokens : 0;
    }
    if (s->config.sharing) {
        return q->prompt_tokens + q->samples * r->generated;
    }
    return q->samples * (q->prompt_tokens + r->generated);
}

/* Request `id`'s rows [from, to) of sample `sample` into `rows` (prompt rows are sample 0's). */
void kvpi_sched_fill_rows(kvp_scheduler *s, uint64_t id, size_t sample, size_t from, size_t to,
                          double *rows)
{
    const kvp_request *q = &record_of(s, id)->request;
    for (size_t t = from; t < to; t++) {
        double *row = rows + (t - from) * s->width;
        if (t < q->prompt_tokens && q->prompt != NULL) {
            memcpy(row, q->prompt + t * s->width, s->width * sizeof *row);
        } else {
            q->input(q->ctx, id, t < q->prompt_tokens ? 0 : sample, t, row, s->width);
        }
    }
}

/* Fills request `id`'s rows in the rows_needed layout. */
void kvpi_sched_fill_request(kvp_scheduler *s, uint64_t id, double *rows)
{
    const record *r = record_of(s, id);
    size_t prompt = r->request.prompt_tokens;
    size_t g = r->generated;
    if (!s->config.compute || s->config.sharing) {
        if (kvpi_sched_rows_needed(s, r) == 0) {
            return;
        }
        kvpi_sched_fill_rows(s, id, 0, 0, prompt, rows);
        for (size_t k = 0; s->config.compute && k < r->request.samples; k++) {
            kvpi_sched_fill_rows(s, id, k, prompt, prompt + g,
                                 rows + (prompt + k * g) * s->width);
        }
        return;
    }
    for (size_t k = 0; k < r->request.samples; k++) {
        kvpi_sched_fill_rows(s, id, k, 0, prompt + g, rows + k * (prompt + g) * s->width);
    }
}

void kvp_request_result_init(kvp_request_result *result)
{
    if (result == NULL) {
        return;
    }
    memset(result, 0, sizeof *result);
    result->struct_size = sizeof *result;
}

/* Appends a finished request's result (room was made at the start of the step). */
void kvpi_sched_finish(kvp_scheduler *s, uint64_t id, int rejected, kvp_status status,
                       const kvp_error *error)
{
    record *r = record_of(s, id);
    kvp_request_result *out = &s->done[s->done_count++];
    kvp_request_result_init(out);
    out->id = id;
    out->tokens_generated = r->generated * r->request.samples;
    out->preemptions = r->preemptions;
    out->admissions = r->admissions;
    out->first_hit_tokens = r->first_hit_tokens;
    out->recomputed_tokens = r->recomputed_tokens;
    out->admitted_step = r->admitted_step;
    out->first_token_step = r->first_token_step;
    out->finished_step = s->stats.steps;
    out->rejected = rejected;
    out->status = status;
    if (error != NULL) {
        out->error = *error;
    }
    r->state = STATE_FINISHED;
    if (rejected) {
        s->stats.rejected++;
    } else if (status != KVP_OK) {
        s->stats.failed++;
    } else {
        s->stats.completed++;
    }
}

/* Moves running slot i's lease to the idle list, reset (room was made first). */
static void retire_slot(kvp_scheduler *s, size_t i)
{
    lease l = s->running[i].lease;
    record_of(s, s->running[i].id)->slots--;
    s->running[i] = s->running[--s->running_count];
    lease_reset(s, &l);
    s->idle[s->idle_count++] = l;
}

/* Retires every running slot of request `id`, from the back. */
void kvpi_sched_retire_request(kvp_scheduler *s, uint64_t id)
{
    for (size_t i = s->running_count; i-- > 0;) {
        if (s->running[i].id == id) {
            retire_slot(s, i);
        }
    }
}

/* A job of request `id` failed: the first failure is kept; the request fails after the phase. */
void kvpi_sched_mark_failed(kvp_scheduler *s, uint64_t id, const kvp_error *error)
{
    record *rec = record_of(s, id);
    if (!rec->failed) {
        rec->failed = 1;
        rec->error = *error;
    }
}

/* Every request of slots [first, running_count) marked failed finishes with its status. */
void kvpi_sched_fail_marked(kvp_scheduler *s, size_t first, kvp_step_stats *st)
{
    for (size_t i = s->running_count; i-- > first;) {
        if (i >= s->running_count) {
            continue; /* a retire moved the last slot into a place already visited */
        }
        uint64_t id = s->running[i].id;
        record *rec = record_of(s, id);
        if (!rec->failed) {
            continue;
        }
        kvpi_sched_retire_request(s, id);
        kvp_error error = rec->error;
        rec->failed = 0;
        kvpi_sched_finish(s, id, 0, error.status, &error);
        st->failed++;
        i = s->running_count; /* retiring moved slots: scan again from the back */
    }
}
