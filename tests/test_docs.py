"""README is the front door: short, its links resolve, its headline table is generated from
the committed benchmarks; docs/ holds the topic pages (their examples run as doctests)."""
import pathlib
import re

from models.benchmarks import headline

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_short():
  assert len(README.splitlines()) <= 300


def test_links_resolve_and_every_page_is_linked():
  for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
      if "://" in target:
        continue
      assert (page.parent / target).exists(), f"{page.name}: broken link {target}"
  linked = set(re.findall(r"\]\(docs/([^)]+\.md)\)", README))
  assert linked == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_headline_block_is_generated_from_the_committed_benchmarks():
  block = README.split(headline.BEGIN + "\n", 1)[1].split(headline.END, 1)[0]
  assert block.strip() == headline.markdown(ROOT).strip()


def test_one_example_per_entry_point():
  for entry in ("invact_jax.gelu", "invact_jax.flax", "invact_jax.invert", "planner.solve",
                "scripts/train_vit.py"):
    assert entry in README, entry


def test_lm_head_tables_are_generated_from_the_committed_benchmarks():
  from models.benchmarks import lm_head  # pylint: disable=import-outside-toplevel
  page = (ROOT / "docs" / "lm-head.md").read_text()
  assert len(lm_head.DOCS_BLOCK.findall(page)) >= 2
  assert page == lm_head.render_docs(page, ROOT), "python -m models.benchmarks.lm_head"


def test_deviceless_tables_are_generated_from_the_committed_predictions():
  from models.benchmarks import frontier_deviceless  # pylint: disable=import-outside-toplevel
  page = (ROOT / "docs" / "deviceless.md").read_text()
  assert len(frontier_deviceless.DOCS_BLOCK.findall(page)) >= 4
  assert page == frontier_deviceless.render_docs(page, ROOT), (
      "python scripts/frontier_deviceless.py --docs")
