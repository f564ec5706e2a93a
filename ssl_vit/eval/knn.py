"""Weighted k-nearest-neighbour classification of frozen features (DINO §4 "k-NN", reference
``eval_knn.py: knn_classifier``; Wu et al. 2018). The k bank entries most similar to a query
(L2-normalised, cosine similarity s_i) vote for their labels with weight exp(s_i / T):

    score(c) = Σ_{i in top-k(q)} exp(s_i / T) · [y_i = c],       prediction = argmax_c score(c).

Several k sweep it (DINO reports k = 10, 20, 100, 200): k is picked on a held-out ``select_fraction``
of the training features queried against the rest, never on the test split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_vit.eval.results import held_out, topk_accuracy


def _topk_in_chunks(q: Tensor, bank: Tensor, k: int, bank_chunk_size: int | None) -> tuple[Tensor, Tensor]:
    """Top-k cosine similarities (and bank indices) of normalised queries ``[Q, F]`` against the bank
    ``[N, F]``, merging per-chunk top-k lists so no ``[Q, N]`` matrix is formed (unlike lightly's ``knn_predict``)."""
    step = bank_chunk_size or bank.shape[0]
    best_sim, best_idx = q.new_empty(q.shape[0], 0), torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
    for start in range(0, bank.shape[0], step):
        sim = q @ bank[start : start + step].T  # [Q, n_chunk]
        top_sim, top_idx = sim.topk(min(k, sim.shape[1]), dim=1)  # [Q, <=k]
        cand_sim, cand_idx = torch.cat([best_sim, top_sim], dim=1), torch.cat([best_idx, top_idx + start], dim=1)  # [Q, <=2k]
        best_sim, pos = cand_sim.topk(min(k, cand_sim.shape[1]), dim=1)  # [Q, <=k]
        best_idx = cand_idx.gather(1, pos)
    return best_sim, best_idx


@dataclass
class KNNClassifier:
    """DINO's weighted kNN (module docstring): ``k`` neighbours (DINO §4: 20; several: a sweep) vote with
    weights exp(sim / ``temperature``) (0.07); ``chunk_size`` queries against ``bank_chunk_size`` bank rows at a time."""

    k: int | list[int] = 20
    temperature: float = 0.07
    chunk_size: int = 256
    bank_chunk_size: int | None = None
    device: str | None = None
    select_fraction: float = 0.1
    seed: int | None = None
    picked: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)  # a sweep's choice, for the result

    @property
    def ks(self) -> tuple[int, ...]:
        return (self.k,) if isinstance(self.k, int) else tuple(self.k)

    def bank_shortfall(self, n: int) -> str | None:
        """Why ``n`` training examples (less a sweep's held-out part) are too few for the largest k; None if not."""
        most, held = max(self.ks), max(1, round(self.select_fraction * n)) if len(self.ks) > 1 else 0  # (as held_out)
        if most > n:
            return f"k={most} neighbours, but the kNN bank holds {n} training examples"
        if most > n - held:
            return (f"k={most} neighbours, but the k sweep holds out {held} of the {n} training examples "
                    f"(select_fraction {self.select_fraction:g}) and leaves {n - held} to vote")
        return None

    @torch.no_grad()
    def votes(self, bank: Tensor, bank_labels: Tensor, queries: Tensor, num_classes: int, ks: tuple[int, ...] | None = None) -> dict[int, Tensor]:
        """Class votes ``{k: [Q, C]}`` of queries ``[Q, F]`` against a bank ``[N, F]`` labelled ``[N]``,
        every k from one top-max(k) search (it begins with every smaller top-k)."""
        ks = ks or self.ks
        assert bank.ndim == queries.ndim == 2 and bank.shape[1] == queries.shape[1] and bank_labels.shape == bank.shape[:1]
        assert max(ks) <= bank.shape[0], f"k={max(ks)} must be in 1..{bank.shape[0]} (the bank size)"
        device = torch.device(self.device) if self.device is not None else bank.device
        bank_n, bank_labels = F.normalize(bank.to(device).float(), dim=1), bank_labels.to(device).long()  # [N, F], [N]
        out: dict[int, list[Tensor]] = {k: [] for k in ks}
        for start in range(0, queries.shape[0], self.chunk_size):
            q = F.normalize(queries[start : start + self.chunk_size].to(device).float(), dim=1)  # [q, F]
            sim, idx = _topk_in_chunks(q, bank_n, max(ks), self.bank_chunk_size)  # [q, K], sorted
            weights, labels = (sim / self.temperature).exp(), bank_labels[idx]  # [q, K] (eval_knn.py: distances.div_(T).exp_())
            for k in ks:
                v = torch.zeros(q.shape[0], num_classes, device=device).scatter_add_(1, labels[:, :k], weights[:, :k])  # [q, C]
                out[k].append(v.to(queries.device))
        return {k: torch.cat(v) for k, v in out.items()}

    def scores(self, bank: Tensor, bank_labels: Tensor, queries: Tensor, num_classes: int | None = None) -> Tensor:
        """Class votes ``[Q, C]`` at the first k (``num_classes``: default max label + 1)."""
        return self.votes(bank, bank_labels, queries, num_classes or int(bank_labels.max()) + 1, ks=self.ks[:1])[self.ks[0]]

    def evaluate(self, train_features: Tensor, train_labels: Tensor, test_features: Tensor, test_labels: Tensor,
                 num_classes: int | None = None) -> dict[str, float]:
        """``{"top1", "top5"}`` of the test features against the training features (a sweep: at the k picked)."""
        num_classes = num_classes or int(max(train_labels.max(), test_labels.max())) + 1
        if len(self.ks) == 1:
            return topk_accuracy(self.scores(train_features, train_labels, test_features, num_classes), test_labels)
        labels = train_labels.to(train_features.device)
        val, fit = held_out(len(train_features), self.select_fraction, self.seed)
        held = self.votes(train_features[fit], labels[fit], train_features[val], num_classes)
        select = {k: topk_accuracy(v, labels[val], ks=(1,))["top1"] for k, v in held.items()}
        best = max(self.ks, key=lambda k: select[k])  # ties: the first listed
        test = self.votes(train_features, train_labels, test_features, num_classes)
        self.picked = {"selected_k": best, "select_top1": {str(k): a for k, a in select.items()}, "select_fraction": self.select_fraction,
                       "test_top1_by_k": {str(k): topk_accuracy(v, test_labels, ks=(1,))["top1"] for k, v in test.items()}}
        return topk_accuracy(test[best], test_labels)
