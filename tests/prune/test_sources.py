"""`sparsecnn prune`'s MODEL and --data (issue 34, item 4): parsing, image folders, CIFAR-10 on disk."""
import pickle

import numpy as np
import pytest
import torch

from sparsecnn.cli import main
from sparsecnn.prune import load_pruned
from sparsecnn.prune.sources import DataSource, datasets, model_spec, parse_data_source


def test_data_sources_parse_and_errors_name_the_argument(tmp_path):
    assert parse_data_source("digits") == DataSource("digits")
    assert parse_data_source(f"imagefolder:{tmp_path}") == DataSource("imagefolder", tmp_path)
    assert parse_data_source(f"cifar10:{tmp_path}") == DataSource("cifar10", tmp_path)
    for text, message in [("imagenet:x", "--data: unknown source 'imagenet'"), ("digits:x", "--data digits takes no"),
                          ("cifar10:", "--data cifar10 needs a folder"),
                          (f"imagefolder:{tmp_path / 'no'}", "no such directory")]:
        with pytest.raises(ValueError, match=message):
            parse_data_source(text)


def test_model_specs_and_their_errors(tmp_path):
    assert model_spec("lenet5") == ("lenet5", None)
    assert model_spec("torchvision:resnet18") == ("torchvision:resnet18", None)
    with pytest.raises(ValueError, match="MODEL 'nope' is not a zoo model"):
        model_spec("nope")
    with pytest.raises(ValueError, match="torchvision:NAME needs a NAME"):
        model_spec("torchvision:")


@pytest.mark.parametrize("argv, message", [
    (["lenet5", "--data", "imagenet:/x"], "--data: unknown source 'imagenet'"),
    (["lenet5", "--data", "cifar10:/no/such/dir"], "--data cifar10:/no/such/dir: no such directory"),
    (["nope"], "MODEL 'nope' is not a zoo model"),
    (["lenet5", "--precision", "fp8"], None),
])
def test_cli_prune_data_and_model_errors(argv, message, tmp_path, capsys):
    if message is None:  # an argparse choice: exits 2 itself
        with pytest.raises(SystemExit):
            main(["prune", "-o", str(tmp_path / "x.pt")] + argv)
        return
    assert main(["prune", "-o", str(tmp_path / "x.pt"), "--device", "cpu"] + argv) == 2
    assert message in capsys.readouterr().err


def test_torchvision_models_need_torchvision(tmp_path, capsys):
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision is installed here")
    except ImportError:
        pass
    assert main(["prune", "torchvision:resnet18", "-o", str(tmp_path / "x.pt"), "--device", "cpu"]) == 2
    assert "MODEL torchvision:resnet18: torchvision is not installed here" in capsys.readouterr().err


def _image_folder(root, classes=2, per_class=10):
    """root/<class>/<i>.png: 10x12 RGB images, class c brighter on the left (c = 0) or right."""
    image_module = pytest.importorskip("PIL.Image")
    generator = np.random.default_rng(0)
    for label in range(classes):
        (root / f"class{label}").mkdir(parents=True)
        for index in range(per_class):
            pixels = generator.integers(0, 80, size=(10, 12, 3), dtype=np.uint8)
            pixels[:, 6 * label:6 * label + 6] += 150
            image_module.fromarray(pixels).save(root / f"class{label}" / f"{index}.png")
    return root


def test_an_image_folder_streams_normalised_images_and_holds_out_a_validation_part(tmp_path):
    root = _image_folder(tmp_path / "images")
    train, validation, classes = datasets(parse_data_source(f"imagefolder:{root}"), (1, 28, 28), seed=0)
    assert classes == 2 and (len(train), len(validation)) == (18, 2)
    image, label = train[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and label.dtype == torch.int64
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="no images"):
        datasets(parse_data_source(f"imagefolder:{tmp_path / 'empty'}"), (1, 28, 28), seed=0)


def test_cli_prunes_on_an_image_folder_and_the_checkpoint_loads(tmp_path, capsys):
    root = _image_folder(tmp_path / "images")
    output = tmp_path / "pruned.pt"
    argv = ["prune", "lenet5", "--data", f"imagefolder:{root}", "--epochs", "1", "--finetune-epochs", "1",
            "--batch-size", "6", "--device", "cpu", "-o", str(output), "--state", str(tmp_path / "run.state")]
    assert main(argv) == 0
    assert "top-1 on imagefolder:" in capsys.readouterr().out
    model, masks, report = load_pruned(output)
    assert list(model.parameters())[-1].shape == (2,) and report["start"] == "dense" and sorted(masks)
    assert main(["prune", str(output), "--data", f"imagefolder:{root}", "--method", "evolutionary",
                 "--device", "cpu", "-o", str(tmp_path / "again.pt")]) == 2
    assert "--method evolutionary needs --data digits" in capsys.readouterr().err


def _cifar10(root, per_batch=4):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    generator = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": generator.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8),
                 b"labels": list(range(per_batch))}
        with open(folder / name, "wb") as file:
            pickle.dump(batch, file)
    return root


def test_cifar10_in_torchvisions_format_loads_without_torchvision(tmp_path):
    root = _cifar10(tmp_path / "cifar")
    train, test, classes = datasets(parse_data_source(f"cifar10:{root}"), (3, 32, 32), seed=0)
    assert (len(train), len(test), classes) == (20, 4, 10)
    image, label = train[5]
    assert image.shape == (3, 32, 32) and label.item() == 1
    (root / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="lacks test_batch"):
        datasets(parse_data_source(f"cifar10:{root}"), (3, 32, 32), seed=0)
    with pytest.raises(ValueError, match="3 channels"):
        datasets(parse_data_source(f"cifar10:{_cifar10(tmp_path / 'other')}"), (1, 28, 28), seed=0)
