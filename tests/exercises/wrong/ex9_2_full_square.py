"""Exercise 9.2, wrong: every token attends to every key (PaLM's T x T square), not causally."""

EXERCISE = "9.2"


def forward_flops(params, layers, attn_dim, seq_len, sequences):
    return sequences * (2 * params * seq_len + 4 * layers * attn_dim * seq_len ** 2)
