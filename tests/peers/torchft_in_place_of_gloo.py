"""pytest plugin of run_torchft_suite.py: torchft's ProcessGroupGloo is torchring's process group.

Loaded with ``-p torchft_in_place_of_gloo`` before pytest imports torchft's test files, it
rebinds the name ``ProcessGroupGloo`` in torchft's package and its process_group module to
torchring.elastic.torchft.ProcessGroupTorchring, so every test file's
``from torchft.process_group import ProcessGroupGloo`` (and ``torchft.ProcessGroupGloo``) gets
torchring's group and the test bodies run unchanged. At the end it prints how many torchring
groups the session formed, by world size: proof that the tests ran on torchring.
"""

from __future__ import annotations

import collections

import torchft
import torchft.process_group as _process_group

from torchring.elastic.torchft import ProcessGroupTorchring

_formed: collections.Counter = collections.Counter()


class _Counted(ProcessGroupTorchring):
    """ProcessGroupTorchring that counts the groups it forms."""

    def _create_pg(self, store, rank, world_size):  # noqa: ANN001, ANN202 - torchft's signature
        pg = super()._create_pg(store, rank, world_size)
        _formed[world_size] += 1
        return pg


_Counted.__name__ = _Counted.__qualname__ = "ProcessGroupTorchring"
_process_group.ProcessGroupGloo = _Counted
torchft.ProcessGroupGloo = _Counted


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001 - pytest's hook
    """Prints the groups formed on torchring, by world size."""
    print(f"\ntorchring process groups formed, by world size: {dict(sorted(_formed.items()))}")
