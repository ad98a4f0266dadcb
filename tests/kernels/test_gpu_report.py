"""``make gpu-report``'s CPU dry run (``bench/gpu_report.py --cpu``): every section runs its small CPU configuration,
the report has every section with its tables, and a section that fails or hangs is reported while the others run.

The dry run is run with the packages the GPU machine lacks made unimportable (a ``sitecustomize`` on
``PYTHONPATH`` hides pyzmq, FastAPI, uvicorn, gguf, the OpenAI client and JupyterLab's packages), so the
sections are shown to need no more than that machine has: torch, Triton, transformers, numpy and msgspec (carried
as a wheel, ``make gpu-wheels``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_report.py"
# Absent from the GPU machine's image (its package list: /opt/torch/.venv there), so refused here.
ABSENT = ("zmq", "fastapi", "uvicorn", "starlette", "gguf", "openai", "jupyterlab", "ipywidgets", "nbformat",
          "IPython")
# None in sys.modules: ``import zmq`` raises ImportError and ``importlib.util.find_spec("zmq")`` answers None, as
# where the package is not installed (transformers probes optional packages with find_spec).
SITECUSTOMIZE = f"import sys\nsys.modules.update(dict.fromkeys({ABSENT!r}))\n"
SECTIONS = ["environment", "kernels", "input_kernels", "attention", "engine_smollm2", "engine_llama8b"]

pytestmark = pytest.mark.slow


def _run(out: Path, tmp: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 300
         ) -> subprocess.CompletedProcess[str]:
    site = tmp / "gpu-machine-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    full_env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out), *args], env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd=tmp)


def test_dry_run_gives_every_section_and_its_tables(tmp_path):
    out = tmp_path / "report"
    start = time.perf_counter()
    proc = _run(out, tmp_path)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "cpu-dry-run"
    assert list(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["status"] == "ok", (name, section)
        assert section["tables"] and all(t.startswith("| ") for t in section["tables"]), name
    md = (out / "report.md").read_text()
    for section in report["sections"].values():
        assert section["title"] in md
    # The tiny model in fp32: minillm's greedy tokens are transformers' own, and async scheduling changes none.
    for name in ("engine_smollm2", "engine_llama8b"):
        data = report["sections"][name]["data"]
        assert data["greedy"]["identical"] == data["greedy"]["prompts"] == 4, data["greedy"]
        assert data["async_same_tokens"] == "4/4"
        assert data["decode_bandwidth"]["achieved_gbs"] > 0
        systems = [row[0] for row in data["throughput"]["rows"]]
        assert systems == ["minillm, async scheduling off", "minillm, async scheduling on",
                           "transformers padded generate", "transformers continuous batching"], systems
    assert report["sections"]["input_kernels"]["data"]["counts"]["passed"] >= 20
    kernels = report["sections"]["kernels"]["data"]["rows"]
    assert {(r[0], r[1]) for r in kernels} == {(d, c) for d in ("float32", "float16")
                                                for c in ("prefill", "chunked prefill", "decode", "mixed varlen")}
    # The budget for the dry run: under 60 s on a 2-core CPU with the rest of the suite beside it (about
    # 35 s alone); the sections' own time is what the report says.
    assert report["seconds"] < 60, f"the dry run took {report['seconds']:.0f} s (wall {seconds:.0f} s)"


def test_a_failing_or_hung_section_is_reported_and_the_others_run(tmp_path):
    out = tmp_path / "report"
    proc = _run(out, tmp_path, "--only", "environment,kernels", env={"MINILLM_GPU_REPORT_FAIL": "environment"})
    assert proc.returncode == 1, proc.stdout[-3000:]
    report = json.loads((out / "report.json").read_text())
    env, kern = report["sections"]["environment"], report["sections"]["kernels"]
    assert env["status"] == "error" and "failed on purpose" in env["error"] and "Traceback" in env["traceback"]
    assert kern["status"] == "ok"
    assert "environment failed on purpose" in (out / "report.md").read_text()

    start = time.perf_counter()
    proc = _run(out, tmp_path, "--only", "environment,kernels", "--limits", "kernels=3",
                env={"MINILLM_GPU_REPORT_HANG": "kernels"})
    assert proc.returncode == 1 and time.perf_counter() - start < 60
    report = json.loads((out / "report.json").read_text())
    assert report["sections"]["environment"]["status"] == "ok"
    assert report["sections"]["kernels"]["status"] == "timeout"
    assert "did not finish within 3 s" in report["sections"]["kernels"]["error"]


def test_bad_arguments_say_what_is_allowed(tmp_path):
    proc = _run(tmp_path / "r", tmp_path, "--only", "kernels,warp_drive")
    assert proc.returncode == 2 and "unknown section(s) ['warp_drive']" in proc.stderr
    proc = _run(tmp_path / "r", tmp_path, "--limits", "kernels=soon")
    assert proc.returncode == 2 and "--limits wants name=seconds" in proc.stderr
