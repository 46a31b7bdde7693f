"""Exercise 4.2, wrong: groups the tensors but never gathers them: the engine gets DTensor shards."""

from minirl.runtime.buckets import layer_key

EXERCISE = "4.2"


def gather_by_layer(named_weights):
    layer, key = [], None
    for name, tensor in named_weights:
        if layer and layer_key(name) != key:
            yield layer
            layer = []
        key = layer_key(name)
        layer.append((name, tensor.detach()))
    if layer:
        yield layer
