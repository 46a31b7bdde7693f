"""The batch that travels (minirl.data): split -> concat is the identity, padding, select, to."""

import pytest
import torch

from minirl.data import Batch, Experience, Rollout


def rollout(N=8, P=3, C=4, G=2, version=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(N, P, dtype=torch.long)
    prompt_mask[::2, 0] = 0                                              # some prompts are left-padded
    return Rollout(torch.randint(3, 18, (N, P), generator=g), prompt_mask, torch.randint(3, 18, (N, C), generator=g),
                   torch.ones(N, C, dtype=torch.long), -torch.rand(N, C, generator=g), [f"c{i}" for i in range(N)],
                   [f"p{i // G}" for i in range(N)], version, num_generations=G, pad_token_id=0)


def experience(**kw):
    ro = rollout(**kw)
    N, C = ro.completion_ids.shape
    return Experience(ro, torch.arange(N).float(), advantages=torch.randn(N), old_logps=-torch.rand(N, C),
                      values=torch.randn(N, C))


def assert_same(a, b):
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.completions, a.prompts, a.version, a.num_generations) == (b.completions, b.prompts, b.version,
                                                                         b.num_generations)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_split_then_concat_is_the_identity(n):
    exp = experience()
    parts = exp.split(n)
    assert len(parts) == n and all(len(p) == 8 // n for p in parts)
    back = Batch.concat(parts)
    assert_same(back.rollout, exp.rollout)
    for name in ("rewards", "advantages", "old_logps", "values"):
        assert torch.equal(getattr(back, name), getattr(exp, name)), name
    assert back.ref_logps is None and back.version == 3


def test_split_keeps_groups_whole():
    exp = experience(N=8, G=4)
    with pytest.raises(ValueError, match="8 rows in groups of 4 do not split into 4 equal parts"):
        exp.split(4)
    halves = exp.split(2)
    assert [p.rollout.prompts for p in halves] == [["p0"] * 4, ["p1"] * 4]


def test_concat_pads_parts_of_different_widths():
    a, b = rollout(N=2, P=3, C=4, G=2), rollout(N=2, P=5, C=2, G=2, seed=1)
    both = Batch.concat([a, b])
    assert both.prompt_ids.shape == (4, 5) and both.completion_ids.shape == (4, 4)
    assert torch.equal(both.prompt_ids[:2, 2:], a.prompt_ids) and (both.prompt_mask[:2, :2] == 0).all(), \
        "prompts pad on the left"
    assert torch.equal(both.completion_ids[2:, :2], b.completion_ids) and (both.completion_mask[2:, 2:] == 0).all(), \
        "completions pad on the right"
    assert (both.completion_ids[2:, 2:] == 0).all() and (both.logprobs[2:, 2:] == 0).all()
    with pytest.raises(ValueError, match="disagree on version"):
        Batch.concat([a, rollout(N=2, version=4)])


def test_select_and_to():
    exp = experience()
    light = exp.select(["advantages"])
    assert light.advantages is exp.advantages and light.old_logps is None and light.values is None
    assert light.rollout is exp.rollout and light.rewards is exp.rewards
    with pytest.raises(ValueError, match="no field"):
        exp.select(["advantage"])
    moved = exp.to("cpu")
    assert moved.rollout.completion_ids.device.type == "cpu" and moved.version == exp.version
