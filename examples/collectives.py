"""A tour of torchring's collectives API, checked against the expected values.

Run it on 2 ranks of this host (shared memory):
    torchrun --standalone --nproc_per_node=2 examples/collectives.py
Force TCP between every rank (each its own host), 3 ranks:
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

    # 7. groups: a communicator over some ranks (every rank calls new_group with the same list);
    # ranks passed to a group's methods are group ranks.
    evens = torchring.new_group(range(0, world, 2))
    if evens.is_member:
        total = evens.allreduce(torch.tensor([rank]))
        assert total.item() == sum(range(0, world, 2))

    # 8. alltoall: rank r sends rows to every rank (here r + 1 rows to each); each gets its rows.
    out, received = torchring.alltoall(torch.full(((rank + 1) * world,), rank), splits=[rank + 1] * world)
    assert received.tolist() == [r + 1 for r in range(world)] and out.numel() == sum(received.tolist())

    # 9. point-to-point: pass a token around the ring (isend/irecv cannot deadlock each other).
    token = torch.zeros(1, dtype=torch.int64)
    receiving = torchring.irecv(token, (rank - 1) % world) if world > 1 else None
    if world > 1:
        torchring.isend(torch.tensor([rank]), (rank + 1) % world).wait()
        assert receiving.wait().item() == (rank - 1) % world

    torchring.barrier()
    if rank == 0:
        print(f"world {world} over {torchring.transport()}: all checks passed")
        print("weights from rank 0:", [round(w, 3) for w in weights.tolist()[:4]], "...")
        print("metrics:", metrics)
    torchring.shutdown()


if __name__ == "__main__":
    main()
