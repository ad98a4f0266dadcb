"""``python -m minillm serve`` and ``bench`` run at ``--dtype auto`` (issue 28) and print which dtype and why at
start-up; ``EngineArgs()``, ``LLM()`` and ``generate`` keep fp32, the dtype the lessons compare against transformers in.

``auto`` is bf16 on a CPU with AMX-BF16 or AVX512-BF16 and fp32 elsewhere, so every test here runs under both
kinds of CPU: the ``cpu`` fixture replaces ``minillm.platforms.cpu.cpu_flags`` (the ``/proc/cpuinfo`` flags) with
an AMX machine's, an AVX512-BF16 machine's and an AVX2 laptop's, whatever this machine has. The model is never
loaded from disk: ``serve`` stops where it would load it, ``bench`` gets the session's model (cast to bf16 when it
asks for bf16) and serves one tiny request.
"""
from __future__ import annotations

import pytest
import torch

import minillm
import minillm.cli as cli
import minillm.platforms.cpu as cpu_module
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.async_llm import AsyncLLM
from minillm.engine.llm_engine import LLMEngine
from minillm.platforms.cpu import cpu_capability
from tests.dtype_helpers import bf16_copy
from tests.engine_helpers import single_thread  # noqa: F401

# name: (/proc/cpuinfo flags, what auto picks there, the reason it gives)
CPUS = {
    "amx": ({"fpu", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, torch.bfloat16,
            "auto: this CPU has AMX-BF16"),
    "avx512-bf16": ({"fpu", "avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, "auto: this CPU has AVX512-BF16"),
    "avx2": ({"fpu", "avx2", "fma"}, torch.float32,
             "auto: this CPU has neither AMX-BF16 nor AVX512-BF16, so bf16 would be emulated and slower"),
}


@pytest.fixture(params=sorted(CPUS))
def cpu(request, monkeypatch) -> tuple[torch.dtype, str]:
    """This process sees the flags of ``CPUS[param]``; returns what ``auto`` must pick and the reason it must give
    (with this machine's torch CPU capability, which the flags do not change)."""
    flags, dtype, reason = CPUS[request.param]
    monkeypatch.setattr(cpu_module, "cpu_flags", lambda path="/proc/cpuinfo": frozenset(flags))
    return dtype, f"{reason}; torch CPU capability {cpu_capability()}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture
def engine_args_seen(monkeypatch) -> list[EngineArgs]:
    """The engine's ``from_engine_args`` records its arguments and stops with a Ctrl-C where it would load the model.

    Both engines are stopped: ``serve`` builds an :class:`AsyncLLM` (vLLM's serving engine), ``LLM`` and ``bench``
    an :class:`LLMEngine`. A server that got past this would load the model and serve until the test's timeout."""
    seen: list[EngineArgs] = []

    def stop_before_loading(cls, engine_args, **kwargs):
        seen.append(engine_args)
        raise KeyboardInterrupt

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(stop_before_loading))
    monkeypatch.setattr(AsyncLLM, "from_engine_args", classmethod(stop_before_loading))
    return seen


# -- serve -------------------------------------------------------------------------------------------------------
# A serve test that reached the model would serve forever; 60 s ends it as a failure, not a hung suite.
@pytest.mark.timeout(60)
def test_serve_runs_at_auto_and_prints_which_and_why(cpu, engine_args_seen, capsys):
    """The start-up line comes before the model loads, and it is the dtype the engine is then built in."""
    from minillm.entrypoints.openai.api_server import main

    dtype, reason = cpu
    code = main(["--port", "0", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 130, out  # the Ctrl-C of engine_args_seen: "interrupted while loading the model"
    assert [a.dtype for a in engine_args_seen] == ["auto"] and engine_args_seen[0].resolved_dtype() == dtype
    lines = [line for line in out.splitlines() if line.startswith("minillm: dtype")]
    assert lines == [f"minillm: dtype {_name(dtype)} ({reason})"], out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("asked, dtype", [("float32", torch.float32), ("bf16", torch.bfloat16)])
def test_serve_dtype_asked_for_wins_and_is_printed(cpu, engine_args_seen, capsys, asked, dtype):
    from minillm.entrypoints.openai.api_server import main

    assert main(["--port", "0", "--device", "cpu", "--dtype", asked]) == 130
    assert engine_args_seen[0].resolved_dtype() == dtype
    assert f"minillm: dtype {_name(dtype)} (asked for)" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("command, says", [
    ("serve", ["--dtype DTYPE weights, activations and KV cache (the cache follows the model). Default here: auto, "
               "the dtype this machine is built for: bfloat16 on a CPU with AMX-BF16 or AVX512-BF16, else float32",
               "the choice and why are printed at start-up", "float32 is EngineArgs' and LLM's default"]),
    ("bench", ["--dtype {float32,bfloat16,auto} the precision of every system and of the roofline's matmuls "
               "(default auto: bfloat16 on a CPU with AMX-BF16 or AVX512-BF16, else float32",
               "printed with the reason at start-up", "float32 is the lessons' dtype, EngineArgs' and LLM's default"]),
])
def test_help_names_the_default(capsys, command, says):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert [s for s in says if s not in help_text] == [], help_text


# -- bench -------------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("single_thread")
def test_bench_runs_at_auto_and_prints_which_and_why(cpu, smollm, monkeypatch, capsys):
    """``python -m minillm bench`` with no --dtype: the start-up line (stderr, before the models load), the model
    it loads, and the report all say the dtype auto picked on this CPU, and why."""
    dtype, reason = cpu
    asked: list[torch.dtype] = []

    def load_model(model=None, dtype=torch.float32, **kwargs):
        asked.append(dtype)
        return (bf16_copy(smollm[0]) if dtype == torch.bfloat16 else smollm[0]), smollm[1]

    monkeypatch.setattr(minillm, "load_model", load_model)
    code = cli.main(["bench", "--peers", "minillm", "--num-requests", "1", "--min-prompt", "4", "--max-prompt", "4",
                     "--output-lens", "2"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert asked == [dtype]
    assert out.err.splitlines()[0] == f"dtype: {_name(dtype)} ({reason})", out.err
    assert f"dtype: {_name(dtype)} ({reason}), every system and the roofline" in out.out.splitlines(), out.out


def test_bench_and_serve_parse_to_auto():
    import inspect

    from minillm.course.benchmarks.throughput import run_benchmark

    parser = cli.build_parser()
    assert parser.parse_args(["bench"]).dtype == "auto" and parser.parse_args(["serve"]).dtype == "auto"
    assert parser.parse_args(["serve", "--dtype", "float32"]).dtype == "float32"
    assert inspect.signature(run_benchmark).parameters["dtype"].default == "auto"


# -- what stays fp32 ---------------------------------------------------------------------------------------------
def test_engine_args_llm_and_generate_stay_fp32(cpu, engine_args_seen, capsys):
    """Even where auto is bf16: EngineArgs(), LLM() and ``python -m minillm generate`` (LLM()) run fp32."""
    from minillm.entrypoints.llm import LLM

    assert EngineArgs(device="cpu").dtype is None and EngineArgs(device="cpu").resolved_dtype() == torch.float32
    with pytest.raises(KeyboardInterrupt):
        LLM(device="cpu")
    assert cli.main(["generate", "hi"]) == 130  # cli turns the Ctrl-C into 130
    assert [a.dtype for a in engine_args_seen] == [None, None]
    assert all(a.resolved_dtype() == torch.float32 for a in engine_args_seen if a.resolved_device() == "cpu")
