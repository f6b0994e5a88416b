#!/usr/bin/env bash
# GPU verification: build the NCCL engine, run the GPU tests, run the GPU benchmarks.
# Run on a machine with a CUDA GPU, from the repository root, in an environment with a CUDA
# build of torch (pip install -e '.[test]' picks one):  bash benchmarks/gpu_suite.sh [OUTDIR]
# Everything it prints goes to OUTDIR/gpu_suite.log too; record the results in RESULTS.md.
set -uo pipefail
out=${1:-gpu-results}
mkdir -p "$out"
exec > >(tee "$out/gpu_suite.log") 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"

echo "== build"
python -m torchring.build || exit 1

echo "== GPU tests (world 1 over NCCL; worlds 2-4 share the GPU through the staged path; wrap parity)"
python -m pytest -q tests/gpu
tests=$?

echo "== allreduce: torchring NCCL vs torch.distributed NCCL, world 1"
python benchmarks/allreduce.py --device cuda --worlds 1 --sizes 4K,64K,1M,16M,64M,256M --dtypes fp32,bf16 \
  --json "$out/allreduce-cuda-w1.json"
echo "== allreduce: torchring staged path vs gloo's CUDA path, world 2 (one shared GPU)"
python benchmarks/allreduce.py --device cuda --worlds 2 --sizes 64K,1M,16M,64M --dtypes fp32 \
  --json "$out/allreduce-cuda-w2.json"
echo "== train step: torchring vs DDP (NCCL), world 1"
python benchmarks/train_step.py --device cuda --world 1 --width 2048 --batch 256 --steps 20 --rounds 5 \
  --json "$out/train-step-cuda-w1.json"
exit $tests
