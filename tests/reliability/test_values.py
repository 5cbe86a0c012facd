"""Bad values: wrong types and out-of-range or non-finite numbers are refused by name.

The API's argument checks run before any tokenizer call or compile, so hypothesis can try
many values cheaply. The CLI checks its flags before it loads a model.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specjax
from specjax.cli import main
from specjax.speculative import TreeSpec
from specjax.vocab import resolve_head
from tests.reliability.conftest import snapshot

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

not_ints = st.one_of(st.text(max_size=5), st.floats(allow_nan=True), st.booleans(), st.none(),
                     st.lists(st.integers(), max_size=2))
not_numbers = st.one_of(st.text(max_size=5), st.booleans(), st.none(),
                        st.lists(st.floats(), max_size=2))
non_finite = st.sampled_from([math.inf, -math.inf, math.nan])


def _refused(target, exc, name, **kw):
    prompts = kw.pop("prompts", [[1, 2, 3]])
    with pytest.raises(exc) as e:
        specjax.generate(target, prompts, **kw)
    assert name in str(e.value), str(e.value)


@SETTINGS
@given(value=not_ints)
def test_max_new_tokens_of_the_wrong_type(rel_target, value):
    _refused(rel_target, TypeError, "max_new_tokens", max_new_tokens=value)


@SETTINGS
@given(value=st.integers(max_value=0))
def test_max_new_tokens_below_one(rel_target, value):
    _refused(rel_target, ValueError, "max_new_tokens must be >= 1", max_new_tokens=value)


@SETTINGS
@given(name=st.sampled_from(["temperature", "top_p"]), value=not_numbers)
def test_sampling_numbers_of_the_wrong_type(rel_target, name, value):
    _refused(rel_target, TypeError, name, **{name: value})


@SETTINGS
@given(name=st.sampled_from(["temperature", "top_p"]), value=non_finite)
def test_non_finite_sampling_numbers(rel_target, name, value):
    _refused(rel_target, ValueError, f"{name} must be a finite number", **{name: value})


@SETTINGS
@given(temperature=st.floats(max_value=-1e-9, allow_infinity=False))
def test_negative_temperature(rel_target, temperature):
    _refused(rel_target, ValueError, "temperature must be >= 0", temperature=temperature)


@SETTINGS
@given(top_p=st.one_of(st.floats(max_value=0.0, allow_infinity=False),
                       st.floats(min_value=1.0, exclude_min=True, allow_infinity=False)))
def test_top_p_outside_the_unit_interval(rel_target, top_p):
    _refused(rel_target, ValueError, "top_p must be in (0, 1]", top_p=top_p, temperature=1.0)


@SETTINGS
@given(top_k=st.one_of(st.integers(max_value=-1), st.integers(min_value=257)))
def test_top_k_outside_the_vocabulary(rel_target, top_k):
    _refused(rel_target, ValueError, "top_k must be", top_k=top_k, temperature=1.0)


@SETTINGS
@given(seed=st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63) - 1)))
def test_seeds_beyond_64_bits(rel_target, seed):
    _refused(rel_target, ValueError, "seed must be", seed=seed, temperature=1.0)


@SETTINGS
@given(prompts=st.one_of(st.integers(), st.none(), st.floats(), st.dictionaries(st.text(),
                                                                               st.text()),
                         st.lists(st.one_of(st.none(), st.floats()), min_size=1, max_size=3)))
def test_prompts_of_the_wrong_type(rel_target, prompts):
    _refused(rel_target, TypeError, "prompt", prompts=prompts)


@SETTINGS
@given(text=st.text(max_size=8), cut=st.integers(0, 8),
       surrogate=st.integers(0xD800, 0xDFFF).map(chr), chat=st.booleans())
def test_lone_surrogates_in_a_prompt(rel_target, text, cut, surrogate, chat):
    prompt = text[:cut] + surrogate + text[cut:]
    _refused(rel_target, ValueError, "not valid UTF-8", prompts=prompt, chat=chat)


@pytest.mark.parametrize("kw, exc, name", [
    (dict(prompts=123), TypeError, "prompts must be"),
    (dict(prompts=[1, 2, 3]), TypeError, "one list per prompt"),
    (dict(prompts=[]), ValueError, "no prompts given"),
    (dict(prompts=[[True, 2]]), TypeError, "prompt 0"),
    (dict(prompts=[[1.0, 2]]), TypeError, "prompt 0"),
    (dict(prompts=[[]]), ValueError, "prompt 0 is empty"),
    (dict(prompts=[[999]]), ValueError, "outside [0, 256)"),
    (dict(max_new_tokens="5"), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=4.7), TypeError, "max_new_tokens"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens"),
    (dict(temperature="0.5"), TypeError, "temperature"),
    (dict(top_k=True), TypeError, "top_k"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(chat=1), TypeError, "chat"),
    (dict(stop_on_eos="yes"), TypeError, "stop_on_eos"),
    (dict(system=5, prompts="hi"), TypeError, "system"),
    (dict(system="\udcff", prompts="hi"), ValueError, "system is not valid UTF-8"),
    (dict(mode="fast"), ValueError, "mode"),
    (dict(key=7), TypeError, "key"),
    (dict(drafter="my-drafter/"), TypeError, "drafter"),
    (dict(tree="chain"), TypeError, "tree"),
    (dict(vocab=5), TypeError, "vocab"),
])
def test_api_arguments(rel_target, kw, exc, name):
    _refused(rel_target, exc, name, **kw)


def test_valid_arguments_pass(rel_target):
    import jax

    from specjax.api import check_generate_args

    ok = dict(max_new_tokens=2, temperature=0.5, top_k=256, top_p=1.0, seed=-(2**63), key=None,
              chat=True, system=None, stop_on_eos=True, mode="eager", drafter=None, tree=None,
              assume_q_one=False, vocab="full")
    for key in (None, jax.random.key(1), jax.random.PRNGKey(1)):
        assert check_generate_args(rel_target, **(ok | {"key": key})) == (2, -(2**63))
    res = specjax.generate(rel_target, "hi cat", max_new_tokens=2, temperature=0.5, top_k=256,
                           top_p=0.9, seed=2**63 - 1)
    assert len(res.tokens[0]) == 2


def test_token_id_arrays(rel_target):
    import numpy as np

    assert len(specjax.generate(rel_target, np.array([[1, 2, 3]]), max_new_tokens=1)
               .tokens) == 1
    with pytest.raises(TypeError, match="must be 2-D"):
        specjax.generate(rel_target, np.array([1, 2, 3]))
    with pytest.raises(TypeError, match="1-D integer array"):
        specjax.generate(rel_target, [np.array([1.5, 2.0])])


def test_target_and_load_arguments(rel_dir, tmp_path, capsys):
    with pytest.raises(TypeError, match="target must be a Target"):
        specjax.generate(str(rel_dir), "hi")
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert main(["generate", "--model", str(f), "--prompt", "hi"]) == 2
    assert "is a file; pass the checkpoint folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype"):
        specjax.load(rel_dir, dtype="int8")
    with pytest.raises(TypeError, match="path"):
        specjax.load(None)


def test_tree_sizes_below_one():
    for kw in (dict(depth=0), dict(top_k=0), dict(total_tokens=-3)):
        with pytest.raises(ValueError, match=f"tree {next(iter(kw))} must be an int >= 1"):
            TreeSpec("eagle2", **kw)
    with pytest.raises(ValueError, match="tree depth must be an int >= 1"):
        TreeSpec("chain", depth=0)


@pytest.mark.parametrize("spec, message", [
    ("fr:99999999", "exceeds the vocabulary's 256 tokens"),
    ("fr:0", "N >= 1"),
    ("fr:-5", "N >= 1"),
    ("fr:abc", "N >= 1"),
    ("pafr:１２", "N >= 1"),  # non-ASCII digits
    ("fr:8:/nonexistent/counts.npy", "no such"),
    ("dynaspec:/nonexistent/router", "no such router folder"),
    ("medusa", "unknown vocab"),
    ("fr:8\udcff", "not valid UTF-8"),
])
def test_vocab_specs(rel_target, rel_drafter, spec, message):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        resolve_head(spec, rel_target, rel_drafter)
    assert message in str(e.value) and "--sizes 99999999" not in str(e.value)


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "inf"], "argument --temperature: must be a finite number"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number"),
    (["--top-p", "nan"], "argument --top-p: must be a finite number"),
    (["--top-p=-inf"], "argument --top-p: must be a finite number"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be >= 1"),
    (["--seed", "99999999999999999999"], "--seed must be <="),
    (["--tree-depth", "0"], "--tree-depth must be >= 1"),
    (["--tree-tokens", "0"], "--tree-tokens must be >= 1"),
    (["--drafter", "/nonexistent/drafter"], "no such folder"),
    (["--prompt", "caf\udce9"], "not valid UTF-8"),
    (["--system", "\udcff"], "--system is not valid UTF-8"),
])
def test_generate_flags_are_checked_before_loading(tmp_path, capsys, flags, message):
    # The model folder does not even exist: the flags are refused first.
    rc = main(["generate", "--model", str(tmp_path / "none"), "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


@pytest.mark.parametrize("argv", [
    ["train", "drafter", "--out", "d", "--lr", "inf"],
    ["train", "router", "--data", "d", "--out", "r", "--weight-decay", "nan"],
    ["train", "drafter", "--out", "d", "--noise=-inf"],
])
def test_every_float_flag_refuses_non_finite_values(capsys, argv):
    assert main(argv) == 2
    assert "must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--top-k", "1000", "--temperature", "1"], "top_k must be <= 256"),
    (["--vocab", "fr:16"], "needs a drafter"),
    (["--no-chat", "--prompt", ""], "is empty"),
])
def test_generate_flags_checked_against_the_model(rel_dir, capsys, flags, message):
    before = snapshot(rel_dir)
    rc = main(["generate", "--model", str(rel_dir), "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert snapshot(rel_dir) == before
