"""DynaSpec's routed head: a router over token clusters picks each node's shortlist.

Per expanded node, the router scores the M clusters from [embedding(x_t); the drafter's
input feature] (the drafter fc's input, so it does not wait for the drafter layer), the
top ``k_c(t)`` clusters are chosen, and the head scores the union of their members with
one gathered GEMM (:mod:`specjax.kernels.gathered_gemm`).

Buffer layout, per node: ``[always-kept ids (A) | members of the chosen clusters, in
router-score order, then padding]``. The static capacity at step t is A plus the sizes of
the ``k_c(t)`` largest clusters, optionally capped at ``k_c(t) * cluster_cap``; a choice
of unusually large clusters then loses the tail of its lowest-scored clusters. Members
that are always-kept tokens are masked out of the cluster part, so valid ids stay distinct.

``shared`` is an option for CPUs: per-node shortlists gather K x C rows per expansion of
K nodes, which XLA:CPU cannot fuse into the GEMM (``specjax bench gemm``: at K=4 a gathered
8k shortlist costs about the full head); a shared one gathers C rows once.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from specjax import pytree
from specjax.kernels.gathered_gemm import gathered_matmul, shared_gathered_matmul
from specjax.sharding import vocab_gather_matmul
from specjax.vocab.clusters import Clusters
from specjax.vocab.head import Candidates, masked
from specjax.vocab.router import RouterParams, router_logits


def cluster_budget(step: int, k0: int, k1: int) -> int:
    """k_c(t) of DynaSpec section 4.2: k0, k1, then floor((k1 + t) / (2t)) (at least 1)."""
    if step == 0:
        return k0
    if step == 1:
        return k1
    return max(1, (k1 + step) // (2 * step))


@pytree.dataclass
class RoutedHead:
    """DynaSpec head. Fixed top-k clusters (``k0`` at every step) or position-aware k_c(t).

    router: the router MLP's parameters.
    perm: [V] int32 token ids grouped by cluster; cluster m is perm[offsets[m]:offsets[m+1]].
    offsets: [M + 1] int32. sizes: [M] int32.
    always: [A] int32 tokens in every shortlist (EOS, chat specials); is_always: [V] bool.
    largest: static, cluster sizes sorted descending (sizes the buffers).
    cluster_cap: static; the cluster part of the buffer holds at most ``k_c(t) *
      cluster_cap`` tokens (0 = no cap). Unbalanced clusters make "the k largest" far larger
      than a typical choice, and the buffer, not the shortlist, sets the GEMM's cost.
    """

    router: RouterParams
    perm: Array
    offsets: Array
    sizes: Array
    always: Array
    is_always: Array
    k0: int = pytree.static_field()
    k1: int = pytree.static_field()
    position_aware: bool = pytree.static_field()
    largest: tuple[int, ...] = pytree.static_field()
    cluster_cap: int = pytree.static_field(default=0)
    shared: bool = pytree.static_field(default=False)
    uses_context: ClassVar[bool] = True
    stateful: ClassVar[bool] = False

    @property
    def name(self) -> str:
        # The --vocab spelling: "dynaspec" is position-aware, "dynaspec-f" a fixed top-k.
        return f"dynaspec{'' if self.position_aware else '-f'}{'-shared' if self.shared else ''}"

    def budget(self, step: int) -> int:
        """Clusters chosen at draft step ``step``."""
        k = cluster_budget(step, self.k0, self.k1) if self.position_aware else self.k0
        return min(k, len(self.largest))

    def capacity(self, step: int) -> int:
        k = self.budget(step)
        cap = sum(self.largest[:k])
        if self.cluster_cap:
            cap = min(cap, k * self.cluster_cap)
        return int(self.always.shape[0]) + cap

    def __call__(self, w, h, step, context=None, state=None) -> Candidates:
        if context is None:
            raise ValueError("the DynaSpec head needs the router context")
        k = self.budget(step)
        cap = self.capacity(step) - self.always.shape[0]
        scores = router_logits(self.router, context)  # [B, K, M]
        if self.shared:  # one shortlist per row and step: a cluster any node wants most
            scores = jnp.max(scores, axis=1, keepdims=True)
        chosen = jax.lax.top_k(scores, k)[1]  # [B, K or 1, k], best first
        size = self.sizes[chosen]
        end = jnp.cumsum(size, axis=-1)
        # Which chosen cluster holds buffer slot p: the number of cluster ends <= p.
        lead = chosen.shape[:-1]
        marks = jnp.zeros(lead + (cap + 1,), jnp.int32)
        idx = tuple(jnp.indices(lead + (k,))[:-1]) + (jnp.minimum(end, cap),)
        j = jnp.minimum(jnp.cumsum(marks.at[idx].add(1), axis=-1)[..., :cap], k - 1)
        p = jnp.arange(cap, dtype=jnp.int32)
        start = jnp.take_along_axis(end - size, j, axis=-1)
        member = jnp.take_along_axis(self.offsets[chosen], j, axis=-1) + p - start
        ids = self.perm[jnp.clip(member, 0, self.perm.shape[0] - 1)]
        valid = (p < end[..., -1:]) & ~self.is_always[ids]
        ids = jnp.concatenate([jnp.broadcast_to(self.always, lead + self.always.shape), ids],
                              axis=-1)
        valid = jnp.concatenate([jnp.ones(lead + self.always.shape, bool), valid], axis=-1)
        if self.shared:
            # Gather the shortlist's rows once and score every node of the step against
            # them: K x fewer gathered bytes than per-node shortlists.
            logits = shared_gathered_matmul(h, w, ids[:, 0])
            shape = logits.shape
            return masked(jnp.broadcast_to(ids, shape), jnp.broadcast_to(valid, shape), logits)
        d = h.shape[-1]
        # Under a mesh W is split over the vocabulary: each device gathers its own rows.
        logits = vocab_gather_matmul(gathered_matmul, h.reshape(-1, d), w,
                                     ids.reshape(-1, ids.shape[-1]))
        return masked(ids, valid, logits.reshape(ids.shape))


def routed_head(router: RouterParams, clusters: Clusters, always: list[int], *, k0: int,
                k1: int = 0, position_aware: bool = False, cluster_cap: int = 0,
                shared: bool = False) -> RoutedHead:
    """Build a :class:`RoutedHead` from a router and its token clusters.

    clusters: the vocabulary partition the router scores (spherical k-means on the head).
    k0: clusters at step 0 (every step when not ``position_aware``); k1: at step 1.
    shared: one shortlist per batch row and draft step, from the max of the step's
      nodes' router scores (gathers once per step; the paper's routing is per node).
    """
    if k0 < 1 or (position_aware and not 1 <= k1 <= k0):
        raise ValueError(f"cluster budgets need 1 <= k1 <= k0 (got k0={k0}, k1={k1})")
    always = np.unique(np.asarray(always, np.int32))
    is_always = np.zeros(clusters.vocab_size, bool)
    is_always[always] = True
    return RoutedHead(router=router, perm=jnp.asarray(clusters.perm),
                      offsets=jnp.asarray(clusters.offsets), sizes=jnp.asarray(clusters.sizes),
                      always=jnp.asarray(always), is_always=jnp.asarray(is_always), k0=k0,
                      k1=k1, position_aware=position_aware,
                      largest=tuple(int(s) for s in np.sort(clusters.sizes)[::-1]),
                      cluster_cap=cluster_cap, shared=shared)
