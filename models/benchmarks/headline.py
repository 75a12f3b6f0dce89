"""The README's headline table, generated from the committed benchmark JSONs in ``bench/``.

Memory and speed come from the newest GPU report (:mod:`models.benchmarks.gpu_report`),
the newest frontier run per device (:func:`models.benchmarks.frontier.headline_rows`) and
the newest LM head run per device (:func:`models.benchmarks.lm_head.headline_rows`),
accuracy from the parity study (``bench/parity.json``) and the gradient audit
(``bench/accuracy.json``).  ``python -m models.benchmarks.headline`` rewrites the block
between ``<!-- headline:begin -->`` and ``<!-- headline:end -->`` in README.md; a test
keeps the README equal to what this prints.
"""
from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"

__all__ = ["markdown", "update_readme"]


def _source(path: str, doc: str) -> str:
  return f"[{pathlib.PurePosixPath(path).name}]({path}) · [docs](docs/{doc}.md)"


def _gpu_rows(report: dict, path: str) -> list[str]:
  """The headline's GPU rows from a GPU report (``path`` as linked): per model, peak memory
  and step time standard vs inverted, and the largest batch."""
  env = report["environment"]
  rows = []
  for g in report.get("models", []):
    std = g["peaks"]["standard"]["peak_bytes_in_use"]
    inv = g["peaks"]["inverted-all"]["peak_bytes_in_use"]
    t_std, t_inv = g["step_time_s"]["standard"], g["step_time_s"]["inverted-all"]
    what = f"{g['model']}, {g['dtype']}, batch {g['batch']}"
    rows.append(f"| memory: peak, {what} | {std / 2**30:.1f} GiB | {inv / 2**30:.1f} GiB "
                f"({inv / std - 1:+.0%}) | {env['device']}, JAX {env['versions']['jax']}, "
                f"{env['date']} | {_source(path, 'gpu-report')} |")
    rows.append(f"| speed: step, {what} | {t_std * 1e3:.1f} ms | {t_inv * 1e3:.1f} ms "
                f"({t_inv / t_std:.2f}×) | same run | {_source(path, 'gpu-report')} |")
  mb = report.get("max_batch")
  if mb:
    res = mb["results"]
    rows.append(f"| memory: largest batch, {mb['model']}, {mb['dtype']} | "
                f"{res['standard']['largest_fitting']} | {res['inverted-all']['largest_fitting']} | "
                f"same run | {_source(path, 'gpu-report')} |")
  return rows


def markdown(root: pathlib.Path = ROOT) -> str:
  """The headline table (markdown) from ``root/bench``."""
  from models.benchmarks import frontier
  from models.benchmarks import gpu_report
  from models.benchmarks import lm_head  # pylint: disable=import-outside-toplevel
  bench = root / "bench"
  lines = ["| figure | JAX default (`standard`) | invact_jax (`inverted-all`) | measured on | "
           "source |", "|---|---:|---:|---|---|"]
  # A report may hold only some sections (the frontier alone, say): the model rows come from
  # the newest report per device that measured the models.
  with_models = [p for p in bench.glob("gpu_*_????-??-??.json")
                 if json.loads(p.read_text()).get("models")]
  for p in gpu_report.newest_per_device(with_models):
    lines += _gpu_rows(json.loads(p.read_text()), f"bench/{p.name}")
  for p, data in frontier.newest_per_model(bench.glob("frontier_*_????-??-??.json")):
    lines += frontier.headline_rows(data, f"bench/{p.name}")
  lines += lm_head.headline_rows(root)
  parity = json.loads((bench / "parity.json").read_text())
  meta = parity["meta"]
  for task in sorted({r["task"] for r in parity["summary"]}):
    rows = [r for r in parity["summary"] if r["task"] == task and r["configuration"] == "inverted-all"
            and r["dtype"] == "float32"]
    for r in rows:
      unit = " pt" if r["diff_units"] == "points" else " %"
      lines.append(f"| accuracy: {task} {r['metric']}, float32, {r['seeds']} seeds | (baseline) | "
                   f"{r['diff_mean']:+.2f}{unit} ± {r['diff_ci95_half_width']:.2f} (95 % CI) | "
                   f"{meta['device']}, JAX {meta['versions']['jax']}, {meta['date']} | "
                   f"{_source('bench/parity.json', 'parity')} |")
  audit = json.loads((bench / "accuracy.json").read_text())
  def ratio(r):  # an exact backward (relu) has a floor and an error of 0
    return r["error"] / r["floor"] if r["floor"] else (0.0 if r["error"] == 0 else float("inf"))
  worst = max(audit, key=ratio)
  lines.append(f"| accuracy: gradient error vs float64, worst of {len(audit)} (op, dtype) | "
               f"the rounding floor | {ratio(worst):.2f}× floor ({worst['name']}, "
               f"{worst['dtype']}) | CPU | {_source('bench/accuracy.json', 'numerics')} |")
  return "\n".join(lines)


def update_readme(path: pathlib.Path = ROOT / "README.md") -> None:
  """Rewrite the headline block of ``path`` from the benchmark JSONs."""
  text = path.read_text()
  head, rest = text.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  path.write_text(head + BEGIN + "\n" + markdown(path.parent) + "\n" + END + tail)


if __name__ == "__main__":
  update_readme()
  sys.exit(0)
