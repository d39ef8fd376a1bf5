/*
 * kvpager/sequence.h: sequences (one cache per layer of a model) and their
 * all-or-nothing steps, prefill, and batched decoding across threads.
 *
 * A step advances every layer of a sequence by one token:
 *   1. prepare layer 0 on the caller's input, and each layer l+1 on the input
 *      computed from layer l (by default the residual stream:
 *      x_{l+1} = x_l + attention_l(x_l));
 *   2. reserve the new pages of every layer and lane at once;
 *   3. commit every layer.
 * Any error (a prepare error of any layer, with err.layer naming it, or
 * POOL_EXHAUSTED for the whole step) leaves every layer exactly as before.
 *
 * Promises: a sequence can promise itself pages it will need (its prompt plus
 * a decoding reserve). kvp_pool_admit counts promised pages not yet taken, as
 * vLLM's can_allocate counts blocks, so admission does not hand the same pages
 * out twice. Pages a step takes are drawn from the promise first.
 * Sliding windows: a promise is a level, not a count of takes. Setting it
 * fixes the level (the pages held then plus the promise). Each page a
 * windowed layer's release gives back to the pool goes back into the
 * promise, in the same hold of the pool lock, after paying for any page
 * the sequence took beyond its promise: held + promised never exceeds the
 * level, and stays at it while every take came from the promise. So
 * kvp_sequence_pages_for(seq, T) promised at any length covers every step
 * to T, and a released page is neither lost to the promise nor counted
 * twice. (A truncate gives pages back without refilling the promise.)
 *
 * Threads: a sequence has one owner at a time; the decoder runs distinct
 * sequences on its worker threads. A decoder takes one kvp_decoder_step
 * caller at a time (a concurrent second one gets DECODER_BUSY).
 */
#ifndef KVPAGER_SEQUENCE_H
#define KVPAGER_SEQUENCE_H

#include "kvpager/cache.h"
#include "kvpager/common.h"
#include "kvpager/model.h"
#include "kvpager/pool.h"
#include "kvpager/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_sequence kvp_sequence;
typedef struct kvp_decoder kvp_decoder;

/*
 * Computes layer l+1's input from layer l's input and output ([B, 1, D] each,
 * `elements` = B * D doubles). NULL means the residual stream.
 */
typedef void (*kvp_next_input_fn)(void *ctx, size_t layer, const double *layer_input,
                                  const double *layer_output, size_t elements,
                                  double *next_input);

/*
 * A sequence of batch_size lanes and `capacity` positions per layer of
 * `model`, drawing pages from `pool`. Errors: NULL_ARGUMENT, the cache
 * creation errors (ZERO_BATCH_SIZE, ZERO_CAPACITY, CAPACITY_EXCEEDS_POSITIONS,
 * GEOMETRY_MISMATCH, ...), ALLOCATION_FAILED. The model counts the sequence
 * as live until kvp_sequence_destroy, and refuses kvp_model_destroy
 * (MODEL_BUSY) until then.
 * Threads: thread-safe: sequences of one model and pool may be created on
 * any threads at once (the model counts them atomically, caches attach
 * under the pool's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_create(const kvp_model *model, kvp_pool *pool,
                                                     size_t batch_size, size_t capacity,
                                                     kvp_sequence **out, kvp_error *err);

/*
 * Returns every page and promise, and frees the sequence.
 * NULL: nothing happens and KVP_OK is returned, as free(NULL) (kvpager.h).
 * Threads: not safe while any other call uses this sequence or its caches
 * (a decoder step running a job for it included).
 */
KVP_API kvp_status kvp_sequence_destroy(kvp_sequence *sequence, kvp_error *err);

/*
 * Every layer back to length 0, every page and promise back; no heap traffic.
 * Threads: one caller at a time per sequence (its owner), and not while a
 * read of it or its caches runs; other sequences may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_reset(kvp_sequence *sequence, kvp_error *err);

/*
 * One token for every layer. input and output are [B, 1, D]; output receives
 * the last layer's next input (the residual stream after the last layer).
 * Threads: one caller at a time per sequence (its owner; a decoder job on it
 * counts as one), not while a read of it or its caches runs, and not while a
 * parameter of its model is updated. Sequences of the same model and pool
 * may step on other threads at once; `next_input` runs on this thread.
 */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_step(kvp_sequence *sequence,
                                                   const kvp_tensor *input,
                                                   kvp_next_input_fn next_input, void *ctx,
                                                   double *output, size_t output_len,
                                                   kvp_error *err);

/*
 * A prompt of T tokens, [B, T, D], as T steps. Checks, in order, before
 * anything is computed: NULL_ARGUMENT; INPUT_RANK (err.what "prompt", the
 * prefill shape in the text); INPUT_BATCH_MISMATCH; INPUT_WIDTH_MISMATCH;
 * INVALID_ARGUMENT (T == 0); FULL when len + T > capacity (err.what
 * "prompt", err.tokens T, err.available the positions left);
 * BUFFER_TOO_SMALL. Then, still before any page is taken: token 0 is
 * prepared in every layer (the seed's checks: bindings, revisions, RoPE,
 * non-finite values; err.layer names the layer, err.token 0); then the
 * other tokens' inputs must be finite: the first token t > 0 holding a NaN
 * or infinity gives NONFINITE_PROJECTION as layer 0's query projection of
 * that token would (err.layer 0, err.token t), even if a token between
 * would have failed later in the computation. Then the pages of all T
 * tokens are taken at once, tentatively (POOL_EXHAUSTED, err.layer
 * SIZE_MAX, when they cannot all be); then token after token is computed
 * and committed. With next_input NULL (the residual stream), tokens 1..T-1
 * are computed in blocks of up to 64 tokens, layer after layer, each page
 * of the cache read once per block and layer: outputs, stored rows, pages
 * and errors (status, err.token, err.layer: the first failing token, and
 * its first failing layer) are those of token after token, bit for bit.
 * With a next_input function the tokens are computed one by one, so it is
 * called in token-major order: token 0 for layers 0..L-1, then token 1, ...
 * If token t > 0 fails, every layer is rolled back to its length before the
 * call, the pages go back in the reverse of the order taken, and the pool's
 * counters (acquires, releases, high-water mark) are exactly as before: the
 * tentative pages were never counted (kvp_pool_stats). Pages taken from the
 * pool's LRU list of cached pages (when no page was free) and not written
 * go back with their keys, to their LRU places. In blocks, token 0 is
 * computed again as the first row of the first block, and a failing block
 * writes no page. So the call changes nothing on error, with three
 * documented exceptions:
 *   - output: rows are written token by token, so when token err.token
 *     fails, the rows of the tokens before it already hold their (rolled
 *     back) outputs; the rest is untouched. Errors found before the first
 *     token leave it untouched;
 *   - free slab bytes: the rows written for tokens before a failing token
 *     t > 0 (the blocks before the failing one; token by token, every
 *     token before t) stay in the pages and slots given back. Nothing can
 *     read them, but kvp_pool_digest, which hashes free bytes too, differs;
 *   - cached blocks: a page taken from the LRU list and written that way
 *     cannot hold its cached block again: it leaves the prefix index and
 *     counts in kvp_pool_stats.evictions (cached_pages and evictable_pages
 *     drop, free_pages rises by as many).
 * output, when not NULL, receives [B, T, D].
 * Threads: one caller at a time per sequence, as kvp_sequence_step: not
 * while a read of it or its caches runs, and not while a parameter of its
 * model is updated; other sequences may prefill or step at once.
 */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_prefill(kvp_sequence *sequence,
                                                      const kvp_tensor *prompt,
                                                      kvp_next_input_fn next_input, void *ctx,
                                                      double *output, size_t output_len,
                                                      kvp_error *err);

/*
 * Sets the sequence's promise to `pages` future pages (replacing the old one).
 * OUT_OF_RANGE, changing nothing, when `pages` exceeds the pages the sequence
 * can ever hold (layers * batch * ceil(capacity / block_tokens)).
 * Threads: one caller at a time per sequence (its owner), and not while a
 * read of it runs; other sequences may be used concurrently.
 */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_promise(kvp_sequence *sequence, size_t pages,
                                                      kvp_error *err);

/*
 * Pages this sequence may take beyond those it holds growing from its
 * current length to `tokens` step by step: for a full layer the new blocks
 * of every lane; for a sliding layer (kvp_layer_set_window) its peak,
 * kvp_cache_pages_held_max(cache, tokens), less the pages it holds, at most
 * its new blocks; plus the copies of shared partial pages its next write
 * must make (copy-on-write, after a fork or truncate). The promise to make
 * before steps to `tokens` (the release refunds keep it whole, above).
 * `tokens` above the capacity: kvp_sequence_prefill_pages.
 * Threads: not safe while a call changes this sequence (reset, destroy,
 * promise, step, prefill, a decoder job); reads of one sequence may overlap.
 */
KVP_API size_t kvp_sequence_pages_for(const kvp_sequence *sequence, size_t tokens);

/*
 * Pages a kvp_sequence_prefill from the current length to `tokens` takes:
 * the new blocks of every layer and lane (a prefill holds every block it
 * writes until it ends; a sliding layer releases at its end), plus the
 * copies. Equal to kvp_sequence_pages_for without windows. Saturates at
 * SIZE_MAX. For a prompt of P tokens then steps to T: promise this before
 * the prefill, and kvp_sequence_pages_for(seq, T) after it.
 * Threads: not safe while a call changes this sequence (reset, destroy,
 * promise, step, prefill, a decoder job); reads of one sequence may overlap.
 */
KVP_API size_t kvp_sequence_prefill_pages(const kvp_sequence *sequence, size_t tokens);

/*
 * Plain queries; NULL reads as 0 / NULL. held_pages counts the pages the
 * layers' tables hold (a block a window released holds none). kvp_sequence_cache gives a layer's
 * cache, for reading (cache.h's rules: its changes are this sequence's).
 * Threads: not safe while a call changes this sequence (reset, destroy,
 * promise, step, prefill, a decoder job); reads of one sequence may overlap.
 */
KVP_API size_t kvp_sequence_len(const kvp_sequence *sequence);
KVP_API size_t kvp_sequence_capacity(const kvp_sequence *sequence);
KVP_API size_t kvp_sequence_held_pages(const kvp_sequence *sequence);
KVP_API size_t kvp_sequence_promised_pages(const kvp_sequence *sequence);
KVP_API const kvp_cache *kvp_sequence_cache(const kvp_sequence *sequence, size_t layer);

/* ---- sharing: fork, truncate, the prompt prefix cache ------------------- */

/*
 * Creates *child, a sequence of the same model, pool, batch and capacity
 * whose every layer cache shares the parent's pages (kvp_cache_fork): the
 * same length, rows and page ids, each page's reference count + 1, no page
 * taken. A mid-block length marks both sides copy-on-write: the next step
 * or prefill of either copies the shared partial pages, reserving them in
 * its own transaction (kvp_sequence_pages_for counts them, so a promise
 * covers only pages the sequence will newly take). Destroying parent and
 * child in any order returns exactly the pages no other sequence names.
 * Errors: NULL_ARGUMENT ("parent", "child"); kvp_sequence_create's
 * (ALLOCATION_FAILED); nothing changes on failure (a partly built child is
 * destroyed). A step or prefill of the child then gives bit for bit what the
 * parent would give for the same input. The child keeps the parent's captured
 * bindings: a fork of a stale sequence (a parameter updated since its caches
 * were bound) is stale too, and its steps are refused as the parent's are.
 * Threads: one caller at a time per parent (its owner), and not while a read
 * of it runs; other sequences of the pool, those sharing its pages included,
 * may step, prefill, fork, truncate or adopt at once (the pool's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_fork(kvp_sequence *parent, kvp_sequence **child,
                                                   kvp_error *err);

/*
 * Shortens every layer to new_len (kvp_cache_truncate): for speculative
 * decoding and beam pruning. Pages wholly past new_len lose this sequence's
 * reference; a now-partial shared page is copied only when the next step
 * writes it. A replay of the same inputs then gives bit for bit the outputs
 * the sequence gave the first time. new_len == len succeeds and changes
 * nothing. The promise is unchanged. Errors: NULL_ARGUMENT; OUT_OF_RANGE
 * ("new_len" > len); BLOCK_RELEASED (a sliding layer's window released a
 * block its window at new_len needs: err.layer that layer, err.index,
 * err.position and err.tokens as kvp_cache_truncate's), changing nothing.
 * Threads: one caller at a time per sequence (its owner), and not while a
 * read of it runs; other sequences of the pool, those sharing its pages
 * included, may be used at once (the pool's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_truncate(kvp_sequence *sequence, size_t new_len,
                                                       kvp_error *err);

/*
 * Prompt prefix cache. An EMPTY sequence looks up the full blocks of
 * `prompt` ([B, T, D], the rows a prefill would take) in the pool's prefix
 * index and shares every hit, in order, up to the first miss, for every
 * layer and lane at once (a model with sliding-window layers: the longest
 * prefix for which every full layer hits every block and every sliding
 * layer the blocks it keeps at that length, its sinks and its last W
 * positions' blocks; the blocks before its window stay null entries,
 * kvp_cache_group_adopt); *tokens_adopted (a multiple of block_tokens, at
 * most T - 1, so at least the last token is left to compute) is the new
 * length. Then kvp_sequence_prefill of the remaining tokens (prompt rows
 * tokens_adopted .. T-1) computes only those, and its outputs, and every
 * later step's, are bit for bit those of a fresh sequence prefilled with the
 * whole prompt. Keys chain every block to the ones before it, the block's
 * input rows and the digest of all the model's layer bindings (one keyed
 * chain per block, as kvp_block_key_chain), and each layer's key derives
 * from its block's with the layer's binding digest, so a parameter update
 * (a revision bump), another model, RoPE, geometry or dtype can never hit an
 * old block. The hash is keyed with the pool's secret (kvp_pool_config):
 * nobody without it can build colliding prompts. They do not cover a
 * next_input callback: share a prefix only between sequences stepped with
 * the same next_input (or none). This call uses no salt: see
 * kvp_sequence_adopt_prefix_salted.
 * Errors: NULL_ARGUMENT ("sequence", "prompt"); INPUT_RANK,
 * INPUT_BATCH_MISMATCH, INPUT_WIDTH_MISMATCH, INVALID_ARGUMENT ("prompt":
 * no token), as prefill; NULL_ARGUMENT ("tokens_adopted"); INVALID_ARGUMENT
 * ("sequence": not empty); ALLOCATION_FAILED (the keys);
 * BLOCK_BINDING_MISMATCH (a hit page was published by a cache of another
 * binding, through a key made elsewhere: cache.h, kvp_cache_adopt_prefix).
 * Nothing changes on failure.
 * Threads: one caller at a time per sequence (its owner); other sequences of
 * the pool may step, prefill, fork, publish or adopt at once (the lookup runs
 * under the pool's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_adopt_prefix(kvp_sequence *sequence,
                                                           const kvp_tensor *prompt,
                                                           size_t *tokens_adopted,
                                                           kvp_error *err);

/*
 * Publishes the full blocks of `prompt` that the sequence holds (the first
 * min(T, len) / block_tokens blocks of every layer and lane) under the keys
 * kvp_sequence_adopt_prefix computes, so later sequences can adopt them. A
 * sliding-window layer publishes the blocks it still holds: those its
 * window released are skipped (kvp_cache_group_publish), so a later prompt
 * that shares only a shorter prefix than this sequence's length may miss
 * that layer's window there (the scheduler publishes a prompt before its
 * prefill's windows release anything).
 * Precondition (the caller's): the sequence's first tokens were prefilled
 * (or adopted) from exactly these prompt rows. Blocks already published
 * under the same key, or whose key names another page, are left as they
 * are. *blocks_published (may be NULL) = the blocks covered. Errors:
 * NULL_ARGUMENT; INPUT_RANK, INPUT_BATCH_MISMATCH, INPUT_WIDTH_MISMATCH;
 * ALLOCATION_FAILED; PAGE_PUBLISHED (a page is published under another key;
 * err.layer names its layer). Nothing changes on failure.
 * Threads: one caller at a time per sequence (its owner); other sequences of
 * the pool may step, prefill, fork, publish or adopt at once (the index is
 * under the pool's mutex).
 */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_publish_prefix(kvp_sequence *sequence,
                                                             const kvp_tensor *prompt,
                                                             size_t *blocks_published,
                                                             kvp_error *err);

/*
 * kvp_sequence_adopt_prefix and kvp_sequence_publish_prefix under a salt
 * (vLLM's cache_salt): every key also covers `salt` (NULL or all zero: no
 * salt, the same keys as the unsalted calls), so blocks published under one
 * salt are found only under that salt. Give each tenant (or each isolation
 * domain) its own salt, secret to it and chosen at random, and no tenant can
 * adopt another's blocks, nor time another's prompts through the prefix
 * cache (a hit is faster than a miss): its lookups never reach them.
 * Errors: as the unsalted calls.
 * Threads: one caller at a time per sequence (its owner); as
 * kvp_sequence_adopt_prefix.
 */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_adopt_prefix_salted(kvp_sequence *sequence,
                                                                  const kvp_tensor *prompt,
                                                                  const kvp_block_key *salt,
                                                                  size_t *tokens_adopted,
                                                                  kvp_error *err);
/* See kvp_sequence_adopt_prefix_salted.
 * Threads: one caller at a time per sequence (its owner); as
 * kvp_sequence_publish_prefix. */
KVP_API KVP_NODISCARD kvp_status kvp_sequence_publish_prefix_salted(kvp_sequence *sequence,
                                                                    const kvp_tensor *prompt,
                                                                    const kvp_block_key *salt,
                                                                    size_t *blocks_published,
                                                                    kvp_error *err);

/* ---- batched decoding across threads ---------------------------------- */

/* What a decode job does; a zeroed job is a one-token step. */
typedef enum kvp_job_kind {
    KVP_JOB_STEP = 0,    /* kvp_sequence_step: input [B, 1, D], output [B, 1, D] */
    KVP_JOB_PREFILL = 1  /* kvp_sequence_prefill: input [B, T, D], output [B, T, D] or NULL */
} kvp_job_kind;

/*
 * One sequence's share of a batched decode. status and error are outputs.
 * `kind` was appended after the original fields; a zeroed `kind` (as from
 * memset or an initializer that omits it) is today's one-token step.
 */
typedef struct kvp_decode_job {
    kvp_sequence *sequence;
    kvp_tensor input;  /* [B, 1, D]; a prefill's prompt [B, T, D] */
    double *output;    /* [B, 1, D]; a prefill's [B, T, D], or NULL for none */
    size_t output_len;
    kvp_status status;
    kvp_error error;
    kvp_job_kind kind;
} kvp_decode_job;

/*
 * A pool of `threads` threads (0: one per online core, at most 4096), the
 * caller's included, started now. INVALID_ARGUMENT above 4096; THREAD_FAILED
 * when the system refuses a thread (the others are stopped again).
 * Threads: thread-safe.
 */
KVP_API KVP_NODISCARD kvp_status kvp_decoder_create(size_t threads, kvp_decoder **out,
                                                    kvp_error *err);

/*
 * Stops and joins the decoder's threads and frees it.
 * NULL: nothing happens and KVP_OK is returned, as free(NULL) (kvpager.h).
 * Threads: not safe while any other call uses the decoder (a running
 * kvp_decoder_step included: its threads would be joined under it).
 */
KVP_API kvp_status kvp_decoder_destroy(kvp_decoder *decoder, kvp_error *err);

/*
 * The decoder's thread count, the caller's included; NULL gives 0.
 * Threads: thread-safe (fixed at creation).
 */
KVP_API size_t kvp_decoder_threads(const kvp_decoder *decoder);

/*
 * Runs every job once, spread over the decoder's threads (the calling thread
 * works too): a KVP_JOB_STEP job steps its sequence one token, a
 * KVP_JOB_PREFILL job prefills its prompt; steps and prefills may be mixed in
 * one batch. A job's output, status and error are the same as
 * kvp_sequence_step or kvp_sequence_prefill on its sequence alone would give
 * (a failed job changes nothing, as those calls promise); when jobs compete
 * for the last free pages, which of them get POOL_EXHAUSTED depends on
 * thread timing. Returns KVP_OK when every job ran (each job's own status
 * says whether it succeeded); running nothing: NULL_ARGUMENT for a NULL
 * sequence, INVALID_ARGUMENT when two jobs name the same sequence or a
 * job's kind is unknown, then DECODER_BUSY (below). A next_input function
 * must be safe to call from several threads. Threads left without a job
 * help the running ones with their attention (one long sequence uses every
 * thread); the results are the same bits as on one thread.
 *
 * One caller at a time: a decoder runs one batch at a time. A call made
 * while another kvp_decoder_step on the same decoder is running (from
 * another thread, or from a next_input callback of the running step) is
 * refused with DECODER_BUSY and changes nothing: none of its jobs runs or
 * has its status written, and the running step is not disturbed. Callers
 * that share a decoder between threads serialize their steps themselves, or
 * retry. Different decoders are independent.
 * Threads: one caller at a time per decoder (a concurrent call gets
 * DECODER_BUSY); other decoders may step concurrently, but never on the same
 * sequence. While a step runs, each job's sequence is the step's: no other
 * call may use it or its caches, and no parameter of its model may be
 * updated. `next_input` may run on any of the decoder's threads at once.
 */
KVP_API KVP_NODISCARD kvp_status kvp_decoder_step(kvp_decoder *decoder, kvp_decode_job *jobs,
                                                  size_t count, kvp_next_input_fn next_input,
                                                  void *ctx, kvp_error *err);

#ifdef __cplusplus
}
#endif

#endif /* KVPAGER_SEQUENCE_H */
