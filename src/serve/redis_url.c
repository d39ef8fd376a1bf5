/*
 * redis_url.c: the Redis store's text: URL parsing, key names, the code
 * names and the error filler (kvpi_redis_fail, declared in redis_conn.h).
 *
 * Invariants: a parse either fills the whole kvpi_redis_url or nothing; no
 * error text holds the password (its part is named, its bytes never
 * copied); echoed parts are cut to 40 bytes. Key names are "kvp:"
 * [namespace ":"] and 32 lowercase hex digits: no byte of a block's
 * content or of its tokens.
 * Callers: src/serve/redis_store.c, src/serve/redis_conn.c, tests.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "serve/redis_conn.h"
#include "serve/redis_store.h"

const char *kvpi_redis_code_name(kvpi_redis_code code) {
    static const char *const names[] = {
        "Ok",      "BadUrl",  "BadArgument", "NoMemory", "Thread",    "Connect", "Auth",
        "Select",  "Timeout", "Io",          "Reply",    "Down",      "QueueFull", "Closed"};
    if ((unsigned)code >= sizeof names / sizeof names[0]) {
        return "Unknown";
    }
    return names[code];
}

void kvpi_redis_fail(kvpi_redis_error *err, kvpi_redis_code code, const char *part,
                     const char *format, ...) {
    if (err == NULL) {
        return;
    }
    err->code = code;
    err->part = part;
    va_list ap;
    va_start(ap, format);
    vsnprintf(err->text, sizeof err->text, format, ap);
    va_end(ap);
}

/* `n` bytes of `s` for an error text: at most 40, then "...". */
static void echo(char *out, size_t size, const char *s, size_t n) {
    if (n > 40) {
        snprintf(out, size, "%.*s...", 40, s);
    } else {
        snprintf(out, size, "%.*s", (int)n, s);
    }
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
        return c - 'A' + 10;
    }
    return -1;
}

/* RFC 3986 unreserved and sub-delims: the bytes userinfo may hold unescaped
 * (':' separates user from password, so it is escaped inside either). */
static bool userinfo_byte(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           strchr("-._~!$&'()*+,;=", c) != NULL;
}

/*
 * Percent-decodes s[0..n) into out[max + 1]. Returns 0, or -1 for a byte
 * userinfo may not hold or a bad escape, -2 when longer than max, -3 for a
 * decoded NUL.
 */
static int decode_userinfo(const char *s, size_t n, char *out, size_t max) {
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        int byte = (unsigned char)s[i];
        if (s[i] == '%') {
            int hi = i + 2 < n ? hex_value(s[i + 1]) : -1;
            int lo = hi >= 0 ? hex_value(s[i + 2]) : -1;
            if (lo < 0) {
                return -1;
            }
            byte = hi * 16 + lo;
            if (byte == 0) {
                return -3;
            }
            i += 2;
        } else if (!userinfo_byte(s[i])) {
            return -1;
        }
        if (len == max) {
            return -2;
        }
        out[len++] = (char)byte;
    }
    out[len] = '\0';
    return 0;
}

static kvpi_redis_code userinfo_error(kvpi_redis_error *err, const char *part, int why,
                                      size_t max) {
    if (why == -2) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, part, "redis URL %s is longer than %zu bytes",
                        part, max);
    } else if (why == -3) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, part, "redis URL %s holds a NUL (%%00)", part);
    } else {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, part,
                        "redis URL %s has a byte that must be %%-escaped, or a bad %%-escape",
                        part);
    }
    return KVPI_REDIS_BAD_URL;
}

/* userinfo s[0..n): "user:password" or ":password". */
static kvpi_redis_code parse_userinfo(const char *s, size_t n, kvpi_redis_url *url,
                                      kvpi_redis_error *err) {
    const char *colon = memchr(s, ':', n);
    if (colon == NULL) {
        char shown[48];
        echo(shown, sizeof shown, s, n);
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "password",
                        "redis URL names user \"%s\" but no password (want user:password@)",
                        shown);
        return KVPI_REDIS_BAD_URL;
    }
    size_t user_len = (size_t)(colon - s);
    int why = decode_userinfo(s, user_len, url->user, KVPI_REDIS_USER_MAX);
    if (why != 0) {
        return userinfo_error(err, "user", why, KVPI_REDIS_USER_MAX);
    }
    if (user_len + 1 == n) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "password", "redis URL password is empty");
        return KVPI_REDIS_BAD_URL;
    }
    why = decode_userinfo(colon + 1, n - user_len - 1, url->password, KVPI_REDIS_PASSWORD_MAX);
    if (why != 0) {
        return userinfo_error(err, "password", why, KVPI_REDIS_PASSWORD_MAX);
    }
    return KVPI_REDIS_OK;
}

static bool host_byte(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '.';
}

/* host s[0..n), bracketed IPv6 or a name; `*end` past it. */
static kvpi_redis_code parse_host(const char *s, size_t n, size_t *end, kvpi_redis_url *url,
                                  kvpi_redis_error *err) {
    char shown[48];
    size_t from = 0, to = 0, after = 0;
    if (n > 0 && s[0] == '[') {
        const char *close = memchr(s, ']', n);
        if (close == NULL) {
            echo(shown, sizeof shown, s, n);
            kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "host",
                            "redis URL host \"%s\" has no closing ']'", shown);
            return KVPI_REDIS_BAD_URL;
        }
        from = 1;
        to = (size_t)(close - s);
        after = to + 1;
        for (size_t i = from; i < to; i++) {
            if (hex_value(s[i]) < 0 && s[i] != ':' && s[i] != '.') {
                echo(shown, sizeof shown, s, after);
                kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "host",
                                "redis URL host \"%s\" is not an IPv6 address", shown);
                return KVPI_REDIS_BAD_URL;
            }
        }
    } else {
        while (to < n && s[to] != ':' && s[to] != '/') {
            to++;
        }
        after = to;
        for (size_t i = 0; i < to; i++) {
            if (!host_byte(s[i])) {
                echo(shown, sizeof shown, s, to);
                kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "host",
                                "redis URL host \"%s\" has a byte other than letters, digits, "
                                "'-' and '.'",
                                shown);
                return KVPI_REDIS_BAD_URL;
            }
        }
    }
    if (to == from) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "host", "redis URL host is empty");
        return KVPI_REDIS_BAD_URL;
    }
    if (to - from > KVPI_REDIS_HOST_MAX) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "host", "redis URL host is longer than %d bytes",
                        KVPI_REDIS_HOST_MAX);
        return KVPI_REDIS_BAD_URL;
    }
    memcpy(url->host, s + from, to - from);
    url->host[to - from] = '\0';
    *end = after;
    return KVPI_REDIS_OK;
}

/* Decimal s[0..n) in [low, high], no sign, no leading zero but "0". */
static bool parse_number(const char *s, size_t n, unsigned long low, unsigned long high,
                         unsigned *out) {
    if (n == 0 || n > 10 || (n > 1 && s[0] == '0')) {
        return false;
    }
    unsigned long value = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') {
            return false;
        }
        value = value * 10 + (unsigned long)(s[i] - '0');
    }
    if (value < low || value > high) {
        return false;
    }
    *out = (unsigned)value;
    return true;
}

/* ":port" and "/db" of s[0..n) (after the host). */
static kvpi_redis_code parse_port_db(const char *s, size_t n, kvpi_redis_url *url,
                                     kvpi_redis_error *err) {
    char shown[48];
    size_t i = 0;
    url->port = 6379;
    url->db = 0;
    if (i < n && s[i] == ':') {
        size_t start = ++i;
        while (i < n && s[i] != '/') {
            i++;
        }
        if (!parse_number(s + start, i - start, 1, 65535, &url->port)) {
            echo(shown, sizeof shown, s + start, i - start);
            kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "port",
                            "redis URL port \"%s\" is not a number from 1 to 65535", shown);
            return KVPI_REDIS_BAD_URL;
        }
    }
    if (i < n && s[i] == '/') {
        size_t start = ++i;
        if (start == n) {
            return KVPI_REDIS_OK; /* "host:port/": database 0 */
        }
        if (!parse_number(s + start, n - start, 0, 2147483647UL, &url->db)) {
            echo(shown, sizeof shown, s + start, n - start);
            kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "database",
                            "redis URL database \"%s\" is not a number from 0 to 2147483647",
                            shown);
            return KVPI_REDIS_BAD_URL;
        }
        i = n;
    }
    if (i != n) {
        echo(shown, sizeof shown, s + i, n - i);
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "url",
                        "redis URL has \"%s\" after the host, where only :port and /db may be",
                        shown);
        return KVPI_REDIS_BAD_URL;
    }
    return KVPI_REDIS_OK;
}

static kvpi_redis_code parse_scheme(const char *text, size_t *rest, kvpi_redis_error *err) {
    const char *sep = strstr(text, "://");
    if (sep == NULL) {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "scheme",
                        "redis URL has no scheme (want redis://host:port/db)");
        return KVPI_REDIS_BAD_URL;
    }
    size_t n = (size_t)(sep - text);
    if (n != 5 || memcmp(text, "redis", 5) != 0) {
        char shown[48];
        echo(shown, sizeof shown, text, n);
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "scheme",
                        "redis URL scheme \"%s\" is not supported (want redis)", shown);
        return KVPI_REDIS_BAD_URL;
    }
    *rest = n + 3;
    return KVPI_REDIS_OK;
}

kvpi_redis_code kvpi_redis_url_parse(const char *text, kvpi_redis_url *out,
                                     kvpi_redis_error *err) {
    if (text == NULL || out == NULL || text[0] == '\0') {
        kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "url", "redis URL is empty");
        return KVPI_REDIS_BAD_URL;
    }
    for (const char *p = text; *p != '\0'; p++) {
        if ((unsigned char)*p <= ' ' || (unsigned char)*p >= 0x7f) {
            kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "url",
                            "redis URL has a space, control or non-ASCII byte at offset %zu",
                            (size_t)(p - text));
            return KVPI_REDIS_BAD_URL;
        }
    }
    static const kvpi_redis_url empty;
    kvpi_redis_url url = empty;
    size_t at = 0;
    kvpi_redis_code code = parse_scheme(text, &at, err);
    if (code != KVPI_REDIS_OK) {
        return code;
    }
    const char *authority = text + at;
    size_t n = strlen(authority);
    const char *last_at = strrchr(authority, '@');
    if (last_at != NULL) {
        size_t info = (size_t)(last_at - authority);
        if (memchr(authority, '@', info) != NULL) {
            kvpi_redis_fail(err, KVPI_REDIS_BAD_URL, "password",
                            "redis URL has more than one '@' (write '@' in a password as %%40)");
            return KVPI_REDIS_BAD_URL;
        }
        code = parse_userinfo(authority, info, &url, err);
        if (code != KVPI_REDIS_OK) {
            return code;
        }
        authority = last_at + 1;
        n -= info + 1;
    }
    size_t end = 0;
    code = parse_host(authority, n, &end, &url, err);
    if (code == KVPI_REDIS_OK) {
        code = parse_port_db(authority + end, n - end, &url, err);
    }
    if (code == KVPI_REDIS_OK) {
        *out = url;
    }
    return code;
}

size_t kvpi_redis_url_format(const kvpi_redis_url *url, char *buf, size_t size) {
    const char *open = strchr(url->host, ':') != NULL ? "[" : "";
    const char *close = open[0] != '\0' ? "]" : "";
    int n;
    if (url->password[0] == '\0') {
        n = snprintf(buf, size, "redis://%s%s%s:%u/%u", open, url->host, close, url->port,
                     url->db);
    } else {
        n = snprintf(buf, size, "redis://%s:***@%s%s%s:%u/%u", url->user, open, url->host,
                     close, url->port, url->db);
    }
    return n < 0 ? 0 : (size_t)n;
}

bool kvpi_redis_namespace_valid(const char *ns) {
    size_t n = strlen(ns);
    if (n == 0 || n > KVPI_REDIS_NAMESPACE_MAX) {
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        if (!host_byte(ns[i]) && ns[i] != '_') {
            return false;
        }
    }
    return true;
}

size_t kvpi_redis_key_name(const char *ns, const kvp_block_key *key, char *buf) {
    static const char digits[] = "0123456789abcdef";
    size_t n = 0;
    memcpy(buf, "kvp:", 4);
    n = 4;
    if (ns != NULL && ns[0] != '\0') {
        size_t len = strlen(ns);
        memcpy(buf + n, ns, len);
        n += len;
        buf[n++] = ':';
    }
    const uint64_t words[2] = {key->hi, key->lo};
    for (int w = 0; w < 2; w++) {
        for (int shift = 60; shift >= 0; shift -= 4) {
            buf[n++] = digits[(words[w] >> shift) & 0xf];
        }
    }
    buf[n] = '\0';
    return n;
}
