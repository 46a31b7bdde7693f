"""Exercise 4.2, wrong: gathers the whole state first, then groups it: a whole extra model in memory."""

from minirl.runtime.buckets import layer_key
from minirl.sync.sharded import full_tensor

EXERCISE = "4.2"


def gather_by_layer(named_weights):
    whole = [(name, full_tensor(t)) for name, t in named_weights]
    layer, key = [], None
    for name, tensor in whole:
        if layer and layer_key(name) != key:
            yield layer
            layer = []
        key = layer_key(name)
        layer.append((name, tensor))
    if layer:
        yield layer
