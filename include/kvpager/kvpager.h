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

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The version of the library running, "MAJOR.MINOR.PATCH", and as a number
 * (MAJOR * 1000000 + MINOR * 1000 + PATCH). They may differ from the
 * KVP_VERSION_* macros of kvpager/version.h, which give the headers a program
 * was compiled against. Static storage.
 * Threads: thread-safe.
 */
KVP_API const char *kvp_version(void);
KVP_API long kvp_version_number(void);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_KVPAGER_H */
