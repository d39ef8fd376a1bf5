/*
 * main.c: the kvpager program's entry point: dispatches to a command.
 */
#include <stdio.h>
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
};

static void usage(FILE *out)
{
    fprintf(out, "usage: kvpager <command> [options]\n"
                 "       kvpager <command> --help\n"
                 "       kvpager --version\n\n"
                 "kvpager keeps transformer key/value caches in fixed-size pages drawn from one\n"
                 "shared pool under a memory budget.\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        fprintf(out, "  %-10s %s\n", commands[i].name, commands[i].summary);
    }
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return KVP_CLI_USAGE;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return KVP_CLI_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("kvpager %s\n", kvp_version());
        return KVP_CLI_OK;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        if (strcmp(argv[1], commands[i].name) == 0) {
            return commands[i].run(argc - 1, argv + 1);
        }
    }
    fprintf(stderr, "kvpager: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return KVP_CLI_USAGE;
}
