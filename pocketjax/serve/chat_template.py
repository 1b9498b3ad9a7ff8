"""The Jinja environment chat templates render in, built like transformers' (`utils/chat_template_utils.py`), and
the plain JSON values a template is given.

The same globals and filters as transformers (`raise_exception`, `strftime_now`, `tojson` as json.dumps, the
`{% generation %}` tag), in `template_sandbox`'s bounded sandbox, so a prompt rendered here has the same text as
transformers' and a hostile template is stopped by the same rules (`namespace` refuses underscore attributes).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from ..errors import CheckpointError
from .template_sandbox import BoundedSandboxedEnvironment, checked

MAX_JSON_INDENT = 16  # tojson(indent=) multiplies each nesting level's lines: a wide indent is a size amplifier


def plain(value: Any) -> Any:
    """`value` rebuilt from JSON types (what transformers lets a sandboxed template see); others -> "<Type>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:
        return plain(value.item())  # numpy scalars
    return f"<{type(value).__name__}>"


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # names templates read it by


def alias_reasoning(message: dict) -> dict:
    """Copy a message's reasoning under every name templates read it by (transformers does the same)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps it as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; templates were written against json.dumps.
    if indent is not None and (not isinstance(indent, int) or not 0 <= indent <= MAX_JSON_INDENT):
        raise jinja2.exceptions.TemplateError(f"tojson indent must be an int in [0, {MAX_JSON_INDENT}]")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes, closing a sandbox escape (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, checked(value))

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def template_environment() -> BoundedSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in: sandboxed, trimmed, same helpers; bounded in
    time and size when rendered through `template_sandbox.render`."""
    env = BoundedSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=16)
def compile_template(source: str, name: str = "chat template") -> jinja2.Template:
    """Compile a chat template once; a template that does not parse is a broken checkpoint."""
    try:
        return template_environment().from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise CheckpointError(f"chat template of {name} does not parse: {err}") from err
    except RecursionError:
        raise CheckpointError(f"chat template of {name} nests too deeply to compile") from None
