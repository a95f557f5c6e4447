from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.data.packing import IGNORE_INDEX, TokenizedExample, collate, pack_best_fit, packing_efficiency


@given(st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=80), st.integers(64, 200))
@settings(max_examples=60, deadline=None)
def test_best_fit_places_every_item_once_within_budget(lengths: list[int], budget: int) -> None:
    bins = pack_best_fit(lengths, budget)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    # best-fit decreasing never needs more than 11/9 OPT + 1 bins; OPT >= total / budget
    assert len(bins) <= 11 / 9 * (sum(lengths) / budget) + 2


def test_best_fit_picks_the_tightest_bin() -> None:
    # 6 opens bin A (space 4), 5 opens bin B (space 5), 4 fits both: best fit is A, leaving B for the 5.
    assert pack_best_fit([6, 5, 4, 5], budget=10) == [[0, 2], [1, 3]]


def test_packing_is_deterministic_and_efficient() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(10, 300) for _ in range(500)]
    first, second = pack_best_fit(lengths, 1024), pack_best_fit(lengths, 1024)
    assert first == second
    assert packing_efficiency(lengths, first, 1024) > 0.95


def test_overlong_items_are_rejected() -> None:
    with pytest.raises(ValueError, match="exceed"):
        pack_best_fit([5, 11], budget=10)


def test_collate_builds_host_metadata() -> None:
    docs = [
        TokenizedExample((1, 2, 3), (IGNORE_INDEX, 2, 3)),
        TokenizedExample((4, 5), (4, 5)),
        TokenizedExample((6, 7, 8, 9), (6, 7, 8, 9)),
    ]
    batch = collate(docs)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert batch.document_ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert isinstance(batch.max_seqlen, int) and batch.max_seqlen == 4
    # every document start is masked, whatever its own label said
    assert batch.labels.tolist() == [[IGNORE_INDEX, 2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, 7, 8, 9]]
    assert batch.trained_tokens == 6
    moved = batch.to("cpu")
    assert moved.cu_seqlens is batch.cu_seqlens and moved.max_seqlen == 4
