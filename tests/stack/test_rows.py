"""take_rows equals MLX's gather in value and gradient, and builds no gather
or scatter where the rows are runs."""

import os
import tempfile

import mlx.core as mx
import numpy as np
import pytest

from flash_cce.stack.rows import MAX_RUNS, disjoint_sets, runs_of, take_rows


def test_runs_and_their_disjoint_sets():
    assert runs_of([3, 4, 5, 9, 10, 12]) == [(3, 6), (9, 11), (12, 13)]
    assert runs_of([0]) == [(0, 1)]
    assert runs_of([]) == []
    assert runs_of([2, 1, 2]) == [(2, 3), (1, 3)]
    assert disjoint_sets([(3, 6), (9, 11), (12, 13)]) == [[0, 1, 2]]
    # a shared prompt's last row scored again for the second response
    assert disjoint_sets([(0, 10), (5, 6), (12, 14)]) == [[0, 2], [1]]
    assert disjoint_sets([(4, 6), (0, 2), (1, 5)]) == [[1, 0], [2]]


CASES = {
    "one run": [2, 3, 4, 5],
    "runs with gaps": [0, 1, 4, 5, 6, 10, 15],
    "to the last row": [13, 14, 15],
    "every row": list(range(16)),
    "repeated rows": [1, 2, 2, 3],
    "decreasing": [5, 4, 9],
    "a row of a shared prompt twice": list(range(10)) + [5, 12, 13],
    "overlapping runs": [3, 4, 5, 6, 4, 5, 5, 0],
    "too many runs": list(range(0, 2 * MAX_RUNS + 4, 2)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_take_rows_equals_the_gather(name):
    idx = CASES[name]
    rows = max(16, max(idx) + 1)
    rng = np.random.default_rng(0)
    h = mx.array(rng.standard_normal((rows, 3)).astype(np.float32))
    w = mx.array(rng.standard_normal((len(idx), 3)).astype(np.float32))

    def f(take):
        return lambda x: (take(x) * w).sum()

    ours = mx.value_and_grad(f(lambda x: take_rows(x, idx)))(h)
    gather = mx.value_and_grad(f(lambda x: x[mx.array(idx)]))(h)
    # Both sum the same products in the same order: equal to the bit.
    assert np.array_equal(np.array(take_rows(h, idx)), np.array(h[mx.array(idx)]))
    assert ours[0].item() == gather[0].item()
    assert np.array_equal(np.array(ours[1]), np.array(gather[1]))


def _primitives(*arrays):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "graph.dot")
        mx.export_to_dot(path, *arrays)
        return open(path).read()


def test_runs_build_no_gather_or_scatter():
    idx = CASES["runs with gaps"]
    h = mx.ones((16, 3))
    value, grad = mx.value_and_grad(lambda x: (take_rows(x, idx) ** 2).sum())(h)
    graph = _primitives(value, grad)
    assert "Gather" not in graph and "Scatter" not in graph
    assert "Gather" in _primitives(h[mx.array(idx)])  # the check can see one
