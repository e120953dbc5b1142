"""Known-answer tests for merge/strategies.py (one parameter at a time)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from submerge.merge.strategies import (
    DEFAULT_FALLBACK,
    STRATEGIES,
    MergeMethod,
    adamerging,
    breadcrumbs,
    breadcrumbs_mask,
    cart,
    consensus,
    dare,
    della,
    elect_sign_disjoint_mean,
    fisher,
    iso_c,
    iso_cts,
    keep_top_magnitude,
    knots,
    lorahub,
    magprune,
    merge_parameter,
    nan,
    nan_coefficients,
    pcb,
    pcb_balance,
    procrustes_orthonormalise,
    regmean,
    resolve_method,
    sftm,
    sftm_system,
    star,
    star_truncate,
    tall_masks,
    task_arithmetic,
    ties,
    tsv_bases,
    tsv_m,
    weight_average,
    weighted_task_arithmetic,
)

f64 = torch.float64


def _random(shape, seed, dtype=f64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _random_tasks(count, shape, seed=0, dtype=f64):
    return [_random(shape, seed * 100 + index, dtype) for index in range(count)]


def _singular_values(matrix):
    return torch.linalg.svdvals(matrix.to(f64))


def _identity_diag(*values):
    return torch.diag(torch.tensor(values, dtype=f64))


# ----------------------------------------------------------------------- trivial identities


def test_weight_average_and_task_arithmetic_by_hand():
    a = torch.tensor([[1.0, -2.0], [0.5, 4.0]], dtype=f64)
    b = torch.tensor([[3.0, 2.0], [-0.5, 0.0]], dtype=f64)
    torch.testing.assert_close(weight_average([a, b]), torch.tensor([[2.0, 0.0], [0.0, 2.0]], dtype=f64))
    torch.testing.assert_close(task_arithmetic([a, b]), torch.tensor([[4.0, 0.0], [0.0, 4.0]], dtype=f64))
    torch.testing.assert_close(task_arithmetic([a, b], scaling=0.25), torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=f64))


def test_weighted_task_arithmetic_identities():
    tasks = _random_tasks(3, (4, 5))
    torch.testing.assert_close(weighted_task_arithmetic(tasks, [1.0, 1.0, 1.0]), task_arithmetic(tasks))
    torch.testing.assert_close(weighted_task_arithmetic(tasks, [1 / 3] * 3), weight_average(tasks))
    torch.testing.assert_close(weighted_task_arithmetic(tasks, [0.0, 2.0, 0.0]), 2 * tasks[1])
    torch.testing.assert_close(
        weighted_task_arithmetic(tasks, torch.tensor([0.5, -1.0, 0.0])), 0.5 * tasks[0] - tasks[1]
    )
    with pytest.raises(ValueError, match="2 entries but there are 3"):
        weighted_task_arithmetic(tasks, [1.0, 2.0])


# --------------------------------------------------------------------------------- TIES


def test_ties_three_task_example_worked_by_hand():
    # Keep the top 50 % = 3 of 6 entries per task:
    # τ1 |.| = 4 1 .5 / 2 3 .1  -> keep 4, 2, -3     τ̂1 = [[4,0,0],[2,-3,0]]
    # τ2 |.| = 2 5 .2 / 1 1 6   -> keep -2, 5, -6    τ̂2 = [[-2,5,0],[0,0,-6]]
    # τ3 |.| = 3 1 .3 / 4 .5 2  -> keep 3, -4, 2     τ̂3 = [[3,0,0],[-4,0,2]]
    # Σ = [[5,5,0],[-2,-3,-4]] -> elected signs [[+,+,0],[-,-,-]]
    # disjoint mean: (4+3)/2, 5, 0 / -4, -3, -6
    tau1 = torch.tensor([[4.0, -1.0, 0.5], [2.0, -3.0, 0.1]], dtype=f64)
    tau2 = torch.tensor([[-2.0, 5.0, 0.2], [1.0, -1.0, -6.0]], dtype=f64)
    tau3 = torch.tensor([[3.0, 1.0, -0.3], [-4.0, 0.5, 2.0]], dtype=f64)
    torch.testing.assert_close(keep_top_magnitude(tau1, 0.5), torch.tensor([[4.0, 0, 0], [2.0, -3.0, 0]], dtype=f64))
    expected = torch.tensor([[3.5, 5.0, 0.0], [-4.0, -3.0, -6.0]], dtype=f64)
    torch.testing.assert_close(ties([tau1, tau2, tau3], top_k=0.5), expected)
    torch.testing.assert_close(ties([tau1, tau2, tau3], top_k=0.5, scaling=0.5), expected / 2)


def test_ties_sign_election_without_trim():
    # top_k = 1: Σ = [2-1-0.5, -1+3-1] = [0.5, 1] -> +,+ ; mean of positive entries only.
    tasks = [
        torch.tensor([2.0, -1.0], dtype=f64),
        torch.tensor([-1.0, 3.0], dtype=f64),
        torch.tensor([-0.5, -1.0], dtype=f64),
    ]
    torch.testing.assert_close(ties(tasks, top_k=1.0), torch.tensor([2.0, 3.0], dtype=f64))
    # An exact tie (+1, −1) elects sign 0 and merges to 0, as sgn(Σ) says.
    torch.testing.assert_close(
        elect_sign_disjoint_mean(torch.tensor([[1.0, 2.0], [-1.0, 2.0]], dtype=f64)),
        torch.tensor([0.0, 2.0], dtype=f64),
    )


def test_ties_with_weights_per_task_top_k_and_normalize():
    """Per-task weights (mergekit's per-model weight) elect signs on w_t τ_t and weight the disjoint mean.

    τ1 = [1, −2, 3], τ2 = [−3, 1, 1], w = [2, 1], no trim: w τ = [2, −4, 6], [−3, 1, 1]; Σ = [−1, −3, 7] elects
    [−, −, +]. Entry 0: only τ2 agrees → −3 / 1; entry 1: only τ1 → −4 / 2; entry 2: both → (6 + 1) / (2 + 1).
    """
    tasks = [torch.tensor([1.0, -2.0, 3.0], dtype=f64), torch.tensor([-3.0, 1.0, 1.0], dtype=f64)]
    torch.testing.assert_close(ties(tasks, top_k=1.0, weights=[2.0, 1.0]), torch.tensor([-3.0, -2.0, 7 / 3], dtype=f64))
    torch.testing.assert_close(ties(tasks, top_k=1.0, weights=[2.0, 1.0], normalize=False),
                               torch.tensor([-3.0, -4.0, 7.0], dtype=f64))  # the disjoint sum
    # equal weights cancel in the disjoint mean; weights of 1 are the unweighted merge bitwise
    torch.testing.assert_close(ties(tasks, top_k=0.5, weights=[3.0, 3.0]), ties(tasks, top_k=0.5))
    assert torch.equal(ties(tasks, top_k=0.5, weights=[1.0, 1.0]), ties(tasks, top_k=0.5))
    # per-task k: τ1 keeps its largest (3) only, τ2 keeps all: Σ = [−3, 1, 4] → [−3, 1, (3 + 1)/2]
    torch.testing.assert_close(ties(tasks, top_k=[1 / 3, 1.0]), torch.tensor([-3.0, 1.0, 2.0], dtype=f64))
    with pytest.raises(ValueError, match="one number per task"):
        ties(tasks, weights=[1.0])
    with pytest.raises(ValueError, match="top_k must be a number or one number per task"):
        ties(tasks, top_k=[0.5, 0.5, 0.5])


def test_weights_and_per_task_fractions_of_dare_breadcrumbs_della():
    tasks = [torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=f64), torch.tensor([-3.0, 1.0, 1.0, 2.0], dtype=f64)]
    weights = [2.0, 0.5]
    # without drops DARE over task arithmetic is Σ w τ (÷ Σ w with normalize), over TIES the weighted election
    torch.testing.assert_close(dare(tasks, drop_rate=0.0, weights=weights), 2.0 * tasks[0] + 0.5 * tasks[1])
    torch.testing.assert_close(dare(tasks, drop_rate=[0.0, 0.0], weights=weights, normalize=True, scaling=2.0),
                               2.0 * (2.0 * tasks[0] + 0.5 * tasks[1]) / 2.5)
    torch.testing.assert_close(dare(tasks, drop_rate=0.0, base="ties", weights=weights),
                               ties(tasks, top_k=1.0, weights=weights))
    # a per-task drop rate: task 1 dropped at p = 0.5 (kept entries × 2), task 0 kept whole
    merged = dare(tasks, drop_rate=[0.0, 0.5], seed=4)
    rest = merged - tasks[0]
    assert bool(((rest == 0) | torch.isclose(rest, 2 * tasks[1])).all())
    # Breadcrumbs: β/γ per task (task 0 keeps its two middle magnitudes, task 1 all), weighted and normalised
    masks = [torch.tensor([True, True, False, False]), torch.ones(4, dtype=torch.bool)]
    expected = (2.0 * torch.where(masks[0], tasks[0], 0.0) + 0.5 * tasks[1]) / 2.5
    torch.testing.assert_close(breadcrumbs(tasks, beta=[0.25, 0.0], gamma=[0.75, 1.0], weights=weights,
                                           normalize=True), expected)
    # DELLA without drops is the weighted sign election
    torch.testing.assert_close(della(tasks, drop_rate=[0.0, 0.0], epsilon=0.0, weights=weights),
                               ties(tasks, top_k=1.0, weights=weights))


def test_keep_top_magnitude_counts_exactly():
    values = torch.arange(1, 21, dtype=f64) * torch.tensor([1.0, -1.0] * 10, dtype=f64)
    kept = keep_top_magnitude(values, 0.2)
    assert int((kept != 0).sum()) == 4
    assert set(kept[kept != 0].abs().tolist()) == {17.0, 18.0, 19.0, 20.0}
    assert int((keep_top_magnitude(values, 0.01) != 0).sum()) == 1  # at least one kept
    # ⌊k · n⌋ as the TIES authors' int(n · K) and mergekit's int(density · n): 0.23 · 20 = 4.6 keeps 4, 0.3 · 10 keeps 3
    assert int((keep_top_magnitude(values, 0.23) != 0).sum()) == 4
    assert int((keep_top_magnitude(values[:10], 0.3) != 0).sum()) == 3
    with pytest.raises(ValueError, match="top_k"):
        keep_top_magnitude(values, 20)


@pytest.mark.parametrize("dtype", [torch.float32, f64])
@pytest.mark.parametrize("seed", range(4))
def test_kth_smallest_is_torch_kthvalue_ties_included(dtype, seed):
    """The CPU selection (NumPy's introselect) returns `torch.kthvalue`'s value for every k, on values with many
    ties (rounded) and without, in float32 and float64."""
    from submerge.merge.strategies import _kth_smallest

    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(257, generator=generator, dtype=dtype).abs()
    if seed % 2:
        values = (values * 4).round() / 4  # a handful of distinct values
    for k in range(1, values.numel() + 1, 7):
        found = _kth_smallest(values, k)
        assert found.dtype == dtype and float(found) == float(torch.kthvalue(values, k).values), k


# --------------------------------------------------------------------------------- DARE


def test_dare_rescale_keeps_the_expectation():
    # One task, DARE-TA with λ = 1 returns the dropped-and-rescaled τ̂. Each entry of the mean
    # over N seeds has standard deviation |τ|·sqrt(p/(1−p))/sqrt(N) = |τ|/sqrt(N) at p = 0.5;
    # we allow 5 standard deviations (the chance of a false failure over 20 entries is ~1e-5).
    task = torch.linspace(-2.0, 3.0, 20, dtype=f64)
    seeds = 3000
    mean = sum(dare([task], drop_rate=0.5, seed=seed) for seed in range(seeds)) / seeds
    tolerance = 5 * task.abs() / math.sqrt(seeds)
    assert bool(((mean - task).abs() <= tolerance + 1e-12).all())
    # Every draw is either 0 or τ / (1 − p).
    one = dare([task], drop_rate=0.5, seed=7)
    assert bool(((one == 0) | torch.isclose(one, 2 * task)).all())


def test_dare_is_deterministic_for_a_seed():
    tasks = _random_tasks(3, (8, 6), seed=1)
    first = dare(tasks, drop_rate=0.7, seed=123)
    torch.testing.assert_close(first, dare(tasks, drop_rate=0.7, seed=123), rtol=0, atol=0)
    assert not torch.equal(first, dare(tasks, drop_rate=0.7, seed=124))
    # p = 0 is plain task arithmetic; over TIES with p = 0 it is TIES.
    torch.testing.assert_close(dare(tasks, drop_rate=0.0, scaling=0.3), task_arithmetic(tasks, scaling=0.3))
    torch.testing.assert_close(dare(tasks, drop_rate=0.0, base="ties", top_k=0.2), ties(tasks, top_k=0.2))


def test_dare_drop_fraction():
    task = torch.ones(20000, dtype=f64)
    kept = (dare([task], drop_rate=0.9, seed=0) != 0).double().mean().item()
    # Binomial(20000, 0.1): std of the kept fraction is 0.0021; allow 5 std.
    assert abs(kept - 0.1) < 0.011


# --------------------------------------------------------------------------- Breadcrumbs


def test_breadcrumbs_masks_exactly_the_expected_entries():
    # Magnitudes 1..10 in a scrambled order; β = 0.2 drops the 2 smallest, γ = 0.9 the largest one.
    magnitudes = torch.tensor([7.0, 1.0, 10.0, 4.0, 2.0, 9.0, 3.0, 6.0, 8.0, 5.0], dtype=f64)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 1.0], dtype=f64)
    task = (magnitudes * signs).reshape(2, 5)
    mask = breadcrumbs_mask(task, beta=0.2, gamma=0.9)
    expected_kept = magnitudes.reshape(2, 5).ge(3) & magnitudes.reshape(2, 5).le(9)
    assert torch.equal(mask, expected_kept)
    merged = breadcrumbs([task, 2 * task], beta=0.2, gamma=0.9, scaling=0.5)
    torch.testing.assert_close(merged, 1.5 * torch.where(expected_kept, task, 0.0))


def test_breadcrumbs_rejects_bad_thresholds():
    with pytest.raises(ValueError, match="beta <= gamma"):
        breadcrumbs_mask(torch.ones(4), beta=0.9, gamma=0.5)


# --------------------------------------------------------------------------------- DELLA


def test_della_drop_probabilities_follow_magnitude_rank():
    # One row of n = 4 deltas, p = 0.5, ε = 0.4: ranks from the largest are 0..3, so the
    # drop probabilities are 0.3, 0.4, 0.5, 0.6 and the kept entries are scaled by 1/(1 − p_i).
    row = torch.tensor([[4.0, -1.0, 3.0, -2.0]], dtype=f64)  # ranks: 0, 3, 1, 2
    drop_probability = torch.tensor([0.3, 0.6, 0.4, 0.5], dtype=f64)
    draws = 4000
    generator = torch.Generator().manual_seed(0)
    samples = torch.stack([magprune(row, 0.5, 0.4, generator) for _ in range(draws)])
    dropped_rate = (samples == 0).double().mean(dim=0).reshape(-1)
    assert bool(((dropped_rate - drop_probability).abs() < 5 * 0.5 / math.sqrt(draws)).all())
    nonzero = samples[0][samples[0] != 0]
    expected = (row / (1 - drop_probability))[samples[0] != 0]
    torch.testing.assert_close(nonzero, expected)
    # Expectation preserved like DARE.
    assert bool(((samples.mean(dim=0) - row).abs() < 5 * 4.0 * math.sqrt(0.6 / 0.4) / math.sqrt(draws)).all())


def test_della_without_drop_is_ties_without_trim_and_rejects_bad_rates():
    tasks = _random_tasks(3, (5, 4), seed=2)
    torch.testing.assert_close(della(tasks, drop_rate=0.0, epsilon=0.0), ties(tasks, top_k=1.0))
    with pytest.raises(ValueError, match="epsilon"):
        della(tasks, drop_rate=0.05, epsilon=0.2)


# -------------------------------------------------------------------------------- TSV-M


def test_tsv_orthogonalised_bases_are_orthonormal():
    tasks = _random_tasks(3, (12, 9), seed=3)  # k = 9 // 3 = 3 per task, 9 columns
    bases = tsv_bases(tasks)
    assert bases.left.shape == (12, 9) and bases.right.shape == (9, 9)
    torch.testing.assert_close(bases.left.mT @ bases.left, torch.eye(9, dtype=f64), atol=1e-6, rtol=0)
    torch.testing.assert_close(bases.right.mT @ bases.right, torch.eye(9, dtype=f64), atol=1e-6, rtol=0)
    expected = 0.7 * (bases.left * bases.singular_values) @ bases.right.mT
    torch.testing.assert_close(tsv_m(tasks, scaling=0.7), expected)
    # σ̂ are the top-3 singular values of each task.
    top = torch.cat([_singular_values(task)[:3] for task in tasks])
    torch.testing.assert_close(bases.singular_values, top)


def test_tsv_m_of_orthogonal_tasks_is_task_arithmetic():
    # Rank-1 tasks on disjoint basis vectors: already decorrelated, Procrustes changes nothing.
    eye = torch.eye(4, dtype=f64)
    tasks = [3.0 * torch.outer(eye[0], eye[1]), -2.0 * torch.outer(eye[2], eye[3])]
    # k = 4 // 2 = 2 but each task has rank 1: zero singular directions are left out.
    torch.testing.assert_close(tsv_m(tasks), task_arithmetic(tasks), atol=1e-12, rtol=0)


def test_procrustes_is_whitening():
    matrix = _random((7, 4), seed=4)
    gram = matrix.mT @ matrix
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    whitened = matrix @ eigenvectors @ torch.diag(eigenvalues.rsqrt()) @ eigenvectors.mT
    torch.testing.assert_close(procrustes_orthonormalise(matrix), whitened)


# ---------------------------------------------------------------------------- Iso-C / CTS


def test_iso_c_spectrum_is_flat_and_scaled_by_the_mean_singular_value():
    tasks = _random_tasks(3, (7, 5), seed=5)
    expected_value = _singular_values(sum(tasks)).mean()
    merged = iso_c(tasks, scaling=1.3)
    torch.testing.assert_close(_singular_values(merged), torch.full((5,), 1.3 * float(expected_value), dtype=f64))
    # Same singular vectors as the task-arithmetic sum: Δ_Iso-C = σ̄ U Vᵀ.
    left, _, right_t = torch.linalg.svd(sum(tasks), full_matrices=False)
    torch.testing.assert_close(merged, 1.3 * expected_value * left @ right_t)


def test_iso_c_by_hand():
    # Δ_TA = diag(3, 1) -> σ̄ = 2 -> 2 I.
    torch.testing.assert_close(iso_c([_identity_diag(3, 0), _identity_diag(0, 1)]), 2 * torch.eye(2, dtype=f64))
    # Rank-deficient sum diag(5, 4, 0, 2): the zero direction stays zero, σ̄ = 11/3 on the others.
    tasks = [_identity_diag(5, 0, 1, 0), _identity_diag(0, 4, -1, 2)]
    torch.testing.assert_close(iso_c(tasks), _identity_diag(11 / 3, 11 / 3, 0, 11 / 3), atol=1e-12, rtol=0)


def test_iso_cts_by_hand():
    # r = 4, T = 2, common fraction 0.5: k = 2 common directions of Δ_TA = diag(5, 4, 0, 2) (e1, e2);
    # off that subspace task 1 leaves diag(0,0,1,0) (σ = 1 on e3), task 2 diag(0,0,-1,2) (top σ = 2 on e4).
    # σ̄ = (5 + 4 + 1 + 2) / 4 = 3 and U_⊥ V_⊥ᵀ = I -> 3 I.
    tasks = [_identity_diag(5, 0, 1, 0), _identity_diag(0, 4, -1, 2)]
    torch.testing.assert_close(iso_cts(tasks, common_fraction=0.5), 3 * torch.eye(4, dtype=f64), atol=1e-12, rtol=0)
    torch.testing.assert_close(
        iso_cts(tasks, common_fraction=0.5, scaling=0.5), 1.5 * torch.eye(4, dtype=f64), atol=1e-12, rtol=0
    )


def test_iso_cts_spectrum_is_flat():
    tasks = _random_tasks(4, (16, 12), seed=6)  # r = 12, k0 = 9, s = round(3/4) = 1, k = 8
    merged = iso_cts(tasks)
    singular_values = _singular_values(merged)
    torch.testing.assert_close(singular_values, singular_values.mean().expand(12), atol=1e-9, rtol=0)


# ---------------------------------------------------------------------------------- CART


def test_cart_full_rank_is_weight_average():
    tasks = _random_tasks(3, (6, 8), seed=7)
    torch.testing.assert_close(cart(tasks, rank_ratio=1.0, scaling=2.5), weight_average(tasks), rtol=0, atol=0)
    torch.testing.assert_close(cart(tasks, rank_ratio=0.0), weight_average(tasks), rtol=0, atol=0)


def test_cart_low_rank_by_hand():
    # τ_t = 3 e_t e_tᵀ (t = 1..3): mean = I; centred = 3 e_t e_tᵀ − I, whose rank-1 part is 2 e_t e_tᵀ;
    # k = round(1/3 · 3) = 1 -> I + λ·2I.
    tasks = [3 * torch.diag(torch.eye(3, dtype=f64)[index]) for index in range(3)]
    torch.testing.assert_close(cart(tasks, rank_ratio=1 / 3, scaling=1.0), 3 * torch.eye(3, dtype=f64))
    torch.testing.assert_close(cart(tasks, rank_ratio=1 / 3, scaling=0.5), 2 * torch.eye(3, dtype=f64))


def test_cart_two_tasks_is_weight_average_at_any_rank():
    # With T = 2 the centred matrices are ±(τ1 − τ2)/2 and their rank-k parts cancel.
    tasks = _random_tasks(2, (6, 5), seed=8)
    torch.testing.assert_close(cart(tasks, rank_ratio=0.4), weight_average(tasks), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------- STAR


def test_star_truncates_and_keeps_the_nuclear_norm():
    # σ = 4, 3, 2, 1: 4/10 ≥ 40 % -> r = 1; σ'_1 = 4 · 10/4 = 10.
    task = _identity_diag(4, 3, 2, 1)
    torch.testing.assert_close(star_truncate(task, 0.4), _identity_diag(10, 0, 0, 0))
    # η = 0.5: 4/10 < 0.5 ≤ 7/10 -> r = 2, σ' = (4, 3) · 10/7.
    torch.testing.assert_close(star_truncate(task, 0.5), _identity_diag(40 / 7, 30 / 7, 0, 0))
    random_task = _random((6, 5), seed=9)
    assert math.isclose(
        float(torch.linalg.matrix_norm(star_truncate(random_task, 0.4), ord="nuc")),
        float(torch.linalg.matrix_norm(random_task, ord="nuc")),
        rel_tol=1e-12,
    )
    torch.testing.assert_close(star([task, -task]), torch.zeros(4, 4, dtype=f64))
    torch.testing.assert_close(star([task, 3 * task]), _identity_diag(20, 0, 0, 0))


# ---------------------------------------------------------------------------------- SFTM


def test_sftm_alpha_solves_its_linear_system():
    tasks = _random_tasks(3, (5, 4), seed=10)
    system = sftm_system(tasks)
    assert system.coefficient_matrix.shape == (12, 12)
    # Build Eq. 3's matrix entry by entry from each task's SVD.
    triplets = []
    for task in tasks:
        left, values, right_t = torch.linalg.svd(task, full_matrices=False)
        triplets += [(values[k], left[:, k], right_t[k]) for k in range(values.numel())]
    by_definition = torch.tensor(
        [
            [s_col * float(u_row @ u_col) * float(v_col @ v_row) for s_col, u_col, v_col in triplets]
            for _, u_row, v_row in triplets
        ],
        dtype=f64,
    )
    torch.testing.assert_close(system.coefficient_matrix.abs(), by_definition.abs())  # singular-vector signs may differ
    sigma = torch.tensor([float(s) for s, _, _ in triplets], dtype=f64)
    torch.testing.assert_close(system.singular_values, sigma)
    residual = system.coefficient_matrix @ system.alpha - system.singular_values
    assert float(residual.abs().max()) < 1e-9
    # Eq. 2 holds for the merged matrix: ⟨u_i^(k), M v_i^(k)⟩ = σ_i^(k).
    merged = sftm(tasks, top_k=1.0)
    torch.testing.assert_close(torch.einsum("mr,mn,nr->r", system.left, merged, system.right), system.singular_values)


def test_sftm_two_by_two_by_hand():
    # M1 = e1 e1ᵀ, M2 = u uᵀ with u = (1,1)/√2: system [[1, 1/2], [1/2, 1]] α = (1, 1) -> α = 2/3;
    # M = 2/3 (M1 + M2) = [[1, 1/3], [1/3, 1/3]].
    u = torch.tensor([1.0, 1.0], dtype=f64) / math.sqrt(2)
    tasks = [_identity_diag(1, 0), torch.outer(u, u)]
    system = sftm_system(tasks)
    torch.testing.assert_close(system.alpha, torch.full((2,), 2 / 3, dtype=f64))
    expected = torch.tensor([[1.0, 1 / 3], [1 / 3, 1 / 3]], dtype=f64)
    torch.testing.assert_close(sftm(tasks, top_k=1.0), expected)
    torch.testing.assert_close(sftm(tasks, top_k=1.0, scaling=0.6), 0.6 * expected)


def test_sftm_orthogonal_tasks_add_up():
    eye = torch.eye(4, dtype=f64)
    tasks = [2 * torch.outer(eye[0], eye[1]) + torch.outer(eye[1], eye[0]), -3 * torch.outer(eye[2], eye[3])]
    assert torch.allclose(sftm_system(tasks).alpha, torch.ones(3, dtype=f64))
    torch.testing.assert_close(sftm(tasks, top_k=1.0), tasks[0] + tasks[1], atol=1e-12, rtol=0)
    # Identical tasks make the system singular; the minimum-norm solution returns the task itself.
    torch.testing.assert_close(sftm([tasks[0], tasks[0]], top_k=1.0), tasks[0], atol=1e-12, rtol=0)


def test_sftm_solves_by_cholesky_to_the_pseudo_inverses_solution_at_a_real_matrix_size():
    """SmolLM2's 576 × 576 attention matrices give an r = 1,728 system: the Cholesky solve (well conditioned)
    gives the pseudo-inverse's α to rounding, and a pair of identical tasks (a singular system: Cholesky stops)
    still gets the minimum-norm solution. The ill-conditioned but positive definite case is
    `test_interference.py::test_solve_symmetric_right_takes_the_pseudo_inverse_below_min_rcond`."""
    from submerge.merge import strategies

    tasks = [keep_top_magnitude(task, 0.3) for task in _random_tasks(3, (576, 576), seed=13)]
    system = sftm_system(tasks)
    assert system.singular_values.numel() == 1728
    gram = system.coefficient_matrix / system.singular_values.unsqueeze(0)
    by_pinv = (torch.linalg.pinv(gram, hermitian=True) @ system.singular_values) / system.singular_values
    torch.testing.assert_close(system.alpha, by_pinv, rtol=1e-9, atol=1e-9)
    twice = [tasks[0], tasks[0].clone()]
    torch.testing.assert_close(sftm(twice, top_k=1.0), tasks[0].to(f64), atol=1e-10, rtol=0)
    assert strategies.SFTM_MIN_RCOND > 1728 * torch.finfo(f64).eps * 1e3


def test_sftm_trims_before_solving():
    tasks = _random_tasks(2, (6, 6), seed=11)
    trimmed = [keep_top_magnitude(task, 0.3) for task in tasks]
    torch.testing.assert_close(sftm(tasks, top_k=0.3), sftm(trimmed, top_k=1.0))


# ------------------------------------------------------------------------------- RegMean


def _regression_toy():
    in_features, out_features = 4, 3
    inputs = [_random((20, in_features), seed=12), _random((15, in_features), seed=13)]
    base = _random((out_features, in_features), seed=14)
    weights = [_random((out_features, in_features), seed=15), _random((out_features, in_features), seed=16)]
    return inputs, base, weights


def test_regmean_is_least_squares_with_unscaled_grams():
    inputs, base, weights = _regression_toy()
    targets = [x @ w.mT for x, w in zip(inputs, weights)]
    task_vectors = [w - base for w in weights]
    grams = [x.mT @ x for x in inputs]
    merged = base + regmean(task_vectors, gram_matrices=grams, off_diagonal_scale=1.0)
    least_squares = torch.linalg.lstsq(torch.cat(inputs), torch.cat(targets)).solution.mT
    torch.testing.assert_close(merged, least_squares)

    # It minimises Σ_t ‖X_t Wᵀ − Y_t‖²: any perturbation is worse.
    def loss(w):
        return sum(float(((x @ w.mT - y) ** 2).sum()) for x, y in zip(inputs, targets))

    assert loss(merged) <= loss(merged + 1e-3 * _random(merged.shape, seed=17))


def test_regmean_off_diagonal_scale_by_closed_form():
    inputs, base, weights = _regression_toy()
    grams = [x.mT @ x for x in inputs]
    scaled = [0.9 * g + 0.1 * torch.diag(torch.diagonal(g)) for g in grams]
    expected = torch.linalg.inv(sum(scaled)) @ sum(g @ w.mT for g, w in zip(scaled, weights))
    merged = base + regmean([w - base for w in weights], gram_matrices=grams)
    torch.testing.assert_close(merged, expected.mT)


def test_regmean_disjoint_inputs_take_each_tasks_columns():
    # Task 1 only ever sees feature 0, task 2 only feature 1: diagonal Grams, so the merged
    # weight takes column 0 from task 1 and column 1 from task 2.
    grams = [_identity_diag(2.0, 0.0), _identity_diag(0.0, 5.0)]
    tau1 = torch.tensor([[1.0, 9.0], [2.0, 9.0]], dtype=f64)
    tau2 = torch.tensor([[7.0, 3.0], [7.0, 4.0]], dtype=f64)
    torch.testing.assert_close(
        regmean([tau1, tau2], gram_matrices=grams), torch.tensor([[1.0, 3.0], [2.0, 4.0]], dtype=f64)
    )


def test_regmean_gives_a_feature_no_input_had_no_weight():
    # Feature 1 is never active: Σ G̃ = diag(5, 0) is singular, and the pseudo-inverse's answer is known by hand:
    # column 0 is the Gram-weighted mean (2 τ1 + 3 τ2) / 5, column 1 is 0.
    grams = [_identity_diag(2.0, 0.0), _identity_diag(3.0, 0.0)]
    tau1 = torch.tensor([[1.0, 9.0], [2.0, 9.0]], dtype=f64)
    tau2 = torch.tensor([[6.0, 3.0], [7.0, 4.0]], dtype=f64)
    torch.testing.assert_close(regmean([tau1, tau2], gram_matrices=grams),
                               torch.tensor([[4.0, 0.0], [5.0, 0.0]], dtype=f64))


@pytest.mark.parametrize("block_entries", [2**22, 64, 7, 1])
def test_regmean_forms_its_scaled_grams_block_by_block_to_the_same_merge(block_entries, monkeypatch):
    """Each G̃_t is formed `REGMEAN_BLOCK_ENTRIES` entries (whole rows) at a time: below the threshold (one block),
    above it (blocks of 5 rows and of 1 row, of 11 features) the merge is the closed form's; the Grams are taken once
    each, in task order (a lazy sequence never holds all T)."""
    from submerge.merge import strategies

    monkeypatch.setattr(strategies, "REGMEAN_BLOCK_ENTRIES", block_entries)
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(30, 11, generator=generator, dtype=f64) for _ in range(3)]
    vectors = [torch.randn(5, 11, generator=generator, dtype=f64) for _ in range(3)]
    grams = [x.mT @ x for x in inputs]
    taken = []

    class Lazy(list):
        def __getitem__(self, index):
            taken.append(index)
            return list.__getitem__(self, index)

    scaled = [0.9 * g + 0.1 * torch.diag(torch.diagonal(g)) for g in grams]
    expected = sum(v @ g for v, g in zip(vectors, scaled)) @ torch.linalg.inv(sum(scaled))
    torch.testing.assert_close(regmean(vectors, gram_matrices=Lazy(grams)), expected, rtol=1e-10, atol=1e-12)
    assert taken == [0, 1, 2]


def test_regmean_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"gram_matrices\[0\] has shape \(3, 3\), expected \(2, 2\)"):
        regmean([torch.ones(4, 2)], gram_matrices=[torch.eye(3)])
    with pytest.raises(ValueError, match="one Gram matrix per task"):
        regmean([torch.ones(4, 2), torch.ones(4, 2)], gram_matrices=[torch.eye(2)])


# ------------------------------------------------------------------------------- PCB-Merging


def _pcb_by_hand(tau, top_k):
    """seed 003 §PCB with scalars: softmaxes over the entries, min-max Norm, keep ⌊r n⌋ per task, β̂-weighted mean."""
    count, size = len(tau), len(tau[0])

    def norm(values):
        low, high = min(values), max(values)
        return [0.0] * len(values) if high == low else [(v - low) / (high - low) for v in values]

    def softmax(values):
        exps = [math.exp(v) for v in values]
        return [e / sum(exps) for e in exps]

    betas = []
    for i in range(count):
        intra = softmax([count * v for v in norm([x * x for x in tau[i]])])
        inter = [0.0] * size
        for j in range(count):
            inter = [a + b for a, b in zip(inter, softmax(norm([x * y for x, y in zip(tau[i], tau[j])])))]
        betas.append([a * b for a, b in zip(intra, inter)])
    keep = math.floor(top_k * size + 1e-9)
    kept = []
    for beta in betas:
        threshold = sorted(beta, reverse=True)[keep - 1]
        kept.append([b if b >= threshold else 0.0 for b in beta])
    return [sum(kept[i][d] * tau[i][d] for i in range(count)) / sum(kept[i][d] for i in range(count))
            if sum(kept[i][d] for i in range(count)) > 0 else 0.0 for d in range(size)]


def test_pcb_two_tasks_three_entries_by_hand():
    tau = [[1.0, 0.0, 2.0], [0.0, 1.0, 1.0]]
    for top_k in (1.0, 2 / 3, 1 / 3):
        expected = torch.tensor(_pcb_by_hand(tau, top_k), dtype=f64)
        got = pcb([torch.tensor(t, dtype=f64) for t in tau], top_k=top_k)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    # entry 2 (largest |τ| of both) survives the 1/3 trim of both tasks and is their β-weighted mean
    assert 1.0 < float(pcb([torch.tensor(t, dtype=f64) for t in tau], top_k=1 / 3)[2]) < 2.0


def test_pcb_balance_is_the_product_of_the_softmaxes():
    tau = _random_tasks(3, (4, 5), seed=40)
    betas = pcb_balance(tau)
    for i, beta in enumerate(betas):
        torch.testing.assert_close(beta.sum() > 0, torch.tensor(True))
        # β_intra sums to 1 and β_inter to T over the entries: Σ β_i ≤ T, every entry positive
        assert bool((beta > 0).all()) and float(beta.sum()) <= len(tau) + 1e-12


def test_pcb_of_equal_or_single_tasks_keeps_the_top_magnitudes():
    """One task, or T equal ones: β is increasing in |τ|, so the mask is TIES's trim and the weighted mean is τ."""
    task = _random((6, 5), seed=41)
    for tasks in ([task], [task, task.clone()], [task] * 3):
        torch.testing.assert_close(pcb(tasks, top_k=0.3), keep_top_magnitude(task, 0.3), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(pcb([task], top_k=0.3, scaling=2.0), 2 * keep_top_magnitude(task, 0.3))


def test_pcb_properties():
    tasks = _random_tasks(3, (5, 7), seed=42)
    merged = pcb(tasks)
    torch.testing.assert_close(pcb(tasks[::-1]), merged, rtol=1e-12, atol=1e-15)  # task order
    torch.testing.assert_close(pcb(tasks, scaling=-0.5), -0.5 * merged)
    assert torch.equal(pcb([torch.zeros(3, 2, dtype=f64)] * 2), torch.zeros(3, 2, dtype=f64))
    # an entry some task keeps is a convex combination of the tasks' entries there; one none keeps is 0
    stacked, kept = torch.stack(tasks), merged != 0
    assert bool((merged <= stacked.max(0).values + 1e-12)[kept].all())
    assert bool((merged >= stacked.min(0).values - 1e-12)[kept].all())
    assert int(kept.sum()) >= math.floor(0.1 * merged.numel())
    with pytest.raises(ValueError, match="top_k must be a fraction"):
        pcb(tasks, top_k=1.5)


# ------------------------------------------------------------------------- Consensus TA


def test_consensus_four_entries_by_hand():
    tau = [torch.tensor(v, dtype=f64) for v in ([1.0, 1.0, 0.0, 3.0], [1.0, -1.0, 0.0, -1.0], [0.1, 0.0, 2.0, 0.0])]
    # Σ = [2.1, 0, 2, 2]; with λ = 0.5: m_1 = [1,1,0,1], m_2 = [1,1,0,0], m_3 = [0,1,1,0]; agreeing [2,3,1,1]
    masks = tall_masks(tau, 0.5)
    assert [m.tolist() for m in masks] == [[True, True, False, True], [True, True, False, False],
                                           [False, True, True, False]]
    torch.testing.assert_close(consensus(tau, mask_lambda=0.5), torch.tensor([2.1, 0.0, 0.0, 0.0], dtype=f64))
    torch.testing.assert_close(consensus(tau, mask_lambda=0.5, min_tasks=1), torch.tensor([2.1, 0.0, 2.0, 2.0],
                                                                                          dtype=f64))
    torch.testing.assert_close(consensus(tau, mask_lambda=0.5, min_tasks=3, scaling=0.5),
                               torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=f64))


def test_consensus_properties():
    tasks = _random_tasks(3, (6, 5), seed=43)
    torch.testing.assert_close(consensus(tasks, mask_lambda=0.0), task_arithmetic(tasks))  # every mask is all ones
    torch.testing.assert_close(consensus(tasks, min_tasks=0, scaling=0.3), task_arithmetic(tasks, scaling=0.3))
    torch.testing.assert_close(consensus([tasks[0]], min_tasks=1), tasks[0])  # one task: its own τ
    assert torch.equal(consensus([tasks[0]]), torch.zeros_like(tasks[0]))  # k = 2 > T: nothing is shared
    torch.testing.assert_close(consensus(tasks[::-1]), consensus(tasks), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="min_tasks"):
        consensus(tasks, min_tasks=1.5)
    with pytest.raises(ValueError, match="mask_lambda"):
        consensus(tasks, mask_lambda=-1.0)


# ------------------------------------------------------------------------------------ NAN


def test_nan_by_hand():
    base = torch.tensor([1.0, 1.0], dtype=f64)
    tau = [torch.tensor([2.0, 3.0], dtype=f64), torch.tensor([-1.0, 11.0], dtype=f64)]  # ‖θ_1‖ = 5, ‖θ_2‖ = 12
    assert nan_coefficients(tau, base) == pytest.approx([12 / 17, 5 / 17], rel=1e-15)
    torch.testing.assert_close(nan(tau, base_weight=base), 12 / 17 * tau[0] + 5 / 17 * tau[1])  # T/2 = 1
    three = tau + [torch.tensor([2.0, 3.0], dtype=f64)]
    torch.testing.assert_close(nan(three, base_weight=base, scaling=2.0),
                               2.0 * 1.5 * (12 * three[0] + 5 * three[1] + 12 * three[2]) / 29)


def test_nan_properties():
    tasks = _random_tasks(3, (4, 5), seed=44)
    base = torch.zeros(4, 5, dtype=f64)
    equal = [t / torch.linalg.vector_norm(t) for t in tasks]  # equal norms: α = 1/T, NAN = (T/2)(1/T) Σ τ
    torch.testing.assert_close(nan(equal, base_weight=base), task_arithmetic(equal, scaling=0.5))
    torch.testing.assert_close(nan(tasks[::-1], base_weight=base), nan(tasks, base_weight=base))
    zero_weight = [-torch.ones(2, dtype=f64), torch.ones(2, dtype=f64)]  # θ_1 = 0 takes the whole weight
    assert nan_coefficients(zero_weight, torch.ones(2, dtype=f64)) == [1.0, 0.0]
    with pytest.raises(ValueError, match="needs base_weight"):
        merge_parameter("w", tasks, "nan")
    torch.testing.assert_close(merge_parameter("w", tasks, "nan", base_weight=base), nan(tasks, base_weight=base))
    assert not STRATEGIES["nan"].needs_data and STRATEGIES["nan"].checkpoint_inputs == ("base_weight",)


# ---------------------------------------------------------------------------------- KnOTS


def test_knots_with_task_arithmetic_is_task_arithmetic():
    """U Σ V_tᵀ = Δ_t exactly, so summing the aligned parts is summing the task matrices."""
    tasks = _random_tasks(3, (5, 4), seed=45)
    torch.testing.assert_close(knots(tasks, base="task-arithmetic", scaling=0.7), task_arithmetic(tasks, scaling=0.7),
                               rtol=1e-12, atol=1e-12)


def test_knots_ties_by_hand():
    # disjoint updates: [Δ1 Δ2] = [[2,0,0,0],[0,0,0,1]], σ = (2, 1), Σ V_1ᵀ = [[2,0],[0,0]], Σ V_2ᵀ = [[0,0],[0,1]]
    first, second = _identity_diag(2.0, 0.0), _identity_diag(0.0, 1.0)
    torch.testing.assert_close(knots([first, second], top_k=0.25), _identity_diag(2.0, 1.0), atol=1e-14, rtol=0)
    # one row: [1, 0 | -3, 0] = √10 · [1, 0, -3, 0]/√10: aligned parts [1, 0] and [-3, 0]; the sign -1 is elected
    row = [torch.tensor([[1.0, 0.0]], dtype=f64), torch.tensor([[-3.0, 0.0]], dtype=f64)]
    torch.testing.assert_close(knots(row, top_k=1.0), torch.tensor([[-3.0, 0.0]], dtype=f64), atol=1e-14, rtol=0)
    torch.testing.assert_close(knots(row, top_k=1.0, scaling=0.5), torch.tensor([[-1.5, 0.0]], dtype=f64))


def test_knots_properties():
    tasks = _random_tasks(3, (6, 4), seed=46)
    torch.testing.assert_close(knots(tasks[::-1]), knots(tasks), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(knots([tasks[0]], top_k=1.0), tasks[0], atol=1e-12, rtol=1e-12)  # one task: itself
    assert torch.equal(knots([torch.zeros(3, 2, dtype=f64)] * 2), torch.zeros(3, 2, dtype=f64))
    low_rank = [_random((6, 1), seed=47) @ _random((1, 4), seed=48 + i) for i in range(2)]  # k = 2 directions
    torch.testing.assert_close(knots(low_rank, base="task-arithmetic"), low_rank[0] + low_rank[1], atol=1e-12,
                               rtol=1e-12)
    with pytest.raises(ValueError, match="knots base"):
        knots(tasks, base="dare")
    assert STRATEGIES["knots"].matrix_only


def test_shared_factors_give_knots_and_cart_at_every_setting_bitwise_with_one_decomposition(monkeypatch):
    """Inside `shared_factors` the settings of KnOTS (top-k) and CART (rank ratio) on the same τ tensors take one
    SVD of [τ_1 … τ_T] (KnOTS) or of each τ_t − τ̄ (CART), and return bitwise what separate calls return; a τ changed
    in place, or other tensors of the same values, are decomposed anew; outside the scope nothing is kept."""
    from submerge.merge import strategies

    tasks = _random_tasks(3, (12, 7), seed=61)
    expected = {("knots", k): knots(tasks, top_k=k) for k in (0.1, 0.3, 0.5)}
    expected |= {("cart", r): cart(tasks, rank_ratio=r) for r in (0.2, 0.5)}
    svds = []
    original = strategies._thin_svd
    monkeypatch.setattr(strategies, "_thin_svd", lambda matrix: svds.append(matrix.shape) or original(matrix))
    with strategies.shared_factors():
        for (method, value), result in expected.items():
            got = knots(tasks, top_k=value) if method == "knots" else cart(tasks, rank_ratio=value)
            assert torch.equal(got, result), (method, value)
        assert len(svds) == 1 + len(tasks)  # KnOTS's one, CART's one per task
        copies = [task.clone() for task in tasks]
        assert torch.equal(knots(copies, top_k=0.3), expected["knots", 0.3]) and len(svds) == 2 + len(tasks)
        copies[0].mul_(2.0)  # in place: the same storage, a new version
        assert torch.equal(knots(copies, top_k=0.3), knots([tasks[0] * 2.0, *tasks[1:]], top_k=0.3))
    svds.clear()
    knots(tasks, top_k=0.3), knots(tasks, top_k=0.5)
    assert len(svds) == 2


# --------------------------------------------------------------------------- Fisher merging


def test_fisher_by_hand():
    tau = [torch.tensor([1.0, 2.0], dtype=f64), torch.tensor([3.0, -2.0], dtype=f64)]
    diagonals = [torch.tensor([1.0, 3.0], dtype=f64), torch.tensor([3.0, 1.0], dtype=f64)]
    torch.testing.assert_close(fisher(tau, fisher_diagonals=diagonals), torch.tensor([2.5, 1.0], dtype=f64))
    # the floor: an entry no Fisher sees is the mean; a Fisher below the floor counts as the floor
    tiny = [torch.tensor([0.0, 1e-9], dtype=f64), torch.tensor([0.0, 3e-6], dtype=f64)]
    torch.testing.assert_close(fisher(tau, fisher_diagonals=tiny),
                               torch.tensor([2.0, (1e-6 * 2 + 3e-6 * -2) / 4e-6], dtype=f64))
    torch.testing.assert_close(fisher(tau, fisher_diagonals=[torch.zeros(2)] * 2, fisher_floor=0.0),
                               torch.tensor([2.0, 0.0], dtype=f64))


def test_fisher_properties():
    tasks = _random_tasks(3, (4, 5), seed=49)
    diagonals = [d.abs() for d in _random_tasks(3, (4, 5), seed=50)]
    merged = fisher(tasks, fisher_diagonals=diagonals)
    torch.testing.assert_close(fisher(tasks[::-1], fisher_diagonals=diagonals[::-1]), merged)
    torch.testing.assert_close(fisher(tasks, fisher_diagonals=[torch.ones(4, 5)] * 3), weight_average(tasks))
    torch.testing.assert_close(fisher([tasks[0]], fisher_diagonals=[diagonals[0]]), tasks[0])
    torch.testing.assert_close(fisher(tasks, fisher_diagonals=[7 * d for d in diagonals]), merged)  # scale-free
    torch.testing.assert_close(fisher(tasks, fisher_diagonals=diagonals, scaling=2.0), 2 * merged)
    with pytest.raises(ValueError, match="one Fisher diagonal per task"):
        fisher(tasks, fisher_diagonals=diagonals[:2])
    with pytest.raises(ValueError, match="needs fisher_diagonals"):
        merge_parameter("w", tasks, "fisher")
    torch.testing.assert_close(merge_parameter("w", tasks, "fisher", {"seed": 3}, fisher_diagonals=diagonals),
                               merged)
    with pytest.raises(ValueError, match="fisher_diagonals are only used by fisher"):
        merge_parameter("w", tasks, "ties", fisher_diagonals=diagonals)


def test_learned_weight_methods_apply_their_weights():
    tasks = _random_tasks(3, (4, 5), seed=51)
    for method in (adamerging, lorahub):
        torch.testing.assert_close(method(tasks, [0.2, -0.5, 1.0]), 0.2 * tasks[0] - 0.5 * tasks[1] + tasks[2])
    for name in ("adamerging", "lorahub"):
        with pytest.raises(ValueError, match="needs weights from data"):
            merge_parameter("w", tasks, name)


# ---------------------------------------------------------------------- dtype, shape, registry


def _options_for(name, tasks):
    if name == "regmean":
        return {"gram_matrices": [torch.eye(tasks[0].shape[1]) * (index + 1) for index in range(len(tasks))]}
    if name in ("closed-form", "adamerging", "lorahub"):
        return {"weights": [0.5, -0.25, 1.0]}
    if name == "fisher":
        return {"fisher_diagonals": [task.abs() + index for index, task in enumerate(tasks)]}
    if name == "nan":
        return {"base_weight": torch.ones_like(tasks[0])}
    return {}


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_dtype_and_shape_preserved(name, dtype):
    tasks = _random_tasks(3, (6, 4), seed=18, dtype=dtype)
    method = STRATEGIES[name]
    merged = method.function(tasks, **method.options, **_options_for(name, tasks))
    assert merged.dtype == dtype and merged.shape == (6, 4)
    assert bool(torch.isfinite(merged.float()).all())


def test_registry_contents():
    expected = {
        "weight-average", "task-arithmetic", "ties", "dare", "breadcrumbs", "della", "tsv-m",
        "iso-c", "iso-cts", "cart", "star", "sftm", "regmean", "closed-form",
        "pcb", "consensus", "nan", "knots", "fisher", "adamerging", "lorahub",
    }  # fmt: skip
    assert set(STRATEGIES) == expected
    matrix_only = {name for name, method in STRATEGIES.items() if method.matrix_only}
    assert matrix_only == {"tsv-m", "iso-c", "iso-cts", "cart", "star", "sftm", "regmean", "knots"}
    assert STRATEGIES["pcb"].defaults == {"top_k": 0.1, "scaling": 1.0}
    assert STRATEGIES["consensus"].defaults == {"mask_lambda": 0.4, "min_tasks": 2, "scaling": 1.0}
    assert STRATEGIES["knots"].defaults == {"base": "ties", "top_k": 0.2, "scaling": 1.0}
    assert STRATEGIES["fisher"].inputs == ("fisher_diagonals",) and STRATEGIES["fisher"].data_options == {"seed": 0}
    assert STRATEGIES["adamerging"].data_options == {"granularity": "layer", "steps": 500, "learning_rate": 1e-3,
                                                     "initial": 0.3}
    assert STRATEGIES["lorahub"].data_options == {"steps": 40, "l1_weight": 0.05, "bound": 1.5, "seed": 42}
    assert STRATEGIES["ties"].defaults == {"top_k": 0.2, "scaling": 1.0, "weights": None, "normalize": True}
    assert STRATEGIES["iso-cts"].defaults["common_fraction"] == 0.8
    assert STRATEGIES["star"].defaults["energy_fraction"] == 0.4
    assert STRATEGIES["regmean"].defaults == {"off_diagonal_scale": 0.9, "scaling": 1.0}
    assert STRATEGIES["regmean"].inputs == ("gram_matrices",)
    assert STRATEGIES["closed-form"].inputs == ("weights",)
    assert STRATEGIES["closed-form"].defaults == {"granularity": "attn-mlp", "balance": True}
    assert STRATEGIES["closed-form"].function is weighted_task_arithmetic
    assert {name for name, method in STRATEGIES.items() if method.needs_data} == {
        "regmean", "closed-form", "fisher", "adamerging", "lorahub"}
    for method in STRATEGIES.values():
        assert method.description and method.function.__doc__


def test_registry_defaults_are_the_function_signatures():
    """One place for a default: change the function's and the registry follows."""

    def halve(task_vectors, *, scaling: float = 0.5, top_k: float = 0.1, seed: int = 3):
        """Test strategy."""
        return task_arithmetic(task_vectors, scaling=scaling)

    method = MergeMethod("halve", halve, "a test method")
    assert method.defaults == {"scaling": 0.5, "top_k": 0.1, "seed": 3}
    assert method.inputs == () and not method.needs_data
    assert method.resolve_options({"top_k": "30%", "seed": "7"}) == {"scaling": 0.5, "top_k": 0.3, "seed": 7}
    with pytest.raises(ValueError, match="unknown option 'k' for merge method 'halve' \\(options: scaling, seed, top_k\\)"):
        method.resolve_options({"k": 1})
    with pytest.raises(ValueError, match="cannot read 'many' as int"):
        method.resolve_options({"seed": "many"})
    import inspect

    for name, registered in STRATEGIES.items():
        signature = inspect.signature(registered.function).parameters
        for option, default in registered.options.items():
            assert signature[option].default == default, (name, option)


@pytest.mark.parametrize(
    "alias, method, implied",
    [("task_arithmetic", "task-arithmetic", {}), ("dare_ties", "dare", {"base": "ties"}),
     ("dare_linear", "dare", {"base": "task-arithmetic"}), ("linear", "weight-average", {}),
     ("ties", "ties", {}), ("della", "della", {}), ("breadcrumbs", "breadcrumbs", {})],
)
def test_mergekit_spellings_are_aliases(alias, method, implied):
    registered, options = resolve_method(alias, {"scaling": 0.5} if method != "weight-average" else {})
    assert registered.name == method
    assert options == {**implied, **({"scaling": 0.5} if method != "weight-average" else {})}
    tasks = _random_tasks(3, (4, 6), seed=22)
    torch.testing.assert_close(merge_parameter("w", tasks, alias, options), merge_parameter("w", tasks, method, options))


def test_mergekit_aliases_mean_the_same_merge():
    tasks = _random_tasks(3, (5, 4), seed=23)
    # dare_ties with no drop and no trim is TIES without trim; dare_linear with no drop is task arithmetic
    torch.testing.assert_close(merge_parameter("w", tasks, "dare_ties", {"drop_rate": 0.0}), ties(tasks, top_k=1.0))
    torch.testing.assert_close(merge_parameter("w", tasks, "dare_linear", {"drop_rate": 0.0}), task_arithmetic(tasks))
    torch.testing.assert_close(merge_parameter("w", tasks, "linear"), sum(tasks) / 3)
    with pytest.raises(ValueError, match="unknown merge method 'slerp'.*mergekit spellings: task_arithmetic"):
        resolve_method("slerp")


def test_closed_form_is_weighted_task_arithmetic_and_needs_its_weights():
    tasks = _random_tasks(3, (4, 5), seed=24)
    with pytest.raises(ValueError, match="needs weights from data"):
        merge_parameter("w", tasks, "closed-form")
    per_row = [torch.arange(4, dtype=f64)[:, None], torch.ones(4, 1, dtype=f64), 0.5]
    expected = per_row[0] * tasks[0] + tasks[1] + 0.5 * tasks[2]
    torch.testing.assert_close(weighted_task_arithmetic(tasks, per_row), expected, rtol=0, atol=1e-15)
    # float16 inputs are weighted and summed in float32, returned in float16
    half = [t.to(torch.float16) for t in tasks]
    merged = weighted_task_arithmetic(half, [0.1, 0.2, 0.3])
    exact = sum(w * t.to(torch.float32) for w, t in zip([0.1, 0.2, 0.3], half))
    assert merged.dtype == torch.float16 and torch.equal(merged, exact.to(torch.float16))


def test_matrix_methods_reject_vectors():
    with pytest.raises(ValueError, match=r"2-D task matrices, got task_vectors of shape \(4,\)"):
        tsv_m([torch.ones(4), torch.ones(4)])
    with pytest.raises(ValueError, match="one shape"):
        task_arithmetic([torch.ones(4), torch.ones(5)])
    with pytest.raises(ValueError, match="empty"):
        ties([])


# ------------------------------------------------------------------------- merge_parameter


def test_merge_parameter_kind_comes_from_the_table_or_the_shape():
    """No name heuristics: without the table's kind a tensor is a matrix (2-D or more) or a bias."""
    vectors = [torch.tensor([1.0, 2.0], dtype=f64), torch.tensor([3.0, -4.0], dtype=f64)]
    # a 1-D "norm" by name is a bias without kind= (task arithmetic under a matrix-only method) ...
    torch.testing.assert_close(merge_parameter("final_norm.weight", vectors, "iso-c"), torch.tensor([4.0, -2.0], dtype=f64))
    # ... and a norm with it (mean)
    torch.testing.assert_close(
        merge_parameter("final_norm.weight", vectors, "iso-c", kind="norm"), torch.tensor([2.0, -1.0], dtype=f64)
    )
    embeddings = _random_tasks(2, (10, 4), seed=19)
    torch.testing.assert_close(merge_parameter("model.embed_tokens.weight", embeddings, "iso-c"), iso_c(embeddings))
    with pytest.raises(ValueError, match="kind must be one of"):
        merge_parameter("w", vectors, "ties", kind="vector")


def test_merge_parameter_fallbacks():
    vectors = [torch.tensor([1.0, 2.0], dtype=f64), torch.tensor([3.0, -4.0], dtype=f64)]
    # Matrix-only method on a bias -> task arithmetic (on a norm -> mean: test above).
    torch.testing.assert_close(merge_parameter("layer.bias", vectors, "tsv-m"), torch.tensor([4.0, -2.0], dtype=f64))
    embeddings = _random_tasks(2, (10, 4), seed=19)
    torch.testing.assert_close(
        merge_parameter("model.embed_tokens.weight", embeddings, "sftm", kind="embedding"), task_arithmetic(embeddings)
    )
    # The caller overrides the fallback or the kind.
    torch.testing.assert_close(
        merge_parameter("layer.bias", vectors, "star", fallback={"bias": ("task-arithmetic", {"scaling": 0.5})}),
        torch.tensor([2.0, -1.0], dtype=f64),
    )
    torch.testing.assert_close(
        merge_parameter("layer.bias", vectors, "star", fallback={"bias": "weight-average"}),
        torch.tensor([2.0, -1.0], dtype=f64),
    )
    torch.testing.assert_close(merge_parameter("lm_head.weight", embeddings, "iso-c", kind="matrix"), iso_c(embeddings))
    # Element-wise methods apply to every kind.
    torch.testing.assert_close(merge_parameter("layer.bias", vectors, "ties", {"top_k": 1.0}), ties(vectors, top_k=1.0))
    assert DEFAULT_FALLBACK["norm"][0] == "weight-average"


def test_merge_parameter_options_and_reshape():
    tasks = _random_tasks(3, (4, 6), seed=20)
    torch.testing.assert_close(
        merge_parameter("mlp.up_proj.weight", tasks, "ties", {"top_k": "50%", "scaling": "0.5"}),
        ties(tasks, top_k=0.5, scaling=0.5),
    )
    with pytest.raises(ValueError, match="unknown option 'k' for merge method 'ties'"):
        merge_parameter("mlp.up_proj.weight", tasks, "ties", {"k": 0.2})
    with pytest.raises(ValueError, match="unknown merge method"):
        merge_parameter("mlp.up_proj.weight", tasks, "slerp")
    kernels = [task.reshape(4, 3, 2) for task in tasks]
    torch.testing.assert_close(merge_parameter("conv.weight", kernels, "tsv-m"), tsv_m(tasks).reshape(4, 3, 2))
    with pytest.raises(ValueError, match="regmean needs gram_matrices"):
        merge_parameter("mlp.up_proj.weight", tasks, "regmean")
    grams = [torch.eye(6, dtype=f64)] * 3
    torch.testing.assert_close(
        merge_parameter("mlp.up_proj.weight", tasks, "regmean", gram_matrices=grams), weight_average(tasks)
    )


def test_merge_parameter_seeds_differ_by_name():
    tasks = _random_tasks(2, (6, 6), seed=21)
    first = merge_parameter("layers.0.q_proj.weight", tasks, "dare", {"drop_rate": 0.5})
    assert torch.equal(first, merge_parameter("layers.0.q_proj.weight", tasks, "dare", {"drop_rate": 0.5}))
    assert not torch.equal(first, merge_parameter("layers.1.q_proj.weight", tasks, "dare", {"drop_rate": 0.5}))


# -------------------------------------------------------------------- hypothesis properties

_small_tasks = st.integers(min_value=1, max_value=4).flatmap(
    lambda count: st.tuples(
        st.integers(min_value=0, max_value=2**31 - 1),
        st.just(count),
        st.integers(min_value=1, max_value=5),
        st.integers(min_value=1, max_value=5),
    )
)


def _draw_tasks(params):
    seed, count, rows, columns = params
    return _random_tasks(count, (rows, columns), seed=seed % 10_000)


@settings(max_examples=40, deadline=None)
@given(_small_tasks, st.randoms(use_true_random=False))
def test_task_order_does_not_matter(params, random):
    tasks = _draw_tasks(params)
    permuted = list(tasks)
    random.shuffle(permuted)
    for merge in (weight_average, task_arithmetic, lambda t: ties(t, top_k=0.4), lambda t: ties(t, top_k=1.0)):
        torch.testing.assert_close(merge(permuted), merge(tasks), atol=1e-12, rtol=0)


@settings(max_examples=40, deadline=None)
@given(_small_tasks)
def test_single_task_returns_itself(params):
    task = _draw_tasks(params)[0]
    torch.testing.assert_close(task_arithmetic([task], scaling=1.0), task)
    torch.testing.assert_close(ties([task], top_k=1.0, scaling=1.0), task)
    torch.testing.assert_close(weight_average([task]), task)
    torch.testing.assert_close(cart([task], rank_ratio=0.5), task)
    torch.testing.assert_close(star([task], energy_fraction=1.0), task, atol=1e-10, rtol=0)
    torch.testing.assert_close(sftm([task], top_k=1.0), task, atol=1e-10, rtol=0)


@settings(max_examples=30, deadline=None)
@given(_small_tasks, st.floats(min_value=-3, max_value=3, allow_nan=False))
def test_scaling_is_linear(params, scaling):
    tasks = _draw_tasks(params)
    torch.testing.assert_close(task_arithmetic(tasks, scaling=scaling), scaling * task_arithmetic(tasks))
    torch.testing.assert_close(ties(tasks, top_k=0.5, scaling=scaling), scaling * ties(tasks, top_k=0.5))
    torch.testing.assert_close(tsv_m(tasks, scaling=scaling), scaling * tsv_m(tasks), atol=1e-10, rtol=1e-10)


# ----------------------------------------------------------------- precision and row chunks

_ELEMENT_WISE = {
    "weight-average": {},
    "task-arithmetic": {"scaling": 0.7},
    "ties": {"top_k": 0.3, "scaling": 0.9},
    "dare": {"drop_rate": 0.5, "seed": 4},
    "dare-ties": {"drop_rate": 0.3, "seed": 5, "base": "ties", "top_k": 0.4},
    "breadcrumbs": {"beta": 0.2, "gamma": 0.9},
    "della": {"drop_rate": 0.4, "epsilon": 0.2, "seed": 6},
    "consensus": {"mask_lambda": 0.3, "min_tasks": 2, "scaling": 0.8},
}


def _element_wise(name, tasks):
    method = "dare" if name == "dare-ties" else name
    return STRATEGIES[method].function(tasks, **_ELEMENT_WISE[name])


@pytest.mark.parametrize("name", list(_ELEMENT_WISE))
def test_row_chunks_give_the_whole_tensor_result(monkeypatch, name):
    """Above CHUNK_THRESHOLD the element-wise methods run row chunk by row chunk: bitwise the same merge
    (same trim thresholds, same random stream), including equal magnitudes across chunk borders."""
    import submerge.merge.strategies as module

    generator = torch.Generator().manual_seed(30)
    tasks = [torch.randint(-6, 7, (37, 11), generator=generator).float() * 0.25 for _ in range(3)]  # many ties
    tasks += [torch.randn(37, 11, generator=generator)]
    whole = _element_wise(name, tasks)
    monkeypatch.setattr(module, "CHUNK_THRESHOLD", 50)
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", 40)  # 3 rows per chunk, 13 chunks
    assert len(module._row_chunks((37, 11))) == 13
    chunked = _element_wise(name, tasks)
    assert chunked.dtype == torch.float32 and torch.equal(chunked, whole), name


def test_trim_with_equal_magnitudes_keeps_exactly_k_the_earlier_ones_first(monkeypatch):
    import submerge.merge.strategies as module

    values = torch.tensor([[1.0, -2.0, 2.0], [2.0, 3.0, -2.0], [2.0, 0.5, 1.0]])
    # top 4 of 9: 3 and the first three of the five 2s in row-major order (a stable descending sort)
    expected = torch.tensor([[0.0, -2.0, 2.0], [2.0, 3.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(keep_top_magnitude(values, 4 / 9), expected)
    monkeypatch.setattr(module, "CHUNK_THRESHOLD", 1)
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", 3)  # one row per chunk: the equal entries span chunks
    assert torch.equal(ties([values], top_k=4 / 9), expected)
    reference = torch.zeros(9, dtype=torch.bool)
    reference[torch.argsort(values.abs().reshape(-1), descending=True, stable=True)[:4]] = True
    assert torch.equal(expected != 0, reference.reshape(3, 3))
    # Breadcrumbs ranks by a stable ascending sort: of equal magnitudes the later ones count as larger
    mask = breadcrumbs_mask(values, beta=0.0, gamma=5 / 9)  # drops the 4 largest: 3 and the last three 2s
    assert torch.equal(mask, torch.tensor([[True, True, True], [False, False, False], [False, True, True]]))


@pytest.mark.parametrize("name", list(_ELEMENT_WISE))
def test_float32_computation_is_within_1e6_of_float64(name):
    tasks32 = _random_tasks(3, (16, 12), seed=31, dtype=torch.float32)
    in32 = _element_wise(name, tasks32)
    in64 = _element_wise(name, [t.to(f64) for t in tasks32])
    assert in32.dtype == torch.float32 and in64.dtype == f64
    assert (in32.to(f64) - in64).abs().max().item() <= 1e-6, name
    # half-precision inputs are computed in float32, then rounded once
    half = [t.to(torch.float16) for t in tasks32]
    from_half = _element_wise(name, half)
    assert from_half.dtype == torch.float16
    assert torch.equal(from_half, _element_wise(name, [t.float() for t in half]).to(torch.float16)), name


def test_compute_dtype_is_at_least_float32():
    from submerge.merge.strategies import compute_dtype

    assert compute_dtype(torch.bfloat16) == torch.float32 and compute_dtype(torch.float16) == torch.float32
    assert compute_dtype(torch.float32) == torch.float32 and compute_dtype(f64) == f64


def test_weight_average_and_star_scaling_multiply_the_merged_update():
    """The soup's and STAR's ``scaling`` λ (1: the paper's merge, bitwise) is λ times the unscaled update: what a
    tuned plan's blocks merged by either carry (`merge.plan.tuned_plan`)."""
    generator = torch.Generator().manual_seed(5)
    vectors = [torch.randn(6, 4, generator=generator, dtype=f64) for _ in range(3)]
    torch.testing.assert_close(weight_average(vectors), (vectors[0] + vectors[1] + vectors[2]) / 3)
    for method in (weight_average, star):
        plain = method(vectors)
        assert torch.equal(method(vectors, scaling=1.0), plain)
        torch.testing.assert_close(method(vectors, scaling=1.7), 1.7 * plain, rtol=1e-12, atol=1e-12)


def test_regmean_scaling_multiplies_the_merged_update():
    """RegMean's ``scaling`` λ (1: the paper's merge) is λ times the unscaled τ_M, for every Gram."""
    generator = torch.Generator().manual_seed(3)
    vectors = [torch.randn(4, 3, generator=generator, dtype=f64) for _ in range(2)]
    inputs = [torch.randn(6, 3, generator=generator, dtype=f64) for _ in range(2)]
    grams = [x.T @ x for x in inputs]
    plain = regmean(vectors, gram_matrices=grams)
    torch.testing.assert_close(regmean(vectors, gram_matrices=grams, scaling=0.4), 0.4 * plain)
    assert torch.equal(regmean(vectors, gram_matrices=grams, scaling=1.0), plain)
