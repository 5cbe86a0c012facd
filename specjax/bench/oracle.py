"""``specjax bench oracle``: the speculative loop's own ceiling, with a drafter that is never wrong.

An *oracle* drafter proposes the target's own greedy continuation, recorded by a vanilla
run, so a chain of depth D accepts every draft and commits D + 1 tokens per target forward
(MAL = D + 1, the bonus token included). What is left between its speed and D + 1 times
vanilla is the engine: the verify forward over D + 1 tokens (``specjax bench latency``), the
draft phase, acceptance, KV compaction, the drafter's catch-up and the output append.

It plugs into the ordinary seams, without a change to the loop:

* the drafter is the EAGLE architecture with ``fc = [0; I]``, zero bias and zero ``wo`` /
  ``w_down``: its decoder layer still runs (so the draft phase costs what a one-layer
  drafter's does) but returns its input feature unchanged, so every node of a tree carries
  the root's feature, the target's final-norm hidden state at the position before the root;
* the vocabulary head (:class:`OracleHead`, a :class:`~specjax.vocab.head.VocabHead`) finds
  that position by nearest neighbour among the recorded hidden states of the prompt and its
  continuation, and offers the recorded token ``step + 1`` places after the root: one
  candidate, no vocabulary-wide work.

Benchmark only: the head reads the answer from the recording.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from tqdm import tqdm

import specjax
from specjax import pytree
from specjax.api import encode_prompts
from specjax.bench.common import (
    as_command,
    int_list,
    machine_info,
    pyplot,
    save_figure,
    write_json,
)
from specjax.bench.questions import uses_chat
from specjax.defaults import resolve_model
from specjax.drafter import DrafterConfig, DrafterParams, identity_layer
from specjax.loaded import Drafter, Target
from specjax.loop import bucket
from specjax.model import forward_hidden, init_cache
from specjax.speculative import TreeSpec
from specjax.vocab.head import Candidates

PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between Python and C? Answer in a list.",
    "Solve step by step: a train travels 120 km in 1.5 hours. What is its average speed?",
)
GOAL = 2.5  # issue 10: chain of depth 4 with the oracle, x vanilla tokens/s
FAR = 1e4  # feature value of table rows past a sequence's end: never the nearest


@pytree.dataclass
class OracleHead:
    """Offers the recorded continuation (see the module doc). B rows, N recorded positions.

    feats: [B, N, d] the target's final-norm hidden state at each position (``FAR`` past
      the end); tokens: [B, N] int32 the token at each position; length: [B] int32 valid
      positions per row.
    """

    feats: Array
    tokens: Array
    length: Array
    name: ClassVar[str] = "oracle"
    uses_context: ClassVar[bool] = False
    stateful: ClassVar[bool] = False

    def capacity(self, step: int) -> int:
        return 1

    def __call__(self, w: Array, h: Array, step: int, context: Array | None = None,
                 state: None = None) -> Candidates:
        # h [B, K, d]: every node carries the root's feature, that of position p = L - 1.
        d2 = (jnp.sum(self.feats * self.feats, -1)[:, None, :]
              - 2 * jnp.einsum("bkd,bnd->bkn", h.astype(jnp.float32), self.feats))
        p = jnp.argmin(d2, axis=-1)  # [B, K]
        nxt = p + 2 + step  # the root is at p + 1; the node at depth `step` at p + 1 + step
        valid = nxt < self.length[:, None]
        ids = jnp.take_along_axis(self.tokens, jnp.clip(nxt, 0, self.tokens.shape[1] - 1),
                                  axis=1)
        return Candidates(jnp.where(valid, ids, 0)[..., None].astype(jnp.int32),
                          valid[..., None], jnp.where(valid, 0.0, -jnp.inf)[..., None])


def oracle_drafter(target: Target) -> Drafter:
    """The identity EAGLE drafter (module doc): its output is its input feature."""
    cfg = target.cfg
    d = cfg.hidden_size
    dtype = target.params.embed.dtype
    layer = dataclasses.replace(identity_layer(target.params.layers[-1]), attn_norm=None)
    fc = jnp.concatenate([jnp.zeros((d, d), dtype), jnp.eye(d, dtype=dtype)], axis=0)
    params = DrafterParams(fc=fc, layers=(layer,), fc_bias=jnp.zeros((d,), dtype))
    return Drafter(cfg=DrafterConfig(target=cfg, input_norm=False, fc_bias=True),
                   params=params, meta={"oracle": True})


def record_head(target: Target, seqs: list[list[int]], table_len: int) -> OracleHead:
    """An :class:`OracleHead` over ``seqs`` (prompt + recorded continuation, one per row)."""
    b, d = len(seqs), target.cfg.hidden_size
    if max(map(len, seqs)) > table_len:
        raise ValueError("table_len is shorter than a recorded sequence")
    toks = np.zeros((b, table_len), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    fwd = jax.jit(lambda p, t, pos, c: forward_hidden(p, target.cfg, t, pos, c)[0])
    hidden = np.asarray(fwd(target.params, jnp.asarray(toks),
                            jnp.broadcast_to(jnp.arange(table_len), (b, table_len)),
                            init_cache(target.cfg, b, table_len, target.params.embed.dtype)),
                        np.float32).copy()
    lengths = np.asarray([len(s) for s in seqs], np.int32)
    hidden[np.arange(table_len)[None, :] >= lengths[:, None]] = FAR
    return OracleHead(feats=jnp.asarray(hidden.reshape(b, table_len, d)),
                      tokens=jnp.asarray(toks), length=jnp.asarray(lengths))


def run_oracle_bench(model_dir: Path, *, prompts: tuple[str, ...] = PROMPTS,
                     depths: tuple[int, ...] = (1, 2, 3, 4), max_new_tokens: int = 128,
                     runs: int = 3, out: Path = Path("results/bench_oracle.json"),
                     dtype: str | None = None, latency_runs: int = 7) -> dict[str, Any]:
    """Vanilla against the oracle chain of each depth, per prompt, in one process.

    Every method is warmed up (compiled) on the prompt first; then ``runs`` timed calls of
    each, interleaved, best decode time kept. One eager run per depth gives the draft /
    verify split per step. The target's forward latency at T = 1 and T = depth + 1 is
    measured in the same run, for the ceiling MAL * latency(1) / latency(T).
    """
    from specjax.bench.latency import latency_curves

    model_dir, out = Path(model_dir), Path(out)
    target = specjax.load(model_dir, dtype)
    drafter = oracle_drafter(target)
    ids = [encode_prompts(target, p, chat=uses_chat(target))[0] for p in prompts]
    trees = {dep: TreeSpec("chain", depth=dep) for dep in depths}
    kw = dict(max_new_tokens=max_new_tokens, stop_on_eos=False)
    bar = tqdm(total=len(ids) * (2 + len(depths) * 3) + 1, unit="step")
    per_prompt = []
    for q, p in enumerate(ids):
        bar.set_description(f"prompt {q + 1}: vanilla")
        specjax.generate(target, [p], **kw)  # compile
        ref = specjax.generate(target, [p], **kw)
        bar.update(2)
        seq = p + ref.tokens[0]
        head = record_head(target, [seq], bucket(len(seq) + max(depths) + 2))
        calls = {"vanilla": lambda p=p: specjax.generate(target, [p], **kw)}
        for dep, tree in trees.items():
            calls[f"chain{dep}"] = (lambda p=p, tree=tree, head=head: specjax.generate(
                target, [p], drafter=drafter, tree=tree, vocab=head, **kw))
            bar.set_description(f"prompt {q + 1}: oracle chain {dep} (compile, eager)")
            calls[f"chain{dep}"]()
            for _ in range(2):  # the first eager call compiles the two phases
                eager = specjax.generate(target, [p], drafter=drafter, tree=tree, vocab=head,
                                         mode="eager", **kw)
            bar.update(2)
            calls[f"eager{dep}"] = eager
        rec: dict[str, Any] = {"prompt": prompts[q], "prompt_tokens": len(p)}
        walls: dict[str, list[float]] = {k: [] for k in calls if not k.startswith("eager")}
        results = {}
        for _ in range(runs):
            for k in walls:
                results[k] = calls[k]()
                walls[k].append(results[k].stats["decode_s"])
        bar.update(len(depths))
        n_dec = max_new_tokens - 1  # the first token comes from the prefill
        rec["vanilla"] = {"decode_tokens_per_s": n_dec / min(walls["vanilla"]),
                          "decode_s": walls["vanilla"]}
        for dep in depths:
            r, e = results[f"chain{dep}"], calls[f"eager{dep}"]
            steps = r.stats["target_forwards"]
            es = e.stats["target_forwards"]
            rec[f"chain{dep}"] = {
                "mal": r.stats["mean_accepted_length"], "target_forwards": steps,
                "decode_tokens_per_s": n_dec / min(walls[f"chain{dep}"]),
                "decode_s": walls[f"chain{dep}"],
                "step_ms": 1e3 * min(walls[f"chain{dep}"]) / steps,
                "greedy_match": r.tokens[0] == ref.tokens[0],
                "eager_draft_ms": 1e3 * e.stats["draft_s"] / es,
                "eager_verify_ms": 1e3 * e.stats["verify_s"] / es,
                "eager_greedy_match": e.tokens[0] == ref.tokens[0]}
            rec[f"chain{dep}"]["speedup"] = (rec[f"chain{dep}"]["decode_tokens_per_s"]
                                             / rec["vanilla"]["decode_tokens_per_s"])
        per_prompt.append(rec)
    bar.set_description("latency T = 1, depth + 1")
    sizes = tuple(sorted({1} | {dep + 1 for dep in depths}))
    ctx = max(len(p) for p in ids) + max_new_tokens // 2
    cap = bucket(max(len(p) for p in ids)) + bucket(max_new_tokens) + max(depths) + 1
    lat = latency_curves(target, {"fused": target.params}, sizes, context=ctx, capacity=cap,
                         runs=latency_runs)["fused"]
    bar.update()
    bar.close()
    lat_ms = dict(zip(sizes, lat["best_ms"], strict=True))
    overall: dict[str, Any] = {"vanilla_decode_tokens_per_s": float(np.mean(
        [r["vanilla"]["decode_tokens_per_s"] for r in per_prompt]))}
    for dep in depths:
        rows = [r[f"chain{dep}"] for r in per_prompt]
        mal = float(np.mean([x["mal"] for x in rows]))
        sp = float(np.mean([x["speedup"] for x in rows]))
        vanilla_step = 1e3 / overall["vanilla_decode_tokens_per_s"]
        step = float(np.mean([x["step_ms"] for x in rows]))
        draft = float(np.mean([x["eager_draft_ms"] for x in rows]))
        verify = float(np.mean([x["eager_verify_ms"] for x in rows]))
        overall[f"chain{dep}"] = {
            "mal": mal, "speedup": sp, "step_ms": step, "vanilla_step_ms": vanilla_step,
            "forward_ms": lat_ms[dep + 1], "forward_t1_ms": lat_ms[1],
            "forward_ratio": lat_ms[dep + 1] / lat_ms[1],
            "ceiling_speedup": mal * lat_ms[1] / lat_ms[dep + 1],
            "eager_draft_ms": draft, "eager_verify_ms": verify,
            "eager_verify_minus_forward_ms": verify - lat_ms[dep + 1],
            "greedy_match": all(x["greedy_match"] and x["eager_greedy_match"] for x in rows)}
    result = {"benchmark": "oracle", "model_name": model_dir.name,
              "dtype": str(target.params.embed.dtype), "machine": machine_info(),
              "max_new_tokens": max_new_tokens, "runs": runs, "depths": list(depths),
              "latency": {"sizes": list(sizes), **lat, "context": ctx, "capacity": cap},
              "goal": {"depth": 4, "min_speedup": GOAL,
                       "met": None if 4 not in depths else overall["chain4"]["speedup"] >= GOAL},
              "overall": overall, "per_prompt": per_prompt,
              "mal_note": "MAL = tokens committed per target forward, the bonus included"}
    write_json(out, result)
    plot_oracle(result, out.with_suffix(".png"))
    print(summary(result))
    return result


def plot_oracle(r: dict[str, Any], path: Path) -> Path:
    """Speedup per depth: measured, the forward-latency ceiling, and MAL (the ideal)."""
    plt = pyplot()

    deps = r["depths"]
    o = r["overall"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = np.arange(len(deps))
    w = 0.27
    for i, (key, name) in enumerate((("speedup", "measured (same run)"),
                                     ("ceiling_speedup", "MAL x latency(1) / latency(T)"),
                                     ("mal", "MAL (free verify and draft)"))):
        bars = ax.bar(xs + (i - 1) * w, [o[f"chain{d}"][key] for d in deps], w, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(GOAL, color="r", ls=":", lw=1, label=f"goal at depth 4: {GOAL}x")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(xs, [f"chain d{d} (T={d + 1})" for d in deps])
    ax.set_ylabel("x vanilla decode tokens/s")
    ax.set_title(f"{r['model_name']}: oracle drafter (the loop's ceiling), "
                 f"{r['max_new_tokens']} greedy tokens", fontsize=10)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def summary(r: dict[str, Any]) -> str:
    """The oracle bench's result ``r`` as a table: one line per chain depth (MAL, speed,
    its ceiling and the step's parts)."""
    o = r["overall"]
    lines = [f"{r['model_name']} {r['dtype']}, oracle drafter, {r['max_new_tokens']} greedy "
             f"tokens, {len(r['per_prompt'])} prompts; vanilla "
             f"{o['vanilla_decode_tokens_per_s']:.1f} tok/s",
             f"{'tree':<10}{'MAL':>6}{'x vanilla':>11}{'ceiling':>9}{'step ms':>9}"
             f"{'fwd(T) ms':>11}{'fwd x T=1':>11}{'draft ms':>10}{'verify-fwd':>12}{'greedy':>8}"]
    for d in r["depths"]:
        c = o[f"chain{d}"]
        lines.append(f"{'chain d' + str(d):<10}{c['mal']:>6.2f}{c['speedup']:>11.2f}"
                     f"{c['ceiling_speedup']:>9.2f}{c['step_ms']:>9.1f}{c['forward_ms']:>11.1f}"
                     f"{c['forward_ratio']:>11.2f}{c['eager_draft_ms']:>10.1f}"
                     f"{c['eager_verify_minus_forward_ms']:>12.1f}"
                     f"{'yes' if c['greedy_match'] else 'NO':>8}")
    lines.append("ceiling = MAL x latency(1) / latency(T): what a loop costing nothing but "
                 "the verify forward would reach; draft and verify-fwd are eager ms per step")
    g = r["goal"]
    if g["met"] is not None:
        lines.append(f"goal: chain d4 >= {g['min_speedup']}x vanilla: "
                     f"{'met' if g['met'] else 'not met'}")
    return "\n".join(lines)


def add_oracle_args(p: argparse.ArgumentParser) -> None:
    """Attach ``specjax bench oracle``'s flags to a (sub)parser."""
    p.add_argument("--model", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--depths", type=int_list, default=(1, 2, 3, 4),
                   help="chain depths (default 1,2,3,4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=len(PROMPTS),
                   help=f"how many of the built-in prompts (default {len(PROMPTS)})")
    p.add_argument("--runs", type=int, default=3, help="timed calls per method (default 3)")
    p.add_argument("--out", default="results/bench_oracle.json")


def run_oracle_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_oracle_bench` from :func:`add_oracle_args`'s flags."""
    return run_oracle_bench(resolve_model(args.model), prompts=PROMPTS[:max(1, args.prompts)],
                            depths=args.depths, max_new_tokens=args.max_new_tokens,
                            runs=args.runs, out=Path(args.out), dtype=args.dtype)


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``oracle`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser(
        "oracle", help="the speculative loop's ceiling with a never-wrong drafter")
    add_oracle_args(p)
    p.set_defaults(run=as_command(run_oracle_from_args))
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m specjax.bench.oracle``: the same as ``specjax bench oracle``."""
    p = argparse.ArgumentParser(prog="specjax bench oracle", description=__doc__)
    add_oracle_args(p)
    run_oracle_from_args(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
