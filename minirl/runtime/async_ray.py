"""The producers as Ray actors: stage 6's `Worker` holding a `Producer`, and the driver's handle on it.

`RayProducer` runs the same `Producer` inside a Ray actor (concurrent `produce` calls share
its engine); `RayProducerClient` gives the driver's producer threads the same `produce` as a
local Producer's (`produce_groups`: `generate_call`, then `score_group` for every group at once), shipping each
new version to the object store once. Imported only when a
run asks for Ray (`AsyncConfig.ray`), so the rest of stage 7 runs without it.

Simplified: one object-store copy per version, pulled by each actor before its next call
(no broadcast, no in-flight updates across processes).
"""

import math
import threading

import ray

from minirl.asyncrl.producer import Producer
from minirl.asyncrl.queue import Trajectory
from minirl.config import RLConfig
from minirl.controller.worker import Worker
from minirl.rollout.registry import build_engine
from minirl.runtime.async_bookkeeping import WeightStore
from minirl.runtime.async_run import generate_call, score_group
from minirl.runtime.ray_calls import DEATHS, died


def produce_groups(producer: Producer, rows: list[dict], seeds: list[int], tickets: list[int],
                   clock=None) -> list[Trajectory]:
    """generate_call, then score_group for every row's group (their sessions all at once); one Trajectory
    per row, returned together (what one remote call gives back). clock: as score_group's."""
    generated = generate_call(producer, rows, seeds[0])
    out: list[Trajectory | None] = [None] * len(rows)

    def finish(i, item):
        out[i] = score_group(producer, *item[:2], seeds[i], *item[2:], ticket=tickets[i], clock=clock)
    threads = [threading.Thread(target=finish, args=(i, item), daemon=True) for i, item in enumerate(generated)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class RayProducer(Worker):
    """A Producer inside a Ray actor (stage 6's Worker): concurrent `produce` calls share its engine."""

    def __init__(self, group: str, rank: int, size: int, model, tokenizer, config: RLConfig, make_env,
                 env_timeout: float, max_turns: int, threads: int = 1):
        super().__init__(group, rank, size, "cpu", threads)
        self.store = WeightStore()
        self.producer = Producer(f"ray {rank}/{size}", build_engine(config, model, tokenizer), self.store, make_env,
                                 config.sampling, env_timeout, max_turns)

    def produce(self, rows: list[dict], seeds: list[int], tickets: list[int], version: int,
                weights_ref: list, clock=None) -> list[Trajectory]:
        """weights_ref: [ObjectRef] of the store's weights at `version` (in a list, so Ray does not fetch
        it unless this actor needs it)."""
        if version > self.store.version:
            with self.producer.lock:
                if version > self.store.version:
                    self.store.publish(ray.get(weights_ref[0]).items(), version)
        return produce_groups(self.producer, rows, seeds, tickets, clock)


class RayProducerClient:
    """The driver's handle on a RayProducer: `produce(rows, seeds, tickets)` as a local Producer's; weights from
    `store`."""

    _refs: dict = {}          # (id of the store, version) -> [ObjectRef]: one object-store copy per version
    _lock = threading.Lock()

    def __init__(self, actor, name: str, store: WeightStore, where: str = ""):
        self.actor, self.name, self.store, self.where = actor, name, store, where

    def produce(self, rows: list[dict], seeds: list[int], tickets: list[int], clock=None) -> list[Trajectory]:
        """A dead actor (killed, crashed, out of memory) raises stage 6's WorkerDiedError naming it."""
        version, weights = self.store.latest()
        key = (id(self.store), version)
        with self._lock:
            if key not in self._refs:
                self._refs.clear()
                self._refs[key] = [ray.put(weights)]
            ref = self._refs[key]
        try:
            return ray.get(self.actor.produce.remote(rows, seeds, tickets, version, ref, clock))
        except DEATHS as err:
            raise died(f"RayProducer {self.name}{self.where}", "produce", err) from None


def start_ray_producers(config: RLConfig, acfg, model, tokenizer, store: WeightStore, make_env=None):
    """acfg.producers clients sharing acfg.ray_actors RayProducer actors (half a CPU each); (clients, actors).

    make_env: the environments' factory (default acfg.make_env()), pickled to the actors."""
    slots = math.ceil(acfg.producers / acfg.ray_actors)
    remote = ray.remote(RayProducer)
    make_env = make_env or acfg.make_env()
    actors = [remote.options(num_cpus=0.5, max_concurrency=slots).remote(
        "rollout", r, acfg.ray_actors, model, tokenizer, config, make_env, acfg.env_timeout, acfg.max_turns)
        for r in range(acfg.ray_actors)]
    try:
        infos = ray.get([a.where.remote() for a in actors])        # started (a failure is named here)
    except DEATHS as err:
        stop_ray_producers(actors)
        raise died(f"a RayProducer of {acfg.ray_actors}", "its start", err) from None
    where = [f" (pid {info['pid']} on node {info['node_id'][:8]})" for info in infos]
    return [RayProducerClient(actors[i % len(actors)], f"ray {i % len(actors)} slot {i // len(actors)}", store,
                              where[i % len(actors)]) for i in range(acfg.producers)], actors


def stop_ray_producers(actors) -> None:
    for actor in actors:
        ray.kill(actor)
