"""Exercise 6.1, wrong: only CPUs are counted; a GPU pool lands on nodes without GPUs."""

from minirl.controller.resource_pool import PlacementError

EXERCISE = "6.1"


def plan_placement(pools, nodes):
    left = [float(n.get("CPU", 0.0)) for n in nodes]
    plan = {}
    for name, pool in pools.items():
        used = []
        for count in pool.devices_per_node:
            need = count * pool.bundle()["CPU"]
            fits = [i for i, free in enumerate(left) if i not in used and free >= need - 1e-9]
            if not fits:
                raise PlacementError(f"pool {name!r} does not fit")
            left[fits[0]] -= need
            used.append(fits[0])
        plan[name] = used
    return plan
