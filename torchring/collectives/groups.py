"""Groups: communicators over some of the world's ranks, with every collective as a method.

    evens = torchring.new_group([0, 2])      # every rank calls it, members or not
    if evens.is_member:
        evens.allreduce(t)                   # among world ranks 0 and 2 only
        evens.send(t, dst=1)                 # dst, src: group ranks (world rank 2 here)

Each group has its own communicator (shared memory among its members on a host, TCP between
hosts) and its own order of operations: collectives of different groups may interleave
differently on different ranks. A method of a group is the module function with ``group=``
that group; ranks given to it are group ranks (``group.ranks[i]`` is group rank i's world rank).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._core import group_wiring as _groups
from . import basic as collectives, exchange, p2p, rooted
from .._core.types import Handle, ReduceOp
from .exchange import Splits

__all__ = ["Group", "new_group", "world_group"]

_SUM = ReduceOp.SUM


class Group(_groups.GroupBase):
    """A set of ranks with its own communicator; made by new_group() or world_group()."""

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = _SUM, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
        """torchring.allreduce on this group."""
        return collectives.allreduce(tensor, op, prescale_factor, postscale_factor, self)

    def allreduce_async(self, tensor: torch.Tensor, op: ReduceOp = _SUM, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Handle:
        """torchring.allreduce_async on this group."""
        return collectives.allreduce_async(tensor, op, prescale_factor, postscale_factor, self)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """torchring.broadcast on this group (`src` a group rank)."""
        return collectives.broadcast(tensor, src, self)

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Handle:
        """torchring.broadcast_async on this group (`src` a group rank)."""
        return collectives.broadcast_async(tensor, src, self)

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        """torchring.allgather on this group."""
        return collectives.allgather(tensor, self)

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        """torchring.allgather_async on this group."""
        return collectives.allgather_async(tensor, self)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp = _SUM, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0) -> torch.Tensor:
        """torchring.reduce_scatter on this group."""
        return collectives.reduce_scatter(tensor, op, prescale_factor, postscale_factor, self)

    def reduce_scatter_async(self, tensor: torch.Tensor, op: ReduceOp = _SUM,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
        """torchring.reduce_scatter_async on this group."""
        return collectives.reduce_scatter_async(tensor, op, prescale_factor, postscale_factor, self)

    def barrier(self) -> None:
        """torchring.barrier on this group."""
        collectives.barrier(self)

    def barrier_async(self) -> Handle:
        """torchring.barrier_async on this group."""
        return collectives.barrier_async(self)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """torchring.broadcast_object on this group (`src` a group rank)."""
        return collectives.broadcast_object(obj, src, self)

    def allgather_object(self, obj: Any) -> list[Any]:
        """torchring.allgather_object on this group (indexed by group rank)."""
        return collectives.allgather_object(obj, self)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: ReduceOp = _SUM) -> torch.Tensor:
        """torchring.reduce on this group (`dst` a group rank)."""
        return rooted.reduce(tensor, dst, op, self)

    def reduce_async(self, tensor: torch.Tensor, dst: int = 0, op: ReduceOp = _SUM) -> Handle:
        """torchring.reduce_async on this group (`dst` a group rank)."""
        return rooted.reduce_async(tensor, dst, op, self)

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """torchring.gather on this group (`dst` a group rank)."""
        return rooted.gather(tensor, dst, self)

    def gather_async(self, tensor: torch.Tensor, dst: int = 0) -> Handle:
        """torchring.gather_async on this group (`dst` a group rank)."""
        return rooted.gather_async(tensor, dst, self)

    def scatter(self, tensor: torch.Tensor, chunks: Sequence[torch.Tensor] | None = None,
                src: int = 0) -> torch.Tensor:
        """torchring.scatter on this group (`src` a group rank)."""
        return rooted.scatter(tensor, chunks, src, self)

    def scatter_async(self, tensor: torch.Tensor, chunks: Sequence[torch.Tensor] | None = None,
                      src: int = 0) -> Handle:
        """torchring.scatter_async on this group (`src` a group rank)."""
        return rooted.scatter_async(tensor, chunks, src, self)

    def allgather_into(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> list[torch.Tensor]:
        """torchring.allgather_into on this group."""
        return rooted.allgather_into(tensor_list, tensor, self)

    def allgather_into_async(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> Handle:
        """torchring.allgather_into_async on this group."""
        return rooted.allgather_into_async(tensor_list, tensor, self)

    def reduce_scatter_into(self, out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = _SUM,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
        """torchring.reduce_scatter_into on this group."""
        return rooted.reduce_scatter_into(out, tensor, op, prescale_factor, postscale_factor, self)

    def reduce_scatter_into_async(self, out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = _SUM,
                                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
        """torchring.reduce_scatter_into_async on this group."""
        return rooted.reduce_scatter_into_async(out, tensor, op, prescale_factor, postscale_factor, self)

    def allreduce_many(self, tensors: Sequence[torch.Tensor], op: ReduceOp = _SUM,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
        """torchring.allreduce_many on this group."""
        return rooted.allreduce_many(tensors, op, prescale_factor, postscale_factor, self)

    def allreduce_many_async(self, tensors: Sequence[torch.Tensor], op: ReduceOp = _SUM,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
        """torchring.allreduce_many_async on this group."""
        return rooted.allreduce_many_async(tensors, op, prescale_factor, postscale_factor, self)

    def alltoall(self, tensor: torch.Tensor, splits: Splits = None) -> tuple[torch.Tensor, torch.Tensor]:
        """torchring.alltoall on this group (splits[i]: rows for group rank i)."""
        return exchange.alltoall(tensor, splits, self)

    def alltoall_async(self, tensor: torch.Tensor, splits: Splits = None) -> Handle:
        """torchring.alltoall_async on this group."""
        return exchange.alltoall_async(tensor, splits, self)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: Splits = None,
                          input_splits: Splits = None) -> torch.Tensor:
        """torchring.all_to_all_single on this group."""
        return exchange.all_to_all_single(output, input, output_splits, input_splits, self)

    def all_to_all_single_async(self, output: torch.Tensor, input: torch.Tensor,
                                output_splits: Splits = None, input_splits: Splits = None) -> Handle:
        """torchring.all_to_all_single_async on this group."""
        return exchange.all_to_all_single_async(output, input, output_splits, input_splits, self)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """torchring.send on this group (`dst` a group rank)."""
        p2p.send(tensor, dst, tag, self)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """torchring.isend on this group (`dst` a group rank)."""
        return p2p.isend(tensor, dst, tag, self)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> torch.Tensor:
        """torchring.recv on this group (`src` a group rank, None: any)."""
        return p2p.recv(tensor, src, tag, self)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Handle:
        """torchring.irecv on this group (`src` a group rank, None: any)."""
        return p2p.irecv(tensor, src, tag, self)


def new_group(ranks: Sequence[int]) -> Group:
    """A group of world ranks `ranks`; every rank of the world calls it, in the same order."""
    return _groups.create(Group, ranks)


def world_group() -> Group:
    """The world as a Group (the same object until shutdown())."""
    return _groups.world(Group)
