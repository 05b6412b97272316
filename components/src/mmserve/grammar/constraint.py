"""One choice's grammar as its tokens come: free text until the grammar's `start_after` token
(a reasoning section's end) is sampled, then every token through the matcher, until a stop
token ends it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mmserve.grammar.base import CompiledGrammar, Matcher
from mmserve.protocol import Grammar

if TYPE_CHECKING:
    import torch


class GrammarRejected(RuntimeError):
    """A token the grammar does not allow was handed to it: a sampler's fault (the mask holds
    every token it may choose), or a history from elsewhere under another grammar."""


class Constraint:
    """A choice's matcher, and whether the grammar has started."""

    def __init__(self, compiled: CompiledGrammar, start_after: int | None = None) -> None:
        self._compiled = compiled
        self._matcher: Matcher = compiled.matcher()
        self._start_after = start_after
        self.started = start_after is None

    @classmethod
    def resume(
        cls, compiled: CompiledGrammar, grammar: Grammar, tokens: Sequence[int]
    ) -> Constraint:
        """A constraint at the grammar's start, advanced over `tokens` (a choice's tokens so
        far); `GrammarRejected` when they do not follow the grammar."""
        constraint = cls(compiled, grammar.start_after)
        for token in tokens:
            constraint.observe(token)
        return constraint

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._compiled.stop_ids

    @property
    def terminated(self) -> bool:
        """Whether the grammar ended (a stop token was accepted): the choice is complete."""
        return self.started and self._matcher.terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """The tokens allowed next into `bitmask[row]`; False when any token is (the grammar
        has not started, or allows everything here)."""
        return self.started and self._matcher.fill_bitmask(bitmask, row)

    def only_end(self, row: torch.Tensor) -> bool:
        """Whether a bitmask row `fill` wrote allows nothing but a stop token."""
        words = row.numpy().view(np.uint32).copy()
        for token in self.stop_ids:
            words[token // 32] &= ~np.uint32(1 << (token % 32))
        return not words.any()

    def observe(self, token: int) -> None:
        """Advance over `token`, the choice's next."""
        if not self.started:
            self.started = token == self._start_after
            return
        if not self._matcher.accept(token):
            raise GrammarRejected(f"token {token} does not follow the request's grammar")
