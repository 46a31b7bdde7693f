"""Exercise 9.2, wrong: counts one FLOP per weight per token (a multiply-add is two)."""

EXERCISE = "9.2"


def forward_flops(params, layers, attn_dim, seq_len, sequences):
    return sequences * (params * seq_len + 2 * layers * attn_dim * seq_len * (seq_len + 1))
