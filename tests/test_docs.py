"""The documentation is tested: README.md and docs/*.md.

- every relative link and #anchor resolves (anchors as GitHub derives them from headings);
- every ```python block runs on CPU in a fresh process, the blocks of one page in order in one
  namespace; blocks fenced ```python gpu (they need a GPU, a launcher or real data) are only
  compiled;
- every `launch/<cmd>.py ...`, `ds-pfc-<cmd> ...` and `python -m ds_pfc.<cmd> ...` command line in a
  ```bash block is parsed by that command's own parser, ds_pfc.cli.<cmd>.build_parser();
- the signatures written in the API part of docs/head.md equal inspect.signature of the object.
"""
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
CLIS = ("train", "eval", "export", "bench", "experiments", "selfcheck", "migrate")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^`]*)$")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path):
    """(info string, first line number, text) of every fenced block of a page."""
    out, lines, i = [], page.read_text().split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            fence, info, start, body = m.group(2), m.group(3).strip(), i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                body.append(lines[i])
                i += 1
            out.append((info, start, textwrap.dedent("\n".join(body))))
        i += 1
    return out


def prose(page: Path) -> str:
    """The page without its fenced blocks and inline code spans."""
    text, keep, inside, fence = page.read_text().split("\n"), [], False, ""
    for line in text:
        m = FENCE.match(line)
        if m and not inside:
            inside, fence = True, m.group(2)
            keep.append("")
        elif inside and line.strip().startswith(fence):
            inside = False
            keep.append("")
        else:
            keep.append("" if inside else line)
    return re.sub(r"`[^`\n]*`", "``", "\n".join(keep))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # links keep their text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out, inside, fence = set(), False, ""
    for line in page.read_text().split("\n"):
        m = FENCE.match(line)
        if m and not inside:
            inside, fence = True, m.group(2)
            continue
        if inside:
            inside = not line.strip().startswith(fence)
            continue
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if h:
            s = slug(h.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(page: Path):
    for n, line in enumerate(prose(page).split("\n"), 1):
        for m in LINK.finditer(line):
            yield n, m.group(1)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_resolve(page):
    bad, count = [], 0
    for n, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto:
            continue
        count += 1
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{_rel(page)}:{n}: {target}: no such file")
            continue
        if anchor:
            if dest.suffix != ".md":
                bad.append(f"{_rel(page)}:{n}: {target}: anchor into a non-Markdown file")
            elif anchor not in anchors(dest):
                bad.append(f"{_rel(page)}:{n}: {target}: no heading with anchor #{anchor} in {_rel(dest)}")
    assert not bad, "\n".join(bad)
    if page.name in ("README.md", "index.md"):
        assert count > 10, f"{_rel(page)} should link to the docs pages"


def test_slug_rules():
    assert slug("Using `PartialFC` as a layer") == "using-partialfc-as-a-layer"
    assert slug("IJB-B / IJB-C") == "ijb-b--ijb-c"
    assert slug("Tensor parallelism: two groups") == "tensor-parallelism-two-groups"
    assert slug("What the run writes (under `output_dir`)") == "what-the-run-writes-under-output_dir"


def test_every_docs_page_is_linked_from_the_index():
    index = ROOT / "docs" / "index.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index) if not t.startswith("#")}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p != index and p.resolve() not in linked]
    assert not missing, f"docs/index.md does not link {missing}"


# -- code ------------------------------------------------------------------------------------------

def _python_pages():
    return [p for p in PAGES if any(info.split()[:1] == ["python"] for info, _, _ in blocks(p))]


_RUNNER = r"""
import sys, json, traceback
blocks = json.loads(sys.stdin.read())
ns = {"__name__": "__main__"}
for name, run, src in blocks:
    code = compile(src, name, "exec")
    if run:
        exec(code, ns)
"""


@pytest.mark.parametrize("page", _python_pages(), ids=_rel)
def test_python_blocks(page, tmp_path):
    """Runnable blocks run in order in one namespace; ```python gpu blocks are compiled only."""
    import json

    payload = []
    for info, line, src in blocks(page):
        words = info.split()
        if words[:1] != ["python"]:
            continue
        unknown = set(words[1:]) - {"gpu"}
        assert not unknown, f"{_rel(page)}:{line}: unknown fence option {unknown} (use ```python or ```python gpu)"
        payload.append((f"{_rel(page)}:{line}", "gpu" not in words, src))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(payload), cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"a ```python block of {_rel(page)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def test_gpu_blocks_are_few():
    """Runnable examples are the rule: a page whose only Python needs a GPU is listed here by name."""
    gpu_only = {p.name for p in PAGES
                if any(i.split()[:1] == ["python"] for i, _, _ in blocks(p))
                and all("gpu" in i.split() for i, _, _ in blocks(p) if i.split()[:1] == ["python"])}
    assert gpu_only <= {"deepspeed.md", "evaluation.md"}, gpu_only


# -- commands --------------------------------------------------------------------------------------

def _logical_lines(src: str):
    """Lines of a bash block with backslash continuations joined; heredoc bodies skipped."""
    out, cur, heredoc = [], "", None
    for line in src.split("\n"):
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        m = re.search(r"<<-?\s*'?\"?(\w+)", line)
        if m:
            heredoc = m.group(1)
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def commands(src: str):
    """(cli name, argv, text) of every ds_pfc command in a bash block."""
    for line in _logical_lines(src):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lex.whitespace_split = True
        lex.commenters = "#"
        tokens = list(lex)
        cmd: list[str] = []
        redirected = False
        for tok in tokens + [";"]:
            if tok in (">", ">>", "<", "2>"):           # a redirection: its file is not an argument
                redirected = True
                continue
            if redirected and tok not in (";", "&&", "||", "|", "&"):
                redirected = False
                continue
            if tok in (";", "&&", "||", "|", "&"):
                found = _find_cli(cmd)
                if found:
                    yield found[0], found[1], " ".join(cmd)
                cmd = []
            else:
                cmd.append(tok)


def _find_cli(cmd):
    """Strip env assignments and a `deepspeed [opts]`/`torchrun ...`/`srun ...`/`python` prefix."""
    for i, tok in enumerate(cmd):
        m = re.fullmatch(r"(?:\./)?launch/(\w+)\.py", tok) or re.fullmatch(r"ds-pfc-(\w+)", tok)
        if m and m.group(1) in CLIS:
            return m.group(1), cmd[i + 1:]
        m = re.fullmatch(r"ds_pfc\.(?:cli\.)?(\w+)", tok)
        if m and i > 0 and cmd[i - 1] == "-m" and m.group(1) in CLIS:
            return m.group(1), cmd[i + 1:]
    return None


def _all_commands():
    for page in PAGES:
        for info, line, src in blocks(page):
            if info.split()[:1] in (["bash"], ["sh"], ["shell"]):
                for name, argv, text in commands(src):
                    yield page, line, name, argv, text


def test_command_extraction():
    src = ("OMP_NUM_THREADS=1 deepspeed --num_gpus 8 launch/train.py --deepspeed_config c.json   # GPU\n"
           "torchrun --nnodes 4 --node_rank 0 \\\n    launch/train.py --no_resume\n"
           "python3 -m venv .venv && . .venv/bin/activate && python -m ds_pfc.selfcheck --quick\n"
           "srun --gpu-bind=none ds-pfc-eval --model m.safetensors\n"
           "python launch/demo.py --steps 3\n"
           "ds-pfc-train --schema > schema.json\n")
    assert [(n, a) for n, a, _ in commands(src)] == [
        ("train", ["--deepspeed_config", "c.json"]), ("train", ["--no_resume"]),
        ("selfcheck", ["--quick"]), ("eval", ["--model", "m.safetensors"]), ("train", ["--schema"])]


def test_commands_parse():
    parsers, bad, seen = {}, [], set()
    for page, line, name, argv, text in _all_commands():
        if name not in parsers:
            parsers[name] = importlib.import_module(f"ds_pfc.cli.{name}").build_parser()
        seen.add(name)
        try:
            parsers[name].parse_args(argv)
        except SystemExit as e:
            bad.append(f"{_rel(page)}:{line}: `{text}` does not parse (exit {e.code})")
    assert not bad, "\n".join(bad)
    assert seen == set(CLIS), f"no documented command line for {set(CLIS) - seen}"


def test_a_wrong_flag_is_caught():
    parser = importlib.import_module("ds_pfc.cli.train").build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--deepspeed_configs", "x.json"])


# -- API -------------------------------------------------------------------------------------------

def documented_signatures():
    """`ds_pfc.X(...)` entries of the ```text blocks under docs/head.md's "## API" heading."""
    text = (ROOT / "docs" / "head.md").read_text()
    m = re.search(r"^## API\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, "docs/head.md has no '## API' section"
    page_api = m.group(1)
    out = []
    for fm in re.finditer(r"^```text\n(.*?)^```", page_api, re.S | re.M):
        for entry in re.split(r"\n\s*\n", fm.group(1).strip()):
            joined = " ".join(part.strip() for part in entry.split("\n")).replace("( ", "(")
            em = re.fullmatch(r"(ds_pfc(?:\.\w+)+)(\(.*)", joined)
            assert em, f"not a signature: {entry!r}"
            out.append((em.group(1), em.group(2)))
    return out


def test_api_signatures_match():
    sigs = documented_signatures()
    assert len(sigs) >= 4
    bad = []
    for dotted, written in sigs:
        parts = dotted.split(".")
        obj = importlib.import_module(parts[0])
        for p in parts[1:]:
            obj = getattr(obj, p)
        actual = str(inspect.signature(obj))
        if actual != written:
            bad.append(f"{dotted}\n  docs:   {written}\n  actual: {actual}")
    assert not bad, "docs/head.md's API differs from the code:\n" + "\n".join(bad)
