"""How failure messages name an unreachable rendezvous store (_rendezvous.store_where)."""

from __future__ import annotations

from torchring._core import rendezvous as _rendezvous


def _info(host: str, addr: str) -> dict:
    return {"host": host, "addr": addr}


def test_names_the_store_host_and_the_ranks_there() -> None:
    infos = [_info("trh0", "198.18.3.1"), _info("trh1", "198.18.3.2"), _info("trh0", "198.18.3.1")]
    where = _rendezvous.store_where("198.18.3.1", infos)
    assert where == "the rendezvous store on trh0 (198.18.3.1, where ranks 0, 2 run)"


def test_one_rank_there() -> None:
    infos = [_info("a", "198.18.3.2"), _info("b", "198.18.3.1")]
    assert _rendezvous.store_where("198.18.3.1", infos) == "the rendezvous store on b (198.18.3.1, where rank 1 runs)"


def test_no_rank_on_the_store_host_names_its_address() -> None:
    infos = [_info("a", "198.18.3.2"), _info("b", "198.18.3.3")]
    assert _rendezvous.store_where("198.18.3.9", infos) == "the rendezvous store on 198.18.3.9"
