"""The interface a grammar backend implements, and the errors a grammar can meet.

A backend checks a grammar without a tokenizer (`Backend.check`: the frontend's validation)
and, per tokenizer, compiles it (`Compiler.compile`, blocking: callers run it in a thread).
A compiled grammar gives a fresh `Matcher` per choice. Token masks are bitmasks of 32-bit
words (`[rows, ceil(vocab / 32)]`, int32, bit `i % 32` of word `i // 32` set where token `i`
is allowed), the layout xgrammar and llguidance both fill.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Protocol

from mmserve.protocol import (
    ERROR_GRAMMAR_INVALID,
    ERROR_GRAMMAR_TIMEOUT,
    ERROR_GRAMMAR_UNSUPPORTED,
    Grammar,
)

if TYPE_CHECKING:
    import torch


class GrammarError(Exception):
    """A grammar that cannot be served as given: the client's 400, with its `code`."""

    code = ERROR_GRAMMAR_INVALID


class GrammarInvalid(GrammarError):
    """Not a valid JSON Schema, regex or EBNF grammar, or an empty list of choices."""


class GrammarUnsupported(GrammarError):
    """Valid, but with a feature the backend would not enforce (named in the message)."""

    code = ERROR_GRAMMAR_UNSUPPORTED


class GrammarTimeout(GrammarError):
    """Its compile ran past the compile timeout."""

    code = ERROR_GRAMMAR_TIMEOUT


class Matcher(Protocol):
    """One choice's place in a compiled grammar."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the tokens allowed next into `bitmask[row]`; False when every token is."""

    def accept(self, token: int) -> bool:
        """Advance over `token`; False (and no change) when the grammar forbids it."""

    def can_end(self) -> bool:
        """Whether the text so far is complete: a stop token is allowed next."""

    def terminated(self) -> bool:
        """Whether a stop token was accepted: nothing may follow."""


class CompiledGrammar(Protocol):
    """A grammar compiled for one tokenizer."""

    @property
    def nbytes(self) -> int:
        """Memory it holds (what the cache weighs)."""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end it (the model's EOS ids)."""

    def matcher(self) -> Matcher:
        """A matcher at the grammar's start."""


class Compiler(Protocol):
    """A backend's compiler for one tokenizer."""

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """`grammar` compiled (blocking); `GrammarError` when it cannot be."""


class Backend(abc.ABC):
    """A grammar engine: what it checks without a tokenizer, and its compiler for one."""

    name: str

    @abc.abstractmethod
    def load(self) -> None:
        """Import what the backend needs (blocking; a compile's timeout does not count it)."""

    @abc.abstractmethod
    def check(self, grammar: Grammar) -> None:
        """Raise `GrammarError` when `grammar` cannot be compiled or enforced (blocking;
        no tokenizer needed)."""

    @abc.abstractmethod
    def compiler(self, tokenizer: object, vocab_size: int, stop_ids: tuple[int, ...]) -> Compiler:
        """A compiler for `tokenizer` (a transformers tokenizer) over the model's
        `vocab_size` logits, ended by `stop_ids` (blocking: it reads the vocabulary)."""
