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

/* The library's version, "MAJOR.MINOR.PATCH". */
KVP_API const char *kvp_version(void);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_KVPAGER_H */
