"""kvpager: paged transformer KV caches under one memory budget, from Python.

The classes wrap libkvpager's public C API (include/kvpager/*.h; their
docstrings summarize the headers' contracts):

  Pool      the shared page pool: config, stats(), audit(), digest()
  Cache     an external paged cache: append_rows, reserve/commit, fork,
            truncate, publish/adopt, block_table and page_view (zero-copy)
  View      a read-only buffer over a page or a block table (numpy.asarray)
  Model     attention layers (Model.random for experiments; update_param)
  Layer     one attention layer: create, random, info, set_window, update_param
  Sequence  a model's caches: step, prefill (the GIL released), fork, ...
  Decoder   batched steps and prefills of many sequences on threads
  Scheduler continuous batching: submit, step, collect, stats, sessions
  Error     the base of one exception class per kvp_status (PoolExhausted,
            Full, PageNotHeld, ...); error_classes maps status -> class

Every failed call raises and changes nothing, as in C. docs/python.md.
"""
from ._kvpager import *  # noqa: F401,F403
from ._kvpager import (Cache, Decoder, Error, Layer, Model, Pool, Scheduler,  # noqa: F401
                       Sequence, View, error_classes, library_version, __version__)

__all__ = ["Pool", "Cache", "View", "Model", "Layer", "Sequence", "Decoder", "Scheduler", "Error", "error_classes",
           "library_version", "__version__"] + [c.__name__ for c in error_classes.values()]
