"""Config: each default written once (dataclass fields drive flags and CROWDCHAT_* variables)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from app import AppConfig, main, parse_args
from engine import EngineConfig, InvalidRequest
from engine.settings import env_name, flag_name
from sessions import SessionConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = (EngineConfig, SessionConfig, AppConfig)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CROWDCHAT_* variable of the machine running the tests leaks into them."""
    for name in list(os.environ):
        if name.startswith("CROWDCHAT_"):
            monkeypatch.delenv(name)


def operations_flags() -> dict[str, str]:
    """Flag -> environment variable, as docs/OPERATIONS.md's generated flag tables list them."""
    doc = ROOT.joinpath("docs", "OPERATIONS.md").read_text()
    table = doc.split("<!-- flags:begin", 1)[1].split("<!-- flags:end -->", 1)[0]
    flags = {}
    for line in table.splitlines():
        if line.startswith("| `--"):
            cells = [c.strip() for c in line.split("|")[1:3]]
            flags[cells[0].strip("`")] = cells[1].strip("`")
    return flags


def test_parsing_no_flags_gives_exactly_the_dataclass_defaults() -> None:
    args = parse_args([])
    for cls in CONFIGS:
        assert cls.from_namespace(args) == cls()
    assert EngineConfig.from_namespace(args).data_dir == Path("data")


def test_flags_and_environment_names_are_the_operations_table() -> None:
    ours = {
        flag_name(f): env_name(f) for cls in CONFIGS for f in fields(cls) if f.metadata.get("cli")
    }
    assert ours == operations_flags()
    assert ours["--data-dir"] == "CROWDCHAT_DATA" and ours["--auth"] == "CROWDCHAT_AUTH"


def test_an_environment_variable_overrides_a_default_and_a_flag_overrides_both(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    users = tmp_path / "users.txt"
    users.write_text("")
    monkeypatch.setenv("CROWDCHAT_DATA", str(tmp_path))
    monkeypatch.setenv("CROWDCHAT_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("CROWDCHAT_KV_BUDGET_MB", "96.5")
    monkeypatch.setenv("CROWDCHAT_QUANT", "none")
    monkeypatch.setenv("CROWDCHAT_IDLE_SECONDS", "5")
    monkeypatch.setenv("CROWDCHAT_AUTH", str(users))
    monkeypatch.setenv("CROWDCHAT_PORT", "9000")
    monkeypatch.setenv("CROWDCHAT_HOST", "")  # empty: unset, the default stays
    args = parse_args(["--port", "9001", "--max-num-seqs", "4"])
    engine = EngineConfig.from_namespace(args)
    assert (engine.data_dir, engine.max_num_seqs, engine.kv_budget_mb, engine.quant) == (
        tmp_path,
        4,
        96.5,
        "none",
    )
    assert SessionConfig.from_namespace(args).idle_seconds == 5.0
    assert AppConfig.from_namespace(args) == AppConfig("127.0.0.1", 9001, users, None)


@pytest.mark.parametrize(
    "cls, settings, match",
    [
        (AppConfig, {"port": 0}, "--port must be in 1..65535"),
        (AppConfig, {"port": 70000}, "--port must be in 1..65535"),
        (AppConfig, {"host": " "}, "--host must not be empty"),
        (AppConfig, {"auth_file": Path("/no/such/users.txt")}, "--auth users file not found"),
        (AppConfig, {"admin_password": ""}, "--admin-password must not be empty"),
        (EngineConfig, {"quant": "fp3"}, "--quant must be one of"),
        (EngineConfig, {"block_size": 12}, "--block-size must be"),
        (EngineConfig, {"cpu_dense_above": -1}, "--cpu-dense-above must be >= 0"),
        (EngineConfig, {"cpu_bf16_above": -1}, "--cpu-bf16-above must be >= 0"),
        (SessionConfig, {"max_tokens_per_turn": 0}, "--max-tokens-per-turn must be >= 1"),
        (SessionConfig, {"tokens_per_minute": -1}, "--tokens-per-minute must be >= 0"),
        (
            SessionConfig,
            {"tokens_per_minute_per_client": -1},
            "--tokens-per-minute-per-client must be >= 0",
        ),
        (AppConfig, {"end_user_header": "X End User"}, "--end-user-header: 'X End User' is not"),
        (AppConfig, {"end_user_header": "X-User:"}, "--end-user-header: 'X-User:' is not"),
    ],
)
def test_a_bad_value_is_an_error_that_names_its_flag(cls: type, settings: dict, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        cls(**settings)


def test_a_bad_environment_value_is_an_error_that_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CROWDCHAT_PORT", "http")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "CROWDCHAT_PORT='http' is not a valid int (it sets --port)" in capsys.readouterr().err
    monkeypatch.setenv("CROWDCHAT_PORT", "80")
    monkeypatch.setenv("CROWDCHAT_DTYPE", "float8")
    with pytest.raises(InvalidRequest, match="--dtype must be one of"):
        EngineConfig.from_namespace(parse_args([]))


def test_the_server_refuses_a_bad_setting_before_loading_the_model() -> None:
    with pytest.raises(SystemExit, match="crowdchat: invalid server setting: --port"):
        main(["--port", "0", "--model", "/no/such/model"])


def test_help_lists_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "app.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for flag, env in operations_flags().items():
        assert flag in out and env in out
