"""The bench stage (``stage.run_bench``): a closed-loop concurrency sweep of the published model on Triton.

Modules, lowest first: ``stats`` (percentiles, knee, ratios), ``load`` (prompts, the gRPC streaming client),
``metrics`` (Triton's counters), ``plots``, ``target`` (one build under load), ``stage``.
"""
