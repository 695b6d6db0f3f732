"""The console commands: every ``console_scripts`` entry of setup.cfg names a
``ds_pfc.cli.<name>:main`` with a ``build_parser()``; ``launch/*.py`` run those same
mains; ``ds-pfc-train`` outside a checkout asks for ``--deepspeed_config`` in one line."""
from __future__ import annotations

import argparse
import configparser
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ["train", "eval", "export", "bench", "experiments", "selfcheck", "migrate", "clean"]


def _console_scripts() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = [line.strip() for line in cfg["options.entry_points"]["console_scripts"].splitlines() if line.strip()]
    return dict((part.strip() for part in line.split("=", 1)) for line in lines)


def test_console_scripts_are_the_cli_mains():
    assert _console_scripts() == {f"ds-pfc-{name}": f"ds_pfc.cli.{name}:main" for name in COMMANDS}


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_has_a_parser_and_main(name, capsys):
    module = importlib.import_module(f"ds_pfc.cli.{name}")
    assert isinstance(module.build_parser(), argparse.ArgumentParser)
    with pytest.raises(SystemExit) as caught:
        module.main(["--help"])
    assert caught.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["train", "eval", "export", "bench", "experiments"])
def test_launch_scripts_call_the_same_main(name):
    spec = importlib.util.spec_from_file_location(f"_launch_{name}", os.path.join(ROOT, "launch", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.join(ROOT, "launch"))
    assert module.main is importlib.import_module(f"ds_pfc.cli.{name}").main


def test_train_without_the_shipped_quickstart_asks_for_the_config(monkeypatch):
    from ds_pfc.app import recipes
    from ds_pfc.cli import train
    monkeypatch.setattr(recipes, "recipe_dir", lambda: os.path.join(ROOT, "no-such-dir"))
    with pytest.raises(SystemExit) as caught:
        train.main([])
    message = str(caught.value.code)
    assert message.startswith("error: ") and "--deepspeed_config" in message and "\n" not in message


def test_train_defaults_to_the_shipped_quickstart():
    from ds_pfc.cli import train
    assert os.path.samefile(train.default_config(), os.path.join(ROOT, "configs", "cpu_quickstart.json"))


@pytest.mark.parametrize("argv", [["launch/train.py", "--help"], ["-m", "ds_pfc.selfcheck", "--help"],
                                  ["-m", "ds_pfc.cli.migrate", "--help"], ["launch/bench.py", "--help"]])
def test_entry_files_run(argv):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr


@pytest.mark.parametrize("value", [os.path.join("configs", "cpu_quickstart.json"),
                                   os.path.join("somewhere", "else", "cpu_quickstart")])
def test_a_missing_path_named_like_a_shipped_config_names_it(tmp_path, monkeypatch, value):
    """Outside a checkout, configs/cpu_quickstart.json is no file; the error names the
    shipped config to pass instead (the shipped files are listed here from the package's
    folder, independently of the code under test)."""
    from ds_pfc.cli import train
    shipped = os.path.join(os.path.dirname(train.__file__), os.pardir, "configs", "cpu_quickstart.json")
    assert os.path.isfile(shipped)
    monkeypatch.chdir(tmp_path)                 # no configs/ here
    code, _, err = _call_train(["--deepspeed_config", value])
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 1 and len(line) == 1, err
    assert "not found" in line[0] and str(tmp_path / value) in line[0]
    assert "; cpu_quickstart is a config shipped with ds_pfc: --deepspeed_config cpu_quickstart" in line[0]
    assert os.listdir(tmp_path) == []               # nothing written


def test_a_missing_path_of_another_name_gets_no_shipped_config_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _call_train(["--deepspeed_config", os.path.join("configs", "my_job.json")])
    assert code == 1 and "config file not found" in err and "shipped" not in err


def _call_train(args):
    import sys as _sys
    _sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _inprocess import call_main
    from ds_pfc.cli.train import main
    return call_main(main, args)
