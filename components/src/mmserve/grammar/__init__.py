"""Grammar-constrained decoding (vLLM's structured outputs): a completion's tokens held to a
JSON Schema, a regex, a list of choices or an EBNF grammar (`protocol.Grammar`).

One small interface (`base`) over a backend (`xgrammar_backend`, xgrammar, as vLLM and SGLang
use it): a tokenizer-free check that the frontend runs before anything is scheduled (`check`),
and per tokenizer a compiler whose compiled grammars give one matcher per choice. Engines
hold a `GrammarCache` (compiled grammars by spec, compiled in a thread under a timeout), each
choice a `Constraint` (the matcher, free until the grammar's `start_after` token), and apply
its token bitmask to the logits (`mask`). `GrammarCache.constraint(grammar, tokens)` rebuilds
a choice's constraint from the tokens it already holds: a decode worker after a prefill, a
request moved to another worker.

The package's root imports nothing, so the command lines read `defaults` without torch.
"""
