"""Decoder (batched steps on threads) and Scheduler (submit, step, collect,
stats, sessions, callbacks)."""
import numpy as np
import pytest

import kvpager
from conftest import state

WIDTH = 16


@pytest.fixture
def model():
    m = kvpager.Model.random(2, WIDTH, 2, 64, seed=4)
    yield m
    m.close()


@pytest.fixture
def decoder():
    d = kvpager.Decoder(2)
    yield d
    d.close()


def x_of(n, seed):
    return np.random.default_rng(seed).standard_normal((1, n, WIDTH)) * 0.5


def test_decoder_jobs_equal_sequences_alone(pool, model, decoder):
    assert decoder.threads == 2
    xs = [x_of(4, s) for s in (1, 2, 3)]
    alone = []
    for x in xs:
        with kvpager.Sequence(model, pool, 1, 16) as s:
            alone.append((s.prefill(x[:, :3]), s.step(x[:, 3:])))
    seqs = [kvpager.Sequence(model, pool, 1, 16) for _ in xs]
    got = decoder.step([(s, x[:, :3], "prefill") for s, x in zip(seqs, xs)])
    got2 = decoder.step([(s, x[:, 3:]) for s, x in zip(seqs, xs)])
    for i in range(3):
        assert np.array_equal(got[i], alone[i][0]) and np.array_equal(got2[i], alone[i][1])
    pool.audit()
    for s in seqs:
        s.close()


def test_decoder_failed_job_is_its_own(pool, model, decoder):
    a, b = kvpager.Sequence(model, pool, 1, 16), kvpager.Sequence(model, pool, 1, 16)
    decoder.step([(a, x_of(1, 1)), (b, x_of(1, 2))])
    before = state(pool, b.cache(0), b.cache(1))
    bad = x_of(1, 3)
    bad[0, 0, 2] = np.inf
    got = decoder.step([(a, x_of(1, 4)), (b, bad)])
    assert isinstance(got[0], np.ndarray)
    assert isinstance(got[1], kvpager.NonFiniteProjection)
    assert a.len == 2 and b.len == 1
    assert state(pool, b.cache(0), b.cache(1))[2] == before[2]
    # the whole batch refused: two jobs on one sequence; nothing runs
    with pytest.raises(kvpager.InvalidArgument):
        decoder.step([(a, x_of(1, 5)), (a, x_of(1, 6))])
    assert a.len == 2
    with pytest.raises(ValueError):
        decoder.step([(a, x_of(1, 5), "decode")])
    a.close()
    b.close()


def test_scheduler_tokens_equal_a_sequence(pool, model, decoder):
    prompt = x_of(5, 7)[0]
    rows = {p: np.full(WIDTH, 0.01 * p) for p in range(5, 9)}
    tokens = {}
    with kvpager.Scheduler(model, pool, decoder, capacity=32) as s:
        rid = s.submit(prompt, max_new_tokens=3, input=lambda i, smp, p: rows[p],
                       on_token=lambda i, smp, p, out: tokens.__setitem__(p, out))
        assert s.request_state(rid) == "waiting" and s.records == 1
        steps = 0
        while s.stats()["uncollected"] == 0:
            s.step()
            steps += 1
        assert s.request_state(rid) == "finished"
        (res,) = s.collect()
        assert res["id"] == rid and res["status"] == "Ok" and res["error"] is None
        assert res["tokens_generated"] == 3 and not res["rejected"]
        assert s.records == 0
        with pytest.raises(kvpager.RequestUnknown) as e:
            s.request_state(rid)
        assert e.value.index == rid
        st = s.stats()
        assert st["submitted"] == 1 and st["completed"] == 1 and st["tokens_generated"] == 3
    # the same tokens from a Sequence by hand
    with kvpager.Sequence(model, pool, 1, 32) as q:
        q.prefill(prompt[None])
        for p in sorted(tokens):
            out = q.step(rows[p].reshape(1, 1, WIDTH))
            assert np.array_equal(out.reshape(WIDTH), tokens[p]), p
    assert sorted(tokens) == [5, 6, 7]
    pool.audit()
    assert pool.stats()["held_pages"] == 0


def test_scheduler_submit_errors_change_nothing(pool, model, decoder):
    with kvpager.Scheduler(model, pool, decoder, capacity=8) as s:
        with pytest.raises(kvpager.Full) as e:
            s.submit(x_of(6, 1)[0], max_new_tokens=3, input=lambda *a: np.zeros(WIDTH))
        assert e.value.tokens == 9 and e.value.available == 8
        with pytest.raises(kvpager.NullArgument):
            s.submit(x_of(2, 1)[0], max_new_tokens=1)  # compute needs input
        with pytest.raises(kvpager.InvalidArgument):
            s.submit(x_of(2, 1)[0], max_new_tokens=0, input=lambda *a: np.zeros(WIDTH))
        assert s.stats()["submitted"] == 0 and s.records == 0


def test_scheduler_callback_exception_is_raised_by_step(pool, model, decoder):
    def bad_input(i, smp, p):
        raise KeyError("no row %d" % p)

    with kvpager.Scheduler(model, pool, decoder, capacity=16) as s:
        s.submit(x_of(2, 1)[0], max_new_tokens=2, input=bad_input)
        with pytest.raises(KeyError):
            for _ in range(5):
                s.step()
        for _ in range(3):
            s.step()
        (res,) = s.collect()
        assert res["status"] != "Ok" and isinstance(res["error"], kvpager.Error)
    pool.audit()


def test_scheduler_sessions(pool, model, decoder):
    """A session's finished sequence is kept; its next turn adopts its blocks."""
    rows = np.random.default_rng(1).standard_normal((40, WIDTH)) * 0.5
    inp = lambda i, smp, p: rows[p]  # noqa: E731
    with kvpager.Scheduler(model, pool, decoder, capacity=64, session_ttl=8) as s:
        first = s.submit(rows[:8], max_new_tokens=4, session=7, input=inp)
        for _ in range(6):
            s.step()
        st = s.stats()
        assert st["session_keeps"] == 1 and st["retained"] == 1
        second = s.submit(rows[:20], max_new_tokens=2, session=7, input=inp)
        for _ in range(6):
            s.step()
        res = s.collect()
        assert [r["id"] for r in res] == [first, second]
        assert [r["status"] for r in res] == ["Ok", "Ok"]
        assert res[1]["first_hit_tokens"] == 12  # the first turn's 3 full blocks
        assert s.stats()["session_hits"] == 1
    pool.audit()
    assert pool.stats()["held_pages"] == 0


def test_scheduler_allocator_only():
    with kvpager.Pool(block_tokens=4, heads=2, head_width=8, budget_bytes=1 << 16,
                      slab_source="reserved") as p:
        with kvpager.Scheduler(None, p, None, capacity=64, compute=False, layers=2,
                               model_width=16) as s:
            ids = [s.submit(None, prompt_tokens=9, max_new_tokens=4, samples=2),
                   s.submit(None, prompt_tokens=20, max_new_tokens=2)]
            for _ in range(10):
                s.step()
            res = sorted(s.collect(), key=lambda r: r["id"])  # collected as they finished
            assert [r["id"] for r in res] == ids and all(r["status"] == "Ok" for r in res)
            assert [r["tokens_generated"] for r in res] == [8, 2]
            assert s.stats()["forks"] == 1  # the second sample shares the prompt
        p.audit()
        assert p.stats()["held_pages"] == 0


def test_scheduler_keeps_its_objects_alive(pool, model):
    d = kvpager.Decoder(1)
    s = kvpager.Scheduler(model, pool, d, capacity=8)
    del d
    s.submit(x_of(2, 1)[0], max_new_tokens=1, input=lambda *a: np.zeros(WIDTH))
    s.step()
    assert s.collect()[0]["status"] == "Ok"
    s.close()


def test_objects_a_scheduler_uses_refuse_to_close(pool, model):
    d = kvpager.Decoder(1)
    s = kvpager.Scheduler(model, pool, d, capacity=8)
    for obj in (d, pool, model):
        with pytest.raises(RuntimeError):
            obj.close()
    assert not pool.closed
    s.close()
    d.close()  # now it may
