#!/usr/bin/env bash
# Fetch, here, the wheels of what comppo_jax (and the credit benchmark's rlax) needs beyond the
# device image's packages (/work/.library/device/KINDS.md lists them: jax 0.11.2, flax, optax,
# orbax, chex, transformers, torch, pytest, hypothesis are there), for Python 3.12 on x86-64.
# They land in .whl/ (gitignored); a device call carries them: carry=[".whl"].
#   bash launch/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  ml-collections==1.1.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  tensorboardX==2.6.5
  rlax==0.1.9 distrax==0.1.9 dm-env==1.6 dm-tree==0.1.10 tfp-nightly==0.26.0.dev20261027 decorator==5.3.1 gast==0.7.0
)
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
ls .whl && du -sh .whl
