/*
 * sharing.c: a sharing storm. Many threads, one small pool, pages shared.
 *
 * T threads each own S sequence slots of one model (2 layers, 1 lane) on one
 * shared pool that is too small for all of them. At random, from fixed
 * seeds, each thread steps and prefills its sequences, forks them (and forks
 * of forks) into its other slots, truncates them (to 0, mid-page, to the
 * same length, and past the end, which must be refused), runs prompts drawn
 * from a few shared prefixes (kvp_sequence_adopt_prefix, then a prefill of
 * the rest, then kvp_sequence_publish_prefix), resets, destroys and
 * recreates. Every refusal must be a typed status the contract allows
 * (POOL_EXHAUSTED, FULL, OUT_OF_RANGE, INVALID_ARGUMENT) and change nothing:
 * the sequence's len, held pages and digest are compared before and after.
 * Every thread runs the pool audit (kvp_pool_check, I1..I5) every K
 * operations while the others keep working.
 *
 * Exactness: every thread keeps each slot's input history (the rows behind
 * every position, inherited by a fork, filled in by an adopt). Every V-th
 * successful step or prefill, and every computation of the phases below, is
 * recomputed on a fresh reference sequence of the same model on a second,
 * large pool (the history prefilled, then the same rows) and the outputs
 * must be equal bit for bit (memcmp). Forked and adopted sequences are
 * verified in every share phase, whatever the scheduling.
 *
 * What random operations reach depends on scheduling (under Valgrind the
 * threads run one at a time), so the run forces it. At `--phases` fixed
 * points of every thread's operations, all threads stop (a barrier) and
 * reset every slot; then, by turns (kind = phase % 3):
 *   - share: each thread prefills and publishes a prompt of prefix t % P in
 *     slot 0 (barrier; those pages stay held, so nothing can evict them),
 *     then adopts prefix (t + 1) % P in slot 1, which must give exactly the
 *     prefix's full blocks, prefills the rest, forks slot 1 into slot 2 and
 *     steps both with one input: every output is verified. One thread then
 *     checks that prefix_hits grew by at least every adopter's pages.
 *   - storm: each thread publishes its prefix (barrier) and resets it, so
 *     every cached page is evictable; one thread records evictable pages
 *     and evictions; then every thread grows every slot one step at a time
 *     until each is refused. One thread checks that the pool is spent (no
 *     sequence below capacity could take a step from free + evictable
 *     pages), that a refusal was POOL_EXHAUSTED, and that evictions grew by
 *     at least the evictable pages consumed (> 0).
 *   - revision: each thread publishes its prefix and keeps it held (barrier),
 *     one thread bumps the revision of every parameter of every layer
 *     (kvp_param_update through kvp_model_param_mut, with slightly changed
 *     values) while the others wait at the barrier, since no computation may
 *     overlap an update. Then each thread: a step on its old slot 0 must be
 *     refused with CACHE_LAYER_REVISION_MISMATCH and change nothing; it
 *     recreates its other slots and its reference, and adopts another
 *     thread's (still held, still indexed) old prefix: 0 tokens, then
 *     prefills and verifies, publishing nothing (a new-revision block
 *     published before every thread has looked would be a fair hit). One thread checks that prefix_hits did not move
 *     and prefix_misses grew by at least T. Old slot 0s are then recreated.
 * The pool is sized (checked up front) so the phases' prompts always fit
 * and the slots together can outgrow it.
 *
 * At the end every sequence is destroyed and the pool is whole: no page
 * held, free + evictable == total, every cached page evictable, nothing
 * promised or attached, acquires == releases (I1 with held == 0: the audit
 * checks acquires - releases + tentative == held), and kvp_pool_check passes;
 * the same for the reference pool.
 *
 * With --window W (and --sinks S) layer 1 slides: front truncation
 * releases its old blocks (null entries) under every operation and phase,
 * a truncate into released blocks must be refused with BLOCK_RELEASED and
 * change nothing, forks share only live blocks, adoption follows the hit
 * rule for windows; the window must have released pages by the end.
 *
 * Exit status 0 when all of that holds, 1 otherwise, 2 on usage errors.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stress_common.h"

#define PROGRAM "stress-sharing"
#define LAYERS 2
#define WIDTH 8      /* model width D */
#define HEADS 2
#define HEAD_WIDTH 4
#define BT 4         /* block tokens */
#define CAPACITY 32
#define PREFIXES 3   /* P shared prefixes */
#define PREFIX 9     /* prefix tokens: two full blocks and one more */
#define MAX_SUFFIX 3 /* prompts are PREFIX + 1..MAX_SUFFIX tokens: adopts give 8 */
#define MAX_PROMPT (PREFIX + MAX_SUFFIX)
#define PREFIX_BLOCKS (PREFIX / BT)
#define MAX_PREFILL 4
/*
 * Pages one thread holds at most during a phase, per layer: its prompt (3
 * blocks), the adopter's own block after the shared prefix, and the two
 * copies (or new blocks) of the adopter's and its fork's steps.
 */
#define PHASE_PAGES (LAYERS * 6)

typedef struct worker worker;

typedef struct shared {
    kvp_pool *pool;
    kvp_pool *ref_pool;  /* large: the reference sequences never run out */
    kvp_model *model;
    double prefix[PREFIXES][PREFIX * WIDTH];
    size_t publishers;   /* min(T, P): prefixes 0 .. publishers-1 are published in phases */
    size_t threads;
    size_t slots;
    size_t ops;
    size_t audit_every;
    size_t verify_every;
    size_t phases;
    uint64_t seed;
    size_t window, sinks; /* layer 1's (W, S) (kvp_layer_set_window); 0: every layer full */
    worker *workers;
    pthread_barrier_t barrier;
    /* Written only by the serial thread of a phase, between barriers. */
    kvp_pool_stats mark;
    size_t storm_exhausted_mark; /* storm refusals before the current storm */
    size_t phases_checked[3];
    size_t bumps;
    int phase_failed;
    char phase_failure[512];
} shared;

typedef struct counters {
    size_t steps;
    size_t prefills;
    size_t forks;
    size_t truncates;
    size_t released_refusals; /* truncates into a window's released blocks, refused */
    size_t prompts;
    size_t adopted_tokens;
    size_t publishes;
    size_t resets;
    size_t recreates;
    size_t exhausted;
    size_t full;
    size_t misuse;         /* OUT_OF_RANGE / INVALID_ARGUMENT refusals, as documented */
    size_t stale;          /* steps of a stale sequence refused after a bump */
    size_t audits;
    size_t verified;       /* outputs compared with a fresh reference */
    size_t verified_shared; /* of those, on forked or adopted sequences */
    size_t storm_steps;
    size_t storm_exhausted;
    size_t phase_adopts;   /* share-phase adopts that gave the whole prefix */
} counters;

typedef struct slot {
    kvp_sequence *seq;
    double *history;       /* [CAPACITY][WIDTH]: the row behind every position */
    int shared;            /* forked, a fork's parent, or adopted a prefix */
} slot;

struct worker {
    size_t id;
    pthread_t thread;
    shared *sh;
    slot *slots;
    kvp_sequence *ref;     /* on the reference pool */
    double rows[MAX_PROMPT * WIDTH];
    double out[MAX_PROMPT * WIDTH];
    double ref_out[MAX_PROMPT * WIDTH];
    unsigned char *refused;
    size_t computed;       /* successful steps and prefills, for the verify cadence */
    uint64_t rng;
    counters count;
    int failed;
    char failure[512];
};

static void record_failure(worker *w, const char *what, const kvp_error *err)
{
    if (w->failed) {
        return;
    }
    w->failed = 1;
    char text[384] = "";
    if (err != NULL) {
        kvp_error_format(err, text, sizeof text);
    }
    snprintf(w->failure, sizeof w->failure, "thread %zu: %s: %s", w->id, what, text);
}

/* ---- "nothing changed" -------------------------------------------------- */

typedef struct snap {
    size_t len;
    size_t held;
    uint64_t digest;
} snap;

static snap take_snap(const kvp_sequence *seq)
{
    snap s = {kvp_sequence_len(seq), kvp_sequence_held_pages(seq), stress_sequence_digest(seq)};
    return s;
}

/* A refusal: `status` must be one of `allowed` (ending with KVP_OK) and change nothing. */
static void check_refusal(worker *w, kvp_status status, const kvp_error *err,
                          const kvp_sequence *seq, const snap *before, const kvp_status *allowed)
{
    size_t i = 0;
    while (allowed[i] != KVP_OK && allowed[i] != status) {
        i++;
    }
    if (allowed[i] == KVP_OK) {
        record_failure(w, "unexpected status", err);
        return;
    }
    w->count.exhausted += status == KVP_POOL_EXHAUSTED;
    w->count.full += status == KVP_FULL;
    w->count.misuse += status == KVP_OUT_OF_RANGE || status == KVP_INVALID_ARGUMENT;
    snap after = take_snap(seq);
    if (after.len != before->len || after.held != before->held ||
        after.digest != before->digest) {
        record_failure(w, "a refused call changed its sequence", err);
    }
}

static const kvp_status k_growth[] = {KVP_POOL_EXHAUSTED, KVP_FULL, KVP_OK};

/* ---- the reference -------------------------------------------------------- */

/*
 * Recomputes rows [from, from + tokens) of slot `s`'s history on a fresh
 * reference sequence (the rows before them prefilled first) and compares the
 * outputs with `got` bit for bit.
 */
static void verify(worker *w, const slot *s, size_t from, size_t tokens, const double *got)
{
    kvp_error err;
    if (kvp_sequence_reset(w->ref, &err) != KVP_OK) {
        record_failure(w, "resetting the reference", &err);
        return;
    }
    if (from > 0) {
        kvp_tensor head = kvp_tensor3(s->history, 1, from, WIDTH);
        if (kvp_sequence_prefill(w->ref, &head, NULL, NULL, NULL, 0, &err) != KVP_OK) {
            record_failure(w, "prefilling the reference's history", &err);
            return;
        }
    }
    kvp_tensor rest = kvp_tensor3(s->history + from * WIDTH, 1, tokens, WIDTH);
    if (kvp_sequence_prefill(w->ref, &rest, NULL, NULL, w->ref_out, tokens * WIDTH, &err) !=
        KVP_OK) {
        record_failure(w, "computing the reference", &err);
        return;
    }
    if (memcmp(got, w->ref_out, tokens * WIDTH * sizeof(double)) != 0) {
        char what[160];
        snprintf(what, sizeof what,
                 "outputs of positions %zu..%zu differ from a fresh sequence's (%s)", from,
                 from + tokens - 1, s->shared ? "shared pages" : "own pages");
        record_failure(w, what, NULL);
        return;
    }
    w->count.verified++;
    w->count.verified_shared += s->shared != 0;
}

static void maybe_verify(worker *w, const slot *s, size_t from, size_t tokens, const double *got)
{
    w->computed++;
    if (w->sh->verify_every != 0 && w->computed % w->sh->verify_every == 0) {
        verify(w, s, from, tokens, got);
    }
}

/* ---- operations ------------------------------------------------------------ */

static int recreate(worker *w, slot *s)
{
    if (s->seq != NULL) {
        kvp_sequence_destroy(s->seq, NULL);
        s->seq = NULL;
    }
    s->shared = 0;
    kvp_error err;
    if (kvp_sequence_create(w->sh->model, w->sh->pool, 1, CAPACITY, &s->seq, &err) != KVP_OK) {
        record_failure(w, "creating a sequence", &err);
        return 1;
    }
    w->count.recreates++;
    return 0;
}

/* One step of `tokens` rows (a step when 1, else a prefill); verified when `force`. */
static kvp_status grow(worker *w, slot *s, size_t tokens, int force)
{
    snap before = take_snap(s->seq);
    stress_fill(w->rows, tokens * WIDTH, &w->rng);
    kvp_tensor input = kvp_tensor3(w->rows, 1, tokens, WIDTH);
    kvp_error err;
    kvp_status status =
        tokens == 1
            ? kvp_sequence_step(s->seq, &input, NULL, NULL, w->out, WIDTH, &err)
            : kvp_sequence_prefill(s->seq, &input, NULL, NULL, w->out, tokens * WIDTH, &err);
    if (status != KVP_OK) {
        check_refusal(w, status, &err, s->seq, &before, k_growth);
        return status;
    }
    if (kvp_sequence_len(s->seq) != before.len + tokens) {
        record_failure(w, "a step or prefill grew its sequence wrongly", NULL);
        return status;
    }
    memcpy(s->history + before.len * WIDTH, w->rows, tokens * WIDTH * sizeof(double));
    if (tokens == 1) {
        w->count.steps++;
    } else {
        w->count.prefills++;
    }
    if (force) {
        w->computed++;
        verify(w, s, before.len, tokens, w->out);
    } else {
        maybe_verify(w, s, before.len, tokens, w->out);
    }
    return status;
}

/* Forks slot `from` into slot `to` (destroying what `to` held). */
static int fork_into(worker *w, slot *from, slot *to)
{
    if (to->seq != NULL) {
        kvp_sequence_destroy(to->seq, NULL);
        to->seq = NULL;
    }
    kvp_error err;
    size_t held = kvp_sequence_held_pages(from->seq);
    if (kvp_sequence_fork(from->seq, &to->seq, &err) != KVP_OK) {
        record_failure(w, "forking a sequence", &err);
        return 1;
    }
    size_t len = kvp_sequence_len(from->seq);
    if (kvp_sequence_len(to->seq) != len || kvp_sequence_held_pages(to->seq) != held ||
        kvp_sequence_held_pages(from->seq) != held ||
        stress_sequence_digest(to->seq) != stress_sequence_digest(from->seq)) {
        record_failure(w, "a fork differs from its parent", NULL);
        return 1;
    }
    memcpy(to->history, from->history, len * WIDTH * sizeof(double));
    from->shared = 1;
    to->shared = 1;
    w->count.forks++;
    return 0;
}

static void truncate_op(worker *w, slot *s)
{
    size_t len = kvp_sequence_len(s->seq);
    size_t kind = stress_rand(&w->rng) % 4;
    size_t to = kind == 0 ? 0 : kind == 1 ? (len == 0 ? 0 : stress_rand(&w->rng) % len)
                          : kind == 2 ? len : len + 1;
    snap before = take_snap(s->seq);
    kvp_error err;
    kvp_status status = kvp_sequence_truncate(s->seq, to, &err);
    if (status == KVP_BLOCK_RELEASED && w->sh->window != 0 && kind == 1) {
        /* the sliding layer released a block its window at `to` needs */
        static const kvp_status released[] = {KVP_BLOCK_RELEASED, KVP_OK};
        check_refusal(w, status, &err, s->seq, &before, released);
        w->count.released_refusals += err.layer == 1;
        return;
    }
    if (kind == 3) {
        static const kvp_status past[] = {KVP_OUT_OF_RANGE, KVP_OK};
        if (status == KVP_OK) {
            record_failure(w, "a truncate past the end succeeded", NULL);
        } else {
            check_refusal(w, status, &err, s->seq, &before, past);
        }
        return;
    }
    if (status != KVP_OK) {
        record_failure(w, "truncating", &err);
        return;
    }
    w->count.truncates++;
    snap after = take_snap(s->seq);
    if (after.len != to || (to == len && (after.held != before.held ||
                                          after.digest != before.digest))) {
        record_failure(w, "a truncate gave the wrong length, or the same length changed it",
                       NULL);
    }
}

/*
 * A prompt of prefix p and `suffix` random rows on the EMPTY slot `s`:
 * adopt, prefill the rest, publish (when `publish`). Returns the tokens
 * adopted, or SIZE_MAX when the prefill was refused (checked) or something
 * failed (recorded).
 */
static size_t prompt_op(worker *w, slot *s, size_t p, size_t suffix, int force, int publish)
{
    size_t tokens = PREFIX + suffix;
    memcpy(w->rows, w->sh->prefix[p], sizeof w->sh->prefix[p]);
    stress_fill(w->rows + PREFIX * WIDTH, suffix * WIDTH, &w->rng);
    kvp_tensor prompt = kvp_tensor3(w->rows, 1, tokens, WIDTH);
    kvp_error err;
    size_t adopted = SIZE_MAX;
    if (kvp_sequence_adopt_prefix(s->seq, &prompt, &adopted, &err) != KVP_OK) {
        record_failure(w, "adopting a prefix", &err);
        return SIZE_MAX;
    }
    if (adopted % BT != 0 || adopted > PREFIX_BLOCKS * BT || kvp_sequence_len(s->seq) != adopted) {
        record_failure(w, "an adopt gave a wrong length", NULL);
        return SIZE_MAX;
    }
    memcpy(s->history, w->rows, tokens * WIDTH * sizeof(double));
    s->shared |= adopted > 0;
    w->count.adopted_tokens += adopted;
    w->count.prompts++;
    snap before = take_snap(s->seq);
    kvp_tensor rest = kvp_tensor3(w->rows + adopted * WIDTH, 1, tokens - adopted, WIDTH);
    kvp_status status = kvp_sequence_prefill(s->seq, &rest, NULL, NULL, w->out,
                                             (tokens - adopted) * WIDTH, &err);
    if (status != KVP_OK) {
        check_refusal(w, status, &err, s->seq, &before, k_growth);
        return SIZE_MAX;
    }
    w->count.prefills++;
    if (force) {
        w->computed++;
        verify(w, s, adopted, tokens - adopted, w->out);
    } else {
        maybe_verify(w, s, adopted, tokens - adopted, w->out);
    }
    if (!publish) {
        return adopted;
    }
    size_t published = 0;
    if (kvp_sequence_publish_prefix(s->seq, &prompt, &published, &err) != KVP_OK) {
        record_failure(w, "publishing a prompt", &err);
        return SIZE_MAX;
    }
    if (published != tokens / BT) {
        record_failure(w, "a publish covered the wrong blocks", NULL);
        return SIZE_MAX;
    }
    w->count.publishes++;
    return adopted;
}

static void reset_slot(worker *w, slot *s)
{
    kvp_error err;
    if (kvp_sequence_reset(s->seq, &err) != KVP_OK) {
        record_failure(w, "resetting a sequence", &err);
        return;
    }
    s->shared = 0;
    w->count.resets++;
    if (kvp_sequence_len(s->seq) != 0 || kvp_sequence_held_pages(s->seq) != 0) {
        record_failure(w, "a reset left rows or pages", NULL);
    }
}

/* One random operation on slot `index`. */
static void operate(worker *w, size_t index)
{
    slot *s = &w->slots[index];
    size_t choice = stress_rand(&w->rng) % 100;
    if (choice < 38) {
        (void)grow(w, s, 1, 0);
    } else if (choice < 48) {
        (void)grow(w, s, 2 + stress_rand(&w->rng) % (MAX_PREFILL - 1), 0);
    } else if (choice < 60) {
        size_t to = (index + 1 + stress_rand(&w->rng) % (w->sh->slots - 1)) % w->sh->slots;
        (void)fork_into(w, s, &w->slots[to]);
    } else if (choice < 70) {
        truncate_op(w, s);
    } else if (choice < 84) {
        reset_slot(w, s);
        size_t p = stress_rand(&w->rng) % PREFIXES;
        (void)prompt_op(w, s, p, 1 + stress_rand(&w->rng) % MAX_SUFFIX, 0, 1);
    } else if (choice < 88) {
        /* An adopt needs an empty sequence: refused otherwise, nothing changed. */
        if (kvp_sequence_len(s->seq) == 0) {
            return;
        }
        snap before = take_snap(s->seq);
        memcpy(w->rows, w->sh->prefix[0], sizeof w->sh->prefix[0]);
        kvp_tensor prompt = kvp_tensor3(w->rows, 1, PREFIX, WIDTH);
        size_t adopted = 777;
        kvp_error err;
        kvp_status status = kvp_sequence_adopt_prefix(s->seq, &prompt, &adopted, &err);
        static const kvp_status busy[] = {KVP_INVALID_ARGUMENT, KVP_OK};
        if (status == KVP_OK || adopted != 777) {
            record_failure(w, "an adopt into a non-empty sequence was not refused cleanly", NULL);
        } else {
            check_refusal(w, status, &err, s->seq, &before, busy);
        }
    } else if (choice < 95) {
        reset_slot(w, s);
    } else {
        (void)recreate(w, s);
    }
}

/* ---- phases ------------------------------------------------------------------- */

enum { PHASE_SHARE, PHASE_STORM, PHASE_REVISION };
static const char *const k_phase_names[] = {"share", "storm", "revision"};

static int serial(pthread_barrier_t *barrier)
{
    return pthread_barrier_wait(barrier) == PTHREAD_BARRIER_SERIAL_THREAD;
}

static int anyone_failed(const shared *sh)
{
    for (size_t t = 0; t < sh->threads; t++) {
        if (sh->workers[t].failed) {
            return 1;
        }
    }
    return 0;
}

static void phase_fail(shared *sh, size_t phase, const char *why)
{
    if (!sh->phase_failed) {
        sh->phase_failed = 1;
        snprintf(sh->phase_failure, sizeof sh->phase_failure, "phase %zu (%s): %s", phase,
                 k_phase_names[phase % 3], why);
    }
}

static int read_stats(shared *sh, size_t phase, kvp_pool_stats *stats)
{
    kvp_pool_stats_init(stats);
    kvp_error err;
    if (kvp_pool_check(sh->pool, NULL, NULL, &err) != KVP_OK ||
        kvp_pool_stats_get(sh->pool, stats, &err) != KVP_OK) {
        char text[384];
        kvp_error_format(&err, text, sizeof text);
        char why[448];
        snprintf(why, sizeof why, "audit: %s", text);
        phase_fail(sh, phase, why);
        return 1;
    }
    return 0;
}

/* Grows every slot one step at a time until each is refused (nothing gives pages back). */
static void storm_grow(worker *w)
{
    size_t slots = w->sh->slots;
    size_t remaining = slots;
    memset(w->refused, 0, slots);
    while (remaining > 0 && !w->failed) {
        for (size_t i = 0; i < slots && !w->failed; i++) {
            if (w->refused[i]) {
                continue;
            }
            kvp_status status = grow(w, &w->slots[i], 1, 0);
            if (status == KVP_OK) {
                w->count.storm_steps++;
                continue;
            }
            w->count.storm_exhausted += status == KVP_POOL_EXHAUSTED;
            w->refused[i] = 1;
            remaining--;
        }
    }
}

/* The serial thread's check after a storm: the pool is spent, and evictions happened. */
static void storm_check(shared *sh, size_t phase, size_t exhausted_before)
{
    kvp_pool_stats stats;
    if (read_stats(sh, phase, &stats) != 0) {
        return;
    }
    size_t exhausted = 0;
    for (size_t t = 0; t < sh->threads; t++) {
        exhausted += sh->workers[t].count.storm_exhausted;
    }
    size_t available = stats.free_pages + stats.evictable_pages;
    char why[256];
    if (exhausted == exhausted_before) {
        phase_fail(sh, phase, "no storm step was refused with PoolExhausted");
        return;
    }
    if (stats.evictions - sh->mark.evictions <
            sh->mark.evictable_pages - stats.evictable_pages ||
        stats.evictions == sh->mark.evictions) {
        snprintf(why, sizeof why, "evictable pages %zu -> %zu but evictions %llu -> %llu",
                 sh->mark.evictable_pages, stats.evictable_pages,
                 (unsigned long long)sh->mark.evictions, (unsigned long long)stats.evictions);
        phase_fail(sh, phase, why);
        return;
    }
    for (size_t t = 0; t < sh->threads; t++) {
        for (size_t i = 0; i < sh->slots; i++) {
            const kvp_sequence *seq = sh->workers[t].slots[i].seq;
            size_t len = kvp_sequence_len(seq);
            size_t need = kvp_sequence_pages_for(seq, len + 1);
            if (len < CAPACITY && need <= available) {
                snprintf(why, sizeof why,
                         "thread %zu slot %zu needs %zu pages, %zu free + evictable", t, i, need,
                         available);
                phase_fail(sh, phase, why);
                return;
            }
        }
    }
}

/* Bumps every parameter of every layer: slightly changed values, revision + 1. */
static void bump_revisions(shared *sh, size_t phase)
{
    for (size_t layer = 0; layer < LAYERS; layer++) {
        for (size_t index = 0; index < KVP_PARAM_COUNT; index++) {
            kvp_param *param = kvp_model_param_mut(sh->model, layer, index);
            size_t n = kvp_param_rows(param) * kvp_param_cols(param);
            double *values = n == 0 ? NULL : malloc(n * sizeof *values);
            if (values == NULL) {
                free(values);
                phase_fail(sh, phase, "no parameter to update, or out of memory");
                return;
            }
            memcpy(values, kvp_param_values(param), n * sizeof *values);
            for (size_t i = 0; i < n; i++) {
                values[i] *= 1.0 - 1.0 / 64.0;
            }
            values[(sh->bumps + layer + index) % n] += 0.125;
            kvp_error err;
            kvp_status status = kvp_param_update(param, values, &err);
            free(values);
            if (status != KVP_OK) {
                phase_fail(sh, phase, "kvp_param_update failed");
                return;
            }
        }
    }
    sh->bumps++;
}

/* The phase's own prompt of thread w in slot `s` (prefix t % P); must succeed. */
static void phase_prompt(worker *w, slot *s, size_t p)
{
    size_t suffix = 1 + stress_rand(&w->rng) % MAX_SUFFIX;
    if (!w->failed && prompt_op(w, s, p, suffix, 1, 1) == SIZE_MAX) {
        record_failure(w, "a phase's prompt, which the pool must fit, was refused", NULL);
    }
}

static void phase_share(worker *w, size_t phase)
{
    shared *sh = w->sh;
    phase_prompt(w, &w->slots[0], w->id % sh->publishers);
    if (serial(&sh->barrier)) {
        (void)read_stats(sh, phase, &sh->mark);
    }
    pthread_barrier_wait(&sh->barrier); /* every prefix is published and held */
    if (!w->failed) {
        size_t adopted = prompt_op(w, &w->slots[1], (w->id + 1) % sh->publishers,
                                   1 + stress_rand(&w->rng) % MAX_SUFFIX, 1, 1);
        if (adopted != PREFIX_BLOCKS * BT) {
            record_failure(w, "a share phase's adopt did not give the held prefix", NULL);
        } else {
            w->count.phase_adopts++;
        }
    }
    if (!w->failed && fork_into(w, &w->slots[1], &w->slots[2]) == 0) {
        /* One input for both: each copies its shared partial page, both match the reference. */
        stress_fill(w->rows, WIDTH, &w->rng);
        double row[WIDTH];
        double outs[2][WIDTH];
        memcpy(row, w->rows, sizeof row);
        for (size_t k = 0; k < 2 && !w->failed; k++) {
            slot *s = &w->slots[1 + k];
            size_t len = kvp_sequence_len(s->seq);
            kvp_tensor input = kvp_tensor3(row, 1, 1, WIDTH);
            kvp_error err;
            if (kvp_sequence_step(s->seq, &input, NULL, NULL, outs[k], WIDTH, &err) != KVP_OK) {
                record_failure(w, "a share phase's step of a fork", &err);
                break;
            }
            memcpy(s->history + len * WIDTH, row, sizeof row);
            w->count.steps++;
            verify(w, s, len, 1, outs[k]);
        }
        if (!w->failed && memcmp(outs[0], outs[1], sizeof outs[0]) != 0) {
            record_failure(w, "a fork and its parent gave different outputs", NULL);
        }
    }
    if (serial(&sh->barrier) && !anyone_failed(sh)) {
        kvp_pool_stats stats;
        if (read_stats(sh, phase, &stats) == 0 &&
            stats.prefix_hits - sh->mark.prefix_hits < sh->threads * PREFIX_BLOCKS * LAYERS) {
            phase_fail(sh, phase, "prefix_hits grew less than every adopter's pages");
        }
    }
}

static void phase_storm(worker *w, size_t phase)
{
    shared *sh = w->sh;
    phase_prompt(w, &w->slots[0], w->id % sh->publishers);
    pthread_barrier_wait(&sh->barrier); /* every prefix is published */
    reset_slot(w, &w->slots[0]);
    if (serial(&sh->barrier)) {
        /* No table names a page now: every cached page is evictable. */
        if (read_stats(sh, phase, &sh->mark) == 0 && !anyone_failed(sh) &&
            (sh->mark.held_pages != 0 || sh->mark.evictable_pages != sh->mark.cached_pages ||
             sh->mark.evictable_pages < sh->publishers * PREFIX_BLOCKS * LAYERS)) {
            phase_fail(sh, phase, "after every reset, pages are held or too few evictable");
        }
        size_t exhausted = 0;
        for (size_t t = 0; t < sh->threads; t++) {
            exhausted += sh->workers[t].count.storm_exhausted;
        }
        sh->storm_exhausted_mark = exhausted;
    }
    pthread_barrier_wait(&sh->barrier); /* marked: storm */
    if (!w->failed) {
        storm_grow(w);
    }
    if (serial(&sh->barrier) && !anyone_failed(sh)) {
        storm_check(sh, phase, sh->storm_exhausted_mark);
    }
}

static void phase_revision(worker *w, size_t phase)
{
    shared *sh = w->sh;
    phase_prompt(w, &w->slots[0], w->id % sh->publishers);
    if (serial(&sh->barrier)) {
        /* Every other thread waits at the next barrier: no computation overlaps the update. */
        (void)read_stats(sh, phase, &sh->mark);
        bump_revisions(sh, phase);
    }
    pthread_barrier_wait(&sh->barrier); /* bumped */
    kvp_error err;
    if (!w->failed) {
        /* The old sequence is stale: refused, nothing changed. */
        slot *old = &w->slots[0];
        snap before = take_snap(old->seq);
        stress_fill(w->rows, WIDTH, &w->rng);
        kvp_tensor input = kvp_tensor3(w->rows, 1, 1, WIDTH);
        kvp_status status = kvp_sequence_step(old->seq, &input, NULL, NULL, w->out, WIDTH, &err);
        static const kvp_status stale[] = {KVP_CACHE_LAYER_REVISION_MISMATCH, KVP_OK};
        if (status == KVP_OK) {
            record_failure(w, "a step with a stale binding succeeded", NULL);
        } else {
            check_refusal(w, status, &err, old->seq, &before, stale);
            w->count.stale++;
        }
    }
    for (size_t i = 1; i < sh->slots && !w->failed; i++) {
        (void)recreate(w, &w->slots[i]);
    }
    if (!w->failed) {
        kvp_sequence_destroy(w->ref, NULL);
        w->ref = NULL;
        if (kvp_sequence_create(sh->model, sh->ref_pool, 1, CAPACITY, &w->ref, &err) != KVP_OK) {
            record_failure(w, "recreating the reference", &err);
        }
    }
    if (!w->failed) {
        /* The old prefix's pages are held by its publisher and indexed: still no hit.
         * Nothing is published under the new revision until every thread has looked. */
        size_t adopted = prompt_op(w, &w->slots[1], (w->id + 1) % sh->publishers,
                                   1 + stress_rand(&w->rng) % MAX_SUFFIX, 1, 0);
        if (adopted != 0) {
            record_failure(w, "a prefix computed under the old revision was adopted", NULL);
        }
    }
    if (serial(&sh->barrier) && !anyone_failed(sh)) {
        kvp_pool_stats stats;
        if (read_stats(sh, phase, &stats) == 0 &&
            (stats.prefix_hits != sh->mark.prefix_hits ||
             stats.prefix_misses - sh->mark.prefix_misses < sh->threads)) {
            phase_fail(sh, phase, "after the bump an old block was hit, or lookups did not miss");
        }
    }
    if (!w->failed) {
        (void)recreate(w, &w->slots[0]);
    }
}

static void phase(worker *w, size_t index)
{
    shared *sh = w->sh;
    pthread_barrier_wait(&sh->barrier); /* every thread has stopped its random operations */
    for (size_t i = 0; i < sh->slots && !w->failed; i++) {
        reset_slot(w, &w->slots[i]);
    }
    pthread_barrier_wait(&sh->barrier); /* every slot is empty */
    switch (index % 3) {
    case PHASE_SHARE:
        phase_share(w, index);
        break;
    case PHASE_STORM:
        phase_storm(w, index);
        break;
    default:
        phase_revision(w, index);
        break;
    }
    if (serial(&sh->barrier)) {
        sh->phases_checked[index % 3]++;
    }
    pthread_barrier_wait(&sh->barrier); /* back to random operations */
}

/* Phase k comes before operation (k + 1) * ops / (phases + 1) of every thread. */
static size_t phase_point(const shared *sh, size_t k)
{
    return (k + 1) * sh->ops / (sh->phases + 1);
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    shared *sh = w->sh;
    size_t next = 0;
    for (size_t op = 0; op <= sh->ops; op++) {
        /* Every thread meets every phase, failed or not, or the others would wait forever. */
        while (next < sh->phases && phase_point(sh, next) == op) {
            phase(w, next++);
        }
        if (op == sh->ops || w->failed) {
            continue;
        }
        operate(w, (size_t)(stress_rand(&w->rng) % sh->slots));
        if (sh->audit_every != 0 && (op + 1) % sh->audit_every == 0) {
            kvp_error err;
            w->count.audits++;
            if (kvp_pool_check(sh->pool, NULL, NULL, &err) != KVP_OK) {
                record_failure(w, "pool audit while other threads work", &err);
            }
        }
    }
    return NULL;
}

/* ---- setup and the end ------------------------------------------------------- */

static void free_worker(worker *w, const shared *sh)
{
    for (size_t i = 0; w->slots != NULL && i < sh->slots; i++) {
        if (w->slots[i].seq != NULL) {
            kvp_sequence_destroy(w->slots[i].seq, NULL);
        }
        free(w->slots[i].history);
    }
    if (w->ref != NULL) {
        kvp_sequence_destroy(w->ref, NULL);
    }
    free(w->slots);
    free(w->refused);
    memset(w, 0, sizeof *w);
}

static int start_workers(worker *workers, shared *sh)
{
    for (size_t t = 0; t < sh->threads; t++) {
        worker *w = &workers[t];
        w->id = t;
        w->sh = sh;
        w->rng = sh->seed * 1000003u + t;
        w->slots = calloc(sh->slots, sizeof *w->slots);
        w->refused = calloc(sh->slots, 1);
        if (w->slots == NULL || w->refused == NULL) {
            fprintf(stderr, PROGRAM ": out of memory\n");
            return 1;
        }
        kvp_error err;
        for (size_t i = 0; i < sh->slots; i++) {
            w->slots[i].history = calloc(CAPACITY * WIDTH, sizeof(double));
            if (w->slots[i].history == NULL) {
                fprintf(stderr, PROGRAM ": out of memory\n");
                return 1;
            }
            if (kvp_sequence_create(sh->model, sh->pool, 1, CAPACITY, &w->slots[i].seq, &err) !=
                KVP_OK) {
                return stress_fail(PROGRAM, "creating a sequence", &err);
            }
        }
        if (kvp_sequence_create(sh->model, sh->ref_pool, 1, CAPACITY, &w->ref, &err) != KVP_OK) {
            return stress_fail(PROGRAM, "creating a reference sequence", &err);
        }
    }
    /* The phases must fit; the storms must be able to outgrow the pool. */
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvp_error err;
    if (kvp_pool_stats_get(sh->pool, &stats, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "reading stats", &err);
    }
    size_t most = sh->threads * sh->slots *
                  kvp_sequence_pages_for(workers[0].slots[0].seq, CAPACITY);
    if (stats.total_pages < sh->threads * PHASE_PAGES || most <= stats.total_pages) {
        fprintf(stderr,
                PROGRAM ": the pool has %zu pages; the phases need %zu and the slots must be "
                        "able to hold more (%zu) (use --pages)\n",
                stats.total_pages, sh->threads * (size_t)PHASE_PAGES, most);
        return 2;
    }
    for (size_t t = 0; t < sh->threads; t++) {
        if (pthread_create(&workers[t].thread, NULL, worker_main, &workers[t]) != 0) {
            fprintf(stderr, PROGRAM ": cannot start thread %zu\n", t);
            exit(1); /* the started threads would wait at the first phase for this one */
        }
    }
    return 0;
}

/* Whole: nothing held, promised or attached, free + evictable == total, acquires == releases. */
static int pool_whole(kvp_pool *pool, const char *which, kvp_pool_stats *stats)
{
    kvp_error err;
    kvp_pool_stats_init(stats);
    if (kvp_pool_check(pool, NULL, NULL, &err) != KVP_OK) {
        return stress_fail(PROGRAM, which, &err);
    }
    if (kvp_pool_stats_get(pool, stats, &err) != KVP_OK) {
        return stress_fail(PROGRAM, which, &err);
    }
    if (stats->held_pages != 0 || stats->free_pages + stats->evictable_pages != stats->total_pages ||
        stats->evictable_pages != stats->cached_pages || stats->acquires != stats->releases ||
        stats->promised_pages != 0 || stats->attached_caches != 0 ||
        stats->tentative_pages != 0) {
        fprintf(stderr,
                PROGRAM ": %s is not whole: %zu held, %zu free + %zu evictable of %zu, %zu "
                        "cached, %llu acquires, %llu releases, %zu promised, %zu attached\n",
                which, stats->held_pages, stats->free_pages, stats->evictable_pages,
                stats->total_pages, stats->cached_pages, (unsigned long long)stats->acquires,
                (unsigned long long)stats->releases, stats->promised_pages,
                stats->attached_caches);
        return 1;
    }
    return 0;
}

static int finish(worker *workers, shared *sh, double seconds)
{
    int failed = 0;
    counters total;
    memset(&total, 0, sizeof total);
    for (size_t t = 0; t < sh->threads; t++) {
        worker *w = &workers[t];
        if (w->failed) {
            fprintf(stderr, PROGRAM ": %s\n", w->failure);
            failed = 1;
        }
        size_t *sum = (size_t *)(void *)&total;
        const size_t *part = (const size_t *)(const void *)&w->count;
        for (size_t i = 0; i < sizeof total / sizeof(size_t); i++) {
            sum[i] += part[i];
        }
        free_worker(w, sh);
    }
    if (sh->phase_failed) {
        fprintf(stderr, PROGRAM ": %s\n", sh->phase_failure);
        failed = 1;
    }
    size_t checked = sh->phases_checked[0] + sh->phases_checked[1] + sh->phases_checked[2];
    if (checked != sh->phases) {
        fprintf(stderr, PROGRAM ": %zu of %zu phases ran\n", checked, sh->phases);
        failed = 1;
    }
    if (!failed && (total.phase_adopts != sh->phases_checked[PHASE_SHARE] * sh->threads ||
                    total.verified_shared == 0)) {
        fprintf(stderr, PROGRAM ": %zu share-phase adopts of %zu, %zu verified shared outputs\n",
                total.phase_adopts, sh->phases_checked[PHASE_SHARE] * sh->threads,
                total.verified_shared);
        failed = 1;
    }
    kvp_pool_stats stats;
    kvp_pool_stats ref_stats;
    failed |= pool_whole(sh->pool, "the pool", &stats);
    failed |= pool_whole(sh->ref_pool, "the reference pool", &ref_stats);
    if (sh->window != 0) {
        printf("%s: layer 1 window %zu, sinks %zu: %llu pages released by the window, %zu "
               "truncates into released blocks refused\n",
               PROGRAM, sh->window, sh->sinks, (unsigned long long)stats.window_releases,
               total.released_refusals);
        if (stats.window_releases == 0) {
            fprintf(stderr, PROGRAM ": the window released no page\n");
            failed = 1;
        }
    }
    printf("%s: %zu threads x %zu ops: %zu steps, %zu prefills, %zu forks, %zu truncates, "
           "%zu prompts (%zu tokens adopted, %zu published), %zu resets, %zu recreates; "
           "refused %zu exhausted, %zu full, %zu misuse, %zu stale; %zu audits; "
           "%zu outputs verified (%zu shared); phases %zu share, %zu storm (%zu steps, "
           "%zu exhausted), %zu revision; pool: %llu hits, %llu misses, %llu evictions, "
           "%llu cow copies, %llu acquires = releases, %zu free + %zu evictable of %zu; "
           "%.2f s: %s\n",
           PROGRAM, sh->threads, sh->ops, total.steps, total.prefills, total.forks,
           total.truncates, total.prompts, total.adopted_tokens, total.publishes, total.resets,
           total.recreates, total.exhausted, total.full, total.misuse, total.stale, total.audits,
           total.verified, total.verified_shared, sh->phases_checked[PHASE_SHARE],
           sh->phases_checked[PHASE_STORM], total.storm_steps, total.storm_exhausted,
           sh->phases_checked[PHASE_REVISION], (unsigned long long)stats.prefix_hits,
           (unsigned long long)stats.prefix_misses, (unsigned long long)stats.evictions,
           (unsigned long long)stats.cow_copies, (unsigned long long)stats.acquires,
           stats.free_pages, stats.evictable_pages, stats.total_pages, seconds,
           failed ? "FAILED" : "ok");
    return failed;
}

static int make_pool(size_t pages, kvp_pool **out)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BT;
    config.heads = HEADS;
    config.head_width = HEAD_WIDTH;
    config.budget_bytes = pages * 2 * HEADS * BT * HEAD_WIDTH * sizeof(double);
    config.dtype = KVP_F64;
    kvp_error err;
    if (kvp_pool_create(&config, out, &err) != KVP_OK) {
        return stress_fail(PROGRAM, "creating a pool", &err);
    }
    return 0;
}

/*
 * Every layer full (window 0), or layer 1 sliding with (W, S): front
 * truncation's null entries then run through every operation and phase.
 */
static kvp_status make_model(shared *sh, kvp_error *err)
{
    if (sh->window == 0) {
        return kvp_model_create_random(LAYERS, WIDTH, HEADS, CAPACITY, 10000.0, sh->seed,
                                       &sh->model, err);
    }
    kvp_layer *made[LAYERS] = {NULL};
    const kvp_layer *layers[LAYERS];
    kvp_status status = KVP_OK;
    for (size_t l = 0; l < LAYERS && status == KVP_OK; l++) {
        status = kvp_layer_create_random(WIDTH, HEADS, CAPACITY, 10000.0, sh->seed * 31u + l,
                                         &made[l], err);
        if (status == KVP_OK && l == 1) {
            status = kvp_layer_set_window(made[l], sh->window, sh->sinks, err);
        }
        layers[l] = made[l];
    }
    if (status == KVP_OK) {
        status = kvp_model_create(layers, LAYERS, &sh->model, err);
    }
    for (size_t l = 0; l < LAYERS; l++) {
        if (made[l] != NULL) {
            (void)kvp_layer_destroy(made[l], NULL);
        }
    }
    return status;
}

/*
 * The counts, and the window: the share phase's adopter must find both full
 * blocks of a prefix that its publisher (at most PREFIX + MAX_SUFFIX = 12
 * tokens) still holds: block 0 stays while W >= 9 or a sink covers it,
 * block 1 while W >= 5.
 */
static int options_ok(size_t threads, size_t slots, size_t phases, size_t window, size_t sinks)
{
    if (threads == 0 || slots < 3 || phases == 0) {
        fprintf(stderr, PROGRAM ": --threads and --phases must be positive, --sequences >= 3\n");
        return 0;
    }
    if (window > CAPACITY || (window != 0 && window < (sinks != 0 ? 5u : 9u)) ||
        sinks > CAPACITY || (sinks != 0 && window == 0)) {
        fprintf(stderr, PROGRAM ": --window %zu --sinks %zu: W 0, or 9 to %d (5 to %d with "
                        "sinks), S at most %d and only with a window\n",
                window, sinks, CAPACITY, CAPACITY, CAPACITY);
        return 0;
    }
    return 1;
}

int main(int argc, char **argv)
{
    size_t threads = 2 * stress_cores();
    size_t slots = 4;
    size_t ops = 4000;
    size_t audit_every = 100;
    size_t verify_every = 8;
    size_t pages = 0;
    size_t phases = 6;
    size_t seed = 1;
    size_t window = 0;
    size_t sinks = 0;
    stress_option options[] = {
        {"--threads", &threads, "worker threads"},
        {"--sequences", &slots, "sequence slots per thread (at least 3)"},
        {"--ops", &ops, "random operations per thread"},
        {"--audit-every", &audit_every, "operations between audits, per thread"},
        {"--verify-every", &verify_every, "computations between reference checks, per thread"},
        {"--pages", &pages, "pages in the shared pool (0: 16 per thread)"},
        {"--phases", &phases, "barrier phases, by turns share, storm, revision bump"},
        {"--seed", &seed, "seed of every random choice"},
        {"--window", &window,
         "layer 1's sliding window W (0: full; else 9 to 32, or 5 to 32 with --sinks)"},
        {"--sinks", &sinks, "layer 1's sink tokens S (needs --window)"},
    };
    int parsed = stress_parse(argc, argv,
                              "Threads fork, truncate, adopt and publish shared prefixes, step, "
                              "reset and bump parameter revisions over one small pool; every "
                              "refusal changes nothing, outputs match fresh sequences bit for "
                              "bit, and the pool ends whole.",
                              options, sizeof options / sizeof options[0]);
    if (parsed != 0) {
        return parsed == 1 ? 0 : 2;
    }
    if (!options_ok(threads, slots, phases, window, sinks)) {
        return 2;
    }
    shared sh;
    memset(&sh, 0, sizeof sh);
    sh.threads = threads;
    sh.slots = slots;
    sh.ops = ops;
    sh.audit_every = audit_every;
    sh.verify_every = verify_every;
    sh.phases = phases;
    sh.seed = seed;
    sh.window = window;
    sh.sinks = sinks;
    sh.publishers = threads < PREFIXES ? threads : PREFIXES;
    uint64_t rng = seed * 7919u + 17u;
    for (size_t p = 0; p < PREFIXES; p++) {
        stress_fill(sh.prefix[p], PREFIX * WIDTH, &rng);
    }
    if (pages == 0) {
        pages = 16 * threads;
    }
    int failed = make_pool(pages, &sh.pool);
    failed = failed || make_pool(threads * (CAPACITY / BT) * LAYERS + 8, &sh.ref_pool);
    kvp_error err;
    if (!failed && make_model(&sh, &err) != KVP_OK) {
        failed = stress_fail(PROGRAM, "creating the model", &err);
    }
    worker *workers = failed ? NULL : calloc(threads, sizeof *workers);
    if (!failed && (workers == NULL ||
                    pthread_barrier_init(&sh.barrier, NULL, (unsigned)threads) != 0)) {
        fprintf(stderr, PROGRAM ": out of memory\n");
        return 1;
    }
    if (!failed) {
        sh.workers = workers;
        double start = stress_seconds();
        failed = start_workers(workers, &sh);
        if (failed) {
            for (size_t t = 0; t < threads; t++) {
                free_worker(&workers[t], &sh);
            }
        } else {
            for (size_t t = 0; t < threads; t++) {
                pthread_join(workers[t].thread, NULL);
            }
            failed = finish(workers, &sh, stress_seconds() - start);
        }
        pthread_barrier_destroy(&sh.barrier);
    }
    free(workers);
    if (sh.model != NULL) {
        kvp_model_destroy(sh.model, NULL);
    }
    if (sh.ref_pool != NULL && kvp_pool_destroy(sh.ref_pool, &err) != KVP_OK) {
        failed |= stress_fail(PROGRAM, "destroying the reference pool", &err);
    }
    if (sh.pool != NULL && kvp_pool_destroy(sh.pool, &err) != KVP_OK) {
        failed |= stress_fail(PROGRAM, "destroying the pool", &err);
    }
    return failed;
}
