"""ShareGPT as plain text, for a base target with no chat template (Gemma 3 270M).

`specjax build-shortlist` and `specjax train drafter` render ShareGPT with the target's chat
template; a base model has none. This writes the same conversations as plain text (turns
joined by blank lines), Spec-Bench's questions excluded by shingle, twice:

* ``OUT.text.jsonl``: ``{"text": ...}`` records, a corpus for ``build-shortlist --corpus``;
* ``OUT.tokens.jsonl``: ``{"tokens": [...]}`` records (the target tokenizer's ``encode``,
  BOS included as ``--no-chat`` prompts get it, truncated to ``--max-len``), data for
  ``train drafter --data``.

    python examples/base_model_corpus.py --model gemma3-270m --tokens 400000 --out gemma-sg
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm.auto import tqdm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--tokens", type=int, default=400_000, help="stop after this many tokens")
    p.add_argument("--skip", type=int, default=600, help="ShareGPT records to skip first")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--out", required=True, help="prefix of the two .jsonl files")
    args = p.parse_args()

    from specjax.bench.questions import resolve_questions
    from specjax.defaults import resolve_model
    from specjax.tokenizer import load_tokenizer
    from specjax.train.data import iter_records, normalize_messages, sharegpt_path
    from specjax.train.prompts import load_exclusions, shares_shingle

    tok = load_tokenizer(resolve_model(args.model))
    exclude = load_exclusions([resolve_questions(None)])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_tok = n_rec = n_excl = 0
    bar = tqdm(total=args.tokens, desc="plain-text ShareGPT", unit="tok")
    with open(f"{out}.text.jsonl", "w") as ft, open(f"{out}.tokens.jsonl", "w") as fk:
        for i, rec in enumerate(iter_records(sharegpt_path())):
            if i < args.skip:
                continue
            msgs = normalize_messages(rec)
            if not msgs:
                continue
            text = "\n\n".join(m["content"].strip() for m in msgs if m["content"].strip())
            if shares_shingle(text, exclude):
                n_excl += 1
                continue
            ids = tok.encode(text)[: args.max_len]
            if len(ids) < args.min_len:
                continue
            ft.write(json.dumps({"text": text}) + "\n")
            fk.write(json.dumps({"tokens": ids}) + "\n")
            n_tok += len(ids)
            n_rec += 1
            bar.update(len(ids))
            if n_tok >= args.tokens:
                break
    bar.close()
    print(f"{n_rec} records, {n_tok} tokens (ShareGPT records {args.skip}..{i}; {n_excl} "
          f"excluded for sharing a shingle with Spec-Bench)")


if __name__ == "__main__":
    main()
