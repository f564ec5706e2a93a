"""Weighted k-nearest-neighbour classification of frozen features (DINO §4 "k-NN", reference
``eval_knn.py: knn_classifier``; Wu et al. 2018).

For a query q and a bank of training features b_i (all L2-normalised), the k most similar bank
entries (cosine similarity s_i = q·b_i) vote for their labels with weight exp(s_i / T):

    score(c) = Σ_{i in top-k(q)} exp(s_i / T) · [y_i = c],       prediction = argmax_c score(c).

Defaults k = 20, T = 0.07 (DINO §4 and specs §4).

Several k (DINO's ``eval_knn.py`` reports k = 10, 20, 100, 200 from one top-k pass) sweep it:
the votes of every k come from one top-max(k) search, k is picked on a held-out
``select_fraction`` of the training features (queried against the rest of them, never against
the test split), and the test split is then classified with the whole bank at that k. Every k's
test top-1 is kept beside the pick, as DINO's table shows them.

Why not ``lightly.utils.benchmarking.knn_predict``: it forms the similarity of a batch against the
whole bank at once; here the bank may also be split into chunks with a running top-k, so memory
stays ``O(chunk_size · (bank_chunk_size + k))`` however large the bank is (specs §5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
        k: neighbours that vote (DINO §4: 20); several distinct values: a sweep, k picked on
            held-out training features (module docstring).
        temperature: the temperature T of the vote weights exp(sim / T) (DINO §4: 0.07).
        chunk_size: queries per similarity block (memory ~ chunk_size × bank chunk).
        bank_chunk_size: split the bank as well and keep a running top-k (``None``: whole bank
            per query chunk).
        device: where to compute (default: where the bank is).
        select_fraction: the share of the training features held out to pick the k of a sweep.
        seed: of the held-out draw.
    """

    def __init__(
        self,
        k: int | Sequence[int] = 20,
        temperature: float = 0.07,
        chunk_size: int = 256,
        bank_chunk_size: int | None = None,
        device: torch.device | str | None = None,
        select_fraction: float = 0.1,
        seed: int = 0,
    ) -> None:
        ks = [k] if isinstance(k, int) else list(k)
        if not ks or len(set(ks)) != len(ks) or any(isinstance(v, bool) or not isinstance(v, int) for v in ks):
            raise ValueError(f"k: give one number of neighbours, or several distinct ones to sweep, got {k}")
        if min(ks) < 1 or temperature <= 0:
            raise ValueError(f"need k >= 1 and temperature > 0, got k={k}, temperature={temperature}")
        if chunk_size < 1 or (bank_chunk_size is not None and bank_chunk_size < 1):
            raise ValueError("chunk_size and bank_chunk_size must be >= 1")
        if len(ks) > 1 and not 0 < select_fraction < 1:
            raise ValueError(f"select_fraction must be in (0, 1) to hold out features for the k sweep, got {select_fraction}")
        self.ks = tuple(ks)
        self.k = ks[0]  # the k of a single run; after a sweep's evaluate(), the one it picked
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.bank_chunk_size = bank_chunk_size
        self.device = device
        self.select_fraction = select_fraction
        self.seed = seed
        # What a sweep picked and every k's test top-1, for the result record (empty without a sweep).
        self.record_args: dict[str, Any] = {}

    def _held_out(self, n: int) -> int:
        return max(1, round(self.select_fraction * n)) if len(self.ks) > 1 else 0

    def bank_shortfall(self, n: int) -> str | None:
        """Why a bank of ``n`` training examples is too small for these k (``None``: it is not):
        the largest k must fit in the bank, and in a sweep also in what the held-out part leaves."""
        most, held = max(self.ks), self._held_out(n)
        if most > n:
            return f"k={most} neighbours, but the kNN bank holds {n} training examples"
        if most > n - held:
            return (f"k={most} neighbours, but the k sweep holds out {held} of the {n} training examples "
                    f"(select_fraction {self.select_fraction:g}) and leaves {n - held} to vote")
        return None

    @torch.no_grad()
    def votes(
        self, bank: Tensor, bank_labels: Tensor, queries: Tensor, num_classes: int | None = None, ks: Sequence[int] | None = None
    ) -> dict[int, Tensor]:
        """Class votes ``{k: [Q, C]}`` of the queries ``[Q, F]`` against the bank ``[N, F]`` with
        labels ``[N]`` for each k of ``ks`` (default: this classifier's), from one top-max(k)
        search (the sorted top-max(k) list begins with every smaller top-k). Both sides are
        L2-normalised here; ``num_classes`` defaults to ``max(bank_labels) + 1``; the votes come
        back on the queries' device."""
        ks = tuple(self.ks if ks is None else ks)
        _check(bank, bank_labels, queries, max(ks))
        num_classes = int(bank_labels.max()) + 1 if num_classes is None else num_classes
        if int(bank_labels.min()) < 0 or int(bank_labels.max()) >= num_classes:
            raise ValueError(f"bank labels must lie in 0..{num_classes - 1}")
        device = torch.device(self.device) if self.device is not None else bank.device
        bank_n = F.normalize(bank.to(device).float(), dim=1)  # [N, F]
        bank_labels = bank_labels.to(device).long()
        out: dict[int, list[Tensor]] = {k: [] for k in ks}
        for start in range(0, queries.shape[0], self.chunk_size):
            q = F.normalize(queries[start : start + self.chunk_size].to(device).float(), dim=1)  # [q, F]
            sim, idx = _topk_in_chunks(q, bank_n, max(ks), self.bank_chunk_size)  # [q, K], sorted
            weights = (sim / self.temperature).exp()  # [q, K]  (eval_knn.py: distances.div_(T).exp_())
            labels = bank_labels[idx]  # [q, K]
            for k in ks:
                v = torch.zeros(q.shape[0], num_classes, device=device)  # [q, C]
                v.scatter_add_(1, labels[:, :k], weights[:, :k])
                out[k].append(v.to(queries.device))
        return {k: torch.cat(v) for k, v in out.items()}  # {k: [Q, C]}

    def scores(self, bank: Tensor, bank_labels: Tensor, queries: Tensor, num_classes: int | None = None) -> Tensor:
        """Class votes ``[Q, C]`` at this classifier's ``k`` (module docstring)."""
        return self.votes(bank, bank_labels, queries, num_classes, ks=(self.k,))[self.k]

    def select_k(self, features: Tensor, labels: Tensor, num_classes: int) -> tuple[int, dict[int, float]]:
        """The sweep's k: a seeded random ``select_fraction`` of the training features queried
        against the rest of them, scored (top-1) per k; ``(best, scores)``, ties to the first listed."""
        n = features.shape[0]
        short = self.bank_shortfall(n)
        if short is not None:
            raise ValueError(short)
        labels = labels.to(features.device)  # (indexed by the permutation, on the features' device)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).to(features.device)
        val, fit = perm[: self._held_out(n)], perm[self._held_out(n) :]
        votes = self.votes(features[fit], labels[fit], features[val], num_classes)
        scores = {k: topk_accuracy(v, labels[val], ks=(1,))["top1"] for k, v in votes.items()}
        return max(self.ks, key=lambda k: scores[k]), scores

    def evaluate(
        self,
        train_features: Tensor,
        train_labels: Tensor,
        test_features: Tensor,
        test_labels: Tensor,
        num_classes: int | None = None,
    ) -> dict[str, float]:
        """The training set is the bank, the test set the queries. Returns ``{"top1", "top5"}``
        as fractions in [0, 1] (top-5 only with >= 5 classes); of a sweep, at the k it picked."""
        if num_classes is None:
            num_classes = int(max(train_labels.max(), test_labels.max())) + 1
        if len(self.ks) == 1:
            return topk_accuracy(self.scores(train_features, train_labels, test_features, num_classes), test_labels)
        self.k, scores = self.select_k(train_features, train_labels, num_classes)
        votes = self.votes(train_features, train_labels, test_features, num_classes)
        self.record_args = {"selected_k": self.k, "select_top1": {str(k): acc for k, acc in scores.items()},
                            "select_fraction": self.select_fraction,
                            "test_top1_by_k": {str(k): topk_accuracy(v, test_labels, ks=(1,))["top1"] for k, v in votes.items()}}
        return topk_accuracy(votes[self.k], test_labels)
