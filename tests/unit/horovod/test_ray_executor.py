"""RayExecutor's decisions without Ray: which arguments it takes, the placement group it asks for,
and the rank environment it gives each actor (ranks node by node, the store on rank 0's node)."""

from __future__ import annotations

import pytest

from torchring.horovod.ray import RayExecutor


def test_settings_keep_horovods_fields() -> None:
    s = RayExecutor.create_settings(timeout_s=7, placement_group_timeout_s=9, ssh_str="unused")
    assert (s.timeout_s, s.placement_group_timeout_s, s.ssh_str) == (7, 9, "unused")


@pytest.mark.parametrize("kwargs", [{}, {"num_workers": 2, "num_hosts": 1}])
def test_either_workers_or_hosts(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="either num_workers, or num_hosts"):
        RayExecutor(**kwargs)


def test_elastic_mode_is_refused_by_name() -> None:
    with pytest.raises(NotImplementedError, match="max_workers, min_workers.*torchring-run"):
        RayExecutor(num_workers=2, min_workers=1, max_workers=4)
    with pytest.raises(TypeError, match="unexpected arguments \\['num_gpus'\\]"):
        RayExecutor(num_workers=2, num_gpus=1)


def test_bundles_packed_per_worker_or_spread_per_host() -> None:
    assert RayExecutor(num_workers=3, cpus_per_worker=2)._bundles() == ([{"CPU": 2.0}] * 3, "PACK")
    ex = RayExecutor(num_hosts=2, num_workers_per_host=4, use_gpu=True)
    assert ex.num_workers == 8
    assert ex._bundles() == ([{"CPU": 4.0, "GPU": 4.0}] * 2, "STRICT_SPREAD")


def test_environments_number_ranks_node_by_node() -> None:
    ex = RayExecutor(num_workers=4, settings=RayExecutor.create_settings(timeout_s=12))
    where = [("a", "10.0.0.1"), ("a", "10.0.0.1"), ("b", "10.0.0.2"), ("b", "10.0.0.2")]
    env = ex._environments(where, 29400, {"DATA_DIR": "/x"})
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in env] == [
        ("0", "0", "2"), ("1", "1", "2"), ("2", "0", "2"), ("3", "1", "2")]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"], e["DATA_DIR"]) for e in env} == {
        ("4", "10.0.0.1", "29400", "/x")}


def test_calls_before_start_say_so() -> None:
    with pytest.raises(RuntimeError, match="call start\\(\\) first"):
        RayExecutor(num_workers=1).run(print)
