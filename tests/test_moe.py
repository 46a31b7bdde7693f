"""Route recording and Rollout Routing Replay on a tiny Qwen2-MoE (minirl.models.moe)."""

import pytest
import torch

from minirl.models.moe import replay_routes
from minirl.models.policy import build_tokenizer
from minirl.runtime.logprob_measure import compare_routes
from minirl.runtime.moe_routes import RouteRecorder, build_moe_policy, route_agreement, routers


@pytest.fixture(scope="module")
def moe():
    tokenizer = build_tokenizer()
    model = build_moe_policy(tokenizer, hidden_size=32, num_layers=2, num_experts=4, top_k=2).eval()
    batch = tokenizer(["27+35=4", "4+5=91"], return_tensors="pt", padding=True, add_special_tokens=False)
    return model, tokenizer, batch


def test_record_shape_and_replay_of_own_routes_is_exact(moe):
    model, _, batch = moe
    assert len(routers(model)) == 2
    with torch.no_grad(), RouteRecorder(model) as rec:
        base = model(**batch).logits
    routes = rec.routes(batch["input_ids"].shape[0])
    assert routes.shape == (2, 2, batch["input_ids"].shape[1], 2)
    with torch.no_grad(), replay_routes(model, routes):
        replayed = model(**batch).logits
    assert torch.allclose(base, replayed, atol=1e-6), "replaying a forward's own routes must not change it"
    assert not any("forward" in vars(r) for r in routers(model)), "patches must be removed on exit"


def test_replay_forces_other_experts_and_keeps_router_gradient(moe):
    model, _, batch = moe
    with torch.no_grad(), RouteRecorder(model) as rec:
        base = model(**batch).logits
    routes = rec.routes(batch["input_ids"].shape[0])
    other = (routes + 1) % 4                                       # a different expert set everywhere
    assert route_agreement(routes, other) == 0.0
    with replay_routes(model, other), RouteRecorder(model) as seen:
        out = model(**batch).logits
    assert torch.equal(seen.routes(2), other), "inside replay the routers must return the replayed experts"
    assert not torch.allclose(base, out, atol=1e-4)
    out.sum().backward()
    assert routers(model)[0].weight.grad is not None, "R3 keeps the router's gradient"
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="routes cover"), torch.no_grad(), replay_routes(model, other[:, :1]):
        model(**batch)
    with pytest.raises(ValueError, match=r"expected \[L=2, B, T, k\]"), replay_routes(model, other[0]):
        pass


def test_agreement_with_mask():
    a = torch.tensor([[[[0, 1], [2, 3]]]])                         # [L=1, B=1, T=2, k=2]
    b = torch.tensor([[[[1, 0], [2, 1]]]])
    assert route_agreement(a, b) == 0.5                            # sets, not order
    assert route_agreement(a, b, torch.tensor([[1, 0]])) == 1.0
    with pytest.raises(ValueError, match="routes_a"):
        route_agreement(a, b[..., :1])


def test_compare_routes_r3_agrees_fully(moe):
    model, tokenizer, _ = moe
    r = compare_routes(model, tokenizer, ["27+35=", "4+5="], rollout_dtype="float8_e4m3fn", num_generations=4)
    assert r["route_agreement_r3"] == 1.0
    assert 0.5 < r["route_agreement"] <= 1.0
    assert r["max_abs_delta_r3"] <= r["max_abs_delta"] + 1e-6 or r["route_agreement"] == 1.0
