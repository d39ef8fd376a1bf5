/*
 * alloc.h: the one door between the kvpager program and the heap.
 *
 * Owns: every heap allocation the program's own code makes (the library has
 * its door in src/pager/alloc.h), and a fault injector that makes the Nth of
 * them fail, so a test can sweep every allocation failure of a command (see
 * tests/cli/sweep_cli.c). The program reads no file through stdio buffers it
 * does not control: traces are read into memory through this door.
 *
 * Invariants: a call that returns NULL has allocated nothing; a failed
 * kvp_cli_realloc leaves the old block untouched; n * size overflow is a
 * failure, never a short block.
 * Global state (documented): the injector's counters. The program allocates
 * on its main thread only, so they are plain statics.
 * Callers: src/cli only, and the CLI tests.
 */
#ifndef KVPAGER_CLI_ALLOC_H
#define KVPAGER_CLI_ALLOC_H

#include <stddef.h>
#include <stdint.h>

/* Uninitialized memory for n * size bytes, or NULL. */
void *kvp_cli_alloc(size_t n, size_t size);
/* Zeroed memory for n * size bytes, or NULL. */
void *kvp_cli_calloc(size_t n, size_t size);
/* `ptr` grown or shrunk to n * size bytes, or NULL with `ptr` untouched. */
void *kvp_cli_realloc(void *ptr, size_t n, size_t size);
void kvp_cli_free(void *ptr);

/*
 * Fault injection: kvp_cli_fault_arm(n) makes the nth allocation call from
 * now (n >= 1) fail, once; 0 disarms. kvp_cli_fault_calls counts calls since
 * the last arm; kvp_cli_fault_fired says whether the armed fault fired.
 */
void kvp_cli_fault_arm(uint64_t nth);
uint64_t kvp_cli_fault_calls(void);
int kvp_cli_fault_fired(void);

#endif /* KVPAGER_CLI_ALLOC_H */
