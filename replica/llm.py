"""Offline API for scripts and benchmarks: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Sequence, Union

from kvroute.replica.config import EngineConfig
from kvroute.replica.engine import Engine
from kvroute.replica.outputs import RequestOutput
from kvroute.replica.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int]]
Message = dict[str, str]


class LLM:
    """A single in-process engine. Keyword arguments are :class:`EngineConfig` fields."""

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_kwargs: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_path(self) -> Path:
        return self.engine.model_path

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        lora_name: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string (tokenized with the model's tokenizer) or a list of token
        ids; a single prompt may be passed bare. ``lora_name``: the LoRA adapter of every
        prompt, or one per prompt (None: the base model). Every request is validated
        before any is queued, so a bad one leaves the engine untouched.
        """
        token_lists = self._to_token_lists(prompts)
        if params is None:
            params = SamplingParams()
        plist = [params] * len(token_lists) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(token_lists):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(token_lists)} prompts")
        loras = [lora_name] * len(token_lists) if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        if len(loras) != len(token_lists):
            raise ValueError(f"got {len(loras)} lora_name entries for {len(token_lists)} prompts")
        reqs = [
            self.engine.make_request(f"llm-{next(self._ids)}", ids, p, cache_salt, lora_name=lora)
            for ids, p, lora in zip(token_lists, plist, loras)
        ]
        outputs = {r.request_id: RequestOutput(r.request_id, list(r.prompt_token_ids)) for r in reqs}
        for r in reqs:
            self.engine.add(r)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        try:
            pending = len(reqs)
            while pending:
                for delta in self.engine.step().deltas:
                    out = outputs.get(delta.request_id)
                    if out is None:
                        continue
                    out.add(delta)
                    if delta.finish_reason is not None:
                        pending -= 1
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [outputs[r.request_id] for r in reqs]

    def load_lora(self, name: str, path: str | Path) -> None:
        """Register the PEFT adapter folder ``path`` as ``name`` (needs ``enable_lora``)."""
        self.engine.load_lora(name, str(path))

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (with the generation prompt) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c) for c in convs]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.engine.model_id!r} has no chat template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        out = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def _to_token_lists(self, prompts: Prompt | Sequence[Prompt]) -> list[list[int]]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # a single prompt
        if not prompts:
            raise ValueError("prompts must not be empty")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                out.append(self.tokenizer.encode(p, add_special_tokens=True))
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                out.append(list(p))
            else:
                raise ValueError(f"prompts[{i}] must be a string or a list of token ids")
        return out
