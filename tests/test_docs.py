"""The documentation: the README's shape, the results index, the env docstrings' sections, the figures script, the
Sphinx build (offline, warnings as errors) and the built pages in a real browser (headless Chromium).

The build needs the ``docs`` extra (``pip install -e ".[docs]"``) and the browser test the Debian package
``chromium``; each is skipped, with the reason, where it is missing.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ENV_PAGES = ("environments/bild-v1.html", "environments/bild-serve-v0.html")
ENV_SECTIONS = ("Action Space", "Observation Space", "Rewards", "Starting State", "Episode End", "Arguments",
                "Version History")
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file; ValueError if it is not one."""
    head = path.read_bytes()[:24]
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG file")
    return struct.unpack(">II", head[16:24])


# ----------------------------------------------------------------------------------------------------------------
# without Sphinx
def test_readme_is_short_and_undated():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 300, "the README is the front page: keep it under 300 lines (details go to docs/)"
    assert not re.findall(r"20\d\d-\d\d-\d\d", text), "no dates in the README (dated notes go to docs/notes/)"
    assert not re.findall(r"\bphase \d+", text, flags=re.I), "no 'phase N' in the README (a diary goes to docs/notes/)"
    for command in ('pip install -e ".[test]" && python -m pytest -q', "python train.py --env serve"):
        assert command in text, f"the README shows {command!r}"


def test_readme_cites_existing_results_and_figure():
    text = (ROOT / "README.md").read_text()
    cited = set(re.findall(r"`([\w.-]+\.json)`", text))
    assert cited, "the README's results table names its JSON"
    missing = sorted(name for name in cited if not (ROOT / "results" / name).is_file())
    assert not missing, f"the README cites results that are not in results/: {missing}"
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        png_size(ROOT / image)


def indexed(name: str, index: str) -> bool:
    """``name`` is in the index: in backticks (a folder as ``name/``), or a plot or table beside its JSON
    (``X.png`` as "`X.json`, `.png`" on one line)."""
    if f"`{name}`" in index or f"`{name}/`" in index:
        return True
    stem, suffix = Path(name).stem, Path(name).suffix
    return any(f"`{stem}.json`" in line and f"`{suffix}`" in line for line in index.splitlines())


def test_results_index_lists_every_file():
    index = (ROOT / "results" / "README.md").read_text()
    entries = sorted(p.name for p in (ROOT / "results").iterdir() if p.name != "README.md")
    missing = [name for name in entries if not indexed(name, index)]
    assert not missing, f"results/README.md does not index: {missing} (add a row saying what each measured)"


@pytest.mark.parametrize("path", ["bild_env.env.BildEnv", "bild_env.serving.env.ServingEnv"])
def test_env_docstrings_have_gymnasium_sections(path):
    """The env pages are generated from these docstrings: every section must be there, as a '## ' heading."""
    module, name = path.rsplit(".", 1)
    doc = getattr(__import__(module, fromlist=[name]), name).__doc__
    headings = re.findall(r"^\s*## +(.+?)\s*$", doc, flags=re.M)
    assert [h for h in headings if h in ENV_SECTIONS] == list(ENV_SECTIONS)


def test_make_figures_reruns(tmp_path):
    spec = importlib.util.spec_from_file_location("make_figures_under_test", ROOT / "scripts" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path)]) == 0
    for figure in module.FIGURES:
        width, height = png_size(tmp_path / figure.name)
        assert width > 100 and height > 100
        committed = DOCS / "_static" / "figures" / figure.name
        assert committed.is_file(), f"{committed} is missing: run python -m scripts.build_assets figures"
        assert png_size(committed) == (width, height)


# ----------------------------------------------------------------------------------------------------------------
# the Sphinx build and the browser
@pytest.fixture(scope="module")
def built_docs(tmp_path_factory) -> Path:
    for module in ("sphinx", "myst_parser", "furo"):
        pytest.importorskip(module, reason=f"the docs build needs {module}: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("docs-html")
    run = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"sphinx-build -W failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    return out


def test_docs_build_offline_with_warnings_as_errors(built_docs):
    for page in ("index.html", "training.html", "evaluation.html", "results.html", "reproducing.html",
                 "changelog.html", *ENV_PAGES):
        assert (built_docs / page).is_file(), page
    training = (built_docs / "training.html").read_text()
    assert "paired_actions" in training and "--total-timesteps" in training  # the generated option tables


def chromium() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless Chromium (apt-get install chromium): the browser test of the docs is skipped")


def render(browser: str, url: str, *extra: str) -> str:
    """The DOM of ``url`` after the page (and its frames) loaded and ran its scripts."""
    run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          "--virtual-time-budget=10000", *extra, "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout, f"{browser} could not render {url}: {run.stderr[-2000:]}"
    return run.stdout


HARNESS = """<!DOCTYPE html><html><body>
<iframe id="page" src="{url}" width="1280" height="4000"></iframe>
<script>
document.getElementById("page").addEventListener("load", function () {{
  var out = {{headings: [], images: []}};
  try {{
    var d = this.contentDocument;
    d.querySelectorAll("h1, h2, h3").forEach(function (h) {{ out.headings.push(h.textContent.replace("\\u00b6", "").trim()); }});
    d.querySelectorAll("article img").forEach(function (i) {{
      out.images.push({{src: i.getAttribute("src"), complete: i.complete, width: i.naturalWidth, height: i.naturalHeight}});
    }});
  }} catch (e) {{ out.error = String(e); }}
  var pre = document.createElement("pre"); pre.id = "result"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}});
</script></body></html>
"""


@pytest.mark.parametrize("page", ENV_PAGES)
def test_env_page_in_a_browser(built_docs, page, tmp_path):
    """Chromium loads the env page: its Gymnasium headings are there and its figure is a real PNG it drew."""
    browser = chromium()
    url = (built_docs / page).as_uri()
    dom = render(browser, url)  # the page alone: headings, and <img> files that exist and are PNGs
    for section in ("Action Space", "Observation Space", "Rewards"):
        assert re.search(rf"<h2[^>]*>\s*{section}\s*<", dom), f"{page}: no '{section}' heading in the rendered DOM"
    sources = re.findall(r"<img[^>]*\ssrc=\"([^\"]+)\"", dom)
    assert sources, f"{page}: no figure"
    for src in sources:
        assert png_size((built_docs / page).parent / src) > (0, 0)
    harness = tmp_path / "harness.html"  # the page in a frame: what the browser really decoded
    harness.write_text(HARNESS.format(url=url))
    dom = render(browser, harness.as_uri(), "--allow-file-access-from-files")
    match = re.search(r'<pre id="result">(.*?)</pre>', dom, flags=re.S)
    assert match, f"the harness did not report on {page}"
    seen = json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert "error" not in seen, seen.get("error")
    assert {"Action Space", "Observation Space", "Rewards"} <= set(seen["headings"]), seen["headings"]
    drawn = [i for i in seen["images"] if i["complete"] and i["width"] > 0 and i["height"] > 0]
    assert drawn, f"{page}: the browser drew no figure: {seen['images']}"


def test_the_assets_are_rebuilt_through_one_command(capsys):
    """``python -m scripts.build_assets <asset>`` runs that asset's builder with the options after its name; an
    unknown asset gets the usage, exit 2."""
    from scripts import build_assets

    assert build_assets.main(["nope"]) == 2
    assert "usage: python -m scripts.build_assets {wiki,humaneval,chat,tokenizer,profiles,figures}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        build_assets.main(["profiles", "--help"])
    assert stop.value.code == 0 and "usage: python -m scripts.build_assets profiles" in capsys.readouterr().out
