/*
 * model.c: what creating a model costs.
 *
 * Times kvp_model_create_random (and the destroy) of --layers L layers of
 * --width D, --heads H, --positions P (medians of --repetitions runs, each
 * a create and a destroy) and reports the resident memory the live model
 * adds (/proc/self/statm, after a create, before its destroy). With P * d_h
 * doubles within the RoPE table cap (4 MiB: 8192 positions at d_h = 64)
 * every layer needs the angle table; models share one table per RoPE
 * configuration, so this shows the cost of L tables against one.
 *
 * Flags (bench/args.h; --help lists them with their ranges and defaults):
 * --layers 32, --width 256, --heads 4, --positions 8192, --repetitions 5.
 * Exit status 0, or 2 on usage or setup errors (a bad flag or value: one
 * line naming both).
 */
#include <stdio.h>
#include <unistd.h>

#include "kvpager/kvpager.h"
#include "args.h"
#include "measure.h"

static long resident_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    long size = 0;
    long resident = 0;
    if (f == NULL) {
        return -1;
    }
    int got = fscanf(f, "%ld %ld", &size, &resident);
    fclose(f);
    return got == 2 ? resident * sysconf(_SC_PAGESIZE) : -1;
}

int main(int argc, char **argv)
{
    size_t layers = 32, width = 256, heads = 4, positions = 8192, repetitions = 5;
    bench_arg table[] = {
        BENCH_SIZE("--layers", &layers, 1, 4096, "L", "layers of the model"),
        BENCH_SIZE("--width", &width, 2, 65536, "D", "model width"),
        BENCH_SIZE("--heads", &heads, 1, 65536, "H", "heads (dividing D, D / H even)"),
        BENCH_SIZE("--positions", &positions, 1, (size_t)1 << 24, "P", "RoPE positions"),
        BENCH_SIZE("--repetitions", &repetitions, 1, 64, "R", "create+destroy runs"),
    };
    bench_args args = BENCH_ARGS("bench-model",
                                 "Times kvp_model_create_random and its destroy, and the resident\n"
                                 "memory the live model adds.",
                                 table);
    int parsed = bench_args_parse(&args, argc, argv);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    if (width % heads != 0 || (width / heads) % 2 != 0) {
        return bench_args_refuse(&args, "--heads", "a divisor of --width %zu leaving an even "
                                                   "head width", width);
    }
    double ns[64];
    long added[64];
    for (size_t r = 0; r < repetitions; r++) {
        kvp_model *model = NULL;
        kvp_error err;
        long before = resident_bytes();
        double t0 = kvp_measure_now_ns();
        if (kvp_model_create_random(layers, width, heads, positions, 10000.0, 1, &model, &err) !=
            KVP_OK) {
            fprintf(stderr, "bench-model: %s\n", kvp_status_name(err.status));
            return 2;
        }
        double t1 = kvp_measure_now_ns();
        added[r] = resident_bytes() - before;
        if (kvp_model_destroy(model, &err) != KVP_OK) {
            return 2;
        }
        ns[r] = kvp_measure_now_ns() - t0;
        (void)t1;
    }
    double created = kvp_measure_median(ns, repetitions);
    long max_added = 0;
    for (size_t r = 0; r < repetitions; r++) {
        max_added = added[r] > max_added ? added[r] : max_added;
    }
    printf("model layers=%zu width=%zu heads=%zu positions=%zu: create+destroy %.2f ms "
           "(median of %zu), resident added by the live model %.1f MiB (first run %.1f MiB)\n",
           layers, width, heads, positions, created * 1e-6, repetitions,
           (double)max_added / (1 << 20), (double)added[0] / (1 << 20));
    return 0;
}
