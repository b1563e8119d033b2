"""benchmarks/spec_bound.py's replay: the steps n-gram speculation with free
verification takes to produce an answer."""

from __future__ import annotations

from benchmarks import workloads
from benchmarks.spec_bound import replay

PROMPT = [1, 2, 3, 4, 5, 6]
ANSWER = [3, 4, 5, 6, 7]


def test_a_repeated_stretch_is_proposed_and_kept():
    # Step 1: nothing recurs, the model's 3. Step 2: "3" recurs and proposes
    # 4 5 6 3; 4 5 6 are kept, the step's own token is the 7.
    assert replay(PROMPT, ANSWER, k=4, min_n=1) == 2
    # With two-token n-grams: 3, then 4 ("6 3" never occurred), then "3 4"
    # proposes 5 6 3 4, of which 5 6 are kept, and the 7.
    assert replay(PROMPT, ANSWER, k=4, min_n=2) == 3
    # k caps what one step keeps: 3; 4 kept + 5; 6 kept + 7.
    assert replay(PROMPT, ANSWER, k=1, min_n=1) == 3


def test_the_last_token_is_always_the_models_own():
    # "9" recurs and proposes 8 9: both kept, and the step's own 8 ends it.
    assert replay([9, 8, 9], [8, 9, 8], k=8, min_n=1) == 1
    # An answer the prompt predicts wholly still takes a step per k + 1.
    assert replay([5, 6, 7, 5, 6, 7], [5, 6, 7, 5, 6, 7], k=2, min_n=1) == 2


def test_the_workloads_asks_are_the_requests_compare_sends():
    grounded = workloads.grounded_asks(3, 2, 40)
    assert grounded[1].startswith("Task 3-1. Copy out the following text exactly")
    assert grounded[1].endswith(workloads.passage(3001, 40))
    assert workloads.chat_asks(0, 5)[4].startswith("(4) Write a short story about")
