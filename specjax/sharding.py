"""SPMD: a device mesh, logical axes on every array, and one table of rules.

The idiom is jax-llm-examples': every weight, cache buffer and loop-state array carries
*logical* axis names (``("vocab", "embed")`` for the embedding), :data:`RULES` maps each
logical axis to a mesh axis (or to None: replicated), and the model's functions run
unchanged under any mesh. Sharding is expressed by placing the inputs
(:func:`shard_params`, :func:`shard_tree`) and by :func:`constrain` at a few points
(the loop state, the logits); XLA's partitioner does the rest. Where it does badly (the
gathered GEMM on a vocabulary-sharded matrix, :func:`vocab_gather_matmul`; the
tree-attention kernels, :func:`attend_by_heads`), ``shard_map`` says what each device does.

The mesh has two axes (:data:`MESH_AXES`):

* ``data``: batch rows. A batch that is not a multiple of it is padded by the API
  (:func:`specjax.api.generate`) and the padding rows dropped.
* ``model``: tensor parallelism. Attention heads (the flat ``Hq*Dh`` / ``Hkv*Dh``
  columns), MLP columns, the embedding and the LM head (over the vocabulary), and the KV
  cache (over its KV heads).

A dimension that its mesh axis does not divide is *replicated*, never refused: e.g.
SmolLM2's 3 KV heads on ``model=4`` keep the whole KV cache on every device. The weights
are sharded on their flat columns (576 = 4 x 144 for SmolLM2's Q), which any model
axis dividing them splits, head-aligned or not; XLA inserts the communication a
non-aligned split needs. :func:`fallbacks` lists what was replicated for that reason.

Exactness: sharding changes no operation, only where it runs, except the contractions
over a split dimension (``wo``, ``w_down``, the drafter's ``fc``), which sum partial
products across devices in another order (a few ulps). The tests check that greedy tokens
equal the single-device run's on every mesh they try.

A mesh is active only inside :func:`use_mesh` (``jax.set_mesh``); outside it
:func:`constrain` is the identity and every function is the single-device one.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "model")

# Logical axis -> mesh axis. One table: change a row to change the layout everywhere.
RULES: Mapping[str, str | None] = {
    "batch": "data",  # rows of a batch (every loop-state array, the KV cache)
    "vocab": "model",  # embedding / LM head rows, logits, shortlist weight rows
    "heads": "model",  # Hq*Dh: columns of wq (and bq), rows of wo
    "kv_heads": "model",  # Hkv*Dh columns of wk / wv; the Hkv axis of the KV cache
    "mlp": "model",  # F: columns of w_gate / w_up, rows of w_down
    "fc_in": "model",  # rows of a drafter's fc (its [embedding; feature] input)
    "embed": None,  # d, the residual stream: replicated
    "head_dim": None,
    "seq": None,  # cache rows
    # The fused inference layout ([q | k | v], [gate | up]) splits on no head or MLP
    # boundary; under a model axis shard_params unfuses first, so these stay replicated
    # and only ever meet a model axis of 1.
    "qkv": None,
    "gate_up": None,
}

# Logical axes of every parameter, by field name (the same names in the target's
# LayerParams / FusedLayerParams / Params, the EAGLE drafters and the vocabulary heads).
PARAM_AXES: Mapping[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "post_attn_norm": ("embed",),  # Gemma 3's sandwich norms
    "post_mlp_norm": ("embed",),
    "embed_norm": ("embed",),  # EAGLE-3
    "hidden_norm": ("embed",),
    "wq": ("embed", "heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "bq": ("heads",),
    "bk": ("kv_heads",),
    "bv": ("kv_heads",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "wqkv": ("embed", "qkv"),
    "bqkv": ("qkv",),
    "w_gate_up": ("embed", "gate_up"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "fc": ("fc_in", "embed"),  # EAGLE drafters: [2d or 3Dt, d]
    "fc_bias": ("embed",),
    "d2t": (None,),  # EAGLE-3 id maps: small int tables, replicated
    "t2d": (None,),
    # Vocabulary heads: the gathered shortlist rows split like the LM head they came from.
    "w_blocks": ("vocab", "embed"),  # FR-Spec / PA-FR
    "core_w": ("vocab", "embed"),  # EvoSpec's static core
}
# Leaves under these fields are small and read whole by every device (ids, tables, the
# DynaSpec router): replicated on purpose.
REPLICATED_FIELDS = frozenset({
    "ids", "core_ids", "in_core", "successors", "perm", "offsets", "sizes", "always",
    "is_always", "kernels", "biases", "norm_scale"})

# Loop-state arrays (specjax.loop / decode / speculative) that are *not* per batch row;
# every other loop-state array is [B, ...], and the KV buffers are [B, S, Hkv, Dh].
STATE_AXES: Mapping[str, tuple[str | None, ...]] = {
    "k": ("batch", "seq", "kv_heads", "head_dim"),
    "v": ("batch", "seq", "kv_heads", "head_dim"),
    "eos_ids": (None,),
    "temperature": (),
    "top_p": (),
    "key": (),
}


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}`` (an absent axis is 1).

    ValueError names what is wrong (an unknown axis, a size that is not a positive int).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--mesh must look like data=2,model=4, got {text!r}")
    sizes: dict[str, int] = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+)\s*", part)
        if not m:
            raise ValueError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE (e.g. data=2,model=4)")
        name, size = m.group(1), int(m.group(2))
        if name not in MESH_AXES:
            raise ValueError(f"--mesh {text!r}: unknown axis {name!r}; the axes are "
                             f"{', '.join(MESH_AXES)}")
        if name in sizes:
            raise ValueError(f"--mesh {text!r}: axis {name!r} given twice")
        if size < 1:
            raise ValueError(f"--mesh {text!r}: {name} must be >= 1, got {size}")
        sizes[name] = size
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def make_mesh(data: int = 1, model: int = 1, devices: list | None = None) -> Mesh:
    """A ``(data, model)`` mesh over the first ``data * model`` devices (all processes').

    ValueError when it asks for more devices than exist, saying how to get more on CPU.
    """
    devices = list(jax.devices() if devices is None else devices)
    need = data * model
    if min(data, model) < 1:
        raise ValueError(f"mesh axes must be >= 1, got data={data}, model={model}")
    if need > len(devices):
        hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
                "jax starts)" if devices[0].platform == "cpu" else "")
        raise ValueError(f"mesh data={data} x model={model} needs {need} devices, jax sees "
                         f"{len(devices)} {devices[0].platform} device(s){hint}")
    return jax.make_mesh((data, model), MESH_AXES, axis_types=(AxisType.Auto,) * 2,
                         devices=devices[:need])


def as_mesh(mesh: Mesh | str | Mapping[str, int] | None) -> Mesh | None:
    """A mesh from a :class:`Mesh`, a ``"data=2,model=4"`` string or a ``{axis: size}`` dict."""
    if mesh is None or isinstance(mesh, Mesh):
        if mesh is not None and tuple(mesh.axis_names) != MESH_AXES:
            raise ValueError(f"mesh axes must be {MESH_AXES}, got {tuple(mesh.axis_names)}")
        if mesh is not None and any(t != AxisType.Auto for t in mesh.axis_types):
            # The layout is given by placements and constraints that XLA propagates;
            # explicit-sharding axes would make every op's sharding part of its type.
            raise ValueError(f"mesh axes must be AxisType.Auto, got {mesh.axis_types}; "
                             "build it with specjax.make_mesh(data, model)")
        return mesh
    if isinstance(mesh, str):
        return make_mesh(**parse_mesh(mesh))
    if isinstance(mesh, Mapping):
        return make_mesh(**parse_mesh(",".join(f"{k}={v}" for k, v in mesh.items())))
    raise TypeError("mesh must be a jax.sharding.Mesh, a string like 'data=2,model=4', a dict "
                    f"or None, got {type(mesh).__name__}")


def axis_size(mesh: Any, axis: str) -> int:
    """Devices along ``axis`` of a (concrete or abstract) mesh; 1 when it has no such axis."""
    return dict(mesh.shape).get(axis, 1)


def spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Any,
         rules: Mapping[str, str | None] = RULES) -> P:
    """The PartitionSpec of an array of ``shape`` with logical ``axes`` on ``mesh``.

    A logical axis maps to its rule's mesh axis when that axis has more than one device
    and divides the dimension; otherwise the dimension is replicated (see the module
    docstring). ``axes`` may be shorter than ``shape``: trailing dimensions replicate.
    """
    if len(axes) > len(shape):
        raise ValueError(f"logical axes {axes} for an array of rank {len(shape)}")
    out: list[str | None] = []
    for dim, name in zip(shape[:len(axes)], axes, strict=True):
        ax = rules[name] if name is not None else None
        n = axis_size(mesh, ax) if ax is not None else 1
        out.append(ax if n > 1 and dim % n == 0 and ax not in out else None)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _field(path: tuple) -> str | None:
    """The innermost field name on a pytree path (``layers[3].wq`` -> ``"wq"``)."""
    for k in reversed(path):
        name = getattr(k, "name", None) or getattr(k, "key", None)
        if isinstance(name, str):
            return name
    return None


def param_axes(path: tuple, leaf: Any) -> tuple[str | None, ...]:
    """Logical axes of one parameter leaf; KeyError for a field with no rule (add one)."""
    name = _field(path)
    if name in REPLICATED_FIELDS or np.ndim(leaf) == 0:
        return ()
    if name not in PARAM_AXES:
        raise KeyError(f"no sharding rule for parameter {jax.tree_util.keystr(path)}; add its "
                       "logical axes to specjax.sharding.PARAM_AXES")
    return PARAM_AXES[name]


def state_axes(path: tuple, leaf: Any) -> tuple[str | None, ...]:
    """Logical axes of one loop-state leaf: :data:`STATE_AXES`, else a leading batch axis."""
    name = _field(path)
    if name in STATE_AXES:
        return STATE_AXES[name]
    return ("batch",) if np.ndim(leaf) else ()


def tree_specs(tree: Any, mesh: Any, axes_of: Callable = param_axes) -> Any:
    """A pytree of PartitionSpecs, one per leaf of ``tree``."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: spec(axes_of(p, x), np.shape(x), mesh), tree)


def shard_tree(tree: Any, mesh: Mesh, axes_of: Callable = param_axes) -> Any:
    """``tree`` placed on ``mesh`` by its logical axes (a no-op for leaves already there)."""
    specs = tree_specs(tree, mesh, axes_of)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def shardings(tree: Any, mesh: Mesh, axes_of: Callable = param_axes) -> Any:
    """NamedShardings for ``tree`` (arrays or ``ShapeDtypeStruct``s): e.g. orbax's targets."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree_specs(tree, mesh, axes_of))


def shard_params(params: Any, mesh: Mesh) -> Any:
    """Target or drafter parameters on ``mesh``.

    A target in the fused inference layout is unfused first when the model axis is > 1
    (see :data:`RULES` ``"qkv"``): the separate Q, K, V and gate, up matrices split on
    head and MLP boundaries.
    """
    from specjax.model import Params, unfuse_params

    if isinstance(params, Params) and axis_size(mesh, "model") > 1:
        params = unfuse_params(params)
    return shard_tree(params, mesh)


def shard_head(head: Any, mesh: Mesh) -> Any:
    """A vocabulary head on ``mesh``. A head whose weight rows are cut into blocks of any
    size (FR-Spec / PA-FR) re-cuts them at multiples of the model axis first
    (``split_rows``), so no block falls back to replication."""
    m = axis_size(mesh, "model")
    if m > 1 and hasattr(head, "split_rows"):
        head = head.split_rows(m)
    return shard_tree(head, mesh)


def fallbacks(tree: Any, mesh: Any, axes_of: Callable = param_axes) -> list[str]:
    """Paths of the leaves with a sharded logical axis that ``mesh`` leaves replicated
    (its mesh axis does not divide the dimension)."""
    out = []

    def check(path, x):
        axes = axes_of(path, x)
        want = [RULES[a] for a in axes if a is not None and RULES[a] is not None
                and axis_size(mesh, RULES[a]) > 1]
        got = [a for a in spec(axes, np.shape(x), mesh) if a is not None]
        if len(got) < len(want):
            out.append(jax.tree_util.keystr(path))

    jax.tree_util.tree_map_with_path(check, tree)
    return out


def active_mesh() -> Any | None:
    """The mesh set by :func:`use_mesh` (an abstract mesh inside a trace), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def use_mesh(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """Context manager making ``mesh`` the active one (``jax.set_mesh``); None: no mesh.

    Functions traced inside it see the mesh (jit keys its cache on it), so a run under a
    mesh never reuses a single-device program or the other way round.
    """
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def constrain(x: Array, axes: tuple[str | None, ...]) -> Array:
    """``with_sharding_constraint`` by logical axes under the active mesh; else ``x``."""
    mesh = active_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec(axes, x.shape, mesh))


def constrain_state(state: Any) -> Any:
    """A loop state with every array pinned to its layout (:func:`state_axes`).

    Called where a loop state is produced (prefill, each step), so the
    ``lax.while_loop`` carry keeps one layout and XLA never reshards it between steps.
    """
    if active_mesh() is None:
        return state
    return jax.tree_util.tree_map_with_path(lambda p, x: constrain(x, state_axes(p, x)), state)


def constrain_logits(logits: Array) -> Array:
    """Logits [B, ..., V] (or one row [V]): rows over ``data``, the vocabulary over
    ``model``."""
    if logits.ndim < 2:
        return constrain(logits, ("vocab",))
    return constrain(logits, ("batch",) + (None,) * (logits.ndim - 2) + ("vocab",))


def vocab_gather_matmul(matmul: Callable[[Array, Array, Array], Array], h: Array, w: Array,
                        idx: Array) -> Array:
    """``matmul(h, w, idx)`` (a gathered GEMM, padding ids -> 0.0) with ``w`` [V, d] split
    over the vocabulary, gathering within each shard.

    XLA partitions the gather by itself as a masked gather in each shard followed by an
    all-reduce of the gathered rows, [N, C, d] (measured on jax 0.10.2). Here each device
    gathers only the ids in its own rows (others become padding, logit exactly 0.0), runs
    the GEMM on them, and a ``psum`` over ``model`` adds the logits, [N, C]: d times fewer
    bytes, and the same float32 values as on one device (one non-zero term per entry).
    h: [N, d], idx: [N, C] -> [N, C] float32. Without a model axis dividing V, it is
    ``matmul`` itself.
    """
    mesh = active_mesh()
    m = axis_size(mesh, "model") if mesh is not None else 1
    v = w.shape[0]
    if m == 1 or v % m:
        return matmul(h, w, idx)
    rows = "data" if h.shape[0] % axis_size(mesh, "data") == 0 else None

    def local(h, w, idx):
        lo = jax.lax.axis_index("model") * w.shape[0]
        mine = (idx >= lo) & (idx < lo + w.shape[0])
        out = matmul(h, w, jnp.where(mine, idx - lo, -1).astype(idx.dtype))
        return jax.lax.psum(out, "model")

    return jax.shard_map(local, mesh=mesh, in_specs=(P(rows), P("model"), P(rows)),
                         out_specs=P(rows), check_vma=False)(h, w, idx)


def per_device_bytes(tree: Any) -> dict[int, int]:
    """Bytes of ``tree``'s arrays held by each device id (addressable shards only)."""
    out: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
    return out


def total_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays at their global shapes."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def flat_shardings(abstract: Mapping[str, Any], mesh: Mesh) -> dict[str, NamedSharding]:
    """Shardings for a checkpoint's flat tensors (``"layers.3.wq"``: the field is the last
    dotted part), as :func:`specjax.checkpoint.restore_params` hands them to orbax."""
    out = {}
    for name, a in abstract.items():
        field = name.rsplit(".", 1)[-1]
        path = (jax.tree_util.GetAttrKey(field),)
        out[name] = NamedSharding(mesh, spec(param_axes(path, a), tuple(a.shape), mesh))
    return out


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """Join a multi-host run (``jax.distributed.initialize``); call before any jax work.

    Every host runs the same program with the same ``coordinator_address`` (host:port of
    process 0) and ``num_processes``, and its own ``process_id``; afterwards
    ``jax.devices()`` lists every host's devices and a mesh spans them all. All None: JAX
    reads them from the cluster environment (SLURM, TPU pods, ...). See docs/sharding.md.
    """
    given = [coordinator_address is not None, num_processes is not None,
             process_id is not None]
    if any(given) and not all(given):
        raise ValueError("a multi-host run needs all of coordinator address, number of "
                         "processes and process id (--coordinator-address, --num-processes, "
                         "--process-id), or none of them to read them from the cluster")
    if num_processes is not None:
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
        if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
            raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
        if not re.fullmatch(r"[\w.\-\[\]:]+:\d+", coordinator_address or ""):
            raise ValueError("coordinator_address must be HOST:PORT (process 0's), got "
                             f"{coordinator_address!r}")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)


def to_host(x: Array) -> np.ndarray:
    """``x`` as one numpy array on this host, gathering other hosts' shards if needed."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def attend_by_heads(attend: Callable[..., Array], q: Array, k_cache: Array, v_cache: Array,
                    prefix_len: Array, tree_mask: Array,
                    positions: Array | None = None) -> Array:
    """``attend(q, k_cache, v_cache, prefix_len, tree_mask, positions=positions)`` (a
    tree-attention kernel) with batch rows over ``data`` and KV heads over ``model``, under
    ``shard_map``.

    q: [B, T, Hq, Dh]; k_cache, v_cache: [B, S, Hkv, Dh]; prefix_len: [B];
    tree_mask: [B, T, R or W]; positions: [B, T] or None (a sliding-window layer's query
    positions) -> [B, T, Hq, Dh]. Query head h reads KV head h // group, so a contiguous
    split of the KV heads splits the query heads with them: each device runs the kernel
    on its own heads and rows, with no communication. XLA cannot partition a Pallas call
    by itself; an axis that does not divide B (or Hkv) is not split.
    """
    mesh = active_mesh()
    if mesh is None:
        return attend(q, k_cache, v_cache, prefix_len, tree_mask, positions=positions)
    d, m = axis_size(mesh, "data"), axis_size(mesh, "model")
    rows = "data" if d > 1 and q.shape[0] % d == 0 else None
    heads = "model" if m > 1 and k_cache.shape[2] % m == 0 else None
    if rows is None and heads is None:
        return attend(q, k_cache, v_cache, prefix_len, tree_mask, positions=positions)
    qkv = P(rows, None, heads)
    args, specs = [q, k_cache, v_cache, prefix_len, tree_mask], [qkv, qkv, qkv, P(rows), P(rows)]
    if positions is not None:
        args.append(positions)
        specs.append(P(rows))

    def local(q, k, v, plen, mask, pos=None):
        return attend(q, k, v, plen, mask, positions=pos)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=qkv,
                         check_vma=False)(*args)
