/*
 * sim_json.h: what the tests that run `kvpager simulate --json` as a child
 * read of it (test_simulate_tier.c, test_simulate_outage.c): the command's
 * standard output, its exit status, and a number or a text after a key.
 * Header-only (static): each test is its own program. The JSON is simulate's
 * own, flat enough that the first `"key":` names the value (a caller
 * narrows the search to an object by passing a pointer into it).
 */
#ifndef KVPT_SIM_JSON_H
#define KVPT_SIM_JSON_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

/* The number after "key": in json (the first occurrence), or fails the test. */
static unsigned long long json_number(const char *json, const char *key)
{
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\":", key);
    const char *at = strstr(json, pattern);
    assert_non_null(at);
    return strtoull(at + strlen(pattern), NULL, 10);
}

/* The text after "key": in json up to the next ',' or '}', into out, or fails the test. */
static void json_text(const char *json, const char *key, char *out, size_t size)
{
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\":", key);
    const char *at = strstr(json, pattern);
    assert_non_null(at);
    at += strlen(pattern);
    size_t n = strcspn(at, ",}");
    assert_true(n < size);
    memcpy(out, at, n);
    out[n] = '\0';
}

/*
 * Runs shell `command`, its standard output into json (size bytes at most,
 * NUL-terminated); returns its exit status (-1: it did not exit).
 */
static int json_run(const char *command, char *json, size_t size)
{
    FILE *p = popen(command, "r");
    assert_non_null(p);
    size_t n = fread(json, 1, size - 1, p);
    json[n] = '\0';
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

#endif
