#!/usr/bin/env bash
# GPU validation: the device kernels' tests, then every benchmark at its GPU sizes, on one H100/H200,
# in the order they matter, inside a time budget sized for one device call.
#
# Here, once:  bash launch/gpu_wheels.sh          (what the device image lacks, into .whl/)
# There (the device tool's run, carry=[".whl"], timeout_s=600):
#   bash launch/gpu_validation.sh                  (every step but profile, within BUDGET_S=540)
# and, on the machine still warm, the steps the summary marks timed out or skipped:
#   BUDGET_S=150 bash launch/gpu_validation.sh sampler lora
# Steps, in their default order: env gpu_tests kernel credit step sampler lora staleness tests
# (and profile, only when named). Each runs under its cap (CAPS below; CAP_<step>=S overrides)
# and never past the budget; a step that times out or fails does not stop the next, one that
# would start with under MIN_STEP_S=20 s left is skipped. Output: $OUT/validation.log (runs/
# gpu_validation without $OUT), the pytest results in $OUT/<step>.xml, one line per step in
# $OUT/summary.txt. Compiled programs persist in JAX's cache (/tmp/comppo_jax_cache) for a rerun on
# the same machine. `profile` writes a jax.profiler trace of the concentration kernel at L = 16K
# to $OUT/kernel_trace.tar.gz (for when the kernel misses its 1.25x goal).
# SMOKE=1 runs every step at small sizes on whatever backend JAX has (this script's own check on
# a CPU; caps of 600 s, a budget of 3600 s); PYTHON picks the interpreter (default python3, the
# device's JAX one).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu_validation}
py=${PYTHON:-python3}
STEPS=(env gpu_tests kernel credit step sampler lora staleness tests profile)
# From the first H200 run (seconds taken): env 5, gpu_tests 59, kernel 33, credit 30, step 171; sampler
# failed at 59, lora printed nothing in 150, staleness needs two runs of about 90.
declare -A CAPS=(
  [env]=30 [gpu_tests]=120 [kernel]=60 [credit]=45 [step]=240 [sampler]=120 [lora]=150 [staleness]=200
  [tests]=180 [profile]=60
)

budget=${BUDGET_S:-540}
if [ -n "${SMOKE:-}" ]; then  # a check of this script, not of speed: a slow CPU gets 10 minutes a step
  for step in "${!CAPS[@]}"; do CAPS[$step]=600; done
  budget=${BUDGET_S:-3600}
  kernel_args=(--length=256) credit_sizes=("--batch=4 --length=256") step_model=tiny lora_args=(--repeats=1 --shapes=tiny)
  sampler_args=(--batch=2 --length=64 --tables=plain,long_tailed --repeats=1) profile_length=256
  staleness_args=() pytest_workers=0  # a check of the script: one pytest process (its gpu tests skip on a CPU)
else
  kernel_args=() credit_sizes=("--batch=16 --length=16384" "--batch=256 --length=4096") step_model=qwen3_0.6b
  sampler_args=(--batch=16 --length=8192 --tables=long_tailed,uniform,plain) profile_length=16384
  lora_args=(--model=qwen3_0.6b) staleness_args=(--batch=16 --length=256 --repeats=6) pytest_workers=4
fi

env_step() {
  nvidia-smi || echo "no nvidia-smi"
  "$py" -c "import sys, jax, jaxlib, flax, optax; print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
}

pytest_step() {  # pytest_step NAME MARK: the kernel, attention and sampler tests, fp32 matmuls at full precision
  # (XLA on a GPU takes fp32 dots as TF32 by default), so the fp32 tolerances are the CPU ones
  JAX_DEFAULT_MATMUL_PRECISION=highest "$py" -m pytest -p no:cacheprovider -p no:benchmark -n "$pytest_workers" -m "$2" --junitxml="$out/$1.xml" \
    tests/pallas_kernels tests/models/test_attention.py tests/rollout/test_engine.py tests/rollout/test_sampler.py \
    tests/rollout/test_quantized_rollout.py
}

gpu_tests_step() { pytest_step gpu_tests gpu; }
tests_step() { pytest_step tests "not gpu"; }

kernel_step() {
  for batch in 1 4; do "$py" launch/benchmark.py kernel --batch=$batch "${kernel_args[@]}" || return; done
}

credit_step() {
  for size in "${credit_sizes[@]}"; do "$py" launch/benchmark.py credit $size || return; done
}

step_step() { "$py" launch/benchmark.py step --model=$step_model; }

sampler_step() { "$py" launch/benchmark.py sampler "${sampler_args[@]}"; }
lora_step() { "$py" launch/benchmark.py lora "${lora_args[@]}"; }
staleness_step() { "$py" launch/benchmark.py staleness "${staleness_args[@]}"; }

profile_step() {
  local trace=/tmp/comppo_kernel_trace
  rm -rf "$trace"
  "$py" - "$trace" "$profile_length" <<'PY' || return
import sys

import jax

sys.path.insert(0, "launch")
from benchmarks.kernel import _inputs
from comppo_jax.models import preset_model_config
from pallas_kernels import attention_with_concentration

trace, length = sys.argv[1], int(sys.argv[2])
q, k, v, mask, _, window_start = _inputs(1, length, preset_model_config("qwen3_4b"))
kernel = jax.jit(attention_with_concentration)
jax.block_until_ready(kernel(q, k, v, mask, window_start))
with jax.profiler.trace(trace):
    for _ in range(3):
        jax.block_until_ready(kernel(q, k, v, mask, window_start))
print("trace written to", trace)
PY
  tar -czf "$out/kernel_trace.tar.gz" -C "$trace" .
}

if [ "${1:-}" = _step ]; then  # one step, in the process group `timeout` stops at the step's limit
  "${2}_step"
  exit
fi

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=("${STEPS[@]:0:${#STEPS[@]}-1}")
for step in "${steps[@]}"; do
  [ -n "${CAPS[$step]:-}" ] || { echo "unknown step $step; expected one of ${STEPS[*]}" >&2; exit 2; }
done

mkdir -p "$out"
deadline=$((SECONDS + budget))
if [ -d .whl ] && [ -z "${SMOKE:-}" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/comppo_site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/comppo_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # pytest workers and benchmarks share the one GPU
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/comppo_jax_cache}

unfinished=()
for step in "${steps[@]}"; do
  cap_override=CAP_$step
  cap=${!cap_override:-${CAPS[$step]}} left=$((deadline - SECONDS))
  limit=$((cap < left ? cap : left))
  if [ "$left" -lt "${MIN_STEP_S:-20}" ]; then
    echo "$step: skipped, $left s of the budget left" | tee -a "$out/summary.txt"
    unfinished+=("$step")
    continue
  fi
  echo "=== $step (limit $limit s)" | tee -a "$out/validation.log"
  start=$SECONDS
  timeout -k 10 "$limit" bash "$0" _step "$step" 2>&1 | tee -a "$out/validation.log"
  status=${PIPESTATUS[0]} elapsed=$((SECONDS - start))
  # timeout's 124 (TERM) or 137 (KILL, 10 s later), not a step that was killed on its own (say, out of memory)
  if { [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; } && [ "$elapsed" -ge "$limit" ]; then
    echo "$step: timed out after $elapsed s (limit $limit s)" | tee -a "$out/summary.txt"
    unfinished+=("$step")
  else
    echo "$step: exit $status in $elapsed s" | tee -a "$out/summary.txt"
  fi
done
[ ${#unfinished[@]} -eq 0 ] || echo "not finished: ${unfinished[*]}; rerun them: bash launch/gpu_validation.sh ${unfinished[*]}" | tee -a "$out/summary.txt"
! grep -qv ": exit 0 in" "$out/summary.txt"
