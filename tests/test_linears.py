"""The CPU layouts of the target's linears compute nn.Linear's product, and each device and dtype gets its own."""
import pytest
import torch
import torch.nn.functional as F

from eagle_ray.model.device import cpu_has_fast_bf16, packed_available
from eagle_ray.model.linears import InputMajorLinear, PackedLinear, lay_out_linears, layout_of, scorer
from eagle_ray.model.numerics import numerics_for

needs_onednn = pytest.mark.skipif(not packed_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("layout", [InputMajorLinear, pytest.param(PackedLinear, marks=needs_onednn)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_layout_computes_the_linear(layout, rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 20)
    x = torch.randn(2, rows, 48)
    assert torch.allclose(layout(linear.weight, linear.bias)(x), linear(x), atol=1e-5)


@needs_onednn
def test_laying_out_a_model_swaps_every_linear_and_keeps_the_named_dense_weight():
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU())   # 2^18 weights: packed
    model.lm_head = torch.nn.Linear(512, 600, bias=False)
    dense = model.lm_head.weight
    lay_out_linears(model, "packed", keep_dense=("lm_head",))
    assert isinstance(model[0], PackedLinear) and not hasattr(model[0], "weight")
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.weight is not None
    assert torch.equal(model.lm_head.weight, dense)
    h = torch.randn(3, 512)
    assert torch.allclose(scorer(dense, "packed")(h), F.linear(h, dense), atol=1e-4)
    assert torch.equal(scorer(dense, "native")(h), F.linear(h, dense))


def test_a_small_fp32_weight_stays_input_major_where_the_layout_says_packed():
    """oneDNN's call costs more than a product of fewer than the CPU's ``packed_min_weights`` takes."""
    model = torch.nn.Sequential(torch.nn.Linear(576, 192), torch.nn.Linear(192, 576))   # 576 -> 192: 135M's k/v
    lay_out_linears(model, "packed")
    assert all(isinstance(m, InputMajorLinear) for m in model)
    assert isinstance(scorer(torch.randn(600, 64), "packed").linear, InputMajorLinear)
    small = torch.zeros(8, 8)
    assert layout_of("packed", small) == "input_major" and layout_of("native", small) == "native"
    assert layout_of("packed", small.bfloat16()) == "packed"      # measured in fp32 only
    assert layout_of("packed", torch.zeros(512, 512)) == "packed"


def test_each_device_and_dtype_gets_its_layout():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert numerics_for(cpu, torch.float32).cpu_linears == ("packed" if packed_available() else "input_major")
    fast_bf16 = packed_available() and cpu_has_fast_bf16()   # packed bf16 is faster only with native bf16
    assert numerics_for(cpu, torch.bfloat16).cpu_linears == ("packed" if fast_bf16 else "native")
    assert numerics_for(cpu, torch.float16).cpu_linears == "native"   # emulated: nn.Linear's layout is the fast one
    assert numerics_for(cuda, torch.bfloat16).cpu_linears == "native"
    assert numerics_for(cuda, torch.float32, cpu_linears="packed").cpu_linears == "native"   # a CPU-only switch
    assert numerics_for(cpu, torch.float32, cpu_linears="native").cpu_linears == "native"
