/*
 * args.h: the command-line parser every bench/ program shares.
 *
 * A program describes its flags in a table of bench_arg (BENCH_SIZE,
 * BENCH_DOUBLE, BENCH_SWITCH, BENCH_CHOICE, BENCH_TEXT), each pointing at the variable
 * that holds its default, and calls bench_args_parse before doing anything
 * else. The parser owns the rules of bench/ (the project's rule for every
 * command):
 *   --help or -h anywhere: the usage, built from the table (each flag, its
 *   help, its range and its default), on stdout, and exit status 0;
 *   --flag value and --flag=value alike; a switch takes no value;
 *   an unknown flag, a stray argument, a missing value, a value that is not
 *   a number, out of range or too big for its type, or not one of the names:
 *   exit status 2 and exactly one line on stderr,
 *     bench-NAME: --flag: bad value 'x' (expected ...)
 *   naming the flag and the value; nothing is written to stdout.
 * A value given twice keeps the last one (as the programs always did).
 * Checks between flags (a divisor, an even width) stay in the program and
 * report through bench_args_refuse, in the same one-line form.
 *
 * Invariants: on a refusal no variable has changed after its own check
 * failed (earlier flags may have been stored; the program exits anyway).
 * Callers: bench/ programs only, from main, single-threaded (it keeps no
 * state of its own but the table's `given` fields).
 */
#ifndef KVP_BENCH_ARGS_H
#define KVP_BENCH_ARGS_H

#include <stddef.h>

typedef enum bench_arg_kind {
    BENCH_ARG_SIZE,   /* size_t, a decimal whole number in [min, max] */
    BENCH_ARG_DOUBLE, /* double, a finite decimal number in [low, high] */
    BENCH_ARG_SWITCH, /* int, set to 1 when the flag is present */
    BENCH_ARG_CHOICE, /* int, the index of the name given in names */
    BENCH_ARG_TEXT    /* const char *, any nonempty text (argv's; the program checks it) */
} bench_arg_kind;

typedef struct bench_arg {
    const char *flag;         /* "--len" */
    bench_arg_kind kind;
    void *value;              /* size_t *, double *, or int * (switch, choice) */
    const char *meta;         /* the value's name in the usage ("N"); NULL for switches */
    const char *help;         /* one line */
    size_t min, max;          /* BENCH_ARG_SIZE */
    double low, high;         /* BENCH_ARG_DOUBLE */
    const char *const *names; /* BENCH_ARG_CHOICE, NULL-terminated */
    const char *given;        /* set by bench_args_parse: the text given last, or NULL */
} bench_arg;

/* Table entries. The pointer's type is checked at compile time. A default
 * outside the range (or a choice of -1) is not shown by --help: it means
 * "not given", and the help text says what the program does then. */
#define BENCH_SIZE(f, ptr, lo, hi, m, h)                                                      \
    {.flag = (f), .kind = BENCH_ARG_SIZE, .value = _Generic((ptr), size_t *: (ptr)),          \
     .meta = (m), .help = (h), .min = (lo), .max = (hi)}
#define BENCH_DOUBLE(f, ptr, lo, hi, m, h)                                                    \
    {.flag = (f), .kind = BENCH_ARG_DOUBLE, .value = _Generic((ptr), double *: (ptr)),        \
     .meta = (m), .help = (h), .low = (lo), .high = (hi)}
#define BENCH_SWITCH(f, ptr, h)                                                               \
    {.flag = (f), .kind = BENCH_ARG_SWITCH, .value = _Generic((ptr), int *: (ptr)), .help = (h)}
#define BENCH_CHOICE(f, ptr, list, m, h)                                                      \
    {.flag = (f), .kind = BENCH_ARG_CHOICE, .value = _Generic((ptr), int *: (ptr)),           \
     .meta = (m), .help = (h), .names = (list)}

#define BENCH_TEXT(f, ptr, m, h)                                                              \
    {.flag = (f), .kind = BENCH_ARG_TEXT, .value = _Generic((ptr), const char **: (ptr)),     \
     .meta = (m), .help = (h)}

typedef struct bench_args {
    const char *program; /* "bench-gather": the first word of every message */
    const char *about;   /* printed by --help under the usage line; may be NULL */
    bench_arg *table;
    size_t count;
} bench_args;

#define BENCH_ARGS(prog, text, tab) {(prog), (text), (tab), sizeof(tab) / sizeof((tab)[0])}

/* What bench_args_parse returns when the program should go on. */
#define BENCH_ARGS_RUN (-1)

/*
 * Parses argv[1..argc-1] into the table's variables. Returns BENCH_ARGS_RUN
 * when every argument was good; otherwise the exit status main must return:
 * 0 after printing the usage (--help, -h), 2 after printing one line on
 * stderr (see above; also when stdout cannot take the usage).
 */
int bench_args_parse(bench_args *a, int argc, char **argv);

/*
 * Refuses `flag`'s value after parsing (a check between flags): prints
 *   PROGRAM: FLAG: bad value 'VALUE' (expected WHY)
 * where VALUE is the text given, or the default when the flag was not
 * given, and WHY is printf(fmt, ...). Returns 2, the exit status.
 */
int bench_args_refuse(const bench_args *a, const char *flag, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
