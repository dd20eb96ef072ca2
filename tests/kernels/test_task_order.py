"""List scheduling of the fused RNN layers' tasks: durations measured by ``run_tasks`` and the
critical-path order built from them."""

from __future__ import annotations

import time

import pytest

from minidl.kernels.parallel import critical_path_order, run_tasks


def _tasks(graph: dict[str, list[str]], log: list | None = None) -> list:
    def fn(key):
        def run(wid):
            if log is not None:
                log.append(key)
        return run
    return [(k, deps, fn(k)) for k, deps in graph.items()]


def test_longest_path_first_ties_in_given_order():
    # a -> c -> d (long chain) beside b (short, independent), e after a
    graph = {"b": [], "a": [], "e": ["a"], "c": ["a"], "d": ["c"]}
    durations = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "e": 0.5}
    order = [k for k, _, _ in critical_path_order(_tasks(graph), durations)]
    assert order == ["a", "c", "d", "b", "e"]  # paths 8, 7, 4, 2, 0.5
    # without durations every task counts 1: a (3) before b (1); e and b tie: given order
    order = [k for k, _, _ in critical_path_order(_tasks(graph), {})]
    assert order == ["a", "c", "b", "e", "d"]


def test_dependencies_given_after_their_dependents_and_cycles():
    graph = {"late": ["early"], "early": []}
    assert [k for k, _, _ in critical_path_order(_tasks(graph), {})] == ["early", "late"]
    with pytest.raises(ValueError, match="cycle"):
        critical_path_order(_tasks({"x": ["y"], "y": ["x"]}), {})


def test_run_tasks_measures_each_task_and_keeps_dependencies():
    log: list = []
    graph = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}
    tasks = _tasks(graph, log)
    tasks[1] = ("b", ["a"], lambda wid: (time.sleep(0.01), log.append("b")))
    durations: dict = {}
    run_tasks(critical_path_order(tasks, {}), 2, durations)
    assert set(durations) == set(graph) and durations["b"] >= 0.01
    assert log[0] == "a" and log[-1] == "d"
