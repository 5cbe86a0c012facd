"""``specjax bench spec``'s report: the printed table and the plot of one result (the dict
:func:`specjax.bench.spec.run_spec_bench` writes), greedy or sampled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specjax.bench.common import MAL_NOTE, dash, pyplot, sampling_label, save_figure

SAMPLING_NOTE = ("sampled: outputs differ from vanilla's by design, so none is compared token "
                 "for token; that their distribution is the target's is checked by the "
                 "chi-square tests (tests/speculative/test_sampling.py)")


def plot_spec(r: dict[str, Any], path: Path) -> Path:
    """MAL and speedup per task; for a greedy run also the latency curve and the tree grid
    (a sampled run has neither: it estimates nothing)."""
    plt = pyplot()

    tasks = list(r["per_task"]) + ["overall"]
    rows = [r["per_task"][t] for t in tasks[:-1]] + [r["overall"]]
    nan = float("nan")

    def vals(key: str) -> list[float]:
        return [nan if x[key] is None else x[key] for x in rows]

    greedy = r["latency"] is not None
    fig, axes = plt.subplots(2 if greedy else 1, 2, figsize=(12, 8 if greedy else 4.5),
                             squeeze=False)
    xs = np.arange(len(tasks))
    ax = axes[0, 0]
    bars = ax.bar(xs, vals("mal"), color="tab:blue")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xticks(xs, tasks, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("MAL (tokens / target forward)")
    ax.set_title("Mean accepted length per task (bonus token included)", fontsize=10)

    ax = axes[0, 1]
    eager = r["overall"]["eager_prompts"] > 0
    w = 0.4 if eager else 0.6
    speed = vals("speedup")
    # The interval's distance from the point, per side (none where it was not computed).
    err = np.array([[nan, nan] if x["speedup_ci95"] is None else
                    [x["speedup"] - x["speedup_ci95"][0], x["speedup_ci95"][1] - x["speedup"]]
                    for x in rows]).T
    b = ax.bar(xs - w / 2 if eager else xs, speed, w, yerr=err, capsize=3,
               label="speculative compiled / vanilla (95% interval)")
    ax.bar_label(b, fmt="%.2f", fontsize=7)
    if eager:
        b = ax.bar(xs + w / 2, vals("eager_speedup"), w, label="speculative eager / vanilla")
        ax.bar_label(b, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(xs, tasks, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("decode speedup (same run)")
    m = r["greedy_equality"]
    ax.set_title("Speedup per task; " + (
        f"greedy equal {m['matched']}/{m['prompts']} prompts" if m is not None else
        f"sampled at temperature {sampling_label(r['config'])}"), fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    if greedy:
        _plot_selection(r, axes[1, 0], axes[1, 1])
    mach = r["machine"]
    how = ("greedy" if greedy else f"sampled (T={sampling_label(r['config'])})")
    fig.suptitle(f"{r['model_name']} + drafter {Path(r['config']['drafter']).name}, tree "
                 f"{r['tree_label']}, {r['config']['max_new_tokens']} {how} tokens, "
                 f"{mach['nproc']} CPUs ({mach['cpu_model']})", fontsize=10)
    return save_figure(fig, path)


def _plot_selection(r: dict[str, Any], ax_latency: Any, ax_grid: Any) -> None:
    """The latency curve and the estimate over the tree grid, on two axes."""
    ax = ax_latency
    lat = r["latency"]
    ax.plot(lat["sizes"], lat["best_ms"], "o", label=f"best of {lat['runs']}")
    ax.plot(lat["sizes"], lat["median_ms"], "x", alpha=0.6, label="median")
    ax.plot(lat["sizes"], lat["fit_ms"], "-", label="monotone fit (used for estimates)")
    t = r["tree"]["num_nodes"]
    ax.axvline(t, color="tab:red", ls=":", label=f"chosen tree T={t}")
    ax.set_xlabel("tokens per target forward (T)")
    ax.set_ylabel("ms")
    ax.set_title(f"Target forward latency, B=1, cache {lat['context']}/{lat['capacity']} rows",
                 fontsize=10)
    ax.legend(fontsize=8)

    ax = ax_grid
    sel = r["tree_selection"]
    g = sel["grid"]
    gx = np.arange(len(g))
    colors = ["tab:red" if i == sel["chosen_index"] else "tab:gray" for i in gx]
    bars = ax.bar(gx, [row["est_tokens_per_s"] for row in g], color=colors)
    ax.bar_label(bars, labels=[f"{row['mal']:.2f}" for row in g], fontsize=7)
    ax.axhline(sel["vanilla_est_tokens_per_s"], color="k", ls="--", lw=1,
               label="vanilla est. 1/latency(1)")
    ax.set_xticks(gx, [row["label"] for row in g], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("estimated tokens/s")
    ax.set_title("Tree grid: MAL / (verify(T) + draft); bar labels = calibration MAL",
                 fontsize=10)
    ax.legend(fontsize=8)


def _selection_lines(r: dict[str, Any]) -> list[str]:
    """The latency curve, the estimate's grid and the paired A/B of a greedy run."""
    sel = r["tree_selection"]
    lines = ["latency (ms, best; monotone fit) " + ", ".join(
                 f"T={t}: {ms:.1f}" + ("" if abs(fit - ms) < 0.05 else f" ({fit:.1f})")
                 for t, ms, fit in zip(r["latency"]["sizes"], r["latency"]["best_ms"],
                                       r["latency"]["fit_ms"], strict=True)),
             f"{'tree':<24}{'T':>4}{'cal MAL':>9}{'draft ms':>10}{'verify ms':>10}"
             f"{'est tok/s':>10}{'est x':>7}"]
    for i, g in enumerate(sel["grid"]):
        lines.append(f"{g['label']:<24}{g['tree']['num_nodes']:>4}{g['mal']:>9.2f}"
                     f"{g['draft_ms']:>10.1f}{g['verify_ms']:>10.1f}{g['est_tokens_per_s']:>10.1f}"
                     f"{g['est_speedup']:>7.2f}" + ("  <- chosen" if i == sel["chosen_index"]
                                                    else ""))
    if sel.get("ab"):
        lines += _ab_lines(sel["ab"])
    lines.append(f"chosen tree: {r['tree_label']} (vanilla est. "
                 f"{sel['vanilla_est_tokens_per_s']:.1f} tok/s)")
    return lines


def _ab_lines(ab: dict[str, Any]) -> list[str]:
    """A paired A/B's table: each tree's MAL and speed against the first, and the rule."""
    if "results" not in ab:
        return [f"paired A/B skipped: {ab['skipped']}"]
    first = ab["results"][0]["label"]
    lines = [f"paired A/B on {ab['prompts']} calibration prompts, speed vs {first}:"]
    lines += [f"  {x['label']:<24} MAL {x['mal']:.2f}  {x['vs_first']['ratio']:.3f} "
              f"[{x['vs_first']['ci95'][0]:.3f}, {x['vs_first']['ci95'][1]:.3f}]"
              for x in ab["results"]]
    lines.append(f"  chosen: {ab['winner']} (decided by {ab['decided_by']}; fastest "
                 f"{ab['fastest']}" + "".join(
                     f", tied with {t}" for t in ab["tied"] if t != ab["fastest"]) + ")")
    return lines


def _equality_lines(r: dict[str, Any]) -> list[str]:
    """What was checked of the output: greedy equality, or the sampling note."""
    eq = r["greedy_equality"]
    if eq is None:
        return [r["sampling"]["note"]]
    if eq["all_match"]:
        return [f"greedy equality: all {eq['prompts']} prompts match vanilla token for token"]
    return [f"!!! greedy equality: {eq['matched']}/{eq['prompts']} prompts match; "
            "mismatches (question, first differing new token): " + ", ".join(
                f"q{m['question_id']}" + (f" turn {m['turn']}" if m.get("turn", 1) > 1
                                          else "") + f"@{m['first_mismatch']}"
                + (f" eager@{m['eager_first_mismatch']}"
                   if m["eager_first_mismatch"] is not None else "")
                for m in eq["mismatches"]) + " !!!"]


def summary(r: dict[str, Any]) -> str:
    """A human-readable table of one result."""
    conf = r["config"]
    how = ("greedy new tokens" if conf["greedy"] else
           f"new tokens sampled at temperature {sampling_label(conf)} (no EOS stop, "
           f"seeds {conf['seed']}+)")
    lines = [f"{r['model_name']}, drafter {conf['drafter']} (vocab {conf.get('vocab', 'full')}), "
             f"{conf['max_new_tokens']} {how}, batch 1"]
    if r["latency"] is not None:  # greedy: the estimate, maybe an A/B
        lines += _selection_lines(r)
    elif r["tree_selection"] is not None:  # sampled: an A/B of the given trees
        lines += _ab_lines(r["tree_selection"]["ab"])
        lines.append(f"chosen tree: {r['tree_label']}")
    else:
        lines.append(f"tree: {r['tree_label']} ({conf['tree_mode']})")
    lines.append(f"{'task':<16}{'n':>3}{'MAL*':>7}{'vanilla':>9}{'spec':>9}{'speedup':>9}"
                 f"{'e2e x':>8}{'eager':>9}{'comp/eag':>9}{'matched':>9}")
    by_turn = [(f"turn {t}", a) for t, a in (r.get("per_turn") or {}).items()]
    for name, a in list(r["per_task"].items()) + [("overall", r["overall"])] + by_turn:
        matched = "-" if a["matched"] is None else f"{a['matched']}/{a['prompts']}"
        lines.append(f"{name:<16}{a['prompts']:>3}{dash(a['mal']):>7}"
                     f"{dash(a['vanilla_decode_tokens_per_s'], '.1f'):>9}"
                     f"{dash(a['spec_decode_tokens_per_s'], '.1f'):>9}{dash(a['speedup']):>9}"
                     f"{dash(a['e2e_speedup']):>8}"
                     f"{dash(a['eager_decode_tokens_per_s'], '.1f'):>9}"
                     f"{dash(a['compiled_vs_eager']):>9}{matched:>9}")
    lines.append("* " + MAL_NOTE + "; rates are decode tokens/s; e2e x is the whole "
                 "call's (prefill included) over vanilla's")
    ci = r["overall"]["speedup_ci95"]
    if ci is not None:
        lines.append(f"decode speedup {dash(r['overall']['speedup'])}x, 95% interval "
                     f"[{ci[0]:.2f}, {ci[1]:.2f}] resampling prompts")
    p = r["prediction"]
    if p is not None:
        lines.append(f"predicted {dash(p['est_tokens_per_s'], '.1f')} tok/s "
                     f"({dash(p['est_speedup'])}x, calibration MAL {dash(p['calibration_mal'])}); "
                     f"realized {dash(p['realized_spec_decode_tokens_per_s'], '.1f')} tok/s "
                     f"({dash(p['realized_speedup'])}x, MAL {dash(p['evaluation_mal'])})")
    if r["timed_compiles"]:
        lines.append(f"warning: {r['timed_compiles']} XLA compiles happened inside timed "
                     "calls (recompiles); those prompts' times include them")
    return "\n".join(lines + _equality_lines(r))
