import numpy as np
import pytest
import torch

from ssl_vit.eval.fewshot import FewShotEvaluator, _pick_l2, fewshot_fit_predict, ridge_solve


def _big_vision_lsr(support_x, support_y, query_x, num_classes, l2_reg):
    """big_vision ``fewshot_lsr.py``'s classifier, written out in numpy (always the primal form):
    standardise by the support's mean and population std (+1e-5), append a bias column of 100,
    solve (XᵀX + λI)W = XᵀY for Y = 2·onehot − 1, predict the argmax."""
    sx, qx = support_x.double().numpy(), query_x.double().numpy()
    mean, std = sx.mean(0), sx.std(0) + 1e-5
    design = lambda x: np.hstack([(x - mean) / std, np.full((len(x), 1), 100.0)])  # noqa: E731
    xs = design(sx)
    y = 2.0 * np.eye(num_classes)[support_y.numpy()] - 1.0
    w = np.linalg.solve(xs.T @ xs + l2_reg * np.eye(xs.shape[1]), xs.T @ y)
    return torch.from_numpy((design(qx) @ w).argmax(1))


@pytest.mark.parametrize("n, d", [(40, 7), (6, 25)])  # primal (n >= d) and dual (n < d) forms
def test_ridge_solve_matches_lstsq_of_the_regularised_system(n, d):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = 2.0 * torch.nn.functional.one_hot(torch.randint(0, 3, (n,), generator=g), 3).double() - 1.0
    lam = 0.7
    # min ||xW - y||^2 + lam ||W||^2  ==  least squares of [x; sqrt(lam) I] W = [y; 0]
    a = torch.cat([x, lam**0.5 * torch.eye(d, dtype=torch.float64)])
    b = torch.cat([y, torch.zeros(d, 3, dtype=torch.float64)])
    ref = torch.linalg.lstsq(a, b).solution
    torch.testing.assert_close(ridge_solve(x, y, lam), ref, rtol=1e-8, atol=1e-10)


def _clusters(n_train: int, n_test: int, num_classes: int = 10, dim: int = 48):
    """Train and test points (independent noise) around the same well-separated centres."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(num_classes, dim, generator=g) * 4
    out = []
    for n in (n_train, n_test):
        labels = torch.arange(num_classes).repeat(n)
        out += [centres[labels] + torch.randn(labels.numel(), dim, generator=g), labels]
    return out


def test_separable_features_are_perfect():
    xtr, ytr, xte, yte = _clusters(30, 10)
    m = FewShotEvaluator(shots=(1, 5, 25), num_seeds=3).evaluate(xtr, ytr, xte, yte)
    assert set(m) == {"1shot", "1shot_std", "5shot", "5shot_std", "25shot", "25shot_std"}
    assert m["5shot"] == 1.0 and m["25shot"] == 1.0 and m["1shot"] > 0.95


def test_lambda_grid_selection_runs_and_is_reproducible():
    xtr, ytr, xte, yte = _clusters(12, 5, num_classes=4)
    ev = FewShotEvaluator(shots=(1, 10), num_seeds=2, l2_grid=(1e-2, 1.0, 2.0**10))
    first, second = ev.evaluate(xtr, ytr, xte, yte), ev.evaluate(xtr, ytr, xte, yte)
    assert first == second and first["10shot"] == 1.0


def test_the_lambda_grid_is_searched_from_two_shots_on(monkeypatch):
    # Leave-one-out over the support needs a second example of each class: 1-shot keeps l2_reg.
    import ssl_vit.eval.fewshot as fewshot

    picked = []
    monkeypatch.setattr(fewshot, "_pick_l2", lambda sx, *a: picked.append(len(sx)) or 1.0)
    xtr, ytr, xte, yte = _clusters(12, 5, num_classes=4)
    FewShotEvaluator(shots=(1, 2, 3), num_seeds=1, l2_grid=(1e-2, 1.0)).evaluate(xtr, ytr, xte, yte)
    assert picked == [2 * 4, 3 * 4]


def test_too_few_examples_per_class_is_a_clear_error():
    x, y = torch.randn(30, 4), torch.tensor([0] * 20 + [1] * 6 + [2] * 4)
    with pytest.raises(ValueError, match=r"class 1 has 6, class 2 has 4"):
        FewShotEvaluator(shots=(1, 10)).evaluate(x, y, x, y)
    with pytest.raises(ValueError, match=r"ask for at most 4 shots \(e\.g\. shots 1\)"):
        FewShotEvaluator(shots=(1, 10)).evaluate(x, y, x, y)
    y[-4:] = 0  # class 2 has no training example: no shot count helps
    with pytest.raises(ValueError, match=r"class 2 has 0$"):
        FewShotEvaluator(shots=(1, 10)).evaluate(x, y, x, y, num_classes=3)


@pytest.mark.parametrize("n_per_class, dim", [(2, 40), (12, 6)])  # dual (n < d) and primal forms
def test_fit_predict_is_big_visions_classifier(n_per_class, dim):
    # Features on wildly different scales and offsets, an unbalanced support (so the bias column
    # matters), queries shifted away from the support's mean (so whose statistics standardise
    # them matters): predictions must be the reference's, query for query.
    g = torch.Generator().manual_seed(dim)
    scales, offsets = 10.0 ** torch.linspace(-2, 3, dim), torch.randn(dim, generator=g) * 50
    centres = torch.randn(4, dim, generator=g) * 2
    support_y = torch.cat([torch.arange(4).repeat(n_per_class), torch.zeros(n_per_class, dtype=torch.long)])
    support_x = (centres[support_y] + torch.randn(len(support_y), dim, generator=g)) * scales + offsets
    query_y = torch.arange(4).repeat(50)
    query_x = (centres[query_y] + 0.7 + 1.5 * torch.randn(len(query_y), dim, generator=g)) * scales + offsets
    for l2 in (2.0**10, 4.0):
        ours = fewshot_fit_predict(support_x, support_y, query_x, 4, l2)
        ref = _big_vision_lsr(support_x, support_y, query_x, 4, l2)
        assert torch.equal(ours, ref)
    assert 0.5 < (ours == query_y).double().mean() < 1.0  # (λ = 4) neither trivial nor perfect: details show


def test_predictions_do_not_depend_on_a_features_units():
    # Standardisation: one feature in other units (x 1000) changes nothing.
    g = torch.Generator().manual_seed(0)
    sx, sy, qx = torch.randn(30, 8, generator=g), torch.arange(3).repeat(10), torch.randn(100, 8, generator=g)
    rescaled = torch.tensor([1000.0] + [1.0] * 7)
    assert torch.equal(fewshot_fit_predict(sx, sy, qx, 3, 2.0**10), fewshot_fit_predict(sx * rescaled, sy, qx * rescaled, 3, 2.0**10))


def test_lambda_selection_keeps_the_largest_of_tied_values():
    xtr, ytr, _, _ = _clusters(6, 1, num_classes=3)  # separable: every λ scores 100 % on the held-out half
    per_class = [(ytr == c).nonzero().flatten() for c in range(3)]
    assert _pick_l2(xtr, ytr, per_class, 3, (1.0, 100.0, 10.0)) == 100.0
