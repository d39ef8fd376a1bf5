/*
 * cli.h: what the kvpager program's commands share.
 *
 * Owns: the command entry points (demo.c; simulate.c, behind simulate.h; bench.c; the
 * dispatcher kvp_cli_main in dispatch.c) and the small helpers every command
 * uses: reporting a library error, parsing numbers and byte sizes strictly,
 * overflow-checked size arithmetic, and the machine's physical memory.
 * The program uses the public API, plus jemalloc's counters where a command
 * proves zero heap traffic. Its own heap allocations go through alloc.h.
 * Input rules: every command parses its whole command line, then validates
 * every value, then opens its outputs, and only then runs; a bad input gets
 * exactly one line on stderr naming the flag and the value, and exit 2.
 * Exit codes: 0 success, 1 evidence or audit failed, 2 usage or library error.
 * Callers: main.c and the CLI tests (through the static kvpager_cli library).
 */
#ifndef KVPAGER_CLI_H
#define KVPAGER_CLI_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvpager/kvpager.h"

enum { KVP_CLI_OK = 0, KVP_CLI_FAILED = 1, KVP_CLI_USAGE = 2 };

/* The whole program: argv[0] is the program, argv[1] the command. */
int kvp_cli_main(int argc, char **argv);
/* The commands: argv[0] is the command's name. */
int kvp_cli_demo(int argc, char **argv);
int kvp_cli_simulate(int argc, char **argv);
int kvp_cli_bench(int argc, char **argv);

/* The first input error of a command line, kept so parsing can go on (a later --help wins). */
typedef struct kvp_cli_problems {
    char line[512];
    int found;
} kvp_cli_problems;

/* Records the first problem; later ones are dropped. */
void kvp_cli_problem(kvp_cli_problems *p, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

/*
 * argv[*i] should name one of the value-taking flags names[0..count), as
 * "--flag value" or "--flag=value". On success returns its index, stores the
 * value in values[index] and advances *i past it. Otherwise records the problem (an unknown option or a stray
 * argument, naming `command`'s --help; a missing value; a flag given twice)
 * and returns -1.
 */
int kvp_cli_take_flag(int argc, char **argv, int *i, const char *command,
                      const char *const *names, size_t count, const char **values,
                      kvp_cli_problems *p);

/* Prints "kvpager <command>: <context>: <rendered error> (<StatusName>)" to stderr. */
void kvp_cli_report(const char *command, const char *context, const kvp_error *err);

/* Prints the one-line "out of memory" report for an allocation of the program's own. */
void kvp_cli_report_oom(const char *command, const char *what, size_t bytes);

/* Parses a whole unsigned decimal number (digits only); 0 on success, -1 otherwise. */
int kvp_cli_parse_size(const char *text, size_t *out);

/*
 * Parses a byte size: a decimal number with an optional unit B, KiB, MiB,
 * GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000). A fraction is
 * accepted only when the byte count it names is whole ("1.5KiB" = 1536;
 * "1.5" and "1.1KiB" are refused). 0 on success, -1 otherwise.
 */
int kvp_cli_parse_bytes(const char *text, size_t *out);

/* Parses a finite decimal number (no hex, inf, nan or blanks); 0 on success, -1 otherwise. */
int kvp_cli_parse_double(const char *text, double *out);

/* "32.0 MiB" style rendering of a byte count into buf. */
const char *kvp_cli_format_bytes(size_t bytes, char *buf, size_t size);

/* *out = a * b, or -1 when it overflows size_t (then *out is SIZE_MAX). */
int kvp_cli_mul(size_t a, size_t b, size_t *out);
/* *out = a + b, or -1 when it overflows size_t (then *out is SIZE_MAX). */
int kvp_cli_add(size_t a, size_t b, size_t *out);

/* Physical memory in bytes (sysconf pages times page size); 0 when unknown. */
size_t kvp_cli_physical_memory(void);

/*
 * Whether paths `a` and `b` name the same file, so a command can refuse an
 * output that would overwrite one of its inputs: the same device and inode
 * when both exist (symbolic links followed), else the same path once made
 * absolute with links, `.` and `..` resolved (a file not made yet: its
 * directory resolved). Reads the file system; allocates nothing.
 */
int kvp_cli_same_file(const char *a, const char *b);

/* jemalloc's count of bytes this thread allocated plus deallocated. */
uint64_t kvp_cli_heap_traffic(void);

#endif /* KVPAGER_CLI_H */
