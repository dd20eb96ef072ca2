"""Trained quantization: weight sharing by k-means, then fine-tuning of the shared values
(Deep Compression, section 3).

Each layer's non-zero weights are clustered into at most ``2**bits - 1`` shared values (code 0
stays the pruned zero), the centroids initialised linearly over the weights' range (the
paper's best initialisation). Every weight is replaced by its centroid.

Fine-tuning trains the centroids, not the weights: the gradient of a centroid is the sum of
the gradients of the weights that share it (the paper's Fig. 3, "group by, reduce").
:class:`ClusterOptimizer` wraps an optimizer over the centroids (and over the parameters that
are not shared, such as biases) and writes the shared values back into the weights after each
step, so the network trains with its quantized weights throughout and pruned weights stay zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels.compression.kmeans import kmeans_1d
from ..memory.runtime.transfer import copy_into, to_host
from ..net.optim import Optimizer, OptimizerWrapper
from ..net.parameter import Parameter


@dataclass
class SharedWeights:
    """A weight tensor as codes (0: zero, ``i >= 1``: ``codebook[i - 1]``) and a codebook."""

    codes: np.ndarray  # int64, the weight's shape
    codebook: np.ndarray  # float32 (k,)
    bits: int
    iterations: int = 0

    def dense(self, dtype: Any = np.float32) -> np.ndarray:
        """The weights these codes and shared values stand for."""
        table = np.concatenate([[0.0], self.codebook]).astype(dtype)
        return table[self.codes]

    @property
    def nonzeros(self) -> int:
        return int(np.count_nonzero(self.codes))


def share_weights(weights: Any, bits: int, max_iter: int = 100) -> SharedWeights:
    """Cluster the non-zero ``weights`` into ``min(2**bits - 1, distinct values)`` shared
    values (k-means, linear initialisation)."""
    w = np.asarray(weights, dtype=np.float32)
    nz = w != 0
    values = w[nz]
    codes = np.zeros(w.shape, dtype=np.int64)
    k = min((1 << int(bits)) - 1, len(np.unique(values)))
    if k == 0:
        return SharedWeights(codes, np.zeros(0, dtype=np.float32), bits)
    centroids, labels, iterations = kmeans_1d(values, k, max_iter=max_iter)
    codes[nz] = labels + 1
    return SharedWeights(codes, centroids.astype(np.float32), bits, iterations)


class ClusterOptimizer(OptimizerWrapper):
    """Fine-tunes shared values: ``make_inner(parameters)`` builds the optimizer of the
    centroids (one :class:`Parameter` per shared weight, ``{name}.centroids``) and of the
    other trainable ``params``; each step sums the weights' gradients per cluster into the
    centroids' gradients, updates, and writes the shared values into the weights."""

    def __init__(self, params: list[Parameter], shared: dict[str, SharedWeights],
                 make_inner: Callable[[list[Parameter]], Optimizer]) -> None:
        self.weights = {p.name: p for p in params if p.name in shared}
        missing = sorted(set(shared) - set(self.weights))
        if missing:
            raise ValueError(f"shared weights for unknown parameters: {', '.join(missing)}")
        self.shared = shared
        self.centroids = {n: Parameter(f"{n}.centroids", s.codebook.astype(np.float32))
                          for n, s in shared.items()}
        self._members: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for n, s in shared.items():
            flat = s.codes.reshape(-1)
            where = np.flatnonzero(flat)
            self._members[n] = (where, flat[where] - 1)
        others = [p for p in params if p.trainable and p.name not in shared]
        super().__init__(make_inner(list(self.centroids.values()) + others))

    def centroid_gradients(self) -> None:
        """Each centroid's gradient: the sum of its weights' gradients."""
        for n, p in self.weights.items():
            c = self.centroids[n]
            if p.grad is None:
                c.grad = None
                continue
            where, cluster = self._members[n]
            g = to_host(p.grad).reshape(-1)[where]
            c.grad = np.bincount(cluster, weights=g, minlength=c.shape[0]).astype(np.float32)

    def write_weights(self) -> None:
        """Every shared weight set from its codes and the current centroids."""
        for n, p in self.weights.items():
            s = self.shared[n]
            s.codebook = np.asarray(self.centroids[n].data, dtype=np.float32).copy()
            copy_into(p.data, s.dense(p.dtype))

    def step(self) -> None:
        self.centroid_gradients()
        self.inner.step()
        self.write_weights()
