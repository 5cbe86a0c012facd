"""How far can a copy gate take the drafter's first draft? A learned gate and a perfect one.

The root's copy gate (``TreeSpec(copy_bias=...)``) picks between the drafter's top-1 and one
lookup token with a bonus per suffix length. This script asks what a richer gate could do
before anyone builds it into the loop: at every drafted position of the target's greedy
answers it offers the drafter's top-1 and *every* token that followed an earlier occurrence
of the last token (up to ``--candidates`` - 1 of them, longest suffix match first), and
scores each with a log-linear model:

- the drafter's logit for the token, minus its top-1's;
- for a lookup token: its suffix match length (one-hot, up to 8), how often and how
  recently it followed, the drafter's confidence (top-1 log-probability), and a linear
  probe of the target's final hidden state at the position ("is this a place where the
  target copies?"), 576 weights for SmolLM2.

It fits the model on ``--calibration`` prompts (never Spec-Bench: that is the evaluation)
by softmax cross-entropy with L-BFGS, then scores the first draft on the 24 Spec-Bench
prompts two ways: teacher-forced (every position), and as a chain of depth 1 sees it in
the loop (:func:`first_draft_agreement.loop_rate`: an accepted draft's next position is the
bonus's, never drafted), with the shipped per-length gate and the drafter alone beside it.

    python examples/copy_gate_probe.py --calibration 400 --out results/copy_gate_probe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import first_draft_agreement as fda  # noqa: E402

import specjax  # noqa: E402
from specjax.bench.common import write_json  # noqa: E402
from specjax.bench.questions import TASKS, calibration_prompts, spec_bench_prompts  # noqa: E402
from specjax.defaults import resolve_model, shipped_drafter_for  # noqa: E402

MATCH = 8  # the longest suffix the features tell apart
FEATURES = 1 + MATCH + 5


def candidates(ids: np.ndarray, t: int, top: int, most: int) -> tuple[list[int], list[tuple]]:
    """The tokens offered at position t (history ``ids[:t + 1]`` predicts ``ids[t + 1]``):
    the drafter's ``top`` first, then the tokens that followed earlier occurrences of
    ``ids[t]``, longest suffix match (capped at :data:`MATCH`) first, then the most recent;
    at most ``most`` in all. Beside each: (match length, times it followed, distance to its
    latest occurrence); (0, 0, 1) for the top-1 when it never followed."""
    seen: dict[int, list[int]] = {}
    for j in np.nonzero(ids[:t] == ids[t])[0]:
        m = 1
        while m < MATCH and j - m >= 0 and ids[j - m] == ids[t - m]:
            m += 1
        c = int(ids[j + 1])
        s = seen.setdefault(c, [0, 0, 0])
        s[0], s[1], s[2] = max(s[0], m), s[1] + 1, int(t - j)  # j ascends: the last is the latest
    order = sorted(seen, key=lambda c: (-seen[c][0], seen[c][2]))
    toks = [top] + [c for c in order if c != top][:most - 1]
    return toks, [tuple(seen.get(c, (0, 0, 1))) for c in toks]


def position_features(logit: np.ndarray, stats: list[tuple], conf: float) -> np.ndarray:
    """[len(stats), FEATURES] for one position's candidates; ``logit`` [n] the drafter's
    logits for them, the first being its top-1."""
    f = np.zeros((len(stats), FEATURES), np.float32)
    for i, (m, count, dist) in enumerate(stats):
        lookup = float(m > 0)
        gap = logit[i] - logit[0]
        f[i, 0] = gap
        if m:
            f[i, m] = 1.0
        f[i, MATCH + 1:] = (lookup * conf, lookup * np.log1p(count), lookup * np.log(dist),
                            lookup * gap, float(i == 0))
    return f


def build(target, drafter, seqs: list[tuple[list[int], list[int]]], most: int,
          desc: str, feats: list[tuple] | None = None) -> dict[str, np.ndarray]:
    """Per drafted position: candidate features [n, most, FEATURES] and their mask
    [n, most] (padding past a position's candidates), the index of the next token among them
    [n] (-1: none offers it), the target's hidden state [n, d] and the answer it belongs
    to [n] (an index into ``seqs``). ``feats``: each pair's :func:`fda.features`, when the
    caller has them already."""
    cols: dict[str, list] = {k: [] for k in ("feat", "mask", "label", "hidden", "pair")}
    for i, (prompt, answer) in enumerate(tqdm(seqs, desc=desc, leave=False)):
        ids = np.asarray(prompt + answer)
        lo, hi = len(prompt), len(ids) - 1
        if hi <= lo:
            continue
        hidden, h = feats[i] if feats is not None else fda.features(target, drafter, list(ids))
        logits = np.asarray(h[0, lo:hi] @ target.params.head.T)
        conf = np.asarray(jax.nn.log_softmax(logits, -1).max(-1))  # the top-1's log-prob
        for k, t in enumerate(range(lo, hi)):
            toks, stats = candidates(ids, t, int(logits[k].argmax()), most)
            f = np.zeros((most, FEATURES), np.float32)
            f[:len(toks)] = position_features(logits[k, toks], stats, float(conf[k]))
            cols["feat"].append(f)
            cols["mask"].append(np.arange(most) < len(toks))
            nxt = int(ids[t + 1])
            cols["label"].append(toks.index(nxt) if nxt in toks else -1)
        cols["hidden"].append(np.asarray(hidden[0, lo:hi], np.float32))
        cols["pair"].append(np.full(hi - lo, i))
    out = {k: (np.concatenate(v) if k in ("hidden", "pair") else np.stack(v))
           for k, v in cols.items()}
    out["label"] = np.asarray(out["label"])
    return out


def scores(params: dict, feat, mask, hidden, mu, sd):
    """[n, most] logits of the log-linear gate; masked candidates -inf-like."""
    s = feat @ params["w"]
    lookup = feat[..., 1:MATCH + 1].sum(-1) > 0
    s = s + lookup * (((hidden - mu) / sd) @ params["u"])[:, None]
    return jnp.where(mask, s, -1e9)


def fit(d: dict[str, np.ndarray], lam: float, steps: int) -> dict:
    """The gate's weights by L-BFGS on softmax cross-entropy (positions no candidate gets
    right left out), an L2 penalty ``lam`` on the probe; starts at the drafter alone."""
    mu, sd = d["hidden"].mean(0), d["hidden"].std(0) + 1e-6
    ok = d["label"] >= 0
    args = [jnp.asarray(d[k][ok]) for k in ("feat", "mask", "hidden")]
    label = jnp.asarray(d["label"][ok])

    def loss(p):
        lp = jax.nn.log_softmax(scores(p, *args, mu, sd), -1)
        return -jnp.mean(jnp.take_along_axis(lp, label[:, None], 1)) + lam * jnp.sum(p["u"] ** 2)

    p = {"w": jnp.zeros(FEATURES).at[0].set(1.0), "u": jnp.zeros(d["hidden"].shape[1])}
    opt = optax.lbfgs()
    state, value_grad = opt.init(p), optax.value_and_grad_from_state(loss)

    @jax.jit
    def step(p, state):
        v, g = value_grad(p, state=state)
        u, state = opt.update(g, state, p, value=v, grad=g, value_fn=loss)
        return optax.apply_updates(p, u), state

    for _ in tqdm(range(steps), desc="fit", leave=False):
        p, state = step(p, state)
    return {"w": p["w"], "u": p["u"], "mu": mu, "sd": sd}


def gate_hits(p: dict, d: dict[str, np.ndarray]) -> np.ndarray:
    """[n] bool: the gate's pick is the next token."""
    s = scores(p, jnp.asarray(d["feat"]), jnp.asarray(d["mask"]), jnp.asarray(d["hidden"]),
               p["mu"], p["sd"])
    return np.asarray(jnp.argmax(s, -1)) == d["label"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", type=int, default=400, metavar="N",
                    help="calibration prompts the gate is fitted on")
    ap.add_argument("--candidates", type=int, default=16, help="tokens offered a position")
    ap.add_argument("--l2", type=float, default=1e-3, help="L2 penalty on the probe")
    ap.add_argument("--steps", type=int, default=300, help="L-BFGS steps")
    ap.add_argument("--copy-bias", default="0.5,3,4,5,5,5,5,15.5",
                    help="the per-length gate compared with (fitted in the sixty-third session)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    if args.calibration < 1 or args.candidates < 2 or args.steps < 1 or args.l2 < 0:
        raise SystemExit("need --calibration >= 1, --candidates >= 2, --steps >= 1, --l2 >= 0")
    target = specjax.load(resolve_model(None, progress=False))
    drafter = specjax.load_drafter(shipped_drafter_for(target.cfg), target)
    calib, source = calibration_prompts(target, num=args.calibration)
    evals, qpath = spec_bench_prompts(target, questions=None, tasks=TASKS, per_task=4)

    def answer(prompts: list[list[int]], desc: str) -> list[tuple[list[int], list[int]]]:
        out = []
        for i in tqdm(range(0, len(prompts), 8), desc=desc, leave=False):  # greedy, batched
            batch = prompts[i:i + 8]
            res = specjax.generate(target, batch, max_new_tokens=args.max_new_tokens)
            out += [(p, [int(x) for x in a]) for p, a in zip(batch, res.tokens, strict=True)]
        return out

    train = build(target, drafter, answer(calib, "calibration answers"), args.candidates,
                  "calibration features")
    spec_seqs = answer([e["ids"] for e in evals], "Spec-Bench answers")
    # One drafter forward of each Spec-Bench answer serves the probe and the per-length gate.
    spec_feats = [fda.features(target, drafter, p + a) for p, a in spec_seqs]
    test = build(target, drafter, spec_seqs, args.candidates, "Spec-Bench features", spec_feats)
    p = fit(train, args.l2, args.steps)
    bias = tuple(float(b) for b in args.copy_bias.split(","))
    g = fda.gate_inputs(target, drafter, spec_seqs, len(bias), spec_feats)
    task_of = [e["task"] for e in evals]
    n = len(evals)
    rows = {"drafter alone": test["label"] == 0, f"per-length gate {list(bias)}":
            fda.gated_hits(g, bias), "learned gate": gate_hits(p, test),
            "oracle (any candidate)": test["label"] >= 0}
    result = {"calibration": {"prompts": len(calib), "positions": len(train["label"]),
                              "source": source, "fit_hits": float(gate_hits(p, train).mean())},
              "questions": str(qpath), "prompts": n, "candidates": args.candidates,
              "l2": args.l2, "steps": args.steps, "spec_bench": {}}
    pair = test["pair"]
    if not np.array_equal(g["pair"], pair):  # both walk the answers' positions in order
        raise SystemExit("the per-length gate and the probe scored different positions")
    for name, hits in rows.items():
        by = fda.by_pair(hits, pair, n)
        rec = {"teacher_forced": float(hits.mean()), "loop": fda.loop_rate(by),
               "per_task": fda.pooled_per_task(by, task_of, TASKS)}
        result["spec_bench"][name] = rec
        print(f"{name}: teacher-forced {rec['teacher_forced']:.3f}, as a depth-1 chain's loop "
              f"sees it {rec['loop']:.3f}; " + " ".join(
                  f"{t} {v:.3f}" for t, v in rec["per_task"].items()), flush=True)
    if args.out:
        write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
