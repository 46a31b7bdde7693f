# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""Placement: which pool hosts each role; three layouts (colocated, disaggregated, per-role).

Roles mapped to one pool share its workers; a placement is checked against a run's config
before any actor starts (`minirl.runtime.placement_checks`).
"""

__all__ = ["Placement", "make_placement"]

from dataclasses import dataclass

from minirl.controller.names import LAYOUTS, ROLES
from minirl.controller.resource_pool import ResourcePool
from minirl.runtime.placement_checks import check_sizes


@dataclass
class Placement:
    """A pool for every role: `roles` maps role -> pool name, `pools` pool name -> ResourcePool."""

    name: str
    pools: dict[str, ResourcePool]
    roles: dict[str, str]


def make_placement(kind: str, sizes: dict[str, list[int]] | None = None, device: str = "cpu",
                   cpus_per_device: float = 0.25) -> Placement:
    """The `kind` layout; `sizes`: {role: devices per node} (roles sharing a pool: one size)."""
    check_sizes(kind, sizes or {})      # a known layout; roles sharing a pool given one size
    layout, sizes = LAYOUTS[kind], dict(sizes or {})
    pools = {}
    for pool in dict.fromkeys(layout.values()):
        roles = [role for role in ROLES if layout[role] == pool]
        given = {role: sizes[role] for role in roles if role in sizes}
        pool_device = "cpu" if roles == ["reward"] else device
        pools[pool] = ResourcePool(next(iter(given.values()), [1]), pool_device, cpus_per_device)
    return Placement(kind, pools, dict(layout))
