/*
 * stress_common.h: what the stress programs share.
 *
 * Owns: "--name value" option tables, SplitMix64 streams, the sequence
 * digest used for "nothing changed" checks, failure reporting, a clock, and
 * the process's resident set.
 * Stress programs are first-party and may use internal headers.
 */
#ifndef KVPAGER_STRESS_COMMON_H
#define KVPAGER_STRESS_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "kvpager/kvpager.h"

typedef struct stress_option {
    const char *name;   /* "--threads" */
    size_t *value;
    const char *help;
} stress_option;

/*
 * Parses argv against `options`. "--help" prints `summary` and the options
 * and returns 1; a bad option prints why and returns 2; success returns 0.
 */
int stress_parse(int argc, char **argv, const char *summary, stress_option *options,
                 size_t count);

uint64_t stress_rand(uint64_t *state);
/* Uniform in [-1, 1). */
void stress_fill(double *values, size_t n, uint64_t *state);

/* len and every layer's kvp_cache_digest, folded into one value. */
uint64_t stress_sequence_digest(const kvp_sequence *sequence);

/* Prints "<program>: <what>: <error>" to stderr and returns 1. */
int stress_fail(const char *program, const char *what, const kvp_error *err);

double stress_seconds(void);

/*
 * The resident set of /proc/self/statm, in bytes, into *out: 0, or 1 after
 * printing "<program>: cannot read /proc/self/statm".
 */
int stress_rss_bytes(const char *program, size_t *out);

/* Online cores, at least 1. */
size_t stress_cores(void);

#endif /* KVPAGER_STRESS_COMMON_H */
