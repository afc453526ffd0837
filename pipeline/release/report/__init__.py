"""The report stage: ``report/index.html``, ``index.md`` and ``summary.json``, made from the stages' manifests.

``document`` (the block model and its Markdown / HTML rendering), ``workdir`` (lenient readers of the work dir),
``summary`` (summary.json, the five lines, the hash chain), ``sections`` (one section per stage) and ``stage``
(``render`` and the stage entry point ``write_report``).
"""
