"""``make lab`` starts JupyterLab serving notebooks/: start it on a free port, fetch /lab, stop it."""
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_make_lab_serves_the_notebooks():
    port, token = _free_port(), "minillm-test"
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token}"
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        body, deadline = None, time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=5).read()
                break
            except OSError:
                time.sleep(1)
        assert body is not None, f"JupyterLab did not answer: {proc.stdout.read(4000) if proc.poll() else ''}"
        assert b"JupyterLab" in body
        listing = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}", timeout=10).read()
        assert b"00_welcome.ipynb" in listing, "JupyterLab must serve notebooks/"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
