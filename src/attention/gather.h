/*
 * gather.h: the page-walking loops of incremental attention (see gather.c).
 * Callers: src/attention and bench/.
 */
#ifndef KVPAGER_ATTENTION_GATHER_H
#define KVPAGER_ATTENTION_GATHER_H

#include <stddef.h>

#include "pager/cache_internal.h"

/*
 * scores[0..len] of (lane, head): (query . key_p) * scale for the len retained
 * keys, then for the candidate key. query and candidate hold d_h values.
 */
void kvpi_gather_scores(const kvp_cache *cache, const double *query, const double *candidate,
                        size_t lane, size_t head, double scale, double *scores);

/*
 * out[0..d_h) of (lane, head): the sum over positions of weights[p] * value_p,
 * retained values first, then the candidate (weights[len]).
 */
void kvpi_gather_values(const kvp_cache *cache, const double *weights, const double *candidate,
                        size_t lane, size_t head, double *out);

#endif /* KVPAGER_ATTENTION_GATHER_H */
