import math

import pytest
import torch

from ssl_vit.eval.knn import KNNClassifier


def test_votes_match_hand_computation():
    # bank: 2-D features with labels; the query (2, 0) normalises to (1, 0)
    bank = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0], [3.0, 0.1]])
    labels = torch.tensor([0, 1, 1, 2, 2])
    query = torch.tensor([[2.0, 0.0]])
    # cosine similarities: 1, 0, 1/sqrt(2), -1, 3/sqrt(9.01); k = 3 keeps items 0, 4, 2
    s4 = 3.0 / math.sqrt(9.01)
    T = 0.1
    expected = torch.tensor([[math.exp(1.0 / T), math.exp((1 / math.sqrt(2)) / T), math.exp(s4 / T)]])
    votes = KNNClassifier(k=3, temperature=T).scores(bank, labels, query, num_classes=3)
    torch.testing.assert_close(votes, expected, rtol=1e-5, atol=0)


def test_votes_match_explicit_loops():
    g = torch.Generator().manual_seed(0)
    bank, queries = torch.randn(40, 6, generator=g), torch.randn(9, 6, generator=g)
    labels = torch.randint(0, 4, (40,), generator=g)
    k, T = 5, 0.07
    expected = torch.zeros(9, 4, dtype=torch.float64)
    for qi in range(9):
        q = queries[qi].double()
        sims = []
        for bi in range(40):
            b = bank[bi].double()
            sims.append((float(q @ b / (q.norm() * b.norm())), int(labels[bi])))
        sims.sort(key=lambda t: -t[0])
        for sim, lab in sims[:k]:
            expected[qi, lab] += math.exp(sim / T)
    votes = KNNClassifier(k=k, temperature=T).scores(bank, labels, queries, num_classes=4)
    torch.testing.assert_close(votes.double(), expected, rtol=1e-4, atol=0)


def test_chunked_equals_unchunked():
    g = torch.Generator().manual_seed(1)
    bank, queries = torch.randn(300, 16, generator=g), torch.randn(57, 16, generator=g)
    labels = torch.randint(0, 7, (300,), generator=g)
    whole = KNNClassifier(k=20, chunk_size=10_000).scores(bank, labels, queries, 7)
    chunked = KNNClassifier(k=20, chunk_size=7, bank_chunk_size=13).scores(bank, labels, queries, 7)
    torch.testing.assert_close(chunked, whole)


def test_top1_agrees_with_lightly_knn_predict():
    from lightly.utils.benchmarking import knn_predict

    g = torch.Generator().manual_seed(2)
    bank, queries = torch.randn(200, 8, generator=g), torch.randn(50, 8, generator=g)
    labels = torch.randint(0, 5, (200,), generator=g)
    ref = knn_predict(
        torch.nn.functional.normalize(queries, dim=1),
        torch.nn.functional.normalize(bank, dim=1).T,
        labels,
        num_classes=5,
        knn_k=20,
        knn_t=0.07,
    )[:, 0]
    ours = KNNClassifier().scores(bank, labels, queries, 5).argmax(dim=1)
    assert torch.equal(ours, ref)


def test_separable_clusters_are_perfect():
    g = torch.Generator().manual_seed(3)
    centres = torch.eye(10, 32) * 10
    ytr, yte = torch.arange(200) % 10, torch.arange(50) % 10
    xtr = centres[ytr] + torch.randn(200, 32, generator=g)
    xte = centres[yte] + torch.randn(50, 32, generator=g)
    m = KNNClassifier(k=20).evaluate(xtr, ytr, xte, yte)
    assert m == {"top1": 1.0, "top5": 1.0}
    # fewer than 5 classes: no top-5
    assert set(KNNClassifier(k=3).evaluate(xtr, ytr % 3, xte, yte % 3)) == {"top1"}


def test_errors():
    with pytest.raises(AssertionError, match="bank size"):
        KNNClassifier(k=20).scores(torch.randn(5, 3), torch.zeros(5, dtype=torch.long), torch.randn(2, 3))
    with pytest.raises(AssertionError):  # features of two widths
        KNNClassifier(k=2).scores(torch.randn(5, 3), torch.zeros(5, dtype=torch.long), torch.randn(2, 4))


def _imbalanced(seed: int, n_major: int = 40, n_minor: int = 15, n_test: int = 20):
    """Two tight clusters, a large class 0 and a smaller class 1: one neighbour tells them apart,
    40 nearly equal votes (T large) hand class 1's images to class 0."""
    g = torch.Generator().manual_seed(seed)
    c0, c1 = torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([1.0, 0.0, 0.0, 0.0])

    def near(c, n):
        return c + 0.01 * torch.randn(n, 4, generator=g)

    x, y = torch.cat([near(c0, n_major), near(c1, n_minor)]), torch.tensor([0] * n_major + [1] * n_minor)
    test_x, test_y = torch.cat([near(c1, n_test), near(c0, n_test)]), torch.tensor([1] * n_test + [0] * n_test)
    return x, y, test_x, test_y


def test_votes_of_several_k_from_one_search_are_those_of_each_k_alone():
    g = torch.Generator().manual_seed(3)
    bank, queries = torch.randn(70, 8, generator=g), torch.randn(13, 8, generator=g)
    labels = torch.randint(0, 5, (70,), generator=g)
    for bank_chunk in (None, 9):
        swept = KNNClassifier(k=[10, 1, 20], temperature=0.07, chunk_size=4, bank_chunk_size=bank_chunk)
        votes = swept.votes(bank, labels, queries, num_classes=5)
        assert list(votes) == [10, 1, 20]
        for k in (10, 1, 20):
            alone = KNNClassifier(k=k, temperature=0.07, chunk_size=4, bank_chunk_size=bank_chunk).scores(bank, labels, queries, 5)
            torch.testing.assert_close(votes[k], alone, rtol=0, atol=0)


def test_a_k_sweep_picks_on_held_out_training_features_never_on_the_test_split():
    x, y, test_x, test_y = _imbalanced(0)
    knn = KNNClassifier(k=[40, 1], temperature=100.0, select_fraction=0.25, seed=0)
    metrics = knn.evaluate(x, y, test_x, test_y, num_classes=2)
    args = knn.picked
    assert args["selected_k"] == 1 and args["select_fraction"] == 0.25
    assert args["select_top1"]["1"] == 1.0 > args["select_top1"]["40"]
    # the held-out scores, by hand: the seeded quarter queried against the other three quarters
    perm = torch.randperm(55, generator=torch.Generator().manual_seed(0))
    val, fit = perm[:14], perm[14:]
    for k in (1, 40):
        alone = KNNClassifier(k=k, temperature=100.0).evaluate(x[fit], y[fit], x[val], y[val], num_classes=2)
        assert args["select_top1"][str(k)] == pytest.approx(alone["top1"])
    # the test split is classified with the whole bank at the pick; every k's test top-1 is kept
    assert metrics == KNNClassifier(k=1, temperature=100.0).evaluate(x, y, test_x, test_y, num_classes=2)
    for k in (1, 40):
        assert args["test_top1_by_k"][str(k)] == pytest.approx(KNNClassifier(k=k, temperature=100.0).evaluate(x, y, test_x, test_y, 2)["top1"])
    assert args["test_top1_by_k"]["40"] == 0.5 and metrics["top1"] == 1.0
    # test labels do not move the pick: all of them flipped, k=1 still picked (and now scores 0)
    flipped = KNNClassifier(k=[40, 1], temperature=100.0, select_fraction=0.25, seed=0)
    assert flipped.evaluate(x, y, test_x, 1 - test_y, num_classes=2)["top1"] == pytest.approx(1 - metrics["top1"])
    assert flipped.picked["selected_k"] == 1


def test_a_k_sweep_breaks_ties_to_the_first_k_listed_and_one_k_records_nothing():
    g = torch.Generator().manual_seed(1)
    centres = torch.eye(3) * 10
    x = torch.cat([c + torch.randn(20, 3, generator=g) * 0.1 for c in centres])
    y = torch.arange(3).repeat_interleave(20)
    for order in ([3, 1, 5], [5, 3, 1]):
        knn = KNNClassifier(k=order)
        assert knn.evaluate(x, y, x, y)["top1"] == 1.0
        assert set(knn.picked["select_top1"].values()) == {1.0} and knn.picked["selected_k"] == order[0]
    single = KNNClassifier(k=3)
    single.evaluate(x, y, x, y)
    assert single.picked == {} and single.ks == (3,)


def test_a_k_sweep_needs_a_bank_for_its_largest_k_after_the_held_out_part():
    knn = KNNClassifier(k=[5, 18], select_fraction=0.1)
    assert knn.bank_shortfall(20) is None  # 20 - 2 = 18: just enough
    assert knn.bank_shortfall(19) == ("k=18 neighbours, but the k sweep holds out 2 of the 19 training examples "
                                      "(select_fraction 0.1) and leaves 17 to vote")
    assert knn.bank_shortfall(17) == "k=18 neighbours, but the kNN bank holds 17 training examples"
    assert KNNClassifier(k=18).bank_shortfall(18) is None  # one k holds nothing out
    with pytest.raises(AssertionError, match=r"k=18 must be in 1..17 \(the bank size\)"):  # (17 left to vote)
        knn.evaluate(torch.randn(19, 4), torch.arange(19) % 2, torch.randn(3, 4), torch.tensor([0, 1, 0]))


def test_a_k_sweep_scores_its_held_out_part_against_the_rest_only():
    """The sweep's per-k scores, recomputed by hand: the seeded held-out tenth queried against the
    other nine tenths (cosine top-k, weights exp(s / 0.07)); a query never finds itself."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(100, 8, generator=g)
    y = torch.randint(0, 4, (100,), generator=g)  # random labels: a query that found itself would score 100 %
    knn = KNNClassifier(k=[1, 5], select_fraction=0.1, seed=0)
    knn.evaluate(x, y, x[:10], y[:10])
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    val, fit = perm[:10], perm[10:]
    xn = torch.nn.functional.normalize(x, dim=1)
    sim = xn[val] @ xn[fit].T  # [10, 90]
    want = {}
    for k in (1, 5):
        s, i = sim.topk(k, dim=1)
        votes = torch.zeros(10, 4).scatter_add_(1, y[fit][i], (s / 0.07).exp())
        want[str(k)] = (votes.argmax(1) == y[val]).float().mean().item()
    assert knn.picked["select_top1"] == pytest.approx(want)
    assert want["1"] < 1.0


def test_a_k_sweep_holds_out_one_example_at_least():
    # 10 % of 4 rounds to 0; one is held out all the same, so k = 4 no longer fits the 3 left
    knn = KNNClassifier(k=(1, 4), select_fraction=0.1)
    assert knn.bank_shortfall(4) == ("k=4 neighbours, but the k sweep holds out 1 of the 4 training examples "
                                     "(select_fraction 0.1) and leaves 3 to vote")
    assert KNNClassifier(k=(1, 3), select_fraction=0.1).bank_shortfall(4) is None
