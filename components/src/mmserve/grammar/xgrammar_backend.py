"""The xgrammar backend (xgrammar 0.2.8, vLLM's and SGLang's default): each kind of grammar as
vLLM builds it, compiled for a tokenizer, matched per choice.

- `json_schema`: the schema (checked first: `schema.check_schema`), in xgrammar's strict mode
  (no property or item the schema does not name, as vLLM has it), compact unless the grammar
  asks for any whitespace; `json_object` is the schema `{"type": "object"}`.
- `regex`: the pattern, whole (the text must match all of it).
- `choice`: one EBNF alternative per choice, each a string literal.
- `ebnf`: xgrammar's EBNF (GBNF-like, root rule `root`); a grammar without `::=` is read as
  Lark, as vLLM reads it.

One repair: xgrammar 0.2.8 writes a string with `minLength` / `maxLength` as a repetition of
`[^"\\\r\n]`, which lets raw control characters through (not JSON: a strict parser such as
pydantic's refuses them), and whose token masks cost 2 to 50 ms each to fill inside the
string. Such a run becomes xgrammar's JSON-string regex of as many characters (`.` in
`Regex(..., json_string=true)`: no control character, quote or backslash), whose masks fill in
tens of microseconds; one regex per pair of bounds, shared by every string of those bounds.
xgrammar expands a regex's repetition only up to 128 (past it the regex loses both its speed
and its JSON characters), so a longer bound repeats JSON's characters instead: correct, with
millisecond masks, and slow to compile (seconds for a few hundred characters: the compile
timeout bounds it).

xgrammar is imported on first use: importing it costs seconds.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import TYPE_CHECKING, Any

import msgspec

from mmserve.grammar.base import Backend, GrammarError, GrammarInvalid
from mmserve.grammar.schema import check_schema
from mmserve.protocol import Grammar

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

ANY_OBJECT = '{"type": "object"}'
# A run of xgrammar's string characters with a length bound, as it writes a bounded string.
_BOUNDED_RUN = re.compile(r"\b(\w+_characters)\{(\d+), (-?\d+)\}")
_REGEX_REPEAT_MAX = 128  # the longest repetition xgrammar expands in a regex
_JSON_CHARACTER = 'mmserve_json_character ::= [^\\0-\\x1f\\"\\\\]'
# "[21:14:32] /project/cpp/grammar_parser.cc:820: " before each of xgrammar's messages.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@functools.cache
def _xgr() -> Any:
    import xgrammar

    return xgrammar


class XGrammarBackend(Backend):
    name = "xgrammar"

    def load(self) -> None:
        _xgr()

    def check(self, grammar: Grammar) -> None:
        source(grammar)

    def compiler(
        self, tokenizer: object, vocab_size: int, stop_ids: tuple[int, ...]
    ) -> XGrammarCompiler:
        return XGrammarCompiler(tokenizer, vocab_size, stop_ids)


def source(grammar: Grammar) -> xgr.Grammar:
    """`grammar` as xgrammar's tokenizer-free grammar; `GrammarError` where it cannot be."""
    xgr = _xgr()
    spec = grammar.spec
    try:
        if grammar.kind == "json_schema":
            check_schema(parse_json(spec, "the JSON Schema"))
            return _json(spec, grammar.any_whitespace)
        if grammar.kind == "json_object":
            return _json(ANY_OBJECT, grammar.any_whitespace)
        if grammar.kind == "regex":
            if "\x00" in spec:  # xgrammar's converter reads a C string
                raise GrammarInvalid("the regex holds a NUL character")
            return xgr.Grammar.from_regex(spec)
        if grammar.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(parse_json(spec, "the choices")))
        if "::=" not in spec:
            return xgr.Grammar.from_lark(spec)
        return xgr.Grammar.from_ebnf(spec)
    except GrammarError:
        raise
    except Exception as err:  # xgrammar's own errors are RuntimeErrors of its runtime
        raise GrammarInvalid(_LOCATION.sub("", str(err)).strip()) from None


@functools.lru_cache(maxsize=256)
def ebnf_text(grammar: Grammar) -> str:
    """`grammar` as xgrammar's EBNF text (for an engine that compiles EBNF itself): the same
    grammar this backend compiles, repairs and whitespace included."""
    return str(source(msgspec.structs.replace(grammar, start_after=None)))


def parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as err:
        raise GrammarInvalid(f"{what} is not valid JSON: {err}") from None


def choice_ebnf(choices: Any) -> str:
    """A grammar whose texts are exactly `choices` (a non-empty list of strings)."""
    if not isinstance(choices, list) or not choices:
        raise GrammarInvalid("the list of choices is empty")
    if not all(isinstance(choice, str) for choice in choices):
        raise GrammarInvalid("every choice must be a string")
    return "root ::= " + " | ".join(_literal(choice) for choice in choices)


def _literal(text: str) -> str:
    """`text` as an EBNF string literal."""
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\x{ord(char):02x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def json_ebnf(schema: str, any_whitespace: bool) -> str:
    """The EBNF text of a JSON Schema's grammar (bounded strings repaired)."""
    text = str(_xgr().Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    runs: dict[str, str] = {}

    def json_run(match: re.Match[str]) -> str:
        low, high = match[2], "" if match[3] == "-1" else match[3]
        if int(high or low) > _REGEX_REPEAT_MAX:
            runs["mmserve_json_character"] = _JSON_CHARACTER
            return f"mmserve_json_character{{{match[2]}, {match[3]}}}"
        name = f"mmserve_json_characters_{low}_{high or 'up'}"
        runs[name] = f'{name} ::= Regex("^.{{{low},{high}}}$", json_string=true)'
        return name

    repaired = _BOUNDED_RUN.sub(json_run, text)
    return "\n".join([repaired, *runs.values()])


def _json(schema: str, any_whitespace: bool) -> xgr.Grammar:
    return _xgr().Grammar.from_ebnf(json_ebnf(schema, any_whitespace))


class XGrammarCompiler:
    """xgrammar's compiler over one tokenizer (its vocabulary read once: ~1 s for Qwen's)."""

    def __init__(self, tokenizer: object, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        xgr = _xgr()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
        )
        self.stop_ids = stop_ids
        # The cache is mmserve's (`GrammarCache`); the threads share out the vocabulary.
        threads = max(1, min(4, len(os.sched_getaffinity(0))))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def compile(self, grammar: Grammar) -> XGrammarCompiled:
        return XGrammarCompiled(self._compiler.compile_grammar(source(grammar)), self.stop_ids)


class XGrammarCompiled:
    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: tuple[int, ...]) -> None:
        self.native = compiled  # xgrammar's own, for its other integrations
        self.stop_ids = stop_ids
        self.nbytes: int = compiled.memory_size_bytes

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(_xgr().GrammarMatcher(self.native))


class XGrammarMatcher:
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        return bool(self._matcher.fill_next_token_bitmask(bitmask, row))

    def accept(self, token: int) -> bool:
        return bool(self._matcher.accept_token(token))

    def can_end(self) -> bool:
        return bool(self._matcher.is_completed())

    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
