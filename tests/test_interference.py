"""Known-answer and property tests for submerge.diagnostics.interference (weight-space metrics)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from submerge.diagnostics.execution import RayEngine
from submerge.diagnostics.interference import (
    DEFAULT_RANK_FRACS,
    centered,
    cosine_similarity,
    driver,
    effective_rank,
    effective_rank_cutoff,
    effective_rank_from_singular_values,
    matrix_interference,
    rank_from_fraction,
    reconstruction_error,
    row_space_interference,
    sar,
    sign_conflict_rate,
    sti,
    sti_rank,
    task_vector_norm,
)
from submerge.merge.strategies import MergedTaskVector

F64 = torch.float64


def outer(u, v):
    return torch.outer(torch.tensor(u, dtype=F64), torch.tensor(v, dtype=F64))


# Two 3×3 task matrices built from explicit singular triplets.
#   Δ_1 = 3·e1 e1ᵀ + 1·e2 e2ᵀ                     σ(Δ_1) = (3, 1, 0)
#   Δ_2 = 2·u vᵀ + 0.5·u' v'ᵀ                     σ(Δ_2) = (2, 0.5, 0)
#   u = (3/5, 4/5, 0), u' = (−4/5, 3/5, 0)  (orthonormal)
#   v = (4/5, 0, 3/5), v' = (0, 1, 0)       (orthonormal)
U_2, U_2_SECOND = [0.6, 0.8, 0.0], [-0.8, 0.6, 0.0]
V_2, V_2_SECOND = [0.8, 0.0, 0.6], [0.0, 1.0, 0.0]
DELTA_1 = 3 * outer([1, 0, 0], [1, 0, 0]) + 1 * outer([0, 1, 0], [0, 1, 0])
DELTA_2 = 2 * outer(U_2, V_2) + 0.5 * outer(U_2_SECOND, V_2_SECOND)


def random_task_matrices(seed: int, shape=(12, 9), num_tasks=3, dtype=F64):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype) for _ in range(num_tasks)]


def block_orthogonal_tasks(num_tasks=3, block=2, seed=0):
    """Δ_t non-zero only on rows and columns [block·t, block·(t+1)): mutually
    orthogonal column spaces (U) and row spaces (V)."""
    generator = torch.Generator().manual_seed(seed)
    size = num_tasks * block
    tasks = []
    for t in range(num_tasks):
        delta = torch.zeros(size, size, dtype=F64)
        delta[block * t : block * (t + 1), block * t : block * (t + 1)] = torch.randn(block, block, generator=generator, dtype=F64)
        tasks.append(delta)
    return tasks


# ------------------------------------------------------------------- simple metrics


def test_cosine_and_sign_conflict_on_tiny_examples():
    a = torch.tensor([1.0, -2.0, 0.0, 3.0])
    b = torch.tensor([-1.0, -1.0, 5.0, -2.0])
    # opposite non-zero signs at entries 0 and 3; entry 2 has a zero → 2 of 4 entries
    assert sign_conflict_rate(a, b) == 0.5
    assert sign_conflict_rate(a, a) == 0.0
    assert sign_conflict_rate(a, -a) == 0.75  # the zero entry is never a conflict, but counts in N
    # ⟨a,b⟩ = −1 + 2 + 0 − 6 = −5, ‖a‖ = √14, ‖b‖ = √31
    assert cosine_similarity(a, b) == pytest.approx(-5 / math.sqrt(14 * 31), abs=1e-12)
    assert cosine_similarity(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])) == pytest.approx(1 / math.sqrt(2))
    assert math.isnan(cosine_similarity(a, torch.zeros(4)))
    assert task_vector_norm(torch.tensor([[3.0, 0.0], [0.0, 4.0]])) == pytest.approx(5.0)
    with pytest.raises(ValueError, match=r"\(4,\).*\(3,\)"):
        cosine_similarity(a, torch.zeros(3))


def test_effective_rank_known_values():
    assert effective_rank(torch.eye(5, dtype=F64)) == pytest.approx(5.0)
    assert effective_rank(outer([1, 2, 3], [4, 5])) == pytest.approx(1.0)
    # σ = (3, 1): p = (3/4, 1/4), exp(H) = (3/4)^(−3/4) (1/4)^(−1/4) = 4 / 3^(3/4)
    assert effective_rank(torch.diag(torch.tensor([3.0, 1.0], dtype=F64))) == pytest.approx(4 / 3**0.75)
    assert effective_rank_from_singular_values([1.0, 1.0, 0.0]) == pytest.approx(2.0)
    assert math.isnan(effective_rank_from_singular_values([0.0, 0.0]))
    with pytest.raises(ValueError, match="2-D"):
        effective_rank(torch.ones(3))


# ------------------------------------------------------------------------------ STI


def test_sti_hand_computed_two_tasks():
    # T = 2, min(m, n) = 3 → k = ⌊3/2⌋ = 1: U = [e1, u], V = [e1, v], Σ = diag(3, 2).
    #   UᵀU − I = [[0, e1·u], [e1·u, 0]] = [[0, .6], [.6, 0]]
    #   VᵀV − I = [[0, e1·v], [e1·v, 0]] = [[0, .8], [.8, 0]]
    #   (UᵀU − I) Σ = [[0, 1.2], [1.8, 0]]
    #   (UᵀU − I) Σ (VᵀV − I) = [[1.2·.8, 0], [0, 1.8·.8]] = [[0.96, 0], [0, 1.44]]
    #   STI = 0.96 + 1.44 = 2.4;  Σσ = 3 + 2 = 5  →  normalised 0.48
    value, normalized, k = sti([DELTA_1, DELTA_2], svd_dtype="float64")
    assert k == 1
    assert value == pytest.approx(2.4, abs=1e-12)
    assert normalized == pytest.approx(0.48, abs=1e-12)


def test_sti_zero_for_orthogonal_subspaces():
    tasks = block_orthogonal_tasks(num_tasks=3, block=2)
    value, normalized, k = sti(tasks, svd_dtype="float64")
    assert k == 2  # ⌊6/3⌋
    assert value == pytest.approx(0.0, abs=1e-12)
    assert normalized == pytest.approx(0.0, abs=1e-12)


def test_sti_ignores_null_directions_of_rank_deficient_tasks():
    # k = ⌊4/2⌋ = 2 but each task has rank 1; the σ = 0 direction is not unique
    # and is dropped, so the (orthogonal) tasks give exactly 0.
    delta_1 = outer([1, 0, 0, 0], [1, 0, 0, 0])
    delta_2 = 2 * outer([0, 1, 0, 0], [0, 1, 0, 0])
    assert sti([delta_1, delta_2], svd_dtype="float64")[0] == pytest.approx(0.0, abs=1e-12)
    zero_value, zero_normalized, _ = sti([torch.zeros(3, 3), torch.zeros(3, 3)])
    assert zero_value == 0.0 and math.isnan(zero_normalized)


def test_sti_rank_rule_and_shape_errors():
    assert sti_rank((4096, 11008), 3) == 1365
    assert sti_rank((2, 10), 5) == 1  # max(1, ·)
    with pytest.raises(ValueError, match=r"\(3, 3\).*\(3, 4\)"):
        sti([torch.zeros(3, 3), torch.zeros(3, 4)])


# ------------------------------------------------------------------------------ SAR


def test_effective_rank_cutoff_hand_spectrum():
    # σ = (3, 2, 1, 0.1): σ² = (9, 4, 1, 0.01), Σσ² = 14.01
    # ε = 0.05: ε²Σσ² = 0.035025; tails Σ_{i>k}σ² for k=1,2,3 = 5.01, 1.01, 0.01 → k_M = 3
    assert effective_rank_cutoff([3, 2, 1, 0.1], 0.05) == 3
    # ε = 0.3: ε²Σσ² = 1.2609 ≥ 1.01 (k=2) but < 5.01 (k=1) → k_M = 2
    assert effective_rank_cutoff([3, 2, 1, 0.1], 0.3) == 2
    assert effective_rank_cutoff([0.1, 3, 1, 2], 0.3) == 2  # order does not matter
    assert effective_rank_cutoff([3, 2, 1, 0.1], 0.0) == 4
    assert effective_rank_cutoff([3, 2, 1, 0.1], 1.0) == 0  # k = 0 already meets ε = 1
    assert effective_rank_cutoff([0.0, 0.0], 0.05) == 0


def test_sar_inside_orthogonal_and_partial():
    # Δ_M = diag(10, 5, 0.1): σ² = (100, 25, 0.01); ε²Σ = 0.3125 → k_M = 2, top space span(e1, e2)
    merged = torch.diag(torch.tensor([10.0, 5.0, 0.1], dtype=F64))
    inside = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64)
    orthogonal = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, -2.0, 5.0]], dtype=F64)
    partial = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 4.0, 0.0]], dtype=F64)
    assert sar(inside, merged, svd_dtype="float64") == (pytest.approx(1.0, abs=1e-12), 2)
    assert sar(orthogonal, merged, svd_dtype="float64")[0] == pytest.approx(0.0, abs=1e-12)
    assert sar(partial, merged, svd_dtype="float64")[0] == pytest.approx(3 / 5, abs=1e-12)  # ‖(3,0)‖/‖(3,4)‖
    assert math.isnan(sar(torch.zeros(3, 3, dtype=F64), merged)[0])
    with pytest.raises(ValueError, match="differ in shape"):
        sar(inside, torch.zeros(3, 4))


# ---------------------------------------------------------------------- CART I(k), R(k)


def test_row_space_interference_and_reconstruction_hand_computed():
    tasks = [DELTA_1, DELTA_2]
    # k = 1: σ̃ = 1 for both tasks, Ṽ_1 = e1, Ṽ_2 = v; I = 2·|e1·v| = 2·0.8
    assert row_space_interference(tasks, 1, svd_dtype="float64") == pytest.approx(1.6, abs=1e-12)
    # k = 2: Σ̃_1 = diag(3,1)/√10, Σ̃_2 = diag(2,.5)/√4.25, Ṽ_1ᵀṼ_2 = [[.8, 0], [0, 1]]
    #   Σ̃_1 Ṽ_1ᵀ Ṽ_2 Σ̃_2 = diag(4.8, 0.5)/√42.5 → ‖·‖_F = √(23.04 + 0.25)/√42.5; two ordered pairs
    assert row_space_interference(tasks, 2, svd_dtype="float64") == pytest.approx(2 * math.sqrt(23.29 / 42.5), abs=1e-12)
    # R(1) = 1² + 0.5² (discarded σ²), R(2) = R(3) = 0
    assert reconstruction_error(tasks, 1, svd_dtype="float64") == pytest.approx(1.25, abs=1e-12)
    assert reconstruction_error(tasks, 2, svd_dtype="float64") == pytest.approx(0.0, abs=1e-12)
    assert reconstruction_error(tasks, 3, svd_dtype="float64") == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="rank k"):
        row_space_interference(tasks, 4)


def test_row_space_interference_zero_for_orthogonal_row_spaces():
    tasks = block_orthogonal_tasks(num_tasks=3, block=2, seed=1)
    for k in range(1, 7):
        assert row_space_interference(tasks, k, svd_dtype="float64") == pytest.approx(0.0, abs=1e-10)


def test_reconstruction_error_is_sum_of_discarded_squares():
    tasks = random_task_matrices(3, shape=(7, 5), num_tasks=2)
    spectra = [torch.linalg.svdvals(t) for t in tasks]
    for k in range(1, 6):
        expected = sum(float((s[k:] ** 2).sum()) for s in spectra)
        assert reconstruction_error(tasks, k, svd_dtype="float64") == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert reconstruction_error(tasks, 5, svd_dtype="float64") == pytest.approx(0.0, abs=1e-20)


@pytest.mark.parametrize("chunk", [1 << 20, 12, 7, 1])  # one block; whole rows per block; a partial last block; < a row
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
def test_centered_row_blocks_are_bitwise_the_whole_matrix_arithmetic(chunk, dtype, monkeypatch):
    """The centred matrices, computed row block by row block, equal the whole-matrix float64 formula bit for bit, in
    the inputs' dtype promoted to float32, on both sides of the block size."""
    from submerge.diagnostics.interference import metrics

    monkeypatch.setattr(metrics, "_CHUNK", chunk)
    generator = torch.Generator().manual_seed(11)
    weights = [torch.randn(9, 6, generator=generator).to(dtype) for _ in range(3)]
    mean = torch.zeros(9, 6, dtype=F64)
    for weight in weights:
        mean += weight.to(F64)
    mean /= 3
    out_dtype = torch.promote_types(dtype, torch.float32)
    for index, (got, weight) in enumerate(zip(centered(weights), weights)):
        assert got.dtype == out_dtype and torch.equal(got, (weight.to(F64) - mean).to(out_dtype))
        assert torch.equal(metrics.centered_one(weights, index), got)  # alone, as the exact route takes them


def test_the_exact_route_keeps_only_the_left_vectors_sti_reads(monkeypatch):
    """The exact route's task SVDs keep U[:, :k] for STI's k = ⌊min(m, n) / T⌋ (nothing else reads U: a 7B
    embedding's full U is 0.8 GB per task), and its centred SVDs get one Δ̄_t at a time; the figures are those of
    the full decompositions (the 2×2 STI case above and the exact-route tests pin their values)."""
    from submerge.diagnostics import spectral
    from submerge.diagnostics.interference import metrics

    widths, live = [], []
    real_concat, real_svd = metrics.concat_top, metrics.thin_svd
    monkeypatch.setattr(metrics, "concat_top", lambda svds, ks: widths.extend(s.U.shape[1] for s in svds)
                        or real_concat(svds, ks))

    def watched_svd(matrix, dtype):
        live.append(matrix.shape)
        return real_svd(matrix, dtype)

    monkeypatch.setattr(metrics, "thin_svd", watched_svd)
    matrices = random_task_matrices(3, shape=(40, 13), num_tasks=3)
    result = metrics.task_matrix_interference(matrices, exact_svd=True)
    assert widths == [4, 4, 4] and result["sti_k"] == 4  # ⌊13 / 3⌋
    assert len(live) == 2 * 3 + 1  # T task matrices, the merged one, T centred ones
    full = [spectral.thin_svd(m, torch.float32) for m in matrices]
    expected = metrics._sti_from_svds(full, (40, 13), torch.float32)
    assert (result["sti"], result["sti_normalized"], result["sti_k"]) == expected


def test_centered_and_rank_fractions():
    base = torch.randn(4, 3, dtype=F64)
    weights = [base + d for d in random_task_matrices(5, shape=(4, 3), num_tasks=3)]
    centred_weights = centered(weights)
    centred_deltas = centered([w - base for w in weights])
    torch.testing.assert_close(sum(centred_weights), torch.zeros(4, 3, dtype=F64), atol=1e-12, rtol=0)
    for a, b in zip(centred_weights, centred_deltas):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)  # translation invariant
    torch.testing.assert_close(centred_weights[0], weights[0] - (weights[0] + weights[1] + weights[2]) / 3)
    assert [rank_from_fraction(f, 100) for f in DEFAULT_RANK_FRACS] == [1, 2, 4, 8, 16, 32, 64, 100]
    assert rank_from_fraction(0.5, 5) == 3  # 2.5 rounds half up
    assert rank_from_fraction(0.01, 10) == 1  # max(1, round(0.1))
    with pytest.raises(ValueError, match="rank fraction"):
        rank_from_fraction(0.0, 10)


# ---------------------------------------------------------------- matrix_interference


def test_matrix_interference_matches_single_metrics():
    base = torch.randn(10, 8, dtype=F64, generator=torch.Generator().manual_seed(11))
    deltas = random_task_matrices(12, shape=(10, 8), num_tasks=3)
    finetuned = [base + d for d in deltas]
    result = matrix_interference(base, finetuned, rank_fracs=(0.25, 0.5, 1.0), svd_dtype="float64")
    assert list(result["ranks"]) == [2, 4, 8]
    assert result["sti_k"] == 2
    value, normalized, _ = sti(deltas, svd_dtype="float64")
    assert result["sti"] == pytest.approx(value, rel=1e-10)
    assert result["sti_normalized"] == pytest.approx(normalized, rel=1e-10)
    merged = deltas[0] + deltas[1] + deltas[2]
    for t, delta in enumerate(deltas):
        sar_value, k_merged = sar(delta, merged, svd_dtype="float64")
        assert result["sar"][t] == pytest.approx(sar_value, rel=1e-10)
        assert result["sar_k"] == k_merged
        assert result["task_vector_norm"][t] == pytest.approx(float(torch.linalg.norm(delta)), rel=1e-12)
        assert result["effective_rank"][t] == pytest.approx(effective_rank(delta, svd_dtype="float64"), rel=1e-10)
    assert result["cosine"][0, 2] == pytest.approx(cosine_similarity(deltas[0], deltas[2]), rel=1e-10)
    assert result["cosine"][2, 0] == result["cosine"][0, 2]
    assert result["sign_conflict"][1, 2] == sign_conflict_rate(deltas[1], deltas[2])
    for index, k in enumerate(result["ranks"]):
        k = int(k)
        assert result["row_space_interference"][index, 0] == pytest.approx(row_space_interference(deltas, k, svd_dtype="float64"), rel=1e-10)
        assert result["row_space_interference"][index, 1] == pytest.approx(
            row_space_interference(centered(deltas), k, svd_dtype="float64"), rel=1e-10
        )
        assert result["reconstruction_error"][index, 1] == pytest.approx(
            reconstruction_error(centered(deltas), k, svd_dtype="float64"), rel=1e-10, abs=1e-12
        )


def test_matrix_interference_sar_equals_one_inside_merged_space():
    # Δ_M = Δ_1 (rank 2 of 6×5) → k_M = 2 and Δ_1 lies inside it; Δ_2 is orthogonal to it.
    base = torch.zeros(6, 5, dtype=F64)
    delta_1 = outer([1, 0, 0, 0, 0, 0], [1, 2, 0, 0, 0]) + outer([0, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0])
    delta_2 = outer([0, 0, 0, 1, 0, 0], [1, 1, 1, 1, 1])
    result = matrix_interference(base, [delta_1, delta_2], merged=delta_1, svd_dtype="float64")
    assert result["sar_k"] == 2
    assert result["sar"] == pytest.approx([1.0, 0.0], abs=1e-12)


def test_matrix_interference_unchanged_matrix_gives_nan_not_error():
    base = torch.randn(5, 4)
    result = matrix_interference(base, [base.clone(), base + torch.randn(5, 4)])
    assert result["task_vector_norm"][0] == 0.0
    assert math.isnan(result["effective_rank"][0])
    assert math.isnan(result["cosine"][0, 1])
    assert math.isnan(result["sar"][0])
    assert np.isnan(result["row_space_interference"][:, 0]).all()  # task 0 has no top-k energy
    assert np.isfinite(result["row_space_interference"][:, 1]).all()  # centred tasks are ±(Δ_2/2)
    assert math.isfinite(result["sti"])
    with pytest.raises(ValueError, match=r"finetuned\[0\] has shape \(4, 5\)"):
        matrix_interference(base, [torch.zeros(4, 5)])


def test_float32_and_float64_agree():
    # low-rank signal + noise, the shape of real task matrices; rel. tolerance 1e-4
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(48, 40, generator=generator, dtype=F64)
    finetuned = []
    for _ in range(3):
        low_rank = torch.randn(48, 4, generator=generator, dtype=F64) @ torch.randn(4, 40, generator=generator, dtype=F64)
        finetuned.append(base + 0.1 * low_rank + 0.01 * torch.randn(48, 40, generator=generator, dtype=F64))
    single = matrix_interference(base.float(), [w.float() for w in finetuned], svd_dtype="float32")
    double = matrix_interference(base, finetuned, svd_dtype="float64")
    assert single["sti_k"] == double["sti_k"] and single["sar_k"] == double["sar_k"]
    for key in ("task_vector_norm", "effective_rank", "cosine", "sti", "sti_normalized", "sar",
                "row_space_interference", "reconstruction_error"):
        np.testing.assert_allclose(single[key], double[key], rtol=1e-4, atol=1e-6, err_msg=key)
    np.testing.assert_array_equal(single["sign_conflict"], double["sign_conflict"])


# --------------------------------------------------------------------- properties

shapes = st.tuples(st.integers(2, 7), st.integers(2, 7))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, num_tasks=st.integers(2, 4))
def test_sti_nonnegative_and_symmetric_in_task_order(seed, shape, num_tasks):
    tasks = random_task_matrices(seed, shape=shape, num_tasks=num_tasks)
    value, normalized, _ = sti(tasks, svd_dtype="float64")
    reversed_value, reversed_normalized, _ = sti(tasks[::-1], svd_dtype="float64")
    rotated_value, _, _ = sti(tasks[1:] + tasks[:1], svd_dtype="float64")
    assert value >= 0.0 and normalized >= 0.0
    assert reversed_value == pytest.approx(value, rel=1e-9, abs=1e-12)
    assert rotated_value == pytest.approx(value, rel=1e-9, abs=1e-12)
    assert reversed_normalized == pytest.approx(normalized, rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, num_tasks=st.integers(2, 4), rank_frac=st.floats(0.01, 1.0))
def test_row_space_interference_symmetric_and_bounded(seed, shape, num_tasks, rank_frac):
    tasks = random_task_matrices(seed, shape=shape, num_tasks=num_tasks)
    k = rank_from_fraction(rank_frac, min(shape))
    value = row_space_interference(tasks, k, svd_dtype="float64")
    assert value == pytest.approx(row_space_interference(tasks[::-1], k, svd_dtype="float64"), rel=1e-9, abs=1e-12)
    # each term is ‖A B‖_F with ‖A‖_F = ‖B‖_F = 1 and orthonormal Ṽ → ≤ 1
    assert -1e-12 <= value <= num_tasks * (num_tasks - 1) + 1e-9


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=shapes, eps=st.floats(0.0, 0.9))
def test_sar_in_unit_interval(seed, shape, eps):
    task_matrix, merged = random_task_matrices(seed, shape=shape, num_tasks=2)
    value, k_merged = sar(task_matrix, merged, eps, svd_dtype="float64")
    assert 0.0 <= value <= 1.0
    assert 1 <= k_merged <= min(shape)
    if shape[0] <= shape[1]:  # ε = 0 keeps all m left singular vectors of a full-rank Δ_M: the whole space
        assert sar(task_matrix, merged, 0.0, svd_dtype="float64")[0] == pytest.approx(1.0, abs=1e-9)


# ------------------------------------------------------- submerge.diagnostics.spectral (shared with merge)


def test_numerical_rank_known_spectra():
    from submerge.diagnostics.spectral import numerical_rank

    spectrum = torch.tensor([2.0, 1.0, 1e-9, 0.0], dtype=F64)
    # float64 eps·σ_max·max(m, n) = 2.2e-16·2·4 ≈ 1.8e-15: 1e-9 counts; float32 eps ≈ 1.2e-7: it does not
    assert numerical_rank(spectrum, (4, 3), torch.float64) == 3
    assert numerical_rank(spectrum, (4, 3), torch.float32) == 2
    assert numerical_rank(spectrum, (4, 3), torch.bfloat16) == 2  # judged at float32 precision
    assert numerical_rank(spectrum, (4, 3), torch.float64, scale=1e7) == 2  # 1e7·4·2.2e-16 ≈ 8.9e-9 > 1e-9
    assert numerical_rank(torch.zeros(3, dtype=F64), (3, 3), torch.float64) == 0
    assert numerical_rank(torch.zeros(0, dtype=F64), (3, 3), torch.float64) == 0


def test_concat_top_blocks_and_thin_svd():
    from submerge.diagnostics.spectral import concat_top, svd_dtype, thin_svd

    first_matrix = outer([1, 0, 0], [0, 1]) * 3 + outer([0, 1, 0], [1, 0])  # σ = (3, 1)
    second_matrix = outer([0, 0, 1], [1, 0]) * 2  # σ = (2, 0)
    first, second = thin_svd(first_matrix, "float64"), thin_svd(second_matrix, torch.float64)
    assert first.S.dtype == F64 and thin_svd(second_matrix, "float32").U.dtype == torch.float32
    kept = concat_top([first, second], [2, 1])
    assert tuple(kept.U.shape) == (3, 3) and tuple(kept.Vh.shape) == (3, 2)
    np.testing.assert_allclose(kept.S.numpy(), [3.0, 1.0, 2.0], atol=1e-12)
    # block t rebuilds its own matrix from its kept triplets
    np.testing.assert_allclose(((kept.U[:, :2] * kept.S[:2]) @ kept.Vh[:2]).numpy(), first_matrix.numpy(), atol=1e-12)
    np.testing.assert_allclose(((kept.U[:, 2:] * kept.S[2:]) @ kept.Vh[2:]).numpy(), second_matrix.numpy(), atol=1e-12)
    empty = concat_top([first], [0])
    assert tuple(empty.U.shape) == (3, 0) and tuple(empty.S.shape) == (0,) and tuple(empty.Vh.shape) == (0, 2)
    with pytest.raises(ValueError, match="2 decompositions but 1"):
        concat_top([first, first], [1])
    with pytest.raises(ValueError, match="svd_dtype"):
        svd_dtype("float16")


# ---------------------------------------------------------------- streaming driver


def write_checkpoint(directory, tensors, config=None):
    """Save `tensors` as model.safetensors with a config (default: the Llama of `tiny_llama_tensors`)."""
    import transformers
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / "model.safetensors"))
    config = config or transformers.LlamaConfig(
        vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    config.save_pretrained(directory)
    return directory


def tiny_llama_tensors(seed=0, hidden=8, intermediate=12, vocab=10, layers=2):
    generator = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator),
               "model.norm.weight": torch.ones(hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[prefix + f"self_attn.{proj}.weight"] = torch.randn(hidden, hidden, generator=generator)
        tensors[prefix + "mlp.gate_proj.weight"] = torch.randn(intermediate, hidden, generator=generator)
        tensors[prefix + "mlp.up_proj.weight"] = torch.randn(intermediate, hidden, generator=generator)
        tensors[prefix + "mlp.down_proj.weight"] = torch.randn(hidden, intermediate, generator=generator)
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # tied, stored twice
    return tensors


@pytest.fixture()
def tiny_checkpoints(tmp_path):
    from submerge.diagnostics.checkpoints import open_checkpoint

    base_tensors = tiny_llama_tensors()
    write_checkpoint(tmp_path / "base", base_tensors)
    generator = torch.Generator().manual_seed(1)
    finetuned_tensors = {}
    for task in ("math", "code"):
        tensors = {name: t + 0.01 * torch.randn(t.shape, generator=generator) for name, t in base_tensors.items()}
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        write_checkpoint(tmp_path / task, tensors)
        finetuned_tensors[task] = tensors
    base = open_checkpoint(str(tmp_path / "base"))
    finetuned = {task: open_checkpoint(str(tmp_path / task)) for task in ("math", "code")}
    return base, finetuned, base_tensors, finetuned_tensors


def test_interference_driver_dataset(tiny_checkpoints):
    from submerge.diagnostics.interference import INTERFERENCE, interference

    base, finetuned, base_tensors, finetuned_tensors = tiny_checkpoints
    ds = interference(base, finetuned, rank_fracs=(0.25, 1.0), progress=False, device="cpu")
    assert ds.sizes == {"matrix": 15, "task": 2, "task_other": 2, "rank_frac": 2, "centered": 2}
    assert "lm_head.weight" not in ds["matrix"].values  # tied duplicate of the embedding
    assert ds.attrs["tied_duplicates"] == {"lm_head.weight": "model.embed_tokens.weight"}
    # written to no store, the result still says what produced it, as a stored group's attrs do
    assert ds.attrs["settings"]["tasks"] == ["math", "code"] and ds.attrs["settings"]["rank_fracs"] == [0.25, 1.0]
    assert "model.norm.weight" not in ds["matrix"].values  # 1-D
    name = "model.layers.1.mlp.down_proj.weight"
    row = ds.sel(matrix=name)
    assert (row["module"].item(), row["layer"].item(), row["level"].item()) == ("layers.1.mlp.down_proj", 1, "mlp")
    assert (row["rows"].item(), row["cols"].item()) == (8, 12)
    expected = matrix_interference(base_tensors[name], [finetuned_tensors[t][name] for t in ("math", "code")],
                                   rank_fracs=(0.25, 1.0))
    assert row["sti"].item() == pytest.approx(expected["sti"], rel=1e-6)
    np.testing.assert_allclose(row["sar"].values, expected["sar"], rtol=1e-6)
    np.testing.assert_allclose(row["row_space_interference"].values, expected["row_space_interference"], rtol=1e-5)
    np.testing.assert_allclose(row["reconstruction_error"].sel(rank_frac=1.0).values, 0.0, atol=1e-10)
    summary = INTERFERENCE.summary(ds)
    assert list(summary.index) == ["attn", "mlp", "embed"]
    assert summary.loc["attn", "matrices"] == 8 and summary.loc["mlp", "matrices"] == 6
    assert summary.loc["embed", "matrices"] == 1
    per_layer = driver.summary(ds, by=("level", "layer"))
    assert list(per_layer.index) == [("attn", 0), ("attn", 1), ("mlp", 0), ("mlp", 1), ("embed", -1)]
    assert per_layer.loc[("attn", 0), "STI/Σσ"] == pytest.approx(
        float(ds["sti_normalized"].where(ds["level"] == "attn").where(ds["layer"] == 0).mean()))
    assert per_layer.loc[("mlp", 1), "SAR"] == pytest.approx(
        float(ds["sar"].mean("task").where(ds["level"] == "mlp").where(ds["layer"] == 1).mean()))


def test_each_matrix_gives_its_mapped_pages_back_once_measured(tiny_checkpoints, monkeypatch):
    """The driver unmaps each fine-tune's checkpoints once per matrix, as soon as its τ is formed and before the
    SVDs (at 7B the pages of every matrix read so far would add up in the RSS), and the reopened files give the
    same figures."""
    from submerge.diagnostics.interference import interference
    from submerge.diagnostics.task_vectors import TaskVectorReader

    base, finetuned, _, _ = tiny_checkpoints
    kept = interference(base, finetuned, rank_fracs=(0.25, 1.0), progress=False, device="cpu")
    released = []
    unmap = TaskVectorReader.release
    monkeypatch.setattr(TaskVectorReader, "release", lambda reader: (released.append(reader.name), unmap(reader)))
    ds = interference(base, finetuned, rank_fracs=(0.25, 1.0), progress=False, device="cpu")
    assert sorted(released) == sorted(list(finetuned) * ds.sizes["matrix"])
    for name in ("sti", "sar", "row_space_interference", "effective_rank"):
        np.testing.assert_array_equal(ds[name].values, kept[name].values)


def test_interference_driver_lora_and_strategies(tiny_checkpoints, tmp_path):
    import json

    from safetensors.torch import save_file

    from submerge.diagnostics.checkpoints import open_checkpoint
    from submerge.diagnostics.interference import interference

    base, finetuned, _, _ = tiny_checkpoints
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    generator = torch.Generator().manual_seed(2)
    lora_a, lora_b = torch.randn(2, 8, generator=generator), torch.randn(8, 2, generator=generator)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": lora_a,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": lora_b},
              str(adapter / "adapter_model.safetensors"))
    lora = open_checkpoint(str(adapter), base=base)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]
    tasks = {"lora": lora, "math": finetuned["math"]}
    ta = interference(base, tasks, matrices=names, progress=False, device="cpu", svd_dtype="float64")
    q_proj, k_proj = ta.sel(matrix=names[0]), ta.sel(matrix=names[1])
    expected_delta = 2.0 * lora_b @ lora_a  # scale α/r = 2
    assert q_proj["task_vector_norm"].sel(task="lora").item() == pytest.approx(
        float(torch.linalg.norm(expected_delta)), rel=1e-6)
    assert q_proj["effective_rank"].sel(task="lora").item() <= 2.0 + 1e-9
    assert math.isnan(k_proj["effective_rank"].sel(task="lora").item())  # LoRA left k_proj unchanged
    assert math.isnan(k_proj["cosine"].sel(task="lora", task_other="math").item())

    # The weight average is TA / T: same left singular vectors and k_M, so the same SAR.
    average = interference(base, tasks, matrices=names, sar_against=MergedTaskVector("weight-average"), progress=False,
                           device="cpu", svd_dtype="float64")
    np.testing.assert_allclose(average["sar"].values, ta["sar"].values, rtol=1e-9)
    assert average.attrs["sar_against"] == "weight-average"
    # Iso-C flattens TA's spectrum: r equal σ → k_M = ⌈r(1 − ε²)⌉ = r = 8 of 8×8, the whole space → SAR = 1.
    iso = interference(base, {"a": finetuned["math"], "b": finetuned["code"]}, matrices=names[:1],
                       sar_against=MergedTaskVector("iso-c"), progress=False, device="cpu", svd_dtype="float64")
    assert iso["sar_k"].item() == 8
    np.testing.assert_allclose(iso["sar"].values, 1.0, atol=1e-9)
    with pytest.raises(ValueError, match="not in the base"):
        interference(base, finetuned, matrices=["nope.weight"], progress=False)
    with pytest.raises(ValueError, match="sar_against='ties'.*MergedTaskVector"):  # diagnostics never import merge
        interference(base, finetuned, sar_against="ties", progress=False)
    with pytest.raises(ValueError, match="unknown merge method 'no-such-merge'"):
        MergedTaskVector("no-such-merge")
    with pytest.raises(TypeError, match="unknown run setting.*workers"):
        interference(base, finetuned, workers=2, progress=False)


def test_interference_store_resumes(tiny_checkpoints, tmp_path, monkeypatch):
    import submerge.diagnostics.interference.driver as interference_module
    from submerge.diagnostics.store import Store

    base, finetuned, _, _ = tiny_checkpoints
    fresh = interference_module.interference(base, finetuned, rank_fracs=(0.5, 1.0), progress=False, device="cpu")
    import submerge.diagnostics.interference.jobs as jobs

    original = jobs.task_matrix_interference
    calls, dying = [], [True]

    def dies_on_the_seventh(*args, **kwargs):
        calls.append(1)
        if dying[0] and len(calls) == 7:
            raise RuntimeError("killed")
        return original(*args, **kwargs)

    monkeypatch.setattr(jobs, "task_matrix_interference", dies_on_the_seventh)
    store = Store(tmp_path / "run.zarr")
    with pytest.raises(RuntimeError, match="killed"):
        interference_module.interference(base, finetuned, rank_fracs=(0.5, 1.0), progress=False, device="cpu",
                                         store=store, flush_every=2)
    assert not store.is_complete("interference")
    calls.clear()
    dying[0] = False
    resumed = interference_module.interference(base, finetuned, rank_fracs=(0.5, 1.0), progress=False,
                                               device="cpu", store=store, flush_every=2)
    assert len(calls) == 15 - 6  # the six matrices written in three flushes are not redone
    assert store.is_complete("interference")
    stored = store.dataset("interference")
    for dataset in (resumed, stored):
        assert [str(m) for m in dataset["matrix"].values] == [str(m) for m in fresh["matrix"].values]
        np.testing.assert_allclose(dataset["sti"].values, fresh["sti"].values, rtol=1e-12)
        np.testing.assert_allclose(dataset["row_space_interference"].values,
                                   fresh["row_space_interference"].values, rtol=1e-12)
    assert stored.attrs["sar_eps"] == 0.05 and stored.attrs["svd_dtype"] == "float32"
    with pytest.raises(Exception, match="other settings"):
        interference_module.interference(base, finetuned, rank_fracs=(0.25,), progress=False, store=store)


def test_matrices_by_glob_pattern(tiny_checkpoints):
    """Patterns select weight matrices in the table's order (layer 2 before layer 10), names stay as given, each
    matrix once; a pattern that matches nothing is a user error naming it."""
    from submerge.diagnostics.errors import SelectionError, SubmergeError
    from submerge.diagnostics.interference import interference

    base, finetuned, _, _ = tiny_checkpoints
    every = [str(m) for m in interference(base, finetuned, rank_fracs=(1.0,), progress=False,
                                          device="cpu")["matrix"].values]
    layer0 = [m for m in every if ".layers.0." in m]
    assert 0 < len(layer0) < len(every)
    picked = interference(base, finetuned, matrices=["*.layers.0.*", layer0[0], "*.o_proj.weight"],
                          rank_fracs=(1.0,), progress=False, device="cpu")
    o_proj = [m for m in every if m.endswith(".o_proj.weight") and m not in layer0]
    assert [str(m) for m in picked["matrix"].values] == layer0 + o_proj
    with pytest.raises(SelectionError, match=r"pattern '\*\.q_norm\.\*' matches no weight matrix") as caught:
        interference(base, finetuned, matrices=["*.q_norm.*"], progress=False)
    assert isinstance(caught.value, SubmergeError) and isinstance(caught.value, ValueError)


def test_interference_driver_empty_selection(tiny_checkpoints, tmp_path):
    from submerge.diagnostics.interference import interference
    from submerge.diagnostics.store import Store

    base, finetuned, _, _ = tiny_checkpoints
    store = Store(tmp_path / "empty.zarr")
    ds = interference(base, finetuned, matrices=[], rank_fracs=(0.5, 1.0), progress=False, device="cpu", store=store)
    assert ds.sizes == {"matrix": 0, "task": 2, "task_other": 2, "rank_frac": 2, "centered": 2}
    assert ds["sti"].dtype == np.float64 and ds["sar_k"].dtype == np.int64
    assert store.is_complete("interference") and ds.attrs["sar_against"] == "ta"


def test_group_matrices_for_ray_tasks():
    from submerge.diagnostics.execution import GROUP_ELEMENTS
    from submerge.diagnostics.execution import group_items as group_matrices

    # 10 elements, 1 worker: groups of ≥ ⌈10 / 4⌉ = 3 elements, in order
    assert group_matrices(["a", "b", "c", "d"], [3, 1, 5, 1], 1) == [["a"], ["b", "c"], ["d"]]
    # 2 workers: ≥ ⌈10 / 8⌉ = 2 elements
    assert group_matrices(["a", "b", "c", "d"], [1, 1, 6, 2], 2) == [["a", "b"], ["c"], ["d"]]
    # a matrix of 2²⁰ elements is a task of its own however many there are
    big = [GROUP_ELEMENTS] * 3
    assert group_matrices(["a", "b", "c"], big, 1) == [["a"], ["b"], ["c"]]
    assert group_matrices([], [], 2) == []


@pytest.mark.xdist_group("ray")  # one xdist worker runs every Ray test (conftest: --dist loadgroup)
def test_interference_on_ray_equals_one_process_and_survives_a_killed_worker(tiny_checkpoints, tmp_path,
                                                                             kill_first_ray_worker):
    """2 local Ray workers give bitwise the single-process results, in the store too, though one is killed."""
    ray = pytest.importorskip("ray")
    from submerge.diagnostics.interference import interference
    from submerge.diagnostics.store import Store

    base, finetuned, _, _ = tiny_checkpoints
    options = {"rank_fracs": (0.25, 1.0), "progress": False, "device": "cpu", "sar_against": MergedTaskVector("ties")}
    fresh = interference(base, finetuned, **options)
    killed = kill_first_ray_worker
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        store, report = Store(tmp_path / "ray.zarr"), {}
        spread = interference(base, finetuned, **options, store=store, flush_every=2,
                              engine=RayEngine("auto", workers=2, report=report))
        assert ray.is_initialized()  # a Ray this process started itself is left running
    finally:
        ray.shutdown()
    assert len(killed) == 1 and killed[0] not in [worker["pid"] for worker in report["workers"]]  # restarted
    stored = store.dataset("interference")
    for dataset in (spread, stored):
        assert [str(m) for m in dataset["matrix"].values] == [str(m) for m in fresh["matrix"].values]
        for name, variable in fresh.data_vars.items():
            assert variable.dtype == dataset[name].dtype
            assert np.array_equal(variable.values, dataset[name].values, equal_nan=True), name
    assert stored.attrs["provenance"]["engine"] == {"engine": "ray", "address": "auto", "workers": 2, "threads": 1,
                                                    "gpus_per_worker": 0}
    assert spread.attrs == fresh.attrs


@pytest.mark.xdist_group("ray")  # one xdist worker runs every Ray test (conftest: --dist loadgroup)
def test_every_engine_fixes_blas_threads_as_well_as_torch_threads():
    """The Gram route's eigendecompositions run in scipy's LAPACK, whose sums depend on its own thread count, which
    torch.set_num_threads does not reach and Ray sets to a worker's CPU share: each engine fixes both to `threads`
    (the demo kit's 576-wide matrices differed between one process and Ray by up to 4e-6 before)."""
    from types import SimpleNamespace

    from submerge.diagnostics.execution import LocalEngine

    def threads_here(group):  # nested, so that Ray pickles it by value: workers cannot import the tests
        """torch's intra-op threads and every loaded BLAS library's (scipy's LAPACK among them) here."""
        import scipy.linalg  # noqa: F401 (loads scipy's BLAS)
        import threadpoolctl

        return torch.get_num_threads(), sorted({info["num_threads"] for info in threadpoolctl.threadpool_info()
                                                if info["user_api"] == "blas"})

    task = SimpleNamespace(method="threads", open=lambda: SimpleNamespace(threads=threads_here))
    for threads in (1, 2):
        assert list(LocalEngine(threads).map(task, [[0]])) == [(threads, [threads])]
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for threads in (1, 2):
            assert list(RayEngine("auto", workers=2, threads=threads).map(task, [[0], [1]])) == [(threads, [threads])] * 2
    finally:
        ray.shutdown()


# ------------------------------------------------------------- the two routes: exact SVDs and Gram matrices

def _previous_task_matrix_interference(task_matrices, rank_fracs, merged, eps, svd_dtype):
    """task_matrix_interference as it was before the Gram route (its body verbatim, over the same helpers)."""
    from submerge.diagnostics.interference import metrics
    from submerge.diagnostics.spectral import svd_dtype as to_dtype
    from submerge.diagnostics.spectral import thin_svd

    dtype = to_dtype(svd_dtype)
    task_matrices = [delta.to(dtype) for delta in task_matrices]
    shape = tuple(task_matrices[0].shape)
    norms = np.array([task_vector_norm(delta) for delta in task_matrices])
    cosine, conflict = metrics._pair_metrics(task_matrices, norms)
    ranks = np.array([rank_from_fraction(frac, min(shape)) for frac in rank_fracs], dtype=np.int64)
    interference, reconstruction = np.zeros((len(ranks), 2)), np.zeros((len(ranks), 2))
    svds = [thin_svd(delta, dtype) for delta in task_matrices]
    effective_ranks = np.array([effective_rank_from_singular_values(svd.S) for svd in svds])
    sti_value, sti_normalized, sti_k = metrics._sti_from_svds(svds, shape, dtype)
    interference[:, 0], reconstruction[:, 0] = metrics._rank_curves(svds, ranks)
    del svds
    sar_values, sar_k = metrics._sar_against_merged(task_matrices, merged, eps, dtype)
    interference[:, 1], reconstruction[:, 1] = metrics._rank_curves(metrics._centered_spectra(task_matrices, dtype),
                                                                    ranks)
    return {"task_vector_norm": norms, "effective_rank": effective_ranks, "cosine": cosine, "sign_conflict": conflict,
            "sti": sti_value, "sti_normalized": sti_normalized, "sti_k": sti_k, "sar": sar_values, "sar_k": sar_k,
            "rank_fracs": np.asarray(rank_fracs, dtype=np.float64), "ranks": ranks,
            "row_space_interference": interference, "reconstruction_error": reconstruction}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_route_is_bitwise_the_previous_implementation(dtype):
    from submerge.diagnostics.interference import task_matrix_interference

    generator = torch.Generator().manual_seed(5)
    cases = [random_task_matrices(1, shape=(14, 9)), random_task_matrices(2, shape=(6, 11), num_tasks=2),
             [torch.randn(16, 3, generator=generator) @ torch.randn(3, 10, generator=generator) for _ in range(3)],
             [torch.zeros(7, 5), torch.randn(7, 5, generator=generator)]]
    for tasks in cases:
        for merged in (None, torch.randn(tasks[0].shape, generator=generator)):
            expected = _previous_task_matrix_interference(tasks, DEFAULT_RANK_FRACS, merged, 0.05, dtype)
            result = task_matrix_interference(tasks, DEFAULT_RANK_FRACS, merged, svd_dtype=dtype, exact_svd=True)
            assert result.keys() == expected.keys()
            for key, value in expected.items():
                np.testing.assert_array_equal(np.asarray(result[key]), np.asarray(value), err_msg=key)
                assert np.asarray(result[key]).dtype == np.asarray(value).dtype


def _spectrum_tasks(kind: str, shape: tuple[int, int], num_tasks: int = 3, seed: int = 0) -> list[torch.Tensor]:
    """Task matrices (float32) whose spectra the Gram route must handle: flat (full fine-tunes), exactly low rank
    (LoRA), low rank plus noise, a 4-decade decay, tasks that nearly agree (centring cancels) or cancel (Σ_t Δ_t)."""
    generator = torch.Generator().manual_seed(seed)
    rows, cols = shape

    def gaussian(*size):
        return torch.randn(*size, generator=generator, dtype=F64)

    if kind == "flat":
        tasks = [gaussian(rows, cols) for _ in range(num_tasks)]
    elif kind == "low_rank":
        tasks = [gaussian(rows, 4) @ gaussian(4, cols) for _ in range(num_tasks)]
    elif kind == "low_rank_noise":
        tasks = [gaussian(rows, 4) @ gaussian(4, cols) + 0.01 * gaussian(rows, cols) for _ in range(num_tasks)]
    elif kind == "decaying":
        rank = min(shape)
        tasks = []
        for _ in range(num_tasks):
            left, right = torch.linalg.qr(gaussian(rows, rank))[0], torch.linalg.qr(gaussian(cols, rank))[0]
            tasks.append((left * torch.logspace(0, -4, rank, dtype=F64)) @ right.T)
    elif kind == "agreeing":
        common = gaussian(rows, cols)
        tasks = [common + 0.05 * gaussian(rows, cols) for _ in range(num_tasks)]
    else:  # cancelling: Σ_t Δ_t is small
        tasks = [gaussian(rows, cols) for _ in range(num_tasks - 1)]
        tasks.append(-sum(tasks) + 0.05 * gaussian(rows, cols))
    return [task.to(torch.float32) for task in tasks]


GRAM_BOUND = 1e-4  # STI, SAR, I(k), R(k): the Gram route against the exact one (gram.py's docstring)


def assert_within_gram_bound(fast: dict, exact: dict, *, effective_rank_bound: float = 1e-3):
    """The bound gram.py states: relative error ≤ 1e-4 on STI, SAR, I(k) and R(k) — R(k) relative to
    max(R(k), 1e-2 · R(0)) — ≤ 1e-3 on the effective rank; the k's equal; the SVD-free figures identical."""
    for key in ("task_vector_norm", "cosine", "sign_conflict", "ranks", "rank_fracs"):
        np.testing.assert_array_equal(fast[key], exact[key], err_msg=key)
    assert fast["sti_k"] == exact["sti_k"] and fast["sar_k"] == exact["sar_k"]
    for key in ("sti", "sti_normalized", "sar", "row_space_interference"):
        np.testing.assert_allclose(fast[key], exact[key], rtol=GRAM_BOUND, atol=0, err_msg=key)
    scale = np.maximum(exact["reconstruction_error"], 1e-2 * exact["reconstruction_error"][0])
    assert np.all(np.abs(fast["reconstruction_error"] - exact["reconstruction_error"]) <= GRAM_BOUND * scale)
    np.testing.assert_allclose(fast["effective_rank"], exact["effective_rank"], rtol=effective_rank_bound)


@pytest.mark.parametrize("kind", ["flat", "low_rank", "low_rank_noise", "decaying", "agreeing", "cancelling"])
@pytest.mark.parametrize("shape", [(56, 40), (40, 56), (48, 48)], ids=["tall", "wide", "square"])
def test_gram_route_within_its_bound_of_the_exact_route(kind, shape):
    from submerge.diagnostics.interference import task_matrix_interference

    tasks = _spectrum_tasks(kind, shape)
    fast = task_matrix_interference(tasks)
    exact = task_matrix_interference(tasks, exact_svd=True)
    assert_within_gram_bound(fast, exact)


@pytest.mark.parametrize("num_tasks", [1, 2, 4])
def test_gram_route_any_number_of_tasks_and_a_given_merge(num_tasks):
    from submerge.diagnostics.interference import task_matrix_interference

    tasks = _spectrum_tasks("low_rank_noise", (36, 30), num_tasks=num_tasks, seed=num_tasks)
    merged = torch.randn(36, 30, generator=torch.Generator().manual_seed(9))
    for given in (None, merged):
        fast = task_matrix_interference(tasks, merged=given)
        exact = task_matrix_interference(tasks, merged=given, exact_svd=True)
        assert_within_gram_bound(fast, exact)


@pytest.mark.parametrize("exact_svd", [True, False], ids=["exact", "gram"])
def test_both_routes_known_answers(exact_svd):
    """Orthogonal task subspaces: STI = 0 and I(k) = 0 (plain); Δ_1 inside Δ_M's top space: SAR = 1, Δ_2 outside: 0;
    hand-computed σ's: R(1) = 1 + 0.5² and erank of (3, 1) = exp(H(3/4, 1/4))."""
    from submerge.diagnostics.interference import task_matrix_interference

    orthogonal = task_matrix_interference(block_orthogonal_tasks(), rank_fracs=(0.25, 0.5, 1.0),
                                          svd_dtype="float64", exact_svd=exact_svd)
    assert orthogonal["sti"] == pytest.approx(0.0, abs=1e-10)
    np.testing.assert_allclose(orthogonal["row_space_interference"][:, 0], 0.0, atol=1e-10)
    hand = task_matrix_interference([DELTA_1, DELTA_2], rank_fracs=(1 / 3, 1.0), svd_dtype="float64",
                                    merged=DELTA_1, exact_svd=exact_svd)
    assert hand["reconstruction_error"][0, 0] == pytest.approx(1.0 + 0.25, rel=1e-12)
    assert hand["reconstruction_error"][1, 0] == pytest.approx(0.0, abs=1e-12)
    assert hand["effective_rank"][0] == pytest.approx(math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))),
                                                       rel=1e-10)
    assert hand["sar_k"] == 2 and hand["sar"][0] == pytest.approx(1.0, abs=1e-12)
    outside = task_matrix_interference([DELTA_1, outer([0, 0, 1], [0, 0, 1])], merged=DELTA_1, svd_dtype="float64",
                                       exact_svd=exact_svd)
    assert outside["sar"][1] == pytest.approx(0.0, abs=1e-12)


def test_gram_route_refinement_threshold_both_sides(monkeypatch):
    """σ_a with λ_a < REFINE_BELOW · λ_max are recomputed as ‖A y_a‖: refining every σ changes nothing beyond the
    bound; refining none leaves √λ's rounding noise, which (unless STI's SVD fallback catches it) inflates the
    effective rank of a low-rank matrix beyond the bound."""
    from submerge.diagnostics.interference import gram, task_matrix_interference

    tasks = _spectrum_tasks("low_rank", (48, 40))
    exact = task_matrix_interference(tasks, exact_svd=True)
    monkeypatch.setattr(gram, "REFINE_BELOW", 1.0)
    assert_within_gram_bound(task_matrix_interference(tasks), exact)
    monkeypatch.setattr(gram, "_COLUMNS", 3)  # refined in many small products: the same figures
    assert_within_gram_bound(task_matrix_interference(tasks), exact)
    monkeypatch.setattr(gram, "REFINE_BELOW", 0.0)  # √λ noise (~√eps σ_max) now passes the numerical rank:
    assert_within_gram_bound(task_matrix_interference(tasks), exact)  # STI keeps it, so the SVD fallback runs
    monkeypatch.setattr(gram, "STI_RESOLVED", 0.0)  # without either guard the noise inflates the effective rank
    unguarded = task_matrix_interference(tasks)
    assert np.all(unguarded["effective_rank"] > (1 + 1e-3) * exact["effective_rank"])  # outside the bound


def test_gram_route_cancellation_guard_both_sides(monkeypatch):
    """Centred Grams come from the cross-Grams unless centring cancels (nearly equal tasks), then from Ā_t itself;
    Σ_t K_st likewise unless the tasks cancel. Either way the figures stay within the bound."""
    from submerge.diagnostics.interference import gram, task_matrix_interference

    assert not gram.CrossGrams(_spectrum_tasks("flat", (30, 20)))._direct_centred
    assert gram.CrossGrams(_spectrum_tasks("agreeing", (30, 20)))._direct_centred
    assert gram.CrossGrams(_spectrum_tasks("flat", (30, 20)))._merged is None
    assert gram.CrossGrams(_spectrum_tasks("cancelling", (30, 20)))._merged is not None
    for kind in ("flat", "agreeing", "cancelling"):
        tasks = _spectrum_tasks(kind, (44, 36))
        exact = task_matrix_interference(tasks, exact_svd=True)
        for limit in (1e9, 1.0):  # always / never form the centred and merged matrices
            monkeypatch.setattr(gram.CrossGrams, "CANCELLATION", limit)
            monkeypatch.setattr(gram, "_ROWS", 5)  # the mean in row blocks
            assert_within_gram_bound(task_matrix_interference(tasks), exact)


def test_gram_eigh_sorted_clamped_and_on_both_backends():
    from submerge.diagnostics.spectral import gram_eigh

    x = torch.randn(9, 6, generator=torch.Generator().manual_seed(4), dtype=F64)
    values, vectors = gram_eigh(x.T @ x)
    np.testing.assert_allclose(values.numpy(), torch.linalg.svdvals(x).numpy() ** 2, rtol=1e-12)
    assert values.dtype == F64 and bool((values[:-1] >= values[1:]).all())
    np.testing.assert_allclose((vectors.T @ vectors).numpy(), np.eye(6), atol=1e-12)
    singular = torch.zeros(4, 4, dtype=F64)
    singular[0, 0] = 1.0
    values, _ = gram_eigh(singular - 1e-18 * torch.eye(4, dtype=F64))
    assert float(values.min()) == 0.0  # rounding below zero is clamped


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_gram_matrix_is_the_symmetric_product_for_every_layout(dtype, monkeypatch):
    """XᵀX through syrk equals X.mT @ X to rounding (a 2×2 case exactly), is exactly symmetric, and reads C- and
    Fortran-ordered X (a transposed view, as the Gram route's wide matrices come) as they are; a strided view falls
    back to the plain product."""
    from submerge.diagnostics import spectral

    assert torch.equal(spectral.gram_matrix(torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=dtype)),
                       torch.tensor([[10.0, 14.0], [14.0, 20.0]], dtype=dtype))
    generator = torch.Generator().manual_seed(7)
    wide = torch.randn(40, 300, generator=generator, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    calls = []
    real = spectral._SYRK[dtype]
    monkeypatch.setitem(spectral._SYRK, dtype, lambda *args, **kwargs: calls.append(kwargs["trans"]) or real(*args, **kwargs))
    for tall in (wide.mT.contiguous(), wide.mT, wide.mT[::2]):  # C-ordered, Fortran-ordered, strided
        gram = spectral.gram_matrix(tall)
        plain = tall.mT @ tall
        assert gram.dtype == dtype and gram.shape == (40, 40)
        assert torch.equal(gram, gram.mT) or tall.stride(0) == 2  # syrk's mirror; the plain product is not exact
        torch.testing.assert_close(gram, plain, rtol=tolerance, atol=tolerance * float(plain.abs().max()))
    assert calls == [0, 1]  # syrk for both orders, the plain product for the strided view


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_solve_symmetric_right_solves_in_place_and_falls_back_to_the_pseudo_inverse(dtype):
    """B A⁻¹ of a symmetric positive definite A by Cholesky overwrites B and A and returns B itself (no copy of either:
    RegMean's 11,008² float64 sum is 0.9 GB); a singular A is rebuilt from the triangle potrf left alone and B A⁺ is
    returned; a 2×2 case by hand."""
    from submerge.diagnostics.spectral import solve_symmetric_right

    a, b = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=dtype), torch.tensor([[3.0, 3.0], [1.0, -1.0]], dtype=dtype)
    torch.testing.assert_close(solve_symmetric_right(b, a), torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=dtype))
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(120, 40, generator=generator, dtype=F64)
    product = x.mT @ x
    matrix, rows = (product + product.mT) / 2, torch.randn(7, 40, generator=generator, dtype=F64)  # symmetric
    expected = rows @ torch.linalg.inv(matrix)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10
    a, b = matrix.to(dtype, copy=True), rows.to(dtype, copy=True)
    solved = solve_symmetric_right(b, a)
    assert solved.data_ptr() == b.data_ptr() and solved.dtype == dtype
    torch.testing.assert_close(solved.to(F64), expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))
    matrix[:, 3] = 0.0
    matrix[3, :] = 0.0  # feature 3 never active
    a, b = matrix.to(dtype, copy=True), rows.to(dtype, copy=True)
    solved = solve_symmetric_right(b, a)
    assert torch.equal(a, matrix.to(dtype))  # rebuilt as it was
    expected = rows @ torch.linalg.pinv(matrix, hermitian=True)
    torch.testing.assert_close(solved.to(F64), expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))
    assert float(solved[:, 3].abs().max()) < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_solve_symmetric_right_takes_the_pseudo_inverse_below_min_rcond(dtype):
    """With ``min_rcond``: a positive definite A whose smallest eigenvalue is below the pseudo-inverse's cut
    (Cholesky succeeds, yet A⁻¹ and A⁺ differ by orders of magnitude) gives B A⁺, with A rebuilt as it was; a
    well-conditioned A still gives B A⁻¹ by Cholesky, in place."""
    from submerge.diagnostics.spectral import solve_symmetric_right

    generator = torch.Generator().manual_seed(12)
    basis, _ = torch.linalg.qr(torch.randn(30, 30, generator=generator, dtype=F64))
    rows = torch.randn(4, 30, generator=generator, dtype=F64)
    tiny = 1e-6 if dtype == torch.float32 else 2e-15  # below 30 · eps · λ_max, above the rounding of forming A
    values = torch.cat([torch.linspace(1.0, 2.0, 29, dtype=F64), torch.tensor([tiny], dtype=F64)])
    ill = (basis * values) @ basis.mT
    ill = ((ill + ill.mT) / 2).to(dtype)
    assert int(torch.linalg.cholesky_ex(ill)[1]) == 0  # positive definite at this dtype: potrf alone would solve it
    a, b = ill.clone(), rows.to(dtype, copy=True)
    solved = solve_symmetric_right(b, a, min_rcond=1e-3)
    assert torch.equal(a, ill)  # rebuilt as it was
    pseudo = rows.to(dtype) @ torch.linalg.pinv(ill, hermitian=True)
    truncated = rows @ ((basis[:, :29] / values[:29]) @ basis[:, :29].mT)  # A⁺: the tiny direction dropped
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10
    for expected in (pseudo.to(F64), truncated):
        torch.testing.assert_close(solved.to(F64), expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))
    inverse = rows @ torch.linalg.inv(ill.to(F64))
    assert float((inverse - truncated).abs().max()) > 1e3 * float(truncated.abs().max())  # the two really differ
    well = (basis * torch.linspace(1.0, 2.0, 30, dtype=F64)) @ basis.mT
    well = (well + well.mT) / 2
    a, b = well.to(dtype, copy=True), rows.to(dtype, copy=True)
    solved = solve_symmetric_right(b, a, min_rcond=1e-3)
    assert solved.data_ptr() == b.data_ptr()  # Cholesky, in place
    expected = rows @ torch.linalg.inv(well)
    torch.testing.assert_close(solved.to(F64), expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))


def test_scipy_calls_below_the_order_threshold_run_on_one_thread(monkeypatch):
    """scipy's OpenBLAS is a thread pool beside torch's: its Cholesky, triangular solve, syrk and eigendecomposition
    run on one thread for a result of order below `spectral.ONE_THREAD_BELOW`, and on the threads set outside at or
    above it (the threshold lowered to 32, so both sides are small), the results the same to rounding."""
    import threadpoolctl

    from submerge.diagnostics import spectral

    def blas_threads() -> set[int]:
        return {info["num_threads"] for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"}

    seen: list[tuple[str, set[int]]] = []

    def spy(name, function):
        return lambda *args, **kwargs: seen.append((name, blas_threads())) or function(*args, **kwargs)

    for table, name in ((spectral._POTRF, "potrf"), (spectral._POTRS, "potrs"), (spectral._SYRK, "syrk")):
        monkeypatch.setitem(table, F64, spy(name, table[F64]))
    eigh = spectral.scipy.linalg.eigh
    monkeypatch.setattr(spectral.scipy.linalg, "eigh", spy("eigh", eigh))
    monkeypatch.setattr(spectral, "ONE_THREAD_BELOW", 32)
    generator = torch.Generator().manual_seed(5)
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        for order, threads in ((16, {1}), (32, {2}), (48, {2})):
            seen.clear()
            tall = torch.randn(3 * order, order, generator=generator, dtype=F64)
            gram = spectral.gram_matrix(tall)
            rows = torch.randn(5, order, generator=generator, dtype=F64)
            expected = rows @ torch.linalg.inv(gram)
            solved = spectral.solve_symmetric_right(rows.clone(), gram.clone())
            torch.testing.assert_close(solved, expected, rtol=1e-8, atol=1e-8 * float(expected.abs().max()))
            spectral.gram_eigh(gram)
            assert [name for name, _ in seen] == ["syrk", "potrf", "potrs", "eigh"]
            assert all(count == threads for _, count in seen), (order, seen)
        assert blas_threads() == {2}  # restored after each call


def test_interference_driver_routes_and_store(tiny_checkpoints, tmp_path):
    """exact_svd=True reproduces task_matrix_interference's exact route bitwise per matrix; the default is the Gram
    route within its bound; the store records the route and refuses to resume in the other one."""
    from submerge.diagnostics.interference import interference, task_matrix_interference
    from submerge.diagnostics.store import Store

    base, finetuned, base_tensors, finetuned_tensors = tiny_checkpoints
    store = Store(tmp_path / "routes.zarr")
    exact = interference(base, finetuned, rank_fracs=(0.25, 1.0), exact_svd=True, progress=False, device="cpu",
                         store=store)
    gram_route = interference(base, finetuned, rank_fracs=(0.25, 1.0), progress=False, device="cpu")
    assert store.group_attrs("interference")["settings"]["svd"] == "exact"
    assert exact.attrs["svd"].startswith("torch.linalg.svd") and gram_route.attrs["svd"].startswith("Gram route")
    for name in exact["matrix"].values:
        tasks = [(finetuned_tensors[t][name] - base_tensors[name]).float() for t in ("math", "code")]
        expected = task_matrix_interference(tasks, (0.25, 1.0), exact_svd=True)
        row = exact.sel(matrix=name)
        assert row["sti"].item() == expected["sti"]
        np.testing.assert_array_equal(row["row_space_interference"].values, expected["row_space_interference"])
        np.testing.assert_array_equal(row["sar"].values, expected["sar"])
        fast = gram_route.sel(matrix=name)
        np.testing.assert_allclose(fast["sti"].item(), expected["sti"], rtol=GRAM_BOUND)
        np.testing.assert_allclose(fast["row_space_interference"].values, expected["row_space_interference"],
                                   rtol=GRAM_BOUND)
    with pytest.raises(Exception, match="other settings"):
        interference(base, finetuned, rank_fracs=(0.25, 1.0), progress=False, device="cpu", store=store)


def test_gram_route_sti_falls_back_to_svds_below_its_resolution(monkeypatch):
    """STI's entrywise norm depends on individual singular vectors. A signal over a noise floor makes STI keep noise
    directions (σ² < STI_RESOLVED · σ_max²) that the float32 Gram does not resolve one by one: there the Δ_t are
    decomposed by SVD. Both sides of the threshold, on spectra that need it and spectra that do not."""
    from submerge.diagnostics.interference import gram, metrics, task_matrix_interference

    noisy, flat = _spectrum_tasks("low_rank_noise", (48, 40)), _spectrum_tasks("flat", (48, 40))
    exact_noisy = task_matrix_interference(noisy, exact_svd=True)
    exact_flat = task_matrix_interference(flat, exact_svd=True)
    calls, original = [], metrics.thin_svd
    monkeypatch.setattr(metrics, "thin_svd", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    assert_within_gram_bound(task_matrix_interference(noisy), exact_noisy)
    assert len(calls) == 3  # one SVD per Δ_t; the centred and merged matrices stay on the Gram route
    calls.clear()
    assert_within_gram_bound(task_matrix_interference(flat), exact_flat)
    assert not calls
    monkeypatch.setattr(gram, "STI_RESOLVED", 1.0)  # every spectrum falls back: the same figures
    assert_within_gram_bound(task_matrix_interference(flat), exact_flat)
    assert len(calls) == 3
    monkeypatch.setattr(gram, "STI_RESOLVED", 0.0)  # none does: the noise directions' STI is off
    unresolved = task_matrix_interference(noisy)
    assert abs(unresolved["sti"] - exact_noisy["sti"]) > GRAM_BOUND * exact_noisy["sti"]
