"""The ``--config`` TOML file: its layout, precedence flag > env > file > default, its errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from llm_backoff_shim.serve.config.file import (
    NOT_TOP_LEVEL,
    SECTION_OF,
    example_config,
    read_config_file,
    render_config,
)
from llm_backoff_shim.serve.config.flags import COMMON, GROUPS, SECTIONS
from llm_backoff_shim.serve.config.settings import ShimSettings
from llm_backoff_shim.serve.config.sources import load_settings
from llm_backoff_shim.serve.config.values import PER_CLASS_KEYS, ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "shim.toml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("LLM_BACKOFF_SHIM_"):
            monkeypatch.delenv(key)


def write(tmp_path: Path, text: str, name: str = "shim.toml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


FILE = """
upstream = "http://10.0.0.7:8000"
max_concurrency = 16
max_queue = 40
max_queue_wait = 5.0
reject_status = 503

[classes.interactive]
max_queue = 8
max_queue_wait = 2
reserved_share = 0.3
ttft_slo = 2

[classes.batch]
max_queue = 32
min_share = 0.2

[classes.bulk]
max_queue_wait = 120
"""


def test_a_file_sets_top_level_settings_and_one_table_per_class(tmp_path: Path) -> None:
    s = load_settings(["--config", write(tmp_path, FILE)])
    assert s.upstream_base == "http://10.0.0.7:8000"
    assert (s.max_concurrency, s.max_queue, s.max_queue_wait, s.reject_status) == (16, 40, 5.0, 503)
    # The tables' order is the classes' order, highest priority first.
    assert s.classes == ("interactive", "batch", "bulk")
    limits = {name: (lim.max_queue, lim.max_queue_wait) for name, lim in s.class_limits().items()}
    assert limits == {"interactive": (8, 2.0), "batch": (32, 5.0), "bulk": (40, 120.0)}
    assert s.reserved_share == {"interactive": 0.3}
    assert s.min_share == {"batch": 0.2}
    assert s.ttft_slo == {"interactive": 2.0}
    assert s.vllm_priority() == {"interactive": 0, "batch": 1, "bulk": 2}


def test_precedence_is_flag_then_env_then_file_then_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, FILE)
    monkeypatch.setenv("LLM_BACKOFF_SHIM_MAX_QUEUE", "50")
    monkeypatch.setenv("LLM_BACKOFF_SHIM_MAX_CONCURRENCY", "12")
    s = load_settings(["--config", path, "--max-concurrency", "4"])
    assert s.max_concurrency == 4  # flag over env over file
    assert s.max_queue == 50  # env over file
    assert s.max_queue_wait == 5.0  # file over default
    assert s.retry_after_max == 30.0  # default
    assert s.reject_status == 503


def test_the_file_can_be_named_by_a_variable_and_the_flag_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLM_BACKOFF_SHIM_CONFIG", write(tmp_path, "max_queue = 3\n", "env.toml"))
    assert load_settings([]).max_queue == 3
    assert load_settings(["--config", write(tmp_path, "max_queue = 4\n")]).max_queue == 4
    monkeypatch.setenv("LLM_BACKOFF_SHIM_CONFIG", "")
    assert load_settings([]).max_queue is None


def test_per_class_values_merge_class_by_class_across_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, FILE)
    monkeypatch.setenv("LLM_BACKOFF_SHIM_CLASS_MAX_QUEUE", "batch=20,bulk=3")
    s = load_settings(["--config", path, "--class-max-queue", "batch=64"])
    assert s.class_max_queue == {"interactive": 8, "batch": 64, "bulk": 3}
    s = load_settings(["--config", path, "--class-max-queue-wait", "interactive=9"])
    assert s.class_max_queue_wait == {"interactive": 9.0, "bulk": 120.0}


def test_a_default_per_class_value_holds_until_a_source_names_a_class() -> None:
    assert load_settings([]).reserved_share == {"interactive": 0.25}
    assert load_settings(["--reserved-share", "batch=0.5"]).reserved_share == {"batch": 0.5}
    # Other classes drop the default's entries for classes that no longer exist.
    s = load_settings(["--classes", "gold,batch", "--default-class", "gold"])
    assert (s.reserved_share, s.min_share) == ({}, {"batch": 0.1})


@pytest.mark.parametrize(
    "text", ['api_keys_file = "keys"\n', '[auth]\napi_keys_file = "keys"\n'], ids=["flat", "table"]
)
def test_relative_paths_are_read_from_the_files_directory(tmp_path: Path, text: str) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "keys").write_text("secret-key\n")
    s = load_settings(["--config", write(tmp_path / "conf", text)])
    assert s.api_keys_file == str(tmp_path / "conf" / "keys")
    assert s.api_keys().check(b"secret-key")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_queue = \n", "shim.toml: not valid TOML: "),
        ("max_queu = 3\n", "shim.toml: max_queu: unknown setting (did you mean 'max_queue'?)"),
        ("[classes.batch]\nmax_queue = 'lots'\n", "shim.toml: classes.batch.max_queue: Input should be a valid integer"),  # noqa: E501
        ("[classes.batch]\nmax_queue = -1\n", "shim.toml: classes.batch.max_queue: Input should be greater than or equal to 0"),  # noqa: E501
        ("[classes.batch]\nsize = 3\n", "shim.toml: classes.batch.size: unknown per-class setting (one of: max_queue, max_queue_wait, reserved_share, min_share, ttft_slo)"),  # noqa: E501
        ("[classes.batch]\nmax_queu = 3\n", "shim.toml: classes.batch.max_queu: unknown per-class setting (did you mean 'max_queue'?)"),  # noqa: E501
        ("[classes.batch]\nttft = 3\n", "classes.batch.ttft: unknown per-class setting (did you mean 'ttft_slo'?)"),  # noqa: E501
        ("max_concurrency = true\n", "shim.toml: max_concurrency: expected a number, got the boolean true"),
        ("max_queue_wait = false\n", "shim.toml: max_queue_wait: expected a number, got the boolean false"),
        ("metrics_port = true\n", "shim.toml: metrics_port: expected a number, got the boolean true"),
        ("[classes.batch]\nmax_queue = true\n", "shim.toml: classes.batch.max_queue: expected a number, got the boolean true"),  # noqa: E501
        ("[classes.batch]\nmin_share = true\n", "shim.toml: classes.batch.min_share: expected a number, got the boolean true"),  # noqa: E501
        ("access_log = 1\n", "shim.toml: access_log: expected true or false, got the number 1"),
        ("[classes.batch]\nreserved_share = 2\n", "shim.toml: classes.batch.reserved_share: a share is a fraction"),  # noqa: E501
        ("max_concurrency = 1.5\n", "shim.toml: max_concurrency: Input should be a valid integer"),
        ("reject_status = 500\n", "shim.toml: reject_status: must be 429 or 503"),
        ("batch_max_queue = 3\n", "batch_max_queue: unknown setting (per-class values go in the class's table: [classes.batch] max_queue = ...)"),  # noqa: E501
        ("reserved_share = 0.5\n", "reserved_share: unknown setting (set it per class: [classes.NAME] reserved_share = ...)"),  # noqa: E501
        ("classes = ['a', 'b']\n", "shim.toml: classes: expected one [classes.NAME] table per class"),
        ("[classes]\nbatch = 3\n", "shim.toml: classes.batch: expected a table"),
        ("[classes.Batch]\n", "shim.toml: classes: class name 'Batch'"),
        ("[classes.batch]\n", "default_class 'interactive' is not one of classes ['batch']"),
    ],
)  # fmt: skip
def test_an_invalid_file_names_the_keys_path(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(["--config", write(tmp_path, text)])
    message = str(info.value)
    assert message.startswith("invalid configuration: ")
    assert expected.replace("shim.toml", str(tmp_path / "shim.toml")) in message
    assert "\n" not in message


# --------------------------------------------------------------------------- tables per group

SECTIONED = """
[upstream]
upstream = "http://10.0.0.7:8000"

[concurrency]
max_concurrency = 16

[queue]
max_queue = 40

[queue_wait]
max_queue_wait = 5.0

[rejections]
reject_status = 503
""" + FILE[FILE.index("\n[classes.") :]  # the same class tables as FILE


def test_each_group_has_one_table_name_a_bare_toml_key() -> None:
    assert list(SECTIONS) == list(GROUPS)
    names = list(SECTIONS.values())
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[a-z][a-z_]*", name) for name in names)
    # [classes.NAME] holds the per-class values; no group's table may take its name.
    assert "classes" not in names
    top_level = [name for name in ShimSettings.model_fields if name not in NOT_TOP_LEVEL]
    assert sorted(SECTION_OF) == sorted(top_level)


def test_a_file_in_tables_reads_as_the_same_file_of_top_level_keys(tmp_path: Path) -> None:
    sectioned = load_settings(["--config", write(tmp_path, SECTIONED, "sectioned.toml")])
    flat = load_settings(["--config", write(tmp_path, FILE, "flat.toml")])
    assert sectioned == flat
    assert (sectioned.upstream_base, sectioned.max_concurrency, sectioned.max_queue) == (
        "http://10.0.0.7:8000", 16, 40,
    )  # fmt: skip
    assert sectioned.classes == ("interactive", "batch", "bulk")
    assert sectioned.class_max_queue == {"interactive": 8, "batch": 32}
    # A value refused by the model is named by its path in the table.
    path = write(tmp_path, "[queue]\nmax_queue = 'lots'\n")
    with pytest.raises(ConfigError, match=r"shim.toml: queue.max_queue: Input should be a valid integer"):
        load_settings(["--config", path])


def test_a_file_may_mix_top_level_keys_and_tables(tmp_path: Path) -> None:
    text = 'upstream = "http://10.0.0.9:8000"\nmax_queue = 7\n\n[concurrency]\nmax_concurrency = 3\n'
    values = read_config_file(write(tmp_path, text))
    assert values.values == {"upstream": "http://10.0.0.9:8000", "max_queue": 7, "max_concurrency": 3}
    assert values.where[("max_concurrency", None)] == "concurrency.max_concurrency"
    assert values.where[("max_queue", None)] == "max_queue"


def test_relative_paths_in_tables_are_read_from_the_files_directory(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "tenants.toml").write_text("")
    text = '[auth]\napi_keys_file = "keys"\n\n[tenants]\ntenants_file = "tenants.toml"\n'
    values = read_config_file(write(tmp_path / "conf", text))
    assert values.values["tenants_file"] == str(tmp_path / "conf" / "tenants.toml")
    assert values.values["api_keys_file"] == str(tmp_path / "conf" / "keys")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[concurrency]\nmax_queue = 3\n", "shim.toml: concurrency.max_queue: max_queue belongs in [queue]"),
        ("[upstream]\nhost = '0.0.0.0'\n", "shim.toml: upstream.host: host belongs in [listen]"),
        ("[classes.batch]\nupstream = 'http://a'\n", "shim.toml: classes.batch.upstream: not a per-class setting: upstream belongs in [upstream]"),  # noqa: E501
        ("[queue]\nmax_queu = 3\n", "shim.toml: queue.max_queu: unknown setting (did you mean 'max_queue'?)"),
        ("[queue]\nmax_concurency = 3\n", "shim.toml: queue.max_concurency: unknown setting (did you mean 'max_concurrency', in [concurrency]?)"),  # noqa: E501
        ("[queue]\nbatch_max_queue = 3\n", "queue.batch_max_queue: unknown setting (per-class values go in the class's table: [classes.batch] max_queue = ...)"),  # noqa: E501
        ("[slo]\nttft_slo = 2\n", "shim.toml: slo.ttft_slo: unknown setting (set it per class: [classes.NAME] ttft_slo = ...)"),  # noqa: E501
        ("[queu]\nmax_queue = 3\n", "shim.toml: queu: unknown table (did you mean 'queue'?)"),
        ("[interactive]\nmax_queue = 3\n", "interactive: unknown table (one of: upstream, listen, limits, "),
        ("queue = 3\n", "shim.toml: queue: expected a table ([queue] with key = value lines)"),
        ("max_queue = 3\n[queue]\nmax_queue = 4\n", "shim.toml: queue.max_queue: max_queue is set twice (at the top level and in [queue]): keep one"),  # noqa: E501
        # TOML itself refuses a key and a table of the same name; the message says why.
        ("upstream = 'http://a'\n[upstream]\nupstream_read_timeout = 9\n", "(upstream is set at the top level and [upstream] is a table: move upstream = ... into it)"),  # noqa: E501
        ("max_body_bytes = 5\n[limits]\nmax_body_bytes = 6\n", "shim.toml: limits.max_body_bytes: max_body_bytes is set twice (at the top level and in [limits]): keep one"),  # noqa: E501
    ],
)  # fmt: skip
def test_a_key_in_the_wrong_table_or_set_twice_is_refused(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(["--config", write(tmp_path, text)])
    message = str(info.value)
    assert message.startswith("invalid configuration: ")
    assert expected.replace("shim.toml", str(tmp_path / "shim.toml")) in message
    assert "\n" not in message


def test_a_class_of_the_file_must_be_one_of_the_classes_a_flag_sets(tmp_path: Path) -> None:
    path = write(tmp_path, "[classes.interactive]\n[classes.bulk]\nmax_queue = 3\n")
    with pytest.raises(
        ConfigError,
        match=r"shim.toml: classes.bulk: not one of the classes \['interactive', 'batch'\] \(set by --classes\)",  # noqa: E501
    ):
        load_settings(["--config", path, "--classes", "interactive,batch"])
    with pytest.raises(ConfigError, match=r"cannot read the file"):
        load_settings(["--config", str(tmp_path / "missing.toml")])


def test_a_bad_file_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "[classes.interactive]\n[classes.batch]\nmax_queue = 'lots'\n")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLM_BACKOFF_SHIM_")}
    result = subprocess.run(
        [sys.executable, "-m", "llm_backoff_shim.cli", "serve", "--config", path],
        capture_output=True, text=True, timeout=30, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"llm-backoff-shim serve: invalid configuration: {path}: classes.batch.max_queue: "
        "Input should be a valid integer, unable to parse string as an integer"
    )


# --------------------------------------------------------------------------- the example file


def test_the_example_file_is_the_generated_one() -> None:
    assert EXAMPLE.read_text(encoding="utf-8") == example_config(), (
        "regenerate: python -m llm_backoff_shim.serve.config.file > server_shim/deploy/shim.toml"
    )


def test_the_example_file_names_every_setting_and_loads_as_the_defaults() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    data = tomllib.loads(text)
    for name in ShimSettings.model_fields:
        if name == "classes":
            continue
        if name in NOT_TOP_LEVEL:
            key = next(k for k, v in PER_CLASS_KEYS.items() if v == name)
            assert all(
                f"\n{key} =" in part or f"\n# {key} =" in part for part in text.split("\n[classes.")[1:]
            ), name
        else:
            assert f"\n{name} =" in text or f"\n# {name} =" in text, name
    assert list(data["classes"]) == list(ShimSettings.model_fields["classes"].default)
    assert load_settings(["--config", str(EXAMPLE)]) == ShimSettings()


def test_the_generated_example_puts_every_setting_in_its_table_and_reads_back_as_the_defaults(
    tmp_path: Path,
) -> None:
    text = example_config()
    table = ""
    placed: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("["):
            table = line.strip("[]")
        elif match := re.fullmatch(r"(?:# )?([a-z_]+) =.*", line):
            placed.setdefault(f"{table}.{match[1]}", table)
    top_level = {name: table for key, table in placed.items() if not table.startswith("classes.")
                 for name in [key.rpartition(".")[2]]}  # fmt: skip
    assert top_level == SECTION_OF
    data = tomllib.loads(text)
    assert data["queue_wait"]["max_queue_wait"] == ShimSettings.model_fields["max_queue_wait"].default
    assert data["upstream"]["upstream"] == "http://127.0.0.1:8000"
    assert "max_queue" not in data
    assert load_settings(["--config", write(tmp_path, text)]) == ShimSettings()


def test_every_commented_example_value_is_valid(tmp_path: Path) -> None:
    """Uncommenting every line of the example gives a file the shim accepts."""
    lines = []
    for line in EXAMPLE.read_text(encoding="utf-8").splitlines():
        if line.startswith("# ") and " = " in line and line[2:].split(" = ")[0].isidentifier():
            line = line[2:]
        if line.startswith(("tenants_file", "redis_url", "api_keys_file")):
            continue  # they name files and servers of the example's machine
        lines.append(line)
    path = write(tmp_path, "\n".join(lines) + "\n")
    s = load_settings(["--config", path])
    assert s.metrics_port == 9090
    assert s.ttft_slo == {"interactive": 2.0, "batch": 60.0}
    assert s.class_max_queue == {"interactive": 64, "batch": 64}


def test_a_rendered_file_loads_back_to_the_same_settings(tmp_path: Path) -> None:
    active = {
        "upstream": "http://10.1.2.3:8000",
        "max_concurrency": 24,
        "classes": ("gold", "silver"),
        "default_class": "silver",
        "class_max_queue": {"gold": 4},
        "reserved_share": {"gold": 0.5},
        "min_share": {},
        "trusted_proxies": ("10.0.0.0/8",),
        "access_log": False,
    }
    s = load_settings(["--config", write(tmp_path, render_config(active))])
    assert (s.upstream_base, s.max_concurrency, s.classes) == ("http://10.1.2.3:8000", 24, ("gold", "silver"))
    assert (s.default_class, s.class_max_queue, s.reserved_share, s.min_share) == (
        "silver", {"gold": 4}, {"gold": 0.5}, {},
    )  # fmt: skip
    assert (s.trusted_proxies, s.access_log) == (("10.0.0.0/8",), False)


# --------------------------------------------------------------------------- --help and --help-all


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LLM_BACKOFF_SHIM_")}
    return subprocess.run(
        [sys.executable, "-m", "llm_backoff_shim.cli", "serve", *args],
        capture_output=True, text=True, timeout=30, env=env, check=False,
    )  # fmt: skip


def flags_listed(help_text: str) -> set[str]:
    return {line.split()[0].rstrip(",") for line in help_text.splitlines() if line.startswith("  --")}


def test_help_shows_the_common_path_in_groups_and_help_all_every_flag() -> None:
    short = run_serve("--help")
    assert short.returncode == 0
    shown = flags_listed(short.stdout)
    common = {"--" + name.replace("_", "-") for names in COMMON.values() for name in names}
    assert shown == common | {"--config", "--help-all"}
    assert len(shown) <= 20
    for title in COMMON:
        assert f"\n{title}:\n" in short.stdout
    assert "--upstream-read-timeout" not in short.stdout
    full = run_serve("--help-all")
    assert full.returncode == 0
    every = {"--" + name.replace("_", "-") for name in ShimSettings.model_fields}
    assert flags_listed(full.stdout) == every | {"--config", "--help-all"}
    for title in GROUPS:
        assert f"\n{title}:\n" in full.stdout


def test_every_setting_has_one_group_and_hidden_flags_are_still_accepted() -> None:
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(ShimSettings.model_fields)
    assert set().union(*COMMON.values()) <= set(grouped)
    s = load_settings(["--upstream-read-timeout", "7", "--engine-metrics", "--tenant-header", "x-team"])
    assert (s.upstream_read_timeout, s.engine_metrics, s.tenant_header) == (7.0, True, "x-team")


def test_the_example_in_the_docs_loads_as_described(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "shim.md").read_text(encoding="utf-8")
    start = doc.index("### Configuration")
    block = doc[doc.index("```toml\n", start) + len("```toml\n") :]
    path = write(tmp_path, block[: block.index("```")])
    s = load_settings(["--config", path, "--class-max-queue", "batch=64"])
    limits = {name: (lim.max_queue, lim.max_queue_wait) for name, lim in s.class_limits().items()}
    assert limits == {"interactive": (8, 2.0), "batch": (64, 10.0)}
    assert (s.reserved_share, s.min_share, s.ttft_slo) == (
        {"interactive": 0.25},
        {"batch": 0.1},
        {"interactive": 2.0},
    )
