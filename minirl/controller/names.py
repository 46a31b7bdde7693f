# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""The names stage 6 chooses among: its roles, its placements, its weight syncs (no Ray, no torch:
chapters/06_ray.py checks its flags against them before anything heavy loads)."""

__all__ = ["ROLES", "LAYOUTS", "PLACEMENTS", "SYNCS"]

ROLES = ("actor", "rollout", "reward", "reference", "critic")


LAYOUTS = {
    "colocated": {role: "shared" for role in ROLES},
    "disaggregated": {"actor": "train", "reference": "train", "critic": "train",
                      "rollout": "rollout", "reward": "rollout"},
    "per-role": {role: role for role in ROLES},
}
PLACEMENTS = tuple(LAYOUTS)


SYNCS = ("collective", "object_store")   # a bucketed broadcast, or Ray's object store
