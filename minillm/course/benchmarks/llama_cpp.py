"""llama.cpp's server as a throughput peer, at the benchmark's precision: when a build is present, else skipped.

Nothing can be downloaded at run time, but the source of llama.cpp ships inside the ``llama-cpp-python`` sdist
(``vendor/llama.cpp``). Build the server and the quantize tool from it once (about 20 minutes on 2 cores)::

    pip download llama-cpp-python --no-binary :all: --no-deps -d /tmp/llama && cd /tmp/llama
    tar xzf llama_cpp_python-*.tar.gz && cd llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \\
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    cmake --build build --target llama-server llama-quantize -j2

then point the benchmark at ``build/bin`` (``--llama-cpp-bin DIR`` or ``$LLAMA_CPP_BIN``). The course's GGUF file
is 4-bit (Q4_1); minillm and transformers dequantize it at load, so for the same weights at the same precision
llama.cpp gets an F32 or BF16 GGUF that its ``llama-quantize --allow-requantize`` writes from the same file (made
once, kept in the temporary directory). The server runs one slot per request, continuous batching, greedy
(``temperature=0``), EOS ignored, prompts sent as token ids, prompt cache off.

vLLM counterpart: none; ``vllm bench serve`` measures a running server the same way, over HTTP.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

GGUF_TYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}


def find_llama_cpp(bin_dir: str | None = None) -> Path | None:
    """The directory holding ``llama-server`` and ``llama-quantize``: ``bin_dir``, ``$LLAMA_CPP_BIN``, or the one of
    ``llama-server`` on ``PATH``; ``None`` when there is no build."""
    candidates = [bin_dir, os.environ.get("LLAMA_CPP_BIN")]
    on_path = shutil.which("llama-server")
    candidates.append(str(Path(on_path).parent) if on_path else None)
    for c in candidates:
        if c and all((Path(c) / tool).is_file() for tool in ("llama-server", "llama-quantize")):
            return Path(c)
    return None


def gguf_at(bin_dir: Path, dtype: torch.dtype) -> Path:
    """The course's GGUF file rewritten as ``dtype`` (F32 or BF16) by ``llama-quantize``, made once."""
    from minillm.loaders.model_path import default_model_path

    if dtype not in GGUF_TYPES:
        raise ValueError(f"llama.cpp peer: no GGUF type for {dtype} (only {sorted(map(str, GGUF_TYPES))})")
    src = default_model_path()
    out = Path(tempfile.gettempdir()) / "minillm-llama-cpp" / f"{src.stem}.{GGUF_TYPES[dtype]}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(src), str(tmp), GGUF_TYPES[dtype]],
                       check=True, capture_output=True)
        tmp.rename(out)
    return out


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_llama_cpp(bin_dir: Path, workload: Any, dtype: torch.dtype, threads: int,
                  timeout_s: float = 1800.0) -> Any:
    """Serve ``workload`` with ``llama-server`` (all requests at once, one slot each); start-up is not timed."""
    from minillm.course.benchmarks.throughput import PeerResult

    gguf = gguf_at(bin_dir, dtype)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = len(workload.prompts)
    per_slot = max(len(p) + k for p, k in zip(workload.prompts, workload.output_lens, strict=True))
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(n), "-c", str(n * (per_slot + 16)), "-t", str(threads), "-tb", str(threads),
           "--no-cache-prompt", "--no-webui", "--log-disable"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"llama-server did not start: {' '.join(cmd)}")
            time.sleep(0.3)

        def one(i: int) -> list[int]:
            body = {"prompt": workload.prompts[i], "n_predict": workload.output_lens[i], "temperature": 0.0,
                    "ignore_eos": True, "cache_prompt": False, "return_tokens": True}
            return list(_post(base + "/completion", body, timeout_s)["tokens"])

        _post(base + "/completion", {"prompt": workload.prompts[0][:8], "n_predict": 2, "temperature": 0.0},
              timeout_s)  # warm-up, not timed
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=n) as pool:
            tokens = list(pool.map(one, range(n)))
        seconds = time.perf_counter() - start
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert [len(t) for t in tokens] == workload.output_lens
    return PeerResult("llama.cpp", seconds, workload.num_output_tokens, tokens)
