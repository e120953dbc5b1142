"""Known-answer tests for the linearity equations of seed 002 (diagnostics/linearity.py, top section)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from submerge.diagnostics.linearity import (  # the public names, not their module: the package exports them
    AlphaSolution, alpha_system, balance_denominator, cosine_base, cosine_merge, linearized_objective, mean_std,
    merge_objective, nonlinearity_score, nonlinearity_scores, nonlinearity_scores_of_points, pairwise_task_cosine, projection_distance,
    projection_terms, projection_terms_of_batch, solve_alpha, task_gram)

f64 = torch.float64


def _random_orthogonal(dimension: int, generator: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(dimension, dimension, generator=generator, dtype=f64))
    return q * torch.sign(torch.diagonal(r))


# --- Non-linearity Score (Eq. 19) ---


def test_linear_trajectory_scores_zero():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=generator, dtype=f64)
    direction = torch.randn(50, generator=generator, dtype=f64)
    steps = 10
    trajectory = torch.stack([start + (k / steps) * direction for k in range(steps + 1)])
    assert nonlinearity_score(trajectory) <= 1e-12


def test_hand_computed_bent_curve():
    # N = 2, F0 = (0,0), F1 = (1,1), F2 = (2,0); ‖F2 − F0‖ = 2.
    # d01 = d12 = √2 → ratio √2/2 against ideal 1/2, four ordered pairs (01,10,12,21);
    # d02 = 2 → ratio 1 against ideal 1 (zero); diagonal zero.
    # NL = 4 (√2/2 − 1/2)² = (√2 − 1)² = 3 − 2√2 ≈ 0.1716.
    trajectory = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 0.0]], dtype=f64)
    assert nonlinearity_score(trajectory) == pytest.approx(3 - 2 * math.sqrt(2), abs=1e-14)


def test_hand_computed_stalled_curve():
    # N = 2, F0 = F1 = 0, F2 = 1 (the module moves only in the second half).
    # d01 = 0 vs 1/2, d12 = 1 vs 1/2, d02 = 1 vs 1: NL = 2·(1/4) + 2·(1/4) + 0 = 1.
    trajectory = torch.tensor([[0.0], [0.0], [1.0]], dtype=f64)
    assert nonlinearity_score(trajectory) == pytest.approx(1.0, abs=1e-15)


def test_unchanged_module_is_nan_not_error():
    trajectory = torch.ones(11, 7, dtype=torch.float32)
    assert math.isnan(nonlinearity_score(trajectory))


def test_distances_match_differences_on_curved_lines_with_large_offsets():
    """`_pairwise_distances` against the norms of the differences, on lines that bend, whose features are 1e4 times
    their whole change: within 1e-12 relative, the nearest points included, batched as one by one."""
    from submerge.diagnostics.linearity.equations import _pairwise_distances

    generator = torch.Generator().manual_seed(3)
    for steps, width in ((10, 5000), (4, 7), (1, 3)):
        offset = 1e4 * torch.randn(width, generator=generator, dtype=f64)
        a, b = torch.randn(2, width, generator=generator, dtype=f64)
        trajectory = torch.stack([offset + (k / steps) * a + (k / steps) ** 2 * b for k in range(steps + 1)])
        exact = torch.linalg.vector_norm(trajectory[:, None, :] - trajectory[None, :, :], dim=-1)
        found = _pairwise_distances(trajectory)
        off_diagonal = ~torch.eye(steps + 1, dtype=torch.bool)
        assert torch.all(found.diagonal() == 0)
        torch.testing.assert_close(found[off_diagonal], exact[off_diagonal], rtol=1e-12, atol=0)
        batched = _pairwise_distances(torch.stack([trajectory, 2 * trajectory]))
        torch.testing.assert_close(batched[1], 2 * found, rtol=1e-12, atol=0)


def test_small_moves_on_large_features_keep_exact_distances():
    # features of size 1e6 moving linearly by 2^-20 (exactly representable steps of 2^-22):
    # distances through the Gram expansion ‖a‖² + ‖b‖² − 2⟨a,b⟩ cancel to noise here.
    steps = 4
    base = torch.full((8,), 1e6, dtype=f64)
    direction = torch.zeros(8, dtype=f64)
    direction[0] = 2.0**-20
    trajectory = torch.stack([base + (k / steps) * direction for k in range(steps + 1)])
    squared_norms = (trajectory**2).sum(dim=1)
    gram_squared = squared_norms[:, None] + squared_norms[None, :] - 2 * trajectory @ trajectory.T
    exact_squared = ((trajectory[:, None, :] - trajectory[None, :, :]) ** 2).sum(dim=2)
    assert not torch.allclose(gram_squared, exact_squared, rtol=1e-3, atol=0)  # the trap is real
    assert nonlinearity_score(trajectory) <= 1e-12


def test_nonlinearity_score_rejects_bad_shapes():
    with pytest.raises(ValueError, match="trajectory"):
        nonlinearity_score(torch.zeros(5))
    with pytest.raises(ValueError, match="at least 2 rows"):
        nonlinearity_score(torch.zeros(1, 4))


def test_batched_scores_match_single_scores():
    generator = torch.Generator().manual_seed(1)
    batch = torch.randn(4, 6, 9, generator=generator, dtype=f64)
    batch[2] = 3.0  # one unchanged sample
    expected = [nonlinearity_score(trajectory) for trajectory in batch]
    batched = nonlinearity_scores(batch)
    listed = nonlinearity_scores([trajectory[:, : 3 + i] for i, trajectory in enumerate(batch)])
    np.testing.assert_allclose(batched, expected, rtol=1e-12)
    assert math.isnan(batched[2]) and math.isnan(listed[2])
    assert listed[0] == pytest.approx(nonlinearity_score(batch[0][:, :3]), rel=1e-12)


@pytest.mark.parametrize("chunk_bytes", [1, None])  # one sequence at a time / the whole batch in one product
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 10), batch=st.integers(1, 5), seq=st.integers(1, 6),
       width=st.integers(1, 5), offset=st.floats(0, 1e4))
def test_scores_of_a_batchs_points_are_each_sequences_trajectory_score(chunk_bytes, seed, steps, batch, seq, width,
                                                                        offset):
    """`nonlinearity_scores_of_points` (the drivers' path: a batch's outputs at each point, padded positions
    masked) gives each sequence the score of its real tokens' trajectory, to 1e-10 relative, on both sides of its
    chunk threshold: NaN written at padded positions changes nothing, NaN at a real one makes that sequence NaN,
    and a sequence whose points are on a straight line at constant speed scores 0."""
    from submerge.diagnostics.linearity import equations

    generator = torch.Generator().manual_seed(seed)
    start = offset + torch.randn(batch, seq, width, generator=generator, dtype=torch.float32)
    bend = torch.randn(batch, seq, width, generator=generator)
    points = [start + (k / steps) * torch.randn(1, generator=generator).abs() * bend + (k / steps) ** 2 * bend.flip(-1)
              for k in range(steps + 1)]
    points[0] = points[0].clone()
    straight = torch.randn(seq, width, generator=generator).mul(4).round()
    straight[straight == 0] = 1.0
    for k, point in enumerate(points):  # sequence 0 moves along a line at constant speed (integers: exact in float32)
        point[0] = start[0].round() + k * straight
    mask = torch.rand(batch, seq, generator=generator) < 0.7
    mask[:, 0] = True  # every sequence has a real token
    for point in points:
        point[~mask] = float("nan")  # padding holds anything
    if batch > 1 and seq > 0:
        points[-1][batch - 1, 0, 0] = float("inf")  # a real position: that sequence is not finite
    expected = [nonlinearity_score(torch.stack([p[i][mask[i]].reshape(-1) for p in points])) for i in range(batch)]
    original = equations.POINTS_CHUNK_BYTES
    try:
        if chunk_bytes is not None:
            equations.POINTS_CHUNK_BYTES = chunk_bytes
        found = nonlinearity_scores_of_points(points, mask)
    finally:
        equations.POINTS_CHUNK_BYTES = original
    np.testing.assert_allclose(found, expected, rtol=1e-10, atol=1e-12)
    assert found[0] <= 1e-9
    if batch > 1:
        assert math.isnan(found[-1])


def test_scores_of_points_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match="at least 2"):
        nonlinearity_scores_of_points([torch.zeros(2, 3, 4)])
    with pytest.raises(ValueError, match="one shape"):
        nonlinearity_scores_of_points([torch.zeros(2, 3, 4), torch.zeros(2, 4, 4)])
    with pytest.raises(ValueError, match="token_mask"):
        nonlinearity_scores_of_points([torch.zeros(2, 3, 4)] * 3, torch.ones(3, 2, dtype=torch.bool))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    steps=st.integers(1, 8),
    dimension=st.integers(1, 6),
    scale=st.floats(1e-3, 1e3),
    shift=st.floats(-1e3, 1e3),
)
def test_nonlinearity_invariant_to_similarity_transforms(seed, steps, dimension, scale, shift):
    generator = torch.Generator().manual_seed(seed)
    trajectory = torch.randn(steps + 1, dimension, generator=generator, dtype=f64)
    rotation = _random_orthogonal(dimension, generator)
    translation = shift * torch.randn(dimension, generator=generator, dtype=f64)
    transformed = scale * trajectory @ rotation.T + translation
    original = nonlinearity_score(trajectory)
    assert original >= 0
    assert nonlinearity_score(transformed) == pytest.approx(original, rel=1e-7, abs=1e-9)


# --- Projection Distance and cosines (Eq. 7-8, 15-17) ---


def test_exact_linear_merge_has_zero_projection_distance():
    generator = torch.Generator().manual_seed(2)
    deltas = [torch.randn(30 + s, generator=generator, dtype=f64) for s in range(5)]
    terms = [projection_terms(delta, delta.clone()) for delta in deltas]
    ratios, cosines = zip(*terms)
    assert projection_distance(ratios) == pytest.approx(0.0, abs=1e-14)
    assert cosine_merge(cosines) == pytest.approx(1.0, abs=1e-14)


def test_projection_hand_cases():
    linear = torch.tensor([1.0, 0.0], dtype=f64)
    ratio, cosine = projection_terms(2 * linear, linear)  # twice as far along Δ_lin
    assert (ratio, cosine) == (pytest.approx(2.0), pytest.approx(1.0))
    assert projection_distance([ratio]) == pytest.approx(1.0)
    ratio, cosine = projection_terms(torch.tensor([0.0, 3.0], dtype=f64), linear)  # orthogonal
    assert ratio == pytest.approx(0.0) and cosine == pytest.approx(0.0)
    assert projection_distance([ratio]) == pytest.approx(1.0)
    # Δm = (3,4), Δl = (1,0): ‖Δm‖ = 5, cos = 3/5, ratio = 5 · (3/5) / 1 = 3
    ratio, cosine = projection_terms(torch.tensor([3.0, 4.0]), torch.tensor([1.0, 0.0]))
    assert ratio == pytest.approx(3.0) and cosine == pytest.approx(0.6)
    # samples overshooting and undershooting by 1/2 cancel in the mean: PD = |1 − (0.5 + 1.5)/2| = 0
    assert projection_distance([0.5, 1.5]) == pytest.approx(0.0)
    assert projection_distance([0.5, 0.7]) == pytest.approx(0.4)


def test_projection_zero_vectors_give_nan():
    zero = torch.zeros(3, dtype=f64)
    vector = torch.tensor([1.0, 2.0, 2.0], dtype=f64)
    ratio, cosine = projection_terms(vector, zero)
    assert math.isnan(ratio) and math.isnan(cosine)
    ratio, cosine = projection_terms(zero, vector)  # merge did nothing: projection 0, angle undefined
    assert ratio == 0.0 and math.isnan(cosine)
    assert math.isnan(projection_distance([math.nan, math.nan]))
    assert projection_distance([math.nan, 0.5]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="differ in length"):
        projection_terms(torch.zeros(3), torch.zeros(4))


def test_projection_terms_of_a_batch_are_each_rows_terms():
    """`projection_terms_of_batch` gives each row's `projection_terms` to float64 rounding, the hand cases and the
    zero rows (NaN ratio and cosine for Δ_lin = 0, ratio 0 and NaN cosine for Δ_merge = 0) included."""
    generator = torch.Generator().manual_seed(4)
    merge, linear = torch.randn(6, 5, 3, generator=generator, dtype=f64), torch.randn(6, 5, 3, generator=generator,
                                                                                      dtype=f64)
    merge[1], linear[2], merge[3] = 2 * linear[1], 0.0, 0.0
    merge[4], linear[4] = 0.0, 0.0  # Δm = (3, 4), Δl = (1, 0) and zeros: ratio 3, cosine 3/5
    merge[4, 0, :2], linear[4, 0, :2] = torch.tensor([3.0, 4.0]), torch.tensor([1.0, 0.0])
    ratios, cosines = projection_terms_of_batch(merge, linear)
    expected = [projection_terms(m, lin) for m, lin in zip(merge, linear)]
    np.testing.assert_allclose(ratios, [r for r, _ in expected], rtol=1e-13, atol=0)
    np.testing.assert_allclose(cosines, [c for _, c in expected], rtol=1e-13, atol=0)
    assert ratios[1] == pytest.approx(2.0) and cosines[1] == pytest.approx(1.0)
    assert np.isnan(ratios[2]) and np.isnan(cosines[2]) and ratios[3] == 0.0 and np.isnan(cosines[3])
    assert ratios[4] == pytest.approx(3.0) and cosines[4] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="one shape"):
        projection_terms_of_batch(torch.zeros(2, 3), torch.zeros(2, 4))


@pytest.mark.parametrize("chunk_bytes", [1, 10**9])  # a sequence at a time / a whole batch at once
def test_projection_metrics_of_batches_are_the_per_sample_equations(monkeypatch, chunk_bytes):
    """The driver's batched PD, cosine_merge and cosine_base (`projection._metrics`) equal the per-sample
    equations over every sample's real tokens (to float64 rounding) on both sides of its chunk size, with
    padded positions that hold NaN changing nothing."""
    import sys

    from submerge.diagnostics.replay import Outputs

    projection_module = sys.modules["submerge.diagnostics.linearity.projection"]
    monkeypatch.setattr(projection_module, "PROJECTION_CHUNK_BYTES", chunk_bytes)
    generator = torch.Generator().manual_seed(5)
    tasks = ["a", "b", "c"]
    subsets, combos, _ = projection_module._combos(tasks, [0.3, 1.0])

    masks = [torch.ones(3, 4, dtype=torch.bool), torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)]
    indices = [[0, 1, 2], [3, 4]]

    def batches() -> list[torch.Tensor]:  # one variant's outputs on a task's two batches, NaN where padded
        values = [torch.randn(*mask.shape, 2, generator=generator) for mask in masks]
        for value, mask in zip(values, masks):
            value[~mask] = math.nan
        return values

    deltas = {task: Outputs([batches() for _ in tasks], masks, indices) for task in tasks}
    merged = [{task: Outputs([batches()], masks, indices) for task in subset} for subset, _ in combos]
    pd_values, cos_values, base_values = projection_module._metrics(tasks, subsets, combos, deltas, merged)
    for c, (subset, alpha) in enumerate(combos):
        ratios, cosines = [], []
        for a in subset:
            for sample, merge in zip(deltas[a].per_sample(), merged[c][a].features(0)):
                linear = sum(weight * sample[tasks.index(t)] for t, weight in zip(subset, alpha))
                ratio, cosine = projection_terms(merge, linear)
                ratios.append(ratio)
                cosines.append(cosine)
        assert np.isfinite(pd_values[c])
        assert pd_values[c] == pytest.approx(projection_distance(ratios), rel=1e-12, abs=1e-12)
        assert cos_values[c] == pytest.approx(cosine_merge(cosines), rel=1e-12, abs=1e-12)
    assert np.isfinite(base_values).all()


def test_cosine_base_known_answers():
    e1 = torch.tensor([1.0, 0.0], dtype=f64)
    e2 = torch.tensor([0.0, 1.0], dtype=f64)
    assert cosine_base([[e1, e2], [e2, -e1]]) == pytest.approx(0.0, abs=1e-15)
    assert cosine_base([[e1, 2 * e1], [e2, e2]]) == pytest.approx(1.0)
    # three tasks (1,0), (0,1), (1,1): pairs 0, 1/√2, 1/√2 → mean √2/3
    assert pairwise_task_cosine([e1, e2, e1 + e2]) == pytest.approx(math.sqrt(2) / 3)
    # mean over samples: sample cosines 1 and 0 → 1/2; samples may differ in length
    assert cosine_base([[e1, e1], [torch.ones(3), torch.tensor([1.0, -1.0, 0.0])]]) == pytest.approx(0.5)
    assert math.isnan(pairwise_task_cosine([e1, torch.zeros(2)]))
    with pytest.raises(ValueError, match="at least 2 tasks"):
        pairwise_task_cosine([e1])


# --- closed-form α (Eq. 11-14, 22, 33-34) ---


def _hand_grams():
    # inputs of task 1: Δf_1 = (1,1), Δf_2 = (0,1) → G = [[2,1],[1,1]]
    # inputs of task 2: Δf_1 = (1,0,0,0), Δf_2 = (0,1,1,1) → G = [[1,0],[0,3]]
    first = task_gram([torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])])
    second = task_gram([torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])])
    return [first[None], second[None]]


def test_task_gram_values():
    gram = task_gram([torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])])
    assert gram.dtype == f64
    torch.testing.assert_close(gram, torch.tensor([[5.0, 1.0], [1.0, 10.0]], dtype=f64))
    assert balance_denominator(gram) == pytest.approx(7.5)
    with pytest.raises(ValueError, match="equal lengths"):
        task_gram([torch.zeros(2), torch.zeros(3)])


def test_hand_solved_2x2_unbalanced():
    # A = G¹ + G² = [[3,1],[1,4]]; b_j = Σ_a B_a j a: b1 = G¹_11 + G²_12 = 2, b2 = G¹_21 + G²_22 = 4.
    # det = 11, α1 = (2·4 − 1·4)/11 = 4/11, α2 = (3·4 − 1·2)/11 = 10/11.
    matrix, vector = alpha_system(_hand_grams(), balance=False)
    np.testing.assert_array_equal(matrix, [[3.0, 1.0], [1.0, 4.0]])
    np.testing.assert_array_equal(vector, [2.0, 4.0])
    solution = solve_alpha(matrix, vector)
    assert isinstance(solution, AlphaSolution) and not solution.used_least_squares
    np.testing.assert_allclose(solution.alpha, [4 / 11, 10 / 11], rtol=1e-14)
    assert solution.condition_number == pytest.approx(np.linalg.cond([[3.0, 1.0], [1.0, 4.0]]))


def test_hand_solved_2x2_balanced():
    # denominators: trace(G¹)/2 = 3/2, trace(G²)/2 = 2 → B_1 = G¹·2/3, B_2 = G²/2.
    # 6A = [[11,4],[4,13]], 6b = [8, 13]; det = 127 → α = (52/127, 111/127).
    matrix, vector = alpha_system(_hand_grams(), balance=True)
    np.testing.assert_allclose(6 * matrix, [[11.0, 4.0], [4.0, 13.0]], rtol=1e-14)
    np.testing.assert_allclose(6 * vector, [8.0, 13.0], rtol=1e-14)
    np.testing.assert_allclose(solve_alpha(matrix, vector).alpha, [52 / 127, 111 / 127], rtol=1e-13)


def _random_deltas(seed, task_count, samples_per_task, correlated=False):
    """deltas[a][s][t] = Δf_t(x_s) for the s-th input of task a, with varying lengths and scales."""
    generator = np.random.default_rng(seed)
    deltas = []
    for a in range(task_count):
        task_inputs = []
        for s in range(samples_per_task[a]):
            length = int(generator.integers(3, 9))
            scale = 10.0 ** generator.uniform(-2, 2)  # unequal norms so balancing matters
            vectors = scale * generator.standard_normal((task_count, length))
            if correlated:
                vectors[1] = 0.7 * vectors[0] + 0.3 * vectors[1]
            task_inputs.append([torch.from_numpy(v) for v in vectors])
        deltas.append(task_inputs)
    return deltas


def _brute_force_alpha(deltas, balance):
    """Direct least squares on stacked vectors: rows √(w/n_a)·[Δf_1..Δf_T], targets √(w/n_a)·Δf_a."""
    task_count = len(deltas)
    rows, targets = [], []
    for a, task_inputs in enumerate(deltas):
        for sample in task_inputs:
            columns = torch.stack(sample, dim=1).numpy()
            weight = 1.0
            if balance:
                weight = 1.0 / (sum(float((v**2).sum()) for v in sample) / task_count)
            factor = math.sqrt(weight / len(task_inputs))
            rows.append(factor * columns)
            targets.append(factor * sample[a].numpy())
    alpha, *_ = np.linalg.lstsq(np.concatenate(rows), np.concatenate(targets), rcond=None)
    return alpha


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("seed,task_count,samples_per_task", [(3, 2, (4, 7)), (4, 3, (5, 3, 6)), (5, 4, (2, 3, 4, 5))])
def test_alpha_matches_brute_force_least_squares(balance, seed, task_count, samples_per_task):
    deltas = _random_deltas(seed, task_count, samples_per_task, correlated=True)
    grams = [torch.stack([task_gram(sample) for sample in task_inputs]) for task_inputs in deltas]
    solution = solve_alpha(*alpha_system(grams, balance=balance))
    assert not solution.used_least_squares
    np.testing.assert_allclose(solution.alpha, _brute_force_alpha(deltas, balance), atol=1e-8, rtol=1e-8)
    # the Gram-based objective equals the vector residual (Eq. 11/22 or 33 linearised)
    merged = [[sum(solution.alpha[t] * sample[t] for t in range(task_count)) for sample in ti] for ti in deltas]
    targets = [[sample[a] for sample in ti] for a, ti in enumerate(deltas)]
    denominators = [[balance_denominator(task_gram(sample)) for sample in ti] for ti in deltas] if balance else None
    assert linearized_objective(solution.alpha, grams, balance) == pytest.approx(
        merge_objective(merged, targets, denominators), rel=1e-9
    )


def test_identical_tasks_fall_back_to_least_squares():
    generator = torch.Generator().manual_seed(6)
    grams = []
    for _ in range(2):
        samples = [torch.randn(5, generator=generator, dtype=f64) for _ in range(3)]
        grams.append(torch.stack([task_gram([v, v.clone()]) for v in samples]))
    matrix, vector = alpha_system(grams, balance=True)
    solution = solve_alpha(matrix, vector)
    assert solution.used_least_squares
    assert solution.condition_number > 1e12
    assert np.all(np.isfinite(solution.alpha))
    # any α with α1 + α2 = 1 fits exactly; least squares gives the minimum-norm one
    np.testing.assert_allclose(solution.alpha, [0.5, 0.5], atol=1e-10)
    assert linearized_objective(solution.alpha, grams, True) == pytest.approx(0.0, abs=1e-12)


def test_condition_bound_forces_least_squares():
    solution = solve_alpha(np.array([[1.0, 0.0], [0.0, 1e-6]]), np.array([1.0, 1e-6]), max_condition=1e3)
    assert solution.used_least_squares and solution.condition_number == pytest.approx(1e6)
    np.testing.assert_allclose(solution.alpha, [1.0, 1.0])


def test_zero_delta_sample_gets_zero_weight_when_balanced():
    # a sample on which no task changed the module adds nothing and does not divide by zero
    grams = _hand_grams()
    padded = [torch.cat([grams[0], torch.zeros(1, 2, 2, dtype=f64)]), grams[1]]
    matrix, vector = alpha_system(padded, balance=True)
    assert np.all(np.isfinite(matrix)) and np.all(np.isfinite(vector))
    reference_matrix, reference_vector = alpha_system(grams, balance=True)
    # task 1 now averages over 2 samples, one of them contributing 0
    np.testing.assert_allclose(matrix, reference_matrix - grams[0][0].numpy() / 1.5 / 2)
    np.testing.assert_allclose(vector[0], reference_vector[0] - 2 / 1.5 / 2)


def test_alpha_input_errors():
    with pytest.raises(ValueError, match="shape"):
        alpha_system([np.zeros((2, 3, 3)), np.zeros((2, 3, 3))])
    with pytest.raises(ValueError, match="no samples"):
        alpha_system([np.zeros((0, 1, 1))])
    with pytest.raises(ValueError, match="non-finite"):
        solve_alpha(np.array([[math.nan]]), np.array([1.0]))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    task_count=st.integers(2, 4),
    balance=st.booleans(),
    other=st.lists(st.floats(-2, 2), min_size=4, max_size=4),
)
def test_solved_alpha_beats_uniform_and_any_weights(seed, task_count, balance, other):
    deltas = _random_deltas(seed, task_count, [3] * task_count)
    grams = [torch.stack([task_gram(sample) for sample in task_inputs]) for task_inputs in deltas]
    solution = solve_alpha(*alpha_system(grams, balance=balance))
    best = linearized_objective(solution.alpha, grams, balance)
    slack = 1e-9 * (1 + abs(best))
    assert best <= linearized_objective(np.full(task_count, 1.0 / task_count), grams, balance) + slack
    assert best <= linearized_objective(np.ones(task_count), grams, balance) + slack
    assert best <= linearized_objective(np.array(other[:task_count]), grams, balance) + slack


# --- true merge objective (Eq. 10) and aggregation ---


def test_merge_objective_hand_value():
    # task 1: two samples with squared errors 1 and 4 → mean 2.5; task 2: one sample, error (1,1,1) → 3.
    merged = [[torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])], [torch.ones(3)]]
    finetuned = [[torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0])], [torch.zeros(3)]]
    assert merge_objective(merged, finetuned) == pytest.approx(5.5)
    # balanced (Eq. 33): divide each term by its denominator → (1/2 + 4/4)/2 + 3/3 = 1.75
    assert merge_objective(merged, finetuned, [[2.0, 4.0], [3.0]]) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="differ in length"):
        merge_objective([[torch.zeros(2)]], [[torch.zeros(3)]])


def test_mean_std_ignores_nan():
    assert mean_std([1.0, math.nan, 3.0]) == (pytest.approx(2.0), pytest.approx(1.0))
    mean, std = mean_std([math.nan, math.nan])
    assert math.isnan(mean) and math.isnan(std)
    assert all(math.isnan(value) for value in mean_std([]))
    assert mean_std([5.0]) == (5.0, 0.0)
