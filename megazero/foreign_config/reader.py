"""Reading a foreign config file: its text (JSON or YAML, a key given twice refused), and a walker that
maps keys to settings while it collects every problem and every unused key, so that a file is refused
once, naming all of its problems, and its unused keys are listed on one warning line."""
from __future__ import annotations

import json
from pathlib import Path

from megazero.errors import ConfigError

AUTO = "auto"
DEFAULT = "default"         # a key absent from the file, whose engine's default a setting takes
# The reason given for a key megazero has no equivalent of (grouped: "a, b: " + this).
UNSUPPORTED = "not supported by megazero (no equivalent here): remove"


def load_yaml(text: str, source: str):
    """YAML whose mappings may not repeat a key (PyYAML keeps the last silently): ``source`` leads the
    message (``--config run.yaml``)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        pass

    def mapping(loader, node):
        keys = [loader.construct_object(k) for k, _ in node.value]
        twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
        if twice:
            raise ConfigError(f"{source}: key {twice[0]!r} is given twice: keep one")
        return loader.construct_mapping(node)

    UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        return yaml.load(text, Loader=UniqueKeys)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}".splitlines()[0]) from None


def read_text(path: Path, source: str) -> str:
    """The text of a config file; a missing or unreadable one is a ConfigError led by ``source``."""
    try:
        return path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{source}: cannot be read ({e})") from None


def read_json(path: Path, source: str) -> dict:
    """A JSON object from ``path``; a missing or unreadable file, bad JSON, a key given twice in one
    object (json keeps the last) or a top level that is not an object is a ConfigError led by ``source``."""
    def unique_keys(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ConfigError(f"{source}: key {key!r} is given twice in one object: keep one")
            seen.add(key)
        return dict(pairs)

    try:
        data = json.loads(read_text(path, source), object_pairs_hook=unique_keys)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top, got {type(data).__name__}")
    return data


def refusal(source: str, errors: list[tuple[str, str]]) -> ConfigError:
    """One message for every problem of a file: ``source: path: why``, or for several ``source: N
    problems: a, b: why; c: why`` (keys with the same reason grouped)."""
    groups: dict[str, list[str]] = {}
    for path, why in errors:
        groups.setdefault(why, []).append(path)
    parts = []
    for why, paths in groups.items():
        if why == UNSUPPORTED:
            why += " them" if len(paths) > 1 else " it"
        parts.append(f"{', '.join(paths)}: {why}")
    if len(errors) == 1:
        return ConfigError(f"{source}: {parts[0]}")
    return ConfigError(f"{source}: {len(errors)} problems: {'; '.join(parts)}")


def unused_warning(unused: list[tuple[str, str]]) -> str | None:
    """The one warning line for every key accepted but not used (``[(source, key path)]``), or None."""
    if not unused:
        return None
    by_source: dict[str, list[str]] = {}
    for source, path in unused:
        by_source.setdefault(source, []).append(path)
    listed = "; ".join(f"{source}: {', '.join(paths)}" for source, paths in by_source.items())
    return (f"not used by megazero, they tune only DeepSpeed's or accelerate launch's own implementation "
            f"(docs/foreign-configs.md): {listed}")


class Reader:
    """Walks a nested dict, mapping keys to settings (``out``), collecting problems (``errors``:
    ``[(key path, why)]``) and keys accepted but not used (``unused``)."""

    def __init__(self, source: str, data: dict):
        self.source, self.data, self.out = source, data, {}
        self.errors: list[tuple[str, str]] = []
        self.unused: list[str] = []
        self.decided: dict[str, str] = {}     # dest -> AUTO (the flags decide) or DEFAULT (absent: the engine's)

    def fail(self, path: str, why: str) -> None:
        self.errors.append((path, why))

    def done(self) -> dict:
        """The settings, or one ConfigError naming every problem found."""
        if self.errors:
            raise refusal(self.source, self.errors)
        return self.out

    def raw(self, path: str, default=None):
        """The value at ``path`` as written (``"auto"`` included), ``default`` when absent."""
        node = self.data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def given(self, path: str) -> bool:
        return self.raw(path, default=KeyError) is not KeyError

    def get(self, path: str, kind=None, default=None):
        """The value at ``path`` checked as ``kind`` (bool, int, float); ``default`` when absent, None for
        ``"auto"`` (the flags or megazero's default decide) and for a value of the wrong kind (a problem)."""
        node = self.raw(path, default=KeyError)
        if node is KeyError:
            return default
        if node == AUTO or node is None:
            return None
        if kind is bool and not isinstance(node, bool):
            return self.fail(path, f"must be true or false, got {node!r}")
        if kind in (int, float) and (isinstance(node, bool) or not isinstance(node, (int, float))
                                     or (kind is int and node != int(node))):
            return self.fail(path, f"must be {'an integer' if kind is int else 'a number'}, got {node!r}")
        return kind(node) if kind in (int, float) else node

    def set(self, dest: str, value) -> None:
        if value is not None:
            self.out[dest] = value

    def take(self, dest: str, path: str, kind=None, default=None):
        """Set ``dest`` from the key at ``path`` (:meth:`get`) and return the value; an ``"auto"`` key, or an
        absent one whose ``default`` is taken, is recorded in ``decided`` (said at start with the value
        it resolved to)."""
        value = self.get(path, kind, default)
        self.note(dest, path, default)
        self.set(dest, value)
        return value

    def note(self, dest: str, path: str, default=None) -> None:
        """Record in ``decided`` how the key at ``path`` leaves ``dest`` to others: ``"auto"``, or absent with
        a ``default`` of the engine's."""
        node = self.raw(path, default=KeyError)
        if isinstance(node, str) and node == AUTO:
            self.decided[dest] = AUTO
        elif node is KeyError and default is not None:
            self.decided[dest] = DEFAULT

    def agree(self, dest: str, value, path: str, other: str = "another offload section") -> None:
        """Set ``dest`` from a key that may appear twice (the optimizer's and the parameters' offload
        sections share one --nvme-path and one pin setting): both places must agree."""
        if value is not None and self.out.get(dest, value) != value:
            return self.fail(path, f"is {value!r} but {other} says {self.out[dest]!r}: megazero uses one setting "
                                   f"for both, make them agree")
        self.set(dest, value)

    def only(self, path: str, allowed: set[str], unused: set[str] = frozenset()) -> dict:
        """The mapping at ``path`` ({} when absent): keys outside ``allowed`` and ``unused`` are problems
        (by their full path), keys in ``unused`` are listed on the warning line."""
        node = self.data if not path else self.raw(path, default={})
        if node in (None, AUTO):
            return {}
        if not isinstance(node, dict):
            self.fail(path, f"must be a mapping, got {node!r}")
            return {}
        for key in node:
            full = f"{path + '.' if path else ''}{key}"
            if key in unused:
                self.unused.append(full)
            elif key not in allowed:
                self.fail(full, UNSUPPORTED)
        return node
