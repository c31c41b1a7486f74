"""The docs hold against the repo: every repo path README.md, docs/*.md and benchmarks/*.md name exists, and every
CLI verb has the make target `make help` lists for it (`<verb>` or `<group>-<verb>`) and that target runs it."""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
from pathlib import Path

import pytest

from specpilot_build.cli.main import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/*.md", "benchmarks/*.md")
EXTENSIONS = (".md", ".py", ".yaml", ".yml", ".toml", ".json", ".sh", ".cu", ".txt", ".patch")
# Words inside a backticked span that make it something other than one path: placeholders, globs, shell
# variables, Hydra overrides, URLs.
NOT_ONE_PATH = re.compile(r"[\s<>{}*$=~…]|\.\.\.|://")
# Outside the repo by rule: the team's shared folder beside the checkout, the harness's library.
OUTSIDE = ("../shared", ".library", "/")
# Files SpecPilot writes into an engine tree, a bundle, a run's results or a host (not in the repo), named bare.
WRITTEN = {
    "manifest.json": "engines/<id>/",
    "config.json": "engines/<id>/",
    "launch.json": "engines/<id>/",
    "build.json": "a sweep job's Hydra output",
    "index.json": "a bundle's folder",
    "install.py": "a bundle's folder",
    "sitecustomize.py": "put first on a served engine's path by the import audit",
}
BACKTICKED = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def pages() -> list[Path]:
    found = sorted({p for pattern in PAGES for p in REPO.glob(pattern)})
    assert len(found) >= 20, f"only {len(found)} pages matched {PAGES}"
    return found


@functools.cache
def tracked() -> tuple[set[str], set[str], set[str]]:
    """Tracked files and the directories holding them, relative to the repo root (what a fresh clone has). An
    overlay's `files/` mirror a wheel's tree (overlays/w12/files/python/sglang/...): their folders are the wheel's
    names, not the repo's."""
    listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]  # a new page counts before its commit
    out = subprocess.run(listing, cwd=REPO, capture_output=True, text=True, check=True).stdout
    files = set(out.split())
    dirs = {str(parent) for f in files for parent in Path(f).parents if str(parent) != "."}
    own = {d for d in dirs if not re.match(r"overlays/[^/]+/files/.", d)}
    return files, dirs | own, own


def ignored(path: str) -> bool:
    """A path git ignores is output (engines/.objects/, bundles/): named by the docs, never in a clone."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO).returncode == 0


def looks_like_path(text: str) -> bool:
    return "/" in text or text.endswith(EXTENSIONS)


def named_paths(page: Path, text: str | None = None) -> list[tuple[str, str]]:
    """(path relative to the repo root, as written) for every path-like backticked span (read from the root) and
    every relative link (read from the page's folder, as a renderer follows it). Fenced code blocks are commands,
    not references, and are left out."""
    text = FENCE.sub("", page.read_text() if text is None else text)
    found = []
    for span in BACKTICKED.findall(text):
        span = span.strip().rstrip(":,.;")
        if not span or NOT_ONE_PATH.search(span) or span.startswith(OUTSIDE) or re.match(r"-|\.[\w.]+$", span):
            continue
        if looks_like_path(span) and span not in WRITTEN:
            found.append((span.rstrip("/"), span))
    for target in LINK.findall(text):
        target = target.split("#")[0]
        if not target or ":" in target or NOT_ONE_PATH.search(target):
            continue
        resolved = (page.parent / target).resolve()
        try:
            found.append((str(resolved.relative_to(REPO)), target))
        except ValueError:  # leaves the repo: ../shared beside the checkout
            assert str(resolved).startswith(str(REPO.parent / "shared")), f"{page}: link {target} leaves the repo"
    return found


def missing(rel: str) -> str | None:
    """Why `rel` (named from the repo root) is not in a fresh clone, or None where it is. A path whose first folder
    is none of the repo's (a wheel's sglang/srt/..., sgl_kernel/...) names another tree and is not checked; one
    whose first folder is a repo folder below the root (store/names.py) must be written from the root; a bare file
    name must be some tracked file's name."""
    files, dirs, own = tracked()
    if rel in files or rel in dirs or ignored(rel):
        return None
    first = rel.split("/")[0]
    if first in {f.split("/")[0] for f in files}:
        return "not in the repo"
    below = sorted(d for d in own if d.endswith("/" + first))
    if below:
        return f"not in the repo (paths are written from the repo root: {below[0]}/...?)"
    if "/" not in rel:  # a file named bare beside its folder's path (`tuned_h200.json`): some tracked file's name
        return None if any(Path(f).name == rel for f in files | dirs) else "is no tracked file's or folder's name"
    return None


def test_every_repo_path_named_exists() -> None:
    problems, checked = [], 0
    for page in pages():
        for rel, written in named_paths(page):
            checked += 1
            why = missing(rel)
            if why:
                problems.append(f"{page.relative_to(REPO)}: `{written}` {why}")
    assert checked >= 250, f"only {checked} paths found in the pages: the extraction matches too little"
    assert not problems, "\n".join(problems)


def test_extraction_sees_what_it_must() -> None:
    text = (
        "See `conf/setting/` and `kernels/w12/FORMAT.md`, [the verbs](verbs.md), `tuned_h200.json`,\n"
        "`engines/<id>/manifest.json`, `../shared/docs/pins.md`, `drafter.num_draft_tokens=6`, `make engine`,\n"
        "[cosign](https://docs.sigstore.dev), `store/names.py`.\n```bash\npython3 benchmarks/not_read.py\n```\n"
    )
    found = named_paths(REPO / "docs" / "a-page.md", text)
    assert found == [
        ("conf/setting", "conf/setting/"),
        ("kernels/w12/FORMAT.md", "kernels/w12/FORMAT.md"),
        ("tuned_h200.json", "tuned_h200.json"),
        ("store/names.py", "store/names.py"),
        ("docs/verbs.md", "verbs.md"),
    ]
    assert [rel for rel, _ in found if missing(rel)] == ["store/names.py"]  # written from the wrong folder
    assert missing("docs/no-such-page.md") and missing("specpilot_build/no_such.py") and missing("no_such.json")
    assert missing("engines/.objects") is None  # output git ignores


def cli_verbs() -> list[tuple[str, ...]]:
    """Every leaf of the argparse tree: ("serve",), ("engine", "check"), ..."""

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [prefix]
        return [leaf for name, child in subs[0].choices.items() for leaf in walk(child, (*prefix, name))]

    verbs = walk(build_parser(), ())
    assert len(verbs) >= 20, verbs
    return verbs


@functools.cache
def make_help() -> dict[str, str]:
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    targets = dict(re.findall(r"^  make (\S+)\s+(.*)$", out, re.M))
    assert len(targets) >= 20, out
    return targets


@pytest.mark.parametrize("verb", cli_verbs(), ids="-".join)
def test_every_cli_verb_has_its_make_target(verb: tuple[str, ...]) -> None:
    target = "-".join(verb)
    assert target in make_help(), f"`specpilot {' '.join(verb)}` has no `make {target}` in `make help`"
    assert make_help()[target].strip(), f"make {target} has no description"
    plan = subprocess.run(
        ["make", "-n", "-s", target, "ENGINE=abcd", "RUN=r", "STATEMENT=s.json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert re.search(rf"/specpilot {' '.join(verb)}(\s|$)", plan, re.M), f"make {target} runs:\n{plan}"


@pytest.mark.parametrize(("given", "passed"), [(["MAX_NEW_TOKENS=96"], "--max-new-tokens 96"), ([], None)])
def test_make_tune_passes_max_new_tokens_only_when_given(given: list[str], passed: str | None) -> None:
    # bench's default (2048) must not become the tune's: without MAX_NEW_TOKENS the tune keeps its own (128)
    plan = subprocess.run(
        ["make", "-n", "-s", "tune", *given], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    flags = re.findall(r"--max-new-tokens \d+", plan)
    assert flags == ([passed] if passed else []), plan
