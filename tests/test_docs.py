"""The docs cannot go stale.

- Every code block titled ``runs on a CPU`` in docs/ runs as written (docs/contributing.md, "The docs"): a page's
  blocks in order, in one fresh folder, the entry points in this process (no new interpreter to pay for), with the
  overrides of the block titled ``appended by the doc tests`` (shown on docs/tutorials.md) added to ``train.py`` and
  ``infer.py`` lines so that the runs take seconds.
- The generated reference pages equal what ``python -m ringdit.reference`` makes from conf/ and the commands now.
- mkdocs.yml lists every page, and the README stays a short entry point that links into them.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

DOCS = REPO / "docs"
CPU_TITLE = 'title="runs on a CPU"'
SHORT_TITLE = 'title="appended by the doc tests"'
# ```lang attributes\n body ``` (a block may be indented, inside an admonition)
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>\w+)(?P<attrs>[^\n]*)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


def blocks(page: Path, title: str) -> list[tuple[str, str]]:
    """(language, code) of the page's blocks with ``title``, their indentation removed."""
    found = []
    for match in FENCE.finditer(page.read_text()):
        if title in match["attrs"]:
            indent = len(match["indent"])
            found.append((match["lang"], "\n".join(line[indent:] for line in match["body"].splitlines())))
    return found


def shortening() -> dict[str, list[str]]:
    """``{"train.py": [overrides], "infer.py": [...]}`` from the block the tutorials page shows."""
    (_, text), = blocks(DOCS / "tutorials.md", SHORT_TITLE)
    return {script: shlex.split(overrides) for script, overrides in (line.split(":", 1) for line in text.splitlines())}


def commands(code: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = code.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def pages_with_cpu_blocks() -> list[str]:
    return sorted(str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md") if blocks(page, CPU_TITLE))


def run_in_process(argv: list[str]) -> tuple[int, str]:
    """``python ...`` as its command line would run it, in this process: (exit code, output)."""
    from hydra.core.global_hydra import GlobalHydra

    out, saved_argv, saved_env = io.StringIO(), sys.argv, dict(os.environ)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if argv[0] == "-c":
                exec(compile(argv[1], "<python -c>", "exec"), {"__name__": "__main__"})
            elif argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                script = Path(argv[0]) if Path(argv[0]).exists() else REPO / argv[0]  # repo scripts from anywhere
                sys.argv = [str(script), *argv[1:]]
                runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:  # Lightning's launcher leaves LOCAL_RANK, NODE_RANK, MASTER_* in the environment of the process it ran in
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        GlobalHydra.instance().clear()
    return code, out.getvalue()


def run_command(line: str, short: dict[str, list[str]]) -> tuple[int, str]:
    words = shlex.split(line)
    if words[0] != "python":  # not an entry point of ours: a real shell
        proc = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120)
        return proc.returncode, proc.stdout + proc.stderr
    argv = words[1:]
    script = Path(argv[0]).name
    return run_in_process(argv + short.get(script, []))


@pytest.mark.parametrize("page", pages_with_cpu_blocks())
def test_the_cpu_commands_of_a_page_run_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths (outputs/, first.png) as in a fresh folder
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("PROJECT_ROOT", raising=False)  # paths.root_dir: where the command runs
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    short = shortening()
    for language, code in blocks(DOCS / page, CPU_TITLE):
        if language == "python":
            code_, output = run_in_process(["-c", code])
            assert code_ == 0, f"{page}: the python block failed:\n{output[-3000:]}"
            continue
        for line in commands(code):
            code_, output = run_command(line, short)
            assert code_ == 0, f"{page}: `{line}` exited {code_}:\n{output[-3000:]}"


def test_the_shortening_is_shown_where_the_tests_use_it():
    short = shortening()
    assert set(short) == {"train.py", "infer.py"} and all(short.values())


def test_the_reference_pages_are_generated_from_conf():
    """docs/reference/ is what ``python -m ringdit.reference`` makes now: a changed yaml comment, option or command
    help fails here until the pages are generated again."""
    from ringdit import reference

    for name, make in reference.PAGES.items():
        path = DOCS / "reference" / name
        assert path.read_text() == make(), f"{path} is out of date: run python -m ringdit.reference"


def test_every_page_is_in_the_navigation():
    nav = set(re.findall(r"([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M))
    pages = {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}
    assert pages <= nav, f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"


def test_the_readme_is_short_and_links_into_the_docs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    links = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    for link in links:
        assert (REPO / link).exists(), f"README links to {link}, which does not exist"
    guide = {f"docs/{page.relative_to(DOCS)}" for page in [*DOCS.glob("*.md"), *DOCS.glob("recipes/*.md")]}
    assert not guide - links, f"user-guide pages the README does not link: {sorted(guide - links)}"
    assert 'pip install torch==2.13.0 && pip install -e ".[dev]" && python train.py' in readme
    assert "python -m pytest -q" in readme


def test_help_shows_the_settings_the_command_line_composes(capsys):
    """``train.py experiment=wan21_14b_lora --help`` shows the experiment's settings and the options it picks (the
    Wan 14B model, text latents), not the digits' defaults."""
    from tests.helpers import in_process

    proc, _ = in_process("train.py", "experiment=wan21_14b_lora", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = proc.stdout
    for section in ("== experiment=wan21_14b_lora (conf/experiment/wan21_14b_lora.yaml", "== model=wan_14b (",
                    "== data=text_latents ("):
        assert section in shown, section
    assert shown.index("== experiment=wan21_14b_lora") < shown.index("== model=wan_14b")
    assert "== model=dit_digits" not in shown and "== data=digits " not in shown


def written_prompt_lists() -> list[tuple[str, str]]:
    """(where, override) of every ``prompts=`` list written on an ``infer.py`` line of the docs, the README, conf/'s
    comments and ringdit's docstrings (lines that build it from a shell variable, ``$P``, excepted)."""
    found = []
    files = [*DOCS.rglob("*.md"), REPO / "README.md", *(REPO / "conf").rglob("*.yaml"), *(REPO / "ringdit").rglob("*.py")]
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "infer.py" not in line or "prompts=" not in line or "$" in line:
                continue
            command = line[line.index("infer.py"):].split("#")[0].rstrip(" |`")
            with contextlib.suppress(ValueError):  # a line of prose, not a command: nothing to check
                for word in shlex.split(command):
                    if word.startswith("prompts=[") and "," in word:
                        found.append((f"{path.relative_to(REPO)}:{number}", word))
    return found


def test_every_written_list_of_prompts_is_one_infer_takes():
    """infer.py refuses a list of several prompts with an unquoted one (Hydra would split it at its commas): the
    commands the docs teach must not be refused."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ringdit.common.errors import ConfigError
    from ringdit.spec.infer import check_prompt_list

    written = written_prompt_lists()
    assert any("captioned_moving_digits" in where for where, _ in written)  # the conf comments are read
    refused = []
    for where, word in written:
        value = OverridesParser.create().parse_overrides([word])[0].value()
        try:
            check_prompt_list(value, [word])
        except ConfigError as error:
            refused.append(f"{where}: {error}")
    assert not refused, "\n".join(refused)
