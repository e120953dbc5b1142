"""mergekit recipes in (`submerge.merge.recipe`): each shared method gives the tensors of mergekit's equations, every
parameter is resolved as mergekit resolves it (per model, top level, filters, one value per layer), what submerge
does not do is refused by key, and a plan's mergekit export imports back to the same config and the same merge.

The reference below is written from mergekit 0.1.5's equations (generalised task arithmetic: per-model weights w_t,
magnitude / outlier sparsification, sign consensus on Σ w_t τ̂_t with 0 counted as +, division by the weights that
enter, λ; linear: Σ w_i θ_i / Σ w_i), in float64 on the toy checkpoints, whose random updates have no equal
magnitudes and no zero sums: there the equations decide every entry. benchmarks/scale.py compares with mergekit
itself on the 7B-width slice.
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from submerge.diagnostics import toy
from submerge.merge.plan import Plan
from submerge.merge.recipe import Recipe, RecipeError, evaluate
from submerge.merge.run import run_merge
from submerge.merge.writer import write_merge

TASKS = ("math", "code", "chat")
LAYERS = 3


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_kit")
    base = toy.build_model(root / "base", "llama", layers=LAYERS, hidden=32)
    tuned = toy.perturbed_finetunes(base, TASKS)
    return {"root": root, "base": base, "tuned": tuned}


def _tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _config(kit, method: str, per_model: list[dict], parameters: dict | None = None, **extra) -> dict:
    models = [{"model": str(kit["tuned"][t]), "parameters": p} for t, p in zip(TASKS, per_model)]
    return {"merge_method": method, "base_model": str(kit["base"]), "models": models,
            "parameters": parameters or {}, "dtype": "float32", **extra}


def _merge(kit, config: dict, tmp_path, name: str = "merged") -> dict[str, torch.Tensor]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return _tensors(run_merge(tmp_path / name, recipe=path, progress=False))


# ------------------------------------------------------------------ mergekit's equations, written out


def _magnitude(delta: torch.Tensor, density: float) -> torch.Tensor:
    if density >= 1:
        return delta
    keep = max(1, int(density * delta.numel()))
    order = torch.argsort(delta.abs().reshape(-1), descending=True)[:keep]
    mask = torch.zeros(delta.numel(), dtype=delta.dtype)
    mask[order] = 1
    return delta * mask.reshape(delta.shape)


def _outliers(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    if density >= 1:
        return delta
    n = delta.numel()
    target, top = int(density * n), int(gamma * n)
    bottom = max(0, n - target - top)
    order = torch.argsort(delta.abs().reshape(-1))
    mask = torch.zeros(n, dtype=delta.dtype)
    mask[order[bottom:bottom + target]] = 1
    return delta * mask.reshape(delta.shape)


def _reference(kit, method: str, weights, densities, *, normalize: bool, scale: float = 1.0, gammas=None,
               base_weight: float | None = None) -> dict[str, torch.Tensor]:
    base = load_file(str(kit["base"] / "model.safetensors"))
    tuned = [load_file(str(kit["tuned"][t] / "model.safetensors")) for t in TASKS]
    merged = {}
    for name, theta0 in base.items():
        theta0 = theta0.double()
        if method == "linear":
            inputs = [sd[name].double() for sd in tuned] + ([theta0] if base_weight is not None else [])
            w = list(weights) + ([base_weight] if base_weight is not None else [])
            total = sum(wi * x for wi, x in zip(w, inputs))
            merged[name] = total / sum(w) if normalize else total
            continue
        deltas = []
        for i, sd in enumerate(tuned):
            delta = sd[name].double() - theta0
            if method == "ties":
                delta = _magnitude(delta, densities[i])
            elif method == "breadcrumbs":
                delta = _outliers(delta, densities[i], gammas[i])
            deltas.append(delta)
        w = torch.tensor(weights, dtype=torch.float64).reshape(-1, *([1] * theta0.ndim))
        stack = torch.stack(deltas) * w
        if method in ("ties", "dare_ties", "della"):
            majority = torch.where(stack.sum(0) >= 0, 1.0, -1.0)
            mask = (stack.sign() == majority).double()
            mixed, divisor = (stack * mask).sum(0), (w * mask).sum(0)
            divisor[divisor == 0] = 1
        else:
            mixed, divisor = stack.sum(0), w.sum()
            divisor = divisor if abs(float(divisor)) >= 1e-8 else 1.0
        merged[name] = theta0 + scale * (mixed / divisor if normalize else mixed)
    return merged


def _assert_close(ours: dict, theirs: dict, tolerance: float = 2e-6) -> None:
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        difference = float((tensor.double() - theirs[name]).abs().max())
        assert difference <= tolerance * max(1.0, float(theirs[name].abs().max())), (name, difference)


CASES = {
    "linear": ("linear", [1.0, 2.0, 0.5], None, {}),
    "task_arithmetic": ("task_arithmetic", [1.0, 0.5, -0.25], None, {"lambda": 0.7}),
    "task_arithmetic normalize": ("task_arithmetic", [1.0, 0.5, 2.0], None, {"normalize": True}),
    "ties": ("ties", [1.0, 0.5, 1.5], [0.3, 0.5, 0.2], {"lambda": 0.9}),
    "ties disjoint sum": ("ties", [1.0, 0.5, 1.5], [0.3, 0.5, 0.2], {"normalize": False}),
    "breadcrumbs": ("breadcrumbs", [1.0, 0.5, 1.5], [0.3, 0.6, 0.2], {"normalize": True}),
    "dare_ties density 1": ("dare_ties", [1.0, 0.5, 1.5], [1.0, 1.0, 1.0], {}),
    "dare_linear density 1": ("dare_linear", [1.0, 0.5, 1.5], [1.0, 1.0, 1.0], {"lambda": 0.5}),
    "della density 1": ("della", [1.0, 0.5, 1.5], [1.0, 1.0, 1.0], {}),
}
DEFAULT_NORMALIZE = {"linear": True, "task_arithmetic": False, "ties": True, "dare_ties": False, "dare_linear": False,
                     "breadcrumbs": False, "della": True}


@pytest.mark.parametrize("case", list(CASES))
def test_recipe_gives_mergekits_equations(kit, tmp_path, case):
    method, weights, densities, parameters = CASES[case]
    gammas = [0.05, 0.01, 0.02]
    per_model = [{"weight": w} for w in weights]
    for i, entry in enumerate(per_model):
        if densities is not None:
            entry["density"] = densities[i]
        if method == "breadcrumbs" and i != 1:
            entry["gamma"] = gammas[i]  # model 1: mergekit's default 0.01
    config = _config(kit, method, per_model, parameters)
    if method == "linear":
        config["parameters"]["weight"] = 0.75  # the named base is averaged in with the top-level weight
    ours = _merge(kit, config, tmp_path)
    expected = _reference(kit, method, weights, densities, normalize=parameters.get("normalize",
                          DEFAULT_NORMALIZE[method]), scale=parameters.get("lambda", 1.0), gammas=gammas,
                          base_weight=0.75 if method == "linear" else None)
    _assert_close(ours, expected)


def test_linear_without_base_model_takes_the_first_model_as_reference(kit, tmp_path):
    config = _config(kit, "linear", [{"weight": 1.0}, {"weight": 2.0}, {"weight": 0.5}])
    del config["base_model"]
    recipe = Recipe.from_config(config)
    assert recipe.base == str(kit["tuned"]["math"]) and list(recipe.finetuned()) == ["code", "chat"]
    _assert_close(_merge(kit, config, tmp_path), _reference(kit, "linear", [1.0, 2.0, 0.5], None, normalize=True))


def test_filters_gradients_and_scopes_resolve_as_mergekit(kit, tmp_path):
    """Model 0: filtered settings (an MLP gradient, one value for attention, a catch-all); model 1: no weight of its
    own, so the top-level one; model 2: a filter that matches nothing falls back to the top level."""
    weight0 = [{"filter": "mlp", "value": [0.1, 0.2, 0.3]}, {"filter": "self_attn", "value": 0.5}, {"value": 1.0}]
    config = _config(kit, "task_arithmetic", [{"weight": weight0}, {}, {"weight": [{"filter": "nowhere",
                                                                                   "value": 9.0}]}],
                     {"weight": 0.25, "lambda": 2.0})
    ours = _merge(kit, config, tmp_path)
    base = load_file(str(kit["base"] / "model.safetensors"))
    tuned = [load_file(str(kit["tuned"][t] / "model.safetensors")) for t in TASKS]
    for name, theta0 in base.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        first = [0.1, 0.2, 0.3][layer] if "mlp" in name and layer >= 0 else (
            0.1 if "mlp" in name else 0.5 if "self_attn" in name else 1.0)
        expected = theta0.double() + 2.0 * sum(w * (sd[name].double() - theta0.double())
                                               for w, sd in zip([first, 0.25, 0.25], tuned))
        assert torch.allclose(ours[name].double(), expected, atol=1e-6), name


def test_evaluate_known_answers():
    assert evaluate(0.5, "x", 1, 3, "k") == 0.5 and evaluate(True, "x", -1, 3, "k") is True
    assert [evaluate([1.0, 2.0, 3.0], "x", layer, 3, "k") for layer in (0, 1, 2, -1)] == [1.0, 2.0, 3.0, 1.0]
    assert evaluate([7.0], "x", 2, 3, "k") == 7.0
    conditions = [{"filter": "mlp", "value": 1.0}, {"filter": "*", "value": 2.0}]
    assert evaluate(conditions, "layers.0.mlp.up", 0, 3, "k") == 1.0
    assert evaluate(conditions, "layers.0.self_attn.q", 0, 3, "k") == 2.0
    assert evaluate({"filter": "mlp", "value": 4.0}, "embed", -1, 3, "k") is None
    with pytest.raises(RecipeError, match=r"models\[0\]\.parameters\.weight\[0\]\.value: a gradient of 2 values over "
                                          r"3 layers"):
        evaluate([{"filter": "mlp", "value": [1.0, 2.0]}], "layers.1.mlp.up", 1, 3, "models[0].parameters.weight")


REFUSED = [
    ({"slices": []}, "'slices': slices"),
    ({"modules": {}}, "'modules': modules are not supported"),
    ({"tokenizer_source": "union"}, "'tokenizer_source: union' is not supported"),
    ({"tokenizer": {"source": "base"}}, "'tokenizer': a tokenizer configuration"),
    ({"chat_template": "chatml"}, "'chat_template'"),
    ({"merge_method": "slerp"}, "merge_method 'slerp' has no counterpart"),
    ({"merge_method": "frobnicate"}, "unknown merge_method 'frobnicate'"),
    ({"base_modle": "x"}, "unknown key 'base_modle'"),
    ({"dtype": "int8"}, "dtype 'int8' is not supported"),
    ({"parameters": {"gamma": 0.1}}, "parameters.gamma: unknown parameter for ties"),
    ({"parameters": {"rescale": True}}, "parameters.rescale: True is not supported for ties"),
    ({"parameters": {"normalize": "yes"}}, "parameters.normalize must be true or false"),
    ({"model0": {"normalize": False}}, "models[0].parameters.normalize: 'normalize' applies to the whole merge"),
    ({"model0": {"weight": "heavy"}}, "models[0].parameters.weight must be a number"),
    ({"model0": {"weight": [{"filter": "mlp"}]}}, "models[0].parameters.weight[0]: a conditional setting has 'value'"),
    ({"model0": {"weight": [1.0, 2.0]}}, "models[0].parameters.weight: a gradient of 2 values over 3 layers"),
    ({"model0": None, "models": [{"model": "a@main", "parameters": {"weight": 1}}]}, "revisions (@REV)"),
    ({"base_model": None}, "'ties' needs 'base_model'"),
    ({"model0": {"density": 0.5}}, "no 'weight' for tensor"),
]


@pytest.mark.parametrize(("change", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_unsupported_recipes_are_refused_by_key(kit, change, message):
    config = _config(kit, "ties", [{"weight": 1.0, "density": 0.5} for _ in TASKS])
    change = dict(change)
    if "model0" in change:
        config["models"][0]["parameters"] = change.pop("model0")
    for key, value in change.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with pytest.raises(RecipeError) as error:
        recipe = Recipe.from_config(config)
        from submerge.diagnostics.tensors import TensorTable

        recipe.rules(TensorTable.from_checkpoint(str(kit["base"])))
    assert message in str(error.value)


def test_method_specific_refusals(kit):
    from submerge.diagnostics.tensors import TensorTable

    table = TensorTable.from_checkpoint(str(kit["base"]))
    cases = [
        (_config(kit, "dare_ties", [{"weight": 1.0, "density": 0.5}] * 3, {"rescale": False}),
         "rescale: false is not DARE"),
        (_config(kit, "task_arithmetic", [{"weight": 1.0, "density": 0.5}] * 3), "'density' has no effect"),
        (_config(kit, "linear", [{"weight": 0.5}] * 3, {"normalize": False, "weight": 0.0}), "sum to 1.5, not 1"),
        (_config(kit, "linear", [{"weight": 1.0}] * 3), "no 'weight' for tensor"),  # the named base needs one
        (_config(kit, "della", [{"weight": 1.0, "density": 0.9, "epsilon": 0.2}] * 3), "density ± epsilon"),
    ]
    for config, message in cases:
        with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
            Recipe.from_config(config).rules(table)


def test_dare_recipe_drops_and_rescales_as_the_paper(kit, tmp_path):
    """dare_linear, one model with density 0.5 and weight 1 (the others weight 0): each entry of τ is kept with
    probability 0.5 and rescaled to 2τ, or dropped."""
    config = _config(kit, "dare_linear", [{"weight": 1.0, "density": 0.5}, {"weight": 0.0}, {"weight": 0.0}])
    ours = _merge(kit, config, tmp_path)
    base = load_file(str(kit["base"] / "model.safetensors"))
    tuned = load_file(str(kit["tuned"]["math"] / "model.safetensors"))
    kept = total = 0
    for name, theta0 in base.items():
        tau, merged = tuned[name].double() - theta0.double(), ours[name].double() - theta0.double()
        is_kept = (merged - 2 * tau).abs() <= 1e-5 * tau.abs().max()
        assert bool((is_kept | (merged.abs() <= 1e-7)).all()), name
        kept, total = kept + int((is_kept & (tau != 0)).sum()), total + int((tau != 0).sum())
    assert abs(kept / total - 0.5) < 5 * math.sqrt(0.25 / total)


@pytest.mark.parametrize("granularity", ["attn-mlp", "layer", "model"])
def test_plan_export_import_export_is_the_identity_and_the_same_merge(kit, tmp_path, granularity):
    finetuned = {t: str(kit["tuned"][t]) for t in TASKS}
    generator = torch.Generator().manual_seed(3)

    def alpha() -> dict:
        return {t: float(torch.rand((), generator=generator)) for t in TASKS}

    units = {"model": ["model"], "layer": [f"layers.{j}" for j in range(LAYERS)],
             "attn-mlp": [f"layers.{j}.{p}" for j in range(LAYERS) for p in ("attn", "mlp")]}[granularity]
    plan = Plan(str(kit["base"]), finetuned, granularity, {unit: alpha() for unit in units})
    exported, notes = plan.to_mergekit(LAYERS)
    assert notes == []
    path = tmp_path / "exported.yaml"
    path.write_text(yaml.safe_dump(exported, sort_keys=False))
    recipe = Recipe.load(path)
    assert recipe.to_mergekit() == exported  # export → import → export
    assert Recipe.from_config(recipe.to_mergekit()).to_mergekit() == exported
    assert recipe.finetuned() == finetuned
    imported = _tensors(run_merge(tmp_path / "imported", recipe=path, progress=False))
    planned = _tensors(write_merge(str(kit["base"]), finetuned, tmp_path / "planned", plan.rule_for, progress=False))
    assert set(imported) == set(planned)
    for name in planned:
        assert torch.equal(imported[name], planned[name]), name  # the same weights: bitwise the plan's merge


def test_diag_merge_takes_a_recipe(kit, tmp_path):
    from submerge.cli.main import app

    config = _config(kit, "ties", [{"weight": 1.0, "density": 0.4}] * 3, out_dtype="bfloat16")
    path = tmp_path / "ties.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    runner = CliRunner()
    result = runner.invoke(app, ["merge", str(path), "--out", str(tmp_path / "out"), "--no-progress"],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    merged = _tensors(tmp_path / "out")
    assert all(t.dtype == torch.bfloat16 for t in merged.values())  # the recipe's out_dtype
    record = yaml.safe_load((tmp_path / "out" / "submerge_merge.yaml").read_text())
    assert record["mergekit"] == {k: v for k, v in config.items() if v != {}} and record["recipe"] == str(path)
    result = runner.invoke(app, ["merge", str(path), "--model", str(kit["base"]), "--out", str(tmp_path / "o2")],
                           env={"COLUMNS": "300"})
    assert result.exit_code != 0 and "names its models" in result.output
    path.write_text(yaml.safe_dump({**config, "slices": []}))
    result = runner.invoke(app, ["merge", str(path), "--out", str(tmp_path / "o3")], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "'slices'" in result.output and "Traceback" not in result.output
