"""Reference counts and memory over many create/destroy cycles."""
import gc
import resource
import sys

import numpy as np

import kvpager


def cycle(model, decoder, layer):
    with kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=1 << 15) as p:
        c = kvpager.Cache(p, batch_size=1, capacity=16)
        k = np.ones((1, 2, 5, 8))
        c.append_rows(k, k)
        np.asarray(c.page_view(0, 1)).sum()
        np.asarray(c.block_table(0)).sum()
        f = c.fork()
        c.keys()
        try:
            c.append_rows(np.full((1, 2, 20, 8), 1.0), k[:, :, :1])
        except kvpager.Error:
            pass
        f.close()
        c.reserve_rows(2)
        for span in c.reserved_slots(0):
            np.asarray(span["view"])[...] = 0.5
        c.commit_written(2)
        c.close()
        with layer.cache(p, batch_size=1, capacity=8) as lc:
            layer.forward(lc, np.zeros((1, 1, 16)))
            t = layer.prepare(lc, np.ones((1, 1, 16)))
            t.result()
            t.commit(lc)
            pending = layer.prepare(lc, np.ones((1, 1, 16)))  # its pages go back with it
            try:
                layer.forward(lc, np.zeros((1, 1, 3)))
            except kvpager.InputWidthMismatch:
                pass
            layer.reference(np.zeros((1, 2, 16)), dtype="bf16")
            kvpager.group_probe([lc], [(1, 2)])
            try:
                kvpager.group_adopt([lc, c], [])
            except ValueError:
                pass
            del pending, t
        with kvpager.Sequence(model, p, 1, 8) as s:
            s.prefill(np.zeros((1, 3, 16)))
            s.step(np.zeros((1, 1, 16)))
            s.cache(0).keys()
            decoder.step([(s, np.zeros((1, 1, 16)))])
            try:
                decoder.step([(s, np.zeros((1, 1, 16))), (s, np.zeros((1, 1, 16)))])
            except kvpager.InvalidArgument:
                pass
        with kvpager.Scheduler(model, p, decoder, capacity=8) as sched:
            sched.submit(np.zeros((2, 16)), max_new_tokens=1, input=lambda *a: np.zeros(16),
                         on_token=lambda *a: None)
            sched.step()
            sched.collect()


def counts(model):
    return tuple(sys.getrefcount(o) for o in (model, kvpager.Pool, kvpager.Cache, kvpager.View,
                                               kvpager.Layer, kvpager.Ticket,
                                               kvpager.Sequence, kvpager.Scheduler,
                                               kvpager.Decoder, kvpager.Full,
                                               kvpager.InvalidArgument))


def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def test_no_reference_or_memory_growth():
    model = kvpager.Model.random(2, 16, 2, 16, seed=1)
    decoder = kvpager.Decoder(2)
    layer = kvpager.Layer.random(16, 2, 16, seed=3)
    for _ in range(200):  # warm up allocators and caches
        cycle(model, decoder, layer)
    gc.collect()
    refs = counts(model)
    rss0 = rss_kib()
    blocks0 = sys.getallocatedblocks()
    for _ in range(2000):
        cycle(model, decoder, layer)
    gc.collect()
    grown_kib = rss_kib() - rss0
    grown_blocks = sys.getallocatedblocks() - blocks0
    after = counts(model)  # taken before any assert: pytest's rewriting holds references
    assert after == refs
    # a leak of one object per cycle would be >= 2000 blocks; a pool slab per
    # cycle would be 32 KiB * 2000
    assert grown_blocks < 200, grown_blocks
    assert grown_kib < 4096, grown_kib
    decoder.close()
    model.close()
