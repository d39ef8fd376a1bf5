/*
 * fuzz_common.h: what the two halves of the kvp_fuzz_api target share
 * (fuzz_api.c and its fuzz_api_*.c files behind fuzz_api.h, the world and
 * its shadow; fuzz_paged.c, the typed pool, its
 * write paths and kvp_paged_attention). Internal to tests/fuzz; nothing else
 * includes it.
 *
 * fuzz_api.c owns the reader, the failure report (the operation's index and
 * name), the status tally and the world's decoder; fuzz_paged.c owns its
 * own sub-world (fz_paged_*), set up empty and torn down with each input.
 */
#ifndef KVP_FUZZ_COMMON_H
#define KVP_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/kvpager.h"

typedef struct reader {
    const uint8_t *data;
    size_t size;
    size_t at;
} reader;

/* ---- fuzz_api.c ---- */

/* Prints "MISMATCH at op N (name): ..." and aborts. */
void fz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#define CHECK(cond, ...)                                                                    \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fz_fail(__VA_ARGS__);                                                           \
        }                                                                                   \
    } while (0)

/* The next input byte (0 past the end). */
uint8_t fz_rd(reader *r);
/* Uniform in [-1, 1) from a SplitMix64 state. */
double fz_unit(uint64_t *state);
/* Tallies the status (KVP_FUZZ_STATS) and fails unless got == want. */
void fz_check_status(kvp_status got, kvp_status want, const kvp_error *err);
/* Names the running operation (a string literal: the tally keys by pointer). */
void fz_set_op(const char *name);
/* 1 while the checks' own calls run: they are not tallied as the operation's. */
void fz_set_auditing(int on);
/* The world's decoder (1 or 2 threads). */
kvp_decoder *fz_decoder(void);

/* ---- fuzz_paged.c ---- */

void fz_paged_setup(void);
void fz_paged_teardown(void);
/* One operation on the typed sub-world: its first byte selects which. */
void fz_paged_op(reader *r);

#endif /* KVP_FUZZ_COMMON_H */
