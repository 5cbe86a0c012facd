"""bench evospec: the recovery count, the topic filter, and (bench marker) a tiny real run."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from specjax.bench.evospec import (
    DOMAINS,
    by_turn,
    conversation_starts,
    recovery,
    run_evospec_bench,
)
from specjax.speculative import TreeSpec


def test_recovery_counts_requests_until_the_trailing_mean_is_close():
    full = [2.0] * 10
    mal = [2.0] * 5 + [1.0, 1.5, 1.9, 2.0, 2.0]
    # Within 3% of 2.0 needs a trailing mean >= 1.94. Windows of 5 from request 5 never get
    # there (the last is 1.68); windows of 2 do at the 4th request, (1.9 + 2.0) / 2 = 1.95.
    assert recovery(mal, full, 5) is None
    assert recovery(mal, full, 5, window=2) == 4
    assert recovery([2.0] * 6, full[:6], 3) == 1


def test_domain_patterns_tell_the_topics_apart():
    import re

    code = re.compile(DOMAINS["code"], re.IGNORECASE)
    med = re.compile(DOMAINS["medical"], re.IGNORECASE)
    assert len(code.findall("Write a Python function that parses JSON, then a class")) >= 2
    assert not med.search("Write a Python function that parses JSON")
    assert len(med.findall("What treatment helps patients with this disease?")) >= 2


@pytest.mark.bench
def test_a_tiny_stream_runs_and_keeps_greedy_output(tmp_path):
    r = run_evospec_bench(None, None, per_domain=1, max_new_tokens=12, core=2048, n_dyn=32,
                          out=tmp_path / "e.json", progress=False)
    assert r["greedy_identical"] and len(r["mal"]["evospec"]) == 2
    assert json.loads((tmp_path / "e.json").read_text())["switch_at"] == 1
    assert (tmp_path / "e.png").stat().st_size > 0


def test_paired_gain_sees_a_small_consistent_lift_through_the_prompt_spread():
    from specjax.bench.evospec import paired_gain

    rs = np.random.default_rng(0)
    base = rs.uniform(1.5, 2.5, 20)  # prompt-to-prompt spread 10x the effect
    g = paired_gain(base + 0.05 + rs.normal(0, 0.01, 20), base)
    assert g["wins"] == 20 and g["ci95"][0] > 0.03 and abs(g["mean"] - 0.05) < 0.01
    # No effect: the interval straddles zero.
    g0 = paired_gain(base + rs.normal(0, 0.05, 20), base)
    assert g0["ci95"][0] < 0 < g0["ci95"][1]
    with pytest.raises(ValueError, match="at least one request"):
        paired_gain([], [])


def test_a_gain_carried_by_one_conversation_is_not_significant_by_conversation():
    from specjax.bench.evospec import paired_gain

    # Five conversations of ten turns: one gains 0.2 on every turn, the others nothing. By
    # request the 10 wins look consistent; resampling whole conversations draws the lucky
    # one in only some draws (none in about a third), so the interval reaches zero.
    base = np.random.default_rng(1).uniform(1.5, 2.5, 50)
    lift = np.r_[np.full(10, 0.2), np.zeros(40)]
    groups = np.repeat([16105, 16118, 16149, 16174, 16175], 10)
    by_request = paired_gain(base + lift, base)
    by_conversation = paired_gain(base + lift, base, groups=groups)
    assert by_request["ci95"][0] > 0 and by_conversation["ci95"][0] == 0.0
    assert by_conversation["groups"] == 5 and by_conversation["mean"] == by_request["mean"]
    # Unequal conversations: a draw's mean is over its requests, not its conversations.
    even = paired_gain([1.0, 1.0, 1.0, 0.0], [0.0] * 4, groups=[7, 7, 7, 9], draws=2000)
    assert even["ci95"] == [0.0, 1.0] and abs(even["mean"] - 0.75) < 1e-12
    with pytest.raises(ValueError, match="3 labels for 4 requests"):
        paired_gain([1.0] * 4, [0.0] * 4, groups=[1, 1, 2])


def test_bad_configurations_domains_and_steps_are_refused_before_any_model_loads():
    with pytest.raises(ValueError, match="configs must be some of full, fr, buffer"):
        run_evospec_bench("/nonexistent", None, configs=["fr", "eagle"], progress=False)
    with pytest.raises(ValueError, match="unknown domains"):
        run_evospec_bench("/nonexistent", None, domains=("code", "sports"), progress=False)
    with pytest.raises(ValueError, match="steps_per_update must be >= 1"):
        run_evospec_bench("/nonexistent", None, steps_per_update=0, progress=False)
    with pytest.raises(ValueError, match="a window of >= 32 samples, got 8"):
        run_evospec_bench("/nonexistent", None, replay=8, progress=False)
    with pytest.raises(ValueError, match="support must be one of topk, vocab"):
        run_evospec_bench("/nonexistent", None, support="full", progress=False)
    with pytest.raises(ValueError, match="LoRA target 'mlp': expected one of"):
        run_evospec_bench("/nonexistent", None, lora_targets=("wq", "mlp"), progress=False)
    with pytest.raises(ValueError, match="needs two or more domains"):
        run_evospec_bench("/nonexistent", None, domains=("code",), progress=False)
    with pytest.raises(ValueError, match="pass --domains dialogue alone"):
        run_evospec_bench("/nonexistent", None, domains=("code", "dialogue"), progress=False)
    with pytest.raises(ValueError, match="each domain once per stream"):
        run_evospec_bench("/nonexistent", None, domains=("dialogue:code", "dialogue:code"),
                          progress=False)
    with pytest.raises(ValueError, match="conversations .* or single prompts, not both"):
        run_evospec_bench("/nonexistent", None, domains=("dialogue:code", "legal"),
                          progress=False)
    with pytest.raises(ValueError, match="resetting per conversation needs conversations"):
        run_evospec_bench("/nonexistent", None, reset_per_conversation=True, progress=False)
    with pytest.raises(ValueError, match="skip must be >= 0"):
        run_evospec_bench("/nonexistent", None, skip=-1, progress=False)


def test_a_later_skip_gives_a_stream_of_other_prompts_and_translate_is_a_domain(
        tmp_path, monkeypatch):
    import specjax.train.data
    from specjax.bench.evospec import add_parser, domain_prompts

    class Words:  # token counts only bound the prompt length here
        def encode(self, text: str) -> list[str]:
            return text.split()

    german = ("Die Krise ist in der Mittelschicht angekommen, und viele Familien müssen jetzt "
              "mit weniger Geld auskommen als früher.")
    records = [{"conversations": [
        {"from": "human", "value": f"Case {i}: can the court enforce this contract clause?"},
        {"from": "gpt", "value": "It depends." if i % 2 else f"Nein.\n\n{german} {i}"}]}
        for i in range(8)]
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(records))
    monkeypatch.setattr(specjax.train.data, "sharegpt_path", lambda: src)
    translate = domain_prompts(Words(), "translate", 3, skip=0, max_tokens=256, exclude=set())
    assert all(t.startswith("Translate") and german in t for t in translate)
    first = domain_prompts(Words(), "legal", 2, skip=0, max_tokens=256, exclude=set())
    later = domain_prompts(Words(), "legal", 2, skip=4, max_tokens=256, exclude=set())
    assert [p.split(":")[0] for p in first + later] == ["Case 0", "Case 1", "Case 4", "Case 5"]
    with pytest.raises(ValueError, match="only 1 usable legal prompts after record 7"):
        domain_prompts(Words(), "legal", 2, skip=7, max_tokens=256, exclude=set())
    parser = argparse.ArgumentParser().add_subparsers()
    assert add_parser(parser).parse_args(["--skip", "2100"]).skip == 2100


def test_a_topics_conversations_are_those_whose_first_turn_is_of_the_topic(
        tmp_path, monkeypatch):
    import specjax.train.data
    from specjax.bench.evospec import clear_topic, conversation_turns

    class Words:
        def encode(self, text: str) -> list[str]:
            return text.split()

    asks = {"legal": "can the court enforce this contract clause?",
            "code": "why does this python function raise in my class?"}

    def conversation(i: int, topic: str, turns: int) -> dict:
        first = f"Case {i}: {asks[topic]}"
        later = [f"And then, in case {i}, turn {k}?" for k in range(1, turns)]
        return {"conversations": [m for t in [first, *later] for m in (
            {"from": "human", "value": t}, {"from": "gpt", "value": "Well."})]}

    # Record 1 is legal but too short (3 user turns); record 3 is code.
    records = [conversation(0, "legal", 4), conversation(1, "legal", 3),
               conversation(2, "legal", 5), conversation(3, "code", 6)]
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(records))
    monkeypatch.setattr(specjax.train.data, "sharegpt_path", lambda: src)
    legal = conversation_turns(Words(), "dialogue:legal", 7, skip=0, exclude=set())
    assert [(t.record, t.index) for t in legal] == [(0, 0), (0, 1), (0, 2), (0, 3), (2, 0),
                                                    (2, 1), (2, 2)]
    code = conversation_turns(Words(), "dialogue:code", 6, skip=0, exclude=set())
    assert {t.record for t in code} == {3} and code[0].text.startswith("Case 3")
    assert clear_topic(asks["legal"], "legal") and not clear_topic(asks["legal"], "code")
    assert not clear_topic("a python class in court", "code")  # a legal keyword too
    # A conversations-only topic is told apart from DOMAINS', not they from it: a code prompt
    # that mentions a business stays code, so the single-prompt streams keep their prompts.
    assert clear_topic("a marketing strategy for my startup's brand", "business")
    assert not clear_topic("a marketing strategy for my startup's python api", "business")
    assert clear_topic("a python api for my startup's marketing", "code")


def test_followup_is_a_domain_of_later_turns_with_their_context(tmp_path, monkeypatch):
    import specjax.train.data
    from specjax.bench.evospec import domain_prompts

    class Chat:  # one id per word, a header id per turn
        chat_template = "{{ turns }}"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
            return [i for m in messages for i in [1] + [2] * len(m["content"].split())]

    records = [{"conversations": [
        {"from": "human", "value": f"Question {i} about rivers?"},
        {"from": "gpt", "value": "Rivers flow. " * (1 + 20 * (i == 1))},
        {"from": "human", "value": f"And follow-up number {i} about lakes?"}]}
        for i in range(4)]
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(records))
    monkeypatch.setattr(specjax.train.data, "sharegpt_path", lambda: src)
    got = domain_prompts(Chat(), "followup", 2, skip=0, max_tokens=30, exclude=set())
    # Record 1's context is over 30 tokens: records 0 and 2, three turns each, a batch of one.
    assert [p[0].count(1) for p in got] == [3, 3] and len(got[1][0]) == len(got[0][0])
    with pytest.raises(ValueError, match="only 1 usable followup prompts after record 3"):
        domain_prompts(Chat(), "followup", 2, skip=3, max_tokens=30, exclude=set())


@pytest.mark.bench
def test_a_tiny_dialogue_goes_on_from_the_targets_replies_and_resumes(tmp_path):
    kw = dict(domains=("dialogue",), per_domain=3, max_new_tokens=8, core=2048,
              configs=["fr", "lora"], out=tmp_path / "d.json", progress=False)
    r = run_evospec_bench(None, None, **kw)
    assert r["greedy_identical"] and r["switch_at"] is None and r["split_at"] == 1
    assert r["conversation_starts"] == [0] and set(r["paired_gain"]["lora-fr"]) == {
        "all", "second_half", "all_by_conversation"}
    partial = [json.loads(line) for line in (tmp_path / "d.partial.jsonl").read_text()
               .splitlines()]
    assert [p["turn"] for p in partial] == [0, 1, 2] and all(p["reply"] for p in partial)
    # Cut after two turns: the rerun rebuilds the conversation from the stored replies.
    (tmp_path / "d.partial.jsonl").write_text("\n".join(
        json.dumps(p) for p in partial[:2]) + "\n")
    again = run_evospec_bench(None, None, **kw)
    assert again["mal"] == r["mal"]


def test_conversations_start_where_the_record_changes():
    assert conversation_starts([7, 7, 9, 9, 9, 7]) == [0, 2, 5]
    assert conversation_starts([]) == []


def test_by_turn_averages_turn_k_over_the_conversations_that_reach_it():
    recs = [{"turn": t, "fr": {"mal": m}, "lora": {"mal": m + d}}
            for t, m, d in [(0, 1.0, 0.0), (1, 2.0, 0.5), (2, 3.0, 1.0),  # one conversation
                            (0, 2.0, 0.0), (1, 1.0, -0.5)]]                # and a shorter one
    got = by_turn(recs, ["fr", "lora"])
    assert got["turn"] == [0, 1, 2] and got["conversations"] == [2, 2, 1]
    assert got["mal"] == {"fr": [1.5, 1.5, 3.0], "lora": [1.5, 1.5, 4.0]}


@pytest.mark.bench
def test_a_reset_per_conversation_starts_each_one_from_the_frozen_drafter(tmp_path):
    # Record 16184 has 12 usable user turns (the thirty-fourth session's stream D2): the 13th
    # request is the next conversation's first turn.
    kw = dict(domains=("dialogue",), per_domain=13, max_new_tokens=16, core=2048, lr=1e-3,
              steps_per_update=2, skip=16177, reset_per_conversation=True,
              configs=["fr", "lora"], tree=TreeSpec(kind="chain", depth=3),
              out=tmp_path / "r.json", progress=False)
    r = run_evospec_bench(None, None, **kw)
    assert r["conversation_starts"] == [0, 12] and r["greedy_identical"]
    assert r["lora_updates"]["lora"] > 0 and r["config"]["reset"] == "per conversation"
    # Zero deltas and the same head: the first turn of each conversation drafts as fr does.
    assert [r["mal"]["lora"][i] for i in (0, 12)] == [r["mal"]["fr"][i] for i in (0, 12)]
    # A rerun resumes every request and still reports each update's time (from the records).
    again = run_evospec_bench(None, None, **kw)
    assert len(r["lora_update_s"]["lora"]) == r["lora_updates"]["lora"]
    assert again["lora_update_s"] == r["lora_update_s"] and again["mal"] == r["mal"]


@pytest.mark.bench
def test_a_guarded_adapter_drafts_as_the_frozen_one_until_deployed(tmp_path):
    from specjax.bench.partial import partial_path, read_partial

    out = tmp_path / "g.json"
    r = run_evospec_bench(None, None, domains=("dialogue",), per_domain=12, max_new_tokens=16,
                          core=2048, lr=1e-3, steps_per_update=2, skip=16177, guard=True,
                          configs=["fr", "lora"], tree=TreeSpec(kind="chain", depth=3),
                          out=out, progress=False)
    assert r["greedy_identical"] and r["config"]["guard"] and r["lora_updates"]["lora"] > 0
    records = read_partial(partial_path(out))
    assert [rec["lora"]["adapted"] for rec in records][0] is False
    assert r["adapter_drafted"]["lora"] == np.mean([rec["lora"]["adapted"] for rec in records])
    # Undeployed, the lora session drafts with the frozen drafter and fr's head: fr's drafts.
    for rec in records:
        if not rec["lora"]["adapted"]:
            assert rec["lora"]["mal"] == rec["fr"]["mal"]
    # The next request is the adapter's when it won on this one (the guard's counts).
    for rec, nxt in zip(records[:-1], records[1:], strict=True):
        wins, losses = rec["lora"]["guard"]
        assert nxt["lora"]["adapted"] == (wins > losses)


@pytest.mark.bench
def test_a_switch_between_topics_conversations_resets_at_each_one(tmp_path):
    # Past record 16,000 the first code conversation of 4+ turns is 16,034, the first legal
    # one 16,463: two turns of each.
    r = run_evospec_bench(None, None, domains=("dialogue:code", "dialogue:legal"),
                          per_domain=2, max_new_tokens=12, core=2048, lr=1e-3,
                          reset_per_conversation=True, configs=["fr", "lora"],
                          tree=TreeSpec(kind="chain", depth=2), out=tmp_path / "t.json",
                          progress=False)
    assert r["switch_at"] == 2 and r["conversation_starts"] == [0, 2]
    assert list(r["per_conversation"]["fr"]) == ["16034", "16463"] and r["greedy_identical"]
    assert set(r["paired_gain"]["lora-fr"]) == {"all", "after_switch", "all_by_conversation"}
    assert r["paired_gain"]["lora-fr"]["all_by_conversation"]["groups"] == 2
    assert r["by_turn"]["turn"] == [0, 1] and r["by_turn"]["conversations"] == [2, 2]
    assert [r["mal"]["lora"][i] for i in (0, 2)] == [r["mal"]["fr"][i] for i in (0, 2)]
    assert (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.bench
def test_a_subset_of_configurations_reports_what_it_can(tmp_path):
    r = run_evospec_bench(None, None, per_domain=1, max_new_tokens=12, core=2048, n_dyn=32,
                          configs=["lora", "fr"], steps_per_update=2, out=tmp_path / "e.json",
                          tree=TreeSpec(kind="chain", depth=2), progress=False)
    assert set(r["mal"]) == {"fr", "lora"} and r["greedy_identical"]
    assert r["config"]["tree"]["kind"] == "chain"
    assert r["recovery_requests"] is None  # no full head to recover to
    assert set(r["paired_gain"]) == {"lora-fr"}
    assert r["paired_gain"]["lora-fr"]["all"]["requests"] == 2
    assert r["memory"]["lora_trainable"] > 0


def test_the_tree_flags_name_the_streams_tree_and_default_to_eagle2():
    from specjax.bench.evospec import add_parser
    from specjax.bench.trees import tree_from_args

    parser = argparse.ArgumentParser().add_subparsers()
    p = add_parser(parser)
    assert tree_from_args(p.parse_args([])) == TreeSpec()  # what every earlier stream ran
    chain = tree_from_args(p.parse_args(["--tree", "chain", "--tree-depth", "3"]))
    assert (chain.kind, chain.depth, chain.lookup) == ("chain", 3, 0)


def test_the_default_lora_targets_are_the_online_configs():
    # The bench leaves the targets out of its resume key at this default.
    from specjax.bench.evospec import DEFAULT_LORA_TARGETS
    from specjax.train.online import OnlineConfig

    assert DEFAULT_LORA_TARGETS == OnlineConfig().targets


def test_the_default_stream_starts_where_training_data_stops():
    from specjax.bench.evospec import DEFAULT_DOMAINS, DEFAULT_SKIP, HELD_OUT_START, add_parser
    from specjax.train.data import CALIBRATION_START

    assert DEFAULT_SKIP == HELD_OUT_START == CALIBRATION_START
    parser = argparse.ArgumentParser().add_subparsers()
    args = add_parser(parser).parse_args([])
    assert args.skip == CALIBRATION_START and args.domains == ",".join(DEFAULT_DOMAINS)
    # An earlier start is allowed (ShareGPT has few medical or legal prompts past it) but
    # says that the drafter trained on those prompts.
    with pytest.warns(UserWarning, match="drafter training reads those records"), \
            pytest.raises(ValueError, match="no such checkpoint folder"):
        run_evospec_bench("/nonexistent", None, skip=600, progress=False)
