"""Checks of a stage-6 placement before anything starts, and the --pools flag parsed.

Hand-written (validation and CLI parsing; notebook 06 teaches the placements themselves, in
`minirl.controller.placement`):

- `needed_roles(config)`: the roles a run uses (actor, rollout, reward; a reference with a KL
  penalty, a critic for PPO).
- `check_placement(placement, config)` runs before any Ray actor starts (the Driver's first
  step, and chapters/06_ray.py's flag checks): every role the algorithm needs (`needed_roles`:
  a reference only with a KL penalty, a critic only for PPO) has a pool, and the batch splits
  into equal parts of whole groups across the ranks of every pool that splits it
  (`SPLIT_ROLES`). It returns {pool: the roles it hosts}; errors name the role, the pool and
  the numbers.
- `check_pool(devices_per_node, device, cpus_per_device)` (a `ResourcePool`'s arguments),
  `check_sizes(kind, sizes)` (a layout `make_placement` knows, and the sizes it gives the pools) and
  `check_driver_args(sync, reward_funcs, reward_weights)` (the Driver's own arguments) refuse
  bad values with a `ConfigError` or `ValueError` naming the setting.
- `describe(placement, needed)`: one line naming each pool, its devices and its roles (for
  messages and the chapter's first line); `plan_or_explain` is the Driver's
  `plan_placement` whose PlacementError also names the placement that way.
- `parse_pools("actor=2,rollout=1+1")` -> {"actor": [2], "rollout": [1, 1]}: the devices on
  each node of each role's pool, as chapters/06_ray.py's --pools flag gives them.
"""

from minirl.controller.names import LAYOUTS, PLACEMENTS, ROLES, SYNCS
from minirl.runtime.validate import ConfigError, check_choice, check_float

DEVICES = ("cpu", "gpu")

SPLIT_ROLES = ("actor", "critic", "reference", "rollout")   # roles whose pool splits the batch by rank


def check_pool(devices_per_node, device: str, cpus_per_device: float) -> None:
    """A ResourcePool's arguments: a device kind of DEVICES, a count >= 1 per node, CPUs per device > 0."""
    check_choice("device", device, DEVICES)
    if (not isinstance(devices_per_node, (list, tuple)) or not devices_per_node
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in devices_per_node)):
        raise ConfigError("devices_per_node", devices_per_node,
                          "a list with one device count >= 1 per node, e.g. [2] or [1, 1]")
    check_float("cpus_per_device", cpus_per_device, low=0.0, low_open=True)


def needed_roles(config) -> list[str]:
    """The roles a run of `config` uses: actor, rollout, reward; a reference if beta > 0; a critic for PPO."""
    roles = ["actor", "rollout", "reward"]
    if config.algorithm.beta > 0:
        roles.append("reference")
    if config.algorithm.algo == "ppo":
        roles.append("critic")
    return roles


def check_sizes(kind: str, sizes: dict[str, list[int]]) -> None:
    """A layout of PLACEMENTS and its --pools sizes: every key a role; roles that share a pool given one size."""
    check_choice("placement", kind, PLACEMENTS)
    unknown = sorted(set(sizes) - set(ROLES))
    if unknown:
        raise ConfigError("pools", unknown[0], f"not a role; the roles are {', '.join(ROLES)}")
    layout = LAYOUTS[kind]
    for pool in dict.fromkeys(layout.values()):
        given = {role: sizes[role] for role in ROLES if layout[role] == pool and role in sizes}
        if len({tuple(v) for v in given.values()}) > 1:
            raise ConfigError("pools", given, f"the roles {', '.join(given)} share the pool {pool!r} in the "
                                              f"{kind} placement; give them one size")


def check_driver_args(sync: str, reward_funcs, reward_weights) -> None:
    """A Driver's own arguments: a sync of SYNCS, one reward weight per reward function (or None)."""
    check_choice("sync", sync, SYNCS)
    if reward_weights is not None and len(reward_weights) != len(reward_funcs):
        raise ValueError(f"reward_weights has {len(reward_weights)} weights for {len(reward_funcs)} reward "
                         "functions: give one weight per function")


def describe(placement, needed=ROLES) -> str:
    """"disaggregated: train [1] cpu (actor); rollout [1] cpu (rollout, reward)": the pools of the `needed` roles."""
    pools = dict.fromkeys(placement.roles[r] for r in needed if r in placement.roles)
    return f"{placement.name}: " + "; ".join(
        f"{pool} {placement.pools[pool].devices_per_node} {placement.pools[pool].device} "
        f"({', '.join(r for r in needed if placement.roles.get(r) == pool)})"
        for pool in pools if pool in placement.pools)


def plan_or_explain(pools: dict, nodes: list[dict], placement, needed) -> dict[str, list[int]]:
    """`plan_placement(pools, nodes)`; its PlacementError also names the placement (`describe`)."""
    from minirl.controller.resource_pool import PlacementError, plan_placement  # noqa: PLC0415 (it imports us)
    try:
        return plan_placement(pools, nodes)
    except PlacementError as err:
        raise PlacementError(f"{err}; the placement was {describe(placement, needed)}") from None


def check_placement(placement, config) -> dict[str, list[str]]:
    """{pool name: the roles it hosts} for the roles `config` needs; raises ConfigError first if a role
    has no pool, or if the batch does not split across a pool's ranks."""
    needed = needed_roles(config)
    for role in needed:
        pool = placement.roles.get(role)
        if pool is None or pool not in placement.pools:
            why = "no pool" if pool is None else f"pool {pool!r}, which the placement does not define"
            raise ConfigError("placement", placement.name,
                              f"role {role!r} (needed by algo={config.algorithm.algo!r}, beta={config.algorithm.beta}) "
                              f"has {why}; map it to one of {sorted(placement.pools)}")
    used = {}
    for role in needed:
        used.setdefault(placement.roles[role], []).append(role)
    B = config.run.prompts_per_step
    for pool, roles in used.items():
        n = placement.pools[pool].size
        if any(r in SPLIT_ROLES for r in roles) and B % n:
            raise ConfigError("prompts_per_step", B,
                              f"{B} prompts per step (groups of {config.sampling.num_generations} completions) do "
                              f"not split into equal parts of whole groups across the {n} workers of pool {pool!r} "
                              f"({', '.join(roles)}); use a prompts_per_step that is a multiple of {n}, or a pool "
                              f"whose size divides {B}")
    return used


def parse_pools(text: str | None) -> dict[str, list[int]]:
    """"actor=2,rollout=1+1" -> {"actor": [2], "rollout": [1, 1]}: devices per node of each role's pool."""
    sizes = {}
    for item in filter(None, (text or "").split(",")):
        role, _, counts = item.partition("=")
        try:
            sizes[role.strip()] = [int(c) for c in counts.split("+")]
        except ValueError:
            raise ConfigError("pools", text, f"{item!r} is not role=N or role=N+M (devices on each node), "
                                             "e.g. actor=2,rollout=1+1") from None
        if min(sizes[role.strip()]) < 1:
            raise ConfigError("pools", text, f"role {role.strip()!r} is given 0 devices; a pool needs at least 1 "
                                             "on each node it spans: use N >= 1, or leave the role out (1 device)")
    return sizes
