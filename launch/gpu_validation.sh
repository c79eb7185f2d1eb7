#!/usr/bin/env bash
# GPU validation: the device kernels' tests, then every benchmark at its GPU sizes, on one H100/H200.
#
# Here, once:  bash launch/gpu_wheels.sh          (what the device image lacks, into .whl/)
# There (the device tool's run, carry=[".whl"], each call under its 10-minute limit):
#   bash launch/gpu_validation.sh tests kernel credit
#   bash launch/gpu_validation.sh step sampler
# Steps: env tests kernel credit step sampler profile (default: all but profile). Their output
# goes to $OUT/validation.log (runs/gpu_validation without $OUT), the pytest results also to
# $OUT/tests.xml, one line per step (exit status, seconds) to $OUT/summary.txt; a failing step
# does not stop the next. `profile` writes a jax.profiler trace of the concentration kernel at
# L = 16K to $OUT/kernel_trace.tar.gz (for when the kernel misses its 1.25x goal).
# SMOKE=1 runs every step at small sizes on whatever backend JAX has (this script's own check on
# a CPU); PYTHON picks the interpreter (default python3, the device's JAX one).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu_validation}
py=${PYTHON:-python3}
mkdir -p "$out"

if [ -d .whl ] && [ -z "${SMOKE:-}" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/comppo_site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/comppo_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # pytest workers and benchmarks share the one GPU

if [ -n "${SMOKE:-}" ]; then
  kernel_args=(--length=256) credit_sizes=("--batch=4 --length=256") step_models=(tiny)
  sampler_args=(--batch=2 --length=64 --tables=plain,long_tailed --repeats=1) profile_length=256
else
  kernel_args=() credit_sizes=("--batch=16 --length=16384" "--batch=256 --length=4096") step_models=(qwen3_0.6b tiny)
  sampler_args=(--batch=16 --length=4096 --tables=plain,uniform,long_tailed) profile_length=16384
fi

run_step() {  # run_step NAME COMMAND...: COMMAND's output to validation.log, its status to summary.txt
  local name=$1 start=$SECONDS status
  shift
  echo "=== $name: $*" | tee -a "$out/validation.log"
  "$@" 2>&1 | tee -a "$out/validation.log"
  status=${PIPESTATUS[0]}
  echo "$name: exit $status in $((SECONDS - start)) s: $*" | tee -a "$out/summary.txt"
}

env_step() {
  nvidia-smi || echo "no nvidia-smi"
  "$py" -c "import sys, jax, jaxlib, flax, optax; print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
}

tests_step() {
  # Matmuls at full fp32 precision, so the fp32 tolerances are the CPU ones (XLA on a GPU takes
  # fp32 dots as TF32 by default).
  JAX_DEFAULT_MATMUL_PRECISION=highest "$py" -m pytest -p no:cacheprovider -n 4 --junitxml="$out/tests.xml" \
    tests/pallas_kernels tests/models/test_attention.py tests/rollout/test_engine.py tests/rollout/test_sampler.py
}

kernel_step() {
  for batch in 1 4; do "$py" launch/benchmark.py kernel --batch=$batch "${kernel_args[@]}" || return; done
}

credit_step() {
  for size in "${credit_sizes[@]}"; do "$py" launch/benchmark.py credit $size || return; done
}

step_step() {
  for model in "${step_models[@]}"; do "$py" launch/benchmark.py step --model=$model || return; done
}

sampler_step() {
  "$py" launch/benchmark.py sampler "${sampler_args[@]}"
}

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

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env tests kernel credit step sampler)
for step in "${steps[@]}"; do
  case $step in
    env|tests|kernel|credit|step|sampler|profile) run_step "$step" "${step}_step" ;;
    *) echo "unknown step $step; expected env tests kernel credit step sampler profile" >&2; exit 2 ;;
  esac
done
cat "$out/summary.txt"
! grep -qv ": exit 0 in" "$out/summary.txt"
