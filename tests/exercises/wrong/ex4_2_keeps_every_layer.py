"""Exercise 4.2, wrong: gathers lazily but keeps every layer it yielded, so the memory grows to a whole model."""

from minirl.runtime.buckets import layer_key
from minirl.sync.sharded import full_tensor

EXERCISE = "4.2"


def gather_by_layer(named_weights):
    kept, layer, key = [], [], None
    for name, tensor in named_weights:
        if layer and layer_key(name) != key:
            kept.append(layer)
            yield layer
            layer = []
        key = layer_key(name)
        layer.append((name, full_tensor(tensor)))
    if layer:
        yield layer
