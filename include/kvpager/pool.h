/*
 * kvpager/pool.h: the shared page pool.
 *
 * A pool owns a fixed budget of equal-size physical pages carved from one
 * slab. The slab is allocated once, at creation, from the pool's slab source
 * (kvp_slab_source below: by default a jemalloc arena of the pool's own when
 * the process has jemalloc, else an anonymous mmap), and is never moved,
 * grown or shrunk. A page holds K and V for
 * `block_tokens` positions of every stored head of one cache lane (the
 * stored heads are a layer's KV heads, kv_heads, which grouped-query layers
 * keep below their query heads), as elements of the pool's storage type
 * `dtype` (f64, f32, bf16, f16 or fp8 e4m3; kvp_dtype below):
 *
 *     K[heads][block_tokens][head_width]  then  V[heads][block_tokens][head_width]
 *
 * row-major, with no padding: the row of (head h, slot s) starts
 * (h * block_tokens + s) * head_width elements into the page for keys and
 * ((heads + h) * block_tokens + s) * head_width for values; features are
 * contiguous. So page_bytes = 2 * heads * block_tokens * head_width *
 * kvp_dtype_bytes(dtype) and total_pages = floor(budget_bytes / page_bytes).
 *
 * Storage precision: callers always hand kvpager f64 rows and read f64 back.
 * An appended row is rounded once, to nearest with ties to even, from f64 to
 * the pool's type (see kvp_dtype; fp8 first divides by the cache's K or V
 * scale); every read widens the stored element to f64, which is exact, and
 * all arithmetic runs in f64 on the widened values. Every cache of a pool
 * stores in the pool's dtype: the pool decides.
 *
 * (kvp_page_layout and kvp_pool_page_data below give a page's address and
 * strides to kernels outside kvpager; kvp_pool_page_base gives the slab's
 * address and the page stride, so a kernel computes any page's address.)
 *
 * Pages are handed out to caches (kvpager/cache.h) and to the reservations
 * that attention tickets, steps and caches' row reservations hold; the pool tracks who
 * holds what so that kvp_pool_check can recompute every invariant.
 *
 * Threads: every pool call is thread-safe (the pool's mutex), except
 * kvp_pool_destroy (no other call on the pool may overlap it) and
 * kvp_pool_digest (not while rows are written into the pool's pages). A pool
 * must outlive its caches.
 */
#ifndef KVPAGER_POOL_H
#define KVPAGER_POOL_H

#include "kvpager/common.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_pool kvp_pool;

/*
 * A 128-bit chain key naming the contents of one full page of one cache
 * lane in the pool's prefix index (kvpager/cache.h: kvp_block_key_chain,
 * kvp_cache_publish_block, kvp_cache_adopt_prefix). Opaque: compare both
 * words. The all-zero key is never produced by kvp_block_key_chain.
 */
/* Bytes of a pool's key secret (kvp_pool_config.key_secret): a BLAKE2b key. */
#define KVP_KEY_SECRET_BYTES 32

typedef struct kvp_block_key {
    uint64_t lo;
    uint64_t hi;
} kvp_block_key;

/*
 * The element type of a pool's pages. Values are stable (ABI).
 *   KVP_F64   IEEE binary64, 8 bytes: rows are stored exactly as appended.
 *   KVP_F32   IEEE binary32, 4 bytes: each element rounded to nearest, ties
 *             to even (the C conversion). Subnormal results are kept.
 *   KVP_BF16  bfloat16 (binary32's sign, 8-bit exponent and top 7 fraction
 *             bits), 2 bytes: each element rounded ONCE from f64 to the
 *             nearest bf16, ties to even, never through f32 (that would
 *             round twice). Subnormal results are kept.
 *   KVP_F16   IEEE binary16 (1 sign, 5 exponent bits of bias 15, 10
 *             fraction bits), 2 bytes: each element rounded ONCE from f64
 *             to the nearest f16, ties to even, never through f32.
 *             Subnormal results are kept (down to 2^-24). Largest finite
 *             65504. Error of one element: at most 2^-11 relative for
 *             |x| >= 2^-14, 2^-25 absolute below.
 *   KVP_FP8_E4M3  OCP fp8 "e4m3fn" (1 sign, 4 exponent bits of bias 7, 3
 *             fraction bits; no infinities, 0x7f and 0xff are NaN), 1 byte:
 *             a key element x is stored as e = round(x / k_scale), a value
 *             element as round(x / v_scale) (kvp_binding's scales, 1.0 by
 *             default; vLLM's fp8 KV cache): the quotient is computed in
 *             f64, then rounded ONCE to the nearest e4m3, ties to even
 *             (two roundings in all; the first is exact when the scale is
 *             a power of two). Subnormals kept (down to 2^-9), largest
 *             finite 448. e stands for e * scale: exports
 *             (kvp_cache_keys) give that product; kernels reading pages
 *             multiply once (the scores by k_scale with 1/sqrt(d_h), each
 *             output feature by v_scale). Error of one element, in units
 *             of the scale: at most 2^-4 relative for |x / scale| >= 2^-6,
 *             2^-10 absolute below.
 * A finite f64 element whose rounding would overflow (|x| at or above
 * 0x1.ffffffp+127 for f32, 0x1.ffp+127 for bf16, 65520 for f16: the
 * midpoints where the tie goes to infinity; |x / scale| above 464 for e4m3,
 * the midpoint between 448 and the missing next step 480, a tie rounding to
 * 448) is refused before anything changes: NONFINITE_KEY or NONFINITE_VALUE
 * with err.what naming the storage type ("f32", "bf16", "f16" or
 * "fp8_e4m3"), err.value the f64 element (status.h). fp8 refuses rather than
 * saturating to 448 as vLLM does: a saturated element silently changes
 * attention by an unbounded amount, while a refusal tells the caller its
 * scales are too small, and every other dtype refuses too.
 */
typedef enum kvp_dtype {
    KVP_F64 = 0,
    KVP_F32 = 1,
    KVP_BF16 = 2,
    KVP_F16 = 3,
    KVP_FP8_E4M3 = 4
} kvp_dtype;

/*
 * Growing structs (ABI). Every struct a caller allocates and hands to
 * kvpager to read (a config) or to fill (stats, info) starts with
 * `struct_size`, the caller's sizeof, set by its *_init function. A newer
 * library with a longer struct then serves an older caller: it reads only the
 * fields the caller's struct_size covers (the others take their defaults)
 * and writes only the fields it covers, never a byte past struct_size. A
 * caller newer than the library may pass a longer struct: the library reads
 * and writes only the fields it knows, and refuses an input whose unknown
 * tail is not all zero (a setting it cannot honour). Fields are only ever
 * appended, each at or past the previous release's sizeof (never into its
 * tail padding, which an older caller's struct_size covers but does not
 * set). A struct_size of zero, or below the struct's first release
 * (every field up to the one marked "first release ends here"), is refused
 * with INVALID_ARGUMENT, argument "struct_size", before anything else is read.
 */

/*
 * Where a pool's slab comes from. Values are stable (ABI). Whatever the
 * source, the slab is allocated once per kvp_pool_create and freed once by
 * kvp_pool_destroy, never resized, and aligned to KVP_SLAB_ALIGNMENT.
 *   KVP_SLAB_DEFAULT   KVP_SLAB_JEMALLOC when jemalloc is in the process
 *                      (the program links it, preloads it or loaded it before
 *                      kvpager), else KVP_SLAB_MMAP. libkvpager.so does not
 *                      depend on jemalloc itself, so a host that dlopen()s it
 *                      never loads jemalloc (whose initial-exec TLS can fail
 *                      to load after start-up: "cannot allocate memory in
 *                      static TLS block").
 *   KVP_SLAB_JEMALLOC  an arena of the pool's own in the process's jemalloc;
 *                      freed pages go back to the system at once. Refused
 *                      with INVALID_ARGUMENT ("slab_source") when jemalloc is
 *                      not in the process.
 *   KVP_SLAB_MMAP      mmap(PROT_READ | PROT_WRITE, MAP_PRIVATE |
 *                      MAP_ANONYMOUS | MAP_NORESERVE), munmap at destroy: the
 *                      budget is address space, and memory is committed only
 *                      as pages are first written.
 *   KVP_SLAB_CUSTOM    the config's slab_alloc / slab_free hooks.
 *   KVP_SLAB_RESERVED  pages with no memory behind them, for the allocator
 *                      alone (kvp_scheduler with compute 0, capacity
 *                      planning): mmap(PROT_NONE, MAP_PRIVATE |
 *                      MAP_ANONYMOUS | MAP_NORESERVE), never touched, so a
 *                      budget past physical memory costs only the pool's
 *                      metadata (and address space). Pages are taken,
 *                      shared, promised, evicted and audited as in any
 *                      pool, but hold no data: what would read or write it
 *                      is refused with INVALID_ARGUMENT (argument "pool"):
 *                      kvp_pool_page_data, kvp_pool_page_base,
 *                      kvp_pool_digest, kvp_cache_digest;
 *                      kvp_cache_create of a layer-bound
 *                      binding (so no sequence); an external cache's
 *                      append_rows, commit_rows, reserved_slots and
 *                      commit_written; kvp_paged_attention over its
 *                      caches. A copy-on-write copies nothing.
 */
typedef enum kvp_slab_source {
    KVP_SLAB_DEFAULT = 0,
    KVP_SLAB_JEMALLOC = 1,
    KVP_SLAB_MMAP = 2,
    KVP_SLAB_CUSTOM = 3,
    KVP_SLAB_RESERVED = 4
} kvp_slab_source;

/* The alignment every slab has, in bytes (a cache line). */
#define KVP_SLAB_ALIGNMENT 64

/*
 * A slab allocator hook (KVP_SLAB_CUSTOM). kvp_pool_create calls slab_alloc
 * once, after every argument check, with bytes = total_pages * page_bytes
 * (nonzero, at most budget_bytes) and alignment = KVP_SLAB_ALIGNMENT; it
 * returns at least `bytes` writable bytes aligned to `alignment`, or NULL
 * (the create then fails with ALLOCATION_FAILED, what "page slab"). A
 * pointer that is not aligned is handed straight back to slab_free and the
 * create fails the same way. slab_free is called once with the same pointer
 * and bytes: by kvp_pool_destroy, or by a create that fails after the slab
 * was allocated. Neither is called with the pool's lock held, both run on
 * the thread that calls create or destroy, and ctx is passed as given; the
 * hooks must be safe to call from any thread that creates or destroys pools.
 * The memory need not be zeroed; kvpager never reads a page before writing
 * it (kvp_pool_digest excepted, which reads whatever is there).
 */
typedef void *(*kvp_slab_alloc_fn)(void *ctx, size_t bytes, size_t alignment);
typedef void (*kvp_slab_free_fn)(void *ctx, void *slab, size_t bytes);

typedef struct kvp_pool_config {
    size_t struct_size;  /* sizeof(kvp_pool_config) of the caller: kvp_pool_config_init */
    size_t block_tokens; /* positions per page */
    size_t heads;        /* stored (KV) heads per lane: a layer's kv_heads */
    size_t head_width;   /* features per head (d_h) */
    size_t budget_bytes; /* memory budget for the page slab */
    kvp_dtype dtype;     /* element type of the pages; KVP_F64 (0) by default */
    /* first release ends here; later fields default when struct_size does not cover them */
    kvp_slab_alloc_fn slab_alloc; /* KVP_SLAB_CUSTOM only; NULL by default */
    kvp_slab_free_fn slab_free;   /* KVP_SLAB_CUSTOM only; NULL by default */
    void *slab_ctx;               /* passed to both hooks */
    kvp_slab_source slab_source;  /* KVP_SLAB_DEFAULT by default */
    /*
     * The secret that keys the pool's prefix-index hash (KVP_KEY_SECRET_BYTES
     * bytes; kvp_block_key_chain). All zero, the default: the pool draws a
     * random one at creation (libsodium's randombytes_buf), so no one outside
     * the process can predict, collide or probe its keys. Set it only when
     * pools (of this process or others) must agree on keys, and keep it as
     * secret as the data: whoever holds it can compute any key (DESIGN.md,
     * Threat model). Read at creation only; the pool keeps its own copy.
     */
    uint64_t key_secret[KVP_KEY_SECRET_BYTES / sizeof(uint64_t)];
} kvp_pool_config;

/*
 * Which counters a failed call can change: only `exhaustions`, which counts
 * refusals (a call that fails with POOL_EXHAUSTED adds one; see status.h).
 * A prefill's pages are tentative while it runs: they are held (free_pages
 * is lower, held_pages and tentative_pages higher) but acquires and the
 * high-water mark count them only when the prefill succeeds; a failed
 * prefill gives them back and leaves acquires, releases and the high-water
 * mark exactly as they were.
 */
typedef struct kvp_pool_stats {
    size_t struct_size;         /* sizeof(kvp_pool_stats) of the caller: kvp_pool_stats_init */
    size_t total_pages;
    size_t free_pages;          /* on the free list (evictable pages are not counted) */
    size_t held_pages;          /* total - free - evictable, tentative pages included */
    size_t high_water_pages;    /* the largest held_pages - tentative_pages ever observed */
    uint64_t acquires;          /* pages handed out by calls that succeeded, over the pool's life */
    uint64_t releases;          /* pages returned, over the pool's life */
    uint64_t exhaustions;       /* requests refused with KVP_POOL_EXHAUSTED */
    size_t page_bytes;
    size_t slab_bytes;          /* total_pages * page_bytes */
    size_t attached_caches;
    size_t attached_reservations;
    uintptr_t slab_address;     /* for audits: the slab never moves */
    size_t promised_pages;      /* promised to sequences and not yet taken */
    size_t tentative_pages;     /* held by prefills still running (0 when quiescent) */
    kvp_dtype dtype;            /* the pages' element type */
    size_t element_bytes;       /* kvp_dtype_bytes(dtype) */
    /* first release ends here */
    kvp_slab_source slab_source; /* the source in use: JEMALLOC, MMAP or CUSTOM */
    /* sharing (kvpager/cache.h: fork, truncate, prefix index) */
    size_t cached_pages;        /* pages the prefix index names, held or evictable (a page
                                   a pending take borrowed from the LRU list included) */
    size_t evictable_pages;     /* cached pages no page table names: neither free nor held */
    uint64_t prefix_hits;       /* pages shared by kvp_cache_adopt_prefix (per lane and block) */
    uint64_t prefix_misses;     /* lookups that found no page (each ends an adopt) */
    uint64_t evictions;         /* evictable pages a take reused for good (mapped), dropping
                                   their index entry; a cancelled take's pages go back */
    uint64_t cow_copies;        /* shared partial pages copied before an append wrote them */
    uint64_t window_releases;   /* pages sliding windows released (front truncation: a
                                   block past every window's reach), over the pool's life */
} kvp_pool_stats;

/* The answer of kvp_pool_admit, as vLLM's AllocStatus. */
typedef enum kvp_admission {
    KVP_ADMIT_NOW = 0,   /* fits now, keeping the watermark free */
    KVP_ADMIT_LATER = 1, /* fits once running sequences give pages back */
    KVP_ADMIT_NEVER = 2  /* can never fit: more than total pages minus the watermark */
} kvp_admission;

/* Called once per audit finding, in the order found. */
typedef void (*kvp_mismatch_fn)(void *ctx, const kvp_mismatch *mismatch);

/*
 * Sets struct_size to sizeof(kvp_pool_config) and every field to its
 * default: block_tokens 16, 8 heads of width 64, a 64 MiB budget, KVP_F64,
 * KVP_SLAB_DEFAULT with no hooks. A NULL config is ignored.
 * Threads: thread-safe (touches only *config).
 */
KVP_API void kvp_pool_config_init(kvp_pool_config *config);

/*
 * Zeroes *stats and sets struct_size to sizeof(kvp_pool_stats). NULL is ignored.
 * Threads: thread-safe (touches only *stats).
 */
KVP_API void kvp_pool_stats_init(kvp_pool_stats *stats);

/*
 * "default", "jemalloc", "mmap", "custom"; "unknown" for any other value. Never NULL.
 * Threads: thread-safe (static strings).
 */
KVP_API const char *kvp_slab_source_name(kvp_slab_source source);

/*
 * "f64", "f32", "bf16", "f16", "fp8_e4m3"; "unknown" for any other value. Never NULL.
 * Threads: thread-safe (static strings).
 */
KVP_API const char *kvp_dtype_name(kvp_dtype dtype);

/*
 * Bytes of one stored element: 8, 4, 2, 2, 1; 0 for any other value.
 * Threads: thread-safe.
 */
KVP_API size_t kvp_dtype_bytes(kvp_dtype dtype);

/*
 * Creates a pool. Errors, in this order: NULL_ARGUMENT (config, out);
 * INVALID_ARGUMENT (`argument` "struct_size": see "Growing structs");
 * ZERO_SIZE (any size zero, `argument` names it); INVALID_ARGUMENT
 * (`argument` "dtype": not a kvp_dtype; "slab_source": not a
 * kvp_slab_source, or KVP_SLAB_JEMALLOC without jemalloc in the process);
 * NULL_ARGUMENT ("slab_alloc", then "slab_free": KVP_SLAB_CUSTOM without
 * that hook); SIZE_OVERFLOW (page_bytes overflows, or more pages than a
 * 32-bit page id can name); BUDGET_TOO_SMALL; ALLOCATION_FAILED.
 * Threads: thread-safe (jemalloc arenas are taken under a process-wide
 * mutex; KVP_SLAB_CUSTOM hooks must be safe to call from any thread).
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_create(const kvp_pool_config *config, kvp_pool **out,
                                                 kvp_error *err);

/*
 * Destroys an idle pool. While caches are attached, reservations are held or
 * any page is held, it refuses with POOL_BUSY and changes nothing.
 * NULL: nothing happens and KVP_OK is returned, as free(NULL) (kvpager.h).
 * Threads: not safe while any other call uses the pool: POOL_BUSY sees
 * attached caches and held pages, not a call running on another thread
 * (which would touch the freed pool).
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_destroy(kvp_pool *pool, kvp_error *err);

/*
 * A consistent snapshot of the pool's counters, written to the fields
 * out->struct_size covers (kvp_pool_stats_init). Errors: NULL_ARGUMENT;
 * INVALID_ARGUMENT ("struct_size"), writing nothing.
 * Threads: thread-safe (one snapshot under the pool's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_stats_get(kvp_pool *pool, kvp_pool_stats *out,
                                                    kvp_error *err);

/*
 * The audit. Under the pool's lock, recomputes from scratch:
 *   the page geometry: page_bytes == 2 * heads * block_tokens * head_width *
 *      kvp_dtype_bytes(dtype) (a STATS finding otherwise);
 *   I1 free + evictable + held == total, and the cached counters;
 *   I2 no page on the free list twice, free pages have reference count 0;
 *   I3 each page's reference count equals the page-table slots and
 *      reservation entries that name it, across every attached cache and
 *      reservation (a page shared by forks or adopters counts each);
 *   I4 every lane of every attached cache maps exactly ceil(len/block_tokens)
 *      pages, contiguously from block 0;
 *   I5 the prefix index and the LRU list: every index entry names a
 *      registered page whose stored key it is, reachable from the key's home
 *      slot, once; the LRU list holds exactly the registered pages at
 *      reference count 0, once each; free pages are not registered; and a
 *      cache whose partial last page is shared or registered will copy it
 *      before its next append writes (copy-on-write).
 * The findings are gathered under the lock into a fixed array (the audit
 * allocates nothing); after the lock is released, each is passed, in the
 * order found, to `on_mismatch` (which may be NULL), on the calling thread.
 * So the callback may call the pool (kvp_pool_stats_get, even
 * kvp_pool_check) without deadlock; what it reads there may be newer than
 * the audited state when other threads work on the pool. Only the first
 * KVP_POOL_CHECK_REPORTS findings reach the callback; err.mismatches counts
 * them all. Returns KVP_OK, or AUDIT_FAILED with the count and the first
 * mismatch in *err. Changes nothing.
 * Threads: thread-safe: caches' owners change every reference state the
 * audit reads (len, page tables, reservations) under the pool's mutex too,
 * so it may run while they work; on_mismatch runs after the unlock.
 */
#define KVP_POOL_CHECK_REPORTS 64 /* findings one kvp_pool_check passes to its callback */
KVP_API KVP_NODISCARD kvp_status kvp_pool_check(kvp_pool *pool, kvp_mismatch_fn on_mismatch,
                                                void *ctx, kvp_error *err);

/*
 * Admission control: may a new sequence needing `pages` pages start now?
 * NEVER when pages + watermark_pages > total pages; NOW when
 * free + evictable - promised >= pages + watermark_pages (an evictable page
 * is reused by the next take that finds no free one); LATER otherwise. Pages promised
 * to running sequences (kvp_sequence_promise) and not yet taken count as used.
 * Threads: thread-safe (under the pool's mutex); the answer is a snapshot,
 * which other threads' takes, returns and promises may change at once.
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_admit(kvp_pool *pool, size_t pages,
                                                size_t watermark_pages, kvp_admission *out,
                                                kvp_error *err);

/*
 * lanes * ceil(tokens / block_tokens): the pages `lanes` lanes need for
 * `tokens`. Saturates: when the product does not fit a size_t the answer is
 * SIZE_MAX, which kvp_pool_admit answers KVP_ADMIT_NEVER (no pool has that
 * many pages), so an overflow can never pass for a small request. A NULL
 * pool gives 0.
 * Threads: thread-safe (reads only the fixed geometry).
 */
KVP_API size_t kvp_pool_pages_for(const kvp_pool *pool, size_t lanes, size_t tokens);

/*
 * The format of a pool's pages, for kernels that read them directly (the
 * same for every page of the pool). A page holds positions 0 ..
 * block_tokens - 1 of one block of one cache lane: keys first, then values,
 * each head-major, [heads][block_tokens][head_width] elements of `dtype`,
 * row-major without padding. The key element (h, s, i) of a page is at
 *     keys + h * head_stride + s * row_stride + i              (elements)
 * and the value element at the same offset from values, where values =
 * keys + values_offset_bytes. f64 elements are IEEE binary64, f32 binary32,
 * bf16 the top 16 bits of a binary32 (uint16_t), f16 IEEE binary16
 * (uint16_t), fp8_e4m3 one byte (OCP e4m3fn) holding e, which stands for
 * e * k_scale (keys) or e * v_scale (values) of the cache's binding; all in
 * the host's byte order. Slots at or past a block's rows (a lane of len positions fills
 * len - block * block_tokens slots of its last block) hold nothing: never
 * read them.
 */
typedef struct kvp_page_layout {
    size_t struct_size;         /* a growing struct: set by kvp_page_layout_init */
    kvp_dtype dtype;
    size_t element_bytes;       /* kvp_dtype_bytes(dtype) */
    size_t heads;               /* stored (KV) heads */
    size_t block_tokens;
    size_t head_width;
    size_t head_stride;         /* elements from (h, s) to (h + 1, s): block_tokens * head_width */
    size_t row_stride;          /* elements from (h, s) to (h, s + 1): head_width */
    size_t head_stride_bytes;   /* head_stride * element_bytes */
    size_t row_stride_bytes;    /* row_stride * element_bytes */
    size_t values_offset_bytes; /* values - keys: heads * head_stride_bytes */
    size_t page_bytes;          /* 2 * values_offset_bytes */
} kvp_page_layout;

/*
 * Zeroes *layout and sets struct_size to sizeof(kvp_page_layout). NULL is ignored.
 * Threads: thread-safe (touches only *layout).
 */
KVP_API void kvp_page_layout_init(kvp_page_layout *layout);

/*
 * The page format of `pool` (kvp_page_layout above), the same for every
 * page, held or free. (kvp_pool_page_layout before 0.2: getters end in _get,
 * kvpager.h.) Errors: NULL_ARGUMENT (pool, out); INVALID_ARGUMENT
 * (out's struct_size: call kvp_page_layout_init first).
 * Threads: thread-safe (the geometry never changes).
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_page_layout_get(const kvp_pool *pool,
                                                          kvp_page_layout *out, kvp_error *err);

/*
 * The address of a held page's keys and values (read-only) and, when
 * `layout` is not NULL, the page format above. A page id comes from
 * kvp_cache_block_table (or kvp_cache_page); the addresses stay valid as
 * long as that page id does (until the next call that changes its cache),
 * and the slab never moves. Errors, in this order: NULL_ARGUMENT (pool, keys,
 * values); INVALID_ARGUMENT (layout's struct_size); OUT_OF_RANGE (argument "page", page >= total pages); PAGE_NOT_HELD
 * (err.index = page, err.what "free": the page is on the free list, or
 * "evictable": cached in the prefix index but named by no page table; only
 * held pages have data). Allocates nothing.
 * Threads: thread-safe, and it takes no lock for a held page (the held
 * check is an atomic read of the page's reference count, which the pool
 * writes under its mutex; only a refusal takes the mutex): kernels may call
 * it per block on many threads at once. Reading rows through the addresses
 * is not safe while the page's cache is changed (an append, commit, reset
 * or destroy may write or free the page): a cache has one owner at a time,
 * who decides when its rows may be read.
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_page_data(kvp_pool *pool, uint32_t page,
                                                    const void **keys, const void **values,
                                                    kvp_page_layout *layout, kvp_error *err);

/*
 * Page addresses without a call per page: the slab's first byte and the
 * distance between pages, so a kernel computes page p's address from its id,
 *     keys of page p:   (unsigned char *)*base + p * *page_stride
 *     values of page p: that + values_offset_bytes (kvp_page_layout),
 * for p < *pages (the pool's total pages; `pages` may be NULL).
 * *page_stride == kvp_page_layout's page_bytes: pages are packed, and page
 * p's bytes are exactly [p * page_bytes, (p + 1) * page_bytes) of the slab.
 * Lifetime: the pool's. The slab is allocated once by kvp_pool_create and
 * never moves, grows or shrinks, so every call gives the same answer until
 * kvp_pool_destroy, after which the address must not be used.
 * What the address may be used for is the caches' business, not the
 * slab's: read the rows of held pages named by a block table
 * (kvp_cache_block_table), as long as the table is valid; write only the
 * slots a row reservation gives out (kvp_cache_reserved_slots). Every other
 * byte belongs to someone else (free pages are even NOACCESS under
 * Valgrind memcheck).
 * Errors: NULL_ARGUMENT (pool, base, page_stride). Allocates nothing.
 * Threads: thread-safe; takes no lock (it reads fields fixed at creation).
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_page_base(const kvp_pool *pool, void **base,
                                                    size_t *page_stride, size_t *pages,
                                                    kvp_error *err);

/*
 * For audits: a 64-bit FNV-1a digest of every byte of the slab, held and free
 * pages alike, so a caller can prove an operation wrote no page (reset, for
 * one). Safe under Valgrind: the read of free (NOACCESS) pages is exempted
 * from memcheck's reports, and the digest is marked defined. Row data is
 * written by caches' owners without the pool lock, so take the digest only
 * while no thread appends to a cache of this pool.
 * Threads: not safe while any thread writes rows into the pool's pages:
 * kvp_cache_append_rows(_typed), kvp_cache_commit_rows(_typed), a kernel
 * writing reserved slots in place, kvp_cache_commit_written, kvp_ticket_commit,
 * kvp_attention_forward, kvp_sequence_step, kvp_sequence_prefill or
 * kvp_decoder_step on a cache or sequence of this pool. Other pool calls,
 * prepares, reserves, resets and reads may overlap it (the slab is hashed
 * under the pool's mutex, and they write no row).
 */
KVP_API KVP_NODISCARD kvp_status kvp_pool_digest(kvp_pool *pool, uint64_t *out, kvp_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_POOL_H */
