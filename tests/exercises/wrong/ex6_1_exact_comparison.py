"""Exercise 6.1, wrong: resources compared without a tolerance (3 x 0.1 CPU does not fit 0.3 CPU)."""

from minirl.controller.resource_pool import PlacementError

EXERCISE = "6.1"


def plan_placement(pools, nodes):
    left = [{r: float(n.get(r, 0.0)) for r in ("CPU", "GPU")} for n in nodes]
    plan = {}
    for name, pool in pools.items():
        used = []
        for count in pool.devices_per_node:
            need = {r: count * a for r, a in pool.bundle().items()}
            fits = [i for i, free in enumerate(left) if i not in used and all(free[r] >= a for r, a in need.items())]
            if not fits:
                raise PlacementError(f"pool {name!r} does not fit")
            for r, a in need.items():
                left[fits[0]][r] -= a
            used.append(fits[0])
        plan[name] = used
    return plan
