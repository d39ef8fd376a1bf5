/*
 * cli.h: what the kvpager program's commands share.
 *
 * Owns: the command entry points (one file each: demo.c, ...) and the small
 * helpers every command uses: reporting a library error, parsing numbers and
 * byte sizes, and knowing whether stderr is a terminal (progress displays
 * appear only then). The program uses only the public API, plus jemalloc's
 * counters where a command proves zero heap traffic.
 * Exit codes: 0 success, 1 evidence or audit failed, 2 usage or library error.
 */
#ifndef KVPAGER_CLI_H
#define KVPAGER_CLI_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvpager/kvpager.h"

enum { KVP_CLI_OK = 0, KVP_CLI_FAILED = 1, KVP_CLI_USAGE = 2 };

int kvp_cli_demo(int argc, char **argv);
int kvp_cli_simulate(int argc, char **argv);

/* Prints "kvpager <command>: <context>: <rendered error>" to stderr. */
void kvp_cli_report(const char *command, const char *context, const kvp_error *err);

/* Parses a whole unsigned decimal number; 0 on success, -1 otherwise. */
int kvp_cli_parse_size(const char *text, size_t *out);

/* Parses a byte size: a number with an optional unit B, KiB, MiB, GiB, KB, MB, GB. */
int kvp_cli_parse_bytes(const char *text, size_t *out);

/* Parses a whole finite decimal number; 0 on success, -1 otherwise. */
int kvp_cli_parse_double(const char *text, double *out);

/* "32.0 MiB" style rendering of a byte count into buf. */
const char *kvp_cli_format_bytes(size_t bytes, char *buf, size_t size);

/* jemalloc's count of bytes this thread allocated plus deallocated. */
uint64_t kvp_cli_heap_traffic(void);

#endif /* KVPAGER_CLI_H */
