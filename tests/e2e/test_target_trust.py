"""The ``_target_`` allow-list is a boundary: a target outside it is refused before anything of it is
imported or called, in one message with exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from train_helpers import run_rlcli

MODULE = "import_side_effect"  # writes a file when it is imported


def side_effect_module(tmp_path: Path) -> Path:
    """A module in ``tmp_path`` that writes ``imported`` next to itself when imported; the file's path."""
    marker = tmp_path / "imported"
    (tmp_path / f"{MODULE}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "import lightning\nclass Callback(lightning.Callback):\n    pass\n")
    return marker


@pytest.mark.parametrize("args, key", [
    ([f"callbacks=[{{_target_: {MODULE}.Callback}}]"], "callbacks[0]._target_"),
    ([f"+loss._target_={MODULE}.Callback"], "loss._target_"),
], ids=["callback", "loss"])
def test_an_untrusted_target_is_refused_without_importing_it(tmp_path, args, key):
    """Fails when rlcli imports the module (the marker file appears) before refusing it."""
    marker = side_effect_module(tmp_path)
    result = run_rlcli(["train", *args, "trainer.max_steps=1", "hydra.run.dir=run"], tmp_path, timeout=300,
                       extra_env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{key}: '{MODULE}." in result.stderr and f"to trust it, add allow_targets=[{MODULE}]" in result.stderr
    assert "Traceback" not in result.stderr and "(1 problem)" in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("trusted", [[], ["allow_targets=[torch]"]], ids=["default", "torch-allowed"])
def test_a_torch_function_as_a_callback_is_refused_without_running_it(tmp_path, trusted):
    """The issue's ``torch.ops.load_library`` in the shape of ``torch.save``, whose effect is a file: by
    default torch is not trusted (torch.ops.load_library, torch.save and torch.hub.load run code or write
    files); allowed, a function is still no Callback class and is refused before it is called. Fails
    when the callback is built first (the file is written, then the run refuses a non-Callback)."""
    written = tmp_path / "written.pt"
    args = ["train", *trusted, f"callbacks=[{{_target_: torch.save, obj: 1, f: '{written}'}}]", "trainer.max_steps=1",
            "hydra.run.dir=run"]
    result = run_rlcli(args, tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    expected = ("callbacks[0]._target_: 'torch.save' is not a lightning Callback class" if trusted else
                "callbacks[0]._target_: 'torch.save' is outside the allowed modules (rlcli)")
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("rlcli train: error:") == 1 and "problems" not in result.stderr, result.stderr
    assert not written.exists()


def test_the_issues_load_library_callback_is_refused_by_the_allow_list(tmp_path):
    """``torch.ops.load_library`` loads (runs) a shared library: refused by name, before anything is called."""
    library = tmp_path / "x.so"
    result = run_rlcli(["train", f"callbacks=[{{_target_: torch.ops.load_library, path: '{library}'}}]",
                        "hydra.run.dir=run"], tmp_path, timeout=300)
    assert result.returncode == 2
    assert "callbacks[0]._target_: 'torch.ops.load_library' is outside the allowed modules (rlcli)" in result.stderr
    assert "Traceback" not in result.stderr
