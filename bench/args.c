/*
 * args.c: the bench/ programs' command-line parser (bench/args.h).
 *
 * Owns the one format of every refusal (PROGRAM: FLAG: bad value 'X'
 * (expected ...), one line on stderr, exit status 2) and of --help (the
 * usage built from the table, on stdout, exit status 0). Keeps no state: a
 * bench_args and its table are the caller's. Callers: bench/ programs' main.
 */
#include "args.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What `arg` accepts, e.g. "a whole number from 1 to 64", into buf. */
static void describe(const bench_arg *arg, char *buf, size_t size)
{
    switch (arg->kind) {
    case BENCH_ARG_SIZE:
        snprintf(buf, size, "a whole number from %zu to %zu", arg->min, arg->max);
        break;
    case BENCH_ARG_DOUBLE:
        snprintf(buf, size, "a number from %g to %g", arg->low, arg->high);
        break;
    case BENCH_ARG_SWITCH:
        snprintf(buf, size, "no value: %s is a switch", arg->flag);
        break;
    case BENCH_ARG_CHOICE: {
        size_t used = (size_t)snprintf(buf, size, "one of");
        for (size_t k = 0; arg->names[k] != NULL && used < size; k++) {
            used += (size_t)snprintf(buf + used, size - used, "%s %s", k == 0 ? "" : ",",
                                     arg->names[k]);
        }
        break;
    }
    case BENCH_ARG_TEXT:
        snprintf(buf, size, "nonempty text");
        break;
    }
}

/* The value `arg` holds now, as text, or "" when it is "not given". */
static void current(const bench_arg *arg, char *buf, size_t size)
{
    buf[0] = '\0';
    if (arg->kind == BENCH_ARG_SIZE) {
        size_t v = *(const size_t *)arg->value;
        if (v >= arg->min && v <= arg->max) {
            snprintf(buf, size, "%zu", v);
        }
    } else if (arg->kind == BENCH_ARG_DOUBLE) {
        double v = *(const double *)arg->value;
        if (v >= arg->low && v <= arg->high) {
            snprintf(buf, size, "%g", v);
        }
    } else if (arg->kind == BENCH_ARG_TEXT) {
        const char *v = *(const char *const *)arg->value;
        if (v != NULL) {
            snprintf(buf, size, "%s", v);
        }
    } else if (arg->kind == BENCH_ARG_CHOICE) {
        int v = *(const int *)arg->value;
        size_t n = 0;
        while (arg->names[n] != NULL) {
            n++;
        }
        if (v >= 0 && (size_t)v < n) {
            snprintf(buf, size, "%s", arg->names[v]);
        }
    }
}

static int usage(const bench_args *a)
{
    printf("usage: %s [--flag value | --flag=value]...\n", a->program);
    if (a->about != NULL) {
        printf("%s\n", a->about);
    }
    printf("\n");
    for (size_t i = 0; i < a->count; i++) {
        const bench_arg *arg = &a->table[i];
        char what[256];
        char now[64];
        describe(arg, what, sizeof what);
        current(arg, now, sizeof now);
        char left[64];
        snprintf(left, sizeof left, "%s%s%s", arg->flag, arg->meta != NULL ? " " : "",
                 arg->meta != NULL ? arg->meta : "");
        printf("  %-20s %s\n", left, arg->help);
        if (arg->kind != BENCH_ARG_SWITCH) {
            printf("  %-20s %s%s%s\n", "", what, now[0] != '\0' ? "; default " : "", now);
        }
    }
    printf("  %-20s %s\n", "--help, -h", "print this and exit");
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "%s: --help: cannot write the usage: %s\n", a->program, strerror(errno));
        return 2;
    }
    return 0;
}

static int refuse_value(const bench_args *a, const bench_arg *arg, const char *text)
{
    char what[256];
    describe(arg, what, sizeof what);
    fprintf(stderr, "%s: %s: bad value '%s' (expected %s)\n", a->program, arg->flag, text, what);
    return 2;
}

/* Whether text is nonempty and made only of characters in `allowed`. */
static int only(const char *text, const char *allowed)
{
    return text[0] != '\0' && strspn(text, allowed) == strlen(text);
}

/* Stores text into arg's variable: 0, or 2 after refusing it. */
static int store(const bench_args *a, bench_arg *arg, const char *text)
{
    char *end = NULL;
    errno = 0;
    if (arg->kind == BENCH_ARG_SIZE) {
        unsigned long long v = only(text, "0123456789") ? strtoull(text, &end, 10) : 0;
        if (end == NULL || *end != '\0' || errno == ERANGE || v > (unsigned long long)SIZE_MAX ||
            v < arg->min || v > arg->max) {
            return refuse_value(a, arg, text);
        }
        *(size_t *)arg->value = (size_t)v;
    } else if (arg->kind == BENCH_ARG_DOUBLE) {
        /* Decimal only: no "inf", "nan" or hexadecimal. */
        double v = only(text, "0123456789.eE+-") ? strtod(text, &end) : 0.0;
        if (end == NULL || *end != '\0' || !isfinite(v) || !(v >= arg->low && v <= arg->high)) {
            return refuse_value(a, arg, text);
        }
        *(double *)arg->value = v;
    } else if (arg->kind == BENCH_ARG_TEXT) {
        if (text[0] == '\0') {
            return refuse_value(a, arg, text);
        }
        *(const char **)arg->value = text;
    } else {
        int k = 0;
        while (arg->names[k] != NULL && strcmp(arg->names[k], text) != 0) {
            k++;
        }
        if (arg->names[k] == NULL) {
            return refuse_value(a, arg, text);
        }
        *(int *)arg->value = k;
    }
    arg->given = text;
    return 0;
}

static bench_arg *find(const bench_args *a, const char *name, size_t length)
{
    for (size_t i = 0; i < a->count; i++) {
        const char *flag = a->table[i].flag;
        if (strlen(flag) == length && strncmp(flag, name, length) == 0) {
            return &a->table[i];
        }
    }
    return NULL;
}

int bench_args_parse(bench_args *a, int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            return usage(a);
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *word = argv[i];
        const char *equals = strchr(word, '=');
        size_t length = equals != NULL ? (size_t)(equals - word) : strlen(word);
        bench_arg *arg = strncmp(word, "--", 2) == 0 ? find(a, word, length) : NULL;
        if (arg == NULL) {
            fprintf(stderr, "%s: %s '%s' (see --help)\n", a->program,
                    word[0] == '-' ? "unknown flag" : "unexpected argument", word);
            return 2;
        }
        if (arg->kind == BENCH_ARG_SWITCH) {
            if (equals != NULL) {
                return refuse_value(a, arg, equals + 1);
            }
            *(int *)arg->value = 1;
            arg->given = word;
            continue;
        }
        const char *text = equals != NULL ? equals + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (text == NULL) {
            char what[256];
            describe(arg, what, sizeof what);
            fprintf(stderr, "%s: %s: missing value (expected %s)\n", a->program, arg->flag, what);
            return 2;
        }
        if (store(a, arg, text) != 0) {
            return 2;
        }
    }
    return BENCH_ARGS_RUN;
}

int bench_args_refuse(const bench_args *a, const char *flag, const char *fmt, ...)
{
    const bench_arg *arg = find(a, flag, strlen(flag));
    char value[64] = "";
    if (arg != NULL && arg->given != NULL) {
        snprintf(value, sizeof value, "%s", arg->given);
    } else if (arg != NULL) {
        current(arg, value, sizeof value);
        if (value[0] == '\0' && arg->kind == BENCH_ARG_SIZE) {
            snprintf(value, sizeof value, "%zu", *(const size_t *)arg->value);
        }
    }
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s: bad value '%s' (expected %s)\n", a->program, flag, value, why);
    return 2;
}
