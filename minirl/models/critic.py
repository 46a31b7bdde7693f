"""The PPO critic: a copy of the policy's transformer backbone with a scalar value head.

Simplified vs TRL's PPOTrainer / veRL: no separate reward model and no shared-backbone
option; the critic is initialized from the policy (the warm start) with a zero head.
"""

__all__ = ["ValueModel"]

import copy

from torch import Tensor, nn

from minirl.algo.logprobs import position_ids_from_mask


class ValueModel(nn.Module):
    """V(s_t) for each completion token: backbone hidden state at position t-1 -> linear -> scalar."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy) -> "ValueModel":
        """A critic whose backbone is a copy of `policy`'s (e.g. Qwen2ForCausalLM.model)."""
        backbone = copy.deepcopy(getattr(policy, policy.base_model_prefix))
        device = next(policy.parameters()).device
        return cls(backbone, policy.config.hidden_size).to(device)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, num_completion_tokens: int) -> Tensor:
        """input_ids, attention_mask: [B, P+C] -> values [B, C] float32 (the state before each token)."""
        C = num_completion_tokens
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
        return self.head(hidden[:, -C - 1:-1]).squeeze(-1).float()        # [B, C]
