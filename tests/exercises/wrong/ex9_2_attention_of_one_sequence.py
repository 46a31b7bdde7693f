"""Exercise 9.2, wrong: counts the attention of one sequence, whatever the number of sequences."""

EXERCISE = "9.2"


def forward_flops(params, layers, attn_dim, seq_len, sequences):
    return sequences * 2 * params * seq_len + 2 * layers * attn_dim * seq_len * (seq_len + 1)
