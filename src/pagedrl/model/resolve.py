"""What a model argument names, as a folder on disk: the one place that decides it.

A model is named the way transformers, TRL and vLLM users name it, tried in this order:

1. the embedded default's name (`smollm2-135m-instruct`): its GGUF, converted once into the cache;
2. a local folder or file that exists — it wins over a Hub id of the same spelling, as in transformers;
3. a local `.gguf` file: converted once into pagedrl's cache;
4. a Hugging Face Hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`, at `revision`), or a GGUF file in a Hub
   repository (`org/repo/file.gguf`): resolved with `huggingface_hub`, so its cache layout,
   `HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_TOKEN` mean what they mean for those tools, and a
   cache they already filled is used as is. Only the files pagedrl reads are fetched. Without a
   network the cache alone answers at once: the Hub is asked only after its host took a connection.

A Hub repository may hold a model or a LoRA adapter (PEFT's format): both resolve to their snapshot
folder, and an adapter's `base_model_name_or_path` resolves the same way.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

from pagedrl.model.adapter import read_adapter_config
from pagedrl.model.checkpoint import CheckpointError
from pagedrl.model.default import DEFAULT_MODEL, default_gguf_path, resolve_default_model
from pagedrl.model.gguf import ensure_converted
from pagedrl.paths import cache_dir

# What pagedrl reads from a model or adapter folder (checkpoint.py, tokenizer.py, adapter.py, loader.py);
# nothing else of a Hub repository (other weight formats, ONNX exports, images) is downloaded.
HUB_FILES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "additional_chat_templates/*.jinja", "adapter_config.json", "adapter_model.safetensors")
_TRUE = {"1", "on", "yes", "true"}
# How long the Hub's host (or the proxy to it) has to take a TCP connection before the cache alone
# answers: without a network, huggingface_hub's own timeouts and retries held a request 23.5 s.
HUB_PROBE_TIMEOUT_S = 2.0


def hub_cache_dir() -> Path:
    """The Hub cache huggingface_hub uses, read from the environment now (not at its import):
    $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = Path(os.environ["XDG_CACHE_HOME"]).expanduser() if os.environ.get("XDG_CACHE_HOME") \
        else Path.home() / ".cache"
    return xdg / "huggingface" / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the Hub ($HF_ENDPOINT, or the proxy the environment routes it through) takes a TCP
    connection within `timeout_s`. The probe runs in a thread of its own, so a name lookup that hangs
    (getaddrinfo has no timeout) costs `timeout_s` too, not the resolver's."""
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "", endpoint.port or (443 if endpoint.scheme == "https" else 80)
    proxy = getproxies().get(endpoint.scheme)
    if proxy and not proxy_bypass(host):
        via = urlsplit(proxy if "://" in proxy else "http://" + proxy)
        host, port = via.hostname or "", via.port or (443 if via.scheme == "https" else 80)
    done, answered = threading.Event(), []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            answered.append(True)
        except (OSError, UnicodeError):
            pass
        finally:
            done.set()

    threading.Thread(target=probe, name="hub-probe", daemon=True).start()
    return done.wait(timeout_s) and bool(answered)


def is_repo_id(name: str) -> bool:
    """Whether `name` is spelled as a Hub repository id (`org/name` or `name`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_gguf(name: str) -> tuple[str, str] | None:
    """(repo id, file) for `org/repo/path/file.gguf`, else None."""
    parts = name.split("/")
    if not name.endswith(".gguf") or len(parts) < 3 or not is_repo_id("/".join(parts[:2])):
        return None
    return "/".join(parts[:2]), "/".join(parts[2:])


def from_hub(repo_id: str, revision: str | None = None, filename: str | None = None) -> Path:
    """The cached snapshot folder of `repo_id` (or one `filename` in it), downloading what is missing
    unless offline; every failure is one CheckpointError naming the id, the revision and the cache."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, offline = hub_cache_dir(), hub_offline()
    unreachable = not offline and not hub_reachable()
    what = repo_id + (f"/{filename}" if filename else "") + (f" at revision {revision!r}" if revision else "")
    try:
        if filename is not None:
            return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache,
                                        local_files_only=offline or unreachable))
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      local_files_only=offline or unreachable, allow_patterns=list(HUB_FILES)))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise CheckpointError(f"{what}: not a local folder or file, and not in the Hugging Face cache {cache} "
                              f"({why}); download it where the Hub is reachable (e.g. `hf download {repo_id}`), "
                              "or name a local folder") from None
    except GatedRepoError:
        raise CheckpointError(f"{what}: a gated repository on the Hugging Face Hub; accept its terms and set "
                              "HF_TOKEN (or log in with `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: no such local folder or file, and no such model on the Hugging Face "
                              "Hub (if it is private, set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo_id}: the Hugging Face Hub has no revision {revision!r} of it") from None
    except EntryNotFoundError:
        raise CheckpointError(f"{what}: no such file in the repository") from None
    except HfHubHTTPError as e:
        raise CheckpointError(f"{what}: the Hugging Face Hub answered {e}") from None


def resolve_model_path(model: str | Path | None, revision: str | None = None) -> Path:
    """The folder behind a model argument (see the module docstring for the order); `revision` (a
    branch, tag or commit) applies to a Hub id only."""
    if model is None or str(model) == DEFAULT_MODEL:
        return resolve_default_model()
    path = Path(model).expanduser()
    if path.exists() and path.suffix == ".gguf":
        return converted_gguf(path)
    if path.exists():
        return path
    name = str(model)
    if (in_repo := hub_gguf(name)) is not None:
        return converted_gguf(from_hub(in_repo[0], revision, filename=in_repo[1]))
    if path.suffix == ".gguf":
        raise CheckpointError(f"{path}: GGUF file not found (a GGUF in a Hub repository is named org/repo/file.gguf)")
    if is_repo_id(name):
        return from_hub(name, revision)
    raise CheckpointError(f"{path}: no such folder or file (expected a Hugging Face folder, a Hub id such as "
                          f"HuggingFaceTB/SmolLM2-135M-Instruct, a .gguf file or {DEFAULT_MODEL!r})")


def resolve_gguf(model: str | Path | None, revision: str | None = None) -> tuple[Path, Path] | None:
    """(the GGUF file, its converted folder) for a model argument that names one (the embedded default's, a
    local `.gguf`, or `org/repo/file.gguf` from the Hub), each looked up once; None for a folder."""
    if model is None or str(model) == DEFAULT_MODEL:
        return default_gguf_path(), resolve_default_model()
    path = Path(model).expanduser()
    if path.exists():
        return (path, converted_gguf(path)) if path.suffix == ".gguf" and path.is_file() else None
    in_repo = hub_gguf(str(model))
    if in_repo is None:
        return None
    source = from_hub(in_repo[0], revision, filename=in_repo[1])
    return source, converted_gguf(source)


def converted_gguf(path: Path) -> Path:
    """The Hugging Face folder a GGUF file converts to, in pagedrl's cache, keyed by the file's identity."""
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file (a GGUF model is one .gguf file)")
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return ensure_converted(path, cache_dir() / "gguf" / f"{path.stem}-{key}")


def adapter_base(adapter: str | Path, base: str | Path | None = None, revision: str | None = None) -> Path:
    """The base model's folder of a LoRA adapter folder: `base` if given (at `revision`), else the
    model the adapter's `base_model_name_or_path` names (a folder or a Hub id, at its `revision`)."""
    if base is None:
        config = read_adapter_config(adapter)
        base, revision = config.base_model_name_or_path, config.revision
        if not base:
            raise CheckpointError(f"{adapter}: adapter_config.json names no base_model_name_or_path; give the base model")
    return resolve_model_path(base, revision)
