/*
 * common.c: helpers shared by the kvpager commands (see cli.h).
 */
#include "cli.h"

#include <errno.h>
#include <jemalloc/jemalloc.h>
#include <stdlib.h>

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
