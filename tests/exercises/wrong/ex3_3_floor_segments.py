"""Exercise 3.3, wrong: takes floor(sqrt(L)) segments instead of ceil."""

import math

EXERCISE = "3.3"


def checkpointed_activation_bytes(layer_bytes, boundary_bytes, head_bytes, num_layers, recompute="none"):
    if recompute not in ("none", "full", "sqrt"):
        raise ValueError(f"recompute={recompute!r}: use 'none', 'full' or 'sqrt'")
    L = num_layers
    if recompute == "none":
        return L * layer_bytes + head_bytes
    if recompute == "full":
        return L * boundary_bytes + max(head_bytes, layer_bytes)
    k = math.isqrt(L)
    return k * boundary_bytes + max(head_bytes, math.ceil(L / k) * layer_bytes)
