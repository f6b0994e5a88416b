"""A tour of torchring's collectives API, checked against the expected values.

Run it on 2 ranks of this host (shared memory):
    torchrun --standalone --nproc_per_node=2 examples/collectives.py
Force the TCP ring, 3 ranks:
    TORCHRING_TRANSPORT=tcp torchrun --standalone --nproc_per_node=3 examples/collectives.py
"""

import torch

import torchring


def main() -> None:
    torchring.init()
    rank, world = torchring.rank(), torchring.size()

    # 1. allreduce, in place: every rank ends with the sum (or avg/min/max/product).
    grad = torch.full((4,), float(rank + 1))
    torchring.allreduce(grad)
    assert grad.tolist() == [world * (world + 1) / 2] * 4

    # 2. async: start several, do other work, then wait in any order.
    handles = [torchring.allreduce_async(torch.ones(1000) * rank, torchring.ReduceOp.MAX)
               for _ in range(3)]
    assert all(h.wait()[0].item() == world - 1 for h in handles)

    # 3. broadcast from rank 0 (e.g. initial weights) and allgather of uneven pieces.
    weights = torch.randn(8) if rank == 0 else torch.zeros(8)
    torchring.broadcast(weights, src=0)
    rows = torchring.allgather(torch.full((rank + 1, 2), rank))
    assert rows.shape == (world * (world + 1) // 2, 2)

    # 4. reduce_scatter: each rank keeps its block of the sum.
    block = torchring.reduce_scatter(torch.ones(2 * world, 3))
    assert block.shape == (2, 3) and bool((block == world).all())

    # 5. Python objects, e.g. metrics from every rank.
    metrics = torchring.allgather_object({"rank": rank, "loss": 1.0 / (rank + 1)})

    # 6. shared-memory tensors: allreduce reads them without copying them in first.
    bucket = torchring.empty(1 << 20)
    bucket.fill_(1.0)
    torchring.allreduce(bucket, torchring.ReduceOp.AVG)
    assert bool((bucket == 1.0).all())

    torchring.barrier()
    if rank == 0:
        print(f"world {world} over {torchring.transport()}: all checks passed")
        print("weights from rank 0:", [round(w, 3) for w in weights.tolist()[:4]], "...")
        print("metrics:", metrics)
    torchring.shutdown()


if __name__ == "__main__":
    main()
