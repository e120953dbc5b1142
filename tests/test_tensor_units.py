"""α is fitted and applied on the same tensors: the unit a plan applies to a tensor is the unit whose replay runs it.

`diag alpha` solves α for a unit by replaying that module (`modules.get_module`), so every parameter the replay
uses must get that unit's α in `Plan.rule_for`, and no other tensor may. Checked on every supported architecture,
through the tensor table built from the checkpoint (as `diag merge` builds it). Before the tensor table, BERT's
`output.LayerNorm` (run by the MLP unit) fell to the plan's "rest" rule.
"""

from __future__ import annotations

import pytest

from submerge.diagnostics.modules import find_architecture, find_submodules, module_parameter_names
from submerge.diagnostics.tensors import TensorTable
from submerge.merge.plan import Plan

ARCHITECTURES = ["llama", "qwen2", "mistral", "gemma3", "gpt2", "bert"]


@pytest.mark.parametrize("granularity, levels", [("layer", ("layer",)), ("attn-mlp", ("attn", "mlp"))])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_alpha_is_applied_to_the_tensors_its_unit_replays(toy_kit, name, granularity, levels):
    kit = toy_kit(name)
    base, _ = kit.load()
    model = base.model
    table = TensorTable.from_checkpoint(str(kit.base_dir))
    units = find_submodules(model, levels, arch=find_architecture(model))
    # one distinct α per unit, so a tensor given another unit's α is caught
    alpha = {unit.name: {"a": 0.1 + i, "b": -0.5 - i} for i, unit in enumerate(units)}
    plan = Plan(base_model=str(kit.base_dir), finetuned={"a": "A", "b": "B"}, granularity=granularity, alpha=alpha,
                rest={"method": "weights", "weights": {"a": 7.0, "b": 7.0}})
    fitted = {}
    for unit in units:
        for parameter in module_parameter_names(model, unit.path).values():
            fitted[base.checkpoint_name(parameter)] = unit.name
    for info in table:
        weights = plan.rule_for(info).weights
        if info.name in fitted:
            assert weights == alpha[fitted[info.name]], f"{name}: {info.name} is replayed by {fitted[info.name]}"
        else:
            assert weights == {"a": 7.0, "b": 7.0}, f"{name}: {info.name} is in no {granularity} unit"
    assert set(fitted) <= set(table.names())
