/*
 * kvpager/kvpager.h: the umbrella header. Include this one.
 *
 * kvpager manages transformer key/value caches in fixed-size pages drawn from
 * one shared pool under a memory budget. Names are kvp_<noun>_<verb>; every
 * fallible call returns a kvp_status and takes an optional kvp_error* last.
 */
#ifndef KVPAGER_KVPAGER_H
#define KVPAGER_KVPAGER_H

#include "kvpager/common.h"
#include "kvpager/version.h"
#include "kvpager/types.h"
#include "kvpager/status.h"
#include "kvpager/pool.h"
#include "kvpager/cache.h"
#include "kvpager/param.h"
#include "kvpager/rope.h"
#include "kvpager/layer.h"
#include "kvpager/attention.h"
#include "kvpager/model.h"
#include "kvpager/sequence.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The version of the library running, "MAJOR.MINOR.PATCH", and as a number
 * (MAJOR * 1000000 + MINOR * 1000 + PATCH). They may differ from the
 * KVP_VERSION_* macros of kvpager/version.h, which give the headers a program
 * was compiled against. Thread-safe; static storage.
 */
KVP_API const char *kvp_version(void);
KVP_API long kvp_version_number(void);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_KVPAGER_H */
