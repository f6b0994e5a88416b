"""``torchring.memory``: shared-memory tensors and the gradient pool's statistics (they live in
torchring._wrap.memory, beside the wrapper that uses them)."""

from ._wrap.memory import empty, grad_pool_stats

__all__ = ["empty", "grad_pool_stats"]
