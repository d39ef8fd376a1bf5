/*
 * stress_common.c: shared helpers of the stress programs (see stress_common.h).
 */
#include "stress_common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int stress_parse(int argc, char **argv, const char *summary, stress_option *options,
                 size_t count)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: %s [options]\n\n%s\n\noptions:\n", argv[0], summary);
            for (size_t o = 0; o < count; o++) {
                printf("  %-22s %s (default %zu)\n", options[o].name, options[o].help,
                       *options[o].value);
            }
            return 1;
        }
        size_t o = 0;
        while (o < count && strcmp(argv[i], options[o].name) != 0) {
            o++;
        }
        if (o == count || i + 1 >= argc) {
            fprintf(stderr, "%s: unknown option or missing value: '%s' (see --help)\n", argv[0],
                    argv[i]);
            return 2;
        }
        errno = 0;
        char *end = NULL;
        unsigned long long value = strtoull(argv[++i], &end, 10);
        if (errno != 0 || *end != '\0' || argv[i][0] == '-' || argv[i][0] == '\0') {
            fprintf(stderr, "%s: invalid value for %s: '%s'\n", argv[0], options[o].name,
                    argv[i]);
            return 2;
        }
        *options[o].value = (size_t)value;
    }
    return 0;
}

uint64_t stress_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void stress_fill(double *values, size_t n, uint64_t *state)
{
    for (size_t i = 0; i < n; i++) {
        values[i] = (double)(stress_rand(state) >> 11) * 0x1.0p-53 * 2.0 - 1.0;
    }
}

uint64_t stress_sequence_digest(const kvp_sequence *sequence)
{
    uint64_t folded = kvp_sequence_len(sequence);
    for (size_t layer = 0;; layer++) {
        const kvp_cache *cache = kvp_sequence_cache(sequence, layer);
        if (cache == NULL) {
            break;
        }
        uint64_t digest = 0;
        if (kvp_cache_digest(cache, &digest, NULL) != KVP_OK) {
            return 0;
        }
        folded = (folded ^ digest) * 0x100000001b3ull;
    }
    return folded;
}

int stress_fail(const char *program, const char *what, const kvp_error *err)
{
    char text[512] = "no detail";
    if (err != NULL) {
        kvp_error_format(err, text, sizeof text);
    }
    fprintf(stderr, "%s: %s: %s\n", program, what, text);
    return 1;
}

double stress_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

size_t stress_cores(void)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    return cores > 0 ? (size_t)cores : 1;
}

int stress_rss_bytes(const char *program, size_t *out)
{
    FILE *statm = fopen("/proc/self/statm", "r");
    unsigned long size_pages = 0;
    unsigned long pages = 0;
    int read = statm != NULL && fscanf(statm, "%lu %lu", &size_pages, &pages) == 2;
    if (statm != NULL) {
        fclose(statm);
    }
    if (!read) {
        fprintf(stderr, "%s: cannot read /proc/self/statm\n", program);
        return 1;
    }
    *out = (size_t)pages * (size_t)sysconf(_SC_PAGESIZE);
    return 0;
}
