"""``specjax bench spec``'s command line, and storing the tree a run chose as the
drafter's default (:func:`save_default_tree`); the run itself is
:func:`specjax.bench.spec.run_spec_bench`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from specjax.bench.common import as_command
from specjax.bench.questions import QUESTIONS_ENV, TASKS
from specjax.bench.spec import DEFAULT_GRID, SpecBenchConfig, run_spec_bench
from specjax.bench.spec_select import with_lookup
from specjax.bench.trees import add_tree_args, tree_from_args
from specjax.defaults import resolve_model
from specjax.speculative import TreeSpec


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Attach ``specjax bench spec``'s flags to a (sub)parser."""
    p.add_argument("--model", default=None,
                   help="converted target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None,
                   help="drafter folder (default: the shipped drafter); 'random' = an "
                        "untrained drafter, to check the pipeline")
    p.add_argument("--per-task", type=int, default=4,
                   help="evaluation prompts per task: the first N of each (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_tree_args(p, auto=True)
    p.add_argument("--questions", default=None,
                   help=f"Spec-Bench question.jsonl (default: ${QUESTIONS_ENV}, else "
                        "../shared/data/spec_bench/question.jsonl from the repository root)")
    p.add_argument("--tasks", default=",".join(TASKS),
                   help=f"comma-separated tasks (default {','.join(TASKS)})")
    p.add_argument("--eager-per-task", type=int, default=1,
                   help="prompts per task also run in eager mode (default 1)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="cast parameters at load (default: as stored)")
    p.add_argument("--vocab", default=None,
                   help="drafter vocabulary head: full, fr:N, pafr:N, dynaspec, ... (default: "
                        "the drafter's measured head, else full)")
    p.add_argument("--no-resume", action="store_true",
                   help="ignore and remove the partial results of an interrupted run")
    p.add_argument("--grid-max-nodes", type=int, default=max(t.num_nodes for t in DEFAULT_GRID),
                   help="--tree auto: calibrate only the grid's trees of at most this many "
                        "nodes, root included, before any lookup chain (default: all; each "
                        "tree compiles its own programs, and XLA:CPU ran out of memory "
                        "mappings after ~25 trees with gated chains here)")
    p.add_argument("--grid-add-default", action="store_true",
                   help="--tree auto: also consider the drafter's stored greedy tree (its "
                        "default_tree.json), so the run says whether it still wins; with "
                        "--ab-trees it always runs in the paired A/B")
    p.add_argument("--ab-trees", type=int, default=0, metavar="K",
                   help="--tree auto: run the K best estimated trees (those within "
                        "--ab-within of the best) end to end on --ab-prompts calibration "
                        "prompts, paired, and choose the fastest, or at a speed tie the "
                        "resolved higher MAL (default 0: the estimate decides; it cannot "
                        "order trees within a few percent)")
    p.add_argument("--ab-within", type=float, default=0.05, metavar="F",
                   help="with --ab-trees: how far below the best estimate (a fraction) a "
                        "tree may be and still run (default 0.05)")
    p.add_argument("--ab-prompts", type=int, default=24, metavar="N",
                   help="with --ab-trees (or --add-tree when sampling): about N calibration "
                        "prompts (ShareGPT's calibration range, a third with a long text; "
                        "never Spec-Bench) (default 24)")
    p.add_argument("--add-tree", action="append", default=[], metavar="JSON",
                   help="a candidate tree as TreeSpec JSON (repeat for more): greedy, it joins "
                        "the grid and with --ab-trees always runs in the A/B; at --temperature "
                        "> 0 it runs end to end, paired, against the tree for sampling on "
                        "--ab-prompts calibration prompts, and the chosen one is evaluated")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (default): greedy, the output checked against vanilla's token for "
                        "token; > 0: sampled, vanilla and speculative decoding with one seed a "
                        "prompt and no EOS stop, the speedup with a 95%% interval over prompts; "
                        "the tree is --tree's, or with auto the drafter's stored tree for "
                        "sampling, or the winner of a paired A/B against --add-tree's")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="with --temperature > 0: nucleus filtering of every draw, vanilla's "
                        "and the verifier's (default 1: off); the tree for sampling is the "
                        "one stored for the temperature, measured without a filter")
    p.add_argument("--turns", default="first", choices=["first", "all"],
                   help="first (default): each question's first turn (the issue's 24 "
                        "prompts); all: Spec-Bench's protocol, MT-bench's second turns too, "
                        "asked after vanilla's answer to the first (reported per turn)")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature > 0: the first prompt's seed, then one more a "
                        "prompt (default 0)")
    p.add_argument("--save-default-tree", action="store_true",
                   help="store the chosen tree and this run's head in the drafter's folder "
                        "(default_tree.json): generate then uses them when given none; at "
                        "--temperature > 0 (with --add-tree) the winner becomes the tree for "
                        "sampling, beside the greedy tree and head")
    p.add_argument("--for-this-machine", action="store_true",
                   help="with --save-default-tree: store the tree (greedy, or for sampling "
                        "at --temperature) for this machine's class only (e.g. cpu-avx2: "
                        "jax's backend and the CPU kernels' vector ISA), beside the main "
                        "trees, which machines of other classes keep drafting")
    p.add_argument("--out", default="results/bench_spec.json")


def config_from_args(args: argparse.Namespace) -> SpecBenchConfig:
    """The :class:`SpecBenchConfig` that :func:`add_spec_args`'s flags describe."""
    return SpecBenchConfig(resolve_model(args.model), args.drafter, per_task=args.per_task,
                           max_new_tokens=args.max_new_tokens, tree=tree_from_args(args),
                           grid=with_lookup([t for t in DEFAULT_GRID
                                             if t.num_nodes <= args.grid_max_nodes],
                                            args.tree_lookup, args.tree_lookup_min),
                           questions=args.questions, out=Path(args.out),
                           tasks=[t for t in args.tasks.split(",") if t],
                           eager_per_task=args.eager_per_task, dtype=args.dtype,
                           resume=not args.no_resume, vocab=args.vocab,
                           grid_add_default=args.grid_add_default, ab_trees=args.ab_trees,
                           ab_within=args.ab_within, ab_prompts=args.ab_prompts,
                           add_trees=tuple(TreeSpec.from_json_text(t, "--add-tree")
                                           for t in args.add_tree),
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                           turns=args.turns)


def save_default_tree(result: dict[str, Any], drafter_dir: str | Path,
                      results_path: str | Path | None = None, *,
                      machine: str | None = None) -> Path:
    """Store the tree a ``bench spec`` run chose as the drafter's default
    (``<drafter_dir>/default_tree.json``, see :mod:`specjax.tree.default`), with what was
    measured: the candidates' estimates and paired speeds, the chosen tree's realised speed,
    the machine. A greedy run stores its tree and the head it drafted with; a sampled run
    whose paired A/B chose the tree stores it as the tree for sampling at its temperature,
    beside the greedy default and its head (which every tree shares). With ``machine``
    (the run's machine class) either is stored for that class only, beside the main trees.

    Raises:
      ValueError: the run did not choose its tree, drafted with a head that names an
        artifact outside the drafter folder (or, sampled or for a machine class, another
        head than the folder's), found a greedy mismatch (a default must be lossless), or
        was given a machine class it did not run on.
    """
    from specjax.tree.default import (
        check_portable_vocab,
        read_default_vocab,
        write_default_tree,
        write_machine_default_tree,
        write_sampled_default_tree,
    )

    conf = result["config"]
    greedy = conf.get("greedy", True)
    if greedy and conf.get("tree_mode") != "auto":
        raise ValueError("this run was given its tree; a default must be chosen by "
                         "measurement: run `specjax bench spec` without --tree")
    if not greedy and conf.get("tree_mode") != "paired":
        raise ValueError(f"this run sampled with a tree it did not choose ({conf['tree_mode']}"
                         "); give the trees to compare it with as --add-tree")
    vocab = check_portable_vocab(conf.get("vocab", "full"))
    if greedy and not result["greedy_equality"]["all_match"]:
        raise ValueError("greedy output differed from vanilla in this run; not saving a "
                         "default from it")
    sel = result["tree_selection"]
    ab = sel.get("ab")
    paired = None if not ab or "results" not in ab else {
        r["label"]: {"speed_vs_first": round(r["vs_first"]["ratio"], 4),
                     "ci95": [round(x, 4) for x in r["vs_first"]["ci95"]]}
        for r in ab["results"]}
    measured = {
        "chosen": result["tree_label"], "paired": paired,
        "realized_speedup": result["overall"]["speedup"],
        "speedup_ci95": result["overall"].get("speedup_ci95"),  # absent before the 75th session
        "mal": result["overall"]["mal"],
        "prompts": result["overall"]["prompts"], "model": conf["model"],
        "machine": {k: result["machine"].get(k) for k in ("cpu_model", "nproc", "jax_backend",
                                                          "class", "versions")},
        "results": None if results_path is None else str(results_path),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    rule = "the fastest wins, or at a speed tie the higher MAL where resolved"
    tree = TreeSpec.from_json(result["tree"])
    if machine is not None and (ran_on := result["machine"].get("class")) != machine:
        raise ValueError(f"a machine class's tree is measured on that class; this run ran "
                         f"on {ran_on!r}, not {machine!r}")
    if not greedy or machine is not None:
        stored = read_default_vocab(drafter_dir)  # None: no file, which the write refuses
        if stored is not None and stored != vocab:
            raise ValueError(f"this run drafted with the head {vocab!r}, but the drafter's "
                             f"trees share {stored!r}; run again with --vocab {stored}")
    if not greedy:
        measured = {"how": (f"bench spec --temperature {conf['temperature']:g}: the "
                            f"{len(ab['candidates'])} trees run end to end at that "
                            f"temperature, paired, on {ab['prompts']} calibration prompts: "
                            f"{rule} ({ab['decided_by']})"), **measured}
    else:
        how = "bench spec: calibration MAL / (verify(T) + draft time), highest wins"
        if paired is not None:
            how += (f"; then the {len(ab['candidates'])} best within {ab['within']:.0%} run "
                    f"end to end, paired, on {ab['prompts']} calibration prompts: {rule} "
                    f"({ab['decided_by']})")
        measured = {"how": how, **measured, "est_speedup": sel["chosen"]["est_speedup"],
                    "candidates": {c["label"]: round(c["est_speedup"], 4)
                                   for c in sel["grid"]}}
    temperature = 0.0 if greedy else conf["temperature"]
    if machine is not None:
        return write_machine_default_tree(drafter_dir, tree, measured, machine=machine,
                                          temperature=temperature)
    if greedy:
        return write_default_tree(drafter_dir, tree, measured, vocab=vocab)
    return write_sampled_default_tree(drafter_dir, tree, measured, temperature=temperature)


def run_spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_spec_bench` from :func:`add_spec_args`'s flags."""
    # What --save-default-tree would refuse after the run is refused before it.
    if args.save_default_tree and args.drafter == "random":
        raise ValueError("--save-default-tree needs a trained drafter, not 'random'")
    if args.save_default_tree and args.temperature > 0 and not args.add_tree:
        raise ValueError("--save-default-tree at --temperature > 0 stores the tree for sampling "
                         "that a paired A/B chose: give the trees to compare the current one "
                         "with as --add-tree")
    if args.save_default_tree and args.top_p < 1:
        raise ValueError("--save-default-tree stores trees by temperature alone, measured "
                         "without a top-p filter; drop --top-p to choose one")
    if args.for_this_machine and not args.save_default_tree:
        raise ValueError("--for-this-machine says where --save-default-tree stores the tree: "
                         "give both")
    if args.save_default_tree and args.vocab is not None:
        from specjax.tree.default import check_portable_vocab

        check_portable_vocab(args.vocab)
    machine = None
    if args.for_this_machine:
        from specjax.tree.default import machine_class

        machine = machine_class()
    res = run_spec_bench(config_from_args(args))
    if args.save_default_tree:
        where = save_default_tree(res, res["config"]["drafter"], args.out, machine=machine)
        what = ("default tree" if res["config"]["greedy"] else "tree for sampling")
        what += f" of {machine} machines" if machine else ""
        print(f"{what} {res['tree_label']} (head {res['config']['vocab']}) saved to {where}")
    return res


def add_parser(bench: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``spec`` to ``specjax bench``'s subparsers; ``args.run`` runs it."""
    p = bench.add_parser("spec",
                         help="Spec-Bench subset: MAL, speedup, greedy equality (JSON + plot)")
    add_spec_args(p)
    p.set_defaults(run=as_command(run_spec_from_args))
    return p
