/*
 * kvpager/common.h: export and attribute macros shared by every public header.
 *
 * Owns: KVP_API (symbol visibility) and KVP_NODISCARD (every fallible call's
 * status must be looked at). Nothing here has state.
 * Callers: the public headers only.
 */
#ifndef KVPAGER_COMMON_H
#define KVPAGER_COMMON_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__) || defined(__clang__)
#define KVP_API __attribute__((visibility("default")))
#define KVP_NODISCARD __attribute__((warn_unused_result))
#else
#define KVP_API
#define KVP_NODISCARD
#endif

/* KVP_VERSION_*: generated from the build's project(VERSION). */
#include "kvpager/version.h"

/* The largest tensor rank a kvp_shape can describe. */
#define KVP_MAX_RANK 8

#endif /* KVPAGER_COMMON_H */
