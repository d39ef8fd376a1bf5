"""kvpager: paged transformer KV caches under one memory budget, from Python.

The classes wrap libkvpager's public C API (include/kvpager/*.h; their
docstrings summarize the headers' contracts):

  Pool      the shared page pool: config, stats(), audit(), digest()
  Cache     an external paged cache: append_rows, reserve/commit, fork,
            truncate, publish/adopt, block_table and page_view (zero-copy)
  View      a read-only buffer over a page or a block table (numpy.asarray)
  Model     attention layers (Model.random for experiments; update_param)
  Layer     one attention layer: create, random, info, set_window, set_accum,
            set_kv_scales, update_param; cache() (a cache bound to it),
            forward / prepare (one token's attention step), reference
  Ticket    a two-phase attention step: Layer.prepare, commit, discard, result
  Sequence  a model's caches: step, prefill (the GIL released), fork, ...
  Decoder   batched steps and prefills of many sequences on threads
  Scheduler continuous batching: submit, step, collect, stats, sessions
  group_probe, group_adopt, group_publish
            prefix sharing over a group of caches (one sequence's layers)
  HostTier  a second tier in host memory (Pool.attach_tier; keys_only for a
            pool without data); group_tier_load maps its verified blocks back
            into a group of caches
  RedisTier a second tier on a Redis server, shared between processes
  Tier      the base of the two (close, closed, name, keys_only)
  Error     the base of one exception class per kvp_status (PoolExhausted,
            Full, PageNotHeld, ...); error_classes maps status -> class

Every failed call raises and changes nothing, as in C. docs/python.md.
"""
from ._kvpager import *  # noqa: F401,F403
from ._kvpager import (Cache, Decoder, Error, HostTier, Layer, Model, Pool,  # noqa: F401
                       RedisTier, Scheduler, Sequence, Ticket, Tier, View, error_classes, group_adopt,
                       group_probe, group_publish, group_tier_load, library_version,
                       __version__)

__all__ = ["Pool", "Cache", "View", "Model", "Layer", "Ticket", "Sequence", "Decoder",
           "Scheduler", "Tier", "HostTier", "RedisTier", "Error", "error_classes", "group_probe", "group_adopt",
           "group_publish", "group_tier_load",
           "library_version", "__version__"] + [c.__name__ for c in error_classes.values()]
