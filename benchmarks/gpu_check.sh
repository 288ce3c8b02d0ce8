#!/usr/bin/env bash
# One lent GPU's checks, in the order the GPU issue asks for, within one time limit:
#   1. pytest -m gpu (kernels, engine, host tier, KV sizing), then the Triton kernel tests
#   that also run interpreted on CPU (token bitmask, LoRA) on the card; then PLAN's steps:
#   the default KV size on the card with a full batch (kv-sizing), LoRA's decode cost
#   against the base step (lora), the host tier's restore, the decode step's profile (at
#   the commit in BASE too, when given, for a side-by-side on the same card), the cost
#   models of three shapes (step profiles), the full gpu_engine run (decode/prefill/offline).
# Runs from the repository root with the machine's own python3 (torch, triton,
# transformers there): links in kvroute/ give the package its layout, so nothing is
# installed. Random checkpoints are kept in /tmp/kvroute-ck across steps.
# The tiny-checkpoint test fixtures need the SmolLM2 tokenizer: .gpu/cache holds its
# converted folder without the weights (the device machines have no gguf to convert).
#
#   [PLAN="restore profile ..."] [TESTS=-k expression|none] bash benchmarks/gpu_check.sh OUT_DIR [BASE_SOURCE_DIR] [SECONDS]
#   bash benchmarks/gpu_check.sh --prepare BASE_COMMIT   (here, before the call: .gpu/ with the
#     base commit's tree in .gpu/base and the fixtures' tokenizer in .gpu/cache; carry ".gpu")
# PLAN's steps, in its order: kv-sizing lora lora-base restore profile profile-base sweep cost-model
# engine engine-base
# (the *-base ones run the harness of this tree on the product code in BASE_SOURCE_DIR).
set -u
if [ "${1:-}" = --prepare ]; then
  commit=${2:?usage: gpu_check.sh --prepare BASE_COMMIT}
  set -e
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo /.gpu/ >>"$exclude"
  rm -rf .gpu/base
  mkdir -p .gpu/base
  git archive "$commit" | tar -x -C .gpu/base  # a plain tree (no worktree to register)
  tok=$(.venv/bin/python -c "from kvroute.replica.checkpoint import resolve_model; print(resolve_model('smollm2-135m-instruct'))")
  mkdir -p .gpu/cache/smollm2-135m-instruct
  for f in config.json generation_config.json kvroute_conversion.json tokenizer.json tokenizer_config.json; do
    cp "$tok/$f" .gpu/cache/smollm2-135m-instruct/
  done
  du -sh .gpu
  exit 0
fi
out=${1:?usage: gpu_check.sh OUT_DIR [BASE_SOURCE_DIR] [SECONDS]}
base=${2:-}
budget=${3:-560}
plan=${PLAN:-restore profile-base profile cost-model engine}
tests=${TESTS:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
ck=/tmp/kvroute-ck

links() {  # links SOURCE: SOURCE/kvroute/<folder> -> SOURCE/<folder> (the package's layout)
  for p in replica kernels router cluster deploy benchmarks; do ln -sfn "$(realpath "$1/$p")" "$1/kvroute/$p"; done
}

step() {  # step NAME SECONDS CMD...: run with the smaller of SECONDS and what is left
  local name=$1 limit=$2
  shift 2
  local left=$((budget - SECONDS - 5))
  ((left < limit)) && limit=$left
  if ((limit < 20)); then echo "== $name: skipped ($left s left)"; return; fi
  echo "== $name (limit ${limit}s, at ${SECONDS}s)"
  timeout "$limit" "$@" 2>&1
  echo "== $name: exit $? at ${SECONDS}s"
}

links .
[ -n "$base" ] && links "$base"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

new="env PYTHONPATH=$PWD KVROUTE_CACHE=$PWD/.gpu/cache"
base_run="env -C $base PYTHONPATH=."
outdir=$(realpath "$out")
if [ "$tests" != none ]; then
  step tests 170 $new python3 -m pytest -q -m gpu -p no:cacheprovider ${tests:+-k "$tests"} \
    tests/kernels/test_gpu.py tests/replica/test_host_tier.py tests/replica/test_kv_sizing.py
  step kernel-tests 60 $new python3 -m pytest -q -p no:cacheprovider ${tests:+-k "$tests"} \
    tests/kernels/test_token_bitmask.py tests/kernels/test_lora_kernel.py
fi
[ -n "$base" ] && cp benchmarks/gpu_*.py "$base/benchmarks/"  # the same harness; only the product code differs
for what in $plan; do
  case $what in
  kv-sizing) step kv-sizing 150 $new python3 -m kvroute.benchmarks.gpu_kv_sizing --checkpoints $ck --out "$outdir/gpu_kv_sizing.json" ;;
  lora) step lora 90 $new python3 -m kvroute.benchmarks.gpu_lora --checkpoints $ck --out "$outdir/gpu_lora.json" ;;
  lora-base) step lora-base 90 $base_run python3 -m kvroute.benchmarks.gpu_lora --checkpoints $ck --out "$outdir/gpu_lora_base.json" ;;
  restore) step restore 110 $new python3 -m kvroute.benchmarks gpu_engine --restore --checkpoints $ck --out "$outdir/gpu_restore.json" ;;
  profile) step profile 80 $new python3 -m kvroute.benchmarks gpu_profile --batches 1,64 --checkpoints $ck --out "$outdir/gpu_profile.json" ;;
  profile-base) step profile-base 80 $base_run python3 -m kvroute.benchmarks.gpu_profile --batches 1,64 --checkpoints $ck \
    --out "$outdir/gpu_profile_base.json" ;;
  sweep) step sweep 150 $new python3 -m kvroute.benchmarks gpu_profile --batches '' --sweep --out "$outdir/gpu_sweep.json" ;;
  cost-model)
    restore_json=()
    [ -f "$outdir/gpu_restore.json" ] && restore_json=(--restore-json "$outdir/gpu_restore.json")
    step cost-model 150 $new python3 -m kvroute.benchmarks gpu_engine --cost-model --shapes llama-3-8b,llama-3.2-1b,qwen3-0.6b \
      "${restore_json[@]}" --checkpoints $ck --out "$outdir/gpu_cost_model.json" ;;
  engine) step engine 150 $new python3 -m kvroute.benchmarks gpu_engine --hf-requests 0 --checkpoints $ck --out "$outdir/gpu_engine.json" ;;
  engine-base) step engine-base 150 $base_run python3 -m kvroute.benchmarks.gpu_engine --hf-requests 0 --checkpoints $ck \
    --out "$outdir/gpu_engine_base.json" ;;
  esac
done
echo "== done at ${SECONDS}s"
