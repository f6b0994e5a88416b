"""hvd.elastic.sampler, at Horovod's module path (horovod.torch.elastic.sampler): the sampler is
torchring.elastic's, shared by torchring.elastic and hvd.elastic."""

from __future__ import annotations

from ...elastic.sampler import ElasticSampler

__all__ = ["ElasticSampler"]
