"""Reserving a stage-6 pool's devices in Ray, and giving them back.

Hand-written (Ray plumbing; notebook 06 teaches the plan, `minirl.controller.resource_pool.
plan_placement`, which picks a node for every entry of every pool before anything starts).

- `reserve(name, pool, node_ids, timeout)`: one Ray placement group per entry of `pool`, one
  bundle (`pool.bundle()`) per device, pinned to the planned node (`node_ids[entry]`) with a
  label selector, packed on it (STRICT_PACK). It waits until Ray holds them all; otherwise it
  removes what it made and raises `PlacementError` naming the pool, its devices and the wait.
- `release(groups)`: remove placement groups (a Driver's shutdown, the notebook's demos).
"""

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from minirl.controller.resource_pool import PlacementError, ResourcePool, _fmt


def reserve(name: str, pool: ResourcePool, node_ids: list[str],
            timeout: float = 60.0) -> list[PlacementGroup]:
    """One placement group per entry of `pool`, pinned to node_ids[entry], one bundle per device.

    Waits until Ray holds them all; otherwise removes what it made and raises PlacementError.
    """
    groups = []
    try:
        for count, node_id in zip(pool.devices_per_node, node_ids, strict=True):
            pinned = [{"ray.io/node-id": node_id}] * count
            groups.append(placement_group([pool.bundle()] * count, strategy="STRICT_PACK",
                                          bundle_label_selector=pinned))
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout)
        if len(ready) < len(groups):
            raise PlacementError(f"pool {name!r}: Ray did not grant its {pool.size} device(s) "
                                 f"({_fmt(pool.bundle())} each) within {timeout:g} s; another job "
                                 "may hold them (`ray status` shows what is in use)")
    except BaseException:
        release(groups)
        raise
    return groups


def release(groups: list[PlacementGroup]) -> None:
    """Remove the placement groups: their devices are free again."""
    for group in groups:
        remove_placement_group(group)
