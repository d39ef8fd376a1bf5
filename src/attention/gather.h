/*
 * gather.h: the page-walking loops of incremental attention (see gather.c).
 * Callers: src/attention and bench/.
 */
#ifndef KVPAGER_ATTENTION_GATHER_H
#define KVPAGER_ATTENTION_GATHER_H

#include <stddef.h>

#include "pager/cache_internal.h"

/*
 * Scores of every query head of `lane`, [H][len + 1]: (query_h . key_p) *
 * scale for the len retained keys of KV head h / (H / H_kv), then for its
 * candidate key. queries are [H][d_h] and candidates [H_kv][d_h], the lane's
 * slices of the ticket's rows; H is cache->binding.heads, H_kv cache->heads.
 */
void kvpi_gather_scores(const kvp_cache *cache, const double *queries, const double *candidates,
                        size_t lane, double scale, double *scores);

/*
 * Head outputs of `lane`, [H][d_h]: for each query head the sum over
 * positions of weights[h][p] * value_p of its KV head, retained values first,
 * then the candidate's ([H_kv][d_h]) with weights[h][len]. weights is
 * [H][len + 1].
 */
void kvpi_gather_values(const kvp_cache *cache, const double *weights, const double *candidates,
                        size_t lane, double *outputs);

#endif /* KVPAGER_ATTENTION_GATHER_H */
