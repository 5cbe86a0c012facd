"""The Python API: :func:`load` a converted checkpoint, :func:`generate` from it."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checkpoint import load_target
from specjax.config import ModelConfig
from specjax.decode import PAD, bucket, decode_loop, decode_step_jit, prefill
from specjax.model import Params
from specjax.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class Target:
    """A loaded target model: what :func:`generate` needs."""

    cfg: ModelConfig
    params: Params
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    path: Path

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: config EOS and the tokenizer's EOS."""
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))


@dataclasses.dataclass
class GenerationResult:
    """Output of :func:`generate`: one entry per prompt, plus batch statistics."""

    texts: list[str]
    tokens: list[list[int]]  # new tokens only, EOS included when hit
    stats: dict[str, Any]

    @property
    def text(self) -> str:
        """The text of the first (often only) prompt."""
        return self.texts[0]


def load(path: str | Path, dtype: str | None = None) -> Target:
    """Load a folder written by ``specjax convert``.

    Args:
      dtype: cast parameters, e.g. "bfloat16"; None keeps the stored dtype.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    cfg, params = load_target(path, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() \
        or (path / "tokenizer.json").exists() else None
    return Target(cfg=cfg, params=params, tokenizer=tokenizer, path=path)


def encode_prompts(target: Target, prompts: str | list[str] | list[list[int]], chat: bool,
                   system: str | None = None) -> list[list[int]]:
    """Token ids per prompt; text goes through the chat template when ``chat``."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(p, list | tuple | np.ndarray) for p in prompts):
        ids = [list(map(int, p)) for p in prompts]
    elif all(isinstance(p, str) for p in prompts):
        tok = target.tokenizer
        if tok is None:
            raise ValueError(f"{target.path} has no tokenizer files; pass token ids instead")
        if chat and tok.chat_template is None:
            raise ValueError(f"{target.path}'s tokenizer has no chat template; pass chat=False")
        ids = []
        for p in prompts:
            if chat:
                msgs = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": p}]
                ids.append(list(tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)))
            else:
                ids.append(tok.encode(p))
    else:
        raise TypeError("prompts must be a str, a list of str, or a list of token-id lists")
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < target.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {target.cfg.vocab_size}): "
                             f"{bad[:5]}")
    return ids


def generate(target: Target, prompts: str | list[str] | list[list[int]], *,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, key: jax.Array | None = None, chat: bool = True,
             system: str | None = None, stop_on_eos: bool = True,
             mode: Literal["compiled", "eager"] = "compiled") -> GenerationResult:
    """Generate continuations of one or more prompts.

    Vanilla decoding is the default strategy. Speculative strategies are keyword
    options (drafter, vocabulary head, tree, verifier) layered on the same
    call: leaving them unset always means exact vanilla decoding.

    Args:
      prompts: text (rendered with the chat template when ``chat``) or token ids.
      max_new_tokens: budget of new tokens per prompt, EOS included.
      temperature: 0 for greedy; > 0 samples, with ``top_k``/``top_p`` filtering.
      seed, key: the PRNG key is ``key`` if given, else ``PRNGKey(seed)``.
      mode: "compiled" runs the decode in one ``lax.while_loop``; "eager" steps
        the same function from Python (for comparison and debugging).
    Returns:
      :class:`GenerationResult` with texts, new token ids and ``stats``
      (new_tokens, prefill_s, decode_s, wall_s, tokens_per_s, decode_tokens_per_s).
      The first call for a new shape bucket includes compilation in its times.
    """
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    if mode not in ("compiled", "eager"):
        raise ValueError(f"mode must be 'compiled' or 'eager', got {mode!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cfg = target.cfg
    ids = encode_prompts(target, prompts, chat, system)
    longest = max(map(len, ids))
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
            f"context of {cfg.max_position_embeddings}; shorten the prompt or lower "
            "max_new_tokens")
    p_len, out_len = bucket(longest), bucket(max_new_tokens)
    # One spare row: the step that finishes a row still writes one K/V row.
    capacity = p_len + out_len + 1
    prompt = np.zeros((len(ids), p_len), np.int32)
    for i, p in enumerate(ids):
        prompt[i, : len(p)] = p
    eos = jnp.asarray(target.eos_ids if stop_on_eos else [-2], jnp.int32)
    dyn = sampling.dynamic()
    static = sampling.static()
    key = jax.random.PRNGKey(seed) if key is None else key

    t0 = time.perf_counter()
    state = prefill(target.params, cfg, jnp.asarray(prompt), jnp.asarray([len(p) for p in ids]),
                    key, jnp.int32(max_new_tokens), eos, **dyn, sampling=static, out_len=out_len,
                    capacity=capacity)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    if mode == "compiled":
        state = decode_loop(target.params, cfg, state, eos, **dyn, sampling=static)
    else:
        while not bool(jnp.all(state.done)):
            state = decode_step_jit(target.params, cfg, state, eos, **dyn, sampling=static)
    out = np.asarray(state.out)
    t2 = time.perf_counter()

    tokens = [[int(t) for t in row if t != PAD] for row in out]
    texts = ([target.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
             if target.tokenizer is not None else [""] * len(tokens))
    new = sum(map(len, tokens))
    stats = {
        "new_tokens": new, "prompt_tokens": [len(p) for p in ids], "prefill_s": t1 - t0,
        "decode_s": t2 - t1, "wall_s": t2 - t0, "tokens_per_s": new / (t2 - t0),
        "decode_tokens_per_s": (new - len(ids)) / max(t2 - t1, 1e-9), "mode": mode,
    }
    return GenerationResult(texts=texts, tokens=tokens, stats=stats)
