"""What verification forwards cost, kept across processes (r2lm.generation.costs.save / load): a process that loads
a table measures nothing for the same forwards and decodes the same text; the table is found by the forwards'
architectures and shapes, not by a model object; a file from another machine, or not a file of costs, is refused
by name and nothing of it is taken."""

import copy
import json
import math

import pytest
import torch

from r2lm import generate
from r2lm.drafter import Drafter, DrafterConfig
from r2lm.generation import costs
from r2lm.generation.costs import MeasuredCosts, cost_name
from tests.helpers.decoding import left_padded
from tests.helpers.models import tiny_conversion


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(an R2LM conversion without sidecars, an untrained drafter for it)."""
    _, target = tiny_conversion(tmp_path_factory.mktemp("costs"), "qwen3", sidecar_layers=[])
    torch.manual_seed(1)
    return target, Drafter(DrafterConfig.for_target(target.config, block_size=4)).eval()


@pytest.fixture
def loaded(monkeypatch):
    """The tables `load` takes, this test's own (a process's: other tests' files stay out)."""
    monkeypatch.setattr(costs, "_LOADED", {})
    return costs._LOADED


def verified(target, drafter):
    ids, mask = left_padded(batch=2)
    return generate(target, ids, attention_mask=mask, max_new_tokens=6, verify=True, drafter=drafter,
                    eos_token_id=[]).sequences


def seconds_by_name(model) -> dict:
    """The tables kept for `model`, by their names: what a file holds of them."""
    return {kept.name: {part: kept.table()[part] for part in costs.SAVED} for kept in costs._KEPT[model].values()}


def test_saved_costs_spare_another_process_the_measurement(converted, loaded, tmp_path, monkeypatch):
    """Another model object of the same architecture, with a drafter of the same shape, is what the next process
    loads: the first call there times no forward, takes the saved seconds, and commits the same tokens (the
    re-measurements steps may ask for left out: a tiny model's steps are mostly host work, far from its forwards)."""
    target, drafter = converted
    first_target, first_drafter = copy.deepcopy(target), copy.deepcopy(drafter)  # objects no call measured for
    before = verified(first_target, first_drafter)
    path = tmp_path / "costs.json"
    costs.save(path)
    saved = json.loads(path.read_text())
    assert not list(tmp_path.glob(".*.tmp"))  # written whole, under its name
    ours = seconds_by_name(first_target)
    in_file = {json.dumps(t["name"], sort_keys=True): {part: t[part] for part in costs.SAVED} for t in saved["tables"]}
    assert ours and ours.items() <= in_file.items()

    def refuse(self, rows):
        raise AssertionError(f"timed the forwards at {rows} rows: the loaded table has them")

    again_target, again_drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    costs.load(path)
    monkeypatch.setattr(MeasuredCosts, "time_forwards", refuse)
    monkeypatch.setattr(MeasuredCosts, "remeasure", lambda self, rows, disagreement, decoded: False)
    assert torch.equal(verified(again_target, again_drafter), before)
    assert seconds_by_name(again_target) == ours


def test_a_table_steps_had_measured_enough_is_measured_no_more_in_the_next_process(converted, loaded, tmp_path,
                                                                                    monkeypatch):
    """Steps a re-measurement does not bear out (a fixed host cost beside the forwards, not a passing load) settle a
    table; the next process takes it settled: its steps, however far from their prices, measure nothing."""
    target, drafter = converted
    first = copy.deepcopy(target)
    verified(first, copy.deepcopy(drafter))
    for kept in costs._KEPT[first].values():
        if not kept.table()["final"]:
            # steps a million times their price, long enough to pay for it: the forwards measured again do not agree
            kept.remeasure(1, 1e6, decoded=math.inf)
    assert all(kept.table()["final"] for kept in costs._KEPT[first].values())
    path = tmp_path / "costs.json"
    costs.save(path)
    costs.load(path)
    monkeypatch.setattr(MeasuredCosts, "time_forwards", lambda self, rows: pytest.fail("measured again"))
    again = copy.deepcopy(target)
    verified(again, copy.deepcopy(drafter))
    assert costs._KEPT[again] and all(kept.table()["final"] for kept in costs._KEPT[again].values())


def test_a_table_is_named_by_the_forwards_it_times_not_the_weights(converted):
    """The same architecture with other weights costs the same (one name); another drafter shape, draft length or
    model architecture is another table."""
    target, drafter = converted
    shapes = dict(drafts="ModelDrafts", block_size=4, capture=[1], outcomes=[], widths=[1, 2], compile=False)
    other_weights = copy.deepcopy(drafter)
    with torch.no_grad():
        next(other_weights.parameters()).add_(1.0)
    name = cost_name(target, drafter, **shapes)
    assert cost_name(copy.deepcopy(target), other_weights, **shapes) == name
    wider = Drafter(DrafterConfig.for_target(target.config, block_size=4, intermediate_size=64))
    assert cost_name(target, wider, **shapes) != name
    assert cost_name(target, drafter, **{**shapes, "block_size": 8}) != name
    assert cost_name(target, None, **shapes) != name
    assert json.loads(name)["where"] == [torch.get_num_threads(), "torch.float32", "cpu"]


def test_a_file_from_elsewhere_or_not_of_costs_is_refused_by_name(converted, loaded, tmp_path):
    target, drafter = converted
    verified(copy.deepcopy(target), copy.deepcopy(drafter))
    path = tmp_path / "costs.json"
    costs.save(path)
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "machine": "another"}))
    with pytest.raises(ValueError, match="measured on another machine, torch or kernel build"):
        costs.load(path)
    for damage in ({"verify": {"1": {"1": "slow"}}}, {"final": "yes"}):
        broken = copy.deepcopy(saved)
        broken["tables"].append({**broken["tables"][0], "name": {"model": "x"}, **damage})
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match="is not a file of r2lm verification costs"):
            costs.load(path)
    for text in ("{", json.dumps({"machine": saved["machine"]})):
        path.write_text(text)
        with pytest.raises(ValueError, match="is not a file of r2lm verification costs"):
            costs.load(path)
    with pytest.raises(ValueError, match="is not a file of r2lm verification costs"):
        costs.load(tmp_path / "missing.json")
    assert loaded == {}  # nothing of a refused file was taken
