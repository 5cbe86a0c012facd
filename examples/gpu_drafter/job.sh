#!/bin/bash
# The GPU drafter job in a few calls of the device tool (64 MiB a call: the GGUF goes in
# slices; a machine kept warm between calls keeps /root/stage). From the repository root:
#
#   job.sh receive   # calls 1..k: store what the call carries (GGUF slices, payload/,
#                    #   tokenizer/; the starting drafter the first time) in /root/stage;
#                    #   the first starts the Pallas kernel tests, compiled, in the background
#   job.sh generate  # install, convert the target, answer the prompt stages (time limited,
#                    #   resumable), cache the hidden states, time 20 training steps
#   job.sh train     # train for STEPS steps (env), export the drafter into $OUT
#   job.sh next      # the trained drafter becomes the starting one (a second `train`)
#
# Sizes come from the environment: GEN_S (generation seconds), STAGES, STEPS, LR, TAP_LR,
# BATCH (tokens per step), EVAL_EVERY, TRAIN_S (training's time limit, s), TTT (unrolled
# draft steps of training-time test, `--ttt-steps`; unset: none), LAYERS (`--drafter-layers`;
# unset: the starting drafter's; more grows it, the new layers the identity), TV (`--tv-weight`,
# the total-variation term that raises temperature 1's acceptance; unset: 0), DTYPE
# (`--compute-dtype`: bfloat16 for mixed-precision steps; unset: float32), CALIB=0 (skip the
# 20 timed steps), MEM_FRACTION (of GPU memory JAX takes, default 0.92), GEN_BATCH_SCALE
# (`generate.py --batch-scale`: each stage's batch times this; unset: 1); for toy runs LIMIT
# (prompts per stage), GEN_BATCH, MAX_RECORDS, CACHE_TOKENS, KERNEL_TESTS=0. Everything the
# job reads is prepared by prepare.py on the CPU. STATES: `device` (default) has `train`
# compute the target's hidden states into GPU memory itself (`--states-on-device`; `generate`
# stops after the answers); `cache` is the seventeenth-to-twenty-fifth sessions' way, states
# cached to files by `generate` (or by `train` if `generate` did not get that far).
# At toy size on a CPU: STAGE=/tmp/stage KERNEL_TESTS=0 LIMIT=8 GEN_BATCH=4 MAX_RECORDS=240
# BATCH=4096 STEPS=6 EVAL_EVERY=3 CALIB=0 CACHE_TOKENS=4096 (examples/gpu_drafter/README.md).
set -uo pipefail
STAGE=${STAGE:-/root/stage}
OUT=${OUT:-$STAGE/out}
GPU=${GPU:-.gpu}
mkdir -p "$STAGE" "$OUT"
export SPECJAX_HOME=$STAGE/home TQDM_MININTERVAL=${TQDM_MININTERVAL:-15} PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
# The cached states live in GPU memory beside the step's logits: more than JAX's default 75%.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.92}
DRAFTER=${DRAFTER:-specjax/assets/drafters/SmolLM2-135M-Instruct}  # the starting drafter
TARGET=$STAGE/SmolLM2-135M-Instruct
# Tokens per step: the step's full-vocabulary logits are 4 * 49,152 bytes a token (12 GiB at
# 65,536 tokens, which an 80 GB H100 could not allocate beside the cached states).
BATCH=${BATCH:-32768}
# The hidden-state cache (~3.5 KB per token with two taps): in memory when /dev/shm has room.
SHM_GB=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
CACHE=${CACHE:-$( [ "${SHM_GB:-0}" -ge 60 ] && echo /dev/shm/specjax-cache || echo "$STAGE/cache" )}
STATES=${STATES:-device}
[ "$STATES" = device ] || [ "$STATES" = cache ] || { echo "STATES=device or cache" >&2; exit 2; }
COMMON=(--target "$TARGET" --max-len 1216 --max-conversations 10000000 --cache-dir "$CACHE"
        --drafter-taps 1,14 --cache-batch-tokens "${CACHE_TOKENS:-65536}" --on-device
        --bucket-width 304
        --log-every 10 --init-from "$STAGE/drafter0"
        --ce-weight 0.5 --train-vocab "fr:8192:$STAGE/freq/freq_counts.npy")

install() {
  if [ -d "$GPU/whl" ] && ! python3 -c "import gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$GPU"/whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  python3 -c "import specjax.train" 2>/dev/null || python3 -m pip install -q --no-deps \
    --no-build-isolation --ignore-requires-python -e . > "$STAGE/pip.log" 2>&1
  python3 -c "import specjax.kernels, gguf, jax; print('jax', jax.__version__, jax.devices())"
}

# The target's hidden states (with taps) for every record of data.jsonl, into $CACHE; a no-op
# when they are there already.
cache_states() {
  specjax train drafter --data "$STAGE/data.jsonl" --heldout-fraction "$(cat "$STAGE/heldout_fraction")" \
    "${COMMON[@]}" --cache-only --out "$STAGE/unused" --no-progress
}

store() {
  for p in "$GPU"/gguf/part_*; do [ -e "$p" ] && cp "$p" "$STAGE"/; done
  for d in payload tokenizer; do
    [ -d "$GPU/$d" ] && rm -rf "${STAGE:?}/$d" && cp -r "$GPU/$d" "$STAGE/$d"
  done
  return 0
}

case "${1:-}" in
receive)
  # Whatever this call carries (GGUF slices, payload/, tokenizer/); the starting drafter
  # from the first call's tree.
  store
  # With it, once, the shortlist trained on, kept apart from drafter0 so that `next` can
  # replace drafter0 with a trained drafter (which has no freq_counts.json saying the .npy
  # holds counts).
  if [ ! -e "$STAGE/drafter0" ]; then
    cp -r "$DRAFTER" "$STAGE/drafter0" && mkdir -p "$STAGE/freq" \
      && cp "$DRAFTER"/freq_counts.{npy,json} "$STAGE/freq/" || exit 1
  fi
  ls -la "$STAGE"; nvidia-smi -L; df -h /dev/shm "$STAGE" | tail -2; free -g | head -2
  install || exit 1
  [ -e "$STAGE/kernels.log" ] && exit 0  # started by an earlier receive
  # The kernels' tests, compiled on the GPU (interpret mode is what the CPU runs), in the
  # background: they finish while the next calls run, and `train` collects the log.
  if [ "${KERNEL_TESTS:-1}" = 1 ]; then  # (an `if`: with KERNEL_TESTS=0 the call succeeds)
    ( XLA_PYTHON_CLIENT_PREALLOCATE=false setsid nohup \
      timeout 900 python3 -m pytest -q -p no:cacheprovider tests/kernels \
      > "$STAGE/kernels.log" 2>&1 & )
  fi ;;
generate)
  store
  install || exit 1
  cat "$STAGE"/part_* > "$STAGE/target.gguf" && sha256sum "$STAGE/target.gguf"
  # tokenizer/ (if sent): the CPU's HF tokenizer files, for a transformers that cannot build
  # the GGUF's.
  TOK=(); [ -f "$STAGE/tokenizer/tokenizer.json" ] && TOK=(--tokenizer "$STAGE/tokenizer")
  [ -e "$TARGET/specjax.json" ] || specjax convert "$STAGE/target.gguf" "$TARGET" "${TOK[@]}" \
    || exit 1
  mkdir -p "$STAGE/answers"
  timeout "${GEN_S:-180}" python3 examples/gpu_drafter/generate.py --target "$TARGET" \
    --prompts "$STAGE/payload/prompts.json.xz" --out-dir "$STAGE/answers" \
    --stages "${STAGES:-greedy_self,greedy_passages,sampled_self,sampled_followup,greedy_new,sampled_short}" \
    ${LIMIT:+--limit "$LIMIT"} ${GEN_BATCH:+--batch "$GEN_BATCH"} \
    ${GEN_BATCH_SCALE:+--batch-scale "$GEN_BATCH_SCALE"} 2>&1 | tr '\r' '\n' \
    | grep -v '%|' 
  # One data file: the prepared records (held-out first), then every complete new answer.
  python3 - "$STAGE/payload" "$STAGE" "${MAX_RECORDS:-}" "$OUT/answers.npz" <<'EOF'
import json, lzma, sys
from pathlib import Path
import numpy as np
payload, stage = Path(sys.argv[1]), Path(sys.argv[2])
n, cap = 0, int(sys.argv[3]) if sys.argv[3] else None
stages = sorted((stage / "answers").glob("*.jsonl"))
# Each new answer is read once: into the training data, and compactly into $OUT (uint16 ids,
# vocab < 65,536; per record its stage, prompt index, answer length and whether it hit EOS;
# the prompts are the payload's pool).
rows, toks = [], []
with open(stage / "data.jsonl", "w") as out:
    for line in lzma.open(payload / "data.jsonl.xz", "rt"):
        if cap is not None and n >= cap:
            break  # toy runs: the held-out records and a few more
        out.write(line); n += 1
    for k, f in enumerate(stages):
        for line in f.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line a time limit cut
            out.write(json.dumps({"tokens": r["tokens"], "assistant": r["assistant"]}) + "\n")
            ans = r["tokens"][r["assistant"].index(1):]
            rows.append((k, r["prompt_index"], len(ans), int(r["finished"])))
            toks.extend(ans)
np.savez_compressed(sys.argv[4], tokens=np.asarray(toks, np.uint16),
                    records=np.asarray(rows, np.int32).reshape(-1, 4),
                    stages=np.asarray([f.stem for f in stages]))
meta = json.loads((payload / "data.json").read_text())
frac = (meta["heldout"] - 0.5) / (n + len(rows))
(stage / "heldout_fraction").write_text(f"{frac!r}")
print(json.dumps({"prepared": n, "new": len(rows), "heldout": meta["heldout"]}))
EOF
  cp "$STAGE"/answers/*.meta.json "$OUT"/ 2>/dev/null
  HF=$(cat "$STAGE/heldout_fraction")
  [ "$STATES" = device ] && exit 0  # `train` computes the states where it trains
  cache_states || exit 1
  # 20 timed steps (compiles included) over the whole cache: the rate `train` sizes from.
  [ "${CALIB:-1}" = 1 ] || exit 0
  rm -rf "$STAGE/calib-ckpt"
  specjax train drafter --data "$STAGE/data.jsonl" --heldout-fraction "$HF" "${COMMON[@]}" \
    --steps 20 --batch-size "$BATCH" --lr 1e-4 --log-every 1 --checkpoint-every 1000 \
    --ckpt-dir "$STAGE/calib-ckpt" --out "$STAGE/calib" --overwrite --no-progress \
    --max-eval-tokens 20000 > "$STAGE/calib.log" 2>&1; tail -3 "$STAGE/calib.log"
  python3 -c "
import json; t = json.load(open('$STAGE/calib/training_log.json'))['train']
w = [r['wall_s'] for r in t]; print('calib wall_s', w[0], w[9], w[-1],
      'step_s(10-20)', round((w[-1] - w[9]) / (len(w) - 10), 3), 'tokens', t[-1]['tokens_seen'])"
  ;;
train)
  HF=$(cat "$STAGE/heldout_fraction")
  # STATES=cache: the hidden states first, outside the time limits below, for a `generate`
  # that stopped before it had cached them (a no-op when it had): caching inside the timed
  # call would count against the hard timeout, which on 2 CPU cores ends the toy run before
  # a step. STATES=device: `train` computes them, into GPU memory, before its first step.
  ON=(--states-on-device); [ "$STATES" = cache ] && { cache_states || exit 1; ON=(); }
  # TRAIN_S stops training gracefully (checkpointed, the drafter still written, marked
  # incomplete); the hard timeout only catches a hang. LR 1e-4 by default: every run starts
  # from a trained drafter, and higher peaks dipped (5e-4: 0.577 -> 0.259 in a toy run).
  # --keep-best: the drafter written is the best held-out evaluation's (every EVAL_EVERY
  # steps and where it stopped), since a run over one GPU session's answers may overfit.
  # (--time-limit counts from the first step; the states on the device come before it, in
  # STATES_S of the hard timeout's allowance.)
  timeout $(( ${TRAIN_S:-420} + 120 + ${STATES_S:-$([ "$STATES" = device ] && echo 240 || echo 0)} )) \
    specjax train drafter --data "$STAGE/data.jsonl" --time-limit "${TRAIN_S:-420}" "${ON[@]}" \
    --heldout-fraction "$HF" "${COMMON[@]}" --steps "${STEPS:?}" --batch-size "$BATCH" \
    --lr "${LR:-1e-4}" --warmup 0.03 --tap-lr-scale "${TAP_LR:-4}" \
    --eval-every "${EVAL_EVERY:-250}" --keep-best ${TTT:+--ttt-steps "$TTT"} \
    ${TV:+--tv-weight "$TV"} ${DTYPE:+--compute-dtype "$DTYPE"} \
    ${LAYERS:+--drafter-layers "$LAYERS"} \
    --checkpoint-every 250 --ckpt-dir "$STAGE/ckpt" --out "$STAGE/drafter" --overwrite \
    --no-progress --resume 2>&1 | tail -40
  # specjax's status, not tail's: 1 also when TRAIN_S stopped it (the drafter is written).
  rc=${PIPESTATUS[0]}
  cp "$STAGE/kernels.log" "$OUT/" 2>/dev/null
  # Files come back at <= 16 MiB each: the drafter (~19 MB in float32) in slices.
  [ -d "$STAGE/drafter" ] && tar -C "$STAGE" -cf - drafter | xz -T0 \
    | split -b 15000000 - "$OUT/drafter.tar.xz.part_"
  ls -la "$OUT"; exit "$rc" ;;
next)
  # The drafter `train` wrote becomes the starting drafter of the next `train` on this warm
  # machine (its checkpoints set aside, or --resume would pick them up).
  [ -d "$STAGE/drafter" ] || { echo "no trained drafter in $STAGE" >&2; exit 1; }
  n=$(ls -d "$STAGE"/drafter0.* 2>/dev/null | wc -l)
  mv "$STAGE/drafter0" "$STAGE/drafter0.$n" && cp -r "$STAGE/drafter" "$STAGE/drafter0" \
    && { [ ! -d "$STAGE/ckpt" ] || mv "$STAGE/ckpt" "$STAGE/ckpt.$n"; } ;;
*) echo "usage: $0 receive|generate|train|next" >&2; exit 2 ;;
esac
