/*
 * json.c: the streaming JSON writer (see json.h).
 */
#include "json.h"

#include <math.h>

void kvp_json_init(kvp_json *json, FILE *out)
{
    json->out = out;
    json->depth = 0;
    json->count[0] = 0;
}

static void write_escaped(FILE *out, const char *text)
{
    fputc('"', out);
    for (const unsigned char *p = (const unsigned char *)text; *p != '\0'; p++) {
        if (*p == '"' || *p == '\\') {
            fprintf(out, "\\%c", *p);
        } else if (*p < 0x20) {
            fprintf(out, "\\u%04x", *p);
        } else {
            fputc(*p, out);
        }
    }
    fputc('"', out);
}

/* Writes the separator and the key (if any) of the next member. */
static void member(kvp_json *json, const char *key)
{
    if (json->count[json->depth]++ > 0) {
        fputc(',', json->out);
    }
    if (key != NULL) {
        write_escaped(json->out, key);
        fputc(':', json->out);
    }
}

static void open_scope(kvp_json *json, const char *key, char bracket)
{
    member(json, key);
    fputc(bracket, json->out);
    if (json->depth + 1 < KVP_JSON_MAX_DEPTH) {
        json->depth++;
    }
    json->count[json->depth] = 0;
}

static void close_scope(kvp_json *json, char bracket)
{
    fputc(bracket, json->out);
    if (json->depth > 0) {
        json->depth--;
    }
    if (json->depth == 0 && bracket == '}') {
        fputc('\n', json->out);
    }
}

void kvp_json_object_begin(kvp_json *json, const char *key)
{
    open_scope(json, key, '{');
}

void kvp_json_object_end(kvp_json *json)
{
    close_scope(json, '}');
}

void kvp_json_array_begin(kvp_json *json, const char *key)
{
    open_scope(json, key, '[');
}

void kvp_json_array_end(kvp_json *json)
{
    close_scope(json, ']');
}

void kvp_json_string(kvp_json *json, const char *key, const char *value)
{
    member(json, key);
    write_escaped(json->out, value);
}

void kvp_json_uint(kvp_json *json, const char *key, uint64_t value)
{
    member(json, key);
    fprintf(json->out, "%llu", (unsigned long long)value);
}

void kvp_json_double(kvp_json *json, const char *key, double value)
{
    member(json, key);
    if (isfinite(value)) {
        fprintf(json->out, "%.17g", value);
    } else {
        fputs("null", json->out);
    }
}

void kvp_json_bool(kvp_json *json, const char *key, int value)
{
    member(json, key);
    fputs(value ? "true" : "false", json->out);
}
