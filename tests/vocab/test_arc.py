"""specjax.vocab.arc against a plain-Python ARC (tests/vocab/arc_reference.py) on random traces."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.vocab.arc import EMPTY, ArcConfig, ArcState, observe_event, touch
from tests.vocab.arc_reference import ArcReference


def _lists(s: ArcState) -> dict:
    """One row's lists in LRU -> MRU order, as the reference holds them."""
    s = jax.tree.map(np.asarray, s)

    def order(ids, stamps, keep):
        idx = [i for i in np.argsort(stamps, kind="stable") if ids[i] != EMPTY and keep[i]]
        return [int(ids[i]) for i in idx]

    return {"t1": order(s.ids, s.stamp, ~s.in_t2), "t2": order(s.ids, s.stamp, s.in_t2),
            "b1": order(s.b1, s.b1_stamp, np.ones_like(s.b1, bool)),
            "b2": order(s.b2, s.b2_stamp, np.ones_like(s.b2, bool)),
            "p": int(s.p), "events": int(s.events), "insertions": int(s.insertions),
            "evictions": int(s.evictions)}


def _ref_lists(r: ArcReference) -> dict:
    return {"t1": list(r.t1), "t2": list(r.t2), "b1": list(r.b1), "b2": list(r.b2), "p": r.p,
            "events": r.events, "insertions": r.insertions, "evictions": r.evictions}


@functools.partial(jax.jit, static_argnames="cfg")
def _step(s, committed, candidates, step, has_event, cfg):
    s = touch(s, committed)
    return jax.lax.cond(has_event, lambda s: observe_event(s, candidates, step, cfg),
                        lambda s: s, s)


CONFIGS = [
    ArcConfig(capacity=8, ghost=8, p_init=4, warmup=3, min_residency=2, max_insert=3),
    ArcConfig(capacity=6, ghost=6, p_init=3, warmup=0, min_residency=0, max_insert=6),
    ArcConfig(capacity=5, ghost=3, p_init=0, warmup=5, min_residency=4, max_insert=2),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"C{c.capacity}G{c.ghost}")
@pytest.mark.parametrize("seed", range(4))
def test_arrays_match_the_reference_on_random_traces(cfg, seed):
    rng = np.random.default_rng(seed)
    universe = 3 * cfg.capacity + 4  # small enough that ids return as hits and ghost hits
    ref = ArcReference(cfg.capacity, cfg.ghost, cfg.p_init, cfg.warmup, cfg.min_residency,
                       cfg.max_insert)
    s = jax.tree.map(lambda a: a[0], ArcState.empty(cfg, 1))
    r_max, t_max = 7, 4
    p_seen = set()
    for step in range(120):
        committed = rng.integers(0, universe, rng.integers(0, t_max + 1)).tolist()
        cands = list(dict.fromkeys(rng.integers(0, universe, rng.integers(1, r_max + 1))))
        has_event = bool(rng.random() < 0.6)
        ref.touch(committed)
        if has_event:
            ref.event([int(x) for x in cands], step)
        pad = lambda xs, n: jnp.asarray(list(xs) + [EMPTY] * (n - len(xs)), jnp.int32)  # noqa: E731
        s = _step(s, pad(committed, t_max), pad(cands, r_max), jnp.int32(step),
                  jnp.bool_(has_event), cfg)
        assert _lists(s) == _ref_lists(ref), f"step {step}"
        p_seen.add(ref.p)
    # The trace exercised the adaptive paths: evictions, and ghost hits that moved p.
    assert ref.evictions > 0 and ref.insertions > cfg.capacity
    assert len(p_seen) > 1


def test_the_cache_never_exceeds_its_capacity_and_holds_distinct_ids():
    cfg = CONFIGS[0]
    s = jax.tree.map(lambda a: a[0], ArcState.empty(cfg, 1))
    rng = np.random.default_rng(0)
    for step in range(60):
        cands = jnp.asarray(rng.permutation(40)[:7], jnp.int32)
        s = _step(s, jnp.full((4,), EMPTY, jnp.int32), cands, jnp.int32(step), jnp.bool_(True),
                  cfg)
        ids = np.asarray(s.ids)
        live = ids[ids != EMPTY]
        assert live.size <= cfg.capacity and np.unique(live).size == live.size
        assert int(np.sum(np.asarray(s.b1) != EMPTY)) <= cfg.ghost


def test_minimum_residency_protects_new_ids():
    cfg = ArcConfig(capacity=4, ghost=4, p_init=2, warmup=0, min_residency=5, max_insert=4)
    s = jax.tree.map(lambda a: a[0], ArcState.empty(cfg, 1))
    none = jnp.full((4,), EMPTY, jnp.int32)
    s = _step(s, none, jnp.arange(4, dtype=jnp.int32), jnp.int32(0), jnp.bool_(True), cfg)
    # Step 3: everything is younger than 5 steps, so nothing may be evicted.
    s = _step(s, none, jnp.arange(10, 14, dtype=jnp.int32), jnp.int32(3), jnp.bool_(True), cfg)
    assert sorted(np.asarray(s.ids).tolist()) == [0, 1, 2, 3]
    s = _step(s, none, jnp.arange(10, 14, dtype=jnp.int32), jnp.int32(5), jnp.bool_(True), cfg)
    assert sorted(np.asarray(s.ids).tolist()) == [10, 11, 12, 13]


def test_insertions_per_event_are_capped():
    cfg = ArcConfig(capacity=16, ghost=16, max_insert=3, min_residency=0)
    s = jax.tree.map(lambda a: a[0], ArcState.empty(cfg, 1))
    s = _step(s, jnp.full((4,), EMPTY, jnp.int32), jnp.arange(8, dtype=jnp.int32),
              jnp.int32(0), jnp.bool_(True), cfg)
    assert sorted(int(x) for x in np.asarray(s.ids) if x != EMPTY) == [0, 1, 2]
