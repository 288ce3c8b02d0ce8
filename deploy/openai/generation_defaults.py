"""The model's sampling defaults, as vLLM applies them (``--generation-config auto``).

A checkpoint's ``generation_config.json`` may name the sampling its authors recommend
(Qwen3: temperature 0.6, top_p 0.95, top_k 20). vLLM's server makes those the defaults
of its requests, and so does ours: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty`` apply to every request that does not set the field (``null``
counts as not set), and ``max_new_tokens`` is the ``max_tokens`` of a request that sets
none (at most the context the prompt leaves). A request's own value always wins.

``EngineConfig.generation_config`` (``--generation-config``) chooses, as in vLLM:
``auto`` (the default) reads the model folder's file, ``vllm`` applies none (the API's
own defaults: temperature 1, no top-p/top-k/min-p, repetition penalty 1), and a folder
path reads that folder's ``generation_config.json``. A model without the file, or whose
file names none of these fields (the embedded SmolLM2's names only token ids), keeps
the API's defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import BaseModel

from kvroute.replica.sampling_params import SamplingParams

FILE = "generation_config.json"
# generation_config.json key -> request field, with the type the request field takes
_FIELDS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}


@dataclass(frozen=True)
class GenerationDefaults:
    """The request fields' defaults a model's generation config gives (``{field: value}``,
    ``max_tokens`` among them); empty: the API's own defaults."""

    values: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, model_folder: Path | str, mode: str = "auto") -> "GenerationDefaults":
        """``mode``: ``auto`` (``model_folder``'s file, if any), ``vllm`` (none) or a
        folder holding the file. ValueError for a file that cannot be read, a value of
        the wrong type or range, or a named folder without the file."""
        if mode == "vllm":
            return cls()
        file = Path(model_folder if mode == "auto" else mode) / FILE
        if not file.is_file():
            if mode == "auto":
                return cls()
            raise ValueError(f"generation_config={mode!r}: no {FILE} in that folder")
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{file} cannot be parsed ({e})") from e
        if not isinstance(data, dict):
            raise ValueError(f"{file} must hold a JSON object")
        return cls(_checked(data, file))

    def unset_fields(self, req: BaseModel) -> dict[str, Any]:
        """The ``SamplingParams`` fields ``req`` leaves to the defaults, with the model's
        values (``max_tokens`` aside: ``max_tokens`` decides it)."""
        return {k: v for k, v in self.values.items() if k != "max_tokens" and k not in req.model_fields_set}

    def max_tokens(self, room: int, fallback: Optional[int] = None) -> int:
        """The ``max_tokens`` of a request that sets none: the model's ``max_new_tokens``
        at most ``room`` (the context left after the prompt); without one ``fallback``,
        or ``room`` where there is no fallback."""
        if "max_tokens" in self.values:
            return max(1, min(self.values["max_tokens"], room))
        return room if fallback is None else fallback


def _checked(data: dict, file: Path) -> dict[str, Any]:
    """The listed fields of ``data`` that are set, as the request fields' types; each
    in the range ``SamplingParams`` accepts (ValueError naming the file and key)."""
    values: dict[str, Any] = {}
    for key, (name, kind) in _FIELDS.items():
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"{file}: {key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        values[name] = kind(value)
    try:
        SamplingParams(**values)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    return values
