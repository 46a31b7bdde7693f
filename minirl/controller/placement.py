# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""Placement: which pool hosts each role; three layouts, one Driver.

Roles mapped to one pool share its workers (one process per device hosts them all and they
take turns on it); roles on different pools run in different processes, on different
devices. `make_placement(kind, sizes, device)` builds one of three layouts:

| kind | pools | roles |
|---|---|---|
| colocated | shared | every role (veRL's hybrid engine: actor and rollout on the same devices) |
| disaggregated | train, rollout | actor, reference, critic on train; rollout and reward on rollout |
| per-role | one per role | each role its own group of Ray actors (OpenRLHF) |

`check_placement(placement, config)` runs before any actor starts: every role the
algorithm needs has a pool, and the batch splits into whole groups across every pool's
ranks. Errors name the role, the pool and the numbers.
"""

__all__ = ["SPLIT_ROLES", "Placement", "needed_roles", "parse_pools", "make_placement",
           "check_placement"]

from dataclasses import dataclass

from minirl.controller.names import LAYOUTS, PLACEMENTS, ROLES
from minirl.controller.resource_pool import ResourcePool
from minirl.runtime.validate import ConfigError, check_choice

SPLIT_ROLES = ("actor", "critic", "reference", "rollout")   # roles whose pool splits the batch by rank


@dataclass
class Placement:
    """A pool for every role: `roles` maps role -> pool name, `pools` pool name -> ResourcePool."""

    name: str
    pools: dict[str, ResourcePool]
    roles: dict[str, str]

    def roles_on(self, pool: str, needed=ROLES) -> list[str]:
        return [role for role in needed if self.roles.get(role) == pool]

    def describe(self, needed=ROLES) -> str:
        pools = dict.fromkeys(self.roles[r] for r in needed if r in self.roles)
        return f"{self.name}: " + "; ".join(f"{pool} {self.pools[pool].devices_per_node} {self.pools[pool].device} "
                                            f"({', '.join(self.roles_on(pool, needed))})"
                                            for pool in pools if pool in self.pools)


def needed_roles(config) -> list[str]:
    """The roles a run of `config` uses: actor, rollout, reward; a reference with beta > 0; a critic for PPO."""
    roles = ["actor", "rollout", "reward"]
    if config.algorithm.beta > 0:
        roles.append("reference")
    if config.algorithm.algo == "ppo":
        roles.append("critic")
    return roles


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


def make_placement(kind: str, sizes: dict[str, list[int]] | None = None, device: str = "cpu",
                   cpus_per_device: float = 0.25) -> Placement:
    """The `kind` layout with one device per pool unless `sizes` ({role: devices per node}) says otherwise.

    Roles that share a pool must be given the same size (or only one of them a size). A pool
    that hosts only the reward stays on CPUs: a verifier needs no GPU.
    """
    check_choice("placement", kind, PLACEMENTS)
    layout, sizes = LAYOUTS[kind], dict(sizes or {})
    unknown = sorted(set(sizes) - set(ROLES))
    if unknown:
        raise ConfigError("pools", unknown[0], f"not a role; the roles are {', '.join(ROLES)}")
    pools = {}
    for pool in dict.fromkeys(layout.values()):
        roles = [role for role in ROLES if layout[role] == pool]
        given = {role: sizes[role] for role in roles if role in sizes}
        if len({tuple(v) for v in given.values()}) > 1:
            raise ConfigError("pools", given, f"the roles {', '.join(given)} share the pool {pool!r} in the {kind} "
                                              "placement; give them one size")
        pool_device = "cpu" if roles == ["reward"] else device
        pools[pool] = ResourcePool(next(iter(given.values()), [1]), pool_device, cpus_per_device)
    return Placement(kind, pools, dict(layout))


def check_placement(placement: Placement, config) -> dict[str, list[str]]:
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
