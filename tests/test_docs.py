"""The documents stay honest: every command they give names a script that exists and flags its parser accepts, every
relative link resolves, every Python snippet compiles, and the README stays a short guide.

What is checked, and where:
- README.md and docs/**/*.md: every `python <script>.py --flag` and `torchrun ... <script>.py --flag` (in code blocks
  and inline code) names a script that exists and flags that its `--help` lists; in a ```bash block, every --flag
  token must also belong to a script the block runs, to torchrun when it runs torchrun, or to a tool in EXTERNAL
  (flags kept in shell variables are checked this way); `bash <script>.sh` names a script that exists.
- studies/*.sh and studies/slurm/*.sbatch: every --flag token (outside `#SBATCH` lines) belongs to the union of the
  flags of the scripts the file runs, those of a file it sources included.
- README.md and docs/: every relative link and image resolves, to a file and, with a #fragment into a markdown file,
  to one of its headings (GitHub's anchors).
- README.md and docs/: every ```python block compiles, unless its first line is a `# sketch: ...` comment.
- README.md: at most 2,500 words; its first 60 lines hold the quick-start command and the test command; every
  row of the findings table links to a document in docs/.
A script's --help runs once per content (pytest's cache, keyed by the hash of the script, detour.py and HELP_ALSO); the first
run gets every script's --help from one process that imports torch once and forks for each script.
"""
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
SHELL = (sorted((ROOT / "studies").glob("*.sh")) + sorted((ROOT / "studies").rglob("*.sbatch"))
         + sorted((ROOT / "runs").glob("*.sh")))
# Flags of the tools that the documents and scripts call besides this repository's scripts: a --flag in a bash
# block or a study script must be one of these when the tool appears there, or a flag of a script it runs.
EXTERNAL = {
    "pip": {"index-url", "upgrade", "requirement", "quiet"},
    "hf": {"local-dir"},
    "huggingface-cli": {"local-dir"},
    "sbatch": {"array", "nodes", "gres", "dependency", "export", "time", "job-name", "output", "partition",
               "requeue", "ntasks-per-node", "cpus-per-task", "parsable"},
    "srun": {"nodes", "ntasks", "ntasks-per-node", "kill-on-bad-exit", "export", "cpus-per-task"},
    "wget": {"continue"},
    "git": {"depth"},
}
TORCHRUN = "-m torch.distributed.run"   # torchrun's own flags, asked of it like a script's
SCRIPT_RE = r"((?:\.{1,2}/)?[\w./-]+\.py)"
PY_CMD = re.compile(r"(?:^|[\s;&|(`\"'=])python3?\s+(?:-[uBO]\s+)*" + SCRIPT_RE + r"((?:[ \t]+[^\s;&|)`\"'#]+)*)")
TORCHRUN_CMD = re.compile(r"(?:^|[\s;&|(`\"'=])torchrun((?:[ \t]+[^\s;&|)`\"']+)*)")
BASH_CMD = re.compile(r"(?:^|[\s;&|(`])bash\s+([\w./-]+\.sh)\b")
FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)")


def text(path):
    return path.read_text(encoding="utf-8")


def rel(path):
    return path.relative_to(ROOT).as_posix()


# --------------------------------------------------------------------------- what a script accepts

def help_flags(help_text):
    """The option names a --help text lists: argparse's --options, or detour/finetune/analysis' `name = value`
    lines."""
    if "[--key value" in help_text.splitlines()[0]:      # detour.py, finetune.py, studies/analysis.py: a line each
        names = set()
        for line in help_text.splitlines()[1:]:
            m = re.match(r"\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?::\s*[^=#]+)?=(?!=)", line)
            if m:
                names |= {n.strip() for n in m.group(1).split(",")}
        return names | {"help"}
    return set(FLAG.findall(help_text)) | {"help"}


# Scripts whose --help also lists another file's options: studies/analysis.py takes finetune.py's Protocol too.
HELP_ALSO = {"studies/analysis.py": ["finetune.py"]}


def _help_key(script):
    """The files a script's --help depends on: itself, detour.py (presets, constants) for any script, and those
    HELP_ALSO names."""
    h = hashlib.sha256()
    for p in (script, ROOT / "detour.py", *(ROOT / f for f in HELP_ALSO.get(rel(script), []))):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


# Runs `<script> --help` for several scripts in one process: torch is imported once, each script runs in a fork.
HELPER = r'''
import io, os, runpy, sys, json
sys.path.insert(0, os.getcwd())
import torch, numpy  # the slow imports, once; each script's --help then runs in a fork
try:
    import detour, finetune  # noqa: F401  (most scripts import them)
except Exception:
    pass
out = {}
for script in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1); os.dup2(w, 2)
        sys.argv = [script, "--help"]
        code = 0
        try:
            if script.startswith("-m "):
                runpy.run_module(script[3:], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback; traceback.print_exc(); code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code or 0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    out[script] = [os.waitstatus_to_exitcode(status), text]
sys.stdout.write(json.dumps(out))
'''


def run_helps(scripts):
    """script -> its --help text; one process for all of them (forks), else one subprocess each."""
    if hasattr(os, "fork") and scripts:
        out = subprocess.run([sys.executable, "-c", HELPER, *scripts], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        if out.returncode == 0:
            found = json.loads(out.stdout)
            bad = {s: t for s, (rc, t) in found.items() if rc != 0}
            assert not bad, "--help failed:\n" + "\n".join(f"{s}: {t[-1500:]}" for s, t in bad.items())
            return {s: t for s, (rc, t) in found.items()}
    helps = {}
    for s in scripts:
        out = subprocess.run([sys.executable, *s.split(), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"python {s} --help failed:\n{out.stderr[-2000:]}"
        helps[s] = out.stdout
    return helps


def runnable_scripts():
    """Every script of the repository with a command line: what the documents may call."""
    dirs = [ROOT, ROOT / "data", ROOT / "bench", ROOT / "studies"]
    return sorted(rel(p) for d in dirs for p in d.glob("*.py") if "__main__" in text(p))


@pytest.fixture(scope="module")
def flags_of(request):
    """scripts -> the union of the flags their --help lists; each --help runs once per content (pytest's cache)."""
    cache, found = getattr(request.config, "cache", None), {}

    def key(script):
        if script == TORCHRUN:                              # keyed by the installed torch, without importing it
            return f"docs/help/torchrun/{importlib.metadata.version('torch')}"
        return f"docs/help/{script.replace('/', '_')}/{_help_key(ROOT / script)}"

    def load(scripts):
        todo = []
        for s in scripts:
            hit = cache.get(key(s), None) if cache is not None else None
            if hit is None:
                todo.append(s)
            else:
                found[s] = set(hit)
        for s, help_text in run_helps(todo).items():
            found[s] = help_flags(help_text)
            if cache is not None:
                cache.set(key(s), sorted(found[s]))

    load(runnable_scripts() + [TORCHRUN])

    def get(scripts):
        load([s for s in scripts if s not in found])
        return set().union(*(found[s] for s in scripts)) if scripts else set()
    return get


@pytest.fixture(scope="module")
def torchrun_flags(flags_of):
    return flags_of([TORCHRUN])


# --------------------------------------------------------------------------- reading the documents

def logical_lines(block):
    """Lines with their backslash continuations joined."""
    return re.sub(r"\\\n", " ", block).splitlines()


def code_blocks(md):
    """(language, body) of every fenced block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", md, re.S | re.M)]


def inline_code(md):
    prose = re.sub(r"^```.*?^```", "", md, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def commands(line, words=False):
    """(script, [flags]) for every `python <script>.py ...` and `torchrun ... <script>.py ...` in one line; with
    words, (script, [the words after it])."""
    found = []
    for m in PY_CMD.finditer(line):
        found.append((m.group(1), m.group(2).split() if words else FLAG.findall(m.group(2))))
    for m in TORCHRUN_CMD.finditer(line):
        parts = m.group(1).split()
        at = next((i for i, w in enumerate(parts) if w.endswith(".py")), None)
        if at is not None:
            found.append((parts[at], parts[at + 1:] if words else
                          [f for w in parts[at + 1:] for f in FLAG.findall(w)]))
    return found


def idle_keys(words):
    """The keys a detour.py command gives that do not act in its run (detour.py would refuse them), judged
    from the values it gives literally (a shell variable keeps the default)."""
    import detour
    values, given = dict(detour.DEFAULTS), []
    pairs = [w.split("=", 1) if "=" in w else [w, nxt] for w, nxt in zip(words, [*words[1:], ""])]
    for key, text in pairs:
        if key.startswith("--") and key[2:] in detour.DEFAULTS:
            given.append(key[2:])
            try:
                values[key[2:]] = detour.convert(key[2:], text, detour.DEFAULTS[key[2:]])
            except (SystemExit, ValueError):  # a variable ($OUT/...): its default stands
                pass
    return [k for k in given if detour.where_else(k, values)]


def scripts_in(body):
    """The repository's .py scripts a shell text names (run directly or through a variable)."""
    names = set(re.findall(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py)\b", body))
    return sorted(n for n in names if (ROOT / n).is_file())


def tools_in(body):
    return {t for t in EXTERNAL if re.search(rf"(?<![\w-]){re.escape(t)}(?![\w-])", body)}


def norm(script):
    return script[2:] if script.startswith("./") else script


def check_commands(where, lines, flags_of):
    problems = []
    for line in lines:
        for script, flags in commands(line):
            script = norm(script)
            if not (ROOT / script).is_file():
                problems.append(f"{where}: `{script}` does not exist ({line.strip()[:100]})")
                continue
            bad = [f for f in flags if f not in flags_of([script])]
            if bad:
                problems.append(f"{where}: {script} has no --{', --'.join(bad)} ({line.strip()[:100]})")
        for script, words in commands(line, words=True):
            if norm(script) == "detour.py" and (idle := idle_keys(words)):
                problems.append(f"{where}: detour.py would refuse --{', --'.join(idle)} there: it does not act "
                                f"({line.strip()[:100]})")
        for sh in BASH_CMD.findall(line):
            if not (ROOT / norm(sh)).is_file():
                problems.append(f"{where}: `bash {sh}`: no such script")
    return problems


def shell_scripts_run(body):
    """The text of the repository's shell scripts a text runs (bash x.sh, sbatch x.sbatch, source x.sh), with the
    files those source: their flags may come from the caller (ARGS="--data_dir ..." sbatch pretrain.sbatch)."""
    out = ""
    for name in set(re.findall(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:sh|sbatch))\b", body)):
        path = ROOT / name
        if path.is_file():
            out += text(path) + "\n" + sourced_text(path) + "\n"
    return out


def sourced_text(sh):
    """The files a shell script sources (`source "$(dirname "$0")/common.sh"`), concatenated."""
    out = ""
    for src in re.findall(r"(?:^|\s)(?:source|\.)\s+\"?(?:\$\(dirname[^)]*\)/)?([\w./-]+\.sh)", text(sh), re.M):
        for cand in (sh.parent / Path(src).name, ROOT / src):
            if cand.is_file():
                out += text(cand) + "\n"
                break
    return out


def union_problems(where, body, flags_of, torchrun_flags, sourced=""):
    """Every --flag token of a shell text against the union of the flags of what it runs."""
    sourced = sourced + "\n" + shell_scripts_run(body)
    scripts = scripts_in(body + "\n" + sourced)
    allowed = flags_of(scripts) | {"help"}
    both = body + "\n" + sourced
    if "torchrun" in both:
        allowed |= torchrun_flags
    for tool in tools_in(both):
        allowed |= EXTERNAL[tool]
    lines = [ln for ln in logical_lines(body) if not ln.lstrip().startswith("#SBATCH")]
    bad = sorted({f for ln in lines for f in FLAG.findall(ln)} - allowed)
    return [f"{where}: --{f} is a flag of none of {scripts or 'the scripts it runs'}" for f in bad]


# --------------------------------------------------------------------------- the tests

def test_commands_in_the_documents_name_real_scripts_and_flags(flags_of, torchrun_flags):
    problems = []
    for doc in DOCS:
        md = text(doc)
        for lang, body in code_blocks(md):
            if lang in ("bash", "sh", "shell", ""):
                problems += check_commands(rel(doc), logical_lines(body), flags_of)
            if lang in ("bash", "sh", "shell"):
                problems += union_problems(f"{rel(doc)} (bash block)", body, flags_of, torchrun_flags)
        problems += check_commands(rel(doc), inline_code(md), flags_of)
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not SHELL, reason="no study scripts yet")
def test_flags_in_the_study_scripts_belong_to_the_scripts_they_run(flags_of, torchrun_flags):
    problems = []
    for sh in SHELL:
        body = text(sh)
        problems += union_problems(rel(sh), body, flags_of, torchrun_flags, sourced_text(sh))
        problems += check_commands(rel(sh), logical_lines(body), flags_of)
    assert not problems, "\n".join(problems)


def slug(heading):
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    h = re.sub(r"[^\w\- ]", "", h.replace("`", ""))
    return h.replace(" ", "-")


def anchors(md):
    seen, out = {}, set()
    for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.sub(r"^```.*?^```", "", md, flags=re.S | re.M), re.M):
        s = slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def test_relative_links_resolve():
    problems = []
    for doc in DOCS:
        md = re.sub(r"^```.*?^```", "", text(doc), flags=re.S | re.M)
        md = re.sub(r"`[^`\n]*`", "", md)
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", md):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):              # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                problems.append(f"{rel(doc)}: link to {target}: no such file")
            elif frag and dest.suffix == ".md" and frag not in anchors(text(dest)):
                problems.append(f"{rel(doc)}: link to {target}: no heading #{frag} in {rel(dest)}")
    assert not problems, "\n".join(problems)


def test_python_snippets_compile_unless_marked_as_a_sketch():
    problems = []
    for doc in DOCS:
        for i, (lang, body) in enumerate(code_blocks(text(doc))):
            if lang != "python" or body.lstrip().startswith("# sketch"):
                continue
            try:
                compile(body, f"{rel(doc)} python block {i}", "exec")
            except SyntaxError as e:
                problems.append(f"{rel(doc)}: python block {i} does not compile ({e.msg}, line {e.lineno}); "
                                "fix it or mark it with a first line `# sketch: ...`")
    assert not problems, "\n".join(problems)


def test_readme_is_a_short_guide():
    md = text(ROOT / "README.md")
    words = len(md.split())
    assert words <= 2500, f"README.md has {words} words; at most 2,500 (move the detail into docs/)"
    head = "\n".join(md.splitlines()[:60])
    assert "detour.py --phase clm" in head and "python data/prepare.py" in head, "the quick start is not in 60 lines"
    assert "pytest" in head, "the test command is not in the first 60 lines"
    section = md.split("## What this repository found", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("|") and not re.match(r"\|[-| ]+\|$", r)][1:]
    assert 0 < len(rows) <= 10, f"the findings table has {len(rows)} rows; at most 10"
    unlinked = [r[:80] for r in rows if not re.search(r"\]\(docs/[^)]+\.md", r)]
    assert not unlinked, f"findings without a link to a document in docs/: {unlinked}"


def test_the_checker_catches_what_it_should(flags_of, torchrun_flags):
    """The checks themselves: a wrong flag (also one kept in a shell variable), a missing script, a heading's
    anchor are judged as they should be."""
    assert check_commands("x", ["python detour.py --phase clm --no_such_flag 1"], flags_of)
    assert check_commands("x", ["torchrun --standalone --nproc_per_node=1 detour.py --nope 3"], flags_of)
    assert check_commands("x", ["python detour.py --phase decay --init_from out/clm --max_tokens 9"], flags_of)
    assert check_commands("x", ["python detour.py --init_from out/x/hf --preset=base"], flags_of)
    assert not check_commands("x", ["python detour.py --phase decay --init_from out/clm --decay_ratio 0.2"], flags_of)
    assert check_commands("x", ["python bench/no_such_script.py --quick"], flags_of)
    assert not check_commands("x", ["python studies/analysis.py --analysis cka --ckpts a,b --seeds 2 && "
                                    "python data/prepare.py --input x"], flags_of)  # analysis.py: finetune.py's too
    assert check_commands("x", ["python finetune.py --analysis cka --ckpts a,b"], flags_of)  # moved to studies/
    assert check_commands("x", ["python studies/analysis.py --analysis cka --no_such_flag 1"], flags_of)
    assert union_problems("x", 'A="--phase clm --nope 1"\npython detour.py $A', flags_of, torchrun_flags)
    assert not union_problems("x", 'A="--phase clm"\ntorchrun --nnodes=2 detour.py $A', flags_of, torchrun_flags)
    assert "the-model" in anchors("# The model\n") and slug("The paper's recipe: at scale") == "the-papers-recipe-at-scale"
