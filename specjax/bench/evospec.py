"""``specjax bench evospec``: a topic switch, as in EvoSpec's figure 2.

A stream of requests, first from one domain and then from another (ShareGPT first user
turns chosen by keywords: programming, medicine or law; or ``translate``: ShareGPT's
non-English paragraphs as translation requests, a task where this target mostly copies its
source; or ``followup``: later user turns with the conversation before them as context,
any topic; programming then translation by default), runs in order through five
configurations, each with its own state carried from request to request. ``dialogue`` (alone,
no switch) is the paper's appendix F instead: the user turns of long conversations in order,
each request the conversation so far with the target's own replies
(:mod:`specjax.bench.dialogue`). ``dialogue:TOPIC`` (TOPIC one of code, medical, legal,
business) is a topic's conversations played the same way, so ``--domains
dialogue:code,dialogue:legal`` is the topic switch as the issue words it: programming
conversations, then legal ones. The configurations:

* ``full``: the full vocabulary, a frozen drafter;
* ``fr``: FR-Spec's static core (the same N as EvoSpec's core), frozen;
* ``buffer``: EvoSpec's core + dynamic buffer, frozen drafter;
* ``lora``: the static core with online LoRA alignment;
* ``evospec``: core + buffer + LoRA (both halves).

Greedy, so every configuration's tokens must equal vanilla decoding's (checked per
request). Reported: MAL per request per configuration, the mean before and after the
switch, how many requests after the switch EvoSpec needs to come within 3% of the full
head's MAL (a trailing mean of 5), LoRA updates and their time, and the LoRA path's
trainable and optimiser bytes against full-parameter online updates. JSON + a plot of MAL
over the stream with the switch marked. Spec-Bench's questions are never in the stream,
and by default neither is a prompt drafter training reads (``--skip``).

Resumable: after each request, the record goes to ``<out>.partial.jsonl`` and each
configuration's state to ``<out>.state/<config>/`` (orbax); a rerun restores and goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # annotations only; the functions import it when they run
    from specjax.speculative import TreeSpec

DOMAINS = {
    "code": r"\b(python|javascript|java|c\+\+|function|class|def|code|compile|sql|api|bug|"
            r"script|typescript|react|regex)\b",
    "medical": r"\b(patient|patients|disease|symptom|symptoms|clinical|diagnosis|medical|"
               r"treatment|therapy|cancer|drug|doctor|health)\b",
    "legal": r"\b(law|legal|court|contract|attorney|lawsuit|statute|clause|liability|"
             r"plaintiff|defendant|jurisdiction)\b",
}
# Not a topic of first user turns but a task: every non-English paragraph as a request
# (specjax.train.prompts.translations).
TRANSLATE = "translate"
# A later user turn with its conversation (specjax.train.prompts.followups), as token ids:
# past the record where training stops, ShareGPT has about 2,100 of them within 1,024 tokens.
FOLLOWUP = "followup"
FOLLOWUP_MAX_TOKENS = 512  # a context, not one turn: longer than the others' 256
# Long conversations turn by turn (specjax.bench.dialogue): a stream of its own, no switch.
DIALOGUE = "dialogue"
# Topics of conversations (dialogue:TOPIC): DOMAINS, and topics that only conversations
# take. A later topic is told apart from DOMAINS' (none of their keywords), not they from it,
# so the single-prompt domains keep the prompts earlier streams ran on.
TOPICS = {**DOMAINS,
          "business": r"\b(marketing|business|customers|customer|brand|sales|startup|company|"
                      r"product|market|strategy)\b"}
# A topic's conversations turn by turn ("dialogue:code"): domains a switch can join. A
# topic's conversations are rarer than long ones of any topic (past the held-out record,
# ShareGPT has 148 code, 114 business, 23 legal and 4 medical turns of conversations of 4+
# usable user turns), so fewer turns suffice.
TOPIC_DIALOGUES = tuple(f"{DIALOGUE}:{d}" for d in TOPICS)
MIN_TOPIC_TURNS = 4
STREAM_DOMAINS = (*DOMAINS, TRANSLATE, FOLLOWUP, DIALOGUE, *TOPIC_DIALOGUES)
CONFIGS = ("full", "fr", "buffer", "lora", "evospec")
# OnlineConfig.targets' default (the paper's W_q, W_v), written here because
# specjax.train.online loads JAX and this module's CLI flags must not (a test keeps the two
# equal); the resume key names the targets only when they differ from it.
DEFAULT_LORA_TARGETS = ("wq", "wv")
# ShareGPT records skipped before the stream's prompts are chosen: by default the stream
# starts where training data stops (specjax.train.data.CALIBRATION_START, written here
# because that module loads JAX; a test keeps the two equal). Drafter training reads the
# records before it, and the shipped drafter was trained on the target's answers to their
# prompts, so a stream from there measures the drafter on its own training text (on code
# prompts its first draft agrees 0.61 of the time there, 0.48 past this record;
# docs/benchmarks.md), where an online adapter has little left to learn. Past it, ShareGPT
# has 77 code and 72 translation prompts, but only 4 medical and 1 legal ones.
HELD_OUT_START = 16_000
DEFAULT_SKIP = HELD_OUT_START
DEFAULT_DOMAINS = ("code", TRANSLATE)
_TOPICS = {d: re.compile(p, re.IGNORECASE) for d, p in TOPICS.items()}


def clear_topic(text: str, topic: str) -> bool:
    """Is ``text`` clearly about ``topic`` (a key of TOPICS): two or more of its keywords
    and none of another DOMAINS topic's."""
    return (len(_TOPICS[topic].findall(text)) >= 2
            and not any(_TOPICS[d].search(text) for d in DOMAINS if d != topic))


def conversational(domain: str) -> bool:
    """Are ``domain``'s requests turns of conversations (``dialogue``, ``dialogue:TOPIC``)?"""
    return domain.partition(":")[0] == DIALOGUE


def conversation_turns(tokenizer: Any, domain: str, n: int, *, skip: int,
                       exclude: set) -> list[Any]:
    """The first ``n`` turns (:class:`specjax.bench.dialogue.Turn`) of a conversational
    domain from ShareGPT record ``skip`` on: long conversations of any topic for
    ``dialogue``, conversations of MIN_TOPIC_TURNS or more whose first user turn is clearly
    of the topic for ``dialogue:TOPIC``."""
    from specjax.bench.dialogue import traces

    if domain == DIALOGUE:
        return traces(tokenizer, n, skip=skip, exclude=exclude)
    topic = domain.partition(":")[2]
    return traces(tokenizer, n, skip=skip, exclude=exclude, min_turns=MIN_TOPIC_TURNS,
                  first_turn=lambda text: clear_topic(text, topic))


def domain_prompts(tokenizer: Any, domain: str, n: int, *, skip: int, max_tokens: int,
                   exclude: set) -> list[Any]:
    """The first ``n`` prompts of a domain from ShareGPT record ``skip`` on: first user turns
    matching its keywords, for ``translate`` every non-English paragraph as a request, for
    ``followup`` every later user turn with its conversation, chat-templated (``[ids]``, a
    batch of one, where the others are text)."""
    from specjax.train.data import sharegpt_conversations
    from specjax.train.prompts import (
        encode_conversation,
        followups,
        prompt_text,
        shares_shingle,
        translations,
    )

    def requests(msgs: list[dict[str, str]]) -> list[Any]:
        if domain == FOLLOWUP:
            return followups(msgs)
        if domain == TRANSLATE:
            return translations(msgs)
        text = msgs[0]["content"]
        return [text] if clear_topic(text, domain) else []

    out: list[Any] = []
    for _, msgs in sharegpt_conversations(skip):
        for item in requests(msgs):
            if shares_shingle(prompt_text(item), exclude):
                continue
            # Text is counted without the chat template, as `specjax.generate` adds it later;
            # a conversation is sent templated, as ids.
            prompt = item if isinstance(item, str) else [encode_conversation(tokenizer, item)]
            n_tokens = len(tokenizer.encode(item) if isinstance(item, str) else prompt[0])
            if n_tokens > max_tokens:
                continue
            out.append(prompt)
            if len(out) == n:
                return out
    raise ValueError(f"ShareGPT has only {len(out)} usable {domain} prompts after record "
                     f"{skip}; lower --per-domain")


def _session(config: str, target: Any, drafter: Any, core: int, n_dyn: int, oc: Any) -> Any:
    from specjax.train.online_session import OnlineSession
    from specjax.vocab import resolve_head

    spec = {"full": "full", "fr": f"fr:{core}", "lora": f"fr:{core}"}.get(
        config, f"evospec:{core}+{n_dyn}")
    return OnlineSession(target, drafter, resolve_head(spec, target, drafter), oc=oc,
                         adapt=config in ("lora", "evospec"))


def recovery(mal: Sequence[float], ref: Sequence[float], start: int, *, window: int = 5,
             within: float = 0.03) -> int | None:
    """Requests after ``start`` until the trailing mean of ``mal`` is within ``within`` of
    ``ref``'s (None if never)."""
    for i in range(start, len(mal)):
        lo = max(start, i - window + 1)
        if np.mean(mal[lo:i + 1]) >= (1 - within) * np.mean(ref[lo:i + 1]):
            return i - start + 1
    return None


def paired_gain(a: Sequence[float], b: Sequence[float], *, groups: Sequence[Any] | None = None,
                draws: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Does ``a`` beat ``b`` on the same requests? Mean per-request difference a - b with a
    95% bootstrap interval (requests resampled with replacement), and the wins / losses /
    ties. The pairing removes the prompt-to-prompt spread (easy and hard requests move both
    configurations alike), which is most of MAL's variance in a stream.

    groups: a label per request (its conversation). Given, the bootstrap resamples whole
    groups, each draw's mean taken over the requests of the groups drawn: the turns of one
    conversation share its adapter and its text, so they are not independent draws, and
    this interval is the wider, honest one for a conversation stream (``groups`` in the
    result counts them)."""
    d = np.asarray(a, float) - np.asarray(b, float)
    if d.size == 0:
        raise ValueError("paired_gain needs at least one request")
    rs = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    if groups is None:
        means = d[rs.integers(0, d.size, (draws, d.size))].mean(axis=1)
    else:
        if len(groups) != d.size:
            raise ValueError(f"groups has {len(groups)} labels for {d.size} requests")
        _, which = np.unique(np.asarray(groups), return_inverse=True)
        sums, counts = np.bincount(which, weights=d), np.bincount(which)
        pick = rs.integers(0, sums.size, (draws, sums.size))
        means = sums[pick].sum(axis=1) / counts[pick].sum(axis=1)
        out["groups"] = int(sums.size)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"mean": float(d.mean()), "ci95": [float(lo), float(hi)], "wins": int((d > 0).sum()),
            "losses": int((d < 0).sum()), "ties": int((d == 0).sum()), "requests": int(d.size),
            **out}


def _gains(mal: dict[str, list[float]], split: int, later: str = "after_switch",
           conversations: Sequence[Any] | None = None) -> dict[str, Any]:
    """LoRA's effect (lora - fr, evospec - buffer: the same head with and without it) and
    the buffer's (buffer - fr), over the whole stream and from request ``split`` on (key
    ``later``: after the switch, or a dialogue's second half); with ``conversations`` (each
    request's), also over the whole stream with conversations resampled whole
    (``all_by_conversation``)."""
    out: dict[str, Any] = {}
    for a, b in (("lora", "fr"), ("evospec", "buffer"), ("buffer", "fr")):
        if a in mal and b in mal:
            out[f"{a}-{b}"] = {"all": paired_gain(mal[a], mal[b]),
                               later: paired_gain(mal[a][split:], mal[b][split:])}
            if conversations is not None:
                out[f"{a}-{b}"]["all_by_conversation"] = paired_gain(
                    mal[a], mal[b], groups=conversations)
    return out


def conversation_starts(records: Sequence[Any]) -> list[int]:
    """Where each conversation begins in a dialogue stream: the indices whose ShareGPT
    record (``records``, one per request, in stream order) differs from the one before."""
    return [i for i, r in enumerate(records) if i == 0 or r != records[i - 1]]


def by_turn(records: Sequence[dict[str, Any]], configs: Sequence[str]) -> dict[str, Any]:
    """Each configuration's MAL at turn k of a conversation, averaged over the conversations
    that reach it (appendix F's x-axis: how far into a conversation the request is).

    records: dialogue records (``turn``, and ``{config: {"mal": ...}}``). Returns ``turn``
    (the turn indices present, ascending), ``conversations`` (how many reach each) and
    ``mal`` ({config: [mean MAL per turn]})."""
    turns = sorted({r["turn"] for r in records})
    at = {k: [r for r in records if r["turn"] == k] for k in turns}
    return {"turn": turns, "conversations": [len(at[k]) for k in turns],
            "mal": {c: [float(np.mean([r[c]["mal"] for r in at[k]])) for k in turns]
                    for c in configs}}


def step_cost(target: Any, drafter: Any, *, core: int = 8192, n_dyn: int = 256,
              context: int = 512, runs: int = 20,
              tree: TreeSpec | None = None) -> dict[str, Any]:
    """What keeping the buffer in the compiled loop costs per step (B = 1, best ms).

    * the draft phase (``tree``, a TreeSpec; None: the default EAGLE-2 tree) with
      ``fr:core`` against ``evospec:core+n_dyn`` (the buffer's rows gathered and scored at
      every expansion);
    * ``observe`` alone (the hit bookkeeping, and the ARC update under its ``lax.cond``)
      on a step without an OOV event and on one with (a token outside core and buffer),
      starting from a half-full buffer.
    """
    import jax
    import jax.numpy as jnp

    from specjax.bench.phases import draft_latency
    from specjax.bench.timing import time_calls
    from specjax.loop import bucket
    from specjax.speculative import TreeSpec, cache_capacity
    from specjax.vocab import resolve_head
    from specjax.vocab.head import Feedback

    tree = TreeSpec() if tree is None else tree
    cap = cache_capacity(context, 128, tree)
    heads = {"fr": resolve_head(f"fr:{core}", target, drafter),
             "evospec": resolve_head(f"evospec:{core}+{n_dyn}", target, drafter)}
    out: dict[str, Any] = {"draft_ms": {
        k: draft_latency(target, drafter, tree, context=context, capacity=cap,
                         out_len=bucket(128), runs=runs, head=h)["best_ms"]
        for k, h in heads.items()}}
    evo = heads["evospec"]
    v = target.cfg.vocab_size
    outside = np.flatnonzero(~np.asarray(evo.in_core))
    state = evo.init_state(1)
    observe = jax.jit(evo.observe)
    rs = np.random.RandomState(0)
    logits = jnp.asarray(rs.randn(1, v).astype(np.float32))

    def committing(tok: int) -> Feedback:
        """A step that committed ``tok`` as its bonus (and nothing else)."""
        return Feedback(committed=jnp.asarray([[tok, -1, -1, -1, -1]]), bonus=jnp.asarray([tok]),
                        logits=logits, hidden=jnp.zeros((1, target.cfg.hidden_size)),
                        live=jnp.ones((1,), bool))

    for tok in outside[: n_dyn // 2]:  # half-fill the buffer through real events
        state = observe(state, committing(int(tok)))
    core_tok = int(np.asarray(evo.core_ids)[5])
    for name, tok in (("observe_no_event_ms", core_tok), ("observe_event_ms", int(outside[-1]))):
        fb = committing(tok)
        out[name] = time_calls(lambda fb=fb: observe(state, fb), runs)["best_ms"]
    out["draft_overhead"] = out["draft_ms"]["evospec"] / out["draft_ms"]["fr"]
    out["occupancy"] = int(np.asarray(state.arc.ids != -1).sum())
    return out


def run_evospec_bench(model: str | None, drafter_dir: str | None, *,
                      domains: Sequence[str] = DEFAULT_DOMAINS, per_domain: int = 20,
                      max_new_tokens: int = 128, core: int = 8192, n_dyn: int = 256,
                      lr: float = 1e-5, steps_per_update: int = 1, replay: int = 0,
                      support: str = "topk",
                      lora_targets: Sequence[str] = DEFAULT_LORA_TARGETS,
                      skip: int = DEFAULT_SKIP,
                      reset_per_conversation: bool = False, guard: bool = False,
                      tree: TreeSpec | None = None,
                      configs: Sequence[str] = CONFIGS,
                      out: str | Path = "results/bench_evospec.json",
                      progress: bool = True) -> dict[str, Any]:
    """Run the topic-switch stream (``per_domain`` requests of each domain, in order)
    through ``configs`` and write ``out`` (JSON) and its plot; returns the JSON's dict.

    ``lr``, ``steps_per_update``, ``replay`` and ``support`` set the online LoRA (the
    paper's: 1e-5, one step per full replay buffer, emptied by each update; ``replay`` > 0
    keeps a window of that many samples and draws each step's batch from it; ``support``
    "vocab" adds the drafter's mass outside the target's top-K to the loss;
    ``lora_targets`` the matrices it adapts, of ``LORA_TARGETS``, "@i" for drafter layer
    i). ``reset_per_conversation`` (conversational domains only) resets every
    configuration's state (:meth:`OnlineSession.reset`) at each new conversation, as a
    server keeps one session per conversation, where by default the state carries from one
    conversation into the next. ``guard`` (not the paper's, OnlineConfig.guard) lets the
    adapter draft a request only after it beat the frozen drafter on the one before.
    ``tree`` (a TreeSpec) is the draft tree of every
    configuration; None: TreeSpec's default, the EAGLE-2 tree (the paper drafts EAGLE-3
    trees). Raises ValueError for an unknown configuration or domain, conversations mixed
    with single prompts, or a reset without conversations."""
    import jax
    from tqdm.auto import tqdm

    import specjax
    from specjax.bench.common import first_mismatch, machine_info, write_json
    from specjax.bench.dialogue import Histories
    from specjax.bench.partial import append_record, partial_path, read_partial
    from specjax.bench.phases import resolve_drafter
    from specjax.bench.questions import resolve_questions
    from specjax.defaults import resolve_model
    from specjax.speculative import TreeSpec
    from specjax.train.online import OnlineConfig
    from specjax.train.prompts import load_exclusions

    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        raise ValueError(f"configs must be some of {', '.join(CONFIGS)}; got {list(configs)}")
    configs = [c for c in CONFIGS if c in configs]  # a fixed order, whatever was asked
    if unknown := [d for d in domains if d not in STREAM_DOMAINS]:
        raise ValueError(f"unknown domains {unknown}; choose from {', '.join(STREAM_DOMAINS)}")
    if len(set(domains)) < len(domains):
        # A conversation played twice would go on from its own replies, a prompt repeat.
        raise ValueError(f"each domain once per stream, got {list(domains)}")
    dialogue = DIALOGUE in domains
    if dialogue and len(domains) > 1:
        raise ValueError(f"{DIALOGUE} is a stream of its own (long conversations, no topic "
                         f"switch): pass --domains {DIALOGUE} alone, or switch between "
                         f"topics' conversations ({', '.join(TOPIC_DIALOGUES)})")
    talk = [conversational(d) for d in domains]
    if any(talk) and not all(talk):
        raise ValueError(f"a stream is conversations ({DIALOGUE}, {DIALOGUE}:TOPIC) or single "
                         f"prompts, not both; got {list(domains)}")
    conversations = bool(domains) and all(talk)
    if reset_per_conversation and not conversations:
        raise ValueError(f"resetting per conversation needs conversations: --domains "
                         f"{DIALOGUE}, or topics' conversations such as "
                         f"{TOPIC_DIALOGUES[0]},{TOPIC_DIALOGUES[-1]} (the other domains' "
                         "requests are single prompts)")
    if len(domains) < 2 and not dialogue:
        raise ValueError(f"a topic switch needs two or more domains, got {list(domains)}")
    if steps_per_update < 1:
        raise ValueError(f"steps_per_update must be >= 1, got {steps_per_update}")
    if replay < 0 or 0 < replay < OnlineConfig.buffer:
        raise ValueError(f"replay must be 0 (the paper's buffer) or a window of >= "
                         f"{OnlineConfig.buffer} samples, got {replay}")
    lora_targets = tuple(lora_targets)
    # Refuses an unknown support or target before anything loads.
    oc = OnlineConfig(lr=lr, steps_per_update=steps_per_update, replay=replay,
                      support=support, targets=lora_targets, guard=guard)
    if skip < 0:
        raise ValueError(f"skip must be >= 0 ShareGPT records, got {skip}")
    if skip < HELD_OUT_START:
        warnings.warn(f"the stream's prompts start at ShareGPT record {skip}, before "
                      f"{HELD_OUT_START}: drafter training reads those records (the shipped "
                      "drafter was trained on the target's answers to them), so the frozen "
                      "drafter is measured on its training text and the online LoRA has "
                      "little left to learn; leave --skip at its default for a held-out "
                      "stream", stacklevel=2)
    out = Path(out)
    target = specjax.load(resolve_model(model, progress=progress))
    drafter, label = resolve_drafter(drafter_dir, target)
    exclude = load_exclusions([resolve_questions(None)])
    if conversations:
        stream = [(d, t) for d in domains for t in conversation_turns(
            target.tokenizer, d, per_domain, skip=skip, exclude=exclude)]
    else:
        stream = [(d, p) for d in domains for p in domain_prompts(
            target.tokenizer, d, per_domain, skip=skip, exclude=exclude,
            max_tokens=FOLLOWUP_MAX_TOKENS if d == FOLLOWUP else 256)]
    histories = Histories(target.tokenizer)
    new_conversation = set(conversation_starts(
        [item.record for _, item in stream])[1:]) if reset_per_conversation else set()
    tree = TreeSpec() if tree is None else tree
    config = {"domains": list(domains), "per_domain": per_domain, "core": core,
              "n_dyn": n_dyn, "lr": lr, "steps_per_update": steps_per_update,
              # Samples keep their whole context since the thirty-third session (they were
              # cut to 128 or --context rows): partial results from before do not resume.
              "lora_samples": "whole context",
              **({"replay": replay} if replay else {}),
              **({"support": support} if support != "topk" else {}),
              **({"lora_targets": list(lora_targets)}
                 if lora_targets != DEFAULT_LORA_TARGETS else {}),
              "skip": skip,  # always: the default moved (600 until it was held out)
              **({"reset": "per conversation"} if reset_per_conversation else {}),
              **({"guard": True} if guard else {}),
              **({"min_turns": MIN_TOPIC_TURNS}
                 if any(d in TOPIC_DIALOGUES for d in domains) else {}),
              "max_new_tokens": max_new_tokens, "drafter": label,
              "tree": dataclasses.asdict(tree), "configs": configs}
    config = json.loads(json.dumps(config))
    part, state_dir = partial_path(out), out.with_suffix(".state")
    done = [r for r in read_partial(part) if r.get("config") == config]
    if len(done) < len(read_partial(part)):  # another configuration's partial results
        part.unlink()
        shutil.rmtree(state_dir, ignore_errors=True)
        done = []
    sessions = {c: _session(c, target, drafter, core, n_dyn, oc) for c in configs}
    if done:
        for c, s in sessions.items():
            s.restore(state_dir / c)
    bar = tqdm(total=len(stream), initial=len(done), desc="bench evospec", disable=not progress)
    records = list(done)
    for i, (domain, item) in enumerate(stream):
        if i < len(done):
            if conversations:  # the conversation goes on from the replies so far
                histories.record(item, done[i]["reply"])
            continue
        if i in new_conversation:
            for s in sessions.values():
                s.reset()
        prompt = histories.prompt(item) if conversations else item
        vanilla = specjax.generate(target, prompt, max_new_tokens=max_new_tokens).tokens[0]
        rec: dict[str, Any] = {"config": config, "index": i, "domain": domain}
        if conversations:
            rec["reply"] = target.tokenizer.decode(vanilla, skip_special_tokens=True)
            rec["record"], rec["turn"] = item.record, item.index
            histories.record(item, rec["reply"])
        for c, s in sessions.items():
            before, timed = s.stats["updates"], len(s.stats["update_s"])
            drafted_adapted = s.adapter_drafts
            res = s.generate(prompt, max_new_tokens=max_new_tokens, tree=tree)
            rec[c] = {"mal": res.stats["mean_accepted_length"],
                      "mismatch_at": first_mismatch(res.tokens[0], vanilla),
                      "updates": s.stats["updates"] - before,
                      # In the record, not only the session: a saved session keeps no times.
                      "update_s": s.stats["update_s"][timed:],
                      **({"adapted": drafted_adapted, "guard": s.stats["guard"][-1]}
                         if guard and s.adapt else {}),
                      **{k: res.stats[k][0] for k in ("oov_events", "insertions",
                                                       "buffer_occupancy") if k in res.stats}}
            s.save(state_dir / c)
        append_record(part, rec)
        records.append(rec)
        bar.update()
    bar.close()
    # A dialogue has no switch: "before" and "after" are its first and second half.
    switch = None if dialogue else per_domain
    split = len(records) // 2 if dialogue else per_domain
    # Each request's conversation (its ShareGPT record), for conversation streams only.
    convs = [r["record"] for r in records] if conversations else None
    mal = {c: [r[c]["mal"] for r in records] for c in configs}
    adapted = [c for c in ("lora", "evospec") if c in sessions]
    result = {
        "config": config, "machine": machine_info(), "switch_at": switch, "split_at": split,
        "mal": mal, "greedy_identical": all(r[c]["mismatch_at"] is None for r in records
                                            for c in configs),
        "mean_before": {c: float(np.mean(v[:split])) for c, v in mal.items()},
        "mean_after": {c: float(np.mean(v[split:])) for c, v in mal.items()},
        # Requests after the switch until EvoSpec (or, without it, the buffer) is within 3%
        # of the full head; None when the run lacks either side or has no switch.
        "recovery_requests": None if dialogue else next(
            (recovery(mal[c], mal["full"], switch)
             for c in ("evospec", "buffer") if c in mal and "full" in mal), None),
        "paired_gain": _gains(mal, split, "second_half" if dialogue else "after_switch",
                              convs),
        **({"conversation_starts": conversation_starts(convs)} if conversations else {}),
        # Appendix F's figure: each conversation's MAL over its turns.
        **({"per_conversation": {c: {str(k): float(np.mean(
            [r[c]["mal"] for r in records if r["record"] == k]))
            for k in dict.fromkeys(convs)} for c in configs}}
           if conversations else {}),
        **({"by_turn": by_turn(records, configs)} if conversations else {}),
        "lora_updates": {c: sessions[c].stats["updates"] for c in adapted},
        "lora_update_s": {c: [t for r in records for t in r[c].get("update_s", [])]
                          for c in adapted},
        # --guard: the share of requests the adapter drafted (the frozen drafter the rest).
        **({"adapter_drafted": {c: float(np.mean([r[c]["adapted"] for r in records]))
                                for c in adapted}} if guard and adapted else {}),
        "memory": sessions[adapted[0]].memory() if adapted else None,
    }
    write_json(out, result)
    _plot(result, out.with_suffix(".png"))
    jax.clear_caches()
    return result


def _plot(result: dict, path: Path) -> None:
    from specjax.bench.common import pyplot, save_figure

    plt = pyplot()

    talk = "by_turn" in result  # conversations, turn by turn
    fig, axes = plt.subplots(1, 2 if talk else 1, figsize=(13 if talk else 8, 4),
                             squeeze=False)
    ax = axes[0, 0]
    for c, v in result["mal"].items():
        ax.plot(range(1, len(v) + 1), v, marker=".", label=c)
    for k in result.get("conversation_starts", [])[1:]:  # each conversation's first turn
        ax.axvline(k + 0.5, color="grey", ls=":", lw=1)
    if result["switch_at"] is not None:
        ax.axvline(result["switch_at"] + 0.5, color="k", ls="--", lw=1)
        ax.set_title(" -> ".join(result["config"]["domains"]) + " (switch dashed"
                     + (", a new conversation dotted)" if talk else ")"))
    else:
        ax.set_title(f"{len(result['conversation_starts'])} long conversations, turn by turn "
                     "(a new one dotted)")
    ax.set_xlabel("request")
    ax.set_ylabel("mean accepted length")
    ax.legend()
    if talk:  # how far into a conversation: turn k averaged over the conversations
        bt, right = result["by_turn"], axes[0, 1]
        for c, v in bt["mal"].items():
            right.plot(bt["turn"], v, marker=".", label=c)
        right.set_xlabel("turn of the conversation (mean over those that reach it)")
        right.set_ylabel("mean accepted length")
        right.legend()
    save_figure(fig, path)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("evospec", help="EvoSpec on a topic-switch stream",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--domains", default=",".join(DEFAULT_DOMAINS),
                   help=f"two or more of {', '.join(d for d in STREAM_DOMAINS if d != DIALOGUE)}"
                        f", in stream order (dialogue:TOPIC: that topic's conversations turn "
                        f"by turn; not mixed with single-prompt domains); or {DIALOGUE} alone "
                        "(long conversations turn by turn, no switch)")
    p.add_argument("--per-domain", type=int, default=20,
                   help="requests of each domain (dialogue: turns, conversation by "
                        "conversation, the last one maybe cut)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--core", type=int, default=8192)
    p.add_argument("--n-dyn", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps-per-update", type=int, default=1,
                   help="optax steps on each full replay buffer (default 1, the paper's)")
    p.add_argument("--replay", type=int, default=0,
                   help="0 (default, the paper's): each update fits the buffer's B samples, "
                        "then empties it; N: keep the last N samples and draw every step's "
                        "batch from them (experience replay, one update per B new samples)")
    p.add_argument("--support", choices=("topk", "vocab"), default="topk",
                   help="topk (default, the paper's eq. 5): KL between softmaxes over the "
                        "target's top-K; vocab: also -log of the drafter's mass on them, its "
                        "softmax over the whole vocabulary")
    p.add_argument("--lora-targets", default=",".join(DEFAULT_LORA_TARGETS),
                   help="matrices the online LoRA adapts (default wq,wv, the paper's; also "
                        "wk, wo, w_gate, w_up, w_down of the first drafter layer, NAME@i of "
                        "layer i of a deeper drafter, e.g. wq@1, and fc, its input fusion)")
    p.add_argument("--skip", type=int, default=DEFAULT_SKIP,
                   help="ShareGPT records skipped before the stream's prompts are chosen "
                        f"(default {DEFAULT_SKIP}, where drafter training data stops; an "
                        "earlier start measures the drafter on prompts it was trained on "
                        "and warns)")
    p.add_argument("--reset-per-conversation", action="store_true",
                   help="conversations only: reset every configuration's state (LoRA deltas, "
                        "optimiser, replay and vocabulary buffers) at each new conversation, "
                        "one session per conversation (default: carried across them)")
    p.add_argument("--guard", action="store_true",
                   help="not the paper's: the adapter drafts a request only after its first "
                        "drafts beat the frozen drafter's on the request before (text it was "
                        "not fitted on); otherwise the frozen drafter drafts and the adapter "
                        "goes on learning")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"which configurations to run, of {', '.join(CONFIGS)} (default all)")
    # Imported here, not at the top: it loads JAX, and this module's constants must not.
    from specjax.bench.trees import add_tree_args

    # Default EAGLE-2 (as every stream so far); a chain measures the drafter's argmax, which
    # EAGLE-2's top-k siblings partly stand in for.
    add_tree_args(p, auto=False)
    p.add_argument("--out", default="results/bench_evospec.json")
    p.add_argument("--step-cost", action="store_true",
                   help="only measure the per-step cost of the buffer (draft phase fr vs "
                        "evospec, observe with and without an OOV event) and print it")
    p.set_defaults(run=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    from specjax.bench.trees import tree_from_args

    tree = tree_from_args(args)
    if args.step_cost:
        import specjax
        from specjax.bench.phases import resolve_drafter
        from specjax.defaults import resolve_model

        target = specjax.load(resolve_model(args.model))
        drafter, _ = resolve_drafter(args.drafter, target)
        print(json.dumps(step_cost(target, drafter, core=args.core, n_dyn=args.n_dyn,
                                   tree=tree),
                         indent=1))
        return 0
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    r = run_evospec_bench(args.model, args.drafter, domains=domains,
                          per_domain=args.per_domain, max_new_tokens=args.max_new_tokens,
                          core=args.core, n_dyn=args.n_dyn, lr=args.lr,
                          steps_per_update=args.steps_per_update, replay=args.replay,
                          support=args.support,
                          lora_targets=[t.strip() for t in args.lora_targets.split(",")],
                          skip=args.skip,
                          reset_per_conversation=args.reset_per_conversation,
                          guard=args.guard, tree=tree,
                          configs=[c.strip() for c in args.configs.split(",") if c.strip()],
                          out=args.out)
    print(json.dumps({k: r[k] for k in ("mean_before", "mean_after", "recovery_requests",
                                        "paired_gain", "greedy_identical")}, indent=1))
    return 0
