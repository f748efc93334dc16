"""The docs cannot drift from the code: the config reference is regenerated and compared, every config field
and ``jaxtron.*`` name the docs mention exists, relative links resolve, and the README's quick start stands."""

import dataclasses
import importlib.util
import os
import re

import pytest

import jaxtron
from jaxtron import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO, "docs")
PAGES = ["index.md", "install.md", "api.md", "config.md", "parallelism.md", "data.md", "checkpoints.md",
         "multihost.md", "planner.md", "kernels.md", "moe.md"]
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


@pytest.mark.parametrize("path", _markdown_files(), ids=os.path.basename)
def test_config_fields_mentioned_exist(path):
    fields = _fields()
    pattern = re.compile(rf"^({'|'.join(SECTIONS)})\.([a-z_][a-z0-9_.]*?)(=\S*)?[,.;:)]*$")
    spans = re.findall(r"`([^`\n]+)`", _read(path)) + re.findall(r"```\n(.*?)```", _read(path), re.S)
    unknown = set()
    for span in spans:
        for token in re.split(r"[\s\"']+", span):
            m = pattern.match(token)
            if m and f"{m.group(1)}.{m.group(2)}" not in fields:
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
