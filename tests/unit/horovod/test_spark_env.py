"""torchring.horovod.spark's rank environment without Spark: ranks by partition, local ranks among
the tasks of the same host, the store on rank 0's host and port."""

from __future__ import annotations

from torchring.horovod.spark import _rank_env


def test_rank_env_groups_local_ranks_by_host() -> None:
    peers = [{"host": "a", "port": 4000}, {"host": "b", "port": 0}, {"host": "a", "port": 0}]
    env = [_rank_env(r, peers, {"TORCHRING_TIMEOUT": "9"}) for r in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in env] == [
        ("0", "0", "2"), ("1", "0", "1"), ("2", "1", "2")]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"], e["TORCHRING_TIMEOUT"]) for e in env} == {
        ("3", "a", "4000", "9")}
