"""Restartable runs, mixed precision and per-epoch logs (issue 34, items 2 and 3)."""
import copy
import logging

import pytest
import torch
from helpers.ddp_prune import huber_loss, regression_problem

from sparsecnn.data import Batches
from sparsecnn.prune import TrainConfig, admm_prune_, prune_and_finetune, train_epochs
from sparsecnn.prune.resume import RunState


class Killed(Exception):
    """Stands for the process being killed."""


def _killing(loss, after_calls=None):
    """`loss` that raises Killed on call `after_calls` + 1; its `calls` list counts the calls."""
    calls = [0]

    def wrapped(model, batch):
        calls[0] += 1
        if after_calls is not None and calls[0] > after_calls:
            raise Killed
        return loss(model, batch)
    wrapped.calls = calls
    return wrapped


def _admm(model, x, y, loss, state=None):
    return admm_prune_(model, Batches(x, y, 32, shuffle=True, seed=0), {"0": 0.7, "2": 0.7}, admm_epochs=3,
                       finetune_epochs=2, lr=0.05, finetune_lr=0.05, loss=loss, train=TrainConfig(state=state))


# 4 steps an epoch, 3 of ADMM and 2 of fine-tuning: killed in ADMM's epoch 2, in fine-tuning's epoch 2.
@pytest.mark.parametrize("killed_after_calls, calls_left", [(5, 16), (17, 4)])
def test_a_run_killed_after_an_epoch_and_resumed_ends_like_an_uninterrupted_one(killed_after_calls, calls_left,
                                                                                tmp_path):
    dense, x, y = regression_problem()
    model = copy.deepcopy(dense)
    masks = _admm(model, x, y, huber_loss)
    path = tmp_path / "run.state"
    with pytest.raises(Killed):
        _admm(copy.deepcopy(dense), x, y, _killing(huber_loss, killed_after_calls), RunState(path))
    assert path.exists() and not list(tmp_path.glob(".*.tmp"))
    resumed, counted = copy.deepcopy(dense), _killing(huber_loss)
    resumed_masks = _admm(resumed, x, y, counted, RunState(path))
    assert counted.calls == [calls_left]  # from the last epoch recorded, not from the start
    assert sorted(resumed_masks) == sorted(masks)
    for name, mask in masks.items():
        assert torch.equal(resumed_masks[name], mask)
    for key, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_a_dataloader_run_with_dropout_resumes_exactly(tmp_path):
    """A DistributedSampler (seeded, one process) and dropout: batch order and RNG come back."""
    _, x, y = regression_problem()
    torch.manual_seed(1)
    dense = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 3))
    dataset = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(dataset, 16, sampler=torch.utils.data.DistributedSampler(
        dataset, num_replicas=1, rank=0, seed=3))
    config = TrainConfig(epochs=3, lr=0.05)
    model = copy.deepcopy(dense)
    masks, _ = prune_and_finetune(model, 0.5, loader, loss=huber_loss, train=config)
    path = tmp_path / "run.state"
    with pytest.raises(Killed):
        prune_and_finetune(copy.deepcopy(dense), 0.5, loader, loss=_killing(huber_loss, 17),
                           train=config.replace(state=RunState(path)))
    resumed, counted = copy.deepcopy(dense), _killing(huber_loss)
    resumed_masks, _ = prune_and_finetune(resumed, 0.5, loader, loss=counted,
                                          train=config.replace(state=RunState(path)))
    assert counted.calls == [8]  # 8 steps an epoch, killed in the third
    assert all(torch.equal(resumed_masks[name], mask) for name, mask in masks.items())
    assert all(torch.equal(resumed.state_dict()[key], value) for key, value in model.state_dict().items())


def test_a_state_file_of_another_run_is_refused(tmp_path):
    model, x, y = regression_problem()
    path = tmp_path / "run.state"
    train_epochs(model, Batches(x, y, 32), TrainConfig(epochs=1, state=RunState(path)), huber_loss, description="a")
    with pytest.raises(ValueError, match="phase 0 is 'a' there but 'b' in this run"):
        train_epochs(model, Batches(x, y, 32), TrainConfig(epochs=1, state=RunState(path)), huber_loss,
                     description="b")
    (tmp_path / "junk").write_bytes(b"not a state")
    with pytest.raises(ValueError, match="junk"):
        RunState(tmp_path / "junk")
    with pytest.raises(TypeError, match="TrainConfig.state must be a RunState"):
        TrainConfig(state=str(path))


def test_a_phase_begun_with_other_settings_is_refused_naming_each_difference(tmp_path):
    model, _, _ = regression_problem()
    path = tmp_path / "run.state"
    first = RunState(path)
    phase = first.begin("search", {"size": 3, "rate": 0.5, "layers": {"0": 0.7}})
    first.save(phase, 1, False, 0, float("nan"), {"model": model}, None, torch.device("cpu"))
    with pytest.raises(ValueError) as refused:
        RunState(path).begin("search", {"size": 4, "rate": 0.5, "layers": {"0": 0.8}, "extra": True})
    assert str(refused.value) == (f"run state {path}: phase 0 ('search') ran with extra=unset there but True here, "
                                  f"layers={{'0': 0.7}} there but {{'0': 0.8}} here, size=3 there but 4 here; "
                                  f"delete the file or use another path")
    assert RunState(path).begin("search", {"layers": {"0": 0.7}, "rate": 0.5, "size": 3}) == phase


def test_a_value_computed_between_phases_is_the_first_runs_after_a_resume(tmp_path):
    """The accuracy before pruning is measured after dense training; a resumed run skips that
    finished phase (the model keeps its initial weights), so it must get the first run's value."""
    path = tmp_path / "run.state"
    model, x, y = regression_problem()
    first = RunState(path)
    train_epochs(model, Batches(x, y, 32), TrainConfig(epochs=1, state=first), huber_loss, description="dense")
    before = first.remember("metric_before", lambda: float(huber_loss(model, (x, y))))
    train_epochs(model, Batches(x, y, 32), TrainConfig(epochs=1, state=first), huber_loss, description="tune")
    fresh, _, _ = regression_problem()   # a restarted process: initial weights again
    again = RunState(path)
    train_epochs(fresh, Batches(x, y, 32), TrainConfig(epochs=1, state=again), huber_loss, description="dense")
    assert float(huber_loss(fresh, (x, y))) != before   # the skipped phase left its weights out
    assert again.remember("metric_before", lambda: float(huber_loss(fresh, (x, y)))) == before


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_learns_and_keeps_masks(precision):
    model, x, y = regression_problem()
    batches = Batches(x, y, 32, shuffle=True)
    masks = {"0": torch.rand(32, 6, generator=torch.Generator().manual_seed(0)) > 0.5}
    first = train_epochs(model, batches, TrainConfig(epochs=1, lr=0.05, precision=precision), huber_loss, masks=masks)
    last = train_epochs(model, batches, TrainConfig(epochs=4, lr=0.05, precision=precision), huber_loss, masks=masks)
    assert last < first
    assert torch.equal(model[0].weight != 0, masks["0"]) and model[0].weight.dtype == torch.float32
    with pytest.raises(ValueError, match="TrainConfig.precision must be one of fp32, bf16, fp16, got 'fp8'"):
        TrainConfig(precision="fp8")


def test_one_log_line_per_epoch(caplog):
    model, x, y = regression_problem()
    with caplog.at_level(logging.INFO, logger="sparsecnn.prune"):
        train_epochs(model, Batches(x, y, 32), TrainConfig(epochs=2), huber_loss, description="toy")
    lines = [record.getMessage() for record in caplog.records if record.name == "sparsecnn.prune"]
    assert len(lines) == 2 and lines[1].startswith("toy: epoch 2/2, loss ")
