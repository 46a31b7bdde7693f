"""Exercise 9.2, wrong: leaves out attention (2 N per token only)."""

EXERCISE = "9.2"


def forward_flops(params, layers, attn_dim, seq_len, sequences):
    return sequences * 2 * params * seq_len
