"""Expert load and balancing on the tiny MoE (minirl.models.moe_balance, notebook 08; installed by
minirl.runtime.balancing_hooks), parameter counting, and the GSPO ratio statistics (minirl.diagnostics.routing,
measured by minirl.runtime.routing_bench)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from minirl.diagnostics.routing import ratio_spread
from minirl.models.moe import count_moe_parameters
from minirl.models.moe_balance import BalancedTopKRouter, expert_counts, load_balancing_loss, load_imbalance
from minirl.models.policy import build_tokenizer
from minirl.runtime.balancing_hooks import install_balancing, load_history
from minirl.runtime.moe_cache import load_moe_policy
from minirl.runtime.moe_checks import RouterError
from minirl.runtime.moe_routes import RouteRecorder, build_moe_policy, routers
from minirl.runtime.routing_bench import routing_ratio_spread


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tokenizer()
    model = build_moe_policy(tokenizer, hidden_size=32, num_layers=2, num_experts=4, top_k=2).eval()
    batch = tokenizer(["27+35=4", "4+5=91"], return_tensors="pt", padding=True, add_special_tokens=False)
    return model, tokenizer, batch


def test_balancing_loss_agrees_with_transformers_and_its_range():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3 * 10, 6, generator=g) * 3
    mask = (torch.arange(10) < torch.tensor([[10], [4], [7]])).long()
    for m in (None, mask):
        ours = load_balancing_loss(logits, 3, None if m is None else m.reshape(-1))
        theirs = load_balancing_loss_func((logits,), num_experts=6, top_k=3, attention_mask=m)
        assert torch.allclose(3 * ours, theirs, atol=1e-6), "transformers counts f per token: top_k x ours"
    assert load_balancing_loss(torch.zeros(12, 6), 3).item() == pytest.approx(1.0)
    assert load_balancing_loss(torch.tensor([[30.0, 30.0, 0.0, 0.0]]).repeat(8, 1), 2).item() == pytest.approx(2.0)


def test_counts_and_imbalance():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1]])
    assert expert_counts(idx, 4).tolist() == [3, 2, 1, 0]
    assert expert_counts(idx, 4, torch.tensor([1, 0, 1])).tolist() == [2, 2, 0, 0]
    stats = load_imbalance(torch.tensor([6.0, 2.0, 2.0, 2.0]))
    assert stats["max_over_mean"] == pytest.approx(2.0) and stats["hottest_over_coldest"] == pytest.approx(3.0)
    assert math.isinf(load_imbalance(torch.tensor([1.0, 0.0]))["hottest_over_coldest"])


def test_install_keeps_the_model_and_its_state_dict(tiny):
    model, _, batch = tiny
    plain = copy.deepcopy(model)
    balanced = copy.deepcopy(model)
    installed = install_balancing(balanced)
    assert len(installed) == 2 and all(isinstance(r, BalancedTopKRouter) for r in routers(balanced))
    with torch.no_grad():
        assert torch.equal(plain(**batch).logits, balanced(**batch).logits), "zero rates: the same computation"
    extra = set(balanced.state_dict()) - set(plain.state_dict())
    assert extra == {f"model.layers.{i}.mlp.gate.expert_bias" for i in range(2)}
    with torch.no_grad(), RouteRecorder(balanced) as rec:
        balanced(**batch)
    assert rec.routes(2).shape[0] == 2, "the route recorder still finds the routers"
    with pytest.raises(ValueError, match="already balanced"):
        install_balancing(balanced)
    with pytest.raises(ValueError, match="aux_loss_coef=-1"):
        install_balancing(copy.deepcopy(model), aux_loss_coef=-1)


def test_aux_loss_gradient_is_exactly_the_balancing_loss(tiny):
    model, _, batch = tiny
    coef = 0.3
    m = copy.deepcopy(model).train()
    install_balancing(m, aux_loss_coef=coef)
    inputs = []
    handles = [r.register_forward_hook(lambda mod, args, out: inputs.append(args[0].detach())) for r in routers(m)]
    (0.0 * m(**batch).logits.sum()).backward()                     # the main loss contributes no gradient
    for h in handles:
        h.remove()
    mask = batch["attention_mask"].reshape(-1)
    last, hidden = routers(m)[-1], inputs[-1]         # earlier routers also feed later layers' losses
    w = last.weight.detach().clone().requires_grad_()
    (coef * load_balancing_loss(F.linear(hidden.reshape(-1, w.shape[1]), w), 2, mask)).backward()
    assert torch.allclose(last.weight.grad, w.grad, atol=1e-8), "the loss of the real tokens (padding masked)"
    w.grad = None
    (coef * load_balancing_loss(F.linear(hidden.reshape(-1, w.shape[1]), w), 2)).backward()
    assert not torch.allclose(last.weight.grad, w.grad, atol=1e-8), "counting padding would differ (test is live)"
    assert routers(m)[0].weight.grad.abs().max() > 0
    m0 = copy.deepcopy(model).train()
    install_balancing(m0)
    (0.0 * m0(**batch).logits.sum()).backward()
    assert all(r.weight.grad.abs().max() == 0 for r in routers(m0)), "no coefficient, no balancing gradient"


def test_history_per_optimizer_step_and_bias_update(tiny):
    model, _, batch = tiny
    m = copy.deepcopy(model).train()
    rate = 0.05
    install_balancing(m, bias_update_rate=rate)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for _ in range(2):                                              # two forwards, one step
        m(**batch).logits.sum().backward()
    other.step()                                                    # an optimizer that does not own the router
    assert load_history(m).shape[0] == 0
    opt.step()
    history = load_history(m)                                       # [steps, L, E]
    assert history.shape == (1, 2, 4)
    assert history[0].sum(-1).tolist() == [2 * 2 * batch["attention_mask"].sum().item()] * 2, \
        "two forwards x top-2 x real tokens (padding excluded)"
    for router, counts in zip(routers(m), history[0], strict=True):
        assert torch.allclose(router.expert_bias, rate * torch.sign(counts.mean() - counts))
    with torch.no_grad():
        m.eval()
        m(**batch)
    assert load_history(m).shape[0] == 1, "eval / no-grad forwards are not training load"


def test_bias_changes_the_choice_not_the_weights(tiny):
    model, _, batch = tiny
    m = copy.deepcopy(model)
    router = install_balancing(m)[0]
    h = torch.randn(5, router.hidden_dim, generator=torch.Generator().manual_seed(1))
    logits, weights, chosen = router(h)
    router.expert_bias[:] = torch.tensor([10.0, 10.0, 0.0, 0.0])
    _, weights_b, chosen_b = router(h)
    assert (chosen_b.sort(-1).values == torch.tensor([0, 1])).all(), "a large bias forces the choice"
    probs = torch.softmax(logits, -1)
    expected = probs[:, :2] / probs[:, :2].sum(-1, keepdim=True)
    assert torch.allclose(weights_b.sort(-1).values, expected.sort(-1).values, atol=1e-6), \
        "the mixing weights come from the router's probabilities, not from the bias"


def test_rollout_copy_receives_the_bias(tiny):
    from minirl.rollout.hf import HFEngine

    model, tokenizer, _ = tiny
    m = copy.deepcopy(model)
    install_balancing(m)
    rollout = HFEngine(m, tokenizer)
    routers(m)[0].expert_bias[:] = 0.5
    rollout.load_weights(m.state_dict().items(), version=1)
    assert torch.equal(routers(rollout.model)[0].expert_bias, torch.full((4,), 0.5))


def test_nan_router_raises_router_error(tiny):
    model, _, batch = tiny
    m = copy.deepcopy(model)
    install_balancing(m)
    with torch.no_grad():
        routers(m)[0].weight[1, 3] = float("nan")
        with pytest.raises(RouterError, match="layer 0 router: router logits are not finite"):
            m(**batch)


def test_count_moe_parameters(tiny):
    model, _, _ = tiny
    c = count_moe_parameters(model.config)
    assert c["total"] == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert c["routed_experts"] == routed and c["num_experts"] == 4 and c["top_k"] == 2
    assert c["active"] == c["total"] - routed / 2
    from transformers import Qwen2Config
    with pytest.raises(ValueError, match="not a MoE config"):
        count_moe_parameters(Qwen2Config(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=10))


def test_ratio_spread_by_hand():
    rollout = torch.zeros(2, 3)
    trainer = torch.log(torch.tensor([[2.0, 0.5, 9.0], [1.0, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    s = ratio_spread(trainer, rollout, mask)
    tokens = torch.tensor([2.0, 0.5, 1.0, 1.0, 1.0])
    assert s["tokens"] == 5 and s["sequences"] == 2
    assert s["token_var"] == pytest.approx(tokens.var().item())
    assert s["sequence_var"] == pytest.approx(torch.tensor([1.0, 1.0]).var().item(), abs=1e-12), \
        "exp(mean(log 2, log 0.5)) = 1: the masked 9 never counts"
    assert s["token_max_dev"] == pytest.approx(1.0)


def test_routing_ratio_spread_on_a_tiny_moe(tiny):
    model, tokenizer, _ = tiny
    r = routing_ratio_spread(model, tokenizer, ["27+35=", "4+5="], rollout_dtype="float8_e4m3fn", num_generations=4)
    assert 0.0 <= r["flipped_share"] <= 1.0
    assert r["tokens_flipped"] + r["tokens_kept"] == r["plain"]["tokens"]
    assert r["plain"]["token_var"] > 0 and r["r3"]["tokens"] == r["plain"]["tokens"]
    same = routing_ratio_spread(model, tokenizer, ["27+35="], rollout_dtype="float32", num_generations=4)
    assert same["flipped_share"] == 0.0 and same["plain"]["token_max_dev"] < 1e-4, "fp32 rollout: no mismatch"


def test_load_moe_policy_is_cached(monkeypatch, tmp_path):
    from minirl.tasks.arithmetic import make_task

    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path))
    tokenizer = build_tokenizer()
    first = load_moe_policy(tokenizer, make_task(), warm_start_steps=1)
    assert len(list(tmp_path.glob("moe-*"))) == 1
    second = load_moe_policy(tokenizer, make_task(), warm_start_steps=1)
    assert all(torch.equal(a, b)
               for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True))
