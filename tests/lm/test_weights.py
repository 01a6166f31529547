"""Weight-only int8 / int4 linears (`lm/weights.py`): what they compute, what they convert, and the
option's path from `open_store(weights=...)` to the loaded receiver (tiny models)."""

import pytest
import torch

import cachegraft_cli as cg
from cachegraft_cli.errors import UsageError
from cachegraft_cli.lm import weights
from cachegraft_cli.lm.weights import INT4_GROUP, Int4Linear, Int8Linear, check_weights, quantize_linears

pytestmark = pytest.mark.skipif(not (weights.available("int8") and weights.available("int4")),
                                reason="this torch build lacks the weight-only CPU kernels")


def _int8_reference(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(1, keepdim=True) / 127
    return torch.round(w / scale) * scale


def _int4_reference(w: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    g = w.view(w.shape[0], -1, group)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (high - low) / 15
    return (torch.round((g - low) / step).clamp(0, 15) * step + low).view_as(w)


@pytest.mark.parametrize("cls, reference", [(Int8Linear, _int8_reference), (Int4Linear, _int4_reference)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_computes_with_its_dequantised_weights(cls, reference, dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48).to(dtype)
    x = torch.randn(2, weights.DECODE_ROWS // 2, 96, dtype=dtype)  # a decode step of a batch
    layer = cls(linear)
    got = layer(x)
    want = x.float() @ reference(linear.weight.float()).t() + linear.bias.float()
    assert got.shape == (*x.shape[:2], 48) and got.dtype == dtype
    prompt = torch.randn(1, weights.DECODE_ROWS + 1, 96, dtype=dtype)  # more rows: the exact weights
    assert torch.equal(layer(prompt), linear(prompt))
    # the kernels multiply in bf16 (float32 enters them rounded to bf16): agreement to its 8 bits
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_float32_steps_enter_the_kernels_in_bf16(cls):
    """The kernels run a scalar loop on float32 activations (several times slower than bf16)."""
    torch.manual_seed(0)
    layer = cls(torch.nn.Linear(96, 48))
    x = torch.randn(3, 96)
    assert layer.kernel_dtype == torch.bfloat16
    got = layer(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, layer.product(x.bfloat16()).float() + layer.bias)
    assert cls(torch.nn.Linear(96, 48).to(torch.bfloat16)).kernel_dtype == torch.bfloat16


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_a_strided_batch_computes_as_its_contiguous_copy(cls):
    torch.manual_seed(0)
    layer = cls(torch.nn.Linear(96, 48).to(torch.bfloat16))
    hidden = torch.randn(3, 5, 96, dtype=torch.bfloat16)
    last = hidden[:, -1:, :]  # what a batched decode step hands the LM head: not contiguous
    assert not last.reshape(-1, 96).is_contiguous()
    assert torch.equal(layer(last), layer(last.contiguous()))


@pytest.mark.parametrize("cls, rows", [(Int8Linear, (48, 16, 16)), (Int4Linear, (128, 64, 32))])
def test_stacked_layers_give_what_each_gives_and_share_its_rows(cls, rows):
    """q/k/v (or gate/up) as one kernel call: the same numbers, and no weight held twice."""
    torch.manual_seed(0)
    layers = [cls(torch.nn.Linear(96, n).to(torch.bfloat16)) for n in rows]
    x = torch.randn(1, 1, 96, dtype=torch.bfloat16)
    separate = torch.cat([m(x) for m in layers], dim=-1)
    assert cls.can_stack(layers)
    stacked = cls.stacked(layers)
    assert torch.equal(stacked.quantised(x), separate)
    assert torch.equal(torch.cat([m(x) for m in layers], dim=-1), separate)  # the layers still compute alone
    first = next(iter(cls.ROWS))  # the packed weights: views into the stacked buffer
    assert getattr(layers[1], first).untyped_storage().data_ptr() == \
        getattr(stacked, first).untyped_storage().data_ptr()


def test_int4_layers_stack_only_on_whole_row_blocks():
    """The int4 packing interleaves rows 64 at a time: a 32-row layer before another would put the
    second layer's rows in the first one's block."""
    torch.manual_seed(0)
    short, long = (Int4Linear(torch.nn.Linear(96, n).to(torch.bfloat16)) for n in (32, 64))
    assert not Int4Linear.can_stack([short, long]) and Int4Linear.can_stack([long, short])
    assert not Int4Linear.can_stack([long, Int4Linear(torch.nn.Linear(64, 64).to(torch.bfloat16))])
    assert not Int8Linear.can_stack([Int8Linear(torch.nn.Linear(96, 16)), long])


def test_quantisation_error_is_bounded():
    torch.manual_seed(1)
    linear = torch.nn.Linear(256, 64, bias=False)
    x = torch.randn(weights.DECODE_ROWS, 256)
    with torch.no_grad():
        exact = linear(x)
        rel = {cls.__name__: float((cls(linear)(x) - exact).norm() / exact.norm()) for cls in (Int8Linear, Int4Linear)}
    assert 0 < rel["Int8Linear"] < 0.01 and rel["Int8Linear"] < rel["Int4Linear"] < 0.1, rel


def test_quantize_linears_converts_what_the_kernels_take():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24),
                                torch.nn.Linear(48, 16))
    assert quantize_linears(model, "as-loaded") == 0 and type(model[0]) is torch.nn.Linear
    # int4: 24 outputs are not a multiple of the kernel's 16, 48 inputs not whole groups of 32
    assert quantize_linears(model, "int4") == 1
    assert [type(m) for m in model] == [Int4Linear, torch.nn.ReLU, torch.nn.Linear, torch.nn.Linear]
    assert quantize_linears(model, "int4") == 0  # a converted layer's dense twin is not converted again
    other = torch.nn.Sequential(torch.nn.Linear(48, 24), torch.nn.Linear(24, 16))
    assert quantize_linears(other, "int8") == 2 and all(type(m) is Int8Linear for m in other)


def test_onednn_layers_are_converted_too():
    from cachegraft_cli.lm import onednn

    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    model[0].__class__ = onednn.OneDnnLinear  # what `route_linears` makes of large float32 layers
    assert quantize_linears(model, "int8") == 1 and type(model[0]) is Int8Linear


@pytest.mark.parametrize("scheme, device, words", [("int3", "cpu", "unknown weights"),
                                                   ("int8", "cuda", "CPU only"), ("int4", "cuda:1", "CPU only")])
def test_check_weights_refuses(scheme, device, words):
    with pytest.raises(UsageError) as err:
        check_weights(scheme, device)
    assert words in err.value.message and err.value.hint
    check_weights("as-loaded", "cuda")  # as loaded runs anywhere
    check_weights(None, "mps")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_receiver_decodes_with_quantised_weights(tiny_dirs, scheme):
    from cachegraft_cli.lm.generation import GenerationOptions, Prompt, generate
    from cachegraft_cli.lm.models import load_causal_lm

    plain = load_causal_lm(str(tiny_dirs["receiver"]), device="cpu", dtype="float32")
    lm = load_causal_lm(str(tiny_dirs["receiver"]), device="cpu", dtype="float32", weights=scheme)
    kind = Int8Linear if scheme == "int8" else Int4Linear
    layers = [m for m in lm.model.modules() if isinstance(m, kind)]
    assert len(layers) == sum(type(m) is torch.nn.Linear for m in plain.model.modules())  # every one, lm_head too
    assert lm.identity["weights"] == scheme and lm.identity["fingerprint"] == plain.identity["fingerprint"]
    ids = list(range(5, 30))
    with torch.inference_mode():  # a prompt reads the exact weights; a few rows, the quantised ones
        assert torch.equal(plain.model(torch.tensor([ids])).logits, lm.model(torch.tensor([ids])).logits)
        short = torch.tensor([ids[:4]])
        a, b = plain.model(short).logits.float(), lm.model(short).logits.float()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert not torch.equal(a, b) and cos > (0.999 if scheme == "int8" else 0.85), float(cos)
    out = generate(lm, Prompt.plain(None, ids, 0), GenerationOptions(max_new_tokens=6))
    assert len(out.token_ids) > 0


def test_a_batch_of_rows_decodes_through_int4_weights(tiny_dirs):
    """`serve` decodes several answers in one step: the LM head then reads a strided view."""
    from cachegraft_cli.lm.batching import Row, RunningBatch
    from cachegraft_cli.lm.generation import GenerationOptions, Prompt
    from cachegraft_cli.lm.models import load_causal_lm

    lm = load_causal_lm(str(tiny_dirs["receiver"]), device="cpu", dtype="float32", weights="int4")
    prompts = [Prompt.plain(None, list(range(5, 5 + n)), 0) for n in (12, 20, 7)]
    rows = [Row(p, GenerationOptions(6)) for p in prompts]
    batch = RunningBatch(lm)
    ended = batch.admit(rows)
    while len(batch):
        ended += batch.step()
    assert sorted(map(id, ended)) == sorted(map(id, rows))
    assert all(0 < len(row.out) <= 6 for row in rows)


def test_store_answers_with_the_weights_asked_for(tiny_dirs, tmp_path, monkeypatch):
    import cachegraft_cli.lm.models as models

    path = tmp_path / "store"
    cg.encode([{"id": "a", "text": "Harbor town was founded in 1820 by fishermen."}], path,
              models=cg.Models(receiver=str(tiny_dirs["receiver"]), dtype="float32"))
    cg.index(path)
    loaded = []
    real = models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda spec, **kw: loaded.append(real(spec, **kw)) or loaded[-1])
    answer = cg.open_store(path, device="cpu", weights="int8").ask("who founded harbor town?", k=1, max_new_tokens=3)
    assert answer.sources[0].id == "a" and answer.tokens["generated"] > 0
    assert [lm.identity.get("weights") for lm in loaded] == ["int8"]  # the receiver, converted
    assert any(isinstance(m, Int8Linear) for m in loaded[0].model.modules())
