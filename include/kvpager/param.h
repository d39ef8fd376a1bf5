/*
 * kvpager/param.h: attention parameters with identity and revision.
 *
 * A parameter is a rows x cols f64 matrix (row-major, applied to a row
 * vector x of `rows` features as y = x W, giving `cols` features). Attention's
 * W_q and W_o are square (D x D); a grouped layer's W_k and W_v are
 * D x (kv_heads * d_h) (kvpager/layer.h). It has a node identity, unique in the process and
 * never reused, and a value revision that every in-place update advances, even
 * when the new values equal the old ones. Caches capture both (kvp_binding),
 * so a cache can tell a rebuilt layer (new identities) from one updated in
 * place (same identities, newer revisions).
 *
 * Parameters are reference counted: layers that share a parameter hold a
 * reference each, and the parameter is freed with its last reference.
 * Threads:
 *   - retain and release are atomic: any thread, any time;
 *   - the id and width never change; the revision is a C11 atomic, so
 *     kvp_param_revision may be called from any thread at any time, also
 *     while another thread updates the parameter (it reads the revision
 *     before or after that update, never a torn value), and a binding or a
 *     prepare that reads it races with nothing;
 *   - the values are not atomic: an update (kvp_param_update,
 *     kvp_param_update_with) needs exclusive access to them. While it runs,
 *     no other thread may read them (kvp_param_values, or computing with a
 *     layer that uses the parameter: prepares, steps, prefills, decoder
 *     batches, kvp_attention_reference) or update the same parameter. The
 *     caller provides that exclusion (for example, updates between decoder
 *     batches). After the update returns, a thread that has synchronized
 *     with the updater (a mutex, a join, or reading the new revision) sees
 *     the new values.
 */
#ifndef KVPAGER_PARAM_H
#define KVPAGER_PARAM_H

#include "kvpager/common.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_param kvp_param;

/* The four parameters of an attention layer, in the seed's stable order. */
enum { KVP_PARAM_QUERY = 0, KVP_PARAM_KEY = 1, KVP_PARAM_VALUE = 2, KVP_PARAM_OUTPUT = 3,
       KVP_PARAM_COUNT = 4 };

/*
 * Called by kvp_param_update_with to change values[0 .. rows*cols) in place.
 * `width` is kvp_param_rows (the row count): for a square parameter that is
 * all it needs; a callback for a rectangular one reads kvp_param_cols.
 */
typedef void (*kvp_param_update_fn)(void *ctx, double *values, size_t width);

/*
 * A new parameter holding a copy of width*width `values`, with one reference
 * owned by the caller. Errors: NULL_ARGUMENT, INVALID_ARGUMENT (width 0 or
 * width*width overflows), ALLOCATION_FAILED.
 * Threads: thread-safe (identities come from an atomic counter).
 */
KVP_API KVP_NODISCARD kvp_status kvp_param_create(size_t width, const double *values,
                                                  kvp_param **out, kvp_error *err);

/*
 * The same for a rows x cols parameter holding a copy of rows*cols `values`;
 * kvp_param_create(w, ...) is kvp_param_create_matrix(w, w, ...). Errors:
 * NULL_ARGUMENT, INVALID_ARGUMENT (rows or cols 0, or rows*cols overflows),
 * ALLOCATION_FAILED.
 * Threads: thread-safe (identities come from an atomic counter).
 */
KVP_API KVP_NODISCARD kvp_status kvp_param_create_matrix(size_t rows, size_t cols,
                                                         const double *values, kvp_param **out,
                                                         kvp_error *err);

/*
 * Adds a reference.
 * Threads: thread-safe (atomic).
 */
KVP_API kvp_status kvp_param_retain(kvp_param *param, kvp_error *err);

/*
 * Drops a reference; the last one frees the parameter.
 * NULL: nothing happens and KVP_OK is returned, as free(NULL) (kvpager.h).
 * Threads: thread-safe (atomic). The last release frees the parameter, so
 * a thread uses it only while it holds a reference (its own, or one held by
 * a layer it uses).
 */
KVP_API kvp_status kvp_param_release(kvp_param *param, kvp_error *err);

/*
 * Copies rows*cols new values in and advances the revision (by exactly one,
 * atomically). Needs exclusive access to the values (see Threads).
 * Threads: not safe while any thread reads the values (through
 * kvp_param_values, or computing with a layer that uses the parameter:
 * prepares, forwards, steps, prefills, decoder steps, references) or updates
 * this parameter. The queries below and kvp_layer_binding_get may overlap it.
 */
KVP_API KVP_NODISCARD kvp_status kvp_param_update(kvp_param *param, const double *values,
                                                  kvp_error *err);

/*
 * Lets `fn` change the values in place, then advances the revision; as kvp_param_update.
 * Threads: not safe while any thread reads the values or updates this
 * parameter, as kvp_param_update (`fn` runs on the calling thread).
 */
KVP_API KVP_NODISCARD kvp_status kvp_param_update_with(kvp_param *param, kvp_param_update_fn fn,
                                                       void *ctx, kvp_error *err);

/*
 * Plain queries; a NULL parameter reads as 0 / NULL. kvp_param_rows is the
 * row count, the width of the rows it is applied to (for a square parameter,
 * both dimensions; kvp_param_width, which duplicated it, is gone since 0.2).
 * The revision is an atomic load.
 * Threads: thread-safe (the id and shape never change; the revision is read
 * atomically, also during an update). Reading the values kvp_param_values
 * points to is not safe while the parameter is updated.
 */
KVP_API uint64_t kvp_param_id(const kvp_param *param);
KVP_API uint64_t kvp_param_revision(const kvp_param *param);
KVP_API size_t kvp_param_rows(const kvp_param *param);
KVP_API size_t kvp_param_cols(const kvp_param *param);
KVP_API const double *kvp_param_values(const kvp_param *param);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_PARAM_H */
