"""YAML files the user gives (plans, ``--config``), read safely: bounded in size and in alias expansion, tags
refused, and every error naming the file and line.

PyYAML's ``safe_load`` already refuses ``!!python/...`` tags, but it shares aliased nodes: a 1 KB file of nested
anchors ("billion laughs") loads as a small graph that any copy (``dataclasses.asdict``, ``json.dumps``) expands
into billions of nodes. `load_yaml` composes the document first, counts the nodes it would have with every alias
expanded (refusing cycles and more than `MAX_NODES`), and only then builds it. `YamlDocument.line` gives the line
of a key path, so a validator's message can point at the line to fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from submerge.diagnostics.errors import SubmergeError

#: The largest YAML file read (a head-mlp plan of a 70B model with its evidence is well under 1 MiB).
MAX_BYTES = 16 << 20
#: The most nodes a document may have once its aliases are expanded.
MAX_NODES = 1_000_000


class YamlError(SubmergeError):
    """A YAML file cannot be read: too large, not YAML, a refused tag, an alias bomb."""


@dataclass
class YamlDocument:
    """A loaded document: its data and its node tree (for line numbers)."""

    path: Path
    data: object
    root: yaml.Node | None

    def line(self, *keys) -> int | None:
        """The line (1-based) of the deepest of `keys` (mapping keys, list indices) that the document holds."""
        node, line = self.root, None
        for key in keys:
            child = _child(node, key)
            if child is None:
                break
            node, line = child
        if line is None and self.root is not None:
            return self.root.start_mark.line + 1
        return line

    def where(self, *keys) -> str:
        """``FILE, line N`` of a key path (for messages)."""
        line = self.line(*keys)
        return f"{self.path}" + (f", line {line}" if line is not None else "")


def _child(node, key):
    """(child node, line of its key) of a mapping or sequence node, or None."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == str(key):
                return value_node, key_node.start_mark.line + 1
    if isinstance(node, yaml.SequenceNode) and isinstance(key, int) and 0 <= key < len(node.value):
        child = node.value[key]
        return child, child.start_mark.line + 1
    return None


def _expanded_size(root: yaml.Node, path: str, limit: int) -> int:
    """The number of nodes of `root` with every alias expanded; a cycle or more than `limit` is a YamlError."""
    sizes: dict[int, int] = {}

    def size(node, visiting: set[int]) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in visiting:
            raise YamlError(f"{path}, line {node.start_mark.line + 1}: an alias refers to a node that contains it "
                            "(a recursive YAML structure): refused")
        total = 1
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            visiting.add(id(node))
            children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
            for child in children:
                total += size(child, visiting)
                if total > limit:
                    raise YamlError(f"{path}: expands to more than {limit:,} nodes through its aliases (&anchor / "
                                    "*alias; a 'billion laughs' file?): refused")
            visiting.discard(id(node))
        sizes[id(node)] = total
        return total

    return size(root, set())


def load_yaml(path: str | Path, *, what: str = "YAML file", max_bytes: int = MAX_BYTES,
              max_nodes: int = MAX_NODES) -> YamlDocument:
    """Read `path` as one safe YAML document (see the module docstring); errors are `YamlError`s naming the file
    and line."""
    path = Path(path)
    if not path.is_file():
        raise YamlError(f"{what} {path} " + ("is not a regular file" if path.exists() else "not found"))
    size = path.stat().st_size
    if size > max_bytes:
        raise YamlError(f"{what} {path} is {size:,} bytes, more than the {max_bytes:,} accepted: refused")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise YamlError(f"{what} {path} is not UTF-8 text (byte {exc.start})") from None
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return YamlDocument(path, None, None)
        _expanded_size(root, f"{what} {path}", max_nodes)
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        if "could not determine a constructor" in problem:
            problem = f"the tag {problem.split('tag', 1)[1].strip()} is not allowed (only plain YAML data)"
        raise YamlError(f"{what} {path}{where}: not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise YamlError(f"{what} {path}: not valid YAML: {exc}") from None
    except RecursionError:
        raise YamlError(f"{what} {path}: nested too deeply to read: refused") from None
    finally:
        loader.dispose()
    return YamlDocument(path, data, root)
