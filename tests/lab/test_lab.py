"""``make lab`` starts JupyterLab at the repository root (chapters, exercises and solutions all reachable): start it
on a free port, fetch /lab and the folder listings, stop it."""
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.net_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_make_lab_serves_the_notebooks():
    port, token = free_port(), "minillm-test"
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
        def listing(path: str) -> set[str]:
            url = f"http://127.0.0.1:{port}/api/contents/{path}?token={token}"
            return {item["name"] for item in json.loads(urllib.request.urlopen(url, timeout=10).read())["content"]}

        assert {"notebooks", "exercises", "solutions"} <= listing(""), "a learner must reach the exercises too"
        assert "00_welcome.ipynb" in listing("notebooks")
        assert "00_warmup.ipynb" in listing("exercises")
        # jupyter/overrides.json, installed by make lab: widget comms on the kernel's main thread (see the Makefile)
        url = f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:kernels-settings?token={token}"
        kernels = json.loads(urllib.request.urlopen(url, timeout=10).read())
        # The server applies overrides.json to the schema's defaults; the user has set nothing.
        assert kernels["schema"]["properties"]["commsOverSubshells"]["default"] == "disabled"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
