"""The "torchring" backend name is known at `import torch`, before any code imports torchring
(torchring_autoload, a torch.backends entry point): registering imports nothing of torchring,
and an error in it never breaks `import torch`."""

from __future__ import annotations

import os
import subprocess
import sys


def _python(code: str, **env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def test_import_torch_registers_the_name_without_importing_torchring() -> None:
    out = _python("import sys, torch.distributed as dist; "
                  "print('torchring' in dist.Backend.backend_list, 'torchring' in sys.modules)")
    assert out == "True False"


def test_torchs_switch_turns_it_off() -> None:
    out = _python("import torch.distributed as dist; print('torchring' in dist.Backend.backend_list)",
                  TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert out == "False"


def test_an_error_while_registering_is_logged_not_raised() -> None:
    code = ("import logging, torch.distributed as dist, torchring_autoload\n"
            "logging.basicConfig(level=logging.DEBUG, format='%(message)s')\n"
            "def boom(*a, **k): raise RuntimeError('registry broken')\n"
            "dist.Backend.register_backend = boom\n"
            "torchring_autoload.register()\n"
            "print('still here', 'torchring' in dist.Backend.backend_list)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert proc.returncode == 0 and proc.stdout.strip() == "still here False", proc.stdout + proc.stderr
    assert "could not register the backend name at import torch: RuntimeError('registry broken')" in proc.stderr
