"""The settings reference, read from ``conf/``: every config group, its options, and every key with the comment its
yaml file gives it. Two readers: ``--help`` of every command (``ringdit.commands.cli``), and the generated pages of the docs:

    python -m ringdit.reference          # rewrites docs/reference/configuration.md and docs/reference/cli.md
    python -m ringdit.reference --check  # exit 1 if either differs from what conf/ and the commands give now

The yaml files are shown as written (comments are the documentation), minus their ``defaults:`` lists, which become
the "inherits" and "default option" lines instead.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
DOCS_DIR = Path(__file__).resolve().parents[1] / "docs" / "reference"



def commands() -> dict[str, str]:
    """Each conf/<name>.yaml that configures a command -> how a user runs it, train and infer first."""
    return {"train": "python train.py", "infer": "python infer.py", "export": "python -m ringdit.export",
            "prepare": "python -m ringdit.prepare", "decode": "python -m ringdit.media.decode",
            "plan": "python -m ringdit.plan", "calibrate": "python -m ringdit.caching calibrate",
            "serve": "python -m ringdit.serve"}


@dataclass(frozen=True)
class Group:
    name: str            # "model", or "trainer/strategy" for a group nested in another
    default: str | None  # the option selected when the command line names none (None: nothing, e.g. experiment)
    options: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.name.replace("/", ".")


def yaml_body(path: Path) -> str:
    """The file's text without its ``defaults:`` list (and without Hydra's ``# @package`` line)."""
    lines, in_defaults = [], False
    for line in path.read_text().splitlines():
        in_defaults = line.startswith("defaults:") or (in_defaults and line.startswith((" ", "-")))
        if not in_defaults and not line.startswith("# @package"):
            lines.append(line)
    return "\n".join(lines).strip("\n")


@functools.lru_cache(maxsize=None)  # read many times per page; conf/ does not change while a page is made
def _defaults(path: Path) -> tuple:
    return tuple(OmegaConf.to_container(OmegaConf.load(path)).get("defaults") or [])


def defaults_list(path: Path) -> list:
    return list(_defaults(path))


def is_global(path: Path) -> bool:
    """A ``# @package _global_`` file sets top-level keys (parallel/, experiment/), not keys under its group's name."""
    return path.read_text().startswith("# @package _global_")


def options(group: str) -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml")))


def command_groups(config_name: str) -> list[Group]:
    """The groups ``conf/<config_name>.yaml`` selects from (Hydra's own ``hydra`` group aside), with the groups their
    default options select in turn (``trainer/strategy``), in the order of the defaults lists."""
    groups: list[Group] = []

    def add(name: str, default: str | None) -> None:
        groups.append(Group(name, default, options(name)))
        for option in [default, *inherited(name, default)] if default else []:  # trainer=gpu builds on default
            for entry in defaults_list(CONF_DIR / name / f"{option}.yaml"):
                if isinstance(entry, dict):  # {"strategy": "ddp"}: a group nested in this one
                    (sub, choice), = entry.items()
                    if (CONF_DIR / name / sub).is_dir():
                        add(f"{name}/{sub}", choice)

    for entry in defaults_list(CONF_DIR / f"{config_name}.yaml"):
        if isinstance(entry, dict):
            (name, default), = entry.items()
            if name.startswith("override "):  # `override trainer/strategy: null`: another default for that group
                name = name.split()[-1].lstrip("/")
                groups = [Group(name, default, g.options) if g.name == name else g for g in groups]
            elif name != "hydra":
                add(name, default)
    return groups


def inherited(group: str, option: str) -> list[str]:
    """The options of the same group that ``option`` builds on (``wan_14b`` -> ``wan``), nearest first."""
    chain, current = [], option
    while True:
        bases = [e for e in defaults_list(CONF_DIR / group / f"{current}.yaml") if isinstance(e, str) and e != "_self_"]
        if not bases:
            return chain
        current = bases[0]
        chain.append(current)


def indented(text: str, levels: int) -> str:
    pad = "  " * levels
    return "\n".join(pad + line if line else line for line in text.splitlines())


def option_settings(group: Group, option: str) -> str:
    """The keys ``group=option`` sets, as yaml under the group's key (``trainer:`` / ``strategy:``), with comments."""
    path = CONF_DIR / group.name / f"{option}.yaml"
    body = yaml_body(path)
    if is_global(path):
        return body
    parts = group.name.split("/")
    head = "\n".join("  " * level + f"{part}:" for level, part in enumerate(parts))
    return f"{head}\n{indented(body, len(parts))}" if body else f"{head} {{}}"


def help_settings(config_name: str, choices: dict | None = None) -> str:
    """What ``--help`` shows after the command's own description: its groups and options, its settings, and the
    settings of each group's chosen option, all with their comments. ``choices``: the option of each group the
    command line composes (Hydra's ``runtime.choices``: ``experiment=wan21_14b_lora --help`` shows the experiment's
    own settings and the model, data ... options it picks); None: the defaults."""
    out = []
    groups = command_groups(config_name)
    chosen = {group.key: (choices or {}).get(group.name, group.default) for group in groups}
    if groups:
        out.append("== Groups (group=option on the command line; the default in [brackets]) ==\n")
        width = max(len(g.key) for g in groups)
        for group in groups:
            names = " ".join(f"[{o}]" if o == group.default else o for o in group.options)
            out.append(textwrap.fill(names, 118, initial_indent=f"{group.key:<{width}}  ",
                                     subsequent_indent=" " * (width + 2), break_on_hyphens=False))
        out.append("")
    out.append(f"== Settings (key=value on the command line; ??? = required): conf/{config_name}.yaml ==\n")
    out.append(yaml_body(CONF_DIR / f"{config_name}.yaml"))
    picked = [group for group in groups if chosen[group.key] != group.default and chosen[group.key] is not None]
    # the command line's choices first, one that sets top-level keys (an experiment) before the options it picks
    picked.sort(key=lambda group: not is_global(CONF_DIR / group.name / f"{chosen[group.key]}.yaml"))
    if picked:
        wins = "; the experiment's settings win over those of the options it picks, shown after it" \
            if is_global(CONF_DIR / picked[0].name / f"{chosen[picked[0].key]}.yaml") else ""
        out.append(f"\n(first the options this command line picks: "
                   f"{', '.join(f'{g.key}={chosen[g.key]}' for g in picked)}{wins})")
    for group in [*picked, *(group for group in groups if group not in picked)]:
        option = chosen[group.key]
        if option is None or not (CONF_DIR / group.name / f"{option}.yaml").is_file():
            continue
        path = CONF_DIR / group.name / f"{option}.yaml"
        how = "top-level keys: KEY=value" if is_global(path) else f"override as {group.key}.KEY=value"
        out.append(f"\n== {group.key}={option} (conf/{group.name}/{option}.yaml; {how}) ==\n")
        for base in inherited(group.name, option):
            out.append(f"# builds on {group.key}={base}, whose settings follow it")
        out.append(option_settings(group, option))
        for base in inherited(group.name, option):
            out.append(f"# from {group.key}={base}:")
            out.append(option_settings(group, base))
    if groups:
        out.append("\nEvery other option's settings: docs/reference/configuration.md (or --cfg job with the option "
                   "selected).")
    return "\n".join(out).replace("$", "$$")  # Hydra's help template is a string.Template


# ---- the generated pages -------------------------------------------------------------------------------------------

GENERATED = "<!-- Generated by `python -m ringdit.reference` from conf/; do not edit by hand. -->\n\n"


def all_groups() -> list[str]:
    """Every group folder of conf/ (nested ones as ``trainer/strategy``), Hydra's own aside."""
    return sorted(str(p.relative_to(CONF_DIR)) for p in CONF_DIR.glob("**/") if p != CONF_DIR and
                  any(p.glob("*.yaml")) and p.name != "hydra")


def configuration_page() -> str:
    lines = [GENERATED, "# Configuration reference\n",
             "Every setting of every command, read from `conf/`: the yaml files as written, their comments "
             "included. A command's own settings are `key=value` on its command line; a group's option is picked "
             "with `group=option` and its keys are set with `group.key=value`; an option that *builds on* another "
             "gets that one's keys too. `--cfg job` prints what a command line composes to.\n"]
    lines.append("## Commands\n")
    for name, command in commands().items():
        groups = command_groups(name)
        lines.append(f"### {command}\n")
        lines.append(f"`conf/{name}.yaml`.")
        if groups:
            used = ", ".join(f"[`{g.key}`](#{_anchor(g.name)})" + (f" (default `{g.default}`)" if g.default else "")
                             for g in groups)
            lines.append(f" Groups: {used}.")
        lines.append("\n\n```yaml\n" + yaml_body(CONF_DIR / f"{name}.yaml") + "\n```\n")
    lines.append("## Groups\n")
    for group_name in all_groups():
        group = Group(group_name, None, options(group_name))
        users = [run for name, run in commands().items() if any(g.name == group_name for g in command_groups(name))]
        lines.append(f"### {group.key}\n")
        lines.append(f"Options: {', '.join(f'`{o}`' for o in group.options)}. Used by: "
                     f"{', '.join(f'`{u}`' for u in users) or 'experiments'}.\n")
        for option in group.options:
            path = CONF_DIR / group_name / f"{option}.yaml"
            lines.append(f"#### {group.key}={option}\n")
            notes = []
            if inherited(group_name, option):
                notes.append("Builds on " + ", then ".join(f"`{group.key}={b}`" for b in inherited(group_name, option)))
            overrides = [e for e in defaults_list(path) if isinstance(e, dict)]
            for entry in overrides:
                (key, value), = entry.items()
                notes.append(f"Selects `{key.split()[-1].lstrip('/')}={value}`")
            if is_global(path):
                notes.append("Sets top-level keys")
            if notes:
                lines.append("; ".join(notes) + ".\n")
            lines.append("```yaml\n" + (option_settings(group, option) or "{}") + "\n```\n")
    return "\n".join(lines).rstrip() + "\n"


def _anchor(group_name: str) -> str:
    """The id mkdocs (Python-Markdown's toc) gives the heading ``### trainer.strategy``."""
    return group_name.replace("/", "").replace(".", "")


def help_output(command: str) -> str:
    """What ``command --help`` prints, run in this process (every command's ``main`` takes its argv)."""
    import importlib
    import runpy

    from hydra.core.global_hydra import GlobalHydra

    words = command.split()
    if words[1] == "-m":  # python -m package [subcommand]: main lives in package.subcommand and reads it first
        module, sub = words[2], words[3:]
        main = importlib.import_module(".".join([module, *sub])).main
        argv = [*sub, "--help"]
    else:  # python train.py: a script, not a module
        main, argv = runpy.run_path(str(CONF_DIR.parent / words[1]), run_name="help")["main"], ["--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            main(argv)
    except SystemExit:
        pass
    finally:
        GlobalHydra.instance().clear()
    return out.getvalue().rstrip() + "\n"


def cli_page() -> str:
    lines = [GENERATED, "# CLI reference\n",
             "What each command prints for `--help`. The settings are those of the "
             "[configuration reference](configuration.md); every command takes `--cfg job` (print the composed "
             "settings) and reports a mistake in the settings as one line with exit code 2 "
             "(`HYDRA_FULL_ERROR=1` shows the traceback).\n"]
    for command in commands().values():
        lines.append(f"## {command}\n")
        lines.append(f"```text\n$ {command} --help\n{help_output(command)}```\n")
    return "\n".join(lines).rstrip() + "\n"


PAGES = {"configuration.md": configuration_page, "cli.md": cli_page}


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    stale = []
    for name, make in PAGES.items():
        path, text = DOCS_DIR / name, make()
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python -m ringdit.reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
