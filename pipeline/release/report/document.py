"""One document, two renderings: a list of blocks rendered both as Markdown and as HTML, so the two say the same.

Also how a value looks on the page (``fmt``, ``mib``, ``short_hash``, ``mark``) and the page's CSS.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline import artifacts

NOT_RUN = "not run"


@dataclass
class Doc:
    """Blocks rendered both as Markdown and as HTML."""

    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", (level, text)))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def bullets(self, items: list[str]) -> None:
        self.blocks.append(("ul", items))

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        self.blocks.append(("table", (header, rows)))

    def kv(self, pairs: list[tuple[str, Any]]) -> None:
        self.table(["", ""], [[k, v] for k, v in pairs])

    def image(self, src: str, alt: str) -> None:
        self.blocks.append(("img", (src, alt)))

    def code(self, text: str) -> None:
        self.blocks.append(("pre", text))

    def not_run(self, stage: str) -> None:
        task = artifacts.STAGE_TASK.get(stage, stage)
        self.p(f"**{NOT_RUN}**: the `{stage}` stage has no manifest in this work dir (`invoke {task}` runs it).")

    def markdown(self) -> str:
        out = []
        for kind, arg in self.blocks:
            if kind == "h":
                out.append("#" * arg[0] + " " + arg[1])
            elif kind == "p":
                out.append(arg)
            elif kind == "ul":
                out.append("\n".join(f"- {i}" for i in arg))
            elif kind == "table":
                header, rows = arg
                cell = lambda v: fmt(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
                lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
                lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
                out.append("\n".join(lines))
            elif kind == "img":
                out.append(f"![{arg[1]}]({arg[0]})")
            elif kind == "pre":
                out.append("```\n" + arg.rstrip("\n") + "\n```")
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        body = []
        for kind, arg in self.blocks:
            if kind == "h":
                level, text = arg
                anchor = f' id="{_slug(text)}"' if level == 2 else ""
                body.append(f"<h{level}{anchor}>{_inline(text)}</h{level}>")
            elif kind == "p":
                body.append(f"<p>{_inline(arg)}</p>")
            elif kind == "ul":
                body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in arg) + "</ul>")
            elif kind == "table":
                header, rows = arg
                head = "" if not any(header) else \
                    "<thead><tr>" + "".join(f"<th>{_inline(fmt(h))}</th>" for h in header) + "</tr></thead>"
                trs = "".join("<tr>" + "".join(f"<td>{_inline(fmt(v))}</td>" for v in r) + "</tr>" for r in rows)
                body.append(f"<table>{head}<tbody>{trs}</tbody></table>")
            elif kind == "img":
                body.append(f'<figure><img src="{html.escape(arg[0])}" alt="{html.escape(arg[1])}">'
                            f"<figcaption>{html.escape(arg[1])}</figcaption></figure>")
            elif kind == "pre":
                body.append(f"<pre>{html.escape(arg)}</pre>")
        toc = "".join(f'<a href="#{_slug(a[1])}">{html.escape(a[1])}</a>' for k, a in self.blocks
                      if k == "h" and a[0] == 2)
        return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
                f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body><nav>{toc}</nav>"
                f"<main>\n" + "\n".join(body) + "\n</main></body></html>\n")


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#1d2330;margin:0;background:#f6f7f9}
nav{position:sticky;top:0;background:#1d2330;padding:6px 16px;z-index:1}
nav a{color:#cfd6e4;margin-right:14px;text-decoration:none;font-size:12px}
main{max-width:1180px;margin:0 auto;padding:8px 24px 48px;background:#fff}
h1{font-size:24px;margin:18px 0 6px}
h2{font-size:19px;margin:30px 0 8px;border-bottom:2px solid #e3e6ec;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;margin:8px 0 14px;font-size:12.5px;display:block;overflow-x:auto}
th,td{border:1px solid #dde1e8;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5}tbody tr:nth-child(even){background:#fafbfc}
code{background:#eef1f5;padding:0 3px;border-radius:3px;font-size:12px;overflow-wrap:anywhere}
pre{background:#f0f2f5;padding:8px;overflow-x:auto;font-size:12px}
figure{margin:10px 0}img{max-width:100%;border:1px solid #e3e6ec}figcaption{font-size:12px;color:#5a6272}
.ok{color:#1e7d32;font-weight:600}.bad{color:#c62828;font-weight:600}
"""


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


_LINK = re.compile(r"\[([^\]`]+)\]\(([A-Za-z0-9_./#-]+)\)")


def _inline(text: str) -> str:
    """HTML for the little Markdown the report uses: `code`, **bold**, [links](href), ✓/✗ marks."""
    out, i = [], 0
    s = html.escape(text, quote=False)
    while i < len(s):
        link = _LINK.match(s, i)
        if link:
            out.append(f'<a href="{html.escape(link.group(2))}">{link.group(1)}</a>')
            i = link.end()
        elif s[i] == "`" and "`" in s[i + 1:]:
            j = s.index("`", i + 1)
            out.append(f"<code>{s[i + 1:j]}</code>")
            i = j + 1
        elif s.startswith("**", i) and "**" in s[i + 2:]:
            j = s.index("**", i + 2)
            out.append(f"<strong>{s[i + 2:j]}</strong>")
            i = j + 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out).replace("✓", '<span class="ok">✓</span>').replace("✗", '<span class="bad">✗</span>')


# ---------------------------------------------------------------- values as the page shows them


def fmt(v: Any) -> str:
    """A value as a table cell or a sentence shows it (None: a dash; floats to 4 significant digits)."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10000 else str(v)
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt(x) for x in v)
    if isinstance(v, dict):
        return ", ".join(f"{k}: {fmt(x)}" for k, x in v.items())
    return str(v)


def mib(n: Optional[float]) -> str:
    return "—" if n is None else f"{n / 2**20:,.1f} MiB"


def short_hash(h: Optional[str]) -> str:
    return f"`{h[:16]}…`" if h else "—"


def mark(ok: Optional[bool]) -> str:
    return "—" if ok is None else ("✓" if ok else "✗")
