# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""Resource pools: devices on nodes, planned first (`plan_placement`), then reserved (`reserve`).

Simplified vs veRL's `RayResourcePool`: veRL lets Ray choose each placement group's node; we
choose it (first fit over the nodes' total resources) and pin the group there, so the plan we
print is the placement that happens. Reserving it in Ray: `minirl.runtime.reservations`.
"""

__all__ = ["PlacementError", "ResourcePool", "plan_placement"]

from minirl.runtime.placement_checks import check_pool


class PlacementError(ValueError):
    """A placement the cluster cannot hold; the message names the pool and the numbers."""


class ResourcePool:
    """Devices on one or more nodes, for the roles placed on this pool."""

    def __init__(self, devices_per_node: list[int], device: str = "cpu",
                 cpus_per_device: float = 0.25):
        check_pool(devices_per_node, device, cpus_per_device)      # a ConfigError names a bad one
        self.devices_per_node = list(devices_per_node)
        self.device, self.cpus_per_device = device, cpus_per_device

    @property
    def size(self) -> int:
        """Devices in all: the number of workers (ranks) the pool holds."""
        return sum(self.devices_per_node)

    def bundle(self) -> dict[str, float]:
        """What one device reserves: {"CPU": c} or {"CPU": c, "GPU": 1}."""
        return {"CPU": self.cpus_per_device, **({"GPU": 1.0} if self.device == "gpu" else {})}

    def __repr__(self) -> str:
        return (f"ResourcePool({self.devices_per_node}, {self.device!r}, "
                f"cpus_per_device={self.cpus_per_device:g})")


def _fmt(resources: dict) -> str:
    return " ".join(f"{k} {v:g}" for k, v in resources.items() if k in ("CPU", "GPU"))


def plan_placement(pools: dict[str, ResourcePool], nodes: list[dict]) -> dict[str, list[int]]:
    """A node for every entry of every pool: {pool name: [node of each devices_per_node entry]}.

    nodes: each node's total resources, e.g. [{"CPU": 2.0, "GPU": 0.0}, ...] (other keys are
    ignored), in cluster order; node i is `nodes[i]`. First fit, pools in the order of `pools`
    and entries in the order of `devices_per_node`: an entry of k devices goes to the first
    node that (a) this pool does not use yet and (b) still holds k of the pool's bundles
    after everything placed before it, for every resource r of `pool.bundle()`:
    k * bundle[r] <= what is left of r on the node, with a tolerance of 1e-9 (fractional CPUs).
    The chosen node's resources shrink by k * bundle. Raises PlacementError naming the pool,
    the entry's demand and what every node has left when no node fits.
    """
    left = [{r: float(node.get(r, 0.0)) for r in ("CPU", "GPU")} for node in nodes]
    plan = {}
    for name, pool in pools.items():
        used = []
        for k, count in enumerate(pool.devices_per_node):
            need = {r: count * amount for r, amount in pool.bundle().items()}
            fits = [i for i, free in enumerate(left) if i not in used
                    and all(free[r] >= amount - 1e-9 for r, amount in need.items())]
            if not fits:
                raise PlacementError(
                    f"pool {name!r} (devices_per_node={pool.devices_per_node}) needs {count} "
                    f"device(s) = {_fmt(need)} on a node of its own for entry {k}, but no node has "
                    "that left: " + ", ".join(f"node{i} has {_fmt(free)}"
                                              + (" (used by this pool)" if i in used else "")
                                              for i, free in enumerate(left))
                    + f" ({len(nodes)} node(s) in the cluster)")
            node = fits[0]
            for r, amount in need.items():
                left[node][r] -= amount
            used.append(node)
        plan[name] = used
    return plan
