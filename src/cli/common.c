/*
 * common.c: helpers shared by the kvpager commands (see cli.h).
 */
#define _XOPEN_SOURCE 700 /* realpath (XSI); before any header */
#include "cli.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <jemalloc/jemalloc.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void kvp_cli_report(const char *command, const char *context, const kvp_error *err)
{
    char text[512];
    kvp_error_format(err, text, sizeof text);
    fprintf(stderr, "kvpager %s: %s: %s (%s)\n", command, context, text,
            kvp_status_name(err->status));
}

void kvp_cli_report_oom(const char *command, const char *what, size_t bytes)
{
    kvp_error err = {.status = KVP_ALLOCATION_FAILED, .what = what, .bytes = bytes};
    kvp_cli_report(command, "out of memory", &err);
}

int kvp_cli_parse_size(const char *text, size_t *out)
{
    if (text == NULL || *text < '0' || *text > '9') {
        return -1;
    }
    size_t value = 0;
    for (const char *p = text; *p != '\0'; p++) {
        if (*p < '0' || *p > '9' || kvp_cli_mul(value, 10, &value) != 0 ||
            kvp_cli_add(value, (size_t)(*p - '0'), &value) != 0) {
            return -1;
        }
    }
    *out = value;
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
    if (text == NULL || strchr("0123456789.+-", *text) == NULL || *text == '\0' ||
        strpbrk(text, "xXpP") != NULL) {
        return -1;
    }
    errno = 0;
    char *end = NULL;
    double value = strtod(text, &end);
    if (errno != 0 || end == text || *end != '\0' || !isfinite(value)) {
        return -1;
    }
    *out = value;
    return 0;
}

static size_t gcd(size_t a, size_t b)
{
    while (b != 0) {
        size_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

int kvp_cli_parse_bytes(const char *text, size_t *out)
{
    static const struct {
        const char *suffix;
        size_t scale;
    } units[] = {{"B", 1},
                 {"KiB", (size_t)1 << 10},
                 {"MiB", (size_t)1 << 20},
                 {"GiB", (size_t)1 << 30},
                 {"TiB", (size_t)1 << 40},
                 {"KB", 1000},
                 {"kB", 1000},
                 {"MB", 1000000},
                 {"GB", 1000000000},
                 {"TB", 1000000000000}};
    if (text == NULL || *text < '0' || *text > '9') {
        return -1;
    }
    /* The number as digits / 10^fraction_digits, all in integers. */
    size_t digits = 0;
    size_t divisor = 1;
    const char *p = text;
    int fraction = 0;
    for (; (*p >= '0' && *p <= '9') || (*p == '.' && !fraction); p++) {
        if (*p == '.') {
            fraction = 1;
            continue;
        }
        if (kvp_cli_mul(digits, 10, &digits) != 0 ||
            kvp_cli_add(digits, (size_t)(*p - '0'), &digits) != 0 ||
            (fraction && kvp_cli_mul(divisor, 10, &divisor) != 0)) {
            return -1;
        }
    }
    if (p[-1] == '.') {
        return -1; /* "1." */
    }
    size_t scale = 1;
    if (*p != '\0') {
        size_t i = 0;
        while (i < sizeof units / sizeof units[0] && strcmp(p, units[i].suffix) != 0) {
            i++;
        }
        if (i == sizeof units / sizeof units[0]) {
            return -1;
        }
        scale = units[i].scale;
    }
    /* bytes = digits * scale / divisor, which must be whole. */
    size_t common = gcd(scale, divisor);
    scale /= common;
    divisor /= common;
    size_t bytes = 0;
    if (digits % divisor != 0 || kvp_cli_mul(digits / divisor, scale, &bytes) != 0) {
        return -1;
    }
    *out = bytes;
    return 0;
}

const char *kvp_cli_format_bytes(size_t bytes, char *buf, size_t size)
{
    static const char *const names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double value = (double)bytes;
    size_t unit = 0;
    while (value >= 1024.0 && unit + 1 < sizeof names / sizeof names[0]) {
        value /= 1024.0;
        unit++;
    }
    snprintf(buf, size, unit == 0 ? "%.0f %s" : "%.1f %s", value, names[unit]);
    return buf;
}

int kvp_cli_mul(size_t a, size_t b, size_t *out)
{
    if (b != 0 && a > SIZE_MAX / b) {
        *out = SIZE_MAX;
        return -1;
    }
    *out = a * b;
    return 0;
}

int kvp_cli_add(size_t a, size_t b, size_t *out)
{
    if (a > SIZE_MAX - b) {
        *out = SIZE_MAX;
        return -1;
    }
    *out = a + b;
    return 0;
}

size_t kvp_cli_physical_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES);
    long page_size = sysconf(_SC_PAGE_SIZE);
    size_t bytes = 0;
    if (pages <= 0 || page_size <= 0 ||
        kvp_cli_mul((size_t)pages, (size_t)page_size, &bytes) != 0) {
        return 0;
    }
    return bytes;
}

void kvp_cli_problem(kvp_cli_problems *p, const char *format, ...)
{
    if (p->found) {
        return;
    }
    p->found = 1;
    va_list args;
    va_start(args, format);
    vsnprintf(p->line, sizeof p->line, format, args);
    va_end(args);
}

int kvp_cli_take_flag(int argc, char **argv, int *i, const char *command,
                      const char *const *names, size_t count, const char **values,
                      kvp_cli_problems *p)
{
    const char *arg = argv[*i];
    const char *equals = strncmp(arg, "--", 2) == 0 ? strchr(arg, '=') : NULL;
    size_t name_len = equals != NULL ? (size_t)(equals - arg) : strlen(arg);
    size_t f = 0;
    while (f < count && (strlen(names[f]) != name_len || strncmp(arg, names[f], name_len) != 0)) {
        f++;
    }
    if (f == count) {
        if (arg[0] == '-') {
            kvp_cli_problem(p, "unknown option '%.*s' (see kvpager %s --help)", (int)name_len, arg,
                            command);
        } else {
            kvp_cli_problem(p, "unexpected argument '%s' (options start with --)", arg);
        }
        return -1;
    }
    const char *value;
    if (equals != NULL) {
        value = equals + 1; /* --flag=value: the value may be empty, and is then refused */
        if (value[0] == '\0') {
            kvp_cli_problem(p, "%s needs a value, got '%s'", names[f], arg);
            return -1;
        }
    } else {
        int next = *i + 1;
        if (next >= argc || strncmp(argv[next], "--", 2) == 0) {
            kvp_cli_problem(p, "%s needs a value%s%s%s", arg,
                            next < argc ? ", got the option '" : "", next < argc ? argv[next] : "",
                            next < argc ? "'" : "");
            return -1;
        }
        *i = next;
        value = argv[next];
    }
    if (values[f] != NULL) {
        kvp_cli_problem(p, "%s given twice: '%s' and '%s'", names[f], values[f], value);
        return -1;
    }
    values[f] = value;
    return (int)f;
}

/*
 * `path` made absolute with every symbolic link and `.`/`..` resolved into
 * out[PATH_MAX]: the whole path when it exists; otherwise its directory
 * resolved plus its last component (a file not made yet); otherwise the
 * path as given. No heap (realpath into a buffer).
 */
static void resolve_path(const char *path, char *out)
{
    char dir[PATH_MAX];
    if (realpath(path, out) != NULL) {
        return;
    }
    const char *slash = strrchr(path, '/');
    const char *base = slash != NULL ? slash + 1 : path;
    size_t dir_len = slash == NULL ? 0 : slash == path ? 1 : (size_t)(slash - path);
    if (dir_len < sizeof dir) {
        memcpy(dir, dir_len > 0 ? path : ".", dir_len > 0 ? dir_len : 1);
        dir[dir_len > 0 ? dir_len : 1] = '\0';
        char resolved[PATH_MAX];
        if (realpath(dir, resolved) != NULL &&
            (size_t)snprintf(out, PATH_MAX, "%s/%s", strcmp(resolved, "/") == 0 ? "" : resolved,
                             base) < PATH_MAX) {
            return;
        }
    }
    snprintf(out, PATH_MAX, "%s", path);
}

int kvp_cli_same_file(const char *a, const char *b)
{
    struct stat sa;
    struct stat sb;
    if (stat(a, &sa) == 0 && stat(b, &sb) == 0) {
        return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    }
    char ra[PATH_MAX];
    char rb[PATH_MAX];
    resolve_path(a, ra);
    resolve_path(b, rb);
    return strcmp(ra, rb) == 0;
}
