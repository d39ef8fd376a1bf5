/*
 * sweep_cli.c: every allocation failure of the kvpager commands, one at a time.
 *
 * For each scenario (simulate computed and --no-compute, each with and
 * without --trace, plus a --plot; the reproduction of the old
 * use-after-free; two sweeps, --json's array and a --format table; demo) and each N = 1, 2, ...: a forked child arms a fault
 * injector to fail its Nth allocation, runs the command in-process through
 * the kvpager_cli library, and exits with the command's status. The parent
 * asserts the child exited (never a signal) with 0 or 2, and that an exit 2
 * printed exactly one stderr line naming AllocationFailed. The sweep of a
 * scenario ends at the first N whose fault did not fire (the run completed).
 *
 * Two passes per scenario: the program's own allocations (src/cli/alloc.h)
 * and the library's (src/pager/alloc.h, reachable since the program links
 * kvpager_internal). Under Valgrind memcheck (which follows fork) a child
 * with any memcheck error or definite/indirect leak exits with memcheck's
 * error code, which this driver reports as a failure.
 *
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "alloc.h"
#include "cli.h"
#include "pager/alloc.h"

#define MAX_ARGS 40
#define MAX_N 100000

typedef struct scenario {
    const char *name;
    const char *args[MAX_ARGS]; /* args[0] is the command; NULL-terminated */
} scenario;

/* What a child tells its parent: did the armed fault fire, after how many calls. */
typedef struct report {
    int fired;
    uint64_t calls;
} report;

static char work[256];
static char trace_path[300];
static char plot_path[300];
static char err_path[300];

static int command_main(int argc, char **argv)
{
    return strcmp(argv[0], "demo") == 0 ? kvp_cli_demo(argc, argv) : kvp_cli_simulate(argc, argv);
}

/* Replaces the placeholders TRACE and PLOT by this run's paths. */
static int build_argv(const scenario *sc, char *argv[MAX_ARGS])
{
    int argc = 0;
    for (; sc->args[argc] != NULL; argc++) {
        const char *a = sc->args[argc];
        argv[argc] = (char *)(strcmp(a, "TRACE") == 0  ? trace_path
                              : strcmp(a, "PLOT") == 0 ? plot_path
                                                       : a);
    }
    argv[argc] = NULL;
    return argc;
}

static void child(const scenario *sc, int library, uint64_t n, report *shared)
{
    int out = open("/dev/null", O_WRONLY);
    int err = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (out < 0 || err < 0 || dup2(out, STDOUT_FILENO) < 0 || dup2(err, STDERR_FILENO) < 0) {
        _exit(120);
    }
    close(out);
    close(err);
    char *argv[MAX_ARGS];
    int argc = build_argv(sc, argv);
    if (library) {
        kvpi_fault_arm(n);
    } else {
        kvp_cli_fault_arm(n);
    }
    int status = command_main(argc, argv);
    shared->fired = library ? kvpi_fault_fired() : kvp_cli_fault_fired();
    shared->calls = library ? kvpi_fault_calls() : kvp_cli_fault_calls();
    kvpi_fault_arm(0);
    kvp_cli_fault_arm(0);
    exit(status);
}

/* The child's stderr: number of lines, and whether every one names AllocationFailed. */
static int stderr_lines(int *all_oom, char *first, size_t size)
{
    FILE *f = fopen(err_path, "r");
    int lines = 0;
    *all_oom = 1;
    first[0] = '\0';
    if (f == NULL) {
        return -1;
    }
    char line[1024];
    while (fgets(line, sizeof line, f) != NULL) {
        if (lines == 0) {
            snprintf(first, size, "%s", line);
        }
        lines++;
        *all_oom = *all_oom && strstr(line, "AllocationFailed") != NULL;
    }
    fclose(f);
    return lines;
}

/* Sweeps one pass; returns the number of N that failed an allocation, or -1. */
static long sweep(const scenario *sc, int library, report *shared)
{
    const char *pass = library ? "library" : "cli";
    for (uint64_t n = 1; n <= MAX_N; n++) {
        shared->fired = -1;
        unlink(plot_path);
        fflush(NULL);
        pid_t pid = fork();
        if (pid < 0) {
            fprintf(stderr, "sweep_cli: fork: %s\n", strerror(errno));
            return -1;
        }
        if (pid == 0) {
            child(sc, library, n, shared);
        }
        int status = 0;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        char first[1024];
        int oom = 0;
        int lines = stderr_lines(&oom, first, sizeof first);
        if (!WIFEXITED(status)) {
            fprintf(stderr, "sweep_cli: %s %s N=%llu: killed by signal %d\n", sc->name, pass,
                    (unsigned long long)n, WIFSIGNALED(status) ? WTERMSIG(status) : -1);
            return -1;
        }
        int code = WEXITSTATUS(status);
        if (shared->fired < 0 || (code != 0 && code != 2)) {
            fprintf(stderr, "sweep_cli: %s %s N=%llu: exit %d (expected 0 or 2); stderr: %s",
                    sc->name, pass, (unsigned long long)n, code, first);
            return -1;
        }
        if (code == 2 && (lines != 1 || !oom || !shared->fired)) {
            fprintf(stderr,
                    "sweep_cli: %s %s N=%llu: exit 2 needs the fault to have fired (%d) and one "
                    "AllocationFailed line, got %d line(s): %s",
                    sc->name, pass, (unsigned long long)n, shared->fired, lines, first);
            return -1;
        }
        if (access(plot_path, F_OK) == 0 && code != 0) {
            fprintf(stderr, "sweep_cli: %s %s N=%llu: a failed run left its plot behind\n",
                    sc->name, pass, (unsigned long long)n);
            return -1;
        }
        unlink(plot_path);
        if (!shared->fired) {
            if (code != 0) {
                fprintf(stderr, "sweep_cli: %s %s: the unfaulted run exited %d: %s", sc->name,
                        pass, code, first);
                return -1;
            }
            return (long)(n - 1);
        }
    }
    fprintf(stderr, "sweep_cli: %s %s: still failing after %d allocations\n", sc->name, pass,
            MAX_N);
    return -1;
}

/* Small pools, burst arrivals and no reserve, so every scenario also preempts. */
#define SMALL "--model-width", "8", "--heads", "2", "--block-tokens", "4", "--capacity", "24", \
              "--layers", "1", "--reserve-tokens", "0", "--watermark", "0", "--audit-every", "3", \
              "--quiet", "--json"
#define GENERATED "--requests", "5", "--prompt-mean", "6", "--output-mean", "10", "--arrival", \
                  "burst", "--budget", "4KiB"

static const scenario scenarios[] = {
    {"simulate", {"simulate", SMALL, GENERATED, "--threads", "2", "--plot", "PLOT", NULL}},
    {"simulate-no-compute", {"simulate", SMALL, GENERATED, "--no-compute", NULL}},
    {"simulate-trace",
     {"simulate", SMALL, "--trace", "TRACE", "--budget", "3KiB", "--threads", "1", NULL}},
    {"simulate-trace-no-compute",
     {"simulate", SMALL, "--trace", "TRACE", "--budget", "3KiB", "--no-compute", NULL}},
    {"simulate-issue-7",
     {"simulate", "--trace", "TRACE", "--budget", "1MiB", "--model-width", "16", "--heads", "2",
      "--capacity", "64", "--threads", "1", "--quiet", NULL}},
    /* Sweeps (simulate_sweep.c): --json's array, and a --format table. */
    {"simulate-sweep-json",
     {"simulate", SMALL, "--requests", "5", "--prompt-mean", "6", "--output-mean", "10",
      "--arrival", "burst", "--budget=4KiB,8KiB", "--no-compute", NULL}},
    {"simulate-sweep-table",
     {"simulate", "--model-width", "8", "--heads", "2", "--block-tokens", "4,8", "--capacity",
      "24", "--layers", "1", "--quiet", GENERATED, "--threads", "1", "--format", "csv", NULL}},
    {"demo", {"demo", NULL}},
};

int main(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(work, sizeof work, "%s/kvp-sweep-XXXXXX", tmp != NULL ? tmp : "/tmp");
    if (mkdtemp(work) == NULL) {
        fprintf(stderr, "sweep_cli: mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    snprintf(trace_path, sizeof trace_path, "%s/trace.csv", work);
    snprintf(plot_path, sizeof plot_path, "%s/plot.svg", work);
    snprintf(err_path, sizeof err_path, "%s/stderr.txt", work);
    FILE *trace = fopen(trace_path, "w");
    if (trace == NULL) {
        fprintf(stderr, "sweep_cli: %s: %s\n", trace_path, strerror(errno));
        return 1;
    }
    /* Enough requests to preempt on a 3 KiB pool (6 pages of 4 positions). */
    fputs("arrival_step,prompt_tokens,output_tokens\n0,6,5\n0,7,4\n1,3,9\n1,9,3\n2,5,5\n",
          trace);
    fclose(trace);
    report *shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE,
                          MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) {
        fprintf(stderr, "sweep_cli: mmap: %s\n", strerror(errno));
        return 1;
    }
    int failed = 0;
    for (size_t i = 0; i < sizeof scenarios / sizeof scenarios[0]; i++) {
        const scenario *sc = &scenarios[i];
        long cli = sweep(sc, 0, shared);
        long library = cli < 0 ? -1 : sweep(sc, 1, shared);
        if (cli < 0 || library < 0) {
            failed = 1;
            continue;
        }
        printf("sweep_cli: %-26s %4ld program allocations and %4ld library allocations "
               "failed one at a time: each exited 2 with one AllocationFailed line\n",
               sc->name, cli, library);
    }
    unlink(trace_path);
    unlink(plot_path);
    unlink(err_path);
    rmdir(work);
    munmap(shared, sizeof *shared);
    return failed;
}
