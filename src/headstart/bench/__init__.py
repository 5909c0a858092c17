"""``headstart bench``: compare OpenAI-compatible servers on time to first token and decode.

An arm is a server, given as a URL or as a command started fresh per arm per order. Each arm
gets the same workload (per prompt: one cold request, then bursts at 1 and N streams) in
alternating orders; every request is timed on the client's clock and written as a raw row to
a receipt folder together with output fingerprints and the environment. Summaries, ratios
between arms and the printed table are derived from those rows only, so
``headstart bench check RECEIPT`` can recompute and verify all of them.

``headstart bench --scenario long|burst|turn|beside`` runs a prefill scenario instead: token-id
prompts of exact lengths, each new to the server (one long prompt; a burst of new prompts;
a new turn on a cached history; a long prompt arriving beside decoding streams), timed the
same way, with the arrival time of every streamed delta kept in its receipt.

Modules: ``command`` (CLI), ``runner`` (orchestration), ``arms`` (servers and processes),
``workload`` (prompts and request bodies), ``client`` (timing one request or burst),
``rows`` (the row schema), ``summary``/``agreement`` (derived numbers), ``receipt``
(the folder), ``env`` (environment and hashes), ``plot``, ``check``; for scenarios,
``scenarios`` (what is sent), ``scenario_run`` (sending it), ``scenario_summary`` (records
and derived numbers), ``scenario_check``.

Non-goals: load generation at a request *rate* (ShareGPT-style open-loop traffic), accuracy
evaluation, or profiling inside a server.

Importing this package is cheap on purpose: ``headstart.cli`` imports ``command`` to build
its parser; everything else loads only when a bench runs.
"""

from __future__ import annotations
