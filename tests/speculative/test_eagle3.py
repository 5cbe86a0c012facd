"""EAGLE-3 drafters in the speculative loop: converted from HF form, fitted, and verified.

The loop reads an EAGLE-3 drafter through the same seam as EAGLE-1/2 (fused low / mid /
high target taps in place of the final hidden state, its own draft-vocabulary head), so
its greedy output must equal vanilla greedy output token for token, through the API and
through the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import specjax
from specjax.cli import main
from specjax.convert.eagle import convert_eagle3
from specjax.eagle3 import Eagle3Head, eagle3_fuse, eagle3_hidden, init_eagle3_cache
from specjax.model import forward_hidden, init_cache, lm_head
from tests.convert.test_eagle import make_eagle3
from tests.speculative.conftest import PROMPTS
from tests.tiny import make_hf_checkpoint

LAYERS = 8  # EAGLE-3 taps layers (1, L//2 - 1, L - 4): at least 8


@pytest.fixture(scope="module")
def target8(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_target")
    src = make_hf_checkpoint(root / "hf", "llama", num_hidden_layers=LAYERS)
    return specjax.load(specjax.convert(src, root / "sj", progress=False))


def fit_eagle3(target, drafter, seqs: list[list[int]], steps: int = 300):
    """Fit an EAGLE-3 drafter's weights to the target's next-token distributions.

    Teacher-forced, as EAGLE-3's first training step: row t reads x_t and the fused taps
    at t-1, and its head should predict the target's distribution over x_{t+1}. Its draft
    vocabulary must be the target's whole vocabulary (the teacher is not renormalised).
    """
    t, cfg = target, drafter.cfg
    assert cfg.draft_vocab_size == t.cfg.vocab_size
    n = max(map(len, seqs))
    tokens = np.zeros((len(seqs), n), np.int32)
    mask = np.zeros((len(seqs), n), bool)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)], mask[i, : len(s)] = s, True
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    pos = jnp.broadcast_to(jnp.arange(n), tokens.shape)
    hidden, _, taps = forward_hidden(t.params, t.cfg, tokens, pos,
                                     init_cache(t.cfg, len(seqs), n),
                                     tap_layers=cfg.tap_layers(t.cfg))
    teacher = jax.nn.softmax(lm_head(t.params, hidden), -1)
    # The identity map has d2t = 0: draft id i is target id i, so logits line up.
    float_params = {f.name: getattr(drafter.params, f.name)
                    for f in dataclasses.fields(drafter.params)
                    if f.name not in ("d2t", "t2d") and getattr(drafter.params, f.name) is not None}

    def loss_fn(fp):
        p = dataclasses.replace(drafter.params, **fp)
        feats = eagle3_fuse(p, taps)
        shifted = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :-1]], axis=1)
        h, _ = eagle3_hidden(p, cfg, t.params.embed, tokens, shifted, pos,
                             init_eagle3_cache(cfg, len(seqs), n))
        logp = jax.nn.log_softmax(Eagle3Head.of(p, cfg)(None, h, 0).logits, -1)
        return jnp.sum(-jnp.sum(teacher * logp, -1) * mask) / mask.sum()

    opt = optax.adam(3e-3)

    @jax.jit
    def step(fp, state):
        loss, grads = jax.value_and_grad(loss_fn)(fp)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(fp, updates), state, loss

    fp, state = float_params, opt.init(float_params)
    for _ in range(steps):
        fp, state, _ = step(fp, state)
    return dataclasses.replace(drafter, params=dataclasses.replace(drafter.params, **fp))


@pytest.fixture(scope="module")
def eagle3_drafter(target8, tmp_path_factory):
    """A converted EAGLE-3 drafter (full draft vocabulary) fitted to the tiny target."""
    root = tmp_path_factory.mktemp("eagle3")
    v = target8.cfg.vocab_size
    src, _, _ = make_eagle3(root / "src", draft_vocab=v, vocab_size=v)
    out = convert_eagle3(src, root / "out", target_cfg=target8.cfg, progress=False)
    drafter = specjax.load_drafter(out, target8)
    rs = np.random.RandomState(0)
    prompts = PROMPTS + [rs.randint(3, v, rs.randint(3, 9)).tolist() for _ in range(13)]
    gens = specjax.generate(target8, prompts, max_new_tokens=48, stop_on_eos=False).tokens
    return fit_eagle3(target8, drafter, [p + g for p, g in zip(prompts, gens, strict=True)])


@pytest.mark.parametrize("tree", [specjax.TreeSpec("chain", depth=3),
                                  specjax.TreeSpec("eagle2", depth=3, top_k=3, total_tokens=8)],
                         ids=["chain3", "eagle2"])
def test_eagle3_greedy_equals_vanilla(target8, eagle3_drafter, tree):
    want = specjax.generate(target8, PROMPTS, max_new_tokens=32, stop_on_eos=False)
    got = specjax.generate(target8, PROMPTS, max_new_tokens=32, stop_on_eos=False,
                           drafter=eagle3_drafter, tree=tree)
    assert got.tokens == want.tokens
    assert got.stats["vocab"] == "eagle3"
    # Accepted paths (not only bonus tokens) went through the fused-tap catch-up.
    assert got.stats["mean_accepted_length"] > 1.5, got.stats["mean_accepted_length"]


def test_eagle3_refuses_shortlist_heads(target8, eagle3_drafter):
    with pytest.raises(ValueError, match="own .*vocabulary; use .full."):
        specjax.generate(target8, PROMPTS[:1], max_new_tokens=4, drafter=eagle3_drafter,
                         vocab="fr:64")


def test_cli_generates_with_an_eagle3_drafter(smollm2_dir, tmp_path, capsys):
    """`specjax generate --drafter EAGLE3_FOLDER`: an imported EAGLE-3 drafter (random, with
    its own narrower width and embedding) drafts for a tiny target that shares SmolLM2's
    tokenizer; greedy output equals `--drafter none`."""
    hf = make_hf_checkpoint(tmp_path / "hf", "llama", num_hidden_layers=LAYERS,
                            vocab_size=49152, tie_word_embeddings=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, hf / name)
    target_dir = specjax.convert(hf, tmp_path / "target", progress=False)
    src, _, _ = make_eagle3(tmp_path / "e3", vocab_size=49152, draft_vocab=512, hidden_size=32,
                            target_hidden_size=64)
    assert main(["convert", str(src), str(tmp_path / "drafter")]) == 0
    runs = {}
    for drafter in ("none", str(tmp_path / "drafter")):
        capsys.readouterr()
        assert main(["generate", "--model", str(target_dir), "--drafter", drafter,
                     "--prompt", "Name a colour.", "--max-new-tokens", "12", "--tree", "chain",
                     "--tree-depth", "2", "--json"]) == 0
        runs[drafter] = json.loads(capsys.readouterr().out)
    spec = runs[str(tmp_path / "drafter")]
    assert spec["tokens"] == runs["none"]["tokens"] and len(spec["tokens"]) == 12
    assert spec["stats"]["vocab"] == "eagle3"
