"""An Adaptive Replacement Cache (ARC) of token ids in fixed-shape arrays: EvoSpec's buffer.

EvoSpec (appendix A.3) keeps its dynamic vocabulary with ARC (Megiddo & Modha, 2003):
two resident lists, T1 (seen once: recency) and T2 (seen again: frequency), two ghost
lists of recently evicted ids, B1 and B2, and a target size ``p`` for T1 that a ghost hit
moves towards the list that should have kept the id. EvoSpec adds:

* a minimum residency: an id inserted fewer than ``min_residency`` decoding steps ago is
  not evicted (REPLACE takes the least recent *evictable* entry, from the other list if
  the preferred one has none, and a request that finds nothing evictable is dropped);
* a warm-up: ``p`` stays at its start value during the first ``warmup`` OOV events;
* at most ``max_insert`` new ids per event (an id entering T1 or T2 from outside them).

The state lives in the decode loop's carry (``SpecState.vocab``), so a compiled
``lax.while_loop`` keeps it with no host round trip. Lists are not linked lists but
slots with recency stamps: the LRU entry of a list is its valid slot with the smallest
stamp, and the MRU position is "stamp = clock" with the clock advancing per request.
``p`` is an integer and its step is ``max(1, |B2| // |B1|)`` (floor of the paper's
ratio), so the arrays and ``tests/vocab/arc_reference.py``'s plain-Python ARC agree
exactly on any trace.

Shapes (per row; every function here works on one row and is ``vmap``-ed over B):
resident ``[C]`` (C = capacity), ghosts ``[G]`` each. Empty slots hold ``EMPTY``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

from specjax import pytree

EMPTY = -1


@dataclasses.dataclass(frozen=True)
class ArcConfig:
    """EvoSpec's ARC settings (appendix A.3 defaults)."""

    capacity: int = 256  # C = N_dyn, resident ids (T1 + T2)
    ghost: int = 256  # |B1|, |B2| at most
    p_init: int = 128
    warmup: int = 50  # OOV events with p held at p_init
    min_residency: int = 8  # decoding steps before an id may be evicted
    max_insert: int = 32  # new ids per event


@pytree.dataclass
class ArcState:
    """One row's cache (add a leading [B] axis for a batch).

    ids: [C] int32 resident ids (T1 and T2), EMPTY where free.
    in_t2: [C] bool which resident ids are in T2.
    stamp: [C] int32 recency (larger = more recent).
    since: [C] int32 the decoding step at which the id became resident.
    b1, b2: [G] int32 ghost ids, EMPTY where free; b1_stamp, b2_stamp: [G] their recency.
    p: [] int32 target size of T1.
    clock: [] int32 the next stamp.
    events: [] int32 OOV events seen (for the warm-up).
    insertions, evictions: [] int32 counters for the statistics.
    """

    ids: Array
    in_t2: Array
    stamp: Array
    since: Array
    b1: Array
    b1_stamp: Array
    b2: Array
    b2_stamp: Array
    p: Array
    clock: Array
    events: Array
    insertions: Array
    evictions: Array

    @classmethod
    def empty(cls, cfg: ArcConfig, batch: int) -> ArcState:
        """A batch of empty caches."""
        c, g = (batch, cfg.capacity), (batch, cfg.ghost)
        zero = jnp.zeros((batch,), jnp.int32)
        return cls(ids=jnp.full(c, EMPTY, jnp.int32), in_t2=jnp.zeros(c, bool),
                   stamp=jnp.zeros(c, jnp.int32), since=jnp.zeros(c, jnp.int32),
                   b1=jnp.full(g, EMPTY, jnp.int32), b1_stamp=jnp.zeros(g, jnp.int32),
                   b2=jnp.full(g, EMPTY, jnp.int32), b2_stamp=jnp.zeros(g, jnp.int32),
                   p=jnp.full((batch,), cfg.p_init, jnp.int32), clock=zero, events=zero,
                   insertions=zero, evictions=zero)

    def occupancy(self) -> Array:
        """[...] int32 resident ids."""
        return jnp.sum(self.ids != EMPTY, axis=-1)


def _lru(valid: Array, stamp: Array) -> Array:
    """Index of the valid slot with the smallest stamp (meaningless if none is valid)."""
    return jnp.argmin(jnp.where(valid, stamp, jnp.iinfo(jnp.int32).max))


def _push_ghost(ids: Array, stamps: Array, x: Array, clock: Array, cap: int) -> tuple[Array, Array]:
    """Put ``x`` at the MRU end of a ghost list, dropping its LRU entry when full."""
    valid = ids != EMPTY
    free = jnp.argmin(valid)  # first free slot, if any
    slot = jnp.where(jnp.sum(valid) < cap, free, _lru(valid, stamps))
    return ids.at[slot].set(x), stamps.at[slot].set(clock)


def _drop_lru(ids: Array, stamps: Array) -> Array:
    valid = ids != EMPTY
    return jnp.where(jnp.any(valid), ids.at[_lru(valid, stamps)].set(EMPTY), ids)


def _replace(s: ArcState, in_b2: Array, step: Array,
             cfg: ArcConfig) -> tuple[ArcState, Array, Array]:
    """ARC's REPLACE with the minimum residency: free one resident slot.

    Returns (state with the victim moved to its ghost list, the freed slot, success).
    """
    resident = s.ids != EMPTY
    evictable = resident & (step - s.since >= cfg.min_residency)
    t1 = resident & ~s.in_t2
    n_t1 = jnp.sum(t1)
    prefer_t1 = (n_t1 >= 1) & ((in_b2 & (n_t1 == s.p)) | (n_t1 > s.p))
    e1, e2 = evictable & t1, evictable & s.in_t2
    from_t1 = jnp.where(prefer_t1, jnp.any(e1), ~jnp.any(e2) & jnp.any(e1))
    ok = jnp.any(e1) | jnp.any(e2)
    slot = jnp.where(from_t1, _lru(e1, s.stamp), _lru(e2, s.stamp))
    victim = s.ids[slot]
    b1, b1s = _push_ghost(s.b1, s.b1_stamp, victim, s.clock, cfg.ghost)
    b2, b2s = _push_ghost(s.b2, s.b2_stamp, victim, s.clock, cfg.ghost)
    s = dataclasses.replace(
        s, b1=jnp.where(from_t1, b1, s.b1), b1_stamp=jnp.where(from_t1, b1s, s.b1_stamp),
        b2=jnp.where(from_t1, s.b2, b2), b2_stamp=jnp.where(from_t1, s.b2_stamp, b2s),
        ids=s.ids.at[slot].set(EMPTY), clock=s.clock + 1, evictions=s.evictions + 1)
    return s, slot, ok


def request(s: ArcState, x: Array, step: Array, inserted: Array,
            cfg: ArcConfig) -> tuple[ArcState, Array]:
    """One ARC request for id ``x`` (EMPTY: no request) at decoding step ``step``.

    A resident ``x`` is a hit (to T2's MRU end). Otherwise, if fewer than
    ``cfg.max_insert`` ids were inserted this event (``inserted``), ``x`` enters T2 (a
    ghost hit, adapting ``p`` after the warm-up) or T1 (a miss), freeing a slot with
    REPLACE when the cache is full; a request that cannot free a slot changes nothing.
    Returns (the new state, ``inserted`` plus one if ``x`` was inserted).
    """
    c = cfg.capacity
    resident = s.ids != EMPTY
    hit_slot = s.ids == x
    hit = (x != EMPTY) & jnp.any(hit_slot)
    hit_state = dataclasses.replace(
        s, in_t2=s.in_t2 | hit_slot, stamp=jnp.where(hit_slot, s.clock, s.stamp),
        clock=s.clock + 1)

    # A miss: the ghost cases adapt p (after the warm-up) and always REPLACE; a cold miss
    # first trims the ghosts as ARC's case IV does, then REPLACEs only if the cache is full.
    in_b1, in_b2 = jnp.any(s.b1 == x), jnp.any(s.b2 == x)
    n_b1, n_b2 = jnp.sum(s.b1 != EMPTY), jnp.sum(s.b2 != EMPTY)
    n_t1 = jnp.sum(resident & ~s.in_t2)
    n_res = jnp.sum(resident)
    adapt = s.events > cfg.warmup  # events counts the current one
    up = jnp.minimum(c, s.p + jnp.maximum(1, n_b2 // jnp.maximum(n_b1, 1)))
    down = jnp.maximum(0, s.p - jnp.maximum(1, n_b1 // jnp.maximum(n_b2, 1)))
    p = jnp.where(adapt & in_b1, up, jnp.where(adapt & in_b2, down, s.p))
    l1_full = n_t1 + n_b1 >= c
    total = n_res + n_b1 + n_b2
    cold = ~in_b1 & ~in_b2
    # Case IV(a) with T1 holding everything: T1's LRU is dropped outright (no ghost).
    drop_t1 = cold & l1_full & (n_t1 >= c)
    b1 = jnp.where(in_b1, jnp.where(s.b1 == x, EMPTY, s.b1),
                   jnp.where(cold & l1_full & (n_t1 < c), _drop_lru(s.b1, s.b1_stamp), s.b1))
    b2 = jnp.where(in_b2, jnp.where(s.b2 == x, EMPTY, s.b2),
                   jnp.where(cold & ~l1_full & (total >= 2 * c), _drop_lru(s.b2, s.b2_stamp),
                             s.b2))
    miss = dataclasses.replace(s, p=p, b1=b1, b2=b2)
    full = n_res >= c
    replaced, freed, ok = _replace(miss, in_b2, step, cfg)
    # drop_t1: evict T1's least recent evictable entry without remembering it.
    t1_evictable = resident & ~s.in_t2 & (step - s.since >= cfg.min_residency)
    drop_slot = _lru(t1_evictable, s.stamp)
    dropped = dataclasses.replace(miss, ids=miss.ids.at[drop_slot].set(EMPTY),
                                  evictions=miss.evictions + 1)
    need_room = full & ~drop_t1
    after = jax.tree.map(lambda a, b, c_: jnp.where(drop_t1, c_, jnp.where(need_room, a, b)),
                         replaced, miss, dropped)
    slot = jnp.where(drop_t1, drop_slot, jnp.where(need_room, freed, jnp.argmin(resident)))
    room = jnp.where(drop_t1, jnp.any(t1_evictable), jnp.where(need_room, ok, True))
    inserted_state = dataclasses.replace(
        after, ids=after.ids.at[slot].set(x), in_t2=after.in_t2.at[slot].set(~cold),
        stamp=after.stamp.at[slot].set(after.clock), since=after.since.at[slot].set(step),
        clock=after.clock + 1, insertions=after.insertions + 1)
    do_insert = (x != EMPTY) & ~hit & (inserted < cfg.max_insert) & room
    new = jax.tree.map(lambda h, i, o: jnp.where(hit, h, jnp.where(do_insert, i, o)),
                       hit_state, inserted_state, s)
    return new, inserted + do_insert.astype(jnp.int32)


def touch(s: ArcState, tokens: Array) -> ArcState:
    """Hits for committed tokens [T] (EMPTY = none) that are resident, in order.

    The last occurrence of each id decides its recency, as sequential hits would.
    """
    t = tokens.shape[0]
    match = s.ids[:, None] == tokens[None, :]  # [C, T]
    match = match & (tokens[None, :] != EMPTY)
    last = jnp.max(jnp.where(match, jnp.arange(t)[None, :], -1), axis=1)
    # Stamps follow the hits' order; the clock advances once per hit.
    hits = jnp.any(match, axis=0)  # [T] which positions hit
    order = jnp.cumsum(hits) - 1  # rank of each hitting position among the hits
    hit = last >= 0
    stamp = jnp.where(hit, s.clock + order[jnp.maximum(last, 0)], s.stamp)
    return dataclasses.replace(s, in_t2=s.in_t2 | hit, stamp=stamp,
                               clock=s.clock + jnp.sum(hits))


def observe_event(s: ArcState, candidates: Array, step: Array, cfg: ArcConfig) -> ArcState:
    """One OOV event: ``candidates`` [R] (EMPTY-padded, deduplicated) requested in order."""
    s = dataclasses.replace(s, events=s.events + 1)

    def body(i, carry):
        s, inserted = carry
        return request(s, candidates[i], step, inserted, cfg)

    s, _ = jax.lax.fori_loop(0, candidates.shape[0], body, (s, jnp.zeros((), jnp.int32)))
    return s
