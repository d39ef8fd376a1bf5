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
 * Exit status 0, or 2 on usage or setup errors.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvpager/kvpager.h"
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
    for (int i = 1; i + 1 < argc; i += 2) {
        size_t v = (size_t)strtoull(argv[i + 1], NULL, 10);
        if (strcmp(argv[i], "--layers") == 0) {
            layers = v;
        } else if (strcmp(argv[i], "--width") == 0) {
            width = v;
        } else if (strcmp(argv[i], "--heads") == 0) {
            heads = v;
        } else if (strcmp(argv[i], "--positions") == 0) {
            positions = v;
        } else if (strcmp(argv[i], "--repetitions") == 0) {
            repetitions = v;
        } else {
            fprintf(stderr, "usage: bench-model [--layers L] [--width D] [--heads H] "
                            "[--positions P] [--repetitions R]\n");
            return 2;
        }
    }
    double ns[64];
    long added[64];
    if (repetitions == 0 || repetitions > 64) {
        return 2;
    }
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
