"""Tree forward and KV compaction on a tiny random Llama: the compacted cache equals a fresh
prefill of the committed sequence, so decoding can continue as if there had been no tree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.kv import compact_cache
from specjax.model import forward, init_cache

CAP = 48  # cache rows, for both the speculative cache and the references
REF_LEN = 40  # references run one padded shape, so they compile once
T = 7

compact = jax.jit(compact_cache, static_argnames="tree_size")


@pytest.fixture(scope="module")
def target(tiny_llama, tmp_path_factory):
    return specjax.load(specjax.convert(tiny_llama, tmp_path_factory.mktemp("kv") / "sj",
                                        progress=False))


def _tree_arrays(parents: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """depth [B, T] and ancestors [B, T, T] (self included) from parent lists."""
    b, t = len(parents), len(parents[0])
    depth = np.zeros((b, t), np.int32)
    anc = np.zeros((b, t, t), bool)
    for r, par in enumerate(parents):
        for i in range(t):
            anc[r, i, i] = True
            if i:
                depth[r, i] = depth[r, par[i]] + 1
                anc[r, i] |= anc[r, par[i]]
    return depth, anc


def _node_path(par: list[int], i: int) -> list[int]:
    """Root-to-node indices."""
    out = [i]
    while par[out[-1]] >= 0:
        out.append(par[out[-1]])
    return out[::-1]


def _reference(target, seq: list[int]):
    """A fresh causal forward over ``seq`` alone: (K rows, V rows per layer, logits)."""
    toks = np.zeros((1, REF_LEN), np.int32)
    toks[0, :len(seq)] = seq  # right padding cannot affect earlier positions (causal)
    logits, cache = forward(target.params, target.cfg, jnp.asarray(toks),
                            jnp.arange(REF_LEN)[None], init_cache(target.cfg, 1, CAP))
    return ([np.asarray(k[0]) for k in cache.k], [np.asarray(v[0]) for v in cache.v],
            np.asarray(logits[0]))


def _prefill(target, prompts: list[list[int]]):
    width = max(map(len, prompts))
    toks = np.zeros((len(prompts), width), np.int32)
    for r, p in enumerate(prompts):
        toks[r, :len(p)] = p
    _, cache = forward(target.params, target.cfg, jnp.asarray(toks),
                       jnp.broadcast_to(jnp.arange(width), toks.shape),
                       init_cache(target.cfg, len(prompts), CAP))
    return dataclasses.replace(cache, lengths=jnp.asarray([len(p) for p in prompts], jnp.int32))


def _tree_forward(target, cache, tokens: np.ndarray, parents: list[list[int]]):
    depth, anc = _tree_arrays(parents)
    positions = cache.lengths[:, None] + jnp.asarray(depth)
    return forward(target.params, target.cfg, jnp.asarray(tokens, jnp.int32), positions, cache,
                   jnp.asarray(anc))


PARENTS = [[-1, 0, 0, 0, 1, 2, 5],  # 0 ─┬─ 1 ── 4
           [-1, 0, 1, 1, 0, 4, 3]]  #    ├─ 2 ── 5 ── 6
#                                        └─ 3


def test_tree_forward_equals_path_forward(target):
    """Node i's logits equal a causal forward over the prompt plus i's root-to-node path."""
    rs = np.random.RandomState(0)
    prompts = [list(rs.randint(0, 256, 5)), list(rs.randint(0, 256, 9))]
    tokens = rs.randint(0, 256, (2, T))
    logits, _ = _tree_forward(target, _prefill(target, prompts), tokens, PARENTS)
    for r in range(2):
        for i in range(T):
            seq = prompts[r] + [int(tokens[r, j]) for j in _node_path(PARENTS[r], i)]
            want = _reference(target, seq)[2][len(seq) - 1]
            np.testing.assert_allclose(np.asarray(logits[r, i]), want, atol=1e-4, rtol=0,
                                       err_msg=f"row {r} node {i}")


def _check_committed(target, cache, committed: list[list[int]], pending: list[int]):
    """Cache rows [0, len) equal a fresh prefill of the committed tokens, for every layer,
    and feeding the pending token gives the reference's next-token logits."""
    assert np.asarray(cache.lengths).tolist() == [len(c) for c in committed]
    nxt, _ = forward(target.params, target.cfg, jnp.asarray(pending, jnp.int32)[:, None],
                     cache.lengths[:, None], cache)
    for r, seq in enumerate(committed):
        ks, vs, ref_logits = _reference(target, seq + [pending[r]])
        n = len(seq)
        for layer in range(target.cfg.num_layers):
            np.testing.assert_allclose(np.asarray(cache.k[layer][r, :n]), ks[layer][:n],
                                       atol=1e-5, rtol=0, err_msg=f"K row {r} layer {layer}")
            np.testing.assert_allclose(np.asarray(cache.v[layer][r, :n]), vs[layer][:n],
                                       atol=1e-5, rtol=0, err_msg=f"V row {r} layer {layer}")
        np.testing.assert_allclose(np.asarray(nxt[r, 0]), ref_logits[n], atol=1e-4, rtol=0)


def _path_array(paths: list[list[int]]) -> tuple[jax.Array, jax.Array]:
    arr = np.full((len(paths), T), -1, np.int32)
    for r, p in enumerate(paths):
        arr[r, :len(p)] = p
    return jnp.asarray(arr), jnp.asarray([len(p) - 1 for p in paths], jnp.int32)


@pytest.mark.parametrize("paths", [[[0, 2, 5], [0, 1, 3, 6]], [[0], [0, 4, 5]]],
                         ids=["deep", "root-only"])
def test_compact_one_step(target, paths):
    """Two rows with different prompt lengths and accepted paths (incl. the root alone)."""
    rs = np.random.RandomState(1)
    prompts = [list(rs.randint(0, 256, 5)), list(rs.randint(0, 256, 9))]
    tokens = rs.randint(0, 256, (2, T))
    _, cache = _tree_forward(target, _prefill(target, prompts), tokens, PARENTS)
    path, num = _path_array(paths)
    cache = compact(cache, path, num, tree_size=T)
    committed = [prompts[r] + [int(tokens[r, j]) for j in paths[r]] for r in range(2)]
    _check_committed(target, cache, committed, pending=[7, 11])


def _random_path(rs: np.random.RandomState, par: list[int]) -> list[int]:
    """Walk down from the root, to a random child or stopping, like a verifier would."""
    path = [0]
    while True:
        kids = [i for i in range(len(par)) if par[i] == path[-1]]
        if not kids or rs.rand() < 0.25:
            return path
        path.append(int(rs.choice(kids)))


def test_compact_consecutive_steps(target):
    """Four tree steps with random trees and paths; the bonus becomes the next root."""
    rs = np.random.RandomState(2)
    committed = [list(rs.randint(0, 256, 4)), list(rs.randint(0, 256, 9))]
    cache = _prefill(target, committed)
    root = [int(x) for x in rs.randint(0, 256, 2)]
    for _ in range(4):
        parents = [[-1] + [int(rs.randint(0, i)) for i in range(1, T)] for _ in range(2)]
        tokens = rs.randint(0, 256, (2, T))
        tokens[:, 0] = root
        _, cache = _tree_forward(target, cache, tokens, parents)
        paths = [_random_path(rs, par) for par in parents]
        cache = compact(cache, *_path_array(paths), tree_size=T)
        for r in range(2):
            committed[r] += [int(tokens[r, j]) for j in paths[r]]
        root = [int(x) for x in rs.randint(0, 256, 2)]  # the bonus tokens
    assert max(map(len, committed)) > 15  # the walk did accept drafts
    _check_committed(target, cache, committed, pending=root)
