"""EAGLE-1/2 drafter: ``fc([embedding(x_t), feature_{t-1}])`` then decoder layers.

EAGLE's drafter has one decoder layer (``num_layers=1``, the default and every
checkpoint written before the field existed); more layers buy capacity per draft
at the cost of one more layer per draft step. Each layer is shaped like the
target's.

Alignment (EAGLE's): drafter row t consumes token x_t together with the
target's final-norm hidden state at t-1 (the state that predicted x_t), and
outputs a predicted feature for position t, which the target's LM head turns
into a distribution over x_{t+1}. Deeper draft steps feed the drafter's own
predicted feature in place of the target's.

Tapped features (``taps``, EAGLE-3's idea on EAGLE-1's drafter): the target feature may
also carry the outputs of earlier target layers, ``f_t + sum_i rms(tap_i_t) @ tap_fc_i``.
Low layers keep what the last one has traded for its prediction (which token stands at t,
and the one before), which a one-layer drafter needs to copy from its context. ``tap_fc``
starts at zero, so a tapped drafter grown from an untapped one predicts exactly as it did;
deeper draft steps feed the drafter's own output, as before (it has no taps).

The embedding and the LM head are the target's, frozen and never stored in a
drafter checkpoint. Training uses the Flax NNX module :class:`EagleDrafter`;
inference uses the pure functions over :class:`DrafterParams` split out of it.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array
from jax.typing import DTypeLike

from specjax import checkpoint as ckpt
from specjax import pytree
from specjax.config import ModelConfig
from specjax.model import (
    FusedLayerParams,
    KVCache,
    LayerParams,
    Params,
    cache_mask,
    decoder_layer,
    init_cache,
    is_out_major,
    out_major_layer,
    rope_inv_freq,
    stored_product,
    unfuse_layer,
)

FORMAT = "specjax-drafter"
# Target fields a drafter is tied to: its layer mirrors them and it reads the
# target's embedding / head and final hidden states.
MATCH_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_heads", "num_kv_heads",
                "head_dim", "intermediate_size")


class DrafterMismatchError(ValueError):
    """The drafter was built for a different target."""


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Static drafter architecture; each decoder layer is shaped like the target's."""

    target: ModelConfig  # the layers' shapes, RoPE and norms; its num_layers is ignored
    input_norm: bool = False  # EAGLE-1 drops the first layer's input RMSNorm
    fc_bias: bool = True
    num_layers: int = 1  # the drafter's own decoder layers (EAGLE: 1)
    # Target layers whose outputs are added to the feature through ``tap_fc`` (() = EAGLE-1).
    taps: tuple[int, ...] = ()

    def __post_init__(self):
        n = self.num_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"a drafter needs at least one decoder layer: num_layers must be "
                             f"an integer >= 1, got {n!r}")
        taps = self.taps
        if (not isinstance(taps, tuple) or any(isinstance(i, bool) or not isinstance(i, int)
                                               for i in taps)
                or list(taps) != sorted(set(taps))
                or any(not 0 <= i < self.target.num_layers for i in taps)):
            raise ValueError(f"drafter taps must be increasing target layer indices in "
                             f"[0, {self.target.num_layers}), got {taps!r}")

    def check_target(self, cfg: ModelConfig, what: str = "drafter") -> None:
        """Refuse a target whose width, vocabulary or family differs, naming each field."""
        bad = [f"{f}: {what} {getattr(self.target, f)} vs target {getattr(cfg, f)}"
               for f in MATCH_FIELDS if getattr(self.target, f) != getattr(cfg, f)]
        if self.taps and max(self.taps) >= cfg.num_layers:
            bad.append(f"taps: {what} reads target layer {max(self.taps)}, the target has "
                       f"{cfg.num_layers} layers")
        if bad:
            raise DrafterMismatchError(
                f"the {what} was built for a different target ({'; '.join(bad)}); use a "
                "drafter trained for this target or train one with `specjax train drafter`")

    # The drafter seam (specjax.draft_model.DraftModel).
    kind: ClassVar[str] = "eagle"

    @property
    def width(self) -> int:
        return self.target.hidden_size

    def tap_layers(self, target_cfg: ModelConfig) -> tuple[int, ...]:
        return self.taps  # () for EAGLE-1/2: the target's final-norm hidden state only

    def target_features(self, params: DrafterParams, hidden: Array,
                        taps: tuple[Array, ...]) -> Array:
        return tapped_features(params, hidden, taps)

    def forward(self, params: DrafterParams, embed: Array, tokens: Array, features: Array,
                positions: Array, cache: KVCache, block_mask: Array | None = None,
                write_rows: Array | None = None,
                attention_impl: str = "dense") -> tuple[Array, KVCache]:
        return drafter_hidden(params, self, embed, tokens, features, positions, cache,
                              block_mask, write_rows, attention_impl)

    def init_cache(self, batch: int, capacity: int,
                   dtype: DTypeLike = jnp.float32) -> KVCache:
        return init_drafter_cache(self, batch, capacity, dtype)

    def router_context(self, embed: Array, tokens: Array, features: Array) -> Array:
        """[B, K, 2d] the fc's input [embedding(x_t); feature_{t-1}]: it does not wait for
        the drafter layer, so a router can run beside it."""
        return jnp.concatenate([embed[tokens].astype(features.dtype), features], axis=-1)

    def to_json(self) -> dict:
        d = {"target": self.target.to_json(), "input_norm": self.input_norm,
             "fc_bias": self.fc_bias, "num_layers": self.num_layers}
        return d | ({"taps": list(self.taps)} if self.taps else {})

    @classmethod
    def from_json(cls, d: dict) -> DrafterConfig:
        """Inverse of :meth:`to_json`; ValueError names a missing or mistyped field."""
        if not isinstance(d, dict):
            raise ValueError(f"drafter config must be a JSON object, got {type(d).__name__}")
        for name in ("input_norm", "fc_bias"):
            if not isinstance(d.get(name), bool):
                raise ValueError(f"drafter config field {name} must be true or false, got "
                                 f"{d.get(name)!r}")
        taps = d.get("taps", [])
        if not isinstance(taps, list):
            raise ValueError(f"drafter config field taps must be a list, got {taps!r}")
        # Absent in folders written before deeper (tapped) drafters: EAGLE's one layer (no
        # taps). The values are checked by __post_init__.
        return cls(target=ModelConfig.from_json(d.get("target")), input_norm=d["input_norm"],
                   fc_bias=d["fc_bias"], num_layers=d.get("num_layers", 1), taps=tuple(taps))


@pytree.dataclass
class DrafterParams:
    fc: Array  # [2d, d]; input rows are [embedding(x_t); feature_{t-1}]
    # cfg.num_layers layers, applied in order; layers[0].attn_norm is None when not
    # cfg.input_norm (deeper layers always keep theirs: their input is a residual stream).
    layers: tuple[LayerParams, ...]
    fc_bias: Array | None = None  # [d]
    tap_fc: Array | None = None  # [len(cfg.taps) * d, d]; None when cfg.taps is ()
    # True only in :func:`in_target_layout`'s inference copy: fc and tap_fc stored
    # transposed, [out, in], for the CPU rowdot kernel; stored params are never so.
    out_major: bool = pytree.static_field(default=False)

    def project(self, name: str, x: Array) -> Array:
        """``x @ fc`` or ``x @ tap_fc`` ([..., in] -> [..., d]), through the CPU rowdot
        kernel when the copy is out-major (its few-row products are the catch-up's)."""
        return stored_product(x, getattr(self, name), self.out_major)


def tapped_features(dp: DrafterParams, hidden: Array, taps: tuple[Array, ...]) -> Array:
    """The drafter's input feature at each position the target ran: [B, T, d].

    hidden: [B, T, d] the target's final-norm states; taps: the outputs of ``cfg.taps``
    layers, each [B, T, d] (residual streams: RMS-normalised here, without a weight, since
    their scale grows with depth). Without taps the feature is ``hidden`` itself.
    """
    if dp.tap_fc is None:
        return hidden
    x = jnp.concatenate([_unit_rms(t) for t in taps], axis=-1)
    return hidden + dp.project("tap_fc", x).astype(hidden.dtype)  # x is float32


def _unit_rms(x: Array) -> Array:
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)


def fc_input(dp: DrafterParams, embed: Array, tokens: Array, features: Array) -> Array:
    """The first layer's input, ``fc([embedding(x_t); feature_{t-1}])``: tokens [B, T] and
    features [B, T, d] -> [B, T, d]."""
    x = dp.project("fc", jnp.concatenate([embed[tokens].astype(features.dtype), features],
                                         axis=-1))
    return x if dp.fc_bias is None else x + dp.fc_bias


def drafter_hidden(dp: DrafterParams, cfg: DrafterConfig, embed: Array, tokens: Array,
                   features: Array, positions: Array, cache: KVCache,
                   block_mask: Array | None = None,
                   write_rows: Array | None = None,
                   attention_impl: str = "dense") -> tuple[Array, KVCache]:
    """Predicted features for a block of new drafter rows.

    Args:
      embed: [V, d] the target's embedding.
      tokens: [B, T] x_t; features: [B, T, d] the feature at t-1 (the target's
        final-norm hidden state, or the drafter's own prediction when drafting).
      positions: [B, T] RoPE positions; cache: the drafter's cache, one entry per layer.
      block_mask, write_rows, attention_impl: as in :func:`specjax.model.forward_hidden`.
    Returns:
      (hidden [B, T, d], cache with the new rows written; lengths unchanged).
    """
    b, t = tokens.shape
    x = fc_input(dp, embed, tokens, features)
    if block_mask is None:
        block_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    if write_rows is None:
        write_rows = cache.lengths[:, None] + jnp.arange(t)[None, :]
    mask = cache_mask(cache.lengths, block_mask, cache.capacity)
    inv_freq = rope_inv_freq(cfg.target)
    ks, vs = [], []
    for layer, k_buf, v_buf in zip(dp.layers, cache.k, cache.v, strict=True):
        x, k, v = decoder_layer(cfg.target, layer, x, positions, inv_freq, k_buf, v_buf,
                                write_rows, mask, (cache.lengths, block_mask), attention_impl)
        ks.append(k)
        vs.append(v)
    return x, dataclasses.replace(cache, k=tuple(ks), v=tuple(vs))


def in_target_layout(dp: Any, target: Params) -> Any:
    """``dp`` (an EAGLE drafter's :class:`DrafterParams`) with its products in the layout
    the target was loaded in; any other drafter's params (EAGLE-3's) unchanged.

    When :func:`specjax.load` stored the target's products [out, in] for the CPU rowdot
    kernel, the drafter's layers, ``fc`` and ``tap_fc`` get the same layout, so their
    few-row products take the kernel too (XLA's small-M dot ran each [1152, 576] product
    of two rows in ~0.35 ms, the kernel in ~0.15): the catch-up re-reads the accepted
    rows and the next root every step (2 rows, or 10 with a lookup chain of 8), and an
    EAGLE-2 or DySpec frontier expands several rows a level. The same numbers, for
    inference only: checkpoints, fingerprints, training and LoRA merges keep the stored
    params.
    """
    if not isinstance(dp, DrafterParams) or not is_out_major(target):
        return dp
    # The copy costs ~20 ms (two SmolLM2 layers), so it is kept while ``dp`` lives: every
    # generate call with one loaded drafter reuses it; a new merge (LoRA) makes a new one.
    laid = _LAID.get(id(dp))
    if laid is None:
        tap_fc = None if dp.tap_fc is None else dp.tap_fc.T
        laid = dataclasses.replace(dp, fc=dp.fc.T, tap_fc=tap_fc, out_major=True,
                                   layers=tuple(out_major_layer(lp) for lp in dp.layers))
        _LAID[id(dp)] = laid
        weakref.finalize(dp, _LAID.pop, id(dp), None)
    return laid


_LAID: dict[int, DrafterParams] = {}  # id(stored params) -> laid out; see in_target_layout


def init_drafter_cache(cfg: DrafterConfig, batch: int, capacity: int,
                       dtype: DTypeLike = jnp.float32) -> KVCache:
    """The drafter's own KV cache: cfg.num_layers layers."""
    # Every layer attends globally (a Gemma target's layer pattern is not the drafter's).
    return init_cache(dataclasses.replace(cfg.target, num_layers=cfg.num_layers,
                                          layer_types=()), batch, capacity, dtype)


def identity_layer(layer: LayerParams) -> LayerParams:
    """``layer`` with its residual branches' outputs zeroed, so it computes x -> x.

    The branches' outputs are ``wo`` and ``w_down``; with sandwich norms (Gemma 3) each
    branch is RMS-normed after its projection, and the norm of a zero vector has a
    1/sqrt(eps) gradient that makes the first update of ``wo`` jump the branch to full
    scale, so there the post-norm scales are zeroed instead. Either way the pretrained
    q/k/v and gate/up projections are kept and gradients reach them once the zeroed
    weights move. Used to start a layer that must not change a drafter's output yet:
    a from-the-target init, or a layer added under a trained drafter.
    """
    layer = unfuse_layer(layer)
    zeroed = (("post_attn_norm", "post_mlp_norm") if layer.post_attn_norm is not None
              else ("wo", "w_down"))
    return dataclasses.replace(layer, **{k: jnp.zeros_like(getattr(layer, k)) for k in zeroed})


class EagleDrafter(nnx.Module):
    """Trainable drafter. ``params()`` gives the pytree the pure functions take."""

    def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs,
                 init_layer: LayerParams | FusedLayerParams | None = None):
        t = cfg.target
        d, f = t.hidden_size, t.intermediate_size
        q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
        self.cfg = cfg
        init = nnx.initializers.normal(0.02)
        self.fc = nnx.Param(init(rngs.params(), (2 * d, d)))
        self.fc_bias = nnx.Param(jnp.zeros((d,))) if cfg.fc_bias else None
        # Zero: the taps add nothing until training finds a use for them.
        self.tap_fc = nnx.Param(jnp.zeros((len(cfg.taps) * d, d))) if cfg.taps else None

        def random_layer() -> LayerParams:
            shapes = dict(wq=(d, q), wk=(d, kv), wv=(d, kv), wo=(q, d), w_gate=(d, f),
                          w_up=(d, f), w_down=(f, d))
            weights = {k: init(rngs.params(), s) for k, s in shapes.items()}
            norms = {"attn_norm": jnp.ones((d,)), "mlp_norm": jnp.ones((d,))}
            if t.attention_bias:
                norms |= {"bq": jnp.zeros((q,)), "bk": jnp.zeros((kv,)), "bv": jnp.zeros((kv,))}
            if t.qk_norm:
                norms |= {"q_norm": jnp.ones((t.head_dim,)), "k_norm": jnp.ones((t.head_dim,))}
            if t.sandwich_norms:
                norms |= {"post_attn_norm": jnp.ones((d,)), "post_mlp_norm": jnp.ones((d,))}
            return LayerParams(**weights, **norms)

        if init_layer is None:
            layers = [random_layer() for _ in range(cfg.num_layers)]
        else:
            # A target's fused (or out-major) layer is read back as [in, out] matrices. Layers
            # past the first start as the identity, so a deeper drafter grown from a trained
            # one-layer drafter starts with exactly its predictions.
            first = unfuse_layer(init_layer)
            layers = [first] + [identity_layer(first)] * (cfg.num_layers - 1)
        if not cfg.input_norm:  # only the first layer: the others read a residual stream
            layers[0] = dataclasses.replace(layers[0], attn_norm=None)
        # One nnx.Param per LayerParams field; a None field stays None. Copy: the init layer
        # is often the target's own weights, which training must never alias (a donated or
        # updated buffer would corrupt the target).
        self.layers = nnx.List([
            nnx.Dict({f.name: nnx.Param(jnp.array(w, jnp.float32, copy=True))
                      for f in dataclasses.fields(LayerParams)
                      if (w := getattr(layer, f.name)) is not None})
            for layer in layers])

    def params(self) -> DrafterParams:
        layers = tuple(LayerParams(**{f.name: (layer[f.name][...] if f.name in layer else None)
                                      for f in dataclasses.fields(LayerParams)})
                       for layer in self.layers)
        return DrafterParams(fc=self.fc[...], layers=layers,
                             fc_bias=None if self.fc_bias is None else self.fc_bias[...],
                             tap_fc=None if self.tap_fc is None else self.tap_fc[...])

    def __call__(self, embed: Array, tokens: Array, features: Array) -> Array:
        """Teacher-forced training pass over whole sequences: [B, T] -> hidden [B, T, d]."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        cache = init_drafter_cache(self.cfg, b, t, features.dtype)
        hidden, _ = drafter_hidden(self.params(), self.cfg, embed, tokens, features, positions,
                                   cache)
        return hidden


def _layer_prefix(i: int) -> str:
    # "layer.*" for the first layer keeps one-layer folders written before deeper drafters
    # existed readable; deeper layers are "layers.<i>.*".
    return "layer" if i == 0 else f"layers.{i}"


def save_drafter(out: Path, cfg: DrafterConfig, dp: DrafterParams, *, meta: dict | None = None,
                 overwrite: bool = False) -> Path:
    """Write a drafter folder (orbax tensors + manifest); atomic like conversion."""
    flat = {"fc": dp.fc}
    for i, layer in enumerate(dp.layers):
        flat |= {f"{_layer_prefix(i)}.{f.name}": getattr(layer, f.name)
                 for f in dataclasses.fields(LayerParams) if getattr(layer, f.name) is not None}
    if dp.fc_bias is not None:
        flat["fc_bias"] = dp.fc_bias
    if dp.tap_fc is not None:
        flat["tap_fc"] = dp.tap_fc
    return ckpt.write_checkpoint(out, flat, FORMAT, cfg.to_json(), meta=meta,
                                 overwrite=overwrite)


def drafter_dims(cfg: DrafterConfig) -> dict[str, tuple]:
    """Every tensor of a drafter folder and its shape as products of target config fields."""
    dims = {"fc": ((2, "hidden_size"), ("hidden_size",))}
    if cfg.fc_bias:
        dims["fc_bias"] = (("hidden_size",),)
    if cfg.taps:
        dims["tap_fc"] = ((len(cfg.taps), "hidden_size"), ("hidden_size",))
    for i in range(cfg.num_layers):
        dims |= {f"{_layer_prefix(i)}.{k}": v for k, v in ckpt.layer_dims(
            cfg.target, input_norm=cfg.input_norm or i > 0).items()}
    return dims


def drafter_config(path: Path, manifest: dict | None = None) -> DrafterConfig:
    """A drafter folder's config, from its manifest alone (no tensor is read)."""
    manifest = ckpt.read_manifest(Path(path), FORMAT) if manifest is None else manifest
    try:
        return DrafterConfig.from_json(manifest.get("config"))
    except (ValueError, KeyError, TypeError) as e:
        raise ckpt.CheckpointError(f"{Path(path) / ckpt.MANIFEST}: invalid drafter config "
                                   f"({type(e).__name__}: {e}); convert or train the drafter "
                                   "again") from e


def read_drafter(path: Path, target_cfg: ModelConfig | None = None,
                 dtype: str | None = None) -> tuple[DrafterConfig, DrafterParams, dict]:
    """(config, params, meta) of a drafter folder; refuses one built for another target."""
    manifest = ckpt.read_manifest(Path(path), FORMAT)
    where = Path(path) / ckpt.MANIFEST
    cfg = drafter_config(path, manifest)
    if target_cfg is not None:
        cfg.check_target(target_cfg)
    tensors = manifest.get("tensors")
    if isinstance(tensors, dict):
        held = 1 + len({m[1] for n in tensors if (m := re.match(r"layers\.(\d+)\.", n))})
        if held != cfg.num_layers:
            raise ckpt.CheckpointError(
                f"{where}: drafter config num_layers={cfg.num_layers} but the tensors hold "
                f"{held} layers; the manifest disagrees with its tensors: train or convert "
                "the drafter again")
    ckpt.check_tensor_shapes(where, cfg.target, drafter_dims(cfg), manifest.get("tensors"))
    flat = ckpt.restore_params(Path(path), manifest)
    if dtype is not None:
        flat = jax.tree.map(lambda a: a.astype(jnp.dtype(dtype)), flat)
    layers = tuple(LayerParams(**{f.name: flat.get(f"{_layer_prefix(i)}.{f.name}")
                                  for f in dataclasses.fields(LayerParams)})
                   for i in range(cfg.num_layers))
    return cfg, DrafterParams(fc=flat["fc"], layers=layers, fc_bias=flat.get("fc_bias"),
                              tap_fc=flat.get("tap_fc")), manifest.get("meta") or {}

