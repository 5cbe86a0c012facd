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


def test_a_cpu_runs_stage_files_give_the_same_records(tmp_path):
    """generate.py on the CPU leaves each stage's JSONL (whole records) and no answers.npz;
    they read back as the npz does, a line a time limit cut is skipped, and a record that
    does not start with its pool prompt is refused."""
    prompts_file = _gpu_run(tmp_path / "run")
    want = prepare.answers_records(tmp_path / "run", prompts_file)
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    for name in ("greedy_new", "sampled_short"):
        meta = tmp_path / "run" / f"{name}.jsonl.meta.json"
        (cpu / meta.name).write_text(meta.read_text())
    stage_of = {0: "greedy_new", 1: "sampled_short"}
    lines: dict[str, list[str]] = {"greedy_new": [], "sampled_short": []}
    for (k, i), rec in zip([(0, 0), (0, 1), (1, 1), (1, 0)], want, strict=True):
        lines[stage_of[k]].append(json.dumps({**rec, "prompt_index": i, "finished": True}))
    for name, rows in lines.items():
        (cpu / f"{name}.jsonl").write_text("\n".join(rows) + "\n" + '{"tokens": [1, 2')
    got = prepare.answers_records(cpu, prompts_file)
    assert sorted(map(json.dumps, got)) == sorted(map(json.dumps, want))

    bad = json.loads(lines["greedy_new"][0]) | {"tokens": [9, 11, 12]}
    (cpu / "greedy_new.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="does not start with its prompt"):
        prepare.answers_records(cpu, prompts_file)


_GENERATE = Path(__file__).parents[2] / "examples" / "gpu_drafter" / "generate.py"
_gspec = importlib.util.spec_from_file_location("gpu_drafter_generate", _GENERATE)
generate = importlib.util.module_from_spec(_gspec)
_gspec.loader.exec_module(generate)


def test_generate_sizes_each_stages_batch(monkeypatch, capsys):
    """--batch is one batch for every stage; --batch-scale multiplies each stage's own
    (prepare.py sizes them for short and long prompts); both at once, or below 1, are
    refused before the target loads."""
    short, long = {"batch": 512}, {"batch": 128}
    assert [generate.stage_batch(s) for s in (short, long)] == [512, 128]
    assert [generate.stage_batch(s, scale=2) for s in (short, long)] == [1024, 256]
    assert [generate.stage_batch(s, 4) for s in (short, long)] == [4, 4]
    monkeypatch.setattr(generate.specjax, "load", lambda *_: pytest.fail("loaded the target"))
    for flags, message in ((["--batch", "4", "--batch-scale", "2"], "not both"),
                           (["--batch-scale", "0"], ">= 1"), (["--batch", "0"], ">= 1")):
        monkeypatch.setattr("sys.argv", ["generate.py", "--prompts", "p.json.xz", "--target",
                                         "t", "--out-dir", "o", *flags])
        with pytest.raises(SystemExit) as e:
            generate.main()
        assert e.value.code == 2 and message in capsys.readouterr().err
