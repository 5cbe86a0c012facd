"""The Python API: :func:`load` a converted checkpoint, :func:`generate` from it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from specjax import drafter as drafter_lib
from specjax import eagle3
from specjax import sharding as sh
from specjax._checks import check_bool, check_int, check_real, check_seed, check_text
from specjax.checkpoint import CheckpointError, load_target, read_manifest
from specjax.compile_cache import CompileTimer, release_programs_near_map_limit
from specjax.loaded import Drafter, Target
from specjax.loop import PAD
from specjax.model import fuse_params, to_out_major
from specjax.runner import Request, SpecRunner, VanillaRunner, all_done
from specjax.sampling import SamplingConfig
from specjax.speculative import TreeSpec
from specjax.tokenizer import load_tokenizer, render_chat
from specjax.tree.default import read_defaults
from specjax.vocab import VocabHead, resolve_head

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION = ("dense", "xla", "pallas", "auto")


@dataclasses.dataclass
class GenerationResult:
    """Output of :func:`generate`: one entry per prompt, plus batch statistics."""

    texts: list[str]
    tokens: list[list[int]]  # new tokens only, EOS included when hit
    stats: dict[str, Any]
    # A stateful vocabulary head's state after the run (EvoSpec's buffers, one per prompt);
    # pass it as the next call's ``vocab_state`` to keep adapting. None for other heads.
    vocab_state: Any = None

    @property
    def text(self) -> str:
        """The text of the first (often only) prompt."""
        return self.texts[0]


def load(path: str | Path, dtype: str | None = None,
         mesh: sh.Mesh | str | None = None) -> Target:
    """Load a folder written by ``specjax convert``.

    The tokenizer is loaded with :func:`specjax.tokenizer.load_tokenizer`, which never
    runs code from the folder: a folder whose tokenizer asks for custom code is refused.

    Args:
      dtype: cast parameters, e.g. "bfloat16"; None keeps the stored dtype.
      mesh: a :class:`jax.sharding.Mesh` over ``("data", "model")`` or a string such as
        ``"data=2,model=4"`` (:mod:`specjax.sharding`): every tensor is restored straight
        into its sharding, with no host copy of the whole model (only the tensors being
        read pass whole through memory; docs/benchmarks.md, issue 17). Pass the same mesh
        to :func:`generate`.
    """
    if not isinstance(path, str | Path):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or None, got {dtype!r}")
    path = Path(path)
    read_manifest(path)  # cheap: a folder that is no checkpoint is refused first
    # The tokenizer next: a folder that asks to run code is refused before its tensors
    # are read.
    tokenizer = load_tokenizer(path)
    mesh = sh.as_mesh(mesh)
    cfg, params = load_target(path, dtype, mesh)
    if mesh is None or sh.axis_size(mesh, "model") == 1:
        # Q/K/V and gate/up as one product each (the inference layout); a model axis keeps
        # them apart so they split on head and MLP boundaries (specjax.sharding.RULES).
        params = fuse_params(params)
    if mesh is None and _rowdot_pays(params):
        # Each layer's products stored [out, in] for the CPU rowdot kernel: a verify step's
        # rows then cost little more than one (docs/benchmarks.md, issue 10).
        params = to_out_major(params)
    if mesh is not None:
        params = sh.shard_params(params, mesh)  # a no-op but for the fused layers' placement
    return Target(cfg=cfg, params=params, tokenizer=tokenizer, path=path)


def _rowdot_pays(params: Any) -> bool:
    """float32 weights whose widths the kernel takes, on a CPU backend with the kernel built
    (and ``SPECJAX_CPU_ROWDOT`` not off)."""
    from specjax.kernels.cpu_rowdot import use_rowdot

    lp = params.layers[0]
    probe = jnp.zeros((1, lp.wqkv.shape[0]), params.embed.dtype)
    return all(w.shape[0] % 16 == 0 and w.dtype == jnp.float32
               for p in params.layers for w in (p.wqkv, p.wo, p.w_gate_up, p.w_down)) and \
        use_rowdot(probe, lp.wqkv.T)


def _is_id(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _token_ids(i: int, p: Any) -> list[int]:
    """Prompt ``i`` given as token ids: a list/tuple of ints or a 1-D integer array."""
    if isinstance(p, np.ndarray | jax.Array):
        a = np.asarray(p)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise TypeError(f"prompt {i} must be a 1-D integer array of token ids, got "
                            f"{a.dtype} {a.shape}")
        return a.astype(np.int64).tolist()
    bad = next((x for x in p if not _is_id(x)), None)
    if bad is not None:
        raise TypeError(f"prompt {i} must hold int token ids, found {type(bad).__name__} "
                        f"{bad!r}")
    return [int(x) for x in p]


def encode_prompts(target: Target, prompts: str | list[str] | list[list[int]], chat: bool,
                   system: str | None = None) -> list[list[int]]:
    """Token ids per prompt; text goes through the chat template when ``chat``.

    Raises TypeError for prompts of the wrong type (naming which), ValueError for an
    empty batch, an empty prompt, text that is not valid UTF-8, token ids outside the
    vocabulary, or a chat template that fails.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray | jax.Array):
        if prompts.ndim != 2:
            raise TypeError(f"a token-id array of prompts must be 2-D [batch, length], got "
                            f"shape {prompts.shape}")
        prompts = list(np.asarray(prompts))
    if not isinstance(prompts, list | tuple):
        raise TypeError("prompts must be a str, a list of str, or a list of token-id lists "
                        f"(e.g. [[1, 2, 3]]), got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("no prompts given: pass a str, a non-empty list of str, or a "
                         "non-empty list of token-id lists")
    if all(_is_id(p) for p in prompts):
        raise TypeError("prompts is a flat list of ints; pass token ids as one list per "
                        f"prompt, e.g. [{list(prompts[:3])}]")
    if all(isinstance(p, list | tuple | np.ndarray | jax.Array) for p in prompts):
        ids = [_token_ids(i, p) for i, p in enumerate(prompts)]
    elif all(isinstance(p, str) for p in prompts):
        texts = [check_text(f"prompt {i}", p) for i, p in enumerate(prompts)]
        if system is not None:
            check_text("system", system)
        tok = target.tokenizer
        if tok is None:
            raise ValueError(f"{target.path} has no tokenizer files; pass token ids instead")
        if chat and tok.chat_template is None:
            raise ValueError(f"{target.path}'s tokenizer has no chat template (a base model, "
                             "e.g. gemma3-270m); pass chat=False (--no-chat)")
        ids = []
        for p in texts:
            if chat:
                msgs = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": p}]
                ids.append(list(render_chat(tok, msgs, where=str(target.path),
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)))
            else:
                ids.append(tok.encode(p))
    else:
        kinds = sorted({type(p).__name__ for p in prompts})
        raise TypeError("prompts must be a str, a list of str, or a list of token-id lists; "
                        f"got a list of {', '.join(kinds)}")
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < target.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {target.cfg.vocab_size}): "
                             f"{bad[:5]}")
    return ids


def load_drafter(path: str | Path, target: Target, dtype: str | None = None) -> Drafter:
    """Load a drafter folder; refuses one built for a target of another shape."""
    if not isinstance(target, Target):
        raise TypeError("target must be a Target from specjax.load(path), got "
                        f"{type(target).__name__}")
    if not isinstance(path, str | Path):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    dtype = dtype or str(target.params.embed.dtype)
    manifest = read_manifest(Path(path), fmt=None)
    read = {drafter_lib.FORMAT: drafter_lib.read_drafter,
            eagle3.FORMAT: eagle3.read_eagle3}.get(manifest.get("format"))
    if read is None:
        raise CheckpointError(
            f"{path} is a {manifest.get('format')!r} folder, not a drafter; convert an EAGLE "
            "drafter with `specjax convert EAGLE_FOLDER OUT` or train one with "
            "`specjax train drafter`")
    cfg, params, meta = read(Path(path), target.cfg, dtype)
    d = read_defaults(path)
    return Drafter(cfg=cfg, params=params, path=Path(path), meta=meta, default_tree=d.tree,
                   default_vocab=d.vocab, sampled_trees=d.sampled_trees,
                   batch_trees=d.batch_trees, sampled_batch_trees=d.sampled_batch_trees)


def check_generate_args(target: Any, *, max_new_tokens: Any, temperature: Any, top_k: Any,
                        top_p: Any, seed: Any, key: Any, chat: Any, system: Any,
                        stop_on_eos: Any, mode: Any, drafter: Any, tree: Any,
                        assume_q_one: Any, vocab: Any,
                        disable_by_batch_size: Any = None) -> tuple[int, int]:
    """Refuse :func:`generate` arguments of the wrong type or range, naming the argument.

    Everything is checked before any work (no tokenizer call, no compile), so a bad value
    costs nothing. Returns ``(max_new_tokens, seed)`` as plain ints.
    """
    if not isinstance(target, Target):
        raise TypeError("target must be a Target from specjax.load(path), got "
                        f"{type(target).__name__}")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1,
                               hint="the number of new tokens to generate per prompt")
    check_real("temperature", temperature, minimum=0.0, hint="0 = greedy")
    v = target.cfg.vocab_size
    check_int("top_k", top_k, minimum=0, maximum=v,
              hint=f"0 = off; the vocabulary has {v} tokens")
    check_real("top_p", top_p, minimum=0.0, maximum=1.0, open_min=True, hint="1 = off")
    seed = check_seed("seed", seed)
    if key is not None:
        k = key if isinstance(key, jax.Array) else None
        typed = k is not None and jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)
        raw = k is not None and k.shape == (2,) and k.dtype == jnp.uint32
        if not (typed and k.shape == ()) and not raw:
            raise TypeError("key must be one PRNG key, jax.random.PRNGKey(seed) or "
                            f"jax.random.key(seed); got {type(key).__name__} "
                            f"{getattr(key, 'dtype', '')}{tuple(getattr(key, 'shape', ()))}")
    for name, value in (("chat", chat), ("stop_on_eos", stop_on_eos),
                        ("assume_q_one", assume_q_one)):
        check_bool(name, value)
    if system is not None and not isinstance(system, str):
        raise TypeError(f"system must be a str or None, got {type(system).__name__}")
    if mode not in ("compiled", "eager"):
        raise ValueError(f"mode must be 'compiled' or 'eager', got {mode!r}")
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError("drafter must be a Drafter from specjax.load_drafter(path, target) or "
                        f"None, got {type(drafter).__name__}")
    if tree is not None and not isinstance(tree, TreeSpec):
        raise TypeError(f"tree must be a specjax.TreeSpec or None, got {type(tree).__name__}")
    if not (vocab is None or isinstance(vocab, str)
            or (callable(vocab) and hasattr(vocab, "capacity"))):
        raise TypeError("vocab must be a spec string ('full', 'fr:N', 'dynaspec', ...) or a "
                        f"VocabHead, got {type(vocab).__name__}")
    if disable_by_batch_size is not None:
        check_int("disable_by_batch_size", disable_by_batch_size, minimum=0,
                  hint="0 = never; N = decode without the drafter from N rows on")
    return max_new_tokens, seed


def generate(target: Target, prompts: str | list[str] | list[list[int]], *,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, key: jax.Array | None = None, chat: bool = True,
             system: str | None = None, stop_on_eos: bool = True,
             mode: Literal["compiled", "eager"] = "compiled", drafter: Drafter | None = None,
             tree: TreeSpec | None = None, assume_q_one: bool = False,
             vocab: str | VocabHead | None = None, attention: str = "dense",
             vocab_state: Any = None, mesh: sh.Mesh | str | None = None,
             disable_by_batch_size: int | None = None) -> GenerationResult:
    """Generate continuations of one or more prompts.

    Without a ``drafter`` this is vanilla decoding. With one, it is speculative
    decoding: the drafter proposes a ``tree`` of tokens and the target verifies
    it over the full vocabulary, so greedy output equals vanilla greedy output
    and sampled output has the target's distribution.

    Args:
      prompts: text (rendered with the chat template when ``chat``) or token ids.
      max_new_tokens: budget of new tokens per prompt, EOS included.
      temperature: 0 for greedy; > 0 samples, with ``top_k``/``top_p`` filtering.
      seed, key: the PRNG key is ``key`` if given, else ``PRNGKey(seed)``.
      mode: "compiled" runs the decode in one ``lax.while_loop``; "eager" steps
        the same functions from Python (for comparison, debugging and per-phase
        timing).
      drafter: from :func:`load_drafter`; None for vanilla decoding.
      tree: the draft tree; default the drafter's measured one (``drafter.tree_for``:
        from its folder's ``default_tree.json``: at a batch of several rows the one
        measured for that batch size where the file has batch defaults (at ``temperature``
        > 0 its sampled batch defaults measured at the temperature nearest it, where it
        has them); else, when ``temperature`` > 0 and the file has trees for sampling, the
        one measured at the temperature nearest it), else ``TreeSpec()`` (a small EAGLE-2
        tree).
      assume_q_one: EAGLE's verification shortcut for sampled drafts (see
        :class:`specjax.speculative.SpecConfig`); off by default.
      vocab: the drafter's vocabulary head: "full", "fr:N", "pafr:N", "dynaspec",
        "dynaspec-f", ... (see :func:`specjax.vocab.resolve_head`) or a
        :class:`specjax.vocab.VocabHead`; default the drafter's measured one
        (``drafter.default_vocab``, stored with its default tree), else "full".
        Verification is always over the full vocabulary, so this changes speed and
        acceptance, never correctness. A spec string is resolved on every call (its
        counts or router read from disk, the head's rows gathered); in a loop, build the
        head once with ``resolve_head``.
      attention: how the tree blocks of a speculative step attend: "dense" (default), or
        :func:`specjax.kernels.tree_attention.tree_attention`'s "xla", "pallas" or "auto"
        (the Pallas kernel on a GPU, XLA elsewhere). Same outputs, other kernels.
      vocab_state: for a stateful head (EvoSpec), the ``vocab_state`` of an earlier
        result to start from (same batch size), so the dynamic vocabulary carries over
        between requests; None starts empty.
      mesh: run SPMD over a device mesh (:mod:`specjax.sharding`): a
        :class:`jax.sharding.Mesh` over ``("data", "model")`` or a string such as
        ``"data=2,model=4"``. Batch rows split over ``data`` (a batch that is not a
        multiple of it is padded with rows that stop after one token, then dropped);
        heads, MLP columns, the vocabulary and the KV cache over ``model``. Greedy tokens
        equal the single-device run's. The target, drafter and head are placed on the
        mesh on every call unless already there: load with ``load(path, mesh=...)``.
      disable_by_batch_size: decode without the drafter from this many rows on (rows per
        ``data`` shard with a mesh): a verify forward over rows x tree nodes turns
        compute-bound as the batch grows, and past some size speculation is slower than
        vanilla decoding (vLLM's option of the same name). The output is the same either
        way (greedy tokens; sampled, the target's distribution). None (default): where the
        drafter's folder measured batches (``specjax bench batch --save-default-tree``;
        at ``temperature`` > 0 the sampled batches measured nearest it where it measured
        them) and ``tree`` is left to the drafter, where the entry of the largest measured
        size <= the rows is vanilla decoding (no tree was faster there), and above the
        largest measured size (no tree was measured there); 0: never.
        ``stats["speculation_off"]`` says why when off.
    Returns:
      :class:`GenerationResult` with texts, new token ids and ``stats``
      (new_tokens, prefill_s, decode_s, wall_s, tokens_per_s, decode_tokens_per_s;
      speculative runs add accept_lengths, mean_accepted_length (tokens
      committed per target forward, the bonus token included), draft_s and
      verify_s (eager mode only), vocab, mean_shortlist_size (valid candidates per
      expanded node), shortlist_coverage (the fraction of steps whose first
      committed token was in the root's shortlist), mean_tree_size (valid tree nodes
      per step, root included), mean_drafter_calls (per step) and chained_fraction (the
      fraction of steps that verified a lookup chain)). ``compile_s`` is the time spent
      compiling (or loading from the persistent cache, see :mod:`specjax.compile_cache`)
      during the call, ``prefill_compile_s`` the part of it inside ``prefill_s``,
      ``compiles`` how many programs; ``decode_tokens_per_s`` leaves the decode loop's
      compile time out, ``wall_s`` and ``tokens_per_s`` include it.
    """
    max_new_tokens, seed = check_generate_args(
        target, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, key=key, chat=chat, system=system, stop_on_eos=stop_on_eos,
        mode=mode, drafter=drafter, tree=tree, assume_q_one=assume_q_one, vocab=vocab,
        disable_by_batch_size=disable_by_batch_size)
    mesh = sh.as_mesh(mesh)
    ids = encode_prompts(target, prompts, chat, system)
    n = len(ids)
    # Rows a device decodes: the batch, or its share of the mesh's data axis.
    rows = -(-n // (1 if mesh is None else sh.axis_size(mesh, "data")))
    off = _speculation_off(drafter, tree, rows, disable_by_batch_size, temperature)
    if off is not None:
        drafter, tree, vocab, attention = None, None, None, "dense"
    target, drafter = _on_mesh(target, drafter, mesh)
    runner, req = _plan(target, _pad_rows(ids, mesh), max_new_tokens=max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, key=key,
                        stop_on_eos=stop_on_eos, drafter=drafter, tree=tree,
                        assume_q_one=assume_q_one, vocab=vocab, attention=attention,
                        rows=rows)
    if vocab_state is not None and off is None:
        _check_vocab_state(runner, vocab_state, n)
        runner.vocab_state = _pad_state(runner.head, vocab_state, req.prompt.shape[0])
    runner, req = _runner_on_mesh(runner, req, n, mesh)
    release_programs_near_map_limit()
    t0 = time.perf_counter()
    with CompileTimer() as compiled, sh.use_mesh(mesh):  # compile time apart from speed
        state = jax.block_until_ready(runner.prefill(req))
        t1 = time.perf_counter()
        if mode == "compiled":
            state = runner.run(state)
        else:
            while not all_done(state):
                state = runner.step(state)
        out = sh.to_host(state.output.tokens)[:n]
    t2 = time.perf_counter()
    decode_compile_s = compiled.since(t1)
    if mesh is not None:
        state = _first_rows(state, n)

    tokens = [[int(t) for t in row if t != PAD] for row in out]
    texts = ([target.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
             if target.tokenizer is not None else [""] * len(tokens))
    new = sum(map(len, tokens))
    stats = {"prefill_s": t1 - t0, "decode_s": t2 - t1, **runner.stats(state)}
    if drafter is not None:
        eager = mode == "eager"
        stats |= {"draft_s": runner.draft_s if eager else None,
                  "verify_s": runner.verify_s if eager else None}
    stats |= {
        "new_tokens": new, "prompt_tokens": [len(p) for p in ids],
        "wall_s": t2 - t0, "tokens_per_s": new / (t2 - t0),
        "decode_tokens_per_s": (new - len(ids)) / max(t2 - t1 - decode_compile_s, 1e-9),
        "mode": mode, "compile_s": compiled.seconds, "compiles": compiled.backend_compiles,
        "prefill_compile_s": compiled.seconds - decode_compile_s,
    }
    if mesh is not None:
        stats["mesh"] = dict(mesh.shape)
    if off is not None:
        stats["speculation_off"] = off
    return GenerationResult(texts=texts, tokens=tokens, stats=stats,
                            vocab_state=vocab_state if off is not None
                            else getattr(state, "vocab", None))


def _speculation_off(drafter: Drafter | None, tree: TreeSpec | None, rows: int,
                     disable_by_batch_size: int | None, temperature: float) -> str | None:
    """Why :func:`generate` decodes ``rows`` rows a device without ``drafter`` (see its
    ``disable_by_batch_size``), or None where it speculates."""
    if drafter is None:
        return None
    if disable_by_batch_size is not None:
        if disable_by_batch_size and rows >= disable_by_batch_size:
            return (f"{rows} rows >= disable_by_batch_size={disable_by_batch_size}: decoded "
                    "without the drafter")
        return None
    if tree is None and not drafter.speculates_at(rows, temperature):
        table = drafter.batch_table(temperature)
        largest = table[-1][0]
        why = ("stores vanilla decoding for this batch size (no tree was measured faster "
               "here, or at a smaller size)" if rows <= largest or table[-1][1] is None
               else f"measured trees up to {largest} rows only, none at this batch size")
        t = drafter.batch_table_temperature(temperature)  # which table said so
        source = ("default_tree.json" if t is None
                  else f"default_tree.json's table for sampling at temperature {t:g}")
        return (f"{rows} rows: the drafter's folder {why} ({source}, `specjax bench batch`); "
                "decoded without the drafter (pass disable_by_batch_size=0 to speculate "
                "anyway)")
    return None


def _on_mesh(target: Target, drafter: Drafter | None,
             mesh: sh.Mesh | None) -> tuple[Target, Drafter | None]:
    """The target and drafter with their parameters on ``mesh`` (unchanged without one)."""
    if mesh is None:
        return target, drafter
    target = dataclasses.replace(target, params=sh.shard_params(target.params, mesh))
    if drafter is not None:
        drafter = dataclasses.replace(drafter, params=sh.shard_params(drafter.params, mesh))
    return target, drafter


def _pad_rows(ids: list[list[int]], mesh: sh.Mesh | None) -> list[list[int]]:
    """``ids`` plus copies of the first prompt up to a multiple of the ``data`` axis.

    The copies are padding rows: :func:`_runner_on_mesh` gives them a budget of one token,
    so they are done after the prefill and never grow; generate drops them.
    """
    data = 1 if mesh is None else sh.axis_size(mesh, "data")
    return ids + [ids[0]] * (-len(ids) % data)


def _pad_state(head: Any, vocab_state: Any, rows: int) -> Any:
    """A stateful head's state with fresh rows appended up to ``rows`` (padding rows)."""
    extra = rows - jax.tree.leaves(vocab_state)[0].shape[0]
    if extra == 0:
        return vocab_state
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), vocab_state,
                        head.init_state(extra))


def _runner_on_mesh(runner: VanillaRunner | SpecRunner, req: Request, n: int,
                    mesh: sh.Mesh | None) -> tuple[VanillaRunner | SpecRunner, Request]:
    """The head and the request placed on ``mesh``; padding rows past ``n`` stop at once."""
    if mesh is None:
        return runner, req
    limits = dataclasses.replace(req.limits, max_new=req.limits.max_new.at[n:].set(1))
    # prompt [B, P] and prompt_lens [B] split by row, like every per-row loop-state array.
    req = dataclasses.replace(req, prompt=sh.shard_tree(req.prompt, mesh, sh.state_axes),
                              prompt_lens=sh.shard_tree(req.prompt_lens, mesh, sh.state_axes),
                              limits=sh.shard_tree(limits, mesh, sh.state_axes))
    if isinstance(runner, SpecRunner):
        runner.head = sh.shard_head(runner.head, mesh)
        if runner.vocab_state is not None:
            runner.vocab_state = sh.shard_tree(runner.vocab_state, mesh, sh.state_axes)
    return runner, req


def _first_rows(state: Any, n: int) -> Any:
    """``state``'s statistics and head state cut to the first ``n`` (real) rows, on the host
    (gathered from every host's shards in a multi-host run)."""
    cut = {f: jax.tree.map(lambda a: sh.to_host(a)[:n], getattr(state, f))
           for f in ("stats", "vocab") if getattr(state, f, None) is not None}
    return dataclasses.replace(state, **cut) if cut else state


def _check_vocab_state(runner: Any, vocab_state: Any, batch: int) -> None:
    """Refuse a ``vocab_state`` that the run's head cannot continue from."""
    head = getattr(runner, "head", None)
    if head is None or not head.stateful:
        raise ValueError("vocab_state continues a stateful vocabulary head (vocab='evospec'); "
                         f"this run's head is {getattr(head, 'name', 'none (vanilla)')}")
    fresh = head.init_state(1)
    if jax.tree.structure(vocab_state) != jax.tree.structure(fresh):
        raise ValueError(f"vocab_state does not have the {head.name} head's structure; pass "
                         "the vocab_state of a result made with the same head")
    rows = {leaf.shape[0] for leaf in jax.tree.leaves(vocab_state)}
    if rows != {batch}:
        raise ValueError(f"vocab_state holds {sorted(rows)} rows but this call has {batch} "
                         "prompts; pass one state row per prompt")
    if [x.shape[1:] for x in jax.tree.leaves(vocab_state)] != [
            x.shape[1:] for x in jax.tree.leaves(fresh)]:
        raise ValueError(f"vocab_state was made with another buffer size than {head.name}'s")


def _plan(target: Target, ids: list[list[int]], *, max_new_tokens: int, temperature: float,
          top_k: int, top_p: float, seed: int, key: jax.Array | None, stop_on_eos: bool,
          drafter: Drafter | None, tree: TreeSpec | None, assume_q_one: bool,
          vocab: str | VocabHead | None, attention: str = "dense",
          rows: int = 1) -> tuple[VanillaRunner | SpecRunner, Request]:
    """The runner and the laid-out request for checked arguments and encoded prompts;
    ``rows``: the rows a device decodes, which picks the drafter's default tree."""
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    if drafter is None and (tree is not None or vocab not in (None, "full")
                            or attention != "dense"):
        raise ValueError("a draft tree, vocabulary head or tree attention needs a drafter; "
                         "pass drafter=load_drafter(...) (--drafter PATH on the command line)")
    runner: VanillaRunner | SpecRunner = VanillaRunner(target, sampling)
    if drafter is not None:
        drafter.cfg.check_target(target.cfg)
        tree = tree or drafter.tree_for(temperature, batch=rows)
        vocab = vocab or drafter.default_vocab or "full"
        runner = SpecRunner.of(target, drafter, resolve_head(vocab, target, drafter), tree,
                               sampling, assume_q_one, attention)
    req = Request.build(target, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                        stop_on_eos=stop_on_eos, tree=tree,
                        key=jax.random.PRNGKey(seed) if key is None else key)
    return runner, req


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What :func:`stream` yields after each step: the text and tokens it committed."""

    text: str  # new text (possibly "" while a multi-byte character is incomplete)
    tokens: list[int]  # the token ids committed by this step (EOS included when hit)

    def __str__(self) -> str:
        return self.text


def stream(target: Target, prompt: str | list[int], *, max_new_tokens: int = 128,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
           key: jax.Array | None = None, chat: bool = True, system: str | None = None,
           stop_on_eos: bool = True, drafter: Drafter | None = None,
           tree: TreeSpec | None = None, assume_q_one: bool = False,
           vocab: str | VocabHead | None = None, attention: str = "dense") -> Iterator[Chunk]:
    """Generate from one prompt, yielding text as it is committed.

    The arguments are :func:`generate`'s (for one prompt). It runs the same prefill and
    the same step function as ``generate(..., mode="eager")``, one step per iteration,
    so the tokens equal ``generate``'s, compiled or eager, token for token. A vanilla
    step commits one token; a speculative step commits the accepted drafts and the bonus
    token. Text is decoded from all tokens so far and a trailing incomplete character
    is held back until the next step completes it.
    """
    one = isinstance(prompt, str) or (isinstance(prompt, list | tuple) and prompt
                                      and all(_is_id(x) for x in prompt))
    if not one:
        raise TypeError("stream takes one prompt: a str or a list of token ids; for a batch, "
                        "call generate")
    prompts = [prompt]
    max_new_tokens, seed = check_generate_args(
        target, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, key=key, chat=chat, system=system, stop_on_eos=stop_on_eos,
        mode="eager", drafter=drafter, tree=tree, assume_q_one=assume_q_one, vocab=vocab)
    ids = encode_prompts(target, prompts, chat, system)
    runner, req = _plan(target, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, key=key, stop_on_eos=stop_on_eos,
                        drafter=drafter, tree=tree, assume_q_one=assume_q_one, vocab=vocab,
                        attention=attention)
    decode = ((lambda t: target.tokenizer.decode(t, skip_special_tokens=True))
              if target.tokenizer is not None else (lambda t: ""))
    tokens: list[int] = []
    shown = ""
    state = runner.prefill(req)
    while True:
        n = int(state.output.num_new[0])
        new = [int(t) for t in np.asarray(state.output.tokens[0, len(tokens):n])]
        tokens += new
        done = all_done(state)
        text = decode(tokens)
        # Hold back a trailing U+FFFD: the bytes of a character split across tokens.
        ready = text if done else text.rstrip("\ufffd")
        if new or (done and ready != shown):
            piece, shown = ready[len(shown):], ready
            yield Chunk(text=piece, tokens=new)
        if done:
            return
        state = runner.step(state)
