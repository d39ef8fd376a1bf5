/*
 * decoder_internal.h: the decoder's thread-start fault injector, its
 * assist hooks for tests, and a way for benchmarks to run code on its
 * threads.
 *
 * Owns: the default thread count, the one door through which the decoder
 * starts worker threads, and a
 * fault injector of the same kind as the allocation one (pager/alloc.h):
 * kvpi_thread_fault_arm(k) makes the kth thread start from now (k >= 1) fail
 * once, as if pthread_create had returned EAGAIN; 0 disarms. Thread starts
 * have their own counter, so an allocation sweep never fails one and a
 * thread sweep never fails an allocation.
 *
 * Global state: the injector's counters, in atomics (like alloc.c's).
 * Callers: decoder.c; tests reach the injector through this header.
 */
#ifndef KVPAGER_SERVE_DECODER_INTERNAL_H
#define KVPAGER_SERVE_DECODER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/sequence.h"
#include "attention/parallel.h"

/* The thread count for threads == 0: `cores` (sysconf's answer) within [1, 4096]. */
size_t kvpi_decoder_default_threads(long cores);

void kvpi_thread_fault_arm(uint64_t nth);
/* Thread starts attempted since the last arm. */
uint64_t kvpi_thread_fault_calls(void);
/* 1 once the armed fault has fired. */
int kvpi_thread_fault_fired(void);

/*
 * A job that is a function: fn(ctx, par) runs as the one job of a decoder
 * step, and par is the decoder's assist executor (NULL with one thread), so
 * whatever fn runs on par is helped by the decoder's other threads exactly
 * as a sequence's attention is. DECODER_BUSY (nothing run) while a step
 * runs. For benchmarks (kvpager bench times kvpi_gather_attend_on with it)
 * and tests.
 */
typedef void (*kvpi_decoder_solo_fn)(void *ctx, const kvpi_parallel *par);
kvp_status kvpi_decoder_run(kvp_decoder *decoder, kvpi_decoder_solo_fn fn, void *ctx,
                            kvp_error *err);

/*
 * The decoder's one step slot, taken ahead: kvpi_decoder_reserve takes it
 * (DECODER_BUSY, nothing taken, while a step runs or it is reserved: every
 * kvp_decoder_step is refused from then on), and kvpi_decoder_step_reserved
 * runs `count` jobs in it as kvp_decoder_step would (no next_input; the jobs
 * are the caller's, valid by construction: not checked) and gives it back,
 * count 0 too. For a caller that must know the decoder will run its batch
 * before it changes anything (the scheduler's prefill batch).
 */
kvp_status kvpi_decoder_reserve(kvp_decoder *decoder, kvp_error *err);
void kvpi_decoder_step_reserved(kvp_decoder *decoder, kvp_decode_job *jobs, size_t count);

/*
 * Test hooks. hold_tasks(d, n): the next n tasks posted for assist while the
 * step has fewer jobs than threads are held: their poster runs no part until
 * another thread has claimed one, so the assist happens under any
 * scheduling (some thread has no job and will come to help). 0 releases.
 * assisted_parts: parts run so far by a thread other than their poster.
 */
void kvpi_decoder_hold_tasks(kvp_decoder *decoder, size_t tasks);
uint64_t kvpi_decoder_assisted_parts(kvp_decoder *decoder);

#endif /* KVPAGER_SERVE_DECODER_INTERNAL_H */
