/*
 * common.c: helpers shared by the kvpager commands (see cli.h).
 */
#include "cli.h"

#include <errno.h>
#include <jemalloc/jemalloc.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void kvp_cli_report(const char *command, const char *context, const kvp_error *err)
{
    char text[512];
    kvp_error_format(err, text, sizeof text);
    fprintf(stderr, "kvpager %s: %s: %s (%s)\n", command, context, text,
            kvp_status_name(err->status));
}

int kvp_cli_parse_size(const char *text, size_t *out)
{
    if (text == NULL || *text < '0' || *text > '9') {
        return -1;
    }
    errno = 0;
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno != 0 || *end != '\0' || value > SIZE_MAX) {
        return -1;
    }
    *out = (size_t)value;
    return 0;
}

uint64_t kvp_cli_heap_traffic(void)
{
    uint64_t allocated = 0;
    uint64_t deallocated = 0;
    size_t size = sizeof allocated;
    if (mallctl("thread.allocated", &allocated, &size, NULL, 0) != 0 ||
        mallctl("thread.deallocated", &deallocated, &size, NULL, 0) != 0) {
        return 0;
    }
    return allocated + deallocated;
}

int kvp_cli_parse_double(const char *text, double *out)
{
    if (text == NULL || *text == '\0') {
        return -1;
    }
    errno = 0;
    char *end = NULL;
    double value = strtod(text, &end);
    if (errno != 0 || *end != '\0' || !isfinite(value)) {
        return -1;
    }
    *out = value;
    return 0;
}

int kvp_cli_parse_bytes(const char *text, size_t *out)
{
    static const struct {
        const char *suffix;
        double scale;
    } units[] = {{"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0}, {"GB", 1e9},
                 {"MB", 1e6},           {"KB", 1e3},       {"kB", 1e3},     {"B", 1.0}};
    if (text == NULL || *text < '0' || *text > '9') {
        return -1;
    }
    errno = 0;
    char *end = NULL;
    double value = strtod(text, &end);
    if (errno != 0 || end == text || !isfinite(value) || value < 0.0) {
        return -1;
    }
    double scale = 1.0;
    if (*end != '\0') {
        size_t i = 0;
        while (i < sizeof units / sizeof units[0] && strcmp(end, units[i].suffix) != 0) {
            i++;
        }
        if (i == sizeof units / sizeof units[0]) {
            return -1;
        }
        scale = units[i].scale;
    }
    double bytes = floor(value * scale);
    if (bytes >= 18446744073709551616.0) {
        return -1;
    }
    *out = (size_t)bytes;
    return 0;
}

const char *kvp_cli_format_bytes(size_t bytes, char *buf, size_t size)
{
    static const char *const names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double value = (double)bytes;
    size_t unit = 0;
    while (value >= 1024.0 && unit + 1 < sizeof names / sizeof names[0]) {
        value /= 1024.0;
        unit++;
    }
    snprintf(buf, size, unit == 0 ? "%.0f %s" : "%.1f %s", value, names[unit]);
    return buf;
}
