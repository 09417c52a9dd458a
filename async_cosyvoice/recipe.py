"""Tag-aware loader for HyperPyYAML recipes (`cosyvoice2.yaml`, `cosyvoice3.yaml`), without upstream code.

`!new:` / `!name:` / `!apply:` nodes are kept as data (`Tagged`, never imported or called); `!ref` and
`!copy` are resolved, including `<a> * <b>` arithmetic; `!tuple` makes a tuple. Floats and booleans follow
YAML 1.2 (`1e-06` is a float, `yes` a string). Every problem raises `ModelDirError` naming the file.
"""
from __future__ import annotations

import ast
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from async_cosyvoice.errors import ModelDirError

YAML_FILE = "cosyvoice2.yaml"  # the recipe of an official CosyVoice2 model directory
# the recipe file names upstream's AutoModel looks for, in its order, and the model each one means
YAML_FILES: dict[str, str] = {"cosyvoice.yaml": "cosyvoice1", "cosyvoice2.yaml": "cosyvoice2",
                              "cosyvoice3.yaml": "cosyvoice3"}


@dataclass(frozen=True)
class Tagged:
    """A `!new:` / `!name:` / `!apply:` node kept as data: `kind` is "new" | "name" | "apply",
    `target` the dotted callable path (never imported), `args` a dict (keywords), a list (positional)
    or None (no arguments)."""
    kind: str
    target: str
    args: Any = None

    @property
    def class_name(self) -> str:
        return self.target.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class _Ref:
    expr: str
    copy: bool = False


class RecipeLoader(yaml.SafeLoader):
    """SafeLoader + HyperPyYAML tags as data, with YAML 1.2 floats (`1e-06`) and booleans."""


RecipeLoader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in rs if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:bool")]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _construct_args(loader: RecipeLoader, node: yaml.Node):
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    if node.value == "":
        return None
    tag = loader.resolve(yaml.ScalarNode, node.value, (True, False))
    return [loader.construct_object(yaml.ScalarNode(tag, node.value), deep=True)]


def _tagged_constructor(kind: str):
    def construct(loader: RecipeLoader, suffix: str, node: yaml.Node) -> Tagged:
        return Tagged(kind, suffix, _construct_args(loader, node))
    return construct


for _kind in ("new", "name", "apply"):
    RecipeLoader.add_multi_constructor(f"!{_kind}:", _tagged_constructor(_kind))
RecipeLoader.add_constructor("!ref", lambda loader, node: _Ref(loader.construct_scalar(node)))
RecipeLoader.add_constructor("!copy", lambda loader, node: _Ref(loader.construct_scalar(node), copy=True))
RecipeLoader.add_constructor("!tuple", lambda loader, node: tuple(loader.construct_sequence(node, deep=True)))

_REF_RE = re.compile(r"<([^<>]+)>")
_ARITH_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arith(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
        return _ARITH_OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _ARITH_OPS:
        return _ARITH_OPS[type(node.op)](_arith(node.operand))
    raise ValueError("not arithmetic")


def _split_key(key: str) -> list[str]:
    """`a.b[c][0]` -> ['a', 'b', 'c', '0']."""
    return [p for p in re.split(r"[.\[\]]", key.strip()) if p]


def child(node, part: str):
    """One step into resolved or raw recipe data: a mapping key or a list index (a `Tagged` node steps
    into its args); KeyError when there is no such child."""
    if isinstance(node, Tagged):
        node = node.args
    if isinstance(node, Mapping):
        if part in node:
            return node[part]
    elif isinstance(node, (list, tuple)) and re.fullmatch(r"-?\d+", part):
        i = int(part)
        if -len(node) <= i < len(node):
            return node[i]
    raise KeyError(part)


class _Resolver:
    def __init__(self, root: dict, file: str):
        self.root, self.file = root, file
        self.memo: dict[str, Any] = {}
        self.active: list[str] = []

    def lookup(self, key: str):
        canon = ".".join(_split_key(key))
        if canon in self.memo:
            return self.memo[canon]
        if canon in self.active:
            raise ModelDirError(self.file, f"circular !ref: {' -> '.join(self.active + [canon])}")
        node = self.root
        for part in _split_key(key):
            try:
                node = child(node, part)
            except KeyError:
                raise ModelDirError(self.file, f"!ref <{key}> refers to a missing key {canon}") from None
        self.active.append(canon)
        try:
            value = self.resolve(node)
        finally:
            self.active.pop()
        self.memo[canon] = value
        return value

    def ref(self, r: _Ref):
        expr = r.expr.strip()
        whole = _REF_RE.fullmatch(expr)
        if whole:
            return self.lookup(whole.group(1))
        text = _REF_RE.sub(lambda m: str(self.lookup(m.group(1))), expr)
        try:
            return _arith(ast.parse(text, mode="eval"))
        except (SyntaxError, ValueError, TypeError, ZeroDivisionError):
            return text

    def resolve(self, node):
        if isinstance(node, _Ref):
            return self.ref(node)
        if isinstance(node, Tagged):
            return Tagged(node.kind, node.target, self.resolve(node.args))
        if isinstance(node, Mapping):
            return {k: self.resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [self.resolve(v) for v in node]
        if isinstance(node, tuple):
            return tuple(self.resolve(v) for v in node)
        return node


def load_recipe(text: str, overrides: Mapping[str, Any] | None = None, file: str = YAML_FILE) -> dict:
    """Parse a HyperPyYAML recipe into plain data: `Tagged` records for `!new:`/`!name:`/`!apply:`,
    `!ref` resolved. Top-level `overrides` replace keys before references are resolved."""
    try:
        raw = yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - RecipeLoader is a SafeLoader
    except yaml.YAMLError as e:
        raise ModelDirError(file, f"not valid YAML ({e})") from e
    if not isinstance(raw, dict):
        raise ModelDirError(file, f"expected a mapping at the top level, got {type(raw).__name__}")
    raw.update(overrides or {})
    return _Resolver(raw, file).resolve(raw)
