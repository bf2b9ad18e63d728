"""The example files (etc/gpuguard.toml, etc/quotas.toml) against the loader's own schema.

Both are what an admin reads first, so each must show every key the loader knows (config.SCHEMA,
config.QUOTA_KEYS) with the line that says what it means, and gpuguard.toml each with its default
(the config dataclasses, as gpuguard.toml(5) prints them: packaging/manpages.py). A key added to
the code and not to an example, or a default changed in one place only, fails here.

A key whose default is unset (off until written) is shown commented out with an example value,
and so are the keys of the tables read only when written ([fleet], [gpu.simulated]); a commented
key that has a default still shows that default.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import tomlkit
from tomlkit.exceptions import TOMLKitError

from gpuguard import config, config_doc

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "etc" / "gpuguard.toml"
QUOTAS = REPO / "etc" / "quotas.toml"
_HEADER = re.compile(r"\[([A-Za-z0-9_.-]+)\]\s*(#.*)?")


def _manpages() -> ModuleType:
    """packaging/manpages.py, where the man page takes the keys and their defaults from the loader."""
    spec = importlib.util.spec_from_file_location("manpages", REPO / "packaging" / "manpages.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MANPAGES = _manpages()
KEYS = MANPAGES.config_keys()  # every (section, key) of config.SCHEMA; stops if one has no words in config_doc
# Tables whose entries are data rather than keys ([fleet.data]: storage paths to nodes).
DATA_TABLES = {f"{section}.{key}" for section, key in KEYS
               if config_doc.KEYS[(section, key)][0] == "table" and f"{section}.{key}" not in config.SCHEMA}


@dataclass(frozen=True)
class Shown:
    """A key as an example file shows it: `key = value` in [section], or a table's `[section.key]`."""

    line: int
    section: str
    key: str
    value: Any        # the TOML value; None for a table header
    commented: bool   # the line, or the table it is in, is commented out: not in effect
    explained: bool   # a trailing comment, or a line of words right above it

    @property
    def where(self) -> str:
        return f"line {self.line}: {self.section}.{self.key}"


def _assignment(body: str) -> tuple[str, Any, bool] | None:
    """(key, value, has a trailing comment) where `body` is one TOML `key = value` line."""
    try:
        doc = tomlkit.parse(body)
    except TOMLKitError:
        return None
    if len(doc.body) != 1:
        return None
    key, item = doc.body[0]
    if key is None or isinstance(item, tomlkit.items.Table):  # a comment alone, or a [table]
        return None
    return key.key, doc.unwrap()[key.key], bool(item.trivia.comment)


def shown(path: Path) -> list[Shown]:
    """Every key in the file, in effect or commented out; lines of words are the keys' meanings."""
    found: list[Shown] = []
    section, section_commented, words_above = "", False, False
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.strip()
        commented = text.startswith("#")
        body = text.lstrip("#").strip()
        if header := _HEADER.fullmatch(body):
            section, section_commented = header[1], commented
            parent, _, key = section.rpartition(".")
            if parent in config.SCHEMA:  # [gpu.simulated]: the key gpu.simulated, shown
                found.append(Shown(number, parent, key, None, commented, words_above or bool(header[2])))
            words_above = False
        elif assignment := _assignment(body):
            key, value, trailing = assignment
            found.append(Shown(number, section, key, value, commented or section_commented, words_above or trailing))
            words_above = False
        else:
            words_above = commented and bool(body)
    return found


def _unset(default: Any) -> bool:
    return default is None or default in ((), "")


def _as_installed(value: Any) -> Any:
    # A relative path in gpuguard.toml is read next to it (paths.quotas = "quotas.toml").
    return config.DEFAULT_PATH.parent / value if isinstance(value, Path) else value


def test_the_example_shows_every_key_the_loader_knows() -> None:
    keys = {(item.section, item.key) for item in shown(EXAMPLE)}
    missing = [f"{section}.{key}" for section, key in KEYS if (section, key) not in keys]
    assert not missing, f"{EXAMPLE}: keys of config.SCHEMA the example does not show: {', '.join(missing)}"


def test_the_example_shows_each_key_once_and_only_known_ones() -> None:
    seen: set[tuple[str, str]] = set()
    for item in shown(EXAMPLE):
        if item.section in DATA_TABLES:
            continue  # the entries of a table value ([fleet.data]: paths to nodes), not keys
        assert (item.section, item.key) in KEYS, f"{EXAMPLE}: {item.where}: not a key of config.SCHEMA"
        assert (item.section, item.key) not in seen, f"{EXAMPLE}: {item.where}: shown twice"
        seen.add((item.section, item.key))


def test_every_key_of_the_example_shows_its_default() -> None:
    for item in shown(EXAMPLE):
        if item.value is None or item.section in DATA_TABLES:
            continue  # a table's header: its keys are checked one by one
        parsed = config.SCHEMA[item.section][item.key](item.value)
        default = getattr(MANPAGES.section_defaults(item.section), item.key)
        written = MANPAGES.render_default(config_doc.KEYS[(item.section, item.key)][0], default)
        if item.commented and _unset(default):
            continue  # an example value for a key that is off until written (the loader takes it)
        assert _as_installed(parsed) == default, (
            f"{EXAMPLE}: {item.where} = {item.value!r}, the default is {written}"
            + (" (an example value of a key off by default goes commented out)" if _unset(default) else ""))


@pytest.mark.parametrize("path", [EXAMPLE, QUOTAS], ids=lambda path: path.name)
def test_every_key_says_what_it_means(path: Path) -> None:
    unexplained = [item.where for item in shown(path) if not item.explained and item.section not in DATA_TABLES]
    assert not unexplained, f"{path}: keys without a comment on their line or right above: {', '.join(unexplained)}"


def test_the_quotas_example_shows_every_quota_key() -> None:
    keys = {item.key for item in shown(QUOTAS) if item.section.startswith(("users.", "groups."))}
    missing = [key for key in config.QUOTA_KEYS if key not in keys]
    assert not missing, f"{QUOTAS}: quota keys (config.QUOTA_KEYS) no example table shows: {', '.join(missing)}"


def test_the_quotas_example_loads_once_uncommented(tmp_path: Path) -> None:
    lines = []
    for raw in QUOTAS.read_text().splitlines():
        body = raw.strip().lstrip("#").strip()
        if _HEADER.fullmatch(body) or _assignment(body):
            lines.append(body)
    (tmp_path / "quotas.toml").write_text("\n".join(lines) + "\n")
    loaded = config.load_quotas(tmp_path / "quotas.toml")
    assert loaded.users and loaded.groups
