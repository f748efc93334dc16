"""The code the docs show runs: fenced snippets in README.md and docs/*.md marked runnable are executed here.

The convention (for whoever writes docs): the line right before a fenced block that a reader could run says
what it is, in an HTML comment (invisible on GitHub):

    <!-- snippet: run -->                          the tests run it (below)
    <!-- snippet: illustrative: <reason> -->       not run; the reason says why (needs a GPU, an 8B model, ...)

Every ```python block and every block with a command line (``python ...``, ``pip ...``, ``scripts/...``,
``sbatch``, ``srun``, ``mpirun``, ``VAR=value ...``) must carry one of the two, so a new snippet cannot slip in
unrun by omission; output, file trees and formulas need none.

How a runnable snippet runs:

- Python: the page's runnable blocks in order, in one namespace (a page's examples share their variables, as
  docs/api.md says), in a fresh working directory holding the files the snippets name (``docs.jsonl``,
  ``some_file.py``, tiny Hugging Face Llamas at ``hf/Llama-3.2-1B`` and ``path/to/Llama-3-8B``). Small shapes:
  ``jaxtron.load_config`` appends :data:`SMALL` to the snippet's own overrides (2 train steps, sequences of 32,
  global batch 8, one eval batch, no TensorBoard; and a 2-layer width-64 model for the tiny preset), so the
  snippets keep their real text; everything else is the snippet as written.
- Shell: each command (``\\`` continuations joined, ``#`` comments dropped) runs in bash in such a directory and
  must exit 0. Shell snippets that train are illustrative unless their own text keeps them tiny
  (``train.steps`` small): the CLI's training runs are tested in tests/test_train_run.py.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))
                              if os.path.basename(p) != "config.md")  # config.md is generated
MARK = re.compile(r"^<!-- snippet: (run|illustrative)(?:: (.*?))? -->$")
FENCE = re.compile(r"^(\s*)```(.*)$")
COMMAND = re.compile(r"^(python3? |pip |scripts/\S+\.(sh|py)\b|sbatch |srun |mpirun |[A-Z][A-Z0-9_]*=\S* )")
SMALL = {"train.steps": 2, "data.seq_len": 32, "train.global_batch_size": 8, "train.micro_batch_size": None,
         "train.eval_batches": 1, "logging.tensorboard": False, "logging.progress": False}
# and for the tiny preset (not for a config whose model is a checkpoint's, e.g. an imported one), a smaller model
SMALL_TINY = {"model.hidden_size": 64, "model.num_layers": 2, "model.intermediate_size": 128}
# the snippets users copy first: these must be runnable (and so run)
MUST_RUN = {"README.md": ("import jaxtron",), "docs/api.md": ("",)}


@dataclasses.dataclass
class Snippet:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: str | None  # "run", "illustrative" or None
    reason: str | None

    def __str__(self):
        return f"{self.page}:{self.line}"

    @property
    def is_code(self) -> bool:
        lines = [ln.strip().lstrip("#").strip() for ln in self.text.splitlines()]
        return self.lang in ("python", "bash", "sh", "shell") or any(COMMAND.match(ln) for ln in lines)


def snippets(page: str) -> list[Snippet]:
    lines = open(os.path.join(REPO, page)).read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        mark = MARK.match(lines[i - 1].strip()) if i else None
        out.append(Snippet(page, i + 1, m.group(2).strip().split(" ")[0], "\n".join(lines[i + 1:end]),
                           mark.group(1) if mark else None, mark.group(2) if mark else None))
        i = end + 1
    return out


ALL = [s for page in PAGES for s in snippets(page)]


def test_every_code_snippet_says_whether_it_runs():
    unmarked = [str(s) for s in ALL if s.is_code and s.mark is None]
    assert not unmarked, f"code snippets without <!-- snippet: run --> or <!-- snippet: illustrative: why -->: {unmarked}"
    no_reason = [str(s) for s in ALL if s.mark == "illustrative" and not (s.reason or "").strip()]
    assert not no_reason, f"illustrative snippets must say why they are not run: {no_reason}"
    for page in PAGES:  # a marker must sit right above a fence, or it marks nothing
        lines = open(os.path.join(REPO, page)).read().split("\n")
        for n, line in enumerate(lines):
            if line.strip().startswith("<!-- snippet"):
                assert MARK.match(line.strip()), f"{page}:{n + 1}: malformed snippet marker {line!r}"
                assert n + 1 < len(lines) and FENCE.match(lines[n + 1]), f"{page}:{n + 1}: marker without a fence"


def test_the_snippets_users_copy_are_runnable():
    for page, starts in MUST_RUN.items():
        python = [s for s in ALL if s.page == page and s.lang == "python" and s.text.startswith(starts)]
        assert python, f"{page}: no Python snippet starting with {starts}"
        assert all(s.mark == "run" for s in python), [f"{s}: {s.mark}" for s in python if s.mark != "run"]


# ------------------------------------------------------------------------------------------- running them


def _tiny_hf_llama(path: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def _workdir(tmp_path, texts: str):
    """A working directory with the files ``texts`` (the snippets) name."""
    work = tmp_path / "work"
    work.mkdir()
    if "docs.jsonl" in texts:
        rows = [{"text": f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 20} for i in range(20)]
        (work / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if "some_file.py" in texts:  # one evaluation batch of 8 windows of 128 bytes
        (work / "some_file.py").write_text("".join(f"def f{i}(x):\n    return x * {i} + 1\n\n\n" for i in range(40)))
    for hf_dir in ("hf/Llama-3.2-1B", "path/to/Llama-3-8B"):
        if hf_dir in texts:
            _tiny_hf_llama(str(work / hf_dir))
    return work


def _small_configs(monkeypatch):
    """``jaxtron.load_config`` with :data:`SMALL` after the caller's overrides."""
    import jaxtron

    real = jaxtron.load_config

    def load_config(path=None, overrides=(), **kw):
        small = {**SMALL, **(SMALL_TINY if path in (None, "tiny") else {})}
        if isinstance(overrides, Mapping):
            overrides = {**overrides, **small}
        else:
            overrides = ([overrides] if isinstance(overrides, str) else list(overrides)) + [
                f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}" for k, v in small.items()]
        return real(path, overrides, **kw)

    monkeypatch.setattr(jaxtron, "load_config", load_config)


RUN_PY = sorted({s.page for s in ALL if s.mark == "run" and s.lang == "python"})
RUN_SH = [s for s in ALL if s.mark == "run" and s.lang != "python"]


@pytest.mark.parametrize("page", RUN_PY)
def test_python_snippets_run(page, tmp_path, monkeypatch):
    blocks = [s for s in ALL if s.page == page and s.mark == "run" and s.lang == "python"]
    monkeypatch.chdir(_workdir(tmp_path, "\n".join(s.text for s in blocks)))
    _small_configs(monkeypatch)
    namespace: dict = {"__name__": "__snippet__"}
    for s in blocks:
        try:
            exec(compile(s.text, str(s), "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"the snippet at {s} fails: {type(err).__name__}: {err}") from err


def _commands(text: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", text)
    return [c for c in (re.sub(r"\s+#.*$", "", ln).strip() for ln in joined.splitlines())
            if c and not c.startswith("#")]


@pytest.mark.parametrize("snippet", RUN_SH, ids=str)
def test_shell_snippets_run(snippet, tmp_path):
    work = _workdir(tmp_path, snippet.text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    for command in _commands(snippet.text):
        command = re.sub(r"^python3? ", f"{sys.executable} ", command)
        done = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{snippet}: `{command}` exited {done.returncode}:\n{done.stderr[-2000:]}"
