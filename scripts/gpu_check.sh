#!/usr/bin/env bash
# GPU check for a lent machine: install the carried wheels, run the gpu-marked tests and
# the kernel benchmark, write the results to $OUT (or the directory given as $1).
#
# The machine cannot download anything: before the device run, fetch the wheels here
# (see docs/cuda.md) into .gpu_wheels/ and name it in the run's `carry`:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels"], timeout_s=540)
# Budget: tests <= 300 s, benchmark <= 150 s (under 8 minutes with the install).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".gpu_wheels/*.whl" > /dev/null; then
    # `python -m pip`: the image's `pip` may belong to another interpreter than `python`
    python -m pip install -q --no-index --no-deps .gpu_wheels/*.whl 2>&1 | tail -3 \
        || python -m pip install -q --no-index --no-deps --break-system-packages .gpu_wheels/*.whl 2>&1 | tail -3
fi
python -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, torch.cuda.get_device_name())" \
    | tee "$DEST/env.txt"
python -c "import importlib.util as u; print('nvcomp', bool(u.find_spec('nvidia.nvcomp')), 'zstandard', bool(u.find_spec('zstandard')))" \
    | tee -a "$DEST/env.txt"

timeout 280 python -m pytest -q -p no:cacheprovider -m gpu tests/cuda/test_cuda_parity.py tests/cuda/test_cuda_feedback.py \
    --durations=15 --junitxml="$DEST/gpu_tests.xml" > "$DEST/gpu_tests.log" 2>&1
tests_rc=$?
tail -25 "$DEST/gpu_tests.log"

timeout 150 python benchmarks/cuda_kernels.py --out "$DEST" > "$DEST/bench.log" 2>&1
bench_rc=$?
tail -5 "$DEST/bench.log"
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
