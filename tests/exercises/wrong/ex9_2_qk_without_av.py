"""Exercise 9.2, wrong: counts QK^T but not the product of the attention weights with V."""

EXERCISE = "9.2"


def forward_flops(params, layers, attn_dim, seq_len, sequences):
    return sequences * (2 * params * seq_len + layers * attn_dim * seq_len * (seq_len + 1))
