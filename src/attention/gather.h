/*
 * gather.h: the page-walking loops of incremental attention (see gather.c).
 * Callers: src/attention and bench/.
 */
#ifndef KVPAGER_ATTENTION_GATHER_H
#define KVPAGER_ATTENTION_GATHER_H

#include <stddef.h>

#include "pager/cache_internal.h"

/*
 * Scores of every head of `lane`, [H][len + 1]: (query_h . key_p) * scale for
 * the len retained keys, then for the candidate key. queries and candidates
 * are [H][d_h], the lane's slices of the ticket's rows.
 */
void kvpi_gather_scores(const kvp_cache *cache, const double *queries, const double *candidates,
                        size_t lane, double scale, double *scores);

/*
 * Head outputs of `lane`, [H][d_h]: for each head the sum over positions of
 * weights[h][p] * value_p, retained values first, then the candidate's with
 * weights[h][len]. weights is [H][len + 1].
 */
void kvpi_gather_values(const kvp_cache *cache, const double *weights, const double *candidates,
                        size_t lane, double *outputs);

#endif /* KVPAGER_ATTENTION_GATHER_H */
