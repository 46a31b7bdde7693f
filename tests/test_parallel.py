"""Stage 4 in one process: configs and checks, LoRA, the rank's loss weight, the data-parallel roles, the sharded
sync, the colocated engine.

A one-rank gloo group (a file store, no torchrun) lets FSDP2 and DTensor run here; the
multi-rank behaviour is in test_parallel_torchrun.py.
"""

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minirl.config import RLConfig, SamplingConfig
from minirl.data import Experience
from minirl.loss_types import aggregate_loss, loss_type_entry
from minirl.memory.measure import storage_bytes
from minirl.memory.wrap import apply_lora, decoder_layers, wrap_model
from minirl.parallel.config import ParallelConfig
from minirl.parallel.launch import ProcessGroup, init_distributed, rank_slice
from minirl.parallel.roles import DistributedActor, DistributedCritic, reduce_metrics, scale_gradient
from minirl.rollout.base import VersionMismatchError
from minirl.rollout.colocated import ColocatedEngine
from minirl.rollout.hf import HFEngine
from minirl.rollout.shared_prefix import SharedPrefixEngine
from minirl.runtime.buckets import gather_buckets, gather_packed, layer_buckets, shard_numels, split_by_layer
from minirl.runtime.lockstep import pad_completions, split_micro_batches
from minirl.runtime.parallel_checks import check_parallel
from minirl.runtime.prompt_seeds import SeedPerPrompt
from minirl.runtime.push_checks import EngineNotReady
from minirl.runtime.ranks import agree, pick_backend
from minirl.runtime.sync_meter import LiveBytes
from minirl.runtime.validate import ConfigError
from minirl.sync.sharded import ShardedSync, engine_name, gather_by_layer, merge_lora

SAMPLING = SamplingConfig(num_generations=2, max_completion_length=3)
PROMPTS = ["1+2=", "3+4="]


@pytest.fixture(scope="module")
def group():
    """A process group of one (gloo through a file store), destroyed when the module ends."""
    ctx = init_distributed()
    yield ProcessGroup(ctx.device)
    dist.destroy_process_group()


# ---- settings and checks: each bad input names the flag and the fix --------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(zero=4), r"zero=4: use one of 0, 1, 2, 3"),
    (dict(lora_rank=-1), r"lora_rank=-1: must be >= 0"),
    (dict(sync_mode="adapter"), r"sync_mode='adapter': merging or shipping an adapter needs LoRA"),
    (dict(lora_rank=4, sync_mode="full"), r"sync_mode='full': with LoRA"),
    (dict(zero=1, cpu_offload=True), r"cpu_offload=True: is FSDP2's.*use --zero 2 or 3"),
    (dict(sync_every=0), r"sync_every=0: must be >= 1 \(1: push after every update"),
    (dict(sync_every=3), r"sync_every=3: a colocated engine discards its weights.*--no-colocate"),
    (dict(sync_bucket_mb=-1.0), r"sync_bucket_mb=-1.0: must be >= 0.0"),
    (dict(lora_rank=2, lora_target_modules=" , "), r"lora_target_modules"),
])
def test_parallel_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParallelConfig(**kwargs)


def test_check_parallel_names_the_cause_before_anything_loads():
    with pytest.raises(ConfigError, match=r"prompts_per_step=6: 6 prompts do not divide over 4 ranks.*multiple of 4"):
        check_parallel(ParallelConfig(), RLConfig.from_flat(prompts_per_step=6), 4)
    with pytest.raises(ConfigError, match=r"algo='ppo': stage 4 trains GRPO"):
        check_parallel(ParallelConfig(), RLConfig.from_flat(algo="ppo"), 2)
    with pytest.raises(ConfigError, match=r"cpu_offload=True.*already on the CPU"):
        check_parallel(ParallelConfig(cpu_offload=True), RLConfig(), 2)
    check_parallel(ParallelConfig(), RLConfig.from_flat(prompts_per_step=8), 4)     # fine


def test_vllm_without_vllm_is_a_named_error():
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ConfigError, match=r"rollout_engine='vllm': vLLM is not installed.*requirements-gpu.txt.*"
                                          r"--rollout-engine shared_prefix"):
        check_parallel(ParallelConfig(), RLConfig.from_flat(rollout_engine="vllm"), 2)


def test_vllm_checks_that_need_both_configs(monkeypatch):
    """Stage 4 alone: vLLM cannot hand its weights back (--verify-sync) nor take an adapter (--sync-mode adapter)."""
    import minirl.rollout.registry as registry

    monkeypatch.setitem(registry.ENGINES, "vllm", dataclasses.replace(registry.ENGINES["vllm"],
                                                                      problem=registry.runs_anywhere))
    config = RLConfig.from_flat(rollout_engine="vllm", device="cuda")
    with pytest.raises(ConfigError, match=r"verify_sync=True: vLLM keeps its weights fused"):
        check_parallel(ParallelConfig(verify_sync=True), config, 2)
    with pytest.raises(ConfigError, match=r"sync_mode='adapter': minirl's vLLM engine takes whole"):
        check_parallel(ParallelConfig(lora_rank=2, sync_mode="adapter"), config, 2)
    check_parallel(ParallelConfig(lora_rank=2), config, 2)
    with pytest.raises(ConfigError, match=r"rollout_engine='tgi': use one of 'hf', 'shared_prefix', 'vllm', 'paged'"):
        check_parallel(ParallelConfig(), RLConfig.from_flat(rollout_engine="tgi"), 2)


def test_sync_due_every_k_steps_and_where_the_engine_must_be_fresh():
    from minirl.runtime.spmd_support import KeepWeights, sync_due

    config = RLConfig.from_flat(steps=10, eval_every=5, checkpoint_every=3)
    due = [s for s in range(1, 11) if sync_due(s, ParallelConfig(sync_every=4, colocate=False), config)]
    assert due == [3, 4, 5, 6, 8, 9, 10], "every 4th, every checkpoint (3), evaluation (5) and the last step"
    assert all(sync_due(s, ParallelConfig(), config) for s in range(1, 11)), "sync_every=1: every step"

    class Engine:
        version = 7

    report = KeepWeights().push([("w", torch.ones(2))], Engine(), 8)
    assert (report.version, report.tensors, report.bytes) == (7, 0, 0), "nothing moves; the engine's own version"


def test_nccl_without_cuda_is_a_named_error():
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"backend='nccl'.*--device is cpu"):
            pick_backend("nccl", "cpu")
        return
    with pytest.raises(ConfigError, match=r"backend='nccl': NCCL communicates between CUDA GPUs and this machine"):
        pick_backend("nccl", "cpu")
    with pytest.raises(ConfigError, match=r"device='cuda': CUDA is not available"):
        pick_backend("auto", "cuda")
    assert pick_backend("auto", "cpu") == "gloo"


def test_rank_slice_is_contiguous_and_refuses_uneven_batches():
    rows = list(range(8))
    assert [rank_slice(rows, r, 2) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ConfigError, match="prompts_per_step=6.*multiple of 4"):
        rank_slice(list(range(6)), 0, 4)


def test_lora_targets_must_match_a_linear_layer(make_tiny_policy):
    model, _ = make_tiny_policy(seed=2, num_layers=1)
    with pytest.raises(ConfigError, match=r"lora_target_modules='q_proj,qkv': \['qkv'\] matches no linear layer.*"
                                          r"named .*down_proj"):
        apply_lora(model, 4, targets=("q_proj", "qkv"))
    lora = apply_lora(model, 4, targets=("q_proj",))
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and "q_proj" in n for n in trainable)


def test_decoder_layers_found_by_no_split_modules(make_tiny_policy):
    model, _ = make_tiny_policy(seed=2, num_layers=2)
    assert len(decoder_layers(model)) == 2
    assert len(decoder_layers(apply_lora(model, 2))) == 2
    with pytest.raises(ValueError, match="names no decoder-layer class"):
        decoder_layers(nn.Linear(2, 2))


# ---- a rank's share of the loss ------------------------------------------------------------------

def rank_loss_weight(loss_type, *counts):
    return loss_type_entry(loss_type).rank_weight(*counts)


def test_rank_loss_weights_make_the_average_the_whole_batch():
    # two ranks holding 3 and 5 tokens of 8: dapo's weights are W * T_r / T, and average to 1
    w = [rank_loss_weight("dapo", t, 8, 2, 4, 2) for t in (3, 5)]
    assert w == pytest.approx([0.75, 1.25]) and sum(w) / 2 == pytest.approx(1)
    assert [rank_loss_weight("cispo", t, 8, 2, 4, 2) for t in (3, 5)] == w, "cispo weighs as dapo (TRL)"
    assert rank_loss_weight("grpo", 3, 8, 2, 4, 2) == pytest.approx(1.0)
    assert rank_loss_weight("dr_grpo", 3, 8, 1, 4, 2) == pytest.approx(0.5)
    assert rank_loss_weight("bnpo", 3, 8, 2, 4, 2) == 1.0
    assert rank_loss_weight("dapo", 0, 0, 2, 4, 2) == pytest.approx(2.0)   # empty batch: the clamp, no NaN
    for loss_type in ("grpo", "dr_grpo"):
        assert rank_loss_weight(loss_type, 0, 8, 0, 4, 2) == 0.0, "a rank with no rows counts for nothing"
        weights = [rank_loss_weight(loss_type, t, 8, r, 4, 3) for t, r in ((5, 3), (0, 0), (3, 1))]
        assert sum(weights) == pytest.approx(3.0), "the ranks' weights sum to world_size"
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        rank_loss_weight("ppo", 1, 2, 1, 2, 2)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo"])
def test_weighted_rank_gradients_average_to_the_whole_batch(loss_type):
    """Split a batch over 3 'ranks'; (1/W) sum_r w_r grad(loss_r) is the whole batch's gradient (not unweighted)."""
    g = torch.Generator().manual_seed(3)
    per_token = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) < 0.6).long()
    mask[:, 0] = 1
    mask[2:4, 3:] = 0                                  # unequal token counts per rank
    x = per_token.clone().requires_grad_(True)
    aggregate_loss(x, mask, loss_type, 5).backward()
    whole, total = x.grad.clone(), int(mask.sum())
    for weighted in (True, False):
        x.grad = None
        for part in (slice(0, 2), slice(2, 4), slice(4, 6)):
            w = rank_loss_weight(loss_type, int(mask[part].sum()), total, 2, 6, 3) if weighted else 1.0
            (w / 3 * aggregate_loss(x[part], mask[part], loss_type, 5)).backward()
        close = torch.allclose(x.grad, whole, atol=1e-6)
        assert close == weighted or loss_type in ("grpo", "dr_grpo"), \
            f"{loss_type}: weighted={weighted}: the ranks' averaged gradients vs the batch's"


def test_scale_gradient_scales_only_the_gradient():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = scale_gradient(x, 3.0)
    assert torch.equal(y, x)
    (y ** 2).sum().backward()
    assert torch.allclose(x.grad, 3.0 * 2 * x.detach())


def test_pad_completions_adds_masked_columns(tiny):
    model, tok = tiny
    ro = HFEngine(model, tok).generate(PROMPTS, SAMPLING, generator=torch.Generator().manual_seed(0))
    C = ro.num_completion_tokens
    wide = pad_completions(Experience(ro, torch.zeros(4), advantages=torch.zeros(4), ref_logps=ro.logprobs), C + 2)
    assert wide.rollout.completion_ids.shape[1] == C + 2 and wide.ref_logps.shape[1] == C + 2
    assert (wide.rollout.completion_mask[:, C:] == 0).all()
    assert (wide.rollout.completion_ids[:, C:] == tok.pad_token_id).all()
    assert torch.equal(wide.rollout.prompt_ids, ro.prompt_ids) and wide.advantages.shape == (4,)


# ---- the sharded sync ----------------------------------------------------------------------------

def shard(model, group, zero=3):
    return wrap_model(model, zero, "cpu")


def test_gather_by_layer_yields_whole_tensors_one_layer_at_a_time(group, make_tiny_policy):
    model, _ = make_tiny_policy(seed=4, num_layers=2)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = shard(model, group)
    named = list(wrapped.module.state_dict().items())
    assert any(hasattr(t, "full_tensor") for _, t in named), "FSDP2 holds DTensors"
    layers = list(gather_by_layer(named))
    assert sum(len(layer) for layer in layers) == len(named)
    assert {n.split(".layers.")[1].split(".")[0] for layer in layers for n, _ in layer if ".layers." in n} == {"0", "1"}
    for layer in layers:
        keys = {n.split(".layers.")[1].split(".")[0] if ".layers." in n else n for n, _ in layer}
        assert len(keys) == 1, f"one layer per list, got {keys}"
        for name, tensor in layer:
            assert type(tensor) is torch.Tensor and torch.equal(tensor, reference[name])


def test_packed_gathering_gives_whole_tensors_in_buckets_of_whole_layers(group, make_tiny_policy):
    """In a group of one: the same tensors as gather_by_layer, grouped by bucket (two ranks: test_parallel_torchrun)."""
    model, _ = make_tiny_policy(seed=4, num_layers=3)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    named = list(shard(model, group).module.state_dict().items())
    layer_bytes = sum(t.numel() * t.element_size() for n, t in named if ".layers.0." in n)
    per_layer = list(gather_buckets(named, 0))
    assert [[n for n, _ in b] for b in per_layer] == [[n for n, _ in layer] for layer in gather_by_layer(named)]
    for cap, expected in ((0, len(per_layer)), (2 * layer_bytes, None), (10**12, 1)):
        buckets = list(layer_buckets(named, cap))
        assert [n for b in buckets for n, _ in b] == [n for n, _ in named], "every tensor once, in order"
        layers_in = [{n.split(".layers.")[1].split(".")[0] for n, _ in b if ".layers." in n} for b in buckets]
        assert sum(len(x) for x in layers_in) == 3, "a decoder layer is never split between buckets"
        if expected is not None:
            assert len(buckets) == expected
        for b in buckets:
            groups = list(split_by_layer(b))
            size = sum(t.numel() * t.element_size() for _, t in b)
            assert len(groups) == 1 or size <= cap, "several layers share a bucket only within the cap"
        assert cap == 0 or len(buckets) < len(per_layer), "a cap of two layers or more merges some"
    whole = {n: t for b in gather_buckets(named, 10**12) for n, t in b}
    assert all(type(t) is torch.Tensor and torch.equal(t, reference[n]) for n, t in whole.items())
    plain = [("lm_head.weight", torch.ones(2, 3))]
    assert gather_packed(plain)[0][1] is not None and torch.equal(gather_packed(plain)[0][1], plain[0][1])


@pytest.mark.parametrize("rows, world, expected", [(19, 2, (10 * 4, 9 * 4)), (3, 4, (4, 4, 4, 0)), (8, 1, (32,))])
def test_shard_numels_follow_torch_chunk(rows, world, expected):
    assert shard_numels((rows, 4), world) == expected


def test_merge_lora_agrees_with_peft(make_tiny_policy):
    model, _ = make_tiny_policy(seed=4, num_layers=1)
    lora = apply_lora(model, 4, alpha=12)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_()                                # B starts at zero: give it something to merge
    state = dict(lora.state_dict())
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    merged = merge_lora(state[f"{stem}.base_layer.weight"], state[f"{stem}.lora_A.default.weight"],
                        state[f"{stem}.lora_B.default.weight"], 12 / 4)
    expected = lora.merge_and_unload().state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.allclose(merged, expected, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        merge_lora(torch.zeros(4, 3), torch.zeros(2, 4), torch.zeros(4, 2), 1.0)


def test_engine_name_strips_peft():
    assert engine_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert engine_name("model.norm.weight") == "model.norm.weight"


def sharded_actor(model, group, zero=3):
    config = RLConfig.from_flat(num_generations=2, max_completion_length=3)
    return DistributedActor(wrap_model(model, zero, "cpu"), config.algorithm, config.optimizer, config.sampling, group)


@pytest.mark.parametrize("lora", [False, True])
def test_sharded_sync_streams_into_a_sleeping_engine(group, make_tiny_policy, lora):
    """Correct weights under the engine's names, verified; the bounded peak needs two ranks (torchrun test)."""
    model, tok = make_tiny_policy(seed=6, num_layers=3)
    engine = ColocatedEngine(SharedPrefixEngine(model, tok), colocate=True)
    if lora:
        model = apply_lora(model, 2, alpha=4)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        merged = {k: v.clone() for k, v in apply_lora_copy_merged(model).items()}
    actor = sharded_actor(model, group)
    sync = ShardedSync("merged" if lora else "full", lora_scaling=2.0 if lora else None, verify=True)
    engine.generate(PROMPTS, SAMPLING)                     # then it sleeps
    assert engine.asleep and storage_bytes(t for _, t in engine.named_weights()) == 0
    report = sync.push(actor.named_weights(), engine, 1)
    assert engine.version == 1 and not engine.asleep and report.tensors == len(engine.names)
    assert report.bytes == storage_bytes(t for _, t in engine.named_weights()) + \
        sum(t.numel() * 4 for n, t in engine.named_weights() if n == "lm_head.weight")   # tied: pushed twice
    if lora:
        held = dict(engine.named_weights())
        assert all(torch.allclose(held[k], v, atol=1e-6) for k, v in merged.items())


def apply_lora_copy_merged(peft_model):
    import copy
    return copy.deepcopy(peft_model).merge_and_unload().state_dict()


def test_adapter_sync_ships_only_the_adapter(group, make_tiny_policy):
    model, tok = make_tiny_policy(seed=6, num_layers=2)
    model = apply_lora(model, 2)
    engine = ColocatedEngine(SharedPrefixEngine(model, tok), adapter_only=True)
    actor = sharded_actor(model, group, zero=2)
    report = ShardedSync("adapter", verify=True).push(actor.named_weights(), engine, 1)
    lora_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
    assert report.bytes == lora_bytes and report.tensors == len(engine.names)
    assert all("lora_" in n for n in engine.names)
    with pytest.raises(ValueError, match="holds no LoRA tensors"):
        ShardedSync("adapter").push([("model.norm.weight", torch.zeros(2))], engine, 2)


def test_live_bytes_counts_until_freed():
    meter = LiveBytes()
    a, b = torch.zeros(10), torch.zeros(20)
    meter.track(a)
    meter.track(b)
    del a
    assert meter.live == 80 and meter.peak == 120


# ---- the colocated engine refuses bad pushes, and sleeps for real ----------------------------------

def test_colocated_engine_refuses_bad_pushes_and_stays_unusable(tiny):
    model, tok = tiny
    engine = ColocatedEngine(SharedPrefixEngine(model, tok), colocate=False)
    state = list(model.state_dict().items())
    with pytest.raises(ValueError, match=r"unexpected tensor 'model.layers.0.attn.weight'.*engine's names"):
        engine.load_weights([(n.replace("self_attn.q_proj", "attn") if "q_proj.weight" in n else n, t)
                             for n, t in state], 1)
    with pytest.raises(EngineNotReady, match="half-loaded"):
        engine.generate(PROMPTS, SAMPLING)
    with pytest.raises(ValueError, match=r"1 of \d+ tensors were never pushed \(first: model.norm.weight\)"):
        engine.load_weights([(n, t) for n, t in state if n != "model.norm.weight"], 1)
    with pytest.raises(ValueError, match="has shape"):
        engine.load_weights([(n, t.T if t.dim() == 2 else t) for n, t in state], 1)
    engine.load_weights(state, 3)
    with pytest.raises(VersionMismatchError, match="holds version 3: refusing to go back"):
        engine.load_weights(state, 2)
    with pytest.raises(VersionMismatchError, match="holds policy version 3 but the loop expected version 2"):
        engine.generate(PROMPTS, SAMPLING, expected_version=2)
    assert len(engine.generate(PROMPTS, SAMPLING, expected_version=3)) == 4


def test_sleep_releases_the_weights_and_a_push_restores_them(tiny):
    model, tok = tiny
    engine = ColocatedEngine(SharedPrefixEngine(model, tok))
    awake = storage_bytes(t for _, t in engine.named_weights())
    engine.generate(PROMPTS, SAMPLING, generator=torch.Generator().manual_seed(1))
    assert engine.asleep and storage_bytes(t for _, t in engine.named_weights()) == 0
    assert engine.stats["released_bytes"] == awake
    with pytest.raises(EngineNotReady, match="asleep"):
        engine.generate(PROMPTS, SAMPLING)
    engine.load_weights(model.state_dict().items(), 1)
    assert storage_bytes(t for _, t in engine.named_weights()) == awake
    pairs = zip(engine.named_weights(), model.state_dict().items(), strict=True)
    assert all(torch.equal(a, b) for (_, a), (_, b) in pairs)


def test_seed_per_prompt_does_not_depend_on_the_split(tiny):
    model, tok = tiny
    engine = SeedPerPrompt(SharedPrefixEngine(model, tok))
    prompts = ["1+2=", "3+4=", "5+6=", "7+8="]
    whole = engine.generate(prompts, SAMPLING, generator=torch.Generator().manual_seed(5))
    halves = [engine.generate(prompts[i:i + 2], SAMPLING, generator=torch.Generator().manual_seed(5)) for i in (0, 2)]
    assert whole.completions == halves[0].completions + halves[1].completions


def test_agree_in_one_process_reraises(group):
    with pytest.raises(KeyError):
        agree("a test", lambda: {}["missing"])
    assert agree("a test", lambda: 3) == 3


def test_distributed_actor_matches_the_plain_actor_in_one_process(group, make_tiny_policy):
    """World size 1: the weight is 1, and one update equals notebook 01's Actor's."""
    from minirl.roles.actor import Actor

    model, tok = make_tiny_policy(seed=8, num_layers=2)
    plain_model, _ = make_tiny_policy(seed=8, num_layers=2)
    ro = SharedPrefixEngine(model, tok).generate(PROMPTS, SAMPLING, generator=torch.Generator().manual_seed(2))
    exp = Experience(ro, torch.tensor([1.0, 0.0, 0.0, 1.0]), advantages=torch.tensor([1.0, -1.0, -1.0, 1.0]))
    config = RLConfig.from_flat(num_generations=2, max_completion_length=3)
    plain = Actor(plain_model, config.algorithm, config.optimizer, config.sampling).update(exp)
    sharded = sharded_actor(model, group).update(exp)
    assert sharded["loss"] == pytest.approx(plain["loss"], abs=1e-6) and not math.isnan(sharded["grad_norm"])
    assert sharded["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


def test_split_micro_batches_gives_every_rank_as_many_passes():
    plan = [[0, 3, 5, 6], [1, 2], [4]]
    for count in (3, 4, 5, 7):
        out = split_micro_batches(plan, count)
        assert len(out) == count and sorted(i for rows in out for i in rows) == list(range(7)), out
        assert all(rows for rows in out), "no empty pass"
    assert split_micro_batches(plan, 2) == plan, "never merges: the rank with the most keeps its plan"
    with pytest.raises(ValueError, match="7 rows cannot make 8 micro-batches"):
        split_micro_batches(plan, 8)


@pytest.mark.parametrize("zero", [0, 3])
def test_distributed_actor_in_micro_batches_matches_the_plain_actor(group, make_tiny_policy, zero):
    """DDP and FSDP2 with several micro-batches (the prompt cache's extra backward): notebook 01's update."""
    from minirl.roles.actor import Actor

    model, tok = make_tiny_policy(seed=8, num_layers=2)
    plain_model, _ = make_tiny_policy(seed=8, num_layers=2)
    sampling = SamplingConfig(num_generations=2, max_completion_length=6)
    ro = SharedPrefixEngine(model, tok).generate(PROMPTS * 2, sampling, generator=torch.Generator().manual_seed(4))
    advantages = torch.linspace(-1, 1, len(ro))
    config = RLConfig.from_flat(num_generations=2, max_completion_length=6, max_tokens_per_microbatch=4)
    plain = Actor(plain_model, config.algorithm, config.optimizer, config.sampling)
    sharded = DistributedActor(wrap_model(model, zero, "cpu"), config.algorithm, config.optimizer, config.sampling,
                               group)
    assert len(sharded.micro_batches(ro)) > 2, "test setup: several micro-batches"
    exp = Experience(ro, torch.zeros(len(ro)), advantages=advantages)
    torch.testing.assert_close(sharded.logprobs(ro), plain.logprobs(ro), atol=1e-5, rtol=0)
    want, got = plain.update(exp), sharded.update(exp)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6) and got["skipped"] == 0
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5) and want["grad_norm"] > 0


def test_reduce_metrics_makes_one_record_of_the_ranks():
    """One rule for every data-parallel role (stage 4 and stage 6): which metric is reduced how."""
    records = [{"loss": 1.0, "value_loss": 0.5, "entropy": 2.0, "ratio/min": 0.9, "ratio/max": 1.1, "skipped": 0,
                "value_skipped": 1, "grad_norm": 3.0, "value_grad_norm": 1.0, "note": "rank 0"},
               {"loss": 3.0, "value_loss": 1.5, "entropy": 4.0, "ratio/min": 0.8, "ratio/max": 1.3, "skipped": 1,
                "value_skipped": 0, "grad_norm": 3.5, "value_grad_norm": 2.0, "note": "rank 1"}]
    out = reduce_metrics(records, [30.0, 10.0], [1.0, 1.0])       # grpo's weights: equal rows, unequal tokens
    assert out == {"loss": 2.0, "value_loss": 1.0,                 # the batch's: (1/W) sum w_r loss_r
                   "entropy": 2.5,                                 # token-weighted: (30 * 2 + 10 * 4) / 40
                   "ratio/min": 0.8, "ratio/max": 1.3, "skipped": 1, "value_skipped": 1,   # any rank skipped
                   "grad_norm": 3.0, "value_grad_norm": 1.0, "note": "rank 0"}            # global already
    assert reduce_metrics(records, [30.0, 10.0])["loss"] == 1.5, "without weights: token-weighted"
    assert reduce_metrics(records[:1], [30.0], [1.0]) == records[0], "one rank: its record"


def update_twice(actor, exp, bad):
    """The actor's weights after an update on `bad` (then on `exp`), and both records."""
    before = {k: v.detach().clone() for k, v in actor.named_weights()}
    skipped = actor.update(bad)
    unchanged = all(torch.equal(v, before[k]) for k, v in actor.named_weights())
    return skipped, unchanged, actor.update(exp)


def test_distributed_roles_skip_a_non_finite_batch_and_keep_their_weights(group, make_tiny_policy):
    model, tok = make_tiny_policy(seed=8, num_layers=1)
    ro = SharedPrefixEngine(model, tok).generate(PROMPTS, SAMPLING, generator=torch.Generator().manual_seed(2))
    exp = Experience(ro, torch.tensor([1.0, 0.0, 0.0, 1.0]), advantages=torch.tensor([1.0, -1.0, -1.0, 1.0]))
    bad = Experience(ro, exp.rewards, advantages=torch.tensor([1.0, math.nan, -1.0, 1.0]))
    skipped, unchanged, after = update_twice(sharded_actor(model, group, zero=0), exp, bad)
    assert skipped["skipped"] == 1 and math.isnan(skipped["loss"]) and unchanged
    assert after["skipped"] == 0 and math.isfinite(after["loss"]) and after["loss_weight"] == 1.0


def test_distributed_critic_matches_the_plain_critic_in_one_process(group, make_tiny_policy):
    from minirl.models.critic import ValueModel
    from minirl.roles.critic import Critic

    model, tok = make_tiny_policy(seed=8, num_layers=1)
    ro = SharedPrefixEngine(model, tok).generate(PROMPTS, SAMPLING, generator=torch.Generator().manual_seed(2))
    C = ro.num_completion_tokens
    exp = Experience(ro, torch.zeros(4), values=torch.zeros(4, C), returns=torch.linspace(-1, 1, 4 * C).view(4, C))
    config = RLConfig.from_flat(algo="ppo", num_generations=2, max_completion_length=3)
    plain = Critic(ValueModel.from_policy(model), config.algorithm, config.optimizer)
    critic = DistributedCritic(wrap_model(ValueModel.from_policy(model), 0, "cpu"), config.algorithm,
                               config.optimizer, group)
    assert critic.optimizer.param_groups[0]["lr"] == config.optimizer.value_learning_rate
    want, got = plain.update(exp), critic.update(exp)
    assert got["value_loss"] == pytest.approx(want["value_loss"], abs=1e-7) and got["value_skipped"] == 0
    assert got["value_grad_norm"] == pytest.approx(want["value_grad_norm"], rel=1e-5) and want["value_grad_norm"] > 0
    assert set(critic.state_dict()["model"]) == set(plain.state_dict()["model"]), "the plain model's names"
    bad = Experience(ro, exp.rewards, values=exp.values, returns=exp.returns.clone())
    bad.returns[1, 0] = math.inf
    before = {k: v.clone() for k, v in critic.module.state_dict().items()}
    assert critic.update(bad)["value_skipped"] == 1
    assert all(torch.equal(v, before[k]) for k, v in critic.module.state_dict().items())
    with pytest.raises(NotImplementedError, match=r"zero=3.*DCP"):
        sharded_actor(make_tiny_policy(seed=8, num_layers=1)[0], group, zero=3).state_dict()


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_keeps_fp32_shards(group, make_tiny_policy, precision, dtype):
    """FSDP2's MixedPrecisionPolicy (--mixed-precision bf16 or fp16 at ZeRO 2/3): compute in half precision, keep
    (and update) float32 shards."""
    model, tok = make_tiny_policy(seed=9, num_layers=2)
    ro = SharedPrefixEngine(model, tok).generate(PROMPTS, SAMPLING, generator=torch.Generator().manual_seed(2))
    config = RLConfig.from_flat(num_generations=2, max_completion_length=3)
    wrapped = wrap_model(model, 3, "cpu", mixed_precision=precision)
    actor = DistributedActor(wrapped, config.algorithm, config.optimizer, config.sampling, group)
    seen = set()
    model.lm_head.register_forward_hook(lambda _m, _i, output: seen.add(output.dtype))
    before = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    metrics = actor.update(Experience(ro, torch.zeros(4), advantages=torch.tensor([1.0, -1.0, -1.0, 1.0])))
    assert math.isfinite(metrics["loss"]) and metrics["skipped"] == 0 and seen == {dtype}, seen
    assert all(p.dtype == torch.float32 for p in model.parameters()), "the shards stay float32 (the master copy)"
    assert any(not torch.equal(p.detach().to_local(), before[n]) for n, p in model.named_parameters())


def test_gradient_checkpointing_gives_the_same_update(group, make_tiny_policy):
    """Per-layer recomputation changes memory and time, not the gradient."""
    from minirl.memory.wrap import set_checkpointing

    grads = []
    for on in (False, True):
        model, tok = make_tiny_policy(seed=10, num_layers=2)
        ro = SharedPrefixEngine(model, tok).generate(PROMPTS, SAMPLING, generator=torch.Generator().manual_seed(3))
        config = RLConfig.from_flat(num_generations=2, max_completion_length=3)
        set_checkpointing(model, on)
        actor = DistributedActor(wrap_model(model, 3, "cpu"), config.algorithm, config.optimizer, config.sampling,
                                 group, checkpointing=on)
        metrics = actor.update(Experience(ro, torch.zeros(4), advantages=torch.tensor([1.0, -1.0, -1.0, 1.0])))
        grads.append(metrics["grad_norm"])
    assert grads[0] == pytest.approx(grads[1], rel=1e-5)


@pytest.mark.parametrize("zero, lora", [(0, 0), (1, 0), (3, 4)])
def test_sharded_checkpoint_resumes_exactly(group, make_tiny_policy, tmp_path, zero, lora):
    """Save after 1 step, restore into a fresh state, 2 more steps: the weights of 3 uninterrupted steps.
    ZeRO-1's optimizer is saved per rank (ZeroRedundancyOptimizer is not one DCP knows)."""
    from minirl.parallel.launch import DistContext
    from minirl.parallel.spmd import setup_spmd, spmd_step
    from minirl.runtime.sharded_checkpoint import latest_sharded, load_sharded, save_sharded
    from minirl.sync.sharded import full_tensor
    from minirl.tasks.arithmetic import make_task
    from minirl.train.run import run

    def digits(prompts, completions, **columns):
        return [sum(c in "01234" for c in text) / max(1, len(text)) for text in completions]

    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    config = RLConfig.from_flat(steps=3, prompts_per_step=2, num_generations=4, eval_every=0, learning_rate=0.01)
    pconfig = ParallelConfig(zero=zero, lora_rank=lora)
    rows = make_task().rows("train")

    def fresh():
        model, tok = make_tiny_policy(seed=11, num_layers=2)
        return setup_spmd(config, pconfig, model, tok, rows, [digits], ctx)

    def weights(state):
        return {n: full_tensor(t).clone() for n, t in state.roles.actor.named_weights()}

    whole = fresh()
    run(whole, spmd_step, [], 3)
    broken = fresh()
    run(broken, spmd_step, [], 1)
    save_sharded(tmp_path, broken)
    resumed = fresh()
    found = latest_sharded(tmp_path, 1)
    assert found is not None and found.name == "step-000001"
    load_sharded(found, resumed)
    assert resumed.step == 1 and resumed.roles.version == 1 and resumed.engine.version == 1
    run(resumed, spmd_step, [], 3)
    a, b = weights(whole), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed != uninterrupted"
    assert any(not torch.equal(a[k], v) for k, v in weights(fresh()).items()), "the steps moved the weights"


def test_export_loads_and_resume_on_another_world_size_is_refused(group, make_tiny_policy, tmp_path):
    from transformers import AutoModelForCausalLM

    from minirl.parallel.launch import DistContext
    from minirl.parallel.spmd import setup_spmd
    from minirl.runtime.policy_export import export_policy
    from minirl.runtime.sharded_checkpoint import load_sharded, save_sharded
    from minirl.tasks.arithmetic import make_task

    model, tok = make_tiny_policy(seed=12, num_layers=1)
    state = setup_spmd(RLConfig.from_flat(num_generations=2), ParallelConfig(), model, tok,
                       make_task().rows("train"), [lambda prompts, completions, **kw: [0.0] * len(completions)],
                       DistContext(0, 1, 0, torch.device("cpu"), "gloo"))
    exported = export_policy(state.roles.actor, None, tok, tmp_path / "final", state.ctx)
    loaded = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.engine.named_weights()), "the export is the policy"
    path = save_sharded(tmp_path / "checkpoints", state)
    training = torch.load(path / "training_state.pt", weights_only=False)
    torch.save(training | {"world_size": 4}, path / "training_state.pt")
    with pytest.raises(ConfigError, match=r"written by 4 ranks; resume with torchrun --nproc_per_node 4"):
        load_sharded(path, state)


def test_a_lora_export_saves_the_peft_adapter_beside_the_merged_model(group, make_tiny_policy, tmp_path):
    """Issue 31: final/adapter/ is what peft saves (adapter_config.json, adapter_model.safetensors); peft loads it on
    the base model, and its merged outputs are the merged export's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from minirl.parallel.launch import DistContext
    from minirl.parallel.spmd import setup_spmd
    from minirl.runtime.policy_export import adapter_path, export_policy
    from minirl.tasks.arithmetic import make_task

    model, tok = make_tiny_policy(seed=12, num_layers=1)
    zero = [lambda prompts, completions, **kw: [0.0] * len(completions)]
    state = setup_spmd(RLConfig.from_flat(num_generations=2), ParallelConfig(zero=3, lora_rank=4, lora_alpha=16),
                       model, tok, make_task().rows("train"), zero, DistContext(0, 1, 0, torch.device("cpu"), "gloo"))
    torch.manual_seed(0)
    with torch.no_grad():                            # a trained adapter: B is zero until the first update
        for name, p in state.roles.actor.module.named_parameters():
            if "lora_B" in name:
                p.to_local().normal_(0.0, 0.1)      # FSDP2: a DTensor; one rank holds it whole
    final = export_policy(state.roles.actor, state.sync.lora_scaling, tok, tmp_path / "final", state.ctx)
    adapter = adapter_path(final, 4)
    assert adapter == final / "adapter" and adapter_path(final, 0) is None
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    base, _ = make_tiny_policy(seed=12, num_layers=1)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    assert peft_model.peft_config["default"].r == 4 and peft_model.peft_config["default"].lora_alpha == 16
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    ids = torch.tensor([tok.encode("12+7=")])
    with torch.no_grad():
        adapted, exported = peft_model(ids).logits, merged(ids).logits
        plain, _ = make_tiny_policy(seed=12, num_layers=1)
        assert not torch.allclose(exported, plain.eval()(ids).logits, atol=1e-4), "the adapter changed the outputs"
        torch.testing.assert_close(adapted, exported, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(peft_model.merge_and_unload()(ids).logits, exported, atol=1e-5, rtol=1e-4)
