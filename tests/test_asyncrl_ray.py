"""Stage 7 on Ray: producers as Ray actors (stage 6's Worker) feeding the driver's queue and trainer.

A local cluster of 2 CPUs for the module, shut down at its end; two producer actors of half a CPU.
"""

import pytest
import torch

ray = pytest.importorskip("ray")

from minirl.config import RLConfig  # noqa: E402
from minirl.runtime.async_config import AsyncConfig  # noqa: E402
from minirl.runtime.async_run import train_async  # noqa: E402
from minirl.runtime.validate import ConfigError  # noqa: E402
from minirl.tasks.arithmetic import make_task  # noqa: E402

pytestmark = pytest.mark.ray
ROWS = make_task().rows("train")


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of our own (address="local": never another process's), started with retries."""
    from minirl.runtime.ray_start import connect
    torch.set_num_threads(1)
    try:
        connect(None, num_cpus=2)
        yield
    finally:
        ray.shutdown()


def test_ray_without_a_cluster_is_named(make_tiny_policy):
    if ray.is_initialized():
        pytest.skip("a cluster is running in this process")
    model, tok = make_tiny_policy(seed=2)
    config = RLConfig.from_flat(steps=1, prompts_per_step=2, num_generations=2, eval_every=0)
    with pytest.raises(RuntimeError, match="ray.init"):
        train_async(config, AsyncConfig(ray=True), model, tok, ROWS)


def test_ray_producers_run_the_async_loop(cluster, make_tiny_policy):
    model, tok = make_tiny_policy(seed=2)
    config = RLConfig.from_flat(steps=4, prompts_per_step=4, num_generations=4, eval_every=0)
    acfg = AsyncConfig(max_staleness=1, ray=True, ray_actors=2, producers=2, prompts_per_call=2,
                       env_latency=0.002, env_latency_sigma=1.0)
    result = train_async(config, acfg, model, tok, ROWS)
    recs = result.records
    assert [r["version"] for r in recs] == [1, 2, 3, 4]
    assert all(r["staleness/max"] <= 1 for r in recs)
    producers = {who for who, *_ in result.timeline.events if who != "trainer"}
    assert producers and all(p.startswith("ray ") for p in producers), producers
    assert {p.split()[1] for p in producers} == {"0/2", "1/2"}, "both actors produced"
    assert max(r["generated_version"] for r in recs) >= 1, "the actors picked up published weights"


def test_ray_with_in_flight_is_refused(cluster, make_tiny_policy):
    model, tok = make_tiny_policy(seed=2)
    config = RLConfig.from_flat(steps=1, prompts_per_step=2, num_generations=2, eval_every=0)
    with pytest.raises(ConfigError, match="in_flight"):
        train_async(config, AsyncConfig(ray=True, in_flight=True), model, tok, ROWS)
