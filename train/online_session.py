"""An EvoSpec session: requests in order, the drafter aligned online and the vocabulary evolving.

:class:`OnlineSession` keeps, between :meth:`OnlineSession.generate` calls, everything
EvoSpec adapts: the LoRA deltas and their optimiser state, the replay buffer, and the
EvoSpec head's buffer (``vocab_state``). After each request it turns the verified text into
draft-anchor samples (:func:`collect_samples`, the gate of :mod:`specjax.train.online`),
and when the replay buffer holds B samples it runs an update. With ``OnlineConfig(guard=True)``
(not the paper's) the adapter drafts only after it beat the frozen drafter on the newest
request, text it had not been fitted on. ``save`` / ``restore`` write and read the whole
state with orbax.

The drafter only proposes: every request's output is the target's (greedy output equals
vanilla, sampled output has the target's distribution), whatever the deltas are.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.loaded import Drafter, Target
from specjax.loop import bucket
from specjax.model import forward_hidden, init_cache, lm_head
from specjax.train.online import (
    Lora,
    OnlineConfig,
    Samples,
    gather_anchors,
    init_lora,
    make_optimizer,
    memory_bytes,
    merge,
    num_anchors,
    update_jit,
    update_on_batches_jit,
)


class TeacherForced(NamedTuple):
    """:func:`teacher_forced`'s pass over T tokens (a tuple, so it unpacks as one)."""

    feats: np.ndarray  # [T, d] the drafter's input features (from the target)
    top_ids: np.ndarray  # [T, k] the target's top-k ids
    top_logits: np.ndarray  # [T, k] and their logits
    first: np.ndarray  # [T] the drafter's first draft at row t, a draft of ids[t + 1]


def _padded(ids: list[int]) -> tuple[jax.Array, jax.Array]:
    """[1, bucket(T)] tokens (zero-padded after the text) and their positions."""
    n = bucket(len(ids))
    return (jnp.asarray([ids + [0] * (n - len(ids))], jnp.int32),
            jnp.arange(n, dtype=jnp.int32)[None])


def teacher_forced(target: Target, dp: Any, cfg: Any, ids: list[int], k: int,
                   active: np.ndarray) -> TeacherForced:
    """One teacher-forced pass of target and drafter over ``ids`` (T tokens), each row
    reading its whole sequence before it (as at inference).

    active: [V] bool the vocabulary the drafter drafts from. Returns (drafter input
    features [T, d] (the target's final-norm states, plus the drafter's tapped layers when
    it has any), the target's top-k ids and logits [T, k], and the drafter's first draft
    [T]: its argmax over ``active`` at row t, a draft of ids[t + 1]).
    """
    toks, pos = _padded(ids)
    hidden, _, taps = forward_hidden(target.params, target.cfg, toks, pos,
                                     init_cache(target.cfg, 1, toks.shape[1]),
                                     tap_layers=cfg.tap_layers(target.cfg))
    top = jax.lax.top_k(lm_head(target.params, hidden)[0].astype(jnp.float32), k)
    feats = np.asarray(cfg.target_features(dp, hidden, taps)[0, :len(ids)], np.float32)
    return TeacherForced(feats, np.asarray(top[1][:len(ids)]), np.asarray(top[0][:len(ids)]),
                         first_drafts(target, dp, cfg, ids, feats, active))


def first_drafts(target: Target, dp: Any, cfg: Any, ids: list[int], feats: np.ndarray,
                 active: np.ndarray) -> np.ndarray:
    """[T] the drafter's first draft at each row of ``ids`` (T tokens), teacher-forced on
    ``feats`` ([T, d], :func:`teacher_forced`'s: the same for the base drafter and any
    adapter of it, since LoRA never adapts the tap fusion that makes them): its argmax over
    ``active`` ([V] bool) at row t, a draft of ids[t + 1]. Another drafter over the same
    text needs only this, not the target again."""
    from specjax.drafter import drafter_hidden, init_drafter_cache

    (toks, pos), t = _padded(ids), len(ids)
    n = toks.shape[1]
    # Row i reads the feature at i - 1 (row 0 a zero one); padded rows come after the text.
    shifted = jnp.zeros((1, n, feats.shape[1]), target.params.embed.dtype)
    shifted = shifted.at[0, 1:t].set(feats[:-1])
    h, _ = drafter_hidden(dp, cfg, target.params.embed, toks, shifted, pos,
                          init_drafter_cache(cfg, 1, n, shifted.dtype))
    logits = jnp.where(jnp.asarray(active)[None], h[0, :t] @ target.params.head.T, -jnp.inf)
    return np.asarray(logits.argmax(-1))


def guard_counts(adapted: np.ndarray, frozen: np.ndarray, ids: list[int], prompt_len: int,
                 active: np.ndarray) -> tuple[int, int]:
    """The guard's evidence on one verified sequence (OnlineConfig.guard): of the output's
    rows whose target token is in ``active`` ([V] bool), how many the adapted drafter's first
    draft hit and the frozen one's missed (wins), and the reverse (losses). adapted, frozen:
    [T] first drafts (:func:`first_drafts`) over ``ids`` (T tokens)."""
    nxt = np.asarray(ids[1:])
    rows = np.arange(max(prompt_len - 1, 0), len(ids) - 1)
    rows = rows[active[nxt[rows]]]
    hit_a, hit_f = adapted[rows] == nxt[rows], frozen[rows] == nxt[rows]
    return int((hit_a & ~hit_f).sum()), int((hit_f & ~hit_a).sum())


def collect_samples(target: Target, dp: Any, cfg: Any, ids: list[int], prompt_len: int,
                    active: np.ndarray, oc: OnlineConfig, *, mismatched_only: bool = True
                    ) -> Samples | None:
    """Draft anchors of one verified sequence (the gate of the module doc), as numpy arrays
    (one sequence: N = 1, W = bucket(T + G)).

    ids: prompt + output tokens (T); active: [V] bool the active vocabulary at the end of
    the request (EvoSpec's core and buffer). A row t predicts ids[t + 1]; anchors are the
    rows in the output's range whose active-vocab argmax misses an in-vocabulary target
    token. ``mismatched_only=False`` keeps every such row whose target token is in the
    vocabulary, hit or miss (an evaluation set, or OSD-style distillation on the whole
    verified text).
    """
    return anchor_samples(teacher_forced(target, dp, cfg, ids, oc.top_k, active), ids,
                          prompt_len, active, oc, mismatched_only=mismatched_only)


def anchor_samples(passes: TeacherForced, ids: list[int], prompt_len: int, active: np.ndarray,
                   oc: OnlineConfig, *, mismatched_only: bool = True) -> Samples | None:
    """:func:`collect_samples` from a :func:`teacher_forced` pass already made."""
    feats, top_ids, top_logits, pred = passes
    nxt = np.asarray(ids[1:] + [-1])
    g = oc.horizon
    rows = np.arange(max(prompt_len - 1, 0), len(ids) - 1)
    keep = active[nxt[rows]]
    if mismatched_only:
        keep &= pred[rows] != nxt[rows]
    rows = rows[keep]
    if rows.size == 0:
        return None
    t, w = len(ids), bucket(len(ids) + g)
    tokens = np.zeros((1, w), np.int32)
    tokens[0, :t] = ids
    f = np.zeros((1, w, feats.shape[1]), np.float32)
    f[0, 1:t] = feats[:-1]  # row i reads the feature at i - 1
    span = rows[:, None] + np.arange(g)[None]
    valid = span < t - 1  # the position's next token exists
    span = np.minimum(span, t - 1)
    return Samples(tokens=tokens, feats=f, seq=np.zeros(rows.size, np.int32),
                   anchors=rows.astype(np.int32), top_ids=top_ids[span],
                   top_logits=top_logits[span], valid=valid)


def drop_oldest(parts: list[Samples], keep: int) -> list[Samples]:
    """The newest ``keep`` anchors of ``parts`` (oldest first; a part whose anchors all
    go is dropped with its sequence)."""
    out, room = [], keep
    for s in reversed(parts):
        n = num_anchors(s)
        if room <= 0:
            break
        if n > room:
            cut = slice(n - room, n)
            s = dataclasses.replace(s, seq=s.seq[cut], anchors=s.anchors[cut],
                                    top_ids=s.top_ids[cut], top_logits=s.top_logits[cut],
                                    valid=s.valid[cut])
        out.append(s)
        room -= num_anchors(s)
    return out[::-1]


def _pairs(parts: list[Samples]) -> list[tuple[int, int]]:
    """Every (part, anchor) pair of ``parts``, oldest first."""
    return [(p, a) for p, s in enumerate(parts) for a in range(num_anchors(s))]


@dataclasses.dataclass
class OnlineSession:
    """Requests in order with EvoSpec: ``vocab`` evolves, LoRA aligns (``adapt``)."""

    target: Target
    drafter: Drafter
    vocab: Any  # a VocabHead (an EvoSpec head, or any head for LoRA alone)
    oc: OnlineConfig = OnlineConfig()
    adapt: bool = True
    seed: int = 0
    lora: Lora | None = None
    opt_state: Any = None
    vocab_state: Any = None
    buffer: list = dataclasses.field(default_factory=list)  # Samples, one per request
    # oc.replay > 0: the last oc.replay samples (Samples, one per request) and how many
    # arrived since the last update; not saved by ``save`` (a restored session refills it).
    window: list = dataclasses.field(default_factory=list)
    pending: int = 0
    # oc.guard: does the adapter draft the next request (it beat the frozen drafter on the
    # newest one)? stats["guard"] keeps each request's (wins, losses).
    deployed: bool = False
    stats: dict = dataclasses.field(default_factory=lambda: {
        "requests": 0, "samples": 0, "updates": 0, "update_s": [], "loss": [], "guard": []})

    def __post_init__(self) -> None:
        from specjax.drafter import DrafterConfig

        if self.adapt and not isinstance(self.drafter.cfg, DrafterConfig):
            kind = type(self.drafter.cfg).__name__
            raise ValueError("online LoRA alignment adapts EAGLE-1/2 drafters (one decoder "
                             f"layer with W_q, W_v); this drafter is {kind}; pass adapt=False "
                             "to keep only the vocabulary state")
        if self.oc.replay and self.oc.replay < self.oc.buffer:
            raise ValueError(f"a replay window of {self.oc.replay} samples cannot give a batch "
                             f"of {self.oc.buffer}: use replay >= {self.oc.buffer}, or 0 for "
                             "the paper's buffer")
        if self.lora is None:
            self._fresh_adapter()

    def reset(self) -> None:
        """Forget what the session learned: the LoRA deltas back to zero (the same
        initialisation), a fresh optimiser state, the replay buffer and window emptied and the
        vocabulary state dropped (the next request starts from the head's initial state).
        ``stats`` keep counting across resets. For a new, unrelated conversation: an adapter
        fitted to one conversation lowers acceptance in the next, and one session per
        conversation raises it on long conversations, late in them (docs/benchmarks.md, the
        thirty-fourth to thirty-sixth sessions)."""
        self._fresh_adapter()
        self.vocab_state = None
        self.buffer, self.window, self.pending = [], [], 0
        self.deployed = False

    def _fresh_adapter(self) -> None:
        """Zero deltas (A random, B zero, from ``seed``) and their optimiser state."""
        self.lora = init_lora(self.drafter.cfg, self.oc.rank, self.oc.alpha,
                              jax.random.PRNGKey(self.seed), self.oc.targets)
        self.opt_state = make_optimizer(self.oc).init(self.lora)

    @property
    def adapter_drafts(self) -> bool:
        """Does the next request draft with the deltas merged (with ``oc.guard``, only while
        the adapter is deployed)?"""
        return self.adapt and (not self.oc.guard or self.deployed)

    def current_drafter(self) -> Drafter:
        """The drafter the next request drafts with: the adapted one or the base."""
        return self.adapted_drafter() if self.adapter_drafts else self.drafter

    def adapted_drafter(self) -> Drafter:
        """The base with the deltas merged, deployed or not: the drafter the updates fit."""
        return dataclasses.replace(self.drafter, params=merge(self.drafter.params, self.lora))

    def active_vocabulary(self) -> np.ndarray:
        """[V] bool: the ids the next request drafts from (the head's, with EvoSpec's buffer)."""
        v = self.target.cfg.vocab_size
        head = self.vocab
        if not getattr(head, "stateful", False):
            active = np.zeros(v, bool)
            ids = getattr(head, "ids", None)
            active[np.asarray(ids) if ids is not None else np.arange(v)] = True
            return active
        active = np.asarray(head.in_core).copy()
        dyn = np.asarray(self.vocab_state.arc.ids[0])
        active[dyn[dyn >= 0]] = True
        return active

    def generate(self, prompt: Any, **kwargs: Any) -> Any:
        """One request (one prompt): :func:`specjax.generate` with this session's state."""
        import specjax
        from specjax.api import encode_prompts

        ids = encode_prompts(self.target, prompt, kwargs.get("chat", True),
                             kwargs.get("system"))
        if len(ids) != 1:
            raise ValueError("a session serves one conversation: pass one prompt per request")
        res = specjax.generate(self.target, ids, drafter=self.current_drafter(),
                               vocab=self.vocab, vocab_state=self.vocab_state,
                               **{k: v for k, v in kwargs.items() if k not in ("chat", "system")})
        self.vocab_state = res.vocab_state
        self.stats["requests"] += 1
        if self.adapt:
            self._learn(ids[0], res.tokens[0])
        return res

    def _learn(self, prompt: list[int], output: list[int]) -> None:
        dr, ids, active = self.adapted_drafter(), prompt + output, self.active_vocabulary()
        passes = teacher_forced(self.target, dr.params, dr.cfg, ids, self.oc.top_k, active)
        if self.oc.guard:
            # Prequential: the adapter has not been fitted on this request yet, so its hits
            # here against the frozen drafter's say how it will draft text it has not seen.
            base = self.drafter
            frozen = first_drafts(self.target, base.params, base.cfg, ids, passes.feats, active)
            wins, losses = guard_counts(passes.first, frozen, ids, len(prompt), active)
            self.stats["guard"].append((wins, losses))
            self.deployed = wins > losses
        s = anchor_samples(passes, ids, len(prompt), active, self.oc)
        if s is None:
            return
        self.stats["samples"] += num_anchors(s)
        if self.oc.replay:
            self._replay(s)
            return
        self.buffer.append(s)
        if sum(num_anchors(b) for b in self.buffer) < self.oc.buffer:
            return
        # "Updates run when it fills": one update on the newest B samples, then it empties.
        newest = drop_oldest(self.buffer, self.oc.buffer)
        batch = jax.tree.map(jnp.asarray, gather_anchors(newest, _pairs(newest)))
        self.buffer = []
        t0 = time.perf_counter()
        self.lora, self.opt_state, st = jax.block_until_ready(update_jit(
            self.lora, self.opt_state, self.drafter.params, self.drafter.cfg,
            self.target.params.embed, self.target.params.head, batch, self.oc))
        self._record(t0, st)

    def window_size(self) -> int:
        """Samples in the replay window (``oc.replay`` > 0)."""
        return sum(num_anchors(s) for s in self.window)

    def _replay(self, s: Samples) -> None:
        """Experience replay (``oc.replay`` > 0, not the paper's): keep the newest
        ``oc.replay`` samples; per B new ones, ``steps_per_update`` steps, each on B samples
        drawn without replacement from the window (a batch never repeats a sample, so the
        window must hold B before the first update)."""
        self.window = drop_oldest([*self.window, s], self.oc.replay)
        self.pending += num_anchors(s)
        pairs, b = _pairs(self.window), self.oc.buffer
        rng = np.random.default_rng([self.seed, self.stats["updates"]])
        while self.pending >= b and len(pairs) >= b:
            # Each step's batch is padded to the same (N, W) so the steps stack.
            draws = [[pairs[i] for i in rng.choice(len(pairs), b, replace=False)]
                     for _ in range(self.oc.steps_per_update)]
            n = bucket(max(len({p for p, _ in d}) for d in draws), 1)
            w = max(self.window[p].tokens.shape[1] for d in draws for p, _ in d)
            batches = [gather_anchors(self.window, d, n, w) for d in draws]
            stacked = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *batches)
            t0 = time.perf_counter()
            self.lora, self.opt_state, st = jax.block_until_ready(update_on_batches_jit(
                self.lora, self.opt_state, self.drafter.params, self.drafter.cfg,
                self.target.params.embed, self.target.params.head, stacked, self.oc))
            self._record(t0, st)
            self.pending -= b

    def _record(self, t0: float, st: dict) -> None:
        self.stats["update_s"].append(time.perf_counter() - t0)
        self.stats["loss"].append(float(st["loss"]))
        self.stats["updates"] += 1

    def memory(self) -> dict:
        return memory_bytes(self.lora, self.drafter.params, make_optimizer(self.oc))

    # ------------------------------------------------------------------ persistence
    def _vocab_state_or_initial(self) -> Any:
        """The vocabulary state, or a stateful head's initial one before the first request
        (or after :meth:`reset`), so that what ``save`` writes ``restore`` can read."""
        if self.vocab_state is None and getattr(self.vocab, "stateful", False):
            return self.vocab.init_state(1)
        return self.vocab_state

    def save(self, path: str | Path) -> Path:
        """Write LoRA, optimiser state and the vocabulary state with orbax."""
        import orbax.checkpoint as ocp

        path = Path(path).absolute()
        state = {"lora": self.lora, "opt_state": self.opt_state,
                 "vocab_state": self._vocab_state_or_initial(), "stats": {
                     "requests": self.stats["requests"], "updates": self.stats["updates"]},
                 "deployed": np.asarray(self.deployed)}
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(path, jax.tree.map(np.asarray, state), force=True)
        ckptr.wait_until_finished()
        return path

    def restore(self, path: str | Path) -> None:
        """Read what :meth:`save` wrote into this session (same drafter, head and settings).

        Raises FileNotFoundError when ``path`` holds no saved session, and ValueError,
        before reading anything, when the saved LoRA adapts other matrices than
        ``oc.targets``."""
        import orbax.checkpoint as ocp

        path = Path(path).absolute()
        meta = ocp.StandardCheckpointer().metadata(path).item_metadata if path.is_dir() else None
        if meta is None or "lora" not in meta:
            raise FileNotFoundError(f"no saved session at {path}: pass the folder "
                                    "OnlineSession.save wrote")
        saved = meta["lora"]
        if "a" not in saved:  # a_q, b_q, a_v, b_v: before deltas were keyed by matrix
            raise ValueError(f"{path} holds a session saved before the thirty-third session's "
                             "LoRA layout (a_q/b_q, a_v/b_v); this version cannot read it: "
                             "start a new session")
        names = tuple(sorted(saved["a"].keys()))
        if names != tuple(sorted(self.lora.a)):
            raise ValueError(f"{path} holds LoRA on {', '.join(names)}; this session adapts "
                             f"{', '.join(sorted(self.lora.a))}: restore it into a session "
                             f"with OnlineConfig(targets={names})")
        abstract = {"lora": self.lora, "opt_state": self.opt_state,
                    "vocab_state": self._vocab_state_or_initial(),
                    "stats": {"requests": 0, "updates": 0},
                    # Sessions saved before the guard existed have no flag: never deployed.
                    **({"deployed": np.asarray(False)} if "deployed" in meta else {})}
        got = ocp.StandardCheckpointer().restore(path, jax.tree.map(np.asarray, abstract))
        self.lora, self.opt_state = got["lora"], got["opt_state"]
        self.deployed = bool(got.get("deployed", False))
        self.vocab_state = got["vocab_state"]
        self.stats["requests"] = int(got["stats"]["requests"])
        self.stats["updates"] = int(got["stats"]["updates"])
