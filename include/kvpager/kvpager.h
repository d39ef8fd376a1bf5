/*
 * kvpager/kvpager.h: the umbrella header. Include this one.
 *
 * kvpager manages transformer key/value caches in fixed-size pages drawn from
 * one shared pool under a memory budget. Names are kvp_<noun>_<verb>; every
 * fallible call returns a kvp_status and takes an optional kvp_error* last.
 *
 * Threads: every public function's comment has a "Threads:" line, in one of
 * three forms: "thread-safe" (any thread, concurrently with any other call),
 * "one caller at a time per <handle>" (calls on one handle must not overlap;
 * other handles may be used concurrently), or "not safe while <X>". Two rules
 * hold for every call and are not repeated: no call may overlap the destroy
 * of a handle it uses (a destroy frees it), and concurrent calls must not
 * share an out-parameter or a kvp_error. docs/DESIGN.md ("Locking") has the
 * table; cmake/check_thread_lines.py keeps every declaration covered.
 *
 * Names (DESIGN.md, "Naming"): a call that fills a caller's struct from a
 * handle is kvp_<noun>_<thing>_get (kvp_pool_stats_get,
 * kvp_pool_page_layout_get, kvp_layer_binding_get); one quantity has one
 * getter (kvp_param_rows); a count's parameter names its unit (blocks,
 * blocks_adopted, tokens_adopted). Destroying NULL (every *_destroy, and
 * kvp_param_release) does nothing and returns KVP_OK, as free(NULL) does,
 * and leaves *err untouched.
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
#include "kvpager/scheduler.h"
#include "kvpager/paged.h"
#include "kvpager/tier.h"
#include "kvpager/tier_redis.h"

#endif /* KVPAGER_KVPAGER_H */
