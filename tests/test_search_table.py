"""The search's printed table shows plans the engine tells apart (session 22): a top 5 of gpt-8.3b held the
winner at two bucket sizes and its EmbRace twin at two, four rows of two figures. A plan with the same
iteration time and the same per-stage peaks as a shown row is folded into that row, which names what it sets
differently."""

from __future__ import annotations

import pytest

from analysis.search_report import folded, print_search, same_figures, setting_differences
from sim.search import SearchSpace, search

TWO_GPUS = {"name": "a100-2", "nodes": 1, "devices_per_node": 2, "device": "A100-80GB", "intra_node_link": "nvlink3"}
# One-stage plans: interleaved with two chunks and 1F1B are one run (the search keeps both names at pp 1).
SPACE = SearchSpace("gpt2-small", TWO_GPUS, global_batch=8, dtype="fp16", max_micro_batch=2, fractions=(),
                    tp_overlaps=(0,), bucket_mbs=(25.0, 100.0), max_chunks=1, refine_shapes=0,
                    gradient_syncs=("allreduce",))


@pytest.fixture(scope="module")
def result():
    return search(SPACE, top_k=60, sample=0, workers=1)


def test_rows_differ_and_every_folded_plan_equals_its_row(result) -> None:
    rows = folded(result.simulated, top=4)
    assert len(rows) == 4
    assert sum(len(same) for _, same in rows) > 0, "the space must hold twins, or this test checks nothing"
    order = {id(r): i for i, r in enumerate(result.simulated)}
    for i, (shown, same) in enumerate(rows):
        assert not any(same_figures(shown, other) for other, _ in rows[i + 1:])
        for twin in same:
            assert same_figures(shown, twin) and order[id(twin)] > order[id(shown)]
            assert twin.candidate != shown.candidate
    # nothing is skipped: every plan the engine put before the last shown row is shown or folded
    last = order[id(rows[-1][0])]
    accounted = {id(r) for shown, same in rows for r in (shown, *same)}
    assert all(id(r) in accounted for r in result.simulated[:last + 1])


def test_a_folded_plan_is_named_by_the_fields_it_sets_differently(result, capsys) -> None:
    pairs = [(shown, twin) for shown, same in folded(result.simulated, top=4) for twin in same]
    assert pairs
    for shown, twin in pairs:
        mine, theirs = shown.candidate.sections(), twin.candidate.sections()
        named = dict(item.split("=", 1) for item in setting_differences(shown.candidate, twin.candidate).split())
        for section in theirs:
            for key in {**mine[section], **theirs[section]}:
                if f"{section}.{key}" in named:
                    assert named[f"{section}.{key}"] == str(theirs[section][key]) != str(mine[section].get(key))
                else:
                    assert mine[section].get(key) == theirs[section].get(key)
    print_search(result, top=4)
    printed = capsys.readouterr().out
    assert "same figures with: parallelism.chunks=1 schedule.name=1f1b" in printed
    assert "folded into their row" in printed
