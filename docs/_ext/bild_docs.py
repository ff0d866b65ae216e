"""Pages generated from the code at build time, so that the documentation cannot drift from it.

A Markdown page asks for generated text with a MyST comment line (ignored where this extension is absent):

    % bild-docs: env-spec bild_env.env.BildEnv config=bild_env.env.EnvConfig
    % bild-docs: config-table agents.bild.comparison.EvalConfig
    % bild-docs: cli-options agents.bild.training:build_parser
    % bild-docs: presets bild_env.models.pairs:PRESETS
    % bild-docs: module-doc agents.serve.rules

``env-spec`` renders an environment's class docstring (Gymnasium's sections, written in Markdown) as the page's
sections, with the table of every argument (its config dataclass) under "Arguments"; a missing section stops the
build. ``config-table`` is a dataclass's fields with their types, defaults and ``metadata["help"]`` (the same
text ``--help`` shows, ``bild_env.cli.field_help``). ``cli-options`` is every option group of an argparse
parser (the trainers' ``build_parser``, themselves generated from the dataclasses). ``presets`` is the table of
model-pair presets. ``module-doc`` is a module's docstring. autodoc pages get the same field comments as the
documentation of dataclass attributes, and the env classes' summaries (their full spec is their own page).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from typing import Any

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

MARKER = re.compile(r"^% bild-docs: (?P<kind>[\w-]+) (?P<args>.+?)\s*$", re.M)
ENV_SECTIONS = ("Action Space", "Observation Space", "Rewards", "Starting State", "Episode End", "Arguments",
                "Version History")


def resolve(path: str) -> Any:
    """``pkg.module.Name`` or ``pkg.module:attr`` (an attribute path after the colon)."""
    if ":" in path:
        module, attr = path.split(":", 1)
    else:
        module, _, attr = path.rpartition(".")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def cell(text: Any) -> str:
    """Text safe inside a Markdown table cell (pipes escaped, one line)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def md_text(text: Any) -> str:
    """Plain text (a field comment, an option's help) as Markdown that shows it as written: code spans kept,
    emphasis, link and HTML characters escaped elsewhere; safe in a table cell."""
    parts = re.split(r"(`+[^`]*`+)", " ".join(str(text).split()))
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"([\\*_\[\]<>])", r"\\\1", parts[i])
    return "".join(parts).replace("|", "\\|")


def code(text: Any) -> str:
    text = cell(text)
    return f"``{text}``" if "`" in text else f"`{text}`"


# ----------------------------------------------------------------------------------------------------------------
# generators: each returns Markdown text
def env_spec(path: str, config: str | None = None) -> str:
    """The class docstring of an env as sections: the text before its first ``## `` heading becomes
    "Description"; the config dataclass's table goes at the end of "Arguments"."""
    cls = resolve(path)
    doc = inspect.getdoc(cls) or ""
    parts = re.split(r"^## +(.+?)\s*$", doc, flags=re.M)
    sections = {"Description": parts[0].strip()}
    for title, body in zip(parts[1::2], parts[2::2]):
        sections[title.strip()] = body.strip()
    missing = [s for s in ENV_SECTIONS if s not in sections]
    if missing:
        raise ExtensionError(f"{path}'s docstring lacks the section(s) {missing}: every env page has Gymnasium's "
                             f"sections {list(ENV_SECTIONS)} (write them as '## <name>' in the class docstring)")
    if config:
        sections["Arguments"] += "\n\n" + config_table(config)
    return "\n\n".join(f"## {title}\n\n{body}" for title, body in sections.items()) + "\n"


def config_table(path: str, skip: str = "") -> str:
    """A dataclass's fields: name, type, default and the field's help (``bild_env.cli.field_help``)."""
    from bild_env.cli import field_help

    cls = resolve(path)
    if not dataclasses.is_dataclass(cls):
        raise ExtensionError(f"config-table: {path} is not a dataclass")
    comments = field_help(cls)
    skipped = set(filter(None, skip.split(",")))
    rows = ["| argument | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in skipped:
            continue
        if f.default is not dataclasses.MISSING:
            default = code(repr(f.default))
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = code(repr(f.default_factory()))  # type: ignore[misc]
        else:
            default = "(required)"
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        note = "" if f.metadata.get("cli", True) else " (Python only, no command-line option)"
        rows.append(f"| `{f.name}` | {code(kind)} | {default} | {md_text(comments.get(f.name, ''))}{note} |")
    return "\n".join(rows) + "\n"


def cli_options(path: str) -> str:
    """Every option group of the parser ``path`` builds: a heading, its description and a table of options."""
    parser = resolve(path)()
    if not isinstance(parser, argparse.ArgumentParser):
        raise ExtensionError(f"cli-options: {path}() returned {type(parser).__name__}, not an ArgumentParser")
    out = []
    for group in parser._action_groups:  # argparse keeps its groups there; it has no public accessor
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = "general options" if group.title in ("options", "optional arguments") else group.title
        out.append(f"### {title}\n")
        if group.description:
            out.append(md_text(group.description) + "\n")
        out += ["| option | meaning |", "|---|---|"]
        for a in actions:
            names = " ".join(a.option_strings) or a.dest
            if isinstance(a, argparse.BooleanOptionalAction):
                names = " / ".join(a.option_strings)
            text = (a.help or "").replace("%%", "%")
            out.append(f"| {code(names)} | {md_text(text)} |")
        out.append("")
    return "\n".join(out)


def presets(path: str) -> str:
    table = resolve(path)
    rows = ["| preset | what it is | prompts | offline | dtype | lean forward | draft head |", "|---|---|---|---|---|---|---|"]
    for name in sorted(table):
        p = table[name]
        head = f"{p.draft_vocab:,} ids" if p.draft_vocab else "full"
        rows.append(f"| `{name}` | {md_text(p.description)} | `{p.dataset}` | {'yes' if p.offline else 'no (hub)'} "
                    f"| `{p.dtype}` | `{p.lean}` | {head} |")
    return "\n".join(rows) + "\n"


def module_doc(path: str) -> str:
    return (inspect.getdoc(importlib.import_module(path)) or "") + "\n"


def figures(path: str) -> str:
    """The figures ``path`` (a script with a ``FIGURES`` list, as ``scripts/make_figures.py``) draws: each with the
    result files it reads, the machine they name and the command that made them."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / path
    spec = importlib.util.spec_from_file_location("make_figures", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    out = []
    for f in module.FIGURES:
        machines = sorted({module.machine_of(json.loads((module.ROOT / "results" / s).read_text())) for s in f.sources})
        out += [f"### {f.title}\n", f"![{f.title}](/_static/figures/{f.name})\n",
                f"- file: `docs/_static/figures/{f.name}`",
                f"- drawn from: {', '.join(f'`results/{s}`' for s in f.sources)}",
                f"- machine: {'; '.join(machines)}",
                f"- measured by: `{f.command}`" if "`" not in f.command else f"- measured by: {f.command}"]
        out += [f"- note: {md_text(f.note)}", ""] if f.note else [""]
    return "\n".join(out)


GENERATORS = {"env-spec": env_spec, "config-table": config_table, "cli-options": cli_options, "presets": presets,
              "module-doc": module_doc, "figures": figures}


def expand_marker(match: re.Match) -> str:
    generator = GENERATORS.get(match["kind"])
    if generator is None:
        raise ExtensionError(f"unknown bild-docs generator {match['kind']!r}; known: {sorted(GENERATORS)}")
    args = match["args"].split()
    keywords = dict(a.split("=", 1) for a in args if "=" in a)
    return generator(*[a for a in args if "=" not in a], **keywords)


def expand(app: Sphinx, docname: str, source: list[str]) -> None:
    source[0] = MARKER.sub(expand_marker, source[0])


# ----------------------------------------------------------------------------------------------------------------
# autodoc
ENV_CLASSES = ("bild_env.env.BildEnv", "bild_env.serving.env.ServingEnv")


def process_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Env classes: their summary and a pointer to their page (their docstring is Markdown, rendered there).
    Dataclass fields without a docstring: their help (what ``--help`` shows, ``bild_env.cli.field_help``)."""
    if what == "class" and name in ENV_CLASSES:
        first = inspect.getdoc(obj).split("\n\n", 1)[0].replace("\n", " ")
        page = "bild-v1" if name.endswith("BildEnv") else "bild-serve-v0"
        lines[:] = [first, "", f"The full specification (Gymnasium's sections) is the page :doc:`/environments/{page}`.", ""]
    elif what == "attribute" and not any(line.strip() for line in lines):
        owner_path, _, field_name = name.rpartition(".")
        try:
            owner = resolve(owner_path)
        except (ImportError, AttributeError):
            return
        if dataclasses.is_dataclass(owner):
            from bild_env.cli import field_help

            comment = field_help(owner).get(field_name)
            if comment:
                lines[:] = [rst_text(comment), ""]


def rst_text(text: str) -> str:
    """Plain text as reStructuredText (autodoc's language): no emphasis, substitution or reference markup."""
    text = text.replace("\\", "\\\\").replace("*", "\\*").replace("|", "\\|")
    return re.sub(r"(\w)_(?=\W|$)", r"\1\\_", text)


def setup(app: Sphinx) -> dict:
    app.connect("source-read", expand)
    app.connect("autodoc-process-docstring", process_docstring)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
