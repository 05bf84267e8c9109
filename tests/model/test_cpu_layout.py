import torch

from conftest import tiny_drafter, tiny_target_model
from dflash.model import cpu_layout
from dflash.model.target import TargetModel


def test_column_major_keeps_values_and_shape():
    weight = torch.randn(6, 4)
    col = cpu_layout.column_major(weight)
    assert torch.equal(col, weight) and col.shape == (6, 4)
    assert col.t().is_contiguous() and not col.is_contiguous()


def test_layout_follows_the_measurement_and_keeps_outputs_and_tied_weights(monkeypatch):
    model = tiny_target_model("qwen3")
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied, as the embedded target
    target = TargetModel(model)
    drafter = tiny_drafter(target)
    ids = torch.randint(0, 100, (1, 9))
    before = target.model(ids).logits

    monkeypatch.setattr(cpu_layout, "column_major_is_faster", lambda weight, rows=16: weight.shape[0] != 128)
    changed = cpu_layout.use_fast_layout([target.model, drafter])
    linears = [m for mod in (target.model, drafter) for m in mod.modules() if isinstance(m, torch.nn.Linear)]
    assert changed == len({id(m.weight) for m in linears if m.weight.shape[0] != 128})
    for m in linears:
        assert m.weight.t().is_contiguous() == (m.weight.shape[0] != 128)
    head, embed = target.model.get_output_embeddings(), target.model.get_input_embeddings()
    assert head.weight is embed.weight  # still one parameter
    assert torch.allclose(target.model(ids).logits, before, atol=1e-5)
    assert cpu_layout.use_fast_layout([target.model, drafter]) == 0  # already laid out

