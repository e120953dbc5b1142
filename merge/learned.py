"""The data steps of the merges whose inputs are learned from the fit records: Fisher, AdaMerging, LoraHub.

Each takes an `Experiment` (the base, the fine-tunes' task vectors read lazily, the fit records tokenised) and
returns what the merge writer needs, as RegMean's Grams (`submerge.diagnostics.capture.GramsByLayer`) and the
closed form's α do:

- `fisher_diagonals`: the diagonal Fisher of every fine-tune, for every tensor (`FisherDiagonals`, the writer's
  per-tensor input of `submerge.merge.strategies.fisher`), computed block by block by
  `submerge.diagnostics.gradients.backward_by_blocks` on θ_t = θ0 + τ_t built one block at a time;
- `adamerging_coefficients`: λ per task (and parameter tensor) minimising the merged model's next-token entropy
  on the fit records, by Adam on gradients from the same block-by-block backward;
- `lorahub_coefficients`: w per task minimising the fit records' loss + L1 by CMA-ES (the ``cma`` library), each
  candidate's loss computed block by block (`submerge.diagnostics.evaluate.streamed_losses`).

The learned weights become merge rules (`Coefficients.rule_for`): θ0 + Σ_t w_t τ_t per tensor, streamed row by
row like a plan's. The objectives themselves are the pure functions at the top.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from submerge.diagnostics import data as data_module
from submerge.diagnostics.capture import ParameterSource, embedding_stage_names
from submerge.diagnostics.data import TokenBatch, unpadded
from submerge.diagnostics.evaluate import streamed_losses
from submerge.diagnostics.gradients import Weights, backward_by_blocks, top_stage
from submerge.diagnostics.modules import module_parameter_names
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.tensors import TensorInfo
from submerge.merge.rules import ParameterRule, RuleFunction, fisher_rule, mean_rule, weights_rule

__all__ = ["LEARNED_METHODS", "Coefficients", "FisherDiagonals", "LearnedMerge", "adamerging_coefficients",
           "fisher_diagonals", "learn", "lorahub_coefficients", "lorahub_objective", "next_token_entropy",
           "sampled_negative_log_likelihood"]


# ------------------------------------------------------------------ objectives (pure)


def next_token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Σ over the rows of H(p) = −Σ_v p_v log p_v, p = softmax(logits) (nats, differentiable); `logits` (n, vocab):
    the positions that predict a real token (`data.predicting`).

    AdaMerging's objective H(f_θM(x)) (survey §AdaMerging) for a language model: the entropy of each next-token
    distribution where the paper takes the class distribution's.
    """
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum()


def sampled_negative_log_likelihood(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """−Σ_i log p(ŷ_i | x_<i) over the rows of `logits` (n, vocab: the positions that predict a real token,
    `data.predicting`), each ŷ_i drawn from the model's own p(· | x_<i).

    The labels of the expected Fisher E_{y∼p_θ}[(∇ log p_θ(y | x))²] (survey §Fisher Average), one draw per
    position from `generator` (on the CPU, so a seed gives the same labels on every device).
    """
    log_p = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        labels = torch.multinomial(log_p.detach().exp().cpu().float(), 1, generator=generator).to(log_p.device)
    return -log_p.gather(1, labels).sum()


def lorahub_objective(losses: Sequence[float], weights: Sequence[float], l1_weight: float) -> float:
    """LoraHub's objective: the mean of the tasks' losses + l1_weight · mean_t |w_t| (the authors'
    ``default_l1_regularization``: 0.05 · Σ|w| / n)."""
    return float(np.mean(losses)) + float(l1_weight) * float(np.mean(np.abs(weights)))


# ------------------------------------------------------------------ learned weights as merge rules


@dataclass
class Coefficients:
    """Learned weights per task: one set for every tensor (task-wise), or one per checkpoint tensor name.

    ``rule_for(info)``: θ0 + Σ_t w_t τ_t with the tensor's weights; a tensor without its own weights (not a
    parameter of the model, e.g. a stored buffer) gets the mean, as a plan's tensors outside every unit.
    """

    tasks: list[str]
    shared: dict[str, float] | None = None
    per_tensor: dict[str, dict[str, float]] = field(default_factory=dict)
    record: dict = field(default_factory=dict)

    def weights(self, name: str) -> dict[str, float] | None:
        return self.shared if self.shared is not None else self.per_tensor.get(name)

    def rule_for(self, info: TensorInfo) -> ParameterRule:
        weights = self.weights(info.name)
        return weights_rule(weights) if weights is not None else mean_rule(self.tasks)


# ------------------------------------------------------------------ Fisher


class FisherDiagonals:
    """The diagonal Fisher of every fine-tune for every checkpoint tensor, kept on disk and read per tensor.

    ``diagonals(name)`` → [F_t for each task, in task order] (float32, the tensor's shape) or None for a tensor
    without one: the merge writer's per-tensor input of Fisher merging, as RegMean's Grams. Each stage's
    diagonals are written to a float32 safetensors file in a temporary directory as soon as they are complete
    (one file per task and stage), so memory holds one stage's, and the disk one float32 copy of the model per
    task; the directory is removed by `close` or when the object is garbage-collected.
    """

    def __init__(self, tasks: Sequence[str]):
        self.tasks = list(tasks)
        self._directory = tempfile.TemporaryDirectory(prefix="submerge-fisher-")
        self.files: dict[str, dict[str, Path]] = {task: {} for task in self.tasks}
        self.tokens: dict[str, int] = {}

    @property
    def names(self) -> set[str]:
        """The checkpoint names that have a Fisher for every task."""
        return set.intersection(*(set(files) for files in self.files.values())) if self.files else set()

    def write(self, task: str, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            return
        file = Path(self._directory.name) / f"{self.tasks.index(task)}-{len(self.files[task])}.safetensors"
        save_file({name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in tensors.items()},
                  str(file))
        self.files[task].update(dict.fromkeys(tensors, file))

    def __call__(self, name: str) -> list[torch.Tensor] | None:
        if name not in self.names:
            return None
        diagonals = []
        for task in self.tasks:
            with safe_open(str(self.files[task][name]), framework="pt") as handle:
                diagonals.append(handle.get_tensor(name))
        return diagonals

    def close(self) -> None:
        self._directory.cleanup()


class _FinetuneWeights(Weights):
    """θ_t = θ0 + τ_t, built one module at a time, its parameters the leaves; the squared gradient of each batch
    (one record) is summed per checkpoint tensor and written to `store` divided by the predicted tokens.

    A weight tied between the output head and the embedding (one checkpoint tensor, two stages) gets the square
    of its whole gradient per record, (a + e)² = a² + e² + 2ae: the head's a is kept for the rows the record's
    tokens look up, where alone the embedding's e is non-zero.
    """

    def __init__(self, source: ParameterSource, arch, task: str, records: list[TokenBatch], store: FisherDiagonals,
                 tokens: int):
        self.source, self.task, self.records, self.store, self.tokens = source, task, records, store, tokens
        self.model, self.base = source.base.model, source.base
        self.top = set(top_stage(self.model, arch))
        self.embedding_path = arch.backbone_path
        top_names = {name for path in self.top for name in self._checkpoint_names(path).values()}
        self.tied = top_names & set(self._checkpoint_names(arch.backbone_path, embedding_stage_names(
            self.model, arch)).values())
        self.squares: dict[str, torch.Tensor] = {}
        self.names_of: dict[str, list[str]] = {}
        self.head_rows: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _checkpoint_names(self, path: str, names: Sequence[str] | None = None) -> dict[str, str]:
        full = module_parameter_names(self.model, path)
        return {local: self.base.checkpoint_name(full[local]) for local in (full if names is None else names)}

    def parameters(self, path, names=None):
        params = self.source.variant(path, {self.task: 1.0}, names)
        checkpoint = self._checkpoint_names(path, names)
        leaves = []
        for local in checkpoint:
            params[local] = params[local].detach().requires_grad_(True)
            leaves.append(params[local])
        self.names_of[path] = list(checkpoint.values())
        return params, leaves

    def gradients(self, path, batch, grads):
        for name, grad in zip(self.names_of[path], grads):
            if grad is None:
                continue
            grad = grad.detach().float()
            square = grad * grad
            if name in self.tied and path in self.top:
                rows = torch.unique(self.records[batch].input_ids.to(grad.device))
                self.head_rows[(name, batch)] = (rows, grad[rows].clone())
            elif name in self.tied and path == self.embedding_path and (name, batch) in self.head_rows:
                rows, head = self.head_rows.pop((name, batch))
                square[rows] += 2 * head * grad[rows]
            self.squares[name] = square if name not in self.squares else self.squares[name].add_(square)

    def done(self, path):
        complete = path == self.embedding_path or not (path in self.top)
        names = [name for name in self.names_of.get(path, []) if complete or name not in self.tied]
        if path == self.embedding_path:
            names += [name for name in self.tied if name in self.squares]
        finished = {name: self.squares.pop(name) / max(1, self.tokens) for name in dict.fromkeys(names)
                    if name in self.squares}
        self.store.write(self.task, finished)


def _records(batches: list[TokenBatch]) -> list[TokenBatch]:
    """Every record of right-padded `batches` as a batch of its own, cut to its real tokens (`data.unpadded`), those
    with at least one predicted token."""
    return [record for record in unpadded(batches) if record.input_ids.shape[1] >= 2]


def fisher_diagonals(experiment, *, seed: int = 0, progress: bool = True) -> FisherDiagonals:
    """The diagonal Fisher of each fine-tune θ_t on its own task's fit records (Matena & Raffel 2022).

    Estimator: the expected Fisher with labels sampled from the model, as the survey writes it (§Fisher Average,
    F̂ = (1/N) Σ_i E_{y∼p_θ(y|x_i)} (∇_θ log p_θ(y | x_i))²), where each next-token prediction is one
    example: x_i is a real prefix of a fit record, y its next token, N the number of predicted tokens of the
    task. One label is drawn per position (`sampled_negative_log_likelihood`, ``seed``), and the gradient is
    taken per record: for record r, (Σ_i g_i)² = Σ_i g_i² + Σ_{i≠j} g_i g_j, and the cross terms have mean zero
    because each g_i = ∇ log p(ŷ_i | x_<i) has mean zero under its own independent draw — so the per-record
    square is an unbiased estimate of Σ_i E[g_i²] at one backward per record. The empirical Fisher (labels = the
    record's own tokens) has no such property and misrepresents curvature; it is not used.

    Memory: θ_t is built one block at a time from the base block and τ_t (`backward_by_blocks`), never whole;
    the diagonals go to disk stage by stage (`FisherDiagonals`). Compute: per task, one forward over its
    records and, per record, a forward and backward of every block.
    """
    tasks = experiment.tasks
    store = FisherDiagonals(tasks)
    source = experiment.parameter_source()
    stages = experiment.arch.num_layers + len(top_stage(experiment.base.model, experiment.arch)) + 1
    with progress_bar(progress) as bar:
        job = bar.add_task("Fisher diagonals", total=len(tasks) * stages)
        for index, task in enumerate(tasks):
            records = _records(experiment.batches[task])
            tokens = sum(int(record.attention_mask.sum()) - 1 for record in records)
            store.tokens[task] = tokens
            generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + index)
            weights = _FinetuneWeights(source, experiment.arch, task, records, store, tokens)
            bar.update(job, description=f"Fisher diagonals · {task}")
            backward_by_blocks(source, experiment.arch, records, weights,
                               lambda b, logits, batch, draws=generator: sampled_negative_log_likelihood(
                                   logits, draws), on_stage=lambda path: bar.advance(job))
    return store


# ------------------------------------------------------------------ AdaMerging


class _MergedWeights(Weights):
    """θ0 + Σ_t clip(λ[r, t], 0, 1) τ_t with r the tensor's row of λ (0 for every tensor when task-wise); the
    leaf is λ, whose gradient is summed over stages and batches into `grad`."""

    def __init__(self, source: ParameterSource, tasks: list[str], raw: torch.Tensor, rows: dict[str, int]):
        self.source, self.tasks, self.raw, self.rows = source, tasks, raw, rows
        self.grad = torch.zeros_like(raw)

    def parameters(self, path, names=None):
        model, base = self.source.base.model, self.source.base
        own = self.source.base_parameters(path)
        full = module_parameter_names(model, path)
        names = list(own) if names is None else list(names)
        deltas = {task: self.source.deltas(path, task, names) for task in self.tasks}
        coefficients = self.raw.clamp(0.0, 1.0)
        params = {}
        for local in names:
            compute = torch.promote_types(own[local].dtype, self.source.compute_dtype)
            value = own[local].to(device=self.source.device, dtype=compute)
            row = self.rows[base.checkpoint_name(full[local])]
            for column, task in enumerate(self.tasks):
                value = value + coefficients[row, column].to(compute) * deltas[task][local].to(compute)
            params[local] = value
        return params | self.source.upcast_buffers(path), [self.raw]

    def gradients(self, path, batch, grads):
        if grads and grads[0] is not None:
            self.grad += grads[0]


def _coefficient_rows(model: torch.nn.Module, base, granularity: str) -> dict[str, int]:
    """Checkpoint name of every parameter → its row of λ: all 0 (task-wise), or one row per checkpoint tensor."""
    names = list(dict.fromkeys(base.checkpoint_name(name) for name, _ in model.named_parameters(remove_duplicate=False)))
    if granularity == "task":
        return dict.fromkeys(names, 0)
    return {name: row for row, name in enumerate(names)}


def adamerging_coefficients(experiment, *, granularity: str = "layer", steps: int = 500, learning_rate: float = 1e-3,
                            initial: float = 0.3, progress: bool = True) -> Coefficients:
    """AdaMerging's λ (Yang et al. 2024; survey §AdaMerging), learned by entropy minimisation on the fit records.

    min_λ Σ_t (1/N_t) Σ over the predicted real tokens of task t's fit records of H(p_θ(λ)(· | x_<i)), with
    θ(λ) = θ0 + Σ_t λ_t τ_t, λ clipped to [0, 1] in the merge (the authors' ``clamp``), by ``steps`` steps of Adam
    at ``learning_rate`` from λ = ``initial`` (the paper: 500, 1e-3, 0.3; its unlabelled test batches are the fit
    records here, all of them every step). ``granularity``: "task" (one λ per task) or "layer" (one λ per task
    and parameter tensor — the authors' layer-wise AdaMerging, whose "layers" are the model's parameter
    tensors). The language-model analogue of the paper's classification entropy is the next-token entropy
    (`next_token_entropy`). Each step is a forward and a backward of the merged model over the fit records,
    block by block (`backward_by_blocks`): one block of θ(λ) built at a time from θ0 and the task vectors. The
    objective sums over tokens, so the records are regrouped by length as the losses are (`data.by_length` at
    `data.BATCH_OVERHEAD_TOKENS`: less padding, no batch larger than the largest given; only rounding moves).
    """
    if granularity not in ("task", "layer"):
        raise ValueError(f"adamerging granularity must be 'task' or 'layer', got {granularity!r}")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"adamerging steps must be a whole number ≥ 0, got {steps}")
    tasks, base = experiment.tasks, experiment.base
    rows = _coefficient_rows(base.model, base, granularity)
    raw = torch.full((max(rows.values(), default=0) + 1, len(tasks)), float(initial), dtype=torch.float32,
                     device=experiment.device, requires_grad=True)
    optimizer = torch.optim.Adam([raw], lr=float(learning_rate))
    regrouped_experiment = experiment.regrouped(data_module.BATCH_OVERHEAD_TOKENS)  # the constant read at call time
    regrouped = regrouped_experiment.batches
    batches = [batch for task in tasks for batch in regrouped[task]]
    owner = [task for task in tasks for _ in regrouped[task]]
    tokens = {task: sum(int(b.attention_mask[:, 1:].sum()) for b in regrouped[task]) for task in tasks}
    source = experiment.parameter_source()
    history = []
    with progress_bar(progress) as bar:
        job = bar.add_task("AdaMerging", total=int(steps))
        for _ in range(int(steps)):
            weights = _MergedWeights(source, tasks, raw, rows)
            entropy = backward_by_blocks(source, experiment.arch, batches, weights,
                                         lambda b, logits, batch: next_token_entropy(logits)
                                         / max(1, tokens[owner[b]]))
            optimizer.zero_grad()
            raw.grad = weights.grad
            optimizer.step()
            history.append(entropy)
            bar.update(job, advance=1, description=f"AdaMerging · entropy {entropy:.4f}")
    learned = raw.detach().clamp(0.0, 1.0).cpu().double().numpy()
    record = {"granularity": granularity, "steps": int(steps), "learning_rate": float(learning_rate),
              "initial": float(initial), "batches": regrouped_experiment.settings["batches"],
              "entropy": {"first": history[0] if history else None, "last": history[-1] if history else None}}
    if granularity == "task":
        shared = {task: float(learned[0, i]) for i, task in enumerate(tasks)}
        return Coefficients(tasks, shared=shared, record={**record, "coefficients": shared})
    per_tensor = {name: {task: float(learned[row, i]) for i, task in enumerate(tasks)} for name, row in rows.items()}
    return Coefficients(tasks, per_tensor=per_tensor, record={**record, "coefficients": per_tensor})


# ------------------------------------------------------------------ LoraHub


def lorahub_coefficients(experiment, *, steps: int = 40, l1_weight: float = 0.05, bound: float = 1.5, seed: int = 42,
                         progress: bool = True) -> Coefficients:
    """LoraHub's task weights (Huang et al. 2023): a gradient-free search of w ∈ [−bound, bound]ᵀ minimising
    `lorahub_objective` — the mean over tasks of the fit records' next-token loss of θ0 + Σ_t w_t τ_t, + the L1
    term — in exactly ``steps`` evaluations, from w = 0.

    The optimiser is CMA-ES (``cma``; σ0 = bound / 2, a quarter of the box as its authors advise, the box
    handled by cma's bound transform; cma's seed is ``seed`` + 1, as cma reads 0 as "from the clock"; one task
    is searched in two dimensions, the second unused, as cma does not run in one) where the authors used
    nevergrad's NGOpt at the same budget; the answer is the best candidate evaluated. Each evaluation is one
    block-by-block forward over every fit record (`streamed_losses`).
    """
    if int(steps) != steps or steps < 1:
        raise ValueError(f"lorahub steps must be a whole number ≥ 1, got {steps}")
    if not float(bound) > 0:
        raise ValueError(f"lorahub bound must be > 0, got {bound}")
    tasks = experiment.tasks
    source = experiment.parameter_source()
    batches = {task: experiment.batches[task] for task in tasks}

    def objective(candidate) -> float:
        results = streamed_losses(source, experiment.arch, batches, dict(zip(tasks, map(float, candidate))))
        return lorahub_objective([results[task][0] for task in tasks], candidate, l1_weight)

    import cma  # here, not at the top: cma imports matplotlib, which the command line loads only to draw

    dimension = max(2, len(tasks))  # cma needs two dimensions: one task searches with an unused second one
    search = cma.CMAEvolutionStrategy([0.0] * dimension, float(bound) / 2,
                                      {"bounds": [-float(bound), float(bound)], "seed": int(seed) + 1,
                                       "verbose": -9})
    best, best_value, evaluations = None, math.inf, 0
    with progress_bar(progress) as bar:
        job = bar.add_task("LoraHub", total=int(steps))
        while evaluations < steps:
            candidates = search.ask()[: int(steps) - evaluations]
            values = []
            for candidate in candidates:
                values.append(objective(candidate[:len(tasks)]))
                if values[-1] < best_value:
                    best, best_value = [float(v) for v in candidate[:len(tasks)]], values[-1]
                bar.update(job, advance=1, description=f"LoraHub · best {best_value:.4f}")
            evaluations += len(candidates)
            if len(candidates) == search.popsize:
                search.tell(candidates, values)
    shared = dict(zip(tasks, best))
    record = {"weights": shared, "objective": best_value, "evaluations": evaluations, "steps": int(steps),
              "l1_weight": float(l1_weight), "bound": float(bound), "seed": int(seed)}
    return Coefficients(tasks, shared=shared, record=record)


# ------------------------------------------------------------------ the data step of each method


#: The registered methods whose inputs `learn` fits on the records.
LEARNED_METHODS = ("fisher", "adamerging", "lorahub")


@dataclass
class LearnedMerge:
    """What a learned method gives the merge writer: a rule per tensor, what was learned (for the merge's record
    and compare's leaderboard), and the per-tensor data input (Fisher's diagonals) if any."""

    rule_for: RuleFunction
    record: dict
    tensor_inputs: FisherDiagonals | None = None
    detail: str = ""


def learn(method: str, experiment, options: dict, data_options: dict, *, progress: bool = True) -> LearnedMerge:
    """Fit `method` (one of `LEARNED_METHODS`) on the records of `experiment`: `data_options` are the data step's
    options (the registry's ``data_options``, resolved), `options` the merge function's (Fisher's floor and
    scaling, carried by its rule). `diag merge --method M --data …` and `diag compare` both run this."""
    if method == "fisher":
        diagonals = fisher_diagonals(experiment, seed=data_options["seed"], progress=progress)
        record = {"labels": "sampled from each fine-tune's own next-token distribution", "seed": data_options["seed"],
                  "predicted_tokens": diagonals.tokens}
        return LearnedMerge(fisher_rule(options, diagonals.names), record, diagonals,
                            f"diagonal Fishers of {len(diagonals.names)} tensors (sampled labels), mean elsewhere")
    if method == "adamerging":
        learned = adamerging_coefficients(experiment, **data_options, progress=progress)
        entropy = learned.record["entropy"]
        detail = (f"λ per {'task' if learned.shared is not None else 'tensor'}, {learned.record['steps']} steps, "
                  f"entropy {entropy['first']:.4g} → {entropy['last']:.4g}" if learned.record["steps"]
                  else "λ at its initial value (no steps)")
        return LearnedMerge(learned.rule_for, learned.record, detail=detail)
    if method == "lorahub":
        learned = lorahub_coefficients(experiment, **data_options, progress=progress)
        detail = "w " + ", ".join(f"{task}={weight:.3g}" for task, weight in learned.shared.items())
        return LearnedMerge(learned.rule_for, learned.record, detail=detail)
    raise ValueError(f"no learned data step for merge method {method!r} (known: {', '.join(LEARNED_METHODS)})")
