"""Exercise 8.1, wrong: forgets the factor E (number of experts), so a balanced router does not score 1."""

EXERCISE = "8.1"


def load_balancing_loss(router_logits, top_k, token_mask=None):
    from minirl.models.moe_balance import load_balancing_loss as reference
    return reference(router_logits, top_k, token_mask) / router_logits.shape[-1]
