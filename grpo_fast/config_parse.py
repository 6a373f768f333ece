"""Reading what a user wrote into config trees: YAML files, ``key=value`` overrides, and the
checks that run before the layers merge (unknown keys with the nearest valid name, replaced
keys, integers beyond a float's range). Each error is one ``ConfigError`` line naming the file,
the override or the key. ``grpo_fast.config.load_config`` layers the trees; the functions take
the config class they read for (``root``), so that this module needs nothing of it."""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grpo_fast.errors import ConfigError


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every key of the config class ``cls`` (sections and leaves), dotted, in declaration order."""
    keys = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        keys.append(name)
        if is_section(f):
            keys.extend(all_keys(type(f.default_factory()), name + "."))
    return keys


def is_section(f: dataclasses.Field) -> bool:
    """A nested config section (a dataclass), as opposed to a plain field with a factory (a dict)."""
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)


def nearest(key: str, root: type) -> str:
    """`` (did you mean 'KEY'?)`` for the key of ``root`` nearest to ``key``, or ``""``."""
    keys = all_keys(root)
    leaf = key.rsplit(".", 1)[-1]
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    by_key = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    match = by_key or difflib.get_close_matches(leaf, leaves, n=1, cutoff=0.6)
    if not match:
        return ""
    best = match[0]
    if best not in keys:  # matched a leaf name: report its full key
        best = next(k for k in keys if k.rsplit(".", 1)[-1] == best)
    return f" (did you mean {best!r}?)"


def check_keys(
    tree: Any, cls: type, where: str, replaced: dict[str, str], root: type | None = None, prefix: str = ""
) -> None:
    """Reject unknown keys of ``tree`` (a layer's values for config class ``cls``; ``root``: the
    whole config's class, default ``cls``) with the nearest valid name, and keys that were
    ``replaced`` (key → what replaced it), before OmegaConf sees them."""
    root = cls if root is None else root
    if not isinstance(tree, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if full in replaced:
            raise ConfigError(f"config key {full!r} in {where} was replaced: {replaced[full]}")
        if key not in fields:
            raise ConfigError(f"unknown config key {full!r} in {where}{nearest(full, root)}")
        f = fields[key]
        if is_section(f) and isinstance(value, dict):
            check_keys(value, type(f.default_factory()), where, replaced, root, full + ".")


def load_yaml(path: str) -> dict:
    """A YAML config file's mapping (``{}`` when empty); one line naming the file otherwise."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {path} is a folder, not a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        data = yaml.safe_load(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (OSError, RecursionError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            f"config file {path}{line} is not valid YAML: {getattr(exc, 'problem', exc)}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def dotlist_to_tree(overrides: list[str], root: type) -> list[tuple[str, dict]]:
    """Each ``key=value`` override as ``(key, {section: {key: value}})``. The value of a text key
    (a ``str`` field: a path, a name, a prompt template) is the text as typed, never parsed as YAML
    (``data.prompt_template={question} Answer:``); quotes around it are read as YAML's (escapes
    such as ``\\n``), and ``null`` is None. Any other value is YAML (numbers, booleans, lists).
    ``root``: the config class the keys belong to."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.lr=3e-6)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not _KEY.fullmatch(key):
            raise ConfigError(
                f"override {item!r}: {key!r} is not a config key (dotted names, e.g. train.lr=3e-6){nearest(key, root)}"
            )
        try:
            if _is_text_key(key, root):
                tree: Any = _text_value(raw)
                for part in reversed(key.split(".")):
                    tree = {part: tree}
            else:
                tree = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
        except (OmegaConfBaseException, yaml.YAMLError, RecursionError) as exc:
            raise ConfigError(f"override {item!r} cannot be parsed: {first_line(exc)}") from None
        out.append((key, tree))
    return out


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")  # a key of an override


def _is_text_key(key: str, root: type) -> bool:
    """Whether ``key`` names a field of ``root`` that holds text only (``str`` or ``str | None``)."""
    cls: Any = root
    f = None
    for part in key.split("."):
        fields = {g.name: g for g in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if (f := fields.get(part)) is None:
            return False
        cls = type(f.default_factory()) if is_section(f) else None
    return f is not None and f.type in ("str", "str | None")


def _text_value(raw: str) -> str | None:
    """A text key's value: ``null`` (or nothing) is None; a quoted string is YAML's reading of
    it; anything else the text as typed."""
    text = raw.strip()
    if text in ("", "null", "Null", "NULL", "~"):
        return None
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            return raw
        return value if isinstance(value, str) else raw
    return raw


def first_line(exc: BaseException) -> str:
    """An exception's message, its first line (YAML's and OmegaConf's run over several)."""
    msg = str(getattr(exc, "problem", None) or getattr(exc, "msg", None) or exc).strip()
    return msg.splitlines()[0] if msg else type(exc).__name__


# What merging a user's values can raise besides OmegaConf's own errors: a huge integer for a float
# key (OverflowError), a mapping merged into a list such as train.betas.x=1 (TypeError).
MERGE_ERRORS = (OmegaConfBaseException, OverflowError, TypeError, ValueError)


def omegaconf_error(exc: Exception, where: str, key_hint: str = "?") -> ConfigError:
    key = getattr(exc, "full_key", None) or key_hint
    return ConfigError(f"config key {key!r} from {where}: {first_line(exc)}")


def too_large(tree: Any, prefix: str = "") -> str | None:
    """The dotted key of the first integer in ``tree`` beyond a float's range, or None."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if (found := too_large(v, f"{prefix}{k}.")) is not None:
                return found
    elif isinstance(tree, int) and not isinstance(tree, bool) and abs(tree) > sys.float_info.max:
        return prefix.rstrip(".")
    return None


def flatten(tree: dict, cls: type, prefix: str = "") -> dict[str, Any]:
    """A (partial) tree of config class ``cls`` → ``{dotted leaf key: value}``; a dict-valued field such as
    ``health.thresholds`` contributes one key per entry."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        f = fields.get(key)
        if f is not None and is_section(f) and isinstance(value, dict):
            flat.update(flatten(value, type(f.default_factory()), f"{prefix}{key}."))
        elif isinstance(value, dict):
            flat.update({f"{prefix}{key}.{k}": v for k, v in value.items()})
        else:
            flat[f"{prefix}{key}"] = value
    return flat
