"""Weighted k-nearest-neighbour classification of frozen features (DINO §4 "k-NN", reference
``eval_knn.py: knn_classifier``; Wu et al. 2018).

For a query q and a bank of training features b_i (all L2-normalised), the k most similar bank
entries (cosine similarity s_i = q·b_i) vote for their labels with weight exp(s_i / T):

    score(c) = Σ_{i in top-k(q)} exp(s_i / T) · [y_i = c],       prediction = argmax_c score(c).

Defaults k = 20, T = 0.07 (DINO §4 and specs §4).

Why not ``lightly.utils.benchmarking.knn_predict``: it forms the similarity of a batch against the
whole bank at once; here the bank may also be split into chunks with a running top-k, so memory
stays ``O(chunk_size · (bank_chunk_size + k))`` however large the bank is (specs §5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_vit.eval.metrics import topk_accuracy


def _check(bank: Tensor, bank_labels: Tensor, queries: Tensor, k: int) -> None:
    if bank.ndim != 2 or queries.ndim != 2:
        raise ValueError(f"features must be [N, F]; got bank {tuple(bank.shape)}, queries {tuple(queries.shape)}")
    if bank.shape[1] != queries.shape[1]:
        raise ValueError(f"bank and query features differ in width: {bank.shape[1]} vs {queries.shape[1]}")
    if bank_labels.shape != (bank.shape[0],):
        raise ValueError(f"bank labels must be [{bank.shape[0]}], got {tuple(bank_labels.shape)}")
    if not 1 <= k <= bank.shape[0]:
        raise ValueError(f"k={k} must be in 1..{bank.shape[0]} (the bank size)")


def _topk_in_chunks(q: Tensor, bank: Tensor, k: int, bank_chunk_size: int | None) -> tuple[Tensor, Tensor]:
    """Top-k cosine similarities of normalised queries ``[Q, F]`` against the bank ``[N, F]``,
    optionally merging per-chunk top-k lists so no ``[Q, N]`` matrix is ever formed."""
    n = bank.shape[0]
    step = n if bank_chunk_size is None else bank_chunk_size
    best_sim = q.new_empty(q.shape[0], 0)  # [Q, 0]
    best_idx = torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
    for start in range(0, n, step):
        sim = q @ bank[start : start + step].T  # [Q, n_chunk]
        top_sim, top_idx = sim.topk(min(k, sim.shape[1]), dim=1)  # [Q, <=k]
        cand_sim = torch.cat([best_sim, top_sim], dim=1)  # [Q, <=2k]
        cand_idx = torch.cat([best_idx, top_idx + start], dim=1)
        best_sim, pos = cand_sim.topk(min(k, cand_sim.shape[1]), dim=1)  # [Q, <=k]
        best_idx = cand_idx.gather(1, pos)
    return best_sim, best_idx  # [Q, k], [Q, k]


class KNNClassifier:
    """DINO's weighted kNN protocol; the constructor is its configuration.

    Args:
        k, temperature: neighbours and the temperature T of the vote weights exp(sim / T)
            (DINO §4: k = 20, T = 0.07).
        chunk_size: queries per similarity block (memory ~ chunk_size × bank chunk).
        bank_chunk_size: split the bank as well and keep a running top-k (``None``: whole bank
            per query chunk).
        device: where to compute (default: where the bank is).
    """

    def __init__(
        self,
        k: int = 20,
        temperature: float = 0.07,
        chunk_size: int = 256,
        bank_chunk_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if k < 1 or temperature <= 0:
            raise ValueError(f"need k >= 1 and temperature > 0, got k={k}, temperature={temperature}")
        if chunk_size < 1 or (bank_chunk_size is not None and bank_chunk_size < 1):
            raise ValueError("chunk_size and bank_chunk_size must be >= 1")
        self.k = k
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.bank_chunk_size = bank_chunk_size
        self.device = device

    @torch.no_grad()
    def scores(self, bank: Tensor, bank_labels: Tensor, queries: Tensor, num_classes: int | None = None) -> Tensor:
        """Class votes ``[Q, C]`` of the queries ``[Q, F]`` against the bank ``[N, F]`` with labels
        ``[N]`` (module docstring). Both sides are L2-normalised here. ``num_classes`` defaults to
        ``max(bank_labels) + 1``; the votes come back on the queries' device."""
        _check(bank, bank_labels, queries, self.k)
        num_classes = int(bank_labels.max()) + 1 if num_classes is None else num_classes
        if int(bank_labels.min()) < 0 or int(bank_labels.max()) >= num_classes:
            raise ValueError(f"bank labels must lie in 0..{num_classes - 1}")
        device = torch.device(self.device) if self.device is not None else bank.device
        bank_n = F.normalize(bank.to(device).float(), dim=1)  # [N, F]
        bank_labels = bank_labels.to(device).long()
        out = []
        for start in range(0, queries.shape[0], self.chunk_size):
            q = F.normalize(queries[start : start + self.chunk_size].to(device).float(), dim=1)  # [q, F]
            sim, idx = _topk_in_chunks(q, bank_n, self.k, self.bank_chunk_size)  # [q, k]
            weights = (sim / self.temperature).exp()  # [q, k]  (eval_knn.py: distances.div_(T).exp_())
            votes = torch.zeros(q.shape[0], num_classes, device=device)  # [q, C]
            votes.scatter_add_(1, bank_labels[idx], weights)
            out.append(votes.to(queries.device))
        return torch.cat(out)  # [Q, C]

    def evaluate(
        self,
        train_features: Tensor,
        train_labels: Tensor,
        test_features: Tensor,
        test_labels: Tensor,
        num_classes: int | None = None,
    ) -> dict[str, float]:
        """The training set is the bank, the test set the queries. Returns ``{"top1", "top5"}``
        as fractions in [0, 1] (top-5 only with >= 5 classes)."""
        if num_classes is None:
            num_classes = int(max(train_labels.max(), test_labels.max())) + 1
        return topk_accuracy(self.scores(train_features, train_labels, test_features, num_classes), test_labels)
