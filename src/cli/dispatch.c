/*
 * dispatch.c: the kvpager program's top level: picks a command (see cli.h).
 *
 * Owns: the command table, the top-level help and version, and the check that
 * everything the program printed reached standard output (a full disk or a
 * closed pipe is an error, exit 2, not a silent truncation).
 * Callers: main.c, and tests that run the program in-process.
 */
#include <errno.h>
#include <string.h>

#include "cli.h"

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} command;

static const command commands[] = {
    {"simulate", kvp_cli_simulate, "serve many concurrent sequences under one memory budget"},
    {"demo", kvp_cli_demo, "print the seed's incremental-attention trace, paged"},
    {"bench", kvp_cli_bench, "measure gather, page and simulate speed against baselines"},
};

static void usage(FILE *out)
{
    fprintf(out, "usage: kvpager <command> [options]\n"
                 "       kvpager <command> --help\n"
                 "       kvpager --help | --version\n\n"
                 "kvpager keeps transformer key/value caches in fixed-size pages drawn from one\n"
                 "shared pool under a memory budget.\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        fprintf(out, "  %-10s %s\n", commands[i].name, commands[i].summary);
    }
    fprintf(out, "\nmemory (each command's --help gives the details):\n"
                 "  simulate   computed runs: the budget, the model's f64 weights and the\n"
                 "             running sequences (the defaults: about 120 MiB); allocator-only\n"
                 "             runs (--no-compute): no weights, nothing behind the pages,\n"
                 "             about 80 bytes a page of metadata plus the prompts' rows\n"
                 "  demo       about 6 MiB\n"
                 "  bench      two copies of the largest shape (--max-bytes, 2 GiB) and the\n"
                 "             read array (--read-bytes, 1 GiB): --quick peaks at 5.1 to 5.3 GiB\n");
    fprintf(out, "\noptions:\n"
                 "  --help, -h   show this help\n"
                 "  --version    print the library version\n\n"
                 "exit status: 0 success, 1 a check failed, 2 bad input or an error\n"
                 "(bad input prints one line naming the option and its value).\n");
}

static int run(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "kvpager: missing command (see kvpager --help)\n");
        return KVP_CLI_USAGE;
    }
    const char *first = argv[1];
    int help = strcmp(first, "--help") == 0 || strcmp(first, "-h") == 0 ||
               strcmp(first, "help") == 0;
    int version = strcmp(first, "--version") == 0;
    if (help || version) {
        if (argc > 2) {
            fprintf(stderr, "kvpager: unexpected argument '%s' after %s\n", argv[2], first);
            return KVP_CLI_USAGE;
        }
        if (help) {
            usage(stdout);
        } else {
            printf("kvpager %s\n", kvp_version());
        }
        return KVP_CLI_OK;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        if (strcmp(first, commands[i].name) == 0) {
            return commands[i].run(argc - 1, argv + 1);
        }
    }
    if (first[0] == '-') {
        fprintf(stderr, "kvpager: unknown option '%s' (see kvpager --help)\n", first);
    } else {
        fprintf(stderr, "kvpager: unknown command '%s' (see kvpager --help)\n", first);
    }
    return KVP_CLI_USAGE;
}

int kvp_cli_main(int argc, char **argv)
{
    int status = run(argc, argv);
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "kvpager: writing standard output: %s\n",
                errno != 0 ? strerror(errno) : "write error");
        return KVP_CLI_USAGE;
    }
    return status;
}
