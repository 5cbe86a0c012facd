"""``specjax bench spec`` and ``specjax bench breakdown``: the machinery on a tiny random
Llama in CI, the real SmolLM2 run under ``-m bench``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax
import numpy as np
import pytest

import specjax
from specjax.bench import spec as spec_bench
from specjax.bench import spec_cli, spec_records
from specjax.bench.breakdown import (
    Expansion,
    add_breakdown_args,
    expansion_plan,
    run_breakdown,
    tree_from_spec_json,
)
from specjax.bench.breakdown import (
    summary as breakdown_summary,
)
from specjax.bench.common import first_mismatch, paired_speedup, pooled_difference
from specjax.bench.partial import partial_path
from specjax.bench.phases import draft_latency, random_drafter
from specjax.bench.questions import (
    TASKS,
    calibration_prompts,
    load_questions,
    resolve_questions,
    select_questions,
)
from specjax.bench.spec import SpecBenchConfig, run_spec_bench
from specjax.bench.spec_cli import add_spec_args
from specjax.bench.spec_report import summary
from specjax.bench.spec_select import tie_candidates, with_lookup
from specjax.bench.timing import monotone_fit, warmup_tokens
from specjax.bench.trees import tree_dict, tree_from_args, tree_label
from specjax.loop import bucket
from specjax.speculative import TreeSpec
from specjax.vocab.fr_head import frequency_head
from tests.tiny import make_hf_checkpoint

GRID = (TreeSpec("chain", depth=2), TreeSpec("eagle2", depth=2, top_k=2, total_tokens=3))
PROMPTS = [{"question_id": 7, "task": "qa", "ids": [1, 17, 42, 99, 5]},
           {"question_id": 9, "task": "rag", "ids": [1, 60, 61, 62, 63, 64, 65, 66, 67, 68]}]
# One calibration prompt in the evaluation's shape buckets: the chosen tree's compiled loop
# is then shared with the evaluation (compiles dominate this test's time).
CALIB = [[1, 5, 6, 7, 200, 201]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec_bench")
    return specjax.convert(make_hf_checkpoint(tmp / "hf", "llama"), tmp / "sj", progress=False)


def _finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0



def test_warm_keys_go_cold_when_generate_drops_the_compiled_programs(monkeypatch):
    """A drop of every compiled program (near Linux's memory-map limit) makes every warmed
    key cold: its next call warms up again, untimed, instead of compiling inside a timed
    call; a drop right after a warm-up took that warm-up's programs too, so it runs again."""
    from specjax import compile_cache
    from specjax.bench.timing import ensure_warm

    drops = iter([False, False,   # "a": warmed once
                  False,          # "a" again: warm, nothing runs
                  True, False,    # a drop: "a" warms again
                  False, True])   # "b": its warm-up crosses the limit, so it runs twice
    monkeypatch.setattr(compile_cache, "release_programs_near_map_limit", lambda: next(drops))
    calls, warm = [], set()
    for key in ("a", "a", "a", "b"):
        ensure_warm(warm, key, lambda k=key: calls.append(k))
    assert calls == ["a", "a", "b", "b"] and warm == {"b"}


def test_helpers(tmp_path, monkeypatch):
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    for n in (1, 8, 16, 17, 100, 128, 129):
        w = warmup_tokens(n)
        assert min(n, 2) <= w <= n and bucket(w) == bucket(n)
    assert monotone_fit([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone_fit([2.0, 5.0]) == [2.0, 5.0]
    assert partial_path(tmp_path / "r" / "b.json") == tmp_path / "r" / "b.partial.jsonl"
    assert expansion_plan(TreeSpec("eagle2", depth=4, top_k=3, total_tokens=8)) == [
        Expansion(0, 1, 3), Expansion(1, 3, 3), Expansion(2, 3, 3), Expansion(3, 3, 3)]
    assert expansion_plan(TreeSpec("chain", depth=3)) == [Expansion(t, 1, 1) for t in range(3)]
    # A static tree: one call a level, as wide as its widest level of nodes with children
    # (here the root's two children both have one), drafting as many children as the
    # level's highest rank asks.
    static = TreeSpec("static", paths=((0,), (1,), (2,), (0, 0), (1, 0)), lookup=8)
    assert expansion_plan(static) == [Expansion(0, 2, 3), Expansion(1, 2, 1)]
    with pytest.raises(ValueError, match="data-dependent"):
        expansion_plan(TreeSpec("dyspec", total_tokens=4))

    # Questions: explicit path, then the environment variable; a clear error when missing.
    lines = [{"question_id": i, "category": c, "turns": [f"q{i}", "second"]}
             for i, c in enumerate(["writing", "coding", "qa", "qa", "qa", "rag"], 1)]
    f = tmp_path / "question.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(FileNotFoundError, match="Spec-Bench questions not found"):
        resolve_questions(tmp_path / "missing.jsonl")
    monkeypatch.setenv("SPECJAX_SPEC_BENCH", str(f))
    assert resolve_questions() == f
    qs = load_questions(resolve_questions())
    assert [q.task for q in qs[:2]] == ["mt_bench", "mt_bench"] and qs[0].text == "q1"
    chosen = select_questions(qs, ["mt_bench", "qa"], 2)
    assert [q.question_id for q in chosen] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="no questions for task 'nope'"):
        select_questions(qs, ["nope"], 1)

    # Flags: the CLI attaches these in one line each.
    p = argparse.ArgumentParser()
    add_spec_args(p)
    assert tree_from_args(p.parse_args([])) is None
    a = p.parse_args(["--tree", "chain", "--tree-depth", "3", "--per-task", "2"])
    assert tree_from_args(a) == TreeSpec("chain", depth=3) and a.per_task == 2
    with pytest.raises(ValueError, match="need --tree"):
        tree_from_args(p.parse_args(["--tree-depth", "3"]))
    # Lookup chains: a fixed tree takes one size and one least match; auto crosses the lists.
    c = p.parse_args(["--tree", "chain", "--tree-lookup", "8", "--tree-lookup-min", "3"])
    assert tree_from_args(c) == TreeSpec("chain", lookup=8, lookup_min=3)
    with pytest.raises(ValueError, match="one --tree-lookup size and one --tree-lookup-min"):
        tree_from_args(p.parse_args(["--tree", "chain", "--tree-lookup", "8",
                                     "--tree-lookup-min", "2,3"]))
    d = p.parse_args(["--tree-lookup", "4,8", "--tree-lookup-min", "2,3"])
    grid = with_lookup([TreeSpec("chain", depth=1)], d.tree_lookup, d.tree_lookup_min)
    assert [(t.kind, t.depth, t.lookup, t.lookup_min) for t in grid] == [
        ("chain", 1, 0, 1), ("chain", 1, 4, 2), ("chain", 1, 8, 2), ("chain", 1, 4, 3),
        ("chain", 1, 8, 3)]
    with pytest.raises(SystemExit):
        p.parse_args(["--tree-lookup-min", "0"])
    # Any tree as JSON, its lookup included (a static tree has no --tree of its own).
    two = '{"kind": "static", "paths": [[0], [1], [0, 0]], "lookup": 8, "lookup_min": 2}'
    assert tree_from_args(p.parse_args(["--tree-json", two])) == TreeSpec(
        "static", paths=((0,), (1,), (0, 0)), lookup=8, lookup_min=2)
    assert tree_label(TreeSpec("static", paths=((0,), (1,), (0, 0)), lookup=8, lookup_min=2)
                      ) == "static 0 1 00 +lookup8 m2"
    for bad, match in ((["--tree-json", two, "--tree-lookup", "8"], "names the whole tree"),
                       (["--tree-json", "{kind: static}"], "not JSON"),
                       (["--tree-json", '{"kind": "static"}'], "paths must list")):
        with pytest.raises(ValueError, match=match):
            tree_from_args(p.parse_args(bad))
    b = argparse.ArgumentParser()
    add_breakdown_args(b)
    assert tree_from_args(b.parse_args([])) == TreeSpec()


def test_calibration_prompts_come_from_sharegpt_never_from_spec_bench(tmp_path, monkeypatch):
    """Tree choice is tuning: its prompts are ShareGPT records past ``skip``, and any that
    shares an 8-word shingle with a Spec-Bench question is dropped."""
    import specjax.train.prompts as prompts_mod

    question = "please explain how the heart pumps blood through the body in simple words"
    (tmp_path / "question.jsonl").write_text(json.dumps(
        {"question_id": 1, "category": "qa", "turns": [question]}) + "\n")
    chat = lambda u: {"conversations": [{"from": "human", "value": u},  # noqa: E731
                                        {"from": "gpt", "value": "An answer."}]}
    records = [chat("an early record the drafters may have trained on")] + [
        chat(question), chat("Write a haiku about the sea."), chat("What is 17 times 3?")]
    (tmp_path / "sg.json").write_text(json.dumps(records))
    monkeypatch.setattr(prompts_mod, "sharegpt_path", lambda: tmp_path / "sg.json")

    class Tok:
        chat_template = "{{ messages }}"  # a chat tokenizer (a base model's has none)

        def apply_chat_template(self, msgs, **kw):
            return [1] + [ord(c) % 200 + 2 for c in msgs[-1]["content"]]

    target = type("T", (), {"tokenizer": Tok()})()
    ids, info = calibration_prompts(target, num=2, skip=1,
                                    questions=tmp_path / "question.jsonl",
                                    weights={"chat": 1.0})
    texts = sorted("".join(chr(t - 2) for t in p[1:]) for p in ids)
    assert texts == sorted(["Write a haiku about the sea.", "What is 17 times 3?"])
    assert info["source"] == "sharegpt" and info["skip"] == 1
    assert info["stats"]["excluded"] == 1
    given, info = calibration_prompts(target, given=[[1, 2, 3]])
    assert given == [[1, 2, 3]] and info == {"source": "given"}


def test_spec_bench_pipeline_on_a_tiny_model(tiny_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "res" / "bench_spec.json"
    cfg = SpecBenchConfig(tiny_model, "random", per_task=1, max_new_tokens=8, tree=None,
                          questions=None, out=out, grid=GRID, latency_sizes=(1, 4), runs=2,
                          calib_max_new_tokens=8, eager_per_task=1, stop_on_eos=False)
    kw = dict(prompts=PROMPTS, calib_prompts=CALIB)

    # Interrupt the first run inside the second prompt: the partial file keeps the rest.
    real_call = spec_bench.PromptRunner.__call__

    def interrupted(self, method, ids, seed=0):
        if ids == PROMPTS[1]["ids"]:
            raise KeyboardInterrupt
        return real_call(self, method, ids, seed)

    monkeypatch.setattr(spec_bench.PromptRunner, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_spec_bench(cfg, **kw)
    kinds = [json.loads(x)["kind"] for x in partial_path(out).read_text().splitlines()]
    assert kinds == ["selection", "prompt"]

    # Resume; corrupt the second prompt's speculative tokens to exercise the mismatch path.
    monkeypatch.setattr(spec_bench.PromptRunner, "__call__", real_call)
    real_record = spec_records.generation_record

    def corrupt(res, compiles):
        rec = real_record(res, compiles)
        if "mal" in rec and "draft_s" not in rec:  # speculative compiled
            rec["tokens"] = rec["tokens"][:3] + [(rec["tokens"][3] + 1) % 256] + rec["tokens"][4:]
        return rec

    monkeypatch.setattr(spec_records, "generation_record", corrupt)
    res = run_spec_bench(cfg, **kw)
    printed = capsys.readouterr()
    assert "GREEDY MISMATCH: question 9" in printed.out + printed.err
    assert "resuming" in printed.out + printed.err
    assert not partial_path(out).exists()
    assert out.exists() and out.with_suffix(".png").stat().st_size > 0
    assert json.loads(out.read_text())["benchmark"] == "spec"

    assert res["resumed_prompts"] == 1
    assert res["mal_counts_bonus_token"] and "bonus token included" in res["mal_note"]
    assert list(res["per_task"]) == ["qa", "rag"]
    eq = res["greedy_equality"]
    assert (eq["matched"], eq["prompts"], eq["all_match"]) == (1, 2, False)
    assert eq["mismatches"] == [{"question_id": 9, "turn": 1, "task": "rag", "first_mismatch": 3,
                                 "eager_first_mismatch": None}]
    first, second = res["per_prompt"]
    assert first["greedy_match"] and first["eager_match"] and first["first_mismatch"] is None
    assert second["eager_match"] and not second["greedy_match"]
    for rec in res["per_prompt"]:
        assert len(rec["vanilla"]["tokens"]) == len(rec["spec"]["tokens"]) == 8
        spec = rec["spec"]
        assert sum(spec["accept_lengths"]) == spec["accepted_tokens"] == 8 - 1
        assert spec["mal"] >= 1 and spec["target_forwards"] == len(spec["accept_lengths"])
        assert rec["eager"]["draft_s"] > 0 and rec["eager"]["verify_s"] > 0
        for m in ("vanilla", "spec", "eager"):
            assert _finite_positive(rec[m]["decode_tokens_per_s"])
            assert rec[m]["compiles_while_timed"] == 0  # warm-ups compiled every shape

    lat = res["latency"]
    assert lat["sizes"] == [1, 4] and all(map(_finite_positive, lat["best_ms"]))
    assert lat["fit_ms"] == monotone_fit(lat["best_ms"])
    sel = res["tree_selection"]
    assert [g["label"] for g in sel["grid"]] == ["chain d2", "eagle2 d2 k2 n3"]
    best = max(sel["grid"], key=lambda g: g["est_tokens_per_s"])
    assert sel["chosen"] == best and res["tree"] == best["tree"]
    for g in sel["grid"]:
        assert g["mal"] >= 1 and _finite_positive(g["draft_ms"])
        assert g["est_tokens_per_s"] == pytest.approx(1e3 * g["mal"] / (g["verify_ms"]
                                                                        + g["draft_ms"]))
    for agg in (*res["per_task"].values(), res["overall"]):
        assert agg["mal"] >= 1
        for k in ("speedup", "compiled_vs_eager", "vanilla_decode_tokens_per_s",
                  "spec_decode_tokens_per_s", "eager_decode_tokens_per_s"):
            assert _finite_positive(agg[k]), k
    assert res["overall"]["prompts"] == 2 and res["overall"]["matched"] == 1
    lo, hi = res["overall"]["speedup_ci95"]
    assert lo <= res["overall"]["speedup"] <= hi
    assert res["per_task"]["qa"]["speedup_ci95"] is None  # one prompt: no interval
    assert _finite_positive(res["overall"]["e2e_speedup"])
    overall = next(ln for ln in summary(res).splitlines() if ln.startswith("overall"))
    assert f"{res['overall']['e2e_speedup']:.2f}" in overall.split()
    assert res["timed_compiles"] == 0
    assert res["config"]["max_new_tokens"] == 8 and res["machine"]["nproc"] >= 1


def test_spec_bench_drafts_with_the_given_vocabulary_head(tiny_model, tmp_path):
    target = specjax.load(tiny_model)
    ranked = np.arange(target.cfg.vocab_size)[::-1].copy()
    head = frequency_head(target.params.head, ranked, always=list(target.eos_ids), k_max=32)
    res = run_spec_bench(SpecBenchConfig(tiny_model, "random", per_task=1, max_new_tokens=8,
                                         tree=TreeSpec("chain", depth=2),
                                         out=tmp_path / "b.json", latency_sizes=(1, 4), runs=1,
                                         calib_max_new_tokens=8, eager_per_task=0,
                                         stop_on_eos=False, vocab=head),
                         prompts=PROMPTS[:1], calib_prompts=CALIB)
    assert "FrequencyHead" in res["config"]["vocab"]
    assert res["greedy_equality"]["all_match"]  # the head changes drafts, never the output
    spec = specjax.generate(target, [PROMPTS[0]["ids"]], max_new_tokens=8, stop_on_eos=False,
                            drafter=random_drafter(target),
                            tree=TreeSpec("chain", depth=2), vocab=head)
    assert res["per_prompt"][0]["spec"]["accept_lengths"] == spec.stats["accept_lengths"][0]


def test_sampled_spec_bench_draws_one_seed_a_prompt_to_the_budget(tiny_model, tmp_path):
    """``temperature`` > 0: the drafter's tree for sampling (the random drafter stores none:
    ``TreeSpec()``), no selection, vanilla and speculative runs with the same seed per
    prompt and no EOS stop, no equality counted, the speedup's interval over prompts."""
    target = specjax.load(tiny_model)
    drafter = random_drafter(target)
    out = tmp_path / "t1.json"
    cfg = SpecBenchConfig(tiny_model, per_task=1, max_new_tokens=8, out=out, eager_per_task=1,
                          temperature=1.0, seed=5)
    res = run_spec_bench(cfg, prompts=PROMPTS, drafter=drafter)
    conf = res["config"]
    assert (conf["greedy"], conf["temperature"], conf["seed"], conf["stop_on_eos"]) == (
        False, 1.0, 5, False)
    assert conf["tree_mode"] == "TreeSpec()'s defaults: the drafter stores no tree"
    assert res["tree"] == tree_dict(TreeSpec()) and conf["grid"] == [res["tree"]]
    assert res["tree_selection"] is None and res["latency"] is None
    assert res["prediction"] is None and res["greedy_equality"] is None
    assert "chi-square" in res["sampling"]["note"]
    for i, (p, rec) in enumerate(zip(PROMPTS, res["per_prompt"], strict=True)):
        assert rec["seed"] == 5 + i
        assert rec["greedy_match"] is None and rec["eager_match"] is None
        # Each method drew with the prompt's seed: the same tokens as a direct call.
        kw = dict(max_new_tokens=8, temperature=1.0, seed=5 + i, stop_on_eos=False)
        assert rec["vanilla"]["tokens"] == specjax.generate(target, [p["ids"]],
                                                            **kw).tokens[0]
        assert rec["spec"]["tokens"] == specjax.generate(
            target, [p["ids"]], drafter=drafter, tree=TreeSpec(), **kw).tokens[0]
        assert len(rec["eager"]["tokens"]) == 8
    assert res["overall"]["matched"] is None and res["overall"]["eager_matched"] is None
    lo, hi = res["overall"]["speedup_ci95"]
    assert lo <= res["overall"]["speedup"] <= hi and res["timed_compiles"] == 0
    printed = summary(res)
    assert "sampled at temperature 1 (no EOS stop, seeds 5+)" in printed
    assert "tree: eagle2" in printed and "latency (ms" not in printed
    assert "decode speedup" in printed and "chi-square" in printed
    assert out.with_suffix(".png").stat().st_size > 0

    # A given tree is evaluated as given.
    chain = TreeSpec("chain", depth=2)
    res = run_spec_bench(dataclasses.replace(cfg, tree=chain, eager_per_task=0,
                                             out=tmp_path / "t1c.json"),
                         prompts=PROMPTS[:1], drafter=drafter)
    assert res["tree"] == tree_dict(chain) and res["config"]["tree_mode"] == "given"
    with pytest.raises(ValueError, match="did not choose"):
        spec_cli.save_default_tree(res, tmp_path)
    # The tree for sampling where the drafter stores one, else its greedy tree.
    stored = dataclasses.replace(drafter, default_tree=chain)
    assert spec_bench._sampled_tree_source(stored, 1.0).startswith("the drafter's greedy tree")
    stored = dataclasses.replace(stored, sampled_trees=((0.3, chain),
                                                        (1.0, TreeSpec("chain", depth=1))))
    assert spec_bench._sampled_tree_source(stored, 0.8) == (
        "the drafter's tree for sampling measured at temperature 1")
    assert spec_bench._sampled_tree_source(stored, 0.5).endswith("temperature 0.3")


def test_sampled_spec_bench_filters_with_top_p(tiny_model, tmp_path):
    """``top_p`` < 1 filters every draw: vanilla's and speculative decoding's tokens are a
    direct call's with the same ``top_p`` (and the same seed), and the report says so."""
    target = specjax.load(tiny_model)
    drafter = random_drafter(target)
    cfg = SpecBenchConfig(tiny_model, per_task=1, max_new_tokens=8, out=tmp_path / "p.json",
                          eager_per_task=0, temperature=1.0, top_p=0.5, seed=2)
    res = run_spec_bench(cfg, prompts=PROMPTS[:2], drafter=drafter)
    assert res["config"]["top_p"] == res["sampling"]["top_p"] == 0.5
    for i, (p, rec) in enumerate(zip(PROMPTS[:2], res["per_prompt"], strict=True)):
        kw = dict(max_new_tokens=8, temperature=1.0, seed=2 + i, stop_on_eos=False)
        assert rec["vanilla"]["tokens"] == specjax.generate(target, [p["ids"]], top_p=0.5,
                                                            **kw).tokens[0]
        assert rec["spec"]["tokens"] == specjax.generate(
            target, [p["ids"]], drafter=drafter, tree=TreeSpec(), top_p=0.5, **kw).tokens[0]
    # The filter changed the draws (these prompts' unfiltered draws differ from them).
    unfiltered = [specjax.generate(target, [p["ids"]], max_new_tokens=8, temperature=1.0,
                                   seed=2 + i, stop_on_eos=False).tokens[0]
                  for i, p in enumerate(PROMPTS[:2])]
    assert unfiltered != [r["vanilla"]["tokens"] for r in res["per_prompt"]]
    assert "sampled at temperature 1, top-p 0.5 (no EOS stop" in summary(res)


def test_sampled_paired_ab_chooses_the_tree_for_sampling(tiny_model, tmp_path):
    """``add_trees`` at temperature > 0: the tree for sampling and the added trees run end
    to end at that temperature, paired, on calibration prompts; the chosen one is
    evaluated, and ``save_default_tree`` stores it as the tree for sampling."""
    from specjax.tree.default import read_defaults, write_default_tree

    target = specjax.load(tiny_model)
    static = TreeSpec("static", paths=((0,), (1,)))
    drafter = dataclasses.replace(random_drafter(target), default_tree=static)
    chain = TreeSpec("chain", depth=1)
    cfg = SpecBenchConfig(tiny_model, per_task=1, max_new_tokens=8, out=tmp_path / "ab.json",
                          eager_per_task=0, temperature=1.0, add_trees=(chain, static))
    ab_prompts = [PROMPTS[0]["ids"], CALIB[0], [1, 2, 3]]
    res = run_spec_bench(cfg, prompts=PROMPTS[:1], ab_prompts=ab_prompts, drafter=drafter)
    conf, sel = res["config"], res["tree_selection"]
    # No tree for sampling stored: the greedy one is the incumbent (and runs once).
    assert conf["tree_mode"] == "paired" and res["latency"] is None
    assert [g["label"] for g in sel["grid"]] == ["static 0 1", "chain d1"]
    ab = sel["ab"]
    assert ab["candidates"] == ab["always_run"] == ["static 0 1", "chain d1"]
    assert ab["prompts"] == 3 and ab["prompt_tokens"] == [5, 6, 3]
    for r in ab["results"]:  # sampled without an EOS stop: every row decodes the budget
        assert [x["tokens"] for x in r["per_prompt"]] == [7, 7, 7]
        lo, hi = r["vs_first"]["ci95"]
        assert lo <= r["vs_first"]["ratio"] <= hi and r["mal"] >= 1
    # The paired rows drew with the run's seeds: prompt i with seed + i, as generate does.
    direct = specjax.generate(target, [CALIB[0]], drafter=drafter, tree=chain,
                              max_new_tokens=8, temperature=1.0, seed=1, stop_on_eos=False)
    assert ab["results"][1]["per_prompt"][1]["mal"] == direct.stats["mean_accepted_length"]
    assert ab["winner"] == res["tree_label"] == sel["chosen"]["label"]
    assert res["tree"] == sel["chosen"]["tree"]
    printed = summary(res)
    assert "paired A/B on 3 calibration prompts, speed vs static 0 1:" in printed
    assert f"chosen tree: {res['tree_label']}" in printed

    # Stored as the tree for sampling, beside the greedy default and its head.
    for d in ("d", "e"):
        (tmp_path / d).mkdir()
    write_default_tree(tmp_path / "d", static, {"how": "test"}, vocab="full")
    spec_cli.save_default_tree(res, tmp_path / "d", "ab.json")
    greedy_tree, vocab, sampled = read_defaults(tmp_path / "d")[:3]
    assert (greedy_tree, vocab) == (static, "full")
    assert sampled == ((1.0, TreeSpec.from_json(res["tree"])),)  # at the run's temperature
    stored = json.loads((tmp_path / "d" / "default_tree.json").read_text())["sampled"][
        "temperatures"]["1"]
    assert "bench spec --temperature 1" in stored["measured"]["how"]
    assert set(stored["measured"]["paired"]) == {"static 0 1", "chain d1"}
    write_default_tree(tmp_path / "e", static, {"how": "test"}, vocab="fr:64")
    with pytest.raises(ValueError, match="run again with --vocab fr:64"):
        spec_cli.save_default_tree(res, tmp_path / "e")


def test_sampled_settings_are_checked(tiny_model):
    for kw, match in (({"temperature": -1.0}, "temperature must be >= 0"),
                      ({"temperature": float("nan")}, "temperature must be >= 0"),
                      ({"temperature": 1.0, "ab_trees": 2}, "estimates nothing"),
                      ({"temperature": 1.0, "grid_add_default": True}, "estimates nothing"),
                      ({"tree": TreeSpec("chain"), "add_trees": (TreeSpec(),)},
                       "a given tree is not chosen"),
                      ({"temperature": 1.0, "top_p": 0.0}, "top_p is in"),
                      ({"temperature": 1.0, "top_p": 1.5}, "top_p is in"),
                      ({"top_p": 0.9}, "filters sampled draws")):
        with pytest.raises(ValueError, match=match):
            SpecBenchConfig(tiny_model, **kw)
    p = argparse.ArgumentParser()
    add_spec_args(p)
    a = p.parse_args(["--model", str(tiny_model), "--temperature", "0.7", "--seed", "3",
                      "--save-default-tree"])
    cfg = spec_cli.config_from_args(a)
    assert (cfg.temperature, cfg.seed, cfg.greedy, cfg.add_trees) == (0.7, 3, False, ())
    with pytest.raises(ValueError, match="give the trees to compare"):
        spec_cli.run_spec_from_args(a)  # refused before any model loads
    a = p.parse_args(["--model", str(tiny_model), "--temperature", "1", "--add-tree",
                      '{"kind": "chain", "depth": 1}', "--drafter", "random",
                      "--save-default-tree"])
    assert spec_cli.config_from_args(a).add_trees == (TreeSpec("chain", depth=1),)
    with pytest.raises(ValueError, match="needs a trained drafter"):
        spec_cli.run_spec_from_args(a)
    a = p.parse_args(["--model", str(tiny_model), "--temperature", "1", "--top-p", "0.9",
                      "--add-tree", '{"kind": "chain", "depth": 1}', "--save-default-tree"])
    assert spec_cli.config_from_args(a).top_p == 0.9
    with pytest.raises(ValueError, match="stores trees by temperature alone"):
        spec_cli.run_spec_from_args(a)  # refused before any model loads
    with pytest.raises(ValueError, match="--add-tree"):
        spec_cli.config_from_args(p.parse_args(["--add-tree", "{bad"]))


def test_paired_speedup_scales_the_base_to_the_run_tokens():
    def rec(s, n):
        return {"decode_s": s, "new_tokens": n}

    van, spec = [rec(2.0, 9), rec(4.0, 9)], [rec(1.0, 9), rec(1.0, 9)]
    sp = paired_speedup(van, spec)
    assert sp["ratio"] == pytest.approx(3.0)
    assert sp["ci95"] == pytest.approx([2.0, 4.0], rel=1e-6)  # a prompt's own ratio bounds
    # The base decoded twice the tokens: its time is halved before the ratio.
    assert paired_speedup([rec(4.0, 17), rec(8.0, 17)], spec)["ci95"] == pytest.approx(
        [2.0, 4.0], rel=1e-6)
    assert paired_speedup(van[:1], spec[:1]) is None
    assert paired_speedup([van[0], rec(1.0, 1)], [spec[0], rec(1.0, 1)]) is None
    with pytest.raises(ValueError, match="same prompts"):
        paired_speedup(van, spec[:1])


def test_tie_candidates_are_the_best_estimates_within_the_margin():
    rows = [{"est_tokens_per_s": v} for v in (90.0, 100.0, 96.0, 94.9, 99.0)]
    assert tie_candidates(rows, 3, 0.05) == [1, 4, 2]
    assert tie_candidates(rows, 9, 0.05) == [1, 4, 2]  # 94.9 is 5.1% below the best
    assert tie_candidates(rows, 2, 0.2) == [1, 4]
    assert tie_candidates(rows, 4, 0.001) == [1]
    # The stored default and added trees run however they were estimated, after the
    # near-ties, each once.
    assert tie_candidates(rows, 2, 0.05, keep=[0]) == [1, 4, 0]
    assert tie_candidates(rows, 2, 0.05, keep=[4]) == [1, 4]
    assert tie_candidates(rows, 4, 0.001, keep=[3]) == [1, 3]
    assert tie_candidates(rows, 1, 0.05, keep=[3, 0, 1, 3]) == [1, 3, 0]


def test_paired_tie_break_chooses_the_fastest_end_to_end(tiny_model, tmp_path, monkeypatch):
    """``ab_trees``: the estimate's near-ties run end to end, paired; the stored default
    joins the grid with ``grid_add_default``, a given tree with ``add_trees``, and both
    always run."""
    target = specjax.load(tiny_model)
    # The calibrated trees' programs are dropped once, before the evaluation's warm-ups (so
    # no drop near the memory-map limit falls inside the evaluation).
    clears = []
    real_clear = jax.clear_caches
    monkeypatch.setattr(jax, "clear_caches", lambda: clears.append(1) or real_clear())
    static = TreeSpec("static", paths=((0,), (1,), (0, 0)))
    drafter = dataclasses.replace(random_drafter(target), default_tree=static)
    cfg = SpecBenchConfig(tiny_model, per_task=1, max_new_tokens=8, out=tmp_path / "b.json",
                          grid=GRID, latency_sizes=(1, 4), runs=1, calib_max_new_tokens=8,
                          eager_per_task=0, stop_on_eos=False, grid_add_default=True,
                          add_trees=(TreeSpec("chain", depth=1),), ab_trees=2, ab_within=0.99)
    ab_prompts = [PROMPTS[0]["ids"], CALIB[0], [1, 2, 3]]
    res = run_spec_bench(cfg, prompts=PROMPTS[:1], calib_prompts=CALIB, ab_prompts=ab_prompts,
                         drafter=drafter)
    sel = res["tree_selection"]
    labels = [g["label"] for g in sel["grid"]]
    assert labels == ["chain d2", "eagle2 d2 k2 n3", "chain d1", "static 0 1 00"]
    est = max(range(4), key=lambda i: sel["grid"][i]["est_tokens_per_s"])
    ab = sel["ab"]
    assert sel["estimate_index"] == est and ab["candidates"][0] == labels[est]
    assert ab["always_run"] == ["chain d1", "static 0 1 00"]
    # The two best estimates (ab_trees=2; all are within the margin), then the trees that
    # always run and are not among them.
    order = sorted(range(4), key=lambda i: -sel["grid"][i]["est_tokens_per_s"])
    top = [labels[i] for i in order[:2]]
    assert ab["candidates"] == top + [t for t in ab["always_run"] if t not in top]
    assert ab["source"] == {"source": "given"} and ab["prompt_tokens"] == [5, 6, 3]
    assert ab["prompts"] == 3
    first = ab["results"][0]["vs_first"]
    assert first["ratio"] == pytest.approx(1.0) and first["ci95"] == pytest.approx([1, 1])
    fastest = max(ab["results"], key=lambda r: r["vs_first"]["ratio"])
    assert ab["fastest"] == fastest["label"] and fastest["label"] in ab["tied"]
    won = next(r for r in ab["results"] if r["label"] == ab["winner"])
    assert ab["winner"] == res["tree_label"] and won["label"] in ab["tied"]
    assert sel["chosen"] == sel["grid"][won["index"]] and res["tree"] == sel["chosen"]["tree"]
    if ab["winner"] != ab["fastest"]:  # a speed tie, decided by a resolved MAL margin
        assert ab["decided_by"] == "speed tie: the higher MAL"
        assert won["mal_vs_fastest"]["ci95"][0] > 0
    for r in ab["results"]:
        for k in ("vs_first", "vs_fastest"):
            lo, hi = r[k]["ci95"]
            assert lo <= r[k]["ratio"] <= hi
        assert r["mal"] >= 1 and len(r["per_prompt"]) == 3
    assert res["greedy_equality"]["all_match"]
    assert len(clears) == 1 and res["timed_compiles"] == 0
    printed = summary(res)
    assert f"paired A/B on 3 calibration prompts, speed vs {labels[est]}:" in printed
    assert f"chosen: {ab['winner']} (decided by {ab['decided_by']}" in printed

    # Nothing within the margin: the estimate decides and the run says so.
    narrow = dataclasses.replace(cfg, ab_within=1e-9, grid_add_default=False, add_trees=(),
                                 out=tmp_path / "c.json")
    res = run_spec_bench(narrow, prompts=PROMPTS[:1], calib_prompts=CALIB,
                         ab_prompts=ab_prompts, drafter=drafter)
    sel = res["tree_selection"]
    assert sel["ab"]["skipped"].startswith("no other tree within")
    assert sel["ab"]["always_run"] == []
    assert sel["chosen_index"] == sel["estimate_index"]
    assert "paired A/B skipped" in summary(res)


def test_every_stored_greedy_tree_joins_the_grid_and_the_ab(tiny_model, tmp_path):
    """``grid_add_default``: this machine's stored tree, then the folder's main one and every
    other machine class's, so a run on any class compares them all."""
    from specjax.tree.default import write_default_tree, write_machine_default_tree

    static = TreeSpec("static", paths=((0,), (1,), (0, 0)), lookup=8, lookup_min=2)
    other = TreeSpec("chain", depth=1, lookup=4, lookup_min=2)
    write_default_tree(tmp_path, static, {}, vocab="fr:16")
    write_machine_default_tree(tmp_path, other, {}, machine="cpu-elsewhere")
    write_machine_default_tree(tmp_path, GRID[0], {}, machine="cpu-again")  # in the grid
    drafter = dataclasses.replace(random_drafter(specjax.load(tiny_model)), path=tmp_path,
                                  default_tree=static)
    cfg = SpecBenchConfig(tiny_model, grid=GRID, grid_add_default=True, ab_trees=2,
                          out=tmp_path / "b.json")
    trees, keep = spec_bench.candidates(cfg, drafter, "d")
    assert trees == (*GRID, static, other)
    assert [trees[i] for i in keep] == [static, GRID[0], other]  # classes by name


def test_tie_break_settings_are_checked(tiny_model, tmp_path):
    for kw, match in (({"ab_trees": 1}, "at least 2 trees"),
                      ({"ab_trees": 2, "ab_within": 1.5}, "0 < ab_within < 1"),
                      ({"ab_trees": 2, "ab_prompts": 1}, "ab_prompts >= 2"),
                      ({"ab_trees": 2, "tree": TreeSpec("chain")}, "a given tree is not chosen")):
        with pytest.raises(ValueError, match=match):
            SpecBenchConfig(tiny_model, **kw)
    target = specjax.load(tiny_model)
    with pytest.raises(ValueError, match="stores no default tree"):
        run_spec_bench(SpecBenchConfig(tiny_model, grid=GRID, grid_add_default=True,
                                       out=tmp_path / "d.json"),
                       prompts=PROMPTS[:1], calib_prompts=CALIB,
                       drafter=random_drafter(target))
    p = argparse.ArgumentParser()
    add_spec_args(p)
    a = p.parse_args(["--model", str(tiny_model), "--ab-trees", "3", "--ab-within", "0.02",
                      "--grid-add-default"])
    cfg = spec_cli.config_from_args(a)
    assert (cfg.ab_trees, cfg.ab_within, cfg.ab_prompts, cfg.grid_add_default) == (
        3, 0.02, 24, True)


def test_calibration_decodes_the_evaluations_budget(tiny_model, tmp_path, monkeypatch):
    """The estimate's MAL is counted over as many new tokens as the evaluation decodes
    unless told otherwise: a shorter calibration under-counts the lookup chain, which
    copies more the longer a greedy answer runs."""
    with pytest.raises(ValueError, match="calib_max_new_tokens"):
        SpecBenchConfig(tiny_model, calib_max_new_tokens=0)
    assert SpecBenchConfig(tiny_model, max_new_tokens=64,
                           calib_max_new_tokens=8).calib_new_tokens == 8
    seen = []
    real = spec_bench.select_tree
    monkeypatch.setattr(spec_bench, "select_tree", lambda *a, **kw: (
        seen.append(kw["calib_max_new_tokens"]) or real(*a, **kw)))
    cfg = SpecBenchConfig(tiny_model, per_task=1, max_new_tokens=6, out=tmp_path / "b.json",
                          grid=GRID[:1], latency_sizes=(1, 4), runs=1, eager_per_task=0,
                          stop_on_eos=False)
    res = run_spec_bench(cfg, prompts=PROMPTS[:1], calib_prompts=CALIB,
                         drafter=random_drafter(specjax.load(tiny_model)))
    assert seen == [6] and res["config"]["calib_max_new_tokens"] == 6


@pytest.mark.parametrize("tree", [TreeSpec("chain", depth=1, copy_bias=(1.0, 2.0)),
                                  TreeSpec("chain", depth=1, lookup=3)])
def test_draft_latency_times_trees_that_read_the_committed_text(tiny_model, tree):
    """A copy gate and a lookup chain both search the prompt: the timed state has one."""
    target = specjax.load(tiny_model)
    t = draft_latency(target, random_drafter(target), tree, context=12, capacity=64,
                      out_len=8, runs=1)
    assert _finite_positive(t["best_ms"])


def test_breakdown_on_a_tiny_model(tiny_model, tmp_path):
    out = tmp_path / "bd.json"
    # The pipeline test's tree and cache geometry: its compiled draft phase and verify
    # forward are reused when both tests run in one process.
    tree = GRID[1]
    res = run_breakdown(tiny_model, "random", tree=tree, out=out, context=12,
                        max_new_tokens=8, runs=2)
    assert out.exists() and out.with_suffix(".png").stat().st_size > 0
    assert json.loads(out.read_text())["benchmark"] == "breakdown"
    rows = res["per_expansion"]
    assert [x["label"] for x in rows] == ["t=0 K=1 (root)", "t=1 K=2"]
    # The root's drafter layers ran in the previous step's catch-up: its expansion in the
    # draft phase is the head alone.
    assert rows[0]["in_draft_phase"] == ["head_topk"]
    assert rows[0]["embed_fc_ms"] == rows[0]["layer_ms"] == 0.0
    assert _finite_positive(rows[0]["head_topk_ms"])
    for k in ("embed_fc_ms", "layer_ms", "head_topk_ms"):
        assert _finite_positive(rows[1][k])
    step = res["draft_step"]
    assert step["layer_ms"] == rows[1]["layer_ms"]
    assert sum(step["fractions"].values()) == pytest.approx(1.0)
    assert _finite_positive(step["tree_ops_ms"]) and _finite_positive(step["measured_ms"])
    assert res["verify_tokens"] == 4 and _finite_positive(res["verify_ms"])
    assert res["capacity"] >= res["context"] + tree.workspace
    assert res["vocab"] == "full"

    spec_json = tmp_path / "spec.json"
    looked_up = TreeSpec("chain", depth=2, lookup=4, lookup_min=2)
    spec_json.write_text(json.dumps({"tree": tree_dict(looked_up)}))
    assert tree_from_spec_json(spec_json) == looked_up


def test_breakdown_of_a_static_tree_with_a_lookup_chain_and_a_shortlist(tiny_model, tmp_path):
    """The shipped tree's shape (a static root of three + a lookup chain) on an FR head:
    one expansion, the root's head over the shortlist's rows."""
    target = specjax.load(tiny_model)
    ranked = tmp_path / "ranked.npy"
    np.save(ranked, np.arange(target.cfg.vocab_size)[::-1].copy())
    tree = TreeSpec("static", paths=((0,), (1,), (2,)), lookup=4, lookup_min=2)
    res = run_breakdown(tiny_model, "random", tree=tree, vocab=f"fr:32:{ranked}",
                        out=tmp_path / "bd.json", context=12, max_new_tokens=8, runs=2)
    (root,) = res["per_expansion"]
    assert root["children"] == 3 and root["capacity"] == 32
    assert res["vocab"].startswith("fr") and res["tree"]["lookup"] == 4
    assert res["verify_tokens"] == 8 and res["verify_unchained_tokens"] == 4
    assert _finite_positive(res["verify_unchained_ms"])
    step = res["draft_step"]
    assert step["layer_ms"] == 0.0 and _finite_positive(step["measured_ms"])
    assert "head fr" in breakdown_summary(res)


@pytest.mark.bench
def test_spec_bench_smollm2(tmp_path):
    """The real pipeline with small settings: SmolLM2, the shipped drafter (random if none)."""
    from specjax.defaults import default_drafter_dir, ensure_default_target

    try:
        drafter = default_drafter_dir()
    except FileNotFoundError:
        drafter = "random"
    model = ensure_default_target()
    out = tmp_path / "bench_spec.json"
    res = run_spec_bench(SpecBenchConfig(
        model, drafter, per_task=1, max_new_tokens=32, out=out,
        grid=(TreeSpec("chain", depth=3), TreeSpec("eagle2", depth=4, top_k=4, total_tokens=8)),
        calib_num_prompts=2, calib_max_new_tokens=24, runs=3))
    assert out.exists() and out.with_suffix(".png").stat().st_size > 0
    assert list(res["per_task"]) == list(TASKS)
    assert res["greedy_equality"]["prompts"] == 6
    assert res["latency"]["sizes"] == list(spec_bench.LATENCY_SIZES)
    assert _finite_positive(res["overall"]["speedup"])
    assert res["overall"]["mal"] >= 1

    bd = run_breakdown(model, drafter, tree=tree_from_spec_json(out),
                       out=tmp_path / "bd.json", runs=5)
    assert bd["vocab_size"] == 49152 and _finite_positive(bd["draft_step"]["measured_ms"])


def test_questions_of_a_base_model_are_plain_text(tiny_target):
    """A target without a chat template (a base model such as Gemma 3 270M) gets Spec-Bench's
    questions as plain text, as ``--no-chat`` gives them; one with a template gets them
    through it."""
    import dataclasses

    from specjax.api import encode_prompts
    from specjax.bench.questions import question_ids, uses_chat
    from tests.vocab.conftest import toy_tokenizer

    text = "the cat sat on a mat"
    chat = dataclasses.replace(tiny_target, tokenizer=toy_tokenizer())
    assert uses_chat(chat)
    assert question_ids(chat, text) == encode_prompts(chat, text, chat=True)[0]
    tok = toy_tokenizer()
    tok.chat_template = None
    base = dataclasses.replace(tiny_target, tokenizer=tok)
    assert not uses_chat(base)
    ids = question_ids(base, text)
    assert ids == tok.encode(text) and len(ids) == 6
    assert ids != question_ids(chat, text)


def test_pooled_difference_resamples_prompts_and_pairs_them():
    rs = np.random.default_rng(0)
    rates = rs.uniform(0.1, 0.9, 24)  # prompts differ far more than the two drafters do
    base = [rs.random(120) < r for r in rates]
    better = [h | (rs.random(120) < 0.05) for h in base]  # ~ +3 points on every prompt
    g = pooled_difference(better, base)
    assert g["prompts"] == 24 and g["positions"] == 24 * 120
    assert 0.015 < g["diff"] < 0.05 and 0 < g["ci95"][0] <= g["diff"] <= g["ci95"][1]
    noise = [rs.random(120) < r for r in rates]
    g0 = pooled_difference(noise, base)
    assert g0["ci95"][0] < 0 < g0["ci95"][1]
    with pytest.raises(ValueError, match="same positions"):
        pooled_difference(base, base[:-1])


def test_later_turns_follow_vanilla_answers_and_are_reported_per_turn(tiny_model, tmp_path,
                                                                       monkeypatch):
    """``turns="all"`` (Spec-Bench's protocol): a question's second turn is asked after its
    first and vanilla's answer to it; each turn is a record, checked against vanilla like
    the first, pooled into its task and split by turn."""
    target = specjax.load(tiny_model)
    drafter = random_drafter(target)
    prompts = [PROMPTS[0] | {"later_ids": [[3, 4, 5]]}, PROMPTS[1]]
    cfg = SpecBenchConfig(tiny_model, per_task=1, max_new_tokens=8, out=tmp_path / "t.json",
                          eager_per_task=1, tree=TreeSpec("chain", depth=2), turns="all")
    kw = dict(prompts=prompts, calib_prompts=CALIB, drafter=drafter)
    # Interrupted at the second turn, then resumed: the first turn's record is reused and
    # its vanilla answer starts the second turn's conversation.
    run_turn = spec_bench.run_turn

    def stop_at_turn_2(runner, p, ids, turn, **kw):
        if turn == 2:
            raise KeyboardInterrupt
        return run_turn(runner, p, ids, turn, **kw)

    monkeypatch.setattr(spec_bench, "run_turn", stop_at_turn_2)
    with pytest.raises(KeyboardInterrupt):
        run_spec_bench(cfg, **kw)
    monkeypatch.setattr(spec_bench, "run_turn", run_turn)
    res = run_spec_bench(cfg, **kw)
    assert res["resumed_prompts"] == 1
    recs = res["per_prompt"]
    assert [(r["question_id"], r["turn"]) for r in recs] == [(7, 1), (7, 2), (9, 1)]
    first, second = recs[0], recs[1]
    answer = first["vanilla"]["tokens"]
    assert second["prompt_tokens"] == len(PROMPTS[0]["ids"]) + len(answer) + 3
    follow_up = [*PROMPTS[0]["ids"], *answer, 3, 4, 5]
    assert second["vanilla"]["tokens"] == specjax.generate(target, [follow_up],
                                                           max_new_tokens=8).tokens[0]
    assert all(r["greedy_match"] for r in recs) and res["greedy_equality"]["prompts"] == 3
    # Eager runs on first turns only; the turn's seed differs from the first turns'.
    assert first["eager"] is not None and second["eager"] is None
    assert len({r["seed"] for r in recs}) == 3
    assert res["per_task"]["qa"]["prompts"] == 2 and res["overall"]["prompts"] == 3
    assert {t: a["prompts"] for t, a in res["per_turn"].items()} == {"1": 2, "2": 1}
    assert res["config"]["turns"].startswith("every turn")
    assert "turn 2" in summary(res)
    # The first-turn run is the default and keeps its key and records' shape.
    one = run_spec_bench(dataclasses.replace(cfg, turns="first", out=tmp_path / "f.json"), **kw)
    assert [r["turn"] for r in one["per_prompt"]] == [1, 1] and one["per_turn"] is None
    assert one["config"]["turns"] == "first turn only"
    with pytest.raises(ValueError, match="turns is 'first' or 'all'"):
        SpecBenchConfig(tiny_model, turns="both")


def test_follow_up_turns_render_the_conversation_through_the_chat_template(tiny_target):
    """A later turn's prompt is the conversation so far (each answer decoded without
    special tokens) and the next turn, as the template lays it out; a base model, which
    has no template, is refused with the flag that avoids it."""
    from tokenizers import decoders

    from specjax.bench.questions import follow_up_ids, spec_bench_prompts
    from tests.train.tiny_data import char_tokenizer

    tok = char_tokenizer()
    tok.backend_tokenizer.decoder = decoders.Fuse()  # characters back to text, unspaced
    chat = dataclasses.replace(tiny_target, tokenizer=tok)
    answer = tok.encode("fine, thanks") + [tok.convert_tokens_to_ids("<|im_end|>")]
    got = follow_up_ids(chat, ["hi", "and you?", "unused"], [answer])
    want = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "fine, thanks"},
                                    {"role": "user", "content": "and you?"}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    assert got == list(want)
    with pytest.raises(ValueError, match="at least 2 turns"):
        follow_up_ids(chat, ["hi"], [answer])
    base = dataclasses.replace(tiny_target, tokenizer=None)
    with pytest.raises(ValueError, match="no chat template.*--turns first"):
        follow_up_ids(base, ["hi", "more"], [answer])
    with pytest.raises(ValueError, match="no chat template"):
        spec_bench_prompts(base, questions=None, tasks=["qa"], per_task=1, all_turns=True)


def test_spec_bench_questions_keep_every_turn(tmp_path):
    """MT-bench's questions (two turns in Spec-Bench's file) keep both, the first as
    ``text``; a turn that is not text is refused with the line that holds it."""
    lines = [{"question_id": 1, "category": "writing", "turns": ["Write.", "Rewrite it."]},
             {"question_id": 2, "category": "qa", "turns": ["Why?"]}]
    f = tmp_path / "question.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    mt, qa = load_questions(f)
    assert (mt.task, mt.text, mt.turns) == ("mt_bench", "Write.", ("Write.", "Rewrite it."))
    assert qa.turns == ("Why?",)
    f.write_text(json.dumps({"question_id": 3, "category": "qa", "turns": [["x"]]}) + "\n")
    with pytest.raises(ValueError, match=r"question.jsonl:1: not a Spec-Bench question"):
        load_questions(f)
