#!/usr/bin/env bash
# Cut the tree a device call carries (64 MiB a call, `carry` included), on the CPU between
# calls. Only the index and .git/info/exclude change; the working tree is untouched.
#
#   trim.sh 1        # drop every asset but the starting drafter's parameters (~33 MB left)
#   trim.sh 2        # drop every asset (the code alone, ~2 MB)
#   trim.sh restore  # undo: call it before committing anything
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
EX=.git/info/exclude
SMOL=specjax/assets/drafters/SmolLM2-135M-Instruct
mkdir -p .git/info && touch "$EX"
sed -i '/# trim-begin/,/# trim-end/d' "$EX"
git reset -q
case "${1:-}" in
restore) exit 0 ;;
1) paths=(docs/img specjax/assets/drafters/gemma3-270m "$SMOL/router" "$SMOL/cooccurrence.npy"
          "$SMOL/loss.png") ;;
2) paths=(docs/img specjax/assets/drafters) ;;
*) echo "usage: $0 1|2|restore" >&2; exit 2 ;;
esac
git rm -r -q --cached "${paths[@]}"
{ echo "# trim-begin"; printf '/%s\n' "${paths[@]}"; echo "# trim-end"; } >> "$EX"
echo "tree now $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes"
