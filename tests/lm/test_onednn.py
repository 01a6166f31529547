"""float32 CPU linears through oneDNN: same results as torch's own path, gradients intact."""

import pytest
import torch

from cachegraft_cli.lm import onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN linear")


def test_routed_model_matches_torch(tiny_models):
    model = tiny_models["receiver"].model
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.inference_mode():
        plain = model(ids).logits
        routed_layers = onednn.route_linears(model, min_weights=0)  # tiny layers: below the default size
        try:
            routed = model(ids).logits
        finally:
            for m in model.modules():
                if type(m) is onednn.OneDnnLinear:
                    m.__class__ = torch.nn.Linear
    assert routed_layers == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) > 0
    torch.testing.assert_close(routed, plain, rtol=1e-4, atol=1e-4)


def test_only_large_float32_layers_are_routed(monkeypatch):
    layers = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 64),
                                 torch.nn.Linear(1024, 1024).bfloat16())
    assert onednn.route_linears(layers) == 1
    assert [type(m) for m in layers] == [onednn.OneDnnLinear, torch.nn.Linear, torch.nn.Linear]
    monkeypatch.setenv(onednn.ENV, "0")
    assert onednn.route_linears(torch.nn.Linear(1024, 1024)) == 0


def test_gradients_take_torch_path_and_are_exact():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    routed = torch.nn.Linear(16, 8)
    routed.load_state_dict(layer.state_dict())
    assert onednn.route_linears(routed, min_weights=0) == 1
    x = torch.randn(5, 16, requires_grad=True)
    layer(x).square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    routed(x).square().sum().backward()
    assert torch.equal(x.grad, grad) and torch.equal(routed.weight.grad, layer.weight.grad)
