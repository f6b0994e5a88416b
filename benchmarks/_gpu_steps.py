"""The steps of benchmarks/gpu_suite.py, the most valuable first.

Each step is a command after `python3` run from the repository root ("{work}" stands for the
folder of the run's files), its time limit, the least time worth starting it with, and for
--dry-run the form that checks it on a CPU machine: `parse` (the same command with
TORCHRING_BENCH_PARSE_ONLY=1 unless given) and `dry` (a CI-sized run, for the steps that need no
GPU). The CPU steps hide the GPU (CUDA_VISIBLE_DEVICES=''), so sixteen ranks do not each open a
CUDA context, and run DeepSpeed's CPU build of its shared-memory op (DS_ACCELERATOR=cpu).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "TORCHRING_CUDA_PATH": "off", "DS_ACCELERATOR": "cpu"}
CPU_SIZES = "4K,64K,1M,16M,64M,256M"
DRY_CPU = ("--worlds", "2", "--sizes", "4K,1M,16M", "--trials", "2", "--trial-s", "0.02")


@dataclass(frozen=True)
class Step:
    """One command of the suite and how to check it without a GPU."""

    name: str
    what: str
    args: tuple[str, ...]
    limit_s: float
    min_s: float
    dry: tuple[str, ...] | None = None
    parse: tuple[str, ...] | None = None
    fallback: tuple[str, ...] | None = None
    fallback_why: str = ""
    env: dict[str, str] = field(default_factory=dict)
    beside: tuple[str, ...] | None = None  # started with the step, waited for at its end
    required: bool = False  # if it fails, the steps after it would only fail again: the run stops

    def _argv(self, args: tuple[str, ...], work: object) -> list[str]:
        return [sys.executable, *(a.replace("{work}", str(work)) for a in args)]

    def argv(self, work: object) -> list[str]:
        """The command on the GPU machine."""
        return self._argv(self.args, work)

    def parse_argv(self, work: object) -> list[str]:
        """The command --dry-run checks for its imports and arguments."""
        return self._argv(self.parse or self.args, work)

    def dry_argv(self, work: object) -> list[str]:
        """The CI-sized run of a step that needs no GPU."""
        assert self.dry is not None
        return self._argv(self.dry, work)

    def beside_argv(self, work: object) -> list[str]:
        """The command that runs alongside this one (on cores it leaves idle)."""
        assert self.beside is not None
        return self._argv(self.beside, work)

    def fallback_argv(self, work: object) -> list[str]:
        """The command once more, without what made it fail (a peer)."""
        assert self.fallback is not None
        return self._argv(self.fallback, work)


def _parallel() -> tuple[str, ...]:
    """pytest-xdist's four workers where it is installed (the GPU tests spend most of their time
    starting ranks and CUDA contexts, which overlap well on sixteen cores), and pytest-timeout's
    limit per test where that is, so one hung test costs 80 s, not the whole step."""
    found = importlib.util.find_spec
    return (("-n", "4") if found("xdist") else ()) + (("--timeout", "80") if found("pytest_timeout") else ())


def _cpu_allreduce(world: int, limit_s: float, min_s: float, dry: bool = False) -> Step:
    """torchring (plain and torchring.empty tensors) vs gloo, Open MPI and DeepSpeed at `world` ranks."""
    base = ("benchmarks/allreduce.py", "--worlds", str(world), "--sizes", CPU_SIZES, "--dtypes", "fp32,bf16",
            "--trials", "3", "--trial-s", "0.05", "--json", f"{{work}}/allreduce-cpu-w{world}.json")
    return Step(
        f"cpu-w{world}", f"CPU allreduce, {world} ranks on the many-core host: torchring vs gloo, Open MPI, DeepSpeed",
        base, limit_s, min_s, env=CPU_ONLY,
        dry=("benchmarks/allreduce.py", *DRY_CPU, "--json", "{work}/allreduce-cpu-dry.json") if dry else None,
        fallback=(*base, "--libs", "torchring,torchring-shm,gloo"), fallback_why="Open MPI or DeepSpeed failed")


# DeepSpeed compiles its shared-memory op on first use: alongside the engine's build, whose
# longest source keeps most cores idle at the end, instead of inside the first timed world.
DEEPSPEED_OP = ("-c", "import os; os.environ['DS_ACCELERATOR'] = 'cpu'\n"
                      "try:\n    import deepspeed\n"
                      "except ImportError as e:\n    raise SystemExit(f'no DeepSpeed: {e}')\n"
                      "from deepspeed.ops.op_builder import ShareMemCommBuilder; ShareMemCommBuilder().load()\n"
                      "print('DeepSpeed', deepspeed.__version__, 'shared-memory op built')")

TESTS = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--durations=15", "tests/gpu")

STEPS: list[Step] = [
    Step("machine", "GPU, driver, CUDA, NCCL, CPU model, copy bandwidths",
         ("benchmarks/gpu_machine.py", "--json", "{work}/machine.json"), 90, 10,
         dry=("benchmarks/gpu_machine.py", "--json", "{work}/machine.json")),
    # The build's check without a GPU: the sources the NCCL build changes compiled against
    # CUDA's and NCCL's headers (cuda_syntax.py); its dry form builds the CPU engine.
    Step("build", "the engine with the NCCL path, every core",
         ("-m", "torchring.build"), 300, 60, parse=("benchmarks/cuda_syntax.py",), dry=("-m", "torchring.build"),
         beside=DEEPSPEED_OP, required=True),
    Step("tests", "tests/gpu: NCCL at world 1 (and shrunk), staged at worlds 2-4, wrap, horovod, c10d, failures",
         (*TESTS, *_parallel(), "--junitxml", "{work}/gpu-tests.xml"), 150, 60,
         parse=("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu")),
    Step("nccl-allreduce", "torchring's NCCL allreduce vs torch.distributed NCCL, world 1, 4 KiB-256 MiB",
         ("benchmarks/allreduce.py", "--device", "cuda", "--worlds", "1", "--sizes", "4K,64K,1M,16M,64M,256M",
          "--dtypes", "fp32,bf16", "--trials", "5", "--trial-s", "0.05", "--json", "{work}/allreduce-nccl-w1.json"),
         90, 20),
    Step("train-step", "a wrap training step vs the plain single-GPU step and DDP-NCCL, world 1",
         ("benchmarks/train_step.py", "--device", "cuda", "--world", "1", "--width", "2048", "--batch", "256",
          "--steps", "10", "--warmup", "2", "--rounds", "5", "--json", "{work}/train-step-cuda-w1.json"), 90, 25),
    _cpu_allreduce(16, 130, 40, dry=True),
    _cpu_allreduce(8, 90, 30),
    Step("data", "a data-bound training loop: torchring.data.DataLoader's defaults vs torch's, GPU busy fraction",
         ("benchmarks/dataloader.py", "--train", "--device", "cuda", "--items", "6144", "--json",
          "{work}/dataloader-cuda.json"), 80, 30,
         dry=("benchmarks/dataloader.py", "--train", "--device", "cpu", "--items", "256", "--rounds", "1",
              "--json", "{work}/dataloader-dry.json")),
    Step("ddp-w8", "the DDP step on the torchring backend vs gloo, world 8 on the CPU",
         ("benchmarks/ddp_backend.py", "--world", "8", "--only", "step", "--steps", "3", "--warmup", "1",
          "--rounds", "3", "--json", "{work}/ddp-cpu-w8.json"), 100, 40, env=CPU_ONLY,
         dry=("benchmarks/ddp_backend.py", "--world", "2", "--only", "step", "--width", "256", "--steps", "1",
              "--warmup", "1", "--rounds", "1", "--json", "{work}/ddp-dry.json")),
    _cpu_allreduce(4, 70, 25),
    _cpu_allreduce(2, 60, 20),
    Step("staged-w2", "torchring's staged path vs gloo's CUDA path, 2 ranks sharing the GPU",
         ("benchmarks/allreduce.py", "--device", "cuda", "--worlds", "2", "--sizes", "64K,1M,16M,64M",
          "--dtypes", "fp32", "--trials", "3", "--trial-s", "0.05", "--json", "{work}/allreduce-staged-w2.json"),
         60, 20),
    # Issue #27's 16-host check where 16 ranks and the latency router have 16 cores, not 2 (on the
    # 2-core machine the 16-host rows are CPU-bound); needs network namespaces, tc and a compiler
    # on the machine, and fails at once, saying so, where it has none.
    Step("scaleout-16", "16 test hosts on 16 cores, D = 1 ms, 200 Mbit/s: rows for scale_model.py --validate",
         ("benchmarks/scaleout.py", "--hosts", "16", "--sizes", "8,8K,64K,1M", "--rate", "200mbit",
          "--latency-us", "1000", "--trials", "3", "--no-mpi", "--json", "{work}/scaleout-16.json"),
         200, 90, env=CPU_ONLY),
]
