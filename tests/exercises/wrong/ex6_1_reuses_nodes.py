"""Exercise 6.1, wrong: a pool's entries may land on the same node (a "two-node" pool on one machine)."""

from minirl.controller.resource_pool import PlacementError

EXERCISE = "6.1"


def plan_placement(pools, nodes):
    left = [{r: float(n.get(r, 0.0)) for r in ("CPU", "GPU")} for n in nodes]
    plan = {}
    for name, pool in pools.items():
        used = []
        for count in pool.devices_per_node:
            need = {r: count * a for r, a in pool.bundle().items()}
            fits = [i for i, free in enumerate(left) if all(free[r] >= a - 1e-9 for r, a in need.items())]
            if not fits:
                raise PlacementError(f"pool {name!r} does not fit")
            for r, a in need.items():
                left[fits[0]][r] -= a
            used.append(fits[0])
        plan[name] = used
    return plan
