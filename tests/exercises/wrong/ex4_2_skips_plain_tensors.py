"""Exercise 4.2, wrong: passes on only the DTensors; plain (unsharded) tensors never reach the engine."""

from minirl.runtime.buckets import layer_key

EXERCISE = "4.2"


def gather_by_layer(named_weights):
    layer, key = [], None
    for name, tensor in named_weights:
        if not hasattr(tensor, "full_tensor"):
            continue
        if layer and layer_key(name) != key:
            yield layer
            layer = []
        key = layer_key(name)
        layer.append((name, tensor.full_tensor()))
    if layer:
        yield layer
