"""Exercise 8.1, wrong: ignores token_mask, so padding tokens count toward the expert load."""

EXERCISE = "8.1"


def load_balancing_loss(router_logits, top_k, token_mask=None):
    from minirl.models.moe_balance import load_balancing_loss as reference
    return reference(router_logits, top_k)
