"""Shrunk sequences the conformance suite produced while it was built, kept as tests.

Each is the reproducer `hiradix check` printed for a deliberately injected bug (named in
the test); on the real implementation every one of them must pass.
"""

from __future__ import annotations

from hiradix.conformance.machine import make_machine
from hiradix.conformance.scenario import Scenario


def test_backup_of_a_node_whose_parent_has_no_host_copy() -> None:
    # Injected bug: write_backup backed up the node alone, skipping the parent check.
    state = make_machine(Scenario(page_size=2, write_policy="write_through_selective",
                                  eviction="lfu", host_layout="page_first"))()
    state.request(chunked=False, dt=0, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 1))
    state.refines_the_model()
    state.request(chunked=True, dt=0, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 1, 1, 1))
    state.refines_the_model()
    state.write_backup(index=1)
    state.refines_the_model()
    assert [n.host is not None for n in state.cache.nodes()] == [True, True]
    state.teardown()


def test_load_back_protects_its_host_source() -> None:
    # Injected bug: load_back did not protect the chain's host copies while in flight.
    state = make_machine(Scenario(page_size=2, write_policy="write_back", eviction="slru",
                                  host_layout="page_first", kv_layout="mla"))()
    state.request(chunked=False, dt=0, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 1))
    state.evict(num_tokens=1)
    state.load_back(index=0, quota=None)
    state.refines_the_model()
    assert state.cache.nodes()[0].host_ref == 1
    state.finish_copies(direction="h2d", count=1)
    state.loading_check()
    state.refines_the_model()
    assert state.cache.nodes()[0].host_ref == 0
    state.teardown()


def test_backup_source_stays_locked_until_acknowledged() -> None:
    # Injected bug: the backup's source node was not locked, so it could be evicted (and
    # its slots reused) while the copy was in flight.
    state = make_machine(Scenario(page_size=2, write_policy="write_through_selective",
                                  eviction="lfu", kv_layout="mla"))()
    state.request(chunked=False, dt=0, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 1))
    state.write_backup(index=0)
    state.refines_the_model()
    assert state.cache.evict(2) == 0  # pinned by the copy in flight
    state.refines_the_model()
    state.teardown()


def test_split_of_a_node_whose_load_is_in_flight() -> None:
    # A match that splits the node being loaded must keep the copy's bookkeeping exact.
    state = make_machine(Scenario(page_size=1, write_policy="write_through"))()
    state.request(chunked=False, dt=1, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 2, 3, 4))
    state.finish_copies(direction="d2h", count=1)
    state.writing_check()
    state.evict(num_tokens=4)
    state.load_back(index=0, quota=None)
    state.refines_the_model()
    state.request(chunked=False, dt=1, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 2, 9))  # splits the loading node at 2
    state.refines_the_model()
    assert len(state.cache.nodes()) == 3  # (1, 2) / (3, 4) / (9,)
    state.finish_copies(direction="h2d", count=1)
    state.loading_check()
    state.finish_copies(direction="d2h", count=1)  # the backup of (9,)
    state.writing_check()
    state.refines_the_model()
    assert all(n.host_ref == 0 and n.lock_ref == 0 for n in state.cache.nodes())
    state.teardown()
