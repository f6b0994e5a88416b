"""Registers torch.distributed's "torchring" backend name at ``import torch``, before any code
imports torchring: torch calls every ``torch.backends`` entry point at the end of its import
(pyproject.toml names ``register`` here). A cluster engine that makes the process group in each
worker before the user's function runs (Ray Train's ``TorchConfig(backend="torchring")``, Spark's
TorchDistributor) then finds the name.

It lives outside the torchring package so that importing it imports nothing of torchring's: it
only registers the name, with a creator that imports torchring when the first group is made. It
builds nothing, and it can never break ``import torch`` (torch turns an entry point's exception
into a RuntimeError that ends the import): every error is caught and logged at debug level on the
"torchring" logger, and ``import torchring`` then registers the name as it always did.
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch's switch) turns every such entry point off.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["register"]

NAME = "torchring"


def _create(*args: Any, **kwargs: Any) -> Any:
    """torch's creator callback: torchring's own (torchring/c10d.py), imported now."""
    from torchring import c10d

    return c10d._create(*args, **kwargs)


def register() -> None:
    """Registers the backend name if torch.distributed is available (never raises)."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or NAME in dist.Backend.backend_list:
            return
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    except Exception as e:  # noqa: BLE001 - import torch must go on whatever happened here
        logging.getLogger("torchring").debug("torchring: could not register the backend name at import torch: %r", e)
