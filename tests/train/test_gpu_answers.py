"""The GPU job's answers come back as records: examples/gpu_drafter/prepare.py --answers."""

from __future__ import annotations

import importlib.util
import json
import lzma
from pathlib import Path

import numpy as np
import pytest

from specjax.train.selfdistill import prompts_hash

_PREPARE = Path(__file__).parents[2] / "examples" / "gpu_drafter" / "prepare.py"
_spec = importlib.util.spec_from_file_location("gpu_drafter_prepare", _PREPARE)
prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare)

POOL = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
STAGES = [{"name": "greedy_new", "prompts": [2, 0, 1]},
          {"name": "sampled_short", "prompts": [3, 0]}]


def _gpu_run(folder: Path, pool=POOL) -> Path:
    """What job.sh writes: answers.npz (uint16 answers; per record stage, prompt index within
    the stage, length, finished) and each stage's meta, beside the pool's prompts.json.xz."""
    folder.mkdir()
    prompts_file = folder / "prompts.json.xz"
    with lzma.open(prompts_file, "wt") as f:
        json.dump({"pool": pool, "stages": STAGES}, f)
    answered = {"greedy_new": 2, "sampled_short": 2}  # the time limit cut greedy_new short
    for s in STAGES:
        prompts = [POOL[i] for i in s["prompts"][:answered[s["name"]]]]
        (folder / f"{s['name']}.jsonl.meta.json").write_text(json.dumps({"settings": {
            "num_prompts": len(prompts), "prompts_sha256": prompts_hash(prompts)}}))
    records = [(0, 0, 2, 1), (0, 1, 1, 0), (1, 1, 3, 1), (1, 0, 1, 0)]
    tokens = [11, 12, 13, 14, 15, 16, 17]
    np.savez_compressed(folder / "answers.npz", tokens=np.asarray(tokens, np.uint16),
                        records=np.asarray(records, np.int32),
                        stages=np.asarray(["greedy_new", "sampled_short"]))
    return prompts_file


def test_records_are_prompt_then_answer(tmp_path):
    prompts_file = _gpu_run(tmp_path / "run")
    recs = prepare.answers_records(tmp_path / "run", prompts_file)
    assert [r["tokens"] for r in recs] == [[6, 11, 12], [1, 2, 3, 13], [1, 2, 3, 14, 15, 16],
                                          [7, 8, 9, 10, 17]]
    assert [r["assistant"] for r in recs] == [[0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1, 1, 1],
                                              [0, 0, 0, 0, 1]]


def test_another_pool_is_refused(tmp_path):
    _gpu_run(tmp_path / "run")
    other = tmp_path / "other.json.xz"
    with lzma.open(other, "wt") as f:
        json.dump({"pool": [[1, 2, 3], [4, 5], [9], [7, 8, 9, 10]], "stages": STAGES}, f)
    with pytest.raises(ValueError, match="prompts_sha256 differs"):
        prepare.answers_records(tmp_path / "run", other)
