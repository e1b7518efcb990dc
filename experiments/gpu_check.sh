#!/usr/bin/env bash
# One GPU check in one device call of under 8 minutes on one H100/H200 (issue 40), results under $OUT
# (default /tmp/gpu_check), at most 8 files, none in a subfolder:
#
#   bash experiments/gpu_check.sh
#
#   env.txt       GPU, driver, Python packages, commit
#   tests.txt     the kernel and model tests on the GPU (SPMDLAB_TEST_PLATFORMS=cuda,cpu, one device)
#   profile_*.txt where the gpt2-124m (AdamW, Muon) and moe-small steps' time goes (experiments.profile_summary)
#   log.txt       every command's output
#   results.jsonl one line per step: name, exit status, seconds, and the step's JSON (or why it was skipped)
#
# The device has no package registry: fetch the wheels once here and carry .whl/ (pytest for the tests;
# tokamax and its dependencies for the tokamax rows and tests, pinned as docs/benchmarks.md 24 verified):
#   ../shared/tools/gpu-wheels pytest pytest-xdist execnet pluggy iniconfig hypothesis sortedcontainers attrs \
#     safetensors tokenizers tokamax==0.0.12 einshape==1.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 pydantic==2.14.4 \
#     pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 qwix==0.1.8 \
#     typeguard==2.13.3 immutabledict==4.3.1
#
# Order: the wheels (the line ../shared/tools/gpu-wheels prints, where the tree carries .whl/), the
# environment, then the tests in the background while the README main job runs, then one step at a
# time by priority (the list below). A step starts only if its expected time fits
# in what is left of BUDGET_S (default 470 s) and runs under `timeout` at the smaller of its limit
# and what is left; skipped steps are listed in results.jsonl. Measured on the H200 (../shared/gpu):
# kernel tests 44 s with 6 workers, main job 37 s, 16 s a throughput row, 50 s the twin, 27 s + 39 s
# the kernels, 20-80 s an optimizer step; on 2026-11-28 (docs/benchmarks.md 23) the tests did not finish in 170 s
# with 8 workers beside the main job (54 s), a throughput row took 20-32 s, the twin 114 s, four optimizers 81 s.
#
# Sizes come from the environment, so the same script runs as a smoke check on a CPU, e.g.
#   OUT=/tmp/gc TEST_PLATFORMS=cpu TESTS=tests/kernels_pallas/test_backends.py TEST_WORKERS=0 PRESET=tiny \
#   LLAMA=tiny MOE=moe-tiny BATCH=2x32 LLAMA_BATCH=2x32 DTYPE=float32 REPEATS=1 STEPS=1 TWIN_DEVICE=cpu \
#   OPTIMIZERS=adamw OPTIMIZER_TREE=tiny MAIN_FLAGS="--config.steps=2 --config.eval_every=2 --config.optimizer.warmup_steps=1" \
#   KERNEL_FLAGS="--shapes=1x40x2x32 --implementations=xla --dtype=float32 --gmm_shapes=2x40x16x16 \
#   --quantized_shapes=2x32x64 --quantized_variants=fp32 --warmup=0 --iters=1" bash experiments/gpu_check.sh
# (NO_WHEELS=1 where .whl/ holds the device's wheels), SPEEDRUN_PRESET=speedrun-tiny SPEEDRUN_SEQ=256 SPEEDRUN_STEPS=2.
# DRY_RUN=1 prints the steps without running them.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
WORK=${WORK:-/tmp/gpu_check_work}  # the steps' JSON and the main job's run directory (not returned)
BUDGET_S=${BUDGET_S:-470}
PRESET=${PRESET:-gpt2-124m} LLAMA=${LLAMA:-llama-1b} MOE=${MOE:-moe-small}
BATCH=${BATCH:-16x1024} LLAMA_BATCH=${LLAMA_BATCH:-8x2048} DTYPE=${DTYPE:-bfloat16}
REPEATS=${REPEATS:-3} STEPS=${STEPS:-5}
TESTS=${TESTS:-tests/kernels_pallas tests/lm} TEST_WORKERS=${TEST_WORKERS:-8} TEST_PLATFORMS=${TEST_PLATFORMS:-cuda,cpu}
OPTIMIZERS=${OPTIMIZERS:-adamw,muon,dion,soap} OPTIMIZER_TREE=${OPTIMIZER_TREE:-$PRESET}
mkdir -p "$OUT" "$WORK"
START=$SECONDS

NAMES=() EXPECTED=() LIMITS=() COMMANDS=() JSONS=()
step() {  # step NAME EXPECTED_S LIMIT_S JSON COMMAND...: queued, run in order by run_steps
  NAMES+=("$1") EXPECTED+=("$2") LIMITS+=("$3") JSONS+=("$4"); shift 4
  COMMANDS+=("$(printf '%q ' "$@")")
}

record() {  # record NAME STATUS SECONDS JSON_FILE: one line of results.jsonl
  python3 -c 'import json, os, sys
name, status, seconds, path = sys.argv[1:5]
result = json.load(open(path)) if path and os.path.isfile(path) and os.path.getsize(path) else None
print(json.dumps({"step": name, "exit": int(status) if status.lstrip("-").isdigit() else status, "seconds": int(seconds), "result": result}))' \
    "$@" >> "$OUT/results.jsonl" 2>> "$OUT/log.txt"
}

run_steps() {
  local i left limit status start
  for i in "${!COMMANDS[@]}"; do
    left=$((BUDGET_S - (SECONDS - START)))
    limit=$(( LIMITS[i] < left ? LIMITS[i] : left ))
    if [ -n "${DRY_RUN:-}" ]; then
      echo "${NAMES[$i]}: expected ${EXPECTED[$i]} s, timeout ${LIMITS[$i]} ${COMMANDS[$i]}"
      continue
    fi
    if [ "$left" -lt "${EXPECTED[$i]}" ]; then
      echo "== ${NAMES[$i]}: skipped, ${left} s left of ${BUDGET_S} s, expected ${EXPECTED[$i]} s" >> "$OUT/log.txt"
      record "${NAMES[$i]}" "skipped: budget (${left} s left, expected ${EXPECTED[$i]} s)" 0 ""
      continue
    fi
    echo "== ${NAMES[$i]} (timeout ${limit} s): ${COMMANDS[$i]}" >> "$OUT/log.txt"
    start=$SECONDS status=0
    eval "timeout -k 10 ${limit} ${COMMANDS[$i]}" >> "$OUT/log.txt" 2>&1 || status=$?
    echo "   ${NAMES[$i]}: exit ${status}, $((SECONDS - start)) s" >> "$OUT/log.txt"
    record "${NAMES[$i]}" "$status" "$((SECONDS - start))" "${JSONS[$i]}"
  done
}

throughput() {  # throughput NAME EXPECTED LIMIT PRESET BATCH [--config.* ...]: one training-step row
  local name=$1 expected=$2 limit=$3 preset=$4 batch=$5; shift 5
  step "$name" "$expected" "$limit" "$WORK/$name.json" python3 -m experiments.bench_throughput --presets="$preset" \
    --batch_shapes="$batch" --dtypes="$DTYPE" --tokens="${TOKENS:-zipf}" --warmup=2 --repeats="$REPEATS" --steps="$STEPS" \
    --json_out="$WORK/$name.json" "$@"
}

# By priority (the budget skips from the end).
throughput step_"$PRESET"_auto 35 75 "$PRESET" "$BATCH" --config.model.attention=auto
step torch_twin 110 150 "$WORK/torch_twin.json" python3 -m experiments.bench_cpu_peer --device="${TWIN_DEVICE:-cuda}" \
  --presets="$PRESET" --batch_shapes="$BATCH" --sweep_batches= --products=false --warmup=2 --repeats="$REPEATS" \
  --steps="$STEPS" --json_out="$WORK/torch_twin.json"
# Where a step's time goes: a trace of three steps of a short run, summarised into profile_NAME.txt. Without
# CUDA command buffers, whose kernels carry the buffer's name (command_buffer_159) instead of their HLO op's.
profile() {  # profile NAME EXPECTED LIMIT PRESET BATCH [--config.* ...]
  local name=$1 expected=$2 limit=$3 preset=$4 batch=$5; shift 5
  step profile_"$name" "$expected" "$limit" "" bash -c "XLA_FLAGS='--xla_gpu_enable_command_buffer= ${XLA_FLAGS:-}' \
    python3 -m experiments.train --workdir='$WORK/profile_$name' --config.model.preset='$preset' --config.batch_size='${batch%x*}' \
    --config.data.seq_len='${batch#*x}' --config.model.dtype='$DTYPE' --config.steps=6 --config.profile=3:5 --config.eval_every=1000 \
    --config.checkpoint_every=1000 $* && python3 -m experiments.profile_summary '$WORK/profile_$name' --top=25 > '$OUT/profile_$name.txt'"
}
profile "$PRESET" 45 90 "$PRESET" "$BATCH" ${PROFILE_FLAGS:-}
profile "$MOE" 45 90 "$MOE" "$BATCH"  # issue 44 item 5: where moe-small's 12% MFU goes (router, sort, permute, gmm, combine)
profile muon 45 90 "$PRESET" "$BATCH" --config.optimizer.name=muon  # issue 44 item 4: Muon's 1.12x AdamW, kernel by kernel
# The layer loop's copies (issue 44 item 2; 8.6 ms of a 48 ms step on the H200): unrolled, two blocks per
# iteration, and XLA:GPU's while-loop double buffering.
throughput step_"$PRESET"_unrolled 45 80 "$PRESET" "$BATCH" --config.model.attention=auto --config.model.scan_layers=false
throughput step_"$PRESET"_unroll2 35 75 "$PRESET" "$BATCH" --config.model.attention=auto --config.model.scan_unroll=2
step step_"$PRESET"_double_buffer 35 75 "$WORK/step_double_buffer.json" env XLA_FLAGS="--xla_gpu_enable_while_loop_double_buffering=true ${XLA_FLAGS:-}" \
  python3 -m experiments.bench_throughput --presets="$PRESET" --batch_shapes="$BATCH" --dtypes="$DTYPE" --tokens="${TOKENS:-zipf}" --warmup=2 \
  --repeats="$REPEATS" --steps="$STEPS" --json_out="$WORK/step_double_buffer.json" --config.model.attention=auto
throughput step_"$PRESET"_fp8 35 75 "$PRESET" "$BATCH" --config.model.attention=auto --config.model.fp8=hybrid
# The speedrun on one GPU for a fixed number of steps: the record's per-GPU load (one 48Ki-token sequence),
# on byte-level stdlib shards (no FineWeb here), no target; tokens/s and MFU without compilation.
step speedrun 60 110 "$WORK/speedrun/speedrun.json" python3 -m experiments.speedrun \
  --config=experiments/configs/speedrun.py:tiny --workdir="$WORK/speedrun" --shards="$WORK/speedrun_shards" --max_files=600 \
  --config.model.preset="${SPEEDRUN_PRESET:-speedrun-124m}" --config.batch_size=1 --config.data.seq_len="${SPEEDRUN_SEQ:-49152}" \
  --config.steps="${SPEEDRUN_STEPS:-40}" --config.eval_every="${SPEEDRUN_STEPS:-40}" --config.data.val_tokens="${SPEEDRUN_SEQ:-49152}" \
  --config.target_val_loss=0.01
step optimizers 90 150 "$WORK/optimizers.json" python3 -m experiments.bench_optimizer_step --optimizers="$OPTIMIZERS" \
  --trees="$OPTIMIZER_TREE" --train_batch="$BATCH" --train_dtype="$DTYPE" --repeats="$REPEATS" --json_out="$WORK/optimizers.json"
throughput step_"$MOE" 30 60 "$MOE" "$BATCH" --config.model.attention=auto
throughput step_"$LLAMA" 40 75 "$LLAMA" "$LLAMA_BATCH" --config.model.attention=auto
throughput step_"$PRESET"_pallas 35 75 "$PRESET" "$BATCH" --config.model.attention=pallas
step kernels 70 110 "$WORK/kernels.json" python3 -m experiments.bench_kernels --sections=attention,gmm,quantized_update \
  ${KERNEL_FLAGS:-} --json_out="$WORK/kernels.json"
throughput step_"$LLAMA"_fp8 40 75 "$LLAMA" "$LLAMA_BATCH" --config.model.attention=auto --config.model.fp8=hybrid
# Every registered optimizer's update alone on the preset's shapes: issue 44 item 4's one table of the registry
# (the whole steps above time four; each of these compiles only its update).
step optimizer_updates 120 200 "$WORK/optimizer_updates.json" python3 -m experiments.bench_optimizer_step --optimizers=all \
  --trees="$OPTIMIZER_TREE" --repeats="$REPEATS" --json_out="$WORK/optimizer_updates.json"

# The tests beside the main job: both share the GPU, so neither takes its memory up front.
TESTS_CMD=(env SPMDLAB_TEST_PLATFORMS="$TEST_PLATFORMS" SPMDLAB_TEST_CPU_DEVICES=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
  python3 -m pytest -o addopts= -n "$TEST_WORKERS" -v -p no:cacheprovider -r fEs $TESTS)  # -v: each outcome as it comes
MAIN_CMD=(env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m experiments.train --workdir="$WORK/main_job" ${MAIN_FLAGS:-})
if [ -n "${DRY_RUN:-}" ]; then
  echo "tests (background, timeout ${TESTS_TIMEOUT:-240}): ${TESTS_CMD[*]}"
  echo "main_job (timeout 120): ${MAIN_CMD[*]}"
  run_steps
  exit 0
fi

if [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then  # the line ../shared/tools/gpu-wheels prints
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

{
  echo "date: $(date -u)  commit: $(git rev-parse HEAD 2>/dev/null) ($(git status --short 2>/dev/null | wc -l) files changed)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1
  python3 -c 'import sys, importlib.metadata as m, jax
print("python", sys.version.split()[0]); print("devices", jax.devices())
for p in ("jax", "jaxlib", "flax", "optax", "torch", "triton", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13"):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: pass' 2>&1
  nproc; free -g | head -2
} > "$OUT/env.txt"

start=$SECONDS
timeout -k 10 ${TESTS_TIMEOUT:-240} "${TESTS_CMD[@]}" > "$OUT/tests.txt" 2>&1 &
tests_pid=$!
echo "== main_job (timeout 120): ${MAIN_CMD[*]}" >> "$OUT/log.txt"
status=0
timeout -k 10 120 "${MAIN_CMD[@]}" >> "$OUT/log.txt" 2>&1 || status=$?
record main_job "$status" "$((SECONDS - start))" ""
status=0
wait "$tests_pid" || status=$?
record tests "$status" "$((SECONDS - start))" ""
run_steps
echo "done in $((SECONDS - START)) s" >> "$OUT/log.txt"
exit 0
