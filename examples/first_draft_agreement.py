"""First-draft agreement of one or more drafters on the Spec-Bench prompts, teacher-forced.

In greedy speculative decoding with a chain of depth 1, a step accepts its draft exactly
when the drafter's argmax equals the target's next token, and the drafter reads what
teacher forcing gives it (its cache holds the target's features of the committed text;
the root's feature is the target's at the token before it). The loop drafts only where a
step starts, though: the position after an accepted draft is the bonus's, never drafted.
This script scores *every* position of the target's own greedy continuation (one vanilla
run, then one batched forward per drafter: minutes instead of a benchmark run), so it
estimates the acceptance rate of ``specjax bench spec --tree chain --tree-depth 1`` over a
superset of its positions: on two prompts, 0.175 / 0.333 here against 0.148 / 0.326 in
the loop. It is the held-out top-1 of training, measured on the evaluation prompts.
Greedy, it also replays the loop's choice of positions on those hits (:func:`loop_rate`):
"as a depth-1 chain's loop sees it" tracks the loop's own figure on the 24 Spec-Bench
prompts (0.426 against 0.420 for the drafter alone, 0.590 against 0.585 through the copy
gate; on the tiny test model the two agree exactly, so the gap is presumably near-tied
logits that fall the other way when the loop's drafter runs step by step from its cache).

    python examples/first_draft_agreement.py --drafter A --drafter B [--max-new-tokens 128]
    python examples/first_draft_agreement.py --model gemma3-270m --drafter A
    python examples/first_draft_agreement.py --tasks summarization,rag --drafter-window 512

With ``--temperature T`` > 0 the target's answers are sampled at T (a seed per prompt)
and each position scores the expected acceptance of a sampled first draft,
``sum_x min(p_T(x), q_T(x))``: p over the whole vocabulary, q the drafter's softmax over
its ``--vocab`` head (default the first drafter's shipped one, e.g. ``fr:8192``, used for
every drafter so that all are scored on one head), zero outside it.
That is the first draft's acceptance probability in the loop's verifier at T (top-k and
top-p off), and the training log's held-out ``accept`` measured on the evaluation prompts.
The lookup chain's figure is then the expected acceptance of its (deterministic) first
token, ``p_T(c)``; "either" is left out (two siblings, one sampled, accept by recursive
rejection, not by either event).

``--children 2,3,4`` (with ``--temperature``) also estimates, per drafter, the chance that
a root with K children drawn from q without replacement has one of them accepted: the tree
``dyspec-threshold`` depth 1 with ``total_tokens`` K drafts at the root. It runs the loop's
own code on each position's (p, q) pair, :func:`specjax.tree.base.draft_children` (Gumbel
top-K) then :func:`specjax.verify.verify_sampling` (multi-draft rejection sampling), over
``--children-trials`` draws (Monte Carlo; K = 1 is ``sum_x min(p, q)`` exactly), so a
root's width can be chosen in minutes, on calibration prompts, before a loop run times it.
Every drafter is simulated with the same random draws, so the differences between drafters
are paired twice over (the same positions, the same noise).

``--calibration N`` scores about N calibration prompts instead (as in
``examples/sampled_speedup.py``): what a drafter is chosen on before Spec-Bench evaluates it.

``--copy-bias B1,...,Bn`` also scores each drafter's first draft through the root's copy
gate (``TreeSpec(copy_bias=...)``, :func:`specjax.tree.lookup.gate_root`): the lookup
token (longest suffix up to n tokens) wins where its drafter logit plus B_m (m the suffix's
length) beats the drafter's top-1. ``--fit-copy-bias N`` (greedy, with ``--calibration``
only: Spec-Bench is the evaluation) fits the N bonuses on the prompts by coordinate ascent
of that figure and prints them for a tree's ``copy_bias``. With ``--temperature`` and
``--children``, ``--copy-bias`` also estimates each root through the gate: its children
drawn from the gated q (:func:`gate_logits`), with the ungated estimate's draws, so the
difference is paired.

``--drafter-window W`` lets each drafted position attend to its last W rows only (a
diagnostic: does attention past the distances a drafter was trained on help or hurt?).

With two or more drafters, each after the first is compared with it: the difference of the
pooled figures and a 95% interval that resamples whole prompts (paired, so the spread
between easy and hard prompts cancels).

It also scores the lookup chain's first token (:mod:`specjax.tree.lookup`: the token that
followed the latest earlier occurrence of the longest suffix, up to ``--lookup-ngram``
tokens and at least ``--lookup-min``, of the prompt + answer so far), alone and together
with each drafter: "either"
is the first-draft acceptance of a tree whose root has the drafter's top-1 and the lookup
token as children. Each drafter's acceptance is also split by where the lookup is right
(the target copies its context) and where it is not (new text).
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.bench.common import dash, pooled_difference, write_json
from specjax.bench.questions import TASKS, calibration_prompts, spec_bench_prompts
from specjax.defaults import resolve_model, shipped_drafter_for
from specjax.loop import bucket
from specjax.model import forward_hidden, init_cache
from specjax.sampling import SamplingConfig, target_probs
from specjax.train.prompts import with_long_share
from specjax.tree.base import DraftMode, dense_dist, draft_children
from specjax.tree.lookup import lookup_continuation
from specjax.verify import verify_sampling
from specjax.vocab import resolve_head
from specjax.vocab.fr_head import FrequencyHead
from specjax.vocab.head import FullHead


def agreement(target, drafter, seqs: list[tuple[list[int], list[int]]],
              window: int = 0, temperature: float = 0.0,
              head_ids: np.ndarray | None = None,
              feats: list[tuple] | None = None) -> list[np.ndarray]:
    """Per (prompt, answer) pair, [n - 1] scores at each drafted position (an answer of n
    tokens has n - 1; its first is the prefill's). Greedy (``temperature`` 0): bool, the
    drafter's top-1 over the whole vocabulary is the next token. ``temperature`` > 0:
    float, ``sum_x min(p, q)`` with p the target's softmax(logits / T) over the whole
    vocabulary and q the drafter's over ``head_ids`` ([N] ids; None: all).
    ``window`` > 0: each row attends to the last ``window`` rows only (itself included).
    ``feats``: each pair's :func:`features`, when the caller has them already."""
    out = []
    for i, (prompt, answer) in enumerate(seqs):
        ids = prompt + answer
        hidden, h = feats[i] if feats is not None else features(target, drafter, ids, window)
        lo, hi = len(prompt), len(ids) - 1
        if temperature > 0:
            out.append(np.asarray(sampled_acceptance(
                hidden[0, lo:hi], h[0, lo:hi], target.params.head, temperature, head_ids)))
            continue
        pred = np.asarray(jnp.argmax(h @ target.params.head.T, -1))[0]
        out.append(pred[lo:hi] == np.asarray(ids[lo + 1:hi + 1]))
    return out


def features(target, drafter, ids: list[int], window: int = 0):
    """The target's and the drafter's final features over ``ids``, teacher-forced:
    ([1, n, d], [1, n, d]), n the loop's bucket. Row t predicts token t + 1; the scored
    rows are the answer's after its first token (the prefill's, never drafted)."""
    dm = drafter.cfg
    toks, pos, hidden, taps = target_forward(target, ids, dm.tap_layers(target.cfg))
    n = toks.shape[1]
    feats = dm.target_features(drafter.params, hidden, taps)
    shifted = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :-1]], axis=1)
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    mask = (j <= i) & ((i - j < window) if window > 0 else True)
    h, _ = dm.forward(drafter.params, target.params.embed, toks, shifted, pos,
                      dm.init_cache(1, n, target.params.embed.dtype), block_mask=mask[None])
    return hidden, h


@partial(jax.jit, static_argnames=("k", "greedy"))
def _root_hits(key, p, logits, cand_ids, temperature, chain_first=None, *, k: int,
               greedy: int = 0):
    """[b] float 1.0 where one of ``k`` children drawn from q at the root is accepted, for
    one draw: p [b, V], logits [b, C] over ``cand_ids`` [C], temperature a scalar array.
    With ``greedy`` = g, the last g children are q's top g (point-mass rule) and the rest
    are sampled from q without them, as ``TreeSpec(greedy_children=g)`` drafts them.
    ``chain_first`` [b] (-1: none) is a lookup chain's first token: as ``graft_chain``
    grafts it, a root child of its own after the others (point-mass rule) unless a
    drafted child has its token already (the chain then hangs below that child, which
    leaves the root's acceptance as it was)."""
    b, v = p.shape
    ids = jnp.broadcast_to(cand_ids, (b, 1, cand_ids.shape[0]))
    k_draft, k_verify = jax.random.split(key)
    ch = draft_children(ids, logits[:, None, :], k,
                        DraftMode(sampled=True, temperature=temperature, key=k_draft), k_draft,
                        greedy=greedy)
    tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), ch.ids[:, 0]], axis=1)
    valid = jnp.concatenate([jnp.ones((b, 1), bool), jnp.isfinite(ch.logq[:, 0])], axis=1)
    parent = jnp.broadcast_to(jnp.asarray([-1] + [0] * k, jnp.int32), (b, k + 1))
    # Only the root's rows matter: a child's own p and q are read after it is accepted.
    probs_t = jnp.broadcast_to(p[:, None, :], (b, k + 1, v))
    dist = jnp.concatenate([dense_dist(ids, ch.cand_q, v),  # the root's q, [b, 1, V]
                            jnp.zeros((b, k, v), jnp.float32)], axis=1)
    fixed = jnp.broadcast_to(jnp.arange(k + 1) > k - greedy, (b, k + 1))
    if chain_first is not None:
        own = (chain_first >= 0) & ~jnp.any(valid[:, 1:] & (tokens[:, 1:] ==
                                                              chain_first[:, None]), axis=1)
        tokens = jnp.concatenate([tokens, jnp.maximum(chain_first, 0)[:, None]], axis=1)
        valid = jnp.concatenate([valid, own[:, None]], axis=1)
        parent = jnp.concatenate([parent, jnp.zeros((b, 1), jnp.int32)], axis=1)
        fixed = jnp.concatenate([fixed, jnp.ones((b, 1), bool)], axis=1)
        probs_t = jnp.concatenate([probs_t, p[:, None, :]], axis=1)
        dist = jnp.concatenate([dist, jnp.zeros((b, 1, v), jnp.float32)], axis=1)
    acc = verify_sampling(k_verify, tokens, parent, valid, probs_t, dist, sampled=True,
                          fixed=fixed)
    return (acc.num_accepted >= 1).astype(jnp.float32)


def children_acceptance(p, cand_logits, cand_ids, k: int, temperature: float, key,
                        trials: int, chunk: int = 64, greedy: int = 0,
                        chain_first: np.ndarray | None = None) -> np.ndarray:
    """[n] the probability that a root with ``k`` children drawn without replacement from
    q has one accepted, estimated over ``trials`` draws with the loop's own drafting and
    verification (:func:`draft_children`, :func:`verify_sampling`); with ``greedy`` = g,
    q's top g are the last g children, and ``chain_first`` [n] (-1: none) adds a lookup
    chain's first token as the loop grafts it (:func:`_root_hits`).

    p: [n, V] the target's distribution at each position (``probs``); cand_logits: [n, C]
    the drafter's logits over its head's ids ``cand_ids`` [C] (q = softmax(cand_logits /
    temperature), zero off the head). Rows are simulated ``chunk`` at a time ([chunk, k +
    1, V] arrays), the last chunk padded so that every call has one shape.
    """
    n = p.shape[0]
    p, cand_logits = jnp.asarray(p, jnp.float32), jnp.asarray(cand_logits, jnp.float32)
    ids, t = jnp.asarray(cand_ids, jnp.int32), jnp.float32(temperature)
    chain = None if chain_first is None else jnp.asarray(chain_first, jnp.int32)
    out = np.zeros(n)
    for lo in range(0, n, chunk):
        rows = jnp.asarray(np.arange(lo, lo + chunk).clip(max=n - 1))
        pc, lc = p[rows], cand_logits[rows]
        cf = None if chain is None else chain[rows]
        tot = sum(_root_hits(jax.random.fold_in(key, lo * trials + i), pc, lc, ids, t, cf,
                             k=k, greedy=greedy) for i in range(trials))
        m = min(chunk, n - lo)
        out[lo:lo + m] = np.asarray(tot)[:m] / trials
    return out


def gate_logits(logits: np.ndarray, cand_ids: np.ndarray, head_size: int, copy: np.ndarray,
                match: np.ndarray, bias: tuple[float, ...]) -> np.ndarray:
    """[n, C] the root's logits after the copy gate, as :func:`specjax.tree.lookup.gate_root`
    gates them, so that q = softmax(result / T) is the loop's gated q.

    logits: [n, C] the drafter's over ``cand_ids`` [C], whose first ``head_size`` are the
    head's ids and the rest extra ids (the copies the head lacks; their columns are -inf
    unless a row takes its own copy there); copy, match: [n] each row's lookup token and
    suffix length (:func:`lookups` with n = len(bias)). Where the bonus B_match > 0 and the
    head lacks the copy, it takes the place of the row's lowest head logit (which becomes
    -inf) with the drafter's own logit for it; then B_match is added to the copy's logit."""
    out = np.asarray(logits, np.float32).copy()
    out[:, head_size:] = -np.inf
    bonus = np.asarray((0.0, *bias), np.float32)[np.minimum(match, len(bias))]
    col: dict[int, int] = {}
    for j, t in enumerate(cand_ids):
        col.setdefault(int(t), j)  # a padding id 0 never shadows a real column
    rows = np.flatnonzero(bonus > 0)
    for r in rows:
        j = col[int(copy[r])]
        if j >= head_size:  # the head lacks it: it displaces the lowest candidate
            out[r, int(np.argmin(out[r, :head_size]))] = -np.inf
            out[r, j] = logits[r, j]
        out[r, j] += bonus[r]
    return out


def children_by_answer(target, seqs: list[tuple[list[int], list[int]]], feats: list[tuple],
                       ks: tuple[int, ...], temperature: float, head_ids: np.ndarray | None,
                       trials: int, seed: int = 0, greedy: int = 0,
                       chain_first: list[np.ndarray] | None = None,
                       copy_bias: tuple[float, ...] = ()) -> dict[int, list[np.ndarray]]:
    """{K: per (prompt, answer) pair, [n - 1] float}: :func:`children_acceptance` at each
    drafted position for a root with K children (the last ``greedy`` of them q's top), q
    over ``head_ids`` (None: all); ``feats`` holds each pair's :func:`features` (the same
    ones :func:`agreement` scores); ``chain_first``, per pair, the [n - 1] lookup chain's
    first tokens (-1 where it does not fire), or None for no chain. ``copy_bias``: q is
    the root's gated softmax (:func:`gate_logits`), as ``TreeSpec(copy_bias=...)`` drafts
    it; the draws are those of the ungated call with the same ``seed``, so the two pair."""
    ids_c = np.arange(target.cfg.vocab_size) if head_ids is None else np.asarray(head_ids)
    out: dict[int, list[np.ndarray]] = {k: [] for k in ks}
    for a, ((prompt, answer), (hidden, h)) in enumerate(zip(seqs, feats, strict=True)):
        lo, hi = len(prompt), len(prompt) + len(answer) - 1
        if hi <= lo:
            for k in ks:
                out[k].append(np.zeros(0))
            continue
        p = probs(hidden[0, lo:hi] @ target.params.head.T, temperature)
        cand = ids_c
        if copy_bias:
            copy, match = lookups(prompt + answer, lo, len(copy_bias))
            extra = np.setdiff1d(copy[match >= 1], ids_c)
            # Padded to a multiple of 128 (id 0 at -inf: no mass) so answers share compiles.
            pad = np.zeros(-len(extra) % 128, ids_c.dtype)
            cand = np.concatenate([ids_c, extra.astype(ids_c.dtype), pad])
        logits = h[0, lo:hi] @ target.params.head[jnp.asarray(cand)].T
        if copy_bias:
            logits = gate_logits(np.asarray(logits), cand, len(ids_c), copy, match, copy_bias)
        for k in ks:
            key = jax.random.fold_in(jax.random.key(seed), a * 1000 + k)
            out[k].append(children_acceptance(
                p, logits, cand, k, temperature, key, trials, greedy=greedy,
                chain_first=None if chain_first is None else chain_first[a]))
    return out


def target_forward(target, ids: list[int], tap_layers: tuple[int, ...] = ()):
    """One teacher-forced target forward over ``ids``, padded to the loop's bucket n:
    ([1, n] tokens, [1, n] positions, [1, n, d] final features, the tapped layers' outputs).
    Rows past ``len(ids)`` are padding."""
    n = bucket(len(ids))
    toks = jnp.asarray([ids + [0] * (n - len(ids))], jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    hidden, _, taps = forward_hidden(target.params, target.cfg, toks, pos,
                                     init_cache(target.cfg, 1, n), tap_layers=tap_layers)
    return toks, pos, hidden, taps


def probs(logits, temperature: float):
    """[..., N] the distribution the loop samples at ``temperature`` (top-k, top-p off):
    the verifier's own :func:`specjax.sampling.target_probs`."""
    cfg = SamplingConfig(temperature=temperature)
    return target_probs(logits, cfg.static(), **cfg.dynamic())


def sampled_acceptance(f, h, head, temperature: float, head_ids=None):
    """[n] ``sum_x min(p, q)``: the probability that a draft sampled from q is accepted
    by the verifier's rejection test against p. f, h: [n, d] the target's and the drafter's
    final features; head: [V, d]; p = softmax(f @ head.T / T) over V, q = softmax of the
    drafter's logits over ``head_ids`` ([N]; None: all V), zero elsewhere."""
    p = probs(f @ head.T, temperature)
    w = head if head_ids is None else head[jnp.asarray(head_ids)]
    q = probs(h @ w.T, temperature)
    if head_ids is not None:
        p = p[:, jnp.asarray(head_ids)]  # min(p, 0) = 0 off the head
    return jnp.sum(jnp.minimum(p, q), axis=-1)


def gate_inputs(target, drafter, seqs: list[tuple[list[int], list[int]]], ngram: int,
                feats: list[tuple] | None = None, window: int = 0) -> dict[str, np.ndarray]:
    """What the root's copy gate reads at each drafted position, pooled over the pairs
    ([n] each): the pair's index, the next token, the drafter's top-1 over the whole
    vocabulary and its logit, the lookup token (longest suffix up to ``ngram``), the
    suffix's length (0: none) and the drafter's logit for the lookup token. ``feats`` and
    ``window`` as in :func:`agreement`."""
    cols: dict[str, list] = {k: [] for k in ("pair", "next", "top", "l_top", "copy", "match",
                                             "l_copy")}
    for i, (prompt, answer) in enumerate(seqs):
        ids = prompt + answer
        lo, hi = len(prompt), len(ids) - 1
        if hi <= lo:
            continue
        _, h = feats[i] if feats is not None else features(target, drafter, ids, window)
        logits = np.asarray(h[0, lo:hi] @ target.params.head.T)
        first, match = lookups(ids, lo, ngram)
        copy, rows = np.maximum(first, 0), np.arange(hi - lo)
        for k, v in (("pair", np.full(hi - lo, i)), ("next", ids[lo + 1:hi + 1]),
                     ("top", logits.argmax(-1)), ("l_top", logits.max(-1)), ("copy", copy),
                     ("match", match), ("l_copy", logits[rows, copy])):
            cols[k].append(np.asarray(v))
    return {k: np.concatenate(v) for k, v in cols.items()}


def gated_hits(g: dict[str, np.ndarray], bias: tuple[float, ...]) -> np.ndarray:
    """[n] bool: the gated first draft (:func:`gate_inputs`' columns, ``bias`` the tree's
    ``copy_bias``) is the next token. An exact tie (rare with float logits) keeps the
    drafter's top-1."""
    bonus = np.asarray((0.0, *bias))[np.minimum(g["match"], len(bias))]
    pick = np.where((g["match"] >= 1) & (g["l_copy"] + bonus > g["l_top"]), g["copy"], g["top"])
    return pick == g["next"]


def fit_copy_bias(g: dict[str, np.ndarray], n: int, sweeps: int = 3,
                  step: float = 0.5, most: float = 16.0) -> tuple[float, ...]:
    """The ``n`` bonuses that maximise :func:`gated_hits`' mean, non-decreasing in the
    suffix's length (a longer match is never less of a copy), each in 0, ``step``, ...,
    ``most``: coordinate ascent from the longest match down, each bonus between its
    neighbours, taking the first best value (the smallest)."""
    bias = [0.0] * n
    for _ in range(sweeps):
        for j in reversed(range(n)):
            lo, hi = (bias[j - 1] if j else 0.0), (bias[j + 1] if j + 1 < n else most)
            bias[j] = float(max(np.arange(lo, hi + step / 2, step), key=lambda b: gated_hits(
                g, tuple(bias[:j] + [b] + bias[j + 1:])).mean()))
    return tuple(bias)


def lookup_expected(target, seqs: list[tuple[list[int], list[int]]], look_tok: list[np.ndarray],
                    look_ok: list[np.ndarray], temperature: float) -> list[np.ndarray]:
    """Per pair, [n - 1] float: ``p_T(c)`` of the lookup chain's first token c where the
    lookup matched enough (``look_ok``), else 0; the expected acceptance of that draft."""
    out = []
    for (prompt, answer), tok, ok in zip(seqs, look_tok, look_ok, strict=True):
        ids = prompt + answer
        hidden = target_forward(target, ids)[2]
        lo, hi = len(prompt), len(ids) - 1
        p = probs(hidden[0, lo:hi] @ target.params.head.T, temperature)
        pc = np.asarray(jnp.take_along_axis(p, jnp.asarray(tok)[:, None], axis=1))[:, 0]
        out.append(np.where(ok, pc, 0.0))
    return out


def head_ids_for(spec: str | None, target, drafter) -> np.ndarray | None:
    """The ids a sampled draft can take under ``spec`` (None: the drafter's default head):
    None for the whole vocabulary, else the fixed shortlist's [N] ids."""
    head = resolve_head(spec or drafter.default_vocab or "full", target, drafter)
    if isinstance(head, FullHead):
        return None
    if isinstance(head, FrequencyHead) and not head.position_aware:
        return np.asarray(head.ids)
    raise SystemExit(f"--vocab {spec}: --temperature scores a fixed head (full or fr:N)")


def lookups(ids: list[int], lo: int, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """The lookup chain's first token and its suffix's length (0: none; up to ``ngram``) at
    each drafted position t in [lo, len(ids) - 1), from the history ids[:t + 1]: two [n]
    arrays, n = len(ids) - 1 - lo."""
    ends = np.arange(lo, len(ids) - 1)  # history ids[:t + 1] predicts ids[t + 1]
    hist = np.where(np.arange(len(ids))[None] <= ends[:, None], np.asarray(ids)[None], -1)
    toks, match = lookup_continuation(jnp.asarray(hist, jnp.int32),
                                      jnp.asarray(ends + 1, jnp.int32), 1, ngram)
    return np.asarray(toks[:, 0]), np.asarray(match)


def lookup_hits(seqs: list[tuple[list[int], list[int]]], ngram: int,
                least: int, parts: bool = False):
    """Per pair, [n - 1] bool: the lookup matched >= ``least`` tokens and its chain's first
    token is the answer's next token. ``parts``: also per pair the [n - 1] first tokens and
    the [n - 1] bool "matched >= least"."""
    out, firsts, oks = [], [], []
    for prompt, answer in seqs:
        ids = prompt + answer
        first, match = lookups(ids, len(prompt), ngram)
        ok = match >= least
        out.append(ok & (first == np.asarray(ids[len(prompt) + 1:])))
        firsts.append(first)
        oks.append(ok)
    return (out, firsts, oks) if parts else out


def pooled(hits: list[np.ndarray]) -> float | None:
    """Hits (bool) or expected hits (float) over drafted positions, pooled (an answer that
    stopped at once adds nothing); None when no position was drafted."""
    n = sum(len(h) for h in hits)
    return sum(float(h.sum()) for h in hits) / n if n else None


def by_pair(hits: np.ndarray, pair: np.ndarray, n: int) -> list[np.ndarray]:
    """Pooled [m] hits (e.g. :func:`gated_hits`) split back into the ``n`` pairs' own
    arrays, in order; ``pair`` [m] is each position's pair (:func:`gate_inputs`)."""
    return [hits[pair == i] for i in range(n)]


def loop_rate(hits: list[np.ndarray]) -> float | None:
    """The first-draft acceptance a chain of depth 1 would show in the loop, from each
    answer's teacher-forced greedy hits ([n] bool, every position): the loop drafts where a
    step starts, and a step whose draft is accepted also commits the next position (the
    bonus's), which is never drafted. Accepted drafts over steps, pooled; None when no
    position was drafted. Copies come in runs, so this is below :func:`pooled`."""
    accepted = steps = 0
    for h in hits:
        t = 0
        while t < len(h):
            steps += 1
            accepted += bool(h[t])
            t += 2 if h[t] else 1
    return accepted / steps if steps else None


def pooled_per_task(hits: list[np.ndarray], task_of: list[str],
                    tasks: tuple[str, ...]) -> dict[str, float | None]:
    """:func:`pooled` over each task's answers; ``task_of[i]`` is answer i's task."""
    return {t: pooled([h for h, k in zip(hits, task_of, strict=True) if k == t]) for t in tasks}


def split_by_lookup(hits: list[np.ndarray], look: list[np.ndarray], task_of: list[str],
                    tasks: tuple[str, ...]) -> dict[str, dict]:
    """A drafter's hits where the lookup chain is right (the target copies its context) and
    where it is not (new text): each part pooled, per task, and its share of positions.
    ``hits`` and ``look`` are per answer, [n - 1] bool each (:func:`agreement`,
    :func:`lookup_hits`)."""
    out = {}
    for name, want in (("where_lookup_hits", True), ("where_lookup_misses", False)):
        parts = [h[c == want] for h, c in zip(hits, look, strict=True)]
        out[name] = {"pooled": pooled(parts), "per_task": pooled_per_task(parts, task_of, tasks),
                     "share": pooled([c == want for c in look])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="target: a named model or converted folder (default: SmolLM2)")
    ap.add_argument("--drafter", action="append", default=None,
                    help="drafter folder (repeat; default: the one shipped for the target)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--per-task", type=int, default=4)
    ap.add_argument("--tasks", default=",".join(TASKS),
                    help=f"comma-separated Spec-Bench tasks (default: all of {','.join(TASKS)})")
    ap.add_argument("--drafter-window", type=int, default=0, metavar="W",
                    help="drafter attention to the last W rows only (default 0: all rows)")
    ap.add_argument("--lookup-ngram", type=int, default=3,
                    help="the longest suffix the lookup matches (default 3, TreeSpec's)")
    ap.add_argument("--lookup-min", type=int, default=1,
                    help="the shortest match that counts (default 1, TreeSpec's)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sample the answers at T and score sum min(p, q) (default 0: "
                         "greedy top-1 agreement)")
    ap.add_argument("--seed", type=int, default=0,
                    help="with --temperature: prompt i's answer is sampled with seed + i")
    ap.add_argument("--vocab", default=None, metavar="full|fr:N",
                    help="with --temperature: the head q is drafted over, the same for every "
                         "drafter (default: the first drafter's shipped one)")
    ap.add_argument("--children", default="", metavar="K,K,...",
                    help="with --temperature: also estimate the acceptance of a root with K "
                         "children sampled without replacement, for each K (Monte Carlo "
                         "through the loop's drafting and verifier)")
    ap.add_argument("--greedy-children", type=int, default=0, metavar="G",
                    help="with --children: the last G children are q's top G, the rest "
                         "sampled from q without them (--tree-greedy-children; default 0)")
    ap.add_argument("--children-lookup", action="store_true",
                    help="with --children: add the lookup chain's first token (--lookup-ngram, "
                         "--lookup-min) as a root child, where the loop's graft_chain puts it")
    ap.add_argument("--children-trials", type=int, default=16,
                    help="draws per position for --children (default 16)")
    ap.add_argument("--calibration", type=int, default=0, metavar="N",
                    help="about N calibration prompts (ShareGPT's calibration range, never "
                         "Spec-Bench) instead of Spec-Bench's, to choose on (default 0)")
    ap.add_argument("--long-share", type=float, default=0.0, metavar="F",
                    help="with --calibration: share of prompts that give a long text "
                         "(450-1,000 tokens) to summarize or answer from, Spec-Bench's mix "
                         "of lengths at 0.333 with --max-prompt-tokens 1024 (default 0)")
    ap.add_argument("--max-prompt-tokens", type=int, default=320,
                    help="with --calibration: the longest prompt taken (default 320)")
    ap.add_argument("--copy-bias", default="", metavar="B1,...,Bn",
                    help="greedy: also score the first draft through the root's copy gate "
                         "with these bonuses (a tree's copy_bias); with --temperature and "
                         "--children: also the root's children drawn from the gated q")
    ap.add_argument("--fit-copy-bias", type=int, default=0, metavar="N",
                    help="greedy, with --calibration: fit N copy-gate bonuses on the prompts "
                         "(coordinate ascent) and score with them")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    if not 0 <= args.long_share <= 1:  # refused before the model loads
        raise SystemExit(f"--long-share must be in [0, 1], got {args.long_share}")
    target = specjax.load(resolve_model(args.model, progress=False))
    tasks = tuple(t for t in args.tasks.split(",") if t)
    if unknown := set(tasks) - set(TASKS):
        raise SystemExit(f"--tasks: unknown {sorted(unknown)}; known: {', '.join(TASKS)}")
    if args.calibration:  # never Spec-Bench: what a drafter or head is chosen on
        ids, source = calibration_prompts(target, num=args.calibration,
                                          weights=with_long_share(args.long_share)
                                          if args.long_share else None,
                                          max_prompt_tokens=args.max_prompt_tokens)
        evals, qpath, tasks = [{"task": "calibration", "ids": p} for p in ids], source, \
            ("calibration",)
    else:
        evals, qpath = spec_bench_prompts(target, questions=None, tasks=tasks,
                                          per_task=args.per_task)
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    sampled = args.temperature > 0
    ks = tuple(int(k) for k in args.children.split(",") if k)
    if ks and not sampled:
        raise SystemExit("--children scores sampled children: give --temperature > 0")
    if not ks and (args.greedy_children or args.children_lookup):
        raise SystemExit("--greedy-children and --children-lookup shape the roots that "
                         "--children scores: give --children K,...")
    if ks and not 0 <= args.greedy_children < min(ks):
        raise SystemExit(f"--greedy-children must be in [0, K) for every K of --children, "
                         f"got {args.greedy_children} with K = {args.children}")
    bias = tuple(float(b) for b in args.copy_bias.split(",") if b)
    if args.fit_copy_bias and sampled:
        raise SystemExit("--fit-copy-bias fits the greedy first draft: drop --temperature")
    if bias and sampled and not ks:
        raise SystemExit("--copy-bias with --temperature gates the --children estimate: give "
                         "--children K,...")
    if args.fit_copy_bias and (bias or not args.calibration):
        raise SystemExit("--fit-copy-bias fits on calibration prompts only (give "
                         "--calibration N, and no --copy-bias): Spec-Bench is the evaluation")
    if any(b < 0 for b in bias) or args.fit_copy_bias < 0:
        raise SystemExit(f"--copy-bias takes bonuses >= 0 and --fit-copy-bias N >= 0, got "
                         f"{args.copy_bias!r} and {args.fit_copy_bias}")
    if any(k < 1 for k in ks) or args.children_trials < 1:
        raise SystemExit(f"--children needs K >= 1 and --children-trials >= 1, got "
                         f"{args.children!r} and {args.children_trials}")
    # Drafters load before the answers are generated, so a bad path fails at once.
    shipped = shipped_drafter_for(target.cfg)
    if not args.drafter and shipped is None:
        raise SystemExit(f"no drafter ships for {args.model}; pass --drafter")
    drafters = [(path, specjax.load_drafter(Path(path), target))
                for path in args.drafter or [str(shipped)]]
    # One head for every drafter: a fine-tune's folder often lacks freq_counts, and its own
    # default (the full head) would be compared against the first drafter's shortlist. It
    # is resolved here too, so a --vocab the script cannot score fails before the answers.
    ids = head_ids_for(args.vocab, target, drafters[0][1]) if sampled else None
    answers = [specjax.generate(target, [e["ids"]], max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, seed=args.seed + i).tokens[0]
               for i, e in enumerate(evals)]
    seqs = [(e["ids"], a) for e, a in zip(evals, answers, strict=True)]
    result = {"questions": qpath if args.calibration else str(qpath), "prompts": len(evals),
              "tasks": list(tasks),
              "drafter_window": args.drafter_window, "temperature": args.temperature,
              "seed": args.seed if sampled else None,
              "max_new_tokens": args.max_new_tokens,
              "children_trials": args.children_trials if ks else None,
              "greedy_children": args.greedy_children if ks else None,
              "children_lookup": args.children_lookup if ks else None, "drafters": {}}
    fmt = partial(dash, fmt=".3f")
    task_of = [e["task"] for e in evals]
    by_task = lambda hits: pooled_per_task(hits, task_of, tasks)  # noqa: E731
    look, look_tok, look_ok = lookup_hits(seqs, args.lookup_ngram, args.lookup_min, parts=True)
    # Sampled, the lookup's draft is accepted with probability p_T(c), not when it is the
    # token that happened to be drawn; `look` still says where the target copied.
    look_acc = lookup_expected(target, seqs, look_tok, look_ok, args.temperature) \
        if sampled else look
    result["lookup"] = {"ngram": args.lookup_ngram, "min": args.lookup_min,
                        "pooled": pooled(look_acc),
                        "per_task": by_task(look_acc)}
    print(f"lookup chain: first-token acceptance {fmt(pooled(look_acc))} "
          + " ".join(f"{t} {fmt(v)}" for t, v in by_task(look_acc).items()), flush=True)
    first: list[np.ndarray] | None = None  # the first drafter's hits: the others' baseline
    first_kids: dict[int, list[np.ndarray]] | None = None  # its --children figures
    for path, drafter in drafters:
        # With --children or the copy gate every score reads one forward of each answer.
        feats = ([features(target, drafter, p + a, args.drafter_window) for p, a in seqs]
                 if ks or bias or args.fit_copy_bias else None)
        per = agreement(target, drafter, seqs, args.drafter_window, args.temperature, ids,
                        feats)
        either = None if sampled else [a | b for a, b in zip(per, look, strict=True)]
        overall, empty = pooled(per), sum(len(h) == 0 for h in per)
        loop = None if sampled else loop_rate(per)
        result["drafters"][path] = {"pooled": overall, "per_task": by_task(per),
                                    "loop": loop,
                                    "positions": sum(len(h) for h in per),
                                    "empty_answers": empty,
                                    "head_size": None if ids is None else len(ids),
                                    "either_with_lookup": None if either is None
                                    else pooled(either),
                                    "either_per_task": None if either is None
                                    else by_task(either),
                                    **split_by_lookup(per, look, task_of, tasks)}
        print(f"{path}: first-draft acceptance {fmt(overall)} "
              + " ".join(f"{t} {fmt(v)}" for t, v in by_task(per).items())
              + f" ({empty} answers with nothing drafted)"
              + ("" if loop is None else f"; as a depth-1 chain's loop sees it {fmt(loop)}")
              + ("" if either is None else f"; either it or the lookup {fmt(pooled(either))} "
                 + " ".join(f"{t} {fmt(v)}" for t, v in by_task(either).items())), flush=True)
        hit, miss = (result["drafters"][path][k] for k in ("where_lookup_hits",
                                                           "where_lookup_misses"))
        print(f"  where the lookup is right ({fmt(hit['share'])} of positions) "
              f"{fmt(hit['pooled'])}, where it is not {fmt(miss['pooled'])}: "
              + " ".join(f"{t} {fmt(hit['per_task'][t])}/{fmt(miss['per_task'][t])}"
                         for t in tasks), flush=True)
        if ks:
            chain = ([np.where(ok, tok, -1) for tok, ok in zip(look_tok, look_ok, strict=True)]
                     if args.children_lookup else None)
            kids = children_by_answer(target, seqs, feats, ks, args.temperature, ids,
                                      args.children_trials, args.seed,
                                      args.greedy_children, chain)
            result["drafters"][path]["children"] = {
                str(k): {"pooled": pooled(v), "per_task": by_task(v)} for k, v in kids.items()}
            shape = (f"children (q's top {args.greedy_children} last)"
                     if args.greedy_children else "sampled children")
            shape += " and the lookup chain's first token" if args.children_lookup else ""
            print(f"  a root with K {shape} accepts one: " + ", ".join(
                f"K={k} {fmt(pooled(v))}" for k, v in kids.items())
                + f" ({args.children_trials} draws a position)", flush=True)
            if bias:  # the same draws through the gated q: a paired difference
                gated = children_by_answer(target, seqs, feats, ks, args.temperature, ids,
                                           args.children_trials, args.seed,
                                           args.greedy_children, chain, bias)
                rec = {str(k): {"pooled": pooled(v), "per_task": by_task(v),
                                "vs_ungated": pooled_difference(v, kids[k])}
                       for k, v in gated.items()}
                result["drafters"][path]["children_gated"] = {"copy_bias": list(bias), **rec}
                for k, r in rec.items():
                    g = r["vs_ungated"]
                    print(f"  K={k} through the copy gate {list(bias)}: {fmt(r['pooled'])}, "
                          f"minus ungated {g['diff']:+.3f}, 95% interval "
                          f"[{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}]", flush=True)
            if first_kids is None:
                first_kids = kids
            else:  # the same draws' noise for every drafter: a paired difference
                for k, v in kids.items():
                    g = pooled_difference(v, first_kids[k])
                    result["drafters"][path]["children"][str(k)]["vs_first"] = g
                    print(f"  K={k} minus the first drafter: {g['diff']:+.3f}, 95% interval "
                          f"[{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}]", flush=True)
        if (bias or args.fit_copy_bias) and not sampled:
            g = gate_inputs(target, drafter, seqs, len(bias) or args.fit_copy_bias, feats,
                            args.drafter_window)
            fitted = fit_copy_bias(g, args.fit_copy_bias) if args.fit_copy_bias else bias
            hits = gated_hits(g, fitted)
            gated = by_pair(hits, g["pair"], len(seqs))
            gate_tasks, gate_loop = by_task(gated), loop_rate(gated)
            result["drafters"][path]["copy_gate"] = {"copy_bias": list(fitted),
                                                     "fitted": bool(args.fit_copy_bias),
                                                     "pooled": float(hits.mean()),
                                                     "loop": gate_loop,
                                                     "per_task": gate_tasks}
            print(f"  through the copy gate {list(fitted)}"
                  f"{' (fitted here)' if args.fit_copy_bias else ''}: first-draft "
                  f"acceptance {hits.mean():.3f} "
                  + " ".join(f"{t} {fmt(v)}" for t, v in gate_tasks.items())
                  + f"; as a depth-1 chain's loop sees it {fmt(gate_loop)}", flush=True)
        if first is None:
            first = per
        else:  # 24 prompts resolve a few points at best: say how many
            g = pooled_difference(per, first)
            result["drafters"][path]["vs_first"] = g
            print(f"  minus the first drafter: {g['diff']:+.3f}, 95% interval "
                  f"[{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}] (prompts resampled)", flush=True)
    if args.out:
        write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
