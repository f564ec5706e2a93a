import pytest
import torch

from ssl_vit.eval.fewshot import FewShotEvaluator, ridge_solve


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


def test_too_few_examples_per_class_is_a_clear_error():
    x, y = torch.randn(30, 4), torch.tensor([0] * 20 + [1] * 6 + [2] * 4)
    with pytest.raises(ValueError, match=r"class 1 has 6, class 2 has 4"):
        FewShotEvaluator(shots=(1, 10)).evaluate(x, y, x, y)
    with pytest.raises(ValueError, match=r"ask for at most 4 shots \(e\.g\. shots 1\)"):
        FewShotEvaluator(shots=(1, 10)).evaluate(x, y, x, y)
    y[-4:] = 0  # class 2 has no training example: no shot count helps
    with pytest.raises(ValueError, match=r"class 2 has 0$"):
        FewShotEvaluator(shots=(1, 10)).evaluate(x, y, x, y, num_classes=3)
