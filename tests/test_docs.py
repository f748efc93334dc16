"""The docs cannot drift from the code: the config reference is regenerated and compared, every config field
and ``jaxtron.*`` name the docs mention exists, relative links resolve, the README's quick start stands, and the
lists the docs keep of things the code defines are complete: presets, packages, Hugging Face architectures,
mesh axes, the rules table and the PartitionSpec it produces. (The snippets themselves run in
tests/test_doc_snippets.py.)"""

import dataclasses
import glob
import importlib.util
import os
import re

import pytest

import jaxtron
from jaxtron import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")
PAGES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(DOCS, "*.md")))
SECTIONS = tuple(f.name for f in dataclasses.fields(config_lib.Config))


def _read(path):
    with open(path) as f:
        return f.read()


def _markdown_files():
    return [os.path.join(DOCS, p) for p in PAGES] + [os.path.join(REPO, "README.md")]


def test_config_reference_is_generated_from_the_code():
    assert _read(os.path.join(DOCS, "config.md")) == config_lib.reference_markdown(), \
        "docs/config.md is stale: run python scripts/gen_config_reference.py"
    spec = importlib.util.spec_from_file_location("gen", os.path.join(REPO, "scripts", "gen_config_reference.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.main(["--check"]) == 0
    text = config_lib.reference_markdown()
    for name, _, _ in config_lib.fields_help():
        assert f"| `{name}` |" in text  # every field has its row


@pytest.mark.parametrize("page", PAGES)
def test_every_page_exists_and_links_resolve(page):
    path = os.path.join(DOCS, page)
    text = _read(path)
    assert text.startswith("# ")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert os.path.exists(os.path.normpath(os.path.join(DOCS, target))), f"{page}: broken link {target}"


def test_readme_quick_start_and_links():
    text = _read(os.path.join(REPO, "README.md"))
    assert "pip install -e . && python -m jaxtron.train\n" in text
    assert 'pip install -e ".[test]" && python -m pytest -n 2 tests\n' in text
    for target in re.findall(r"\]\(([^)#\s]+)\)", text):
        if "://" not in target:
            assert os.path.exists(os.path.join(REPO, target)), f"README: broken link {target}"


def _fields():
    names = {name for name, _, _ in config_lib.fields_help()}
    return names | {n.rsplit(".", 1)[0] for n in names}  # and the nested sections (model.rope_scaling)


def _names_a_module(section: str, rest: str) -> bool:
    """``parallel.pipeline.value_and_grad`` names jaxtron.parallel.pipeline's function, not a config field."""
    first = rest.split(".")[0]
    return os.path.exists(os.path.join(REPO, "jaxtron", section, first + ".py")) or os.path.isdir(
        os.path.join(REPO, "jaxtron", section, first))


@pytest.mark.parametrize("path", _markdown_files(), ids=os.path.basename)
def test_config_fields_mentioned_exist(path):
    fields = _fields()
    pattern = re.compile(rf"^({'|'.join(SECTIONS)})\.([a-z_][a-z0-9_.]*?)(=\S*)?[,.;:)]*$")
    spans = re.findall(r"`([^`\n]+)`", _read(path)) + re.findall(r"```\n(.*?)```", _read(path), re.S)
    unknown = set()
    for span in spans:
        for token in re.split(r"[\s\"']+", span):
            m = pattern.match(token)
            if m and f"{m.group(1)}.{m.group(2)}" not in fields and not _names_a_module(m.group(1), m.group(2)):
                unknown.add(token)
    assert not unknown, f"{os.path.basename(path)} mentions config fields that do not exist: {sorted(unknown)}"


def test_api_names_mentioned_exist():
    text = "".join(_read(p) for p in _markdown_files())
    for dotted in sorted(set(re.findall(r"\bjaxtron\.[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_]", text))):
        obj = jaxtron
        for part in dotted.split(".")[1:]:
            if not hasattr(obj, part) and hasattr(obj, "__path__"):  # a subpackage not imported yet
                importlib.util.find_spec(f"{obj.__name__}.{part}") and importlib.import_module(f"{obj.__name__}.{part}")
            assert hasattr(obj, part), f"docs mention {dotted}, which does not exist"
            obj = getattr(obj, part)
    assert set(jaxtron.__all__) <= set(re.findall(r"`([A-Za-z_]+)`", _read(os.path.join(DOCS, "api.md"))))


# ---------------------------------------------------------------------------------------------------------------
# Lists the docs keep of things the code defines
# ---------------------------------------------------------------------------------------------------------------


def _block_after(text: str, heading: str) -> str:
    """The first fenced block after ``heading``."""
    return re.search(re.escape(heading) + r".*?```\n(.*?)```", text, re.S).group(1)


def test_every_page_is_in_the_index_and_the_readme():
    index = _read(os.path.join(DOCS, "index.md"))
    missing = [p for p in PAGES if p != "index.md" and f"]({p})" not in index]
    assert not missing, f"docs/index.md's table of pages lacks {missing}"
    readme = _read(os.path.join(REPO, "README.md")).split("## Documentation")[1].split("\n## ")[0]
    missing = [p for p in PAGES if f"](docs/{p})" not in readme]
    assert not missing, f"README's Documentation section lacks {missing}"


def test_every_preset_is_listed():
    presets = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(REPO, "configs", "*.yaml")))
    readme = _read(os.path.join(REPO, "README.md"))
    listed = re.search(r"Presets live in\s+`configs/` \((.*?)\)\. A bad value", readme, re.S).group(1)
    assert not [p for p in presets if f"`{p}`" not in listed], "README's preset list lacks some configs/*.yaml"
    index = _block_after(_read(os.path.join(DOCS, "index.md")), "## Code layout")
    line = index[index.index("configs/"):]
    assert not [p for p in presets if not re.search(rf"\b{p}\b", line)], "docs/index.md's presets lack some"


def test_every_package_is_in_the_code_layout():
    packages = sorted(f"jaxtron/{os.path.basename(os.path.dirname(p))}/"
                      for p in glob.glob(os.path.join(REPO, "jaxtron", "*", "__init__.py")))
    for path, heading in [(os.path.join(REPO, "README.md"), "## Layout"),
                          (os.path.join(DOCS, "index.md"), "## Code layout")]:
        block = _block_after(_read(path), heading)
        missing = [p for p in packages if p not in block]
        assert not missing, f"{os.path.basename(path)}'s code layout lacks {missing}"


def test_every_hugging_face_architecture_is_named():
    from jaxtron.convert.hf.config import ARCHITECTURES

    names = [a.removesuffix("ForCausalLM").replace("Moe", "-MoE") for a in ARCHITECTURES]
    readme, index = _read(os.path.join(REPO, "README.md")), _read(os.path.join(DOCS, "index.md"))
    places = {"README's layout": _block_after(readme, "## Layout"),
              "docs/index.md's layout": _block_after(index, "## Code layout"),
              "docs/index.md's convert command": next(ln for ln in index.splitlines() if "jaxtron.convert" in ln),
              "README's intro": readme[:readme.index("## Quick start")],
              "docs/index.md's intro": index[:index.index("| page |")]}
    for place, text in places.items():
        missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b(?!-)", text)]
        if "intro" in place:  # the intros name the families: Llama 2/3, Qwen2, dense Qwen3, ...
            missing = [n for n in missing if n not in ("Llama",)]
        assert not missing, f"{place} does not name {missing}"


def test_mesh_axes_in_the_docs_are_the_code_s():
    from jaxtron.parallel.axes import AXES

    text = "".join(_read(p) for p in _markdown_files())
    for listing in re.findall(r"\(('[a-z]+'(?:,\s*#?\s*'[a-z]+')+)\)", text):
        axes = tuple(re.findall(r"'([a-z]+)'", listing))
        if "stage" in axes and "tensor" in axes:  # a listing of the mesh axes
            assert axes == AXES, f"the docs list the mesh axes as {axes}; the code's are {AXES}"
    parallelism = _read(os.path.join(DOCS, "parallelism.md"))
    table = re.findall(r"^\| `([a-z]+)` \| `parallel\.([a-z]+)` \|", parallelism, re.M)
    assert tuple(a for a, _ in table) == AXES and all(a == f for a, f in table), table
    assert f"The mesh has {len(AXES)} axes" in parallelism
    for intro in (_read(os.path.join(REPO, "README.md")).split("## Quick start")[0],
                  _read(os.path.join(DOCS, "index.md")).split("| page |")[0]):
        for axis in AXES:  # the intros name every kind of parallelism
            assert {"stage": "pipeline", "fsdp": "FSDP"}.get(axis, axis) in intro, axis


def _rules_table() -> dict[str, tuple[str, ...]]:
    """docs/parallelism.md's rules table: logical name -> the mesh axes its row names (() for replicated)."""
    section = _read(os.path.join(DOCS, "parallelism.md")).split("## The rules table")[1].split("\n## ")[0]
    rows = {}
    for names, axes in re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", section, re.M):
        for name in re.findall(r"`([a-z_]+)`", names):
            assert name not in rows, f"docs/parallelism.md's rules table lists {name} twice"
            rows[name] = tuple(re.findall(r"`([a-z]+)`", axes))
    return rows


def test_the_rules_table_in_the_docs_is_the_code_s():
    from jaxtron.config.schema import ParallelConfig
    from jaxtron.parallel.rules import logical_rules

    code = {}
    for name, axes in logical_rules(ParallelConfig()):
        code[name] = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    assert _rules_table() == code


def test_the_partition_spec_in_the_docs_is_the_code_s():
    """parallelism.md prints the sharding of the first attention weight under fsdp 4 x tensor 2."""
    from flax import nnx

    from jaxtron.model.llama import Llama
    from jaxtron.parallel.layout import Layout
    from jaxtron.parallel.sharding import logical_names, logical_to_spec

    text = _read(os.path.join(DOCS, "parallelism.md"))
    documented = re.search(r"wq\[\.\.\.\]\.sharding\.spec\)\s+# (P\(.*?\)):", text).group(1)
    cfg = config_lib.load("tiny", ["parallel.data=1", "parallel.fsdp=4", "parallel.tensor=2"])
    names = logical_names(nnx.state(nnx.eval_shape(lambda: Llama(cfg.model, rngs=nnx.Rngs(0)))))
    spec = logical_to_spec(tuple(names["layers"]["attention"]["wq"]), Layout.planned(cfg, 8).rules)
    assert documented == repr(spec).replace("PartitionSpec", "P"), (documented, spec)


def test_repository_paths_mentioned_exist():
    """Every file or folder of the repository the docs name (``jaxtron/parallel/rules.py``, ``tests/...``)."""
    pattern = re.compile(r"(?<![\w/.-])((?:jaxtron|tests|scripts|configs|pallas_kernels|examples)/[\w./<>*{}-]*[\w/])")
    for path in _markdown_files():
        missing = sorted({p for p in pattern.findall(_read(path))
                          if not any(c in p for c in "<>*{}") and not os.path.exists(os.path.join(REPO, p))})
        assert not missing, f"{os.path.basename(path)} names paths that do not exist: {missing}"
