"""Half-precision checkpoints are measured in float32: storage dtype ≠ compute dtype (issue: headline run at 7B).

For each architecture, the base and two fine-tunes are rounded to bfloat16 and to float16 and saved in that
dtype. Loaded with ``dtype`` bfloat16 / float16, the Non-linearity Score, α, the Projection Distance and the
merged tensors (task arithmetic, TIES, written in float32), and the evidence plan's cross-validated objectives,
α and block objectives (`diag compare`'s `plan`) must equal the float32 run on the *same rounded
values* (saved as float32) within 1e-3 relative: the capture, the task vectors, every θ0 + Σ c_t τ_t, every
replay and every merge run in float32, nothing is rounded back to storage.
(Computed in the storage dtype, as before, bfloat16 scores are off by far more than that.)
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from submerge.diagnostics import toy
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.linearity import alpha, nonlinearity, projection
from submerge.merge.plan import block_objectives, evidence_plan
from submerge.merge.run import run_merge

ARCHITECTURES = toy.ARCHITECTURES
HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
TASKS = ("math", "code")
RTOL = 1e-3
MERGES = {"task-arithmetic": {"scaling": 0.5}, "ties": {"top_k": 0.2}}


def _rounded_copy(source: Path, target: Path, dtype: torch.dtype, saved_as: torch.dtype) -> Path:
    """`source`'s checkpoint with every floating tensor rounded to `dtype`, saved in `saved_as`."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.name != "model.safetensors":
            shutil.copy2(file, target / file.name)
    tensors = load_file(source / "model.safetensors")
    rounded = {name: t.to(dtype).to(saved_as) if t.is_floating_point() else t for name, t in tensors.items()}
    save_file(rounded, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    """Per architecture: the float32 base and fine-tunes, and task data for both tasks."""
    root = tmp_path_factory.mktemp("dtypes")
    data = {task: str(toy.write_task_data(root / f"{task}.jsonl", task, count=4)) for task in TASKS}
    built = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for arch in ARCHITECTURES:
            base = toy.build_model(root / arch / "base", arch, layers=2, hidden=32)
            tuned = {task: toy.finetune(base, root / arch / task, task, steps=2, seed=s)
                     for s, task in enumerate(TASKS)}
            built[arch] = (root / arch, base, tuned)
    return built, data


def _measure(folder: Path, base: Path, tuned: dict, data: dict, dtype: str, saved_as: torch.dtype, rounding):
    """NL, α and PD of the checkpoints rounded to `rounding`, saved as `saved_as`, loaded with `dtype`."""
    label = f"{rounding}-as-{str(saved_as).removeprefix('torch.')}"
    base_copy = _rounded_copy(base, folder / label / "base", HALF[rounding], saved_as)
    finetuned = {t: str(_rounded_copy(p, folder / label / t, HALF[rounding], saved_as)) for t, p in tuned.items()}
    experiment = Experiment.load(str(base_copy), finetuned, data, samples=2, max_tokens=24, batch_size=2,
                                 dtype=dtype, device="cpu")
    assert next(experiment.base.model.parameters()).dtype == getattr(torch, dtype)
    scores = nonlinearity(experiment, levels=("model", "layer", "attn", "mlp"), steps=4, progress=False)
    solved = alpha(experiment, granularity="attn-mlp", progress=False)
    distances = projection(experiment, levels=("model", "layer"), alphas=(0.5, 1.0), progress=False)
    evidence = evidence_plan(experiment, finetuned, folds=2, progress=False)  # `diag compare`'s plan
    plan = evidence.plan()
    cross_validated = [e.cv_objective[c] for e in evidence.layers for c in sorted(e.cv_objective)]
    plan_alpha = [plan.alpha[unit][task] for unit in sorted(plan.alpha) for task in sorted(plan.alpha[unit])]
    objectives = block_objectives(experiment, plan, fit=experiment)
    stored = load_file(base_copy / "model.safetensors")  # the base is back in its storage dtype, bit for bit
    for name, parameter in experiment.base.model.named_parameters():
        checkpoint = experiment.base.checkpoint_name(name)
        if checkpoint in stored:
            assert parameter.dtype == getattr(torch, dtype) and torch.equal(parameter, stored[checkpoint]), name
    merged = {}
    for method, options in MERGES.items():
        out = run_merge(folder / label / f"merged-{method}", method=method, options=options, base=str(base_copy),
                        finetuned=finetuned, out_dtype="float32", progress=False)
        merged.update({f"{method}:{name}": t.numpy() for name, t in load_file(out / "model.safetensors").items()})
    return {**merged, "nonlinearity_score": scores.nonlinearity_score.values, "alpha": solved.alpha.values,
            "objective_alpha": solved.objective_alpha.values,
            "projection_distance": distances.projection_distance.values,
            "cosine_merge": distances.cosine_merge.values, "cosine_base": distances.cosine_base.values,
            "evidence_cv_objective": np.array(cross_validated), "evidence_plan_alpha": np.array(plan_alpha),
            "block_objective": np.array([objectives[layer] for layer in sorted(objectives)])}


@pytest.mark.parametrize("rounding", list(HALF))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_half_precision_checkpoints_score_as_their_float32_values(kits, arch, rounding):
    built, data = kits
    folder, base, tuned = built[arch]
    half = _measure(folder, base, tuned, data, rounding, HALF[rounding], rounding)
    reference = _measure(folder, base, tuned, data, "float32", torch.float32, rounding)
    for name, expected in reference.items():
        assert np.all(np.isfinite(expected)), name
        np.testing.assert_allclose(half[name], expected, rtol=RTOL, atol=0, err_msg=f"{arch} {rounding}: {name}")
    # the scores are not trivially equal: the fine-tunes move every level
    assert np.nanmin(reference["nonlinearity_score"]) > 0


@pytest.fixture(scope="module")
def llama(kits):
    built, data = kits
    _folder, base, tuned = built["llama"]
    return str(base), {t: str(p) for t, p in tuned.items()}, data


def test_compute_dtype_is_recorded_and_float64_computes_in_float64(llama, tmp_path):
    from submerge.diagnostics.store import Store

    base, tuned, data = llama
    experiment = Experiment.load(base, tuned, data, samples=2, max_tokens=24, batch_size=2, dtype="float32",
                                 device="cpu", compute_dtype="float64")
    assert experiment.parameter_source().variant(experiment.arch.attn_path(0), {"math": 0.5})[
        "q_proj.weight"].dtype == torch.float64
    store = Store(tmp_path / "run.zarr")
    nonlinearity(experiment, levels=("layer",), steps=2, store=store, progress=False)
    group = store.dataset("linearity")
    assert group.attrs["settings"]["dtype"] == "float32"
    assert group.attrs["settings"]["compute_dtype"] == "float64"
    assert group.attrs["precision"]["tf32"] is False


@pytest.mark.parametrize(("dtype", "compute"), [("float32", "float32"), ("bfloat16", "float32"),
                                               ("float32", "float64")])
@pytest.mark.parametrize("scratch", ["one piece", "pieces of 7"])
def test_variants_are_the_base_plus_scaled_task_vectors_in_the_compute_dtype(llama, dtype, compute, scratch,
                                                                             monkeypatch):
    """θ0 + Σ c·τ built in place where the base was converted, or (``pooled``) written into the source's buffers:
    bitwise the sum in order, ((θ0 + c1·τ1) + c2·τ2), in float32 (from float32 or bfloat16 storage); in float64
    (the floor's pass) equal to it to float64's rounding, and in float64. A pooled variant reuses its parameters'
    buffers for the next one (no allocation per point) until `clear`. Both sides of the scratch's size: c·τ added in
    one piece, or (the threshold lowered) in pieces of 7 entries."""
    from submerge.diagnostics import capture

    if scratch == "pieces of 7":
        monkeypatch.setattr(capture, "SCRATCH_ELEMENTS", 7)
    base, tuned, data = llama
    experiment = Experiment.load(base, tuned, data, samples=2, max_tokens=24, batch_size=2, dtype=dtype,
                                 device="cpu", compute_dtype=compute)
    source, path = experiment.parameter_source(), experiment.arch.layer_path(1)
    wide = getattr(torch, compute)
    pointers = None
    for coefficients in ({"math": 0.3}, {"math": 0.3, "code": -0.7}, {"code": 0.0}):
        for pooled in (False, True):
            variant = source.variant(path, coefficients, pooled=pooled)
            if variant is None:  # nothing to change: float32 storage at a = 0
                assert dtype == compute == "float32" and not any(coefficients.values())
                continue
            for local, weight in source.base_parameters(path).items():
                expected = weight.to(wide)
                for task, c in coefficients.items():
                    if c:
                        expected = expected + c * source.deltas(path, task)[local].to(wide)
                assert variant[local].dtype == wide, local
                if compute == "float32":
                    assert torch.equal(variant[local], expected), local
                else:
                    torch.testing.assert_close(variant[local], expected, rtol=1e-15, atol=1e-15)
            if pooled:
                found = {local: variant[local].data_ptr() for local in source.base_parameters(path)}
                assert pointers is None or found == pointers  # the same buffers, point after point
                pointers = found
        assert all(weight.dtype == getattr(torch, dtype) for weight in source.base_parameters(path).values())
    source.clear()
    assert not source._pool and not source._scratches


def test_unknown_compute_dtype_and_missing_cuda_are_clear_errors(llama):
    from submerge.diagnostics.errors import ModelInputError

    base, tuned, data = llama
    with pytest.raises(ModelInputError, match="--compute-dtype must be one of float32, float64, bfloat16, float16"):
        Experiment.load(base, tuned, data, samples=2, dtype="float32", device="cpu", compute_dtype="int8")
    with pytest.raises(ModelInputError, match="--compute-dtype bfloat16 computes in the storage dtype"):
        Experiment.load(base, tuned, data, samples=2, dtype="float32", device="cpu", compute_dtype="bfloat16")
    if not torch.cuda.is_available():
        with pytest.raises(ModelInputError, match="CUDA is not available"):
            Experiment.load(base, tuned, data, samples=2, dtype="float32", device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_cuda_scores_match_cpu_and_tf32_is_restored(llama, device):
    base, tuned, data = llama
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        on_gpu = Experiment.load(base, tuned, data, samples=2, max_tokens=24, batch_size=2, dtype="bfloat16",
                                 device=device)
        assert on_gpu.device.type == "cuda"
        gpu = nonlinearity(on_gpu, levels=("model", "layer", "attn", "mlp"), steps=4, progress=False)
        assert torch.backends.cuda.matmul.allow_tf32  # restored after the sweep
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    on_cpu = Experiment.load(base, tuned, data, samples=2, max_tokens=24, batch_size=2, dtype="bfloat16",
                             device="cpu")
    cpu = nonlinearity(on_cpu, levels=("model", "layer", "attn", "mlp"), steps=4, progress=False)
    np.testing.assert_allclose(gpu.nonlinearity_score.values, cpu.nonlinearity_score.values, rtol=1e-3)


@pytest.mark.parametrize("compute", ["float32", "float64"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_points_token_embedding_forms_only_the_batches_rows(toy_kit, arch, compute, monkeypatch):
    """The model level's embedding stage forms θ0 + a·τ of the token embedding at the batches' token ids only
    (`token_rows`), not the whole table per point: the rows formed are bitwise the whole table's at those ids, the
    rows left are never read (poisoned with NaN, the outputs stay bitwise those of the whole table formed), on
    every toy architecture and in float64 (the floor's pass)."""
    from submerge.diagnostics import capture

    experiment = toy_kit(arch).experiment(compute_dtype=compute)
    source, model, kit_arch = experiment.parameter_source(), experiment.base.model, experiment.arch
    batches = experiment.batches[experiment.tasks[0]]
    rows = capture.token_rows(model, kit_arch, batches)
    assert len(rows) == 1
    (name, ids), = rows.items()
    table_rows = model.get_input_embeddings().weight.shape[0]
    assert 0 < len(ids) < table_rows and torch.equal(ids, torch.unique(torch.cat([b.input_ids.reshape(-1)
                                                                                  for b in batches])))
    names = capture.embedding_stage_names(model, kit_arch)
    variant = {experiment.tasks[0]: 0.7}
    whole = {n: t.clone() for n, t in source.variant(kit_arch.backbone_path, variant, names, pooled=True).items()}
    formed = source.variant(kit_arch.backbone_path, variant, names, pooled=True, rows=rows)
    assert torch.equal(formed[name][ids], whole[name][ids])
    assert all(torch.equal(formed[n], whole[n]) for n in whole if n != name)
    variants = [{experiment.tasks[0]: a} for a in (0.5, 1.0)]
    expected = capture.model_outputs(source, kit_arch, batches, variants)
    source.clear()
    real = source.variant

    def poisoned(path, coefficients, names=None, *, pooled=False, rows=None):  # the buffer's other rows: NaN
        params = real(path, coefficients, names, pooled=pooled)
        if rows:
            for local, index in rows.items():
                keep = params[local].index_select(0, index)
                params[local].fill_(float("nan")).index_copy_(0, index, keep)
        return params

    monkeypatch.setattr(source, "variant", poisoned)
    found = capture.model_outputs(source, kit_arch, batches, variants)
    for want, got in zip(expected, found):
        for w, g in zip(want, got):
            assert w.dtype == getattr(torch, compute) and torch.equal(w, g)
    monkeypatch.setattr(capture, "token_rows", lambda *args: {})  # the whole table formed: the same outputs
    source.clear()
    monkeypatch.setattr(source, "variant", real)
    for want, got in zip(expected, capture.model_outputs(source, kit_arch, batches, variants)):
        assert all(torch.equal(w, g) for w, g in zip(want, got))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_model_level_frees_a_blocks_pooled_variant_before_forming_the_next_blocks(toy_kit, arch, monkeypatch):
    """`model_outputs` (the model level, compare's and eval's merged models) forms each block's variant into pooled
    tensors and drops the pool once the block is done: no tensor of block i's variant may still be alive when block
    i + 1's is formed (a 7B block's variant is 0.8 GB in float32; held one block too long, it raised the 7B-width
    slices' peak from L = 1 to L = 2). Counted with weak references at every `variant` call."""
    import weakref

    from submerge.diagnostics import capture

    experiment = toy_kit(arch).experiment()
    source, kit_arch = experiment.parameter_source(), experiment.arch
    batches = experiment.batches[experiment.tasks[0]]
    formed: dict[str, list] = {}  # path → weak references to the tensors its variants returned
    alive_at_call = []
    real = source.variant

    def watched(path, coefficients, names=None, **options):
        alive_at_call.append((path, sorted(p for p, refs in formed.items()
                                           if p != path and any(ref() is not None for ref in refs))))
        params = real(path, coefficients, names, **options)
        formed.setdefault(path, []).extend(weakref.ref(t) for t in params.values())
        return params

    monkeypatch.setattr(source, "variant", watched)
    capture.model_outputs(source, kit_arch, batches, [{experiment.tasks[0]: a} for a in (0.5, 1.0)])
    blocks = [path for path, _ in alive_at_call if path.startswith(kit_arch.layers_path + ".")]
    assert len(set(blocks)) == kit_arch.num_layers >= 2
    assert all(alive == [] for _, alive in alive_at_call), alive_at_call


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_head_replay_frees_each_variant_before_forming_the_next(toy_kit, arch, monkeypatch):
    """`replay_variants(..., heads=True)` (the head level) forms each variant anew (not pooled: the output
    projection's weight of every variant is kept for the heads). When the next variant is formed, of the previous
    ones only those kept weights may still be alive, not the rest of their tensors (at 7B two block-sized variants
    side by side)."""
    import weakref

    from submerge.diagnostics.capture import record_inputs
    from submerge.diagnostics.replay import replay_variants

    experiment = toy_kit(arch).experiment()
    source, kit_arch, task = experiment.parameter_source(), experiment.arch, experiment.tasks[0]
    path = kit_arch.attn_path(0)
    recorded = record_inputs(experiment.base.model, kit_arch, [path], experiment.batches[task])
    formed, alive_at_call, real = [], [], source.variant

    def watched(where, coefficients, names=None, **options):
        alive_at_call.append(sum(ref() is not None for refs in formed for ref in refs))
        params = real(where, coefficients, names, **options)
        formed.append([weakref.ref(t) for t in params.values()])
        return params

    monkeypatch.setattr(source, "variant", watched)
    replayed = replay_variants(source, kit_arch, path, recorded[path], [{task: a} for a in (0.5, 1.0, 1.5)],
                               heads=True)
    assert len(formed) == 3 and all(len(refs) > 1 for refs in formed)
    assert alive_at_call == [0, 1, 2], alive_at_call  # one kept weight per earlier variant
    assert len(replayed.o_weights) == 3
