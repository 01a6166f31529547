"""float32 CPU linears through oneDNN: same results as torch's own path, gradients intact."""

import pytest
import torch

from cachegraft_cli import onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN linear")


def test_loaded_models_route_their_linears_and_match_torch(tiny_models):
    model = tiny_models["receiver"].model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is onednn.OneDnnLinear for m in linears)
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.inference_mode():
        routed = model(ids).logits
        for m in linears:
            m.__class__ = torch.nn.Linear
        try:
            plain = model(ids).logits
        finally:
            onednn.route_linears(model)
    torch.testing.assert_close(routed, plain, rtol=1e-4, atol=1e-4)


def test_gradients_take_torch_path_and_are_exact():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    routed = torch.nn.Linear(16, 8)
    routed.load_state_dict(layer.state_dict())
    assert onednn.route_linears(routed) == 1
    x = torch.randn(5, 16, requires_grad=True)
    layer(x).square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    routed(x).square().sum().backward()
    assert torch.equal(x.grad, grad) and torch.equal(routed.weight.grad, layer.weight.grad)


def test_switch_off_and_other_dtypes(monkeypatch):
    monkeypatch.setenv(onednn.ENV, "0")
    assert onednn.route_linears(torch.nn.Linear(4, 4)) == 0
    monkeypatch.delenv(onednn.ENV)
    half = torch.nn.Sequential(torch.nn.Linear(4, 4).bfloat16(), torch.nn.Linear(4, 4))
    assert onednn.route_linears(half) == 1 and type(half[0]) is torch.nn.Linear
