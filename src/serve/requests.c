/*
 * requests.c: the scheduler's request records (requests_internal.h).
 *
 * Owns: the record slots (and each slot's prompt-key buffer, which outlives
 * the requests it serves and goes with the table), their free list, and the id index: open
 * addressing with linear probing over a power-of-two table at least twice
 * the slots, holding slot + 1 (0 empty), deleted by backward shift (no
 * tombstones, so a lookup probes at most the run it hashes into).
 * Invariants: a slot is free (state KVPI_RECORD_FREE, on the free list) or
 * held (its id in the index exactly once); live counts the held ones; every
 * id below next_id was added once.
 * Callers: the scheduler's rooms (src/serve/scheduler*.c).
 */
#include "serve/requests_internal.h"

#include <assert.h>
#include <string.h>

#include "pager/alloc.h"

/* MurmurHash3's 64-bit finalizer: consecutive ids spread over the table. */
static size_t home_of(const kvpi_requests *t, uint64_t id)
{
    uint64_t h = id;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    return (size_t)h & (t->index_room - 1);
}

static void index_put(size_t *index, size_t mask, const kvpi_requests *t, size_t slot)
{
    size_t at = home_of(t, t->records[slot].id);
    while (index[at] != 0) {
        at = (at + 1) & mask;
    }
    index[at] = slot + 1;
}

void kvpi_requests_init(kvpi_requests *t)
{
    memset(t, 0, sizeof *t);
    t->free_head = SIZE_MAX;
}

void kvpi_requests_free(kvpi_requests *t)
{
    for (size_t i = 0; i < t->room; i++) {
        kvpi_free(t->records[i].chain);
    }
    kvpi_free(t->records);
    kvpi_free(t->index);
    kvpi_requests_init(t);
}

int kvpi_requests_reserve(kvpi_requests *t, size_t more)
{
    if (more <= t->room - t->live) {
        return 0;
    }
    size_t room = t->room ? t->room : 16;
    while (room - t->live < more) {
        if (room > SIZE_MAX / 4 / sizeof(size_t)) {
            return -1;
        }
        room *= 2;
    }
    kvpi_record *records = kvpi_calloc(KVPI_SITE_SCRATCH, room, sizeof *records);
    size_t *index = kvpi_calloc(KVPI_SITE_SCRATCH, 2 * room, sizeof *index);
    if (records == NULL || index == NULL) {
        kvpi_free(records);
        kvpi_free(index);
        return -1;
    }
    if (t->room > 0) {
        memcpy(records, t->records, t->room * sizeof *records);
    }
    /* The new slots join the free list ahead of the old free ones, lowest first. */
    for (size_t i = room; i-- > t->room;) {
        records[i].state = KVPI_RECORD_FREE;
        records[i].next_free = t->free_head;
        t->free_head = i;
    }
    kvpi_free(t->records);
    kvpi_free(t->index);
    t->records = records;
    t->room = room;
    t->index = index;
    t->index_room = 2 * room;
    for (size_t i = 0; i < room; i++) {
        if (records[i].state != KVPI_RECORD_FREE) {
            index_put(index, t->index_room - 1, t, i);
        }
    }
    return 0;
}

kvpi_record *kvpi_requests_add(kvpi_requests *t)
{
    assert(t->free_head != SIZE_MAX);
    size_t slot = t->free_head;
    kvpi_record *r = &t->records[slot];
    t->free_head = r->next_free;
    kvp_block_key *chain = r->chain;
    size_t chain_room = r->chain_room;
    memset(r, 0, sizeof *r);
    r->chain = chain; /* the slot's buffer serves the new request */
    r->chain_room = chain_room;
    r->id = t->next_id++;
    r->next_free = SIZE_MAX;
    t->live++;
    index_put(t->index, t->index_room - 1, t, slot);
    return r;
}

/* The index position of `id`, or SIZE_MAX. */
static size_t index_find(const kvpi_requests *t, uint64_t id)
{
    if (t->index_room == 0) {
        return SIZE_MAX;
    }
    size_t mask = t->index_room - 1;
    for (size_t at = home_of(t, id);; at = (at + 1) & mask) {
        size_t e = t->index[at];
        if (e == 0) {
            return SIZE_MAX;
        }
        if (t->records[e - 1].id == id) {
            return at;
        }
    }
}

kvpi_record *kvpi_requests_find(const kvpi_requests *t, uint64_t id)
{
    size_t at = index_find(t, id);
    return at == SIZE_MAX ? NULL : &t->records[t->index[at] - 1];
}

void kvpi_requests_remove(kvpi_requests *t, uint64_t id)
{
    size_t at = index_find(t, id);
    assert(at != SIZE_MAX);
    size_t slot = t->index[at] - 1;
    size_t mask = t->index_room - 1;
    /* Backward shift: later entries of the run move into the hole when their home allows. */
    size_t hole = at;
    for (size_t next = (hole + 1) & mask; t->index[next] != 0; next = (next + 1) & mask) {
        size_t home = home_of(t, t->records[t->index[next] - 1].id);
        /* Movable when home is not cyclically within (hole, next]. */
        if (((next - home) & mask) >= ((next - hole) & mask)) {
            t->index[hole] = t->index[next];
            hole = next;
        }
    }
    t->index[hole] = 0;
    kvpi_record *r = &t->records[slot];
    kvp_block_key *chain = r->chain;
    size_t chain_room = r->chain_room;
    memset(r, 0, sizeof *r);
    r->chain = chain;
    r->chain_room = chain_room;
    r->state = KVPI_RECORD_FREE;
    r->next_free = t->free_head;
    t->free_head = slot;
    t->live--;
}
