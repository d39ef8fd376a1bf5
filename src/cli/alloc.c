/*
 * alloc.c: the program's allocation hook and fault injector (see alloc.h).
 */
#include "alloc.h"

#include <stdlib.h>

static uint64_t fault_calls;  /* allocation calls since the last arm */
static uint64_t fault_target; /* 0: disarmed */
static int fault_fired;

/* Counts the call; 1 when this call must fail by injection. */
static int should_fail(void)
{
    fault_calls++;
    if (fault_target != 0 && fault_calls == fault_target) {
        fault_fired = 1;
        return 1;
    }
    return 0;
}

static int bytes_of(size_t n, size_t size, size_t *bytes)
{
    if (size != 0 && n > SIZE_MAX / size) {
        return -1;
    }
    *bytes = n * size == 0 ? 1 : n * size;
    return 0;
}

void *kvp_cli_alloc(size_t n, size_t size)
{
    size_t bytes = 0;
    if (should_fail() || bytes_of(n, size, &bytes) != 0) {
        return NULL;
    }
    return malloc(bytes);
}

void *kvp_cli_calloc(size_t n, size_t size)
{
    size_t bytes = 0;
    if (should_fail() || bytes_of(n, size, &bytes) != 0) {
        return NULL;
    }
    return calloc(1, bytes);
}

void *kvp_cli_realloc(void *ptr, size_t n, size_t size)
{
    size_t bytes = 0;
    if (should_fail() || bytes_of(n, size, &bytes) != 0) {
        return NULL;
    }
    return realloc(ptr, bytes);
}

void kvp_cli_free(void *ptr)
{
    free(ptr);
}

void kvp_cli_fault_arm(uint64_t nth)
{
    fault_calls = 0;
    fault_fired = 0;
    fault_target = nth;
}

uint64_t kvp_cli_fault_calls(void)
{
    return fault_calls;
}

int kvp_cli_fault_fired(void)
{
    return fault_fired;
}
