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
    with pytest.raises(ValueError, match="bank size"):
        KNNClassifier(k=20).scores(torch.randn(5, 3), torch.zeros(5, dtype=torch.long), torch.randn(2, 3))
    with pytest.raises(ValueError, match="width"):
        KNNClassifier(k=2).scores(torch.randn(5, 3), torch.zeros(5, dtype=torch.long), torch.randn(2, 4))
