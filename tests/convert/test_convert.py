"""`specjax convert` on HF folders: round trip, and a clear refusal for each bad input."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

import specjax
from specjax.checkpoint import CheckpointError, flatten_params
from specjax.config import UnsupportedModelError
from specjax.convert.hf import expected_shapes
from tests.tiny import edit_config, edit_tensors


@pytest.fixture
def src(tiny_llama, tmp_path):
    """A private copy of the tiny checkpoint that a test may damage."""
    return shutil.copytree(tiny_llama, tmp_path / "src")


def test_round_trip_keeps_every_tensor(src, tmp_path):
    out = specjax.convert(src, tmp_path / "out", progress=False)
    assert (out / "specjax.json").exists() and (out / "config.json").exists()
    target = specjax.load(out)
    flat = {k: np.asarray(v) for k, v in flatten_params(target.params).items()}
    state = load_file(src / "model.safetensors")
    np.testing.assert_array_equal(flat["embed"], state["model.embed_tokens.weight"])
    wq = state["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(flat["layers.1.wq"], wq.T)
    assert len(expected_shapes(target.cfg)) == len(state)


def test_bfloat16_conversion(src, tmp_path):
    out = specjax.convert(src, tmp_path / "out", dtype="bfloat16", progress=False)
    assert str(specjax.load(out).params.embed.dtype) == "bfloat16"


def test_sharded_checkpoint(tiny_llama, tmp_path):
    from tests.tiny import make_hf_model

    make_hf_model("llama").save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    a = specjax.load(specjax.convert(tmp_path / "sharded", tmp_path / "a", progress=False))
    b = specjax.load(specjax.convert(tiny_llama, tmp_path / "b", progress=False))
    np.testing.assert_array_equal(np.asarray(a.params.layers[1].w_down),
                                  np.asarray(b.params.layers[1].w_down))


def test_refuses_unsupported_architecture(src, tmp_path):
    edit_config(src, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*not supported"):
        specjax.convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_refuses_missing_tensor(src, tmp_path):
    edit_tensors(src, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"1 tensors missing.*layers\.1\.mlp\.up_proj"):
        specjax.convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_refuses_extra_tensor(src, tmp_path):
    edit_tensors(src, lambda s: s.update({"model.layers.2.mlp.up_proj.weight": np.zeros((2, 2),
                                                                                         np.float32)}))
    with pytest.raises(CheckpointError, match="unexpected tensors.*layers.2"):
        specjax.convert(src, tmp_path / "out", progress=False)


def test_refuses_shape_mismatch(src, tmp_path):
    edit_config(src, intermediate_size=128)
    with pytest.raises(CheckpointError, match=r"mismatch.*gate_proj.*\(96, 64\) != \(128, 64\)"):
        specjax.convert(src, tmp_path / "out", progress=False)


def test_refuses_truncated_file(src, tmp_path):
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        specjax.convert(src, tmp_path / "out", progress=False)
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_refuses_missing_source(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        specjax.convert(tmp_path / "nowhere", tmp_path / "out", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        specjax.convert(tmp_path / "empty", tmp_path / "out", progress=False)


def test_refuses_bad_arguments_and_sources_before_writing(src, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="dtype must be 'float32' or 'bfloat16'"):
        specjax.convert(src, out, dtype="float16", progress=False)
    with pytest.raises(TypeError, match="src and out must be str or Path"):
        specjax.convert(src, 7, progress=False)
    with pytest.raises(ValueError, match="tokenizer= is for a .gguf source"):
        specjax.convert(src, out, tokenizer=src, progress=False)
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="unrecognised source"):
        specjax.convert(tmp_path / "model.bin", out, progress=False)
    # A supported architecture with a malformed field: the error names the file and field.
    edit_config(src, num_attention_heads="four")
    with pytest.raises(CheckpointError, match=r"config\.json: num_heads must be a positive"):
        specjax.convert(src, out, progress=False)
    assert not out.exists()


def test_existing_out_needs_overwrite(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        specjax.convert(src, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    # --overwrite replaces only folders specjax wrote (issue 11): the user's file stays.
    with pytest.raises(FileExistsError, match="not a specjax folder"):
        specjax.convert(src, out, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()  # an empty folder may be written into
    specjax.convert(src, out, overwrite=True, progress=False)
    assert (out / "specjax.json").exists()


def test_failed_overwrite_keeps_the_old_folder(src, tmp_path):
    out = specjax.convert(src, tmp_path / "out", progress=False)
    before = (out / "specjax.json").read_text()
    edit_tensors(src, lambda s: s.pop("model.norm.weight"))
    with pytest.raises(CheckpointError):
        specjax.convert(src, out, overwrite=True, progress=False)
    assert (out / "specjax.json").read_text() == before
    specjax.load(out)


def test_load_refuses_incomplete_or_corrupt(src, tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        specjax.load(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not a specjax checkpoint"):
        specjax.load(src)  # an unconverted HF folder
    out = specjax.convert(src, tmp_path / "out", progress=False)
    (out / "specjax.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        specjax.load(out)
    out = specjax.convert(src, tmp_path / "out2", progress=False)
    for f in (out / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="bytes, the manifest says"):
        specjax.load(out)
