#!/usr/bin/env bash
# The GPU measurements the open issues still owe (docs/benchmarks.md), as four runs of under 10 minutes
# each on one H100, every result written under $OUT (default /tmp/accelerator_checks):
#
#   bash experiments/accelerator_checks.sh kernels      # issues 12, 14, 17: kernels compiled, checked, timed
#   bash experiments/accelerator_checks.sh step         # issue 11: tokens/s and MFU, layers scanned / unrolled / remat
#   bash experiments/accelerator_checks.sh attention    # issue 11: the same per attention implementation
#   bash experiments/accelerator_checks.sh optimizers   # issue 11: whole training steps per optimizer vs AdamW
#
# Sizes come from the environment, so the same commands run as a smoke check on a CPU, e.g.
#   OUT=/tmp/ac PRESETS=tiny BATCH=2x32 DTYPE=float32 ATTENTION=xla STEPS=2 REPEATS=1 \
#     bash experiments/accelerator_checks.sh step
#   OUT=/tmp/ac TEST_PLATFORMS=cpu KERNEL_TESTS=tests/kernels_pallas/test_backends.py KERNEL_FLAGS="--shapes=1x40x2x32 \
#     --implementations=pallas,xla --dtype=float32 --gmm_shapes=2x40x16x16 --gmm_block_m=16 --gmm_block_k=16 \
#     --gmm_block_n=16 --quantized_shapes=2x32x64 --warmup=0 --iters=1" bash experiments/accelerator_checks.sh kernels
# Each command's output goes to $OUT/<name>.txt and its table to $OUT/<name>.json; a failing command is
# recorded in $OUT/failed.txt and the others still run.
set -uo pipefail
OUT=${OUT:-/tmp/accelerator_checks}
PRESETS=${PRESETS:-gpt2-124m,small}
BATCH=${BATCH:-16x1024}
DTYPE=${DTYPE:-bfloat16}
ATTENTION=${ATTENTION:-cudnn}  # the baseline rows use cuDNN; the step section adds xla and pallas
STEPS=${STEPS:-10}
REPEATS=${REPEATS:-5}
mkdir -p "$OUT"

run() {  # run NAME COMMAND...: output to $OUT/NAME.txt, exit status noted on failure
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/commands.txt"
  local start=$SECONDS
  "$@" > "$OUT/$name.txt" 2>&1 || echo "$name exit $?" >> "$OUT/failed.txt"
  echo "   $((SECONDS - start)) s" | tee -a "$OUT/commands.txt"
}

throughput() {  # throughput NAME [--config.* ...]: the training step of every preset at $BATCH
  local name=$1; shift
  run "$name" python -m experiments.bench_throughput --presets="$PRESETS" --batch_shapes="$BATCH" --dtypes="$DTYPE" \
    --warmup=2 --repeats="$REPEATS" --steps="$STEPS" --json_out="$OUT/$name.json" "$@"
}

case "${1:-}" in
  kernels)
    SPMDLAB_TEST_PLATFORMS=${TEST_PLATFORMS:-cuda,cpu} run kernel_tests python -m pytest -n 0 -q ${KERNEL_TESTS:-tests/kernels_pallas}
    run kernels python -m experiments.bench_kernels --sections=attention,gmm,quantized_update \
      ${KERNEL_FLAGS:-} --json_out="$OUT/kernels.json"
    ;;
  step)
    throughput step_scan --config.model.attention="$ATTENTION"
    throughput step_unrolled --config.model.attention="$ATTENTION" --config.model.scan_layers=false
    throughput step_scan_remat --config.model.attention="$ATTENTION" --config.model.remat=dots_with_no_batch_dims_saveable
    ;;
  attention)
    throughput step_scan_unroll2 --config.model.attention="$ATTENTION" --config.model.scan_unroll=2
    throughput step_pallas --config.model.attention=pallas
    throughput step_xla --config.model.attention=xla
    ;;
  optimizers)
    preset=${PRESETS%%,*}
    run optimizers python -m experiments.bench_optimizer_step --optimizers=adamw,muon,normuon,mars_muon,lion,soap \
      --trees="$preset" --train_batch="$BATCH" --train_dtype="$DTYPE" --repeats="$REPEATS" --out="$OUT/optimizers.json"
    # Shampoo over one real refresh cycle (precondition_every=100 steps), timed rather than computed.
    PRESETS=$preset STEPS=${SHAMPOO_CYCLE:-100} REPEATS=1 throughput shampoo_cycle --optimizer=shampoo \
      --config.model.attention="$ATTENTION"
    PRESETS=$preset STEPS=${SHAMPOO_CYCLE:-100} REPEATS=1 throughput adamw_cycle --config.model.attention="$ATTENTION"
    ;;
  *)
    echo "usage: $0 kernels|step|attention|optimizers (see the header)" >&2
    exit 2
    ;;
esac
[ -s "$OUT/failed.txt" ] && cat "$OUT/failed.txt"
exit 0
