"""Run the README's shell commands in order, exactly as written, and log each one's time, machine and load.

    python -m docs.readme_commands                # clone HEAD into runs/readme-commands (a fresh venv, an empty
                                                  # cache, no hub), run every command; log → docs/readme_commands/
    python -m docs.readme_commands --resume       # go on after a stop: the clone, its venv and finished commands kept
    python -m docs.readme_commands --quick DIR    # the same commands in this environment, in DIR, with a micro
                                                  # model and small token counts (tests/test_readme.py)

The commands are the lines of the README's ```bash blocks (a trailing `\\` joins lines, a comment after two spaces
is dropped). Each line either runs as written or is skipped for a stated reason (RULES: the CUDA install line on a
CPU machine, torchrun's 8 processes, the hours-long mutation run); the README's one placeholder model
(`path/to/your/model`) becomes the zoo model its neighbours use. The log is rewritten atomically after each command,
so a stop loses no finished command, and `docs.readme_results` writes the README's time estimates from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = ROOT / "docs" / "readme_commands" / "log.json"

# (pattern searched in the command, what to do): "run", or a reason to skip. First match wins; unmatched lines run.
RULES = [
    (r"^pip install torch==[\d.]+$", "the CUDA build's line, for a machine with an NVIDIA GPU (its CPU twin ran)"),
    (r"^torchrun ", "8 processes on a GPU node (`M` is your model); the suite runs torchrun's profile and train with "
                    "2 CPU processes (tests/test_profile.py, tests/test_train.py)"),
    (r"benchmarks\.mutations", "hours per module; docs/mutations.md holds its last run"),
]
# In --quick, also skipped: what the suite runs elsewhere or cannot run inside itself.
QUICK_RULES = [
    (r"^pip install", "the suite runs in an installed environment"),
    (r"pytest", "the suite itself"),
    (r"benchmarks\.run", "a timing run; tests/test_gpu_scripts.py runs its sections on CPU through gpu_check's smoke"),
    (r"docs\.readme_results", "tests/test_readme.py runs it"),
]
PLACEHOLDERS = {"path/to/your/model": "smollm2-135m"}
PYTHON_BLOCK = "python: the README's Python block"  # the log's name for it; it runs as `python -` in a fresh process


def commands(readme: str) -> list[str]:
    """Every command line of the README's ```bash blocks, in order, continuations joined, comments dropped; a
    ```python block is one command (PYTHON_BLOCK), run as a reader pastes it into a fresh interpreter."""
    out = []
    for kind, block in re.findall(r"```(bash|python)\n(.*?)```", readme, flags=re.S):
        if kind == "python":
            out.append(PYTHON_BLOCK)
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s{2,}#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(re.sub(r"\s+", " ", line))
    return out


def python_code(readme: str) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", readme, flags=re.S))


def plan(cmds: list[str], quick: bool = False, readme: str = "") -> list[dict]:
    """Each command with what runs ("run": the line to execute, or "skip": why not). A repeated line runs once;
    the Python block (from `readme`) runs as `python -` with the block on its input."""
    seen, rows = set(), []
    for cmd in cmds:
        if cmd == PYTHON_BLOCK:
            rows.append({"command": cmd, "skip": "tests/test_readme.py runs it verbatim"} if quick else
                        {"command": cmd, "run": f"python - <<'README_PYTHON'\n{python_code(readme)}\nREADME_PYTHON"})
            continue
        row = {"command": cmd}
        reason = next((r for p, r in RULES + (QUICK_RULES if quick else []) if re.search(p, cmd)), None)
        if cmd in seen and reason is None:
            reason = "ran above"
        seen.add(cmd)
        if reason:
            row["skip"] = reason
        else:
            run = cmd
            for old, new in PLACEHOLDERS.items():
                run = run.replace(old, new)
            row["run"] = run
        rows.append(row)
    return rows


def quick_line(cmd: str, model: str) -> str:
    """The command on a micro model with small token counts: what the suite runs. Every flag the README wrote is
    kept; the model, the presets and the budgets get small values in place (`--flag value` or `--flag=value`),
    and the budgets a command leaves at its default are added."""
    words = []
    for w in shlex.split(cmd):  # --flag=value as two words
        words += w.split("=", 1) if w.startswith("--") and "=" in w else [w]
    command = words[1] if words[:1] == ["diffquant"] and len(words) > 1 else None
    small = {"--model": model, "--preset": "micro", "--kurtosis-tokens": "256",
             "--tokens": "2048" if command == "train" else "512"}
    if command in ("profile", "quantize", "sweep"):
        small["--seq-len"] = "64"
    if command in ("quantize", "sweep"):
        small.update({"--calib-tokens": "256", "--eval-tokens": "256"})
    if command == "sweep":
        small["--mc-limit"] = "16"
    out, i = [], 0
    while i < len(words):
        if words[i] in small and i + 1 < len(words):
            out += [words[i], small.pop(words[i])]
            i += 2
        else:
            out.append(words[i])
            i += 1
    for flag in ("--seq-len", "--calib-tokens", "--eval-tokens", "--mc-limit"):  # defaults made small
        if flag in small:
            out += [flag, small[flag]]
    return shlex.join(out)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else \
        platform.processor()
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "system": platform.platform()}


def in_process(line: str, cwd: Path) -> tuple[int, str]:
    """A `diffquant ...` line through diffquant's command line in this process (--quick: one interpreter start for
    every command instead of one each), in `cwd`; (exit code, output)."""
    import contextlib
    import io
    import traceback

    from diffquant_cli import main as cli  # the `diffquant` command's entry point (pyproject's scripts)

    buf, here = io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                code = cli(shlex.split(line)[1:])
            except SystemExit as e:  # argparse's refusal, or --help
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                print(e.code if isinstance(e.code, str) else "")
            except Exception:  # noqa: BLE001 - recorded in the log with its traceback
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(here)
    return code, buf.getvalue()


def run_all(rows: list[dict], cwd: Path, env: dict, log: Path, doc: dict, shell_prefix: str = "",
            echo=print, here: bool = False, reused: bool = False) -> dict:
    """Run the rows' commands in order in `cwd`, skipping those the log already holds as passed (with --resume);
    a failure is recorded with its output's tail and the next command runs. The log is rewritten after each."""
    # one entry per row, in the README's order (a line the README repeats is one row that ran and one skipped,
    # so entries are kept by position, never looked up by their text alone); an earlier run's entry stays
    # logged until its command is reached again
    earlier = {r["command"]: r for r in doc.get("commands", []) if "skip" not in r}
    entries = [None if "skip" in row else earlier.get(row["command"]) for row in rows]
    doc["finished"] = False

    def put(i: int, entry: dict) -> None:
        entries[i] = entry
        doc["commands"] = [e for e in entries if e is not None]

    for i, row in enumerate(rows):
        done = earlier.get(row["command"], {})
        if "skip" in row or (done.get("rc") == 0 and done.get("run") == row["run"]):
            put(i, row if "skip" in row else done)
            continue
        echo(f"$ {row['run']}")
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        if here and row["run"].startswith("diffquant "):
            code, output = in_process(row["run"], cwd)
        else:
            p = subprocess.run(["bash", "-c", shell_prefix + row["run"]], cwd=cwd, env=env, capture_output=True,
                               text=True)
            code, output = p.returncode, p.stdout + p.stderr
        entry = {**row, "commit": doc.get("commit"), "rc": code, "seconds": round(time.perf_counter() - t0, 1),
                 "load_start": round(load0, 2), "load_end": round(os.getloadavg()[0], 2)}
        if code:
            entry["output_tail"] = output[-3000:]
        if reused:  # --resume in the clone an earlier run left: its venv installed, its caches filled
            entry["reused_clone"] = True
        put(i, entry)
        write_log(log, doc)
        echo(f"  exit {code} in {entry['seconds']:.0f} s (load {entry['load_start']} → {entry['load_end']})")
    doc["finished"] = True
    write_log(log, doc)
    return doc


def write_log(log: Path, doc: dict) -> None:
    """The log as JSON and, for a full run, as the Markdown table beside it (both rewritten after each command)."""
    from diffquant.paths import atomic_write_text

    atomic_write_text(log, json.dumps(doc, indent=1) + "\n")
    if "machine" in doc:
        atomic_write_text(log.with_suffix(".md"), markdown(doc))


def markdown(doc: dict) -> str:
    m = doc["machine"]
    commits = sorted({r["commit"][:12] for r in doc["commands"] if r.get("commit")})
    state = "" if doc.get("finished") else (" **This run has not finished: a command missing below, or stopped by a "
                                             "signal, has no measured time yet.**")
    lines = ["# The README's commands, run in order from a fresh clone\n",
             f"Commit {', '.join(commits) or doc['commit'][:12]}, {doc['date']}; {m['cpu']}, {m['cores']} cores, "
             f"Python {m['python']}; a fresh clone and venv, an empty diffquant cache (`DIFFQUANT_CACHE`), its own "
             "Hugging Face home, `HF_HUB_OFFLINE=1`; pip as this machine configures it (its package index, and a "
             "local wheel folder that holds torch's CPU build). Written by `python -m docs.readme_commands`; load is "
             f"the 1-minute load average at each command's start and end.{state}\n",
             "| command | exit | time | load | note |", "|---|---|---|---|---|"]
    for r in doc["commands"]:
        cmd = r["command"].replace("|", "\\|")
        if "skip" in r:
            lines.append(f"| `{cmd}` | | | | skipped: {r['skip']} |")
            continue
        note = "" if r["run"] == r["command"] or r["command"] == PYTHON_BLOCK else f"ran as `{r['run']}`"
        if r["rc"] < 0:
            note = (note + "; " if note else "") + f"stopped by signal {-r['rc']} before it finished"
        elif r["rc"]:
            tail = r.get("output_tail", "").strip().splitlines()
            note = (note + "; " if note else "") + "failed: " + (tail[-1].replace("|", "\\|") if tail else "")
        if r.get("reused_clone"):
            note += ("; " if note else "") + "run by --resume in the earlier run's clone (venv installed, caches warm)"
        if r.get("restored"):
            note += f" (entry restored {r['restored']})"
        lines.append(f"| `{cmd}` | {r['rc']} | {minutes(r['seconds'])} | {r['load_start']} → {r['load_end']} | "
                     f"{note} |")
    return "\n".join(lines) + "\n"


def minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--resume", action="store_true", help="keep the clone, its venv and the commands that passed")
    p.add_argument("--work", default="runs/readme-commands", help="the clone's folder (default runs/readme-commands)")
    p.add_argument("--quick", metavar="DIR", help="run in this environment in DIR, micro model, small token counts")
    p.add_argument("--rerun", action="append", default=[], metavar="TEXT",
                   help="with --resume: run again the commands that contain TEXT (repeatable), even if they passed")
    p.add_argument("--model", help="--quick: the micro model folder every --model becomes (required with --quick)")
    a = p.parse_args(argv)
    if a.quick:
        if not a.model:
            p.error("--quick needs --model: a small model folder with its tokenizer")
        rows = plan(commands((ROOT / "README.md").read_text()), quick=True)  # (the Python block: skipped)
        for row in rows:
            if "run" in row:
                row["run"] = quick_line(row["run"], a.model)
        out = Path(a.quick)
        out.mkdir(parents=True, exist_ok=True)
        os.environ["HF_HUB_OFFLINE"] = "1"
        doc = run_all(rows, out, dict(os.environ), out / "log.json", {"quick": True}, here=True)
        return 1 if any(r.get("rc") for r in doc["commands"]) else 0
    work = (ROOT / a.work).resolve()
    doc = json.loads(LOG.read_text()) if a.resume and LOG.is_file() else {}
    doc["commands"] = [r for r in doc.get("commands", []) if not any(t in r["command"] for t in a.rerun)]
    if work.exists() and not a.resume:
        raise SystemExit(f"{work} exists: remove it, or pass --resume")
    reused = work.exists()
    if not work.exists():  # a fresh clone of HEAD; on --resume (the earlier clone lost) its installs run again
        subprocess.run(["git", "clone", "-q", str(ROOT), str(work)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(work / ".venv")], check=True)
        if a.resume:
            doc["commands"] = [r for r in doc.get("commands", []) if not r["command"].startswith("pip ")]
    # the commands and the commit are the clone's: what ran, whatever the working tree here holds
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=work, capture_output=True, text=True).stdout.strip()
    doc.update(commit=commit, date=time.strftime("%Y-%m-%d"), machine=machine())
    # nothing of this environment's Python: not its venv on PATH (a failed install would run this checkout's
    # diffquant), not its caches
    venv_bin = os.path.join(os.environ.get("VIRTUAL_ENV", "/nonexistent"), "bin")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "DIFFQUANT_CACHE", "HF_HOME")}
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep) if d != venv_bin)
    env.update(DIFFQUANT_CACHE=str(work / "cache"), HF_HOME=str(work / "hf"), HF_HUB_OFFLINE="1")
    readme = (work / "README.md").read_text()
    doc = run_all(plan(commands(readme), readme=readme), work, env, LOG, doc, shell_prefix=". .venv/bin/activate && ",
                  reused=reused)
    return 1 if any(r.get("rc") for r in doc["commands"]) else 0


if __name__ == "__main__":
    sys.exit(main())
