"""A `structural_tag` constraint (xgrammar's format, which the SMG router and vLLM / SGLang clients
send for tool calls) translated to llguidance's Lark, the only grammar engine we run.

Two shapes are read. The legacy `{"type": "structural_tag", "structures": [{"begin", "schema",
"end"}, ...], "triggers": [...]}`: free text in which each trigger must open one of the structures
that begin with it (begin, a JSON value for its schema, end), any number of times. And `{"format":
{...}}`: a tree of the FORMAT_TYPES objects, read as xgrammar documents them; `at_least_one` on
triggered_tags means the output starts with a tag at once (xgrammar's reading, for forced calls).

Free text up to a trigger, and any_text up to its tag's end, are llguidance lazy lexemes: they end
at the first occurrence of the string that follows, so the text cannot contain it (as in
xgrammar). any_text before a const_string or a tag in a sequence stops at that literal likewise;
anywhere else no known literal follows it, so it is greedy and takes the rest of the output.

Triggers such as "<|python_tag|>" or "[TOOL_CALLS]" stay text literals, never `<|name|>` special
tokens (llguidance's `assume_special`): whether such a string is one special token depends on the
tokenizer, and the grammar must mean the same for every model the gateway may load. A tokenizer
that has it as a special token makes the model spell it out as text instead.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from shardlm_server.gateway.constraints.json_schema import generation_schema

MAX_DEPTH = 32
MAX_TAGS = 1000
ANY_TEXT = "/(.|\\n)*/"  # "." alone stops at a newline
FORMAT_TYPES = ("const_string", "json_schema", "grammar", "regex", "any_text", "sequence", "or",
                "tag", "triggered_tags", "tags_with_separator")
_JSON_NAMES = {str: "a string", bool: "a boolean", dict: "an object", list: "a list",
               int: "a number", float: "a number", type(None): "null"}
_MISSING = object()


class StructuralTagError(ValueError):
    """A structural_tag its sender got wrong; the message names the field and what is wrong."""


def structural_tag_to_lark(text: str) -> str:
    """The Lark grammar (for `llguidance.LLMatcher.grammar_from_lark`) of a structural_tag JSON
    text; StructuralTagError when it is not a structural tag we can read."""
    if not isinstance(text, str):
        raise StructuralTagError(f"must be a JSON text, not {type(text).__name__}")
    try:
        root = json.loads(text)
        json.dumps(root, ensure_ascii=False).encode()  # llguidance takes UTF-8 only
    except json.JSONDecodeError as exc:
        raise StructuralTagError(f"is not valid JSON: {exc.msg} at line {exc.lineno} column "
                                 f"{exc.colno}") from None
    except RecursionError:
        raise StructuralTagError("is nested too deeply to read") from None
    except UnicodeEncodeError:
        raise StructuralTagError("holds an unpaired UTF-16 surrogate (\\ud800-\\udfff)") from None
    _as(root, dict, "the structural tag")
    if root.get("type", "structural_tag") != "structural_tag":
        raise StructuralTagError(f'type must be "structural_tag", not {root["type"]!r}')
    writer = _LarkWriter()
    if "format" in root:
        start = writer.format(root["format"], "", "format", 1)
    elif "structures" in root or "triggers" in root:
        start = writer.legacy(root)
    else:
        raise StructuralTagError('needs a "format" object, or "structures" and "triggers"')
    lark = "\n".join([f"start: {start}", *writer.rules]) + "\n"
    if reason := _problem(lark):
        # Only now is each schema and regex compiled alone, to name the field at fault.
        for piece, path in writer.pieces:
            if piece_reason := _problem(f"start: {piece}"):
                raise StructuralTagError(f"{path}: {piece_reason}")
        raise StructuralTagError(f"does not compile: {reason}")
    return lark


def _as(value: Any, kind: type, path: str) -> Any:
    """`value` if it is of `kind` (and not empty, for a list); `path` names it."""
    if not isinstance(value, kind):
        wrong = _JSON_NAMES[type(value)]
        raise StructuralTagError(f"{path} must be {_JSON_NAMES[kind]}, not {wrong}")
    if kind is list and not value:
        raise StructuralTagError(f"{path} must not be empty")
    return value


def _get(obj: dict, key: str, kind: type, path: str, default: Any = _MISSING) -> Any:
    field = f"{path}.{key}" if path else key
    if key in obj:
        return _as(obj[key], kind, field)
    if default is _MISSING:
        raise StructuralTagError(f"{field} is missing")
    return default


def _lit(text: str) -> str:
    """A Lark string literal: JSON escaping is Lark's, except that Lark wants DEL escaped too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f") if text else ""


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p) or '""'


def _alt(parts: Any) -> str:
    return "(" + " | ".join(parts) + ")"


def _regex_literal(pattern: str) -> str:
    """`/pattern/`: an unescaped "/" would end the literal, a raw newline the grammar's line."""
    escapes = {"/": "\\/", "\n": "\\n", "\r": "\\r"}
    return "/" + re.sub(r"\\.|[/\n\r]", lambda m: escapes.get(m.group(), m.group()), pattern,
                        flags=re.DOTALL) + "/"


def _problem(lark: str, keep_position: bool = False) -> str:
    """llguidance's objection to a grammar, on one line without its excerpt of the grammar (and
    without positions when they are in a wrapper of ours); "" when it has none."""
    message = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))
    reason = " ".join(line.strip() for line in re.split(r"\n\s*\d+ \| ", message)[0]
                      .splitlines() if line.strip(" ^"))
    return reason if keep_position else re.sub(r"^(at )?\d+\(\d+\): ", "", reason)


class _LarkWriter:
    """Writes a format tree as a Lark expression plus the named rules that it needs."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.tags = 0
        self.pieces: list[tuple[str, str]] = []  # (a JSON schema or regex, its field)
        self._text_terminals: dict[tuple[str, ...], str] = {}

    def _rule(self, prefix: str, body: str, lazy: bool = False) -> str:
        name = f"{prefix}_{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def _text(self, excluded: tuple[str, ...] = ()) -> str:
        """A terminal for any text that contains none of `excluded`."""
        if excluded not in self._text_terminals:
            body = ANY_TEXT
            if excluded:
                body += f" & ~({ANY_TEXT} ({' | '.join(map(_lit, excluded))}) {ANY_TEXT})"
            self._text_terminals[excluded] = name = f"TEXT_{len(self._text_terminals)}"
            self.rules.append(f"{name}: {body}")
        return self._text_terminals[excluded]

    def _text_then(self, follow: str, excluded: tuple[str, ...] = ()) -> str:
        """Any text, then `follow`: a lazy lexeme ends at the first `follow` (a greedy one would
        swallow `follow` and all after it)."""
        if not follow:
            return self._text(excluded)
        return self._rule("text", f"{self._text(excluded)} {_lit(follow)}", lazy=True)

    def _count_tag(self) -> None:
        self.tags += 1
        if self.tags > MAX_TAGS:
            raise StructuralTagError(f"has more than {MAX_TAGS} tags")

    def format(self, fmt: Any, follow: str, path: str, depth: int, skip_begin: bool = False) -> str:
        """An expression for `fmt` followed by the literal `follow` (where any_text stops);
        `skip_begin`: a const_string's or tag's leading literal was matched already."""
        if depth > MAX_DEPTH:
            raise StructuralTagError(f"{path}: formats nest deeper than {MAX_DEPTH} levels")
        obj = _as(fmt, dict, path)
        kind = _get(obj, "type", str, path)
        if kind == "const_string":
            value = _get(obj, "value", str, path)
            return _seq(_lit(follow if skip_begin else value + follow))
        if kind == "json_schema":
            return _seq(self._json(obj, "json_schema", path), _lit(follow))
        if kind == "grammar":
            return _seq(self._grammar(_get(obj, "grammar", str, path), f"{path}.grammar"),
                        _lit(follow))
        if kind == "regex":
            pattern = _get(obj, "pattern", str, path)
            if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
                raise StructuralTagError(f"{path}.pattern ends in a lone backslash")
            literal = _regex_literal(pattern)
            self.pieces.append((literal, f"{path}.pattern"))
            return _seq(literal, _lit(follow))
        if kind == "any_text":
            excluded = obj.get("excluded_str", [])
            if not isinstance(excluded, list) or not all(isinstance(x, str) and x for x in excluded):
                raise StructuralTagError(f"{path}.excluded_str must be a list of non-empty strings")
            return self._text_then(follow, tuple(excluded))
        if kind == "sequence":
            return self._sequence(_get(obj, "elements", list, path), follow, path, depth)
        if kind == "or":
            elements = _get(obj, "elements", list, path)
            return _alt(self.format(e, follow, f"{path}.elements[{i}]", depth + 1)
                        for i, e in enumerate(elements))
        if kind == "tag":
            begin, body = self._tag(obj, path, depth, follow)
            return _seq("" if skip_begin else _lit(begin), body)
        if kind not in ("triggered_tags", "tags_with_separator"):
            raise StructuralTagError(f"{path}.type {kind!r} is not one of: "
                                     f"{', '.join(FORMAT_TYPES)}")
        tags = []
        for i, tag in enumerate(_get(obj, "tags", list, path)):
            tag_path = f"{path}.tags[{i}]"
            if _as(tag, dict, tag_path).get("type", "tag") != "tag":
                raise StructuralTagError(f'{tag_path}.type must be "tag", not {tag["type"]!r}')
            tags.append((tag_path, *self._tag(tag, tag_path, depth + 1)))
        at_least_one = _get(obj, "at_least_one", bool, path, default=False)
        stop_after_first = _get(obj, "stop_after_first", bool, path, default=False)
        if kind == "triggered_tags":
            return self._triggered(_get(obj, "triggers", list, path), tags, f"{path}.triggers",
                                   follow, at_least_one, stop_after_first)
        separator = _get(obj, "separator", str, path)
        one = _alt(_seq(_lit(begin), body) for _, begin, body in tags)
        many = one if stop_after_first else f"{one} ({_seq(_lit(separator), one)})*"
        return _seq(many if at_least_one else f"({many})?", _lit(follow))

    def _sequence(self, elements: list, follow: str, path: str, depth: int) -> str:
        parts, skip_begin = [], False
        for i, element in enumerate(elements):
            last = i == len(elements) - 1
            element_follow, skip_next = (follow if last else ""), False
            after = None if last else elements[i + 1]
            if (isinstance(element, dict) and element.get("type") == "any_text"
                    and isinstance(after, dict) and after.get("type") in ("const_string", "tag")):
                leading = after.get("value" if after["type"] == "const_string" else "begin")
                if isinstance(leading, str) and leading:  # the text ends where that literal starts
                    element_follow, skip_next = leading, True
            parts.append(self.format(element, element_follow, f"{path}.elements[{i}]",
                                     depth + 1, skip_begin))
            skip_begin = skip_next
        return _seq(*parts)

    def _json(self, obj: dict, key: str, path: str) -> str:
        schema = _get(obj, key, object, path)
        if not isinstance(schema, dict | bool):
            raise StructuralTagError(f"{path}.{key} must be a JSON schema (an object or a "
                                     f"boolean), not {_JSON_NAMES[type(schema)]}")
        expression = f"%json {json.dumps(generation_schema(schema))}"
        self.pieces.append((expression, f"{path}.{key}"))
        return expression

    def _grammar(self, grammar: str, path: str) -> str:
        try:  # GBNF (xgrammar's and llama.cpp's EBNF) is converted; Lark passes through
            lark = any_to_lark(grammar)
        except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions
            raise StructuralTagError(f"{path}: {exc}") from None
        # Checked alone, which also keeps a stray "}" from closing the nested grammar early.
        if reason := _problem(lark, keep_position=True):
            raise StructuralTagError(f"{path}: {reason}")
        return self._rule("grammar", "%lark {\n" + lark + "\n}")

    def _tag(self, obj: dict, path: str, depth: int, follow: str = "") -> tuple[str, str]:
        """(begin, a rule for the content, end and `follow`)."""
        self._count_tag()
        begin, end = _get(obj, "begin", str, path), _get(obj, "end", str, path)
        if "content" not in obj:
            raise StructuralTagError(f"{path}.content is missing")
        return begin, self._rule("tag", self.format(obj["content"], end + follow,
                                                    f"{path}.content", depth + 1))

    def legacy(self, root: dict) -> str:
        """`structures` and `triggers`: triggered tags whose contents are JSON schemas."""
        tags = []
        for i, structure in enumerate(_get(root, "structures", list, "")):
            path = f"structures[{i}]"
            self._count_tag()
            obj = _as(structure, dict, path)
            begin, end = _get(obj, "begin", str, path), _get(obj, "end", str, path)
            tags.append((path, begin, self._rule("tag", _seq(self._json(obj, "schema", path),
                                                             _lit(end)))))
        return self._triggered(_get(root, "triggers", list, ""), tags, "triggers", "", False,
                               False)

    def _triggered(self, triggers: list, tags: list[tuple[str, str, str]], triggers_path: str,
                   follow: str, at_least_one: bool, stop_after_first: bool) -> str:
        """Free text in which a trigger (a lazy lexeme, so the first in the text wins) must go
        on into one of the tags whose begin starts with it."""
        for i, trigger in enumerate(triggers):
            if not isinstance(trigger, str) or not trigger:
                raise StructuralTagError(f"{triggers_path}[{i}] must be a non-empty string")
        rests: list[list[str]] = [[] for _ in triggers]
        for tag_path, begin, body in tags:
            matches = [i for i, trigger in enumerate(triggers) if begin.startswith(trigger)]
            if len(matches) != 1:
                raise StructuralTagError(
                    f"{tag_path}.begin {begin!r} must start with exactly one of the triggers "
                    f"{triggers}; it starts with {len(matches) or 'none'} of them")
            rests[matches[0]].append(_seq(_lit(begin[len(triggers[matches[0]]):]), body))
        opened = []
        for i, trigger in enumerate(triggers):
            if not rests[i]:
                raise StructuralTagError(f"{triggers_path}[{i}] {trigger!r} begins no tag")
            text_and_trigger = self._rule("trigger", f"{self._text()} {_lit(trigger)}", lazy=True)
            opened.append(f"{text_and_trigger} {_alt(rests[i])}")
        triggered = _alt(opened)
        whole = _alt(_seq(_lit(begin), body) for _, begin, body in tags)
        if at_least_one and stop_after_first:
            return _seq(whole, _lit(follow))
        if at_least_one:
            return f"{whole} {triggered}* {self._text_then(follow)}"
        if stop_after_first:
            return f"({_seq(triggered, _lit(follow))} | {self._text_then(follow)})"
        return f"{triggered}* {self._text_then(follow)}"
