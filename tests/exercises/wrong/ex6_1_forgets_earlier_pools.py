"""Exercise 6.1, wrong: every pool sees the nodes' full resources (earlier pools' devices overcommitted)."""

from minirl.controller.resource_pool import PlacementError

EXERCISE = "6.1"


def plan_placement(pools, nodes):
    plan = {}
    for name, pool in pools.items():
        left = [{r: float(n.get(r, 0.0)) for r in ("CPU", "GPU")} for n in nodes]
        used = []
        for count in pool.devices_per_node:
            need = {r: count * a for r, a in pool.bundle().items()}
            fits = [i for i, free in enumerate(left)
                    if i not in used and all(free[r] >= a - 1e-9 for r, a in need.items())]
            if not fits:
                raise PlacementError(f"pool {name!r} does not fit")
            for r, a in need.items():
                left[fits[0]][r] -= a
            used.append(fits[0])
        plan[name] = used
    return plan
