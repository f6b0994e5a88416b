"""A small training loop with one seeded fault on rank 1 (tests/spawned/trace):

    python _trace_job.py MODE OUT_DIR

MODE: ok (no fault), skip (rank 1 skips the broadcast of step 3), shape (rank 1 allreduces
another shape in step 3), sleep (rank 1 sleeps 20 s in step 3), lock (rank 1 blocks on a lock
forever in step 3), c10d (the loop through torch.distributed on the torchring backend, with a
send/recv pair, then every rank dumps). Each rank writes its pid to OUT_DIR/pid<rank>. The
lines the diagnosis must name carry a "# line:" marker for the tests to find.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
import torchring


def main(mode: str, out_dir: str) -> None:
    """Runs the loop of MODE (see the module's docstring)."""
    if mode == "c10d":
        return c10d(out_dir)
    torchring.init()
    rank = torchring.rank()
    with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    t = torch.ones(256)
    for step in range(6):
        torchring.allreduce(t)  # line: allreduce
        if step == 3 and rank == 1 and mode != "ok":
            if mode == "skip":
                continue
            if mode == "shape":
                torchring.allreduce(torch.ones(3))  # line: shape
                continue
            if mode == "sleep":
                time.sleep(20)  # line: sleep
            if mode == "lock":
                lock = threading.Lock()
                lock.acquire()
                lock.acquire()  # line: lock
        torchring.broadcast(t, 0)  # line: broadcast
    torchring.shutdown()


def c10d(out_dir: str) -> None:
    """The loop on torch.distributed's torchring backend; each rank dumps at the end."""
    import torch.distributed as dist  # here: only this mode uses the process group

    dist.init_process_group("torchring")
    rank = dist.get_rank()
    t = torch.ones(64)
    for _ in range(3):
        dist.all_reduce(t)  # line: c10d all_reduce
    if rank == 0:
        dist.send(t, 1)  # line: c10d send
    elif rank == 1:
        dist.recv(t, 0)  # line: c10d recv
    dist.barrier()
    with open(os.path.join(out_dir, f"dump{rank}"), "w") as f:
        f.write(str(torchring.dump_trace()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
