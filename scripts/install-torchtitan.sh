#!/usr/bin/env bash
# Install torchtitan 0.3.0 for gradwire's torchtitan adapter tests on a CPU machine, leaving torch as it is.
#
# torchtitan's declared dependencies pull `datasets` (and with it an older huggingface_hub than
# transformers 5 ships with); its model code needs none of that, but imports triton, which only
# CUDA builds of torch bring. So: torchtitan and spmd_types without dependencies, then tyro and
# triton (about 20 s from PyPI; triton is a ~290 MB wheel). Idempotent.
set -euo pipefail
PY=${PYTHON:-python3}
if "$PY" -c 'import torchtitan, spmd_types, tyro, triton' 2>/dev/null; then
  echo "install-torchtitan: already installed"
  exit 0
fi
"$PY" -m pip install --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
"$PY" -m pip install -c <("$PY" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])') tyro triton
