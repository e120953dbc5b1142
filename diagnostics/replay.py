"""Replay: what a sweep does with one unit — replay a module (or the whole network) for variants of its
parameters on recorded inputs, and turn the outputs into per-sample features — and `LocalLayers`, the sweep's
layers in this process (capture a chunk of layers, then measure each layer's units).

Both engines run this code (`submerge.diagnostics.execution`): `LocalLayers` here, and the Ray pipeline
(`submerge.diagnostics.pipeline`) stage by stage. A *unit* is a replayed module path (an attention path also
serves its heads); a driver's ``measure(unit)`` asks it for the variants it needs (`Unit.run`) and returns
{module name: result}. A driver whose units need each other (the evidence step: α of the attention and the MLP,
scored on the block's output) measures a whole layer at once instead: a `LayerMeasure`, given the layer's units
(`Layer`). A variant is θ0 + Σ c_t τ_t (a `Variant`: task → c_t) or parameters built by the driver (`Given`:
a merged block).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.func import functional_call

from submerge.diagnostics import placement
from submerge.diagnostics.capture import (
    CaptureState,
    Recorded,
    Variant,
    embedded_streams,
    first_output,
    head_output,
    hooks,
    layer_chunks,
    model_outputs,
    real_tokens,
    record_inputs,
    replay,
    replay_with_heads,
    sample_features,
)
from submerge.diagnostics.modules import Architecture, Submodule, find_submodules, get_module, is_linear


@dataclass
class Outputs:
    """One module's outputs for V variants on one task's batches: ``values[v][b]`` is (batch, seq, ...)."""

    values: list[list[torch.Tensor]]
    masks: list[torch.Tensor]  # per batch: (batch, seq) bool, real tokens
    indices: list[list[int]]  # per batch: the record index of each row

    def sample_indices(self) -> Iterator[int]:
        for batch_indices in self.indices:
            yield from batch_indices

    def features(self, v: int) -> Iterator[torch.Tensor]:
        """Variant v's features, one per sample in order: float64, real tokens only, flattened."""
        for output, mask in zip(self.values[v], self.masks):
            yield from sample_features(output, mask)

    def per_sample(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """Per sample, the features of variants 0..V−1."""
        return zip(*(self.features(v) for v in range(len(self.values))))

    def trajectories(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Per sample, (record index, (V, D) float64): row v is `features(v)` of the sample, written straight into
        one float64 tensor (the same values as stacking `per_sample`'s rows, with one copy instead of three)."""
        for b, (mask, batch_indices) in enumerate(zip(self.masks, self.indices)):
            for i, index in enumerate(batch_indices):
                first = real_tokens(self.values[0][b], mask, i)
                rows = torch.empty((len(self.values), *first.shape), dtype=torch.float64, device=first.device)
                for v, per_batch in enumerate(self.values):
                    rows[v].copy_(first if v == 0 else real_tokens(per_batch[b], mask, i))
                yield index, rows.reshape(len(self.values), -1)

    def minus(self, base: list[torch.Tensor]) -> Outputs:
        """Every variant minus per-batch ``base`` outputs, in the outputs' own dtype (Δf = f(x; θ) − f(x; θ0))."""
        values = [[o - b for o, b in zip(per_batch, base)] for per_batch in self.values]
        return Outputs(values, self.masks, self.indices)


@dataclass
class Replayed:
    """Raw replays of one unit for a list of variants on one task's batches; `of` gives a served module's outputs."""

    outputs: list[list[torch.Tensor]]
    masks: list[torch.Tensor]
    indices: list[list[int]]
    o_inputs: list[list[torch.Tensor]] = field(default_factory=list)  # heads: W_o's input per [v][b]
    o_weights: list[torch.Tensor] = field(default_factory=list)  # heads: W_o per variant
    arch: object = None

    def of(self, module: Submodule) -> Outputs:
        if module.head is None:
            return Outputs(self.outputs, self.masks, self.indices)
        values = [[head_output(x, weight, self.arch, module.head) for x in per_batch]
                  for per_batch, weight in zip(self.o_inputs, self.o_weights)]
        return Outputs(values, self.masks, self.indices)


@dataclass(frozen=True)
class Given:
    """A variant given by its parameters (local names → tensors, in the compute dtype, on the execution device),
    built by the driver: e.g. a block merged by a plan's rules, which θ0 + Σ c_t τ_t cannot express."""

    parameters: dict[str, torch.Tensor]


def replay_variants(source, arch, path: str, recorded, variants: Sequence[Variant | Given], *,
                    heads: bool = False) -> Replayed:
    """The module at `path` replayed on every recorded batch for each variant (parameters built by `source`, or
    `Given`).

    With `heads`, also keeps the output projection's input and weight of each variant for head outputs.
    Inputs and parameters are upcast to the compute dtype (`source.dtype_for`) and the outputs stay in it.
    """
    module = get_module(source.base.model, path)
    recorded = [rec.upcast(source.dtype_for(path)) for rec in recorded]  # the compute dtype, per unit
    result = Replayed([], [rec.token_mask for rec in recorded], [rec.sample_index for rec in recorded], arch=arch)
    for variant in variants:
        params = variant.parameters if isinstance(variant, Given) else source.variant(path, variant,
                                                                                        pooled=not heads)
        per_batch, per_batch_x = [], []
        for rec in recorded:
            if heads:
                out, x, weight = replay_with_heads(module, arch, rec, params)
                per_batch_x.append(x)
            else:
                out = replay(module, rec, params)
            per_batch.append(out)
        result.outputs.append(per_batch)
        if heads:
            result.o_inputs.append(per_batch_x)
            result.o_weights.append(weight)
        params = None  # this variant's tensors go now, not once the next variant's are formed beside them
    return result


@dataclass(frozen=True)
class SharedMap:
    """A linear map inside a replayed module whose input is the same at every point of a line θ0 + a·τ: the
    module's own input (``norm`` None), or the output of a norm (``norm``: its local path) that the module's input
    feeds. A norm is affine in its parameters, so its output is z0 + a·d and the map's output is a polynomial in a:

        (W0 + aτ_W)(z0 + a·d) + b0 + aτ_b = [W0 z0 + b0] + a·[τ_W z0 + τ_b + W0 d] + a²·[τ_W d]

    three products computed once per task instead of one per point (two when the norm is unchanged: d = 0)."""

    name: str  # local path of the map in the module ("": the module itself is the map)
    norm: str | None


_SHARED_MAPS: dict[tuple, tuple[SharedMap, ...]] = {}


def shared_maps(module: torch.nn.Module, recorded: Recorded) -> tuple[SharedMap, ...]:
    """The `SharedMap`s of `module`, found once per module structure by one probing replay on `recorded`: a linear
    map (called once) whose input is the module's input tensor itself, or the output of a norm (a leaf module whose
    class name says Norm) whose input is."""
    key = (type(module), tuple(name for name, _ in module.named_modules()))
    if key not in _SHARED_MAPS:
        _SHARED_MAPS[key] = _probe_shared_maps(module, recorded)
    return _SHARED_MAPS[key]


def _placed_like(module: torch.nn.Module, stream) -> dict[str, torch.Tensor] | None:
    """The module's parameters in the dtype and on the device of the recorded stream when they differ (the floor's
    float64 pass probes a module whose weights are stored in float32; an offloaded base keeps them on the host
    while the stream is on the GPU); None: its own."""
    if not (isinstance(stream, torch.Tensor) and stream.is_floating_point()):
        return None
    parameters = dict(module.named_parameters())
    if all(p.dtype == stream.dtype and p.device == stream.device for p in parameters.values()):
        return None
    return {name: p.to(device=stream.device, dtype=stream.dtype) if p.is_floating_point() else p.to(stream.device)
            for name, p in parameters.items()}


def _probe_shared_maps(module: torch.nn.Module, recorded: Recorded) -> tuple[SharedMap, ...]:
    if is_linear(module):
        return (SharedMap("", None),)
    stream = recorded.hidden
    inputs: dict[str, list] = {}
    outputs: dict[str, object] = {}
    with hooks() as handles:
        for name, sub in module.named_modules():
            if name:
                handles.append(sub.register_forward_pre_hook(
                    lambda m, args, name=name: inputs.setdefault(name, []).append(args[0] if args else None)))
                handles.append(sub.register_forward_hook(lambda m, args, out, name=name: outputs.setdefault(name, out)))
        replay(module, recorded, _placed_like(module, stream))
    norms = [name for name, sub in module.named_modules() if name and not list(sub.children())
             and "norm" in type(sub).__name__.lower() and inputs.get(name, [None])[0] is stream]
    found = []
    for name, sub in module.named_modules():
        seen = inputs.get(name, [])
        if not (name and is_linear(sub) and len(seen) == 1):
            continue
        if seen[0] is stream:
            found.append(SharedMap(name, None))
        else:
            norm = next((n for n in norms if outputs[n] is seen[0]), None)
            if norm is not None:
                found.append(SharedMap(name, norm))
    return tuple(found)


def _local_parameters(module: torch.nn.Module, prefix: str) -> list[str]:
    """The unit-local names of the parameters of the submodule at `prefix` ("" the module itself)."""
    sub = module.get_submodule(prefix) if prefix else module
    return [f"{prefix}.{name}" if prefix else name for name, _ in sub.named_parameters(remove_duplicate=False)]


@dataclass
class ChildTerms:
    """A request to a line (`replay_line`) for the terms of the shared maps inside its submodule `child` on the
    child's own recorded `inputs`: where each batch's input of those maps is bitwise the child's recorded input
    (a block's attention: its input norm's output on θ0, or the block's input), a map's terms on that input are
    P0 = W0 z0 + b0 and P1 = τ_W z0 + τ_b, which the line computes anyway (its own P1 adds W0 d where the norm
    moves), so the child's line takes them from `found` ({the map's name local to the child: per batch (P0, P1)})
    instead of computing them again."""

    child: str
    inputs: list[Recorded]
    found: dict[str, list[tuple]]


def _line_terms(source, module, path: str, task: str, shared: SharedMap, recorded: list[Recorded], compute,
                child_inputs: list[Recorded] | None = None, found: list | None = None):
    """Per batch, the polynomial coefficients [P0, P1(, P2)] of `shared`'s output along the line θ0 + a·τ_task
    (`_combo_terms` of the one task: its monomials 1, a (and a²)).

    ``child_inputs`` (a `ChildTerms`' inputs) and ``found`` (a list): where every batch's input of the map on θ0
    (z0) is bitwise the child's recorded input, `found` gets the map's terms on it, (P0, τ_W z0 + τ_b) per batch."""
    return _combo_terms(source, module, path, [task], shared, recorded, compute, child_inputs, found)[1]


def _combo_terms(source, module, path: str, tasks: Sequence[str], shared: SharedMap, recorded: list[Recorded],
                 compute, child_inputs: list[Recorded] | None = None, found: list | None = None
                 ) -> tuple[list[tuple[str, ...]], list[tuple]]:
    """`shared`'s output on every merged variant θ0 + Σ_t c_t τ_t of `tasks`, as terms computed once: (the
    monomials, per batch the terms in their order). With z0 the map's input on θ0 and d_t = norm(x; τ_t) − norm(x; 0)
    the linear part of the norm before it (none where the norm does not move):

        (W0 + Σ_t c_t τ_t)(z0 + Σ_s c_s d_s) + b0 + Σ_t c_t τ_b,t
            = [W0 z0 + b0] + Σ_t c_t·[τ_t z0 + τ_b,t + W0 d_t] + Σ_t Σ_s c_t c_s·[τ_t d_s]

    monomials () → 1, (t,) → c_t, (t, s) → c_t·c_s (`_monomial_weights`). ``child_inputs``/``found``: as
    `_line_terms`'s, for one task."""
    base, sub = source.base_parameters(path), module.get_submodule(shared.name) if shared.name else module
    names = _local_parameters(module, shared.name)
    own = {n: base[n].to(device=source.device, dtype=compute) for n in names}
    deltas = [{n: d.to(compute) for n, d in source.deltas(path, task, names).items()} for task in tasks]
    short = {n: n.removeprefix(f"{shared.name}.") if shared.name else n for n in names}

    def apply(params: dict, x: torch.Tensor, zero_bias: bool = False) -> torch.Tensor:
        local = {short[n]: (torch.zeros_like(v) if zero_bias and short[n] == "bias" else v) for n, v in params.items()}
        return functional_call(sub, local, (x,), strict=False)

    moved = []  # (index of the task, its norm's τ, zeros of that shape) where the norm moves
    if shared.norm is not None:
        norm, norm_names = module.get_submodule(shared.norm), _local_parameters(module, shared.norm)
        norm_own = {n.removeprefix(f"{shared.norm}."): base[n].to(device=source.device, dtype=compute)
                    for n in norm_names}
        for i, task in enumerate(tasks):
            norm_delta = {n.removeprefix(f"{shared.norm}."): d.to(compute)
                          for n, d in source.deltas(path, task, norm_names).items()}
            if any(bool(d.abs().max() > 0) for d in norm_delta.values() if d.numel()):
                moved.append((i, norm_delta, {n: torch.zeros_like(v) for n, v in norm_delta.items()}))
    monomials = [(), *((t,) for t in tasks), *((t, tasks[s]) for t in tasks for s, _, _ in moved)]
    terms, handed = [], [] if found is not None else None  # handed: None once a batch's input is not the child's
    for b, rec in enumerate(recorded):
        x = rec.args[0] if rec.args else rec.kwargs["hidden_states"]
        z0 = x if shared.norm is None else functional_call(norm, norm_own, (x,), strict=False)
        d = {}
        for s, norm_delta, zero in moved:  # the norm's linear part: norm(x; θ0 + τ) − norm(x; θ0) = norm(x; τ) − norm(x; 0)
            d[s] = functional_call(norm, norm_delta, (x,), strict=False) - functional_call(norm, zero, (x,),
                                                                                           strict=False)
        p0 = _captured_term(rec, shared.name, compute)
        linear = [apply(delta, z0) for delta in deltas]
        if p0 is None:
            p0 = apply(own, z0)
        if handed is not None:
            child = child_inputs[b].hidden
            same = isinstance(child, torch.Tensor) and child.dtype == z0.dtype and torch.equal(child, z0)
            handed = handed + [(p0, linear[0])] if same else None
        linear = [p1 + apply(own, d[t], zero_bias=True) if t in d else p1 for t, p1 in enumerate(linear)]
        quadratic = [apply(delta, d[s], zero_bias=True) for delta in deltas for s, _, _ in moved]
        terms.append((p0, *linear, *quadratic))
    if handed:
        found.extend(handed)
    return monomials, terms


def _unshared_parameters(source, module: torch.nn.Module, path: str, maps: Sequence[SharedMap]) -> list[str]:
    """The local names of `module`'s parameters outside every shared map: those a point or merge gets a variant of."""
    covered = {n for m in maps for n in _local_parameters(module, m.name)}
    return [n for n in source.base_parameters(path) if n not in covered]


def _monomial_weights(monomials: Sequence[tuple[str, ...]], coefficients: Variant) -> tuple[float, ...]:
    """The weight of each monomial of `_combo_terms` at the variant θ0 + Σ_t c_t τ_t (a task it lacks: c_t = 0)."""
    return tuple(math.prod((coefficients.get(task, 0.0) for task in monomial), start=1.0) for monomial in monomials)


def _captured_term(rec: Recorded, name: str, compute: torch.dtype) -> torch.Tensor | None:
    """P0 = W0·z0 + b0 of the shared map `name` on this batch where the capture kept the map's output on θ0
    (`Recorded.maps`; the capture ran the base in the compute dtype, so this is the product the line would compute,
    bit for bit); None where it did not."""
    value = rec.output if name == "" else rec.maps.get(name) if rec.maps else None  # "": the module is the map
    return value if isinstance(value, torch.Tensor) and value.dtype == compute else None


def _at(terms: tuple, a: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """P0 + a·P1 (+ a²·P2): `_combined` at the weights (1, a, a²)."""
    return _combined(terms, (1.0, a, a * a)[:len(terms)], out)


def _combined(terms: tuple, weights: Sequence[float], out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_i weights[i]·terms[i] with weights[0] = 1, one fused pass per term (``torch.add`` with ``alpha``), written
    into `out` where given (the same values, bitwise, as a new tensor). One term: a copy of it."""
    if len(terms) == 1:
        return terms[0].clone() if out is None else out.copy_(terms[0])
    value = (torch.add(terms[0], terms[1], alpha=weights[1]) if out is None
             else torch.add(terms[0], terms[1], alpha=weights[1], out=out))
    for term, weight in zip(terms[2:], weights[2:]):
        value.add_(term, alpha=weight)
    return value


class _Probed(Exception):
    """Raised by `LineRotary`'s probe once it has the rotary embedding of a term: the rest of the forward is not
    needed."""


class LineRotary:
    """The rotary position embedding of a line's queries and keys, applied once per term instead of once per point.

    Where q and k are shared maps of the line (`SharedMap`), they are polynomials in a, and the rotary embedding is
    linear in them, so RoPE(q(a)) = Σ_i a^i·RoPE(P_i): the embedding of each term is computed once per batch and
    every point's rotated q and k are formed from those (`_at`), where the attention would apply it to q(a) and
    k(a) anew at each point (on the CPU it costs about three MLP-sized products per call). It stands in for the
    function the attention's modeling module calls (``apply_rotary_pos_emb``, looked up there at call time) while a
    point is replayed. Checked on the first point replayed of each batch: there the true embedding runs too and the
    formed one must agree with it to float32 rounding (and is used, so every point gets the formed values whichever
    is replayed first: a = 0 where the capture kept no output), or the line stops forming them (an attention whose
    q and k are not linear in the maps' outputs before the embedding, say a per-head norm, is then replayed
    plainly).
    """

    NAME = "apply_rotary_pos_emb"

    def __init__(self, site):
        self.site, self.true = site, getattr(site, self.NAME)
        self.rotated: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # batch → per term: (RoPE(q_i), RoPE(k_i))
        self.kept: dict[int, tuple[torch.Tensor, ...]] = {}  # batch → the point's rotated (q, k), overwritten
        self.on = True

    @classmethod
    def of(cls, module: torch.nn.Module, maps: Sequence[SharedMap]) -> LineRotary | None:
        """The rotary of `module`'s line, or None: one attention inside it whose modeling module has the function,
        no norm of its own (q/k norms come before the embedding), and at least two shared maps in it."""
        found = [(name, sub) for name, sub in module.named_modules()
                 if "attention" in type(sub).__name__.lower() and hasattr(sys.modules.get(type(sub).__module__),
                                                                          cls.NAME)]
        if len(found) != 1:
            return None
        name, attention = found[0]
        inside = [m for m in maps if m.name.startswith(f"{name}.") or not name]
        if len(inside) < 2 or any("norm" in type(sub).__name__.lower() for sub in attention.modules()):
            return None
        return cls(sys.modules[type(attention).__module__])

    @contextlib.contextmanager
    def _standing_in(self, function):
        """`function` called by the attention in place of the embedding, while the block is open."""
        setattr(self.site, self.NAME, function)
        try:
            yield
        finally:
            setattr(self.site, self.NAME, self.true)

    def _probe(self, module, rec: Recorded, params, fixed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        found = []

        def probe(q, k, *args, **kwargs):
            found.append(self.true(q, k, *args, **kwargs))
            raise _Probed

        with self._standing_in(probe):
            try:
                _replayed_with(module, rec, params, fixed)
            except _Probed:
                pass
        if not found:
            raise _Probed
        return tuple(found[0])

    def replay(self, a: float, b: int, module, rec: Recorded, params, terms: dict[str, list[tuple]],
               fixed: dict[str, torch.Tensor], kept: dict[str, list] | None) -> torch.Tensor:
        """Point a of batch b: `_replayed_with`, the rotary embedding formed from the terms'."""
        if not self.on:
            return _replayed_with(module, rec, params, fixed, kept)
        if b not in self.rotated:
            count = max(len(t[b]) for t in terms.values())
            try:
                self.rotated[b] = [self._probe(module, rec, params, {
                    name: t[b][i] if i < len(t[b]) else torch.zeros_like(t[b][0]) for name, t in terms.items()})
                    for i in range(count)]
            except _Probed:  # the embedding was not called: nothing to form
                self.on = False
                return _replayed_with(module, rec, params, fixed, kept)
            checked = []

            def check(q, k, *args, **kwargs):  # the formed values where they pass: the same at every point,
                true, formed = self.true(q, k, *args, **kwargs), self._formed(a, b)  # whichever is checked first
                checked.append(all(torch.allclose(t, f, rtol=1e-4, atol=1e-5 * float(t.abs().max()))
                                   for t, f in zip(true, formed)))
                return formed if checked == [True] else true

            with self._standing_in(check):
                output = _replayed_with(module, rec, params, fixed, kept)
            self.on = checked == [True]
            return output

        def formed(q, k, *args, **kwargs):
            return self._formed(a, b)

        with self._standing_in(formed):
            return _replayed_with(module, rec, params, fixed, kept)

    def _formed(self, a: float, b: int) -> tuple[torch.Tensor, ...]:
        terms = self.rotated[b]
        if b not in self.kept:
            self.kept[b] = tuple(torch.empty_like(t) for t in terms[0])
        return tuple(_at(tuple(term[j] for term in terms), a, self.kept[b][j]) for j in range(len(terms[0])))


def replay_line(source, arch, path: str, recorded, task: str, coefficients: Sequence[float], *,
                heads: bool = False, keep: dict[str, dict] | None = None, shared_rotary: bool = True,
                child_terms: ChildTerms | None = None, given_terms: dict[str, list[tuple]] | None = None) -> Replayed:
    """The module at `path` at the points θ0 + a·τ_task, a in `coefficients`, on every recorded batch: what
    `replay_variants` gives for ``[{task: a} for a in coefficients]`` (up to rounding), computed with less.

    - a = 0 is the output the capture kept (`Recorded.output`), where it kept one: no replay.
    - The maps whose input every point shares (`shared_maps`: q/k/v of an attention or a block, gate/up of an
      MLP, a linear module itself) are computed once per task as polynomials in a (`SharedMap`), and their output
      at each point is formed from those terms; only the other parameters get a variant θ0 + aτ per point.
    - Where q and k are such maps, their rotary embedding is applied once per term too (`LineRotary`;
      ``shared_rotary=False`` applies it at every point).
    Heads (which need the output projection's input per variant) and joined paths replay plainly.
    ``keep``: {submodule's local name: {}}, filled with {a: its output per batch} for each point replayed here.
    ``child_terms``: a `ChildTerms` filled with the terms of the shared maps inside a submodule, where they are the
    submodule's own; ``given_terms``: such terms ({map's local name: per batch terms}), taken instead of computed.
    """
    if heads or "+" in path:
        return replay_variants(source, arch, path, recorded, [{task: a} for a in coefficients], heads=heads)
    module = get_module(source.base.model, path)
    recorded = [rec.upcast(source.dtype_for(path)) for rec in recorded]
    result = Replayed([], [rec.token_mask for rec in recorded], [rec.sample_index for rec in recorded], arch=arch)
    compute = source.dtype_for(path)
    maps = shared_maps(module, recorded[0]) if recorded else ()
    terms = {}
    for m in maps:
        if given_terms is not None and m.name in given_terms:
            terms[m.name] = given_terms[m.name]
            continue
        inside = child_terms is not None and m.name.startswith(f"{child_terms.child}.")
        found = [] if inside else None
        terms[m.name] = _line_terms(source, module, path, task, m, recorded, compute,
                                    child_terms.inputs if inside else None, found)
        if found:
            child_terms.found[m.name.removeprefix(f"{child_terms.child}.")] = found
    at = {name: [torch.empty_like(t[0]) for t in per_batch] for name, per_batch in terms.items() if name}
    # ^ the shared maps' outputs at a point, written over point after point (a point's replay is done with them)
    rotary = LineRotary.of(module, maps) if shared_rotary else None
    others = _unshared_parameters(source, module, path, maps)
    for a in coefficients:
        if a == 0 and all(rec.output is not None for rec in recorded):
            result.outputs.append([rec.output for rec in recorded])
        elif "" in terms:  # the module is itself a shared map
            result.outputs.append([_at(t, a) for t in terms[""]])
        else:
            params = (source.variant(path, {task: a}, others, pooled=True) if others
                      else source.upcast_buffers(path))
            kept = {name: found.setdefault(a, []) for name, found in (keep or {}).items()}
            per_batch = []
            for b, rec in enumerate(recorded):
                fixed = {name: _at(t[b], a, at[name][b]) for name, t in terms.items()}
                per_batch.append(rotary.replay(a, b, module, rec, params, terms, fixed, kept) if rotary is not None
                                 else _replayed_with(module, rec, params, fixed, kept))
            result.outputs.append(per_batch)
    return result


#: The most the terms of `replay_combos` may hold at once (bytes, at most 1 + T + T² per shared map and batch, where
#: every norm moves); above it a unit's merged variants are replayed plainly. 512 MiB, the default capture budget:
#: SmolLM2-135M's MLP at 3 tasks × 8 records × 128 tokens holds about 0.2 GiB, a 7B MLP at 8 × 512 tokens 4.7 GiB.
COMBO_TERMS_BYTES = 512 * 2**20


def _combo_terms_bytes(module: torch.nn.Module, maps: Sequence[SharedMap], recorded, tasks: int,
                       compute: torch.dtype) -> float:
    """The bytes of `_combo_terms` of every shared map of `module` on `recorded` for `tasks` tasks, at most (every
    norm moving); a map whose output width is not known counts as too large."""
    tokens = sum(int(rec.hidden[..., 0].numel()) for rec in recorded if isinstance(rec.hidden, torch.Tensor))
    total = 0
    for m in maps:
        sub = module.get_submodule(m.name) if m.name else module
        width = getattr(sub, "out_features", None) or getattr(sub, "nf", None)
        if width is None:
            return math.inf
        total += (1 + tasks + (tasks * tasks if m.norm is not None else 0)) * tokens * int(width) * compute.itemsize
    return total


def replay_combos(source, arch, path: str, recorded, variants: Sequence[Variant], *, heads: bool = False
                  ) -> Replayed:
    """The module at `path` at merged variants θ0 + Σ_t c_t τ_t (`variants`, each task → c_t) on every recorded
    batch: what `replay_variants` gives (up to float rounding), computed with less. The maps whose input every
    variant shares (`shared_maps`) are computed once per task (and task pair, where a norm before them moves) as the
    terms of a polynomial in the c_t (`_combo_terms`); each variant's output of such a map is the terms' weighted
    sum (`_combined`, terms of weight 0 left out), and only the other parameters get a variant per merge. Heads
    and joined paths replay plainly."""
    if heads or "+" in path or not variants:
        return replay_variants(source, arch, path, recorded, variants, heads=heads)
    module, compute = get_module(source.base.model, path), source.dtype_for(path)
    maps = shared_maps(module, recorded[0]) if recorded else ()
    tasks = list(dict.fromkeys(task for variant in variants for task in variant))
    if _combo_terms_bytes(module, maps, recorded, len(tasks), compute) > COMBO_TERMS_BYTES:
        return replay_variants(source, arch, path, recorded, variants)
    recorded = [rec.upcast(compute) for rec in recorded]
    result = Replayed([], [rec.token_mask for rec in recorded], [rec.sample_index for rec in recorded], arch=arch)
    terms = {m.name: _combo_terms(source, module, path, tasks, m, recorded, compute) for m in maps}
    at = {name: [torch.empty_like(t[0]) for t in per_batch] for name, (_, per_batch) in terms.items() if name}
    # ^ the shared maps' outputs at a variant, written over variant after variant (a replay is done with them)
    others = _unshared_parameters(source, module, path, maps)

    def formed(name: str, b: int, variant: Variant, out: torch.Tensor | None) -> torch.Tensor:
        monomials, per_batch = terms[name]
        chosen = [(term, weight) for i, (term, weight) in enumerate(zip(per_batch[b], _monomial_weights(monomials,
                                                                                                       variant)))
                  if i == 0 or weight != 0]
        return _combined(tuple(t for t, _ in chosen), tuple(w for _, w in chosen), out)

    for variant in variants:
        if "" in terms:  # the module is itself a shared map
            result.outputs.append([formed("", b, variant, None) for b in range(len(recorded))])
            continue
        params = (source.variant(path, variant, others, pooled=True) if others
                  else source.upcast_buffers(path))
        result.outputs.append([_replayed_with(module, rec, params, {name: formed(name, b, variant, at[name][b])
                                                                    for name in terms})
                               for b, rec in enumerate(recorded)])
    return result


def _replayed_with(module, rec: Recorded, params, fixed: dict[str, torch.Tensor],
                   kept: dict[str, list] | None = None) -> torch.Tensor:
    """`replay` of `module` with the submodules named in `fixed` returning the given outputs instead of computing,
    and the outputs of those named in `kept` appended to its lists."""
    subs = [module.get_submodule(name) for name in fixed]
    try:
        with hooks() as handles:
            for name, found in (kept or {}).items():
                handles.append(module.get_submodule(name).register_forward_hook(
                    lambda m, args, out, found=found: found.append(first_output(out))))
            for sub, value in zip(subs, fixed.values()):
                sub.forward = lambda *args, value=value, **kwargs: value
            return replay(module, rec, params or None)
    finally:
        for sub in subs:
            sub.__dict__.pop("forward", None)


def replay_model(source, arch, batches, variants: Sequence[Variant], *, output: str = "hidden") -> Replayed:
    """The whole network run block by block for each variant (`model_outputs`) on `batches`."""
    device = source.device
    return model_replayed(model_outputs(source, arch, batches, list(variants), output=output), batches, device)


def model_replayed(outputs: list[list[torch.Tensor]], batches, device) -> Replayed:
    """The model level's `Replayed`: `model_outputs`' outputs[variant][batch] with the batches' masks."""
    return Replayed(outputs, [batch.attention_mask.to(device).bool() for batch in batches],
                    [batch.sample_index for batch in batches])


@dataclass
class Unit:
    """What one replay serves: a module path (or the whole model) and the modules measured on it.

    ``line(task, coefficients)``, where given, replays the points θ0 + a·τ_task of one task's line at once
    (`replay_line`: shared maps computed once, a = 0 from the capture); it returns what ``run(task, [{task: a}
    for a in coefficients])`` returns, up to rounding.
    """

    path: str
    modules: list[Submodule]
    # (input task, variants) → replays on its inputs; a block's unit also takes ``batches=`` (indices of the
    # recorded batches to replay, default all)
    run: Callable[..., Replayed]
    changed: Callable[[str], bool]  # whether task's fine-tune changes this unit's parameters
    line: Callable[[str, Sequence[float]], Replayed] | None = None
    # (input task, merged variants) → what ``run`` returns, the shared maps computed once (`replay_combos`)
    combos: Callable[[str, Sequence[Variant]], Replayed] | None = None

    def merged(self, task: str, variants: Sequence[Variant]) -> Replayed:
        """The replays of merged variants θ0 + Σ_t c_t τ_t on `task`'s inputs (through `combos` where the unit
        has one)."""
        if self.combos is not None:
            return self.combos(task, variants)
        return self.run(task, variants)

    def points(self, task: str, coefficients: Sequence[float]) -> Replayed:
        """The replays of θ0 + a·τ_task for each a of `coefficients` (through `line` where the unit has one)."""
        if self.line is not None:
            return self.line(task, coefficients)
        return self.run(task, [{task: a} for a in coefficients])


@dataclass
class Layer:
    """What a `LayerMeasure` gets: block `index`'s units (module path → `Unit`, in module order), the
    `ParameterSource` its variants are built from (its base, task vectors and compute dtype), and the recorded
    inputs the units replay on ({task: {module path: [Recorded per batch]}}; None where not given)."""

    index: int
    units: dict[str, Unit]
    source: object
    arch: Architecture
    recorded: dict | None = None


@dataclass(frozen=True)
class LayerMeasure:
    """A driver's measure of a whole layer at once, for units that need each other: ``function(layer)`` with a
    `Layer` → {module name: result}. The sweep hands it to every engine like a per-unit ``measure``."""

    function: Callable[[Layer], dict]


def module_coords(modules: Sequence[Submodule]) -> dict:
    """The ``module`` coordinate with its ``level``, ``layer`` (−1: the model) and ``head`` (−1: none) labels."""
    return {
        "module": np.array([m.name for m in modules], dtype=object),
        "level": ("module", np.array([m.level for m in modules], dtype=object)),
        "layer": ("module", np.array([m.layer for m in modules])),
        "head": ("module", np.array([-1 if m.head is None else m.head for m in modules])),
    }


def units_of(modules: Sequence[Submodule]) -> dict[str, list[Submodule]]:
    """Modules grouped by the module path whose replay serves them (an attention serves its heads)."""
    units: dict[str, list[Submodule]] = {}
    for module in modules:
        units.setdefault(module.path, []).append(module)
    return units


def modules_for(experiment, levels: Sequence[str], layers: Sequence[int] | None = None) -> list[Submodule]:
    """Submodules of the requested levels (in `layers`, default all), blocks first, the model level last."""
    block_levels = tuple(level for level in levels if level != "model")
    chosen = None if layers is None else list(layers)
    modules = (find_submodules(experiment.base.model, block_levels, layers=chosen, arch=experiment.arch)
               if block_levels else [])
    if "model" in levels:
        modules.append(Submodule("model", "model", -1, experiment.arch.backbone_path))
    return modules


def block_unit(source, arch, path: str, served: list[Submodule], recorded: dict,
               from_block: dict | None = None) -> Unit:
    """The `Unit` of the module at `path` (serving `served`) replayed on `recorded` ({task: {path: inputs}}).

    ``from_block`` (one dict per layer, shared by its units): a block's line keeps its attention's outputs there
    where they are the attention level's points (`attention_points_coincide`), and the attention's line takes them
    instead of replaying; where they are not (the norm before the attention moves with τ), it keeps the terms of
    the attention's q/k/v on the attention's own input (`ChildTerms`), and the attention's line takes those."""
    heads = any(m.level == "head" for m in served)
    layer = served[0].layer
    attention = arch.attn_path(layer) if layer >= 0 else None

    def run(task, variants, batches=None):
        inputs = recorded[task][path]
        return replay_variants(source, arch, path, inputs if batches is None else [inputs[b] for b in batches],
                               variants, heads=heads)

    def line(task, coefficients):
        inputs = recorded[task][path]
        given = from_block.pop(("terms", task), None) if from_block is not None and path == attention else None
        if from_block is not None and not heads and path == attention and (task, tuple(coefficients)) in from_block:
            return _attention_from_block(from_block.pop((task, tuple(coefficients))), inputs, coefficients, arch)
        keep, child = None, None
        if from_block is not None and path == arch.layer_path(layer) and attention in recorded[task]:
            if attention_points_coincide(source, path, arch.attn_child, task, inputs):
                keep = {arch.attn_child: {}}
            else:  # the attention's line replays: its q/k/v terms are the block's P0 and τ·z0
                compute = source.dtype_for(attention)
                child = ChildTerms(arch.attn_child, [rec.upcast(compute) for rec in recorded[task][attention]], {})
        replayed = replay_line(source, arch, path, inputs, task, coefficients, heads=heads, keep=keep,
                               child_terms=child, given_terms=given)
        if keep is not None:
            from_block[(task, tuple(coefficients))] = keep[arch.attn_child]
        if child is not None and child.found:
            from_block[("terms", task)] = child.found
        return replayed

    def combos(task, variants):
        return replay_combos(source, arch, path, recorded[task][path], variants, heads=heads)

    return Unit(path, served, run, lambda task: source.changed(path, task), line, combos)


def attention_points_coincide(source, block_path: str, attn_child: str, task: str, recorded: list[Recorded]) -> bool:
    """Whether block `block_path`'s attention, at each point θ0 + a·τ_task of the block's line, is the attention
    level's point a: its input is the attention's recorded input when the norm feeding it is unchanged by τ_task
    (or there is none), so the block's replay computes the attention level's outputs on the way."""
    if not recorded:
        return False
    module = get_module(source.base.model, block_path)
    maps = [m for m in shared_maps(module, recorded[0].upcast(source.dtype_for(block_path)))
            if m.name.startswith(f"{attn_child}.")]
    norms = {m.norm for m in maps if m.norm is not None}
    return bool(maps) and not any(bool(d.abs().max() > 0) for norm in norms
                                  for d in source.deltas(block_path, task, _local_parameters(module, norm)).values()
                                  if d.numel())


def _attention_from_block(kept: dict[float, list], recorded: list[Recorded], coefficients, arch) -> Replayed:
    """The attention level's `Replayed` from the outputs a block's line kept (a = 0: the attention's own capture)."""
    result = Replayed([], [rec.token_mask for rec in recorded], [rec.sample_index for rec in recorded], arch=arch)
    result.outputs = [kept[a] if a in kept else [rec.output for rec in recorded] for a in coefficients]
    return result


def measure_layer(source, arch, modules: list[Submodule], recorded: dict,
                  measure: Callable[[Unit], dict] | LayerMeasure,
                  describe: Callable[[str], None] = lambda text: None, *, clear: bool = True) -> dict:
    """{module name: result} of one layer's `modules`: ``measure`` on each unit (a `LayerMeasure`: on the
    layer's units together), replayed on `recorded`. ``clear=False``: the source keeps the layer's τ and kept
    variants after a measure that succeeded (the model level's pass through the block takes them next)."""
    if isinstance(measure, LayerMeasure):
        describe(f"layer {modules[0].layer}")
        units = {path: block_unit(source, arch, path, served, recorded) for path, served in units_of(modules).items()}
        try:
            return measure.function(Layer(modules[0].layer, units, source, arch, recorded))
        finally:
            source.clear()
    results, from_block = {}, {}
    try:  # the layer's units share the τ read for the first of them (at most one block's), dropped at the end
        for path, served in units_of(modules).items():
            describe(served[0].name)
            results.update(measure(block_unit(source, arch, path, served, recorded, from_block)))
            source.drop_pooled()
    except BaseException:
        source.clear()
        raise
    if clear:
        source.clear()
    return results


class ModelStreams:
    """The model level's variants carried through the network beside a local sweep, block by block after each
    layer's units: ``variants`` {task: [variant, ...]} (a driver's `Sweep`'s ``model_variants``). Each block's
    variants are then formed once for the layer's units and the model level (`ParameterSource`'s kept variants,
    where they fit), and its τ read once for both, where the model level would pass through every block again
    after the sweep. Holds tasks × variants streams of the records' hidden states (SmolLM2-135M, 3 tasks × 10
    points × 8 records × 128 tokens: 70 MB)."""

    def __init__(self, source, arch, batches: dict, variants: dict[str, list[Variant]], output: str):
        self.source, self.arch, self.batches, self.output = source, arch, batches, output
        self.variants = variants
        self.streams = {task: embedded_streams(source, arch, batches[task], list(task_variants))
                        for task, task_variants in variants.items()}
        self.done = -1  # the last block the streams have passed

    def advance(self, layer: int) -> None:
        """Every task's streams through block `layer` (the next one), then the source cleared. The tasks go in
        reverse order: the last task a layer's units read may still be kept (one task's τ kept at 7B width)."""
        if layer != self.done + 1:
            raise RuntimeError(f"model streams at block {self.done} cannot pass block {layer}")
        for task in reversed(list(self.variants)):
            model_outputs(self.source, self.arch, self.batches[task], list(self.variants[task]), output=self.output,
                          layers=range(layer, layer + 1), hidden=self.streams[task], clear=False)
        self.source.clear()
        self.done = layer

    def take(self, task: str, variants: Sequence[Variant]) -> list[list[torch.Tensor]] | None:
        """The final outputs of `variants` of `task` where the streams carried each of them through the whole
        network (None otherwise: the caller replays them itself)."""
        if self.done != self.arch.num_layers - 1 or task not in self.variants:
            return None
        known = [dict(variant) for variant in self.variants[task]]
        found = [known.index(dict(variant)) if dict(variant) in known else None for variant in variants]
        return None if None in found else [self.streams[task][i] for i in found]


def linear_maps_in(model: torch.nn.Module, path: str) -> list[str]:
    """Local names of the linear maps inside the module at `path` (none for a joined path or a linear module: its
    own output is `Recorded.output`), whose outputs on θ0 a line's capture keeps (`record_inputs`' ``maps``)."""
    if "+" in path:
        return []
    module = get_module(model, path)
    return [name for name, sub in module.named_modules() if name and is_linear(sub)]


def keep_shared_map_outputs(model: torch.nn.Module, recorded: dict, compute: torch.dtype) -> None:
    """Drop from each `Recorded.maps` of `recorded` ({task: {path: [Recorded]}}) the outputs of maps that are not
    the module's `shared_maps` (or were called twice): only those are a line's P0."""
    for by_path in recorded.values():
        for path, records in by_path.items():
            if not records or records[0].maps is None:
                continue
            shared = {m.name for m in shared_maps(get_module(model, path), records[0].upcast(compute))}
            for rec in records:
                rec.maps = {name: value for name, value in rec.maps.items() if name in shared and value is not None}


def map_output_bytes(experiment, modules: Sequence[Submodule], compute: torch.dtype) -> int:
    """An upper bound of the bytes of one layer's kept map outputs (`keep_shared_map_outputs`) over all tasks: the
    outputs of the distinct linear maps inside the unit paths of `modules` whose input is as wide as the hidden
    state (a shared map's input is the module's input or its norm's output; o_proj's counts too, though it is not
    one), each kept once however many units hold it."""
    model = experiment.base.model
    hidden = model.config.get_text_config().hidden_size
    element = torch.finfo(torch.promote_types(next(model.parameters()).dtype, compute)).bits // 8
    maps = {f"{path}.{name}" for path in units_of(modules) for name in linear_maps_in(model, path)}
    width = 0
    for full in maps:
        linear = model.get_submodule(full)
        outputs, inputs = linear.weight.shape  # (out, in); transformers' Conv1D stores (in, out)
        if type(linear).__name__ == "Conv1D":
            outputs, inputs = inputs, outputs
        width += outputs if inputs == hidden else 0
    padded = sum(sum(b.input_ids.numel() for b in batches) for batches in experiment.batches.values())
    return padded * width * element


def bytes_per_layer(experiment, paths_per_layer: int, compute: torch.dtype) -> int:
    """Bytes of one layer's recorded inputs (kept in the storage dtype promoted to `compute`)."""
    hidden = experiment.base.model.config.get_text_config().hidden_size
    element = torch.finfo(torch.promote_types(next(experiment.base.model.parameters()).dtype, compute)).bits // 8
    padded = max(sum(b.input_ids.numel() for b in batches) for batches in experiment.batches.values())
    return padded * hidden * element * max(1, paths_per_layer)


class LocalLayers:
    """The layers of a `submerge.diagnostics.linearity.sweep.Sweep` measured in this process: capture a chunk of
    layers whose recorded inputs fit the capture budget (each chunk continuing from the hidden state where the
    previous one stopped: one forward in all), then measure each layer's units on them."""

    def __init__(self, sweep):
        self.sweep, self.experiment, self.source = sweep, sweep.experiment, sweep.source
        self.model_base: dict[str, list[torch.Tensor]] = {}  # the model level's a = 0, kept by the last capture
        self.model_streams: ModelStreams | None = None

    def layer_results(self, measure: Callable[[Unit], dict], describe) -> Iterator[tuple[list[Submodule], dict]]:
        """(modules, {module name: result}) per layer still to do, in layer order, measured here. Where the sweep
        names its model level's variants and that level is still to do, they pass each block right after the
        layer's units (`ModelStreams`), every block, also those whose units a resumed run has."""
        variants = self._model_variants()
        arch = self.experiment.arch
        if variants:
            describe("model level · embedding")
            self.model_streams = ModelStreams(self.source, arch, self.experiment.batches, variants,
                                              self.sweep.model_output)
        streams = self.model_streams
        for layer, layer_modules, recorded in self._layers(describe, every_layer=streams is not None):
            results = (measure_layer(self.source, arch, layer_modules, recorded, measure, describe,
                                     clear=streams is None) if layer_modules else None)
            if streams is not None:
                describe(f"model level · layer {layer}")
                streams.advance(layer)
            if layer_modules:
                yield layer_modules, results

    def _model_variants(self) -> dict[str, list[Variant]] | None:
        """The sweep's ``model_variants`` where its model level is still to do and their streams fit in
        `placement.VARIANTS_KEPT_BYTES`, less each task's base (a = 0) where the capture keeps it (`_final_path`).
        (A 7B model, 3 tasks × 10 points × 8 records × 128 tokens in float32: 0.5 GB; beyond the budget the model
        level runs after the sweep, one task's streams at a time, as before.)"""
        sweep = self.sweep
        wanted = sweep.model_variants
        if not wanted or not self._model_pending():
            return None
        captured = self._final_path() is not None
        variants = {task: [v for v in task_variants if not captured or any(c != 0 for c in v.values())]
                    for task, task_variants in wanted.items()}
        hidden = self.experiment.base.model.config.get_text_config().hidden_size
        element = sweep.compute_dtype.itemsize
        streams = sum(len(variants[task]) * sum(b.input_ids.numel() for b in self.experiment.batches[task])
                      for task in variants) * hidden * element
        return variants if streams <= placement.VARIANTS_KEPT_BYTES else None

    def _final_path(self) -> str | None:
        """The final norm, whose output on θ0 is the model level's point a = 0 when the capture can keep it (the
        sweep keeps outputs, measures the model level, on the final hidden states)."""
        sweep, arch = self.sweep, self.experiment.arch
        wanted = sweep.capture_outputs and sweep.model_output == "hidden" and self._model_pending()
        return arch.final_norm_path if wanted else None

    def _model_pending(self) -> bool:
        """Whether the sweep's model level is still to do."""
        sweep = self.sweep
        return any(m.level == "model" and sweep.label(m) not in sweep.writer.done for m in sweep.modules)

    def _layers(self, describe, every_layer: bool = False) -> Iterator[tuple[int, list[Submodule], dict | None]]:
        """Per layer with modules not yet done: (its index, those modules, recorded inputs by task and path); with
        `every_layer`, every layer, those with nothing to do as (index, [], None)."""
        experiment, by_layer, final = self.experiment, self.sweep.by_layer(), self._final_path()
        chunks = layer_chunks(experiment.arch.num_layers, self.sweep.layer_bytes(), self.sweep.capture_budget)
        states = {task: CaptureState() for task in experiment.tasks}  # each chunk starts where the last stopped
        for chunk in chunks:
            chunk_modules = [m for layer in chunk for m in by_layer.get(layer, [])]
            if not chunk_modules:
                if every_layer:
                    yield from ((layer, [], None) for layer in chunk)
                continue
            describe(f"capturing layers {chunk[0]}–{chunk[-1]}")
            paths = list(units_of(chunk_modules))
            last = final is not None and chunk[-1] == experiment.arch.num_layers - 1  # the forward runs to its end
            maps = ({path: linear_maps_in(experiment.base.model, path) for path in paths}
                    if self.sweep.keeps_map_outputs() else None)
            recorded = {task: record_inputs(experiment.base.model, experiment.arch, paths + [final] * last,
                                            experiment.batches[task], device=experiment.device, state=states[task],
                                            compute=self.source.compute_dtype, outputs=self.sweep.capture_outputs,
                                            maps=maps)
                        for task in experiment.tasks}
            if maps:
                keep_shared_map_outputs(experiment.base.model, recorded, self.source.compute_dtype)
            if last:
                self.model_base = {task: [rec.output for rec in recorded[task].pop(final)] for task in recorded}
            for layer in chunk:
                if layer in by_layer:
                    yield layer, by_layer[layer], recorded
                elif every_layer:
                    yield layer, [], None
            del recorded

    def model_unit(self, modules: list[Submodule]) -> Unit:
        """The model level: the whole network replayed here, block by block, for the variants asked (a line's
        a = 0: the final hidden states the capture kept, where it kept them)."""
        experiment, output = self.experiment, self.sweep.model_output

        def run(task, variants):
            carried = self.model_streams.take(task, variants) if self.model_streams is not None else None
            if carried is not None:
                return model_replayed(carried, experiment.batches[task], self.source.device)
            return replay_model(self.source, experiment.arch, experiment.batches[task], variants, output=output)

        def line(task, coefficients):
            base = self.model_base.get(task)
            replayed_at = [a for a in coefficients if a != 0 or base is None]
            replayed = run(task, [{task: a} for a in replayed_at])
            outputs = iter(replayed.outputs)
            replayed.outputs = [base if a == 0 and base is not None else next(outputs) for a in coefficients]
            return replayed

        return Unit(experiment.arch.backbone_path, modules, run, lambda task: True, line)
