import torch

from conftest import tiny_drafter, tiny_target_model
from dflash.model import cpu_layout
from dflash.model.target import TargetModel


def test_column_major_keeps_values_and_shape():
    weight = torch.randn(6, 4)
    col = cpu_layout.column_major(weight)
    assert torch.equal(col, weight) and col.shape == (6, 4)
    assert col.t().is_contiguous() and not col.is_contiguous()


def test_layout_follows_the_measurement_and_keeps_outputs_and_the_model_savable(monkeypatch, tmp_path):
    model = tiny_target_model("qwen3")
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied, as the embedded target
    target = TargetModel(model)
    drafter = tiny_drafter(target)
    ids = torch.randint(0, 100, (1, 9))
    before = target.model(ids).logits

    monkeypatch.setattr(cpu_layout, "column_major_is_faster", lambda weight, rows=16: tuple(weight.shape) != (64, 128))
    linears = [m for mod in (target.model, drafter) for m in mod.modules() if isinstance(m, torch.nn.Linear)]
    expected = len({id(m.weight) for m in linears if tuple(m.weight.shape) != (64, 128)})
    changed = cpu_layout.use_fast_layout([target.model, drafter])
    assert changed == expected
    for m in linears:
        assert m.weight.t().is_contiguous() == (tuple(m.weight.shape) != (64, 128))
    head, embed = target.model.get_output_embeddings(), target.model.get_input_embeddings()
    assert head.weight is not embed.weight and head.weight.t().is_contiguous()  # its own column-major copy
    assert embed.weight.is_contiguous()  # embedding lookups keep contiguous rows
    assert torch.allclose(target.model(ids).logits, before, atol=1e-5)
    assert cpu_layout.use_fast_layout([target.model, drafter]) == 0  # already laid out
    target.model.save_pretrained(tmp_path)  # transformers cannot follow storage shared by a strided tensor
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.allclose(reloaded(ids).logits, before, atol=1e-5)

