#!/usr/bin/env bash
# benchmarks/gpu/make_nvvm_carry.sh: builds .gpu_check/nvvm-13.0.88-cuda13.tar.gz (28.9 MB): libnvvm.so.4 + libdevice.10.bc of CUDA
# 13.0 laid out as $CUDA_HOME/nvvm/{lib64,libdevice}, for a GPU machine without network whose
# numba-cuda has no NVVM. 13.0 on purpose: NVVM of a newer 13.x emits PTX that driver 580
# (CUDA 13.0) cannot load. Run on a machine with PyPI access, from the repository root.
set -euo pipefail
d=$(mktemp -d)
python3 -m pip download --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 -d "$d" "nvidia-nvvm==13.0.88"
mkdir -p "$d/cuda13/nvvm/lib64" "$d/cuda13/nvvm/libdevice" .gpu_check
python3 - "$d" <<'PY'
import glob, shutil, sys, zipfile
d = sys.argv[1]
z = zipfile.ZipFile(glob.glob(f"{d}/nvidia_nvvm-13.0.88-*.whl")[0])
for src, dst in [("nvidia/cu13/lib/libnvvm.so.4", "cuda13/nvvm/lib64/libnvvm.so.4"),
                 ("nvidia/cu13/nvvm/libdevice/libdevice.10.bc", "cuda13/nvvm/libdevice/libdevice.10.bc"),
                 ("nvidia_nvvm-13.0.88.dist-info/licenses/License.txt", "cuda13/nvvm/License.txt")]:
    with z.open(src) as f, open(f"{d}/{dst}", "wb") as g:
        shutil.copyfileobj(f, g)
PY
ln -sf libnvvm.so.4 "$d/cuda13/nvvm/lib64/libnvvm.so"
tar -C "$d" -czf .gpu_check/nvvm-13.0.88-cuda13.tar.gz cuda13
rm -rf "$d"
ls -la .gpu_check/nvvm-13.0.88-cuda13.tar.gz
