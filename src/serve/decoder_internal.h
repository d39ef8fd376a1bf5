/*
 * decoder_internal.h: the decoder's thread-start fault injector.
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

/* The thread count for threads == 0: `cores` (sysconf's answer) within [1, 4096]. */
size_t kvpi_decoder_default_threads(long cores);

void kvpi_thread_fault_arm(uint64_t nth);
/* Thread starts attempted since the last arm. */
uint64_t kvpi_thread_fault_calls(void);
/* 1 once the armed fault has fired. */
int kvpi_thread_fault_fired(void);

#endif /* KVPAGER_SERVE_DECODER_INTERNAL_H */
