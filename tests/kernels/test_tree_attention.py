"""Tree attention: the Pallas kernel against the jnp reference (compiled on a GPU, and in
interpret mode anywhere), the reference against the model's attention, the CUDA lowering on
this CPU-only jaxlib, the block counts, and the dispatcher's refusals.

As in jax's ``tests/pallas/gpu_ops_test.py``, one test class holds the kernel cases and a
subclass reruns them in interpret mode. The compiled class needs a GPU backend; the
conftest pins ``JAX_PLATFORMS=cpu`` unless it is set, so run it with
``JAX_PLATFORMS=cuda``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.compat import lower_for_cuda
from specjax.config import ModelConfig
from specjax.kernels.tree_attention import (
    count_tree_blocks,
    tree_attention,
    tree_attention_pallas,
    tree_attention_ref,
    tree_attention_xla,
)
from specjax.model import LayerParams, attention, cache_mask
from specjax.tree import ancestors_from_parent, pack_ancestors
from tests.kernels.pallas_case import PallasCase

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


# --------------------------------------------------------------------------------------
# Trees and problems
# --------------------------------------------------------------------------------------


def _children(parent: np.ndarray) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parent]
    for i, p in enumerate(parent[1:], 1):
        kids[p].append(i)
    return kids


def _dfs_order(parent: np.ndarray) -> list[int]:
    """Preorder, children in index order: every subtree is a contiguous run of nodes."""
    kids, order, stack = _children(parent), [], [0]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(kids[n]))
    return order


def _bfs_order(parent: np.ndarray) -> list[int]:
    """By depth, then parent, then index: the layout the tree builders emit."""
    kids, order = _children(parent), [0]
    for n in order:
        order.extend(kids[n])
    return order


def _relabel(parent: np.ndarray, order: list[int]) -> np.ndarray:
    """The parent array of the same tree with node ``order[n]`` renumbered ``n``."""
    new = np.empty(len(order), np.int64)
    new[order] = np.arange(len(order))
    return np.array([-1 if parent[o] < 0 else new[parent[o]] for o in order], np.int32)


def _is_dfs(parent: np.ndarray) -> bool:
    return _dfs_order(parent) == list(range(len(parent)))


def _random_parent(rng: np.random.Generator, t: int) -> np.ndarray:
    """A random valid tree: parents before children, the root at 0."""
    return np.array([-1] + [rng.integers(0, i) for i in range(1, t)], np.int32)


def make_tree(kind: str, b: int, t: int, seed: int) -> np.ndarray:
    """[b, t] parent arrays of one ``kind``: "random", "chain", "dfs" (a random tree
    relabelled in DFS order), "bfs" (relabelled breadth first, which is not DFS) or "gap"
    (the last third of the nodes hang off the first 8, so at blocks of 16 the last query
    block sees key blocks 0 and its own but not those between)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        parent = _random_parent(rng, t)
        if kind == "chain":
            parent = np.arange(-1, t - 1, dtype=np.int32)
        elif kind == "gap":
            tail = 2 * t // 3
            parent[tail:] = rng.integers(0, 8, t - tail)
        elif kind == "dfs":
            parent = _relabel(parent, _dfs_order(parent))
        elif kind == "bfs":
            parent = _relabel(parent, _bfs_order(parent))
        assert (parent[1:] < np.arange(1, t)).all()
        rows.append(parent)
    return np.stack(rows)


def make_problem(b: int, t: int, hkv: int, group: int, dh: int, s: int, dtype,
                 tree: str = "random", prefix=None, r: int | None = None, seed: int = 0):
    """Random q [b, t, hkv*group, dh], a random cache [b, s, hkv, dh] (every row filled, so
    a row that leaks into the softmax changes the result), ragged prefix lengths and the
    [b, t, r] ancestor mask of ``tree`` (r > t: the queries are the first t of r nodes)."""
    rng = np.random.default_rng(seed)
    r = t if r is None else r
    anc = ancestors_from_parent(jnp.asarray(make_tree(tree, b, r, seed)), r)[:, :t]
    if prefix is None:  # ragged, and the last row's tree ends at the last cache row
        prefix = [int(rng.integers(0, s - r + 1)) for _ in range(b - 1)] + [s - r]
    q = jnp.asarray(rng.standard_normal((b, t, hkv * group, dh)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, dh)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, dh)), dtype)
    return q, k, v, jnp.asarray(prefix, jnp.int32), anc


def max_error(out, want) -> float:
    return float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(want, np.float32))))


# --------------------------------------------------------------------------------------
# The kernel, compiled and interpreted
# --------------------------------------------------------------------------------------

# (b, t, hkv, group, dh, s, dtype, tree, prefix, blocks): ragged prefixes (0 and unaligned
# ones included), T and R not multiples of the blocks, both head_dims, GQA groups 1 and 3,
# several query and tree key blocks (so empty ones are skipped) at blocks of 16.
B16 = dict(block_q=16, block_k=16, block_t=16)
KERNEL_CASES = [
    (2, 20, 2, 1, 64, 96, jnp.float32, "random", [0, 37], {}),
    (2, 24, 1, 3, 128, 80, jnp.bfloat16, "random", None, {}),
    (2, 18, 2, 3, 64, 64, jnp.float32, "chain", [5, 46], B16),
    (1, 40, 1, 3, 64, 72, jnp.float32, "dfs", [17], B16),
    (1, 40, 1, 3, 64, 72, jnp.float32, "bfs", [17], B16),
    (2, 33, 1, 1, 128, 100, jnp.float32, "random", None, B16),
    (2, 33, 2, 1, 64, 100, jnp.bfloat16, "bfs", None, B16),
    (1, 48, 2, 3, 64, 80, jnp.float32, "gap", [9], B16),
]
KERNEL_IDS = [f"{c[7]}-T{c[1]}-Dh{c[4]}-g{c[3]}-{jnp.dtype(c[6]).name}" for c in KERNEL_CASES]


class TestTreeAttention(PallasCase):
    """The Pallas kernel against the reference, compiled (needs a GPU)."""

    KERNEL = staticmethod(tree_attention_pallas)

    @pytest.mark.parametrize("b,t,hkv,group,dh,s,dtype,tree,prefix,blocks", KERNEL_CASES,
                             ids=KERNEL_IDS)
    def test_matches_reference(self, b, t, hkv, group, dh, s, dtype, tree, prefix, blocks):
        q, k, v, plen, anc = make_problem(b, t, hkv, group, dh, s, dtype, tree, prefix,
                                          seed=t + dh)
        want = tree_attention_ref(q, k, v, plen, anc)
        out = self.pallas(q, k, v, plen, pack_ancestors(anc), **blocks)
        assert out.shape == q.shape and out.dtype == q.dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                                   rtol=TOL[dtype], atol=TOL[dtype])

    def test_bool_mask_and_more_tree_rows_than_queries(self):
        """A drafter's expansion: 12 queries over a 30-row workspace, the mask given as
        bool, and as packed words with tree_len."""
        q, k, v, plen, anc = make_problem(2, 12, 2, 3, 64, 90, jnp.float32, r=30, seed=3)
        want = tree_attention_ref(q, k, v, plen, anc)
        for mask, tree_len in ((anc, None), (pack_ancestors(anc), 30)):
            out = self.pallas(q, k, v, plen, mask, tree_len=tree_len, **B16)
            np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5,
                                       atol=1e-5)

    def test_bits_past_tree_len_are_ignored(self):
        """Packed words with stray bits past R (say, a larger tree's words reused): rows
        past the tree stay invisible."""
        q, k, v, plen, anc = make_problem(2, 20, 1, 3, 64, 60, jnp.float32, seed=4)
        want = tree_attention_ref(q, k, v, plen, anc)
        words = pack_ancestors(anc) | jnp.uint32(0xFFF00000)  # bits 20..31 set
        out = self.pallas(q, k, v, plen, words, tree_len=20, **B16)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)

    def test_tree_mask_is_applied(self):
        """A query that sees only itself returns its own V row exactly; the same queries
        under the full tree do not."""
        q, k, v, _, _ = make_problem(1, 16, 1, 1, 64, 40, jnp.float32)
        plen = jnp.asarray([0], jnp.int32)
        only_self = jnp.eye(16, dtype=bool)[None]
        out = self.pallas(q, k, v, plen, pack_ancestors(only_self))
        np.testing.assert_allclose(np.asarray(out[0, :, 0]), np.asarray(v[0, :16, 0]),
                                   rtol=1e-6, atol=1e-6)
        full = self.pallas(q, k, v, plen, pack_ancestors(jnp.ones((1, 16, 16), bool)))
        assert max_error(full, out) > 0.1


class TestTreeAttentionInterpret(TestTreeAttention):
    """The same cases in the Pallas interpreter, on any backend."""

    INTERPRET = True


# --------------------------------------------------------------------------------------
# The reference is the model's attention; the XLA path agrees
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_is_model_attention(dtype, group):
    """``specjax.model.attention`` over a cache_mask of (lengths, ancestors), with identity
    projections and RoPE switched off, equals the reference (and the XLA path) on the cache
    the model itself wrote."""
    b, t, hkv, dh, s = 2, 14, 2, 64, 48
    hq, d = hkv * group, hkv * group * dh
    rng = np.random.default_rng(group)
    cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=d, intermediate_size=8,
                      num_layers=1, num_heads=hq, num_kv_heads=hkv, head_dim=dh,
                      rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                      tie_word_embeddings=False)

    def mat(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), dtype)

    eye = jnp.eye(d, dtype=dtype)
    lp = LayerParams(attn_norm=None, wq=eye, wk=mat(d, hkv * dh), wv=mat(d, hkv * dh), wo=eye,
                     mlp_norm=None, w_gate=None, w_up=None, w_down=None)
    x = jnp.asarray(rng.standard_normal((b, t, d)), dtype)
    lengths = jnp.asarray([9, s - t], jnp.int32)
    anc = ancestors_from_parent(jnp.asarray(make_tree("random", b, t, 1)), t)
    k_buf = jnp.asarray(rng.standard_normal((b, s, hkv, dh)), dtype)
    v_buf = jnp.asarray(rng.standard_normal((b, s, hkv, dh)), dtype)
    rows = lengths[:, None] + jnp.arange(t)[None, :]
    no_rope = jnp.zeros((dh // 2,), jnp.float32)  # cos 1, sin 0: q = x, k = x @ wk
    out, k_buf, v_buf = attention(cfg, lp, x, rows, no_rope, k_buf, v_buf, rows,
                                  cache_mask(lengths, anc, s))
    q = x.reshape(b, t, hq, dh)
    want = np.asarray(out.reshape(b, t, hq, dh), np.float32)
    for impl in (tree_attention_ref, tree_attention_xla):
        got = impl(q, k_buf, v_buf, lengths, pack_ancestors(anc))
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=TOL[dtype],
                                   atol=TOL[dtype])


def test_xla_matches_reference_on_empty_rows():
    """Both give 0 to a query that sees nothing (prefix 0, an all-False mask row)."""
    q, k, v, _, anc = make_problem(2, 10, 1, 2, 64, 30, jnp.float32)
    plen = jnp.asarray([0, 4], jnp.int32)
    anc = anc.at[:, 3].set(False)
    want = tree_attention_ref(q, k, v, plen, anc)
    np.testing.assert_allclose(np.asarray(tree_attention_xla(q, k, v, plen, anc)),
                               np.asarray(want), rtol=1e-5, atol=1e-5)
    assert (np.asarray(want[0, 3]) == 0).all() and (np.asarray(want[1, 3]) != 0).all()


def test_dispatcher_impls_agree():
    q, k, v, plen, anc = make_problem(2, 12, 2, 3, 64, 50, jnp.float32)
    want = np.asarray(tree_attention(q, k, v, plen, anc, impl="ref"))
    for impl in ("auto", "xla"):  # "auto" is XLA on this CPU
        np.testing.assert_allclose(np.asarray(tree_attention(q, k, v, plen, anc, impl=impl)),
                                   want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# Block counts
# --------------------------------------------------------------------------------------


def _count_blocks_numpy(anc: np.ndarray, block: int) -> int:
    t, r = anc.shape
    return sum(bool(anc[i:i + block, j:j + block].any())
               for i in range(0, t, block) for j in range(0, r, block))


def test_count_tree_blocks():
    anc = ancestors_from_parent(jnp.asarray(make_tree("random", 3, 70, 5)), 70)
    for block in (16, 32):
        want = [_count_blocks_numpy(np.asarray(a), block) for a in anc]
        np.testing.assert_array_equal(np.asarray(count_tree_blocks(anc, block)), want)
        np.testing.assert_array_equal(
            np.asarray(count_tree_blocks(pack_ancestors(anc), block)), want)
    chain = jnp.tril(jnp.ones((64, 64), bool))
    assert int(count_tree_blocks(chain, 16)) == 10  # the 4 x 4 lower triangle of blocks
    assert int(count_tree_blocks(chain, 16, block_k=32)) == 6


def test_tree_layouts_for_the_kernel_cases():
    """The DFS case is in DFS order and the BFS case is not; DFS needs fewer tiles here."""
    dfs, bfs = make_tree("dfs", 1, 40, 17)[0], make_tree("bfs", 1, 40, 17)[0]
    assert _is_dfs(dfs) and not _is_dfs(bfs)
    tiles = [int(count_tree_blocks(ancestors_from_parent(jnp.asarray(p[None]), 40)[0], 16))
             for p in (dfs, bfs)]
    assert tiles[0] <= tiles[1]
    # The "gap" case: query block 2 sees key blocks 0 and 2, so the kernel skips block 1.
    gap = ancestors_from_parent(jnp.asarray(make_tree("gap", 1, 48, 48 + 64)), 48)
    assert int(count_tree_blocks(gap, 16)[0]) == 1 + 2 + 2


# --------------------------------------------------------------------------------------
# Lowering for CUDA on this CPU-only jaxlib
# --------------------------------------------------------------------------------------

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dh", [64, 128])
def test_pallas_lowers_for_cuda(dtype, dh):
    """An EAGLE-2-sized tree (T = 60) with GQA group 3 over a 1000-row cache."""
    b, t, hkv, s = 2, 60, 2, 1000
    f = partial(tree_attention_pallas, interpret=False)
    lowered = lower_for_cuda(f, S((b, t, hkv * 3, dh), dtype), S((b, s, hkv, dh), dtype),
                             S((b, s, hkv, dh), dtype), S((b,), jnp.int32),
                             S((b, t, 2), jnp.uint32))
    assert "triton" in lowered.as_text()


def test_dispatcher_lowers_bool_mask_for_cuda():
    f = partial(tree_attention, impl="pallas")
    lowered = lower_for_cuda(f, S((1, 20, 4, 64), jnp.bfloat16), S((1, 128, 4, 64), jnp.bfloat16),
                             S((1, 128, 4, 64), jnp.bfloat16), S((1,), jnp.int64),
                             S((1, 20, 20), jnp.bool_))
    assert "triton" in lowered.as_text()


# --------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------


def _args(b=1, t=8, hq=4, hkv=2, dh=64, s=32, w=None, mask_dtype=jnp.uint32, kv_dh=None):
    q = jnp.zeros((b, t, hq, dh), jnp.float32)
    k = jnp.zeros((b, s, hkv, dh if kv_dh is None else kv_dh), jnp.float32)
    mask = (jnp.zeros((b, t, 1 if w is None else w), jnp.uint32) if mask_dtype == jnp.uint32
            else jnp.zeros((b, t, t), mask_dtype))
    return q, k, k, jnp.zeros((b,), jnp.int32), mask


@pytest.mark.parametrize("change,kwargs,match", [
    (lambda a: (a[0][0],) + a[1:], {}, r"expected q \[B, T, Hq, Dh\]"),
    (lambda a: (a[0], a[1], a[2][:, :-1]) + a[3:], {}, "v_cache .* differ in shape"),
    (lambda a: (a[0][:, :, :3],) + a[1:], {}, "Hq=3 must be a multiple of the KV heads Hkv=2"),
    (lambda a: _args(kv_dh=32), {}, "head_dim mismatch"),
    (lambda a: (jnp.zeros((2, 8, 4, 64)),) + a[1:], {}, "batch mismatch"),
    (lambda a: a[:3] + (jnp.zeros((2,), jnp.int32), a[4]), {}, r"prefix_len .* shape \(1,\)"),
    (lambda a: a[:3] + (jnp.zeros((1,)), a[4]), {}, "prefix_len must be an integer"),
    (lambda a: a[:4] + (a[4][:, :5],), {}, "tree_mask must be"),
    (lambda a: _args(t=40), {}, "room for 32 tree rows, but the tree has R=40"),
    (lambda a: a, {"tree_len": 33}, "room for 32 tree rows, but the tree has R=33"),
    (lambda a: _args(t=40, s=32, w=2), {}, "R=40 rows but the cache only S=32"),
    (lambda a: _args(mask_dtype=jnp.int32), {}, "tree_mask must be bool or packed uint32"),
    (lambda a: (a[0].astype(jnp.int32),) + a[1:], {}, "q must be float32, bfloat16"),
    (lambda a: a, {"impl": "cuda"}, "unknown impl 'cuda'"),
    (lambda a: _args(dh=80, kv_dh=80), {"impl": "pallas"}, "Dh a power of two >= 16"),
])
def test_dispatcher_refuses(change, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tree_attention(*change(_args()), **kwargs)


@pytest.mark.parametrize("name,value", [("block_q", 24), ("block_k", 8), ("block_t", 0)])
def test_block_sizes_must_be_powers_of_two(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a power of two >= 16"):
        tree_attention_pallas(*_args(), interpret=True, **{name: value})
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        count_tree_blocks(jnp.ones((8, 8), bool), 12)


# --------------------------------------------------------------------------------------
# Gemma 3: another attention scale, and the sliding window (XLA and reference only)
# --------------------------------------------------------------------------------------


def test_scale_and_window_xla_equals_reference():
    """``scale`` replaces 1/sqrt(Dh) everywhere (the Pallas kernel included, interpreted);
    ``window`` removes the keys at distance >= window from each query's position, in the
    XLA path as in the reference, and refuses the Pallas kernel."""
    q, k, v, plen, anc = make_problem(2, 12, 2, 2, 16, 40, jnp.float32, prefix=[6, 20])
    depth = jnp.sum(anc, axis=-1) - 1  # a node's depth: its ancestors, itself excluded
    pos = plen[:, None] + depth
    scaled = tree_attention_ref(q, k, v, plen, anc, scale=0.1)
    assert max_error(scaled, tree_attention_ref(q, k, v, plen, anc)) > 1e-3
    out = tree_attention_pallas(q, k, v, plen, pack_ancestors(anc), scale=0.1, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(scaled), rtol=1e-5, atol=1e-5)
    windowed = tree_attention_ref(q, k, v, plen, anc, scale=0.1, window=5, positions=pos)
    assert max_error(windowed, scaled) > 1e-3
    out = tree_attention(q, k, v, plen, anc, impl="xla", scale=0.1, window=5, positions=pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(windowed), rtol=1e-5, atol=1e-5)
    # A window wider than every query-key distance changes nothing.
    wide = tree_attention_ref(q, k, v, plen, anc, scale=0.1, window=64, positions=pos)
    np.testing.assert_allclose(np.asarray(wide), np.asarray(scaled), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="Pallas tree-attention kernel does not implement"):
        tree_attention(q, k, v, plen, anc, impl="pallas", window=5, positions=pos)
