"""The stated limits of every file the package reads from a user, and the readers that check them first.

A manifest (YAML) and the JSON files a command is handed (a sweep or routing policy for `shapewise tune`, a
report's provenance.json) are read through `load_yaml` / `load_json`, which check, before anything is built
from them: the file exists and is a regular file, its size (MAX_YAML_BYTES, MAX_JSON_BYTES), that it is UTF-8,
its nesting depth (MAX_YAML_DEPTH, MAX_JSON_DEPTH), that no key is written twice in one mapping, for JSON that
every integer is one Python converts (at most sys.get_int_max_str_digits() digits), and for YAML
that it has no alias (`*name`, also what a merge key `<<: *name` uses): an alias shares a node, and a few nested
ones expand exponentially in whatever walks the data afterwards (validation, JSON, a deep copy). Every violation
is an InputFileError whose message starts with the file's name (and the line, for YAML).

COUNT_MAX is the largest count or byte size anything downstream can hold: torch's sizes and numel, JSON
readers and pandas' Int64 columns are signed 64-bit; TENSOR_ELEMENTS_MAX bounds one tensor of a row. Nothing
here imports torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

COUNT_MAX = 2**63 - 1  # a signed 64-bit count: torch sizes and numel, pandas Int64
# The most elements one tensor of a row may hold: its bytes at 8 an element (the widest dtype a job uses), summed
# over up to 8 such tensors in one memory estimate, still fit COUNT_MAX.
TENSOR_ELEMENTS_MAX = COUNT_MAX // 64
NAME_MAX = 255  # the longest file name ext4, XFS, Btrfs, ZFS and NFS take (bytes; ids are ASCII)
MAX_YAML_BYTES = 1 * 2**20  # a manifest row takes ~200 bytes: 1 MiB holds thousands of rows
MAX_JSON_BYTES = 64 * 2**20  # a sweep or provenance record is well under a MiB; a trace is never read
MAX_YAML_DEPTH = 8  # a manifest needs 3 levels: the list, a row, a value
MAX_JSON_DEPTH = 32  # the package's JSON records (results, sweeps, provenance) need at most 7
MAX_CONFIG_NODES = 10_000  # config/config.yaml holds ~150 values; an alias bomb expands past any such bound


class InputFileError(ValueError):
    """A file the package refuses before using any of it; the message names the file and what is wrong."""


def read_text(path, what, max_bytes):
    """The UTF-8 text of `path` (a `what`: "manifest", "sweep file", ...), at most `max_bytes` bytes."""
    path = Path(path)
    if path.is_dir():
        raise InputFileError(f"{path}: is a directory, not a {what} file")
    if not path.is_file():
        raise InputFileError(f"{path}: {what} file not found" if not path.exists()
                             else f"{path}: not a regular file (a {what} must be one)")
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise InputFileError(f"{path}: cannot be read ({exc.strerror})") from None
    if len(data) > max_bytes:
        raise InputFileError(f"{path}: larger than the {max_bytes} bytes a {what} may have")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{path}: not UTF-8 text (byte {exc.start} is {data[exc.start]:#04x}); "
                             f"a {what} is a text file") from None
    if (nul := data.find(b"\0")) >= 0:  # a text file holds none; UTF-16 or UTF-32 text without a BOM decodes
        raise InputFileError(f"{path}: not UTF-8 text (byte {nul} is 0x00: UTF-16 or UTF-32 text? save it as "
                             f"UTF-8); a {what} is a text file")
    return text


def _mark(mark):
    return f"line {mark.line + 1}, column {mark.column + 1}"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses aliases, nodes deeper than MAX_YAML_DEPTH and a key written twice."""

    def __init__(self, text, source):
        super().__init__(text)
        self.source = source
        self.depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise InputFileError(f"{self.source}: {_mark(event.start_mark)}: YAML alias *{event.anchor}: aliases "
                                 "are not allowed (write each value out; nested aliases expand exponentially)")
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise InputFileError(f"{self.source}: {_mark(self.peek_event().start_mark)}: nested deeper than "
                                     f"{MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise InputFileError(f"{self.source}: {_mapping_name(node)}: key {key!r} written twice (lines "
                                     f"{seen[key]} and {line}); YAML would keep the last one silently")
            seen[key] = line
        return super().construct_mapping(node, deep)


def _mapping_name(node):
    """`row 'x' (line N)` for a mapping with a scalar `id`, else `the mapping at line N`."""
    for key_node, value_node in node.value:
        if (isinstance(key_node, yaml.ScalarNode) and key_node.value == "id"
                and isinstance(value_node, yaml.ScalarNode)):
            return f"row {value_node.value!r} (line {node.start_mark.line + 1})"
    return f"the mapping at line {node.start_mark.line + 1}"


def load_yaml(path, what="manifest", max_bytes=MAX_YAML_BYTES):
    """The one YAML document of `path`, checked against the limits above; InputFileError otherwise."""
    text = read_text(path, what, max_bytes)
    loader = None
    try:
        loader = _Loader(text, str(path))  # its reader refuses a character YAML does not print, at once
        loader.name = str(path)  # PyYAML's own messages name the stream by it
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise InputFileError(f"{path}: not valid YAML: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _depth(value):
    """The nesting depth of a JSON value (a scalar is 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, level + 1) for child in children)
    return deepest


def check_loaded(value, source, max_nodes=MAX_CONFIG_NODES, max_depth=MAX_YAML_DEPTH):
    """Raise InputFileError naming `source` when `value`, data another loader built (Snakemake's config, whose
    loader keeps aliases), nests deeper than `max_depth` or expands to more than `max_nodes` values: every
    occurrence of a shared node counts, so an alias bomb stops after `max_nodes` steps, not 9^9."""
    count, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        count += 1
        if count > max_nodes:
            raise InputFileError(f"{source}: more than {max_nodes} values once expanded (YAML aliases?)")
        if level > max_depth:
            raise InputFileError(f"{source}: nested deeper than {max_depth} levels")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, level + 1) for child in children)


def load_json(path, what, max_bytes=MAX_JSON_BYTES):
    """The JSON value of `path`, checked against the limits above; InputFileError otherwise."""
    text = read_text(path, what, max_bytes)

    def pairs(items):
        out = {}
        for key, value in items:
            if key in out:
                raise InputFileError(f"{path}: key {key!r} written twice in one object; a JSON reader would keep "
                                     f"the last one silently")
            out[key] = value
        return out

    too_long = object()  # in place of an integer longer than Python converts (sys.get_int_max_str_digits())

    def integer(digits):
        try:
            return int(digits)
        except ValueError:
            return too_long

    try:
        data = json.loads(text, object_pairs_hook=pairs, parse_int=integer)
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{path}: not valid JSON ({exc.msg}; line {exc.lineno}, column {exc.colno})") \
            from None
    except RecursionError:
        raise InputFileError(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels") from None
    if _depth(data) > MAX_JSON_DEPTH:
        raise InputFileError(f"{path}: nested deeper than {MAX_JSON_DEPTH} levels")
    if (where := _place_of(data, too_long)) is not None:
        raise InputFileError(f"{path}: {where}: an integer longer than the {sys.get_int_max_str_digits()} digits "
                             f"Python reads")
    return data


def _place_of(value, target):
    """Where `target` (that very object) sits in a JSON value, as `key[2].key` (`the top level` for the value
    itself), or None; without recursion."""
    stack = [(value, "")]
    while stack:
        item, where = stack.pop()
        if item is target:
            return where or "the top level"
        if isinstance(item, dict):
            stack.extend((child, f"{where}.{key}" if where else f"field {key}") for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{index}]") for index, child in enumerate(item))
    return None
