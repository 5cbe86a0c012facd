"""The sampled verifier of a git revision against the working tree's: alone, or in the loop.

``specjax.verify.verify_sampling`` walks a draft tree with multi-draft rejection sampling
over the whole vocabulary. This times a revision's walk (``--rev``, its ``specjax/verify.py``
loaded from git) against the working tree's, interleaved call by call:

* by default, the verifier alone on root-of-five trees like the shipped tree for sampling
  (SmolLM2's 49,152 ids, q on an 8,192-id shortlist, children drawn from q without
  replacement), over a spread of drafter quality from trees rarely accepted to trees always
  accepted; both must take the same decisions;
* with ``--loop N``, the whole compiled loop (``specjax.generate``, the shipped drafter and
  defaults) on N calibration prompts (ShareGPT's calibration range, never Spec-Bench), each
  verifier patched into ``specjax.speculative`` in turn (``jax.clear_caches`` between) for
  ``--rounds`` rounds each; ms a step = decode time / target forwards.

    python examples/verify_sampling_ab.py --rev HEAD~1 --out results/verify_ab.json
    python examples/verify_sampling_ab.py --rev HEAD~1 --loop 8 --out results/verify_ab_loop.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import specjax
import specjax.speculative as speculative
from specjax.verify import verify_sampling

V, SHORTLIST, CHILDREN = 49152, 8192, 5


def revision_verifier(rev: str):
    """``verify_sampling`` as ``rev``'s ``specjax/verify.py`` defines it."""
    text = subprocess.run(["git", "show", f"{rev}:specjax/verify.py"], check=True,
                          capture_output=True, text=True, cwd=Path(__file__).parents[1]).stdout
    path = Path(tempfile.mkdtemp(prefix="verify_ab_")) / "verify_rev.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("verify_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["verify_rev"] = module
    spec.loader.exec_module(module)
    return module.verify_sampling


def root_of_five(noise: float, seed: int) -> tuple:
    """(tokens, parent, valid, p, q) for one root with five children drawn from q: p's mass
    mostly on the shortlist, q p's shortlist logits plus Gaussian noise of scale ``noise``
    (0.5: nearly always accepted; 4: rarely)."""
    rs = np.random.default_rng(seed)
    ids = np.random.default_rng(0).choice(V, SHORTLIST, replace=False)
    t = CHILDREN + 1
    logits = rs.standard_normal((1, t, V)).astype(np.float32) * 3.0 - 6.0
    logits[:, :, ids] += 6.0
    p = jax.nn.softmax(jnp.asarray(logits), -1)
    q_short = jax.nn.softmax(jnp.asarray(
        logits[:, :, ids] + rs.standard_normal((1, t, SHORTLIST)).astype(np.float32) * noise), -1)
    q = jnp.zeros((1, t, V)).at[:, :1, ids].set(q_short[:, :1])  # only the root is expanded
    gumbel = jnp.log(q[0, 0]) + jax.random.gumbel(jax.random.key(seed), (V,))
    kids = jax.lax.top_k(gumbel, CHILDREN)[1].astype(jnp.int32)
    tokens = jnp.concatenate([jnp.zeros(1, jnp.int32), kids])[None]
    parent = jnp.asarray([[-1] + [0] * CHILDREN], jnp.int32)
    return tokens, parent, jnp.ones((1, t), bool), p, q


def calls(old, runs: int) -> dict:
    """The verifiers alone, interleaved (alternating which goes first)."""
    cases = [root_of_five(noise, seed) for noise in (0.5, 1.0, 2.0, 3.0, 4.0)
             for seed in range(4)]
    fns = {"revision": jax.jit(lambda k, *a: old(k, *a, sampled=True)),
           "working tree": jax.jit(lambda k, *a: verify_sampling(k, *a, sampled=True))}
    for f in fns.values():
        jax.block_until_ready(f(jax.random.key(0), *cases[0]))
    us = {k: [] for k in fns}
    accepted = {k: [] for k in fns}
    for r in tqdm(range(runs), desc="calls"):
        key, case = jax.random.key(r), cases[r % len(cases)]
        for name in (list(fns) if r % 2 else list(fns)[::-1]):
            t = time.perf_counter()
            acc = jax.block_until_ready(fns[name](key, *case))
            us[name].append(1e6 * (time.perf_counter() - t))
            accepted[name].append(int(acc.num_accepted[0]))
    same = accepted["revision"] == accepted["working tree"]
    out = {k: {"median_us": float(np.median(v)), "mean_us": float(np.mean(v)),
               "accept_rate": float(np.mean(accepted[k]))} for k, v in us.items()}
    out["working_tree_over_rev"] = out["working tree"]["median_us"] / out["revision"]["median_us"]
    out["same_decisions"] = same
    return out


def loop(old, n: int, rounds: int, temperature: float) -> dict:
    """ms a step of the compiled loop with each verifier, ``rounds`` rounds each."""
    from specjax.bench.questions import calibration_prompts
    from specjax.defaults import resolve_model, shipped_drafter_for

    target = specjax.load(resolve_model(None, progress=False))
    drafter = specjax.load_drafter(shipped_drafter_for(target.cfg), target)
    prompts, _ = calibration_prompts(target, num=n)
    kw = dict(max_new_tokens=128, temperature=temperature, stop_on_eos=False,
              drafter=drafter)
    verifiers = {"revision": old, "working tree": verify_sampling}
    steps_ms: dict[str, list[float]] = {k: [] for k in verifiers}
    try:
        for r in tqdm(range(rounds), desc="rounds"):
            for name in (list(verifiers) if r % 2 else list(verifiers)[::-1]):
                speculative.verify_sampling = verifiers[name]
                jax.clear_caches()  # the loop is jitted: retrace with this verifier
                seconds = forwards = 0
                for i, ids in enumerate(prompts):
                    specjax.generate(target, [ids], seed=i, **kw)  # compile
                    res = specjax.generate(target, [ids], seed=i, **kw)
                    seconds += res.stats["decode_s"]
                    forwards += res.stats["target_forwards"]
                steps_ms[name].append(1e3 * seconds / forwards)
    finally:
        speculative.verify_sampling = verify_sampling
        jax.clear_caches()
    out = {k: {"ms_per_step": v, "mean": float(np.mean(v))} for k, v in steps_ms.items()}
    out["working_tree_over_rev"] = out["working tree"]["mean"] / out["revision"]["mean"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="git revision to compare with (default HEAD)")
    ap.add_argument("--runs", type=int, default=600, help="calls per verifier (default 600)")
    ap.add_argument("--loop", type=int, default=0, metavar="N",
                    help="time the compiled loop on N calibration prompts instead")
    ap.add_argument("--rounds", type=int, default=3, help="with --loop: rounds per verifier")
    ap.add_argument("--temperature", type=float, default=1.0, help="with --loop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    old = revision_verifier(args.rev)
    res = (loop(old, args.loop, args.rounds, args.temperature) if args.loop
           else calls(old, args.runs))
    res["rev"] = args.rev
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
