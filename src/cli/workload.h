/*
 * workload.h: the requests a simulation serves.
 *
 * Owns: request lists, generated from a named profile with fixed seeds or
 * read from a trace file. A request arrives at a scheduler step (turn 0),
 * or, a conversation's later turn, think_steps after the turn before it
 * finishes (closed loop, below); it brings a prompt of prompt_tokens and
 * wants output_tokens generated. Invariants of every list: the requests of
 * turn 0 are sorted by arrival (stable), a request of turn k > 0 comes
 * right after the one of turn k - 1 of its conversation (same stream),
 * every request has prompt_tokens >= 1, output_tokens >= 1 and
 * prompt + output <= capacity. Only conversation makes turns above 0.
 *
 * A Mooncake trace's requests also carry their prompt's block hash ids
 * (block_ids); every generator and the CSV trace leave them NULL and 0.
 * Profiles (published dataset statistics, as in the vLLM paper):
 *   sharegpt      mean prompt 161, mean output 338; lognormal lengths, heavy-tailed
 *   alpaca        mean prompt 19, mean output 58; lognormal lengths
 *   uniform       uniform lengths with the given means
 *   long-context  prompts lognormal (sigma 0.3) around mean 8192, kept within
 *                 [mean / 2, 2 x mean]: 4k to 16k tokens, where sliding
 *                 windows matter (issue 21); outputs mean 256 (sigma 0.3)
 *   conversation  multi-turn chats (ShareGPT's multi-turn statistics, below):
 *                 each turn's prompt is the whole earlier conversation (every
 *                 earlier message and reply) plus a new message; prompt_mean
 *                 and output_mean are the new message's and the reply's
 *                 means (lognormal, sigma 1.0).
 * ShareGPT multi-turn statistics: 94,145 conversations of 330,239 turns,
 * 3.51 turns per conversation on average (LMSYS-Chat-1M, Zheng et al.,
 * ICLR 2024, arXiv:2309.11998, Table 1, as reproduced in ShareChat,
 * arXiv:2512.17843, Table 1). The same table gives 94.46 tokens per user
 * message and 348.45 per reply; those two could not be confirmed from the
 * sources at hand when this was written, so they are an assumption (the
 * means used: 94 and 348). The shapes are assumptions too: turns per
 * conversation geometric on {1, 2, ...} with mean 3.51, lengths lognormal
 * with sigma 1.0 as the sharegpt profile's. A conversation's first turn
 * arrives by the arrival process; each later turn is closed-loop, as a user
 * sends the next message only after reading the reply: it is submitted a
 * think time after the turn before it finishes (sim.h), exponential with
 * mean 16 steps (think_steps, drawn here). A conversation ends early when
 * its next turn would not leave room for one message and one reply token in
 * `capacity`. The list holds each conversation's turns in a row, the
 * conversations in the order they start.
 * Shared prefix (shared_prefix > 0): every request's prompt starts with the
 * same shared_prefix tokens (a system prompt), counted in prompt_tokens;
 * the drawn prompt follows it, so prompt + output stays within capacity.
 * Lognormal lengths use sigma (default 1.0 for sharegpt, 0.6 for alpaca) and
 * mu = ln(mean) - sigma^2 / 2, so the untruncated mean is the target; lengths
 * are then clamped to [1, capacity - 1] and prompt + output to capacity.
 * Arrivals: poisson (exponential gaps, `rate` requests per step), uniform
 * (one every 1/rate steps) or burst (all at step 0).
 */
#ifndef KVPAGER_CLI_WORKLOAD_H
#define KVPAGER_CLI_WORKLOAD_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvp_workload_request {
    size_t arrival_step;
    size_t prompt_tokens;  /* shared_tokens included */
    size_t output_tokens;
    size_t shared_tokens;  /* leading prompt positions every request shares (--shared-prefix) */
    uint64_t stream;       /* whose pseudo-embeddings the other positions are: the request's
                              index, or its conversation's number (all of its turns share it) */
    size_t turn;           /* 0: arrives at arrival_step; k > 0: turn k of a conversation,
                              submitted think_steps after the request before it in the list
                              (turn k - 1) finishes; arrival_step is then unused (0) */
    size_t think_steps;    /* turn > 0: the user's think time, in steps */
    uint64_t session;      /* conversation: its number + 1, on every turn (kvp_request.session);
                              0: not a conversation's */
    const uint64_t *block_ids; /* a Mooncake trace's request: its hash ids, one per
                                  KVP_MOONCAKE_BLOCK_TOKENS-token block of the prompt (the last
                                  may be partial), pointing into the list's own allocation (freed
                                  with it by kvp_workload_free); NULL for every other workload */
    size_t block_count;        /* entries of block_ids: ceil(prompt_tokens / 512); 0 without */
} kvp_workload_request;

typedef struct kvp_workload {
    kvp_workload_request *requests;
    size_t count;
} kvp_workload;

typedef enum kvp_profile {
    KVP_PROFILE_SHAREGPT,
    KVP_PROFILE_ALPACA,
    KVP_PROFILE_UNIFORM,
    KVP_PROFILE_CONVERSATION,
    KVP_PROFILE_LONG_CONTEXT
} kvp_profile;
typedef enum kvp_arrival { KVP_ARRIVAL_POISSON, KVP_ARRIVAL_UNIFORM, KVP_ARRIVAL_BURST } kvp_arrival;

typedef struct kvp_workload_spec {
    kvp_profile profile;
    double prompt_mean;  /* 0: the profile's */
    double output_mean;  /* 0: the profile's */
    double sigma;        /* 0: the profile's; lognormal shape */
    kvp_arrival arrival;
    double rate;         /* requests per step */
    size_t requests;
    size_t capacity;     /* positions a sequence may hold */
    uint64_t seed;
    size_t shared_prefix; /* tokens every prompt starts with; at most capacity - 2 */
    double turns_mean;    /* conversation: 0: the profile's (3.51) */
} kvp_workload_spec;

/* conversation: mean turns per conversation, and the mean think time between turns. */
#define KVP_CONVERSATION_TURNS_MEAN 3.51
#define KVP_CONVERSATION_THINK_STEPS 16.0

/* Fills the profile's defaults into zero fields. */
void kvp_workload_spec_defaults(kvp_workload_spec *spec);

/*
 * Returns 0, or -1 when out of memory (through the program's allocation
 * hook). With shared_prefix 0 and a profile other than conversation, the
 * list is exactly what it was before those existed (same seeds, same draws).
 */
int kvp_workload_generate(const kvp_workload_spec *spec, kvp_workload *out);

/* kvp_workload_load_trace's result when the request list cannot grow. */
#define KVP_TRACE_OUT_OF_MEMORY (-2)

/*
 * Reads a CSV of arrival_step,prompt_tokens,output_tokens: an optional UTF-8
 * byte order mark, an optional header line naming exactly those columns,
 * blank lines ignored, rows sorted by arrival step (ties keep file order).
 * Refused, with "<file>:<line>: ..." (and the column and value where there is
 * one) in `message`: a row that is not three whole numbers, a prompt or
 * output of 0 tokens, prompt + output above `capacity`, an arrival step
 * below the previous row's, a NUL byte, a line over 510 characters, a file
 * with no rows; a directory or unreadable file gives "<file>: <strerror>".
 * Returns 0, -1 on such input, or KVP_TRACE_OUT_OF_MEMORY; on failure
 * nothing is returned and nothing is left allocated.
 */
int kvp_workload_load_trace(const char *path, size_t capacity, kvp_workload *out, char *message,
                            size_t message_size);

/* Tokens per hash id of a Mooncake trace. */
#define KVP_MOONCAKE_BLOCK_TOKENS 512

/*
 * Reads a Mooncake trace (the FAST '25 release's JSONL, data/traces/README.md):
 * one JSON object per line with exactly the keys timestamp (ms), input_length,
 * output_length and hash_ids, in any order, whitespace anywhere JSON allows it.
 * An optional UTF-8 byte order mark and blank lines are skipped. Request i of
 * the list is line i's: arrival_step = floor(timestamp / ms_per_step) (the
 * step during which the request arrives, step k covering [k * ms_per_step,
 * (k + 1) * ms_per_step) ms), prompt_tokens = input_length, output_tokens =
 * output_length, stream = i, block_ids/block_count = its hash_ids, every
 * other field 0. The requests and every request's ids are one allocation,
 * freed by kvp_workload_free; copying a request keeps pointing into it.
 * Refused, with "<file>:<line>: ..." naming the key and the value in
 * `message`: JSON that is not one object of exactly those keys (an unknown
 * or repeated key, a string or array where a number goes, anything after
 * the object), a value that is negative, not a whole number (a fraction or
 * an exponent: Mooncake writes integers), written with a leading zero or
 * above 2^64 - 1 (hash ids) or SIZE_MAX (the others), output_length 0, an
 * empty hash_ids, a count of hash_ids other than ceil(input_length / 512),
 * input_length + output_length above `capacity` (or overflowing), a
 * timestamp below the previous line's, a NUL byte, a line over 1 MiB; a
 * file with no requests and an unreadable file or directory are refused as
 * by kvp_workload_load_trace. ms_per_step must be >= 1.
 * Returns 0, -1 on such input, or KVP_TRACE_OUT_OF_MEMORY (the message says
 * what could not be allocated); on failure `out` is untouched and nothing is
 * left allocated. Allocates through the program's hook (alloc.h).
 */
int kvp_workload_load_mooncake(const char *path, size_t capacity, uint64_t ms_per_step,
                               kvp_workload *out, char *message, size_t message_size);

void kvp_workload_free(kvp_workload *workload);

const char *kvp_profile_name(kvp_profile profile);
const char *kvp_arrival_name(kvp_arrival arrival);
int kvp_profile_parse(const char *text, kvp_profile *out);
int kvp_arrival_parse(const char *text, kvp_arrival *out);

#endif /* KVPAGER_CLI_WORKLOAD_H */
