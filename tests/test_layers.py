"""Each layer stays in its place: a model constructor leaves the process alone (the commands
tune the allocator), and the data layer takes plain values rather than the run's config."""

from __future__ import annotations

import pytest

import lgvit
import lgvit.cli as cli
import lgvit.core.runtime as runtime


@pytest.fixture
def mallopt_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every glibc mallopt call the process makes from here on (none really made)."""
    calls: list[tuple[int, int]] = []

    class FakeLibc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.delenv("LGVIT_DEFAULT_MALLOC", raising=False)
    monkeypatch.setattr(runtime, "_done", False)
    monkeypatch.setattr(runtime.sys, "platform", "linux")
    monkeypatch.setattr(runtime.ctypes, "CDLL", lambda name: FakeLibc())
    return calls


def test_create_model_leaves_the_allocator_alone(mallopt_calls):
    lgvit.create_model("lsa_micro_cifar", num_classes=10)
    assert mallopt_calls == []
    assert lgvit.tune_cpu_allocator() is True  # the documented call for library users
    assert len(mallopt_calls) == 2  # the mmap and trim thresholds


COMMANDS = {  # the commands that run a model, each with its required arguments
    "train": ["train"],
    "eval": ["eval", "--checkpoint", "x", "--data", "cifar10"],
    "predict": ["predict", "--checkpoint", "x", "img.png"],
    "bench": ["bench"],
    "export": ["export", "x", "--format", "onnx"],
    "viz": ["viz", "x", "img.png", "--what", "attention"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_model_command_tunes_the_allocator_once(command, mallopt_calls, monkeypatch):
    seen: list[int] = []  # mallopt calls made before the command ran
    monkeypatch.setattr(cli, f"cmd_{command}", lambda args: seen.append(len(mallopt_calls)) or 0)
    assert cli.main(COMMANDS[command]) == 0
    assert seen == [2] and len(mallopt_calls) == 2


def test_the_model_zoo_names_every_task_its_files_serve():
    # models/weights.py words "load them with ..." for each task from the task table (facts),
    # without importing the tasks' code
    from lgvit.models.weights import WEIGHTS
    from lgvit.task_table import DEFAULT_TASK, TASK_NAMES, TASKS

    assert all(t.loads_released and t.model_words for t in TASKS.values())
    assert {w.task for w in WEIGHTS} <= set(TASK_NAMES) and DEFAULT_TASK in TASKS


def test_weights_of_another_task_name_their_builder():
    from lgvit.core.errors import LgvitError
    from lgvit.models.weights import WEIGHTS, resolve_weights

    seg = next(w for w in WEIGHTS if w.task == "segmentation")
    with pytest.raises(LgvitError, match=rf"load them with create_segmenter\('{seg.model}', "):
        resolve_weights(seg.name)


def test_a_dense_task_s_weights_are_not_a_classifier_s():
    # inference tells a dense task's released file from a classifier's without the tasks
    from lgvit.core.errors import LgvitError
    from lgvit.inference import load_model
    from lgvit.models.weights import WEIGHTS

    det = next(w for w in WEIGHTS if w.task == "detection")
    with pytest.raises(LgvitError) as e:
        load_model(det.name, "cpu")
    assert str(e.value) == f"{det.name} are detection weights, not a classification model's"
