/*
 * json.h: a small streaming JSON writer for the commands' --json output.
 *
 * Owns: commas, nesting and string escaping. Keys are given for members of
 * objects and NULL for elements of arrays. Non-finite numbers are written as
 * null, since JSON has no NaN or infinity.
 */
#ifndef KVPAGER_CLI_JSON_H
#define KVPAGER_CLI_JSON_H

#include <stdint.h>
#include <stdio.h>

#define KVP_JSON_MAX_DEPTH 16

typedef struct kvp_json {
    FILE *out;
    int depth;
    int count[KVP_JSON_MAX_DEPTH]; /* members written at each depth */
} kvp_json;

void kvp_json_init(kvp_json *json, FILE *out);
void kvp_json_object_begin(kvp_json *json, const char *key);
void kvp_json_object_end(kvp_json *json);
void kvp_json_array_begin(kvp_json *json, const char *key);
void kvp_json_array_end(kvp_json *json);
void kvp_json_string(kvp_json *json, const char *key, const char *value);
void kvp_json_uint(kvp_json *json, const char *key, uint64_t value);
void kvp_json_double(kvp_json *json, const char *key, double value);
void kvp_json_bool(kvp_json *json, const char *key, int value);

#endif /* KVPAGER_CLI_JSON_H */
