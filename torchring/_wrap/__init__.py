"""torchring.wrap: the DistributedModel (model), its Reducer and buckets, join for uneven
inputs, the memory it lives in (shared-memory tensors, the gradient pool) and SyncBatchNorm."""
