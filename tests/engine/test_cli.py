"""``python -m minillm generate`` answers on the real model; bad arguments give a clear usage error."""
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_generate_says_paris():
    out = subprocess.run([sys.executable, "-m", "minillm", "generate", "What is the capital of France?",
                          "--max-tokens", "16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout, out.stdout


def test_bad_arguments_are_refused():
    out = subprocess.run([sys.executable, "-m", "minillm", "generate", "hi", "--max-tokens", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "must be a positive integer, got 0" in out.stderr


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    import minillm.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    assert cli.main(["generate", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
