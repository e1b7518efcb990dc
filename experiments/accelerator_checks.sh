#!/usr/bin/env bash
# The GPU measurements the open issues still owe (docs/benchmarks.md), as six calls of under 10 minutes
# each on one H100 (the device's limit per call), every result written under $OUT (default /tmp/accelerator_checks):
#
#   bash experiments/accelerator_checks.sh kernels           # issues 12, 14, 17, 26: kernels compiled, checked, timed
#   bash experiments/accelerator_checks.sh step              # issue 11: tokens/s and MFU, layers scanned / unrolled / remat
#   bash experiments/accelerator_checks.sh attention         # issue 11: the same per attention implementation
#   bash experiments/accelerator_checks.sh optimizers        # issue 11: whole training steps per optimizer vs AdamW:
#   bash experiments/accelerator_checks.sh optimizers_soap   #   Muon family, then Lion, SOAP and SOAP's refresh step
#   bash experiments/accelerator_checks.sh optimizer_cycles  # Shampoo over a real 100-step cycle, AdamW alike
#
# Where the working tree carries wheels in .whl/ (a device without the dependencies), they are installed
# into /tmp/site first. Every command runs under its own `timeout` (its share of the section's 560 s,
# scaled by TIME_SCALE), so a hung one cannot cost the call. Each case writes its own JSON
# ($OUT/<case>.json): a failing case loses nothing else. All output goes to $OUT/log.txt, failures to
# $OUT/failed.txt: at most 8 files per call, none in a subfolder.
#
# Sizes come from the environment, so the same commands run as a smoke check on a CPU, e.g.
#   OUT=/tmp/ac PRESETS=tiny BATCH=2x32 DTYPE=float32 ATTENTION=xla STEPS=2 REPEATS=1 \
#     bash experiments/accelerator_checks.sh step
#   OUT=/tmp/ac TEST_PLATFORMS=cpu KERNEL_TESTS=tests/kernels_pallas/test_backends.py KERNEL_FLAGS="--shapes=1x40x2x32 \
#     --implementations=pallas,xla --dtype=float32 --gmm_shapes=2x40x16x16 --gmm_block_m=16 --gmm_block_k=16 \
#     --gmm_block_n=16 --quantized_shapes=2x32x64 --warmup=0 --iters=1" bash experiments/accelerator_checks.sh kernels
# DRY_RUN=1 prints the commands without running them.
set -uo pipefail
OUT=${OUT:-/tmp/accelerator_checks}
PRESETS=${PRESETS:-gpt2-124m,small}
BATCH=${BATCH:-16x1024}
DTYPE=${DTYPE:-bfloat16}
ATTENTION=${ATTENTION:-cudnn}  # the issue's baseline rows use cuDNN; the attention section adds xla and pallas
STEPS=${STEPS:-10}
REPEATS=${REPEATS:-5}
SECTION_S=560  # of the device's 600 s per call, leaving time to start and to return $OUT
mkdir -p "$OUT"

if [ -z "${DRY_RUN:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    >> "$OUT/log.txt" 2>&1 && export PYTHONPATH=/tmp/site:$PWD
fi

NAMES=() LIMITS=() COMMANDS=()
case_() {  # case_ NAME SECONDS COMMAND...: queued; the section then runs each under `timeout SECONDS`
  NAMES+=("$1") LIMITS+=("$(( $2 * ${TIME_SCALE:-100} / 100 ))"); shift 2
  COMMANDS+=("$(printf '%q ' "$@")")
}

run_all() {
  local i total=0
  for i in "${LIMITS[@]}"; do total=$((total + i)); done
  if [ "$total" -gt "$SECTION_S" ] && [ "${TIME_SCALE:-100}" -le 100 ]; then
    echo "the section's timeouts add up to $total s, over $SECTION_S s" >&2
    exit 3
  fi
  for i in "${!COMMANDS[@]}"; do
    if [ -n "${DRY_RUN:-}" ]; then
      echo "${NAMES[$i]}: timeout ${LIMITS[$i]} ${COMMANDS[$i]}"
      continue
    fi
    echo "== ${NAMES[$i]} (timeout ${LIMITS[$i]} s): ${COMMANDS[$i]}" >> "$OUT/log.txt"
    local start=$SECONDS status=0
    eval "timeout -k 10 ${LIMITS[$i]} ${COMMANDS[$i]}" >> "$OUT/log.txt" 2>&1 || status=$?
    echo "   ${NAMES[$i]}: exit ${status}, $((SECONDS - start)) s" >> "$OUT/log.txt"
    if [ "$status" -ne 0 ]; then echo "${NAMES[$i]} exit $status" >> "$OUT/failed.txt"; fi
  done
}

throughput() {  # throughput NAME SECONDS [--config.* ...]: the training step at $BATCH, one case per preset
  local name=$1 limit=$2 preset; shift 2
  for preset in ${PRESETS//,/ }; do
    case_ "${name}_${preset}" "$limit" python3 -m experiments.bench_throughput --presets="$preset" --batch_shapes="$BATCH" \
      --dtypes="$DTYPE" --warmup=2 --repeats="$REPEATS" --steps="$STEPS" --json_out="$OUT/${name}_${preset}.json" "$@"
  done
}

preset=${PRESETS%%,*}
case "${1:-}" in
  kernels)
    case_ kernel_tests 260 env SPMDLAB_TEST_PLATFORMS="${TEST_PLATFORMS:-cuda,cpu}" python3 -m pytest -n 0 -q -p no:cacheprovider \
      ${KERNEL_TESTS:-tests/kernels_pallas}
    for section in attention gmm quantized_update; do
      case_ "kernels_$section" 100 python3 -m experiments.bench_kernels --sections="$section" ${KERNEL_FLAGS:-} \
        --json_out="$OUT/kernels_$section.json"
    done
    ;;
  step)
    throughput step_scan 90 --config.model.attention="$ATTENTION"
    throughput step_unrolled 90 --config.model.attention="$ATTENTION" --config.model.scan_layers=false
    throughput step_scan_remat 90 --config.model.attention="$ATTENTION" --config.model.remat=dots_with_no_batch_dims_saveable
    ;;
  attention)
    throughput step_scan_unroll2 90 --config.model.attention="$ATTENTION" --config.model.scan_unroll=2
    throughput step_pallas 90 --config.model.attention=pallas
    throughput step_xla 90 --config.model.attention=xla
    ;;
  optimizers | optimizers_soap)
    # One process per row, AdamW in both calls as their baseline; soap_refresh: SOAP's step that refreshes
    # every eigenbasis (SOAP at its default refresh every 10 steps costs (9 soap + soap_refresh) / 10).
    rows="adamw muon normuon mars_muon"
    [ "$1" = optimizers_soap ] && rows="adamw lion soap soap_refresh"
    for optimizer in $rows; do
      case_ "optimizer_$optimizer" 130 python3 -m experiments.bench_optimizer_step --optimizers="$optimizer" --trees="$preset" \
        --train_batch="$BATCH" --train_dtype="$DTYPE" --repeats="$REPEATS" --out="$OUT/optimizer_$optimizer.json"
    done
    ;;
  optimizer_cycles)
    # Whole steps over one real refresh cycle of Shampoo (its preconditioners every 100 steps), timed rather
    # than computed, and AdamW over the same steps.
    PRESETS=$preset STEPS=${SHAMPOO_CYCLE:-100} REPEATS=1 throughput shampoo_cycle 300 --optimizer=shampoo \
      --config.model.attention="$ATTENTION"
    PRESETS=$preset STEPS=${SHAMPOO_CYCLE:-100} REPEATS=1 throughput adamw_cycle 200 --config.model.attention="$ATTENTION"
    ;;
  *)
    echo "usage: $0 kernels|step|attention|optimizers|optimizers_soap|optimizer_cycles (see the header)" >&2
    exit 2
    ;;
esac
run_all
[ -s "$OUT/failed.txt" ] && cat "$OUT/failed.txt"
exit 0
