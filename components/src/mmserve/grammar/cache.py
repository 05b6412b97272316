"""Compiled grammars for one tokenizer, by spec (LRU, within a byte budget), compiled on
threads of their own under a timeout; and the frontend's tokenizer-free check, under the same.

A compile past the timeout is refused (`GrammarTimeout`) and runs on to its end in its thread
(xgrammar cannot be interrupted; it releases the GIL, so the event loop and the model go on);
its result is kept, and a request for the same spec meanwhile waits on that same compile
rather than starting another, so a hostile spec costs one compile however often it comes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from mmserve.grammar.base import Backend, CompiledGrammar, Compiler, GrammarTimeout
from mmserve.grammar.constraint import Constraint
from mmserve.grammar.defaults import DEFAULT_CACHE_BYTES, DEFAULT_COMPILE_TIMEOUT_S
from mmserve.grammar.xgrammar_backend import XGrammarBackend
from mmserve.protocol import Grammar

COMPILE_THREADS = 2  # compiles at once per cache (and checks at once per frontend)
CHECKED = 1024  # grammars a frontend remembers it checked (a request's form, sent again)


def default_backend() -> Backend:
    return XGrammarBackend()


@functools.cache
def _check_threads() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, "mmserve-grammar-check")


_checked: OrderedDict[Grammar, None] = OrderedDict()


async def check(grammar: Grammar, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
    """Raise `GrammarError` when `grammar` cannot be compiled or enforced, without a
    tokenizer, on a thread (the frontend's validation); one checked lately passes at once."""
    key = _key(grammar)
    if key in _checked:
        _checked.move_to_end(key)
        return
    loop = asyncio.get_running_loop()
    backend = default_backend()
    await loop.run_in_executor(_check_threads(), backend.load)
    work = loop.run_in_executor(_check_threads(), backend.check, grammar)
    try:
        await asyncio.wait_for(asyncio.shield(work), timeout_s)
    except TimeoutError:
        raise GrammarTimeout(_too_long("checking", timeout_s)) from None
    _checked[key] = None
    if len(_checked) > CHECKED:
        _checked.popitem(last=False)


def _too_long(what: str, timeout_s: float) -> str:
    return f"{what} the grammar took longer than {timeout_s:g} s (--grammar-compile-timeout)"


def _key(grammar: Grammar) -> Grammar:
    """What a compile depends on: not where the grammar starts."""
    return msgspec.structs.replace(grammar, start_after=None)


class GrammarCache:
    """One tokenizer's compiled grammars. `new_compiler` makes the backend's compiler (reading
    the vocabulary: ~1 s) on a compile thread, before the first compile and outside its
    timeout."""

    def __init__(
        self,
        new_compiler: Callable[[], Compiler],
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._new_compiler = new_compiler
        self._compiler: asyncio.Future[Compiler] | None = None
        self._threads = concurrent.futures.ThreadPoolExecutor(
            COMPILE_THREADS, "mmserve-grammar-compile"
        )
        self._compiled: OrderedDict[Grammar, CompiledGrammar] = OrderedDict()
        self._bytes = 0
        self._compiling: dict[Grammar, asyncio.Future[CompiledGrammar]] = {}
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: object,
        vocab_size: int,
        stop_ids: Sequence[int],
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        backend: Backend | None = None,
    ) -> GrammarCache:
        chosen = backend or default_backend()
        new = functools.partial(chosen.compiler, tokenizer, vocab_size, tuple(stop_ids))
        return cls(new, timeout_s)

    async def compiled(self, grammar: Grammar) -> CompiledGrammar:
        """`grammar` compiled, from the cache or on a compile thread (within the timeout)."""
        key = _key(grammar)
        found = self._compiled.get(key)
        if found is not None:
            self._compiled.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        loop = asyncio.get_running_loop()
        if self._compiler is None:
            self._compiler = loop.run_in_executor(self._threads, self._new_compiler)
        compiler = await asyncio.shield(self._compiler)
        work = self._compiling.get(key)
        if work is None:
            work = loop.run_in_executor(self._threads, compiler.compile, key)
            self._compiling[key] = work
            work.add_done_callback(functools.partial(self._done, key))
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.timeout_s)
        except TimeoutError:
            raise GrammarTimeout(_too_long("compiling", self.timeout_s)) from None

    async def constraint(self, grammar: Grammar, tokens: Sequence[int] = ()) -> Constraint:
        """A choice's constraint under `grammar`, past `tokens` (those it already holds: the
        prefill's first token on a decode worker, the tokens streamed before a request moved
        here); `GrammarRejected` when they do not follow it."""
        return Constraint.resume(await self.compiled(grammar), grammar, tokens)

    def _done(self, key: Grammar, work: asyncio.Future[CompiledGrammar]) -> None:
        del self._compiling[key]
        if work.cancelled() or work.exception() is not None:
            return
        compiled = work.result()
        if compiled.nbytes > self.max_bytes:
            return
        self._compiled[key] = compiled
        self._bytes += compiled.nbytes
        while self._bytes > self.max_bytes:
            _, evicted = self._compiled.popitem(last=False)
            self._bytes -= evicted.nbytes

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
