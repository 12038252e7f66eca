"""AttentionReplay hands a layer's attention outputs back only where that is exact."""

import torch

from moecompress.sweep.attention_replay import AttentionReplay


class Layer(torch.nn.Module):
    """An attention-like module, then an MoE-like one (or the other way round with ``moe_first``)."""

    def __init__(self, moe_first: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.attention, self.moe, self.moe_first = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), moe_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe_first:
            return self.attention(self.moe(x))
        return self.moe(self.attention(x))


class Counting(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


def _watched(layer: Layer, inputs: list[torch.Tensor]) -> tuple[AttentionReplay, list[torch.Tensor]]:
    replay = AttentionReplay(layer.attention, layer.moe)
    with torch.no_grad():
        outputs = [layer(x) for x in inputs]
    replay.stop_watching()
    return replay, outputs


def test_the_recomputing_forward_takes_the_recorded_attention_and_changes_nothing_else():
    layer = Layer()
    layer.attention = Counting(layer.attention)
    inputs = [torch.randn(3, 4), torch.randn(2, 4)]
    replay, _ = _watched(layer, inputs)
    assert replay.replayable(len(inputs))
    with torch.no_grad():
        layer.moe.weight.mul_(2)
        expected = [layer.moe(layer.attention.inner(x)) for x in inputs]
        before = layer.attention.calls
        with replay.replaying():
            got = [layer(x) for x in inputs]
    assert layer.attention.calls == before
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert "forward" not in vars(layer.attention)


def test_an_output_modified_in_place_is_computed_again():
    layer = Layer()
    inputs = [torch.randn(3, 4)]
    replay, _ = _watched(layer, inputs)
    replay.outputs[0].add_(1.0)
    with torch.no_grad():
        expected = layer(inputs[0])
        with replay.replaying():
            got = layer(inputs[0])
    assert torch.equal(got, expected)


def test_an_attention_after_or_around_the_moe_block_is_not_replayed():
    inputs = [torch.randn(3, 4)]
    replay, _ = _watched(Layer(moe_first=True), inputs)
    assert not replay.replayable(len(inputs))
    layer = Layer()
    nested = AttentionReplay(layer, layer.moe)
    with torch.no_grad():
        layer(inputs[0])
    nested.stop_watching()
    assert not nested.replayable(len(inputs))
