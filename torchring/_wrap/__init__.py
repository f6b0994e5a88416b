"""torchring.wrap: the DistributedModel (model), its Reducer and buckets, the hooks that drive a
Reducer from autograd (hooks, also used by hvd.DistributedOptimizer), join for uneven inputs, the
memory it lives in (shared-memory tensors, the gradient pool) and SyncBatchNorm."""
