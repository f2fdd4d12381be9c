#!/usr/bin/env bash
# Build and install Horovod 0.28.1 against the installed PyTorch, with Gloo and MPI.
#
# Horovod's last release compiles its torch extension as C++14, which PyTorch >= 2.1 rejects
# (horovod issues #3996, #4014; the fix, PR #3998, was never released). This script builds
# the PyPI sdist with the C++ standard raised to 17 and CMake's minimum-policy setting for
# new CMake, caches the wheel, and is idempotent: a second run only reinstalls the cache.
set -euo pipefail
VERSION=0.28.1
CACHE=${GRADWIRE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gradwire/wheels}
PY=${PYTHON:-python3}
TORCH=$("$PY" -c 'import torch; print(torch.__version__)')
CACHE="$CACHE/torch-$TORCH"  # the extension is built against this exact torch
mkdir -p "$CACHE"

if "$PY" -c 'import horovod.torch' 2>/dev/null && [ "$("$PY" -c 'import horovod; print(horovod.__version__)')" = "$VERSION" ] \
   && [ -e "$CACHE/.installed-for-this-torch" ]; then
  echo "install-horovod: horovod $VERSION already installed"
  exit 0
fi

wheel=$(ls "$CACHE"/horovod-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  "$PY" -m pip install -q cmake packaging cloudpickle psutil pyyaml wheel
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$VERSION" -d "$work"
  tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
  src="$work/horovod-$VERSION"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
         HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
         CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)"
  "$PY" -m pip wheel -q --no-deps --no-build-isolation "$src" -w "$CACHE"
  wheel=$(ls "$CACHE"/horovod-"$VERSION"-*.whl | head -n 1)
fi
"$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging
touch "$CACHE/.installed-for-this-torch"
"$PY" -c 'import horovod.torch as hvd; print("install-horovod: horovod", hvd.__version__ if hasattr(hvd, "__version__") else "", "gloo", hvd.gloo_built(), "mpi", hvd.mpi_built())'
