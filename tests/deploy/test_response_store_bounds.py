"""The response store's bounds as an operator sets them: ``--response-store-max-entries``,
``--response-store-max-mib`` and ``--response-store-ttl-s`` on ``kvroute serve-replica``
and ``kvroute serve``, ``ingress.response_store_*`` in the Serve config (both
``ServerLimits`` fields), a bad value refused with its name before anything starts; and
``serve-replica``'s in-process store keeping to them (the store's own eviction is
test_responses_api's ``test_bounded_store_evicts_by_count_bytes_and_age``)."""

from __future__ import annotations

import pytest

from kvroute.deploy.cli import _limits, build_parser, main, serve_app_args
from kvroute.deploy.openai.responses.store import StoreBounds
from kvroute.deploy.openai.serving import ServerLimits

FLAGS = ["--response-store-max-entries", "3", "--response-store-max-mib", "2", "--response-store-ttl-s", "60"]
SET = StoreBounds(max_entries=3, max_bytes=2 * 2**20, ttl_s=60.0)


@pytest.mark.parametrize("command", ["serve-replica", "serve"])
def test_flags_set_the_bounds_and_their_absence_keeps_the_defaults(command):
    assert _limits(build_parser().parse_args([command, *FLAGS])).response_store_bounds() == SET
    assert _limits(build_parser().parse_args([command])).response_store_bounds() == StoreBounds()


def test_serve_puts_them_in_the_ingress_config():
    parsed = serve_app_args(build_parser().parse_args(["serve", *FLAGS]))
    ingress = parsed.ingress
    assert (ingress.response_store_max_entries, ingress.response_store_max_mib, ingress.response_store_ttl_s) == (3, 2, 60)
    assert parsed.limits().response_store_bounds() == SET


@pytest.mark.parametrize("command", ["serve-replica", "serve"])
@pytest.mark.parametrize("flag,value,message", [
    ("--response-store-max-entries", "0", "must be a number above 0, got '0'"),
    ("--response-store-max-entries", "1.5", "invalid int value: '1.5'"),
    ("--response-store-max-mib", "-1", "must be a number above 0, got '-1'"),
    ("--response-store-max-mib", "lots", "invalid float value: 'lots'"),
    ("--response-store-ttl-s", "inf", "must be a number above 0, got 'inf'"),
    ("--response-store-ttl-s", "nan", "must be a number above 0, got 'nan'"),
])  # fmt: skip
def test_a_bad_flag_exits_2_naming_it(command, flag, value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("field,value", [("response_store_max_entries", 0), ("response_store_max_mib", 0),
                                         ("response_store_ttl_s", -5), ("response_store_max_entries", "many")])
def test_a_bad_ingress_field_is_refused_naming_it(field, value):
    from kvroute.deploy.app_config import parse_args

    args = {"llm_configs": [{"model_loading_config": {"model_id": "m"}}], "ingress": {field: value}}
    with pytest.raises(ValueError, match=rf"ingress\.{field}: "):
        parse_args(args)
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: value})


def test_serve_replica_keeps_no_more_responses_than_its_bound(tiny_llama_path):
    """One entry: a second stored response evicts the first (404), as the bound says."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from kvroute.deploy.replica_server import build_replica_server
    from kvroute.replica.config import EngineConfig
    from tests.deploy.server import running

    config = EngineConfig(model=str(tiny_llama_path), block_size=8, num_kv_blocks=64, max_model_len=256, dtype="float32")
    app, _ = build_replica_server(config, ServerLimits(response_store_max_entries=1), "tiny")
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        first, second = (client.responses.create(model="tiny", input=text, max_output_tokens=2) for text in ("a", "b"))
        assert client.responses.retrieve(second.id).id == second.id
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
