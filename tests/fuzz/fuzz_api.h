/*
 * fuzz_api.h: what the files of the kvp_fuzz_api target's main world share
 * (fuzz_api.c: the entry point, the reader, the failure report and tally,
 * setup and teardown; fuzz_api_shadow.c: the world W and its shadow model;
 * fuzz_api_check.c: the checks; fuzz_api_cache.c and fuzz_api_seq.c: the
 * operations). Internal to tests/fuzz; fuzz_paged*.c use fuzz_common.h only.
 *
 * Invariants: one world W per input, set up and torn down by fuzz_api.c;
 * every function here may fail() (abort) on a mismatch.
 */
#ifndef KVP_FUZZ_API_H
#define KVP_FUZZ_API_H

#include "fuzz_common.h"

#define fail fz_fail

#define MAX_D 8
#define MAX_H 2
#define MAX_B 2
#define MAX_CAP 16
#define MAX_POSITIONS 16
#define N_LAYERS 3
#define N_PSETS 2
#define MAX_MODEL 2
#define N_CACHES 4
#define N_TICKETS 4
#define N_SEQS 3
#define MAX_OPS 400
#define MAX_PROMPT 4
#define TOLERANCE 1e-12


/* ---- the shadow -------------------------------------------------------- */

/* K and V rows of a set of lanes: [B][H][cap][d_h]. */
typedef struct skv {
    size_t len;
    double k[MAX_B][MAX_H][MAX_CAP][MAX_D];
    double v[MAX_B][MAX_H][MAX_CAP][MAX_D];
} skv;

typedef struct sparams {
    double w[KVP_PARAM_COUNT][MAX_D * MAX_D];
    uint64_t version[KVP_PARAM_COUNT];
} sparams;

typedef struct slayer {
    kvp_layer *layer;
    int pset;
    double base;
} slayer;

typedef struct scache {
    kvp_cache *cache;
    int live;
    int layer;
    size_t batch;
    size_t capacity;
    uint64_t version[KVP_PARAM_COUNT];
    uint64_t uid;
    uint64_t epoch;
    skv kv;
    double x[MAX_CAP][MAX_B * MAX_D]; /* the input row of every committed position */
} scache;

enum { T_EMPTY, T_PREPARED, T_COMMITTED };

typedef struct sticket {
    kvp_ticket *ticket;
    int live;
    size_t batch;
    size_t capacity;
    int state;
    uint64_t cache_uid;
    uint64_t cache_epoch;
    size_t len_at;
    size_t reserved;
    /* Of the reserved pages, the shadow ids of those borrowed from the LRU
     * list (taken after the free ones), in the order taken. */
    uint8_t borrowed[MAX_B];
    size_t borrowed_count;
    double key[MAX_B * MAX_D];
    double value[MAX_B * MAX_D];
    double x[MAX_B * MAX_D];
} sticket;

typedef struct sseq {
    kvp_sequence *seq;
    int live;
    size_t batch;
    size_t capacity;
    size_t promise;
    uint64_t version[MAX_MODEL][KVP_PARAM_COUNT];
    skv kv[MAX_MODEL];
    /* Sharing: the shadow page of every (layer, lane, block), each layer's
     * copy-on-write mark, and layer 0's input row of every position. */
    uint8_t table[MAX_MODEL][MAX_B][MAX_CAP];
    int cow[MAX_MODEL];
    double x[MAX_CAP][MAX_B * MAX_D];
} sseq;

/*
 * A prefix key as the shadow sees it: the layer, the revisions every layer's
 * binding captured, and the lane's input rows of blocks 0..j (the chain).
 */
typedef struct skey {
    size_t layer;
    uint64_t version[MAX_MODEL][KVP_PARAM_COUNT];
    size_t tokens;
    double rows[MAX_CAP * MAX_D];
} skey;

/*
 * A page that sequences name (held, refs > 0) or the prefix index keeps
 * (evictable: registered, refs 0, on the LRU list by stamp), or a cached
 * page a take borrowed (DESIGN.md, "Transactions and cached pages"): held by
 * its reservation (refs 1), still registered (cached) with its key and
 * stamp, but off the LRU list and skipped by lookups, until the reservation
 * maps it (evicted) or gives it back (restored). Its id is the shadow's own;
 * check_world maps ids to the library's page ids one to one.
 */
typedef struct spage {
    int used;
    unsigned refs;
    int registered;
    int borrowed;
    uint64_t stamp;
    skey key;
    double k[MAX_H][3][MAX_D]; /* the block's rows, for adopters (block_tokens <= 3) */
    double v[MAX_H][3][MAX_D];
} spage;

#define MAX_SPAGES 32

typedef struct world {
    /* geometry */
    size_t d, heads, hd, bt, layers, threads;
    kvp_pool_config pool_config;
    size_t total;
    /* objects */
    kvp_pool *pool;
    kvp_decoder *decoder;
    kvp_model *model;
    sparams params[N_PSETS];
    slayer layer[N_LAYERS];
    kvp_layer *alien;   /* the same model width split into another head count */
    size_t alien_heads;
    kvp_layer *wide;    /* twice the model width, as many heads */
    int next_mode;      /* 0: the residual stream (NULL); 1: next_half */
    int model_layer[MAX_MODEL];
    scache cache[N_CACHES];
    sticket ticket[N_TICKETS];
    sseq seq[N_SEQS];
    uint64_t next_uid;
    /* the pool's counters as the shadow predicts them */
    size_t anon; /* pages held by standalone caches and tickets (never shared) */
    uint64_t acquires, releases, exhaustions;
    size_t high_water;
    /* sharing: pages of sequences and the prefix index */
    spage page[MAX_SPAGES];
    uint64_t clock; /* LRU stamps */
    uint64_t hits, misses, evictions, cow_copies;
} world;

/* What one prepare should give: a status with its detail, or the row. */
typedef struct expect {
    kvp_status status;
    const char *what; /* NONFINITE_PROJECTION */
    size_t index;     /* NONFINITE_* */
    size_t parameter; /* CACHE_LAYER_REVISION_MISMATCH */
    double out[MAX_B * MAX_D];
    double key[MAX_B * MAX_D];
    double value[MAX_B * MAX_D];
} expect;

/* Digests of every live cache, the standalone ones and each sequence's layers. */
typedef struct digests {
    uint64_t cache[N_CACHES];
    uint64_t seq[N_SEQS][MAX_MODEL];
} digests;

extern world W;
/* The running operation's name (a string literal: the tally keys by pointer). */
extern const char *g_op_name;
/* 1 while check_world's own calls run (fuzz_api.c's tally skips them). */
extern int g_auditing;

/* The functions each file lends the others; each is documented at its definition. */

/* ---- fuzz_api.c ---- */

void check_status(kvp_status got, kvp_status want, const kvp_error *err);
uint8_t rd(reader *r);
double unit(uint64_t *state);
void read_values(reader *r, double *out, size_t n);

/* ---- fuzz_api_shadow.c ---- */

size_t blocks_for(size_t tokens);
size_t held_pages(void);
size_t evictable_pages(void);
size_t cached_pages(void);
size_t free_pages(void);
void raise_high_water(void);
void take_pages(sticket *t, size_t n);
void give_pages(size_t n);
void give_ticket_pages(sticket *t);
void map_ticket_pages(sticket *t);
uint8_t spage_new(void);
void spage_ref(uint8_t id);
void spage_put(uint8_t id);
size_t promised_total(void);
void seq_truncate_to(sseq *s, size_t new_len);
size_t seq_copies(const sseq *s);
size_t seq_pages_for(const sseq *s, size_t tokens);
void forget_written_borrowed(const sseq *s, size_t len, size_t pages, size_t committed);
void seq_map_token(sseq *s, const uint8_t *ids, size_t *next,
                   uint8_t saved[MAX_MODEL][MAX_B], int defer);
void seq_step_pages(sseq *s, size_t pages);
void make_key(const uint64_t version[MAX_MODEL][KVP_PARAM_COUNT], size_t l,
              const double *prompt, size_t tokens, size_t b, size_t j, skey *out);
int key_eq(const skey *a, const skey *b);
int index_find(const skey *key);
void s_project(const double *x, const double *w, size_t d, double *y);
size_t first_nonfinite(const double *v, size_t n);
kvp_status set_nonfinite(expect *e, kvp_status status, const char *what, size_t index);
kvp_status s_attend(const slayer *layer, const skv *kv, size_t batch, const double *x,
                    expect *e);
void skv_append(skv *kv, size_t batch, const double *key, const double *value);
int stale_parameter(const uint64_t *captured, int pset);

/* ---- fuzz_api_check.c ---- */

void compare_rows(const char *what, const double *got, const double *want, size_t n);
void check_detail(const kvp_error *err, const expect *e);
void take_digests(digests *out);
void check_unchanged(const digests *before);
void on_mismatch(void *ctx, const kvp_mismatch *mismatch);
void check_world(void);
void poison(kvp_error *err);
void check_untouched(const kvp_error *err);

/* ---- fuzz_api_cache.c ---- */

void op_cache_create(reader *r);
void op_cache_destroy(reader *r);
void op_cache_reset(reader *r);
void op_cache_truncate(reader *r);
void op_ticket_create(reader *r);
void op_ticket_destroy(reader *r);
void op_ticket_discard(reader *r);
void op_commit(reader *r);
void op_prepare(reader *r);
void op_forward(reader *r);

/* ---- fuzz_api_seq.c ---- */

void op_seq_create(reader *r);
void op_seq_destroy(reader *r);
void op_seq_reset(reader *r);
void op_seq_truncate(reader *r);
void op_seq_promise(reader *r);
void op_seq_step(reader *r);
void op_seq_prefill(reader *r);
void op_seq_fork(reader *r);
void op_seq_publish(reader *r);
void op_seq_adopt(reader *r);
void op_admit(reader *r);
void op_param_update(reader *r);
void op_decoder_step(reader *r);

#endif /* KVP_FUZZ_API_H */
